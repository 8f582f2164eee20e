//! One outcome per micro-batch and per wave, whoever commits it (issue 13's
//! first race), driven through the command line on the simulator: two
//! processes hold the same batch id (or wave), one reads no rows and the
//! other reads rows, each paused by a `sleep` failpoint so the commits land
//! in the order that used to record two outcomes:
//! - the empty call records its outcome first, the call with rows still
//!   holding the batch it read before that;
//! - the call with rows then commits.
//!
//! Each process logs when its read is done (`batch read` / `wave read`, at
//! debug) before it sleeps: the test waits for that line, not for a guessed
//! time, before it changes the source or starts the other call.
//!
//! Checks read the simulator's change table (`CdcSource::changes`, rows made
//! bronze-shaped by `bronze::from_changes`, every column) and the facts and
//! bronze tables themselves.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{failpoint_command, item_row, last_json_line, Running, Scenario};
use deltalake::arrow::array::Array;
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::arrow::util::display::array_value_to_string;
use futures::StreamExt;
use mssql_cdc::delta::{self, bronze, facts::FactRow};
use mssql_cdc::lsn::Lsn;
use mssql_cdc::types::SqlValue;

const FULL: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\n";
const CHUNKED: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                       [stream]\nmax_batch_rows = 1000\n";

/// Runs a step to its end: (exit code, JSON).
fn step(s: &Scenario, args: &[&str]) -> (i32, serde_json::Value) {
    let out = failpoint_command(s, args, None).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    (out.status.code().unwrap_or(-1), last_json_line(&stdout))
}

fn ok(s: &Scenario, args: &[&str]) -> serde_json::Value {
    let (code, j) = step(s, args);
    assert_eq!(code, 0, "{args:?}: {j}");
    j
}

/// This stream's facts rows.
fn facts(rt: &tokio::runtime::Runtime, s: &Scenario) -> Vec<FactRow> {
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        mssql_cdc::engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
    })
}

/// Every column of every row but `skip`, rendered as text, counted (a multiset).
fn render(batches: &[RecordBatch], skip: &[&str]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for b in batches {
        let schema = b.schema();
        let mut names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).filter(|n| !skip.contains(n)).collect();
        names.sort_unstable();
        for i in 0..b.num_rows() {
            let row: Vec<String> = names
                .iter()
                .map(|n| {
                    let a = b.column_by_name(n).unwrap();
                    if a.is_null(i) {
                        format!("{n}=NULL")
                    } else {
                        format!("{n}={}", array_value_to_string(a.as_ref(), i).unwrap())
                    }
                })
                .collect();
            *out.entry(row.join(" ")).or_default() += 1;
        }
    }
    out
}

/// The change table's rows after `after` up to max LSN, as bronze stores them
/// (every column but the batch id, which only the stream assigns).
fn source_changes(rt: &tokio::runtime::Runtime, s: &Scenario, after: Lsn) -> BTreeMap<String, usize> {
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        let schema = ctx.bronze_schema().unwrap();
        let max = ctx.source.max_lsn().await.unwrap().unwrap();
        let mut stream =
            ctx.source.changes(&ctx.instance, after.increment(), max, ctx.row_filter(), 1000).await.unwrap();
        let mut batches = Vec::new();
        while let Some(b) = stream.next().await {
            let b = b.unwrap();
            if b.num_rows() > 0 {
                batches.push(bronze::from_changes(&b, &schema, &ctx.zone, 0, &ctx.instance.name).unwrap());
            }
        }
        render(&batches, &[bronze::BATCH_ID])
    })
}

/// Bronze's change rows (every column but the batch id).
fn bronze_changes(rt: &tokio::runtime::Runtime, s: &Scenario) -> BTreeMap<String, usize> {
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        let batches = delta::query(&ctx.bronze, "SELECT * FROM t WHERE _operation <> 0").await.unwrap();
        render(&batches, &[bronze::BATCH_ID])
    })
}

