//! The stream's workflow as a state machine: one state derived from the
//! Delta tables ([`MachineState::derive`], pure), one pure function that
//! names the transition to run next ([`next`]), and the table of every
//! transition the machine allows ([`EDGES`]), from which `mssql-cdc machine`
//! draws the diagram.
//!
//! Two lanes run at once on one stream (adr-0028): the stream lane commits
//! micro-batches from the position on, and the snapshot lane reads a chunked
//! snapshot's waves beside it. A chunked open starts both: the stream at S,
//! the waves from the table. So [`next`] answers per lane, and `status`
//! prints both answers.
//!
//! The state and the decision are the rules the steps apply, read back from
//! the same facts rows (`engine::state`, `engine::rules`, `engine::recover`).
//! The coarse `stream` is a loop over [`next_in_call`] (the stream lane's
//! [`next`] bounded by the call's limits), running each transition through
//! `stream::run_transitions`, exactly as `step` runs one. Architecture invariant: a transition [`next`] names is
//! always an edge of [`EDGES`] from the state's [`MachineState::label`]
//! (unit-tested over the states below), so the diagram is the machine's.

use serde::Serialize;

use super::chunked::{self, Mode, EVENT_SNAPSHOT_PLAN};
use super::state::StreamState;
use crate::delta::facts::FactRow;
use crate::lsn::Lsn;
use crate::workflow::{OnDataLoss, SnapshotMode};

/// Where one stream stands, from its facts rows and bronze's txn version.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MachineState {
    pub generation: i32,
    /// The stream lane: not started, or at a position with the next batch id.
    pub stream: StreamPhase,
    /// The snapshot that holds the snapshot mode, if one does.
    pub snapshot: Option<SnapshotState>,
    /// The generation a recorded recovery opens, while its re-snapshot has
    /// not made it live yet.
    pub recovery_pending: Option<i32>,
    /// A batch bronze holds without its facts row (a crash between the two
    /// commits): repaired before anything else.
    pub batch_to_repair: Option<i64>,
    /// Older generations whose bronze holds batches without facts rows (a
    /// call cut after a reseed or a recovery): repaired as well.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub older_generations_to_repair: Vec<i32>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum StreamPhase {
    NotStarted,
    At { position: Lsn, next_batch_id: i64 },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SnapshotState {
    pub s: Lsn,
    pub generation: i32,
    /// "full" or "chunked".
    pub mode: &'static str,
    pub phase: SnapshotPhase,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum SnapshotPhase {
    /// A full snapshot being read by the call that opened it.
    Reading,
    /// A chunked snapshot opened at S, not planned yet.
    Opened,
    /// Planned into `chunks` chunks, `done` of them recorded, the newest wave `last_wave`.
    Waves { chunks: i64, done: i64, last_wave: Option<i64> },
}

impl MachineState {
    /// Derives the state (pure): `rows` are the app id's facts rows,
    /// `bronze_batch` bronze's txn version for the generation's app id, and
    /// `min_lsn` the capture instance's (a full open cleanup has passed holds
    /// nothing; None counts none as passed), as `engine::state::load` reads them.
    pub fn derive(app_id: &str, rows: &[FactRow], bronze_batch: Option<i64>, min_lsn: Option<Lsn>) -> MachineState {
        let st = StreamState::derive_with_cleanup(app_id, rows, bronze_batch, min_lsn);
        Self::from_stream_state(&st, rows, min_lsn)
    }

    /// The state from an already derived [`StreamState`] and the same rows.
    pub fn from_stream_state(st: &StreamState, rows: &[FactRow], min_lsn: Option<Lsn>) -> MachineState {
        let stream = match st.position() {
            None => StreamPhase::NotStarted,
            Some(position) => StreamPhase::At { position, next_batch_id: st.next_batch_id() },
        };
        let snapshot = chunked::snapshot_holding_mode(rows, min_lsn).map(|o| {
            let phase = match o.mode {
                Mode::Full => SnapshotPhase::Reading,
                Mode::Chunked => match planned_chunks(rows, o.s) {
                    None => SnapshotPhase::Opened,
                    Some(chunks) => {
                        let p = chunked::progress(rows, o.s);
                        SnapshotPhase::Waves { chunks, done: p.done.len() as i64, last_wave: p.last_wave }
                    }
                },
            };
            SnapshotState { s: o.s, generation: o.generation, mode: if o.mode == Mode::Full { "full" } else { "chunked" }, phase }
        });
        let recovery_pending = super::recover::recovery_row(rows, st.generation + 1).map(|_| st.generation + 1);
        MachineState {
            generation: st.generation,
            stream,
            snapshot,
            recovery_pending,
            batch_to_repair: st.batch_to_repair(),
            older_generations_to_repair: st.older_batches_to_repair.iter().map(|o| o.generation).collect(),
        }
    }

    /// The state's name in the diagram ([`EDGES`]).
    pub fn label(&self) -> State {
        if self.batch_to_repair.is_some() || !self.older_generations_to_repair.is_empty() {
            return State::HalfRecorded;
        }
        if self.recovery_pending.is_some() {
            return State::Recovering;
        }
        match (&self.stream, &self.snapshot) {
            (StreamPhase::NotStarted, Some(SnapshotState { phase: SnapshotPhase::Reading, .. })) => State::FullReading,
            (StreamPhase::NotStarted, _) => State::NotStarted,
            // A full open beside a running stream holds only the snapshot
            // mode: the stream's state is its own.
            (StreamPhase::At { .. }, Some(SnapshotState { phase: SnapshotPhase::Reading, .. })) => State::Streaming,
            (StreamPhase::At { .. }, Some(SnapshotState { phase: SnapshotPhase::Opened, .. })) => State::ChunkedOpened,
            (StreamPhase::At { .. }, Some(SnapshotState { phase: SnapshotPhase::Waves { chunks, done, .. }, .. })) if done >= chunks => {
                State::ChunksRead
            }
            (StreamPhase::At { .. }, Some(SnapshotState { phase: SnapshotPhase::Waves { .. }, .. })) => State::ChunkedPlanned,
            (StreamPhase::At { .. }, None) => State::Streaming,
        }
    }
}

/// The chunk count of snapshot `s`'s plan, when its `snapshot_plan` row is recorded.
fn planned_chunks(rows: &[FactRow], s: Lsn) -> Option<i64> {
    let hex = s.to_hex();
    rows.iter()
        .filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_PLAN))
        .filter_map(|r| r.detail.as_ref())
        .filter(|d| d.get("snapshot").and_then(serde_json::Value::as_str) == Some(hex.as_str()))
        .find_map(|d| d.get("chunk_count").and_then(serde_json::Value::as_i64))
}

