//! Table upkeep: compaction of small files, VACUUM of removed files, and a
//! checkpoint, for the `maintain` step (`engine::maintain` decides which
//! table gets what).
//!
//! Why the compaction is ours and not delta-rs's `optimize()`: its commits
//! are built from default commit properties, so they carry no `txn`, and
//! delta-rs's conflict checker does not treat a winner's `dataChange=false`
//! removes as a conflict (they "only change the layout"). Two compactions
//! of one table planned on the same version would then both land, and
//! every compacted row would be held twice. The commit made here holds a
//! `txn` of [`COMPACTION_APP_ID`]: delta-rs refuses a commit whose txn app
//! id a concurrent winner also wrote, so of two compactions planned at once
//! exactly one lands and the other plans again on the new version.
//!
//! The same blind spot is why only append-only tables may be compacted: a
//! MERGE (silver) or a file undo (a seed's, on bronze) that read or removes
//! a file a compaction removed first is not refused, and would keep the
//! rows it meant to change in the compacted file. Appends are never in
//! conflict with a compaction in either order: an append reads no file, and
//! a compaction on the version before an append leaves the appended file
//! alone (it only removes the files it read).
//!
//! The compacted rows are read file by file (in the snapshot's order) with
//! Parquet's own reader and conformed to the table's current schema (a
//! column an older file lacks is NULL, as a scan of the table reads it), so
//! the table's rows are the same multiset after the commit as before.

use std::sync::Arc;

use deltalake::arrow::array::{new_null_array, ArrayRef};
use deltalake::arrow::datatypes::SchemaRef;
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::kernel::transaction::CommitBuilder;
use deltalake::kernel::{Action, Transaction};
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use deltalake::protocol::DeltaOperation;
use deltalake::writer::DeltaWriter;
use deltalake::DeltaTable;
use serde::Serialize;
use serde_json::{json, Value};

use super::{streaming_writer, txn_version, DATA_FILE_TARGET_BYTES};
use crate::error::{StepError, StepResult};

/// The txn app id of every compaction commit, on every table: one per
/// table, not per stream, because a facts table shared by many streams is
/// compacted as one table by whichever stream's `maintain` comes first.
pub const COMPACTION_APP_ID: &str = "mssql-cdc.maintain.compact";

/// A data file smaller than this is rewritten by a compaction; larger ones
/// are left as they are (a compaction's own output, which it would
/// otherwise rewrite on every run).
pub const SMALL_FILE_BYTES: i64 = 16 * 1024 * 1024;

/// How many times a compaction plans again after a concurrent commit
/// refused it before it gives up with "call again later".
const COMPACTION_ATTEMPTS: usize = 5;

/// What [`compact_small_files`] did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Compaction {
    /// Data files in the table before the compaction.
    pub files_before: usize,
    /// Small files rewritten (0: fewer than two, nothing to do).
    pub files_compacted: usize,
    /// Files written in their place.
    pub files_written: usize,
    /// Rows moved.
    pub rows: usize,
    /// The compaction's commit, when there was one.
    pub table_version: Option<i64>,
    /// Why the table was left alone, when it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// Rewrites the table's small files (under [`SMALL_FILE_BYTES`]) into as few
