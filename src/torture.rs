//! `mssql-cdc torture`: seeded, randomized schedules of writes, steps, crashes
//! and overlapping calls against the simulator, each checked at its end
//! against the simulator's own rows and change log.
//!
//! A schedule is drawn from one seed: a table shape (an integer primary key,
//! a string primary key under a case-insensitive collation, a heap), a
//! snapshot mode (full or chunked, the chunks sometimes cut on a repeated
//! column), then a run of events: transactions of a writer (inserts,
//! updates, deletes, key changes, keys respelled in place, set-based key
//! swaps, duplicate heap rows), capture lag (a write left uncaptured for a
//! while), and the calls an orchestrator makes (`stream`, `backfill`,
//! `apply`, `reconcile`, `status`), alone or two at once, each possibly
//! crashed and later called again.
//!
//! Why crashes are cut by polls, not by named failpoints or by time: a step
//! is an async future, and every I/O it does (a Delta read or commit, a
//! source call) is an await. The call runs on a runtime of its own, and a
//! crash drops the future after its k-th poll, k drawn from the seed, then
//! shuts the runtime down, which drops every task the step spawned at its
//! next await. That stops the step between any two I/O operations, as a
//! killed process stops, and the same seed cuts at the same poll. (Timing is
//! not fully deterministic: a source call on the blocking pool may finish
//! sooner or later than the poll that follows it. A failing seed replays as
//! the same schedule; it usually fails again at the same place.) A share of
//! calls, when the binary is given, run as child processes killed with
//! SIGKILL after a random delay: the same thing from outside.
//!
//! The checks at the end, after the writer stops and every step has been
//! called until it has nothing left to do, do not ask the engine:
//! - bronze's change rows are exactly the change rows the simulator's change
//!   function returns for the streamed range, every column, as a multiset:
//!   none lost, none twice;
//! - bronze's batch ranges (facts) tile the stream from S without a gap or
//!   an overlap;
//! - silver equals the simulator's table, every column, as a multiset;
//! - `reconcile` is clean.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use clap::Parser;
use deltalake::arrow::array::Array;
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::arrow::util::display::array_value_to_string;
use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};

use crate::delta;
use crate::error::{StepError, EXIT_OK, EXIT_TEMPORARY};
use crate::lsn::Lsn;
use crate::sim::{Clock, SimConfig, SimDb, TableSpec};
use crate::source::{CdcSource, Isolation, KeyRange, RowFilter, SnapshotRead, TableName};
use crate::types::{ColumnDesc, SqlType, SqlValue};

/// What `torture` is asked to do.
#[derive(Debug, Clone)]
pub struct TortureArgs {
    /// The first schedule's seed; schedule i uses `seed + i`.
    pub seed: u64,
    pub schedules: u32,
    /// Events per schedule (writes and calls, before the final drain).
    pub events: u32,
    /// The mssql-cdc binary, for the calls run as child processes and
    /// killed; None runs every call in process.
    pub binary: Option<PathBuf>,
    /// Where each schedule's files go (under the system's temporary folder
    /// when None); a passing schedule's folder is removed, a failing one's kept.
    pub dir: Option<PathBuf>,
}

/// The mix one run injected, and its failures.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TortureReport {
    pub schedules: u32,
    pub failures: u32,
    pub shapes: BTreeMap<String, u32>,
    pub modes: BTreeMap<String, u32>,
    pub steps: BTreeMap<String, u32>,
    pub crashes: u32,
    pub kills: u32,
    pub overlaps: u32,
    pub transactions: u32,
    /// Schedules whose capture job lagged behind the commits.
    pub lagged: u32,
    pub temporary_exits: u32,
    pub seconds: f64,
    /// The failing schedules: seed, what broke, the command that replays it.
    pub failed: Vec<Value>,
}

