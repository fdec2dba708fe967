"""LightGBM's distributed training through the device, with no patch to
LightGBM: its network hook (``LGBM_NetworkInitWithFunctions``) takes a
reduce-scatter and an allgather, and here both move their data through the
device.

    import lightgbm as lgb
    import dmlc
    from dmlc import lightgbm as dmlc_lgb

    dev = dmlc.init()
    with dmlc_lgb.network(dev):
        booster = lgb.train({**params, **dmlc_lgb.params(dev)}, shard)

How the two functions map onto the device:

- reduce-scatter: LightGBM hands a byte buffer cut into one block per rank
  and its own reduce function (a C function pointer: histogram sums, the
  best split's maximum). Block ``j`` goes to rank ``j`` in one all-to-all
  (``alltoallv`` of bytes), and each rank folds the blocks it received into
  its output with LightGBM's function, in rank order. The device moves the
  data; the reduction stays LightGBM's, so any reducer works. At two ranks the
  result equals LightGBM's own socket network's bit for bit (one addition,
  and addition commutes); at more ranks the order of the additions differs.
- allgather: blocks of any sizes (LightGBM gathers bin boundaries of
  different lengths): every rank's block padded to the largest, one
  ``allgather``, then each block copied to its place.

LightGBM gives these functions no way to report an error: a failed
collective here would train on garbage. So an error prints what failed and
ends the process (exit status 1); the other ranks then get the device's
PEER_LOST (or their timeout) instead of waiting.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .device import Device

__all__ = ["Exchange", "network", "params"]

# LightGBM's comm_size_t is int32_t (include/LightGBM/meta.h).
_Int32p = ctypes.POINTER(ctypes.c_int32)
# void (*)(const char* src, char* dst, int type_size, comm_size_t bytes): dst op= src.
_Reducer = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int32)
# The reducer arrives as `const ReduceFunction&`: a pointer to the function pointer.
_ReduceScatter = ctypes.CFUNCTYPE(
    None,
    ctypes.c_void_p,  # input
    ctypes.c_int32,  # input_size (bytes)
    ctypes.c_int,  # type_size
    _Int32p,  # block_start (bytes, one per block)
    _Int32p,  # block_len (bytes)
    ctypes.c_int,  # num_block (= ranks)
    ctypes.c_void_p,  # output
    ctypes.c_int32,  # output_size
    ctypes.POINTER(ctypes.c_void_p),  # reducer
)
_Allgather = ctypes.CFUNCTYPE(
    None,
    ctypes.c_void_p,  # input
    ctypes.c_int32,  # input_size
    _Int32p,  # block_start
    _Int32p,  # block_len
    ctypes.c_int,  # num_block
    ctypes.c_void_p,  # output
    ctypes.c_int32,  # output_size
)


def _bytes_at(address: int, n: int) -> np.ndarray:
    """A writable uint8 view of `n` bytes at `address` (LightGBM's buffer)."""
    if n == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))


