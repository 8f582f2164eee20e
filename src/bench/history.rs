//! `mssql-cdc bench history`: what a `stream` call with nothing new costs as
//! the facts table it shares with other streams grows, before and after
//! `maintain`.
//!
//! An orchestrator runs each step in a fresh process, so nothing a step
//! read last time is cached: a call reads the facts table's log (a
//! checkpoint and the commits after it) and every data file it holds, one
//! per batch of every stream that shares it. The bench builds one stream
//! (a full bootstrap and a caught-up stream) and then, for each point of
//! `--history`, adds commits of one facts row each, as `--others` streams
//! sharing the table would, up to that many batches in all. At each point
//! it times `--calls` `stream` calls of the measured stream in child
//! processes of this binary (the median is kept), runs `maintain` in a child
//! process, and times the same calls again, so "before" and "after" are
//! measured side by side on the same history. The points build on one
//! table, so a later point's "before" holds the earlier points' history
//! compacted and its own added batches as small files, as a table
//! maintained at each point would (the workflow's table paths are bound
//! into its facts rows, so the folder cannot be copied aside instead).
//! The last line is the JSON; the ratios are the last point's median over
//! the first.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::delta::{self, facts};
use crate::engine::{self, Context};
use crate::error::{StepError, StepResult};
use crate::sim::{self, Clock, SimConfig, SimDb};
use crate::source::TableName;
use crate::workflow::Workflow;

