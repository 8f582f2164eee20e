#!/usr/bin/env bash
# A chunked snapshot's backfill, next to cron.sh's stream (its own cron line,
# its own lock: the two run side by side). Each call reads waves for at most
# --max-seconds; done: true ends the snapshot, exit 75 is a headroom pause.
set -u
WF=${1:?usage: backfill_cron.sh WORKFLOW.toml}
exec 9>"/tmp/mssql-cdc-backfill.$(basename "$WF").lock"
flock -n 9 || exit 0
out=$(mssql-cdc --workflow "$WF" backfill --max-seconds 3300 --min-headroom-hours 12 2>>/var/log/mssql-cdc.log); code=$?
last=$(printf '%s\n' "$out" | tail -n 1)
case $code in
  0|75) exit 0 ;;   # progress (or done), or paused: the next run continues
  *) echo "mssql-cdc backfill needs attention (exit $code): $last" | logger -t mssql-cdc; exit "$code" ;;
esac
