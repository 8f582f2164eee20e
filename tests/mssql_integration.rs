//! Runs every `CdcSource` method of `MssqlSource` against a real SQL Server.
//!
//! Set `MSSQL_CDC_TEST_URL` (an `mssql://` URL of a login that may enable CDC,
//! for example `sa` on a throw-away container) and `MSSQL_CDC_TEST_PASSWORD`;
//! SQL Server Agent must run so that capture happens. docs/sqlserver.md shows
//! how to start a server.
//!
//! Every test here is `#[ignore]`d, so a plain `cargo test` lists it as
//! ignored instead of reporting a pass it never earned. Run the suite with
//! `cargo test --release --test suite mssql_integration:: -- --ignored`; a test run
//! that way without a server fails, it never passes silently.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use deltalake::arrow::array::{Array, FixedSizeBinaryArray, Int32Array, Int64Array};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::arrow::util::display::array_value_to_string;
use futures::TryStreamExt;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::mssql::{MssqlConfig, MssqlSource, PASSWORD_ENV};
use mssql_cdc::source::{
    CdcSource, CaptureInstance, Isolation, KeyRange, RowFilter, SnapshotRead, SourceError, SourceSecrets, TableName, TimeOp,
    CHANGE_COMMAND_ID, CHANGE_OPERATION, CHANGE_START_LSN,
};
use mssql_cdc::types::{value_at, ColumnDesc, SqlType, SqlValue};
use tokio::net::TcpStream;
use tokio_util::compat::TokioAsyncWriteCompatExt;

type Admin = tiberius::Client<tokio_util::compat::Compat<TcpStream>>;

async fn admin(url: &str, password: &str) -> Admin {
    let cfg = MssqlConfig::parse(url).expect("MSSQL_CDC_TEST_URL parses");
    let tc = cfg.tiberius_config(password);
    let tcp = TcpStream::connect(tc.get_addr()).await.expect("TCP connection to the test server");
    tcp.set_nodelay(true).ok();
    tiberius::Client::connect(tc, tcp.compat_write()).await.expect("admin login")
}

async fn exec(c: &mut Admin, sql: &str) {
    c.simple_query(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}")).into_results().await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// (start LSN, operation, id) of every change row, in stream order.
async fn read_changes(src: &MssqlSource, ci: &mssql_cdc::source::CaptureInstance, from: Lsn, to: Lsn, filter: RowFilter) -> Vec<(Lsn, i32, i64)> {
    let batches: Vec<_> = src.changes(ci, from, to, filter, 7).await.expect("changes").try_collect().await.expect("change batches");
    let id_pos = 5 + ci.columns.iter().position(|c| c.name == "id").expect("id captured");
    let mut out = Vec::new();
    for b in &batches {
        assert!(b.num_rows() <= 7, "batch larger than batch_rows");
        let lsn_col = b.column_by_name(CHANGE_START_LSN).unwrap();
        let op_col = b.column_by_name(CHANGE_OPERATION).unwrap();
        for r in 0..b.num_rows() {
            let lsn_bytes = lsn_col.as_any().downcast_ref::<FixedSizeBinaryArray>().expect("FixedSizeBinary(10)").value(r);
            let lsn = Lsn(lsn_bytes.try_into().unwrap());
            let op = value_at(op_col.as_ref(), r, &SqlType::Int).as_i64().unwrap() as i32;
            let id = value_at(b.column(id_pos).as_ref(), r, &SqlType::Int).as_i64().unwrap();
            out.push((lsn, op, id));
        }
    }
    out
}

/// The server under test, from the environment. A run that asked for this
/// suite (`--ignored`) and gave no server is a failure, not a pass.
fn server_under_test() -> (String, String) {
    match (std::env::var("MSSQL_CDC_TEST_URL"), std::env::var("MSSQL_CDC_TEST_PASSWORD")) {
        (Ok(url), Ok(password)) => (url, password),
        _ => panic!(
            "the real-server suite ran without a server: set MSSQL_CDC_TEST_URL (mssql://user@host:port/database) and \
             MSSQL_CDC_TEST_PASSWORD, see docs/sqlserver.md"
        ),
    }
}

/// The schema the tests below create their tables in.
const SCHEMA: &str = "cdc_it";

/// A table name no other run uses.
fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple().to_string().get(..8).unwrap_or("x"))
}

/// One number from the server (the statement's first column of its first row, cast to bigint by the caller's SQL).
async fn scalar(c: &mut Admin, sql: &str) -> Option<i64> {
    let row = c.simple_query(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}")).into_row().await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    row.and_then(|r| r.try_get::<i64, _>(0).unwrap_or_else(|e| panic!("{sql}: expected a bigint: {e}")))
}

/// CDC on the database and the test schema, both made when missing.
async fn prepare(a: &mut Admin) {
    exec(a, "IF (SELECT is_cdc_enabled FROM sys.databases WHERE name = DB_NAME()) = 0 EXEC sys.sp_cdc_enable_db").await;
    exec(a, &format!("IF SCHEMA_ID(N'{SCHEMA}') IS NULL EXEC(N'CREATE SCHEMA {SCHEMA}')")).await;
}

/// `sp_cdc_enable_table` without a gating role; returns the capture instance's name.
async fn enable_cdc(a: &mut Admin, name: &str) -> String {
    exec(a, &format!("EXEC sys.sp_cdc_enable_table @source_schema = N'{SCHEMA}', @source_name = N'{name}', @role_name = NULL")).await;
    format!("{SCHEMA}_{name}")
}

/// Disables CDC on the table (when on) and drops it.
async fn drop_table(a: &mut Admin, name: &str) {
    exec(
        a,
        &format!(
            "IF EXISTS (SELECT 1 FROM sys.tables WHERE object_id = OBJECT_ID(N'{SCHEMA}.[{name}]') AND is_tracked_by_cdc = 1) \
             EXEC sys.sp_cdc_disable_table @source_schema = N'{SCHEMA}', @source_name = N'{name}', @capture_instance = N'all'; \
             IF OBJECT_ID(N'{SCHEMA}.[{name}]') IS NOT NULL DROP TABLE {SCHEMA}.[{name}]"
        ),
    )
    .await;
}

