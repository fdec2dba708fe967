"""One member's device: collectives on numpy arrays and torch tensors.

The device reads and writes only device-visible memory. Over the kernel
driver that is any of the process's memory (the module pins the pages of
each request), so every collective on contiguous arrays or tensors goes to
the device without a copy. Over the other transports an array or tensor
made by :meth:`Device.empty` lives there and goes without a copy; a
collective that touches anything else goes through the C library's host
forms (``dmlc_*_host``: its bounce buffer, counted in ``staged_bytes``), as
does one whose input and output overlap other than in the in-place form.
Requests on device memory are cut where the host forms cut theirs
(``dmlc_host_chunk_bytes``), so members that stage and members that do not
send the same requests. Calls run in order on one worker thread per device, so blocking
and asynchronous calls keep the order every member must issue them in, and
an asynchronous call leaves the caller's thread free (ctypes releases the
GIL while the C library waits).

Communicators (spec 5.X.6.13, where the device offers them: one host, not
the kernel transport): :meth:`Device.comm_split` and
:meth:`Device.comm_create` make a :class:`Comm`, which every collective
takes as ``comm=``; :meth:`Device.send` and :meth:`Device.recv` move one
message between two members; :meth:`Device.alltoall`, :meth:`Device.gather`,
:meth:`Device.scatter` and their ``v`` forms move blocks. They go to the
device without a copy on arrays from :meth:`Device.empty`, and through the C
library's staging buffer otherwise (counted in ``staged_bytes``), cut where
the C library cuts them. Sends run in order on a worker thread of their own,
receives on another, so a pending receive does not hold up a send (or a
collective) of the same process.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal, Optional, Union

import numpy as np

from . import _capi
from .errors import DmlcError, NonFiniteError, TruncatedError, error_for

__all__ = ["Comm", "Device", "Dtype", "Received", "ReduceOp", "Work"]


class Dtype(IntEnum):
    """Element types of the device (dmlc_dtype)."""

    F32 = 0
    F64 = 1
    F16 = 2
    BF16 = 3
    I8 = 4
    U8 = 5
    I32 = 6
    U32 = 7
    I64 = 8
    U64 = 9


class ReduceOp(IntEnum):
    """Reduce operations of the device (dmlc_op)."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7


_NUMPY_DTYPES: dict[np.dtype[Any], Dtype] = {
    np.dtype(np.float32): Dtype.F32,
    np.dtype(np.float64): Dtype.F64,
    np.dtype(np.float16): Dtype.F16,
    np.dtype(np.int8): Dtype.I8,
    np.dtype(np.uint8): Dtype.U8,
    np.dtype(np.int32): Dtype.I32,
    np.dtype(np.uint32): Dtype.U32,
    np.dtype(np.int64): Dtype.I64,
    np.dtype(np.uint64): Dtype.U64,
}

Op = Union[ReduceOp, str]
# A worker's jobs: a call and its future, or None to stop.
_Jobs = queue.SimpleQueue[Optional[tuple[Callable[[], Any], Future[Any]]]]
# How a wait spends its time, by the names every client uses (DMLC_POLL,
# the C ABI's DMLC_WAIT_*): "poll" busy-polls, "interrupt" sleeps on the
# interrupt at once, "hybrid" spins briefly first. None leaves the C
# library's default (dmlc_open_options_init: "hybrid"). True and False are the
# older spellings of "poll" and "interrupt".
WaitMode = Literal["poll", "interrupt", "hybrid"]
Wait = Union[WaitMode, bool]


def reduce_op(op: Op) -> ReduceOp:
    """`op` as a ReduceOp (a name such as "sum" is accepted)."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp[str(op).upper()]
    except KeyError:
        names = ", ".join(o.name.lower() for o in ReduceOp)
        raise ValueError(f"unknown reduce op {op!r}: expected one of {names}") from None


def allreduce_order(out: Any, op: Op, *, stacklevel: int) -> tuple[Any, Op]:
    """`(out, op)` of an allreduce, from a call in the older order
    ``allreduce(data, op)`` too (with a DeprecationWarning at the caller
    `stacklevel` frames up)."""
    if not isinstance(out, (ReduceOp, str)):
        return out, op
    warnings.warn(
        "allreduce(data, op) is deprecated: the order is allreduce(data, out, op) in every "
        "collective; pass op=... by name",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return None, out


def _torch() -> Any:
    import torch  # noqa: PLC0415 (torch is optional: imported only for tensors)

    return torch


_TORCH_DTYPES: dict[Any, Dtype] = {}


def _torch_dtypes() -> dict[Any, Dtype]:
    """torch's dtypes that the device has (built once torch is imported)."""
    if not _TORCH_DTYPES:
        torch = _torch()
        _TORCH_DTYPES.update(
            {
                torch.float32: Dtype.F32,
                torch.float64: Dtype.F64,
                torch.float16: Dtype.F16,
                torch.bfloat16: Dtype.BF16,
                torch.int8: Dtype.I8,
                torch.uint8: Dtype.U8,
                torch.int32: Dtype.I32,
                torch.uint32: Dtype.U32,
                torch.int64: Dtype.I64,
                torch.uint64: Dtype.U64,
            }
        )
    return _TORCH_DTYPES


def _is_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


_SIZES: dict[Dtype, int] = {
    Dtype.F64: 8,
    Dtype.I64: 8,
    Dtype.U64: 8,
    Dtype.F32: 4,
    Dtype.I32: 4,
    Dtype.U32: 4,
    Dtype.F16: 2,
    Dtype.BF16: 2,
    Dtype.I8: 1,
    Dtype.U8: 1,
}


def _size(dtype: Dtype) -> int:
    return _SIZES[dtype]


def memory(x: Any) -> tuple[int, int, Dtype]:
    """The address, byte length and dtype of `x`'s memory (no copy: the
    caller keeps `x` alive while the address is used).

    `x` is a C-contiguous numpy array or CPU torch tensor of a dtype the
    device has (torch's bfloat16 included: the device needs only the bytes).
    """
    if isinstance(x, np.ndarray):
        if x.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"dmlc has no element type for numpy {x.dtype}")
        if not x.flags.c_contiguous:
            raise ValueError("dmlc needs C-contiguous arrays (np.ascontiguousarray)")
        if not x.flags.writeable:
            raise ValueError("the array is read-only")
        return x.ctypes.data, x.nbytes, _NUMPY_DTYPES[x.dtype]
    if _is_tensor(x):
        dtype = _torch_dtypes().get(x.dtype)
        if dtype is None:
            raise TypeError(f"dmlc has no element type for {x.dtype}")
        if x.device.type != "cpu":
            raise ValueError(f"dmlc works on CPU tensors; this one is on {x.device}")
        if not x.is_contiguous():
            raise ValueError("dmlc needs contiguous tensors (call .contiguous() first)")
        return x.data_ptr(), x.numel() * _SIZES[dtype], dtype
    raise TypeError(f"expected a numpy array or a torch tensor, not {type(x).__name__}")


