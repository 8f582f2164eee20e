//! Capture-instance switches (what adr-0028 and adr-0018 take from 0023).
//!
//! SQL Server allows two capture instances per table, so a schema change is
//! captured by enabling a second instance with the new columns and, later,
//! dropping the first. A stream that does not pin `table.capture_instance`
//! follows them: it reads each instance's piece of the LSN range, the older
//! one up to the newer one's start LSN (exclusive), the newer one from there
//! on. Both hold the changes after the newer one's start, so the piece
//! boundary loses nothing and reads nothing twice.
//!
//! The instance a stream is on is the one its newest batch's facts row
//! names (state lives in Delta); a batch never crosses a switch. The batch
//! that first reads the newer instance carries, in its own facts commit, a
//! `capture_instance_switched` row and, when the captured columns differ, a
//! `schema_change` row; bronze gains the added columns first (a Delta schema
//! change, which a rerun finds already made). Dropped columns stay in
//! bronze, NULL from then on. An older instance dropped before the stream
//! reached the newer one's start leaves a gap the retention guard reports
//! like any purge (the newer instance's min LSN is past the position).
//!
//! # Every step follows the stream's instance
//!
//! `Context::open` picks the instance a new stream starts on (the one
//! [`plan`] reaches at the max LSN from the oldest established one, which is
//! the newest unless that one starts above the max LSN), but only the stream moves from
//! one instance to the next, in LSN order, and bronze gains columns at that
//! move. Every other step ([`follow_stream`]: `backfill`, `apply`,
//! `reconcile`, `status`, `seed`) reads the instance the stream is on from
//! the facts ([`recorded_instance`]): the newest batch's row of the current
//! generation, or, before the generation's first batch, the row that started
//! it (its chunked open, bootstrap, re-snapshot, seed or recorded start),
//! which names the instance the stream reads from there. The newest instance
//! is wrong for them whenever the stream has not reached its start LSN yet:
//! its columns are not in bronze, and rows read with them either lose them
//! (bronze's schema drops what it lacks) or outrun the stream's own order.
//!
//! What that means per step:
//! - `backfill` reads chunks with the stream's instance's columns. A wave
//!   whose stamp L is at or past a newer instance's start (the point where
//!   the stream itself would switch, [`plan`]) is not read until the stream
//!   has switched: it pauses (exit 75) instead, like the headroom pause. Read
//!   with the older columns, such a chunk row would lack the added column
//!   while ranking above the newer instance's changes up to L, the only rows
//!   that carry that column's values: bronze's latest image would then hold
//!   NULL where the table holds a value. Read with the newer columns, it
//!   would need bronze to gain them ahead of the stream (out of order, and
//!   `apply` would merge rows whose columns silver does not follow yet).
//!   After the switch the stream's instance is the newer one and bronze has
//!   its columns, so the wave reads them all ([`waits_for_switch`]).
//! - Chunks read before the switch keep the older columns. Their keys get
//!   the added column's values from the newer instance's changes, which all
//!   rank above those chunks (their stamps are below its start LSN), so
//!   bronze's latest image is the table's for every key a change touched
//!   after that start. A key untouched since keeps NULL in the added column,
//!   which is the table's value when the column was added without a default
//!   (the simulator's only kind). A column added with a default, or set
//!   between the `ALTER TABLE` and the new instance's start, is in no change
//!   row of either instance: no rule over bronze's rows can recover it, for
//!   chunks and completed snapshots alike. Only a snapshot read after the
//!   switch can: `snapshot.snapshot_on_switch` (below).
//! - A heap's reads are fenced (`CdcSource::snapshot_read_fenced`): its
//!   silver takes the read as holding every commit that ended before the
//!   fence, captured or not, and skips those commits' change rows. So the
//!   stamp does not bound what such a read holds: under capture lag a read
//!   stamped below a newer instance's start can hold commits after it,
//!   which set the columns it adds and which only the newer instance's
//!   change rows (skipped) carry. A fenced read of an instance is refused
//!   while a newer instance adding columns is listed
//!   ([`newer_with_added_columns`]), before the read and again after its
//!   fence (one enabled meanwhile): a heap's wave pauses (exit 75) until the
//!   stream has switched; a heap's full snapshot exits 75 until the capture
//!   job passes the newer start, when it reads the newer instance. A full
//!   snapshot of any table reads the instance the switch rule reaches at its
//!   S, not the one picked at an earlier max LSN: the changes between a
//!   newer instance's start and S are in no batch of the new stream.
//! - `apply` merges with the stream's instance's columns, and silver gains
//!   an added column (NULL in the rows it holds, which is bronze's image of
//!   them too) in the call that first applies rows read under that instance.
//! - `reconcile` compares the stream's instance's columns; a column silver
//!   has not gained yet compares as NULL there, and the keys whose values
//!   it lacks are in bronze after silver's applied LSN: IN_FLIGHT.
//! - `status` reports the stream's instance and its min LSN (its headroom);
//!   `seed` fits the copy to the stream's instance's columns, the ones
//!   bronze holds.
//!
//! A chunked snapshot opened by the switch (adr-0028 Amendment 5,
//! `snapshot.snapshot_on_switch`) is the snapshot lane's business: see
//! `engine::chunked::on_switch`, which reads this module's rules.

