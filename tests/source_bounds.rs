//! Chunk bounds as the source sees them, end to end through the binary:
//! an integer key that reaches the top of its type (int, smallint, tinyint)
//! and a nullable integer key with many NULLs, each snapshot chunked with
//! `stream` then `backfill` calls until `"done": true`.
//!
//! Every check compares bronze with the simulator's own rows
//! ([`SimDb::rows`], its storage read directly), column by column, and the
//! plan's counts with the rows each chunk wrote; nothing here goes through
//! the engine's range helpers.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use deltalake::arrow::array::{Array, Decimal128Array, Int16Array, Int32Array, Int64Array, StringArray, TimestampMicrosecondArray};
use deltalake::arrow::record_batch::RecordBatch;
use mssql_cdc::delta::{self, facts, plans};
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

/// One value as both sides can state it without the engine's conversions.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Cell {
    Null,
    Int(i64),
    Text(String),
    /// Unscaled value and scale.
    Dec(i128, i8),
    /// Microseconds since 1970 (datetime2(3) holds whole milliseconds).
    Micros(i64),
}

fn cell_of_sim(v: &SqlValue) -> Cell {
    match v {
        SqlValue::Null => Cell::Null,
        SqlValue::Int(x) => Cell::Int(*x),
        SqlValue::Str(s) => Cell::Text(s.clone()),
        SqlValue::Decimal { value, scale } => Cell::Dec(*value, *scale as i8),
        SqlValue::DateTime(t) => Cell::Micros(t.and_utc().timestamp_micros()),
        other => panic!("no cell for {other:?}"),
    }
}

fn cells_of_column(b: &RecordBatch, i: usize) -> Vec<Cell> {
    let a = b.column(i);
    let any = a.as_any();
    (0..b.num_rows())
        .map(|r| {
            if a.is_null(r) {
                Cell::Null
            } else if let Some(x) = any.downcast_ref::<Int16Array>() {
                Cell::Int(x.value(r) as i64)
            } else if let Some(x) = any.downcast_ref::<Int32Array>() {
                Cell::Int(x.value(r) as i64)
            } else if let Some(x) = any.downcast_ref::<Int64Array>() {
                Cell::Int(x.value(r))
            } else if let Some(x) = any.downcast_ref::<StringArray>() {
                Cell::Text(x.value(r).to_string())
            } else if let Some(x) = any.downcast_ref::<Decimal128Array>() {
                Cell::Dec(x.value(r), x.scale())
            } else if let Some(x) = any.downcast_ref::<TimestampMicrosecondArray>() {
                Cell::Micros(x.value(r))
            } else {
                panic!("column {} has type {}", b.schema().field(i).name(), a.data_type())
            }
        })
        .collect()
}

/// The columns every table here has besides its key.
fn payload_columns() -> Vec<ColumnDesc> {
    vec![
        ColumnDesc::new("label", SqlType::NVarChar { len: Some(30) }, true),
        ColumnDesc::new("amount", SqlType::Decimal { precision: 12, scale: 2 }, true),
        ColumnDesc::new("at", SqlType::DateTime2 { scale: 3 }, true),
        ColumnDesc::new("big", SqlType::BigInt, true),
    ]
}

fn payload(i: i64) -> Vec<SqlValue> {
    let t = chrono::NaiveDate::from_ymd_opt(2026, 3, 1).unwrap().and_hms_opt(0, 0, 0).unwrap() + chrono::Duration::milliseconds(i * 1_237);
    vec![
        if i % 5 == 0 { SqlValue::Null } else { SqlValue::Str(format!("row {i} ü")) },
        SqlValue::Decimal { value: (i as i128) * 101 - 5_000, scale: 2 },
        if i % 7 == 0 { SqlValue::Null } else { SqlValue::DateTime(t) },
        SqlValue::Int(i64::MAX - i.abs()),
    ]
}

