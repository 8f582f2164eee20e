//! The stream lane's transitions (`run_transitions`): a start, repairs, one
//! micro-batch from the stream's position, a recovery and its re-snapshot.
//! The coarse `stream` command runs them in a loop (`engine::coarse`).
//!
//! Each batch reads the capture instance's changes in `(position, to]`,
//! appends them to bronze in one commit (txn: the generation's app id, the
//! batch id; the range in the commit metadata), then writes its facts row
//! (txn: `<app id>#facts`, the batch id). A crash between the two leaves a
//! bronze commit without a facts row; the next call finds the bronze txn
//! version ahead of the facts and writes the missing row from the commit's
//! metadata before reading anything, so the position never moves back and no
//! change is written twice.
//!
//! Bronze's txn is the one arbiter of a batch, whoever commits it. A batch
//! that read no rows still commits to bronze: a commit holding only the txn
//! action and the batch's metadata (Delta accepts a commit without data
//! actions; deltalake's `CommitData` is built from an empty action list
//! plus commitInfo and txn). Two calls that hold the same batch id (two
//! orchestrator runs overlapping) race for bronze's txn N; the loser finds it
//! applied and exits 75 without writing anything, and the facts row of N is
//! only ever written from the winner's commit: by the winner itself, or by
//! the repair above from the commit's metadata. An older protocol committed
//! an empty batch to the facts only; a call with rows for the same batch id
//! then won bronze N, found facts N applied and ignored it, so the facts
//! ended N where bronze did not and the next batch wrote the changes in
//! between again. Alternatives considered: making the facts txn the arbiter
//! (bronze written after it) would need a facts row whose range is not yet
//! in bronze, and a crash between them could not be repaired from bronze;
//! comparing after the fact only detects the damage. The cost of the chosen
//! one is one more commit (bronze's, a few hundred bytes of log) for each
//! empty batch; a batch with rows makes the same two commits as before.
//!
//! A facts append that finds N applied (a concurrent repair wrote it from the
//! same bronze commit) compares the recorded range, rows and bronze version
//! with the ones this call derived; a difference is exit 3 naming both, never
//! ignored. Tables written by older releases stay readable: their empty
//! batches have a facts row and no bronze commit, and bronze's txn version
//! may trail the facts (the next batch id is the larger of the two plus one).
//! A newest facts row without a bronze version while bronze holds a commit of
//! that batch id is the older race's damage, and stops the stream (exit 3)
//! before it writes the changes twice.
//!
//! `on_data_loss = "skip"` is refused while the generation's chunked snapshot
//! is still open. A chunked snapshot is only right because bronze holds every
//! change after its S without a gap (adr-0028's P3): a chunk row stamped L is
//! corrected by the changes after L that the stream wrote. A skip breaks that
//! premise for every chunk read after the gap's changes were made, and the
//! records say such a snapshot is abandoned and a newer one supersedes it
//! (adr-0028, Consequences). Skipping and letting `backfill` complete it
//! would hand silver a `bootstrap`/`resnapshot` row over an image that may
//! keep deleted keys or old values, with nothing in the facts to tell. Marking
//! it failed after the skip would strand the stream instead: the skip leaves
//! no loss for a later call to recover from, and a generation opens one
//! chunked snapshot only. So the stream stops before the batch (exit 3,
//! nothing written) and says what supersedes the snapshot: a recovery
//! (`on_data_loss = "resnapshot"`) that opens a new chunked snapshot in the
//! next generation. The same holds for cleanup found during a read (a
//! possible loss): the batch is not committed. Once no chunked snapshot is
//! open, skips go on as adr-0018's Amendment 3 describes.

use std::time::Instant;

use deltalake::arrow::array::{Array, FixedSizeBinaryArray};
use deltalake::writer::DeltaWriter;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use super::repair::{check_recorded_batch, repair, Skip};
use super::state::{self, append_facts, StreamState, EVENT_STREAM_START};
use super::switch;
use super::Context;
use crate::delta::facts::FactRow;
use crate::delta::{self, bronze, Appended, Txn};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::source::{SourceError, CHANGE_START_LSN};
use crate::workflow::{OnDataLoss, SnapshotMode};

