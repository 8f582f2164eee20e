//! The workflow engine: one module per step, each a transition that loads
//! state from Delta, decides with a pure function, and commits.
//!
//! Architecture invariant: a step holds no state between calls. Everything
//! it needs to resume (position, generation, open snapshot) is read back from
//! the bronze and facts tables at its start, and each commit it makes carries
//! the txn id that turns its rerun into a no-op. So any step may crash at any
//! point and be called again; the failpoints in [`FAILPOINTS`] sit at every
//! commit boundary and the crash drill proves it.

pub mod apply;
pub mod change_order;
pub mod chunked;
pub mod coarse;
pub mod headroom;
pub mod maintain;
pub mod identity;
pub mod machine;
pub mod plan;
pub mod rebuild;
pub mod reconcile;
pub mod recover;
pub mod repair;
pub mod rules;
pub mod seed;
pub mod snapshot;
pub mod state;
pub mod status;
pub mod step;
pub mod stream;
pub mod switch;

use std::collections::HashMap;
use std::path::Path;

use deltalake::DeltaTable;

use crate::delta::{self, TableKind};
use crate::error::{StepError, StepResult};
use crate::source::{CaptureInstance, ServerZone, SharedSource, SourceSecrets, TableInfo};
use crate::workflow::Workflow;

/// Every failpoint, in the order a bootstrap and a batch pass them. Set one
/// with `MSSQL_CDC_FAILPOINTS=name=return` (the step fails as if it crashed
/// there) or `MSSQL_CDC_FAILPOINTS=name=return(abort)` (the process aborts
/// there, like a kill); see `cli::arm_failpoints`.
///
/// Others sit where a sleep or a held callback lets a test race two calls,
/// not at a commit boundary, so they are not listed: for `tests/batch_race.rs`,
/// `stream.after_read` (a batch read, before its bronze commit),
/// `state.between_facts_and_bronze` and `chunked.before_wave_bronze` (a wave
/// read, before its bronze commit; `tests/records_race.rs` holds it too);
/// and, for `tests/records_race.rs`, `chunked.before_plan_plans` (a plan
/// made, before its plans row), `chunked.before_chunk_read` (a chunk handed
/// to a reader, before its SELECT), `snapshot.before_open` (a full run's mode
/// check passed, before its open row), `recover.before_recovery_row` (a
/// recovery's facts read, before its recovery row) and
/// `apply.between_facts_and_plans` (apply's facts read, before its plans read)
/// and `apply.before_state` (apply's capture instance picked, before its
/// facts read); for `tests/seed_crash.rs`, `snapshot.before_repaired_completion`
/// (a full snapshot or a seed found in bronze without its completion row,
/// before the row is written); for `tests/maintain.rs`,
/// `maintain.before_compact_commit` (a compaction's files written, before
/// its commit).
pub const FAILPOINTS: &[&str] = &[
    "snapshot.after_open",
    "snapshot.after_bronze",
    "snapshot.after_event",
    "snapshot.after_repaired_completion",
    "recover.after_failed_row",
    "recover.after_recovery_row",
    "stream.after_start",
    "repair.after_facts",
    "stream.after_bronze",
    "stream.after_facts",
    "switch.after_open_plans",
    "switch.after_open",
    "chunked.after_open_plans",
    "chunked.after_open",
    "chunked.after_plan_plans",
    "chunked.after_plan",
    "chunked.after_wave_bronze",
    "chunked.after_wave_plans",
    "chunked.after_wave_facts",
    "chunked.after_complete",
    "apply.after_merge",
    "apply.after_control",
    "reconcile.after_report",
    "maintain.after_compact",
    "maintain.after_vacuum",
];

/// A failpoint: in tests and crash drills, fails the step here (`return`) or
/// aborts the process (`return(abort)`); otherwise does nothing.
#[macro_export]
macro_rules! failpoint {
    ($name:expr) => {
        fail::fail_point!($name, |arg: Option<String>| {
            if arg.as_deref() == Some("abort") {
                eprintln!("failpoint {} aborting the process", $name);
                std::process::abort();
            }
            Err($crate::error::StepError::Injected($name.to_string()))
        });
    };
}

/// The app id of a stream generation: the configured one for generation 0,
/// `<app_id>.g<n>` after (a new generation restarts batch ids at 0, and Delta
/// txn versions must only grow).
pub fn generation_app_id(app_id: &str, generation: i32) -> String {
    if generation == 0 {
        app_id.to_string()
    } else {
        format!("{app_id}.g{generation}")
    }
}

