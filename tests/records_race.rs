//! The concurrency rules of adr-0028 and adr-0018 that no other test held
//! open (docs/CONFORMANCE.md rows 28.52, 28.82 full direction, 28.83, 28.96,
//! 28.97, 28.112, 18.26), each driven in process on the simulator.
//!
//! Every race is made certain, not hoped for, with `common::gate`: the
//! test waits until one call is held at a failpoint, runs the other call to
//! its end (or changes the source), then opens the gate. Failpoints armed in
//! process are process-global, so this file is a test binary of its own, and
//! each test holds `fail::FailScenario` (one test at a time, failpoints
//! cleared).
//!
//! Checks read the simulator's own rows and the Delta tables themselves
//! (bronze's rows per chunk, the facts rows, the plans rows, silver), opened
//! straight from their folders; bronze's image is rebuilt here in SQL by the
//! records' rule, so no engine helper checks itself.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::gate::{failpoints_and_runtime, start_held, wait_until, Gate};
use common::model::{delta_rows, source_rows};
use common::{table_rows_by_id as table_rows, Scenario};
use deltalake::arrow::array::{Array, Int64Array, StringArray};
use mssql_cdc::delta::facts::{self, FactRow};
use mssql_cdc::delta::plans::{self, PlanRow};
use mssql_cdc::engine::chunked::{self, BackfillArgs, BackfillResult, OpenResult};
use mssql_cdc::engine::{self, apply};
use mssql_cdc::error::{StepError, StepResult};
use mssql_cdc::lsn::Lsn;
use mssql_cdc::sim::FaultOn;
use mssql_cdc::source::SourceError;
use mssql_cdc::types::SqlValue;

const DAY: Duration = Duration::from_secs(24 * 3600);

const CHUNKED: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                       [stream]\nmax_batch_rows = 1000\n";
/// One connection: each wave is one chunk, and the reader reads chunk n+1
/// while chunk n's wave commits.
const CHUNKED_ONE_READER: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 1\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                                  [stream]\nmax_batch_rows = 1000\n";
const CHUNKED_SILVER: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\n\
                              target_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n";
const FULL_RESNAPSHOT: &str =
    "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";

// ---------------------------------------------------------------------------
// The steps, each on a fresh context of the workflow file (as a process would).

async fn backfill_at(wf: PathBuf, args: BackfillArgs) -> StepResult<BackfillResult> {
    let mut ctx = engine::open_workflow(&wf).await?;
    chunked::backfill(&mut ctx, &args).await
}

async fn open_chunked_at(wf: PathBuf) -> StepResult<Option<OpenResult>> {
    let mut ctx = engine::open_workflow(&wf).await?;
    chunked::ensure_bootstrap_open(&mut ctx).await
}

async fn full_bootstrap_at(wf: PathBuf) -> StepResult<engine::snapshot::SnapshotResult> {
    let mut ctx = engine::open_workflow(&wf).await?;
    engine::snapshot::ensure_bootstrap(&mut ctx).await
}

async fn stream_at(wf: PathBuf) -> StepResult<engine::stream::StreamResult> {
    let mut ctx = engine::open_workflow(&wf).await?;
    engine::coarse::stream(&mut ctx).await
}

async fn apply_at(wf: PathBuf) -> StepResult<apply::ApplyResult> {
    let mut ctx = engine::open_workflow(&wf).await?;
    apply::run(&mut ctx).await
}

fn one_wave() -> BackfillArgs {
    BackfillArgs { max_waves: Some(1), ..Default::default() }
}

fn backfill_until_done(rt: &tokio::runtime::Runtime, wf: &Path) {
    for _ in 0..50 {
        if rt.block_on(backfill_at(wf.to_path_buf(), BackfillArgs::default())).unwrap().done {
            return;
        }
    }
    panic!("backfill did not finish in 50 calls");
}

// ---------------------------------------------------------------------------
// Reading the tables themselves.

fn location(s: &Scenario, table: &str) -> String {
    s.path().join(table).to_string_lossy().into_owned()
}

fn query(rt: &tokio::runtime::Runtime, location: &str, sql: &str) -> Vec<deltalake::arrow::record_batch::RecordBatch> {
    rt.block_on(async {
        let t = mssql_cdc::delta::open_existing(location, &Default::default()).await.unwrap().unwrap_or_else(|| panic!("{location} exists"));
        mssql_cdc::delta::query(&t, sql).await.unwrap()
    })
}

/// A query whose every column is a BIGINT (cast in the SQL), row by row.
fn int_rows(rt: &tokio::runtime::Runtime, location: &str, sql: &str) -> Vec<Vec<Option<i64>>> {
    let mut out = Vec::new();
    for b in query(rt, location, sql) {
        let cols: Vec<&Int64Array> =
            b.columns().iter().map(|c| c.as_any().downcast_ref::<Int64Array>().unwrap_or_else(|| panic!("not BIGINT: {sql}"))).collect();
        for i in 0..b.num_rows() {
            out.push(cols.iter().map(|c| (!c.is_null(i)).then(|| c.value(i))).collect());
        }
    }
    out
}

