"""``WaitPolicy``: how a rank waits for its peers, from how many ranks share this host's cores.

Spinning is the cheapest wait when every rank has a core of its own and the worst when
they share one (the spinner holds the core its peer needs).  The shm channel spins, then
yields, then dozes on a futex; the tcp lane spins briefly before it blocks in ``poll``.
Both ask this class whether spinning is allowed.  Built once per communicator, read by
its op thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from torchcomms import config
from torchcomms.transport import placement


class WaitPolicy:
    """How to wait, from ranks per core: spin only when every rank has a core of its own."""

    __slots__ = ("oversubscribed", "sleep_max_s", "spin_s", "spins", "unshare_cores", "yield_s")

    #: The spin phase ends after this long, whatever ``spins`` says: one readiness check
    #: of a p2p wait costs 5-10 us, and 32 of them, with a peer on the same core (the
    #: scheduler's choice, or pinning), held that core for ~300 us per hand-over.
    SPIN_S = 5e-6

    #: Longest futex sleep between checks of the deadline, the peers' liveness and a lost
    #: wake-up (the doorbell protocol tolerates one, bounded by this).
    DOZE_S = 0.002

    def __init__(
        self, local_ranks: int, cores: int | None = None, pids: Iterable[int] = ()
    ) -> None:
        """``local_ranks`` share this host; ``pids`` are theirs (the cores they may use
        together decide, ``placement.usable_cores``) unless ``cores`` says how many."""
        if cores is None:
            cores = placement.usable_cores(pids)
        self.oversubscribed = local_ranks > cores
        # A Python spin iteration is ~0.1-0.3 us.  Spin only a few microseconds even when
        # cores suffice: the scheduler may still put a peer on this core, and yielding (which
        # returns at once when nothing else is runnable) lets it run.
        self.spins = 0 if self.oversubscribed else 32
        self.spin_s = self.SPIN_S
        # With a core each, two ranks the scheduler put on one core are split again
        # (``transport.core_sharing``); with fewer cores than ranks they must share.
        self.unshare_cores = not self.oversubscribed and config.shm_unshare_cores()
        # Yielding hands the core to a peer that shares it; past this, block on a futex
        # doorbell (a peer that writes a flag rings it), so long waits cost no CPU.
        # On the dev VM a futex wake-up of an idle vCPU takes 0.15-4 ms, so a wait yields for
        # a millisecond before it sleeps (bounded CPU, and short waits never pay a wake-up).
        self.yield_s = 0.001
        self.sleep_max_s = 0.001
        tuned = config.shm_wait_policy()
        if tuned is not None:
            self.spins, yield_us, sleep_us = tuned
            self.yield_s, self.sleep_max_s = yield_us * 1e-6, sleep_us * 1e-6
