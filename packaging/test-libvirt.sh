#!/bin/bash
# Two libvirt domains with the virtio-dmlc device against one daemon (issue
# 41, item 3): Debian's libvirt defines and starts them from
# packaging/libvirt/dmlc-domain.xml, and both guests pass the device's
# self-test. Needs root.
#
# Usage: packaging/test-libvirt.sh [--keep] [--timeout SECONDS]
#   --keep          keep the work folder (logs, XML, libvirt's state) and
#                   print its path
#   --timeout S     how long the guests may take, boot to power-off
#                   (default 600)
#
# What it does:
#   1. installs what is missing with apt-get: libvirt-daemon-system (its
#      sysv flavour: no systemd runs here), libvirt-clients (virsh,
#      virt-xml-validate) and libxml2-utils (xmllint, which the validator
#      runs);
#   2. virt-xml-validate on the example XML and on the two domains made
#      from it;
#   3. one vhost-device-dmlc with 2 sockets (the release build);
#   4. virtlogd, virtlockd and libvirtd, started by hand in a private mount
#      namespace (what systemd's sockets would start on a host):
#      /etc/libvirt, /run/libvirt, /var/lib/libvirt, /var/log/libvirt and
#      /var/cache/libvirt are folders of the work folder there, so the
#      machine's own configuration and state are neither read nor changed,
#      and a libvirtd of the machine's would not clash. The private qemu.conf
#      is Debian's but for three settings: no security driver (no AppArmor
#      here), no cgroups and no private /dev (no systemd; a container); and
#      /dev/kvm is root:kvm 0660 there, as udev makes it on a host.
#      QEMU runs as Debian's libvirt-qemu, as on a real host: the daemon's
#      sockets are mode 0660 in the group libvirt-qemu, and QEMU (with its firmware),
#      the kernel and the initrd are copies in the work folder, which
#      libvirt-qemu can read, as docs/qemu.md installs them;
#   5. virsh define and virsh start of two domains (names unique per run)
#      over qemu:///system (libvirtd's socket in the work folder): the
#      example XML with the patched QEMU as emulator, the guest image of
#      tests/image/build-image.sh (with the release dmlc-guest), rank r's
#      socket and its own console file;
#   6. waits for each console to show `selftest PASS: ..., rank r of 2` and
#      `DMLC-EXIT NAME 0`, and for libvirt to report both domains shut off;
#   7. destroys and undefines the domains and stops every process it started
#      (also on failure or Ctrl-C), printing the logs of a failure.
#
# Environment: DMLC_QEMU (the patched QEMU; default: qemu-patches/build-qemu.sh
# --env, which builds it once), DMLC_BACKEND_BIN and DMLC_GUEST_BIN (default
# target/release/vhost-device-dmlc and target/release/dmlc-guest: `cargo
# build --release -p dmlc-guest -p vhost-device-dmlc`), DMLC_ACCEL=kvm (the
# domains as type kvm instead of qemu, TCG), DMLC_CACHE.

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" test-libvirt || exit 1
# shellcheck source=SCRIPTDIR/../tests/lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/ensure-packages.sh"
# shellcheck source=SCRIPTDIR/../tests/lib/import-env.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/import-env.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
template=$here/libvirt/dmlc-domain.xml
keep=0
timeout=600
while [ $# -gt 0 ]; do
    case "$1" in
    --keep)
        keep=1
        shift
        ;;
    --timeout)
        [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "--timeout needs a number of seconds"
        timeout=$2
        shift 2
        ;;
    -h | --help)
        script_header
        exit 0
        ;;
    *)
        echo "test-libvirt.sh: unknown option $1 (try --help)" >&2
        exit 2
        ;;
    esac
done
[ "$(id -u)" = 0 ] || die "needs root (libvirt's system daemon, mount namespaces)"

