//! Two rules of adr-0028 that no test covered (rows marked UNTESTED in
//! docs/CONFORMANCE.md), on the simulator:
//! - P1 (28.1): a chunk's stamp is the max LSN read before its SELECT, so
//!   the read sees every commit up to the stamp, and a commit after the read
//!   ranks above the chunk's rows;
//! - 28.134, the recovery path: a chunked re-snapshot crashed inside its open
//!   reuses the recorded open on rerun when the crash came after the open
//!   row (the commit point), opens anew at a new S when it came before, and
//!   opens a newer one, a generation on, once cleanup has passed it.
//!
//! Expectations come from the simulator's own rows and LSNs, the facts and
//! plans rows and bronze's rows read here; bronze is compared with the
//! simulator by `Scenario::verify` and silver with the table, every column,
//! through `common::model`. No failpoint is armed in this process (the file
//! runs in the shared `suite` binary): the crashes run the command-line
//! binary as a child with `MSSQL_CDC_FAILPOINTS` set.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use common::model::{delta_rows, source_rows, Multiset};
use common::{item_row, items_spec, Scenario};
use deltalake::arrow::array::{Array, Int64Array, StringArray};
use futures::StreamExt;
use mssql_cdc::delta::{self, facts::FactRow, plans};
use mssql_cdc::engine::chunked::{self, BackfillArgs, BackfillResult};
use mssql_cdc::engine::{self, apply, Context};
use mssql_cdc::lsn::Lsn;
use mssql_cdc::sim::SimDb;
use mssql_cdc::source::{BatchStream, SharedSource, SnapshotRead, SourceError, TableName};
use mssql_cdc::types::{Key, SqlValue};
use serde_json::{json, Value};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A chunked bootstrap read by one connection in chunks of 10 rows, one
/// chunk a wave (target 0 s: one round), with silver.
const ONE_CHUNK_A_WAVE: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 1\nchunk_rows = 10\n\
                                target_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n";

/// A chunked bootstrap and chunked re-snapshots after a data loss, with silver.
const CHUNKED_RECOVERY: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 15\n\
                                target_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";

// ---------------------------------------------------------------------------
// Reading the facts, the plans, bronze and silver.

async fn facts(s: &Scenario) -> Vec<FactRow> {
    let ctx = s.context().await.unwrap();
    engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
}

fn events<'a>(rows: &'a [FactRow], name: &str) -> Vec<&'a FactRow> {
    rows.iter().filter(|r| r.event.as_deref() == Some(name)).collect()
}

/// The S of every chunked `snapshot_open` facts row of a generation.
fn chunked_opens(rows: &[FactRow], generation: i32) -> Vec<Lsn> {
    let mut out: Vec<Lsn> = rows
        .iter()
        .filter(|r| r.event.as_deref() == Some("snapshot_open") && r.generation == generation)
        .filter(|r| r.detail.as_ref().is_some_and(|d| d["mode"] == "chunked"))
        .filter_map(|r| r.min_lsn)
        .collect();
    out.sort();
    out
}

/// True when a `bootstrap` or `resnapshot` row ends at or after `s`.
fn completed(rows: &[FactRow], s: Lsn) -> bool {
    rows.iter()
        .filter(|r| matches!(r.event.as_deref(), Some("bootstrap") | Some("resnapshot")))
        .filter_map(|r| r.max_lsn)
        .any(|m| m >= s)
}

/// `recovery` rows written towards generation `target`.
fn recoveries(rows: &[FactRow], target: i32) -> usize {
    events(rows, "recovery").into_iter().filter(|r| r.detail.as_ref().is_some_and(|d| d["target_generation"] == target)).count()
}

/// The stamp the facts record for each chunk of snapshot `snapshot`: chunk -> L.
fn chunk_stamps(rows: &[FactRow], snapshot: Lsn) -> BTreeMap<i64, Lsn> {
    events(rows, "snapshot_chunk")
        .into_iter()
        .filter(|r| r.detail.as_ref().is_some_and(|d| d["snapshot"] == json!(snapshot.to_hex())))
        .map(|r| (r.detail.as_ref().unwrap()["chunk"].as_i64().unwrap(), r.min_lsn.expect("a chunk row's stamp")))
        .collect()
}

