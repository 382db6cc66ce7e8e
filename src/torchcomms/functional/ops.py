"""The ``torchcomms::`` custom ops a compiled graph calls, with their fake implementations.

Every communicator operation (a row of ``torchcomms.functional.table``) has, under upstream's
names, ``torchcomm_<method>_`` (in place, ``async_op=False``) and, if it writes tensors,
``torchcomm_<method>`` (functional); ``torchcomm_<method>_async`` is the form an
``async_op=True`` call emits, and ``torchcomm_wait_`` waits for it.  Each takes the opaque
communicator, an *order token* and the operation's arguments flattened into schema types (a
reduce op as ``(int type, float? factor, Tensor? factor_tensor)``, hints as two ``str[]`` (one
``str`` in the functional ops), the timeout as ``float?`` seconds, and ``call_id``, a constant naming the call site).

* ``torchcomm_<method>_`` runs the eager call to completion and declares the tensors it
  writes as mutated (``Tensor(a!)``), so functionalization and Inductor order every later
  read after it.
* ``torchcomm_<method>`` writes nothing: it runs the eager call on copies of the tensors the
  op writes and returns them, after a new order token.  It is the op autograd formulas
  (``torchcomms.functional.autograd``) are registered on; a traced call with an input that
  requires grad emits it and copies its results into the outputs under autograd.
* ``torchcomm_<method>_async`` issues the eager call with ``async_op=True`` on *private
  copies* of its tensors and returns; it declares no tensor written.  ``torchcomm_wait_`` (on
  the call's ``TracedWork``) waits for it and copies the results into the tensors it
  declares mutated.  Copies, because functionalization may hand an op a clone of a tensor
  and Inductor may reuse a buffer after its last read: memory the graph owns is never
  written or read behind the graph's back.  So inside a graph an async op reads its inputs
  when it is issued and its outputs change at ``wait()``.
* ``torchcomm_wait_tensors_(Tensor(a!)[])`` and ``torchcomm_wait_tensors(Tensor[])`` are
  upstream's public waits: the identity on values and for gradients (``requires_grad``
  propagated).  A ``TorchCommsAsyncTensor`` argument is waited as the op dispatches.

The order token is one zero-element tensor every op mutates (the functional ops read it and
return its successor, which the traced call writes back): all communicator ops of a graph
form one chain, so no pass can reorder them against each other (ranks must issue
collectives in the same order) nor drop one whose results go unused (``send``, ``barrier``,
``torchcomm_wait_``).

The kernels (the caller's thread, when the compiled graph runs) call the communicator's
eager method: validation, op ids, hooks, the flight recorder and timeouts are exactly
those of an eager call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch

from torchcomms.comm import TorchComm
from torchcomms.functional import table
from torchcomms.runtime.work import TorchWork
from torchcomms.types import BatchP2POptions, RedOpType, ReduceOp

NAMESPACE = "torchcomms"
#: The arguments every communicator op ends with.
_TAIL = "bool async_op, str[] hint_keys, str[] hint_values, float? timeout_s, int call_id"
#: The functional ops' tail: hints as one string (``hints_text``), as ``torch.library``'s
#: autograd mishandles an empty list argument (an empty ``str[]`` breaks its backward).
_FUNCTIONAL_TAIL = "bool async_op, str hints, float? timeout_s, int call_id"
_HINT_SEP, _KV_SEP = "\x1f", "\x1e"
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


def hints_text(keys: Sequence[str], values: Sequence[str]) -> str:
    """Hints as the functional ops take them: one string (``""``: none)."""
    return _HINT_SEP.join(k + _KV_SEP + v for k, v in zip(keys, values, strict=True))


def _hints(text: str) -> tuple[list[str], list[str]]:
    keys: list[str] = []
    values: list[str] = []
    for item in text.split(_HINT_SEP) if text else ():
        key, _, value = item.partition(_KV_SEP)
        keys.append(key)
        values.append(value)
    return keys, values


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
    """``torchcomm_all_reduce_`` -> ``torchcomm_all_reduce_async``: what ``async_op=True``
    emits."""
    return name + "async"


#: The graph's wait for an async op (``TracedWork.wait``); upstream's waits are below.
WAIT = table.PREFIX + "wait_"
WAIT_TENSORS = table.PREFIX + "wait_tensors"


def _fake(*args: Any) -> None:
    """An in-place op only writes its mutated arguments: nothing to compute when tracing."""


def _written(value: Any) -> Any:
    """A new tensor (or list) shaped as a written argument, for the functional ops."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return [t.clone() for t in value]


