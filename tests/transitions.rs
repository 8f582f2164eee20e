//! Golden logs per transition of the state machine (`engine::machine`), and
//! the same transitions crashed at each commit boundary they pass.
//!
//! Two deterministic scenarios on the simulator's manual clock, driven only
//! by `mssql-cdc step <name>`: a chunked bootstrap (chunks of a few rows,
//! one chunk a wave, so several waves) with a writer whose changes the
//! stream lane commits while the snapshot is open, and a full bootstrap
//! followed by one batch. Each call names its transition: the one the
//! machine names next (the stream lane's unless it is idle, else
//! backfill's), as the previous call printed it unless the writer has
//! changed the source since. Naming it makes `step` check it is allowed.
//! The log holds, per call, `transition <name>: <state before> -> <state
//! after>` and the commits the call added to bronze, facts and the plans
//! table, one line each (`delta::golden::render`).
//!
//! Then the crashes. Before each call that commits, the targets are saved;
//! the call is run again from that copy once per failpoint of
//! `engine::FAILPOINTS` (`MSSQL_CDC_FAILPOINTS=<fp>=return`). A call that
//! stops at it is followed by `step next` until the machine is back in the
//! clean call's state after, and the three tables, rendered whole, must then
//! be the clean run's, commit for commit. A failpoint the call does not pass
//! leaves it running as the clean call, which must give the same tables
//! too. The end of the log has one line per crash, naming the transitions
//! that repaired it, so the golden file pins how each crash is mended.
//!
//! Why save and restore: replaying the scenario from its start for every
//! (call, failpoint) pair would cost thousands of process starts; a copy of
//! the targets taken before the call costs a few milliseconds. The copy is
//! restored in place, because the facts rows record bronze's absolute path
//! (a moved copy is refused). The simulator's file is neither saved nor
//! restored: this process holds it open (`Scenario::db`), and a SQLite file
//! replaced under an open connection leaves that connection on the unlinked
//! one. It needs no restore either: with the clock manual and the capture
//! job settled before each call, a call reads the source and writes nothing
//! to it, which the test checks (the clock and the max LSN stay where they
//! were across every crash and rerun).
//!
//! Every call is one transition and nothing more: `step wave` never
//! records the completion, even after the last wave (the machine is then in
//! ChunksRead, and `complete` is a call of its own), and the rerun of a wave
//! a crash cut finishes that wave and reads no other. No call is cut at a
//! failpoint to make it so (the golden log would show the completion in the
//! last wave's block, and a rerun reading a second wave, if it were not).
//!
//! A full open cut after its open row or its bronze commit leaves the
//! machine in FullReading with the stream not started: the stream lane
//! names `open` again there (nothing tells a dead full run from a slow one;
//! the rerun reuses the open row recorded at the same S, or completes the
//! snapshot from bronze's commit), so those crashes rerun like the others.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::Scenario;
use mssql_cdc::delta::{self, golden, plans};
use mssql_cdc::engine::machine::{self, Lane, Transition};
use mssql_cdc::engine::{self, Context};
use mssql_cdc::lsn::Lsn;
use serde_json::{json, Value};
use tokio::runtime::Runtime;

/// 24 rows in chunks of 6, one chunk a wave (parallelism 1, and
/// `target_wave_seconds = 0` sizes every wave to one round): four waves or so.
const CHUNKED: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 1\nchunk_rows = 6\ntarget_wave_seconds = 0\n\
                       [stream]\nmax_batch_rows = 1000\n";
const FULL: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\n";
const ROWS: i64 = 24;
/// The transactions the writer makes at each of its points.
const WRITES: usize = 3;

/// The golden lines of bronze, facts and the plans table, in that order.
type Tables = Vec<Vec<String>>;

/// Where the machine stands: its state as `step` prints it (`{state,
/// detail}`) and the transition each lane names next.
#[derive(Clone)]
struct Where {
    state: Value,
    stream: Transition,
    backfill: Transition,
}