/// What the next batch should do, decided from the position and the source's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchDecision {
    /// Nothing new: max LSN is at or below the position.
    CaughtUp,
    /// Read `from ..= to_max` (bounded by rows).
    Read { from: Lsn, to_max: Lsn },
    /// The next range was purged: `next < min_lsn` with changes to read.
    Purged { next: Lsn, min_lsn: Lsn },
}

/// The retention guard, as a pure function. Precondition of the purge test:
/// a range to read exists (max LSN above the position); with nothing
/// captured after the position nothing can have been purged from it, and a
/// new instance's min LSN may still be unset.
pub fn decide(position: Lsn, max_lsn: Option<Lsn>, min_lsn: Option<Lsn>) -> BatchDecision {
    let Some(max) = max_lsn else { return BatchDecision::CaughtUp };
    if max <= position {
        return BatchDecision::CaughtUp;
    }
    let next = position.increment();
    match min_lsn {
        Some(min) if next < min => BatchDecision::Purged { next, min_lsn: min },
        _ => BatchDecision::Read { from: next, to_max: max },
    }
}

/// The JSON result of a `stream` call.
#[derive(Debug, Clone, Serialize)]
pub struct StreamResult {
    pub step: &'static str,
    pub generation: i32,
    pub batches: u32,
    pub rows: i64,
    pub position: Option<Lsn>,
    pub source_max_lsn: Option<Lsn>,
    pub caught_up: bool,
    /// True when the step stopped at max_batches with more to read: call again now.
    /// (`caught_up` is about the max LSN read when the call started.)
    pub call_again: bool,
    pub repaired_batches: Vec<i64>,
    pub bootstrap: Option<Value>,
    /// The recovery this call made after finding the next range purged
    /// (`on_data_loss = "resnapshot"`): the gap, the new generation and its snapshot.
    pub recovery: Option<super::recover::RecoveryResult>,
    /// Purged ranges this call skipped (`on_data_loss = "skip"`), as their `data_skipped` rows say.
    pub skipped: Vec<Value>,
    /// Chunked snapshots this call opened after a capture-instance switch
    /// (`snapshot.snapshot_on_switch`; see `engine::switch`).
    pub snapshots_on_switch: Vec<super::chunked::OpenResult>,
}

/// Which of the stream lane's transitions one call of [`run_transitions`]
/// runs, so that each makes exactly its own commits. `step` runs one (the
/// machine's `start`/`repair`, `commit`, `recover`, `resnapshot`); the
/// coarse `stream` (`engine::coarse`) runs them one after another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamTransitions {
    /// The bootstrap, the repairs and the recorded start only: no batch.
    Start,
    /// One micro-batch (with the `data_skipped` row a skip adds to it), not a recovery.
    Commit,
    /// A recovery's row only (`recovery`, generation n + 1 recorded), not its re-snapshot.
    Recover,
    /// A recorded recovery's re-snapshot only, not the batch after it.
    Resnapshot,
}

