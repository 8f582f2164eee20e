//! More rules of the design records that no test covered (rows marked
//! UNTESTED in docs/CONFORMANCE.md), on the simulator:
//! - a stream without a snapshot starts `earliest` or `latest` outside the
//!   range CDC cleanup purged (18.6);
//! - a recovery whose source reports no max LSN has no server time: its
//!   guard is not asked on any other clock and no snapshot is read (18.25);
//! - a `data_skipped` row is written only by a batch that passes its schema
//!   checks (18.45);
//! - cleanup during a read in skip mode records a possible loss, in the
//!   batch's own commits, once even across a crash (18.48, 18.49);
//! - a wave's chunks reach data files as they are read and its commit only
//!   adds them (28.101);
//! - `backfill --max-seconds` caps each wave and stops between waves (28.102).
//!
//! Expectations come from the simulator's own rows and commit times, from the
//! Delta logs and data files read here, and from the facts rows; never from
//! an engine helper. No failpoint is armed in this process (the file runs in
//! the shared `suite` binary): the tests that need one run the command-line
//! binary as a child with `MSSQL_CDC_FAILPOINTS` set.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, TimeZone, Utc};
use common::{failpoint_command, item_row, last_json_line, Running, Scenario};
use deltalake::arrow::array::{Array, FixedSizeBinaryArray, Int32Array, Int64Array, StringArray};
use deltalake::arrow::compute::cast;
use deltalake::arrow::datatypes::DataType;
use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use futures::StreamExt;
use mssql_cdc::delta::{self, facts::FactRow};
use mssql_cdc::engine::chunked::{self, BackfillArgs};
use mssql_cdc::engine::{self, Context};
use mssql_cdc::error::{StepError, StepResult};
use mssql_cdc::lsn::Lsn;
use mssql_cdc::source::{CdcSource, RowFilter, SharedSource, SourceError, CHANGE_OPERATION, CHANGE_SEQVAL, CHANGE_START_LSN};
use mssql_cdc::types::{SqlType, SqlValue};
use serde_json::{json, Value};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A full bootstrap, `on_data_loss = "skip"`.
const SKIP: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"skip\"\n";

/// A full bootstrap, `on_data_loss = "resnapshot"`, and an anti-loop interval
/// no clock of this century falls outside of.
const GUARDED: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\n\
                       on_data_loss = \"resnapshot\"\nresnapshot_interval_days = 100000\n";

/// A chunked bootstrap read by one connection, chunks of 10 rows, and waves
/// as long as 100 s hold at the last wave's pace.
const ONE_READER: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 1\nchunk_rows = 10\ntarget_wave_seconds = 100\n\
                          [stream]\nmax_batch_rows = 1000\n";

/// The simulator's read rate in the chunked tests (`conn_rows_per_s`): a
/// 10-row chunk takes at least a second to read.
const ROWS_PER_SECOND: u64 = 10;

// ---------------------------------------------------------------------------
// Reading the facts, the simulator and the Delta logs.

async fn facts(s: &Scenario) -> Vec<FactRow> {
    let ctx = s.context().await.unwrap();
    engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
}

fn events<'a>(rows: &'a [FactRow], name: &str) -> Vec<&'a FactRow> {
    rows.iter().filter(|r| r.event.as_deref() == Some(name)).collect()
}

/// The micro-batch rows of a generation, by batch id.
fn batches(rows: &[FactRow], generation: i32) -> Vec<&FactRow> {
    let mut out: Vec<&FactRow> = rows.iter().filter(|r| r.generation == generation && r.event.is_none() && r.batch_id.is_some()).collect();
    out.sort_by_key(|r| r.batch_id);
    out
}

/// Generation 0's position as the facts rows say it: the newest batch's end,
/// else the bootstrap's LSN.
fn position_of(rows: &[FactRow]) -> Lsn {
    batches(rows, 0)
        .last()
        .and_then(|b| b.max_lsn)
        .or_else(|| events(rows, "bootstrap").first().and_then(|b| b.max_lsn))
        .expect("a batch or a bootstrap")
}

/// Bronze's and the facts' table versions.
async fn versions(s: &Scenario) -> (Option<u64>, Option<u64>) {
    let ctx = s.context().await.unwrap();
    (ctx.bronze.version(), ctx.facts.version())
}

/// The capture instance's min LSN as the simulator holds it.
fn min_lsn(s: &Scenario) -> Lsn {
    s.db.capture_instances(&s.table).unwrap().pop().unwrap().start_lsn.expect("the instance has a start")
}

fn lsn_of(bytes: &[u8]) -> Lsn {
    let mut b = [0u8; 10];
    b.copy_from_slice(bytes);
    Lsn(b)
}

/// The change table's rows in `from ..= to`, read from the simulator itself:
/// (start LSN, seqval, operation).
async fn source_changes(s: &Scenario, from: Lsn, to: Lsn) -> BTreeSet<(String, String, i32)> {
    let source = s.db.source().unwrap();
    let ci = s.db.capture_instances(&s.table).unwrap().pop().unwrap();
    let mut stream = source.changes(&ci, from, to, RowFilter::All, 1000).await.unwrap();
    let mut out = BTreeSet::new();
    while let Some(b) = stream.next().await {
        let b = b.unwrap();
        let start = b.column_by_name(CHANGE_START_LSN).unwrap().as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap().clone();
        let seq = b.column_by_name(CHANGE_SEQVAL).unwrap().as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap().clone();
        let op = b.column_by_name(CHANGE_OPERATION).unwrap().as_any().downcast_ref::<Int32Array>().unwrap().clone();
        for i in 0..b.num_rows() {
            out.insert((lsn_of(start.value(i)).to_hex(), lsn_of(seq.value(i)).to_hex(), op.value(i)));
        }
    }
    out
}

