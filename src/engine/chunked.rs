//! Chunked snapshots read next to the running stream (adr-0028).
//!
//! A table too large to read within the CDC retention is not read before the
//! stream starts. The open records S (max LSN) and the key's extent and starts
//! the stream generation at S at once, reading nothing; the stream then keeps
//! every change after S in bronze without a gap. The `backfill` step, called
//! again until done, reads the table in chunks beside it. Each chunk only
//! needs a stamp L >= S read before its SELECT: the rebuild rule (latest row
//! per key over the snapshot's rows and the changes after S) makes a chunk
//! row that is newer than its stamp harmless, because the change that made it
//! newer is in bronze too and ranks at or above it.
//!
//! Effects, each a commit with its own txn, each followed by a failpoint:
//!
//! | effect                         | table  | txn app id                 | version    |
//! |--------------------------------|--------|----------------------------|------------|
//! | open: key extent               | plans  | `<app>#snapopen.<S>`       | 0          |
//! | open: `snapshot_open` row      | facts  | `<app>#snapshots`          | generation |
//! | plan: every chunk's bounds     | plans  | `<app>#snapplan.<S>`       | 0          |
//! | plan: `snapshot_plan` row      | facts  | `<app>#snapplan.<S>`       | 0          |
//! | wave w: the chunks' rows       | bronze | `<app>#snap.<S>`           | w          |
//! | wave w: chunk bounds and stamps| plans  | `<app>#snapchunks.<S>`     | w          |
//! | wave w: `snapshot_chunk` rows  | facts  | `<app>#snapchunks.<S>`     | w          |
//! | completion: `bootstrap` row    | facts  | `<app>#events`             | generation |
//!
//! A snapshot opened after a capture-instance switch (`engine::switch`,
//! adr-0028 Amendment 5) keys its facts open and its completion by S
//! instead (`<app>#snapopen.<S>`, `<app>#snapdone.<S>`, at the switch batch
//! id its open row records), since the generation's keys may be taken.
//!
//! Architecture invariant: key values never reach the facts table; they are
//! in the plans table (next to bronze, under bronze's access) and in bronze's
//! commit metadata. Every plans row is written before its facts row, and
//! readers read the facts first, so a facts row always finds its payload.
//!
//! Architecture invariant: the plan is made once (the first `backfill` call)
//! and never changes while the snapshot is open: a rerun, a later call with
//! other options, reconcile and silver all read the same chunks back.
//!
//! Bronze's txn decides a wave, whoever commits it: a wave whose chunks all
//! read no rows still commits to bronze (the txn and the metadata naming its
//! chunks, no files), and the plans and facts rows of wave w are only
//! written after winning bronze's txn w or, by the repair, from that commit's
//! metadata. Two `backfill` calls that both read wave w (overlapping runs;
//! their waves may even hold other chunks, since rounds follow each call's
//! pace) race for bronze's txn; the loser exits 75 with nothing recorded.
//! Before this, an all-empty wave wrote only plans and facts rows: a
//! concurrent call whose wave w read rows then committed them to bronze,
//! found the rows applied and went on, so the facts called chunks done with
//! none of the rows bronze holds for them (or, for other chunks, read them
//! again as a later wave). Plans or facts rows found already applied are
//! compared with bronze's outcome (chunks, rows, stamps, bronze version); a
//! difference is exit 3. Waves of older tables without a bronze commit stay
//! readable: the next wave number is the largest of the three txn versions.
//!
//! Waves read ahead: once a wave is read (its rows already written to data
//! files by the readers, so no rows wait in memory), its commits run while
//! the next wave is stamped and read. The next wave's commits start only
//! after the previous ones finished, so bronze takes waves in order and at
//! most the last committed wave can lack its facts rows after a crash, which
//! the next call rebuilds first. The read-ahead is one wave (adr-0028
//! Amendment 3): no more than two waves are uncommitted at once, the one
//! committing and the one being read, so a reader that would stamp a third
//! waits for the commit (`MAX_UNCOMMITTED_WAVES`).
//!
//! Capture-instance switches: chunks are read with the columns of the
//! instance the stream is on (as the facts record it), and a wave whose stamp
//! is at or past a newer instance's start pauses (exit 75) until the stream
//! has switched to it and bronze has its columns; `engine::switch` argues why
//! neither the newest instance's columns nor the older ones read past that
//! start keep bronze's latest image equal to the table.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use deltalake::writer::DeltaWriter;
use deltalake::DeltaTable;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::Mutex;

use super::state::{self, generation_of};
use super::Context;
use crate::delta::bronze::{self, SnapshotStamp};
use crate::delta::facts::{self, FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::delta::plans::{self, PlanRow};
use crate::delta::{self, sql_str, Appended, TableKind, Txn};
use crate::engine::plan::{self as planner, KeyCounter, KeySeeker, KeysetShape};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::source::{Isolation, KeyRange, SharedSource, SnapshotRead, SourceError, TableName};
use crate::types::{Key, SqlType, SqlValue};

pub const EVENT_SNAPSHOT_PLAN: &str = "snapshot_plan";
pub const EVENT_SNAPSHOT_CHUNK: &str = "snapshot_chunk";


/// Waves a call may have stamped and not yet committed (adr-0028 Amendment
/// 3: "at most one wave reads while one commits"). A reader that finds the
/// queue empty starts no wave while this many are uncommitted: it waits for
/// the oldest one's commit. So a chunk of wave n + 2 is never read before
/// wave n is committed (bronze, plans and facts rows), a crash loses at most
/// the two waves' reads, and `--max-seconds` is passed by at most the wave
/// being read and the commit under way.
const MAX_UNCOMMITTED_WAVES: u32 = 2;

/// The snapshot modes of `snapshot_open` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Full,
    Chunked,
}

/// An opened snapshot, as its facts row says (no key values).
#[derive(Debug, Clone, PartialEq)]
pub struct Opened {
    pub s: Lsn,
    pub generation: i32,
    pub mode: Mode,
    /// `bootstrap` or `resnapshot`: the completion row it ends with.
    pub kind: String,
}

fn opened_of(r: &FactRow) -> Option<Opened> {
    if r.event.as_deref() != Some(EVENT_SNAPSHOT_OPEN) {
        return None;
    }
    let d = r.detail.as_ref()?;
    let mode = match d.get("mode").and_then(Value::as_str) {
        Some("chunked") => Mode::Chunked,
        _ => Mode::Full,
    };
    let kind = d.get("kind").and_then(Value::as_str).unwrap_or(EVENT_BOOTSTRAP).to_string();
    Some(Opened { s: r.min_lsn?, generation: r.generation, mode, kind })
}

/// True when a `bootstrap` or `resnapshot` row (any generation) has max_lsn at or after `s`.
pub fn is_completed(rows: &[FactRow], s: Lsn) -> bool {
    rows.iter()
        .filter(|r| matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT)))
        .filter_map(|r| r.max_lsn)
        .any(|m| m >= s)
}

/// The chunked snapshot `backfill` works on: the newest chunked open of the
/// current generation without a completion. Opens of older generations were
/// abandoned by the loss that started a newer one.
pub fn open_chunked(rows: &[FactRow]) -> Option<Opened> {
    let generation = generation_of(rows);
    rows.iter()
        .filter_map(opened_of)
        .filter(|o| o.mode == Mode::Chunked && o.generation == generation && !is_completed(rows, o.s))
        .max_by_key(|o| o.s)
}

/// The chunked open of the current generation, completed or not.
pub fn chunked_of_generation(rows: &[FactRow]) -> Option<Opened> {
    let generation = generation_of(rows);
    rows.iter().filter_map(opened_of).filter(|o| o.mode == Mode::Chunked && o.generation == generation).max_by_key(|o| o.s)
}

/// A full snapshot that still holds the snapshot mode (adr-0028's
/// Amendment): opened for the current generation or a later one (a full
/// re-snapshot is opened for generation n + 1 before it makes it live), not
/// superseded ([`is_superseded_full`]), without a chunked open beside it in
/// its generation, and not yet passed by CDC cleanup (`min_lsn` of the
/// capture instance). Once cleanup passes its S it can never complete, and
/// before that nobody can tell a dead run from a slow one: so a killed run's
/// open holds the mode for the retention at most, never forever.
pub fn full_holding_mode(rows: &[FactRow], min_lsn: Option<Lsn>) -> Option<Opened> {
    let generation = generation_of(rows);
    let opens: Vec<Opened> = rows.iter().filter_map(opened_of).collect();
    let chunked_in = |g: i32| opens.iter().any(|o| o.mode == Mode::Chunked && o.generation == g);
    opens
        .iter()
        .filter(|o| o.mode == Mode::Full && o.generation >= generation && !chunked_in(o.generation) && !is_superseded_full(rows, o))
        .filter(|o| !min_lsn.is_some_and(|m| o.s.increment() < m))
        .max_by_key(|o| o.s)
        .cloned()
}

/// Whether a full open can no longer complete because another snapshot took
/// its place: a completion (`bootstrap` or `resnapshot`) at or after its S in
/// any generation (a newer attempt, or a later generation's snapshot), or a
/// completion of its own generation at any S.
///
/// The second half is the lost race of two concurrent full snapshots of one
/// generation. Their open rows are untracked (one per attempt, by design), so
/// both are written, each at the S its own read started from; the bronze
/// commit (`<app>#snapshot` + generation) and the completion row
/// (`<app>#events` + generation) are keyed by the generation, so exactly one
/// attempt completes and the other's commit finds its key taken. When the
/// loser read later, its S is above the winner's, and "a completion at or
/// after S" alone would keep its open holding until cleanup passed it,
/// blocking `seed --reseed` and every chunked open meanwhile. A generation's
/// completion ends every full attempt of that generation: none can commit
/// after it. (Giving the open row the generation's txn instead would drop
/// the open of a rerun at a newer S, which is the one still being read.)
pub fn is_superseded_full(rows: &[FactRow], open: &Opened) -> bool {
    is_completed(rows, open.s)
        || rows
            .iter()
            .any(|r| r.generation == open.generation && matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT)))
}

/// The one snapshot that holds the snapshot mode now, of either mode: the
/// chunked snapshot `backfill` works on, else a full one that may still be
/// read ([`full_holding_mode`]). Every step that takes, opens or seeds a
/// snapshot asks this one function (the stream's bootstrap and recovery,
/// `snapshot`, `backfill`, `seed`), and `status` reports it
/// (`engine::state::load` fills `open_snapshots` from it), so no step calls
/// a snapshot open that another step would take over.
pub fn snapshot_holding_mode(rows: &[FactRow], min_lsn: Option<Lsn>) -> Option<Opened> {
    open_chunked(rows).or_else(|| full_holding_mode(rows, min_lsn))
}

/// A full open for generation `generation` (a re-snapshot taken for the next
/// generation) that is not completed and not yet passed by cleanup: it may
/// still be being read, so a chunked recovery must not start beside it.
pub fn full_open_of(rows: &[FactRow], generation: i32, min_lsn: Option<Lsn>) -> Option<Opened> {
    full_holding_mode(rows, min_lsn).filter(|o| o.generation == generation)
}

/// What finishes an open snapshot, as a sentence naming the calls that do.
/// A full bootstrap is finished by `snapshot`, which reads the table again at
/// a newer S whose completion closes the old open; a full re-snapshot only by
/// the recovery that opened it, which `stream` resumes (`snapshot` returns at
/// once once generation 0 has its bootstrap). Either stops holding on its own
/// once CDC cleanup passes its S.
pub fn how_to_finish(open: &Opened) -> String {
    match (open.mode, open.kind.as_str()) {
        (Mode::Chunked, _) => "call `mssql-cdc --workflow FILE backfill` until it reports done: true".into(),
        (Mode::Full, EVENT_RESNAPSHOT) => format!(
            "with snapshot.mode = \"full\" and stream.on_data_loss = \"resnapshot\", call `mssql-cdc --workflow FILE stream` \
             (add --resnapshot-interval-days 0 if its anti-loop guard stops it): it resumes the recovery and reads the table \
             again for generation {}; or wait until CDC cleanup passes {}, after which it can never complete and holds nothing",
            open.generation, open.s
        ),
        (Mode::Full, _) => format!(
            "with snapshot.mode = \"full\", call `mssql-cdc --workflow FILE snapshot`: it reads the table again at a newer \
             LSN, and its completion closes this open; or wait until CDC cleanup passes {}, after which it can never complete \
             and holds nothing",
            open.s
        ),
    }
}

/// The error for a step that finds the other mode's snapshot open.
pub fn mode_conflict(open: &Opened, wanted: Mode) -> StepError {
    StepError::Config(format!(
        "a {} snapshot opened at {} (generation {}) is still open, and one run takes its snapshots in one mode: \
         this {} step cannot start beside it. To finish it, {}; then change snapshot.mode",
        if open.mode == Mode::Full { "full" } else { "chunked" },
        open.s,
        open.generation,
        if wanted == Mode::Full { "full snapshot" } else { "chunked snapshot" },
        how_to_finish(open),
    ))
}

