"""What each guest architecture costs under TCG, side by side in one run:
boot, the device's 4 B and 1 MiB allreduce latency (dmlc-guest bench, 2 VMs
of that architecture), and with --torch `import torch` and a DDP step of
examples/torch/train.py on Debian's root of that architecture; then one DDP
job across x86_64, aarch64 and riscv64 through the device and with gloo
over virtio-net between the same mixed VMs. Rounds alternate the
architectures, so load on the machine falls on all of them alike; medians
over the rounds, and each architecture's ratio to x86_64.

    python3 bench/arch-tcg.py [--rounds 3] [--torch [--torch-rounds 1]]

Needs target/debug/dmlc-qemu (or --launcher), the release dmlc-guest and
its cross-builds (tests/image/cross-build.sh aarch64 riscv64), and with
--torch the release libdmlc_guest.so and the Debian roots
(tests/image/build-rootfs.sh, which the launcher runs when needed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARCHES = ("x86_64", "aarch64", "riscv64")
REPO = Path(__file__).resolve().parent.parent
DATA = Path.home() / ".cache/virtio-dmlc/data"
# Debian's root of each VM's architecture; a backend timeout of 15 minutes
# for members that have not arrived: under TCG `import torch` ends minutes
# apart on different architectures, past the default 30 s.
ROOT = ["--host-root", "--rootfs", "debian", "--memory", "2G", "--backend-arg=--timeout-ms=900000"]
IMPORT_TORCH = (
    "python3 -c 'import time; t = time.perf_counter(); import torch; "
    'print("import-torch-s", round(time.perf_counter() - t, 3))\''
)


def run(cmd: list[str], env: dict[str, str]) -> str:
    """Runs the launcher; its stdout and stderr, or exits on failure."""
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=REPO)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}):\n{out}")
    return out


def booted_s(out: str) -> float:
    """The slowest VM's boot, from the launcher's 'booted in A to B s'."""
    m = re.search(r"booted in ([0-9.]+)(?: to ([0-9.]+))? s", out)
    if not m:
        sys.exit(f"no boot time in:\n{out}")
    return float(m.group(2) or m.group(1))


def bench_us(out: str, size: int) -> float:
    """Rank 0's out-of-place median for `size` bytes (dmlc-guest bench)."""
    for line in out.splitlines():
        words = line.split()
        if len(words) > 6 and words[:2] == ["[rank", "0]"] and words[2] == str(size):
            return float(words[7])
    sys.exit(f"no {size} B row in:\n{out}")


def ddp_json(out: str) -> dict[str, float]:
    for line in out.splitlines():
        if "json: " in line:
            return json.loads(line.split("json: ", 1)[1])
    sys.exit(f"no json line in:\n{out}")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--torch", action="store_true", help="also import torch and DDP (minutes)")
    p.add_argument(
        "--torch-rounds",
        type=int,
        default=1,
        help="rounds that run the torch jobs (the first ones)",
    )
    p.add_argument("--launcher", default=str(REPO / "target/debug/dmlc-qemu"))
    p.add_argument("--steps", type=int, default=10, help="DDP steps per job")
    a = p.parse_args()
    env = dict(os.environ)
    env.setdefault("DMLC_BACKEND", str(REPO / "target/release/vhost-device-dmlc"))
    env["DMLC_LIBRARY"] = str(REPO / "target/release/libdmlc_guest.so")
    env["PYTHONPATH"] = str(REPO / "python/src")
    guest = str(REPO / "target/release/dmlc-guest")
    ddp = f"python3 examples/torch/train.py --hidden 256 --steps {a.steps} --eval-samples 100"
    rows: dict[str, dict[str, list[float]]] = {x: {} for x in (*ARCHES, "mixed")}

    def keep(arch: str, key: str, v: float) -> None:
        rows[arch].setdefault(key, []).append(v)

    launcher = a.launcher
    for r in range(a.rounds):
        print(f"# round {r + 1} of {a.rounds}", flush=True)
        for arch in ARCHES:
            bench = [guest, "bench", "-b", "4", "-e", "1M", "-f", "262144", "-n", "50", "-w", "5"]
            out = run([launcher, "submit", "-n", "2", "--arch", arch, "--", *bench], env)
            keep(arch, "boot_s", booted_s(out))
            keep(arch, "ar_4B_us", bench_us(out, 4))
            keep(arch, "ar_1MiB_us", bench_us(out, 1 << 20))
            if not a.torch or r >= a.torch_rounds:
                continue
            root = [*ROOT, "--bind", str(DATA)]
            job = f"{IMPORT_TORCH} && {ddp} --backend dmlc --json -"
            cmd = [launcher, "submit", "-n", "2", "--arch", arch, *root, "--", "sh", "-c", job]
            out = run(cmd, env)
            m = re.search(r"\[rank 0\] import-torch-s ([0-9.]+)", out)
            keep(arch, "import_torch_s", float(m.group(1)) if m else float("nan"))
            res = ddp_json(out)
            keep(arch, "ddp_step_ms", res["step_ms"])
            keep(arch, "ddp_exchange_ms", res["exchange_ms"])
        if a.torch and r < a.torch_rounds:
            root = [*ROOT, "--bind", str(DATA)]
            for backend, transport in (("dmlc", "device"), ("gloo", "tcp")):
                cmd = [launcher, "submit", "-n", "3", "--arch", ",".join(ARCHES), *root]
                job = f"{ddp} --backend {backend} --json -"
                cmd += ["--transport", transport, "--", "sh", "-c", job]
                res = ddp_json(run(cmd, env))
                keep("mixed", f"{backend}_step_ms", res["step_ms"])
                keep("mixed", f"{backend}_exchange_ms", res["exchange_ms"])

    print("raw:", json.dumps(rows), flush=True)
    print("\n# medians over the rounds (ratio to x86_64)")
    keys = ["boot_s", "ar_4B_us", "ar_1MiB_us"]
    if a.torch:
        keys += ["import_torch_s", "ddp_step_ms", "ddp_exchange_ms"]
    print("| measure | " + " | ".join(ARCHES) + " |")
    print("|---|" + "---:|" * len(ARCHES))
    for k in keys:
        base = median(rows["x86_64"][k])
        cells = []
        for arch in ARCHES:
            v = median(rows[arch][k])
            ratio = f" ({v / base:.1f}x)" if base > 0 else ""
            cells.append(f"{v:.2f}" if arch == "x86_64" else f"{v:.2f}{ratio}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    if a.torch:
        mixed = rows["mixed"]
        print("\n# DDP across x86_64, aarch64 and riscv64 (3 VMs): medians, ms")
        print("| backend | step | exchange |")
        print("|---|---:|---:|")
        for b in ("dmlc", "gloo"):
            step, exchange = median(mixed[b + "_step_ms"]), median(mixed[b + "_exchange_ms"])
            print(f"| {b} | {step:.1f} | {exchange:.1f} |")
        ratio = median(mixed["gloo_step_ms"]) / median(mixed["dmlc_step_ms"])
        xr = median(mixed["gloo_exchange_ms"]) / max(median(mixed["dmlc_exchange_ms"]), 1e-9)
        print(f"# gloo over dmlc: step {ratio:.2f}x, exchange {xr:.2f}x")
    print(f"# done at {time.strftime('%Y-%m-%d %H:%M:%S')}")


if __name__ == "__main__":
    main()
