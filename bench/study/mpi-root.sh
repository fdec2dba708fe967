#!/bin/bash
# Debian's guest root of another architecture with Open MPI's launcher, for
# the study's MPI sweeps in VMs of that architecture: a copy of
# tests/image/build-rootfs.sh's root with openmpi-bin and openmpi-common
# (mpirun, prted, their help texts) and libopenmpi-dev's C headers unpacked
# into it. The root already holds Open MPI's libraries (torch depends on
# them); the headers let the study cross-compile bench/mpi_allreduce.c
# against them (bench/study/prepare.py).
#
# Usage: bench/study/mpi-root.sh --arch aarch64|riscv64
#
# Output: progress on stderr; stdout's last line is DMLC_MPI_ROOTFS=/abs/dir
#
# Why not in build-rootfs.sh's package list: every edit there changes every
# root's key, and an arm64 root takes about 25 minutes to build again under
# qemu-user; this copy takes about a minute and runs nothing emulated. The
# packages are unpacked, not installed (no maintainer scripts: they would
# only register the mpirun alternative, made here as a link). The version
# unpacked must be that of the root's libopenmpi40, or the script fails.
#
# Cache: $DMLC_CACHE/study/roots/<arch>-<key>/, key = a hash of this script
# and the base root's directory name (its own key); the newest per
# architecture is kept.

# shellcheck source=SCRIPTDIR/../../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/lib/prologue.sh" mpi-root || exit 1
# shellcheck source=SCRIPTDIR/../../tests/lib/debian-mirror.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/lib/debian-mirror.sh"

arch=
while [ $# -gt 0 ]; do
    case "$1" in
    -h | --help)
        script_header
        exit 0
        ;;
    --arch)
        [ $# -ge 2 ] || die "--arch needs a value"
        arch=$2
        shift 2
        ;;
    *) die "unknown argument '$1' (--help)" ;;
    esac
done
case "$arch" in
aarch64) debarch=arm64 ;;
riscv64) debarch=riscv64 ;;
*) die "--arch aarch64 or riscv64 (x86_64 VMs run this host's Open MPI)" ;;
esac
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap's root mode)"

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
base=$("$repo/tests/image/build-rootfs.sh" --arch "$arch" | tail -n 1)
base=${base#DMLC_ROOTFS=}
[ -d "$base" ] || die "tests/image/build-rootfs.sh --arch $arch gave no root"
key=$({
    sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1
    basename "$base"
} | sha256sum | cut -c1-16)
roots=$CACHE/study/roots
out=$roots/$arch-$key

if [ ! -f "$out/.done" ]; then
    cache_lock "$roots/.lock-$arch"
    if [ ! -f "$out/.done" ]; then
        t0=$SECONDS
        want=$(dpkg-query --admindir="$base/var/lib/dpkg" -W -f='${Version}' libopenmpi40) ||
            die "$base has no libopenmpi40"
        find "$roots" -maxdepth 1 -name ".tmp-$arch-*" -exec rm -rf --one-file-system {} +
        tmp=$(mktemp -d "$roots/.tmp-$arch-$key.XXXXXX")
        # shellcheck disable=SC2064 # expand $tmp now
        trap "rm -rf --one-file-system '$tmp'" EXIT
        log "fetching openmpi-bin, openmpi-common and libopenmpi-dev $want ($debarch)"
        mirror=$(debian_mirror)
        # extract: download and unpack (dependencies too), run nothing; the
        # three .debs are taken from its apt cache before it is emptied.
        mkdir "$tmp/debs"
        mmdebstrap --mode=root --variant=extract --arch="$debarch" -q \
            --include="openmpi-bin=$want,openmpi-common=$want,libopenmpi-dev=$want" \
            --aptopt='APT::Install-Recommends "false"' \
            --extract-hook="sync-out /var/cache/apt/archives $tmp/debs" \
            trixie "$tmp/fetch" "deb $mirror trixie main" "deb $mirror trixie-updates main" ||
            die "mmdebstrap could not fetch Open MPI $want for $debarch"
        log "copying $base"
        cp -a --reflink=auto "$base" "$tmp/root"
        rm -f "$tmp/root/.done"
        for p in openmpi-bin openmpi-common libopenmpi-dev; do
            deb=$(find "$tmp/debs" -name "${p}_*_*.deb" | head -n 1)
            [ -n "$deb" ] || die "no $p .deb was fetched"
            if [ "$p" = libopenmpi-dev ]; then
                dpkg-deb --fsys-tarfile "$deb" |
                    tar -x -C "$tmp/root" --wildcards './usr/lib/*/openmpi/include'
            else
                dpkg-deb -x "$deb" "$tmp/root"
            fi
        done
        # What openmpi-bin's postinst would register as alternatives.
        ln -sf mpirun.openmpi "$tmp/root/usr/bin/mpirun"
        ln -sf mpirun.openmpi "$tmp/root/usr/bin/mpiexec"
        rm -rf --one-file-system "$tmp/fetch" "$tmp/debs"
        touch "$tmp/root/.done"
        mv -T "$tmp/root" "$out"
        rm -rf --one-file-system "$tmp"
        trap - EXIT
        log "made $out in $((SECONDS - t0)) s"
        find "$roots" -mindepth 1 -maxdepth 1 -type d -name "$arch-*" ! -path "$out" \
            -exec rm -rf --one-file-system {} +
    fi
    cache_unlock
else
    log "cached $out"
fi
echo "DMLC_MPI_ROOTFS=$out"
