//! The snapshot's plan: made once, by the first `backfill` call, over the pure
//! planner (the sibling module `engine::plan`, imported as `planner`; hence
//! `planning.rs`, not `plan.rs`), recorded as a plans row read back before its
//! facts row, and only read after that. Holds the planner's source adapter too.

use std::time::Instant;

use async_trait::async_trait;
use chrono::Utc;
use deltalake::DeltaTable;
use serde_json::{json, Value};

use super::tables::{append_facts_rows, append_plans, payload_of, plan_rows};
use crate::engine::rules::{txn_plan, OpenPayload, Opened, PlanPayload, PlannedChunk, EVENT_SNAPSHOT_PLAN};
use crate::delta::facts::FactRow;
use crate::delta::plans::{self, PlanRow};
use crate::engine::plan::{self as planner, KeyCounter, KeySeeker, KeysetShape};
use crate::engine::Context;
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::source::{Isolation, KeyRange, SharedSource, SourceError, TableName};
use crate::types::{Key, SqlType, SqlValue};

/// Source adapters for the planners.
pub(super) struct SourceKeys {
    pub(super) source: SharedSource,
    pub(super) table: TableName,
    pub(super) keys: Vec<String>,
    pub(super) isolation: Isolation,
}

#[async_trait]
impl KeyCounter for SourceKeys {
    async fn count(&self, lo: i64, hi: i64, width: i64) -> Result<Vec<(i64, u64)>, SourceError> {
        self.source.slice_counts(&self.table, &self.keys[0], lo, hi, width, self.isolation).await
    }

    async fn extent(&self, lo: i64, hi: i64) -> Result<Option<(i64, i64)>, SourceError> {
        self.source.slice_extent(&self.table, &self.keys[0], lo, hi, self.isolation).await
    }

    async fn null_rows(&self) -> Result<u64, SourceError> {
        self.source.null_count(&self.table, &self.keys[0], self.isolation).await
    }
}

#[async_trait]
impl KeySeeker for SourceKeys {
    async fn seek(&self, range: &KeyRange, n: u64) -> Result<Option<Key>, SourceError> {
        self.source.key_seek(&self.table, &self.keys, range, n, self.isolation).await
    }

    async fn compare(&self, a: &Key, b: &Key) -> Result<std::cmp::Ordering, SourceError> {
        let answer = self.source.compare_keys(&self.table, &self.keys, &[(a.clone(), b.clone())]).await?;
        answer.first().copied().ok_or_else(|| SourceError::Other("the source answered no comparison".into()))
    }
}

pub(super) fn same_columns(a: &[String], b: &[String]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.eq_ignore_ascii_case(y))
}

pub(super) fn keyset_shape(ctx: &Context, keys: &[String]) -> KeysetShape {
    let types = keys.iter().map(|k| ctx.instance.column(k).map(|c| c.sql_type.clone()).unwrap_or(SqlType::BigInt)).collect();
    KeysetShape { types, unique: same_columns(keys, &ctx.instance.index_columns) }
}

/// Plans every chunk of the snapshot (pure planning over source reads).
async fn compute_plan(ctx: &Context, open: &OpenPayload, chunk_rows: u64, isolation: Isolation) -> StepResult<PlanPayload> {
    let table = ctx.workflow.table_name();
    let adapter = SourceKeys { source: ctx.source.clone(), table: table.clone(), keys: open.keys.clone(), isolation };
    let single_int = open.keys.len() == 1 && ctx.instance.column(&open.keys[0]).is_some_and(|c| c.sql_type.is_integer());
    let (Some(min), Some(max)) = (&open.min, &open.max) else {
        // No key at S (an empty table, or NULL keys only): one chunk; whatever
        // is there now was inserted after S or is NULL, and reading it only replays.
        return Ok(PlanPayload {
            kind: "keyset".into(),
            keys: open.keys.clone(),
            chunk_rows,
            chunk_count: 1,
            chunks: vec![PlannedChunk { chunk: 0, lo: None, hi: None, rows: None }],
            open_end: false,
            isolation,
        });
    };
    if let (true, Some(lo), Some(hi)) = (single_int, min[0].as_i64(), max[0].as_i64()) {
        let estimate = ctx.source.row_estimate(&table).await?;
        let chunks = planner::plan_integer(&adapter, lo, hi, chunk_rows, estimate).await?;
        let chunks: Vec<PlannedChunk> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| PlannedChunk {
                chunk: i as i64,
                lo: c.lo.map(|v| vec![SqlValue::Int(v)]),
                hi: c.hi.map(|v| vec![SqlValue::Int(v)]),
                rows: Some(c.rows),
            })
            .collect();
        return Ok(PlanPayload { kind: "integer".into(), keys: open.keys.clone(), chunk_rows, chunk_count: chunks.len(), chunks, open_end: false, isolation });
    }
    let shape = keyset_shape(ctx, &open.keys);
    let bounds = planner::plan_keyset(&adapter, max, chunk_rows, &shape).await?;
    let end = planner::last_bound(&adapter, max, &shape).await?;
    let mut chunks = Vec::with_capacity(bounds.len() + 1);
    let mut lo: Option<Key> = None;
    for b in bounds {
        chunks.push(PlannedChunk { chunk: chunks.len() as i64, lo: lo.clone(), hi: Some(b.clone()), rows: None });
        lo = Some(b);
    }
    let open_end = end.is_none();
    chunks.push(PlannedChunk { chunk: chunks.len() as i64, lo, hi: end, rows: None });
    Ok(PlanPayload { kind: "keyset".into(), keys: open.keys.clone(), chunk_rows, chunk_count: chunks.len(), chunks, open_end, isolation })
}