/// A query of one text column.
fn strings(rt: &tokio::runtime::Runtime, location: &str, sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    for b in query(rt, location, sql) {
        let c = b.column(0).as_any().downcast_ref::<StringArray>().unwrap_or_else(|| panic!("not text: {sql}"));
        out.extend((0..b.num_rows()).map(|i| c.value(i).to_string()));
    }
    out
}

fn facts_rows(rt: &tokio::runtime::Runtime, s: &Scenario) -> Vec<FactRow> {
    facts::from_batches(&query(rt, &location(s, "facts"), "SELECT * FROM t WHERE app_id = 'items'")).unwrap()
}

fn plan_rows(rt: &tokio::runtime::Runtime, s: &Scenario) -> Vec<PlanRow> {
    plans::from_batches(&query(rt, &location(s, "bronze_snapshot_plans"), "SELECT * FROM t")).unwrap()
}

fn events<'a>(rows: &'a [FactRow], name: &str) -> Vec<&'a FactRow> {
    rows.iter().filter(|r| r.event.as_deref() == Some(name)).collect()
}

/// S of the chunked open the facts record (exactly one).
fn chunked_open(rows: &[FactRow]) -> Lsn {
    let opens: Vec<&FactRow> = events(rows, "snapshot_open").into_iter().filter(|r| r.detail.as_ref().is_some_and(|d| d["mode"] == "chunked")).collect();
    assert_eq!(opens.len(), 1, "one chunked open: {opens:?}");
    opens[0].min_lsn.unwrap()
}

/// chunk -> (wave, rows) of every `snapshot_chunk` facts row of snapshot `s`
/// (a chunk recorded twice fails here).
fn chunk_facts(rows: &[FactRow], s: Lsn) -> BTreeMap<i64, (i64, i64)> {
    let mut out = BTreeMap::new();
    for r in events(rows, "snapshot_chunk") {
        let d = r.detail.as_ref().unwrap();
        if d["snapshot"] != s.to_hex().as_str() {
            continue;
        }
        let chunk = d["chunk"].as_i64().unwrap();
        assert!(out.insert(chunk, (d["wave"].as_i64().unwrap(), r.rows.unwrap())).is_none(), "chunk {chunk} has two facts rows");
    }
    out
}

/// chunk -> (rows, distinct ids, min id, max id) of bronze's rows of snapshot `s`.
fn bronze_chunks(rt: &tokio::runtime::Runtime, s: &Scenario, snap: Lsn) -> BTreeMap<Option<i64>, (i64, i64, i64, i64)> {
    let sql = format!(
        "SELECT CAST(_chunk AS BIGINT), CAST(COUNT(*) AS BIGINT), CAST(COUNT(DISTINCT id) AS BIGINT), CAST(MIN(id) AS BIGINT), \
         CAST(MAX(id) AS BIGINT) FROM t WHERE _operation = 0 AND _snapshot = '{}' GROUP BY _chunk",
        snap.to_hex()
    );
    int_rows(rt, &location(s, "bronze"), &sql).into_iter().map(|r| (r[0], (r[1].unwrap(), r[2].unwrap(), r[3].unwrap(), r[4].unwrap()))).collect()
}

/// An integer bound of the plan (`[{"t": "int", "v": n}]`), None when open.
fn bound(v: &serde_json::Value) -> Option<i64> {
    let key = v.as_array()?;
    let value: SqlValue = serde_json::from_value(key[0].clone()).unwrap();
    Some(value.as_i64().expect("an integer bound"))
}

/// The chunked snapshot at `snap` is recorded once and read once: one plan
/// (plans and facts), every planned chunk with exactly one facts row and one
/// plans row, bronze holding each chunk's rows once, inside the plan's
/// bounds, as many as its facts row says, and no chunk the facts do not
/// record. Returns the chunk count.
fn assert_each_chunk_once(rt: &tokio::runtime::Runtime, s: &Scenario, snap: Lsn) -> usize {
    let rows = facts_rows(rt, s);
    let prs: Vec<PlanRow> = plan_rows(rt, s).into_iter().filter(|r| r.snapshot == snap).collect();
    let plan: Vec<&PlanRow> = prs.iter().filter(|r| r.event == "snapshot_plan").collect();
    assert_eq!(plan.len(), 1, "one plans row of the plan");
    let planned = plan[0].detail["chunks"].as_array().unwrap().clone();
    let n = plan[0].detail["chunk_count"].as_u64().unwrap() as usize;
    assert_eq!(planned.len(), n);
    let facts_plan: Vec<&FactRow> =
        events(&rows, "snapshot_plan").into_iter().filter(|r| r.detail.as_ref().unwrap()["snapshot"] == snap.to_hex().as_str()).collect();
    assert_eq!(facts_plan.len(), 1, "one facts row of the plan");
    assert_eq!(facts_plan[0].detail.as_ref().unwrap()["chunk_count"].as_u64(), Some(n as u64), "the facts count the plan's chunks");

    let done = chunk_facts(&rows, snap);
    assert_eq!(done.keys().copied().collect::<Vec<_>>(), (0..n as i64).collect::<Vec<_>>(), "every planned chunk has one facts row");
    let mut plans_chunks: BTreeMap<i64, usize> = BTreeMap::new();
    for r in prs.iter().filter(|r| r.event == "snapshot_chunk") {
        *plans_chunks.entry(r.chunk.unwrap()).or_default() += 1;
    }
    assert_eq!(plans_chunks, (0..n as i64).map(|c| (c, 1usize)).collect::<BTreeMap<i64, usize>>(), "every planned chunk has one plans row");

    let in_bronze = bronze_chunks(rt, s, snap);
    for (chunk, (count, distinct, lo, hi)) in &in_bronze {
        let c = chunk.unwrap_or_else(|| panic!("bronze rows of snapshot {snap} without a chunk"));
        let (_, recorded) = done.get(&c).unwrap_or_else(|| panic!("bronze holds rows of chunk {c}, which no facts row records"));
        assert_eq!(count, recorded, "chunk {c}: bronze's rows are the facts row's");
        assert_eq!(count, distinct, "chunk {c}: an id twice in bronze");
        let p = planned.iter().find(|p| p["chunk"].as_i64() == Some(c)).unwrap();
        assert!(bound(&p["lo"]).is_none_or(|b| *lo >= b) && bound(&p["hi"]).is_none_or(|b| *hi < b), "chunk {c}: ids {lo}..={hi} outside its bounds {p}");
    }
    for (c, (_, recorded)) in &done {
        if !in_bronze.contains_key(&Some(*c)) {
            assert_eq!(*recorded, 0, "chunk {c}: the facts count rows bronze does not hold");
        }
    }
    let twice = int_rows(
        rt,
        &location(s, "bronze"),
        &format!("SELECT CAST(id AS BIGINT) FROM t WHERE _operation = 0 AND _snapshot = '{}' GROUP BY id HAVING COUNT(*) > 1", snap.to_hex()),
    );
    assert!(twice.is_empty(), "ids read by two chunks: {twice:?}");
    n
}

