"""``torchcomms.distwrap`` is laid out as upstream ships it: modules, functions, signatures.

``UPSTREAM`` is upstream's distwrap (meta-pytorch/torchcomms, ``comms/torchcomms/distwrap``)
as data: each module's public functions with their parameters in order, each with its
default (``REQUIRED`` where there is none).  The walk fails on a module or function that is
missing, on a parameter with another name, place, kind or default, on a public function one
of our modules defines that upstream's does not, and on a module upstream does not have.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import pytest
import torch.distributed as tdist

import torchcomms.distwrap

REQUIRED = inspect.Parameter.empty
SUM = tdist.ReduceOp.SUM


def _p(*names: str) -> list[tuple[str, Any]]:
    """Required parameters."""
    return [(n, REQUIRED) for n in names]


UPSTREAM: dict[str, dict[str, list[tuple[str, Any]]]] = {
    "utils": {
        "set_torchcomms_enabled": _p("enabled"),
        "torchcomms_is_enabled": [],
        "set_eager_init_enabled": _p("enabled"),
        "eager_init_is_enabled": [],
        "parse_backend_string": _p("backend"),
        "format_backend_string": _p("device_backends"),
        "get_rank_and_world_size": _p("rank", "world_size"),
        "torchcomms_create_split_group": _p(
            "pg", "parent_pg", "split_ranks", "group_desc", "pg_options", "device_backends"
        ),
        "get_group": _p("group"),
        "get_torchcomms_instance": [*_p("group"), ("device_type", None), ("tensor", None)],
        "get_group_rank": _p("group", "global_rank"),
        "get_backend_for_device": _p("group", "device_type"),
    },
    "pginfo": {
        "pg_info_create": _p("pg", "global_ranks", "group_desc"),
        "pg_info_destroy": _p("pg"),
        "pg_info_get": _p("pg"),
        "pg_info_assert_registered": _p("pg"),
        "pg_info_get_global_ranks": _p("pg"),
        "pg_info_get_rank_map": _p("pg"),
        "pg_info_get_group_desc": _p("pg"),
        "pg_info_set_data": _p("pg", "key", "data"),
        "pg_info_get_data": _p("pg", "key"),
    },
    "new_comm": {
        "init_process_group": [
            ("backend", None), ("init_method", None), ("timeout", None), ("world_size", -1),
            ("rank", -1), ("store", None), ("group_name", ""), ("pg_options", None),
            ("device_id", None), ("use_torchcomms", False),
        ],
        "new_group": [
            ("ranks", None), ("timeout", None), ("backend", None), ("pg_options", None),
            ("use_local_synchronization", False), ("group_desc", None), ("device_id", None),
        ],
        "destroy_process_group": [("group", None)],
        "split_group": [
            ("parent_pg", None), ("split_ranks", None), ("timeout", None),
            ("pg_options", None), ("group_desc", None), ("backend", None),
        ],
    },
    "collectives_extension": {
        "new_window": [("group", None), ("backend", None)],
        "reduce_scatter_quantized": [
            *_p("output", "input", "op", "seed"), ("group", None), ("async_op", False),
        ],
    },
    "fallback": {
        "fallback_split_group_new_group": _p(
            "parent_pg", "my_group_ranks", "timeout", "pg_options", "group_desc"
        ),
        "fallback_all_gather_gloo": _p("tensor_list", "tensor", "pg", "async_op"),
        "fallback_all_to_all_gloo": _p(
            "output_tensor_list", "input_tensor_list", "pg", "async_op"
        ),
        "fallback_all_to_all_single_gloo": _p(
            "output", "input", "output_split_sizes", "input_split_sizes", "pg", "async_op"
        ),
    },
    "collectives": {
        "_make_nccl_premul_sum": _p("mul_factor"),
        "all_reduce": [*_p("tensor"), ("op", SUM), ("group", None), ("async_op", False)],
        "broadcast": [
            *_p("tensor"), ("src", None), ("group", None), ("async_op", False),
            ("group_src", None),
        ],
        "reduce": [
            *_p("tensor"), ("dst", None), ("op", SUM), ("group", None), ("async_op", False),
            ("group_dst", None),
        ],
        "all_gather": [*_p("tensor_list", "tensor"), ("group", None), ("async_op", False)],
        "all_gather_into_tensor": [
            *_p("output_tensor", "input_tensor"), ("group", None), ("async_op", False),
        ],
        "reduce_scatter": [
            *_p("output", "input_list"), ("op", SUM), ("group", None), ("async_op", False),
        ],
        "reduce_scatter_tensor": [
            *_p("output", "input"), ("op", SUM), ("group", None), ("async_op", False),
        ],
        "all_to_all": [
            *_p("output_tensor_list", "input_tensor_list"), ("group", None),
            ("async_op", False),
        ],
        "all_to_all_single": [
            *_p("output", "input"), ("output_split_sizes", None), ("input_split_sizes", None),
            ("group", None), ("async_op", False),
        ],
        "scatter": [
            *_p("tensor"), ("scatter_list", None), ("src", None), ("group", None),
            ("async_op", False), ("group_src", None),
        ],
        "gather": [
            *_p("tensor"), ("gather_list", None), ("dst", None), ("group", None),
            ("async_op", False), ("group_dst", None),
        ],
        "barrier": [("group", None), ("async_op", False), ("device_ids", None)],
        "send": [*_p("tensor"), ("dst", None), ("group", None), ("tag", 0), ("group_dst", None)],
        "recv": [*_p("tensor"), ("src", None), ("group", None), ("tag", 0), ("group_src", None)],
        "isend": [
            *_p("tensor"), ("dst", None), ("group", None), ("tag", 0), ("group_dst", None),
        ],
        "irecv": [
            *_p("tensor"), ("src", None), ("group", None), ("tag", 0), ("group_src", None),
        ],
        "batch_isend_irecv": _p("p2p_op_list"),
        "all_gather_object": [*_p("object_list", "obj"), ("group", None)],
        "gather_object": [
            *_p("obj"), ("object_gather_list", None), ("dst", None), ("group", None),
            ("group_dst", None),
        ],
        "scatter_object_list": [
            *_p("scatter_object_output_list"), ("scatter_object_input_list", None),
            ("src", None), ("group", None), ("group_src", None),
        ],
        "broadcast_object_list": [
            *_p("object_list"), ("src", None), ("group", None), ("device", None),
            ("group_src", None),
        ],
        "get_mem_allocator": _p("group", "device"),
        "register_mem_pool": _p("group", "device", "pool"),
    },
}  # fmt: skip

#: ``torchcomms.distwrap`` itself: the class upstream defines there, and its constructor.
UPSTREAM_P2POP = [*_p("self", "op", "tensor"), ("peer", None), ("group", None), ("tag", 0),
                  ("group_peer", None)]  # fmt: skip

#: What upstream's ``__init__`` re-exports from its modules (and lists in ``__all__``).
UPSTREAM_REEXPORTED = {
    "collectives": list(UPSTREAM["collectives"]),
    "collectives_extension": ["new_window", "reduce_scatter_quantized"],
    "new_comm": ["destroy_process_group", "init_process_group", "new_group", "split_group"],
}

#: torch.distributed's names upstream's ``__init__`` re-exports (``ProcessGroupNCCL``: CUDA
#: builds of torch only).
UPSTREAM_TORCH_NAMES = [
    "get_process_group_ranks", "get_rank", "get_world_size", "group", "GroupMember",
    "HashStore", "is_available", "is_initialized", "ProcessGroup", "ProcessGroupGloo",
    "ProcessGroupNCCL", "ReduceOp", "Store", "Work",
]  # fmt: skip


def _same_default(ours: Any, theirs: Any) -> bool:
    if theirs is REQUIRED or ours is REQUIRED:
        return ours is theirs
    return type(ours) is type(theirs) and bool(ours == theirs)


def _differences(fn: Any, expected: list[tuple[str, Any]]) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())
    problems = []
    names = [p.name for p in params]
    if names != [n for n, _ in expected]:
        problems.append(f"parameters {names}, upstream {[n for n, _ in expected]}")
    for p, (name, default) in zip(params, expected, strict=False):
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            problems.append(f"{p.name} is {p.kind.description}, upstream positional-or-keyword")
        if p.name == name and not _same_default(p.default, default):
            problems.append(f"{name} defaults to {p.default!r}, upstream {default!r}")
    return problems


@pytest.mark.parametrize(
    ("module", "function"),
    [(m, f) for m, functions in UPSTREAM.items() for f in functions],
)
def test_every_upstream_function_is_at_its_path_with_its_signature(
    module: str, function: str
) -> None:
    mod = importlib.import_module(f"torchcomms.distwrap.{module}")
    fn = getattr(mod, function, None)
    assert callable(fn), f"torchcomms.distwrap.{module}.{function} is missing"
    assert fn.__module__ == mod.__name__, f"{function} is defined in {fn.__module__}"
    problems = _differences(fn, UPSTREAM[module][function])
    assert not problems, f"torchcomms.distwrap.{module}.{function}: " + "; ".join(problems)


def test_p2pop_is_distwrap_s_own_class_with_upstream_s_constructor() -> None:
    cls = torchcomms.distwrap.P2POp
    assert cls.__module__ == "torchcomms.distwrap"
    problems = _differences(cls.__init__, UPSTREAM_P2POP)
    assert not problems, "P2POp.__init__: " + "; ".join(problems)


def test_the_package_has_upstream_s_modules_and_nothing_public_beyond_them() -> None:
    ours = {m.name for m in pkgutil.iter_modules(torchcomms.distwrap.__path__)}
    assert ours == set(UPSTREAM) | {"tests"}, sorted(ours ^ (set(UPSTREAM) | {"tests"}))
    extra = []
    for module, functions in UPSTREAM.items():
        mod = importlib.import_module(f"torchcomms.distwrap.{module}")
        for name, value in vars(mod).items():
            defined_here = getattr(value, "__module__", None) == mod.__name__
            public = not name.startswith("_")
            if defined_here and public and inspect.isfunction(value) and name not in functions:
                extra.append(f"{module}.{name}")
    assert not extra, f"public functions upstream does not have: {extra}"


def test_init_re_exports_what_upstream_s_does() -> None:
    for module, names in UPSTREAM_REEXPORTED.items():
        mod = importlib.import_module(f"torchcomms.distwrap.{module}")
        for name in names:
            assert getattr(torchcomms.distwrap, name) is getattr(mod, name), name
            assert name in torchcomms.distwrap.__all__, name
    for name in UPSTREAM_TORCH_NAMES:
        if not hasattr(tdist, name):  # ProcessGroupNCCL on a CPU build
            continue
        assert getattr(torchcomms.distwrap, name) is getattr(tdist, name), name
        assert name in torchcomms.distwrap.__all__, name
    assert "P2POp" in torchcomms.distwrap.__all__
