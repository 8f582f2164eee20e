//! `mssql-cdc demo`: scenarios run end to end on the embedded simulator.
//!
//! One harness ([`Harness`]) makes a simulated database with a table and a
//! writer, writes the workflow files, and calls the same steps an
//! orchestrator would; each scenario is a sequence of those calls ending in
//! `apply` (silver from bronze) and `reconcile` (silver against the source).
//! The last stdout line is the scenario's JSON; the command exits 0 only
//! when `differences` (what reconcile found besides IN_FLIGHT) is 0.

pub mod loss;
pub mod seed;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::engine::{self, rebuild, Context};
use crate::error::{StepError, StepResult};
use crate::sim::{self, Clock, SimConfig, SimDb};
use crate::source::TableName;
use crate::workflow::Workflow;

/// The scenarios `demo` can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoScenario {
    /// A full bootstrap under a running writer, then micro-batches, then a check.
    Full,
    /// A chunked bootstrap: the stream starts at S at once and `backfill`
    /// reads the table in waves beside it, both under the running writer.
    Chunked,
    /// A Parquet copy exported under the running writer, seeded by its start time, then streamed and checked.
    Seed,
    /// The stream stops for longer than the CDC retention; its next call
    /// recovers on its own with a full re-snapshot in a new generation.
    DataLoss,
    /// As data-loss, with a chunked re-snapshot: the new generation streams
    /// at once while `backfill` reads the table beside it.
    DataLossChunked,
}

/// Arguments of `mssql-cdc demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Rows in the demo table before CDC is enabled.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Folder for the simulated database, the workflow file and the Delta tables
    /// (replaced when it holds an earlier demo; refused when it holds anything else).
    #[arg(long, default_value = "demo-out")]
    pub dir: PathBuf,
    #[arg(long, value_enum, default_value_t = DemoScenario::Full)]
    pub scenario: DemoScenario,
    /// Seconds of streaming while the writer runs, after the bootstrap.
    #[arg(long, default_value_t = 15)]
    pub stream_seconds: u64,
    /// The writer's transactions per second.
    #[arg(long, default_value_t = 200.0)]
    pub writer_tx_per_s: f64,
    /// Seed of the table's rows and of the writer.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

const MARKER: &str = ".mssql-cdc-demo";

/// The demo's world: a simulated database, a writer, workflow files.
pub struct Harness {
    pub dir: PathBuf,
    pub db: SimDb,
    pub table: TableName,
    pub workflow_path: PathBuf,
    writer: Option<(std::thread::JoinHandle<Result<sim::WorkloadReport, sim::SimError>>, Arc<AtomicBool>)>,
    pub progress: indicatif::ProgressBar,
}

impl Harness {
    /// Prepares `dir` and creates the simulated database with `rows` orders.
    pub fn create(dir: &Path, rows: u64, seed: u64) -> StepResult<Harness> {
        let cfg = SimConfig {
            clock: Clock::Wall,
            time_zone: "America/Sao_Paulo".into(),
            capture_lag_ms: 300,
            idle_interval_seconds: 1,
            seed,
            ..SimConfig::default()
        };
        Harness::create_with(dir, rows, cfg)
    }

    /// [`Harness::create`] with the simulator's settings given (a manual
    /// clock lets a scenario skip days ahead).
    pub fn create_with(dir: &Path, rows: u64, cfg: SimConfig) -> StepResult<Harness> {
        prepare_dir(dir)?;
        let seed = cfg.seed;
        let sim_err = |e: sim::SimError| StepError::Internal(format!("simulator: {e}"));
        let db = SimDb::create(&dir.join("source.sqlite"), cfg).map_err(sim_err)?;
        let table = TableName::new("dbo", "orders");
        db.create_table(&sim::orders_table_spec(table.clone())).map_err(sim_err)?;
        db.load_rows(&table, sim::orders_rows(rows, seed)).map_err(sim_err)?;
        db.enable_cdc(&table, None, None).map_err(sim_err)?;
        let progress = indicatif::ProgressBar::new_spinner();
        progress.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        Ok(Harness { dir: dir.to_path_buf(), db, table, workflow_path: dir.join("orders.toml"), writer: None, progress })
    }

