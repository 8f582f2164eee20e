//! `mssql-cdc torture`: seeded, randomized schedules of writes, steps, crashes,
//! source faults and cleanups against the simulator, each checked at its end
//! against the simulator's own rows and change log.
//!
//! A schedule is drawn from one seed: a table shape (an integer primary key,
//! a string primary key under a case-insensitive collation, a heap), a
//! snapshot mode (full or chunked, the chunks sometimes cut on a repeated
//! column), what it injects besides crashes (a share of calls that meet a
//! source fault; big transactions; cleanups inside the CDC retention;
//! cleanups past the stream, with the workflow's `stream.on_data_loss` set to
//! `resnapshot` or `skip`; a capture-instance switch; a bootstrap by `seed`
//! from a copy, and reseeds), then a run of events:
//! transactions of a writer
//! (inserts, updates, deletes, key changes, keys respelled in place,
//! set-based key swaps, duplicate heap rows; in a share of schedules big
//! ones), capture lag (a write left uncaptured for a while), cleanups, the
//! switch, copies of the table, and the calls an orchestrator makes (`seed`,
//! `seed --reseed`, `stream`, `backfill`, `apply`, `reconcile`, `status`),
//! alone or two at once, each possibly crashed and later called again, some
//! meeting a source fault armed just before them.
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
//! # Source faults
//!
//! In a share of schedules a share of calls meet one fault, armed in the
//! simulator right before the call (so a child process meets it too): a
//! dropped connection or a numbered server error the client classifies as
//! transient (1205 deadlock victim, 601 NOLOCK scan lost its place, 3961
//! SNAPSHOT against a DDL, 1222 lock timeout, 40613 database unavailable,
//! 10054 connection reset), on the next snapshot read, change read or
//! either, after 0 to 40 rows, once or twice (a chunk read retries in
//! process, so twice tests the retry as well). A faulted call must end with
//! "call again later" (exit 75) or succeed, and leave nothing the final
//! checks would see. A fault the call never met (it read nothing of that
//! kind) is taken right after it by reads of the tester's own, so that no
//! fault outlives the call it was drawn for: none reaches a cleanup's
//! record, the drain or the checks.
//!
//! # Big transactions
//!
//! In a share of schedules some writer transactions are big: hundreds of
//! fresh rows inserted, each updated one to three times (an integer key
//! sometimes moved to a fresh key), then all but at most four deleted, in one
//! transaction. That is thousands of change rows under one commit LSN, far
//! more than the workflow's `max_batch_rows` (2 to 30), so the batch that
//! reads it must run past its row limit to the transaction's end (a batch
//! never splits a transaction), while the table, and so a chunked
//! snapshot's plan, grows by at most four rows.
//!
//! # Cleanups, and the change log the model keeps
//!
//! A cleanup moves the capture instance's min LSN up to a watermark (the
//! commit LSN of a change row, as a real cleanup's watermark is a real LSN)
//! and deletes the change rows below it, as `sys.sp_cdc_cleanup_change_table`
//! does. *Inside the retention* the watermark is at most where the stream
//! stands (the newest live generation's newest batch end, or the S of the
//! snapshot that made it live, as the facts say): only changes bronze holds, or the
//! snapshot covers, are purged, and nothing the steps do may change. *Past
//! the stream* the watermark is more than one LSN above that, so changes the
//! stream never read are gone. Such schedules set `on_data_loss =
//! "resnapshot"` (with `resnapshot_interval_days = 0.0`: the anti-loop guard
//! would otherwise stop the second loss of a schedule), or, for an integer
//! key in full mode only, `"skip"` (a skip is refused while a chunked
//! snapshot is open, and lost changes can leave a heap's or a respelled
//! string key's silver where `apply` rightly refuses to go on). Schedules
//! without cleanups past the stream keep the default `"fail"`: a loss the
//! engine believes in there is a failure.
//!
//! The reference for bronze is the change log as the simulator *held* it,
//! not as it holds it at the end, since cleanups delete rows bronze must
//! still hold. Right before each cleanup the tester reads the change
//! function from the instance's min LSN to the max LSN (with the model's
//! row filter) and keeps the rows below the watermark: exactly the rows the
//! cleanup deletes. This is exact because the capture job writes change rows
//! in LSN order and the watermark is at most the max LSN, so every row below
//! it is captured and none can be added below it later, and because nothing
//! else purges (no automatic cleanup is configured, no cleanup runs while a
//! call reads, and the min LSN only moves up). At the end the model's change
//! log is the rows recorded so far plus what the change function returns
//! from the min LSN to the max LSN: every change row ever captured, once.
//! The recorded rows and each cleanup's watermark are kept in the schedule's
//! folder (`model.json`), so that [`recheck`] runs the same checks again.
//! Where a watermark is drawn reads the facts (the engine's claim of how far
//! it streamed); no check does. A watermark drawn from a wrong claim only
//! turns a cleanup inside the retention into a loss, which the checks then
//! see as rows missing from bronze.
//!
//! # A capture-instance switch
//!
//! In a share of the schedules without a data loss, once, between two calls
//! (in a schedule that seeds, once the seed is done):
//! a nullable column is added at the end of the table and a second capture
//! instance (`dbo_t_v2`) is enabled at once (no write in between, so every
//! value the column ever holds is in a change row of the newer instance),
//! then the writer commits (its
//! inserts and updates fill the new column from then on). The stream must
//! follow: the older instance up to the newer one's start LSN (exclusive),
//! the newer one from there, bronze and silver gaining the column. The model
//! takes its change log the same way from the source's own instances: the
//! older instance's rows below the start LSN the newer one had when it was
//! enabled (kept in `model.json`), the newer one's from it, the added
//! column NULL in the older rows (as bronze holds them). Both instances
//! capture every change after that start, so the split is exact wherever the
//! stream switches, and a cleanup inside the retention never moves the
//! newer instance's start before the stream has switched (it stays below
//! where the stream stands, which is below that start until the switch).
//! Cleanups past the stream are not drawn with a switch: one that passed the
//! newer start before the stream switched would give both instances the
//! same start LSN, and nothing would tell the newer one.
//!
//! # Seeds
//!
//! In a share of the schedules (drawn from a generator of their own, so
//! that a schedule that does not seed draws what it drew before seeds were
//! added) the stream bootstraps from a copy of the table instead of a
//! snapshot (ADR 0025). At the first call event the tester takes the copy as
//! a user would: it lets the clock pass any capture lag and runs a capture
//! scan (always for a copy by time, so that a commit before the time is
//! never captured only after a seed call mapped it; for a heap; for a
//! reseed; for half the keyed copies by LSN, the others holding commits
//! above the max LSN the capture job has not taken yet), records the point
//! (the max LSN, or the clock's time, passed in UTC or at -03:00), lets the
//! writer commit up to two transactions while the copy runs (a keyed table
//! only: commits after the point the copy holds, which the stream replays;
//! a heap's silver counts every change after the seed's L, a seed has no
//! read fence, so a heap's copy holds exactly the commits up to its point),
//! then reads the table (the rows go to `model.json`) and exports it as
//! Parquet files (`seed_copy::export_parquet`). An empty table is written to
//! first: `seed` refuses an empty copy. Until a call of
//! `seed --copy DIR --as-of X` succeeds, `seed` and `status` are the only
//! steps called alone (an orchestrator seeds before it schedules the rest),
//! but half of the pairs of calls at once are the seed and a `stream` or a
//! `backfill` (`seed_races`: a schedule that started too early), whose
//! snapshot takes generation 0 another way. Exactly one of the two wins: the
//! seed, or the other step, and then the seed is refused (exit 2,
//! `seeds_refused`), none of its rows may be left in bronze, and the
//! schedule goes on as one that never seeded. A seed cut in the race may
//! still be pending when the drain starts; the drain's call of it is then
//! refused and judged the same way. After the seed the steps are
//! the usual ones, and `seed` again now and then (a rerun returns the seed
//! and writes nothing, after cleanups too).
//!
//! Where a reseed is legal (no data loss and no switch: nothing else takes
//! a snapshot, so none is open, and the copy is fitted to one capture
//! instance) the tester takes up to two newer copies, each after a writer
//! commit it captures first (so its L is above the last seed's), and
//! `seed --reseed` with it becomes a frequent step until a call succeeds;
//! meanwhile no cleanup runs (it could purge the changes after the copy's
//! point before the newer generation reads them). Seed calls are crashed,
//! killed and paired like the others and counted in the mix (`seed`,
//! `seed --reseed`); the drain calls every seed still pending first.
//!
//! # The checks
//!
//! At the end, after the writer stops and every step has been called until
//! it has nothing left to do (no faults armed, no cleanups), the checks do
//! not ask the engine:
//! - the facts split the stream into generations: one starts at the S of
//!   the snapshot that made it live (its `bootstrap` or `resnapshot` row, or
//!   its chunked `snapshot_open` row); its batch rows have ids 0, 1, 2, ...
//!   and their ranges tile the LSNs after S without a gap or an overlap,
//!   except that a batch with a `data_skipped` row starts where the skipped
//!   range ends, and that range starts right after the batch before; a
//!   generation ends where its last batch does (at S without batches) and
//!   the next one starts after that, except a reseed's (its S is a seed's),
//!   which starts after the older generation's S, possibly before its end
//!   (the stream had read past the newer copy's point);
//! - bronze's change rows are exactly the model's change rows (above) of
//!   each generation's range, from S (exclusive) to its end (the newest
//!   generation to the max LSN), less the rows of the skipped ranges, every
//!   column of the table as it is now, as a multiset: none lost, none twice
//!   (a row in the ranges of two generations, after a reseed, counts twice:
//!   the newer generation writes it again);
//! - the facts' seed completions (a `bootstrap` or `resnapshot` row whose
//!   detail says `"mode": "seed"`) are the copies the schedule took, one
//!   each and in order, the first one generation 0's, each one its
//!   generation's S; each one's L is the LSN the copy was given or, for a
//!   time T, at or after the newest mapping row 2 s before T (recorded when
//!   the copy was taken), below every change row of the model's log
//!   committed after T (above the max LSN when the copy started), and
//!   mapped to a time at or before T where the mapping row is still there;
//!   bronze's whole-snapshot rows (operation 0, no chunk) at those Ls are
//!   exactly the copies' rows (the table's columns, a column added later
//!   NULL), stamped `_start_lsn = _snapshot = L` with `_seqval`,
//!   `_command_id` and `_batch_id` NULL, as a multiset: a seed that lost a
//!   row of its copy, loaded one twice or loaded a copy twice fails. Without
//!   a data loss nothing else takes a snapshot, so they are bronze's only
//!   whole-snapshot rows;
//! - every move to a newer generation that is not a reseed matches a real purge: a cleanup ran
//!   while the stream stood at or before the older generation's end, with a
//!   watermark more than one LSN past that end, so the changes right after it
//!   were gone before the stream read them;
//! - every `data_skipped` row matches a real purge: it is certain (no cleanup
//!   runs during a read here), its range ends at the watermark of a cleanup
//!   that ran while the stream stood before the range's start, and (by the
//!   bronze check) bronze holds none of the range's rows;
//! - silver equals the simulator's table, every column, as a multiset (after
//!   a recovery too: the newer generation's snapshot brings it back), and
//!   `reconcile` is clean. Once a range was skipped both are left out:
//!   silver then rightly lacks the lost changes, and no model of silver
//!   without them is kept.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use clap::Parser;
use deltalake::arrow::array::{Array, FixedSizeBinaryArray};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::arrow::util::display::array_value_to_string;
use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::delta;
use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_DATA_SKIPPED, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::engine::state::EVENT_STREAM_START;
use crate::error::{StepError, EXIT_OK, EXIT_TEMPORARY};
use crate::lsn::Lsn;
use crate::sim::{Clock, FaultOn, FaultSpec, SimConfig, SimDb, TableSpec};
use crate::source::{CaptureInstance, CdcSource, Isolation, KeyRange, RowFilter, SnapshotRead, TableName, TimeOp};
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