/// Chunks of `snapshot` the facts record with at least one row.
fn chunks_with_rows(rows: &[FactRow], snapshot: Lsn) -> usize {
    events(rows, "snapshot_chunk")
        .into_iter()
        .filter(|r| r.detail.as_ref().is_some_and(|d| d["snapshot"] == json!(snapshot.to_hex())))
        .filter(|r| r.rows.unwrap_or(0) > 0)
        .count()
}

/// Each generation's batches tile the LSNs after its chunked open's S:
/// batch ids 0, 1, … each once, each range starting right after the one
/// before, nothing skipped.
fn assert_batches_tile(rows: &[FactRow]) {
    assert!(events(rows, "data_skipped").is_empty(), "no range was skipped");
    let generations: BTreeSet<i32> = rows.iter().filter(|r| r.event.is_none() && r.batch_id.is_some()).map(|r| r.generation).collect();
    for g in generations {
        let opens = chunked_opens(rows, g);
        assert_eq!(opens.len(), 1, "generation {g} streams from its one chunked open: {opens:?}");
        let mut batches: Vec<&FactRow> = rows.iter().filter(|r| r.generation == g && r.event.is_none() && r.batch_id.is_some()).collect();
        batches.sort_by_key(|r| r.batch_id);
        let mut from = opens[0].increment();
        for (i, b) in batches.iter().enumerate() {
            assert_eq!(b.batch_id, Some(i as i64), "generation {g}: batch ids from 0 without a hole or a repeat");
            assert_eq!(b.min_lsn, Some(from), "generation {g} batch {i}: a gap or an overlap");
            from = b.max_lsn.expect("a batch's end").increment();
        }
    }
}

/// The S of every `snapshot_open` row of the plans table.
async fn plans_opens(s: &Scenario) -> BTreeSet<Lsn> {
    let ctx = s.context().await.unwrap();
    let t = delta::open_existing(&plans::location_for(&ctx.workflow.target.bronze), &Default::default()).await.unwrap().expect("the plans table");
    plans::from_batches(&delta::query(&t, "SELECT * FROM t").await.unwrap())
        .unwrap()
        .into_iter()
        .filter(|r| r.event == "snapshot_open")
        .map(|r| r.snapshot)
        .collect()
}

/// Bronze's snapshot rows per S they belong to: S -> rows.
async fn bronze_snapshots(s: &Scenario) -> BTreeMap<Lsn, i64> {
    let ctx = s.context().await.unwrap();
    let mut out = BTreeMap::new();
    for b in delta::query(&ctx.bronze, "SELECT _snapshot, COUNT(*) AS n FROM t WHERE _operation = 0 GROUP BY _snapshot").await.unwrap() {
        let snap = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
        let n = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        for i in 0..n.len() {
            assert!(!snap.is_null(i), "a snapshot row without _snapshot");
            out.insert(Lsn::parse(snap.value(i)).unwrap(), n.value(i));
        }
    }
    out
}

/// Bronze's rows of snapshot `snapshot`: id -> (qty, `_start_lsn`, `_chunk`), each id once.
async fn chunk_rows_of(s: &Scenario, snapshot: Lsn) -> BTreeMap<i64, (i64, Lsn, i64)> {
    let ctx = s.context().await.unwrap();
    let sql = format!(
        "SELECT CAST(id AS BIGINT) AS id, CAST(qty AS BIGINT) AS qty, _start_lsn, _chunk FROM t WHERE _operation = 0 AND _snapshot = '{}'",
        snapshot.to_hex()
    );
    let mut out = BTreeMap::new();
    for b in delta::query(&ctx.bronze, &sql).await.unwrap() {
        let id = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let qty = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        let start = b.column(2).as_any().downcast_ref::<StringArray>().unwrap();
        let chunk = b.column(3).as_any().downcast_ref::<Int64Array>().unwrap();
        for i in 0..id.len() {
            let before = out.insert(id.value(i), (qty.value(i), Lsn::parse(start.value(i)).unwrap(), chunk.value(i)));
            assert!(before.is_none(), "id {} is in snapshot {snapshot} twice", id.value(i));
        }
    }
    out
}

/// Silver's rows, every captured column.
async fn silver_rows(s: &Scenario) -> Multiset {
    delta_rows(&s.path().join("silver").to_string_lossy(), &items_spec(&s.table).columns, "true").await
}

