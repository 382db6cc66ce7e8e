"""``TorchCommsAsyncTensor``: a collective's result that waits for its work when first used.

Upstream's class, written here from its documented behaviour: a tensor subclass wrapping
``elem`` (the tensor the collective writes) and ``work`` (its ``TorchWork``, or ``None`` for
one already complete).  Any torch function or op on it waits for the work first, once, and
then runs on ``elem``; so does ``wait()`` and ``backward()``.  It is transparent to autograd:
``grad_fn``, ``is_leaf`` and ``grad`` are ``elem``'s (a wrapper of a leaf is a leaf), and the
result of an op on it has ``elem``'s history.  ``__tensor_flatten__`` /
``__tensor_unflatten__`` let Dynamo trace through it.

Used by one thread (the one that issued the work), like the work itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["TorchCommsAsyncTensor"]


class TorchCommsAsyncTensor(torch.Tensor):
    """An async collective's result; waits for its work on first use (see the module)."""

    elem: torch.Tensor
    work: Any
    completed: bool

    @staticmethod
    def __new__(cls, elem: torch.Tensor, work: Any) -> TorchCommsAsyncTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=elem.device,
            requires_grad=elem.requires_grad,
        )
        out.elem = elem
        out.work = work
        out.completed = work is None
        return out

    def __init__(self, elem: torch.Tensor, work: Any) -> None:
        super().__init__()

    # -- autograd: elem's ---------------------------------------------------------------------
    @property
    def grad_fn(self) -> Any:  # type: ignore[override]
        return self.elem.grad_fn

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]
        return bool(self.elem.is_leaf)

    @property
    def grad(self) -> torch.Tensor | None:
        return self.elem.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        self.elem.grad = value

    # -- waiting ------------------------------------------------------------------------------
    def trigger_wait(self) -> torch.Tensor:
        """Wait for the work (the first time only) and return ``elem``."""
        if not self.completed:
            self.completed = True
            if self.work is not None:
                self.work.wait()
        return self.elem

    def wait(self) -> torch.Tensor:
        """Wait for the work and return the result tensor."""
        return self.trigger_wait()

    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        self.trigger_wait().backward(gradient, retain_graph, create_graph, inputs)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"TorchCommsAsyncTensor({self.trigger_wait()!r})"

    # -- Dynamo -------------------------------------------------------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, bool]]:
        return ["elem"], (self.work, self.completed)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: tuple[Any, bool], size: Any, stride: Any
    ) -> TorchCommsAsyncTensor:
        work, completed = meta
        out = TorchCommsAsyncTensor(inner["elem"], work)
        out.completed = completed
        return out

    # -- every op waits first, then runs on elem ----------------------------------------------
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _after_waits(func, args, kwargs)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _after_waits(func, args, kwargs)


def _after_waits(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` on the arguments, every ``TorchCommsAsyncTensor`` among them waited first."""
    unwrap = TorchCommsAsyncTensor.trigger_wait
    args = pytree.tree_map_only(TorchCommsAsyncTensor, unwrap, args)
    kwargs = pytree.tree_map_only(TorchCommsAsyncTensor, unwrap, kwargs or {})
    return func(*args, **kwargs)
