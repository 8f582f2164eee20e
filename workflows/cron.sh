#!/usr/bin/env bash
# Run from cron every minute: stream what is new, retry later on exit 75,
# alert a person on exit 2 or 3. The step is idempotent: overlapping or
# repeated runs are safe (a lock avoids wasted work, not corruption).
set -u
WF=${1:?usage: cron.sh WORKFLOW.toml}
exec 9>"/tmp/mssql-cdc.$(basename "$WF").lock"
flock -n 9 || exit 0
while true; do
  out=$(mssql-cdc --workflow "$WF" stream 2>>/var/log/mssql-cdc.log); code=$?
  last=$(printf '%s\n' "$out" | tail -n 1)
  case $code in
    0) printf '%s' "$last" | grep -q '"call_again":true' || exit 0 ;;  # caught up: done until next minute
    75) exit 0 ;;                                                      # temporary: next minute retries
    *) echo "mssql-cdc needs attention (exit $code): $last" | logger -t mssql-cdc; exit "$code" ;;
  esac
done
