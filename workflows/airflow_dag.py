"""An Airflow DAG that calls one mssql-cdc step per task.

Exit 75 ("call again later") is retried by Airflow's own retries; exit 2 and 3
need a person and fail the task without retrying.

Overlaps (README, "Running steps at the same time"): any two calls of one
workflow may run at once, so a retry that starts while a timed-out call still
runs, a manual run beside a scheduled one, or two DAG runs are all safe. The
first call to commit a batch, a wave or a MERGE decides it; the other goes on
from it or exits 75 having written nothing of what it lost (tests/batch_race.rs,
tests/records_race.rs, tests/concurrent_first.rs, tests/torture.rs).
max_active_runs=1 only saves that lost work. A task killed by a timeout is a
crash; the next call repairs it (tests/crash_drill.rs), so an execution_timeout
is safe too. Do not run `seed` while this DAG runs.

The stream and backfill tasks run side by side. Each backfill task is one call
bounded by --max-seconds (it may overrun by one wave and one commit): with
max_active_runs=1, a backfill task that looped until done would keep the next
run, and so the stream, waiting for the whole snapshot.
"""
import json
import subprocess
from datetime import datetime, timedelta

from airflow import DAG
from airflow.exceptions import AirflowFailException
from airflow.operators.python import PythonOperator

WORKFLOW = "/opt/cdc/workflows/orders.toml"


def run_step(step: str, *args: str) -> dict:
    while True:
        proc = subprocess.run(["mssql-cdc", "--workflow", WORKFLOW, step, *args], capture_output=True, text=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if proc.returncode == 0:
            # stream: call_again means more batches are waiting now. backfill
            # without done: true is continued by the next DAG run.
            if result.get("call_again"):
                continue
            return result
        if proc.returncode == 75:
            raise RuntimeError(f"temporary failure, Airflow retries: {result}")
        raise AirflowFailException(f"mssql-cdc {step} needs a person (exit {proc.returncode}): {result}")


with DAG(
    "mssql_cdc_orders",
    start_date=datetime(2026, 1, 1),
    schedule=timedelta(minutes=5),
    catchup=False,
    max_active_runs=1,  # saves work only: overlapping runs are safe
    default_args={"retries": 5, "retry_delay": timedelta(minutes=1)},
) as dag:
    stream = PythonOperator(task_id="stream", python_callable=run_step, op_args=["stream"])
    # With snapshot.mode = "chunked": backfill reads the table beside the stream
    # (parallel tasks), one bounded call per run; after the snapshot completes
    # it returns done at once.
    backfill = PythonOperator(task_id="backfill", python_callable=run_step, op_args=["backfill", "--max-seconds", "240"])
