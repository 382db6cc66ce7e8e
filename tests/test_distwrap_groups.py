"""``torchcomms.distwrap``'s groups: ``new_group``, ``split_group``, ``destroy_process_group``.

One task of four ranks (``tests/distwrap_cases.py``).  With ``use_torchcomms=True`` a split
group runs on a split of its parent's communicator (global/group rank translation,
timeouts, hints, non-members, splits of splits, torch's own groups on the same world;
DDP on it under ``-m slow``); passed through, ``new_group`` is torch's and ``split_group``
falls back to it (gloo cannot split).  Bad split lists are refused, the world left usable.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import PrefixStore

from tests.distwrap_cases import Cases
from tests.harness import REPO_ROOT, RankContext, run_torchrun
from torchcomms import distwrap as dist
from torchcomms._backend_wrapper import _BackendWrapper
from torchcomms.distwrap import pginfo, utils
from torchcomms.distwrap.pginfo import pg_info_get
from torchcomms.types import ReduceOp

WORLD = 4
cases = Cases()


def _init(ctx: RankContext, torchcomms: bool, tag: str, **kwargs: object) -> None:
    dist.init_process_group(
        "gloo", store=PrefixStore(tag, ctx.store), use_torchcomms=torchcomms, **kwargs
    )


def _sum_of_ranks(pg: tdist.ProcessGroup, members: list[int]) -> None:
    """An all_reduce of global ranks + 1 over ``pg`` gives the members' sum."""
    t = torch.full((8,), float(tdist.get_rank() + 1))
    dist.all_reduce(t, group=pg)
    assert t.tolist() == [float(sum(m + 1 for m in members))] * 8


def _refusals_leave_the_world_usable(ctx: RankContext) -> None:
    for bad, text in (
        ([], "split_ranks cannot be None or empty"),
        ([[0, 1], []], "the split group cannot be empty"),
        ([[0, 1], [1, 2, 3]], "ranks appear more than once"),
        ([[0, 1, 2, 3, 4]], r"rank 4 is outside the parent group \(size 4\)"),
    ):
        with pytest.raises(ValueError, match=text):
            dist.split_group(split_ranks=bad)
    # A rank in none of the lists takes part (the others are not left waiting), then is told.
    if ctx.rank == 3:
        with pytest.raises(ValueError, match="Rank 3 not found in any split_ranks group"):
            dist.split_group(split_ranks=[[0, 1, 2]])
    else:
        sub = dist.split_group(split_ranks=[[0, 1, 2]])
        _sum_of_ranks(sub, [0, 1, 2])
        dist.destroy_process_group(sub)
    _sum_of_ranks(tdist.group.WORLD, [0, 1, 2, 3])