/// Bronze's change rows: (start LSN, seqval, operation), each at most once.
async fn bronze_changes(s: &Scenario) -> BTreeSet<(String, String, i32)> {
    let ctx = s.context().await.unwrap();
    let mut out = BTreeSet::new();
    for b in delta::query(&ctx.bronze, "SELECT _start_lsn, _seqval, CAST(_operation AS INT) AS op FROM t WHERE _operation <> 0").await.unwrap() {
        let start = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
        let seq = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        let op = b.column(2).as_any().downcast_ref::<Int32Array>().unwrap();
        for i in 0..b.num_rows() {
            assert!(out.insert((start.value(i).to_string(), seq.value(i).to_string(), op.value(i))), "bronze holds a change twice");
        }
    }
    out
}

/// The UTC commit time of an LSN from the simulator's own mapping (its
/// server clock runs in America/Sao_Paulo), in microseconds.
async fn server_commit_micros(s: &Scenario, lsn: Lsn) -> Option<i64> {
    let local: NaiveDateTime = s.db.source().unwrap().lsn_to_time(lsn).await.unwrap()?;
    let at = chrono_tz::America::Sao_Paulo.from_local_datetime(&local).single().expect("one instant");
    Some(at.with_timezone(&Utc).timestamp_micros())
}

fn micros(t: Option<DateTime<Utc>>) -> Option<i64> {
    t.map(|t| t.timestamp_micros())
}

/// One commit of a Delta table, read from its JSON file in `_delta_log`.
#[derive(Debug, Clone)]
struct LogCommit {
    version: u64,
    txns: Vec<(String, i64)>,
    adds: Vec<String>,
    /// commitInfo's `mssql_cdc` metadata.
    meta: Value,
}

fn log_commits(table: &Path) -> Vec<LogCommit> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(table.join("_delta_log")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let Some(version) = name.strip_suffix(".json").and_then(|v| v.parse::<u64>().ok()) else { continue };
        let text = std::fs::read_to_string(&path).unwrap();
        let mut c = LogCommit { version, txns: Vec::new(), adds: Vec::new(), meta: Value::Null };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let action: Value = serde_json::from_str(line).unwrap();
            if let Some(t) = action.get("txn") {
                c.txns.push((t["appId"].as_str().unwrap().to_string(), t["version"].as_i64().unwrap()));
            }
            if let Some(a) = action.get("add") {
                c.adds.push(a["path"].as_str().unwrap().to_string());
            }
            if let Some(ci) = action.get("commitInfo") {
                c.meta = ci.get("mssql_cdc").cloned().unwrap_or(Value::Null);
            }
        }
        out.push(c);
    }
    out.sort_by_key(|c| c.version);
    out
}

/// The commit that carries txn (`app`, `version`), if the log holds one.
fn txn_commit(table: &Path, app: &str, version: i64) -> Option<LogCommit> {
    let found: Vec<LogCommit> = log_commits(table).into_iter().filter(|c| c.txns.iter().any(|(a, v)| a == app && *v == version)).collect();
    assert!(found.len() <= 1, "txn {app}/{version} in {} commits", found.len());
    found.into_iter().next()
}

/// The data files in a table's folder that no commit of its log adds.
fn uncommitted_files(table: &Path) -> Vec<PathBuf> {
    let committed: BTreeSet<String> = log_commits(table).into_iter().flat_map(|c| c.adds).collect();
    let mut out: Vec<PathBuf> = std::fs::read_dir(table)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .filter(|p| !committed.contains(p.file_name().unwrap().to_str().unwrap()))
        .collect();
    out.sort();
    out
}

/// The given columns of every row of one Parquet file, as text.
fn parquet_text(path: &Path, columns: &[&str]) -> Vec<Vec<Option<String>>> {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let reader = ParquetRecordBatchReaderBuilder::try_new(file).unwrap().build().unwrap();
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        let cols: Vec<StringArray> = columns
            .iter()
            .map(|c| {
                let a = batch.column_by_name(c).unwrap_or_else(|| panic!("{} has no column {c}", path.display()));
                let t = cast(a, &DataType::Utf8).unwrap();
                t.as_any().downcast_ref::<StringArray>().unwrap().clone()
            })
            .collect();
        for i in 0..batch.num_rows() {
            out.push(cols.iter().map(|a| if a.is_null(i) { None } else { Some(a.value(i).to_string()) }).collect());
        }
    }
    out
}

/// (event, batch id) of every facts row a commit of the facts table added.
fn facts_rows_of_commit(facts_dir: &Path, commit: &LogCommit) -> Vec<(Option<String>, Option<String>)> {
    let mut out: Vec<(Option<String>, Option<String>)> = commit
        .adds
        .iter()
        .flat_map(|f| parquet_text(&facts_dir.join(f), &["event", "batch_id"]))
        .map(|r| (r[0].clone(), r[1].clone()))
        .collect();
    out.sort();
    out
}

