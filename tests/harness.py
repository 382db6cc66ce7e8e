"""Run a test function on N real OS processes ("ranks") and report every rank's failure.

Why real processes: communicators bind sockets, start background threads and keep
process-global state, so ranks must not share an interpreter. Why a *pool*: spawning a
process that imports torch costs 1-3 s on a small box, so workers are reused across tests.

Concurrency model
-----------------
* **Parent (the pytest process), main thread.** Owns everything: one ``TCPStore`` server
  (port chosen by the kernel, ``wait_for_workers=False``), a session temp root, a task-id
  counter and the worker pool, kept until :func:`shutdown` (called from
  ``conftest.pytest_sessionfinish``, with ``atexit`` as fallback). The pool is one list of
  workers that grows on demand: a task of world size N runs on ``pool[:N]`` and the
  worker at index i plays rank i, so world sizes 1..4 share 4 processes instead of 10
  (spawns dominate the run time on 2 cores). :func:`run_ranks` is serialised by a lock;
  it pickles ``(fn, args)`` once, sends every worker its task over that worker's private
  duplex ``Pipe`` and waits on all pipes *and* all process sentinels with
  ``multiprocessing.connection.wait`` under a single deadline. The parent never trusts a
  worker to finish: the deadline is always enforced from here.
* **Workers (one process each), main thread only.** Pooled workers are forked from a
  ``forkserver`` that has imported torch once (a worker is ready in about 0.2 s, not the 2 s
  of a torch import); ``fresh=True`` workers are forked the same way and discarded after
  their task; ``spawn=True`` ones are ``spawn``ed, pristine interpreters (for flags read
  when torch imports torchcomms). Daemonic, SIGINT ignored, ``PR_SET_PDEATHSIG=SIGKILL`` on
  Linux so they die with their parent (the fork server exits with pytest), pytest's
  environment as of the request applied first. At start-up each calls ``torch.set_num_threads(1)``,
  points ``faulthandler`` (fatal signals and ``SIGUSR1``, all threads) at a per-worker dump
  file, connects one client ``TCPStore`` to the parent's server, freezes the GC and sends
  ``("ready", pid)``. Then it loops: receive a task, set the task's environment, build a
  :class:`RankContext` (fresh ``PrefixStore(f"task{id}", client)``), run ``fn(ctx, *args)``,
  restore environment and cwd, collect garbage, reply. An empty message or EOF ends it.
* **How errors travel.** A worker replies ``(task_id, "ok", pickled_return_value)`` or
  ``(task_id, "error", formatted_traceback)``; a return value that cannot be pickled is an
  error. A worker that dies is seen as its sentinel firing / EOF on its pipe, and its exit
  code or signal is reported. If some rank fails the parent keeps collecting the other
  ranks for at most :data:`FAILURE_GRACE_S` more seconds (so that every traceback is shown),
  never past the deadline. Ranks still running at the end are sent ``SIGUSR1`` and their
  faulthandler stack dumps are read back from the dump files into the message (so they
  show up in the assertion, not only in captured stderr). Everything is raised as one
  :class:`RankFailure`. The workers of the ranks that failed (error, death or timeout) are
  SIGKILLed and reaped, so later tasks run on fresh processes: a failing rank may leave
  broken state (half-open sockets, stuck threads) behind. The ranks of a failed task that
  returned normally stay in the pool: a test that kills one rank on purpose costs one
  spawn, not a whole world.

Functions are pickled by reference, so they must be module-level functions in an importable
module (``tests`` is a package and the repository root is on the workers' ``sys.path``).

``TORCHCOMM_TEST_TIMEOUT_SCALE`` (float, default 1) multiplies every timeout in this module.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = [
    "RankContext",
    "RankFailure",
    "free_port",
    "run_ranks",
    "run_torchrun",
    "shutdown",
    "timeout_scale",
]

MASTER_ADDR = "127.0.0.1"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_DIR = os.path.join(REPO_ROOT, "src")

#: After the first failed rank, wait at most this long (scaled) for the remaining ranks.
FAILURE_GRACE_S = 10.0
#: How long (scaled) new workers may take to import torch and connect to the store.
STARTUP_TIMEOUT_S = 120.0
#: Longest time given to stuck workers to write their SIGUSR1 stack dumps.
STACK_DUMP_WAIT_S = 1.0
#: A dump file that has not grown for this long is considered complete.
_DUMP_SETTLE_S = 0.1
#: Time (scaled) a worker gets to exit after a polite shutdown request before SIGKILL.
SHUTDOWN_GRACE_S = 5.0


def timeout_scale() -> float:
    """Return ``TORCHCOMM_TEST_TIMEOUT_SCALE`` (default 1) so slow CI boxes can stretch time."""
    raw = os.environ.get("TORCHCOMM_TEST_TIMEOUT_SCALE", "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"TORCHCOMM_TEST_TIMEOUT_SCALE must be a float, got {raw!r}") from None
    if not scale > 0:
        raise ValueError(f"TORCHCOMM_TEST_TIMEOUT_SCALE must be > 0, got {raw!r}")
    return scale


@dataclass
class RankContext:
    """What one rank of a task gets as first argument."""

    rank: int
    world_size: int
    #: ``PrefixStore(f"task{task_id}", client)``: keys never collide between tasks.
    store: Store
    master_addr: str
    #: A port nobody listens on yet, fresh per task, for store-less bootstrap tests.
    master_port: int
    #: A directory created for this task, shared by all its ranks.
    tmpdir: str
    task_id: int


class RankFailure(AssertionError):
    """One or more ranks raised, died or did not finish; the message shows all of them.

    Subclasses ``AssertionError`` so pytest reports it as a test failure with the full text.
    The structured attributes let tests of the harness assert on what happened.
    """

    def __init__(
        self,
        message: str,
        errors: Mapping[int, str] | None = None,
        timed_out: Sequence[int] = (),
        died: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        #: rank -> formatted traceback of the exception it raised
        self.errors: dict[int, str] = dict(errors or {})
        #: ranks that had not finished when the deadline passed
        self.timed_out: list[int] = list(timed_out)
        #: rank -> description of how its worker process died
        self.died: dict[int, str] = dict(died or {})


# --------------------------------------------------------------------------------------
# ports


_handed_out_ports: set[int] = set()
_port_lock = threading.Lock()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range
    (``transport.listen.free_master_port``: a store-less bootstrap's ``MASTER_PORT`` must
    not become a connection's local end between bootstraps).  The port is released before
    returning (someone else must bind it), so there is a small race with other processes;
    within this process a port is never handed out twice.
    """
    # Imported here: a spawned worker imports this module before its task's environment is
    # set, and must not import torchcomms then (flags read at its import).
    from torchcomms.transport import listen

    with _port_lock:
        port = listen.free_master_port(MASTER_ADDR, _handed_out_ports)
        _handed_out_ports.add(port)
        return port


