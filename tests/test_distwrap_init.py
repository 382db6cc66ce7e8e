"""``torchcomms.distwrap``: the module's surface and every ``init_process_group`` variant.

The argument checks (backend strings, rank and size from the environment, refused calls)
run in this process: they fail before anything is initialised.  The init variants run in
one task of two ranks, each case initialising a world (``use_torchcomms`` on or off),
checking it with a collective and destroying it (``tests/distwrap_cases.py``).
"""

from __future__ import annotations

import ast
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import PrefixStore

from tests.distwrap_cases import Cases
from tests.harness import RankContext
from torchcomms import distwrap as dist
from torchcomms._backend_wrapper import _BackendWrapper
from torchcomms.distwrap import utils
from torchcomms.distwrap.pginfo import pg_info_get_group_desc

WORLD = 2

# -- the module's surface (in process) -------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "get_rank",
        "get_world_size",
        "is_initialized",
        "is_available",
        "get_process_group_ranks",
        "ProcessGroup",
        "ProcessGroupGloo",
        "GroupMember",
        "ReduceOp",
        "group",
        "Store",
        "HashStore",
        "Work",
    ],
)
def test_forwarded_names_are_torch_distributed_s(name: str) -> None:
    assert getattr(dist, name) is getattr(tdist, name)


def test_every_exported_name_resolves_and_the_rest_is_forwarded() -> None:
    assert [n for n in dist.__all__ if not hasattr(dist, n)] == []
    upstream = {
        "init_process_group", "destroy_process_group", "new_group", "split_group",
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
        "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
        "scatter", "gather", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
        "all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list",
        "get_mem_allocator", "register_mem_pool", "new_window", "reduce_scatter_quantized",
        "_make_nccl_premul_sum", "P2POp",
    }  # fmt: skip
    assert upstream <= set(dist.__all__)
    assert all(callable(getattr(dist, n)) for n in upstream)
    # Names distwrap does not define are torch.distributed's.
    assert dist.get_backend is tdist.get_backend
    assert dist.TCPStore is tdist.TCPStore
    with pytest.raises(AttributeError, match="has no attribute 'nonexistent_attribute'"):
        _ = dist.nonexistent_attribute


def test_torchcomms_init_does_not_import_distwrap() -> None:
    # torchcomms/__init__ runs while torch.distributed is half initialised (DESIGN.md);
    # distwrap imports torch.distributed, so it is loaded on demand only.
    init = Path(__file__).resolve().parents[1] / "src" / "torchcomms" / "__init__.py"
    tree = ast.parse(init.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "distwrap" not in names and "torchcomms.distwrap" not in modules
    import torchcomms

    assert torchcomms.distwrap is dist  # loaded by this module's import, as a sub-package


# -- backend strings -------------------------------------------------------------------------


def test_backend_strings_parse_as_upstream() -> None:
    parse = utils.parse_backend_string
    assert parse("gloo") == {"cpu": "gloo"}
    assert parse("nccl") == {"cuda": "nccl"}
    assert parse("ncclx") == {"cuda": "ncclx"}
    assert parse("hccl") == {"mtia": "hccl"}
    assert parse("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse(" cpu : gloo , cuda : ncclx ") == {"cpu": "gloo", "cuda": "ncclx"}
    assert parse(tdist.Backend("gloo")) == {"cpu": "gloo"}
    # torch is given the caller's string unless a name needs renaming.
    assert utils._dist_backend_string("gloo", {"cpu": "gloo"}) == "gloo"
    assert utils._dist_backend_string("cpu:gloo,cuda:ncclx", parse("cpu:gloo,cuda:ncclx")) == (
        "cpu:gloo,cuda:nccl"
    )


@pytest.mark.parametrize(
    ("backend", "error", "text"),
    [
        ("foo", ValueError, "Unknown backend: 'foo'. Known backends are: gloo, hccl, nccl"),
        ("", ValueError, "Unknown backend: ''"),
        ("gpu:nccl", ValueError, "Invalid device type 'gpu' in backend string 'gpu:nccl'"),
        ("cpu:gloo,cuda0:nccl", ValueError, "Invalid device type 'cuda0'"),
        ("cpu:gloo,cuda:0:nccl", ValueError, "must have exactly one colon"),
        ("cpu:", ValueError, "the backend name is empty"),
        ("cpu:gloo,cpu:gloo", ValueError, "device type 'cpu' appears twice"),
        (3, TypeError, "backend must be a str, got int"),
    ],
)
def test_bad_backend_strings_are_refused(backend: object, error: type, text: str) -> None:
    with pytest.raises(error, match=text.replace("(", r"\(")):
        utils.parse_backend_string(backend)


def test_pg_options_become_hints() -> None:
    opts = tdist.ProcessGroupGloo._Options()
    opts.group_name = "g1"
    hints = utils._pg_options_to_hints(opts)
    assert hints is not None and hints["group_name"] == "g1" and "backend" in hints
    assert utils._pg_options_to_hints(None) is None
    assert utils._pg_options_to_hints({"a": 1}) == {"a": "1"}


# -- rank and world size from the environment ------------------------------------------------

_ALL_VARS = [v for pair in utils._RANK_ENV_PAIRS for v in pair]


@pytest.mark.parametrize(
    ("set_vars", "expected"),
    [
        ({"RANK": "1", "WORLD_SIZE": "4"}, (1, 4)),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "RANK": "0"}, (2, 3)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (5, 8)),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, (0, 2)),
        # Each of rank and size is taken from the first variable of its kind that is set.
        ({"SLURM_PROCID": "1", "WORLD_SIZE": "2"}, (1, 2)),
    ],
)
def test_rank_and_size_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, set_vars: dict[str, str], expected: tuple[int, int]
) -> None:
    for var in _ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in set_vars.items():
        monkeypatch.setenv(var, value)
    assert utils.get_rank_and_world_size(-1, -1) == expected
    # Arguments win over the environment.
    assert utils.get_rank_and_world_size(0, 1) == (0, 1)


