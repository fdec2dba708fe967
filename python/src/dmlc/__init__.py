"""Python binding of the virtio-dmlc allreduce device.

>>> import numpy as np, dmlc
>>> dev = dmlc.init()                      # from the job's environment
>>> grads = np.ones(1024, dtype=np.float32)
>>> dmlc.allreduce(grads)                  # in place, rank order, bitwise reproducible

``dmlc.Device`` is the object API (several devices, explicit sockets);
``dmlc.torch_backend`` registers ``torch.distributed`` backend ``"dmlc"``
(loaded automatically through its entry point where torch supports it).
"""

from __future__ import annotations

from typing import Any

from .device import Comm, Device, Dtype, Received, ReduceOp, Work, allreduce_order
from .errors import (
    BadRequestError,
    BufferBusyError,
    CollectiveTimeoutError,
    DmlcError,
    EnvironmentSettingError,
    MismatchError,
    NonFiniteError,
    PeerLostError,
    RequestDroppedError,
    ResetError,
    TooBigError,
    TransportError,
    TruncatedError,
    UnansweredError,
    UnsupportedError,
)

__all__ = [
    "BadRequestError",
    "BufferBusyError",
    "CollectiveTimeoutError",
    "Comm",
    "Device",
    "DmlcError",
    "Dtype",
    "EnvironmentSettingError",
    "MismatchError",
    "NonFiniteError",
    "PeerLostError",
    "Received",
    "ReduceOp",
    "RequestDroppedError",
    "ResetError",
    "TooBigError",
    "TransportError",
    "TruncatedError",
    "UnansweredError",
    "UnsupportedError",
    "Work",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "device",
    "finalize",
    "init",
    "rank",
    "reduce",
    "reduce_scatter",
    "world_size",
]

_default: Device | None = None


def init(env: dict[str, str] | None = None) -> Device:
    """Opens the process's device from the environment (see Device.from_env)."""
    global _default
    if _default is None:
        _default = Device.from_env(env)
    return _default


def device() -> Device:
    """The device opened by init()."""
    if _default is None:
        raise RuntimeError("call dmlc.init() first")
    return _default


def finalize() -> None:
    """Closes the device opened by init()."""
    global _default
    if _default is not None:
        _default.close()
        _default = None


def rank() -> int:
    return device().rank


def world_size() -> int:
    return device().world_size


def allreduce(data: Any, out: Any = None, op: ReduceOp | str = ReduceOp.SUM, **kw: Any) -> Any:
    out, op = allreduce_order(out, op, stacklevel=3)
    return device().allreduce(data, out, op, **kw)


def broadcast(data: Any, root: int = 0, **kw: Any) -> Any:
    return device().broadcast(data, root, **kw)


def reduce(data: Any, op: ReduceOp | str = ReduceOp.SUM, root: int = 0, **kw: Any) -> Any:
    return device().reduce(data, op, root, **kw)


def allgather(data: Any, out: Any, **kw: Any) -> Any:
    return device().allgather(data, out, **kw)


def reduce_scatter(data: Any, out: Any, op: ReduceOp | str = ReduceOp.SUM, **kw: Any) -> Any:
    return device().reduce_scatter(data, out, op, **kw)


def barrier(**kw: Any) -> Any:
    return device().barrier(**kw)
