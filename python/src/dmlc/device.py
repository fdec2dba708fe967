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
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any, Literal, Union

import numpy as np

from . import _capi
from .errors import DmlcError, error_for

__all__ = ["Device", "Dtype", "ReduceOp", "Work"]


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
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._worker = threading.Thread(target=self._serve, name="dmlc-device", daemon=True)
        self._worker.start()
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
        cls, opener: str, where: bytes | None, poll: Wait | None, dma_bytes: int | None
    ) -> Device:
        """Calls the C ABI's ``opener(where, options, &device)``."""
        lib = cls.library()
        out = ctypes.c_void_p()
        opts = cls._options(poll, dma_bytes)
        rc = getattr(lib, opener)(where, ctypes.byref(opts), ctypes.byref(out))
        _raise_if(lib, rc)
        return cls(out.value or 0, lib, wraps=opener == "dmlc_open_kernel")

    @classmethod
    def open_host(
        cls,
        socket: str | os.PathLike[str],
        *,
        poll: Wait | None = None,
        dma_bytes: int | None = None,
    ) -> Device:
        """The device served by the backend at `socket` (this process plays the VM)."""
        return cls._open("dmlc_open_host_ex", os.fsencode(socket), poll, dma_bytes)

    @classmethod
    def open_pci(
        cls, addr: str | None = None, *, poll: Wait | None = None, dma_bytes: int | None = None
    ) -> Device:
        """The PCI device from inside a guest (root and hugepages needed)."""
        return cls._open("dmlc_open_pci", addr.encode() if addr else None, poll, dma_bytes)

    @classmethod
    def open_kernel(
        cls, node: str | None = None, *, poll: Wait | None = None, dma_bytes: int | None = None
    ) -> Device:
        """The device through the virtio_dmlc kernel module's node (no root needed)."""
        return cls._open("dmlc_open_kernel", os.fsencode(node) if node else None, poll, dma_bytes)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Device:
        """Opens the device the job's environment names, and checks the rank.

        ``DMLC_SOCKET`` (a backend socket; or ``DMLC_SOCKET_PREFIX`` plus the
        rank), ``DMLC_DEVICE=pci[:ADDR]`` or ``DMLC_DEVICE=kernel[:NODE]``;
        ``DMLC_POLL=hybrid`` (the default) spins up to 200 us before it
        sleeps, ``poll`` (or ``1``) polls, ``interrupt`` (or ``0``) sleeps on
        the interrupt at once;
        ``DMLC_DMA_BYTES`` sizes the device memory. A rank given by the
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
        self._jobs.put(None)
        self._worker.join()
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
        self, data: Any, out: Any = None, op: Op = ReduceOp.SUM, *, async_op: bool = False
    ) -> Any:
        """Element-wise reduction over the members, in rank order.

        In place on `data` unless `out` (same shape and dtype) is given.
        Arguments come in one order in every collective: the data, the
        output, the op, the root (as in the C ABI). The older
        ``allreduce(data, op)`` still works, with a DeprecationWarning.
        """
        out, op = allreduce_order(out, op, stacklevel=3)
        rop = reduce_op(op)

        def run() -> Any:
            src, n, dtype = memory(data)
            dst = src if out is None else self._same(out, n, dtype)
            in_place = dst == src
            if self._direct_pair(src, n, dst, n, in_place):
                self._run_pieces(_capi.ALLREDUCE, dtype, rop, 0, n, in_place)
                return data if out is None else out
            self.staged_bytes += n
            if not in_place and src < dst + n and dst < src + n:
                # Overlapping buffers (not the in-place form): the host form
                # wants them apart, so the input goes to the output first.
                ctypes.memmove(dst, src, n)
                in_place = True
            self._host(
                self._lib_.dmlc_allreduce_host(
                    self._dev, None if in_place else src, dst, n // _SIZES[dtype], dtype, rop
                )
            )
            return data if out is None else out

        return self._call(run, async_op)

    def broadcast(self, data: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Every member's `data` gets the root's."""
        self._check_root(root)

        def run() -> Any:
            buf, n, dtype = memory(data)
            if self._direct(buf, n, self._seg):
                self._run_pieces(_capi.BROADCAST, dtype, ReduceOp.SUM, root, n, True)
                return data
            self.staged_bytes += n
            self._host(
                self._lib_.dmlc_broadcast_host(self._dev, buf, n // _SIZES[dtype], dtype, root)
            )
            return data

        return self._call(run, async_op)

    def reduce(
        self, data: Any, op: Op = ReduceOp.SUM, root: int = 0, *, async_op: bool = False
    ) -> Any:
        """The root's `data` becomes the reduction; the others' is unchanged."""
        self._check_root(root)
        rop = reduce_op(op)

        def run() -> Any:
            buf, n, dtype = memory(data)
            # In place, a non-root member's buffer is only read.
            if self._direct(buf, n, self._seg):
                self._run_pieces(_capi.REDUCE, dtype, rop, root, n, True)
                return data
            self.staged_bytes += n
            self._host(
                self._lib_.dmlc_reduce_host(self._dev, buf, n // _SIZES[dtype], dtype, rop, root)
            )
            return data

        return self._call(run, async_op)

    def allgather(self, data: Any, out: Any, *, async_op: bool = False) -> Any:
        """`out` (world_size times `data`'s size) gets every member's `data` in rank order."""

        def run() -> Any:
            src, n, dtype = memory(data)
            dst, total, odtype = memory(out)
            if odtype != dtype or total != n * self.world_size:
                raise ValueError(
                    f"allgather output must hold {self.world_size} x {n} bytes of {dtype.name}"
                )
            # `data` as block `rank` of `out` is the in-place form.
            in_place = src == dst + self.rank * n
            if n <= self._block_piece(dtype) and self._direct_pair(src, n, dst, total, in_place):
                self._run_direct(
                    _capi.ALLGATHER, dtype, ReduceOp.SUM, n, total, 0 if in_place else n
                )
                return out
            self.staged_bytes += total
            send, kept = src, None
            if src < dst + total and dst < src + n:
                # The host form reads its input apart from the output.
                kept = ctypes.create_string_buffer(n)
                ctypes.memmove(kept, src, n)
                send = ctypes.addressof(kept)
            self._host(
                self._lib_.dmlc_allgather_host(self._dev, send, dst, n // _SIZES[dtype], dtype)
            )
            return out

        return self._call(run, async_op)

    def reduce_scatter(
        self, data: Any, out: Any, op: Op = ReduceOp.SUM, *, async_op: bool = False
    ) -> Any:
        """`out` gets block `rank` of the reduction of every member's `data`."""
        rop = reduce_op(op)

        def run() -> Any:
            src, total, dtype = memory(data)
            dst, n, odtype = memory(out)
            if odtype != dtype or total != n * self.world_size:
                raise ValueError(
                    f"reduce_scatter input must hold {self.world_size} x {n} bytes of {dtype.name}"
                )
            # `out` as block `rank` of `data` is the in-place form, whose one
            # buffer is `data`.
            in_place = dst == src + self.rank * n
            out_addr, out_bytes = (src, total) if in_place else (dst, n)
            if n <= self._block_piece(dtype) and self._direct_pair(
                src, total, out_addr, out_bytes, in_place
            ):
                self._run_direct(
                    _capi.REDUCE_SCATTER, dtype, rop, n, out_bytes, 0 if in_place else total
                )
                return out
            self.staged_bytes += total
            recv, result = dst, None
            if dst < src + total and src < dst + n:
                # The host form writes its output apart from the input.
                result = ctypes.create_string_buffer(n)
                recv = ctypes.addressof(result)
            self._host(
                self._lib_.dmlc_reduce_scatter_host(
                    self._dev, src, recv, n // _SIZES[dtype], dtype, rop
                )
            )
            if result is not None:
                ctypes.memmove(dst, result, n)
            return out

        return self._call(run, async_op)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Returns once every member has called it."""
        return self._call(
            lambda: self._run(_capi.BARRIER, Dtype.U8, ReduceOp.SUM, 0, 0, 0), async_op
        )

    # ---- plumbing -----------------------------------------------------------

    def _call(self, fn: Callable[[], Any], async_op: bool) -> Any:
        if self._closed:
            raise DmlcError(_capi.ERR_INVALID_ARGUMENT, "the device is closed")
        fut: Future[Any] = Future()
        self._jobs.put((fn, fut))
        work = Work(fut)
        return work if async_op else work.wait()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
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

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(f"root {root} is not a rank of a group of {self.world_size}")

    @staticmethod
    def _same(out: Any, nbytes: int, dtype: Dtype) -> int:
        dst, n, odtype = memory(out)
        if odtype != dtype or n != nbytes:
            raise ValueError("out must have the input's size and dtype")
        return dst

    def _block_piece(self, dtype: Dtype) -> int:
        """The most bytes per member that the host forms of allgather and
        reduce-scatter carry in one request: a larger block goes through
        them, so that every member cuts it at the same places."""
        size = _SIZES[dtype]
        return max(1, self._host_chunk // self.world_size // size) * size

    def _host(self, rc: int) -> None:
        """Raises the error of a failed host form, with the device's detail
        and peer of the request that failed."""
        if rc != _capi.OK:
            lib = self._lib_
            msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
            why = _capi.Completion()
            lib.dmlc_last_error_completion(ctypes.byref(why))
            peer = None if why.peer == _capi.NO_PEER else why.peer
            raise error_for(rc, msg or _strerror(lib, rc), why.detail, peer)

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
    ) -> None:
        """Runs one request on `nbytes` of the caller's memory, which
        `_direct` or `_direct_pair` pointed the segments at (none for a
        barrier); the caller frees their wrappers. In place, the result is
        left there; with `in_bytes`, the request is out of place and reads
        its input from the segment `_direct_pair` set. `block_bytes` is the
        per-member count in bytes."""
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
        rc = lib.dmlc_submit(
            self._dev,
            0,
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
            raise error_for(rc, msg or _strerror(lib, rc), done.detail, peer)

    def _run_pieces(
        self, opcode: int, dtype: Dtype, op: ReduceOp, root: int, nbytes: int, in_place: bool
    ) -> None:
        """An element-wise collective (allreduce, broadcast, reduce) on the
        caller's memory that `_direct` or `_direct_pair` pointed the
        segments at, in requests of the host forms' size."""
        size = _SIZES[dtype]
        step = max(1, self._host_chunk // size) * size
        out_at, in_at = self._seg.offset, self._in_seg.offset
        try:
            for lo in range(0, nbytes, step):
                k = min(step, nbytes - lo)
                self._seg.offset, self._in_seg.offset = out_at + lo, in_at + lo
                self._run(opcode, dtype, op, root, k, k, in_bytes=0 if in_place else k)
        finally:
            self._unwrap()

    def _run_direct(
        self, opcode: int, dtype: Dtype, op: ReduceOp, block: int, nbytes: int, in_bytes: int
    ) -> None:
        """One allgather or reduce-scatter request on the caller's memory
        that `_direct_pair` pointed the segments at (`block` bytes per
        member, `nbytes` of output, `in_bytes` of input: 0 in place)."""
        try:
            self._run(opcode, dtype, op, 0, block, nbytes, in_bytes=in_bytes)
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


def _strerror(lib: ctypes.CDLL, rc: int) -> str:
    return (lib.dmlc_strerror(rc) or b"").decode(errors="replace")


def _raise_if(lib: ctypes.CDLL, rc: int) -> None:
    if rc != _capi.OK:
        msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
        raise error_for(rc, msg or _strerror(lib, rc))
