"""Progress bars on a terminal, and nothing of them elsewhere.

Each long step runs twice on twin tables: once with stderr on a pseudo-
terminal (as a person at a shell sees it) and once with stderr a pipe (as
an orchestrator's log does). The checks:

- on the terminal, a chunked `backfill` draws its bar (label, chunks
  counted against the plan's total, rows read), a full bootstrap its rows
  bar, `reconcile` its ranges bar;
- on a pipe, the same steps write no carriage return and no escape code:
  plain lines only;
- `MSSQL_CDC_PROGRESS=0` on a terminal draws no bar;
- both runs end with the same JSON (the bar changes nothing the step does).

Exit 0 when every check held, 1 when one failed.
"""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflows" / "test"))
import simlib  # noqa: E402

BIN = simlib.BIN
check = simlib.Checks(detail_chars=600)


def on_terminal(args: list[str], env: dict | None = None) -> tuple[int, dict, str]:
    """Runs the binary with stderr on a pseudo-terminal: (exit code, the last
    stdout line's JSON, everything the terminal received)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL,
                            env={**os.environ, "MSSQL_CDC_LOG": "info", **(env or {})})
    os.close(slave)
    seen = bytearray()
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    out = proc.stdout.read().decode() if proc.stdout else ""
    proc.wait()
    os.close(master)
    lines = out.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else {}, seen.decode(errors="replace")


def on_pipe(args: list[str]) -> tuple[int, dict, str]:
    proc = subprocess.run([BIN, *args], capture_output=True, text=True, env={**os.environ, "MSSQL_CDC_LOG": "info"})
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else {}, proc.stderr


def plain(text: str) -> bool:
    return "\r" not in text and "\x1b" not in text


def same_shape(a: dict, b: dict) -> bool:
    """The two runs' JSON agree but for what differs between any two runs."""
    drop = {"duration_ms", "wave_fixed_seconds", "snapshot_lsn", "snapshot", "position", "source_max_lsn", "applied_lsn", "run"}
    return {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="mssql-cdc-progress."))
    wf = root / "workflows"
    wf.mkdir()
    # Twins: the same rows (same seed), one run on a terminal, one on a pipe.
    tty_c = simlib.Table(root, wf, "tty_c", 60_000, "chunked", chunk_rows=3_000, seed=5)
    pipe_c = simlib.Table(root, wf, "pipe_c", 60_000, "chunked", chunk_rows=3_000, seed=5)
    quiet_c = simlib.Table(root, wf, "quiet_c", 60_000, "chunked", chunk_rows=3_000, seed=5)
    for t in (tty_c, pipe_c, quiet_c):
        t.step("stream")  # opens the chunked bootstrap
        simlib.cdc("sim", "write", "--db", str(t.db), "--tx-per-s", "0", "--transactions", "3", "--seed", "9")
        simlib.cdc("sim", "capture", "--db", str(t.db))
        t.step("stream")

    code_t, out_t, term = on_terminal(["--workflow", str(tty_c.workflow), "backfill"])
    code_p, out_p, err_p = on_pipe(["--workflow", str(pipe_c.workflow), "backfill"])
    chunks = out_t.get("chunks_total")
    check("backfill: both runs complete the snapshot", code_t == 0 and code_p == 0 and out_t.get("done") and out_p.get("done"), f"{out_t} {out_p}")
    check(f"backfill on a terminal: its bar, chunks counted against the plan's {chunks}",
          "backfill of dbo.tty_c" in term and f"/{chunks} chunks" in term and "rows read" in term, term[-1500:])
    check("backfill on a pipe: plain lines, no carriage return, no escape code", plain(err_p) and "backfill of" not in err_p, repr(err_p[-800:]))
    check("backfill: the bar changes nothing the step does", same_shape(out_t, out_p), f"{out_t}\n{out_p}")
    code_q, _, quiet = on_terminal(["--workflow", str(quiet_c.workflow), "backfill"], env={"MSSQL_CDC_PROGRESS": "0"})
    # (A terminal turns each newline into CR LF; a bar's redraw is a CR alone.)
    check("backfill with MSSQL_CDC_PROGRESS=0 on a terminal: no bar", code_q == 0 and "backfill of" not in quiet and re.search(r"\r(?!\n)", quiet) is None, quiet[-800:])

    tty_f = simlib.Table(root, wf, "tty_f", 200_000, "full", seed=6)
    pipe_f = simlib.Table(root, wf, "pipe_f", 200_000, "full", seed=6)
    code_t, out_t, term = on_terminal(["--workflow", str(tty_f.workflow), "stream"])
    code_p, out_p, err_p = on_pipe(["--workflow", str(pipe_f.workflow), "stream"])
    check("full snapshot on a terminal: its rows bar", code_t == 0 and "full snapshot of dbo.tty_f" in term and " rows" in term, term[-1500:])
    check("full snapshot on a pipe: plain lines", code_p == 0 and plain(err_p) and "full snapshot of dbo" not in err_p, repr(err_p[-800:]))
    check("full snapshot: both read the same rows", out_t.get("bootstrap", {}).get("rows") == out_p.get("bootstrap", {}).get("rows"), f"{out_t} {out_p}")

    for t in (tty_c, pipe_c):
        t.step("apply")
    code_t, out_t, term = on_terminal(["--workflow", str(tty_c.workflow), "reconcile"])
    code_p, out_p, err_p = on_pipe(["--workflow", str(pipe_c.workflow), "reconcile"])
    check("reconcile on a terminal: its ranges bar", "reconcile of dbo.tty_c" in term and " ranges" in term, term[-1500:])
    check("reconcile on a pipe: plain lines", plain(err_p) and "reconcile of" not in err_p, repr(err_p[-800:]))
    check("reconcile: both clean", out_t.get("clean") is True and out_p.get("clean") is True, f"{out_t} {out_p}")

    return check.summary("progress_test")


if __name__ == "__main__":
    sys.exit(main())