/// Bronze's image by the records' rule (`common::bronze_image_sql`).
fn bronze_image(rt: &tokio::runtime::Runtime, s: &Scenario, snapshot: Lsn) -> BTreeMap<i64, Vec<String>> {
    let columns = common::items_spec(&s.table).columns;
    common::image_by_id(&query(rt, &location(s, "bronze"), &common::bronze_image_sql(snapshot)), &columns)
}

/// Bronze's image from the newest completed snapshot equals the table, every
/// column, and no change row is in bronze twice. Returns that snapshot's S.
fn assert_bronze_equals_table(rt: &tokio::runtime::Runtime, s: &Scenario) -> Lsn {
    let rows = facts_rows(rt, s);
    let newest = common::newest_completion(&rows).expect("a completed snapshot");
    let image = bronze_image(rt, s, newest);
    let table = table_rows(s);
    common::assert_image_is_table(&table, &image);
    let twice = int_rows(
        rt,
        &location(s, "bronze"),
        "SELECT CAST(COUNT(*) AS BIGINT) FROM t WHERE _operation <> 0 GROUP BY _start_lsn, _seqval, _operation, _command_id HAVING COUNT(*) > 1",
    );
    assert!(twice.is_empty(), "change rows in bronze twice: {twice:?}");
    newest
}

/// Commits in a table's log.
fn log_commits(s: &Scenario, table: &str) -> usize {
    std::fs::read_dir(s.path().join(table).join("_delta_log"))
        .map(|d| d.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().ends_with(".json")).count())
        .unwrap_or(0)
}

/// Silver's rows (the columns named), read from its folder.
fn silver_rows(rt: &tokio::runtime::Runtime, s: &Scenario, columns: &[mssql_cdc::types::ColumnDesc]) -> common::model::Multiset {
    rt.block_on(delta_rows(&location(s, "silver"), columns, "true"))
}

fn stream_until_caught_up(rt: &tokio::runtime::Runtime, s: &Scenario) {
    rt.block_on(s.stream_until_caught_up());
}

/// The stream catches up; then each chunk of snapshot `snap` is recorded and
/// read once, and bronze's image from `snap`, the newest completed
/// snapshot, equals the table.
fn assert_caught_up_whole(rt: &tokio::runtime::Runtime, s: &Scenario, snap: Lsn) {
    stream_until_caught_up(rt, s);
    assert_each_chunk_once(rt, s, snap);
    assert_eq!(assert_bronze_equals_table(rt, s), snap);
}

// ---------------------------------------------------------------------------
// The rows.