/// A number in a facts row's detail.
fn detail_i64(r: &FactRow, k: &str) -> i64 {
    r.detail.as_ref().and_then(|d| d[k].as_i64()).unwrap_or_else(|| panic!("{k}: {r:?}"))
}

/// Bronze's snapshot rows of `snapshot`: id -> how many.
async fn snapshot_ids(s: &Scenario, snapshot: Lsn) -> BTreeMap<i64, usize> {
    let ctx = s.context().await.unwrap();
    let sql = format!("SELECT CAST(id AS BIGINT) AS id FROM t WHERE _operation = 0 AND _snapshot = '{}'", snapshot.to_hex());
    let mut out = BTreeMap::new();
    for b in delta::query(&ctx.bronze, &sql).await.unwrap() {
        let a = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        for i in 0..a.len() {
            *out.entry(a.value(i)).or_default() += 1;
        }
    }
    out
}

/// The simulator's ids, each once.
fn table_ids(s: &Scenario) -> BTreeMap<i64, usize> {
    s.db.keys(&s.table).unwrap().iter().map(|k| (k[0].as_i64().unwrap(), 1)).collect()
}

/// Updates ids `1..=n`, one transaction each, and runs the capture job;
/// returns the last commit LSN.
fn updates(s: &Scenario, n: i64) -> Lsn {
    let table = s.table.clone();
    let mut last = None;
    for id in 1..=n {
        last = Some(s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(id)], item_row(id, 1))).unwrap());
    }
    common::settle(&s.db);
    last.expect("at least one update")
}

async fn backfill(s: &Scenario, args: BackfillArgs) -> StepResult<chunked::BackfillResult> {
    let mut ctx = s.context().await?;
    chunked::backfill(&mut ctx, &args).await
}

async fn backfill_until_done(s: &Scenario) {
    for _ in 0..50 {
        if backfill(s, BackfillArgs::default()).await.unwrap().done {
            return;
        }
    }
    panic!("backfill did not finish in 50 calls");
}

/// Changes, the retention passes, more changes; cleanup (3 days) purges the
/// first ones, which the stream has not read.
fn stop_past_the_retention(s: &mut Scenario) {
    s.changes(8);
    common::settle(&s.db);
    s.db.advance_clock(DAY * 4).unwrap();
    s.changes(6);
    common::settle(&s.db);
    assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "cleanup ran");
}

// ---------------------------------------------------------------------------
// The command line, as a child process.

/// Runs a step that must succeed; returns its JSON.
fn ok(s: &Scenario, args: &[&str]) -> Value {
    let out = failpoint_command(s, args, None).output().unwrap();
    let j = last_json_line(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(out.status.code(), Some(0), "{args:?}: {j}\n{}", String::from_utf8_lossy(&out.stderr));
    j
}

// ---------------------------------------------------------------------------
// 18.6

/// 18.6 (the purged-start half): without a snapshot, the first call takes
/// the start from `stream.start`, after cleanup has purged the oldest
/// changes. `earliest` starts right before the instance's min LSN as it is
/// now, and its first batch reads every change the change table still holds
/// (the simulator's own rows); `latest` starts at the max LSN or later and
/// reads only what comes after it. `on_data_loss` is "fail", so a start
/// inside the purged range would stop the call. Catches `earliest` taken
/// from the instance's start before cleanup (or from LSN 0), and `latest`
/// taken from anything older than the max LSN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn earliest_and_latest_starts_never_fall_inside_a_purged_range() {
    for start in ["earliest", "latest"] {
        let mut s = Scenario::new(10, &format!("[stream]\nmax_batch_rows = 1000\nstart = \"{start}\"\n"));
        let created = min_lsn(&s);
        s.changes(6);
        common::settle(&s.db);
        s.db.advance_clock(DAY * 4).unwrap();
        s.changes(5);
        common::settle(&s.db);
        assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "{start}: cleanup ran");
        let min = min_lsn(&s);
        let max = s.db.max_lsn().unwrap().unwrap();
        assert!(min > created.increment(), "{start}: cleanup moved the min LSN ({created} -> {min})");
        let held = source_changes(&s, min, max).await;
        assert!(!held.is_empty(), "{start}: the change table still holds the later changes");

        let r = s.stream().await.unwrap_or_else(|e| panic!("{start}: the first call stopped: {e}"));
        assert!(r.caught_up, "{start}: {r:?}");
        let rows = facts(&s).await;
        assert!(events(&rows, "data_skipped").is_empty(), "{start}: nothing was skipped");
        let begun = events(&rows, "stream_start");
        assert_eq!(begun.len(), 1, "{start}: {begun:?}");
        let at = begun[0].min_lsn.unwrap();
        if start == "earliest" {
            assert_eq!(at, min.decrement(), "earliest starts right before the oldest LSN the instance still holds");
            assert_eq!(batches(&rows, 0).first().and_then(|b| b.min_lsn), Some(min), "the first batch reads from the min LSN");
            assert_eq!(bronze_changes(&s).await, held, "earliest reads every change still held, once");
        } else {
            assert!(at >= max, "latest starts at the max LSN ({max}) or after it, not at {at}");
            assert!(bronze_changes(&s).await.is_empty(), "latest reads nothing committed before its start");
            s.changes(3);
            common::settle(&s.db);
            let now = s.db.max_lsn().unwrap().unwrap();
            s.stream_until_caught_up().await;
            let after = source_changes(&s, at.increment(), now).await;
            assert!(!after.is_empty());
            assert_eq!(bronze_changes(&s).await, after, "latest reads every change after its start, once");
        }
    }
}