/// The stream lane's transitions named by `only` (see [`StreamTransitions`]):
/// the bootstrap when configured, the repairs and the start first, then at
/// most one batch or one recovery transition.
pub async fn run_transitions(ctx: &mut Context, only: StreamTransitions) -> StepResult<StreamResult> {
    // A stream that has not started starts on the context's instance (the
    // newest, or the pinned one). Bronze may be older than that instance: a
    // call made before a column was added and a new instance enabled (an
    // `apply`, a `status`) created it with the older instance's columns.
    // Whatever the stream then wrote, snapshot rows or changes, would be cut
    // to bronze's columns and lose the added one, and steps that select the
    // instance's columns from bronze would fail. So bronze gains them first,
    // as a switch gives them (`switch::switch`).
    let started = switch::recorded_instance(&state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?).is_some();
    if !started || ctx.workflow.table.capture_instance.is_some() {
        let instance = ctx.instance.clone();
        switch::add_bronze_columns(ctx, &instance).await?;
    }
    let mut bootstrap = None;
    if ctx.workflow.snapshot.bootstrap {
        match ctx.workflow.snapshot.mode {
            SnapshotMode::Full => {
                let r = super::snapshot::ensure_bootstrap(ctx).await?;
                bootstrap = Some(serde_json::to_value(&r).unwrap_or(Value::Null));
            }
            SnapshotMode::Chunked => {
                // Opens the chunked snapshot at S and starts the stream there;
                // `backfill` reads the table beside the stream.
                if let Some(r) = super::chunked::ensure_bootstrap_open(ctx).await? {
                    bootstrap = Some(serde_json::to_value(&r).unwrap_or(Value::Null));
                }
            }
        }
    }
    let mut st = state::load(ctx).await?;
    let repaired = repair(ctx, &st).await?;
    if !repaired.is_empty() {
        st = state::load(ctx).await?;
    }
    if st.position().is_none() {
        record_start(ctx, &st).await?;
        st = state::load(ctx).await?;
    }
    let mut position = st.position().ok_or_else(|| StepError::Internal("the stream has no position after recording its start".into()))?;
    let mut result = StreamResult {
        step: "stream",
        generation: st.generation,
        batches: 0,
        rows: 0,
        position: Some(position),
        source_max_lsn: None,
        caught_up: false,
        call_again: false,
        repaired_batches: repaired,
        bootstrap,
        recovery: None,
        skipped: Vec::new(),
        snapshots_on_switch: Vec::new(),
    };
    // The instance the stream is on (it follows newer ones unless the
    // workflow pins one; see `engine::switch`).
    let follow_instances = ctx.workflow.table.capture_instance.is_none();
    let mut instances = Vec::new();
    if follow_instances {
        instances = ctx.source.capture_instances(&ctx.workflow.table_name()).await?;
        // The newest batch's instance, or before the generation's first
        // batch the one its start row names (never the newest by default:
        // a newer instance starts after the stream's position).
        let recorded = super::switch::recorded_instance(&state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?);
        ctx.instance = super::switch::current(recorded.as_deref(), &instances, &ctx.instance).clone();
        // A switch batch whose snapshot a crash left unopened: open it first.
        if let Some(r) = super::chunked::ensure_open_on_switch(ctx).await? {
            result.snapshots_on_switch.push(r);
            st = state::load(ctx).await?;
            position = st.position().ok_or_else(|| StepError::Internal("the stream lost its position".into()))?;
            result.position = Some(position);
        }
    }
    if !ctx.instance.renamed.is_empty() {
        // Change rows carry a renamed column under its captured name, as the
        // change table does, so streaming stays right; the table reads do not.
        tracing::warn!(
            table = %ctx.workflow.table_name(),
            capture_instance = %ctx.instance.name,
            renamed = %super::renames_text(&ctx.instance),
            "the capture instance captures columns the source table has renamed since (captured name -> name now): the stream \
             goes on under the captured names, but every step that reads the table (snapshots, backfill, reconcile, seed) \
             refuses this instance; create a capture instance that captures the new names and let the stream switch to it"
        );
    }
    // The call reads up to the max LSN it found when it started: a writer that
    // never pauses cannot keep one call running forever. The next call picks
    // up what arrived meanwhile.
    let mut max = ctx.source.max_lsn().await?;
    result.source_max_lsn = max;
    let on_loss = ctx.workflow.stream.on_data_loss;
    let max_batches = match only {
        StreamTransitions::Commit => 1,
        StreamTransitions::Start | StreamTransitions::Recover | StreamTransitions::Resnapshot => 0,
    };
    let recovery_only = matches!(only, StreamTransitions::Recover | StreamTransitions::Resnapshot);
    if only == StreamTransitions::Resnapshot && max.is_none() {
        // The re-snapshot is taken at the max LSN, and the batch guard below
        // would take a NULL max LSN for "caught up" and end the transition
        // without it.
        return Err(StepError::Temporary(
            "the capture job has no max LSN to take the recovery's re-snapshot at (max LSN is NULL): call again once it has run".into(),
        ));
    }
    loop {
        // A recovery's transitions stop the call once theirs is made; the
        // others once the call has committed its batches.
        let done = if recovery_only { result.recovery.is_some() } else { result.batches >= max_batches };
        if done {
            result.call_again = true;
            break;
        }
        let mut switch_events = Vec::new();
        let mut read_max = max;
        if follow_instances {
            match super::switch::plan(position, &ctx.instance, &instances) {
                super::switch::InstancePlan::Stay { upto: Some(u) } => read_max = max.map(|m| m.min(u)),
                super::switch::InstancePlan::Stay { upto: None } => {}
                super::switch::InstancePlan::Switch { to } => {
                    if super::chunked::opens_on_switch(ctx) {
                        super::chunked::check_open_on_switch(ctx, &to).await?;
                    }
                    switch_events = super::switch::switch(ctx, st.generation, to).await?
                }
            }
        }
        let ci = ctx.instance.name.clone();
        let min = ctx.source.min_lsn(&ci).await?;
        let (from, to_max, mut skips) = match decide(position, read_max, min) {
            BatchDecision::CaughtUp => {
                result.caught_up = true;
                break;
            }
            // Nothing purged: no recovery to make, and a recovery's transition reads no batch.
            BatchDecision::Read { .. } if recovery_only => break,
            BatchDecision::Read { from, to_max } => (from, to_max, Vec::new()),
            BatchDecision::Purged { next, min_lsn } => match on_loss {
                OnDataLoss::Fail => return Err(data_loss(ctx, position, next, min_lsn).await),
                OnDataLoss::Resnapshot => {
                    if only == StreamTransitions::Commit {
                        // The state the machine named `commit` from is gone:
                        // cleanup passed the position since. Nothing written.
                        return Err(StepError::Temporary(format!(
                            "the changes after {position} were purged after the state was read: call `step next` (it names `recover`)"
                        )));
                    }
                    if result.recovery.is_some() {
                        // One recovery per call: a second loss right after one
                        // means cleanup outruns the stream; the next call's guard decides.
                        return Err(data_loss(ctx, position, next, min_lsn).await);
                    }
                    let loss = super::recover::Loss { position, next, min_lsn };
                    let upto = if only == StreamTransitions::Recover { super::recover::RecoverUpTo::RecoveryRow } else { super::recover::RecoverUpTo::Snapshot };
                    let r = super::recover::recover(ctx, &st, loss, ctx.workflow.stream.resnapshot_interval_days, upto).await?;
                    if r.snapshot_lsn.is_none() {
                        // The recovery row only: the stream stays in the older generation.
                        result.recovery = Some(r);
                        continue;
                    }
                    st = state::load(ctx).await?;
                    position = st.position().ok_or_else(|| StepError::Internal("the new generation has no position after its recovery".into()))?;
                    result.generation = st.generation;
                    result.position = Some(position);
                    result.recovery = Some(r);
                    // The snapshot's LSN is at or past the max LSN this call
                    // started with: read up to the max LSN of now.
                    max = ctx.source.max_lsn().await?;
                    result.source_max_lsn = max;
                    continue;
                }
                OnDataLoss::Skip if open_chunked_snapshot(&st).is_some() => {
                    return Err(skip_refused(ctx, &st, position, next, min_lsn).await);
                }
                OnDataLoss::Skip => {
                    let to_max = max.map_or(min_lsn, |m| m.max(min_lsn));
                    let lost_from_ts = super::recover::position_time(ctx, &st, position).await?;
                    let skip = Skip {
                        from: next,
                        to: min_lsn,
                        certain: true,
                        reason: "the range was purged by CDC cleanup before the batch read it".into(),
                        lost_from_ts,
                        lost_to_ts: ctx.commit_time(min_lsn).await?,
                    };
                    tracing::warn!(from = %next, to = %min_lsn, "on_data_loss = skip: the changes in between were purged; skipping ahead and recording the gap");
                    (min_lsn, to_max, vec![skip])
                }
            },
        };
        // A batch's id and its `from` must come from one outcome: the id
        // follows the newest batch bronze or the facts hold, `from` follows
        // the facts' end. Bronze ahead of the facts means another call
        // committed a batch whose facts row this call has not read (its
        // state was loaded between that call's two commits); reading on
        // from the facts' end would cover that batch's range a second time
        // under the next id. The next call repairs the facts row first.
        if let Some(ahead) = st.batch_to_repair() {
            return Err(StepError::Temporary(format!(
                "batch {ahead} of {} was committed by another call while this one ran: call again",
                st.generation_app_id
            )));
        }
        debug_assert_eq!(Some(position), st.position(), "the stream's position is the facts' end");
        let batch_id = st.next_batch_id();
        match run_batch(ctx, &st, batch_id, from, to_max, max, &mut skips, &switch_events).await? {
            BatchOutcome::Committed(fact) => {
                result.batches += 1;
                result.rows += fact.rows.unwrap_or(0);
                position = fact.max_lsn.expect("a batch has a max LSN");
                result.position = Some(position);
                result.skipped.extend(skips.iter().map(Skip::describe));
                st.last_batch = Some(fact);
                if !switch_events.is_empty() {
                    if let Some(r) = super::chunked::ensure_open_on_switch(ctx).await? {
                        result.snapshots_on_switch.push(r);
                        st = state::load(ctx).await?;
                        position = st.position().ok_or_else(|| StepError::Internal("the stream lost its position".into()))?;
                        result.position = Some(position);
                    }
                }
            }
            BatchOutcome::PurgedDuringRead { min_lsn } => match on_loss {
                // Nothing of the batch was committed; the guard at the top of
                // the loop finds the loss again and recovers.
                OnDataLoss::Resnapshot if result.recovery.is_none() => continue,
                OnDataLoss::Skip => return Err(skip_refused(ctx, &st, from.decrement(), from, min_lsn).await),
                _ => return Err(data_loss(ctx, from.decrement(), from, min_lsn).await),
            },
            // The read itself met error 313 because cleanup passed `from`
            // after the guard looked: nothing was read or committed, and the
            // guard, run again, finds the purge and takes the on_data_loss
            // path (recover, skip with its data_skipped row, or fail) as for
            // any purge it sees first. It cannot find `Read` again: the min
            // LSN only moves up, and it is already above `from`.
            BatchOutcome::ReadFoundPurged => continue,
        }
    }
    Ok(result)
}