/// Whether a step may create its targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The steps that write: missing targets are created.
    ReadWrite,
    /// `status`: nothing is created; a missing target reads as empty.
    ReadOnly,
}

/// Everything a step works with, opened and validated.
pub struct Context {
    pub workflow: Workflow,
    pub source: SharedSource,
    pub zone: ServerZone,
    pub table: TableInfo,
    pub instance: CaptureInstance,
    pub bronze: DeltaTable,
    pub facts: DeltaTable,
    pub storage: HashMap<String, String>,
}

impl Context {
    /// Opens the source and the targets and checks the configuration against
    /// them. Every problem is found here, before anything is written: a
    /// missing table, a table without CDC, an unknown capture instance, a
    /// target folder that holds something else, a bronze table of another
    /// source table, facts rows of this app id written for another stream.
    /// Missing targets are created.
    pub async fn open(workflow: Workflow) -> StepResult<Context> {
        Context::open_with(workflow, Access::ReadWrite).await
    }

    /// Like [`Context::open`], with the same checks, but writes nothing: a
    /// target that does not exist yet is seen as an empty table held in
    /// memory (for `status`, which must never create tables).
    pub async fn open_read_only(workflow: Workflow) -> StepResult<Context> {
        Context::open_with(workflow, Access::ReadOnly).await
    }

    async fn open_with(workflow: Workflow, access: Access) -> StepResult<Context> {
        let storage = workflow.storage_options()?;
        let secrets = read_secrets(&workflow)?;
        let source = crate::connect::open_source(&workflow.source.url, secrets).await?;
        let table_name = workflow.table_name();
        let table = source.table_info(&table_name).await?;
        let instances = source.capture_instances(&table_name).await?;
        if instances.is_empty() {
            return Err(StepError::Config(format!(
                "change data capture is not enabled on {table_name} ({}): enable it with sys.sp_cdc_enable_table \
                 (or `mssql-cdc sim alter --enable-instance` on the simulator)",
                source.describe()
            )));
        }
        let instance = match &workflow.table.capture_instance {
            Some(name) => instances.iter().find(|c| c.name.eq_ignore_ascii_case(name)).cloned().ok_or_else(|| {
                StepError::Config(format!(
                    "capture instance '{name}' does not exist on {table_name}; it has: {}. Fix table.capture_instance in {}",
                    instances.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
                    workflow.path.display()
                ))
            })?,
            None => first_instance(source.as_ref(), &instances).await?,
        };
        let zone = source.server_time_zone().await?;
        // Look at both targets before creating either, so a bad one writes nothing.
        let (bronze_existing, facts_existing) = match access {
            Access::ReadWrite => (
                delta::open_existing(&workflow.target.bronze, &storage).await?,
                delta::open_existing(&workflow.target.facts, &storage).await?,
            ),
            Access::ReadOnly => (
                delta::peek_existing(&workflow.target.bronze, &storage).await?,
                delta::peek_existing(&workflow.target.facts, &storage).await?,
            ),
        };
        let bronze_schema = delta::bronze::schema(&instance.columns);
        let facts_schema = delta::facts::schema();
        let mut bronze_existing = bronze_existing;
        let mut facts_existing = facts_existing;
        if access == Access::ReadWrite {
            // Before anything is written (a table created, a schema
            // migrated): a commit must be put-if-absent on this store. Bronze
            // and facts are found above to be empty folders or Delta tables,
            // and here to be this program's, so the probe may go into them;
            // the other tables' folders are checked by the probe itself.
            if let Some(b) = bronze_existing.as_ref() {
                delta::check_kind(b, &workflow.target.bronze, TableKind::Bronze)?;
            }
            if let Some(f) = facts_existing.as_ref() {
                delta::check_kind(f, &workflow.target.facts, TableKind::Facts)?;
            }
            let checked = [workflow.target.bronze.as_str(), workflow.target.facts.as_str()];
            crate::storage::check_conditional_puts(&workflow.target_tables(), &storage, workflow.target.single_writer, &checked).await?;
        }
        if let Some(b) = bronze_existing.as_mut() {
            delta::check_kind_and_migrate(b, &workflow.target.bronze, TableKind::Bronze, &bronze_schema).await?;
            identity::check_bronze_belongs(b, &workflow, &table_name, &instance)?;
        }
        if let Some(f) = facts_existing.as_mut() {
            delta::check_kind_and_migrate(f, &workflow.target.facts, TableKind::Facts, &facts_schema).await?;
            identity::check_facts_belong(f, &workflow).await?;
        }
        // snapshot.keys must be captured by the instance the stream is on
        // (`engine::switch`), the one every snapshot step reads: during a
        // switch the newest instance may lack a key column the stream still
        // reads (refusing would keep the stream from reaching the switch), or
        // add one bronze does not hold yet.
        let stream_instance = match (&workflow.table.capture_instance, facts_existing.as_ref()) {
            (None, Some(f)) => {
                let rows = state::facts_rows(f, &workflow.app_id).await?;
                switch::current(switch::recorded_instance(&rows).as_deref(), &instances, &instance).clone()
            }
            _ => instance.clone(),
        };
        if let Some(keys) = &workflow.snapshot.keys {
            for k in keys {
                if stream_instance.column(k).is_none() {
                    return Err(StepError::Config(format!(
                        "snapshot.keys names '{k}', which capture instance '{}' (the one the stream is on) does not capture: \
                         set snapshot.keys in {} to columns it captures ({})",
                        stream_instance.name,
                        workflow.path.display(),
                        stream_instance.columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ")
                    )));
                }
            }
        }
        let (bronze, facts) = match access {
            Access::ReadOnly => (
                match bronze_existing {
                    Some(b) => b,
                    None => delta::empty_in_memory(TableKind::Bronze, &bronze_schema).await?,
                },
                match facts_existing {
                    Some(f) => f,
                    None => delta::empty_in_memory(TableKind::Facts, &facts_schema).await?,
                },
            ),
            Access::ReadWrite => {
                let bronze = delta::open_or_create_with(
                    &workflow.target.bronze,
                    &storage,
                    TableKind::Bronze,
                    &bronze_schema,
                    &format!("mssql-cdc bronze of {table_name}: CDC change rows and snapshot rows"),
                    &[(delta::PROP_SOURCE_TABLE, table_name.to_string())],
                )
                .await?;
                // A bronze table created by a concurrent first call is checked too.
                identity::check_bronze_belongs(&bronze, &workflow, &table_name, &instance)?;
                let facts = delta::open_or_create(
                    &workflow.target.facts,
                    &storage,
                    TableKind::Facts,
                    &facts_schema,
                    "mssql-cdc facts: a row per micro-batch and per event",
                )
                .await?;
                (bronze, facts)
            }
        };
        Ok(Context { workflow, source, zone, table, instance, bronze, facts, storage })
    }

