#!/bin/bash
# Builds the Debian packages of virtio-dmlc (amd64, Debian 12) from this
# tree, with dpkg-deb from staged trees (docs/packaging.md says why):
#   vhost-device-dmlc   the daemon, dmlc-ctl, the template unit
#                       vhost-device-dmlc@.service, its default config
#                       /etc/vhost-device-dmlc/group0.conf (a conffile), the
#                       sysusers.d file of its user vhost-dmlc, the Grafana
#                       dashboard
#   libdmlc-guestN      libdmlc_guest.so.N (N: DMLC_ABI_VERSION of
#                       capi/include/dmlc_guest.h, the SONAME's number)
#   libdmlc-guest-dev   the headers, dmlc-guest.pc, the libdmlc_guest.so link
#   dmlc-guest          the guest tool dmlc-guest
#   virtio-dmlc-dkms    the kernel module's source under /usr/src with its
#                       dkms.conf, built by dkms on install
#
# Usage: packaging/build-debs.sh [--out DIR] [--no-build]
#   --out DIR    where the .debs go (default target/debian); the folder's
#                old .debs are removed first
#   --no-build   package the release binaries already in target/release
#                instead of running cargo build --release first
#
# Output: progress on stderr; on stdout the path of each .deb, one a line.
# Environment: DEBEMAIL / DEBFULLNAME set the packages' Maintainer field.

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" build-debs || exit 1
# shellcheck source=SCRIPTDIR/../tests/lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/ensure-packages.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
out=$repo/target/debian
build=1
while [ $# -gt 0 ]; do
    case "$1" in
    --out)
        [ $# -ge 2 ] || die "--out needs a folder"
        out=$2
        shift 2
        ;;
    --no-build)
        build=0
        shift
        ;;
    -h | --help)
        script_header
        exit 0
        ;;
    *)
        echo "build-debs.sh: unknown option $1 (try --help)" >&2
        exit 2
        ;;
    esac
done

# dpkg-shlibdeps (dpkg-dev) computes the Depends of the ELF files; patchelf
# gives the library its SONAME (see below); binutils strips.
ensure_packages dpkg-dev patchelf binutils
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
[ "$arch" = amd64 ] || log "warning: built on $arch, tested only on amd64"

version=$(cd "$repo" && cargo pkgid -p dmlc-capi | sed 's/.*[@#]//')
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "unexpected workspace version '$version'"
debversion=$version-1
abi=$(sed -nE 's/^#define DMLC_ABI_VERSION ([0-9]+)u$/\1/p' "$repo/capi/include/dmlc_guest.h")
[ -n "$abi" ] || die "no DMLC_ABI_VERSION in capi/include/dmlc_guest.h"
soname=libdmlc_guest.so.$abi
libpkg=libdmlc-guest$abi
kmod_version=$(sed -nE 's/^PACKAGE_VERSION="(.*)"$/\1/p' "$repo/kernel-driver/dkms.conf")
[ "$kmod_version" = "$version" ] ||
    die "kernel-driver/dkms.conf has PACKAGE_VERSION $kmod_version, the workspace $version"
# Reproducible file times in the .debs (dpkg-deb clamps to it).
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)}
maintainer="${DEBFULLNAME:-virtio-dmlc developers} <${DEBEMAIL:-virtio-dmlc@localhost}>"

if [ "$build" = 1 ]; then
    log "cargo build --release (vhost-device-dmlc, dmlc-ctl, dmlc-guest, libdmlc_guest.so)"
    (cd "$repo" && nice -n 19 cargo build --release --locked -q \
        -p vhost-device-dmlc -p dmlc-guest -p dmlc-capi) >&2 || die "cargo build failed"
fi
rel=$repo/target/release
for f in vhost-device-dmlc dmlc-ctl dmlc-guest libdmlc_guest.so; do
    [ -f "$rel/$f" ] || die "$rel/$f is missing (run without --no-build)"
done

