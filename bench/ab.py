#!/usr/bin/env python3
"""Two builds of the device, one size, interleaved: which is faster, in the
same minutes of a shared machine.

  bench/ab.py BEFORE_DIR AFTER_DIR [--ranks 2,4] [--size 64M] [--rounds 3]
              [--modes poll,interrupt] [--iters 20] [--warmup 5]

BEFORE_DIR and AFTER_DIR hold a release dmlc-guest and vhost-device-dmlc
each (`dmlc-guest local` starts the backend beside itself). Every round runs
`dmlc-guest --poll|--interrupt|--hybrid local --ranks N -- bench -b SIZE -e SIZE` for every
mode, N and build in turn, and takes rank 0's out-of-place p50 and 2·N·S/t
(membw) from the table it prints. The summary gives per configuration the
median over the rounds and the ratio after / before, with the load average
before and after.
"""

import argparse
import os
import subprocess
import sys


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def median(xs):
    xs = sorted(xs)
    k = len(xs)
    return xs[k // 2] if k % 2 else (xs[k // 2 - 1] + xs[k // 2]) / 2


def run(guest, mode, n, size, args):
    cmd = [guest, {"poll": "--poll", "interrupt": "--interrupt", "hybrid": "--hybrid"}[mode]] + [
        "local", "--ranks", str(n), "--", "bench", "-b", str(size), "-e", str(size),
        "-n", str(args.iters), "-w", str(args.warmup)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"ab.py: {' '.join(cmd)} failed with status {out.returncode}")
    for line in out.stdout.splitlines():
        f = line.split()
        if f and f[0] == str(size):
            # size count type redop root time algbw busbw #wrong ... membw
            return float(f[5]), float(f[-1]), int(f[8])
    raise SystemExit(f"ab.py: no row for {size} bytes in the output of {' '.join(cmd)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--size", default="64M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="poll,interrupt")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    size = parse_size(args.size)
    ranks = [int(n) for n in args.ranks.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    builds = {"before": os.path.join(args.before, "dmlc-guest"), "after": os.path.join(args.after, "dmlc-guest")}
    load_before = loadavg()
    got = {}
    for _ in range(args.rounds):
        for mode in modes:
            for n in ranks:
                for name, guest in builds.items():
                    got.setdefault((mode, n, name), []).append(run(guest, mode, n, size, args))
    print(f"# ab.py: {size} B f32 sum allreduce, out of place, median of {args.rounds} interleaved rounds "
          f"(each the p50 of {args.iters} iterations after {args.warmup}); load average {load_before} "
          f"before, {loadavg()} after")
    print("| mode | N | p50 before (us) | p50 after (us) | 2·N·S/t before (GB/s) | 2·N·S/t after (GB/s) | "
          "after / before | #wrong |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        for n in ranks:
            b, a = got[(mode, n, "before")], got[(mode, n, "after")]
            tb, ta = median([r[0] for r in b]), median([r[0] for r in a])
            mb, ma = median([r[1] for r in b]), median([r[1] for r in a])
            wrong = sum(r[2] for r in b + a)
            print(f"| {mode} | {n} | {tb:.0f} | {ta:.0f} | {mb:.2f} | {ma:.2f} | {ma / mb:.2f}x | {wrong} |")


if __name__ == "__main__":
    main()