/// The simulator's rows, every column; only those whose id is in `ids` when given.
async fn table_rows(s: &Scenario, ids: Option<&BTreeSet<i64>>) -> Multiset {
    let all = source_rows(&s.db, &s.table, &items_spec(&s.table).columns).await;
    match ids {
        None => all,
        Some(ids) => all
            .into_iter()
            .filter(|(text, _)| ids.contains(&text.split(" | ").next().unwrap().parse::<i64>().unwrap()))
            .collect(),
    }
}

async fn apply_silver(s: &Scenario) {
    let mut ctx = s.context().await.unwrap();
    apply::run(&mut ctx).await.unwrap();
}

/// `backfill` until done; returns the last call's result.
async fn backfill_until_done(s: &Scenario) -> BackfillResult {
    for _ in 0..50 {
        let mut ctx = s.context().await.unwrap();
        let r = chunked::backfill(&mut ctx, &BackfillArgs::default()).await.unwrap();
        if r.done {
            return r;
        }
    }
    panic!("backfill did not finish in 50 calls");
}

// ---------------------------------------------------------------------------
// 28.1

/// A commit made around one chunk's read.
#[derive(Debug, Clone)]
struct AroundRead {
    /// The first id of the chunk's range, updated after the stamp and before the SELECT.
    before_id: i64,
    before_lsn: Lsn,
    /// Its qty after that update.
    before_qty: i64,
    /// The last id of the range, updated once the read had ended.
    after_id: i64,
    after_lsn: Lsn,
    /// Its qty before and after that update.
    after_old_qty: i64,
    after_qty: i64,
    /// The max LSN once the update after the read was captured (and an idle
    /// capture scan ran past it): what a stamp read after the read would be.
    late_max: Lsn,
}

/// The simulator as a source, except that each chunk read (`snapshot_read`)
/// commits around itself through the simulator's own writer: an update of
/// the first row of the chunk's range before the SELECT (after the wave's
/// stamp, which `backfill` read before calling here), and, once the read's
/// whole stream is taken, an update of the last row of the range. Both are
/// captured at once, so the change table holds them. The read's batches are
/// handed to the caller only after that, so the second commit is certainly
/// after the read.
struct CommitsAroundReads {
    db: SimDb,
    table: TableName,
    version: AtomicI64,
    reads: Mutex<Vec<AroundRead>>,
}

impl CommitsAroundReads {
    /// Updates `id` to a version no other write used and captures it:
    /// (commit LSN, qty before, qty after).
    fn update(&self, id: i64) -> (Lsn, i64, i64) {
        let version = self.version.fetch_add(1, Ordering::SeqCst);
        let key: Key = vec![SqlValue::Int(id)];
        let mut old: Option<Vec<SqlValue>> = None;
        let lsn = self
            .db
            .transaction(|tx| {
                old = tx.get(&self.table, &key)?;
                tx.update(&self.table, &key, item_row(id, version))
            })
            .unwrap();
        common::settle(&self.db);
        let old_qty = old.expect("the row is in the table")[2].as_i64().expect("qty is an int");
        (lsn, old_qty, id * 10 + version)
    }

    fn reads(&self) -> Vec<AroundRead> {
        self.reads.lock().unwrap().clone()
    }
}

#[async_trait]
impl common::Hooks for CommitsAroundReads {
    async fn snapshot_read(&self, inner: &SharedSource, read: &SnapshotRead) -> Result<BatchStream, SourceError> {
        let ids: Vec<i64> =
            self.db.keys(&read.table).unwrap().into_iter().filter(|k| read.range.contains(k)).map(|k| k[0].as_i64().unwrap()).collect();
        let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
            return inner.snapshot_read(read).await;
        };
        // After the wave's stamp, before the SELECT.
        let (before_lsn, _, before_qty) = self.update(first);
        let mut stream = inner.snapshot_read(read).await?;
        let mut batches = Vec::new();
        while let Some(b) = stream.next().await {
            batches.push(b);
        }
        drop(stream);
        // After the read: the simulator's read transaction ended with its stream.
        let (after_lsn, after_old_qty, after_qty) = self.update(last);
        // An idle capture scan past it, so a max LSN read now lies strictly above it.
        self.db.advance_clock(Duration::from_secs(2)).unwrap();
        common::settle(&self.db);
        let late_max = self.db.max_lsn().unwrap().expect("capture has run");
        self.reads.lock().unwrap().push(AroundRead { before_id: first, before_lsn, before_qty, after_id: last, after_lsn, after_old_qty, after_qty, late_max });
        Ok(futures::stream::iter(batches).boxed())
    }
}

