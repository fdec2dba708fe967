#!/bin/bash
# Build the virtio-dmlc guest image of one architecture: a Debian kernel and
# an initramfs (cpio.gz) holding busybox-static, the kernel modules the guest
# needs, tests/image/init as /init, and extra files.
#
# Usage: build-image.sh [--arch ARCH] [--module NAME]... [--strip] [--headers]
#                       [--checkpatch] [HOST:GUEST]...
#   --arch ARCH  the guest's architecture (default x86_64):
#                  x86_64   bookworm, linux-image-cloud-amd64 (6.1)
#                  aarch64  bookworm, linux-image-cloud-arm64 (6.1)
#                  riscv64  trixie, linux-image-riscv64 (6.12; bookworm has
#                           no riscv64 port)
#                and that suite's busybox-static of the architecture.
#   HOST:GUEST   copy file or directory HOST to GUEST in the image (GUEST
#                ending in / means "into that directory"). On x86_64,
#                dynamically linked ELF files get the libraries `ldd` lists,
#                at the same paths. The other architectures' images hold
#                Debian's libc6 and libgcc-s1 of that architecture (for
#                programs cross-built against glibc), and an ELF file built
#                for another architecture is refused.
#   --module N   also load kernel module N (and what it depends on).
#   --strip      strip debug info from the extra ELF files (a debug build of
#                dmlc-guest is ~40 MB; stripped, a few MB: faster boots).
#   --headers    also fetch Debian's headers for the image's kernel (the
#                packages linux-headers-VERSION, its -common and linux-kbuild)
#                and print DMLC_KERNEL_HEADERS=DIR before the two lines
#                below: `make -C DIR M=...` builds an out-of-tree module.
#   --checkpatch also fetch that kernel's scripts/checkpatch.pl (from the
#                139 MB linux-source package, once) and print
#                DMLC_CHECKPATCH=FILE before the lines below.
#
# Output: progress on stderr; stdout's last two lines are
#   DMLC_INITRD=/abs/path/initrd-KEY.cpio.gz
#   DMLC_KERNEL=/abs/path/vmlinuz-VERSION
# so `eval "$(build-image.sh ... | tail -n 2)"` sets both.
#
# Environment:
#   DMLC_CACHE           cache root (default ~/.cache/virtio-dmlc); this
#                        script uses $DMLC_CACHE/image
#   DMLC_IMAGE_MODULES   more modules, space separated (like --module)
#   DMLC_KERNEL_PKG      kernel package (default: the architecture's above, a
#                        metapackage resolved to the versioned one)
#   DMLC_DEBIAN_MIRROR   Debian mirror URI (default: the machine's, else
#                        http://deb.debian.org/debian)
#   DMLC_IMAGE_REFRESH=1 download the packages again (new kernel version)
#
# The result is cached under a key over every input (packages, init, this
# script, modules, extra files and their libraries): an unchanged rebuild
# prints the same paths at once.

# shellcheck source=SCRIPTDIR/../lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/prologue.sh" build-image || exit 1
shopt -s inherit_errexit

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
default_modules="virtio_pci virtio_net uio_pci_generic qemu_fw_cfg virtiofs overlay"

usage() {
    script_header >&2
    exit "$1"
}

modules=$default_modules
strip=0
headers=0
checkpatch=0
arch=x86_64
for m in ${DMLC_IMAGE_MODULES:-}; do modules="$modules $m"; done
extras=()
while [ $# -gt 0 ]; do
    case "$1" in
    -h | --help) usage 0 ;;
    --strip)
        strip=1
        shift
        ;;
    --arch)
        [ $# -ge 2 ] || usage 2
        arch=$2
        shift 2
        ;;
    --arch=*)
        arch=${1#--arch=}
        shift
        ;;
    --headers)
        headers=1
        shift
        ;;
    --checkpatch)
        checkpatch=1
        shift
        ;;
    --module)
        [ $# -ge 2 ] || usage 2
        modules="$modules $2"
        shift 2
        ;;
    --module=*)
        modules="$modules ${1#--module=}"
        shift
        ;;
    -*) usage 2 ;;
    *:*)
        h=${1%%:*}
        [ -e "$h" ] || die "extra file $h does not exist"
        extras+=("$(realpath -s -- "$h"):${1#*:}")
        shift
        ;;
    *) die "extra file '$1' is not HOST:GUEST" ;;
    esac
