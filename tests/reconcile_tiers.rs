//! `reconcile`'s tier 1 and the lag it reads, on the simulator (adr-0028
//! rows 28.39, 28.40, 28.88, 28.92, 28.93; adr-0025 row 25.38): buckets of a
//! date key, one counted whole table for a varchar key, the change table
//! read per capture instance with only the key columns, a commit the capture
//! job has not harvested, a seeded and a chunked table, and `status`'s
//! headroom read on the stream's instance.

mod common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use chrono::NaiveDate;
use common::Scenario;
use mssql_cdc::delta;
use mssql_cdc::engine::apply;
use mssql_cdc::engine::chunked::{self, BackfillArgs};
use mssql_cdc::engine::rebuild::key_text;
use mssql_cdc::engine::reconcile::{self, ReconcileResult};
use mssql_cdc::engine::seed::{self, AsOf, SeedArgs};
use mssql_cdc::engine::{self, Context};
use mssql_cdc::lsn::Lsn;
use mssql_cdc::sim::TableSpec;
use mssql_cdc::source::*;
use mssql_cdc::types::{as_stored, value_at, ColumnDesc, SqlType, SqlValue};
use serde_json::Value;

const DAY_US: i64 = 86_400_000_000;

/// Hooks on a source that hands every read to the simulator
/// (`common::Wrapped`) which write down each change-table read: (instance,
/// columns asked for, from, to).
#[derive(Default)]
struct ChangeReads(Mutex<Vec<(String, Vec<String>, Lsn, Lsn)>>);

#[async_trait]
impl common::Hooks for ChangeReads {
    async fn changes(
        &self,
        inner: &SharedSource,
        ci: &CaptureInstance,
        from: Lsn,
        to: Lsn,
        filter: RowFilter,
        batch_rows: usize,
    ) -> Result<BatchStream, SourceError> {
        self.0.lock().unwrap().push((ci.name.clone(), ci.columns.iter().map(|c| c.name.clone()).collect(), from, to));
        inner.changes(ci, from, to, filter, batch_rows).await
    }
}

/// A scenario whose workflow names another table of the simulator (`items`
/// stays, empty): `table` created with `rows`, CDC enabled, one capture scan.
fn other_table(spec: TableSpec, rows: Vec<Vec<SqlValue>>, workflow_extra: &str) -> Scenario {
    let mut s = Scenario::new(0, "");
    s.db.create_table(&spec).unwrap();
    s.db.load_rows(&spec.name, rows.into_iter()).unwrap();
    s.db.enable_cdc(&spec.name, None, None).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.table = spec.name.clone();
    let text = format!(
        "app_id = \"{n}\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"{n}\"\n[target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n{workflow_extra}\n",
        n = spec.name.name
    );
    std::fs::write(&s.wf_path, text).unwrap();
    s
}

fn events_spec() -> TableSpec {
    TableSpec { collations: Default::default(),
        name: TableName::new("dbo", "events"),
        columns: vec![
            ColumnDesc::new("day", SqlType::Date, false),
            ColumnDesc::new("note", SqlType::NVarChar { len: Some(40) }, true),
            ColumnDesc::new("amount", SqlType::Int, true),
        ],
        primary_key: vec!["day".into()],
        unique_index: vec![],
    }
}

fn day(i: i64) -> NaiveDate {
    NaiveDate::from_ymd_opt(2024, 1, 1).unwrap() + chrono::Duration::days(i * 3)
}

fn event_row(i: i64) -> Vec<SqlValue> {
    vec![SqlValue::Date(day(i)), if i % 5 == 0 { SqlValue::Null } else { SqlValue::Str(format!("event {i}")) }, SqlValue::Int(i * 7)]
}

fn codes_spec() -> TableSpec {
    TableSpec { collations: Default::default(),
        name: TableName::new("dbo", "codes"),
        columns: vec![ColumnDesc::new("code", SqlType::VarChar { len: Some(20) }, false), ColumnDesc::new("qty", SqlType::Int, true)],
        primary_key: vec!["code".into()],
        unique_index: vec![],
    }
}

async fn apply(s: &Scenario) {
    let mut ctx = s.context().await.unwrap();
    apply::run(&mut ctx).await.unwrap();
}

async fn reconcile(s: &Scenario) -> ReconcileResult {
    let mut ctx = s.context().await.unwrap();
    reconcile::run(&mut ctx).await.unwrap()
}

