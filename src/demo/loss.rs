//! `demo --scenario data-loss` and `--scenario data-loss-chunked`: a stream
//! stopped for longer than the CDC retention recovers on its next call, with
//! no person involved (adr-0018).
//!
//! The simulator runs on a manual clock that the writer's commits move
//! forward, so the scenario can let four days pass in an instant: the stream
//! job is "down", the writer goes on, the clock jumps past the three-day
//! retention, CDC cleanup purges the changes the stream never read. The next
//! `stream` call finds the gap, records it, re-snapshots in generation 1
//! (full: read now; chunked: opened at S, read by `backfill` beside the
//! stream) and streams on. Silver was applied before the stop; at the end
//! `apply` rebuilds it from the re-snapshot and `reconcile` checks it
//! against the table.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{DemoArgs, Harness};
use crate::engine::{self, chunked::BackfillArgs, Context};
use crate::error::{StepError, StepResult};
use crate::sim::{Clock, SimConfig};

const RETENTION_MINUTES: u64 = 3 * 24 * 60;

fn sim_err(e: crate::sim::SimError) -> StepError {
    StepError::Internal(format!("simulator: {e}"))
}

/// Runs the scenario; `chunked` picks the re-snapshot's mode.
pub async fn run(args: DemoArgs, chunked: bool) -> StepResult<(Value, bool)> {
    let t0 = Instant::now();
    let dir = std::path::absolute(&args.dir).unwrap_or(args.dir.clone());
    let cfg = SimConfig {
        // Each commit moves the clock by 5 ms: at 200 transactions a second it
        // keeps pace with the wall clock, and the scenario can jump days.
        clock: Clock::Manual { start: chrono::Utc::now(), tick_ms: 5 },
        time_zone: "America/Sao_Paulo".into(),
        capture_lag_ms: 0,
        retention_minutes: RETENTION_MINUTES,
        idle_interval_seconds: 1,
        seed: args.seed,
        ..SimConfig::default()
    };
    let mut h = Harness::create_with(&dir, args.rows, cfg)?;
    let create_s = t0.elapsed().as_secs_f64();
    let snapshot_toml = if chunked {
        let chunk_rows = (args.rows / 20).clamp(1_000, 1_000_000);
        format!("bootstrap = true\nmode = \"chunked\"\nparallelism = 4\nchunk_rows = {chunk_rows}\ntarget_wave_seconds = 2")
    } else {
        "bootstrap = true\nmode = \"full\"\nparallelism = 4".to_string()
    };
    h.write_workflow_with("on_data_loss = \"resnapshot\"\nresnapshot_interval_days = 7", &snapshot_toml)?;
    h.progress.enable_steady_tick(Duration::from_millis(200));
    h.say(format!("created a simulated dbo.orders with {} rows in {create_s:.1}s; writer starting", args.rows));
    h.start_writer(args.writer_tx_per_s, args.seed);
    h.wait_for_capture().await?;

    // Generation 0: the bootstrap, then the stream for a while.
    h.say("bootstrap, then streaming");
    let first = h.stream().await?;
    if chunked {
        backfill_beside_the_stream(&h).await?;
    }
    let (mut batches, mut streamed) = (first.batches, first.rows);
    let stream_for = Duration::from_secs((args.stream_seconds / 2).max(2));
    let t_stream = Instant::now();
    while t_stream.elapsed() < stream_for {
        let r = h.stream().await?;
        batches += r.batches;
        streamed += r.rows;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let position_before = h.stream().await?.position;
    // Silver is applied in generation 0, so the recovery's rebuild has to
    // delete the keys the gap removed.
    h.say("apply: silver from bronze before the stop");
    let applied_before = h.stream_handle().apply().await?;

    // The stream job stops; four days pass; cleanup purges what it never read.
    h.say("the stream job is down: four days pass, CDC cleanup runs");
    tokio::time::sleep(Duration::from_millis(800)).await;
    h.db.advance_clock(Duration::from_secs(4 * 24 * 3600)).map_err(sim_err)?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    h.db.capture().map_err(sim_err)?;
    let cleanup = h.db.cleanup(None).map_err(sim_err)?;

    // The next call finds the gap and recovers on its own.
    h.say("the stream job is back: its next call recovers");
    let t_recover = Instant::now();
    let r = h.stream().await?;
    let recovery = r.recovery.clone().ok_or_else(|| {
        StepError::Internal(format!("the stream's first call after the retention did not recover: {}", serde_json::to_string(&r).unwrap_or_default()))
    })?;
    let recover_call_s = t_recover.elapsed().as_secs_f64();
    batches += r.batches;
    streamed += r.rows;
    if chunked {
        backfill_beside_the_stream(&h).await?;
    }
    let recovered_s = t_recover.elapsed().as_secs_f64();
    let t_after = Instant::now();
    while t_after.elapsed() < stream_for {
        let r = h.stream().await?;
        batches += r.batches;
        streamed += r.rows;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let (writer, b, rr) = h.stop_and_catch_up().await?;
    batches += b;
    streamed += rr;

    h.say("checking: apply to silver (a rebuild from the re-snapshot), then reconcile silver with the table");
    let check = h.check().await?;
    let mut ctx = Context::open(h.workflow()?).await?;
    let st = engine::state::load(&mut ctx).await?;
    let facts = engine::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let resnapshots = engine::recover::resnapshots(&facts);
    h.progress.finish_and_clear();
    let differences = check.differences();
    let out = json!({
        "scenario": if chunked { "data-loss-chunked" } else { "data-loss" },
        "rows_source": check.reconcile.rows_source,
        "rows_target": check.reconcile.rows_target,
        "differences": differences,
        "reconcile": check.reconcile_json(),
        "apply": check.apply_json(),
        "applied_lsn_before_the_stop": applied_before.applied_lsn,
        "resnapshots": resnapshots,
        "generation": st.generation,
        "position_before_the_stop": position_before,
        "cleanup_watermark": cleanup.watermark,
        "recovery": recovery,
        "batches": batches,
        "change_rows_streamed": streamed,
        "writer": writer,
        "seconds": {"create": create_s, "recovery_call": recover_call_s, "recovered": recovered_s, "total": t0.elapsed().as_secs_f64()},
        "dir": dir,
        "workflow": h.workflow_path,
    });
    Ok((out, differences == 0 && resnapshots >= 1))
}

/// Calls `backfill` (two-second calls) and `stream` in turn until the open
/// chunked snapshot is complete, as two orchestrator jobs would.
async fn backfill_beside_the_stream(h: &Harness) -> StepResult<()> {
    let handle = h.stream_handle();
    let args = BackfillArgs { max_seconds: Some(2.0), ..Default::default() };
    for _ in 0..10_000 {
        let r = handle.backfill(&args).await?;
        h.say(format!("backfill: {}/{} chunks (generation {}), stream running", r.chunks_done, r.chunks_total, r.generation));
        handle.stream().await?;
        if r.done {
            return Ok(());
        }
    }
    Err(StepError::Internal("backfill did not finish".into()))
}