# --------------------------------------------------------------------------------------
# worker side (runs in the spawned processes)


_SHUTDOWN = b""  # an empty message asks a worker to exit its loop


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this worker when the parent dies, so nothing outlives pytest."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def _worker_main(
    conn: multiprocessing.connection.Connection,
    store_port: int,
    dump_path: str,
    parent_pid: int | None,
    environ: dict[str, str],
) -> None:
    """Entry point of a worker process: start up, then serve tasks until told to stop.

    ``parent_pid``: pytest, for a spawned worker, which must exit if pytest already died
    (``None`` for a forked one: its parent is the fork server); ``environ``: pytest's
    environment when it asked for the worker (a forked worker would otherwise start from the
    fork server's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    _set_parent_death_signal()
    if parent_pid is not None and os.getppid() != parent_pid:  # died before prctl took effect
        os._exit(1)
    os.environ.clear()
    os.environ.update(environ)
    for path in (SRC_DIR, REPO_ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        torch.set_num_threads(1)
        # Kept open for the life of the process: faulthandler writes to its fd.
        dump_file = open(dump_path, "a")  # noqa: SIM115
        faulthandler.enable(file=dump_file, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
        client = TCPStore(MASTER_ADDR, store_port, is_master=False)
        gc.collect()
        gc.freeze()  # startup objects are permanent: keeps the per-task gc.collect() cheap
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("startup-error", traceback.format_exc()))
        raise
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if message == _SHUTDOWN:
            break
        reply = _execute_task(client, *pickle.loads(message))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    dump_file.close()


def _execute_task(
    client: TCPStore,
    task_id: int,
    rank: int,
    world_size: int,
    payload: bytes,
    env: Mapping[str, str | None],
    master_port: int,
    tmpdir: str,
    store_timeout_s: float,
) -> tuple[int, str, Any]:
    """Run one task in this worker; never raises, always returns the reply to send."""
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    try:
        _apply_env(
            {
                "TORCHCOMM_RANK": str(rank),
                "TORCHCOMM_SIZE": str(world_size),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": MASTER_ADDR,
                "MASTER_PORT": str(master_port),
            }
        )
        _apply_env(env)
        # A previous task may have changed the shared client's timeout; reset it per task.
        client.set_timeout(datetime.timedelta(seconds=store_timeout_s))
        ctx = RankContext(
            rank=rank,
            world_size=world_size,
            store=PrefixStore(f"task{task_id}", client),
            master_addr=MASTER_ADDR,
            master_port=master_port,
            tmpdir=tmpdir,
            task_id=task_id,
        )
        fn, args = pickle.loads(payload)
        result = fn(ctx, *args)
        del ctx
        try:
            data = pickle.dumps(result)
        except BaseException:
            return (
                task_id,
                "error",
                f"return value {type(result).__qualname__} could not be pickled:\n"
                + traceback.format_exc(),
            )
        return (task_id, "ok", data)
    except BaseException:  # SystemExit too: a rank calling sys.exit() is a failure
        return (task_id, "error", traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        with contextlib.suppress(OSError):
            os.chdir(saved_cwd)
        # The rank's prints belong to the test that is running now, not to a later one.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        gc.collect()  # drop process groups etc. created by the task now, not mid-next-task
        gc.freeze()  # e.g. modules the task imported: do not rescan them after every task


def _apply_env(env: Mapping[str, str | None]) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# --------------------------------------------------------------------------------------
# parent side


@dataclass
class _Worker:
    """The parent's handle on one worker process."""

    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    dump_path: str
    pid: int
    dump_offset: int = 0

    def alive(self) -> bool:
        return self.process.is_alive()

    def dump_size(self) -> int:
        try:
            return os.path.getsize(self.dump_path)
        except OSError:
            return 0

    def mark_dump_offset(self) -> None:
        self.dump_offset = self.dump_size()

    def read_dump(self) -> str:
        """Return what faulthandler wrote to this worker's dump file since the task began."""
        try:
            with open(self.dump_path, errors="replace") as f:
                f.seek(self.dump_offset)
                return f.read()
        except OSError:
            return ""

    def describe_exit(self) -> str:
        """Say how this worker's process ended (reaping it if it has)."""
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            return f"worker pid {self.pid} closed its pipe but is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"worker pid {self.pid} was killed by signal {name}"
        return f"worker pid {self.pid} exited with code {code}"


