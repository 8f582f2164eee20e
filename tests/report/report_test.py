"""`report --out DIR` checked in a browser: the pages are drawn by headless
Chromium (driven by Playwright) and every chart is checked against figures
the test gathers itself from the steps' own JSON, not from the report.

The scenario: `orders`, a chunked bootstrap read in bounded backfill calls
with stream calls and writes between them, then applied and reconciled
twice; `items`, a full bootstrap and two stream calls; and `ghost`, a fleet
entry whose facts path is another kind of Delta table. The checks:

- `--workflow orders.toml report --out A`: its page and an index of one.
- `--fleet F --all report --out B`: exit 2 (ghost's error, the others
  written), an index line per table, ghost's naming its facts path.
- In Chromium, from B/index.html: the link opens orders' page; every chart
  is laid out on the page; the rows-per-batch chart has one mark per batch
  the stream calls said they committed, and its values sum to the rows they
  said they wrote; the wave charts have one mark per wave the backfill calls
  read, summing to the rows they read; one reconcile mark per run, green
  when the run was clean; the lag and headroom charts a mark per batch.
  Every mark is hit by the browser at its own centre (painted, not hidden).
  items' page says it has no wave and lists its bootstrap with the rows the
  snapshot said it read.
- The page loads nothing from the network and runs no script.

A screenshot of each page is written to $REPORT_SCREENSHOTS (default: the
temp dir), for a person to look at.

Exit 0 when every check held, 1 when one failed.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflows" / "test"))
import simlib  # noqa: E402
from simlib import cdc  # noqa: E402

from playwright.sync_api import sync_playwright  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
check = simlib.Checks()


def writes(t: simlib.Table, n: int, seed: int) -> None:
    cdc("sim", "write", "--db", str(t.db), "--tx-per-s", "0", "--transactions", str(n), "--seed", str(seed))
    cdc("sim", "capture", "--db", str(t.db))


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="mssql-cdc-report."))
    shots = Path(os.environ.get("REPORT_SCREENSHOTS", root))
    shots.mkdir(parents=True, exist_ok=True)
    wf_dir = root / "workflows"
    wf_dir.mkdir()
    orders = simlib.Table(root, wf_dir, "orders", 3000, "chunked", chunk_rows=400, seed=3)
    items = simlib.Table(root, wf_dir, "items", 500, "full", seed=4)

    # What the steps say they did: the figures the charts must show.
    batches = rows_streamed = waves = wave_rows = headroom_batches = 0
    reconcile_runs: list[bool] = []
    cleaned = False

    def stream(t: simlib.Table) -> dict:
        nonlocal batches, rows_streamed, headroom_batches
        _, out, _ = t.step("stream")
        if t is orders:
            batches += out["batches"]
            rows_streamed += out["rows"]
            # A batch records its headroom once the instance's min LSN has a
            # commit time: after the cleanup below (before it, the min LSN
            # is the instance's start, which maps to no time).
            headroom_batches += out["batches"] if cleaned else 0
        return out

    opened = stream(orders)  # opens the chunked bootstrap
    seed = 100
    for _ in range(40):
        writes(orders, 4, seed)
        seed += 1
        stream(orders)
        code, out, err = orders.step("backfill", "--max-waves", "1", check=False)
        if code not in (0, 75):
            raise RuntimeError(f"backfill exit {code}: {out} {err[-1000:]}")
        waves += out.get("waves", 0)
        wave_rows += out.get("rows", 0)
        if out.get("done"):
            break
    # The capture job's cleanup up to the snapshot's LSN (the stream is past it).
    cdc("sim", "cleanup", "--db", str(orders.db), "--to-lsn", opened["bootstrap"]["snapshot_lsn"])
    cleaned = True
    for _ in range(3):
        writes(orders, 6, seed)
        seed += 1
        stream(orders)
    orders.step("apply")
    for _ in range(2):
        code, out, _ = orders.step("reconcile", check=False)
        reconcile_runs.append(bool(out.get("clean")))
    _, boot, _ = items.step("stream")
    items_rows = boot["bootstrap"]["rows"]
    writes(items, 3, 7)
    items.step("stream")
    check(f"the scenario: {batches} orders batches with {rows_streamed} rows, {waves} waves with {wave_rows} rows, reconcile runs {reconcile_runs}",
          batches >= 4 and rows_streamed > 0 and headroom_batches >= 3 and waves >= 2 and wave_rows > 0 and len(reconcile_runs) == 2)

    # One workflow.
    out_a = root / "report-a"
    code, one, err = cdc("--workflow", str(orders.workflow), "report", "--out", str(out_a), check=False)
    check("--workflow report exits 0 and names its page and index",
          code == 0 and Path(one.get("page", "")).is_file() and Path(one.get("index", "")).is_file(), f"exit {code}: {one} {err[-500:]}")
    check("its summary counts the batches the stream calls committed",
          one.get("summary", {}).get("batches") == batches and one.get("summary", {}).get("rows_streamed") == rows_streamed, json.dumps(one.get("summary")))

    # A fleet: the two tables and one whose facts path is silver (another kind of table).
    fleet = root / "fleet.toml"
    lake = root / "lake"
    fleet.write_text(
        "[fleet]\nmax_source_connections = 4\n"
        "[defaults]\n"
        'app_id = "{table}"\n'
        f'source.url = "sim://{root}/{{table}}.sqlite"\n'
        f'target.bronze = "{lake}/{{table}}/bronze"\n'
        f'target.facts = "{lake}/{{table}}/facts"\n'
        f'target.silver = "{lake}/{{table}}/silver"\n'
        'snapshot.mode = "chunked"\nsnapshot.parallelism = 2\nsnapshot.chunk_rows = 400\n'
        '[[tables]]\nname = "dbo.orders"\n'
        '[[tables]]\nname = "dbo.items"\nsnapshot.mode = "full"\n'
        '[[tables]]\nname = "dbo.ghost"\n'
        f'target.facts = "{lake}/orders/silver"\n'
    )
    out_b = root / "report-b"
    code, many, err = cdc("--fleet", str(fleet), "--all", "report", "--out", str(out_b), check=False)
    per = {t["table"]: t for t in many.get("tables", [])}
    check("--fleet --all report exits 2 for the ghost's bad facts path, the others written",
          code == 2 and many.get("succeeded") == 2 and per.get("dbo.ghost", {}).get("exit_code") == 2, f"exit {code}: {json.dumps(many)[:800]}")
    ghost_error = per.get("dbo.ghost", {}).get("result", {}).get("error", "")
    check("the ghost's error names its facts path and the kind it is", "orders/silver" in ghost_error and "facts" in ghost_error, ghost_error)
    check("the fleet's index is written", (out_b / "index.html").is_file())

    html_b = (out_b / "orders.html").read_text()
    check("the page runs no script and loads nothing", "<script" not in html_b and "<link" not in html_b and "src=" not in html_b and "url(" not in html_b)

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )
        page = browser.new_page(viewport={"width": 1000, "height": 900})
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto((out_b / "index.html").as_uri())
        lines = page.locator("#tables tr").count() - 1
        check("the index has a line per table", lines == 3, f"{lines} lines")
        ghost_line = page.locator("#tables tr.bad", has_text="dbo.ghost")
        check("the index's ghost line shows its error", ghost_line.count() == 1 and "facts" in ghost_line.inner_text(), ghost_line.inner_text() if ghost_line.count() else "no line")
        # An app id is read whole: the index never breaks one across lines,
        # even in a window too narrow for the table (an inline element has
        # one client rect per line it spans). With `word-break: break-all`
        # on every code cell, a narrow window broke them mid-word.
        page.set_viewport_size({"width": 480, "height": 900})
        spans = page.evaluate("() => [...document.querySelectorAll('#tables td code')].slice(0, 3).map(c => [c.textContent, c.getClientRects().length])")
        page.set_viewport_size({"width": 1000, "height": 900})
        check("the index shows each app id on one line in a narrow window", len(spans) == 3 and all(n == 1 for _, n in spans), f"{spans}")
        page.screenshot(path=str(shots / "index.png"), full_page=True)
        page.click("#tables a:text-is('dbo.orders')")
        page.wait_for_load_state()
        check("the index's link opens orders' page", page.url.endswith("/orders.html"), page.url)

        def marks(chart: str) -> list[dict]:
            """The marks of a chart: value, class, their box, and whether the
            element the browser hits at the box's centre is the mark."""
            return page.evaluate(
                """(id) => {
                    const svg = document.getElementById(id);
                    if (!svg) return null;
                    svg.scrollIntoView();
                    return [...svg.querySelectorAll('.mark')].map(m => {
                        const b = m.getBoundingClientRect();
                        const hit = document.elementFromPoint(b.x + b.width / 2, b.y + b.height / 2);
                        return {value: parseFloat(m.dataset.value), cls: m.getAttribute('class'), w: b.width, h: b.height,
                                hit: hit === m || (hit !== null && m.contains(hit))};
                    });
                }""",
                chart,
            )

        charts = {}
        for chart in ["lag", "rows", "headroom", "wave-rows", "wave-throughput", "reconcile-runs"]:
            box = page.locator(f"svg#{chart}").bounding_box() if page.locator(f"svg#{chart}").count() == 1 else None
            check(f"orders: chart {chart} is laid out", box is not None and box["width"] > 400 and box["height"] > 80, str(box))
            charts[chart] = marks(chart) or []
            unhit = [m for m in charts[chart] if not (m["w"] >= 1 and m["h"] >= 1 and m["hit"])]
            check(f"orders: each of chart {chart}'s {len(charts[chart])} marks is painted where the browser hits it", charts[chart] != [] and not unhit, str(unhit[:3]))
        rows = charts["rows"]
        check(f"orders: rows per batch has a mark per batch committed ({batches})", len(rows) == batches, f"{len(rows)} marks")
        check(f"orders: its values sum to the rows the stream calls wrote ({rows_streamed})", sum(m["value"] for m in rows) == rows_streamed, str(sum(m["value"] for m in rows)))
        check(f"orders: lag has a mark per batch, headroom one per batch after the cleanup ({headroom_batches})",
              len(charts["lag"]) == batches and len(charts["headroom"]) == headroom_batches, f"{len(charts['lag'])}, {len(charts['headroom'])}")
        wr = charts["wave-rows"]
        check(f"orders: rows per wave has a mark per wave read ({waves}), summing to the rows the backfill calls read ({wave_rows})",
              len(wr) == waves and sum(m["value"] for m in wr) == wave_rows, f"{len(wr)} marks, {sum(m['value'] for m in wr)} rows")
        check("orders: throughput per wave has a mark per wave, each above zero", len(charts["wave-throughput"]) == waves and all(m["value"] > 0 for m in charts["wave-throughput"]))
        rec = charts["reconcile-runs"]
        check("orders: a reconcile mark per run, coloured by its verdict",
              [("ok" in m["cls"]) for m in rec] == reconcile_runs and [("bad" in m["cls"]) for m in rec] == [not c for c in reconcile_runs], str(rec))
        events = page.locator("#event-list tr").all_inner_texts()
        check("orders: the events list the snapshot's open and its completion (bootstrap)",
              any(e.startswith("snapshot_open") for e in events) and any(e.startswith("bootstrap") for e in events), str(events))
        page.screenshot(path=str(shots / "orders.png"), full_page=True)

        page.goto((out_b / "items.html").as_uri())
        body = page.inner_text("body")
        check("items: a full snapshot has no wave, and says so", page.locator("svg#wave-rows").count() == 0 and "No chunked snapshot wave yet" in body)
        done = page.locator("h3:text-is('Completed snapshots') + table tr", has_text="bootstrap").all_inner_texts()
        check(f"items: its bootstrap is listed with the {items_rows} rows the snapshot read",
              len(done) == 1 and f"{items_rows}" in done[0].replace(",", ""), str(done))
        page.screenshot(path=str(shots / "items.png"), full_page=True)
        browser.close()
    external = [u for u in requests if not u.startswith("file://")]
    check("the browser fetched nothing but the pages' files", not external, str(external[:5]))

    return check.summary("report_test", f"; screenshots in {shots}")


if __name__ == "__main__":
    sys.exit(main())