/// The states of the diagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    NotStarted,
    FullReading,
    ChunkedOpened,
    ChunkedPlanned,
    ChunksRead,
    Streaming,
    Recovering,
    HalfRecorded,
}

impl State {
    pub const ALL: [State; 8] =
        [State::NotStarted, State::FullReading, State::ChunkedOpened, State::ChunkedPlanned, State::ChunksRead, State::Streaming, State::Recovering, State::HalfRecorded];

    pub fn name(self) -> &'static str {
        match self {
            State::NotStarted => "NotStarted",
            State::FullReading => "FullReading",
            State::ChunkedOpened => "ChunkedOpened",
            State::ChunkedPlanned => "ChunkedPlanned",
            State::ChunksRead => "ChunksRead",
            State::Streaming => "Streaming",
            State::Recovering => "Recovering",
            State::HalfRecorded => "HalfRecorded",
        }
    }
}

/// The transitions, each one step's commits (docs/ARCHITECTURE.md's txn tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Transition {
    /// Record the facts row of a batch bronze holds without it.
    Repair,
    /// Record where a stream without a bootstrap starts.
    Start,
    /// Open a snapshot: a chunked one at S (the stream starts there), or a
    /// full one, read and completed by the same call.
    Open,
    /// Fix a chunked snapshot's chunks.
    Plan,
    /// Read and commit one wave of chunks.
    Wave,
    /// Record a chunked snapshot's completion once every chunk is read.
    Complete,
    /// Read and commit one micro-batch (with a `data_skipped` row under
    /// `on_data_loss = "skip"`).
    Commit,
    /// Record a data loss and the generation that replaces it.
    Recover,
    /// Take the re-snapshot of a recorded recovery.
    Resnapshot,
    /// Nothing to do now; the reason says why (or what a person must do).
    Idle,
}