    /// Writes the workflow file with these extra `[snapshot]` settings.
    pub fn write_workflow(&self, snapshot_toml: &str) -> StepResult<()> {
        self.write_workflow_with("", snapshot_toml)
    }

    /// Writes the workflow file with extra `[stream]` and `[snapshot]` settings.
    pub fn write_workflow_with(&self, stream_toml: &str, snapshot_toml: &str) -> StepResult<()> {
        let text = format!(
            "# Written by `mssql-cdc demo`.\napp_id = \"orders-demo\"\n\n[source]\nurl = \"sim://source.sqlite\"\n\n\
             [table]\nschema = \"dbo\"\nname = \"orders\"\n\n[target]\nbronze = \"bronze/orders\"\nfacts = \"facts\"\nsilver = \"silver/orders\"\n\n\
             [stream]\nmax_batch_rows = 20000\n{stream_toml}\n\n[reconcile]\nbuckets = 64\nsample_fraction = 0.25\n\n[snapshot]\n{snapshot_toml}\n"
        );
        std::fs::write(&self.workflow_path, text).map_err(|e| StepError::Config(format!("cannot write {}: {e}", self.workflow_path.display())))
    }

    /// Starts the writer on a thread.
    pub fn start_writer(&mut self, tx_per_s: f64, seed: u64) {
        let stop = Arc::new(AtomicBool::new(false));
        let db = SimDb::open(self.db.path()).expect("the demo database opens");
        let table = self.table.clone();
        let s2 = stop.clone();
        let handle = std::thread::spawn(move || {
            let w = sim::Workload { tx_per_s, ops_per_tx: 3, seed, ..sim::Workload::default() };
            w.run(&db, &table, sim::Until::Deadline(Instant::now() + Duration::from_secs(24 * 3600)), s2)
        });
        self.writer = Some((handle, stop));
    }

    /// Stops the writer and waits for it.
    pub fn stop_writer(&mut self) -> StepResult<sim::WorkloadReport> {
        let Some((h, stop)) = self.writer.take() else { return Ok(sim::WorkloadReport::default()) };
        stop.store(true, Ordering::SeqCst);
        h.join()
            .map_err(|_| StepError::Internal("the writer thread panicked".into()))?
            .map_err(|e| StepError::Internal(format!("writer: {e}")))
    }

    pub fn workflow(&self) -> StepResult<Workflow> {
        Workflow::load(&self.workflow_path)
    }

    /// One `stream` call, as an orchestrator makes it.
    pub async fn stream(&self) -> StepResult<engine::stream::StreamResult> {
        let mut ctx = Context::open(self.workflow()?).await?;
        engine::coarse::stream(&mut ctx).await
    }

