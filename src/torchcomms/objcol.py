"""Object collectives: picklable Python objects moved through a communicator's tensor ops.

As upstream, each rank's own ``TORCHCOMMS_SERIALIZATION`` decides its format:

* ``pickle`` on this rank: objects are sent with ``pickle`` and received payloads are
  unpickled whatever ``weights_only`` says; setting it is this rank's consent to run what
  its peers send;
* otherwise (the default): objects are sent with ``torch.save`` and loaded with
  ``torch.load(weights_only=weights_only)`` (default ``True``, so a peer cannot make this
  rank run arbitrary code).  A payload a peer pickled (its own environment says ``pickle``)
  is refused with ``pickle.UnpicklingError`` naming the setting, unless the call passes
  ``weights_only=False``.

The receiver tells the two formats apart by their first bytes.  Every call is blocking.
"""

from __future__ import annotations

import io
import pickle
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from torchcomms import config

if TYPE_CHECKING:
    from torchcomms.comm import TorchComm

#: ``torch.save`` writes a zip archive.
_ZIP_MAGIC = b"PK\x03\x04"


def _uses_pickle() -> bool:
    """This rank's ``TORCHCOMMS_SERIALIZATION`` asks for plain pickle (read at each call)."""
    return config.object_serialization() == "pickle"


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    if _uses_pickle():
        data = pickle.dumps(obj)
    else:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _from_tensor(t: torch.Tensor, weights_only: bool, where: str) -> Any:
    data = t.detach().to("cpu").numpy().tobytes()
    if data[:4] == _ZIP_MAGIC:
        return torch.load(io.BytesIO(data), weights_only=weights_only)
    if weights_only and not _uses_pickle():
        raise pickle.UnpicklingError(
            f"{where}: refusing to unpickle a payload serialised with pickle (the sender has "
            "TORCHCOMMS_SERIALIZATION=pickle, this rank does not) under weights_only=True; "
            "set TORCHCOMMS_SERIALIZATION=pickle on this rank or pass weights_only=False to "
            "accept it"
        )
    return pickle.loads(data)


def _where(comm: TorchComm, op: str) -> str:
    return f"[comm={comm.get_name()} rank={comm.get_rank()}] {op}"


def _size_tensor(n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64, device=device)


def _all_lengths(comm: TorchComm, length: int, timeout: timedelta | None) -> list[int]:
    """Every rank's payload length, in rank order."""
    device = comm.get_device()
    sizes = [_size_tensor(0, device) for _ in range(comm.get_size())]
    comm.all_gather(sizes, _size_tensor(length, device), async_op=False, timeout=timeout)
    return [int(s.item()) for s in sizes]


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.uint8, device=t.device)
    out[: t.numel()] = t
    return out