impl Where {
    fn label(&self) -> String {
        self.state["state"].as_str().expect("a state label").to_string()
    }

    /// The transition a driver runs next, as `step next` picks it: the
    /// stream lane's unless it is idle, else backfill's.
    fn next(&self) -> &'static str {
        if self.stream != Transition::Idle {
            self.stream.name()
        } else {
            self.backfill.name()
        }
    }
}

/// How one `step` call ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum End {
    Done,
    /// Exit 75 at this armed failpoint.
    Failpoint(&'static str),
}

/// The end of a call with `armed` failpoints; any other failure fails the test.
fn end_of(code: i32, j: &Value, armed: &[&'static str]) -> End {
    if code == 0 {
        return End::Done;
    }
    let error = j["error"].as_str().unwrap_or_default();
    match armed.iter().find(|f| error.contains(&format!("failpoint '{f}'"))) {
        Some(&f) if code == 75 => End::Failpoint(f),
        _ => panic!("exit {code}, not at an armed failpoint {armed:?}: {j}"),
    }
}

/// The commit boundaries a `step` call may pass: `engine::FAILPOINTS` but
/// those of `apply` and `reconcile`, steps `step` never runs. Which of them
/// a call does pass is found by arming each one.
fn candidates() -> impl Iterator<Item = &'static str> {
    engine::FAILPOINTS.iter().copied().filter(|f| !f.starts_with("apply.") && !f.starts_with("reconcile."))
}

/// The lines `after` adds to `before`, table by table. Delta commits are only
/// ever appended, so a call that changed an older line is a failure.
fn added(before: &Tables, after: &Tables) -> Vec<String> {
    before
        .iter()
        .zip(after)
        .flat_map(|(b, a)| {
            assert!(a.starts_with(b), "a call changed commits it did not make: {b:?} -> {a:?}");
            a[b.len()..].to_vec()
        })
        .collect()
}

/// The tables without the mark a repair leaves on the rows it writes
/// (`"repaired":true` in a facts row rewritten from bronze's commit): a
/// crash repaired by the rerun must leave the clean run's commits, but its
/// repair says it was one.
fn unmarked(tables: &Tables) -> Tables {
    tables.iter().map(|t| t.iter().map(|l| l.replace(",\"repaired\":true", "").replace("\"repaired\":true,", "")).collect()).collect()
}

/// Every commit of the table at `location`, one line each (none when it does not exist yet).
async fn render(location: &str, label: &str) -> Vec<String> {
    // Not opened when absent, so that looking never creates its folder.
    if !Path::new(location).exists() {
        return Vec::new();
    }
    match delta::open_existing(location, &Default::default()).await.unwrap() {
        Some(t) => golden::render(&t, label).await.unwrap(),
        None => Vec::new(),
    }
}

// ---------------------------------------------------------------------------
// Saving and restoring the targets in place (see the module docs).

/// The simulator's own files (`source.sqlite` and its WAL and shared-memory files).
fn is_simulator_file(name: &std::ffi::OsStr) -> bool {
    name.to_str().is_some_and(|n| n.starts_with("source.sqlite"))
}

fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            copy_tree(&e.path(), &to.join(e.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap();
    }
}

/// Copies everything in `dir` but the simulator's files to `to`, replacing what `to` held.
fn save_targets(dir: &Path, to: &Path) {
    if to.exists() {
        std::fs::remove_dir_all(to).unwrap();
    }
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if !is_simulator_file(&e.file_name()) {
            copy_tree(&e.path(), &to.join(e.file_name()));
        }
    }
}

/// Removes everything in `dir` but the simulator's files, then copies `from` back into it.
fn restore_targets(dir: &Path, from: &Path) {
    let entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap()).filter(|e| !is_simulator_file(&e.file_name())).collect();
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p).unwrap();
        } else {
            std::fs::remove_file(&p).unwrap();
        }
    }
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        copy_tree(&e.path(), &dir.join(e.file_name()));
    }
}

// ---------------------------------------------------------------------------
// The driver: the clean run, and the crashes at each of its calls.

