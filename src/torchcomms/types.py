"""Value types of the API: reduce ops, op names, P2P descriptors and option structs."""

from __future__ import annotations

import copy
import enum
from datetime import timedelta
from typing import Any

import torch


class RedOpType(enum.Enum):
    """The kind of a reduction; values match upstream's C++ enum order."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    PREMUL_SUM = 7
    AVG = 8


class ReduceOp:
    """A reduction; ``ReduceOp.SUM`` etc. are singletons, ``ReduceOp.PREMUL_SUM(f)`` makes a new op."""

    SUM: ReduceOp
    PRODUCT: ReduceOp
    MIN: ReduceOp
    MAX: ReduceOp
    BAND: ReduceOp
    BOR: ReduceOp
    BXOR: ReduceOp
    AVG: ReduceOp

    __slots__ = ("_factor", "_type")

    def __init__(self, op_type: RedOpType, factor: float | torch.Tensor | None = None) -> None:
        if not isinstance(op_type, RedOpType):
            raise TypeError(f"ReduceOp expects a RedOpType, got {type(op_type).__name__}")
        if op_type is RedOpType.PREMUL_SUM and factor is None:
            raise RuntimeError(
                "ReduceOp.PREMUL_SUM needs a factor: use ReduceOp.PREMUL_SUM(factor)"
            )
        if op_type is not RedOpType.PREMUL_SUM and factor is not None:
            raise RuntimeError(f"ReduceOp.{op_type.name} takes no factor")
        self._type = op_type
        self._factor = factor

    @staticmethod
    def PREMUL_SUM(factor: float | torch.Tensor) -> ReduceOp:
        """Multiply each rank's input by ``factor`` (a float or a 1-element tensor), then sum."""
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise RuntimeError(
                    f"ReduceOp.PREMUL_SUM factor tensor must have one element (got {factor.numel()})"
                )
        elif isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(
                f"ReduceOp.PREMUL_SUM factor must be a float or a tensor, got {type(factor).__name__}"
            )
        else:
            factor = float(factor)
        return ReduceOp(RedOpType.PREMUL_SUM, factor)

    @property
    def type(self) -> RedOpType:
        return self._type

    @property
    def factor(self) -> float | torch.Tensor | None:
        """The PREMUL_SUM factor (``None`` for other ops)."""
        return self._factor

    def factor_value(self) -> float:
        """The PREMUL_SUM factor as a Python float (a tensor factor is read on the host)."""
        f = self._factor
        if f is None:
            raise RuntimeError(f"ReduceOp.{self._type.name} has no factor")
        if isinstance(f, torch.Tensor):
            return float(f.detach().to("cpu", torch.float64).item())
        return float(f)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            if self._type is not other._type:
                return False
            if self._type is RedOpType.PREMUL_SUM:
                return self is other
            return True
        if isinstance(other, RedOpType):
            return self._type is other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._type) if self._type is not RedOpType.PREMUL_SUM else id(self)

    def __repr__(self) -> str:
        if self._type is RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self._factor!r})"
        return f"ReduceOp.{self._type.name}"

    def __copy__(self) -> ReduceOp:
        return ReduceOp(self._type, self._factor)

    def __deepcopy__(self, memo: dict[int, Any]) -> ReduceOp:
        if id(self) in memo:
            return memo[id(self)]
        result = ReduceOp(self._type, copy.deepcopy(self._factor, memo))
        memo[id(self)] = result
        return result

    def __reduce__(self) -> tuple[Any, ...]:
        if self._type is RedOpType.PREMUL_SUM:
            return (ReduceOp, (self._type, self._factor))
        return (_singleton, (self._type.name,))  # unpickles to the singleton itself


def _singleton(name: str) -> ReduceOp:
    op: ReduceOp = getattr(ReduceOp, name)
    return op


for _t in RedOpType:
    if _t is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _t.name, ReduceOp(_t))


class P2POpType(enum.Enum):
    SEND = 0
    RECV = 1