impl Transition {
    pub const ALL: [Transition; 10] = [
        Transition::Repair,
        Transition::Start,
        Transition::Open,
        Transition::Plan,
        Transition::Wave,
        Transition::Complete,
        Transition::Commit,
        Transition::Recover,
        Transition::Resnapshot,
        Transition::Idle,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Transition::Repair => "repair",
            Transition::Start => "start",
            Transition::Open => "open",
            Transition::Plan => "plan",
            Transition::Wave => "wave",
            Transition::Complete => "complete",
            Transition::Commit => "commit",
            Transition::Recover => "recover",
            Transition::Resnapshot => "resnapshot",
            Transition::Idle => "idle",
        }
    }
}

/// Every transition the machine allows: (from, transition, to). A
/// transition may lead to more than one state (a wave to more waves or to
/// all chunks read); each is an edge.
pub const EDGES: &[(State, Transition, State)] = &[
    (State::HalfRecorded, Transition::Repair, State::Streaming),
    (State::NotStarted, Transition::Start, State::Streaming),
    (State::NotStarted, Transition::Open, State::ChunkedOpened),
    (State::NotStarted, Transition::Open, State::FullReading),
    (State::FullReading, Transition::Open, State::Streaming),
    (State::FullReading, Transition::Idle, State::FullReading),
    (State::FullReading, Transition::Start, State::Streaming),
    (State::ChunkedOpened, Transition::Plan, State::ChunkedPlanned),
    (State::ChunkedOpened, Transition::Commit, State::ChunkedOpened),
    (State::ChunkedPlanned, Transition::Wave, State::ChunkedPlanned),
    (State::ChunkedPlanned, Transition::Wave, State::ChunksRead),
    (State::ChunkedPlanned, Transition::Commit, State::ChunkedPlanned),
    (State::ChunksRead, Transition::Complete, State::Streaming),
    (State::ChunksRead, Transition::Commit, State::ChunksRead),
    (State::Streaming, Transition::Commit, State::Streaming),
    (State::Streaming, Transition::Idle, State::Streaming),
    (State::Streaming, Transition::Recover, State::Recovering),
    (State::ChunkedOpened, Transition::Recover, State::Recovering),
    (State::ChunkedPlanned, Transition::Recover, State::Recovering),
    (State::ChunksRead, Transition::Recover, State::Recovering),
    (State::Streaming, Transition::Open, State::ChunkedOpened),
    (State::ChunkedOpened, Transition::Idle, State::ChunkedOpened),
    (State::ChunkedPlanned, Transition::Idle, State::ChunkedPlanned),
    (State::ChunksRead, Transition::Idle, State::ChunksRead),
    (State::Recovering, Transition::Resnapshot, State::Streaming),
    (State::Recovering, Transition::Resnapshot, State::ChunkedOpened),
    (State::NotStarted, Transition::Idle, State::NotStarted),
];

/// The lane a caller drives: `stream` the stream's, `backfill` the snapshot's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    Stream,
    Snapshot,
}

/// What [`next`] looks at besides the state: the source's bounds (the
/// capture instance's min LSN, the max LSN) and the workflow's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Inputs {
    pub min_lsn: Option<Lsn>,
    pub max_lsn: Option<Lsn>,
    pub bootstrap: bool,
    pub mode: SnapshotMode,
    pub on_data_loss: OnDataLoss,
}

/// The transition to run next in `lane`, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Next {
    pub transition: Transition,
    pub reason: String,
}

fn go(transition: Transition, reason: impl Into<String>) -> Next {
    Next { transition, reason: reason.into() }
}