/// One act of a scripted run ([`Driver::run_script`]).
enum Act {
    /// The writer makes [`WRITES`] transactions and the capture job takes them.
    Write,
    /// The stream stops past the retention (`common::pass_the_retention`).
    PassRetention { days: u32 },
    /// `step <name>`, which must be what the machine names next, cut at a
    /// failpoint that leaves the named state when given.
    Call { name: &'static str, cut: Option<(&'static str, &'static str)> },
}

const fn call(name: &'static str) -> Act {
    Act::Call { name, cut: None }
}

struct Driver {
    rt: Runtime,
    s: Scenario,
    /// The saved targets: `before` the current call, and the clean call's `after`.
    saved: tempfile::TempDir,
    log: Vec<String>,
    crash_lines: Vec<String>,
    /// The transitions of the clean run, in call order.
    ran: Vec<&'static str>,
    /// The failpoints a crash stopped at.
    hit: BTreeSet<&'static str>,
    /// (transition, failpoint) of the crashes `step` never reran.
    stuck: Vec<(&'static str, &'static str)>,
    /// The number the next call or act takes in the log (acts of a script
    /// are numbered too, so a script's calls keep their place).
    numbered: usize,
}

impl Driver {
    fn new(title: &str, workflow: &str) -> Driver {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        Driver {
            rt,
            s: Scenario::new(ROWS, workflow),
            saved: tempfile::tempdir().unwrap(),
            log: vec![title.to_string()],
            crash_lines: Vec::new(),
            ran: Vec::new(),
            hit: BTreeSet::new(),
            stuck: Vec::new(),
            numbered: 0,
        }
    }

    /// The machine's state now, read as `step` reads it (nothing written).
    fn where_now(&self) -> Where {
        let wf = self.s.workflow();
        self.rt.block_on(async move {
            let mut ctx = Context::open_read_only(wf).await.unwrap();
            let (state, inputs) = engine::step::load(&mut ctx).await.unwrap();
            Where {
                state: json!({"state": state.label(), "detail": state}),
                stream: machine::next(&state, &inputs, Lane::Stream).transition,
                backfill: machine::next(&state, &inputs, Lane::Snapshot).transition,
            }
        })
    }

    /// Bronze, facts and plans rendered whole, the scenario's folder as `<dir>`.
    fn tables(&self) -> Tables {
        let wf = self.s.workflow();
        let dir = self.s.path().to_str().unwrap().to_string();
        let locations = [("bronze", wf.target.bronze.clone()), ("facts", wf.target.facts.clone()), ("plans", plans::location_for(&wf.target.bronze))];
        self.rt.block_on(async {
            let mut out: Tables = Vec::new();
            for (label, location) in locations {
                out.push(render(&location, label).await.into_iter().map(|l| l.replace(&dir, "<dir>")).collect());
            }
            out
        })
    }

    /// The simulator's clock and max LSN: a call that wrote to the source would move them.
    fn source_clock(&self) -> (chrono::DateTime<chrono::Utc>, Option<Lsn>) {
        (self.s.db.now().unwrap(), self.s.db.max_lsn().unwrap())
    }

    /// `mssql-cdc step <name>` with `armed` failpoints: (exit code, JSON).
    fn step(&self, name: &str, armed: &[&str]) -> (i32, Value) {
        let spec = armed.iter().map(|f| format!("{f}=return")).collect::<Vec<_>>().join(";");
        let env: Vec<(&str, &str)> = if spec.is_empty() { Vec::new() } else { vec![("MSSQL_CDC_FAILPOINTS", spec.as_str())] };
        common::step(&self.s, &["step", name], &env)
    }

    fn save(&self, name: &str) {
        save_targets(self.s.path(), &self.saved.path().join(name));
    }

    fn restore(&self, name: &str) {
        restore_targets(self.s.path(), &self.saved.path().join(name));
    }

