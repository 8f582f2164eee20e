//! Rules of the design records that no test covered (rows marked UNTESTED in
//! docs/CONFORMANCE.md), each driven in process on the simulator:
//! - a wave stamped below S is refused (28.2, 28.65): the workflow is pointed
//!   at a copy of the source whose log is behind, as a readable secondary is;
//! - a keyset plan's open last chunk ends at the first key after MAX as it is
//!   when that chunk is read (28.63);
//! - a full snapshot cuts its ranges on `snapshot.keys` (28.118);
//! - the unique index's columns get the same key checks as `snapshot.keys`
//!   (28.120, deliberately stricter than the record);
//! - `apply` and its verdict take no notice of a skipped range (18.51, 18.52);
//! - no statement uses CHECKSUM_AGG or BINARY_CHECKSUM (28.48).
//!
//! Expectations come from the simulator's own rows and from values computed
//! by hand here, never from an engine helper. No failpoint is armed (this
//! file runs in the shared `suite` binary).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::Scenario;
use deltalake::arrow::array::{Array, Int32Array, Int64Array, StringArray};
use mssql_cdc::delta::{self, plans};
use mssql_cdc::engine::apply;
use mssql_cdc::engine::chunked::{self, BackfillArgs, ChunkPayload};
use mssql_cdc::error::StepError;
use mssql_cdc::sim::TableSpec;
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

const DAY: Duration = Duration::from_secs(24 * 3600);

const CHUNKED: &str =
    "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n";

/// Writes the scenario's workflow for `table`, reading the source at `url`.
fn write_workflow(s: &Scenario, url: &str, table: &str, extra: &str) {
    let text = format!(
        "app_id = \"items\"\n[source]\nurl = \"{url}\"\n[table]\nname = \"{table}\"\n[target]\nbronze = \"bronze\"\nfacts = \"facts\"\n{extra}\n"
    );
    std::fs::write(&s.wf_path, text).unwrap();
}

async fn backfill(s: &Scenario, args: BackfillArgs) -> mssql_cdc::error::StepResult<chunked::BackfillResult> {
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

/// Bronze's snapshot rows (operation 0): key text -> how many.
async fn snapshot_keys(s: &Scenario, key: &str) -> BTreeMap<String, usize> {
    let ctx = s.context().await.unwrap();
    let mut out = BTreeMap::new();
    for b in delta::query(&ctx.bronze, &format!("SELECT CAST({key} AS VARCHAR) AS k FROM t WHERE _operation = 0")).await.unwrap() {
        let a = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
        for i in 0..a.len() {
            *out.entry(a.value(i).to_string()).or_default() += 1;
        }
    }
    out
}

/// 28.2 (the runtime refusal), 28.65: the snapshot is opened on the primary
/// at S; the workflow then reads a copy of the same table whose log is behind
/// (a readable secondary), so the wave's stamp is below S. Backfill refuses
/// with exit 75 before reading a chunk; back on the primary the snapshot
/// completes and bronze equals the table.
/// Catches the `stamp < S` check dropped (the wave would be read and
/// committed, stamped below S) or made anything but temporary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wave_whose_stamp_is_below_s_is_refused_until_the_source_has_caught_up() {
    let mut primary = Scenario::new(30, CHUNKED);
    // The same table and capture instance, with none of the primary's later commits.
    let secondary = Scenario::new(30, CHUNKED);
    primary.changes(5);
    primary.db.advance_clock(Duration::from_secs(2)).unwrap();
    common::settle(&primary.db);
    let opened = primary.stream().await.unwrap();
    assert!(opened.bootstrap.is_some(), "{opened:?}");
    let s_lsn = opened.position.unwrap();
    let behind = secondary.db.max_lsn().unwrap().unwrap();
    assert!(behind < s_lsn, "the copy's log ({behind}) must be behind S ({s_lsn})");

    write_workflow(&primary, &secondary.db.url(), "items", CHUNKED);
    let e = backfill(&primary, BackfillArgs { max_waves: Some(1), ..Default::default() }).await.unwrap_err();
    assert!(matches!(e, StepError::Temporary(_)), "{e}");
    assert_eq!(e.exit_code(), 75);
    assert!(e.to_string().contains("below the snapshot's S"), "{e}");

    primary.write_workflow(CHUNKED);
    assert_eq!(primary.count("facts", "event = 'snapshot_chunk'").await, 0, "no chunk was recorded");
    assert_eq!(primary.count("bronze", "_operation = 0").await, 0, "no chunk row was written");
    backfill_until_done(&primary).await;
    primary.changes(3);
    common::settle(&primary.db);
    primary.stream_until_caught_up().await;
    assert_eq!(primary.verify().await.differences(), 0);
    // Every row there at S was read by exactly one chunk, each stamped at or after S.
    let ids = snapshot_keys(&primary, "id").await;
    assert!(ids.values().all(|n| *n == 1), "{ids:?}");
    let ctx = primary.context().await.unwrap();
    let low = delta::query(&ctx.bronze, &format!("SELECT COUNT(*) FROM t WHERE _operation = 0 AND _start_lsn < '{}'", s_lsn.to_hex())).await.unwrap();
    assert_eq!(low[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0), 0, "a chunk stamped below S");
}

