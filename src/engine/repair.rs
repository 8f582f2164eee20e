//! The `repair` transition: a micro-batch that bronze holds without its
//! facts row gets that row, and a batch never keeps two outcomes.
//!
//! A batch is two commits, bronze's rows (txn `<gen app>`, batch id) and then
//! the facts row (txn `<gen app>#facts`, batch id) that moves the position.
//! A crash between them leaves bronze one batch ahead of the facts, which
//! `StreamState::batch_to_repair` sees. Every step that may start or extend
//! the stream (`stream` first of all, and `seed` before it may start a
//! generation) runs [`repair`] before it decides anything: the facts row is
//! rebuilt from bronze's commit metadata (its range, rows, skipped ranges
//! and switch events), never read again from the source.
//!
//! The same holds for an older generation. A call that loaded its state
//! while generation g was live may commit g's next batch to bronze after a
//! reseed or a recovery made g + 1 live, and be cut before its facts row;
//! the live generation's rule cannot see it. So `state::load` also reads
//! bronze's txn version of each older generation the facts name, and
//! [`repair`] records those batches too, under the older generation's own
//! txn ids. The row only completes the record (each generation's range of
//! change rows in bronze); the live position and silver do not read it.
//!
//! Bronze's txn decides a batch, whoever commits it. A facts append that
//! finds its txn already applied must find the very outcome bronze's commit
//! records; anything else ([`check_recorded_batch`]) is a batch with two
//! outcomes, which would read a range twice or never, so it stops the step
//! for a person (exit 3) instead of being accepted.
//!
//! Below `stream` and `seed`, above `state`: it imports no transition.

use serde::Serialize;
use serde_json::{json, Value};

use super::state::{self, StreamState};
use super::Context;
use crate::delta::facts::{FactRow, EVENT_DATA_SKIPPED};
use crate::delta::{self, Appended, Txn};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;

/// A purged range a batch skips (`on_data_loss = "skip"`), recorded as a
/// `data_skipped` row in the batch's facts commit (adr-0018 Amendment 3).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Skip {
    /// The first LSN the stream needed.
    pub from: Lsn,
    /// The min LSN the capture instance had: where the batch read from.
    pub to: Lsn,
    /// True when the range was purged before the read (the skip is certain);
    /// false when cleanup ran during the read (rows of it may be missing).
    pub certain: bool,
    pub reason: String,
    pub lost_from_ts: Option<chrono::DateTime<chrono::Utc>>,
    pub lost_to_ts: Option<chrono::DateTime<chrono::Utc>>,
}

impl Skip {
    pub(crate) fn describe(&self) -> Value {
        json!({"from": self.from, "to": self.to, "certain": self.certain})
    }

    /// The `data_skipped` row of batch `batch_id`.
    pub(crate) fn fact_row(&self, ctx: &Context, generation: i32, batch_id: i64) -> FactRow {
        let mut row = ctx.fact_row(generation);
        row.batch_id = Some(batch_id);
        row.event = Some(EVENT_DATA_SKIPPED.into());
        row.min_lsn = Some(self.to);
        row.max_lsn = Some(self.to);
        row.rows = Some(0);
        row.commit_ts = self.lost_to_ts;
        row.lost_from_ts = self.lost_from_ts;
        row.lost_to_ts = self.lost_to_ts;
        row.retention_watermark_ts = self.lost_to_ts;
        row.detail = Some(json!({"from": self.from, "to": self.to, "certain": self.certain, "reason": self.reason}));
        row
    }
}

