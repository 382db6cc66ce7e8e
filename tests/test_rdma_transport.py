"""``torchcomms._transport`` on CPU: one-sided reads and writes between real processes.

* three ranks of this host (``_matrix``), both paths (cross-memory attach and TCP): every dtype
  at sizes from 1 B to 256 MiB, read and written bit for bit; two readers of one buffer at
  once; two writers into disjoint halves of one buffer; keys that are wrong, of another
  process, of freed memory; ranges past the end; the link still works after each refusal;
* in this process: upstream's view and pickling semantics, the local refusals (a
  non-contiguous or CUDA tensor, a view past the end, a local buffer larger than the remote
  one, not connected), registration reuse, and churn (a thousand links and registrations
  leave no fd, thread or registration behind);
* faults with a peer process (``tests/rdma_peer.py``): the owner killed in the middle of a
  256 MiB read (the reader's error names it), a writer killed in the middle of a 256 MiB write
  (only the bytes it wrote changed, each as sent; the owner serves the next peer);
* two simulated hosts (``@pytest.mark.netns``): reads, writes, refusals and a killed owner
  over TCP between network namespaces.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from tests.rdma_peer import GUARD, OWNER_BYTES, pattern
from torchcomms._transport import (
    RdmaMemory,
    RdmaMemoryMutableView,
    RdmaMemoryView,
    RdmaRemoteBuffer,
    RdmaTransport,
    attach_rdma_memory_hook,
)
from torchcomms.errors import PeerFailureError
from torchcomms.transport.rdma.registry import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("cma", "tcp")

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
#: Bytes per dtype case: 1 B up, across the 4 MiB piece boundary and the 8 MiB parallel switch.
SIZES = (1, 7, 4096, (4 << 20) + 3, 9 << 20)
BIG = 256 << 20


def _case(dtype: torch.dtype, nbytes: int, salt: int) -> torch.Tensor:
    """``nbytes`` (rounded down to whole elements, at least one) of ``dtype``, seeded: random
    bytes, tiled past ``_BLOCK`` (a prime length, so a piece misplaced by any power of two shows)."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = max(1, nbytes // size) * size
    gen = torch.Generator().manual_seed(salt)
    block = torch.randint(0, 256, (min(total, _BLOCK),), generator=gen, dtype=torch.uint8)
    raw = block.repeat(total // block.numel() + 1)[:total].clone()
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


_BLOCK = 1_000_003


def _cases() -> list[tuple[torch.dtype, int]]:
    return [(d, n) for d in DTYPES for n in SIZES[:3]] + [(torch.float32, n) for n in SIZES[3:]]


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _matrix(ctx: RankContext, path: str) -> dict[str, Any]:
    """Rank 0 owns the memory; ranks 1 and 2 read and write it (module docstring)."""
    os.environ["TORCHCOMM_RDMA_PATH"] = path
    store, rank, tag = ctx.store, ctx.rank, path
    out: dict[str, Any] = {"checked": 0}
    if rank == 0:
        links = {}
        for peer in (1, 2):
            t = RdmaTransport(torch.device("cpu"))
            store.set(f"{tag}/url0to{peer}", t.bind())
            links[peer] = t
        cases = {f"{d}/{n}": _case(d, n, i) for i, (d, n) in enumerate(_cases())}
        big = _case(torch.uint8, BIG, 99)
        inbox = torch.zeros(BIG + 2 * GUARD, dtype=torch.uint8)
        inbox[:GUARD] = 7
        inbox[-GUARD:] = 7
        doomed = torch.ones(64, dtype=torch.uint8)
        mems = {k: RdmaMemory(v) for k, v in cases.items()}
        mems["big"], mems["inbox"] = RdmaMemory(big), RdmaMemory(inbox[GUARD:-GUARD])
        mems["doomed"] = RdmaMemory(doomed)
        store.set(
            f"{tag}/buffers", pickle.dumps({k: m.to_remote_buffer() for k, m in mems.items()})
        )
        for peer in (1, 2):
            links[peer].connect(store.get(f"{tag}/url{peer}to0"))
        store.wait([f"{tag}/read/1", f"{tag}/read/2"])
        del mems["doomed"]  # deregistered: later accesses with its key must be refused
        store.set(f"{tag}/freed", "1")
        store.wait([f"{tag}/done/1", f"{tag}/done/2"])
        got = inbox[GUARD:-GUARD]
        want = torch.cat([_case(torch.uint8, BIG // 2, 1001), _case(torch.uint8, BIG // 2, 1002)])
        out["inbox_as_written"] = bool(torch.equal(got, want))
        out["guards_held"] = bool((inbox[:GUARD] == 7).all() and (inbox[-GUARD:] == 7).all())
        for t in links.values():
            t.close()
        return out

    t = RdmaTransport("cpu")
    store.set(f"{tag}/url{rank}to0", t.bind())
    assert t.connect(store.get(f"{tag}/url0to{rank}")) == 0 and t.connected()
    out["path"] = t.path
    remote: dict[str, RdmaRemoteBuffer] = pickle.loads(store.get(f"{tag}/buffers"))
    for i, (dtype, n) in enumerate(_cases()):
        want = _case(dtype, n, i)
        got = torch.zeros_like(want)
        mem = RdmaMemory(got)
        assert t.read(mem.to_mutable_view(), remote[f"{dtype}/{n}"]) == 0
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, n)
        out["checked"] += 1
    # Both readers read the 256 MiB buffer at the same time.
    store.add(f"{tag}/big_ready", 1)
    while int(store.add(f"{tag}/big_ready", 0)) < 2:
        time.sleep(0.001)
    dst = torch.empty(BIG, dtype=torch.uint8)
    dmem = RdmaMemory(dst)
    t.read(dmem.to_mutable_view(), remote["big"])
    out["big_read"] = bool(torch.equal(dst, _case(torch.uint8, BIG, 99)))
    # Each writes its half of the owner's inbox (at an offset into the registration).
    half = _case(torch.uint8, BIG // 2, 1000 + rank)
    hmem = RdmaMemory(half)
    inbox = remote["inbox"]
    t.write(
        hmem.to_view(),
        RdmaRemoteBuffer(inbox.ptr + (rank - 1) * (BIG // 2), BIG // 2, inbox.access_key),
    )
    # Refusals, each followed by a read that must still work.
    small = torch.zeros(16, dtype=torch.uint8)
    smem = RdmaMemory(small)
    good = remote["doomed"]
    key = good.access_key
    bad = {
        "wrong_key": RdmaRemoteBuffer(good.ptr, 16, key[:-1] + ("0" if key[-1] != "0" else "1")),
        "malformed_key": RdmaRemoteBuffer(good.ptr, 16, "nonsense"),
        "past_end": RdmaRemoteBuffer(good.ptr + 56, 16, key),
        "before_start": RdmaRemoteBuffer(good.ptr - 8, 16, key),
        "other_process": RdmaRemoteBuffer(smem.ptr, 16, smem.key),
    }
    for name, buf in bad.items():
        for op in ("read", "write"):
            call = (
                (lambda b=buf: t.read(smem.to_mutable_view(), b))
                if op == "read"
                else (lambda b=buf: t.write(smem.to_view(), b))
            )
            out[f"{name}/{op}"] = _outcome(call)
            small.zero_()
            t.read(smem.to_mutable_view(), RdmaRemoteBuffer(good.ptr, 16, key))
            assert bool((small == 1).all()), (name, op, small)
    store.set(f"{tag}/read/{rank}", "1")
    store.wait([f"{tag}/freed"])
    out["freed/read"] = _outcome(lambda: t.read(smem.to_mutable_view(), good))
    out["freed/write"] = _outcome(lambda: t.write(smem.to_view(), good))
    store.set(f"{tag}/done/{rank}", "1")
    t.close()
    return out


@pytest.mark.parametrize("path", PATHS)
def test_three_processes_read_and_write_every_dtype_and_refuse_bad_accesses(path: str) -> None:
    results = run_ranks(_matrix, 3, path, timeout=120)
    owner, readers = results[0], results[1:]
    assert owner == {"checked": 0, "inbox_as_written": True, "guards_held": True}
    for res in readers:
        assert res["path"] == path and res["checked"] == len(_cases()) and res["big_read"], res
        for op in ("read", "write"):
            assert res[f"wrong_key/{op}"][0] == "RemoteAccessError", res
            assert "does not name live memory" in res[f"wrong_key/{op}"][1]
            kind, text = res[f"malformed_key/{op}"]
            assert kind == "RemoteAccessError" and "malformed access key 'nonsense'" in text, res
            for name in ("past_end", "before_start"):
                kind, text = res[f"{name}/{op}"]
                assert kind == "RemoteAccessError" and "is outside the memory of key" in text, res
            kind, text = res[f"other_process/{op}"]
            assert kind == "RemoteAccessError", res
            assert ("not of the connected peer" in text) or ("does not name live memory" in text)
            kind, text = res[f"freed/{op}"]
            assert kind == "RemoteAccessError" and "deregistered" in text, res


# ------------------------------------------------------------------------- in this process
def test_views_pickling_and_local_refusals() -> None:
    assert RdmaTransport.supported()
    tensor = torch.arange(1024, dtype=torch.uint8)
    mem = RdmaMemory(tensor)
    for make in (mem.to_view, mem.to_mutable_view):
        assert make().size() == 1024 and make(offset=256).size() == 768
        assert make(length=512).size() == 512 and make(offset=256, length=512).size() == 512
    assert isinstance(mem.to_mutable_view(), RdmaMemoryMutableView)
    assert not isinstance(mem.to_view(), RdmaMemoryMutableView)
    remote = mem.to_remote_buffer()
    for protocol in (0, 1, pickle.HIGHEST_PROTOCOL):
        assert pickle.loads(pickle.dumps(remote, protocol=protocol)) == remote
    assert remote.__getstate__() == (tensor.data_ptr(), 1024, mem.key)
    assert RdmaMemory(tensor).reused_registration() and not mem.reused_registration()
    assert RdmaMemory(tensor[100:200]).reused_registration()  # inside a live registration

    with pytest.raises(RuntimeError, match="RdmaMemory currently requires a contiguous tensor"):
        RdmaMemory(torch.zeros(4, 4).t())
    with pytest.raises(RuntimeError, match="past the end of the registered 1024 bytes"):
        mem.to_view(offset=1000, length=25)
    with pytest.raises(RuntimeError, match="offset 2000 is outside"):
        mem.to_mutable_view(offset=2000)
    with pytest.raises(TypeError, match="expected a torch\\.Tensor"):
        RdmaMemory([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-negative ints"):
        RdmaRemoteBuffer(-1, 4, "k")
    with pytest.raises(RuntimeError, match="attach_rdma_memory_hook"):
        attach_rdma_memory_hook(None, None)
    if torch.cuda.is_available():  # pragma: no cover - a GPU runner
        with pytest.raises(RuntimeError, match="moves CPU memory"):
            RdmaMemory(torch.zeros(4, device="cuda"))

    a, b = RdmaTransport(torch.device("cuda:0")), RdmaTransport("cpu")
    with pytest.raises(RuntimeError, match="not connected"):
        a.read(mem.to_mutable_view(), remote)
    with pytest.raises(RuntimeError, match=r"not a URL of RdmaTransport\.bind"):
        a.connect(b"garbage")
    assert a.connect(b.bind()) == 0 and b.connect(a.bind()) == 0
    assert a.connect(b.bind()) == 0  # again: the same peer
    with pytest.raises(RuntimeError, match="already connected"):
        a.connect(RdmaTransport("cpu").bind())
    with pytest.raises(RuntimeError, match="larger than the remote buffer"):
        a.write(mem.to_view(), RdmaRemoteBuffer(remote.ptr, 10, remote.access_key))
    with pytest.raises(TypeError, match="local_buffer must be an RdmaMemoryMutableView"):
        a.read(mem.to_view(), remote)  # type: ignore[arg-type]
    assert isinstance(mem.to_view(), RdmaMemoryView)
    # One process, both ends (upstream's test layout): write then a partial read.
    dst = torch.zeros(1024, dtype=torch.uint8)
    dmem = RdmaMemory(dst)
    assert a.write(mem.to_view(offset=256, length=512), dmem.to_remote_buffer()) == 0
    assert torch.equal(dst[:512], tensor[256:768]) and not dst[512:].any()
    dst.zero_()
    assert b.read(dmem.to_mutable_view(offset=256, length=512), remote) == 0
    assert torch.equal(dst[256:768], tensor[:512]) and not dst[:256].any() and not dst[768:].any()
    a.close()
    b.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("path", PATHS)
def test_churn_leaves_no_fd_thread_or_registration(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHCOMM_RDMA_PATH", path)
    src = torch.arange(4096, dtype=torch.int32)

    def once() -> None:
        a, b = RdmaTransport("cpu"), RdmaTransport("cpu")
        a.connect(b.bind())
        b.connect(a.bind())
        smem, dst = RdmaMemory(src), torch.zeros_like(src)
        dmem = RdmaMemory(dst)
        a.read(dmem.to_mutable_view(), smem.to_remote_buffer())
        assert torch.equal(dst, src)
        a.close()
        b.close()

    once()  # the process's registration table opens once, on first use
    gc.collect()  # what earlier tests in this process dropped closes now, not mid-count
    fds, threads, live = _fds(), threading.active_count(), registry().stats()["live"]
    for _ in range(1000):
        once()
    assert (_fds(), threading.active_count(), registry().stats()["live"]) == (fds, threads, live)


# ------------------------------------------------------------------ faults, with a peer process
class _Peer:
    """``tests/rdma_peer.py`` in a child process (``argv`` may wrap it in ``ip netns exec``)."""

    def __init__(self, role: str, env: dict[str, str], prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.rdma_peer", role],
            cwd=REPO,
            env={**env, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self.answer(60)
        self.url: str = hello["url"]
        self.buffers: dict[str, str] = hello["buffers"]
        self.pid = json.loads(self.url)["pid"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def answer(self, timeout: float = 30) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=timeout))  # type: ignore[no-any-return]
        except queue.Empty:
            self.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"peer gave no answer in {timeout} s; stderr:\n{err}") from None

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.answer()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def peers() -> Iterator[list[_Peer]]:
    made: list[_Peer] = []
    yield made
    for peer in made:
        peer.kill()


def _kill_when(peer: _Peer, tensor: torch.Tensor, stop: threading.Event) -> threading.Thread:
    """Kill ``peer`` as soon as the first byte of ``tensor`` changes (mid-transfer)."""

    def watch() -> None:
        while not stop.is_set() and not bool(tensor[0]):
            pass
        os.kill(peer.pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "path",
    # TCP's killed owner is also in the two-host test of the default run.
    ["cma", pytest.param("tcp", marks=pytest.mark.slow)],
)
def test_owner_killed_mid_read_is_named_and_writer_killed_mid_write_harms_nothing(
    path: str, peers: list[_Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHCOMM_RDMA_PATH", path)
    env = dict(os.environ)
    # The owner dies while this process reads 256 MiB of its memory.
    owner = _Peer("owner", env)
    peers.append(owner)
    me = RdmaTransport("cpu")
    assert me.connect(owner.url.encode()) == 0 and me.path == path
    assert owner.ask(op="connect", url=me.bind().decode()) == {"ok": 0}
    dst = torch.zeros(OWNER_BYTES, dtype=torch.uint8)
    dmem = RdmaMemory(dst)
    remote = pickle.loads(bytes.fromhex(owner.buffers["pattern"]))
    stop = threading.Event()
    watcher = _kill_when(owner, dst, stop)
    start = time.monotonic()
    with pytest.raises(PeerFailureError) as info:
        me.read(dmem.to_mutable_view(), remote)
    stop.set()
    watcher.join()
    assert f"pid {owner.pid}" in str(info.value) and time.monotonic() - start < 10, info.value
    me.close()

    # A writer dies while it writes 256 MiB into this process's memory: only bytes it wrote
    # changed, each as sent; the guards either side held; over TCP the next peer is served.
    space = torch.zeros(OWNER_BYTES + 2 * GUARD, dtype=torch.uint8)
    space[:GUARD] = 7
    space[-GUARD:] = 7
    inbox = space[GUARD:-GUARD]
    imem = RdmaMemory(inbox)
    serve = RdmaTransport("cpu")
    writer = _Peer("client", env)
    peers.append(writer)
    assert writer.ask(op="connect", url=serve.bind().decode())["ok"] == 0
    serve.connect(writer.url.encode())
    stop = threading.Event()
    watcher = _kill_when(writer, inbox, stop)
    writer.send(op="write", buffer=pickle.dumps(imem.to_remote_buffer()).hex(), nbytes=OWNER_BYTES)
    watcher.join(30)
    writer.proc.wait(30)
    time.sleep(0.2)  # the kernel has finished any copy of the dead writer
    changed = inbox.nonzero().flatten()
    assert 0 < changed.numel() < OWNER_BYTES, changed.numel()  # it died mid-transfer
    assert torch.equal(inbox[changed], pattern(OWNER_BYTES)[changed])
    assert bool((space[:GUARD] == 7).all() and (space[-GUARD:] == 7).all())
    serve.close()
    if path == "cma":
        return  # no serving thread took part: there is nothing the writer's death could break
    reader = _Peer("client", env)
    peers.append(reader)
    serve2 = RdmaTransport("cpu")
    assert reader.ask(op="connect", url=serve2.bind().decode())["ok"] == 0
    inbox.copy_(pattern(OWNER_BYTES))
    res = reader.ask(op="read", buffer=pickle.dumps(imem.to_remote_buffer()).hex(), nbytes=1 << 20)
    assert res == {"ok": 0, "as_pattern": True}, res
    serve2.close()


# ------------------------------------------------------------------ two simulated hosts (netns)
@pytest.mark.netns
def test_two_hosts_read_write_refuse_and_name_a_killed_owner(peers: list[_Peer]) -> None:
    from tests.test_shm_hier import NETNS_ADDRS, veth_namespaces

    with veth_namespaces() as names:

        def start(role: str, h: int) -> _Peer:
            env = dict(os.environ)
            env.update(TORCHCOMM_HOST_ID=f"rdmahost{h}", TORCHCOMM_GLOO_HOSTNAME=NETNS_ADDRS[h])
            peer = _Peer(role, env, ("ip", "netns", "exec", names[h]))
            peers.append(peer)
            return peer

        owner, client = start("owner", 0), start("client", 1)
        res = client.ask(op="connect", url=owner.url)
        assert res == {"ok": 0, "path": "tcp"}, res
        assert owner.ask(op="connect", url=client.url) == {"ok": 0}
        size = 64 << 20
        res = client.ask(op="read", buffer=owner.buffers["pattern"], nbytes=size)
        assert res == {"ok": 0, "as_pattern": True}, res
        assert client.ask(op="write", buffer=owner.buffers["inbox"], nbytes=size) == {"ok": 0}
        inbox = owner.ask(op="check_inbox")
        assert inbox == {
            "changed": size,
            "first": 0,
            "last": size - 1,
            "as_sent": True,
            "guards_held": True,
        }, inbox
        assert owner.ask(op="drop") == {"ok": 0}
        res = client.ask(op="read", buffer=owner.buffers["pattern"], nbytes=4096)
        assert res["error"] == "RemoteAccessError" and "deregistered" in res["text"], res
        # The owner dies while the client reads 256 MiB from the other host.
        client.send(op="read", buffer=owner.buffers["inbox"], nbytes=OWNER_BYTES)
        owner.kill()
        res = client.answer()
        assert res["error"] == "PeerFailureError" and f"pid {owner.pid}" in res["text"], res
        assert NETNS_ADDRS[0] in res["text"], res
        client.send(op="quit")
        client.proc.wait(30)


def test_a_dead_owners_table_is_swept_and_a_live_ones_kept() -> None:
    from torchcomms.transport.rdma.registry import TABLE_PREFIX
    from torchcomms.transport.shm import segment

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {
        "dead_table": f"{TABLE_PREFIX}{dead.pid}-test",
        "live_table": f"{TABLE_PREFIX}{os.getpid()}-test",
        "dead_segment": f"{segment.PREFIX}{dead.pid}-test",
    }
    for name in names.values():
        open(os.path.join(segment.SHM_DIR, name), "w").close()
    try:
        removed = segment.sweep_stale(TABLE_PREFIX)
        left = {k for k, n in names.items() if os.path.exists(os.path.join(segment.SHM_DIR, n))}
        assert names["dead_table"] in removed and left == {"live_table", "dead_segment"}, left
    finally:
        for name in names.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(segment.SHM_DIR, name))


def test_forced_paths_and_their_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TORCHCOMM_RDMA_PATH``: ``tcp`` takes the socket on one host; ``cma`` to a peer of
    another host (another ``TORCHCOMM_HOST_ID`` when it bound) is refused, saying why; a value
    that is none of the three is refused."""
    src = torch.arange(64, dtype=torch.int16)
    smem = RdmaMemory(src)
    monkeypatch.setenv("TORCHCOMM_RDMA_PATH", "tcp")
    a, b = RdmaTransport("cpu"), RdmaTransport("cpu")
    assert a.connect(b.bind()) == 0 and a.path == "tcp"
    dst = torch.zeros_like(src)
    assert a.read(RdmaMemory(dst).to_mutable_view(), smem.to_remote_buffer()) == 0
    assert torch.equal(dst, src)
    monkeypatch.setenv("TORCHCOMM_HOST_ID", "elsewhere")
    far = RdmaTransport("cpu").bind()
    monkeypatch.delenv("TORCHCOMM_HOST_ID")
    monkeypatch.setenv("TORCHCOMM_RDMA_PATH", "cma")
    with pytest.raises(RuntimeError, match="TORCHCOMM_RDMA_PATH=cma, but cross-memory attach"):
        RdmaTransport("cpu").connect(far)
    monkeypatch.setenv("TORCHCOMM_RDMA_PATH", "shm")
    with pytest.raises(RuntimeError, match="TORCHCOMM_RDMA_PATH"):
        RdmaTransport("cpu").connect(b.bind())
    a.close()
    b.close()


def test_checkpoint_transport_in_one_process_every_refusal() -> None:
    """``RdmaCheckpointTransport`` between two instances: mixed leaves bit for bit, in place
    into the receiver's own tensors, and the refusals: another step, foreign metadata, nothing
    served within the reader's timeout, a source that shut down."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torchcomms.errors import CommTimeoutError
    from torchcomms.errors import PeerFailureError as Gone
    from torchcomms.ft import RdmaCheckpointTransport

    t = timedelta(seconds=5)
    src, dst = RdmaCheckpointTransport(t), RdmaCheckpointTransport(t)
    sd = {
        "w": torch.randn(3, 5),
        "h": torch.arange(7, dtype=torch.int64).to(torch.bfloat16),
        "t": torch.arange(12.0).reshape(3, 4).t(),
        "e": torch.empty(0),
        "n": ("x", 3),
    }
    src.send_checkpoint([1], 4, sd, t)
    got = dst.recv_checkpoint(0, src.metadata(), 4, t)
    assert got["n"] == ("x", 3) and got["e"].numel() == 0
    for k in ("w", "h", "t"):
        assert torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype, k
    mine = {"w": torch.zeros(3, 5), "h": torch.zeros(7, dtype=torch.bfloat16)}
    into = RdmaCheckpointTransport(t, state_dict=lambda: mine)
    healed = into.recv_checkpoint(0, src.metadata(), 4, t)
    assert healed["w"] is mine["w"] and torch.equal(mine["w"], sd["w"])
    assert healed["h"] is mine["h"] and torch.equal(mine["h"], sd["h"])
    with pytest.raises(RuntimeError, match="refused step 5: serving step 4, asked for step 5"):
        dst.recv_checkpoint(0, src.metadata(), 5, t)
    with pytest.raises(RuntimeError, match="is not the metadata of an RdmaCheckpointTransport"):
        dst.recv_checkpoint(0, "http://host:1/checkpoint/", 4, t)
    src.disallow_checkpoint()
    short = timedelta(seconds=0.5)
    quick = RdmaCheckpointTransport(short)
    with pytest.raises(CommTimeoutError, match=r"replica rank 0 \(.*\) did not serve step 4"):
        quick.recv_checkpoint(0, src.metadata(), 4, short)
    src.shutdown()
    with pytest.raises(Gone, match=r"replica rank 0 .* broke"):
        dst.recv_checkpoint(0, src.metadata(), 4, t)
    for x in (dst, into, quick):
        x.shutdown()
