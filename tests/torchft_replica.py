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
"""

from __future__ import annotations

import json
import logging
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
    )
    return manager, pg


_OUT = threading.Lock()


def run(replica_id: str, ctrl_port: int) -> None:
    """One replica's loop (a thread of its own where several share the process)."""
    ctrl = TCPStore("127.0.0.1", ctrl_port, is_master=False, timeout=timedelta(seconds=60))
    w = torch.zeros(4)
    manager, pg = replica_manager(
        f"ft_{replica_id}",
        replica_id,
        state_dict=lambda: {"w": w.clone()},
        load_state_dict=lambda sd: w.copy_(sd["w"]),
        min_replica_size=2,
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
