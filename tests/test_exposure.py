"""What a job exposes to other users and hosts (issue 12, item 7).

* the bootstrap's TCPStore servers (``MASTER_PORT`` and the private store) listen on
  127.0.0.1 when ``MASTER_ADDR=127.0.0.1``, not on every interface (read from
  ``/proc/net/tcp``/``tcp6``), and on the dialled address in general;
* flight-recorder dumps are 0600 files in a 0700 directory of this user's (by default
  ``<tempdir>/torchcomm_fr-<uid>``); a directory in the way that is a symlink or belongs to
  another user is refused, a loose one of ours is tightened;
* ``python -m torchcomms.tools.fr`` refuses files that are not dumps in the recorder's format
  and never runs code from a pickle (restricted unpickler), naming each refused file;
* ``torchcomms.objcol`` unpickles only on a rank whose own ``TORCHCOMMS_SERIALIZATION`` is
  ``pickle`` (its consent, as upstream); a rank without it refuses a pickled payload, even
  with ``weights_only=True`` passed, and loads ``torch.save`` payloads weights-only.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import ReduceOp, new_comm, objcol
from torchcomms.hooks import FlightRecorderHook, _fr_dump
from torchcomms.tools import fr as frtool
from torchcomms.transport import listen

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=60)


# ----------------------------------------------------------------------------- listening address


def _listeners(port: int | None = None, inodes: set[int] | None = None) -> list[str]:
    """``ip:port`` of listening TCP sockets (on ``port``, or whose inode is in ``inodes``)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                hex_ip, hex_port = fields[1].split(":")
                if fields[3] != "0A":
                    continue
                if port is not None and int(hex_port, 16) != port:
                    continue
                if inodes is not None and int(fields[9]) not in inodes:
                    continue
                raw = bytes.fromhex(hex_ip)
                if len(raw) == 4:  # /proc prints each 32-bit word in host (little-endian) order
                    ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    ip = socket.inet_ntop(socket.AF_INET6, words)
                found.append(f"{ip}:{int(hex_port, 16)}")
    return sorted(found)


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _bind_cases(ctx: RankContext) -> dict[str, Any]:
    port = ctx.master_port
    out: dict[str, Any] = {}
    if ctx.rank == 1:
        # Rank 0 serves MASTER_PORT until this rank joins: look at its socket first.
        deadline = time.monotonic() + 30
        while not _listeners(port) and time.monotonic() < deadline:
            time.sleep(0.01)
        out["master_port"] = _listeners(port)
    before = _own_socket_inodes()
    comm = new_comm("gloo", CPU, name="exposure_bind", timeout=TIMEOUT)
    t = torch.ones(4)
    comm.all_reduce(t, ReduceOp.SUM, False)
    assert t.tolist() == [2.0] * 4
    if ctx.rank == 0:
        # The private store (the only server a comm on one host opens) came with new_comm.
        out["new_listeners"] = _listeners(inodes=_own_socket_inodes() - before)
    comm.barrier(False)
    comm.finalize()
    return out


def test_bootstrap_servers_listen_on_loopback_for_loopback_master_addr() -> None:
    results = run_ranks(_bind_cases, 2, timeout=60)
    master = results[1]["master_port"]
    assert len(master) == 1 and master[0].startswith("127.0.0.1:"), master
    port = int(master[0].rsplit(":", 1)[1])
    new = results[0]["new_listeners"]
    assert new, "rank 0 opened no private store"
    assert all(a.startswith("127.0.0.1:") for a in new), new
    assert port not in [int(a.rsplit(":", 1)[1]) for a in new]  # MASTER_PORT is closed again


