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
//! - `commit`: `stream` limited to one micro-batch (`stream::StreamTransitions`);
//! - `recover`: `stream` limited to the recovery row its retention guard
//!   writes (generation n + 1 recorded, nothing read);
//! - `resnapshot`: `stream` limited to the recorded recovery's snapshot
//!   (full: read and completed; chunked: opened), no batch after it;
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
use super::stream::StreamTransitions;
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
        (Transition::Start | Transition::Repair, _) => stream_with(ctx, StreamTransitions::Start).await?,
        (Transition::Commit, _) => stream_with(ctx, StreamTransitions::Commit).await?,
        (Transition::Recover, _) => stream_with(ctx, StreamTransitions::Recover).await?,
        (Transition::Resnapshot, _) => stream_with(ctx, StreamTransitions::Resnapshot).await?,
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

/// `stream` limited to one of its transitions.
async fn stream_with(ctx: &mut Context, transitions: StreamTransitions) -> StepResult<Value> {
    Ok(serde_json::to_value(super::stream::run_transitions(ctx, transitions).await?).unwrap_or(Value::Null))
}

/// `backfill` limited to one of its transitions.
async fn backfill_with(ctx: &mut Context, transitions: LaneTransitions) -> StepResult<Value> {
    let args = super::chunked::BackfillArgs { transitions, ..Default::default() };
    Ok(serde_json::to_value(super::chunked::backfill(ctx, &args).await?).unwrap_or(Value::Null))
}
