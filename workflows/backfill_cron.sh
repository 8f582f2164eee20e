#!/usr/bin/env bash
# A chunked snapshot's backfill, next to cron.sh's stream: its own cron line
# and its own lock, so the two run side by side, as they must (the stream
# reads every change after S while backfill reads the table; the two share
# no txn). Each call reads waves for at most --max-seconds, plus at most one
# wave and one commit; done: true ends the snapshot. Exit 75 is a pause
# (headroom, or a wave past a newer capture instance the stream has not
# reached yet), a temporary failure, or a wave another call committed first;
# the next run continues.
#
# Overlaps (README, "Running steps at the same time"): two backfill calls at
# once are safe. One plan is recorded and both read by it; bronze's txn
# decides each wave and the loser exits 75 having committed nothing it read
# (tests/records_race.rs, tests/batch_race.rs). The flock only saves that
# wasted read. Do not share cron.sh's lock: the stream would wait for waves.
set -u
WF=${1:?usage: backfill_cron.sh WORKFLOW.toml}
exec 9>"/tmp/mssql-cdc-backfill.$(basename "$WF").lock"
flock -n 9 || exit 0
out=$(mssql-cdc --workflow "$WF" backfill --max-seconds 3300 --min-headroom-hours 12 2>>/var/log/mssql-cdc.log); code=$?
last=$(printf '%s\n' "$out" | tail -n 1)
case $code in
  0|75) exit 0 ;;   # progress (or done), or paused / lost a wave: the next run continues
  *) echo "mssql-cdc backfill needs attention (exit $code): $last" | logger -t mssql-cdc; exit "$code" ;;
esac
