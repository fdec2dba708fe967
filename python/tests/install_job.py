"""The job tests/python-install.sh runs with dmlc-run in a new virtual
environment: torch.distributed over backend "dmlc", loaded through the
package's entry point, with the library bundled in the wheel.

Every rank checks its own result against the formula (rank r contributes
(r + 1) * i at index i, so the sum is i * W(W+1)/2), and that the library it
loaded is the one inside this environment (DMLC_LIBRARY unset), then prints
one line. Options: --fail-once-rank R (rank R exits 3 in the first attempt,
so the job passes only if torchrun restarts it: --max-restarts) and
--fail-rank R (rank R exits 3 in every attempt).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import dmlc

COUNT = 100_003  # more than one page, not a multiple of anything


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-once-rank", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=-1)
    a = p.parse_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == a.fail_rank or (rank == a.fail_once_rank and attempt == 0):
        print(f"rank {rank}: exits 3 on purpose (attempt {attempt})", flush=True)
        return 3

    assert "DMLC_LIBRARY" not in os.environ, "the test must run without DMLC_LIBRARY"
    library = Path(dmlc.Device.library()._name).resolve()
    assert library == Path(dmlc.__file__).resolve().parent / "libdmlc_guest.so", library
    assert Path(sys.prefix).resolve() in library.parents, (library, sys.prefix)

    # No `import dmlc.torch_backend`: the entry point registers the backend.
    dist.init_process_group("dmlc")
    world = dist.get_world_size()
    assert dist.get_rank() == rank
    t = torch.arange(COUNT, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t)
    expect = np.arange(COUNT, dtype=np.float64) * (world * (world + 1) // 2)
    assert np.array_equal(t.numpy(), expect), "allreduce differs from the formula"
    dist.destroy_process_group()
    line = (
        f"rank {rank} of {world}: allreduce of {COUNT} float64 equals the formula "
        f"(attempt {attempt}, library {library})\n"
    )
    # One write(2) of the whole line: the ranks share torchrun's stdout, and
    # print() may write the text and its newline separately, so two ranks'
    # lines could run together.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