// ---------------------------------------------------------------------------
// 18.25

/// The simulator as a source, except that `max_lsn` answers only the call's
/// own two reads: every later one finds it NULL (no mapping row to give), so
/// no server time can be read. A `stream` call reads max LSN with the state
/// (`step::load`, the call's limit) and again in the transition it runs (the
/// batch's bound); the guard of a recovery in that transition then has none.
struct MaxLsnOnce {
    calls: AtomicUsize,
}

/// The `stream` call's own max LSN reads before its recovery's guard.
const CALLS_OWN_MAX_LSN_READS: usize = 2;

#[async_trait]
impl common::Hooks for MaxLsnOnce {
    async fn max_lsn(&self, inner: &SharedSource) -> Result<Option<Lsn>, SourceError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < CALLS_OWN_MAX_LSN_READS {
            inner.max_lsn().await
        } else {
            Ok(None)
        }
    }
}

/// 18.25, the path without server time: the guard's clock is the commit time
/// of the max LSN, and a source with no max LSN has none. A second loss
/// within the interval of a first recovery stops for a person on the
/// server's clock (control). The same loss while max LSN is NULL at the
/// guard: the guard is not asked at all (no other clock stands in, so no
/// exit 3), the recovery row is written without a time, and no snapshot is
/// read (exit 75, nothing in bronze, no row of generation 2). With the
/// server's clock back, the rerun is guarded again (exit 3, the first
/// recovery named); interval 0 then completes the recovery from that row.
/// Catches the guard falling back to the writer's clock (with an interval
/// of 100000 days any clock would stop the call) and a snapshot taken with
/// no max LSN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_max_lsn_the_guard_has_no_server_time_and_no_snapshot_is_read() {
    let mut s = Scenario::new(30, GUARDED);
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s);
    let r = s.stream().await.unwrap();
    assert_eq!(r.recovery.as_ref().map(|r| r.generation), Some(1), "the first loss recovers: {r:?}");
    stop_past_the_retention(&mut s);

    // Control: on the server's clock the first recovery is within the interval.
    let before = versions(&s).await;
    let e = s.stream().await.unwrap_err();
    assert_eq!(e.exit_code(), 3, "{e}");
    assert!(e.to_string().contains("generation 1"), "{e}");
    assert_eq!(versions(&s).await, before, "the guard stops before writing anything");

    // The same loss, max LSN NULL from the guard on.
    let mut ctx = s.context().await.unwrap();
    let blank = Arc::new(common::Wrapped::new(ctx.source.clone(), MaxLsnOnce { calls: AtomicUsize::new(0) }));
    ctx.source = blank.clone();
    let e = engine::coarse::stream(&mut ctx).await.unwrap_err();
    assert!(matches!(e, StepError::Temporary(_)), "no server time: call again, not a decision on another clock: {e}");
    assert_eq!(e.exit_code(), 75);
    assert!(e.to_string().contains("max LSN is NULL"), "{e}");
    assert!(blank.hooks.calls.load(Ordering::SeqCst) > CALLS_OWN_MAX_LSN_READS, "the guard asked for max LSN after the call's own reads");
    let rows = facts(&s).await;
    let recoveries = events(&rows, "recovery");
    assert_eq!(recoveries.len(), 2, "{recoveries:?}");
    let second = recoveries
        .iter()
        .find(|r| r.detail.as_ref().is_some_and(|d| d["target_generation"] == 2))
        .expect("the recovery towards generation 2 was recorded");
    assert_eq!((second.commit_ts, second.source_max_lsn), (None, None), "recorded without a server time: {second:?}");
    assert!(rows.iter().all(|r| r.generation < 2), "no snapshot row of generation 2");
    assert_eq!(versions(&s).await.0, before.0, "nothing was read into bronze");

    // The server's clock back: the rerun is guarded like any other call.
    let e = s.stream().await.unwrap_err();
    assert_eq!(e.exit_code(), 3, "{e}");
    assert!(e.to_string().contains("generation 1"), "{e}");
    // A person decides: interval 0 re-snapshots from the recorded start.
    let mut wf = s.workflow();
    wf.stream.resnapshot_interval_days = 0.0;
    let mut ctx = Context::open(wf).await.unwrap();
    let r = engine::coarse::stream(&mut ctx).await.unwrap();
    let rec = r.recovery.as_ref().expect("recovered");
    assert_eq!((rec.generation, rec.resumed), (2, true), "{rec:?}");
    let rows = facts(&s).await;
    assert_eq!(events(&rows, "recovery").len(), 2, "the row written without a time is reused, not written again");
    let done: Vec<&FactRow> = events(&rows, "resnapshot").into_iter().filter(|r| r.generation == 2).collect();
    assert_eq!(done.len(), 1, "{done:?}");
    let s2 = done[0].max_lsn.unwrap();
    let table = s.db.row_count(&s.table).unwrap() as i64;
    assert_eq!(s.count("bronze", &format!("_operation = 0 AND _snapshot = '{}'", s2.to_hex())).await, table, "generation 2's snapshot holds the table");
}

