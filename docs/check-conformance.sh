#!/usr/bin/env bash
# Keeps the conformance table of docs/spec.md (5.X.9) honest:
#  - every identifier ([DEV-...-n], [DRV-...-n]) in the text has exactly one
#    row in the table, and every row's identifier appears in the text;
#  - every test the table names as `path::test_name` exists: the file is in
#    the repository and defines `fn test_name`.
# Run from anywhere; exits 1 and lists the problems if there are any.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
spec="$root/docs/spec.md"
cd "$root"

id_re='(DEV|DRV)-[A-Z]+-[0-9]+'
fail=0
problem() {
  printf 'check-conformance: %s\n' "$*" >&2
  fail=1
}

# (Here-strings rather than "printf | grep -q": with pipefail, grep -q
# leaving early can fail the printf with SIGPIPE.)
# Table rows: lines that start with "| DEV-" or "| DRV-".
rows=$(grep -E "^\| $id_re \|" "$spec" || true)
[ -n "$rows" ] || problem "no conformance table rows found in $spec"
row_ids=$(printf '%s\n' "$rows" | sed -E 's/^\| ([A-Z]+-[A-Z]+-[0-9]+) \|.*/\1/')
# Identifiers used in the text: "[ID]" outside the table rows.
text_ids=$(grep -vE "^\| $id_re \|" "$spec" | grep -oE "\[$id_re\]" | tr -d '[]' | sort -u)

dups=$(printf '%s\n' "$row_ids" | sort | uniq -d)
for id in $dups; do problem "$id has more than one row in the table"; done
for id in $text_ids; do
  grep -qxF "$id" <<<"$row_ids" || problem "$id is in the text but has no row in the table"
done
for id in $row_ids; do
  grep -qxF "$id" <<<"$text_ids" || problem "$id has a row in the table but is not in the text"
done

# Named tests: `path::name` in the "Tests" column.
tests=$(printf '%s\n' "$rows" | grep -oE '`[A-Za-z0-9_./-]+\.rs::[A-Za-z0-9_]+`' | tr -d '`' | sort -u)
for t in $tests; do
  file=${t%%::*}
  name=${t##*::}
  if [ ! -f "$file" ]; then
    problem "$t: no file $file"
  elif ! grep -qE "fn $name\b" "$file"; then
    problem "$t: no fn $name in $file"
  fi
done

# A driver row that names no test does not claim the userspace driver is checked.
# Columns: | id | summary | side | tests | userspace driver | kernel driver |
while IFS="|" read -r _ id _ side tcol user kernel _; do
  [ "${side// /}" = driver ] || continue
  case "$user" in
    " checked"*) [[ "$tcol" == *"::"* ]] || problem "$id: the userspace driver column says checked but the row names no test" ;;
  esac
  case "$kernel" in
    " checked"*) [[ "$kernel" == *'::'* ]] || problem "$id: the kernel driver column says checked but names no test" ;;
  esac
done <<<"$rows"

n_rows=$(printf '%s\n' "$row_ids" | wc -l)
n_tests=$(printf '%s\n' "$tests" | grep -c . || true)
if [ "$fail" -ne 0 ]; then
  exit 1
fi
printf 'check-conformance: %d requirements, %d named tests, all present\n' "$n_rows" "$n_tests"
