//! The plans table: `<bronze>_snapshot_plans`, next to bronze.
//!
//! A chunked snapshot cuts the table on source key values (its extent, every
//! chunk's bounds). Those values are data: they stay out of the facts table,
//! which operators and dashboards read and which many tables may share, and
//! live here instead, in a sibling of bronze, so whoever may read bronze may
//! read them and nobody else needs to (adr-0028 Amendment 4).
//!
//! One row per `snapshot_open`, `snapshot_plan` and `snapshot_chunk` facts row
//! of a chunked snapshot, its `detail` the payload whole. Each row is written
//! before its facts row, with the facts row's own txn id (another table, so
//! the ids do not collide); readers read the facts first and the plans after,
//! so every facts row they hold finds its plans row.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use deltalake::arrow::array::{Array, ArrayRef, Int64Array, StringArray, TimestampMicrosecondArray};
use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

use super::Migration;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;

/// The plans table's schema history.
pub static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "snapshot plans: key values of chunked snapshots (extent, plan, chunk bounds)",
    adds_columns: &[],
}];

/// Where the plans table of a bronze table lives: a sibling named after it.
pub fn location_for(bronze: &str) -> String {
    format!("{}_snapshot_plans", bronze.trim_end_matches('/'))
}

/// One plans row.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PlanRow {
    pub app_id: String,
    /// S of the snapshot.
    pub snapshot: Lsn,
    /// `snapshot_open`, `snapshot_plan` or `snapshot_chunk`, as the facts row it completes.
    pub event: String,
    pub wave: Option<i64>,
    pub chunk: Option<i64>,
    pub detail: serde_json::Value,
    pub recorded_at: Option<DateTime<Utc>>,
}

/// The plans table's Arrow schema.
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("app_id", DataType::Utf8, false),
        Field::new("snapshot", DataType::Utf8, false),
        Field::new("event", DataType::Utf8, false),
        Field::new("wave", DataType::Int64, true),
        Field::new("chunk", DataType::Int64, true),
        Field::new("detail", DataType::Utf8, false),
        Field::new("recorded_at", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
    ]))
}

/// The comment of a plans column.
pub fn column_comment(name: &str) -> String {
    match name {
        "app_id" => "The stream's app id (as in the facts rows).",
        "snapshot" => "S: the LSN the chunked snapshot was opened at (hex).",
        "event" => "The facts event this row completes: snapshot_open, snapshot_plan or snapshot_chunk.",
        "wave" => "The wave that read the chunk (snapshot_chunk rows).",
        "chunk" => "The chunk's index in the plan (snapshot_chunk rows).",
        "detail" => "The payload with source key values: the key's extent, the plan's bounds, a chunk's bounds (JSON).",
        "recorded_at" => "When this row was written (UTC, the writer's clock).",
        _ => "",
    }
    .to_string()
}

/// Rows as one Arrow batch of the plans schema.
pub fn to_batch(rows: &[PlanRow]) -> RecordBatch {
    let cols: Vec<ArrayRef> = vec![
        Arc::new(rows.iter().map(|r| Some(r.app_id.clone())).collect::<StringArray>()),
        Arc::new(rows.iter().map(|r| Some(r.snapshot.to_hex())).collect::<StringArray>()),
        Arc::new(rows.iter().map(|r| Some(r.event.clone())).collect::<StringArray>()),
        Arc::new(rows.iter().map(|r| r.wave).collect::<Int64Array>()),
        Arc::new(rows.iter().map(|r| r.chunk).collect::<Int64Array>()),
        Arc::new(rows.iter().map(|r| Some(r.detail.to_string())).collect::<StringArray>()),
        Arc::new(rows.iter().map(|r| r.recorded_at.map(|t| t.timestamp_micros())).collect::<TimestampMicrosecondArray>().with_timezone("UTC")),
    ];
    RecordBatch::try_new(schema(), cols).expect("plans columns match the schema")
}

/// Reads plans rows back from batches of the plans schema.
pub fn from_batches(batches: &[RecordBatch]) -> StepResult<Vec<PlanRow>> {
    let mut out = Vec::new();
    for b in batches {
        let get = |name: &str| -> StepResult<&ArrayRef> {
            b.column_by_name(name).ok_or_else(|| StepError::Internal(format!("plans batch without column {name}")))
        };
        let strs = |name: &str| -> StepResult<&StringArray> {
            get(name)?.as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal(format!("plans.{name} is not text")))
        };
        let i64s = |name: &str| -> StepResult<&Int64Array> {
            get(name)?.as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal(format!("plans.{name} is not bigint")))
        };
        let (app, snap, event, detail) = (strs("app_id")?, strs("snapshot")?, strs("event")?, strs("detail")?);
        let (wave, chunk) = (i64s("wave")?, i64s("chunk")?);
        let rec = get("recorded_at")?
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .ok_or_else(|| StepError::Internal("plans.recorded_at is not a timestamp".into()))?;
        for i in 0..b.num_rows() {
            out.push(PlanRow {
                app_id: app.value(i).to_string(),
                snapshot: Lsn::parse(snap.value(i)).map_err(|e| StepError::Internal(format!("plans holds a bad LSN: {e}")))?,
                event: event.value(i).to_string(),
                wave: if wave.is_null(i) { None } else { Some(wave.value(i)) },
                chunk: if chunk.is_null(i) { None } else { Some(chunk.value(i)) },
                detail: serde_json::from_str(detail.value(i))
                    .map_err(|e| StepError::Internal(format!("plans.detail is not JSON: {e}")))?,
                recorded_at: if rec.is_null(i) { None } else { DateTime::from_timestamp_micros(rec.value(i)) },
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_and_location_is_a_sibling() {
        let r = PlanRow {
            app_id: "a".into(),
            snapshot: Lsn::from_parts(1, 2, 3),
            event: "snapshot_chunk".into(),
            wave: Some(2),
            chunk: Some(7),
            detail: serde_json::json!({"lo": [{"Int": 5}], "hi": null}),
            recorded_at: DateTime::from_timestamp(1_700_000_000, 0),
        };
        assert_eq!(from_batches(&[to_batch(std::slice::from_ref(&r))]).unwrap(), vec![r]);
        assert_eq!(location_for("/x/bronze/"), "/x/bronze_snapshot_plans");
        assert_eq!(location_for("s3://b/t/bronze"), "s3://b/t/bronze_snapshot_plans");
    }
}
