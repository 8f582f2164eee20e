//! A seed that crashes between its bronze commit and its facts row is
//! finished by the next call, from the bronze commit's metadata. (Its own test
//! binary: failpoints are process-wide.)

mod common;

use common::Scenario;
use mssql_cdc::engine::seed::{self, AsOf, SeedArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_the_bronze_commit_then_rerun() {
    let _failpoints = fail::FailScenario::setup();
    let mut s = Scenario::new(20, "[snapshot]\nbootstrap = true\n");
    let recorded = s.db.max_lsn().unwrap().unwrap();
    s.changes(3);
    let copy = s.path().join("copy");
    let source = s.db.source().unwrap();
    let ci = mssql_cdc::source::CdcSource::capture_instances(&source, &s.table).await.unwrap().pop().unwrap();
    let rows = mssql_cdc::seed_copy::export_parquet(&source, &s.table, &ci.columns, &copy, 1000).await.unwrap() as i64;
    s.changes(3);
    common::settle(&s.db);
    let args = SeedArgs { copy: copy.to_string_lossy().into_owned(), as_of: AsOf::Lsn(recorded), reseed: false, allow_missing_columns: false };
    fail::cfg("seed.after_bronze", "1*return").unwrap();
    let e = seed::run(&mut s.context().await.unwrap(), &args).await.unwrap_err();
    assert!(e.to_string().contains("seed.after_bronze"), "{e}");
    fail::remove("seed.after_bronze");
    assert_eq!(s.count("bronze", "_operation = 0").await, rows);
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 0);
    let r = seed::run(&mut s.context().await.unwrap(), &args).await.unwrap();
    assert!(r.already_seeded && r.lsn == recorded && r.rows == rows, "{r:?}");
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1);
    assert_eq!(s.count("bronze", "_operation = 0").await, rows, "the rerun wrote no second copy");
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
}
