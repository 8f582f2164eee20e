//! The `seed` step end to end on the simulator: a copy someone else took
//! becomes the stream's snapshot, reruns write nothing, a reseed starts a new
//! generation, and a copy started inside a repeated fall-back hour skips no
//! commit.

mod common;

use std::path::Path;
use std::sync::Arc;

use chrono::{DateTime, TimeZone, Utc};
use common::Scenario;
use deltalake::arrow::array::{Array, ArrayRef, Int64Array, StringArray, TimestampMicrosecondArray};
use deltalake::arrow::datatypes::{DataType, Field, Schema};
use deltalake::arrow::record_batch::RecordBatch;
use futures::StreamExt;
use mssql_cdc::engine::seed::{self, mapping_time, AsOf, SeedArgs, SeedResult};
use mssql_cdc::engine::{self};
use mssql_cdc::error::{StepError, StepResult};
use mssql_cdc::lsn::Lsn;
use mssql_cdc::source::{CdcSource, Isolation, KeyRange, SnapshotRead, TimeOp};

const WF: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\n";
const WF_NO_BOOTSTRAP: &str = "[stream]\nmax_batch_rows = 1000\n";

/// The table as one read sees it now, in the captured columns' order.
async fn read_table(s: &Scenario) -> Vec<RecordBatch> {
    let source = s.db.source().unwrap();
    let ci = source.capture_instances(&s.table).await.unwrap().pop().unwrap();
    let read = SnapshotRead {
        table: s.table.clone(),
        columns: ci.columns.clone(),
        keys: vec![],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 16,
    };
    let mut stream = source.snapshot_read(&read).await.unwrap();
    let mut out = Vec::new();
    while let Some(b) = stream.next().await {
        out.push(b.unwrap());
    }
    out
}

/// A copy as another tool might write it: names in other cases, qty widened
/// to bigint, and a column the table does not have.
async fn odd_parquet_copy(s: &Scenario, dir: &Path) -> i64 {
    std::fs::create_dir_all(dir).unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("ID", DataType::Int32, true),
        Field::new("Name", DataType::Utf8, true),
        Field::new("QTY", DataType::Int64, true),
        Field::new("Price", DataType::Decimal128(10, 2), true),
        Field::new("UPDATED", DataType::Timestamp(deltalake::arrow::datatypes::TimeUnit::Microsecond, None), true),
        Field::new("loaded_by", DataType::Utf8, true),
    ]));
    let file = std::fs::File::create(dir.join("part-0.parquet")).unwrap();
    let mut w = deltalake::parquet::arrow::ArrowWriter::try_new(file, schema.clone(), None).unwrap();
    let mut rows = 0;
    for b in read_table(s).await {
        let n = b.num_rows();
        let qty = deltalake::arrow::compute::cast(b.column(2), &DataType::Int64).unwrap();
        let cols: Vec<ArrayRef> =
            vec![b.column(0).clone(), b.column(1).clone(), qty, b.column(3).clone(), b.column(4).clone(), Arc::new(StringArray::from(vec!["etl"; n]))];
        w.write(&RecordBatch::try_new(schema.clone(), cols).unwrap()).unwrap();
        rows += n as i64;
    }
    w.close().unwrap();
    rows
}

/// A plain copy in several Parquet files.
async fn parquet_copy(s: &Scenario, dir: &Path) -> i64 {
    let source = s.db.source().unwrap();
    let ci = source.capture_instances(&s.table).await.unwrap().pop().unwrap();
    mssql_cdc::seed_copy::export_parquet(&source, &s.table, &ci.columns, dir, 7).await.unwrap() as i64
}

/// A copy as a Delta table.
async fn delta_copy(s: &Scenario, dir: &Path) -> i64 {
    std::fs::create_dir_all(dir).unwrap();
    let batches = read_table(s).await;
    let rows = batches.iter().map(|b| b.num_rows() as i64).sum();
    let url = deltalake::ensure_table_uri(dir.to_str().unwrap()).unwrap();
    deltalake::DeltaTable::try_from_url(url).await.unwrap().write(batches).await.unwrap();
    rows
}

