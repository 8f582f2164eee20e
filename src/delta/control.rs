//! Silver's control table: `<silver>_control`, one row per `apply` call.
//!
//! It is silver's position, kept in Delta like every other state: the LSN
//! silver holds every change up to (`applied_lsn`), the completed snapshot
//! it was last rebuilt from, the chunked snapshot it is applying wave by
//! wave, and the verdict `finalized_until`: the LSN up to which silver is
//! known complete. The verdict is held while a snapshot is open (silver then
//! lacks the rows of chunks not read yet) and only ever moves from facts
//! rows, never from silver's own content.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use deltalake::arrow::array::{Array, ArrayRef, Int64Array, StringArray, TimestampMicrosecondArray};
use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

use super::Migration;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;

/// The control table's schema history.
pub static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "silver control: a row per apply (position, snapshot, open snapshot and wave, verdict)",
    adds_columns: &[],
}];

/// One control row: silver's state after an `apply`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ControlRow {
    pub app_id: String,
    /// The apply's sequence number (txn version of both of its commits).
    pub seq: i64,
    /// Silver holds every bronze change up to this LSN.
    pub applied_lsn: Option<Lsn>,
    /// The completed snapshot (bootstrap or resnapshot) silver was last rebuilt from.
    pub snapshot_lsn: Option<Lsn>,
    /// The chunked snapshot being applied wave by wave, while open.
    pub open_snapshot_lsn: Option<Lsn>,
    /// The newest wave of the open snapshot silver holds.
    pub snapshot_wave: Option<i64>,
    /// Silver is complete up to this LSN; held while a snapshot is open.
    pub finalized_until: Option<Lsn>,
    /// `rebuild`, `waves`, `changes` or `position`.
    pub action: String,
    pub rows_upserted: Option<i64>,
    pub rows_deleted: Option<i64>,
    /// The silver version of the apply's MERGE (None when it committed nothing).
    pub silver_version: Option<i64>,
    pub detail: Option<serde_json::Value>,
    pub recorded_at: Option<DateTime<Utc>>,
}

/// The control table's Arrow schema.
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("app_id", DataType::Utf8, false),
        Field::new("seq", DataType::Int64, false),
        Field::new("applied_lsn", DataType::Utf8, true),
        Field::new("snapshot_lsn", DataType::Utf8, true),
        Field::new("open_snapshot_lsn", DataType::Utf8, true),
        Field::new("snapshot_wave", DataType::Int64, true),
        Field::new("finalized_until", DataType::Utf8, true),
        Field::new("action", DataType::Utf8, false),
        Field::new("rows_upserted", DataType::Int64, true),
        Field::new("rows_deleted", DataType::Int64, true),
        Field::new("silver_version", DataType::Int64, true),
        Field::new("detail", DataType::Utf8, true),
        Field::new("recorded_at", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
    ]))
}

/// The comment of a control column.
pub fn column_comment(name: &str) -> String {
    match name {
        "app_id" => "The stream's app id.",
        "seq" => "The apply's sequence number: txn version of its silver MERGE (<app>#silver) and of this row (<app>#control).",
        "applied_lsn" => "Silver holds every bronze change with _start_lsn up to this LSN (hex).",
        "snapshot_lsn" => "S of the completed snapshot (bootstrap or resnapshot) silver was last rebuilt from.",
        "open_snapshot_lsn" => "S of the chunked snapshot silver applies wave by wave while it is open; NULL otherwise.",
        "snapshot_wave" => "The newest wave of the open chunked snapshot silver holds.",
        "finalized_until" => "Verdict: silver is complete up to this LSN. Held while a snapshot is open; only moved from facts rows.",
        "action" => "What the apply did: rebuild (from a completed snapshot), waves, changes, or position (no row changed).",
        "rows_upserted" => "Silver rows inserted or updated by the apply's MERGE.",
        "rows_deleted" => "Silver rows deleted by the apply's MERGE.",
        "silver_version" => "The silver table version of the MERGE; NULL when it committed nothing.",
        "detail" => "JSON details (waves applied, range deletes, repaired).",
        "recorded_at" => "When this row was written (UTC, the writer's clock).",
        _ => "",
    }
    .to_string()
}

