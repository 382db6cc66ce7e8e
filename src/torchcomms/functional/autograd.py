"""Autograd formulas of the functional ops (``torchcomm_<method>``), as upstream defines them.

Each backward is a collective over the same communicator, emitted as a functional op, so a
compiled graph's backward graph holds it like any other op (and an eager backward runs it):

* ``all_reduce``: the same all_reduce of the gradient (``SUM``, ``AVG`` and ``PREMUL_SUM``,
  the linear reductions; a traced call with another one adds no autograd node, and the
  formula refuses one);
* ``all_gather`` / ``all_gather_single``: a ``SUM`` reduce_scatter of the gradients;
* ``reduce_scatter`` / ``reduce_scatter_single``: an all_gather of the gradient, scaled as
  the reduction scales (``AVG``: by 1 / size, ``PREMUL_SUM(f)``: by ``f``);
* ``all_to_all_single``: the same exchange; ``all_to_all_v_single``: the reverse one (the
  split sizes swapped).

Only the inputs an op reads get a gradient; the output buffers it writes get none.  A
gradient autograd leaves undefined is taken as zeros, so every rank still calls the backward
collective the others call.  The backward's order token is the forward's successor token
(saved), which keeps the backward ops after the forward ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchcomms.functional import table
from torchcomms.types import RedOpType

_SUM = (RedOpType.SUM.value, None, None)
_LINEAR = (RedOpType.SUM.value, RedOpType.AVG.value, RedOpType.PREMUL_SUM.value)
_Grads = dict[str, Any]


def _call(method: str, comm: Any, token: torch.Tensor, *args: Any) -> tuple[Any, ...]:
    """The functional op of ``method``, sync, default hints and timeout; its written outputs."""
    op = getattr(torch.ops.torchcomms, table.PREFIX + method)
    result: tuple[Any, ...] = op(comm, token, *args, False, "", None, -1)
    return result[1:]


class _Saved:
    """What a backward needs from its forward, read from the functional op's arguments: the
    shapes of the tensors, the split sizes, the reduce op (its factor tensor, if any, goes to
    ``save_for_backward``)."""

    def __init__(self, spec: table.OpSpec, inputs: tuple[Any, ...]) -> None:
        self.values: dict[str, Any] = {}
        self.factor_tensor: torch.Tensor | None = None
        at = 2  # after comm and token
        for name, kind in zip(spec.names, spec.kinds, strict=True):
            value = inputs[at]
            if kind == table.RED:
                value = (inputs[at], inputs[at + 1])
                self.factor_tensor = inputs[at + 2]
            elif kind in (table.TENSOR, table.OUT):
                value = value.shape
            elif kind in (table.TENSORS, table.OUTS):
                value = [t.shape for t in value]
            self.values[name] = value
            at += table.WIDTH[kind]


def _tensor_list(value: Any) -> bool:
    """A list autograd treats as a list of gradients (``torch.library``'s rule: a list with no
    element that is not a tensor); anything else takes one gradient, ``None`` here."""
    return isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value)


def _zeros(grad: torch.Tensor | None, shape: Any, like: torch.Tensor) -> torch.Tensor:
    """The gradient, contiguous; zeros where autograd left it undefined."""
    if grad is None:
        return like.new_zeros(shape)
    return grad.contiguous()


def _check_linear(method: str, red: int) -> int:
    if red not in _LINEAR:
        raise RuntimeError(
            f"torchcomms autograd: {method} backward is defined for the linear reductions "
            f"(SUM, AVG, PREMUL_SUM); got {RedOpType(red).name}"
        )
    return red


def register(spec: table.OpSpec, lib: torch.library.Library) -> None:
    """Register the formula of one differentiable op (``differentiable``) on its functional op."""
    backward_of = _BACKWARDS[spec.method]
    positions: dict[str, int] = {}
    at = 2
    for name, kind in zip(spec.names, spec.kinds, strict=True):
        positions[name] = at
        at += table.WIDTH[kind]

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        ctx.comm = inputs[0]
        ctx.size = inputs[0].get_size()
        # autograd wants one gradient per input, of its structure: a list for a list of tensors
        ctx.lists = [len(v) if _tensor_list(v) else -1 for v in inputs]
        ctx.saved = _Saved(spec, inputs)
        ctx.save_for_backward(output[0], ctx.saved.factor_tensor)
        ctx.saved.factor_tensor = None  # kept by save_for_backward, not as an attribute

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        token, factor_tensor = ctx.saved_tensors
        out: list[Any] = [None if n < 0 else [None] * n for n in ctx.lists]
        for name, grad in backward_of(ctx, token, factor_tensor, grads[1:]).items():
            out[positions[name]] = grad
        return tuple(out)

    torch.library.register_autograd(
        f"torchcomms::{spec.functional}", backward, setup_context=setup_context, lib=lib
    )


# -- the formulas: (ctx, token, factor_tensor, output grads) -> {input name: grad} -------------
_Backward = Callable[[Any, torch.Tensor, Any, tuple[Any, ...]], _Grads]
#: The formulas by op: ``_<op>`` below, registered by ``_formula``.
_BACKWARDS: dict[str, _Backward] = {}


def _formula(fn: _Backward) -> _Backward:
    """Register ``fn`` (named ``_<op>``) as the backward of ``<op>``."""
    _BACKWARDS[fn.__name__.removeprefix("_")] = fn
    return fn


@_formula
def _all_reduce(ctx: Any, token: torch.Tensor, ft: Any, grads: tuple[Any, ...]) -> _Grads:
    red, factor = ctx.saved.values["op"]
    red = _check_linear("all_reduce", red)
    g = _zeros(grads[0], ctx.saved.values["tensor"], token)
    (result,) = _call("all_reduce", ctx.comm, token, g, red, factor, ft)
    return {"tensor": result}


def _single_backward(
    ctx: Any, token: torch.Tensor, grads: tuple[Any, ...], op: str, *args: Any
) -> Any:
    """``op`` (then ``args``) from the output's gradient into a tensor shaped as the input: the
    backward of a ``*_single`` op."""
    g = _zeros(grads[0], ctx.saved.values["output"], token)
    template = g.new_empty(ctx.saved.values["input"])
    (result,) = _call(op, ctx.comm, token, template, g, *args)
    return result


@_formula
def _all_gather_single(ctx: Any, token: torch.Tensor, ft: Any, grads: tuple[Any, ...]) -> _Grads:
    return {"input": _single_backward(ctx, token, grads, "reduce_scatter_single", *_SUM)}


@_formula
def _all_gather(ctx: Any, token: torch.Tensor, ft: Any, grads: tuple[Any, ...]) -> _Grads:
    shapes = ctx.saved.values["tensor_list"]
    gs = [_zeros(g, s, token) for g, s in zip(grads[0], shapes, strict=True)]
    template = gs[0].new_empty(ctx.saved.values["tensor"])
    (result,) = _call("reduce_scatter", ctx.comm, token, template, gs, *_SUM)
    return {"tensor": result}


def _scaled(ctx: Any, grads: Any, ft: Any, method: str) -> Any:
    """The gathered gradient times d(reduction)/d(input): 1 (SUM), 1/size (AVG), f (PREMUL)."""
    red, factor = ctx.saved.values["op"]
    red = _check_linear(method, red)
    if red == RedOpType.SUM.value:
        return grads
    if red == RedOpType.AVG.value:  # divided, not multiplied by 1 / size: exact where it can be
        if isinstance(grads, list):
            return [g / ctx.size for g in grads]
        return grads / ctx.size
    scale = ft if ft is not None else float(factor or 0)
    if isinstance(grads, list):
        return [g * scale for g in grads]
    return grads * scale


@_formula
def _reduce_scatter_single(
    ctx: Any, token: torch.Tensor, ft: Any, grads: tuple[Any, ...]
) -> _Grads:
    result = _single_backward(ctx, token, grads, "all_gather_single")
    return {"input": _scaled(ctx, result, ft, "reduce_scatter_single")}


@_formula
def _reduce_scatter(ctx: Any, token: torch.Tensor, ft: Any, grads: tuple[Any, ...]) -> _Grads:
    g = _zeros(grads[0], ctx.saved.values["output"], token)
    templates = [g.new_empty(s) for s in ctx.saved.values["input_list"]]
    (result,) = _call("all_gather", ctx.comm, token, templates, g)
    return {"input_list": _scaled(ctx, list(result), ft, "reduce_scatter")}


@_formula
def _all_to_all_single(ctx: Any, token: torch.Tensor, ft: Any, grads: tuple[Any, ...]) -> _Grads:
    return {"input": _single_backward(ctx, token, grads, "all_to_all_single")}


@_formula
def _all_to_all_v_single(ctx: Any, token: torch.Tensor, ft: Any, grads: tuple[Any, ...]) -> _Grads:
    saved = ctx.saved.values
    g = _zeros(grads[0], saved["output"], token)
    template = g.new_empty(saved["input"])
    # the reverse exchange: what this rank received goes back where it came from
    (result,) = _call(
        "all_to_all_v_single",
        ctx.comm,
        token,
        template,
        g,
        list(saved["input_split_sizes"]),
        list(saved["output_split_sizes"]),
    )
    return {"input": result}


def differentiable(spec: table.OpSpec) -> bool:
    """Whether the op has an autograd formula here (upstream's set: the others write
    outside autograd)."""
    return spec.method in _BACKWARDS
