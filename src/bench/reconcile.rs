//! `mssql-cdc bench reconcile`: reconcile's speed and memory for an integer
//! key and a composite string key, at `--rows` and ten times as many rows,
//! with the same `reconcile.bucket_rows`.
//!
//! For each key kind and scale a child process builds a simulated table, its
//! full bootstrap and silver; then a child reconciles it clean, silver is
//! damaged behind the engine's back (one row in `--damage-every` deleted),
//! and a child reconciles it again. Each reconcile runs in a child of its own,
//! so its peak resident set (VmHWM, reset when the step starts) is its own.
//! The summary gives, per key kind, the peak RSS at 10x over 1x: reconcile's
//! memory follows `bucket_rows`, not the table, so the ratio should stay near
//! 1 (the goal: within 1.5).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{child_json, peak_rss_bytes, this_program};
use crate::delta;
use crate::engine::{self, Context};
use crate::error::{StepError, StepResult};
use crate::sim::{self, Clock, SimConfig, SimDb, TableSpec};
use crate::source::TableName;
use crate::types::{ColumnDesc, SqlType, SqlValue};
use crate::workflow::Workflow;

#[derive(Debug, Clone, clap::Args)]
pub struct ReconcileBenchArgs {
    /// Rows in the table at 1x (the memory check also runs ten times as many).
    #[arg(long, default_value_t = 200_000)]
    pub rows: u64,
    /// reconcile.bucket_rows: the most rows of a side tier 2 holds at once.
    #[arg(long, default_value_t = 50_000)]
    pub bucket_rows: u64,
    /// One silver row in this many is deleted before the second reconcile
    /// (1: every row, so differences outnumber what reconcile holds in memory).
    #[arg(long, default_value_t = 1_000)]
    pub damage_every: u64,
    /// Key kinds to measure: `int` (one bigint) and `string` (varchar, nvarchar).
    #[arg(long, value_delimiter = ',', default_value = "int,string")]
    pub keys: Vec<String>,
    /// Folder for the runs' databases and tables (a fresh temporary one when omitted).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Internal: run one phase in this process (`setup`, `clean`, `damage` or `damaged`).
    #[arg(long, hide = true)]
    pub child: Option<String>,
    /// Internal: the key kind of the child.
    #[arg(long, hide = true)]
    pub key: Option<String>,
}

pub async fn run(a: &ReconcileBenchArgs) -> StepResult<Value> {
    match a.child.as_deref() {
        Some(phase) => child(a, phase).await,
        None => parent(a).await,
    }
}