#[derive(Debug, Clone, clap::Args)]
pub struct HistoryBenchArgs {
    /// Batches in the shared facts table at each point (ascending, comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "10,1000,10000")]
    pub history: Vec<u64>,
    /// Other streams sharing the facts table (their batches are spread over them).
    #[arg(long, default_value_t = 20)]
    pub others: u32,
    /// Timed `stream` calls per point and side (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub calls: u32,
    /// Folder for the database and tables (a fresh temporary one when omitted).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub async fn run(a: &HistoryBenchArgs) -> StepResult<Value> {
    if a.history.is_empty() || a.history.windows(2).any(|w| w[0] >= w[1]) || a.history[0] == 0 {
        return Err(StepError::Config("--history must name one or more batch counts, each at least 1, in ascending order (e.g. 10,1000,10000)".into()));
    }
    if a.others == 0 || a.calls == 0 {
        return Err(StepError::Config("--others and --calls must each be at least 1".into()));
    }
    let tmp = std::env::temp_dir().join(format!("mssql-cdc-bench-history-{}", std::process::id()));
    let dir = a.dir.clone().unwrap_or_else(|| tmp.clone());
    let main = dir.join("history");
    if main.exists() {
        return Err(StepError::Config(format!("{} already holds a bench run: pass an empty --dir", dir.display())));
    }
    std::fs::create_dir_all(&main).map_err(|e| StepError::Config(format!("cannot create {}: {e}", main.display())))?;
    let sim_err = |e: sim::SimError| StepError::Internal(format!("simulator: {e}"));
    let table = TableName::new("dbo", "orders");
    let cfg = SimConfig { clock: Clock::Wall, time_zone: "UTC".into(), idle_interval_seconds: 1, capture_lag_ms: 0, ..SimConfig::default() };
    let db = SimDb::create(&main.join("source.sqlite"), cfg).map_err(sim_err)?;
    db.create_table(&sim::orders_table_spec(table.clone())).map_err(sim_err)?;
    db.load_rows(&table, sim::orders_rows(200, 7)).map_err(sim_err)?;
    db.enable_cdc(&table, None, None).map_err(sim_err)?;
    while db.max_lsn().map_err(sim_err)?.is_none() {
        db.capture().map_err(sim_err)?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wf_path = main.join("orders.toml");
    let text = "app_id = \"bench-history\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"orders\"\n\
                [target]\nbronze = \"bronze\"\nfacts = \"facts\"\n[stream]\nmax_batch_rows = 50\n[snapshot]\nbootstrap = true\nmode = \"full\"\n";
    std::fs::write(&wf_path, text).map_err(|e| StepError::Config(format!("cannot write {}: {e}", wf_path.display())))?;
    let w = sim::Workload { tx_per_s: 0.0, ops_per_tx: 2, seed: 4, ..sim::Workload::default() };
    let mut ctx = Context::open(Workflow::load(&wf_path)?).await?;
    engine::snapshot::ensure_bootstrap(&mut ctx).await?;
    w.run(&db, &table, sim::Until::Transactions(20), std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false))).map_err(sim_err)?;
    db.capture().map_err(sim_err)?;
    engine::coarse::stream(&mut ctx).await?;
    // The row the others' batches are made from: one of the measured stream's own.
    let own = engine::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let template = own.iter().rfind(|r| r.batch_id.is_some() && r.event.is_none()).cloned().ok_or_else(|| StepError::Internal("the stream wrote no batch".into()))?;
    let own_batches = own.iter().filter(|r| r.batch_id.is_some() && r.event.is_none()).count() as u64;
    let exe = std::env::current_exe().map_err(|e| StepError::Internal(format!("cannot find this program: {e}")))?;

    let mut points = Vec::new();
    let mut added = 0u64;
    for &n in &a.history {
        let t = Instant::now();
        while own_batches + added < n {
            let other = added % u64::from(a.others);
            let row = facts::FactRow {
                app_id: format!("bench-history-other-{other:02}"),
                batch_id: Some((added / u64::from(a.others)) as i64),
                recorded_at: Some(chrono::Utc::now()),
                ..template.clone()
            };
            delta::append_untracked(&mut ctx.facts, vec![facts::to_batch(&[row])], json!({"bench": "history"})).await?;
            added += 1;
        }
        let fill_s = t.elapsed().as_secs_f64();
        let files_before = delta::maintain::file_count(&ctx.facts)?.0;
        let before_ms = median_call_ms(&exe, &wf_path, a.calls)?;

        let t = Instant::now();
        let j = call(&exe, &wf_path, &["maintain"])?;
        let maintain_ms = t.elapsed().as_secs_f64() * 1000.0;
        let files_after = j["tables"].as_array().and_then(|ts| ts.iter().find(|t| t["table"] == "facts")).and_then(|t| t["files_after"].as_u64());
        let after_ms = median_call_ms(&exe, &wf_path, a.calls)?;
        // The bench's own handle must see the compacted table before it adds more.
        ctx.facts.update_state().await.map_err(|e| StepError::Internal(format!("reloading facts: {e}")))?;
        tracing::info!(history_batches = n, files_before, before_ms, after_ms, "history point");
        points.push(json!({
            "history_batches": n,
            "fill_seconds": (fill_s * 10.0).round() / 10.0,
            "facts_files": files_before,
            "stream_ms_before_maintain": before_ms.round(),
            "maintain_ms": maintain_ms.round(),
            "facts_files_after_maintain": files_after,
            "stream_ms_after_maintain": after_ms.round(),
        }));
    }
    drop(ctx);
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let ratio = |key: &str| -> Option<f64> {
        let (f, l) = (points.first()?[key].as_f64()?, points.last()?[key].as_f64()?);
        (f > 0.0).then(|| (l / f * 100.0).round() / 100.0)
    };
    Ok(json!({
        "bench": "history",
        "others": a.others,
        "calls_per_point": a.calls,
        "points": points,
        "before_maintain_last_over_first": ratio("stream_ms_before_maintain"),
        "after_maintain_last_over_first": ratio("stream_ms_after_maintain"),
        "goal_after_maintain_last_over_first_at_most": 1.5,
    }))
}

/// One step of the workflow in a child process of this binary; its JSON.
fn call(exe: &Path, wf: &Path, args: &[&str]) -> StepResult<Value> {
    let out = std::process::Command::new(exe)
        .arg("--workflow")
        .arg(wf)
        .args(args)
        .env("MSSQL_CDC_LOG", "warn")
        .current_dir(wf.parent().unwrap_or(Path::new(".")))
        .output()
        .map_err(|e| StepError::Internal(format!("cannot run {}: {e}", exe.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let j: Value = stdout.lines().last().and_then(|l| serde_json::from_str(l).ok()).unwrap_or(Value::Null);
    if out.status.code() != Some(0) {
        return Err(StepError::Internal(format!("{args:?} exited {:?}: {j} {}", out.status.code(), String::from_utf8_lossy(&out.stderr))));
    }
    Ok(j)
}

/// The median wall time of `calls` `stream` calls, in milliseconds.
fn median_call_ms(exe: &Path, wf: &Path, calls: u32) -> StepResult<f64> {
    let mut ms = Vec::new();
    for _ in 0..calls {
        let t = Instant::now();
        call(exe, wf, &["stream"])?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok(ms[ms.len() / 2])
}
