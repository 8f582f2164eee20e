"""An Airflow DAG that calls one mssql-cdc step per task.

Exit 75 ("call again later") is retried by Airflow's own retries; exit 2 and 3
need a person and fail the task without retrying.
"""
import json
import subprocess
from datetime import datetime, timedelta

from airflow import DAG
from airflow.exceptions import AirflowFailException
from airflow.operators.python import PythonOperator

WORKFLOW = "/opt/cdc/workflows/orders.toml"


def run_step(step: str) -> dict:
    while True:
        proc = subprocess.run(["mssql-cdc", "--workflow", WORKFLOW, step], capture_output=True, text=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if proc.returncode == 0:
            # stream: call_again; backfill (chunked snapshots): done.
            if result.get("call_again") or (step == "backfill" and not result.get("done")):
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
    max_active_runs=1,
    default_args={"retries": 5, "retry_delay": timedelta(minutes=1)},
) as dag:
    stream = PythonOperator(task_id="stream", python_callable=run_step, op_args=["stream"])
    # With snapshot.mode = "chunked": backfill reads the table beside the stream
    # (parallel tasks); after the snapshot completes it returns done at once.
    backfill = PythonOperator(task_id="backfill", python_callable=run_step, op_args=["backfill"])
