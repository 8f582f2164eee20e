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
use std::time::{Duration, Instant};

use deltalake::arrow::array::{Array, FixedSizeBinaryArray};
use futures::TryStreamExt;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::mssql::{MssqlConfig, MssqlSource};
use mssql_cdc::source::{
    CdcSource, Isolation, KeyRange, RowFilter, SnapshotRead, SourceError, SourceSecrets, TableName, TimeOp, CHANGE_OPERATION,
    CHANGE_START_LSN,
};
use mssql_cdc::types::{value_at, SqlType, SqlValue};
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