def _try_recv(conn: multiprocessing.connection.Connection) -> Any | None:
    """Receive one message, or return ``None`` if the other end is gone."""
    try:
        if not conn.poll():
            return None
        return conn.recv()
    except (EOFError, OSError):
        return None


def _spawn_workers(count: int, store_port: int, dump_dir: str, spawn: bool) -> list[_Worker]:
    """Start ``count`` workers at once and wait until ready.

    ``spawn``: brand-new interpreters (pristine, torch imported anew, the flags read at
    import time read again), else forked from the fork server."""
    if spawn:
        ctx: Any = multiprocessing.get_context("spawn")
        parent: int | None = os.getpid()
    else:
        # One fork server per pytest process, started at the first request; it imports torch
        # (and so torchcomms) once and nothing else runs in it.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tests.harness"])
        parent = None  # the fork server; it exits with pytest, and the worker with it
    workers: list[_Worker] = []
    try:
        for _ in range(count):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            dump_path = os.path.join(dump_dir, f"worker{next(_worker_ids)}.txt")
            process = ctx.Process(
                target=_worker_main,
                args=(child_conn, store_port, dump_path, parent, dict(os.environ)),
                name="harness-worker",
                daemon=True,
            )
            process.start()
            child_conn.close()  # so that EOF on parent_conn means the worker is gone
            workers.append(_Worker(process, parent_conn, dump_path, pid=process.pid or 0))
        _wait_ready(workers, time.monotonic() + STARTUP_TIMEOUT_S * timeout_scale())
    except BaseException:
        _kill_workers(workers)
        raise
    return workers