/// How a batch ended.
enum BatchOutcome {
    Committed(FactRow),
    /// CDC cleanup passed the batch's first LSN while it read (fail and
    /// resnapshot modes): nothing was committed.
    PurgedDuringRead { min_lsn: Lsn },
    /// The read failed with error 313 and the instance's min LSN is now
    /// above the batch's first LSN: cleanup ran between the guard and the
    /// read. Nothing was read.
    ReadFoundPurged,
}

/// Error 313 from a change read: a purge when cleanup has since passed
/// `from` (the read's range was valid when the guard checked it), or else
/// the error itself (a range the guard should not have let through).
async fn range_refused(ctx: &Context, from: Lsn, err: SourceError) -> StepResult<BatchOutcome> {
    match ctx.source.min_lsn(&ctx.instance.name).await? {
        Some(min) if from < min => {
            tracing::warn!(from = %from, min_lsn = %min, "the change read met error 313: CDC cleanup passed the range after the guard checked it");
            Ok(BatchOutcome::ReadFoundPurged)
        }
        _ => Err(err.into()),
    }
}

/// The error for a purged next range, with the times that name the gap.
pub async fn data_loss(ctx: &Context, position: Lsn, next: Lsn, min_lsn: Lsn) -> StepError {
    let from_t = ctx.commit_time(position).await.ok().flatten();
    let to_t = ctx.commit_time(min_lsn).await.ok().flatten();
    let times = match (from_t, to_t) {
        (Some(a), Some(b)) => format!("; changes committed between {a} and {b} are gone"),
        (None, Some(b)) => format!("; changes committed before {b} are gone"),
        _ => String::new(),
    };
    StepError::DataLoss {
        capture_instance: ctx.instance.name.clone(),
        position,
        next,
        min_lsn,
        times,
        advice: match ctx.workflow.stream.on_data_loss {
            OnDataLoss::Fail => "Set stream.on_data_loss = \"resnapshot\" to recover with a new snapshot in a new generation \
                                 (or \"skip\" to go on past the gap), take a new snapshot into a new target, or raise the \
                                 CDC retention (sys.sp_cdc_change_job @retention) so the stream keeps up."
                .into(),
            _ => "CDC cleanup passed the stream again right after a recovery: call the step again (its anti-loop guard \
                  decides), and raise the CDC retention or run the stream more often."
                .into(),
        },
    }
}

