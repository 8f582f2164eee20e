//! `mssql-cdc bench snapshot`: full versus chunked snapshot throughput of the
//! same table over rate-limited connections, the per-wave fixed cost, and
//! peak memory as the table grows tenfold.
//!
//! Each measurement runs in a child process of its own (the same binary,
//! `bench snapshot --child`), so its peak resident set (VmHWM) is its own:
//! one run with both modes for the throughput figures, then the chunked
//! mode alone on the table and on a table ten times larger for memory, and
//! those two memory runs again on glibc's malloc as shipped
//! (`MSSQL_CDC_ALLOCATOR=system`, glibc's own arena limit), so the default
//! allocator's gain is a ratio measured in the same run, not a claim.
//! The simulator's connections are rate-limited per connection and each
//! query pays a fixed latency, like a production link; the figures are
//! therefore about the engine's overheads (chunking, planning, waves,
//! commits), not about SQLite's speed.

pub mod apply;
pub mod history;
pub mod reconcile;
pub mod stream;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::engine::{self, chunked, Context};
use crate::error::{StepError, StepResult};
use crate::sim::{self, Clock, SimConfig, SimDb};
use crate::source::TableName;
use crate::workflow::Workflow;

/// What `bench` measures.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchCommand {
    /// Full vs chunked snapshot of one table over rate-limited connections.
    Snapshot(SnapshotBenchArgs),
    /// `apply` of a batch of changes into a large silver, `reconcile` of it, and a bare append of the same rows.
    Apply(apply::ApplyBenchArgs),
    /// `stream` calls over a backlog: milliseconds per batch as the history grows, and the facts read cached against a SQL scan.
    Stream(stream::StreamBenchArgs),
    /// `stream` calls with nothing new as a shared facts table's history grows, before and after `maintain`.
    History(history::HistoryBenchArgs),
    /// `reconcile` of an integer and a composite string key, clean and damaged, at N and 10 N rows: rows/s and peak memory.
    Reconcile(reconcile::ReconcileBenchArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct SnapshotBenchArgs {
    /// Rows in the table (the memory check also runs ten times as many).
    #[arg(long, default_value_t = 200_000)]
    pub rows: u64,
    /// Source connections (snapshot.parallelism).
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Rows per second one connection delivers.
    #[arg(long, default_value_t = 25_000)]
    pub rows_per_s: u64,
    /// Fixed latency of every query, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub latency_ms: u64,
    /// Rows per chunk (default: rows / 16, so each connection reads four chunks).
    #[arg(long)]
    pub chunk_rows: Option<u64>,
    /// Seconds a wave is sized toward.
    #[arg(long, default_value_t = 2.0)]
    pub target_wave_seconds: f64,
    /// Folder for the runs' databases and tables (a fresh temporary one when omitted).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Internal: run one measurement in this process (`full`, `chunked` or `both`).
    #[arg(long, hide = true)]
    pub child: Option<String>,
}

/// Runs a bench command; returns its JSON.
pub async fn run(cmd: BenchCommand) -> StepResult<Value> {
    match cmd {
        BenchCommand::Snapshot(a) => match a.child.clone() {
            Some(mode) => child(&a, &mode).await,
            None => parent(&a).await,
        },
        BenchCommand::Apply(a) => apply::run(&a).await,
        BenchCommand::Stream(a) => stream::run(&a).await,
        BenchCommand::History(a) => history::run(&a).await,
        BenchCommand::Reconcile(a) => reconcile::run(&a).await,
    }
}

async fn parent(a: &SnapshotBenchArgs) -> StepResult<Value> {
    if a.rows == 0 || a.connections == 0 || a.rows_per_s == 0 {
        return Err(StepError::Config("--rows, --connections and --rows-per-s must be at least 1".into()));
    }
    let tmp = std::env::temp_dir().join(format!("mssql-cdc-bench-{}", std::process::id()));
    let base = a.dir.clone().unwrap_or_else(|| tmp.clone());
    let exe = this_program()?;
    // `glibc_as_shipped`: the child runs on the C library's malloc with its
    // own default arena limit (eight per core on 64-bit), the comparison the
    // default allocator is chosen by (`crate::alloc`). Otherwise both
    // variables are removed, so one a user exported does not skew the default's.
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let run_child = |rows: u64, mode: &str, glibc_as_shipped: bool, dir: PathBuf| -> StepResult<Value> {
        let chunk_rows = a.chunk_rows.unwrap_or((a.rows / 16).max(1));
        tracing::info!(rows, mode, glibc_as_shipped, "bench run starting");
        let mut cmd = std::process::Command::new(&exe);
        if glibc_as_shipped {
            cmd.env(crate::alloc::ALLOCATOR_VAR, "system").env(crate::alloc::ARENA_VAR, (8 * cores).to_string());
        } else {
            cmd.env_remove(crate::alloc::ALLOCATOR_VAR).env_remove(crate::alloc::ARENA_VAR);
        }
        cmd.args(["bench", "snapshot", "--child", mode])
            .args(["--rows", &rows.to_string(), "--connections", &a.connections.to_string()])
            .args(["--rows-per-s", &a.rows_per_s.to_string(), "--latency-ms", &a.latency_ms.to_string()])
            .args(["--chunk-rows", &chunk_rows.to_string(), "--target-wave-seconds", &a.target_wave_seconds.to_string()])
            .arg("--dir")
            .arg(&dir);
        child_json(cmd, mode)
    };
    let both = run_child(a.rows, "both", false, base.join("both"))?;
    let mem = run_child(a.rows, "chunked", false, base.join("mem1"))?;
    let mem10 = run_child(a.rows * 10, "chunked", false, base.join("mem10"))?;
    // The full snapshot of the 10x table, so the chunked one's throughput
    // there has its full counterpart: at 1x the chunks are few, and a round
    // in which some connections have no chunk left (17 chunks on 4
    // connections take 5 rounds where a full read's 4 even ranges take the
    // time of 4) weighs on the ratio as it does not once there are many.
    let full10 = run_child(a.rows * 10, "full", false, base.join("full10"))?;
    // The same two memory runs on glibc as shipped, side by side.
    let sys = run_child(a.rows, "chunked", true, base.join("sys1"))?;
    let sys10 = run_child(a.rows * 10, "chunked", true, base.join("sys10"))?;
    for (run, want) in [(&both, "jemalloc"), (&mem, "jemalloc"), (&mem10, "jemalloc"), (&full10, "jemalloc"), (&sys, "system"), (&sys10, "system")] {
        if run["allocator"] != want {
            return Err(StepError::Internal(format!("a bench child meant for {want} ran on {}", run["allocator"])));
        }
    }
    let ratio = |big: &Value, small: &Value| match (big["peak_rss_bytes"].as_f64(), small["peak_rss_bytes"].as_f64()) {
        (Some(b), Some(s)) if s > 0.0 => json!(b / s),
        _ => Value::Null,
    };
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let full = both["full_rows_per_s"].as_f64().unwrap_or(0.0);
    let chunked = both["chunked_rows_per_s"].as_f64().unwrap_or(0.0);
    let full_10x = full10["full_rows_per_s"].as_f64().unwrap_or(0.0);
    let chunked_10x = mem10["chunked_rows_per_s"].as_f64().unwrap_or(0.0);
    Ok(json!({
        "bench": "snapshot",
        "rows": a.rows,
        "connections": a.connections,
        "rows_per_s_per_connection": a.rows_per_s,
        "latency_ms": a.latency_ms,
        "chunk_rows": both["chunk_rows"],
        "chunks": both["chunks"],
        "waves": both["waves"],
        "full_seconds": both["full_seconds"],
        "full_rows_read": both["full_rows"],
        "chunked_rows_read": both["chunked_rows"],
        "full_rows_read_10x": full10["full_rows"],
        "chunked_rows_read_10x": mem10["chunked_rows"],
        "chunked_seconds": both["chunked_seconds"],
        "full_rows_per_s": full,
        "chunked_rows_per_s": chunked,
        "chunked_over_full": if full > 0.0 { chunked / full } else { 0.0 },
        "wave_fixed_seconds_median": both["wave_fixed_seconds_median"],
        "wave_fixed_seconds_max": both["wave_fixed_seconds_max"],
        "peak_rss_bytes": mem["peak_rss_bytes"],
        "peak_rss_bytes_10x": mem10["peak_rss_bytes"],
        "peak_rss_10x_over_1x": ratio(&mem10, &mem),
        "chunks_10x": mem10["chunks"],
        "chunked_rows_per_s_10x": mem10["chunked_rows_per_s"],
        "full_rows_per_s_10x": full10["full_rows_per_s"],
        "chunked_over_full_10x": if full_10x > 0.0 { chunked_10x / full_10x } else { 0.0 },
        "waves_10x": mem10["waves"],
        "allocator": mem["allocator"],
        "c_arena_limit": mem["c_arena_limit"],
        "glibc_as_shipped": {
            "c_arena_limit": sys["c_arena_limit"],
            "peak_rss_bytes": sys["peak_rss_bytes"],
            "peak_rss_bytes_10x": sys10["peak_rss_bytes"],
            "peak_rss_10x_over_1x": ratio(&sys10, &sys),
            "chunked_rows_per_s": sys["chunked_rows_per_s"],
            "chunked_rows_per_s_10x": sys10["chunked_rows_per_s"],
        },
        "default_over_glibc_as_shipped_peak_rss_10x": ratio(&mem10, &sys10),
    }))
}

/// This program's path, to run its bench children.
fn this_program() -> StepResult<PathBuf> {
    std::env::current_exe().map_err(|e| StepError::Internal(format!("cannot find this program: {e}")))
}

/// Runs `cmd` (this program with a bench's `--child` arguments) with its
/// stderr passed through, and returns the JSON object it printed last. A
/// child that exits non-zero fails the bench with what it printed, so no
/// figure comes from a run that failed; `what` names the child in errors.
fn child_json(mut cmd: std::process::Command, what: &str) -> StepResult<Value> {
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| StepError::Internal(format!("cannot run the bench child {what}: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.lines().last().unwrap_or(""))
        .map_err(|e| StepError::Internal(format!("bench child {what} printed no JSON ({e}): {text}")))?;
    if !out.status.success() {
        return Err(StepError::Internal(format!("bench child {what} failed: {v}")));
    }
    Ok(v)
}

/// Starts the peak resident set over, so the next [`peak_rss_bytes`] is
/// the peak of what runs from here on, not of the set-up before it (Linux:
/// writing 5 to clear_refs resets VmHWM; elsewhere this does nothing).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's peak resident set (Linux VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn write_workflow(path: &Path, name: &str, snapshot: &str) -> StepResult<Workflow> {
    let text = format!(
        "app_id = \"bench-{name}\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"orders\"\n\
         [target]\nbronze = \"{name}/bronze\"\nfacts = \"{name}/facts\"\n[snapshot]\n{snapshot}\n"
    );
    std::fs::write(path, text).map_err(|e| StepError::Config(format!("cannot write {}: {e}", path.display())))?;
    Workflow::load(path)
}

async fn child(a: &SnapshotBenchArgs, mode: &str) -> StepResult<Value> {
    let dir = a.dir.clone().ok_or_else(|| StepError::Config("--child needs --dir".into()))?;
    std::fs::create_dir_all(&dir).map_err(|e| StepError::Config(format!("cannot create {}: {e}", dir.display())))?;
    let sim_err = |e: sim::SimError| StepError::Internal(format!("simulator: {e}"));
    let cfg = SimConfig { clock: Clock::Wall, time_zone: "UTC".into(), idle_interval_seconds: 1, ..SimConfig::default() };
    let db = SimDb::create(&dir.join("source.sqlite"), cfg.clone()).map_err(sim_err)?;
    let table = TableName::new("dbo", "orders");
    db.create_table(&sim::orders_table_spec(table.clone())).map_err(sim_err)?;
    db.load_rows(&table, sim::orders_rows(a.rows, 7)).map_err(sim_err)?;
    db.enable_cdc(&table, None, None).map_err(sim_err)?;
    let started = Instant::now();
    while db.max_lsn().map_err(sim_err)?.is_none() {
        if started.elapsed() > Duration::from_secs(30) {
            return Err(StepError::Internal("the simulated capture job recorded no LSN".into()));
        }
        db.capture().map_err(sim_err)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Rate limits on only now: loading and capture are set-up, not measured.
    db.set_config(SimConfig { conn_rows_per_s: Some(a.rows_per_s), query_latency_ms: a.latency_ms, ..cfg }).map_err(sim_err)?;
    // Fold the load's write-ahead log into the database file, as a server's
    // table would be at rest, so reads do not pay for a log of the whole load.
    rusqlite::Connection::open(dir.join("source.sqlite"))
        .and_then(|c| c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())))
        .map_err(|e| StepError::Internal(format!("checkpointing the simulator's log: {e}")))?;
    // The peak resident set from here on is the snapshot's, not the table load's.
    reset_peak_rss();
    let chunk_rows = a.chunk_rows.unwrap_or((a.rows / 16).max(1));
    let mut out = json!({"rows": a.rows, "chunk_rows": chunk_rows});
    if mode == "both" || mode == "full" {
        let wf = write_workflow(&dir.join("full.toml"), "full", &format!("bootstrap = true\nmode = \"full\"\nparallelism = {}", a.connections))?;
        let t = Instant::now();
        let mut ctx = Context::open(wf).await?;
        let r = engine::snapshot::ensure_bootstrap(&mut ctx).await?;
        let secs = t.elapsed().as_secs_f64();
        out["full_seconds"] = json!(secs);
        out["full_rows"] = json!(r.rows);
        out["full_rows_per_s"] = json!(r.rows as f64 / secs);
    }
    if mode == "both" || mode == "chunked" {
        let wf = write_workflow(
            &dir.join("chunked.toml"),
            "chunked",
            &format!(
                "bootstrap = true\nmode = \"chunked\"\nparallelism = {}\nchunk_rows = {chunk_rows}\ntarget_wave_seconds = {}",
                a.connections, a.target_wave_seconds
            ),
        )?;
        let t = Instant::now();
        let mut ctx = Context::open(wf.clone()).await?;
        chunked::ensure_bootstrap_open(&mut ctx).await?;
        let (mut rows, mut waves, mut fixed) = (0i64, 0u32, Vec::new());
        let mut chunks;
        loop {
            let mut ctx = Context::open(wf.clone()).await?;
            let r = chunked::backfill(&mut ctx, &chunked::BackfillArgs::default()).await?;
            rows += r.rows;
            waves += r.waves;
            chunks = r.chunks_total;
            fixed.extend(r.wave_fixed_seconds);
            if r.done {
                break;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        fixed.sort_by(|a, b| a.total_cmp(b));
        out["chunked_seconds"] = json!(secs);
        out["chunked_rows"] = json!(rows);
        out["chunked_rows_per_s"] = json!(rows as f64 / secs);
        out["chunks"] = json!(chunks);
        out["waves"] = json!(waves);
        out["wave_fixed_seconds_median"] = json!(fixed.get(fixed.len() / 2));
        out["wave_fixed_seconds_max"] = json!(fixed.last());
    }
    out["peak_rss_bytes"] = json!(peak_rss_bytes());
    out["allocator"] = json!(crate::alloc::name());
    out["c_arena_limit"] = json!(crate::alloc::c_arena_limit());
    Ok(out)
}
