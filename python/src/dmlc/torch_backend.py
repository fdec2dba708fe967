"""torch.distributed backend "dmlc": collectives through the device.

``import dmlc.torch_backend`` registers it (and torch loads it by itself
through the ``torch.distributed.backends`` entry point where supported);
then ``dist.init_process_group("dmlc")`` opens the device from the job's
environment (see :meth:`dmlc.Device.from_env`) and DDP runs unmodified.

The creator returns a :class:`BackendDmlc`, a ``torch.distributed.Backend``
for the CPU device, which torch places inside a ProcessGroup of its own
making, as it does gloo: ``destroy_process_group``, ``pg.name()`` and
sequence numbers work as they do there.

Every collective is queued on the device's worker thread and returns at
once a :class:`DeviceWork`, completed from that thread, so DDP's backward
overlaps the exchange. A collective that fails fails its Work both ways
torch looks: ``wait()`` raises the device's exception (a
:class:`dmlc.DmlcError` with its status, peer and detail), and the Work's
future is failed in C++ (what DDP's reducer and comm hooks wait on), so
``backward()`` raises instead of reading an exception as a gradient.
Tensors go to the device from their own memory over the kernel driver
(``DMLC_DEVICE=kernel``) and from tensors made by
:meth:`dmlc.Device.empty`; others are copied into device memory and back.
Dtypes the device lacks are carried or refused as :mod:`dmlc.torch_tensors`
says; ops the device lacks raise NotImplementedError naming the op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _capi
from .device import Device, ReduceOp
from .errors import CollectiveTimeoutError
from .torch_tensors import as_bytes, for_reduction

__all__ = ["BackendDmlc", "DeviceWork", "device", "register"]

BACKEND = "dmlc"


def _op(opts: Any) -> ReduceOp:
    """The device's op for the ReduceOp in torch's `opts` (SUM without)."""
    if opts is None:
        return ReduceOp.SUM
    op = opts.reduceOp
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


class DeviceWork(dist.Work):
    """The torch Work of one device collective.

    ``wait()`` returns True, or raises the collective's exception, or a
    :class:`dmlc.CollectiveTimeoutError` once the group's timeout has passed
    without an answer. ``get_future()`` completes with the op's outputs, or
    fails with the exception's message (C++ waiters see a failed future).

    ``dist.*`` calls hand back torch's wrapper of this Work (PyWorkHolder in
    torch 2.15), which forwards ``wait()`` and ``get_future()`` only: its
    ``is_completed()`` stays False and ``is_success()`` True whatever
    happens. Poll ``get_future().done()`` instead.
    """

    def __init__(self, name: str, result: Any, timeout: timedelta) -> None:
        super().__init__()
        self._name = name
        self._result = result
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._start: torch.futures.Future[None] = torch.futures.Future()
        self._future: torch.futures.Future[Any] | None = None
        self._future_lock = threading.Lock()

    def _outcome(self, _: torch.futures.Future[None]) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def finish(self, error: BaseException | None) -> None:
        """Completes the Work (from the device's worker thread)."""
        self._error = error
        # The future's callbacks (C++) run before any waiter resumes: a
        # caller that returns from wait() and exits finds no completion
        # still running in the worker thread.
        self._start.set_result(None)
        self._done.set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = timeout if timeout > timedelta(0) else self._timeout
        if not self._done.wait(limit.total_seconds()):
            raise CollectiveTimeoutError(
                _capi.ERR_WAIT_TIMEOUT,
                f"dmlc: {self._name} did not complete within {limit} (the process group's "
                "timeout; the device's own is the backend's --timeout-ms)",
            )
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def get_future(self) -> torch.futures.Future[Any]:
        # Made on first use (DDP asks for it, dist.* calls do not). A Python
        # Future's set_exception only stores the exception as its value; an
        # exception raised in a `then` callback fails the chained future in
        # C++ (ivalue::Future::setError), which is what DDP's reducer and
        # any C++ waiter check. `then` on a completed future runs at once.
        with self._future_lock:
            if self._future is None:
                self._future = self._start.then(self._outcome)
            return self._future


class BackendDmlc(dist._Backend):
    """The CPU backend of a process group whose collectives run on one
    virtio-dmlc device."""

    def __init__(self, device: Device, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.device = device
        self._timeout = timeout
        self._seq = 0

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    @property
    def _backend_name(self) -> str:
        return BACKEND

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this process has started on the group."""
        return self._seq

    def _work(
        self, name: str, result: Any, start: Callable[[], Any], then: Callable[[], None] | None
    ) -> DeviceWork:
        """A Work completed when the device's work from `start()` is, after
        `then` (which copies results into the caller's tensors).

        One callback does both: a second callback on the device's work could
        run first, in the caller's thread, if it completes in between, and
        the caller would read outputs that `then` has not filled yet.
        """
        self._seq += 1
        work = DeviceWork(name, result, self._timeout)
        started = start()
        # Several requests (a coalesced op) complete in order on the device's
        # one worker thread: the last one's completion ends them all, and the
        # Work fails with the first failure.
        works = started if isinstance(started, list) else [started]

        def done(_: Any) -> None:
            e = next((w.exception() for w in works if w.exception() is not None), None)
            if e is None and then is not None:
                try:
                    then()
                except Exception as x:  # noqa: BLE001 (handed to the waiter)
                    e = x
            work.finish(e)

        works[-1].add_done_callback(done)
        return work

    @staticmethod
    def _one(tensors: list[Any], what: str) -> Any:
        if len(tensors) != 1:
            raise NotImplementedError(
                f"dmlc: {what} takes one tensor per process, not {len(tensors)}"
            )
        return tensors[0]

    @staticmethod
    def _then(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
        todo = [s for s in steps if s is not None]
        if not todo:
            return None

        def run() -> None:
            for s in todo:
                s()

        return run

    # ---- what the device has ------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> DeviceWork:
        t = self._one(tensors, "allreduce")
        op = _op(opts)
        if t.layout == torch.sparse_coo:
            return self._sparse_allreduce(t, op, tensors)
        c = for_reduction(t, op, "allreduce")
        return self._work(
            "allreduce",
            tensors,
            lambda: self.device.allreduce(c.tensor, op=c.op, async_op=True),
            c.back,
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> DeviceWork:
        op = _op(opts)
        carried = [for_reduction(t, op, "allreduce_coalesced") for t in tensors]
        if not carried:
            return self.barrier()
        return self._work(
            "allreduce_coalesced",
            tensors,
            lambda: [self.device.allreduce(c.tensor, op=c.op, async_op=True) for c in carried],
            self._then(*(c.back for c in carried)),
        )

    def _sparse_allreduce(
        self, t: torch.Tensor, op: ReduceOp, tensors: list[torch.Tensor]
    ) -> DeviceWork:
        """A sparse SUM from three allgathers (counts, indices, values), as
        gloo does it: the result is the coalesced sum, written into `t`."""
        if op != ReduceOp.SUM:
            raise NotImplementedError(f"dmlc: allreduce of sparse tensors has only SUM, not {op}")
        s = t.coalesce()
        indices, values = s.indices().contiguous(), s.values().contiguous()
        world = self.size()
        counts = torch.empty(world, dtype=torch.int64)
        self.device.allgather(torch.tensor([indices.shape[1]]), counts)
        most = int(counts.max())
        pad_i = torch.zeros((indices.shape[0], most), dtype=indices.dtype)
        pad_i[:, : indices.shape[1]] = indices
        pad_v = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
        pad_v[: values.shape[0]] = values
        all_i = torch.empty((world, *pad_i.shape), dtype=pad_i.dtype)
        all_v = torch.empty((world, *pad_v.shape), dtype=pad_v.dtype)

        def gather_all() -> Any:
            self.device.allgather(pad_i, all_i)
            return self.device.allgather(
                as_bytes(pad_v, "allreduce"), as_bytes(all_v, "allreduce"), async_op=True
            )

        def sum_into_t() -> None:
            n = [int(c) for c in counts]
            idx = torch.cat([all_i[r, :, : n[r]] for r in range(world)], dim=1)
            val = torch.cat([all_v[r, : n[r]] for r in range(world)])
            # Indices come from the peers: checked before use.
            total = torch.sparse_coo_tensor(idx, val, t.shape, check_invariants=True)
            t.copy_(total.coalesce())

        return self._work("allreduce", tensors, gather_all, sum_into_t)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> DeviceWork:
        t = as_bytes(self._one(tensors, "broadcast"), "broadcast")
        root = opts.rootRank if opts is not None else 0
        return self._work(
            "broadcast", tensors, lambda: self.device.broadcast(t, root, async_op=True), None
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> DeviceWork:
        c = for_reduction(self._one(tensors, "reduce"), _op(opts), "reduce")
        root = opts.rootRank if opts is not None else 0
        return self._work(
            "reduce",
            tensors,
            lambda: self.device.reduce(c.tensor, c.op, root, async_op=True),
            c.back,
        )

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> DeviceWork:
        self._one(input_tensors, "allgather")
        self._one(output_tensors, "allgather")
        return self.allgather_coalesced(output_tensors, input_tensors, opts)

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> DeviceWork:
        """Each input into its list of outputs, through one gathered tensor
        per input that is copied into the list when the device is done."""
        if not input_tensors:
            return self.barrier()
        name = "allgather"
        pairs = []
        for inp in input_tensors:
            gathered = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
            pairs.append((as_bytes(inp.contiguous(), name), as_bytes(gathered, name), gathered))

        def scatter_back() -> None:
            for outs, (_, _, gathered) in zip(output_lists, pairs):
                for o, g in zip(outs, gathered):
                    o.copy_(g)

        return self._work(
            name,
            output_lists,
            lambda: [self.device.allgather(s, d, async_op=True) for s, d, _ in pairs],
            scatter_back,
        )

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> DeviceWork:
        src = as_bytes(input.contiguous(), "all_gather_into_tensor")
        dst = as_bytes(output, "all_gather_into_tensor")
        return self._work(
            "all_gather_into_tensor",
            output,
            lambda: self.device.allgather(src, dst, async_op=True),
            None,
        )

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> DeviceWork:
        out = self._one(output_tensors, "reduce_scatter")
        ins = self._one(input_tensors, "reduce_scatter")  # type: ignore[arg-type]
        flat = torch.cat([t.reshape(-1) for t in ins])  # type: ignore[union-attr]
        return self._reduce_scatter("reduce_scatter", output_tensors, out, flat, _op(opts))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> DeviceWork:
        return self._reduce_scatter(
            "reduce_scatter_tensor", output, output, input.contiguous(), _op(opts)
        )

    def _reduce_scatter(
        self, name: str, result: Any, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp
    ) -> DeviceWork:
        ci, co = for_reduction(inp, op, name), for_reduction(out, op, name)
        return self._work(
            name,
            result,
            lambda: self.device.reduce_scatter(ci.tensor, co.tensor, ci.op, async_op=True),
            co.back,
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self.reduce_scatter_single(output, input, opts)

    def barrier(self, opts: Any = None) -> DeviceWork:
        return self._work("barrier", None, lambda: self.device.barrier(async_op=True), None)

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


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> BackendDmlc:
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
    return BackendDmlc(dev, rank, size, timeout)


def device() -> Device | None:
    """The device the backend opened in this process (None before any group):
    for its counters, such as ``staged_bytes``."""
    return _device


def register() -> None:
    """Registers backend "dmlc" with torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


register()
