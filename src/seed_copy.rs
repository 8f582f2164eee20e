//! The copy a `seed` loads: a Delta table or a folder of Parquet files someone
//! else wrote, read as a stream of Arrow batches and fitted to the capture
//! instance's columns.
//!
//! Fitting follows how SQL Server resolves names: a copy column matches a
//! captured column when their names are equal ignoring case. Copy columns that
//! match nothing are dropped (a copy often carries load dates or lineage);
//! each kept value is cast to bronze's type with a checked cast, so a value
//! that does not fit stops the seed instead of turning into a silent NULL.
//! The plan is made from the copy's schema alone, so every mismatch is found
//! before a row is written.
//!
//! [`export_parquet`] writes such a copy from a source table (the demo's
//! "existing copy", and the tests').

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use deltalake::arrow::array::{new_null_array, ArrayRef};
use deltalake::arrow::compute::{can_cast_types, cast_with_options, CastOptions};
use deltalake::arrow::datatypes::{Field, Schema, SchemaRef};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::datafusion::physical_plan::SendableRecordBatchStream;
use deltalake::datafusion::prelude::{ParquetReadOptions, SessionContext};
use futures::StreamExt;

use crate::delta;
use crate::error::{StepError, StepResult};
use crate::source::{CdcSource, Isolation, KeyRange, SnapshotRead, TableName};
use crate::types::ColumnDesc;

/// What kind of copy a path holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CopyKind {
    Delta,
    Parquet,
}

/// An opened copy: its kind and a stream of its rows (not yet read).
pub struct OpenedCopy {
    pub kind: CopyKind,
    pub stream: SendableRecordBatchStream,
}

/// Opens the copy at `location`: a Delta table (a folder with `_delta_log`, or
/// an object-store URI of one) or a local folder of `.parquet` files (or one
/// file). Nothing is read until the stream is polled.
pub async fn open(location: &str, storage: &HashMap<String, String>) -> StepResult<OpenedCopy> {
    let local = match location.strip_prefix("file://") {
        Some(rest) => Some(rest.to_string()),
        None if !location.contains("://") => Some(location.to_string()),
        None => None,
    };
    let Some(local) = local else {
        // Object stores: only Delta tables (a Parquet listing would need its own store registration).
        let table = delta::open_existing(location, storage).await?.ok_or_else(|| {
            StepError::Config(format!(
                "--copy {location} is not a Delta table (no _delta_log there): on an object store the copy must be a Delta table; \
                 copy a Parquet folder to a local path first"
            ))
        })?;
        return Ok(OpenedCopy { kind: CopyKind::Delta, stream: delta::query_stream(&table, "SELECT * FROM t").await? });
    };
    let path = Path::new(&local);
    if !path.exists() {
        return Err(StepError::Config(format!("--copy {location} does not exist: pass the folder of the copy (a Delta table or Parquet files)")));
    }
    if path.join("_delta_log").is_dir() {
        let table = delta::open_existing(&local, storage)
            .await?
            .ok_or_else(|| StepError::Config(format!("--copy {location} has a _delta_log folder but no Delta commit in it")))?;
        return Ok(OpenedCopy { kind: CopyKind::Delta, stream: delta::query_stream(&table, "SELECT * FROM t").await? });
    }
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut target = abs.to_string_lossy().into_owned();
    if path.is_dir() && !target.ends_with('/') {
        // A trailing slash makes DataFusion list the folder instead of reading one file.
        target.push('/');
    }
    let ctx = SessionContext::new();
    let df = ctx.read_parquet(target, ParquetReadOptions::default()).await.map_err(|e| {
        StepError::Config(format!(
            "--copy {location} is neither a Delta table nor readable Parquet ({e}): pass a Delta table or a folder of .parquet files"
        ))
    })?;
    let stream = df
        .execute_stream()
        .await
        .map_err(|e| StepError::Config(format!("cannot read the Parquet files of --copy {location}: {e}")))?;
    Ok(OpenedCopy { kind: CopyKind::Parquet, stream })
}

/// Where one bronze column's values come from.
#[derive(Debug, Clone, PartialEq)]
pub enum ColumnSource {
    /// The copy's column at this index (its name may differ in case).
    Copy(usize),
    /// Not in the copy: NULL (only with `--allow-missing-columns`).
    Null,
}

/// How the copy's columns become the captured columns, decided from schemas only.
#[derive(Debug, Clone)]
pub struct ColumnPlan {
    /// The captured columns with bronze's types, in the order they are built.
    pub target: SchemaRef,
    pub sources: Vec<ColumnSource>,
    /// Copy columns no captured column matches (dropped).
    pub dropped: Vec<String>,
    /// Captured columns the copy lacks (NULL).
    pub missing: Vec<String>,
}

