"""The workflow on object stores, through their real protocols.

For each store that honours conditional writes (S3 as moto serves it, Azure
Blob as Azurite serves it; tests/objstore/stores.py says how and why):

1. End to end, one writer: a chunked bootstrap, `stream`, `backfill` until
   the snapshot is done, more writes, `stream`, `apply`, `reconcile`. Judged
   by `reconcile` (silver against the simulator's own table) and by the
   store's own listing, read with the store's SDK: every table's first
   commit is on the store, and nothing was written to the local disk.
2. Credentials by reference: a workflow whose storage options hold a literal
   secret is refused (exit 2, naming the option and `env:`), and nothing is
   written to the store.
3. Two processes committing to one table at once: two workflows (two source
   tables, two bronze tables) share one facts table, and both stream a
   backlog of small batches at the same time. An outside reader of the facts
   table's Delta log (the commit files as the store holds them, not the
   program's reading of them) must find each stream's batches as `txn`
   actions, every batch id each call said it committed, once.

And the negative control: check 3 on a store that drops `If-None-Match`
(every put overwrites), with `target.single_writer = true` to get past the
refusal of such a store. There the same reader must find a lost commit
within a few rounds; if it never does, the check could not disagree and the
test fails. The control races six streams, not two: with two (each started
alone first), three rounds in a row on this store lost no commit, while
each of the first rounds with six lost some.

In check 3 each stream commits its start and first batch alone before the
race, so the race is between batch commits, which the reader counts. (Raced
from their first call on the overwriting store, one start replaced the
other every time, and the loser stopped itself with an internal error
before any batch: the reader had nothing to count.)

GCS is not tested: no emulator installable here honours preconditions, and
fake-gcs-server 1.54 refuses object_store's first XML put (README says more).

Run by tests/objstore/objstore_test.sh, which installs the stores. Exit 0
when every check held, 1 when one failed, 2 when it could not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import stores

BIN = os.environ["MSSQL_CDC_BIN"]
AZURITE = os.environ["AZURITE_BIN"]
failed = 0
passed = 0


def check(what: str, ok: bool, detail: str = "") -> bool:
    global failed, passed
    if ok:
        passed += 1
        print(f"ok   {what}")
    else:
        failed += 1
        print(f"FAIL {what}{': ' + detail if detail else ''}")
    return ok


def cdc(env: dict, *args: str) -> tuple[int, dict, str]:
    """Runs the binary: (exit code, JSON of its last stdout line, stderr)."""
    proc = subprocess.run([BIN, *args], capture_output=True, text=True, env=env)
    return parse(proc.returncode, proc.stdout, proc.stderr)


def parse(code: int, stdout: str, stderr: str) -> tuple[int, dict, str]:
    lines = stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        out = {"raw": lines[-1]}
    return code, out, stderr


def base_env(store: stores.Store) -> dict:
    # The store's variables only: no AWS_* or AZURE_* from the machine, which
    # the store clients would otherwise read on their own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AZURE_", "GOOGLE_"))}
    env.update(store.env)
    env["MSSQL_CDC_LOG"] = "warn"
    env["MSSQL_CDC_PROGRESS"] = "0"
    return env


def make_table(env: dict, folder: Path, name: str, rows: int, transactions: int, seed: int) -> Path:
    db = folder / f"{name}.sqlite"
    for args in (
        ["sim", "create", "--db", str(db), "--table", f"dbo.{name}", "--preset", "orders", "--rows", str(rows),
         "--seed", str(seed)],
        ["sim", "write", "--db", str(db), "--tx-per-s", "0", "--transactions", str(transactions), "--seed", str(seed)],
        ["sim", "capture", "--db", str(db)],
    ):
        code, out, err = cdc(env, *args)
        if code != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {code} {out} {err[-500:]}")
    return db


def toml_options(options: dict) -> str:
    return "".join(f'{k} = "{v}"\n' for k, v in options.items())


def workflow(folder: Path, store: stores.Store, bucket: str, app: str, db: Path, table: str, facts: str,
             snapshot: str, options: dict | None = None, stream: str = "", target: str = "") -> Path:
    path = folder / f"{app}.toml"
    path.write_text(
        f'app_id = "{app}"\n'
        f'[source]\nurl = "sim://{db}"\n'
        f'[table]\nschema = "dbo"\nname = "{table}"\n'
        f'[target]\nbronze = "{store.url(bucket, f"lake/{app}/bronze")}"\n'
        f'facts = "{store.url(bucket, facts)}"\n'
        f'silver = "{store.url(bucket, f"lake/{app}/silver")}"\n{target}'
        f"[target.storage_options]\n{toml_options(options if options is not None else store.options)}"
        f"{snapshot}"
        f"[stream]\n{stream or 'max_batch_rows = 200'}\n"
        f"[reconcile]\ncapture_wait_seconds = 10\n"
    )
    return path


CHUNKED = '[snapshot]\nbootstrap = true\nmode = "chunked"\nchunk_rows = 400\nparallelism = 2\ntarget_wave_seconds = 0\n'
NO_SNAPSHOT = "[snapshot]\nbootstrap = false\n"


def end_to_end(store: stores.Store, tmp: Path) -> None:
    """Check 1 and 2."""
    env = base_env(store)
    folder = tmp / f"e2e-{store.kind}"
    folder.mkdir()
    bucket = f"e2e-{store.kind}"
    store.make_bucket(bucket)
    db = make_table(env, folder, "orders", rows=2000, transactions=50, seed=3)
    wf = workflow(folder, store, bucket, "orders", db, "orders", "lake/ops/facts", CHUNKED)
    step = lambda *a: cdc(env, "--workflow", str(wf), *a)  # noqa: E731

    code, out, err = step("stream")
    check(f"{store.name}: the first stream opens a chunked snapshot",
          code == 0 and (out.get("bootstrap") or {}).get("opened_now") is True, f"exit {code} {out} {err[-800:]}")
    code, out, err = cdc(env, "sim", "write", "--db", str(db), "--tx-per-s", "0", "--transactions", "300", "--seed", "4")
    cdc(env, "sim", "capture", "--db", str(db))
    code, out, err = step("stream")
    check(f"{store.name}: stream commits batches while the snapshot is open",
          code == 0 and out.get("batches", 0) > 0, f"exit {code} {out} {err[-800:]}")
    done, calls = False, 0
    while not done and calls < 20:
        calls += 1
        code, out, err = step("backfill")
        if code not in (0, 75):
            break
        done = out.get("done") is True
    check(f"{store.name}: backfill reads every chunk", done,
          f"after {calls} calls: exit {code} {out} {err[-800:]}")
    cdc(env, "sim", "write", "--db", str(db), "--tx-per-s", "0", "--transactions", "100", "--seed", "5")
    cdc(env, "sim", "capture", "--db", str(db))
    code, out, err = step("stream")
    check(f"{store.name}: stream after the snapshot", code == 0 and out.get("batches", 0) > 0, f"exit {code} {out}")
    code, out, err = step("apply")
    check(f"{store.name}: apply", code == 0 and out.get("silver_version") is not None, f"exit {code} {out} {err[-800:]}")
    code, out, err = step("reconcile")
    check(f"{store.name}: reconcile finds silver equal to the source table",
          code == 0 and out.get("clean") is True and out.get("rows_source") == out.get("rows_target") and out.get("rows_source", 0) > 0,
          f"exit {code} {out} {err[-800:]}")
    keys = store.keys(bucket, "lake/")
    for table in ("lake/orders/bronze", "lake/ops/facts", "lake/orders/silver", "lake/orders/silver_control",
                  "lake/orders/silver_reconcile", "lake/orders/bronze_snapshot_plans"):
        first = f"{table}/_delta_log/00000000000000000000.json"
        check(f"{store.name}: {table} is a Delta table on the store", first in keys,
              f"{len(keys)} keys, none is {first}")
    data_files = [k for k in keys if k.startswith("lake/orders/bronze/") and k.endswith(".parquet")]
    check(f"{store.name}: bronze's data files are on the store", len(data_files) > 0, f"{keys[:20]}")
    probes = [k for k in keys if "_mssql_cdc_put_check" in k]
    check(f"{store.name}: the put-if-absent probe left one object, in bronze's log folder",
          probes == ["lake/orders/bronze/_delta_log/_mssql_cdc_put_check"], f"{probes}")
    local = [p for p in folder.rglob("*") if "_delta_log" in p.parts or p.suffix == ".parquet"]
    check(f"{store.name}: nothing of the tables was written to the local disk", not local, f"{local[:5]}")

    # 2. A literal secret: refused before anything is written.
    literal = dict(store.options)
    secret_key = "AWS_SECRET_ACCESS_KEY" if store.kind == "s3" else "AZURE_STORAGE_ACCOUNT_KEY"
    secret = store.env.get("OBJSTORE_TEST_SECRET", store.env.get("OBJSTORE_TEST_ACCOUNT_KEY"))
    literal[secret_key] = secret
    wf2 = workflow(folder, store, bucket, "leaky", db, "orders", "lake/leaky/facts", CHUNKED, options=literal)
    code, out, err = cdc(env, "--workflow", str(wf2), "stream")
    message = json.dumps(out) + err
    check(f"{store.name}: a literal secret in storage_options exits 2, naming the option and env:, never the value",
          code == 2 and secret_key.lower() in message.lower() and "env:" in message and bool(secret) and secret not in message,
          f"exit {code} {out}")
    leaked = store.keys(bucket, "lake/leaky/")
    check(f"{store.name}: the refused workflow wrote nothing to the store", not leaked, f"{leaked[:5]}")


def facts_batches(store: stores.Store, bucket: str, facts: str) -> tuple[dict[str, list[int]], int]:
    """The outside reader: every commit file of the facts table as the store
    holds it; for each stream, the batch ids of its `<app>#facts` txn
    actions, in the order the commits hold them (a repeat stays a repeat)."""
    prefix = f"{facts}/_delta_log/"
    names = sorted(k for k in store.keys(bucket, prefix) if re.fullmatch(r"\d{20}\.json", k[len(prefix):]))
    batches: dict[str, list[int]] = {}
    for name in names:
        for line in store.read(bucket, name).decode().splitlines():
            txn = json.loads(line).get("txn") if line.strip() else None
            if txn and txn["appId"].endswith("#facts"):
                batches.setdefault(txn["appId"][: -len("#facts")], []).append(txn["version"])
    return batches, len(names)


WRITERS = ("east", "west", "north", "south", "up", "down")


def two_writers(store: stores.Store, tmp: Path, round_no: int, target: str = "", writers: int = 2,
                transactions: int = 300) -> tuple[bool, bool, str]:
    """Check 3's race, between `writers` streams: (every check held, a batch
    a call said it committed is missing from the log or there twice, what
    was found)."""
    env = base_env(store)
    folder = tmp / f"race-{store.kind}-{round_no}-{int(time.time() * 1000)}"
    folder.mkdir()
    bucket = f"race{round_no}-{folder.name[-6:]}"
    store.make_bucket(bucket)
    facts = "lake/ops/facts"
    apps = {}
    for i, app in enumerate(WRITERS[:writers]):
        db = make_table(env, folder, app, rows=0, transactions=transactions, seed=10 + i)
        apps[app] = workflow(folder, store, bucket, app, db, app, facts, NO_SNAPSHOT,
                             stream='start = "earliest"\nmax_batch_rows = 10\n', target=target)
    # Each stream's start and first batch are committed alone first, so the
    # race is between batch commits, whose ids an outside reader can count
    # (on a store that overwrites, a start lost to the other writer's commit
    # is caught by the stream itself, as an internal error, and shows nothing
    # about the reader's check).
    for app, wf in apps.items():
        code, out, err = cdc(env, "--workflow", str(wf), "stream", "--max-batches", "1")
        if code != 0 or out.get("batches") != 1:
            return False, False, f"{app}'s first batch, alone: exit {code} {out} {err[-300:]}"
    procs = {
        app: subprocess.Popen([BIN, "--workflow", str(wf), "stream"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
        for app, wf in apps.items()
    }
    results = {}
    for app, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        results[app] = parse(proc.returncode, stdout, stderr)
    found, commits = facts_batches(store, bucket, facts)
    problems = []
    lost = False
    for app, (code, out, err) in results.items():
        said = 1 + out["batches"] if code == 0 and "batches" in out else None
        ids = found.get(app, [])
        if said is None:
            problems.append(f"{app}: exit {code} {out} {err[-300:]}")
        elif sorted(ids) != list(range(len(ids))) or len(ids) != said:
            lost = True
            missing = sorted(set(range(max(ids, default=-1) + 1)) - set(ids))
            problems.append(f"{app}: said {said} batches, the log holds {len(ids)} (missing {missing[:10]}, "
                            f"repeated {len(ids) - len(set(ids))})")
    detail = f"{commits} commits; " + ("; ".join(problems) if problems else
                                         ", ".join(f"{a}: {len(found.get(a, []))} batches" for a in apps))
    if not problems:
        # The streams' own view agrees, and silver is the source table.
        for app, wf in apps.items():
            for stepname in ("apply", "reconcile"):
                code, out, err = cdc(env, "--workflow", str(wf), stepname)
                if code != 0 or (stepname == "reconcile" and out.get("clean") is not True):
                    problems.append(f"{app} {stepname}: exit {code} {out} {err[-300:]}")
        if problems:
            detail += "; " + "; ".join(problems)
    return not problems, lost, detail


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="mssql-cdc-objstore."))
    started = []
    try:
        s3 = stores.start_s3(str(tmp))
        azure = stores.start_azure(str(tmp), AZURITE)
        overwriting = stores.start_s3(str(tmp), overwriting=True)
        started += [s3, azure, overwriting]
        for store in (s3, azure):
            t0 = time.monotonic()
            end_to_end(store, tmp)
            ok, _, detail = two_writers(store, tmp, 0)
            check(f"{store.name}: two processes commit to one facts table at once, no commit lost", ok, detail)
            print(f"     {store.name}: {detail}; {time.monotonic() - t0:.1f}s")
        # A store that drops If-None-Match is refused before a table is made.
        refused = tmp / "refused"
        refused.mkdir()
        overwriting.make_bucket("refused")
        env = base_env(overwriting)
        db = make_table(env, refused, "orders", rows=100, transactions=5, seed=7)
        wf = workflow(refused, overwriting, "refused", "orders", db, "orders", "lake/ops/facts", CHUNKED)
        code, out, err = cdc(env, "--workflow", str(wf), "stream")
        check(f"{overwriting.name}: a store without conditional puts is refused (exit 2, naming target.single_writer)",
              code == 2 and "single_writer" in json.dumps(out), f"exit {code} {out} {err[-500:]}")
        left = [k for k in overwriting.keys("refused", "") if "_delta_log/0" in k or k.endswith(".parquet")]
        check(f"{overwriting.name}: the refused call created no table", not left, f"{left[:5]}")
        # The negative control: the same race where puts overwrite, which the
        # user allowed by saying no two steps run at once (and then broke).
        # Only a batch missing from the log (or there twice) counts: a call
        # failing for another reason would show nothing about the check.
        seen = []
        for round_no in range(4):
            _, lost, detail = two_writers(overwriting, tmp, round_no, target="single_writer = true\n", writers=6,
                                          transactions=100)
            seen.append(detail)
            if lost:
                break
        check(f"{overwriting.name}: the same check finds a lost commit when the store drops If-None-Match",
              lost, " | ".join(seen))
        print(f"     {overwriting.name}: {seen[-1]}")
    finally:
        for s in started:
            s.stop()
        if failed == 0 and os.environ.get("KEEP") != "1":
            subprocess.run(["rm", "-rf", str(tmp)])
        else:
            print(f"kept {tmp}")
    print(f"objstore_test: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