fn codes_spec(t: &TableName) -> TableSpec {
    TableSpec {
        collations: Default::default(),
        name: t.clone(),
        columns: vec![ColumnDesc::new("code", SqlType::NVarChar { len: Some(20) }, false), ColumnDesc::new("qty", SqlType::Int, true)],
        primary_key: vec!["code".into()],
        unique_index: vec![],
    }
}

/// 28.63: a string key is planned by keyset seeks; with nothing after MAX
/// (`k029`) at planning, the last chunk is open. Keys inserted above MAX
/// before its wave are the stream's: the wave seeks the first key after MAX
/// again (`m001`), records it as the chunk's end, and reads neither insert.
/// Catches the re-seek dropped (the chunk stays open above and reads `m001`
/// and `z999` as snapshot rows) or the end sought past the first key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_last_chunk_ends_at_the_first_key_after_max_as_it_is_at_its_wave() {
    let mut s = Scenario::new(0, "");
    let codes = TableName::new("dbo", "codes");
    s.db.create_table(&codes_spec(&codes)).unwrap();
    s.db.load_rows(&codes, (0..30).map(|i| vec![SqlValue::Str(format!("k{i:03}")), SqlValue::Int(i)])).unwrap();
    s.db.enable_cdc(&codes, None, None).unwrap();
    s.db.advance_clock(Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.table = codes.clone();
    write_workflow(&s, "sim://source.sqlite", "codes", &CHUNKED.replace("parallelism = 2", "parallelism = 1"));
    s.stream().await.unwrap();
    let first = backfill(&s, BackfillArgs { max_waves: Some(1), ..Default::default() }).await.unwrap();
    assert_eq!((first.chunks_total, first.chunks_done), (3, 1), "30 keys in chunks of 10: {first:?}");
    s.db
        .transaction(|tx| {
            tx.insert(&codes, vec![SqlValue::Str("m001".into()), SqlValue::Int(100)])?;
            tx.insert(&codes, vec![SqlValue::Str("z999".into()), SqlValue::Int(101)])
        })
        .unwrap();
    common::settle(&s.db);
    s.stream().await.unwrap();
    backfill_until_done(&s).await;

    let ctx = s.context().await.unwrap();
    let t = delta::open_existing(&plans::location_for(&ctx.workflow.target.bronze), &Default::default()).await.unwrap().unwrap();
    let rows = plans::from_batches(&delta::query(&t, "SELECT * FROM t").await.unwrap()).unwrap();
    let plan = rows.iter().find(|r| r.event == "snapshot_plan").unwrap();
    assert_eq!(plan.detail["open_end"], true, "nothing after MAX when planned: {}", plan.detail);
    let last: Vec<ChunkPayload> = rows
        .iter()
        .filter(|r| r.event == "snapshot_chunk")
        .map(|r| serde_json::from_value::<ChunkPayload>(r.detail.clone()).unwrap())
        .filter(|c| c.last)
        .collect();
    assert_eq!(last.len(), 1);
    assert_eq!(last[0].lo, Some(vec![SqlValue::Str("k020".into())]));
    assert_eq!(last[0].hi, Some(vec![SqlValue::Str("m001".into())]), "{:?}", last[0]);
    let read = snapshot_keys(&s, "code").await;
    let want: BTreeMap<String, usize> = (0..30).map(|i| (format!("k{i:03}"), 1)).collect();
    assert_eq!(read, want, "the chunks read every key up to MAX once, and none inserted above it");
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
}

