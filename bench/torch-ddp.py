"""DDP with backend "dmlc" against "gloo", in one run: host processes, or VMs.

    python3 bench/torch-ddp.py [--ranks 2 4] [--repeat 3] [--steps 30] [--hidden 1024]
    python3 bench/torch-ddp.py --vms [--ranks 2 4] [--repeat 3] [--batch 2]

Runs examples/torch/train.py with each backend (interleaved, repetition by
repetition, so the machine's noise spreads over both), keeps rank 0's
median step, compute, update and exchange times (see train.py), and prints per N the median over
repetitions and the ratio gloo / dmlc. Without --vms the ranks are local
processes (the device over the host transport, gloo over loopback TCP).
With --vms each rank is a TCG VM on the host's userland (`dmlc-qemu submit
--host-root`): "dmlc" through the device, "gloo" over virtio-net between
the same kind of VMs. With --vms, --kernel-driver adds "dmlc-kernel": the
device through the kernel driver (kernel-driver/build.sh), whose buckets go
to the device from the tensors' own pages; --nocomm adds train.py's
"nocomm" baseline, whose collectives do nothing: the step with a free
exchange, the floor under any backend. Every run but nocomm's must end with
the same parameters on every rank (each rank prints its own sha256). Needs torch and numpy
(python/venv.sh); builds the release binaries and C library and fetches
the digits data (examples/digits/fetch-data.sh) first.

With --vms, --wait-modes runs "dmlc" once per way the driver waits
(`DMLC_POLL`): "dmlc-poll" (1), "dmlc-interrupt" (0) and "dmlc-hybrid"
(hybrid), to choose the default wait by the step it gives DDP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torchjobs

ROOT = torchjobs.ROOT
TRAIN = torchjobs.EXAMPLES / "train.py"


def run_host(
    backend: str, ranks: int, steps: int, hidden: int, batch: int, port: int
) -> dict[str, float]:
    argv = [str(TRAIN), "--backend", backend, "--steps", str(steps), "--hidden", str(hidden)]
    argv += ["--batch", str(batch), "--json", "-"]
    with tempfile.TemporaryDirectory(prefix="dmlc-ddp-") as tmp:
        codes, outputs = torchjobs.run_host(argv, backend, ranks, port, tmp)
    if any(codes):
        raise SystemExit(f"{backend} with {ranks} ranks failed: exit codes {codes}")
    results = [
        json.loads(line.removeprefix("json: "))
        for out in outputs
        for line in out.splitlines()
        if line.startswith("json: ")
    ]
    if len(results) != ranks:
        raise SystemExit(f"{backend} with {ranks} ranks: {len(results)} ranks printed results")
    if len({r["params_sha256"] for r in results}) != 1:
        raise SystemExit(f"{backend} with {ranks} ranks: the ranks ended with different models")
    return results[0]


# --wait-modes: backend label suffix -> DMLC_POLL.
WAITS = {"poll": "1", "interrupt": "0", "hybrid": "hybrid"}


def run_vms(a: argparse.Namespace, backend: str, ranks: int) -> dict[str, float]:
    """One job of `ranks` TCG VMs through the launcher; rank 0's results.
    `backend` is train.py's, or "dmlc-kernel": "dmlc" over the kernel driver."""
    log_dir = None
    if a.log_dir:
        runs = len(list(a.log_dir.glob(f"{backend}-{ranks}-*")))
        log_dir = a.log_dir / f"{backend}-{ranks}-{runs}"
    flags = []
    if backend == "dmlc-kernel":
        flags += ["--kernel-driver", str(a.kernel_module)]
    train_backend, _, variant = backend.partition("-")
    if variant in WAITS:
        flags += ["--env", f"DMLC_POLL={WAITS[variant]}"]
    argv = [str(TRAIN), "--backend", train_backend, "--steps", str(a.steps)]
    argv += ["--hidden", str(a.hidden), "--batch", str(a.batch)]
    argv += ["--eval-samples", "256", "--json", "-"] + ["--bucket-view"] * a.bucket_view
    argv += ["--interleave"] * a.interleave
    transport = "tcp" if backend == "gloo" else "device"
    p, took = torchjobs.submit(
        ranks, argv, transport=transport, timeout=a.timeout, log_dir=log_dir, flags=flags
    )
    results = {
        r: json.loads(line.removeprefix("json: "))
        for r, lines in torchjobs.rank_lines(p.stdout).items()
        for line in lines
        if line.startswith("json: ")
    }
    if p.returncode or len(results) != ranks:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"{backend} on {ranks} VMs failed: exit status {p.returncode}")
    if backend != "nocomm" and len({r["params_sha256"] for r in results.values()}) != 1:
        raise SystemExit(f"{backend} on {ranks} VMs: the ranks ended with different models")
    print(
        f"#   {backend} on {ranks} VMs: step {results[0]['step_ms']:.1f} ms, "
        f"job {took:.0f} s, params sha256 {results[0]['params_sha256'][:16]}",
        flush=True,
    )
    return results[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vms", action="store_true", help="ranks in TCG VMs (dmlc-qemu submit)")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="samples per rank per step [default: 64 on the host, 2 in VMs, where TCG "
        "computes about 1000x slower than the host and a bigger batch hides the exchange]",
    )
    p.add_argument(
        "--bucket-view",
        action="store_true",
        help="with --vms: pass --bucket-view to train.py (DDP's gradient_as_bucket_view=True)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="with --vms: pass --interleave to train.py (compute measured before every step)",
    )
    p.add_argument(
        "--kernel-driver",
        action="store_true",
        help='with --vms: also "dmlc-kernel", the device through the kernel driver '
        "(builds it with kernel-driver/build.sh)",
    )
    p.add_argument(
        "--nocomm",
        action="store_true",
        help="with --vms: also train.py's nocomm baseline (collectives that do nothing)",
    )
    p.add_argument(
        "--wait-modes",
        action="store_true",
        help='with --vms: "dmlc" once per DMLC_POLL (dmlc-poll, dmlc-interrupt, dmlc-hybrid)',
    )
    p.add_argument("--timeout", type=int, default=1200, help="seconds per VM job")
    p.add_argument("--log-dir", type=Path, help="with --vms: keep each job's logs here")
    a = p.parse_args()
    if a.batch is None:
        a.batch = 2 if a.vms else 64
    if (a.kernel_driver or a.nocomm or a.wait_modes) and not a.vms:
        p.error("--kernel-driver, --nocomm and --wait-modes need --vms")
    dmlc = [f"dmlc-{m}" for m in WAITS] if a.wait_modes else ["dmlc"]
    backends = dmlc + ["dmlc-kernel"] * a.kernel_driver + ["gloo"] + ["nocomm"] * a.nocomm
    if a.kernel_driver:
        built = subprocess.run(
            [str(ROOT / "kernel-driver" / "build.sh")], check=True, capture_output=True, text=True
        ).stdout
        a.kernel_module = next(
            Path(line.split("=", 1)[1])
            for line in built.splitlines()
            if line.startswith("DMLC_KMOD=")
        )
    # The binaries, and train.py's default data file (scikit-learn's digits).
    torchjobs.build(a.vms)
    where = "TCG VMs (1 vCPU, 2 GiB each)" if a.vms else "host processes"
    print(
        f"# torch-ddp.py: MLP 64-{a.hidden}-{a.hidden}-10, batch {a.batch} per rank, "
        f"{a.steps} steps, {a.repeat} repetitions, in {where}; {torchjobs.machine()}",
        flush=True,
    )
    rows = []
    port = 29600
    for n in a.ranks:
        got: dict[str, list[dict[str, float]]] = {b: [] for b in backends}
        for _ in range(a.repeat):
            for backend in backends:
                port += 1
                if a.vms:
                    got[backend].append(run_vms(a, backend, n))
                else:
                    got[backend].append(run_host(backend, n, a.steps, a.hidden, a.batch, port))
        med = {
            b: {
                k: statistics.median(r[k] for r in rs)
                for k in ("step_ms", "compute_ms", "update_ms", "exchange_ms")
            }
            for b, rs in got.items()
        }
        rows.append((n, med, got[dmlc[0]][0]["params"]))
    print(
        f"{'N':>3} {'backend':>14} {'step ms':>9} {'compute ms':>11} {'update ms':>10} "
        f"{'exchange ms':>12}"
    )
    for n, med, _ in rows:
        for b in backends:
            m = med[b]
            print(
                f"{n:>3} {b:>14} {m['step_ms']:>9.2f} {m['compute_ms']:>11.2f} "
                f"{m['update_ms']:>10.2f} {m['exchange_ms']:>12.2f}"
            )
    print()
    for n, med, params in rows:
        for b in (b for b in backends if b != "gloo"):
            step = med["gloo"]["step_ms"] / med[b]["step_ms"]
            line = f"N={n} ({params} parameters): step gloo/{b} {step:.2f}x"
            if b != "nocomm":  # its exchange is nothing by construction
                ex_d = max(med[b]["exchange_ms"], 1e-3)
                line += f", exchange gloo/{b} {med['gloo']['exchange_ms'] / ex_d:.2f}x"
            print(line)


if __name__ == "__main__":
    main()
