#!/usr/bin/env bash
# A long torture soak, beyond the 1,000 schedules `cargo test` runs: chunks of
# schedules run one after the other at the lowest CPU priority, one JSON line
# per chunk appended to a file, so a soak can be stopped, read and resumed.
#
#   tests/soak/soak.sh run BIN FIRST_SEED END_SEED OUT.jsonl [EVENTS]
#   tests/soak/soak.sh summary OUT.jsonl [OUT2.jsonl ...]
#
# `run` takes seeds FIRST_SEED..END_SEED-1 in chunks of 50 (`torture --seed S
# --schedules 50`, 12 events per schedule as CI draws them unless EVENTS says
# otherwise). It resumes after the last chunk OUT.jsonl already holds. A chunk
# with a failure keeps its folder (OUT.jsonl's `dir`) and the JSON names the
# failing seed and its replay command; the soak goes on with the next chunk.
# Two lanes on two cores: two `run`s over disjoint seed ranges, two files.
#
# `summary` adds the files up: schedules, failures, failing seeds, the
# binaries they ran (a count is only worth something on one binary).
set -euo pipefail

chunk_schedules=50

case "${1:-}" in
run)
  bin=$(realpath "$2"); first=$3; end=$4; out=$5; events=${6:-12}
  [ -x "$bin" ] || { echo "soak: $bin is not an executable" >&2; exit 2; }
  bin_sha=$(sha256sum "$bin" | cut -c1-16)
  start=$first
  if [ -s "$out" ]; then
    last=$(python3 -c 'import json,sys; print(max(json.loads(l)["first_seed"] for l in open(sys.argv[1]) if l.strip()))' "$out")
    start=$((last + chunk_schedules))
  fi
  workdir=$(dirname "$(realpath -m "$out")")
  for ((seed = start; seed < end; seed += chunk_schedules)); do
    dir=$(mktemp -d "$workdir/soak.$seed.XXXX")
    t0=$(date +%s)
    set +e
    last_line=$(nice -n 19 "$bin" torture --seed "$seed" --schedules "$chunk_schedules" \
      --events "$events" --dir "$dir" 2>"$dir/stderr.log" | tail -n 1)
    rc=$?
    set -e
    secs=$(( $(date +%s) - t0 ))
    # rc 1 means a schedule failed (the JSON says which); anything else but 0
    # is the tester itself failing, and the chunk's stderr is kept to read.
    [ -n "$last_line" ] || last_line=null
    printf '{"first_seed":%s,"schedules_asked":%s,"events":%s,"rc":%s,"secs":%s,"bin_sha256":"%s","dir":"%s","result":%s}\n' \
      "$seed" "$chunk_schedules" "$events" "$rc" "$secs" "$bin_sha" "$dir" "$last_line" >> "$out"
    if [ "$rc" -eq 0 ]; then rm -rf "$dir"; fi
  done
  ;;
summary)
  shift
  python3 - "$@" <<'EOF'
import json, sys
schedules = failures = chunks = secs = 0
failing, broken, bins = [], [], set()
for path in sys.argv[1:]:
    for line in open(path):
        if not line.strip():
            continue
        d = json.loads(line)
        chunks += 1
        secs += d.get("secs", 0)
        bins.add(d.get("bin_sha256"))
        r = d.get("result") or {}
        if not r and d["rc"] != 0:
            broken.append(d)
            continue
        schedules += r.get("schedules", 0)
        failures += r.get("failures", 0)
        for f in r.get("failed") or []:
            failing.append(dict(f, dir=d["dir"]))
print(json.dumps({"chunks": chunks, "schedules": schedules, "failures": failures,
                  "chunk_seconds": secs, "binaries": sorted(b for b in bins if b),
                  "failing": failing, "tester_errors": broken}))
EOF
  ;;
*)
  sed -n '2,17p' "$0" >&2
  exit 2
  ;;
esac