/// The S of the generation's chunked snapshot while it is open (no
/// completion at or after S yet): the stream must not skip past a gap then.
pub fn open_chunked_snapshot(st: &StreamState) -> Option<Lsn> {
    st.chunked_start.filter(|s| !st.snapshot.is_some_and(|c| c >= *s))
}

/// The error for a skip refused while a chunked snapshot is open (see the
/// module docs): what was lost, why the skip would break the snapshot, and
/// the call that supersedes it.
async fn skip_refused(ctx: &Context, st: &StreamState, position: Lsn, next: Lsn, min_lsn: Lsn) -> StepError {
    let s = open_chunked_snapshot(st).map(|s| s.to_hex()).unwrap_or_default();
    let wf = ctx.workflow.path.display();
    let err = data_loss(ctx, position, next, min_lsn).await;
    match err {
        StepError::DataLoss { capture_instance, position, next, min_lsn, times, .. } => StepError::DataLoss {
            capture_instance,
            position,
            next,
            min_lsn,
            times,
            advice: format!(
                "stream.on_data_loss = \"skip\" was not applied, and nothing was written: the chunked snapshot opened at {s} \
                 (generation {}) is still being read, and its chunks are only right with every change after {s} in bronze. \
                 Skipping the gap would let backfill complete it over the lost changes. Set stream.on_data_loss = \"resnapshot\" \
                 and call `mssql-cdc --workflow {wf} stream` (add --resnapshot-interval-days 0 if its anti-loop guard stops \
                 it): it opens a new chunked snapshot in generation {} that supersedes this one, then `backfill` reads it; \
                 \"skip\" may be set again once that snapshot is complete.",
                st.generation,
                st.generation + 1
            ),
        },
        other => other,
    }
}

