#!/bin/bash
# The kernel driver against the userspace driver in the same VMs: 4 B
# allreduce latency, 1 MiB and 64 MiB allreduce time (medians of rank 0).
# The first row is the device's floor: a nop, which the device answers
# for the member alone, through each driver. The userspace driver works on
# its hugepage DMA buffers (zero copy); a
# program with malloc buffers must copy in and out, so its time is shown
# with two 64 MiB memcpys (measured in the same VM) added. The kernel
# driver works on malloc buffers directly (pinned pages), polling and on
# interrupts.
#
# Usage: bench/kernel-driver.sh [-n N] [--iters I] [--repeat R] [--log-dir DIR]
#   -n N        VMs (default 2)
#   --iters I   4 B iterations (default 1000)
#   --repeat R  boot and measure R times; the table gives each cell's
#               median over the runs, after one row per run (default 3)
#   --log-dir   keep the VMs' logs there (of the last run)
# Needs release builds: cargo build --release -p dmlc-guest -p dmlc-qemu
# -p vhost-device-dmlc, and kernel-driver/build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
n=2 iters=1000 repeat=3 logs=()
while [ $# -gt 0 ]; do
    case "$1" in
    -n) n=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --log-dir) logs=(--log-dir "$2"); shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "kernel-driver.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
for b in dmlc-qemu dmlc-guest vhost-device-dmlc; do
    [ -x "target/release/$b" ] || { echo "build target/release/$b first (see --help)" >&2; exit 1; }
done
# shellcheck source=tests/lib/import-env.sh
. tests/lib/import-env.sh
import_env DMLC_KMOD DMLC_KTEST -- kernel-driver/build.sh
outs=()
trap 'rm -f "${outs[@]}"' EXIT
for run in $(seq "$repeat"); do
    out=$(mktemp)
    outs+=("$out")
    echo "# run $run of $repeat: $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg), $n VMs" >&2
    target/release/dmlc-qemu submit -n "$n" --memory 1G --dma 192M --timeout 900 "${logs[@]}" \
        --files "$DMLC_KMOD:/lib/dmlc/virtio_dmlc.ko" --files "$DMLC_KTEST:/usr/bin/dmlc-ktest" \
        --files kernel-driver/tools/guest-load.sh:/usr/bin/guest-load.sh \
        --files kernel-driver/tools/guest-bench.sh:/usr/bin/guest-bench.sh \
        --files target/release/dmlc-guest:/usr/bin/dmlc-guest \
        -- guest-bench.sh "$iters" >"$out"
    grep -E '^\[rank 0\] (ktest|kernel driver|# floor)|^\[rank 0\] +(4|1048576|67108864) ' "$out" >&2 || true
done
python3 - "$n" "${outs[@]}" <<'PY'
import re, statistics, sys

n, files = sys.argv[1], sys.argv[2:]


def run_values(path):
    r0 = [l[len("[rank 0] "):] for l in open(path).read().splitlines() if l.startswith("[rank 0] ")]
    user = {}
    for l in r0:
        f = l.split()
        if len(f) > 16 and f[0].isdigit():
            user[int(f[0])] = float(f[5])
    marks = [i for i, l in enumerate(r0) if l.startswith("kernel driver, malloc buffers")]
    if len(marks) < 2 or set(user) != {4, 1 << 20, 64 << 20}:
        sys.exit(f"bench/kernel-driver.sh: {path}: the guests' output lacks rows")
    poll, intr = r0[marks[0]:marks[1]], r0[marks[1]:]

    def k(sec, pat):
        return next(float(m.group(1)) for l in sec for m in [re.search(pat, l)] if m)

    cp = k(poll, r"memcpy 64 MiB .*median ([0-9.]+)")
    floor = r"nop \(the device's floor\): p50 ([0-9.]+)"
    return [
        (k(r0, r"^# floor: .* p50 ([0-9.]+)"), None, k(poll, floor), k(intr, floor)),
        (user[4], None, k(poll, r"4 B: p50 ([0-9.]+)"), k(intr, r"4 B: p50 ([0-9.]+)")),
        (user[1 << 20], None, k(poll, r"1 MiB: median ([0-9.]+)"), k(intr, r"1 MiB: median ([0-9.]+)")),
        (user[64 << 20], user[64 << 20] + 2 * cp, k(poll, r"64 MiB: median ([0-9.]+)"),
         k(intr, r"64 MiB: median ([0-9.]+)")),
    ], cp


names = ["floor: nop, p50 (us)", "4 B allreduce, p50 (us)", "1 MiB allreduce (us)",
         "64 MiB allreduce (us)"]
runs = [run_values(f) for f in files]
print(f"\nkernel driver vs userspace driver, {n} VMs, rank 0's medians, {len(runs)} runs")
head = "| | userspace (DMA buffers) | userspace + 2 copies | kernel, poll (malloc) | kernel, interrupt | kernel poll / userspace (+ copies) |"
print(head)
print("|---|---|---|---|---|---|")


def row(name, u, uc, kp, ki):
    base = uc if uc is not None else u
    ucs = f"{uc:.1f}" if uc is not None else "-"
    print(f"| {name} | {u:.1f} | {ucs} | {kp:.1f} | {ki:.1f} | {kp / base:.2f}x |")


for i, (vals, cp) in enumerate(runs):
    for name, v in zip(names, vals):
        row(f"run {i + 1}: {name}", *v)
for j, name in enumerate(names):
    cells = [statistics.median(r[0][j][c] for r in runs) if runs[0][0][j][c] is not None else None
             for c in range(4)]
    row(f"**median: {name}**", *cells)
print(f"memcpy 64 MiB in the VM (malloc to malloc), median of runs: "
      f"{statistics.median(cp for _, cp in runs):.0f} us")
PY