work=$(mktemp -d "${TMPDIR:-/tmp}/dmlc-debs.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
rm -f "$out"/*.deb

# The copyright file every package carries.
copyright() {
    local dir=$1/usr/share/doc/$2 license=$3
    mkdir -p "$dir"
    cat >"$dir/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: virtio-dmlc

Files: *
Copyright: the virtio-dmlc developers
License: $license
COPYRIGHT
}

# install_elf SRC DEST: a stripped copy, as Debian's packages ship them.
install_elf() {
    install -D -m "$3" "$1" "$2"
    strip --strip-unneeded --remove-section=.comment --remove-section=.note "$2"
}

# The shared libraries' packages that the ELF files in $@ need, as a
# Depends value (dpkg-shlibdeps reads a debian/control; give it one).
shlib_depends() {
    local d=$work/shlibdeps
    mkdir -p "$d/debian"
    printf 'Source: virtio-dmlc\n\nPackage: x\nArchitecture: any\n' >"$d/debian/control"
    (cd "$d" && dpkg-shlibdeps -O "$@" 2>/dev/null) | sed -n 's/^shlibs:Depends=//p'
}

# control DIR NAME FIELDS...: DEBIAN/control, Installed-Size computed.
control() {
    local root=$1 name=$2
    shift 2
    mkdir -p "$root/DEBIAN"
    {
        echo "Package: $name"
        echo "Version: $debversion"
        echo "Maintainer: $maintainer"
        echo "Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)"
        printf '%s\n' "$@"
    } >"$root/DEBIAN/control"
}

script() { # script DIR NAME FILE: a maintainer script from packaging/debian
    sed "s/@VERSION@/$version/g" "$here/debian/$3" >"$1/DEBIAN/$2"
    chmod 0755 "$1/DEBIAN/$2"
}

build_deb() {
    local root=$1 name=$2 deb
    deb=$out/${name}_${debversion}_$(sed -n 's/^Architecture: //p' "$root/DEBIAN/control").deb
    dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null || die "dpkg-deb $name failed"
    log "built $(basename "$deb") ($(du -k "$deb" | cut -f1) KiB)"
    echo "$deb"
}

# ---- vhost-device-dmlc -------------------------------------------------------
python3 -m json.tool "$here/grafana/vhost-device-dmlc.json" >/dev/null ||
    die "packaging/grafana/vhost-device-dmlc.json is not valid JSON"
p=$work/vhost-device-dmlc
install_elf "$rel/vhost-device-dmlc" "$p/usr/bin/vhost-device-dmlc" 0755
install_elf "$rel/dmlc-ctl" "$p/usr/bin/dmlc-ctl" 0755
install -D -m 0644 "$here/systemd/vhost-device-dmlc@.service" "$p/lib/systemd/system/vhost-device-dmlc@.service"
install -D -m 0644 "$here/systemd/group0.conf" "$p/etc/vhost-device-dmlc/group0.conf"
install -D -m 0644 "$here/systemd/vhost-device-dmlc.sysusers" "$p/usr/lib/sysusers.d/vhost-device-dmlc.conf"
install -D -m 0644 "$here/grafana/vhost-device-dmlc.json" \
    "$p/usr/share/vhost-device-dmlc/grafana/vhost-device-dmlc.json"
install -D -m 0644 "$repo/vhost-device/README.md" "$p/usr/share/doc/vhost-device-dmlc/README.md"
install -D -m 0644 "$repo/docs/packaging.md" "$p/usr/share/doc/vhost-device-dmlc/packaging.md"
copyright "$p" vhost-device-dmlc "Apache-2.0 OR BSD-3-Clause"
control "$p" vhost-device-dmlc \
    "Architecture: $arch" \
    "Depends: $(shlib_depends "$p/usr/bin/vhost-device-dmlc" "$p/usr/bin/dmlc-ctl"), passwd" \
    "Section: misc" "Priority: optional" \
    "Description: vhost-user backend of the virtio-dmlc allreduce device" \
    " One daemon serves the virtio-dmlc devices of a group of QEMU VMs: it" \
    " reduces their buffers straight out of guest memory. Includes dmlc-ctl," \
    " the template unit vhost-device-dmlc@GROUP.service and a Grafana dashboard."
echo /etc/vhost-device-dmlc/group0.conf >"$p/DEBIAN/conffiles"
script "$p" postinst vhost-device-dmlc.postinst
script "$p" prerm vhost-device-dmlc.prerm
script "$p" postrm vhost-device-dmlc.postrm
debs=("$(build_deb "$p" vhost-device-dmlc)")

# ---- libdmlc-guestN ----------------------------------------------------------
# cargo builds the cdylib without a SONAME; the packaged copy gets one.
# (Setting it in capi's build would make every program linked against
# target/*/libdmlc_guest.so, the tests' C programs among them, need a
# libdmlc_guest.so.N file that cargo does not make.)
p=$work/$libpkg
libdir=$p/usr/lib/$multiarch
install_elf "$rel/libdmlc_guest.so" "$libdir/$soname.$version" 0644
patchelf --set-soname "$soname" "$libdir/$soname.$version"
ln -s "$soname.$version" "$libdir/$soname"
copyright "$p" "$libpkg" "Apache-2.0 OR BSD-3-Clause"
control "$p" "$libpkg" \
    "Architecture: $arch" "Multi-Arch: same" \
    "Depends: $(shlib_depends "$libdir/$soname.$version")" \
    "Section: libs" "Priority: optional" \
    "Description: virtio-dmlc guest library (C ABI $abi)" \
    " The C library of the virtio-dmlc allreduce device's drivers: collectives," \
    " communicators and the rabit-style API, over the PCI device from userspace," \
    " the kernel driver's /dev/dmlcN, or a host's vhost-user socket."
echo "libdmlc_guest $abi $libpkg (>= $version)" >"$p/DEBIAN/shlibs"
echo "activate-noawait ldconfig" >"$p/DEBIAN/triggers"
debs+=("$(build_deb "$p" "$libpkg")")

# ---- libdmlc-guest-dev -------------------------------------------------------
p=$work/libdmlc-guest-dev
install -D -m 0644 "$repo/capi/include/dmlc_guest.h" "$p/usr/include/dmlc_guest.h"
install -D -m 0644 "$repo/capi/include/dmlc_rabit.h" "$p/usr/include/dmlc_rabit.h"
mkdir -p "$p/usr/lib/$multiarch/pkgconfig"
ln -s "$soname" "$p/usr/lib/$multiarch/libdmlc_guest.so"
sed -e "s/@VERSION@/$version/" -e "s/@MULTIARCH@/$multiarch/" "$here/debian/dmlc-guest.pc.in" \
    >"$p/usr/lib/$multiarch/pkgconfig/dmlc-guest.pc"
copyright "$p" libdmlc-guest-dev "Apache-2.0 OR BSD-3-Clause"
control "$p" libdmlc-guest-dev \
    "Architecture: $arch" "Multi-Arch: same" \
    "Depends: $libpkg (= $debversion)" \
    "Section: libdevel" "Priority: optional" \
    "Description: virtio-dmlc guest library: headers and pkg-config file" \
    " dmlc_guest.h, dmlc_rabit.h, dmlc-guest.pc and the link libdmlc_guest.so" \
    " for programs that call the virtio-dmlc device (pkg-config dmlc-guest)."
debs+=("$(build_deb "$p" libdmlc-guest-dev)")

# ---- dmlc-guest --------------------------------------------------------------
p=$work/dmlc-guest
install_elf "$rel/dmlc-guest" "$p/usr/bin/dmlc-guest" 0755
install -D -m 0644 "$repo/guest-cli/README.md" "$p/usr/share/doc/dmlc-guest/README.md"
copyright "$p" dmlc-guest "Apache-2.0 OR BSD-3-Clause"
control "$p" dmlc-guest \
    "Architecture: $arch" \
    "Depends: $(shlib_depends "$p/usr/bin/dmlc-guest")" \
    "Section: utils" "Priority: optional" \
    "Description: virtio-dmlc guest tools" \
    " dmlc-guest: information, self-test and benchmark of a virtio-dmlc device" \
    " (PCI from userspace, or /dev/dmlcN), and a local group of host ranks."
debs+=("$(build_deb "$p" dmlc-guest)")

# ---- virtio-dmlc-dkms --------------------------------------------------------
p=$work/virtio-dmlc-dkms
src=$p/usr/src/virtio_dmlc-$version
for f in Kbuild Makefile dkms.conf virtio_dmlc.c include/uapi/virtio_dmlc.h; do
    install -D -m 0644 "$repo/kernel-driver/$f" "$src/$f"
done
install -D -m 0644 "$repo/docs/kernel-driver.md" "$p/usr/share/doc/virtio-dmlc-dkms/kernel-driver.md"
copyright "$p" virtio-dmlc-dkms "GPL-2.0-only"
control "$p" virtio-dmlc-dkms \
    "Architecture: all" \
    "Depends: dkms (>= 3)" \
    "Section: kernel" "Priority: optional" \
    "Description: virtio-dmlc kernel driver (DKMS source)" \
    " virtio_dmlc.ko, the guest kernel's driver of the virtio-dmlc allreduce" \
    " device (/dev/dmlcN), built by DKMS for each installed kernel's headers."
script "$p" postinst virtio-dmlc-dkms.postinst
script "$p" prerm virtio-dmlc-dkms.prerm
debs+=("$(build_deb "$p" virtio-dmlc-dkms)")

printf '%s\n' "${debs[@]}"
