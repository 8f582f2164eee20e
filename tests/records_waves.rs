//! The chunked backfill's wave pipeline against adr-0028 Amendment 3, rows
//! 28.94, 28.100 and 28.102 of docs/CONFORMANCE.md, on the simulator, with
//! the steps run in process:
//! - read-ahead is one wave: a chunk of wave n + 2 is never read before wave
//!   n is committed, and bronze takes the waves in order (28.94);
//! - a call's first wave takes the rounds its target holds at the last
//!   committed wave's pace, its read and its append per round (28.100);
//! - `max_seconds` is passed by at most the wave being read and the commit
//!   under way (28.102);
//! - a reader waiting for a commit exits when the call fails.
//!
//! A wrapper source (`Spy`) delegates to the simulator; for each chunk read
//! it records the chunk's lower bound and which waves bronze's Delta log held
//! committed when the read started, and it sleeps first (the first read of a
//! call long, every other briefly), so one reader is held in wave 0 while the
//! other runs on. Waves are one round (`target_wave_seconds = 0`) of two
//! chunks. Which wave a read belongs to comes from bronze's wave commits,
//! whose metadata names each chunk's bounds. No failpoint is armed (the file
//! runs in the shared `suite` binary).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use common::Scenario;
use deltalake::arrow::array::{Array, Int64Array};
use mssql_cdc::delta::{self, facts::FactRow};
use mssql_cdc::engine::chunked::{self, BackfillArgs, BackfillResult};
use mssql_cdc::engine;
use mssql_cdc::error::StepResult;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::source::{BatchStream, FencedRead, SharedSource, SnapshotRead, SourceError};
use serde_json::Value;

/// A chunked bootstrap read by two connections in waves of one round (two
/// chunks of at most 4 rows).
const TWO_READERS: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 4\ntarget_wave_seconds = 0\n\
                           [stream]\nmax_batch_rows = 1000\n";

/// A chunked bootstrap read by one connection, chunks of at most 2 rows.
const ONE_READER: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 1\nchunk_rows = 2\ntarget_wave_seconds = 0\n\
                          [stream]\nmax_batch_rows = 1000\n";

// ---------------------------------------------------------------------------
// The spy.

/// How the spy delays reads: the call's first read by `first` (and fails it
/// after that when `fail_first`), every other by `rest`.
#[derive(Debug, Clone, Copy)]
struct Delays {
    first: Duration,
    rest: Duration,
    fail_first: bool,
}

/// One chunk read the spy saw.
#[derive(Debug, Clone)]
struct Read {
    /// The chunk's lower bound as JSON, as bronze's wave commits name it.
    lo: String,
    /// The waves bronze's log held committed when the read started.
    committed: BTreeSet<i64>,
    started: Instant,
    /// When the spy's sleep ended and the simulator's read began.
    delayed_until: Instant,
}

struct Spy {
    bronze: PathBuf,
    delays: Delays,
    calls: AtomicUsize,
    reads: Mutex<Vec<Read>>,
}