done

# Per architecture: Debian's name for it, the suite, the kernel and the ELF
# e_machine of its programs.
case "$arch" in
x86_64) debarch=amd64 suite=bookworm kpkg=linux-image-cloud-amd64 emachine=62 ;;
aarch64) debarch=arm64 suite=bookworm kpkg=linux-image-cloud-arm64 emachine=183 ;;
riscv64) debarch=riscv64 suite=trixie kpkg=linux-image-riscv64 emachine=243 ;;
*) die "unknown architecture '$arch' (known: x86_64, aarch64, riscv64)" ;;
esac
kernel_pkg=${DMLC_KERNEL_PKG:-$kpkg}
hostarch=$(dpkg --print-architecture)
# x86_64 keeps the cache directory it always had.
if [ "$arch" = x86_64 ]; then cache=$CACHE/image; else cache=$CACHE/image-$arch; fi

# Host tools. busybox (from the package we unpack) provides cpio, so the
# host needs only apt, dpkg and coreutils-level tools.
need() {
    command -v "$1" >/dev/null 2>&1 && return
    log "installing $2 (for $1)"
    [ "$(id -u)" = 0 ] || die "$1 is missing; install package $2"
    apt-get install -y --no-install-recommends "$2" >&2 || die "cannot install $2"
}
need apt-get apt
need dpkg-deb dpkg
need gzip gzip
need sha256sum coreutils
need flock util-linux
need ldd libc-bin
# Another architecture's files are stripped by its cross binutils.
case "$arch" in
x86_64) objcopy=objcopy binutils=binutils ;;
*) objcopy=$arch-linux-gnu-objcopy binutils=binutils-$arch-linux-gnu ;;
esac
[ "$strip" = 0 ] || need "$objcopy" "$binutils"
[ "$arch" = x86_64 ] || need "qemu-$arch-static" qemu-user-static

mkdir -p "$cache/debs" "$cache/apt/lists/partial" "$cache/apt/cache/archives/partial" "$cache/tmp"
exec 9>"$cache/.lock"
flock 9

keyring=/usr/share/keyrings/debian-archive-keyring.gpg
if [ ! -f "$keyring" ]; then
    [ "$(id -u)" = 0 ] || die "$keyring is missing; install debian-archive-keyring"
    log "installing debian-archive-keyring"
    apt-get install -y --no-install-recommends debian-archive-keyring >&2 ||
        die "cannot install debian-archive-keyring"
fi

