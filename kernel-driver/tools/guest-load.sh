#!/bin/sh
# In a guest of tests/image: load virtio_dmlc and hand the virtio-dmlc PCI
# device to virtio-pci (the image's init keeps it unbound, for the
# userspace driver), then wait for /dev/dmlc0.
# Usage: guest-load.sh [MODULE.ko] [PARAM=VALUE...]
#   MODULE.ko     default /lib/dmlc/virtio_dmlc.ko
#   PARAM=VALUE   module parameters (docs/kernel-driver.md), e.g. comm=0
ko=/lib/dmlc/virtio_dmlc.ko
params=
for a in "$@"; do
    case $a in
    *=*) params="$params $a" ;;
    *) ko=$a ;;
    esac
done
# shellcheck disable=SC2086 # one word per parameter
grep -q '^virtio_dmlc ' /proc/modules || insmod "$ko" $params || exit 1
for d in /sys/bus/pci/devices/*; do
    [ "$(cat "$d/vendor")" = 0x1af4 ] && [ "$(cat "$d/device")" = 0x107f ] || continue
    [ -e "$d/driver" ] && echo "${d##*/}" >"$d/driver/unbind"
    echo virtio-pci >"$d/driver_override"
    echo "${d##*/}" >/sys/bus/pci/drivers_probe
done
for _ in $(seq 50); do
    [ -e /dev/dmlc0 ] && exit 0
    sleep 0.1
done
echo "guest-load.sh: no /dev/dmlc0 after binding the device" >&2
dmesg | grep -i dmlc | tail -n 5 >&2
exit 1