    /// The clean run, to both lanes idle. The writer makes [`WRITES`]
    /// transactions (and the capture job takes them) the first time the
    /// machine is in each state of `writer_in`, so the stream lane commits a
    /// batch there: fixed points, so every run makes the same calls.
    fn run(&mut self, writer_in: &[&str]) {
        let mut written = BTreeSet::new();
        // Calls are numbered across the driver's runs, as the log shows them.
        let offset = self.numbered;
        for k in offset..offset + 30 {
            let mut here = self.where_now();
            let label = here.label();
            let writes_here = writer_in.contains(&label.as_str()) && !written.contains(&label);
            if writes_here {
                written.insert(label);
                self.s.changes(WRITES);
                common::settle(&self.s.db);
                self.log.push(format!("writer: {WRITES} transactions, captured"));
                here = self.where_now();
            }
            if here.next() == "idle" {
                return;
            }
            self.numbered = k + 1;
            self.call(k, here, None);
        }
        panic!("the scenario did not end in 30 calls; it ran {:?}", self.ran);
    }

    /// A scripted run: each act in order, every call checked to be the one
    /// the machine names next, ending with both lanes idle.
    fn run_script(&mut self, script: &[Act]) {
        self.run_acts(script);
        let end = self.where_now();
        assert_eq!(end.next(), "idle", "the script ends with {} next in {}", end.next(), end.label());
    }

    /// [`Driver::run_script`] without the check that both lanes end idle.
    fn run_acts(&mut self, script: &[Act]) {
        let offset = self.numbered;
        self.numbered += script.len();
        for (i, act) in script.iter().enumerate() {
            let k = offset + i;
            match *act {
                Act::Write => {
                    self.s.changes(WRITES);
                    common::settle(&self.s.db);
                    self.log.push(format!("writer: {WRITES} transactions, captured"));
                }
                Act::PassRetention { days } => {
                    common::pass_the_retention(&mut self.s, days);
                    self.log.push(format!("the stream stops; writes; {days} days pass; the capture job runs, then cleanup (3 days' retention)"));
                }
                Act::Call { name, cut } => {
                    let here = self.where_now();
                    assert_eq!(here.next(), name, "act {k}: the machine names '{}' in {}, the script '{name}'", here.next(), here.label());
                    self.call(k, here, cut);
                }
            }
        }
    }

    /// Clean call `k`: its block of the log, then its crashes. `cut` stops
    /// the call at a failpoint, the state it leaves named: the boundary
    /// where the transition's own commits end when the step that runs it
    /// would go on to the next transition's.
    fn call(&mut self, k: usize, before: Where, cut: Option<(&'static str, &'static str)>) {
        let name = before.next();
        let armed: Vec<&'static str> = cut.map(|(fp, _)| vec![fp]).unwrap_or_default();
        let tables_before = self.tables();
        self.save("before");
        let (code, j) = self.step(name, &armed);
        let end = end_of(code, &j, &armed);
        let after = self.where_now();
        match end {
            // `step` printed the states and lanes the test reads itself.
            End::Done => {
                assert_eq!(j["transition"], name, "{j}");
                assert_eq!(j["before"], before.state, "{j}");
                assert_eq!(j["after"], after.state, "{j}");
                assert_eq!(j["next"]["stream"]["transition"], after.stream.name(), "{j}");
                assert_eq!(j["next"]["backfill"]["transition"], after.backfill.name(), "{j}");
            }
            // The cut call stopped where its transition's commits end (for
            // the last wave: every chunk recorded, the completion not).
            End::Failpoint(_) => assert_eq!(after.label(), cut.expect("only a cut call stops").1, "{j}"),
        }
        let tables_after = self.tables();
        let note = cut.map(|(fp, _)| format!(" (cut at {fp})")).unwrap_or_default();
        self.log.push(format!("transition {name}: {} -> {}{note}", before.label(), after.label()));
        self.log.extend(added(&tables_before, &tables_after).into_iter().map(|l| format!("  {l}")));
        self.ran.push(name);
        // A call that commits nothing has no commit boundary to crash at.
        if tables_after != tables_before {
            self.save("after");
            self.crash_each_boundary(k, name, &armed, end, &after, &tables_after);
            self.restore("after");
            assert_eq!(self.tables(), tables_after, "call {k}'s clean tables are back");
        }
    }

