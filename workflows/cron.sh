#!/usr/bin/env bash
# Run from cron every minute: stream what is new, retry later on exit 75,
# alert a person on exit 2 or 3.
#
# Overlaps (README, "Running steps at the same time"): two stream calls at
# once are safe. Bronze's txn decides each batch; the loser exits 75 having
# written nothing for it, and the next call reads on from the winner's batch
# (tests/batch_race.rs, tests/torture.rs). The flock only saves the loser's
# wasted read: a run that finds the lock taken exits 0, and the next minute
# streams. The lock is per workflow file name. backfill_cron.sh, apply and
# reconcile may run beside this script. A run killed mid-call is a crash: the
# next run repairs it (tests/crash_drill.rs).
set -u
WF=${1:?usage: cron.sh WORKFLOW.toml}
exec 9>"/tmp/mssql-cdc.$(basename "$WF").lock"
flock -n 9 || exit 0
while true; do
  out=$(mssql-cdc --workflow "$WF" stream 2>>/var/log/mssql-cdc.log); code=$?
  last=$(printf '%s\n' "$out" | tail -n 1)
  case $code in
    0) printf '%s' "$last" | grep -q '"call_again":true' || exit 0 ;;  # caught up: done until next minute
    75) exit 0 ;;                                                      # temporary, or lost a batch to another call: next minute retries
    *) echo "mssql-cdc needs attention (exit $code): $last" | logger -t mssql-cdc; exit "$code" ;;
  esac
done