/// Records where a stream without a bootstrap starts, so later calls start there too.
async fn record_start(ctx: &mut Context, st: &StreamState) -> StepResult<()> {
    let start = match ctx.workflow.stream.start.as_str() {
        "latest" => ctx.source.max_lsn().await?.ok_or_else(|| {
            StepError::Temporary("the capture job has not recorded any LSN yet (max LSN is NULL): call again once it has run".into())
        })?,
        "earliest" => {
            let min = ctx.source.min_lsn(&ctx.instance.name).await?.ok_or_else(|| {
                StepError::Temporary(format!("capture instance '{}' has no minimum LSN yet: call again once capture has run", ctx.instance.name))
            })?;
            min.decrement()
        }
        lsn => Lsn::parse(lsn).map_err(|e| StepError::Config(e.to_string()))?,
    };
    let row = FactRow {
        app_id: ctx.workflow.app_id.clone(),
        table: ctx.workflow.table_name().to_string(),
        target: ctx.workflow.target.bronze.clone(),
        generation: st.generation,
        event: Some(EVENT_STREAM_START.into()),
        capture_instance: Some(ctx.instance.name.clone()),
        min_lsn: Some(start),
        max_lsn: Some(start),
        rows: Some(0),
        detail: Some(json!({"start": ctx.workflow.stream.start})),
        recorded_at: Some(chrono::Utc::now()),
        ..Default::default()
    };
    let txn = Txn::new(format!("{}#start", st.generation_app_id), 0);
    append_facts(ctx, vec![row], &txn).await?;
    failpoint!("stream.after_start");
    Ok(())
}