class Exchange:
    """The two functions LightGBM calls, bound to one device, and what they
    cost: ``seconds`` spent in them, ``calls`` and ``bytes`` given to them."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        self._lock = threading.Lock()
        # ctypes keeps a callback callable only while its object lives.
        self.reduce_scatter = _ReduceScatter(self._guarded("reduce-scatter", self._reduce_scatter))
        self.allgather = _Allgather(self._guarded("allgather", self._allgather))

    def _guarded(self, what: str, fn: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            start = time.perf_counter()
            try:
                # LightGBM's threads are its own: one collective at a time.
                with self._lock:
                    fn(*args)
            except BaseException:  # noqa: BLE001 (LightGBM takes no error: end here)
                rank = self.device.rank
                print(
                    f"dmlc.lightgbm: rank {rank}: LightGBM's {what} through the device failed; "
                    "LightGBM cannot be told, so this process ends:\n" + traceback.format_exc(),
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
            self.seconds += time.perf_counter() - start
            self.calls += 1

        return call

    def _blocks(self, start: Any, length: Any, n: int) -> tuple[list[int], list[int]]:
        if n != self.device.world_size:
            raise ValueError(
                f"LightGBM cut its buffer into {n} blocks for a device group of "
                f"{self.device.world_size} ranks: num_machines must be the group's size"
            )
        return [start[i] for i in range(n)], [length[i] for i in range(n)]

    def _reduce_scatter(
        self,
        inp: int,
        in_size: int,
        type_size: int,
        block_start: Any,
        block_len: Any,
        n: int,
        out: int,
        out_size: int,
        reducer: Any,
    ) -> None:
        starts, lens = self._blocks(block_start, block_len, n)
        rank = self.device.rank
        mine = lens[rank]
        if mine > out_size:
            raise ValueError(f"block {rank} holds {mine} bytes, the output only {out_size}")
        data = _bytes_at(inp, in_size)
        # The blocks in rank order, one after the other, as alltoallv sends them.
        contiguous = all(starts[i] == sum(lens[:i]) for i in range(n))
        send = (
            data[: sum(lens)]
            if contiguous
            else np.concatenate([data[s : s + k] for s, k in zip(starts, lens)])
        )
        got = np.empty(mine * n, dtype=np.uint8)
        self.device.alltoallv(np.ascontiguousarray(send), got, lens, [mine] * n)
        self.bytes += in_size
        result = _bytes_at(out, mine)
        result[:] = got[:mine]
        fold = _Reducer(ctypes.cast(reducer, ctypes.POINTER(ctypes.c_void_p))[0])
        for i in range(1, n):
            piece = got[i * mine : (i + 1) * mine]
            fold(piece.ctypes.data, out, type_size, mine)

    def _allgather(
        self,
        inp: int,
        in_size: int,
        block_start: Any,
        block_len: Any,
        n: int,
        out: int,
        out_size: int,
    ) -> None:
        starts, lens = self._blocks(block_start, block_len, n)
        rank = self.device.rank
        if lens[rank] != in_size:
            raise ValueError(f"block {rank} holds {lens[rank]} bytes, the input {in_size}")
        if max(s + k for s, k in zip(starts, lens)) > out_size:
            raise ValueError(f"the blocks reach past the output's {out_size} bytes")
        width = max(*lens, 1)
        mine = np.zeros(width, dtype=np.uint8)
        mine[:in_size] = _bytes_at(inp, in_size)
        every = np.empty(width * n, dtype=np.uint8)
        self.device.allgather(mine, every)
        self.bytes += in_size
        result = _bytes_at(out, out_size)
        for i, (s, k) in enumerate(zip(starts, lens)):
            result[s : s + k] = every[i * width : i * width + k]


def params(device: Device) -> dict[str, Any]:
    """The training parameters that make LightGBM train with the others
    (data-parallel trees, each rank's rows its own)."""
    return {"num_machines": device.world_size, "tree_learner": "data", "pre_partition": True}


def _library() -> Any:
    try:
        from lightgbm import basic  # noqa: PLC0415 (LightGBM is optional)
    except ImportError as e:
        raise ImportError("dmlc.lightgbm needs LightGBM (pip install lightgbm)") from e
    return basic._LIB


@contextmanager
def network(device: Device) -> Iterator[Exchange]:
    """LightGBM's network set to `device` for the block (its own socket
    network is not started); the Exchange counts the time in collectives."""
    lib = _library()
    ex = Exchange(device)
    rc = lib.LGBM_NetworkInitWithFunctions(
        ctypes.c_int(device.world_size),
        ctypes.c_int(device.rank),
        ctypes.cast(ex.reduce_scatter, ctypes.c_void_p),
        ctypes.cast(ex.allgather, ctypes.c_void_p),
    )
    if rc != 0:
        lib.LGBM_GetLastError.restype = ctypes.c_char_p
        raise RuntimeError(f"LGBM_NetworkInitWithFunctions: {lib.LGBM_GetLastError().decode()}")
    try:
        yield ex
    finally:
        lib.LGBM_NetworkFree()