/// A heap of `id` (unique in practice, not declared) and a payload.
fn heap_scenario(snapshot: &str) -> Scenario {
    let mut s = Scenario::new(0, "");
    let heap = TableName::new("dbo", "heap");
    let spec = TableSpec {
        collations: Default::default(),
        name: heap.clone(),
        columns: vec![ColumnDesc::new("id", SqlType::Int, false), ColumnDesc::new("payload", SqlType::Int, true)],
        primary_key: vec![],
        unique_index: vec![],
    };
    s.db.create_table(&spec).unwrap();
    s.db.load_rows(&heap, (1..=60).map(|i| vec![SqlValue::Int(i), SqlValue::Int(i % 4)])).unwrap();
    s.db.enable_cdc(&heap, None, None).unwrap();
    s.db.advance_clock(Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.table = heap;
    write_workflow(&s, "sim://source.sqlite", "heap", snapshot);
    s
}

/// 28.118, for a heap (deliberately changed): a table without a unique
/// index is read in one fenced range whatever `snapshot.keys` and
/// `parallelism` say, because its silver counts the changes after one
/// read's fence (`engine::apply::heap`); the fence is recorded in the
/// completion row. Each row is read once either way. Catches a heap's full
/// snapshot split into unfenced ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_snapshot_cuts_its_ranges_on_snapshot_keys() {
    for keys in ["keys = [\"id\"]", ""] {
        let s = heap_scenario(&format!("[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 3\n{keys}\n"));
        let mut ctx = s.context().await.unwrap();
        let r = mssql_cdc::engine::snapshot::ensure_bootstrap(&mut ctx).await.unwrap();
        assert_eq!((r.ranges, r.rows), (1, 60), "{keys:?}: {r:?}");
        let read = snapshot_keys(&s, "id").await;
        let want: BTreeMap<String, usize> = (1..=60).map(|i| (i.to_string(), 1)).collect();
        assert_eq!(read, want, "{keys:?}: every row once");
        let after = s.context().await.unwrap();
        let rows = mssql_cdc::engine::state::facts_rows(&after.facts, &after.workflow.app_id).await.unwrap();
        let done = rows.iter().find(|r| r.event.as_deref() == Some("bootstrap")).expect("a bootstrap row");
        assert!(done.detail.as_ref().and_then(|d| d.get("fence")).is_some_and(|f| f.is_string()), "{keys:?}: the read's fence is recorded: {:?}", done.detail);
    }
}

/// 28.120 (deliberately changed): the record exempts the unique index's
/// columns from the key checks; here they are checked like `snapshot.keys`.
/// A primary key (at time(7), id) puts a 100 ns column before the last one,
/// which a bound cannot hold exactly: the chunked open is refused before
/// anything is written, and the same table chunked on `id` alone opens.
/// Catches an exemption for the index's columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unique_index_gets_the_key_checks_of_snapshot_keys() {
    let s = timed_scenario("");
    let e = s.stream().await.unwrap_err();
    assert!(matches!(e, StepError::Config(_)) && e.to_string().contains("before the last column"), "{e}");
    if let Some(f) = delta::open_existing(&s.path().join("facts").to_string_lossy(), &Default::default()).await.unwrap() {
        let n = delta::query(&f, "SELECT COUNT(*) FROM t").await.unwrap();
        assert_eq!(n[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0), 0, "a facts row was written");
    }
    let s = timed_scenario("keys = [\"id\"]");
    let r = s.stream().await.unwrap();
    assert_eq!(r.bootstrap.as_ref().unwrap()["opened_now"], true, "{r:?}");
}