def test_rank_and_size_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(AssertionError, match="rank must be specified either as a parameter"):
        utils.get_rank_and_world_size(-1, 2)
    with pytest.raises(AssertionError, match="world_size must be specified either as a param"):
        utils.get_rank_and_world_size(0, -1)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="environment variable RANK must be an integer"):
        utils.get_rank_and_world_size(-1, 2)
    with pytest.raises(ValueError, match=r"rank 2 is outside the world: expected 0 <= rank < 2"):
        utils.get_rank_and_world_size(2, 2)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        utils.get_rank_and_world_size(0, 0)


# -- pginfo and the lookups (in process, on stand-in group keys) -----------------------------


def test_pginfo_records_and_upstream_s_errors() -> None:
    from torchcomms.distwrap import pginfo

    pg = tdist.HashStore()  # any hashable object keys the registry; no world needed
    with pytest.raises(AssertionError, match="not registered"):
        pginfo.pg_info_assert_registered(pg)
    assert pginfo.pg_info_get(pg) is None
    pginfo.pg_info_create(pg, [4, 2, 7], None)
    try:
        with pytest.raises(AssertionError, match="already registered"):
            pginfo.pg_info_create(pg, [4], "again")
        assert pginfo.pg_info_get_global_ranks(pg) == [4, 2, 7]
        assert pginfo.pg_info_get_rank_map(pg) == {4: 0, 2: 1, 7: 2}
        assert pginfo.pg_info_get_group_desc(pg) == ""
        with pytest.raises(AssertionError, match="Key 'torchcomms' not found"):
            pginfo.pg_info_get_data(pg, "torchcomms")
        pginfo.pg_info_set_data(pg, "device_backends", {"cpu": "gloo"})
        assert utils.get_backend_for_device(pg, "cpu") == "gloo"
        with pytest.raises(AssertionError, match="Device type 'cuda' not found"):
            utils.get_backend_for_device(pg, "cuda")
        assert utils.get_group_rank(pg, 7) == 2
        with pytest.raises(ValueError, match=r"Global rank 3 is not in process group\. Group "
                                             r"ranks: \[4, 2, 7\]"):  # fmt: skip
            utils.get_group_rank(pg, 3)
        with pytest.raises(ValueError, match="Either device_type or tensor must be provided"):
            utils.get_torchcomms_instance(pg)
        pginfo.pg_info_set_data(pg, "torchcomms", {})
        with pytest.raises(AssertionError, match="No torchcomms instances found"):
            utils.get_torchcomms_instance(pg, tensor=torch.zeros(1))
        marker = object()
        pginfo.pg_info_set_data(pg, "torchcomms", {"cpu": marker})
        assert utils.get_torchcomms_instance(pg, tensor=torch.zeros(1)) is marker
        with pytest.raises(ValueError, match=r"No torchcomms instance for device type 'meta'\. "
                                             r"Available: cpu"):  # fmt: skip
            utils.get_torchcomms_instance(pg, device_type="meta")
    finally:
        pginfo.pg_info_destroy(pg)
    pginfo.pg_info_destroy(pg)  # a second time: nothing happens
    assert pginfo.pg_info_get(pg) is None


