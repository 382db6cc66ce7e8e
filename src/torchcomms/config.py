"""Every environment variable the library reads, parsed in one place with upstream's rules."""

from __future__ import annotations

import os
from datetime import timedelta

_TRUE = {"1", "true", "yes", "y"}
_FALSE = {"0", "false", "no", "n"}


def parse_bool(name: str, value: str) -> bool:
    """Parse a boolean env value (case-insensitive, trimmed); anything else is an error."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise RuntimeError(
        f"Invalid value for environment variable {name}: {value!r} "
        "(expected one of 1/true/yes/y or 0/false/no/n)"
    )


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return parse_bool(name, value)


def env_str(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def default_timeout() -> timedelta:
    """``TORCHCOMM_TIMEOUT_SECONDS`` (a positive integer), else 600 s.

    Zero is refused: every wait in this library has a deadline.
    """
    raw = os.environ.get("TORCHCOMM_TIMEOUT_SECONDS")
    if raw is None or raw.strip() == "":
        return timedelta(seconds=600)
    try:
        seconds = int(raw.strip())
    except ValueError:
        raise RuntimeError(
            f"Invalid value for environment variable TORCHCOMM_TIMEOUT_SECONDS: {raw!r} "
            "(expected a positive integer number of seconds)"
        ) from None
    if seconds <= 0:
        raise RuntimeError(
            f"Invalid value for environment variable TORCHCOMM_TIMEOUT_SECONDS: {raw!r} "
            "(expected a positive integer number of seconds)"
        )
    return timedelta(seconds=seconds)


def default_abort_on_error() -> bool:
    return env_bool("TORCHCOMM_ABORT_ON_ERROR", True)


def ranksize_query_method() -> str:
    method = (os.environ.get("TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD") or "auto").strip().lower()
    if method not in ("auto", "torchrun", "mpi", "pals"):
        raise RuntimeError(
            "Invalid TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD "
            f"{method!r}: expected one of auto, torchrun, mpi, pals"
        )
    return method


def env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None


def gloo_hostname() -> str | None:
    return env_str("TORCHCOMM_GLOO_HOSTNAME")


def gloo_interface() -> str | None:
    return env_str("TORCHCOMM_GLOO_INTERFACE")


def master_addr_port() -> tuple[str | None, int | None]:
    return env_str("MASTER_ADDR"), env_int("MASTER_PORT")


def gloo_lazy_init(hint: str | None) -> bool:
    """Whether gloo connects a pair at its first op (hint ``lazy``, else
    ``TORCHCOMM_GLOO_LAZY_INIT``; default on, as upstream's) or every pair at connect.

    Lazy saves a full mesh of sockets and store traffic per rank (``docs/scale.md``);
    ``lazy=false`` / ``TORCHCOMM_GLOO_LAZY_INIT=0`` connects eagerly.
    """
    if hint is not None:
        return parse_bool("hint lazy", hint)
    return env_bool("TORCHCOMM_GLOO_LAZY_INIT", True)


def store_counts() -> bool:
    """``TORCHCOMM_STORE_COUNTS``: count every store operation of new comms (``store_counts``)."""
    return env_bool("TORCHCOMM_STORE_COUNTS", False)


def store_path() -> str | None:
    """``TORCHCOMM_STORE_PATH``: bootstrap through a FileStore at this path instead of TCP."""
    return env_str("TORCHCOMM_STORE_PATH")


def torchelastic_agent_store() -> bool:
    """True under torchrun when its agent already serves a TCPStore on ``MASTER_PORT``."""
    raw = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    return raw is not None and raw.strip().lower() == "true"


def object_serialization() -> str:
    """``TORCHCOMMS_SERIALIZATION``: ``pickle`` or (default) ``torch`` (torch.save/torch.load)."""
    raw = (os.environ.get("TORCHCOMMS_SERIALIZATION") or "torch").strip().lower()
    return "pickle" if raw == "pickle" else "torch"


# -- observability (flight recorder, event log, collective check) -------------------------------
FR_DEFAULT_BUFFER_SIZE = 2000
FR_DEFAULT_DUMP_PREFIX = "/tmp/torchcomm_fr/rank_"


def fr_buffer_size() -> int:
    """``TORCHCOMM_FR_BUFFER_SIZE``: entries of the always-on flight recorder (0 turns it off)."""
    value = env_int("TORCHCOMM_FR_BUFFER_SIZE")
    return FR_DEFAULT_BUFFER_SIZE if value is None else max(value, 0)


def fr_dump_prefix() -> str:
    """``TORCHCOMM_FR_DUMP_TEMP_FILE``: flight-recorder dumps go to ``<prefix><rank>``.

    Read at every write, so ``TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME`` (upstream's switch for
    that) is always in effect.
    """
    return env_str("TORCHCOMM_FR_DUMP_TEMP_FILE") or FR_DEFAULT_DUMP_PREFIX


def fr_dump_on_signal() -> bool | None:
    """``TORCHCOMM_FR_DUMP_ON_SIGUSR1``: dump the recorder on SIGUSR1.

    True/False force it on/off; unset (or ``auto``) means "on unless SIGUSR1 already has a
    handler" (``None`` here; the recorder decides).
    """
    raw = os.environ.get("TORCHCOMM_FR_DUMP_ON_SIGUSR1")
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    return parse_bool("TORCHCOMM_FR_DUMP_ON_SIGUSR1", raw)


def fr_auto_dump() -> bool:
    """``TORCHCOMM_FR_DUMP_ON_ERROR``: dump on timeout / peer failure / abort (default on)."""
    return env_bool("TORCHCOMM_FR_DUMP_ON_ERROR", True)


def fr_stack() -> bool:
    """``TORCHCOMM_FR_STACK``: record the issuing Python stack in each entry's ``frames``."""
    return env_bool("TORCHCOMM_FR_STACK", False)


def log_json_path() -> str | None:
    """``TORCHCOMM_LOG_JSON``: append one JSON line per finished op to this file."""
    return env_str("TORCHCOMM_LOG_JSON")


def check_collectives() -> bool:
    """``TORCHCOMM_CHECK_COLLECTIVES``: compare every collective's fingerprint across ranks."""
    return env_bool("TORCHCOMM_CHECK_COLLECTIVES", False)


# -- transport (CPU backend) ---------------------------------------------------------------------
TRANSPORTS = ("auto", "shm", "tcp")
RDMA_PATHS = ("auto", "cma", "tcp")


def shm_single_copy() -> bool:
    """``TORCHCOMM_SHM_SINGLE_COPY`` (default on): large all_gather, all_to_all and broadcast over
    shared memory copy once, between the ranks' address spaces; off on any rank turns it off for the
    communicator that rank makes."""
    return env_bool("TORCHCOMM_SHM_SINGLE_COPY", True)


def shm_p2p_rendezvous() -> bool:
    """``TORCHCOMM_SHM_P2P_RENDEZVOUS`` (default off): messages of at least 1 MiB that this rank
    sends over shared memory are read by the receiver straight out of this rank's memory
    (``transport.shm.p2p``), once the communicator's single-copy probe has passed; a receiver
    takes either form, so ranks may differ."""
    return env_bool("TORCHCOMM_SHM_P2P_RENDEZVOUS", False)


def shm_unshare_cores() -> bool:
    """``TORCHCOMM_SHM_UNSHARE_CORES`` (default on): when the ranks of a host have a core each but
    the scheduler put two on one, the higher rank's waiting thread steps off it
    (``transport.core_sharing``); nothing stays pinned."""
    return env_bool("TORCHCOMM_SHM_UNSHARE_CORES", True)


def rdma_path() -> str:
    """``TORCHCOMM_RDMA_PATH``: how ``torchcomms._transport`` reaches a peer of this host
    (``auto``: cross-memory attach when the peer is local and the kernel permits it, else
    TCP; ``cma`` insists on it; ``tcp`` always takes the socket)."""
    return _choice(None, "", "TORCHCOMM_RDMA_PATH", RDMA_PATHS, "auto")


SHM_SLOT_BYTES_DEFAULT = 1 << 20
_UNITS = {
    "": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def _choice(
    hint: str | None, hint_name: str, env: str, choices: tuple[str, ...], default: str
) -> str:
    """The hint if given, else the environment variable, else ``default``: one of ``choices``."""
    source = f"hint {hint_name}" if hint is not None else env
    raw = hint if hint is not None else os.environ.get(env)
    value = (raw or default).strip().lower()
    if value not in choices:
        raise RuntimeError(
            f"Invalid value for {source}: {raw!r} (expected one of {', '.join(choices)})"
        )
    return value


def transport(hint: str | None) -> str:
    """Hint ``transport``, else ``TORCHCOMM_TRANSPORT``, else ``auto`` (one of TRANSPORTS)."""
    return _choice(hint, "transport", "TORCHCOMM_TRANSPORT", TRANSPORTS, "auto")


#: ``off``: the scheduler places ranks; ``spread``: local rank i on core i mod n.
CPU_AFFINITY_MODES = ("off", "spread")


def cpu_affinity(hint: str | None) -> str:
    """Hint ``cpu_affinity``, else ``TORCHCOMM_CPU_AFFINITY``, else ``off``
    (``transport.placement``)."""
    return _choice(hint, "cpu_affinity", "TORCHCOMM_CPU_AFFINITY", CPU_AFFINITY_MODES, "off")


def parse_bytes(source: str, raw: str) -> int:
    """``4194304``, ``4M``, ``64KiB`` ... as a byte count."""
    text = raw.strip().upper()
    digits = text.rstrip("KMGIB")
    unit = text[len(digits) :]
    try:
        value = int(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        raise RuntimeError(
            f"Invalid value for {source}: {raw!r} (expected a byte count such as 4194304 or 4M)"
        ) from None
    if value < 0:
        raise RuntimeError(f"Invalid value for {source}: {raw!r} (must not be negative)")
    return value


def _bytes_setting(
    hint_name: str, env_name: str, hint: str | None, default: int | None
) -> int | None:
    if hint is not None:
        return parse_bytes(f"hint {hint_name}", hint)
    raw = os.environ.get(env_name)
    if raw is None or raw.strip() == "":
        return default
    return parse_bytes(env_name, raw)


def _page_multiple(source: str, value: int) -> int:
    if value < 4096 or value % 4096:
        raise RuntimeError(
            f"Invalid value for {source}: {value} (must be a multiple of 4096, at least 4096)"
        )
    return value


def shm_slot_bytes(hint: str | None) -> int:
    """Per-rank data slot of the shm transport (hint ``shm_slot_bytes`` / ``TORCHCOMM_SHM_SLOT_BYTES``)."""
    value = _bytes_setting(
        "shm_slot_bytes", "TORCHCOMM_SHM_SLOT_BYTES", hint, SHM_SLOT_BYTES_DEFAULT
    )
    assert value is not None
    return _page_multiple("shm slot bytes", value)


def shm_pair_bytes(hint: str | None) -> int | None:
    """Point-to-point ring slot (hint ``shm_pair_bytes`` / ``TORCHCOMM_SHM_PAIR_BYTES``); None: by size."""
    value = _bytes_setting("shm_pair_bytes", "TORCHCOMM_SHM_PAIR_BYTES", hint, None)
    return None if value is None else _page_multiple("shm pair bytes", value)


def shm_oneshot_max(hint: str | None) -> int | None:
    """Largest all_reduce/reduce (chunk) done one-shot (``TORCHCOMM_SHM_ONESHOT_MAX_BYTES``).

    None (unset): chosen by the transport from the member count (measured; see README).
    """
    return _bytes_setting("shm_oneshot_max", "TORCHCOMM_SHM_ONESHOT_MAX_BYTES", hint, None)


HIER_SMALL_MAX_DEFAULT = 1 << 20  # measured: the simulated 2 x 2 world


def hier_small_max(hint: str | None) -> int:
    """Largest hierarchical all_reduce done leader-based (``TORCHCOMM_HIER_SMALL_MAX_BYTES``)."""
    value = _bytes_setting(
        "hier_small_max", "TORCHCOMM_HIER_SMALL_MAX_BYTES", hint, HIER_SMALL_MAX_DEFAULT
    )
    assert value is not None
    return value


def shm_wait_policy() -> tuple[int, int, int] | None:
    """``TORCHCOMM_SHM_WAIT=spins,yield_us,sleep_max_us``: override the shm wait policy (tuning)."""
    raw = os.environ.get("TORCHCOMM_SHM_WAIT")
    if raw is None or raw.strip() == "":
        return None
    try:
        spins, yield_us, sleep_us = (int(x) for x in raw.split(","))
    except ValueError:
        raise RuntimeError(
            f"Invalid value for TORCHCOMM_SHM_WAIT: {raw!r} (expected spins,yield_us,sleep_max_us)"
        ) from None
    return spins, yield_us, sleep_us


def mismatch_check() -> bool:
    """``TORCHCOMM_MISMATCH_CHECK`` (default on): exchange every collective's fingerprint.

    Off (to measure what it costs), the tcp path skips the header exchange of ops whose
    data does not ride in it, and the shm path writes and compares no fingerprints.
    """
    return env_bool("TORCHCOMM_MISMATCH_CHECK", True)


def liveness_period_s() -> float:
    """``TORCHCOMM_LIVENESS_PERIOD_MS`` (default 50): how often the tcp path checks peers."""
    raw = env_int("TORCHCOMM_LIVENESS_PERIOD_MS")
    if raw is None:
        return 0.05
    if raw <= 0:
        raise ValueError(f"TORCHCOMM_LIVENESS_PERIOD_MS must be > 0, got {raw}")
    return raw / 1000.0


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"Invalid value for environment variable {name}: {raw!r} (expected seconds, >= 0)"
        ) from None
    if value < 0:
        raise ValueError(f"Invalid value for environment variable {name}: {raw!r} (must be >= 0)")
    return value


def tcp_user_timeout_s() -> float:
    """``TORCHCOMM_TCP_USER_TIMEOUT_S`` (default 30, 0: the kernel's own, ~15 min): how long
    sent bytes of a data connection may stay unacknowledged before the kernel gives the
    connection up, and the op fails naming the peer."""
    return _seconds("TORCHCOMM_TCP_USER_TIMEOUT_S", 30.0)


def tcp_keepalive_s() -> float:
    """``TORCHCOMM_TCP_KEEPALIVE_S`` (default 5, 0: off): after how long idle a data
    connection is probed, so a peer end that vanished without FIN or RST is found."""
    return _seconds("TORCHCOMM_TCP_KEEPALIVE_S", 5.0)


# -- torch.compile (torchcomms.functional) -------------------------------------------------------
def _flag_on(name: str) -> bool:
    """A switch read at import time: only 1/true/yes/y turn it on (anything else is off).

    Lenient on purpose: ``torchcomms`` is imported while ``torch.distributed`` initialises,
    where a raised error would only switch the integration off.
    """
    return (os.environ.get(name) or "").strip().lower() in _TRUE


def compile_patch_enabled() -> bool:
    """``TORCHCOMMS_PATCH_FOR_COMPILE``: make communicator calls traceable by torch.compile."""
    return _flag_on("TORCHCOMMS_PATCH_FOR_COMPILE")


def compile_ignore_version() -> bool:
    """``TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT``: skip the torch version check."""
    return _flag_on("TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT")