@cases.case("split_group_on_torchcomms")
def _split_torchcomms(ctx: RankContext) -> None:
    r = ctx.rank
    _init(ctx, True, "tc", timeout=timedelta(seconds=44))
    world = tdist.group.WORLD
    assert isinstance(world, _BackendWrapper)
    with pytest.raises(AssertionError, match="new_group is not supported with torchcomms"):
        dist.new_group(ranks=[0, 1, 2, 3], backend="gloo")

    pairs = dist.split_group(split_ranks=[[0, 1], [2, 3]], group_desc="pairs")
    mine = [0, 1] if r < 2 else [2, 3]
    assert isinstance(pairs, _BackendWrapper)
    assert dist.get_world_size(pairs) == 2 and dist.get_rank(pairs) == r % 2
    assert dist.get_process_group_ranks(pairs) == mine
    assert dist.get_backend(pairs) == "gloo" and pairs.group_desc == "pairs"
    comm = pairs.get_comm()
    assert comm.get_size() == 2 and comm.get_options().timeout == timedelta(seconds=44)
    _sum_of_ranks(pairs, mine)
    # Peers are global ranks (src/dst) or group ranks (group_src/group_dst).
    t = torch.full((2,), float(r))
    dist.broadcast(t, src=mine[1], group=pairs)
    assert t.tolist() == [float(mine[1])] * 2
    t = torch.full((2,), float(r))
    dist.broadcast(t, group_src=0, group=pairs)
    assert t.tolist() == [float(mine[0])] * 2
    other = 2 if r < 2 else 0
    with pytest.raises(ValueError, match=f"Global rank {other} is not in process group"):
        dist.broadcast(t, src=other, group=pairs)
    partner = mine[1 - r % 2]
    got = torch.zeros(2)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((2,), float(r)), partner, group=pairs),
            dist.P2POp(dist.irecv, got, group=pairs, group_peer=1 - r % 2),
        ]
    )
    for w in works:
        w.wait()
    assert got.tolist() == [float(partner)] * 2
    objs: list[object] = [None, None]
    dist.all_gather_object(objs, r, group=pairs)
    assert objs == mine

    # Odd splits, a split of a split, single-rank groups, the default list, a timeout, hints.
    evens = dist.split_group(split_ranks=[[0, 2], [1, 3]], timeout=timedelta(seconds=33))
    assert dist.get_process_group_ranks(evens) == [r % 2, r % 2 + 2]
    assert evens.get_comm().get_options().timeout == timedelta(seconds=33)
    outs = [torch.zeros(1), torch.zeros(1)]
    dist.all_gather(outs, torch.tensor([float(r)]), group=evens)
    assert [o.item() for o in outs] == [float(r % 2), float(r % 2 + 2)]
    alone = dist.split_group(parent_pg=pairs, split_ranks=[[0], [1]])
    assert dist.get_process_group_ranks(alone) == [r]
    _sum_of_ranks(alone, [r])
    whole = dist.split_group(pg_options=tdist.ProcessGroupGloo._Options(), backend="gloo")
    assert dist.get_process_group_ranks(whole) == [0, 1, 2, 3]
    assert "global_ranks_in_group" in whole.get_comm().get_options().hints
    _sum_of_ranks(whole, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="backend 'nccl' for device 'cuda' is not one of"):
        dist.split_group(split_ranks=[[0, 1, 2, 3]], backend="nccl")
    _refusals_leave_the_world_usable(ctx)

    # torch's own new_group on this world is a split too, and distwrap routes to it.
    torch_group = tdist.new_group([0, 1, 2, 3])
    assert isinstance(torch_group, _BackendWrapper)
    _sum_of_ranks(torch_group, [0, 1, 2, 3])

    # Upstream's utility: a registered group gets communicators split from its parent's.
    holder = tdist.new_group([0, 1, 2, 3])
    pginfo.pg_info_create(holder, [0, 1, 2, 3], "by_hand")
    pairs_by_hand = [[0, 3], [1, 2]]
    partners = pairs_by_hand[0] if r in (0, 3) else pairs_by_hand[1]
    for desc in ("by_hand", ""):  # "": a name of its own, the same on both members
        utils.torchcomms_create_split_group(
            holder, world, pairs_by_hand, desc, None, {"cpu": "gloo"}
        )
        comm = utils.get_torchcomms_instance(holder, device_type="cpu")
        assert comm.get_size() == 2 and comm.get_rank() == partners.index(r)
        t = torch.full((2,), float(r + 1))
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert t.tolist() == [float(sum(p + 1 for p in partners))] * 2
        comm.finalize()
    pginfo.pg_info_destroy(holder)
    tdist.destroy_process_group(holder)

    # Destroying a group finalizes its communicator; the rest go on.
    dist.destroy_process_group(evens)
    assert evens.get_comm()._finalized and pg_info_get(evens) is None
    with pytest.raises(ValueError, match="Invalid process group specified"):
        dist.destroy_process_group(evens)
    _sum_of_ranks(pairs, mine)
    dist.destroy_process_group()
    assert pairs.get_comm()._finalized and world.get_comm()._finalized


#: DDP's first construction in a process costs about 4 s of imports (x4 ranks on 2 cores).
slow_cases = Cases()


@slow_cases.case("ddp_on_the_torchcomms_world")
def _ddp(ctx: RankContext) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for torchcomms in (True, False):
        _init(ctx, torchcomms, f"ddp{int(torchcomms)}")
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(ctx.rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4, generator=gen)).square().sum().backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, flat) for g in gathered)  # replicas agree
        results[torchcomms] = flat
        del model, opt
        dist.destroy_process_group()
    torch.testing.assert_close(results[True], results[False], rtol=1e-6, atol=1e-6)


