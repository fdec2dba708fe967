#!/usr/bin/env bash
# Build QEMU with the vhost-user-dmlc patch series for the guest
# architectures the project runs (x86_64, aarch64, riscv64: one build, three
# qemu-system-* binaries side by side in one bin/) and print the path of
# qemu-system-x86_64 on the last line of stdout; the others are found next to
# it. Progress goes to stderr.
#
# Usage: build-qemu.sh [--firmware | --env | --help]
#
#   (no option)  build (or reuse) QEMU, fetch the firmware, print the binary
#   --firmware   fetch the firmware only and print its -L directories, one a line
#   --env        build and fetch as above, print shell assignments of
#                DMLC_QEMU and DMLC_QEMU_FIRMWARE (colon-separated -L dirs)
#
# Environment:
#   DMLC_QEMU        a qemu-system-x86_64 of your own (with the series applied):
#                    printed as it is, nothing is built; VMs of another
#                    architecture use the qemu-system-ARCH beside it
#   DMLC_CACHE       cache root (default: $HOME/.cache/virtio-dmlc)
#   DMLC_QEMU_JOBS   parallel compile jobs (default: number of CPUs)
#   DMLC_QEMU_KEEP_BUILD=1  keep the source and build tree of a successful build
#
# The build is cached in $DMLC_CACHE/qemu/<version>-<hash>/ where the hash
# covers the patch series and this script, so editing either rebuilds. A lock
# ($DMLC_CACHE/.lock) serialises concurrent runs. See README.md.

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" build-qemu || exit 1

readonly QEMU_VERSION=10.0.2
readonly QEMU_TARBALL="qemu_${QEMU_VERSION}+ds.orig.tar.xz"
readonly QEMU_TARBALL_SHA256=0901da33844a331bf8b3602b9c1fbd178e60b737c8e3ade678255bd090c9b9f1
readonly MESON_VERSION=1.5.0
readonly PYCOTAP_VERSION=1.3.1
# Debian suite that carries the QEMU 10.0.2 source package.
readonly SOURCE_SUITE=bookworm-backports
readonly FIRMWARE_PACKAGES=(seabios qemu-system-data ipxe-qemu)
# Where those packages put what QEMU loads (-L directories, in Debian's order).
readonly FIRMWARE_SUBDIRS=(usr/share/qemu usr/share/seabios usr/lib/ipxe/qemu)
# One build for every guest architecture: the targets share most objects,
# so three cost far less than three builds.
readonly TARGETS=(x86_64 aarch64 riscv64)
readonly BUILD_PACKAGES=(gcc make ninja-build pkg-config libglib2.0-dev libfdt-dev
    flex bison python3 python3-venv bzip2 xz-utils patch)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly HERE
readonly JOBS=${DMLC_QEMU_JOBS:-$(nproc)}

usage() { script_header; }

mode=build
case "${1:-}" in
"") ;;
--firmware) mode=firmware ;;
--env) mode="env" ;;
-h | --help)
    usage
    exit 0
    ;;
*)
    usage >&2
    die "unknown option: $1"
    ;;
