//! A captured column renamed at the source (`sp_rename`), through the CLI
//! binary against the simulator. SQL Server keeps the capture instance as it
//! was: the captured column keeps its old name, and the change table goes on
//! returning its values under that name (capture maps columns by id). So the
//! stream must go on and carry the new values under the old name, while
//! every step that reads the table itself (which has no column of the old
//! name any more) must stop with exit 3 before writing anything, never read
//! the column as NULL.
//!
//! Expected values come from what the writer wrote and from the simulator's
//! own rows, read under the columns' current names.

mod common;

use std::path::{Path, PathBuf};

use common::model::{delta_rows, ok, run_cli, source_rows};
use deltalake::arrow::array::{Array, Int64Array, StringArray};
use deltalake::arrow::datatypes::DataType;
use mssql_cdc::delta;
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};
use serde_json::Value;

const OLD_INSTANCE: &str = "dbo_items";
const NEW_INSTANCE: &str = "dbo_items_v2";

/// The table's columns under the given names (id, name, amount as created).
fn columns(names: [&str; 3]) -> Vec<ColumnDesc> {
    vec![
        ColumnDesc::new(names[0], SqlType::Int, false),
        ColumnDesc::new(names[1], SqlType::NVarChar { len: Some(40) }, true),
        ColumnDesc::new(names[2], SqlType::Int, true),
    ]
}

fn row(id: i64, amount: i64) -> Vec<SqlValue> {
    vec![SqlValue::Int(id), SqlValue::Str(format!("item {id}")), SqlValue::Int(amount)]
}

fn key(id: i64) -> Vec<SqlValue> {
    vec![SqlValue::Int(id)]
}

struct Setup {
    dir: tempfile::TempDir,
    db: SimDb,
    table: TableName,
}

impl Setup {
    /// `rows` items loaded before CDC was enabled, and the capture job's first scan.
    fn new(rows: i64) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let db = SimDb::create(&dir.path().join("source.sqlite"), common::manual_config()).unwrap();
        let table = TableName::new("dbo", "items");
        db.create_table(&TableSpec {
            collations: Default::default(),
            name: table.clone(),
            columns: columns(["id", "name", "amount"]),
            primary_key: vec!["id".into()],
            unique_index: vec![],
        })
        .unwrap();
        db.load_rows(&table, (1..=rows).map(|i| row(i, i * 10))).unwrap();
        db.enable_cdc(&table, None, None).unwrap();
        db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
        common::settle(&db);
        Setup { dir, db, table }
    }

    /// A workflow file `file` for app `app`, its targets named with `prefix`.
    fn workflow(&self, file: &str, app: &str, prefix: &str, snapshot_toml: &str) -> PathBuf {
        let path = self.dir.path().join(file);
        std::fs::write(
            &path,
            format!(
                "app_id = \"{app}\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"items\"\n\
                 [target]\nbronze = \"{prefix}bronze\"\nfacts = \"{prefix}facts\"\nsilver = \"{prefix}silver\"\n\
                 [snapshot]\nbootstrap = true\n{snapshot_toml}\n[stream]\nmax_batch_rows = 1000\n"
            ),
        )
        .unwrap();
        path
    }

    /// One transaction of writes, then a capture scan so the change table holds it.
    fn write(&self, f: impl FnOnce(&mut mssql_cdc::sim::db::SimTx<'_>) -> mssql_cdc::sim::db::Result<()>) {
        self.db.transaction(f).unwrap();
        self.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        common::settle(&self.db);
    }

    fn location(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_string()
    }
}

/// The refusal of a step that reads the table: exit 3, naming the instance,
/// the old and the new name, and the way out.
fn assert_refused(what: &str, wf: &Path, args: &[&str]) {
    let (code, j, err) = run_cli(wf, args);
    assert_eq!(code, Some(3), "{what}: {j}\n{err}");
    assert_eq!(j["kind"], "needs_person", "{what}: {j}");
    let e = j["error"].as_str().unwrap_or_default();
    assert!(e.contains("'amount' -> 'total'"), "{what}: the error names the old and the new name: {e}");
    assert!(e.contains(OLD_INSTANCE) && e.contains("dbo.items"), "{what}: the error names the instance and the table: {e}");
    assert!(e.contains("sys.sp_cdc_enable_table") && e.contains("@capture_instance"), "{what}: the error says what to do: {e}");
}

