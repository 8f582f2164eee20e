//! The cached facts reader (`delta::facts_read`) returns what a SQL scan of
//! the same snapshot returns: after every commit, for every app id, with
//! files removed, with a second handle on an older snapshot reading in
//! between (which makes the cache forget files the newer one holds), and
//! after time travel back. The scan is DataFusion's over the Delta table,
//! which shares no code with the reader past the row decoding.

use std::collections::HashMap;

use chrono::{TimeZone, Utc};
use mssql_cdc::delta::{self, facts, facts::FactRow, facts_read, TableKind, Txn};
use mssql_cdc::lsn::Lsn;

fn row(app: &str, gen: i32, batch: i64, i: u32) -> FactRow {
    FactRow {
        app_id: app.to_string(),
        table: "dbo.orders".into(),
        target: "file:///tmp/bronze".into(),
        generation: gen,
        batch_id: Some(batch),
        event: (i % 3 == 0).then(|| "bootstrap".to_string()),
        capture_instance: Some("dbo_orders".into()),
        min_lsn: Some(Lsn::from_u128(u128::from(i) * 10)),
        max_lsn: Some(Lsn::from_u128(u128::from(i) * 10 + 9)),
        rows: Some(i64::from(i) * 7),
        duration_ms: (i % 2 == 0).then_some(12),
        commit_ts: Some(Utc.timestamp_micros(1_700_000_000_000_000 + i64::from(i)).unwrap()),
        source_max_lsn: None,
        retention_watermark_ts: None,
        headroom_seconds: Some(f64::from(i) / 3.0),
        lost_from_ts: None,
        lost_to_ts: None,
        bronze_version: Some(i64::from(i)),
        detail: (i % 4 == 1).then(|| serde_json::json!({"i": i, "why": "a test"})),
        recorded_at: Some(Utc.timestamp_micros(1_700_000_100_000_000 + i64::from(i)).unwrap()),
    }
}

fn key(r: &FactRow) -> String {
    serde_json::to_string(r).unwrap()
}

/// The reader's rows and the scan's, as sorted multisets, for each app id.
async fn agree(table: &deltalake::DeltaTable, apps: &[&str], at: &str) {
    for app in apps {
        let mut cached: Vec<String> = facts_read::rows_of(table, app).await.unwrap().iter().map(key).collect();
        let sql = format!("SELECT * FROM t WHERE app_id = {}", delta::sql_str(app));
        let mut scanned: Vec<String> = facts::from_batches(&delta::query(table, &sql).await.unwrap()).unwrap().iter().map(key).collect();
        cached.sort();
        scanned.sort();
        assert_eq!(cached, scanned, "{at}, app id {app}: the cached reader and the scan disagree");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cached_facts_reader_returns_what_a_scan_of_the_same_snapshot_returns() {
    let dir = tempfile::tempdir().unwrap();
    let location = format!("file://{}/facts", dir.path().display());
    let storage = HashMap::new();
    let mut table = delta::open_or_create(&location, &storage, TableKind::Facts, &facts::schema(), "facts of a test").await.unwrap();
    let apps = ["a", "b", "a.g1"];
    let mut versions = Vec::new();
    let mut i = 0u32;
    for batch in 0..12i64 {
        let mut rows = Vec::new();
        for app in &apps[..(batch as usize % 3) + 1] {
            i += 1;
            rows.push(row(app, (batch / 5) as i32, batch, i));
        }
        let txn = Txn::new("facts-read-test", batch);
        delta::append_batches(&mut table, vec![facts::to_batch(&rows)], facts::schema(), &txn, serde_json::json!({})).await.unwrap();
        versions.push(table.version().unwrap());
        agree(&table, &apps, &format!("after batch {batch}")).await;
    }
    let total: usize = facts_read::all_rows(&table).await.unwrap().len();
    assert_eq!(total, i as usize, "every row written is read");

    // A second handle on an older snapshot reads in between: the cache
    // forgets the newer files, and the newer handle decodes them again.
    let mut old = deltalake::open_table(url::Url::parse(&location).unwrap()).await.unwrap();
    old.load_version(versions[3]).await.unwrap();
    agree(&old, &apps, "an older snapshot").await;
    agree(&table, &apps, "the newest snapshot after an older one was read").await;

    // Files removed by a later commit are no longer returned.
    let removed = delta::remove_files_of_commit(&mut table, versions[4] as i64, serde_json::json!({})).await.unwrap();
    assert!(removed > 0, "the commit had files to remove");
    table.update_state().await.unwrap();
    agree(&table, &apps, "after a removal").await;
    let after: usize = facts_read::all_rows(&table).await.unwrap().len();
    assert!(after < total, "the removed commit's rows are gone: {after} of {total}");

    // The older handle still sees the removed files (time travel).
    agree(&old, &apps, "the older snapshot after the removal").await;
    agree(&table, &apps, "the newest snapshot at the end").await;
}