/// reconcile with the spy as its source; returns the result and the change-table reads.
async fn reconcile_spied(s: &Scenario) -> (ReconcileResult, Vec<(String, Vec<String>, Lsn, Lsn)>) {
    let mut ctx: Context = s.context().await.unwrap();
    let spy = Arc::new(common::Wrapped::new(ctx.source.clone(), ChangeReads::default()));
    ctx.source = spy.clone();
    let r = reconcile::run(&mut ctx).await.unwrap();
    let reads = spy.hooks.0.lock().unwrap().clone();
    (r, reads)
}

fn silver_loc(s: &Scenario) -> String {
    s.path().join("silver").to_string_lossy().into_owned()
}

/// Every silver row, every captured column, keyed by its key's text.
async fn silver_rows(s: &Scenario, columns: &[ColumnDesc], key_idx: usize) -> Vec<(String, Vec<SqlValue>)> {
    let t = delta::open_existing(&silver_loc(s), &Default::default()).await.unwrap().unwrap();
    let cols: Vec<String> = columns.iter().map(|c| format!("\"{}\"", c.name)).collect();
    let mut out = Vec::new();
    for b in delta::query(&t, &format!("SELECT {} FROM t", cols.join(", "))).await.unwrap() {
        let b = delta::plain_types(&b).unwrap();
        for r in 0..b.num_rows() {
            let row: Vec<SqlValue> = columns.iter().enumerate().map(|(i, c)| value_at(b.column(i).as_ref(), r, &c.sql_type)).collect();
            out.push((key_text(&row[key_idx..=key_idx]), row));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The simulator's own table, as silver stores its values, keyed the same way.
fn table_rows(s: &Scenario, columns: &[ColumnDesc], key_idx: usize) -> Vec<(String, Vec<SqlValue>)> {
    let mut out: Vec<(String, Vec<SqlValue>)> = s
        .db
        .rows(&s.table)
        .unwrap()
        .into_iter()
        .map(|row| {
            let row: Vec<SqlValue> = row.iter().zip(columns).map(|(v, c)| as_stored(v, &c.sql_type)).collect();
            (key_text(&row[key_idx..=key_idx]), row)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

async fn assert_silver_is_the_table(s: &Scenario, columns: &[ColumnDesc], why: &str) {
    assert_eq!(silver_rows(s, columns, 0).await, table_rows(s, columns, 0), "{why}: silver differs from the simulator's table");
}

async fn delete_from_silver(s: &Scenario, predicate: &str) {
    let t = delta::open_existing(&silver_loc(s), &Default::default()).await.unwrap().unwrap();
    let (_t, m) = t.delete().with_predicate(predicate).await.unwrap();
    assert_eq!(m.num_deleted_rows, Some(1), "{predicate}");
}

fn json(r: &ReconcileResult) -> Value {
    serde_json::to_value(r).unwrap()
}

fn micros(d: NaiveDate) -> i64 {
    (d.and_hms_opt(0, 0, 0).unwrap() - NaiveDate::from_ymd_opt(1, 1, 1).unwrap().and_hms_opt(0, 0, 0).unwrap()).num_microseconds().unwrap()
}

/// A date key gets tier 1 buckets (count and key sum per bucket of days, on
/// both sides); a row deleted from silver behind the engine's back makes
/// exactly its bucket mismatch, and tier 2 reads that bucket alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_date_key_gets_buckets_and_a_row_missing_from_silver_is_found_in_its_bucket() {
    let s = other_table(events_spec(), (0..120).map(event_row).collect(), "[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nbuckets = 8\nsample_fraction = 0.0\n");
    let columns = events_spec().columns;
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, &columns, "after the bootstrap").await;
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(r.clean, "{j:#}");
    assert_eq!((r.tier1, r.buckets_mismatched, r.buckets_compared, r.rows_compared), ("buckets", 0, 0, 0), "{j:#}");
    assert!(r.buckets > 1, "{j:#}");
    assert_eq!((r.rows_source, r.rows_target), (120, 120), "{j:#}");

    let gone = day(77);
    delete_from_silver(&s, &format!("day = CAST('{}' AS DATE)", gone.format("%Y-%m-%d"))).await;
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(!r.clean, "{j:#}");
    assert_eq!((r.tier1, r.buckets_mismatched, r.buckets_compared, r.differences), ("buckets", 1, 1, 1), "{j:#}");
    assert_eq!((r.rows_source, r.rows_target), (120, 119), "{j:#}");
    let d = &r.samples[0];
    assert_eq!((d["class"].as_str(), d["key"]["day"].as_str()), (Some("MISSING_TARGET"), Some(gone.format("%Y-%m-%d").to_string().as_str())), "{j:#}");
    // The bucket holds the key: [start, start + width) in microseconds from 0001-01-01, whole days.
    let (start, width) = (d["bucket"].as_i64().expect("the bucket is reported"), j["bucket_width"].as_i64().expect("the width is reported"));
    assert!(start <= micros(gone) && micros(gone) < start + width && width % DAY_US == 0 && start % DAY_US == 0, "{j:#}");
    // Tier 2 read that bucket only: as many source rows as the table holds there.
    let in_bucket = table_rows(&s, &columns, 0)
        .iter()
        .filter(|(_, row)| matches!(&row[0], SqlValue::Date(d) if (start..start + width).contains(&micros(*d))))
        .count() as u64;
    assert_eq!(r.rows_compared, in_bucket, "{j:#}");
    assert!(in_bucket < 120, "{j:#}");
}

/// A varchar key gets one row count for the whole table, counted on the
/// source: equal counts with sample_fraction 0 compare no row; a row
/// missing from silver makes the count mismatch, and tier 2 names the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_varchar_key_is_counted_whole_in_tier_one() {
    let rows: Vec<Vec<SqlValue>> = (0..60).map(|i| vec![SqlValue::Str(format!("c-{i:03}")), SqlValue::Int(i)]).collect();
    let s = other_table(codes_spec(), rows, "[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nsample_fraction = 0.0\n");
    let columns = codes_spec().columns;
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, &columns, "after the bootstrap").await;
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(r.clean, "{j:#}");
    assert_eq!((r.tier1, r.buckets, r.buckets_mismatched), ("count", 1, 0), "{j:#}");
    assert_eq!((r.rows_source, r.rows_target), (60, 60), "{j:#}");
    assert_eq!((r.buckets_compared, r.rows_compared), (0, 0), "equal counts and no sample: no row is read: {j:#}");

    delete_from_silver(&s, "code = 'c-017'").await;
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(!r.clean, "{j:#}");
    assert_eq!((r.tier1, r.buckets_mismatched, r.buckets_compared), ("count", 1, 1), "{j:#}");
    assert_eq!((r.rows_source, r.rows_target, r.differences), (60, 59, 1), "{j:#}");
    assert_eq!((r.samples[0]["class"].as_str(), r.samples[0]["key"]["code"].as_str()), (Some("MISSING_TARGET"), Some("c-017")), "{j:#}");
}

/// A varchar-keyed table of 600 rows with `reconcile.bucket_rows = 100`:
/// tier 2 never holds the whole table. Clean, the hash partitions' counts
/// and checksums match and no row is held. With silver damaged behind the
/// engine's back (three rows deleted, two values changed, one row held
/// twice) exactly those keys are reported, each with its class, and no pass
/// held more than 100 rows of a side: the old tier 2 held all 1,200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_string_key_table_larger_than_bucket_rows_is_compared_in_hash_partitions() {
    let rows: Vec<Vec<SqlValue>> = (0..600).map(|i| vec![SqlValue::Str(format!("c-{i:04}")), SqlValue::Int(i)]).collect();
    let s = other_table(codes_spec(), rows, "[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nsample_fraction = 1.0\nbucket_rows = 100\n");
    let columns = codes_spec().columns;
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, &columns, "after the bootstrap").await;
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(r.clean, "{j:#}");
    assert_eq!((r.tier1, r.buckets_compared, r.rows_source, r.rows_target), ("count", 1, 600, 600), "{j:#}");
    assert!(r.partitions >= 12, "600 rows are cut into partitions of about 64: {j:#}");
    assert_eq!((r.partitions_mismatched, r.passes, r.rows_held_max, r.rows_compared), (0, 0, 0, 0), "clean: no partition is read again: {j:#}");

    for code in ["c-0017", "c-0311", "c-0598"] {
        delete_from_silver(&s, &format!("code = '{code}'")).await;
    }
    let t = delta::open_existing(&silver_loc(&s), &Default::default()).await.unwrap().unwrap();
    let (t, m) = t.update().with_predicate("code = 'c-0100' OR code = 'c-0444'").with_update("qty", "-1").await.unwrap();
    assert_eq!(m.num_updated_rows, 2);
    // A second copy of c-0250 in silver: a hash map keyed on the key would hide it.
    let mut t = t;
    let copy: Vec<_> = delta::query(&t, "SELECT * FROM t WHERE code = 'c-0250'").await.unwrap().iter().map(|b| delta::plain_types(b).unwrap()).collect();
    assert_eq!(copy.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
    delta::append_untracked(&mut t, copy, serde_json::json!({"test": "a second copy of a key"})).await.unwrap();

    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(!r.clean, "{j:#}");
    assert_eq!((r.rows_source, r.rows_target), (600, 598), "{j:#}");
    let mut found: Vec<(String, String)> =
        r.samples.iter().map(|d| (d["class"].as_str().unwrap().to_string(), d["key"]["code"].as_str().unwrap().to_string())).collect();
    found.sort();
    let mut want: Vec<(String, String)> = [
        ("MISSING_TARGET", "c-0017"),
        ("MISSING_TARGET", "c-0311"),
        ("MISSING_TARGET", "c-0598"),
        ("RECORD_DIFF", "c-0100"),
        ("RECORD_DIFF", "c-0444"),
        ("MISSING_SOURCE", "c-0250"),
    ]
    .iter()
    .map(|(c, k)| (c.to_string(), k.to_string()))
    .collect();
    want.sort();
    assert_eq!(found, want, "{j:#}");
    assert_eq!(r.differences, 6, "{j:#}");
    assert!(r.partitions_mismatched >= 1 && r.partitions_mismatched <= 6, "only the damaged partitions are read again: {j:#}");
    assert!(r.passes >= 1, "{j:#}");
    assert!(r.rows_held_max > 0 && r.rows_held_max <= 200, "a pass holds at most bucket_rows rows of each side: {j:#}");
    assert!(r.rows_compared < 600, "only the mismatched partitions' rows are compared row by row: {j:#}");
}

/// An integer key gets enough tier 1 buckets for `bucket_rows` (300 rows at
/// 20 a bucket, though `buckets` asks for 4), and tier 2 holds one bucket at
/// a time: with every bucket sampled, no pass holds more than a bucket's
/// rows of each side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_integer_key_gets_buckets_of_bucket_rows_and_tier_two_holds_one_at_a_time() {
    let s = Scenario::new(300, "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nbuckets = 4\nbucket_rows = 20\nsample_fraction = 1.0\n");
    s.stream_until_caught_up().await;
    apply(&s).await;
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(r.clean, "{j:#}");
    assert_eq!(r.tier1, "buckets", "{j:#}");
    assert!(r.buckets >= 15, "300 rows at 20 a bucket: {j:#}");
    assert_eq!(r.passes as usize, r.buckets_compared, "one pass a bucket: {j:#}");
    assert_eq!(r.rows_compared, 300, "{j:#}");
    assert!(r.rows_held_max <= 2 * 25, "one bucket's rows of each side at a time, not the {} of the whole table: {j:#}", 2 * 300);
}