/// Matches the copy's columns to the captured ones (`target`, bronze's
/// types). Errors name every problem at once: a missing column (unless
/// `allow_missing`), two copy columns that differ only in case, a type that
/// cannot be cast.
pub fn plan_columns(copy: &Schema, target: &[Field], allow_missing: bool) -> StepResult<ColumnPlan> {
    let mut sources = Vec::with_capacity(target.len());
    let mut missing = Vec::new();
    let mut problems = Vec::new();
    let mut used = vec![false; copy.fields().len()];
    for f in target {
        let matches: Vec<usize> =
            copy.fields().iter().enumerate().filter(|(_, c)| c.name().eq_ignore_ascii_case(f.name())).map(|(i, _)| i).collect();
        match matches.as_slice() {
            [] => {
                missing.push(f.name().clone());
                sources.push(ColumnSource::Null);
            }
            [i] => {
                used[*i] = true;
                let from = copy.field(*i).data_type();
                if from != f.data_type() && !can_cast_types(from, f.data_type()) {
                    problems.push(format!(
                        "column {} is {from} in the copy, which does not convert to the stream's {}",
                        copy.field(*i).name(),
                        f.data_type()
                    ));
                }
                sources.push(ColumnSource::Copy(*i));
            }
            many => {
                let names: Vec<&str> = many.iter().map(|i| copy.field(*i).name().as_str()).collect();
                problems.push(format!(
                    "the copy has {} columns named {} ignoring case ({}); SQL Server names are case-insensitive, so keep one",
                    many.len(),
                    f.name(),
                    names.join(", ")
                ));
                sources.push(ColumnSource::Null);
            }
        }
    }
    if !missing.is_empty() && !allow_missing {
        problems.push(format!(
            "the copy lacks the captured column(s) {}: add them to the copy, or pass --allow-missing-columns to load them as NULL \
             (as a snapshot reads a column dropped from the table)",
            missing.join(", ")
        ));
    }
    if !problems.is_empty() {
        return Err(StepError::Config(format!("the copy does not fit the capture instance: {}", problems.join("; "))));
    }
    let dropped = copy.fields().iter().zip(&used).filter(|(_, u)| !**u).map(|(f, _)| f.name().clone()).collect();
    Ok(ColumnPlan { target: Arc::new(Schema::new(target.to_vec())), sources, dropped, missing })
}

impl ColumnPlan {
    /// One copy batch as a batch of the captured columns. A value that does
    /// not fit its column's type is an error (checked cast), never a NULL.
    pub fn apply(&self, batch: &RecordBatch) -> StepResult<RecordBatch> {
        let checked = CastOptions { safe: false, ..Default::default() };
        let n = batch.num_rows();
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.sources.len());
        for (f, source) in self.target.fields().iter().zip(&self.sources) {
            columns.push(match source {
                ColumnSource::Null => new_null_array(f.data_type(), n),
                ColumnSource::Copy(i) => {
                    let a = batch.column(*i);
                    if a.data_type() == f.data_type() {
                        a.clone()
                    } else {
                        cast_with_options(a, f.data_type(), &checked).map_err(|e| {
                            StepError::Config(format!(
                                "a value of the copy's column {} does not fit the stream's type {}: {e}. Fix the copy (nothing was committed)",
                                batch.schema().field(*i).name(),
                                f.data_type()
                            ))
                        })?
                    }
                }
            });
        }
        RecordBatch::try_new(self.target.clone(), columns).map_err(|e| StepError::Internal(format!("fitting a copy batch: {e}")))
    }
}