/// Refuses to go on with (and so to complete) the chunked snapshot `open`
/// when the stream of its generation has a gap after S: the changes right
/// after the stream's position were purged by CDC cleanup. Bronze can then
/// never hold every change after S (P3), so adr-0028 gives the snapshot up
/// and a newer one replaces it: the stream's recovery opens it in the next
/// generation (`on_data_loss = "resnapshot"`, adr-0018's Amendment), and
/// this one never completes. A completion written over the gap would be
/// taken by `apply` and `reconcile` for a whole image of the table.
/// With "resnapshot" the call is for later (exit 75, after `stream`); with
/// "fail" or "skip" (which a chunked snapshot refuses) a person decides.
pub async fn refuse_over_stream_gap(
    source: &SharedSource,
    instance: &str,
    rows: &[FactRow],
    open: &Opened,
    on_data_loss: crate::workflow::OnDataLoss,
    workflow: &std::path::Path,
) -> StepResult<()> {
    let st = state::StreamState::derive("", rows, None);
    let Some(position) = st.position() else { return Ok(()) };
    let min = source.min_lsn(instance).await?;
    let max = source.max_lsn().await?;
    if !super::snapshot::is_purged_after(position, min, max) {
        return Ok(());
    }
    let min = min.expect("a purged range has a min LSN");
    let wf = workflow.display();
    let head = format!(
        "the stream of generation {} stands at {position} and the changes after it were purged by CDC cleanup (capture instance \
         '{instance}', min LSN now {min}): the chunked snapshot opened at {} can never hold every change after its start, so \
         backfill does not complete it (nothing was written)",
        open.generation, open.s
    );
    Err(match on_data_loss {
        crate::workflow::OnDataLoss::Resnapshot => StepError::Temporary(format!(
            "{head}. Call `mssql-cdc --workflow {wf} stream`: with stream.on_data_loss = \"resnapshot\" it recovers with a newer \
             snapshot in generation {}, which backfill then reads",
            open.generation + 1
        )),
        _ => StepError::NeedsPerson(format!(
            "{head}. Set stream.on_data_loss = \"resnapshot\" and call `mssql-cdc --workflow {wf} stream`: it recovers with a \
             newer snapshot in generation {}, which replaces this one and which backfill then reads",
            open.generation + 1
        )),
    })
}

/// The payload of a chunked open's plans row: the columns the chunks are cut
/// on and their extent at S.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenPayload {
    pub keys: Vec<String>,
    pub min: Option<Key>,
    pub max: Option<Key>,
    pub kind: String,
    pub generation: i32,
}

/// One planned chunk: `[lo, hi)`, `lo = None` open below (and NULL keys), `hi = None` open above.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedChunk {
    pub chunk: i64,
    pub lo: Option<Key>,
    pub hi: Option<Key>,
    /// Rows counted when planned (integer plans only).
    pub rows: Option<u64>,
}

/// The payload of the plan's plans row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanPayload {
    /// `integer` (packed from per-slice counts) or `keyset`.
    pub kind: String,
    pub keys: Vec<String>,
    pub chunk_rows: u64,
    pub chunk_count: usize,
    pub chunks: Vec<PlannedChunk>,
    /// A keyset plan found no key after MAX when planned: the last chunk's end
    /// is sought again before the wave that reads it.
    pub open_end: bool,
    pub isolation: Isolation,
}

/// The payload of a chunk's plans row (the bounds as read) and, minus the
/// bounds, of its facts row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChunkPayload {
    pub chunk: i64,
    pub wave: i64,
    pub lo: Option<Key>,
    pub hi: Option<Key>,
    pub last: bool,
    pub rows: i64,
    /// L: max LSN read before the wave's reads.
    pub stamp: Lsn,
    /// Max LSN read after them.
    pub max_lsn: Lsn,
    pub read_ms: Option<i64>,
    /// Bytes the chunk's rows took in memory as read from the source (Arrow
    /// buffers, before bronze's encoding): the record's "megabytes read".
    /// None where the chunk is rebuilt from a commit rather than read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bytes: Option<i64>,
    /// Rounds of `parallelism` chunks in the wave (its pace: [`round_pace`]).
    pub rounds: u32,
    pub bronze_version: Option<i64>,
    /// A heap's chunk only: the fence of its read (`CdcSource::snapshot_read_fenced`),
    /// in UTC. The chunk holds exactly the table's commits that ended at or
    /// before it; its heap silver counts a later change image only when the
    /// image's commit ended after it (see `engine::apply::heap`). None for a
    /// keyed table's chunk, whose rank rule needs no more than the stamp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<DateTime<Utc>>,
}

fn chunk_key(s: Lsn) -> String {
    s.to_hex()
}

pub(crate) fn txn_open_plans(app: &str, s: Lsn) -> Txn {
    Txn::new(format!("{app}#snapopen.{}", chunk_key(s)), 0)
}
fn txn_open_facts(app: &str, generation: i32) -> Txn {
    Txn::new(format!("{app}#snapshots"), generation as i64)
}
fn txn_plan(app: &str, s: Lsn) -> Txn {
    Txn::new(format!("{app}#snapplan.{}", chunk_key(s)), 0)
}
fn txn_wave_bronze(app: &str, s: Lsn, wave: i64) -> Txn {
    Txn::new(format!("{app}#snap.{}", chunk_key(s)), wave)
}
fn txn_wave_rows(app: &str, s: Lsn, wave: i64) -> Txn {
    Txn::new(format!("{app}#snapchunks.{}", chunk_key(s)), wave)
}
fn txn_completion(app: &str, generation: i32) -> Txn {
    Txn::new(format!("{app}#events"), generation as i64)
}
/// The facts open of a snapshot opened after a capture-instance switch
/// (adr-0028 Amendment 5): keyed by its S, since the generation's own key
/// (`#snapshots`, generation) may be taken by the generation's first open.
pub(crate) fn txn_switch_open_facts(app: &str, s: Lsn, switch_batch_id: i64) -> Txn {
    Txn::new(format!("{app}#snapopen.{}", chunk_key(s)), switch_batch_id)
}
/// The completion of a snapshot opened after a switch: keyed by its S for
/// the same reason (`#events`, generation may hold the generation's bootstrap).
pub(crate) fn txn_switch_done(app: &str, s: Lsn, switch_batch_id: i64) -> Txn {
    Txn::new(format!("{app}#snapdone.{}", chunk_key(s)), switch_batch_id)
}
/// The switch batch an open row records (only a switch's open has one).
pub fn switch_batch_of(open_row: &FactRow) -> Option<i64> {
    open_row.detail.as_ref().and_then(|d| d.get("switch_batch_id")).and_then(Value::as_i64)
}

/// Chunk progress of snapshot `s` from its `snapshot_chunk` facts rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// chunk -> rows, of every chunk a facts row records.
    pub done: BTreeMap<i64, i64>,
    pub last_wave: Option<i64>,
    /// The pace per round of the newest wave with read times, in seconds:
    /// [`round_pace`] of its slowest chunk's read, its bronze append and its rounds.
    pub pace_round_seconds: Option<f64>,
    pub waves: BTreeSet<i64>,
}

/// Derives the progress (pure).
pub fn progress(rows: &[FactRow], s: Lsn) -> Progress {
    let mut p = Progress::default();
    let hex = s.to_hex();
    // The newest wave with read times: (wave, slowest read s, append s, rounds).
    let mut newest: Option<(i64, f64, f64, u32)> = None;
    for r in rows.iter().filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_CHUNK)) {
        let Some(d) = &r.detail else { continue };
        if d.get("snapshot").and_then(Value::as_str) != Some(hex.as_str()) {
            continue;
        }
        let (Some(chunk), Some(wave)) = (d.get("chunk").and_then(Value::as_i64), d.get("wave").and_then(Value::as_i64)) else { continue };
        p.done.insert(chunk, r.rows.unwrap_or(0));
        p.waves.insert(wave);
        p.last_wave = p.last_wave.max(Some(wave));
        // A round's read is the wave's slowest chunk (each connection reads
        // one chunk a round); the append is the wave's, the same on each of its
        // rows (absent on rows written before it was recorded: 0).
        if let Some(ms) = r.duration_ms {
            let read = ms as f64 / 1000.0;
            let append = d.get("append_ms").and_then(Value::as_i64).unwrap_or(0).max(0) as f64 / 1000.0;
            let rounds = d.get("rounds").and_then(Value::as_u64).unwrap_or(1).clamp(1, u32::MAX as u64) as u32;
            newest = match newest {
                Some((w, r0, a0, n0)) if w == wave => Some((w, r0.max(read), a0.max(append), n0.max(rounds))),
                Some((w, ..)) if w > wave => newest,
                _ => Some((wave, read, append, rounds)),
            };
        }
    }
    p.pace_round_seconds = newest.map(|(_, read, append, rounds)| round_pace(read, append, rounds));
    p
}

/// The pace per round of a committed wave, from its facts rows, which sizes
/// a call's first wave (pure). adr-0028 Amendment 3 takes it from "the facts
/// rows of the last wave committed (duration_ms, its read and its append)",
/// per round. Here a round's read is the wave's slowest chunk read (a chunk
/// row's `duration_ms`: each connection reads one chunk a round, so a wave
/// of r rounds reads for about r of them), and its append, the wave's bronze
/// commit (`append_ms` in the detail), happens once a wave, so each round
/// carries an r-th of it: (r x slowest read + append) / r.
///
/// Within a call the record sizes the next wave by the last wave's read
/// alone ("its read, from its stamp to its rows cached, per round"): its
/// commit runs beside the next wave's read. So does [`backfill`]: once a
/// wave's chunks are all read, its slowest chunk read is the pace of the
/// waves stamped after.
pub fn round_pace(slowest_read_seconds: f64, append_seconds: f64, rounds: u32) -> f64 {
    slowest_read_seconds + append_seconds / rounds.max(1) as f64
}

/// How many rounds of `parallelism` chunks the next wave takes: as many as
/// `target_seconds` holds at the last pace, no more than what is left of
/// `remaining_seconds`, at least one, at most `rounds_left` (pure).
pub fn rounds_for_wave(target_seconds: f64, pace_round_seconds: Option<f64>, remaining_seconds: Option<f64>, rounds_left: usize) -> usize {
    let rounds_left = rounds_left.max(1);
    if target_seconds <= 0.0 {
        return 1;
    }
    let Some(pace) = pace_round_seconds.filter(|p| *p > 0.0) else { return 1 };
    let mut r = (target_seconds / pace).floor().max(1.0);
    if let Some(rem) = remaining_seconds {
        r = r.min((rem / pace).floor().max(1.0));
    }
    (r as usize).clamp(1, rounds_left)
}

/// Options of one `backfill` call (CLI flags over the workflow's values).
#[derive(Debug, Clone, Default)]
pub struct BackfillArgs {
    pub max_waves: Option<u32>,
    pub max_seconds: Option<f64>,
    pub chunk_rows: Option<u64>,
    pub min_headroom_hours: Option<f64>,
    pub isolation: Option<Isolation>,
    pub target_wave_seconds: Option<f64>,
}

/// The JSON result of a `backfill` call.
#[derive(Debug, Clone, Serialize, Default)]
pub struct BackfillResult {
    pub step: &'static str,
    /// S of the snapshot worked on (None when none is open).
    pub snapshot: Option<Lsn>,
    pub generation: i32,
    pub chunks_done: usize,
    pub chunks_total: usize,
    pub done: bool,
    pub paused: bool,
    pub reason: Option<String>,
    /// Waves this call committed (not counting a repaired one).
    pub waves: u32,
    pub rows: i64,
    pub repaired_wave: Option<i64>,
    /// Per wave: seconds from its last chunk's last row read to its facts rows committed.
    pub wave_fixed_seconds: Vec<f64>,
    pub duration_ms: i64,
}

/// What a chunked open returned.
#[derive(Debug, Clone, Serialize)]
pub struct OpenResult {
    pub step: &'static str,
    pub mode: &'static str,
    pub snapshot_lsn: Lsn,
    pub generation: i32,
    pub opened_now: bool,
    pub completed: bool,
}

/// Checks that the chunks can be cut on `keys` (adr-0028 Amendment 6): every
/// column captured, orderable and bindable. Called before anything is recorded.
pub fn check_keys(ctx: &Context, keys: &[String]) -> StepResult<Vec<SqlType>> {
    if keys.is_empty() {
        return Err(StepError::Config(format!(
            "capture instance '{}' has no unique index, so there is no key to cut chunks on: name columns in snapshot.keys \
             (unique or not; a column the writers do not update)",
            ctx.instance.name
        )));
    }
    let mut types = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let col = ctx.instance.column(k).ok_or_else(|| {
            StepError::Config(format!("snapshot.keys names '{k}', which capture instance '{}' does not capture", ctx.instance.name))
        })?;
        if let Some(why) = col.sql_type.unorderable_reason() {
            return Err(StepError::Config(format!(
                "snapshot.keys names '{}' ({}), which chunks cannot be cut on: {why}. Name another column",
                col.name,
                col.sql_type.sql_name()
            )));
        }
        let hundred_ns = matches!(col.sql_type, SqlType::Time { .. } | SqlType::DateTime2 { scale: 7 } | SqlType::DateTimeOffset { scale: 7 });
        if hundred_ns && i + 1 < keys.len() {
            return Err(StepError::Config(format!(
                "snapshot.keys names '{}' ({}) before the last column: its bounds cannot be bound exactly (the drivers keep \
                 microseconds, the column holds 100 ns). Put it last, or name other columns",
                col.name,
                col.sql_type.sql_name()
            )));
        }
        types.push(col.sql_type.clone());
    }
    Ok(types)
}

