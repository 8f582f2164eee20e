//! The `maintain` step: upkeep of a workflow's Delta tables, so what a step
//! reads to load its state does not grow with the stream's history. It
//! reads no source and changes no row.
//!
//! Every batch, wave, apply and reconcile appends a small file to the
//! facts, plans, control or reconcile table, and a step called in a fresh
//! process reads every file of the facts table to derive its state (the
//! per-file cache of `delta::facts_read` lives as long as the process). So
//! a stream called every minute reads ten thousand files within a week.
//! `maintain` compacts those four append-only tables' small files into one
//! (`delta::maintain::compact_small_files`, a commit that carries its own
//! txn so two compactions never both land), deletes the files of removes
//! older than the retention with VACUUM's lite mode, and writes a
//! checkpoint of every table.
//!
//! What it leaves alone, and why:
//! - bronze and silver are not compacted. delta-rs 1.1's conflict checker
//!   does not refuse a MERGE (silver) or a seed's file undo (bronze) whose
//!   files a compaction removed first, so a compaction beside either would
//!   keep the rows they change in the compacted file; a rewrite marked as a
//!   data change would be refused but would break Delta streaming readers
//!   of silver. Both tables are still vacuumed and checkpointed.
//! - VACUUM's full mode (which deletes any file the log does not name) is
//!   never run: a seed, a wave's readers and a MERGE write their files
//!   before their commit names them.
//! - The Delta log's JSON commits are left to delta-rs's own cleanup after a
//!   checkpoint (`delta.logRetentionDuration`, 30 days): the repairs read
//!   the newest commits of bronze and silver by their txn, which a stream
//!   or an apply called at least once a month keeps well inside it.
//! - Transaction ids never expire: no table sets
//!   `delta.setTransactionRetentionDuration`, and no commit of this program
//!   writes a txn with `lastUpdated`, so the checkpoints keep every txn.
//!
//! Each table's work is idempotent by content (a compaction's rerun finds
//! no small files left; VACUUM and the checkpoint do what the log says), so
//! a crash anywhere is repaired by calling `maintain` again, and it may run
//! beside any other step: appends are never refused for a compaction.

use serde_json::{json, Value};

use crate::delta::{self, maintain as upkeep, TableKind};
use crate::error::{StepError, StepResult};
use crate::workflow::Workflow;

/// The shortest VACUUM retention this step accepts. A step that loaded an
/// older version of a table reads the files of that version for as long as
/// its call lasts (a long seed or backfill call); a day is far beyond any
/// call's life, and the default leaves readers of silver five days of
/// time travel.
pub const MIN_VACUUM_RETENTION_HOURS: f64 = 24.0;

/// The default VACUUM retention: five days, two under the week of
/// `delta.deletedFileRetentionDuration` every table has unless an operator
/// set it. The gap is the window VACUUM's lite mode has to see a removed
/// file: a checkpoint drops a remove from the log once it is older than
/// that property, after which no lite VACUUM can find the file (it stays
/// on storage, unreferenced, for good). A busy table is checkpointed every
/// hundred commits, so with a retention equal to the property nearly every
/// removed file would be forgotten before it is old enough; with a
/// two-day window a daily `maintain` deletes each one.
pub const DEFAULT_VACUUM_RETENTION_HOURS: f64 = 120.0;

/// The arguments of `maintain`.
#[derive(Debug, Clone)]
pub struct MaintainArgs {
    /// VACUUM deletes the files of removes at least this old; `None`: no VACUUM.
    pub vacuum_retention_hours: Option<f64>,
    /// Replaces the clock VACUUM judges ages by (tests: days passing).
    pub now_ms: Option<i64>,
}

impl MaintainArgs {
    /// Checks the arguments before anything is read or written.
    pub fn new(vacuum_retention_hours: f64, no_vacuum: bool) -> StepResult<MaintainArgs> {
        if !no_vacuum && !(vacuum_retention_hours >= MIN_VACUUM_RETENTION_HOURS && vacuum_retention_hours.is_finite()) {
            return Err(StepError::Config(format!(
                "--vacuum-retention-hours is {vacuum_retention_hours}: use {MIN_VACUUM_RETENTION_HOURS} or more (a call that loaded an \
                 older version of a table may still read its removed files), or pass --no-vacuum"
            )));
        }
        Ok(MaintainArgs { vacuum_retention_hours: (!no_vacuum).then_some(vacuum_retention_hours), now_ms: None })
    }
}