/// Waits (at most two minutes) until the capture job has written at least
/// `rows` rows to the instance's change table, all at or below max LSN.
async fn wait_for_capture(a: &mut Admin, capture_instance: &str, rows: i64) {
    let sql = format!(
        "SELECT CAST(COUNT_BIG(*) AS bigint) FROM cdc.[{capture_instance}_CT] WHERE __$start_lsn <= sys.fn_cdc_get_max_lsn()"
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let n = scalar(a, &sql).await.unwrap_or(0);
        if n >= rows {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected {rows} change rows in cdc.[{capture_instance}_CT] within 2 minutes, found {n}: is SQL Server Agent running?"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The table's only capture instance, as the source reads it.
async fn instance(src: &MssqlSource, table: &TableName) -> CaptureInstance {
    let mut cis = src.capture_instances(table).await.unwrap_or_else(|e| panic!("capture instances of {table}: {e}"));
    assert_eq!(cis.len(), 1, "expected one capture instance on {table}, found {}", cis.len());
    cis.remove(0)
}

/// Each row of `batch` as text (the named columns joined with " | "),
/// repeated as often as its `count` column says (heap silver) or once.
fn render(batch: &RecordBatch, names: &[String], count: Option<&str>) -> Vec<String> {
    let schema = batch.schema();
    let cols: Vec<_> = names
        .iter()
        .map(|n| batch.column(schema.index_of(n).unwrap_or_else(|_| panic!("expected a column '{n}' in {schema:?}"))).clone())
        .collect();
    let counts = count.map(|c| {
        batch
            .column(schema.index_of(c).unwrap_or_else(|_| panic!("expected a column '{c}'")))
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap_or_else(|| panic!("expected '{c}' to be Int64"))
            .clone()
    });
    let mut out = Vec::new();
    for r in 0..batch.num_rows() {
        let line = cols
            .iter()
            .map(|a| if a.is_null(r) { "NULL".to_string() } else { array_value_to_string(a.as_ref(), r).expect("a printable value") })
            .collect::<Vec<_>>()
            .join(" | ");
        let n = counts.as_ref().map(|c| c.value(r)).unwrap_or(1);
        for _ in 0..n {
            out.push(line.clone());
        }
    }
    out
}

/// The table's rows now (a READ COMMITTED read of the whole table through
/// the source), as sorted text lines of `columns`.
async fn table_rows(src: &MssqlSource, table: &TableName, columns: &[ColumnDesc]) -> Vec<String> {
    let read = SnapshotRead {
        table: table.clone(),
        columns: columns.to_vec(),
        keys: vec![],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 1000,
    };
    let batches: Vec<RecordBatch> = src
        .snapshot_read(&read)
        .await
        .unwrap_or_else(|e| panic!("read of {table}: {e}"))
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("read of {table}: {e}"));
    let names: Vec<String> = columns.iter().map(|c| c.name.clone()).collect();
    let mut rows: Vec<String> = batches.iter().flat_map(|b| render(b, &names, None)).collect();
    rows.sort();
    rows
}

/// Rows of a Delta table (`filter` a SQL condition on it, or "true"), as sorted text lines of `columns`.
async fn delta_rows(location: &str, columns: &[ColumnDesc], filter: &str, count: Option<&str>) -> Vec<String> {
    let t = mssql_cdc::delta::open_existing(location, &Default::default())
        .await
        .unwrap_or_else(|e| panic!("open {location}: {e}"))
        .unwrap_or_else(|| panic!("expected a Delta table at {location}"));
    let names: Vec<String> = columns.iter().map(|c| c.name.clone()).collect();
    let mut select: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    if let Some(c) = count {
        select.push(format!("\"{c}\""));
    }
    let sql = format!("SELECT {} FROM t WHERE {filter}", select.join(", "));
    let batches = mssql_cdc::delta::query(&t, &sql).await.unwrap_or_else(|e| panic!("{sql} on {location}: {e}"));
    let mut rows: Vec<String> = batches.iter().flat_map(|b| render(b, &names, count)).collect();
    rows.sort();
    rows
}

/// Fails naming the first lines where two sorted row lists differ.
fn assert_same_rows(what: &str, expected: &[String], got: &[String]) {
    if expected != got {
        let missing: Vec<_> = expected.iter().filter(|r| !got.contains(r)).take(10).collect();
        let extra: Vec<_> = got.iter().filter(|r| !expected.contains(r)).take(10).collect();
        panic!(
            "{what}: expected the table's {} rows, got {} rows; first missing: {missing:?}; first unexpected: {extra:?}",
            expected.len(),
            got.len()
        );
    }
}

/// Runs one step of the command-line binary on a workflow file: (exit code,
/// the last stdout line as JSON, stderr).
async fn run_cli(wf: PathBuf, password: String, args: Vec<String>) -> (Option<i32>, serde_json::Value, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .arg("--workflow")
        .arg(&wf)
        .args(&args)
        .env("MSSQL_CDC_LOG", "warn")
        .env(PASSWORD_ENV, &password)
        .output()
        .await
        .expect("the mssql-cdc binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let last = stdout.lines().last().unwrap_or("null").to_string();
    (out.status.code(), serde_json::from_str(&last).unwrap_or(serde_json::Value::Null), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A workflow file in a temporary folder whose source is the server under
/// test, and the steps run on it through the binary.
struct Steps {
    dir: tempfile::TempDir,
    wf: PathBuf,
    password: String,
}

impl Steps {
    /// `extra` is TOML after the `[target]` table (further `[snapshot]` or `[stream]` tables).
    fn new(url: &str, password: &str, table: &str, extra: &str) -> Steps {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let wf = dir.path().join("workflow.toml");
        // A JSON string is a valid TOML basic string.
        let url = serde_json::to_string(url).expect("a URL as a string");
        let text = format!(
            "app_id = \"{table}\"\n[source]\nurl = {url}\n[table]\nschema = \"{SCHEMA}\"\nname = \"{table}\"\n\
             [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n{extra}\n"
        );
        std::fs::write(&wf, text).expect("workflow file written");
        Steps { dir, wf, password: password.to_string() }
    }

    fn location(&self, table: &str) -> String {
        self.dir.path().join(table).to_string_lossy().into_owned()
    }

    async fn run(&self, args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
        run_cli(self.wf.clone(), self.password.clone(), args.iter().map(|a| a.to_string()).collect()).await
    }

    /// Runs a step that must exit 0; its JSON result.
    async fn ok(&self, args: &[&str]) -> serde_json::Value {
        let (code, json, stderr) = self.run(args).await;
        assert_eq!(code, Some(0), "expected `{}` to exit 0: {json}\n{stderr}", args.join(" "));
        json
    }

    async fn stream_until_caught_up(&self) {
        for _ in 0..50 {
            let r = self.ok(&["stream"]).await;
            if r["caught_up"] == true && r["call_again"] != true {
                return;
            }
        }
        panic!("expected the stream to catch up within 50 calls");
    }

    async fn backfill_until_done(&self) -> u32 {
        for calls in 1..=200 {
            let r = self.ok(&["backfill"]).await;
            if r["done"] == true {
                return calls;
            }
        }
        panic!("expected backfill to finish its chunked snapshot within 200 calls");
    }

    /// `apply`, which must complete the snapshot, then `reconcile`, which must find nothing.
    async fn apply_and_reconcile_clean(&self) -> serde_json::Value {
        let a = self.ok(&["apply"]).await;
        assert_eq!(a["snapshot_state"], "complete", "expected apply to complete the snapshot: {a}");
        let r = self.ok(&["reconcile"]).await;
        assert_eq!((r["clean"].as_bool(), r["differences"].as_u64()), (Some(true), Some(0)), "expected a clean reconcile: {r}");
        r
    }
}

/// The source's view of the table's rows next to silver's, which must be equal.
async fn assert_silver_is_the_table(src: &MssqlSource, steps: &Steps, table: &TableName, ci: &CaptureInstance, heap: bool) {
    let expected = table_rows(src, table, &ci.columns).await;
    let got = delta_rows(&steps.location("silver"), &ci.columns, "true", heap.then_some("_count")).await;
    assert_same_rows(&format!("silver of {table}"), &expected, &got);
}

/// Bronze's snapshot rows (operation 0) next to the table's: every row read once.
async fn assert_snapshot_is_the_table(src: &MssqlSource, steps: &Steps, table: &TableName, ci: &CaptureInstance) {
    let expected = table_rows(src, table, &ci.columns).await;
    let got = delta_rows(&steps.location("bronze"), &ci.columns, "_operation = 0", None).await;
    assert_same_rows(&format!("bronze's snapshot of {table}"), &expected, &got);
}

/// The test URL with another login in it (`mssql://USER@…` only).
fn url_for_user(url: &str, user: &str) -> String {
    let rest = url
        .strip_prefix("mssql://")
        .unwrap_or_else(|| panic!("the least-privilege test needs MSSQL_CDC_TEST_URL as an mssql:// URL, got an ADO string"));
    let at = rest.find('@').unwrap_or_else(|| panic!("expected USER@ in MSSQL_CDC_TEST_URL"));
    format!("mssql://{user}@{}", &rest[at + 1..])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn every_method_against_a_server() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    let name = format!("cdc_it_{}", uuid::Uuid::new_v4().simple().to_string().get(..8).unwrap_or("x"));
    let table = TableName::new("dbo", &name);
    exec(&mut a, "IF (SELECT is_cdc_enabled FROM sys.databases WHERE name = DB_NAME()) = 0 EXEC sys.sp_cdc_enable_db").await;
    exec(
        &mut a,
        &format!(
            "CREATE TABLE dbo.[{name}] (id int NOT NULL PRIMARY KEY, region varchar(10) NULL, amount decimal(38,4) NULL, \
             price money NULL, note nvarchar(max) NULL, at datetime2(7) NULL, dto datetimeoffset(7) NULL, g uniqueidentifier NULL, \
             flag bit NULL, raw varbinary(16) NULL)"
        ),
    )
    .await;
    exec(&mut a, &format!("EXEC sys.sp_cdc_enable_table @source_schema = N'dbo', @source_name = N'{name}', @role_name = NULL")).await;
    exec(
        &mut a,
        &format!(
            "INSERT INTO dbo.[{name}] (id, region, amount, price, note, at, dto, g, flag, raw) \
             SELECT v.n, CASE WHEN v.n % 2 = 0 THEN 'even' ELSE 'odd' END, CAST(v.n AS decimal(38,4)) * 1000000000000.0001, \
             922337203685477.5807, N'Ünïcode ' + CAST(v.n AS nvarchar(10)), '2026-03-08T01:02:03.1234567', \
             '2026-03-08T01:02:03.1234567+05:30', NEWID(), 1, 0x00FF \
             FROM (SELECT TOP (50) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS v"
        ),
    )
    .await;
    exec(&mut a, &format!("UPDATE dbo.[{name}] SET region = 'changed' WHERE id = 3")).await;
    exec(&mut a, &format!("UPDATE dbo.[{name}] SET id = 105 WHERE id = 5")).await;
    exec(&mut a, &format!("DELETE FROM dbo.[{name}] WHERE id = 7")).await;

    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("connect");
    assert!(!src.describe().contains(&password));

    // Capture instances, then wait for the capture job to bring in all 54 change rows.
    let cis = src.capture_instances(&table).await.unwrap();
    assert_eq!(cis.len(), 1);
    let ci = &cis[0];
    assert_eq!(ci.index_columns, vec!["id".to_string()]);
    assert_eq!(ci.columns.len(), 10);
    assert_eq!(ci.column("PRICE").unwrap().sql_type, SqlType::Money);
    assert_eq!(ci.column("at").unwrap().sql_type, SqlType::DateTime2 { scale: 7 });
    let deadline = Instant::now() + Duration::from_secs(120);
    let (min, max, rows) = loop {
        let min = src.min_lsn(&ci.name).await.unwrap();
        let max = src.max_lsn().await.unwrap();
        if let (Some(min), Some(max)) = (min, max) {
            if min <= max {
                let rows = read_changes(&src, ci, min, max, RowFilter::All).await;
                if rows.len() >= 54 {
                    break (min, max, rows);
                }
            }
        }
        assert!(Instant::now() < deadline, "capture did not run within 2 minutes: is SQL Server Agent running?");
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    assert_eq!(src.min_lsn("no_such_instance").await.unwrap(), None);

    // Changes in order: 50 inserts, an update (4), the key update as delete + insert, a delete.
    assert!(rows.windows(2).all(|w| w[0].0 <= w[1].0), "changes out of LSN order");
    assert_eq!(rows.iter().filter(|r| r.1 == 2).count(), 51);
    assert!(rows.iter().any(|r| r.1 == 4 && r.2 == 3));
    let key_update: Vec<_> = rows.iter().filter(|r| r.2 == 5 || r.2 == 105).filter(|r| r.1 != 2 || r.2 == 105).collect();
    assert_eq!(key_update.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(), vec![(1, 5), (2, 105)]);
    assert_eq!(key_update[0].0, key_update[1].0, "the key update's rows share a commit LSN");
    let old = read_changes(&src, ci, min, max, RowFilter::AllUpdateOld).await;
    let upd: Vec<i32> = old.iter().filter(|r| r.2 == 3 && r.1 >= 3).map(|r| r.1).collect();
    assert_eq!(upd, vec![3, 4]);
    match src.changes(ci, max.increment(), max, RowFilter::All, 100).await {
        Err(SourceError::RangeUnavailable { capture_instance, .. }) => assert_eq!(capture_instance, ci.name),
        Err(e) => panic!("expected RangeUnavailable, got {e}"),
        Ok(_) => panic!("expected RangeUnavailable for from > to"),
    }

    // LSN arithmetic and the time mapping.
    assert_eq!(src.increment_lsn(max).await.unwrap(), max.increment());
    assert_eq!(src.decrement_lsn(max).await.unwrap(), max.decrement());
    let t = src.lsn_to_time(max).await.unwrap().expect("max LSN has a commit time");
    assert_eq!(src.time_to_lsn(TimeOp::LargestLessThanOrEqual, t).await.unwrap(), Some(max));
    let earlier = src.time_to_lsn(TimeOp::LargestLessThan, t).await.unwrap();
    assert!(earlier.is_none_or(|l| l < max));
    let ge = src.time_to_lsn(TimeOp::SmallestGreaterThanOrEqual, t).await.unwrap().unwrap();
    assert!(ge <= max);
    assert_eq!(src.time_to_lsn(TimeOp::SmallestGreaterThan, t + chrono::Duration::days(1)).await.unwrap(), None);
    assert_eq!(src.lsn_to_time(Lsn::from_parts(1, 0, 0)).await.unwrap(), None);
    match src.server_time_zone().await {
        Ok(z) => println!("server zone: {} ({:?})", z.name, z.kind),
        Err(SourceError::Config(m)) => println!("server zone not known: {m}"),
        Err(e) => panic!("{e}"),
    }

    // Catalog and planning.
    let info = src.table_info(&table).await.unwrap();
    assert_eq!(info.unique_key, vec!["id".to_string()]);
    assert_eq!(info.columns.len(), 10);
    assert!(matches!(src.table_info(&TableName::new("dbo", "no such table ]")).await, Err(SourceError::Config(_))));
    let keys = vec!["id".to_string()];
    let rc = Isolation::ReadCommitted;
    let (lo, hi) = src.key_extent(&table, &keys, rc).await.unwrap().unwrap();
    assert_eq!((lo.clone(), hi.clone()), (vec![SqlValue::Int(1)], vec![SqlValue::Int(105)]));
    let counts = src.slice_counts(&table, "id", 1, 105, 10, rc).await.unwrap();
    assert_eq!(counts.iter().map(|c| c.1).sum::<u64>(), 49);
    assert_eq!(counts[0], (1, 8)); // 1..10 less 5 (now 105) and 7 (deleted)
    assert_eq!(src.slice_extent(&table, "id", 1, 10, rc).await.unwrap(), Some((1, 10)));
    assert_eq!(src.slice_extent(&table, "id", 5, 7, rc).await.unwrap(), Some((6, 6)));
    assert_eq!(src.key_seek(&table, &keys, &KeyRange::all(), 0, rc).await.unwrap(), Some(vec![SqlValue::Int(1)]));
    let k1 = src.key_seek(&table, &keys, &KeyRange::all(), 15, rc).await.unwrap().unwrap();
    let k2 = src.key_seek(&table, &keys, &KeyRange { lo: Some(k1.clone()), hi: None }, 15, rc).await.unwrap().unwrap();
    assert_eq!(src.key_seek(&table, &keys, &KeyRange::all(), 49, rc).await.unwrap(), None);
    let _ = src.row_estimate(&table).await.unwrap();

    // Snapshot reads of three ranges tile the table, under both isolation levels.
    for isolation in [Isolation::ReadCommitted, Isolation::Snapshot] {
        let mut seen = BTreeSet::new();
        let mut total = 0;
        for range in [
            KeyRange { lo: None, hi: Some(k1.clone()) },
            KeyRange { lo: Some(k1.clone()), hi: Some(k2.clone()) },
            KeyRange { lo: Some(k2.clone()), hi: None },
        ] {
            let read = SnapshotRead { table: table.clone(), columns: ci.columns.clone(), keys: keys.clone(), range, isolation, batch_rows: 8 };
            let stream = match src.snapshot_read(&read).await {
                Ok(s) => s,
                Err(SourceError::Config(m)) if isolation == Isolation::Snapshot => {
                    println!("SNAPSHOT not allowed here: {m}");
                    break;
                }
                Err(e) => panic!("{e}"),
            };
            let batches: Vec<_> = stream.try_collect().await.unwrap();
            for b in &batches {
                assert!(b.num_rows() <= 8);
                let ids = b.column_by_name("id").unwrap();
                for r in 0..b.num_rows() {
                    total += 1;
                    assert!(seen.insert(value_at(ids.as_ref(), r, &SqlType::Int).as_i64().unwrap()), "a row in two ranges");
                }
            }
        }
        if total > 0 {
            assert_eq!(total, 49);
        }
    }

    drop(src);
    exec(&mut a, &format!("EXEC sys.sp_cdc_disable_table @source_schema = N'dbo', @source_name = N'{name}', @capture_instance = N'all'")).await;
    exec(&mut a, &format!("DROP TABLE dbo.[{name}]")).await;
}

/// Columns the catalog must never lose or pass off as something else: a
/// `geography` column (system_type_id 240) and a computed column, each
/// captured, make `capture_instances` refuse the instance by the column's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn captured_columns_that_cannot_be_replicated_are_refused() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    exec(&mut a, "IF (SELECT is_cdc_enabled FROM sys.databases WHERE name = DB_NAME()) = 0 EXEC sys.sp_cdc_enable_db").await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    for (column_sql, column) in [("shape geography NULL", "shape"), ("total AS (id * 2)", "total")] {
        let name = format!("cdc_cat_{}", uuid::Uuid::new_v4().simple().to_string().get(..8).unwrap_or("x"));
        exec(&mut a, &format!("CREATE TABLE dbo.[{name}] (id int NOT NULL PRIMARY KEY, {column_sql})")).await;
        exec(&mut a, &format!("EXEC sys.sp_cdc_enable_table @source_schema = N'dbo', @source_name = N'{name}', @role_name = NULL")).await;
        let got = src.capture_instances(&TableName::new("dbo", &name)).await;
        exec(&mut a, &format!("EXEC sys.sp_cdc_disable_table @source_schema = N'dbo', @source_name = N'{name}', @capture_instance = N'all'")).await;
        exec(&mut a, &format!("DROP TABLE dbo.[{name}]")).await;
        match got {
            Err(SourceError::Config(m)) => assert!(m.contains(&format!("'{column}'")), "{m}"),
            other => panic!("{column_sql}: expected a refusal naming '{column}', got {other:?}"),
        }
    }
}

/// Key order under real collations: the server's answers to `compare_keys`
/// (case-sensitive, width-insensitive, padded strings; binary values padded
/// with 0x00), and a seek past MAX on a non-unique string column whose MAX
/// has a width-insensitive twin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn key_order_follows_each_columns_collation() {
    use std::cmp::Ordering::*;
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    let name = format!("cdc_coll_{}", uuid::Uuid::new_v4().simple().to_string().get(..8).unwrap_or("x"));
    exec(
        &mut a,
        &format!(
            "CREATE TABLE dbo.[{name}] (id int NOT NULL PRIMARY KEY, cs nvarchar(10) COLLATE Latin1_General_CS_AS NULL, \
             ci nvarchar(10) COLLATE SQL_Latin1_General_CP1_CI_AS NULL, b varbinary(8) NULL); \
             INSERT INTO dbo.[{name}] VALUES (1, N'a', N'z', 0x01), (2, N'A', N'\u{ff5a}', 0x0100), (3, N'b', N'y', 0x00)"
        ),
    )
    .await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let t = TableName::new("dbo", &name);
    let s = |x: &str| vec![SqlValue::Str(x.into())];
    let cs = src.compare_keys(&t, &["cs".into()], &[(s("a"), s("A")), (s("a"), s("a  ")), (s("a"), s("B"))]).await;
    let ci = src.compare_keys(&t, &["ci".into()], &[(s("z"), s("\u{ff5a}")), (s("Z"), s("z")), (s("\u{e9}"), s("f"))]).await;
    let b = src
        .compare_keys(&t, &["b".into()], &[(vec![SqlValue::Bytes(vec![1])], vec![SqlValue::Bytes(vec![1, 0])]), (vec![SqlValue::Bytes(vec![0])], vec![SqlValue::Bytes(vec![1])])])
        .await;
    let max = src.key_extent(&t, &["ci".into()], Isolation::ReadCommitted).await;
    exec(&mut a, &format!("DROP TABLE dbo.[{name}]")).await;
    let cs = cs.expect("compare under Latin1_General_CS_AS");
    assert_ne!(cs[0], Equal, "case counts under _CS");
    assert_eq!(cs[1], Equal, "trailing spaces never count");
    assert_eq!(cs[2], Less, "linguistic order: a < B");
    assert_eq!(ci.expect("compare under SQL_Latin1_General_CP1_CI_AS"), vec![Equal, Equal, Less], "width and case do not count; é < f");
    assert_eq!(b.expect("compare varbinary"), vec![Equal, Less], "binary values are padded with 0x00");
    let (_, max) = max.expect("key extent").expect("rows");
    assert!(matches!(&max[0], SqlValue::Str(v) if v == "z" || v == "\u{ff5a}"), "MAX is one of the twins: {max:?}");
}

/// Issue 12 §6: on SQL Server 2017 and later every change row carries
/// `__$command_id` (read from the change table), and within a commit the
/// stream's order follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn command_id_is_read_on_2017_and_later() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    let major = scalar(&mut a, "SELECT CAST(SERVERPROPERTY('ProductMajorVersion') AS bigint)").await.unwrap_or(0);
    assert!(major >= 14, "expected SQL Server 2017 (major version 14) or later for __$command_id, the server is version {major}");
    prepare(&mut a).await;
    let name = unique("cmd");
    exec(&mut a, &format!("CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, v int NULL)")).await;
    let ci_name = enable_cdc(&mut a, &name).await;
    exec(
        &mut a,
        &format!(
            "BEGIN TRANSACTION; INSERT INTO {SCHEMA}.[{name}] VALUES (1, 1), (2, 2), (3, 3); \
             UPDATE {SCHEMA}.[{name}] SET v = 20 WHERE id = 2; DELETE FROM {SCHEMA}.[{name}] WHERE id = 3; COMMIT"
        ),
    )
    .await;
    wait_for_capture(&mut a, &ci_name, 6).await; // 3 inserts, an update's two rows, a delete
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    let min = src.min_lsn(&ci.name).await.unwrap().expect("a min LSN");
    let max = src.max_lsn().await.unwrap().expect("a max LSN");
    let batches: Vec<RecordBatch> = src.changes(&ci, min, max, RowFilter::All, 100).await.expect("changes").try_collect().await.expect("change batches");
    drop(src);
    drop_table(&mut a, &name).await;
    let mut seen = Vec::new();
    for b in &batches {
        let cmd = b.column_by_name(CHANGE_COMMAND_ID).expect("__$command_id in the change batch");
        let cmd = cmd.as_any().downcast_ref::<Int32Array>().expect("__$command_id is Int32");
        let lsn = b.column_by_name(CHANGE_START_LSN).unwrap().as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap().clone();
        for r in 0..b.num_rows() {
            assert!(cmd.is_valid(r), "expected a non-NULL __$command_id on every change row of a 2017+ change table (row {r})");
            seen.push((lsn.value(r).to_vec(), cmd.value(r)));
        }
    }
    assert_eq!(seen.len(), 5, "expected 5 change rows (3 inserts, 1 update after-image, 1 delete), got {}", seen.len());
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "expected the changes ordered by (start LSN, command id): {seen:?}");
}

/// Issue 12 §6: a set-based update of the primary key (`SET id = id + 1`
/// on several rows in one statement, which SQL Server logs as deletes and
/// inserts whose `__$seqval` order may put an insert before the delete of
/// the same key), streamed and applied, leaves silver equal to the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_set_based_key_update_streams_and_applies_to_silver_equal_to_the_table() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("keyupd");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, v nvarchar(20) NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, N'row ' + CAST(n AS nvarchar(10)) \
             FROM (SELECT TOP (10) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x"
        ),
    )
    .await;
    let ci_name = enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\n");
    steps.stream_until_caught_up().await;
    exec(&mut a, &format!("UPDATE {SCHEMA}.[{name}] SET id = id + 1 WHERE id >= 3")).await;
    wait_for_capture(&mut a, &ci_name, 16).await; // 8 deletes and 8 inserts
    steps.stream_until_caught_up().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    steps.apply_and_reconcile_clean().await;
    assert_silver_is_the_table(&src, &steps, &table, &ci, false).await;
    drop(src);
    drop_table(&mut a, &name).await;
}

