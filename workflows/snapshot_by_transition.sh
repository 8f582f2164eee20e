#!/usr/bin/env bash
# Drives a chunked snapshot transition by transition (docs/ARCHITECTURE.md,
# "The step state machine"): open -> plan -> wave, wave, ... -> complete,
# each a `mssql-cdc step NAME` call, the name read from what the machine says
# is next (`status`'s machine.next, then each step's own next.stream and
# next.backfill). Each call makes one transition's commits: the last wave
# leaves every chunk read and the machine then names `complete`. An orchestrator
# runs it as one task on a schedule of its own, apart from the stream's
# (cron.sh, the DAG's stream task): an Airflow
# BashOperator (bash_command="snapshot_by_transition.sh /opt/cdc/orders.toml ",
# the trailing space keeps Jinja from reading the .sh as a template), a
# Databricks job task, or a cron line. Each run goes as far as its budget and
# exits 0; the state lives in the Delta tables, so the next run goes on from
# there, and once the snapshot is complete a run finds both lanes idle.
#
#   usage: snapshot_by_transition.sh WORKFLOW.toml [MSSQL_CDC_BINARY]
#   SNAPSHOT_MAX_WAVES      waves per run (default 50)
#   SNAPSHOT_MAX_SECONDS    no transition starts after this (default 3000; a wave may overrun it)
#   SNAPSHOT_RETRIES        exit-75 calls in a row before this run gives up with 75 (default 5)
#   SNAPSHOT_RETRY_SECONDS  the wait before reading the state again after an exit 75 (default 30)
#   SNAPSHOT_JSON_TOOL      jq or python3 (default: jq when installed, else python3)
#
# Exit codes (README, "Exit codes"): 75 means call again later, so the state is
# read again after a pause and the call made again if the machine still names
# it (a call cut after a commit, or beaten to a wave by another call, leaves
# the state moved on; a name the machine no longer names would exit 2). 2 (bad
# input), 3 (needs a person), 1 (a bug) and any other code stop the run with
# that code, naming the transition. Lines go to stderr, one per transition:
# "snapshot_by_transition: step NAME (LANE lane): BEFORE -> AFTER".
# Two runs at once, or this beside `backfill`, are safe (README, "Running steps
# at the same time"): each wave is decided by one commit, the loser exits 75.
set -euo pipefail

WF=${1:?usage: snapshot_by_transition.sh WORKFLOW.toml [MSSQL_CDC_BINARY]}
BIN=${2:-mssql-cdc}
MAX_WAVES=${SNAPSHOT_MAX_WAVES:-50}
MAX_SECONDS=${SNAPSHOT_MAX_SECONDS:-3000}
RETRIES=${SNAPSHOT_RETRIES:-5}
RETRY_SECONDS=${SNAPSHOT_RETRY_SECONDS:-30}
JSON_TOOL=${SNAPSHOT_JSON_TOOL:-$(command -v jq >/dev/null 2>&1 && echo jq || echo python3)}

log() { echo "snapshot_by_transition: $*" >&2; }
if ! command -v "$BIN" >/dev/null 2>&1; then
  log "no mssql-cdc binary at '$BIN' (pass its path as the second argument)"
  exit 2
fi

# get JSON PATH: one field of a JSON object (PATH as in next.stream.transition), empty when absent.
get() {
  if [[ $JSON_TOOL == jq ]]; then
    printf '%s' "$1" | jq -r ".$2 // empty" 2>/dev/null || true
  else
    python3 -c 'import json, sys
v = json.loads(sys.argv[1])
for k in sys.argv[2].split("."):
    v = v.get(k) if isinstance(v, dict) else None
print("" if v is None else v)' "$1" "$2" 2>/dev/null || true
  fi
}

# attempt WHAT ARGS...: one mssql-cdc call; $out is its last stdout line (JSON).
# Returns 0 on exit 0; 1 after an exit 75 and the pause; exits on anything else.
# tempfails counts the exits 75 since the last step that ran.
tempfails=0
attempt() {
  local what=$1 code=0
  shift
  out=$("$BIN" --workflow "$WF" "$@") || code=$?
  out=$(printf '%s\n' "$out" | tail -n 1)
  case $code in
    0) return 0 ;;
    75)
      tempfails=$((tempfails + 1))
      if ((tempfails > RETRIES)); then
        log "$what: exit 75 on $tempfails calls in a row; the next run goes on: $(get "$out" error)"
        exit 75
      fi
      log "$what: exit 75 (call again later), retry $tempfails of $RETRIES after ${RETRY_SECONDS}s: $(get "$out" error)"
      sleep "$RETRY_SECONDS"
      return 1 ;;
    *)
      log "$what: exit $code, stopping: $(get "$out" error)"
      exit "$code" ;;
  esac
}

# take_next PREFIX: both lanes' next transitions and the state from $out
# (PREFIX "machine." for status, empty for a step, whose state is after.state).
take_next() {
  stream_next=$(get "$out" "${1}next.stream.transition")
  backfill_next=$(get "$out" "${1}next.backfill.transition")
  state=$(get "$out" "${1:-after.}state")
  if [[ -z $stream_next || -z $backfill_next ]]; then
    log "no next transitions in: $out"
    exit 1
  fi
}

read_status() {
  until attempt status status; do :; done
  take_next machine.
}

# transition NAME: runs `step NAME`; 0 when it ran, 1 after an exit 75 (state read again).
transition() {
  if attempt "step $1" step "$1"; then
    tempfails=0
    log "step $1 ($(get "$out" lane) lane): $(get "$out" before.state) -> $(get "$out" after.state)"
    take_next ""
    return 0
  fi
  read_status
  return 1
}

read_status
log "state $state: the stream lane's next is '$stream_next', the snapshot lane's '$backfill_next'"
waves=0
while :; do
  if ((SECONDS >= MAX_SECONDS)); then
    log "the time budget of ${MAX_SECONDS}s is spent; the next run goes on"
    exit 0
  fi
  # The stream lane gets one micro-batch before each snapshot transition, so it
  # never waits for the snapshot: a chunked snapshot needs every change after
  # its S, and CDC cleanup purges changes once they are older than the capture
  # instance's retention (3 days by default) whether or not the stream has read
  # them. A stream held back past that is a data loss (a new snapshot under
  # on_data_loss = "resnapshot"). The stream's own job may commit too: one of
  # two calls for one batch wins, the other exits 75.
  if [[ $stream_next == commit ]]; then
    transition commit || continue
  fi
  case $backfill_next in
    wave)
      if ((waves >= MAX_WAVES)); then
        log "$waves waves this run (SNAPSHOT_MAX_WAVES); the next run goes on"
        exit 0
      fi
      if transition wave; then waves=$((waves + 1)); fi ;;
    # open, plan and complete are the snapshot lane's; the machine names repair
    # and resnapshot for both lanes, before anything else.
    open | plan | complete | repair | resnapshot)
      transition "$backfill_next" || true ;;
    *)
      if [[ $stream_next == commit ]]; then
        continue
      elif [[ $stream_next == idle ]]; then
        log "both lanes are idle (state $state)"
      else
        log "the snapshot lane is idle (state $state); the stream lane's '$stream_next' is the stream job's"
      fi
      exit 0 ;;
  esac
done
