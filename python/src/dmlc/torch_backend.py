"""torch.distributed backend "dmlc": collectives through the device.

``import dmlc.torch_backend`` registers it (and torch loads it by itself
through the ``torch.distributed.backends`` entry point where supported);
then ``dist.init_process_group("dmlc")`` opens the device from the job's
environment (see :meth:`dmlc.Device.from_env`) and DDP runs unmodified.

The creator (torch's extended API: it learns each group's global ranks and
name) returns a :class:`BackendDmlc`, a ``torch.distributed.Backend`` for
the CPU device, which torch places inside a ProcessGroup of its own making,
as it does gloo: ``destroy_process_group``, ``pg.name()`` and sequence
numbers work as they do there.

Each group runs on one communicator of the device (spec 5.X.6.13): the
default group, and any group of every rank in rank order, on communicator
0 (the device's group); any other group (``new_group(ranks)``,
``new_subgroups``, ...) on one that its members make with
:meth:`dmlc.Device.comm_create` when torch creates the group on them (torch
calls the creator on the group's members only), tagged with a hash of
torch's group name, which every member of a group agrees on, so that groups
made at once stay apart. ``destroy_process_group`` frees it (torch's
``shutdown`` hook). Ranks and roots are the group's, as torch passes them.

Every op is queued on the device's worker thread (sends and receives on
one each) and returns at once a :class:`DeviceWork`, completed from that
thread, so DDP's backward overlaps the exchange. An op that fails fails
its Work both ways torch looks: ``wait()`` raises the device's exception (a
:class:`dmlc.DmlcError` with its status, peer and detail), and the Work's
future is failed in C++ (what DDP's reducer and comm hooks wait on), so
``backward()`` raises instead of reading an exception as a gradient.
Tensors go to the device from their own memory over the kernel driver
(``DMLC_DEVICE=kernel``) and from tensors made by
:meth:`dmlc.Device.empty`; others are copied into device memory and back.

The ops: allreduce (dense, and sparse with SUM), allreduce_coalesced,
broadcast, reduce, allgather, allgather_coalesced (one output list per
member, as gloo), reduce_scatter, all_gather_into_tensor and
reduce_scatter_tensor and their coalesced forms (which torch's functional
collectives call, so DTensor and FSDP2), barrier, monitored_barrier (gloo's, on
send and receive); send, recv and recv_anysource (torch's
tag is the device's; messages above the device's max_bytes are cut by the
C library, spec DRV-COMM-2); all_to_all (the device's alltoallv: the sizes
of the list form may differ between members), all_to_all_single (alltoall
without split sizes, alltoallv with them); gather and scatter of equal
blocks. Tensors of no elements move nothing (every member's has none).
Dtypes the device lacks are carried or refused as
:mod:`dmlc.torch_tensors` says; what the backend cannot do raises
NotImplementedError naming the op.

Limits torch or the device set:

- torch wraps a Python backend's Work in one that forwards only ``wait()``
  and ``get_future()``, so ``dist.recv(t, src=None)`` receives the message
  and then raises torch's RuntimeError from ``_source_rank()``; use
  :func:`recv_anysource` here, which returns the sender's global rank.
- A send completes once a receive took it, and a process's sends go one
  at a time in the order it made them (its receives too), so a send waits
  for the receives of the sends before it: a receiver that waits for a
  later message of a process before it takes an earlier one waits until
  the timeout. A ring, or ``batch_isend_irecv`` of one send and one
  receive per peer, is fine.
- The v forms, so all_to_all and all_to_all_single with split sizes, are
  one request each: each member's data must fit the device's max_bytes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _capi
from .device import Comm, Device, ReduceOp
from .errors import CollectiveTimeoutError, DmlcError
from .torch_tensors import as_bytes, as_input, as_output, for_reduction, moved_numel

__all__ = ["BackendDmlc", "DeviceWork", "device", "group_tag", "recv_anysource", "register"]

BACKEND = "dmlc"
# The device tag of monitored_barrier's messages: out of the range of
# torch's tags (C ints, which _tag maps to 0..2**31-1 and 2**64-2**31..).
_MONITORED = 0x6D6F6E69_74626172


def _tag(tag: int) -> int:
    """torch's tag of a send or receive (a C int, which may be negative) as
    the device's (a 64-bit number): equal tags map to equal tags."""
    return tag % (1 << 64)