/// Reads, commits and records one micro-batch.
async fn run_batch(
    ctx: &mut Context,
    st: &StreamState,
    batch_id: i64,
    from: Lsn,
    to_max: Lsn,
    source_max: Option<Lsn>,
    skips: &mut Vec<Skip>,
    events: &[FactRow],
) -> StepResult<BatchOutcome> {
    let started = Instant::now();
    let limit = ctx.workflow.stream.max_batch_rows;
    let filter = ctx.row_filter();
    let bronze_schema = ctx.bronze_schema()?;
    let mut stream = match ctx.source.changes(&ctx.instance, from, to_max, filter, limit.min(8_192)).await {
        Ok(s) => s,
        Err(e @ SourceError::RangeUnavailable { .. }) => return range_refused(ctx, from, e).await,
        Err(e) => return Err(e.into()),
    };
    let mut order = super::change_order::OrderCheck::new(&ctx.instance);
    // The rows go to data files as they arrive, not to memory: a batch must
    // end on a transaction boundary, so one transaction of millions of rows
    // is one batch however small `max_batch_rows` is, and holding it whole
    // would take memory in proportion to it. The files become bronze's only
    // through the commit below (with the batch's txn); an attempt that stops
    // before it leaves orphans that Delta's VACUUM removes.
    let label = ctx.bronze.table_url().to_string();
    // The writer takes the schema the rows are converted to (`bronze_schema`,
    // read from the same table state), not a newer one: a concurrent call
    // may add a column meanwhile (bronze gaining a newer instance's columns),
    // and rows without it would not match a writer that has it. Files
    // without the column are valid Delta data (it reads as NULL there); the
    // commit below is made on the table's newest state.
    let mut writer = delta::streaming_writer(&ctx.bronze)?;
    let mut rows = 0usize;
    let mut cut_at: Option<Lsn> = None; // the LSN the batch ends at when it stops before to_max
    while let Some(batch) = stream.next().await {
        let batch = match batch {
            Ok(b) => b,
            Err(e @ SourceError::RangeUnavailable { .. }) => {
                drop(stream);
                return range_refused(ctx, from, e).await;
            }
            Err(e) => return Err(e.into()),
        };
        if batch.num_rows() == 0 {
            continue;
        }
        order.check(&batch)?;
        let lsns = batch
            .column_by_name(CHANGE_START_LSN)
            .and_then(|a| a.as_any().downcast_ref::<FixedSizeBinaryArray>().cloned())
            .ok_or_else(|| StepError::Internal("change batch without __$start_lsn".into()))?;
        let take = match cut_at {
            // Past the row limit: keep only the rest of the last transaction.
            Some(last) => (0..lsns.len()).take_while(|&i| lsn_at(&lsns, i) == last).count(),
            None => batch.num_rows(),
        };
        if take > 0 {
            let piece = batch.slice(0, take);
            let piece = bronze::from_changes(&piece, &bronze_schema, &ctx.zone, batch_id, &ctx.instance.name)?;
            writer.write(piece).await.map_err(StepError::delta(&label))?;
            rows += take;
        }
        if cut_at.is_some() && take < batch.num_rows() {
            break;
        }
        if cut_at.is_none() && rows >= limit {
            cut_at = Some(lsn_at(&lsns, lsns.len() - 1));
        }
    }
    drop(stream);
    let adds = writer.flush().await.map_err(StepError::delta(&label))?;
    tracing::debug!(batch_id, rows, files = adds.len(), from = %from, "batch read");
    // Only a race test arms this (a sleep): two calls then hold the same batch id.
    failpoint!("stream.after_read");
    // Cleanup may have run during the read: rows of the range could be gone.
    if let Some(min) = ctx.source.min_lsn(&ctx.instance.name).await? {
        if from < min {
            if ctx.workflow.stream.on_data_loss != OnDataLoss::Skip || open_chunked_snapshot(st).is_some() {
                return Ok(BatchOutcome::PurgedDuringRead { min_lsn: min });
            }
            tracing::warn!(from = %from, min_lsn = %min, "CDC cleanup ran during the read: rows of the range may be missing; recording a possible loss");
            skips.push(Skip {
                from,
                to: min,
                certain: false,
                reason: "CDC cleanup passed the range's first LSN during the read: some of its rows may be missing".into(),
                lost_from_ts: super::recover::position_time(ctx, st, from.decrement()).await?,
                lost_to_ts: ctx.commit_time(min).await?,
            });
        }
    }
    let to = cut_at.unwrap_or(to_max);
    let mut meta = json!({
        "kind": "batch",
        "batch_id": batch_id,
        "generation": st.generation,
        "from_lsn": from,
        "to_lsn": to,
        "rows": rows,
        "capture_instance": ctx.instance.name,
        "source_max_lsn": source_max,
    });
    if !skips.is_empty() {
        meta["skipped"] = json!(skips);
    }
    if !events.is_empty() {
        meta["events"] = json!(events);
    }
    // Bronze's txn decides the batch, an empty one too (a commit of the txn
    // and the metadata only): see the module docs.
    let txn = Txn::new(st.generation_app_id.clone(), batch_id);
    if rows > 0 && adds.is_empty() {
        return Err(StepError::Internal(format!("batch {batch_id} read {rows} rows but bronze wrote no file of them")));
    }
    // With no rows this commits the txn and the metadata only (see the module docs).
    let appended = delta::commit_adds(&mut ctx.bronze, adds, &txn, meta).await?;
    let bronze_version = match appended {
        Appended::Committed { table_version } => table_version,
        Appended::Empty => return Err(StepError::Internal(format!("batch {batch_id} read {rows} rows but bronze wrote none of them"))),
        Appended::AlreadyApplied { .. } => {
            // Another call won batch N: its outcome stands, and the next call
            // records it (from bronze's commit) and reads on from its end.
            return Err(StepError::Temporary(format!(
                "batch {batch_id} of {} was committed by another writer meanwhile: call again",
                st.generation_app_id
            )));
        }
    };
    failpoint!("stream.after_bronze");
    let min_now = ctx.source.min_lsn(&ctx.instance.name).await?;
    let commit_ts = ctx.commit_time(to).await?;
    let watermark = match min_now {
        Some(m) => ctx.commit_time(m).await?,
        None => None,
    };
    let row = FactRow {
        app_id: ctx.workflow.app_id.clone(),
        table: ctx.workflow.table_name().to_string(),
        target: ctx.workflow.target.bronze.clone(),
        generation: st.generation,
        batch_id: Some(batch_id),
        capture_instance: Some(ctx.instance.name.clone()),
        min_lsn: Some(from),
        max_lsn: Some(to),
        rows: Some(rows as i64),
        duration_ms: Some(started.elapsed().as_millis() as i64),
        commit_ts,
        source_max_lsn: source_max,
        retention_watermark_ts: watermark,
        headroom_seconds: super::headroom::seconds_between(commit_ts, watermark),
        bronze_version: Some(bronze_version),
        recorded_at: Some(chrono::Utc::now()),
        ..Default::default()
    };
    // The gap rows go in the batch's own facts commit: a replayed batch
    // (same txn) writes them once, and a batch that never commits leaves none.
    let mut rows_out = vec![row.clone()];
    rows_out.extend(skips.iter().map(|k| k.fact_row(ctx, st.generation, batch_id)));
    rows_out.extend(events.iter().cloned().map(|mut e| {
        e.batch_id = Some(batch_id);
        e
    }));
    let facts_txn = Txn::new(format!("{}#facts", st.generation_app_id), batch_id);
    if let Appended::AlreadyApplied { .. } = append_facts(ctx, rows_out, &facts_txn).await? {
        // A concurrent call repaired the row from our bronze commit: the same outcome, unless something else wrote it.
        check_recorded_batch(ctx, st, &row, "this call's bronze commit").await?;
    }
    failpoint!("stream.after_facts");
    tracing::info!(batch_id, rows, from = %from, to = %to, "batch committed");
    Ok(BatchOutcome::Committed(row))
}

