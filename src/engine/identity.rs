//! A stream's identity: which source table and which bronze table its app id
//! belongs to, checked before a step writes anything.
//!
//! State is read back by app id (facts rows) and by txn ids derived from it
//! (bronze, plans, silver). Two workflows that name the same app id on a
//! shared facts table would each read the other's position and generation,
//! and their commits would be taken for each other's reruns: rows dropped as
//! "already applied", ranges written twice. So the facts rows bind an app id
//! to the table and the bronze target it was written for (both columns of
//! every facts row), and a bronze table records the source table it holds
//! (table property [`crate::delta::PROP_SOURCE_TABLE`]). A workflow whose
//! identity does not match is refused with exit 2 and a message naming both.
//!
//! The app id's own form is checked when the workflow file is read
//! ([`crate::workflow::check_app_id`]): it can never look like another
//! stream's generation id.

use deltalake::DeltaTable;

use crate::delta::{self, sql_str};
use crate::error::{StepError, StepResult};
use crate::source::{CaptureInstance, TableName};
use crate::workflow::{LocationKey, Relation, Workflow};

/// Refuses a bronze table that holds another source table's rows.
///
/// Tables created by this release carry the source table as a property.
/// Older ones do not: there the instance's key columns must at least be
/// columns of bronze (a bronze table of another table would otherwise be
/// accepted and its missing columns filled with NULL).
pub fn check_bronze_belongs(bronze: &DeltaTable, wf: &Workflow, table: &TableName, instance: &CaptureInstance) -> StepResult<()> {
    let location = &wf.target.bronze;
    let snapshot = bronze.snapshot().map_err(StepError::delta(location))?;
    let recorded = snapshot.metadata().configuration().get(delta::PROP_SOURCE_TABLE).cloned();
    match recorded {
        Some(other) if !same_table_name(&other, &table.to_string()) => Err(StepError::Config(format!(
            "target.bronze {location} holds the rows of source table {other}, not of {table}: \
             point target.bronze of {} at a bronze table of {table} (or an empty folder)",
            wf.path.display()
        ))),
        Some(_) => Ok(()),
        None => {
            let columns: Vec<String> = snapshot.schema().fields().map(|f| f.name().to_string()).collect();
            let missing: Vec<&String> =
                instance.index_columns.iter().filter(|k| !columns.iter().any(|c| c.eq_ignore_ascii_case(k))).collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(StepError::Config(format!(
                    "target.bronze {location} has no column {} of {table}'s key, so it holds another table's rows: \
                     point target.bronze of {} at a bronze table of {table} (or an empty folder)",
                    missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
                    wf.path.display()
                )))
            }
        }
    }
}

/// Refuses a workflow whose app id already names, in this facts table, a
/// stream of another source table or another bronze table.
pub async fn check_facts_belong(facts: &DeltaTable, wf: &Workflow) -> StepResult<()> {
    let batches = delta::query(
        facts,
        &format!("SELECT DISTINCT \"table\", target FROM t WHERE app_id = {}", sql_str(&wf.app_id)),
    )
    .await?;
    let ours_table = wf.table_name().to_string();
    let ours_target = LocationKey::of(&wf.target.bronze).map_err(StepError::Config)?;
    for b in &batches {
        let b = delta::plain_types(b)?;
        let tables = b.column(0).as_any().downcast_ref::<deltalake::arrow::array::StringArray>();
        let targets = b.column(1).as_any().downcast_ref::<deltalake::arrow::array::StringArray>();
        let (Some(tables), Some(targets)) = (tables, targets) else {
            return Err(StepError::Internal("facts columns table/target are not strings".into()));
        };
        for i in 0..b.num_rows() {
            let (their_table, their_target) = (tables.value(i), targets.value(i));
            let same_target = LocationKey::of(their_target).map(|k| k.relation(&ours_target) == Relation::Same).unwrap_or(false);
            if !same_table_name(their_table, &ours_table) || !same_target {
                return Err(StepError::Config(format!(
                    "app_id '{}' already names another stream in facts table {}: its rows are for table {their_table} \
                     into bronze {their_target}, this workflow is for table {ours_table} into bronze {}. Each stream \
                     needs an app id of its own: change app_id in {} (or, if that bronze table was moved, move it back)",
                    wf.app_id,
                    wf.target.facts,
                    wf.target.bronze,
                    wf.path.display()
                )));
            }
        }
    }
    Ok(())
}

/// Refuses facts rows of the workflow's app id that were written for another
/// stream (another source table or bronze table). [`check_facts_belong`]
/// runs once, before a step writes; this runs on every load of the stream's
/// state, so two workflows that share an app id and made their first
/// commits at the same moment (both passing that first check on an empty
/// facts table) are refused as soon as either reads the other's rows,
/// before it decides anything from them.
pub fn check_rows_belong(rows: &[crate::delta::facts::FactRow], wf: &Workflow) -> StepResult<()> {
    let ours_table = wf.table_name().to_string();
    let ours_target = LocationKey::of(&wf.target.bronze).map_err(StepError::Config)?;
    let mut seen: std::collections::HashSet<(&str, &str)> = std::collections::HashSet::new();
    for r in rows {
        if !seen.insert((r.table.as_str(), r.target.as_str())) {
            continue;
        }
        let same_target = LocationKey::of(&r.target).map(|k| k.relation(&ours_target) == Relation::Same).unwrap_or(false);
        if !same_table_name(&r.table, &ours_table) || !same_target {
            return Err(StepError::Config(format!(
                "app_id '{}' names two streams in facts table {}: rows for table {} into bronze {}, and this workflow's, for \
                 table {ours_table} into bronze {} (two workflows with one app id started at the same moment). Each stream \
                 needs an app id of its own: change app_id in the workflow that should not own it, and delete its rows \
                 from the facts (app_id = '{}' AND table = '<its table>')",
                wf.app_id,
                wf.target.facts,
                r.table,
                r.target,
                wf.target.bronze,
                wf.app_id
            )));
        }
    }
    Ok(())
}

/// SQL Server resolves object names case-insensitively under the usual
/// catalog collations, and so does the workflow's table lookup.
fn same_table_name(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}