_worker_ids = itertools.count()


def _wait_ready(workers: list[_Worker], deadline: float) -> None:
    pending = dict(enumerate(workers))
    problems: dict[int, str] = {}
    while pending and not problems:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[Any] = [w.conn for w in pending.values()]
        waitables += [w.process.sentinel for w in pending.values()]
        ready = multiprocessing.connection.wait(waitables, timeout=remaining)
        for index, worker in list(pending.items()):
            if worker.conn not in ready and worker.process.sentinel not in ready:
                continue
            message = _try_recv(worker.conn)
            if message is None:
                problems[index] = worker.describe_exit()
            elif message[0] == "ready":
                del pending[index]
            else:
                problems[index] = f"failed to start:\n{message[1]}"
    for index in pending:
        problems.setdefault(index, f"worker pid {workers[index].pid} did not start in time")
    if problems:
        lines = [f"could not start {len(workers)} harness worker(s):"]
        lines += [f"--- {problems[i]}" for i in sorted(problems)]
        raise RankFailure("\n".join(lines))


def _kill_workers(workers: Sequence[_Worker]) -> None:
    """SIGKILL and reap: a discarded worker must leave no process (not even a zombie)."""
    for worker in workers:
        if worker.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
    for worker in workers:
        worker.process.join(timeout=5.0)
        worker.conn.close()


def _shutdown_workers(workers: Sequence[_Worker]) -> None:
    """Ask workers to exit cleanly (their atexit hooks run), then kill whatever is left."""
    if not workers:
        return
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.conn.send_bytes(_SHUTDOWN)
    try:
        scale = timeout_scale()
    except ValueError:  # reported elsewhere; shutting down must not fail because of it
        scale = 1.0
    deadline = time.monotonic() + SHUTDOWN_GRACE_S * scale
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
    _kill_workers(workers)


