"""torchft replicas for ``tests/test_torchft.py``: each a Manager over our gloo communicator.

Run as ``python -m tests.torchft_replica REPLICA_IDS CTRL_PORT``, with ``TORCHFT_LIGHTHOUSE``
set; ``REPLICA_IDS`` is one id or several, comma-separated (``r0,r1``): each then runs as a
thread of this process with its own reconfigurable communicator, as torchft's own tests
place replicas.  Each step a replica averages a gradient ``[value, one-hot of the
replica]``, value being the replica's number + 1 (r0 → 1.0, r1 → 2.0, r2 → 3.0), through
``torchft.torchcomms.ProcessGroupTorchComms`` and, when the Manager says so, commits it into
``w``.  One line per step on stdout (``STEP {json}``, its ``rid`` saying whose) tells the
test what happened; a replica stops once its step reaches the one the test's control store
holds as ``stop`` (the same for all: none is left waiting for a quorum).

``TORCHFT_TEST_CHECKPOINT=rdma`` heals through ``torchcomms.ft.RdmaCheckpointTransport``
(else torchft's default, its HTTP transport); the state dict then also carries a tensor of
each of several dtypes, a non-contiguous one and a non-tensor leaf, all derived from ``w``,
and each step's record has their digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore


def replica_manager(
    name: str,
    replica_id: str,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], Any],
    min_replica_size: int,
    wrap: Callable[[Any], Any] | None = None,
    checkpoint_transport: Any = None,
) -> tuple[Any, Any]:
    """A torchft ``Manager`` of one rank over ``ProcessGroupTorchComms`` of a reconfigurable
    ``new_comm("gloo", ...)`` named ``name``, with its own store (what every replica here
    runs); returns the manager and the process group (``pg.comm`` is the communicator).
    ``wrap``: the Manager gets ``wrap(pg)`` (torchft's error-injecting wrapper)."""
    from torchft.manager import Manager
    from torchft.torchcomms import ProcessGroupTorchComms

    import torchcomms

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    comm = torchcomms.new_comm(
        "gloo",
        torch.device("cpu"),
        name=name,
        store=store,
        enable_reconfigure=True,
        timeout=timedelta(seconds=5),
        abort_process_on_timeout_or_error=False,
    )
    pg = ProcessGroupTorchComms(comm)
    manager = Manager(
        pg=pg if wrap is None else wrap(pg),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        replica_id=replica_id,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        checkpoint_transport=checkpoint_transport,
    )
    return manager, pg


_OUT = threading.Lock()


def _derived(w: torch.Tensor) -> dict[str, Any]:
    """Leaves of several dtypes (one large, one non-contiguous) and a non-tensor, from ``w``."""
    big = torch.arange(1 << 20, dtype=torch.float32) * w.sum()
    return {
        "bf16": (w * 1.37).to(torch.bfloat16),
        "f64": w.double() / 3,
        "i64": (w * 1000).to(torch.int64),
        "bool": w > 1,
        "big": big,
        "strided": big[: 1 << 12].reshape(64, 64).t(),
        "note": f"w sum {w.sum().item()}",
    }


def _digest(sd: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for key in sorted(sd):
        value = sd[key]
        if isinstance(value, torch.Tensor):
            h.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
            h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{key}={value!r}".encode())
    return h.hexdigest()


def run(replica_id: str, ctrl_port: int) -> None:
    """One replica's loop (a thread of its own where several share the process)."""
    ctrl = TCPStore("127.0.0.1", ctrl_port, is_master=False, timeout=timedelta(seconds=60))
    w = torch.zeros(4)
    extra: dict[str, Any] = {}
    transport = None
    if os.environ.get("TORCHFT_TEST_CHECKPOINT") == "rdma":
        from torchcomms.ft import RdmaCheckpointTransport

        transport = RdmaCheckpointTransport(timedelta(seconds=10))

    def state_dict() -> dict[str, Any]:
        sd: dict[str, Any] = {"w": w.clone()}
        if transport is not None:
            sd["extra"] = _derived(w)
        return sd

    def load_state_dict(sd: dict[str, Any]) -> None:
        w.copy_(sd["w"])
        if "extra" in sd:
            extra["digest"] = _digest(sd["extra"])
            extra["ok"] = extra["digest"] == _digest(_derived(sd["w"]))

    manager, pg = replica_manager(
        f"ft_{replica_id}",
        replica_id,
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        min_replica_size=2,
        checkpoint_transport=transport,
    )
    comm = pg.comm
    ctrl.set(f"ready/{replica_id}", "1")
    index = int(replica_id[1:])
    # [value, one-hot of the replica]: the average times n says exactly who took part.
    mine = torch.zeros(4)
    mine[0] = float(index + 1)
    mine[1 + index] = 1.0
    while not (ctrl.check(["stop"]) and manager.current_step() >= int(ctrl.get("stop"))):
        manager.start_quorum()
        healed = manager.current_step()
        grad = mine.clone()
        ok = manager.allreduce(grad).wait()
        committed = manager.should_commit()
        if committed:
            w.add_(grad)
        record = {
            "rid": replica_id,
            "step": manager.current_step(),
            "start_step": healed,
            "quorum": manager._quorum_id,
            "n": manager.num_participants(),
            "ok": bool(ok),
            "commit": committed,
            "avg": grad[0].item(),
            "members": [
                i for i in range(3) if round(grad[1 + i].item() * manager.num_participants()) == 1
            ],
            "w": w.tolist(),
            # What the last heal loaded besides w: its digest, and whether it is bit for bit
            # what the healthy replica derived from the w it sent.
            "healed_extra": extra.get("digest"),
            "healed_extra_ok": extra.get("ok"),
            "comm": [comm.get_rank(), comm.get_size()],
        }
        with _OUT:  # one write per line: threads sharing stdout do not interleave
            sys.stdout.write("STEP " + json.dumps(record) + "\n")
            sys.stdout.flush()
        time.sleep(0.05)
    manager.shutdown(wait=False)
    pg.shutdown()


def main(replica_ids: str, ctrl_port: int) -> int:
    """Run the comma-separated replicas, several as threads of this process."""
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    ids = replica_ids.split(",")
    if len(ids) == 1:
        run(ids[0], ctrl_port)
        return 0
    failed: list[str] = []

    def thread(rid: str) -> None:
        try:
            run(rid, ctrl_port)
        except BaseException:
            logging.getLogger("torchft_replica").exception("replica %s failed", rid)
            failed.append(rid)

    threads = [threading.Thread(target=thread, args=(rid,), name=rid) for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