/// Issue 12 §6: a captured `geography` column stops the stream with a
/// configuration error (exit 2) naming the column; it is never dropped silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_captured_geography_column_stops_the_stream_naming_it() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("geo");
    exec(&mut a, &format!("CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, shape geography NULL)")).await;
    enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\n");
    let (code, json, stderr) = steps.run(&["stream"]).await;
    drop_table(&mut a, &name).await;
    assert_eq!(code, Some(2), "expected exit 2 (configuration) for a captured geography column: {json}\n{stderr}");
    let msg = json["error"].as_str().unwrap_or_default();
    assert!(msg.contains("'shape'"), "expected the error to name the column 'shape': {msg}");
}

/// Issue 12 §6: a heap chunked on a string column whose MAX has a
/// width-insensitive twin (`z` and fullwidth `ｚ` under
/// SQL_Latin1_General_CP1_CI_AS): the chunked snapshot reads every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_heap_chunked_on_a_string_reads_every_row_once_with_a_width_twin_of_max() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("heapstr");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL, s nvarchar(10) COLLATE SQL_Latin1_General_CP1_CI_AS NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, NCHAR(97 + n % 25) \
             FROM (SELECT TOP (60) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x; \
             INSERT INTO {SCHEMA}.[{name}] VALUES (101, N'z'), (102, N'\u{ff5a}'), (103, N'z'), (104, N'\u{ff5a}'), (105, NULL)"
        ),
    )
    .await;
    enable_cdc(&mut a, &name).await;
    let steps = Steps::new(
        &url,
        &password,
        &name,
        "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nkeys = [\"s\"]\nchunk_rows = 4\nparallelism = 2\ntarget_wave_seconds = 0\n",
    );
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    assert_snapshot_is_the_table(&src, &steps, &table, &ci).await;
    drop(src);
    drop_table(&mut a, &name).await;
}