fn lsn_at(a: &FixedSizeBinaryArray, i: usize) -> Lsn {
    let mut b = [0u8; 10];
    b.copy_from_slice(a.value(i));
    Lsn(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }

    #[test]
    fn caught_up_when_nothing_new() {
        assert_eq!(decide(l(10), Some(l(10)), Some(l(5))), BatchDecision::CaughtUp);
        assert_eq!(decide(l(10), None, None), BatchDecision::CaughtUp);
        // Nothing to read: even a min LSN past the position is no loss yet.
        assert_eq!(decide(l(10), Some(l(10)), Some(l(50))), BatchDecision::CaughtUp);
    }

    #[test]
    fn reads_from_the_next_lsn() {
        assert_eq!(decide(l(10), Some(l(20)), Some(l(5))), BatchDecision::Read { from: l(11), to_max: l(20) });
        // min LSN exactly at the next LSN is fine; NULL min LSN (new instance) too.
        assert_eq!(decide(l(10), Some(l(20)), Some(l(11))), BatchDecision::Read { from: l(11), to_max: l(20) });
        assert_eq!(decide(l(10), Some(l(20)), None), BatchDecision::Read { from: l(11), to_max: l(20) });
    }

    #[test]
    fn purged_when_next_is_below_min() {
        assert_eq!(decide(l(10), Some(l(20)), Some(l(12))), BatchDecision::Purged { next: l(11), min_lsn: l(12) });
    }
}
