"""Point-to-point (sendrecv) or all-to-all in TCG VMs: the device against
gloo over virtio-net and against the project's TCP Communicator, between
the same VMs in one boot.

    "$(python/venv.sh)/bin/python" bench/p2p-vms.py [--ranks 2] [--opcode sendrecv]
        [--repeat 3] [--iters 10] [--maxbytes 64M]

Builds the release binaries, then runs bench/guest-p2p.py in every VM
through `dmlc-qemu submit --host-root --transport tcp` (each VM has the
device and virtio-net). Prints rank 0's raw lines, then per size the
median over repetitions of each path's median time, and the ratios
gloo / device and TCP / device. Needs torch (python/venv.sh).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\[rank 0\] (.*)$")


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def show_size(b: int) -> str:
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{suffix}"
    return str(b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="VMs, one rank each (default 2)")
    p.add_argument(
        "--opcode",
        choices=["sendrecv", "alltoall"],
        default="sendrecv",
        help="sendrecv: a ring shift, every rank sends to the next and receives from the previous; "
        "alltoall: equal blocks (default sendrecv)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="interleaved runs of every path in one boot; medians are over them (default 3)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=10,
        help="timed operations per size and path (default 10)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed operations before them (default 2)",
    )
    p.add_argument(
        "--minbytes",
        default="4",
        help="smallest message per rank, K/M/G suffixes (default 4)",
    )
    p.add_argument("--maxbytes", default="64M", help="largest message per rank (default 64M)")
    p.add_argument("--factor", type=int, default=4, help="size step between rows (default 4)")
    p.add_argument("--memory", default="2G", help="RAM per VM")
    p.add_argument("--timeout", type=int, default=3600, help="seconds for the whole job")
    a = p.parse_args()

    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "dmlc-guest", "-p", "dmlc-qemu"],
        cwd=ROOT,
        check=True,
    )
    target = ROOT / "target" / "release"
    cmd = [str(target / "dmlc-qemu"), "submit", "-n", str(a.ranks), "--host-root"]
    # dmlc-guest bench holds an input and an output pool, each at least the
    # largest message and its rotation span (2 x LLC / N, tens of MiB).
    dma_mib = (2 * max(parse_size(a.maxbytes), 64 << 20) + (16 << 20)) >> 20
    dma_mib += dma_mib % 2  # whole 2 MiB hugepages
    cmd += ["--memory", a.memory, "--dma", f"{dma_mib}M"]
    cmd += ["--timeout", str(a.timeout), "--transport", "tcp"]
    cmd += ["--env", f"DMLC_GUEST_BIN={target / 'dmlc-guest'}"]
    cmd += [
        "--",
        sys.executable,
        str(ROOT / "bench" / "guest-p2p.py"),
        "--opcode",
        a.opcode,
    ]
    cmd += [
        "--repeat",
        str(a.repeat),
        "--iters",
        str(a.iters),
        "--warmup",
        str(a.warmup),
    ]
    cmd += [
        "--minbytes",
        str(parse_size(a.minbytes)),
        "--maxbytes",
        str(parse_size(a.maxbytes)),
    ]
    cmd += ["--factor", str(a.factor)]
    print("# " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    doc = None
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        if m.group(1).startswith("p2p-json: "):
            doc = json.loads(m.group(1)[len("p2p-json: ") :])
        else:
            print(m.group(1))
    if proc.returncode or doc is None:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-3000:])
        raise SystemExit(f"the VM job failed: exit status {proc.returncode}")

    paths = list(doc["runs"])
    per: dict[str, dict[int, float]] = {}
    wrong = 0
    for path, runs in doc["runs"].items():
        by_size: dict[int, list[float]] = {}
        for rows in runs:
            for r in rows:
                by_size.setdefault(r["size"], []).append(r["time_us"])
                wrong += r["wrong"]
        per[path] = {s: statistics.median(v) for s, v in by_size.items()}
    sizes = sorted(set().union(*[set(v) for v in per.values()]))
    print()
    print(
        f"{doc['opcode']}, N = {doc['world']} TCG VMs: per size the median over {a.repeat} "
        f"interleaved runs of rank 0's median of {doc['iters']} iterations (us); "
        f"#wrong over every path and run: {wrong}"
    )
    print()
    others = [x for x in paths if x != "device"]
    head = ["size"] + [f"{x} p50 (us)" for x in paths]
    head += [f"{x} / device" for x in others if "device" in per]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for s in sizes:
        cells = [show_size(s)] + [f"{per[x][s]:.1f}" if s in per[x] else "" for x in paths]
        dev = per.get("device", {}).get(s)
        for x in others:
            if "device" in per:
                t = per[x].get(s)
                cells.append(f"{t / dev:.1f}x" if t and dev else "")
        print("| " + " | ".join(cells) + " |")
    if wrong:
        raise SystemExit(f"{wrong} wrong values")


if __name__ == "__main__":
    main()
