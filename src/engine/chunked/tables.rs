//! The plans and facts tables as a chunked snapshot uses them: the plans
//! table opened next to bronze, rows appended under a txn, and a snapshot's
//! plans rows read back. Apart because the open, the plan, the waves and the
//! backfill loop (and `engine::switch`) all go through these few helpers.

use deltalake::DeltaTable;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::delta::facts::{self, FactRow};
use crate::delta::plans::{self, PlanRow};
use crate::delta::{self, sql_str, Appended, TableKind, Txn};
use crate::engine::Context;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;

/// Opens or creates the plans table next to bronze.
pub async fn open_plans(ctx: &Context) -> StepResult<DeltaTable> {
    let location = plans::location_for(&ctx.workflow.target.bronze);
    delta::open_or_create(
        &location,
        &ctx.storage,
        TableKind::Plans,
        &plans::schema(),
        &format!("mssql-cdc snapshot plans of {}: key values of chunked snapshots, next to bronze", ctx.workflow.table_name()),
    )
    .await
}

pub(crate) async fn append_plans(table: &mut DeltaTable, app: &str, rows: Vec<PlanRow>, txn: &Txn) -> StepResult<Appended> {
    let summary: Vec<Value> = rows.iter().map(|r| json!({"event": r.event, "wave": r.wave, "chunk": r.chunk})).collect();
    let meta = json!({"plans": summary, "app_id": app});
    delta::append_batches(table, vec![plans::to_batch(&rows)], plans::schema(), txn, meta).await
}

pub(crate) async fn append_facts_rows(table: &mut DeltaTable, app: &str, rows: Vec<FactRow>, txn: &Txn) -> StepResult<Appended> {
    let meta = json!({"facts": facts::summary(&rows), "app_id": app});
    delta::append_batches(table, vec![facts::to_batch(&rows)], facts::schema(), txn, meta).await
}

/// The plans rows of snapshot `s`, read without creating the plans table
/// (none when it does not exist). `apply` reads them after the facts, so
/// every facts row finds its plans row.
pub(crate) async fn plan_rows_if_any(ctx: &Context, app: &str, s: Lsn) -> StepResult<Vec<PlanRow>> {
    let location = plans::location_for(&ctx.workflow.target.bronze);
    let Some(table) = delta::open_existing(&location, &ctx.storage).await? else { return Ok(vec![]) };
    let batches = delta::query(&table, &format!("SELECT * FROM t WHERE app_id = {} AND snapshot = {}", sql_str(app), sql_str(&s.to_hex()))).await?;
    plans::from_batches(&batches)
}

/// The plans rows of snapshot `s`.
pub(super) async fn plan_rows(table: &mut DeltaTable, app: &str, s: Lsn) -> StepResult<Vec<PlanRow>> {
    table.update_state().await.map_err(StepError::delta(table.table_url().to_string()))?;
    let batches =
        delta::query(table, &format!("SELECT * FROM t WHERE app_id = {} AND snapshot = {}", sql_str(app), sql_str(&s.to_hex()))).await?;
    plans::from_batches(&batches)
}

pub(super) fn payload_of<T: for<'de> Deserialize<'de>>(rows: &[PlanRow], event: &str, what: &str, location: &str) -> StepResult<T> {
    let r = rows.iter().find(|r| r.event == event).ok_or_else(|| {
        StepError::NeedsPerson(format!(
            "the facts record the {what} of a chunked snapshot, but the plans table {location} has no row for it: \
             a range without bounds is never read as the whole table. Restore the plans table, or open a new snapshot"
        ))
    })?;
    serde_json::from_value(r.detail.clone()).map_err(|e| StepError::Internal(format!("the plans table's {what} row does not parse: {e}")))
}
