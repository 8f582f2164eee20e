//! Silver: the current state of the source table, one row per key.
//!
//! Each row is the latest image of its key in bronze (captured columns) plus
//! the rank of the bronze row it came from, so a later MERGE can tell an
//! older image from a newer one: (`_start_lsn`, `_command_id`, `_seqval`,
//! `_operation`), the order bronze's rebuild rule uses. `_commit_ts` is kept
//! for readers who want to know how fresh a row is.

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

/// Names of silver's own columns.
pub const META_COLUMNS: &[&str] = &[START_LSN, COMMAND_ID, SEQVAL, OPERATION, COMMIT_TS];

/// Silver's schema for these captured columns.
pub fn schema(columns: &[ColumnDesc]) -> SchemaRef {
    let mut fields: Vec<Field> = columns.iter().map(|c| c.arrow_field()).collect();
    fields.extend(meta_fields());
    Arc::new(Schema::new(fields))
}

/// The comment of a silver column.
pub fn column_comment(name: &str) -> String {
    match name {
        START_LSN => "Commit LSN of the bronze row this image comes from (hex); a snapshot row's stamp.".into(),
        COMMAND_ID => "__$command_id of that bronze row (NULL for snapshot rows): part of the image's rank.".into(),
        SEQVAL => "__$seqval of that bronze row (NULL for snapshot rows): part of the image's rank.".into(),
        OPERATION => "Operation of that bronze row: 0 snapshot, 2 insert, 4 update after-image.".into(),
        COMMIT_TS => "Commit time of _start_lsn (UTC).".into(),
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