@cases.case("new_group_and_split_group_pass_through")
def _pass_through(ctx: RankContext) -> None:
    r = ctx.rank
    _init(ctx, False, "pt")
    everyone = [0, 1, 2, 3]
    with pytest.raises(ValueError, match="backend must be specified"):
        dist.new_group(ranks=everyone)
    for kwargs in (
        {"ranks": everyone},
        {},
        {"ranks": everyone, "timeout": timedelta(seconds=60)},
        {"ranks": everyone, "group_desc": "test_new_group"},
        {"ranks": everyone, "use_local_synchronization": True},
        {"ranks": everyone, "pg_options": tdist.ProcessGroupGloo._Options()},
    ):
        pg = dist.new_group(backend="gloo", **kwargs)
        assert not isinstance(pg, _BackendWrapper)
        assert dist.get_world_size(pg) == 4
        _sum_of_ranks(pg, everyone)
        dist.destroy_process_group(pg)
    # A non-member of a new_group gets torch's non-member marker.
    pg = dist.new_group(ranks=[0, 1], backend="gloo")
    if r < 2:
        _sum_of_ranks(pg, [0, 1])
    else:
        assert pg is tdist.GroupMember.NON_GROUP_MEMBER

    pairs = dist.split_group(split_ranks=[[0, 1], [2, 3]], group_desc="pairs")
    mine = [0, 1] if r < 2 else [2, 3]
    assert dist.get_process_group_ranks(pairs) == mine
    _sum_of_ranks(pairs, mine)
    whole = dist.split_group()
    nested = dist.split_group(parent_pg=whole, split_ranks=[[0, 3], [1, 2]])
    assert dist.get_process_group_ranks(nested) == ([0, 3] if r in (0, 3) else [1, 2])
    alone = dist.split_group(split_ranks=[[0], [1], [2], [3]])
    assert dist.get_world_size(alone) == 1
    # A torch group is torch's: distwrap's result is torch.distributed's own, bit for bit.
    gen = torch.Generator().manual_seed(r)
    x = torch.randn(100, generator=gen)
    y = x.clone()
    dist.all_reduce(x, group=pairs)
    tdist.all_reduce(y, group=pairs)
    assert torch.equal(x, y)
    _refusals_leave_the_world_usable(ctx)
    dist.destroy_process_group(pairs)
    assert pg_info_get(pairs) is None
    dist.destroy_process_group()


def _rank(ctx: RankContext) -> dict[str, object]:
    return cases.run_all(ctx)


def _slow_rank(ctx: RankContext) -> dict[str, object]:
    return slow_cases.run_all(ctx)


@pytest.mark.parametrize("name", list(cases.cases))
def test_groups(name: str) -> None:
    cases.check(_rank, WORLD, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(slow_cases.cases))
def test_groups_slow(name: str) -> None:
    slow_cases.check(_slow_rank, WORLD, name, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("use_torchcomms", ["1", "0"])
def test_ddp_example_changes_one_import(tmp_path: Path, use_torchcomms: str) -> None:
    """``examples/distwrap_ddp.py`` under torchrun trains as a single process would."""
    examples = Path(REPO_ROOT) / "examples"
    sys.path.insert(0, str(examples))
    from _training import read_result, reference

    out = tmp_path / "result.json"
    proc = run_torchrun(
        [str(examples / "distwrap_ddp.py"), "--steps", "3", "--out", str(out)],
        nproc=2,
        timeout=240.0,
        env={"USE_TORCHCOMMS": use_torchcomms},
    )
    assert proc.returncode == 0, proc.stdout
    group = "_BackendWrapper" if use_torchcomms == "1" else "ProcessGroup"
    assert f"distwrap DDP on {group}: 2 ranks" in proc.stdout, proc.stdout
    losses, params = read_result(str(out))
    ref_losses, ref_params = reference(3, 2)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name].flatten(), **tol, msg=name)
