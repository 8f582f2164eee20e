#!/usr/bin/env python3
"""Runs one mssql-cdc step for an orchestrator task (the Databricks jobs in
databricks_job.json run it as a spark_python_task; it needs no Spark, only
Python 3.11+ and the binary) and maps the exit code to what the task does.

    run_step.py [--binary PATH] [--calls N] [--retries N] [--retry-delay S]
                --workflow FILE.toml STEP [STEP ARGS...]

STEP is an mssql-cdc step (stream, backfill, apply, reconcile, maintain,
status, snapshot, ...) with its own arguments after it (`backfill --max-seconds 600`).

Exit codes (README, "Exit codes"):
- 0: the step's JSON is printed as the last stdout line. While `stream`
  answers "call_again": true it is called again, up to --calls calls.
- 75 (temporary; backfill paused): called again after --retry-delay seconds,
  up to --retries times; then TemporaryStepError, exit 75: the task fails
  and the next run (or the job's own task retries) calls it again.
- 2 (bad input, nothing written) and 3 (needs a person): BadInputError or
  NeedsPersonError at once, exit 2 or 3, with the workflow file, the table
  and the error from the JSON. A Databricks task retries every failure
  alike, so the jobs set max_retries 0 and leave the exit-75 retries here.
- 1 (a bug) and anything else: StepBugError, exit 1. A call killed by a
  signal is a crash that the next call repairs: treated as temporary.

Two rules keep the stream's schedule free of snapshots and silver free of
false alarms (the same as airflow_dag.py's):
- `stream` is skipped (exit 0, "skipped": true) when the stream's next
  transition is a full snapshot's open (snapshot.mode = "full", bootstrap
  not taken yet): that call would read the whole table. `backfill` takes
  that snapshot first (`snapshot`), then reads its waves as usual, so the
  backfill job owns every long read.
- `reconcile` calls `apply` first (idempotent: nothing to do when bronze has
  nothing new) and compares only when silver holds a complete snapshot:
  while a chunked snapshot is open reconcile can judge only the chunks
  silver has applied (the rest count as SNAPSHOT_PENDING), so its read of
  the whole table would check little.

Overlaps (README, "Running steps at the same time"): any two calls of one
workflow may run at once, so a task retried while its first attempt still
runs, or two runs of one job, are safe: the first commit decides, the other
call exits 75 having written nothing it lost. Do not run `seed` beside them.

The binary may sit on a volume mounted without exec permission
(/Volumes/...): it is then copied to a local temp dir and made executable.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class StepFailed(SystemExit):
    """An mssql-cdc step that did not end with exit 0: exits with `code`."""

    retryable = False

    def __init__(self, code: int, message: str, result: dict | None = None):
        super().__init__(code)
        self.message = message
        self.result = result or {}

    def __str__(self) -> str:
        return self.message


class TemporaryStepError(StepFailed):
    """Exit 75 (or a crash) after the in-process retries: call again later."""

    retryable = True


class BadInputError(StepFailed):
    """Exit 2: the workflow file or the source needs fixing; nothing was written."""


class NeedsPersonError(StepFailed):
    """Exit 3: data loss, or reconcile found differences."""


class StepBugError(StepFailed):
    """Exit 1 or another code: a bug; report it with the log."""


def describe(workflow: str) -> str:
    """The workflow file and, when it can be read, its table."""
    try:
        with open(workflow, "rb") as f:
            t = tomllib.load(f).get("table", {})
        return f"{workflow} (table {t.get('schema', 'dbo')}.{t.get('name', '?')})"
    except (OSError, tomllib.TOMLDecodeError):
        return workflow


def snapshot_mode(workflow: str) -> str:
    try:
        with open(workflow, "rb") as f:
            return tomllib.load(f).get("snapshot", {}).get("mode", "full")
    except (OSError, tomllib.TOMLDecodeError):
        return "full"  # the binary reports the file's error itself


def executable(binary: str) -> str:
    """A path to the binary that can be executed: the binary itself, one on
    PATH, or a copy in the temp dir when it cannot be executed where it is."""
    found = shutil.which(binary)
    if found:
        return found
    if not os.path.isfile(binary):
        raise BadInputError(2, f"no mssql-cdc binary at '{binary}' (pass --binary or set MSSQL_CDC_BIN)")
    with open(binary, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    local = os.path.join(tempfile.gettempdir(), f"mssql-cdc-{digest}")
    if not os.access(local, os.X_OK):
        part = f"{local}.{os.getpid()}"
        shutil.copyfile(binary, part)
        os.chmod(part, os.stat(part).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(part, local)
    return local


class Runner:
    def __init__(self, binary: str, workflow: str, retries: int = 3, retry_delay: float = 30.0, calls: int = 20, log=None):
        self.binary = executable(binary)
        self.workflow = workflow
        self.where = describe(workflow)
        self.retries = retries
        self.retry_delay = retry_delay
        self.calls = calls
        self.log = log or (lambda msg: print(f"run_step: {msg}", file=sys.stderr, flush=True))

    def call(self, step: str, *args: str) -> tuple[int, dict]:
        """One call: (exit code, the JSON of its last stdout line). The
        binary's log (stderr) goes to this process's stderr as it comes."""
        proc = subprocess.run([self.binary, "--workflow", self.workflow, step, *args], stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            result = {"error": f"last stdout line is not JSON: {lines[-1]!r}"}
        return proc.returncode, result

    def run(self, step: str, *args: str) -> dict:
        """Calls the step until it ends 0 without call_again (at most
        `calls` calls), retrying exit 75 up to `retries` times; raises a
        StepFailed for everything else."""
        temporary = 0
        calls = 0
        while True:
            code, result = self.call(step, *args)
            calls += 1
            error = result.get("error", result)
            if code == 0:
                if result.get("call_again") and calls < self.calls:
                    continue
                return result
            if code == 75 or code < 0:
                why = "exit 75 (temporary)" if code == 75 else f"killed by signal {-code} (a crash the next call repairs)"
                if temporary < self.retries:
                    temporary += 1
                    self.log(f"{self.where}: {step} {why}, retry {temporary} of {self.retries} in {self.retry_delay:g}s: {error}")
                    time.sleep(self.retry_delay)
                    continue
                raise TemporaryStepError(75, f"{self.where}: mssql-cdc {step} {why} after {self.retries} retries; call again later: {error}", result)
            if code == 2:
                raise BadInputError(2, f"{self.where}: mssql-cdc {step} exit 2 (bad input or configuration, nothing was written): {error}", result)
            if code == 3:
                raise NeedsPersonError(3, f"{self.where}: mssql-cdc {step} exit 3 (needs a person): {error}", result)
            raise StepBugError(1, f"{self.where}: mssql-cdc {step} exit {code} (a bug: report it with the log): {error}", result)

    def full_bootstrap_due(self) -> bool:
        """True when the stream's next transition is a full snapshot's open
        (a chunked open takes a moment: the stream does it)."""
        if snapshot_mode(self.workflow) != "full":
            return False
        nxt = self.run("status").get("machine", {}).get("next", {}).get("stream", {}).get("transition")
        return nxt == "open"

    def step(self, step: str, *args: str) -> dict:
        """A step with the two rules above."""
        if step == "stream" and self.full_bootstrap_due():
            return {"step": "stream", "skipped": True, "reason": "a full bootstrap snapshot is due: the backfill job reads it"}
        if step == "backfill" and self.full_bootstrap_due():
            self.log(f"{self.where}: a full bootstrap snapshot is due: taking it before backfill")
            self.run("snapshot")
        if step == "reconcile":
            applied = self.run("apply")
            state = applied.get("snapshot_state")
            if state != "complete":
                return {"step": "reconcile", "skipped": True, "reason": f"silver's snapshot is '{state}', not complete", "apply": applied}
        return self.run(step, *args)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="run_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default=os.environ.get("MSSQL_CDC_BIN", "mssql-cdc"), help="the mssql-cdc binary (default: $MSSQL_CDC_BIN, else mssql-cdc on PATH)")
    p.add_argument("--workflow", required=True, help="the workflow file (TOML)")
    p.add_argument("--calls", type=int, default=20, help="most calls while the step answers call_again (default 20)")
    p.add_argument("--retries", type=int, default=3, help="exit-75 retries within this run (default 3)")
    p.add_argument("--retry-delay", type=float, default=30.0, help="seconds before each of them (default 30)")
    p.add_argument("step", help="the mssql-cdc step: stream, backfill, apply, reconcile, status, snapshot, ...")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the step's own arguments")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = Runner(a.binary, a.workflow, a.retries, a.retry_delay, a.calls).step(a.step, *a.args)
    except StepFailed as e:
        print(f"run_step: {type(e).__name__}: {e.message}", file=sys.stderr, flush=True)
        print(json.dumps({"ok": False, "exit_code": e.code, "error": e.message, "retryable": e.retryable}), flush=True)
        raise
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