/// The tables of the workflow with their kinds, bronze first.
pub fn tables_of(wf: &Workflow) -> Vec<(&'static str, String, TableKind)> {
    let mut out = vec![
        ("bronze", wf.target.bronze.clone(), TableKind::Bronze),
        ("facts", wf.target.facts.clone(), TableKind::Facts),
        ("plans", delta::plans::location_for(&wf.target.bronze), TableKind::Plans),
    ];
    if let Some(silver) = &wf.target.silver {
        out.push(("silver", silver.clone(), TableKind::Silver));
        out.push(("control", delta::silver::control_location_for(silver), TableKind::Control));
    }
    if let Ok(report) = wf.reconcile_location() {
        out.push(("reconcile", report, TableKind::Reconcile));
    }
    out
}

/// Whether a kind of table is only ever appended to, so a compaction never
/// meets a commit that removes its files (see the module docs).
pub fn compactable(kind: TableKind) -> bool {
    matches!(kind, TableKind::Facts | TableKind::Plans | TableKind::Control | TableKind::Reconcile)
}

/// Refuses a VACUUM retention at or above the table's
/// `delta.deletedFileRetentionDuration`: the checkpoints would forget the
/// removed files before VACUUM may delete them (see
/// [`DEFAULT_VACUUM_RETENTION_HOURS`]), so the call would delete little or
/// nothing and say it had done its work.
fn check_vacuum_window(table: &deltalake::DeltaTable, name: &str, location: &str, hours: f64) -> StepResult<()> {
    let kept_hours = delta::maintain::deleted_file_retention_hours(table)?;
    if hours >= kept_hours {
        return Err(StepError::Config(format!(
            "--vacuum-retention-hours is {hours}, but the {name} table ({location}) keeps removed files in its checkpoints for only \
             {kept_hours} hours (delta.deletedFileRetentionDuration), so VACUUM would never see most of them: use a retention under \
             {kept_hours} (the default is {DEFAULT_VACUUM_RETENTION_HOURS}), or raise the table's property"
        )));
    }
    Ok(())
}

/// Runs the upkeep of every table of the workflow that exists. Every table
/// is opened and its kind and VACUUM window checked first, so a foreign
/// table or a retention that cannot work is refused before any is touched.
pub async fn run(wf: &Workflow, args: &MaintainArgs) -> StepResult<Value> {
    let storage = wf.storage_options()?;
    let mut opened = Vec::new();
    let mut missing = Vec::new();
    for (name, location, kind) in tables_of(wf) {
        match delta::open_existing(&location, &storage).await? {
            Some(table) => {
                delta::check_kind(&table, &location, kind)?;
                if let Some(hours) = args.vacuum_retention_hours {
                    check_vacuum_window(&table, name, &location, hours)?;
                }
                opened.push((name, location, kind, table));
            }
            None => missing.push(name),
        }
    }
    let mut out = Vec::new();
    let (mut before, mut after) = (0usize, 0usize);
    for (name, location, kind, mut table) in opened {
        let files_before = upkeep::file_count(&table)?.0;
        let compaction = if compactable(kind) {
            let c = upkeep::compact_small_files(&mut table, || {
                // A race test holds two compactions here, after their
                // files are written and before their commits.
                crate::failpoint!("maintain.before_compact_commit");
                Ok(())
            })
            .await?;
            crate::failpoint!("maintain.after_compact");
            Some(c)
        } else {
            None
        };
        let vacuumed = match args.vacuum_retention_hours {
            Some(hours) => {
                let retention = chrono::Duration::milliseconds((hours * 3_600_000.0) as i64);
                let v = upkeep::vacuum(&mut table, retention, args.now_ms).await?;
                crate::failpoint!("maintain.after_vacuum");
                Some(v)
            }
            None => None,
        };
        let checkpoint_version = upkeep::checkpoint(&mut table).await?;
        let files_after = upkeep::file_count(&table)?.0;
        tracing::info!(table = name, files_before, files_after, checkpoint_version, "maintained");
        before += files_before;
        after += files_after;
        out.push(upkeep::summary(name, &location, compaction.as_ref(), vacuumed.as_ref(), checkpoint_version, files_after));
    }
    Ok(json!({
        "step": "maintain",
        "app_id": wf.app_id,
        "tables": out,
        "not_created_yet": missing,
        "files_before": before,
        "files_after": after,
        "vacuum_retention_hours": args.vacuum_retention_hours,
    }))
}