impl Spy {
    async fn before_read(&self, read: &SnapshotRead) -> Result<(), SourceError> {
        let started = Instant::now();
        let committed = committed_waves(&self.bronze);
        let first = self.calls.fetch_add(1, Ordering::SeqCst) == 0;
        tokio::time::sleep(if first { self.delays.first } else { self.delays.rest }).await;
        let lo = serde_json::to_value(&read.range.lo).unwrap().to_string();
        self.reads.lock().unwrap().push(Read { lo, committed, started, delayed_until: Instant::now() });
        if first && self.delays.fail_first {
            return Err(SourceError::Other("the spy fails the call's first chunk read".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl common::Hooks for Spy {
    async fn snapshot_read(&self, inner: &SharedSource, read: &SnapshotRead) -> Result<BatchStream, SourceError> {
        self.before_read(read).await?;
        inner.snapshot_read(read).await
    }
    async fn snapshot_read_fenced(&self, inner: &SharedSource, read: &SnapshotRead) -> Result<FencedRead, SourceError> {
        self.before_read(read).await?;
        inner.snapshot_read_fenced(read).await
    }
}

/// One `backfill` call through the spy.
struct Run {
    result: StepResult<BackfillResult>,
    reads: Vec<Read>,
    /// Just before the call, on both clocks.
    started: Instant,
    started_at: SystemTime,
    elapsed: Duration,
}

async fn backfill_spied(s: &Scenario, delays: Delays, args: BackfillArgs) -> Run {
    let mut ctx = s.context().await.unwrap();
    let spy = Arc::new(common::Wrapped::new(ctx.source.clone(), Spy { bronze: s.path().join("bronze"), delays, calls: AtomicUsize::new(0), reads: Mutex::new(Vec::new()) }));
    ctx.source = spy.clone();
    let (started, started_at) = (Instant::now(), SystemTime::now());
    // A reader left waiting for a commit that never comes would hang the call.
    let result = tokio::time::timeout(Duration::from_secs(60), chunked::backfill(&mut ctx, &args))
        .await
        .expect("the call returns: no reader is left waiting for a commit");
    let elapsed = started.elapsed();
    let reads = spy.hooks.reads.lock().unwrap().clone();
    Run { result, reads, started, started_at, elapsed }
}

async fn backfill(s: &Scenario, args: BackfillArgs) -> BackfillResult {
    let mut ctx = s.context().await.unwrap();
    chunked::backfill(&mut ctx, &args).await.unwrap()
}

// ---------------------------------------------------------------------------
// Reading bronze's log and the facts.

/// A wave's commit in bronze's log.
#[derive(Debug, Clone)]
struct WaveCommit {
    version: u64,
    wave: i64,
    /// Its chunks' lower bounds (JSON text) -> chunk.
    chunks: BTreeMap<String, i64>,
    /// The commit file's write time.
    written: SystemTime,
}

/// The commit files of a Delta log: (version, path).
fn log_files(table: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(dir) = std::fs::read_dir(table.join("_delta_log")) else { return Vec::new() };
    let mut out: Vec<(u64, PathBuf)> = dir
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let v = p.file_name()?.to_str()?.strip_suffix(".json")?.parse::<u64>().ok()?;
            Some((v, p))
        })
        .collect();
    out.sort();
    out
}

/// The waves whose bronze commit (txn `items#snap.<S>`, version = the wave)
/// the log holds now. A commit file appears whole (written, then renamed).
fn committed_waves(bronze: &Path) -> BTreeSet<i64> {
    let mut out = BTreeSet::new();
    for (_, path) in log_files(bronze) {
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(action) = serde_json::from_str::<Value>(line) else { continue };
            if let Some(t) = action.get("txn") {
                if t["appId"].as_str().is_some_and(|a| a.starts_with("items#snap.")) {
                    out.insert(t["version"].as_i64().unwrap());
                }
            }
        }
    }
    out
}

/// Bronze's wave commits, oldest first.
fn wave_commits(bronze: &Path) -> Vec<WaveCommit> {
    let mut out = Vec::new();
    for (version, path) in log_files(bronze) {
        let text = std::fs::read_to_string(&path).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let action: Value = serde_json::from_str(line).unwrap();
            let Some(meta) = action.get("commitInfo").and_then(|ci| ci.get("mssql_cdc")) else { continue };
            if meta["kind"].as_str() != Some("snapshot_wave") {
                continue;
            }
            let chunks: BTreeMap<String, i64> = meta["chunks"].as_array().unwrap().iter().map(|c| (c["lo"].to_string(), c["chunk"].as_i64().unwrap())).collect();
            let written = std::fs::metadata(&path).unwrap().modified().unwrap();
            out.push(WaveCommit { version, wave: meta["wave"].as_i64().unwrap(), chunks, written });
        }
    }
    out
}

/// A chunk's lower bound (JSON text) -> its wave, from bronze's wave commits.
fn wave_of_bound(commits: &[WaveCommit]) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for c in commits {
        for lo in c.chunks.keys() {
            assert!(out.insert(lo.clone(), c.wave).is_none(), "chunk from {lo} in two wave commits: {commits:?}");
        }
    }
    out
}

async fn facts(s: &Scenario) -> Vec<FactRow> {
    let ctx = s.context().await.unwrap();
    engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
}

