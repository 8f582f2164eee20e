//! The stream's state, derived from the facts table and bronze's txn
//! versions, and the two ways a step appends to the facts table.
//!
//! [`load`] does the I/O; [`StreamState::derive`] is a pure function of the
//! facts rows and the bronze txn version, so every rule below is unit-tested
//! without a table:
//! - the generation is the highest one any row of this app id names;
//! - the position is the newest batch's `max_lsn` in that generation, or the
//!   generation's start (its snapshot's S, or the recorded stream start);
//! - a bronze txn version above the newest facts batch means a crash between
//!   the two commits: that batch's facts row must be repaired first;
//! - the open snapshot is the one that holds the snapshot mode
//!   (`engine::rules::snapshot_holding_mode`, the rule every step uses). A
//!   full open stops holding once CDC cleanup passes its S, which only the
//!   source knows: [`load`] passes the capture instance's min LSN, and
//!   [`StreamState::derive`] alone (no source) counts no open as passed.

//!
//! Above `engine::rules` (whose generation rules it re-exports under their
//! old paths) and below every transition.

use serde::Serialize;
use serde_json::json;

use super::Context;
use crate::delta::facts::{self, FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::delta::{self, Appended, Txn};
use crate::error::StepResult;
use crate::lsn::Lsn;

pub use super::rules::{generation_of, makes_generation_live, EVENT_STREAM_START};

/// What the facts and bronze say about one stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamState {
    pub generation: i32,
    /// The generation's app id (bronze txn id of its batches).
    pub generation_app_id: String,
    /// The completed snapshot the generation started from (bootstrap or resnapshot), if any.
    pub snapshot: Option<Lsn>,
    /// The S of the generation's chunked snapshot: the stream starts there
    /// at the open, while `backfill` reads the table beside it.
    pub chunked_start: Option<Lsn>,
    /// The recorded start of a stream without a snapshot.
    pub stream_start: Option<Lsn>,
    /// The newest batch with a facts row in this generation.
    pub last_batch: Option<FactRow>,
    /// The newest batch id bronze holds for this generation's app id.
    pub bronze_batch: Option<i64>,
    /// The S of the snapshot that holds the snapshot mode, if one does (at
    /// most one): a chunked open not completed yet, or a full open that may
    /// still be read. A dead full open (cleanup passed its S, or a
    /// completion superseded it: one at or after its S, or its own
    /// generation's after a lost race) is not listed: no step can finish it
    /// and none waits for it.
    pub open_snapshots: Vec<Lsn>,
    /// Batches bronze holds for an older generation without their facts
    /// rows (see [`older_batches_to_repair`]); filled by [`load`], empty
    /// when derived without bronze.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub older_batches_to_repair: Vec<OlderBatches>,
}

/// An older generation's batches that bronze holds without facts rows: ids
/// after `recorded` up to `held`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OlderBatches {
    pub generation: i32,
    /// The generation's app id (bronze txn id of its batches).
    pub app_id: String,
    /// The newest batch id the facts record for the generation, if any.
    pub recorded: Option<i64>,
    /// The newest batch id bronze holds for it.
    pub held: i64,
}

/// The older generations whose bronze holds batches the facts do not
/// record (pure): `held` is bronze's txn version of each generation below
/// the live one. A call that loaded its state while generation g was live
/// can commit g's next batch to bronze after a reseed or a recovery made
/// g + 1 live, then be cut before its facts row. Every later call loads
/// g + 1 and repairs only g + 1's batches by [`StreamState::batch_to_repair`],
/// so without this the batch would stay in bronze with no facts row for
/// good: its rows counted by no generation's range.
pub fn older_batches_to_repair(app_id: &str, rows: &[FactRow], live: i32, held: &std::collections::BTreeMap<i32, i64>) -> Vec<OlderBatches> {
    held.iter()
        .filter(|(g, _)| **g < live)
        .filter_map(|(&generation, &held)| {
            let recorded = rows.iter().filter(|r| r.generation == generation && r.event.is_none()).filter_map(|r| r.batch_id).max();
            recorded.is_none_or(|f| held > f).then(|| OlderBatches { generation, app_id: super::generation_app_id(app_id, generation), recorded, held })
        })
        .collect()
}

