//! Recovery after CDC data loss (adr-0018 and its amendments): a stream
//! stopped past the retention re-snapshots on its own (full or chunked), the
//! anti-loop guard, a full re-snapshot outliving the retention, crashes at
//! every step of the recovery, and the skip mode's `data_skipped` rows.

mod common;

use std::time::Duration;

use common::Scenario;
use mssql_cdc::delta::facts::FactRow;
use mssql_cdc::engine::{self, chunked};
use mssql_cdc::error::StepError;

const FULL: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n\
                    [stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";
const CHUNKED: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 15\ntarget_wave_seconds = 0\n\
                       [stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";
const SKIP: &str = "[snapshot]\nbootstrap = true\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"skip\"\n";

const DAY: Duration = Duration::from_secs(24 * 3600);

/// The stream stops; changes happen; `days` pass; more changes; cleanup (3
/// days' retention) purges the first ones, which the stream never read.
fn stop_past_the_retention(s: &mut Scenario, days: u64) {
    s.changes(12);
    common::settle(&s.db);
    s.db.advance_clock(DAY * days as u32).unwrap();
    s.changes(8);
    common::settle(&s.db);
    let report = s.db.cleanup(None).unwrap();
    assert!(report.watermark.is_some(), "cleanup ran");
}

async fn facts(s: &Scenario) -> Vec<FactRow> {
    let ctx = s.context().await.unwrap();
    engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
}

fn events<'a>(rows: &'a [FactRow], name: &str) -> Vec<&'a FactRow> {
    rows.iter().filter(|r| r.event.as_deref() == Some(name)).collect()
}