fn detail_i64(r: &FactRow, k: &str) -> i64 {
    r.detail.as_ref().and_then(|d| d[k].as_i64()).unwrap_or_else(|| panic!("{k}: {r:?}"))
}

/// The `snapshot_chunk` facts rows of one wave.
fn chunk_rows_of(rows: &[FactRow], wave: i64) -> Vec<&FactRow> {
    rows.iter().filter(|r| r.event.as_deref() == Some("snapshot_chunk") && detail_i64(r, "wave") == wave).collect()
}

/// Bronze's snapshot rows of `snapshot`: id -> how many.
async fn snapshot_ids(s: &Scenario, snapshot: Lsn) -> BTreeMap<i64, usize> {
    let ctx = s.context().await.unwrap();
    let sql = format!("SELECT CAST(id AS BIGINT) AS id FROM t WHERE _operation = 0 AND _snapshot = '{}'", snapshot.to_hex());
    let mut out = BTreeMap::new();
    for b in delta::query(&ctx.bronze, &sql).await.unwrap() {
        let a = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        for i in 0..a.len() {
            *out.entry(a.value(i)).or_default() += 1;
        }
    }
    out
}

fn table_ids(s: &Scenario) -> BTreeMap<i64, usize> {
    s.db.keys(&s.table).unwrap().iter().map(|k| (k[0].as_i64().unwrap(), 1)).collect()
}

// ---------------------------------------------------------------------------
// 28.94

/// 28.94: two connections, waves of two chunks, the call's first read (a
/// chunk of wave 0) held 800 ms and every other read 20 ms. Wave 0 cannot
/// commit before its slow chunk is in, so the other reader reads wave 1
/// beside it and then must wait: no chunk of wave n + 2 starts while wave n
/// is uncommitted (the waves bronze's log holds when each read starts), and
/// bronze takes the waves in order, each once. Read-ahead still happens: a
/// chunk of wave 1 is read before wave 0's commit. Every row is in bronze
/// once at the end.
///
/// Fails against a reader pool that stamps a wave whenever the queue is
/// empty: the free reader then reads waves 1 to 4 (80 ms of reads) while
/// wave 0's chunk is held, long before wave 0 commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_chunk_is_read_two_waves_ahead_of_the_commits_and_waves_commit_in_order() {
    let s = Scenario::new(40, TWO_READERS);
    s.stream().await.unwrap();
    let delays = Delays { first: Duration::from_millis(800), rest: Duration::from_millis(20), fail_first: false };
    let run = backfill_spied(&s, delays, BackfillArgs::default()).await;
    let r = run.result.unwrap();
    assert!(r.done, "one call reads the whole table: {r:?}");

    let commits = wave_commits(&s.path().join("bronze"));
    let waves: Vec<i64> = commits.iter().map(|c| c.wave).collect();
    assert_eq!(waves, (0..commits.len() as i64).collect::<Vec<_>>(), "bronze takes the waves in order, each once: {commits:?}");
    assert!(commits.windows(2).all(|w| w[0].version < w[1].version));
    assert!(commits.len() >= 4, "enough waves to run ahead in: {commits:?}");
    assert_eq!(r.waves as usize, commits.len(), "{r:?}");

    let wave_of = wave_of_bound(&commits);
    assert_eq!(run.reads.len(), wave_of.len(), "one read a chunk: {:?}", run.reads);
    for read in &run.reads {
        let w = *wave_of.get(&read.lo).unwrap_or_else(|| panic!("a read of no committed chunk: {read:?}"));
        if w >= 2 {
            assert!(
                read.committed.contains(&(w - 2)),
                "a chunk of wave {w} started reading with waves {:?} committed: wave {} was not (more than one wave read ahead)",
                read.committed,
                w - 2
            );
        }
    }
    assert!(
        run.reads.iter().any(|read| wave_of[&read.lo] == 1 && !read.committed.contains(&0)),
        "wave 1 is read while wave 0 waits for its chunk and commits: {:?}",
        run.reads
    );
    let snapshot = r.snapshot.unwrap();
    assert_eq!(snapshot_ids(&s, snapshot).await, table_ids(&s), "every row of the table once");
}

