# shellcheck shell=bash
# Sourced: debian_mirror prints the Debian mirror this machine's apt uses
# (deb822 "URIs:" fields and one-line "deb URI" entries, not comments), or
# $DMLC_DEBIAN_MIRROR when set, else deb.debian.org; without a trailing /.
# tests/image/build-image.sh and packaging/test-debs.sh fetch from it.

debian_mirror() {
    [ -n "${DMLC_DEBIAN_MIRROR:-}" ] && {
        echo "$DMLC_DEBIAN_MIRROR"
        return
    }
    local uri
    uri=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
        sed -nE 's/^URIs:[[:space:]]*//p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' |
        tr ' ' '\n' | grep -E '/debian/?$' | head -n 1 || true)
    uri=${uri:-http://deb.debian.org/debian}
    echo "${uri%/}"
}