/// A source whose max LSN is always NULL (the capture job has recorded none).
struct MaxLsnNull;

#[async_trait]
impl common::Hooks for MaxLsnNull {
    async fn max_lsn(&self, _inner: &SharedSource) -> Result<Option<Lsn>, SourceError> {
        Ok(None)
    }
}

/// 18.25 through `step`: the recorded recovery's re-snapshot is taken at the
/// server's max LSN. With max LSN NULL, `step resnapshot` has no S: it exits
/// 75 and writes nothing, and is not taken as a stream caught up (exit 0,
/// nothing done, the recovery left without its snapshot). With the server's
/// max LSN back, the same transition reads the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_resnapshot_without_a_max_lsn_exits_75_and_writes_nothing() {
    let mut s = Scenario::new(32, GUARDED);
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s);
    let mut ctx = s.context().await.unwrap();
    let out = engine::step::run(&mut ctx, engine::step::parse("recover").unwrap()).await.unwrap();
    assert_eq!(out["after"]["state"], "recovering", "{out}");
    drop(ctx);

    let before = versions(&s).await;
    let mut ctx = s.context().await.unwrap();
    ctx.source = Arc::new(common::Wrapped::new(ctx.source.clone(), MaxLsnNull));
    let e = engine::step::run(&mut ctx, engine::step::parse("resnapshot").unwrap()).await.unwrap_err();
    assert_eq!(e.exit_code(), 75, "no max LSN: call again, not done: {e}");
    assert!(e.to_string().contains("max LSN is NULL"), "{e}");
    drop(ctx);
    assert_eq!(versions(&s).await, before, "nothing written");
    assert!(events(&facts(&s).await, "resnapshot").iter().all(|r| r.generation < 1), "no re-snapshot of generation 1");

    let mut ctx = s.context().await.unwrap();
    let out = engine::step::run(&mut ctx, engine::step::parse("resnapshot").unwrap()).await.unwrap();
    assert_eq!(out["after"]["detail"]["generation"], 1, "{out}");
    let done = events(&facts(&s).await, "resnapshot").into_iter().filter(|r| r.generation == 1).count();
    assert_eq!(done, 1, "the re-snapshot of generation 1 is recorded once");
}

// ---------------------------------------------------------------------------
// 18.45

/// 18.45: the stream stops past the retention; meanwhile `qty` is widened to
/// bigint at the source and a value past int's range is written. The
/// pre-flight guard decides to skip the purged range, and the batch after
/// the gap holds the value bronze's int cannot hold: the schema check
/// refuses it (exit 3) and the call writes nothing, no `data_skipped` row
/// either, however often it is called. Once cleanup passes the refused
/// change too, the next batch passes its checks and records one skip from
/// the first LSN the stream needed to the new min LSN, under the first free
/// batch id. Catches a skip row written on its own before (or apart from)
/// the batch's checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_is_recorded_only_by_a_batch_that_passes_its_schema_checks() {
    let mut s = Scenario::new(20, SKIP);
    s.stream_until_caught_up().await;
    let rows = facts(&s).await;
    let position = position_of(&rows);
    let batch_ids = batches(&rows, 0).len() as i64;
    let table = s.table.clone();
    s.changes(5);
    common::settle(&s.db);
    s.db.advance_clock(DAY * 4).unwrap();
    s.db.alter_column_type(&table, "qty", SqlType::BigInt).unwrap();
    let key = s.db.keys(&table).unwrap()[0].clone();
    let mut big = item_row(key[0].as_i64().unwrap(), 9);
    big[2] = SqlValue::Int(3_000_000_000);
    let refused = s.db.transaction(|tx| tx.update(&table, &key, big)).unwrap();
    common::settle(&s.db);
    assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "cleanup ran");
    let min = min_lsn(&s);
    assert!(position.increment() < min && min <= refused, "a gap ({position} .. {min}) before the value ({refused})");

    let before = versions(&s).await;
    for attempt in 0..2 {
        let e = s.stream().await.unwrap_err();
        assert_eq!(e.exit_code(), 3, "attempt {attempt}: {e}");
        assert!(e.to_string().contains("'qty'"), "attempt {attempt}: {e}");
        assert_eq!(versions(&s).await, before, "attempt {attempt}: a batch that fails writes nothing");
    }
    assert!(events(&facts(&s).await, "data_skipped").is_empty(), "no skip row without its batch");

    s.db.advance_clock(DAY * 4).unwrap();
    s.db.transaction(|tx| tx.insert(&table, item_row(900, 1))).unwrap();
    common::settle(&s.db);
    assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "cleanup ran");
    let min = min_lsn(&s);
    assert!(min > refused, "cleanup passed the refused change");
    let r = s.stream().await.unwrap();
    assert_eq!(r.skipped.len(), 1, "{r:?}");
    let rows = facts(&s).await;
    let skips = events(&rows, "data_skipped");
    assert_eq!(skips.len(), 1, "{skips:?}");
    let d = skips[0].detail.as_ref().unwrap();
    assert_eq!((&d["from"], &d["to"], &d["certain"]), (&json!(position.increment()), &json!(min), &json!(true)), "{d}");
    assert_eq!((skips[0].min_lsn, skips[0].max_lsn, skips[0].rows), (Some(min), Some(min), Some(0)));
    let done = batches(&rows, 0);
    assert_eq!(done.len() as i64, batch_ids + 1, "the refused attempts took no batch id: {done:?}");
    let last = done.last().unwrap();
    assert_eq!((last.batch_id, skips[0].batch_id), (Some(batch_ids), Some(batch_ids)));
    assert_eq!(last.min_lsn, Some(min));
    assert_eq!(s.count("bronze", &format!("_start_lsn = '{}'", refused.to_hex())).await, 0, "the refused change never reached bronze");
    assert_eq!(s.count("bronze", "id = 900 AND _operation = 2").await, 1, "the batch after the gap did");
}

