"""The one rank vocabulary (``torchcomms.ranks``): how messages name ranks, how rank sets are
written to the wire and the store, and a message whose ranks another layer renumbers.

The hierarchical path's shm errors: a host's segment numbers its members 0..L-1, the user
knows them by comm rank; ``HierOps`` renders the shm error's message in comm ranks from its
data (``WaitError.message``), never by rewriting its text.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchcomms.backends.cpu.hier.ops import HierOps, Topology
from torchcomms.ranks import RankMessage, Ranks, decode_ranks, encode_ranks, ranks_text
from torchcomms.runtime import fingerprint as F
from torchcomms.transport.errors import WaitError
from torchcomms.transport.shm.channel import _Mismatch


def test_ranks_text_names_ranks_sorted_once() -> None:
    assert ranks_text([2]) == "peer rank 2"
    assert ranks_text([3, 1, 3]) == "peer ranks 1, 3"
    assert ranks_text([0, 2], "rank") == "ranks 0, 2"


def test_rank_sets_round_trip_as_ranges() -> None:
    assert encode_ranks([9, 1, 2, 3, 4, 7]) == "1-4,7,9"
    assert encode_ranks([]) == ""
    assert decode_ranks("1-4,7,9") == {1, 2, 3, 4, 7, 9}
    assert decode_ranks(b"0,5-6") == {0, 5, 6}  # a store's value
    assert decode_ranks("") == set()
    for ranks in ([], [0], [5, 3, 4, 100], list(range(0, 40, 3))):
        assert decode_ranks(encode_ranks(ranks)) == set(ranks)


def test_a_message_keeps_its_ranks_as_data() -> None:
    message = RankMessage(
        "waiting for {} {} ({} timed out)", Ranks([1, 0]), "in reduce", Ranks([2])
    )
    assert str(message) == "waiting for peer ranks 0, 1 in reduce (peer rank 2 timed out)"
    comm = (4, 6, 9)
    assert message.text(comm.__getitem__) == (
        "waiting for peer ranks 4, 6 in reduce (peer rank 9 timed out)"
    )
    error = WaitError("timeout", [0, 1], message)
    assert str(error) == "waiting for peer ranks 0, 1 in reduce (peer rank 2 timed out)"
    assert error.message is message and error.ranks == [0, 1]
    assert WaitError("aborted", [], "plain text").message.text(comm.__getitem__) == "plain text"


def test_a_mismatch_names_who_passed_what_in_the_readers_numbering() -> None:
    every = [(F.make(F.ALL_REDUCE, torch.float32, n), 1) for n in (4, 4, 5)]
    mismatch = _Mismatch(every)
    assert mismatch.text() == "rank 2 passed count=5, ranks 0, 1 count=4"
    assert mismatch.text((3, 5, 7).__getitem__) == "rank 7 passed count=5, ranks 3, 5 count=4"


def _hier_shm(error: WaitError, dead: list[int] | None = None) -> WaitError:
    """What ``HierOps._shm`` raises for ``error`` on host 1 of comm ranks 1, 3, 5."""
    liveness = None
    if dead is not None:
        liveness = SimpleNamespace(dead=dead, check_pids=lambda: True)
    ops = SimpleNamespace(
        topo=Topology(hosts=((0, 2, 4), (1, 3, 5)), host=1, local_rank=0),
        flat=SimpleNamespace(liveness=liveness),
    )

    def step() -> None:
        raise error

    with pytest.raises(WaitError) as raised:
        HierOps._shm(ops, step)  # type: ignore[arg-type]
    assert raised.value.__cause__ is error
    return raised.value


def test_hier_names_a_hosts_shm_error_in_comm_ranks() -> None:
    local = WaitError(
        "timeout", [1, 2], RankMessage("waiting for {} {}", Ranks([1, 2]), "in reduce")
    )
    got = _hier_shm(local)
    assert (got.kind, got.ranks) == ("timeout", [3, 5])
    assert str(got) == "waiting for peer ranks 3, 5 in reduce [inside host 1 of comm ranks 1, 3, 5]"
    every = [(F.make(F.BROADCAST, torch.float32, 8, root=r), 2) for r in (0, 0, 1)]
    text = RankMessage("{}: collective mismatch: {}", "broadcast", _Mismatch(every))
    got = _hier_shm(WaitError("mismatch", [2], text))
    assert got.ranks == [5]
    assert str(got).startswith("broadcast: collective mismatch: rank 5 passed root=1, ranks 1, 3")


def test_hier_blames_the_dead_elsewhere_for_a_host_peers_failure() -> None:
    local = WaitError("peer_failed", [2], RankMessage("{} {}", Ranks([2]), "failed"))
    got = _hier_shm(local, dead=[4])
    assert (got.kind, got.ranks) == ("dead", [4])
    assert str(got) == "peer rank 4 died (process gone); peer rank 5 failed"
