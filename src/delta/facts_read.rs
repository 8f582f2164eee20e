//! Reading the facts table, at a cost that grows with what changed since the
//! last read rather than with the table.
//!
//! Every transition starts by reading its stream's facts rows (the state is
//! derived from them), and the facts table gains one small file per batch
//! and per event. A SQL scan of the table therefore costs more with every
//! batch the stream has committed: a coarse `stream` call that read the
//! state again before each of its 329 batches spent ten times as long
//! reading facts as reading the source (see docs/ARCHITECTURE.md).
//!
//! Delta data files never change once written; a commit only adds or
//! removes whole files. So this module keeps, per table, the rows of every
//! data file it has decoded, keyed by the file's path, and a read:
//! 1. lists the files of the loaded snapshot (from the log state the caller
//!    just refreshed, no I/O);
//! 2. forgets the files the snapshot no longer holds (a removal);
//! 3. decodes only the files it has not seen (typically the one or two the
//!    last commits added);
//! 4. returns the rows of the snapshot's files, in the snapshot's order.
//!
//! The result is exactly what a scan of that snapshot returns: the file set
//! is the snapshot's own, and the rows of a file are those of its Parquet.
//! Where a table uses something this reader does not apply (deletion
//! vectors, partition columns, column mapping), it falls back to the SQL
//! scan. `tests/facts_read.rs` checks the two agree, commit by commit, with
//! removals and several app ids.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use deltalake::arrow::array::{new_null_array, ArrayRef};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::DeltaTable;
use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::facts::{self, FactRow};
use crate::error::{StepError, StepResult};

/// The rows of each decoded data file, per table URL.
type FileRows = HashMap<String, Arc<Vec<FactRow>>>;

fn cache() -> &'static Mutex<HashMap<String, FileRows>> {
    static CACHE: OnceLock<Mutex<HashMap<String, FileRows>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The facts rows of `app_id` in the table's loaded snapshot (the caller
/// refreshes the table first when it wants the newest commits).
pub async fn rows_of(table: &DeltaTable, app_id: &str) -> StepResult<Vec<FactRow>> {
    let all = all_rows(table).await?;
    Ok(all.into_iter().filter(|r| r.app_id == app_id).collect())
}

/// Every facts row of the table's loaded snapshot.
pub async fn all_rows(table: &DeltaTable) -> StepResult<Vec<FactRow>> {
    let label = table.table_url().to_string();
    let Some(files) = plain_files(table)? else {
        let batches = super::query(table, "SELECT * FROM t").await?;
        return facts::from_batches(&batches);
    };
    let missing: Vec<String> = {
        let mut held = cache().lock().expect("facts cache lock");
        let entry = held.entry(label.clone()).or_default();
        let live: std::collections::HashSet<&str> = files.iter().map(String::as_str).collect();
        entry.retain(|path, _| live.contains(path.as_str()));
        files.iter().filter(|f| !entry.contains_key(*f)).cloned().collect()
    };
    let mut decoded = Vec::with_capacity(missing.len());
    let store = table.object_store();
    for path in missing {
        let location = deltalake::Path::parse(&path).map_err(|e| StepError::Internal(format!("facts file path {path} of {label}: {e}")))?;
        let bytes = store
            .get(&location)
            .await
            .map_err(|e| StepError::Temporary(format!("reading facts file {path} of {label}: {e}")))?
            .bytes()
            .await
            .map_err(|e| StepError::Temporary(format!("reading facts file {path} of {label}: {e}")))?;
        let rows = decode(bytes, &path, &label)?;
        decoded.push((path, Arc::new(rows)));
    }
    let gathered: Option<Vec<FactRow>> = {
        let mut held = cache().lock().expect("facts cache lock");
        let entry = held.entry(label.clone()).or_default();
        for (path, rows) in decoded {
            entry.insert(path, rows);
        }
        let mut out = Vec::new();
        let mut whole = true;
        for f in &files {
            match entry.get(f) {
                Some(rows) => out.extend(rows.iter().cloned()),
                None => {
                    whole = false;
                    break;
                }
            }
        }
        whole.then_some(out)
    };
    match gathered {
        Some(out) => Ok(out),
        // Another reader of the same table, on an older snapshot, forgot a
        // file of ours between our two locks: read the slow way.
        None => facts::from_batches(&super::query(table, "SELECT * FROM t").await?),
    }
}

/// The snapshot's data file paths, or `None` when a file or the table uses a
/// feature this reader does not apply (then the caller scans with SQL).
fn plain_files(table: &DeltaTable) -> StepResult<Option<Vec<String>>> {
    let label = table.table_url().to_string();
    let snapshot = table.snapshot().map_err(StepError::delta(&label))?;
    if !snapshot.metadata().partition_columns().is_empty() {
        return Ok(None);
    }
    if snapshot.metadata().configuration().keys().any(|k| k.starts_with("delta.columnMapping")) {
        return Ok(None);
    }
    let mut files = Vec::new();
    for f in snapshot.log_data() {
        if f.deletion_vector_descriptor().is_some() {
            return Ok(None);
        }
        files.push(f.object_store_path().to_string());
    }
    Ok(Some(files))
}

/// Decodes one facts data file, filling columns an older schema version did
/// not have with NULL and casting each column to the current type.
fn decode(bytes: bytes::Bytes, path: &str, label: &str) -> StepResult<Vec<FactRow>> {
    let bad = |e: &dyn std::fmt::Display| StepError::Internal(format!("facts file {path} of {label} does not decode: {e}"));
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).map_err(|e| bad(&e))?.build().map_err(|e| bad(&e))?;
    let want = facts::schema();
    let mut batches = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| bad(&e))?;
        let mut cols: Vec<ArrayRef> = Vec::with_capacity(want.fields().len());
        for field in want.fields() {
            let col = match batch.column_by_name(field.name()) {
                Some(c) if c.data_type() == field.data_type() => c.clone(),
                Some(c) => deltalake::arrow::compute::cast(c, field.data_type()).map_err(|e| bad(&e))?,
                None => new_null_array(field.data_type(), batch.num_rows()),
            };
            cols.push(col);
        }
        // Columns NOT NULL in the schema may be absent from no file (they
        // are the first version's); a NULL filled there would be a bug.
        batches.push(RecordBatch::try_new(want.clone(), cols).map_err(|e| bad(&e))?);
    }
    facts::from_batches(&batches)
}
