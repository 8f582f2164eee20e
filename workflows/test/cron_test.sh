#!/usr/bin/env bash
# Runs workflows/cron.sh and workflows/backfill_cron.sh under bash against
# the simulator, as cron would (one run after another, a writer between
# them), and checks their exit-code handling: 0 and 75 are no alert and exit
# 0; 2 and 3 alert (a line on stderr and one to logger) and exit with that
# code; a taken lock skips the run; call_again is followed; two workflow
# files with one name in two folders get two locks. A stub `logger` on PATH
# records the alerts. Needs no venv. .ci/run calls it after the Rust tests.
#
#   usage: workflows/test/cron_test.sh
#   MSSQL_CDC_BIN  the binary (default: mssql-cdc on PATH)
#   KEEP=1         keep the temp dir
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CRON=$HERE/../cron.sh
BACKFILL=$HERE/../backfill_cron.sh
MAINTAIN=$HERE/../maintain_cron.sh
# shellcheck source=venv.sh
source "$HERE/venv.sh"
find_bin cron_test || exit 2
TMP=$(mktemp -d "${TMPDIR:-/tmp}/mssql-cdc-cron.XXXXXX")
cleanup() { if [[ ${KEEP:-0} == 1 ]]; then echo "kept $TMP" >&2; else rm -rf "$TMP"; fi; }
trap cleanup EXIT
T0=$SECONDS

export MSSQL_CDC_BIN=$BIN MSSQL_CDC_LOG=warn
export MSSQL_CDC_LOGFILE=$TMP/mssql-cdc.log
export MSSQL_CDC_LOCK_DIR=$TMP/locks
export MSSQL_CDC_BACKFILL_SECONDS=1
mkdir -p "$TMP/stub" "$TMP/locks" "$TMP/a" "$TMP/b"
# logger stub: one line per alert, its arguments.
cat >"$TMP/stub/logger" <<EOF
#!/usr/bin/env bash
echo "\$*" >>"$TMP/alerts"
EOF
chmod +x "$TMP/stub/logger"
export PATH=$TMP/stub:$PATH
: >"$TMP/alerts"

passed=0
failed=0
check() { # check WHAT COMMAND...: one line, ok or FAIL
  local what=$1
  shift
  if "$@"; then
    passed=$((passed + 1))
    echo "ok   $what"
  else
    failed=$((failed + 1))
    echo "FAIL $what"
  fi
}
# run SCRIPT WF: runs it; $code, $err (its stderr), $new_alerts (alerts it added).
run() {
  local before
  before=$(wc -l <"$TMP/alerts")
  code=0
  err=$(bash "$1" "$2" 2>&1 >/dev/null) || code=$?
  new_alerts=$(tail -n +"$((before + 1))" "$TMP/alerts")
}
json() { # json FIELD: a top-level field of the JSON on stdin
  python3 -c 'import json, sys; v = json.loads(sys.stdin.read().strip().splitlines()[-1]).get(sys.argv[1]); print(json.dumps(v) if isinstance(v, (dict, list)) else v)' "$1"
}
cdc() { "$BIN" "$@" 2>/dev/null; }
step() { local wf=$1; shift; cdc --workflow "$wf" "$@"; }

# workflow NAME DIR MODE EXTRA: a simulated table (its own sqlite file) and its workflow file.
workflow() {
  local name=$1 dir=$2 mode=$3 extra=${4:-}
  cdc sim create --db "$dir/$name.sqlite" --table "dbo.$name" --preset orders --rows 3000 --rows-per-s 1000 >/dev/null
  cdc sim write --db "$dir/$name.sqlite" --tx-per-s 0 --transactions 20 >/dev/null
  cdc sim capture --db "$dir/$name.sqlite" >/dev/null
  cat >"$dir/$name.toml" <<EOF
app_id = "$name"
[source]
url = "sim://$dir/$name.sqlite"
[table]
name = "$name"
[target]
bronze = "$dir/lake/$name/bronze"
facts = "$dir/lake/$name/facts"
silver = "$dir/lake/$name/silver"
[snapshot]
bootstrap = true
mode = "$mode"
parallelism = 2
chunk_rows = 200
target_wave_seconds = 0
$extra
EOF
}
writes() { cdc sim write --db "$1" --tx-per-s 0 --transactions "$2" --ops-per-tx 1 >/dev/null; cdc sim capture --db "$1" >/dev/null; }