def group_tag(group_name: str) -> int:
    """The comm_create tag of the torch group named `group_name`: 64 bits of
    its SHA-256, the same in every process (Python's ``hash`` of a str is
    salted per process).

    torch names a group the same on every member (the name prefixes the
    group's keys in the store, which the members share): ``str(n)`` of a
    counter that every rank advances at each ``new_group``, or a SHA-1 of
    the ranks and that counter (``use_local_synchronization=True``). So
    groups created at once, such as ``[0, 1]`` and ``[1, 2]`` (rank 1 makes
    both while ranks 0 and 2 each make one), get different tags, and the
    device matches each creation with its own members.
    """
    return int.from_bytes(hashlib.sha256(group_name.encode()).digest()[:8], "little")


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
    happens, and its ``_source_rank()`` raises. Poll
    ``get_future().done()`` instead; for the sender of a receive from any
    source, see :func:`recv_anysource`.
    """

    def __init__(self, name: str, result: Any, timeout: timedelta) -> None:
        super().__init__()
        if _KEEP_WORKS is not None:
            _KEEP_WORKS.append(self)
        self._name = name
        self._result = result
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None
        # A receive's sender, as a rank of the group (None: not a receive).
        self._source: int | None = None
        self._start: torch.futures.Future[None] = torch.futures.Future()
        self._future: torch.futures.Future[Any] | None = None
        self._future_lock = threading.Lock()

    def _outcome(self, _: torch.futures.Future[None]) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def finish(self, error: BaseException | None, source: int | None = None) -> None:
        """Completes the Work (from the device's worker thread); `source`
        is a receive's sender."""
        self._error = error
        self._source = source
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
                f"dmlc: {self._name} did not complete within {limit}: it hit the process "
                "group's timeout (the device's own is the backend's --timeout-ms)",
            )
        if self._error is not None:
            raise self._error
        return True

    def _source_rank(self) -> int:
        """The sender of a receive (its rank in the group), once it has
        completed: waits as ``wait()`` does, and raises its error."""
        self.wait()
        if self._source is None:
            raise RuntimeError(f"dmlc: {self._name} has no source rank: only a receive has one")
        return self._source

    def source_rank(self) -> int:
        return self._source_rank()

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


def _backend_base() -> type:
    """The class a Python backend derives from: torch's ``_Backend`` where
    torch lets Python construct one, else ``ProcessGroup``. torch 2.6 (the
    one Debian trixie packages for every architecture, docs/architectures.md)
    binds no constructor for ``_Backend``; it takes a ProcessGroup that the
    creator returns as the group itself, with the same collective methods."""
    try:
        dist._Backend(0, 1)
    except TypeError:
        return dist.ProcessGroup
    return dist._Backend


# torch 2.6 keeps only the C++ part of a Work a Python backend returns: once
# the Python object is gone (a collective that completed before DDP's
# reducer asked for its future), getFuture() falls back to the base class
# and raises "Work::getFuture not implemented". The newest Works are kept
# alive there; later torch holds them itself (PyWorkHolder).
_BASE = _backend_base()
_KEEP_WORKS: collections.deque[Any] | None = (
    collections.deque(maxlen=64) if _BASE is dist.ProcessGroup else None
)