/// Opens (or finds) the chunked snapshot of generation `generation`: records S
/// and the key's extent and starts the generation at S, reading no rows.
pub async fn ensure_open(ctx: &mut Context, kind: &str, generation: i32) -> StepResult<OpenResult> {
    ensure_open_with_gap(ctx, kind, generation, None).await
}

/// [`ensure_open`] for a re-snapshot: its open row (and later its
/// completion row) carries the data-loss gap it closes.
pub async fn ensure_open_with_gap(ctx: &mut Context, kind: &str, generation: i32, gap: Option<super::snapshot::Gap>) -> StepResult<OpenResult> {
    // The chunks are read with this instance's columns: bronze must hold them
    // all (it may be older than the instance; see stream::run).
    let instance = ctx.instance.clone();
    super::switch::add_bronze_columns(ctx, &instance).await?;
    let app = ctx.workflow.app_id.clone();
    let rows = state::facts_rows(&ctx.facts, &app).await?;
    if let Some(o) = chunked_of_generation(&rows).filter(|o| o.generation == generation) {
        let completed = is_completed(&rows, o.s);
        return Ok(OpenResult { step: "snapshot", mode: "chunked", snapshot_lsn: o.s, generation, opened_now: false, completed });
    }
    // Its chunks would be read with these columns: refuse before the open is recorded.
    super::check_no_renamed_columns(ctx, "a chunked snapshot")?;
    let min = ctx.source.min_lsn(&ctx.instance.name).await?;
    if let Some(full) = full_holding_mode(&rows, min) {
        return Err(mode_conflict(&full, Mode::Chunked));
    }
    let keys = ctx.snapshot_keys();
    check_keys(ctx, &keys)?;
    let iso = ctx.workflow.snapshot.isolation;
    let s = ctx.source.max_lsn().await?.ok_or_else(|| {
        StepError::Temporary("the capture job has not recorded any LSN yet (max LSN is NULL): call again once it has run".into())
    })?;
    let table = ctx.workflow.table_name();
    let extent = ctx.source.key_extent(&table, &keys, iso).await?;
    let payload = OpenPayload { keys: keys.clone(), min: extent.as_ref().map(|e| e.0.clone()), max: extent.map(|e| e.1), kind: kind.to_string(), generation };
    let mut plans_table = open_plans(ctx).await?;
    let prow = PlanRow {
        app_id: app.clone(),
        snapshot: s,
        event: EVENT_SNAPSHOT_OPEN.into(),
        wave: None,
        chunk: None,
        detail: serde_json::to_value(&payload).map_err(|e| StepError::Internal(e.to_string()))?,
        recorded_at: Some(Utc::now()),
    };
    append_plans(&mut plans_table, &app, vec![prow], &txn_open_plans(&app, s)).await?;
    failpoint!("chunked.after_open_plans");
    // 28.82: a full run that passed its own check before ours and wrote its
    // open since (it is still reading) stops this open before its commit
    // point, the facts row below; the plans row alone is keyed by S and
    // read by nobody. The other order is `engine::snapshot::take_full`'s
    // re-check after its own open.
    ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
    let rows = state::facts_rows(&ctx.facts, &app).await?;
    if let Some(full) = full_holding_mode(&rows, min) {
        return Err(mode_conflict(&full, Mode::Chunked));
    }
    let mut row = ctx.fact_row(generation);
    row.event = Some(EVENT_SNAPSHOT_OPEN.into());
    row.min_lsn = Some(s);
    row.max_lsn = Some(s);
    row.commit_ts = ctx.commit_time(s).await?;
    row.detail = Some(json!({"mode": "chunked", "kind": kind, "generation": generation, "isolation": iso}));
    row.lost_from_ts = gap.and_then(|g| g.lost_from_ts);
    row.lost_to_ts = gap.and_then(|g| g.lost_to_ts);
    let appended = append_facts_rows(&mut ctx.facts, &app, vec![row], &txn_open_facts(&app, generation)).await?;
    failpoint!("chunked.after_open");
    if let Appended::AlreadyApplied { .. } = appended {
        // Another call opened this generation's snapshot meanwhile: use
        // theirs. Or a seed completed the generation (its completion claims
        // this key, `engine::seed`): the next call starts from the seed.
        let rows = state::facts_rows(&ctx.facts, &app).await?;
        let Some(o) = chunked_of_generation(&rows) else {
            return Err(StepError::Temporary(format!(
                "generation {generation} was started another way meanwhile (a seed's completion holds the open's key {}#snapshots): call again",
                app
            )));
        };
        return Ok(OpenResult { step: "snapshot", mode: "chunked", snapshot_lsn: o.s, generation, opened_now: false, completed: false });
    }
    tracing::info!(snapshot = %s, generation, keys = ?keys, "chunked snapshot opened: the stream starts at S now, backfill reads the table beside it");
    Ok(OpenResult { step: "snapshot", mode: "chunked", snapshot_lsn: s, generation, opened_now: true, completed: false })
}

/// The bootstrap of a workflow with `snapshot.mode = "chunked"`: opens
/// generation 0's chunked snapshot unless the stream already has one or a
/// completed bootstrap. Returns None when there is nothing to open.
pub async fn ensure_bootstrap_open(ctx: &mut Context) -> StepResult<Option<OpenResult>> {
    let rows = state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let bootstrapped = rows.iter().any(|r| r.generation == 0 && matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT)));
    if generation_of(&rows) > 0 || bootstrapped {
        return Ok(None);
    }
    ensure_open(ctx, EVENT_BOOTSTRAP, 0).await.map(Some)
}

/// Opens or creates the plans table next to bronze.
pub async fn open_plans(ctx: &Context) -> StepResult<DeltaTable> {
    let location = plans::location_for(&ctx.workflow.target.bronze);
    delta::open_or_create(
        &location,
        &ctx.storage,
        TableKind::Plans,
        &plans::schema(),
        &format!("mssql-cdc snapshot plans of {}: key values of chunked snapshots, next to bronze", ctx.workflow.table_name()),
    )
    .await
}

pub(crate) async fn append_plans(table: &mut DeltaTable, app: &str, rows: Vec<PlanRow>, txn: &Txn) -> StepResult<Appended> {
    let summary: Vec<Value> = rows.iter().map(|r| json!({"event": r.event, "wave": r.wave, "chunk": r.chunk})).collect();
    let meta = json!({"plans": summary, "app_id": app});
    delta::append_batches(table, vec![plans::to_batch(&rows)], plans::schema(), txn, meta).await
}

pub(crate) async fn append_facts_rows(table: &mut DeltaTable, app: &str, rows: Vec<FactRow>, txn: &Txn) -> StepResult<Appended> {
    let meta = json!({"facts": facts::summary(&rows), "app_id": app});
    delta::append_batches(table, vec![facts::to_batch(&rows)], facts::schema(), txn, meta).await
}

/// The plans rows of snapshot `s`.
async fn plan_rows(table: &mut DeltaTable, app: &str, s: Lsn) -> StepResult<Vec<PlanRow>> {
    table.update_state().await.map_err(StepError::delta(table.table_url().to_string()))?;
    let batches =
        delta::query(table, &format!("SELECT * FROM t WHERE app_id = {} AND snapshot = {}", sql_str(app), sql_str(&s.to_hex()))).await?;
    plans::from_batches(&batches)
}

fn payload_of<T: for<'de> Deserialize<'de>>(rows: &[PlanRow], event: &str, what: &str, location: &str) -> StepResult<T> {
    let r = rows.iter().find(|r| r.event == event).ok_or_else(|| {
        StepError::NeedsPerson(format!(
            "the facts record the {what} of a chunked snapshot, but the plans table {location} has no row for it: \
             a range without bounds is never read as the whole table. Restore the plans table, or open a new snapshot"
        ))
    })?;
    serde_json::from_value(r.detail.clone()).map_err(|e| StepError::Internal(format!("the plans table's {what} row does not parse: {e}")))
}

/// Source adapters for the planners.
struct SourceKeys {
    source: SharedSource,
    table: TableName,
    keys: Vec<String>,
    isolation: Isolation,
}

#[async_trait]
impl KeyCounter for SourceKeys {
    async fn count(&self, lo: i64, hi: i64, width: i64) -> Result<Vec<(i64, u64)>, SourceError> {
        self.source.slice_counts(&self.table, &self.keys[0], lo, hi, width, self.isolation).await
    }

    async fn extent(&self, lo: i64, hi: i64) -> Result<Option<(i64, i64)>, SourceError> {
        self.source.slice_extent(&self.table, &self.keys[0], lo, hi, self.isolation).await
    }

    async fn null_rows(&self) -> Result<u64, SourceError> {
        self.source.null_count(&self.table, &self.keys[0], self.isolation).await
    }
}

#[async_trait]
impl KeySeeker for SourceKeys {
    async fn seek(&self, range: &KeyRange, n: u64) -> Result<Option<Key>, SourceError> {
        self.source.key_seek(&self.table, &self.keys, range, n, self.isolation).await
    }

    async fn compare(&self, a: &Key, b: &Key) -> Result<std::cmp::Ordering, SourceError> {
        let answer = self.source.compare_keys(&self.table, &self.keys, &[(a.clone(), b.clone())]).await?;
        answer.first().copied().ok_or_else(|| SourceError::Other("the source answered no comparison".into()))
    }
}

fn same_columns(a: &[String], b: &[String]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.eq_ignore_ascii_case(y))
}

fn keyset_shape(ctx: &Context, keys: &[String]) -> KeysetShape {
    let types = keys.iter().map(|k| ctx.instance.column(k).map(|c| c.sql_type.clone()).unwrap_or(SqlType::BigInt)).collect();
    KeysetShape { types, unique: same_columns(keys, &ctx.instance.index_columns) }
}

/// Plans every chunk of the snapshot (pure planning over source reads).
async fn compute_plan(ctx: &Context, open: &OpenPayload, chunk_rows: u64, isolation: Isolation) -> StepResult<PlanPayload> {
    let table = ctx.workflow.table_name();
    let adapter = SourceKeys { source: ctx.source.clone(), table: table.clone(), keys: open.keys.clone(), isolation };
    let single_int = open.keys.len() == 1 && ctx.instance.column(&open.keys[0]).is_some_and(|c| c.sql_type.is_integer());
    let (Some(min), Some(max)) = (&open.min, &open.max) else {
        // No key at S (an empty table, or NULL keys only): one chunk; whatever
        // is there now was inserted after S or is NULL, and reading it only replays.
        return Ok(PlanPayload {
            kind: "keyset".into(),
            keys: open.keys.clone(),
            chunk_rows,
            chunk_count: 1,
            chunks: vec![PlannedChunk { chunk: 0, lo: None, hi: None, rows: None }],
            open_end: false,
            isolation,
        });
    };
    if let (true, Some(lo), Some(hi)) = (single_int, min[0].as_i64(), max[0].as_i64()) {
        let estimate = ctx.source.row_estimate(&table).await?;
        let chunks = planner::plan_integer(&adapter, lo, hi, chunk_rows, estimate).await?;
        let chunks: Vec<PlannedChunk> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| PlannedChunk {
                chunk: i as i64,
                lo: c.lo.map(|v| vec![SqlValue::Int(v)]),
                hi: c.hi.map(|v| vec![SqlValue::Int(v)]),
                rows: Some(c.rows),
            })
            .collect();
        return Ok(PlanPayload { kind: "integer".into(), keys: open.keys.clone(), chunk_rows, chunk_count: chunks.len(), chunks, open_end: false, isolation });
    }
    let shape = keyset_shape(ctx, &open.keys);
    let bounds = planner::plan_keyset(&adapter, max, chunk_rows, &shape).await?;
    let end = planner::last_bound(&adapter, max, &shape).await?;
    let mut chunks = Vec::with_capacity(bounds.len() + 1);
    let mut lo: Option<Key> = None;
    for b in bounds {
        chunks.push(PlannedChunk { chunk: chunks.len() as i64, lo: lo.clone(), hi: Some(b.clone()), rows: None });
        lo = Some(b);
    }
    let open_end = end.is_none();
    chunks.push(PlannedChunk { chunk: chunks.len() as i64, lo, hi: end, rows: None });
    Ok(PlanPayload { kind: "keyset".into(), keys: open.keys.clone(), chunk_rows, chunk_count: chunks.len(), chunks, open_end, isolation })
}