/// One `backfill` call in process, its chunk reads through `spy`.
async fn backfill_through(s: &Scenario, spy: &Arc<common::Wrapped<CommitsAroundReads>>, args: BackfillArgs) -> BackfillResult {
    let mut ctx = s.context().await.unwrap();
    ctx.source = spy.clone();
    chunked::backfill(&mut ctx, &args).await.unwrap()
}

/// 28.1 (P1): a chunked bootstrap of 40 rows, one 10-row chunk a wave, each
/// chunk read through a source that commits around the read: after the
/// wave's stamp and before the SELECT it updates the range's first row (B),
/// and once the read has ended the range's last row (A), both captured at
/// once. Every chunk's rows in bronze carry the stamp the facts record for
/// it, at or after S and below B's commit; the chunk holds B's new image (the
/// read sees every commit up to its start) and A's old one. The stream then
/// brings both changes; silver, applied after two waves and at the end,
/// equals the table (every column, the rows of the chunks read so far
/// midway), and bronze's rebuild equals the simulator's table.
///
/// Why a stamp taken after the read would fail it: that stamp would be a max
/// LSN read once A's update was captured (the source here also lets an idle
/// capture scan run past it, so it would lie strictly above A's commit, as
/// `late_max` shows). The assertion "stamp < B's commit" fails at once; and
/// beyond it, A's change row would carry an LSN below the stamp, so the
/// rebuild rule (latest by `_start_lsn`) would rank the chunk row's old image
/// of A over A's update: bronze's rebuild and silver would hold A's old
/// values where the table holds the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_read_sees_commits_between_its_stamp_and_its_select_and_a_commit_after_it_ranks_above_its_rows() {
    let s = Scenario::new(40, ONE_CHUNK_A_WAVE);
    s.stream().await.unwrap();
    let inner = s.context().await.unwrap().source.clone();
    let spy = Arc::new(common::Wrapped::new(
        inner,
        CommitsAroundReads { db: SimDb::open(s.db.path()).unwrap(), table: s.table.clone(), version: AtomicI64::new(100), reads: Mutex::new(Vec::new()) },
    ));

    let first = backfill_through(&s, &spy, BackfillArgs { max_waves: Some(2), ..Default::default() }).await;
    assert!(!first.done && first.chunks_total >= 4, "two waves of a plan of four chunks or more: {first:?}");
    assert_eq!((first.waves, first.chunks_done), (2, 2), "{first:?}");
    let snapshot = first.snapshot.expect("the snapshot backfill works on");
    assert_eq!(spy.hooks.reads().len(), chunks_with_rows(&facts(&s).await, snapshot), "one read per chunk with rows, each with its two commits");
    assert!(!spy.hooks.reads().is_empty());

    // Midway: the stream brings the commits made around the reads; silver
    // takes the two waves with every change of their keys after S.
    s.stream_until_caught_up().await;
    apply_silver(&s).await;
    let read_so_far: BTreeSet<i64> = chunk_rows_of(&s, snapshot).await.keys().copied().collect();
    assert!(!read_so_far.is_empty());
    assert_eq!(silver_rows(&s).await, table_rows(&s, Some(&read_so_far)).await, "silver holds the chunks read so far as the table has them now");

    let last = {
        let mut r = None;
        for _ in 0..20 {
            let b = backfill_through(&s, &spy, BackfillArgs::default()).await;
            if b.done {
                r = Some(b);
                break;
            }
        }
        r.expect("backfill finishes")
    };
    assert_eq!(last.snapshot, Some(snapshot));
    let rows = facts(&s).await;
    assert_eq!(events(&rows, "bootstrap").len(), 1, "the snapshot completed");
    let reads = spy.hooks.reads();
    assert_eq!(reads.len(), chunks_with_rows(&rows, snapshot), "every chunk with rows was read once, through the spy");
    assert!(reads.len() >= 3, "{reads:?}");

    let in_bronze = chunk_rows_of(&s, snapshot).await;
    assert_eq!(in_bronze.len() as u64, s.db.row_count(&s.table).unwrap(), "every row of the table read once (no insert or delete ran)");
    let stamps = chunk_stamps(&rows, snapshot);
    for r in &reads {
        let (b_qty, b_stamp, b_chunk) = in_bronze[&r.before_id];
        let (a_qty, a_stamp, a_chunk) = in_bronze[&r.after_id];
        assert_eq!((a_chunk, a_stamp), (b_chunk, b_stamp), "one chunk, one stamp: {r:?}");
        assert_eq!(stamps.get(&b_chunk), Some(&b_stamp), "the facts record the stamp bronze's rows carry: {r:?}");
        assert!(b_stamp >= snapshot, "P2: the stamp {b_stamp} is at or after S {snapshot}");
        assert!(
            b_stamp < r.before_lsn,
            "P1: the stamp {b_stamp} was read before the SELECT, so it lies below the commit {} made between the two: {r:?}",
            r.before_lsn
        );
        assert_eq!(b_qty, r.before_qty, "the read saw the commit made after its stamp, before its SELECT: {r:?}");
        assert_eq!(a_qty, r.after_old_qty, "the read did not see the commit made after it: {r:?}");
        assert!(r.before_lsn < r.after_lsn && r.after_lsn < r.late_max, "a stamp read after the read would lie above the later commit: {r:?}");
        assert_ne!(r.after_qty, r.after_old_qty);
    }

    s.stream_until_caught_up().await;
    for r in &reads {
        for lsn in [r.before_lsn, r.after_lsn] {
            assert!(s.count("bronze", &format!("_operation <> 0 AND _start_lsn = '{}'", lsn.to_hex())).await >= 1, "bronze holds the change at {lsn}");
        }
    }
    assert_eq!(s.duplicate_change_rows().await, 0);
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "bronze's rebuild against the simulator's table: {cmp:?}");
    apply_silver(&s).await;
    assert_eq!(silver_rows(&s).await, table_rows(&s, None).await, "silver equals the table, every column");
    // The later commit's image is the one that stands, in the table and so in silver.
    let table = table_rows(&s, None).await;
    for r in &reads {
        let row = table.keys().find(|t| t.split(" | ").next() == Some(r.after_id.to_string().as_str())).expect("the row is in the table");
        assert!(row.contains(&format!(" | {} | ", r.after_qty)), "id {} holds qty {} (the update after the read): {row}", r.after_id, r.after_qty);
    }
}

