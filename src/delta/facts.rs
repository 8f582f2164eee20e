//! The facts table: one row per micro-batch and per event of every stream
//! that writes to it (it may be shared by many tables).
//!
//! It is the stream's durable memory: the position (the newest batch's
//! `max_lsn`), the generations, the snapshots and their completion, the
//! headroom before CDC cleanup. Event rows have `event` set: `bootstrap`,
//! `resnapshot` (the two that complete a snapshot), `snapshot_open` and the
//! others later issues add. It never holds source key values.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use deltalake::arrow::array::{
    Array, ArrayRef, Float64Array, Int32Array, Int64Array, StringArray, TimestampMicrosecondArray,
};
use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

use super::Migration;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;

/// The facts table's schema history.
pub static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "facts: a row per micro-batch and per event",
    adds_columns: &[],
}];

/// Event names.
pub const EVENT_BOOTSTRAP: &str = "bootstrap";
pub const EVENT_RESNAPSHOT: &str = "resnapshot";
pub const EVENT_SNAPSHOT_OPEN: &str = "snapshot_open";
/// A recovery after data loss started: the gap and the position it starts
/// from (written once per target generation, before any snapshot is read).
pub const EVENT_RECOVERY: &str = "recovery";
/// A full re-snapshot whose own LSN was purged before its read ended: it was
/// not committed, and it counts for the anti-loop guard.
pub const EVENT_RESNAPSHOT_FAILED: &str = "resnapshot_failed";
/// A purged range skipped (`on_data_loss = "skip"`), in the batch's commit.
pub const EVENT_DATA_SKIPPED: &str = "data_skipped";
/// The stream moved to a newer capture instance at its start LSN.
pub const EVENT_CAPTURE_INSTANCE_SWITCHED: &str = "capture_instance_switched";
/// The captured columns changed with a capture instance switch.
pub const EVENT_SCHEMA_CHANGE: &str = "schema_change";

/// One facts row.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FactRow {
    pub app_id: String,
    pub table: String,
    pub target: String,
    pub generation: i32,
    pub batch_id: Option<i64>,
    pub event: Option<String>,
    pub capture_instance: Option<String>,
    pub min_lsn: Option<Lsn>,
    pub max_lsn: Option<Lsn>,
    pub rows: Option<i64>,
    pub duration_ms: Option<i64>,
    pub commit_ts: Option<DateTime<Utc>>,
    pub source_max_lsn: Option<Lsn>,
    pub retention_watermark_ts: Option<DateTime<Utc>>,
    pub headroom_seconds: Option<f64>,
    pub lost_from_ts: Option<DateTime<Utc>>,
    pub lost_to_ts: Option<DateTime<Utc>>,
    pub bronze_version: Option<i64>,
    pub detail: Option<serde_json::Value>,
    pub recorded_at: Option<DateTime<Utc>>,
}

fn ts_field(name: &str) -> Field {
    Field::new(name, DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true)
}

/// The facts table's Arrow schema.
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("app_id", DataType::Utf8, false),
        Field::new("table", DataType::Utf8, false),
        Field::new("target", DataType::Utf8, false),
        Field::new("generation", DataType::Int32, false),
        Field::new("batch_id", DataType::Int64, true),
        Field::new("event", DataType::Utf8, true),
        Field::new("capture_instance", DataType::Utf8, true),
        Field::new("min_lsn", DataType::Utf8, true),
        Field::new("max_lsn", DataType::Utf8, true),
        Field::new("rows", DataType::Int64, true),
        Field::new("duration_ms", DataType::Int64, true),
        ts_field("commit_ts"),
        Field::new("source_max_lsn", DataType::Utf8, true),
        ts_field("retention_watermark_ts"),
        Field::new("headroom_seconds", DataType::Float64, true),
        ts_field("lost_from_ts"),
        ts_field("lost_to_ts"),
        Field::new("bronze_version", DataType::Int64, true),
        Field::new("detail", DataType::Utf8, true),
        ts_field("recorded_at"),
    ]))
}

