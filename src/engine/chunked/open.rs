//! Opening a chunked snapshot: the check of the columns chunks are cut on,
//! then S and the key's extent (its plans row, then its `snapshot_open` facts
//! row), reading no rows. Apart from the waves because the stream's bootstrap
//! and the recovery open snapshots here without ever calling `backfill`.

use chrono::Utc;
use serde::Serialize;
use serde_json::json;

use super::tables::{append_facts_rows, append_plans, open_plans};
use crate::engine::rules::{chunked_of_generation, full_holding_mode, is_completed, mode_conflict, txn_open_facts, txn_open_plans, Mode, OpenPayload};
use crate::delta::facts::{EVENT_BOOTSTRAP, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::delta::plans::PlanRow;
use crate::delta::Appended;
use crate::engine::state::{self, generation_of};
use crate::engine::Context;
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::types::SqlType;

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
pub async fn ensure_open_with_gap(ctx: &mut Context, kind: &str, generation: i32, gap: Option<crate::engine::rules::Gap>) -> StepResult<OpenResult> {
    // The chunks are read with this instance's columns: bronze must hold them
    // all (it may be older than the instance; see stream::run_transitions).
    let instance = ctx.instance.clone();
    crate::engine::switch::add_bronze_columns(ctx, &instance).await?;
    let app = ctx.workflow.app_id.clone();
    let rows = state::facts_rows(&ctx.facts, &app).await?;
    if let Some(o) = chunked_of_generation(&rows).filter(|o| o.generation == generation) {
        let completed = is_completed(&rows, o.s);
        return Ok(OpenResult { step: "snapshot", mode: "chunked", snapshot_lsn: o.s, generation, opened_now: false, completed });
    }
    // Its chunks would be read with these columns: refuse before the open is recorded.
    crate::engine::check_no_renamed_columns(ctx, "a chunked snapshot")?;
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
