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
    #[arg(long, global = true, value_name = "FILE")]
    pub workflow: Option<PathBuf>,
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
    },
    /// Take the bootstrap snapshot now (the stream step also does it when needed).
    Snapshot,
    /// Print the stream's state: generation, position, lag, open snapshot, last batch, headroom.
    Status,
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
    /// Drive the embedded SQL Server CDC simulator.
    #[command(subcommand)]
    Sim(crate::sim::cli::SimCommand),
    /// Run a demo scenario end to end on the simulator and check the result.
    Demo(crate::demo::DemoArgs),
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
    init_logging();
    let _failpoints = fail::FailScenario::setup();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return EXIT_BUG;
        }
    };
    let outcome = runtime.block_on(run(cli));
    match outcome {
        Ok((value, code)) => {
            println!("{value}");
            code
        }
        Err(e) => {
            tracing::error!("{}", error_chain(&e));
            println!("{}", json!({"ok": false, "kind": e.kind(), "exit_code": e.exit_code(), "error": error_chain(&e)}));
            e.exit_code()
        }
    }
}

/// An error with its causes, outermost first.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("MSSQL_CDC_LOG").unwrap_or_else(|_| EnvFilter::new("mssql_cdc=info,warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).try_init();
}

fn workflow_path(cli_path: &Option<PathBuf>) -> Result<PathBuf, StepError> {
    cli_path.clone().ok_or_else(|| StepError::Config("this step needs --workflow FILE (the stream's TOML workflow file)".into()))
}

/// Runs one command; returns its JSON result and exit code.
pub async fn run(cli: Cli) -> Result<(Value, i32), StepError> {
    match cli.command {
        Command::Stream { max_batches } => {
            let mut wf = crate::workflow::Workflow::load(&workflow_path(&cli.workflow)?)?;
            if let Some(n) = max_batches {
                wf.stream.max_batches = n.max(1);
            }
            let mut ctx = crate::engine::Context::open(wf).await?;
            let r = crate::engine::stream::run(&mut ctx).await?;
            Ok((serde_json::to_value(&r).unwrap_or(Value::Null), EXIT_OK))
        }
        Command::Snapshot => {
            let mut ctx = crate::engine::open_workflow(&workflow_path(&cli.workflow)?).await?;
            let r = crate::engine::snapshot::ensure_bootstrap(&mut ctx).await?;
            Ok((serde_json::to_value(&r).unwrap_or(Value::Null), EXIT_OK))
        }
        Command::Status => {
            let mut ctx = crate::engine::open_workflow(&workflow_path(&cli.workflow)?).await?;
            Ok((crate::engine::status::run(&mut ctx).await?, EXIT_OK))
        }
        Command::Seed { copy, as_of, reseed, allow_missing_columns } => {
            // The arguments are checked before the workflow's targets are opened.
            let as_of = crate::engine::seed::AsOf::parse(&as_of)?;
            let args = crate::engine::seed::SeedArgs { copy, as_of, reseed, allow_missing_columns };
            let mut ctx = crate::engine::open_workflow(&workflow_path(&cli.workflow)?).await?;
            let r = crate::engine::seed::run(&mut ctx, &args).await?;
            Ok((serde_json::to_value(&r).unwrap_or(Value::Null), EXIT_OK))
        }
        Command::Sim(cmd) => {
            let v = tokio::task::spawn_blocking(move || crate::sim::cli::run(cmd))
                .await
                .map_err(|e| StepError::Internal(format!("sim command panicked: {e}")))?
                .map_err(|e| StepError::Config(e.to_string()))?;
            Ok((v, EXIT_OK))
        }
        Command::Demo(args) => {
            let (v, ok) = crate::demo::run(args).await?;
            Ok((v, if ok { EXIT_OK } else { crate::error::EXIT_NEEDS_PERSON }))
        }
    }
}
