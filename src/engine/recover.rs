//! Recovery after CDC data loss (`stream.on_data_loss = "resnapshot"`, adr-0018).
//!
//! A stream stopped for longer than the CDC retention finds the changes after
//! its position purged. Instead of stopping for a person, the `stream` step
//! takes a new snapshot, moves to generation n + 1 (app id `<app>.g<n+1>`,
//! batch ids from 0) and streams on from the snapshot's LSN S.
//!
//! Order (each write a commit with its txn, a failpoint after it):
//! 1. **Reuse or retire** a full re-snapshot already in bronze for a
//!    generation that is not live (a crash after its commit, before its
//!    completion row). While cleanup has not passed its S it is completed
//!    from the commit's metadata. Once cleanup has passed S its image can
//!    never be continued (the changes right after S are gone), so it is a
//!    failed attempt: a `resnapshot_failed` row records it once, it is never
//!    completed, and the recovery goes on to take a new snapshot (the guard
//!    below counts the failure, so it takes one only past the interval or
//!    with `--resnapshot-interval-days 0`). Without this, every rerun would
//!    find the same dead commit and stop. A full rerun takes the generation
//!    after the dead one, because the dead commit holds that generation's
//!    bronze key (`<app>#snapshot` + generation) and Delta would skip a second
//!    append under it as already applied; a chunked rerun keys its rows by S
//!    and opens the same generation, as adr-0018's Amendment 2 says.
//! 2. **Anti-loop guard** ([`guard`], pure): a loss within
//!    `resnapshot_interval_days` of an earlier recovery or of a failed
//!    re-snapshot stops with exit 3 naming it. Times are the server's, as CDC
//!    records them (commit times of LSNs), never the writer's clock: the
//!    simulator's clock and a production server's agree with their own LSNs.
//! 3. **The recovery row** (`recovery`, txn `<app>#recovery` + n + 1): the
//!    position it starts from and the gap. Written once: a rerun after a crash
//!    reads the gap back from it, so the recovery repeats from the recorded
//!    start, not from whatever the facts say later.
//! 4. **The snapshot**: full (read now at S, not committed if cleanup passed S
//!    before the read ended: a `resnapshot_failed` row, exit 3) or chunked
//!    (opened at S, read by `backfill`, completed by a `resnapshot` row).
//! 5. **The commit point** is the row that makes generation n + 1 live: the
//!    full snapshot's `resnapshot` row (txn `<app>#events` + n + 1) or the
//!    chunked open (txn `<app>#snapshots` + n + 1). Before it, the stream is
//!    still generation n at its old position, so a rerun finds the same loss
//!    and resumes here; after it, the stream reads from S.
//!
//! There is no lock: two runs recovering one stream at once waste a snapshot,
//! but the txn ids keep one recovery row and one completion per generation.

use chrono::{DateTime, Duration, Utc};
use serde::Serialize;
use serde_json::{json, Value};

use super::snapshot::{self, Gap};
use super::state::{self, StreamState};
use super::Context;
use crate::delta::facts::{FactRow, EVENT_RECOVERY, EVENT_RESNAPSHOT, EVENT_RESNAPSHOT_FAILED};
use crate::delta::{Appended, Txn};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::workflow::SnapshotMode;

/// A purged range the retention guard found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loss {
    /// The last position the stream processed.
    pub position: Lsn,
    /// The next LSN it needed.
    pub next: Lsn,
    /// The capture instance's min LSN when the loss was found.
    pub min_lsn: Lsn,
}

/// An earlier recovery or failed re-snapshot the anti-loop guard counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Previous {
    pub what: &'static str,
    pub generation: i32,
    pub at: DateTime<Utc>,
}