/// Issue 12 §6: an `int` key that reaches 2147483647: the chunked
/// snapshot's last bound (2147483648) is compared as bigint, so the plan,
/// every chunk read, apply and reconcile's bucket sums finish without error 8115.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn an_int_key_at_2147483647_completes_its_chunked_snapshot() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("intmax");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, v int NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, n FROM (SELECT TOP (30) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x; \
             INSERT INTO {SCHEMA}.[{name}] VALUES (2147483646, 1), (2147483647, 2), (-2147483648, 3)"
        ),
    )
    .await;
    let ci_name = enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 5\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    exec(&mut a, &format!("UPDATE {SCHEMA}.[{name}] SET v = 99 WHERE id = 2147483647")).await;
    wait_for_capture(&mut a, &ci_name, 1).await;
    steps.stream_until_caught_up().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    steps.apply_and_reconcile_clean().await;
    assert_silver_is_the_table(&src, &steps, &table, &ci, false).await;
    drop(src);
    drop_table(&mut a, &name).await;
}

/// Issue 12 §5 and §6: a login with exactly the grants docs/sqlserver.md
/// lists ("A read-only login"), and nothing on schema cdc: SELECT on the
/// captured columns only (the table has a `secret` column the instance does
/// not capture and the login may not read), SELECT on cdc.change_tables,
/// cdc.captured_columns, cdc.index_columns, cdc.lsn_time_mapping and the
/// instance's change function, SELECT on the four ordering columns of its
/// change table, and membership of its gating role. It runs stream,
/// backfill, apply and reconcile, and silver equals the table. Then each of
/// two grants is taken away in turn, and what the server answers is what the
/// simulator models: the change function revoked, `stream` exits 2 naming
/// the GRANT on it; out of the gating role, `fn_cdc_get_min_lsn` answers all
/// zeros and the client refuses the instance naming the ALTER ROLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_least_privilege_login_streams_and_backfills() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("lp");
    let login = unique("cdc_it_reader");
    let role = unique("cdc_it_gate");
    let login_password = format!("Rd!{}aA9", uuid::Uuid::new_v4().simple());
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, v nvarchar(20) NULL, secret nvarchar(20) NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, N'v', N's' FROM (SELECT TOP (25) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x"
        ),
    )
    .await;
    // A gating role (sp_cdc_enable_table creates it) and a captured column list without `secret`.
    exec(
        &mut a,
        &format!(
            "EXEC sys.sp_cdc_enable_table @source_schema = N'{SCHEMA}', @source_name = N'{name}', @role_name = N'{role}', \
             @captured_column_list = N'id, v'"
        ),
    )
    .await;
    let ci_name = format!("{SCHEMA}_{name}");
    exec(
        &mut a,
        &format!(
            "CREATE LOGIN [{login}] WITH PASSWORD = N'{login_password}', CHECK_POLICY = OFF; CREATE USER [{login}] FOR LOGIN [{login}]; \
             GRANT SELECT ON OBJECT::{SCHEMA}.[{name}] ([id], [v]) TO [{login}]; \
             GRANT SELECT ON OBJECT::cdc.change_tables TO [{login}]; \
             GRANT SELECT ON OBJECT::cdc.captured_columns TO [{login}]; \
             GRANT SELECT ON OBJECT::cdc.index_columns TO [{login}]; \
             GRANT SELECT ON OBJECT::cdc.lsn_time_mapping TO [{login}]; \
             GRANT SELECT ON OBJECT::cdc.[fn_cdc_get_all_changes_{ci_name}] TO [{login}]; \
             GRANT SELECT ON OBJECT::cdc.[{ci_name}_CT] ([__$start_lsn], [__$seqval], [__$operation], [__$command_id]) TO [{login}]; \
             ALTER ROLE [{role}] ADD MEMBER [{login}]"
        ),
    )
    .await;
    let reader_url = url_for_user(&url, &login);
    let steps = Steps::new(&reader_url, &login_password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 6\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    exec(&mut a, &format!("INSERT INTO {SCHEMA}.[{name}] VALUES (100, N'new', N's'); UPDATE {SCHEMA}.[{name}] SET v = N'upd' WHERE id = 3; DELETE FROM {SCHEMA}.[{name}] WHERE id = 4")).await;
    wait_for_capture(&mut a, &ci_name, 3).await;
    steps.stream_until_caught_up().await;
    let src = MssqlSource::connect(&reader_url, SourceSecrets { password: Some(login_password.clone()) }).await.expect("the reader logs in");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    assert_eq!(ci.columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["id", "v"], "the instance captures id and v only");
    steps.apply_and_reconcile_clean().await;
    assert_silver_is_the_table(&src, &steps, &table, &ci, false).await;

    // Least means least: the column no step needs stays closed (error 230).
    let secret = SnapshotRead {
        table: table.clone(),
        columns: vec![ColumnDesc::new("secret", SqlType::NVarChar { len: Some(20) }, true)],
        keys: vec![],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 100,
    };
    let denied = match src.snapshot_read(&secret).await {
        Ok(s) => s.try_collect::<Vec<_>>().await.err(),
        Err(e) => Some(e),
    };
    assert!(
        matches!(&denied, Some(SourceError::Permission(m)) if m.contains(&format!("GRANT SELECT ON OBJECT::[{SCHEMA}].[{name}] ([secret]) TO [{login}]"))),
        "expected error 230 naming the grant on secret: {denied:?}"
    );

    // The change function revoked: the next change read is error 229 naming it.
    exec(&mut a, &format!("REVOKE SELECT ON OBJECT::cdc.[fn_cdc_get_all_changes_{ci_name}] FROM [{login}]")).await;
    exec(&mut a, &format!("UPDATE {SCHEMA}.[{name}] SET v = N'again' WHERE id = 5")).await;
    // The 4 change rows before (an insert, an update's two images, a delete) and this update's two.
    wait_for_capture(&mut a, &ci_name, 6).await;
    let (code, json, stderr) = steps.run(&["stream"]).await;
    let grant = format!("GRANT SELECT ON OBJECT::[cdc].[fn_cdc_get_all_changes_{ci_name}] TO [{login}]");
    assert_eq!(code, Some(2), "expected stream to stop with exit 2: {json}\n{stderr}");
    assert!(json["error"].as_str().is_some_and(|m| m.contains(&grant)), "expected the error to name {grant}: {json}");
    exec(&mut a, &format!("GRANT SELECT ON OBJECT::cdc.[fn_cdc_get_all_changes_{ci_name}] TO [{login}]")).await;

    // Out of the gating role: CDC closes the instance (fn_cdc_get_min_lsn answers all zeros), and the client says so.
    exec(&mut a, &format!("ALTER ROLE [{role}] DROP MEMBER [{login}]")).await;
    let closed = MssqlSource::connect(&reader_url, SourceSecrets { password: Some(login_password.clone()) }).await.expect("the reader logs in");
    instance(&closed, &table).await;
    let e = closed.min_lsn(&ci_name).await.expect_err("the instance is closed to a login outside its gating role");
    assert!(matches!(&e, SourceError::Permission(m) if m.contains(&format!("ALTER ROLE [{role}] ADD MEMBER [{login}]"))), "{e}");
    drop(closed);

    drop(src);
    drop_table(&mut a, &name).await;
    exec(&mut a, &format!("DROP USER [{login}]; IF DATABASE_PRINCIPAL_ID(N'{role}') IS NOT NULL DROP ROLE [{role}]")).await;
    // The reader's sessions end as their connections close; the login can go once they have.
    let mut dropped = Err(String::new());
    for _ in 0..20 {
        dropped = match a.simple_query(format!("DROP LOGIN [{login}]")).await {
            Ok(q) => q.into_results().await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if dropped.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    dropped.unwrap_or_else(|e| panic!("expected to drop the test login {login}: {e}"));
}

/// 28.135: a composite key with a varchar column, chunked, streamed
/// (value updates, a key update, a delete, an insert), applied and reconciled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn composite_varchar_keys_chunk_stream_apply_and_reconcile() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("comp");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (region varchar(10) COLLATE SQL_Latin1_General_CP1_CI_AS NOT NULL, n int NOT NULL, v int NULL, \
             PRIMARY KEY (region, n)); \
             INSERT INTO {SCHEMA}.[{name}] SELECT r.region, x.n, x.n * 10 FROM (VALUES ('east'), ('North'), ('south'), ('West')) AS r(region) \
             CROSS JOIN (SELECT TOP (9) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x"
        ),
    )
    .await;
    let ci_name = enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 7\nparallelism = 2\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    exec(
        &mut a,
        &format!(
            "UPDATE {SCHEMA}.[{name}] SET v = -1 WHERE n = 2; UPDATE {SCHEMA}.[{name}] SET region = 'zulu' WHERE region = 'east' AND n = 1; \
             DELETE FROM {SCHEMA}.[{name}] WHERE region = 'West' AND n = 9; INSERT INTO {SCHEMA}.[{name}] VALUES ('middle', 1, 1)"
        ),
    )
    .await;
    // 4 updates (before and after image each), a key update (delete and insert), a delete, an insert.
    wait_for_capture(&mut a, &ci_name, 12).await;
    steps.stream_until_caught_up().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    assert_eq!(ci.index_columns, vec!["region".to_string(), "n".to_string()], "expected the composite key as the instance's index columns");
    steps.apply_and_reconcile_clean().await;
    assert_silver_is_the_table(&src, &steps, &table, &ci, false).await;
    drop(src);
    drop_table(&mut a, &name).await;
}

