//! The `status` step: the stream's state as JSON, read-only.
//!
//! It reports the capture instance the stream is on (the facts say which,
//! `engine::switch::follow_stream`), not the newest one: the position, the
//! min LSN and so the headroom are that instance's, the one whose cleanup
//! can pass the stream. `capture_instances` lists the table's instances with
//! their start LSNs (empty when the workflow pins one), so a newer instance
//! the stream has not reached yet shows beside it.

use serde_json::{json, Value};

use super::Context;
use crate::error::StepResult;

/// Reads the stream's state and the source's bounds; writes nothing.
pub async fn run(ctx: &mut Context) -> StepResult<Value> {
    let instances = super::switch::follow_stream(ctx).await?;
    let st = super::state::load(ctx).await?;
    let max = ctx.source.max_lsn().await?;
    let position = st.position();
    // The headroom is read live (`engine::headroom`): a batch's recorded one
    // stays put after the stream stops, while cleanup goes on.
    let headroom = super::headroom::live(&ctx.source, &ctx.zone, &ctx.instance.name, position).await?;
    let min = headroom.min_lsn;
    let pos_time = headroom.position_commit_ts;
    let max_time = match max {
        Some(m) => ctx.commit_time(m).await?,
        None => None,
    };
    let lag_seconds = match (pos_time, max_time) {
        (Some(p), Some(m)) => Some(((m - p).num_milliseconds() as f64 / 1000.0).max(0.0)),
        _ => None,
    };
    let headroom_seconds = headroom.seconds;
    let purged = matches!((position, min, max), (Some(p), Some(m), Some(x)) if x > p && p.increment() < m);
    // The state machine's view (`engine::machine`): the state, and the
    // transition each lane (`stream`, `backfill`) would run next.
    let rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let state = super::machine::MachineState::from_stream_state(&st, &rows, min);
    let inputs = super::machine::Inputs {
        min_lsn: min,
        max_lsn: max,
        bootstrap: ctx.workflow.snapshot.bootstrap,
        mode: ctx.workflow.snapshot.mode,
        on_data_loss: ctx.workflow.stream.on_data_loss,
    };
    let machine = json!({
        "state": state.label(),
        "detail": state,
        "next": {
            "stream": super::machine::next(&state, &inputs, super::machine::Lane::Stream),
            "backfill": super::machine::next(&state, &inputs, super::machine::Lane::Snapshot),
        },
    });
    let last_reconcile = last_reconcile(ctx).await?;
    Ok(json!({
        "step": "status",
        "app_id": ctx.workflow.app_id,
        "table": ctx.workflow.table_name().to_string(),
        "capture_instance": ctx.instance.name,
        "capture_instances": instances.iter().map(|i| json!({"name": i.name, "start_lsn": i.start_lsn})).collect::<Vec<_>>(),
        "generation": st.generation,
        "generation_app_id": st.generation_app_id,
        "position": position,
        "position_commit_ts": pos_time,
        "source_max_lsn": max,
        "source_min_lsn": min,
        "lag_seconds": lag_seconds,
        "headroom_seconds": headroom_seconds,
        "next_range_purged": purged,
        "snapshot": st.snapshot,
        "open_snapshots": st.open_snapshots,
        "last_batch": st.last_batch.as_ref().map(|b| json!({
            "batch_id": b.batch_id, "min_lsn": b.min_lsn, "max_lsn": b.max_lsn, "rows": b.rows,
            "recorded_at": b.recorded_at, "headroom_seconds": b.headroom_seconds,
        })),
        "batch_to_repair": st.batch_to_repair(),
        "last_reconcile": last_reconcile,
        "machine": machine,
    }))
}

/// The newest reconcile run's summary (run, clean, checked_at), read without
/// creating anything; `null` when the workflow has no silver or reconcile
/// has not run.
async fn last_reconcile(ctx: &Context) -> StepResult<Value> {
    let Ok(location) = ctx.workflow.reconcile_location() else {
        return Ok(Value::Null);
    };
    let Some(table) = crate::delta::peek_existing(&location, &ctx.storage).await? else {
        return Ok(Value::Null);
    };
    let sql = format!(
        "SELECT run, detail, checked_at FROM t WHERE app_id = {} AND class = 'SUMMARY' ORDER BY run DESC LIMIT 1",
        crate::delta::sql_str(&ctx.workflow.app_id)
    );
    let batches = crate::delta::query(&table, &sql).await?;
    let Some((run, detail, checked_at)) = crate::delta::reconcile::summaries_from_batches(&batches, &location)?.into_iter().next() else {
        return Ok(Value::Null);
    };
    let detail = detail.unwrap_or(Value::Null);
    Ok(json!({"run": run, "clean": detail.get("clean").cloned().unwrap_or(Value::Null), "checked_at": checked_at}))
}