/// The anti-loop guard, as a pure function: the newest earlier recovery (for
/// another target generation than `target`) or failed re-snapshot (any) that
/// lies within `interval_days` before `now`. None: the recovery may go on.
///
/// Counting recoveries, not completed re-snapshots, covers a chunked
/// re-snapshot still being read and a full one that failed; excluding the
/// recovery for `target` itself lets a crashed recovery resume.
pub fn guard(rows: &[FactRow], target: i32, now: DateTime<Utc>, interval_days: f64) -> Option<Previous> {
    if interval_days <= 0.0 {
        return None;
    }
    let interval = Duration::milliseconds((interval_days * 86_400_000.0) as i64);
    rows.iter()
        .filter_map(|r| {
            let at = r.commit_ts?;
            match r.event.as_deref() {
                Some(EVENT_RECOVERY) => {
                    let g = target_generation(r)?;
                    (g != target).then_some(Previous { what: "an automatic re-snapshot", generation: g, at })
                }
                Some(EVENT_RESNAPSHOT_FAILED) => {
                    Some(Previous { what: "a failed re-snapshot", generation: target_generation(r).unwrap_or(r.generation), at })
                }
                _ => None,
            }
        })
        .filter(|p| now - p.at < interval)
        .max_by_key(|p| p.at)
}

fn target_generation(r: &FactRow) -> Option<i32> {
    r.detail.as_ref()?.get("target_generation")?.as_i64().map(|g| g as i32)
}

/// The recovery row for generation `target`, if one was written.
pub fn recovery_row(rows: &[FactRow], target: i32) -> Option<&FactRow> {
    rows.iter().find(|r| r.event.as_deref() == Some(EVENT_RECOVERY) && target_generation(r) == Some(target))
}

/// Automatic re-snapshots completed so far (`resnapshot` rows that close a gap).
pub fn resnapshots(rows: &[FactRow]) -> usize {
    rows.iter().filter(|r| r.event.as_deref() == Some(EVENT_RESNAPSHOT) && r.lost_to_ts.is_some()).count()
}

/// What a recovery did, for the step's JSON.
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryResult {
    pub from_generation: i32,
    pub generation: i32,
    pub mode: &'static str,
    /// The position the stream had processed when the loss was found.
    pub lost_after: Lsn,
    pub min_lsn: Lsn,
    pub lost_from_ts: Option<DateTime<Utc>>,
    pub lost_to_ts: Option<DateTime<Utc>>,
    /// The new snapshot's LSN: the new generation streams from here. None
    /// when the call stopped after the recovery row ([`RecoverUpTo::RecoveryRow`]).
    pub snapshot_lsn: Option<Lsn>,
    /// Rows the full re-snapshot read (a chunked one is read by `backfill`).
    pub rows: Option<i64>,
    /// True when a crashed attempt's snapshot was completed, not read again.
    pub resumed: bool,
}

/// The commit time of the stream's position: from the source's mapping while
/// it still has it, else from the facts row that recorded the position
/// (cleanup deletes mapping rows below the retention too).
pub async fn position_time(ctx: &Context, st: &StreamState, position: Lsn) -> StepResult<Option<DateTime<Utc>>> {
    if let Some(t) = ctx.commit_time(position).await? {
        return Ok(Some(t));
    }
    if let Some(t) = st.last_batch.as_ref().filter(|b| b.max_lsn == Some(position)).and_then(|b| b.commit_ts) {
        return Ok(Some(t));
    }
    let rows = state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    Ok(rows.iter().filter(|r| r.max_lsn == Some(position)).find_map(|r| r.commit_ts))
}

/// The gap a recovery for `target` closes: read back from its recovery row
/// when one was written (a rerun), else measured now.
async fn gap_of(ctx: &Context, st: &StreamState, rows: &[FactRow], target: i32, loss: Loss) -> StepResult<(Gap, Option<FactRow>)> {
    let recorded = recovery_row(rows, target).cloned();
    let gap = match &recorded {
        Some(r) => Gap { lost_from_ts: r.lost_from_ts, lost_to_ts: r.lost_to_ts },
        None => Gap {
            lost_from_ts: position_time(ctx, st, loss.position).await?,
            lost_to_ts: ctx.commit_time(loss.min_lsn).await?,
        },
    };
    Ok((gap, recorded))
}

