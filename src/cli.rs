//! The command line: `mssql-cdc --workflow FILE <step>`, plus `sim`, `demo`
//! and `bench`.
//!
//! Contract with orchestrators: logs go to stderr; the last line on stdout is
//! one JSON object (the step's result, or `{"ok": false, "error": …}`); the
//! exit code says what to do next (see [`crate::error`] and README).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use serde_json::{json, Value};

use crate::error::{StepError, EXIT_BUG, EXIT_CONFIG, EXIT_OK};

/// Replicates SQL Server change data capture into Delta Lake, one idempotent step at a time.
#[derive(Debug, Parser)]
#[command(name = "mssql-cdc", version, about, long_about = None)]
pub struct Cli {
    /// The workflow file (TOML) of the stream the step works on.
    #[arg(long, global = true, value_name = "FILE", conflicts_with = "fleet")]
    pub workflow: Option<PathBuf>,
    /// A fleet file (TOML): shared defaults and one entry per table; name the
    /// table with --table or run every table with --all (before the step:
    /// `mssql-cdc --fleet F --all stream`).
    #[arg(long, value_name = "FILE")]
    pub fleet: Option<PathBuf>,
    /// With --fleet: the table to run the step on (schema.table, a table name
    /// only one entry has, or an app id).
    #[arg(long, value_name = "NAME", requires = "fleet", conflicts_with = "all")]
    pub table: Option<String>,
    /// With --fleet: run the step on every table of the fleet.
    #[arg(long, requires = "fleet")]
    pub all: bool,
    /// With --all: how many tables a call works on at once (within the fleet
    /// file's fleet.max_source_connections).
    #[arg(long, value_name = "N", default_value_t = 4, requires = "all")]
    pub parallel: usize,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream micro-batches from the stream's position up to the source's max LSN
    /// (bootstrapping first when the workflow asks for it).
    Stream {
        /// The most micro-batches this call commits (overrides stream.max_batches).
        #[arg(long)]
        max_batches: Option<u32>,
        /// Overrides stream.resnapshot_interval_days for this call: 0 lets a
        /// person re-snapshot now after the anti-loop guard stopped a recovery.
        #[arg(long, value_name = "DAYS")]
        resnapshot_interval_days: Option<f64>,
    },
    /// Take the bootstrap snapshot now (the stream step also does it when needed);
    /// in chunked mode, open it (backfill reads it).
    Snapshot,
    /// Read the open chunked snapshot in waves beside the stream; call again until done.
    Backfill(BackfillCli),
    /// Print the stream's state: generation, position, lag, open snapshot, last batch, headroom,
    /// last reconcile; writes nothing.
    Status {
        /// json (the step's JSON only), table (one aligned line per table) or
        /// prometheus (node_exporter's textfile format); the last stdout line
        /// is the JSON either way.
        #[arg(long, value_enum, default_value_t = StatusFormat::Json)]
        format: StatusFormat,
        /// Write the table or the metrics to this file (replaced atomically,
        /// as node_exporter's textfile collector asks) instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Write an HTML page per table (lag and rows per batch, headroom, snapshot
    /// waves and throughput, events, reconcile verdicts) and an index, drawn
    /// from the Delta tables alone; reads no source, needs no network to view.
    Report {
        /// The folder to write into (made if missing): index.html and a page per table.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Load an existing copy of the table (a Delta table or a folder of Parquet
    /// files) into bronze as the stream's snapshot at the copy's point.
    Seed {
        /// The copy: a Delta table, or a folder of Parquet files.
        #[arg(long, value_name = "PATH")]
        copy: String,
        /// An LSN recorded before the copy started (0x + 20 hex digits), or the
        /// time the copy started, with Z or an offset (2026-10-01T16:53:59-03:00).
        #[arg(long, value_name = "TIME|LSN")]
        as_of: String,
        /// Replace the target's snapshot with this newer copy (starts a new stream generation).
        #[arg(long)]
        reseed: bool,
        /// Load captured columns the copy lacks as NULL instead of refusing.
        #[arg(long)]
        allow_missing_columns: bool,
    },
    /// Apply bronze's changes and snapshots to silver (the latest row per key); call on any schedule.
    Apply,
    /// Compare silver with the source (bucket counts, then row hashes) and append a report;
    /// exit 3 when real differences remain.
    Reconcile,
    /// Upkeep of the workflow's tables, so a step's cost does not grow with
    /// history: compacts the small files of facts, plans, control and
    /// reconcile, vacuums removed files older than the retention, and
    /// checkpoints every table; reads no source, changes no row.
    Maintain {
        /// VACUUM deletes the files of removes at least this many hours old:
        /// at least 24, and under each table's delta.deletedFileRetentionDuration
        /// (a week unless set), after which checkpoints forget removed files.
        #[arg(long, value_name = "HOURS", default_value_t = crate::engine::maintain::DEFAULT_VACUUM_RETENTION_HOURS)]
        vacuum_retention_hours: f64,
        /// Compact and checkpoint only; delete no file.
        #[arg(long)]
        no_vacuum: bool,
    },
    /// Drive the embedded SQL Server CDC simulator.
    #[command(subcommand)]
    Sim(crate::sim::cli::SimCommand),
    /// Run a demo scenario end to end on the simulator and check the result.
    Demo(crate::demo::DemoArgs),
    /// Benchmarks that print figures (last stdout line: JSON).
    #[command(subcommand)]
    Bench(crate::bench::BenchCommand),
    /// Randomized, seeded schedules of writes, steps, crashes and overlapping
    /// calls on the simulator, each checked against the simulator's own rows
    /// and change log (exit 1 when any schedule fails; its replay command is
    /// in the JSON).
    Torture {
        /// The first schedule's seed (schedule i uses seed + i).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// How many schedules to run.
        #[arg(long, default_value_t = 100)]
        schedules: u32,
        /// Writes and calls per schedule before the final drain.
        #[arg(long, default_value_t = 16)]
        events: u32,
        /// Where schedules keep their files (a failing one's are kept).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Run every call in process (no child processes killed with SIGKILL).
        #[arg(long)]
        no_kill: bool,
        /// Run the end checks again on a kept schedule's folder (a failed
        /// one keeps its files) and exit: 0 when they hold.
        #[arg(long, value_name = "DIR", conflicts_with_all = ["seed", "schedules"])]
        recheck: Option<PathBuf>,
    },
    /// Run one transition of the state machine (or whichever is next) and print
    /// the state before and after it: next, start, open, plan, wave, complete,
    /// commit, recover, resnapshot or repair. One not allowed now exits 2.
    Step {
        #[arg(default_value = "next")]
        transition: String,
    },
    /// Print the workflow's state machine (its states and transitions, from
    /// the code's own table) as a diagram; needs no workflow.
    Machine {
        #[arg(long, value_enum, default_value_t = DiagramFormat::Mermaid)]
        format: DiagramFormat,
    },
}

/// The output formats of `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StatusFormat {
    Json,
    Table,
    Prometheus,
}

/// The diagram formats of `machine`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DiagramFormat {
    Mermaid,
    Dot,
}