/// 28.135: a writer holds a row lock in another session; a locking READ
/// COMMITTED chunk read waits behind it (backfill has not finished while the
/// lock is held), then completes once the writer commits, with the
/// committed value in bronze.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_chunk_read_waits_behind_a_writers_lock_then_completes() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let rcsi = scalar(&mut a, "SELECT CAST(is_read_committed_snapshot_on AS bigint) FROM sys.databases WHERE name = DB_NAME()").await;
    assert_eq!(
        rcsi,
        Some(0),
        "expected READ_COMMITTED_SNAPSHOT off in the test database (a locking READ COMMITTED read is what this test checks): \
         ALTER DATABASE CURRENT SET READ_COMMITTED_SNAPSHOT OFF"
    );
    let name = unique("lock");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, v int NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, n FROM (SELECT TOP (40) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x"
        ),
    )
    .await;
    enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 10\nparallelism = 1\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await; // opens the chunked snapshot; the open reads no rows
    let mut writer = admin(&url, &password).await;
    exec(&mut writer, &format!("BEGIN TRANSACTION; UPDATE {SCHEMA}.[{name}] SET v = -5 WHERE id = 5")).await;
    let started = Instant::now();
    let backfill = tokio::spawn(run_cli(steps.wf.clone(), steps.password.clone(), vec!["backfill".into()]));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let waited = !backfill.is_finished();
    exec(&mut writer, "COMMIT TRANSACTION").await;
    let (code, json, stderr) = backfill.await.expect("the backfill task");
    assert!(waited, "expected backfill to wait behind the writer's uncommitted row lock, but it finished first: {json}\n{stderr}");
    assert_eq!(code, Some(0), "expected the backfill that waited to succeed once the lock went: {json}\n{stderr}");
    assert!(started.elapsed() >= Duration::from_secs(6), "expected the backfill to take at least the 6 s the lock was held");
    steps.backfill_until_done().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    assert_snapshot_is_the_table(&src, &steps, &table, &ci).await;
    drop(src);
    drop(writer);
    drop_table(&mut a, &name).await;
}

