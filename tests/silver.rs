//! Silver (`apply`) and `reconcile` end to end on the simulator: rebuilds
//! from snapshots, changes, chunked waves with their range deletes, a key
//! update recorded as 3/4, a crash between apply's two commits, stream lag
//! reported IN_FLIGHT beside a real difference, and golden transition logs.

mod common;

use std::collections::BTreeSet;

use common::Scenario;
use deltalake::arrow::array::{Array, Int32Array};
use mssql_cdc::delta::{self, bronze, golden, silver, Txn};
use mssql_cdc::engine::apply::{self, ApplyResult};
use mssql_cdc::engine::chunked::{self, BackfillArgs};
use mssql_cdc::engine::reconcile::{self, ReconcileResult};
use mssql_cdc::error::StepResult;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::source::{ChangeBatchBuilder, ChangeRow, ServerZone};
use mssql_cdc::sim::TableSpec;
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

const FULL: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\n[reconcile]\nbuckets = 8\nsample_fraction = 0.5\n";
const CHUNKED: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n";

async fn apply(s: &Scenario) -> StepResult<ApplyResult> {
    let mut ctx = s.context().await?;
    apply::run(&mut ctx).await
}

async fn reconcile(s: &Scenario) -> StepResult<ReconcileResult> {
    let mut ctx = s.context().await?;
    reconcile::run(&mut ctx).await
}

async fn one_wave(s: &Scenario) -> chunked::BackfillResult {
    let mut ctx = s.context().await.unwrap();
    chunked::backfill(&mut ctx, &BackfillArgs { max_waves: Some(1), ..Default::default() }).await.unwrap()
}

fn silver_path(s: &Scenario) -> String {
    s.path().join("silver").to_string_lossy().into_owned()
}

async fn silver_ids(s: &Scenario) -> BTreeSet<i64> {
    let t = delta::open_existing(&silver_path(s), &Default::default()).await.unwrap().unwrap();
    let mut out = BTreeSet::new();
    for b in delta::query(&t, "SELECT id FROM t").await.unwrap() {
        let a = b.column(0).as_any().downcast_ref::<Int32Array>().unwrap();
        for i in 0..a.len() {
            assert!(out.insert(a.value(i) as i64), "silver holds key {} twice", a.value(i));
        }
    }
    out
}

async fn source_ids(s: &Scenario) -> BTreeSet<i64> {
    s.db.keys(&s.table).unwrap().iter().map(|k| k[0].as_i64().unwrap()).collect()
}

async fn golden_log(s: &Scenario) -> String {
    let silver_loc = silver_path(s);
    let mut lines = Vec::new();
    for (loc, label) in [
        (silver_loc.clone(), "silver"),
        (silver::control_location_for(&silver_loc), "control"),
        (silver::reconcile_location_for(&silver_loc), "reconcile"),
    ] {
        if let Some(t) = delta::open_existing(&loc, &Default::default()).await.unwrap() {
            lines.extend(golden::render(&t, label).await.unwrap());
        }
    }
    lines.join("\n")
}