impl StreamState {
    /// Derives the state from this app id's facts rows and bronze's txn
    /// version for the generation's app id (looked up by the caller, who
    /// first needs the generation: see [`generation_of`]), not knowing where
    /// CDC cleanup is (see [`StreamState::derive_with_cleanup`]).
    pub fn derive(app_id: &str, rows: &[FactRow], bronze_batch: Option<i64>) -> StreamState {
        Self::derive_with_cleanup(app_id, rows, bronze_batch, None)
    }

    /// [`StreamState::derive`] with the capture instance's min LSN, so that a
    /// full open cleanup has passed no longer counts as open.
    pub fn derive_with_cleanup(app_id: &str, rows: &[FactRow], bronze_batch: Option<i64>, min_lsn: Option<Lsn>) -> StreamState {
        let generation = generation_of(rows);
        let in_gen = |r: &&FactRow| r.generation == generation;
        let snapshot = rows
            .iter()
            .filter(in_gen)
            .filter(|r| matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT)))
            .filter_map(|r| r.max_lsn)
            .max();
        let chunked_start = rows
            .iter()
            .filter(in_gen)
            .filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN))
            .filter(|r| r.detail.as_ref().and_then(|d| d.get("mode")).and_then(serde_json::Value::as_str) == Some("chunked"))
            .filter_map(|r| r.min_lsn)
            .max();
        let stream_start = rows.iter().filter(in_gen).filter(|r| r.event.as_deref() == Some(EVENT_STREAM_START)).filter_map(|r| r.max_lsn).max();
        let last_batch = rows
            .iter()
            .filter(in_gen)
            .filter(|r| r.event.is_none() && r.batch_id.is_some())
            .max_by_key(|r| r.batch_id)
            .cloned();
        let open_snapshots: Vec<Lsn> = super::rules::snapshot_holding_mode(rows, min_lsn).map(|o| o.s).into_iter().collect();
        StreamState {
            generation,
            generation_app_id: super::generation_app_id(app_id, generation),
            snapshot,
            chunked_start,
            stream_start,
            last_batch,
            bronze_batch,
            open_snapshots,
            older_batches_to_repair: Vec::new(),
        }
    }

    /// The last position the stream processed, if it has one yet.
    pub fn position(&self) -> Option<Lsn> {
        self.last_batch.as_ref().and_then(|b| b.max_lsn).or(self.snapshot).or(self.chunked_start).or(self.stream_start)
    }

    /// The batch id bronze holds but the facts do not (a crash between the two commits).
    pub fn batch_to_repair(&self) -> Option<i64> {
        let facts_batch = self.last_batch.as_ref().and_then(|b| b.batch_id);
        match (self.bronze_batch, facts_batch) {
            (Some(b), Some(f)) if b > f => Some(b),
            (Some(b), None) => Some(b),
            _ => None,
        }
    }

    /// The id the next batch takes.
    pub fn next_batch_id(&self) -> i64 {
        let f = self.last_batch.as_ref().and_then(|b| b.batch_id).unwrap_or(-1);
        f.max(self.bronze_batch.unwrap_or(-1)) + 1
    }
}

/// Reads this app id's facts rows.
pub async fn facts_rows(facts: &deltalake::DeltaTable, app_id: &str) -> StepResult<Vec<FactRow>> {
    delta::facts_read::rows_of(facts, app_id).await
}

