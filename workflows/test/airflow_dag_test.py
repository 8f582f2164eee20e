"""Runs workflows/airflow_dag.py's four DAGs end to end with Airflow's own
dag.test() against the simulator. Started by airflow_test.sh, which sets up
the venv, AIRFLOW_HOME, the DAGs folder and the metadata database; run with
that venv's python.

Two tables, one workflow file each in one folder: `chunked_orders`
(snapshot.mode = "chunked") and `full_orders` (mode = "full"), a writer on
each and the capture job running. The DAGs run in the order a scheduler
would interleave them until both snapshots are complete and silver is
applied; then the writers stop, a last stream and silver run catch up, and
the binary itself (`status`, `apply`, `reconcile`) checks both tables. On
the way: an injected source fault (exit 75) is retried by Airflow, and a bad
workflow file (exit 2) fails its own tasks on the first try while the other
tables' tasks succeed. Prints one line per check and "N passed, N failed".
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import simlib  # noqa: E402

ROOT = Path(os.environ["MSSQL_CDC_TEST_DIR"])
WF_DIR = Path(os.environ["MSSQL_CDC_WORKFLOWS"])
DAG_FILE = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"]) / "airflow_dag.py"

passed: list[str] = []
failed: list[str] = []
timings: list[tuple[str, float]] = []


def check(ok: bool, what: str) -> bool:
    (passed if ok else failed).append(what)
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    return ok


def load_dags():
    spec = importlib.util.spec_from_file_location("airflow_dag", DAG_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_dag(dag, label: str) -> dict:
    """One dag.test() run: {workflow file name or task id: (state, try_number)}."""
    t0 = time.monotonic()
    dr = dag.test()
    took = time.monotonic() - t0
    timings.append((f"{dag.dag_id} ({label})", took))
    files = sorted(p.name for p in WF_DIR.glob("*.toml"))
    out: dict[str, tuple[str, int]] = {}
    for ti in dr.get_task_instances():
        key = ti.task_id.split(".")[-1]
        if ti.map_index is not None and ti.map_index >= 0:
            key += f"[{files[ti.map_index] if ti.map_index < len(files) else ti.map_index}]"
        out[key] = (str(ti.state), ti.try_number)
    print(f"     {dag.dag_id} ({label}, {took:.1f}s): run {dr.state}: {out}", flush=True)
    return out


def state(tis: dict, key: str) -> str:
    return tis.get(key, ("missing", 0))[0]


def main() -> None:
    mod = load_dags()
    stream_dag, backfill_dag, silver_dag, maintain_dag = mod.stream_dag, mod.backfill_dag, mod.silver_dag, mod.maintain_dag
    chunked = simlib.Table(ROOT, WF_DIR, "chunked_orders", rows=6000, mode="chunked", chunk_rows=300, seed=1, rows_per_s=2000)
    full = simlib.Table(ROOT, WF_DIR, "full_orders", rows=3000, mode="full", seed=2)
    C, F = "chunked_orders.toml", "full_orders.toml"
    bg = simlib.Background([chunked, full])
    try:
        # 1. The first stream run opens the chunked snapshot and streams from
        #    its S; the full table's bootstrap is the backfill DAG's.
        tis = run_dag(stream_dag, "first")
        check(state(tis, f"stream[{C}]") == "success", "stream DAG: the chunked table's first stream opens its snapshot")
        check(state(tis, f"stream[{F}]") == "skipped", "stream DAG: the full table's stream is skipped while its full bootstrap is due")
        check(chunked.status()["machine"]["state"] in ("chunked_opened", "chunked_planned"), "the chunked table has an open chunked snapshot")

        # 2. The backfill DAG reads the full snapshot and the first waves.
        tis = run_dag(backfill_dag, "first")
        check(state(tis, f"backfill[{C}]") == "success" and state(tis, f"backfill[{F}]") == "success", "backfill DAG: both tables' tasks succeed")
        check(full.status().get("snapshot") is not None, "the full table's bootstrap snapshot is complete after the backfill DAG")

        # 3. Silver while the chunked snapshot is still open: apply both,
        #    reconcile the full table only.
        open_now = bool(chunked.status().get("open_snapshots"))
        tis = run_dag(silver_dag, "snapshot open")
        check(state(tis, f"apply[{C}]") == "success" and state(tis, f"apply[{F}]") == "success", "silver DAG: apply succeeds for both tables")
        check(state(tis, f"reconcile[{F}]") == "success", "silver DAG: the full table is reconciled")
        check(open_now, "after one bounded backfill call the chunked snapshot is still open (later runs go on)")
        if open_now:
            check(state(tis, f"reconcile[{C}]") == "skipped", "silver DAG: reconcile is skipped while the chunked snapshot is open")

        # 4. A dropped connection on the chunked table's source: exit 75, and
        #    Airflow retries the task (retry_delay is 1 s here).
        simlib.cdc("sim", "fault", "--db", str(chunked.db), "--on", "any", "--times", "1")
        tis = run_dag(stream_dag, "source fault")
        st, tries = tis.get(f"stream[{C}]", ("missing", 0))
        check(st == "success" and tries == 2, f"stream DAG: exit 75 retried once and then succeeded (state {st}, try {tries})")
        check(state(tis, f"stream[{F}]") == "success", "stream DAG: the full table streams after its snapshot")

        # 5. Backfill and stream runs side by side in time, until the chunked
        #    snapshot is complete (at most 30 rounds).
        for i in range(30):
            if not chunked.status().get("open_snapshots"):
                break
            tis = run_dag(backfill_dag, f"round {i}")
            if state(tis, f"backfill[{C}]") != "success":
                break
            run_dag(stream_dag, f"round {i}")
        check(not chunked.status().get("open_snapshots"), "the chunked snapshot is complete after bounded backfill runs")

        # 6. Writers and the capture job stop (after a last capture); a last
        #    stream and silver run catch up and reconcile both tables.
        bg.stop()
        tis = run_dag(stream_dag, "caught up")
        check(all(state(tis, f"stream[{n}]") == "success" for n in (C, F)), "stream DAG: both tables stream")
        # The daily upkeep, before the last silver run: every table's task
        # succeeds and facts ends compacted (its log holds the compaction's
        # txn); the silver run and the binary's checks below then run on
        # the compacted tables.
        tis = run_dag(maintain_dag, "caught up")
        check(all(state(tis, f"maintain[{n}]") == "success" for n in (C, F)), "maintain DAG: both tables' upkeep succeeds")
        for t in (chunked, full):
            log = "".join(p.read_text() for p in sorted((t.lake / "facts" / "_delta_log").glob("*.json")))
            check('"appId":"mssql-cdc.maintain.compact"' in log, f"maintain DAG: {t.name}'s facts were compacted")
        tis = run_dag(silver_dag, "caught up")
        check(all(state(tis, f"{s}[{n}]") == "success" for n in (C, F) for s in ("apply", "reconcile")), "silver DAG: apply and reconcile succeed for both tables")
        for t in (chunked, full):
            problems = simlib.check_caught_up(t)
            check(not problems, f"binary check of {t.name}: streamed, snapshot complete, applied, reconcile clean" + (f": {problems}" if problems else ""))

        # 7. A bad workflow file beside them: its tasks fail at once (exit 2),
        #    on the first try, the others succeed. From here the folder comes
        #    from MSSQL_CDC_WORKFLOWS, the Airflow Variable being unset.
        os.environ.pop("AIRFLOW_VAR_MSSQL_CDC_WORKFLOWS", None)
        bad = WF_DIR / "bad_orders.toml"
        # A typo in a value: the binary refuses the file (exit 2) before anything is written.
        bad.write_text(chunked.workflow.read_text().replace('"chunked_orders"', '"bad_orders"').replace('mode = "chunked"', 'mode = "chunkd"'))
        B = bad.name
        try:
            mod.run(str(bad), "status")
            check(False, "runner: exit 2 raises AirflowFailException")
        except mod.AirflowFailException as e:
            msg = str(e)
            check("bad_orders.toml" in msg and "exit 2" in msg and "chunkd" in msg, f"runner: exit 2 raises AirflowFailException naming the file and the error ({msg[:160]}...)")
        for dag, tasks in ((stream_dag, ["stream"]), (backfill_dag, ["backfill"]), (silver_dag, ["apply", "reconcile"]), (maintain_dag, ["maintain"])):
            tis = run_dag(dag, "bad file")
            st, tries = tis.get(f"{tasks[0]}[{B}]", ("missing", 0))
            check(st == "failed" and tries == 1, f"{dag.dag_id}: the bad file's {tasks[0]} fails on its first try, no retry (state {st}, try {tries})")
            others = [state(tis, f"{t}[{n}]") for t in tasks for n in (C, F)]
            check(all(s == "success" for s in others), f"{dag.dag_id}: the other tables' tasks succeed beside it ({others})")
            if len(tasks) > 1:
                check(state(tis, f"reconcile[{B}]") == "upstream_failed", f"{dag.dag_id}: the bad file's reconcile does not run after its failed apply")
        bad.unlink()
    except Exception:
        traceback.print_exc()
        check(False, "the test ran to its end without an exception")
    finally:
        bg.stop()

    print("\nAirflow DAG runs (dag.test):")
    for label, took in timings:
        print(f"  {took:6.1f}s  {label}")
    print(f"\nairflow: {len(passed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
