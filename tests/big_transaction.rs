//! A micro-batch must end on a transaction boundary, so one transaction of
//! many rows is read by one batch whatever `max_batch_rows` says (issue 12
//! §4). The batch must write that transaction to data files as it reads it,
//! not hold it in memory whole: these tests count the heap the `stream` call
//! takes while it reads such a transaction and compare it with what holding
//! the transaction's bronze rows would take.
//!
//! A binary of its own: its allocator counts every allocation of the
//! process, so nothing else may run beside the measured call (one test
//! function does every measurement in turn).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{item_row, Scenario};
use deltalake::arrow::array::Array;
use mssql_cdc::delta;

/// The system allocator, counting the bytes live now and the most live since
/// the last [`reset_peak`].
struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE_BYTES.fetch_add(by, Ordering::Relaxed) + by;
    PEAK_BYTES.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE_BYTES.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Starts a measurement: returns the bytes live now, and makes the peak that.
fn reset_peak() -> usize {
    let now = LIVE_BYTES.load(Ordering::Relaxed);
    PEAK_BYTES.store(now, Ordering::Relaxed);
    now
}

struct Measured {
    rows: i64,
    /// The most heap the `stream` call held above what was live before it.
    peak_growth_bytes: usize,
    /// What the batch's bronze rows take as Arrow arrays (read back after
    /// the call): what a batch that held the transaction whole would hold.
    held_bytes: usize,
    /// Data files the batch's bronze commit added, and their bytes.
    files: usize,
    file_bytes: i64,
}

/// Streams one transaction of `rows` inserts (with `max_batch_rows` far
/// below it) and measures that `stream` call.
async fn stream_one_transaction(rows: i64) -> Measured {
    let mut s = Scenario::new(10, "[snapshot]\nbootstrap = true\n[stream]\nmax_batch_rows = 1000\n");
    // No idle mapping rows: with the capture lag, one would land right
    // after the transaction, inside the measured call, as a second batch.
    s.db.set_config_value("idle_interval_seconds", "0").unwrap();
    s.stream_until_caught_up().await;
    let table = s.table.clone();
    let first = s.next_id;
    s.db.transaction(|tx| {
        for id in first..first + rows {
            tx.insert(&table, item_row(id, 1))?;
        }
        Ok(())
    })
    .unwrap();
    s.next_id += rows;
    // The simulator's capture job (which holds a transaction whole while it
    // logs it) runs before the measurement: it is the server's work, not the
    // step's.
    s.db.advance_clock(std::time::Duration::from_millis(common::CAPTURE_LAG_MS + 1_000)).unwrap();
    s.db.capture().unwrap();

    let before = reset_peak();
    let result = s.stream().await.unwrap();
    let peak_growth_bytes = PEAK_BYTES.load(Ordering::Relaxed).saturating_sub(before);

    assert_eq!(result.rows, rows, "one call reads the whole transaction");
    assert_eq!(result.batches, 1, "one transaction is one batch, past max_batch_rows: {result:?}");
    s.assert_matches_source().await;

    let ctx = s.context().await.unwrap();
    let newest = ctx.bronze.version().expect("bronze has commits");
    let held = delta::query(&ctx.bronze, "SELECT * FROM t WHERE _batch_id = (SELECT MAX(_batch_id) FROM t)").await.unwrap();
    let held_rows: usize = held.iter().map(|b| b.num_rows()).sum();
    assert_eq!(held_rows as i64, rows, "bronze's newest batch holds the transaction");
    let held_bytes = held.iter().map(|b| b.columns().iter().map(|c| c.get_array_memory_size()).sum::<usize>()).sum();
    let commit = std::fs::read_to_string(s.path().join(format!("bronze/_delta_log/{newest:020}.json"))).unwrap();
    let adds: Vec<serde_json::Value> = commit.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).filter_map(|v| v.get("add").cloned()).collect();
    let files = adds.len();
    let file_bytes = adds.iter().filter_map(|a| a.get("size").and_then(|x| x.as_i64())).sum();
    Measured { rows, peak_growth_bytes, held_bytes, files, file_bytes }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_streams_a_big_transaction_to_files_instead_of_holding_it() {
    // deltalake uploads a file in 5 MiB parts, up to ten at once: up to 50
    // MiB of a file in flight, which would hide below it whether the batch
    // holds its rows. One part at a time leaves only what the step holds.
    // (Read once, before the first writer: deltalake keeps it in a OnceLock.)
    std::env::set_var("DELTARS_MAX_CONCURRENCY_TASKS", "1");
    let small = stream_one_transaction(100_000).await;
    let big = stream_one_transaction(400_000).await;
    for m in [&small, &big] {
        eprintln!(
            "transaction of {} rows: the stream call's heap peak grew {:.1} MiB; its bronze rows take {:.1} MiB as Arrow arrays, {:.1} MiB in {} data file(s)",
            m.rows,
            m.peak_growth_bytes as f64 / 1048576.0,
            m.held_bytes as f64 / 1048576.0,
            m.file_bytes as f64 / 1048576.0,
            m.files
        );
    }
    // A batch that held the transaction would take at least 300,000 more
    // rows' Arrow size in the bigger case (measured so: 1.4 of it). One that
    // writes as it reads holds an open row group (delta::ROW_GROUP_TARGET_BYTES,
    // which the smaller case does not fill) and the parts of the file in
    // flight, whatever the transaction's size (measured: about 0.35 of it).
    let peak_more = big.peak_growth_bytes.saturating_sub(small.peak_growth_bytes);
    let held_more = big.held_bytes - small.held_bytes;
    eprintln!(
        "4x the rows: the peak grew {:.1} MiB more, the rows take {:.1} MiB more ({:.2} of it)",
        peak_more as f64 / 1048576.0,
        held_more as f64 / 1048576.0,
        peak_more as f64 / held_more as f64
    );
    assert!(
        peak_more < held_more * 6 / 10,
        "the stream call's heap peak grew by {peak_more} bytes more for 300,000 more rows (whose bronze rows take {held_more} bytes): \
         the batch holds the transaction instead of writing it as it reads"
    );
}