def test_mode_switches_and_get_group_without_a_world() -> None:
    assert not utils.torchcomms_is_enabled() and not utils.eager_init_is_enabled()
    utils.set_torchcomms_enabled(True)
    utils.set_eager_init_enabled(True)
    try:
        assert utils.torchcomms_is_enabled() and utils.eager_init_is_enabled()
        assert dist.torchcomms_is_enabled()
    finally:
        utils.set_torchcomms_enabled(False)
        utils.set_eager_init_enabled(False)
    sentinel = object()
    assert utils.get_group(sentinel) is sentinel
    with pytest.raises(AssertionError, match=r"dist\.group\.WORLD is not initialized"):
        utils.get_group(None)
    assert utils.format_backend_string({"cpu": "gloo", "cuda": "nccl"}) == "cpu:gloo,cuda:nccl"


# -- refused before anything is initialised (in process) -------------------------------------


def test_init_refusals_change_nothing() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="backend must be specified"):
        dist.init_process_group()
    with pytest.raises(ValueError, match="Unknown backend: 'glo'"):
        dist.init_process_group("glo", rank=0, world_size=1, use_torchcomms=True)
    with pytest.raises(ValueError, match="Invalid device type 'gpu'"):
        dist.init_process_group("cpu:gloo,gpu:nccl", rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 3 is outside the world"):
        dist.init_process_group("gloo", rank=3, world_size=2, use_torchcomms=True)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device type 'cuda' \\(backend 'nccl'\\) is not"):
            dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, use_torchcomms=True)
    assert not dist.is_initialized() and not dist.torchcomms_is_enabled()
    assert not tdist.config.use_torchcomms


def test_calls_that_need_a_world_or_torchcomms() -> None:
    with pytest.raises(AssertionError, match="new_group called before init_process_group"):
        dist.new_group([0], backend="gloo")
    with pytest.raises(AssertionError, match="split_group called before init_process_group"):
        dist.split_group(split_ranks=[[0]])
    with pytest.raises(AssertionError, match="new_window requires torchcomms to be enabled"):
        dist.new_window()
    t = torch.zeros(2)
    with pytest.raises(AssertionError, match="reduce_scatter_quantized requires torchcomms"):
        dist.reduce_scatter_quantized(t, t, dist.ReduceOp.SUM, torch.tensor([1]))
    with pytest.raises(AssertionError, match="Process group is not initialized"):
        dist.destroy_process_group()


# -- every init variant, on two ranks ---------------------------------------------------------

cases = Cases()
_round = [0]


def _store(ctx: RankContext) -> PrefixStore:
    """A fresh prefix per init: a store's keys are never reused by the next world."""
    _round[0] += 1
    return PrefixStore(f"init{_round[0]}", ctx.store)


def _check_world(ctx: RankContext, torchcomms: bool) -> None:
    assert dist.is_initialized()
    assert dist.get_rank() == ctx.rank and dist.get_world_size() == ctx.world_size
    assert dist.torchcomms_is_enabled() is torchcomms
    world = dist.group.WORLD
    assert isinstance(world, _BackendWrapper) is torchcomms
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0, 3.0]


def _destroy() -> None:
    dist.destroy_process_group()
    assert not dist.is_initialized() and not dist.torchcomms_is_enabled()
    assert not tdist.config.use_torchcomms  # the switch distwrap turned on is restored


@cases.case("default_and_explicit_rank")
def _default(ctx: RankContext) -> None:
    for torchcomms in (False, True):
        # rank and world size from RANK / WORLD_SIZE (the harness sets them)
        dist.init_process_group("gloo", store=_store(ctx), use_torchcomms=torchcomms)
        _check_world(ctx, torchcomms)
        _destroy()
        dist.init_process_group(
            backend="gloo",
            store=_store(ctx),
            rank=ctx.rank,
            world_size=ctx.world_size,
            use_torchcomms=torchcomms,
        )
        _check_world(ctx, torchcomms)
        _destroy()


@cases.case("rank_and_size_from_open_mpi_slurm_pmi")
def _from_env(ctx: RankContext) -> None:
    saved = {v: os.environ.get(v) for v in _ALL_VARS}
    variants = [
        # Open MPI wins over torchrun's variables, here deliberately wrong.
        {"OMPI_COMM_WORLD_RANK": str(ctx.rank), "OMPI_COMM_WORLD_SIZE": str(ctx.world_size),
         "RANK": "7", "WORLD_SIZE": "9"},
        {"SLURM_PROCID": str(ctx.rank), "SLURM_NTASKS": str(ctx.world_size)},
        {"PMI_RANK": str(ctx.rank), "PMI_SIZE": str(ctx.world_size)},
    ]  # fmt: skip
    try:
        for i, variant in enumerate(variants):
            for var in _ALL_VARS:
                os.environ.pop(var, None)
            os.environ.update(variant)
            torchcomms = i % 2 == 0
            dist.init_process_group("gloo", store=_store(ctx), use_torchcomms=torchcomms)
            _check_world(ctx, torchcomms)
            _destroy()
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


