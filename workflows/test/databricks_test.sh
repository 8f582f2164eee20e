#!/usr/bin/env bash
# Checks the Databricks example: databricks_job.json against the Jobs API's
# own types in the databricks-sdk package (databricks_validate.py), and
# workflows/run_step.py, the runner its tasks call, against the simulator
# (test_run_step.py, pytest). .ci/run calls it after the Rust tests. See
# workflows/README.md.
#
#   usage: workflows/test/databricks_test.sh
#   MSSQL_CDC_BIN          the binary (default: mssql-cdc on PATH)
#   DATABRICKS_SDK_VERSION the pinned databricks-sdk (default 0.167.0)
#   MSSQL_CDC_VENV_DIR, PYTHON: see venv.sh
#
# Exit 0 when both passed, 1 when one failed, 2 when they could not run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=venv.sh
source "$HERE/venv.sh"
find_bin databricks_test || exit 2
export MSSQL_CDC_BIN=$BIN
SDK=${DATABRICKS_SDK_VERSION:-0.167.0}
ensure_venv "databricks-sdk-$SDK" "databricks-sdk==$SDK" "pytest==8.3.5" || exit 2

TMP=$(mktemp -d "${TMPDIR:-/tmp}/mssql-cdc-databricks.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

code=0
t0=$SECONDS
"$VENV/bin/python" "$HERE/databricks_validate.py" 2>"$TMP/validate.err" || { code=1; cat "$TMP/validate.err" >&2; }
validate=$((SECONDS - t0))
t1=$SECONDS
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --basetemp="$TMP/pytest" "$HERE/test_run_step.py" || code=1
tests=$((SECONDS - t1))
echo "databricks_test: databricks-sdk $SDK, install ${INSTALL_SECONDS}s (0: venv reused), validate ${validate}s, run_step.py tests ${tests}s; exit $code"
exit "$code"
