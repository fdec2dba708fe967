"""One member's device: collectives on numpy arrays and torch tensors.

Every call is copied into one staging buffer in device-visible memory, run
in place there, and copied back (the device reads and writes only that
memory). Calls run in order on one worker thread per device, so blocking
and asynchronous calls keep the order every member must issue them in, and
an asynchronous call leaves the caller's thread free (ctypes releases the
GIL while the C library waits).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any, Union

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

# Largest piece of one request: the staging buffer stays small.
CHUNK_BYTES = 16 << 20

Op = Union[ReduceOp, str]


def reduce_op(op: Op) -> ReduceOp:
    """`op` as a ReduceOp (a name such as "sum" is accepted)."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp[str(op).upper()]
    except KeyError:
        names = ", ".join(o.name.lower() for o in ReduceOp)
        raise ValueError(f"unknown reduce op {op!r}: expected one of {names}") from None


def _torch() -> Any:
    import torch  # noqa: PLC0415 (torch is optional: imported only for tensors)

    return torch


def _is_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def as_bytes(x: Any) -> tuple[np.ndarray, Dtype]:
    """A writable uint8 view of `x`'s memory (no copy) and its dtype.

    `x` is a C-contiguous numpy array or CPU torch tensor of a dtype the
    device has (torch's bfloat16 included).
    """
    if _is_tensor(x):
        torch = _torch()
        if x.device.type != "cpu":
            raise ValueError(f"dmlc works on CPU tensors; this one is on {x.device}")
        if not x.is_contiguous():
            raise ValueError("dmlc needs contiguous tensors (call .contiguous() first)")
        t = x.detach()
        tdtypes = {
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
        if t.dtype not in tdtypes:
            raise TypeError(f"dmlc has no element type for {t.dtype}")
        # numpy has no bfloat16 (nor every unsigned type in every torch):
        # look at the raw bytes instead.
        raw = t.reshape(-1).view(torch.uint8)
        return raw.numpy(), tdtypes[t.dtype]
    if isinstance(x, np.ndarray):
        if x.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"dmlc has no element type for numpy {x.dtype}")
        if not x.flags.c_contiguous:
            raise ValueError("dmlc needs C-contiguous arrays (np.ascontiguousarray)")
        if not x.flags.writeable:
            raise ValueError("the array is read-only")
        return x.reshape(-1).view(np.uint8), _NUMPY_DTYPES[x.dtype]
    raise TypeError(f"expected a numpy array or a torch tensor, not {type(x).__name__}")


def _size(dtype: Dtype) -> int:
    return {
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
    }[dtype]


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


