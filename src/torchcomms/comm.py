"""``TorchComm`` and ``new_comm``: the backend-agnostic communicator object users hold.

``TorchComm`` validates arguments (``validation``), assigns the process-global
``op_id``, runs pre/post hooks, resolves the per-op timeout, tracks the
communicator's state, and forwards to its backend.  It never touches bytes.

Thread-safety follows upstream: a communicator is meant to be driven by one
thread; ``op_id`` allocation and hook registration are thread-safe.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from torchcomms import config, hook_args, registry
from torchcomms.backends.base import TorchCommBackend
from torchcomms.errors import CommStateError
from torchcomms.oprecord import OpObserver, OpRecord
from torchcomms.types import (
    BatchP2POptions,
    CommOptions,
    OpName,
    OpOptions,
    P2POp,
    P2POpType,
    ReduceOp,
)
from torchcomms.validation import Checker
from torchcomms.work import PythonBackendWork, TorchWork, completed_python_work

logger = logging.getLogger("torchcomms.comm")

FINALIZE_OP_ID = 2**64 - 1

_op_ids = itertools.count()
_op_id_lock = threading.Lock()


def _next_op_id() -> int:
    with _op_id_lock:
        return next(_op_ids)


PreHook = Callable[[OpName, int, Any], None]
PostHook = Callable[[int, Any], None]
AbortHook = Callable[[], None]


class RemovableHandle:
    """Returned by ``register_*_hook``; ``remove()`` unregisters once, later calls do nothing."""

    def __init__(self, registry_: dict[int, Any], key: int) -> None:
        self._registry = registry_
        self._key = key
        self._lock = threading.Lock()

    def remove(self) -> None:
        with self._lock:
            self._registry.pop(self._key, None)


class TorchComm:
    """A communicator: a group of ranks with communicator-relative rank numbers."""

    def __init__(
        self, backend: str, impl: TorchCommBackend, device: torch.device, options: CommOptions
    ) -> None:
        self._backend = backend
        self._impl = impl
        self._device = device
        self._options = options
        self._finalized = False
        self._hook_ids = itertools.count()
        self._pre_hooks: dict[int, PreHook] = {}
        self._post_hooks: dict[int, PostHook] = {}
        self._abort_hooks: dict[int, AbortHook] = {}
        self._checkers: dict[str, Checker] = {}
        self._native = bool(getattr(impl, "_native", False))
        self._impl_name = type(impl).__name__
        self._observers: tuple[OpObserver, ...] = ()

    # -- getters ---------------------------------------------------------------------------------
    def get_rank(self) -> int:
        return int(self._impl.get_rank())

    def get_size(self) -> int:
        return int(self._impl.get_size())

    def get_name(self) -> str:
        return str(self._impl.get_comm_name())

    def get_device(self) -> torch.device:
        return self._device

    def get_backend(self) -> str:
        return self._backend

    def get_options(self) -> CommOptions:
        return self._options

    def get_backend_impl(self) -> TorchCommBackend:
        return self._impl

    def unsafe_get_backend(self) -> TorchCommBackend:
        warnings.warn(
            "unsafe_get_backend() is deprecated; use get_backend_impl()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._impl

    def get_backend_version(self) -> str:
        return self._impl.get_backend_version()

    def get_init_handle(self) -> str:
        return self._impl.get_init_handle()

    def is_abort_supported(self) -> bool:
        return bool(self._impl.is_abort_supported())

    def is_aborted(self) -> bool:
        return bool(self._impl.is_aborted())

    def set_timeout(self, timeout: timedelta) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(
                f"set_timeout: timeout must be a timedelta, got {type(timeout).__name__}"
            )
        if timeout <= timedelta(0):
            raise ValueError(f"set_timeout: timeout must be positive, got {timeout}")
        self._impl.set_timeout(timeout)
        self._options.timeout = timeout

    def set_hints(self, hints: dict[str, str]) -> None:
        self._impl.set_hints(dict(hints))

    def __repr__(self) -> str:
        try:
            where = f"rank={self.get_rank()}/{self.get_size()}"
        except Exception:
            where = "uninitialized"
        state = "finalized" if self._finalized else "ready"
        return f"TorchComm(backend={self._backend!r}, name={self._safe_name()!r}, {where}, {state})"

    def _safe_name(self) -> str:
        try:
            return self.get_name()
        except Exception:
            return "<unnamed>"

    # -- copy semantics: a communicator is a handle, never duplicated ------------------------------
    def __copy__(self) -> TorchComm:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchComm:
        if id(self) in memo:
            return memo[id(self)]
        memo[id(self)] = self
        return self

    # -- hooks -----------------------------------------------------------------------------------
    def register_pre_hook(self, callback: PreHook) -> RemovableHandle:
        """``callback(name: OpName, op_id: int, args)`` runs before each op; raising stops the op."""
        return self._add_hook(self._pre_hooks, callback)

    def register_post_hook(self, callback: PostHook) -> RemovableHandle:
        """``callback(op_id: int, args)`` runs right after each op was issued."""
        return self._add_hook(self._post_hooks, callback)

    def register_abort_hook(self, callback: AbortHook) -> RemovableHandle:
        """``callback()`` runs before the communicator aborts."""
        return self._add_hook(self._abort_hooks, callback)

    def _add_hook(self, table: dict[int, Any], callback: Any) -> RemovableHandle:
        if not callable(callback):
            raise TypeError(f"hook must be callable, got {type(callback).__name__}")
        key = next(self._hook_ids)
        table[key] = callback
        return RemovableHandle(table, key)

    def _run_pre_hooks(self, name: OpName, op_id: int, args: Any) -> None:
        if self._pre_hooks:
            for hook in list(self._pre_hooks.values()):
                hook(name, op_id, args)

    def _run_post_hooks(self, op_id: int, args: Any) -> None:
        for hook in list(self._post_hooks.values()):
            hook(op_id, args)

    # -- plumbing --------------------------------------------------------------------------------
    def _prefix(self, op: str) -> str:
        rank = self._impl.get_rank() if not self._finalized else "?"
        return f"[{self._impl_name} comm={self._safe_name()} rank={rank}] {op}: "

    def _checker(self, op: str) -> Checker:
        if self._finalized:
            raise CommStateError(
                f"{self._prefix(op)}{self._impl_name} not initialized (the communicator was "
                "finalized)"
            )
        checker = self._checkers.get(op)
        if checker is None:  # rank, size and dtypes are fixed for a comm's life: build once
            checker = Checker(
                functools.partial(self._prefix, op),
                self.get_rank(),
                self.get_size(),
                self._device,
                self._impl.supported_dtypes(),
                self._impl._self_p2p_allowed,
            )
            self._checkers[op] = checker
        return checker

    def _resolve_timeout(self, timeout: timedelta | None, op: str, hints: Any = None) -> timedelta:
        """The op's timeout (the comm's default when unset); also type-checks ``hints``."""
        if hints is not None and not isinstance(hints, dict):
            raise TypeError(
                f"{self._prefix(op)}hints must be a dict[str, str], got {type(hints).__name__}"
            )
        if timeout is None:
            return self._options.timeout
        if not isinstance(timeout, timedelta):
            raise TypeError(
                f"{self._prefix(op)}timeout must be a timedelta, got {type(timeout).__name__}"
            )
        if timeout <= timedelta(0):
            return self._options.timeout
        return timeout

    def _issue(
        self,
        name: OpName,
        pre_args: Any,
        timeout: timedelta | None,
        hints: dict[str, str] | None,
        args: tuple[Any, ...],
        plugin: Callable[[], Any] | None = None,
    ) -> TorchWork:
        """Assign an op_id, run pre-hooks, call the backend method named ``name``, run post-hooks.

        Native backends get ``(*args, OpOptions)``; plug-ins get ``args`` alone (or ``plugin()``
        runs instead, where upstream composes the op from other plug-in calls).
        """
        resolved = self._resolve_timeout(timeout, name.name, hints)
        op_id = _next_op_id()
        self._run_pre_hooks(name, op_id, pre_args)
        method = getattr(self._impl, name.name, None)

        def call() -> TorchWork:
            if self._native:
                assert method is not None
                return method(*args, OpOptions(resolved, dict(hints) if hints else {}, name.name, op_id))
            if plugin is not None:
                return _wrap_plugin_result(plugin())
            assert method is not None
            return _wrap_plugin_result(method(*args))

        work = self._observed(name, op_id, pre_args, resolved, call, args)
        if self._post_hooks:
            self._run_post_hooks(op_id, hook_args.CollectivePostHookArgs(work))
        return work

    def _observed(
        self,
        name: OpName,
        op_id: int,
        pre_args: Any,
        timeout: timedelta,
        call: Callable[[], TorchWork],
        call_args: tuple[Any, ...] = (),
    ) -> TorchWork:
        """``call()`` the backend, telling the internal observers (``oprecord``) about it."""
        observers = self._observers
        if not observers:
            return call()
        record = OpRecord(self, name, op_id, pre_args, timeout, observers, call_args)
        try:
            # An observer may stop the op (the collective check); it still finishes, failed.
            record._scheduled()
            work = call()
        except BaseException as exc:
            record._failed(exc)
            raise
        record._issued(work)
        return work

    def _add_observer(self, observer: OpObserver) -> None:
        """Attach an internal observer (see ``oprecord``); split children inherit it."""
        if observer not in self._observers:
            self._observers = (*self._observers, observer)

    def _remove_observer(self, observer: OpObserver) -> None:
        self._observers = tuple(o for o in self._observers if o is not observer)

    # -- point-to-point ----------------------------------------------------------------------------
    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("send")
        c.tensor(tensor)
        c.peer("dst", dst, "send to")
        c.async_op(async_op)
        return self._issue(
            OpName.send,
            hook_args.SendPreHookArgs(tensor, dst, async_op),
            timeout,
            hints,
            (tensor, dst, async_op),
        )

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("recv")
        c.tensor(tensor)
        c.peer("src", src, "recv from")
        c.async_op(async_op)
        return self._issue(
            OpName.recv,
            hook_args.RecvPreHookArgs(tensor, src, async_op),
            timeout,
            hints,
            (tensor, src, async_op),
        )

    def batch_op_create(self) -> BatchSendRecv:
        """A batch of sends and receives issued together, so mutual pairs cannot deadlock."""
        self._checker("batch_op_create")
        return BatchSendRecv(self)

    # -- collectives -----------------------------------------------------------------------------
    def broadcast(
        self,
        tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("broadcast")
        c.tensor(tensor)
        c.rank_arg("root", root)
        c.async_op(async_op)
        return self._issue(
            OpName.broadcast,
            hook_args.BroadcastPreHookArgs(tensor, root, async_op),
            timeout,
            hints,
            (tensor, root, async_op),
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_reduce")
        c.tensor(tensor)
        c.reduce_op(op, tensor.dtype)
        c.async_op(async_op)
        return self._issue(
            OpName.all_reduce,
            hook_args.AllReducePreHookArgs(tensor, async_op),
            timeout,
            hints,
            (tensor, op, async_op),
        )

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce")
        c.tensor(tensor)
        c.rank_arg("root", root)
        c.reduce_op(op, tensor.dtype)
        c.async_op(async_op)
        return self._issue(
            OpName.reduce,
            hook_args.ReducePreHookArgs(tensor, root, async_op),
            timeout,
            hints,
            (tensor, root, op, async_op),
        )

    def all_gather(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_gather")
        c.tensor(tensor)
        outs = c.tensor_list(tensor_list, "tensor_list")
        c.list_len(outs, "tensor_list size must equal comm_size for all_gather")
        for t in outs:
            c.numel_eq(
                t.numel(),
                tensor.numel(),
                "All tensors in tensor_list must have same size as input tensor",
            )
        c.same_dtype(tensor, outs)
        c.async_op(async_op)
        return self._issue(
            OpName.all_gather,
            hook_args.AllGatherPreHookArgs(tensor, tensor_list, async_op),
            timeout,
            hints,
            (tensor_list, tensor, async_op),
        )

    def all_gather_v(
        self,
        tensor_list: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_gather_v")
        c.tensor(tensor)
        outs = c.tensor_list(tensor_list, "tensor_list")
        c.list_len(outs, "tensor_list size must equal comm_size for all_gather_v")
        c.numel_eq(
            outs[c.rank].numel(),
            tensor.numel(),
            f"tensor_list[{c.rank}] must have the same size as this rank's input tensor",
        )
        c.same_dtype(tensor, outs)
        c.async_op(async_op)
        return self._issue(
            OpName.all_gather_v,
            hook_args.AllGatherVPreHookArgs(tensor, tensor_list, async_op),
            timeout,
            hints,
            (tensor_list, tensor, async_op),
        )

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_gather_single")
        c.tensor(output, "output")
        c.tensor(input, "input")
        c.numel_eq(
            output.numel(),
            input.numel() * c.size,
            "Output tensor size must be input_size * comm_size for all_gather_single",
        )
        c.same_dtype(input, [output])
        c.async_op(async_op)
        return self._issue(
            OpName.all_gather_single,
            hook_args.AllGatherSinglePreHookArgs(input, output, async_op),
            timeout,
            hints,
            (output, input, async_op),
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce_scatter")
        c.tensor(output, "output")
        ins = c.tensor_list(input_list, "input_list")
        c.list_len(ins, "input_list size must equal comm_size for reduce_scatter")
        for t in ins:
            c.numel_eq(
                t.numel(), output.numel(), "All input tensors must have same size as output tensor"
            )
        c.same_dtype(output, ins)
        c.reduce_op(op, output.dtype)
        c.async_op(async_op)
        return self._issue(
            OpName.reduce_scatter,
            hook_args.ReduceScatterPreHookArgs(input_list, output, async_op),
            timeout,
            hints,
            (output, input_list, op, async_op),
        )

    def reduce_scatter_v(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce_scatter_v")
        c.tensor(output, "output")
        ins = c.tensor_list(input_list, "input_list")
        c.list_len(ins, "input_list size must equal comm_size for reduce_scatter_v")
        c.numel_eq(
            ins[c.rank].numel(),
            output.numel(),
            f"input_list[{c.rank}] must have the same size as this rank's output tensor",
        )
        c.same_dtype(output, ins)
        c.reduce_op(op, output.dtype)
        c.async_op(async_op)
        return self._issue(
            OpName.reduce_scatter_v,
            hook_args.ReduceScatterVPreHookArgs(input_list, output, async_op),
            timeout,
            hints,
            (output, input_list, op, async_op),
        )

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("reduce_scatter_single")
        c.tensor(output, "output")
        c.tensor(input, "input")
        c.numel_eq(
            input.numel(),
            output.numel() * c.size,
            "Input tensor size must be output_size * comm_size for reduce_scatter_single",
        )
        c.same_dtype(output, [input])
        c.reduce_op(op, output.dtype)
        c.async_op(async_op)
        return self._issue(
            OpName.reduce_scatter_single,
            hook_args.ReduceScatterSinglePreHookArgs(input, output, async_op),
            timeout,
            hints,
            (output, input, op, async_op),
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_to_all_single")
        c.tensor(output, "output")
        c.tensor(input, "input")
        c.numel_eq(
            output.numel(),
            input.numel(),
            "Input and output tensors must have same size for all_to_all_single",
        )
        if input.numel() % c.size != 0:
            raise c.fail(
                "Tensor size must be divisible by comm_size for all_to_all_single "
                f"(got {input.numel()}, comm_size {c.size})"
            )
        c.same_dtype(input, [output])
        c.async_op(async_op)
        return self._issue(
            OpName.all_to_all_single,
            hook_args.AllToAllSinglePreHookArgs(input, output, async_op),
            timeout,
            hints,
            (output, input, async_op),
        )

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_to_all_v_single")
        c.tensor(output, "output")
        c.tensor(input, "input")
        out_splits = c.split_sizes(output_split_sizes, "output_split_sizes", output)
        in_splits = c.split_sizes(input_split_sizes, "input_split_sizes", input)
        if output.dim() > 1 or input.dim() > 1:
            out_row = output.shape[1:].numel() if output.dim() > 0 else 1
            in_row = input.shape[1:].numel() if input.dim() > 0 else 1
            if out_row != in_row:
                raise c.fail(
                    "input and output rows must have the same number of elements for "
                    f"all_to_all_v_single (got {in_row} and {out_row})"
                )
        c.same_dtype(input, [output])
        c.async_op(async_op)
        return self._issue(
            OpName.all_to_all_v_single,
            hook_args.AllToAllVSinglePreHookArgs(input, output, in_splits, out_splits, async_op),
            timeout,
            hints,
            (output, input, out_splits, in_splits, async_op),
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("all_to_all")
        outs = c.tensor_list(output_tensor_list, "output_tensor_list")
        ins = c.tensor_list(input_tensor_list, "input_tensor_list")
        if len(outs) != c.size or len(ins) != c.size:
            raise c.fail(
                "Tensor list sizes must equal comm_size for all_to_all "
                f"(got {len(outs)} outputs and {len(ins)} inputs, expected {c.size})"
            )
        c.same_dtype(ins[0], ins[1:] + outs)
        c.async_op(async_op)
        return self._issue(
            OpName.all_to_all,
            hook_args.AllToAllPreHookArgs(input_tensor_list, output_tensor_list, async_op),
            timeout,
            hints,
            (output_tensor_list, input_tensor_list, async_op),
        )

    def barrier(
        self,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("barrier")
        c.async_op(async_op)
        return self._issue(
            OpName.barrier,
            hook_args.BarrierPreHookArgs(async_op),
            timeout,
            hints,
            (async_op,),
        )

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor_list: list[torch.Tensor],
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("scatter")
        c.tensor(output_tensor, "output_tensor")
        c.rank_arg("root", root)
        if c.rank == root:
            ins = c.tensor_list(input_tensor_list, "input_tensor_list")
            c.list_len(ins, "input_tensor_list size must equal comm_size for scatter")
            for t in ins:
                c.numel_eq(
                    t.numel(),
                    output_tensor.numel(),
                    "All input tensors must have same size as output tensor for scatter",
                )
            c.same_dtype(output_tensor, ins)
        c.async_op(async_op)
        return self._issue(
            OpName.scatter,
            hook_args.ScatterPreHookArgs(output_tensor, input_tensor_list, root, async_op),
            timeout,
            hints,
            (output_tensor, input_tensor_list, root, async_op),
        )

    def gather(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("gather")
        c.tensor(input_tensor, "input_tensor")
        c.rank_arg("root", root)
        if c.rank == root:
            outs = c.tensor_list(output_tensor_list, "output_tensor_list")
            c.list_len(outs, "output_tensor_list size must equal comm_size for gather")
            for t in outs:
                c.numel_eq(
                    t.numel(),
                    input_tensor.numel(),
                    "All output tensors must have same size as input tensor for gather",
                )
            c.same_dtype(input_tensor, outs)
        c.async_op(async_op)
        return self._issue(
            OpName.gather,
            hook_args.GatherPreHookArgs(input_tensor, output_tensor_list, root, async_op),
            timeout,
            hints,
            (output_tensor_list, input_tensor, root, async_op),
        )

    def gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        root: int,
        async_op: bool,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchWork:
        c = self._checker("gather_single")
        c.tensor(input, "input")
        c.rank_arg("root", root)
        if c.rank == root:
            c.tensor(output, "output")
            c.numel_eq(
                output.numel(),
                input.numel() * c.size,
                "Output tensor size must be input_size * comm_size for gather_single",
            )
            c.same_dtype(input, [output])
        c.async_op(async_op)

        def plugin() -> Any:
            # Upstream's default: root views its output as comm_size chunks and calls gather.
            outs = list(output.view(-1).chunk(c.size)) if c.rank == root else []
            return self._impl.gather(outs, input, root, async_op)

        return self._issue(
            OpName.gather_single,
            hook_args.GatherSinglePreHookArgs(input, output, root, async_op),
            timeout,
            hints,
            (output, input, root, async_op),
            plugin,
        )

    # -- sub-communicators -------------------------------------------------------------------------
    def split(
        self,
        ranks: list[int],
        name: str,
        hints: dict[str, str] | None = None,
        timeout: timedelta | None = None,
    ) -> TorchComm | None:
        """A new communicator over ``ranks`` (parent ranks; list order = new rank order).

        Every rank of the new group calls it with the same list; ranks outside any group
        pass ``[]`` and get ``None``.
        """
        c = self._checker("split")
        members = c.split_ranks(ranks)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{c.prefix}name must be a non-empty str")
        child_timeout = self._resolve_timeout(timeout, "split", hints)
        op_id = _next_op_id()
        self._run_pre_hooks(OpName.split, op_id, hook_args.SplitPreHookArgs(members, name))
        if not members:
            return None
        child_options = CommOptions()
        child_options.timeout = child_timeout
        child_options.abort_process_on_timeout_or_error = (
            self._options.abort_process_on_timeout_or_error
        )
        child_options.hints = dict(hints or {})
        child_impl = self._impl.split(members, name, child_options)
        child = TorchComm(self._backend, child_impl, self._device, child_options)
        child._observers = self._observers
        for observer in self._observers:
            on_split = getattr(observer, "comm_split", None)
            if on_split is not None:  # e.g. the flight recorder records the split
                on_split(self, child, members, op_id)
        self._run_post_hooks(op_id, hook_args.SplitPostHookArgs(child))
        return child

    # -- lifecycle ---------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Release the communicator; every later call raises."""
        if self._finalized:
            raise CommStateError(f"{self._impl_name} already finalized (comm {self._safe_name()})")
        self._run_pre_hooks(OpName.finalize, FINALIZE_OP_ID, hook_args.FinalizePreHookArgs())
        self._finalized = True
        self._impl.finalize()
        self._run_post_hooks(FINALIZE_OP_ID, hook_args.FinalizePostHookArgs())

    def abort(self) -> None:
        for hook in list(self._abort_hooks.values()):
            hook()
        self._impl.abort()

    def reconfigure(
        self,
        uuid: int,
        init_handles: list[str] | set[str],
        timeout: timedelta | None = None,
        hints: dict[str, str] | None = None,
    ) -> TorchWork:
        self._checkers.clear()  # rank and size may change
        work = self._impl.reconfigure(uuid, init_handles, timeout, hints)
        if isinstance(work, TorchWork):
            work.wait_blocking()
            return work
        return _wrap_plugin_result(work)

    def new_window(self, tensor: torch.Tensor | None = None) -> Any:
        return self._impl.new_window(tensor)

    def tensor_register(self, tensor: torch.Tensor) -> None:
        self._impl.tensor_register(tensor)

    def tensor_deregister(self, tensor: torch.Tensor) -> None:
        self._impl.tensor_deregister(tensor)

    def __del__(self) -> None:
        try:
            if not self._finalized:
                logger.debug("TorchComm %s was destroyed without finalize()", self._safe_name())
        except Exception:
            pass


