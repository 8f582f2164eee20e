//! A table's definition as the simulator uses it ([`TableMeta`]: the spec
//! with its column ids and its key columns resolved) and a capture instance
//! as stored ([`InstanceRow`]), with the helpers that build, decode and save
//! them.

use std::path::Path;

use rusqlite::{params, Connection};

use crate::lsn::Lsn;
use crate::source::CaptureInstance;
use crate::types::{ColumnDesc, SqlValue};

use super::config::{Result, SimError, SqlCtx, TableSpec};
use super::keys;

/// A table's definition with the positions of its key columns resolved.
#[derive(Debug, Clone)]
pub(crate) struct TableMeta {
    pub id: i64,
    pub spec: TableSpec,
    /// Each column's id (SQL Server's `column_id`), aligned with
    /// `spec.columns`: assigned once and never reused, kept by a rename and
    /// a type change, so it names a column whatever it is called now.
    pub column_ids: Vec<i64>,
    /// Positions of the columns rows are ordered and found by (PK, else the unique index).
    pub key_cols: Vec<usize>,
    /// Positions of the unique index columns when it is separate from the PK.
    pub uk_cols: Vec<usize>,
    /// True when some capture instance covers the table.
    pub captured: bool,
}

impl TableMeta {
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.spec.columns.iter().position(|c| c.name.eq_ignore_ascii_case(name))
    }

    /// The position of the column with id `column_id`, while the table has it.
    pub fn column_index_by_id(&self, column_id: i64) -> Option<usize> {
        self.column_ids.iter().position(|&id| id == column_id)
    }

    /// The key columns' sort-key descriptions.
    pub fn key_types(&self) -> Vec<keys::KeyCol> {
        self.key_cols.iter().map(|&i| self.spec.key_col(i)).collect()
    }

    /// The identity columns the catalog reports (PK, else unique index).
    pub fn unique_key(&self) -> Vec<String> {
        self.key_cols.iter().map(|&i| self.spec.columns[i].name.clone()).collect()
    }

    pub fn is_heap(&self) -> bool {
        self.key_cols.is_empty()
    }

    /// The sort key of a row (for keyed tables).
    pub fn row_sort_key(&self, row: &[SqlValue]) -> Vec<u8> {
        let vals: Vec<SqlValue> = self.key_cols.iter().map(|&i| row[i].clone()).collect();
        keys::encode_key(&self.key_types(), &vals)
    }

    pub(super) fn row_unique_key(&self, row: &[SqlValue]) -> Option<Vec<u8>> {
        if self.uk_cols.is_empty() {
            return None;
        }
        let vals: Vec<SqlValue> = self.uk_cols.iter().map(|&i| row[i].clone()).collect();
        let types: Vec<keys::KeyCol> = self.uk_cols.iter().map(|&i| self.spec.key_col(i)).collect();
        Some(keys::encode_key(&types, &vals))
    }

    /// Decodes a stored row, padding columns added since it was written with NULL.
    pub fn decode_row(&self, data: &str) -> Result<Vec<SqlValue>> {
        let mut row: Vec<SqlValue> = serde_json::from_str(data).map_err(|e| SimError::Corrupt(format!("row of {}: {e}", self.spec.name)))?;
        row.resize(self.spec.columns.len(), SqlValue::Null);
        Ok(row)
    }
}

pub(super) fn resolve_cols(spec: &TableSpec, names: &[String]) -> Result<Vec<usize>> {
    names
        .iter()
        .map(|n| {
            spec.columns
                .iter()
                .position(|c| c.name.eq_ignore_ascii_case(n))
                .ok_or_else(|| SimError::NoSuchColumn { table: spec.name.to_string(), column: n.clone() })
        })
        .collect()
}

pub(crate) fn table_meta(id: i64, spec: TableSpec, column_ids: Vec<i64>, captured: bool) -> Result<TableMeta> {
    if column_ids.len() != spec.columns.len() {
        return Err(SimError::Corrupt(format!(
            "table {} has {} columns but {} column ids",
            spec.name,
            spec.columns.len(),
            column_ids.len()
        )));
    }
    let pk = resolve_cols(&spec, &spec.primary_key)?;
    let ui = resolve_cols(&spec, &spec.unique_index)?;
    let (key_cols, uk_cols) = if pk.is_empty() { (ui, vec![]) } else { (pk, ui) };
    Ok(TableMeta { id, spec, column_ids, key_cols, uk_cols, captured })
}

/// The column ids stored with a table (`src_tables.column_ids`, a JSON
/// array); a file written before ids were kept has NULL there, and its
/// columns get 1..n in column order, as a table created then would have.
fn parse_column_ids(text: Option<&str>, spec: &TableSpec) -> Result<Vec<i64>> {
    match text {
        None => Ok((1..=spec.columns.len() as i64).collect()),
        Some(t) => serde_json::from_str(t).map_err(|e| SimError::Corrupt(format!("column ids of {}: {e}", spec.name))),
    }
}

pub(super) fn load_table(id: i64, spec: &str, column_ids: Option<&str>, captured: bool) -> Result<TableMeta> {
    let spec: TableSpec = serde_json::from_str(spec).map_err(|e| SimError::Corrupt(format!("table spec: {e}")))?;
    let ids = parse_column_ids(column_ids, &spec)?;
    table_meta(id, spec, ids, captured)
}

/// Writes a table's definition and its column ids back.
pub(super) fn save_table(conn: &Connection, path: &Path, t: &TableMeta) -> Result<()> {
    conn.execute(
        "UPDATE src_tables SET spec = ?2, column_ids = ?3 WHERE id = ?1",
        params![t.id, serde_json::to_string(&t.spec).expect("spec serialises"), serde_json::to_string(&t.column_ids).expect("ids serialise")],
    )
    .ctx(path)?;
    Ok(())
}

/// For each captured column whose id the table still has under another
/// name (compared ignoring ASCII case): captured name -> name now. A column
/// whose id is gone was dropped, not renamed.
pub(super) fn renamed_columns(columns: &[ColumnDesc], column_ids: &[Option<i64>], t: &TableMeta) -> std::collections::BTreeMap<String, String> {
    columns
        .iter()
        .zip(column_ids)
        .filter_map(|(c, id)| {
            let now = &t.spec.columns[t.column_index_by_id((*id)?)?].name;
            (!now.eq_ignore_ascii_case(&c.name)).then(|| (c.name.clone(), now.clone()))
        })
        .collect()
}

/// An instance as stored.
#[derive(Debug, Clone)]
pub(crate) struct InstanceRow {
    pub id: i64,
    pub table_id: i64,
    /// Whether the instance's change table (`cdc.<ci>_CT`) has
    /// `__$command_id`: false for a table created before KB3030352.
    pub ct_command_id: bool,
    pub created_lsn: Lsn,
    /// The source column id of each captured column, aligned with
    /// `info.columns`: the capture job reads values by id, as SQL Server's
    /// does, so a renamed column is still captured under its captured name.
    /// None where an instance stored before ids were kept names a column
    /// the table no longer has.
    pub column_ids: Vec<Option<i64>>,
    pub info: CaptureInstance,
}
