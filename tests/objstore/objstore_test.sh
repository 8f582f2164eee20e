#!/usr/bin/env bash
# Runs the workflow against S3 (moto) and Azure Blob (Azurite) on localhost
# through their real protocols, two writers on one table on each, and a
# store that overwrites as the negative control (objstore_test.py says what
# it checks). .ci/run calls it after the Rust tests. It installs moto and
# the stores' Python SDKs into a venv (workflows/test/venv.sh), and Azurite
# 3.35.0 with npm into the cache dir: the last Azurite that runs on
# Debian 12's Node 20.
#
#   usage: tests/objstore/objstore_test.sh
#   MSSQL_CDC_BIN  the binary, built with the `cloud` feature (default: mssql-cdc on PATH)
#   KEEP=1         keep the temp dir
#
# Exit 0 when every check passed, 1 when one failed, 2 when it could not run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../../workflows/test/venv.sh
source "$HERE/../../workflows/test/venv.sh"
find_bin objstore_test || exit 2
export MSSQL_CDC_BIN=$BIN
t0=$SECONDS
ensure_venv "objstore-moto-5.2.5" "moto[server]==5.2.5" "boto3==1.44.8" "azure-storage-blob==12.31.1" || exit 2
venv_seconds=$INSTALL_SECONDS

azurite_version=3.35.0
azurite_dir=${MSSQL_CDC_VENV_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mssql-cdc/venvs}/azurite-$azurite_version
export AZURITE_BIN=$azurite_dir/node_modules/.bin/azurite-blob
if [[ ! -x $AZURITE_BIN ]]; then
  if ! command -v npm >/dev/null; then
    echo "objstore_test: npm is needed to install Azurite $azurite_version (apt-get install npm)" >&2
    exit 2
  fi
  echo "objstore_test: installing Azurite $azurite_version with npm" >&2
  rm -rf "$azurite_dir"
  mkdir -p "$azurite_dir"
  npm install --silent --no-audit --no-fund --prefix "$azurite_dir" "azurite@$azurite_version" >&2 ||
    { rm -rf "$azurite_dir"; echo "objstore_test: npm install azurite@$azurite_version failed" >&2; exit 2; }
fi
install_seconds=$((SECONDS - t0))
code=0
(cd "$HERE" && "$VENV/bin/python" objstore_test.py) || code=$?
echo "objstore_test: moto venv ${venv_seconds}s, install ${install_seconds}s (0: reused), tests $((SECONDS - t0 - install_seconds))s; exit $code"
exit "$code"