class Device:
    """One member's handle on a virtio-dmlc device.

    Open it with :meth:`open_host` (a host process playing a VM, over the
    backend's vhost-user socket), :meth:`open_pci` (inside a guest) or
    :meth:`from_env` (the job's environment). Collectives take numpy arrays
    or CPU torch tensors; ``in place`` unless an ``out`` is given.
    """

    _lib: ctypes.CDLL | None = None

    def __init__(self, handle: int, lib: ctypes.CDLL) -> None:
        self._lib_ = lib
        self._dev = ctypes.c_void_p(handle)
        cfg = _capi.Config()
        self._check(lib.dmlc_get_config(self._dev, ctypes.byref(cfg)))
        self.rank: int = cfg.rank
        self.world_size: int = cfg.world_size
        self.max_bytes: int = cfg.max_bytes
        self.group_id: int = cfg.group_id
        self._chunk = max(8, min(CHUNK_BYTES, cfg.max_bytes) // 8 * 8)
        self._staging = ctypes.c_void_p()
        self._staging_len = 0
        self._staging_view = np.empty(0, dtype=np.uint8)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._worker = threading.Thread(target=self._serve, name="dmlc-device", daemon=True)
        self._worker.start()
        self._closed = False

    # ---- opening ----------------------------------------------------------

    @classmethod
    def library(cls) -> ctypes.CDLL:
        if cls._lib is None:
            cls._lib = _capi.load()
        return cls._lib

    @classmethod
    def _options(cls, poll: bool, dma_bytes: int | None) -> _capi.OpenOptions:
        opts = _capi.OpenOptions()
        cls.library().dmlc_open_options_init(ctypes.byref(opts))
        opts.poll = int(poll)
        if dma_bytes is not None:
            opts.dma_bytes = dma_bytes
        return opts

    @classmethod
    def open_host(
        cls, socket: str | os.PathLike[str], *, poll: bool = False, dma_bytes: int | None = None
    ) -> Device:
        """The device served by the backend at `socket` (this process plays the VM)."""
        lib = cls.library()
        out = ctypes.c_void_p()
        opts = cls._options(poll, dma_bytes)
        rc = lib.dmlc_open_host_ex(os.fsencode(socket), ctypes.byref(opts), ctypes.byref(out))
        _raise_if(lib, rc)
        return cls(out.value or 0, lib)

    @classmethod
    def open_pci(
        cls, addr: str | None = None, *, poll: bool = False, dma_bytes: int | None = None
    ) -> Device:
        """The PCI device from inside a guest (root and hugepages needed)."""
        lib = cls.library()
        out = ctypes.c_void_p()
        opts = cls._options(poll, dma_bytes)
        rc = lib.dmlc_open_pci(
            addr.encode() if addr else None, ctypes.byref(opts), ctypes.byref(out)
        )
        _raise_if(lib, rc)
        return cls(out.value or 0, lib)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Device:
        """Opens the device the job's environment names, and checks the rank.

        ``DMLC_SOCKET`` (a backend socket; or ``DMLC_SOCKET_PREFIX`` plus the
        rank) or ``DMLC_DEVICE=pci[:ADDR]``; ``DMLC_POLL=1`` polls,
        ``DMLC_DMA_BYTES`` sizes the device memory. A rank given by the
        launcher (``DMLC_TASK_ID``) or torchrun (``RANK``, ``WORLD_SIZE``)
        must match the device's.
        """
        env = dict(os.environ) if env is None else env
        given_rank = _int_env(env, "RANK", "DMLC_TASK_ID")
        given_world = _int_env(env, "WORLD_SIZE", "DMLC_NUM_WORKER")
        poll = env.get("DMLC_POLL", "0")
        if poll not in ("0", "1"):
            raise ValueError(f"DMLC_POLL={poll!r}: expected 1 (poll) or 0 (interrupts)")
        dma = env.get("DMLC_DMA_BYTES")
        dma_bytes = parse_size("DMLC_DMA_BYTES", dma) if dma else None
        if "DMLC_SOCKET" in env:
            dev = cls.open_host(env["DMLC_SOCKET"], poll=poll == "1", dma_bytes=dma_bytes)
        elif "DMLC_SOCKET_PREFIX" in env:
            if given_rank is None:
                raise ValueError("DMLC_SOCKET_PREFIX needs RANK or DMLC_TASK_ID")
            dev = cls.open_host(
                f"{env['DMLC_SOCKET_PREFIX']}{given_rank}", poll=poll == "1", dma_bytes=dma_bytes
            )
        elif env.get("DMLC_DEVICE", "").startswith("pci"):
            addr = env["DMLC_DEVICE"].partition(":")[2] or None
            dev = cls.open_pci(addr, poll=poll == "1", dma_bytes=dma_bytes)
        else:
            raise ValueError(
                "no device in the environment: set DMLC_SOCKET (host transport) "
                "or DMLC_DEVICE=pci (inside a guest)"
            )
        if given_rank is not None and given_rank != dev.rank:
            dev.close()
            raise ValueError(f"the environment says rank {given_rank}, the device {dev.rank}")
        if given_world is not None and given_world != dev.world_size:
            dev.close()
            raise ValueError(
                f"the environment says {given_world} members, the device {dev.world_size}"
            )
        return dev

    def close(self) -> None:
        """Finishes the queued collectives and closes the device."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
        lib = self._lib_
        if self._staging:
            lib.dmlc_free(self._staging)
            self._staging = ctypes.c_void_p()
        lib.dmlc_close(self._dev)

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (nothing to report to at exit)
            pass

    # ---- collectives --------------------------------------------------------

    def allreduce(
        self, data: Any, op: Op = ReduceOp.SUM, *, out: Any = None, async_op: bool = False
    ) -> Any:
        """Element-wise reduction over the members, in rank order.

        In place on `data` unless `out` (same shape and dtype) is given.
        """
        rop = reduce_op(op)

        def run() -> Any:
            src, dtype = as_bytes(data)
            dst = src if out is None else self._same(out, src, dtype)
            step = self._chunk // _size(dtype) * _size(dtype)
            for lo in range(0, len(src), step) if len(src) else ():
                hi = min(lo + step, len(src))
                dst[lo:hi] = self._run(_capi.ALLREDUCE, dtype, rop, 0, src[lo:hi], hi - lo)
            return data if out is None else out

        return self._call(run, async_op)

    def broadcast(self, data: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Every member's `data` gets the root's."""
        self._check_root(root)

        def run() -> Any:
            buf, dtype = as_bytes(data)
            step = self._chunk // _size(dtype) * _size(dtype)
            for lo in range(0, len(buf), step) if len(buf) else ():
                hi = min(lo + step, len(buf))
                buf[lo:hi] = self._run(
                    _capi.BROADCAST, dtype, ReduceOp.SUM, root, buf[lo:hi], hi - lo
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
            buf, dtype = as_bytes(data)
            result = self._run(_capi.REDUCE, dtype, rop, root, buf, len(buf))
            if self.rank == root:
                buf[:] = result
            return data

        return self._call(run, async_op)

    def allgather(self, data: Any, out: Any, *, async_op: bool = False) -> Any:
        """`out` (world_size times `data`'s size) gets every member's `data` in rank order."""

        def run() -> Any:
            src, dtype = as_bytes(data)
            dst, odtype = as_bytes(out)
            n = len(src)
            if odtype != dtype or len(dst) != n * self.world_size:
                raise ValueError(
                    f"allgather output must hold {self.world_size} x {n} bytes of {dtype.name}"
                )
            staged = np.zeros(n * self.world_size, dtype=np.uint8)
            staged[self.rank * n : (self.rank + 1) * n] = src
            dst[:] = self._run(_capi.ALLGATHER, dtype, ReduceOp.SUM, 0, staged, n)
            return out

        return self._call(run, async_op)

    def reduce_scatter(
        self, data: Any, out: Any, op: Op = ReduceOp.SUM, *, async_op: bool = False
    ) -> Any:
        """`out` gets block `rank` of the reduction of every member's `data`."""
        rop = reduce_op(op)

        def run() -> Any:
            src, dtype = as_bytes(data)
            dst, odtype = as_bytes(out)
            n = len(dst)
            if odtype != dtype or len(src) != n * self.world_size:
                raise ValueError(
                    f"reduce_scatter input must hold {self.world_size} x {n} bytes of {dtype.name}"
                )
            result = self._run(_capi.REDUCE_SCATTER, dtype, rop, 0, src, n)
            dst[:] = result[self.rank * n : (self.rank + 1) * n]
            return out

        return self._call(run, async_op)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Returns once every member has called it."""
        return self._call(
            lambda: self._run(_capi.BARRIER, Dtype.U8, ReduceOp.SUM, 0, None, 0), async_op
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
    def _same(out: Any, src: np.ndarray, dtype: Dtype) -> np.ndarray:
        dst, odtype = as_bytes(out)
        if odtype != dtype or len(dst) != len(src):
            raise ValueError("out must have the input's size and dtype")
        return dst

    def _stage(self, nbytes: int) -> np.ndarray:
        """The staging buffer (device memory) as at least `nbytes` of numpy bytes."""
        lib = self._lib_
        if nbytes > self._staging_len:
            if self._staging:
                self._staging_view = np.empty(0, dtype=np.uint8)
                lib.dmlc_free(self._staging)
                self._staging = ctypes.c_void_p()
                self._staging_len = 0
            buf = ctypes.c_void_p()
            self._check(lib.dmlc_alloc(self._dev, max(nbytes, 64), ctypes.byref(buf)))
            self._staging = buf
            self._staging_len = lib.dmlc_buffer_size(buf)
            ptr = lib.dmlc_buffer_data(self._staging)
            raw = (ctypes.c_uint8 * self._staging_len).from_address(ptr)
            self._staging_view = np.frombuffer(raw, dtype=np.uint8)
        return self._staging_view

    def _run(
        self,
        opcode: int,
        dtype: Dtype,
        op: ReduceOp,
        root: int,
        data: np.ndarray | None,
        block_bytes: int,
    ) -> np.ndarray:
        """Runs one in-place request on a copy of `data`; returns the result
        bytes, a view of the staging buffer valid until the next request (the
        worker thread runs one at a time). `block_bytes` is the per-member
        count in bytes."""
        size = _size(dtype)
        if block_bytes % size:
            raise ValueError(f"{block_bytes} bytes are not whole {dtype.name} elements")
        nbytes = 0 if data is None else len(data)
        seg = _capi.Segment()
        nseg = 0
        if nbytes:
            stage = self._stage(nbytes)
            stage[:nbytes] = data
            seg.buf, seg.offset, seg.len = self._staging, 0, nbytes
            nseg = 1
        req = _capi.Request(
            opcode=opcode,
            dtype=int(dtype),
            op=int(op),
            root=root,
            count=block_bytes // size,
            tag=0,
            flags=_capi.FLAG_IN_PLACE if nseg else 0,
            timeout_ms=0,
        )
        handle = ctypes.c_void_p()
        lib = self._lib_
        rc = lib.dmlc_submit(
            self._dev,
            0,
            ctypes.byref(req),
            None,
            0,
            ctypes.byref(seg) if nseg else None,
            nseg,
            ctypes.byref(handle),
        )
        self._check(rc)
        done = _capi.Completion()
        rc = lib.dmlc_wait(self._dev, handle, -1, ctypes.byref(done))
        if rc != _capi.OK:
            msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
            peer = None if done.peer == _capi.NO_PEER else done.peer
            raise error_for(rc, msg or _strerror(lib, rc), done.detail, peer)
        if not nbytes:
            return np.empty(0, dtype=np.uint8)
        return self._stage(nbytes)[:nbytes]


def _strerror(lib: ctypes.CDLL, rc: int) -> str:
    return (lib.dmlc_strerror(rc) or b"").decode(errors="replace")


def _raise_if(lib: ctypes.CDLL, rc: int) -> None:
    if rc != _capi.OK:
        msg = (lib.dmlc_last_error_message() or b"").decode(errors="replace")
        raise error_for(rc, msg or _strerror(lib, rc))


def parse_size(name: str, value: str) -> int:
    """A byte count such as 4096, 64K, 16M or 1G (powers of 1024), as rabit reads it."""
    v = value.strip()
    shift = {"k": 10, "m": 20, "g": 30}.get(v[-1:].lower(), 0)
    digits = v[:-1] if shift else v
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(f"{name}={value!r} is not a size such as 16M")
    return int(digits) << shift


def _int_env(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"{name}={env[name]!r} is not a number") from None
    return None
