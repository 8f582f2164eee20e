//! `mssql-cdc bench apply`: `apply` of a batch of changes into a large
//! silver, `reconcile` of that silver, and a bare deltalake append of the
//! same rows as the baseline.
//!
//! The set-up (a simulated table of `--rows` rows, its full bootstrap, the
//! first apply that builds silver, then `--changes` changes made by
//! transactions on the simulator, captured and streamed into bronze) runs in
//! a child process; each measured step runs in a child of its own so its
//! peak resident set (VmHWM, reset when the step starts) is its own.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::peak_rss_bytes;
use crate::delta::{self, bronze, Txn};
use crate::engine::{self, Context};
use crate::error::{StepError, StepResult};
use crate::sim::{self, Clock, SimConfig, SimDb};
use crate::source::TableName;
use crate::types::SqlValue;
use crate::workflow::Workflow;

#[derive(Debug, Clone, clap::Args)]
pub struct ApplyBenchArgs {
    /// Rows in the table, and so in silver before the changes.
    #[arg(long, default_value_t = 10_000_000)]
    pub rows: u64,
    /// Changes applied (80% updates, 10% deletes, 10% inserts, each key once).
    #[arg(long, default_value_t = 1_000_000)]
    pub changes: u64,
    /// Folder for the database and tables (a fresh temporary one when omitted).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Internal: run one phase in this process (`setup`, `apply`, `reconcile` or `append`).
    #[arg(long, hide = true)]
    pub child: Option<String>,
}

pub async fn run(a: &ApplyBenchArgs) -> StepResult<Value> {
    match a.child.as_deref() {
        Some(phase) => child(a, phase).await,
        None => parent(a).await,
    }
}

async fn parent(a: &ApplyBenchArgs) -> StepResult<Value> {
    if a.rows == 0 || a.changes == 0 || a.changes > a.rows {
        return Err(StepError::Config("--rows and --changes must be at least 1, and --changes at most --rows".into()));
    }
    let tmp = std::env::temp_dir().join(format!("mssql-cdc-bench-apply-{}", std::process::id()));
    let dir = a.dir.clone().unwrap_or_else(|| tmp.clone());
    let exe = std::env::current_exe().map_err(|e| StepError::Internal(format!("cannot find this program: {e}")))?;
    let phase = |p: &str| -> StepResult<Value> {
        tracing::info!(phase = p, "bench apply phase starting");
        let out = std::process::Command::new(&exe)
            .args(["bench", "apply", "--child", p, "--rows", &a.rows.to_string(), "--changes", &a.changes.to_string()])
            .arg("--dir")
            .arg(&dir)
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| StepError::Internal(format!("cannot run the bench child: {e}")))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(text.lines().last().unwrap_or(""))
            .map_err(|e| StepError::Internal(format!("bench child printed no JSON ({e}): {text}")))?;
        if !out.status.success() {
            return Err(StepError::Internal(format!("bench child {p} failed: {v}")));
        }
        Ok(v)
    };
    let setup = phase("setup")?;
    let apply = phase("apply")?;
    let reconcile = phase("reconcile")?;
    let append = phase("append")?;
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(json!({"bench": "apply", "rows": a.rows, "changes": a.changes, "setup": setup, "apply": apply, "reconcile": reconcile, "append_baseline": append, "allocator": crate::alloc::name(), "c_arena_limit": crate::alloc::c_arena_limit()}))
}

fn workflow(dir: &Path) -> StepResult<Workflow> {
    let path = dir.join("orders.toml");
    if !path.exists() {
        let text = "app_id = \"bench-apply\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"orders\"\n\
                    [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n[stream]\nmax_batch_rows = 200000\n\
                    [snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[reconcile]\nbuckets = 64\nsample_fraction = 0.1\n";
        std::fs::write(&path, text).map_err(|e| StepError::Config(format!("cannot write {}: {e}", path.display())))?;
    }
    Workflow::load(&path)
}

fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