/// Writes the facts rows of batches bronze holds without them (the
/// stream's first act, and the seed's before it may start a generation):
/// the live generation's, then any older generation's a call cut after a
/// reseed or a recovery left behind (`StreamState::older_batches_to_repair`).
/// Returns the live generation's batch ids it recorded.
pub async fn repair(ctx: &mut Context, st: &StreamState) -> StepResult<Vec<i64>> {
    check_newest_batch(ctx, st).await?;
    let mut repaired = Vec::new();
    if let Some(upto) = st.batch_to_repair() {
        let first = st.last_batch.as_ref().and_then(|b| b.batch_id).map(|b| b + 1).unwrap_or(0);
        repaired = repair_batches(ctx, st.generation, &st.generation_app_id, first, upto).await?;
    }
    for older in &st.older_batches_to_repair {
        let first = older.recorded.map_or(0, |b| b + 1);
        tracing::warn!(generation = older.generation, from = first, upto = older.held, "an older generation's bronze holds batches without facts rows (a call cut after a reseed or a recovery): recording them");
        repair_batches(ctx, older.generation, &older.app_id, first, older.held).await?;
    }
    Ok(repaired)
}

/// Records batches `first..=upto` of `generation` (txn app id `gen_app`)
/// from bronze's commits of them.
async fn repair_batches(ctx: &mut Context, generation: i32, gen_app: &str, first: i64, upto: i64) -> StepResult<Vec<i64>> {
    let mut repaired = Vec::new();
    for batch_id in first..=upto {
        let txn = Txn::new(gen_app.to_string(), batch_id);
        let Some((version, meta)) = delta::find_txn_commit(&ctx.bronze, &txn).await? else {
            // Older releases made no bronze commit for an empty batch; only
            // the newest batch can be missing its facts row.
            if batch_id < upto {
                continue;
            }
            return Err(StepError::NeedsPerson(format!(
                "bronze records batch {batch_id} of {gen_app} but its commit is no longer in the Delta log and the facts \
                 have no row for it: restore the facts row by hand or start a new app_id"
            )));
        };
        let lsn = |k: &str| meta.get(k).and_then(Value::as_str).and_then(|s| Lsn::parse(s).ok());
        let (Some(from), Some(to)) = (lsn("from_lsn"), lsn("to_lsn")) else {
            return Err(StepError::Internal(format!("bronze commit {version} lacks its batch range metadata")));
        };
        tracing::warn!(generation, batch_id, bronze_version = version, "bronze holds a batch without its facts row (a crash between the two commits): writing it now");
        let row = FactRow {
            app_id: ctx.workflow.app_id.clone(),
            table: ctx.workflow.table_name().to_string(),
            target: ctx.workflow.target.bronze.clone(),
            generation,
            batch_id: Some(batch_id),
            capture_instance: meta.get("capture_instance").and_then(Value::as_str).map(str::to_string),
            min_lsn: Some(from),
            max_lsn: Some(to),
            rows: meta.get("rows").and_then(Value::as_i64),
            source_max_lsn: lsn("source_max_lsn"),
            commit_ts: ctx.commit_time(to).await?,
            bronze_version: Some(version),
            detail: Some(json!({"repaired": true})),
            recorded_at: Some(chrono::Utc::now()),
            ..Default::default()
        };
        let skips: Vec<Skip> = meta.get("skipped").cloned().map(serde_json::from_value).transpose().ok().flatten().unwrap_or_default();
        let events: Vec<FactRow> = meta.get("events").cloned().map(serde_json::from_value).transpose().ok().flatten().unwrap_or_default();
        let mut rows_out = vec![row.clone()];
        rows_out.extend(skips.iter().map(|k| k.fact_row(ctx, generation, batch_id)));
        rows_out.extend(events.into_iter().map(|mut e| {
            e.batch_id = Some(batch_id);
            e
        }));
        if let Appended::AlreadyApplied { .. } = state::append_facts(ctx, rows_out, &Txn::new(format!("{gen_app}#facts"), batch_id)).await? {
            // The call that committed the batch wrote its row meanwhile.
            check_recorded(ctx, generation, gen_app, &row, "bronze's commit of the batch").await?;
        }
        failpoint!("repair.after_facts");
        repaired.push(batch_id);
    }
    Ok(repaired)
}

/// What the facts must agree on for one batch: its range, its rows and the
/// bronze commit that decided it.
fn outcome(row: &FactRow) -> (Option<Lsn>, Option<Lsn>, Option<i64>, Option<i64>) {
    (row.min_lsn, row.max_lsn, row.rows, row.bronze_version)
}