// ---------------------------------------------------------------------------
// 18.48, 18.49

/// 18.48: the stream reads a batch of six updates; while the child process
/// holds the rows (a sleep after the read, before its commits), cleanup
/// passes the batch's first LSN up to the last update's LSN M. The batch
/// still commits its rows, and records a `data_skipped` row with `certain:
/// false` and a reason: from the batch's first LSN to M, rows 0, min = max =
/// M, the lost times the commit times of the position and of M (read from
/// the simulator's mapping). 18.49 (no crash): that row is in the batch's own
/// facts commit (txn `items#facts`, batch id) beside the batch row.
/// Catches the check after the read dropped (no row), the loss recorded as
/// certain, or written apart from the batch's commit.
#[test]
fn cleanup_during_a_skip_mode_read_records_a_possible_loss_in_the_batchs_commit() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Scenario::new(20, SKIP);
    ok(&s, &["stream"]);
    let rows = rt.block_on(facts(&s));
    let position = position_of(&rows);
    let batch_id = batches(&rows, 0).len() as i64;
    let position_at = rt.block_on(server_commit_micros(&s, position)).expect("the position's commit is mapped");
    let last = updates(&s, 6);

    let mut child = Running::spawn(&s, &["stream"], "stream.after_read=sleep(5000)");
    let read = child.wait_for("batch read");
    assert!(read.contains("rows=6"), "{read}");
    s.db.cleanup_to_lsn(last).unwrap();
    let (code, j, err) = child.finish();
    assert_eq!(code, 0, "{j}\n{err}");
    assert_eq!(j["skipped"], json!([{"from": position.increment(), "to": last, "certain": false}]), "{j}");

    let rows = rt.block_on(facts(&s));
    let skips = events(&rows, "data_skipped");
    assert_eq!(skips.len(), 1, "{skips:?}");
    let k = skips[0];
    let d = k.detail.as_ref().unwrap();
    assert_eq!((&d["from"], &d["to"], &d["certain"]), (&json!(position.increment()), &json!(last), &json!(false)), "{d}");
    assert!(d["reason"].as_str().is_some_and(|r| r.contains("cleanup")), "a reason: {d}");
    assert_eq!((k.min_lsn, k.max_lsn, k.rows, k.batch_id), (Some(last), Some(last), Some(0), Some(batch_id)));
    assert_eq!(micros(k.lost_from_ts), Some(position_at), "lost from the position's commit time");
    assert_eq!(micros(k.lost_to_ts), rt.block_on(server_commit_micros(&s, last)), "lost up to M's commit time");
    let b = batches(&rows, 0);
    assert_eq!(b.len() as i64, batch_id + 1);
    assert_eq!((b[batch_id as usize].min_lsn, b[batch_id as usize].rows), (Some(position.increment()), Some(6)));
    assert_eq!(rt.block_on(s.count("bronze", &format!("_batch_id = {batch_id} AND _operation <> 0"))), 6, "the rows read before cleanup are in");

    let facts_dir = s.path().join("facts");
    let commit = txn_commit(&facts_dir, "items#facts", batch_id).expect("the batch's facts commit");
    let n = batch_id.to_string();
    assert_eq!(facts_rows_of_commit(&facts_dir, &commit), vec![(None, Some(n.clone())), (Some("data_skipped".to_string()), Some(n))], "one commit");
}

