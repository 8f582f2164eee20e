//! Silver keyed on a nullable column, end to end through the CLI binary.
//!
//! A table whose unique index allows one NULL (SQL Server's rule), captured
//! with that index as its row identity (`@index_name`): the row whose key is NULL is updated
//! again and again, deleted, and inserted again, with `stream` and `apply`
//! run between the changes. After every apply, silver must hold exactly the
//! simulator's rows: every column of every row, compared as a multiset (a
//! MERGE that joins keys with `=` inserts the NULL-key row again on each
//! change and never deletes it, which a comparison by key would hide). Then
//! `reconcile` must be clean (exit 0); and with a second copy of the NULL-key
//! row planted in silver, it must see the difference (exit 3).

mod common;

use std::path::{Path, PathBuf};

use deltalake::arrow::record_batch::RecordBatch;
use mssql_cdc::delta;
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

/// The captured columns, in order; `key` is the nullable unique column silver is keyed on.
fn columns(key_type: &SqlType) -> Vec<ColumnDesc> {
    vec![
        ColumnDesc::new("id", SqlType::Int, false),
        ColumnDesc::new("key", key_type.clone(), true),
        ColumnDesc::new("qty", SqlType::Int, true),
        ColumnDesc::new("note", SqlType::NVarChar { len: Some(40) }, true),
    ]
}

/// A key value: NULL, or n as the key column's type.
fn key_value(key_type: &SqlType, n: Option<i64>) -> SqlValue {
    match (n, key_type) {
        (None, _) => SqlValue::Null,
        (Some(n), SqlType::Int) => SqlValue::Int(n),
        (Some(n), _) => SqlValue::Str(format!("k{n:03}")),
    }
}

fn row(key_type: &SqlType, id: i64, key: Option<i64>, qty: i64, note: Option<&str>) -> Vec<SqlValue> {
    vec![
        SqlValue::Int(id),
        key_value(key_type, key),
        SqlValue::Int(qty),
        note.map(|n| SqlValue::Str(n.to_string())).unwrap_or(SqlValue::Null),
    ]
}

struct Case {
    _dir: tempfile::TempDir,
    db: SimDb,
    table: TableName,
    key_type: SqlType,
    wf_path: PathBuf,
    silver: String,
}

