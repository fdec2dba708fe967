# shellcheck shell=bash
# import_env NAME... -- COMMAND [ARG...]
#
# Runs COMMAND (a build script's --env mode), which prints shell-quoted
# assignments such as DMLC_KMOD=/path on stdout, and sets and exports each
# NAME from them. Fails, saying which, when COMMAND fails, when it prints no
# assignment of a NAME, or an empty one, or when it prints an assignment of
# a name not asked for. tests/run.sh uses it instead of
# `eval "$(COMMAND)"`, which succeeds on empty output, so a failed build
# went unnoticed (issue 35).
import_env() {
  local -a names=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    names+=("$1")
    shift
  done
  if [ $# -lt 2 ] || [ ${#names[@]} -eq 0 ]; then
    echo "import_env: usage: import_env NAME... -- COMMAND [ARG...]" >&2
    return 2
  fi
  shift
  local out rc=0
  out=$("$@") || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "import_env: '$*' failed (exit $rc)" >&2
    return 1
  fi
  local line name known n
  while IFS= read -r line; do
    [[ $line =~ ^([A-Z][A-Z0-9_]*)= ]] || continue
    name=${BASH_REMATCH[1]}
    known=0
    for n in "${names[@]}"; do [ "$n" = "$name" ] && known=1; done
    if [ "$known" = 0 ]; then
      echo "import_env: '$*' printed $name, which was not asked for" >&2
      return 1
    fi
    # One %q-quoted assignment of a name asked for: safe to evaluate.
    eval "$line"
  done <<<"$out"
  for name in "${names[@]}"; do
    if [ -z "${!name:-}" ]; then
      echo "import_env: '$*' gave no $name" >&2
      return 1
    fi
    export "${name?}"
  done
}
