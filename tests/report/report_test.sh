#!/usr/bin/env bash
# Renders `mssql-cdc report` pages in headless Chromium (Debian's package,
# driven by Playwright) and checks each chart against what the steps said
# they did (report_test.py says what it checks); then runs the long steps
# with stderr on a pseudo-terminal and on a pipe (progress_test.py). .ci/run calls it after the
# Rust tests; it installs Chromium with apt-get when the machine lacks it,
# and Playwright into a venv (workflows/test/venv.sh).
#
#   usage: tests/report/report_test.sh
#   MSSQL_CDC_BIN       the binary (default: mssql-cdc on PATH)
#   CHROMIUM            the browser (default /usr/bin/chromium)
#   REPORT_SCREENSHOTS  where the pages' screenshots go (default: the temp dir)
#
# Exit 0 when every check passed, 1 when one failed, 2 when it could not run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../../workflows/test/venv.sh
source "$HERE/../../workflows/test/venv.sh"
find_bin report_test || exit 2
export MSSQL_CDC_BIN=$BIN MSSQL_CDC_LOG=${MSSQL_CDC_LOG:-warn}
export CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
t0=$SECONDS
if [[ ! -x $CHROMIUM ]]; then
  # As root, or through sudo when it asks no password.
  SUDO=
  if [[ $(id -u) != 0 ]] && sudo -n true 2>/dev/null; then SUDO=sudo; fi
  if { [[ $(id -u) == 0 ]] || [[ -n $SUDO ]]; } && command -v apt-get >/dev/null; then
    echo "report_test: installing Debian's chromium" >&2
    { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/tmp/report_test_apt.log 2>&1 ||
      { tail -20 /tmp/report_test_apt.log >&2; echo "report_test: apt-get install chromium failed" >&2; exit 2; }
  else
    echo "report_test: no browser at $CHROMIUM; install Debian's chromium (apt-get install chromium) or set CHROMIUM" >&2
    exit 2
  fi
fi
chromium_seconds=$((SECONDS - t0))
ensure_venv "playwright-1.65.2" "playwright==1.65.2" || exit 2
code=0
"$VENV/bin/python" "$HERE/report_test.py" || code=$?
# The long steps' progress bars: drawn on a terminal, absent on a pipe.
python3 "$HERE/progress_test.py" || code=1
echo "report_test: $("$CHROMIUM" --version 2>/dev/null | head -1), install ${chromium_seconds}s, playwright install ${INSTALL_SECONDS}s (0: venv reused); exit $code"
exit "$code"