/// Draws a schedule is made to take whatever its seed says (None keeps the
/// draw): how a test makes sure an event happens instead of hoping a seed
/// draws it. Every draw is still taken from the seed's generator, so the
/// rest of the schedule follows the same seed; a schedule run with
/// overrides replays only with the same overrides (`run_one_with`), not
/// with the `mssql-cdc torture` command.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// "int_key", "string_key" or "heap".
    pub shape: Option<&'static str>,
    pub chunked: Option<bool>,
    /// The share of calls that meet a source fault (0 to 1).
    pub fault_share: Option<f64>,
    /// Big transactions on or off; on also makes the schedule's first
    /// writer transaction a big one.
    pub big_transactions: Option<bool>,
    /// Cleanups inside the retention on or off.
    pub cleanups: Option<bool>,
    /// Cleanups past the stream and the workflow's `on_data_loss` for them:
    /// "none", "resnapshot" or "skip" (skip needs "int_key" and full mode).
    pub data_loss: Option<&'static str>,
    /// A capture-instance switch on or off (on needs data_loss "none"); on
    /// also makes it happen by the schedule's third call event (in a schedule
    /// that seeds, once the seed is done).
    pub switch: Option<bool>,
    /// A bootstrap by `seed` from a copy instead of a snapshot, on or off.
    pub seed: Option<bool>,
    /// Reseeds on or off; on needs a seed bootstrap (and turns it on when
    /// `seed` is None), data_loss "none" and no switch (it keeps both so
    /// unless told otherwise), and makes the first reseed's copy be taken at
    /// the first call event after the seed is done (or after the events).
    pub reseed: Option<bool>,
    /// `snapshot.snapshot_on_switch` on or off; on needs a switch and the
    /// chunked mode (set them too).
    pub snapshot_on_switch: Option<bool>,
    /// On: the first call event of a schedule that seeds is the bootstrap's
    /// seed and a stream or a backfill at once (turns `seed` on when None).
    pub seed_race: Option<bool>,
    /// On (with `seed_race`): the race's seed is cut early and the step
    /// beside it runs whole, and no call event follows the race, so the drain
    /// finds the seed still pending beside a generation 0 the other step may
    /// have started (seed 190021923 of the 287d932 soak).
    pub seed_race_cut: Option<bool>,
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
    /// Writer transactions of hundreds of rows (thousands of change rows).
    pub big_transactions: u32,
    /// Schedules whose capture job lagged behind the commits.
    pub lagged: u32,
    pub temporary_exits: u32,
    /// Source faults armed before a call, by kind (`dropped_connection`, `error_1205`, ...).
    pub faults: BTreeMap<String, u32>,
    /// Armed faults a call (or one of two overlapping calls) met.
    pub faults_met: u32,
    /// Cleanups that purged only what the stream had read.
    pub cleanups: u32,
    /// Cleanups that purged changes the stream had not read (data loss).
    pub cleanups_past: u32,
    /// Schedules by the workflow's `stream.on_data_loss`.
    pub on_data_loss: BTreeMap<String, u32>,
    /// Moves to a newer generation (recoveries) the final checks matched to a real purge.
    pub recoveries: u32,
    /// `data_skipped` rows the final checks matched to a real purge.
    pub skipped_ranges: u32,
    /// Capture-instance switches (a column added, a second instance enabled).
    pub switches: u32,
    /// Schedules bootstrapped by `seed` from a copy instead of a snapshot.
    pub seeded: u32,
    /// Newer copies taken for `seed --reseed` (each called until it succeeds).
    pub reseeds: u32,
    /// Schedules whose workflow sets `snapshot.snapshot_on_switch` (a switch in the chunked mode).
    pub snapshots_on_switch: u32,
    /// Pairs of the bootstrap's seed and a stream or backfill at once.
    pub seed_races: u32,
    /// Bootstrap seeds refused because the step beside them started generation 0 first.
    pub seeds_refused: u32,
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
        let outcome = run_schedule(seed, args, &dir, &Overrides::default(), &mut report);
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
    /// The table has the column a capture-instance switch added ([`EXTRA_COLUMN`], last).
    extra: bool,
}

impl Writer {
    fn row(&self, n: i64, rng: &mut SmallRng) -> Vec<SqlValue> {
        let note = SqlValue::Str(format!("n{}", rng.random_range(0..1000)));
        let mut row = match self.shape {
            Shape::IntKey => vec![SqlValue::Int(n), SqlValue::Int(n % 5), note, SqlValue::Int(rng.random_range(-1000..1000))],
            Shape::StringKey => vec![SqlValue::Str(format!("k{n}")), SqlValue::Int(rng.random_range(0..100)), note],
            Shape::Heap => vec![SqlValue::Int(n % 4), SqlValue::Str(format!("t{}", n % 3)), SqlValue::Int(rng.random_range(0..5))],
        };
        if self.extra {
            row.push(if rng.random_bool(0.2) { SqlValue::Null } else { SqlValue::Str(format!("x{}", rng.random_range(0..100))) });
        }
        row
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
        commit(db, &self.table, plan)
    }

    /// A big transaction (see the module docs): `fresh` new rows inserted,
    /// each updated `rounds` times (an integer key sometimes moved to a fresh
    /// key), then all but at most four deleted. Returns its operations.
    fn big_transaction(&mut self, db: &SimDb, rng: &mut SmallRng) -> Result<usize, String> {
        let shape = self.shape;
        // The simulator finds a heap row by scanning the table: fewer rows keep it quick.
        let (fresh, rounds) = match shape {
            Shape::Heap => (rng.random_range(60..200), 1),
            _ => (rng.random_range(150..600), rng.random_range(1..=3)),
        };
        let mut plan: Vec<Op> = Vec::new();
        let mut mine: Vec<Vec<SqlValue>> = Vec::new();
        for _ in 0..fresh {
            let n = self.next;
            self.next += 1;
            let row = self.row(n, rng);
            mine.push(row.clone());
            plan.push(Op::Insert(row));
        }
        for _ in 0..rounds {
            for row in mine.iter_mut() {
                let key = self.key_of(row);
                let mut new = row.clone();
                let last = new.len() - 1;
                new[last] = match &row[last] {
                    SqlValue::Int(v) => SqlValue::Int(v + rng.random_range(1..50)),
                    _ => SqlValue::Str(format!("u{}", rng.random_range(0..1000))),
                };
                if shape == Shape::IntKey && rng.random_bool(0.1) {
                    new[0] = SqlValue::Int(self.next);
                    self.next += 1;
                }
                *row = new.clone();
                plan.push(Op::Update(key, new));
            }
        }
        let keep = rng.random_range(0..=4usize).min(mine.len());
        for row in &mine[keep..] {
            plan.push(Op::Delete(self.key_of(row)));
        }
        let ops = plan.len();
        commit(db, &self.table, plan)?;
        Ok(ops)
    }
}

/// Runs a writer's planned operations as one transaction.
fn commit(db: &SimDb, table: &TableName, plan: Vec<Op>) -> Result<(), String> {
    db.transaction(|tx| {
        for op in plan {
            match op {
                Op::Insert(r) => tx.insert(table, r)?,
                Op::Delete(k) => tx.delete(table, &k)?,
                Op::Update(k, r) => tx.update(table, &k, r)?,
                Op::Swap(changes) => tx.update_keys(table, changes)?,
            }
        }
        Ok(())
    })
    .map(|_| ())
    .map_err(|e| format!("the writer's transaction failed: {e}"))
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

/// What a schedule does when cleanups pass the stream.
#[derive(Debug, Clone, Copy, PartialEq)]
enum DataLoss {
    /// No cleanup passes the stream; the workflow keeps `on_data_loss = "fail"`.
    None,
    Resnapshot,
    Skip,
}

impl DataLoss {
    fn name(self) -> &'static str {
        match self {
            DataLoss::None => "fail",
            DataLoss::Resnapshot => "resnapshot",
            DataLoss::Skip => "skip",
        }
    }

    fn workflow_toml(self) -> &'static str {
        match self {
            DataLoss::None => "",
            // 0: the anti-loop guard would stop the second loss of a schedule.
            DataLoss::Resnapshot => "on_data_loss = \"resnapshot\"\nresnapshot_interval_days = 0.0\n",
            DataLoss::Skip => "on_data_loss = \"skip\"\n",
        }
    }
}

/// What a schedule injects besides crashes (see the module docs).
#[derive(Debug, Clone, Copy)]
struct Draws {
    /// The chance that a call meets a source fault (0: no faults).
    fault_share: f64,
    big: bool,
    /// The first writer transaction is big (an override asked for big transactions).
    big_first: bool,
    /// Cleanups inside the retention.
    cleanups: bool,
    loss: DataLoss,
    /// A capture-instance switch (never with a data loss).
    switch: bool,
    /// The switch comes by the schedule's third call event at the latest
    /// (an override asked for it), after the stream has had calls.
    switch_first: bool,
}

/// The column a capture-instance switch adds (nullable, last), and the
/// instance that captures it.
const EXTRA_COLUMN: &str = "extra";
const NEXT_INSTANCE: &str = "dbo_t_v2";

/// The change log as the simulator held it before the schedule's cleanups
/// purged parts of it (see the module docs), the cleanups, and the
/// capture-instance switch.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
#[serde(default)]
struct Model {
    /// The change rows the cleanups deleted, each with its start LSN, as
    /// [`change_rows`] writes them (a row recorded before a switch lacks the
    /// added column's field: [`pad_fields`] adds it as NULL).
    purged: Vec<(Lsn, String)>,
    cleanups: Vec<CleanupDone>,
    /// The start LSN [`NEXT_INSTANCE`] had when it was enabled: the model
    /// takes the older instance's rows below it and the newer one's from it.
    switch_start: Option<Lsn>,
    /// The copies taken for `seed`, in order: the bootstrap's, then each
    /// reseed's (see the module docs).
    seeds: Vec<SeedCopy>,
}

