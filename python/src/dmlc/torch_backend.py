"""torch.distributed backend "dmlc": collectives through the device.

``import dmlc.torch_backend`` registers it (and torch loads it by itself
through the ``torch.distributed.backends`` entry point where supported);
then ``dist.init_process_group("dmlc")`` opens the device from the job's
environment (see :meth:`dmlc.Device.from_env`) and DDP runs unmodified.

Every collective is queued on the device's worker thread and returns at
once: its Work completes from that thread, so DDP's backward overlaps the
exchange. Tensors go to the device from their own memory over the kernel
driver (``DMLC_DEVICE=kernel``), and from tensors made by
:meth:`dmlc.Device.empty`; others are copied into device memory and back
(one staging buffer); reduce ops map to the device's, AVG included; what the device
does not have raises NotImplementedError naming the op.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from .device import Device, ReduceOp

__all__ = ["ProcessGroupDmlc", "device", "register"]

BACKEND = "dmlc"


def _op(op: Any) -> ReduceOp:
    """The device's op for a torch.distributed ReduceOp."""
    table = {
        dist.ReduceOp.SUM: ReduceOp.SUM,
        dist.ReduceOp.PRODUCT: ReduceOp.PROD,
        dist.ReduceOp.MIN: ReduceOp.MIN,
        dist.ReduceOp.MAX: ReduceOp.MAX,
        dist.ReduceOp.AVG: ReduceOp.AVG,
        dist.ReduceOp.BAND: ReduceOp.BAND,
        dist.ReduceOp.BOR: ReduceOp.BOR,
        dist.ReduceOp.BXOR: ReduceOp.BXOR,
    }
    for k, v in table.items():
        if op == k:
            return v
    raise NotImplementedError(
        f"dmlc: reduce op {op} is not supported (the device has sum, product, min, max, "
        "avg, band, bor and bxor; PREMUL_SUM would need a scaling the device does not do)"
    )


class ProcessGroupDmlc(dist.ProcessGroup):
    """A process group whose collectives run on one virtio-dmlc device."""

    def __init__(self, device: Device, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.device = device

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    @property
    def _backend_name(self) -> str:
        return BACKEND

    def _work(self, result: Any, work: Any, then: Callable[[], None] | None = None) -> Any:
        """A torch Work completed when the device's `work` is, after `then`.

        One callback does both: a second callback on `work` could run first,
        in the caller's thread, if `work` completes in between, and the
        caller would read outputs that `then` has not filled yet.
        """
        fut: torch.futures.Future[Any] = torch.futures.Future()

        def done(f: Any) -> None:
            e = f.exception()
            if e is None and then is not None:
                try:
                    then()
                except Exception as x:  # noqa: BLE001 (handed to the waiter)
                    e = x
            if e is not None:
                fut.set_exception(e)
            else:
                fut.set_result(result)

        work.add_done_callback(done)
        return _create_work_from_future(fut)

    def _one(self, tensors: list[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise NotImplementedError(
                f"dmlc: {what} takes one tensor per process, not {len(tensors)}"
            )
        return tensors[0]

    # ---- what the device has ------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        t = self._one(tensors, "allreduce")
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        return self._work(tensors, self.device.allreduce(t, op, async_op=True))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        works = [self.device.allreduce(t, op, async_op=True) for t in tensors]
        return self._work(tensors, works[-1]) if works else self.barrier()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        t = self._one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        return self._work(tensors, self.device.broadcast(t, root, async_op=True))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        t = self._one(tensors, "reduce")
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        root = opts.rootRank if opts is not None else 0
        return self._work(tensors, self.device.reduce(t, op, root, async_op=True))

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        inp = self._one(input_tensors, "allgather")
        outs = self._one(output_tensors, "allgather")  # type: ignore[arg-type]
        gathered = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)

        def scatter_back() -> None:
            for o, g in zip(outs, gathered):  # type: ignore[call-overload]
                o.copy_(g)

        work = self.device.allgather(inp.contiguous(), gathered, async_op=True)
        return self._work(output_tensors, work, then=scatter_back)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._work(output, self.device.allgather(input.contiguous(), output, async_op=True))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        out = self._one(output_tensors, "reduce_scatter")
        ins = self._one(input_tensors, "reduce_scatter")  # type: ignore[arg-type]
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        flat = torch.cat([t.reshape(-1) for t in ins])  # type: ignore[union-attr]
        return self._work(output_tensors, self.device.reduce_scatter(flat, out, op, async_op=True))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        return self._work(
            output, self.device.reduce_scatter(input.contiguous(), output, op, async_op=True)
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self.reduce_scatter_single(output, input, opts)

    def barrier(self, opts: Any = None) -> Any:
        return self._work(None, self.device.barrier(async_op=True))

    # ---- what it does not have ------------------------------------------------

    def _missing(self, name: str) -> Any:
        raise NotImplementedError(
            f"dmlc: {name} is not supported: the device has allreduce, broadcast, reduce, "
            "allgather, reduce_scatter and barrier"
        )

    def send(self, *args: Any, **kw: Any) -> Any:
        return self._missing("send")

    def recv(self, *args: Any, **kw: Any) -> Any:
        return self._missing("recv")

    def recv_anysource(self, *args: Any, **kw: Any) -> Any:
        return self._missing("recv_anysource")

    def alltoall(self, *args: Any, **kw: Any) -> Any:
        return self._missing("all_to_all")

    def all_to_all_single(self, *args: Any, **kw: Any) -> Any:
        return self._missing("all_to_all_single")

    def alltoall_base(self, *args: Any, **kw: Any) -> Any:
        return self._missing("all_to_all_single")

    def gather(self, *args: Any, **kw: Any) -> Any:
        return self._missing("gather")

    def scatter(self, *args: Any, **kw: Any) -> Any:
        return self._missing("scatter")


_device: Device | None = None


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroupDmlc:
    """torch's creator: one device per process, shared by every group on it."""
    global _device
    if _device is None:
        _device = Device.from_env()
    dev = _device
    if (rank, size) != (dev.rank, dev.world_size):
        raise RuntimeError(
            f"dmlc: a group of {size} with this process as rank {rank} is not the device's "
            f"group ({dev.world_size} members, this one rank {dev.rank}); subgroups "
            "(new_group with other ranks) are not supported"
        )
    return ProcessGroupDmlc(dev, rank, size)


def device() -> Device | None:
    """The device the backend opened in this process (None before any group):
    for its counters, such as ``staged_bytes``."""
    return _device


def register() -> None:
    """Registers backend "dmlc" with torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


register()
