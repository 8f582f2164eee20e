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

use deltalake::kernel::StructField;
use serde_json::json;

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
pub fn plan(position: Lsn, current: &CaptureInstance, instances: &[CaptureInstance]) -> InstancePlan {
    let Some(cur_start) = current.start_lsn else { return InstancePlan::Stay { upto: None } };
    let newer = instances
        .iter()
        .filter(|i| i.name != current.name)
        .filter(|i| i.start_lsn.is_some_and(|s| s > cur_start))
        .min_by_key(|i| i.start_lsn);
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

/// Which instance the stream is on when a call starts: the one its newest
/// batch read, while it exists; else the one the context picked.
pub fn current<'a>(recorded: Option<&str>, instances: &'a [CaptureInstance], picked: &'a CaptureInstance) -> &'a CaptureInstance {
    recorded.and_then(|name| instances.iter().find(|i| i.name.eq_ignore_ascii_case(name))).unwrap_or(picked)
}

/// Columns added and dropped between two instances (names only: facts hold no values).
pub fn column_changes(from: &CaptureInstance, to: &CaptureInstance) -> (Vec<String>, Vec<String>) {
    let added = to.columns.iter().filter(|c| from.column(&c.name).is_none()).map(|c| c.name.clone()).collect();
    let dropped = from.columns.iter().filter(|c| to.column(&c.name).is_none()).map(|c| c.name.clone()).collect();
    (added, dropped)
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
        let existing: Vec<String> = ctx.bronze_schema()?.fields().iter().map(|f| f.name().to_lowercase()).collect();
        let wanted = delta::commented_schema(TableKind::Bronze, &bronze::schema(&to.columns))?;
        let new_fields: Vec<StructField> = wanted.fields().filter(|f| !existing.contains(&f.name().to_lowercase())).cloned().collect();
        if !new_fields.is_empty() {
            let label = ctx.workflow.target.bronze.clone();
            ctx.bronze = ctx.bronze.clone().add_columns().with_fields(new_fields).await.map_err(StepError::delta(&label))?;
        }
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
        assert_eq!(column_changes(&old, &new), (vec!["b".to_string()], vec![]));
        assert_eq!(column_changes(&new, &old), (vec![], vec!["b".to_string()]));
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
