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
//!
//! The files, by concern:
//!
//! - `mod.rs`: what the other steps share with this one: the payload types,
//!   the txn ids, the rules read off the facts (which snapshot is open, which
//!   one holds the snapshot mode, a chunk's progress and a wave's pace) and
//!   the refusals built on them; it re-exports the public items of the others.
//! - `tables.rs`: the plans and facts tables: opening, appending, reading back.
//! - `open.rs`: the open (the key check, S, the key's extent).
//! - `planning.rs`: the plan, made once over the pure planner (`engine::plan`).
//! - `backfill.rs`: the `backfill` step: its checks, the wave repair, and the
//!   loop that commits the waves in order as their chunks come in.
//! - `reader.rs`: the readers: waves stamped and handed out (one wave read
//!   ahead at most, sized by the pace, paused on budgets and headroom), and
//!   each connection's chunk reads.
//! - `wave.rs`: a wave's commits (bronze, plans, facts) and the completion,
//!   and a wave's chunks rebuilt from bronze when its commit is gone.

mod backfill;
mod open;
mod planning;
mod reader;
mod tables;
mod wave;

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::state::{self, generation_of};
use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::delta::Txn;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;
use crate::source::{Isolation, SharedSource};
use crate::types::Key;

pub use self::backfill::{backfill, BackfillArgs, BackfillResult};
pub use self::open::{check_keys, ensure_bootstrap_open, ensure_open, ensure_open_with_gap, OpenResult};
pub use self::tables::open_plans;
pub(crate) use self::tables::{append_facts_rows, append_plans};

pub const EVENT_SNAPSHOT_PLAN: &str = "snapshot_plan";
pub const EVENT_SNAPSHOT_CHUNK: &str = "snapshot_chunk";

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
/// commit runs beside the next wave's read. So does [`backfill`](fn@backfill): once a
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    pub(super) fn lsn(n: u128) -> Lsn {
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
}
