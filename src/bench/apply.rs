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

use super::{child_json, peak_rss_bytes, this_program};
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
    /// Changes applied (80% updates, 10% deletes, 10% inserts).
    #[arg(long, default_value_t = 1_000_000)]
    pub changes: u64,
    /// Where the changes fall, a comma list run one after the other:
    /// `spread`, each of `--changes` keys changed once, anywhere in the key
    /// range; `hot`, every change on the newest 1 % of keys (the recent
    /// orders a real orders table keeps changing), so each hot key changes
    /// many times and the changed keys sit together.
    #[arg(long, value_delimiter = ',', default_value = "spread,hot")]
    pub shapes: Vec<String>,
    /// Multiples of `--rows` to run each shape at, with the same `--changes`
    /// (`1,10` measures peak memory at ten times the table against once).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub scales: Vec<u64>,
    /// Internal: the shape of one child's changes.
    #[arg(long, hide = true, default_value = "spread")]
    pub shape: String,
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
    if let Some(s) = a.shapes.iter().find(|s| !["spread", "hot"].contains(&s.as_str())) {
        return Err(StepError::Config(format!("--shapes holds '{s}': use spread and/or hot")));
    }
    if a.shapes.is_empty() || a.scales.is_empty() || a.scales.contains(&0) {
        return Err(StepError::Config("--shapes and --scales need at least one entry each, and a scale is at least 1".into()));
    }
    let tmp = std::env::temp_dir().join(format!("mssql-cdc-bench-apply-{}", std::process::id()));
    let base = a.dir.clone().unwrap_or_else(|| tmp.clone());
    let exe = this_program()?;
    let phase = |shape: &str, rows: u64, p: &str, dir: &Path| -> StepResult<Value> {
        tracing::info!(shape, rows, phase = p, "bench apply phase starting");
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["bench", "apply", "--child", p, "--shape", shape, "--rows", &rows.to_string(), "--changes", &a.changes.to_string()])
            .arg("--dir")
            .arg(dir);
        child_json(cmd, p)
    };
    let mut runs = Vec::new();
    let mut summary = serde_json::Map::new();
    for shape in &a.shapes {
        let mut apply_peaks = Vec::new();
        for &scale in &a.scales {
            let rows = a.rows * scale;
            let dir = base.join(format!("{shape}-{rows}"));
            let _ = std::fs::remove_dir_all(&dir);
            let setup = phase(shape, rows, "setup", &dir)?;
            let apply = phase(shape, rows, "apply", &dir)?;
            let reconcile = phase(shape, rows, "reconcile", &dir)?;
            // A figure counts only from an apply that left silver equal to
            // the source, every row and column (reconcile's verdict).
            if reconcile["clean"] != json!(true) || reconcile["differences"].as_u64() != Some(0) {
                return Err(StepError::Internal(format!("reconcile after the {shape} apply found silver unlike the source: {reconcile}")));
            }
            let append = phase(shape, rows, "append", &dir)?;
            // Against the append of the same rows: the change rows apply took
            // from bronze per second (its own `rows_per_s` counts the net rows
            // per key it wrote, far fewer than the changes when keys are hot).
            let change_rows_per_s = match (setup["change_rows_streamed"].as_f64(), apply["seconds"].as_f64()) {
                (Some(n), Some(secs)) if secs > 0.0 => n / secs,
                _ => 0.0,
            };
            let ratio = match append["rows_per_s"].as_f64() {
                Some(y) if y > 0.0 => json!(change_rows_per_s / y),
                _ => Value::Null,
            };
            apply_peaks.push((scale, apply["peak_rss_bytes"].as_f64().unwrap_or(0.0)));
            let line = json!({"shape": shape, "rows": rows, "changes": a.changes, "setup": setup, "apply": apply, "reconcile": reconcile,
                              "append_baseline": append,
                              "apply_change_rows_per_s": change_rows_per_s, "apply_over_append_rows_per_s": ratio});
            println!("{line}");
            runs.push(line);
            if a.dir.is_none() {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        let at = |scale: u64| apply_peaks.iter().find(|(s, _)| *s == scale).map(|(_, p)| *p);
        if let (Some(one), Some(ten)) = (at(1), at(10)) {
            if one > 0.0 {
                summary.insert(format!("{shape}_apply_peak_rss_ratio_10x"), json!(ten / one));
            }
        }
    }
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(json!({"bench": "apply", "rows": a.rows, "changes": a.changes, "summary": summary, "runs": runs,
              "allocator": crate::alloc::name(), "c_arena_limit": crate::alloc::c_arena_limit()}))
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
            // The changes, in transactions of 1,000. `spread`: each key
            // touched once. `hot`: keys drawn again and again from the newest
            // 1 %; a change to a key deleted earlier puts it back.
            let t = Instant::now();
            let mut rng = SmallRng::seed_from_u64(11);
            let ids: Vec<i64> = match a.shape.as_str() {
                "spread" => {
                    let mut ids: Vec<i64> = (1..=a.rows as i64).collect();
                    for i in 0..a.changes as usize {
                        let j = rng.random_range(i..ids.len());
                        ids.swap(i, j);
                    }
                    ids.truncate(a.changes as usize);
                    ids
                }
                "hot" => {
                    let hot_lo = a.rows as i64 - (a.rows as i64 / 100).max(1) + 1;
                    (0..a.changes).map(|_| rng.random_range(hot_lo..=a.rows as i64)).collect()
                }
                other => return Err(StepError::Config(format!("--shape {other}: use spread or hot"))),
            };
            let template: Vec<Vec<SqlValue>> = sim::orders_rows(1, 99).collect();
            let mut next_id = a.rows as i64 + 1;
            let mut deleted = std::collections::HashSet::new();
            for (c, chunk) in ids.chunks(1000).enumerate() {
                db.transaction(|tx| {
                    for (n, id) in chunk.iter().enumerate() {
                        let key = vec![SqlValue::Int(*id)];
                        let mut row = template[0].clone();
                        row[0] = SqlValue::Int(*id);
                        // Differs from the row's last value, so every update changes it.
                        row[2] = SqlValue::Decimal { value: (*id as i128 % 100_000) * 7 + (c * 1000 + n) as i128 % 997 + 1, scale: 2 };
                        match n % 10 {
                            1 => {
                                let mut row = row;
                                row[0] = SqlValue::Int(next_id);
                                next_id += 1;
                                tx.insert(&table, row)?;
                            }
                            _ if deleted.remove(id) => tx.insert(&table, row)?,
                            0 => {
                                tx.delete(&table, &key)?;
                                deleted.insert(*id);
                            }
                            _ => tx.update(&table, &key, row)?,
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
            super::reset_peak_rss();
            let t = Instant::now();
            let r = engine::apply::run(&mut ctx).await?;
            let secs = t.elapsed().as_secs_f64();
            let rows = r.rows_upserted + r.rows_deleted;
            Ok(json!({"seconds": secs, "rows_upserted": r.rows_upserted, "rows_deleted": r.rows_deleted, "action": r.action,
                      "rows_per_s": rows as f64 / secs, "peak_rss_bytes": peak_rss_bytes()}))
        }
        "reconcile" => {
            let mut ctx = Context::open(workflow(&dir)?).await?;
            super::reset_peak_rss();
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
            super::reset_peak_rss();
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
