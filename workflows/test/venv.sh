# Sourced by the shell tests (workflows/test, tests/report, tests/objstore):
# `find_bin` below finds the binary; `ensure_venv NAME REQUIREMENT...` makes
# (once) a Python venv for those pinned requirements under the cache dir and
# sets VENV to it. A venv is reused while its requirement list is unchanged;
# a changed list, or an install cut halfway, makes it anew.
#
#   MSSQL_CDC_VENV_DIR  where the venvs live
#                       (default ${XDG_CACHE_HOME:-$HOME/.cache}/mssql-cdc/venvs)
#   PYTHON              the interpreter to make them with (default python3, 3.11+)
#
# Airflow's constraints files live outside the package registries, which this
# machine does not reach, so each requirement is pinned here instead, and the
# versions pip resolved for the rest are written to the venv's freeze.txt.
# INSTALL_SECONDS is set to how long the install took (0 when reused).

# `find_bin WHO`: BIN is the mssql-cdc binary the test runs (MSSQL_CDC_BIN, a
# path or a name on PATH; default mssql-cdc) as an absolute path, exported
# as MSSQL_CDC_BIN too. Without one it says so as WHO and returns 2.
find_bin() {
  BIN=${MSSQL_CDC_BIN:-mssql-cdc}
  if ! BIN=$(command -v "$BIN"); then
    echo "$1: no mssql-cdc binary (set MSSQL_CDC_BIN)" >&2
    return 2
  fi
  [[ $BIN == /* ]] || BIN=$PWD/$BIN
  export MSSQL_CDC_BIN=$BIN
}

ensure_venv() {
  local name=$1
  shift
  local base=${MSSQL_CDC_VENV_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/mssql-cdc/venvs}
  VENV=$base/$name
  local want
  want=$(printf '%s\n' "$@")
  INSTALL_SECONDS=0
  if [[ -f $VENV/.requirements && $(cat "$VENV/.requirements") == "$want" ]]; then
    echo "venv $VENV: reused ($(tr '\n' ' ' <"$VENV/.requirements"))" >&2
    return 0
  fi
  local py=${PYTHON:-python3}
  if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "venv: $py is not Python 3.11 or newer" >&2
    return 2
  fi
  echo "venv $VENV: installing $*" >&2
  local t0=$SECONDS
  rm -rf "$VENV"
  mkdir -p "$base"
  "$py" -m venv "$VENV" || return 1
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@" || { rm -rf "$VENV"; return 1; }
  "$VENV/bin/pip" freeze --disable-pip-version-check >"$VENV/freeze.txt"
  printf '%s\n' "$want" >"$VENV/.requirements"
  INSTALL_SECONDS=$((SECONDS - t0))
  echo "venv $VENV: installed in ${INSTALL_SECONDS}s" >&2
}