/// A copy of the table taken for `seed`, as a user takes one (module docs).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SeedCopy {
    /// Its folder of Parquet files, under the schedule's folder.
    copy: String,
    /// `--as-of` as passed: an LSN (0x-hex) or a time with an offset.
    as_of: String,
    /// The LSN passed (None: a time was).
    lsn: Option<Lsn>,
    /// The time passed (None: an LSN was).
    time: Option<DateTime<Utc>>,
    /// The max LSN when the copy started: every change row above it was
    /// committed after the copy's point.
    before: Lsn,
    /// For a time: the newest mapping row 2 s or more before it (the
    /// capture job had every commit up to the time when the copy started).
    floor: Option<Lsn>,
    reseed: bool,
    /// The table's rows as the copy holds them (texts over the table's
    /// columns then, as [`texts`] writes them).
    rows: Vec<String>,
    /// A seed call with this copy succeeded.
    done: bool,
    /// A bootstrap's copy whose seed was refused because a step paired with
    /// it started generation 0 first (a stream's snapshot): the schedule
    /// goes on as one that never seeded, and no row of the copy may be left.
    #[serde(default)]
    refused: bool,
}

/// The step names of seed calls: the bootstrap's copy (and its reruns), and the pending reseed's.
const SEED: &str = "seed";
const RESEED: &str = "seed --reseed";

/// Mixed into a schedule's seed for the generator of its seed draws (module
/// docs): a schedule that does not seed draws exactly what it drew before
/// seeds were added to the tester.
const SEED_DRAWS: u64 = 0x5eed_c0b1_0025_0025;

/// Mixed into a schedule's seed for the generator of its
/// `snapshot_on_switch` draw, for the same reason as [`SEED_DRAWS`].
const ON_SWITCH_DRAWS: u64 = 0x0a5e_0028_0005_5e1f;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct CleanupDone {
    /// Where the stream stood as the facts said when the cleanup ran.
    streamed_to: Lsn,
    /// The capture instance's min LSN after it: every change row below was deleted.
    watermark: Lsn,
    /// True when it passed the stream (a data loss).
    past: bool,
}

fn save_model(dir: &Path, model: &Model) -> Result<(), String> {
    let text = serde_json::to_string(model).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("model.json"), text).map_err(|e| format!("cannot write model.json: {e}"))
}

fn load_model(dir: &Path) -> Result<Model, String> {
    match std::fs::read_to_string(dir.join("model.json")) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| format!("model.json: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Model::default()),
        Err(e) => Err(format!("cannot read model.json: {e}")),
    }
}

/// The command line of a seed call with `copy`.
fn seed_args(dir: &Path, copy: &SeedCopy) -> Vec<String> {
    let path = std::path::absolute(dir.join(&copy.copy)).unwrap_or_else(|_| dir.join(&copy.copy));
    let mut argv = vec![SEED.to_string(), "--copy".into(), path.display().to_string(), "--as-of".into(), copy.as_of.clone()];
    if copy.reseed {
        argv.push("--reseed".into());
    }
    argv
}

/// The command line of step `step`: a seed's with the bootstrap's copy
/// ([`SEED`]) or the pending reseed's ([`RESEED`]).
fn call_args(step: &str, dir: &Path, model: &Model) -> Result<Vec<String>, String> {
    Ok(match step {
        "backfill" => vec!["backfill".into(), "--max-waves".into(), "1".into()],
        SEED => seed_args(dir, model.seeds.first().ok_or("a seed call before the copy was taken")?),
        RESEED => seed_args(dir, model.seeds.last().filter(|c| c.reseed).ok_or("a reseed call without a reseed's copy")?),
        other => vec![other.to_string()],
    })
}

/// Records that a seed call (`step`) succeeded: its copy is done.
fn mark_seeded(model: &mut Model, step: &str, dir: &Path) -> Result<(), String> {
    let copy = match step {
        SEED => model.seeds.first_mut(),
        RESEED => model.seeds.last_mut(),
        _ => None,
    };
    let Some(c) = copy else { return Ok(()) };
    if c.done {
        return Ok(());
    }
    c.done = true;
    save_model(dir, model)
}

/// A bootstrap seed's exit 2 is its refusal, and expected, when the facts
/// show generation 0 started by another step (a stream's snapshot open or
/// completion, or a stream start): the copy is then marked refused and the
/// call judged as a "call again" (returned as exit 75). Any other end is
/// returned as it was, for [`judge`].
fn seed_refusal(
    step: &str,
    ended: Ended,
    facts: &str,
    trt: &tokio::runtime::Runtime,
    model: &mut Model,
    dir: &Path,
    report: &mut TortureReport,
) -> Result<Ended, String> {
    let exit2 = match &ended {
        Ended::Done(_, 2) => true,
        Ended::Failed(e) => e.exit_code() == 2,
        _ => false,
    };
    if step != SEED || !exit2 || model.seeds.first().is_none_or(|c| c.done) {
        return Ok(ended);
    }
    let rows = trt.block_on(fact_rows(facts, "t"))?.unwrap_or_default();
    let started_otherwise = rows.iter().any(|r| {
        r.generation == 0
            && (matches!(r.event.as_deref(), Some(EVENT_STREAM_START) | Some(EVENT_SNAPSHOT_OPEN))
                || (matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP)) && !is_seed_completion(r)))
    });
    if !started_otherwise {
        return Ok(ended);
    }
    if let Some(c) = model.seeds.first_mut() {
        if !c.refused {
            c.refused = true;
            report.seeds_refused += 1;
            save_model(dir, model)?;
        }
    }
    Ok(Ended::Done(Value::Null, EXIT_TEMPORARY))
}

/// Calls `seed` with every copy not done yet until it succeeds (the drain's
/// first part). The bootstrap's seed may still be pending after a race whose
/// seed was cut while the step beside it started generation 0: its refusal
/// is then judged as during the schedule ([`seed_refusal`]), the copy is
/// marked refused, and the checks after the drain find none of its rows.
fn finish_seeds(wf: &Path, dir: &Path, model: &mut Model, facts: &str, trt: &tokio::runtime::Runtime, report: &mut TortureReport) -> Result<(), String> {
    for i in 0..model.seeds.len() {
        if model.seeds[i].done || model.seeds[i].refused {
            continue;
        }
        let owned = seed_args(dir, &model.seeds[i]);
        let argv: Vec<&str> = owned.iter().map(String::as_str).collect();
        if i == 0 && !model.seeds[0].reseed {
            match seed_refusal(SEED, call(wf, &argv, None), facts, trt, model, dir, report)? {
                Ended::Done(_, EXIT_OK) => {
                    model.seeds[0].done = true;
                    save_model(dir, model)?;
                    continue;
                }
                Ended::Done(_, EXIT_TEMPORARY) if model.seeds[0].refused => continue,
                // Anything else: called until it succeeds, and judged there.
                _ => {}
            }
        }
        call_until_ok(wf, &argv)?;
        model.seeds[i].done = true;
        save_model(dir, model)?;
    }
    Ok(())
}

/// The table's rows as one read-committed read sees them now: texts over `columns`.
async fn table_texts(src: &dyn CdcSource, table: &TableName, columns: &[ColumnDesc]) -> Result<Vec<String>, String> {
    let names: Vec<String> = columns.iter().map(|c| c.name.clone()).collect();
    let read = SnapshotRead { table: table.clone(), columns: columns.to_vec(), keys: vec![], range: KeyRange::all(), isolation: Isolation::ReadCommitted, batch_rows: 1000 };
    let mut stream = src.snapshot_read(&read).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    while let Some(b) = stream.next().await {
        out.extend(texts(&b.map_err(|e| e.to_string())?, &names)?);
    }
    Ok(out)
}

/// Takes a copy of the table for `seed` the way a user takes one (module
/// docs), records it in `model` (not yet done) and returns true; false when
/// a reseed's table stayed empty (`seed` refuses an empty copy). Between
/// calls, with no fault armed.
#[allow(clippy::too_many_arguments)]
fn take_copy(
    db: &SimDb,
    table: &TableName,
    shape: Shape,
    writer: &mut Writer,
    dir: &Path,
    reseed: bool,
    rng: &mut SmallRng,
    trt: &tokio::runtime::Runtime,
    model: &mut Model,
    report: &mut TortureReport,
) -> Result<bool, String> {
    if reseed {
        // A commit after the last copy (captured below): the reseed's L is above the last seed's.
        writer.transaction(db, rng)?;
        report.transactions += 1;
        db.advance_clock(Duration::from_secs(1)).map_err(|e| e.to_string())?;
    }
    let mut tries = 0;
    while db.row_count(table).map_err(|e| e.to_string())? == 0 {
        tries += 1;
        if tries > 20 {
            if reseed {
                return Ok(false);
            }
            return Err("the table stayed empty through twenty writer transactions: no copy to seed from".into());
        }
        writer.transaction(db, rng)?;
        report.transactions += 1;
        db.advance_clock(Duration::from_secs(1)).map_err(|e| e.to_string())?;
    }
    let by_time = rng.random_bool(0.5);
    // Past any capture lag (at most 4 s), then a capture scan: the capture
    // job holds every commit so far. Always for a time (a commit before it
    // captured only later would move its mapping between two seed calls),
    // a heap (its copy must hold no commit after L) and a reseed (its L must
    // be above the last seed's); for a keyed copy by LSN, in half the
    // copies (the copy then also holds commits the max LSN is below).
    if by_time || reseed || shape == Shape::Heap || rng.random_bool(0.5) {
        db.advance_clock(Duration::from_secs(5)).map_err(|e| e.to_string())?;
        db.capture().map_err(|e| e.to_string())?;
    }
    let src = db.source().map_err(|e| e.to_string())?;
    let before = db.max_lsn().map_err(|e| e.to_string())?.ok_or("the source has no max LSN to take a copy at")?;
    let time = db.now().map_err(|e| e.to_string())?;
    let floor = if by_time {
        // The simulator's zone is UTC: its mapping times are UTC.
        trt.block_on(src.time_to_lsn(TimeOp::LargestLessThanOrEqual, (time - chrono::Duration::seconds(2)).naive_utc())).map_err(|e| e.to_string())?
    } else {
        None
    };
    // The writer goes on while the copy runs: commits after the copy's
    // point that the copy holds, which the stream replays. Not for a heap,
    // whose silver would count them twice (a seed has no read fence).
    if shape != Shape::Heap {
        let writes: u32 = rng.random_range(0..=2);
        for _ in 0..writes {
            writer.transaction(db, rng)?;
            report.transactions += 1;
            db.advance_clock(Duration::from_secs(1)).map_err(|e| e.to_string())?;
            if rng.random_bool(0.5) {
                db.capture().map_err(|e| e.to_string())?;
            }
        }
        // Those writes may have deleted the last row. `seed` refuses an
        // empty copy (exit 2: such a table needs no seed), so the writer goes
        // on until the table holds a row again, still after `before`.
        // (Found by schedule 20000053, whose copy was of an emptied table.)
        let mut more = 0;
        while db.row_count(table).map_err(|e| e.to_string())? == 0 {
            more += 1;
            if more > 20 {
                return Err("the table stayed empty through twenty writer transactions after the copy's point".into());
            }
            writer.transaction(db, rng)?;
            report.transactions += 1;
            db.advance_clock(Duration::from_secs(1)).map_err(|e| e.to_string())?;
        }
    }
    let columns = db.table_spec(table).map_err(|e| e.to_string())?.columns;
    let rows = trt.block_on(table_texts(&src, table, &columns))?;
    let name = format!("copy-{}", model.seeds.len());
    let path = std::path::absolute(dir.join(&name)).unwrap_or_else(|_| dir.join(&name));
    let files: usize = rng.random_range(1..=16);
    let written = trt.block_on(crate::seed_copy::export_parquet(&src, table, &columns, &path, files)).map_err(|e| format!("exporting the copy: {e}"))?;
    if written != rows.len() as u64 {
        return Err(format!("the copy holds {written} rows, but the table read just before it {}", rows.len()));
    }
    let as_of = match (by_time, rng.random_bool(0.5)) {
        (false, _) => before.to_hex(),
        (true, true) => time.to_rfc3339(),
        (true, false) => time.with_timezone(&chrono::FixedOffset::west_opt(3 * 3600).expect("an offset")).to_rfc3339(),
    };
    model.seeds.push(SeedCopy {
        copy: name,
        as_of,
        lsn: (!by_time).then_some(before),
        time: by_time.then_some(time),
        before,
        floor,
        reseed,
        rows,
        done: false,
        refused: false,
    });
    save_model(dir, model)?;
    Ok(true)
}

