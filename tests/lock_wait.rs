//! A chunk read behind a writer's lock (adr-0028: locking READ COMMITTED
//! makes a chunk wait behind writers; issue 12 §4: a blocked read fails as
//! transient and is read again). The simulator holds a writer's lock on the
//! table (`SimDb::hold_lock`) across processes; a locking read waits up to
//! its `lock_timeout_ms` and then fails with error 1222. `backfill` must read
//! the chunk again within the call once the lock is gone, and every row must
//! land in bronze once and in silver as the table has it. A SNAPSHOT read
//! does not wait at all.

mod common;

use std::time::{Duration, Instant};

use common::{cli, last_json_or_null as last_json, Scenario};
use deltalake::arrow::array::{Array, Int64Array};
use mssql_cdc::delta;
use mssql_cdc::sim::SimDb;

const CHUNKED: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 15\nparallelism = 2\n\
                       target_wave_seconds = 0\n[reconcile]\nbuckets = 8\nsample_fraction = 1.0\n";

async fn bronze_count(s: &Scenario, filter: &str) -> i64 {
    let ctx = s.context().await.unwrap();
    let b = delta::query(&ctx.bronze, &format!("SELECT COUNT(*) FROM t WHERE {filter}")).await.unwrap();
    b[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0)
}

fn silver_is_the_table(s: &Scenario, rt: &tokio::runtime::Runtime) {
    let out = cli(s, "apply");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    let out = cli(s, "reconcile");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(0), "{j}");
    assert_eq!((j["clean"].as_bool(), j["differences"].as_u64()), (Some(true), Some(0)), "{j}");
    // Bronze's image against the simulator's own rows, every column.
    let cmp = rt.block_on(s.verify());
    assert_eq!(cmp.differences(), 0, "bronze against the simulator's table: {:?}", cmp.samples);
}

#[test]
fn a_chunk_read_behind_a_writers_lock_fails_with_1222_and_is_read_again_once_the_lock_goes() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let s = Scenario::new(60, CHUNKED);
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    s.db.set_config_value("lock_timeout_ms", "300").unwrap();
    s.db.hold_lock(&s.table, "a writer's open transaction").unwrap();
    // The writer commits (lets go) 1.5 s into the call.
    let (path, table) = (s.db.path().to_path_buf(), s.table.clone());
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        SimDb::open(&path).unwrap().release_lock(&table).unwrap();
    });
    let started = Instant::now();
    let out = cli(&s, "backfill");
    let took = started.elapsed();
    release.join().unwrap();
    let j = last_json(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{j}\n{stderr}");
    assert_eq!(j["done"], true, "{j}");
    assert!(stderr.contains("1222"), "the blocked read failed with error 1222 and was read again: {stderr}");
    assert!(took >= Duration::from_millis(1500), "the call waited for the lock ({took:?})");
    assert_eq!(rt.block_on(bronze_count(&s, "_operation = 0")), 60, "every row read once");
    silver_is_the_table(&s, &rt);
}

#[test]
fn a_snapshot_isolation_chunk_read_does_not_wait_behind_a_writers_lock() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let s = Scenario::new(60, &CHUNKED.replace("target_wave_seconds = 0\n", "target_wave_seconds = 0\nisolation = \"snapshot\"\n"));
    s.db.set_config_value("allow_snapshot_isolation", "true").unwrap();
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    s.db.set_config_value("lock_timeout_ms", "300").unwrap();
    s.db.hold_lock(&s.table, "a writer's open transaction").unwrap();
    let out = cli(&s, "backfill");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{}\n{stderr}", last_json(&out));
    assert!(!stderr.contains("1222"), "a SNAPSHOT read reads row versions and never waits: {stderr}");
    s.db.release_lock(&s.table).unwrap();
    assert_eq!(rt.block_on(bronze_count(&s, "_operation = 0")), 60);
    silver_is_the_table(&s, &rt);
}

#[test]
fn a_lock_held_past_every_retry_exits_75_with_nothing_committed_and_the_rerun_completes() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let s = Scenario::new(30, CHUNKED);
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    // Each attempt waits 5 s; the chunk's retries give up a minute in.
    s.db.set_config_value("lock_timeout_ms", "5000").unwrap();
    s.db.hold_lock(&s.table, "a long transaction").unwrap();
    let out = cli(&s, "backfill");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(75), "{j}");
    assert!(j["error"].as_str().unwrap_or("").contains("1222"), "{j}");
    assert_eq!(rt.block_on(bronze_count(&s, "_operation = 0")), 0, "no chunk of a failed wave is committed");
    s.db.release_lock(&s.table).unwrap();
    let out = cli(&s, "backfill");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    assert_eq!(rt.block_on(bronze_count(&s, "_operation = 0")), 30);
    silver_is_the_table(&s, &rt);
}