/// Lag pending on both sides of a capture-instance switch: the change table
/// is read as the stream reads it, the older instance up to the newer one's
/// start and the newer one from there, key columns only; every changed key
/// is IN_FLIGHT, and once streamed and applied reconcile is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_across_a_capture_instance_switch_is_read_per_instance_keys_only() {
    let s = Scenario::new(30, "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nbuckets = 4\nsample_fraction = 1.0\n");
    let columns = common::items_spec(&s.table).columns;
    s.stream_until_caught_up().await;
    apply(&s).await;
    let r = reconcile(&s).await;
    assert!(r.clean && r.counts["IN_FLIGHT"] == 0, "{:#}", json(&r));
    let position = {
        let mut ctx = s.context().await.unwrap();
        engine::state::load(&mut ctx).await.unwrap().position().unwrap()
    };
    let table = s.table.clone();
    // In the older instance only.
    s.db.transaction(|tx| {
        tx.update(&table, &vec![SqlValue::Int(3)], common::item_row(3, 50))?;
        tx.update(&table, &vec![SqlValue::Int(5)], common::item_row(5, 50))
    })
    .unwrap();
    common::settle(&s.db);
    let newer = s.db.enable_cdc(&table, Some("dbo_items_v2"), None).unwrap();
    let start = newer.start_lsn.unwrap();
    // In both instances.
    s.db.transaction(|tx| {
        tx.update(&table, &vec![SqlValue::Int(7)], common::item_row(7, 51))?;
        tx.insert(&table, common::item_row(300, 0))?;
        tx.delete(&table, &vec![SqlValue::Int(9)])
    })
    .unwrap();
    common::settle(&s.db);
    let max = s.db.max_lsn().unwrap().unwrap();

    let (r, reads) = reconcile_spied(&s).await;
    let j = json(&r);
    assert!(r.clean, "lag across the switch is not a failure: {j:#}");
    assert_eq!(r.counts["IN_FLIGHT"], 5, "{j:#}");
    let mut flight: Vec<i64> = r.samples.iter().filter(|d| d["class"] == "IN_FLIGHT").map(|d| d["key"]["id"].as_i64().unwrap()).collect();
    flight.sort();
    assert_eq!(flight, vec![3, 5, 7, 9, 300], "{j:#}");
    let id = vec!["id".to_string()];
    assert_eq!(
        reads,
        vec![("dbo_items".to_string(), id.clone(), position.increment(), start.decrement()), ("dbo_items_v2".to_string(), id, start, max)],
        "one read per instance's piece, key columns only"
    );

    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, &columns, "after the switch").await;
    let (r, reads) = reconcile_spied(&s).await;
    assert!(r.clean && r.counts["IN_FLIGHT"] == 0 && r.differences == 0, "{:#}", json(&r));
    assert!(reads.iter().all(|(ci, _, _, _)| ci == "dbo_items_v2"), "{reads:?}");
}

