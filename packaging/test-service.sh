#!/bin/bash
# Runs inside the Debian 12 root of packaging/test-debs.sh, after the
# packages are installed (test-in-root.sh calls it): the service of item 2.
#   1. systemd-analyze verify vhost-device-dmlc@group0.service (Debian's
#      systemd 252, the unit and binary as installed), and its hardening
#      scored by systemd-analyze security --offline (at most 2.0 of 10);
#   2. the daemon started as systemd would start it, without systemd (none
#      runs here): the unit's ExecStart= line with %i, %t and the variables
#      of /etc/vhost-device-dmlc/group0.conf (the shipped config, unchanged)
#      expanded as systemd does, run as the unit's User=/Group= with its
#      UMask=, RuntimeDirectory= and NoNewPrivileges=;
#   3. its sockets appear (mode 0660, group vhost-dmlc), its metrics answer at
#      the config's METRICS_ADDR, dmlc-ctl answers on its control socket;
#      and every metric the Grafana dashboard queries is among them;
#   4. SIGTERM (systemctl stop's signal) ends it with status 0.
# The root runs in its own network namespace, so the shipped 127.0.0.1:9100
# is free.

set -euo pipefail
say() { echo "test-service: $*" >&2; }
fail() {
    echo "test-service: FAIL: $*" >&2
    exit 1
}
instance=group0
unit=/lib/systemd/system/vhost-device-dmlc@.service
conf=/etc/vhost-device-dmlc/$instance.conf

say "systemd-analyze verify vhost-device-dmlc@$instance.service"
# It exits 0 on unknown or misspelt settings, only warning: any output fails.
verify=$(systemd-analyze verify "vhost-device-dmlc@$instance.service" 2>&1) ||
    fail "systemd-analyze verify: $verify"
[ -z "$verify" ] || fail "systemd-analyze verify warns: $verify"
# The hardening, scored by systemd (0 best, 10 worst; 1.5 when written):
# fails above 2.
systemd-analyze security --offline=true --threshold=20 "vhost-device-dmlc@$instance.service" \
    >/tmp/security.txt 2>&1 || {
    cat /tmp/security.txt >&2
    fail "systemd-analyze security: exposure above 2.0"
}
grep 'Overall exposure' /tmp/security.txt >&2

# The unit's settings (one line each, no continuation lines in this unit).
setting() { sed -n "s/^$1=//p" "$unit" | tail -n 1; }
exec_start=$(setting ExecStart)
user=$(setting User)
group=$(setting Group)
umask_=$(setting UMask)
runtime=$(setting RuntimeDirectory)
runtime_mode=$(setting RuntimeDirectoryMode)
[ "$(setting NoNewPrivileges)" = yes ] || fail "the unit lacks NoNewPrivileges=yes"
[ "$(setting EnvironmentFile)" = "/etc/vhost-device-dmlc/%i.conf" ] || fail "unexpected EnvironmentFile="

# systemd's specifiers: %i the instance, %t the runtime directory root (/run
# for the system manager), %% a percent sign.
spec() { sed -e "s/%i/$instance/g" -e "s|%t|/run|g" -e 's/%%/%/g' <<<"$1"; }
exec_start=$(spec "$exec_start")
runtime=/run/$(spec "$runtime")