fn assert_clean(r: &ReconcileResult) {
    assert!(r.clean && r.differences == 0, "reconcile found differences: {r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_bootstrap_then_changes_apply_and_reconcile_clean() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(60, FULL);
    s.stream().await.unwrap();
    s.changes(15);
    s.stream_until_caught_up().await;
    let r = apply(&s).await.unwrap();
    assert_eq!((r.seq, r.action.as_str(), r.snapshot_state), (Some(0), "rebuild", "complete"), "{r:?}");
    assert!(r.finalized_until.is_some() && r.finalized_until == r.applied_lsn, "{r:?}");
    assert_eq!(silver_ids(&s).await, source_ids(&s).await);
    assert_clean(&reconcile(&s).await.unwrap());
    s.changes(20);
    s.stream_until_caught_up().await;
    let r = apply(&s).await.unwrap();
    assert_eq!(r.action, "changes", "{r:?}");
    assert!(r.rows_upserted > 0, "{r:?}");
    assert_eq!(silver_ids(&s).await, source_ids(&s).await);
    let rc = reconcile(&s).await.unwrap();
    assert_clean(&rc);
    assert_eq!(rc.tier1, "buckets");
    assert!(rc.buckets_compared >= 1, "{rc:?}");
    assert_eq!(rc.run, 1);
    // Nothing new: no commit at all.
    let r = apply(&s).await.unwrap();
    assert_eq!((r.action.as_str(), r.seq), ("nothing", None), "{r:?}");
    let log = golden_log(&s).await;
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_silver_full_then_changes", log));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_merge_and_the_control_row_is_harmless() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(30, FULL);
    s.stream().await.unwrap();
    apply(&s).await.unwrap();
    s.changes(10);
    s.stream_until_caught_up().await;
    fail::cfg("apply.after_merge", "return").unwrap();
    let e = apply(&s).await.unwrap_err();
    assert!(e.to_string().contains("apply.after_merge"), "{e}");
    fail::remove("apply.after_merge");
    // The rerun finds the MERGE's txn, writes only its control row, and has nothing more to do.
    let r = apply(&s).await.unwrap();
    assert!(r.repaired, "{r:?}");
    assert_eq!(r.action, "nothing", "{r:?}");
    assert_eq!(silver_ids(&s).await, source_ids(&s).await);
    assert_clean(&reconcile(&s).await.unwrap());
    // A crash after the control row: the rerun has nothing to do either.
    s.changes(5);
    s.stream_until_caught_up().await;
    fail::cfg("apply.after_control", "return").unwrap();
    apply(&s).await.unwrap_err();
    fail::remove("apply.after_control");
    let r = apply(&s).await.unwrap();
    assert!(!r.repaired && r.action == "nothing", "{r:?}");
    assert_clean(&reconcile(&s).await.unwrap());
    let log = golden_log(&s).await;
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_silver_crash_between_merge_and_control", log));
}

/// Appends change rows to bronze as if the stream had read them (for shapes the simulator does not record).
async fn inject(s: &Scenario, rows: Vec<ChangeRow>) {
    let ctx = s.context().await.unwrap();
    let mut b = ChangeBatchBuilder::new(&ctx.instance.columns);
    for r in &rows {
        b.push(r).unwrap();
    }
    let schema = ctx.bronze_schema().unwrap();
    let batch = bronze::from_changes(&b.finish(), &schema, &ServerZone::utc(), 999, &ctx.instance.name).unwrap();
    let mut t = ctx.bronze;
    delta::append_batches(&mut t, vec![batch], schema, &Txn::new("test#inject", 0), serde_json::json!({"test": "inject"})).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_of_a_key_recorded_as_3_and_4_moves_the_row() {
    let _fp = fail::FailScenario::setup();
    let s = Scenario::new(20, FULL);
    s.stream().await.unwrap();
    apply(&s).await.unwrap();
    // A commit the stream reads, so its position passes the injected rows' LSN.
    let table = s.table.clone();
    let l = s.db.transaction(|tx| tx.insert(&table, common::item_row(100, 0))).unwrap();
    common::settle(&s.db);
    s.stream_until_caught_up().await;
    let seq = Lsn(l.0);
    let row = |id: i64, v: i64, op: i32| ChangeRow { start_lsn: l, seqval: seq, operation: op, command_id: Some(1), tran_end_time: None, values: common::item_row(id, v) };
    // Key 5 became key 500 (3 of the old key, 4 of the new one, one commit);
    // key 6 was updated in place (its 4 outranks its 3).
    inject(&s, vec![row(5, 0, 3), row(500, 9, 4), row(6, 0, 3), row(6, 9, 4)]).await;
    let r = apply(&s).await.unwrap();
    assert_eq!(r.action, "changes", "{r:?}");
    let ids = silver_ids(&s).await;
    assert!(!ids.contains(&5), "the old key leaves silver: {ids:?}");
    assert!(ids.contains(&500) && ids.contains(&6) && ids.contains(&100), "{ids:?}");
    let t = delta::open_existing(&silver_path(&s), &Default::default()).await.unwrap().unwrap();
    let b = delta::query(&t, "SELECT qty FROM t WHERE id = 6").await.unwrap();
    assert_eq!(b[0].column(0).as_any().downcast_ref::<Int32Array>().unwrap().value(0), 69, "key 6 holds its after-image");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_lag_is_in_flight_and_a_real_difference_beside_it_is_not() {
    let _fp = fail::FailScenario::setup();
    let s = Scenario::new(40, FULL);
    s.stream().await.unwrap();
    apply(&s).await.unwrap();
    assert_clean(&reconcile(&s).await.unwrap());
    // Lag only the change table holds: an insert, an update, a delete after bronze's position.
    let table = s.table.clone();
    s.db.transaction(|tx| {
        tx.insert(&table, common::item_row(200, 0))?;
        tx.update(&table, &vec![SqlValue::Int(3)], common::item_row(3, 77))?;
        tx.delete(&table, &vec![SqlValue::Int(4)])
    })
    .unwrap();
    common::settle(&s.db);
    let r = reconcile(&s).await.unwrap();
    assert!(r.clean, "stream lag is not a failure: {r:#?}");
    assert_eq!(r.counts["IN_FLIGHT"], 3, "{r:#?}");
    // Bronze holds part of the lag now (streamed, not applied), and a real difference is made in silver.
    s.stream_until_caught_up().await;
    let t = delta::open_existing(&silver_path(&s), &Default::default()).await.unwrap().unwrap();
    let (_t, _m) = t.update().with_predicate("id = 10").with_update("qty", "-1").await.unwrap();
    let r = reconcile(&s).await.unwrap();
    assert!(!r.clean, "{r:#?}");
    assert_eq!((r.counts["RECORD_DIFF"], r.counts["IN_FLIGHT"]), (1, 3), "{r:#?}");
    assert!(r.samples.iter().any(|d| d["class"] == "RECORD_DIFF" && d["key"]["id"] == 10), "{:?}", r.samples);
    // Once applied, the lag is gone and the real difference stays until silver is rebuilt.
    apply(&s).await.unwrap();
    let r = reconcile(&s).await.unwrap();
    assert_eq!((r.counts["RECORD_DIFF"], r.counts["IN_FLIGHT"], r.differences), (1, 0, 1), "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_bootstrap_waves_are_applied_as_they_arrive() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(45, CHUNKED);
    s.stream().await.unwrap(); // opens at S
    s.changes(8);
    s.stream_until_caught_up().await;
    one_wave(&s).await;
    let r = apply(&s).await.unwrap();
    assert_eq!((r.action.as_str(), r.snapshot_state), ("waves", "open"), "{r:?}");
    assert_eq!(r.finalized_until, None, "the verdict is held while the snapshot is open");
    assert!(r.range_deletes, "one integer key, the open's own");
    // The first wave's keys are in silver; later chunks' keys are not (unless a change brought them).
    let ids = silver_ids(&s).await;
    assert!(ids.contains(&1) && !ids.contains(&44), "{ids:?}");
    loop {
        s.changes(3);
        s.stream_until_caught_up().await;
        let b = one_wave(&s).await;
        apply(&s).await.unwrap();
        if b.done {
            break;
        }
    }
    s.stream_until_caught_up().await;
    let r = apply(&s).await.unwrap();
    assert_eq!(r.snapshot_state, "complete", "{r:?}");
    assert_eq!(silver_ids(&s).await, source_ids(&s).await);
    let rc = reconcile(&s).await.unwrap();
    assert_clean(&rc);
    assert!(rc.chunk_snapshot.is_some() && rc.chunks_checked >= 5, "{rc:?}");
    // A chunk's bounds changed in the plans table after the fact fail its tiling.
    let plans_loc = delta::plans::location_for(&s.path().join("bronze").to_string_lossy());
    let t = delta::open_existing(&plans_loc, &Default::default()).await.unwrap().unwrap();
    let rows = delta::plans::from_batches(&delta::query(&t, "SELECT * FROM t WHERE event = 'snapshot_chunk' AND chunk = 1").await.unwrap()).unwrap();
    let mut detail = rows[0].detail.clone();
    detail["lo"] = serde_json::json!([{"t": "int", "v": 3}]);
    let literal = format!("'{}'", detail.to_string().replace('\'', "''"));
    t.update().with_predicate("event = 'snapshot_chunk' AND chunk = 1").with_update("detail", literal.as_str()).await.unwrap();
    let rc = reconcile(&s).await.unwrap();
    assert!(!rc.clean && rc.counts["CHUNK_TILING"] >= 1, "{rc:#?}");
    assert!(rc.samples.iter().any(|d| d["class"] == "CHUNK_TILING" && d["chunk"] == 1), "{:?}", rc.samples);
    // A chunk the facts record whose plans row is gone: reconcile names the
    // plans table and stops (28.111), rather than checking the others only.
    let t = delta::open_existing(&plans_loc, &Default::default()).await.unwrap().unwrap();
    t.delete().with_predicate("event = 'snapshot_chunk' AND chunk = 2").await.unwrap();
    let e = reconcile(&s).await.unwrap_err();
    assert_eq!(e.exit_code(), 3, "{e}");
    assert!(e.to_string().contains("plans table") && e.to_string().contains("chunk 2"), "{e}");
    // The whole plans table gone: the same.
    std::fs::remove_dir_all(&plans_loc).unwrap();
    let e = reconcile(&s).await.unwrap_err();
    assert_eq!(e.exit_code(), 3, "{e}");
    assert!(e.to_string().contains("no such table"), "{e}");
}

/// A silver built before a loss, then a chunked re-snapshot (generation 1)
/// whose gap deleted keys no delete row will ever reach bronze for.
async fn resnapshot_after_a_gap(keys_toml: &str) -> (Scenario, BTreeSet<i64>) {
    let mut s = Scenario::new(50, &format!("silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n{keys_toml}\n[stream]\nmax_batch_rows = 1000\n"));
    s.stream().await.unwrap();
    apply(&s).await.unwrap();
    // The gap: deletes the stream never reads.
    let gone: BTreeSet<i64> = [3, 8, 25, 41, 47].into();
    let table = s.table.clone();
    s.db.transaction(|tx| {
        for id in &gone {
            tx.delete(&table, &vec![SqlValue::Int(*id)])?;
        }
        Ok(())
    })
    .unwrap();
    common::settle(&s.db);
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.write_workflow(&format!("silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n{keys_toml}\n[stream]\nmax_batch_rows = 1000\n"));
    let mut ctx = s.context().await.unwrap();
    let o = chunked::ensure_open(&mut ctx, "resnapshot", 1).await.unwrap();
    assert!(o.opened_now);
    (s, gone)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_resnapshot_removes_the_gaps_keys_wave_by_wave() {
    let _fp = fail::FailScenario::setup();
    let (s, gone) = resnapshot_after_a_gap("").await;
    let before = silver_ids(&s).await;
    assert!(gone.iter().all(|k| before.contains(k)), "silver was built before the gap: {before:?}");
    let mut waves = 0;
    loop {
        let b = one_wave(&s).await;
        s.stream_until_caught_up().await;
        let r = apply(&s).await.unwrap();
        waves += 1;
        if b.done {
            assert_eq!(r.snapshot_state, "complete", "{r:?}");
            break;
        }
        assert!(r.range_deletes && r.snapshot_state == "open", "{r:?}");
        if waves == 1 {
            // The first wave covers the lowest keys: the gap's keys there are gone, the others still wait.
            let ids = silver_ids(&s).await;
            assert!(!ids.contains(&3) && !ids.contains(&8), "{ids:?}");
            assert!(ids.contains(&47), "{ids:?}");
        }
    }
    assert!(waves > 1);
    assert_eq!(silver_ids(&s).await, source_ids(&s).await);
    assert_clean(&reconcile(&s).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_range_deletes_on_a_composite_key_the_rebuild_removes_them() {
    let _fp = fail::FailScenario::setup();
    let (s, gone) = resnapshot_after_a_gap("keys = [\"id\", \"qty\"]").await;
    let b = one_wave(&s).await;
    assert!(!b.done);
    let r = apply(&s).await.unwrap();
    assert!(!r.range_deletes && r.action == "waves", "{r:?}");
    let ids = silver_ids(&s).await;
    assert!(gone.iter().all(|k| ids.contains(k)), "stale keys wait for the completion: {ids:?}");
    loop {
        if one_wave(&s).await.done {
            break;
        }
    }
    s.stream_until_caught_up().await;
    let r = apply(&s).await.unwrap();
    assert_eq!((r.action.as_str(), r.snapshot_state), ("rebuild", "complete"), "{r:?}");
    assert_eq!(silver_ids(&s).await, source_ids(&s).await, "the rebuild deletes by absence");
    let rc = reconcile(&s).await.unwrap();
    assert_clean(&rc);
    // Silver is keyed on the unique index (`id`), whatever snapshot.keys cut
    // the chunks on, so reconcile buckets that one integer key.
    assert_eq!(rc.tier1, "buckets");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_without_a_silver_target_is_refused_before_anything_is_written() {
    let _fp = fail::FailScenario::setup();
    let s = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    s.stream().await.unwrap();
    let e = apply(&s).await.unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("target.silver"), "{e}");
    let e = reconcile(&s).await.unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(!s.path().join("silver").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_drill_at_every_silver_failpoint() {
    let _fp = fail::FailScenario::setup();
    for fp in mssql_cdc::engine::FAILPOINTS.iter().filter(|f| f.starts_with("apply.") || f.starts_with("reconcile.")) {
        let mut s = Scenario::new(30, FULL);
        s.stream().await.unwrap();
        apply(&s).await.unwrap();
        s.changes(10);
        s.stream_until_caught_up().await;
        fail::cfg(*fp, "1*return").unwrap();
        let e = if fp.starts_with("apply.") {
            apply(&s).await.unwrap_err()
        } else {
            apply(&s).await.unwrap();
            reconcile(&s).await.unwrap_err()
        };
        assert!(e.to_string().contains(*fp), "{fp}: {e}");
        fail::remove(*fp);
        s.changes(6);
        s.stream_until_caught_up().await;
        for _ in 0..3 {
            if apply(&s).await.unwrap().action == "nothing" {
                break;
            }
        }
        assert_eq!(silver_ids(&s).await, source_ids(&s).await, "{fp}");
        let r = reconcile(&s).await.unwrap();
        assert_clean(&r);
        let ctrl = delta::open_existing(&silver::control_location_for(&silver_path(&s)), &Default::default()).await.unwrap().unwrap();
        let b = delta::query(&ctrl, "SELECT COUNT(*) - COUNT(DISTINCT seq) FROM t").await.unwrap();
        let dup = b[0].column(0).as_any().downcast_ref::<deltalake::arrow::array::Int64Array>().unwrap().value(0);
        assert_eq!(dup, 0, "{fp}: a control row twice");
    }
}

/// The CLI end to end: a process killed between apply's two commits, the
/// rerun, reconcile's exit codes (0 clean, 3 with a real difference).
#[test]
fn cli_apply_killed_between_its_commits_then_reconcile_exit_codes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(30, FULL);
    let bin = env!("CARGO_BIN_EXE_mssql-cdc");
    let wf_path = s.wf_path.clone();
    let run = |step: &str, fp: Option<&str>| {
        let mut c = std::process::Command::new(bin);
        c.arg("--workflow").arg(&wf_path).arg(step).env("MSSQL_CDC_LOG", "warn");
        if let Some(fp) = fp {
            c.env("MSSQL_CDC_FAILPOINTS", format!("{fp}=return(abort)"));
        }
        let out = c.output().unwrap();
        let last: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("null")).unwrap_or_default();
        (out.status.code(), last)
    };
    assert_eq!(run("stream", None).0, Some(0));
    let (code, _) = run("apply", Some("apply.after_merge"));
    assert_ne!(code, Some(0), "the process should have been killed");
    let (code, r) = run("apply", None);
    assert_eq!(code, Some(0), "{r}");
    assert_eq!(r["repaired"], true, "{r}");
    s.changes(8);
    common::settle(&s.db);
    assert_eq!(run("stream", None).0, Some(0));
    let (code, r) = run("apply", None);
    assert_eq!((code, r["action"].as_str()), (Some(0), Some("changes")), "{r}");
    let (code, r) = run("reconcile", None);
    assert_eq!(code, Some(0), "{r}");
    assert_eq!(r["clean"], true, "{r}");
    rt.block_on(async {
        let t = delta::open_existing(&silver_path(&s), &Default::default()).await.unwrap().unwrap();
        let ids = silver_ids(&s).await;
        let victim = *ids.iter().next().unwrap();
        t.delete().with_predicate(format!("id = {victim}")).await.unwrap();
    });
    let (code, r) = run("reconcile", None);
    assert_eq!(code, Some(3), "a real difference needs a person: {r}");
    assert_eq!(r["counts"]["MISSING_TARGET"], 1, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_on_a_null_chunk_key_is_in_flight_and_its_difference_is_named_by_the_unique_index() {
    let _fp = fail::FailScenario::setup();
    // snapshot.keys may name a nullable column: `name` is NULL for id 7 only
    // here. It only cuts snapshot ranges; silver and reconcile name rows by
    // the unique index (`id`). Silver keyed on a nullable unique index is
    // tests/silver_keys.rs.
    // Every bucket compared row by row: with one integer key, tier 1 counts
    // and sums keys only, and a changed value is seen by tier 2's sample.
    let s = Scenario::new(6, "silver = \"silver\"\n[snapshot]\nbootstrap = true\nkeys = [\"name\"]\n[reconcile]\nsample_fraction = 1.0\n");
    s.stream().await.unwrap();
    apply(&s).await.unwrap();
    assert_clean(&reconcile(&s).await.unwrap());
    let table = s.table.clone();
    s.db.transaction(|tx| tx.insert(&table, common::item_row(7, 0))).unwrap();
    common::settle(&s.db);
    s.stream_until_caught_up().await;
    let r = reconcile(&s).await.unwrap();
    assert!(r.clean && r.counts["IN_FLIGHT"] == 1, "bronze holds the NULL key's change: {r:#?}");
    assert_eq!(r.samples[0]["key"], serde_json::json!({"id": 7}), "{:?}", r.samples);
    apply(&s).await.unwrap();
    assert_clean(&reconcile(&s).await.unwrap());
    let t = delta::open_existing(&silver_path(&s), &Default::default()).await.unwrap().unwrap();
    t.update().with_predicate("name IS NULL").with_update("qty", "-1").await.unwrap();
    let r = reconcile(&s).await.unwrap();
    assert_eq!((r.counts["RECORD_DIFF"], r.clean), (1, false), "{r:#?}");
    assert_eq!(r.samples[0]["key"], serde_json::json!({"id": 7}), "{:?}", r.samples);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_a_unique_index_is_a_heap_refused_without_before_images() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(0, "");
    let heap = TableName::new("dbo", "heap");
    let spec = TableSpec { collations: Default::default(),
        name: heap.clone(),
        columns: vec![ColumnDesc::new("id", SqlType::Int, false), ColumnDesc::new("payload", SqlType::Int, true)],
        primary_key: vec![],
        unique_index: vec![],
    };
    s.db.create_table(&spec).unwrap();
    s.db.load_rows(&heap, (1..=30).map(|i| vec![SqlValue::Int(i), SqlValue::Int(i * 2)])).unwrap();
    s.db.enable_cdc(&heap, None, None).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.table = heap;
    // Keys or not, silver keeps a heap as a multiset, which needs the updates' before-images.
    let wf = |keys: &str| {
        format!(
            "app_id = \"items\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"heap\"\n[target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
             [snapshot]\nbootstrap = true\n{keys}\n"
        )
    };
    // Read without before-images by hand (the default, `auto`, reads them for a heap).
    std::fs::write(&s.wf_path, wf("[stream]\nrow_filter = \"all\"")).unwrap();
    s.stream().await.unwrap();
    let e = apply(&s).await.unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("stream.row_filter"), "{e}");
    assert!(!s.path().join("silver").exists(), "nothing written");
    std::fs::write(&s.wf_path, wf("keys = [\"id\"]\n[stream]\nrow_filter = \"all update old\"")).unwrap();
    let r = apply(&s).await.unwrap();
    assert_eq!((r.action.as_str(), r.rows_upserted), ("rebuild", 30), "{r:?}");
    assert_clean(&reconcile(&s).await.unwrap());
}

/// While a wave's chunk is read, a delete of one of its rows is streamed
/// and applied (silver never had the key: nothing to delete). Then the wave
/// commits with the row it read before the delete.
struct DeleteDuringTheRead {
    wf_path: std::path::PathBuf,
    db_path: std::path::PathBuf,
    done: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl common::Hooks for DeleteDuringTheRead {
    async fn snapshot_read(
        &self,
        inner: &mssql_cdc::source::SharedSource,
        read: &mssql_cdc::source::SnapshotRead,
    ) -> Result<mssql_cdc::source::BatchStream, mssql_cdc::source::SourceError> {
        use futures::StreamExt;
        let batches: Vec<_> = inner.snapshot_read(read).await?.collect().await;
        if read.range.contains(&[SqlValue::Int(5)]) && !self.done.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let db = mssql_cdc::sim::SimDb::open(&self.db_path).unwrap();
            let table = mssql_cdc::source::TableName::new("dbo", "items");
            db.transaction(|tx| tx.delete(&table, &vec![SqlValue::Int(5)])).unwrap();
            db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
            common::settle(&db);
            let wf = mssql_cdc::workflow::Workflow::load(&self.wf_path).unwrap();
            for _ in 0..100 {
                let mut ctx = mssql_cdc::engine::Context::open(wf.clone()).await.unwrap();
                if mssql_cdc::engine::coarse::stream(&mut ctx).await.unwrap().caught_up {
                    break;
                }
            }
            let mut ctx = mssql_cdc::engine::Context::open(wf).await.unwrap();
            let r = apply::run(&mut ctx).await.unwrap();
            assert_eq!(r.action, "changes", "the delete is applied before the wave is: {r:?}");
        }
        Ok(futures::stream::iter(batches).boxed())
    }
}

/// adr-0028: each chunk row is merged with the changes after S *of its own
/// key* (28.26). A wave's MERGE source holds its chunk rows, the changes
/// silver has not applied, and the applied changes after S of the chunk
/// rows' keys — not every change after S of every key, which grew with the
/// snapshot's age (on the old code this wave's source held the ten keys
/// changed in the last chunk's range too: 30 rows, not 20). And a delete
/// applied before its chunk's wave still outranks the row the chunk read
/// before it: without the chunk keys' applied changes in the source, key 5
/// would come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waves_merge_reads_its_own_keys_changes_not_every_change_since_s() {
    let _fp = fail::FailScenario::setup();
    let s = Scenario::new(60, CHUNKED);
    s.stream().await.unwrap(); // opens at S
    // Ten updates each of the last chunk's keys, streamed and applied
    // before any wave: changes after S that no early wave needs.
    let table = s.table.clone();
    for v in 1..=10 {
        s.db.transaction(|tx| {
            for id in 51..=60 {
                tx.update(&table, &vec![SqlValue::Int(id)], common::item_row(id, v))?;
            }
            Ok(())
        })
        .unwrap();
    }
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.stream_until_caught_up().await;
    let r = apply(&s).await.unwrap();
    assert_eq!(r.action, "changes", "{r:?}");
    // Wave 0: chunks 0 and 1 (keys 1..=20); key 5 is deleted, streamed and
    // applied while the wave is read.
    let hooks = DeleteDuringTheRead { wf_path: s.wf_path.clone(), db_path: s.path().join("source.sqlite"), done: Default::default() };
    let mut ctx = s.context().await.unwrap();
    ctx.source = std::sync::Arc::new(common::Wrapped::new(ctx.source.clone(), hooks));
    let b = chunked::backfill(&mut ctx, &BackfillArgs { max_waves: Some(1), ..Default::default() }).await.unwrap();
    assert_eq!(b.waves, 1, "{b:?}");
    let r = apply(&s).await.unwrap();
    assert_eq!(r.action, "waves", "{r:?}");
    // 20 keys, the chunk rows' own: key 5's latest row is its delete, which
    // outranks the row its chunk read before it. (Seen failing: 30 with
    // every change after S in the source; key 5 back in silver without the
    // chunk keys' applied changes.)
    assert_eq!(r.source_rows, Some(20), "the wave's source holds its own keys only: {r:?}");
    let ids = silver_ids(&s).await;
    assert!(!ids.contains(&5), "key 5, deleted after its chunk was read, came back with the wave: {ids:?}");
    assert!((1..=20).filter(|i| *i != 5).all(|i| ids.contains(&i)), "{ids:?}");
    // To the end: silver is the table.
    loop {
        let b = one_wave(&s).await;
        s.stream_until_caught_up().await;
        apply(&s).await.unwrap();
        if b.done {
            break;
        }
    }
    s.stream_until_caught_up().await;
    apply(&s).await.unwrap();
    assert_eq!(silver_ids(&s).await, source_ids(&s).await);
    assert_clean(&reconcile(&s).await.unwrap());
}