/// A commit the capture job has not harvested is in no change table, so
/// the keys it changed differ without being IN_FLIGHT. adr-0028 Amendment 2
/// left that as a false difference that clears on the next run; reconcile
/// now waits for the capture job to pass the end of its reads, and when it
/// has not (here an hour's lag and no wait) the call is a call-again that
/// writes nothing. The next run, after the capture scan, takes the key as
/// IN_FLIGHT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_not_yet_harvested_is_a_call_again_and_the_next_run_clears_it() {
    let s = Scenario::new(
        20,
        "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nbuckets = 4\nsample_fraction = 0.0\ncapture_wait_seconds = 0\n",
    );
    let columns = common::items_spec(&s.table).columns;
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert!(reconcile(&s).await.clean);
    s.db.set_config_value("capture_lag_ms", "3600000").unwrap();
    let table = s.table.clone();
    let before = s.db.max_lsn().unwrap();
    s.db.transaction(|tx| tx.insert(&table, common::item_row(500, 0))).unwrap();
    s.db.capture().unwrap(); // a scan that leaves the commit inside the lag
    assert_eq!(s.db.max_lsn().unwrap(), before, "the commit is still inside the capture lag");
    let mut ctx = s.context().await.unwrap();
    let e = reconcile::run(&mut ctx).await.unwrap_err();
    assert!(matches!(e, mssql_cdc::error::StepError::Temporary(_)), "{e}");
    assert!(e.to_string().contains("1 key(s) differ") && e.to_string().contains("capture job"), "{e}");
    // The capture job harvests it: the next run sees it in the change table.
    s.db.advance_clock(std::time::Duration::from_secs(7200)).unwrap();
    common::settle(&s.db);
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(r.clean, "{j:#}");
    assert_eq!((r.differences, r.counts["IN_FLIGHT"]), (0, 1), "{j:#}");
    assert_eq!(r.run, 1, "the call-again wrote no report, so this is the second run: {j:#}");
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, &columns, "after the harvest").await;
    let r = reconcile(&s).await;
    assert!(r.clean && r.counts["IN_FLIGHT"] == 0, "{:#}", json(&r));
}