/// A reader waiting for a commit that will never come (the call failed)
/// exits: the call's first read (wave 0) fails after 500 ms while the other
/// reader has read wave 1 and waits, two waves uncommitted. The call returns
/// the read's error, with nothing of either wave in bronze.
///
/// A regression test of the wait itself: a reader not woken by the failure
/// hangs the call, which the 60 s timeout of `backfill_spied` turns into a
/// failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reader_waiting_for_a_commit_exits_when_a_read_fails() {
    let s = Scenario::new(40, TWO_READERS);
    s.stream().await.unwrap();
    let delays = Delays { first: Duration::from_millis(500), rest: Duration::from_millis(20), fail_first: true };
    let run = backfill_spied(&s, delays, BackfillArgs::default()).await;
    let err = run.result.expect_err("the failed read fails the call");
    assert!(err.to_string().contains("the spy fails"), "{err}");
    assert!(run.reads.len() >= 2, "the other reader went on meanwhile: {:?}", run.reads);
    assert!(run.elapsed < Duration::from_secs(10), "returned at once after the failure: {:?}", run.elapsed);
    assert!(wave_commits(&s.path().join("bronze")).is_empty(), "no wave committed");
}

// ---------------------------------------------------------------------------
// 28.100

/// 28.100, end to end: one connection; call 1 reads wave 0 (one chunk: no
/// pace yet), whose facts row records its read (`duration_ms`) and its
/// bronze append (`append_ms`). Call 2's first wave is sized from them: its
/// target is set half a round past k rounds at that pace, (read + append)
/// per round, so it must take exactly k rounds, k chunks, each row
/// recording `rounds = k`. k is chosen so the read alone as the pace gives
/// more rounds (or one, for a read too fast to measure). Call 2's second
/// wave is sized within the call, by wave 1's read alone as the record
/// says: the target over wave 1's slowest chunk read (its rows'
/// `duration_ms`), capped by the chunks left, at least one.
///
/// Fails against a pace that leaves the append out: no `append_ms` in the
/// facts, and a wave of more than k rounds. The second wave fails, unless
/// the two paces happen to give the same count, against a pace taken only
/// at a commit (wave 2 is stamped while wave 1 commits, so it would still
/// be sized from the facts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_first_wave_takes_the_rounds_the_last_waves_read_and_append_hold() {
    let s = Scenario::new(120, ONE_READER);
    s.stream().await.unwrap();
    let first = backfill(&s, BackfillArgs { max_waves: Some(1), ..Default::default() }).await;
    assert_eq!((first.waves, first.chunks_done), (1, 1), "wave 0 is one chunk: {first:?}");
    let rows = facts(&s).await;
    let w0 = chunk_rows_of(&rows, 0);
    assert_eq!(w0.len(), 1, "{w0:?}");
    let read_ms = w0[0].duration_ms.expect("a chunk read records its read time");
    let append_ms = detail_i64(w0[0], "append_ms");
    let rounds0 = detail_i64(w0[0], "rounds");
    assert_eq!(rounds0, 1, "{w0:?}");
    assert!(append_ms >= 1, "an append takes time: {w0:?}");
    // The record's pace from the facts: the wave's read and its append, per round.
    let pace = read_ms as f64 / 1000.0 + append_ms as f64 / 1000.0 / rounds0 as f64;
    let read_only = read_ms as f64 / 1000.0;
    let left = first.chunks_total - first.chunks_done;
    let mut k = 2usize;
    while read_only > 0.0 && k + 1 < left && ((k as f64 + 0.5) * pace / read_only).floor() as usize <= k {
        k += 1;
    }
    assert!(k < left, "{k} rounds of {left} chunks left");
    let target = (k as f64 + 0.5) * pace;

    let second = backfill(&s, BackfillArgs { max_waves: Some(2), target_wave_seconds: Some(target), ..Default::default() }).await;
    assert_eq!(second.waves, 2, "{second:?}");
    let rows = facts(&s).await;
    let w1 = chunk_rows_of(&rows, 1);
    assert_eq!(
        w1.len(),
        k,
        "a target of {target} s at {pace} s a round (read {read_ms} ms + append {append_ms} ms) holds {k} rounds of one chunk: {w1:?}"
    );
    assert!(w1.iter().all(|c| detail_i64(c, "rounds") == k as i64), "{w1:?}");

    let slowest_ms = w1.iter().map(|c| c.duration_ms.expect("read time")).max().unwrap();
    let read_pace = slowest_ms as f64 / 1000.0;
    let expected = if read_pace > 0.0 { ((target / read_pace).floor() as usize).clamp(1, left - k) } else { 1 };
    let w2 = chunk_rows_of(&rows, 2);
    assert_eq!(w2.len(), expected, "wave 2: {target} s at wave 1's read of {slowest_ms} ms a round: {w2:?}");
    assert!(w2.iter().all(|c| detail_i64(c, "rounds") == expected as i64), "{w2:?}");
}