/// Server errors the client classifies as transient (see `mssql::client`).
const TRANSIENT_ERRORS: [u32; 6] = [1205, 601, 3961, 1222, 40613, 10054];

/// Arms one fault for the next read of its kind (any process's): a dropped
/// connection or a numbered transient error, after a few rows, once or
/// twice. Returns how many reads it fails.
fn arm_fault(db: &SimDb, rng: &mut SmallRng, report: &mut TortureReport) -> Result<i64, String> {
    let on = [FaultOn::Snapshot, FaultOn::Changes, FaultOn::Any][rng.random_range(0..3)];
    let after_rows: u64 = match rng.random_range(0..3) {
        0 => 0,
        1 => rng.random_range(1..4),
        _ => rng.random_range(4..40),
    };
    let times: u32 = if rng.random_bool(0.2) { 2 } else { 1 };
    let kind = if rng.random_bool(0.5) {
        db.inject_fault(FaultSpec { on, after_rows, times }).map_err(|e| e.to_string())?;
        "dropped_connection".to_string()
    } else {
        let number = TRANSIENT_ERRORS[rng.random_range(0..TRANSIENT_ERRORS.len())];
        db.inject_server_error(on, after_rows, times, number).map_err(|e| e.to_string())?;
        format!("error_{number}")
    };
    *report.faults.entry(kind).or_default() += 1;
    Ok(times as i64)
}

/// The reads the armed faults still wait for.
fn armed_faults(db: &SimDb) -> Result<i64, String> {
    let status = db.status().map_err(|e| e.to_string())?;
    Ok(status["armed_faults"].as_i64().unwrap_or(0))
}

/// Takes every fault still armed: a snapshot read and a change read of the
/// tester's own take one each (a fault is taken when a read of its kind
/// starts, whether the read then fails or not), until none is left.
async fn take_faults(db: &SimDb, table: &TableName, columns: &[ColumnDesc]) -> Result<(), String> {
    let src = db.source().map_err(|e| e.to_string())?;
    for _ in 0..10 {
        if armed_faults(db)? == 0 {
            return Ok(());
        }
        let read = SnapshotRead { table: table.clone(), columns: columns.to_vec(), keys: vec![], range: KeyRange::all(), isolation: Isolation::ReadCommitted, batch_rows: 1000 };
        if let Ok(mut s) = src.snapshot_read(&read).await {
            while s.next().await.is_some() {}
        }
        let instances = src.capture_instances(table).await.map_err(|e| e.to_string())?;
        let max = src.max_lsn().await.map_err(|e| e.to_string())?;
        if let (Some(instance), Some(max)) = (instances.last(), max) {
            if let Ok(mut s) = src.changes(instance, max, max, RowFilter::All, 1000).await {
                while s.next().await.is_some() {}
            }
        }
    }
    Err("source faults stayed armed after ten reads of each kind".into())
}

/// The LSN a facts row puts its generation's stream at, for the rows that
/// do: a batch's end, a completed snapshot's S (`bootstrap`, `resnapshot`),
/// a chunked snapshot's S at its open (the open makes the generation live;
/// a full snapshot's open does not, its completion does).
fn stream_point(r: &FactRow) -> Option<Lsn> {
    match r.event.as_deref() {
        None if r.batch_id.is_some() => r.max_lsn,
        Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT) => r.max_lsn,
        Some(EVENT_SNAPSHOT_OPEN) if r.detail.as_ref().and_then(|d| d.get("mode")).and_then(Value::as_str) == Some("chunked") => r.min_lsn,
        _ => None,
    }
}

/// The facts rows of `app_id` (None when the facts table does not exist yet).
async fn fact_rows(facts: &str, app_id: &str) -> Result<Option<Vec<FactRow>>, String> {
    let Some(t) = delta::open_existing(facts, &Default::default()).await.map_err(|e| e.to_string())? else { return Ok(None) };
    let batches = delta::query(&t, "SELECT * FROM t").await.map_err(|e| e.to_string())?;
    let rows = crate::delta::facts::from_batches(&batches).map_err(|e| e.to_string())?;
    Ok(Some(rows.into_iter().filter(|r| r.app_id == app_id).collect()))
}