    /// The bronze table's Arrow schema as it is now.
    pub fn bronze_schema(&self) -> StepResult<deltalake::arrow::datatypes::SchemaRef> {
        let snap = self.bronze.snapshot().map_err(StepError::delta(&self.workflow.target.bronze))?;
        let arrow = snap.snapshot().arrow_schema();
        Ok(arrow)
    }

    /// The columns snapshots cut key ranges on.
    pub fn snapshot_keys(&self) -> Vec<String> {
        match &self.workflow.snapshot.keys {
            Some(k) => k.iter().map(|k| self.instance.column(k).map(|c| c.name.clone()).unwrap_or_else(|| k.clone())).collect(),
            None => self.instance.index_columns.clone(),
        }
    }

    /// The row filter the change reads use: `stream.row_filter`, with
    /// `auto` resolved for the capture instance the context is on (see
    /// [`crate::workflow::RowFilterOption::Auto`]).
    pub fn row_filter(&self) -> crate::source::RowFilter {
        use crate::source::RowFilter;
        use crate::workflow::RowFilterOption;
        match self.workflow.stream.row_filter {
            RowFilterOption::All => RowFilter::All,
            RowFilterOption::AllUpdateOld => RowFilter::AllUpdateOld,
            RowFilterOption::Auto => match self.key_needing_before_images() {
                Some(_) => RowFilter::AllUpdateOld,
                None if self.instance.index_columns.is_empty() => RowFilter::AllUpdateOld,
                None => RowFilter::All,
            },
        }
    }

    /// The first column of the capture instance's unique index whose equal
    /// values can be spelled differently, with why: an update that only
    /// respells it is named in its old form by its before-image alone.
    pub fn key_needing_before_images(&self) -> Option<(&crate::types::ColumnDesc, &'static str)> {
        self.instance
            .index_columns
            .iter()
            .filter_map(|k| self.instance.column(k))
            .find_map(|c| c.sql_type.equal_respellings().map(|why| (c, why)))
    }

    /// A facts row of this stream with its header filled (app id, table,
    /// target, generation, capture instance, recorded now) and nothing else.
    pub fn fact_row(&self, generation: i32) -> crate::delta::facts::FactRow {
        crate::delta::facts::FactRow {
            app_id: self.workflow.app_id.clone(),
            table: self.workflow.table_name().to_string(),
            target: self.workflow.target.bronze.clone(),
            generation,
            capture_instance: Some(self.instance.name.clone()),
            recorded_at: Some(chrono::Utc::now()),
            ..Default::default()
        }
    }

