//! The rules every step reads off the facts rows, and what a snapshot
//! records: pure functions and plain types, no I/O.
//!
//! Which generation is live, which snapshot is open, which one holds the
//! snapshot mode, how far a chunked snapshot has read and at what pace; the
//! payloads a chunked snapshot writes to the plans table; the txn ids of its
//! commits; the data-loss gap a re-snapshot closes. `state` derives the
//! stream's state with these rules, and every step that opens, reads,
//! completes or refuses a snapshot asks them rather than reading the rows its
//! own way, so two steps never disagree about what is open.
//!
//! Architecture invariant: this module imports no other module of the
//! engine. It is the bottom of the engine's module graph; `state` (the
//! stream's state and the facts table's reads and appends) stands right
//! above it, and the transitions above both (docs/ARCHITECTURE.md draws the
//! layers).

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_CAPTURE_INSTANCE_SWITCHED, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::delta::Txn;
use crate::error::StepError;
use crate::lsn::Lsn;
use crate::source::Isolation;
use crate::types::Key;

/// Facts event recording where a stream without a bootstrap started.
pub const EVENT_STREAM_START: &str = "stream_start";

/// The current generation: the highest a live row names (0 for a new stream).
///
/// A generation becomes live at its commit point: its completed snapshot
/// (`bootstrap`/`resnapshot`), its chunked open (the stream starts at S at
/// once), its recorded start, or a batch. A full re-snapshot's open row names
/// the generation it is taken for but does not make it live: until its
/// completion row the stream stays where it was, so a crash repeats the
/// recovery from the recorded start.
pub fn generation_of(rows: &[FactRow]) -> i32 {
    rows.iter().filter(|r| makes_generation_live(r)).map(|r| r.generation).max().unwrap_or(0)
}

/// Whether a row marks its generation as the stream's live one (see [`generation_of`]).
pub fn makes_generation_live(r: &FactRow) -> bool {
    match r.event.as_deref() {
        None => true,
        Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT) | Some(EVENT_STREAM_START) => true,
        Some(EVENT_SNAPSHOT_OPEN) => r.detail.as_ref().and_then(|d| d.get("mode")).and_then(serde_json::Value::as_str) == Some("chunked"),
        _ => false,
    }
}

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

pub(crate) fn opened_of(r: &FactRow) -> Option<Opened> {
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

pub(crate) fn chunk_key(s: Lsn) -> String {
    s.to_hex()
}

pub(crate) fn txn_open_plans(app: &str, s: Lsn) -> Txn {
    Txn::new(format!("{app}#snapopen.{}", chunk_key(s)), 0)
}
pub(crate) fn txn_open_facts(app: &str, generation: i32) -> Txn {
    Txn::new(format!("{app}#snapshots"), generation as i64)
}
pub(crate) fn txn_plan(app: &str, s: Lsn) -> Txn {
    Txn::new(format!("{app}#snapplan.{}", chunk_key(s)), 0)
}
pub(crate) fn txn_wave_bronze(app: &str, s: Lsn, wave: i64) -> Txn {
    Txn::new(format!("{app}#snap.{}", chunk_key(s)), wave)
}
pub(crate) fn txn_wave_rows(app: &str, s: Lsn, wave: i64) -> Txn {
    Txn::new(format!("{app}#snapchunks.{}", chunk_key(s)), wave)
}
pub(crate) fn txn_completion(app: &str, generation: i32) -> Txn {
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

/// The switch whose snapshot is not opened yet, as (S, switch batch id): the
/// current generation's newest `capture_instance_switched` row, unless a
/// chunked open of the generation is at or after its S or a completed
/// snapshot covers it (pure; see `engine::chunked::on_switch`).
pub fn switch_to_open(rows: &[FactRow]) -> Option<(Lsn, i64)> {
    let generation = generation_of(rows);
    let newest = rows
        .iter()
        .filter(|r| r.generation == generation && r.event.as_deref() == Some(EVENT_CAPTURE_INSTANCE_SWITCHED))
        .filter_map(|r| Some((r.min_lsn?, r.batch_id?)))
        .max()?;
    let s = newest.0;
    let opened = rows
        .iter()
        .filter(|r| r.generation == generation && r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN))
        .filter(|r| r.detail.as_ref().and_then(|d| d.get("mode")).and_then(serde_json::Value::as_str) == Some("chunked"))
        .filter_map(|r| r.min_lsn)
        .any(|o| o >= s);
    (!opened && !is_completed(rows, s)).then_some(newest)
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
/// commit runs beside the next wave's read. So does `backfill`: once a
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

/// The data-loss gap a re-snapshot closes, as its event rows record it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Gap {
    /// Commit time of the last position the stream processed.
    pub lost_from_ts: Option<DateTime<Utc>>,
    /// Commit time of the capture instance's min LSN when the loss was found.
    pub lost_to_ts: Option<DateTime<Utc>>,
}

/// True when CDC cleanup has passed `s`: the changes right after it are gone
/// while there is something after it to read, so a stream cannot start there.
pub fn is_purged_after(s: Lsn, min_lsn: Option<Lsn>, max_lsn: Option<Lsn>) -> bool {
    matches!((min_lsn, max_lsn), (Some(min), Some(max)) if max > s && s.increment() < min)
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