async fn parent(a: &ReconcileBenchArgs) -> StepResult<Value> {
    if a.rows == 0 || a.bucket_rows == 0 || a.damage_every == 0 {
        return Err(StepError::Config("--rows, --bucket-rows and --damage-every must be at least 1".into()));
    }
    if let Some(k) = a.keys.iter().find(|k| !["int", "string"].contains(&k.as_str())) {
        return Err(StepError::Config(format!("--keys holds '{k}': use int and/or string")));
    }
    let tmp = std::env::temp_dir().join(format!("mssql-cdc-bench-reconcile-{}", std::process::id()));
    let base = a.dir.clone().unwrap_or_else(|| tmp.clone());
    let exe = this_program()?;
    let phase = |key: &str, rows: u64, p: &str, dir: &Path| -> StepResult<Value> {
        tracing::info!(key, rows, phase = p, "bench reconcile phase starting");
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["bench", "reconcile", "--child", p, "--key", key, "--rows", &rows.to_string()])
            .args(["--bucket-rows", &a.bucket_rows.to_string(), "--damage-every", &a.damage_every.to_string()])
            .arg("--dir")
            .arg(dir);
        child_json(cmd, p)
    };
    let mut runs = Vec::new();
    let mut summary = serde_json::Map::new();
    for key in &a.keys {
        let mut peaks = Vec::new();
        for rows in [a.rows, a.rows * 10] {
            let dir = base.join(format!("{key}-{rows}"));
            let _ = std::fs::remove_dir_all(&dir);
            let setup = phase(key, rows, "setup", &dir)?;
            let clean = phase(key, rows, "clean", &dir)?;
            let damage = phase(key, rows, "damage", &dir)?;
            let damaged = phase(key, rows, "damaged", &dir)?;
            if clean["differences"].as_u64() != Some(0) {
                return Err(StepError::Internal(format!("reconcile of an untouched silver found differences: {clean}")));
            }
            let found = damaged["differences"].as_u64().unwrap_or(0);
            let deleted = damage["rows_deleted"].as_u64().unwrap_or(0);
            if found != deleted {
                return Err(StepError::Internal(format!("reconcile found {found} differences where {deleted} silver rows were deleted: {damaged}")));
            }
            let peak = clean["peak_rss_bytes"].as_u64().unwrap_or(0).max(damaged["peak_rss_bytes"].as_u64().unwrap_or(0));
            peaks.push(peak);
            let line = json!({"key": key, "rows": rows, "bucket_rows": a.bucket_rows, "setup": setup, "clean": clean, "damage": damage, "damaged": damaged});
            println!("{line}");
            runs.push(line);
            if a.dir.is_none() {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        let ratio = if peaks[0] > 0 { peaks[1] as f64 / peaks[0] as f64 } else { 0.0 };
        summary.insert(format!("{key}_peak_rss_ratio_10x"), json!(ratio));
    }
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(json!({"bench": "reconcile", "rows": a.rows, "bucket_rows": a.bucket_rows, "summary": summary, "runs": runs,
              "allocator": crate::alloc::name(), "c_arena_limit": crate::alloc::c_arena_limit()}))
}

/// The table of a key kind: `int`, one bigint key; `string`, a composite
/// key of a varchar and an nvarchar (neither an order silver can evaluate).
fn spec(key: &str) -> TableSpec {
    let name = TableName::new("dbo", "measures");
    let value_columns = [
        ColumnDesc::new("qty", SqlType::Int, true),
        ColumnDesc::new("amount", SqlType::Decimal { precision: 12, scale: 2 }, false),
        ColumnDesc::new("note", SqlType::NVarChar { len: Some(60) }, true),
    ];
    let (mut columns, primary_key): (Vec<ColumnDesc>, Vec<String>) = if key == "int" {
        (vec![ColumnDesc::new("id", SqlType::BigInt, false)], vec!["id".into()])
    } else {
        (
            vec![ColumnDesc::new("region", SqlType::VarChar { len: Some(12) }, false), ColumnDesc::new("code", SqlType::NVarChar { len: Some(24) }, false)],
            vec!["region".into(), "code".into()],
        )
    };
    columns.extend(value_columns);
    TableSpec { collations: Default::default(), name, columns, primary_key, unique_index: vec![] }
}

/// Row `i` of a key kind's table (deterministic).
fn row(key: &str, i: u64) -> Vec<SqlValue> {
    let mut out = if key == "int" {
        vec![SqlValue::Int(i as i64)]
    } else {
        vec![SqlValue::Str(format!("r{:02}", i % 37)), SqlValue::Str(format!("code-{:010}", i.wrapping_mul(2_654_435_761) % 10_000_000_000))]
    };
    out.push(if i % 11 == 0 { SqlValue::Null } else { SqlValue::Int((i % 1000) as i64) });
    out.push(SqlValue::Decimal { value: (i as i128 * 37) % 10_000_000, scale: 2 });
    out.push(if i % 3 == 0 { SqlValue::Null } else { SqlValue::Str(format!("note {i}")) });
    out
}

fn workflow(dir: &Path, bucket_rows: u64) -> StepResult<Workflow> {
    let path = dir.join("measures.toml");
    let text = format!(
        "app_id = \"bench-reconcile\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"measures\"\n\
         [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n[stream]\nmax_batch_rows = 200000\n\
         [snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n\
         [reconcile]\nbucket_rows = {bucket_rows}\nsample_fraction = 0.1\ncapture_wait_seconds = 5\n"
    );
    std::fs::write(&path, text).map_err(|e| StepError::Config(format!("cannot write {}: {e}", path.display())))?;
    Workflow::load(&path)
}

async fn child(a: &ReconcileBenchArgs, phase: &str) -> StepResult<Value> {
    let dir = a.dir.clone().ok_or_else(|| StepError::Config("--child needs --dir".into()))?;
    let key = a.key.clone().ok_or_else(|| StepError::Config("--child needs --key".into()))?;
    std::fs::create_dir_all(&dir).map_err(|e| StepError::Config(format!("cannot create {}: {e}", dir.display())))?;
    let sim_err = |e: sim::SimError| StepError::Internal(format!("simulator: {e}"));
    match phase {
        "setup" => {
            let t0 = Instant::now();
            let cfg = SimConfig { clock: Clock::Wall, time_zone: "UTC".into(), idle_interval_seconds: 1, capture_lag_ms: 0, ..SimConfig::default() };
            let db = SimDb::create(&dir.join("source.sqlite"), cfg).map_err(sim_err)?;
            let spec = spec(&key);
            db.create_table(&spec).map_err(sim_err)?;
            db.load_rows(&spec.name, (0..a.rows).map(|i| row(&key, i))).map_err(sim_err)?;
            db.enable_cdc(&spec.name, None, None).map_err(sim_err)?;
            while db.max_lsn().map_err(sim_err)?.is_none() {
                db.capture().map_err(sim_err)?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let mut ctx = Context::open(workflow(&dir, a.bucket_rows)?).await?;
            engine::snapshot::ensure_bootstrap(&mut ctx).await?;
            let built = engine::apply::run(&mut ctx).await?;
            Ok(json!({"seconds": t0.elapsed().as_secs_f64(), "silver_rows": built.rows_upserted}))
        }
        "damage" => {
            let ctx = Context::open(workflow(&dir, a.bucket_rows)?).await?;
            let loc = ctx.workflow.silver_location("bench")?;
            let t = delta::open_existing(&loc, &ctx.storage).await?.ok_or_else(|| StepError::Internal("no silver".into()))?;
            // Every damage_every-th row by its amount (deterministic, spread
            // over every key); at 1, every row: a silver that lost all, whose
            // differences outnumber what reconcile holds in memory.
            let predicate = if a.damage_every == 1 { "TRUE".to_string() } else { format!("CAST(amount * 100 AS BIGINT) % {} = 0", a.damage_every * 37) };
            let (_, m) = t.delete().with_predicate(predicate.as_str()).await.map_err(StepError::delta(&loc))?;
            Ok(json!({"rows_deleted": m.num_deleted_rows.unwrap_or(0), "predicate": predicate}))
        }
        "clean" | "damaged" => {
            // The capture job, as a server runs it: reconcile waits for it to
            // pass the end of its reads before it counts a difference.
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let capture = {
                let (stop, path) = (stop.clone(), dir.join("source.sqlite"));
                std::thread::spawn(move || -> Result<(), sim::SimError> {
                    let db = SimDb::open(&path)?;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        db.capture()?;
                        std::thread::sleep(Duration::from_millis(250));
                    }
                    Ok(())
                })
            };
            let mut ctx = Context::open(workflow(&dir, a.bucket_rows)?).await?;
            super::reset_peak_rss();
            let t = Instant::now();
            let r = engine::reconcile::run(&mut ctx).await;
            let secs = t.elapsed().as_secs_f64();
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            capture.join().map_err(|_| StepError::Internal("the capture thread panicked".into()))?.map_err(sim_err)?;
            let r = r?;
            Ok(json!({"seconds": secs, "clean": r.clean, "differences": r.differences, "tier1": r.tier1, "buckets": r.buckets,
                      "buckets_compared": r.buckets_compared, "rows_source": r.rows_source, "rows_compared": r.rows_compared,
                      "passes": r.passes, "rows_held_max": r.rows_held_max, "differences_spilled": r.differences_spilled, "partitions": r.partitions, "partitions_mismatched": r.partitions_mismatched,
                      "rows_per_s": r.rows_source as f64 / secs, "peak_rss_bytes": peak_rss_bytes()}))
        }
        other => Err(StepError::Config(format!("unknown bench phase {other}"))),
    }
}