/// How far one call takes a recovery. The machine's `recover` transition is
/// the recovery row (steps 1 to 3 of the module docs), its `resnapshot` the
/// snapshot that makes the new generation live (4 and 5); the `stream` step
/// runs both in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoverUpTo {
    /// Stop once the recovery row is in (a row already recorded: nothing to do).
    RecoveryRow,
    /// Go on to the snapshot (a recovery row already recorded: the snapshot only).
    Snapshot,
}

/// Recovers the stream from `loss`: see the module docs for the order.
pub async fn recover(ctx: &mut Context, st: &StreamState, loss: Loss, interval_days: f64, upto: RecoverUpTo) -> StepResult<RecoveryResult> {
    let app = ctx.workflow.app_id.clone();
    let mode = ctx.workflow.snapshot.mode;
    let mut target = st.generation + 1;
    let mut rows = state::facts_rows(&ctx.facts, &app).await?;
    // 1. Reuse, or retire: a full re-snapshot bronze holds for a generation
    // that is not live yet (the newest such commit; older ones were retired
    // by earlier reruns).
    let newest_full = snapshot::newest_full_generation(ctx).await?.filter(|g| *g >= target);
    if let Some(c) = match newest_full {
        Some(g) => snapshot::committed_full(ctx, g).await?,
        None => None,
    }
    .filter(|c| {
        // A reseed that lost the generation and removed its rows: nothing to
        // reuse or record, but its key is spent, so a full re-snapshot takes
        // the generation after it.
        if c.undone && mode == SnapshotMode::Full {
            target = c.generation + 1;
        }
        !c.undone
    }) {
        let min = ctx.source.min_lsn(&ctx.instance.name).await?;
        let max = ctx.source.max_lsn().await?;
        if !snapshot::is_purged_after(c.s, min, max) {
            let (gap, recorded) = gap_of(ctx, st, &rows, c.generation, loss).await?;
            let done = snapshot::complete_committed(ctx, &c, EVENT_RESNAPSHOT, Some(gap)).await?;
            return Ok(RecoveryResult {
                from_generation: st.generation,
                generation: c.generation,
                mode: "full",
                lost_after: recorded.as_ref().and_then(|r| r.min_lsn).unwrap_or(loss.position),
                min_lsn: loss.min_lsn,
                lost_from_ts: gap.lost_from_ts,
                lost_to_ts: gap.lost_to_ts,
                snapshot_lsn: Some(done.snapshot_lsn),
                rows: Some(done.rows),
                resumed: true,
            });
        }
        // Its image can never be continued: a failed attempt, recorded once
        // (the guard below counts it), never completed. A full rerun cannot
        // reuse the generation, whose bronze key the dead commit holds
        // (Delta would skip the append), so it takes the next one; a chunked
        // one keys its rows by S and opens the same generation, as
        // adr-0018's Amendment 2 says.
        if !snapshot::failure_recorded(&rows, c.generation, c.s) {
            tracing::warn!(snapshot = %c.s, generation = c.generation, "a full re-snapshot committed to bronze but not completed was passed by CDC cleanup: recording it as failed");
            snapshot::record_failed_row(ctx, c.generation, c.s, min, "its bronze commit is in, but CDC cleanup passed its LSN before its completion row was written").await?;
            failpoint!("recover.after_failed_row");
            rows = state::facts_rows(&ctx.facts, &app).await?;
        }
        if mode == SnapshotMode::Full {
            target = c.generation + 1;
        }
    }
    let (gap, recorded) = gap_of(ctx, st, &rows, target, loss).await?;
    tracing::warn!(position = %loss.position, min_lsn = %loss.min_lsn, generation = st.generation, target,
        resumed = recorded.is_some(), "the changes after the stream's position were purged: recovering with a new snapshot");
    let lost_after = recorded.as_ref().and_then(|r| r.min_lsn).unwrap_or(loss.position);
    let mut result = RecoveryResult {
        from_generation: st.generation,
        generation: target,
        mode: if mode == SnapshotMode::Chunked { "chunked" } else { "full" },
        lost_after,
        min_lsn: loss.min_lsn,
        lost_from_ts: gap.lost_from_ts,
        lost_to_ts: gap.lost_to_ts,
        snapshot_lsn: None,
        rows: None,
        resumed: recorded.is_some(),
    };
    // The new snapshot reads the table: refuse before the recovery row.
    super::check_no_renamed_columns(ctx, "the re-snapshot after the data loss")?;
    // 2. The anti-loop guard, on the server's clock.
    let max = ctx.source.max_lsn().await?;
    let now = match max {
        Some(m) => ctx.commit_time(m).await?,
        None => None,
    };
    if let Some(now) = now {
        if let Some(p) = guard(&rows, target, now, interval_days) {
            return Err(StepError::NeedsPerson(format!(
                "the changes after {} were purged by CDC cleanup (capture instance '{}', min LSN now {}), and {} \
                 (generation {}) happened at {}, within stream.resnapshot_interval_days = {interval_days} of now ({now}): \
                 the stream cannot keep up, stops for longer than the retention again and again, or cannot read the table \
                 within it. Decide what to change (the retention, the schedule, snapshot.mode = \"chunked\"), then rerun with \
                 --resnapshot-interval-days 0 to re-snapshot now",
                loss.position, ctx.instance.name, loss.min_lsn, p.what, p.generation, p.at
            )));
        }
    }
    // 3. The recovery row: the start and the gap, once per target generation.
    if recorded.is_none() {
        // Not a commit boundary (not in `FAILPOINTS`): a race test holds a
        // recovery here, after its read found no recovery row, while another
        // one recovers (tests/records_race.rs).
        failpoint!("recover.before_recovery_row");
        let mut row = ctx.fact_row(st.generation);
        row.event = Some(EVENT_RECOVERY.into());
        row.min_lsn = Some(loss.position);
        row.max_lsn = Some(loss.position);
        row.commit_ts = now;
        row.lost_from_ts = gap.lost_from_ts;
        row.lost_to_ts = gap.lost_to_ts;
        row.retention_watermark_ts = gap.lost_to_ts;
        row.source_max_lsn = max;
        row.detail = Some(json!({
            "target_generation": target,
            "mode": result.mode,
            "next": loss.next,
            "min_lsn": loss.min_lsn,
            "interval_days": interval_days,
        }));
        let txn = Txn::new(format!("{app}#recovery"), target as i64);
        if let Appended::AlreadyApplied { .. } = state::append_facts(ctx, vec![row], &txn).await? {
            tracing::warn!(target, "another run recorded this recovery meanwhile: going on with it");
        }
        failpoint!("recover.after_recovery_row");
    }
    if upto == RecoverUpTo::RecoveryRow {
        tracing::info!(generation = target, "the recovery is recorded; its re-snapshot is the next transition");
        return Ok(result);
    }
    // 4 and 5. The snapshot, whose commit point makes the target generation live.
    // It is taken at an S at or past the max LSN now, so the new generation
    // reads from there the instance the switch rule leads to from the
    // stream's: the snapshot is read with that one's columns. Read with the
    // older instance's, a column added before the purge (whose newer
    // instance cleanup may have left with the older one's start) would stay
    // NULL for every key not changed since.
    if ctx.workflow.table.capture_instance.is_none() {
        let instances = ctx.source.capture_instances(&ctx.workflow.table_name()).await?;
        if let Some(max) = ctx.source.max_lsn().await? {
            let reached = super::switch::reached_at(max, &ctx.instance, &instances);
            if reached.name != ctx.instance.name {
                tracing::info!(from = %ctx.instance.name, to = %reached.name, "the re-snapshot reads the instance the stream reads from its S on");
                ctx.instance = reached;
            }
        }
    }
    match mode {
        SnapshotMode::Full => {
            let r = snapshot::take_full(ctx, target, EVENT_RESNAPSHOT, Some(gap)).await?;
            result.snapshot_lsn = Some(r.snapshot_lsn);
            result.rows = Some(r.rows);
        }
        SnapshotMode::Chunked => {
            // A full re-snapshot of the target generation still being read
            // holds the mode (adr-0018 Amendment 2); a completed one would
            // have made the generation live and this recovery would not run.
            let min = ctx.source.min_lsn(&ctx.instance.name).await?;
            if let Some(full) = super::chunked::full_open_of(&rows, target, min) {
                return Err(super::chunked::mode_conflict(&full, super::chunked::Mode::Chunked));
            }
            let r = super::chunked::ensure_open_with_gap(ctx, EVENT_RESNAPSHOT, target, Some(gap)).await?;
            result.snapshot_lsn = Some(r.snapshot_lsn);
        }
    }
    tracing::info!(generation = target, snapshot = ?result.snapshot_lsn, mode = result.mode, "recovered: the stream goes on from the new snapshot");
    Ok(result)
}