/// [`texts`], with NULL for a name the batch lacks: a column the older
/// capture instance does not capture, which bronze holds as NULL in its rows.
fn texts_or_null(batch: &RecordBatch, names: &[String]) -> Result<Vec<String>, String> {
    let arrays: Vec<Option<deltalake::arrow::array::ArrayRef>> = names.iter().map(|n| batch.column_by_name(n).cloned()).collect();
    (0..batch.num_rows())
        .map(|r| {
            arrays
                .iter()
                .map(|a| match a {
                    Some(a) if !a.is_null(r) => array_value_to_string(a.as_ref(), r).map_err(|e| e.to_string()),
                    _ => Ok("\u{2400}NULL".to_string()),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|v| v.join(" | "))
        })
        .collect()
}

/// A change row's text with `fields` fields: a row recorded before a
/// capture-instance switch lacks the added (last) column, NULL in bronze.
/// (No value the writer writes holds " | ".)
fn pad_fields(text: &str, fields: usize) -> String {
    let mut t = text.to_string();
    for _ in text.split(" | ").count()..fields {
        t.push_str(" | \u{2400}NULL");
    }
    t
}

/// The change log the model takes from the change function now (module
/// docs): every row from the instance's min LSN to the max LSN, before a
/// capture-instance switch's start LSN from the older instance, from it on
/// from the newer one (both capture the changes after it; the stream reads
/// each piece from one), texts over `names` (NULL where the older instance
/// lacks a column).
async fn current_log(src: &dyn CdcSource, table: &TableName, filter: RowFilter, names: &[String], switch_start: Option<Lsn>) -> Result<Vec<(Lsn, String)>, String> {
    let instances = src.capture_instances(table).await.map_err(|e| e.to_string())?;
    let Some(top) = src.max_lsn().await.map_err(|e| e.to_string())? else { return Ok(Vec::new()) };
    // Each piece: the instance, the lowest LSN it supplies (None: its min LSN), the highest.
    let pieces: Vec<(&CaptureInstance, Option<Lsn>, Lsn)> = match switch_start {
        None => vec![(instances.last().ok_or("no capture instance")?, None, top)],
        Some(start) => {
            let older = instances.iter().find(|i| i.name != NEXT_INSTANCE).ok_or("the capture instance before the switch is gone")?;
            let newer = instances.iter().find(|i| i.name == NEXT_INSTANCE).ok_or("the capture instance the switch enabled is gone")?;
            vec![(older, None, top.min(start.decrement())), (newer, Some(start), top)]
        }
    };
    let mut log = Vec::new();
    for (instance, low, high) in pieces {
        let Some(min) = src.min_lsn(&instance.name).await.map_err(|e| e.to_string())? else { continue };
        let from = low.map_or(min, |l| l.max(min));
        log.extend(change_rows(src, instance, from, high, filter, names).await?);
    }
    Ok(log)
}

/// The change rows of `instance` with `from <= __$start_lsn <= to`, read
/// with `filter`: each row's start LSN and its text (the rank columns
/// `__$start_lsn`, `__$seqval`, `__$operation`, `__$command_id`, then
/// `names`; LSNs as 0x-hex, as bronze prints them).
async fn change_rows(src: &dyn CdcSource, instance: &CaptureInstance, from: Lsn, to: Lsn, filter: RowFilter, names: &[String]) -> Result<Vec<(Lsn, String)>, String> {
    let mut change_names = vec![
        crate::source::CHANGE_START_LSN.to_string(),
        crate::source::CHANGE_SEQVAL.to_string(),
        crate::source::CHANGE_OPERATION.to_string(),
        crate::source::CHANGE_COMMAND_ID.to_string(),
    ];
    change_names.extend(names.iter().cloned());
    let mut out = Vec::new();
    if from > to {
        return Ok(out);
    }
    let mut changes = src.changes(instance, from, to, filter, 1000).await.map_err(|e| e.to_string())?;
    while let Some(b) = changes.next().await {
        let b = b.map_err(|e| e.to_string())?;
        let lsns = b
            .column_by_name(crate::source::CHANGE_START_LSN)
            .and_then(|a| a.as_any().downcast_ref::<FixedSizeBinaryArray>().cloned())
            .ok_or("a change batch without __$start_lsn")?;
        for (i, t) in texts_or_null(&b, &change_names)?.into_iter().enumerate() {
            let mut l = [0u8; 10];
            l.copy_from_slice(lsns.value(i));
            out.push((Lsn(l), hex_lsns(&t)));
        }
    }
    Ok(out)
}

/// One cleanup (see the module docs): inside the retention (`past` false,
/// the watermark at most where the stream stands) or past the stream (more
/// than one LSN above it), the watermark drawn among the commit LSNs of the
/// change rows in range. The rows it deletes are recorded in `model` first.
/// False when there was nothing to draw from (no stream yet, nothing to purge).
async fn cleanup(
    db: &SimDb,
    table: &TableName,
    facts: &str,
    filter: RowFilter,
    past: bool,
    rng: &mut SmallRng,
    model: &mut Model,
) -> Result<bool, String> {
    let Some(rows) = fact_rows(facts, "t").await? else { return Ok(false) };
    // Where the newest live generation stands: after a reseed, whose S may
    // be below where the older generation had read, the stream is there
    // (without reseeds the newest generation's points are the highest).
    let newest = rows.iter().filter(|r| stream_point(r).is_some()).map(|r| r.generation).max();
    let Some(streamed) = rows.iter().filter(|r| Some(r.generation) == newest).filter_map(stream_point).max() else { return Ok(false) };
    let src = db.source().map_err(|e| e.to_string())?;
    // The table's columns now (a switch's added column once it is there).
    let names: Vec<String> = db.table_spec(table).map_err(|e| e.to_string())?.columns.iter().map(|c| c.name.clone()).collect();
    let log = current_log(&src, table, filter, &names, model.switch_start).await?;
    let mut lsns: Vec<Lsn> = log.iter().map(|(l, _)| *l).collect();
    lsns.sort();
    lsns.dedup();
    // Inside the retention: above the lowest row (so the cleanup purges something), at most where the stream stands.
    let lowest = lsns.first().copied();
    let candidates: Vec<Lsn> = if past {
        lsns.into_iter().filter(|l| *l > streamed.increment()).collect()
    } else {
        lsns.into_iter().filter(|l| Some(*l) > lowest && *l <= streamed).collect()
    };
    if candidates.is_empty() {
        return Ok(false);
    }
    let watermark = candidates[rng.random_range(0..candidates.len())];
    model.purged.extend(log.into_iter().filter(|(l, _)| *l < watermark));
    model.cleanups.push(CleanupDone { streamed_to: streamed, watermark, past });
    db.cleanup_to_lsn(watermark).map_err(|e| e.to_string())?;
    Ok(true)
}

fn run_schedule(seed: u64, args: &TortureArgs, dir: &Path, overrides: &Overrides, report: &mut TortureReport) -> Result<(), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let drawn_shape = [Shape::IntKey, Shape::StringKey, Shape::Heap][rng.random_range(0..3)];
    let shape = match overrides.shape {
        None => drawn_shape,
        Some("int_key") => Shape::IntKey,
        Some("string_key") => Shape::StringKey,
        Some("heap") => Shape::Heap,
        Some(other) => return Err(format!("unknown shape '{other}' in the overrides")),
    };
    let drawn_chunked = rng.random_bool(0.5);
    let chunked = overrides.chunked.unwrap_or(drawn_chunked);
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

    // What the schedule injects besides crashes (the module docs).
    let drawn_fault_share = if rng.random_bool(0.3) { rng.random_range(0.1..0.4) } else { 0.0 };
    let drawn_big = rng.random_bool(0.15);
    let drawn_cleanups = rng.random_bool(0.3);
    let loss_roll = rng.random_range(0..100);
    let skip_roll = rng.random_bool(0.5);
    // Skip only for an integer key in full mode (see the module docs).
    let skip_allowed = shape == Shape::IntKey && !chunked;
    let drawn_loss = if loss_roll < 20 {
        if skip_allowed && skip_roll {
            DataLoss::Skip
        } else {
            DataLoss::Resnapshot
        }
    } else {
        DataLoss::None
    };
    let loss = match overrides.data_loss {
        // A forced switch or reseed keeps the schedule free of data loss unless told otherwise.
        None if overrides.switch == Some(true) || overrides.reseed == Some(true) => DataLoss::None,
        None => drawn_loss,
        Some("none") => DataLoss::None,
        Some("resnapshot") => DataLoss::Resnapshot,
        Some("skip") if skip_allowed => DataLoss::Skip,
        Some("skip") => return Err("the overrides ask for on_data_loss = \"skip\", which needs shape \"int_key\" and full mode".into()),
        Some(other) => return Err(format!("unknown data_loss '{other}' in the overrides")),
    };
    // A switch only where no cleanup passes the stream: a cleanup past the
    // newer instance's start before the stream switched would leave the two
    // instances with one start LSN, and no rule to tell the newer one by.
    let drawn_switch = rng.random_bool(0.2) && loss == DataLoss::None;
    // A forced reseed keeps the schedule free of a switch unless told otherwise.
    let switch = overrides.switch.unwrap_or(drawn_switch && overrides.reseed != Some(true));
    if switch && loss != DataLoss::None {
        return Err("the overrides ask for a capture-instance switch with a data loss; a switch needs data_loss \"none\"".into());
    }
    // `snapshot.snapshot_on_switch = true` in half the schedules where a
    // switch meets the chunked mode (adr-0028 Amendment 5: the switch opens a
    // chunked snapshot at the newer instance's start), drawn apart.
    let on_switch = switch
        && chunked
        && overrides.snapshot_on_switch.unwrap_or_else(|| SmallRng::seed_from_u64(seed ^ ON_SWITCH_DRAWS).random_bool(0.5));
    if overrides.snapshot_on_switch == Some(true) && !on_switch {
        return Err("the overrides ask for snapshot_on_switch without a switch in the chunked mode".into());
    }
    report.snapshots_on_switch += u32::from(on_switch);
    // A seed bootstrap, and reseeds (module docs), from a generator of their
    // own: the draws above and the main generator's stay what they were.
    let mut srng = SmallRng::seed_from_u64(seed ^ SEED_DRAWS);
    let drawn_seed = srng.random_bool(0.2);
    let seeded = match (overrides.seed, overrides.reseed) {
        (Some(false), Some(true)) => return Err("the overrides ask for a reseed without a seed bootstrap".into()),
        (Some(s), _) => s,
        (None, Some(true)) => true,
        (None, _) if overrides.seed_race == Some(true) => true,
        (None, _) => drawn_seed,
    };
    if overrides.seed_race == Some(true) && !seeded {
        return Err("the overrides ask for a seed race without a seed bootstrap".into());
    }
    if overrides.seed_race_cut == Some(true) && overrides.seed_race != Some(true) {
        return Err("the overrides ask for a cut seed race without seed_race".into());
    }
    let mut report_seed_races = 0u32;
    // Legal only where nothing else takes a snapshot (no data loss, so no
    // recovery) and the copy is fitted to one capture instance (no switch).
    let reseeds = seeded && loss == DataLoss::None && !switch && overrides.reseed != Some(false);
    if overrides.reseed == Some(true) && !reseeds {
        return Err("the overrides ask for a reseed with a data loss or a capture-instance switch; a reseed needs data_loss \"none\" and no switch".into());
    }
    let reseed_first = overrides.reseed == Some(true);
    let mut reseeds_made = 0u32;
    let draws = Draws {
        fault_share: overrides.fault_share.unwrap_or(drawn_fault_share).clamp(0.0, 1.0),
        big: overrides.big_transactions.unwrap_or(drawn_big),
        big_first: overrides.big_transactions == Some(true),
        cleanups: overrides.cleanups.unwrap_or(drawn_cleanups),
        loss,
        switch,
        switch_first: overrides.switch == Some(true),
    };
    *report.on_data_loss.entry(draws.loss.name().into()).or_default() += 1;

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
    let mut model = Model::default();
    save_model(dir, &model)?;
    let mut writer = Writer { shape, table: table.clone(), next: 1, extra: false };
    let initial = rng.random_range(0..40);
    db.load_rows(&table, writer.initial_rows(initial, &mut rng).into_iter()).map_err(|e| e.to_string())?;
    db.enable_cdc(&table, None, None).map_err(|e| e.to_string())?;
    db.advance_clock(Duration::from_secs(2)).map_err(|e| e.to_string())?;
    db.capture().map_err(|e| e.to_string())?;

    let mode = if chunked {
        format!(
            "mode = \"chunked\"\nchunk_rows = {}\nparallelism = {}\ntarget_wave_seconds = 0\n{}",
            rng.random_range(3..12),
            rng.random_range(1..=2),
            if on_switch { "snapshot_on_switch = true\n" } else { "" }
        )
    } else {
        "mode = \"full\"\n".to_string()
    };
    let wf = dir.join("t.toml");
    std::fs::write(
        &wf,
        format!(
            "app_id = \"t\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"t\"\n\
             [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
             [snapshot]\nbootstrap = true\n{keys_toml}{mode}[stream]\nmax_batch_rows = {}\n{}[reconcile]\nsample_fraction = 1.0\ncapture_wait_seconds = 0\n",
            rng.random_range(2..30),
            draws.loss.workflow_toml()
        ),
    )
    .map_err(|e| e.to_string())?;
    let facts_location = dir.join("facts").to_string_lossy().into_owned();
    // The tester's own reads (cleanups, faults left armed) run here; each
    // call runs on a runtime of its own.
    let trt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");

    let steps: &[&str] = if chunked { &["stream", "backfill", "apply", "reconcile", "status"] } else { &["stream", "apply", "reconcile", "status"] };
    let mut uncaptured = false;
    let mut bigs = 0u32;
    let mut call_events = 0u32;
    for _ in 0..args.events {
        let roll = rng.random_range(0..100);
        if roll < 35 {
            let big = draws.big && ((draws.big_first && bigs == 0) || rng.random_bool(0.3));
            if big {
                writer.big_transaction(&db, &mut rng)?;
                bigs += 1;
                report.big_transactions += 1;
            } else {
                writer.transaction(&db, &mut rng)?;
            }
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
        call_events += 1;
        // A capture-instance switch before this event's call (module docs):
        // the column and the instance that captures it at once, then a write
        // the newer instance captures.
        // Not before a seed bootstrap is done: the seed is fitted to the instance the stream is on.
        let seed_settled = !seeded || model.seeds.first().is_some_and(|c| c.done || c.refused);
        if draws.switch && model.switch_start.is_none() && seed_settled && ((draws.switch_first && call_events >= 3) || rng.random_bool(0.15)) {
            db.add_column(&table, ColumnDesc::new(EXTRA_COLUMN, SqlType::NVarChar { len: Some(16) }, true)).map_err(|e| e.to_string())?;
            let instance = db.enable_cdc(&table, Some(NEXT_INSTANCE), None).map_err(|e| e.to_string())?;
            model.switch_start = Some(instance.start_lsn.ok_or("the capture instance the switch enabled has no start LSN")?);
            save_model(dir, &model)?;
            writer.extra = true;
            report.switches += 1;
            writer.transaction(&db, &mut rng)?;
            report.transactions += 1;
            db.advance_clock(Duration::from_secs(1)).map_err(|e| e.to_string())?;
            db.capture().map_err(|e| e.to_string())?;
        }
        // A cleanup before this event's call, between calls as the cleanup
        // job runs beside the steps (never during a read: see the module
        // docs), and not while a reseed is pending (it could purge the
        // changes right after the newer copy's point).
        let reseed_pending = model.seeds.iter().any(|c| c.reseed && !c.done);
        if (draws.cleanups || draws.loss != DataLoss::None) && rng.random_bool(0.2) && !reseed_pending {
            let past = draws.loss != DataLoss::None && (!draws.cleanups || rng.random_bool(0.5));
            if trt.block_on(cleanup(&db, &table, &facts_location, shape.model_filter(), past, &mut rng, &mut model))? {
                if past {
                    report.cleanups_past += 1;
                } else {
                    report.cleanups += 1;
                }
                save_model(dir, &model)?;
            }
        }
        // A copy for `seed` (module docs), before any fault is armed: the
        // bootstrap's at the schedule's first call event; a reseed's now and
        // then once every seed so far is done.
        if seeded && model.seeds.is_empty() {
            take_copy(&db, &table, shape, &mut writer, dir, false, &mut srng, &trt, &mut model, report)?;
            report.seeded += 1;
        } else if reseeds
            && reseeds_made < 2
            && model.seeds.iter().all(|c| c.done)
            && !model.seeds.iter().any(|c| c.refused)
            && ((reseed_first && reseeds_made == 0) || srng.random_bool(0.12))
            && take_copy(&db, &table, shape, &mut writer, dir, true, &mut srng, &trt, &mut model, report)?
        {
            reseeds_made += 1;
            report.reseeds += 1;
        }
        let weights = |s: &str| match s {
            "stream" => 40,
            "backfill" => 30,
            "apply" => 25,
            "reconcile" => 8,
            _ => 4,
        };
        // The steps and their weights: until the bootstrap's seed is done,
        // only `seed` and `status` (an orchestrator seeds before it schedules
        // the rest: a stream or backfill would take a snapshot); after it,
        // the steps, the seed again now and then, and a pending reseed often.
        let bootstrap_pending = seeded && model.seeds.first().is_some_and(|c| !c.done && !c.refused);
        let bootstrap_refused = model.seeds.first().is_some_and(|c| c.refused);
        let reseed_pending = model.seeds.iter().any(|c| c.reseed && !c.done);
        let mix: Vec<(&'static str, u32)> = if bootstrap_pending {
            vec![(SEED, 3), ("status", 1)]
        } else {
            let mut m: Vec<(&'static str, u32)> = steps.iter().map(|s| (*s, weights(s))).collect();
            if seeded && !bootstrap_refused {
                m.push((SEED, 3));
            }
            if reseed_pending {
                m.push((RESEED, 60));
            }
            m
        };
        let total: u32 = mix.iter().map(|(_, w)| *w).sum();
        let draw = |rng: &mut SmallRng| {
            let mut x = rng.random_range(0..total);
            for (s, w) in &mix {
                if x < *w {
                    return *s;
                }
                x -= *w;
            }
            mix[0].0
        };
        let crash = |rng: &mut SmallRng| if rng.random_bool(0.3) { Some(rng.random_range(1..600)) } else { None };
        // A source fault for this event's call (or either of two at once).
        let armed = if draws.fault_share > 0.0 && rng.random_bool(draws.fault_share) { arm_fault(&db, &mut rng, report)? } else { 0 };
        // The forced race of the bootstrap's seed and a step beside it (Overrides::seed_race).
        let force_race = overrides.seed_race == Some(true) && bootstrap_pending && report_seed_races == 0;
        if roll < 85 && !force_race {
            let s = draw(&mut rng);
            *report.steps.entry(s.into()).or_default() += 1;
            let owned = call_args(s, dir, &model)?;
            let argv: Vec<&str> = owned.iter().map(String::as_str).collect();
            let mut succeeded = false;
            if let (Some(bin), true) = (&args.binary, rng.random_bool(0.08)) {
                let after = Duration::from_millis(rng.random_range(20..600));
                match call_killed(bin, &wf, &argv, after)? {
                    None => report.kills += 1,
                    Some((code, _)) if code == EXIT_OK || code == EXIT_TEMPORARY => succeeded = code == EXIT_OK,
                    // reconcile's "not clean" mid-run is judged after the drain.
                    Some((3, _)) if s == "reconcile" => {}
                    // reconcile before the first apply: as judged in process.
                    Some((2, j)) if s == "reconcile" && j["error"].as_str().is_some_and(|e| e.contains("has no applied state yet")) => {}
                    // The bootstrap's seed refused because another step took
                    // generation 0: judged as in process (schedule 8700007).
                    Some((2, j)) if s == SEED => match seed_refusal(s, Ended::Done(j.clone(), 2), &facts_location, &trt, &mut model, dir, report)? {
                        Ended::Done(_, EXIT_TEMPORARY) => {}
                        _ => return Err(format!("{s} (a child process) exited 2: {j}")),
                    },
                    Some((code, j)) => return Err(format!("{s} (a child process) exited {code}: {j}")),
                }
            } else {
                let c = crash(&mut rng);
                let ended = call(&wf, &argv, c);
                succeeded = matches!(ended, Ended::Done(_, EXIT_OK));
                let ended = seed_refusal(s, ended, &facts_location, &trt, &mut model, dir, report)?;
                judge(s, ended, report)?;
            }
            if succeeded {
                mark_seeded(&mut model, s, dir)?;
            }
        } else {
            // Two calls at once, as two processes would make them. While the
            // bootstrap's seed is pending, half of its pairs are the seed and
            // a step that takes generation 0 another way (an orchestrator
            // whose schedule started too early): one of the two must win.
            let (mut a, mut b) = (draw(&mut rng), draw(&mut rng));
            if bootstrap_pending && (force_race || (a == SEED && srng.random_bool(0.5))) {
                a = SEED;
                b = if chunked && srng.random_bool(0.5) { "backfill" } else { "stream" };
                report.seed_races += 1;
                report_seed_races += 1;
            }
            let (ca, cb) = (crash(&mut rng), crash(&mut rng));
            let cut = force_race && overrides.seed_race_cut == Some(true);
            let (ca, cb) = if cut { (Some(srng.random_range(1..150)), None) } else { (ca, cb) };
            report.overlaps += 1;
            *report.steps.entry(a.into()).or_default() += 1;
            *report.steps.entry(b.into()).or_default() += 1;
            let (wa, wb) = (wf.clone(), wf.clone());
            let (aa, ab) = (call_args(a, dir, &model)?, call_args(b, dir, &model)?);
            let ta = std::thread::spawn(move || call(&wa, &aa.iter().map(String::as_str).collect::<Vec<_>>(), ca));
            let tb = std::thread::spawn(move || call(&wb, &ab.iter().map(String::as_str).collect::<Vec<_>>(), cb));
            let ea = ta.join().map_err(|_| format!("{a} panicked"))?;
            let eb = tb.join().map_err(|_| format!("{b} panicked"))?;
            let (oka, okb) = (matches!(ea, Ended::Done(_, EXIT_OK)), matches!(eb, Ended::Done(_, EXIT_OK)));
            let ea = seed_refusal(a, ea, &facts_location, &trt, &mut model, dir, report)?;
            let eb = seed_refusal(b, eb, &facts_location, &trt, &mut model, dir, report)?;
            judge(a, ea, report)?;
            judge(b, eb, report)?;
            for (step, ok) in [(a, oka), (b, okb)] {
                if ok {
                    mark_seeded(&mut model, step, dir)?;
                }
            }
            if cut {
                break;
            }
        }
        if armed > 0 {
            let left = armed_faults(&db)?;
            report.faults_met += u32::from(left < armed);
            if left > 0 {
                trt.block_on(take_faults(&db, &table, &columns))?;
            }
        }
    }
    // A schedule that seeds and had no call event takes its copy now; the
    // drain first calls every seed still pending until it is done (a forced
    // reseed that found no call event after the seed takes its copy here).
    if seeded && model.seeds.is_empty() {
        take_copy(&db, &table, shape, &mut writer, dir, false, &mut srng, &trt, &mut model, report)?;
        report.seeded += 1;
    }
    finish_seeds(&wf, dir, &mut model, &facts_location, &trt, report)?;
    if reseed_first && reseeds_made == 0 && !model.seeds.iter().any(|c| c.refused) && take_copy(&db, &table, shape, &mut writer, dir, true, &mut srng, &trt, &mut model, report)? {
        reseeds_made += 1;
        report.reseeds += 1;
        finish_seeds(&wf, dir, &mut model, &facts_location, &trt, report)?;
    }
    drop(trt);
    let checked = drain_and_check(&db, &table, shape, chunked, &wf, &columns, &model)?;
    if on_switch {
        snapshot_opened_on_switch(&facts_location)?;
    }
    if checked.reseeds != reseeds_made {
        return Err(format!("the schedule made {reseeds_made} reseeds, but the checks matched {} to the facts", checked.reseeds));
    }
    if checked.skipped > 0 && draws.loss != DataLoss::Skip {
        return Err(format!(
            "the facts record {} skipped ranges, but the workflow says on_data_loss = \"{}\"",
            checked.skipped,
            draws.loss.name()
        ));
    }
    report.recoveries += checked.recoveries;
    report.skipped_ranges += checked.skipped;
    Ok(())
}

/// With `snapshot_on_switch = true`, a stream that switched capture
/// instances opened a chunked snapshot at the newer one's start, and the
/// drain completed it (its completion names that S).
fn snapshot_opened_on_switch(facts: &str) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let rows = rt.block_on(fact_rows(facts, "t"))?.unwrap_or_default();
    if !rows.iter().any(|r| r.event.as_deref() == Some(crate::delta::facts::EVENT_CAPTURE_INSTANCE_SWITCHED)) {
        return Ok(());
    }
    let opens: Vec<Lsn> = rows
        .iter()
        .filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN) && crate::engine::chunked::switch_batch_of(r).is_some())
        .filter_map(|r| r.min_lsn)
        .collect();
    if opens.is_empty() {
        return Err("the stream switched capture instances with snapshot_on_switch = true, but no snapshot was opened on the switch".into());
    }
    for s in opens {
        if !rows.iter().any(|r| r.event.as_deref() == Some(EVENT_BOOTSTRAP) && r.max_lsn == Some(s)) {
            return Err(format!("the snapshot opened on the capture-instance switch at {s} was never completed"));
        }
    }
    Ok(())
}