// ---------------------------------------------------------------------------
// 28.102

/// 28.102: two connections, waves of two chunks, `max_seconds = 1`; the
/// call's first read (wave 0) takes 2 s and every other read at least 20
/// ms. The time runs out while wave 0 is read. Then:
/// - at most two waves were uncommitted at the deadline (bronze's commits
///   written after it), the one being read and the one read ahead, and
///   every wave the call committed was stamped before it;
/// - the call returns within the end of wave 0's read (the wave in progress:
///   deadline + one wave) and two commits (the commit under way and that
///   wave's), each as long as wave 0's commit (`wave_fixed_seconds`), plus
///   0.5 s of slack.
///
/// Fails against unbounded read-ahead: the free reader reads every other
/// chunk (some 14 waves, 20 ms a chunk) before the deadline, all committed
/// after it, one after another once wave 0 is in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_seconds_is_passed_by_at_most_the_wave_being_read_and_the_commit_under_way() {
    let s = Scenario::new(120, TWO_READERS);
    s.stream().await.unwrap();
    let limit = 1.0;
    let slow = Duration::from_millis(2000);
    let delays = Delays { first: slow, rest: Duration::from_millis(20), fail_first: false };
    let run = backfill_spied(&s, delays, BackfillArgs { max_seconds: Some(limit), ..Default::default() }).await;
    let r = run.result.unwrap();
    assert!(!r.done, "{r:?}");
    assert_eq!(r.reason.as_deref(), Some("max_seconds reached"), "{r:?}");

    let deadline = run.started + Duration::from_secs_f64(limit);
    let deadline_at = run.started_at + Duration::from_secs_f64(limit);
    let commits = wave_commits(&s.path().join("bronze"));
    assert_eq!(commits.len(), r.waves as usize, "{commits:?}");
    let late: Vec<i64> = commits.iter().filter(|c| c.written > deadline_at).map(|c| c.wave).collect();
    assert!(late.len() <= 2, "waves {late:?} were uncommitted when the time ran out: more than the one read and the one read ahead");
    let wave_of = wave_of_bound(&commits);
    let mut first_read: BTreeMap<i64, Instant> = BTreeMap::new();
    for read in &run.reads {
        if let Some(w) = wave_of.get(&read.lo) {
            let e = first_read.entry(*w).or_insert(read.started);
            *e = (*e).min(read.started);
        }
    }
    for (w, at) in &first_read {
        assert!(*at < deadline + Duration::from_millis(20), "wave {w} started reading after the deadline");
    }

    let slow_read = run.reads.iter().find(|read| read.delayed_until.duration_since(read.started) >= slow).expect("the held read");
    let held_until = slow_read.delayed_until.duration_since(run.started);
    assert!(held_until.as_secs_f64() > limit, "the time ran out during wave 0's read");
    let commit = Duration::from_secs_f64(r.wave_fixed_seconds.first().copied().expect("wave 0 committed"));
    let bound = held_until + commit * 2 + Duration::from_millis(500);
    assert!(
        run.elapsed <= bound,
        "the call took {:?}: more than wave 0's read ({held_until:?}) and two commits of {commit:?} (+0.5 s); {} waves committed",
        run.elapsed,
        r.waves
    );
}