/// Bronze's change rows per batch id: (count, min start LSN, max start LSN).
fn bronze_batches(rt: &tokio::runtime::Runtime, s: &Scenario) -> BTreeMap<i64, (i64, Lsn, Lsn)> {
    rt.block_on(async {
        use deltalake::arrow::array::{Int64Array, StringArray};
        let ctx = s.context().await.unwrap();
        let batches = delta::query(
            &ctx.bronze,
            "SELECT _batch_id, COUNT(*) AS n, MIN(_start_lsn) AS lo, MAX(_start_lsn) AS hi FROM t WHERE _operation <> 0 GROUP BY _batch_id",
        )
        .await
        .unwrap();
        let mut out = BTreeMap::new();
        for b in &batches {
            let id = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            let n = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
            let lo = b.column(2).as_any().downcast_ref::<StringArray>().unwrap();
            let hi = b.column(3).as_any().downcast_ref::<StringArray>().unwrap();
            for i in 0..b.num_rows() {
                out.insert(id.value(i), (n.value(i), Lsn::parse(lo.value(i)).unwrap(), Lsn::parse(hi.value(i)).unwrap()));
            }
        }
        out
    })
}

/// Bronze holds each captured change exactly once (every column), and the
/// facts' batches tile the stream from S to max LSN: ids 0, 1, … without a
/// hole, each starting right after the previous one's end, each holding
/// exactly the bronze rows of its batch id, all inside its range.
fn assert_one_outcome_per_batch(rt: &tokio::runtime::Runtime, s: &Scenario) {
    let rows = facts(rt, s);
    let snapshot = rows.iter().find(|r| r.event.as_deref() == Some("bootstrap")).and_then(|r| r.max_lsn).expect("a bootstrap row");
    let in_source = source_changes(rt, s, snapshot);
    let in_bronze = bronze_changes(rt, s);
    let twice: Vec<_> = in_bronze.iter().filter(|(_, n)| **n > 1).map(|(r, n)| format!("{n}x {r}")).collect();
    assert!(twice.is_empty(), "bronze holds change rows more than once:\n{}", twice.join("\n"));
    assert_eq!(in_bronze, in_source, "bronze's change rows are the change table's");

    let mut batches: Vec<&FactRow> = rows.iter().filter(|r| r.event.is_none() && r.batch_id.is_some()).collect();
    batches.sort_by_key(|r| r.batch_id);
    let in_bronze = bronze_batches(rt, s);
    let mut end = snapshot;
    for (i, b) in batches.iter().enumerate() {
        let id = b.batch_id.unwrap();
        assert_eq!(id, i as i64, "batch ids run 0, 1, … once each: {:?}", batches.iter().map(|b| b.batch_id).collect::<Vec<_>>());
        let (from, to) = (b.min_lsn.unwrap(), b.max_lsn.unwrap());
        assert_eq!(from, end.increment(), "batch {id} starts right after the previous end {end}");
        assert!(to >= from, "batch {id}: ({from}, {to})");
        let (n, lo, hi) = in_bronze.get(&id).copied().unwrap_or((0, to, to));
        assert_eq!(b.rows, Some(n), "batch {id}: the facts' rows are bronze's rows of the batch");
        if n > 0 {
            assert!(lo >= from && hi <= to, "batch {id}: bronze's rows ({lo} ..= {hi}) lie outside its range ({from} ..= {to})");
        }
        end = to;
    }
    let unrecorded: Vec<_> = in_bronze.keys().filter(|id| **id >= batches.len() as i64).collect();
    assert!(unrecorded.is_empty(), "bronze rows of batches the facts do not record: {unrecorded:?}");
    let max = s.db.max_lsn().unwrap().unwrap();
    assert_eq!(end, max, "the batches reach max LSN");
}