t0=$SECONDS
ensure_packages libvirt-daemon-system libvirt-daemon-system-sysv libvirt-clients libxml2-utils util-linux
log "packages ready after $((SECONDS - t0)) s"

backend=${DMLC_BACKEND_BIN:-$repo/target/release/vhost-device-dmlc}
guest=${DMLC_GUEST_BIN:-$repo/target/release/dmlc-guest}
for b in "$backend" "$guest"; do
    [ -x "$b" ] || die "no $b: build it with cargo build --release -p dmlc-guest -p vhost-device-dmlc"
done
if [ -z "${DMLC_QEMU:-}" ]; then
    import_env DMLC_QEMU DMLC_QEMU_FIRMWARE -- "$repo/qemu-patches/build-qemu.sh" --env ||
        die "no patched QEMU (qemu-patches/build-qemu.sh failed; set DMLC_QEMU to use your own)"
fi
[ -x "$DMLC_QEMU" ] || die "DMLC_QEMU=$DMLC_QEMU is not an executable file"
"$DMLC_QEMU" -device help 2>&1 | grep -q '"vhost-user-dmlc-pci"' ||
    die "$DMLC_QEMU has no vhost-user-dmlc-pci device (not the patched QEMU?)"
image=$("$repo/tests/image/build-image.sh" --strip "$guest:/usr/bin/") ||
    die "tests/image/build-image.sh failed"
kernel=$(sed -n 's/^DMLC_KERNEL=//p' <<<"$image")
initrd=$(sed -n 's/^DMLC_INITRD=//p' <<<"$image")
[[ -f $kernel && -f $initrd ]] || die "tests/image/build-image.sh named no kernel and initrd"
getent passwd libvirt-qemu >/dev/null || die "no user libvirt-qemu (libvirt-daemon-system makes it)"
domain_type=qemu
[ "${DMLC_ACCEL:-tcg}" = kvm ] && domain_type=kvm

qemu_tree=${DMLC_QEMU%/bin/*}
[[ $DMLC_QEMU == */bin/* && -d $qemu_tree/share/qemu ]] ||
    die "DMLC_QEMU=$DMLC_QEMU is not in bin/ of an installed QEMU tree (with share/qemu)"

# Short: the daemon's socket paths must fit a sockaddr_un.
work=$(mktemp -d /tmp/dmlc-libvirt.XXXXXX)
tag=dmlc-test-$(basename "$work" | cut -d. -f2 | tr '[:upper:]' '[:lower:]')
names=("$tag-vm0" "$tag-vm1")
uri="qemu:///system?socket=$work/run/libvirt-sock"
daemon_pid="" libvirtd_pid=""
virsh() { command virsh -q -c "$uri" "$@"; }

show_logs() {
    local f
    for f in "$work"/daemon.log "$work"/libvirtd.log "$work"/virtlogd.log "$work"/virtlockd.log \
        "$work"/log/qemu/*.log "$work"/vm*-console.log; do
        [ -s "$f" ] || continue
        echo "----- $f (last 40 lines)" >&2
        tail -n 40 "$f" >&2
    done
}
cleanup() {
    local rc=$? name pidfile pid
    trap - EXIT INT TERM
    [ "$rc" = 0 ] || show_logs
    if [ -n "$libvirtd_pid" ] && kill -0 "$libvirtd_pid" 2>/dev/null; then
        for name in "${names[@]}"; do
            virsh domstate "$name" >/dev/null 2>&1 || continue
            virsh destroy "$name" >/dev/null 2>&1 || true
            virsh undefine "$name" >/dev/null 2>&1 || log "virsh undefine $name failed"
        done
    fi
    # QEMUs left behind by a libvirtd that died: libvirt's pid files.
    for pidfile in "$work"/run/qemu/*.pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        if [[ $pid =~ ^[0-9]+$ ]]; then kill "$pid" 2>/dev/null || true; fi
    done
    for pid in "$libvirtd_pid" "$(cat "$work/virtlogd.pid" 2>/dev/null)" \
        "$(cat "$work/virtlockd.pid" 2>/dev/null)" "$daemon_pid"; do
        [ -n "$pid" ] || continue
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
    done
    if [ "$keep" = 1 ]; then
        log "kept $work"
    else
        rm -rf "$work"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

chmod 0755 "$work"
# What QEMU, as libvirt-qemu, must read: not under /root. The QEMU tree with
# its firmware links resolved (QEMU finds ../share/qemu next to its binary).
mkdir -p "$work/qemu" "$work/images"
cp -rL "$qemu_tree/bin" "$qemu_tree/share" "$work/qemu/"
qemu=$work/qemu/bin/${DMLC_QEMU##*/}
cp "$kernel" "$work/images/vmlinuz"
cp "$initrd" "$work/images/initrd.cpio.gz"