use deltalake::kernel::StructField;
use serde_json::json;

use super::rules::{generation_of, makes_generation_live};
use super::state;
use super::Context;
use crate::delta::facts::{FactRow, EVENT_CAPTURE_INSTANCE_SWITCHED, EVENT_SCHEMA_CHANGE};
use crate::delta::{self, bronze, TableKind};
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;
use crate::source::CaptureInstance;

/// Where the next batch reads, decided from the position and the instances.
#[derive(Debug, Clone, PartialEq)]
pub enum InstancePlan {
    /// Read the current instance, up to `upto` (the LSN before a newer
    /// instance's start) when there is one.
    Stay { upto: Option<Lsn> },
    /// The position reached the newer instance's start: read it from now on.
    Switch { to: CaptureInstance },
}

/// The switch rule, as a pure function.
///
/// `instances` are in creation order (`cdc.change_tables.create_date`, as
/// the source lists them). A newer instance is one that starts later or,
/// at the same start, was created later: cleanup raises every instance's
/// start LSN to its low watermark, so once it passes the newer one's start
/// both start at the watermark and both hold every change from there. The
/// stream must then move to the later-created one (the newer columns), not
/// stay on the older one for good with the added columns NULL.
pub fn plan(position: Lsn, current: &CaptureInstance, instances: &[CaptureInstance]) -> InstancePlan {
    let Some(cur_start) = current.start_lsn else { return InstancePlan::Stay { upto: None } };
    let cur_order = instances.iter().position(|i| i.name == current.name);
    let newer = instances
        .iter()
        .enumerate()
        .filter(|(_, i)| i.name != current.name)
        .filter(|(order, i)| i.start_lsn.is_some_and(|s| s > cur_start || (s == cur_start && cur_order.is_some_and(|c| *order > c))))
        .min_by_key(|(order, i)| (i.start_lsn, *order))
        .map(|(_, i)| i);
    match newer {
        None => InstancePlan::Stay { upto: None },
        Some(n) => {
            let start = n.start_lsn.expect("filtered on start_lsn");
            if position.increment() >= start {
                InstancePlan::Switch { to: n.clone() }
            } else {
                InstancePlan::Stay { upto: Some(start.decrement()) }
            }
        }
    }
}

/// The instance a stream on `on` reads at `lsn`: `on`, moved along every
/// switch [`plan`] makes up to there.
pub fn reached_at(lsn: Lsn, on: &CaptureInstance, instances: &[CaptureInstance]) -> CaptureInstance {
    let mut on = on.clone();
    while let InstancePlan::Switch { to } = plan(lsn, &on, instances) {
        on = to;
    }
    on
}

/// Which instance the stream is on when a call starts: the one its newest
/// batch read, while it exists; else the one the context picked.
pub fn current<'a>(recorded: Option<&str>, instances: &'a [CaptureInstance], picked: &'a CaptureInstance) -> &'a CaptureInstance {
    recorded.and_then(|name| instances.iter().find(|i| i.name.eq_ignore_ascii_case(name))).unwrap_or(picked)
}