/// Flags of `backfill` (each overrides the workflow's value for this call).
#[derive(Debug, Clone, clap::Args)]
pub struct BackfillCli {
    /// The most waves this call reads.
    #[arg(long)]
    pub max_waves: Option<u32>,
    /// Stop starting waves after this many seconds (a wave under way finishes).
    #[arg(long)]
    pub max_seconds: Option<f64>,
    /// Rows per chunk when this call makes the plan (ignored, with a warning, once planned).
    #[arg(long)]
    pub chunk_rows: Option<u64>,
    /// Pause while the stream's retention headroom is below this many hours.
    #[arg(long)]
    pub min_headroom_hours: Option<f64>,
    /// Isolation of the counts, seeks and chunk reads (never NOLOCK).
    #[arg(long, value_enum)]
    pub isolation: Option<IsolationArg>,
    /// Size waves toward this many seconds of reading (0: one round of chunks a wave).
    #[arg(long)]
    pub target_wave_seconds: Option<f64>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum IsolationArg {
    ReadCommitted,
    Snapshot,
}

impl BackfillCli {
    /// The step's arguments, checked before anything is read or written.
    pub fn to_args(&self) -> Result<crate::engine::chunked::BackfillArgs, StepError> {
        let bad = |m: String| Err(StepError::Config(m));
        if self.chunk_rows == Some(0) {
            return bad("--chunk-rows must be at least 1".into());
        }
        if self.max_waves == Some(0) {
            return bad("--max-waves must be at least 1".into());
        }
        for (name, v) in [("--max-seconds", self.max_seconds), ("--min-headroom-hours", self.min_headroom_hours), ("--target-wave-seconds", self.target_wave_seconds)] {
            if let Some(v) = v {
                if !(v >= 0.0 && v.is_finite()) {
                    return bad(format!("{name} is {v}: use a number of 0 or more"));
                }
            }
        }
        Ok(crate::engine::chunked::BackfillArgs {
            max_waves: self.max_waves,
            max_seconds: self.max_seconds,
            chunk_rows: self.chunk_rows,
            min_headroom_hours: self.min_headroom_hours,
            isolation: self.isolation.map(|i| match i {
                IsolationArg::ReadCommitted => crate::source::Isolation::ReadCommitted,
                IsolationArg::Snapshot => crate::source::Isolation::Snapshot,
            }),
            target_wave_seconds: self.target_wave_seconds,
            transitions: crate::engine::chunked::LaneTransitions::All,
        })
    }
}

/// Runs the command line; returns the process exit code.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_CONFIG } else { EXIT_OK };
            let _ = e.print();
            if code != EXIT_OK {
                println!("{}", json!({"ok": false, "kind": "config", "error": e.kind().to_string()}));
            }
            return code;
        }
    };
    // The tester calls steps thousands of times in process: their logs would
    // bury its own, so it logs warnings only unless MSSQL_CDC_LOG says otherwise.
    init_logging(if matches!(cli.command, Command::Torture { .. }) { "warn" } else { "mssql_cdc=info,warn" });
    arm_failpoints();
    if let Err(message) = crate::alloc::check_env() {
        tracing::error!("{message}");
        println!("{}", json!({"ok": false, "kind": "config", "exit_code": EXIT_CONFIG, "error": message}));
        return EXIT_CONFIG;
    }
    tracing::debug!(allocator = crate::alloc::name(), c_arena_limit = crate::alloc::c_arena_limit(), "memory allocator");
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return EXIT_BUG;
        }
    };
    // The engine names the command to run next as `--workflow FILE` (it
    // does not know how it was called); here the file is known.
    let rerun_as = match (&cli.workflow, &cli.fleet, &cli.table) {
        (Some(w), _, _) => Some(format!("--workflow {}", w.display())),
        (None, Some(f), Some(t)) => Some(format!("--fleet {} --table {t}", f.display())),
        _ => None,
    };
    let outcome = runtime.block_on(run(cli));
    match outcome {
        Ok((value, code)) => {
            println!("{value}");
            code
        }
        Err(e) => {
            let mut message = error_chain(&e);
            if let Some(r) = &rerun_as {
                message = message.replace("--workflow FILE", r);
            }
            tracing::error!("{message}");
            println!("{}", json!({"ok": false, "kind": e.kind(), "exit_code": e.exit_code(), "error": message}));
            e.exit_code()
        }
    }
}