# The domains: the example with this run's names, paths and sockets.
for r in 0 1; do
    sed -e "s|dmlc-vm0-console.log|vm$r-console.log|g" \
        -e "s|/var/log/libvirt/qemu/vm$r-console.log|$work/vm$r-console.log|g" \
        -e "s|dmlc-vm0|${names[r]}|g" \
        -e "s|<domain type='qemu'|<domain type='$domain_type'|" \
        -e "s|/opt/qemu-dmlc/bin/qemu-system-x86_64|$qemu|" \
        -e "s|/var/lib/libvirt/images/dmlc-vmlinuz|$work/images/vmlinuz|" \
        -e "s|/var/lib/libvirt/images/dmlc-initrd.cpio.gz|$work/images/initrd.cpio.gz|" \
        -e "s|/run/vhost-device-dmlc/group0/dmlc.sock0|$work/dmlc.sock$r|" \
        "$template" >"$work/vm$r.xml"
    if ! grep -q "$work/dmlc.sock$r" "$work/vm$r.xml" || ! grep -q "$qemu" "$work/vm$r.xml"; then
        die "the example XML lacks the paths this test replaces"
    fi
done

log "virt-xml-validate: the example and the two domains"
for f in "$template" "$work/vm0.xml" "$work/vm1.xml"; do
    out=$(virt-xml-validate "$f" domain 2>&1) || die "virt-xml-validate $f: $out"
done

log "starting vhost-device-dmlc with 2 members"
"$backend" --socket-path "$work/dmlc.sock" --socket-count 2 --socket-mode 0660 --socket-group libvirt-qemu \
    --control-socket "$work/control.sock" >"$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do
    [[ -S $work/dmlc.sock0 && -S $work/dmlc.sock1 && -S $work/control.sock ]] && break
    kill -0 "$daemon_pid" 2>/dev/null || die "vhost-device-dmlc exited"
    sleep 0.1
done
[[ -S $work/dmlc.sock1 ]] || die "vhost-device-dmlc made no sockets in 10 s"

log "starting virtlogd, virtlockd and libvirtd in a private mount namespace ($work)"
mkdir -p "$work"/{etc,run,lib,log,cache}
cat >"$work/etc/libvirtd.conf" <<'EOF'
# Only root reaches the sockets; no polkit (no D-Bus here).
unix_sock_ro_perms = "0700"
unix_sock_rw_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
EOF
cat >"$work/etc/qemu.conf" <<'EOF'
# Debian's defaults (QEMU as libvirt-qemu:libvirt-qemu) but: no AppArmor
# here, and no systemd to make cgroups or a private /dev for QEMU.
security_driver = "none"
cgroup_controllers = [ ]
namespaces = [ ]
EOF
# shellcheck disable=SC2016 # expanded by the inner shell
unshare --mount --propagation private bash -c '
    set -e
    w=$1
    for d in etc:/etc/libvirt run:/run/libvirt lib:/var/lib/libvirt \
        log:/var/log/libvirt cache:/var/cache/libvirt; do
        mkdir -p "${d#*:}" # /run/libvirt: made by the service otherwise
        mount --bind "$w/${d%%:*}" "${d#*:}"
    done
    # /dev/kvm as udev makes it on a host with systemd (Debian: root:kvm,
    # 0660), for libvirt-qemu (in group kvm). Else libvirt, which probes
    # QEMU with KVM but finds /dev/kvm closed to libvirt-qemu, throws its
    # cached capabilities away at every lookup and probes again (4 s each).
    if [ -c /dev/kvm ]; then
        mknod -m 0660 "$w/kvm" c 10 232
        chgrp kvm "$w/kvm"
        mount --bind "$w/kvm" /dev/kvm
    fi
    virtlogd -p "$w/virtlogd.pid" >"$w/virtlogd.log" 2>&1 &
    virtlockd -p "$w/virtlockd.pid" >"$w/virtlockd.log" 2>&1 &
    exec libvirtd -p "$w/libvirtd.pid" >"$w/libvirtd.log" 2>&1