/// files as the writer's target size allows, in one commit that removes
/// them and adds the new ones, both with `dataChange=false` (the rows are
/// unchanged), and holds the next version of [`COMPACTION_APP_ID`]. Only for
/// append-only tables (see the module docs). Idempotent by content: a rerun
/// finds the compacted file and fewer than two small files, and does
/// nothing. `before_commit` runs between the files' write and the commit
/// (the step's failpoint; a race test holds two compactions there).
pub async fn compact_small_files<F>(table: &mut DeltaTable, mut before_commit: F) -> StepResult<Compaction>
where
    F: FnMut() -> StepResult<()>,
{
    let label = table.table_url().to_string();
    for attempt in 0..COMPACTION_ATTEMPTS {
        table.update_state().await.map_err(StepError::delta(&label))?;
        let snapshot = table.snapshot().map_err(StepError::delta(&label))?;
        let files_before = snapshot.log_data().iter().count();
        if !snapshot.metadata().partition_columns().is_empty() {
            return Ok(Compaction { files_before, skipped: Some("the table has partition columns".into()), ..Default::default() });
        }
        if snapshot.metadata().configuration().keys().any(|k| k.starts_with("delta.columnMapping")) {
            return Ok(Compaction { files_before, skipped: Some("the table uses column mapping".into()), ..Default::default() });
        }
        let small: Vec<_> = snapshot.log_data().iter().filter(|f| f.size() < SMALL_FILE_BYTES && f.deletion_vector_descriptor().is_none()).collect();
        if small.len() < 2 {
            return Ok(Compaction { files_before, ..Default::default() });
        }
        let version = txn_version(table, COMPACTION_APP_ID).await?.unwrap_or(0) + 1;
        let removes: Vec<Action> = small.iter().map(|f| Action::Remove(f.remove_action(false))).collect();
        let paths: Vec<deltalake::Path> = small.iter().map(|f| f.object_store_path()).collect();
        let files_compacted = small.len();
        drop(small);

        let mut writer = streaming_writer(table)?;
        let schema = writer.arrow_schema();
        let store = table.object_store();
        let mut rows = 0usize;
        for path in &paths {
            let bytes = store
                .get(path)
                .await
                .map_err(|e| StepError::Temporary(format!("reading {path} of {label} to compact it: {e}")))?
                .bytes()
                .await
                .map_err(|e| StepError::Temporary(format!("reading {path} of {label} to compact it: {e}")))?;
            let bad = |e: &dyn std::fmt::Display| StepError::Internal(format!("data file {path} of {label} does not decode: {e}"));
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).map_err(|e| bad(&e))?.build().map_err(|e| bad(&e))?;
            for batch in reader {
                let batch = conform(&batch.map_err(|e| bad(&e))?, &schema).map_err(|e| bad(&e))?;
                rows += batch.num_rows();
                if batch.num_rows() > 0 {
                    writer.write(batch).await.map_err(StepError::delta(&label))?;
                }
            }
        }
        let mut adds = writer.flush().await.map_err(StepError::delta(&label))?;
        let written: usize = adds.iter().map(|a| a.get_stats().ok().flatten().map(|s| s.num_records as usize).unwrap_or(0)).sum();
        if written != rows {
            return Err(StepError::Internal(format!("compacting {label}: read {rows} rows from {files_compacted} files but the writer's files hold {written}")));
        }
        for a in &mut adds {
            a.data_change = false;
        }
        let files_written = adds.len();
        let added_paths: Vec<String> = adds.iter().map(|a| a.path.clone()).collect();
        before_commit()?;

        let metadata = json!({"maintain": "compact", "files_compacted": files_compacted, "files_written": files_written, "rows": rows});
        let props = super::metadata_commit_properties(metadata).with_application_transaction(Transaction::new(COMPACTION_APP_ID, version));
        let mut actions: Vec<Action> = adds.into_iter().map(Action::Add).collect();
        actions.extend(removes);
        let operation = DeltaOperation::Optimize { predicate: None, target_size: DATA_FILE_TARGET_BYTES as i64 };
        let result = {
            let snapshot = table.snapshot().map_err(StepError::delta(&label))?;
            CommitBuilder::from(props).with_actions(actions).build(Some(snapshot), table.log_store(), operation).await
        };
        match result {
            Ok(done) => {
                let v = done.version() as i64;
                table.update_state().await.map_err(StepError::delta(&label))?;
                return Ok(Compaction { files_before, files_compacted, files_written, rows, table_version: Some(v), skipped: None });
            }
            Err(e) => {
                // Another compaction landed first (or a commit raced this
                // one): the files written here were never committed, so no
                // snapshot names them; delete them and plan again.
                tracing::warn!(table = %label, attempt, error = %e, "a compaction met a concurrent commit: planning again");
                for p in added_paths {
                    if let Ok(location) = deltalake::Path::parse(&p) {
                        let _ = store.delete(&location).await;
                    }
                }
            }
        }
    }
    Err(StepError::Temporary(format!("could not compact {label} against concurrent compactions: call again")))
}

