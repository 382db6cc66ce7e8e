"""Upstream's public Python surface, name by name, and the behaviour of the names it adds.

* ``UPSTREAM_NAMES`` / ``UPSTREAM_MEMBERS`` are upstream's public names (its ``_comms.pyi``,
  the pybind bindings in ``TorchCommPy.cpp``, ``__init__.py``, ``hooks/``, ``objcol.py``,
  ``device_mesh.py`` and ``utils/_store_manager.pyi``), kept here as data: a name missing
  here fails ``test_upstream_names_exist`` / ``test_upstream_members_exist``.
* The persistent all-gather runs for real on every CPU transport (shm, tcp, hierarchical),
  in one task: values, reuse, async, aliasing, large messages, registration agreement,
  every misuse error, and hooks / flight recorder left as they were.
* ``_create_prefix_store`` / ``_dup_prefix_store`` make stores that carry a communicator.
* The GPU-only names (``get_mem_allocator``, ``get_device_transport``) raise a
  ``RuntimeError`` that names the limit; ``WorkWrapper.exception()`` reports an op's error.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch

import torchcomms
from tests.harness import RankContext, run_ranks
from torchcomms import (
    AllGatherPHandle,
    BackendNotImplementedError,
    CollectivePostHookArgs,
    CommError,
    CommStateError,
    CommTimeoutError,
    CommValidationError,
    OpName,
    P2POpType,
    ReconfigureOptions,
    ReduceOp,
    TorchComm,
    new_comm,
)
from torchcomms.utils._store_manager import _create_prefix_store, _dup_prefix_store

CPU = torch.device("cpu")

_HOOK_OPS = [
    "Send",
    "Recv",
    "Broadcast",
    "AllReduce",
    "Reduce",
    "AllGather",
    "AllGatherV",
    "AllGatherSingle",
    "ReduceScatter",
    "ReduceScatterV",
    "ReduceScatterSingle",
    "AllToAllSingle",
    "AllToAllVSingle",
    "AllToAll",
    "Barrier",
    "Scatter",
    "Gather",
    "GatherSingle",
]
_OPTIONS = [
    "SendOptions",
    "RecvOptions",
    "BroadcastOptions",
    "AllReduceOptions",
    "ReduceOptions",
    "AllGatherOptions",
    "AllGatherSingleOptions",
    "ReduceScatterOptions",
    "ReduceScatterSingleOptions",
    "AllToAllOptions",
    "AllToAllSingleOptions",
    "AllToAllvSingleOptions",
    "BarrierOptions",
    "ScatterOptions",
    "GatherOptions",
    "AllGatherPInitOptions",
    "AllGatherPExecOptions",
]
#: Public names of upstream's ``_comms`` (stub and binding); ``from torchcomms._comms import *``
#: puts each of them at top level too.
_COMMS = [
    *["RedOpType", "ReduceOp", "OpName", "RemovableHandle", "CommOptions", "BatchP2POptions"],
    *["ReconfigureOptions", "WorkStatus", "TorchWork", "TorchCommWinAccessType"],
    *["TorchCommWindowAttr", "TorchCommWindow", "P2POpType", "P2POp", "BatchSendRecv", "TorchComm"],
    *["new_comm", "get_mem_allocator", "TorchCommBackend", "register_backend", "WorkWrapper"],
    *["InitHandle", "AllGatherPHandle", "PreHookArgs", "PostHookArgs"],
    *_OPTIONS,
    *(f"{op}PreHookArgs" for op in _HOOK_OPS),
    *["SplitPreHookArgs", "NewWindowPreHookArgs", "BatchOpIssuePreHookArgs"],
    "FinalizePreHookArgs",
    "CollectivePostHookArgs",
    *(f"{op}PostHookArgs" for op in _HOOK_OPS),
    *["SplitPostHookArgs", "NewWindowPostHookArgs", "BatchOpIssuePostHookArgs"],
    "FinalizePostHookArgs",
]
#: module -> names (a dotted name is an attribute path).
UPSTREAM_NAMES: dict[str, list[str]] = {
    "torchcomms": [
        *_COMMS,
        *["Timeout", "hooks", "objcol", "_load_backend", "is_backend_built", "built_backends"],
        "is_torch_compile_supported",
        "is_torch_compile_supported_and_enabled",
        "_is_backend_registered",
    ],
    "torchcomms._comms": [
        *_COMMS,
        *["Timeout", "_BackendWrapper", "_BackendWrapperOptions", "_is_backend_registered"],
        "hooks.fr.FlightRecorderHook",
        "hooks.clog.clog",
    ],
    "torchcomms._comms_gloo": ["TorchCommGloo"],
    "torchcomms.hooks": ["clog", "FlightRecorderHook", "NanCheckHook"],
    "torchcomms.hooks.fr": ["FlightRecorderHook"],
    "torchcomms.hooks.clog": ["clog"],
    "torchcomms.hooks.nan_check": ["NanCheckHook"],
    "torchcomms.hooks.nan_check.nan_check": ["NanCheckHook"],
    "torchcomms.objcol": [
        *["all_gather_object", "gather_object", "send_object_list", "recv_object_list"],
        *["broadcast_object_list", "scatter_object_list"],
    ],
    "torchcomms.device_mesh": [
        "init_device_mesh",
        "_create_torchcomm_process_group",
        "_flatten_with_comm",
    ],
    "torchcomms.utils._store_manager": ["_create_prefix_store", "_dup_prefix_store"],
}
#: class (a name in torchcomms) -> its upstream members.
UPSTREAM_MEMBERS: dict[str, list[str]] = {
    "TorchComm": [
        *[
            "finalize",
            "get_rank",
            "get_size",
            "get_name",
            "get_options",
            "get_device",
            "get_backend",
        ],
        *["get_backend_version", "get_backend_impl", "unsafe_get_backend", "get_init_handle"],
        *["reconfigure", "abort", "is_abort_supported", "is_aborted", "set_timeout", "set_hints"],
        *[
            "get_device_transport",
            "tensor_register",
            "tensor_deregister",
            "send",
            "recv",
            "broadcast",
        ],
        *[
            "all_reduce",
            "reduce",
            "all_gather",
            "all_gather_v",
            "all_gather_single",
            "reduce_scatter",
        ],
        *["reduce_scatter_v", "reduce_scatter_single", "all_to_all_single", "all_to_all_v_single"],
        *[
            "all_to_all",
            "barrier",
            "scatter",
            "gather",
            "gather_single",
            "new_window",
            "all_gather_p_init",
        ],
        *[
            "all_gather_p_exec",
            "all_gather_p_free",
            "split",
            "batch_op_create",
            "get_mem_allocator",
        ],
        *["mem_allocator", "register_pre_hook", "register_post_hook", "register_abort_hook"],
        "__copy__",
        "__deepcopy__",
    ],
    "BatchSendRecv": ["send", "recv", "issue"],  # and ``ops``, an instance attribute (below)
    "TorchWork": ["is_completed", "wait", "wait_blocking", "_set_status"],
    "TorchCommWindow": [
        *[
            "dtype",
            "shape",
            "device",
            "get_size",
            "get_tensor",
            "tensor_register",
            "tensor_deregister",
            "put",
        ],
        *["signal", "wait_signal", "map_remote_tensor", "get_attr", "get_device_window"],
        *["register_local_buffer", "deregister_local_buffer", "__copy__", "__deepcopy__"],
    ],
    "_BackendWrapper": [
        *["get_comm", "get_mem_allocator", "name", "options", "_verify_work_timeout"],
        "_set_default_timeout",
    ],
    "WorkWrapper": ["exception"],
    "ReconfigureOptions": ["uuid", "init_handles", "timeout", "hints"],  # on an instance
    "CommOptions": [  # on an instance
        *["abort_process_on_timeout_or_error", "timeout", "store", "enable_reconfigure", "hints"],
    ],
}
#: Parameter lists of the names this module is about (upstream's binding: names and order).
UPSTREAM_SIGNATURES: dict[str, list[str]] = {
    "TorchComm.all_gather_p_init": ["output", "hints", "timeout"],
    "TorchComm.all_gather_p_exec": ["handle", "input", "async_op", "hints", "timeout"],
    "TorchComm.all_gather_p_free": ["handle"],
    "TorchComm.get_device_transport": [],
    "TorchComm.get_mem_allocator": [],
    "get_mem_allocator": ["backend"],
    "ReconfigureOptions": ["uuid", "init_handles", "timeout", "hints"],
    "utils._store_manager._create_prefix_store": ["prefix", "timeout"],
    "utils._store_manager._dup_prefix_store": ["prefix", "bootstrap_store", "timeout"],
}


def _resolve(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _has(obj: Any, dotted: str) -> bool:
    try:
        _resolve(obj, dotted)
    except AttributeError:
        return False
    return True


def _fake(name: str) -> TorchComm:
    return new_comm("fake", CPU, name=name)


# -- the names ----------------------------------------------------------------------------------
@pytest.mark.parametrize("module_name", sorted(UPSTREAM_NAMES))
def test_upstream_names_exist(module_name: str) -> None:
    module = importlib.import_module(module_name)
    missing = [n for n in UPSTREAM_NAMES[module_name] if not _has(module, n)]
    assert missing == [], f"{module_name} lacks {missing}"


def test_upstream_members_exist() -> None:
    comm = _fake("surface_members")
    instances: dict[str, Any] = {
        "ReconfigureOptions": ReconfigureOptions(),
        "CommOptions": torchcomms.CommOptions(),
        "BatchSendRecv": comm.batch_op_create(),
    }
    missing = {
        cls: [m for m in members if not _has(instances.get(cls, getattr(torchcomms, cls)), m)]
        for cls, members in UPSTREAM_MEMBERS.items()
    }
    assert {c: m for c, m in missing.items() if m} == {}
    assert instances["BatchSendRecv"].ops == []
    comm.finalize()


def test_upstream_signatures() -> None:
    wrong = {}
    for dotted, expected in UPSTREAM_SIGNATURES.items():
        params = list(inspect.signature(_resolve(torchcomms, dotted)).parameters)
        params = [p for p in params if p != "self"]
        if params != expected:
            wrong[dotted] = params
    assert wrong == {}


def test_comms_star_export_is_clean_and_complete() -> None:
    import torchcomms._comms as comms

    exported = set(comms.__all__)
    assert {n for n in _COMMS} <= exported
    assert not {"torch", "Any", "dataclass", "annotations"} & exported
    assert all(getattr(torchcomms, n) is getattr(comms, n) for n in _COMMS)
    assert comms.hooks.fr.FlightRecorderHook is torchcomms.hooks.FlightRecorderHook
    assert comms.hooks.clog.clog is torchcomms.hooks.clog


# -- value types --------------------------------------------------------------------------------
def test_reconfigure_options() -> None:
    default = ReconfigureOptions()
    assert (default.uuid, default.init_handles, default.timeout, default.hints) == (
        0,
        set(),
        None,
        {},
    )
    opts = ReconfigureOptions(
        7, ["gloo:0:-1:h:1", "gloo:1:-1:h:2"], timedelta(seconds=3), {"k": "v"}
    )
    assert opts.uuid == 7 and opts.init_handles == ["gloo:0:-1:h:1", "gloo:1:-1:h:2"]
    assert opts.timeout == timedelta(seconds=3) and opts.hints == {"k": "v"}
    kw = ReconfigureOptions(uuid=2, init_handles={"a", "b"})
    assert kw.init_handles == {"a", "b"} and kw.timeout is None
    kw.uuid, kw.init_handles = 3, ["c"]  # read-write, as upstream's fields
    assert (kw.uuid, kw.init_handles) == (3, ["c"])
    with pytest.raises(TypeError, match=r"ReconfigureOptions: uuid must be an int, got str"):
        ReconfigureOptions("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"uuid must be an int, got bool"):
        ReconfigureOptions(True)
    with pytest.raises(TypeError, match=r"init_handles must be a list or a set of str, got str"):
        ReconfigureOptions(1, "gloo:0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"init_handles must be a list or a set of str, got list"):
        ReconfigureOptions(1, [1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"timeout must be a timedelta or None, got int"):
        ReconfigureOptions(1, [], 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"hints must be a dict\[str, str\] or None, got list"):
        ReconfigureOptions(1, [], None, [])  # type: ignore[arg-type]


def test_per_op_options_classes() -> None:
    for name in _OPTIONS:
        opts = getattr(torchcomms, name)()
        assert (opts.hints, opts.timeout) == ({}, timedelta(0)), name  # upstream: 0 ms = unset
        opts.hints["k"] = "v"
        opts.timeout = timedelta(seconds=1)
        assert repr(opts) == f"{name}(hints={{'k': 'v'}}, timeout=0:00:01)"


def test_typed_post_hook_args_and_batch_ops() -> None:
    comm = _fake("surface_hooks")
    seen: list[Any] = []
    comm.register_post_hook(lambda op_id, args: seen.append(args))
    t = torch.ones(4)
    work = comm.all_reduce(t, ReduceOp.SUM, False)
    comm.barrier(True)
    comm.send(t, 0, False)
    assert [type(a).__name__ for a in seen] == [
        "AllReducePostHookArgs",
        "BarrierPostHookArgs",
        "SendPostHookArgs",
    ]
    assert all(isinstance(a, CollectivePostHookArgs) for a in seen) and seen[0].work is work
    batch = comm.batch_op_create()
    batch.send(t, 0)
    batch.recv(torch.empty(4), 0)
    assert [op.type for op in batch.ops] == [P2POpType.SEND, P2POpType.RECV]
    batch.ops = batch.ops[:1]  # read-write, as upstream's
    assert len(batch.ops) == 1
    comm.finalize()


# -- what a CPU answers for GPU-only names ------------------------------------------------------
def test_gpu_only_names_raise_naming_the_limit() -> None:
    for backend in ("gloo", "fake", "nccl"):
        with pytest.raises(
            BackendNotImplementedError,
            match=rf"^No allocator factory registered for backend: {backend} \(a communicator "
            r"memory allocator is a CUDA allocator",
        ):
            torchcomms.get_mem_allocator(backend)
    with pytest.raises(TypeError, match=r"get_mem_allocator: backend must be a str, got int"):
        torchcomms.get_mem_allocator(1)  # type: ignore[arg-type]
    comm = _fake("surface_gpu")
    for get in (comm.get_mem_allocator, lambda: comm.mem_allocator):
        with pytest.raises(
            RuntimeError, match=r"No allocator factory registered for backend: fake"
        ):
            get()
    with pytest.raises(
        BackendNotImplementedError,
        match=r"^\[TorchCommBackend\]: get_device_transport not implemented for "
        r"communicator:surface_gpu \(a device transport is a GPU-resident handle",
    ):
        comm.get_device_transport()
    # A backend without the persistent all-gather (fake, as upstream's) says so.
    with pytest.raises(
        BackendNotImplementedError,
        match=r"^\[TorchCommBackend\]: all_gather_p_init not implemented for "
        r"communicator:surface_gpu$",
    ):
        comm.all_gather_p_init(torch.zeros(4))
    assert issubclass(BackendNotImplementedError, RuntimeError)
    comm.finalize()


# -- persistent all-gather on every transport -----------------------------------------------------
#: (transport hint, simulated host of each of 4 ranks or (): one host, the ops class expected)
PLACEMENTS = {
    "shm": ("auto", (), "ShmOps"),
    "tcp": ("tcp", (), "TcpOps"),
    "hier": ("auto", (0, 0, 1, 1), "HierOps"),
}
_PREFIX = r"\[TorchCommGloo comm=agp_{} rank={}\] {}: "


def _raises(exc: type[BaseException], placement: str, rank: int, op: str, text: str) -> Any:
    return pytest.raises(exc, match="^" + _PREFIX.format(placement, rank, op) + text)


def _gathered(size: int, count: int, base: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([torch.arange(count, dtype=dtype) + base * 100 + r for r in range(size)])


def _persistent_checks(comm: TorchComm, placement: str, me: int, size: int) -> dict[str, Any]:
    """Every check of the persistent all-gather on one communicator (all ranks run it)."""
    n = 5
    output = torch.full((size * n,), -1.0)
    handle = comm.all_gather_p_init(output)
    assert isinstance(handle, AllGatherPHandle)
    assert (
        repr(handle)
        == f"AllGatherPHandle(comm='agp_{placement}', output=float32[{size * n}], registered)"
    )
    comm.barrier(False)
    for step in range(3):  # one registration, many execs, new inputs each time
        output.fill_(-1.0)
        x = torch.arange(n, dtype=torch.float32) + step * 100 + me
        work = comm.all_gather_p_exec(handle, x, async_op=False)
        assert work.is_completed()
        assert torch.equal(output, _gathered(size, n, step, torch.float32)), (step, output)
    output.fill_(-1.0)
    work = comm.all_gather_p_exec(handle, torch.arange(n, dtype=torch.float32) + 700 + me, True)
    work.wait()
    assert work.is_completed() and torch.equal(output, _gathered(size, n, 7, torch.float32))

    # A 2-D int64 output, a large one, and the in-place form (input = own slot of the output),
    # all registered at once and interleaved with ordinary collectives.
    grid = torch.zeros((size, 3), dtype=torch.int64)
    big_n = 1 << 14
    big = torch.zeros(size * big_n)
    inplace = torch.zeros(size * n, dtype=torch.int32)
    h_grid = comm.all_gather_p_init(grid, hints={"any": "hint"}, timeout=timedelta(seconds=30))
    h_big = comm.all_gather_p_init(big)
    h_inplace = comm.all_gather_p_init(inplace)
    comm.all_gather_p_exec(h_grid, torch.tensor([me, me * 10, me * 100]), False)
    total = torch.tensor([me + 1])
    comm.all_reduce(total, ReduceOp.SUM, False)
    comm.all_gather_p_exec(
        h_big, torch.full((big_n,), float(me)), False, timeout=timedelta(seconds=30)
    )
    own = inplace[me * n : (me + 1) * n]
    own.copy_(torch.arange(n, dtype=torch.int32) + me * 10)
    comm.all_gather_p_exec(h_inplace, own, False)
    assert torch.equal(grid, torch.tensor([[r, r * 10, r * 100] for r in range(size)]))
    assert int(total) == size * (size + 1) // 2
    assert torch.equal(big, torch.arange(size).repeat_interleave(big_n).float())
    assert torch.equal(
        inplace, torch.cat([torch.arange(n, dtype=torch.int32) + r * 10 for r in range(size)])
    )

    # Misuse: each a clear error on the calling rank, and the comm stays usable.
    c = (placement, me)
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_exec",
        r"input dtype torch.int32 must match the registered output's dtype torch.float32$",
    ):
        comm.all_gather_p_exec(handle, torch.zeros(n, dtype=torch.int32), False)
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_exec",
        rf"Registered output size must be input_size \* comm_size for all_gather_p_exec \(got {size * n}, expected {size * (n + 1)}\)$",
    ):
        comm.all_gather_p_exec(handle, torch.zeros(n + 1), False)
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_init",
        rf"Output tensor size must be a multiple of comm_size for all_gather_p_init \(got {size * n + 1}, comm_size {size}\)$",
    ):
        comm.all_gather_p_init(torch.zeros(size * n + 1))
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_init",
        r"Tensor must be contiguous for Gloo operations \(output\)$",
    ):
        comm.all_gather_p_init(torch.zeros(size * n, 2).t())
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_exec",
        r"Invalid scalar type torch.complex64 \(input\)$",
    ):
        comm.all_gather_p_exec(handle, torch.zeros(n, dtype=torch.complex64), False)
    with _raises(
        TypeError,
        *c,
        "all_gather_p_exec",
        r"handle must be an AllGatherPHandle from all_gather_p_init, got str$",
    ):
        comm.all_gather_p_exec("handle", torch.zeros(n), False)  # type: ignore[arg-type]
    with _raises(TypeError, *c, "all_gather_p_exec", r"async_op must be a bool, got int$"):
        comm.all_gather_p_exec(handle, torch.zeros(n), 1)  # type: ignore[arg-type]
    with _raises(ValueError, *c, "all_gather_p_exec", r"timeout must be positive, got 0:00:00$"):
        comm.all_gather_p_exec(handle, torch.zeros(n), False, timeout=timedelta(0))
    with _raises(
        TypeError, *c, "all_gather_p_init", r"hints must be a dict\[str, str\], got list$"
    ):
        comm.all_gather_p_init(torch.zeros(size * n), hints=[])  # type: ignore[arg-type]
    with _raises(
        TypeError,
        *c,
        "all_gather_p_free",
        r"handle must be an AllGatherPHandle from all_gather_p_init, got int$",
    ):
        comm.all_gather_p_free(3)  # type: ignore[arg-type]

    # A handle of another communicator (here a split child of this one) is refused both ways.
    child = comm.split(list(range(size)), f"agp_{placement}_child")
    assert child is not None
    child_out = torch.zeros(size * n)
    h_child = child.all_gather_p_init(child_out)
    child_prefix = rf"^\[TorchCommGloo comm=agp_{placement}_child rank={me}\] all_gather_p_exec: "
    with pytest.raises(
        CommValidationError,
        match=child_prefix
        + r"the handle was registered on communicator 'agp_\w+' \(another communicator\); use it only with the communicator whose all_gather_p_init returned it$",
    ):
        child.all_gather_p_exec(handle, torch.zeros(n), False)
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_free",
        rf"the handle was registered on communicator 'agp_{placement}_child' \(another communicator\)",
    ):
        comm.all_gather_p_free(h_child)
    child.all_gather_p_exec(h_child, torch.full((n,), float(me)), False)
    assert torch.equal(child_out, torch.arange(size).repeat_interleave(n).float())
    child.all_gather_p_free(h_child)
    child.finalize()

    # Members that register different outputs all learn it at init (no exec ever runs).
    odd = torch.zeros(size * (n + 1)) if me == 1 else torch.zeros(size * n)
    agree = r"every member must register an output of the same size and dtype \(rank 1 differs from rank 0; this is rank {}; registered: rank 0: {} x float32, rank 1: {} x float32"
    with _raises(
        CommValidationError, *c, "all_gather_p_init", agree.format(me, size * n, size * (n + 1))
    ):
        comm.all_gather_p_init(odd)
    typed = torch.zeros(size * n, dtype=torch.int64 if me == size - 1 else torch.float32)
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_init",
        rf"every member must register an output of the same size and dtype \(rank {size - 1} differs from rank 0; .* rank {size - 1}: {size * n} x int64\)$",
    ):
        comm.all_gather_p_init(typed)

    # Hooks and the flight recorder see the persistent calls as upstream's do: not at all.
    names: list[OpName] = []
    hook = comm.register_pre_hook(lambda name, op_id, args: names.append(name))
    recorder = torchcomms.hooks.FlightRecorderHook(isolated=True)
    recorder.register_with_comm(comm)
    comm.all_gather_p_exec(handle, torch.zeros(n), False)
    comm.barrier(False)
    comm.all_gather_p_exec(handle, torch.zeros(n), True).wait()
    hook.remove()
    assert names == [OpName.barrier]
    entries = json.loads(recorder.dump_json())["entries"]
    assert [e["profiling_name"] for e in entries] == ["gloo:barrier"]

    # Free: after it the handle is refused; freeing twice is an error, None is ignored.
    for h in (handle, h_grid, h_big, h_inplace):
        comm.all_gather_p_free(h)
    assert repr(handle).endswith(", freed)")
    with _raises(
        CommValidationError,
        *c,
        "all_gather_p_exec",
        r"the handle was freed by all_gather_p_free \(register the output again with all_gather_p_init\)$",
    ):
        comm.all_gather_p_exec(handle, torch.zeros(n), False)
    with _raises(CommValidationError, *c, "all_gather_p_free", r"the handle was already freed$"):
        comm.all_gather_p_free(handle)
    comm.all_gather_p_free(None)
    again = comm.all_gather_p_init(output)  # the same buffer registers anew
    comm.all_gather_p_exec(again, torch.full((n,), 1.0 + me), False)
    assert torch.equal(output, (torch.arange(size) + 1.0).repeat_interleave(n))

    # After finalize: exec is refused as every op is; free only marks the handle freed.
    impl = type(comm.get_backend_impl()._ops).__name__  # type: ignore[attr-defined]
    comm.finalize()
    finalized = (
        r"all_gather_p_exec: TorchCommGloo not initialized \(the communicator was finalized\)$"
    )
    with pytest.raises(CommStateError, match=finalized):
        comm.all_gather_p_exec(again, torch.zeros(n), False)
    comm.all_gather_p_free(again)
    with pytest.raises(
        CommValidationError, match=r"all_gather_p_free: the handle was already freed$"
    ):
        comm.all_gather_p_free(again)
    return {"ops": impl}


def _persistent_all_transports(ctx: RankContext) -> dict[str, str]:
    seen = {}
    for placement, (transport, hosts, _) in PLACEMENTS.items():
        if hosts:
            os.environ["TORCHCOMM_HOST_ID"] = f"agp-host-{hosts[ctx.rank]}"
        else:
            os.environ.pop("TORCHCOMM_HOST_ID", None)
        comm = new_comm(
            "gloo",
            CPU,
            name=f"agp_{placement}",
            store=ctx.store,
            timeout=timedelta(seconds=30),
            hints={"transport": transport},
        )
        seen[placement] = _persistent_checks(comm, placement, ctx.rank, ctx.world_size)["ops"]
    return seen


def test_persistent_all_gather_on_every_transport() -> None:
    results = run_ranks(
        _persistent_all_transports, 4, timeout=240, env={"TORCHCOMM_ABORT_ON_ERROR": "0"}
    )
    expected = {placement: ops for placement, (_, _, ops) in PLACEMENTS.items()}
    assert results == [expected] * 4


# -- stores ----------------------------------------------------------------------------------------
def _stores(ctx: RankContext) -> dict[str, Any]:
    me, size = ctx.rank, ctx.world_size
    timeout = timedelta(seconds=30)
    boot = _create_prefix_store("boot", timeout)
    boot.set(f"k{me}", str(me * 3))
    assert [int(boot.get(f"k{r}")) for r in range(size)] == [r * 3 for r in range(size)]
    dup = _dup_prefix_store("dup", boot, timeout)
    dup.set(f"d{me}", f"v{me}")
    assert [dup.get(f"d{r}").decode() for r in range(size)] == [f"v{r}" for r in range(size)]
    assert not boot.check([f"d{me}"])  # another server: the two stores share no key
    # The dup store outlives the bootstrap store (whose server, on rank 0, stops with it).
    dup.set(f"done_with_boot{me}", "1")
    dup.wait([f"done_with_boot{r}" for r in range(size)])
    del boot
    comm = new_comm("gloo", CPU, name="dup_comm", store=dup, timeout=timeout)
    t = torch.tensor([me + 1])
    comm.all_reduce(t, ReduceOp.SUM, False)
    comm.finalize()
    # MASTER_PORT is free again: a second bootstrap store can be served on it.
    again = _create_prefix_store("again", timeout)
    again.set(f"a{me}", "1")
    again.wait([f"a{r}" for r in range(size)])
    # Rank 0's servers stop when it returns: leave together, through the harness's store.
    ctx.store.set(f"left{me}", "1")
    ctx.store.wait([f"left{r}" for r in range(size)])
    return {"sum": int(t)}


def test_store_manager_stores_carry_a_communicator() -> None:
    results = run_ranks(_stores, 3, timeout=120, env={"TORCHCOMM_ABORT_ON_ERROR": "0"})
    assert [r["sum"] for r in results] == [6, 6, 6]


def test_store_manager_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._C._distributed_c10d as c10d

    with pytest.raises(TypeError, match=r"^_create_prefix_store: prefix must be a str, got int$"):
        _create_prefix_store(1)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^_dup_prefix_store: timeout must be a timedelta, got int$"
    ):
        _dup_prefix_store("p", c10d.HashStore(), 5)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^_create_prefix_store: timeout must be positive, got 0:00:00$"
    ):
        _create_prefix_store("p", timedelta(0))
    with pytest.raises(
        TypeError, match=r"bootstrap_store must be a torch.distributed Store, got dict$"
    ):
        _dup_prefix_store("p", {})  # type: ignore[arg-type]
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(CommError, match=r"^_create_prefix_store: MASTER_ADDR env is not set$"):
        _create_prefix_store("p")
    with pytest.raises(CommError, match=r"^_dup_prefix_store: MASTER_ADDR env is not set$"):
        _dup_prefix_store("p", c10d.HashStore())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(CommError, match=r"^_create_prefix_store: MASTER_PORT env is not set$"):
        _create_prefix_store("p")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHCOMM_SIZE", "2")
    # Rank 1: rank 0 never publishes its port / never serves.
    monkeypatch.setenv("TORCHCOMM_RANK", "1")
    with pytest.raises(
        CommTimeoutError,
        match=r"^\[rank=1\] _dup_prefix_store: rank 0 never published 'dup_store_port' on the "
        r"bootstrap store within 0.3 s$",
    ) as timed_out:
        _dup_prefix_store("p", c10d.HashStore(), timedelta(seconds=0.3))
    assert timed_out.value.ranks == (0,)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        # Rank 0: someone else holds MASTER_PORT.
        monkeypatch.setenv("TORCHCOMM_RANK", "0")
        with pytest.raises(
            CommError,
            match=rf"^\[rank=0\] _create_prefix_store: rank 0 could not serve a store on "
            rf"MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} \(",
        ):
            _create_prefix_store("p", timedelta(seconds=2))
    # Rank 1: nobody serves MASTER_PORT (the socket is closed).
    monkeypatch.setenv("TORCHCOMM_RANK", "1")
    with pytest.raises(
        CommTimeoutError,
        match=rf"^\[rank=1\] _create_prefix_store: could not connect to the store at "
        rf"127.0.0.1:{port} \(rank 0\) within 0.5 s",
    ):
        _create_prefix_store("p", timedelta(seconds=0.5))


# -- the bridge's work ----------------------------------------------------------------------------
def _work_wrapper(ctx: RankContext) -> str:
    from torchcomms._comms import _BackendWrapper

    comm = new_comm("gloo", CPU, name="ww", store=ctx.store, timeout=timedelta(seconds=30))
    pg = _BackendWrapper(comm)
    t = torch.tensor([ctx.rank + 1.0])
    ok = pg.allreduce([t])
    ok.wait()
    assert isinstance(ok, torchcomms.WorkWrapper) and ok.exception() is None
    assert float(t) == 3.0
    # Ranks that disagree on the size: the op fails on both, and exception() says why.
    bad = pg.allreduce([torch.zeros(2 + ctx.rank)])
    with pytest.raises(RuntimeError):
        bad.wait()
    error = bad.exception()
    assert isinstance(error, RuntimeError)
    comm.finalize()
    return str(error)


def test_work_wrapper_exception() -> None:
    messages = run_ranks(_work_wrapper, 2, timeout=120, env={"TORCHCOMM_ABORT_ON_ERROR": "0"})
    for message in messages:
        assert "ww" in message and "all_reduce" in message and "count" in message, message