/// Rows as one Arrow batch of the control schema.
pub fn to_batch(rows: &[ControlRow]) -> RecordBatch {
    let s = |f: &dyn Fn(&ControlRow) -> Option<String>| -> ArrayRef { Arc::new(rows.iter().map(f).collect::<StringArray>()) };
    let i = |f: &dyn Fn(&ControlRow) -> Option<i64>| -> ArrayRef { Arc::new(rows.iter().map(f).collect::<Int64Array>()) };
    let lsn = |l: Option<Lsn>| l.map(|l| l.to_hex());
    let cols: Vec<ArrayRef> = vec![
        s(&|r| Some(r.app_id.clone())),
        i(&|r| Some(r.seq)),
        s(&|r| lsn(r.applied_lsn)),
        s(&|r| lsn(r.snapshot_lsn)),
        s(&|r| lsn(r.open_snapshot_lsn)),
        i(&|r| r.snapshot_wave),
        s(&|r| lsn(r.finalized_until)),
        s(&|r| Some(r.action.clone())),
        i(&|r| r.rows_upserted),
        i(&|r| r.rows_deleted),
        i(&|r| r.silver_version),
        s(&|r| r.detail.as_ref().map(|d| d.to_string())),
        Arc::new(rows.iter().map(|r| r.recorded_at.map(|t| t.timestamp_micros())).collect::<TimestampMicrosecondArray>().with_timezone("UTC")),
    ];
    RecordBatch::try_new(schema(), cols).expect("control columns match the schema")
}

/// Reads control rows back (any column order).
pub fn from_batches(batches: &[RecordBatch]) -> StepResult<Vec<ControlRow>> {
    let mut out = Vec::new();
    for b in batches {
        let get = |name: &str| -> StepResult<&ArrayRef> {
            b.column_by_name(name).ok_or_else(|| StepError::Internal(format!("control batch without column {name}")))
        };
        let strs = |name: &str| -> StepResult<&StringArray> {
            get(name)?.as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal(format!("control.{name} is not text")))
        };
        let i64s = |name: &str| -> StepResult<&Int64Array> {
            get(name)?.as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal(format!("control.{name} is not bigint")))
        };
        let rec = get("recorded_at")?
            .as_any()
            .downcast_ref::<TimestampMicrosecondArray>()
            .ok_or_else(|| StepError::Internal("control.recorded_at is not a timestamp".into()))?;
        let (app, applied, snap, open, fin, action, detail) =
            (strs("app_id")?, strs("applied_lsn")?, strs("snapshot_lsn")?, strs("open_snapshot_lsn")?, strs("finalized_until")?, strs("action")?, strs("detail")?);
        let (seq, wave, up, del, ver) = (i64s("seq")?, i64s("snapshot_wave")?, i64s("rows_upserted")?, i64s("rows_deleted")?, i64s("silver_version")?);
        let oi = |a: &Int64Array, i: usize| if a.is_null(i) { None } else { Some(a.value(i)) };
        let olsn = |a: &StringArray, i: usize| -> StepResult<Option<Lsn>> {
            if a.is_null(i) {
                return Ok(None);
            }
            Lsn::parse(a.value(i)).map(Some).map_err(|e| StepError::Internal(format!("control holds a bad LSN: {e}")))
        };
        for i in 0..b.num_rows() {
            out.push(ControlRow {
                app_id: app.value(i).to_string(),
                seq: seq.value(i),
                applied_lsn: olsn(applied, i)?,
                snapshot_lsn: olsn(snap, i)?,
                open_snapshot_lsn: olsn(open, i)?,
                snapshot_wave: oi(wave, i),
                finalized_until: olsn(fin, i)?,
                action: action.value(i).to_string(),
                rows_upserted: oi(up, i),
                rows_deleted: oi(del, i),
                silver_version: oi(ver, i),
                detail: if detail.is_null(i) { None } else { serde_json::from_str(detail.value(i)).ok() },
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
    fn rows_round_trip() {
        let r = ControlRow {
            app_id: "a".into(),
            seq: 3,
            applied_lsn: Some(Lsn::from_parts(1, 2, 3)),
            snapshot_lsn: Some(Lsn::from_parts(1, 1, 1)),
            open_snapshot_lsn: None,
            snapshot_wave: Some(2),
            finalized_until: None,
            action: "changes".into(),
            rows_upserted: Some(10),
            rows_deleted: Some(1),
            silver_version: Some(4),
            detail: Some(serde_json::json!({"x": 1})),
            recorded_at: DateTime::from_timestamp(1_700_000_000, 0),
        };
        assert_eq!(from_batches(&[to_batch(std::slice::from_ref(&r))]).unwrap(), vec![r]);
    }
}