// ---------------------------------------------------------------------------
// 28.134 (recovery path)

/// The stream stops; changes happen; the retention passes; more changes;
/// cleanup (3 days) purges the first ones, which the stream has not read.
fn stop_past_the_retention(s: &mut Scenario) {
    s.changes(8);
    common::settle(&s.db);
    s.db.advance_clock(DAY * 4).unwrap();
    s.changes(6);
    common::settle(&s.db);
    assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "cleanup ran");
}

fn min_lsn(s: &Scenario) -> Lsn {
    s.db.capture_instances(&s.table).unwrap().pop().unwrap().start_lsn.expect("the instance has a start")
}

/// `mssql-cdc stream` as a child process with one failpoint armed to fail
/// the step there: (exit code, the JSON line, stderr).
fn stream_crashing_at(s: &Scenario, point: &str) -> (Option<i32>, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .arg("--workflow")
        .arg(&s.wf_path)
        .arg("stream")
        .env("MSSQL_CDC_LOG", "warn")
        .env("MSSQL_CDC_FAILPOINTS", format!("{point}=return"))
        .current_dir(s.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let j: Value = serde_json::from_str(stdout.lines().last().unwrap_or("null")).unwrap_or(Value::Null);
    (out.status.code(), j, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// 28.134, the recovery path (deliberately changed: the open row is the
/// commit point). A chunked bootstrap is read and applied; the stream stops
/// past the retention; its `stream` call recovers in chunked mode and is
/// crashed (a child process, `MSSQL_CDC_FAILPOINTS`) at each failpoint of
/// the recovery's open: after the `recovery` row (no open yet), after the
/// open's plans row (S1 recorded in the plans only), and after the open's
/// facts row (generation 1 live at S1). The source then moves on (commits,
/// so a fresh open would take a newer S), and `stream` is called again:
/// - after the recovery row: the recovery resumes (no second row) and opens
///   at the max LSN of now, above the crash's;
/// - after the plans row: it resumes and opens anew at a new S above S1; S1's
///   plans row stays, read by nobody (bronze never holds a row of S1);
/// - after the open row: no second recovery; generation 1 streams from S1,
///   the recorded open, whose plans row is the only new one;
/// - after the open row, with cleanup then passing S1: generation 1 has lost
///   its changes after S1, so a second recovery opens a newer snapshot, a
///   generation on (interval 0, so the anti-loop guard lets it).
///
/// Every case: one `snapshot_open` row per generation, one open not
/// completed in the stream's generation (`status` lists it alone), one
/// `recovery` row per generation recovered to; after `backfill` one
/// `resnapshot` row, at the open's S; bronze's snapshot rows only of the
/// bootstrap's S and that one, each id once; the facts' batch ranges tile
/// each generation from its S; bronze's rebuild and silver equal the table,
/// every column. Catches an open before the commit point taken as the
/// generation's (a rerun reading S1's plans row, or none written and the
/// stream lost), a second open or recovery written on rerun after the
/// commit point, and an open cleanup passed being reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_recovery_crashed_in_its_open_reuses_the_recorded_open_or_opens_anew() {
    for (point, passed) in
        [("recover.after_recovery_row", false), ("chunked.after_open_plans", false), ("chunked.after_open", false), ("chunked.after_open", true)]
    {
        let case = format!("{point}{}", if passed { " then cleanup past S1" } else { "" });
        let mut s = Scenario::new(40, CHUNKED_RECOVERY);
        s.stream().await.unwrap();
        backfill_until_done(&s).await;
        s.changes(4);
        common::settle(&s.db);
        s.stream_until_caught_up().await;
        apply_silver(&s).await;
        let rows = facts(&s).await;
        let boot = events(&rows, "bootstrap");
        assert_eq!(boot.len(), 1, "{case}");
        let s0 = boot[0].max_lsn.unwrap();
        assert_eq!(plans_opens(&s).await, BTreeSet::from([s0]), "{case}");

        stop_past_the_retention(&mut s);
        let (code, j, err) = stream_crashing_at(&s, point);
        assert_eq!(code, Some(75), "{case}: the failpoint fails the step: {j}\n{err}");
        assert!(j["error"].as_str().is_some_and(|e| e.contains(point)), "{case}: {j}\n{err}");
        let crashed_max = s.db.max_lsn().unwrap().unwrap();
        let rows = facts(&s).await;
        assert_eq!(recoveries(&rows, 1), 1, "{case}: the recovery row is written before the open");
        let recorded: BTreeSet<Lsn> = plans_opens(&s).await.into_iter().filter(|l| *l != s0).collect();
        let opens1 = chunked_opens(&rows, 1);
        let s1 = recorded.iter().next().copied();
        match point {
            "recover.after_recovery_row" => assert!(recorded.is_empty() && opens1.is_empty(), "{case}: no open yet: {recorded:?} {opens1:?}"),
            "chunked.after_open_plans" => {
                assert_eq!(recorded.len(), 1, "{case}: the open's plans row");
                assert!(opens1.is_empty(), "{case}: no open row yet: {opens1:?}");
            }
            _ => {
                assert_eq!(recorded.len(), 1, "{case}: the open's plans row");
                assert_eq!(opens1, vec![s1.unwrap()], "{case}: the open row at the plans row's S");
            }
        }
        if let Some(s1) = s1 {
            assert!(s1 <= crashed_max, "{case}");
        }

        // The source moves on: an open taken now would be at a newer S.
        s.changes(3);
        common::settle(&s.db);
        let mut wf = s.workflow();
        if passed {
            stop_past_the_retention(&mut s);
            assert!(min_lsn(&s) > s1.unwrap().increment(), "{case}: cleanup passed S1");
            wf.stream.resnapshot_interval_days = 0.0;
        }
        let mut ctx = Context::open(wf).await.unwrap();
        let r = engine::coarse::stream(&mut ctx).await.unwrap();
        let (generation, final_s) = match (point, passed) {
            ("recover.after_recovery_row", _) => {
                let rec = r.recovery.as_ref().unwrap_or_else(|| panic!("{case}: the rerun resumes the recovery: {r:?}"));
                assert_eq!((rec.from_generation, rec.generation, rec.mode, rec.resumed), (0, 1, "chunked", true), "{case}: {rec:?}");
                assert!(rec.snapshot_lsn.unwrap() > crashed_max, "{case}: no open was recorded, so S is the max LSN of the rerun: {rec:?}");
                (1, rec.snapshot_lsn.unwrap())
            }
            ("chunked.after_open_plans", _) => {
                let rec = r.recovery.as_ref().unwrap_or_else(|| panic!("{case}: the rerun resumes the recovery: {r:?}"));
                assert_eq!((rec.from_generation, rec.generation, rec.mode, rec.resumed), (0, 1, "chunked", true), "{case}: {rec:?}");
                assert!(rec.snapshot_lsn.unwrap() > s1.unwrap(), "{case}: before the commit point the rerun opens at a new S, not S1: {rec:?}");
                (1, rec.snapshot_lsn.unwrap())
            }
            (_, false) => {
                assert!(r.recovery.is_none(), "{case}: the open row made generation 1 live: nothing to recover: {r:?}");
                (1, s1.unwrap())
            }
            (_, true) => {
                let rec = r.recovery.as_ref().unwrap_or_else(|| panic!("{case}: generation 1 lost its changes after S1: {r:?}"));
                assert_eq!((rec.from_generation, rec.generation, rec.mode, rec.resumed), (1, 2, "chunked", false), "{case}: {rec:?}");
                assert!(rec.snapshot_lsn.unwrap() > s1.unwrap(), "{case}: {rec:?}");
                (2, rec.snapshot_lsn.unwrap())
            }
        };
        assert_eq!(r.generation, generation, "{case}: {r:?}");

        // One open per generation, and one live.
        let rows = facts(&s).await;
        assert_eq!(chunked_opens(&rows, generation), vec![final_s], "{case}");
        if passed {
            assert_eq!(chunked_opens(&rows, 1), vec![s1.unwrap()], "{case}: generation 1's open stays, abandoned");
        }
        assert_eq!(chunked_opens(&rows, 0), vec![s0], "{case}");
        let live: Vec<Lsn> = (0..=generation).flat_map(|g| chunked_opens(&rows, g)).filter(|o| !completed(&rows, *o)).collect();
        let live_now: Vec<Lsn> = live.iter().copied().filter(|o| chunked_opens(&rows, generation).contains(o)).collect();
        assert_eq!(live_now, vec![final_s], "{case}: one open in the stream's generation: {live:?}");
        let mut status_ctx = s.context().await.unwrap();
        let status = engine::status::run(&mut status_ctx).await.unwrap();
        assert_eq!(status["open_snapshots"], json!([final_s]), "{case}: {status}");
        assert_eq!(recoveries(&rows, 1), 1, "{case}: the recovery row is written once");
        assert_eq!(recoveries(&rows, 2), usize::from(passed), "{case}");
        let expected_plans: BTreeSet<Lsn> = match point {
            "recover.after_recovery_row" => BTreeSet::from([s0, final_s]),
            _ => BTreeSet::from([s0, s1.unwrap(), final_s]),
        };
        assert_eq!(plans_opens(&s).await, expected_plans, "{case}");

        let done = backfill_until_done(&s).await;
        assert_eq!((done.snapshot, done.generation), (Some(final_s), generation), "{case}: {done:?}");
        s.changes(4);
        common::settle(&s.db);
        s.stream_until_caught_up().await;
        apply_silver(&s).await;

        let rows = facts(&s).await;
        let resnap = events(&rows, "resnapshot");
        assert_eq!(resnap.len(), 1, "{case}: {resnap:?}");
        assert_eq!((resnap[0].generation, resnap[0].max_lsn), (generation, Some(final_s)), "{case}: {:?}", resnap[0]);
        assert!(resnap[0].lost_to_ts.is_some(), "{case}: the completion carries the gap");
        assert_eq!(events(&rows, "recovery").len(), generation as usize, "{case}");
        let snapshots = bronze_snapshots(&s).await;
        assert_eq!(snapshots.keys().copied().collect::<BTreeSet<Lsn>>(), BTreeSet::from([s0, final_s]), "{case}: {snapshots:?}");
        assert_eq!(chunk_rows_of(&s, final_s).await.len() as i64, snapshots[&final_s], "{case}: each id once in the re-snapshot");
        assert_eq!(s.duplicate_change_rows().await, 0, "{case}");
        assert_eq!(s.duplicate_batch_rows().await, 0, "{case}");
        assert_batches_tile(&rows);
        let cmp = s.verify().await;
        assert_eq!(cmp.differences(), 0, "{case}: bronze's rebuild against the table: {cmp:?}");
        assert_eq!(silver_rows(&s).await, table_rows(&s, None).await, "{case}: silver equals the table, every column");
    }
}