/// 28.52: two first `backfill` calls plan the same snapshot at once. The
/// first is held after making its own plan (asking for chunks of 4 rows:
/// at least 10 chunks of 40 rows) and before recording it; the second plans
/// chunks of 10 rows, records that plan and commits wave 0. The held call's
/// plans append then finds Delta's txn taken, and it must go on with the
/// recorded plan read back, not its own: both calls end with the same
/// chunks, one plan is recorded, and bronze holds each chunk of that plan
/// once, inside its bounds.
#[test]
fn two_first_backfills_plan_at_once_and_both_go_on_with_the_recorded_plan() {
    let (_fp, rt) = failpoints_and_runtime();
    let s = Scenario::new(40, CHUNKED);
    rt.block_on(s.stream()).unwrap();
    let gate = Gate::hold("chunked.before_plan_plans", 1);
    let mut held = start_held(&gate, &s.wf_path, |wf| backfill_at(wf, BackfillArgs { chunk_rows: Some(4), ..Default::default() }));
    let first = rt.block_on(backfill_at(s.wf_path.clone(), one_wave())).unwrap();
    assert_eq!(first.waves, 1, "{first:?}");
    assert!(first.chunks_total < 10, "the recorded plan (10 rows a chunk) must differ from the held call's (4 rows a chunk): {first:?}");
    gate.open();
    let second = held.join().unwrap();
    assert!(second.done, "{second:?}");
    assert_eq!(second.chunks_total, first.chunks_total, "both calls end with the same plan");

    let rows = facts_rows(&rt, &s);
    let snap = chunked_open(&rows);
    let plan: Vec<PlanRow> = plan_rows(&rt, &s).into_iter().filter(|r| r.event == "snapshot_plan").collect();
    assert_eq!(plan.len(), 1, "one plan recorded: {plan:?}");
    assert_eq!(plan[0].detail["chunk_rows"], 10, "the recorded plan is the one that won the txn");
    assert_eq!(events(&rows, "snapshot_plan").len(), 1);
    assert_eq!(assert_each_chunk_once(&rt, &s, snap), first.chunks_total);
    stream_until_caught_up(&rt, &s);
    assert_eq!(assert_bronze_equals_table(&rt, &s), snap);
}

/// 28.82, the full direction: a full bootstrap passes its mode check and is
/// held before its open row; meanwhile a chunked open of generation 0 is
/// written. The full run's re-check after its own open row must stop it
/// (exit 2, naming the chunked open) before it reads or commits anything:
/// no bootstrap row, no snapshot row in bronze. The chunked snapshot then
/// completes and bronze equals the table.
#[test]
fn a_full_run_stops_when_a_chunked_open_appears_after_its_check() {
    let (_fp, rt) = failpoints_and_runtime();
    let s = Scenario::new(30, CHUNKED);
    let full_wf = s.path().join("items_full.toml");
    std::fs::write(&full_wf, std::fs::read_to_string(&s.wf_path).unwrap().replace("mode = \"chunked\"", "mode = \"full\"")).unwrap();
    let gate = Gate::hold("snapshot.before_open", 1);
    let mut full = start_held(&gate, &full_wf, full_bootstrap_at);
    let opened = rt.block_on(open_chunked_at(s.wf_path.clone())).unwrap().expect("a chunked open");
    assert!(opened.opened_now, "{opened:?}");
    gate.open();
    let e = full.join().expect_err("the full run stops beside the chunked open");
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains(&format!("a chunked snapshot opened at {}", opened.snapshot_lsn)), "{e}");

    let rows = facts_rows(&rt, &s);
    assert!(events(&rows, "bootstrap").is_empty(), "the full run completed nothing");
    let opens = events(&rows, "snapshot_open");
    let modes: BTreeSet<&str> = opens.iter().map(|r| r.detail.as_ref().unwrap()["mode"].as_str().unwrap()).collect();
    assert_eq!((opens.len(), modes), (2, BTreeSet::from(["chunked", "full"])), "the chunked open and the stopped run's open: {opens:?}");
    assert_eq!(chunked_open(&rows), opened.snapshot_lsn);
    assert_eq!(int_rows(&rt, &location(&s, "bronze"), "SELECT CAST(COUNT(*) AS BIGINT) FROM t WHERE _operation = 0"), vec![vec![Some(0)]], "no snapshot row in bronze");

    backfill_until_done(&rt, &s.wf_path);
    assert_caught_up_whole(&rt, &s, opened.snapshot_lsn);
}

/// 28.83: two chunked opens of generation 0 at once, at different S (the
/// source moves on between them). The first is held after its plans row;
/// the second records its open. The first's facts open then finds Delta's
/// txn (`#snapshots`, generation 0) taken and must use the other's open:
/// one `snapshot_open` row, both calls answer the same S, and the snapshot
/// completes at that S equal to the table.
#[test]
fn two_chunked_opens_of_one_generation_keep_one_and_both_use_it() {
    let (_fp, rt) = failpoints_and_runtime();
    let mut s = Scenario::new(30, CHUNKED);
    let gate = Gate::hold("chunked.after_open_plans", 1);
    let mut held = start_held(&gate, &s.wf_path, open_chunked_at);
    s.changes(4);
    common::settle(&s.db);
    let second = rt.block_on(open_chunked_at(s.wf_path.clone())).unwrap().expect("the second open");
    assert!(second.opened_now, "{second:?}");
    gate.open();
    let first = held.join().unwrap().expect("the first call answers an open");
    assert!(!first.opened_now, "the first call's open lost the txn: {first:?}");
    assert_eq!(first.snapshot_lsn, second.snapshot_lsn, "both calls use the one open");

    let opens_planned: Vec<Lsn> = plan_rows(&rt, &s).iter().filter(|r| r.event == "snapshot_open").map(|r| r.snapshot).collect();
    assert_eq!(opens_planned.len(), 2, "each call wrote its plans row, keyed by its own S: {opens_planned:?}");
    assert!(opens_planned.iter().any(|l| *l < second.snapshot_lsn), "the held call read an earlier S: {opens_planned:?}");
    let rows = facts_rows(&rt, &s);
    let opens = events(&rows, "snapshot_open");
    assert_eq!(opens.len(), 1, "one open recorded: {opens:?}");
    assert_eq!((opens[0].min_lsn, opens[0].generation), (Some(second.snapshot_lsn), 0));

    backfill_until_done(&rt, &s.wf_path);
    stream_until_caught_up(&rt, &s);
    assert_each_chunk_once(&rt, &s, second.snapshot_lsn);
    let snapshots = strings(&rt, &location(&s, "bronze"), "SELECT DISTINCT _snapshot FROM t WHERE _operation = 0");
    assert_eq!(snapshots, vec![second.snapshot_lsn.to_hex()], "every chunk row is of the one open");
    assert_eq!(assert_bronze_equals_table(&rt, &s), second.snapshot_lsn);
}