/// An empty batch beside one with rows for the same batch id: the empty call
/// records its outcome first while the call with rows still holds the batch
/// id it read. Bronze's txn decides: the empty batch won it, so the call with
/// rows exits 75 and writes nothing, and the next call reads those rows as
/// the next batch, once. (Before, the call with rows committed them to
/// bronze, found facts N applied and ignored it: facts ended N before them,
/// and the next call wrote them again.)
#[test]
fn an_empty_batch_and_one_with_rows_for_the_same_id_have_one_outcome() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(20, FULL);
    ok(&s, &["stream"]);
    s.changes(6);
    common::settle(&s.db);
    assert_eq!(ok(&s, &["stream"])["caught_up"], true);
    // An idle capture scan: max LSN moves past the position, no change of the table.
    s.db.advance_clock(Duration::from_secs(2)).unwrap();
    common::settle(&s.db);

    // A reads (position, max] with no rows, then sleeps before its commits.
    let mut empty = Running::spawn(&s, &["stream"], "stream.after_read=sleep(6000)");
    let read = empty.wait_for("batch read");
    assert!(read.contains("rows=0"), "the first call reads nothing: {read}");
    let empty_read_at = Instant::now();
    // Changes arrive; B reads them under the same batch id and sleeps longer.
    s.changes(5);
    common::settle(&s.db);
    let mut with_rows = Running::spawn(&s, &["stream"], "stream.after_read=sleep(9000)");
    let read = with_rows.wait_for("batch read");
    assert!(!read.contains("rows=0"), "the second call reads the changes: {read}");
    assert!(
        !empty.has_exited() && empty_read_at.elapsed() < Duration::from_secs(5),
        "the second call must read before the first one commits (took {:?}): the machine is too slow for this race",
        empty_read_at.elapsed()
    );
    let (code_empty, j_empty, err_empty) = empty.finish();
    let (code_rows, j_rows, err_rows) = with_rows.finish();

    // Whoever won, the next calls read the rest once.
    for _ in 0..10 {
        if ok(&s, &["stream"])["caught_up"] == true {
            break;
        }
    }
    assert_one_outcome_per_batch(&rt, &s);
    assert_eq!(code_empty, 0, "the empty batch won bronze's txn: {j_empty}\n{err_empty}");
    assert_eq!(code_rows, 75, "the call with rows lost it: call again, nothing written: {j_rows}\n{err_rows}");
    assert!(j_rows["error"].as_str().unwrap_or_default().contains("another writer"), "{j_rows}");
}

/// The same race for `backfill`: a wave whose chunks all read no rows beside
/// a call that read rows for the same wave (rows inserted into its chunks'
/// range between the two reads). The empty wave's bronze commit decides; the
/// other call exits 75, and every chunk's facts row counts exactly the rows
/// bronze holds for it. (Before, the facts said 0 rows for a chunk whose rows
/// the other call had committed to bronze.)
#[test]
fn an_empty_wave_and_one_with_rows_for_the_same_wave_have_one_outcome() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Scenario::new(40, CHUNKED);
    ok(&s, &["stream"]);
    // The plan and wave 0 (chunks 0 and 1, two connections, one round).
    let j = ok(&s, &["backfill", "--max-waves", "1"]);
    assert_eq!(j["waves"], 1, "{j}");
    let chunks_total = j["chunks_total"].as_i64().unwrap();
    assert!(chunks_total >= 4, "the race needs a second wave: {j}");
    // Empty the rest of the key range, so wave 1 reads no rows.
    let table = s.table.clone();
    for id in 21..=40 {
        s.db.transaction(|tx| tx.delete(&table, &vec![SqlValue::Int(id)])).unwrap();
    }
    common::settle(&s.db);
    ok(&s, &["stream"]);

    let mut empty = Running::spawn(&s, &["backfill", "--max-waves", "1"], "chunked.before_wave_bronze=sleep(6000)");
    let read = empty.wait_for("wave read");
    assert!(read.contains("wave=1") && read.contains("rows=0"), "the first call reads wave 1 empty: {read}");
    let empty_read_at = Instant::now();
    for id in 25..=30 {
        s.db.transaction(|tx| tx.insert(&table, item_row(id, 1))).unwrap();
    }
    common::settle(&s.db);
    let mut with_rows = Running::spawn(&s, &["backfill", "--max-waves", "1"], "chunked.before_wave_bronze=sleep(9000)");
    let read = with_rows.wait_for("wave read");
    assert!(read.contains("wave=1") && !read.contains("rows=0"), "the second call reads rows in wave 1: {read}");
    assert!(
        !empty.has_exited() && empty_read_at.elapsed() < Duration::from_secs(5),
        "the second call must read before the first one commits (took {:?}): the machine is too slow for this race",
        empty_read_at.elapsed()
    );
    let (code_empty, j_empty, err_empty) = empty.finish();
    let (code_rows, j_rows, err_rows) = with_rows.finish();
    for _ in 0..10 {
        if ok(&s, &["backfill"])["done"] == true {
            break;
        }
    }
    ok(&s, &["stream"]);

    // Every chunk has one facts row, counting exactly bronze's rows of it.
    let rows = facts(&rt, &s);
    let open = rows.iter().find(|r| r.event.as_deref() == Some("snapshot_open")).and_then(|r| r.min_lsn).unwrap();
    let mut facts_chunks: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.event.as_deref() == Some("snapshot_chunk")) {
        let chunk = r.detail.as_ref().unwrap()["chunk"].as_i64().unwrap();
        facts_chunks.entry(chunk).or_default().push(r.rows.unwrap());
    }
    assert_eq!(facts_chunks.len() as i64, chunks_total, "every chunk has a facts row: {facts_chunks:?}");
    let bronze_chunks: BTreeMap<i64, i64> = rt.block_on(async {
        use deltalake::arrow::array::Int64Array;
        let ctx = s.context().await.unwrap();
        let sql = format!("SELECT _chunk, COUNT(*) FROM t WHERE _operation = 0 AND _snapshot = '{}' GROUP BY _chunk", open.to_hex());
        let mut out = BTreeMap::new();
        for b in delta::query(&ctx.bronze, &sql).await.unwrap() {
            let c = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            let n = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
            for i in 0..b.num_rows() {
                out.insert(c.value(i), n.value(i));
            }
        }
        out
    });
    for (chunk, counts) in &facts_chunks {
        assert_eq!(counts.len(), 1, "chunk {chunk} has one facts row: {counts:?}");
        assert_eq!(counts[0], bronze_chunks.get(chunk).copied().unwrap_or(0), "chunk {chunk}: facts count bronze's rows of it ({bronze_chunks:?})");
    }
    assert!(bronze_chunks.keys().all(|c| facts_chunks.contains_key(c)), "bronze rows of unrecorded chunks: {bronze_chunks:?}");
    assert_eq!(rows.iter().filter(|r| r.event.as_deref() == Some("bootstrap")).count(), 1, "one completion");
    // The snapshot and the changes after S rebuild the table.
    let cmp = rt.block_on(s.verify());
    assert_eq!(cmp.differences(), 0, "bronze's image equals the table: {cmp:?}");
    assert_eq!(code_empty, 0, "the empty wave won bronze's txn: {j_empty}\n{err_empty}");
    assert_eq!(code_rows, 75, "the call with rows lost it: {j_rows}\n{err_rows}");
}

