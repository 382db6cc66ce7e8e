"""Run upstream torchcomms' integration test files, unmodified, against this package.

    python benchmarks/diagnostics/run_upstream_tests.py --mirror PATH \
        [--files 'comms/torchcomms/distwrap/tests/integration/*Test.py' ...] \
        [--support 'comms/torchcomms/tests/**/helpers/**' ...] \
        [--nproc 4] [--use-torchcomms 1|0|both] [--runner script|pytest|both] \
        [--timeout 300] [--in-place] [--backend gloo] [--device cpu] [--logs DIR]

``--mirror`` is upstream's repository: a bare git mirror (files are read at ``--rev``, default
``HEAD``) or a checkout.  ``--files`` are globs of repository paths (default: distwrap's 26
integration files); ``--support`` globs name files copied beside them but never run
(upstream's test helpers: the core suite needs ``comms/torchcomms/tests/__init__.py``,
``tests/integration/__init__.py``, ``tests/integration/helpers/*`` and
``tests/helpers/py/*``).  Each file is placed where upstream ships it inside the package
(``comms/torchcomms/X`` -> ``<torchcomms package>/X``), so its ``torchcomms.<...>`` imports
resolve as they do upstream; then, one file at a time, it runs under torchrun with
``TEST_BACKEND``/``TEST_DEVICE``/``USE_TORCHCOMMS`` set:

* ``script``: ``torchrun --nproc-per-node N File.py`` (the file's ``unittest.main()``);
* ``pytest``: ``torchrun --nproc-per-node N -m pytest File.py``: pytest imports the file as
  ``torchcomms.<...>.File``, so the ``torchcomms`` package is imported before
  ``torch.distributed``.

Placement: by default into a copy of the package (the one this interpreter imports) in a
temporary directory, put first on ``PYTHONPATH``, so the checkout, and anyone linting or
testing it meanwhile, never sees upstream's files.  ``--in-place`` copies them into the
package directory itself instead, only to paths that ``.gitignore`` lists (so a copy can never
be committed; the script refuses others).  Every copied file, every directory the script
created and the temporary tree are removed at the end, on failure and on Ctrl-C too.  A file
that already exists there (our own ``test_helpers.py``) is never overwritten.

Prints one row per file and mode (result, tests run / skipped as rank 0's runner counted
them, seconds) and the totals; exits 0 only if every run passed.  Each rank's output is kept
under ``--logs`` (default: a temporary directory, printed at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_FILES = ["comms/torchcomms/distwrap/tests/integration/*Test.py"]
UPSTREAM_PACKAGE = "comms/torchcomms/"


@dataclass
class Outcome:
    path: str
    use_torchcomms: str
    runner: str
    result: str  # pass | FAIL | TIMEOUT
    ran: int | None
    skipped: int
    seconds: float
    log_dir: Path


class Upstream:
    """Upstream's files, from a bare mirror (``git show``) or a checkout."""

    def __init__(self, root: Path, rev: str) -> None:
        self.root = root
        self.rev = rev
        probe = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--is-bare-repository"],
            capture_output=True,
            text=True,
        )
        self.bare = probe.returncode == 0 and probe.stdout.strip() == "true"

    def paths(self) -> list[str]:
        if self.bare:
            out = subprocess.run(
                ["git", "-C", str(self.root), "ls-tree", "-r", "--name-only", self.rev],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return out.split()
        return [str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()]

    def read(self, path: str) -> bytes:
        if self.bare:
            return subprocess.run(
                ["git", "-C", str(self.root), "show", f"{self.rev}:{path}"],
                capture_output=True,
                check=True,
            ).stdout
        return (self.root / path).read_bytes()

    def select(self, patterns: list[str]) -> list[str]:
        every = self.paths()
        found = sorted({p for p in every for pat in patterns if fnmatch.fnmatchcase(p, pat)})
        return found


def package_dir() -> Path:
    """This interpreter's ``torchcomms`` package directory (found without importing it)."""
    spec = importlib.util.find_spec("torchcomms")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torchcomms is not importable in this interpreter (activate the venv)")
    return Path(next(iter(spec.submodule_search_locations)))


def is_git_ignored(path: Path) -> bool:
    probe = subprocess.run(
        ["git", "-C", str(path.parent), "check-ignore", "-q", "--no-index", str(path)],
        capture_output=True,
    )
    if probe.returncode == 128:  # not in a git work tree: nothing could commit it
        return True
    return probe.returncode == 0


class Placement:
    """Puts upstream's files into a package tree and takes them out again."""

    def __init__(self, package: Path, in_place: bool) -> None:
        self.package = package
        self.in_place = in_place
        self.created_files: list[Path] = []
        self.created_dirs: list[Path] = []

    def target(self, upstream_path: str) -> Path:
        if not upstream_path.startswith(UPSTREAM_PACKAGE):
            sys.exit(f"{upstream_path}: not under {UPSTREAM_PACKAGE}")
        return self.package / upstream_path[len(UPSTREAM_PACKAGE) :]

    def place(self, upstream_path: str, data: bytes) -> Path | None:
        """The copy's path; None where a file of ours already sits there (kept)."""
        dest = self.target(upstream_path)
        if dest.exists():
            return None
        if self.in_place and not is_git_ignored(dest):
            raise SystemExit(
                f"refusing to copy {upstream_path} to {dest}: that path is not in .gitignore "
                "(add it there, or run without --in-place)"
            )
        missing = [d for d in [dest.parent, *dest.parent.parents] if not d.exists()]
        for d in reversed(missing):
            d.mkdir()
            self.created_dirs.append(d)
        dest.write_bytes(data)
        self.created_files.append(dest)
        return dest

    def remove(self) -> None:
        for f in self.created_files:
            f.unlink(missing_ok=True)
            cache = f.parent / "__pycache__"
            for pyc in cache.glob(f"{f.stem}.*.pyc") if cache.is_dir() else []:
                pyc.unlink(missing_ok=True)
        for d in reversed(self.created_dirs):
            shutil.rmtree(d, ignore_errors=True)
        self.created_files.clear()
        self.created_dirs.clear()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from ``/proc``; torchrun's workers leave its group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a timed-out torchrun: SIGTERM (it stops its workers), then SIGKILL what is left."""
    below = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    for pid in [proc.pid, *below]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def check_imported(package: Path, env_extra: dict[str, str]) -> None:
    """Exit unless a child interpreter with ``env_extra`` imports ``package``."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torchcomms; print(torchcomms.__file__)"],
        env={**os.environ, **env_extra},
        cwd=package.parent,
        capture_output=True,
        text=True,
    )
    found = Path(probe.stdout.strip()).parent if probe.returncode == 0 else None
    if found != package:
        sys.exit(f"a child imports torchcomms from {found or probe.stderr}, not {package}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_RAN = re.compile(r"^Ran (\d+) tests? in", re.M)
_UNITTEST_SKIPPED = re.compile(r"^(?:OK|FAILED) \(.*?skipped=(\d+)", re.M)
_PYTEST_SUMMARY = re.compile(r"^(?:=+ )?(\d+ \w+(?:, \d+ \w+)*) in [\d.]+s", re.M)


def count(runner: str, text: str) -> tuple[int | None, int]:
    """(tests run, skipped) from rank 0's runner output."""
    if runner == "script":
        ran = _RAN.findall(text)
        skipped = _UNITTEST_SKIPPED.findall(text)
        return (int(ran[-1]) if ran else None), (int(skipped[-1]) if skipped else 0)
    summary = _PYTEST_SUMMARY.findall(text)
    if not summary:
        return None, 0
    parts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (\w+)", summary[-1]))
    total = sum(parts.get(k, 0) for k in ("passed", "failed", "error", "errors", "skipped"))
    return total, parts.get("skipped", 0)


def rank_text(log_dir: Path, rank: int) -> str:
    text = []
    for name in ("stderr.log", "stdout.log"):
        for f in sorted(log_dir.rglob(f"{rank}/{name}")):
            text.append(f.read_text(errors="replace"))
    return "\n".join(text)


def run_one(
    test_file: Path,
    upstream_path: str,
    args: argparse.Namespace,
    use_tc: str,
    runner: str,
    cwd: Path,
    env_extra: dict[str, str],
    log_root: Path,
) -> Outcome:
    log_dir = log_root / f"{test_file.stem}.tc{use_tc}.{runner}"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.nproc),
        "--master-port",
        str(free_port()),
        "--log-dir",
        str(log_dir),
        "--redirects",
        "3",
    ]
    if runner == "pytest":
        cmd += ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    else:
        cmd += [str(test_file)]
    env = dict(os.environ)
    env.update(env_extra)
    env.update(
        TEST_BACKEND=args.backend,
        TEST_DEVICE=args.device,
        USE_TORCHCOMMS=use_tc,
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    start = time.monotonic()
    with open(log_dir / "torchrun.log", "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=args.timeout)
            result = "pass" if rc == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            result = "TIMEOUT"
            stop(proc)
    seconds = time.monotonic() - start
    ran, skipped = count(runner, rank_text(log_dir, 0))
    return Outcome(upstream_path, use_tc, runner, result, ran, skipped, seconds, log_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", required=True, type=Path, help="upstream repo (bare or not)")
    parser.add_argument("--rev", default="HEAD", help="revision of a bare mirror")
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="path globs")
    parser.add_argument("--support", nargs="*", default=[], help="globs copied, never run")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--use-torchcomms", choices=("1", "0", "both"), default="1")
    parser.add_argument("--runner", choices=("script", "pytest", "both"), default="script")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--in-place", action="store_true", help="copy into the package itself (gitignored paths)"
    )
    parser.add_argument("--logs", type=Path, default=None, help="keep rank logs here")
    args = parser.parse_args()

    upstream = Upstream(args.mirror, args.rev)
    paths = upstream.select(args.files)
    if not paths:
        sys.exit(f"no upstream file matches {args.files}")
    support = [p for p in upstream.select(args.support) if p not in paths] if args.support else []
    log_root = args.logs or Path(tempfile.mkdtemp(prefix="upstream-tests-"))
    modes = ["1", "0"] if args.use_torchcomms == "both" else [args.use_torchcomms]
    runners = ["script", "pytest"] if args.runner == "both" else [args.runner]

    temp_root: Path | None = None
    package = package_dir()
    env_extra: dict[str, str] = {}
    outcomes: list[Outcome] = []
    total_start = time.monotonic()
    placement: Placement | None = None
    try:
        if not args.in_place:
            temp_root = Path(tempfile.mkdtemp(prefix="upstream-tree-"))
            shutil.copytree(
                package, temp_root / "torchcomms", ignore=shutil.ignore_patterns("__pycache__")
            )
            package = temp_root / "torchcomms"
            env_extra["PYTHONPATH"] = os.pathsep.join(
                [str(temp_root), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
            check_imported(package, env_extra)
        cwd = package.parent
        placement = Placement(package, in_place=temp_root is None)
        placed: list[tuple[str, Path]] = []
        for path in paths:
            dest = placement.place(path, upstream.read(path))
            if dest is None:
                print(f"kept ours: {placement.target(path)} (not overwritten)")
            elif path.endswith(".py") and Path(path).name != "__init__.py":
                placed.append((path, dest))
        for path in support:
            if placement.place(path, upstream.read(path)) is None:
                print(f"kept ours: {placement.target(path)} (not overwritten)")
        tests = [(p, d) for p, d in placed if fnmatch.fnmatchcase(Path(p).name, "*Test*.py")]
        for use_tc in modes:
            for runner in runners:
                for path, dest in tests:
                    o = run_one(dest, path, args, use_tc, runner, cwd, env_extra, log_root)
                    outcomes.append(o)
                    ran = "?" if o.ran is None else str(o.ran)
                    print(
                        f"{Path(path).name:48} USE_TORCHCOMMS={use_tc} {runner:6} "
                        f"{o.result:7} tests={ran:>3} skipped={o.skipped:<2} {o.seconds:6.1f}s",
                        flush=True,
                    )
    finally:
        if placement is not None:
            placement.remove()
        if temp_root is not None:
            shutil.rmtree(temp_root, ignore_errors=True)

    print()
    print(f"{'mode':28} {'files passed':>13} {'failed':>7} {'tests run':>10} {'skipped':>8}")
    for use_tc in modes:
        for runner in runners:
            rows = [o for o in outcomes if o.use_torchcomms == use_tc and o.runner == runner]
            passed = sum(o.result == "pass" for o in rows)
            tests_run = sum(o.ran or 0 for o in rows)
            skipped = sum(o.skipped for o in rows)
            label = f"USE_TORCHCOMMS={use_tc} {runner}"
            print(
                f"{label:28} {passed:>6}/{len(rows):<6} {len(rows) - passed:>7} {tests_run:>10} "
                f"{skipped:>8}"
            )
    failed = [o for o in outcomes if o.result != "pass"]
    for o in failed:
        print(f"{o.result}: {o.path} USE_TORCHCOMMS={o.use_torchcomms} {o.runner}: {o.log_dir}")
    print(
        f"nproc={args.nproc} backend={args.backend} device={args.device} "
        f"total {time.monotonic() - total_start:.0f}s; logs: {log_root}"
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