/// A simulator file in `dir` with one table of `rows`, CDC on, capture run.
fn source(dir: &Path, spec: &TableSpec, rows: Vec<Vec<SqlValue>>) -> SimDb {
    let db = SimDb::create(&dir.join("source.sqlite"), common::manual_config()).unwrap();
    db.create_table(spec).unwrap();
    db.load_rows(&spec.name, rows.into_iter()).unwrap();
    db.enable_cdc(&spec.name, None, None).unwrap();
    db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&db);
    db
}

fn write_workflow(dir: &Path, table: &str, extra: &str) -> std::path::PathBuf {
    let p = dir.join("wf.toml");
    let text = format!(
        "app_id = \"bounds\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"{table}\"\n[target]\nbronze = \"bronze\"\nfacts = \"facts\"\n\
         [snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n{extra}\n"
    );
    std::fs::write(&p, text).unwrap();
    p
}

fn run(wf: &Path, step: &str) -> (Output, serde_json::Value) {
    run_args(wf, &[step])
}

fn run_args(wf: &Path, args: &[&str]) -> (Output, serde_json::Value) {
    let step = args[0];
    let out = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .args(["--workflow", wf.to_str().unwrap()])
        .args(args)
        .env("MSSQL_CDC_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| panic!("{step}: no stdout; stderr: {}", String::from_utf8_lossy(&out.stderr))).to_string();
    let j = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{step}: last line is not JSON ({e}): {line}"));
    (out, j)
}

/// `stream` once, then `backfill` (one wave a call) until done; every call
/// must exit 0. Returns the chunk count the last call reports.
fn stream_and_backfill(wf: &Path) -> u64 {
    let (out, j) = run(wf, "stream");
    assert_eq!(out.status.code(), Some(0), "stream: {j}\n{}", String::from_utf8_lossy(&out.stderr));
    for calls in 1..=100 {
        let (out, j) = run_args(wf, &["backfill", "--max-waves", "1"]);
        assert_eq!(out.status.code(), Some(0), "backfill call {calls}: {j}\n{}", String::from_utf8_lossy(&out.stderr));
        if j["done"] == true {
            return j["chunks_total"].as_u64().unwrap_or_else(|| panic!("no chunks_total: {j}"));
        }
    }
    panic!("backfill did not finish in 40 calls");
}

async fn open(location: &Path) -> deltalake::DeltaTable {
    delta::open_existing(location.to_str().unwrap(), &Default::default()).await.unwrap().unwrap_or_else(|| panic!("no table at {}", location.display()))
}

/// Bronze's snapshot rows: the captured columns' cells and the chunk that wrote each.
async fn bronze_snapshot(dir: &Path, columns: &[ColumnDesc]) -> Vec<(Vec<Cell>, i64)> {
    let t = open(&dir.join("bronze")).await;
    let list: Vec<String> = columns.iter().map(|c| format!("\"{}\"", c.name)).collect();
    let batches = delta::query(&t, &format!("SELECT {}, _chunk FROM t WHERE _operation = 0", list.join(", "))).await.unwrap();
    let mut out = Vec::new();
    for b in &batches {
        let cols: Vec<Vec<Cell>> = (0..columns.len()).map(|i| cells_of_column(b, i)).collect();
        let chunk = b.column(columns.len()).as_any().downcast_ref::<Int64Array>().unwrap();
        for r in 0..b.num_rows() {
            out.push((cols.iter().map(|c| c[r].clone()).collect(), chunk.value(r)));
        }
    }
    out
}

/// Asserts that bronze's snapshot rows are the table's rows, every column, each once.
async fn assert_snapshot_is_the_table(dir: &Path, db: &SimDb, spec: &TableSpec) -> Vec<(Vec<Cell>, i64)> {
    let read = bronze_snapshot(dir, &spec.columns).await;
    let mut got: Vec<Vec<Cell>> = read.iter().map(|(r, _)| r.clone()).collect();
    let mut want: Vec<Vec<Cell>> = db.rows(&spec.name).unwrap().iter().map(|r| r.iter().map(cell_of_sim).collect()).collect();
    got.sort();
    want.sort();
    assert_eq!(got.len(), want.len(), "bronze holds {} snapshot rows, the table {}", got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w);
    }
    read
}