/// Runs `args.schedules` schedules, one after another, and reports.
pub fn run(args: &TortureArgs) -> TortureReport {
    let started = Instant::now();
    let mut report = TortureReport::default();
    for i in 0..args.schedules {
        let seed = args.seed.wrapping_add(i as u64);
        let base = args.dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("mssql-cdc-torture-{}", std::process::id())));
        let dir = base.join(format!("schedule-{seed}"));
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            report.failures += 1;
            report.failed.push(json!({"seed": seed, "error": format!("cannot create {}: {e}", dir.display())}));
            continue;
        }
        let outcome = run_schedule(seed, args, &dir, &mut report);
        report.schedules += 1;
        match outcome {
            Ok(()) => {
                let _ = std::fs::remove_dir_all(&dir);
            }
            Err(why) => {
                report.failures += 1;
                tracing::error!(seed, %why, dir = %dir.display(), "schedule failed; its files are kept");
                report.failed.push(json!({
                    "seed": seed,
                    "error": why,
                    "dir": dir,
                    "replay": format!("mssql-cdc torture --seed {seed} --schedules 1 --events {} --dir {}", args.events, base.display()),
                }));
            }
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    IntKey,
    StringKey,
    Heap,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::IntKey => "int_key",
            Shape::StringKey => "string_key",
            Shape::Heap => "heap",
        }
    }

    fn columns(self) -> Vec<ColumnDesc> {
        match self {
            Shape::IntKey => vec![
                ColumnDesc::new("id", SqlType::Int, false),
                ColumnDesc::new("grp", SqlType::Int, true),
                ColumnDesc::new("note", SqlType::NVarChar { len: Some(24) }, true),
                ColumnDesc::new("amount", SqlType::BigInt, true),
            ],
            Shape::StringKey => vec![
                ColumnDesc::new("code", SqlType::NVarChar { len: Some(16) }, false),
                ColumnDesc::new("v", SqlType::Int, true),
                ColumnDesc::new("note", SqlType::NVarChar { len: Some(24) }, true),
            ],
            Shape::Heap => vec![
                ColumnDesc::new("grp", SqlType::Int, true),
                ColumnDesc::new("tag", SqlType::NVarChar { len: Some(12) }, true),
                ColumnDesc::new("amount", SqlType::Int, true),
            ],
        }
    }

    /// The change function's row filter the reference model reads with:
    /// what bronze must hold. Before-images for a heap and for a string key
    /// (their silver needs them); after-images only for the integer key.
    fn model_filter(self) -> RowFilter {
        match self {
            Shape::IntKey => RowFilter::All,
            Shape::StringKey | Shape::Heap => RowFilter::AllUpdateOld,
        }
    }
}

/// The writer: draws transactions and keeps the next fresh key.
struct Writer {
    shape: Shape,
    table: TableName,
    next: i64,
}

impl Writer {
    fn row(&self, n: i64, rng: &mut SmallRng) -> Vec<SqlValue> {
        let note = SqlValue::Str(format!("n{}", rng.random_range(0..1000)));
        match self.shape {
            Shape::IntKey => vec![SqlValue::Int(n), SqlValue::Int(n % 5), note, SqlValue::Int(rng.random_range(-1000..1000))],
            Shape::StringKey => vec![SqlValue::Str(format!("k{n}")), SqlValue::Int(rng.random_range(0..100)), note],
            Shape::Heap => vec![SqlValue::Int(n % 4), SqlValue::Str(format!("t{}", n % 3)), SqlValue::Int(rng.random_range(0..5))],
        }
    }

    fn initial_rows(&mut self, n: i64, rng: &mut SmallRng) -> Vec<Vec<SqlValue>> {
        let rows = (1..=n).map(|i| self.row(i, rng)).collect();
        self.next = n + 1;
        rows
    }

    /// The key of a row (the whole row for a heap: the simulator finds a heap row by its values).
    fn key_of(&self, row: &[SqlValue]) -> Vec<SqlValue> {
        match self.shape {
            Shape::IntKey | Shape::StringKey => vec![row[0].clone()],
            Shape::Heap => row.to_vec(),
        }
    }