async fn child(a: &ApplyBenchArgs, phase: &str) -> StepResult<Value> {
    let dir = a.dir.clone().ok_or_else(|| StepError::Config("--child needs --dir".into()))?;
    std::fs::create_dir_all(&dir).map_err(|e| StepError::Config(format!("cannot create {}: {e}", dir.display())))?;
    let sim_err = |e: sim::SimError| StepError::Internal(format!("simulator: {e}"));
    let table = TableName::new("dbo", "orders");
    match phase {
        "setup" => {
            let t0 = Instant::now();
            let cfg = SimConfig { clock: Clock::Wall, time_zone: "UTC".into(), idle_interval_seconds: 1, capture_lag_ms: 0, ..SimConfig::default() };
            let db = SimDb::create(&dir.join("source.sqlite"), cfg).map_err(sim_err)?;
            db.create_table(&sim::orders_table_spec(table.clone())).map_err(sim_err)?;
            db.load_rows(&table, sim::orders_rows(a.rows, 7)).map_err(sim_err)?;
            db.enable_cdc(&table, None, None).map_err(sim_err)?;
            while db.max_lsn().map_err(sim_err)?.is_none() {
                db.capture().map_err(sim_err)?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let load_s = t0.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut ctx = Context::open(workflow(&dir)?).await?;
            engine::snapshot::ensure_bootstrap(&mut ctx).await?;
            let bootstrap_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let built = engine::apply::run(&mut ctx).await?;
            let build_s = t.elapsed().as_secs_f64();
            // The changes: each key touched once, in transactions of 1,000.
            let t = Instant::now();
            let mut rng = SmallRng::seed_from_u64(11);
            let mut ids: Vec<i64> = (1..=a.rows as i64).collect();
            for i in 0..a.changes as usize {
                let j = rng.random_range(i..ids.len());
                ids.swap(i, j);
            }
            let template: Vec<Vec<SqlValue>> = sim::orders_rows(1, 99).collect();
            let mut next_id = a.rows as i64 + 1;
            for chunk in ids[..a.changes as usize].chunks(1000) {
                db.transaction(|tx| {
                    for (n, id) in chunk.iter().enumerate() {
                        match n % 10 {
                            0 => tx.delete(&table, &vec![SqlValue::Int(*id)])?,
                            1 => {
                                let mut row = template[0].clone();
                                row[0] = SqlValue::Int(next_id);
                                next_id += 1;
                                tx.insert(&table, row)?;
                            }
                            _ => {
                                let mut row = template[0].clone();
                                row[0] = SqlValue::Int(*id);
                                row[2] = SqlValue::Decimal { value: (*id as i128 % 100_000) * 7 + 1, scale: 2 };
                                tx.update(&table, &vec![SqlValue::Int(*id)], row)?;
                            }
                        }
                    }
                    Ok(())
                })
                .map_err(sim_err)?;
                db.capture().map_err(sim_err)?;
            }
            db.capture().map_err(sim_err)?;
            let changes_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut streamed = 0i64;
            for _ in 0..1000 {
                let mut ctx = Context::open(workflow(&dir)?).await?;
                let r = engine::coarse::stream(&mut ctx).await?;
                streamed += r.rows;
                if r.caught_up {
                    break;
                }
            }
            let stream_s = t.elapsed().as_secs_f64();
            Ok(json!({"load_seconds": load_s, "bootstrap_seconds": bootstrap_s, "silver_build_seconds": build_s, "silver_rows": built.rows_upserted,
                      "changes_seconds": changes_s, "stream_seconds": stream_s, "change_rows_streamed": streamed}))
        }
        "apply" => {
            let mut ctx = Context::open(workflow(&dir)?).await?;
            reset_peak();
            let t = Instant::now();
            let r = engine::apply::run(&mut ctx).await?;
            let secs = t.elapsed().as_secs_f64();
            let rows = r.rows_upserted + r.rows_deleted;
            Ok(json!({"seconds": secs, "rows_upserted": r.rows_upserted, "rows_deleted": r.rows_deleted, "action": r.action,
                      "rows_per_s": rows as f64 / secs, "peak_rss_bytes": peak_rss_bytes()}))
        }
        "reconcile" => {
            let mut ctx = Context::open(workflow(&dir)?).await?;
            reset_peak();
            let t = Instant::now();
            let r = engine::reconcile::run(&mut ctx).await?;
            let secs = t.elapsed().as_secs_f64();
            Ok(json!({"seconds": secs, "clean": r.clean, "differences": r.differences, "rows_source": r.rows_source, "rows_compared": r.rows_compared,
                      "buckets_compared": r.buckets_compared, "rows_per_s": r.rows_source as f64 / secs, "compared_rows_per_s": r.rows_compared as f64 / secs,
                      "peak_rss_bytes": peak_rss_bytes()}))
        }
        "append" => {
            // The baseline: the same change rows read from bronze and appended to a fresh Delta table.
            let ctx = Context::open(workflow(&dir)?).await?;
            reset_peak();
            let t = Instant::now();
            let schema = ctx.bronze_schema()?;
            let loc = dir.join("append_baseline").to_string_lossy().into_owned();
            let _ = std::fs::remove_dir_all(&loc);
            let mut target = delta::open_or_create(&loc, &ctx.storage, delta::TableKind::Bronze, &schema, "bench: bare append baseline").await?;
            let stream = delta::query_stream(&ctx.bronze, &format!("SELECT * FROM t WHERE {} <> 0", bronze::OPERATION)).await?;
            let mut rows = 0usize;
            let batches = futures::StreamExt::map(stream, |b| {
                b.map_err(|e| StepError::Temporary(format!("reading bronze: {e}"))).and_then(|b| delta::plain_types(&b))
            });
            let counted = futures::StreamExt::inspect(batches, |b| {
                if let Ok(b) = b {
                    rows += b.num_rows();
                }
            });
            delta::append_idempotent(&mut target, counted, schema, &Txn::new("bench#append", 0), json!({"bench": "append"})).await?;
            let secs = t.elapsed().as_secs_f64();
            Ok(json!({"seconds": secs, "rows": rows, "rows_per_s": rows as f64 / secs, "peak_rss_bytes": peak_rss_bytes()}))
        }
        other => Err(StepError::Config(format!("unknown bench phase {other}"))),
    }
}