class P2POp:
    """One send or receive inside a ``BatchSendRecv``."""

    __slots__ = ("peer", "tensor", "type")

    def __init__(self, type: P2POpType, tensor: torch.Tensor, peer: int) -> None:
        self.type = type
        self.tensor = tensor
        self.peer = peer

    def __repr__(self) -> str:
        return f"P2POp({self.type.name}, shape={tuple(self.tensor.shape)}, peer={self.peer})"


class Timeout(timedelta):
    """A timeout; a ``timedelta`` subclass as upstream's ``torchcomms.Timeout``."""


DEFAULT_TIMEOUT = timedelta(seconds=600)


class CommOptions:
    """Communicator-wide options; ``None`` arguments of ``new_comm`` keep these defaults."""

    def __init__(self) -> None:
        self.abort_process_on_timeout_or_error: bool = True
        self.timeout: timedelta = DEFAULT_TIMEOUT
        self.is_high_priority_stream: bool = False
        self.store: Any = None
        self.enable_reconfigure: bool = False
        self.hints: dict[str, str] = {}

    def __repr__(self) -> str:
        return (
            "CommOptions("
            f"abort_process_on_timeout_or_error={self.abort_process_on_timeout_or_error}, "
            f"timeout={self.timeout.total_seconds()}s, "
            f"is_high_priority_stream={self.is_high_priority_stream}, "
            f"store={type(self.store).__name__ if self.store is not None else None}, "
            f"enable_reconfigure={self.enable_reconfigure}, hints={self.hints})"
        )


#: ``BatchP2POptions``' default timeout (upstream's ``0 ms``: "use the comm's timeout").
#: Only this object means "unset"; a zero timeout set explicitly is refused like any op's.
UNSET_BATCH_TIMEOUT = timedelta(0)


class BatchP2POptions:
    """Options of ``BatchSendRecv.issue``."""

    def __init__(self) -> None:
        self.hints: dict[str, str] = {}
        self.timeout: timedelta = UNSET_BATCH_TIMEOUT


#: ``InitHandle`` of upstream's stub: what ``get_init_handle()`` returns and ``reconfigure`` takes.
InitHandle = str


class ReconfigureOptions:
    """The arguments of ``reconfigure`` as one value (upstream's ``ReconfigureOptions``).

    ``ReconfigureOptions()`` holds upstream's defaults (uuid 0, no handles, the comm's
    timeout, no hints); ``comm.reconfigure(o.uuid, o.init_handles, o.timeout, o.hints)``
    uses one.  A list of handles fixes the ranks (position), a set lets the backend order them.
    """

    def __init__(
        self,
        uuid: int = 0,
        init_handles: list[InitHandle] | set[InitHandle] | None = None,
        timeout: timedelta | None = None,
        hints: dict[str, str] | None = None,
    ) -> None:
        if isinstance(uuid, bool) or not isinstance(uuid, int):
            raise TypeError(f"ReconfigureOptions: uuid must be an int, got {type(uuid).__name__}")
        handles: list[InitHandle] | set[InitHandle] = (
            set() if init_handles is None else init_handles
        )
        if not isinstance(handles, (list, set)) or not all(isinstance(h, str) for h in handles):
            raise TypeError(
                "ReconfigureOptions: init_handles must be a list or a set of str, got "
                f"{type(handles).__name__}"
            )
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(
                f"ReconfigureOptions: timeout must be a timedelta or None, got {type(timeout).__name__}"
            )
        if hints is not None and not isinstance(hints, dict):
            raise TypeError(
                f"ReconfigureOptions: hints must be a dict[str, str] or None, got {type(hints).__name__}"
            )
        self.uuid = uuid
        self.init_handles = handles
        self.timeout = timeout
        self.hints: dict[str, str] = (
            {} if hints is None else {str(k): str(v) for k, v in hints.items()}
        )

    def __repr__(self) -> str:
        return (
            f"ReconfigureOptions(uuid={self.uuid}, init_handles={self.init_handles!r}, "
            f"timeout={self.timeout}, hints={self.hints})"
        )


#: Per-op options' default timeout (upstream's ``kNoTimeout``, ``0 ms``): the comm's timeout.
UNSET_OP_TIMEOUT = timedelta(0)