# 1. A chunked bootstrap: cron.sh's first run opens it, backfill_cron.sh
#    runs read it in bounded calls beside cron.sh's runs, with changes between.
workflow orders "$TMP/a" chunked
WF=$TMP/a/orders.toml
run "$CRON" "$WF"
check "cron.sh: the first run exits 0 and alerts nothing" test "$code" = 0 -a -z "$new_alerts"
check "cron.sh: the first run opened the chunked snapshot" test "$(step "$WF" status | json open_snapshots)" != "[]"
# With the default --min-headroom-hours 12 a capture instance minutes old
# has too little headroom: the call pauses (exit 75), which is no alert.
# (A dropped connection during a chunk read is retried by backfill itself,
# so the pause is the exit 75 a backfill run meets here.)
run "$BACKFILL" "$WF"
check "backfill_cron.sh: a headroom pause (exit 75) is no alert and exits 0" test "$code" = 0 -a -z "$new_alerts"
check "backfill_cron.sh: the paused run logged why" grep -q "paused" "$MSSQL_CDC_LOGFILE"
export MSSQL_CDC_MIN_HEADROOM_HOURS=   # from here on: no headroom floor
runs=0
while [[ $(step "$WF" status | json open_snapshots) != "[]" ]] && ((runs < 40)); do
  run "$BACKFILL" "$WF"
  [[ $code == 0 && -z $new_alerts ]] || break
  writes "$TMP/a/orders.sqlite" 3
  run "$CRON" "$WF"
  [[ $code == 0 && -z $new_alerts ]] || break
  runs=$((runs + 1))
done
check "backfill_cron.sh: $runs bounded runs (and cron.sh runs between) complete the snapshot, all exit 0, no alert" \
  test "$(step "$WF" status | json open_snapshots)" = "[]" -a "$code" = 0 -a "$runs" -ge 2
run "$BACKFILL" "$WF"
check "backfill_cron.sh: once done, a run exits 0 (done at once)" test "$code" = 0 -a -z "$new_alerts"

# 2. Exit 75: a dropped connection. No alert, exit 0; the next run goes on.
writes "$TMP/a/orders.sqlite" 5
cdc sim fault --db "$TMP/a/orders.sqlite" --on any --times 1 >/dev/null
run "$CRON" "$WF"
check "cron.sh: exit 75 (a source fault) is no alert and exits 0" test "$code" = 0 -a -z "$new_alerts"
check "cron.sh: the exit-75 call's error is in MSSQL_CDC_LOGFILE" grep -q "simulated fault" "$MSSQL_CDC_LOGFILE"
run "$CRON" "$WF"
check "cron.sh: the next run streams again (exit 0, caught up)" test "$code" = 0 -a "$(step "$WF" stream | json batches)" = 0

# 3. call_again: one batch of five rows a call; a run calls until caught up.
workflow busy "$TMP/a" full $'[stream]\nmax_batch_rows = 5\nmax_batches = 1'
run "$CRON" "$TMP/a/busy.toml"
writes "$TMP/a/busy.sqlite" 23
run "$CRON" "$TMP/a/busy.toml"
check "cron.sh: follows call_again until caught up in one run" test "$code" = 0 -a "$(step "$TMP/a/busy.toml" stream | json batches)" = 0
writes "$TMP/a/busy.sqlite" 23
MSSQL_CDC_MAX_CALLS=2 run "$CRON" "$TMP/a/busy.toml"
check "cron.sh: stops after MSSQL_CDC_MAX_CALLS calls, exit 0 (the next minute goes on)" \
  test "$code" = 0 -a "$(step "$TMP/a/busy.toml" stream --max-batches 1 | json call_again)" = True

# 4. A taken lock: the run exits 0 at once and calls nothing.
writes "$TMP/a/orders.sqlite" 3
lock=$(ls "$MSSQL_CDC_LOCK_DIR"/mssql-cdc.stream.orders.toml.*.lock)
size=$(stat -c %s "$MSSQL_CDC_LOGFILE")
exec 8>"$lock"
flock -n 8
MSSQL_CDC_LOG=info run "$CRON" "$WF"
check "cron.sh: a run that finds the lock taken exits 0 and calls nothing" test "$code" = 0 -a "$(stat -c %s "$MSSQL_CDC_LOGFILE")" = "$size"
exec 8>&-

# 5. One file name in two folders: two locks, neither run skips the other.
workflow orders "$TMP/b" full
run "$CRON" "$TMP/b/orders.toml"
check "cron.sh: orders.toml in two folders has two lock files" test "$(ls "$MSSQL_CDC_LOCK_DIR"/mssql-cdc.stream.orders.toml.*.lock | wc -l)" = 2