pub use crate::error::error_chain;

/// The variable that arms failpoints in this binary (crash drills, tests).
pub const FAILPOINTS_ENV: &str = "MSSQL_CDC_FAILPOINTS";

/// Arms the failpoints named in `MSSQL_CDC_FAILPOINTS` (`name=action;…`, as
/// the `fail` crate's actions: `return`, `return(abort)`, `1*return`).
///
/// The failpoints are compiled into the release binary so that crash drills
/// test the binary users run. They are never armed by the `fail` crate's
/// generic `FAILPOINTS` variable, which another tool in the same environment
/// might set: only by this program's own variable, and then loudly, on
/// stderr, for every failpoint armed.
fn arm_failpoints() {
    if std::env::var_os("FAILPOINTS").is_some() {
        tracing::warn!("FAILPOINTS is set and ignored: this program arms failpoints only from {FAILPOINTS_ENV}");
    }
    let Ok(spec) = std::env::var(FAILPOINTS_ENV) else { return };
    for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((name, action)) = item.split_once('=') else {
            tracing::error!("{FAILPOINTS_ENV}: '{item}' is not name=action; ignored");
            continue;
        };
        match fail::cfg(name, action) {
            Ok(()) => tracing::warn!("failpoint {name} ARMED ({action}) by {FAILPOINTS_ENV}: this run may fail or abort on purpose"),
            Err(e) => tracing::error!("{FAILPOINTS_ENV}: failpoint {name}: {e}"),
        }
    }
}