class _PerOpOptions:
    """``hints`` and ``timeout`` of one op, as upstream's ``OptionsBase``.

    Upstream's stub lists one class per op; its Python methods take ``hints=`` and
    ``timeout=`` keywords instead, and so do ours.  They exist for code that builds them.
    """

    def __init__(self) -> None:
        self.hints: dict[str, str] = {}
        self.timeout: timedelta = UNSET_OP_TIMEOUT

    def __repr__(self) -> str:
        return f"{type(self).__name__}(hints={self.hints}, timeout={self.timeout})"


class SendOptions(_PerOpOptions):
    """Options of ``send``."""


class RecvOptions(_PerOpOptions):
    """Options of ``recv``."""


class BroadcastOptions(_PerOpOptions):
    """Options of ``broadcast``."""


class AllReduceOptions(_PerOpOptions):
    """Options of ``all_reduce``."""


class ReduceOptions(_PerOpOptions):
    """Options of ``reduce``."""


class AllGatherOptions(_PerOpOptions):
    """Options of ``all_gather`` and ``all_gather_v``."""


class AllGatherSingleOptions(_PerOpOptions):
    """Options of ``all_gather_single``."""


class ReduceScatterOptions(_PerOpOptions):
    """Options of ``reduce_scatter`` and ``reduce_scatter_v``."""


class ReduceScatterSingleOptions(_PerOpOptions):
    """Options of ``reduce_scatter_single``."""


class AllToAllOptions(_PerOpOptions):
    """Options of ``all_to_all``."""


class AllToAllSingleOptions(_PerOpOptions):
    """Options of ``all_to_all_single``."""


class AllToAllvSingleOptions(_PerOpOptions):
    """Options of ``all_to_all_v_single``."""


class BarrierOptions(_PerOpOptions):
    """Options of ``barrier``."""


class ScatterOptions(_PerOpOptions):
    """Options of ``scatter``."""


class GatherOptions(_PerOpOptions):
    """Options of ``gather`` and ``gather_single``."""


class AllGatherPInitOptions(_PerOpOptions):
    """Options of ``all_gather_p_init``."""


class AllGatherPExecOptions(_PerOpOptions):
    """Options of ``all_gather_p_exec``."""


class AbortReason(enum.Enum):
    """Why a communicator was aborted (``TorchComm.get_abort_info()``)."""

    NONE = 0
    ABORTED = 1
    TIMED_OUT = 2
    BOOTSTRAP_POLL = 3
    NETWORK_ERROR = 4
    INTERNAL_ERROR = 5


class AbortInfo:
    """The reason and free-form context of a communicator's abort (the first one wins)."""

    __slots__ = ("context", "reason")

    def __init__(self, reason: AbortReason, context: str = "") -> None:
        self.reason = reason
        self.context = context

    def __repr__(self) -> str:
        return f"AbortInfo(reason={self.reason.name}, context={self.context!r})"


class OpOptions:
    """Per-op options handed to native backends: resolved timeout, hints, and the op's identity."""

    __slots__ = ("hints", "op_id", "op_name", "timeout")

    def __init__(
        self,
        timeout: timedelta,
        hints: dict[str, str] | None = None,
        op_name: str = "",
        op_id: int | None = None,
    ) -> None:
        self.timeout = timeout
        self.hints = {} if hints is None else hints
        self.op_name = op_name
        self.op_id = op_id


class TorchCommWinAccessType(enum.Enum):
    """How a window reaches a peer's buffer: directly (same host) or through the network."""

    WIN_ACCESS_TYPE_UNIFIED = 0
    WIN_ACCESS_TYPE_SEPARATE = 1


class TorchCommWindowAttr:
    """What ``TorchCommWindow.get_attr(peer_rank)`` returns."""

    __slots__ = ("access_type",)

    def __init__(self, access_type: TorchCommWinAccessType) -> None:
        self.access_type = access_type

    def __repr__(self) -> str:
        return f"TorchCommWindowAttr(access_type={self.access_type})"