/// The detail JSON of a recovery, for logs and the step's result.
pub fn describe(r: &RecoveryResult) -> Value {
    serde_json::to_value(r).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(days: f64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap() + Duration::milliseconds((days * 86_400_000.0) as i64)
    }

    fn recovery(target: i32, at: f64) -> FactRow {
        FactRow {
            app_id: "a".into(),
            generation: target - 1,
            event: Some(EVENT_RECOVERY.into()),
            commit_ts: Some(t(at)),
            detail: Some(json!({"target_generation": target})),
            ..Default::default()
        }
    }

    fn failed(target: i32, at: f64) -> FactRow {
        FactRow {
            app_id: "a".into(),
            generation: target - 1,
            event: Some(EVENT_RESNAPSHOT_FAILED.into()),
            commit_ts: Some(t(at)),
            detail: Some(json!({"target_generation": target})),
            ..Default::default()
        }
    }

    #[test]
    fn first_loss_passes() {
        assert_eq!(guard(&[], 1, t(0.0), 7.0), None);
    }

    #[test]
    fn a_second_loss_within_the_interval_stops() {
        let rows = vec![recovery(1, 0.0)];
        let p = guard(&rows, 2, t(3.5), 7.0).expect("within 7 days");
        assert_eq!(p.generation, 1);
        assert_eq!(p.what, "an automatic re-snapshot");
        // After the interval, or with interval 0, it passes.
        assert_eq!(guard(&rows, 2, t(7.01), 7.0), None);
        assert_eq!(guard(&rows, 2, t(3.5), 0.0), None);
    }

    #[test]
    fn the_recovery_being_resumed_does_not_count() {
        // A crash after the recovery row: the rerun for the same target passes.
        assert_eq!(guard(&[recovery(1, 0.0)], 1, t(0.1), 7.0), None);
    }

    #[test]
    fn a_failed_attempt_counts_even_for_its_own_generation() {
        let rows = vec![recovery(1, 0.0), failed(1, 0.2)];
        let p = guard(&rows, 1, t(0.3), 7.0).expect("a failed attempt stops the rerun");
        assert_eq!(p.what, "a failed re-snapshot");
        assert_eq!(guard(&rows, 1, t(0.3), 0.0), None);
    }

    #[test]
    fn the_newest_previous_is_named() {
        let rows = vec![recovery(1, 0.0), recovery(2, 2.0)];
        assert_eq!(guard(&rows, 3, t(3.0), 7.0).unwrap().generation, 2);
    }

    #[test]
    fn resnapshots_count_only_gap_closing_rows() {
        let mut r = FactRow { event: Some(EVENT_RESNAPSHOT.into()), ..Default::default() };
        assert_eq!(resnapshots(std::slice::from_ref(&r)), 0); // a reseed's row has no gap
        r.lost_to_ts = Some(t(0.0));
        assert_eq!(resnapshots(&[r]), 1);
    }
}
