"""Object collectives (reference §10) on 2 and 3 real ranks over the ``gloo`` backend.

One spawn per world size runs every case: ``all_gather_object``, ``gather_object`` (root
and non-root), ``send_object_list``/``recv_object_list``, ``broadcast_object_list`` and
``scatter_object_list`` (with its ``ValueError``s) on dicts, lists, tensors and strings
whose serialised sizes differ per rank; the default ``weights_only=True`` refusing an
arbitrary class on load; and ``TORCHCOMMS_SERIALIZATION=pickle`` round-tripping one through
every op (with ``weights_only`` left out and passed ``True``, as upstream's test does), and a
rank without the setting refusing a pickled payload.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.harness import RankContext, run_ranks
from torchcomms import new_comm, objcol

CPU = torch.device("cpu")
TIMEOUT = 120.0


class Payload:
    """An arbitrary user class: not in torch's weights-only allow-list."""

    def __init__(self, rank: int, blob: str) -> None:
        self.rank = rank
        self.blob = blob

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Payload) and (self.rank, self.blob) == (other.rank, other.blob)

    def __hash__(self) -> int:
        return hash((self.rank, self.blob))


def _obj(rank: int, tag: str) -> dict[str, Any]:
    """An object whose size grows with ``rank`` (dicts, lists, tensors, strings, ints)."""
    return {
        "tag": tag,
        "rank": rank,
        "items": list(range(rank * 37)),
        "text": "x" * (rank * 101 + 1),
        "tensor": torch.arange(rank * 13 + 1, dtype=torch.int64) * (rank + 1),
        "nested": [{"r": rank}, ("tuple", rank), None],
    }


def _assert_obj(got: Any, rank: int, tag: str, case: str) -> None:
    want = _obj(rank, tag)
    assert isinstance(got, dict), f"{case}: got {type(got).__name__}"
    assert got.keys() == want.keys(), f"{case}: keys {sorted(got)}"
    assert torch.equal(got["tensor"], want["tensor"]), f"{case}: tensor {got['tensor']}"
    for key in ("tag", "rank", "items", "text", "nested"):
        assert got[key] == want[key], f"{case}: {key} = {got[key]!r}"


def _objcol_cases(ctx: RankContext) -> str:
    rank, size = ctx.rank, ctx.world_size
    comm = new_comm("gloo", CPU, name="objcol", store=ctx.store)
    timeout = timedelta(seconds=60)

    # all_gather_object: every rank gets every rank's object, in rank order.
    gathered: list[Any] = [None] * size
    objcol.all_gather_object(comm, gathered, _obj(rank, "ag"))
    for r in range(size):
        _assert_obj(gathered[r], r, "ag", f"all_gather_object[{r}]")
    strings: list[Any] = [None] * size
    objcol.all_gather_object(comm, strings, "s" * (rank * 1000), timeout=timeout)
    assert strings == ["s" * (r * 1000) for r in range(size)], "all_gather_object strings"
    with pytest.raises(ValueError, match="object_list must have comm size"):
        objcol.all_gather_object(comm, [None] * (size + 1), rank)

    # gather_object: root gets all, the others' lists are left alone; two different roots.
    for root in (0, size - 1):
        case = f"gather_object root={root}"
        out: list[Any] | None = [None] * size if rank == root else None
        objcol.gather_object(comm, _obj(rank, "g"), root, out, timeout=timeout)
        if rank == root:
            assert out is not None
            for r in range(size):
                _assert_obj(out[r], r, "g", f"{case} [{r}]")
        else:
            assert out is None, case
    untouched = ["keep"] * size
    if rank == 0:
        with pytest.raises(ValueError, match="root needs an object_gather_list"):
            objcol.gather_object(comm, rank, 0, None)  # root checks before communicating
        root_list: list[Any] = [None] * size
        objcol.gather_object(comm, [rank, "list", rank * 2], 0, root_list)
        assert root_list == [[r, "list", r * 2] for r in range(size)], "gather_object lists"
    else:
        objcol.gather_object(comm, [rank, "list", rank * 2], 0, untouched)
        assert untouched == ["keep"] * size, "gather_object must not touch a non-root's list"

    # send_object_list / recv_object_list: one pair at a time around the ring.
    for src in range(size):
        dst = (src + 1) % size
        case = f"send/recv {src}->{dst}"
        if rank == src:
            objcol.send_object_list(
                comm,
                [_obj(src, "p2p"), torch.full((src + 2,), src), "y" * (src * 50), None],
                dst,
                timeout=timeout,
            )
        elif rank == dst:
            received: list[Any] = [None] * 4
            objcol.recv_object_list(comm, received, src, timeout=timeout)
            _assert_obj(received[0], src, "p2p", case)
            assert torch.equal(received[1], torch.full((src + 2,), src)), case
            assert received[2] == "y" * (src * 50), case
            assert received[3] is None, case

    # broadcast_object_list: root's entries replace everyone's; two different roots.
    for root in (0, size - 1):
        case = f"broadcast_object_list root={root}"
        objs: list[Any] = (
            [_obj(root, "b"), "root-string", torch.ones(root + 3)] if rank == root else [None] * 3
        )
        objcol.broadcast_object_list(comm, objs, root, timeout=timeout)
        _assert_obj(objs[0], root, "b", case)
        assert objs[1] == "root-string", case
        assert torch.equal(objs[2], torch.ones(root + 3)), case

    # scatter_object_list: rank i gets root's input[i] (objects of different sizes).
    for root in (size - 1, 0):
        case = f"scatter_object_list root={root}"
        inputs = [_obj(r, "s") for r in range(size)] if rank == root else None
        output: list[Any] = [None]
        objcol.scatter_object_list(comm, root, output, inputs, timeout=timeout)
        _assert_obj(output[0], rank, "s", case)
    with pytest.raises(
        ValueError, match="scatter_object_output_list to be a list of size at least 1"
    ):
        objcol.scatter_object_list(comm, 0, [], [1] * size)
    if rank == 0:  # the root's own checks fail before anything is sent
        with pytest.raises(ValueError, match="scatter_object_input_list must not be None"):
            objcol.scatter_object_list(comm, 0, [None], None)
        with pytest.raises(ValueError, match="scatter_object_input_list must have comm size"):
            objcol.scatter_object_list(comm, 0, [None], [1] * (size + 1))

    # weights_only=True (the default) refuses an arbitrary class on load, on every rank.
    mixed: list[Any] = [None] * size
    obj: Any = Payload(rank, "p" * rank) if rank == size - 1 else {"plain": rank}
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        objcol.all_gather_object(comm, mixed, obj)
    objcol.all_gather_object(comm, mixed, obj, weights_only=False)
    assert mixed[:-1] == [{"plain": r} for r in range(size - 1)], "weights_only=False dicts"
    assert mixed[-1] == Payload(size - 1, "p" * (size - 1)), "weights_only=False Payload"
    bcast: list[Any] = [Payload(0, "root")] if rank == 0 else [None]
    if rank == 0:
        objcol.broadcast_object_list(comm, bcast, 0)
    else:
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            objcol.broadcast_object_list(comm, bcast, 0)

    comm.barrier(False)
    comm.finalize()
    return "ok"