class _Harness:
    """Session-wide state of the parent: the store server, the temp root and the workers.

    ``pool[i]`` plays rank ``i`` in every task whose world size exceeds ``i``; the pool
    grows on demand, so a task of size N costs no spawn once N live workers exist.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: list[_Worker] = []
        self.task_ids = itertools.count(1)
        self._server: TCPStore | None = None
        self._root: str | None = None

    @property
    def server(self) -> TCPStore:
        if self._server is None:
            # Port 0: the kernel picks a free port, no race with other processes.
            self._server = TCPStore(MASTER_ADDR, 0, is_master=True, wait_for_workers=False)
        return self._server

    @property
    def root(self) -> str:
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="torchcomms-harness-")
            os.mkdir(os.path.join(self._root, "stacks"))
        return self._root

    def spawn(self, count: int, spawn: bool = False) -> list[_Worker]:
        return _spawn_workers(count, self.server.port, os.path.join(self.root, "stacks"), spawn)

    def acquire(self, world_size: int) -> list[_Worker]:
        """Return live workers for ranks ``0..world_size-1``, spawning the missing ones."""
        dead = [w for w in self.pool if not w.alive()]
        if dead:  # e.g. killed from outside between tasks
            self.discard(dead)
        if len(self.pool) < world_size:
            self.pool += self.spawn(world_size - len(self.pool))
        return self.pool[:world_size]

    def discard(self, workers: Sequence[_Worker]) -> None:
        """Kill the workers of a failed task; later tasks get freshly spawned ones."""
        _kill_workers(workers)
        gone = {id(w) for w in workers}
        # A worker learns its rank from each task, so the survivors just move up.
        self.pool = [w for w in self.pool if id(w) not in gone]

    def shutdown(self) -> None:
        with self.lock:
            workers, self.pool = self.pool, []
            _shutdown_workers(workers)
            self._server = None
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None


_harness = _Harness()
atexit.register(_harness.shutdown)


def shutdown() -> None:
    """Stop every pooled worker and remove the session temp root (idempotent)."""
    _harness.shutdown()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
    fresh: bool = False,
    spawn: bool = False,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; return the results indexed by rank.

    ``timeout`` (scaled by ``TORCHCOMM_TEST_TIMEOUT_SCALE``) is one deadline for the whole
    task, counted from when it is handed to the workers (starting workers is not counted).
    ``env`` entries are set in every rank for the duration of the task (``None`` unsets).
    ``fresh=True`` runs the task on brand-new processes (forked from the fork server) that
    are discarded afterwards, for tests that leave a process changed (pinned cores, signal
    handlers); ``spawn=True`` makes them brand-new interpreters, for flags read when torch
    imports torchcomms (implies ``fresh``). Raises :class:`RankFailure` if any rank raises,
    dies or misses the deadline; the workers of the ranks that did are killed (those that
    returned normally are kept).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"run_ranks needs a module-level function of an importable module and picklable "
            f"args; pickling {fn!r} failed: {exc}"
        ) from exc
    scale = timeout_scale()
    with _harness.lock:
        fresh = fresh or spawn
        workers = _harness.spawn(world_size, spawn) if fresh else _harness.acquire(world_size)
        try:
            results = _dispatch_task(
                workers, fn, payload, timeout * scale, dict(env or {}), FAILURE_GRACE_S * scale
            )
        except RankFailure as failure:
            # Ranks that returned normally are clean (their function ran to its end) and stay
            # in the pool: a test that kills one rank costs one new worker, not the world.
            bad = set(failure.errors) | set(failure.died) | set(failure.timed_out)
            finished = [w for rank, w in enumerate(workers) if rank not in bad]
            broken = [w for rank, w in enumerate(workers) if rank in bad]
            if fresh:
                _kill_workers(broken)
                _shutdown_workers(finished)
            else:
                _harness.discard(broken)
            raise
        except BaseException:  # e.g. KeyboardInterrupt: the workers are mid-task
            if fresh:
                _kill_workers(workers)
            else:
                _harness.discard(workers)
            raise
        if fresh:
            _shutdown_workers(workers)
        return results


def _dispatch_task(
    workers: list[_Worker],
    fn: Callable[..., Any],
    payload: bytes,
    timeout: float,
    env: dict[str, str | None],
    grace: float,
) -> list[Any]:
    """Hand one task to ``workers`` (index = rank) and collect every rank's outcome."""
    world_size = len(workers)
    task_id = next(_harness.task_ids)
    tmpdir = os.path.join(_harness.root, f"task{task_id}")
    os.mkdir(tmpdir)
    master_port = free_port()

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    died: dict[int, str] = {}
    pending: dict[int, _Worker] = {}
    for rank, worker in enumerate(workers):
        worker.mark_dump_offset()
        message = (task_id, rank, world_size, payload, env, master_port, tmpdir, timeout)
        try:
            worker.conn.send_bytes(pickle.dumps(message))
        except OSError:
            died[rank] = worker.describe_exit()
        else:
            pending[rank] = worker

    start = time.monotonic()
    deadline = start + timeout
    cut_short = False  # did a failure bring the deadline forward?
    grace_started = False
    while pending:
        now = time.monotonic()
        if (errors or died) and not grace_started:
            grace_started = True
            if now + grace < deadline:
                deadline, cut_short = now + grace, True
        if now >= deadline:
            break
        waitables: list[Any] = [w.conn for w in pending.values()]
        waitables += [w.process.sentinel for w in pending.values()]
        ready = multiprocessing.connection.wait(waitables, timeout=deadline - now)
        for rank, worker in list(pending.items()):
            if worker.conn not in ready and worker.process.sentinel not in ready:
                continue
            reply = _try_recv(worker.conn)
            if reply is None:
                died[rank] = worker.describe_exit()
                dump = worker.read_dump()  # e.g. a segfault's faulthandler traceback
                if dump:
                    died[rank] += f"; faulthandler output:\n{dump}"
                del pending[rank]
                continue
            reply_task, status, value = reply
            if reply_task != task_id:  # cannot happen: workers of failed tasks are killed
                continue
            del pending[rank]
            if status == "ok":
                try:
                    results[rank] = pickle.loads(value)
                except Exception:
                    errors[rank] = "return value could not be unpickled in the parent:\n" + (
                        traceback.format_exc()
                    )
            else:
                errors[rank] = value

    if not pending and not errors and not died:
        return [results[rank] for rank in range(world_size)]

    elapsed = time.monotonic() - start
    why = (
        f"still running {grace:.1f} s after another rank failed"
        if cut_short
        else f"no result within the {timeout:.1f} s timeout"
    )
    timed_out = sorted(pending)
    dumps = _dump_stacks({rank: pending[rank] for rank in timed_out})
    lines = [
        f"run_ranks({_name(fn)}, world_size={world_size}) failed (task {task_id}): "
        f"{len(errors)} raised, {len(died)} died, {len(timed_out)} timed out"
    ]
    for rank in range(world_size):
        if rank in errors:
            lines.append(f"--- rank {rank} raised:\n{errors[rank].rstrip()}")
        elif rank in died:
            lines.append(f"--- rank {rank} died: {died[rank].rstrip()}")
        elif rank in pending:
            lines.append(
                f"--- rank {rank} timed out ({why}, {elapsed:.1f} s into the task); "
                f"stack dump of worker pid {pending[rank].pid}:\n"
                f"{dumps[rank].rstrip() or '<no dump>'}"
            )
    raise RankFailure("\n".join(lines), errors=errors, timed_out=timed_out, died=died)