/// 28.96: a `backfill` call is held at its first wave's bronze commit (wave
/// 1, after an earlier call's wave 0) while its readers read the next wave
/// ahead; another call commits waves 1 and 2 meanwhile. The held call
/// finds wave 1's txn taken: it exits 75 and commits none of what it read,
/// and the rerun goes on past every recorded wave, reading the thrown-away
/// chunks again. Each chunk is in bronze once and recorded once.
#[test]
fn a_call_whose_waves_another_call_committed_exits_75_and_the_rerun_reads_the_rest_once() {
    let (_fp, rt) = failpoints_and_runtime();
    let s = Scenario::new(100, CHUNKED);
    rt.block_on(s.stream()).unwrap();
    let w0 = rt.block_on(backfill_at(s.wf_path.clone(), one_wave())).unwrap();
    let n = w0.chunks_total;
    assert!(n >= 8, "the race needs waves left after waves 0 to 2: {w0:?}");
    let commit = Gate::hold("chunked.before_wave_bronze", 1);
    let reads = Gate::count("chunked.before_chunk_read");
    let mut held = start_held(&commit, &s.wf_path, |wf| backfill_at(wf, BackfillArgs::default()));
    // Its readers go on while its commit is held, one wave ahead and no
    // further (28.94: at most two waves uncommitted): wave 1's two chunks
    // and wave 2's, then they wait for the held commit.
    wait_until("the held call reads the wave after the held one", || reads.hits() >= 4);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(reads.hits(), 4, "the readers went past the wave after the one whose commit is held");
    let other = rt.block_on(backfill_at(s.wf_path.clone(), BackfillArgs { max_waves: Some(2), ..Default::default() })).unwrap();
    assert_eq!((other.waves, other.done), (2, false), "{other:?}");
    commit.open();
    let e = held.join().expect_err("the held call's wave 1 was committed by the other call");
    assert_eq!(e.exit_code(), 75, "{e}");
    assert!(e.to_string().contains("wave 1") && e.to_string().contains("committed by another backfill call"), "{e}");

    let rows = facts_rows(&rt, &s);
    let snap = chunked_open(&rows);
    let recorded = chunk_facts(&rows, snap);
    assert_eq!(recorded.keys().copied().collect::<Vec<i64>>(), (0..6i64).collect::<Vec<i64>>(), "nothing of the held call is recorded");
    assert!(bronze_chunks(&rt, &s, snap).keys().all(|c| c.is_some_and(|c| c < 6)), "nothing of the held call is in bronze");

    let rerun = rt.block_on(backfill_at(s.wf_path.clone(), BackfillArgs::default())).unwrap();
    assert!(rerun.done && rerun.repaired_wave.is_none(), "{rerun:?}");
    let recorded = chunk_facts(&facts_rows(&rt, &s), snap);
    assert!(recorded.iter().filter(|(c, _)| **c >= 6).all(|(_, (w, _))| *w >= 3), "the rerun reads after every recorded wave: {recorded:?}");
    stream_until_caught_up(&rt, &s);
    assert_eq!(assert_each_chunk_once(&rt, &s, snap), n);
    assert_eq!(assert_bronze_equals_table(&rt, &s), snap);
}

