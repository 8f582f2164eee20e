//! Chunked snapshots (adr-0028): the open, the fixed plan, waves beside the
//! stream, the plans table, the mode lock, repairs after crashes, and tables
//! chunked on a column that is not unique.

mod common;

use common::Scenario;
use deltalake::arrow::array::{Array, Int64Array, StringArray};
use mssql_cdc::delta::{self, plans};
use mssql_cdc::engine::chunked::{self, BackfillArgs, BackfillResult};
use mssql_cdc::error::{StepError, StepResult};
use mssql_cdc::sim::TableSpec;
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

const CHUNKED: &str =
    "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 3\nchunk_rows = 10\ntarget_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n";

async fn backfill(s: &Scenario, args: BackfillArgs) -> StepResult<BackfillResult> {
    let mut ctx = s.context().await?;
    chunked::backfill(&mut ctx, &args).await
}

fn one_wave() -> BackfillArgs {
    BackfillArgs { max_waves: Some(1), ..Default::default() }
}

async fn plans_log(s: &Scenario) -> Vec<String> {
    let ctx = s.context().await.unwrap();
    let t = delta::open_existing(&plans::location_for(&ctx.workflow.target.bronze), &Default::default()).await.unwrap();
    match t {
        Some(t) => delta::golden::render(&t, "plans").await.unwrap(),
        None => vec![],
    }
}

async fn plan_rows(s: &Scenario) -> Vec<plans::PlanRow> {
    let ctx = s.context().await.unwrap();
    let t = delta::open_existing(&plans::location_for(&ctx.workflow.target.bronze), &Default::default()).await.unwrap().unwrap();
    plans::from_batches(&delta::query(&t, "SELECT * FROM t").await.unwrap()).unwrap()
}

