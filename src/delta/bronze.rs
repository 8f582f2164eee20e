//! Bronze: the change log of one source table in Delta.
//!
//! Each row is a captured row image plus the CDC columns below. Change rows
//! come from the stream (operations 1-4); snapshot rows (operation 0) from a
//! snapshot or a seed, stamped with the snapshot's LSN in `_snapshot`.
//! The rebuild rule (the latest row per key by (`_start_lsn`, `_command_id`,
//! `_seqval`, `_operation`) over the newest snapshot and the changes after it)
//! reconstructs the table at any position the stream reached.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use deltalake::arrow::array::{
    Array, ArrayRef, FixedSizeBinaryArray, Int32Array, Int64Array, StringArray, TimestampMicrosecondArray,
};
use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::arrow::record_batch::RecordBatch;

use super::Migration;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;
use crate::source::{ServerZone, CHANGE_COMMAND_ID, CHANGE_OPERATION, CHANGE_SEQVAL, CHANGE_START_LSN, CHANGE_TRAN_END_TIME};
use crate::types::ColumnDesc;

pub const START_LSN: &str = "_start_lsn";
pub const SEQVAL: &str = "_seqval";
pub const OPERATION: &str = "_operation";
pub const COMMAND_ID: &str = "_command_id";
pub const COMMIT_TS: &str = "_commit_ts";
pub const BATCH_ID: &str = "_batch_id";
pub const CAPTURE_INSTANCE: &str = "_capture_instance";
pub const SNAPSHOT: &str = "_snapshot";
pub const CHUNK: &str = "_chunk";

/// Bronze's schema history.
pub static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "bronze: captured columns plus _start_lsn, _seqval, _operation, _command_id, _commit_ts, _batch_id, _capture_instance, _snapshot, _chunk",
    adds_columns: &[],
}];

