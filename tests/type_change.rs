//! A captured column whose type changes at the source, through the CLI
//! binary against the simulator. SQL Server carries a type change to the
//! change table, so change rows arrive in the new type while bronze keeps the
//! old one. A value the old type holds must reach bronze unchanged; a value
//! it cannot hold must stop the step (exit 3) before anything is written,
//! never land in bronze as NULL.
//!
//! Expected values come from the simulator's own rows; bronze's latest image
//! is ranked here from bronze's raw rows, not by the engine's rebuild.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use deltalake::arrow::array::{Array, StringArray};
use deltalake::arrow::datatypes::DataType;
use mssql_cdc::delta;
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};
use serde_json::Value;

struct Setup {
    dir: tempfile::TempDir,
    db: SimDb,
    table: TableName,
    wf_path: PathBuf,
}

fn row(id: i64, qty: i64) -> Vec<SqlValue> {
    vec![SqlValue::Int(id), SqlValue::Str(format!("item {id}")), SqlValue::Int(qty)]
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let db = SimDb::create(&dir.path().join("source.sqlite"), common::manual_config()).unwrap();
    let table = TableName::new("dbo", "items");
    db.create_table(&TableSpec { collations: Default::default(),
        name: table.clone(),
        columns: vec![
            ColumnDesc::new("id", SqlType::Int, false),
            ColumnDesc::new("name", SqlType::NVarChar { len: Some(40) }, true),
            ColumnDesc::new("qty", SqlType::Int, true),
        ],
        primary_key: vec!["id".into()],
        unique_index: vec![],
    })
    .unwrap();
    db.load_rows(&table, (1..=20).map(|i| row(i, i * 10))).unwrap();
    db.enable_cdc(&table, None, None).unwrap();
    db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&db);
    let wf_path = dir.path().join("items.toml");
    std::fs::write(
        &wf_path,
        "app_id = \"items\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"items\"\n\
         [target]\nbronze = \"bronze\"\nfacts = \"facts\"\n[snapshot]\nbootstrap = true\n[stream]\nmax_batch_rows = 1000\n",
    )
    .unwrap();
    Setup { dir, db, table, wf_path }
}

impl Setup {
    fn run(&self, args: &[&str]) -> (i32, Value, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
            .arg("--workflow")
            .arg(&self.wf_path)
            .args(args)
            .env("MSSQL_CDC_LOG", "warn")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last = stdout.lines().last().unwrap_or("null");
        let json = serde_json::from_str(last).unwrap_or_else(|e| panic!("{args:?}: the last line is not JSON ({e}): {last}"));
        (out.status.code().unwrap_or(-1), json, String::from_utf8_lossy(&out.stderr).into_owned())
    }

    fn write(&self, f: impl FnOnce(&mut mssql_cdc::sim::db::SimTx<'_>) -> mssql_cdc::sim::db::Result<()>) {
        self.db.transaction(f).unwrap();
        self.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        common::settle(&self.db);
    }

    /// The simulator's rows, every column as text, by id.
    fn source_rows(&self) -> BTreeMap<i64, Vec<Option<String>>> {
        self.db.rows(&self.table).unwrap().iter().map(|r| (r[0].as_i64().unwrap(), r.iter().map(text).collect())).collect()
    }

    /// Bronze's latest image per id, ranked here by (`_start_lsn`, `_seqval`,
    /// `_operation`); keys whose latest row is a delete are absent.
    async fn bronze_latest(&self) -> BTreeMap<i64, Vec<Option<String>>> {
        let location = self.dir.path().join("bronze");
        let t = delta::open_existing(location.to_str().unwrap(), &Default::default()).await.unwrap().unwrap();
        let batches = delta::query(&t, "SELECT id, name, qty, _start_lsn, _seqval, _operation FROM t").await.unwrap();
        let mut latest: BTreeMap<i64, ((String, String, i64), Vec<Option<String>>)> = BTreeMap::new();
        for b in batches {
            let col = |i: usize| -> Vec<Option<String>> {
                let a = deltalake::arrow::compute::cast(b.column(i), &DataType::Utf8).unwrap();
                let a = a.as_any().downcast_ref::<StringArray>().unwrap().clone();
                (0..a.len()).map(|r| if a.is_null(r) { None } else { Some(a.value(r).to_string()) }).collect()
            };
            let cols: Vec<_> = (0..6).map(col).collect();
            for r in 0..b.num_rows() {
                let id: i64 = cols[0][r].as_ref().unwrap().parse().unwrap();
                let rank = (cols[3][r].clone().unwrap(), cols[4][r].clone().unwrap_or_default(), cols[5][r].as_ref().unwrap().parse().unwrap());
                let image = vec![cols[0][r].clone(), cols[1][r].clone(), cols[2][r].clone()];
                if latest.get(&id).is_none_or(|(best, _)| rank > *best) {
                    latest.insert(id, (rank, image));
                }
            }
        }
        latest.into_iter().filter(|(_, ((_, _, op), _))| *op != 1 && *op != 3).map(|(id, (_, img))| (id, img)).collect()
    }
}

fn text(v: &SqlValue) -> Option<String> {
    match v {
        SqlValue::Null => None,
        SqlValue::Int(i) => Some(i.to_string()),
        SqlValue::Str(s) => Some(s.clone()),
        other => panic!("the test's table holds only int and nvarchar values, not {other:?}"),
    }
}

#[test]
fn a_column_widened_at_the_source_never_lands_in_bronze_as_null() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = setup();
    let table = s.table.clone();
    let (code, j, err) = s.run(&["stream"]);
    assert_eq!(code, 0, "{j} {err}");

    // ALTER TABLE items ALTER COLUMN qty bigint; the change table follows.
    s.db.alter_column_type(&table, "qty", SqlType::BigInt).unwrap();
    // A value an int still holds: streamed as it is.
    s.write(|tx| tx.update(&table, &vec![SqlValue::Int(2)], row(2, 5)));
    let (code, j, err) = s.run(&["stream"]);
    assert_eq!(code, 0, "a value that fits bronze's type: {j} {err}");
    assert_eq!(rt.block_on(s.bronze_latest()), s.source_rows(), "bronze's latest image after a value that fits");

    // A value past int's range: the step stops and names the column.
    let before = rt.block_on(s.bronze_latest());
    s.write(|tx| tx.update(&table, &vec![SqlValue::Int(3)], row(3, 3_000_000_000)));
    let (code, j, err) = s.run(&["stream"]);
    assert_eq!(code, 3, "a value bronze's type cannot hold needs a person: {j}\n{err}");
    assert!(j.to_string().contains("'qty'"), "the error names the column: {j}");
    // Nothing of that batch was written: bronze is as it was, and id 3 still
    // holds its old quantity rather than NULL.
    let after = rt.block_on(s.bronze_latest());
    assert_eq!(after, before, "bronze changed although the step stopped");
    assert_eq!(after[&3][2].as_deref(), Some("30"), "{:?}", after[&3]);
}