/// 28.135: under SNAPSHOT isolation (ALLOW_SNAPSHOT_ISOLATION on, turned
/// on here if it is off), reads do not wait behind a writer's uncommitted
/// change and see the committed rows; a chunked backfill under
/// `--isolation snapshot` reads every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn snapshot_isolation_reads_committed_rows_without_waiting_for_a_writer() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let enable = "IF (SELECT snapshot_isolation_state FROM sys.databases WHERE name = DB_NAME()) = 0 \
                  ALTER DATABASE CURRENT SET ALLOW_SNAPSHOT_ISOLATION ON";
    if let Err(e) = async { Ok::<_, tiberius::error::Error>(a.simple_query(enable).await?.into_results().await?) }.await {
        panic!("this test needs SNAPSHOT isolation: run ALTER DATABASE <db> SET ALLOW_SNAPSHOT_ISOLATION ON as a login that may (the test's login could not: {e})");
    }
    let name = unique("snap");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, v int NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, n FROM (SELECT TOP (30) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x"
        ),
    )
    .await;
    enable_cdc(&mut a, &name).await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    let committed = table_rows(&src, &table, &ci.columns).await;
    let mut writer = admin(&url, &password).await;
    exec(&mut writer, &format!("BEGIN TRANSACTION; UPDATE {SCHEMA}.[{name}] SET v = -5 WHERE id = 5")).await;
    let read = SnapshotRead {
        table: table.clone(),
        columns: ci.columns.clone(),
        keys: vec!["id".into()],
        range: KeyRange { lo: Some(vec![SqlValue::Int(1)]), hi: None },
        isolation: Isolation::Snapshot,
        batch_rows: 7,
    };
    let under_lock = tokio::time::timeout(Duration::from_secs(20), async {
        let batches: Vec<RecordBatch> = src.snapshot_read(&read).await?.try_collect().await?;
        let extent = src.key_extent(&table, &["id".into()], Isolation::Snapshot).await?;
        let counts = src.slice_counts(&table, "id", 1, 30, 10, Isolation::Snapshot).await?;
        Ok::<_, SourceError>((batches, extent, counts))
    })
    .await;
    exec(&mut writer, "ROLLBACK TRANSACTION").await;
    let (batches, extent, counts) = under_lock
        .expect("expected SNAPSHOT reads not to wait behind the writer's lock (they did not finish within 20 s)")
        .unwrap_or_else(|e| panic!("expected SNAPSHOT reads to succeed: {e}"));
    let names: Vec<String> = ci.columns.iter().map(|c| c.name.clone()).collect();
    let mut got: Vec<String> = batches.iter().flat_map(|b| render(b, &names, None)).collect();
    got.sort();
    assert_same_rows("a SNAPSHOT read beside an uncommitted update (expected the committed values)", &committed, &got);
    assert_eq!(extent, Some((vec![SqlValue::Int(1)], vec![SqlValue::Int(30)])), "expected the key extent 1..30 under SNAPSHOT");
    assert_eq!(counts, vec![(1, 10), (11, 10), (21, 10)], "expected slice counts of 10 per slice under SNAPSHOT");
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 8\nisolation = \"snapshot\"\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    assert_snapshot_is_the_table(&src, &steps, &table, &ci).await;
    drop(src);
    drop(writer);
    drop_table(&mut a, &name).await;
}

