"""What one DDP gradient bucket costs inside a guest: the device's allreduce
from Python (of a torch tensor, and straight from device memory), a 4 B
allreduce and a barrier, against what DDP and the optimizer do to the
same bucket anyway (one element-wise pass, one copy). Medians of
a few runs, printed by rank 0. Run it on N VMs through the device, e.g.:

    dmlc-qemu submit -n 2 --host-root --memory 2G --transport device \\
        -- python3 bench/guest-allreduce.py

(PYTHONPATH must reach python/src and DMLC_LIBRARY the C library, as in
the README's PyTorch example). With `--kernel-driver KO` the tensor goes
to the device from its own pages instead of through the staging buffer.
The bucket defaults to 1.1M f32, the gradients of examples/torch/train.py's
MLP.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import timeit
from collections.abc import Callable

import torch

from dmlc import Device


def median_ms(fn: Callable[[], object], runs: int) -> float:
    """Median of `runs` timed calls after one untimed call."""
    return statistics.median(timeit.repeat(fn, number=1, repeat=runs + 1)[1:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elems", type=int, default=1_100_000, help="f32 elements in the bucket")
    p.add_argument("--runs", type=int, default=9)
    a = p.parse_args()
    torch.set_num_threads(1)
    dev = Device.from_env()
    bucket = torch.ones(a.elems)
    other = torch.ones(a.elems)
    shared = dev.empty(a.elems, dtype=torch.float32)
    shared.fill_(1.0)
    nbytes = a.elems * 4
    # Every rank runs the same collectives in the same order; only rank 0 prints.
    rows = [
        ("device allreduce of a torch tensor", lambda: dev.allreduce(bucket)),
        ("device allreduce, device memory (no copy)", lambda: dev.allreduce(shared)),
        ("device allreduce of 4 B", lambda: dev.allreduce(torch.ones(1))),
        ("device barrier", dev.barrier),
    ]
    local = [
        ("element-wise pass (div_ by the world size)", lambda: bucket.div_(2.0)),
        (
            "memmove of the bucket",
            lambda: ctypes.memmove(other.data_ptr(), bucket.data_ptr(), nbytes),
        ),
    ]
    results = [(name, median_ms(fn, a.runs)) for name, fn in rows + local]
    staged = dev.staged_bytes
    dev.close()
    if dev.rank == 0:
        driver = os.environ.get("DMLC_DEVICE", "?")
        how = "staged" if staged else "from its own pages"
        print(
            f"# {dev.world_size} members, bucket {nbytes / 1e6:.1f} MB, median of {a.runs}; "
            f"DMLC_DEVICE={driver}: the torch tensor went {how} ({staged} bytes staged)"
        )
        for name, ms in results:
            print(f"{name:45s} {ms:9.2f} ms")


if __name__ == "__main__":
    main()
