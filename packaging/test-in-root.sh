#!/bin/bash
# Runs inside the Debian 12 root of packaging/test-debs.sh (as /test-in-root.sh,
# with the packages in /debs): installs them, uses them, purges them.
# Usage: test-in-root.sh KERNEL_VERSION

set -euo pipefail
kver=$1
say() { echo "test-in-root: $*" >&2; }
fail() {
    echo "test-in-root: FAIL: $*" >&2
    exit 1
}

say "apt-get install ./debs/*.deb"
# The root has no network (its own namespace): every dependency must be in it
# already (a missing one fails here, naming it).
DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    -o Dpkg::Use-Pty=0 /debs/*.deb >/tmp/apt.log 2>&1 || {
    cat /tmp/apt.log >&2
    fail "apt-get install of the packages"
}
for p in vhost-device-dmlc libdmlc-guest1 libdmlc-guest-dev dmlc-guest virtio-dmlc-dkms; do
    dpkg-query -W -f='${Status}' "$p" | grep -q 'ok installed' || fail "$p is not installed"
done

say "the daemon, dmlc-ctl and dmlc-guest run"
vhost-device-dmlc --help | grep -q -- '--socket-path' || fail "vhost-device-dmlc --help"
vhost-device-dmlc --version >&2
dmlc-ctl --help >/dev/null || fail "dmlc-ctl --help"
dmlc-guest --help | grep -q selftest || fail "dmlc-guest --help"

say "the service's user, unit and config"
getent passwd vhost-dmlc >/dev/null || fail "no user vhost-dmlc"
getent group vhost-dmlc >/dev/null || fail "no group vhost-dmlc"
[ -f /lib/systemd/system/vhost-device-dmlc@.service ] || fail "no unit"
[ -f /etc/vhost-device-dmlc/group0.conf ] || fail "no default config"
grep -qx /etc/vhost-device-dmlc/group0.conf /var/lib/dpkg/info/vhost-device-dmlc.conffiles ||
    fail "the config is not a conffile"

say "pkg-config --cflags --libs dmlc-guest: $(pkg-config --cflags --libs dmlc-guest)"
pkg-config --exists --print-errors 'dmlc-guest >= 0.1' || fail "pkg-config dmlc-guest"
soname=$(objdump -p "$(readlink -f /usr/lib/x86_64-linux-gnu/libdmlc_guest.so)" | awk '$1 == "SONAME" {print $2}')
say "the library's SONAME: $soname"
[ "$soname" = libdmlc_guest.so.1 ] || fail "SONAME is '$soname', not libdmlc_guest.so.1"
mkdir -p /tmp/c
cat >/tmp/c/hello.c <<'C'
#include <dmlc_guest.h>
#include <dmlc_rabit.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    if (dmlc_abi_version() != DMLC_ABI_VERSION) {
        fprintf(stderr, "ABI %u, header %u\n", dmlc_abi_version(), DMLC_ABI_VERSION);
        return 1;
    }
    const char *timeout = dmlc_strerror(DMLC_ERR_TIMEOUT);
    if (timeout == NULL || strlen(timeout) == 0)
        return 1;
    printf("libdmlc_guest %s, ABI %u, DMLC_ERR_TIMEOUT: %s\n", dmlc_version(), dmlc_abi_version(), timeout);
    return 0;
}
C
# shellcheck disable=SC2046 # pkg-config's words are the flags
gcc -std=c99 -Wall -Wextra -Werror -o /tmp/c/hello /tmp/c/hello.c $(pkg-config --cflags --libs dmlc-guest) ||
    fail "compiling and linking against pkg-config's flags"
objdump -p /tmp/c/hello | grep -q 'NEEDED.*libdmlc_guest\.so\.1$' || fail "the program does not need libdmlc_guest.so.1"
/tmp/c/hello >&2 || fail "the C program"

say "dkms: virtio_dmlc for $kver (Debian's linux-headers-$kver)"
dkms status -m virtio_dmlc >&2
dkms status -m virtio_dmlc | grep -q 'added\|built\|installed' || fail "the module is not added to dkms"
ver=$(dpkg-query -W -f='${Version}' virtio-dmlc-dkms)
ver=${ver%%-*}
dkms build -m virtio_dmlc -v "$ver" -k "$kver" >/tmp/dkms.log 2>&1 || {
    cat /tmp/dkms.log "/var/lib/dkms/virtio_dmlc/$ver/build/make.log" >&2 || true
    fail "dkms build"
}
dkms install -m virtio_dmlc -v "$ver" -k "$kver" >>/tmp/dkms.log 2>&1 || {
    cat /tmp/dkms.log >&2
    fail "dkms install"
}
ko=$(find "/lib/modules/$kver" -name 'virtio_dmlc.ko*' | head -n 1)
[ -n "$ko" ] || fail "no virtio_dmlc.ko under /lib/modules/$kver"
vermagic=$(modinfo -F vermagic "$ko")
say "$ko: vermagic $vermagic"
[ "${vermagic%% *}" = "$kver" ] || fail "vermagic $vermagic is not $kver"
dkms status -m virtio_dmlc -k "$kver" | grep -q installed || fail "dkms status after install"

/test-service.sh || fail "test-service.sh"

say "apt-get purge leaves nothing behind"
files=$(dpkg -L vhost-device-dmlc libdmlc-guest1 libdmlc-guest-dev dmlc-guest virtio-dmlc-dkms |
    grep -vE '^/(\.|usr|usr/bin|usr/lib|usr/lib/x86_64-linux-gnu|usr/lib/x86_64-linux-gnu/pkgconfig|usr/include|usr/share|usr/share/doc|usr/src|etc|lib|lib/systemd|lib/systemd/system|usr/lib/sysusers.d)$')
DEBIAN_FRONTEND=noninteractive apt-get purge -y -q -o Dpkg::Use-Pty=0 \
    vhost-device-dmlc libdmlc-guest1 libdmlc-guest-dev dmlc-guest virtio-dmlc-dkms >/tmp/apt.log 2>&1 || {
    cat /tmp/apt.log >&2
    fail "apt-get purge"
}
left=""
for f in $files; do
    [ -e "$f" ] && left="$left $f"
done
[ -z "$left" ] || fail "left after purge:$left"
[ ! -e "/var/lib/dkms/virtio_dmlc" ] || fail "dkms still has virtio_dmlc after purge"
[ -z "$(find "/lib/modules/$kver" -name 'virtio_dmlc.ko*')" ] || fail "the module is still installed after purge"
say "passed"
