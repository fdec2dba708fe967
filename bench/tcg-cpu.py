"""How fast torch computes on this CPU: a float matmul, an element-wise add
and the cost of one small op, medians of a few runs. Run it in a guest to
see what a CPU model costs under TCG, for example:

    dmlc-qemu submit -n 1 --host-root --memory 2G -- python3 bench/tcg-cpu.py
    dmlc-qemu submit -n 1 --host-root --memory 2G --cpu max -- python3 bench/tcg-cpu.py

(the first uses the launcher's TCG default, `max` without the AVX family;
the second gives the guest AVX2 and FMA).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for k in (256, 1024):
        a, w = torch.randn(64, k), torch.randn(k, k)
        ms = median_ms(lambda a=a, w=w: a @ w)
        print(f"matmul 64x{k} @ {k}x{k} f32: {ms:10.2f} ms")
    x = torch.randn(1 << 20)
    print(f"add of 1M f32:               {median_ms(lambda: x + x):10.2f} ms")
    s = torch.randn(16)
    print(f"one small op (16 elements):  {median_ms(lambda: s + 1, 50):10.3f} ms")


if __name__ == "__main__":
    main()
