#!/bin/sh
# In each VM of bench/kernel-driver.sh: the userspace driver first (the
# device bound to uio_pci_generic, buffers in hugepage DMA memory), then the
# kernel driver in the same VM (rebound to virtio-pci, buffers from malloc).
# Usage: guest-bench.sh ITERS
iters=${1:-1000}
for d in /sys/bus/pci/devices/*; do
    [ "$(cat "$d/vendor")" = 0x1af4 ] && [ "$(cat "$d/device")" = 0x107f ] && dev=$d
done
[ -n "$dev" ] || { echo "no virtio-dmlc device" >&2; exit 1; }
echo uio_pci_generic >"$dev/driver_override"
echo "${dev##*/}" >/sys/bus/pci/drivers_probe
for size in "4 $iters 50" "1M 20 3" "64M 5 2"; do
    set -- $size
    dmlc-guest --poll bench --pci -b "$1" -e "$1" -n "$2" -w "$3" || exit 1
done
# The userspace driver's process is gone (a lost member, then back as the
# kernel driver): dmlc-ktest's first barrier waits for the whole group.
echo "${dev##*/}" >"$dev/driver/unbind"
guest-load.sh || exit 1
dmlc-ktest bench --iters "$iters" || exit 1
dmlc-ktest bench --iters "$iters" --spin-us 0