/// The instance the facts say the stream is on: the newest batch's of the
/// current generation, else the one the row that made the generation live
/// names (a batch never crosses a switch, and a generation's first batch
/// reads the instance its start recorded). None for a stream with no row.
pub fn recorded_instance(rows: &[FactRow]) -> Option<String> {
    let generation = generation_of(rows);
    let in_gen = |r: &&FactRow| r.generation == generation && r.capture_instance.is_some();
    let newest_batch = rows.iter().filter(in_gen).filter(|r| r.event.is_none() && r.batch_id.is_some()).max_by_key(|r| r.batch_id);
    let start = || rows.iter().filter(in_gen).filter(|r| r.event.is_some() && makes_generation_live(r)).max_by_key(|r| r.max_lsn);
    newest_batch.or_else(start).and_then(|r| r.capture_instance.clone())
}

/// Points `ctx.instance` at the instance the stream is on (see the module
/// docs), unless the workflow pins one. Returns the table's instances as the
/// source lists them now (empty when pinned: a pinned stream never switches).
pub async fn follow_stream(ctx: &mut Context) -> StepResult<Vec<CaptureInstance>> {
    if ctx.workflow.table.capture_instance.is_some() {
        return Ok(Vec::new());
    }
    let instances = ctx.source.capture_instances(&ctx.workflow.table_name()).await?;
    let rows = state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let recorded = recorded_instance(&rows);
    let on = current(recorded.as_deref(), &instances, &ctx.instance).clone();
    if on.name != ctx.instance.name {
        tracing::info!(stream = %on.name, newest = %ctx.instance.name, "following the capture instance the stream is on, not the newest");
    }
    ctx.instance = on;
    Ok(instances)
}

/// Points `ctx.instance` at the capture instance a committed snapshot was
/// read on, as its bronze commit names it (`recorded`), before the
/// completion row is written from that commit by a later call (the call
/// that read it crashed between its two commits).
///
/// Why: the completion row names the instance the stream starts on, at the
/// snapshot's LSN. A newer instance enabled between the crash and the rerun
/// starts after that LSN; started on it, the stream would read its min LSN
/// as a purge of the changes in between, though the older instance holds
/// them (a false "data loss" with `fail`, a needless re-snapshot with
/// `resnapshot`, and with `skip` those changes skipped for good). On the
/// instance it was read on, the stream reads on from the snapshot's LSN and
/// switches at the newer one's start as it always does.
///
/// Nothing changes when the workflow pins an instance, when the commit
/// names none, or when the source no longer lists it (the older instance
/// dropped, its changes gone with it: the stream's own checks then see the
/// loss for what it is).
pub async fn use_instance_of_commit(ctx: &mut Context, recorded: Option<&str>) -> StepResult<()> {
    if ctx.workflow.table.capture_instance.is_some() {
        return Ok(());
    }
    let Some(name) = recorded else { return Ok(()) };
    if name.eq_ignore_ascii_case(&ctx.instance.name) {
        return Ok(());
    }
    let instances = ctx.source.capture_instances(&ctx.workflow.table_name()).await?;
    if let Some(on) = instances.into_iter().find(|i| i.name.eq_ignore_ascii_case(name)) {
        tracing::info!(read_on = %on.name, newest = %ctx.instance.name, "completing the snapshot on the capture instance it was read on");
        ctx.instance = on;
    }
    Ok(())
}

/// The newer instance a chunk stamped `stamp` must wait for: the stream,
/// on `on`, switches to it at or before `stamp` but has not yet. None when
/// the stream's instance is the one it reads at `stamp`.
pub fn waits_for_switch(stamp: Lsn, on: &CaptureInstance, instances: &[CaptureInstance]) -> Option<CaptureInstance> {
    match plan(stamp, on, instances) {
        InstancePlan::Switch { to } => Some(to),
        InstancePlan::Stay { .. } => None,
    }
}