    /// Commit time (UTC) of an LSN, from the source's mapping table.
    pub async fn commit_time(&self, lsn: crate::lsn::Lsn) -> StepResult<Option<chrono::DateTime<chrono::Utc>>> {
        Ok(self.source.lsn_to_time(lsn).await?.map(|l| self.zone.to_utc(l)))
    }
}

/// The renames of a capture instance's columns, as `'captured' -> 'now'` pairs.
pub fn renames_text(instance: &CaptureInstance) -> String {
    instance.renamed.iter().map(|(old, now)| format!("'{old}' -> '{now}'")).collect::<Vec<_>>().join(", ")
}

/// Refuses a step that reads the source table's rows with a capture instance
/// (`ctx.instance`, the one the step reads with: call it after
/// `switch::follow_stream` where the step follows the stream) that captures a
/// column the table has renamed since (`sp_rename`,
/// [`CaptureInstance::renamed`]). The instance keeps the old name, and the
/// table no longer has it: a snapshot read of the captured columns would
/// find nothing under that name and load NULL in its place for every row,
/// a loss no later step could see. The stream is unaffected (the change
/// table keeps the old name too). Call it before the step writes anything;
/// `step` names the step in the message ("reconcile", "a full snapshot"...).
pub fn check_no_renamed_columns(ctx: &Context, step: &str) -> StepResult<()> {
    let ci = &ctx.instance;
    if ci.renamed.is_empty() {
        return Ok(());
    }
    let table = ctx.workflow.table_name();
    Err(StepError::NeedsPerson(format!(
        "{step} reads the rows of {table}, but capture instance '{}' captures columns that {table} has renamed since \
         (captured name -> name now: {}): the table no longer has the captured names, so the read would load NULL in their \
         place. The step stopped before reading the table. Create a capture instance that captures the columns under their \
         new names (EXEC sys.sp_cdc_enable_table @source_schema = N'{}', @source_name = N'{}', @role_name = NULL, \
         @capture_instance = N'<a new name>'), let `stream` switch to it (with table.capture_instance unset the stream \
         follows the newer instance from its start LSN; bronze gains the new names as columns), then call the step again; \
         drop the old instance (sys.sp_cdc_disable_table) once the stream has switched",
        ci.name,
        renames_text(ci),
        table.schema.replace('\'', "''"),
        table.name.replace('\'', "''"),
    )))
}

/// The source password, from the variable or file the workflow names.
fn read_secrets(wf: &Workflow) -> StepResult<SourceSecrets> {
    let mut s = SourceSecrets::default();
    if let Some(var) = &wf.source.password_env {
        s.password = Some(std::env::var(var).map_err(|_| {
            StepError::Config(format!("source.password_env names {var}, which is not set: export it before running the step"))
        })?);
    } else if let Some(file) = &wf.source.password_file {
        let text = std::fs::read_to_string(file)
            .map_err(|e| StepError::Config(format!("cannot read source.password_file {}: {e}", file.display())))?;
        s.password = Some(text.trim_end_matches(['\n', '\r']).to_string());
    }
    Ok(s)
}

/// Loads a workflow file and opens its context.
pub async fn open_workflow(path: &Path) -> StepResult<Context> {
    Context::open(Workflow::load(path)?).await
}

/// The instance a step starts on before the facts name one (a new stream's
/// bootstrap, chunked open, seed or start): the one the switch rule reaches
/// at the max LSN from the oldest instance whose start is established.
///
/// Not simply the newest: SQL Server sets a new instance's start LSN only
/// when the capture job first scans past its creation, and that start can
/// be above `fn_cdc_get_max_lsn()` for a while (the capture job's lag). A
/// stream started at a snapshot S below it on that instance would find its
/// first changes missing and call it a purge (and with `on_data_loss =
/// "skip"` go on past changes the older instance holds). From the oldest,
/// the stream switches when its position reaches the newer one's start.
async fn first_instance(source: &dyn crate::source::CdcSource, instances: &[CaptureInstance]) -> StepResult<CaptureInstance> {
    let newest = instances.last().cloned().expect("non-empty");
    let Some(oldest) = instances.iter().find(|i| i.start_lsn.is_some()) else { return Ok(newest) };
    let Some(max) = source.max_lsn().await? else { return Ok(newest) };
    Ok(switch::reached_at(max, oldest, instances))
}