    /// Call `k` again from its saved targets once per candidate failpoint.
    fn crash_each_boundary(&mut self, k: usize, name: &'static str, clean_armed: &[&'static str], clean_end: End, after: &Where, tables_after: &Tables) {
        let source_before = self.source_clock();
        for fp in candidates() {
            self.restore("before");
            let mut armed = vec![fp];
            armed.extend(clean_armed.iter().copied().filter(|c| *c != fp));
            let (code, j) = self.step(name, &armed);
            let end = end_of(code, &j, &armed);
            if end == clean_end {
                // Not on this call's path: it ran as the clean call did, to
                // the same commits (and so the same state, which derives
                // from these tables and the unchanged source).
                assert_eq!(self.tables(), *tables_after, "{name} #{k} with {fp} armed, which it does not pass");
                continue;
            }
            assert_eq!(end, End::Failpoint(fp), "{name} #{k}: {j}");
            self.hit.insert(fp);
            let line = match self.rerun_until(after) {
                Ok(reruns) => {
                    assert_eq!(
                        unmarked(&self.tables()),
                        unmarked(tables_after),
                        "a crash at {fp} in {name} #{k}, rerun by {reruns:?}: the tables are not the clean run's"
                    );
                    let by = if reruns.is_empty() { "nothing".to_string() } else { reruns.join(", ") };
                    format!("crash {fp} in {name} #{k}: rerun by {by} -> same tables")
                }
                Err(state) => {
                    self.stuck.push((name, fp));
                    format!("crash {fp} in {name} #{k}: rerun by idle -> stuck in {state}")
                }
            };
            self.crash_lines.push(line);
        }
        // Why the simulator's file needs no restore (module docs).
        assert_eq!(self.source_clock(), source_before, "the calls at {name} #{k} wrote to the simulator");
    }

    /// After a crash: `step next` until the machine is
    /// in `want`'s state again. Returns the transitions the reruns ran, or
    /// Err(state) when the machine names nothing to do before that (it
    /// waits, and no `step` call leaves that state).
    fn rerun_until(&mut self, want: &Where) -> Result<Vec<&'static str>, String> {
        let mut reruns = Vec::new();
        for _ in 0..4 {
            let now = self.where_now();
            if now.state == want.state {
                return Ok(reruns);
            }
            let expected = now.next();
            let (code, j) = self.step("next", &[]);
            match end_of(code, &j, &[]) {
                End::Done => assert_eq!(j["transition"], expected, "{j}"),
                End::Failpoint(fp) => panic!("a rerun with no failpoint armed stopped at {fp}: {j}"),
            }
            if expected == "idle" {
                assert_eq!(self.where_now().state, now.state, "an idle call moved the machine");
                return Err(now.label());
            }
            reruns.push(expected);
        }
        panic!("four reruns did not bring the machine back to {}", want.state);
    }

    /// The golden log: the blocks of the clean run, then one line per crash.
    fn golden(&self) -> String {
        let mut lines = self.log.clone();
        lines.push("crashes (each call again from its saved targets, stopped at one failpoint, then step next):".into());
        lines.extend(self.crash_lines.iter().cloned());
        lines.join("\n")
    }
}

/// The commit boundaries a chunked snapshot's transitions and the stream's
/// batches beside it pass, written out here (not read from
/// `engine::FAILPOINTS`) so the test can disagree with the engine's list.
const CHUNKED_BOUNDARIES: [&str; 10] = [
    "chunked.after_open_plans",
    "chunked.after_open",
    "chunked.after_plan_plans",
    "chunked.after_plan",
    "chunked.after_wave_bronze",
    "chunked.after_wave_plans",
    "chunked.after_wave_facts",
    "chunked.after_complete",
    "stream.after_bronze",
    "stream.after_facts",
];

