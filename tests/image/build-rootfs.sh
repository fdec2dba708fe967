#!/bin/bash
# Build a Debian trixie root filesystem (a directory) for one guest
# architecture, for real programs in VMs: the guest's busybox initramfs
# mounts it read-only over virtio-fs and chroots into it. It holds python3,
# torch, numpy, scikit-learn, xgboost, procps, iproute2 and netbase; no
# kernel, no init system, no apt. One fix-up: a .pth file makes USE_LIBUV=0
# the default, as Debian's torch is built without libuv (see below).
#
# Usage: build-rootfs.sh --arch x86_64|aarch64|riscv64 [--check]
#   --arch A   the guest architecture (Debian amd64, arm64, riscv64).
#   --check    then check the rootfs on this host (qemu-user for a foreign
#              architecture): chroot into a read-only bind mount of it, in
#              a private mount and network namespace with /proc, /sys, /dev
#              and tmpfs /tmp, /run, /var/tmp, /root (as the guest does), and
#              run python3: import torch, numpy, sklearn, xgboost; a small
#              sklearn and xgboost fit; a 2-process torch.distributed gloo
#              allreduce over TCP on lo. Fails (exit 1) if any step fails.
#
# Output: progress on stderr; stdout's last line is
#   DMLC_ROOTFS=/abs/path/to/dir
#
# Environment:
#   DMLC_CACHE          cache root (default ~/.cache/virtio-dmlc); this
#                       script uses $DMLC_CACHE/rootfs
#   DMLC_DEBIAN_MIRROR  Debian mirror URI (default: the machine's, else
#                       http://deb.debian.org/debian)
#
# Cache: $DMLC_CACHE/rootfs/<arch>-<key>/, key = a hash over this script
# (which holds the package list and the suite) and the architecture; an
# unchanged run prints the path at once. The two newest per architecture
# are kept. The .debs are kept in $DMLC_CACHE/rootfs/debs/<debian-arch>/ (only
# those of the newest build), so a rebuild after an edit downloads nothing.
# The key does not follow the archive: to take trixie's newer point release,
# remove the cached directories.
#
# Method: mmdebstrap --variant=essential in root mode (the Essential:yes set
# plus the packages and their dependencies; no apt, no Recommends; man
# pages, docs and locales not unpacked), with the maintainer scripts of a
# foreign architecture run by qemu-user-static (bookworm's 7.2, which runs
# trixie's arm64 and riscv64 binaries) via binfmt_misc, mounted and
# registered here when missing. The alternative, --variant=extract (unpack
# only, no binfmt), takes well under a minute but needs fix-ups to work: no
# libblas.so.3/liblapack.so.3 (alternatives made by libopenblas0's postinst;
# numpy does not import), no /etc/passwd or group (base-passwd's postinst),
# no .pyc files (py3compile runs in postinst; on the read-only virtio-fs
# every python start compiles again: `import torch, sklearn, xgboost` took
# 7.6 s instead of 3.4 s natively, much longer under TCG), no dpkg
# database. Running the real scripts costs minutes (amd64) to tens of
# minutes (emulated, mostly py3compile), once per cache key. Numbers in
# ROOTFS.md.

# shellcheck source=SCRIPTDIR/../lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/prologue.sh" build-rootfs || exit 1
shopt -s inherit_errexit
# shellcheck source=SCRIPTDIR/../lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/ensure-packages.sh"
# shellcheck source=SCRIPTDIR/../lib/debian-mirror.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/debian-mirror.sh"

suite=trixie
packages=(python3 python3-torch python3-numpy python3-sklearn python3-xgboost
    procps iproute2 netbase)
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

usage() {
    script_header >&2
    exit "$1"
}

arch=
check=0
while [ $# -gt 0 ]; do
    case "$1" in
    -h | --help) usage 0 ;;
    --arch)
        [ $# -ge 2 ] || usage 2
        arch=$2
        shift 2
        ;;
    --arch=*)
        arch=${1#--arch=}
        shift
        ;;
    --check)
        check=1
        shift
        ;;
    *) usage 2 ;;
    esac
done
command -v dpkg >/dev/null || die "needs a Debian host (dpkg, apt)"
# The guest architecture, its Debian name and its qemu-user name.
case "$arch" in
x86_64 | amd64) arch=x86_64 debarch=amd64 qarch=x86_64 ;;
aarch64 | arm64) arch=aarch64 debarch=arm64 qarch=aarch64 ;;
riscv64) debarch=riscv64 qarch=riscv64 ;;
"") usage 2 ;;
*) die "unknown architecture '$arch' (x86_64, aarch64 or riscv64)" ;;
esac
foreign=0
[ "$debarch" = "$(dpkg --print-architecture)" ] || foreign=1

