"""One Streaming DiLoCo replica for ``tests/test_torchft_processes.py``: torchft's scenario setup.

Run as ``python -m tests.torchft_streaming_replica SCENARIO REPLICA_ID FRAGMENTS DELAY ALPHA
CTRL_PORT`` with ``TORCHFT_LIGHTHOUSE`` set; SCENARIO is ``upscale`` or ``commit_failure``.
What torchft's ``test_streaming_diloco_upscale`` / ``_commit_failure`` train, as one process:
``MultiMyModel(2, 3, FRAGMENTS)`` from ``torch.manual_seed(42)``, one fragment per layer,
AdamW inner (lr 4e-4, weight decay 0.1, betas 0.9 / 0.95), one outer SGD per fragment (lr
0.7, momentum 0.9, Nesterov), ``DiLoCo(sync_every=4, fragment_sync_delay=DELAY,
fragment_update_alpha=ALPHA)``, batches of one, a Manager of ``min_replica_size=2`` over
``ProcessGroupTorchComms(new_comm("gloo", ..., enable_reconfigure=True))`` inside torchft's
error-injecting ``FakeProcessGroupWrapper`` (reconfiguring with the inner group's own handles,
and failing the next all_reduce's ``wait`` with the injected error, see ``Injecting``).

* ``upscale``: at Manager step 2, replicas other than ``r0`` print ``PAUSE`` and wait for the
  control store's ``go``, which ``r0`` (started late by the test) sets when it starts
  training, as torchft's barrier does.
* ``commit_failure``: at Manager step 1 the replica has its next all_reduce fail (torchft's
  ``report_future_error``, printing ``INJECTED``), once: the Manager sees the error, and
  ``should_commit`` says no on both replicas (both inject, as in torchft's scenario).

Like torchft's loop, whenever the Manager's step is new it prints ``STATE {json}``: the step
and the global state of every fragment (its ``original_parameters`` and outer optimizer
momentum), and after every ``should_commit`` ``COMMIT {json}``: the step before and after,
the verdict and the participants.  It stops once its step reaches the control store's
``stop``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from tests.torchft_replica import replica_manager


def global_state(manager: Any, fragments: int) -> dict[str, Any]:
    """Every fragment's global weights and outer momentum, as lists (what torchft compares)."""
    user = manager._manager_state_dict()["user"]
    out: dict[str, Any] = {}
    for i in range(fragments):
        frag = user[f"StreamingDiLoCoFragment_{i}"]
        momentum = [
            None if s.get("momentum_buffer") is None else s["momentum_buffer"].tolist()
            for _, s in sorted(frag["outer_optimizer"]["state"].items())
        ]
        params = {k: v.tolist() for k, v in sorted(frag["original_parameters"].items())}
        out[str(i)] = {"params": params, "momentum": momentum}
    return out


def main(scenario: str, rid: str, fragments: int, delay: int, alpha: float, port: int) -> None:
    from torchft._test.diloco_trainer import MultiMyModel
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import FakeProcessGroupWrapper, ReconfigureOptions

    class FailingWork(torch.distributed.distributed_c10d.Work):
        """An all_reduce that completed on the wire (the peers stay in step) and then fails."""

        def __init__(self, work: Any, error: Exception) -> None:
            super().__init__()
            self._inner, self._error = work, error

        def wait(self, timeout: timedelta | None = None) -> bool:
            self._inner.wait()
            raise self._error

        def get_future(self) -> Any:
            return self._inner.get_future()

    class Injecting(FakeProcessGroupWrapper):
        """torchft's error injection, reconfiguring with the inner group's own handles.

        torchft's wrapper chains the error onto a future nobody waits for, so over any
        group its injected error never reaches the Manager and the commit goes through;
        here the next all_reduce's ``wait`` raises it, as a failed op's does."""

        def reconfigure(self, opts: ReconfigureOptions) -> Any:
            self._future_error = None
            return self._pg.reconfigure(opts)

        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
            work = self._pg.allreduce(tensors, opts)
            error, self._future_error = self._future_error, None
            return work if error is None else FailingWork(work, error)

    assert scenario in ("upscale", "commit_failure"), scenario
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    ctrl = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    torch.manual_seed(42)
    model = MultiMyModel(2, 3, fragments)
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
    outer = [
        torch.optim.SGD(layer.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        for layer in model.layers
    ]
    criterion = torch.nn.CrossEntropyLoss()

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])

    manager, pg = replica_manager(
        f"ft_{scenario}_{rid}",
        f"{scenario}_{rid}",
        state_dict=lambda: {"model": model.state_dict(), "inner_optim": inner.state_dict()},
        load_state_dict=load_state_dict,
        min_replica_size=2,
        wrap=Injecting,
    )
    wrapper = manager._pg
    should_commit = manager.should_commit

    def reporting_should_commit(*args: Any, **kwargs: Any) -> bool:
        before = manager.current_step()
        verdict = bool(should_commit(*args, **kwargs))
        record = {"rid": rid, "step": before, "after": manager.current_step(), "commit": verdict}
        record["n"] = manager.num_participants()
        print("COMMIT " + json.dumps(record), flush=True)
        return verdict

    manager.should_commit = reporting_should_commit  # type: ignore[method-assign]
    events = {"upscale": 2, "commit_failure": 1}
    event_at = None if (scenario, rid) == ("upscale", "r0") else events[scenario]
    if (scenario, rid) == ("upscale", "r0"):
        ctrl.set("go", "1")
    seen: set[int] = set()
    with DiLoCo(
        manager,
        list(model.layers),
        inner,
        outer,
        backup_device=torch.device("cpu"),
        sync_every=4,
        fragment_sync_delay=delay,
        fragment_update_alpha=alpha,
    ):
        while not (ctrl.check(["stop"]) and manager.current_step() >= int(ctrl.get("stop"))):
            step = manager.current_step()
            if step == event_at:
                event_at = None
                if scenario == "upscale":
                    print(f"PAUSE step={step}", flush=True)
                    ctrl.wait(["go"], timedelta(seconds=60))
                else:
                    print(f"INJECTED step={step}", flush=True)
                    wrapper.report_future_error(RuntimeError("injected allreduce error"))
            if step not in seen:
                seen.add(step)
                record = {"rid": rid, "step": step, "state": global_state(manager, fragments)}
                print("STATE " + json.dumps(record), flush=True)
            inputs = model.get_rand_inputs(1)
            labels = model.get_rand_labels(1)
            loss = criterion(model(inputs), labels)
            inner.zero_grad()
            loss.backward()
            inner.step()
            time.sleep(0.01)
    manager.shutdown(wait=False)
    pg.shutdown()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), float(a[4]), int(a[5]))