#[test]
fn golden_transitions_of_a_chunked_bootstrap_with_a_crash_at_each_commit_boundary() {
    let mut d = Driver::new("chunked bootstrap: 24 rows, chunks of 6, one chunk a wave", CHUNKED);
    // A batch while the snapshot is opened, planned, and fully read.
    d.run(&["chunked_opened", "chunked_planned", "chunks_read"]);
    for t in ["open", "commit", "plan", "wave", "complete"] {
        assert!(d.ran.contains(&t), "the clean run never ran '{t}': {:?}", d.ran);
    }
    let waves = d.ran.iter().filter(|t| **t == "wave").count();
    assert!(waves >= 3, "the snapshot was read in {waves} waves: {:?}", d.ran);
    // The commit boundaries a chunked bootstrap passes, each crashed at
    // least once. Not stream.after_start: a chunked open starts the
    // stream at S, and `stream` records a start only for a stream without a
    // position (engine::stream::record_start); nor the full snapshot's,
    // switch's or recovery's.
    let want = BTreeSet::from(CHUNKED_BOUNDARIES);
    assert_eq!(d.hit, want);
    assert!(d.stuck.is_empty(), "crashes step never reran: {:?}", d.stuck);
    // The clean run's targets, restored last, are the source's change log from S.
    common::assert_targets_match_source_blocking(&d.s.db, &d.s.table, &d.s.wf_path);
    let log = d.golden();
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_transitions_chunked", log));
}

#[test]
fn golden_transitions_of_a_full_bootstrap_with_a_crash_at_each_commit_boundary() {
    let mut d = Driver::new("full bootstrap: 24 rows, then a batch", FULL);
    // The open reads the whole table and completes it in one call; then one batch.
    d.run(&["streaming"]);
    assert_eq!(d.ran, ["open", "commit"]);
    // Not stream.after_start: a bootstrap's stream starts at its snapshot's S.
    let want = BTreeSet::from(["snapshot.after_open", "snapshot.after_bronze", "snapshot.after_event", "stream.after_bronze", "stream.after_facts"]);
    assert_eq!(d.hit, want);
    // A full open cut after its open row or its bronze commit is opened
    // again by the stream lane (FullReading, not started), to the same tables.
    assert!(d.stuck.is_empty(), "crashes step never reran: {:?}", d.stuck);
    common::assert_targets_match_source_blocking(&d.s.db, &d.s.table, &d.s.wf_path);
    let log = d.golden();
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_transitions_full", log));
}

const NO_BOOTSTRAP: &str = "[stream]\nmax_batch_rows = 1000\nstart = \"earliest\"\n";
const FULL_RECOVERING: &str =
    "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";

#[test]
fn golden_transitions_of_a_start_and_a_repair_with_a_crash_at_each_commit_boundary() {
    let mut d = Driver::new("stream without a bootstrap: a start, a batch cut between its two commits, its repair, a batch", NO_BOOTSTRAP);
    d.run_script(&[
        call("start"),
        Act::Write,
        // Bronze's commit in, the facts row not: the half-recorded batch the repair mends.
        Act::Call { name: "commit", cut: Some(("stream.after_bronze", "half_recorded")) },
        call("repair"),
        Act::Write,
        call("commit"),
    ]);
    assert_eq!(d.ran, ["start", "commit", "repair", "commit"]);
    // The cut commit is not crashed at stream.after_bronze (that is its clean
    // outcome); the last commit is, and at its facts commit.
    let want = BTreeSet::from(["stream.after_start", "repair.after_facts", "stream.after_bronze", "stream.after_facts"]);
    assert_eq!(d.hit, want);
    assert!(d.stuck.is_empty(), "crashes step never reran: {:?}", d.stuck);
    common::assert_targets_match_source_blocking(&d.s.db, &d.s.table, &d.s.wf_path);
    let log = d.golden();
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_transitions_start_repair", log));
}

