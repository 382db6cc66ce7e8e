"""One torchft replica for ``tests/test_torchft_processes.py``: a training mode over our gloo.

Run as ``python -m tests.torchft_mode_replica MODE REPLICA_ID CTRL_PORT`` with
``TORCHFT_LIGHTHOUSE`` set, MODE one of:

* ``ddp``: torchft's ``DistributedDataParallel`` (gradients averaged through the Manager)
  and ``OptimizerWrapper`` (the quorum in ``zero_grad``, the commit in ``step``);
* ``localsgd``: ``torchft.local_sgd.LocalSGD`` averaging the weights every 2 steps;
* ``diloco``: ``torchft.local_sgd.DiLoCo`` with one fragment (the whole model), outer
  step every 2 inner steps, ``fragment_sync_delay=0``, ``fragment_update_alpha=0``.

The Manager's process group is ``ProcessGroupTorchComms`` over a reconfigurable
``new_comm("gloo", ...)`` (its own TCPStore), as in ``tests/torchft_replica.py``.  Every
replica starts from the same weights (``torch.manual_seed(0)``) and trains on its own data.
One ``STEP {json}`` line per step that asked the Manager to commit (every step for ddp,
every synchronisation for localsgd / diloco): the Manager's step after it, the number of
participants, whether it committed and a digest of the model parameters (sha1 of their
bytes, 12 hex).  It stops once its step reaches the control store's ``stop``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import TCPStore

from tests.torchft_replica import replica_manager

MODES = ("ddp", "localsgd", "diloco")


def digest(model: nn.Module) -> str:
    """sha1 (12 hex) of the model parameters' bytes, in order."""
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def main(mode: str, replica_id: str, ctrl_port: int) -> None:
    from torchft.ddp import DistributedDataParallel
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.optim import OptimizerWrapper

    assert mode in MODES, mode
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    ctrl = TCPStore("127.0.0.1", ctrl_port, is_master=False, timeout=timedelta(seconds=60))
    torch.manual_seed(0)  # every replica starts from the same weights
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager, pg = replica_manager(
        f"ft_{mode}_{replica_id}",
        f"{mode}_{replica_id}",
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        load_state_dict=load_state_dict,
        min_replica_size=1,
    )
    # Record what should_commit answered (the optimizer wrapper / LocalSGD / DiLoCo call it).
    verdicts: list[bool] = []
    should_commit = manager.should_commit

    def recording_should_commit(*args: Any, **kwargs: Any) -> bool:
        verdict = should_commit(*args, **kwargs)
        verdicts.append(bool(verdict))
        return verdict

    manager.should_commit = recording_should_commit  # type: ignore[method-assign]

    forward: nn.Module = model
    optimizer: torch.optim.Optimizer = inner
    wrapper: Any = None
    if mode == "ddp":
        forward = DistributedDataParallel(manager, model)
        optimizer = OptimizerWrapper(manager, inner)
    elif mode == "localsgd":
        wrapper = LocalSGD(manager, model, inner, sync_every=2)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        wrapper = DiLoCo(
            manager,
            [model],
            inner,
            outer,
            sync_every=2,
            backup_device=torch.device("cpu"),
            pin_memory=False,
            fragment_sync_delay=0,
            fragment_update_alpha=0.0,
        )
    if wrapper is not None:
        wrapper.__enter__()

    ctrl.set(f"ready/{replica_id}", "1")
    data = torch.Generator().manual_seed(100 + int(replica_id[1:]))  # its own data
    target = torch.linspace(-1, 1, 8)
    inner_step = 0
    while not (ctrl.check(["stop"]) and manager.current_step() >= int(ctrl.get("stop"))):
        started = manager.current_step()
        x = torch.randn(16, 8, generator=data)
        y = (x * target).sum(dim=1, keepdim=True).tanh()
        optimizer.zero_grad()  # ddp: the quorum (and healing) happens here
        loss = nn.functional.mse_loss(forward(x), y)
        loss.backward()
        optimizer.step()  # ddp: commit; localsgd / diloco: a sync every 2nd step
        inner_step += 1
        if verdicts:
            record = {
                "rid": replica_id,
                "mode": mode,
                "step": manager.current_step(),
                "start_step": started,
                "inner": inner_step,
                "n": manager.num_participants(),
                "commit": verdicts[-1],
                "digest": digest(model),
                "loss": loss.item(),
            }
            print("STEP " + json.dumps(record), flush=True)
            verdicts.clear()
        time.sleep(0.03)
    if wrapper is not None:
        wrapper.__exit__(None, None, None)
    manager.shutdown(wait=False)
    pg.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