fn describe_outcome(row: &FactRow) -> String {
    let lsn = |l: Option<Lsn>| l.map(|l| l.to_hex()).unwrap_or_else(|| "none".into());
    let version = row.bronze_version.map(|v| format!("bronze version {v}")).unwrap_or_else(|| "no bronze commit".into());
    format!("({}, {}] with {} rows, {version}", lsn(row.min_lsn.map(Lsn::decrement)), lsn(row.max_lsn), row.rows.unwrap_or(0))
}

/// After a facts append found batch N's txn already applied: the row the
/// facts hold for N must be the outcome `meant` names (derived from bronze's
/// commit of N). Any other row is a second outcome for one batch, which
/// would move the position to where bronze did not stop: exit 3, never
/// accepted.
pub(crate) async fn check_recorded_batch(ctx: &mut Context, st: &StreamState, meant: &FactRow, meant_from: &str) -> StepResult<()> {
    check_recorded(ctx, st.generation, &st.generation_app_id, meant, meant_from).await
}

/// [`check_recorded_batch`] for batch rows of `generation` (txn app id `gen_app`).
async fn check_recorded(ctx: &mut Context, generation: i32, gen_app: &str, meant: &FactRow, meant_from: &str) -> StepResult<()> {
    let batch_id = meant.batch_id.expect("a batch row has a batch id");
    ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
    let rows = state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let recorded: Vec<&FactRow> =
        rows.iter().filter(|r| r.generation == generation && r.event.is_none() && r.batch_id == Some(batch_id)).collect();
    if recorded.len() == 1 && outcome(recorded[0]) == outcome(meant) {
        return Ok(());
    }
    let found = match recorded.as_slice() {
        [] => "no row for it".to_string(),
        many => many.iter().map(|r| describe_outcome(r)).collect::<Vec<_>>().join("; "),
    };
    Err(StepError::NeedsPerson(format!(
        "batch {batch_id} of {} has two outcomes: {meant_from} says {}, but the facts (txn {}#facts) record {found}. \
         Going on would read the changes between the two ends again or never. Stop every other writer of app_id '{}' \
         (an older mssql-cdc writes empty batches without a bronze commit), compare bronze's rows with _batch_id = {batch_id} \
         with the change table, and correct the facts row by hand, or start a new app_id",
        gen_app,
        describe_outcome(meant),
        gen_app,
        ctx.workflow.app_id
    )))
}

/// The damage an older release's race left (before bronze decided empty
/// batches): the newest facts row records batch N as empty without a bronze
/// commit while bronze holds a commit of N, made by a concurrent call that
/// read rows. The facts' end is then not bronze's, and the next batch would
/// write the changes in between a second time. Cheap: only a newest row
/// without a bronze version and bronze at the same batch id is looked up.
async fn check_newest_batch(ctx: &mut Context, st: &StreamState) -> StepResult<()> {
    let Some(last) = st.last_batch.as_ref() else { return Ok(()) };
    let Some(batch_id) = last.batch_id else { return Ok(()) };
    if last.bronze_version.is_some() || st.bronze_batch != Some(batch_id) {
        return Ok(());
    }
    let Some((version, meta)) = delta::find_txn_commit(&ctx.bronze, &Txn::new(st.generation_app_id.clone(), batch_id)).await? else {
        return Ok(());
    };
    let lsn = |k: &str| meta.get(k).and_then(Value::as_str).and_then(|s| Lsn::parse(s).ok());
    let bronze_row = FactRow {
        batch_id: Some(batch_id),
        min_lsn: lsn("from_lsn"),
        max_lsn: lsn("to_lsn"),
        rows: meta.get("rows").and_then(Value::as_i64),
        bronze_version: Some(version),
        ..Default::default()
    };
    check_recorded_batch(ctx, st, &bronze_row, "bronze's commit of the batch").await
}
