"""How the torch backend hands tensors to the device, the dtypes it lacks included.

The device reduces ten element types (see :class:`dmlc.Dtype`). The backend
carries some others with gloo's results, and refuses the rest at the call
with an error that names the dtype and what the device has:

- ``bool`` goes as ``uint8`` bytes (torch keeps bools as 0 or 1): SUM and
  MAX are a logical or, PRODUCT and MIN a logical and, the bitwise ops are
  themselves; AVG is refused, as gloo refuses it.
- ``int16`` and ``uint16`` are widened to ``int32`` for a reduction and
  narrowed back, wrapping as 16-bit arithmetic does (products and sums
  modulo 2**16 do not depend on the width they were taken in).
- ``complex64`` and ``complex128`` go as pairs of ``float32``/``float64``:
  SUM and AVG are element-wise on the real and imaginary parts; PRODUCT,
  MIN, MAX and the bitwise ops are refused.
- Broadcast, allgather, send and receive, all-to-all, gather and scatter
  move bytes: any dense dtype goes, as ``uint8``.
- Sparse tensors: ``allreduce`` with SUM is built from allgathers (see the
  backend); every other op refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .device import ReduceOp, _torch_dtypes

__all__ = ["Carried", "as_bytes", "as_input", "as_output", "for_reduction", "moved_numel"]

_HAS = "float32, float64, float16, bfloat16, int8, uint8, int32, uint32, int64 and uint64"
_CARRIED = "bool, int16, uint16, complex64 and complex128 by conversion"

# bool's ops on 0/1 bytes: what gloo's arithmetic on C++ bools gives.
_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.MAX,
    ReduceOp.PROD: ReduceOp.MIN,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.BAND: ReduceOp.BAND,
    ReduceOp.BOR: ReduceOp.BOR,
    ReduceOp.BXOR: ReduceOp.BXOR,
}
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32}
_COMPLEX_OPS = (ReduceOp.SUM, ReduceOp.AVG)


@dataclass
class Carried:
    """What the device works on for one caller tensor.

    ``tensor`` is the caller's own memory where the dtype allows, a view of
    it, or a converted copy; ``back`` copies a copy's result into the
    caller's tensor (None when the device wrote the caller's memory).
    """

    tensor: torch.Tensor
    op: ReduceOp
    back: Callable[[], None] | None = None


def _dense_cpu(t: torch.Tensor, what: str, *, contiguous: bool = True) -> None:
    if t.layout != torch.strided:
        raise NotImplementedError(
            f"dmlc: {what} of a {t.layout} tensor is not supported (the device works on "
            "dense tensors; allreduce with SUM is the one op that takes sparse ones)"
        )
    if t.device.type != "cpu":
        raise ValueError(f"dmlc: {what} works on CPU tensors; this one is on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"dmlc: {what} needs contiguous tensors (call .contiguous() first)")


def for_reduction(t: torch.Tensor, op: ReduceOp, what: str) -> Carried:
    """The device's form of `t` for a reduction with `op`, or a clear error."""
    _dense_cpu(t, what)
    if t.dtype in _torch_dtypes():
        return Carried(t, op)
    if t.dtype == torch.bool:
        if op not in _BOOL_OPS:
            raise ValueError(f"dmlc: {what} of bool tensors has no {op.name} (as in gloo)")
        return Carried(t.view(torch.uint8), _BOOL_OPS[op])
    if t.dtype in _WIDER:
        wide = t.to(_WIDER[t.dtype])
        return Carried(wide, op, lambda: t.copy_(wide))
    if t.dtype in (torch.complex64, torch.complex128):
        if op not in _COMPLEX_OPS:
            raise ValueError(
                f"dmlc: {what} of {t.dtype} tensors has only SUM and AVG, not {op.name}"
            )
        return Carried(torch.view_as_real(t), op)
    raise TypeError(
        f"dmlc: {what} has no reduction for {t.dtype}: the device reduces {_HAS}, "
        f"and the backend carries {_CARRIED}"
    )


def as_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as the device moves it when nothing is reduced: itself where the
    device has its dtype, else a flat ``uint8`` view of its memory."""
    _dense_cpu(t, what)
    if t.dtype in _torch_dtypes():
        return t
    return t.reshape(-1).view(torch.uint8)


def as_input(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as :func:`as_bytes` gives it, for a tensor the device only reads:
    a contiguous copy first where it is not contiguous."""
    if t.layout == torch.strided and t.device.type == "cpu":
        t = t.contiguous()
    return as_bytes(t, what)


def as_output(t: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """What the device writes for `t`, and what copies it into `t` after:
    :func:`as_bytes` of `t` itself where it is contiguous (nothing to copy),
    of a contiguous tensor like it otherwise."""
    _dense_cpu(t, what, contiguous=False)
    if t.is_contiguous():
        return as_bytes(t, what), None
    room = torch.empty(t.shape, dtype=t.dtype)

    def back() -> None:
        t.copy_(room)

    return as_bytes(room, what), back


def moved_numel(t: torch.Tensor, what: str) -> int:
    """How many elements :func:`as_bytes` makes of a tensor like `t`
    (which need not be contiguous): its own, or its bytes."""
    _dense_cpu(t, what, contiguous=False)
    return t.numel() if t.dtype in _torch_dtypes() else t.numel() * t.element_size()
