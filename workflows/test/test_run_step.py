"""workflows/run_step.py against the simulator, run as a Databricks task runs
it (a subprocess: its exit code, its last stdout line, its stderr).

    MSSQL_CDC_BIN=... python -m pytest -q workflows/test/test_run_step.py
(databricks_test.sh runs it in its venv.)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import simlib  # noqa: E402

RUN_STEP = HERE.parent / "run_step.py"
BIN = shutil.which(os.environ.get("MSSQL_CDC_BIN", "mssql-cdc"))
pytestmark = pytest.mark.skipif(BIN is None, reason="no mssql-cdc binary (set MSSQL_CDC_BIN)")


def run_step(workflow, *args: str, runner: tuple[str, ...] = (), binary: str | None = None, tmp: Path | None = None) -> tuple[int, dict, str]:
    """run_step.py [runner flags] --workflow F ARGS: (exit code, last stdout line as JSON, stderr).
    `tmp` becomes its TMPDIR (where it copies a binary it cannot execute)."""
    cmd = [sys.executable, str(RUN_STEP), "--binary", binary or BIN, "--retry-delay", "0", *runner, "--workflow", str(workflow), *args]
    env = {**os.environ, "MSSQL_CDC_LOG": "warn", **({"TMPDIR": str(tmp)} if tmp else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else {}, proc.stderr


@pytest.fixture
def tables(tmp_path):
    wf = tmp_path / "workflows"
    wf.mkdir()
    chunked = simlib.Table(tmp_path, wf, "chunked_orders", rows=4000, mode="chunked", chunk_rows=250, rows_per_s=2000)
    full = simlib.Table(tmp_path, wf, "full_orders", rows=2000, mode="full", seed=2)
    bg = simlib.Background([chunked, full])
    yield chunked, full, bg
    bg.stop()


def test_the_jobs_steps_bring_a_chunked_and_a_full_table_to_a_clean_reconcile(tables):
    chunked, full, bg = tables
    # The stream job: the chunked table opens its snapshot and streams; the
    # full table's stream is skipped while its bootstrap is due.
    code, out, err = run_step(chunked.workflow, "stream")
    assert code == 0 and out["step"] == "stream" and not out.get("skipped"), (out, err)
    code, out, err = run_step(full.workflow, "stream")
    assert code == 0 and out.get("skipped") is True, (out, err)
    # The backfill job: the full snapshot, then bounded backfill calls.
    code, out, err = run_step(full.workflow, "backfill", "--max-seconds", "1")
    assert code == 0 and out["done"] is True, (out, err)
    assert full.status()["snapshot"] is not None
    code, out, err = run_step(chunked.workflow, "backfill", "--max-seconds", "1")
    assert code == 0 and out["done"] is False, f"one bounded call should leave waves for the next run: {out}"
    # Silver while the chunked snapshot is open: reconcile skipped, not exit 3.
    code, out, err = run_step(chunked.workflow, "reconcile")
    assert code == 0 and out.get("skipped") is True and out["apply"]["snapshot_state"] == "open", (out, err)
    for _ in range(30):
        code, out, err = run_step(chunked.workflow, "backfill", "--max-seconds", "1")
        assert code == 0, (out, err)
        run_step(chunked.workflow, "stream")
        if out["done"]:
            break
    assert out["done"] is True, out
    bg.stop()
    for t in (chunked, full):
        code, out, err = run_step(t.workflow, "stream")
        assert code == 0 and out["caught_up"] is True, (out, err)
        # The maintain job: facts ends compacted, and the steps after it
        # (apply, reconcile) run on the compacted tables.
        code, out, err = run_step(t.workflow, "maintain", "--vacuum-retention-hours", "120")
        assert code == 0, (out, err)
        log = "".join(p.read_text() for p in sorted((t.lake / "facts" / "_delta_log").glob("*.json")))
        assert '"appId":"mssql-cdc.maintain.compact"' in log, f"{t.name}'s facts were not compacted: {out}"
        code, out, err = run_step(t.workflow, "apply")
        assert code == 0 and out["snapshot_state"] == "complete", (out, err)
        code, out, err = run_step(t.workflow, "reconcile")
        assert code == 0 and out["step"] == "reconcile" and out["clean"] is True and out["differences"] == 0, (out, err)
        assert not simlib.check_caught_up(t)


def test_exit_75_is_retried_within_the_run_then_raised_as_retryable(tables):
    chunked, _, _ = tables
    run_step(chunked.workflow, "stream")
    simlib.cdc("sim", "fault", "--db", str(chunked.db), "--on", "any", "--times", "1")
    code, out, err = run_step(chunked.workflow, "stream", runner=("--retries", "1"))
    assert code == 0 and out["step"] == "stream", (out, err)
    assert "retry 1 of 1" in err, err
    simlib.cdc("sim", "fault", "--db", str(chunked.db), "--on", "any", "--times", "5")
    code, out, err = run_step(chunked.workflow, "stream", runner=("--retries", "2"))
    assert code == 75 and out["retryable"] is True and out["exit_code"] == 75, (out, err)
    assert "TemporaryStepError" in err and "chunked_orders.toml (table dbo.chunked_orders)" in out["error"], (out, err)
    assert err.count("retry ") == 2, err


def test_exit_2_fails_at_once_naming_the_file_the_table_and_the_error(tables, tmp_path):
    chunked, _, _ = tables
    bad = tmp_path / "workflows" / "bad_orders.toml"
    bad.write_text(chunked.workflow.read_text().replace('"chunked_orders"', '"bad_orders"').replace('mode = "chunked"', 'mode = "chunkd"'))
    code, out, err = run_step(bad, "stream", runner=("--retries", "3"))
    assert code == 2 and out["retryable"] is False, (out, err)
    assert "bad_orders.toml (table dbo.bad_orders)" in out["error"] and "chunkd" in out["error"], out
    assert "BadInputError" in err and "retry" not in err, err


def test_exit_3_on_data_loss_fails_at_once(tmp_path):
    wf = tmp_path / "workflows"
    wf.mkdir()
    t = simlib.Table(tmp_path, wf, "lossy", rows=200, mode="full", extra='[stream]\non_data_loss = "fail"\n')
    assert run_step(t.workflow, "backfill")[0] == 0
    assert run_step(t.workflow, "stream")[0] == 0
    # Changes the stream has not read, purged by cleanup.
    simlib.cdc("sim", "write", "--db", str(t.db), "--tx-per-s", "0", "--transactions", "10")
    simlib.cdc("sim", "capture", "--db", str(t.db))
    max_lsn = simlib.cdc("sim", "status", "--db", str(t.db))[1]["max_lsn"]
    simlib.cdc("sim", "cleanup", "--db", str(t.db), "--to-lsn", max_lsn)
    code, out, err = run_step(t.workflow, "stream", runner=("--retries", "3"))
    assert code == 3 and out["retryable"] is False and "lossy.toml (table dbo.lossy)" in out["error"], (out, err)
    assert "NeedsPersonError" in err and "retry" not in err, err


def test_call_again_is_followed_up_to_the_bound(tmp_path):
    wf = tmp_path / "workflows"
    wf.mkdir()
    t = simlib.Table(tmp_path, wf, "busy", rows=100, mode="full", extra="[stream]\nmax_batch_rows = 5\nmax_batches = 1\n")
    assert run_step(t.workflow, "backfill")[0] == 0
    simlib.cdc("sim", "write", "--db", str(t.db), "--tx-per-s", "0", "--transactions", "12", "--ops-per-tx", "1")
    simlib.cdc("sim", "capture", "--db", str(t.db))
    code, out, err = run_step(t.workflow, "stream", runner=("--calls", "1"))
    assert code == 0 and out["call_again"] is True and out["batches"] == 1, (out, err)
    code, out, err = run_step(t.workflow, "stream", runner=("--calls", "50"))
    assert code == 0 and out["call_again"] is False and out["caught_up"] is True, (out, err)


def test_a_binary_without_exec_permission_is_copied_and_a_missing_one_is_exit_2(tables, tmp_path):
    chunked, _, _ = tables
    plain = tmp_path / "noexec-mssql-cdc"
    shutil.copyfile(BIN, plain)
    os.chmod(plain, 0o644)
    copies = tmp_path / "tmp"
    copies.mkdir()
    code, out, err = run_step(chunked.workflow, "status", binary=str(plain), tmp=copies)
    assert code == 0 and out["step"] == "status", (out, err)
    assert [p.name.startswith("mssql-cdc-") for p in copies.iterdir()] == [True], list(copies.iterdir())
    code, out, err = run_step(chunked.workflow, "status", binary=str(tmp_path / "missing"))
    assert code == 2 and "no mssql-cdc binary" in out["error"], (out, err)
