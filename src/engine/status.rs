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
    let min = ctx.source.min_lsn(&ctx.instance.name).await?;
    let position = st.position();
    let pos_time = match position {
        Some(p) => ctx.commit_time(p).await?,
        None => None,
    };
    let max_time = match max {
        Some(m) => ctx.commit_time(m).await?,
        None => None,
    };
    let min_time = match min {
        Some(m) => ctx.commit_time(m).await?,
        None => None,
    };
    let lag_seconds = match (pos_time, max_time) {
        (Some(p), Some(m)) => Some(((m - p).num_milliseconds() as f64 / 1000.0).max(0.0)),
        _ => None,
    };
    let headroom_seconds = match (pos_time, min_time) {
        (Some(p), Some(m)) => Some((p - m).num_milliseconds() as f64 / 1000.0),
        _ => None,
    };
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
        "machine": machine,
    }))
}