/// A silver that lost every row: reconcile finds a difference in every row
/// of the table, more than it holds in memory (10,000), so the rest go to a
/// temporary file and are read back for the in-flight check and the count.
/// Every one is counted, keys changed since silver's apply are IN_FLIGHT
/// though they were found after the first 10,000, and the report keeps
/// `max_report_rows` of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_difference_is_counted_when_silver_lost_every_row() {
    let n = 25_000i64;
    let s = Scenario::new(
        n,
        "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nsample_fraction = 0.0\nmax_report_rows = 100\ncapture_wait_seconds = 0\n",
    );
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert!(reconcile(&s).await.clean);
    let t = delta::open_existing(&silver_loc(&s), &Default::default()).await.unwrap().unwrap();
    let (_t, m) = t.delete().await.unwrap();
    assert_eq!(m.num_deleted_rows, Some(n as usize), "every silver row is deleted behind the engine's back");
    // The five highest keys change at the source and are streamed, not applied.
    let table = s.table.clone();
    s.db.transaction(|tx| {
        for i in n - 4..=n {
            tx.update(&table, &vec![SqlValue::Int(i)], common::item_row(i, 1))?;
        }
        Ok(())
    })
    .unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.stream_until_caught_up().await;
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(!r.clean, "{j:#}");
    assert_eq!((r.counts["MISSING_TARGET"], r.counts["IN_FLIGHT"], r.differences), (n as u64 - 5, 5, n as u64 - 5), "{j:#}");
    // All but the first 10,000 went to disk, once as found and once labelled.
    assert_eq!(r.differences_spilled, 2 * (n as u64 - 10_000), "{j:#}");
    // The report: its summary row and max_report_rows of the differences, not all of them.
    let report = delta::open_existing(&s.workflow().reconcile_location().unwrap(), &Default::default()).await.unwrap().unwrap();
    let rows = delta::query(&report, &format!("SELECT class, COUNT(*) AS n FROM t WHERE run = {} GROUP BY class ORDER BY class", r.run)).await.unwrap();
    let mut by_class: Vec<(String, i64)> = Vec::new();
    for b in &rows {
        let b = delta::plain_types(b).unwrap();
        for i in 0..b.num_rows() {
            let SqlValue::Str(class) = value_at(b.column(0).as_ref(), i, &SqlType::VarChar { len: None }) else { panic!("a class is text") };
            let count = value_at(b.column(1).as_ref(), i, &SqlType::BigInt).as_i64().unwrap();
            by_class.push((class, count));
        }
    }
    // The five in flight were found last: the kept hundred are all missing.
    assert_eq!(by_class, vec![("MISSING_TARGET".to_string(), 100), ("SUMMARY".to_string(), 1)], "a summary and 100 differences");
}