/// A table keyed on (at time(7), id), chunked on `keys` (the index when empty).
fn timed_scenario(keys: &str) -> Scenario {
    let mut s = Scenario::new(0, "");
    let timed = TableName::new("dbo", "timed");
    let spec = TableSpec {
        collations: Default::default(),
        name: timed.clone(),
        columns: vec![
            ColumnDesc::new("at", SqlType::Time { scale: 7 }, false),
            ColumnDesc::new("id", SqlType::Int, false),
            ColumnDesc::new("qty", SqlType::Int, true),
        ],
        primary_key: vec!["at".into(), "id".into()],
        unique_index: vec![],
    };
    s.db.create_table(&spec).unwrap();
    let at = |i: i64| chrono::NaiveTime::from_hms_nano_opt(1, 0, 0, 100 * i as u32).unwrap();
    s.db.load_rows(&timed, (1..=5).map(|i| vec![SqlValue::Time(at(i)), SqlValue::Int(i), SqlValue::Int(0)])).unwrap();
    s.db.enable_cdc(&timed, None, None).unwrap();
    s.db.advance_clock(Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.table = timed;
    write_workflow(&s, "sim://source.sqlite", "timed", &format!("[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 10\n{keys}\n"));
    s
}

const SKIP: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"skip\"\n";

/// 18.51, 18.52: the update of id 1 is purged before the stream reads it
/// (skip mode records it as `data_skipped`), the update of id 2 is read in
/// the same batch. `apply` keeps id 1 as the bootstrap read it (silver
/// differs from the table there, as the record accepts) and takes id 2's
/// update, and its verdict moves to the stream's position: not held at the
/// skip. Catches a verdict held at a skipped range, a batch with a
/// `data_skipped` row left out of apply, or a skip "repaired" from the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_takes_no_notice_of_a_skipped_range() {
    let s = Scenario::new(10, SKIP);
    s.stream_until_caught_up().await;
    let mut ctx = s.context().await.unwrap();
    apply::run(&mut ctx).await.unwrap();
    let table = s.table.clone();
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(1)], common::item_row(1, 5))).unwrap();
    common::settle(&s.db);
    s.db.advance_clock(DAY * 4).unwrap();
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(2)], common::item_row(2, 6))).unwrap();
    common::settle(&s.db);
    assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "cleanup ran");
    s.stream_until_caught_up().await;

    let ctx = s.context().await.unwrap();
    let facts = mssql_cdc::engine::state::facts_rows(&ctx.facts, "items").await.unwrap();
    let skips: Vec<_> = facts.iter().filter(|r| r.event.as_deref() == Some("data_skipped")).collect();
    assert_eq!(skips.len(), 1, "the update of id 1 was skipped: {skips:?}");
    let position = facts.iter().filter(|r| r.event.is_none()).filter_map(|r| r.max_lsn).max().unwrap();
    assert!(position >= skips[0].max_lsn.unwrap());

    let mut ctx = s.context().await.unwrap();
    let r = apply::run(&mut ctx).await.unwrap();
    assert_eq!(r.finalized_until, Some(position), "{r:?}");
    assert_eq!(r.applied_lsn, Some(position), "{r:?}");
    let silver = delta::open_existing(&s.path().join("silver").to_string_lossy(), &Default::default()).await.unwrap().unwrap();
    let mut qty: BTreeMap<i64, i64> = BTreeMap::new();
    for b in delta::query(&silver, "SELECT id, qty FROM t").await.unwrap() {
        let ids = b.column(0).as_any().downcast_ref::<Int32Array>().unwrap();
        let qs = b.column(1).as_any().downcast_ref::<Int32Array>().unwrap();
        for i in 0..b.num_rows() {
            assert!(qty.insert(ids.value(i) as i64, qs.value(i) as i64).is_none(), "id {} twice", ids.value(i));
        }
    }
    // item_row's qty is id * 10 + version: id 1 keeps version 0 (the table holds 5), id 2 has version 6.
    let want: BTreeMap<i64, i64> = (1..=10).map(|id| (id, id * 10 + if id == 2 { 6 } else { 0 })).collect();
    assert_eq!(qty, want);
    let table_ids: BTreeSet<i64> = s.db.keys(&s.table).unwrap().iter().map(|k| k[0].as_i64().unwrap()).collect();
    assert_eq!(table_ids, want.keys().copied().collect::<BTreeSet<_>>());
}

/// 28.48: reconcile hashes rows with SHA-256 on our side; no statement asks
/// the server for CHECKSUM_AGG, BINARY_CHECKSUM or CHECKSUM (collisions,
/// collation-blind). A grep of every source file under `src/`.
/// Catches any use of them added to a statement (or to a comment, which
/// then has to say it another way).
#[test]
fn no_source_file_uses_checksum_functions() {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    assert!(files.iter().any(|f| f.ends_with("mssql/sql.rs")), "the statements' file is among {} files", files.len());
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap().to_uppercase();
        for word in ["CHECKSUM_AGG", "BINARY_CHECKSUM", "CHECKSUM("] {
            assert!(!text.contains(word), "{} uses {word}", f.display());
        }
    }
}
