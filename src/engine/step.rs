//! The `step` command: one transition of the state machine
//! (`engine::machine`), chosen by name or by [`machine::next`], with the
//! state before and after it.
//!
//! A transition runs through the step that owns it, bounded to that one
//! transition, so its commits, txn ids and failpoints are exactly the
//! step's (the crash drills and golden logs cover them):
//! - `start`, `repair`: `stream` with no batch (its start and repairs only);
//! - `open`: the bootstrap's open (`snapshot`: a chunked open at S, or a
//!   full snapshot, which is read and completed by the same call);
//! - `commit`: `stream` with at most one batch;
//! - `recover`, `resnapshot`: `stream` with at most one batch, whose
//!   retention guard records the recovery and takes the re-snapshot;
//! - `plan`, `wave`, `complete`: `backfill` limited to that transition
//!   (`chunked::LaneTransitions`): the plan's rows; one wave's bronze, plans
//!   and facts commits (never the completion, even after the last wave);
//!   the completion row. Each runs backfill's checks first, which write
//!   nothing, and refuses (exit 2) when the snapshot is not where the
//!   transition starts.
//!
//! A named transition that [`machine::next`] does not name for either lane
//! is refused with exit 2 before anything is written, naming what is next.

use serde_json::{json, Value};

use super::chunked::LaneTransitions;
use super::machine::{self, Inputs, Lane, MachineState, Next, Transition};
use super::Context;
use crate::error::{StepError, StepResult};

/// The machine's state and its inputs, read now (nothing written).
pub async fn load(ctx: &mut Context) -> StepResult<(MachineState, Inputs)> {
    super::switch::follow_stream(ctx).await?;
    let st = super::state::load(ctx).await?;
    let rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let min_lsn = ctx.source.min_lsn(&ctx.instance.name).await?;
    let max_lsn = ctx.source.max_lsn().await?;
    let state = MachineState::from_stream_state(&st, &rows, min_lsn);
    let inputs = Inputs {
        min_lsn,
        max_lsn,
        bootstrap: ctx.workflow.snapshot.bootstrap,
        mode: ctx.workflow.snapshot.mode,
        on_data_loss: ctx.workflow.stream.on_data_loss,
    };
    Ok((state, inputs))
}

/// Parses a transition's name as `step` takes it.
pub fn parse(name: &str) -> StepResult<Option<Transition>> {
    if name == "next" {
        return Ok(None);
    }
    Transition::ALL.iter().copied().find(|t| t.name() == name && *t != Transition::Idle).map(Some).ok_or_else(|| {
        let names: Vec<&str> = Transition::ALL.iter().filter(|t| **t != Transition::Idle).map(|t| t.name()).collect();
        StepError::Config(format!("'{name}' is not a transition: use next or one of {}", names.join(", ")))
    })
}

fn state_json(s: &MachineState) -> Value {
    json!({"state": s.label(), "detail": s})
}

/// Runs one transition: `wanted`, or whichever [`machine::next`] names
/// (the stream lane's first, the snapshot lane's when the stream has
/// nothing to do). Returns the state before, the transition and the state after.
pub async fn run(ctx: &mut Context, wanted: Option<Transition>) -> StepResult<Value> {
    let (before, inputs) = load(ctx).await?;
    let stream_next = machine::next(&before, &inputs, Lane::Stream);
    let snapshot_next = machine::next(&before, &inputs, Lane::Snapshot);
    let (lane, chosen): (Lane, Next) = match wanted {
        None if stream_next.transition != Transition::Idle => (Lane::Stream, stream_next.clone()),
        None => (Lane::Snapshot, snapshot_next.clone()),
        Some(t) if stream_next.transition == t => (Lane::Stream, stream_next.clone()),
        Some(t) if snapshot_next.transition == t => (Lane::Snapshot, snapshot_next.clone()),
        Some(t) => {
            return Err(StepError::Config(format!(
                "transition '{}' is not allowed in state {}: the stream's next is '{}' ({}), backfill's is '{}' ({})",
                t.name(),
                before.label().name(),
                stream_next.transition.name(),
                stream_next.reason,
                snapshot_next.transition.name(),
                snapshot_next.reason
            )))
        }
    };
    let result = match (chosen.transition, lane) {
        (Transition::Idle, _) => Value::Null,
        (Transition::Start | Transition::Repair, _) => stream_with(ctx, 0).await?,
        (Transition::Commit | Transition::Recover | Transition::Resnapshot, _) => stream_with(ctx, 1).await?,
        (Transition::Open, _) => {
            if ctx.workflow.snapshot.mode == crate::workflow::SnapshotMode::Chunked {
                serde_json::to_value(super::chunked::ensure_bootstrap_open(ctx).await?).unwrap_or(Value::Null)
            } else {
                serde_json::to_value(super::snapshot::ensure_bootstrap(ctx).await?).unwrap_or(Value::Null)
            }
        }
        (Transition::Plan, _) => backfill_with(ctx, LaneTransitions::Plan).await?,
        (Transition::Wave, _) => backfill_with(ctx, LaneTransitions::Wave).await?,
        (Transition::Complete, _) => backfill_with(ctx, LaneTransitions::Complete).await?,
    };
    let (after, after_inputs) = load(ctx).await?;
    Ok(json!({
        "step": "step",
        "lane": lane,
        "transition": chosen.transition,
        "reason": chosen.reason,
        "before": state_json(&before),
        "after": state_json(&after),
        "next": {
            "stream": machine::next(&after, &after_inputs, Lane::Stream),
            "backfill": machine::next(&after, &after_inputs, Lane::Snapshot),
        },
        "result": result,
    }))
}

/// `stream` bounded to `max_batches` batches (0: its start and repairs only).
async fn stream_with(ctx: &mut Context, max_batches: u32) -> StepResult<Value> {
    let kept = ctx.workflow.stream.max_batches;
    ctx.workflow.stream.max_batches = max_batches;
    let r = super::stream::run(ctx).await;
    ctx.workflow.stream.max_batches = kept;
    Ok(serde_json::to_value(r?).unwrap_or(Value::Null))
}

/// `backfill` limited to one of its transitions.
async fn backfill_with(ctx: &mut Context, transitions: LaneTransitions) -> StepResult<Value> {
    let args = super::chunked::BackfillArgs { transitions, ..Default::default() };
    Ok(serde_json::to_value(super::chunked::backfill(ctx, &args).await?).unwrap_or(Value::Null))
}
