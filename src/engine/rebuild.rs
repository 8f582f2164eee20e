//! The rebuild rule, and the comparison of a rebuilt image with the source.
//!
//! The image of the table at the stream's position is: the rows of the newest
//! completed snapshot S (`_snapshot = S`, operation 0) and the change rows
//! after S (`_start_lsn > S`); per key, the row that is latest by
//! (`_start_lsn`, `_command_id`, `_seqval`, `_operation`); a key whose latest
//! row is a delete (1) or a before-image (3, the old key of an update that
//! SQL Server recorded as 3/4) is absent. Keys compare exactly, value for
//! value, as silver's MERGE matches them: every image CDC and a snapshot give
//! holds the key as stored, and an update that changes a key only in ways its
//! collation ignores (`abc` to `ABC` under `_CI`) is a before/after pair that
//! names both forms. Folding case here instead once merged two rows of a
//! `_CS` table whose keys differ only in case.
//!
//! The demo and the drills use it to check bronze against the source; it
//! holds one canonical text per key in memory (fine for the demo's million
//! rows; silver is the scalable form of the same rule).

use std::collections::HashMap;

use deltalake::arrow::array::{Array, Int32Array, StringArray};
use deltalake::DeltaTable;
use futures::StreamExt;
use serde::Serialize;

use crate::delta::{self, bronze, sql_str};
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;
use crate::source::{CdcSource, KeyRange, SnapshotRead, TableName};
use crate::types::{as_stored, value_at, ColumnDesc, SqlValue};

/// Rank of a bronze row among the rows of its key.
type Rank = (String, i64, String, i32);

/// The latest image per key: key text -> canonical row text.
pub type Image = HashMap<String, String>;

/// The key text of a row: equal keys (value for value, strings exactly as
/// stored) give equal text.
pub fn key_text(key: &[SqlValue]) -> String {
    key.iter()
        .map(|v| match v {
            SqlValue::Str(s) => format!("s:{s}"),
            other => other.canonical(),
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// The canonical text of a row as bronze stores it.
pub fn row_text(values: &[SqlValue]) -> String {
    values.iter().map(SqlValue::canonical).collect::<Vec<_>>().join("\u{1f}")
}

/// Rebuilds the image from bronze: snapshot `snapshot` (None: changes only) and the changes after it.
pub async fn rebuild(bronze_table: &DeltaTable, columns: &[ColumnDesc], keys: &[String], snapshot: Option<Lsn>) -> StepResult<Image> {
    if keys.is_empty() {
        return Err(StepError::Config("the rebuild needs key columns: the capture instance has no unique index; set snapshot.keys".into()));
    }
    let filter = match snapshot {
        Some(s) => format!(
            "({snap} = {s} AND {op} = 0) OR ({op} <> 0 AND {start} > {s})",
            snap = bronze::SNAPSHOT,
            op = bronze::OPERATION,
            start = bronze::START_LSN,
            s = sql_str(&s.to_hex())
        ),
        None => format!("{} <> 0", bronze::OPERATION),
    };
    let mut stream = delta::query_stream(bronze_table, &format!("SELECT * FROM t WHERE {filter}")).await?;
    let mut latest: HashMap<String, (Rank, Option<String>)> = HashMap::new();
    while let Some(batch) = stream.next().await {
        let batch = batch.map_err(|e| StepError::Temporary(format!("reading bronze: {e}")))?;
        let batch = delta::plain_types(&batch)?;
        let col = |name: &str| batch.column_by_name(name).cloned().ok_or_else(|| StepError::Internal(format!("bronze lacks {name}")));
        let start = col(bronze::START_LSN)?;
        let start = start.as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("_start_lsn".into()))?;
        let seq = col(bronze::SEQVAL)?;
        let seq = seq.as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("_seqval".into()))?;
        let op = col(bronze::OPERATION)?;
        let op = op.as_any().downcast_ref::<Int32Array>().ok_or_else(|| StepError::Internal("_operation".into()))?;
        let cmd = col(bronze::COMMAND_ID)?;
        let cmd = cmd.as_any().downcast_ref::<Int32Array>().ok_or_else(|| StepError::Internal("_command_id".into()))?;
        let data: Vec<_> = columns
            .iter()
            .map(|c| {
                batch
                    .schema()
                    .fields()
                    .iter()
                    .position(|f| f.name().eq_ignore_ascii_case(&c.name))
                    .map(|i| batch.column(i).clone())
            })
            .collect();
        let key_idx: Vec<usize> = keys
            .iter()
            .map(|k| columns.iter().position(|c| c.name.eq_ignore_ascii_case(k)).ok_or_else(|| StepError::Config(format!("key column {k} is not captured"))))
            .collect::<StepResult<_>>()?;
        for i in 0..batch.num_rows() {
            let values: Vec<SqlValue> = columns
                .iter()
                .zip(&data)
                .map(|(c, a)| match a {
                    Some(a) => value_at(a.as_ref(), i, &c.sql_type),
                    None => SqlValue::Null,
                })
                .collect();
            let key: Vec<SqlValue> = key_idx.iter().map(|&k| values[k].clone()).collect();
            let rank: Rank = (
                start.value(i).to_string(),
                if cmd.is_null(i) { -1 } else { cmd.value(i) as i64 },
                if seq.is_null(i) { String::new() } else { seq.value(i).to_string() },
                op.value(i),
            );
            let kt = key_text(&key);
            let operation = op.value(i);
            let image = if operation == 1 || operation == 3 { None } else { Some(row_text(&values)) };
            match latest.get(&kt) {
                Some((r, _)) if *r >= rank => {}
                _ => {
                    latest.insert(kt, (rank, image));
                }
            }
        }
    }
    Ok(latest.into_iter().filter_map(|(k, (_, img))| img.map(|i| (k, i))).collect())
}

/// How a rebuilt image differs from the source.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Comparison {
    pub rows_source: u64,
    pub rows_target: u64,
    pub missing_in_target: u64,
    pub extra_in_target: u64,
    pub different: u64,
    /// A few keys of each kind, for a person to look at.
    pub samples: Vec<String>,
}