fn keyed_spec(name: &str, key_type: SqlType) -> TableSpec {
    let mut columns = vec![ColumnDesc::new("id", key_type, false)];
    columns.extend(payload_columns());
    TableSpec { collations: Default::default(), name: TableName::new("dbo", name), columns, primary_key: vec!["id".into()], unique_index: vec![] }
}

/// A key at its type's MAX: the last chunk ends at MAX + 1, which the type
/// cannot hold. The snapshot completes and equals the table.
async fn chunked_snapshot_reaches_the_top_of(key_type: SqlType, ids: Vec<i64>) {
    let dir = tempfile::tempdir().unwrap();
    let spec = keyed_spec("t", key_type.clone());
    let rows: Vec<Vec<SqlValue>> = ids.iter().map(|&i| [vec![SqlValue::Int(i)], payload(i)].concat()).collect();
    let db = source(dir.path(), &spec, rows);
    let wf = write_workflow(dir.path(), "t", "");
    let chunks = stream_and_backfill(&wf);
    assert!(chunks >= 5, "{key_type:?}: {chunks} chunks; the table should take several");
    let read = assert_snapshot_is_the_table(dir.path(), &db, &spec).await;
    // The top value was read, by the last chunk.
    let last_chunk = read.iter().map(|(_, c)| *c).max().unwrap();
    let top = *ids.iter().max().unwrap();
    assert!(read.iter().any(|(r, c)| r[0] == Cell::Int(top) && *c == last_chunk), "{key_type:?}: MAX {top} not in the last chunk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_int_key_reaching_2147483647_snapshots_in_chunks() {
    let ids: Vec<i64> = (-2_147_483_648..-2_147_483_630).chain(0..25).chain(2_147_483_610..=2_147_483_647).collect();
    chunked_snapshot_reaches_the_top_of(SqlType::Int, ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smallint_key_reaching_32767_snapshots_in_chunks() {
    let ids: Vec<i64> = (-32_768..-32_750).chain(0..25).chain(32_740..=32_767).collect();
    chunked_snapshot_reaches_the_top_of(SqlType::SmallInt, ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tinyint_key_holding_every_value_to_255_snapshots_in_chunks() {
    chunked_snapshot_reaches_the_top_of(SqlType::TinyInt, (0..=255).collect()).await;
}

/// A heap chunked on a nullable integer column with many NULLs: the plan
/// counts the NULLs into the first chunk (which reads them), so every chunk's
/// planned rows are the rows it read, as bronze and the facts rows hold them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nullable_integer_key_plans_its_nulls_into_the_first_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let mut columns = vec![ColumnDesc::new("k", SqlType::Int, true)];
    columns.extend(payload_columns());
    let spec = TableSpec { collations: Default::default(), name: TableName::new("dbo", "h"), columns, primary_key: vec![], unique_index: vec![] };
    // 70 NULL keys among 55 keyed rows (values 1..=50, 3 and 40 repeated).
    let mut rows: Vec<Vec<SqlValue>> = Vec::new();
    for i in 0..125i64 {
        let k = match i {
            0..=69 => SqlValue::Null,
            70..=119 => SqlValue::Int(i - 69),
            120..=122 => SqlValue::Int(3),
            _ => SqlValue::Int(40),
        };
        rows.push([vec![k], payload(i)].concat());
    }
    let db = source(dir.path(), &spec, rows);
    let wf = write_workflow(dir.path(), "h", "keys = [\"k\"]");
    let chunks = stream_and_backfill(&wf);
    let read = assert_snapshot_is_the_table(dir.path(), &db, &spec).await;

    let mut read_per_chunk: BTreeMap<i64, u64> = BTreeMap::new();
    for (r, c) in &read {
        *read_per_chunk.entry(*c).or_default() += 1;
        if r[0] == Cell::Null {
            assert_eq!(*c, 0, "a NULL key read by chunk {c}");
        }
    }
    let plan_table = open(Path::new(&plans::location_for(dir.path().join("bronze").to_str().unwrap()))).await;
    let plan_rows = plans::from_batches(&delta::query(&plan_table, "SELECT * FROM t").await.unwrap()).unwrap();
    let plan = plan_rows.iter().find(|r| r.event == "snapshot_plan").expect("a plan row");
    assert_eq!(plan.detail["kind"], "integer", "{}", plan.detail);
    let planned: BTreeMap<i64, u64> = plan.detail["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["chunk"].as_i64().unwrap(), c["rows"].as_u64().unwrap_or_else(|| panic!("no planned rows in {c}"))))
        .collect();
    assert_eq!(planned.len() as u64, chunks);
    let facts_table = open(&dir.path().join("facts")).await;
    let fact_rows = facts::from_batches(&delta::query(&facts_table, "SELECT * FROM t").await.unwrap()).unwrap();
    let recorded: BTreeMap<i64, u64> = fact_rows
        .iter()
        .filter(|r| r.event.as_deref() == Some("snapshot_chunk"))
        .map(|r| (r.detail.as_ref().unwrap()["chunk"].as_i64().unwrap(), r.rows.unwrap() as u64))
        .collect();
    let table_rows = db.rows(&spec.name).unwrap().len() as u64;
    assert_eq!(planned.values().sum::<u64>(), table_rows, "the plan counts every row: {planned:?}");
    for (chunk, rows) in &planned {
        let got = read_per_chunk.get(chunk).copied().unwrap_or(0);
        assert_eq!(got, *rows, "chunk {chunk}: planned {rows} rows, bronze holds {got}; plan {planned:?}, read {read_per_chunk:?}");
        assert_eq!(recorded.get(chunk).copied(), Some(*rows), "chunk {chunk}: facts row");
    }
    assert!(planned[&0] >= 70, "the first chunk holds the 70 NULL keys: {planned:?}");
}

/// The nullable-key heap of the test above, with silver, and changes while
/// its chunked snapshot is open: before the first wave and between waves, a
/// transaction (committed and captured) inserts rows with a NULL key and
/// with a value, updates NULL-key rows in place, moves a NULL key to a value
/// and a value to NULL, and deletes rows of both kinds; the stream runs on
/// every other round. Then the stream until caught up and `apply` until it
/// has nothing left, and the torture tester's reference checks: silver is the
/// table on every column (a heap's silver as a multiset with counts), bronze's
/// change rows are the change function's from S on every column, and the
/// facts' batch ranges tile the LSNs from S.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nullable_integer_key_with_changes_while_its_snapshot_is_open_ends_with_silver_and_bronze_as_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let mut columns = vec![ColumnDesc::new("k", SqlType::Int, true)];
    columns.extend(payload_columns());
    let spec = TableSpec { collations: Default::default(), name: TableName::new("dbo", "h"), columns, primary_key: vec![], unique_index: vec![] };
    // 70 NULL keys among 55 keyed rows (values 1..=50, 3 and 40 repeated), as above.
    let mut rows: Vec<Vec<SqlValue>> = Vec::new();
    for i in 0..125i64 {
        let k = match i {
            0..=69 => SqlValue::Null,
            70..=119 => SqlValue::Int(i - 69),
            120..=122 => SqlValue::Int(3),
            _ => SqlValue::Int(40),
        };
        rows.push([vec![k], payload(i)].concat());
    }
    let db = source(dir.path(), &spec, rows);
    let wf = dir.path().join("wf.toml");
    std::fs::write(
        &wf,
        "app_id = \"bounds\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"h\"\n\
         [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
         [snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\nkeys = [\"k\"]\n",
    )
    .unwrap();

    // The stream opens the snapshot.
    let (out, j) = run(&wf, "stream");
    assert_eq!(out.status.code(), Some(0), "stream: {j}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(j["bootstrap"]["opened_now"], true, "{j}");

    let table = spec.name.clone();
    let mut done = false;
    let mut changes = 0;
    for round in 0..40i64 {
        // A heap row is found by its values: each change names a whole row.
        let current = db.rows(&table).unwrap();
        let nulls: Vec<Vec<SqlValue>> = current.iter().filter(|r| matches!(r[0], SqlValue::Null)).cloned().collect();
        let valued: Vec<Vec<SqlValue>> = current.iter().filter(|r| !matches!(r[0], SqlValue::Null)).cloned().collect();
        let (n, v) = (nulls.len(), valued.len());
        assert!(n > 13 && v > 3, "round {round}: {n} NULL-key rows, {v} keyed rows left");
        let base = 1_000 + round * 10;
        db.transaction(|tx| {
            // Inserts: a NULL key and a value (one past the keys planned, one among them).
            tx.insert(&table, [vec![SqlValue::Null], payload(base)].concat())?;
            tx.insert(&table, [vec![SqlValue::Int(60 + round)], payload(base + 1)].concat())?;
            tx.insert(&table, [vec![SqlValue::Int(1 + round % 50)], payload(base + 2)].concat())?;
            // A NULL-key row updated in place (its key stays NULL).
            let a = &nulls[round as usize % n];
            tx.update(&table, a, [vec![SqlValue::Null], payload(base + 3)].concat())?;
            // A NULL key moved to a value.
            let b = &nulls[(round as usize + 7) % n];
            let mut b2 = b.clone();
            b2[0] = SqlValue::Int(5 + round % 40);
            tx.update(&table, b, b2)?;
            // A value moved to NULL.
            let c = &valued[round as usize % v];
            let mut c2 = c.clone();
            c2[0] = SqlValue::Null;
            tx.update(&table, c, c2)?;
            // Deletes: a NULL-key row and a keyed one.
            tx.delete(&table, &nulls[(round as usize + 13) % n])?;
            tx.delete(&table, &valued[(round as usize + 3) % v])
        })
        .unwrap();
        db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        common::settle(&db);
        changes += 1;
        if round % 2 == 1 {
            let (out, j) = run(&wf, "stream");
            assert_eq!(out.status.code(), Some(0), "stream in round {round}: {j}\n{}", String::from_utf8_lossy(&out.stderr));
        }
        if done {
            break;
        }
        let (out, j) = run_args(&wf, &["backfill", "--max-waves", "1"]);
        assert_eq!(out.status.code(), Some(0), "backfill in round {round}: {j}\n{}", String::from_utf8_lossy(&out.stderr));
        // One more round of changes after the last wave, then stop.
        done = j["done"] == true;
    }
    assert!(done, "backfill did not finish in 40 calls");
    assert!(changes >= 2, "the snapshot took {changes} rounds; the scenario wants changes between waves");

    db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&db);
    let mut caught_up = false;
    for calls in 1..=50 {
        let (out, j) = run(&wf, "stream");
        assert_eq!(out.status.code(), Some(0), "stream call {calls}: {j}\n{}", String::from_utf8_lossy(&out.stderr));
        if j["caught_up"] == true {
            caught_up = true;
            break;
        }
    }
    assert!(caught_up, "the stream did not catch up in 50 calls");
    let mut applied = false;
    for calls in 1..=20 {
        let (out, j) = run(&wf, "apply");
        assert_eq!(out.status.code(), Some(0), "apply call {calls}: {j}\n{}", String::from_utf8_lossy(&out.stderr));
        if j["action"] == "nothing" {
            applied = true;
            break;
        }
    }
    assert!(applied, "apply still had work after 20 calls");

    // The premise: NULL keys are still there, and the changes reached them.
    let now = db.rows(&table).unwrap();
    assert!(now.iter().filter(|r| matches!(r[0], SqlValue::Null)).count() >= 40, "NULL-key rows remain");
    common::assert_targets_match_source(&db, &table, &wf).await;
}