/// 18.49: as above, but the child also fails right after the batch's bronze
/// commit. The possible loss is in that commit (its metadata, under the
/// batch's txn) while the facts hold neither the batch nor the skip; the
/// next call writes the batch's facts row from bronze's commit and the
/// `data_skipped` row with it, in one facts commit, and later calls add no
/// second one. Catches a skip kept outside the batch's commits (lost by the
/// crash) or written again on each call.
#[test]
fn a_possible_loss_rides_in_the_batchs_bronze_commit_and_is_recorded_once_after_a_crash() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(20, SKIP);
    ok(&s, &["stream"]);
    let rows = rt.block_on(facts(&s));
    let position = position_of(&rows);
    let batch_id = batches(&rows, 0).len() as i64;
    let last = updates(&s, 6);

    let mut child = Running::spawn(&s, &["stream"], "stream.after_read=sleep(5000);stream.after_bronze=return");
    child.wait_for("batch read");
    s.db.cleanup_to_lsn(last).unwrap();
    let (code, j, err) = child.finish();
    assert_eq!(code, 75, "the failpoint after bronze: {j}\n{err}");

    let bronze_dir = s.path().join("bronze");
    let commit = txn_commit(&bronze_dir, "items", batch_id).expect("bronze holds the batch");
    let skipped = commit.meta["skipped"].as_array().cloned().unwrap_or_default();
    assert_eq!(skipped.len(), 1, "{}", commit.meta);
    assert_eq!((&skipped[0]["from"], &skipped[0]["to"], &skipped[0]["certain"]), (&json!(position.increment()), &json!(last), &json!(false)));
    let rows = rt.block_on(facts(&s));
    assert!(events(&rows, "data_skipped").is_empty() && batches(&rows, 0).len() as i64 == batch_id, "the facts have neither yet");

    let j = ok(&s, &["stream"]);
    assert_eq!(j["repaired_batches"], json!([batch_id]), "{j}");
    s.changes(3);
    common::settle(&s.db);
    ok(&s, &["stream"]);
    let rows = rt.block_on(facts(&s));
    let skips = events(&rows, "data_skipped");
    assert_eq!(skips.len(), 1, "recorded once: {skips:?}");
    let d = skips[0].detail.as_ref().unwrap();
    assert_eq!((&d["from"], &d["to"], &d["certain"]), (&json!(position.increment()), &json!(last), &json!(false)), "{d}");
    assert!(d["reason"].as_str().is_some_and(|r| r.contains("cleanup")), "{d}");
    assert_eq!(skips[0].batch_id, Some(batch_id));
    let facts_dir = s.path().join("facts");
    let commit = txn_commit(&facts_dir, "items#facts", batch_id).expect("the batch's facts commit");
    let n = batch_id.to_string();
    assert_eq!(facts_rows_of_commit(&facts_dir, &commit), vec![(None, Some(n.clone())), (Some("data_skipped".to_string()), Some(n))]);
    assert_eq!(rt.block_on(s.count("bronze", &format!("_batch_id = {batch_id} AND _operation <> 0"))), 6);
}

// ---------------------------------------------------------------------------
// 28.101

/// 28.101 (deliberately changed: chunk rows go to data files as they are
/// read; only the add actions wait for the commit). One connection reads
/// chunks of 10 rows at 10 rows a second; wave 0 sets the pace, so wave 1
/// takes every chunk left. The child sleeps once wave 1 is read, before its
/// bronze commit: the log holds no commit of wave 1, yet bronze's folder
/// holds data files no commit adds, one per chunk of the wave, holding its
/// snapshot rows; their write times lie at least half a second apart (each
/// chunk's file was written when that chunk was read, not all at the end).
/// The wave's commit then adds exactly those files. Catches rows held in
/// memory (or anywhere) until the commit and written by it.
#[test]
fn a_waves_chunks_are_in_data_files_as_they_are_read_and_its_commit_only_adds_them() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Scenario::new(50, ONE_READER);
    rt.block_on(s.stream()).unwrap();
    s.db.set_config_value("conn_rows_per_s", &ROWS_PER_SECOND.to_string()).unwrap();
    let first = rt.block_on(backfill(&s, BackfillArgs { max_waves: Some(1), ..Default::default() })).unwrap();
    assert_eq!((first.waves, first.chunks_done), (1, 1), "wave 0 is one chunk (no pace yet): {first:?}");
    let snapshot = first.snapshot.unwrap();
    let left = first.chunks_total - first.chunks_done;
    assert!(left >= 3, "{first:?}");
    let bronze_dir = s.path().join("bronze");
    assert!(uncommitted_files(&bronze_dir).is_empty());

    let mut child = Running::spawn(&s, &["backfill", "--max-waves", "1"], "chunked.before_wave_bronze=sleep(6000)");
    let read = child.wait_for("wave read");
    assert!(read.contains("wave=1"), "{read}");
    let wave_app = format!("items#snap.{}", snapshot.to_hex());
    assert!(txn_commit(&bronze_dir, &wave_app, 1).is_none(), "wave 1 is read, not committed");
    let written = uncommitted_files(&bronze_dir);
    // chunk -> (the newest write time of its files, its rows)
    let mut chunk_files: BTreeMap<i64, (SystemTime, usize)> = BTreeMap::new();
    for f in &written {
        let mut chunks = BTreeSet::new();
        let rows = parquet_text(f, &["_operation", "_snapshot", "_chunk"]);
        for r in &rows {
            assert_eq!((r[0].as_deref(), r[1].clone()), (Some("0"), Some(snapshot.to_hex())), "{}: a snapshot row of S", f.display());
            chunks.insert(r[2].as_deref().unwrap().parse::<i64>().unwrap());
        }
        assert_eq!(chunks.len(), 1, "{}: one chunk a file: {chunks:?}", f.display());
        let at = std::fs::metadata(f).unwrap().modified().unwrap();
        let e = chunk_files.entry(*chunks.iter().next().unwrap()).or_insert((at, 0));
        e.0 = e.0.max(at);
        e.1 += rows.len();
    }
    assert_eq!(chunk_files.len(), left, "every chunk of wave 1 is in files before the commit: {chunk_files:?}");
    let rows_written: usize = chunk_files.values().map(|c| c.1).sum();
    assert_eq!(rows_written as i64, 50 - first.rows, "the rows left after wave 0");
    // One connection reads the chunks one after another, each for at least
    // its rows / ROWS_PER_SECOND: a file written as its chunk was read is
    // that much younger than the one before it.
    let mut times: Vec<(SystemTime, usize)> = chunk_files.values().copied().collect();
    times.sort();
    for w in times.windows(2) {
        let gap = w[1].0.duration_since(w[0].0).unwrap();
        let least = Duration::from_secs_f64(w[1].1 as f64 / ROWS_PER_SECOND as f64 / 2.0);
        assert!(gap >= least, "chunk files written {gap:?} apart (at least {least:?} expected): not as each chunk was read ({times:?})");
    }

    let (code, j, err) = child.finish();
    assert_eq!(code, 0, "{j}\n{err}");
    assert_eq!(j["waves"], 1, "{j}");
    let commit = txn_commit(&bronze_dir, &wave_app, 1).expect("wave 1 committed");
    let added: BTreeSet<String> = commit.adds.iter().cloned().collect();
    let names: BTreeSet<String> = written.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(added, names, "the commit adds the files the reads wrote, and nothing else");
    assert!(uncommitted_files(&bronze_dir).is_empty());

    s.db.set_config_value("conn_rows_per_s", "null").unwrap();
    rt.block_on(backfill_until_done(&s));
    assert_eq!(rt.block_on(snapshot_ids(&s, snapshot)), table_ids(&s), "every row of the table once");
}