/// A heap's plan reads its last chunk open above: no row is left to "above
/// the last chunk's end". Keyed silver takes such rows from the stream's
/// changes after S, key by key; a heap's could only count their images after
/// the moment no row lay above MAX, which is neither S (a switch's snapshot
/// reads MAX long after the newer instance's start) nor any LSN the open can
/// read without a fence (the capture job runs behind the table). The last
/// chunk's own fenced read holds them exactly instead; what it costs is a
/// larger last chunk on a table whose chunk column grows.
fn open_above_for_a_heap(ctx: &Context, mut plan: PlanPayload) -> PlanPayload {
    // A heap: no unique index (`engine::apply::heap::is_heap`, not imported: apply sits above this module).
    if ctx.instance.index_columns.is_empty() {
        if let Some(last) = plan.chunks.last_mut() {
            last.hi = None;
        }
        plan.open_end = false;
    }
    plan
}

/// Reads the plan, making it on the first call (plans row, read back, facts row).
async fn ensure_plan(
    ctx: &mut Context,
    plans_table: &mut DeltaTable,
    o: &Opened,
    open: &OpenPayload,
    facts_rows: &[FactRow],
    args: &BackfillArgs,
    isolation: Isolation,
) -> StepResult<PlanPayload> {
    let app = ctx.workflow.app_id.clone();
    let hex = o.s.to_hex();
    let location = plans::location_for(&ctx.workflow.target.bronze);
    let has_facts_plan = facts_rows
        .iter()
        .any(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_PLAN) && r.detail.as_ref().and_then(|d| d.get("snapshot")).and_then(Value::as_str) == Some(hex.as_str()));
    let rows = plan_rows(plans_table, &app, o.s).await?;
    if has_facts_plan {
        let plan: PlanPayload = payload_of(&rows, EVENT_SNAPSHOT_PLAN, "plan", &location)?;
        if let Some(n) = args.chunk_rows.filter(|n| *n != plan.chunk_rows) {
            tracing::warn!(asked = n, planned = plan.chunk_rows, "--chunk-rows is ignored: the snapshot's chunks were planned by its first backfill call and stay fixed");
        }
        return Ok(plan);
    }
    let plan: PlanPayload = match rows.iter().find(|r| r.event == EVENT_SNAPSHOT_PLAN) {
        // A call stopped between the plans row and the facts row: that plan is the one.
        Some(r) => serde_json::from_value(r.detail.clone()).map_err(|e| StepError::Internal(format!("plan row: {e}")))?,
        None => {
            let chunk_rows = args.chunk_rows.unwrap_or(ctx.workflow.snapshot.chunk_rows).max(1);
            let started = Instant::now();
            let plan = open_above_for_a_heap(ctx, compute_plan(ctx, open, chunk_rows, isolation).await?);
            tracing::info!(snapshot = %o.s, chunks = plan.chunk_count, kind = %plan.kind, ms = started.elapsed().as_millis() as u64, "planned the chunked snapshot");
            let prow = PlanRow {
                app_id: app.clone(),
                snapshot: o.s,
                event: EVENT_SNAPSHOT_PLAN.into(),
                wave: None,
                chunk: None,
                detail: serde_json::to_value(&plan).map_err(|e| StepError::Internal(e.to_string()))?,
                recorded_at: Some(Utc::now()),
            };
            // Not a commit boundary (not in `FAILPOINTS`): a race test holds
            // a first call here, its own plan made, while another call records
            // one (tests/records_race.rs).
            failpoint!("chunked.before_plan_plans");
            append_plans(plans_table, &app, vec![prow], &txn_plan(&app, o.s)).await?;
            failpoint!("chunked.after_plan_plans");
            // The plan read back is the recorded one, whoever wrote it.
            let rows = plan_rows(plans_table, &app, o.s).await?;
            payload_of(&rows, EVENT_SNAPSHOT_PLAN, "plan", &location)?
        }
    };
    let mut row = ctx.fact_row(o.generation);
    row.event = Some(EVENT_SNAPSHOT_PLAN.into());
    row.min_lsn = Some(o.s);
    row.max_lsn = Some(o.s);
    row.detail = Some(json!({"snapshot": hex, "kind": plan.kind, "chunk_rows": plan.chunk_rows, "chunk_count": plan.chunk_count}));
    append_facts_rows(&mut ctx.facts, &app, vec![row], &txn_plan(&app, o.s)).await?;
    failpoint!("chunked.after_plan");
    Ok(plan)
}

/// A wave read and ready to commit.
struct WaveRead {
    wave: i64,
    chunks: Vec<ChunkPayload>,
    adds: Vec<deltalake::kernel::Add>,
    rows: i64,
    read_ended: Instant,
    stamp_ts: Option<DateTime<Utc>>,
}

/// Everything the commit task needs, owned, so it runs beside the next read.
struct Sink {
    app: String,
    s: Lsn,
    generation: i32,
    kind: String,
    header: FactRow,
    /// The data-loss gap a re-snapshot closes (on its completion row only).
    gap: super::snapshot::Gap,
    /// The completion row's txn: the generation's, or for a snapshot opened
    /// after a switch the one keyed by its S (see [`txn_switch_done`]).
    completion_txn: Txn,
    bronze: DeltaTable,
    facts: DeltaTable,
    plans: DeltaTable,
    chunks_total: usize,
    done: BTreeSet<i64>,
    rows_total: i64,
    waves_total: BTreeSet<i64>,
    /// What the completion checks first ([`refuse_over_stream_gap`]).
    gap_check: GapCheck,
}

/// The source and settings [`refuse_over_stream_gap`] needs, owned by the sink.
struct GapCheck {
    source: SharedSource,
    instance: String,
    open: Opened,
    on_data_loss: crate::workflow::OnDataLoss,
    workflow: std::path::PathBuf,
}

/// What committing a wave did.
struct WaveCommitted {
    rows: i64,
    fixed_seconds: f64,
}

impl Sink {
    /// A chunk's facts row. `append_ms` is its wave's bronze append (None for
    /// a wave rebuilt after a crash, whose append this call did not make).
    fn chunk_fact(&self, c: &ChunkPayload, stamp_ts: Option<DateTime<Utc>>, repaired: bool, append_ms: Option<i64>) -> FactRow {
        let mut row = self.header.clone();
        row.recorded_at = Some(Utc::now());
        row.event = Some(EVENT_SNAPSHOT_CHUNK.into());
        row.rows = Some(c.rows);
        row.min_lsn = Some(c.stamp);
        row.max_lsn = Some(c.max_lsn);
        row.commit_ts = stamp_ts;
        row.duration_ms = c.read_ms;
        row.bronze_version = c.bronze_version;
        let mut detail = json!({"snapshot": self.s.to_hex(), "chunk": c.chunk, "wave": c.wave, "last": c.last, "rounds": c.rounds});
        if let Some(bytes) = c.read_bytes {
            detail["read_bytes"] = json!(bytes);
        }
        if let Some(ms) = append_ms {
            // With duration_ms (the read), the record's "its read and its
            // append" that sizes the next call's first wave (see `round_pace`).
            detail["append_ms"] = json!(ms);
        }
        if repaired {
            detail["repaired"] = json!(true);
        }
        row.detail = Some(detail);
        row
    }

    /// Commits a wave: bronze (unless its rows are there already), plans
    /// rows, facts rows, and the completion row when it holds the last chunks.
    async fn commit(&mut self, mut w: WaveRead) -> StepResult<WaveCommitted> {
        tracing::debug!(wave = w.wave, rows = w.rows, "wave read");
        // Only a race test arms this (a sleep): two calls then hold the same wave.
        failpoint!("chunked.before_wave_bronze");
        let txn = txn_wave_bronze(&self.app, self.s, w.wave);
        // Bronze's txn decides the wave, one whose chunks all read no rows
        // too (a commit of the txn and the metadata only): see the module docs.
        let (bronze_version, append_ms) = {
            let meta = json!({
                "kind": "snapshot_wave",
                "snapshot_lsn": self.s,
                "wave": w.wave,
                "generation": self.generation,
                "rows": w.rows,
                "chunks": w.chunks.iter().map(|c| json!({
                    "chunk": c.chunk, "lo": c.lo, "hi": c.hi, "last": c.last, "rows": c.rows,
                    "stamp": c.stamp, "max_lsn": c.max_lsn, "rounds": c.rounds, "fence": c.fence,
                })).collect::<Vec<_>>(),
            });
            let append_started = Instant::now();
            let appended = delta::commit_adds(&mut self.bronze, std::mem::take(&mut w.adds), &txn, meta).await?;
            // Rounded up: an append is never recorded as taking no time.
            let append_ms = append_started.elapsed().as_micros().div_ceil(1000) as i64;
            match appended {
                Appended::Committed { table_version } => (Some(table_version), append_ms),
                Appended::Empty => return Err(StepError::Internal(format!("wave {}'s bronze commit was skipped as empty", w.wave))),
                Appended::AlreadyApplied { .. } => {
                    return Err(StepError::Temporary(format!(
                        "wave {} of the snapshot at {} was committed by another backfill call meanwhile: call again",
                        w.wave, self.s
                    )))
                }
            }
        };
        failpoint!("chunked.after_wave_bronze");
        for c in &mut w.chunks {
            c.bronze_version = bronze_version;
        }
        self.finish_wave(&w.chunks, w.stamp_ts, false, Some(append_ms)).await?;
        let fixed_seconds = w.read_ended.elapsed().as_secs_f64();
        self.complete_if_done(None).await?;
        Ok(WaveCommitted { rows: w.rows, fixed_seconds })
    }

    /// The plans rows, then the facts rows, of a wave whose bronze rows are in.
    async fn finish_wave(&mut self, chunks: &[ChunkPayload], stamp_ts: Option<DateTime<Utc>>, repaired: bool, append_ms: Option<i64>) -> StepResult<()> {
        let Some(wave) = chunks.first().map(|c| c.wave) else { return Ok(()) };
        let prows: Vec<PlanRow> = chunks
            .iter()
            .map(|c| PlanRow {
                app_id: self.app.clone(),
                snapshot: self.s,
                event: EVENT_SNAPSHOT_CHUNK.into(),
                wave: Some(c.wave),
                chunk: Some(c.chunk),
                detail: serde_json::to_value(c).unwrap_or(Value::Null),
                recorded_at: Some(Utc::now()),
            })
            .collect();
        let txn = txn_wave_rows(&self.app, self.s, wave);
        if let Appended::AlreadyApplied { .. } = append_plans(&mut self.plans, &self.app, prows, &txn).await? {
            // A concurrent repair wrote them from the same bronze commit; anything else is a second outcome.
            let recorded: Vec<ChunkPayload> = plan_rows(&mut self.plans, &self.app, self.s)
                .await?
                .iter()
                .filter(|r| r.event == EVENT_SNAPSHOT_CHUNK && r.wave == Some(wave))
                .filter_map(|r| serde_json::from_value(r.detail.clone()).ok())
                .collect();
            self.check_recorded_wave(wave, chunks, &recorded, "plans")?;
        }
        failpoint!("chunked.after_wave_plans");
        self.write_wave_facts(chunks, stamp_ts, repaired, append_ms).await
    }