/// The listed instance newer than `on` that captures a column `on` lacks,
/// if any: one that starts later, or at the same start (or with no start
/// yet) was created later (see [`plan`]).
///
/// A fenced read (a heap's snapshot or chunk) holds every commit that ended
/// before its fence, captured or not, and its silver counts none of those
/// commits' change rows (`engine::apply::heap`). While such a newer
/// instance is listed, some of those commits may come after its start and
/// set the columns it adds: read with `on`'s columns the rows lack those
/// values, and the change rows that carry them are the ones silver skips.
/// So a fenced read of `on` is refused while this is Some (the stream
/// switches first, or the next call picks the newer instance). A newer
/// instance that adds nothing costs nothing: dropped columns are left out
/// of silver's match from the switch on.
pub fn newer_with_added_columns<'a>(on: &CaptureInstance, instances: &'a [CaptureInstance]) -> Option<&'a CaptureInstance> {
    let on_order = instances.iter().position(|i| i.name.eq_ignore_ascii_case(&on.name));
    instances
        .iter()
        .enumerate()
        .filter(|(_, i)| !i.name.eq_ignore_ascii_case(&on.name))
        .filter(|(order, i)| {
            let created_later = on_order.is_some_and(|c| *order > c);
            match (i.start_lsn, on.start_lsn) {
                (Some(s), Some(cur)) => s > cur || (s == cur && created_later),
                (None, _) | (_, None) => created_later,
            }
        })
        .map(|(_, i)| i)
        .find(|i| !column_changes(on, i).0.is_empty())
}

/// The refusal of a fenced read of `on`'s columns while `newer` (from
/// [`newer_with_added_columns`]) is listed; `what` names the read and
/// `remedy` what to do before calling again.
pub fn fenced_read_refused(on: &CaptureInstance, newer: &CaptureInstance, what: &str, remedy: &str) -> StepError {
    let (added, _) = column_changes(on, newer);
    StepError::Temporary(format!(
        "{what} is a fenced read of a table without a unique index with the columns of capture instance '{}', but capture \
         instance '{}' (start {}) also captures {}: commits the read would hold may have set {} and their values would be lost. \
         {remedy}",
        on.name,
        newer.name,
        newer.start_lsn.map_or_else(|| "not established yet".to_string(), |l| l.to_string()),
        added.join(", "),
        if added.len() == 1 { "it" } else { "them" },
    ))
}

/// After a fenced read of `on`'s columns has read its fence: an error when
/// the source now lists a newer instance adding columns (one created after
/// the check before the read, which the read may hold commits of). Nothing
/// of the read may be committed then. A pinned workflow never switches:
/// its reads keep the pinned instance's columns.
pub async fn check_after_fenced_read(
    source: &dyn crate::source::CdcSource,
    table: &crate::source::TableName,
    pinned: bool,
    on: &CaptureInstance,
    what: &str,
) -> StepResult<()> {
    if pinned {
        return Ok(());
    }
    let instances = source.capture_instances(table).await?;
    match newer_with_added_columns(on, &instances) {
        Some(newer) => Err(fenced_read_refused(on, newer, what, "Nothing of it was written; call again.")),
        None => Ok(()),
    }
}

/// Columns added and dropped between two instances (names only: facts hold no values).
pub fn column_changes(from: &CaptureInstance, to: &CaptureInstance) -> (Vec<String>, Vec<String>) {
    let added = to.columns.iter().filter(|c| from.column(&c.name).is_none()).map(|c| c.name.clone()).collect();
    let dropped = from.columns.iter().filter(|c| to.column(&c.name).is_none()).map(|c| c.name.clone()).collect();
    (added, dropped)
}

/// Adds to bronze the columns of `instance` it does not hold (NULL in the
/// rows it has). A no-op when bronze holds them all, as it does for the
/// instance the stream is on.
pub async fn add_bronze_columns(ctx: &mut Context, instance: &CaptureInstance) -> StepResult<()> {
    let existing: Vec<String> = ctx.bronze_schema()?.fields().iter().map(|f| f.name().to_lowercase()).collect();
    let wanted = delta::commented_schema(TableKind::Bronze, &bronze::schema(&instance.columns))?;
    let new_fields: Vec<StructField> = wanted.fields().filter(|f| !existing.contains(&f.name().to_lowercase())).cloned().collect();
    if !new_fields.is_empty() {
        let label = ctx.workflow.target.bronze.clone();
        tracing::info!(capture_instance = %instance.name, columns = ?new_fields.iter().map(|f| f.name().to_string()).collect::<Vec<_>>(), "bronze gains the capture instance's columns it lacks");
        ctx.bronze = ctx.bronze.clone().add_columns().with_fields(new_fields).await.map_err(StepError::delta(&label))?;
    }
    Ok(())
}