    /// Waits until the simulated capture job has recorded an LSN.
    pub async fn wait_for_capture(&self) -> StepResult<()> {
        let wait_start = Instant::now();
        while self.db.max_lsn().map_err(|e| StepError::Internal(format!("simulator: {e}")))?.is_none() {
            if wait_start.elapsed() > Duration::from_secs(30) {
                return Err(StepError::Temporary("the simulated capture job recorded no LSN within 30 s".into()));
            }
            let _ = self.db.capture();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    /// Stops the writer, lets capture harvest its last transactions and streams to its last commit.
    pub async fn stop_and_catch_up(&mut self) -> StepResult<(sim::WorkloadReport, u32, i64)> {
        let writer = self.stop_writer()?;
        self.say("writer stopped; catching up");
        tokio::time::sleep(Duration::from_millis(400)).await;
        self.db.capture().map_err(|e| StepError::Internal(format!("capture: {e}")))?;
        let (mut batches, mut rows) = (0u32, 0i64);
        for _ in 0..100 {
            let r = self.stream().await?;
            batches += r.batches;
            rows += r.rows;
            let done = r.caught_up
                && match (r.position, writer.last_commit_lsn) {
                    (Some(p), Some(w)) => p >= w,
                    _ => true,
                };
            if done {
                break;
            }
        }
        Ok((writer, batches, rows))
    }

    /// Rebuilds the latest image per key from bronze and compares it with the table now.
    pub async fn verify(&self) -> StepResult<rebuild::Comparison> {
        let mut ctx = Context::open(self.workflow()?).await?;
        let st = engine::state::load(&mut ctx).await?;
        // Rows are told apart by the unique index, as silver's are (snapshot.keys only cut chunks).
        let keys = if ctx.instance.index_columns.is_empty() { ctx.snapshot_keys() } else { ctx.instance.index_columns.clone() };
        let image = rebuild::rebuild(&ctx.bronze, &ctx.instance.columns, &keys, st.snapshot).await?;
        rebuild::compare_with_source(ctx.source.as_ref(), &self.table, &ctx.instance.columns, &keys, &image).await
    }

    /// The end of every scenario: `apply` (silver from bronze) then
    /// `reconcile` (silver against the table now), as an orchestrator calls them.
    pub async fn check(&self) -> StepResult<Check> {
        let mut ctx = Context::open(self.workflow()?).await?;
        let apply = engine::apply::run(&mut ctx).await?;
        let mut ctx = Context::open(self.workflow()?).await?;
        let reconcile = engine::reconcile::run(&mut ctx).await?;
        Ok(Check { apply, reconcile })
    }

    /// A handle that runs steps against this harness's workflow from another task.
    pub fn stream_handle(&self) -> StepHandle {
        StepHandle { workflow_path: self.workflow_path.clone() }
    }

    pub fn say(&self, msg: impl Into<std::borrow::Cow<'static, str>>) {
        self.progress.set_message(msg);
        self.progress.tick();
    }
}

/// What a scenario's final `apply` and `reconcile` found.
#[derive(Debug, Clone)]
pub struct Check {
    pub apply: engine::apply::ApplyResult,
    pub reconcile: engine::reconcile::ReconcileResult,
}

impl Check {
    /// What reconcile found besides IN_FLIGHT (0 expected).
    pub fn differences(&self) -> u64 {
        self.reconcile.differences
    }

    /// The scenario JSON's `reconcile` member: counts per class and `clean`.
    pub fn reconcile_json(&self) -> Value {
        let r = &self.reconcile;
        json!({
            "clean": r.clean,
            "counts": r.counts,
            "run": r.run,
            "tier1": r.tier1,
            "buckets": r.buckets,
            "buckets_mismatched": r.buckets_mismatched,
            "buckets_compared": r.buckets_compared,
            "rows_compared": r.rows_compared,
            "chunks_checked": r.chunks_checked,
            "samples": r.samples,
        })
    }

    /// The scenario JSON's `apply` member.
    pub fn apply_json(&self) -> Value {
        serde_json::to_value(&self.apply).unwrap_or(Value::Null)
    }
}

/// Runs steps of one workflow file; cheap to clone into tasks.
#[derive(Debug, Clone)]
pub struct StepHandle {
    workflow_path: PathBuf,
}

impl StepHandle {
    pub async fn stream(&self) -> StepResult<engine::stream::StreamResult> {
        let mut ctx = Context::open(Workflow::load(&self.workflow_path)?).await?;
        engine::coarse::stream(&mut ctx).await
    }

    pub async fn backfill(&self, args: &engine::chunked::BackfillArgs) -> StepResult<engine::chunked::BackfillResult> {
        let mut ctx = Context::open(Workflow::load(&self.workflow_path)?).await?;
        engine::chunked::backfill(&mut ctx, args).await
    }

    pub async fn apply(&self) -> StepResult<engine::apply::ApplyResult> {
        let mut ctx = Context::open(Workflow::load(&self.workflow_path)?).await?;
        engine::apply::run(&mut ctx).await
    }
}

/// Empties a folder of an earlier demo, refuses one holding anything else.
fn prepare_dir(dir: &Path) -> StepResult<()> {
    if dir.exists() {
        let empty = std::fs::read_dir(dir).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty {
            if !dir.join(MARKER).exists() {
                return Err(StepError::Config(format!(
                    "{} holds files that are not an earlier demo's: pass another --dir",
                    dir.display()
                )));
            }
            std::fs::remove_dir_all(dir).map_err(|e| StepError::Config(format!("cannot clear {}: {e}", dir.display())))?;
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| StepError::Config(format!("cannot create {}: {e}", dir.display())))?;
    std::fs::write(dir.join(MARKER), "a folder made by `mssql-cdc demo`; the next demo run replaces it\n")
        .map_err(|e| StepError::Config(format!("cannot write in {}: {e}", dir.display())))?;
    Ok(())
}

/// Runs the scenario; returns its JSON and whether it passed.
pub async fn run(args: DemoArgs) -> StepResult<(Value, bool)> {
    match args.scenario {
        DemoScenario::Full => full(args).await,
        DemoScenario::Chunked => chunked(args).await,
        DemoScenario::Seed => seed::run(args).await,
        DemoScenario::DataLoss => loss::run(args, false).await,
        DemoScenario::DataLossChunked => loss::run(args, true).await,
    }
}

async fn full(args: DemoArgs) -> StepResult<(Value, bool)> {
    let t0 = Instant::now();
    let dir = std::path::absolute(&args.dir).unwrap_or(args.dir.clone());
    let mut h = Harness::create(&dir, args.rows, args.seed)?;
    let create_s = t0.elapsed().as_secs_f64();
    h.write_workflow("bootstrap = true\nmode = \"full\"\nparallelism = 4")?;
    h.progress.enable_steady_tick(Duration::from_millis(200));
    h.say(format!("created a simulated dbo.orders with {} rows in {create_s:.1}s; writer starting", args.rows));
    h.start_writer(args.writer_tx_per_s, args.seed);

    // The capture job's first scans: a snapshot needs an LSN to stand at.
    h.wait_for_capture().await?;
    let t_boot = Instant::now();
    h.say("bootstrap: reading the table at S over 4 connections");
    let mut ctx = Context::open(h.workflow()?).await?;
    let boot = engine::snapshot::ensure_bootstrap(&mut ctx).await?;
    drop(ctx);
    let bootstrap_s = t_boot.elapsed().as_secs_f64();

    let t_stream = Instant::now();
    let (mut batches, mut streamed) = (0u32, 0i64);
    while t_stream.elapsed() < Duration::from_secs(args.stream_seconds) {
        let r = h.stream().await?;
        batches += r.batches;
        streamed += r.rows;
        h.say(format!("streaming: {batches} batches, {streamed} change rows, position {}", r.position.map(|p| p.to_string()).unwrap_or_default()));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (writer, b, r) = h.stop_and_catch_up().await?;
    batches += b;
    streamed += r;
    let stream_s = t_stream.elapsed().as_secs_f64();
    h.say("checking: apply to silver, then reconcile silver with the table");
    let t_verify = Instant::now();
    let check = h.check().await?;
    let verify_s = t_verify.elapsed().as_secs_f64();
    h.progress.finish_and_clear();
    let differences = check.differences();
    let out = json!({
        "scenario": "full",
        "rows_source": check.reconcile.rows_source,
        "rows_target": check.reconcile.rows_target,
        "differences": differences,
        "reconcile": check.reconcile_json(),
        "apply": check.apply_json(),
        "batches": batches,
        "change_rows_streamed": streamed,
        "bootstrap_rows": boot.rows,
        "bootstrap_lsn": boot.snapshot_lsn,
        "writer": writer,
        "seconds": {"create": create_s, "bootstrap": bootstrap_s, "stream": stream_s, "verify": verify_s, "total": t0.elapsed().as_secs_f64()},
        "bootstrap_rows_per_s": if bootstrap_s > 0.0 { boot.rows as f64 / bootstrap_s } else { 0.0 },
        "dir": dir,
        "workflow": h.workflow_path,
    });
    Ok((out, differences == 0))
}

/// The chunked scenario: the stream and `backfill` run side by side (two
/// tasks, as two orchestrator jobs would), each called again and again,
/// under the writer, `apply` taking each wave into silver as it arrives;
/// then `apply` and `reconcile` check silver against the source.
async fn chunked(args: DemoArgs) -> StepResult<(Value, bool)> {
    let t0 = Instant::now();
    let dir = std::path::absolute(&args.dir).unwrap_or(args.dir.clone());
    let mut h = Harness::create(&dir, args.rows, args.seed)?;
    let create_s = t0.elapsed().as_secs_f64();
    let chunk_rows = (args.rows / 40).clamp(1_000, 1_000_000);
    h.write_workflow(&format!("bootstrap = true\nmode = \"chunked\"\nparallelism = 4\nchunk_rows = {chunk_rows}\ntarget_wave_seconds = 2"))?;
    h.progress.enable_steady_tick(Duration::from_millis(200));
    h.say(format!("created a simulated dbo.orders with {} rows in {create_s:.1}s; writer starting", args.rows));
    h.start_writer(args.writer_tx_per_s, args.seed);
    h.wait_for_capture().await?;

    // The stream's first call opens the snapshot at S and starts from there.
    let first = h.stream().await?;
    let t_boot = Instant::now();
    let h = Arc::new(tokio::sync::Mutex::new(h));
    let backfill_done = Arc::new(AtomicBool::new(false));
    let stream_task = {
        let h = h.clone();
        let backfill_done = backfill_done.clone();
        let min_seconds = args.stream_seconds;
        tokio::spawn(async move {
            let started = Instant::now();
            let (mut batches, mut rows) = (first.batches, first.rows);
            loop {
                let r = { h.lock().await.stream_handle() }.stream().await?;
                batches += r.batches;
                rows += r.rows;
                if backfill_done.load(Ordering::SeqCst) && started.elapsed() >= Duration::from_secs(min_seconds) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Ok::<_, StepError>((batches, rows))
        })
    };
    let handle = { h.lock().await.stream_handle() };
    let bf_args = engine::chunked::BackfillArgs { max_seconds: Some(2.0), ..Default::default() };
    let (mut calls, mut waves, mut backfill_rows, mut chunks_total) = (0u32, 0u32, 0i64, 0usize);
    let mut fixed: Vec<f64> = Vec::new();
    let (mut applies, mut waves_applied) = (0u32, 0u32);
    let backfill_outcome: StepResult<()> = async {
        loop {
            let r = handle.backfill(&bf_args).await?;
            calls += 1;
            waves += r.waves;
            backfill_rows += r.rows;
            chunks_total = r.chunks_total;
            fixed.extend(r.wave_fixed_seconds.iter().copied());
            // Silver takes each wave as it arrives (the verdict held until the completion).
            let a = handle.apply().await?;
            applies += 1;
            waves_applied += a.waves_applied.len() as u32;
            h.lock().await.say(format!("backfill: {}/{} chunks in {waves} waves ({backfill_rows} rows), stream running", r.chunks_done, r.chunks_total));
            if r.done {
                return Ok(());
            }
        }
    }
    .await;
    backfill_done.store(true, Ordering::SeqCst);
    let bootstrap_s = t_boot.elapsed().as_secs_f64();
    let (mut batches, mut streamed) = stream_task.await.map_err(|e| StepError::Internal(format!("stream task: {e}")))??;
    backfill_outcome?;
    let mut h = Arc::try_unwrap(h).map_err(|_| StepError::Internal("the harness is still shared".into()))?.into_inner();
    let (writer, b, r) = h.stop_and_catch_up().await?;
    batches += b;
    streamed += r;
    h.say("checking: apply to silver, then reconcile silver with the table");
    let t_verify = Instant::now();
    let check = h.check().await?;
    let verify_s = t_verify.elapsed().as_secs_f64();
    h.progress.finish_and_clear();
    let differences = check.differences();
    fixed.sort_by(|a, b| a.total_cmp(b));
    let out = json!({
        "scenario": "chunked",
        "rows_source": check.reconcile.rows_source,
        "rows_target": check.reconcile.rows_target,
        "differences": differences,
        "reconcile": check.reconcile_json(),
        "apply": check.apply_json(),
        "snapshot_lsn": first.position,
        "chunk_rows": chunk_rows,
        "chunks_total": chunks_total,
        "waves": waves,
        "backfill_calls": calls,
        "apply_calls_during_backfill": applies,
        "waves_applied_during_backfill": waves_applied,
        "backfill_rows": backfill_rows,
        "backfill_rows_per_s": if bootstrap_s > 0.0 { backfill_rows as f64 / bootstrap_s } else { 0.0 },
        "wave_fixed_seconds_median": fixed.get(fixed.len() / 2),
        "batches": batches,
        "change_rows_streamed": streamed,
        "writer": writer,
        "seconds": {"create": create_s, "backfill": bootstrap_s, "verify": verify_s, "total": t0.elapsed().as_secs_f64()},
        "dir": dir,
        "workflow": h.workflow_path,
    });
    Ok((out, differences == 0))
}