#[test]
fn golden_transitions_of_a_recovery_with_a_crash_at_each_commit_boundary() {
    let mut d = Driver::new("full bootstrap, a batch, the stream stopped past the retention, its recovery and re-snapshot, a batch", FULL_RECOVERING);
    d.run_script(&[
        call("open"),
        Act::Write,
        call("commit"),
        Act::PassRetention { days: 4 },
        // The recovery row only: generation 1 recorded, its re-snapshot not taken.
        call("recover"),
        call("resnapshot"),
        Act::Write,
        call("commit"),
    ]);
    assert_eq!(d.ran, ["open", "commit", "recover", "resnapshot", "commit"]);
    let want = BTreeSet::from([
        "snapshot.after_open",
        "snapshot.after_bronze",
        "snapshot.after_event",
        "stream.after_bronze",
        "stream.after_facts",
        "recover.after_recovery_row",
    ]);
    assert_eq!(d.hit, want);
    assert!(d.stuck.is_empty(), "crashes step never reran: {:?}", d.stuck);
    let st = d.where_now();
    assert_eq!(st.state["detail"]["generation"], 1, "{}", st.state);
    // Bronze's image by the records' rule (the re-snapshot's rows and the
    // changes after it, the test's own SQL) is the simulator's table.
    let rows = d.rt.block_on(async {
        let ctx = d.s.context().await.unwrap();
        engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
    });
    let newest = common::newest_completion(&rows).expect("a completed re-snapshot");
    common::assert_image_is_table(&common::table_rows_by_id(&d.s), &common::bronze_image(&d.rt, &d.s, newest));
    let log = d.golden();
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_transitions_recovery", log));
}

const CHUNKED_RECOVERING: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 1\nchunk_rows = 6\ntarget_wave_seconds = 0\n\
                                  [stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";

/// The chunked recovery, transition by transition: `recover` writes the
/// recovery row alone, `resnapshot` opens the chunked snapshot of
/// generation 1 alone (no batch, no plan), and `plan`, `wave` and `complete`
/// read it as a bootstrap's; a crash at each commit boundary of each call.
#[test]
fn golden_transitions_of_a_chunked_recovery_with_a_crash_at_each_commit_boundary() {
    let mut d = Driver::new("chunked bootstrap, the stream stopped past the retention, its recovery and chunked re-snapshot", CHUNKED_RECOVERING);
    d.run(&["chunked_planned"]);
    let bootstrap_calls = d.ran.len();
    d.run_acts(&[Act::PassRetention { days: 4 }, call("recover"), call("resnapshot")]);
    assert_eq!(d.ran[bootstrap_calls..], ["recover", "resnapshot"]);
    let opened = d.where_now();
    assert_eq!(opened.label(), "chunked_opened", "{}", opened.state);
    assert_eq!(opened.state["detail"]["generation"], 1, "{}", opened.state);
    d.run(&["chunked_planned"]);
    for t in ["plan", "wave", "complete"] {
        assert!(d.ran[bootstrap_calls + 2..].contains(&t), "generation 1's snapshot never ran '{t}': {:?}", d.ran);
    }
    let want: BTreeSet<&str> = CHUNKED_BOUNDARIES.into_iter().chain(["recover.after_recovery_row"]).collect();
    assert_eq!(d.hit, want);
    assert!(d.stuck.is_empty(), "crashes step never reran: {:?}", d.stuck);
    assert_eq!(d.where_now().state["detail"]["generation"], 1);
    // Bronze's image by the records' rule (generation 1's chunk rows and the
    // changes after its S, the test's own SQL) is the simulator's table;
    // cleanup removed the change log before the loss, so no comparison
    // with it from the start.
    let rows = d.rt.block_on(async {
        let ctx = d.s.context().await.unwrap();
        engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
    });
    let newest = common::newest_completion(&rows).expect("a completed re-snapshot");
    common::assert_image_is_table(&common::table_rows_by_id(&d.s), &common::bronze_image(&d.rt, &d.s, newest));
    let log = d.golden();
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_transitions_recovery_chunked", log));
}