    async fn write_wave_facts(&mut self, chunks: &[ChunkPayload], stamp_ts: Option<DateTime<Utc>>, repaired: bool, append_ms: Option<i64>) -> StepResult<()> {
        let Some(wave) = chunks.first().map(|c| c.wave) else { return Ok(()) };
        let frows: Vec<FactRow> = chunks.iter().map(|c| self.chunk_fact(c, stamp_ts, repaired, append_ms)).collect();
        let txn = txn_wave_rows(&self.app, self.s, wave);
        if let Appended::AlreadyApplied { .. } = append_facts_rows(&mut self.facts, &self.app, frows, &txn).await? {
            self.facts.update_state().await.map_err(StepError::delta(self.facts.table_url().to_string()))?;
            let hex = self.s.to_hex();
            let recorded: Vec<ChunkPayload> = state::facts_rows(&self.facts, &self.app)
                .await?
                .iter()
                .filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_CHUNK))
                .filter_map(|r| {
                    let d = r.detail.as_ref()?;
                    (d.get("snapshot")?.as_str()? == hex && d.get("wave")?.as_i64()? == wave).then_some(())?;
                    Some(ChunkPayload {
                        chunk: d.get("chunk")?.as_i64()?,
                        wave,
                        lo: None,
                        hi: None,
                        last: false,
                        rows: r.rows.unwrap_or(0),
                        stamp: r.min_lsn?,
                        max_lsn: r.max_lsn?,
                        read_ms: None,
                        read_bytes: None,
                        rounds: 1,
                        bronze_version: r.bronze_version,
                        fence: None,
                    })
                })
                .collect();
            self.check_recorded_wave(wave, chunks, &recorded, "facts")?;
        }
        failpoint!("chunked.after_wave_facts");
        for c in chunks {
            if self.done.insert(c.chunk) {
                self.rows_total += c.rows;
            }
        }
        self.waves_total.insert(wave);
        Ok(())
    }

    /// After the plans or facts rows of a wave were found already applied:
    /// they must record the outcome this call derived from bronze's commit of
    /// the wave (the same chunks, rows, stamps, and bronze version). Another
    /// outcome for one wave would mark chunks done that bronze holds other
    /// rows of, so it is exit 3 naming both, never accepted.
    fn check_recorded_wave(&self, wave: i64, meant: &[ChunkPayload], recorded: &[ChunkPayload], table: &str) -> StepResult<()> {
        let key = |c: &ChunkPayload, with_version: bool| (c.chunk, c.rows, c.stamp, if with_version { c.bronze_version } else { None });
        // A wave rebuilt from bronze's rows (its commit cleaned up) knows no bronze version.
        let with_version = meant.iter().all(|c| c.bronze_version.is_some());
        let mut a: Vec<_> = meant.iter().map(|c| key(c, with_version)).collect();
        let mut b: Vec<_> = recorded.iter().map(|c| key(c, with_version)).collect();
        a.sort();
        b.sort();
        if a == b {
            return Ok(());
        }
        let show = |v: &[(i64, i64, Lsn, Option<i64>)]| {
            v.iter()
                .map(|(c, r, l, bv)| format!("chunk {c}: {r} rows at {l}{}", bv.map(|v| format!(" (bronze version {v})")).unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        Err(StepError::NeedsPerson(format!(
            "wave {wave} of the chunked snapshot at {} has two outcomes: bronze's commit of it says [{}], but the {table} table \
             records [{}] under txn {}. Stop every other backfill of app_id '{}' (an older mssql-cdc commits an empty wave \
             without bronze), then open a new snapshot (a new generation) for this table",
            self.s,
            show(&a),
            if b.is_empty() { "nothing".to_string() } else { show(&b) },
            txn_wave_rows(&self.app, self.s, wave).app_id,
            self.app
        )))
    }

    /// Writes the completion row once every planned chunk has its facts row.
    async fn complete_if_done(&mut self, commit_ts: Option<DateTime<Utc>>) -> StepResult<bool> {
        if self.done.len() < self.chunks_total {
            return Ok(false);
        }
        // The stream may have hit a purged range since this call started.
        self.facts.update_state().await.map_err(StepError::delta(self.facts.table_url().to_string()))?;
        let rows = state::facts_rows(&self.facts, &self.app).await?;
        if is_completed(&rows, self.s) {
            return Ok(true);
        }
        let g = &self.gap_check;
        refuse_over_stream_gap(&g.source, &g.instance, &rows, &g.open, g.on_data_loss, &g.workflow).await?;
        let mut row = self.header.clone();
        row.recorded_at = Some(Utc::now());
        row.event = Some(if self.kind == EVENT_RESNAPSHOT { EVENT_RESNAPSHOT } else { EVENT_BOOTSTRAP }.into());
        row.min_lsn = Some(self.s);
        row.max_lsn = Some(self.s);
        row.rows = Some(self.rows_total);
        row.commit_ts = commit_ts.or(row.commit_ts);
        row.lost_from_ts = self.gap.lost_from_ts;
        row.lost_to_ts = self.gap.lost_to_ts;
        row.retention_watermark_ts = self.gap.lost_to_ts;
        row.detail = Some(json!({"mode": "chunked", "snapshot": self.s.to_hex(), "chunks": self.chunks_total, "waves": self.waves_total.len()}));
        append_facts_rows(&mut self.facts, &self.app, vec![row], &self.completion_txn).await?;
        failpoint!("chunked.after_complete");
        tracing::info!(snapshot = %self.s, rows = self.rows_total, chunks = self.chunks_total, "chunked snapshot complete");
        Ok(true)
    }
}

/// Rebuilds the chunk payloads of a wave whose bronze commit is no longer in
/// the log: from its rows in bronze (the chunks of `_snapshot = S` from the
/// wave's first chunk to the last one with rows there), with the plan's bounds.
async fn chunks_from_bronze(bronze_table: &DeltaTable, s: Lsn, wave: i64, plan: &PlanPayload, first: i64) -> StepResult<Vec<ChunkPayload>> {
    let sql = format!(
        "SELECT {chunk} AS chunk, COUNT(*) AS n, MIN({start}) AS stamp FROM t WHERE {snap} = {s} AND {op} = 0 AND {chunk} >= {first} GROUP BY {chunk}",
        chunk = bronze::CHUNK,
        start = bronze::START_LSN,
        snap = bronze::SNAPSHOT,
        op = bronze::OPERATION,
        s = sql_str(&s.to_hex()),
    );
    let batches = delta::query(bronze_table, &sql).await?;
    let mut found: BTreeMap<i64, (i64, Lsn)> = BTreeMap::new();
    for b in &batches {
        use deltalake::arrow::array::{Array, Int64Array, StringArray};
        let c = b.column(0).as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal("chunk column".into()))?;
        let n = b.column(1).as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal("count column".into()))?;
        let st = b.column(2).as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("stamp column".into()))?;
        for i in 0..b.num_rows() {
            if c.is_null(i) {
                continue;
            }
            let stamp = Lsn::parse(st.value(i)).map_err(|e| StepError::Internal(e.to_string()))?;
            found.insert(c.value(i), (n.value(i), stamp));
        }
    }
    let Some((&last, _)) = found.iter().next_back() else {
        return Err(StepError::NeedsPerson(format!(
            "bronze records wave {wave} of the chunked snapshot at {s}, but neither its commit nor its rows are there: \
             open a new snapshot (a new generation) for this table"
        )));
    };
    let stamp = found.values().map(|(_, l)| *l).min().unwrap_or(s);
    let last_planned = plan.chunks.len() as i64 - 1;
    Ok(plan
        .chunks
        .iter()
        .filter(|c| c.chunk >= first && c.chunk <= last)
        .map(|c| ChunkPayload {
            chunk: c.chunk,
            wave,
            lo: c.lo.clone(),
            hi: c.hi.clone(),
            last: c.chunk == last_planned,
            rows: found.get(&c.chunk).map(|x| x.0).unwrap_or(0),
            stamp,
            max_lsn: stamp,
            read_ms: None,
            read_bytes: None,
            rounds: 1,
            bronze_version: None,
            fence: None,
        })
        .collect())
}

