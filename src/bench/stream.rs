//! `mssql-cdc bench stream`: what a `stream` call costs per batch as the
//! stream's history grows, and what reading the facts costs with and
//! without the per-file cache (`delta::facts_read`).
//!
//! The coarse `stream` reads the stream's state before every transition,
//! and the state is derived from every facts row the stream has written,
//! one file per batch. If that read cost what the whole table costs, a
//! batch late in a stream's life would cost more than an early one, and a
//! long backlog would be read ever more slowly. So this bench streams a
//! backlog in calls of `--batches-per-call` batches, as an orchestrator
//! would (a fresh context per call), and prints each call's milliseconds
//! per batch and the ratio of the last call's to the first's (about 1 when
//! the cost is flat). Then, on the facts table the run left behind, it
//! times the cached read against a SQL scan of the same snapshot, side by
//! side, and checks they return the same rows.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::delta;
use crate::engine::{self, Context};
use crate::error::{StepError, StepResult};
use crate::sim::{self, Clock, SimConfig, SimDb};
use crate::source::TableName;
use crate::workflow::Workflow;

#[derive(Debug, Clone, clap::Args)]
pub struct StreamBenchArgs {
    /// Rows in the table.
    #[arg(long, default_value_t = 2_000)]
    pub rows: u64,
    /// Transactions written after the bootstrap (the backlog the stream reads).
    #[arg(long, default_value_t = 20_000)]
    pub transactions: u64,
    /// `stream.max_batch_rows`: small batches make many facts files.
    #[arg(long, default_value_t = 200)]
    pub batch_rows: u64,
    /// Batches per `stream` call (`--max-batches`).
    #[arg(long, default_value_t = 50)]
    pub batches_per_call: u32,
    /// Reads of the facts per side in the read comparison.
    #[arg(long, default_value_t = 20)]
    pub reads: u32,
    /// Folder for the database and tables (a fresh temporary one when omitted).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub async fn run(a: &StreamBenchArgs) -> StepResult<Value> {
    if a.rows == 0 || a.transactions == 0 || a.batch_rows == 0 || a.batches_per_call == 0 || a.reads == 0 {
        return Err(StepError::Config("--rows, --transactions, --batch-rows, --batches-per-call and --reads must each be at least 1".into()));
    }
    let tmp = std::env::temp_dir().join(format!("mssql-cdc-bench-stream-{}", std::process::id()));
    let dir = a.dir.clone().unwrap_or_else(|| tmp.clone());
    std::fs::create_dir_all(&dir).map_err(|e| StepError::Config(format!("cannot create {}: {e}", dir.display())))?;
    let sim_err = |e: sim::SimError| StepError::Internal(format!("simulator: {e}"));
    let table = TableName::new("dbo", "orders");
    let db_path = dir.join("source.sqlite");
    if db_path.exists() {
        return Err(StepError::Config(format!("{} already holds a bench database: pass an empty --dir", dir.display())));
    }
    let cfg = SimConfig { clock: Clock::Wall, time_zone: "UTC".into(), idle_interval_seconds: 1, capture_lag_ms: 0, ..SimConfig::default() };
    let db = SimDb::create(&db_path, cfg).map_err(sim_err)?;
    db.create_table(&sim::orders_table_spec(table.clone())).map_err(sim_err)?;
    db.load_rows(&table, sim::orders_rows(a.rows, 7)).map_err(sim_err)?;
    db.enable_cdc(&table, None, None).map_err(sim_err)?;
    while db.max_lsn().map_err(sim_err)?.is_none() {
        db.capture().map_err(sim_err)?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wf_path = dir.join("orders.toml");
    let text = format!(
        "app_id = \"bench-stream\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"orders\"\n\
         [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n[stream]\nmax_batch_rows = {}\n\
         [snapshot]\nbootstrap = true\nmode = \"full\"\n",
        a.batch_rows
    );
    std::fs::write(&wf_path, text).map_err(|e| StepError::Config(format!("cannot write {}: {e}", wf_path.display())))?;
    let mut ctx = Context::open(Workflow::load(&wf_path)?).await?;
    engine::snapshot::ensure_bootstrap(&mut ctx).await?;
    drop(ctx);

    let w = sim::Workload { tx_per_s: 0.0, ops_per_tx: 2, seed: 4, ..sim::Workload::default() };
    w.run(&db, &table, sim::Until::Transactions(a.transactions), std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false))).map_err(sim_err)?;
    db.capture().map_err(sim_err)?;

    let mut calls = Vec::new();
    let (mut batches, mut rows) = (0u64, 0u64);
    let t_all = Instant::now();
    loop {
        let mut wf = Workflow::load(&wf_path)?;
        wf.stream.max_batches = a.batches_per_call;
        let mut ctx = Context::open(wf).await?;
        let t = Instant::now();
        let r = engine::coarse::stream(&mut ctx).await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if r.batches > 0 {
            calls.push(json!({"batches": r.batches, "rows": r.rows, "ms": ms.round(), "ms_per_batch": (ms / r.batches as f64 * 10.0).round() / 10.0, "batches_before": batches}));
        }
        batches += u64::from(r.batches);
        rows += u64::try_from(r.rows).unwrap_or(0);
        if r.caught_up || r.batches == 0 {
            break;
        }
    }
    let stream_s = t_all.elapsed().as_secs_f64();
    let per_batch = |c: &Value| c["ms_per_batch"].as_f64().unwrap_or(0.0);
    // The last full call (a short last call pays its fixed cost over fewer batches).
    let full: Vec<&Value> = calls.iter().filter(|c| c["batches"].as_u64() == Some(u64::from(a.batches_per_call))).collect();
    let growth = match (full.first(), full.last()) {
        (Some(f), Some(l)) if full.len() > 1 && per_batch(f) > 0.0 => Some((per_batch(l) / per_batch(f) * 100.0).round() / 100.0),
        _ => None,
    };

    // The facts read, side by side on the table the run left.
    let ctx = Context::open(Workflow::load(&wf_path)?).await?;
    let files = ctx.facts.snapshot().map(|s| s.log_data().into_iter().count()).unwrap_or(0);
    let app = ctx.workflow.app_id.clone();
    let sql = format!("SELECT * FROM t WHERE app_id = {}", delta::sql_str(&app));
    let t = Instant::now();
    let mut scanned = Vec::new();
    for _ in 0..a.reads {
        scanned = delta::facts::from_batches(&delta::query(&ctx.facts, &sql).await?)?;
    }
    let scan_ms = t.elapsed().as_secs_f64() * 1000.0 / f64::from(a.reads);
    let t = Instant::now();
    let mut cached = Vec::new();
    for _ in 0..a.reads {
        cached = delta::facts_read::rows_of(&ctx.facts, &app).await?;
    }
    let cached_ms = t.elapsed().as_secs_f64() * 1000.0 / f64::from(a.reads);
    let key = |r: &delta::facts::FactRow| serde_json::to_string(r).unwrap_or_default();
    let (mut s, mut c): (Vec<String>, Vec<String>) = (scanned.iter().map(key).collect(), cached.iter().map(key).collect());
    s.sort();
    c.sort();
    if s != c {
        return Err(StepError::Internal(format!("the cached facts read returned {} rows and the scan {}, not the same rows", c.len(), s.len())));
    }
    drop(ctx);
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(json!({
        "bench": "stream",
        "rows": a.rows,
        "transactions": a.transactions,
        "batch_rows": a.batch_rows,
        "batches": batches,
        "change_rows": rows,
        "stream_seconds": (stream_s * 10.0).round() / 10.0,
        "calls": calls,
        "ms_per_batch_last_over_first": growth,
        "facts_read": {
            "facts_files": files,
            "facts_rows": c.len(),
            "sql_scan_ms": (scan_ms * 10.0).round() / 10.0,
            "cached_ms": (cached_ms * 100.0).round() / 100.0,
            "scan_over_cached": if cached_ms > 0.0 { Some((scan_ms / cached_ms).round()) } else { None },
            "same_rows": true,
        },
    }))
}