/// Writes the rows of `table` (as one read-committed statement sees them) to
/// `dir` as Parquet files of at most `rows_per_file` rows. Returns the row
/// count. This is a copy "taken by another tool": the seed knows nothing of it
/// but the files and the time the copy started.
pub async fn export_parquet(source: &dyn CdcSource, table: &TableName, columns: &[ColumnDesc], dir: &Path, rows_per_file: usize) -> StepResult<u64> {
    use deltalake::parquet::arrow::ArrowWriter;
    std::fs::create_dir_all(dir).map_err(|e| StepError::Config(format!("cannot create {}: {e}", dir.display())))?;
    let read = SnapshotRead {
        table: table.clone(),
        columns: columns.to_vec(),
        keys: vec![],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 8_192,
    };
    let schema = crate::types::arrow_schema(columns);
    let mut stream = source.snapshot_read(&read).await?;
    let io = |e: &dyn std::fmt::Display| StepError::Internal(format!("writing the Parquet copy in {}: {e}", dir.display()));
    let mut rows: u64 = 0;
    let mut file_no = 0usize;
    let mut writer: Option<(ArrowWriter<std::fs::File>, usize)> = None;
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        if writer.as_ref().is_some_and(|(_, n)| *n >= rows_per_file.max(1)) {
            let (w, _) = writer.take().expect("checked");
            w.close().map_err(|e| io(&e))?;
        }
        if writer.is_none() {
            let file = std::fs::File::create(dir.join(format!("part-{file_no:05}.parquet"))).map_err(|e| io(&e))?;
            file_no += 1;
            writer = Some((ArrowWriter::try_new(file, schema.clone(), None).map_err(|e| io(&e))?, 0));
        }
        let (w, n) = writer.as_mut().expect("just opened");
        w.write(&batch).map_err(|e| io(&e))?;
        *n += batch.num_rows();
        rows += batch.num_rows() as u64;
    }
    // An empty table is still a copy: one file with the columns and no
    // rows, as an export tool writes it, so the seed can read its schema
    // (a folder without files says nothing of the columns, and the seed
    // refuses it).
    if writer.is_none() && file_no == 0 {
        let file = std::fs::File::create(dir.join("part-00000.parquet")).map_err(|e| io(&e))?;
        writer = Some((ArrowWriter::try_new(file, schema.clone(), None).map_err(|e| io(&e))?, 0));
    }
    if let Some((w, _)) = writer {
        w.close().map_err(|e| io(&e))?;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltalake::arrow::array::{Array, Int32Array, Int64Array, StringArray};
    use deltalake::arrow::datatypes::DataType;

    fn target() -> Vec<Field> {
        vec![Field::new("id", DataType::Int32, true), Field::new("name", DataType::Utf8, true), Field::new("qty", DataType::Int32, true)]
    }

    #[test]
    fn matches_ignoring_case_drops_extras_and_casts() {
        let copy = Schema::new(vec![
            Field::new("NAME", DataType::Utf8, true),
            Field::new("Id", DataType::Int64, true),
            Field::new("loaded_at", DataType::Utf8, true),
            Field::new("QTY", DataType::Int64, true),
        ]);
        let plan = plan_columns(&copy, &target(), false).unwrap();
        assert_eq!(plan.sources, vec![ColumnSource::Copy(1), ColumnSource::Copy(0), ColumnSource::Copy(3)]);
        assert_eq!(plan.dropped, vec!["loaded_at".to_string()]);
        let batch = RecordBatch::try_new(
            Arc::new(copy),
            vec![
                Arc::new(StringArray::from(vec!["a", "b"])),
                Arc::new(Int64Array::from(vec![1, 2])),
                Arc::new(StringArray::from(vec!["x", "y"])),
                Arc::new(Int64Array::from(vec![Some(5), None])),
            ],
        )
        .unwrap();
        let out = plan.apply(&batch).unwrap();
        assert_eq!(out.schema().field(0).name(), "id");
        let ids = out.column(0).as_any().downcast_ref::<Int32Array>().unwrap();
        assert_eq!(ids.values().to_vec(), vec![1, 2]);
        assert!(out.column(2).is_null(1));
    }

    #[test]
    fn a_value_that_does_not_fit_is_an_error_not_a_null() {
        let copy = Schema::new(vec![Field::new("id", DataType::Int64, true), Field::new("name", DataType::Utf8, true), Field::new("qty", DataType::Utf8, true)]);
        let plan = plan_columns(&copy, &target(), false).unwrap();
        let batch = RecordBatch::try_new(
            Arc::new(copy),
            vec![
                Arc::new(Int64Array::from(vec![i64::from(i32::MAX) + 1])),
                Arc::new(StringArray::from(vec!["a"])),
                Arc::new(StringArray::from(vec!["12"])),
            ],
        )
        .unwrap();
        let e = plan.apply(&batch).unwrap_err();
        assert!(matches!(e, StepError::Config(_)) && e.to_string().contains("id"), "{e}");
    }

    #[test]
    fn missing_columns_are_refused_unless_allowed() {
        let copy = Schema::new(vec![Field::new("ID", DataType::Int32, true)]);
        let e = plan_columns(&copy, &target(), false).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("name, qty") && msg.contains("--allow-missing-columns"), "{msg}");
        let plan = plan_columns(&copy, &target(), true).unwrap();
        assert_eq!(plan.missing, vec!["name".to_string(), "qty".to_string()]);
        assert_eq!(plan.sources[1], ColumnSource::Null);
    }

    #[test]
    fn two_columns_equal_ignoring_case_and_impossible_casts_are_refused() {
        let copy = Schema::new(vec![
            Field::new("id", DataType::Int32, true),
            Field::new("ID", DataType::Int32, true),
            Field::new("name", DataType::Utf8, true),
            Field::new("qty", DataType::Struct(vec![Field::new("a", DataType::Int32, true)].into()), true),
        ]);
        let msg = plan_columns(&copy, &target(), false).unwrap_err().to_string();
        assert!(msg.contains("id, ID") && msg.contains("qty"), "{msg}");
    }
}