/// Column `name` of a batch as text per row (None for NULL).
fn text_column(b: &deltalake::arrow::record_batch::RecordBatch, name: &str) -> Vec<Option<String>> {
    let i = b.schema().index_of(name).unwrap_or_else(|_| panic!("no column '{name}' in {:?}", b.schema()));
    let a = deltalake::arrow::compute::cast(b.column(i), &DataType::Utf8).unwrap();
    let a = a.as_any().downcast_ref::<StringArray>().unwrap();
    (0..a.len()).map(|r| if a.is_null(r) { None } else { Some(a.value(r).to_string()) }).collect()
}

/// Bronze's inserts and after-images of the ids `filter` keeps: (id, amount), by id.
async fn change_amounts(bronze: &str, filter: &str) -> Vec<(i64, Option<i64>)> {
    let t = delta::open_existing(bronze, &Default::default()).await.unwrap().expect("bronze exists");
    let mut out = Vec::new();
    for b in delta::query(&t, &format!("SELECT id, amount FROM t WHERE _operation IN (2, 4) AND {filter}")).await.unwrap() {
        let (ids, amounts) = (text_column(&b, "id"), text_column(&b, "amount"));
        for r in 0..b.num_rows() {
            out.push((ids[r].as_ref().unwrap().parse().unwrap(), amounts[r].as_ref().map(|a| a.parse().unwrap())));
        }
    }
    out.sort();
    out
}

async fn version(location: &str) -> Option<i64> {
    delta::open_existing(location, &Default::default()).await.unwrap().and_then(|t| t.version()).map(|v| v as i64)
}

async fn row_count(location: &str) -> i64 {
    let t = delta::open_existing(location, &Default::default()).await.unwrap().unwrap_or_else(|| panic!("no Delta table at {location}"));
    let b = delta::query(&t, "SELECT COUNT(*) AS n FROM t").await.unwrap();
    b[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0)
}

#[test]
fn a_renamed_column_streams_under_its_captured_name_and_reads_of_the_table_stop() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Setup::new(20);
    let table = s.table.clone();
    let wf = s.workflow("items.toml", "items", "", "mode = \"full\"");
    ok(&wf, &["stream"]);
    ok(&wf, &["apply"]);
    s.write(|tx| {
        tx.update(&table, &key(2), row(2, 21))?;
        tx.insert(&table, row(21, 210))
    });
    ok(&wf, &["stream"]);
    ok(&wf, &["apply"]);
    // Before the rename the workflow is sound: reconcile runs, and is clean.
    let r = ok(&wf, &["reconcile"]);
    assert_eq!(r["clean"], true, "{r}");
    let report_version = rt.block_on(version(&s.location("silver_reconcile")));
    assert!(report_version.is_some(), "reconcile wrote its report");

    // EXEC sp_rename 'dbo.items.amount', 'total', 'COLUMN'; then writes under the new name.
    s.db.rename_column(&table, "amount", "total").unwrap();
    s.write(|tx| {
        tx.update(&table, &key(3), row(3, 333))?;
        tx.update(&table, &key(4), row(4, 444))?;
        tx.insert(&table, row(22, 2222))
    });

    // The stream goes on, and says why the table reads will not.
    let (code, j, err) = run_cli(&wf, &["stream"]);
    assert_eq!(code, Some(0), "{j}\n{err}");
    assert!(err.contains("renamed") && err.contains("total"), "the stream warns of the rename: {err}");
    // Its change rows carry what the writer wrote to `total`, under the captured name.
    assert_eq!(
        rt.block_on(change_amounts(&s.location("bronze"), "id IN (3, 4, 22)")),
        vec![(3, Some(333)), (4, Some(444)), (22, Some(2222))],
        "bronze's change rows after the rename"
    );
    // Silver follows: its `amount` is the table's `total`, row for row.
    ok(&wf, &["apply"]);
    let source = rt.block_on(source_rows(&s.db, &table, &columns(["id", "name", "total"])));
    let silver = rt.block_on(delta_rows(&s.location("silver"), &columns(["id", "name", "amount"]), "TRUE"));
    assert_eq!(silver, source, "silver's amount is the table's total");

    // Reconcile reads the table: refused, and no report written.
    assert_refused("reconcile", &wf, &["reconcile"]);
    assert_eq!(rt.block_on(version(&s.location("silver_reconcile"))), report_version, "reconcile wrote a report although it stopped");

    // A full snapshot (a second workflow bootstrapping on the same table): refused before its open row.
    let again = s.workflow("again.toml", "again", "again_", "mode = \"full\"");
    assert_refused("a full snapshot", &again, &["snapshot"]);
    assert_eq!(rt.block_on(row_count(&s.location("again_facts"))), 0, "the refused snapshot recorded nothing");
    assert_eq!(rt.block_on(row_count(&s.location("again_bronze"))), 0, "the refused snapshot wrote no row");

    // The stream still works after the refusals.
    s.write(|tx| tx.update(&table, &key(5), row(5, 555)));
    ok(&wf, &["stream"]);
    assert_eq!(rt.block_on(change_amounts(&s.location("bronze"), "id = 5")), vec![(5, Some(555))]);
}

