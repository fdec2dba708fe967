"""Exceptions for the device's statuses, keeping what the status says."""

from __future__ import annotations

from . import _capi

__all__ = [
    "BadRequestError",
    "BufferBusyError",
    "CollectiveTimeoutError",
    "DmlcError",
    "EnvironmentSettingError",
    "MismatchError",
    "NonFiniteError",
    "PeerLostError",
    "RequestDroppedError",
    "ResetError",
    "TooBigError",
    "TransportError",
    "TruncatedError",
    "UnansweredError",
    "UnsupportedError",
]


class DmlcError(RuntimeError):
    """A collective or a driver call failed.

    ``status`` is the C ABI's status code, ``detail`` the device's detail
    word (a BAD_* reason, a mismatch field mask), ``peer`` the rank the
    status is about or None.
    """

    def __init__(self, status: int, message: str, detail: int = 0, peer: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        self.peer = peer


class BadRequestError(DmlcError, ValueError):
    """The device refused a malformed request (sizes, root, flags)."""


class MismatchError(DmlcError):
    """The members called different collectives; ``fields`` names what differs."""

    @property
    def fields(self) -> list[str]:
        return [n for bit, n in enumerate(_capi.MISMATCH_FIELDS) if self.detail & (1 << bit)]


class PeerLostError(DmlcError):
    """A member was lost during the collective; ``peer`` is its rank."""


class CollectiveTimeoutError(DmlcError, TimeoutError):
    """Not every member arrived in time; ``peer`` is one that did not."""


class UnsupportedError(DmlcError):
    """The device does not support this opcode, dtype or op."""


class TooBigError(DmlcError):
    """The request is above the device's max_bytes or max_segments."""


class ResetError(DmlcError):
    """The group was reset while the collective waited."""


class TruncatedError(DmlcError):
    """A message and the receive it matched differ in size: the message was
    larger, or (above the device's max_bytes, where both ends cut it into
    pieces) of another size. Nothing of the piece that differed moved.

    ``length`` is the message's size in bytes (on a receive: as far as the
    device told it), ``room`` the receive's; ``peer`` the other end's rank in
    the communicator. None where unknown.
    """

    def __init__(
        self,
        status: int,
        message: str,
        detail: int = 0,
        peer: int | None = None,
        *,
        length: int | None = None,
        room: int | None = None,
    ) -> None:
        super().__init__(status, message, detail, peer)
        self.length = length
        self.room = room


class NonFiniteError(DmlcError, FloatingPointError):
    """With the check of non-finite inputs on (``Device.set_check_finite``,
    ``check_finite=True`` or ``DMLC_CHECK_FINITE=1``): a floating-point
    reduction's input held a NaN or an infinity. ``rank`` is the lowest rank
    (of the collective's communicator) whose input held one, ``index`` the
    lowest such element of its input (counted in the whole tensor or array
    the collective was given). Every member gets the same pair; the output
    holds the reduction all the same (NaNs included)."""

    def __init__(self, rank: int, index: int, message: str | None = None) -> None:
        super().__init__(
            _capi.ERR_NONFINITE,
            message
            or f"non-finite input: rank {rank}'s input holds a NaN or an infinity "
            f"at element {index}",
            0,
            rank,
        )
        self.rank = rank
        self.index = index

    def __reduce__(self) -> tuple[type[NonFiniteError], tuple[int, int, str]]:
        return (NonFiniteError, (self.rank, self.index, str(self)))


class TransportError(DmlcError, ConnectionError):
    """The connection to the device failed or was lost."""


class UnansweredError(DmlcError):
    """The device did not answer within its timeout plus a margin: it is
    stuck or gone. The request stays in flight; close and reopen the device."""


class RequestDroppedError(DmlcError):
    """The backend restarted (its group id changed) and will never answer
    this request: close and reopen the device."""


class BufferBusyError(DmlcError):
    """A request in flight uses the buffer: wait for it first."""


class EnvironmentSettingError(DmlcError, ValueError):
    """The job's environment (``DMLC_*``, ``RANK``, ``WORLD_SIZE``) is
    wrong, or names no device, or not this one."""


_BY_STATUS: dict[int, type[DmlcError]] = {
    _capi.ERR_BAD_REQUEST: BadRequestError,
    _capi.ERR_MISMATCH: MismatchError,
    _capi.ERR_PEER_LOST: PeerLostError,
    _capi.ERR_TIMEOUT: CollectiveTimeoutError,
    _capi.ERR_UNSUPPORTED: UnsupportedError,
    _capi.ERR_TOO_BIG: TooBigError,
    _capi.ERR_RESET: ResetError,
    _capi.ERR_TRUNCATE: TruncatedError,
    _capi.ERR_TRANSPORT: TransportError,
    _capi.ERR_UNANSWERED: UnansweredError,
    _capi.ERR_REQUEST_DROPPED: RequestDroppedError,
    _capi.ERR_BUFFER_BUSY: BufferBusyError,
    _capi.ERR_ENVIRONMENT: EnvironmentSettingError,
}


def error_for(
    status: int, message: str, detail: int = 0, peer: int | None = None, *, length: int = 0
) -> DmlcError:
    """The exception of `status`, with the driver's message; `length` is the
    element index of a NONFINITE (``dmlc_last_error_length``)."""
    if status == _capi.ERR_NONFINITE and peer is not None:
        return NonFiniteError(peer, length, message)
    return _BY_STATUS.get(status, DmlcError)(status, message, detail, peer)