impl Case {
    /// A table with a primary key `id` and a unique index on the nullable
    /// `key` (one NULL allowed), 20 rows of which id 1 has the NULL key,
    /// CDC enabled on that unique index (`@index_name`), so silver is keyed
    /// on `key`; the workflow also cuts snapshot ranges on it.
    fn new(key_type: SqlType) -> Case {
        let dir = tempfile::tempdir().unwrap();
        let db = SimDb::create(&dir.path().join("source.sqlite"), common::manual_config()).unwrap();
        let table = TableName::new("dbo", "accounts");
        db.create_table(&TableSpec { collations: Default::default(),
            name: table.clone(),
            columns: columns(&key_type),
            primary_key: vec!["id".into()],
            unique_index: vec!["key".into()],
        })
        .unwrap();
        let rows: Vec<Vec<SqlValue>> =
            (1..=20).map(|id| row(&key_type, id, if id == 1 { None } else { Some(id) }, id * 10, if id % 3 == 0 { None } else { Some("start") })).collect();
        db.load_rows(&table, rows.into_iter()).unwrap();
        // @index_name: the capture instance's row identity is the nullable
        // unique index, so silver is keyed on `key`, not on the primary key.
        db.enable_cdc_on_index(&table, None, None, Some(&["key".to_string()])).unwrap();
        db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
        common::settle(&db);
        let wf_path = dir.path().join("accounts.toml");
        std::fs::write(
            &wf_path,
            "app_id = \"accounts\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"accounts\"\n\
             [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
             [snapshot]\nbootstrap = true\nkeys = [\"key\"]\n[reconcile]\nbuckets = 4\nsample_fraction = 0.0\n",
        )
        .unwrap();
        let silver = dir.path().join("silver").to_string_lossy().into_owned();
        Case { _dir: dir, db, table, key_type, wf_path, silver }
    }

    /// Runs a step through the binary: (exit code, last stdout line as JSON).
    fn run(&self, step: &str) -> (Option<i32>, serde_json::Value) {
        run_cli(&self.wf_path, step)
    }

    fn write(&self, f: impl FnOnce(&mut mssql_cdc::sim::SimTx<'_>, &TableName, &SqlType) -> mssql_cdc::sim::db::Result<()>) {
        let (table, ty) = (self.table.clone(), self.key_type.clone());
        self.db.transaction(|tx| f(tx, &table, &ty)).unwrap();
        self.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        common::settle(&self.db);
    }

    /// Streams and applies; both must exit 0.
    fn stream_and_apply(&self) -> serde_json::Value {
        let (code, r) = self.run("stream");
        assert_eq!(code, Some(0), "stream: {r}");
        let (code, r) = self.run("apply");
        assert_eq!(code, Some(0), "apply: {r}");
        r
    }

    /// Silver must hold the simulator's rows: every column, every row, as a multiset.
    async fn assert_silver_is_the_table(&self, when: &str) {
        let source = common::model::source_rows(&self.db, &self.table, &columns(&self.key_type)).await;
        let silver = silver_rows(&self.silver, &columns(&self.key_type)).await;
        assert_eq!(silver, source, "{when}: silver (left) differs from the simulator's table (right)");
    }
}

fn run_cli(wf_path: &Path, step: &str) -> (Option<i32>, serde_json::Value) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .arg("--workflow")
        .arg(wf_path)
        .arg(step)
        .env("MSSQL_CDC_LOG", "warn")
        .output()
        .unwrap();
    let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("null").to_string();
    let json: serde_json::Value = serde_json::from_str(&last).unwrap_or_default();
    if out.status.code() != Some(0) {
        eprintln!("{step}: exit {:?}\n{}", out.status.code(), String::from_utf8_lossy(&out.stderr));
    }
    (out.status.code(), json)
}

/// Silver's rows (captured columns only), read with a plain query.
async fn silver_rows(location: &str, columns: &[ColumnDesc]) -> common::model::Multiset {
    common::model::delta_rows(location, columns, "true").await
}

/// The NULL-key row updated several times (apply after each), deleted, and
/// inserted again, beside changes to other rows.
async fn null_key_lifecycle(key_type: SqlType) {
    let case = Case::new(key_type);
    let r = case.stream_and_apply();
    assert_eq!(r["action"], "rebuild", "{r}");
    case.assert_silver_is_the_table("after the bootstrap's rebuild").await;

    // Updates of the NULL-key row (found by its primary key), one apply each.
    for v in 1..=3 {
        case.write(|tx, t, ty| {
            tx.update(t, &vec![SqlValue::Int(1)], row(ty, 1, None, 100 + v, Some(&format!("null key v{v}"))))?;
            tx.update(t, &vec![SqlValue::Int(5)], row(ty, 5, Some(5), 500 + v, None))
        });
        let r = case.stream_and_apply();
        assert_eq!(r["action"], "changes", "{r}");
        case.assert_silver_is_the_table(&format!("after update {v} of the NULL-key row")).await;
    }
    // Two updates of it in one transaction and an insert beside them.
    case.write(|tx, t, ty| {
        tx.update(t, &vec![SqlValue::Int(1)], row(ty, 1, None, 200, None))?;
        tx.update(t, &vec![SqlValue::Int(1)], row(ty, 1, None, 201, Some("twice")))?;
        tx.insert(t, row(ty, 21, Some(21), 210, Some("new")))
    });
    case.stream_and_apply();
    case.assert_silver_is_the_table("after two updates in one transaction").await;

    // The delete: silver must lose the NULL-key row.
    case.write(|tx, t, _| tx.delete(t, &vec![SqlValue::Int(1)]));
    case.stream_and_apply();
    case.assert_silver_is_the_table("after the NULL-key row's delete").await;

    // Inserted again (another id, the same NULL key), then updated twice.
    case.write(|tx, t, ty| tx.insert(t, row(ty, 30, None, 300, Some("back"))));
    case.stream_and_apply();
    case.assert_silver_is_the_table("after the NULL key's re-insert").await;
    for v in 1..=2 {
        case.write(|tx, t, ty| tx.update(t, &vec![SqlValue::Int(30)], row(ty, 30, None, 300 + v, Some("back again"))));
        case.stream_and_apply();
        case.assert_silver_is_the_table(&format!("after update {v} of the re-inserted NULL-key row")).await;
    }
    // A key moved to NULL and back: the NULL row leaves, key 7 takes NULL, then a value again.
    case.write(|tx, t, ty| {
        tx.delete(t, &vec![SqlValue::Int(30)])?;
        tx.update(t, &vec![SqlValue::Int(7)], row(ty, 7, None, 77, Some("now null")))
    });
    case.stream_and_apply();
    case.assert_silver_is_the_table("after a key set to NULL").await;
    case.write(|tx, t, ty| tx.update(t, &vec![SqlValue::Int(7)], row(ty, 7, Some(70), 78, Some("valued again"))));
    case.stream_and_apply();
    case.assert_silver_is_the_table("after a NULL key set to a value").await;
    case.write(|tx, t, ty| tx.insert(t, row(ty, 31, None, 310, None)));
    case.stream_and_apply();
    case.assert_silver_is_the_table("after a last NULL-key insert").await;

    let (code, r) = case.run("reconcile");
    assert_eq!(code, Some(0), "reconcile must be clean: {r}");
    assert_eq!(r["clean"], true, "{r}");
    assert_eq!(r["differences"], 0, "{r}");
    // The torture tester's reference checks (issue 17): silver against the
    // table on every column, bronze's change rows against the simulator's
    // change function from S on every column, the facts' batch ranges tiling
    // from S. Before the planted duplicate below, which silver must fail.
    common::assert_targets_match_source(&case.db, &case.table, &case.wf_path).await;

    // A second copy of the NULL-key row in silver (what the `=` join left
    // behind) is a difference reconcile must report.
    let mut t = delta::open_existing(&case.silver, &Default::default()).await.unwrap().unwrap();
    let dup = delta::query(&t, "SELECT * FROM t WHERE \"key\" IS NULL").await.unwrap();
    assert_eq!(dup.iter().map(|b| b.num_rows()).sum::<usize>(), 1, "one NULL-key row in silver");
    let schema = t.snapshot().unwrap().snapshot().arrow_schema();
    let dup: Vec<RecordBatch> = dup.iter().map(|b| RecordBatch::try_new(schema.clone(), b.columns().to_vec()).unwrap()).collect();
    t = t.write(dup).with_save_mode(deltalake::protocol::SaveMode::Append).await.unwrap();
    drop(t);
    let (code, r) = case.run("reconcile");
    assert_eq!(code, Some(3), "a duplicated NULL-key row in silver is a real difference: {r}");
    assert_eq!(r["clean"], false, "{r}");
    // The reference check of silver sees the planted copy too.
    let found = mssql_cdc::torture::silver_matches_table(&case.db, &case.table, &case.silver, &columns(&case.key_type)).await;
    assert!(found.is_err(), "the reference check must see the second NULL-key row in silver");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_string_key_is_updated_deleted_and_reinserted_in_silver() {
    null_key_lifecycle(SqlType::NVarChar { len: Some(20) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_integer_key_is_updated_deleted_and_reinserted_in_silver() {
    null_key_lifecycle(SqlType::Int).await;
}
