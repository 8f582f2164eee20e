#!/usr/bin/env bash
# Runs workflows/airflow_dag.py's DAGs end to end with Airflow itself
# (dag.test(), no scheduler) against the simulator: two tables (one chunked
# bootstrap, one full), a source fault retried on exit 75, a bad workflow
# file failing its own tasks without retry (airflow_dag_test.py says what it
# checks). .ci/run calls it after the Rust tests. See workflows/README.md.
#
#   usage: workflows/test/airflow_test.sh
#   MSSQL_CDC_BIN     the binary (default: mssql-cdc on PATH)
#   AIRFLOW_VERSION   the pinned apache-airflow (default 3.3.2)
#   MSSQL_CDC_VENV_DIR, PYTHON: see venv.sh
#   KEEP=1            keep the temp dir (simulators, lake, AIRFLOW_HOME) for a look
#
# Exit 0 when every check passed, 1 when one failed, 2 when it could not run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=venv.sh
source "$HERE/venv.sh"
find_bin airflow_test || exit 2
AIRFLOW_VERSION=${AIRFLOW_VERSION:-3.3.2}
ensure_venv "airflow-$AIRFLOW_VERSION" "apache-airflow==$AIRFLOW_VERSION" || exit 2

TMP=$(mktemp -d "${TMPDIR:-/tmp}/mssql-cdc-airflow.XXXXXX")
cleanup() { if [[ ${KEEP:-0} == 1 ]]; then echo "kept $TMP" >&2; else rm -rf "$TMP"; fi; }
trap cleanup EXIT
mkdir -p "$TMP/dags" "$TMP/workflows" "$TMP/sim"
cp "$HERE/../airflow_dag.py" "$TMP/dags/"

export AIRFLOW_HOME=$TMP/airflow
export AIRFLOW__CORE__DAGS_FOLDER=$TMP/dags
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=sqlite:///$TMP/airflow/airflow.db
export AIRFLOW__LOGGING__LOGGING_LEVEL=${AIRFLOW_LOG_LEVEL:-WARNING}
# The DAG's settings: the folder as an Airflow Variable (AIRFLOW_VAR_*), the
# binary, short retry delays and a one-second backfill budget.
export AIRFLOW_VAR_MSSQL_CDC_WORKFLOWS=$TMP/workflows
export MSSQL_CDC_WORKFLOWS=$TMP/workflows
export MSSQL_CDC_BIN=$BIN
export MSSQL_CDC_RETRY_DELAY_SECONDS=1
export MSSQL_CDC_RETRIES=3
export MSSQL_CDC_BACKFILL_SECONDS=1
export MSSQL_CDC_LOG=warn
export MSSQL_CDC_TEST_DIR=$TMP/sim

t0=$SECONDS
mkdir -p "$AIRFLOW_HOME"
"$VENV/bin/airflow" db migrate >"$TMP/migrate.log" 2>&1 || { cat "$TMP/migrate.log" >&2; exit 2; }
migrate=$((SECONDS - t0))

t1=$SECONDS
code=0
"$VENV/bin/python" "$HERE/airflow_dag_test.py" || code=$?
run=$((SECONDS - t1))
echo "airflow_test: apache-airflow $AIRFLOW_VERSION, install ${INSTALL_SECONDS}s (0: venv reused), db migrate ${migrate}s, DAG runs and checks ${run}s; exit $code"
exit "$code"
