//! The change read's order as SQL Server gives it (issue 12 §1): a set-based
//! update of unique keys, which SQL Server may log insert-before-delete,
//! streamed, applied and reconciled on a current change table (ordered by
//! `__$command_id`) and on one from before KB3030352 (no such column: the
//! batch is refused rather than a key dropped); error 313 met by the read
//! itself taking the `on_data_loss` path; errors 601 and 3961 as exit 75.
//!
//! Silver is compared with the simulator's own table (`SimDb::rows`) on
//! every column, not through the engine's rebuild.

mod common;

use common::{cli, item_row, last_json, Scenario};
use deltalake::arrow::array::{Array, Int64Array};
use mssql_cdc::delta::{self, facts::FactRow};
use mssql_cdc::engine::{self, apply, reconcile};
use mssql_cdc::error::StepError;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::sim::FaultOn;
use mssql_cdc::types::{value_at, SqlValue};

const FULL: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n\
                    [reconcile]\nbuckets = 8\nsample_fraction = 1.0\n[stream]\nmax_batch_rows = 1000\n";

/// A scenario whose only capture instance has a change table without
/// `__$command_id` (an old server's): the instance Scenario::new enabled is
/// replaced before anything is streamed.
fn old_server(rows: i64, extra: &str) -> Scenario {
    let s = Scenario::new(rows, extra);
    let ci = s.db.capture_instances(&s.table).unwrap().remove(0);
    s.db.disable_instance(&ci.name).unwrap();
    s.db.enable_cdc_without_command_id(&s.table, Some(&ci.name), None).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s
}

/// One transaction of two set-based UPDATE statements on the primary key:
/// the five highest ids move up by one (a new id is either free or another
/// shifted row's old one), and the two lowest ids swap rows. Returns its
/// commit LSN.
fn set_based_key_updates(s: &mut Scenario) -> Lsn {
    let t = s.table.clone();
    let mut ids: Vec<i64> = s.db.keys(&t).unwrap().iter().map(|k| k[0].as_i64().unwrap()).collect();
    ids.sort_unstable();
    let top: Vec<i64> = ids[ids.len() - 5..].to_vec();
    let (a, b) = (ids[0], ids[1]);
    let lsn = s
        .db
        .transaction(|tx| {
            let shift = top.iter().map(|&k| (vec![SqlValue::Int(k)], item_row(k + 1, 500 + k))).collect();
            tx.update_keys(&t, shift)?;
            tx.update_keys(&t, vec![(vec![SqlValue::Int(a)], item_row(b, 903)), (vec![SqlValue::Int(b)], item_row(a, 904))])
        })
        .unwrap();
    s.next_id = s.next_id.max(top[4] + 2);
    common::settle(&s.db);
    lsn
}

async fn apply(s: &Scenario) {
    let mut ctx = s.context().await.unwrap();
    apply::run(&mut ctx).await.unwrap();
}

/// Every row of a table as canonical text per column, sorted. datetime2
/// values are cut to microseconds, the precision Delta keeps
/// (`SqlType::inexact_in_delta`); every other value is compared as it is.
fn canonical(rows: Vec<Vec<SqlValue>>) -> Vec<Vec<String>> {
    use chrono::Timelike;
    let text = |v: &SqlValue| match v {
        SqlValue::DateTime(t) => SqlValue::DateTime(t.with_nanosecond(t.nanosecond() / 1000 * 1000).unwrap()).canonical(),
        other => other.canonical(),
    };
    let mut out: Vec<Vec<String>> = rows.into_iter().map(|r| r.iter().map(text).collect()).collect();
    out.sort();
    out
}

/// Silver's captured columns (every one), read with a plain query.
async fn silver_rows(s: &Scenario) -> Vec<Vec<SqlValue>> {
    let loc = s.path().join("silver").to_string_lossy().into_owned();
    let t = delta::open_existing(&loc, &Default::default()).await.unwrap().expect("silver exists");
    let spec = common::items_spec(&s.table);
    let mut out = Vec::new();
    for b in delta::query(&t, "SELECT * FROM t").await.unwrap() {
        for i in 0..b.num_rows() {
            out.push(
                spec.columns
                    .iter()
                    .map(|c| value_at(b.column_by_name(&c.name).unwrap_or_else(|| panic!("silver lacks {}", c.name)).as_ref(), i, &c.sql_type))
                    .collect(),
            );
        }
    }
    out
}

async fn assert_silver_is_the_table(s: &Scenario, when: &str) {
    let want = canonical(s.db.rows(&s.table).unwrap());
    let got = canonical(silver_rows(s).await);
    let missing: Vec<_> = want.iter().filter(|r| !got.contains(r)).collect();
    let extra: Vec<_> = got.iter().filter(|r| !want.contains(r)).collect();
    assert!(missing.is_empty() && extra.is_empty() && got.len() == want.len(), "{when}: silver differs from the table\nmissing from silver: {missing:?}\nextra in silver: {extra:?}");
}