async fn seed_at(s: &Scenario, copy: &Path, as_of: AsOf, reseed: bool) -> StepResult<SeedResult> {
    let mut ctx = s.context().await?;
    let args = SeedArgs { copy: copy.to_string_lossy().into_owned(), as_of, reseed, allow_missing_columns: false };
    seed::run(&mut ctx, &args).await
}

async fn versions(s: &Scenario) -> (Option<u64>, Option<u64>) {
    let ctx = s.context().await.unwrap();
    (ctx.bronze.version().map(|v| v as u64), ctx.facts.version().map(|v| v as u64))
}

async fn commit_time(s: &Scenario, lsn: Lsn) -> DateTime<Utc> {
    let ctx = s.context().await.unwrap();
    ctx.commit_time(lsn).await.unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_from_a_copy_in_other_case_with_an_extra_column_then_stream() {
    let mut s = Scenario::new(40, WF);
    s.changes(5);
    common::settle(&s.db);
    let last_before_copy = s.db.max_lsn().unwrap().unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(10)).unwrap();
    let as_of = s.db.now().unwrap();
    // Changes while the copy runs: committed after its start, seen by its read.
    s.changes(4);
    let copy = s.path().join("copy");
    let copy_rows = odd_parquet_copy(&s, &copy).await;
    // Changes after the copy.
    s.changes(8);
    common::settle(&s.db);

    let r = seed_at(&s, &copy, AsOf::Time(as_of), false).await.unwrap();
    assert!(!r.already_seeded);
    assert_eq!(r.rows, copy_rows);
    assert_eq!(r.columns_dropped, vec!["loaded_by".to_string()]);
    assert!(r.lsn >= last_before_copy, "L {} must not be before the last commit before the copy {}", r.lsn, last_before_copy);
    assert!(r.commit_ts.unwrap() <= as_of, "L committed at {:?}, after the copy started at {as_of}", r.commit_ts);
    assert_eq!(r.commit_ts.unwrap(), commit_time(&s, r.lsn).await);

    // The stamps: one whole snapshot at L, the other CDC columns NULL.
    let l = r.lsn.to_hex();
    let stamped = format!(
        "_operation = 0 AND _start_lsn = '{l}' AND _snapshot = '{l}' AND _seqval IS NULL AND _command_id IS NULL \
         AND _batch_id IS NULL AND _chunk IS NULL AND _capture_instance = 'dbo_items'"
    );
    assert_eq!(s.count("bronze", &stamped).await, copy_rows);
    assert_eq!(s.count("bronze", "_operation = 0").await, copy_rows);
    assert!(s.count("bronze", "_operation = 0 AND name IS NOT NULL AND qty IS NOT NULL").await > 0, "columns in other case land in bronze's");
    let ctx = s.context().await.unwrap();
    assert!(ctx.bronze_schema().unwrap().fields().iter().all(|f| !f.name().eq_ignore_ascii_case("loaded_by")));
    let ts = mssql_cdc::delta::query(&ctx.bronze, "SELECT DISTINCT _commit_ts FROM t WHERE _operation = 0").await.unwrap();
    let ts = ts[0].column(0).as_any().downcast_ref::<TimestampMicrosecondArray>().unwrap();
    assert_eq!(ts.len(), 1);
    assert_eq!(ts.value(0), r.commit_ts.unwrap().timestamp_micros());
    drop(ctx);

    // The stream finds the seed as its bootstrap and continues from L.
    let first = s.stream().await.unwrap();
    let boot = first.bootstrap.clone().unwrap();
    assert_eq!(boot["already_done"], true, "{boot}");
    assert_eq!(boot["snapshot_lsn"], serde_json::json!(r.lsn));
    s.stream_until_caught_up().await;
    let mut ctx = s.context().await.unwrap();
    let st = engine::state::load(&mut ctx).await.unwrap();
    assert_eq!((st.generation, st.snapshot), (0, Some(r.lsn)));
    let first_batch = mssql_cdc::delta::query(&ctx.facts, "SELECT min_lsn FROM t WHERE batch_id = 0").await.unwrap();
    let first_from = first_batch[0].column(0).as_any().downcast_ref::<StringArray>().unwrap().value(0).to_string();
    assert_eq!(first_from, r.lsn.increment().to_hex(), "the first batch reads from L + 1");
    drop(ctx);
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1);
    assert_eq!(s.count("facts", "event = 'snapshot_open'").await, 0, "the bootstrap read nothing");
    assert_eq!(s.count("bronze", "_operation = 0").await, copy_rows, "no second snapshot");
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{cmp:?}");

    // A rerun returns the seed and writes nothing.
    let before = versions(&s).await;
    let again = seed_at(&s, &copy, AsOf::Time(as_of), false).await.unwrap();
    assert!(again.already_seeded);
    assert_eq!((again.lsn, again.rows, again.commit_ts), (r.lsn, r.rows, r.commit_ts));
    assert_eq!(versions(&s).await, before);
}