class BackendDmlc(_BASE):  # type: ignore[misc,valid-type]
    """The CPU backend of a process group whose ops run on one virtio-dmlc
    device, on communicator `comm` (the device's group by default; its
    rank and size are the group's)."""

    def __init__(
        self,
        device: Device,
        rank: int,
        size: int,
        timeout: timedelta,
        comm: Comm | None = None,
    ) -> None:
        super().__init__(rank, size)
        self.device = device
        self.comm = device.world if comm is None else comm
        self._timeout = timeout
        self._seq = 0
        self._freed = False

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    @property
    def _backend_name(self) -> str:
        return BACKEND

    # torch 2.15 reads a backend's capabilities through properties that, on
    # a Python backend without its own, look themselves up again and
    # recurse (RecursionError): batch_isend_irecv reads supports_coalescing,
    # split_group supports_splitting. The backend has none of them.

    @property
    def supports_coalescing(self) -> bool:
        return False

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_shrinking(self) -> bool:
        return False

    @property
    def supports_reconfigure(self) -> bool:
        return False

    @property
    def supports_window(self) -> bool:
        return False

    @property
    def _supports_time_estimate(self) -> bool:
        return False

    def _get_sequence_number_for_group(self) -> int:
        """How many ops this process has started on the group."""
        return self._seq

    def shutdown(self) -> None:
        """torch's hook when the group is destroyed: frees its communicator,
        collectively over its members (nothing for communicator 0). A
        failure warns: destroy_process_group does not expect one."""
        if self.comm.id == 0 or self._freed:
            return
        self._freed = True
        try:
            self.device.comm_free(self.comm)
        except DmlcError as e:
            warnings.warn(
                f"dmlc: freeing communicator {self.comm.id} of the group failed: {e}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _work(
        self,
        name: str,
        result: Any,
        start: Callable[[], Any],
        then: Callable[[], None] | None,
        *,
        receive: bool = False,
    ) -> DeviceWork:
        """A Work completed when the device's work from `start()` is, after
        `then` (which copies results into the caller's tensors); with
        `receive`, the device's work is a receive whose sender the Work
        reports.

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
            work.finish(e, works[-1].wait().source if e is None and receive else None)

        works[-1].add_done_callback(done)
        return work

    def _finished(
        self, name: str, result: Any, then: Callable[[], None] | None = None
    ) -> DeviceWork:
        """A Work already complete, after `then`: an op with nothing to move
        (tensors of no elements, which every member has alike)."""
        self._seq += 1
        work = DeviceWork(name, result, self._timeout)
        error: BaseException | None = None
        if then is not None:
            try:
                then()
            except Exception as x:  # noqa: BLE001 (handed to the waiter)
                error = x
        work.finish(error)
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
        if not t.numel():
            return self._finished("allreduce", tensors)
        return self._work(
            "allreduce",
            tensors,
            lambda: self.device.allreduce(c.tensor, op=c.op, comm=self.comm, async_op=True),
            c.back,
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> DeviceWork:
        op = _op(opts)
        carried = [for_reduction(t, op, "allreduce_coalesced") for t in tensors if t.numel()]
        if not tensors:
            return self.barrier()
        if not carried:
            return self._finished("allreduce_coalesced", tensors)
        return self._work(
            "allreduce_coalesced",
            tensors,
            lambda: [
                self.device.allreduce(c.tensor, op=c.op, comm=self.comm, async_op=True)
                for c in carried
            ],
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
        self.device.allgather(torch.tensor([indices.shape[1]]), counts, comm=self.comm)
        most = int(counts.max())
        pad_i = torch.zeros((indices.shape[0], most), dtype=indices.dtype)
        pad_i[:, : indices.shape[1]] = indices
        pad_v = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
        pad_v[: values.shape[0]] = values
        all_i = torch.empty((world, *pad_i.shape), dtype=pad_i.dtype)
        all_v = torch.empty((world, *pad_v.shape), dtype=pad_v.dtype)

        def gather_all() -> Any:
            self.device.allgather(pad_i, all_i, comm=self.comm)
            return self.device.allgather(
                as_bytes(pad_v, "allreduce"),
                as_bytes(all_v, "allreduce"),
                comm=self.comm,
                async_op=True,
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
        if not t.numel():
            return self._finished("broadcast", tensors)
        return self._work(
            "broadcast",
            tensors,
            lambda: self.device.broadcast(t, root, comm=self.comm, async_op=True),
            None,
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> DeviceWork:
        c = for_reduction(self._one(tensors, "reduce"), _op(opts), "reduce")
        root = opts.rootRank if opts is not None else 0
        if not c.tensor.numel():
            return self._finished("reduce", tensors)
        return self._work(
            "reduce",
            tensors,
            lambda: self.device.reduce(c.tensor, c.op, root, comm=self.comm, async_op=True),
            c.back,
        )

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> DeviceWork:
        """``output_tensors[0][r]`` gets member r's ``input_tensors[0]``."""
        inp = self._one(input_tensors, "allgather")
        outs = self._one(output_tensors, "allgather")
        self._per_member(outs, "allgather")
        return self._allgather("allgather", output_tensors, [inp], lambda r, _: outs[r])

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> DeviceWork:
        """``output_lists[r][j]`` gets member r's ``input_tensors[j]`` (one
        list per member, as gloo and torch's all_gather_coalesced have it)."""
        name = "allgather_coalesced"
        self._per_member(output_lists, name)
        for outs in output_lists:
            if len(outs) != len(input_tensors):
                raise ValueError(
                    f"dmlc: {name}: each member's output list must have one tensor per "
                    f"input ({len(input_tensors)}), not {len(outs)}"
                )
        return self._allgather(name, output_lists, input_tensors, lambda r, j: output_lists[r][j])

    def _allgather(
        self,
        name: str,
        result: Any,
        inputs: list[torch.Tensor],
        out: Callable[[int, int], torch.Tensor],
    ) -> DeviceWork:
        """Each input gathered into one tensor, then copied into ``out(r, j)``
        (member r's block of input j) when the device is done. Inputs with no
        elements move nothing (every member's has none)."""
        gathered = [torch.empty((self.size(), *t.shape), dtype=t.dtype) for t in inputs]
        moves = [
            (as_input(t, name), as_bytes(g, name)) for t, g in zip(inputs, gathered) if t.numel()
        ]

        def copy_out() -> None:
            for j, g in enumerate(gathered):
                for r in range(self.size()):
                    out(r, j).copy_(g[r])

        if not moves:
            return self._finished(name, result, copy_out)
        return self._work(
            name,
            result,
            lambda: [self.device.allgather(s, d, comm=self.comm, async_op=True) for s, d in moves],
            copy_out,
        )

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> DeviceWork:
        src = as_input(input, "all_gather_into_tensor")
        dst = as_bytes(output, "all_gather_into_tensor")
        if not src.numel():
            return self._finished("all_gather_into_tensor", output)
        return self._work(
            "all_gather_into_tensor",
            output,
            lambda: self.device.allgather(src, dst, comm=self.comm, async_op=True),
            None,
        )

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> DeviceWork:
        """``outputs[j]`` gets every member's ``inputs[j]``, block r from
        member r: all_gather_into_tensor of each pair, in one Work (what
        the functional collectives call, and so DTensor's
        ``full_tensor()`` and ``redistribute()``)."""
        name = "all_gather_into_tensor_coalesced"
        self._pairs(outputs, inputs, name)
        moves = [
            (as_input(i, name), as_bytes(o, name)) for o, i in zip(outputs, inputs) if i.numel()
        ]
        if not moves:
            return self._finished(name, outputs)
        return self._work(
            name,
            outputs,
            lambda: [self.device.allgather(s, d, comm=self.comm, async_op=True) for s, d in moves],
            None,
        )

    # The name torch used before all_gather_single_coalesced (it still asks
    # for it where a Python backend lacks the new one).
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @staticmethod
    def _pairs(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], what: str) -> None:
        if len(outputs) != len(inputs):
            raise ValueError(
                f"dmlc: {what} takes one output per input ({len(inputs)}), not {len(outputs)}"
            )

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
        if not co.tensor.numel():
            return self._finished(name, result)
        return self._work(
            name,
            result,
            lambda: self.device.reduce_scatter(
                ci.tensor, co.tensor, ci.op, comm=self.comm, async_op=True
            ),
            co.back,
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> DeviceWork:
        """``outputs[j]`` gets block `rank` of the reduction of every
        member's ``inputs[j]``: reduce_scatter_tensor of each pair, in one
        Work (the functional collectives' reduce_scatter_tensor)."""
        name = "reduce_scatter_tensor_coalesced"
        self._pairs(outputs, inputs, name)
        op = _op(opts)
        pairs = [
            (for_reduction(i.contiguous(), op, name), for_reduction(o, op, name))
            for o, i in zip(outputs, inputs)
        ]
        pairs = [(ci, co) for ci, co in pairs if co.tensor.numel()]
        if not pairs:
            return self._finished(name, outputs)
        return self._work(
            name,
            outputs,
            lambda: [
                self.device.reduce_scatter(
                    ci.tensor, co.tensor, ci.op, comm=self.comm, async_op=True
                )
                for ci, co in pairs
            ],
            self._then(*(co.back for _, co in pairs)),
        )

    # The older name of reduce_scatter_single_coalesced.
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts: Any = None) -> DeviceWork:
        return self._work(
            "barrier", None, lambda: self.device.barrier(comm=self.comm, async_op=True), None
        )

    # ---- send and receive (spec 5.X.6.13.4) -----------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> DeviceWork:
        t = as_input(self._one(tensors, "send"), "send")
        return self._work(
            "send",
            tensors,
            lambda: self.device.send(t, dst, _tag(tag), comm=self.comm, async_op=True),
            None,
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> DeviceWork:
        return self._recv("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> DeviceWork:
        """A receive from any member; the Work's ``_source_rank()`` is the
        sender's rank in the group (see :func:`recv_anysource` for why
        torch's own ``dist.recv(src=None)`` cannot ask it)."""
        return self._recv("recv_anysource", tensors, None, tag)

    def _recv(
        self, name: str, tensors: list[torch.Tensor], src: int | None, tag: int
    ) -> DeviceWork:
        out, back = as_output(self._one(tensors, name), name)
        return self._work(
            name,
            tensors,
            lambda: self.device.recv(out, src, _tag(tag), comm=self.comm, async_op=True),
            back,
            receive=True,
        )

    # ---- all-to-all, gather and scatter (spec 5.X.6.13.5) ----------------------

    @staticmethod
    def _one_dtype(tensors: Sequence[torch.Tensor], what: str) -> None:
        kinds = {t.dtype for t in tensors}
        if len(kinds) > 1:
            raise ValueError(
                f"dmlc: {what} takes tensors of one dtype, not {sorted(map(str, kinds))}"
            )

    def _per_member(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        if len(tensors) != self.size():
            raise ValueError(
                f"dmlc: {what} takes one tensor per member of the group ({self.size()}), "
                f"not {len(tensors)}"
            )

    def _equal_blocks(self, tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        """The root's list of a gather or scatter: one block per member,
        each with `like`'s dtype and number of elements."""
        self._per_member(tensors, what)
        for t in tensors:
            if t.dtype != like.dtype or t.numel() != like.numel():
                raise ValueError(
                    f"dmlc: {what} moves equal blocks: each tensor of the list must have "
                    f"{like.numel()} elements of {like.dtype}, not {t.numel()} of {t.dtype}"
                )

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor], what: str) -> tuple[torch.Tensor, list[int]]:
        """`tensors` one after the other in one tensor of the device's form
        (see :func:`dmlc.torch_tensors.as_bytes`), and each one's elements
        in it."""
        parts = [as_input(t, what).reshape(-1) for t in tensors]
        return torch.cat(parts), [p.numel() for p in parts]

    @staticmethod
    def _unflat(flat: torch.Tensor, counts: list[int], outs: Sequence[torch.Tensor]) -> None:
        """Copies the pieces of `flat` (`counts` elements each, in the
        device's form) into `outs`."""
        for o, piece in zip(outs, flat.split(counts)):
            o.copy_(piece.view(o.dtype).reshape(o.shape))

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> DeviceWork:
        """``input_tensors[j]`` to member j, ``output_tensors[i]`` from
        member i. Always the device's alltoallv: whether every block of the
        group has one size is not known to any one member (its own lists
        can be even while another's are not), and the members must agree on
        the request."""
        name = "all_to_all"
        self._per_member(input_tensors, name)
        self._per_member(output_tensors, name)
        self._one_dtype([*input_tensors, *output_tensors], name)
        send, sends = self._flat(input_tensors, name)
        recvs = [moved_numel(t, name) for t in output_tensors]
        got = torch.empty(sum(recvs), dtype=send.dtype)
        return self._work(
            name,
            output_tensors,
            lambda: self.device.alltoallv(send, got, sends, recvs, comm=self.comm, async_op=True),
            lambda: self._unflat(got, recvs, output_tensors),
        )

    def _split(self, splits: Sequence[int], t: torch.Tensor, what: str) -> list[int]:
        """Elements of `t`'s device form for each member: `splits` rows of
        `t` (its first dimension) each, or equal parts without."""
        n, rows = self.size(), (t.shape[0] if t.dim() else 1)
        if not splits:
            if rows % n:
                raise ValueError(
                    f"dmlc: {what}: {rows} rows do not split into {n} equal parts "
                    "(pass split sizes)"
                )
            splits = [rows // n] * n
        if len(splits) != n or sum(splits) != rows or min(splits) < 0:
            raise ValueError(
                f"dmlc: {what}: split sizes {list(splits)} are not {n} counts of the "
                f"tensor's {rows} rows"
            )
        row = moved_numel(t, what) // rows if rows else 0
        return [int(x) * row for x in splits]

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> DeviceWork:
        """Rows of `input` to each member, rows of `output` from each:
        equal parts without split sizes (the device's alltoall, cut into
        requests as the C library cuts it), the given ones with either
        (alltoallv, one request), as gloo decides: the members must agree
        on giving split sizes, as they must there."""
        name = "all_to_all_single"
        self._one_dtype([output, input], name)
        if not input.is_contiguous():
            # gloo and nccl refuse it, and torch's backend-agnostic test
            # (test_c10d_common.py) expects every backend to.
            raise ValueError(
                f"dmlc: {name}: Tensors must be contiguous, and the input is not "
                "(as in gloo and nccl; call .contiguous() first)"
            )
        sends = self._split(input_split_sizes, input, name)
        recvs = self._split(output_split_sizes, output, name)
        src = as_input(input, name)
        dst, back = as_output(output, name)
        if not input_split_sizes and not output_split_sizes:

            def start() -> Any:
                return self.device.alltoall(src, dst, comm=self.comm, async_op=True)

        else:

            def start() -> Any:
                return self.device.alltoallv(src, dst, sends, recvs, comm=self.comm, async_op=True)

        return self._work(name, output, start, back)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> DeviceWork:
        """The older name of :meth:`all_to_all_single` (torch 2.15 asks for
        that one first)."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> DeviceWork:
        """Every member's tensor into the root's list (``output_tensors`` is
        ``[list]`` on the root, ``[]`` elsewhere), equal blocks."""
        name = "gather"
        root = opts.rootRank if opts is not None else 0
        inp = self._one(input_tensors, name)
        src = as_input(inp, name)
        if self.rank() != root:
            return self._work(
                name,
                output_tensors,
                lambda: self.device.gather(src, None, root, comm=self.comm, async_op=True),
                None,
            )
        outs = self._one(output_tensors, name)
        self._equal_blocks(outs, inp, name)
        got = torch.empty(self.size() * src.numel(), dtype=src.dtype)
        return self._work(
            name,
            output_tensors,
            lambda: self.device.gather(src, got, root, comm=self.comm, async_op=True),
            lambda: self._unflat(got, [src.numel()] * self.size(), outs),
        )

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> DeviceWork:
        """The root's list (``input_tensors`` is ``[list]`` on the root,
        ``[]`` elsewhere) to every member's tensor, equal blocks."""
        name = "scatter"
        root = opts.rootRank if opts is not None else 0
        out = self._one(output_tensors, name)
        data = None
        if self.rank() == root:
            ins = self._one(input_tensors, name)
            self._equal_blocks(ins, out, name)
            data, _ = self._flat(ins, name)
        dst, back = as_output(out, name)
        return self._work(
            name,
            output_tensors,
            lambda: self.device.scatter(data, dst, root, comm=self.comm, async_op=True),
            back,
        )

    # ---- monitored barrier ---------------------------------------------------------

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, on the device's send and receive: every
        member sends rank 0 a byte and waits for its answer; rank 0 waits
        for each member in turn within the timeout (``opts.timeout``) and
        names the first that did not arrive, or all of them with
        `wait_all_ranks`, in gloo's words, before it answers anyone.

        A receive that timed out stays posted on the device until the
        backend's own timeout ends it.
        """
        limit = getattr(opts, "timeout", None)
        if not isinstance(limit, timedelta) or limit < timedelta(0):
            limit = self._timeout
        seconds = limit.total_seconds()
        ms = int(seconds * 1000)
        start = time.monotonic()
        me, size = self.rank(), self.size()

        def left() -> float:
            return seconds - (time.monotonic() - start)

        if me != 0:
            try:
                token = torch.ones(1, dtype=torch.uint8)
                self.device.send(token, 0, _MONITORED, comm=self.comm, async_op=True).wait(
                    max(left(), 0.0)
                )
                self.device.recv(token, 0, _MONITORED, comm=self.comm, async_op=True).wait(
                    max(left(), 0.0)
                )
            except (DmlcError, concurrent.futures.TimeoutError) as e:
                raise RuntimeError(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors "
                    "while waiting for send/recv from rank 0. Please check rank 0 logs for "
                    f"faulty rank. (dmlc: {e or 'no answer within the timeout'})"
                ) from e
            return
        works = {
            r: self.device.recv(
                torch.zeros(1, dtype=torch.uint8), r, _MONITORED, comm=self.comm, async_op=True
            )
            for r in range(1, size)
        }
        failed: list[int] = []
        processed: list[int] = []
        for r, w in works.items():
            # As gloo: with wait_all_ranks each member gets the whole timeout.
            wait = seconds if wait_all_ranks else left()
            if not wait_all_ranks and wait <= 0:
                raise RuntimeError(
                    f"[Rank 0]: Rank 0 timed out in monitoredBarrier after {ms} ms; "
                    f"successfully processed ranks: {processed}"
                )
            try:
                w.wait(max(wait, 0.0))
                processed.append(r)
            except (DmlcError, concurrent.futures.TimeoutError) as e:
                if not wait_all_ranks:
                    raise RuntimeError(
                        f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms"
                    ) from e
                failed.append(r)
        if failed:
            raise RuntimeError(
                f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass "
                f"monitoredBarrier in {ms} ms"
            )
        token = torch.ones(1, dtype=torch.uint8)
        for r in range(1, size):
            # Bounded by the device's own timeout: the member is waiting.
            self.device.send(token, r, _MONITORED, comm=self.comm, async_op=True).wait()


_device: Device | None = None


def _create(opts: Any, backend_options: Any = None) -> BackendDmlc:
    """torch's creator (its extended API: `opts` is a
    ``_DistributedBackendOptions``), called on the members of the group
    only: one device per process, shared by every group on it; the group
    on communicator 0 if it is every rank in rank order, else on a
    communicator that its members create now."""
    global _device
    if _device is None:
        _device = Device.from_env()
    dev = _device
    rank, size = opts.group_rank, opts.group_size
    # [] for the default group, which is every rank.
    ranks = list(opts.global_ranks_in_group) or list(range(size))
    if not 0 <= rank < size == len(ranks) or not all(0 <= r < dev.world_size for r in ranks):
        raise RuntimeError(
            f"dmlc: a group of global ranks {ranks} with this process as its rank {rank} "
            f"does not fit the device's group of {dev.world_size}"
        )
    if ranks[rank] != dev.rank:
        raise RuntimeError(
            f"dmlc: this process is global rank {ranks[rank]} of torch but rank {dev.rank} of "
            "the device: the default group must be the device's group, in its rank order"
        )
    if ranks == list(range(dev.world_size)):
        return BackendDmlc(dev, rank, size, opts.timeout)
    if not dev.has_comms:
        raise RuntimeError(
            f"dmlc: the group of global ranks {ranks} needs the device's communicators (spec "
            "5.X.6.13), which this device does not offer (over the kernel transport or across "
            "hosts): only groups of every rank work on it"
        )
    comm = dev.comm_create(ranks, tag=group_tag(str(opts.group_id)))
    return BackendDmlc(dev, rank, size, opts.timeout, comm)


def recv_anysource(tensor: torch.Tensor, group: Any = None, tag: int = 0) -> int:
    """``dist.recv(tensor, src=None, group=group, tag=tag)`` on a "dmlc"
    group, returning the sender's global rank as torch's does.

    torch's own receives the message and then raises a RuntimeError
    ("sourceRank() may only be called on work objects that correspond to a
    recv or recv-from-any call"): it asks the Work for its source rank, and
    the wrapper torch puts around a Python backend's Work (PyWorkHolder,
    torch 2.15) forwards only ``wait()`` and ``get_future()``, so the
    backend cannot answer. This asks the backend's own Work.
    """
    pg = dist.group.WORLD if group is None else group
    if pg is None:
        raise RuntimeError("dmlc: recv_anysource before init_process_group")
    # On torch 2.6 the group is the backend itself (_backend_base).
    backend = pg if isinstance(pg, BackendDmlc) else pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, BackendDmlc):
        raise TypeError(
            f"dmlc: recv_anysource needs a group of backend dmlc, not {type(backend).__name__}"
        )
    # As dist.recv does: a complex tensor travels as its real view.
    t = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    source = backend.recv_anysource([t], tag)._source_rank()
    return dist.get_global_rank(pg, source)


def device() -> Device | None:
    """The device the backend opened in this process (None before any group):
    for its counters, such as ``staged_bytes``."""
    return _device


def register() -> None:
    """Registers backend "dmlc" with torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


register()
