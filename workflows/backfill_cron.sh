#!/usr/bin/env bash
# A chunked snapshot's backfill, next to cron.sh's stream: its own cron line
# and its own lock, so the two run side by side, as they must (the stream
# reads every change after S while backfill reads the table; the two share
# no txn). Hourly, with the default budget:
#
#   0 * * * * /opt/cdc/backfill_cron.sh /opt/cdc/workflows/orders.toml
#
# Each call reads waves for at most --max-seconds (MSSQL_CDC_BACKFILL_SECONDS,
# default 3300), plus at most one wave and one commit; done: true ends the
# snapshot, and later calls answer done at once. Exit 75 is a pause
# (headroom below MSSQL_CDC_MIN_HEADROOM_HOURS, or a wave past a newer
# capture instance the stream has not reached yet), a temporary
# failure, or a wave another call committed first: no alert, the script
# exits 0 and the next run continues. 2 (bad input or configuration), 3
# (needs a person) and anything else (1 is a bug) are alerts: one line on
# stderr, which cron mails to MAILTO, and to syslog through logger; the
# script exits with that code. Each call's JSON (chunks done, paused and
# why) is appended to MSSQL_CDC_LOGFILE after its log.
#
# Overlaps (README, "Running steps at the same time"): two backfill calls at
# once are safe. One plan is recorded and both read by it; bronze's txn
# decides each wave and the loser exits 75 having committed nothing it read
# (tests/records_race.rs, tests/batch_race.rs). The flock only saves that
# wasted read. Do not share cron.sh's lock: the stream would wait for waves.
#
#   MSSQL_CDC_BIN, MSSQL_CDC_LOGFILE, MSSQL_CDC_LOCK_DIR: as in cron.sh
#   MSSQL_CDC_BACKFILL_SECONDS    --max-seconds (default 3300, for an hourly line)
#   MSSQL_CDC_MIN_HEADROOM_HOURS  --min-headroom-hours (default 12; set it
#       empty to leave it to the workflow's snapshot.min_headroom_hours).
#       Headroom is how much older the stream's position is than the
#       oldest change CDC still holds, so it grows from 0 when CDC is
#       enabled: on a capture instance younger than this many hours every
#       call pauses (exit 75, no alert) until it is that old.
set -u
WF=${1:?usage: backfill_cron.sh WORKFLOW.toml}
BIN=${MSSQL_CDC_BIN:-mssql-cdc}
LOG=${MSSQL_CDC_LOGFILE:-/var/log/mssql-cdc.log}

alert() {
  echo "mssql-cdc: $*" >&2
  logger -t mssql-cdc -- "$*" 2>/dev/null || true
}

wf_abs=$(realpath -m -- "$WF")
lock="${MSSQL_CDC_LOCK_DIR:-/tmp}/mssql-cdc.backfill.$(basename "$WF").$(printf '%s' "$wf_abs" | cksum | cut -d' ' -f1).lock"
exec 9>"$lock" || { alert "cannot open the lock file $lock"; exit 1; }
flock -n 9 || exit 0
if ! { : >>"$LOG"; } 2>/dev/null; then
  alert "cannot write the log file $LOG (set MSSQL_CDC_LOGFILE)"
  exit 2
fi

headroom=()
if [[ -n ${MSSQL_CDC_MIN_HEADROOM_HOURS-12} ]]; then
  headroom=(--min-headroom-hours "${MSSQL_CDC_MIN_HEADROOM_HOURS-12}")
fi
code=0
out=$("$BIN" --workflow "$WF" backfill --max-seconds "${MSSQL_CDC_BACKFILL_SECONDS:-3300}" "${headroom[@]}" 2>>"$LOG") || code=$?
last=$(printf '%s\n' "$out" | tail -n 1)
echo "$(date -u +%FT%TZ) backfill $WF exit $code: $last" >>"$LOG"
case $code in
  0 | 75) exit 0 ;;   # progress (or done), or paused / lost a wave: the next run continues
  *)
    alert "backfill of $WF needs attention (exit $code): $last"
    exit "$code" ;;
esac