/// Every facts row of a chunked snapshot is free of key values.
async fn assert_facts_hold_no_key_values(s: &Scenario) {
    let ctx = s.context().await.unwrap();
    let rows = mssql_cdc::engine::state::facts_rows(&ctx.facts, "items").await.unwrap();
    for r in rows.iter().filter(|r| r.event.as_deref().is_some_and(|e| e.starts_with("snapshot_"))) {
        let d = r.detail.clone().unwrap_or_default();
        for k in ["lo", "hi", "min", "max", "chunks", "keys"] {
            assert!(d.get(k).is_none(), "facts row {:?} holds '{k}': {d}", r.event);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_bootstrap_beside_the_stream_with_changes_between_waves() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(95, CHUNKED);
    // The stream's first call opens the snapshot and starts at S, reading no rows.
    let r = s.stream().await.unwrap();
    let boot = r.bootstrap.clone().expect("the first call opens the snapshot");
    assert_eq!(boot["opened_now"], true, "{boot}");
    let s_lsn = r.position.unwrap();
    assert_eq!(boot["snapshot_lsn"], serde_json::json!(s_lsn));
    assert_eq!(s.count("bronze", "_operation = 0").await, 0, "the open reads nothing");
    let mut totals = Vec::new();
    let mut calls = 0;
    loop {
        s.changes(4);
        s.stream().await.unwrap();
        // A later call's chunk_rows is ignored: the plan is fixed by the first.
        let args = BackfillArgs { chunk_rows: if calls > 0 { Some(3) } else { None }, ..one_wave() };
        let b = backfill(&s, args).await.unwrap();
        assert_eq!(b.snapshot, Some(s_lsn));
        totals.push(b.chunks_total);
        calls += 1;
        if b.done {
            break;
        }
        assert!(calls < 50, "backfill never finished");
    }
    assert!(totals.windows(2).all(|w| w[0] == w[1]), "chunks_total changed between calls: {totals:?}");
    assert!(calls >= 3, "{calls} calls: the table should take several waves");
    s.changes(5);
    s.stream_until_caught_up().await;
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{cmp:?}");
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1);
    assert_eq!(s.count("facts", "event = 'snapshot_plan'").await, 1);
    assert_eq!(s.count("facts", "event = 'snapshot_chunk'").await, totals[0] as i64);
    assert_eq!(s.duplicate_change_rows().await, 0);
    // Each original row was read by exactly one chunk.
    let dup = {
        let ctx = s.context().await.unwrap();
        let b = delta::query(&ctx.bronze, "SELECT id, COUNT(*) AS n FROM t WHERE _operation = 0 GROUP BY id HAVING COUNT(*) > 1").await.unwrap();
        b.iter().map(|b| b.num_rows()).sum::<usize>()
    };
    assert_eq!(dup, 0, "a row read by two chunks");
    assert_facts_hold_no_key_values(&s).await;
    // Each chunk's facts row says how long its read took and how many bytes
    // it read: more bytes for a chunk of more rows, none for an empty one.
    {
        let ctx = s.context().await.unwrap();
        let facts = mssql_cdc::engine::state::facts_rows(&ctx.facts, "items").await.unwrap();
        let chunks: Vec<_> = facts.iter().filter(|r| r.event.as_deref() == Some("snapshot_chunk")).collect();
        for r in &chunks {
            let d = r.detail.clone().unwrap();
            let bytes = d["read_bytes"].as_i64().unwrap_or_else(|| panic!("chunk facts row without read_bytes: {d}"));
            assert!(r.duration_ms.is_some(), "chunk facts row without its read time: {d}");
            let rows = r.rows.unwrap();
            assert!(if rows > 0 { bytes >= rows * 8 } else { bytes == 0 }, "chunk of {rows} rows read {bytes} bytes: {d}");
        }
    }
    let prs = plan_rows(&s).await;
    assert_eq!(prs.iter().filter(|r| r.event == "snapshot_open").count(), 1);
    assert_eq!(prs.iter().filter(|r| r.event == "snapshot_plan").count(), 1);
    assert_eq!(prs.iter().filter(|r| r.event == "snapshot_chunk").count(), totals[0]);
    let plan = prs.iter().find(|r| r.event == "snapshot_plan").unwrap();
    assert_eq!(plan.detail["kind"], "integer");
    assert_eq!(plan.detail["chunk_rows"], 10);
    // Calls after completion are no-ops that say so.
    let b = backfill(&s, one_wave()).await.unwrap();
    assert!(b.done && b.waves == 0, "{b:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_chunked_bootstrap_of_three_waves() {
    let _fp = fail::FailScenario::setup();
    let wf = CHUNKED.replace("parallelism = 3", "parallelism = 1");
    let mut s = Scenario::new(30, &wf);
    s.stream().await.unwrap();
    for _ in 0..3 {
        s.changes(3);
        s.stream().await.unwrap();
        backfill(&s, one_wave()).await.unwrap();
    }
    let b = backfill(&s, one_wave()).await.unwrap();
    assert!(b.done, "{b:?}");
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    let mut log = s.golden().await;
    log.push('\n');
    log.push_str(&plans_log(&s).await.join("\n"));
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_chunked_three_waves", log));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_crash_after_a_waves_bronze_append_rebuilds_its_facts() {
    let _fp = fail::FailScenario::setup();
    let wf = CHUNKED.replace("parallelism = 3", "parallelism = 1");
    let mut s = Scenario::new(30, &wf);
    s.stream().await.unwrap();
    backfill(&s, one_wave()).await.unwrap();
    s.changes(3);
    s.stream().await.unwrap();
    fail::cfg("chunked.after_wave_bronze", "1*return").unwrap();
    let e = backfill(&s, one_wave()).await.unwrap_err();
    assert!(e.to_string().contains("chunked.after_wave_bronze"), "{e}");
    fail::remove("chunked.after_wave_bronze");
    let b = backfill(&s, one_wave()).await.unwrap();
    assert_eq!(b.repaired_wave, Some(1), "{b:?}");
    assert_eq!(b.chunks_done, 3, "the repaired wave counts, and one more wave was read: {b:?}");
    loop {
        if backfill(&s, one_wave()).await.unwrap().done {
            break;
        }
    }
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    let mut log = s.golden().await;
    log.push('\n');
    log.push_str(&plans_log(&s).await.join("\n"));
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_chunked_crash_after_wave_bronze", log));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wave_whose_commit_left_the_log_is_rebuilt_from_its_rows_in_bronze() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(60, &CHUNKED.replace("parallelism = 3", "parallelism = 2"));
    s.stream().await.unwrap();
    backfill(&s, one_wave()).await.unwrap();
    fail::cfg("chunked.after_wave_bronze", "1*return").unwrap();
    assert!(backfill(&s, one_wave()).await.is_err());
    fail::remove("chunked.after_wave_bronze");
    // Log cleanup: a later commit, a checkpoint at it, and the JSON commits
    // before it dropped (the wave's among them), as Delta's log cleanup does.
    s.changes(3);
    s.stream().await.unwrap();
    {
        let ctx = s.context().await.unwrap();
        deltalake::checkpoints::create_checkpoint(&ctx.bronze, None).await.unwrap();
        let v = ctx.bronze.version().unwrap();
        for i in 0..v {
            let f = std::path::Path::new(&ctx.workflow.target.bronze).join("_delta_log").join(format!("{i:020}.json"));
            std::fs::remove_file(&f).unwrap();
        }
    }
    let b = backfill(&s, one_wave()).await.unwrap();
    assert_eq!(b.repaired_wave, Some(1), "{b:?}");
    loop {
        s.changes(2);
        s.stream().await.unwrap();
        if backfill(&s, one_wave()).await.unwrap().done {
            break;
        }
    }
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    let ctx = s.context().await.unwrap();
    let rows = mssql_cdc::engine::state::facts_rows(&ctx.facts, "items").await.unwrap();
    let rebuilt: Vec<_> = rows
        .iter()
        .filter(|r| r.event.as_deref() == Some("snapshot_chunk") && r.detail.as_ref().unwrap()["wave"] == 1)
        .collect();
    assert_eq!(rebuilt.len(), 2, "both chunks of the wave rebuilt");
    assert!(rebuilt.iter().all(|r| r.duration_ms.is_none()), "a rebuilt chunk has no read time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_snapshot_mode_per_run() {
    let _fp = fail::FailScenario::setup();
    // A chunked snapshot being backfilled refuses a full one, saying how to finish it.
    let mut s = Scenario::new(40, CHUNKED);
    s.stream().await.unwrap();
    s.write_workflow(&CHUNKED.replace("mode = \"chunked\"", "mode = \"full\""));
    let mut ctx = s.context().await.unwrap();
    let e = mssql_cdc::engine::snapshot::ensure_bootstrap(&mut ctx).await.unwrap_err();
    assert!(matches!(e, StepError::Config(_)) && e.to_string().contains("backfill"), "{e}");
    // Finished by backfill, the mode may change (the bootstrap is done).
    s.write_workflow(CHUNKED);
    while !backfill(&s, BackfillArgs::default()).await.unwrap().done {}
    s.write_workflow(&CHUNKED.replace("mode = \"chunked\"", "mode = \"full\""));
    let mut ctx = s.context().await.unwrap();
    assert!(mssql_cdc::engine::snapshot::ensure_bootstrap(&mut ctx).await.unwrap().already_done);

    // A full snapshot a crash left open holds the mode until cleanup passes its S.
    let full = "[snapshot]\nbootstrap = true\nmode = \"full\"\n";
    let mut s = Scenario::new(40, full);
    fail::cfg("snapshot.after_open", "1*return").unwrap();
    assert!(s.stream().await.is_err());
    fail::remove("snapshot.after_open");
    s.write_workflow(CHUNKED);
    let e = s.stream().await.unwrap_err();
    assert!(matches!(e, StepError::Config(_)) && e.to_string().contains("snapshot.mode = \"full\""), "{e}");
    let e = backfill(&s, one_wave()).await.unwrap_err();
    assert!(matches!(e, StepError::Config(_)), "{e}");
    assert_eq!(s.count("facts", "event = 'snapshot_open'").await, 1, "the refusals wrote nothing");
    s.changes(5);
    s.db.advance_clock(std::time::Duration::from_secs(5)).unwrap();
    common::settle(&s.db);
    let max = s.db.max_lsn().unwrap().unwrap();
    s.db.cleanup_to_lsn(max).unwrap();
    let r = s.stream().await.unwrap();
    assert_eq!(r.bootstrap.as_ref().unwrap()["opened_now"], true, "cleanup passed the dead full open: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_pauses_while_headroom_is_below_the_minimum() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(30, CHUNKED);
    let opened = s.stream().await.unwrap().position.unwrap();
    // Cleanup up to S: the capture instance's min LSN gets a commit time, so
    // the stream's batches record a headroom (position minus that time).
    s.db.cleanup_to_lsn(opened).unwrap();
    // No batch yet: no headroom known, so it pauses.
    let b = backfill(&s, BackfillArgs { min_headroom_hours: Some(1.0), ..one_wave() }).await.unwrap();
    assert!(b.paused && !b.done && b.waves == 0, "{b:?}");
    assert!(b.reason.as_deref().unwrap().contains("min_headroom_hours"), "{b:?}");
    s.changes(3);
    common::settle(&s.db);
    s.stream().await.unwrap();
    // The stream's headroom is its distance to the cleanup watermark: seconds
    // on this fresh instance, so 1000 hours pauses and a few seconds do not.
    let b = backfill(&s, BackfillArgs { min_headroom_hours: Some(1000.0), ..one_wave() }).await.unwrap();
    assert!(b.paused, "{b:?}");
    let b = backfill(&s, BackfillArgs { min_headroom_hours: Some(0.0001), ..one_wave() }).await.unwrap();
    assert!(!b.paused && b.waves == 1, "{b:?}");
}

/// The pause reads the headroom live: once the stream stops, cleanup goes on
/// and its last batch's recorded headroom no longer says how close cleanup
/// is. Here cleanup reaches the stopped stream's position: the recorded
/// headroom is still above the minimum, the live one is zero, and backfill
/// pauses until the stream has read on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_pauses_on_the_live_headroom_not_the_last_batchs_recorded_one() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(100, CHUNKED);
    let opened = s.stream().await.unwrap().position.unwrap();
    s.db.cleanup_to_lsn(opened).unwrap();
    s.changes(3);
    common::settle(&s.db);
    let stopped_at = s.stream().await.unwrap().position.unwrap();
    let min_h = 0.0001;
    let b = backfill(&s, BackfillArgs { min_headroom_hours: Some(min_h), ..one_wave() }).await.unwrap();
    assert!(!b.paused && b.waves == 1, "the stream has just read: {b:?}");
    let ctx = s.context().await.unwrap();
    let rows = mssql_cdc::engine::state::facts_rows(&ctx.facts, "items").await.unwrap();
    let recorded = rows.iter().filter(|r| r.batch_id.is_some() && r.event.is_none()).max_by_key(|r| r.batch_id).unwrap().headroom_seconds.unwrap();
    assert!(recorded >= min_h * 3600.0, "the last batch recorded {recorded} s");
    drop(ctx);

    // The stream stops; the writer goes on and cleanup reaches its position.
    s.changes(3);
    common::settle(&s.db);
    s.db.cleanup_to_lsn(stopped_at).unwrap();
    let b = backfill(&s, BackfillArgs { min_headroom_hours: Some(min_h), ..one_wave() }).await.unwrap();
    assert!(b.paused && b.waves == 0, "cleanup is at the stream's position: {b:?}");
    assert!(b.reason.as_deref().unwrap().contains("headroom is 0.00 h"), "{b:?}");
    let mut ctx = s.context().await.unwrap();
    let status = mssql_cdc::engine::status::run(&mut ctx).await.unwrap();
    drop(ctx);
    assert_eq!(status["headroom_seconds"], serde_json::json!(0.0), "{status}");

    // The stream reads on: its position moves past the watermark and the
    // waves go on.
    common::settle(&s.db);
    s.stream().await.unwrap();
    let b = backfill(&s, BackfillArgs { min_headroom_hours: Some(min_h), ..one_wave() }).await.unwrap();
    assert!(!b.paused && b.waves == 1, "the stream has caught up: {b:?}");
}

/// A heap (no primary key, no unique index): `id` is unique in practice but
/// not declared; `name` repeats, in mixed case, NULL now and then.
fn heap_spec(table: &TableName) -> TableSpec {
    TableSpec { collations: Default::default(),
        name: table.clone(),
        columns: vec![
            ColumnDesc::new("id", SqlType::Int, false),
            ColumnDesc::new("name", SqlType::VarChar { len: Some(10) }, true),
            ColumnDesc::new("payload", SqlType::Int, true),
            ColumnDesc::new("flag", SqlType::Bit, true),
            ColumnDesc::new("notes", SqlType::Text, true),
            ColumnDesc::new("at", SqlType::Time { scale: 7 }, true),
        ],
        primary_key: vec![],
        unique_index: vec![],
    }
}

fn heap_row(id: i64, payload: i64) -> Vec<SqlValue> {
    // 17 values, each in upper and lower case and now and then with a
    // trailing space: equal under the case-insensitive collation.
    let name = if id % 9 == 0 {
        SqlValue::Null
    } else {
        let base = format!("v{:02}", (id * 7) % 17);
        let cased = if id % 2 == 0 { base.to_uppercase() } else { base };
        SqlValue::Str(if id % 5 == 0 { format!("{cased} ") } else { cased })
    };
    vec![SqlValue::Int(id), name, SqlValue::Int(payload), SqlValue::Bool(id % 2 == 0), SqlValue::Str("n".into()), SqlValue::Null]
}

fn heap_scenario(keys: &str) -> Scenario {
    let mut s = Scenario::new(0, "");
    let heap = TableName::new("dbo", "heap");
    s.db.create_table(&heap_spec(&heap)).unwrap();
    s.db.load_rows(&heap, (1..=120).map(|i| heap_row(i, 0))).unwrap();
    s.db.enable_cdc(&heap, None, None).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.table = heap;
    let text = format!(
        "app_id = \"items\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"heap\"\n[target]\nbronze = \"bronze\"\nfacts = \"facts\"\n\
         [snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 8\ntarget_wave_seconds = 0\n{keys}\n"
    );
    std::fs::write(&s.wf_path, text).unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heap_chunked_on_a_repeated_case_mixed_column_reads_every_row_once() {
    let _fp = fail::FailScenario::setup();
    let s = heap_scenario("keys = [\"name\"]");
    let heap = s.table.clone();
    s.stream().await.unwrap();
    let mut next_id = 1000;
    let mut deleted = Vec::new();
    loop {
        // Between waves: inserts, updates of a column the chunks are not cut on, deletes.
        s.db.transaction(|tx| {
            tx.insert(&heap, heap_row(next_id, 1))?;
            tx.update(&heap, &vec![SqlValue::Int(next_id - 990)], heap_row(next_id - 990, 5))?;
            Ok(())
        })
        .unwrap();
        let victim = next_id - 950;
        if s.db.transaction(|tx| tx.delete(&heap, &vec![SqlValue::Int(victim)])).is_ok() {
            deleted.push(victim);
        }
        next_id += 1;
        s.stream().await.unwrap();
        let b = backfill(&s, one_wave()).await.unwrap();
        if b.done {
            assert!(b.chunks_total > 3, "a heap is read in more than one chunk: {b:?}");
            break;
        }
    }
    // The last inserts were inside the capture lag while the waves ran.
    s.stream_until_caught_up().await;
    let ctx = s.context().await.unwrap();
    let b = delta::query(&ctx.bronze, "SELECT id, name, _chunk FROM t WHERE _operation = 0").await.unwrap();
    let mut seen: std::collections::HashMap<i64, usize> = Default::default();
    let mut chunk_of_value: std::collections::HashMap<String, std::collections::BTreeSet<i64>> = Default::default();
    for batch in &b {
        let ids = batch.column(0).as_any().downcast_ref::<deltalake::arrow::array::Int32Array>().unwrap();
        let names = batch.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        let chunks = batch.column(2).as_any().downcast_ref::<Int64Array>().unwrap();
        for i in 0..batch.num_rows() {
            *seen.entry(ids.value(i) as i64).or_default() += 1;
            let v = if names.is_null(i) { "<null>".to_string() } else { names.value(i).trim_end().to_lowercase() };
            chunk_of_value.entry(v).or_default().insert(chunks.value(i));
        }
    }
    for id in 1..=120i64 {
        let n = seen.get(&id).copied().unwrap_or(0);
        if deleted.contains(&id) {
            assert!(n <= 1, "deleted row {id} read {n} times");
        } else {
            assert_eq!(n, 1, "row {id}, there all along, read {n} times");
        }
    }
    assert!(seen.values().all(|n| *n == 1), "no row twice");
    for (v, chunks) in &chunk_of_value {
        assert_eq!(chunks.len(), 1, "value {v} split across chunks {chunks:?}");
    }
    assert_eq!(chunk_of_value["<null>"].iter().next(), Some(&0), "NULLs in the first chunk");
    // The stream holds every insert made during the backfill.
    let inserts = delta::query(&ctx.bronze, "SELECT COUNT(*) FROM t WHERE _operation = 2").await.unwrap();
    assert_eq!(inserts[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0), next_id - 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_chunks_cannot_be_cut_on_are_refused_before_anything_is_recorded() {
    let _fp = fail::FailScenario::setup();
    for (keys, says) in [
        ("", "no unique index"),
        ("keys = [\"flag\"]", "bit"),
        ("keys = [\"notes\"]", "text"),
        ("keys = [\"at\", \"id\"]", "before the last column"),
        ("keys = [\"nope\"]", "does not capture"),
    ] {
        let s = heap_scenario(keys);
        let e = s.stream().await.unwrap_err();
        assert!(matches!(e, StepError::Config(_)) && e.to_string().contains(says), "{keys}: {e}");
        let ctx = delta::open_existing(&s.path().join("facts").to_string_lossy(), &Default::default()).await.unwrap();
        if let Some(f) = ctx {
            let n = delta::query(&f, "SELECT COUNT(*) FROM t").await.unwrap();
            assert_eq!(n[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0), 0, "{keys}: a facts row was written");
        }
    }
    // A time column as the last one is fine.
    let s = heap_scenario("keys = [\"id\", \"at\"]");
    s.stream().await.unwrap();
}

/// The crash drill at every chunked failpoint: a crash there, then reruns,
/// leave one snapshot, every row once, and bronze equal to the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_drill_at_every_chunked_failpoint() {
    // Failpoints are process-wide: hold the lock for the whole drill.
    let _guard = fail::FailScenario::setup();
    for fp in mssql_cdc::engine::FAILPOINTS.iter().filter(|f| f.starts_with("chunked.")) {
        let mut s = Scenario::new(50, CHUNKED);
        let fired = {
            fail::cfg(*fp, "1*return").unwrap();
            let mut fired = false;
            for _ in 0..12 {
                s.changes(2);
                let step = match s.stream().await {
                    Ok(_) => backfill(&s, one_wave()).await.map(|b| b.done),
                    Err(e) => Err(e),
                };
                match step {
                    Err(e) if e.to_string().contains(*fp) => {
                        fired = true;
                        break;
                    }
                    Err(e) => panic!("{fp}: unexpected error {e}"),
                    Ok(true) => break,
                    Ok(false) => {}
                }
            }
            fail::remove(*fp);
            fired
        };
        assert!(fired, "{fp} never fired");
        loop {
            s.changes(2);
            s.stream().await.unwrap();
            if backfill(&s, BackfillArgs::default()).await.unwrap().done {
                break;
            }
        }
        s.stream_until_caught_up().await;
        let cmp = s.verify().await;
        assert_eq!(cmp.differences(), 0, "{fp}: {cmp:?}");
        assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1, "{fp}");
        assert_eq!(s.count("facts", "event = 'snapshot_plan'").await, 1, "{fp}");
        assert_eq!(s.duplicate_change_rows().await, 0, "{fp}");
        let chunks = s.count("facts", "event = 'snapshot_chunk'").await;
        let planned = plan_rows(&s).await.iter().find(|r| r.event == "snapshot_plan").unwrap().detail["chunk_count"].as_i64().unwrap();
        assert_eq!(chunks, planned, "{fp}: one facts row per chunk");
        let ctx = s.context().await.unwrap();
        let b = delta::query(&ctx.bronze, "SELECT id FROM t WHERE _operation = 0 GROUP BY id HAVING COUNT(*) > 1").await.unwrap();
        assert_eq!(b.iter().map(|b| b.num_rows()).sum::<usize>(), 0, "{fp}: a row read twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_facts_row_without_its_plans_row_raises_instead_of_reading_the_whole_table() {
    let _fp = fail::FailScenario::setup();
    let s = Scenario::new(30, &CHUNKED.replace("parallelism = 3", "parallelism = 1"));
    s.stream().await.unwrap();
    assert!(!backfill(&s, one_wave()).await.unwrap().done);
    // The plans table is lost (or was never readable): its key values are nowhere.
    let location = plans::location_for(&s.context().await.unwrap().workflow.target.bronze);
    std::fs::remove_dir_all(&location).unwrap();
    let e = backfill(&s, one_wave()).await.unwrap_err();
    assert!(matches!(e, StepError::NeedsPerson(_)), "{e}");
    assert!(e.to_string().contains("plans table"), "{e}");
    assert_eq!(s.count("bronze", "_chunk IS NOT NULL AND _chunk > 0").await, 0, "nothing more was read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_isolation_on_request_once_the_database_allows_it() {
    let _fp = fail::FailScenario::setup();
    let mut s = Scenario::new(40, CHUNKED);
    s.stream().await.unwrap();
    let snapshot = BackfillArgs { isolation: Some(mssql_cdc::source::Isolation::Snapshot), ..BackfillArgs::default() };
    // Refused while ALLOW_SNAPSHOT_ISOLATION is off, before the plan is made.
    let e = backfill(&s, snapshot.clone()).await.unwrap_err();
    assert!(e.to_string().to_lowercase().contains("snapshot"), "{e}");
    assert_eq!(s.count("facts", "event = 'snapshot_plan'").await, 0);
    s.db.set_config_value("allow_snapshot_isolation", "true").unwrap();
    s.changes(5);
    s.stream().await.unwrap();
    let b = backfill(&s, snapshot).await.unwrap();
    assert!(b.done, "{b:?}");
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
}