    /// One transaction of 1 to 6 operations on the rows as they are now.
    fn transaction(&mut self, db: &SimDb, rng: &mut SmallRng) -> Result<(), String> {
        let mut rows = db.rows(&self.table).map_err(|e| e.to_string())?;
        let ops = if rng.random_bool(0.1) { rng.random_range(10..40) } else { rng.random_range(1..=6) };
        let shape = self.shape;
        let table = self.table.clone();
        let mut plan: Vec<Op> = Vec::new();
        for _ in 0..ops {
            let pick = rng.random_range(0..100);
            if rows.is_empty() || pick < 30 {
                let n = self.next;
                self.next += 1;
                let mut row = self.row(n, rng);
                if shape == Shape::Heap && !rows.is_empty() && rng.random_bool(0.3) {
                    row = rows[rng.random_range(0..rows.len())].clone(); // an identical row
                }
                rows.push(row.clone());
                plan.push(Op::Insert(row));
                continue;
            }
            let i = rng.random_range(0..rows.len());
            let old = rows[i].clone();
            let key = self.key_of(&old);
            if pick < 45 {
                rows.swap_remove(i);
                plan.push(Op::Delete(key));
                continue;
            }
            let mut new = old.clone();
            match (shape, pick) {
                (Shape::IntKey, 45..=55) => {
                    new[0] = SqlValue::Int(self.next);
                    self.next += 1;
                }
                (Shape::StringKey, 45..=52) => {
                    // The same key under the collation, spelled otherwise: an update in place.
                    if let SqlValue::Str(s) = &old[0] {
                        new[0] = SqlValue::Str(if s.starts_with('k') { s.replacen('k', "K", 1) } else { s.replacen('K', "k", 1) });
                    }
                }
                (Shape::StringKey, 53..=58) => {
                    new[0] = SqlValue::Str(format!("k{}", self.next));
                    self.next += 1;
                }
                (Shape::IntKey | Shape::StringKey, 59..=63) if rows.len() >= 2 => {
                    // A set-based swap of two keys in one statement.
                    let j = (i + 1) % rows.len();
                    let (a, b) = (rows[i].clone(), rows[j].clone());
                    let mut a2 = a.clone();
                    let mut b2 = b.clone();
                    a2[0] = b[0].clone();
                    b2[0] = a[0].clone();
                    rows[i] = a2.clone();
                    rows[j] = b2.clone();
                    plan.push(Op::Swap(vec![(self.key_of(&a), a2), (self.key_of(&b), b2)]));
                    continue;
                }
                _ => {}
            }
            let last = new.len() - 1;
            new[last] = match &old[last] {
                SqlValue::Int(v) => SqlValue::Int(v + rng.random_range(1..50)),
                _ => SqlValue::Str(format!("u{}", rng.random_range(0..1000))),
            };
            if shape != Shape::Heap {
                new[1] = match &old[1] {
                    SqlValue::Int(v) if rng.random_bool(0.5) => SqlValue::Int(v + 1),
                    other => other.clone(),
                };
            }
            rows[i] = new.clone();
            plan.push(Op::Update(key, new));
        }
        db.transaction(|tx| {
            for op in plan {
                match op {
                    Op::Insert(r) => tx.insert(&table, r)?,
                    Op::Delete(k) => tx.delete(&table, &k)?,
                    Op::Update(k, r) => tx.update(&table, &k, r)?,
                    Op::Swap(changes) => tx.update_keys(&table, changes)?,
                }
            }
            Ok(())
        })
        .map(|_| ())
        .map_err(|e| format!("the writer's transaction failed: {e}"))
    }
}

enum Op {
    Insert(Vec<SqlValue>),
    Delete(Vec<SqlValue>),
    Update(Vec<SqlValue>, Vec<SqlValue>),
    Swap(Vec<(Vec<SqlValue>, Vec<SqlValue>)>),
}

/// A future that gives up after `polls` polls: the crash of a call.
struct CrashAfter<F> {
    inner: Pin<Box<F>>,
    polls_left: u32,
}