def all_gather_object(
    comm: TorchComm,
    object_list: list[Any],
    obj: Any,
    timeout: timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Fill ``object_list`` (length comm size) with every rank's ``obj``, in rank order."""
    size = comm.get_size()
    if len(object_list) != size:
        raise ValueError(
            f"all_gather_object: object_list must have comm size {size} entries, got {len(object_list)}"
        )
    device = comm.get_device()
    payload = _to_tensor(obj, device)
    lengths = _all_lengths(comm, payload.numel(), timeout)
    longest = max(lengths)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    comm.all_gather(gathered, _padded(payload, longest), async_op=False, timeout=timeout)
    for i, (t, n) in enumerate(zip(gathered, lengths, strict=True)):
        object_list[i] = _from_tensor(t[:n], weights_only, _where(comm, "all_gather_object"))


def gather_object(
    comm: TorchComm,
    obj: Any,
    root: int,
    object_gather_list: list[Any] | None = None,
    timeout: timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Collect every rank's ``obj`` into ``object_gather_list`` on ``root`` (ignored elsewhere)."""
    size = comm.get_size()
    is_root = comm.get_rank() == root
    if is_root and (object_gather_list is None or len(object_gather_list) != size):
        raise ValueError(
            f"gather_object: root needs an object_gather_list of comm size {size} entries"
        )
    device = comm.get_device()
    payload = _to_tensor(obj, device)
    lengths = _all_lengths(comm, payload.numel(), timeout)
    longest = max(lengths)
    outputs = (
        [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
        if is_root
        else []
    )
    comm.gather(
        output_tensor_list=outputs,
        input_tensor=_padded(payload, longest),
        root=root,
        async_op=False,
        timeout=timeout,
    )
    if is_root:
        assert object_gather_list is not None
        for i, (t, n) in enumerate(zip(outputs, lengths, strict=True)):
            object_gather_list[i] = _from_tensor(t[:n], weights_only, _where(comm, "gather_object"))


def send_object_list(
    comm: TorchComm, object_list: list[Any], dst: int, timeout: timedelta | None = None
) -> None:
    """Send ``object_list`` to ``dst`` (which calls ``recv_object_list`` with a same-length list)."""
    device = comm.get_device()
    payloads = [_to_tensor(o, device) for o in object_list]
    lengths = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=device)
    comm.send(lengths, dst, async_op=False, timeout=timeout)
    if payloads and int(lengths.sum()) > 0:
        comm.send(torch.cat(payloads), dst, async_op=False, timeout=timeout)


def recv_object_list(
    comm: TorchComm,
    object_list: list[Any],
    src: int,
    timeout: timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Receive into ``object_list`` (same length as the sender's list) from ``src``."""
    device = comm.get_device()
    lengths = torch.zeros(len(object_list), dtype=torch.int64, device=device)
    comm.recv(lengths, src, async_op=False, timeout=timeout)
    total = int(lengths.sum())
    data = torch.empty(total, dtype=torch.uint8, device=device)
    if object_list and total > 0:
        comm.recv(data, src, async_op=False, timeout=timeout)
    where = _where(comm, "recv_object_list")
    offset = 0
    for i, n in enumerate(int(x) for x in lengths.tolist()):
        object_list[i] = _from_tensor(data[offset : offset + n], weights_only, where)
        offset += n


def broadcast_object_list(
    comm: TorchComm,
    object_list: list[Any],
    root: int,
    timeout: timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Replace ``object_list``'s entries on every rank with root's (lists have equal length)."""
    device = comm.get_device()
    is_root = comm.get_rank() == root
    if is_root:
        payloads = [_to_tensor(o, device) for o in object_list]
        lengths = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=device)
    else:
        lengths = torch.zeros(len(object_list), dtype=torch.int64, device=device)
    comm.broadcast(lengths, root, async_op=False, timeout=timeout)
    total = int(lengths.sum())
    data = (
        torch.cat(payloads)
        if is_root and payloads
        else torch.empty(total, dtype=torch.uint8, device=device)
    )
    if total > 0:
        comm.broadcast(data, root, async_op=False, timeout=timeout)
    if is_root:
        return
    where = _where(comm, "broadcast_object_list")
    offset = 0
    for i, n in enumerate(int(x) for x in lengths.tolist()):
        object_list[i] = _from_tensor(data[offset : offset + n], weights_only, where)
        offset += n


def scatter_object_list(
    comm: TorchComm,
    root: int,
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    timeout: timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Rank ``i`` gets root's ``scatter_object_input_list[i]`` in ``scatter_object_output_list[0]``."""
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(
            "Expected argument scatter_object_output_list to be a list of size at least 1."
        )
    size = comm.get_size()
    is_root = comm.get_rank() == root
    device = comm.get_device()
    if is_root:
        if scatter_object_input_list is None:
            raise ValueError("scatter_object_input_list must not be None on the root rank")
        if len(scatter_object_input_list) != size:
            raise ValueError(
                f"scatter_object_input_list must have comm size {size} entries on the root, "
                f"got {len(scatter_object_input_list)}"
            )
        payloads = [_to_tensor(o, device) for o in scatter_object_input_list]
        longest = torch.tensor([max(p.numel() for p in payloads)], dtype=torch.int64, device=device)
    else:
        longest = torch.zeros(1, dtype=torch.int64, device=device)
    comm.broadcast(longest, root, async_op=False, timeout=timeout)
    n_max = int(longest.item())
    my_len = torch.zeros(1, dtype=torch.int64, device=device)
    length_inputs = [_size_tensor(p.numel(), device) for p in payloads] if is_root else []
    comm.scatter(
        my_len, input_tensor_list=length_inputs, root=root, async_op=False, timeout=timeout
    )
    out = torch.empty(n_max, dtype=torch.uint8, device=device)
    data_inputs = [_padded(p, n_max) for p in payloads] if is_root else []
    comm.scatter(out, input_tensor_list=data_inputs, root=root, async_op=False, timeout=timeout)
    where = _where(comm, "scatter_object_list")
    scatter_object_output_list[0] = _from_tensor(out[: int(my_len.item())], weights_only, where)