/// 28.97, reader side: with one connection, the reader reads chunk 1 while
/// wave 0 (chunk 0) commits. The commit is held; the reader's SELECT fails
/// with a non-transient server error meanwhile. The call must not return
/// while the commit is in progress; the commit completes (bronze, plans and
/// facts rows of wave 0), and the call then fails with the reader's error.
/// The rerun finds nothing to repair and completes.
#[test]
fn a_reader_failure_fails_the_call_after_the_commit_in_progress_completes() {
    let (_fp, rt) = failpoints_and_runtime();
    let s = Scenario::new(40, CHUNKED_ONE_READER);
    rt.block_on(s.stream()).unwrap();
    let commit = Gate::hold("chunked.before_wave_bronze", 1);
    let read = Gate::hold("chunked.before_chunk_read", 2);
    let mut call = start_held(&commit, &s.wf_path, |wf| backfill_at(wf, BackfillArgs::default()));
    read.wait_held(&mut call);
    // Chunk 1's SELECT fails: SQL Server error 208, which no retry passes.
    s.db.inject_server_error(FaultOn::Snapshot, 0, 1, 208).unwrap();
    read.open();
    wait_until("the reader's SELECT meets the error", || s.db.status().unwrap()["armed_faults"].as_i64() == Some(0));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!call.is_finished(), "the call returned while wave 0's commit was in progress");
    commit.open();
    let e = call.join().expect_err("the reader's failure fails the call");
    assert!(matches!(e, StepError::Source(SourceError::Config(_))) && e.to_string().contains("208"), "{e:?}");

    let rows = facts_rows(&rt, &s);
    let snap = chunked_open(&rows);
    let recorded = chunk_facts(&rows, snap);
    assert_eq!(recorded.keys().copied().collect::<Vec<i64>>(), vec![0i64], "wave 0's facts row is in: {recorded:?}");
    let plans_chunks: Vec<i64> = plan_rows(&rt, &s).iter().filter(|r| r.event == "snapshot_chunk").map(|r| r.chunk.unwrap()).collect();
    assert_eq!(plans_chunks, vec![0i64], "wave 0's plans row is in");
    let in_bronze = bronze_chunks(&rt, &s, snap);
    assert_eq!(in_bronze.keys().copied().collect::<Vec<Option<i64>>>(), vec![Some(0i64)], "wave 0 alone is in bronze: {in_bronze:?}");
    assert_eq!(in_bronze[&Some(0)].0, recorded[&0].1);
    assert!(recorded[&0].1 > 0);

    let rerun = rt.block_on(backfill_at(s.wf_path.clone(), BackfillArgs::default())).unwrap();
    assert!(rerun.done && rerun.repaired_wave.is_none(), "the failed call left no wave half committed: {rerun:?}");
    assert_caught_up_whole(&rt, &s, snap);
}

/// 28.97, commit side: the reader is held in chunk 1's read while wave 0's
/// commit fails after its bronze commit. The call must wait for the reader
/// to finish its chunk in hand before it returns the commit's error; what
/// the reader read is not committed, and the rerun repairs wave 0 from
/// bronze's commit and reads chunk 1 again, once.
#[test]
fn a_commit_failure_fails_the_call_after_the_reader_finishes_its_chunk() {
    let (_fp, rt) = failpoints_and_runtime();
    let s = Scenario::new(40, CHUNKED_ONE_READER);
    rt.block_on(s.stream()).unwrap();
    fail::cfg("chunked.after_wave_bronze", "1*return").unwrap();
    let commit = Gate::hold("chunked.before_wave_bronze", 1);
    let read = Gate::hold("chunked.before_chunk_read", 2);
    let mut call = start_held(&commit, &s.wf_path, |wf| backfill_at(wf, BackfillArgs::default()));
    read.wait_held(&mut call);
    let bronze_before = log_commits(&s, "bronze");
    commit.open();
    // Wave 0's bronze commit lands; the failpoint right after it fails the commit.
    wait_until("wave 0's bronze commit", || log_commits(&s, "bronze") > bronze_before);
    std::thread::sleep(Duration::from_millis(500));
    assert!(!call.is_finished(), "the call returned while its reader still held chunk 1");
    read.open();
    let e = call.join().expect_err("the commit's failure fails the call");
    assert!(matches!(e, StepError::Injected(ref fp) if fp == "chunked.after_wave_bronze"), "{e:?}");

    let rows = facts_rows(&rt, &s);
    let snap = chunked_open(&rows);
    assert!(chunk_facts(&rows, snap).is_empty(), "the failed commit wrote no facts row");
    let in_bronze = bronze_chunks(&rt, &s, snap);
    assert_eq!(in_bronze.keys().copied().collect::<Vec<Option<i64>>>(), vec![Some(0i64)], "chunk 1, read after the failure, is not committed: {in_bronze:?}");

    let rerun = rt.block_on(backfill_at(s.wf_path.clone(), BackfillArgs::default())).unwrap();
    assert!(rerun.done && rerun.repaired_wave == Some(0), "{rerun:?}");
    assert_caught_up_whole(&rt, &s, snap);
}

