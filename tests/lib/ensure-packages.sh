# shellcheck shell=bash
# ensure_packages PKG...: installs the Debian packages among PKG that are
# not installed yet, with apt-get, as root; updates the package lists once
# and retries when the install fails (stale lists). Sourced by the build
# scripts that need packages (vm-harness/build-virtiofsd.sh,
# xgboost-patches/build-xgboost.sh) after tests/lib/prologue.sh, whose `log`
# and `die` it uses.

ensure_packages_updated=0
ensure_packages() {
    local missing=() p
    for p in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed'; then
            missing+=("$p")
        fi
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    [[ $(id -u) -eq 0 ]] ||
        die "missing build packages (install them as root): ${missing[*]}"
    log "installing ${missing[*]}"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >&2; then
        if [[ $ensure_packages_updated -eq 0 ]]; then
            log "apt-get update"
            apt-get -qq update >&2 || die "apt-get update failed"
            ensure_packages_updated=1
        fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >&2 || die "apt-get install ${missing[*]} failed"
    fi
}