@dataclass(frozen=True)
class Comm:
    """A communicator (spec 5.X.6.13): an ordered subset of the group's
    members. ``id`` 0 is the whole group (:attr:`Device.world`); ``rank`` is
    this member's rank in it and ``size`` its number of members."""

    id: int
    rank: int
    size: int


@dataclass(frozen=True)
class Received:
    """What :meth:`Device.recv` got: the message's elements and bytes, and
    its sender's rank in the communicator."""

    count: int
    nbytes: int
    source: int


class Work:
    """An asynchronous collective: ``wait()`` returns its result or raises."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the collective completes; returns its output."""
        return self._future.result(timeout)

    def is_completed(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Future[Any]], None]) -> None:
        self._future.add_done_callback(fn)

    def exception(self) -> BaseException | None:
        """What the collective raised (None if it succeeded); blocks until it completes."""
        return self._future.exception()


# Devices not yet closed, closed at exit: a daemon worker still running a
# completion (torch's future callbacks, in C++) when the interpreter
# finalizes is ended by pthread_exit, and unwinding that through C++ aborts
# the process ("terminate called without an active exception").
_open_devices: weakref.WeakSet[Device] = weakref.WeakSet()


@atexit.register
def _close_open_devices() -> None:
    for dev in list(_open_devices):
        dev.close()