async fn bronze_i64(s: &Scenario, sql: &str) -> i64 {
    let ctx = s.context().await.unwrap();
    let b = delta::query(&ctx.bronze, sql).await.unwrap();
    b[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0)
}

async fn facts(s: &Scenario) -> Vec<FactRow> {
    let ctx = s.context().await.unwrap();
    engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
}

/// The batches of a generation cover their LSNs without a gap or overlap,
/// except across a recorded `data_skipped` range.
fn assert_contiguous(rows: &[FactRow], generation: i32) {
    let mut batches: Vec<&FactRow> = rows.iter().filter(|r| r.generation == generation && r.event.is_none() && r.batch_id.is_some()).collect();
    batches.sort_by_key(|r| r.batch_id);
    let skips: Vec<&FactRow> = rows.iter().filter(|r| r.generation == generation && r.event.as_deref() == Some("data_skipped")).collect();
    for w in batches.windows(2) {
        let (prev, next) = (w[0].max_lsn.unwrap(), w[1].min_lsn.unwrap());
        if next == prev.increment() {
            continue;
        }
        let skip = skips.iter().find(|k| k.batch_id == w[1].batch_id).unwrap_or_else(|| panic!("a gap without a data_skipped row: {prev} -> {next}"));
        let d = skip.detail.as_ref().unwrap();
        assert_eq!(d["from"].as_str().and_then(|x| Lsn::parse(x).ok()), Some(prev.increment()), "{d}");
        assert_eq!(d["to"].as_str().and_then(|x| Lsn::parse(x).ok()), Some(next), "{d}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_based_key_update_on_a_current_change_table_keeps_every_key() {
    let mut s = Scenario::new(20, FULL);
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, "after the bootstrap").await;
    let lsn = set_based_key_updates(&mut s);
    s.changes(6);
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, "after the set-based key updates").await;
    let mut ctx = s.context().await.unwrap();
    let r = reconcile::run(&mut ctx).await.unwrap();
    assert!(r.clean && r.differences == 0, "{r:#?}");
    assert_eq!(s.verify().await.differences(), 0, "the rebuild rule agrees");
    // Bronze: every change row carries its command id. In the key update
    // transaction, each key that was both deleted and inserted (17..20 by
    // the shift, 1 and 2 by the swap) has its delete's command id below its
    // insert's, while the log (seqval) holds the insert first.
    assert!(bronze_i64(&s, "SELECT COUNT(*) FROM t WHERE _operation <> 0").await > 0);
    assert_eq!(bronze_i64(&s, "SELECT COUNT(*) FROM t WHERE _operation <> 0 AND _command_id IS NULL").await, 0, "NULL _command_id in bronze");
    let l = lsn.to_hex();
    assert_eq!(bronze_i64(&s, &format!("SELECT COUNT(*) FROM t WHERE _start_lsn = '{l}'")).await, 14, "5 + 2 rows, a delete and an insert each");
    let b = delta::query(
        &ctx.bronze,
        &format!(
            "SELECT COUNT(*), SUM(CASE WHEN d._command_id < i._command_id THEN 1 ELSE 0 END), \
             SUM(CASE WHEN i._seqval < d._seqval THEN 1 ELSE 0 END) \
             FROM t AS d JOIN t AS i ON d.id = i.id AND d._start_lsn = i._start_lsn \
             WHERE d._operation = 1 AND i._operation = 2 AND d._start_lsn = '{l}'"
        ),
    )
    .await
    .unwrap();
    let n = |i: usize| b[0].column(i).as_any().downcast_ref::<Int64Array>().unwrap().value(0);
    assert_eq!(n(0), 6, "keys both deleted and inserted by the statement");
    assert_eq!(n(1), 6, "the delete's command id is below the insert's for every such key");
    assert_eq!(n(2), 6, "the log holds the insert before the delete for every such key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_based_key_update_on_an_old_change_table_is_refused_not_dropped() {
    let mut s = old_server(20, FULL);
    s.stream_until_caught_up().await;
    s.changes(8);
    s.stream_until_caught_up().await;
    apply(&s).await;
    // Other changes stream in seqval order with NULL command ids, and stay right.
    assert_silver_is_the_table(&s, "before the key updates").await;
    assert_eq!(bronze_i64(&s, "SELECT COUNT(*) FROM t WHERE _operation <> 0 AND _command_id IS NOT NULL").await, 0, "no command id on an old table");
    let silver_before = canonical(silver_rows(&s).await);
    let before = facts(&s).await.len();
    let bronze_rows = bronze_i64(&s, "SELECT COUNT(*) FROM t").await;
    let lsn = set_based_key_updates(&mut s);
    let e = s.stream().await.unwrap_err();
    assert_eq!(e.exit_code(), 3, "{e}");
    assert!(matches!(e, StepError::NeedsPerson(_)), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("__$command_id") && msg.contains(&lsn.to_hex()) && msg.contains("sp_vupgrade_replication"), "{msg}");
    assert_eq!(facts(&s).await.len(), before, "nothing written to facts");
    assert_eq!(bronze_i64(&s, "SELECT COUNT(*) FROM t").await, bronze_rows, "nothing written to bronze");
    // Silver keeps the last state it had; it never loses a key to the misorder.
    apply(&s).await;
    assert_eq!(canonical(silver_rows(&s).await), silver_before, "silver is unchanged by the refused batch");
}

/// The same statement shape through the CLI on an old change table: exit 3,
/// the refusal as JSON, nothing written.
#[test]
fn the_cli_refuses_an_ambiguous_order_with_exit_3() {
    let mut s = old_server(12, FULL);
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    set_based_key_updates(&mut s);
    let out = cli(&s, "stream");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(3), "{j}");
    assert_eq!(j["ok"], false);
    assert!(j["error"].as_str().unwrap().contains("without __$command_id"), "{j}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_313_met_by_the_read_recovers_in_resnapshot_mode() {
    let extra = format!("{FULL}on_data_loss = \"resnapshot\"\n");
    let mut s = Scenario::new(20, &extra);
    s.stream_until_caught_up().await;
    s.changes(10);
    common::settle(&s.db);
    // The guard sees a valid range; cleanup passes it before the read checks it.
    s.db.cleanup_before_next_change_read().unwrap();
    let r = s.stream().await.unwrap();
    let rec = r.recovery.as_ref().expect("the read's 313 took the on_data_loss path: a recovery");
    assert_eq!((rec.from_generation, rec.generation), (0, 1), "{rec:?}");
    assert!(r.caught_up, "{r:?}");
    s.changes(4);
    s.stream_until_caught_up().await;
    apply(&s).await;
    assert_silver_is_the_table(&s, "after the recovery").await;
    assert_contiguous(&facts(&s).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_313_met_by_the_read_records_a_skip_in_skip_mode() {
    let extra = format!("{FULL}on_data_loss = \"skip\"\n");
    let mut s = Scenario::new(20, &extra);
    s.stream_until_caught_up().await;
    s.changes(10);
    common::settle(&s.db);
    let min_before = s.context().await.unwrap().source.min_lsn("dbo_items").await.unwrap().unwrap();
    s.db.cleanup_before_next_change_read().unwrap();
    let r = s.stream().await.unwrap();
    assert_eq!(r.skipped.len(), 1, "{r:?}");
    assert_eq!(r.generation, 0, "a skip stays in its generation");
    let rows = facts(&s).await;
    let skipped: Vec<&FactRow> = rows.iter().filter(|r| r.event.as_deref() == Some("data_skipped")).collect();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    let d = skipped[0].detail.as_ref().unwrap();
    assert_eq!(d["certain"], true, "{d}");
    let min_after = s.context().await.unwrap().source.min_lsn("dbo_items").await.unwrap().unwrap();
    assert!(min_after > min_before, "cleanup moved the min LSN");
    assert_eq!(d["to"].as_str().and_then(|x| Lsn::parse(x).ok()), Some(min_after), "{d}");
    assert_contiguous(&rows, 0);
}

/// Error 601 on a change read and 3961 on a snapshot read are temporary:
/// exit 75, and the same call again goes on.
#[test]
fn errors_601_and_3961_exit_75_and_the_rerun_goes_on() {
    let mut s = Scenario::new(10, FULL);
    s.db.inject_server_error(FaultOn::Snapshot, 3, 1, 3961).unwrap();
    let out = cli(&s, "stream");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(75), "{j}");
    assert!(j["error"].as_str().unwrap().contains("3961"), "{j}");
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));

    s.changes(5);
    common::settle(&s.db);
    s.db.inject_server_error(FaultOn::Changes, 2, 1, 601).unwrap();
    let out = cli(&s, "stream");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(75), "{j}");
    assert!(j["error"].as_str().unwrap().contains("601"), "{j}");
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    let out = cli(&s, "apply");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(assert_silver_is_the_table(&s, "after the retried reads"));
}

const CHUNKED: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 10\nparallelism = 2\n\
                       target_wave_seconds = 0\n[reconcile]\nbuckets = 8\nsample_fraction = 1.0\n[stream]\nmax_batch_rows = 1000\n";

/// A chunk read that fails part-way with a transient server error (1222, a
/// lock timeout behind a writer) is read again within the same `backfill`
/// call: exit 0, every chunk once, silver equal to the table. (Without the
/// chunk retry the call exits 75.)
#[test]
fn a_chunk_read_that_fails_transiently_is_read_again_in_the_same_call() {
    let s = Scenario::new(60, CHUNKED);
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    s.db.inject_server_error(FaultOn::Snapshot, 3, 2, 1222).unwrap();
    let out = cli(&s, "backfill");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(0), "{j}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(j["done"], true, "{j}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("reading it again"), "the retry is logged");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let snapshot_rows = rt.block_on(bronze_i64(&s, "SELECT COUNT(*) FROM t WHERE _operation = 0"));
    assert_eq!(snapshot_rows, 60, "each row read once, though two reads failed part-way");
    let out = cli(&s, "apply");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    rt.block_on(assert_silver_is_the_table(&s, "after the chunk reads read again"));
}
