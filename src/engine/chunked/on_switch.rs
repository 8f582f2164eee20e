//! The chunked snapshot a capture-instance switch opens (adr-0028
//! Amendment 5), as `engine::switch` hands the stream over to a newer
//! instance.
//!
//! With `snapshot.mode = "chunked"` and `snapshot.snapshot_on_switch = true`
//! the stream, after committing the batch that first reads a newer instance,
//! opens a chunked snapshot in the running generation at that instance's
//! start LSN S ([`ensure_open_on_switch`]). Why S and not max LSN: the chunks
//! are stamped at or after the stream's position, which is past S, so every
//! chunk row ranks above the new instance's changes it already reflects, and
//! the rebuild takes "the rows of S and the changes after S", which bronze
//! holds without a gap since the switch batch read from S. And since S is
//! below the stream's position, opening never moves the position (adr-0028
//! Amendment 2): the stream goes on from its switch batch.
//!
//! It is one more chunked open to every other step: the newest open of the
//! generation, so `chunked::open_chunked` (and through it
//! `snapshot_holding_mode`, `backfill`, `apply`, `status`) takes it, and it
//! supersedes an open still being read (its completion at S covers every
//! older S). `backfill` reads it with the new instance's columns and ends it
//! with a `bootstrap` row; `apply` takes its waves, then rebuilds from it.
//!
//! What differs is its txn keys. The generation's keys (`#snapshots` and
//! `#events`, version = generation) may already hold the generation's own
//! open and completion, so this open is keyed by S: plans `<app>#snapopen.<S>`
//! (as any open), facts `<app>#snapopen.<S>` and the completion
//! `<app>#snapdone.<S>`, both at the switch batch's id, which the open row
//! records (`switch_batch_id`) so that `backfill` picks the completion key.
//!
//! Crash safety: the open is its own two commits after the batch's, each
//! followed by a failpoint (`switch.after_open_plans`, `switch.after_open`).
//! Which switch still needs its open is derived from the facts alone
//! ([`switch_to_open`]: the generation's newest switch row without a chunked
//! open at or after its S), so a rerun after a crash anywhere in between
//! opens it exactly once. Its checks (the keys cut on the new instance, no
//! full snapshot holding the mode) run before the switch batch too
//! ([`check_open_on_switch`]), so a bad configuration stops the stream
//! before it writes the batch rather than after.

use serde_json::json;

use super::open::check_keys;
use super::tables::{append_facts_rows, append_plans, open_plans};
use super::open::OpenResult;
use crate::delta::facts::{EVENT_BOOTSTRAP, EVENT_SNAPSHOT_OPEN};
use crate::delta::plans::PlanRow;
use crate::delta;
use crate::engine::rules::{full_holding_mode, generation_of, mode_conflict, switch_to_open, txn_open_plans, txn_switch_open_facts, Mode, OpenPayload};
use crate::engine::state;
use crate::engine::Context;
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::source::CaptureInstance;
use crate::workflow::SnapshotMode;

/// Whether the workflow opens a snapshot after each switch.
pub fn opens_on_switch(ctx: &Context) -> bool {
    let o = &ctx.workflow.snapshot;
    o.snapshot_on_switch && o.mode == SnapshotMode::Chunked && ctx.workflow.table.capture_instance.is_none()
}

/// The checks of a switch's open, made before the batch that switches to
/// `to`: no full snapshot holds the mode, and the chunks can be cut on the
/// keys as `to` captures them. Nothing is written.
pub async fn check_open_on_switch(ctx: &mut Context, to: &CaptureInstance) -> StepResult<()> {
    let rows = state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let min = ctx.source.min_lsn(&ctx.instance.name).await?;
    if let Some(full) = full_holding_mode(&rows, min) {
        return Err(mode_conflict(&full, Mode::Chunked));
    }
    let on = std::mem::replace(&mut ctx.instance, to.clone());
    let keys = ctx.snapshot_keys();
    let checked = check_keys(ctx, &keys);
    ctx.instance = on;
    checked.map(|_| ()).map_err(|e| match e {
        StepError::Config(m) => StepError::Config(format!(
            "snapshot.snapshot_on_switch = true, and the snapshot the switch to capture instance '{}' opens cannot start: {m}. \
             Nothing was written",
            to.name
        )),
        other => other,
    })
}

/// Opens the snapshot of the stream's newest switch if it has none yet
/// (adr-0028 Amendment 5; see the module docs). Call with `ctx.instance` on
/// the stream's instance. Returns None when there is nothing to open.
pub async fn ensure_open_on_switch(ctx: &mut Context) -> StepResult<Option<OpenResult>> {
    if !opens_on_switch(ctx) {
        return Ok(None);
    }
    let app = ctx.workflow.app_id.clone();
    let rows = state::facts_rows(&ctx.facts, &app).await?;
    let Some((s, switch_batch_id)) = switch_to_open(&rows) else { return Ok(None) };
    let generation = generation_of(&rows);
    let min = ctx.source.min_lsn(&ctx.instance.name).await?;
    if let Some(full) = full_holding_mode(&rows, min) {
        return Err(mode_conflict(&full, Mode::Chunked));
    }
    let keys = ctx.snapshot_keys();
    check_keys(ctx, &keys)?;
    let iso = ctx.workflow.snapshot.isolation;
    let table = ctx.workflow.table_name();
    let extent = ctx.source.key_extent(&table, &keys, iso).await?;
    let payload = OpenPayload {
        keys: keys.clone(),
        min: extent.as_ref().map(|e| e.0.clone()),
        max: extent.map(|e| e.1),
        kind: EVENT_BOOTSTRAP.to_string(),
        generation,
    };
    let mut plans_table = open_plans(ctx).await?;
    let prow = PlanRow {
        app_id: app.clone(),
        snapshot: s,
        event: EVENT_SNAPSHOT_OPEN.into(),
        wave: None,
        chunk: None,
        detail: serde_json::to_value(&payload).map_err(|e| StepError::Internal(e.to_string()))?,
        recorded_at: Some(chrono::Utc::now()),
    };
    append_plans(&mut plans_table, &app, vec![prow], &txn_open_plans(&app, s)).await?;
    failpoint!("switch.after_open_plans");
    let mut row = ctx.fact_row(generation);
    row.event = Some(EVENT_SNAPSHOT_OPEN.into());
    row.min_lsn = Some(s);
    row.max_lsn = Some(s);
    row.commit_ts = ctx.commit_time(s).await?;
    row.detail = Some(json!({
        "mode": "chunked",
        "kind": EVENT_BOOTSTRAP,
        "generation": generation,
        "isolation": iso,
        "switch_batch_id": switch_batch_id,
    }));
    let appended = append_facts_rows(&mut ctx.facts, &app, vec![row], &txn_switch_open_facts(&app, s, switch_batch_id)).await?;
    failpoint!("switch.after_open");
    let opened_now = !matches!(appended, delta::Appended::AlreadyApplied { .. });
    tracing::info!(snapshot = %s, generation, switch_batch_id, instance = %ctx.instance.name, keys = ?keys,
        "chunked snapshot opened after the capture instance switch: backfill reads the table with the new instance's columns");
    Ok(Some(OpenResult { step: "snapshot", mode: "chunked", snapshot_lsn: s, generation, opened_now, completed: false }))
}