fn init_logging(default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("MSSQL_CDC_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colours only on a terminal: a log file or an orchestrator's log view
    // gets plain text, not escape codes.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(crate::progress::LogWriter).with_ansi(ansi).with_target(false).try_init();
}

fn workflow_path(cli_path: &Option<PathBuf>) -> Result<PathBuf, StepError> {
    cli_path.clone().ok_or_else(|| StepError::Config("this step needs --workflow FILE (the stream's TOML workflow file)".into()))
}

/// A workflow step with its arguments checked (before any workflow file is
/// read, so bad arguments are refused first).
#[derive(Debug, Clone)]
enum WorkflowStep {
    Stream { max_batches: Option<u32>, resnapshot_interval_days: Option<f64> },
    Snapshot,
    Backfill(crate::engine::chunked::BackfillArgs),
    Status,
    Report(PathBuf),
    Seed(crate::engine::seed::SeedArgs),
    Apply,
    Reconcile,
    Maintain(crate::engine::maintain::MaintainArgs),
    Step(Option<crate::engine::machine::Transition>),
}

impl WorkflowStep {
    /// The step a command names, its arguments checked; `None` for the
    /// commands that work on no workflow.
    fn of(command: &Command) -> Result<Option<WorkflowStep>, StepError> {
        Ok(Some(match command {
            Command::Stream { max_batches, resnapshot_interval_days } => {
                if let Some(d) = resnapshot_interval_days {
                    if !(*d >= 0.0 && d.is_finite()) {
                        return Err(StepError::Config(format!("--resnapshot-interval-days is {d}: use 0 or more days")));
                    }
                }
                WorkflowStep::Stream { max_batches: *max_batches, resnapshot_interval_days: *resnapshot_interval_days }
            }
            Command::Snapshot => WorkflowStep::Snapshot,
            Command::Backfill(flags) => WorkflowStep::Backfill(flags.to_args()?),
            Command::Status { .. } => WorkflowStep::Status,
            Command::Report { out } => WorkflowStep::Report(out.clone()),
            Command::Seed { copy, as_of, reseed, allow_missing_columns } => {
                let as_of = crate::engine::seed::AsOf::parse(as_of)?;
                WorkflowStep::Seed(crate::engine::seed::SeedArgs { copy: copy.clone(), as_of, reseed: *reseed, allow_missing_columns: *allow_missing_columns })
            }
            Command::Apply => WorkflowStep::Apply,
            Command::Reconcile => WorkflowStep::Reconcile,
            Command::Maintain { vacuum_retention_hours, no_vacuum } => {
                WorkflowStep::Maintain(crate::engine::maintain::MaintainArgs::new(*vacuum_retention_hours, *no_vacuum)?)
            }
            Command::Step { transition } => WorkflowStep::Step(crate::engine::step::parse(transition)?),
            _ => return Ok(None),
        }))
    }

    fn name(&self) -> &'static str {
        match self {
            WorkflowStep::Stream { .. } => "stream",
            WorkflowStep::Snapshot => "snapshot",
            WorkflowStep::Backfill(_) => "backfill",
            WorkflowStep::Status => "status",
            WorkflowStep::Report(_) => "report",
            WorkflowStep::Seed(_) => "seed",
            WorkflowStep::Apply => "apply",
            WorkflowStep::Reconcile => "reconcile",
            WorkflowStep::Maintain(_) => "maintain",
            WorkflowStep::Step(_) => "step",
        }
    }

    /// The source connections the step may hold at once on `wf`: the steps
    /// that can read a snapshot use `snapshot.parallelism`.
    fn source_connections(&self, wf: &crate::workflow::Workflow) -> usize {
        match self {
            WorkflowStep::Stream { .. } | WorkflowStep::Snapshot | WorkflowStep::Backfill(_) | WorkflowStep::Step(_) => wf.snapshot.parallelism.max(1),
            _ => 1,
        }
    }

    /// Runs the step on one workflow.
    async fn run(&self, mut wf: crate::workflow::Workflow) -> Result<(Value, i32), StepError> {
        use crate::engine::Context;
        match self {
            WorkflowStep::Stream { max_batches, resnapshot_interval_days } => {
                if let Some(n) = max_batches {
                    wf.stream.max_batches = (*n).max(1);
                }
                if let Some(d) = resnapshot_interval_days {
                    wf.stream.resnapshot_interval_days = *d;
                }
                let mut ctx = Context::open(wf).await?;
                let r = crate::engine::coarse::stream(&mut ctx).await?;
                Ok((serde_json::to_value(&r).unwrap_or(Value::Null), EXIT_OK))
            }
            WorkflowStep::Snapshot => {
                let mut ctx = Context::open(wf).await?;
                if ctx.workflow.snapshot.mode == crate::workflow::SnapshotMode::Chunked {
                    let v = match crate::engine::chunked::ensure_bootstrap_open(&mut ctx).await? {
                        Some(r) => serde_json::to_value(&r).unwrap_or(Value::Null),
                        None => {
                            let st = crate::engine::state::load(&mut ctx).await?;
                            json!({"step": "snapshot", "mode": "chunked", "already_done": true, "snapshot_lsn": st.snapshot, "generation": st.generation})
                        }
                    };
                    return Ok((v, EXIT_OK));
                }
                let r = crate::engine::snapshot::ensure_bootstrap(&mut ctx).await?;
                Ok((serde_json::to_value(&r).unwrap_or(Value::Null), EXIT_OK))
            }
            WorkflowStep::Backfill(args) => {
                let mut ctx = Context::open(wf).await?;
                let r = crate::engine::chunked::backfill(&mut ctx, args).await?;
                // Paused on headroom: "call again later"; otherwise progress (call again until done).
                let code = if r.paused { crate::error::EXIT_TEMPORARY } else { EXIT_OK };
                Ok((serde_json::to_value(&r).unwrap_or(Value::Null), code))
            }
            WorkflowStep::Status => {
                // Status writes nothing: a stream that has not started reads as empty.
                let mut ctx = Context::open_read_only(wf).await?;
                Ok((crate::engine::status::run(&mut ctx).await?, EXIT_OK))
            }
            WorkflowStep::Report(out) => Ok((crate::report::run(&wf, out).await?, EXIT_OK)),
            WorkflowStep::Seed(args) => {
                let mut ctx = Context::open(wf).await?;
                let r = crate::engine::seed::run(&mut ctx, args).await?;
                Ok((serde_json::to_value(&r).unwrap_or(Value::Null), EXIT_OK))
            }
            WorkflowStep::Apply => {
                let mut ctx = Context::open(wf).await?;
                let r = crate::engine::apply::run(&mut ctx).await?;
                Ok((serde_json::to_value(&r).unwrap_or(Value::Null), EXIT_OK))
            }
            WorkflowStep::Reconcile => {
                let mut ctx = Context::open(wf).await?;
                let r = crate::engine::reconcile::run(&mut ctx).await?;
                let code = if r.clean { EXIT_OK } else { crate::error::EXIT_NEEDS_PERSON };
                Ok((serde_json::to_value(&r).unwrap_or(Value::Null), code))
            }
            WorkflowStep::Maintain(args) => Ok((crate::engine::maintain::run(&wf, args).await?, EXIT_OK)),
            WorkflowStep::Step(wanted) => {
                let mut ctx = Context::open(wf).await?;
                Ok((crate::engine::step::run(&mut ctx, *wanted).await?, EXIT_OK))
            }
        }
    }
}

