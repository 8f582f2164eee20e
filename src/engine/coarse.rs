//! The coarse `stream` command, as a loop over the state machine.
//!
//! Each turn reads the state again (`step::load`), asks the pure
//! [`machine::next_in_call`] what the stream lane does next within the
//! call's limits, and runs that one transition through
//! `stream::run_transitions`, the same function `step` runs it with. So a
//! `stream` call makes exactly the commits a sequence of `step` calls makes,
//! and the golden logs of the two agree by construction, not by a second
//! copy of the order.
//!
//! Why a loop here and not inside `stream`: `step` runs the stream's
//! transitions, so the loop that chooses them sits above both, and the
//! layers stay one way (coarse → step → stream).
//!
//! What the loop costs: the state is read before every transition (the
//! facts, bronze's txn versions, the source's min and max LSN). The facts
//! read decodes only the files added since the last read in this process
//! (`delta::facts_read`), so a turn costs about the same late in a stream's
//! life as early: `mssql-cdc bench stream` prints the milliseconds per batch
//! of the first and the last call over a backlog, and the cached read
//! against a SQL scan of the same facts.

use super::machine::{self, CallLimits, CallNext, MachineState, StreamPhase, Transition};
use super::stream::{self, StreamResult, StreamTransitions};
use super::Context;
use crate::error::{StepError, StepResult};

/// Runs the `stream` step: the stream lane's transitions (a bootstrap or a
/// start, repairs, micro-batches, a recovery and its re-snapshot) one after
/// another while [`machine::next_in_call`] names one.
pub async fn stream(ctx: &mut Context) -> StepResult<StreamResult> {
    let (mut state, mut inputs) = super::step::load(ctx).await?;
    let mut limits = CallLimits { max_lsn: inputs.max_lsn, batches_left: ctx.workflow.stream.max_batches, recovered: false };
    let mut total: Option<StreamResult> = None;
    let (caught_up, reason) = loop {
        let transition = match machine::next_in_call(&state, &inputs, &limits) {
            CallNext::Run(t) => t,
            CallNext::Stop { caught_up, reason } => break (caught_up, reason),
            CallNext::DataLoss { position, next, min_lsn } => return Err(stream::data_loss(ctx, position, next, min_lsn).await),
        };
        let only = match transition {
            Transition::Start | Transition::Repair | Transition::Open => StreamTransitions::Start,
            Transition::Commit => StreamTransitions::Commit,
            Transition::Recover => StreamTransitions::Recover,
            Transition::Resnapshot => StreamTransitions::Resnapshot,
            other => return Err(StepError::Internal(format!("the stream lane named the snapshot lane's transition '{}'", other.name()))),
        };
        tracing::debug!(transition = transition.name(), state = state.label().name(), "stream: running a transition");
        let result = match stream::run_transitions(ctx, only).await {
            Ok(r) => r,
            // A batch refuses to run on a state that moved under it: nothing
            // was written. When cleanup passed the position after the state
            // was read, the state read again names the recovery and the call
            // goes on with it, as a `stream` call always has. Another call's
            // batch half committed (bronze ahead of the facts) still ends
            // this call with exit 75: that call is alive and writes its own
            // facts row, and the next call repairs it if it died.
            Err(StepError::Temporary(why)) if transition == Transition::Commit => {
                let (again, again_inputs) = super::step::load(ctx).await?;
                match machine::next_in_call(&again, &again_inputs, &limits) {
                    CallNext::Run(Transition::Recover) => {
                        (state, inputs) = (again, again_inputs);
                        continue;
                    }
                    _ => return Err(StepError::Temporary(why)),
                }
            }
            Err(e) => return Err(e),
        };
        limits.batches_left = limits.batches_left.saturating_sub(result.batches);
        if transition == Transition::Recover {
            limits.recovered = true;
        }
        let moved = result.batches > 0;
        let ended_caught_up = result.caught_up;
        merge(&mut total, result);
        let (after, after_inputs) = super::step::load(ctx).await?;
        if after.generation > state.generation {
            // A recovery's snapshot made a new generation live (this call's,
            // or a concurrent call's that got there first): it stands at or
            // past the max LSN the call started with, so the call reads on up
            // to the max LSN of now.
            limits.max_lsn = after_inputs.max_lsn;
        }
        if after == state && !moved {
            // A transition that changed nothing (another call got there
            // first, or the step found nothing to do) ends the call rather
            // than run it again.
            break (ended_caught_up, format!("'{}' changed nothing", transition.name()));
        }
        (state, inputs) = (after, after_inputs);
    };
    tracing::debug!(reason = %reason, "stream: the call ends");
    let mut result = total.unwrap_or_else(|| empty_result(&state));
    // Where the stream stands now, whichever transition (or concurrent call) moved it.
    result.generation = state.generation;
    if let StreamPhase::At { position, .. } = &state.stream {
        result.position = Some(*position);
    }
    result.caught_up = caught_up;
    result.call_again = !caught_up;
    result.source_max_lsn = limits.max_lsn;
    Ok(result)
}

/// The result of a call that ran no transition: the state as it is.
fn empty_result(state: &MachineState) -> StreamResult {
    StreamResult {
        step: "stream",
        generation: state.generation,
        batches: 0,
        rows: 0,
        position: match &state.stream {
            StreamPhase::At { position, .. } => Some(*position),
            StreamPhase::NotStarted => None,
        },
        source_max_lsn: None,
        caught_up: false,
        call_again: false,
        repaired_batches: Vec::new(),
        bootstrap: None,
        recovery: None,
        skipped: Vec::new(),
        snapshots_on_switch: Vec::new(),
    }
}

/// Adds one transition's result to the call's.
fn merge(total: &mut Option<StreamResult>, r: StreamResult) {
    let Some(t) = total else {
        *total = Some(r);
        return;
    };
    t.generation = r.generation;
    t.batches += r.batches;
    t.rows += r.rows;
    t.position = r.position.or(t.position);
    t.repaired_batches.extend(r.repaired_batches);
    // The first transition that met the bootstrap did it (or found it
    // done); the later ones only find it done.
    if t.bootstrap.is_none() {
        t.bootstrap = r.bootstrap;
    }
    // A recovery's second transition (its re-snapshot) reports the recovery
    // whole: the gap, the new generation and its snapshot.
    // Whether the recovery was resumed (its row recorded before this call)
    // is the first transition's word: the re-snapshot always finds the row
    // its own call's `recover` wrote.
    if let Some(mut later) = r.recovery {
        if let Some(first) = &t.recovery {
            later.resumed = first.resumed;
        }
        t.recovery = Some(later);
    }
    t.skipped.extend(r.skipped);
    t.snapshots_on_switch.extend(r.snapshots_on_switch);
}