// ---------------------------------------------------------------------------
// 28.102

/// 28.102: one connection reads chunks of 10 rows at 10 rows a second, so a
/// chunk takes at least a second and wave 0 sets a pace of a second or more;
/// waves would take 100 s of chunks (every chunk left). With `max_seconds =
/// 3.5` the call stops for the time limit, between waves: every wave it
/// committed is whole (one chunk per round), none has more chunks than 3.5 s
/// hold at a chunk's least read time, and all of them together have at most
/// one chunk more than that (the wave in reading when the time ran out; the
/// reads are one after another). Bronze holds the rows of exactly the
/// recorded chunks. Catches the wave size not capped by the time left, the
/// limit checked only when the snapshot is done, or a wave cut in the middle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_seconds_caps_each_wave_and_stops_between_waves() {
    let s = Scenario::new(100, ONE_READER);
    s.stream().await.unwrap();
    s.db.set_config_value("conn_rows_per_s", &ROWS_PER_SECOND.to_string()).unwrap();
    let first = backfill(&s, BackfillArgs { max_waves: Some(1), ..Default::default() }).await.unwrap();
    assert_eq!((first.waves, first.chunks_done), (1, 1), "{first:?}");
    let snapshot = first.snapshot.unwrap();
    let last_chunk = first.chunks_total as i64 - 1;
    let limit = 3.5;
    let r = backfill(&s, BackfillArgs { max_seconds: Some(limit), ..Default::default() }).await.unwrap();
    s.db.set_config_value("conn_rows_per_s", "null").unwrap();
    assert!(!r.done, "{r:?}");
    assert_eq!(r.reason.as_deref(), Some("max_seconds reached"), "{r:?}");
    assert!(r.waves >= 1, "the call committed a wave: {r:?}");

    let rows = facts(&s).await;
    let chunk_rows = events(&rows, "snapshot_chunk");
    let min_rows = chunk_rows.iter().filter(|c| detail_i64(c, "chunk") != last_chunk).filter_map(|c| c.rows).min().unwrap();
    assert!(min_rows >= 5, "chunks of about 10 rows: {chunk_rows:?}");
    let chunk_seconds = min_rows as f64 / ROWS_PER_SECOND as f64;
    let cap = (limit / chunk_seconds).floor() as usize;
    let mut waves: BTreeMap<i64, Vec<&FactRow>> = BTreeMap::new();
    for c in chunk_rows.iter().copied() {
        waves.entry(detail_i64(c, "wave")).or_default().push(c);
    }
    let of_call: Vec<(&i64, &Vec<&FactRow>)> = waves.iter().filter(|(w, _)| **w >= 1).collect();
    assert_eq!(of_call.len(), r.waves as usize, "{waves:?}");
    let mut read = 0;
    for (w, cs) in &of_call {
        let rounds = detail_i64(cs[0], "rounds") as usize;
        assert!(cs.iter().all(|c| detail_i64(c, "rounds") as usize == rounds), "wave {w}: {cs:?}");
        if !cs.iter().any(|c| detail_i64(c, "chunk") == last_chunk) {
            assert_eq!(cs.len(), rounds, "wave {w} is whole: one chunk a round on one connection");
        }
        assert!(cs.len() <= cap.max(1), "wave {w} has {} chunks; {limit} s hold {cap} at {chunk_seconds} s a chunk", cs.len());
        read += cs.len();
    }
    assert!(read <= cap + 1, "{read} chunks read in a call of {limit} s at {chunk_seconds} s or more a chunk");
    assert_eq!(r.chunks_done, 1 + read, "{r:?}");

    let recorded: BTreeSet<i64> = chunk_rows.iter().map(|c| detail_i64(c, "chunk")).collect();
    let ctx = s.context().await.unwrap();
    let sql = format!("SELECT DISTINCT _chunk FROM t WHERE _operation = 0 AND _snapshot = '{}'", snapshot.to_hex());
    let mut in_bronze = BTreeSet::new();
    for b in delta::query(&ctx.bronze, &sql).await.unwrap() {
        let a = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        in_bronze.extend((0..a.len()).map(|i| a.value(i)));
    }
    assert_eq!(in_bronze, recorded, "bronze holds the rows of the recorded chunks only");

    backfill_until_done(&s).await;
    assert_eq!(snapshot_ids(&s, snapshot).await, table_ids(&s), "every row of the table once");
}
