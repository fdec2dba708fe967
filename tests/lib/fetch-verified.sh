# shellcheck shell=bash
# fetch_verified URL SHA256 FILE: makes FILE a copy of URL whose sha256 is
# SHA256, downloading it (with curl) only when FILE is missing or differs;
# prints FILE. A partial or wrong download never takes FILE's name. Sourced
# by the scripts that build from a pinned source archive
# (xgboost-patches/build-xgboost.sh, bench/study/cross-lightgbm.sh) after
# tests/lib/prologue.sh, whose `log` and `die` it uses.

fetch_verified() {
    local url=$1 sha=$2 file=$3
    if [[ -e $file ]] && echo "$sha  $file" | sha256sum -c --status; then
        echo "$file"
        return 0
    fi
    log "fetching $(basename "$file")"
    mkdir -p "$(dirname "$file")"
    curl -fsSL -o "$file.tmp" "$url" || die "download of $url failed"
    echo "$sha  $file.tmp" | sha256sum -c --status ||
        die "$(basename "$file"): sha256 mismatch (expected $sha)"
    mv "$file.tmp" "$file"
    echo "$file"
}