/// Runs schedule `seed` in `dir` (which must be empty) and leaves its files there.
pub fn run_one(seed: u64, events: u32, binary: Option<PathBuf>, dir: &Path) -> Result<(), String> {
    run_one_with(seed, events, binary, dir, &Overrides::default()).map(|_| ())
}

/// [`run_one`] with some draws forced, returning the schedule's mix: how a
/// test makes sure a schedule injects an event (a fault met, a big
/// transaction, a cleanup, a recovery, a skipped range). Its failure
/// replays with the same call, not with the `mssql-cdc torture` command.
pub fn run_one_with(seed: u64, events: u32, binary: Option<PathBuf>, dir: &Path, overrides: &Overrides) -> Result<TortureReport, String> {
    let args = TortureArgs { seed, schedules: 1, events, binary, dir: None };
    let mut report = TortureReport::default();
    run_schedule(seed, &args, dir, overrides, &mut report)?;
    report.schedules = 1;
    Ok(report)
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
    let model = load_model(dir)?;
    let db = SimDb::open(&dir.join("source.sqlite")).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(check(&db, &TableName::new("dbo", "t"), shape, &dir.join("t.toml"), &model)).map(|_| ())
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

/// Calls `seed` again with every copy the schedule seeded from (done, not
/// refused): each call must find its seed there (`already_seeded`) and leave
/// bronze as it was, whatever completed since (a snapshot opened on a
/// capture-instance switch completes in the seed's generation; a reseed or a
/// recovery starts a later one). The checks after the drain compare bronze's
/// snapshot rows with the copies, so a rerun that removed rows is caught. It
/// draws nothing from the schedule's random numbers: seeds replay the same
/// schedules with it or without it.
fn rerun_finished_seeds(wf: &Path, model: &Model) -> Result<(), String> {
    let dir = wf.parent().ok_or("the workflow has no folder")?;
    for c in model.seeds.iter().filter(|c| c.done && !c.refused) {
        let owned = seed_args(dir, c);
        let argv: Vec<&str> = owned.iter().map(String::as_str).collect();
        let v = call_until_ok(wf, &argv)?;
        if v["already_seeded"] != true {
            return Err(format!("a seed called again after it was done did not find itself ({} --as-of {}): {v}", c.copy, c.as_of));
        }
    }
    Ok(())
}

fn drain_and_check(db: &SimDb, table: &TableName, shape: Shape, chunked: bool, wf: &Path, columns: &[ColumnDesc], model: &Model) -> Result<Checked, String> {
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
    // After a loss, silver holds the older generation's rows (some of them
    // deleted in the lost range) until the newer snapshot is complete and
    // applied: the check of silver during the waves below does not hold then.
    let lossy = model.cleanups.iter().any(|c| c.past);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    if chunked {
        let mut done = false;
        let src = db.source().map_err(|e| e.to_string())?;
        let silver_location = wf.parent().expect("the workflow's folder").join("silver").to_string_lossy().into_owned();
        for wave in 0..400 {
            let v = call_until_ok(wf, &["backfill", "--max-waves", "1"])?;
            call_until_ok(wf, &["stream"])?;
            if v["done"] == true {
                done = true;
                break;
            }
            // A rerun of the seeds while a snapshot is half read.
            if wave == 0 {
                rerun_finished_seeds(wf, model)?;
            }
            if lossy {
                continue;
            }
            // The waves path, which the completion's rebuild would paper
            // over: the writer has stopped, so once the stream is caught up
            // and the waves are applied, every row silver holds (the rows of
            // the chunks read, and of keys changed since S) is the table's
            // row now, as a multiset; only rows of unread chunks may be missing.
            // On the shape's columns: a switch's added column left out (the
            // projection of a sub-multiset is one too).
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
    // And once every snapshot is complete (the review of 14ce033 found a
    // rerun after a switch's snapshot completed that removed the seed's rows,
    // an order the random part almost never draws).
    rerun_finished_seeds(wf, model)?;
    call_until_ok(wf, &["apply"])?;
    let checked = rt.block_on(check(db, table, shape, wf, model))?;
    let r = call_until_ok(wf, &["reconcile"]);
    match r {
        Ok(v) if v["clean"] == true => Ok(checked),
        // A skipped range leaves silver without the lost changes: reconcile rightly reports them.
        Ok(_) if checked.skipped > 0 => Ok(checked),
        Err(e) if checked.skipped > 0 && e.contains("exited 3") => Ok(checked),
        Ok(v) => Err(format!("reconcile is not clean after the drain: {v}")),
        Err(e) if e.contains("exited 3") => Err(format!("reconcile is not clean after the drain: {e}")),
        Err(e) => Err(e),
    }
}

type Multiset = BTreeMap<String, i64>;

/// Bronze's change rows (not its snapshot rows) as a multiset of texts: the
/// LSN columns and the command id (which ranks rows of one transaction, so
/// it is compared too), then `names`.
async fn bronze_change_rows(bronze: &deltalake::DeltaTable, names: &[String]) -> Result<Multiset, String> {
    let mut bronze_names = vec![
        crate::delta::bronze::START_LSN.to_string(),
        crate::delta::bronze::SEQVAL.to_string(),
        crate::delta::bronze::OPERATION.to_string(),
        crate::delta::bronze::COMMAND_ID.to_string(),
    ];
    bronze_names.extend(names.iter().cloned());
    let mut held = Multiset::new();
    for b in delta::query(bronze, "SELECT * FROM t WHERE _operation <> 0").await.map_err(|e| e.to_string())? {
        for t in texts(&b, &bronze_names)? {
            *held.entry(t).or_default() += 1;
        }
    }
    Ok(held)
}

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

/// What the final checks found, for the report.
#[derive(Debug, Default, Clone, Copy)]
struct Checked {
    /// Moves to a newer generation, each matched to a real purge.
    recoveries: u32,
    /// `data_skipped` rows, each matched to a real purge.
    skipped: u32,
    /// Reseeds' generations, each matched to a copy the schedule took.
    reseeds: u32,
}

/// The checks of the module doc, against the simulator's own rows and change
/// log (with the change rows the schedule's cleanups purged, from `model`),
/// on the table's columns as they are now (a switch's added column included).
async fn check(db: &SimDb, table: &TableName, shape: Shape, wf: &Path, model: &Model) -> Result<Checked, String> {
    let dir = wf.parent().expect("the workflow's folder");
    let loc = |t: &str| dir.join(t).to_string_lossy().into_owned();
    let columns = db.table_spec(table).map_err(|e| e.to_string())?.columns;
    let rows = fact_rows(&loc("facts"), "t").await?.ok_or("facts was never created")?;
    let gens = generations(&rows)?;
    let skipped: usize = gens.iter().map(|g| g.skips.len()).sum();
    if skipped == 0 {
        silver_matches_table(db, table, &loc("silver"), &columns).await?;
    }
    let names: Vec<String> = columns.iter().map(|c| c.name.clone()).collect();
    let log = model_log(db, table, shape.model_filter(), &names, model).await?;
    let bronze = delta::open_existing(&loc("bronze"), &Default::default()).await.map_err(|e| e.to_string())?.ok_or("bronze was never created")?;
    if let Err(e) = bronze_matches_model(&bronze, &names, &gens, &log).await {
        return Err(format!("{e}{}", unrepaired_batches(&bronze, &rows, &gens).await));
    }
    let reseeds = seeds_match_copies(db, &bronze, &names, &rows, &gens, model, &log).await?;
    losses_match_purges(&gens, model)?;
    Ok(Checked { recoveries: gens.iter().skip(1).filter(|g| !g.seeded).count() as u32, skipped: skipped as u32, reseeds })
}

/// One generation of the stream as the facts record it (see the module docs).
#[derive(Debug)]
struct Generation {
    number: i32,
    /// The S of the snapshot that made it live.
    s: Lsn,
    /// Its last batch's end (S without batches).
    end: Lsn,
    skips: Vec<Skipped>,
    /// Its snapshot is a seed's (the facts' completion row says so).
    seeded: bool,
}

/// A seed's completion row: `bootstrap` or `resnapshot` with `"mode": "seed"`.
fn is_seed_completion(r: &FactRow) -> bool {
    matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT))
        && r.detail.as_ref().and_then(|d| d.get("mode")).and_then(Value::as_str) == Some("seed")
}

/// A `data_skipped` row: `[from, to)` was skipped, and its batch read from `to`.
#[derive(Debug)]
struct Skipped {
    batch: i64,
    from: Lsn,
    to: Lsn,
    certain: bool,
}

/// Splits the facts into generations and checks that each one's batch
/// rows tile the LSNs after its S (a skipped range bridging a gap only
/// where a `data_skipped` row of that batch says so), and that each
/// generation starts after the one before ended.
fn generations(rows: &[FactRow]) -> Result<Vec<Generation>, String> {
    let mut starts: BTreeMap<i32, Lsn> = BTreeMap::new();
    let mut batches: BTreeMap<i32, Vec<&FactRow>> = BTreeMap::new();
    let mut skips: BTreeMap<(i32, i64), Vec<Skipped>> = BTreeMap::new();
    let mut seeded: std::collections::BTreeSet<i32> = std::collections::BTreeSet::new();
    for r in rows {
        if is_seed_completion(r) {
            seeded.insert(r.generation);
        }
        match r.event.as_deref() {
            None if r.batch_id.is_some() => batches.entry(r.generation).or_default().push(r),
            Some(EVENT_DATA_SKIPPED) => {
                let batch = r.batch_id.ok_or("a data_skipped row without a batch id")?;
                let detail = r.detail.clone().unwrap_or(Value::Null);
                let lsn = |k: &str| detail.get(k).and_then(Value::as_str).and_then(|s| Lsn::parse(s).ok());
                let (Some(from), Some(to)) = (lsn("from"), lsn("to")) else {
                    return Err(format!("the data_skipped row of batch {batch} (generation {}) has no range: {detail}", r.generation));
                };
                let certain = detail.get("certain").and_then(Value::as_bool).unwrap_or(false);
                skips.entry((r.generation, batch)).or_default().push(Skipped { batch, from, to, certain });
            }
            _ => {
                if let Some(s) = stream_point(r) {
                    let e = starts.entry(r.generation).or_insert(s);
                    if s < *e {
                        *e = s;
                    }
                }
            }
        }
    }
    if let Some(g) = batches.keys().find(|g| !starts.contains_key(*g)) {
        return Err(format!("the facts hold batches of generation {g}, but no snapshot that made it live"));
    }
    let mut out: Vec<Generation> = Vec::new();
    for (&number, &s) in &starts {
        let mut list = batches.remove(&number).unwrap_or_default();
        list.sort_by_key(|r| r.batch_id);
        let mut next_from = s.increment();
        let mut gen_skips = Vec::new();
        for (i, b) in list.iter().enumerate() {
            let id = b.batch_id.expect("a batch row has a batch id");
            if id != i as i64 {
                return Err(format!("generation {number}: the facts' batch ids skip or repeat: batch {id} where {i} was due"));
            }
            let (Some(from), Some(to)) = (b.min_lsn, b.max_lsn) else {
                return Err(format!("generation {number}: batch {id} has no range"));
            };
            let mut start = next_from;
            if let Some(mut k) = skips.remove(&(number, id)) {
                if k.len() != 1 {
                    return Err(format!("generation {number}: batch {id} has {} data_skipped rows", k.len()));
                }
                let k = k.pop().expect("one skipped range");
                if k.from != next_from {
                    return Err(format!(
                        "generation {number}: batch {id} skips from {}, but the previous range ended just before {next_from}: a gap or an overlap",
                        k.from
                    ));
                }
                if k.to <= k.from {
                    return Err(format!("generation {number}: batch {id} skips an empty range [{}, {})", k.from, k.to));
                }
                start = k.to;
                gen_skips.push(k);
            }
            if from != start {
                return Err(format!(
                    "generation {number}: batch {id} starts at {from}, but the previous range (or a skipped one) ended just before {start}: a gap or an overlap"
                ));
            }
            if to < from.decrement() {
                return Err(format!("generation {number}: batch {id} ends at {to} before it starts at {from}"));
            }
            next_from = to.increment();
        }
        let is_seeded = seeded.contains(&number);
        if let Some(prev) = out.last() {
            if is_seeded {
                // A reseed's copy may stand before where the older generation
                // had read; it never stands at or before its S.
                if s <= prev.s {
                    return Err(format!(
                        "generation {number} (a reseed's) starts at {s}, not after generation {}'s S {}: a reseed never goes back",
                        prev.number, prev.s
                    ));
                }
            } else if s <= prev.end {
                return Err(format!("generation {number} starts at {s}, not after generation {} ended at {}", prev.number, prev.end));
            }
        }
        out.push(Generation { number, s, end: next_from.decrement(), skips: gen_skips, seeded: is_seeded });
    }
    if let Some(((g, b), _)) = skips.iter().next() {
        return Err(format!("a data_skipped row names batch {b} of generation {g}, which has no batch row"));
    }
    if out.is_empty() {
        return Err("the facts hold no snapshot that started the stream".into());
    }
    Ok(out)
}

/// The model's change log (module docs): the rows the cleanups purged,
/// padded to `names` (the added column NULL), then what the change function
/// returns now, texts with the rank columns, then `names`.
async fn model_log(db: &SimDb, table: &TableName, filter: RowFilter, names: &[String], model: &Model) -> Result<Vec<(Lsn, String)>, String> {
    let src = db.source().map_err(|e| e.to_string())?;
    // The rank columns, then the table's.
    let fields = 4 + names.len();
    let mut log: Vec<(Lsn, String)> = model.purged.iter().map(|(l, t)| (*l, pad_fields(t, fields))).collect();
    log.extend(current_log(&src, table, filter, names, model.switch_start).await?);
    Ok(log)
}

/// The reference check of bronze across generations, cleanups, skips and
/// reseeds: its change rows (every column, with the rank columns) against
/// the model's change log of each generation's range, less the skipped
/// ranges, as multisets. A row counts once for each generation whose range
/// holds it: at most one, except after a reseed whose S is before where the
/// older generation had read (the newer generation writes those changes again).
async fn bronze_matches_model(bronze: &deltalake::DeltaTable, names: &[String], generations: &[Generation], log: &[(Lsn, String)]) -> Result<(), String> {
    let newest = generations.len() - 1;
    let mut model_rows = Multiset::new();
    for (lsn, text) in log {
        for (i, g) in generations.iter().enumerate() {
            if *lsn <= g.s || (i != newest && *lsn > g.end) {
                continue;
            }
            if g.skips.iter().any(|k| *lsn >= k.from && *lsn < k.to) {
                continue;
            }
            *model_rows.entry(text.clone()).or_default() += 1;
        }
    }
    let held = bronze_change_rows(bronze, names).await?;
    diff("bronze's change rows (target) and the simulator's change log (source)", &held, &model_rows)
}

/// For a failed bronze check: the batches bronze holds for a generation
/// older than the newest without their facts rows (a call cut between its
/// bronze and facts commits, never repaired: the next call repairs only its
/// own generation's), as a sentence to append, or nothing.
async fn unrepaired_batches(bronze: &deltalake::DeltaTable, rows: &[FactRow], generations: &[Generation]) -> String {
    let mut found = Vec::new();
    for g in generations.iter().take(generations.len().saturating_sub(1)) {
        let app = crate::engine::generation_app_id("t", g.number);
        let Ok(Some(held)) = delta::txn_version(bronze, &app).await else { continue };
        let recorded = rows.iter().filter(|r| r.generation == g.number && r.event.is_none()).filter_map(|r| r.batch_id).max();
        if recorded.is_none_or(|f| held > f) {
            found.push(format!("generation {}'s bronze holds batch {held}, its facts {}", g.number, recorded.map_or("none".to_string(), |f| format!("up to batch {f}"))));
        }
    }
    if found.is_empty() {
        String::new()
    } else {
        format!(" (a batch of an older generation in bronze without its facts row, never repaired: {})", found.join("; "))
    }
}

/// The reference check of the seeds (module docs): the facts' seed
/// completions are the schedule's copies, one each, in order; each one's L
/// keeps the copy's `--as-of`; bronze's whole-snapshot rows at those Ls are
/// the copies' rows, stamped as a seed stamps them, as a multiset (without
/// a data loss, bronze's only whole-snapshot rows). Returns the reseeds.
async fn seeds_match_copies(
    db: &SimDb,
    bronze: &deltalake::DeltaTable,
    names: &[String],
    facts: &[FactRow],
    generations: &[Generation],
    model: &Model,
    log: &[(Lsn, String)],
) -> Result<u32, String> {
    let mut completions: Vec<&FactRow> = facts.iter().filter(|r| is_seed_completion(r)).collect();
    completions.sort_by_key(|r| r.generation);
    let refused: Vec<&SeedCopy> = model.seeds.iter().filter(|c| c.refused).collect();
    let seeds: Vec<SeedCopy> = model.seeds.iter().filter(|c| !c.refused).cloned().collect();
    if !refused.is_empty() && !model.cleanups.iter().any(|c| c.past) {
        // The refused seed's rows are gone from bronze: without a data loss
        // (whose recoveries may leave a cut full re-snapshot uncompleted),
        // every point bronze holds whole-snapshot rows at is one a
        // completion row names.
        let completed_at: BTreeSet<String> = facts
            .iter()
            .filter(|r| matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT)))
            .filter_map(|r| r.max_lsn.map(|l| l.to_hex()))
            .collect();
        let sql = "SELECT DISTINCT coalesce(_snapshot, _start_lsn) AS p FROM t WHERE _operation = 0 AND _chunk IS NULL";
        for b in delta::query(bronze, sql).await.map_err(|e| e.to_string())? {
            for p in texts(&b, &["p".to_string()])? {
                if !completed_at.contains(&p) {
                    return Err(format!(
                        "bronze holds whole-snapshot rows at {p}, which no completion row names, after the seed from {} was refused: its rows were not removed",
                        refused[0].copy
                    ));
                }
            }
        }
    }
    let model = &Model { seeds, ..model.clone() };
    if completions.is_empty() && model.seeds.is_empty() {
        return Ok(0);
    }
    if completions.len() != model.seeds.len() {
        return Err(format!(
            "the facts record {} seeds (generations {:?}), but the schedule took {} copies and seeded from each once",
            completions.len(),
            completions.iter().map(|r| r.generation).collect::<Vec<_>>(),
            model.seeds.len()
        ));
    }
    let src = db.source().map_err(|e| e.to_string())?;
    let null = "\u{2400}NULL";
    let mut expected = Multiset::new();
    let mut points: Vec<String> = Vec::new();
    for (i, (r, copy)) in completions.iter().zip(&model.seeds).enumerate() {
        let l = r.max_lsn.ok_or_else(|| format!("the seed completion of generation {} has no LSN", r.generation))?;
        let what = format!("the seed from {} (--as-of {}, generation {}, at {l})", copy.copy, copy.as_of, r.generation);
        if i == 0 && (r.generation != 0 || generations.first().map(|g| g.number) != Some(0)) {
            return Err(format!("{what} is the schedule's bootstrap, but not generation 0's snapshot"));
        }
        let g = generations.iter().find(|g| g.number == r.generation).ok_or_else(|| format!("{what} started no generation"))?;
        if g.s != l {
            return Err(format!("{what}: its generation starts at {}, not at the seed", g.s));
        }
        match (copy.lsn, copy.time) {
            (Some(at), _) => {
                if l != at {
                    return Err(format!("{what} does not stand at the LSN it was given"));
                }
            }
            (None, Some(t)) => {
                if let Some(f) = copy.floor {
                    if l < f {
                        return Err(format!("{what} stands before {f}, the newest commit 2 s or more before the copy started"));
                    }
                }
                // Every change row above `before` was committed after the copy's point.
                if let Some((x, _)) = log.iter().find(|(x, _)| *x > copy.before && *x <= l) {
                    return Err(format!("{what} stands at or after {x}, a change committed after the copy started at {t}: the stream skips it"));
                }
                if let Some(at) = src.lsn_to_time(l).await.map_err(|e| e.to_string())? {
                    if at > t.naive_utc() {
                        return Err(format!("{what} maps to {at}, after the copy started at {t}"));
                    }
                }
            }
            (None, None) => return Err(format!("copy {} has neither an LSN nor a time in model.json", copy.copy)),
        }
        let lh = l.to_hex();
        for row in &copy.rows {
            *expected.entry(format!("{lh} | {lh} | {null} | {null} | {null} | {}", pad_fields(row, names.len()))).or_default() += 1;
        }
        points.push(lh);
    }
    let mut cols: Vec<String> = [
        crate::delta::bronze::START_LSN,
        crate::delta::bronze::SNAPSHOT,
        crate::delta::bronze::SEQVAL,
        crate::delta::bronze::COMMAND_ID,
        crate::delta::bronze::BATCH_ID,
    ]
    .iter()
    .map(|c| c.to_string())
    .collect();
    cols.extend(names.iter().cloned());
    // After a data loss the recoveries' full snapshots are bronze's too
    // (and one cut after its bronze commit); without one, nothing but a seed
    // takes a snapshot here.
    let lossy = model.cleanups.iter().any(|c| c.past);
    let mut held = Multiset::new();
    for b in delta::query(bronze, "SELECT * FROM t WHERE _operation = 0 AND _chunk IS NULL").await.map_err(|e| e.to_string())? {
        for t in texts(&b, &cols)? {
            let mut f = t.split(" | ");
            let (start, snapshot) = (f.next().unwrap_or_default(), f.next().unwrap_or_default());
            let point = if snapshot == null { start } else { snapshot };
            if lossy && !points.iter().any(|p| p == point) {
                continue;
            }
            *held.entry(t).or_default() += 1;
        }
    }
    diff("bronze's snapshot rows (target) and the copies the schedule seeded from (source)", &held, &expected)?;
    Ok(completions.len().saturating_sub(1) as u32)
}