/// The machine's decision (pure), in the order the steps check: a half
/// recorded commit first, then how the stream starts, a recorded recovery,
/// then the lane's own work.
pub fn next(state: &MachineState, inputs: &Inputs, lane: Lane) -> Next {
    if let Some(b) = state.batch_to_repair {
        return go(Transition::Repair, format!("bronze holds batch {b} without its facts row"));
    }
    if let Some(g) = state.older_generations_to_repair.first() {
        return go(Transition::Repair, format!("bronze holds a batch of older generation {g} without its facts row"));
    }
    if state.recovery_pending.is_some() {
        return go(Transition::Resnapshot, format!("a recovery into generation {} is recorded; its re-snapshot is not live yet", state.generation + 1));
    }
    if let Some(SnapshotState { phase: SnapshotPhase::Reading, s, .. }) = &state.snapshot {
        match (lane, &state.stream) {
            // Nothing tells a dead full run from a slow one, and a bootstrap's
            // open may always run again: its one bronze commit (`<app>#snapshot`
            // of the generation) lets one run complete it, and a run cut after
            // that commit is completed from it. So a stream not started opens.
            (Lane::Stream, StreamPhase::NotStarted) if inputs.bootstrap => {
                return go(Transition::Open, format!("a full snapshot at {s} is open without its completion: the open takes it (again, if the run that opened it is gone)"))
            }
            // A stream that starts without a bootstrap, or runs already, is not
            // held by a full open: its start and its batches go on (the open
            // holds only the snapshot mode, until cleanup passes its S).
            (Lane::Stream, _) => {}
            (Lane::Snapshot, _) => {
                return go(Transition::Idle, format!("a full snapshot at {s} is being read by the call that opened it (or holds the mode until cleanup passes it)"))
            }
        }
    }
    match lane {
        Lane::Stream => match &state.stream {
            StreamPhase::NotStarted if !inputs.bootstrap => go(Transition::Start, "no bootstrap: the stream starts where stream.start says"),
            StreamPhase::NotStarted if inputs.max_lsn.is_none() => go(Transition::Idle, "the capture job has recorded no LSN yet"),
            StreamPhase::NotStarted => go(Transition::Open, format!("bootstrap: a {} snapshot starts generation 0", mode_name(inputs.mode))),
            StreamPhase::At { position, next_batch_id } => match inputs.max_lsn {
                None => go(Transition::Idle, "the capture job has recorded no LSN yet"),
                Some(max) if super::snapshot::is_purged_after(*position, inputs.min_lsn, inputs.max_lsn) => match inputs.on_data_loss {
                    OnDataLoss::Fail => go(Transition::Idle, format!("data loss after {position}: on_data_loss = \"fail\" needs a person (exit 3)")),
                    OnDataLoss::Resnapshot => go(Transition::Recover, format!("the changes after {position} are purged: recover into generation {}", state.generation + 1)),
                    OnDataLoss::Skip => go(Transition::Commit, format!("batch {next_batch_id} skips the purged range after {position} up to {max}")),
                },
                Some(max) if max > *position => go(Transition::Commit, format!("batch {next_batch_id} reads ({position}, {max}]")),
                Some(_) => go(Transition::Idle, format!("caught up at {position}")),
            },
        },
        Lane::Snapshot => match &state.snapshot {
            None if matches!(state.stream, StreamPhase::NotStarted) && inputs.bootstrap && inputs.mode == SnapshotMode::Chunked => {
                go(Transition::Open, "bootstrap: a chunked snapshot starts generation 0")
            }
            None => go(Transition::Idle, "no chunked snapshot is open"),
            Some(SnapshotState { phase: SnapshotPhase::Opened, s, .. }) => go(Transition::Plan, format!("the chunked snapshot at {s} has no plan yet")),
            Some(SnapshotState { phase: SnapshotPhase::Waves { chunks, done, last_wave }, s, .. }) if done < chunks => go(
                Transition::Wave,
                format!("wave {} of the snapshot at {s}: {done} of {chunks} chunks recorded", last_wave.map_or(0, |w| w + 1)),
            ),
            Some(SnapshotState { s, .. }) => go(Transition::Complete, format!("every chunk of the snapshot at {s} is recorded")),
        },
    }
}