/// Hooks that, once reconcile has read the server's clock after its source
/// reads, let the capture job catch up a moment later, while the call waits.
struct CaptureWhileWaiting(std::path::PathBuf);

#[async_trait]
impl common::Hooks for CaptureWhileWaiting {
    async fn server_now(&self, inner: &SharedSource) -> Result<chrono::NaiveDateTime, SourceError> {
        let t = inner.server_now().await;
        let path = self.0.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(400));
            common::settle(&mssql_cdc::sim::SimDb::open(&path).unwrap());
        });
        t
    }
}

/// reconcile with [`CaptureWhileWaiting`] on its source; the result and how long it took.
async fn reconcile_while_the_capture_job_catches_up(s: &Scenario) -> (ReconcileResult, std::time::Duration) {
    let mut ctx: Context = s.context().await.unwrap();
    ctx.source = Arc::new(common::Wrapped::new(ctx.source.clone(), CaptureWhileWaiting(s.path().join("source.sqlite"))));
    let started = std::time::Instant::now();
    let r = reconcile::run(&mut ctx).await.unwrap();
    (r, started.elapsed())
}

/// Under the shared configuration's capture lag, a commit just before
/// reconcile's reads is in the table but not yet in the change table. The
/// call waits for the capture job to pass the end of its reads, finds the
/// key's change there, and takes it as IN_FLIGHT; a real difference next to
/// it (a row removed from silver) still counts, and once the capture job has
/// caught up no wait is needed for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_inside_the_capture_lag_is_in_flight_once_the_capture_job_passes_the_reads() {
    let s = Scenario::new(
        20,
        "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[reconcile]\nbuckets = 4\nsample_fraction = 1.0\ncapture_wait_seconds = 20\n",
    );
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert!(reconcile(&s).await.clean);
    let table = s.table.clone();
    let before = s.db.max_lsn().unwrap();
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(5)], common::item_row(5, 42))).unwrap();
    assert_eq!(s.db.max_lsn().unwrap(), before, "the update is inside the capture lag");
    let (r, took) = reconcile_while_the_capture_job_catches_up(&s).await;
    let j = json(&r);
    assert!(r.clean, "{j:#}");
    assert_eq!((r.differences, r.counts["IN_FLIGHT"], r.counts["RECORD_DIFF"]), (0, 1, 0), "{j:#}");
    assert!(r.source_max_lsn > before, "the max LSN the capture job reached while the call waited: {j:#}");
    assert!(took >= std::time::Duration::from_millis(400), "the call waited for the capture job: {took:?}");

    // A real difference beside it: key 7 removed from silver.
    delete_from_silver(&s, "id = 7").await;
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(9)], common::item_row(9, 42))).unwrap();
    let (r, _) = reconcile_while_the_capture_job_catches_up(&s).await;
    let j = json(&r);
    assert!(!r.clean, "{j:#}");
    assert_eq!((r.differences, r.counts["MISSING_TARGET"], r.counts["IN_FLIGHT"]), (1, 1, 2), "{j:#}");
    assert_eq!(r.samples.iter().find(|d| d["class"] == "MISSING_TARGET").unwrap()["key"]["id"], 7, "{j:#}");
}