# A private apt configuration, so the machine's sources and state stay as
# they are and the packages always come from the architecture's suite.
# shellcheck source=/dev/null
. "$(dirname "${BASH_SOURCE[0]}")/../lib/debian-mirror.sh"
mirror=$(debian_mirror)
security=${mirror%/debian}/debian-security
cat >"$cache/apt/sources.list" <<EOF
deb [signed-by=$keyring] $mirror $suite main
deb [signed-by=$keyring] $mirror $suite-updates main
deb [signed-by=$keyring] $security $suite-security main
EOF
apt_opts=(
    -o "APT::Architecture=$debarch"
    -o "APT::Architectures::=$debarch"
    # The host's too: another architecture's headers build with the host's
    # kbuild tools (--headers).
    -o "APT::Architectures::=$hostarch"
    -o "Dir::Etc::SourceList=$cache/apt/sources.list"
    -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$cache/apt/lists"
    -o "Dir::Cache=$cache/apt/cache"
    -o APT::Sandbox::User=root
    -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false
    -q
)
lists_fresh=0
apt_update() {
    [ "$lists_fresh" = 1 ] && return
    log "apt-get update (private lists in $cache/apt)"
    apt-get "${apt_opts[@]}" update >&2 || die "apt-get update failed"
    lists_fresh=1
}
# Download package $1 into $cache/debs; print the .deb's path.
download() {
    local pkg=$1 out
    [ -n "$(ls "$cache/apt/lists"/*_Packages* 2>/dev/null)" ] || apt_update
    if ! out=$(cd "$cache/debs" && apt-get "${apt_opts[@]}" download "$pkg" 2>&1); then
        # Stale lists: the mirror dropped the version they name.
        apt_update
        out=$(cd "$cache/debs" && apt-get "${apt_opts[@]}" download "$pkg" 2>&1) ||
            die "cannot download $pkg: $out"
    fi
    # apt-get download names no file: take the newest of this package (a
    # PKG:ARCH's file is PKG_VERSION_ARCH.deb).
    local deb
    # shellcheck disable=SC2012 # Debian file names are plain.
    deb=$(ls -t "$cache/debs/${pkg%%:*}_"*.deb 2>/dev/null | head -n 1)
    [ -n "$deb" ] || die "downloaded $pkg but cannot find its .deb"
    echo "$deb"
}
# The .deb for role $1 (a link in $cache/debs), downloading package $2 if
# there is none yet or DMLC_IMAGE_REFRESH=1.
fetch() {
    local role=$1 pkg=$2 link="$cache/debs/$1.deb" deb
    if [ "${DMLC_IMAGE_REFRESH:-0}" != 1 ] && [ -f "$link" ]; then
        readlink -f "$link"
        return
    fi
    log "downloading $pkg"
    deb=$(download "$pkg")
    if [ "$role" = kernel ] && [[ "$pkg" != linux-image-[0-9]* ]]; then
        # A metapackage: follow its dependency to the versioned kernel.
        local real
        real=$(dpkg-deb -f "$deb" Depends | grep -oE 'linux-image-[0-9][^ ,(]*' | head -n 1)
        [ -n "$real" ] || die "$pkg names no kernel package"
        log "downloading $real"
        deb=$(download "$real")
    fi
    ln -sfn "$(basename "$deb")" "$link"
    echo "$deb"
}
kernel_deb=$(fetch kernel "$kernel_pkg")
busybox_deb=$(fetch busybox busybox-static)
kernel_sha=$(sha256sum "$kernel_deb" | cut -d' ' -f1)
busybox_sha=$(sha256sum "$busybox_deb" | cut -d' ' -f1)
# A foreign architecture's C runtime: the host's ldd cannot resolve its
# programs' libraries, so the image holds the whole of it.
runtime_debs=()
if [ "$arch" != x86_64 ]; then
    runtime_debs=("$(fetch libc6 libc6)" "$(fetch libgcc-s1 libgcc-s1)")
fi