/// The CDC columns every bronze table ends with.
pub fn meta_fields() -> Vec<Field> {
    vec![
        Field::new(START_LSN, DataType::Utf8, true),
        Field::new(SEQVAL, DataType::Utf8, true),
        Field::new(OPERATION, DataType::Int32, true),
        Field::new(COMMAND_ID, DataType::Int32, true),
        Field::new(COMMIT_TS, DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
        Field::new(BATCH_ID, DataType::Int64, true),
        Field::new(CAPTURE_INSTANCE, DataType::Utf8, true),
        Field::new(SNAPSHOT, DataType::Utf8, true),
        Field::new(CHUNK, DataType::Int64, true),
    ]
}

/// True for the names of bronze's own CDC columns.
pub fn is_meta_column(name: &str) -> bool {
    meta_fields().iter().any(|f| f.name() == name)
}

/// Bronze's schema for these captured columns.
pub fn schema(columns: &[ColumnDesc]) -> SchemaRef {
    let mut fields: Vec<Field> = columns.iter().map(|c| c.arrow_field()).collect();
    fields.extend(meta_fields());
    Arc::new(Schema::new(fields))
}

/// The comment of a bronze column.
pub fn column_comment(name: &str) -> String {
    match name {
        START_LSN => "Commit LSN of the change (hex, 0x + 20 digits, sorts as the LSN). On snapshot rows: the snapshot's LSN, or a chunk's stamp.".into(),
        SEQVAL => "__$seqval: the operation's position in the log (hex). NULL on snapshot rows.".into(),
        OPERATION => "0 snapshot row, 1 delete, 2 insert, 3 update before-image, 4 update after-image.".into(),
        COMMAND_ID => "__$command_id: order of the operation inside its transaction. NULL on snapshot rows and old change tables.".into(),
        COMMIT_TS => "Commit time of _start_lsn (UTC), from cdc.lsn_time_mapping converted from the server's time zone.".into(),
        BATCH_ID => "The micro-batch that wrote the row (txn version of the stream's app id). NULL on snapshot rows.".into(),
        CAPTURE_INSTANCE => "The capture instance the row was read from.".into(),
        SNAPSHOT => "The LSN S of the snapshot the row belongs to; NULL on change rows.".into(),
        CHUNK => "The chunk of a chunked snapshot that read the row; NULL otherwise.".into(),
        other => format!("Source column {other}, as captured."),
    }
}

/// Converts a change batch (the source's `change_schema`) into bronze rows.
/// Captured columns are matched to bronze's by name; a bronze column the batch
/// lacks is NULL. Commit times are converted from the server's zone to UTC.
pub fn from_changes(batch: &RecordBatch, bronze: &SchemaRef, zone: &ServerZone, batch_id: i64, capture_instance: &str) -> StepResult<RecordBatch> {
    let n = batch.num_rows();
    let col = |name: &str| -> StepResult<&ArrayRef> {
        batch.column_by_name(name).ok_or_else(|| StepError::Internal(format!("change batch without {name}")))
    };
    let lsn_hex = |a: &ArrayRef| -> StepResult<ArrayRef> {
        let a = a.as_any().downcast_ref::<FixedSizeBinaryArray>().ok_or_else(|| StepError::Internal("LSN column is not binary(10)".into()))?;
        let v: StringArray = (0..n).map(|i| if a.is_null(i) { None } else { Some(lsn_of(a.value(i)).to_hex()) }).collect();
        Ok(Arc::new(v))
    };
    let start = lsn_hex(col(CHANGE_START_LSN)?)?;
    let seq = lsn_hex(col(CHANGE_SEQVAL)?)?;
    let times = col(CHANGE_TRAN_END_TIME)?
        .as_any()
        .downcast_ref::<TimestampMicrosecondArray>()
        .ok_or_else(|| StepError::Internal("tran_end_time is not a timestamp".into()))?;
    let commit_ts: TimestampMicrosecondArray = (0..n)
        .map(|i| {
            if times.is_null(i) {
                None
            } else {
                let local = DateTime::from_timestamp_micros(times.value(i)).map(|t| t.naive_utc());
                local.map(|l| zone.to_utc(l).timestamp_micros())
            }
        })
        .collect::<TimestampMicrosecondArray>()
        .with_timezone("UTC");
    let meta: Vec<(&str, ArrayRef)> = vec![
        (START_LSN, start),
        (SEQVAL, seq),
        (OPERATION, col(CHANGE_OPERATION)?.clone()),
        (COMMAND_ID, col(CHANGE_COMMAND_ID)?.clone()),
        (COMMIT_TS, Arc::new(commit_ts)),
        (BATCH_ID, Arc::new(Int64Array::from(vec![batch_id; n]))),
        (CAPTURE_INSTANCE, Arc::new(StringArray::from(vec![capture_instance; n]))),
        (SNAPSHOT, Arc::new(StringArray::from(vec![None::<&str>; n]))),
        (CHUNK, Arc::new(Int64Array::from(vec![None::<i64>; n]))),
    ];
    conform(batch, bronze, &meta)
}

/// Stamps for snapshot rows.
#[derive(Debug, Clone)]
pub struct SnapshotStamp {
    /// S: the snapshot the rows belong to.
    pub snapshot: Lsn,
    /// The row's `_start_lsn`: S for a whole snapshot, the chunk's stamp L for a chunk.
    pub start_lsn: Lsn,
    /// Commit time of `start_lsn`, UTC.
    pub commit_ts: Option<DateTime<Utc>>,
    pub capture_instance: String,
    pub chunk: Option<i64>,
}

/// Converts a snapshot batch (captured columns) into bronze operation-0 rows.
pub fn from_snapshot(batch: &RecordBatch, bronze: &SchemaRef, stamp: &SnapshotStamp) -> StepResult<RecordBatch> {
    let n = batch.num_rows();
    let ts = stamp.commit_ts.map(|t| t.timestamp_micros());
    let meta: Vec<(&str, ArrayRef)> = vec![
        (START_LSN, Arc::new(StringArray::from(vec![stamp.start_lsn.to_hex(); n]))),
        (SEQVAL, Arc::new(StringArray::from(vec![None::<&str>; n]))),
        (OPERATION, Arc::new(Int32Array::from(vec![0; n]))),
        (COMMAND_ID, Arc::new(Int32Array::from(vec![None::<i32>; n]))),
        (COMMIT_TS, Arc::new(TimestampMicrosecondArray::from(vec![ts; n]).with_timezone("UTC"))),
        (BATCH_ID, Arc::new(Int64Array::from(vec![None::<i64>; n]))),
        (CAPTURE_INSTANCE, Arc::new(StringArray::from(vec![stamp.capture_instance.as_str(); n]))),
        (SNAPSHOT, Arc::new(StringArray::from(vec![stamp.snapshot.to_hex(); n]))),
        (CHUNK, Arc::new(Int64Array::from(vec![stamp.chunk; n]))),
    ];
    conform(batch, bronze, &meta)
}

/// Builds a batch of bronze's schema: CDC columns from `meta`, every other
/// column from `batch` by name (case-insensitively, as SQL Server resolves
/// names), NULL when the batch lacks it.
fn conform(batch: &RecordBatch, bronze: &SchemaRef, meta: &[(&str, ArrayRef)]) -> StepResult<RecordBatch> {
    let n = batch.num_rows();
    let mut arrays: Vec<ArrayRef> = Vec::with_capacity(bronze.fields().len());
    for f in bronze.fields() {
        if let Some((_, a)) = meta.iter().find(|(name, _)| *name == f.name()) {
            arrays.push(a.clone());
            continue;
        }
        let idx = batch.schema().fields().iter().position(|bf| bf.name().eq_ignore_ascii_case(f.name()));
        match idx {
            Some(i) => arrays.push(exact_cast(batch.column(i), f)?),
            None => arrays.push(deltalake::arrow::array::new_null_array(f.data_type(), n)),
        }
    }
    RecordBatch::try_new(bronze.clone(), arrays).map_err(|e| StepError::Internal(format!("bronze batch: {e}")))
}

/// A column as bronze's field holds it, or an error if that would change a
/// value. A captured column whose type changed at the source arrives in its
/// new type (SQL Server applies a type change to the change table too) while
/// bronze keeps the old one. Arrow's default cast turns a value that does not
/// fit into NULL and rounds decimals to the smaller scale, both silently; here
/// the cast must be exact: it runs with `safe: false` (overflow is an error)
/// and the result is cast back and compared with what arrived, which also
/// catches rounding. A widening that keeps every value (int to bigint in
/// bronze, say) passes value by value.
fn exact_cast(arrived: &ArrayRef, field: &Field) -> StepResult<ArrayRef> {
    use deltalake::arrow::compute::{cast_with_options, CastOptions};
    if arrived.data_type() == field.data_type() {
        return Ok(arrived.clone());
    }
    let refuse = |why: String| {
        StepError::NeedsPerson(format!(
            "column '{}' arrives as {} but bronze holds it as {}, and {why}. The column's type changed at the source: \
             create a new capture instance, then re-snapshot into a new bronze table (or widen this bronze's column by hand)",
            field.name(),
            arrived.data_type(),
            field.data_type()
        ))
    };
    let strict = CastOptions { safe: false, ..Default::default() };
    let cast = cast_with_options(arrived, field.data_type(), &strict).map_err(|e| refuse(format!("a value does not fit ({e})")))?;
    let back = cast_with_options(&cast, arrived.data_type(), &strict).map_err(|e| refuse(format!("a value does not fit ({e})")))?;
    if back.to_data() != arrived.to_data() {
        let row = (0..arrived.len()).find(|&r| back.slice(r, 1).to_data() != arrived.slice(r, 1).to_data()).unwrap_or(0);
        return Err(refuse(format!("row {row} of the batch would change value")));
    }
    Ok(cast)
}

fn lsn_of(bytes: &[u8]) -> Lsn {
    let mut b = [0u8; 10];
    b.copy_from_slice(&bytes[..10]);
    Lsn(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltalake::arrow::array::{Decimal128Array, Int32Array};

    fn conform_one(arrived: ArrayRef, bronze_type: DataType) -> StepResult<RecordBatch> {
        let batch = RecordBatch::try_new(Arc::new(Schema::new(vec![Field::new("amount", arrived.data_type().clone(), true)])), vec![arrived])
            .unwrap();
        conform(&batch, &Arc::new(Schema::new(vec![Field::new("amount", bronze_type, true)])), &[])
    }

    #[test]
    fn a_type_change_at_the_source_never_changes_a_value_silently() {
        // int widened to bigint at the source, bronze still int: a value past
        // i32::MAX must stop the step, not land as NULL.
        let e = conform_one(Arc::new(Int64Array::from(vec![Some(1), None, Some(3_000_000_000)])), DataType::Int32).unwrap_err();
        assert!(matches!(&e, StepError::NeedsPerson(m) if m.contains("'amount'") && m.contains("capture instance")), "{e}");
        // Values that still fit pass, NULLs included.
        let ok = conform_one(Arc::new(Int64Array::from(vec![Some(1), None, Some(-7)])), DataType::Int32).unwrap();
        assert_eq!(ok.column(0).as_any().downcast_ref::<Int32Array>().unwrap(), &Int32Array::from(vec![Some(1), None, Some(-7)]));
        // decimal(12,4) arriving at a decimal(10,2) bronze: 1.2345 would round to 1.23.
        let d = Decimal128Array::from(vec![Some(12_345i128)]).with_precision_and_scale(12, 4).unwrap();
        let e = conform_one(Arc::new(d), DataType::Decimal128(10, 2)).unwrap_err();
        assert!(matches!(&e, StepError::NeedsPerson(m) if m.contains("row 0")), "{e}");
        // The same type with a value that is exact at the smaller scale passes.
        let d = Decimal128Array::from(vec![Some(12_300i128)]).with_precision_and_scale(12, 4).unwrap();
        let ok = conform_one(Arc::new(d), DataType::Decimal128(10, 2)).unwrap();
        assert_eq!(ok.column(0).as_any().downcast_ref::<Decimal128Array>().unwrap().value(0), 123);
        // A narrower type arriving at a wider bronze column always fits.
        let ok = conform_one(Arc::new(Int32Array::from(vec![Some(i32::MIN), None])), DataType::Int64).unwrap();
        assert_eq!(ok.column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0), i32::MIN as i64);
    }
}
