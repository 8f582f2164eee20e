"""Four Airflow DAGs that call mssql-cdc one step per task, for every
workflow file in a folder (one file per table, dynamic task mapping):

- mssql_cdc_stream    every 5 minutes: `stream` per table, nothing else.
- mssql_cdc_backfill  every 10 minutes: per table, a full bootstrap snapshot
                      when one is due, then one `backfill --max-seconds` call.
- mssql_cdc_silver    every hour: per table, `apply` then `reconcile`.
- mssql_cdc_maintain  every day: per table, `maintain` (compaction of the
                      small files of facts, plans, control and reconcile,
                      VACUUM past a retention, a checkpoint of every table),
                      without which each step's read of its state grows
                      with the table's history.

Why the stream is its own DAG. A chunked snapshot needs every change after
its S, and the stream is what reads them; CDC cleanup purges change rows once
they are older than the capture instance's retention (3 days by default)
whether or not the stream has read them. A stream held back past that loses
changes (a data loss; a new snapshot under on_data_loss = "resnapshot"). In
one DAG with max_active_runs=1 the stream's next run would wait for the
slowest task of the current run: a backfill, an apply or a reconcile, which
can take hours on a large table. So nothing but `stream` runs in the stream
DAG, and a full bootstrap snapshot (a read of the whole table, which `stream`
would otherwise take itself) is left to the backfill DAG: the stream task of
a table whose next transition is a full snapshot's open is skipped, and
streams from the next run after the snapshot is complete.

Overlaps (README, "Running steps at the same time"): any two calls of one
workflow may run at once, so a retry that starts while a timed-out call still
runs, a manual run beside a scheduled one, two runs of one DAG, and these
three DAGs side by side are all safe. The first call to commit a batch, a
wave or a MERGE decides it; the other goes on from it or exits 75 having
written nothing of what it lost (tests/batch_race.rs, tests/records_race.rs,
tests/concurrent_first.rs, tests/torture.rs). max_active_runs=1 only saves
that lost work. A task killed by a timeout is a crash; the next call repairs
it (tests/crash_drill.rs), so an execution_timeout is safe too. Do not run
`seed` while these DAGs run.

Exit codes (README, "Exit codes"). 75 (temporary, or backfill paused on
headroom) raises AirflowException, which Airflow retries (`retries`,
`retry_delay`). 2 (bad input or configuration: nothing was written) and 3
(needs a person: data loss, or reconcile found differences) raise
AirflowFailException, which fails the task at once without retrying; the
message names the workflow file, the table and the error from the JSON.
1 (a bug) fails at once too. A call killed by a signal is a crash and is
retried. 0 with "call_again": true is called again within the task, up to
MSSQL_CDC_STREAM_CALLS calls; the next run goes on from there.

Configuration (environment of the workers, or Airflow Variables):
- Variable `mssql_cdc_workflows`, else env MSSQL_CDC_WORKFLOWS: the folder of
  workflow files (*.toml), read when each DAG run starts. One failing file
  (a typo, a table that does not exist) fails its own tasks only.
- MSSQL_CDC_BIN: the binary (default `mssql-cdc` on PATH).
- MSSQL_CDC_RETRIES (5), MSSQL_CDC_RETRY_DELAY_SECONDS (60): exit-75 retries.
- MSSQL_CDC_STREAM_CALLS (20): `stream` calls a task makes while call_again.
- MSSQL_CDC_BACKFILL_SECONDS (480): `backfill --max-seconds`; a call may run
  one wave and one commit past it, so keep it below the DAG's interval.
- MSSQL_CDC_VACUUM_RETENTION_HOURS (unset: the binary's 120): `maintain
  --vacuum-retention-hours`; at least 24, and under the tables' own
  delta.deletedFileRetentionDuration (a week by default).

Written for Airflow 3 (tested with 3.3.2 by workflows/test/airflow_test.sh);
the fallback imports are Airflow 2.x's names.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

try:  # Airflow 3
    from airflow.sdk import Variable, dag, get_current_context, task, task_group
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException
except ImportError:  # Airflow 2.x
    from airflow.decorators import dag, task, task_group
    from airflow.exceptions import AirflowException, AirflowFailException, AirflowSkipException
    from airflow.models import Variable
    from airflow.operators.python import get_current_context

log = logging.getLogger(__name__)

BIN = os.environ.get("MSSQL_CDC_BIN", "mssql-cdc")
RETRIES = int(os.environ.get("MSSQL_CDC_RETRIES", "5"))
RETRY_DELAY = timedelta(seconds=int(os.environ.get("MSSQL_CDC_RETRY_DELAY_SECONDS", "60")))
STREAM_CALLS = int(os.environ.get("MSSQL_CDC_STREAM_CALLS", "20"))
BACKFILL_SECONDS = int(os.environ.get("MSSQL_CDC_BACKFILL_SECONDS", "480"))
VACUUM_RETENTION_HOURS = os.environ.get("MSSQL_CDC_VACUUM_RETENTION_HOURS", "")
START = datetime(2026, 1, 1, tzinfo=timezone.utc)

# Every per-table task: retried on exit 75 only (the others raise
# AirflowFailException), and named by its workflow file in the UI.
PER_TABLE = {"retries": RETRIES, "retry_delay": RETRY_DELAY, "map_index_template": "{{ workflow_name }}"}


def workflows_folder() -> str:
    return Variable.get("mssql_cdc_workflows", default=None) or os.environ.get("MSSQL_CDC_WORKFLOWS", "/opt/cdc/workflows")


def _describe(workflow: str) -> str:
    """The workflow file and, when it can be read, its table: for messages."""
    try:
        with open(workflow, "rb") as f:
            t = tomllib.load(f).get("table", {})
        return f"{workflow} (table {t.get('schema', 'dbo')}.{t.get('name', '?')})"
    except (OSError, tomllib.TOMLDecodeError):
        return workflow


def _snapshot_mode(workflow: str) -> str:
    try:
        with open(workflow, "rb") as f:
            return tomllib.load(f).get("snapshot", {}).get("mode", "full")
    except (OSError, tomllib.TOMLDecodeError):
        return "full"  # the binary reports the file's error itself


def call(workflow: str, step: str, *args: str) -> tuple[int, dict]:
    """One mssql-cdc call: (exit code, the JSON of its last stdout line)."""
    cmd = [BIN, "--workflow", workflow, step, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise AirflowFailException(f"{_describe(workflow)}: no mssql-cdc binary at '{BIN}' (set MSSQL_CDC_BIN)")
    for line in proc.stderr.splitlines():
        log.info("mssql-cdc: %s", line)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {"error": f"last stdout line is not JSON: {lines[-1]!r}"}
    return proc.returncode, result


def run(workflow: str, step: str, *args: str, max_calls: int = 1) -> dict:
    """Calls a step, again while it answers call_again (up to max_calls), and
    maps its exit code to what Airflow does next."""
    where = _describe(workflow)
    for n in range(1, max_calls + 1):
        code, result = call(workflow, step, *args)
        error = result.get("error", result)
        if code == 0:
            if result.get("call_again") and n < max_calls:
                continue
            log.info("%s: %s done: %s", where, step, json.dumps(result))
            return result
        if code == 75:
            raise AirflowException(f"{where}: mssql-cdc {step} exit 75, temporary (Airflow retries it): {error}")
        if code < 0:
            raise AirflowException(f"{where}: mssql-cdc {step} killed by signal {-code}, a crash the next call repairs")
        what = {2: "bad input or configuration, nothing was written", 3: "needs a person", 1: "a bug: report it with the log"}
        raise AirflowFailException(f"{where}: mssql-cdc {step} exit {code} ({what.get(code, 'unexpected')}): {error}")
    raise AssertionError("unreachable")


def _name_instance(workflow: str) -> None:
    get_current_context()["workflow_name"] = Path(workflow).name


def full_bootstrap_due(workflow: str) -> bool:
    """True when the stream's next transition is a full snapshot's open: the
    first `stream` would read the whole table itself. (A chunked open takes
    a moment: the stream does it. A file that cannot be read is passed to
    the binary, which names what is wrong with it.)"""
    if _snapshot_mode(workflow) != "full":
        return False
    status = run(workflow, "status")
    nxt = status.get("machine", {}).get("next", {}).get("stream", {}).get("transition")
    return nxt == "open"


@task(retries=RETRIES, retry_delay=RETRY_DELAY)
def list_workflows() -> list[str]:
    folder = workflows_folder()
    if not Path(folder).is_dir():
        raise AirflowFailException(f"the workflow folder {folder} does not exist (Variable mssql_cdc_workflows or MSSQL_CDC_WORKFLOWS)")
    files = sorted(str(p) for p in Path(folder).glob("*.toml"))
    if not files:
        raise AirflowSkipException(f"no workflow files (*.toml) in {folder}")
    log.info("%d workflow files in %s", len(files), folder)
    return files


@dag(
    dag_id="mssql_cdc_stream",
    start_date=START,
    schedule=timedelta(minutes=5),
    catchup=False,
    max_active_runs=1,  # saves work only: overlapping runs are safe
    tags=["mssql-cdc"],
)
def mssql_cdc_stream():
    # A stream call reads a bounded number of batches (stream.max_batches);
    # 2 hours is far above that, and a killed call is repaired by the next.
    @task(**PER_TABLE, execution_timeout=timedelta(hours=2), max_active_tis_per_dagrun=16)
    def stream(workflow: str) -> dict:
        _name_instance(workflow)
        if full_bootstrap_due(workflow):
            raise AirflowSkipException(f"{_describe(workflow)}: a full bootstrap snapshot is due; mssql_cdc_backfill reads it")
        return run(workflow, "stream", max_calls=STREAM_CALLS)

    stream.expand(workflow=list_workflows())


@dag(
    dag_id="mssql_cdc_backfill",
    start_date=START,
    schedule=timedelta(minutes=10),
    catchup=False,
    max_active_runs=1,
    tags=["mssql-cdc"],
)
def mssql_cdc_backfill():
    @task(**PER_TABLE, max_active_tis_per_dagrun=4)
    def backfill(workflow: str) -> dict:
        """A full bootstrap snapshot when due (one call that reads the whole
        table), then one bounded `backfill` call: with snapshot.mode =
        "chunked" it reads waves beside the stream; without an open chunked
        snapshot it answers done at once. Not done yet: the next run goes on."""
        _name_instance(workflow)
        if full_bootstrap_due(workflow):
            run(workflow, "snapshot")
        return run(workflow, "backfill", "--max-seconds", str(BACKFILL_SECONDS))

    backfill.expand(workflow=list_workflows())


@dag(
    dag_id="mssql_cdc_silver",
    start_date=START,
    schedule=timedelta(hours=1),
    catchup=False,
    max_active_runs=1,
    tags=["mssql-cdc"],
)
def mssql_cdc_silver():
    @task(**PER_TABLE)
    def apply(workflow: str) -> dict:
        _name_instance(workflow)
        return {"workflow": workflow, "apply": run(workflow, "apply")}

    @task(**PER_TABLE)
    def reconcile(applied: dict) -> dict:
        """Compares silver with the table (it reads the whole table). Only
        once silver holds a complete snapshot: while a chunked snapshot is
        open, reconcile can judge only the chunks silver has applied (it
        counts the rest SNAPSHOT_PENDING, not as differences), so a read of
        the whole table would check little; before any snapshot it has
        nothing to compare."""
        workflow = applied["workflow"]
        _name_instance(workflow)
        state = applied["apply"].get("snapshot_state")
        if state != "complete":
            raise AirflowSkipException(f"{_describe(workflow)}: silver's snapshot is '{state}', not complete: nothing to reconcile yet")
        return run(workflow, "reconcile")

    # A mapped task group: table i's reconcile follows table i's apply only,
    # so one table's failure holds back no other table.
    @task_group
    def table(workflow: str):
        reconcile(apply(workflow))

    table.expand(workflow=list_workflows())


@dag(
    dag_id="mssql_cdc_maintain",
    start_date=START,
    schedule=timedelta(days=1),
    catchup=False,
    max_active_runs=1,
    tags=["mssql-cdc"],
)
def mssql_cdc_maintain():
    @task(**PER_TABLE, max_active_tis_per_dagrun=4)
    def maintain(workflow: str) -> dict:
        """The table's upkeep. It changes no row and may run beside every
        other step (a compaction carries its own txn, so two at once land
        once). Daily is what the default VACUUM retention is sized for."""
        _name_instance(workflow)
        args = ["--vacuum-retention-hours", VACUUM_RETENTION_HOURS] if VACUUM_RETENTION_HOURS else []
        return run(workflow, "maintain", *args)

    maintain.expand(workflow=list_workflows())


stream_dag = mssql_cdc_stream()
backfill_dag = mssql_cdc_backfill()
silver_dag = mssql_cdc_silver()
maintain_dag = mssql_cdc_maintain()