/// What one coarse `stream` call has done so far, against its limits: the
/// call reads up to the max LSN it found when it started (a writer that
/// never pauses cannot keep one call running), commits at most
/// `stream.max_batches` batches, and makes at most one recovery.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallLimits {
    /// The source's max LSN when the call started (or when its recovery's
    /// snapshot made the new generation live: the snapshot stands at or past
    /// the first one).
    pub max_lsn: Option<Lsn>,
    /// Batches the call may still commit.
    pub batches_left: u32,
    /// The call has made its recovery.
    pub recovered: bool,
}

/// The coarse `stream`'s decision for its next turn ([`next_in_call`]).
#[derive(Debug, Clone, PartialEq)]
pub enum CallNext {
    /// Run this transition of the stream lane.
    Run(Transition),
    /// End the call: `caught_up` when the position reached the call's max
    /// LSN, else the call stopped at a limit with more to do (call again).
    Stop { caught_up: bool, reason: String },
    /// The changes after `position` are purged and the workflow says fail
    /// (or the call has made its one recovery already): exit 3.
    DataLoss { position: Lsn, next: Lsn, min_lsn: Lsn },
}

/// The coarse `stream` as a loop over [`next`] (pure): the stream lane's
/// transition, bounded by the call's limits. `stream` calls it after each
/// transition, on the state read again, until it says stop.
pub fn next_in_call(state: &MachineState, inputs: &Inputs, limits: &CallLimits) -> CallNext {
    let n = next(state, inputs, Lane::Stream);
    let purged = |position: Lsn| match inputs.min_lsn {
        Some(min_lsn) if super::rules::is_purged_after(position, inputs.min_lsn, inputs.max_lsn) => {
            Some(CallNext::DataLoss { position, next: position.increment(), min_lsn })
        }
        _ => None,
    };
    match (n.transition, &state.stream) {
        (Transition::Commit, StreamPhase::At { position, .. }) => {
            if limits.max_lsn.is_none_or(|m| *position >= m) && !super::rules::is_purged_after(*position, inputs.min_lsn, inputs.max_lsn) {
                CallNext::Stop { caught_up: true, reason: format!("caught up at {position}, the max LSN the call started with") }
            } else if limits.batches_left == 0 {
                CallNext::Stop { caught_up: false, reason: "the call committed stream.max_batches batches: call again".into() }
            } else {
                CallNext::Run(Transition::Commit)
            }
        }
        (Transition::Recover, StreamPhase::At { position, .. }) if limits.recovered => {
            // One recovery a call: a second loss right after one means
            // cleanup outruns the stream; a person decides.
            purged(*position).unwrap_or(CallNext::Stop { caught_up: false, reason: n.reason })
        }
        // The stream has not started and nothing can start it now (nothing
        // captured yet): the start's own step says so, as a call of it would.
        (Transition::Idle, StreamPhase::NotStarted) => CallNext::Run(Transition::Start),
        (Transition::Idle, StreamPhase::At { position, .. }) => match inputs.on_data_loss {
            OnDataLoss::Fail => purged(*position).unwrap_or(CallNext::Stop { caught_up: true, reason: n.reason }),
            _ => CallNext::Stop { caught_up: true, reason: n.reason },
        },
        (t, _) => CallNext::Run(t),
    }
}

fn mode_name(mode: SnapshotMode) -> &'static str {
    if mode == SnapshotMode::Chunked {
        "chunked"
    } else {
        "full"
    }
}

/// The diagram of [`EDGES`] in Mermaid's `stateDiagram-v2`.
pub fn mermaid() -> String {
    let mut out = String::from("stateDiagram-v2\n    [*] --> NotStarted\n");
    for (from, t, to) in EDGES {
        out.push_str(&format!("    {} --> {}: {}\n", from.name(), to.name(), t.name()));
    }
    out
}

