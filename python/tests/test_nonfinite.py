"""Non-finite origin (spec 5.X.6.14) from Python, over the host transport:
with the check on, a NaN or an infinity in one rank's input raises
``dmlc.NonFiniteError(rank, index)`` on every rank, from numpy arrays on the
device (cut into several requests: the index counts in the whole array) and
under the torch backend with ``DMLC_CHECK_FINITE=1`` alone: ``all_reduce`` of
f32, f64, f16 and bf16 tensors, and a DDP job whose rank 1 feeds a NaN at
step 7 stops at step 7 on both ranks, naming rank 1.

This file is also the rank program: ``python test_nonfinite.py JOB SOCKET STORE``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import dmlc

# Elements per rank in the numpy job: more than one request of the host
# forms' size (16 MiB of f32), so that the direct path cuts it in two.
BIG = 5 << 20
# Where rank 1's non-finite values go.
BIG_AT = (4 << 20) + 3
STEP = 7


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def numpy_job(socket: str) -> None:
    """Off: NaN in the output, no error. On: NonFiniteError naming rank 1's
    element in the whole array (the second request's), on every rank,
    the output written all the same; integers are not checked."""
    with dmlc.Device.open_host(socket, dma_bytes=64 << 20) as dev:
        rank = dev.rank
        a = dev.empty(BIG, np.float32)

        def fill() -> None:
            a[:] = 1.0
            if rank == 1:
                a[BIG_AT] = np.nan
                a[BIG_AT + 10] = np.inf
            if rank == 0:
                a[BIG - 1] = -np.inf

        def expect(x: Any, want: tuple[int, int]) -> None:
            try:
                dev.allreduce(x)
            except dmlc.NonFiniteError as e:
                _check((e.rank, e.index) == want, f"{(e.rank, e.index)} != {want}: {e}")
                _check(e.peer == e.rank and e.status == 9, f"status {e.status} peer {e.peer}")
                again = pickle.loads(pickle.dumps(e))
                _check((again.rank, again.index) == want, "pickled")
            else:
                raise AssertionError(f"no NonFiniteError ({want})")

        fill()
        dev.allreduce(a)
        _check(bool(np.isnan(a[BIG_AT])), "off: the NaN is in the output")
        dev.set_check_finite(True)
        fill()
        # Rank 0's -Inf is in the second request, rank 1's NaN too: rank 0.
        expect(a, (0, BIG - 1))
        _check(bool(np.isnan(a[BIG_AT])), "on: the output is written")
        fill()
        if rank == 0:
            a[BIG - 1] = 1.0
        expect(a, (1, BIG_AT))
        # Ordinary memory goes through the C library's host forms.
        x = np.ones(8)
        if rank == 1:
            x[5] = np.nan
        expect(x, (1, 5))
        dev.allreduce(np.full(8, 0x7F800000, dtype=np.int32))
        dev.set_check_finite(False)
        fill()
        dev.allreduce(a)


def torch_job(store_path: str) -> None:
    """DMLC_CHECK_FINITE=1 only: the backend's all_reduce raises
    NonFiniteError for every float dtype, the group goes on, and DDP stops
    at the step whose gradient rank 1 spoiled, naming rank 1."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import dmlc.torch_backend  # registers "dmlc" from a source tree

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(store_path, world)
    dist.init_process_group("dmlc", store=store, rank=rank, world_size=world)
    kinds = [float("nan"), float("inf"), float("-inf"), float("nan")]
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    for i, (dtype, bad) in enumerate(zip(dtypes, kinds)):
        t = torch.ones(1000, dtype=dtype)
        if rank == 1:
            t[100 + i] = bad
            t[900] = float("nan")
        try:
            dist.all_reduce(t)
        except dmlc.NonFiniteError as e:
            _check((e.rank, e.index) == (1, 100 + i), f"{dtype}: {e}")
        else:
            raise AssertionError(f"{dtype}: no NonFiniteError")
        clean = torch.ones(10, dtype=dtype)
        dist.all_reduce(clean)
        _check(bool((clean == world).all()), f"{dtype}: the group goes on")

    torch.manual_seed(0)
    net = DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    stopped = None
    for step in range(10):
        x = torch.full((4, 8), 0.5)
        if rank == 1 and step == STEP:
            x[2, 3] = float("nan")
        opt.zero_grad()
        try:
            net(x).square().sum().backward()
        except RuntimeError as e:
            _check("NonFiniteError" in str(e) and "rank 1's input" in str(e), str(e))
            stopped = step
            break
        opt.step()
    _check(stopped == STEP, f"stopped at step {stopped}")
    print(f"stopped at step {stopped}", flush=True)


def _run_ranks(tmp_path: Path, job: str, env: dict[str, str]) -> list[str]:
    from conftest import _binary, start_backend

    b = start_backend(tmp_path, 2, "--timeout-ms", "20000")
    try:
        base = dict(os.environ)
        base.setdefault("DMLC_LIBRARY", str(_binary("DMLC_LIBRARY", "libdmlc_guest.so")))
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, job, str(b.socket(r)), str(tmp_path / "store")],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={
                    **base,
                    **env,
                    "RANK": str(r),
                    "WORLD_SIZE": "2",
                    "DMLC_SOCKET": str(b.socket(r)),
                },
            )
            for r in range(2)
        ]
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
            assert p.returncode == 0, f"{job}: a rank failed ({p.returncode}):\n{out}"
            outs.append(out)
        return outs
    finally:
        b.proc.terminate()
        b.proc.wait(10)


def test_numpy_arrays_name_the_rank_and_the_element_in_the_whole_array(tmp_path: Path) -> None:
    _run_ranks(tmp_path, "numpy", {})


def test_ddp_stops_at_the_step_of_the_nan_naming_rank_1(tmp_path: Path) -> None:
    from conftest import need

    need("torch")
    outs = _run_ranks(tmp_path, "torch", {"DMLC_CHECK_FINITE": "1"})
    for out in outs:
        assert f"stopped at step {STEP}" in out, out


def test_the_error_keeps_rank_and_index() -> None:
    e = dmlc.NonFiniteError(1, 42)
    assert (e.rank, e.index, e.peer, e.status) == (1, 42, 1, dmlc._capi.ERR_NONFINITE)
    assert isinstance(e, dmlc.DmlcError) and isinstance(e, FloatingPointError)
    assert "rank 1" in str(e) and "42" in str(e)


def main(argv: list[str]) -> None:
    job, socket, store = argv[1], argv[2], argv[3]
    jobs: dict[str, Any] = {"numpy": lambda: numpy_job(socket), "torch": lambda: torch_job(store)}
    jobs[job]()


if __name__ == "__main__":
    main(sys.argv)