/// 28.112: `apply` is held between its facts read (wave 0 recorded) and
/// its plans read while `backfill` commits wave 1 (plans and facts rows).
/// The held apply takes wave 0 only and records it as the wave applied;
/// the next apply takes wave 1. Silver holds exactly the chunk rows of the
/// waves applied after each call, and equals the table once the snapshot
/// completes and the changes after S are applied.
#[test]
fn a_wave_landing_between_applys_facts_and_plans_reads_is_taken_by_the_next_apply() {
    let (_fp, rt) = failpoints_and_runtime();
    let mut s = Scenario::new(60, CHUNKED_SILVER);
    let columns = common::items_spec(&s.table).columns;
    rt.block_on(s.stream()).unwrap();
    let w0 = rt.block_on(backfill_at(s.wf_path.clone(), one_wave())).unwrap();
    assert!(w0.chunks_total >= 5, "the race needs a third wave: {w0:?}");
    let gate = Gate::hold("apply.between_facts_and_plans", 1);
    let mut held = start_held(&gate, &s.wf_path, apply_at);
    let w1 = rt.block_on(backfill_at(s.wf_path.clone(), one_wave())).unwrap();
    assert_eq!((w1.waves, w1.done), (1, false), "{w1:?}");
    gate.open();
    let first = held.join().unwrap();
    assert_eq!((first.waves_applied.clone(), first.snapshot_wave), (vec![0], Some(0)), "the held apply takes what its facts read held: {first:?}");

    let rows = facts_rows(&rt, &s);
    let snap = chunked_open(&rows);
    let waves = chunk_facts(&rows, snap);
    let chunks_of = |upto: i64| -> String {
        waves.iter().filter(|(_, (w, _))| *w <= upto).map(|(c, _)| c.to_string()).collect::<Vec<_>>().join(", ")
    };
    let bronze_of = |upto: i64| {
        rt.block_on(delta_rows(
            &location(&s, "bronze"),
            &columns,
            &format!("_operation = 0 AND _snapshot = '{}' AND _chunk IN ({})", snap.to_hex(), chunks_of(upto)),
        ))
    };
    assert!(waves.values().any(|(w, _)| *w == 1), "wave 1 is recorded: {waves:?}");
    assert_eq!(silver_rows(&rt, &s, &columns), bronze_of(0), "silver holds wave 0's chunk rows and nothing of wave 1");

    let next = rt.block_on(apply_at(s.wf_path.clone())).unwrap();
    assert_eq!((next.waves_applied.clone(), next.snapshot_wave), (vec![1], Some(1)), "the next apply takes wave 1: {next:?}");
    assert_eq!(silver_rows(&rt, &s, &columns), bronze_of(1), "silver holds the chunk rows of waves 0 and 1");

    backfill_until_done(&rt, &s.wf_path);
    s.changes(6);
    common::settle(&s.db);
    stream_until_caught_up(&rt, &s);
    rt.block_on(apply_at(s.wf_path.clone())).unwrap();
    assert_eq!(silver_rows(&rt, &s, &columns), rt.block_on(source_rows(&s.db, &s.table, &columns)), "silver equals the table");
    assert_each_chunk_once(&rt, &s, snap);
}

/// A capture-instance switch while `apply` runs: the held apply has picked
/// the instance the stream was on (and silver's columns from it) when the
/// stream switches to a newer instance that adds a column and commits the
/// batch whose rows carry it. The apply must not merge those rows with the
/// older instance's columns (silver would hold the new column NULL for
/// them, and the next apply, finding nothing new, would never mend it):
/// silver equals the table, every column, once the calls end.
#[test]
fn a_capture_instance_switch_during_apply_keeps_the_added_column() {
    let (_fp, rt) = failpoints_and_runtime();
    let s = Scenario::new(20, "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\n");
    rt.block_on(s.stream_until_caught_up());
    rt.block_on(apply_at(s.wf_path.clone())).unwrap();

    let gate = Gate::hold("apply.before_state", 1);
    let mut held = start_held(&gate, &s.wf_path, apply_at);
    let note = mssql_cdc::types::ColumnDesc::new("note", mssql_cdc::types::SqlType::NVarChar { len: Some(20) }, true);
    s.db.add_column(&s.table, note.clone()).unwrap();
    s.db.enable_cdc(&s.table, Some("dbo_items_v2"), None).unwrap();
    let table = s.table.clone();
    s.db.transaction(|tx| {
        let mut r = common::item_row(3, 1);
        r.push(SqlValue::Str("n3".into()));
        tx.update(&table, &vec![SqlValue::Int(3)], r)?;
        let mut r = common::item_row(21, 0);
        r.push(SqlValue::Str("n21".into()));
        tx.insert(&table, r)
    })
    .unwrap();
    common::settle(&s.db);
    rt.block_on(s.stream_until_caught_up());
    let facts = facts_rows(&rt, &s);
    assert_eq!(events(&facts, "capture_instance_switched").len(), 1, "the stream switched while apply was held");
    gate.open();
    held.join().unwrap();
    rt.block_on(apply_at(s.wf_path.clone())).unwrap();

    let mut columns = common::items_spec(&s.table).columns;
    columns.push(note);
    let silver = silver_rows(&rt, &s, &columns);
    assert_eq!(silver, rt.block_on(source_rows(&s.db, &s.table, &columns)), "silver equals the table, the added column too");
    assert!(silver.keys().any(|r| r.contains("n3")) && silver.keys().any(|r| r.contains("n21")), "{silver:?}");
}

