"""The package's shape, read from the source: no import cycles, layers in order, small modules,
one rank vocabulary.

The package rules each ``__init__`` docstring states (``backends/__init__.py``,
``backends/cpu/__init__.py``, ``transport/__init__.py``, ...) are checked here.

Every ``torchcomms`` import counts, including those under ``if TYPE_CHECKING:`` and
inside functions: a cycle hidden in a function is still a cycle in the design.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "torchcomms"
#: No module is longer: past it, split by concern.
MAX_LINES = 600
#: Modules directly in ``src/torchcomms`` (besides ``__init__``), and directly in any package.
MAX_TOP_LEVEL = 24
MAX_PER_PACKAGE = 12

#: Modules above ``TorchComm``: the bridge, the tools at the edge.  Nothing in ``hooks/``,
#: ``backends/`` or ``transport/`` may import them.
_ABOVE_COMM = (
    "torchcomms._backend_wrapper",
    "torchcomms._comms",
    "torchcomms.device_mesh",
    "torchcomms.distwrap",
    "torchcomms.bench",
    "torchcomms.tools",
    "torchcomms.objcol",
    "torchcomms.bridge",
)
#: The bridge's one module read from below ``TorchComm``: what c10d gave the group being
#: created (the CPU backend's bootstrap reads the explicit ranks); it imports nothing of ours.
_READ_FROM_BELOW = {"torchcomms.bridge.c10d_caller"}
#: Layers below ``TorchComm``: they may not import ``torchcomms.comm`` or its parts.
_BELOW_COMM = ("torchcomms.backends", "torchcomms.transport")
_COMM = ("torchcomms.comm", "torchcomms.comm.core", "torchcomms.comm.ops")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The torchcomms modules ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            # ``from torchcomms import config`` imports the module config (the package is
            # already initialising); ``from torchcomms import new_comm`` needs the package.
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return {m for m in out if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_import_cycles() -> None:
    graph = _graph()
    assert "torchcomms.comm" in graph and "torchcomms.backends.cpu.backend" in graph
    assert _cycles(graph) == []


def test_a_package_is_not_a_cycle_with_its_own_modules() -> None:
    # The checker itself: a package __init__ importing its submodule is not a cycle unless
    # the submodule imports the package back.
    graph = {"p": {"p.a"}, "p.a": set(), "q": {"q.b"}, "q.b": {"q"}}
    assert _cycles(graph) == [["q", "q.b"]]


def test_layers_import_downwards_only() -> None:
    graph = _graph()
    wrong = []
    for module, imported in sorted(graph.items()):
        below_hooks = _under(module, ("torchcomms.hooks",))
        below_comm = _under(module, _BELOW_COMM)
        for target in sorted(imported):
            above = _under(target, _ABOVE_COMM) and target not in _READ_FROM_BELOW
            if (below_hooks or below_comm) and above:
                wrong.append(f"{module} -> {target}")
            if below_comm and _under(target, (*_COMM, "torchcomms.hooks")):
                wrong.append(f"{module} -> {target}")
    assert wrong == []
    assert [graph[m] for m in sorted(_READ_FROM_BELOW)] == [set()] * len(_READ_FROM_BELOW)


def test_no_module_over_the_size_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: s for n, s in sorted(sizes.items()) if s > MAX_LINES} == {}


def test_folders_stay_small_enough_to_read() -> None:
    """At most ``MAX_TOP_LEVEL`` modules at the top of the package (upstream's module paths
    and the shared vocabulary), at most ``MAX_PER_PACKAGE`` in any package below it."""
    crowded = {}
    for folder in [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))]:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        limit = MAX_TOP_LEVEL if folder == PACKAGE else MAX_PER_PACKAGE
        if count > limit:
            crowded[str(folder.relative_to(SRC))] = count
    assert crowded == {}


#: Classes named for a transport that are not byte movers of ``torchcomms.transport``:
#: upstream's own names, kept.
_TRANSPORT_NAMES_KEPT = {
    # torchft's ``CheckpointTransport`` interface, implemented over our RDMA transport.
    "torchcomms.ft.checkpoint.RdmaCheckpointTransport",
}


def test_transport_names_only_the_byte_movers() -> None:
    """"transport" in a module or class name means the byte movers (``torchcomms.transport``
    and upstream's ``torchcomms._transport`` over it), never an ops object."""
    wrong = []
    movers = ("torchcomms.transport", "torchcomms._transport")
    for name, path in sorted(_modules().items()):
        if "transport" in name.lower() and not _under(name, movers):
            wrong.append(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and "transport" in node.name.lower():
                qualified = f"{name}.{node.name}"
                if not _under(name, movers) and qualified not in _TRANSPORT_NAMES_KEPT:
                    wrong.append(qualified)
    assert wrong == []


def test_each_op_runs_the_code_its_name_finds() -> None:
    """``TorchComm.<op>`` is a function written in a file of the package: ``inspect``,
    tracebacks and go-to-definition land on the code that checks and issues the op."""
    import inspect

    from torchcomms import TorchComm, optable

    for entry in optable.OPS:
        method = getattr(TorchComm, entry.method)
        where = Path(inspect.getsourcefile(method) or "")
        assert where.is_file() and PACKAGE in where.parents, entry.method
        source = inspect.getsource(method)
        assert f"def {entry.method}(" in source, entry.method
        assert f"self._backend.{entry.method}" in source, entry.method
        assert f"checks.check_{entry.method}(" in source, entry.method


#: What ``transport`` may import outside itself: the leaf core modules (and ``errors`` for
#: ``transport.rdma``, which raises to the user with no backend between).
_TRANSPORT_MAY_IMPORT = (
    "torchcomms.transport",
    "torchcomms.config",
    "torchcomms.runtime.deadline",
    "torchcomms.runtime.fingerprint",
    "torchcomms.ranks",
    "torchcomms.types",
)
#: Packages that must not import each other (either direction), and one-way bans.
_APART = (
    ("torchcomms.backends.cpu.shm", "torchcomms.backends.cpu.tcp"),
    ("torchcomms.transport.shm", "torchcomms.transport.tcp"),
    ("torchcomms.transport.shm", "torchcomms.transport.gloo"),
    ("torchcomms.transport.tcp", "torchcomms.transport.gloo"),
    *[
        ("torchcomms.transport.rdma", f"torchcomms.transport.{p}")
        for p in ("tcp", "gloo", "window")
    ],
)
_NEVER = {
    "torchcomms.backends.cpu.window": (
        "torchcomms.backends.cpu.shm",
        "torchcomms.backends.cpu.tcp",
        "torchcomms.backends.cpu.recovery",
    ),
    "torchcomms.backends.cpu.recovery": (
        "torchcomms.backends.cpu.shm",
        "torchcomms.backends.cpu.tcp",
        "torchcomms.backends.cpu.window",
    ),
    "torchcomms.transport.window": ("torchcomms.transport.tcp", "torchcomms.transport.gloo"),
}
#: The CPU backend's top-level modules that may reach into its transport sub-packages.
_CPU_CHOOSERS = {
    "torchcomms.backends.cpu.backend",
    "torchcomms.backends.cpu.select",
}
#: Its sub-packages, and ``hier.ops`` (``HierOps``): ``hier``'s other modules
#: (``leaders``, ``members``) serve every transport and sit with the top level.
_CPU_SUBPACKAGES = tuple(
    f"torchcomms.backends.cpu.{p}" for p in ("shm", "tcp", "window", "recovery", "hier.ops")
)


def test_transport_imports_only_itself_and_leaf_modules() -> None:
    wrong = [
        f"{module} -> {target}"
        for module, imported in sorted(_graph().items())
        if _under(module, ("torchcomms.transport",))
        for target in sorted(imported)
        if not _under(target, _TRANSPORT_MAY_IMPORT)
        and not (_under(module, ("torchcomms.transport.rdma",)) and target == "torchcomms.errors")
    ]
    assert wrong == []


def test_sibling_packages_stay_apart() -> None:
    graph = _graph()
    wrong = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            for a, b in _APART:
                if (_under(module, (a,)) and _under(target, (b,))) or (
                    _under(module, (b,)) and _under(target, (a,))
                ):
                    wrong.append(f"{module} -> {target}")
            for package, banned in _NEVER.items():
                if _under(module, (package,)) and _under(target, banned):
                    wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_only_the_cpu_choosers_reach_into_its_sub_packages() -> None:
    # ``hier.ops`` is the one ops class that delegates to both transports; ``select``
    # picks one; ``backend`` owns the result.  The shared modules (dispatch, ops, staging,
    # ``hier.leaders``, ``hier.members``, ...) stay below.
    graph = _graph()
    wrong = [
        f"{module} -> {target}"
        for module, imported in sorted(graph.items())
        if module.startswith("torchcomms.backends.cpu.")
        and not _under(module, _CPU_SUBPACKAGES)
        and module not in _CPU_CHOOSERS
        for target in sorted(imported)
        if _under(target, _CPU_SUBPACKAGES)
    ]
    assert wrong == []
    assert graph["torchcomms.backends.cpu.hier.ops"] & {
        "torchcomms.backends.cpu.shm.ops",
        "torchcomms.backends.cpu.tcp.ops",
    } == {"torchcomms.backends.cpu.shm.ops", "torchcomms.backends.cpu.tcp.ops"}


def test_every_package_says_what_it_owns_and_may_import() -> None:
    silent = []
    for name, path in sorted(_modules().items()):
        if path.name != "__init__.py" or name == "torchcomms":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "import" not in doc.lower():
            silent.append(name)
    assert silent == []


def test_public_names_are_public_and_importable() -> None:
    import torchcomms

    assert [n for n in torchcomms.__all__ if n.startswith("_")] == []
    assert [n for n in torchcomms.__all__ if not hasattr(torchcomms, n)] == []
    assert {"AbortReason", "AbortInfo", "BackendNotImplementedError"} <= set(torchcomms.__all__)
    # The public import paths stay where users find them.
    import torchcomms.bench
    import torchcomms.device_mesh
    import torchcomms.functional
    import torchcomms.hooks
    import torchcomms.objcol
    import torchcomms.tools


#: The one module that names, encodes and parses rank lists; it imports nothing of ours.
_RANK_VOCABULARY = "torchcomms.ranks"
#: What a function of its own would be called: ``ranks_text``, ``encode_ranks``, ...
_RANK_FUNCTION = re.compile(
    r"ranks?_(text|str|format|encode|decode|parse)|(text|format|encode|decode|parse)_ranks?", re.I
)

#: What a rank set decodes to: a generic ``decode`` returning one is a rank codec.
_RANK_SETS = ("set[int]", "frozenset[int]", "list[int]", "tuple[int, ...]")


def _rank_vocabulary_copies(name: str, tree: ast.AST) -> list[str]:
    """Functions of ``name`` that format, encode or parse rank lists; regex rewrites of text."""
    rewrites = _under(name, ("torchcomms.backends", "torchcomms.transport"))
    patterns = set()  # module-level names bound to re.compile(...)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr == "compile":
                patterns.update(t.id for t in node.targets if isinstance(t, ast.Name))
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            args = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            returns = ast.unparse(node.returns) if node.returns else ""
            of_ranks = any("rank" in x for x in args) or returns in _RANK_SETS
            generic = re.fullmatch(r"_?(encode|decode|parse|format)", node.name)
            if _RANK_FUNCTION.search(node.name) or (generic and of_ranks):
                wrong.append(f"{name}.{node.name} (line {node.lineno})")
        elif rewrites and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            pattern = isinstance(f.value, ast.Name) and f.value.id in ("re", *patterns)
            if f.attr in ("sub", "subn") and pattern:
                wrong.append(f"{name}: {ast.unparse(f)} rewrites text (line {node.lineno})")
    return wrong


def test_one_rank_vocabulary() -> None:
    """Rank lists are named (``ranks_text``), encoded and parsed in ``torchcomms.ranks`` only,
    a leaf every layer may import.  No other module defines its own formatter or codec, and
    no backend or transport rewrites another layer's message with a regex: an error carries
    its ranks as data (``WaitError.ranks``, ``WaitError.message``) and a layer that numbers
    ranks differently renders the message with its numbering."""
    graph = _graph()
    assert graph[_RANK_VOCABULARY] == set()
    wrong = [
        found
        for name, path in sorted(_modules().items())
        if name != _RANK_VOCABULARY
        for found in _rank_vocabulary_copies(name, ast.parse(path.read_text(), str(path)))
    ]
    assert wrong == []


def test_the_rank_vocabulary_check_finds_copies() -> None:
    # The checker itself, on a module that has each kind of copy.
    source = """
import re
_RANKS = re.compile(r"ranks? (\\d+)")
def encode_ranks(ranks): ...
def decode(text, ranks): ...
def parse(text) -> frozenset[int]: ...
def _ranks_text(rs): ...
def fix(msg): return _RANKS.sub("x", msg) + re.sub("a", "b", msg)
def encode(self): ...
"""
    found = _rank_vocabulary_copies("torchcomms.backends.cpu.x", ast.parse(source))
    assert [f.split(" ")[0] for f in found] == [
        "torchcomms.backends.cpu.x.encode_ranks",
        "torchcomms.backends.cpu.x.decode",
        "torchcomms.backends.cpu.x.parse",
        "torchcomms.backends.cpu.x._ranks_text",
        "torchcomms.backends.cpu.x:",
        "torchcomms.backends.cpu.x:",
    ]


def _op_names() -> set[str]:
    from torchcomms import optable

    return {e.method for e in optable.OPS} | {optable.BATCH.method}


def _per_op_lists(tree: ast.AST, ops: set[str]) -> list[int]:
    """Lines of collection literals naming three or more ops (as strings or ``OpName.x``);
    ``__all__`` (public names that may share an op's name) does not count."""
    exports = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in exports:
            continue
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items: list[ast.expr] = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        named = [
            item
            for item in items
            if (isinstance(item, ast.Constant) and item.value in ops)
            or (isinstance(item, ast.Attribute) and item.attr in ops)
        ]
        if len(named) >= 3:
            found.append(node.lineno)
    return found


def test_the_op_table_is_the_only_per_op_list() -> None:
    """Each op is declared once, in ``torchcomms.optable``; every other per-op fact is derived
    from it, so no other module lists ops (three or more op names in one literal)."""
    ops = _op_names()
    lists = {
        name: lines
        for name, path in sorted(_modules().items())
        if not _under(name, ("torchcomms.optable",))
        and (lines := _per_op_lists(ast.parse(path.read_text()), ops))
    }
    assert lists == {}


def test_the_per_op_list_check_finds_a_list() -> None:
    ops = _op_names()
    assert _per_op_lists(ast.parse("X = (OpName.send, OpName.recv, OpName.barrier)"), ops) == [1]
    assert _per_op_lists(ast.parse("X = {'all_reduce': 1, 'reduce': 2, 'gather': 3}"), ops) == [1]
    assert _per_op_lists(ast.parse("X = ('all_reduce', 'put', 'get')"), ops) == []