/// adr-0025: reconcile checks a table seeded from a copy, and one a chunked
/// snapshot bootstrapped, each with a date key's tier 1 buckets, and finds a
/// row removed from silver in either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_checks_a_seeded_table_and_a_chunked_one() {
    let columns = events_spec().columns;
    // Seeded from a Parquet copy taken at a known LSN.
    let s = other_table(events_spec(), (0..90).map(event_row).collect(), "[stream]\nmax_batch_rows = 1000\n[reconcile]\nbuckets = 6\nsample_fraction = 0.0\n");
    let copy = s.path().join("copy");
    let source = s.db.source().unwrap();
    let lsn = s.db.max_lsn().unwrap().unwrap();
    mssql_cdc::seed_copy::export_parquet(&source, &s.table, &columns, &copy, 7).await.unwrap();
    let table = s.table.clone();
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Date(day(4))], vec![SqlValue::Date(day(4)), SqlValue::Str("later".into()), SqlValue::Int(-4)])).unwrap();
    common::settle(&s.db);
    let mut ctx = s.context().await.unwrap();
    seed::run(&mut ctx, &SeedArgs { copy: copy.to_string_lossy().into_owned(), as_of: AsOf::Lsn(lsn), reseed: false, allow_missing_columns: false })
        .await
        .unwrap();
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, &columns, "after the seed").await;
    let r = reconcile(&s).await;
    assert!(r.clean && r.tier1 == "buckets" && r.rows_source == 90, "{:#}", json(&r));
    delete_from_silver(&s, &format!("day = CAST('{}' AS DATE)", day(50).format("%Y-%m-%d"))).await;
    let r = reconcile(&s).await;
    assert_eq!((r.differences, r.counts["MISSING_TARGET"], r.buckets_mismatched), (1, 1, 1), "{:#}", json(&r));

    // Bootstrapped by a chunked snapshot beside the stream.
    let s = other_table(
        events_spec(),
        (0..90).map(event_row).collect(),
        "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 20\ntarget_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n[reconcile]\nbuckets = 6\nsample_fraction = 0.0\n",
    );
    s.stream_until_caught_up().await;
    loop {
        let mut ctx = s.context().await.unwrap();
        if chunked::backfill(&mut ctx, &BackfillArgs::default()).await.unwrap().done {
            break;
        }
    }
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, &columns, "after the chunked bootstrap").await;
    let r = reconcile(&s).await;
    assert!(r.clean && r.tier1 == "buckets" && r.chunks_checked >= 4 && r.rows_source == 90, "{:#}", json(&r));
    delete_from_silver(&s, &format!("day = CAST('{}' AS DATE)", day(11).format("%Y-%m-%d"))).await;
    let r = reconcile(&s).await;
    assert_eq!((r.differences, r.counts["MISSING_TARGET"], r.buckets_mismatched), (1, 1, 1), "{:#}", json(&r));
}

/// A varchar key whose order is the collation's (case-insensitive): a letter
/// per key, upper or lower case by turn, so code-point order would put every
/// capital first.
fn mixed_code(i: i64) -> String {
    let letter = (b'a' + (i % 26) as u8) as char;
    let letter = if i % 2 == 1 { letter.to_ascii_uppercase() } else { letter };
    format!("{letter}{i:03}")
}