/// The diagram of [`EDGES`] in Graphviz's dot.
pub fn dot() -> String {
    let mut out = String::from("digraph machine {\n    rankdir=LR;\n    start [shape=point];\n    start -> NotStarted;\n");
    for (from, t, to) in EDGES {
        out.push_str(&format!("    {} -> {} [label=\"{}\"];\n", from.name(), to.name(), t.name()));
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delta::facts::{EVENT_BOOTSTRAP, EVENT_RECOVERY, EVENT_SNAPSHOT_OPEN};
    use serde_json::json;

    fn l(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }

    fn row(generation: i32, event: Option<&str>, lsn: u128) -> FactRow {
        FactRow { app_id: "t".into(), generation, event: event.map(str::to_string), min_lsn: Some(l(lsn)), max_lsn: Some(l(lsn)), ..Default::default() }
    }

    fn batch(generation: i32, id: i64, from: u128, to: u128) -> FactRow {
        FactRow { app_id: "t".into(), generation, batch_id: Some(id), min_lsn: Some(l(from)), max_lsn: Some(l(to)), ..Default::default() }
    }

    fn open(s: u128) -> FactRow {
        let mut r = row(0, Some(EVENT_SNAPSHOT_OPEN), s);
        r.detail = Some(json!({"mode": "chunked", "kind": "bootstrap", "generation": 0}));
        r
    }

    fn plan(s: u128, chunks: i64) -> FactRow {
        let mut r = row(0, Some(EVENT_SNAPSHOT_PLAN), s);
        r.detail = Some(json!({"snapshot": l(s).to_hex(), "chunk_count": chunks}));
        r
    }

    fn chunk(s: u128, chunk: i64, wave: i64) -> FactRow {
        let mut r = row(0, Some(chunked::EVENT_SNAPSHOT_CHUNK), s);
        r.detail = Some(json!({"snapshot": l(s).to_hex(), "chunk": chunk, "wave": wave}));
        r.rows = Some(3);
        r
    }

    fn inputs(max: u128) -> Inputs {
        Inputs { min_lsn: Some(l(1)), max_lsn: Some(l(max)), bootstrap: true, mode: SnapshotMode::Chunked, on_data_loss: OnDataLoss::Resnapshot }
    }

    /// The states the tests walk through, each with its label.
    fn walk() -> Vec<(Vec<FactRow>, Option<i64>, State)> {
        let mut completed = vec![open(10), plan(10, 2), chunk(10, 0, 0), chunk(10, 1, 1), batch(0, 0, 11, 20)];
        let mut done = row(0, Some(EVENT_BOOTSTRAP), 10);
        done.detail = Some(json!({"mode": "chunked", "snapshot": l(10).to_hex()}));
        completed.push(done);
        let mut recovering = completed.clone();
        let mut rec = row(0, Some(EVENT_RECOVERY), 20);
        rec.detail = Some(json!({"target_generation": 1}));
        recovering.push(rec);
        let mut full_open = row(0, Some(EVENT_SNAPSHOT_OPEN), 10);
        full_open.detail = Some(json!({"mode": "full", "kind": "bootstrap", "generation": 0}));
        vec![
            (vec![], None, State::NotStarted),
            (vec![full_open], None, State::FullReading),
            (vec![open(10)], None, State::ChunkedOpened),
            (vec![open(10), plan(10, 2)], None, State::ChunkedPlanned),
            (vec![open(10), plan(10, 2), chunk(10, 0, 0)], None, State::ChunkedPlanned),
            (vec![open(10), plan(10, 2), chunk(10, 0, 0), chunk(10, 1, 1)], None, State::ChunksRead),
            (completed.clone(), None, State::Streaming),
            (completed, Some(1), State::HalfRecorded),
            (recovering, None, State::Recovering),
        ]
    }

    #[test]
    fn states_derive_from_the_facts() {
        for (rows, bronze, want) in walk() {
            let s = MachineState::derive("t", &rows, bronze, None);
            assert_eq!(s.label(), want, "{s:?}");
        }
        let s = MachineState::derive("t", &[open(10), plan(10, 2), chunk(10, 0, 0)], None, None);
        assert_eq!(s.snapshot.unwrap().phase, SnapshotPhase::Waves { chunks: 2, done: 1, last_wave: Some(0) });
    }

    fn streaming_at(position: u128) -> MachineState {
        let mut rows = vec![open(10), plan(10, 2), chunk(10, 0, 0), chunk(10, 1, 1), batch(0, 0, 11, position)];
        let mut done = row(0, Some(EVENT_BOOTSTRAP), 10);
        done.detail = Some(json!({"mode": "chunked", "snapshot": l(10).to_hex()}));
        rows.push(done);
        MachineState::derive("t", &rows, None, None)
    }

    /// The coarse `stream`'s loop: the stream lane's `next` while the call's
    /// max LSN, batch count and one recovery allow, and a data loss it may
    /// not recover from ends it with exit 3's decision.
    #[test]
    fn a_stream_call_runs_the_lanes_transitions_within_its_limits() {
        let limits = CallLimits { max_lsn: Some(l(40)), batches_left: 2, recovered: false };
        let at = streaming_at(20);
        assert_eq!(next_in_call(&at, &inputs(50), &limits), CallNext::Run(Transition::Commit));
        // Past the call's max (a writer that never pauses): caught up, though the source holds more.
        assert!(matches!(next_in_call(&streaming_at(40), &inputs(50), &limits), CallNext::Stop { caught_up: true, .. }));
        assert!(matches!(next_in_call(&streaming_at(50), &inputs(50), &limits), CallNext::Stop { caught_up: true, .. }));
        let spent = CallLimits { batches_left: 0, ..limits };
        assert!(matches!(next_in_call(&at, &inputs(50), &spent), CallNext::Stop { caught_up: false, .. }));
        // Purged after the position: recover once, then a second loss stops with exit 3.
        let purged = Inputs { min_lsn: Some(l(30)), ..inputs(50) };
        assert_eq!(next_in_call(&at, &purged, &limits), CallNext::Run(Transition::Recover));
        let recovered = CallLimits { recovered: true, ..limits };
        assert_eq!(next_in_call(&at, &purged, &recovered), CallNext::DataLoss { position: l(20), next: l(20).increment(), min_lsn: l(30) });
        let fail = Inputs { on_data_loss: OnDataLoss::Fail, ..purged.clone() };
        assert_eq!(next_in_call(&at, &fail, &limits), CallNext::DataLoss { position: l(20), next: l(20).increment(), min_lsn: l(30) });
        // A purge is read whatever the call's max: skip mode commits the skip.
        let skip = Inputs { on_data_loss: OnDataLoss::Skip, ..purged };
        assert_eq!(next_in_call(&at, &skip, &CallLimits { max_lsn: Some(l(20)), ..limits }), CallNext::Run(Transition::Commit));
        // Not started: the start runs even when nothing is captured yet (it says so itself).
        let none = MachineState::derive("t", &[], None, None);
        assert_eq!(next_in_call(&none, &inputs(50), &limits), CallNext::Run(Transition::Open));
        let nothing = Inputs { max_lsn: None, ..inputs(50) };
        assert_eq!(next_in_call(&none, &nothing, &limits), CallNext::Run(Transition::Start));
        // A half-recorded batch is repaired first, even with no batch left to commit.
        let half = MachineState::derive("t", &[batch(0, 0, 11, 20)], Some(1), None);
        assert_eq!(next_in_call(&half, &inputs(50), &spent), CallNext::Run(Transition::Repair));
    }

    /// The architecture invariant: whatever `next` names from a state is an
    /// edge of the table the diagram is drawn from.
    #[test]
    fn every_transition_next_names_is_an_edge_of_the_diagram() {
        let variants = [
            inputs(30),
            inputs(10),
            Inputs { max_lsn: None, ..inputs(30) },
            Inputs { bootstrap: false, ..inputs(30) },
            Inputs { mode: SnapshotMode::Full, ..inputs(30) },
            Inputs { min_lsn: Some(l(25)), ..inputs(30) },
            Inputs { min_lsn: Some(l(25)), on_data_loss: OnDataLoss::Skip, ..inputs(30) },
            Inputs { min_lsn: Some(l(25)), on_data_loss: OnDataLoss::Fail, ..inputs(30) },
        ];
        for (rows, bronze, _) in walk() {
            let s = MachineState::derive("t", &rows, bronze, None);
            for i in &variants {
                for lane in [Lane::Stream, Lane::Snapshot] {
                    let n = next(&s, i, lane);
                    assert!(
                        EDGES.iter().any(|(from, t, _)| *from == s.label() && *t == n.transition),
                        "{lane:?} from {:?}: next names {:?} ({}), which the diagram lacks",
                        s.label(),
                        n.transition,
                        n.reason
                    );
                }
            }
        }
    }

    #[test]
    fn every_state_and_transition_is_in_the_diagram() {
        for st in State::ALL {
            assert!(EDGES.iter().any(|(f, _, t)| *f == st || *t == st), "{st:?}");
        }
        for tr in Transition::ALL {
            assert!(EDGES.iter().any(|(_, t, _)| *t == tr), "{tr:?}");
        }
        let m = mermaid();
        assert!(m.starts_with("stateDiagram-v2\n") && m.contains("ChunkedPlanned --> ChunksRead: wave"), "{m}");
        assert!(dot().contains("Recovering -> ChunkedOpened [label=\"resnapshot\"];"));
    }

    /// docs/ARCHITECTURE.md embeds the diagram: it must be the code's.
    #[test]
    fn the_architecture_doc_embeds_this_diagram() {
        let doc = include_str!("../../docs/ARCHITECTURE.md");
        assert!(doc.contains(&format!("```mermaid\n{}```", mermaid())), "docs/ARCHITECTURE.md's diagram differs from `mssql-cdc machine --format mermaid`:\n{}", mermaid());
    }

    #[test]
    fn the_lanes_decide_as_the_steps_do() {
        let at = |rows: &[FactRow]| MachineState::derive("t", rows, None, None);
        // A chunked bootstrap: the stream lane opens, the snapshot lane too.
        assert_eq!(next(&at(&[]), &inputs(30), Lane::Stream).transition, Transition::Open);
        assert_eq!(next(&at(&[]), &inputs(30), Lane::Snapshot).transition, Transition::Open);
        // Opened: the stream reads from S, the snapshot lane plans.
        assert_eq!(next(&at(&[open(10)]), &inputs(30), Lane::Stream).transition, Transition::Commit);
        assert_eq!(next(&at(&[open(10)]), &inputs(30), Lane::Snapshot).transition, Transition::Plan);
        // Caught up; a purged range by on_data_loss.
        let s = at(&[open(10), batch(0, 0, 11, 30)]);
        assert_eq!(next(&s, &inputs(30), Lane::Stream).transition, Transition::Idle);
        assert_eq!(next(&s, &Inputs { min_lsn: Some(l(35)), ..inputs(40) }, Lane::Stream).transition, Transition::Recover);
        // A full bootstrap cut before its completion: the stream lane opens
        // it again (a run still reading races it for the one bronze commit).
        let mut full_open = row(0, Some(EVENT_SNAPSHOT_OPEN), 10);
        full_open.detail = Some(json!({"mode": "full", "kind": "bootstrap", "generation": 0}));
        let full = Inputs { mode: SnapshotMode::Full, ..inputs(30) };
        assert_eq!(at(&[full_open.clone()]).label(), State::FullReading);
        assert_eq!(next(&at(&[full_open.clone()]), &full, Lane::Stream).transition, Transition::Open);
        assert_eq!(next(&at(&[full_open.clone()]), &full, Lane::Snapshot).transition, Transition::Idle);
        // A dead full open (its run crashed) that cleanup has not passed yet
        // does not hold the stream: without a bootstrap it starts, and once
        // started it streams (the label is the stream's own).
        let no_boot_full = Inputs { bootstrap: false, ..full.clone() };
        assert_eq!(next(&at(&[full_open.clone()]), &no_boot_full, Lane::Stream).transition, Transition::Start);
        let mut started = row(0, Some(crate::engine::state::EVENT_STREAM_START), 20);
        started.detail = Some(json!({}));
        let running = at(&[full_open.clone(), started]);
        assert_eq!(running.label(), State::Streaming);
        assert_eq!(next(&running, &no_boot_full, Lane::Stream).transition, Transition::Commit);
        assert_eq!(next(&running, &no_boot_full, Lane::Snapshot).transition, Transition::Idle);
        // No bootstrap: a start; the snapshot lane has nothing.
        let no_boot = Inputs { bootstrap: false, ..inputs(30) };
        assert_eq!(next(&at(&[]), &no_boot, Lane::Stream).transition, Transition::Start);
        assert_eq!(next(&at(&[]), &no_boot, Lane::Snapshot).transition, Transition::Idle);
    }
}