esac
[[ $# -le 1 ]] || die "expected at most one option"

# --- helpers ---------------------------------------------------------------

# Private apt configuration under the cache: the machine's own apt
# configuration is never touched. Only used to fetch the source package.
apt_private() {
    apt-get -o Dir::Etc::SourceList="$CACHE/apt/sources.list" \
        -o Dir::Etc::SourceParts=/dev/null \
        -o Dir::State::Lists="$CACHE/apt/lists" \
        -o Dir::Cache="$CACHE/apt/cache" \
        -o APT::Sandbox::User=root \
        "$@"
}

# The Debian mirror the machine already uses, from its deb822 or one-line
# sources.
debian_mirror() {
    local uri
    uri=$(grep -hs -m1 -E '^URIs:.*/debian/?$' /etc/apt/sources.list.d/*.sources |
        awk '{print $2}' || true)
    if [[ -z $uri ]]; then
        uri=$(grep -hs -m1 -E '^deb .*/debian/? ' /etc/apt/sources.list \
            /etc/apt/sources.list.d/*.list | awk '{print $2}' || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

apt_updated=0
apt_update_once() {
    if [[ $apt_updated -eq 0 ]]; then
        log "apt-get update"
        apt-get -qq update >&2 || die "apt-get update failed"
        apt_updated=1
    fi
}

ensure_packages() {
    local missing=() p
    for p in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed'; then
            missing+=("$p")
        fi
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    [[ $(id -u) -eq 0 ]] ||
        die "missing build packages (install them as root): ${missing[*]}"
    apt_update_once
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >&2 || die "apt-get install ${missing[*]} failed"
}

# Debian firmware (SeaBIOS, option ROMs, iPXE NIC ROMs), unpacked into the
# cache without installing: prints the root it was unpacked into.
fetch_firmware() {
    local dir="$CACHE/firmware/debian"
    if [[ "$(head -n1 "$dir/.done" 2>/dev/null)" != "${FIRMWARE_PACKAGES[*]}" ]]; then
        log "fetching firmware: ${FIRMWARE_PACKAGES[*]}"
        rm -rf "$dir" "$dir.tmp"
        mkdir -p "$dir.tmp/debs"
        if ! (cd "$dir.tmp/debs" && apt-get -qq -o APT::Sandbox::User=root \
            download "${FIRMWARE_PACKAGES[@]}" >&2); then
            apt_update_once
            (cd "$dir.tmp/debs" && apt-get -qq -o APT::Sandbox::User=root \
                download "${FIRMWARE_PACKAGES[@]}" >&2) ||
                die "apt-get download ${FIRMWARE_PACKAGES[*]} failed"
        fi
        local deb
        for deb in "$dir.tmp"/debs/*.deb; do
            dpkg -x "$deb" "$dir.tmp/root"
        done
        [[ -e $dir.tmp/root/usr/share/seabios/bios-256k.bin ]] ||
            die "firmware packages lack usr/share/seabios/bios-256k.bin"
        [[ -e $dir.tmp/root/usr/share/qemu/linuxboot_dma.bin ]] ||
            die "firmware packages lack usr/share/qemu/linuxboot_dma.bin"
        # The riscv64 virt machine's default -bios (aarch64 virt boots the
        # kernel directly and needs none).
        [[ -e $dir.tmp/root/usr/share/qemu/opensbi-riscv64-generic-fw_dynamic.bin ]] ||
            die "firmware packages lack usr/share/qemu/opensbi-riscv64-generic-fw_dynamic.bin"
        {
            echo "${FIRMWARE_PACKAGES[*]}"
            (cd "$dir.tmp/debs" && ls)
        } >"$dir.tmp/.done"
        rm -rf "$dir.tmp/debs"
        mv "$dir.tmp" "$dir"
    fi
    echo "$dir/root"
}

# Everything that decides what the build produces.
cache_key() {
    local patches=("$HERE"/*.patch)
    [[ -e ${patches[0]} ]] || die "no patches in $HERE"
    {
        echo "qemu $QEMU_VERSION $QEMU_TARBALL_SHA256 meson $MESON_VERSION"
        sha256sum "${patches[@]}" | awk '{print $1}'
        sha256sum "${BASH_SOURCE[0]}" | awk '{print $1}'
    } | sha256sum | cut -c1-16
}

fetch_source() {
    local tarball="$CACHE/src/$QEMU_TARBALL"
    if [[ -e $tarball ]] &&
        echo "$QEMU_TARBALL_SHA256  $tarball" | sha256sum -c --status; then
        echo "$tarball"
        return 0
    fi
    log "fetching $QEMU_TARBALL (Debian source package, $SOURCE_SUITE)"
    mkdir -p "$CACHE/src" "$CACHE/apt/lists/partial" "$CACHE/apt/cache/archives/partial"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
        "$(debian_mirror) $SOURCE_SUITE main" >"$CACHE/apt/sources.list"
    apt_private -qq update >&2 || die "apt-get update of $SOURCE_SUITE sources failed"
    # This exits non-zero when the registry lacks the .debian.tar.xz or
    # .dsc of this version; the orig tarball is all we need, so check for it.
    rm -f "$tarball"
    (cd "$CACHE/src" && apt_private -qq source --download-only qemu >&2) || true
    [[ -e $tarball ]] ||
        die "download of $QEMU_TARBALL failed (does $SOURCE_SUITE still carry QEMU $QEMU_VERSION?)"
    echo "$QEMU_TARBALL_SHA256  $tarball" | sha256sum -c --status ||
        die "$tarball: sha256 mismatch (expected $QEMU_TARBALL_SHA256)"
    echo "$tarball"
}

# meson and pycotap wheels are missing from the +ds tarball.
ensure_venv() {
    local venv="$CACHE/pyvenv-meson-$MESON_VERSION"
    if [[ ! -e $venv/.done ]]; then
        log "creating Python venv with meson $MESON_VERSION"
        rm -rf "$venv"
        /usr/bin/python3 -m venv "$venv" >&2 || die "python3 -m venv failed"
        "$venv/bin/pip" install -q --disable-pip-version-check \
            "meson==$MESON_VERSION" "pycotap==$PYCOTAP_VERSION" >&2 ||
            die "pip install meson failed"
        touch "$venv/.done"
    fi
    echo "$venv/bin/python3"
}

# Lay out <out>/share/qemu so that the binary finds its firmware relative
# to itself (QEMU looks in <bindir>/../share/qemu) and needs no -L.
link_firmware() {
    local out=$1 fw=$2 sub f
    mkdir -p "$out/share/qemu"
    for sub in "${FIRMWARE_SUBDIRS[@]}"; do
        [[ -d $fw/$sub ]] || die "firmware directory $fw/$sub is missing"
        # The first directory wins, as with -L.
        for f in "$fw/$sub"/*; do
            [[ -e $out/share/qemu/${f##*/} || -L $out/share/qemu/${f##*/} ]] ||
                ln -s "$f" "$out/share/qemu/"
        done
    done
}

build_qemu() {
    local out=$1 fw=$2
    local work="$out.tmp"
    local tarball python start pid rc last now

    tarball=$(fetch_source)
    python=$(ensure_venv)

    rm -rf "$work"
    mkdir -p "$work/bin"
    log "unpacking $QEMU_TARBALL"
    tar -xf "$tarball" -C "$work" --no-same-owner
    mv "$work/qemu-$QEMU_VERSION" "$work/src"

    local p
    for p in "$HERE"/*.patch; do
        log "applying $(basename "$p")"
        patch -d "$work/src" -p1 --batch --quiet <"$p" >&2 ||
            die "$(basename "$p") does not apply to QEMU $QEMU_VERSION"
    done

    # The +ds tarball drops the prebuilt edk2 images that pc-bios/meson.build
    # decompresses when bzip2 is found: empty stand-ins keep it happy.
    local fd
    sed -n '/fds = \[/,/\]/p' "$work/src/pc-bios/meson.build" |
        grep -o "edk2-[a-z0-9_-]*\.fd" | while read -r fd; do
        [[ -e $work/src/pc-bios/$fd.bz2 ]] || bzip2 -c </dev/null >"$work/src/pc-bios/$fd.bz2"
    done

    log "configuring (log: $work/configure.log)"
    mkdir -p "$work/build"
    if ! (cd "$work/build" && ../src/configure \
        --python="$python" \
        --prefix="$out" \
        --target-list="$(printf '%s-softmmu,' "${TARGETS[@]}" | sed 's/,$//')" \
        --without-default-features \
        --enable-kvm --enable-tcg \
        --enable-vhost-user \
        --enable-fdt=system \
        --disable-docs \
        --disable-install-blobs) >"$work/configure.log" 2>&1; then
        tail -n 30 "$work/configure.log" >&2
        die "configure failed; see $work/configure.log"
    fi

    local binaries=() t
    for t in "${TARGETS[@]}"; do binaries+=("qemu-system-$t"); done
    log "compiling ${binaries[*]} with $JOBS jobs (log: $work/build.log)"
    start=$(date +%s)
    ninja -C "$work/build" -j "$JOBS" "${binaries[@]}" >"$work/build.log" 2>&1 &
    pid=$!
    last=$start
    while kill -0 "$pid" 2>/dev/null; do
        sleep 5
        now=$(date +%s)
        if ((now - last >= 30)); then
            log "compiling: $(grep -o '^\[[0-9]*/[0-9]*\]' "$work/build.log" | tail -n1 || true) after $((now - start)) s"
            last=$now
        fi
    done
    rc=0
    wait "$pid" || rc=$?
    if [[ $rc -ne 0 ]]; then
        grep -B2 -A12 -m3 -E 'error|FAILED' "$work/build.log" >&2 || tail -n 40 "$work/build.log" >&2
        die "compile failed; see $work/build.log"
    fi
    log "compiled in $(($(date +%s) - start)) s"

    local devices b
    for b in "${binaries[@]}"; do
        cp "$work/build/$b" "$work/bin/"
        devices=$("$work/bin/$b" -device help 2>&1) ||
            die "the built $b does not run: $devices"
        grep -q '"vhost-user-dmlc-pci"' <<<"$devices" ||
            die "the built $b does not list vhost-user-dmlc-pci"
    done
    link_firmware "$work" "$fw"
    cp "$HERE"/*.patch "$work/"
    {
        echo "qemu $QEMU_VERSION"
        echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(($(date +%s) - start)) s"
        (cd "$HERE" && sha256sum ./*.patch "$(basename "${BASH_SOURCE[0]}")")
    } >"$work/BUILD-INFO"
    if [[ ${DMLC_QEMU_KEEP_BUILD:-0} != 1 ]]; then
        rm -rf "$work/src" "$work/build"
    fi
    rm -rf "$out"
    mv "$work" "$out"
}

# --- main ------------------------------------------------------------------

if [[ $mode == build && -n ${DMLC_QEMU:-} ]]; then
    [[ -x $DMLC_QEMU && -f $DMLC_QEMU ]] || die "DMLC_QEMU=$DMLC_QEMU is not an executable file"
    echo "$DMLC_QEMU"
    exit 0
fi

cache_lock "$CACHE/.lock"

command -v apt-get >/dev/null || die "needs a Debian system (apt-get)"
fw=$(fetch_firmware)
firmware_dirs=$(printf "$fw/%s:" "${FIRMWARE_SUBDIRS[@]}")
firmware_dirs=${firmware_dirs%:}

if [[ $mode == firmware ]]; then
    tr ':' '\n' <<<"$firmware_dirs"
    exit 0
fi

if [[ -n ${DMLC_QEMU:-} ]]; then
    [[ -x $DMLC_QEMU && -f $DMLC_QEMU ]] || die "DMLC_QEMU=$DMLC_QEMU is not an executable file"
    qemu=$DMLC_QEMU
else
    out="$CACHE/qemu/$QEMU_VERSION-$(cache_key)"
    qemu="$out/bin/qemu-system-x86_64"
    if [[ -x $qemu ]] && "$qemu" --version >/dev/null 2>&1 &&
        [[ -x $out/bin/qemu-system-${TARGETS[-1]} ]]; then
        log "using cached $out"
    else
        ensure_packages "${BUILD_PACKAGES[@]}"
        build_qemu "$out" "$fw"
    fi
fi

log "firmware -L directories: $firmware_dirs"
if [[ $mode == env ]]; then
    printf 'DMLC_QEMU=%q\n' "$qemu"
    printf 'DMLC_QEMU_FIRMWARE=%q\n' "$firmware_dirs"
else
    echo "$qemu"
fi
