//! The reference side of the CLI tests: the simulator's own rows and the
//! Delta tables' rows, as multisets of whole-row texts (every column), and a
//! runner for the binary. New tests compare through these; older files still
//! carry their own copies (to be moved here).

use std::collections::BTreeMap;
use std::path::Path;

use deltalake::arrow::array::Array;
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::arrow::util::display::array_value_to_string;
use futures::StreamExt;
use mssql_cdc::delta;
use mssql_cdc::sim::SimDb;
use mssql_cdc::source::{CdcSource, Isolation, KeyRange, SnapshotRead, TableName};
use mssql_cdc::types::ColumnDesc;

/// Row text -> how many times it occurs.
pub type Multiset = BTreeMap<String, usize>;

/// Runs `mssql-cdc --workflow F <args>`: (exit code, last stdout line as JSON, stderr).
pub fn run_cli(wf_path: &Path, args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .arg("--workflow")
        .arg(wf_path)
        .args(args)
        .env("MSSQL_CDC_LOG", "warn")
        .output()
        .unwrap();
    let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("null").to_string();
    let json: serde_json::Value = serde_json::from_str(&last).unwrap_or_default();
    (out.status.code(), json, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Runs a step that must exit 0; returns its JSON.
pub fn ok(wf_path: &Path, args: &[&str]) -> serde_json::Value {
    let (code, json, err) = run_cli(wf_path, args);
    assert_eq!(code, Some(0), "{args:?}: {json}\n{err}");
    json
}

/// A row's values as text (the columns named, in order), NULL as a marker no value prints as.
pub fn row_texts(batch: &RecordBatch, columns: &[ColumnDesc]) -> Vec<String> {
    let arrays: Vec<_> = columns
        .iter()
        .map(|c| {
            let i = batch.schema().index_of(&c.name).unwrap_or_else(|_| panic!("column {} missing from {:?}", c.name, batch.schema()));
            batch.column(i).clone()
        })
        .collect();
    (0..batch.num_rows())
        .map(|r| {
            arrays
                .iter()
                .map(|a| if a.is_null(r) { "\u{2400}NULL".to_string() } else { array_value_to_string(a.as_ref(), r).unwrap() })
                .collect::<Vec<_>>()
                .join(" | ")
        })
        .collect()
}

/// The simulator's rows, read through its own snapshot reader (a SELECT of the whole table).
pub async fn source_rows(db: &SimDb, table: &TableName, columns: &[ColumnDesc]) -> Multiset {
    let src = db.source().unwrap();
    let read = SnapshotRead {
        table: table.clone(),
        columns: columns.to_vec(),
        keys: vec![],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 1000,
    };
    let mut stream = src.snapshot_read(&read).await.unwrap();
    let mut out = Multiset::new();
    while let Some(b) = stream.next().await {
        for t in row_texts(&b.unwrap(), columns) {
            *out.entry(t).or_default() += 1;
        }
    }
    assert_eq!(out.values().sum::<usize>() as u64, db.row_count(table).unwrap(), "the reader returns every row");
    out
}

/// The rows of a Delta table that `filter` keeps (a SQL condition over `t`), as a multiset of the columns named.
pub async fn delta_rows(location: &str, columns: &[ColumnDesc], filter: &str) -> Multiset {
    let t = delta::open_existing(location, &Default::default()).await.unwrap().expect("the Delta table exists");
    let mut out = Multiset::new();
    for b in delta::query(&t, &format!("SELECT * FROM t WHERE {filter}")).await.unwrap() {
        for t in row_texts(&b, columns) {
            *out.entry(t).or_default() += 1;
        }
    }
    out
}