def test_listen_target_follows_the_dialled_address() -> None:
    target = listen.listen_target
    assert target("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    assert target("127.0.0.5") == (socket.AF_INET, "127.0.0.5")
    assert target("::1") == (socket.AF_INET6, "::1")
    assert target("localhost") == (socket.AF_INET, "127.0.0.1")
    assert target("192.0.2.7") == (socket.AF_INET, "192.0.2.7")  # a literal IP is kept
    # ... but one this host does not have (NAT, floating address) falls back to all.
    with listen.listen_socket("192.0.2.7", 0) as sock:
        assert sock.getsockname()[0] in ("::", "0.0.0.0")
    with listen.listen_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
        taken = sock.getsockname()[1]
        with pytest.raises(OSError) as info:
            listen.listen_socket("127.0.0.1", taken)
        assert info.value.errno == errno.EADDRINUSE


def test_a_held_port_is_told_from_a_listener_and_master_ports_avoid_the_ephemeral_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    with listen.listen_socket("127.0.0.1", 0) as server:
        port = server.getsockname()[1]
        assert listen.accepts("127.0.0.1", port, 1.0) is True
        held = socket.create_connection(("127.0.0.1", port))  # its local end holds a port
        try:
            local = held.getsockname()[1]
            with pytest.raises(OSError) as info:
                listen.listen_socket("127.0.0.1", local)
            assert info.value.errno == errno.EADDRINUSE  # taken ...
            assert listen.accepts("127.0.0.1", local, 1.0) is False  # ... by no listener
        finally:
            held.close()
    picked = {listen.free_master_port() for _ in range(5)}
    assert all(max(1024, ephemeral_low - 12000) <= p < ephemeral_low for p in picked), picked
    again = listen.free_master_port(avoid=picked)
    assert again not in picked
    with pytest.raises(RuntimeError, match=r"no free port on 127\.0\.0\.1 in "):
        listen.free_master_port(avoid=range(1024, ephemeral_low))


# ----------------------------------------------------------------------------- dump permissions


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def fake_comm(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    comm = new_comm("fake", CPU, name="exposure_fr")
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    yield comm
    comm.finalize()


def test_dumps_are_private_to_the_user(
    fake_comm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHCOMM_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old_umask = os.umask(0)  # permissions must not depend on the caller's umask
    try:
        rec = FlightRecorderHook(isolated=True)
        rec.register_with_comm(fake_comm)
        fake_comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
        private = tmp_path / f"torchcomm_fr-{os.getuid()}"
        path = rec.dump_file(0)
        assert path == str(private / "rank_0")
        assert _mode(private) == 0o700
        assert _mode(path) == 0o600
        assert os.stat(private).st_uid == os.stat(path).st_uid == os.getuid()
        assert [p.name for p in private.iterdir()] == ["rank_0"]  # no temporary file left

        # A loose directory of ours is tightened; the dump is written again, still 0600.
        os.chmod(private, 0o777)
        assert rec.dump_file(0) == path
        assert _mode(private) == 0o700 and _mode(path) == 0o600

        # Someone else's directory (or a symlink) in the way is refused, naming it.
        other = tmp_path / "elsewhere"
        other.mkdir()
        for p in private.iterdir():
            p.unlink()
        private.rmdir()
        private.symlink_to(other)
        with pytest.raises(PermissionError, match=f"refusing to dump into {private}: not a dir"):
            rec.dump_file(0)
        assert list(other.iterdir()) == []
        private.unlink()
        if os.getuid() == 0:  # only root can give a directory away
            private.mkdir(mode=0o700)
            os.chown(private, 12345, 12345)
            with pytest.raises(
                PermissionError,
                match=f"refusing to dump into {private}: owned by uid 12345, not by this user",
            ):
                rec.dump_file(0)
            assert list(private.iterdir()) == []

        # An explicit prefix is used as given; a directory it needs is created 0700.
        prefix = tmp_path / "chosen" / "deeper" / "fr_"
        monkeypatch.setenv("TORCHCOMM_FR_DUMP_TEMP_FILE", str(prefix))
        path = rec.dump_file(3)
        assert path == f"{prefix}3"
        assert _mode(path) == 0o600
        assert _mode(prefix.parent) == 0o700 and _mode(prefix.parent.parent) == 0o700
        with open(path, "rb") as f:
            assert frtool.load_dump(path) == pickle.load(f)
        rec.unregister()
    finally:
        os.umask(old_umask)


# ----------------------------------------------------------------------------- analyzer refusal


class _Planted:
    """Unpickling this opens (creates) a file: proof that a pickle ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_analyzer_refuses_what_is_not_a_dump(
    fake_comm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fr_dump.FR_VERSION in frtool._SUPPORTED_VERSIONS
    assert frtool._FORMAT_MARK == _fr_dump.FORMAT_MARK
    rec = FlightRecorderHook(isolated=True)
    rec.register_with_comm(fake_comm)
    fake_comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    good = json.loads(rec.dump_json())
    rec.unregister()
    good["torchcomms"]["rank"] = 0
    (tmp_path / "rank_0").write_bytes(pickle.dumps(good))

    marker = tmp_path / "code_ran"
    planted = tmp_path / "rank_1"
    planted.write_bytes(pickle.dumps({**good, "entries": [_Planted(str(marker))]}))
    foreign = tmp_path / "rank_2.json"  # PyTorch's own (NCCL) recorder: not our format
    foreign.write_text(json.dumps({**good, "comm_lib_version": "2.21.5"}))
    newer = tmp_path / "rank_3"
    newer.write_bytes(pickle.dumps({**good, "version": "9.0"}))
    garbage = tmp_path / "notes.txt"
    garbage.write_text("hello")

    expect = {
        str(planted): "refused, not a torchcomms flight-recorder dump (unpickling: it refers "
        "to io.open, which no dump contains)",
        str(foreign): "refused, not a torchcomms flight-recorder dump (comm_lib_version is "
        "'2.21.5', expected 'torchcomms')",
        str(newer): "refused, not a torchcomms flight-recorder dump (version '9.0' is not one "
        "of ['2.10'])",
    }
    for path, reason in expect.items():
        with pytest.raises(frtool.DumpFormatError) as info:
            frtool.load_dump(path)
        assert str(info.value) == f"{path}: {reason}"
    with pytest.raises(frtool.DumpFormatError, match=f"^{garbage}: refused, not a torchcomms"):
        frtool.load_dump(str(garbage))

    status = frtool.main([str(tmp_path)])
    out, err = capsys.readouterr()
    assert not marker.exists(), "the analyzer ran code from a pickle"
    assert status == 1  # refused files are a problem even when the rest is healthy
    for path, reason in expect.items():
        assert f"error: {path}: {reason}\n" in err, err
    assert f"error: {garbage}: refused" in err
    assert out.startswith("1 dumps: rank 0\n"), out  # the real dump is still analysed

    # Only refused files: no dump at all.
    (tmp_path / "rank_0").unlink()
    assert frtool.main([str(tmp_path)]) == 2
    assert not marker.exists()


def test_restricted_unpickler_allows_plain_data_only() -> None:
    plain = {"a": [1, 2.5, "x", None, True], "b": {"c": (1, 2)}}
    assert frtool._DumpUnpickler(io.BytesIO(pickle.dumps(plain))).load() == plain
    for evil in (pickle.dumps(os.getcwd), pickle.dumps(_Planted("/nonexistent/x"))):
        with pytest.raises(pickle.UnpicklingError, match="which no dump contains"):
            frtool._DumpUnpickler(io.BytesIO(evil)).load()


# ----------------------------------------------------------------------------- weights_only


@dataclass
class Gift:
    """An arbitrary class: ``torch.load(weights_only=True)`` refuses it."""

    rank: int


def _weights_only_cases(ctx: RankContext) -> dict[str, str]:
    """Each rank's own TORCHCOMMS_SERIALIZATION is its consent to unpickle (as upstream)."""
    assert "TORCHCOMMS_SERIALIZATION" not in os.environ
    rank, size = ctx.rank, ctx.world_size
    comm = new_comm("gloo", CPU, name="exposure_objcol", store=ctx.store, timeout=TIMEOUT)
    out: dict[str, str] = {}
    gathered: list[Any] = [None] * size
    # No consent: torch.load(weights_only=True) (the default) refuses the class on every rank.
    with pytest.raises(pickle.UnpicklingError) as info:
        objcol.all_gather_object(comm, gathered, Gift(rank))
    out["all_gather_object"] = str(info.value)
    # ... and plain data still goes through.
    objcol.all_gather_object(comm, gathered, {"r": rank})
    assert gathered == [{"r": r} for r in range(size)]
    bcast: list[Any] = [Gift(0)] if rank == 0 else [None]
    if rank == 0:
        objcol.broadcast_object_list(comm, bcast, 0)
    else:
        with pytest.raises(pickle.UnpicklingError) as info:
            objcol.broadcast_object_list(comm, bcast, 0)
        out["broadcast_object_list"] = str(info.value)
    # Rank 0 consents (its own setting) and pickles; rank 1 did not: refused, even when it
    # passed weights_only=True explicitly, and accepted only with weights_only=False.
    for case in ("explicit", "default", "accepted"):
        if rank == 0:
            os.environ["TORCHCOMMS_SERIALIZATION"] = "pickle"
            try:
                objcol.send_object_list(comm, [Gift(7)], 1)
            finally:
                del os.environ["TORCHCOMMS_SERIALIZATION"]
        elif rank == 1:
            got: list[Any] = [None]
            if case == "accepted":
                objcol.recv_object_list(comm, got, 0, weights_only=False)
                assert got == [Gift(7)]
                continue
            with pytest.raises(pickle.UnpicklingError) as info:
                if case == "explicit":
                    objcol.recv_object_list(comm, got, 0, weights_only=True)
                else:
                    objcol.recv_object_list(comm, got, 0)
            out[f"recv_object_list {case}"] = str(info.value)
            assert got == [None]
    comm.finalize()
    return out


def test_a_rank_unpickles_only_with_its_own_consent() -> None:
    results = run_ranks(_weights_only_cases, 2, timeout=60, env={"TORCHCOMMS_SERIALIZATION": None})
    for out in results:
        assert "Weights only load failed" in out["all_gather_object"], out
        assert "Gift" in out["all_gather_object"], out
    assert "Weights only load failed" in results[1]["broadcast_object_list"]
    for case in ("explicit", "default"):
        assert results[1][f"recv_object_list {case}"] == (
            "[comm=exposure_objcol rank=1] recv_object_list: refusing to unpickle a payload "
            "serialised with pickle (the sender has TORCHCOMMS_SERIALIZATION=pickle, this rank "
            "does not) under weights_only=True; set TORCHCOMMS_SERIALIZATION=pickle on this rank "
            "or pass weights_only=False to accept it"
        )