/// A call whose state is read between another call's two commits of a
/// batch (bronze, then facts) sees bronze one batch ahead of the facts. It
/// must not read on from the facts' end under the next id: before the fix it
/// did, and that batch's changes were written to bronze a second time as the
/// next batch. Found by the torture tester; here two sleep failpoints hold
/// the window open: A sleeps after each bronze commit, and C's state read in
/// its first batch transition sleeps between the facts and bronze while A
/// commits its batch 1 to bronze. C then records batch 1's facts row from
/// A's bronze commit (A's own append finds the same row) and reads on from
/// its end: every batch has one outcome and no range is read twice.
#[test]
fn a_call_that_sees_bronze_ahead_of_the_facts_reads_no_batch_twice() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(20, "[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 2\n");
    for _ in 0..5 {
        if ok(&s, &["stream"])["caught_up"] == true {
            break;
        }
    }
    s.changes(8);
    common::settle(&s.db);
    let mut a = Running::spawn(&s, &["stream"], "stream.after_bronze=sleep(4000)");
    a.wait_for("batch read");
    // A commits its first batch to bronze right after the read, then sleeps.
    std::thread::sleep(Duration::from_millis(1000));
    // C's seventh state read sleeps: the first turn reads the state (1),
    // repairs A's batch 0 (the bootstrap's read 2, the transition's 3, its
    // read after the repair 4), reads the state again (5); the second turn,
    // a batch, reads it in the bootstrap's check (6) and then before the
    // batch (7). While it sleeps there, A commits batch 1 to bronze.
    let mut c = Running::spawn(&s, &["stream"], "state.between_facts_and_bronze=6*off->1*sleep(6000)->off");
    c.wait_for("without its facts row");
    let (code_c, j_c, err_c) = c.finish();
    let (code_a, j_a, err_a) = a.finish();
    for _ in 0..10 {
        if ok(&s, &["stream"])["caught_up"] == true {
            break;
        }
    }
    assert_one_outcome_per_batch(&rt, &s);
    assert_eq!(code_a, 0, "{j_a}\n{err_a}");
    assert_eq!(code_c, 0, "{j_c}\n{err_c}");
    assert!(
        j_c["repaired_batches"].as_array().is_some_and(|b| b.contains(&serde_json::json!(1))),
        "the call that saw bronze ahead recorded A's batch 1 from its bronze commit before reading on: {j_c}\n{err_c}"
    );
}
