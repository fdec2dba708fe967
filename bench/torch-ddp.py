"""DDP with backend "dmlc" against "gloo", on the host transport, in one run.

    python3 bench/torch-ddp.py [--ranks 2 4] [--repeat 3] [--steps 30] [--hidden 1024]

Runs examples/torch/train.py on N local processes with each backend
(interleaved, repetition by repetition, so the machine's noise spreads over
both), keeps rank 0's median step, compute and exchange times, and prints
per N the median over repetitions and the ratio gloo / dmlc. Every run must
end with the same parameters on every rank (each rank prints its own
sha256). Needs torch and numpy (python/venv.sh), and builds the release C
library and backend first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "torch" / "train.py"


def run(backend: str, ranks: int, steps: int, hidden: int, port: int) -> dict[str, float]:
    target = ROOT / "target" / "release"
    with tempfile.TemporaryDirectory(prefix="dmlc-ddp-") as tmp:
        daemon = None
        if backend == "dmlc":
            daemon = subprocess.Popen(
                [
                    str(target / "vhost-device-dmlc"),
                    "--socket-path",
                    f"{tmp}/d.sock",
                    "--socket-count",
                    str(ranks),
                    "--log-level",
                    "warn",
                ]
            )
            deadline = time.monotonic() + 20
            while not all(Path(f"{tmp}/d.sock{r}").exists() for r in range(ranks)):
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit("the backend did not start")
                time.sleep(0.01)
        env = dict(
            os.environ,
            DMLC_LIBRARY=str(target / "libdmlc_guest.so"),
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT / "python" / "src"),
        )
        procs = []
        for r in range(ranks):
            renv = dict(env, RANK=str(r), WORLD_SIZE=str(ranks), DMLC_SOCKET=f"{tmp}/d.sock{r}")
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(TRAIN),
                        "--backend",
                        backend,
                        "--steps",
                        str(steps),
                        "--hidden",
                        str(hidden),
                        "--json",
                        f"{tmp}/r{r}.json",
                    ],
                    env=renv,
                    stdout=subprocess.DEVNULL,
                )
            )
        codes = [p.wait(600) for p in procs]
        if daemon is not None:
            daemon.terminate()
            daemon.wait(10)
        if any(codes):
            raise SystemExit(f"{backend} with {ranks} ranks failed: exit codes {codes}")
        results = [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(ranks)]
    if len({r["params_sha256"] for r in results}) != 1:
        raise SystemExit(f"{backend} with {ranks} ranks: the ranks ended with different models")
    return results[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=1024)
    a = p.parse_args()
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "dmlc-capi", "-p", "vhost-device-dmlc"],
        cwd=ROOT,
        check=True,
    )
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"# torch-ddp.py: MLP 64-{a.hidden}-{a.hidden}-10, {a.steps} steps, "
        f"{a.repeat} repetitions; {os.cpu_count()} CPUs, load average {' '.join(load)}"
    )
    rows = []
    port = 29600
    for n in a.ranks:
        got: dict[str, list[dict[str, float]]] = {"dmlc": [], "gloo": []}
        for _ in range(a.repeat):
            for backend in ("dmlc", "gloo"):
                port += 1
                got[backend].append(run(backend, n, a.steps, a.hidden, port))
        med = {
            b: {
                k: statistics.median(r[k] for r in rs)
                for k in ("step_ms", "compute_ms", "exchange_ms")
            }
            for b, rs in got.items()
        }
        rows.append((n, med, got["dmlc"][0]["params"]))
    print(f"{'N':>3} {'backend':>8} {'step ms':>9} {'compute ms':>11} {'exchange ms':>12}")
    for n, med, _ in rows:
        for b in ("dmlc", "gloo"):
            m = med[b]
            print(
                f"{n:>3} {b:>8} {m['step_ms']:>9.2f} {m['compute_ms']:>11.2f} "
                f"{m['exchange_ms']:>12.2f}"
            )
    print()
    for n, med, params in rows:
        step = med["gloo"]["step_ms"] / med["dmlc"]["step_ms"]
        ex_d = max(med["dmlc"]["exchange_ms"], 1e-3)
        print(
            f"N={n} ({params} parameters): step gloo/dmlc {step:.2f}x, "
            f"exchange gloo/dmlc {med['gloo']['exchange_ms'] / ex_d:.2f}x"
        )


if __name__ == "__main__":
    main()