/// Runs the `backfill` step.
pub async fn backfill(ctx: &mut Context, args: &BackfillArgs) -> StepResult<BackfillResult> {
    let started = Instant::now();
    let app = ctx.workflow.app_id.clone();
    let mut result = BackfillResult { step: "backfill", ..Default::default() };
    ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
    // Chunks are read with the columns of the instance the stream is on
    // (engine::switch's module docs argue why, and why a wave past a newer
    // instance's start waits for the stream).
    let instances = super::switch::follow_stream(ctx).await?;
    let mut rows = state::facts_rows(&ctx.facts, &app).await?;
    let min = ctx.source.min_lsn(&ctx.instance.name).await?;
    if let Some(full) = full_holding_mode(&rows, min) {
        return Err(mode_conflict(&full, Mode::Chunked));
    }
    let mut open = open_chunked(&rows);
    if open.is_none() && ctx.workflow.snapshot.bootstrap && ctx.workflow.snapshot.mode == crate::workflow::SnapshotMode::Chunked {
        // The workflow asks for a chunked bootstrap the stream has not opened
        // yet: open it here, so the two steps may be called in either order.
        if ensure_bootstrap_open(ctx).await?.is_some() {
            rows = state::facts_rows(&ctx.facts, &app).await?;
            open = open_chunked(&rows);
        }
    }
    let Some(o) = open else {
        result.generation = generation_of(&rows);
        if let Some(c) = chunked_of_generation(&rows) {
            let p = progress(&rows, c.s);
            result.snapshot = Some(c.s);
            result.chunks_done = p.done.len();
            result.chunks_total = p.done.len();
        }
        result.done = true;
        result.reason = Some("no chunked snapshot is open: nothing to backfill".into());
        return Ok(result);
    };
    result.snapshot = Some(o.s);
    result.generation = o.generation;
    // With the stream's instance (followed above), before any plan or wave is written.
    super::check_no_renamed_columns(ctx, "backfill")?;
    // A gap in the stream after S ruins the snapshot: no chunk is worth reading.
    refuse_over_stream_gap(&ctx.source, &ctx.instance.name, &rows, &o, ctx.workflow.stream.on_data_loss, &ctx.workflow.path).await?;
    let isolation = args.isolation.unwrap_or(ctx.workflow.snapshot.isolation);
    let mut plans_table = open_plans(ctx).await?;
    let location = plans::location_for(&ctx.workflow.target.bronze);
    let prow = plan_rows(&mut plans_table, &app, o.s).await?;
    let open_payload: OpenPayload = payload_of(&prow, EVENT_SNAPSHOT_OPEN, "open", &location)?;
    let keys_now = ctx.snapshot_keys();
    if !same_columns(&open_payload.keys, &keys_now) {
        return Err(StepError::Config(format!(
            "the chunked snapshot at {} is cut on ({}), but the workflow's keys are now ({}): a plan never moves to other columns. \
             Set snapshot.keys back to [{}] until the snapshot completes",
            o.s,
            open_payload.keys.join(", "),
            keys_now.join(", "),
            open_payload.keys.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", ")
        )));
    }
    let plan = ensure_plan(ctx, &mut plans_table, &o, &open_payload, &rows, args, isolation).await?;
    result.chunks_total = plan.chunk_count;

    // Reload after planning: the facts now hold every row this call relies on.
    rows = state::facts_rows(&ctx.facts, &app).await?;
    let mut prog = progress(&rows, o.s);
    let mut header = ctx.fact_row(o.generation);
    header.recorded_at = None;
    header.commit_ts = ctx.commit_time(o.s).await?;
    // A re-snapshot's completion carries the gap its open recorded; a
    // switch's open names the batch its completion's txn is keyed by.
    let open_row = rows.iter().find(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN) && r.min_lsn == Some(o.s) && r.generation == o.generation);
    let gap = open_row.map(|r| super::snapshot::Gap { lost_from_ts: r.lost_from_ts, lost_to_ts: r.lost_to_ts }).unwrap_or_default();
    let completion_txn = match open_row.and_then(switch_batch_of) {
        Some(b) => txn_switch_done(&app, o.s, b),
        None => txn_completion(&app, o.generation),
    };
    let mut sink = Sink {
        app: app.clone(),
        s: o.s,
        generation: o.generation,
        kind: o.kind.clone(),
        header,
        gap,
        completion_txn,
        bronze: ctx.bronze.clone(),
        facts: ctx.facts.clone(),
        plans: plans_table,
        chunks_total: plan.chunk_count,
        done: prog.done.keys().copied().collect(),
        rows_total: prog.done.values().sum(),
        waves_total: prog.waves.clone(),
        gap_check: GapCheck {
            source: ctx.source.clone(),
            instance: ctx.instance.name.clone(),
            open: o.clone(),
            on_data_loss: ctx.workflow.stream.on_data_loss,
            workflow: ctx.workflow.path.clone(),
        },
    };

    // Repair: a wave whose bronze or plans rows are in without its facts rows.
    let wave_app = txn_wave_bronze(&app, o.s, 0).app_id;
    let rows_app = txn_wave_rows(&app, o.s, 0).app_id;
    let bv = delta::txn_version(&sink.bronze, &wave_app).await?;
    let pv = delta::txn_version(&sink.plans, &rows_app).await?;
    let fv = delta::txn_version(&sink.facts, &rows_app).await?;
    if pv > fv {
        let w = pv.expect("greater than something");
        let prs = plan_rows(&mut sink.plans, &app, o.s).await?;
        let chunks: Vec<ChunkPayload> = prs
            .iter()
            .filter(|r| r.event == EVENT_SNAPSHOT_CHUNK && r.wave == Some(w))
            .filter_map(|r| serde_json::from_value(r.detail.clone()).ok())
            .collect();
        tracing::warn!(wave = w, "the plans table holds a wave without its facts rows (a crash between the two): writing them now");
        let ts = match chunks.first() {
            Some(c) => ctx.commit_time(c.stamp).await?,
            None => None,
        };
        sink.write_wave_facts(&chunks, ts, true, None).await?;
        result.repaired_wave = Some(w);
    } else if bv > pv.max(fv) {
        let w = bv.expect("greater than something");
        let chunks: Vec<ChunkPayload> = match delta::find_txn_commit(&sink.bronze, &Txn::new(wave_app.clone(), w)).await? {
            Some((version, meta)) => meta
                .get("chunks")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|c| {
                            let mut c = c.clone();
                            c["wave"] = json!(w);
                            c["bronze_version"] = json!(version);
                            c["read_ms"] = Value::Null;
                            serde_json::from_value::<ChunkPayload>(c).ok()
                        })
                        .collect()
                })
                .unwrap_or_default(),
            None if ctx.instance.index_columns.is_empty() => {
                // A heap's chunks count later changes against their fences,
                // which only the commit's metadata holds.
                return Err(StepError::NeedsPerson(format!(
                    "bronze records wave {w} of the chunked snapshot at {} of a table without a unique index, but the wave's \
                     commit (which holds its chunks' read fences) is no longer in the log: open a new snapshot (a new generation)",
                    o.s
                )));
            }
            None => {
                let first = plan.chunks.iter().map(|c| c.chunk).find(|c| !sink.done.contains(c)).unwrap_or(0);
                tracing::warn!(wave = w, "the wave's bronze commit is no longer in the log: rebuilding its facts from its rows in bronze");
                chunks_from_bronze(&sink.bronze, o.s, w, &plan, first).await?
            }
        };
        if chunks.is_empty() {
            return Err(StepError::Internal(format!("bronze's commit of wave {w} names no chunks")));
        }
        tracing::warn!(wave = w, chunks = chunks.len(), "bronze holds a wave without its facts rows (a crash between the commits): writing them now");
        let ts = ctx.commit_time(chunks[0].stamp).await?;
        sink.finish_wave(&chunks, ts, true, None).await?;
        result.repaired_wave = Some(w);
    }
    if result.repaired_wave.is_some() {
        rows = state::facts_rows(&sink.facts, &app).await?;
        prog = progress(&rows, o.s);
    }
    if sink.complete_if_done(None).await? || is_completed(&state::facts_rows(&sink.facts, &app).await?, o.s) {
        result.chunks_done = sink.done.len();
        result.done = true;
        result.reason = Some("complete".into());
        ctx.facts = sink.facts;
        ctx.bronze = sink.bronze;
        result.duration_ms = started.elapsed().as_millis() as i64;
        return Ok(result);
    }

    // The waves. A pool of `parallelism` readers lives for the whole call and
    // pulls chunks from one queue; when the queue runs dry the reader that
    // found it empty stamps the next wave and queues its chunks, so no
    // connection waits for a wave's slowest chunk. Each chunk is written to
    // its own data files as it is read. This task commits the waves, in order,
    // as each one's chunks are all in: the reads go on meanwhile, but only one
    // wave ahead. While two waves are uncommitted (MAX_UNCOMMITTED_WAVES) a
    // reader that finds the queue empty waits on `commits`, which this task
    // bumps after each commit and when the call fails, then asks again: it
    // gets a chunk, waits again, or (failed, out of budget) exits.
    let pending: VecDeque<PlannedChunk> = plan.chunks.iter().filter(|c| !sink.done.contains(&c.chunk)).cloned().collect();
    let first_wave = [bv, pv, fv, prog.last_wave].into_iter().flatten().max().map(|w| w + 1).unwrap_or(0);
    let parallelism = ctx.workflow.snapshot.parallelism.max(1);
    let shape = keyset_shape(ctx, &plan.keys);
    let coordinator = Arc::new(Mutex::new(Coordinator {
        pending,
        queue: VecDeque::new(),
        next_wave: first_wave,
        waves_started: 0,
        waves_committed: 0,
        reading: BTreeMap::new(),
        stop_reason: None,
        paused: false,
        failed: false,
        pace_round_seconds: prog.pace_round_seconds,
        max_waves: args.max_waves,
        deadline: args.max_seconds.map(|s| started + Duration::from_secs_f64(s.max(0.0))),
        min_headroom_hours: args.min_headroom_hours.or(ctx.workflow.snapshot.min_headroom_hours),
        target_wave_seconds: args.target_wave_seconds.unwrap_or(ctx.workflow.snapshot.target_wave_seconds),
        parallelism,
        open_end: plan.open_end,
        last_chunk: plan.chunks.len() as i64 - 1,
        max_key: open_payload.max.clone(),
        keys: SourceKeys { source: ctx.source.clone(), table: ctx.workflow.table_name(), keys: plan.keys.clone(), isolation },
        shape,
        facts: ctx.facts.clone(),
        app: app.clone(),
        generation: o.generation,
        zone: ctx.zone.clone(),
        s: o.s,
        stream_instance: ctx.instance.clone(),
        instances,
    }));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<ReadEvent>();
    // Waves this call committed; every change (and a failure) wakes the readers waiting for a commit.
    let (commits, commits_seen) = tokio::sync::watch::channel(0u32);
    // The readers' bronze is this state, never refreshed, and `schema` is
    // read from it: each chunk's writer (`ChunkReader::read`) has the
    // columns its rows are converted to, whatever a concurrent call adds to
    // bronze meanwhile (the race `delta::append_idempotent_with` and the
    // stream's batch guard against). The wave's commit (`Sink::commit`,
    // `delta::commit_adds`) is made on bronze's newest state.
    let reader = ChunkReader {
        source: ctx.source.clone(),
        bronze: ctx.bronze.clone(),
        schema: ctx.bronze_schema()?,
        base: SnapshotRead {
            table: ctx.workflow.table_name(),
            columns: ctx.instance.columns.clone(),
            keys: plan.keys.clone(),
            range: KeyRange::all(),
            isolation,
            batch_rows: ctx.workflow.snapshot.batch_rows,
        },
        capture_instance: ctx.instance.name.clone(),
        s: o.s,
        fenced: ctx.instance.index_columns.is_empty(),
        zone: ctx.zone.clone(),
    };
    let mut readers = Vec::with_capacity(parallelism);
    for _ in 0..parallelism {
        let (coordinator, tx, reader, seen) = (coordinator.clone(), tx.clone(), reader.clone(), commits_seen.clone());
        readers.push(tokio::spawn(async move { reader.run(coordinator, tx, seen).await }));
    }
    drop(tx);
    drop(commits_seen);
    let mut waves: BTreeMap<i64, WaveAcc> = BTreeMap::new();
    let mut next_commit = first_wave;
    let mut failure: Option<StepError> = None;
    while let Some(event) = rx.recv().await {
        match event {
            ReadEvent::WaveStarted { wave, chunks, stamp, stamp_ts, rounds, at } => {
                waves.insert(wave, WaveAcc { expected: chunks, stamp, stamp_ts, rounds, started: at, chunks: Vec::new(), adds: Vec::new(), rows: 0, ended: at });
            }
            ReadEvent::ChunkRead { wave, chunk, rows, read_ms, read_bytes, fence, adds, ended } => {
                if let Some(acc) = waves.get_mut(&wave) {
                    acc.rows += rows;
                    acc.adds.extend(adds);
                    acc.ended = acc.ended.max(ended);
                    acc.chunks.push((chunk, rows, read_ms, read_bytes, fence));
                }
            }
            ReadEvent::Failed(e) => {
                failure.get_or_insert(e);
            }
        }
        // Commit every wave whose chunks are all in, in wave order.
        while failure.is_none() && waves.get(&next_commit).is_some_and(|w| w.chunks.len() >= w.expected) {
            let acc = waves.remove(&next_commit).expect("checked above");
            let committed = async {
                let max_after = ctx.source.max_lsn().await?.unwrap_or(acc.stamp);
                let read = acc.into_wave(next_commit, max_after, coordinator.lock().await.last_chunk);
                sink.commit(read).await
            }
            .await;
            match committed {
                Ok(c) => {
                    result.waves += 1;
                    result.rows += c.rows;
                    result.wave_fixed_seconds.push(c.fixed_seconds);
                    coordinator.lock().await.waves_committed += 1;
                    // After the count is in the coordinator: a reader woken by
                    // this finds room for the next wave.
                    let _ = commits.send_replace(result.waves);
                    next_commit += 1;
                }
                Err(e) => failure = Some(e),
            }
        }
        if failure.is_some() {
            // Stop handing out chunks; the readers finish the chunk in hand,
            // and those waiting for a commit wake, find the call failed and exit.
            coordinator.lock().await.failed = true;
            let _ = commits.send_replace(result.waves);
        }
    }
    for r in readers {
        if let Err(e) = r.await {
            failure.get_or_insert(StepError::Internal(format!("a chunk reader panicked: {e}")));
        }
    }
    let (stop_reason, paused) = {
        let c = coordinator.lock().await;
        (c.stop_reason.clone(), c.paused)
    };
    result.paused = paused;
    result.chunks_done = sink.done.len();
    result.done = sink.done.len() >= sink.chunks_total;
    ctx.facts = sink.facts;
    ctx.bronze = sink.bronze;
    if let Some(e) = failure {
        return Err(e);
    }
    result.reason = if result.done { Some("complete".into()) } else { stop_reason };
    result.duration_ms = started.elapsed().as_millis() as i64;
    Ok(result)
}

/// What the readers tell the committing task.
enum ReadEvent {
    /// A wave was stamped and its chunks queued.
    WaveStarted { wave: i64, chunks: usize, stamp: Lsn, stamp_ts: Option<DateTime<Utc>>, rounds: u32, at: Instant },
    /// One chunk is read and its data files written.
    ChunkRead { wave: i64, chunk: PlannedChunk, rows: i64, read_ms: i64, read_bytes: i64, fence: Option<DateTime<Utc>>, adds: Vec<deltalake::kernel::Add>, ended: Instant },
    Failed(StepError),
}

/// A wave being read.
struct WaveAcc {
    expected: usize,
    stamp: Lsn,
    stamp_ts: Option<DateTime<Utc>>,
    rounds: u32,
    #[allow(dead_code)]
    started: Instant,
    chunks: Vec<(PlannedChunk, i64, i64, i64, Option<DateTime<Utc>>)>,
    adds: Vec<deltalake::kernel::Add>,
    rows: i64,
    ended: Instant,
}

impl WaveAcc {
    fn into_wave(mut self, wave: i64, max_after: Lsn, last_chunk: i64) -> WaveRead {
        self.chunks.sort_by_key(|c| c.0.chunk);
        let chunks = self
            .chunks
            .into_iter()
            .map(|(c, rows, ms, bytes, fence)| ChunkPayload {
                chunk: c.chunk,
                wave,
                lo: c.lo,
                hi: c.hi,
                last: c.chunk == last_chunk,
                rows,
                stamp: self.stamp,
                max_lsn: max_after,
                read_ms: Some(ms),
                read_bytes: Some(bytes),
                rounds: self.rounds,
                bronze_version: None,
                fence,
            })
            .collect();
        WaveRead { wave, chunks, adds: self.adds, rows: self.rows, read_ended: self.ended, stamp_ts: self.stamp_ts }
    }
}

/// A chunk handed to a reader, with its wave's stamp.
struct WorkItem {
    wave: i64,
    chunk: PlannedChunk,
    stamp: Lsn,
    stamp_ts: Option<DateTime<Utc>>,
}

/// Hands out chunks and starts waves (the call's budgets and the headroom
/// pause are checked only when a wave would start).
struct Coordinator {
    pending: VecDeque<PlannedChunk>,
    queue: VecDeque<WorkItem>,
    next_wave: i64,
    waves_started: u32,
    /// Of those, the waves whose commit (bronze, plans, facts) is done.
    waves_committed: u32,
    /// Waves being read: wave -> (chunks not read yet, slowest read so far in ms).
    reading: BTreeMap<i64, (usize, i64)>,
    stop_reason: Option<String>,
    paused: bool,
    failed: bool,
    pace_round_seconds: Option<f64>,
    max_waves: Option<u32>,
    deadline: Option<Instant>,
    min_headroom_hours: Option<f64>,
    target_wave_seconds: f64,
    parallelism: usize,
    open_end: bool,
    last_chunk: i64,
    max_key: Option<Key>,
    keys: SourceKeys,
    shape: KeysetShape,
    facts: DeltaTable,
    app: String,
    generation: i32,
    zone: crate::source::ServerZone,
    s: Lsn,
    /// The instance the stream is on: the chunks' columns.
    stream_instance: crate::source::CaptureInstance,
    /// The table's instances when the call started (empty when the workflow pins one).
    instances: Vec<crate::source::CaptureInstance>,
}

/// What [`Coordinator::next`] gives a reader.
enum Next {
    /// A chunk to read.
    Chunk(WorkItem),
    /// Nothing to read now, and no wave may start: [`MAX_UNCOMMITTED_WAVES`]
    /// are uncommitted. Ask again after the next commit.
    Wait,
    /// Nothing more for this call.
    Done,
}