class BatchSendRecv:
    """Sends and receives collected with ``send``/``recv`` and issued together by ``issue``."""

    def __init__(self, comm: TorchComm) -> None:
        self._comm = comm
        self.ops: list[P2POp] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        c = self._comm._checker("batch send")
        c.tensor(tensor)
        c.peer("dst", dst, "send to")
        self.ops.append(P2POp(P2POpType.SEND, tensor, dst))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        c = self._comm._checker("batch recv")
        c.tensor(tensor)
        c.peer("src", src, "recv from")
        self.ops.append(P2POp(P2POpType.RECV, tensor, src))

    def issue(self, async_op: bool, options: BatchP2POptions | None = None) -> TorchWork:
        comm = self._comm
        c = comm._checker("batch_op_issue")
        c.async_op(async_op)
        if not self.ops:
            raise c.fail("Cannot issue empty batch operation")
        for op in self.ops:
            c.tensor(op.tensor)
            c.peer("peer", op.peer, "send to" if op.type is P2POpType.SEND else "recv from")
        opts = options or BatchP2POptions()
        ops = list(self.ops)
        impl = comm._impl
        if not comm._native:
            raise RuntimeError(
                "[PyTorchCommBackend]: batch_op_issue not implemented for Python backends"
            )
        resolved = comm._resolve_timeout(opts.timeout, "batch_op_issue", opts.hints)
        op_id = _next_op_id()
        pre_args = hook_args.BatchOpIssuePreHookArgs(len(ops), async_op)
        comm._run_pre_hooks(OpName.batch_op_issue, op_id, pre_args)
        work = comm._observed(
            OpName.batch_op_issue,
            op_id,
            pre_args,
            resolved,
            lambda: impl.batch_op_issue(  # type: ignore[attr-defined]
                ops, async_op, OpOptions(resolved, dict(opts.hints), "batch_op_issue", op_id)
            ),
        )
        comm._run_post_hooks(op_id, hook_args.BatchOpIssuePostHookArgs(work))
        return work