# The EnvironmentFile: NAME=VALUE lines, comments and blank lines skipped.
declare -A env=()
while IFS= read -r line; do
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    [[ $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] || fail "bad line in $conf: $line"
    env[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
done <"$conf"
# Then ExecStart='s variables, as systemd expands them: ${NAME} is one
# word (the value as is), $NAME is split at white space (none when empty).
argv=()
read -ra words <<<"$exec_start"
for w in "${words[@]}"; do
    if [[ $w =~ ^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$ ]]; then
        argv+=("${env[${BASH_REMATCH[1]}]-}")
    elif [[ $w =~ ^\$([A-Za-z_][A-Za-z0-9_]*)$ ]]; then
        read -ra split <<<"${env[${BASH_REMATCH[1]}]-}"
        argv+=("${split[@]}")
    elif [[ $w == *'$'* ]]; then
        fail "this test cannot expand the word '$w' of ExecStart="
    else
        argv+=("$w")
    fi
done
say "ExecStart as expanded: ${argv[*]}"
[ "${argv[0]}" = /usr/bin/vhost-device-dmlc ] || fail "ExecStart runs ${argv[0]}"

# RuntimeDirectory=: made for the unit's user, with its mode.
mkdir -p "$runtime"
chown "$user:$group" "$runtime"
chmod "$runtime_mode" "$runtime"

log=/tmp/daemon.log
(
    umask "$umask_"
    exec setpriv --reuid="$user" --regid="$group" --init-groups --no-new-privs \
        --inh-caps=-all --bounding-set=-all "${argv[@]}"
) >"$log" 2>&1 &
pid=$!
stop() { kill "$pid" 2>/dev/null || true; }
trap stop EXIT

members=${env[MEMBERS]}
for _ in $(seq 100); do
    all=1
    for ((r = 0; r < members; r++)); do
        [ -S "$runtime/dmlc.sock$r" ] || all=0
    done
    [ -S "$runtime/control.sock" ] || all=0
    [ "$all" = 1 ] && break
    kill -0 "$pid" 2>/dev/null || {
        cat "$log" >&2
        fail "the daemon exited"
    }
    sleep 0.1
done
[ "$all" = 1 ] || {
    cat "$log" >&2
    fail "the sockets did not appear in $runtime"
}
ls -l "$runtime" >&2
for ((r = 0; r < members; r++)); do
    s=$runtime/dmlc.sock$r
    [ "$(stat -c '%a %U %G' "$s")" = "660 $user $group" ] ||
        fail "$s is $(stat -c '%a %U %G' "$s"), not 660 $user $group"
done

addr=${env[METRICS_ADDR]}
say "metrics at http://$addr/metrics"
exec 3<>"/dev/tcp/${addr%:*}/${addr##*:}" || fail "cannot connect to $addr"
printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n' "$addr" >&3
metrics=$(cat <&3)
exec 3<&-
grep -q '^HTTP/1.[01] 200' <<<"$metrics" || fail "metrics: $(head -n 1 <<<"$metrics")"
grep -qx 'dmlc_members_connected 0' <<<"$metrics" || fail "no dmlc_members_connected 0 in the metrics"
grep -q '^dmlc_collectives_total{opcode="allreduce"} 0' <<<"$metrics" || fail "no dmlc_collectives_total"

# Every metric the Grafana dashboard queries is one the daemon exports.
dashboard=/usr/share/vhost-device-dmlc/grafana/vhost-device-dmlc.json
[ -f "$dashboard" ] || fail "no $dashboard"
n=0
while read -r m; do
    grep -q "^# TYPE $m " <<<"$metrics" || fail "the dashboard queries $m, which the daemon does not export"
    n=$((n + 1))
done < <(grep -oE 'dmlc_[a-z_]+' "$dashboard" | sed -E 's/_(bucket|sum|count)$//' | sort -u)
[ "$n" -gt 10 ] || fail "only $n metrics found in $dashboard"
say "the dashboard's $n metrics are all exported"

say "dmlc-ctl state"
state=$(dmlc-ctl --socket "$runtime/control.sock" state) || fail "dmlc-ctl state"
echo "$state" | head -c 300 >&2
echo >&2
grep -q "\"group_id\": \"${env[GROUP_ID]}\"" <<<"$state" || fail "the state names another group id than ${env[GROUP_ID]}"

say "SIGTERM (systemctl stop)"
kill -TERM "$pid"
for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$pid" 2>/dev/null; then
    fail "the daemon is still running 10 s after SIGTERM"
fi
trap - EXIT
rc=0
wait "$pid" || rc=$?
[ "$rc" = 0 ] || {
    cat "$log" >&2
    fail "the daemon exited with status $rc after SIGTERM"
}
rm -rf "$runtime"
say "passed"
