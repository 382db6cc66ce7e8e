"""Each op's argument checks: upstream's rules and error texts, in upstream's order.

``check_<op>(c, *arguments)`` raises through the comm's ``Checker`` (``torchcomms.comm.validation``)
for invalid arguments; ``@op`` pairs each declaration with the check of its name.  The
checks run on the issuing thread, before the backend sees the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchcomms.comm.validation import Checker


def check_send(c: Checker, tensor: Any, dst: Any) -> None:
    c.tensor(tensor)
    c.peer("dst", dst, "send to")


def check_recv(c: Checker, tensor: Any, src: Any) -> None:
    c.tensor(tensor)
    c.peer("src", src, "recv from")


def check_broadcast(c: Checker, tensor: Any, root: Any) -> None:
    c.tensor(tensor)
    c.rank_arg("root", root)


def check_all_reduce(c: Checker, tensor: Any, op: Any) -> None:
    c.tensor(tensor)
    c.reduce_op(op, tensor.dtype)


def check_reduce(c: Checker, tensor: Any, root: Any, op: Any) -> None:
    c.tensor(tensor)
    c.rank_arg("root", root)
    c.reduce_op(op, tensor.dtype)


def _rank_list(
    what: str, one_name: str, many_name: str, role: str, each: str | None = None
) -> Callable[..., None]:
    """An op with one tensor and a list of comm_size tensors: each the size of the one
    (``each`` is then the error text), or, where sizes vary per rank, this rank's entry."""
    size_message = f"{many_name} size must equal comm_size for {what}"

    def check(c: Checker, one: Any, many: Any, *op: Any) -> None:
        c.tensor(one, one_name)
        listed = c.tensor_list(many, many_name)
        c.list_len(listed, size_message)
        if each is not None:
            for t in listed:
                c.numel_eq(t.numel(), one.numel(), each)
        else:
            c.numel_eq(
                listed[c.rank].numel(),
                one.numel(),
                f"{many_name}[{c.rank}] must have the same size as this rank's {role} tensor",
            )
        c.same_dtype(one, listed)
        if op:
            c.reduce_op(op[0], one.dtype)

    return check


_all_gather = _rank_list(
    "all_gather",
    "tensor",
    "tensor_list",
    "input",
    "All tensors in tensor_list must have same size as input tensor",
)
_all_gather_v = _rank_list("all_gather_v", "tensor", "tensor_list", "input")
check_reduce_scatter = _rank_list(
    "reduce_scatter",
    "output",
    "input_list",
    "output",
    "All input tensors must have same size as output tensor",
)
check_reduce_scatter_v = _rank_list("reduce_scatter_v", "output", "input_list", "output")


def check_all_gather(c: Checker, tensor_list: Any, tensor: Any) -> None:
    _all_gather(c, tensor, tensor_list)


def check_all_gather_v(c: Checker, tensor_list: Any, tensor: Any) -> None:
    _all_gather_v(c, tensor, tensor_list)


def _times_size(what: str, big: str) -> Callable[..., None]:
    """``output``/``input`` where the ``big`` one holds comm_size times the other's elements."""
    small_name = "input" if big == "output" else "output"
    message = f"{big.capitalize()} tensor size must be {small_name}_size * comm_size for {what}"
    big_first = big == "output"

    def check(c: Checker, output: Any, input: Any, *op: Any) -> None:
        c.tensor(output, "output")
        c.tensor(input, "input")
        large, small = (output, input) if big_first else (input, output)
        c.numel_eq(large.numel(), small.numel() * c.size, message)
        c.same_dtype(small, [large])
        if op:
            c.reduce_op(op[0], output.dtype)

    return check


check_all_gather_single = _times_size("all_gather_single", "output")
check_reduce_scatter_single = _times_size("reduce_scatter_single", "input")


def check_all_to_all_single(c: Checker, output: Any, input: Any) -> None:
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


def check_all_to_all_v_single(
    c: Checker, output: Any, input: Any, output_split_sizes: Any, input_split_sizes: Any
) -> tuple[Any, ...]:
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
    return output, input, out_splits, in_splits


def check_all_to_all(c: Checker, output_tensor_list: Any, input_tensor_list: Any) -> None:
    outs = c.tensor_list(output_tensor_list, "output_tensor_list")
    ins = c.tensor_list(input_tensor_list, "input_tensor_list")
    if len(outs) != c.size or len(ins) != c.size:
        raise c.fail(
            "Tensor list sizes must equal comm_size for all_to_all "
            f"(got {len(outs)} outputs and {len(ins)} inputs, expected {c.size})"
        )
    c.same_dtype(ins[0], ins[1:] + outs)


def check_barrier(c: Checker) -> None:
    pass


def _root_list(what: str, one: str, many: str) -> Callable[..., None]:
    """A rooted op whose root passes a list of comm_size tensors, each the size of every
    rank's one tensor (``scatter``: the root's inputs; ``gather``: its outputs)."""
    one_name, many_name = f"{one}_tensor", f"{many}_tensor_list"
    size_message = f"{many_name} size must equal comm_size for {what}"
    each_message = f"All {many} tensors must have same size as {one} tensor for {what}"

    def check(c: Checker, tensor: Any, tensors: Any, root: Any) -> None:
        c.tensor(tensor, one_name)
        c.rank_arg("root", root)
        if c.rank == root:
            listed = c.tensor_list(tensors, many_name)
            c.list_len(listed, size_message)
            for t in listed:
                c.numel_eq(t.numel(), tensor.numel(), each_message)
            c.same_dtype(tensor, listed)

    return check


_scatter = _root_list("scatter", "output", "input")
_gather = _root_list("gather", "input", "output")


def check_scatter(c: Checker, output_tensor: Any, input_tensor_list: Any, root: Any) -> None:
    _scatter(c, output_tensor, input_tensor_list, root)


def check_gather(c: Checker, output_tensor_list: Any, input_tensor: Any, root: Any) -> None:
    _gather(c, input_tensor, output_tensor_list, root)


def check_gather_single(c: Checker, output: Any, input: Any, root: Any) -> None:
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
