"""One rank of an HSDP job for ``tests/test_torchft_hsdp.py``: FSDP2 inside a replica group,
torchft's fault-tolerant replicate dimension across groups, both on torchcomms.

Run as ``python -m tests.torchft_hsdp_rank GROUP GROUP_RANK GROUP_PORT CTRL_PORT``, with
``TORCHFT_LIGHTHOUSE`` set.  The group's two ranks meet store-less on ``GROUP_PORT``
(``new_comm("gloo", cpu, name="shard")``), shard a small model with FSDP2 on a DeviceMesh
built from that communicator, and average each reduce-scattered gradient shard across the
replica groups in FSDP's all-reduce hook, through a torchft ``Manager`` (one per rank,
``rank=GROUP_RANK``, ``world_size=2``) over ``ProcessGroupTorchComms`` of a reconfigurable
communicator.  Every step prints ``STEP {json}`` (step, participants, committed, loss, a
digest of this rank's parameter shard); it stops at the control store's ``stop`` step.  A
failed step (a group-mate gone: torchft's quorum times out waiting for it, or an FSDP
collective names it) ends the process with code 3, as a launcher would restart the group.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore


def main(group: int, group_rank: int, group_port: int, ctrl_port: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torchft.manager import Manager
    from torchft.torchcomms import ProcessGroupTorchComms

    import torchcomms
    from torchcomms.device_mesh import init_device_mesh

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    ctrl = TCPStore("127.0.0.1", ctrl_port, is_master=False, timeout=timedelta(seconds=60))
    os.environ.update(
        TORCHCOMM_RANK=str(group_rank),
        TORCHCOMM_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(group_port),
        TORCHCOMM_ABORT_ON_ERROR="0",
    )
    shard = torchcomms.new_comm(
        "gloo", torch.device("cpu"), name="shard", timeout=timedelta(seconds=20)
    )
    mesh = init_device_mesh([shard], ["dp_shard"])
    torch.manual_seed(0)  # every rank of every group starts from the same weights
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1")
    rep = torchcomms.new_comm(
        "gloo",
        torch.device("cpu"),
        name=f"replicate_{group_rank}",
        store=store,
        enable_reconfigure=True,
        abort_process_on_timeout_or_error=False,
        timeout=timedelta(seconds=10),
    )
    # the group's rank 0 serves the manager's store: every rank of the group reads its port
    if group_rank == 0:
        ctrl.set(f"group{group}/{group_port}/store_port", str(store.port))
    # keyed by the group's port too: a restarted group must not read its first life's port
    manager_port = int(ctrl.get(f"group{group}/{group_port}/store_port").decode())
    manager = Manager(
        pg=ProcessGroupTorchComms(rep, timeout=timedelta(seconds=10)),
        min_replica_size=1,
        use_async_quorum=False,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            optim.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        replica_id=f"group{group}",
        store_addr="127.0.0.1",
        store_port=manager_port,
        rank=group_rank,
        world_size=2,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=20),
    )

    def average_across_groups(out: torch.Tensor) -> None:
        manager.allreduce(out).wait()

    model.set_all_reduce_hook(average_across_groups)
    data = torch.Generator().manual_seed(1000 * group + group_rank)
    ctrl.set(f"ready/{group}/{group_rank}", "1")
    while not (ctrl.check(["stop"]) and manager.current_step() >= int(ctrl.get("stop"))):
        try:
            manager.start_quorum()
            x = torch.randn(8, 8, generator=data)
            y = x.sum(dim=1, keepdim=True).tanh()
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            committed = manager.should_commit()
        except Exception as exc:  # the group lost a rank: a launcher restarts the group
            print(f"GROUP FAILED {type(exc).__name__}: {exc}", flush=True)
            os._exit(3)
        if committed:
            optim.step()
        digest = hashlib.sha1()
        for p in model.parameters():
            digest.update(p.to_local().detach().numpy().tobytes())  # type: ignore[attr-defined]
        record = {
            "group": group,
            "rank": group_rank,
            "step": manager.current_step(),
            "n": manager.num_participants(),
            "commit": committed,
            "loss": loss.item(),
            "shard": digest.hexdigest()[:12],
        }
        print("STEP " + json.dumps(record), flush=True)
        time.sleep(0.05)
    manager.shutdown(wait=False)
    shard.finalize()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]))
