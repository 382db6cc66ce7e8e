"""The ``torchcomms::`` custom ops a compiled graph calls, with their fake implementations.

Every communicator operation (a row of ``torchcomms.functional.table``) has two ops:
``<name>_`` for ``async_op=False`` and ``<name>_async`` for ``async_op=True``, plus ``wait_``.  Each takes the opaque
communicator, an *order token* and the operation's arguments flattened into schema types
(a reduce op as ``(int type, float? factor, Tensor? factor_tensor)``, hints as two
``str[]``, the timeout as ``float?`` seconds, and ``call_id``, a constant naming the call
site).

* ``<name>_`` runs the eager call to completion and declares the tensors it writes as
  mutated (``Tensor(a!)``), so functionalization and Inductor order every later read
  after it.
* ``<name>_async`` issues the eager call with ``async_op=True`` on *private copies* of its
  tensors and returns; it declares no tensor written.  ``wait_`` (on the call's
  ``TracedWork``) waits for it and copies the results into the tensors it declares
  mutated.  Copies, because functionalization may hand an op a clone of a tensor and
  Inductor may reuse a buffer after its last read: memory the graph owns is never
  written or read behind the graph's back.  So inside a graph an async op reads its
  inputs when it is issued and its outputs change at ``wait()``.

The order token is one zero-element tensor every op mutates: all communicator ops of a
graph form one chain of writes to it, so no pass can reorder them against each other
(ranks must issue collectives in the same order) nor drop one whose results go unused
(``send``, ``barrier``, ``wait_``).

The kernels (the caller's thread, when the compiled graph runs) call the communicator's
eager method: validation, op ids, hooks, the flight recorder and timeouts are exactly
those of an eager call.  The fake implementations write nothing and return nothing:
every op only mutates its arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch

from torchcomms.comm import TorchComm
from torchcomms.functional import table
from torchcomms.types import BatchP2POptions, RedOpType, ReduceOp
from torchcomms.work import TorchWork

NAMESPACE = "torchcomms"
#: The arguments every communicator op ends with.
_TAIL = "bool async_op, str[] hint_keys, str[] hint_values, float? timeout_s, int call_id"
#: A reduce op, flattened.
_RED = "int red, float? factor, Tensor? factor_tensor"

_library: torch.library.Library | None = None
#: The order token (module docstring).  Lifted into every graph that calls an op.
ORDER_TOKEN = torch.empty(0)


def reduce_op(red: int, factor: float | None, factor_tensor: torch.Tensor | None) -> ReduceOp:
    """The ``ReduceOp`` a flattened reduce op stands for."""
    kind = RedOpType(red)
    if kind is RedOpType.PREMUL_SUM:
        return ReduceOp.PREMUL_SUM(
            factor_tensor if factor_tensor is not None else float(factor or 0)
        )
    op: ReduceOp = getattr(ReduceOp, kind.name)
    return op


def _kwargs(keys: Sequence[str], values: Sequence[str], timeout_s: float | None) -> dict[str, Any]:
    hints = dict(zip(keys, values, strict=True)) if keys else None
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    return {"hints": hints, "timeout": timeout}


# -- real implementations: the eager method of the communicator ---------------------------------
_Args = list[Any]
_Eager = Callable[[TorchComm, _Args, bool, dict[str, Any]], TorchWork]


def _batch_issue(comm: TorchComm, a: _Args, async_op: bool, kw: dict[str, Any]) -> TorchWork:
    """Rebuild the batch in its original order (sends and receives interleaved as queued)."""
    sends, recvs, is_recv, peers = a
    batch = TorchComm.batch_op_create(comm)
    send_iter, recv_iter = iter(sends), iter(recvs)
    for recv, peer in zip(is_recv, peers, strict=True):
        if recv:
            batch.recv(next(recv_iter), peer)
        else:
            batch.send(next(send_iter), peer)
    options = BatchP2POptions()
    if kw["hints"]:
        options.hints = kw["hints"]
    if kw["timeout"] is not None:
        options.timeout = kw["timeout"]
    return batch.issue(async_op, options)


def _unflatten(kinds: tuple[str, ...], flat: _Args) -> _Args:
    """The eager method's arguments from the op's flattened ones (a reduce op takes three)."""
    out: _Args = []
    at = 0
    for kind in kinds:
        if kind == table.RED:
            out.append(reduce_op(*flat[at : at + 3]))
        elif kind == table.INTS:
            out.append(list(flat[at]))
        else:
            out.append(flat[at])
        at += table.WIDTH[kind]
    return out


def _eager(spec: table.OpSpec) -> _Eager:
    """The eager call behind one row of ``table.OPS``: the communicator's own method."""
    method = getattr(TorchComm, spec.method)
    kinds = spec.kinds

    def call(comm: TorchComm, flat: _Args, async_op: bool, kw: dict[str, Any]) -> TorchWork:
        work: TorchWork = method(comm, *_unflatten(kinds, flat), async_op, **kw)
        return work

    return call


