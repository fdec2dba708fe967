#!/usr/bin/env bash
# Checks tests/lib/import-env.sh: a failed build script, a missing or empty
# assignment and an unexpected one each fail import_env; a good one sets and
# exports its variables. Run by tests/run.sh; prints one line per case.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tests/lib/import-env.sh
. tests/lib/import-env.sh

fails=0
expect() { # expect ok|fail DESCRIPTION -- import_env arguments...
  local want=$1 what=$2
  shift 3
  local got=ok
  (import_env "$@") 2>/dev/null || got=fail
  if [ "$got" = "$want" ]; then
    echo "ok: $what"
  else
    echo "FAILED: $what: import_env ${got}ed, expected $want" >&2
    fails=$((fails + 1))
  fi
}

quoted='/tmp/a dir/x'
expect fail "a script that fails after printing its assignment" -- \
  DMLC_A -- sh -c 'echo DMLC_A=/bin/true; exit 3'
expect fail "a script that prints nothing" -- DMLC_A -- true
expect fail "an empty value" -- DMLC_A -- echo 'DMLC_A='
expect fail "a name not asked for" -- DMLC_A -- printf 'DMLC_A=1\nDMLC_B=2\n'
expect fail "one of two names missing" -- DMLC_A DMLC_B -- echo 'DMLC_A=1'
expect fail "no names" -- -- echo 'DMLC_A=1'
expect ok "two names among other output" -- \
  DMLC_A DMLC_B -- printf 'building...\nDMLC_A=%q\nDMLC_B=2\n' "$quoted"

import_env DMLC_A -- printf 'DMLC_A=%q\n' "$quoted"
if [ "$DMLC_A" = "$quoted" ] && [ "$(sh -c 'echo "$DMLC_A"')" = "$quoted" ]; then
  echo "ok: a quoted value is set and exported"
else
  echo "FAILED: DMLC_A is '$DMLC_A', expected '$quoted' (and exported)" >&2
  fails=$((fails + 1))
fi
[ "$fails" -eq 0 ] || { echo "$fails case(s) of import_env failed" >&2; exit 1; }