def _functional(eager: _Eager, mutated: tuple[int, ...]) -> Callable[..., Any]:
    """The functional op's kernel: the eager call, always sync, on copies it then returns."""

    def kernel(comm: TorchComm, token: torch.Tensor, *args: Any) -> tuple[Any, ...]:
        *own, _async_op, hints, timeout_s, _call_id = args
        own = [_written(a) if i in mutated else a for i, a in enumerate(own)]
        eager(comm, own, False, _kwargs(*_hints(hints), timeout_s))
        return (token.new_empty(0), *(own[i] for i in mutated))

    return kernel


def _functional_fake(mutated: tuple[int, ...]) -> Callable[..., Any]:
    def fake(comm: Any, token: torch.Tensor, *args: Any) -> tuple[Any, ...]:
        own = args[:-4]
        outs = []
        for i in mutated:
            v = own[i]
            outs.append(
                torch.empty_like(v)
                if isinstance(v, torch.Tensor)
                else [torch.empty_like(t) for t in v]
            )
        return (token.new_empty(0), *outs)

    return fake


def _wait_tensors(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Upstream's functional wait: new tensors equal to the (waited) inputs."""
    return [t.clone() for t in inputs]


def _wait_tensors_fake(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in inputs]


def _wait_tensors_(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Upstream's in-place wait: the inputs themselves (aliased, declared written)."""
    return inputs


def _identity_backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    return (grads,)


def _no_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    pass


def _wait_tensors_autograd(keyset: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The in-place wait under autograd: values unchanged, so the inputs keep their history."""
    op = getattr(torch.ops.torchcomms, WAIT_TENSORS + "_").default
    with torch._C._AutoDispatchBelowAutograd():
        result: list[torch.Tensor] = op.redispatch(keyset & torch._C._after_autograd_keyset, inputs)
    return result


def _wait_tensors_functionalize(ctx: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Functionalization turns the in-place wait into the functional one (Inductor's view)."""
    unwrapped = ctx.unwrap_tensors(inputs)
    with ctx.redispatch_to_next():
        result = getattr(torch.ops.torchcomms, WAIT_TENSORS)(unwrapped)
    for old, new in zip(inputs, result, strict=True):
        ctx.replace(old, new)
        ctx.commit_update(old)
        ctx.sync(old)
    return inputs


def _define_waits(lib: torch.library.Library) -> None:
    """Upstream's ``torchcomm_wait_tensors`` and ``torchcomm_wait_tensors_``."""
    name = WAIT_TENSORS
    lib.define(f"{name}(Tensor[] inputs) -> Tensor[]")
    lib.impl(name, _wait_tensors, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", _wait_tensors_fake, lib=lib)
    torch.library.register_autograd(
        f"{NAMESPACE}::{name}", _identity_backward, setup_context=_no_context, lib=lib
    )
    lib.define(f"{name}_(Tensor(a!)[] inputs) -> Tensor(a!)[]")
    lib.impl(name + "_", _wait_tensors_, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}_", _wait_tensors_, lib=lib)
    lib.impl(name + "_", _wait_tensors_autograd, "Autograd", with_keyset=True)
    getattr(torch.ops.torchcomms, name + "_").default.py_functionalize_impl(
        _wait_tensors_functionalize
    )


def define(comm_type_name: str) -> None:
    """Define the ops once, for the opaque communicator type named ``comm_type_name``."""
    global _library
    if _library is not None:
        return
    from torchcomms.functional import autograd

    lib = torch.library.Library(NAMESPACE, "DEF")
    head = f"{comm_type_name} comm, Tensor(t!) token"
    rows = [(spec, _eager(spec)) for spec in table.OPS] + [(table.BATCH, _batch_issue)]
    for spec, eager in rows:
        name, args = spec.op, spec.schema()
        mutated = spec.mutated()
        kernel = _real(eager, mutated)
        tail = f"{args + ', ' if args else ''}{_TAIL}"
        # the async form writes nothing when it runs (module docstring): no "!" on its outputs
        for op, op_args in ((name, tail), (async_name(name), tail.replace("(a!)", ""))):
            lib.define(f"{op}({head}, {op_args}) -> ()")
            lib.impl(op, kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{op}", _fake, lib=lib)
        if not mutated or spec is table.BATCH:
            continue
        functional = spec.functional
        plain = (
            f"{comm_type_name} comm, Tensor token, {args.replace('(a!)', '')}, {_FUNCTIONAL_TAIL}"
        )
        lib.define(f"{functional}({plain}) -> {spec.functional_returns()}")
        lib.impl(functional, _functional(eager, mutated), "CompositeExplicitAutograd")
        torch.library.register_fake(
            f"{NAMESPACE}::{functional}", _functional_fake(mutated), lib=lib
        )
        if autograd.differentiable(spec):
            autograd.register(spec, lib)
    lib.define(f"{WAIT}(Tensor(t!) token, Tensor(a!)[] tensors, int call_id) -> ()")
    lib.impl(WAIT, _wait, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{WAIT}", _fake, lib=lib)
    _define_waits(lib)
    _library = lib