class _Pending:
    """Async ops issued by a graph and not yet waited, keyed by their call site's id.

    Each entry holds the op's work and its private outputs.  Used only by the thread that
    runs the graph (a communicator is driven by one thread).
    """

    def __init__(self) -> None:
        self._works: dict[int, tuple[TorchWork, list[torch.Tensor]]] = {}

    def add(self, call_id: int, work: TorchWork, private: list[torch.Tensor]) -> None:
        if call_id in self._works:
            raise RuntimeError(
                "torchcomms compiled graph: an async op was issued again at the same call site "
                "before the work of its previous run was waited; call work.wait() on every "
                "async op's work (its outputs are written at wait())"
            )
        self._works[call_id] = (work, private)

    def wait(self, call_id: int, tensors: list[torch.Tensor]) -> None:
        entry = self._works.pop(call_id, None)
        if entry is None:
            return  # a sync op: it wrote its outputs inside its own op
        work, private = entry
        work.wait()
        for dst, src in zip(tensors, private, strict=True):
            dst.copy_(src)


_pending = _Pending()


def _private(value: Any) -> Any:
    """A copy the async op owns: no later kernel of the graph may reuse or read its memory."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return [t.clone() for t in value]
    return value


def _flat(values: list[Any], indices: Iterable[int]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i in indices:
        v = values[i]
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


def _real(eager: _Eager, mutated: tuple[int, ...]) -> Callable[..., None]:
    """The kernel of one op: run the eager call (sync), or issue it on private copies (async).

    Registered for both forms of the op: ``<name>_`` (sync, declares its outputs mutated)
    and ``<name>_async`` (declares nothing but the token mutated: ``wait_`` writes them).
    """

    def kernel(comm: TorchComm, token: torch.Tensor, *args: Any) -> None:
        *own, async_op, keys, values, timeout_s, call_id = args
        kw = _kwargs(keys, values, timeout_s)
        if not async_op:
            eager(comm, list(own), False, kw)
            return
        copies = [_private(a) for a in own]
        work = eager(comm, copies, True, kw)
        _pending.add(call_id, work, _flat(copies, mutated))

    return kernel


def _wait(token: torch.Tensor, tensors: list[torch.Tensor], call_id: int) -> None:
    """Wait for the async op issued at ``call_id`` and write its results into ``tensors``."""
    _pending.wait(call_id, tensors)


def async_name(name: str) -> str:
    """``all_reduce_`` -> ``all_reduce_async``: the op an ``async_op=True`` call emits."""
    return name + "async"


def _fake(*args: Any) -> None:
    """Every op only writes its mutated arguments: nothing to compute when tracing."""


def define(comm_type_name: str) -> None:
    """Define the ops once, for the opaque communicator type named ``comm_type_name``."""
    global _library
    if _library is not None:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")
    head = f"{comm_type_name} comm, Tensor(t!) token"
    rows = [(spec, _eager(spec)) for spec in table.OPS] + [(table.BATCH, _batch_issue)]
    for spec, eager in rows:
        name, args = spec.op, spec.schema()
        kernel = _real(eager, spec.mutated())
        # the async form writes nothing when it runs (module docstring): no "!" on its outputs
        for op, op_args in ((name, args), (async_name(name), args.replace("(a!)", ""))):
            lib.define(f"{op}({head}, {op_args + ', ' if op_args else ''}{_TAIL}) -> ()")
            lib.impl(op, kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{op}", _fake, lib=lib)
    lib.define("wait_(Tensor(t!) token, Tensor(a!)[] tensors, int call_id) -> ()")
    lib.impl("wait_", _wait, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::wait_", _fake, lib=lib)
    _library = lib