async fn backfill_until_done(s: &Scenario) {
    for _ in 0..50 {
        let mut ctx = s.context().await.unwrap();
        let r = chunked::backfill(&mut ctx, &Default::default()).await.unwrap();
        if r.done {
            return;
        }
    }
    panic!("backfill did not finish in 50 calls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stopped_past_the_retention_recovers_with_a_full_resnapshot() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(40, FULL);
    s.stream_until_caught_up().await;
    s.changes(5);
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s, 4);
    let r = s.stream().await.unwrap();
    let rec = r.recovery.as_ref().expect("the call recovered");
    assert_eq!((rec.from_generation, rec.generation, rec.mode), (0, 1, "full"));
    assert!(rec.lost_from_ts.unwrap() < rec.lost_to_ts.unwrap(), "{rec:?}");
    assert_eq!(r.generation, 1);
    assert!(r.caught_up, "{r:?}");
    // The new generation streams on under its own app id.
    s.changes(6);
    common::settle(&s.db);
    let r = s.stream().await.unwrap();
    assert_eq!((r.generation, r.batches), (1, 1), "{r:?}");
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{cmp:?}");
    let rows = facts(&s).await;
    let resnap = events(&rows, "resnapshot");
    assert_eq!(resnap.len(), 1);
    assert_eq!(resnap[0].generation, 1);
    assert_eq!(resnap[0].lost_to_ts, rec.lost_to_ts);
    let s_hex = resnap[0].max_lsn.unwrap().to_hex();
    assert_eq!(Some(s.count("bronze", &format!("_operation = 0 AND _snapshot = '{s_hex}'")).await), resnap[0].rows, "{:?}", resnap[0]);
    assert_eq!(events(&rows, "recovery").len(), 1);
    assert!(rows.iter().any(|r| r.generation == 1 && r.batch_id == Some(0) && r.event.is_none()), "batch ids restart at 0");
    assert_eq!(s.duplicate_change_rows().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_loss_within_the_interval_needs_a_person_then_interval_0_recovers() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(30, FULL);
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s, 4);
    assert!(s.stream().await.unwrap().recovery.is_some());
    // Three and a half days later it happens again: within the 7-day interval.
    stop_past_the_retention(&mut s, 4);
    let e = s.stream().await.unwrap_err();
    assert_eq!(e.exit_code(), 3, "{e}");
    let msg = e.to_string();
    assert!(msg.contains("resnapshot_interval_days") && msg.contains("generation 1"), "{msg}");
    let rows = facts(&s).await;
    assert_eq!(events(&rows, "recovery").len(), 1, "the guard stops before writing anything");
    // A person decides: interval 0 re-snapshots now.
    let mut wf = s.workflow();
    wf.stream.resnapshot_interval_days = 0.0;
    let mut ctx = engine::Context::open(wf).await.unwrap();
    let r = engine::coarse::stream(&mut ctx).await.unwrap();
    assert_eq!(r.recovery.as_ref().unwrap().generation, 2, "{r:?}");
    assert_eq!(s.verify().await.differences(), 0);
    assert_eq!(events(&facts(&s).await, "resnapshot").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_mode_still_stops_and_says_how_to_recover() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(10, "[snapshot]\nbootstrap = true\n");
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s, 4);
    let e = s.stream().await.unwrap_err();
    assert!(matches!(e, StepError::DataLoss { .. }), "{e}");
    assert!(e.to_string().contains("on_data_loss"), "{e}");
    assert!(events(&facts(&s).await, "recovery").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_resnapshot_outliving_the_retention_fails_and_its_chunked_rerun_succeeds() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(100, FULL);
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s, 4);
    // The re-snapshot reads slowly; meanwhile the writer goes on and cleanup
    // passes the snapshot's LSN before the read ends.
    s.db.set_config_value("conn_rows_per_s", "30").unwrap();
    let db = mssql_cdc::sim::SimDb::open(s.db.path()).unwrap();
    let table = s.table.clone();
    let log = s.path().join("facts/_delta_log");
    let commits = move || std::fs::read_dir(&log).unwrap().filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "json")).count();
    let before = commits();
    let racer = std::thread::spawn(move || {
        // Once the recovery row and the re-snapshot's open are committed, the read is under way.
        let waited = std::time::Instant::now();
        while commits() < before + 2 {
            assert!(waited.elapsed() < Duration::from_secs(30), "the re-snapshot never opened");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        db.transaction(|tx| tx.insert(&table, common::item_row(10_000, 1))).unwrap();
        common::settle(&db);
        let max = db.max_lsn().unwrap().unwrap();
        db.cleanup_to_lsn(max).unwrap();
    });
    let e = s.stream().await.unwrap_err();
    racer.join().unwrap();
    assert_eq!(e.exit_code(), 3, "{e}");
    assert!(e.to_string().contains("chunked") && e.to_string().contains("--resnapshot-interval-days 0"), "{e}");
    s.db.set_config_value("conn_rows_per_s", "null").unwrap();
    let rows = facts(&s).await;
    assert_eq!(events(&rows, "resnapshot_failed").len(), 1);
    assert!(events(&rows, "resnapshot").is_empty());
    assert_eq!(s.count("bronze", "_snapshot IS NOT NULL AND _snapshot <> (SELECT MIN(_snapshot) FROM t)").await, 0, "the failed read was not committed");
    // The rerun (still within the interval of the failed attempt) needs a person.
    let e = s.stream().await.unwrap_err();
    assert_eq!(e.exit_code(), 3);
    assert!(e.to_string().contains("failed re-snapshot"), "{e}");
    // The person switches to chunked with interval 0: it opens the same generation.
    s.write_workflow(&CHUNKED.replace("on_data_loss = \"resnapshot\"", "on_data_loss = \"resnapshot\"\nresnapshot_interval_days = 0"));
    let r = s.stream().await.unwrap();
    let rec = r.recovery.as_ref().unwrap();
    assert_eq!((rec.generation, rec.mode, rec.resumed), (1, "chunked", true), "{rec:?}");
    backfill_until_done(&s).await;
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    let rows = facts(&s).await;
    assert_eq!(events(&rows, "recovery").len(), 1);
    let done = events(&rows, "resnapshot");
    assert_eq!(done.len(), 1);
    assert!(done[0].lost_to_ts.is_some(), "the chunked completion carries the gap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_recovery_streams_at_once_and_backfill_completes_it() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(50, CHUNKED);
    s.stream().await.unwrap();
    backfill_until_done(&s).await;
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s, 4);
    let r = s.stream().await.unwrap();
    let rec = r.recovery.as_ref().unwrap();
    assert_eq!((rec.generation, rec.mode, rec.rows), (1, "chunked", None));
    // The new generation streams from S before any chunk is read.
    s.changes(5);
    let r = s.stream().await.unwrap();
    assert_eq!((r.generation, r.batches), (1, 1), "{r:?}");
    // A second loss while it is still open (interval 0) opens a newer one.
    let mut s2wf = s.workflow();
    s2wf.stream.resnapshot_interval_days = 0.0;
    stop_past_the_retention(&mut s, 4);
    let mut ctx = engine::Context::open(s2wf).await.unwrap();
    let r = engine::coarse::stream(&mut ctx).await.unwrap();
    assert_eq!(r.recovery.as_ref().unwrap().generation, 2);
    backfill_until_done(&s).await;
    s.changes(4);
    s.stream_until_caught_up().await;
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{cmp:?}");
    let rows = facts(&s).await;
    let done = events(&rows, "resnapshot");
    assert_eq!(done.len(), 1, "the abandoned generation-1 snapshot never completes");
    assert_eq!(done[0].generation, 2);
    assert_eq!(events(&rows, "recovery").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_every_step_of_a_recovery_reruns_to_one_snapshot_and_one_event() {
    let _fp = fail::FailScenario::setup();
    for point in ["recover.after_recovery_row", "snapshot.after_open", "snapshot.after_bronze", "snapshot.after_event"] {
        let mut s = Scenario::new(25, FULL);
        s.stream_until_caught_up().await;
        stop_past_the_retention(&mut s, 4);
        fail::cfg(point, "return").unwrap();
        let e = s.stream().await.unwrap_err();
        fail::remove(point);
        assert!(e.to_string().contains(point), "{point}: {e}");
        s.changes(3);
        common::settle(&s.db);
        let r = s.stream().await.unwrap();
        assert_eq!(r.generation, 1, "{point}: {r:?}");
        let rows = facts(&s).await;
        assert_eq!(events(&rows, "recovery").len(), 1, "{point}");
        assert_eq!(events(&rows, "resnapshot").len(), 1, "{point}");
        assert_eq!(s.count("bronze", "_operation = 0 AND _snapshot = (SELECT MAX(_snapshot) FROM t)").await, events(&rows, "resnapshot")[0].rows.unwrap(), "{point}");
        let snapshots = s.count("bronze", "_operation = 0 AND _snapshot IS NOT NULL").await;
        let boot = events(&rows, "bootstrap")[0].rows.unwrap();
        assert_eq!(snapshots, boot + events(&rows, "resnapshot")[0].rows.unwrap(), "{point}: one re-snapshot in bronze");
        assert_eq!(s.verify().await.differences(), 0, "{point}");
        assert_eq!(s.duplicate_change_rows().await, 0, "{point}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_mode_records_the_gap_once_with_the_batch() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(10, SKIP);
    s.stream_until_caught_up().await;
    stop_past_the_retention(&mut s, 4);
    // A crash after the batch's bronze commit: the repair writes the gap row too, once.
    fail::cfg("stream.after_bronze", "return").unwrap();
    assert!(s.stream().await.is_err());
    fail::remove("stream.after_bronze");
    let r = s.stream().await.unwrap();
    assert_eq!(r.repaired_batches.len(), 1, "{r:?}");
    let rows = facts(&s).await;
    let skipped = events(&rows, "data_skipped");
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    let d = skipped[0].detail.as_ref().unwrap();
    assert_eq!(d["certain"], true);
    assert!(skipped[0].lost_from_ts.unwrap() < skipped[0].lost_to_ts.unwrap());
    assert_eq!(skipped[0].batch_id, rows.iter().filter(|r| r.event.is_none()).filter_map(|r| r.batch_id).max());
    assert_eq!(r.generation, 0, "a skip stays in its generation");
    // Calls after it write no more gap rows.
    s.changes(3);
    s.stream_until_caught_up().await;
    assert_eq!(events(&facts(&s).await, "data_skipped").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_log_of_a_full_recovery() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(20, FULL);
    s.stream_until_caught_up().await;
    s.changes(4);
    s.stream().await.unwrap();
    stop_past_the_retention(&mut s, 4);
    assert!(s.stream().await.unwrap().recovery.is_some());
    s.changes(3);
    s.stream().await.unwrap();
    // The last commits were inside the capture lag.
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    let log = s.golden().await;
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_recovery_full", log));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_log_of_a_chunked_recovery() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(30, CHUNKED);
    s.stream().await.unwrap();
    backfill_until_done(&s).await;
    s.changes(4);
    s.stream().await.unwrap();
    stop_past_the_retention(&mut s, 4);
    assert!(s.stream().await.unwrap().recovery.is_some());
    s.changes(3);
    s.stream().await.unwrap();
    backfill_until_done(&s).await;
    s.stream().await.unwrap();
    // The last commits were inside the capture lag.
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    let log = s.golden().await;
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_recovery_chunked", log));
}

/// The two demo scenarios end to end, small: no person involved, a re-snapshot, no difference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_loss_demos_recover_with_no_difference() {
    let _fp = fail::FailScenario::setup();
    for scenario in [mssql_cdc::demo::DemoScenario::DataLoss, mssql_cdc::demo::DemoScenario::DataLossChunked] {
        let dir = tempfile::tempdir().unwrap();
        let args = mssql_cdc::demo::DemoArgs {
            rows: 3_000,
            dir: dir.path().join("demo"),
            scenario,
            stream_seconds: 2,
            writer_tx_per_s: 100.0,
            seed: 7,
        };
        let (out, ok) = mssql_cdc::demo::run(args).await.unwrap();
        assert!(ok, "{out}");
        assert_eq!(out["differences"], 0, "{out}");
        assert!(out["resnapshots"].as_u64().unwrap() >= 1, "{out}");
        assert_eq!(out["generation"], 1, "{out}");
    }
}

/// A capture-instance switch mid-stream with a column added (what the seeds
/// take from 0023): the old instance is read up to the new one's start, the
/// new one from there, bronze gains the column, no change is lost, and the
/// switch and the schema change are facts rows of the batch that first reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_instance_switch_mid_stream_with_a_column_added_loses_nothing() {
    use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(20, "[snapshot]\nbootstrap = true\n[stream]\nmax_batch_rows = 1000\n");
    s.stream_until_caught_up().await;
    s.changes(5);
    s.stream().await.unwrap();
    s.changes(4); // on the old instance only, not read yet
    s.db.add_column(&s.table, ColumnDesc::new("note", SqlType::NVarChar { len: Some(20) }, true)).unwrap();
    s.db.enable_cdc(&s.table, Some("dbo_items_v2"), None).unwrap();
    let table = s.table.clone();
    let row = |id: i64, v: i64| {
        let mut r = common::item_row(id, v);
        r.push(SqlValue::Str(format!("note {id}.{v}")));
        r
    };
    let k = s.db.keys(&table).unwrap()[0].clone();
    let kid = k[0].as_i64().unwrap();
    s.db.transaction(|tx| {
        tx.insert(&table, row(900, 1))?;
        tx.update(&table, &k, row(kid, 9))
    })
    .unwrap();
    common::settle(&s.db);
    s.stream_until_caught_up().await;
    // The old instance goes; the stream is already past the switch.
    s.db.disable_instance("dbo_items").unwrap();
    s.db.transaction(|tx| tx.insert(&table, row(901, 1))).unwrap();
    s.stream_until_caught_up().await;
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{cmp:?}");
    assert_eq!(s.duplicate_change_rows().await, 0);
    assert_eq!(s.count("bronze", &format!("note = 'note {kid}.9'")).await, 1, "bronze holds the added column");
    assert_eq!(s.count("bronze", "_capture_instance = 'dbo_items_v2' AND _operation <> 0").await, 3, "insert, update, insert");
    let rows = facts(&s).await;
    let switched = events(&rows, "capture_instance_switched");
    assert_eq!(switched.len(), 1, "{switched:?}");
    assert_eq!(switched[0].detail.as_ref().unwrap()["to"], "dbo_items_v2");
    assert!(switched[0].batch_id.is_some());
    let change = events(&rows, "schema_change");
    assert_eq!(change.len(), 1);
    assert_eq!(change[0].detail.as_ref().unwrap()["added"], serde_json::json!(["note"]));
}