# Foreign binaries run through binfmt_misc and qemu-user-static; the F flag
# (Debian's default) opens the interpreter at registration, so it works in
# the chroot.
ensure_binfmt() {
    local bm=/proc/sys/fs/binfmt_misc conf=/usr/lib/binfmt.d/qemu-$qarch.conf
    if [ ! -e "$bm/register" ]; then
        log "mounting binfmt_misc"
        mount -t binfmt_misc binfmt_misc "$bm" || die "cannot mount binfmt_misc on $bm"
    fi
    if [ ! -e "$bm/qemu-$qarch" ]; then
        [ -f "$conf" ] || die "no $conf (qemu-user-static)"
        log "registering qemu-$qarch with binfmt_misc"
        cat "$conf" >"$bm/register" || die "cannot register $conf"
    fi
    grep -qx enabled "$bm/qemu-$qarch" || die "binfmt_misc handler qemu-$qarch is disabled"
    arch-test "$debarch" >/dev/null || die "this host cannot run $debarch binaries (arch-test)"
}

# What building and checking need: root, the host packages, binfmt_misc.
prepare_host() {
    [ "$(id -u)" = 0 ] || die "run as root (mmdebstrap root mode, binfmt_misc, chroot)"
    local host_pkgs=(mmdebstrap debian-archive-keyring util-linux iproute2)
    [ "$foreign" = 0 ] || host_pkgs+=(qemu-user-static arch-test)
    ensure_packages "${host_pkgs[@]}"
    # User IDs are plain text in the binary keyring: bookworm's keyring has
    # trixie's keys from 2023.3+deb12u2 on.
    grep -aq '(13/trixie)' "$keyring" ||
        die "$keyring lacks trixie's keys: upgrade debian-archive-keyring (bookworm's 2023.3+deb12u2 has them)"
    [ "$foreign" = 0 ] || ensure_binfmt
}

script_sha=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
key=$(printf 'script %s\nsuite %s\narch %s\npackages %s\n' \
    "$script_sha" "$suite" "$debarch" "${packages[*]}" | sha256sum | cut -c1-16)
root=$CACHE/rootfs
out=$root/$arch-$key
debs=$root/debs/$debarch

# Debian builds torch without libuv, but its TCP rendezvous (init_method
# tcp:// and env://, torchrun) asks for libuv unless USE_LIBUV=0: "use_libuv
# was requested but PyTorch was build without libuv support". A .pth line
# runs at every python start (not with -S): it sets that default.
libuv_pth='import os; os.environ.setdefault("USE_LIBUV", "0")'