/// A heap's plan reads its last chunk open above: no row is left to "above
/// the last chunk's end". Keyed silver takes such rows from the stream's
/// changes after S, key by key; a heap's could only count their images after
/// the moment no row lay above MAX, which is neither S (a switch's snapshot
/// reads MAX long after the newer instance's start) nor any LSN the open can
/// read without a fence (the capture job runs behind the table). The last
/// chunk's own fenced read holds them exactly instead; what it costs is a
/// larger last chunk on a table whose chunk column grows.
fn open_above_for_a_heap(ctx: &Context, mut plan: PlanPayload) -> PlanPayload {
    // A heap: no unique index (`engine::apply::heap::is_heap`, not imported: apply sits above this module).
    if ctx.instance.index_columns.is_empty() {
        if let Some(last) = plan.chunks.last_mut() {
            last.hi = None;
        }
        plan.open_end = false;
    }
    plan
}

/// Reads the plan, making it on the first call (plans row, read back, facts row).
/// `chunk_rows_asked` is the call's `--chunk-rows`, which sizes a new plan
/// only: a recorded plan stays as it is.
pub(super) async fn ensure_plan(
    ctx: &mut Context,
    plans_table: &mut DeltaTable,
    o: &Opened,
    open: &OpenPayload,
    facts_rows: &[FactRow],
    chunk_rows_asked: Option<u64>,
    isolation: Isolation,
) -> StepResult<PlanPayload> {
    let app = ctx.workflow.app_id.clone();
    let hex = o.s.to_hex();
    let location = plans::location_for(&ctx.workflow.target.bronze);
    let has_facts_plan = facts_rows
        .iter()
        .any(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_PLAN) && r.detail.as_ref().and_then(|d| d.get("snapshot")).and_then(Value::as_str) == Some(hex.as_str()));
    let rows = plan_rows(plans_table, &app, o.s).await?;
    if has_facts_plan {
        let plan: PlanPayload = payload_of(&rows, EVENT_SNAPSHOT_PLAN, "plan", &location)?;
        if let Some(n) = chunk_rows_asked.filter(|n| *n != plan.chunk_rows) {
            tracing::warn!(asked = n, planned = plan.chunk_rows, "--chunk-rows is ignored: the snapshot's chunks were planned by its first backfill call and stay fixed");
        }
        return Ok(plan);
    }
    let plan: PlanPayload = match rows.iter().find(|r| r.event == EVENT_SNAPSHOT_PLAN) {
        // A call stopped between the plans row and the facts row: that plan is the one.
        Some(r) => serde_json::from_value(r.detail.clone()).map_err(|e| StepError::Internal(format!("plan row: {e}")))?,
        None => {
            let chunk_rows = chunk_rows_asked.unwrap_or(ctx.workflow.snapshot.chunk_rows).max(1);
            let started = Instant::now();
            let plan = open_above_for_a_heap(ctx, compute_plan(ctx, open, chunk_rows, isolation).await?);
            tracing::info!(snapshot = %o.s, chunks = plan.chunk_count, kind = %plan.kind, ms = started.elapsed().as_millis() as u64, "planned the chunked snapshot");
            let prow = PlanRow {
                app_id: app.clone(),
                snapshot: o.s,
                event: EVENT_SNAPSHOT_PLAN.into(),
                wave: None,
                chunk: None,
                detail: serde_json::to_value(&plan).map_err(|e| StepError::Internal(e.to_string()))?,
                recorded_at: Some(Utc::now()),
            };
            // Not a commit boundary (not in `FAILPOINTS`): a race test holds
            // a first call here, its own plan made, while another call records
            // one (tests/records_race.rs).
            failpoint!("chunked.before_plan_plans");
            append_plans(plans_table, &app, vec![prow], &txn_plan(&app, o.s)).await?;
            failpoint!("chunked.after_plan_plans");
            // The plan read back is the recorded one, whoever wrote it.
            let rows = plan_rows(plans_table, &app, o.s).await?;
            payload_of(&rows, EVENT_SNAPSHOT_PLAN, "plan", &location)?
        }
    };
    let mut row = ctx.fact_row(o.generation);
    row.event = Some(EVENT_SNAPSHOT_PLAN.into());
    row.min_lsn = Some(o.s);
    row.max_lsn = Some(o.s);
    row.detail = Some(json!({"snapshot": hex, "kind": plan.kind, "chunk_rows": plan.chunk_rows, "chunk_count": plan.chunk_count}));
    append_facts_rows(&mut ctx.facts, &app, vec![row], &txn_plan(&app, o.s)).await?;
    failpoint!("chunked.after_plan");
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Tests that close UNTESTED rows of docs/CONFORMANCE.md (28.126).

    #[test]
    fn a_plan_is_on_the_unique_index_for_its_columns_in_any_case_and_never_for_a_prefix() {
        // 28.126 (`keyset_shape`): catches a case-sensitive match (a plan on the index taken as not unique, so it
        // makes the extra seeks) and a prefix of the index taken for it (`zip` without the length check: a prefix
        // may repeat, and a unique plan skips the check that keeps its chunks non-empty).
        fn names(v: &[&str]) -> Vec<String> {
            v.iter().map(|s| s.to_string()).collect()
        }
        assert!(same_columns(&names(&["ID", "Name"]), &names(&["id", "name"])));
        assert!(!same_columns(&names(&["id"]), &names(&["id", "name"])));
    }
}