impl Coordinator {
    /// The next chunk to read, starting a wave when the queue is empty and
    /// fewer than [`MAX_UNCOMMITTED_WAVES`] are uncommitted.
    async fn next(&mut self, events: &tokio::sync::mpsc::UnboundedSender<ReadEvent>) -> StepResult<Next> {
        if self.failed {
            return Ok(Next::Done);
        }
        if let Some(w) = self.queue.pop_front() {
            return Ok(Next::Chunk(w));
        }
        if self.pending.is_empty() || self.stop_reason.is_some() {
            return Ok(Next::Done);
        }
        if self.max_waves.is_some_and(|m| self.waves_started >= m) {
            self.stop_reason = Some(format!("max_waves ({}) reached", self.waves_started));
            return Ok(Next::Done);
        }
        // A wave starts only before the deadline, and (next) only while at most
        // one other is uncommitted; it is sized (below) to what is left. When
        // the time runs out, one wave may still be reading and one committing,
        // so the call passes max_seconds by at most a wave and the commit under
        // way (adr-0028 Amendment 3). A reader that waited is asked here again,
        // so a wave never starts after the deadline.
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.stop_reason = Some("max_seconds reached".into());
            return Ok(Next::Done);
        }
        if self.waves_started.saturating_sub(self.waves_committed) >= MAX_UNCOMMITTED_WAVES {
            return Ok(Next::Wait);
        }
        if let Some(h) = self.min_headroom_hours {
            let headroom = newest_headroom(&self.facts, &self.app, self.generation).await?;
            if headroom.is_none_or(|s| s < h * 3600.0) {
                self.paused = true;
                self.stop_reason = Some(match headroom {
                    Some(s) => format!(
                        "paused: the stream's retention headroom is {:.2} h, below min_headroom_hours {h}; call again once the stream has caught up",
                        s / 3600.0
                    ),
                    None => format!("paused: the stream has no batch with a headroom yet (min_headroom_hours {h}); run the stream step first"),
                });
                return Ok(Next::Done);
            }
        }
        let remaining = self.deadline.map(|d| d.saturating_duration_since(Instant::now()).as_secs_f64());
        let rounds_left = self.pending.len().div_ceil(self.parallelism);
        let rounds = rounds_for_wave(self.target_wave_seconds, self.pace_round_seconds, remaining, rounds_left);
        let take = (rounds * self.parallelism).min(self.pending.len());
        let mut chunks: Vec<PlannedChunk> = self.pending.drain(..take).collect();
        if self.open_end {
            if let (Some(c), Some(max)) = (chunks.iter_mut().find(|c| c.chunk == self.last_chunk), &self.max_key) {
                // The last chunk ends at the first key after MAX as it is now,
                // so rows inserted above MAX since S (the stream's) do not pile into it.
                c.hi = planner::last_bound(&self.keys, max, &self.shape).await?;
            }
        }
        // The stamp: read before any of the wave's SELECTs starts (P1), never below S (P2).
        let stamp = self.keys.source.max_lsn().await?.ok_or_else(|| StepError::Temporary("max LSN is NULL: call again once capture has run".into()))?;
        if stamp < self.s {
            return Err(StepError::Temporary(format!(
                "the source's max LSN {stamp} is below the snapshot's S {} (a readable secondary behind the primary?): \
                 a chunk stamped below S could miss commits the stream does not have. Read from the server S came from",
                self.s
            )));
        }
        if let Some(newer) = super::switch::waits_for_switch(stamp, &self.stream_instance, &self.instances) {
            // The chunks go back unread: stamped here, read with the stream's
            // columns, they would outrank the newer instance's changes up to
            // the stamp without the columns those changes carry.
            for c in chunks.into_iter().rev() {
                self.pending.push_front(c);
            }
            self.paused = true;
            self.stop_reason = Some(format!(
                "paused: the wave's stamp {stamp} is past the start {} of capture instance '{}', which the stream (on '{}') has \
                 not switched to yet; run the stream step, then call backfill again",
                newer.start_lsn.map(|l| l.to_string()).unwrap_or_default(),
                newer.name,
                self.stream_instance.name
            ));
            return Ok(Next::Done);
        }
        let stamp_ts = self.keys.source.lsn_to_time(stamp).await?.map(|l| self.zone.to_utc(l));
        let wave = self.next_wave;
        self.next_wave += 1;
        self.waves_started += 1;
        self.reading.insert(wave, (chunks.len(), 0));
        let _ = events.send(ReadEvent::WaveStarted { wave, chunks: chunks.len(), stamp, stamp_ts, rounds: rounds as u32, at: Instant::now() });
        self.queue.extend(chunks.into_iter().map(|chunk| WorkItem { wave, chunk, stamp, stamp_ts }));
        Ok(self.queue.pop_front().map_or(Next::Done, Next::Chunk))
    }

    /// A chunk of `wave` is read in `read_ms`. Once the wave's chunks are all
    /// read, its slowest read is the pace of the waves stamped after it in
    /// this call (the record's "pace of the last wave: its read ... per
    /// round"; its commit runs beside the next wave's read). With one
    /// connection the next wave is stamped right after, at this pace; with
    /// more, a reader may have stamped it while this wave's last chunk was
    /// still being read, at the pace of the wave before.
    fn chunk_read(&mut self, wave: i64, read_ms: i64) {
        let Some(w) = self.reading.get_mut(&wave) else { return };
        w.0 = w.0.saturating_sub(1);
        w.1 = w.1.max(read_ms);
        if w.0 == 0 {
            let slowest = w.1;
            self.reading.remove(&wave);
            self.pace_round_seconds = Some(slowest as f64 / 1000.0);
        }
    }
}

/// One source connection's reader: takes chunks until the coordinator has none.
#[derive(Clone)]
struct ChunkReader {
    source: SharedSource,
    /// Bronze as `schema` was read from it; never refreshed (see `backfill`).
    bronze: DeltaTable,
    schema: deltalake::arrow::datatypes::SchemaRef,
    base: SnapshotRead,
    capture_instance: String,
    s: Lsn,
    /// Read chunks fenced: the table is a heap.
    fenced: bool,
    /// The server's zone, for the fence.
    zone: crate::source::ServerZone,
}