/// 28.135: datetime2(7) at its MAX (9999-12-31 23:59:59.9999999) as the
/// chunk key: the plan's last bound lies past MAX, so every row is read
/// once; changes to and from MAX stream and apply, and reconcile is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn datetime2_at_its_max_chunks_streams_and_applies() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("dt2max");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, at datetime2(7) NOT NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, DATEADD(DAY, n * 300, CAST('2000-01-01T00:00:00.1234567' AS datetime2(7))) \
             FROM (SELECT TOP (12) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x; \
             INSERT INTO {SCHEMA}.[{name}] VALUES (13, '9999-12-31T23:59:59.9999999'), (14, '9999-12-31T23:59:59.9999999'), \
             (15, '9999-12-31T23:59:59.9999990'), (16, '0001-01-01T00:00:00.0000000')"
        ),
    )
    .await;
    let ci_name = enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nkeys = [\"at\"]\nchunk_rows = 4\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    assert_snapshot_is_the_table(&src, &steps, &table, &ci).await;
    exec(
        &mut a,
        &format!(
            "INSERT INTO {SCHEMA}.[{name}] VALUES (17, '9999-12-31T23:59:59.9999999'); \
             UPDATE {SCHEMA}.[{name}] SET at = '9999-12-31T23:59:59.9999999' WHERE id = 1; \
             UPDATE {SCHEMA}.[{name}] SET at = '2026-03-08T02:30:00' WHERE id = 13"
        ),
    )
    .await;
    wait_for_capture(&mut a, &ci_name, 3).await;
    steps.stream_until_caught_up().await;
    steps.apply_and_reconcile_clean().await;
    assert_silver_is_the_table(&src, &steps, &table, &ci, false).await;
    drop(src);
    drop_table(&mut a, &name).await;
}

/// 28.135: a skewed BIGINT key (200 small keys, three next to
/// 9223372036854775807): the plan's grid, the chunk reads and reconcile's
/// bucket sums near the top of the type complete and read every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_skewed_bigint_key_chunks_every_row_once() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("skew");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id bigint NOT NULL PRIMARY KEY, v int NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, 1 FROM (SELECT TOP (200) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x; \
             INSERT INTO {SCHEMA}.[{name}] VALUES (9223372036854775807, 2), (9223372036854775806, 3), (9223372036854775000, 4)"
        ),
    )
    .await;
    let ci_name = enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 20\nparallelism = 2\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    assert_snapshot_is_the_table(&src, &steps, &table, &ci).await;
    exec(&mut a, &format!("DELETE FROM {SCHEMA}.[{name}] WHERE id = 9223372036854775806; UPDATE {SCHEMA}.[{name}] SET v = 9 WHERE id = 9223372036854775807")).await;
    wait_for_capture(&mut a, &ci_name, 2).await;
    steps.stream_until_caught_up().await;
    steps.apply_and_reconcile_clean().await;
    assert_silver_is_the_table(&src, &steps, &table, &ci, false).await;
    drop(src);
    drop_table(&mut a, &name).await;
}