# 6. Exit 2: a bad workflow file. An alert naming it, exit 2, both scripts.
sed 's/mode = "chunked"/mode = "chunkd"/' "$WF" >"$TMP/a/bad.toml"
run "$CRON" "$TMP/a/bad.toml"
check "cron.sh: exit 2 alerts (stderr and logger) and exits 2" \
  test "$code" = 2 -a -n "$new_alerts" -a -n "$err"
check "cron.sh: the alert names the file, the exit code and the error" \
  grep -q "bad.toml needs attention (exit 2).*chunkd" <<<"$new_alerts"
run "$BACKFILL" "$TMP/a/bad.toml"
check "backfill_cron.sh: exit 2 alerts and exits 2" test "$code" = 2 -a -n "$new_alerts"

# 7. Exit 3: changes purged before the stream read them (on_data_loss = "fail").
workflow lossy "$TMP/a" full $'[stream]\non_data_loss = "fail"'
run "$CRON" "$TMP/a/lossy.toml"
writes "$TMP/a/lossy.sqlite" 10
cdc sim cleanup --db "$TMP/a/lossy.sqlite" --to-lsn "$(cdc sim status --db "$TMP/a/lossy.sqlite" | json max_lsn)" >/dev/null
run "$CRON" "$TMP/a/lossy.toml"
check "cron.sh: exit 3 (data loss) alerts and exits 3" test "$code" = 3 -a -n "$new_alerts"
grep -q "exit 3" <<<"$new_alerts"
check "cron.sh: the exit-3 alert says exit 3" test $? = 0

# 8. An unwritable log file is named, not a bare exit 1.
MSSQL_CDC_LOGFILE=$TMP/no/such/dir/x.log run "$CRON" "$WF"
check "cron.sh: an unwritable MSSQL_CDC_LOGFILE alerts naming it, exit 2" grep -q "cannot write the log file" <<<"$err"

# 9. maintain_cron.sh: the daily upkeep compacts facts (one commit with the
#    compaction's txn in its log), exits 0 and alerts nothing; a bad file
#    alerts and exits 2; a taken lock skips. Step 10's reconcile then checks
#    that the compacted tables still drive the stream and silver.
facts_files() { find "$TMP/a/lake/orders/facts" -maxdepth 1 -name '*.parquet' | wc -l; }
files_before=$(facts_files)
run "$MAINTAIN" "$WF"
check "maintain_cron.sh: exits 0 and alerts nothing" test "$code" = 0 -a -z "$new_alerts"
check "maintain_cron.sh: facts' $files_before files were compacted (the compaction txn is in facts' log)" \
  grep -qs '"appId":"mssql-cdc.maintain.compact"' "$TMP"/a/lake/orders/facts/_delta_log/*.json
check "maintain_cron.sh: the call's JSON is in MSSQL_CDC_LOGFILE" grep -q "maintain $WF exit 0: {" "$MSSQL_CDC_LOGFILE"
MSSQL_CDC_VACUUM_RETENTION_HOURS=12 run "$MAINTAIN" "$WF"
check "maintain_cron.sh: a retention under a day alerts naming the flag and exits 2" \
  test "$code" = 2 -a -n "$new_alerts" -a -n "$(grep -- "--vacuum-retention-hours" <<<"$new_alerts")"
run "$MAINTAIN" "$TMP/a/bad.toml"
check "maintain_cron.sh: a bad workflow file alerts and exits 2" test "$code" = 2 -a -n "$new_alerts"
lock=$(ls "$MSSQL_CDC_LOCK_DIR"/mssql-cdc.maintain.orders.toml.*.lock | head -n 1)
size=$(stat -c %s "$MSSQL_CDC_LOGFILE")
exec 8>"$lock"
flock -n 8
run "$MAINTAIN" "$WF"
check "maintain_cron.sh: a run that finds the lock taken exits 0 and calls nothing" test "$code" = 0 -a "$(stat -c %s "$MSSQL_CDC_LOGFILE")" = "$size"
exec 8>&-

# 10. What the runs left: applied and reconciled by the binary, exit 0.
for wf in "$WF" "$TMP/b/orders.toml" "$TMP/a/busy.toml"; do
  step "$wf" stream >/dev/null
  step "$wf" apply >/dev/null
  rc=0
  out=$(step "$wf" reconcile) || rc=$?
  check "reconcile of $(basename "$(dirname "$wf")")/$(basename "$wf") after the cron runs: exit 0, clean" \
    test "$rc" = 0 -a "$(json clean <<<"$out")" = True
done

echo
echo "cron: $passed passed, $failed failed"
echo "cron_test: ${SECONDS}s"
((failed == 0))
