#!/usr/bin/env bash
# Daily upkeep of one workflow's Delta tables, next to cron.sh and
# backfill_cron.sh: its own cron line and its own lock.
#
#   30 3 * * * /opt/cdc/maintain_cron.sh /opt/cdc/workflows/orders.toml
#
# `maintain` (README, "Table upkeep") compacts the small files of facts,
# plans, control and reconcile, vacuums files removed longer ago than the
# retention (VACUUM lite: only files the log names as removed), and writes a
# checkpoint of every table, so that a step's read of its state does not grow
# with its history. It changes no row and never compacts bronze or silver.
# Once a day is what the default retention (120 h, under the tables' week of
# deletedFileRetentionDuration) is sized for: a run may be missed for two days
# before a removed file outlives the log entry that names it.
#
# Overlaps (README, "Running steps at the same time"): every other step may
# run beside it. Two maintain calls at once are safe too: the compaction of a
# table carries its own txn, so one lands and the other finds nothing left to
# do (tests/maintain.rs). The flock only saves that repeated work.
#
# Exit 75 (temporary) is no alert: the script exits 0 and tomorrow's run
# goes on. 2 (bad input or configuration: nothing was written), 3 and
# anything else (1 is a bug) are alerts, as in cron.sh. The call's JSON
# (files before and after per table) is appended to MSSQL_CDC_LOGFILE.
#
#   MSSQL_CDC_BIN, MSSQL_CDC_LOGFILE, MSSQL_CDC_LOCK_DIR: as in cron.sh
#   MSSQL_CDC_VACUUM_RETENTION_HOURS  --vacuum-retention-hours (default:
#       the binary's, 120; at least 24 and under the tables' retention)
set -u
WF=${1:?usage: maintain_cron.sh WORKFLOW.toml}
BIN=${MSSQL_CDC_BIN:-mssql-cdc}
LOG=${MSSQL_CDC_LOGFILE:-/var/log/mssql-cdc.log}

alert() {
  echo "mssql-cdc: $*" >&2
  logger -t mssql-cdc -- "$*" 2>/dev/null || true
}

wf_abs=$(realpath -m -- "$WF")
lock="${MSSQL_CDC_LOCK_DIR:-/tmp}/mssql-cdc.maintain.$(basename "$WF").$(printf '%s' "$wf_abs" | cksum | cut -d' ' -f1).lock"
exec 9>"$lock" || { alert "cannot open the lock file $lock"; exit 1; }
flock -n 9 || exit 0
if ! { : >>"$LOG"; } 2>/dev/null; then
  alert "cannot write the log file $LOG (set MSSQL_CDC_LOGFILE)"
  exit 2
fi

retention=()
if [[ -n ${MSSQL_CDC_VACUUM_RETENTION_HOURS:-} ]]; then
  retention=(--vacuum-retention-hours "$MSSQL_CDC_VACUUM_RETENTION_HOURS")
fi
code=0
out=$("$BIN" --workflow "$WF" maintain "${retention[@]}" 2>>"$LOG") || code=$?
last=$(printf '%s\n' "$out" | tail -n 1)
echo "$(date -u +%FT%TZ) maintain $WF exit $code: $last" >>"$LOG"
case $code in
  0 | 75) exit 0 ;;
  *)
    alert "maintain of $WF needs attention (exit $code): $last"
    exit "$code" ;;
esac