impl Comparison {
    pub fn differences(&self) -> u64 {
        self.missing_in_target + self.extra_in_target + self.different
    }
}

/// Compares an image with the source table read now (read committed).
pub async fn compare_with_source(source: &dyn CdcSource, table: &TableName, columns: &[ColumnDesc], keys: &[String], image: &Image) -> StepResult<Comparison> {
    let read = SnapshotRead {
        table: table.clone(),
        columns: columns.to_vec(),
        keys: keys.to_vec(),
        range: KeyRange::all(),
        isolation: Default::default(),
        batch_rows: 8192,
    };
    let key_idx: Vec<usize> = keys.iter().filter_map(|k| columns.iter().position(|c| c.name.eq_ignore_ascii_case(k))).collect();
    let mut stream = source.snapshot_read(&read).await?;
    let mut cmp = Comparison { rows_target: image.len() as u64, ..Default::default() };
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::with_capacity(image.len());
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        for i in 0..batch.num_rows() {
            let values: Vec<SqlValue> = columns
                .iter()
                .enumerate()
                .map(|(c, col)| as_stored(&value_at(batch.column(c).as_ref(), i, &col.sql_type), &col.sql_type))
                .collect();
            cmp.rows_source += 1;
            let key: Vec<SqlValue> = key_idx.iter().map(|&k| values[k].clone()).collect();
            let kt = key_text(&key);
            match image.get(&kt) {
                None => {
                    cmp.missing_in_target += 1;
                    sample(&mut cmp.samples, format!("missing in target: {kt}"));
                }
                Some(t) if *t != row_text(&values) => {
                    cmp.different += 1;
                    sample(&mut cmp.samples, format!("different: {kt}: source {} / target {}", row_text(&values), t));
                }
                Some(_) => {}
            }
            seen.insert(kt);
        }
    }
    for k in image.keys() {
        if !seen.contains(k) {
            cmp.extra_in_target += 1;
            sample(&mut cmp.samples, format!("extra in target: {k}"));
        }
    }
    Ok(cmp)
}

fn sample(samples: &mut Vec<String>, s: String) {
    if samples.len() < 10 {
        samples.push(s);
    }
}