#[test]
fn a_chunked_snapshot_does_not_read_a_renamed_column_until_a_new_instance_captures_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Setup::new(40);
    let table = s.table.clone();
    let chunked = "mode = \"chunked\"\nchunk_rows = 5\nparallelism = 1\ntarget_wave_seconds = 0";
    let wf = s.workflow("items.toml", "items", "", chunked);
    // The stream opens the snapshot at S; no chunk is read yet.
    let r = ok(&wf, &["stream"]);
    assert_eq!(r["bootstrap"]["opened_now"], true, "{r}");

    s.db.rename_column(&table, "amount", "total").unwrap();
    s.write(|tx| tx.update(&table, &key(5), row(5, 555)));
    ok(&wf, &["stream"]);
    assert_eq!(rt.block_on(change_amounts(&s.location("bronze"), "id = 5")), vec![(5, Some(555))], "the stream goes on");

    // Backfill would read the chunks with the captured names: refused, nothing written.
    let targets = ["bronze", "facts", "bronze_snapshot_plans"];
    let versions = || targets.iter().map(|t| rt.block_on(version(&s.location(t)))).collect::<Vec<_>>();
    let before = versions();
    assert!(before.iter().all(Option::is_some), "the open wrote bronze, facts and plans: {before:?}");
    assert_refused("backfill", &wf, &["backfill", "--max-waves", "1"]);
    assert_eq!(versions(), before, "backfill wrote to {targets:?} although it stopped");

    // Opening a chunked snapshot (a second workflow on the same table): refused before its plans row.
    let again = s.workflow("again.toml", "again", "again_", chunked);
    assert_refused("a chunked snapshot's open", &again, &["snapshot"]);
    assert!(rt.block_on(version(&s.location("again_bronze_snapshot_plans"))).is_none(), "the refused open wrote a plans table");
    assert_eq!(rt.block_on(row_count(&s.location("again_facts"))), 0, "the refused open recorded a facts row");

    // The way out the error gives: an instance that captures the new name,
    // which the stream switches to; backfill then reads with its columns.
    s.db.enable_cdc(&table, Some(NEW_INSTANCE), None).unwrap();
    s.write(|tx| tx.update(&table, &key(6), row(6, 666)));
    ok(&wf, &["stream"]);
    let st = ok(&wf, &["status"]);
    assert_eq!(st["capture_instance"], NEW_INSTANCE, "the stream switched: {st}");
    let mut calls = 0;
    loop {
        let b: Value = ok(&wf, &["backfill", "--max-waves", "1"]);
        calls += 1;
        if b["done"] == true {
            break;
        }
        assert!(calls < 30, "backfill never finished: {b}");
        ok(&wf, &["stream"]);
    }
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    ok(&wf, &["stream"]);
    for _ in 0..10 {
        if ok(&wf, &["apply"])["action"] == "nothing" {
            break;
        }
    }
    // Silver's `total` is the table's, every row (the chunks were read after the switch).
    let now = columns(["id", "name", "total"]);
    let source = rt.block_on(source_rows(&s.db, &table, &now));
    let silver = rt.block_on(delta_rows(&s.location("silver"), &now, "TRUE"));
    assert_eq!(silver, source, "silver after the snapshot read with the new instance");
}