/// 28.135: a heap (no unique index) with identical rows, chunked on an
/// integer column: fenced chunk reads, then inserts, an update and a delete
/// of identical rows, streamed with before-images; silver (a multiset) equals
/// the table and reconcile is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_heap_with_identical_rows_streams_and_applies_as_a_multiset() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("heap");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (grp int NULL, note varchar(10) NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT CASE WHEN n % 13 = 0 THEN NULL ELSE n % 6 END, 't' + CAST(n % 3 AS varchar(2)) \
             FROM (SELECT TOP (60) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x"
        ),
    )
    .await;
    let ci_name = enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nkeys = [\"grp\"]\nchunk_rows = 12\ntarget_wave_seconds = 0\n");
    steps.ok(&["stream"]).await;
    steps.backfill_until_done().await;
    exec(
        &mut a,
        &format!(
            "INSERT INTO {SCHEMA}.[{name}] VALUES (1, 't1'), (1, 't1'); \
             UPDATE TOP (1) {SCHEMA}.[{name}] SET note = 'changed' WHERE grp = 2; \
             DELETE TOP (1) FROM {SCHEMA}.[{name}] WHERE grp = 3"
        ),
    )
    .await;
    wait_for_capture(&mut a, &ci_name, 5).await; // 2 inserts, before and after image, a delete
    steps.stream_until_caught_up().await;
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let table = TableName::new(SCHEMA, &name);
    let ci = instance(&src, &table).await;
    assert!(ci.index_columns.is_empty(), "expected a heap's capture instance to have no index columns");
    steps.apply_and_reconcile_clean().await;
    assert_silver_is_the_table(&src, &steps, &table, &ci, true).await;
    drop(src);
    drop_table(&mut a, &name).await;
}

/// 28.135: reconcile on a table with no changes since its snapshot was
/// applied finds no difference, twice, counting the table's rows on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn a_quiet_reconcile_reports_no_differences() {
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    prepare(&mut a).await;
    let name = unique("quiet");
    exec(
        &mut a,
        &format!(
            "CREATE TABLE {SCHEMA}.[{name}] (id int NOT NULL PRIMARY KEY, v decimal(18,2) NULL, note nvarchar(max) NULL); \
             INSERT INTO {SCHEMA}.[{name}] SELECT n, n * 1.25, REPLICATE(N'x', n) \
             FROM (SELECT TOP (50) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n FROM sys.all_objects) AS x"
        ),
    )
    .await;
    enable_cdc(&mut a, &name).await;
    let steps = Steps::new(&url, &password, &name, "[snapshot]\nbootstrap = true\n");
    steps.stream_until_caught_up().await;
    for run in 1..=2 {
        let r = steps.apply_and_reconcile_clean().await;
        assert_eq!((r["rows_source"].as_u64(), r["rows_target"].as_u64()), (Some(50), Some(50)), "run {run}: expected 50 rows on both sides: {r}");
        assert_eq!(r["buckets_mismatched"].as_u64(), Some(0), "run {run}: expected no mismatched bucket: {r}");
    }
    drop_table(&mut a, &name).await;
}

/// 25.35: the server's clock conversion for Eastern Standard Time across
/// the 2026 US clock changes (2026-03-08 07:00 UTC, 2026-11-01 06:00 UTC):
/// `server_local_times` (the conversion `seed --as-of` maps a time to an LSN
/// with) gives, for instants on each side of each change, the local time
/// the server's own `AT TIME ZONE 'Eastern Standard Time'` gives, and the
/// compiled-in rules (`ServerZone::to_local`, used for commit times read
/// back) agree. The server's zone must be Eastern: start the container
/// with `TZ=America/New_York` (docs/sqlserver.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a SQL Server with CDC: set MSSQL_CDC_TEST_URL and MSSQL_CDC_TEST_PASSWORD, run with --ignored"]
async fn eastern_time_to_local_mapping_across_the_2026_clock_changes_matches_the_server() {
    use chrono::{NaiveDate, NaiveDateTime, TimeZone, Utc};
    let (url, password) = server_under_test();
    let mut a = admin(&url, &password).await;
    let zone_row = a
        .simple_query("SELECT CAST(CURRENT_TIMEZONE_ID() AS nvarchar(100))")
        .await
        .unwrap_or_else(|e| panic!("CURRENT_TIMEZONE_ID() (SQL Server 2022): {e}"))
        .into_row()
        .await
        .unwrap_or_else(|e| panic!("CURRENT_TIMEZONE_ID(): {e}"));
    let zone_id: Option<String> = match &zone_row {
        Some(r) => r.get::<&str, _>(0).map(|z| z.to_string()),
        None => None,
    };
    assert_eq!(
        zone_id.as_deref(),
        Some("Eastern Standard Time"),
        "expected a server whose clock runs in Eastern Standard Time: start the container with -e TZ=America/New_York"
    );
    let at = |y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32| Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap();
    let local = |y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32| -> NaiveDateTime {
        NaiveDate::from_ymd_opt(y, mo, d).unwrap().and_hms_opt(h, mi, s).unwrap()
    };
    // (instant, the local time US rules give it)
    let cases = [
        (at(2026, 1, 15, 12, 0, 0), local(2026, 1, 15, 7, 0, 0)),
        (at(2026, 3, 8, 6, 30, 0), local(2026, 3, 8, 1, 30, 0)),
        (at(2026, 3, 8, 6, 59, 59), local(2026, 3, 8, 1, 59, 59)),
        (at(2026, 3, 8, 7, 0, 0), local(2026, 3, 8, 3, 0, 0)),
        (at(2026, 3, 8, 7, 30, 0), local(2026, 3, 8, 3, 30, 0)),
        (at(2026, 7, 1, 12, 0, 0), local(2026, 7, 1, 8, 0, 0)),
        (at(2026, 11, 1, 5, 30, 0), local(2026, 11, 1, 1, 30, 0)),
        (at(2026, 11, 1, 5, 59, 59), local(2026, 11, 1, 1, 59, 59)),
        (at(2026, 11, 1, 6, 0, 0), local(2026, 11, 1, 1, 0, 0)),
        (at(2026, 11, 1, 6, 30, 0), local(2026, 11, 1, 1, 30, 0)),
        (at(2026, 11, 1, 7, 0, 0), local(2026, 11, 1, 2, 0, 0)),
    ];
    let mut server = Vec::new();
    for (t, _) in &cases {
        let sql = format!(
            "SELECT CAST((CAST('{}' AS datetimeoffset(7)) AT TIME ZONE 'Eastern Standard Time') AS datetime2(7))",
            t.format("%Y-%m-%dT%H:%M:%S+00:00")
        );
        let row = a.simple_query(sql.as_str()).await.unwrap_or_else(|e| panic!("{sql}: {e}")).into_row().await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        let v: NaiveDateTime = row.and_then(|r| r.get::<NaiveDateTime, _>(0)).unwrap_or_else(|| panic!("{sql}: expected a datetime2"));
        server.push(v);
    }
    let src = MssqlSource::connect(&url, SourceSecrets { password: Some(password.clone()) }).await.expect("source connects");
    let zone = src.server_time_zone().await.expect("the server's zone");
    let instants: Vec<_> = cases.iter().map(|c| c.0).collect();
    let client = src.server_local_times(&instants).await.expect("server_local_times");
    for (i, (t, us_rules)) in cases.iter().enumerate() {
        assert_eq!(server[i], *us_rules, "expected the server's AT TIME ZONE 'Eastern Standard Time' to give {us_rules} for {t} (US rules)");
        assert_eq!(client[i], server[i], "expected server_local_times to give the server's {} for {t}", server[i]);
        assert_eq!(zone.to_local(*t), server[i], "expected the compiled-in rules of {} to give the server's {} for {t}", zone.name, server[i]);
    }
}