/// 18.26: two stream calls recover the same loss at once, without a lock.
/// The first is held after its facts read found no recovery row, before it
/// writes one; the second recovers all the way (recovery row, full
/// re-snapshot, `resnapshot` row). The first then writes its recovery row
/// under the same txn (taken: it goes on), opens its own snapshot attempt
/// (at the same S, whose open row it finds written) and finds the
/// generation's bronze commit taken (exit 75). One recovery row, one open
/// row and one completion for generation 1, one set of snapshot rows, and
/// bronze equals the table after the stream catches up.
#[test]
fn two_recoveries_at_once_record_one_recovery_and_one_resnapshot() {
    let (_fp, rt) = failpoints_and_runtime();
    let mut s = Scenario::new(30, FULL_RESNAPSHOT);
    stream_until_caught_up(&rt, &s);
    s.changes(5);
    common::settle(&s.db);
    stream_until_caught_up(&rt, &s);
    // The stream stops past the retention: cleanup purges changes it never read.
    s.changes(6);
    common::settle(&s.db);
    s.db.advance_clock(DAY * 4).unwrap();
    s.changes(5);
    common::settle(&s.db);
    assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "cleanup ran");

    let gate = Gate::hold("recover.before_recovery_row", 1);
    let mut held = start_held(&gate, &s.wf_path, stream_at);
    let other = rt.block_on(stream_at(s.wf_path.clone())).unwrap();
    let rec = other.recovery.as_ref().expect("the other call recovers");
    assert_eq!((rec.generation, rec.mode), (1, "full"), "{rec:?}");
    gate.open();
    // The held call's `recover` finds the recovery recorded; the state it
    // reads next has generation 1 live (the other call's re-snapshot), so it
    // streams on in it and takes no snapshot of its own.
    let r = held.join().expect("the held call goes on in generation 1");
    assert_eq!(r.generation, 1, "{r:?}");
    assert!(r.position >= Some(other.position.unwrap()), "{r:?} {other:?}");

    let rows = facts_rows(&rt, &s);
    let recoveries: Vec<&FactRow> =
        events(&rows, "recovery").into_iter().filter(|r| r.detail.as_ref().unwrap()["target_generation"].as_i64() == Some(1)).collect();
    assert_eq!(recoveries.len(), 1, "one recovery row: {recoveries:?}");
    let done: Vec<&FactRow> = events(&rows, "resnapshot").into_iter().filter(|r| r.generation == 1).collect();
    assert_eq!(done.len(), 1, "one completion of generation 1: {done:?}");
    let attempts = events(&rows, "snapshot_open").into_iter().filter(|r| r.generation == 1).count();
    assert_eq!(attempts, 1, "one open row of generation 1's snapshot: the other call's");
    let resnap = done[0].max_lsn.unwrap();
    let per_snapshot = strings(&rt, &location(&s, "bronze"), "SELECT DISTINCT _snapshot FROM t WHERE _operation = 0");
    assert_eq!(per_snapshot.len(), 2, "the bootstrap's rows and one re-snapshot's: {per_snapshot:?}");
    let counts = int_rows(
        &rt,
        &location(&s, "bronze"),
        &format!("SELECT CAST(COUNT(*) AS BIGINT), CAST(COUNT(DISTINCT id) AS BIGINT) FROM t WHERE _operation = 0 AND _snapshot = '{}'", resnap.to_hex()),
    );
    assert_eq!(counts, vec![vec![done[0].rows, done[0].rows]], "the re-snapshot's rows, each id once, as its completion counts");

    stream_until_caught_up(&rt, &s);
    assert_eq!(assert_bronze_equals_table(&rt, &s), resnap);
}

/// Two workflows that share an app id (and a facts table) but not a table
/// make their first calls at once: both pass the identity check on a facts
/// table with no row of that app id. The one that reads the other's rows
/// when it loads its state is refused there (exit 2), before it decides or
/// writes anything from them; the other goes on alone.
#[test]
fn two_workflows_with_one_app_id_started_at_once_the_one_reading_the_others_rows_is_refused() {
    let (_fp, rt) = failpoints_and_runtime();
    let s = Scenario::new(10, "[stream]\nmax_batch_rows = 1000\n");
    let other = mssql_cdc::source::TableName::new("dbo", "other");
    s.db.create_table(&common::items_spec(&other)).unwrap();
    s.db.load_rows(&other, (1..=5).map(|i| common::item_row(i, 0))).unwrap();
    s.db.enable_cdc(&other, None, None).unwrap();
    common::settle(&s.db);
    let other_wf = s.path().join("other.toml");
    std::fs::write(
        &other_wf,
        "app_id = \"items\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"other\"\n\
         [target]\nbronze = \"bronze_other\"\nfacts = \"facts\"\n[stream]\nmax_batch_rows = 1000\n",
    )
    .unwrap();
    // The other workflow is held in its first load of the state, after its
    // identity check passed; this one runs a whole call meanwhile.
    let gate = Gate::hold("state.between_facts_and_bronze", 1);
    let mut held = start_held(&gate, &other_wf, stream_at);
    let first = rt.block_on(stream_at(s.wf_path.clone())).unwrap();
    gate.open();
    let e = held.join().unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("names two streams"), "{e}");
    let rows = facts_rows(&rt, &s);
    assert!(!rows.is_empty() && rows.iter().all(|r| r.table.to_lowercase().ends_with("items")), "only this workflow's rows: {rows:?}");
    let other_bronze = s.path().join("bronze_other").to_string_lossy().into_owned();
    if rt.block_on(mssql_cdc::delta::open_existing(&other_bronze, &Default::default())).unwrap().is_some() {
        assert_eq!(int_rows(&rt, &other_bronze, "SELECT count(*) FROM t"), vec![vec![Some(0)]], "the refused workflow wrote no row");
    }
    // This workflow goes on from its own start.
    let items = s.table.clone();
    s.db.transaction(|tx| {
        tx.insert(&items, common::item_row(100, 1))?;
        Ok(())
    })
    .unwrap();
    common::settle(&s.db);
    let next = rt.block_on(stream_at(s.wf_path.clone())).unwrap();
    assert!(next.position > first.position, "{first:?} then {next:?}");
}
