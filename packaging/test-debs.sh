#!/bin/bash
# Installs the Debian packages of packaging/build-debs.sh into a clean
# Debian 12 root and uses them there (issue 41, item 1), the service unit
# (item 2) included. Needs root.
#
# Usage: packaging/test-debs.sh [--debs DIR] [--keep]
#   --debs DIR   test the .debs in DIR (default: build them with
#                packaging/build-debs.sh into a temporary folder)
#   --keep       keep the unpacked root (its path is printed) instead of
#                removing it
#
# In the root (a copy of a cached bookworm tarball made by mmdebstrap, entered
# with chroot in private mount and network namespaces; the checks are
# packaging/test-in-root.sh's):
#   - `apt-get install ./*.deb` of all five packages (their Depends resolved
#     by apt, maintainer scripts run: the vhost-dmlc user, dkms add);
#   - `vhost-device-dmlc --help`, `dmlc-ctl --help`, `dmlc-guest --help`;
#   - `pkg-config --cflags --libs dmlc-guest`, then a small C program compiled
#     and linked with those flags that calls dmlc_abi_version(),
#     dmlc_version() and dmlc_strerror() and runs (its NEEDED entry is the
#     soname, found by ld.so in the system's library path);
#   - `dkms build` and `dkms install` of virtio_dmlc for the guest image's
#     kernel (tests/image/build-image.sh --headers names it), against
#     Debian's linux-headers package of that kernel installed in the root;
#     the module's vermagic must name that kernel;
#   - packaging/test-service.sh: the unit verified with systemd-analyze, and
#     the daemon run with the unit's own command line and config (see that
#     script);
#   - `apt-get purge` of every package leaves no file of theirs behind.
#
# The root is cached under $DMLC_CACHE/debian-root/ keyed by the mirror, the
# suite and the package list (Debian's base, plus systemd, gcc, pkg-config,
# dkms and the guest kernel's headers, which the checks need): the first run
# downloads it (mmdebstrap from apt, installed when missing; 25 to 45 s), later
# runs unpack it (the whole test then takes 10 to 25 s).
#
# Environment: DMLC_CACHE (cache root, default ~/.cache/virtio-dmlc),
# DMLC_DEBIAN_MIRROR (a Debian mirror URI; default: the machine's own).

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" test-debs || exit 1
# shellcheck source=SCRIPTDIR/../tests/lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/ensure-packages.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
debs=""
keep=0
while [ $# -gt 0 ]; do
    case "$1" in
    --debs)
        [ $# -ge 2 ] || die "--debs needs a folder"
        debs=$(cd "$2" && pwd) || die "no folder $2"
        shift 2
        ;;
    --keep)
        keep=1
        shift
        ;;
    -h | --help)
        script_header
        exit 0
        ;;
    *)
        echo "test-debs.sh: unknown option $1 (try --help)" >&2
        exit 2
        ;;
    esac
done
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap, chroot, mount)"
ensure_packages mmdebstrap util-linux iproute2

work=$(mktemp -d "${TMPDIR:-/tmp}/dmlc-test-debs.XXXXXX")
cleanup() {
    if [ "$keep" = 1 ]; then
        log "kept $work"
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT

if [ -z "$debs" ]; then
    debs=$work/debs
    "$here/build-debs.sh" --out "$debs" >/dev/null
fi
# shellcheck disable=SC2012 # our own plain file names
[ "$(ls "$debs"/*.deb 2>/dev/null | wc -l)" -eq 5 ] || die "expected 5 .debs in $debs"

# The guest image's kernel, and the cached Debian headers of it.
hdr=$("$repo/tests/image/build-image.sh" --headers | sed -n 's/^DMLC_KERNEL_HEADERS=//p')
kver=$(basename "$hdr")
kver=${kver#linux-headers-}
[ -n "$kver" ] || die "tests/image/build-image.sh --headers named no kernel"

# The mirror, as tests/image/build-image.sh finds it.
# shellcheck source=/dev/null
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/debian-mirror.sh"
mirror=$(debian_mirror)
security=${mirror%/debian}/debian-security
# The headers: the very .debs build-image.sh downloaded and keeps (the mirror
# drops a kernel's packages once a newer ABI replaces it), else the mirror's.
headers=linux-headers-$kver
hdebs=()
for role in headers headers-common kbuild; do
    f=$CACHE/image/debs/$role-$kver.deb
    [ -f "$f" ] && hdebs+=("$(readlink -f "$f")")
done
if [ ${#hdebs[@]} -eq 3 ]; then
    headers=$(
        IFS=,
        echo "${hdebs[*]}"
    )
fi
include="systemd,gcc,libc6-dev,make,pkg-config,dkms,$headers"
sources=("deb $mirror bookworm main" "deb $mirror bookworm-updates main" "deb $security bookworm-security main")
key=$( (printf '%s\n' "v2 variant=apt" "$include" "${sources[@]}" && cat "${hdebs[@]}") | sha256sum | cut -c1-16)
rootdir=$CACHE/debian-root
tarball=$rootdir/bookworm-$key.tar
cache_lock "$rootdir/.lock"
if [ ! -f "$tarball" ]; then
    log "making a Debian 12 root with mmdebstrap (once; cached as $tarball)"
    nice -n 19 mmdebstrap --variant=apt --format=tar --include="$include" --skip=cleanup/apt/lists \
        --hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount \
        bookworm "$tarball.part" "${sources[@]}" >&2 || die "mmdebstrap failed"
    mv "$tarball.part" "$tarball"
    # shellcheck disable=SC2012 # our own plain file names
    ls -t "$rootdir"/bookworm-*.tar | tail -n +3 | xargs -r rm -f
fi
cache_unlock

root=$work/root
mkdir -p "$root"
log "unpacking the root into $root"
tar -C "$root" -xf "$tarball"
mkdir -p "$root/debs"
cp "$debs"/*.deb "$root/debs/"
cp "$here/test-in-root.sh" "$here/test-service.sh" "$root/"

log "installing and using the packages in the root (kernel $kver)"
# A private mount namespace (the mounts go with it) and network namespace
# (only a loopback: no downloads, and the config's metrics port is free).
# shellcheck disable=SC2016 # expanded by the inner shell
unshare --mount --net --fork --propagation private sh -ec '
    root=$1
    ip link set lo up
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount -t tmpfs tmpfs "$root/tmp"
    exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 /bin/bash /test-in-root.sh "$2"
' test-debs "$root" "$kver" >&2 || die "the checks in the Debian 12 root failed"
log "all package checks passed"
