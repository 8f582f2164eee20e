//! Silver: the current state of the source table, one row per key.
//!
//! Each row is the latest image of its key in bronze (captured columns) plus
//! the rank of the bronze row it came from, so a later MERGE can tell an
//! older image from a newer one: (`_start_lsn`, `_command_id`, `_seqval`,
//! `_operation`), the order bronze's rebuild rule uses. `_commit_ts` is kept
//! for readers who want to know how fresh a row is.
//!
//! A heap (a capture instance without a unique index) has no key, and may
//! hold identical rows: its silver is a multiset, one row per distinct row
//! with `_count`, how many source rows hold exactly those values
//! ([`heap_schema`]; see `engine::apply`). No single image ranks such a row:
//! `_start_lsn` and `_commit_ts` are the newest image counted into it, the
//! other rank columns are NULL.

use std::sync::Arc;

use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};

use super::bronze::{COMMAND_ID, COMMIT_TS, OPERATION, SEQVAL, START_LSN};
use super::Migration;
use crate::types::ColumnDesc;

/// Silver's schema history.
pub static MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "silver: captured columns plus the rank of the image (_start_lsn, _command_id, _seqval, _operation) and _commit_ts",
    adds_columns: &[],
}];

/// The rank and freshness columns silver ends with (bronze's names and types).
pub fn meta_fields() -> Vec<Field> {
    vec![
        Field::new(START_LSN, DataType::Utf8, true),
        Field::new(COMMAND_ID, DataType::Int32, true),
        Field::new(SEQVAL, DataType::Utf8, true),
        Field::new(OPERATION, DataType::Int32, true),
        Field::new(COMMIT_TS, DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
    ]
}

/// A heap's silver: how many source rows hold the row's values (always above 0).
pub const COUNT: &str = "_count";

/// Names of silver's own columns.
pub const META_COLUMNS: &[&str] = &[START_LSN, COMMAND_ID, SEQVAL, OPERATION, COMMIT_TS];

/// Silver's schema for these captured columns.
pub fn schema(columns: &[ColumnDesc]) -> SchemaRef {
    let mut fields: Vec<Field> = columns.iter().map(|c| c.arrow_field()).collect();
    fields.extend(meta_fields());
    Arc::new(Schema::new(fields))
}

/// The schema of a heap's silver: [`schema`] and [`COUNT`].
pub fn heap_schema(columns: &[ColumnDesc]) -> SchemaRef {
    let mut fields: Vec<Field> = schema(columns).fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(COUNT, DataType::Int64, true));
    Arc::new(Schema::new(fields))
}

/// Whether a silver table's columns are a heap's (it has [`COUNT`]).
pub fn is_heap_schema(schema: &Schema) -> bool {
    schema.field_with_name(COUNT).is_ok()
}

/// The comment of a silver column.
pub fn column_comment(name: &str) -> String {
    match name {
        START_LSN => "Commit LSN of the bronze row this image comes from (hex); a snapshot row's stamp.".into(),
        COMMAND_ID => "__$command_id of that bronze row (NULL for snapshot rows, and in a heap's silver): part of the image's rank.".into(),
        SEQVAL => "__$seqval of that bronze row (NULL for snapshot rows, and in a heap's silver): part of the image's rank.".into(),
        OPERATION => "Operation of that bronze row: 0 snapshot, 2 insert, 4 update after-image (NULL in a heap's silver).".into(),
        COMMIT_TS => "Commit time of _start_lsn (UTC).".into(),
        COUNT => "A heap's silver only: how many rows of the source table hold exactly these values.".into(),
        other => format!("Source column {other}: its latest value."),
    }
}

/// Where silver's control table lives: a sibling named after silver.
pub fn control_location_for(silver: &str) -> String {
    format!("{}_control", silver.trim_end_matches('/'))
}

/// Where the reconcile report lives when the workflow does not name it.
pub fn reconcile_location_for(silver: &str) -> String {
    format!("{}_reconcile", silver.trim_end_matches('/'))
}