/// The batch with the table's columns, in the table's order: a column the
/// file lacks (written before a migration added it) is NULL; one whose type
/// an older release wrote differently is cast, as a scan of the table casts it.
fn conform(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, deltalake::arrow::error::ArrowError> {
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(schema.fields().len());
    for field in schema.fields() {
        let found = batch.schema().fields().iter().position(|f| f.name().eq_ignore_ascii_case(field.name()));
        columns.push(match found {
            Some(i) if batch.column(i).data_type() == field.data_type() => batch.column(i).clone(),
            Some(i) => deltalake::arrow::compute::cast(batch.column(i), field.data_type())?,
            None => new_null_array(field.data_type(), batch.num_rows()),
        });
    }
    let options = deltalake::arrow::record_batch::RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(Arc::clone(schema), columns, &options)
}

/// What [`vacuum`] did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Vacuumed {
    pub files_deleted: usize,
}

/// Deletes the files of removes older than `retention` (VACUUM's lite mode:
/// only files the log names as removed, never an unreferenced file, so a
/// data file a step has written and not yet committed is never touched).
/// The log names a remove only until a checkpoint drops it, once it is older
/// than the table's `delta.deletedFileRetentionDuration`; `retention` must be
/// under that (the caller checks it) for the files to be found.
/// `now_ms` replaces the clock (a test's days passing); `None` is now.
pub async fn vacuum(table: &mut DeltaTable, retention: chrono::Duration, now_ms: Option<i64>) -> StepResult<Vacuumed> {
    use deltalake::operations::vacuum::{Clock, VacuumMode};
    #[derive(Debug)]
    struct At(i64);
    impl Clock for At {
        fn current_timestamp_millis(&self) -> i64 {
            self.0
        }
    }
    let label = table.table_url().to_string();
    table.update_state().await.map_err(StepError::delta(&label))?;
    let metadata = json!({"maintain": "vacuum", "retention_hours": retention.num_hours()});
    let props = super::metadata_commit_properties(metadata);
    // The retention is below the table's deletedFileRetentionDuration on
    // purpose (engine::maintain checks it is under it and at least a day),
    // so delta-rs's check that it is at least that property is turned off.
    let mut builder = table
        .clone()
        .vacuum()
        .with_mode(VacuumMode::Lite)
        .with_retention_period(retention)
        .with_enforce_retention_duration(false)
        .with_commit_properties(props);
    if let Some(ms) = now_ms {
        builder = builder.with_clock(Arc::new(At(ms)));
    }
    let (t, metrics) = builder.await.map_err(StepError::delta(&label))?;
    *table = t;
    Ok(Vacuumed { files_deleted: metrics.files_deleted.len() })
}

/// The table's `delta.deletedFileRetentionDuration` in hours (a week when
/// unset): how long its checkpoints keep a remove, so how long a lite
/// VACUUM can find the removed file.
pub fn deleted_file_retention_hours(table: &DeltaTable) -> StepResult<f64> {
    let snapshot = table.snapshot().map_err(StepError::delta(table.table_url().as_str()))?;
    use deltalake::table::config::TablePropertiesExt;
    Ok(snapshot.table_config().deleted_file_retention_duration().as_secs_f64() / 3600.0)
}

/// Writes a checkpoint at the table's newest version, so the next open
/// reads it and the commits after it instead of every commit since the
/// last automatic one (every 100 commits). Idempotent: a checkpoint of a
/// version that has one is left as it is.
pub async fn checkpoint(table: &mut DeltaTable) -> StepResult<i64> {
    let label = table.table_url().to_string();
    table.update_state().await.map_err(StepError::delta(&label))?;
    let version = table.version().unwrap_or(0) as i64;
    match deltalake::checkpoints::create_checkpoint(table, None).await {
        Ok(()) => Ok(version),
        Err(e) if e.to_string().to_lowercase().contains("already exists") => Ok(version),
        Err(e) => Err(StepError::delta(&label)(e)),
    }
}

/// The data files of the table's loaded snapshot and their total bytes.
pub fn file_count(table: &DeltaTable) -> StepResult<(usize, i64)> {
    let snapshot = table.snapshot().map_err(StepError::delta(table.table_url().as_str()))?;
    let files: Vec<i64> = snapshot.log_data().iter().map(|f| f.size()).collect();
    Ok((files.len(), files.iter().sum()))
}

/// The JSON of a table's upkeep.
pub fn summary(name: &str, location: &str, compaction: Option<&Compaction>, vacuumed: Option<&Vacuumed>, checkpoint_version: i64, files_after: usize) -> Value {
    json!({
        "table": name,
        "location": location,
        "compaction": compaction,
        "vacuum": vacuumed,
        "checkpoint_version": checkpoint_version,
        "files_after": files_after,
    })
}