/// Every move to a newer generation and every skipped range matches a
/// purge the tester made before the stream read the range (module docs).
fn losses_match_purges(generations: &[Generation], model: &Model) -> Result<(), String> {
    for w in generations.windows(2) {
        let (old, new) = (&w[0], &w[1]);
        // A reseed's generation matches a copy the schedule took instead ([`seeds_match_copies`]).
        if new.seeded {
            continue;
        }
        if !model.cleanups.iter().any(|c| c.streamed_to <= old.end && c.watermark > old.end.increment()) {
            return Err(format!(
                "generation {} started (S {}) after generation {} ended at {}, but no cleanup purged the changes right after that end \
                 before the stream read them: a recovery without a real loss",
                new.number, new.s, old.number, old.end
            ));
        }
    }
    for g in generations {
        for k in &g.skips {
            if !k.certain {
                return Err(format!(
                    "generation {}: batch {} records an uncertain skip of [{}, {}) (cleanup during the read), but no cleanup ran during a read",
                    g.number, k.batch, k.from, k.to
                ));
            }
            if !model.cleanups.iter().any(|c| c.watermark == k.to && c.streamed_to < k.from) {
                return Err(format!(
                    "generation {}: batch {} skipped [{}, {}), but no cleanup purged up to {} while the stream stood before {}: a skip without a real purge",
                    g.number, k.batch, k.from, k.to, k.to, k.from
                ));
            }
        }
    }
    Ok(())
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
    let held = bronze_change_rows(&bronze, &names).await?;
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

/// Where the stream's changes start (exclusive): the first snapshot open's
/// S, a seed's L (its completion row), or, for a stream without a snapshot,
/// its recorded start's position.
async fn snapshot_lsn_from_facts(facts: &str) -> Result<Lsn, String> {
    let t = delta::open_existing(facts, &Default::default()).await.map_err(|e| e.to_string())?.ok_or("facts was never created")?;
    for sql in [
        "SELECT MIN(min_lsn) AS s FROM t WHERE event = 'snapshot_open'",
        // A seed's snapshot records no open, only its completion at L.
        "SELECT MIN(max_lsn) AS s FROM t WHERE event = 'bootstrap'",
        "SELECT MIN(max_lsn) AS s FROM t WHERE event = 'stream_start'",
    ] {
        let b = delta::query(&t, sql).await.map_err(|e| e.to_string())?;
        let v = b.first().and_then(|b| texts(b, &["s".to_string()]).ok()).and_then(|v| v.into_iter().next());
        match v {
            Some(v) if !v.starts_with('\u{2400}') => return Lsn::parse(&v).map_err(|e| format!("facts' start LSN {v}: {e}")),
            _ => continue,
        }
    }
    Err("facts hold neither a snapshot open nor a stream start".into())
}