/// Moves the stream to `to`: bronze gains its added columns, the context
/// reads it from now on, and the event rows for the next batch are returned.
pub async fn switch(ctx: &mut Context, generation: i32, to: CaptureInstance) -> StepResult<Vec<FactRow>> {
    let from = ctx.instance.clone();
    let (added, dropped) = column_changes(&from, &to);
    for c in to.columns.iter().filter(|c| added.contains(&c.name)) {
        if let Some(old) = from.column(&c.name) {
            if old.sql_type != c.sql_type {
                return Err(StepError::NeedsPerson(format!(
                    "capture instance '{}' changes the type of column '{}' from {} to {}: bronze cannot hold both; \
                     migrate bronze by hand or start a new target",
                    to.name,
                    c.name,
                    old.sql_type.sql_name(),
                    c.sql_type.sql_name()
                )));
            }
        }
    }
    if !added.is_empty() {
        add_bronze_columns(ctx, &to).await?;
    }
    let start = to.start_lsn;
    tracing::info!(from = %from.name, to = %to.name, start = ?start, added = ?added, dropped = ?dropped, "moving the stream to the newer capture instance");
    let mut switched = ctx.fact_row(generation);
    switched.event = Some(EVENT_CAPTURE_INSTANCE_SWITCHED.into());
    switched.capture_instance = Some(to.name.clone());
    switched.min_lsn = start;
    switched.max_lsn = start;
    switched.rows = Some(0);
    switched.detail = Some(json!({"from": from.name, "to": to.name, "start_lsn": start}));
    let mut events = vec![switched];
    if !added.is_empty() || !dropped.is_empty() {
        let mut change = ctx.fact_row(generation);
        change.event = Some(EVENT_SCHEMA_CHANGE.into());
        change.capture_instance = Some(to.name.clone());
        change.min_lsn = start;
        change.max_lsn = start;
        change.rows = Some(0);
        change.detail = Some(json!({"from": from.name, "to": to.name, "added": added, "dropped": dropped}));
        events.push(change);
    }
    ctx.instance = to;
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::TableName;
    use crate::types::{ColumnDesc, SqlType};

    fn ci(name: &str, start: u128, cols: &[&str]) -> CaptureInstance {
        CaptureInstance {
            name: name.into(),
            table: TableName::new("dbo", "t"),
            start_lsn: Some(Lsn::from_u128(start)),
            columns: cols.iter().map(|c| ColumnDesc::new(*c, SqlType::Int, true)).collect(),
            index_columns: vec!["id".into()],
            renamed: Default::default(),
        }
    }

    #[test]
    fn the_older_instance_is_read_up_to_the_newer_ones_start() {
        let old = ci("v1", 10, &["id", "a"]);
        let new = ci("v2", 50, &["id", "a", "b"]);
        let all = vec![old.clone(), new.clone()];
        assert_eq!(plan(Lsn::from_u128(20), &old, &all), InstancePlan::Stay { upto: Some(Lsn::from_u128(49)) });
        assert_eq!(plan(Lsn::from_u128(49), &old, &all), InstancePlan::Switch { to: new.clone() });
        assert_eq!(plan(Lsn::from_u128(70), &old, &all), InstancePlan::Switch { to: new.clone() });
        // On the newest instance there is nothing to switch to.
        assert_eq!(plan(Lsn::from_u128(70), &new, &all), InstancePlan::Stay { upto: None });
        // Cleanup past the newer one's start raised both starts to its
        // watermark: the later-created instance is still the newer one.
        let (old_w, new_w) = (ci("v1", 80, &["id", "a"]), ci("v2", 80, &["id", "a", "b"]));
        let cleaned = vec![old_w.clone(), new_w.clone()];
        assert_eq!(plan(Lsn::from_u128(79), &old_w, &cleaned), InstancePlan::Switch { to: new_w.clone() });
        assert_eq!(plan(Lsn::from_u128(95), &old_w, &cleaned), InstancePlan::Switch { to: new_w.clone() });
        assert_eq!(plan(Lsn::from_u128(95), &new_w, &cleaned), InstancePlan::Stay { upto: None });
        assert_eq!(column_changes(&old, &new), (vec!["b".to_string()], vec![]));
        assert_eq!(column_changes(&new, &old), (vec![], vec!["b".to_string()]));
    }

    fn fact(gen: i32, event: Option<&str>, batch: Option<i64>, instance: &str, lsn: u128) -> FactRow {
        FactRow {
            app_id: "a".into(),
            generation: gen,
            event: event.map(str::to_string),
            batch_id: batch,
            capture_instance: Some(instance.into()),
            min_lsn: Some(Lsn::from_u128(lsn)),
            max_lsn: Some(Lsn::from_u128(lsn)),
            detail: event.map(|_| json!({"mode": "chunked"})),
            ..Default::default()
        }
    }

    #[test]
    fn the_stream_is_on_its_newest_batchs_instance_else_its_generations_start() {
        use crate::delta::facts::{EVENT_BOOTSTRAP, EVENT_SNAPSHOT_OPEN};
        assert_eq!(recorded_instance(&[]), None);
        // Before the first batch: the chunked open that started the generation.
        let open = fact(0, Some(EVENT_SNAPSHOT_OPEN), None, "v1", 10);
        assert_eq!(recorded_instance(&[open.clone()]).as_deref(), Some("v1"));
        // A batch switched (its event rows name the new instance, and so does its batch row).
        let rows = vec![
            open.clone(),
            fact(0, None, Some(0), "v1", 20),
            fact(0, None, Some(1), "v2", 60),
            fact(0, Some(EVENT_CAPTURE_INSTANCE_SWITCHED), Some(1), "v2", 50),
        ];
        assert_eq!(recorded_instance(&rows).as_deref(), Some("v2"));
        // Rows that do not start a generation never name the stream's instance.
        let plan_row = fact(0, Some("snapshot_plan"), None, "v9", 10);
        assert_eq!(recorded_instance(&[open.clone(), plan_row]).as_deref(), Some("v1"));
        // A newer generation (a re-snapshot) starts from its own row, not the old batches.
        let mut rows = rows;
        rows.push(fact(1, Some(EVENT_BOOTSTRAP), None, "v3", 90));
        assert_eq!(recorded_instance(&rows).as_deref(), Some("v3"));
    }

    #[test]
    fn the_newest_switch_without_an_open_at_or_after_its_start_is_the_one_to_open() {
        use crate::delta::facts::EVENT_SNAPSHOT_OPEN;
        use crate::engine::rules::{switch_batch_of, switch_to_open};
        let mut open = fact(0, Some(EVENT_SNAPSHOT_OPEN), None, "v1", 10);
        open.detail = Some(json!({"mode": "chunked", "kind": "bootstrap"}));
        let mut rows = vec![open, fact(0, None, Some(0), "v1", 49)];
        assert_eq!(switch_to_open(&rows), None, "no switch yet");
        let mut switched = fact(0, Some(EVENT_CAPTURE_INSTANCE_SWITCHED), Some(1), "v2", 50);
        switched.detail = None;
        rows.push(fact(0, None, Some(1), "v2", 60));
        rows.push(switched);
        assert_eq!(switch_to_open(&rows), Some((Lsn::from_u128(50), 1)), "the bootstrap's open at 10 is older");
        // Once opened at its start, nothing more (a rerun opens nothing twice).
        let mut on_switch = fact(0, Some(EVENT_SNAPSHOT_OPEN), None, "v2", 50);
        on_switch.detail = Some(json!({"mode": "chunked", "kind": "bootstrap", "switch_batch_id": 1}));
        let mut opened = rows.clone();
        opened.push(on_switch.clone());
        assert_eq!(switch_to_open(&opened), None);
        assert_eq!(switch_batch_of(&on_switch), Some(1));
        // A full open's row does not count as the switch's open.
        let mut full = on_switch.clone();
        full.detail = Some(json!({"mode": "full", "kind": "bootstrap"}));
        let mut with_full = rows.clone();
        with_full.push(full);
        assert_eq!(switch_to_open(&with_full), Some((Lsn::from_u128(50), 1)));
        // A later switch opens at its own start; a switch of an older generation opens nothing.
        let mut later = rows.clone();
        later.push(on_switch);
        later.push(fact(0, Some(EVENT_CAPTURE_INSTANCE_SWITCHED), Some(4), "v3", 90));
        assert_eq!(switch_to_open(&later), Some((Lsn::from_u128(90), 4)));
        let mut next_gen = rows.clone();
        next_gen.push(fact(1, Some(crate::delta::facts::EVENT_BOOTSTRAP), None, "v2", 70));
        assert_eq!(switch_to_open(&next_gen), None);
    }

    #[test]
    fn a_chunk_stamped_past_a_newer_instances_start_waits_for_the_stream() {
        let old = ci("v1", 10, &["id", "a"]);
        let new = ci("v2", 50, &["id", "a", "b"]);
        let all = vec![old.clone(), new.clone()];
        assert_eq!(waits_for_switch(Lsn::from_u128(30), &old, &all), None);
        assert_eq!(waits_for_switch(Lsn::from_u128(49), &old, &all), Some(new.clone()), "the stream reads v2 after 49");
        assert_eq!(waits_for_switch(Lsn::from_u128(80), &old, &all), Some(new.clone()));
        assert_eq!(waits_for_switch(Lsn::from_u128(80), &new, &all), None, "the stream is on v2");
        // A pinned workflow lists no instances: nothing to wait for.
        assert_eq!(waits_for_switch(Lsn::from_u128(80), &old, &[]), None);
    }

    #[test]
    fn a_fenced_read_waits_for_a_listed_newer_instance_that_adds_columns() {
        let old = ci("v1", 10, &["id", "a"]);
        let new = ci("v2", 50, &["id", "a", "b"]);
        // Listed but above the max LSN (capture lags): a fenced read of v1 now
        // may hold commits after 50 that set b. The stamp does not matter.
        assert_eq!(newer_with_added_columns(&old, &[old.clone(), new.clone()]), Some(&new));
        assert_eq!(newer_with_added_columns(&new, &[old.clone(), new.clone()]), None, "on the newest: nothing");
        assert_eq!(newer_with_added_columns(&old, &[old.clone()]), None);
        assert_eq!(newer_with_added_columns(&old, &[]), None, "a pinned workflow lists none");
        // A newer instance that only drops columns (or keeps them) loses nothing.
        let fewer = ci("v2", 50, &["id"]);
        assert_eq!(newer_with_added_columns(&old, &[old.clone(), fewer]), None);
        // Not established yet, created later: newer all the same.
        let mut unstarted = new.clone();
        unstarted.start_lsn = None;
        assert_eq!(newer_with_added_columns(&old, &[old.clone(), unstarted.clone()]), Some(&unstarted));
        // An older instance (created before, starting before) is never newer.
        assert_eq!(newer_with_added_columns(&new, &[ci("v0", 5, &["id", "a", "b", "c"]), new.clone()]), None);
        let refused = fenced_read_refused(&old, &new, "this full snapshot", "Call again.").to_string();
        assert!(refused.contains("'v2'") && refused.contains("captures b") && refused.contains("'v1'"), "{refused}");
    }

    #[test]
    fn the_recorded_instance_is_current_while_it_exists() {
        let old = ci("v1", 10, &["id"]);
        let new = ci("v2", 50, &["id"]);
        let all = vec![old.clone(), new.clone()];
        assert_eq!(current(Some("V1"), &all, &new).name, "v1");
        assert_eq!(current(Some("gone"), &all, &new).name, "v2");
        assert_eq!(current(None, &all, &new).name, "v2");
    }
}
