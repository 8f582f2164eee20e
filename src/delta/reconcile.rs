//! The reconcile report: one table kind of its own, appended by every
//! `reconcile` call. A run writes one `SUMMARY` row and one row per key or
//! chunk it found different, so a person can see which keys and why.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use deltalake::arrow::array::{Array, ArrayRef, Int64Array, StringArray, TimestampMicrosecondArray};
use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

use super::Migration;
use crate::error::{StepError, StepResult};

/// The report's schema history.
pub static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "reconcile report: a summary row per run and a row per difference found",
    adds_columns: &[],
}];

/// One report row.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReportRow {
    pub app_id: String,
    pub run: i64,
    /// SUMMARY, MISSING_TARGET, MISSING_SOURCE, RECORD_DIFF, IN_FLIGHT, SNAPSHOT_PENDING, CHUNK_TILING, CHUNK_ROWS or CHUNK_STAMP.
    pub class: String,
    /// The key as a JSON object (column -> value, a NULL column as null); NULL for summary and chunk rows.
    pub key: Option<serde_json::Value>,
    pub bucket: Option<i64>,
    pub chunk: Option<i64>,
    pub source_hash: Option<String>,
    pub target_hash: Option<String>,
    pub applied_lsn: Option<String>,
    pub source_max_lsn: Option<String>,
    pub detail: Option<serde_json::Value>,
    pub checked_at: Option<DateTime<Utc>>,
}

/// The report's Arrow schema.
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("app_id", DataType::Utf8, false),
        Field::new("run", DataType::Int64, false),
        Field::new("class", DataType::Utf8, false),
        Field::new("key", DataType::Utf8, true),
        Field::new("bucket", DataType::Int64, true),
        Field::new("chunk", DataType::Int64, true),
        Field::new("source_hash", DataType::Utf8, true),
        Field::new("target_hash", DataType::Utf8, true),
        Field::new("applied_lsn", DataType::Utf8, true),
        Field::new("source_max_lsn", DataType::Utf8, true),
        Field::new("detail", DataType::Utf8, true),
        Field::new("checked_at", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
    ]))
}

/// The comment of a report column.
pub fn column_comment(name: &str) -> String {
    match name {
        "app_id" => "The stream's app id.",
        "run" => "The reconcile run (txn version of <app>#reconcile).",
        "class" => "SUMMARY (one per run, counts in detail); MISSING_TARGET (in the source, not silver); MISSING_SOURCE (in silver, not the source); \
                    RECORD_DIFF (both, different values); IN_FLIGHT (a change silver has not applied yet, in bronze or the change table: check again later); \
                    SNAPSHOT_PENDING (a difference outside the chunks silver has applied of the chunked snapshot open now: not a difference yet); \
                    CHUNK_TILING, CHUNK_ROWS, CHUNK_STAMP (a chunk of the newest chunked snapshot disagrees with its plan or with bronze).",
        "key" => "The key's columns as a JSON object; a NULL key column is null.",
        "bucket" => "Tier 1 bucket the key falls in.",
        "chunk" => "The chunk a CHUNK_* row is about.",
        "source_hash" => "SHA-256 of the row's canonical encoding, read from the source.",
        "target_hash" => "SHA-256 of the row's canonical encoding, read from silver.",
        "applied_lsn" => "Silver's applied LSN (control table) when the run read it.",
        "source_max_lsn" => "The source's max LSN read after the source reads.",
        "detail" => "JSON details: counts per class on SUMMARY rows, what disagrees on CHUNK_* rows.",
        "checked_at" => "When the run wrote the report (UTC).",
        _ => "",
    }
    .to_string()
}

/// Rows as one Arrow batch of the report schema.
pub fn to_batch(rows: &[ReportRow]) -> RecordBatch {
    let s = |f: &dyn Fn(&ReportRow) -> Option<String>| -> ArrayRef { Arc::new(rows.iter().map(f).collect::<StringArray>()) };
    let i = |f: &dyn Fn(&ReportRow) -> Option<i64>| -> ArrayRef { Arc::new(rows.iter().map(f).collect::<Int64Array>()) };
    let cols: Vec<ArrayRef> = vec![
        s(&|r| Some(r.app_id.clone())),
        i(&|r| Some(r.run)),
        s(&|r| Some(r.class.clone())),
        s(&|r| r.key.as_ref().map(|k| k.to_string())),
        i(&|r| r.bucket),
        i(&|r| r.chunk),
        s(&|r| r.source_hash.clone()),
        s(&|r| r.target_hash.clone()),
        s(&|r| r.applied_lsn.clone()),
        s(&|r| r.source_max_lsn.clone()),
        s(&|r| r.detail.as_ref().map(|d| d.to_string())),
        Arc::new(rows.iter().map(|r| r.checked_at.map(|t| t.timestamp_micros())).collect::<TimestampMicrosecondArray>().with_timezone("UTC")),
    ];
    RecordBatch::try_new(schema(), cols).expect("report columns match the schema")
}

/// The SUMMARY rows of a `SELECT run, detail, checked_at` over the report,
/// in the order read: (run, detail as JSON, checked_at).
pub fn summaries_from_batches(batches: &[RecordBatch], location: &str) -> StepResult<Vec<(i64, Option<serde_json::Value>, Option<DateTime<Utc>>)>> {
    let bad = || StepError::Internal(format!("the reconcile report {location} has a summary row of an unexpected shape"));
    let mut out = Vec::new();
    for b in batches {
        if b.num_columns() < 3 {
            return Err(bad());
        }
        let run = b.column(0).as_any().downcast_ref::<Int64Array>().ok_or_else(bad)?;
        let detail = b.column(1).as_any().downcast_ref::<StringArray>().ok_or_else(bad)?;
        let at = b.column(2).as_any().downcast_ref::<TimestampMicrosecondArray>().ok_or_else(bad)?;
        for i in 0..b.num_rows() {
            let d = if detail.is_null(i) { None } else { serde_json::from_str(detail.value(i)).ok() };
            let t = if at.is_null(i) { None } else { DateTime::<Utc>::from_timestamp_micros(at.value(i)) };
            out.push((run.value(i), d, t));
        }
    }
    Ok(out)
}