impl ChunkReader {
    /// `commits` counts the waves committed; a reader told to wait sleeps
    /// until it changes (the committing task also bumps it when the call
    /// fails), so it never misses the commit it waits for: it marks the value
    /// seen before asking, and the count reaches the coordinator before it
    /// is sent. It exits when the sender is gone.
    async fn run(
        self,
        coordinator: Arc<Mutex<Coordinator>>,
        events: tokio::sync::mpsc::UnboundedSender<ReadEvent>,
        mut commits: tokio::sync::watch::Receiver<u32>,
    ) {
        loop {
            commits.mark_unchanged();
            let next = coordinator.lock().await.next(&events).await;
            let item = match next {
                Ok(Next::Chunk(item)) => item,
                Ok(Next::Done) => return,
                Ok(Next::Wait) => {
                    if commits.changed().await.is_err() {
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    coordinator.lock().await.failed = true;
                    let _ = events.send(ReadEvent::Failed(e));
                    return;
                }
            };
            match self.read_retrying(&item).await {
                Ok(ChunkReadOutcome { rows, read_ms, read_bytes, fence, adds }) => {
                    // Before asking for the next chunk: a wave stamped next is sized at this pace.
                    coordinator.lock().await.chunk_read(item.wave, read_ms);
                    let _ = events.send(ReadEvent::ChunkRead { wave: item.wave, chunk: item.chunk, rows, read_ms, read_bytes, fence, adds, ended: Instant::now() });
                }
                Err(e) => {
                    coordinator.lock().await.failed = true;
                    let _ = events.send(ReadEvent::Failed(e));
                    return;
                }
            }
        }
    }

    /// [`ChunkReader::read`], again after a transient failure (a dropped
    /// connection, a lock timeout behind a writer, a deadlock victim), with
    /// backoff for up to a minute. A chunk read is idempotent: the failed
    /// attempt's data files are never committed, the stamp was read before
    /// the first attempt's SELECT (so before every later one's too), and a
    /// fenced read takes its own fence each time.
    async fn read_retrying(&self, item: &WorkItem) -> StepResult<ChunkReadOutcome> {
        use backoff::backoff::Backoff;
        let mut schedule = backoff::ExponentialBackoff {
            initial_interval: Duration::from_millis(200),
            max_interval: Duration::from_secs(10),
            max_elapsed_time: Some(Duration::from_secs(60)),
            ..backoff::ExponentialBackoff::default()
        };
        loop {
            match self.read(item).await {
                Err(StepError::Source(crate::source::SourceError::Transient(msg))) => match schedule.next_backoff() {
                    Some(wait) => {
                        tracing::warn!(chunk = item.chunk.chunk, wave = item.wave, ?wait, "reading the chunk failed, reading it again: {msg}");
                        tokio::time::sleep(wait).await;
                    }
                    None => return Err(StepError::Source(crate::source::SourceError::Transient(msg))),
                },
                other => return other,
            }
        }
    }

    /// Reads one chunk into data files of its own.
    async fn read(&self, item: &WorkItem) -> StepResult<ChunkReadOutcome> {
        // Not a commit boundary (not in `FAILPOINTS`): a race test holds a
        // reader here while the wave before commits (tests/records_race.rs).
        failpoint!("chunked.before_chunk_read");
        let label = self.bronze.table_url().to_string();
        let t0 = Instant::now();
        let mut writer = delta::streaming_writer(&self.bronze)?;
        let read = SnapshotRead { range: KeyRange { lo: item.chunk.lo.clone(), hi: item.chunk.hi.clone() }, ..self.base.clone() };
        let stamp = SnapshotStamp {
            snapshot: self.s,
            start_lsn: item.stamp,
            commit_ts: item.stamp_ts,
            capture_instance: self.capture_instance.clone(),
            chunk: Some(item.chunk.chunk),
        };
        // A heap's chunk is read fenced (the lock makes it exact at its
        // fence: see engine::apply::heap); a keyed table's is not locked.
        let (mut stream, fence) = if self.fenced {
            let f = self.source.snapshot_read_fenced(&read).await?;
            (f.batches, Some(f.fence))
        } else {
            (self.source.snapshot_read(&read).await?, None)
        };
        let mut rows = 0i64;
        let mut read_bytes = 0i64;
        while let Some(b) = stream.next().await {
            let b = b?;
            if b.num_rows() == 0 {
                continue;
            }
            rows += b.num_rows() as i64;
            read_bytes += b.get_array_memory_size() as i64;
            writer.write(bronze::from_snapshot(&b, &self.schema, &stamp)?).await.map_err(StepError::delta(&label))?;
        }
        let fence = match fence {
            Some(f) => Some(self.zone.fence_to_utc(f.await?)?),
            None => None,
        };
        let adds = writer.flush().await.map_err(StepError::delta(&label))?;
        Ok(ChunkReadOutcome { rows, read_ms: t0.elapsed().as_millis() as i64, read_bytes, fence, adds })
    }
}

/// What reading one chunk gave: its rows, how long it took, how many bytes
/// the rows took as read, and the data files they went to.
struct ChunkReadOutcome {
    rows: i64,
    read_ms: i64,
    read_bytes: i64,
    /// A fenced read's fence, in UTC.
    fence: Option<DateTime<Utc>>,
    adds: Vec<deltalake::kernel::Add>,
}

/// The stream's newest batch headroom in this generation, in seconds.
async fn newest_headroom(facts_table: &DeltaTable, app: &str, generation: i32) -> StepResult<Option<f64>> {
    let mut t = facts_table.clone();
    t.update_state().await.map_err(StepError::delta(t.table_url().to_string()))?;
    let sql = format!(
        "SELECT headroom_seconds FROM t WHERE app_id = {} AND generation = {generation} AND event IS NULL AND batch_id IS NOT NULL \
         ORDER BY batch_id DESC LIMIT 1",
        sql_str(app)
    );
    let batches = delta::query(&t, &sql).await?;
    for b in &batches {
        use deltalake::arrow::array::{Array, Float64Array};
        if let Some(a) = b.column(0).as_any().downcast_ref::<Float64Array>() {
            if a.len() > 0 && !a.is_null(0) {
                return Ok(Some(a.value(0)));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }

    fn open(gen: i32, s: u128, mode: &str) -> FactRow {
        FactRow {
            app_id: "a".into(),
            generation: gen,
            event: Some(EVENT_SNAPSHOT_OPEN.into()),
            min_lsn: Some(lsn(s)),
            max_lsn: Some(lsn(s)),
            detail: Some(json!({"mode": mode, "kind": "bootstrap", "generation": gen})),
            ..Default::default()
        }
    }

    fn done(gen: i32, s: u128) -> FactRow {
        FactRow { app_id: "a".into(), generation: gen, event: Some(EVENT_BOOTSTRAP.into()), min_lsn: Some(lsn(s)), max_lsn: Some(lsn(s)), ..Default::default() }
    }

    fn chunk(s: u128, c: i64, wave: i64, rows: i64, ms: i64, rounds: u32) -> FactRow {
        FactRow {
            app_id: "a".into(),
            event: Some(EVENT_SNAPSHOT_CHUNK.into()),
            rows: Some(rows),
            duration_ms: Some(ms),
            detail: Some(json!({"snapshot": lsn(s).to_hex(), "chunk": c, "wave": wave, "rounds": rounds})),
            ..Default::default()
        }
    }

    #[test]
    fn a_full_open_holds_the_mode_until_completed_passed_by_cleanup_or_joined_by_a_chunked_open() {
        let rows = vec![open(0, 10, "full")];
        assert_eq!(full_holding_mode(&rows, Some(lsn(5))).map(|o| o.s), Some(lsn(10)));
        // Cleanup passed S: the run can never complete, so it no longer holds.
        assert_eq!(full_holding_mode(&rows, Some(lsn(12))), None);
        // Completed (by any later completion).
        assert_eq!(full_holding_mode(&[open(0, 10, "full"), done(0, 11)], Some(lsn(5))), None);
        // A chunked open of its generation took the generation over.
        assert_eq!(full_holding_mode(&[open(0, 10, "full"), open(0, 12, "chunked")], Some(lsn(5))), None);
        // An older generation's full open is not this run's.
        assert_eq!(full_holding_mode(&[open(0, 10, "full"), done(1, 3)], Some(lsn(5))), None);
    }

    #[test]
    fn a_full_open_that_lost_its_generation_to_an_older_s_holds_nothing() {
        // Two concurrent bootstraps: the loser opened at 12, the winner at 10 completed generation 0.
        let rows = vec![open(0, 10, "full"), open(0, 12, "full"), done(0, 10)];
        assert_eq!(full_holding_mode(&rows, Some(lsn(5))), None);
        assert_eq!(snapshot_holding_mode(&rows, Some(lsn(5))), None);
        // A re-snapshot's open for generation 1 is not ended by generation 0's completion.
        let rows = vec![open(0, 10, "full"), done(0, 10), open(1, 12, "full")];
        assert_eq!(full_holding_mode(&rows, Some(lsn(5))).map(|o| (o.s, o.generation)), Some((lsn(12), 1)));
        // Nor by a completion of its own generation still to come: while none is written it holds.
        let rows = vec![open(0, 10, "full"), open(0, 12, "full")];
        assert_eq!(full_holding_mode(&rows, Some(lsn(5))).map(|o| o.s), Some(lsn(12)));
    }

    #[test]
    fn backfill_works_on_the_newest_chunked_open_of_the_current_generation() {
        let rows = vec![open(0, 10, "chunked"), open(1, 30, "chunked")];
        assert_eq!(open_chunked(&rows).map(|o| (o.s, o.generation)), Some((lsn(30), 1)));
        let rows = vec![open(0, 10, "chunked"), done(0, 10)];
        assert_eq!(open_chunked(&rows), None);
        assert_eq!(chunked_of_generation(&rows).map(|o| o.s), Some(lsn(10)));
        // A loss opened generation 1 without a chunked snapshot: generation 0's is abandoned.
        let rows = vec![open(0, 10, "chunked"), done(1, 40)];
        assert_eq!(open_chunked(&rows), None);
    }

    #[test]
    fn progress_counts_chunks_of_its_snapshot_and_the_newest_pace() {
        let rows = vec![chunk(10, 0, 0, 5, 4000, 2), chunk(10, 1, 0, 6, 3000, 2), chunk(10, 2, 1, 7, 1000, 1), chunk(99, 9, 5, 1, 1, 1)];
        let p = progress(&rows, lsn(10));
        assert_eq!(p.done.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(p.done.values().sum::<i64>(), 18);
        assert_eq!(p.last_wave, Some(1));
        assert_eq!(p.pace_round_seconds, Some(1.0), "rows without an append (written before it was recorded) count none");
    }

    /// The record's pace from the facts: the wave's read and its append, per
    /// round. Fails against a pace of the slowest read alone (the append left
    /// out), which sized the next call's first wave too large.
    #[test]
    fn the_pace_from_the_facts_adds_the_waves_append_per_round() {
        let with_append = |mut r: FactRow, ms: i64| {
            r.detail.as_mut().unwrap()["append_ms"] = json!(ms);
            r
        };
        // Wave 1 of 2 rounds: slowest read 3 s, append 2 s -> 3 + 2 / 2 = 4 s a round.
        let rows = vec![
            with_append(chunk(10, 0, 0, 5, 9000, 1), 9000),
            with_append(chunk(10, 1, 1, 5, 3000, 2), 2000),
            with_append(chunk(10, 2, 1, 5, 2500, 2), 2000),
        ];
        let p = progress(&rows, lsn(10));
        assert_eq!(p.pace_round_seconds, Some(4.0));
        // One round: the whole append on it.
        let rows = vec![with_append(chunk(10, 0, 0, 5, 1500, 1), 500)];
        assert_eq!(progress(&rows, lsn(10)).pace_round_seconds, Some(2.0));
        // A rebuilt wave (no read times) does not set the pace; the one before does.
        let mut rebuilt = chunk(10, 1, 1, 5, 0, 1);
        rebuilt.duration_ms = None;
        let rows = vec![with_append(chunk(10, 0, 0, 5, 1500, 1), 500), rebuilt];
        assert_eq!(progress(&rows, lsn(10)).pace_round_seconds, Some(2.0));
    }

    #[test]
    fn rounds_follow_the_target_the_pace_and_the_time_left() {
        assert_eq!(rounds_for_wave(300.0, None, None, 10), 1, "no pace yet: one round");
        assert_eq!(rounds_for_wave(0.0, Some(1.0), None, 10), 1, "target 0: one round a wave");
        assert_eq!(rounds_for_wave(300.0, Some(60.0), None, 10), 5);
        assert_eq!(rounds_for_wave(300.0, Some(60.0), Some(130.0), 10), 2, "bounded by max_seconds");
        assert_eq!(rounds_for_wave(300.0, Some(60.0), Some(10.0), 10), 1, "at least one");
        assert_eq!(rounds_for_wave(300.0, Some(1.0), None, 3), 3, "no more than are left");
        // With the commit: 50 s reads and a 40 s append over the 2 rounds before
        // make 70 s a round, so 4 rounds, where the read alone (50 s) gave 6.
        assert_eq!(round_pace(50.0, 40.0, 2), 70.0);
        assert_eq!(rounds_for_wave(300.0, Some(round_pace(50.0, 40.0, 2)), None, 10), 4);
        assert_eq!(rounds_for_wave(300.0, Some(round_pace(50.0, 0.0, 2)), None, 10), 6);
        // A wave of one round carries its whole append: 50 + 40 = 90 s, 3 rounds.
        assert_eq!(rounds_for_wave(300.0, Some(round_pace(50.0, 40.0, 1)), None, 10), 3);
        // Reads too fast to measure (0 ms): the append alone paces the wave.
        assert_eq!(rounds_for_wave(1.0, Some(round_pace(0.0, 0.3, 1)), None, 10), 3);
        // The time left caps it at the same pace: 150 s left hold 2 rounds of 70 s.
        assert_eq!(rounds_for_wave(300.0, Some(round_pace(50.0, 40.0, 2)), Some(150.0), 10), 2);
    }

    // Tests that close UNTESTED rows of docs/CONFORMANCE.md (28.72, 28.73, 28.126).

    #[test]
    fn a_plan_is_on_the_unique_index_for_its_columns_in_any_case_and_never_for_a_prefix() {
        // 28.126 (`keyset_shape`): catches a case-sensitive match (a plan on the index taken as not unique, so it
        // makes the extra seeks) and a prefix of the index taken for it (`zip` without the length check: a prefix
        // may repeat, and a unique plan skips the check that keeps its chunks non-empty).
        fn names(v: &[&str]) -> Vec<String> {
            v.iter().map(|s| s.to_string()).collect()
        }
        assert!(same_columns(&names(&["ID", "Name"]), &names(&["id", "name"])));
        assert!(!same_columns(&names(&["id"]), &names(&["id", "name"])));
    }

    /// A bronze table in `dir` holding these rows: (_snapshot, _chunk,
    /// _operation, _start_lsn); every other column NULL.
    async fn bronze_with(dir: &std::path::Path, rows: &[(Option<u128>, Option<i64>, i32, u128)]) -> DeltaTable {
        use deltalake::arrow::array::{ArrayRef, Int32Array, Int64Array, StringArray};
        let location = dir.join("bronze").to_string_lossy().into_owned();
        let columns = vec![crate::types::ColumnDesc::new("id", SqlType::Int, false)];
        let mut table = delta::open_or_create(&location, &std::collections::HashMap::new(), TableKind::Bronze, &bronze::schema(&columns), "test bronze")
            .await
            .unwrap();
        let schema = table.snapshot().unwrap().snapshot().arrow_schema();
        let n = rows.len();
        let arrays: Vec<ArrayRef> = schema
            .fields()
            .iter()
            .map(|f| {
                let a: ArrayRef = match f.name().as_str() {
                    bronze::SNAPSHOT => Arc::new(StringArray::from(rows.iter().map(|r| r.0.map(|s| lsn(s).to_hex())).collect::<Vec<_>>())) as ArrayRef,
                    bronze::CHUNK => Arc::new(Int64Array::from(rows.iter().map(|r| r.1).collect::<Vec<_>>())) as ArrayRef,
                    bronze::OPERATION => Arc::new(Int32Array::from(rows.iter().map(|r| Some(r.2)).collect::<Vec<_>>())) as ArrayRef,
                    bronze::START_LSN => Arc::new(StringArray::from(rows.iter().map(|r| Some(lsn(r.3).to_hex())).collect::<Vec<_>>())) as ArrayRef,
                    _ => return deltalake::arrow::array::new_null_array(f.data_type(), n),
                };
                deltalake::arrow::compute::cast(&a, f.data_type()).unwrap()
            })
            .collect();
        let batch = deltalake::arrow::record_batch::RecordBatch::try_new(schema.clone(), arrays).unwrap();
        delta::append_batches(&mut table, vec![batch], schema, &Txn::new("test#snap", 0), json!({})).await.unwrap();
        table
    }

    /// A plan of five integer chunks: (-inf, 10), [10, 20), [20, 30), [30, 40), [40, +inf).
    fn five_chunks() -> PlanPayload {
        let int = |v: i64| Some(vec![SqlValue::Int(v)]);
        let chunks: Vec<PlannedChunk> = (0..5i64)
            .map(|i| PlannedChunk { chunk: i, lo: if i == 0 { None } else { int(i * 10) }, hi: if i == 4 { None } else { int(i * 10 + 10) }, rows: Some(10) })
            .collect();
        PlanPayload {
            kind: "integer".into(),
            keys: vec!["id".into()],
            chunk_rows: 10,
            chunk_count: 5,
            chunks,
            open_end: false,
            isolation: Isolation::ReadCommitted,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wave_rebuilt_from_bronze_ends_at_its_last_chunk_with_rows_so_trailing_empty_chunks_are_read_again() {
        // 28.72. Catches a rebuild that records every planned chunk from `first` (chunk 4, empty in bronze, would be
        // marked done and never read), one that drops the `_snapshot = S` filter (an older snapshot's chunk-4 row
        // would count), one that drops `_chunk >= first` (an earlier wave's chunk 0 would be taken again), a
        // stamp other than the smallest, or middle empty chunks left out.
        let dir = tempfile::tempdir().unwrap();
        let (s, older) = (100u128, 50u128);
        let mut rows = Vec::new();
        rows.extend([(Some(s), Some(0), 0, 101); 2]); // wave 6's chunk 0, done before
        rows.extend([(Some(s), Some(1), 0, 105); 3]);
        rows.extend([(Some(s), Some(3), 0, 103); 2]);
        rows.push((Some(older), Some(4), 0, 51)); // an older snapshot's row
        rows.push((None, None, 2, 107)); // a change row
        let bronze_table = bronze_with(dir.path(), &rows).await;
        let plan = five_chunks();
        let got = chunks_from_bronze(&bronze_table, lsn(s), 7, &plan, 1).await.unwrap();
        let want: Vec<ChunkPayload> = [(1, 3), (2, 0), (3, 2)]
            .into_iter()
            .map(|(c, n): (usize, i64)| ChunkPayload {
                chunk: c as i64,
                wave: 7,
                lo: plan.chunks[c].lo.clone(),
                hi: plan.chunks[c].hi.clone(),
                last: false,
                rows: n,
                stamp: lsn(103),
                max_lsn: lsn(103),
                read_ms: None,
                read_bytes: None,
                rounds: 1,
                bronze_version: None,
                fence: None,
            })
            .collect();
        assert_eq!(got, want);
        // The older snapshot's wave reaches the last planned chunk: every chunk from 0 on, chunk 4 flagged last.
        let got = chunks_from_bronze(&bronze_table, lsn(older), 2, &plan, 0).await.unwrap();
        assert_eq!(got.iter().map(|c| (c.chunk, c.rows, c.last)).collect::<Vec<_>>(), vec![(0, 0, false), (1, 0, false), (2, 0, false), (3, 0, false), (4, 1, true)]);
        assert!(got.iter().all(|c| c.stamp == lsn(51) && c.wave == 2));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wave_whose_rows_are_not_in_bronze_needs_a_person() {
        // 28.73. Catches a rebuild that returns no chunks (the wave's facts would never be written and the
        // snapshot could complete without its rows) or a temporary error (the call would loop forever).
        let dir = tempfile::tempdir().unwrap();
        let bronze_table = bronze_with(dir.path(), &[(Some(100), Some(0), 0, 101), (Some(100), Some(1), 0, 102)]).await;
        for (s, first) in [(100u128, 2i64), (200, 0)] {
            let e = chunks_from_bronze(&bronze_table, lsn(s), 3, &five_chunks(), first).await.unwrap_err();
            assert!(matches!(e, StepError::NeedsPerson(_)), "S {s}, from chunk {first}: {e}");
            assert_eq!(e.exit_code(), 3);
            assert!(e.to_string().contains("wave 3") && e.to_string().contains("new snapshot"), "{e}");
        }
    }
}