def _pickle_round_trips(comm: Any, rank: int, size: int, **weights: bool) -> list[Any]:
    """Every object collective on arbitrary classes; ``weights`` is passed through."""
    gathered: list[Any] = [None] * size
    objcol.all_gather_object(comm, gathered, Payload(rank, "q" * (rank * 77)), **weights)
    assert gathered == [Payload(r, "q" * (r * 77)) for r in range(size)], "all_gather_object"

    at_root: list[Any] | None = [None] * size if rank == 0 else None
    objcol.gather_object(comm, Payload(rank, "g"), 0, at_root, **weights)
    if rank == 0:
        assert at_root == [Payload(r, "g") for r in range(size)], "gather_object"

    bcast: list[Any] = [Payload(0, "root"), _obj(0, "pk")] if rank == 0 else [None, None]
    objcol.broadcast_object_list(comm, bcast, 0, **weights)
    assert bcast[0] == Payload(0, "root"), "broadcast_object_list"
    _assert_obj(bcast[1], 0, "pk", "broadcast_object_list (pickle)")

    out: list[Any] = [None]
    objcol.scatter_object_list(
        comm, 0, out, [Payload(r, "s" * r) for r in range(size)] if rank == 0 else None, **weights
    )
    assert out[0] == Payload(rank, "s" * rank), "scatter_object_list"

    if rank == 0:
        objcol.send_object_list(comm, [Payload(0, "p2p"), 7], 1)
    elif rank == 1:
        got: list[Any] = [None, None]
        objcol.recv_object_list(comm, got, 0, **weights)
        assert got == [Payload(0, "p2p"), 7], "send/recv_object_list"
    return gathered


def _pickle_serialization(ctx: RankContext) -> list[Any]:
    """Each rank's own ``TORCHCOMMS_SERIALIZATION=pickle`` is its consent, as upstream's."""
    rank, size = ctx.rank, ctx.world_size
    comm = new_comm("gloo", CPU, name="objcol_pickle", store=ctx.store)
    gathered = _pickle_round_trips(comm, rank, size)
    # Upstream's ObjColTestWithPickle passes weights_only=True explicitly: the setting wins.
    assert _pickle_round_trips(comm, rank, size, weights_only=True) == gathered

    # A receiver that did not opt in refuses a pickled payload, clearly, and stays usable.
    if rank == 0:
        os.environ.pop("TORCHCOMMS_SERIALIZATION")
        try:
            got: list[Any] = [None]
            with pytest.raises(
                pickle.UnpicklingError,
                match=r"objcol_pickle rank=0\] recv_object_list: refusing to unpickle a payload "
                r"serialised with pickle \(the sender has TORCHCOMMS_SERIALIZATION=pickle, this "
                r"rank does not\)",
            ):
                objcol.recv_object_list(comm, got, 1)
            assert got == [None], got
            objcol.recv_object_list(comm, got, 1, weights_only=False)
            assert got == [Payload(1, "second")], got
        finally:
            os.environ["TORCHCOMMS_SERIALIZATION"] = "pickle"
    elif rank == 1:
        objcol.send_object_list(comm, [Payload(1, "first")], 0)
        objcol.send_object_list(comm, [Payload(1, "second")], 0)
    comm.finalize()
    return gathered


@pytest.mark.parametrize("world_size", [2, 3])
def test_object_collectives(world_size: int) -> None:
    assert run_ranks(_objcol_cases, world_size, timeout=TIMEOUT) == ["ok"] * world_size


def test_pickle_serialization_round_trips_arbitrary_classes() -> None:
    results = run_ranks(
        _pickle_serialization, 2, timeout=TIMEOUT, env={"TORCHCOMMS_SERIALIZATION": "pickle"}
    )
    for rank_result in results:
        assert rank_result == [Payload(r, "q" * (r * 77)) for r in range(2)]