/// Loads the stream's state (reloading both tables first).
pub async fn load(ctx: &mut Context) -> StepResult<StreamState> {
    ctx.facts.update_state().await.map_err(crate::error::StepError::delta(&ctx.workflow.target.facts))?;
    // The facts are read before bronze, so a batch another call commits in
    // between shows as bronze ahead of the facts (never the other way
    // round): the stream's guard relies on that. A race test widens the
    // window here (a sleep); not a commit boundary, not in `FAILPOINTS`.
    crate::failpoint!("state.between_facts_and_bronze");
    ctx.bronze.update_state().await.map_err(crate::error::StepError::delta(&ctx.workflow.target.bronze))?;
    let rows = facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    super::identity::check_rows_belong(&rows, &ctx.workflow)?;
    let generation = generation_of(&rows);
    let gen_app = super::generation_app_id(&ctx.workflow.app_id, generation);
    let bronze_batch = delta::txn_version(&ctx.bronze, &gen_app).await?;
    let min_lsn = ctx.source.min_lsn(&ctx.instance.name).await?;
    let mut st = StreamState::derive_with_cleanup(&ctx.workflow.app_id, &rows, bronze_batch, min_lsn);
    // Bronze's txn version of every older generation the facts name (a
    // handful: one per reseed or recovery).
    let older: std::collections::BTreeSet<i32> = rows.iter().map(|r| r.generation).filter(|g| *g < generation).collect();
    let mut held = std::collections::BTreeMap::new();
    for g in older {
        if let Some(v) = delta::txn_version(&ctx.bronze, &super::generation_app_id(&ctx.workflow.app_id, g)).await? {
            held.insert(g, v);
        }
    }
    st.older_batches_to_repair = older_batches_to_repair(&ctx.workflow.app_id, &rows, generation, &held);
    Ok(st)
}

/// Appends facts rows with a txn (their summary in the commit metadata).
pub async fn append_facts(ctx: &mut Context, rows: Vec<FactRow>, txn: &Txn) -> StepResult<Appended> {
    let meta = json!({"facts": facts::summary(&rows), "app_id": ctx.workflow.app_id});
    delta::append_batches(&mut ctx.facts, vec![facts::to_batch(&rows)], facts::schema(), txn, meta).await
}