impl<F: Future> Future for CrashAfter<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        if self.polls_left == 0 {
            return Poll::Ready(None);
        }
        self.polls_left -= 1;
        match self.inner.as_mut().poll(cx) {
            Poll::Ready(v) => Poll::Ready(Some(v)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// How one call ended.
enum Ended {
    Done(Value, i32),
    Crashed,
    Failed(StepError),
}

/// Runs one call in process on a runtime of its own; `crash_after` polls, if set, cuts it.
fn call(workflow: &Path, args: &[&str], crash_after: Option<u32>) -> Ended {
    let mut argv = vec!["mssql-cdc".to_string(), "--workflow".into(), workflow.display().to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    let cli = match crate::cli::Cli::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => return Ended::Failed(StepError::Internal(format!("torture built a bad command line {argv:?}: {e}"))),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let fut = CrashAfter { inner: Box::pin(crate::cli::run(cli)), polls_left: crash_after.unwrap_or(u32::MAX) };
    let out = rt.block_on(fut);
    // Blocking work already handed to the pool (a file write, a simulator
    // read) finishes, as a system call in flight does when a process is
    // killed; nothing the dropped future would have started next runs. A
    // background shutdown would let a crashed call's commit land after its
    // rerun began: a late writer no real crash produces.
    rt.shutdown_timeout(Duration::from_secs(30));
    match out {
        None => Ended::Crashed,
        Some(Ok((v, code))) => Ended::Done(v, code),
        Some(Err(e)) => Ended::Failed(e),
    }
}

/// Runs one call as a child process of `binary`, killed (SIGKILL) after
/// `kill_after` if still running: None when it was killed, else its exit
/// code and the JSON of its last stdout line (Null if it printed none).
fn call_killed(binary: &Path, workflow: &Path, args: &[&str], kill_after: Duration) -> Result<Option<(i32, Value)>, String> {
    use std::io::Read;
    let mut child = std::process::Command::new(binary)
        .arg("--workflow")
        .arg(workflow)
        .args(args)
        .env("MSSQL_CDC_LOG", "error")
        // One JSON line: far below a pipe's buffer, so the child never blocks on it.
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
    let deadline = Instant::now() + kill_after;
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            let mut out = String::new();
            if let Some(mut stdout) = child.stdout.take() {
                let _ = stdout.read_to_string(&mut out);
            }
            let json = out.lines().last().and_then(|l| serde_json::from_str(l).ok()).unwrap_or(Value::Null);
            return Ok(Some((status.code().unwrap_or(-1), json)));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Judges a call's end during the random part: "call again later" and a
/// crash are expected; a refusal or a bug is a failure.
fn judge(step: &str, ended: Ended, report: &mut TortureReport) -> Result<(), String> {
    match ended {
        Ended::Crashed => {
            report.crashes += 1;
            Ok(())
        }
        Ended::Done(_, code) if code == EXIT_OK || code == EXIT_TEMPORARY => {
            report.temporary_exits += u32::from(code == EXIT_TEMPORARY);
            Ok(())
        }
        // reconcile's "not clean" mid-run is judged at the end, after the drain.
        Ended::Done(_, 3) if step == "reconcile" => Ok(()),
        // Called before any apply: an orchestrator ran the steps out of order.
        Ended::Failed(e) if step == "reconcile" && e.to_string().contains("has no applied state yet") => Ok(()),
        Ended::Done(v, code) => Err(format!("{step} exited {code}: {v}")),
        Ended::Failed(e) if e.exit_code() == EXIT_TEMPORARY => {
            report.temporary_exits += 1;
            Ok(())
        }
        Ended::Failed(e) => Err(format!("{step} failed with exit {}: {e}", e.exit_code())),
    }
}

fn run_schedule(seed: u64, args: &TortureArgs, dir: &Path, report: &mut TortureReport) -> Result<(), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let shape = [Shape::IntKey, Shape::StringKey, Shape::Heap][rng.random_range(0..3)];
    let chunked = rng.random_bool(0.5);
    *report.shapes.entry(shape.name().into()).or_default() += 1;
    *report.modes.entry(if chunked { "chunked" } else { "full" }.into()).or_default() += 1;

    // Capture lag: in a share of schedules the capture job only takes a
    // commit once it is this old (on the manual clock), so steps run while
    // committed changes are not yet in the change tables.
    // For heaps too: a commit in the table when a chunk (or a full snapshot)
    // is read but not yet captured has its change row after the stamp, and
    // only the read's fence keeps heap silver from counting it twice.
    let capture_lag_ms = if rng.random_bool(0.4) { rng.random_range(500..4000) } else { 0 };
    if capture_lag_ms > 0 {
        report.lagged += 1;
    }
    let cfg = SimConfig {
        capture_lag_ms,
        clock: Clock::Manual { start: chrono::DateTime::from_timestamp(1_772_366_400 + (seed % 1000) as i64 * 3600, 0).expect("a time"), tick_ms: 1000 },
        time_zone: "UTC".into(),
        idle_interval_seconds: 1,
        seed,
        ..SimConfig::default()
    };
    let db = SimDb::create(&dir.join("source.sqlite"), cfg).map_err(|e| e.to_string())?;
    let table = TableName::new("dbo", "t");
    let columns = shape.columns();
    let (primary_key, keys_toml) = match shape {
        Shape::IntKey => (vec!["id".to_string()], if rng.random_bool(0.5) { "keys = [\"grp\"]\n" } else { "" }),
        Shape::StringKey => (vec!["code".to_string()], ""),
        Shape::Heap => (vec![], "keys = [\"grp\"]\n"),
    };
    db.create_table(&TableSpec { name: table.clone(), columns: columns.clone(), primary_key, unique_index: vec![], collations: Default::default() })
        .map_err(|e| e.to_string())?;
    std::fs::write(dir.join("shape"), shape.name()).map_err(|e| e.to_string())?;
    let mut writer = Writer { shape, table: table.clone(), next: 1 };
    let initial = rng.random_range(0..40);
    db.load_rows(&table, writer.initial_rows(initial, &mut rng).into_iter()).map_err(|e| e.to_string())?;
    db.enable_cdc(&table, None, None).map_err(|e| e.to_string())?;
    db.advance_clock(Duration::from_secs(2)).map_err(|e| e.to_string())?;
    db.capture().map_err(|e| e.to_string())?;

    let mode = if chunked {
        format!("mode = \"chunked\"\nchunk_rows = {}\nparallelism = {}\ntarget_wave_seconds = 0\n", rng.random_range(3..12), rng.random_range(1..=2))
    } else {
        "mode = \"full\"\n".to_string()
    };
    let wf = dir.join("t.toml");
    std::fs::write(
        &wf,
        format!(
            "app_id = \"t\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"t\"\n\
             [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
             [snapshot]\nbootstrap = true\n{keys_toml}{mode}[stream]\nmax_batch_rows = {}\n[reconcile]\nsample_fraction = 1.0\n",
            rng.random_range(2..30)
        ),
    )
    .map_err(|e| e.to_string())?;

    let steps: &[&str] = if chunked { &["stream", "backfill", "apply", "reconcile", "status"] } else { &["stream", "apply", "reconcile", "status"] };
    let step_args = |s: &'static str| -> Vec<&'static str> {
        match s {
            "backfill" => vec!["backfill", "--max-waves", "1"],
            other => vec![other],
        }
    };
    let mut uncaptured = false;
    for _ in 0..args.events {
        let roll = rng.random_range(0..100);
        if roll < 35 {
            writer.transaction(&db, &mut rng)?;
            report.transactions += 1;
            db.advance_clock(Duration::from_secs(1)).map_err(|e| e.to_string())?;
            // Capture lag: sometimes the capture job has not read this commit yet.
            uncaptured = rng.random_bool(0.3);
            if !uncaptured {
                db.capture().map_err(|e| e.to_string())?;
            }
            continue;
        }
        if uncaptured && rng.random_bool(0.5) {
            db.capture().map_err(|e| e.to_string())?;
            uncaptured = false;
        }
        let weights = |s: &str| match s {
            "stream" => 40,
            "backfill" => 30,
            "apply" => 25,
            "reconcile" => 8,
            _ => 4,
        };
        let total: u32 = steps.iter().map(|s| weights(s)).sum();
        let draw = |rng: &mut SmallRng| {
            let mut x = rng.random_range(0..total);
            for s in steps {
                if x < weights(s) {
                    return *s;
                }
                x -= weights(s);
            }
            steps[0]
        };
        let crash = |rng: &mut SmallRng| if rng.random_bool(0.3) { Some(rng.random_range(1..600)) } else { None };
        if roll < 85 {
            let s = draw(&mut rng);
            *report.steps.entry(s.into()).or_default() += 1;
            if let (Some(bin), true) = (&args.binary, rng.random_bool(0.08)) {
                let after = Duration::from_millis(rng.random_range(20..600));
                match call_killed(bin, &wf, &step_args(s), after)? {
                    None => report.kills += 1,
                    Some((code, _)) if code == EXIT_OK || code == EXIT_TEMPORARY => {}
                    // reconcile's "not clean" mid-run is judged after the drain.
                    Some((3, _)) if s == "reconcile" => {}
                    // reconcile before the first apply: as judged in process.
                    Some((2, j)) if s == "reconcile" && j["error"].as_str().is_some_and(|e| e.contains("has no applied state yet")) => {}
                    Some((code, j)) => return Err(format!("{s} (a child process) exited {code}: {j}")),
                }
                continue;
            }
            let c = crash(&mut rng);
            judge(s, call(&wf, &step_args(s), c), report)?;
        } else {
            // Two calls at once, as two processes would make them.
            let (a, b) = (draw(&mut rng), draw(&mut rng));
            let (ca, cb) = (crash(&mut rng), crash(&mut rng));
            report.overlaps += 1;
            *report.steps.entry(a.into()).or_default() += 1;
            *report.steps.entry(b.into()).or_default() += 1;
            let (wa, wb) = (wf.clone(), wf.clone());
            let (aa, ab) = (step_args(a), step_args(b));
            let ta = std::thread::spawn(move || call(&wa, &aa, ca));
            let tb = std::thread::spawn(move || call(&wb, &ab, cb));
            let ea = ta.join().map_err(|_| format!("{a} panicked"))?;
            let eb = tb.join().map_err(|_| format!("{b} panicked"))?;
            judge(a, ea, report)?;
            judge(b, eb, report)?;
        }
    }
    drain_and_check(&db, &table, shape, chunked, &wf, &columns)
}

/// Runs schedule `seed` in `dir` (which must be empty) and leaves its files there.
pub fn run_one(seed: u64, events: u32, binary: Option<PathBuf>, dir: &Path) -> Result<(), String> {
    let args = TortureArgs { seed, schedules: 1, events, binary, dir: None };
    run_schedule(seed, &args, dir, &mut TortureReport::default())
}

/// Checks the targets a schedule left in `dir` again (no drain): how a test
/// shows the checks disagree with a target that was damaged afterwards.
pub fn recheck(dir: &Path) -> Result<(), String> {
    let shape = match std::fs::read_to_string(dir.join("shape")).map_err(|e| e.to_string())?.trim() {
        "int_key" => Shape::IntKey,
        "string_key" => Shape::StringKey,
        "heap" => Shape::Heap,
        other => return Err(format!("unknown shape '{other}'")),
    };
    let db = SimDb::open(&dir.join("source.sqlite")).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(check(&db, &TableName::new("dbo", "t"), shape, &dir.join("t.toml"), &shape.columns()))
}

/// Calls a step with no crash until it succeeds (a "call again later" is retried).
fn call_until_ok(wf: &Path, args: &[&str]) -> Result<Value, String> {
    for _ in 0..20 {
        match call(wf, args, None) {
            Ended::Done(v, EXIT_OK) => return Ok(v),
            Ended::Done(_, EXIT_TEMPORARY) => continue,
            Ended::Failed(e) if e.exit_code() == EXIT_TEMPORARY => continue,
            Ended::Done(v, code) => return Err(format!("{args:?} exited {code} in the drain: {v}")),
            Ended::Failed(e) => return Err(format!("{args:?} failed in the drain with exit {}: {e}", e.exit_code())),
            Ended::Crashed => unreachable!("no crash was asked for"),
        }
    }
    Err(format!("{args:?} asked to be called again 20 times in the drain"))
}

fn drain_and_check(db: &SimDb, table: &TableName, shape: Shape, chunked: bool, wf: &Path, columns: &[ColumnDesc]) -> Result<(), String> {
    // Past any capture lag the schedule drew (at most 4 s).
    db.advance_clock(Duration::from_secs(10)).map_err(|e| e.to_string())?;
    db.capture().map_err(|e| e.to_string())?;
    let mut caught_up = false;
    for _ in 0..50 {
        let v = call_until_ok(wf, &["stream"])?;
        if v["caught_up"] == true {
            caught_up = true;
            break;
        }
    }
    if !caught_up {
        return Err("the stream did not catch up in 50 calls".into());
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    if chunked {
        let mut done = false;
        let src = db.source().map_err(|e| e.to_string())?;
        let silver_location = wf.parent().expect("the workflow's folder").join("silver").to_string_lossy().into_owned();
        for _ in 0..400 {
            let v = call_until_ok(wf, &["backfill", "--max-waves", "1"])?;
            call_until_ok(wf, &["stream"])?;
            if v["done"] == true {
                done = true;
                break;
            }
            // The waves path, which the completion's rebuild would paper
            // over: the writer has stopped, so once the stream is caught up
            // and the waves are applied, every row silver holds (the rows of
            // the chunks read, and of keys changed since S) is the table's
            // row now, as a multiset; only rows of unread chunks may be missing.
            call_until_ok(wf, &["apply"])?;
            let (silver_rows, table_rows) = rt.block_on(silver_and_table(&src, table, &silver_location, columns, false))?;
            let extra: Vec<String> = silver_rows
                .iter()
                .filter(|(t, n)| **n != 0 && table_rows.get(*t).copied().unwrap_or(0) < **n)
                .take(6)
                .map(|(t, n)| format!("{t}: {n} in silver, {} in the table", table_rows.get(t).copied().unwrap_or(0)))
                .collect();
            if !extra.is_empty() {
                return Err(format!("during the chunked snapshot, silver holds rows the table does not: {}", extra.join("; ")));
            }
        }
        if !done {
            return Err("backfill did not finish in 400 calls".into());
        }
    }
    call_until_ok(wf, &["apply"])?;
    rt.block_on(check(db, table, shape, wf, columns))?;
    let r = call_until_ok(wf, &["reconcile"]);
    match r {
        Ok(v) if v["clean"] == true => Ok(()),
        Ok(v) => Err(format!("reconcile is not clean after the drain: {v}")),
        Err(e) if e.contains("exited 3") => Err(format!("reconcile is not clean after the drain: {e}")),
        Err(e) => Err(e),
    }
}

type Multiset = BTreeMap<String, i64>;

fn texts(batch: &RecordBatch, names: &[String]) -> Result<Vec<String>, String> {
    let arrays = names
        .iter()
        .map(|n| batch.column_by_name(n).cloned().ok_or_else(|| format!("column {n} missing from {:?}", batch.schema())))
        .collect::<Result<Vec<_>, _>>()?;
    (0..batch.num_rows())
        .map(|r| {
            arrays
                .iter()
                .map(|a| if a.is_null(r) { Ok("\u{2400}NULL".to_string()) } else { array_value_to_string(a.as_ref(), r).map_err(|e| e.to_string()) })
                .collect::<Result<Vec<_>, _>>()
                .map(|v| v.join(" | "))
        })
        .collect()
}

fn diff(label: &str, engine: &Multiset, model: &Multiset) -> Result<(), String> {
    if engine == model {
        return Ok(());
    }
    let mut lines = Vec::new();
    for (k, n) in engine {
        let m = model.get(k).copied().unwrap_or(0);
        if *n != m {
            lines.push(format!("{k}: {n} in the target, {m} in the source"));
        }
    }
    for (k, m) in model {
        if !engine.contains_key(k) {
            lines.push(format!("{k}: 0 in the target, {m} in the source"));
        }
    }
    lines.truncate(6);
    Err(format!("{label} differ: {}", lines.join("; ")))
}

/// The checks of the module doc, against the simulator's own rows and change function.
async fn check(db: &SimDb, table: &TableName, shape: Shape, wf: &Path, columns: &[ColumnDesc]) -> Result<(), String> {
    let dir = wf.parent().expect("the workflow's folder");
    let loc = |t: &str| dir.join(t).to_string_lossy().into_owned();
    silver_matches_table(db, table, &loc("silver"), columns).await?;
    let s = bronze_matches_change_log(db, table, &loc("bronze"), &loc("facts"), columns, shape.model_filter()).await?;
    batch_ranges_tile(&loc("facts"), "t", s).await
}

/// The reference check of silver: silver's rows against the simulator's
/// table, every column, as multisets (a heap's silver row counts `_count`
/// times and must hold each distinct row once with a positive count). Read
/// from the simulator itself, never through the engine's rebuild; tests of
/// single scenarios call it as the tester does.
pub async fn silver_matches_table(db: &SimDb, table: &TableName, silver: &str, columns: &[ColumnDesc]) -> Result<(), String> {
    let src = db.source().map_err(|e| e.to_string())?;
    let (silver_rows, table_rows) = silver_and_table(&src, table, silver, columns, true).await?;
    diff("silver (target) and the table (source)", &silver_rows, &table_rows)
}

/// The reference check of bronze: its change rows (every column, with the
/// rank columns `_start_lsn`, `_seqval`, `_operation` and `_command_id`)
/// against what the simulator's change function returns from S to its max
/// LSN with `filter` (the row filter the stream reads with), as multisets:
/// none lost, none twice. S is the first snapshot's (bronze's smallest
/// `_snapshot`, or the facts' open for an empty table), returned for
/// [`batch_ranges_tile`]. One generation and one capture instance: the
/// newest instance's change function is the reference.
pub async fn bronze_matches_change_log(
    db: &SimDb,
    table: &TableName,
    bronze: &str,
    facts: &str,
    columns: &[ColumnDesc],
    filter: RowFilter,
) -> Result<Lsn, String> {
    let names: Vec<String> = columns.iter().map(|c| c.name.clone()).collect();
    let src = db.source().map_err(|e| e.to_string())?;
    let bronze = delta::open_existing(bronze, &Default::default()).await.map_err(|e| e.to_string())?.ok_or("bronze was never created")?;
    let s_rows = delta::query(&bronze, "SELECT MIN(_snapshot) AS s FROM t WHERE _operation = 0").await.map_err(|e| e.to_string())?;
    let s_text = s_rows.first().and_then(|b| texts(b, &["s".to_string()]).ok()).and_then(|v| v.into_iter().next());
    let s = match s_text.as_deref() {
        Some(t) if !t.starts_with('\u{2400}') => Lsn::parse(t).map_err(|e| e.to_string())?,
        // An empty table: the snapshot wrote no rows; the facts hold S.
        _ => snapshot_lsn_from_facts(facts).await?,
    };
    let max = src.max_lsn().await.map_err(|e| e.to_string())?.ok_or("the source has no max LSN")?;
    let instances = src.capture_instances(table).await.map_err(|e| e.to_string())?;
    let instance = instances.last().ok_or("no capture instance")?;
    let mut change_names = vec![
        crate::source::CHANGE_START_LSN.to_string(),
        crate::source::CHANGE_SEQVAL.to_string(),
        crate::source::CHANGE_OPERATION.to_string(),
        crate::source::CHANGE_COMMAND_ID.to_string(),
    ];
    change_names.extend(names.iter().cloned());
    let mut model = Multiset::new();
    if s < max {
        let mut changes = src.changes(instance, s.increment(), max, filter, 1000).await.map_err(|e| e.to_string())?;
        while let Some(b) = changes.next().await {
            let b = b.map_err(|e| e.to_string())?;
            for t in texts(&b, &change_names)? {
                *model.entry(t).or_default() += 1;
            }
        }
    }
    // The command id ranks rows of one transaction: compared too.
    let mut bronze_names = vec![
        crate::delta::bronze::START_LSN.to_string(),
        crate::delta::bronze::SEQVAL.to_string(),
        crate::delta::bronze::OPERATION.to_string(),
        crate::delta::bronze::COMMAND_ID.to_string(),
    ];
    bronze_names.extend(names.iter().cloned());
    let mut held = Multiset::new();
    for b in delta::query(&bronze, "SELECT * FROM t WHERE _operation <> 0").await.map_err(|e| e.to_string())? {
        for t in texts(&b, &bronze_names)? {
            *held.entry(t).or_default() += 1;
        }
    }
    // LSNs print as hex in bronze and as bytes in the change batch: compare both as hex.
    let model: Multiset = model.into_iter().map(|(k, n)| (hex_lsns(&k), n)).collect();
    diff("bronze's change rows (target) and the change function's (source)", &held, &model)?;
    Ok(s)
}

/// Silver's rows and the table's, every column, as multisets (a heap's
/// silver row counts `_count` times). `positive_counts`: a heap's silver must
/// hold each distinct row once with a positive count (true once every
/// snapshot is complete).
async fn silver_and_table(src: &dyn CdcSource, table: &TableName, silver_location: &str, columns: &[ColumnDesc], positive_counts: bool) -> Result<(Multiset, Multiset), String> {
    let names: Vec<String> = columns.iter().map(|c| c.name.clone()).collect();
    let mut table_rows = Multiset::new();
    let read = SnapshotRead { table: table.clone(), columns: columns.to_vec(), keys: vec![], range: KeyRange::all(), isolation: Isolation::ReadCommitted, batch_rows: 1000 };
    let mut stream = src.snapshot_read(&read).await.map_err(|e| e.to_string())?;
    while let Some(b) = stream.next().await {
        for t in texts(&b.map_err(|e| e.to_string())?, &names)? {
            *table_rows.entry(t).or_default() += 1;
        }
    }
    let silver = delta::open_existing(silver_location, &Default::default()).await.map_err(|e| e.to_string())?.ok_or("silver was never created")?;
    let mut silver_rows = Multiset::new();
    for b in delta::query(&silver, "SELECT * FROM t").await.map_err(|e| e.to_string())? {
        let counts: Option<Vec<i64>> = b.column_by_name(crate::delta::silver::COUNT).map(|a| {
            let a = a.as_any().downcast_ref::<deltalake::arrow::array::Int64Array>().expect("_count is bigint");
            (0..a.len()).map(|i| a.value(i)).collect()
        });
        for (i, t) in texts(&b, &names)?.into_iter().enumerate() {
            if let (Some(c), true) = (&counts, positive_counts) {
                // A heap's silver holds each distinct row once, with a positive count.
                if c[i] <= 0 {
                    return Err(format!("heap silver holds {t} with _count {}", c[i]));
                }
                if silver_rows.contains_key(&t) {
                    return Err(format!("heap silver holds the distinct row {t} in two rows"));
                }
            }
            *silver_rows.entry(t).or_default() += counts.as_ref().map_or(1, |c| c[i]);
        }
    }
    silver_rows.retain(|_, n| *n != 0);
    Ok((silver_rows, table_rows))
}

/// The stream's batch rows in the facts (of `app_id`, one generation) tile
/// the LSNs after S: batch ids 0, 1, 2, ... each once, each range starting
/// right after the previous one.
pub async fn batch_ranges_tile(facts: &str, app_id: &str, s: Lsn) -> Result<(), String> {
    let t = delta::open_existing(facts, &Default::default()).await.map_err(|e| e.to_string())?.ok_or("facts was never created")?;
    let sql = format!(
        "SELECT CAST(batch_id AS VARCHAR) AS b, min_lsn, max_lsn FROM t WHERE app_id = {} AND event IS NULL AND batch_id IS NOT NULL ORDER BY batch_id",
        delta::sql_str(app_id)
    );
    let batches = delta::query(&t, &sql).await.map_err(|e| e.to_string())?;
    let mut expected_id = 0i64;
    let mut next_from = s.increment();
    for b in &batches {
        for row in texts(b, &["b".to_string(), "min_lsn".to_string(), "max_lsn".to_string()])? {
            let f: Vec<&str> = row.split(" | ").collect();
            let id: i64 = f[0].parse().map_err(|e| format!("batch id {}: {e}", f[0]))?;
            let (from, to) = (Lsn::parse(f[1]).map_err(|e| e.to_string())?, Lsn::parse(f[2]).map_err(|e| e.to_string())?);
            if id != expected_id {
                return Err(format!("the facts' batch ids skip or repeat: batch {id} where {expected_id} was due"));
            }
            if from != next_from {
                return Err(format!("batch {id} starts at {from}, but the previous range ended just before {next_from}: a gap or an overlap"));
            }
            if to < from.decrement() {
                return Err(format!("batch {id} ends at {to} before it starts at {from}"));
            }
            expected_id += 1;
            next_from = to.increment();
        }
    }
    Ok(())
}

/// Rewrites the two leading binary LSN fields of a change row's text as 0x-hex.
fn hex_lsns(text: &str) -> String {
    let mut parts: Vec<String> = text.split(" | ").map(str::to_string).collect();
    for p in parts.iter_mut().take(2) {
        if !p.starts_with("0x") {
            *p = format!("0x{}", p.to_lowercase());
        }
    }
    parts.join(" | ")
}

async fn snapshot_lsn_from_facts(facts: &str) -> Result<Lsn, String> {
    let t = delta::open_existing(facts, &Default::default()).await.map_err(|e| e.to_string())?.ok_or("facts was never created")?;
    let b = delta::query(&t, "SELECT MIN(min_lsn) AS s FROM t WHERE event = 'snapshot_open'").await.map_err(|e| e.to_string())?;
    let v = b.first().and_then(|b| texts(b, &["s".to_string()]).ok()).and_then(|v| v.into_iter().next()).ok_or("facts hold no snapshot open")?;
    Lsn::parse(&v).map_err(|e| format!("facts' snapshot LSN {v}: {e}"))
}
