//! A chunk read behind a writer's lock (adr-0028: locking READ COMMITTED
//! makes a chunk wait behind writers; issue 12 §4: a blocked read fails as
//! transient and is read again). The simulator holds a writer's lock on the
//! table (`SimDb::hold_lock`) across processes; a locking read waits up to
//! its `lock_timeout_ms` and then fails with error 1222. `backfill` must read
//! the chunk again within the call once the lock is gone, and every row must
//! land in bronze once and in silver as the table has it. A SNAPSHOT read
//! does not wait at all.
//!
//! The planning reads the table as well (the open's MIN and MAX of the key,
//! the plan's slice counts, extents and seeks), and waits behind the same
//! lock under READ COMMITTED: a planning step that times out is a temporary
//! failure (exit 75) that records nothing, and the next call plans. The
//! chunk-read tests plan before the writer comes (`backfill --max-seconds 0`
//! plans and starts no wave), so what they hold up is the chunks.

mod common;

use std::process::Output;
use std::time::{Duration, Instant};

use common::{cli, cli_command, last_json_or_null as last_json, Scenario};
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

async fn facts_count(s: &Scenario, filter: &str) -> i64 {
    let ctx = s.context().await.unwrap();
    let b = delta::query(&ctx.facts, &format!("SELECT COUNT(*) FROM t WHERE {filter}")).await.unwrap();
    b[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0)
}

/// `backfill --max-seconds 0`: makes (or reads) the plan and starts no wave.
fn plan_only(s: &Scenario) -> Output {
    cli_command(&s.wf_path, &["backfill", "--max-seconds", "0"], &[]).output().unwrap()
}

fn assert_planned_without_reading(s: &Scenario, out: &Output, rt: &tokio::runtime::Runtime) {
    let j = last_json(out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{j}\n{stderr}");
    assert!(j["chunks_total"].as_u64().unwrap_or(0) > 1, "the plan cuts the table into chunks: {j}");
    assert_eq!((j["waves"].as_u64(), j["done"].as_bool()), (Some(0), Some(false)), "no wave was read: {j}");
    assert_eq!(rt.block_on(facts_count(s, "event = 'snapshot_plan'")), 1, "the plan is recorded");
    assert_eq!(rt.block_on(bronze_count(s, "_operation = 0")), 0, "no chunk is read yet");
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
    // Planned before the writer comes: the lock below holds up the chunks.
    assert_planned_without_reading(&s, &plan_only(&s), &rt);
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
    // Planned before the writer comes: what gives up below is the chunk's retries.
    assert_planned_without_reading(&s, &plan_only(&s), &rt);
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

/// The planning steps of a chunked snapshot read the table under locking
/// READ COMMITTED: the open (in `stream`) takes the key's MIN and MAX, the
/// plan (in `backfill`) counts the rows per slice of the key. Behind a
/// writer's lock each waits `lock_timeout_ms`, then fails with error 1222:
/// a temporary failure (exit 75) that records nothing (no open, no plan, no
/// row). Called again once the writer has let go, the step goes on, and the
/// snapshot that ends it is the table.
#[test]
fn chunk_planning_behind_a_writers_lock_exits_75_and_plans_once_the_lock_goes() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let s = Scenario::new(60, CHUNKED);
    s.db.set_config_value("lock_timeout_ms", "300").unwrap();
    s.db.hold_lock(&s.table, "a writer's open transaction").unwrap();
    // The open's MIN and MAX wait behind the writer, then fail.
    let out = cli(&s, "stream");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(75), "the open behind the lock is a temporary failure: {j}");
    assert!(j["error"].as_str().unwrap_or("").contains("1222"), "{j}");
    assert_eq!(rt.block_on(facts_count(&s, "event = 'snapshot_open'")), 0, "no open is recorded");
    s.db.release_lock(&s.table).unwrap();
    let out = cli(&s, "stream");
    assert_eq!(out.status.code(), Some(0), "{}", last_json(&out));
    assert_eq!(rt.block_on(facts_count(&s, "event = 'snapshot_open'")), 1, "the open is recorded once the lock is gone");
    // The plan's slice counts wait behind the next writer, then fail.
    s.db.hold_lock(&s.table, "another writer's open transaction").unwrap();
    let started = Instant::now();
    let out = plan_only(&s);
    let took = started.elapsed();
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(75), "the plan behind the lock is a temporary failure: {j}");
    assert!(j["error"].as_str().unwrap_or("").contains("1222"), "{j}");
    assert!(took >= Duration::from_millis(300), "the plan waited for the lock before it failed ({took:?})");
    assert_eq!(rt.block_on(facts_count(&s, "event = 'snapshot_plan'")), 0, "no plan is recorded");
    assert_eq!(rt.block_on(bronze_count(&s, "_operation = 0")), 0, "no chunk is read");
    s.db.release_lock(&s.table).unwrap();
    // Once the writer has let go the same call plans, and the next reads every chunk.
    assert_planned_without_reading(&s, &plan_only(&s), &rt);
    let out = cli(&s, "backfill");
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(0), "{j}");
    assert_eq!(j["done"], true, "{j}");
    assert_eq!(rt.block_on(facts_count(&s, "event = 'snapshot_plan'")), 1, "one plan");
    assert_eq!(rt.block_on(bronze_count(&s, "_operation = 0")), 60, "every row read once");
    silver_is_the_table(&s, &rt);
}

/// Under SNAPSHOT the same planning reads row versions: behind the same
/// writer's lock the open and the plan are made without waiting (and the
/// chunks are read without waiting, as above).
#[test]
fn chunk_planning_under_snapshot_isolation_does_not_wait_behind_a_writers_lock() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let s = Scenario::new(60, &CHUNKED.replace("target_wave_seconds = 0\n", "target_wave_seconds = 0\nisolation = \"snapshot\"\n"));
    s.db.set_config_value("allow_snapshot_isolation", "true").unwrap();
    s.db.set_config_value("lock_timeout_ms", "300").unwrap();
    s.db.hold_lock(&s.table, "a writer's open transaction").unwrap();
    let out = cli(&s, "stream");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{}\n{stderr}", last_json(&out));
    assert!(!stderr.contains("1222"), "the open's MIN and MAX read row versions and never wait: {stderr}");
    assert_eq!(rt.block_on(facts_count(&s, "event = 'snapshot_open'")), 1);
    let out = plan_only(&s);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("1222"), "the plan's counts read row versions and never wait: {stderr}");
    assert_planned_without_reading(&s, &out, &rt);
    let out = cli(&s, "backfill");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{}\n{stderr}", last_json(&out));
    assert_eq!(last_json(&out)["done"], true);
    s.db.release_lock(&s.table).unwrap();
    assert_eq!(rt.block_on(bronze_count(&s, "_operation = 0")), 60);
    silver_is_the_table(&s, &rt);
}