/// An empty table's copy is one Parquet file with the columns and no rows
/// (an export tool's; a folder without files would say nothing of the
/// columns). The seed refuses it before writing anything, naming the
/// bootstrap, which then starts the stream. (The torture tester's schedule
/// 20000053 copied a table its writer had just emptied: the export wrote no
/// file and the refusal named the wrong problem.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_tables_copy_is_refused_naming_the_bootstrap_and_nothing_is_written() {
    let mut s = Scenario::new(0, WF_NO_BOOTSTRAP);
    let at = s.db.max_lsn().unwrap().unwrap();
    let copy = s.path().join("copy-empty");
    assert_eq!(parquet_copy(&s, &copy).await, 0);
    let files: Vec<_> = std::fs::read_dir(&copy).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files.len(), 1, "one file with the schema: {files:?}");
    let before = versions(&s).await;
    let e = seed_at(&s, &copy, AsOf::Lsn(at), false).await.unwrap_err();
    assert!(matches!(e, StepError::Config(_)) && e.to_string().contains("holds no rows") && e.to_string().contains("bootstrap"), "{e}");
    assert_eq!(versions(&s).await, before, "the refused seed wrote nothing");
    s.write_workflow(WF);
    s.changes(6);
    common::settle(&s.db);
    s.stream_until_caught_up().await;
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1);
    s.assert_matches_source().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_from_a_delta_copy_by_lsn_without_bootstrap() {
    let mut s = Scenario::new(30, WF_NO_BOOTSTRAP);
    s.changes(3);
    common::settle(&s.db);
    let recorded = s.db.max_lsn().unwrap().unwrap();
    s.changes(4);
    let copy = s.path().join("copy-delta");
    let copy_rows = delta_copy(&s, &copy).await;
    s.changes(5);
    common::settle(&s.db);
    let r = seed_at(&s, &copy, AsOf::Lsn(recorded), false).await.unwrap();
    assert_eq!((r.lsn, r.rows, r.copy_kind), (recorded, copy_rows, Some(mssql_cdc::seed_copy::CopyKind::Delta)));
    s.stream_until_caught_up().await;
    assert_eq!(s.count("facts", "event = 'stream_start'").await, 0, "the stream starts at the seed");
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1);
    assert_eq!(s.verify().await.differences(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerun_after_cleanup_under_a_newer_snapshot_and_reseed() {
    let mut s = Scenario::new(30, WF);
    s.changes(4);
    s.db.advance_clock(std::time::Duration::from_secs(10)).unwrap();
    common::settle(&s.db);
    let as_of1 = s.db.now().unwrap();
    let copy1 = s.path().join("copy1");
    parquet_copy(&s, &copy1).await;
    s.changes(3);
    common::settle(&s.db);
    let r1 = seed_at(&s, &copy1, AsOf::Time(as_of1), false).await.unwrap();
    s.stream_until_caught_up().await;

    // Four days pass without the stream; cleanup removes the changes and the
    // mapping rows around the copy's start.
    s.db.advance_clock(std::time::Duration::from_secs(4 * 24 * 3600)).unwrap();
    s.changes(5);
    common::settle(&s.db);
    s.db.cleanup(None).unwrap();
    let ctx = s.context().await.unwrap();
    let mapped = ctx.source.time_to_lsn(TimeOp::LargestLessThanOrEqual, mapping_time(&ctx.zone, as_of1)).await.unwrap();
    assert_eq!(mapped, None, "cleanup removed the mapping of the copy's start");
    drop(ctx);
    let before = versions(&s).await;
    let by_time = seed_at(&s, &copy1, AsOf::Time(as_of1), false).await.unwrap();
    assert!(by_time.already_seeded);
    assert_eq!((by_time.lsn, by_time.commit_ts), (r1.lsn, r1.commit_ts));
    let by_lsn = seed_at(&s, &copy1, AsOf::Lsn(r1.lsn), false).await.unwrap();
    assert!(by_lsn.already_seeded && by_lsn.lsn == r1.lsn);
    assert_eq!(versions(&s).await, before, "reruns write nothing");

    // The stream lost changes: the recovery is a newer copy, reseeded.
    let e = s.stream().await.unwrap_err();
    assert!(matches!(e, StepError::DataLoss { .. }), "{e}");
    s.db.advance_clock(std::time::Duration::from_secs(10)).unwrap();
    common::settle(&s.db);
    let as_of2 = s.db.now().unwrap();
    let copy2 = s.path().join("copy2");
    parquet_copy(&s, &copy2).await;
    s.changes(4);
    common::settle(&s.db);
    // Without --reseed: refused, saying how to proceed.
    let e = seed_at(&s, &copy2, AsOf::Time(as_of2), false).await.unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("--reseed"), "{e}");
    let r2 = seed_at(&s, &copy2, AsOf::Time(as_of2), true).await.unwrap();
    assert!(!r2.already_seeded && r2.lsn > r1.lsn);
    assert_eq!(r2.generation, 1);
    assert!(seed_at(&s, &copy2, AsOf::Time(as_of2), true).await.unwrap().already_seeded);
    s.stream_until_caught_up().await;
    let mut ctx = s.context().await.unwrap();
    let st = engine::state::load(&mut ctx).await.unwrap();
    assert_eq!((st.generation, st.generation_app_id.as_str(), st.snapshot), (1, "items.g1", Some(r2.lsn)));
    drop(ctx);
    assert_eq!(s.count("facts", "event = 'resnapshot' AND generation = 1").await, 1);
    assert_eq!(s.count("facts", "generation = 1 AND batch_id = 0").await, 1, "the new generation's batches start at 0");
    assert_eq!(s.verify().await.differences(), 0);

    // The first seed's rerun still returns it under the newer snapshot.
    let before = versions(&s).await;
    let old = seed_at(&s, &copy1, AsOf::Time(as_of1), false).await.unwrap();
    assert!(old.already_seeded && old.lsn == r1.lsn, "{old:?}");
    // A reseed never goes back: an LSN between the two snapshots is refused.
    let min = s.db.source().unwrap().min_lsn("dbo_items").await.unwrap().unwrap();
    assert!(min < r2.lsn && min != r1.lsn);
    let e = seed_at(&s, &copy1, AsOf::Lsn(min), true).await.unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("never goes back"), "{e}");
    assert_eq!(versions(&s).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_started_in_a_repeated_fall_back_hour_skips_no_commit() {
    let mut s = Scenario::new(30, WF_NO_BOOTSTRAP);
    // The server's clock in New York: 2026-11-01 02:00 EDT falls back to 01:00 EST,
    // so local 01:00-02:00 runs twice (05:00-06:00Z, then 06:00-07:00Z).
    s.db.set_config_value("time_zone", "America/New_York").unwrap();
    let start = Utc.with_ymd_and_hms(2026, 11, 1, 4, 0, 0).unwrap();
    let now = s.db.now().unwrap();
    s.db.advance_clock((start - now).to_std().unwrap()).unwrap();
    // The copy starts at 01:30 EDT, in the first pass of the repeated hour.
    let as_of = Utc.with_ymd_and_hms(2026, 11, 1, 5, 30, 0).unwrap();
    let step = std::time::Duration::from_secs(119);
    while s.db.now().unwrap() + chrono::Duration::seconds(125) < as_of {
        s.changes(1);
        common::settle(&s.db);
        s.db.advance_clock(step).unwrap();
    }
    let now = s.db.now().unwrap();
    s.db.advance_clock((as_of - now).to_std().unwrap()).unwrap();
    common::settle(&s.db);
    let last_before_copy = s.db.max_lsn().unwrap().unwrap();
    let copy = s.path().join("copy");
    parquet_copy(&s, &copy).await;
    let end = Utc.with_ymd_and_hms(2026, 11, 1, 6, 45, 0).unwrap();
    while s.db.now().unwrap() < end {
        s.changes(1);
        common::settle(&s.db);
        s.db.advance_clock(step).unwrap();
    }
    common::settle(&s.db);

    // The trap: 'largest less than or equal' at as_of's own local time (01:30)
    // finds a commit of the second pass, an hour after the copy started.
    let ctx = s.context().await.unwrap();
    let naive = ctx.source.time_to_lsn(TimeOp::LargestLessThanOrEqual, ctx.zone.to_local(as_of)).await.unwrap().unwrap();
    assert!(naive > last_before_copy, "the scenario must put commits after the copy at earlier local times");
    drop(ctx);

    let r = seed_at(&s, &copy, AsOf::Time(as_of), false).await.unwrap();
    assert!(r.lsn <= last_before_copy, "L {} is after the copy started (last commit before it: {last_before_copy})", r.lsn);
    assert!(r.commit_ts.unwrap() <= as_of);
    s.stream_until_caught_up().await;
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{cmp:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_that_does_not_fit_writes_nothing() {
    let s = Scenario::new(5, WF);
    let dir = s.path().join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true), Field::new("qty", DataType::Utf8, true)]));
    let b = RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(Int64Array::from(vec![1, 5_000_000_000])), Arc::new(StringArray::from(vec!["1", "2"]))],
    )
    .unwrap();
    let mut w = deltalake::parquet::arrow::ArrowWriter::try_new(std::fs::File::create(dir.join("a.parquet")).unwrap(), schema, None).unwrap();
    w.write(&b).unwrap();
    w.close().unwrap();
    let before = versions(&s).await;
    let max = s.db.max_lsn().unwrap().unwrap();
    let mut ctx = s.context().await.unwrap();
    let args = SeedArgs { copy: dir.to_string_lossy().into_owned(), as_of: AsOf::Lsn(max), reseed: false, allow_missing_columns: true };
    let e = seed::run(&mut ctx, &args).await.unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("id"), "{e}");
    assert_eq!(versions(&s).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_seed_rerun_reseed() {
    let mut s = Scenario::new(20, WF);
    s.changes(3);
    s.db.advance_clock(std::time::Duration::from_secs(10)).unwrap();
    common::settle(&s.db);
    let as_of1 = s.db.now().unwrap();
    let copy1 = s.path().join("copy1");
    parquet_copy(&s, &copy1).await;
    s.changes(2);
    common::settle(&s.db);
    assert!(!seed_at(&s, &copy1, AsOf::Time(as_of1), false).await.unwrap().already_seeded);
    s.stream().await.unwrap();
    assert!(seed_at(&s, &copy1, AsOf::Time(as_of1), false).await.unwrap().already_seeded);
    s.changes(2);
    s.db.advance_clock(std::time::Duration::from_secs(10)).unwrap();
    common::settle(&s.db);
    let as_of2 = s.db.now().unwrap();
    let copy2 = s.path().join("copy2");
    parquet_copy(&s, &copy2).await;
    let r2 = seed_at(&s, &copy2, AsOf::Time(as_of2), true).await.unwrap();
    assert_eq!(r2.generation, 1);
    s.changes(2);
    common::settle(&s.db);
    s.stream().await.unwrap();
    assert_eq!(s.verify().await.differences(), 0);
    // The seed's commits name the copy by its path, which is under this run's temporary folder.
    let log = s.golden().await.replace(&s.path().display().to_string(), "<dir>");
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_seed_rerun_reseed", log));
}