# Unpack once per package version.
unpack() {
    local deb=$1 dir=$2
    [ -f "$dir/.done" ] && return
    rm -rf "$dir"
    mkdir -p "$dir"
    dpkg-deb -x "$deb" "$dir"
    touch "$dir/.done"
}
kdir="$cache/kernel-${kernel_sha:0:16}"
bbdir="$cache/busybox-${busybox_sha:0:16}"
unpack "$kernel_deb" "$kdir"
unpack "$busybox_deb" "$bbdir"
busybox="$bbdir/bin/busybox"
[ -f "$busybox" ] || busybox="$bbdir/usr/bin/busybox" # trixie: merged /usr
[ -f "$busybox" ] || die "no busybox in $busybox_deb"
# The image's busybox also packs the image; another architecture's runs
# under qemu-user.
bb() {
    if [ "$arch" = x86_64 ]; then "$busybox" "$@"; else "qemu-$arch-static" "$busybox" "$@"; fi
}
# riscv64's package names its (uncompressed Image) kernel vmlinux-VERSION.
vmlinuz=$(find "$kdir/boot" -name 'vmlinuz-*' -o -name 'vmlinux-*' | head -n 1)
[ -n "$vmlinuz" ] || die "no vmlinuz or vmlinux in $kernel_deb"
kver=${vmlinuz##*/vmlinu[xz]-}
moddir="$kdir/lib/modules/$kver"
# trixie's kernels keep their modules under /usr (merged /usr).
[ -d "$moddir" ] || moddir="$kdir/usr/lib/modules/$kver"

# Module closure in dependency order (dependencies first). Module names use
# '_' where file names may use '-'. A module built into this kernel (the
# other architectures' kernels build in some that amd64's loads) is skipped.
declare -A modpath=() modstate=() builtin=()
while IFS= read -r f; do
    n=${f##*/}
    n=${n%.ko}
    builtin[${n//-/_}]=1
done <"$moddir/modules.builtin"
while IFS= read -r f; do
    n=${f##*/}
    n=${n%%.ko*}
    modpath[${n//-/_}]=${f#"$moddir"/}
done < <(find "$moddir/kernel" -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst')
ordered=()
visit() {
    local n=${1//-/_} f deps d
    case "${modstate[$n]:-}" in
    "done") return ;;
    "active") die "module dependency cycle at $n" ;;
    esac
    [ -z "${modpath[$n]:-}" ] && [ -n "${builtin[$n]:-}" ] && return
    f=${modpath[$n]:-}
    [ -n "$f" ] || die "kernel $kver has no module $n"
    modstate[$n]="active"
    deps=$(modinfo_depends "$moddir/$f")
    for d in ${deps//,/ }; do visit "$d"; done
    modstate[$n]="done"
    ordered+=("$f")
}
modinfo_depends() {
    case "$1" in
    *.xz) bb xzcat "$1" ;;
    *.zst) zstd -dc "$1" ;;
    *) cat "$1" ;;
    esac | tr '\0' '\n' | sed -n 's/^depends=//p' | head -n 1
}
for m in $modules; do visit "$m"; done

# Extra files, and the shared libraries of the ELF ones.
declare -A libs=()
is_elf() { [ "$(head -c 4 "$1" 2>/dev/null | od -An -c | tr -d ' ')" = '177ELF' ]; }
# e_machine of an ELF file (little-endian u16 at offset 18).
elf_machine() { od -An -t u2 -j 18 -N 2 "$1" | tr -d ' '; }
scan_libs() {
    local f=$1 line p m
    is_elf "$f" || return 0
    m=$(elf_machine "$f")
    [ "$m" = "$emachine" ] ||
        die "$f is built for another architecture (ELF machine $m), not $arch ($emachine)"
    # The image holds the architecture's whole C runtime instead.
    [ "$arch" = x86_64 ] || return 0
    local out
    out=$(ldd "$f" 2>&1) || return 0 # static, or not an executable
    while IFS= read -r line; do
        case "$line" in
        *"not found"*) die "$f needs a library ldd cannot find: ${line%% =>*}" ;;
        *"=> /"*) p=${line#*=> } p=${p%% (*} ;;
        [[:space:]]/*) p=${line#"${line%%[![:space:]]*}"} p=${p%% (*} ;;
        *) continue ;;
        esac
        libs[$p]=1
    done <<<"$out"
}
manifest() {
    echo "script $(sha256sum "$here/$(basename "${BASH_SOURCE[0]}")" | cut -d' ' -f1)"
    echo "init $(sha256sum "$here/init" | cut -d' ' -f1)"
    echo "arch $arch"
    echo "kernel $kernel_sha"
    echo "busybox $busybox_sha"
    local d
    for d in "${runtime_debs[@]}"; do echo "runtime $(sha256sum "$d" | cut -d' ' -f1)"; done
    echo "modules ${ordered[*]}"
    echo "strip $strip"
    local e host guest f
    for e in "${extras[@]}"; do
        host=${e%%:*} guest=${e#*:}
        [ -e "$host" ] || die "extra file $host does not exist"
        echo "extra $guest"
        while IFS= read -r f; do
            echo "  $(sha256sum "$f" | cut -d' ' -f1) $(stat -L -c %a "$f") ${f#"$host"}"
        done < <(find -L "$host" -type f | sort)
    done
    for f in $(printf '%s\n' "${!libs[@]}" | sort); do
        echo "lib $f $(sha256sum "$f" | cut -d' ' -f1)"
    done
}
# Process substitution runs in a subshell, so collect libs first.
for e in "${extras[@]}"; do
    host=${e%%:*}
    [ -e "$host" ] || die "extra file $host does not exist"
    while IFS= read -r f; do scan_libs "$f"; done < <(find -L "$host" -type f)
done
key=$(manifest | sha256sum | cut -c1-16)
initrd="$cache/initrd-$key.cpio.gz"
kernel_out="$cache/${vmlinuz##*/}"
if ! cmp -s "$vmlinuz" "$kernel_out" 2>/dev/null; then
    cp "$vmlinuz" "$kernel_out"
fi

if [ -f "$initrd" ]; then
    log "cached $initrd"
    touch "$initrd"
else
    log "kernel $kver; modules: ${ordered[*]##*/}"
    stage=$(mktemp -d "$cache/tmp/stage.XXXXXX")
    trap 'rm -rf "$stage"' EXIT
    cd "$stage" || exit
    mkdir -p bin sbin usr/bin usr/sbin etc/dmlc proc sys dev run tmp root mnt lib/modules
    chmod 1777 tmp
    chmod 700 root
    cp "$busybox" bin/busybox
    while IFS= read -r a; do
        [ "$a" = bin/busybox ] && continue
        mkdir -p "$(dirname "$a")"
        ln -sf /bin/busybox "$a"
    done < <(bb --list-full)
    install -m 755 "$here/init" init
    printf 'root:x:0:0:root:/root:/bin/sh\n' >etc/passwd
    printf 'root:x:0:\n' >etc/group
    printf '127.0.0.1 localhost\n' >etc/hosts
    for f in "${ordered[@]}"; do
        mkdir -p "lib/modules/$kver/$(dirname "$f")"
        case "$f" in
        *.xz) bb xzcat "$moddir/$f" >"lib/modules/$kver/${f%.xz}" ;;
        *.zst) zstd -qdc "$moddir/$f" >"lib/modules/$kver/${f%.zst}" ;;
        *) cp "$moddir/$f" "lib/modules/$kver/$f" ;;
        esac
        f=${f%.xz} f=${f%.zst}
        echo "$kver/$f" >>etc/dmlc/modules
    done
    for p in "${!libs[@]}"; do
        mkdir -p ".$(dirname "$p")"
        cp -L "$p" ".$p"
    done
    # Only the shared objects and the dynamic loader of the runtime packages
    # (not their docs or locales).
    for d in "${runtime_debs[@]}"; do
        rt=$(mktemp -d "$cache/tmp/runtime.XXXXXX")
        dpkg-deb -x "$d" "$rt"
        while IFS= read -r f; do
            mkdir -p "$(dirname "$f")"
            cp -a "$rt/$f" "$f"
        done < <(cd "$rt" && find . \( -path './usr/share' -o -name gconv \) -prune -o \( -type f -o -type l \) \
            \( -name '*.so*' -o -name 'ld-linux*' \) -print)
        rm -rf "$rt"
    done
    # Programs name their loader as /lib/ld-linux-*; trixie's libc6 ships it
    # in /usr/lib (/lib is a link to usr/lib on a Debian system).
    for f in usr/lib/ld-linux*; do
        if [ -e "$f" ] && [ ! -e "lib/${f##*/}" ]; then ln -s "/$f" "lib/${f##*/}"; fi
    done
    for e in "${extras[@]}"; do
        host=${e%%:*} guest=${e#*:}
        case "$guest" in
        /*) ;;
        *) die "guest path $guest is not absolute" ;;
        esac
        case "$guest" in */) guest=$guest$(basename "$host") ;; esac
        mkdir -p ".$(dirname "$guest")"
        rm -rf ".$guest"
        cp -RL --preserve=mode "$host" ".$guest"
        if [ "$strip" = 1 ]; then
            while IFS= read -r f; do
                is_elf "$f" && "$objcopy" --strip-debug "$f"
            done < <(find ".$guest" -type f)
        fi
    done
    manifest >etc/dmlc/manifest
    log "packing $(du -sh . | cut -f1) into $initrd"
    find . -mindepth 1 | sed 's|^\./||' | sort | bb cpio -o -H newc -R 0:0 2>/dev/null |
        gzip -6 >"$initrd.tmp"
    mv "$initrd.tmp" "$initrd"
    cd /
    # Keep the eight newest images.
    # shellcheck disable=SC2012 # our own plain file names
    ls -t "$cache"/initrd-*.cpio.gz | tail -n +9 | xargs -r rm -f
fi

# The headers of the same kernel, unpacked once per package version.
# Debian's headers Makefile includes the -common tree by its installed
# path (/usr/src/...): point it at the unpacked one.
if [ "$headers" = 1 ]; then
    hdr_deb=$(fetch "headers-$kver" "linux-headers-$kver")
    deps=$(dpkg-deb -f "$hdr_deb" Depends)
    common_pkg=$(grep -oE 'linux-headers-[0-9][^ ,(]*-common' <<<"$deps" | head -n 1)
    kbuild_pkg=$(grep -oE 'linux-kbuild-[0-9][^ ,(]*' <<<"$deps" | head -n 1)
    [ -n "$common_pkg" ] && [ -n "$kbuild_pkg" ] || die "linux-headers-$kver: unexpected Depends: $deps"
    common_deb=$(fetch "headers-common-$kver" "$common_pkg")
    # Kbuild's programs (fixdep, modpost) run on the host: its
    # architecture's package, for a cross-build of another's modules.
    kbuild_deb=$(fetch "kbuild-$kver-$hostarch" "$kbuild_pkg:$hostarch")
    hkey=$(cat "$hdr_deb" "$common_deb" "$kbuild_deb" | sha256sum | cut -c1-16)
    hroot="$cache/headers-$hkey"
    if [ ! -f "$hroot/.done" ]; then
        log "unpacking the headers of $kver"
        rm -rf "$hroot"
        mkdir -p "$hroot"
        for d in "$hdr_deb" "$common_deb" "$kbuild_deb"; do dpkg-deb -x "$d" "$hroot"; done
        sed -i "s|^include /usr/src/|include $hroot/usr/src/|" "$hroot/usr/src/linux-headers-$kver/Makefile"
        # A newer suite's kbuild programs (trixie's modpost needs glibc
        # 2.38) run with that suite's C library of the host's architecture,
        # through its own loader; the host's is left alone.
        needs_libc=()
        while IFS= read -r f; do
            ran=$("$f" </dev/null 2>&1 || true)
            if grep -q "GLIBC_[0-9.]*' not found" <<<"$ran"; then needs_libc+=("$f"); fi
        done < <(find "$hroot/usr/lib" -path '*linux-kbuild*' -type f -perm -u+x)
        if [ ${#needs_libc[@]} -gt 0 ]; then
            libc_deb=$(fetch "libc6-$hostarch" "libc6:$hostarch")
            dpkg-deb -x "$libc_deb" "$hroot/hostlibc"
            loader=$(find "$hroot/hostlibc" -name 'ld-linux*.so*' | head -n 1)
            libdir=$(dirname "$(find "$hroot/hostlibc" -name 'libc.so.6' | head -n 1)")
            [ -n "$loader" ] && [ -d "$libdir" ] || die "no loader in $(basename "$libc_deb")"
            for f in "${needs_libc[@]}"; do
                log "running ${f#"$hroot"/} with $(basename "$libc_deb")"
                mv "$f" "$f.elf"
                printf '#!/bin/sh\nexec %q --library-path %q "$0.elf" "$@"\n' "$loader" "$libdir" >"$f"
                chmod 755 "$f"
            done
        fi
        touch "$hroot/.done"
    fi
    echo "DMLC_KERNEL_HEADERS=$hroot/usr/src/linux-headers-$kver"
fi
# checkpatch.pl and the two data files it reads, from the kernel's source.
if [ "$checkpatch" = 1 ]; then
    kbranch=$(sed -E 's/^([0-9]+\.[0-9]+).*/\1/' <<<"$kver")
    src_deb=$(fetch "source-$kbranch" "linux-source-$kbranch")
    sdir="$cache/checkpatch-$(sha256sum "$src_deb" | cut -c1-16)"
    if [ ! -f "$sdir/.done" ]; then
        log "extracting checkpatch.pl from $(basename "$src_deb")"
        rm -rf "$sdir"
        mkdir -p "$sdir"
        dpkg-deb --fsys-tarfile "$src_deb" | tar -xO "./usr/src/linux-source-$kbranch.tar.xz" |
            tar -xJ -C "$sdir" --strip-components=1 "linux-source-$kbranch/scripts/checkpatch.pl" \
                "linux-source-$kbranch/scripts/spelling.txt" \
                "linux-source-$kbranch/scripts/const_structs.checkpatch"
        touch "$sdir/.done"
    fi
    echo "DMLC_CHECKPATCH=$sdir/scripts/checkpatch.pl"
fi
echo "DMLC_INITRD=$initrd"
echo "DMLC_KERNEL=$kernel_out"