class Device:
    """One member's handle on a virtio-dmlc device.

    Open it with :meth:`open_host` (a host process playing a VM, over the
    backend's vhost-user socket), :meth:`open_pci` or :meth:`open_kernel`
    (inside a guest) or :meth:`from_env` (the job's environment). Collectives take numpy arrays
    or CPU torch tensors; ``in place`` unless an ``out`` is given.
    """

    _lib: ctypes.CDLL | None = None

    def __init__(self, handle: int, lib: ctypes.CDLL, *, wraps: bool = False) -> None:
        self._lib_ = lib
        # Over the kernel transport the device reaches any of this process's
        # memory (the module pins it per request): no staging copy.
        self._wraps = wraps
        # Wrappers of the caller's memory for the request in flight (input,
        # output): freed when it completes.
        self._wrapped: list[ctypes.c_void_p] = []
        #: Bytes of the caller's data that went through the C library's
        #: bounce buffer (each collective's input counted once): 0 while
        #: every collective reaches the caller's memory directly.
        self.staged_bytes = 0
        self._dev = ctypes.c_void_p(handle)
        cfg = _capi.Config()
        self._check(lib.dmlc_get_config(self._dev, ctypes.byref(cfg)))
        self.rank: int = cfg.rank
        self.world_size: int = cfg.world_size
        self.max_bytes: int = cfg.max_bytes
        self.group_id: int = cfg.group_id
        # Where the host forms cut a collective into requests: the direct
        # path cuts at the same places.
        self._host_chunk: int = lib.dmlc_host_chunk_bytes(self._dev)
        # Buffers behind the arrays of empty(): address -> (length, buffer).
        self._owned: dict[int, tuple[int, ctypes.c_void_p]] = {}
        self._owned_lock = threading.Lock()
        # One request at a time runs on the worker thread: its ctypes
        # arguments are made once and reused (building them costs more than
        # a small collective under TCG).
        self._req = _capi.Request(tag=0, timeout_ms=0)
        self._seg = _capi.Segment(offset=0)
        self._in_seg = _capi.Segment(offset=0)
        self._done = _capi.Completion()
        self._handle = ctypes.c_void_p()
        self._req_ref = ctypes.byref(self._req)
        self._seg_ref = ctypes.byref(self._seg)
        self._in_seg_ref = ctypes.byref(self._in_seg)
        self._done_ref = ctypes.byref(self._done)
        self._handle_ref = ctypes.byref(self._handle)
        #: Communicators (spec 5.X.6.13): the features the device offers and
        #: this device negotiated (``dmlc_comm_features``), and how many
        #: communicators may live at once (0 without them).
        self._features: int = lib.dmlc_comm_features(self._dev)
        self.max_comms: int = lib.dmlc_max_comms(self._dev)
        #: The whole group as a communicator.
        self.world = Comm(0, self.rank, self.world_size)
        self._stats_lock = threading.Lock()
        self._jobs: _Jobs = queue.SimpleQueue()
        self._worker = threading.Thread(
            target=self._serve, args=(self._jobs,), name="dmlc-device", daemon=True
        )
        self._worker.start()
        # Sends and receives: a worker thread each, started at first use.
        self._lanes: dict[str, tuple[_Jobs, threading.Thread]] = {}
        self._lanes_lock = threading.Lock()
        self._closed = False
        _open_devices.add(self)

    @property
    def wait_mode(self) -> WaitMode:
        """How waits spend their time on this device: "poll", "interrupt" or
        "hybrid" (a hybrid wait polls where there is no interrupt to sleep on)."""
        code = self._lib_.dmlc_wait_mode(self._dev)
        names: dict[int, WaitMode] = {
            _capi.WAIT_POLL: "poll",
            _capi.WAIT_INTERRUPT: "interrupt",
            _capi.WAIT_HYBRID: "hybrid",
        }
        return names[code]

    @property
    def has_comms(self) -> bool:
        """True if communicators work (comm_split, comm_create, comm_free,
        and ``comm=`` on every collective)."""
        return bool(self._features & _capi.FEATURE_COMM)

    @property
    def has_p2p(self) -> bool:
        """True if send and recv work."""
        return bool(self._features & _capi.FEATURE_P2P)

    @property
    def has_blocks(self) -> bool:
        """True if alltoall, gather, scatter and their v forms work."""
        return bool(self._features & _capi.FEATURE_BLOCKS)

    @property
    def reaches_any_memory(self) -> bool:
        """True over the kernel transport, where collectives on any
        contiguous array or tensor go to the device without a copy; False
        where only arrays from :meth:`empty` do."""
        return self._wraps

    # ---- opening ----------------------------------------------------------

    @classmethod
    def library(cls) -> ctypes.CDLL:
        if cls._lib is None:
            cls._lib = _capi.load()
        return cls._lib

    @classmethod
    def _options(cls, poll: Wait | None, dma_bytes: int | None) -> _capi.OpenOptions:
        opts = _capi.OpenOptions()
        cls.library().dmlc_open_options_init(ctypes.byref(opts))
        if poll is not None:
            name = ("poll" if poll else "interrupt") if isinstance(poll, bool) else poll
            if name not in _capi.WAIT_CODES:
                raise ValueError(f"poll={poll!r}: expected 'poll', 'interrupt' or 'hybrid'")
            opts.poll = _capi.WAIT_CODES[name]
        if dma_bytes is not None:
            opts.dma_bytes = dma_bytes
        return opts

    @classmethod
    def _open(
        cls,
        opener: str,
        where: bytes | None,
        poll: Wait | None,
        dma_bytes: int | None,
        check_finite: bool = False,
    ) -> Device:
        """Calls the C ABI's ``opener(where, options, &device)``."""
        lib = cls.library()
        out = ctypes.c_void_p()
        opts = cls._options(poll, dma_bytes)
        rc = getattr(lib, opener)(where, ctypes.byref(opts), ctypes.byref(out))
        _raise_if(lib, rc)
        dev = cls(out.value or 0, lib, wraps=opener == "dmlc_open_kernel")
        if check_finite:
            try:
                dev.set_check_finite(True)
            except BaseException:
                dev.close()
                raise
        return dev

    @classmethod
    def open_host(
        cls,
        socket: str | os.PathLike[str],
        *,
        poll: Wait | None = None,
        dma_bytes: int | None = None,
        check_finite: bool = False,
    ) -> Device:
        """The device served by the backend at `socket` (this process plays
        the VM); `check_finite`: see :meth:`set_check_finite`."""
        return cls._open("dmlc_open_host_ex", os.fsencode(socket), poll, dma_bytes, check_finite)

    @classmethod
    def open_pci(
        cls,
        addr: str | None = None,
        *,
        poll: Wait | None = None,
        dma_bytes: int | None = None,
        check_finite: bool = False,
    ) -> Device:
        """The PCI device from inside a guest (root and hugepages needed)."""
        where = addr.encode() if addr else None
        return cls._open("dmlc_open_pci", where, poll, dma_bytes, check_finite)

    @classmethod
    def open_kernel(
        cls, node: str | None = None, *, poll: Wait | None = None, dma_bytes: int | None = None
    ) -> Device:
        """The device through the virtio_dmlc kernel module's node (no root needed)."""
        return cls._open("dmlc_open_kernel", os.fsencode(node) if node else None, poll, dma_bytes)

    def set_check_finite(self, on: bool = True) -> None:
        """Turns the check of non-finite inputs (spec 5.X.6.14) on or off for
        the later collectives: a floating-point allreduce, reduce or
        reduce-scatter whose input holds a NaN or an infinity on any member
        then raises :class:`dmlc.NonFiniteError` naming the lowest such rank
        and element, on every member; its output holds the reduction all the
        same. ``DMLC_CHECK_FINITE=1`` turns it on in :meth:`from_env` (and so
        under the torch backend). Raises :class:`dmlc.DmlcError` where the
        device lacks it (a group across hosts, the kernel driver)."""
        self._check(self._lib_.dmlc_set_check_finite(self._dev, 1 if on else 0))

    def set_tag(self, tag: int) -> None:
        """Tags the later collectives with `tag` (0: none), e.g. the training
        step, which ``dmlc-ctl freeze --tag`` can name (docs/debugging.md).
        Every member must set the same tag for a collective (the device
        compares it: :class:`dmlc.MismatchError` otherwise); sends, receives
        and :meth:`comm_create` keep their own tag. Under the torch backend:
        ``dmlc.torch_backend.device().set_tag(step)``."""
        if not 0 <= tag < 1 << 64:
            raise ValueError(f"tag must be 0 to 2**64-1, not {tag}")
        # On the worker thread, in order with the collectives queued before
        # it (an async collective of the previous step keeps its tag).
        self._call(lambda: self._check(self._lib_.dmlc_set_tag(self._dev, tag)), False)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Device:
        """Opens the device the job's environment names, and checks the rank.

        ``DMLC_SOCKET`` (a backend socket; or ``DMLC_SOCKET_PREFIX`` plus the
        rank), ``DMLC_DEVICE=pci[:ADDR]`` or ``DMLC_DEVICE=kernel[:NODE]``;
        ``DMLC_POLL=hybrid`` (the default) spins up to 200 us before it
        sleeps, ``poll`` (or ``1``) polls, ``interrupt`` (or ``0``) sleeps on
        the interrupt at once;
        ``DMLC_DMA_BYTES`` sizes the device memory; ``DMLC_CHECK_FINITE=1``
        turns on :meth:`set_check_finite`. A rank given by the
        launcher (``DMLC_TASK_ID``, ``DMLC_NUM_WORKER``) or torchrun
        (``RANK``, ``WORLD_SIZE``) must match the device's. The C library
        reads all of it (``dmlc_open_env``), as the rabit API and XGBoost's
        device path do, so every client reads one environment one way; a
        setting that cannot work raises :class:`dmlc.EnvironmentSettingError`
        (a ValueError). `env` replaces the process environment.
        """
        lib = cls.library()
        out = ctypes.c_void_p()
        if env is None:
            rc = lib.dmlc_open_env(None, ctypes.byref(out))
        else:
            entries = [f"{k}={v}".encode() for k, v in env.items()]
            array = (ctypes.c_char_p * (len(entries) + 1))(*entries, None)
            rc = lib.dmlc_open_env(array, ctypes.byref(out))
        _raise_if(lib, rc)
        return cls(out.value or 0, lib, wraps=lib.dmlc_reaches_any_memory(out) == 1)

    def close(self) -> None:
        """Finishes the queued collectives and closes the device."""
        if self._closed:
            return
        self._closed = True
        with self._lanes_lock:
            workers = [(self._jobs, self._worker), *self._lanes.values()]
        for jobs, _ in workers:
            jobs.put(None)
        for _, worker in workers:
            worker.join()
        self._lib_.dmlc_close(self._dev)

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (nothing to report to at exit)
            pass

    # ---- device memory --------------------------------------------------------

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> Any:
        """An uninitialized array in device-visible memory: in-place
        collectives on it (or on a contiguous slice of it) need no copy.

        `dtype` is a numpy dtype (a numpy array comes back) or a torch dtype
        (a CPU tensor). The memory is freed when the last view of it is
        gone, and may outlive :meth:`close`.
        """
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(dims, dtype=np.int64))
        torch_dtype = dtype if type(dtype).__module__.startswith("torch") else None
        if torch_dtype is not None:
            device_dtype = _torch_dtypes().get(torch_dtype)
            if device_dtype is None:
                raise TypeError(f"dmlc has no element type for {torch_dtype}")
            nbytes = count * _SIZES[device_dtype]
        else:
            np_dtype = np.dtype(dtype)
            if np_dtype not in _NUMPY_DTYPES:
                raise TypeError(f"dmlc has no element type for numpy {np_dtype}")
            nbytes = count * np_dtype.itemsize
        lib = self._lib_
        buf = ctypes.c_void_p()
        self._check(lib.dmlc_alloc(self._dev, max(nbytes, 1), ctypes.byref(buf)))
        addr = lib.dmlc_buffer_data(buf)
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(addr)
        with self._owned_lock:
            self._owned[addr] = (nbytes, buf)
        # Every view keeps `raw` alive; when the last one is gone, the
        # buffer goes back to the device.
        weakref.finalize(raw, self._release, addr, buf)
        if torch_dtype is None:
            return np.frombuffer(raw, dtype=np_dtype, count=count).reshape(dims)
        if not count:  # torch.frombuffer refuses an empty view
            return _torch().empty(dims, dtype=torch_dtype)
        return _torch().frombuffer(raw, dtype=torch_dtype, count=count).reshape(dims)

    def _release(self, addr: int, buf: ctypes.c_void_p) -> None:
        with self._owned_lock:
            self._owned.pop(addr, None)
        self._lib_.dmlc_free(buf)

    def _device_memory(self, addr: int, nbytes: int) -> tuple[ctypes.c_void_p, int] | None:
        """The buffer and offset of [addr, addr + nbytes) if empty() made it."""
        if not nbytes:
            return None
        with self._owned_lock:
            for start, (length, buf) in self._owned.items():
                if start <= addr and addr + nbytes <= start + length:
                    return buf, addr - start
        return None

    # ---- collectives --------------------------------------------------------

    def allreduce(
        self,
        data: Any,
        out: Any = None,
        op: Op = ReduceOp.SUM,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """Element-wise reduction over the members, in rank order.

        In place on `data` unless `out` (same shape and dtype) is given.
        Arguments come in one order in every collective: the data, the
        output, the op, the root (as in the C ABI). The older
        ``allreduce(data, op)`` still works, with a DeprecationWarning.
        ``comm`` (every collective takes it) runs it among the members of
        that communicator, the whole group by default.
        """
        out, op = allreduce_order(out, op, stacklevel=3)
        rop = reduce_op(op)
        c = self._comm(comm)

        def run() -> Any:
            src, n, dtype = memory(data)
            dst = src if out is None else self._same(out, n, dtype)
            in_place = dst == src
            if self._direct_pair(src, n, dst, n, in_place):
                self._run_pieces(_capi.ALLREDUCE, dtype, rop, 0, n, in_place, c.id)
                return data if out is None else out
            self._staged(n)
            if not in_place and src < dst + n and dst < src + n:
                # Overlapping buffers (not the in-place form): the host form
                # wants them apart, so the input goes to the output first.
                ctypes.memmove(dst, src, n)
                in_place = True
            self._host(
                self._lib_.dmlc_allreduce_host_comm(
                    self._dev, c.id, None if in_place else src, dst, n // _SIZES[dtype], dtype, rop
                )
            )
            return data if out is None else out

        return self._call(run, async_op)

    def broadcast(
        self, data: Any, root: int = 0, *, comm: Comm | None = None, async_op: bool = False
    ) -> Any:
        """Every member's `data` gets the root's."""
        c = self._comm(comm)
        self._check_root(root, c)

        def run() -> Any:
            buf, n, dtype = memory(data)
            if self._direct(buf, n, self._seg):
                self._run_pieces(_capi.BROADCAST, dtype, ReduceOp.SUM, root, n, True, c.id)
                return data
            self._staged(n)
            self._host(
                self._lib_.dmlc_broadcast_host_comm(
                    self._dev, c.id, buf, n // _SIZES[dtype], dtype, root
                )
            )
            return data

        return self._call(run, async_op)

    def reduce(
        self,
        data: Any,
        op: Op = ReduceOp.SUM,
        root: int = 0,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """The root's `data` becomes the reduction; the others' is unchanged."""
        c = self._comm(comm)
        self._check_root(root, c)
        rop = reduce_op(op)

        def run() -> Any:
            buf, n, dtype = memory(data)
            # In place, a non-root member's buffer is only read.
            if self._direct(buf, n, self._seg):
                self._run_pieces(_capi.REDUCE, dtype, rop, root, n, True, c.id)
                return data
            self._staged(n)
            self._host(
                self._lib_.dmlc_reduce_host_comm(
                    self._dev, c.id, buf, n // _SIZES[dtype], dtype, rop, root
                )
            )
            return data

        return self._call(run, async_op)

    def allgather(
        self, data: Any, out: Any, *, comm: Comm | None = None, async_op: bool = False
    ) -> Any:
        """`out` (size times `data`'s size) gets every member's `data` in rank order."""
        c = self._comm(comm)

        def run() -> Any:
            src, n, dtype = memory(data)
            dst, total, odtype = memory(out)
            if odtype != dtype or total != n * c.size:
                raise ValueError(f"allgather output must hold {c.size} x {n} bytes of {dtype.name}")
            # `data` as block `rank` of `out` is the in-place form.
            in_place = src == dst + c.rank * n
            if n <= self._block_piece(dtype, c.size) and self._direct_pair(
                src, n, dst, total, in_place
            ):
                self._run_direct(
                    _capi.ALLGATHER, dtype, ReduceOp.SUM, n, total, 0 if in_place else n, c.id
                )
                return out
            self._staged(total)
            send, kept = src, None
            if src < dst + total and dst < src + n:
                # The host form reads its input apart from the output.
                kept = ctypes.create_string_buffer(n)
                ctypes.memmove(kept, src, n)
                send = ctypes.addressof(kept)
            self._host(
                self._lib_.dmlc_allgather_host_comm(
                    self._dev, c.id, send, dst, n // _SIZES[dtype], dtype
                )
            )
            return out

        return self._call(run, async_op)

    def reduce_scatter(
        self,
        data: Any,
        out: Any,
        op: Op = ReduceOp.SUM,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """`out` gets block `rank` of the reduction of every member's `data`."""
        rop = reduce_op(op)
        c = self._comm(comm)

        def run() -> Any:
            src, total, dtype = memory(data)
            dst, n, odtype = memory(out)
            if odtype != dtype or total != n * c.size:
                raise ValueError(
                    f"reduce_scatter input must hold {c.size} x {n} bytes of {dtype.name}"
                )
            # `out` as block `rank` of `data` is the in-place form, whose one
            # buffer is `data`.
            in_place = dst == src + c.rank * n
            out_addr, out_bytes = (src, total) if in_place else (dst, n)
            if n <= self._block_piece(dtype, c.size) and self._direct_pair(
                src, total, out_addr, out_bytes, in_place
            ):
                self._run_direct(
                    _capi.REDUCE_SCATTER, dtype, rop, n, out_bytes, 0 if in_place else total, c.id
                )
                return out
            self._staged(total)
            recv, result = dst, None
            if dst < src + total and src < dst + n:
                # The host form writes its output apart from the input.
                result = ctypes.create_string_buffer(n)
                recv = ctypes.addressof(result)
            self._host(
                self._lib_.dmlc_reduce_scatter_host_comm(
                    self._dev, c.id, src, recv, n // _SIZES[dtype], dtype, rop
                )
            )
            if result is not None:
                ctypes.memmove(dst, result, n)
            return out

        return self._call(run, async_op)

    def barrier(self, *, comm: Comm | None = None, async_op: bool = False) -> Any:
        """Returns once every member (of `comm`) has called it."""
        c = self._comm(comm)
        return self._call(
            lambda: self._run(_capi.BARRIER, Dtype.U8, ReduceOp.SUM, 0, 0, 0, comm=c.id), async_op
        )

    # ---- communicators (spec 5.X.6.13) ----------------------------------------

    def comm_split(
        self, color: int | None, key: int = 0, *, comm: Comm | None = None
    ) -> Comm | None:
        """Collective over `comm` (the group by default): the members that
        give one color form a new communicator, ranked by `key`, then by
        their rank in `comm`. Returns this member's :class:`Comm`, or None
        for `color` None (it joins none)."""
        c = self._comm(comm)
        raw = _capi.UNDEFINED if color is None else color
        if not 0 <= raw <= _capi.UNDEFINED or not 0 <= key < 1 << 32:
            raise ValueError(f"color {color} and key {key} must be 32-bit numbers")

        def run() -> Comm | None:
            info = _capi.CommInfo()
            self._check(self._lib_.dmlc_comm_split(self._dev, c.id, raw, key, ctypes.byref(info)))
            return Comm(info.id, info.rank, info.size) if info.id else None

        return self._call(run, False)

    def comm_create(self, ranks: Sequence[int], tag: int = 0, *, comm: Comm | None = None) -> Comm:
        """A communicator of `ranks` (ranks of `comm`, in the new one's
        order, this member among them), called by those members only; `tag`
        tells apart creations that run at once."""
        c = self._comm(comm)
        listed = [int(r) for r in ranks]
        if c.rank not in listed or len(set(listed)) != len(listed):
            raise ValueError(f"comm_create: {listed} must be distinct ranks including {c.rank}")
        for r in listed:
            self._check_root(r, c, "rank")

        def run() -> Comm:
            info = _capi.CommInfo()
            arr = (ctypes.c_uint32 * len(listed))(*listed)
            self._check(
                self._lib_.dmlc_comm_create(
                    self._dev, c.id, arr, len(listed), tag, ctypes.byref(info)
                )
            )
            return Comm(info.id, info.rank, info.size)

        return self._call(run, False)

    def comm_free(self, comm: Comm) -> None:
        """Frees `comm`, collectively over its members."""
        c = self._comm(comm)
        self._call(lambda: self._check(self._lib_.dmlc_comm_free(self._dev, c.id)), False)

    def send(
        self,
        data: Any,
        dst: int,
        tag: int = 0,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """Sends `data` to rank `dst` of `comm`, matched by `tag`; returns
        (or the Work completes) once the receiver has it. A message larger
        than the device's max_bytes goes as several, which the receive
        takes only if its `out` has the message's size."""
        c = self._comm(comm)
        self._check_peer(dst, c)

        def run() -> Any:
            src, n, dtype = memory(data)
            size = _SIZES[dtype]
            segs = self._device_seg(src, n) if n <= self._message_piece(dtype) else None
            if segs is not None:
                req = _comm_request(_capi.SEND, dtype, c.id, n // size, peer=dst, tag=tag)
                self._comm_call(req, segs, [], message=n)
                return data
            self._staged(n)
            rc = self._lib_.dmlc_send(self._dev, c.id, dst, tag, dtype, src, n // size)
            if rc != _capi.OK:
                raise self._host_error(rc, length=n, room=self._lib_.dmlc_last_error_length())
            return data

        return self._call(run, async_op, "send")

    def recv(
        self,
        out: Any,
        src: int | None = None,
        tag: int = 0,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """Receives one message from rank `src` of `comm` (None: from any)
        with `tag` into `out`; a shorter message leaves the rest of `out` as
        it was. Returns :class:`Received` (its count, bytes and sender).
        A larger message raises :class:`dmlc.TruncatedError`."""
        c = self._comm(comm)
        peer = _capi.ANY_SOURCE if src is None else src
        if src is not None:
            self._check_peer(src, c)

        def run() -> Received:
            dst, n, dtype = memory(out)
            size = _SIZES[dtype]
            segs = self._device_seg(dst, n) if n <= self._message_piece(dtype) else None
            if segs is not None:
                req = _comm_request(_capi.RECV, dtype, c.id, n // size, peer=peer, tag=tag)
                done = self._comm_call(req, [], segs, room=n)
                return Received(done.length // size, done.length, done.peer)
            length, source = ctypes.c_uint64(), ctypes.c_uint32()
            rc = self._lib_.dmlc_recv(
                self._dev,
                c.id,
                peer,
                tag,
                dtype,
                dst,
                n // size,
                ctypes.byref(length),
                ctypes.byref(source),
            )
            if rc != _capi.OK:
                raise self._host_error(rc, length=length.value, room=n)
            self._staged(length.value)
            return Received(length.value // size, length.value, source.value)

        return self._call(run, async_op, "recv")

    def alltoall(
        self, data: Any, out: Any, *, comm: Comm | None = None, async_op: bool = False
    ) -> Any:
        """Block `j` of `data` (`comm`'s size equal blocks) goes to member
        `j`, whose `out` (as large) gets every member's block in rank order."""
        c = self._comm(comm)

        def run() -> Any:
            src, total, dtype = memory(data)
            dst, ototal, odtype = memory(out)
            size = _SIZES[dtype]
            if odtype != dtype or ototal != total or total % (c.size * size):
                raise ValueError(
                    f"alltoall input and output must hold {c.size} equal blocks of {dtype.name}"
                )
            block = total // c.size
            if block <= self._block_piece(dtype, c.size) and not _overlap(src, total, dst, total):
                ins, outs = self._device_segs((src, total)), self._device_segs((dst, total))
                if ins is not None and outs is not None:
                    self._comm_call(
                        _comm_request(_capi.ALLTOALL, dtype, c.id, block // size), ins, outs
                    )
                    return out
            self._staged(total)
            send, _kept = _apart(src, total, dst, total)
            self._host(self._lib_.dmlc_alltoall(self._dev, c.id, send, dst, block // size, dtype))
            return out

        return self._call(run, async_op)

    def alltoallv(
        self,
        data: Any,
        out: Any,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """As :meth:`alltoall` with ``send_counts[j]`` elements of `data` to
        member `j` and ``recv_counts[i]`` into `out` from member `i`, blocks
        one after the other in rank order (member `i`'s ``send_counts[j]``
        must equal member `j`'s ``recv_counts[i]``). One request: each
        member's data must fit the device's max_bytes."""
        c = self._comm(comm)
        sc, rc = self._counts(send_counts, c), self._counts(recv_counts, c)

        def run() -> Any:
            src, total, dtype = memory(data)
            dst, ototal, odtype = memory(out)
            size = _SIZES[dtype]
            if odtype != dtype or total != sum(sc) * size or ototal != sum(rc) * size:
                raise ValueError(
                    f"alltoallv: data must hold sum(send_counts) and out sum(recv_counts) "
                    f"elements of {dtype.name}"
                )
            table = np.array(sc + rc, dtype="<u8")
            if not _overlap(src, total, dst, ototal):
                ins, outs = self._device_segs((src, total)), self._device_segs((dst, ototal))
                if ins is not None and outs is not None:
                    req = _comm_request(_capi.ALLTOALLV, dtype, c.id, 0, table=table)
                    self._comm_call(req, ins, outs)
                    return out
            self._staged(total)
            send, _kept = _apart(src, total, dst, ototal)
            self._host(
                self._lib_.dmlc_alltoallv(self._dev, c.id, send, dst, _u64s(sc), _u64s(rc), dtype)
            )
            return out

        return self._call(run, async_op)

    def gather(
        self,
        data: Any,
        out: Any = None,
        root: int = 0,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """The root's `out` (`comm`'s size times `data`) gets every member's
        `data` in rank order; the others pass no `out`. `data` may be the
        root's own block of `out` (in place). Returns `out` on the root,
        None elsewhere."""
        c = self._comm(comm)
        self._check_root(root, c)
        return self._call(lambda: self._gather(data, out, False, None, root, c), async_op)

    def gatherv(
        self,
        data: Any,
        out: Any = None,
        counts: Sequence[int] | None = None,
        root: int = 0,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """As :meth:`gather`, each member giving its own number of elements:
        the root's `counts` (one per member) place the blocks in its `out`.
        One request."""
        c = self._comm(comm)
        self._check_root(root, c)
        table = None
        if c.rank == root:
            if counts is None:
                raise ValueError("the root of gatherv needs counts")
            table = self._counts(counts, c)
        return self._call(lambda: self._gather(data, out, True, table, root, c), async_op)

    def scatter(
        self,
        data: Any,
        out: Any,
        root: int = 0,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """Every member's `out` gets its block of the root's `data`
        (`comm`'s size times `out`); the others pass None as `data`. `out`
        may be the root's own block of `data` (in place). Returns `out`."""
        c = self._comm(comm)
        self._check_root(root, c)
        return self._call(lambda: self._scatter(data, out, False, None, root, c), async_op)

    def scatterv(
        self,
        data: Any,
        out: Any,
        counts: Sequence[int] | None = None,
        root: int = 0,
        *,
        comm: Comm | None = None,
        async_op: bool = False,
    ) -> Any:
        """As :meth:`scatter`, each member receiving its own number of
        elements (its `out`): the root's `counts` (one per member) place
        the blocks in its `data`. One request."""
        c = self._comm(comm)
        self._check_root(root, c)
        table = None
        if c.rank == root:
            if counts is None:
                raise ValueError("the root of scatterv needs counts")
            table = self._counts(counts, c)
        return self._call(lambda: self._scatter(data, out, True, table, root, c), async_op)

    def _gather(
        self, data: Any, out: Any, v: bool, table: list[int] | None, root: int, c: Comm
    ) -> Any:
        """gather, or gatherv (`v`; `table` the root's counts), on the
        worker thread."""
        src, n, dtype = memory(data)
        size = _SIZES[dtype]
        is_root = c.rank == root
        dst, total, in_place = 0, 0, False
        if is_root:
            if out is None:
                raise ValueError("the root of a gather needs out")
            dst, total, odtype = memory(out)
            at = sum(table[: c.rank]) * size if table is not None else c.rank * n
            want = sum(table) * size if table is not None else c.size * n
            if odtype != dtype or total != want:
                raise ValueError(f"gather: out must hold {want} bytes of {dtype.name}")
            if table is not None and table[c.rank] * size != n:
                raise ValueError(f"gatherv: counts[{c.rank}] is not the size of data")
            # `data` as the root's block of `out` is the in-place form.
            in_place = src == dst + at
        # Equal blocks above one piece go through the host form on every
        # member, which cuts them alike; the v forms are one request.
        if (v or n <= self._block_piece(dtype, c.size)) and (
            in_place or not _overlap(src, n, dst, total)
        ):
            ins = [] if in_place else self._device_segs((src, n))
            outs = self._device_segs((dst, total)) if is_root else []
            if ins is not None and outs is not None:
                opcode = _capi.GATHERV if v else _capi.GATHER
                req = _comm_request(opcode, dtype, c.id, n // size, root=root, table=table)
                req.flags = _capi.FLAG_IN_PLACE if in_place else 0
                self._comm_call(req, ins, outs)
                return out if is_root else None
        self._staged(total if is_root else n)
        send, _kept = (None, None) if in_place else _apart(src, n, dst, total)
        lib = self._lib_
        if v:
            counts = _u64s(table) if table is not None else None
            rc = lib.dmlc_gatherv(
                self._dev, c.id, send, dst or None, n // size, counts, dtype, root
            )
        else:
            rc = lib.dmlc_gather(self._dev, c.id, send, dst or None, n // size, dtype, root)
        self._host(rc)
        return out if is_root else None

    def _scatter(
        self, data: Any, out: Any, v: bool, table: list[int] | None, root: int, c: Comm
    ) -> Any:
        """scatter, or scatterv (`v`; `table` the root's counts), on the
        worker thread."""
        dst, n, dtype = memory(out)
        size = _SIZES[dtype]
        is_root = c.rank == root
        src, total, in_place = 0, 0, False
        if is_root:
            if data is None:
                raise ValueError("the root of a scatter needs data")
            src, total, idtype = memory(data)
            at = sum(table[: c.rank]) * size if table is not None else c.rank * n
            want = sum(table) * size if table is not None else c.size * n
            if idtype != dtype or total != want:
                raise ValueError(f"scatter: data must hold {want} bytes of {dtype.name}")
            if table is not None and table[c.rank] * size != n:
                raise ValueError(f"scatterv: counts[{c.rank}] is not the size of out")
            # `out` as the root's block of `data` is the in-place form.
            in_place = dst == src + at
        if (v or n <= self._block_piece(dtype, c.size)) and (
            in_place or not _overlap(src, total, dst, n)
        ):
            ins: list[_capi.Segment] | None
            if in_place:
                ins, outs = [], self._device_segs((src, total))
            else:
                ins = self._device_segs((src, total)) if is_root else []
                outs = self._device_segs((dst, n))
            if ins is not None and outs is not None:
                opcode = _capi.SCATTERV if v else _capi.SCATTER
                req = _comm_request(opcode, dtype, c.id, n // size, root=root, table=table)
                req.flags = _capi.FLAG_IN_PLACE if in_place else 0
                self._comm_call(req, ins, outs)
                return out
        self._staged(total if is_root else n)
        # In place, the root's block stays where it is: no recv.
        recv = None if in_place else dst
        result = None
        if recv is not None and _overlap(src, total, dst, n):
            result = ctypes.create_string_buffer(n)
            recv = ctypes.addressof(result)
        lib = self._lib_
        if v:
            counts = _u64s(table) if table is not None else None
            rc = lib.dmlc_scatterv(
                self._dev, c.id, src or None, recv, counts, n // size, dtype, root
            )
        else:
            rc = lib.dmlc_scatter(self._dev, c.id, src or None, recv, n // size, dtype, root)
        self._host(rc)
        if result is not None:
            ctypes.memmove(dst, result, n)
        return out

    # ---- plumbing -----------------------------------------------------------

    def _call(self, fn: Callable[[], Any], async_op: bool, lane: str = "") -> Any:
        """Runs `fn` on the worker thread (`lane` "send" or "recv": on that
        lane's own worker); waits for it unless `async_op`."""
        if self._closed:
            raise DmlcError(_capi.ERR_INVALID_ARGUMENT, "the device is closed")
        fut: Future[Any] = Future()
        (self._lane(lane) if lane else self._jobs).put((fn, fut))
        work = Work(fut)
        return work if async_op else work.wait()

    def _lane(self, name: str) -> _Jobs:
        """The jobs of lane `name`, its worker started at first use."""
        with self._lanes_lock:
            if name not in self._lanes:
                jobs: _Jobs = queue.SimpleQueue()
                worker = threading.Thread(
                    target=self._serve, args=(jobs,), name=f"dmlc-{name}", daemon=True
                )
                worker.start()
                self._lanes[name] = (jobs, worker)
            return self._lanes[name][0]

    def _serve(self, jobs: _Jobs) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                fut.set_exception(e)

    def _check(self, rc: int) -> None:
        _raise_if(self._lib_, rc)

    def _comm(self, comm: Comm | None) -> Comm:
        """`comm`, the group if None."""
        if comm is None:
            return self.world
        if not isinstance(comm, Comm):
            raise TypeError(f"comm must be a dmlc.Comm, not {type(comm).__name__}")
        return comm

    @staticmethod
    def _check_root(root: int, c: Comm, what: str = "root") -> None:
        if not 0 <= root < c.size:
            where = "the group" if c.id == 0 else f"communicator {c.id}"
            raise ValueError(f"{what} {root} is not a rank of {where} of {c.size}")

    def _check_peer(self, peer: int, c: Comm) -> None:
        self._check_root(peer, c, "peer")
        if peer == c.rank:
            raise ValueError(f"peer {peer} is this member itself")

    @staticmethod
    def _counts(counts: Sequence[int], c: Comm) -> list[int]:
        """`counts` as a list of one count per member of `c`."""
        listed = [int(x) for x in counts]
        if len(listed) != c.size or any(x < 0 for x in listed):
            raise ValueError(f"{len(listed)} counts for a communicator of {c.size}: {listed}")
        return listed

    def _staged(self, nbytes: int) -> None:
        with self._stats_lock:
            self.staged_bytes += nbytes

    def _message_piece(self, dtype: Dtype) -> int:
        """Bytes of one message of send and receive: max_bytes rounded down
        to whole elements; a larger one goes through the host form, which
        cuts it into such pieces."""
        size = _SIZES[dtype]
        return max(size, self.max_bytes - self.max_bytes % size)

    def _device_segs(self, *spans: tuple[int, int]) -> list[_capi.Segment] | None:
        """Segments over `spans` (address, bytes) if empty() made them all
        (the empty ones left out); None if any must be staged."""
        segs = []
        for addr, nbytes in spans:
            if not nbytes:
                continue
            found = self._device_memory(addr, nbytes)
            if found is None:
                return None
            segs.append(_capi.Segment(buf=found[0], offset=found[1], len=nbytes))
        return segs

    def _device_seg(self, addr: int, nbytes: int) -> list[_capi.Segment] | None:
        """`_device_segs` of one span, which must not be empty."""
        return self._device_segs((addr, nbytes)) if nbytes else None

    def _comm_call(
        self,
        req: _capi.CommRequest,
        ins: list[_capi.Segment],
        outs: list[_capi.Segment],
        *,
        message: int | None = None,
        room: int | None = None,
    ) -> _capi.CommCompletion:
        """One request of spec 5.X.6.13 on device memory (dmlc_comm_call);
        raises its error (TRUNCATE: with the send's `message` or the
        receive's `room`, and the other end's from the device)."""
        done = _capi.CommCompletion()
        in_arr = (_capi.Segment * len(ins))(*ins) if ins else None
        out_arr = (_capi.Segment * len(outs))(*outs) if outs else None
        lib = self._lib_
        rc = lib.dmlc_comm_call(
            self._dev,
            0,
            ctypes.byref(req),
            in_arr,
            len(ins),
            out_arr,
            len(outs),
            ctypes.byref(done),
        )
        if rc != _capi.OK:
            msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
            peer = None if done.peer == _capi.NO_PEER else done.peer
            if rc == _capi.ERR_TRUNCATE:
                length, room = (
                    (message, done.length) if message is not None else (done.length, room)
                )
                raise TruncatedError(
                    rc, msg or _strerror(lib, rc), done.detail, peer, length=length, room=room
                )
            raise error_for(rc, msg or _strerror(lib, rc), done.detail, peer, length=done.length)
        return done

    def _host_error(self, rc: int, *, length: int, room: int) -> DmlcError:
        """The error of a failed dmlc_send or dmlc_recv: TRUNCATE with the
        message's `length` and the receive's `room`."""
        lib = self._lib_
        msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
        why = _capi.Completion()
        lib.dmlc_last_error_completion(ctypes.byref(why))
        peer = None if why.peer == _capi.NO_PEER else why.peer
        if rc == _capi.ERR_TRUNCATE:
            return TruncatedError(
                rc, msg or _strerror(lib, rc), why.detail, peer, length=length, room=room
            )
        return error_for(rc, msg or _strerror(lib, rc), why.detail, peer)

    @staticmethod
    def _same(out: Any, nbytes: int, dtype: Dtype) -> int:
        dst, n, odtype = memory(out)
        if odtype != dtype or n != nbytes:
            raise ValueError("out must have the input's size and dtype")
        return dst

    def _block_piece(self, dtype: Dtype, members: int) -> int:
        """The most bytes per member that the host forms of allgather,
        reduce-scatter, all-to-all, gather and scatter carry in one request
        among `members`: a larger block goes through them, so that every
        member cuts it at the same places."""
        size = _SIZES[dtype]
        return max(1, self._host_chunk // members // size) * size

    def _host(self, rc: int) -> None:
        """Raises the error of a failed host form, with the device's detail
        and peer of the request that failed."""
        if rc != _capi.OK:
            lib = self._lib_
            msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
            why = _capi.Completion()
            lib.dmlc_last_error_completion(ctypes.byref(why))
            peer = None if why.peer == _capi.NO_PEER else why.peer
            length = lib.dmlc_last_error_length()
            raise error_for(rc, msg or _strerror(lib, rc), why.detail, peer, length=length)

    def _direct(self, addr: int, nbytes: int, seg: _capi.Segment) -> bool:
        """Points `seg` at the caller's memory if the device can reach it:
        device memory (from empty()), or any memory over the kernel
        transport (wrapped until `_run` returns); False if it must be staged."""
        found = self._device_memory(addr, nbytes)
        if found is None and self._wraps and nbytes:
            wrapper = ctypes.c_void_p()
            self._check(
                self._lib_.dmlc_wrap_memory(
                    self._dev, ctypes.c_void_p(addr), nbytes, ctypes.byref(wrapper)
                )
            )
            self._wrapped.append(wrapper)
            found = wrapper, 0
        if found is None:
            return False
        seg.buf, seg.offset = found
        return True

    def _direct_pair(
        self, src: int, src_bytes: int, dst: int, dst_bytes: int, in_place: bool
    ) -> bool:
        """`_direct` for a request's output (`dst`) and, unless `in_place`,
        its input (`src`); False (nothing wrapped) if either must be staged,
        or if the two overlap other than in the in-place form."""
        if in_place:
            return self._direct(dst, dst_bytes, self._seg)
        if src < dst + dst_bytes and dst < src + src_bytes:
            return False
        try:
            if self._direct(src, src_bytes, self._in_seg) and self._direct(
                dst, dst_bytes, self._seg
            ):
                return True
        except BaseException:
            self._unwrap()
            raise
        self._unwrap()
        return False

    def _run(
        self,
        opcode: int,
        dtype: Dtype,
        op: ReduceOp,
        root: int,
        block_bytes: int,
        nbytes: int,
        *,
        in_bytes: int = 0,
        comm: int = 0,
    ) -> None:
        """Runs one request on `nbytes` of the caller's memory, which
        `_direct` or `_direct_pair` pointed the segments at (none for a
        barrier); the caller frees their wrappers. In place, the result is
        left there; with `in_bytes`, the request is out of place and reads
        its input from the segment `_direct_pair` set. `block_bytes` is the
        per-member count in bytes; `comm` the communicator's id."""
        size = _SIZES[dtype]
        if block_bytes % size:
            raise ValueError(f"{block_bytes} bytes are not whole {dtype.name} elements")
        req = self._req
        req.opcode = opcode
        req.dtype = dtype
        req.op = op
        req.root = root
        req.count = block_bytes // size
        req.flags = _capi.FLAG_IN_PLACE if nbytes and not in_bytes else 0
        self._seg.len = nbytes
        self._in_seg.len = in_bytes
        lib = self._lib_
        rc = lib.dmlc_submit_comm(
            self._dev,
            0,
            comm,
            self._req_ref,
            self._in_seg_ref if in_bytes else None,
            1 if in_bytes else 0,
            self._seg_ref if nbytes else None,
            1 if nbytes else 0,
            self._handle_ref,
        )
        self._check(rc)
        done = self._done
        rc = lib.dmlc_wait(self._dev, self._handle, -1, self._done_ref)
        if rc != _capi.OK:
            msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
            peer = None if done.peer == _capi.NO_PEER else done.peer
            length = lib.dmlc_last_error_length()
            raise error_for(rc, msg or _strerror(lib, rc), done.detail, peer, length=length)

    def _run_pieces(
        self,
        opcode: int,
        dtype: Dtype,
        op: ReduceOp,
        root: int,
        nbytes: int,
        in_place: bool,
        comm: int = 0,
    ) -> None:
        """An element-wise collective (allreduce, broadcast, reduce) on the
        caller's memory that `_direct` or `_direct_pair` pointed the
        segments at, in requests of the host forms' size."""
        size = _SIZES[dtype]
        step = max(1, self._host_chunk // size) * size
        out_at, in_at = self._seg.offset, self._in_seg.offset
        # A non-finite input (spec 5.X.6.14) fails one piece: the others
        # still run, as the host forms run them, and the lowest (rank,
        # element), counted in the whole buffer, is raised at the end.
        found: NonFiniteError | None = None
        try:
            for lo in range(0, nbytes, step):
                k = min(step, nbytes - lo)
                self._seg.offset, self._in_seg.offset = out_at + lo, in_at + lo
                try:
                    self._run(
                        opcode, dtype, op, root, k, k, in_bytes=0 if in_place else k, comm=comm
                    )
                except NonFiniteError as e:
                    where = (e.rank, e.index + lo // size)
                    if found is None or where < (found.rank, found.index):
                        found = NonFiniteError(*where)
        finally:
            self._unwrap()
        if found is not None:
            raise found

    def _run_direct(
        self,
        opcode: int,
        dtype: Dtype,
        op: ReduceOp,
        block: int,
        nbytes: int,
        in_bytes: int,
        comm: int = 0,
    ) -> None:
        """One allgather or reduce-scatter request on the caller's memory
        that `_direct_pair` pointed the segments at (`block` bytes per
        member, `nbytes` of output, `in_bytes` of input: 0 in place)."""
        try:
            self._run(opcode, dtype, op, 0, block, nbytes, in_bytes=in_bytes, comm=comm)
        finally:
            # The wrappers go in any case: the driver keeps its own hold on
            # a request still pending after a wait that gave up on a device
            # that stopped answering (which then needs a reset, and the
            # module's reset unpins).
            self._unwrap()

    def _unwrap(self) -> None:
        """Frees the wrappers of the caller's memory made by `_direct`."""
        while self._wrapped:
            self._lib_.dmlc_free(self._wrapped.pop())


def _comm_request(
    opcode: int,
    dtype: Dtype,
    comm: int,
    count: int,
    *,
    peer: int = 0,
    root: int = 0,
    tag: int = 0,
    table: Sequence[int] | np.ndarray | None = None,
) -> _capi.CommRequest:
    """A dmlc_comm_request; its table (le64 counts) is kept alive by the
    request (``_table``)."""
    req = _capi.CommRequest(
        opcode=opcode, dtype=dtype, root=root, count=count, tag=tag, comm=comm, peer=peer
    )
    if table is not None:
        raw = np.ascontiguousarray(table, dtype="<u8")
        req.table, req.table_bytes = raw.ctypes.data, raw.nbytes
        req._table = raw  # type: ignore[attr-defined]
    return req


def _overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    return a_bytes > 0 and b_bytes > 0 and a < b + b_bytes and b < a + a_bytes


def _apart(src: int, n: int, dst: int, total: int) -> tuple[int, Any]:
    """`src`, or a copy of its `n` bytes if they overlap [dst, dst + total)
    (the host forms read their input apart from their output), and what
    keeps the copy alive."""
    if not _overlap(src, n, dst, total):
        return src, None
    kept = ctypes.create_string_buffer(n)
    ctypes.memmove(kept, src, n)
    return ctypes.addressof(kept), kept


def _u64s(values: Sequence[int]) -> Any:
    """`values` as a C array of uint64_t."""
    return (ctypes.c_uint64 * len(values))(*values)


def _strerror(lib: ctypes.CDLL, rc: int) -> str:
    return (lib.dmlc_strerror(rc) or b"").decode(errors="replace")


def _raise_if(lib: ctypes.CDLL, rc: int) -> None:
    if rc != _capi.OK:
        msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
        # The device's detail and peer, where the failure was the device's.
        why = _capi.Completion()
        lib.dmlc_last_error_completion(ctypes.byref(why))
        if why.status != rc:
            why.detail, why.peer = 0, _capi.NO_PEER
        peer = None if why.peer == _capi.NO_PEER else why.peer
        length = lib.dmlc_last_error_length()
        raise error_for(rc, msg or _strerror(lib, rc), why.detail, peer, length=length)
