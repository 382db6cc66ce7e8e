"""``CpuOps``: what one transport of the CPU backend implements (gloo, shm, hierarchical).

``TorchCommGloo`` picks one ``CpuOps`` per communicator at connect and runs every op as
one call on it, inside its execution plumbing (issue order, deadline, error typing).  A
new transport is one new subclass; the op methods of the backend do not change.

Contract, for every method:

* arguments are the API's, already validated by ``TorchComm`` (so sizes, roots and
  dtypes agree with the reference's rules); tensors may live on any device, and an
  implementation stages them through host memory itself;
* ``deadline`` bounds every wait of the op (``torchcomms.runtime.deadline``);
* the calling thread is the op's thread: the caller's for sync ops, the communicator's
  executor thread for async ones; one op at a time per communicator (issue order);
* errors are raised as they come (``WaitError``, gloo's ``RuntimeError``);
  the backend turns them into typed errors and reports the failure.

The composite ops whose shape is the same on every transport (``gather_single``,
``all_to_all`` and its variable-size single-tensor form) are written once here, over
``gather`` and ``all_to_all_flat``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

from torchcomms import optable
from torchcomms.runtime.deadline import Deadline
from torchcomms.types import P2POp, P2POpType, ReduceOp

#: Waits for point-to-point transfers that were posted without blocking.
Completion = Callable[[], None]


class CpuOps(abc.ABC):
    """Every operation of the CPU backend over one transport (see the module docstring)."""

    rank: int
    size: int

    @abc.abstractmethod
    def describe(self) -> str:
        """How this transport moves bytes, for logs and ``transport`` (e.g. ``shm (2 ranks …)``)."""

    # -- lifecycle -----------------------------------------------------------------------
    @abc.abstractmethod
    def fail(
        self, dead: Sequence[int] = (), missing: Sequence[int] = (), blamed: Sequence[int] = ()
    ) -> None:
        """Tell the peers this rank failed (because ``dead`` died, it timed out waiting for
        ``missing``, or ``blamed`` failed it otherwise, if known), so none of them waits for
        it any longer."""

    @abc.abstractmethod
    def close(self, failed: bool) -> None:
        """Release the transport (after ``fail()`` the peers see a failure, else a finalize)."""

    def unattended(self) -> None:
        """Point-to-point ops were posted for an async work, whose completion runs only
        when someone waits for it: a transport that moves bytes only inside waits starts
        a helper (``transport.tcp.p2p``).  Default: nothing (gloo and shm progress on their own)."""
        return None

    def abort(self) -> None:
        """Make every wait of this transport, on any thread, raise within a second; local only.

        Called from any thread (``TorchComm.abort``); later ops are refused by the backend.
        """
        self.fail()

    def dead_peers(self) -> list[int]:
        """Members known to be gone (their process exited); used to explain a failure."""
        return []

    # -- the ops: each op of the table (``torchcomms.optable``) but send and recv is a method of
    # its name taking the op's arguments and a ``deadline`` (``required_ops``); those the CPU
    # backend calls by name only are not declared here, the rest are (the hot ops, and what
    # the composite ops below build on).
    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, deadline: Deadline) -> None: ...

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, deadline: Deadline) -> None: ...

    # -- rooted --------------------------------------------------------------------------
    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None: ...

    @abc.abstractmethod
    def gather(
        self,
        output_list: Sequence[torch.Tensor],
        input: torch.Tensor,
        root: int,
        deadline: Deadline,
    ) -> None: ...

    def gather_single(
        self, output: torch.Tensor, input: torch.Tensor, root: int, deadline: Deadline
    ) -> None:
        """The root's ``output`` holds ``size`` rank-ordered copies' worth of elements."""
        outs = list(output.view(-1).chunk(self.size)) if self.rank == root else []
        self.gather(outs, input, root, deadline)

    # -- gathers -------------------------------------------------------------------------

    @abc.abstractmethod
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, deadline: Deadline
    ) -> None: ...

    # -- all-to-all ----------------------------------------------------------------------
    @abc.abstractmethod
    def all_to_all_flat(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        deadline: Deadline,
    ) -> None:
        """Contiguous tensors, element counts per peer; empty splits mean equal parts."""

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, deadline: Deadline
    ) -> None:
        self.all_to_all_flat(output, input, (), (), deadline)

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        deadline: Deadline,
    ) -> None:
        """Splits count dim-0 rows; each row holds the same number of elements on both sides."""
        out_row = output[0].numel() if output.dim() > 0 and output.shape[0] > 0 else 1
        in_row = input[0].numel() if input.dim() > 0 and input.shape[0] > 0 else 1
        out_elems = [s * out_row for s in output_split_sizes]
        in_elems = [s * in_row for s in input_split_sizes]
        self.all_to_all_flat(
            output.view(-1)[: sum(out_elems)],
            input.reshape(-1)[: sum(in_elems)],
            out_elems,
            in_elems,
            deadline,
        )

    def all_to_all(
        self,
        output_list: Sequence[torch.Tensor],
        input_list: Sequence[torch.Tensor],
        deadline: Deadline,
    ) -> None:
        in_elems = [t.numel() for t in input_list]
        out_elems = [t.numel() for t in output_list]
        if sum(in_elems) == 0 and sum(out_elems) == 0:
            return
        flat_in = torch.cat([t.detach().to("cpu").reshape(-1) for t in input_list])
        flat_out = torch.empty(sum(out_elems), dtype=input_list[0].dtype)
        self.all_to_all_flat(flat_out, flat_in, out_elems, in_elems, deadline)
        offset = 0
        for out, n in zip(output_list, out_elems, strict=True):
            out.copy_(flat_out[offset : offset + n].view(out.shape))
            offset += n

    # -- synchronisation and point-to-point -----------------------------------------------
    @abc.abstractmethod
    def barrier(self, deadline: Deadline) -> None: ...

    def transfer(self, sending: bool, tensor: torch.Tensor, peer: int, deadline: Deadline) -> None:
        """One untagged sync send or receive of a non-empty tensor, waited for here (the
        latency path of ``send``/``recv``).  It matches ``post``'s messages in issue
        order.  Default: ``post`` and wait; transports may do it with less."""
        kind = P2POpType.SEND if sending else P2POpType.RECV
        self.post([P2POp(kind, tensor, peer)], None, deadline)()

    @abc.abstractmethod
    def post(self, ops: Sequence[P2POp], tag: int | None, deadline: Deadline) -> Completion:
        """Post sends and receives without blocking; the completion waits for all of them.

        Untagged messages between two ranks match in issue order; a ``tag`` (the c10d
        bridge's tags) matches only messages of the same tag, as in c10d.
        """


def required_ops() -> frozenset[str]:
    """The methods every transport has: each op of the table but point-to-point (``post``
    and ``transfer`` carry those)."""
    return frozenset(e.method for e in optable.OPS if not e.p2p)
