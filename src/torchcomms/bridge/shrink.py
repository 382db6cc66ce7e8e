"""``dist.shrink_group`` on a torchcomms process group (the bridge's ``Backend.shrink``).

torch 2.13 registers what ``shrink`` returns in a new C++ ``ProcessGroup``, which takes
only a C++ ``c10d.Backend``, and a Python class cannot be one.  So the shrunk group runs
on a ``ProcessGroupGloo`` over the survivors.  They meet through the torchcomms comm's own
``shrink`` first: it agrees on who is left (a member that died since is caught too) on a
store that outlives rank 0, and its new comm's store is where the gloo group connects.
``get_comm()`` on the returned backend gives that survivors' ``TorchComm``.

Runs on the thread that calls ``dist.shrink_group`` (only survivors call it); imported
when it runs, after ``torch.distributed`` is whole.
"""

from __future__ import annotations

import itertools

import torch._C._distributed_c10d as c10d

from torchcomms.backends.cpu.backend import TorchCommGloo
from torchcomms.comm import TorchComm
from torchcomms.transport.gloo import process_group as gloo

#: torch's ``SHRINK_ABORT`` flag (``distributed_c10d.SHRINK_ABORT``): abort in-flight work.
SHRINK_ABORT = 0x01

_shrinks = itertools.count(1)
#: torch keeps only the C++ part of a backend: the Python object (and its comm) live here.
_kept: list[ShrunkGloo] = []


class ShrunkGloo(c10d.ProcessGroupGloo):
    """The c10d gloo backend of a shrunk group, with the survivors' comm beside it."""

    comm: TorchComm

    def get_comm(self) -> TorchComm:
        return self.comm


def shrink(comm: TorchComm, ranks_to_exclude: list[int], shrink_flags: int) -> ShrunkGloo:
    """The survivors' backend: ``comm.shrink``, then a gloo group over the same members."""
    if not isinstance(comm.get_backend_impl(), TorchCommGloo):
        raise RuntimeError(
            f"dist.shrink_group: backend {comm.get_backend()!r} cannot shrink a torch process "
            "group (only the gloo backend can)"
        )
    if shrink_flags & SHRINK_ABORT:
        comm.abort()  # in-flight ops fail now, not at their timeout
    child = comm.shrink(
        exclude_ranks=list(ranks_to_exclude), name=f"{comm.get_name()}_shrunk{next(_shrinks)}"
    )
    impl = child.get_backend_impl()
    assert isinstance(impl, TorchCommGloo)
    store, hosts, me = impl.c10d_meeting()
    _, device = gloo.choose_device({}, hosts, me)
    opts = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = child.get_options().timeout
    opts._devices = [device]
    backend = ShrunkGloo(
        c10d.PrefixStore("c10d_shrunk/", store), child.get_rank(), child.get_size(), opts
    )
    backend.comm = child
    _kept.append(backend)
    return backend