/// The comment of a facts column.
pub fn column_comment(name: &str) -> String {
    match name {
        "app_id" => "The stream's app id, as in its workflow file (generations share it).",
        "table" => "The source table (schema.name).",
        "target" => "The bronze table the stream writes.",
        "generation" => "The stream generation: 0, then one more after each recovery from data loss.",
        "batch_id" => "The micro-batch (txn version of the generation's app id); NULL on snapshot events.",
        "event" => "NULL for a micro-batch; bootstrap or resnapshot for a completed snapshot; snapshot_open when one starts; \
                    recovery when a data-loss recovery starts, resnapshot_failed when its snapshot outlived the retention; \
                    data_skipped for a purged range skipped (certain in detail); capture_instance_switched and schema_change \
                    when the stream moves to a newer capture instance.",
        "capture_instance" => "The capture instance read.",
        "min_lsn" => "First LSN of the batch's range; for a snapshot event its LSN S.",
        "max_lsn" => "Last LSN of the batch's range (the stream's position after it); for a snapshot event S.",
        "rows" => "Rows written to bronze.",
        "duration_ms" => "Time the batch or snapshot took, read to commit.",
        "commit_ts" => "Commit time of max_lsn (UTC).",
        "source_max_lsn" => "sys.fn_cdc_get_max_lsn() when the batch was planned; the lag is the distance to it.",
        "retention_watermark_ts" => "Commit time of the capture instance's min LSN when the batch ran: what cleanup has already purged up to.",
        "headroom_seconds" => "commit_ts minus retention_watermark_ts: how far ahead of CDC cleanup the stream's position was.",
        "lost_from_ts" => "For a data-loss event (recovery, resnapshot, data_skipped): commit time of the last position processed.",
        "lost_to_ts" => "For a data-loss event (recovery, resnapshot, data_skipped): commit time of the min LSN when the loss was found.",
        "bronze_version" => "The bronze table version of the batch's or snapshot's commit.",
        "detail" => "JSON details of an event or batch (never source key values).",
        "recorded_at" => "When this row was written (UTC, the writer's clock).",
        _ => "",
    }
    .to_string()
}

fn ts(v: Option<DateTime<Utc>>) -> Option<i64> {
    v.map(|t| t.timestamp_micros())
}

/// Rows as one Arrow batch of the facts schema.
pub fn to_batch(rows: &[FactRow]) -> RecordBatch {
    let s = |f: &dyn Fn(&FactRow) -> Option<String>| -> ArrayRef { Arc::new(rows.iter().map(f).collect::<StringArray>()) };
    let i64s = |f: &dyn Fn(&FactRow) -> Option<i64>| -> ArrayRef { Arc::new(rows.iter().map(f).collect::<Int64Array>()) };
    let tss = |f: &dyn Fn(&FactRow) -> Option<i64>| -> ArrayRef {
        Arc::new(rows.iter().map(f).collect::<TimestampMicrosecondArray>().with_timezone("UTC"))
    };
    let cols: Vec<ArrayRef> = vec![
        s(&|r| Some(r.app_id.clone())),
        s(&|r| Some(r.table.clone())),
        s(&|r| Some(r.target.clone())),
        Arc::new(rows.iter().map(|r| Some(r.generation)).collect::<Int32Array>()),
        i64s(&|r| r.batch_id),
        s(&|r| r.event.clone()),
        s(&|r| r.capture_instance.clone()),
        s(&|r| r.min_lsn.map(|l| l.to_hex())),
        s(&|r| r.max_lsn.map(|l| l.to_hex())),
        i64s(&|r| r.rows),
        i64s(&|r| r.duration_ms),
        tss(&|r| ts(r.commit_ts)),
        s(&|r| r.source_max_lsn.map(|l| l.to_hex())),
        tss(&|r| ts(r.retention_watermark_ts)),
        Arc::new(rows.iter().map(|r| r.headroom_seconds).collect::<Float64Array>()),
        tss(&|r| ts(r.lost_from_ts)),
        tss(&|r| ts(r.lost_to_ts)),
        i64s(&|r| r.bronze_version),
        s(&|r| r.detail.as_ref().map(|d| d.to_string())),
        tss(&|r| ts(r.recorded_at)),
    ];
    RecordBatch::try_new(schema(), cols).expect("facts columns match the schema")
}