/// Appends facts rows without a txn (events written once per attempt, such as a full snapshot's open).
pub async fn append_facts_untracked(ctx: &mut Context, rows: Vec<FactRow>) -> StepResult<()> {
    let meta = json!({"facts": facts::summary(&rows), "app_id": ctx.workflow.app_id});
    delta::append_untracked(&mut ctx.facts, vec![facts::to_batch(&rows)], meta).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }

    fn batch(gen: i32, id: i64, to: u128) -> FactRow {
        FactRow { app_id: "a".into(), generation: gen, batch_id: Some(id), min_lsn: Some(lsn(to - 1)), max_lsn: Some(lsn(to)), ..Default::default() }
    }

    fn event(gen: i32, name: &str, at: u128) -> FactRow {
        FactRow { app_id: "a".into(), generation: gen, event: Some(name.into()), min_lsn: Some(lsn(at)), max_lsn: Some(lsn(at)), ..Default::default() }
    }

    #[test]
    fn new_stream_has_no_position() {
        let s = StreamState::derive("a", &[], None);
        assert_eq!(s.position(), None);
        assert_eq!(s.next_batch_id(), 0);
        assert_eq!(s.generation_app_id, "a");
    }

    #[test]
    fn position_is_newest_batch_else_snapshot() {
        let rows = vec![full_open(0, 10, EVENT_BOOTSTRAP), event(0, EVENT_BOOTSTRAP, 10)];
        let s = StreamState::derive("a", &rows, None);
        assert_eq!(s.position(), Some(lsn(10)));
        assert!(s.open_snapshots.is_empty());
        let mut rows2 = rows.clone();
        rows2.push(batch(0, 0, 20));
        rows2.push(batch(0, 1, 30));
        let s = StreamState::derive("a", &rows2, Some(1));
        assert_eq!(s.position(), Some(lsn(30)));
        assert_eq!(s.batch_to_repair(), None);
        assert_eq!(s.next_batch_id(), 2);
    }

    #[test]
    fn bronze_ahead_of_facts_is_repaired_first() {
        let rows = vec![event(0, EVENT_BOOTSTRAP, 10), batch(0, 0, 20)];
        let s = StreamState::derive("a", &rows, Some(1));
        assert_eq!(s.batch_to_repair(), Some(1));
        assert_eq!(s.next_batch_id(), 2);
        let s = StreamState::derive("a", &[event(0, EVENT_BOOTSTRAP, 10)], Some(0));
        assert_eq!(s.batch_to_repair(), Some(0));
    }

    #[test]
    fn an_older_generations_batch_bronze_holds_without_facts_is_listed_and_the_live_ones_is_not() {
        // Generation 0 recorded batch 0; a cut call committed its batch 1 to
        // bronze after the reseed made generation 1 live (schedule 10001298).
        let rows = vec![event(0, EVENT_BOOTSTRAP, 10), batch(0, 0, 20), event(1, EVENT_BOOTSTRAP, 40)];
        let held = std::collections::BTreeMap::from([(0, 1), (1, 3)]);
        let listed = older_batches_to_repair("a", &rows, 1, &held);
        assert_eq!(listed, vec![OlderBatches { generation: 0, app_id: super::super::generation_app_id("a", 0), recorded: Some(0), held: 1 }]);
        // Recorded up to what bronze holds: nothing.
        assert!(older_batches_to_repair("a", &rows, 1, &std::collections::BTreeMap::from([(0, 0)])).is_empty());
        // A generation whose facts record no batch at all.
        let no_batch = vec![event(0, EVENT_BOOTSTRAP, 10), event(1, EVENT_BOOTSTRAP, 40)];
        assert_eq!(older_batches_to_repair("a", &no_batch, 1, &std::collections::BTreeMap::from([(0, 0)]))[0].recorded, None);
    }

    fn full_open(gen: i32, at: u128, kind: &str) -> FactRow {
        let mut r = event(gen, EVENT_SNAPSHOT_OPEN, at);
        r.detail = Some(serde_json::json!({"mode": "full", "kind": kind}));
        r
    }

    #[test]
    fn an_open_without_completion_stays_open_until_cleanup_passes_it() {
        let s = StreamState::derive("a", &[full_open(0, 10, EVENT_BOOTSTRAP)], None);
        assert_eq!(s.open_snapshots, vec![lsn(10)]);
        assert_eq!(s.position(), None);
        // Cleanup at 11 still holds the changes right after S = 10: it may still complete.
        let s = StreamState::derive_with_cleanup("a", &[full_open(0, 10, EVENT_BOOTSTRAP)], None, Some(lsn(11)));
        assert_eq!(s.open_snapshots, vec![lsn(10)]);
        // Cleanup at 12 purged 11: a killed run's open holds nothing any more.
        let s = StreamState::derive_with_cleanup("a", &[full_open(0, 10, EVENT_BOOTSTRAP)], None, Some(lsn(12)));
        assert!(s.open_snapshots.is_empty(), "{:?}", s.open_snapshots);
        // A full re-snapshot's open for generation 1 holds while it may be read, not once passed.
        let rows = vec![event(0, EVENT_BOOTSTRAP, 5), batch(0, 0, 20), full_open(1, 30, EVENT_RESNAPSHOT)];
        assert_eq!(StreamState::derive_with_cleanup("a", &rows, Some(0), Some(lsn(25))).open_snapshots, vec![lsn(30)]);
        assert!(StreamState::derive_with_cleanup("a", &rows, Some(0), Some(lsn(40))).open_snapshots.is_empty());
    }

    #[test]
    fn a_chunked_open_starts_the_stream_at_s_before_any_row_is_read() {
        let mut open = event(0, EVENT_SNAPSHOT_OPEN, 10);
        open.detail = Some(serde_json::json!({"mode": "chunked", "kind": "bootstrap"}));
        let s = StreamState::derive("a", &[open.clone()], None);
        assert_eq!(s.position(), Some(lsn(10)));
        // A full open does not: its rows are not read yet and the stream waits for its completion.
        let mut full = open.clone();
        full.detail = Some(serde_json::json!({"mode": "full", "kind": "bootstrap"}));
        assert_eq!(StreamState::derive("a", &[full], None).position(), None);
        let s = StreamState::derive("a", &[open, batch(0, 0, 20)], Some(0));
        assert_eq!(s.position(), Some(lsn(20)));
    }

    #[test]
    fn later_generation_uses_its_own_app_id_and_rows() {
        let rows = vec![event(0, EVENT_BOOTSTRAP, 10), batch(0, 5, 20), event(1, EVENT_RESNAPSHOT, 50)];
        let s = StreamState::derive("a", &rows, None);
        assert_eq!(s.generation, 1);
        assert_eq!(s.generation_app_id, "a.g1");
        assert_eq!(s.position(), Some(lsn(50)));
        assert_eq!(s.next_batch_id(), 0);
    }
}