def _dump_stacks(stuck: dict[int, _Worker]) -> dict[int, str]:
    """SIGUSR1 the stuck workers and return what faulthandler wrote, by rank."""
    if not stuck:
        return {}
    for worker in stuck.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGUSR1)
    # faulthandler writes from its C signal handler within milliseconds; poll instead of
    # sleeping the whole second, and stop once every file has grown and then stayed put.
    deadline = time.monotonic() + STACK_DUMP_WAIT_S * timeout_scale()
    sizes: dict[int, int] = {}
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        now_sizes = {rank: w.dump_size() for rank, w in stuck.items()}
        if now_sizes != sizes:
            sizes, last_change = now_sizes, time.monotonic()
        elif (
            all(sizes[rank] > w.dump_offset for rank, w in stuck.items())
            and time.monotonic() - last_change >= _DUMP_SETTLE_S
        ):
            break
        time.sleep(0.02)
    return {rank: worker.read_dump() for rank, worker in stuck.items()}


def _name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", repr(fn))
    return f"{module}.{qualname}" if module else qualname


# --------------------------------------------------------------------------------------
# torchrun


def run_torchrun(
    script_or_module_args: list[str],
    nproc: int,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch.distributed.run`` on one node with a free master port.

    Returns the ``CompletedProcess`` with stdout and stderr merged into ``stdout`` (the
    caller asserts on ``returncode`` and output). On timeout (scaled) torchrun and every
    process it started are killed and :class:`RankFailure` carries the output so far.
    torchrun starts its workers in their own sessions, so killing its process group is not
    enough: descendants are found through ``/proc`` and killed too.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        MASTER_ADDR,
        "--master-port",
        str(free_port()),
        *script_or_module_args,
    ]
    child_env = dict(os.environ)
    python_path = [REPO_ROOT, SRC_DIR]
    if child_env.get("PYTHONPATH"):
        python_path.append(child_env["PYTHONPATH"])
    child_env["PYTHONPATH"] = os.pathsep.join(python_path)
    child_env.setdefault("OMP_NUM_THREADS", "1")  # also silences torchrun's warning about it
    child_env.update(env or {})
    timeout *= timeout_scale()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=child_env,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = _kill_tree(proc)
        raise RankFailure(
            f"torchrun timed out after {timeout:.1f} s: {' '.join(cmd)}\n--- output:\n{out}",
            timed_out=list(range(nproc)),
        ) from None
    except BaseException:  # e.g. KeyboardInterrupt: leave nothing running
        _kill_tree(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            # "pid (comm) state ppid ..." - comm may contain spaces and parentheses.
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_tree(proc: subprocess.Popen[str]) -> str:
    """Stop torchrun (SIGTERM first so it can forward it), then SIGKILL the whole tree."""
    victims = set(_descendants(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=3.0)
    victims.update(_descendants(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=10.0)
    except subprocess.TimeoutExpired:
        out = ""
    return out or ""