/// Reads facts rows back from batches of the facts schema (any column order).
pub fn from_batches(batches: &[RecordBatch]) -> StepResult<Vec<FactRow>> {
    let mut out = Vec::new();
    for b in batches {
        let get = |name: &str| -> StepResult<&ArrayRef> {
            b.column_by_name(name).ok_or_else(|| StepError::Internal(format!("facts batch without column {name}")))
        };
        let strs = |name: &str| -> StepResult<&StringArray> {
            get(name)?.as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal(format!("facts.{name} is not text")))
        };
        let i64s = |name: &str| -> StepResult<&Int64Array> {
            get(name)?.as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal(format!("facts.{name} is not bigint")))
        };
        let tss = |name: &str| -> StepResult<&TimestampMicrosecondArray> {
            get(name)?
                .as_any()
                .downcast_ref::<TimestampMicrosecondArray>()
                .ok_or_else(|| StepError::Internal(format!("facts.{name} is not a timestamp")))
        };
        let gen = get("generation")?.as_any().downcast_ref::<Int32Array>().ok_or_else(|| StepError::Internal("facts.generation".into()))?;
        let head = get("headroom_seconds")?.as_any().downcast_ref::<Float64Array>().ok_or_else(|| StepError::Internal("facts.headroom".into()))?;
        let (app, table, target, event, ci, minl, maxl, smax, detail) = (
            strs("app_id")?,
            strs("table")?,
            strs("target")?,
            strs("event")?,
            strs("capture_instance")?,
            strs("min_lsn")?,
            strs("max_lsn")?,
            strs("source_max_lsn")?,
            strs("detail")?,
        );
        let (batch_id, rows, dur, bv) = (i64s("batch_id")?, i64s("rows")?, i64s("duration_ms")?, i64s("bronze_version")?);
        let (cts, rw, lf, lt, rec) = (tss("commit_ts")?, tss("retention_watermark_ts")?, tss("lost_from_ts")?, tss("lost_to_ts")?, tss("recorded_at")?);
        let ostr = |a: &StringArray, i: usize| if a.is_null(i) { None } else { Some(a.value(i).to_string()) };
        let oi = |a: &Int64Array, i: usize| if a.is_null(i) { None } else { Some(a.value(i)) };
        let ot = |a: &TimestampMicrosecondArray, i: usize| if a.is_null(i) { None } else { DateTime::from_timestamp_micros(a.value(i)) };
        let olsn = |a: &StringArray, i: usize| -> StepResult<Option<Lsn>> {
            match ostr(a, i) {
                None => Ok(None),
                Some(s) => Lsn::parse(&s).map(Some).map_err(|e| StepError::Internal(format!("facts holds a bad LSN: {e}"))),
            }
        };
        for i in 0..b.num_rows() {
            out.push(FactRow {
                app_id: app.value(i).to_string(),
                table: table.value(i).to_string(),
                target: target.value(i).to_string(),
                generation: gen.value(i),
                batch_id: oi(batch_id, i),
                event: ostr(event, i),
                capture_instance: ostr(ci, i),
                min_lsn: olsn(minl, i)?,
                max_lsn: olsn(maxl, i)?,
                rows: oi(rows, i),
                duration_ms: oi(dur, i),
                commit_ts: ot(cts, i),
                source_max_lsn: olsn(smax, i)?,
                retention_watermark_ts: ot(rw, i),
                headroom_seconds: if head.is_null(i) { None } else { Some(head.value(i)) },
                lost_from_ts: ot(lf, i),
                lost_to_ts: ot(lt, i),
                bronze_version: oi(bv, i),
                detail: ostr(detail, i).and_then(|d| serde_json::from_str(&d).ok()),
                recorded_at: ot(rec, i),
            });
        }
    }
    Ok(out)
}

/// A compact, deterministic summary of facts rows for the commit metadata
/// (and so for the golden transition logs): no timings, no wall-clock times.
pub fn summary(rows: &[FactRow]) -> serde_json::Value {
    serde_json::Value::Array(
        rows.iter()
            .map(|r| {
                let mut v = serde_json::json!({
                    "event": r.event,
                    "generation": r.generation,
                    "batch_id": r.batch_id,
                    "min_lsn": r.min_lsn,
                    "max_lsn": r.max_lsn,
                    "rows": r.rows,
                });
                if r.detail.as_ref().and_then(|d| d.get("repaired")).is_some() {
                    v["repaired"] = serde_json::json!(true);
                }
                v
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_through_arrow() {
        let r = FactRow {
            app_id: "a".into(),
            table: "dbo.t".into(),
            target: "/x".into(),
            generation: 2,
            batch_id: Some(7),
            event: None,
            capture_instance: Some("dbo_t".into()),
            min_lsn: Some(Lsn::from_parts(1, 2, 3)),
            max_lsn: Some(Lsn::from_parts(1, 2, 9)),
            rows: Some(10),
            duration_ms: Some(5),
            commit_ts: DateTime::from_timestamp(1_700_000_000, 0),
            headroom_seconds: Some(3600.5),
            detail: Some(serde_json::json!({"k": 1})),
            ..Default::default()
        };
        let e = FactRow { event: Some(EVENT_BOOTSTRAP.into()), batch_id: None, ..r.clone() };
        let back = from_batches(&[to_batch(&[r.clone(), e.clone()])]).unwrap();
        assert_eq!(back, vec![r, e]);
    }
}