/// While a chunked snapshot is open, silver holds only the chunks of the
/// waves it applied: a key elsewhere is SNAPSHOT_PENDING and the run is
/// clean, while a row lost from an applied chunk is still a difference. The
/// chunks are cut on a case-insensitive varchar key, so a key is placed in
/// its chunk by the server's order (code-point order would misplace every
/// capital).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_beside_an_open_chunked_snapshot_holds_its_unapplied_keys_pending() {
    let rows: Vec<Vec<SqlValue>> = (0..120).map(|i| vec![SqlValue::Str(mixed_code(i)), SqlValue::Int(i)]).collect();
    let s = other_table(
        codes_spec(),
        rows,
        "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 15\nparallelism = 1\ntarget_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n[reconcile]\nsample_fraction = 1.0\ncapture_wait_seconds = 0\n",
    );
    let columns = codes_spec().columns;
    // The stream opens the snapshot; two waves are read and applied, the rest not.
    s.stream_until_caught_up().await;
    for _ in 0..2 {
        let mut ctx = s.context().await.unwrap();
        let r = chunked::backfill(&mut ctx, &BackfillArgs { max_waves: Some(1), ..Default::default() }).await.unwrap();
        assert!(!r.done, "the snapshot must stay open for this test: {r:?}");
    }
    apply(&s).await;
    let held = silver_rows(&s, &columns, 0).await;
    assert!(!held.is_empty() && held.len() < 120, "silver holds {} rows: the two waves should hold some, not all", held.len());
    let r = reconcile(&s).await;
    let j = json(&r);
    // Every key silver does not hold is in a range the snapshot has not applied; every one it holds matches.
    assert!(r.clean && r.differences == 0, "{j:#}");
    assert_eq!(r.counts["SNAPSHOT_PENDING"], 120 - held.len() as u64, "{j:#}");
    assert!(r.open_snapshot.is_some() && r.open_snapshot_chunks_applied >= 2, "{j:#}");

    // Rows lost from the applied chunks (every capital silver holds) are differences, not pending.
    let capitals: Vec<String> = held.iter().map(|(_, row)| row[0].clone()).filter_map(|v| match v {
        SqlValue::Str(k) if k.starts_with(|c: char| c.is_ascii_uppercase()) => Some(k),
        _ => None,
    }).collect();
    assert!(capitals.len() >= 2, "{capitals:?}");
    for k in &capitals {
        delete_from_silver(&s, &format!("code = '{k}'")).await;
    }
    let r = reconcile(&s).await;
    let j = json(&r);
    assert!(!r.clean, "{j:#}");
    assert_eq!((r.differences, r.counts["MISSING_TARGET"]), (capitals.len() as u64, capitals.len() as u64), "{j:#}");
    assert_eq!(r.counts["SNAPSHOT_PENDING"], 120 - held.len() as u64, "{j:#}");

    // Once the snapshot completes and is applied, nothing is pending and the lost rows are back.
    loop {
        let mut ctx = s.context().await.unwrap();
        if chunked::backfill(&mut ctx, &BackfillArgs::default()).await.unwrap().done {
            break;
        }
    }
    s.stream_until_caught_up().await;
    apply(&s).await;
    let r = reconcile(&s).await;
    assert!(r.clean && r.open_snapshot.is_none() && r.counts["SNAPSHOT_PENDING"] == 0, "{:#}", json(&r));
    assert_silver_is_the_table(&s, &columns, "after the snapshot completed").await;
}

/// `status` reads the min LSN (so the headroom) of the instance the stream
/// is on, not of a newer one it has not reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_headroom_is_the_streams_instances() {
    let s = Scenario::new(10, "[snapshot]\nbootstrap = true\nmode = \"full\"\n");
    s.stream_until_caught_up().await;
    s.db.advance_clock(std::time::Duration::from_secs(30)).unwrap();
    let older = s.db.capture_instances(&s.table).unwrap()[0].clone();
    let newer = s.db.enable_cdc(&s.table, Some("dbo_items_v2"), None).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    let mut ctx = Context::open_read_only(s.workflow()).await.unwrap();
    let j = engine::status::run(&mut ctx).await.unwrap();
    assert_eq!(j["capture_instance"], "dbo_items", "{j:#}");
    assert_eq!(j["source_min_lsn"], serde_json::to_value(older.start_lsn).unwrap(), "{j:#}");
    assert_ne!(j["source_min_lsn"], serde_json::to_value(newer.start_lsn).unwrap(), "{j:#}");
}