' test-libvirt "$work" &
libvirtd_pid=$!
for _ in $(seq 300); do
    [ -S "$work/run/libvirt-sock" ] && virsh list --all >/dev/null 2>&1 && break
    kill -0 "$libvirtd_pid" 2>/dev/null || die "libvirtd exited"
    sleep 0.1
done
virsh list --all >/dev/null 2>&1 || die "libvirtd does not answer on $work/run/libvirt-sock after 30 s"

for r in 0 1; do
    log "virsh define and start ${names[r]} (rank $r, $work/dmlc.sock$r)"
    out=$(virsh define "$work/vm$r.xml" 2>&1) || die "virsh define ${names[r]}: $out"
    out=$(virsh start "${names[r]}" 2>&1) || die "virsh start ${names[r]}: $out"
done

log "waiting for both guests' self-tests (up to $timeout s)"
t=$SECONDS
done_=(0 0)
while [ "${done_[0]}${done_[1]}" != 11 ]; do
    ((SECONDS - t < timeout)) || die "the guests did not finish in $timeout s"
    sleep 2
    for r in 0 1; do
        [ "${done_[r]}" = 0 ] || continue
        console=$work/vm$r-console.log
        exit_line=$(grep -a "^DMLC-EXIT ${names[r]} " "$console" 2>/dev/null || true)
        if [ -z "$exit_line" ]; then
            state=$(virsh domstate "${names[r]}" 2>&1 || true)
            [ "$state" = running ] || die "${names[r]} is '$state' before its job ended"
            continue
        fi
        pass=$(grep -a '^selftest PASS: ' "$console" | tr -d '\r' || true)
        [ "${exit_line%$'\r'}" = "DMLC-EXIT ${names[r]} 0" ] || die "${names[r]}: $exit_line"
        [[ $pass == *", rank $r of 2" ]] || die "${names[r]}: no 'selftest PASS: ..., rank $r of 2' line"
        log "${names[r]}: $pass ($((SECONDS - t)) s)"
        done_[r]=1
    done
done

# The guests power off; libvirt must see it.
for r in 0 1; do
    for _ in $(seq 150); do
        [ "$(virsh domstate "${names[r]}" 2>&1)" = "shut off" ] && break
        sleep 0.2
    done
    state=$(virsh domstate "${names[r]}" 2>&1 || true)
    [ "$state" = "shut off" ] || die "${names[r]} is '$state' after powering off"
done
collectives="?"
if [ -x "${backend%/*}/dmlc-ctl" ] && m=$("${backend%/*}/dmlc-ctl" --socket "$work/control.sock" metrics 2>&1); then
    collectives=$(awk '/^dmlc_collectives_total/ { n += $NF } END { print n + 0 }' <<<"$m")
fi
log "PASS: 2 libvirt domains passed the self-test against one daemon ($collectives collectives) in $((SECONDS - t0)) s"
