//! `mssql-cdc demo --scenario seed`: a table "too big to snapshot" joins the
//! stream through a copy someone already has.
//!
//! Under the running writer, the demo exports the table to a folder of
//! Parquet files as another tool would, noting only the time the copy started;
//! seeds bronze from that folder by the time; calls the seed again (a rerun
//! writes nothing); streams while the writer keeps going; and checks the
//! latest image per key rebuilt from bronze against the table.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{DemoArgs, Harness};
use crate::engine::seed::{AsOf, SeedArgs};
use crate::engine::{self, Context};
use crate::error::{StepError, StepResult};
use crate::source::CdcSource;

/// Runs the seed scenario; returns its JSON and whether it passed.
pub async fn run(args: DemoArgs) -> StepResult<(Value, bool)> {
    let t0 = Instant::now();
    let dir = std::path::absolute(&args.dir).unwrap_or(args.dir.clone());
    let mut h = Harness::create(&dir, args.rows, args.seed)?;
    let create_s = t0.elapsed().as_secs_f64();
    // bootstrap = true on purpose: the stream must find the seed as its snapshot and read no table.
    h.write_workflow("bootstrap = true\nmode = \"full\"\nparallelism = 4")?;
    h.progress.enable_steady_tick(Duration::from_millis(200));
    h.say(format!("created a simulated dbo.orders with {} rows in {create_s:.1}s; writer starting", args.rows));
    h.start_writer(args.writer_tx_per_s, args.seed);
    let sim_err = |e: crate::sim::SimError| StepError::Internal(format!("simulator: {e}"));
    let wait_start = Instant::now();
    while h.db.max_lsn().map_err(sim_err)?.is_none() {
        if wait_start.elapsed() > Duration::from_secs(30) {
            return Err(StepError::Temporary("the simulated capture job recorded no LSN within 30 s".into()));
        }
        let _ = h.db.capture();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The copy must be taken under the writer: wait until the capture job has
    // seen its changes (a writer over a big table takes a while to start),
    // then let it run a moment longer.
    let wait_start = Instant::now();
    while wait_start.elapsed() < Duration::from_secs(60) {
        let _ = h.db.capture();
        let status = h.db.status().map_err(sim_err)?;
        let change_rows = status["tables"][0]["capture_instances"][0]["change_rows"].as_i64().unwrap_or(0);
        if change_rows >= 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    let copy_dir = dir.join("copy");
    let source = h.db.source()?;
    let instance = source
        .capture_instances(&h.table)
        .await?
        .pop()
        .ok_or_else(|| StepError::Internal("the demo table has no capture instance".into()))?;
    let copy_started_at = chrono::Utc::now();
    // A writer transaction stamped just before the noted time may still be
    // committing: starting the read a moment later lets the copy hold it (a
    // copy may hold later commits, never miss earlier ones).
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.say(format!("exporting a Parquet copy of dbo.orders under the writer (started at {copy_started_at})"));
    let t_export = Instant::now();
    let copy_rows = crate::seed_copy::export_parquet(&source, &h.table, &instance.columns, &copy_dir, 50_000).await?;
    let export_s = t_export.elapsed().as_secs_f64();
    let note = dir.join("copy.started_at");
    std::fs::write(&note, format!("{}\n", copy_started_at.to_rfc3339()))
        .map_err(|e| StepError::Config(format!("cannot write {}: {e}", note.display())))?;

    h.say("seeding bronze from the copy by its start time");
    let seed_args = SeedArgs {
        copy: copy_dir.to_string_lossy().into_owned(),
        as_of: AsOf::Time(copy_started_at),
        reseed: false,
        allow_missing_columns: false,
    };
    let t_seed = Instant::now();
    let mut ctx = Context::open(h.workflow()?).await?;
    let seed = engine::seed::run(&mut ctx, &seed_args).await?;
    let seed_s = t_seed.elapsed().as_secs_f64();
    let rerun = engine::seed::run(&mut ctx, &seed_args).await?;
    drop(ctx);

    let t_stream = Instant::now();
    let (mut batches, mut streamed) = (0u32, 0i64);
    let mut bootstrap_found_seed = None;
    while t_stream.elapsed() < Duration::from_secs(args.stream_seconds) {
        let r = h.stream().await?;
        if bootstrap_found_seed.is_none() {
            bootstrap_found_seed = r.bootstrap.as_ref().map(|b| b["already_done"] == json!(true) && b["snapshot_lsn"] == json!(seed.lsn));
        }
        batches += r.batches;
        streamed += r.rows;
        h.say(format!("streaming from the seed: {batches} batches, {streamed} change rows"));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let writer = h.stop_writer()?;
    h.say("writer stopped; catching up");
    tokio::time::sleep(Duration::from_millis(400)).await;
    h.db.capture().map_err(sim_err)?;
    for _ in 0..100 {
        let r = h.stream().await?;
        if bootstrap_found_seed.is_none() {
            bootstrap_found_seed = r.bootstrap.as_ref().map(|b| b["already_done"] == json!(true) && b["snapshot_lsn"] == json!(seed.lsn));
        }
        batches += r.batches;
        streamed += r.rows;
        let done = r.caught_up && match (r.position, writer.last_commit_lsn) {
            (Some(p), Some(w)) => p >= w,
            _ => true,
        };
        if done {
            break;
        }
    }
    let stream_s = t_stream.elapsed().as_secs_f64();
    h.say("checking: apply to silver, then reconcile silver with the table");
    let t_verify = Instant::now();
    let check = h.check().await?;
    let verify_s = t_verify.elapsed().as_secs_f64();
    let ctx = Context::open(h.workflow()?).await?;
    let bootstrap_rows = crate::delta::query(&ctx.facts, "SELECT COUNT(*) AS n FROM t WHERE event = 'bootstrap'").await?;
    let bootstrap_events = bootstrap_rows
        .first()
        .and_then(|b| b.column(0).as_any().downcast_ref::<deltalake::arrow::array::Int64Array>().map(|a| a.value(0)))
        .unwrap_or(-1);
    h.progress.finish_and_clear();
    let differences = check.differences();
    let passed = differences == 0 && rerun.already_seeded && bootstrap_events == 1 && bootstrap_found_seed == Some(true);
    let out = json!({
        "scenario": "seed",
        "rows_source": check.reconcile.rows_source,
        "rows_target": check.reconcile.rows_target,
        "differences": differences,
        "reconcile": check.reconcile_json(),
        "apply": check.apply_json(),
        "copy": copy_dir,
        "copy_started_at": copy_started_at,
        "copy_rows": copy_rows,
        "seeded_lsn": seed.lsn,
        "seed_commit_ts": seed.commit_ts,
        "seed_rows": seed.rows,
        "seed_rows_per_s": if seed_s > 0.0 { seed.rows as f64 / seed_s } else { 0.0 },
        "rerun_already_seeded": rerun.already_seeded,
        "stream_bootstrap_found_seed": bootstrap_found_seed,
        "bootstrap_events": bootstrap_events,
        "batches": batches,
        "change_rows_streamed": streamed,
        "writer": writer,
        "seconds": {"create": create_s, "export": export_s, "seed": seed_s, "stream": stream_s, "verify": verify_s, "total": t0.elapsed().as_secs_f64()},
        "dir": dir,
        "workflow": h.workflow_path,
    });
    Ok((out, passed))
}