def _wrap_plugin_result(result: Any) -> TorchWork:
    if result is None:
        return completed_python_work()
    if isinstance(result, TorchWork):
        return result
    if not callable(getattr(result, "wait", None)):
        raise TypeError(
            "a Python backend op must return None or an object with wait(), "
            f"got {type(result).__name__}"
        )
    return PythonBackendWork(result)


def _as_device(device: torch.device | str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        return torch.device(device)
    raise TypeError(f"new_comm: device must be a torch.device, got {type(device).__name__}")


def new_comm(
    backend: str,
    device: torch.device,
    name: str,
    abort_process_on_timeout_or_error: bool | None = None,
    timeout: timedelta | None = None,
    is_high_priority_stream: bool | None = None,
    store: Any = None,
    enable_reconfigure: bool = False,
    hints: dict[str, str] | None = None,
) -> TorchComm:
    """Create a communicator over every rank of the job (collective: all ranks call it)."""
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"new_comm: backend must be a non-empty str, got {backend!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"new_comm: name must be a non-empty str, got {name!r}")
    dev = _as_device(device)
    options = CommOptions()
    options.timeout = config.default_timeout()
    options.abort_process_on_timeout_or_error = config.default_abort_on_error()
    if abort_process_on_timeout_or_error is not None:
        options.abort_process_on_timeout_or_error = bool(abort_process_on_timeout_or_error)
    if timeout is not None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"new_comm: timeout must be a timedelta, got {type(timeout).__name__}")
        if timeout <= timedelta(0):
            raise ValueError(f"new_comm: timeout must be positive, got {timeout}")
        options.timeout = timeout
    if is_high_priority_stream is not None:
        options.is_high_priority_stream = bool(is_high_priority_stream)
    options.store = store
    options.enable_reconfigure = bool(enable_reconfigure)
    if hints is not None:
        if not isinstance(hints, dict):
            raise TypeError(f"new_comm: hints must be a dict[str, str], got {type(hints).__name__}")
        options.hints = {str(k): str(v) for k, v in hints.items()}
    backend_class = registry.get_backend_class(backend)
    impl = backend_class()
    if not isinstance(impl, TorchCommBackend):
        raise TypeError(
            f"backend {backend!r} class {backend_class.__name__} must subclass TorchCommBackend"
        )
    if enable_reconfigure and not impl.supports_reconfigure():
        raise RuntimeError(
            f"[TorchComm]: enable_reconfigure=true is not supported by backend: {backend}"
        )
    impl._device = dev
    impl._options = options
    impl.init(dev, name, options)
    comm = TorchComm(backend, impl, dev, options)
    for factory in list(_default_observer_factories):
        observer = factory(comm)
        if observer is not None:
            comm._add_observer(observer)
    return comm


ObserverFactory = Callable[[TorchComm], "OpObserver | None"]
_default_observer_factories: list[ObserverFactory] = []


def add_default_observer(factory: ObserverFactory) -> None:
    """Call ``factory(comm)`` for every communicator ``new_comm`` creates from now on.

    Used by always-on tooling (the flight recorder, ``TORCHCOMM_LOG_JSON``): the factory
    returns the observer to attach, or ``None`` to leave that comm alone.
    """
    if factory not in _default_observer_factories:
        _default_observer_factories.append(factory)
