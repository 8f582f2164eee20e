#!/usr/bin/env bash
# Run from cron every minute, one line per workflow file: stream what is new,
# retry later on exit 75, alert a person on any other failure.
#
#   * * * * * /opt/cdc/cron.sh /opt/cdc/workflows/orders.toml
#
# Exit codes (README, "Exit codes"): 0 with "call_again": true calls again at
# once (at most MSSQL_CDC_MAX_CALLS calls a run; the next minute goes on);
# 75 (temporary, or a batch lost to another call) is no alert: the script
# exits 0 and the next minute retries. 2 (bad input or configuration), 3
# (needs a person: data loss) and anything else (1 is a bug) are alerts: one
# line on stderr, which cron mails to MAILTO, and to syslog through logger;
# the script exits with that code. The step's log (stderr) is appended to
# MSSQL_CDC_LOGFILE, and so is the JSON of a call that exits 75.
#
# Overlaps (README, "Running steps at the same time"): two stream calls at
# once are safe. Bronze's txn decides each batch; the loser exits 75 having
# written nothing for it, and the next call reads on from the winner's batch
# (tests/batch_race.rs, tests/torture.rs). The flock only saves the loser's
# wasted read: a run that finds the lock taken exits 0, and the next minute
# streams. The lock is per workflow file (its full path). backfill_cron.sh,
# apply and reconcile may run beside this script. A run killed mid-call is a
# crash: the next run repairs it (tests/crash_drill.rs). A full bootstrap
# snapshot (snapshot.mode = "full") is read by the first run, under this
# lock: the stream cannot start before it completes anyway.
#
#   MSSQL_CDC_BIN        the binary (default: mssql-cdc on PATH)
#   MSSQL_CDC_LOGFILE    where the steps' logs go (default /var/log/mssql-cdc.log)
#   MSSQL_CDC_LOCK_DIR   where the lock files go (default /tmp)
#   MSSQL_CDC_MAX_CALLS  stream calls a run makes while call_again (default 100)
set -u
WF=${1:?usage: cron.sh WORKFLOW.toml}
BIN=${MSSQL_CDC_BIN:-mssql-cdc}
LOG=${MSSQL_CDC_LOGFILE:-/var/log/mssql-cdc.log}
MAX_CALLS=${MSSQL_CDC_MAX_CALLS:-100}

alert() {
  echo "mssql-cdc: $*" >&2
  logger -t mssql-cdc -- "$*" 2>/dev/null || true
}

# One lock per workflow file: its name and a hash of its full path.
wf_abs=$(realpath -m -- "$WF")
lock="${MSSQL_CDC_LOCK_DIR:-/tmp}/mssql-cdc.stream.$(basename "$WF").$(printf '%s' "$wf_abs" | cksum | cut -d' ' -f1).lock"
exec 9>"$lock" || { alert "cannot open the lock file $lock"; exit 1; }
flock -n 9 || exit 0
if ! { : >>"$LOG"; } 2>/dev/null; then
  alert "cannot write the log file $LOG (set MSSQL_CDC_LOGFILE)"
  exit 2
fi

calls=0
while true; do
  code=0
  out=$("$BIN" --workflow "$WF" stream 2>>"$LOG") || code=$?
  calls=$((calls + 1))
  last=$(printf '%s\n' "$out" | tail -n 1)
  case $code in
    0)
      # caught up: done until the next minute
      printf '%s' "$last" | grep -Eq '"call_again": *true' || exit 0
      ((calls < MAX_CALLS)) || exit 0 ;;
    75)   # temporary, or lost a batch to another call: the next minute retries
      echo "$(date -u +%FT%TZ) stream $WF exit 75: $last" >>"$LOG"
      exit 0 ;;
    *)
      alert "stream of $WF needs attention (exit $code): $last"
      exit "$code" ;;
  esac
done
