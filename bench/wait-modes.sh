#!/bin/bash
# The driver's three ways of waiting, in the same TCG VMs: pure polling,
# pure interrupts and the hybrid wait (spin up to 200 us, then sleep on the
# interrupt). For each: the 4 B allreduce p50 (and the device's floor, a
# nop), and, while rank 0 waits 50 ms per round for a late rank 1, the share
# of that wait rank 0's process is on its vCPU (the guest's own CPU time
# over wall time; `dmlc-guest debug late-peer`).
#
# Usage: bench/wait-modes.sh [-n N] [--iters I] [--rounds R] [--repeat K]
#   -n N        VMs (default 2)
#   --iters I   4 B iterations per mode (default 500)
#   --rounds R  late-peer rounds per mode (default 20)
#   --repeat K  boot and measure K times; the table gives medians (default 3)
# Needs release builds: cargo build --release -p dmlc-guest -p dmlc-qemu
# -p vhost-device-dmlc.
set -euo pipefail
cd "$(dirname "$0")/.."
n=2 iters=500 rounds=20 repeat=3
while [ $# -gt 0 ]; do
    case "$1" in
    -n) n=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "wait-modes.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
for b in dmlc-qemu dmlc-guest vhost-device-dmlc; do
    [ -x "target/release/$b" ] || { echo "build target/release/$b first (see --help)" >&2; exit 1; }
done
guest=$(mktemp)
outs=("$guest")
trap 'rm -f "${outs[@]}"' EXIT
# In each VM: the device to uio_pci_generic (interrupts for the userspace
# driver), then every mode's bench and late-peer run.
cat >"$guest" <<GUEST
#!/bin/sh
for d in /sys/bus/pci/devices/*; do
    [ "\$(cat "\$d/vendor")" = 0x1af4 ] && [ "\$(cat "\$d/device")" = 0x107f ] && dev=\$d
done
[ -n "\$dev" ] || { echo "no virtio-dmlc device" >&2; exit 1; }
echo uio_pci_generic >"\$dev/driver_override"
echo "\${dev##*/}" >/sys/bus/pci/drivers_probe
for mode in --poll --interrupt --hybrid; do
    echo "mode \$mode"
    dmlc-guest --pci \$mode bench -b 4 -e 4 -n $iters -w $((iters / 10)) || exit 1
    dmlc-guest --pci \$mode debug late-peer --rounds $rounds || exit 1
done
GUEST
for run in $(seq "$repeat"); do
    out=$(mktemp)
    outs+=("$out")
    echo "# run $run of $repeat: $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg), $n VMs" >&2
    target/release/dmlc-qemu submit -n "$n" --memory 512M --timeout 900 \
        --files "$guest:/usr/bin/wait-modes.sh" \
        --files target/release/dmlc-guest:/usr/bin/dmlc-guest \
        -- sh /usr/bin/wait-modes.sh >"$out"
    grep -E '^\[rank 0\] (mode|late-peer|# floor)|^\[rank 0\] +4 ' "$out" >&2 || true
done
python3 - "$n" "${outs[@]:1}" <<'PY'
import re, statistics, sys

n, files = sys.argv[1], sys.argv[2:]
modes = ["--poll", "--interrupt", "--hybrid"]


def run_values(path):
    vals, mode = {}, None
    for line in open(path).read().splitlines():
        if not line.startswith("[rank 0] "):
            continue
        l = line[len("[rank 0] "):]
        if l.startswith("mode "):
            mode = l.split()[1]
            vals[mode] = {}
        elif m := re.search(r"^# floor: .* p50 ([0-9.]+)", l):
            vals[mode]["floor"] = float(m.group(1))
        elif (f := l.split()) and f[0] == "4" and len(f) > 10:
            vals[mode]["p50"] = float(f[5])
        elif m := re.search(r"waited ([0-9.]+) ms .* CPU busy ([0-9.]+)%", l):
            vals[mode]["wait"], vals[mode]["busy"] = float(m.group(1)), float(m.group(2))
    for mode in modes:
        if set(vals.get(mode, {})) != {"floor", "p50", "wait", "busy"}:
            sys.exit(f"bench/wait-modes.sh: {path}: no complete output for {mode}")
    return vals


runs = [run_values(f) for f in files]
med = lambda mode, k: statistics.median(r[mode][k] for r in runs)
print(f"\nwait modes, {n} TCG VMs, rank 0, medians of {len(runs)} boots")
print("| mode | 4 B p50 (us) | / poll | floor p50 (us) | waiting 50 ms for a late peer: wait (ms) | vCPU busy |")
print("|---|---|---|---|---|---|")
for mode in modes:
    print(f"| {mode[2:]} | {med(mode, 'p50'):.1f} | {med(mode, 'p50') / med('--poll', 'p50'):.2f}x "
          f"| {med(mode, 'floor'):.1f} | {med(mode, 'wait'):.1f} | {med(mode, 'busy'):.1f}% |")
PY
