"""Simulated tables and workflow files for the orchestrator tests.

Standard library only, so any Python 3.11 runs it (the Airflow test's venv,
the Databricks runner's test, plain python3). Each table is its own
simulator file (`mssql-cdc sim create`), with a workflow file in a folder of
workflow files, as an orchestrator finds them. A Background runs what a
SQL Server runs beside the steps: a writer per table and the capture job
(`sim capture` every half second; idle mapping rows every second, so
`reconcile` sees the capture job past its reads).
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

BIN = os.environ.get("MSSQL_CDC_BIN", "mssql-cdc")


class Checks:
    """A test's tally of checks: each call prints `ok` or `FAIL` and the
    check's name; `summary` prints the counts and the failed names and gives
    the exit code (0 when every check held, 1 when one failed)."""

    def __init__(self, detail_chars: int | None = None) -> None:
        self.passed = 0
        self.failures: list[str] = []
        self.detail_chars = detail_chars

    def __call__(self, what: str, ok: bool, detail: str = "") -> None:
        if ok:
            self.passed += 1
            print(f"ok   {what}")
        else:
            self.failures.append(what)
            shown = detail if self.detail_chars is None else detail[: self.detail_chars]
            print(f"FAIL {what}{': ' + shown if shown else ''}")

    def summary(self, name: str, note: str = "") -> int:
        print(f"{name}: {self.passed} passed, {len(self.failures)} failed{note}")
        for f in self.failures:
            print(f"  failed: {f}")
        return 1 if self.failures else 0


def cdc(*args: str, check: bool = True) -> tuple[int, dict, str]:
    """Runs the binary: (exit code, JSON of the last stdout line, stderr)."""
    proc = subprocess.run([BIN, *args], capture_output=True, text=True, env={**os.environ, "MSSQL_CDC_LOG": os.environ.get("MSSQL_CDC_LOG", "warn")})
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        out = {"raw": lines[-1]}
    if check and proc.returncode != 0:
        raise RuntimeError(f"{BIN} {' '.join(args)}: exit {proc.returncode}: {out}\n{proc.stderr[-2000:]}")
    return proc.returncode, out, proc.stderr


class Table:
    """One simulated table (its own simulator file) and its workflow file."""

    def __init__(self, root: Path, wf_dir: Path, name: str, rows: int, mode: str, chunk_rows: int = 500, seed: int = 1,
                 rows_per_s: int | None = None, extra: str = ""):
        self.name = name
        self.db = root / f"{name}.sqlite"
        self.lake = root / "lake" / name
        self.workflow = wf_dir / f"{name}.toml"
        cdc("sim", "create", "--db", str(self.db), "--table", f"dbo.{name}", "--preset", "orders", "--rows", str(rows),
            "--idle-interval-seconds", "1", "--seed", str(seed), *(["--rows-per-s", str(rows_per_s)] if rows_per_s else []))
        # Some changes before the stream starts, captured.
        cdc("sim", "write", "--db", str(self.db), "--tx-per-s", "0", "--transactions", "20", "--seed", str(seed))
        cdc("sim", "capture", "--db", str(self.db))
        self.workflow.write_text(
            f'app_id = "{name}"\n'
            f'[source]\nurl = "sim://{self.db}"\n'
            f'[table]\nschema = "dbo"\nname = "{name}"\n'
            f'[target]\nbronze = "{self.lake}/bronze"\nfacts = "{self.lake}/facts"\nsilver = "{self.lake}/silver"\n'
            f'[snapshot]\nbootstrap = true\nmode = "{mode}"\nparallelism = 2\nchunk_rows = {chunk_rows}\ntarget_wave_seconds = 0\n'
            f'[reconcile]\ncapture_wait_seconds = 20\n{extra}'
        )

    def step(self, *args: str, check: bool = True) -> tuple[int, dict, str]:
        return cdc("--workflow", str(self.workflow), *args, check=check)

    def status(self) -> dict:
        return self.step("status")[1]


class Background:
    """A writer per table and the capture job, until stop()."""

    def __init__(self, tables: list[Table], tx_per_s: int = 10):
        self.tables = tables
        self.writers = [
            subprocess.Popen([BIN, "sim", "write", "--db", str(t.db), "--tx-per-s", str(tx_per_s), "--seconds", "3600", "--seed", str(7 + i)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i, t in enumerate(tables)
        ]
        self._stop = threading.Event()
        self.capture = threading.Thread(target=self._capture_loop, daemon=True)
        self.capture.start()

    def _capture_loop(self) -> None:
        while not self._stop.is_set():
            for t in self.tables:
                cdc("sim", "capture", "--db", str(t.db), check=False)
            self._stop.wait(0.5)

    def stop_writers(self) -> None:
        for w in self.writers:
            if w.poll() is None:
                w.terminate()
        for w in self.writers:
            w.wait(timeout=30)
        # Let the capture job take the writers' last transactions.
        time.sleep(1.5)

    def stop(self) -> None:
        """Stops the writers, then the capture job after one last capture,
        so the change tables hold every commit and no idle row moves the
        max LSN afterwards."""
        self.stop_writers()
        if not self._stop.is_set():
            self._stop.set()
            self.capture.join(timeout=30)
            for t in self.tables:
                cdc("sim", "capture", "--db", str(t.db), check=False)


def check_caught_up(t: Table) -> list[str]:
    """What is wrong with a table that should be bootstrapped, streamed up to
    its last change and applied, with a clean reconcile (empty: nothing),
    read by the binary itself."""
    problems = []
    st = t.status()
    m = st.get("machine", {})
    if m.get("state") != "streaming":
        problems.append(f"{t.name}: machine.state is {m.get('state')!r}, not 'streaming'")
    # (The stream lane may name a commit: the simulator writes an idle
    # mapping row, a new max LSN, after a second without transactions. That
    # the stream read every change is shown by reconcile's IN_FLIGHT = 0.)
    nxt = m.get("next", {}).get("backfill", {}).get("transition")
    if nxt != "idle":
        problems.append(f"{t.name}: the backfill lane's next transition is {nxt!r}, not 'idle'")
    if st.get("open_snapshots"):
        problems.append(f"{t.name}: open snapshots {st['open_snapshots']}")
    if not st.get("snapshot"):
        problems.append(f"{t.name}: no completed snapshot")
    code, ap, _ = t.step("apply", check=False)
    if code != 0 or ap.get("snapshot_state") != "complete" or ap.get("applied_lsn") != st.get("position"):
        problems.append(f"{t.name}: apply exit {code}, snapshot_state {ap.get('snapshot_state')}, applied {ap.get('applied_lsn')} vs position {st.get('position')}")
    code, rc, _ = t.step("reconcile", check=False)
    in_flight = rc.get("counts", {}).get("IN_FLIGHT")
    if code != 0 or not rc.get("clean") or rc.get("differences") != 0 or in_flight != 0 or rc.get("rows_source") != rc.get("rows_target"):
        problems.append(f"{t.name}: reconcile exit {code}: {json.dumps(rc)[:600]}")
    return problems