build() {
    local mirror security tmp t0 before
    mirror=$(debian_mirror)
    security=${mirror%/debian}/debian-security
    mkdir -p "$debs"
    # Leftovers of interrupted runs (we hold the lock): never cross into a
    # mount (/proc, /sys, /dev of a chroot mmdebstrap left behind).
    find "$root" -maxdepth 1 -name ".tmp-$arch-*" -exec rm -rf --one-file-system {} +
    tmp=$(mktemp -d "$root/.tmp-$arch-$key.XXXXXX")
    # shellcheck disable=SC2064 # expand $tmp now
    trap "rm -rf --one-file-system '$tmp'" EXIT
    before=$(find "$debs" -maxdepth 1 -name '*.deb' -printf '%f\n')
    t0=$SECONDS
    log "building $suite/$debarch into $tmp (mirror $mirror)"
    # essential: the Essential:yes set plus the packages and their
    # dependencies, without Recommends, apt or init; man pages, docs (not
    # copyright files), locales and info pages are not unpacked.
    local inc
    inc=$(
        IFS=,
        echo "${packages[*]}"
    )
    # shellcheck disable=SC2016 # "$1" in the hooks: mmdebstrap's (the rootfs)
    nice -n 19 mmdebstrap --mode=root --variant=essential --arch="$debarch" \
        --include="$inc" \
        --keyring="$keyring" \
        --aptopt='APT::Install-Recommends "false"' \
        --aptopt='APT::Sandbox::User "root"' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --skip=essential/unlink \
        --setup-hook='mkdir -p "$1"/var/cache/apt/archives/' \
        --setup-hook="sync-in $debs /var/cache/apt/archives/" \
        --customize-hook="sync-out /var/cache/apt/archives $debs" \
        --customize-hook='printf "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" >"$1/etc/hosts"' \
        --customize-hook='rm -f "$1/etc/hostname" "$1/etc/resolv.conf"' \
        --customize-hook="echo '$libuv_pth' >\"\$1/usr/lib/python3/dist-packages/dmlc-use-libuv.pth\"" \
        "$suite" "$tmp" \
        "deb $mirror $suite main" \
        "deb $mirror $suite-updates main" \
        "deb $security $suite-security main" >&2 ||
        die "mmdebstrap failed"
    # Keep only the .debs this build installed (the name apt gives them).
    local keep
    keep=$(dpkg-query --admindir="$tmp/var/lib/dpkg" -W \
        -f='${Package}_${Version}_${Architecture}.deb\n' | sed 's/:/%3a/g')
    find "$debs" -maxdepth 1 -name '*.deb' -printf '%f\n' | { grep -vxF "$keep" || true; } |
        sed "s|^|$debs/|" | xargs -r rm -f
    local downloaded
    downloaded=$(find "$debs" -maxdepth 1 -name '*.deb' -printf '%f %s\n' |
        awk -v before="$before" 'BEGIN { n = split(before, b, "\n"); for (i = 1; i <= n; i++) old[b[i]] = 1 }
            !($1 in old) { s += $2 } END { printf "%d", s / 1000000 }')
    {
        echo "suite $suite"
        echo "arch $debarch"
        echo "key $key"
        echo "mirror $mirror"
        echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        dpkg-query --admindir="$tmp/var/lib/dpkg" -W -f='${Package} ${Version}\n' \
            python3 python3-torch python3-numpy python3-sklearn python3-xgboost
    } >"$tmp/etc/dmlc-rootfs"
    touch "$tmp/.done"
    mv -T "$tmp" "$out"
    trap - EXIT
    log "built $out in $((SECONDS - t0)) s: $(du -sh "$out" | cut -f1) on disk," \
        "downloaded $downloaded MB" \
        "(packages $(du -sh "$debs" | cut -f1))"
    # Keep the two newest of this architecture.
    local d n=0
    while IFS= read -r d; do
        [ -f "$d/.done" ] || continue
        n=$((n + 1))
        [ "$n" -le 2 ] && continue
        log "removing old $d"
        rm -rf --one-file-system "$d"
    done < <(find "$root" -mindepth 1 -maxdepth 1 -type d -name "$arch-*" -printf '%T@ %p\n' |
        sort -rn | cut -d' ' -f2-)
}

if [ ! -f "$out/.done" ]; then
    prepare_host
    cache_lock "$root/.lock-$arch"
    [ -f "$out/.done" ] || build
    cache_unlock
else
    log "cached $out"
    touch "$out"
fi

# The check, run by python3 in the rootfs: rank "driver" starts two ranks of
# itself and waits.
# shellcheck disable=SC2016 # python, expanded by nothing here
check_py='
import os, subprocess, sys, time
rank = sys.argv[1]
if rank == "driver":
    t = time.time()
    import numpy, sklearn, torch, xgboost
    import torch.distributed as dist
    print("python", sys.version.split()[0], "torch", torch.__version__,
          "numpy", numpy.__version__, "sklearn", sklearn.__version__,
          "xgboost", xgboost.__version__, "gloo", dist.is_gloo_available(),
          "import %.1fs" % (time.time() - t), flush=True)
    assert dist.is_gloo_available()
    from sklearn.linear_model import LogisticRegression
    x = numpy.random.default_rng(0).normal(size=(200, 4))
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    print("sklearn fit score", LogisticRegression().fit(x, y).score(x, y), flush=True)
    b = xgboost.train({"max_depth": 2, "nthread": 1}, xgboost.DMatrix(x, label=y), 3)
    print("xgboost predictions", len(b.predict(xgboost.DMatrix(x))), flush=True)
    procs = [subprocess.Popen([sys.executable, "-c", sys.argv[2], str(r), sys.argv[2]])
             for r in range(2)]
    codes = [p.wait(timeout=900) for p in procs]
    assert codes == [0, 0], codes
    print("gloo allreduce ok", flush=True)
else:
    import torch, torch.distributed as dist
    r = int(rank)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511",
                            rank=r, world_size=2, timeout=__import__("datetime").timedelta(seconds=600))
    t = torch.tensor([float(r + 1)] * 4)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4, t
    dist.barrier()
    dist.destroy_process_group()
'

if [ "$check" = 1 ]; then
    prepare_host
    log "checking $out ($debarch$([ "$foreign" = 0 ] || echo ", qemu-$qarch"))"
    t0=$SECONDS
    # A private mount and network namespace (only lo): the rootfs read-only,
    # the guest's mounts on top, nothing left behind.
    # shellcheck disable=SC2016 # expanded by the inner shell
    unshare --mount --net --propagation private sh -euc '
        r=$1
        shift
        ip link set lo up
        mount --bind "$r" "$r"
        mount -o remount,bind,ro "$r"
        mount -t proc proc "$r/proc"
        mount --rbind /sys "$r/sys"
        mount --rbind /dev "$r/dev"
        for d in tmp run var/tmp root; do mount -t tmpfs tmpfs "$r/$d"; done
        exec chroot "$r" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root \
            GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 "$@"
    ' sh "$out" python3 -c "$check_py" driver "$check_py" >&2 ||
        die "check of $out failed"
    log "check passed in $((SECONDS - t0)) s"
fi

echo "DMLC_ROOTFS=$out"
