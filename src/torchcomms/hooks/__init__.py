"""Observability hooks: ``FlightRecorderHook``, ``clog``, ``NanCheckHook``.

Importing this package (``import torchcomms`` does) also installs the always-on tooling
every ``new_comm`` attaches: the flight recorder (``TORCHCOMM_FR_BUFFER_SIZE``), the JSON
event log (``TORCHCOMM_LOG_JSON``) and the collective check (``TORCHCOMM_CHECK_COLLECTIVES``).
Modules: ``fr`` (the recorder; ``_fr_dump`` its dump format and files, ``_fr_signal`` the
SIGUSR1 handler), ``clog``, ``nan_check``, ``eventlog`` (``TORCHCOMM_LOG_JSON``) and
``desync`` (``TORCHCOMM_CHECK_COLLECTIVES``).

Import rule: only ``torch``, ``torch._C._distributed_c10d`` and the standard library at
module level (PyTorch imports this while ``torch.distributed`` is half-initialised).
Layering: modules here import ``torchcomms.comm`` and what it builds on (``types``,
``errors``, ``config``, ``work``, ``oprecord``, ``opinfo``), never the layers above it
(``_backend_wrapper``, ``device_mesh``, ``bench``, ``tools``).
"""

from __future__ import annotations

from torchcomms.hooks import desync, eventlog
from torchcomms.hooks.clog import clog
from torchcomms.hooks.fr import FlightRecorderHook
from torchcomms.hooks.nan_check import NanCheckHook

# Observer order matters: the flight recorder (attached by importing hooks.fr, above) and
# the event log see each op before the collective check may stop it.
eventlog.install()
desync.install()

__all__ = ["FlightRecorderHook", "NanCheckHook", "clog", "desync", "eventlog"]