/// `status --format table|prometheus`: renders the lines, prints them or
/// writes them to `out`; the JSON stays the last stdout line.
fn render_status(lines: &[crate::fleet::status::StatusLine], format: StatusFormat, out: Option<&std::path::Path>) -> Result<Option<String>, StepError> {
    let text = match format {
        StatusFormat::Json => return Ok(None),
        StatusFormat::Table => crate::fleet::status::table(lines),
        StatusFormat::Prometheus => crate::fleet::status::prometheus(lines),
    };
    match out {
        Some(path) => {
            crate::fleet::status::write_atomically(path, &text)
                .map_err(|e| StepError::Config(format!("cannot write {}: {e}. Pass --out a file in a folder that exists and is writable", path.display())))?;
            Ok(Some(path.display().to_string()))
        }
        None => {
            print!("{text}");
            Ok(None)
        }
    }
}

/// Runs a workflow step on the tables of a fleet file (`--table` or `--all`).
async fn run_fleet(cli: &Cli, fleet_path: &std::path::Path, step: WorkflowStep) -> Result<(Value, i32), StepError> {
    let fleet = crate::fleet::Fleet::load(fleet_path)?;
    let selected = fleet.select(cli.table.as_deref(), cli.all)?;
    if cli.all && matches!(step, WorkflowStep::Seed(_)) {
        return Err(StepError::Config("seed loads one table's copy: name the table with --table NAME, not --all".into()));
    }
    if cli.parallel == 0 {
        return Err(StepError::Config("--parallel is 0: use 1 or more".into()));
    }
    let status_format = match &cli.command {
        Command::Status { format, out } => Some((*format, out.clone())),
        _ => None,
    };
    if !cli.all {
        let wf = selected.into_iter().next().expect("select names one table");
        let (table, app) = (format!("{}.{}", wf.table.schema, wf.table.name), wf.app_id.clone());
        let (mut value, code) = step.run(wf).await?;
        if let WorkflowStep::Report(out) = &step {
            value["index"] = json!(crate::report::write_index(out, &[(table.clone(), app.clone(), value.clone())])?.display().to_string());
        }
        if let Some((format, out)) = status_format {
            let line = crate::fleet::status::StatusLine::from_status(&table, &app, &value, chrono::Utc::now());
            if let Some(written) = render_status(&[line], format, out.as_deref())? {
                let mut value = value;
                value["out"] = json!(written);
                return Ok((value, code));
            }
        }
        return Ok((value, code));
    }
    let step_name = step.name();
    let budget = fleet.max_source_connections;
    let outcomes = crate::fleet::run_many(
        selected,
        cli.parallel,
        budget,
        |wf| step.source_connections(wf),
        |wf| {
            let step = step.clone();
            async move { step.run(wf).await }
        },
    )
    .await;
    let mut tables = Vec::with_capacity(outcomes.len());
    for o in &outcomes {
        let mut v = o.to_json();
        if let Some(e) = v["result"]["error"].as_str() {
            let e = e.replace("--workflow FILE", &format!("--fleet {} --table {}", fleet_path.display(), o.table));
            v["result"]["error"] = json!(e);
        }
        tables.push(v);
    }
    let code = crate::fleet::fleet_exit_code(&outcomes);
    let failed = outcomes.iter().filter(|o| o.exit_code != EXIT_OK).count();
    let mut value = json!({
        "step": step_name,
        "fleet": fleet_path.display().to_string(),
        "tables": tables,
        "succeeded": outcomes.len() - failed,
        "failed": failed,
        "exit_code": code,
    });
    if let WorkflowStep::Report(out) = &step {
        let tables: Vec<(String, String, Value)> = outcomes.iter().map(|o| (o.table.clone(), o.app_id.clone(), o.value.clone())).collect();
        value["index"] = json!(crate::report::write_index(out, &tables)?.display().to_string());
    }
    if let Some((format, out)) = status_format {
        let now = chrono::Utc::now();
        let lines: Vec<crate::fleet::status::StatusLine> = outcomes
            .iter()
            .map(|o| match o.value["error"].as_str() {
                Some(e) if o.exit_code != EXIT_OK => crate::fleet::status::StatusLine::failed(&o.table, &o.app_id, e),
                _ => crate::fleet::status::StatusLine::from_status(&o.table, &o.app_id, &o.value, now),
            })
            .collect();
        if let Some(written) = render_status(&lines, format, out.as_deref())? {
            value["out"] = json!(written);
        }
    }
    Ok((value, code))
}

