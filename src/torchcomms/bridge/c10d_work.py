"""``_WorkWrapper``: the c10d ``Work`` (and its ``Future``) that ``_BackendWrapper`` returns.

One c10d ``Work`` over one or more TorchWorks: it completes when all of them finished, with
the first error if any failed, after an optional ``finish`` step.

Threads: the future is completed from the TorchWorks' done-callbacks, on whichever thread
finished the last op (the issuing thread for sync ops, the comm's executor thread for
async ops), so DDP's ``get_future().then(...)`` chains run without anyone calling
``wait()``; ``finish`` runs there too.  ``wait()`` runs on the caller's thread.

Import rule (as ``_backend_wrapper``): PyTorch imports this while ``torch.distributed`` is
half-initialised, so at module level only ``torch``, ``torch._C._distributed_c10d``, the
standard library and ``torchcomms.runtime.work``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
from torch._C import _distributed_c10d as c10d

from torchcomms.runtime.work import TorchWork

_UNSET_TIMEOUT = timedelta(0)


class _WorkWrapper(c10d.Work):
    """A c10d ``Work`` over one or more TorchWorks (all must finish); see the module docstring.

    ``finish`` (optional) runs once after every TorchWork succeeded, before the future
    completes (e.g. copying a staged all_gather back into aliased outputs).
    """

    def __init__(
        self,
        works: Sequence[TorchWork],
        result: list[torch.Tensor],
        timeout: timedelta | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._works = list(works)
        self._result = result
        self._timeout = timeout
        self._finish = finish
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self._lock = threading.Lock()
        self._pending = len(self._works)
        self._error: BaseException | None = None
        if not self._works:
            self._complete()
        for work in self._works:
            work._add_done_callback(self._one_done)

    def _one_done(self, work: TorchWork) -> None:
        with self._lock:
            error = work.exception()
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        if self._error is None and self._finish is not None:
            try:
                self._finish()
            except BaseException as exc:
                self._error = exc
        if self._error is not None:
            self._future.set_exception(self._error)  # type: ignore[arg-type]
        else:
            self._future.set_result(self._result)

    # -- c10d.Work API -------------------------------------------------------------------
    def wait(self, timeout: timedelta = _UNSET_TIMEOUT) -> bool:
        if timeout != _UNSET_TIMEOUT:
            raise RuntimeError("wait timeout not supported")
        for work in self._works:
            work.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def synchronize(self) -> None:
        """CPU ops are complete once waited; there is no stream to synchronise."""

    def block_current_stream(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        raise RuntimeError("source_rank is only defined for recv_anysource works")

    def _timeout_value(self) -> timedelta | None:
        return self._timeout