@cases.case("timeout_group_name_pg_options")
def _named(ctx: RankContext) -> None:
    timeout = timedelta(seconds=45)
    opts = tdist.ProcessGroupGloo._Options()
    for torchcomms in (False, True):
        dist.init_process_group(
            "gloo",
            store=_store(ctx),
            timeout=timeout,
            group_name=f"trainers{int(torchcomms)}",
            pg_options=opts,
            use_torchcomms=torchcomms,
        )
        _check_world(ctx, torchcomms)
        world = dist.group.WORLD
        assert world is not None
        # torch ignores group_name (its default group is always "0"); distwrap records it.
        assert pg_info_get_group_desc(world) == f"trainers{int(torchcomms)}"
        if torchcomms:
            assert isinstance(world, _BackendWrapper)
            comm = world.get_comm()
            # torch passes no timeout to the comm it builds; distwrap gives it the one asked for.
            assert comm.get_options().timeout == timeout
            assert world.options._timeout == timeout
        else:
            assert world._get_backend(torch.device("cpu")).options._timeout == timeout
        _destroy()


@cases.case("device_id")
def _device_id(ctx: RankContext) -> None:
    # Passed through: torch refuses a CPU device id, and distwrap is left as it was.
    with pytest.raises(ValueError, match="device_id parameter must be an accelerator"):
        dist.init_process_group("gloo", store=_store(ctx), device_id=torch.device("cpu"))
    assert not dist.is_initialized() and not utils.eager_init_is_enabled()
    # With torchcomms the device id is ignored (upstream), even one torch would refuse.
    dist.init_process_group("gloo", store=_store(ctx), device_id=0, use_torchcomms=True)
    _check_world(ctx, True)
    assert not utils.eager_init_is_enabled()
    _destroy()


@cases.case("init_method_and_storeless")
def _init_method(ctx: RankContext) -> None:
    for torchcomms in (False, True):
        url = f"file://{ctx.tmpdir}/rendezvous{int(torchcomms)}"
        dist.init_process_group(
            "gloo", init_method=url, rank=ctx.rank, world_size=ctx.world_size,
            use_torchcomms=torchcomms,
        )  # fmt: skip
        _check_world(ctx, torchcomms)
        _destroy()
    # Neither store nor init_method: upstream's shared TCPStore on MASTER_ADDR:MASTER_PORT.
    dist.init_process_group("gloo", use_torchcomms=True)
    _check_world(ctx, True)
    _destroy()


@cases.case("use_torchcomms_world")
def _torchcomms_world(ctx: RankContext) -> None:
    dist.init_process_group("cpu:gloo", store=_store(ctx), use_torchcomms=True)
    _check_world(ctx, True)
    assert tdist.config.use_torchcomms
    world = dist.group.WORLD
    assert isinstance(world, _BackendWrapper)
    assert dist.get_backend() == "cpu:gloo"
    # torch.distributed's own calls on the group run on the same communicator (supported).
    t = torch.full((2,), float(ctx.rank))
    tdist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    _destroy()


@cases.case("bad_input_leaves_the_world_usable")
def _bad_input(ctx: RankContext) -> None:
    for torchcomms in (False, True):
        dist.init_process_group("gloo", store=_store(ctx), use_torchcomms=torchcomms)
        try:
            with pytest.raises(ValueError, match="default process group twice"):
                dist.init_process_group("gloo", store=_store(ctx), use_torchcomms=torchcomms)
            with pytest.raises(ValueError, match="Unknown backend: 'mpix'"):
                dist.split_group(split_ranks=[[0, 1]], backend="mpix")
            if not torchcomms:
                with pytest.raises(ValueError, match="Invalid device type 'gpu'"):
                    dist.new_group([0, 1], backend="gpu:nccl")
            _check_world(ctx, torchcomms)
        finally:
            _destroy()


def _rank(ctx: RankContext) -> dict[str, object]:
    return cases.run_all(ctx)


@pytest.mark.parametrize("name", list(cases.cases))
def test_init_variant(name: str) -> None:
    cases.check(_rank, WORLD, name)