/// Runs one command; returns its JSON result and exit code.
pub async fn run(cli: Cli) -> Result<(Value, i32), StepError> {
    if let Some(step) = WorkflowStep::of(&cli.command)? {
        if let Some(fleet) = cli.fleet.clone() {
            return run_fleet(&cli, &fleet, step).await;
        }
        let wf = crate::workflow::Workflow::load(&workflow_path(&cli.workflow)?)?;
        let (table, app) = (format!("{}.{}", wf.table.schema, wf.table.name), wf.app_id.clone());
        let (mut value, code) = step.run(wf).await?;
        if let WorkflowStep::Report(out) = &step {
            value["index"] = json!(crate::report::write_index(out, &[(table.clone(), app.clone(), value.clone())])?.display().to_string());
        }
        if let Command::Status { format, out } = &cli.command {
            let line = crate::fleet::status::StatusLine::from_status(&table, &app, &value, chrono::Utc::now());
            if let Some(written) = render_status(&[line], *format, out.as_deref())? {
                value["out"] = json!(written);
            }
        }
        return Ok((value, code));
    }
    if cli.fleet.is_some() {
        return Err(StepError::Config("--fleet works with the workflow steps (stream, snapshot, backfill, status, report, seed, apply, reconcile, maintain, step)".into()));
    }
    match cli.command {
        Command::Stream { .. }
        | Command::Snapshot
        | Command::Backfill(_)
        | Command::Status { .. }
        | Command::Report { .. }
        | Command::Seed { .. }
        | Command::Apply
        | Command::Reconcile
        | Command::Maintain { .. }
        | Command::Step { .. } => unreachable!("workflow steps are run above"),
        Command::Sim(cmd) => {
            let v = tokio::task::spawn_blocking(move || crate::sim::cli::run(cmd))
                .await
                .map_err(|e| StepError::Internal(format!("sim command panicked: {e}")))?
                .map_err(|e| StepError::Config(e.to_string()))?;
            Ok((v, EXIT_OK))
        }
        Command::Bench(cmd) => Ok((crate::bench::run(cmd).await?, EXIT_OK)),
        Command::Machine { format } => {
            use crate::engine::machine;
            let diagram = match format {
                DiagramFormat::Mermaid => machine::mermaid(),
                DiagramFormat::Dot => machine::dot(),
            };
            // The diagram, then the JSON line every command ends with.
            print!("{diagram}");
            let value = json!({
                "step": "machine",
                "format": if format == DiagramFormat::Mermaid { "mermaid" } else { "dot" },
                "states": machine::State::ALL.iter().map(|s| s.name()).collect::<Vec<_>>(),
                "transitions": machine::Transition::ALL.iter().map(|t| t.name()).collect::<Vec<_>>(),
                "edges": machine::EDGES.len(),
            });
            Ok((value, EXIT_OK))
        }
        Command::Torture { recheck: Some(folder), .. } => {
            let f = folder.clone();
            // The checks run on a runtime of their own, outside this one.
            let outcome = tokio::task::spawn_blocking(move || std::thread::spawn(move || crate::torture::recheck(&f)).join())
                .await
                .map_err(|e| StepError::Internal(format!("torture recheck: {e}")))?
                .map_err(|_| StepError::Internal("the torture recheck panicked".into()))?;
            let ok = outcome.is_ok();
            let value = json!({"step": "torture", "recheck": folder, "ok": ok, "error": outcome.err()});
            Ok((value, if ok { EXIT_OK } else { EXIT_BUG }))
        }
        Command::Torture { seed, schedules, events, dir, no_kill, recheck: None } => {
            let binary = if no_kill { None } else { std::env::current_exe().ok() };
            let args = crate::torture::TortureArgs { seed, schedules, events, binary, dir };
            // Each call of a schedule runs on a runtime of its own (a crash
            // shuts it down), so the schedules run on a thread outside this one.
            let driver = std::thread::spawn(move || crate::torture::run(&args));
            let report = tokio::task::spawn_blocking(move || driver.join())
                .await
                .map_err(|e| StepError::Internal(format!("torture driver: {e}")))?
                .map_err(|_| StepError::Internal("the torture driver panicked".into()))?;
            let code = if report.failures == 0 { EXIT_OK } else { EXIT_BUG };
            Ok((serde_json::to_value(&report).unwrap_or(Value::Null), code))
        }
        Command::Demo(args) => {
            let (v, ok) = crate::demo::run(args).await?;
            Ok((v, if ok { EXIT_OK } else { crate::error::EXIT_NEEDS_PERSON }))
        }
    }
}
