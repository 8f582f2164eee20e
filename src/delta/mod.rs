//! The Delta layer: table kinds, their typed and commented schemas, versioned
//! migrations, and the one idempotent append every step commits through.
//!
//! Architecture invariant: every commit a step makes goes through
//! [`append_idempotent`], which writes the data, a Delta `txn` action
//! (app id + version) and the commit metadata in ONE commit, after checking
//! whether the table already holds that txn version. A rerun of a step that
//! crashed after a commit therefore finds "already applied" and moves on; one
//! that crashed before it commits normally. No other state exists: position,
//! generations and snapshots are all read back from these tables.

pub mod bronze;
pub mod control;
pub mod facts;
pub mod facts_read;
pub mod golden;
pub mod maintain;
pub mod plans;
pub mod reconcile;
pub mod silver;

use std::collections::HashMap;
use std::sync::Arc;

use deltalake::arrow::datatypes::SchemaRef;
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::datafusion::prelude::SessionContext;
use deltalake::kernel::engine::arrow_conversion::TryIntoKernel;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::kernel::{StructField, StructType, Transaction};
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use deltalake::DeltaTable;
use futures::StreamExt;
use serde_json::{json, Value};
use url::Url;

use crate::error::{StepError, StepResult};

/// Table property naming the kind of a table this program created.
pub const PROP_KIND: &str = "mssql_cdc.kind";
/// Table property of a bronze table: the source table it holds (`schema.name`).
/// A workflow pointed at a bronze table of another source table is refused.
pub const PROP_SOURCE_TABLE: &str = "mssql_cdc.source_table";
/// Table property of a keyed silver table: the key columns its rows are told
/// apart by (comma-separated, as the capture instance names them). A silver
/// merged on other columns than it was built on would gain duplicates or
/// merge distinct rows, so `apply` refuses a mismatch.
pub const PROP_SILVER_KEYS: &str = "mssql_cdc.silver_keys";
/// Table property holding the schema version (the last migration applied).
pub const PROP_SCHEMA_VERSION: &str = "mssql_cdc.schemaVersion";

/// The kinds of table this program writes. Each has its own schema and migrations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableKind {
    Bronze,
    Facts,
    /// Key values of chunked snapshots, next to bronze (adr-0028 Amendment 4).
    Plans,
    /// The current state per key, applied from bronze.
    Silver,
    /// Silver's position and verdict, a row per apply.
    Control,
    /// Reconcile reports.
    Reconcile,
}

impl TableKind {
    pub fn name(self) -> &'static str {
        match self {
            TableKind::Bronze => "bronze",
            TableKind::Facts => "facts",
            TableKind::Plans => "snapshot_plans",
            TableKind::Silver => "silver",
            TableKind::Control => "silver_control",
            TableKind::Reconcile => "reconcile",
        }
    }

    /// The migrations of this kind, in order. Migration 1 is the table as
    /// created; a later one changes an existing table (adds columns, rewrites
    /// comments) and is applied when the table is next opened.
    pub fn migrations(self) -> &'static [Migration] {
        match self {
            TableKind::Bronze => bronze::MIGRATIONS,
            TableKind::Facts => facts::MIGRATIONS,
            TableKind::Plans => plans::MIGRATIONS,
            TableKind::Silver => silver::MIGRATIONS,
            TableKind::Control => control::MIGRATIONS,
            TableKind::Reconcile => reconcile::MIGRATIONS,
        }
    }

    /// The schema version this release writes.
    pub fn current_version(self) -> u32 {
        self.migrations().last().map(|m| m.version).unwrap_or(1)
    }
}

/// One step of a table kind's schema history.
#[derive(Debug)]
pub struct Migration {
    pub version: u32,
    pub description: &'static str,
    /// Columns this migration adds (name, comment); the schema itself comes from
    /// the kind's current schema, so the column's type is looked up there.
    pub adds_columns: &'static [&'static str],
}

/// Turns a path or URI into the URL deltalake opens. Local paths become
/// `file://` URLs (the folder is created when needed); cloud URIs need the
/// `cloud` build feature.
pub fn table_url(location: &str) -> StepResult<Url> {
    if location.contains("://") {
        let url = Url::parse(location)
            .map_err(|e| StepError::Config(format!("'{location}' is not a valid table URI: {e}")))?;
        match url.scheme() {
            "file" | "memory" => {}
            "s3" | "s3a" | "abfss" | "abfs" | "az" | "adl" | "azure" | "gs" => {
                if !cfg!(feature = "cloud") {
                    return Err(StepError::Config(format!(
                        "'{location}' needs the object-store support of the `cloud` build feature: \
                         build with `cargo build --release --features cloud`"
                    )));
                }
            }
            other => {
                return Err(StepError::Config(format!(
                    "'{location}': the scheme '{other}' is not supported; use a path, file://, s3://, abfss:// or gs://"
                )))
            }
        }
        Ok(url)
    } else {
        let path = std::path::Path::new(location);
        std::fs::create_dir_all(path)
            .map_err(|e| StepError::Config(format!("cannot create the table folder {location}: {e}")))?;
        deltalake::ensure_table_uri(location)
            .map_err(|e| StepError::Config(format!("'{location}' is not a usable table path: {e}")))
    }
}

/// Opens the Delta table at `location`, or returns None when no table is
/// there yet. A location holding files that are not a Delta table is a
/// `Config` error: we never write into someone else's folder.
///
/// "No table yet" is decided the way the Delta protocol decides it: a table
/// exists once its log holds a commit (or a checkpoint). A folder whose only
/// entries are under `_delta_log/` and none of them a commit is a table whose
/// creation is under way or was cut short: log stores that stage a commit
/// under a temporary name (`_delta_log/_commit_<uuid>.json.tmp` on S3 with a
/// locking provider) show exactly that until the commit is copied into
/// place, and keep showing it after a crash. Creating there is safe, because
/// version 0 is written put-if-absent and only one writer's
/// `00000000000000000000.json` lands: [`open_or_create_with`] makes the loser
/// open the winner's table. Anything outside `_delta_log/` (a data file, a
/// stray export) is refused as before: this program's first commit on a table
/// is the bare create, which writes no data file, so such files were never
/// ours.
pub async fn open_existing(location: &str, storage: &HashMap<String, String>) -> StepResult<Option<DeltaTable>> {
    let url = table_url(location)?;
    let mut table = deltalake::DeltaTableBuilder::from_url(url.clone())
        .map_err(StepError::delta(location))?
        .with_storage_options(storage.clone())
        .build()
        .map_err(StepError::delta(location))?;
    let exists = table.verify_deltatable_existence().await.map_err(StepError::delta(location))?;
    if exists {
        table.load().await.map_err(StepError::delta(location))?;
        return Ok(Some(table));
    }
    // No commit when we looked: nothing but a log folder without a commit may be there.
    fail::fail_point!("delta.open_existing.before_listing");
    let store = table.object_store();
    let mut foreign = None;
    let mut listing = store.list(None);
    while let Some(entry) = listing.next().await {
        let path = match entry {
            Ok(meta) => meta.location.to_string(),
            Err(e) => return Err(StepError::Temporary(format!("cannot list {location}: {e}"))),
        };
        if !is_uncommitted_log_entry(&path) {
            foreign = Some(path);
            break;
        }
    }
    drop(listing);
    let Some(path) = foreign else { return Ok(None) };
    // A file outside the log is foreign only if there is still no commit
    // after the listing saw it: another call may have created the table and
    // written to it between our look and the listing (found by the torture
    // soak, seed 140010510: a first `backfill`'s plans table, exit 2 beside
    // the call creating it). That call's first commit, the bare create,
    // lands before any data file of its, so a data file listed while no
    // commit existed, and still without one, was never ours.
    if table.verify_deltatable_existence().await.map_err(StepError::delta(location))? {
        table.load().await.map_err(StepError::delta(location))?;
        return Ok(Some(table));
    }
    Err(StepError::Config(format!(
        "{location} is not a Delta table but holds other files (for example '{path}'): \
         point the workflow at an empty folder or an existing Delta table"
    )))
}

/// Whether a path of a folder without a Delta commit lies in its log folder:
/// a commit staged by a creation under way (or cut short), never a foreign
/// data file (see [`open_existing`]).
fn is_uncommitted_log_entry(path: &str) -> bool {
    path.strip_prefix("_delta_log/").is_some_and(|rest| !rest.is_empty())
}

/// Checks that an existing table is of the expected kind and migrates it to
/// this release's schema version.
pub async fn check_kind_and_migrate(table: &mut DeltaTable, location: &str, kind: TableKind, schema: &SchemaRef) -> StepResult<()> {
    let version = check_kind(table, location, kind)?;
    if version < kind.current_version() {
        migrate(table, location, kind, version, schema).await?;
    }
    Ok(())
}

/// The kind of this program's table `table` says it is (its
/// `mssql_cdc.kind` property); None for a Delta table another program made.
pub fn kind_property(table: &DeltaTable) -> Option<String> {
    table.snapshot().ok()?.metadata().configuration().get(PROP_KIND).cloned()
}

/// Checks that an existing table is of the expected kind and of a schema
/// version this release knows; returns that version (a reader that writes
/// nothing checks with this and leaves the migration to the steps).
pub fn check_kind(table: &DeltaTable, location: &str, kind: TableKind) -> StepResult<u32> {
    let config = table.snapshot().map_err(StepError::delta(location))?.metadata().configuration().clone();
    let found_kind = config.get(PROP_KIND).cloned();
    if found_kind.as_deref() != Some(kind.name()) {
        return Err(StepError::Config(format!(
            "{location} is a Delta table, but not a {} table of mssql-cdc (its {PROP_KIND} is {}): \
             point target.{} at a table this program created, or at an empty folder",
            kind.name(),
            found_kind.map(|k| format!("'{k}'")).unwrap_or_else(|| "not set".into()),
            kind.name()
        )));
    }
    let version: u32 = config.get(PROP_SCHEMA_VERSION).and_then(|v| v.parse().ok()).unwrap_or(1);
    let current = kind.current_version();
    if version > current {
        return Err(StepError::Config(format!(
            "{location} has {} schema version {version}, newer than this release knows ({current}): upgrade mssql-cdc",
            kind.name()
        )));
    }
    Ok(version)
}

/// Applies the migrations after `from` to an existing table.
async fn migrate(table: &mut DeltaTable, location: &str, kind: TableKind, from: u32, schema: &SchemaRef) -> StepResult<()> {
    for m in kind.migrations().iter().filter(|m| m.version > from) {
        tracing::info!(table = location, kind = kind.name(), version = m.version, "migrating: {}", m.description);
        if !m.adds_columns.is_empty() {
            let existing: Vec<String> = table
                .snapshot()
                .map_err(StepError::delta(location))?
                .schema()
                .fields()
                .map(|f| f.name().to_string())
                .collect();
            let kernel = commented_schema(kind, schema)?;
            let new_fields: Vec<StructField> = kernel
                .fields()
                .filter(|f| m.adds_columns.contains(&f.name().as_str()) && !existing.contains(f.name()))
                .cloned()
                .collect();
            if !new_fields.is_empty() {
                *table = table.clone().add_columns().with_fields(new_fields).await.map_err(StepError::delta(location))?;
            }
        }
        let props = HashMap::from([(PROP_SCHEMA_VERSION.to_string(), m.version.to_string())]);
        *table = table
            .clone()
            .set_tbl_properties()
            .with_properties(props)
            .with_raise_if_not_exists(false)
            .await
            .map_err(StepError::delta(location))?;
    }
    Ok(())
}

/// The kernel schema of an Arrow schema, with each column's comment from the
/// kind's comment table.
pub fn commented_schema(kind: TableKind, schema: &SchemaRef) -> StepResult<StructType> {
    let kernel: StructType = schema
        .as_ref()
        .try_into_kernel()
        .map_err(|e| StepError::Internal(format!("schema of the {} table does not convert: {e}", kind.name())))?;
    let fields: Vec<StructField> = kernel
        .fields()
        .map(|f| {
            let comment = match kind {
                TableKind::Bronze => bronze::column_comment(f.name()),
                TableKind::Facts => facts::column_comment(f.name()),
                TableKind::Plans => plans::column_comment(f.name()),
                TableKind::Silver => silver::column_comment(f.name()),
                TableKind::Control => control::column_comment(f.name()),
                TableKind::Reconcile => reconcile::column_comment(f.name()),
            };
            f.clone().with_metadata([("comment".to_string(), comment)])
        })
        .collect();
    StructType::try_new(fields).map_err(|e| StepError::Internal(format!("schema: {e}")))
}

/// Like [`open_existing`], but never creates anything, not even an empty
/// local folder: for steps that only read (`status`).
pub async fn peek_existing(location: &str, storage: &HashMap<String, String>) -> StepResult<Option<DeltaTable>> {
    if !location.contains("://") && !std::path::Path::new(location).exists() {
        return Ok(None);
    }
    if let Some(path) = location.strip_prefix("file://") {
        if !std::path::Path::new(path).exists() {
            return Ok(None);
        }
    }
    open_existing(location, storage).await
}

/// An empty table of this kind held in memory only: what a read-only step
/// sees where a target does not exist yet, without creating it.
pub async fn empty_in_memory(kind: TableKind, schema: &SchemaRef) -> StepResult<DeltaTable> {
    let kernel = commented_schema(kind, schema)?;
    DeltaTable::new_in_memory()
        .create()
        .with_columns(kernel.fields().cloned())
        .await
        .map_err(StepError::delta("memory:///"))
}

/// Opens the table of this kind at `location`, creating it (typed, commented,
/// at the current schema version) when the location is empty.
pub async fn open_or_create(
    location: &str,
    storage: &HashMap<String, String>,
    kind: TableKind,
    schema: &SchemaRef,
    description: &str,
) -> StepResult<DeltaTable> {
    open_or_create_with(location, storage, kind, schema, description, &[]).await
}

/// [`open_or_create`] with more table properties set at creation (e.g. the
/// source table a bronze table belongs to).
pub async fn open_or_create_with(
    location: &str,
    storage: &HashMap<String, String>,
    kind: TableKind,
    schema: &SchemaRef,
    description: &str,
    extra_properties: &[(&str, String)],
) -> StepResult<DeltaTable> {
    if let Some(mut table) = open_existing(location, storage).await? {
        check_kind_and_migrate(&mut table, location, kind, schema).await?;
        return Ok(table);
    }
    // Tests widen the window between the look above and the create below
    // (`delta.before_create=sleep(1500)`), so two first calls surely both
    // find no table and both create. Not a commit boundary: not in
    // `engine::FAILPOINTS`.
    crate::failpoint!("delta.before_create");
    let url = table_url(location)?;
    let table = deltalake::DeltaTableBuilder::from_url(url)
        .map_err(StepError::delta(location))?
        .with_storage_options(storage.clone())
        .build()
        .map_err(StepError::delta(location))?;
    let kernel = commented_schema(kind, schema)?;
    let props: HashMap<String, Option<String>> = HashMap::from([
        (PROP_KIND.to_string(), Some(kind.name().to_string())),
        (PROP_SCHEMA_VERSION.to_string(), Some(kind.current_version().to_string())),
    ]);
    let mut props = props;
    for (k, v) in extra_properties {
        props.insert(k.to_string(), Some(v.clone()));
    }
    // No retry of the create commit: delta-rs, on losing the put-if-absent of
    // version 0, would load the winner's table and commit our protocol and
    // metadata again as version 1 (a second creation, with a new table id,
    // over a table that may already hold rows). With no retries the lost race
    // is an error, and we open the winner's table instead.
    let created = table
        .create()
        .with_columns(kernel.fields().cloned())
        .with_comment(description)
        .with_configuration(props)
        .with_raise_if_key_not_exists(false)
        .with_save_mode(deltalake::protocol::SaveMode::ErrorIfExists)
        .with_commit_properties(CommitProperties::default().with_max_retries(0))
        .await;
    match created {
        Ok(t) => Ok(t),
        Err(create_error) => {
            let mut t = open_after_lost_create(location, storage, create_error).await?;
            check_kind_and_migrate(&mut t, location, kind, schema).await?;
            Ok(t)
        }
    }
}

/// How often, and how long apart, a call whose create failed looks for the
/// table another process created: a store that lists a new object late may
/// not show the winner's version 0 at once.
const LOST_CREATE_LOOKS: u32 = 10;
const LOST_CREATE_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// After a failed create: another process created the table between our
/// look and our commit (its version 0 won the put-if-absent), so we open
/// its table, looking again a bounded number of times. When no table shows
/// up, the create's own error stands (a lost commit race is exit 75).
async fn open_after_lost_create(
    location: &str,
    storage: &HashMap<String, String>,
    create_error: deltalake::DeltaTableError,
) -> StepResult<DeltaTable> {
    for look in 0..LOST_CREATE_LOOKS {
        if look > 0 {
            tokio::time::sleep(LOST_CREATE_WAIT).await;
        }
        if let Some(t) = open_existing(location, storage).await? {
            tracing::info!(table = location, "another call created this table first: using its table");
            return Ok(t);
        }
    }
    Err(StepError::delta(location)(create_error))
}

/// A Delta transaction id: the commit that holds it is applied at most once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Txn {
    pub app_id: String,
    pub version: i64,
}

impl Txn {
    pub fn new(app_id: impl Into<String>, version: i64) -> Txn {
        Txn { app_id: app_id.into(), version }
    }
}

/// What [`append_idempotent`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Appended {
    /// A new commit at this table version.
    Committed { table_version: i64 },
    /// The table already held this txn (version `found` >= the one asked).
    /// Another call decided this outcome: a caller that wrote something else
    /// under the txn compares what is recorded with what it meant (see
    /// `engine::repair::check_recorded_batch`) rather than going on.
    AlreadyApplied { found: i64 },
    /// There were no rows: nothing was committed and the txn is not recorded.
    Empty,
}

impl Appended {
    pub fn committed(&self) -> bool {
        matches!(self, Appended::Committed { .. })
    }
}

/// The newest version the table holds for a txn app id.
pub async fn txn_version(table: &DeltaTable, app_id: &str) -> StepResult<Option<i64>> {
    let snapshot = table.snapshot().map_err(StepError::delta(table.table_url().as_str()))?;
    snapshot
        .transaction_version(table.log_store().as_ref(), app_id)
        .await
        .map_err(StepError::delta(table.table_url().as_str()))
}

/// Data files a step writes while it reads (a chunk, a micro-batch) are
/// closed at this size.
pub const DATA_FILE_TARGET_BYTES: u64 = 64 * 1024 * 1024;

/// A row group is written out once its encoded size passes this. Parquet's
/// writer holds the open row group's encoded pages in memory, and its
/// default closes a group at 1,048,576 rows whatever their size, so without
/// this bound a read of a million rows would hold them all (encoded) before
/// any reached the file. 16 MiB keeps a writer's memory small and the row
/// groups large enough for readers (about 100,000 rows of a narrow table).
pub const ROW_GROUP_TARGET_BYTES: usize = 16 * 1024 * 1024;

/// A writer for the data files of a step that writes while it reads: its
/// memory is bounded by one open row group ([`ROW_GROUP_TARGET_BYTES`]),
/// not by the rows it is given, and it closes files at
/// [`DATA_FILE_TARGET_BYTES`]. Its `flush` gives the `Add` actions for
/// [`commit_adds`].
pub fn streaming_writer(table: &DeltaTable) -> StepResult<RecordBatchWriter> {
    let label = table.table_url().to_string();
    Ok(RecordBatchWriter::for_table(table)
        .map_err(StepError::delta(&label))?
        .with_target_file_size(DATA_FILE_TARGET_BYTES)
        .with_writer_properties(bounded_writer_properties()))
}

/// Parquet writer properties whose open row group is bounded by
/// [`ROW_GROUP_TARGET_BYTES`]: for every writer of a step, including the
/// files a MERGE rewrites (deltalake's default closes a row group at
/// 1,048,576 rows, so a MERGE that rewrites a large silver held that many
/// rows, encoded, per file it was writing).
pub fn bounded_writer_properties() -> deltalake::parquet::file::properties::WriterProperties {
    use deltalake::parquet::basic::Compression;
    use deltalake::parquet::file::properties::WriterProperties;
    // deltalake's own default is SNAPPY; kept, with the row-group bound added.
    WriterProperties::builder().set_compression(Compression::SNAPPY).set_max_row_group_bytes(Some(ROW_GROUP_TARGET_BYTES)).build()
}

/// Appends batches in ONE commit that also carries `txn` and `metadata`, unless
/// the table already holds that txn version. `metadata` lands in commitInfo
/// under `mssql_cdc` and, as text, in `userMetadata`. Batches are written to
/// files as they arrive, so memory stays bounded by one batch and the writer's
/// buffer, not by the commit's size. With no rows nothing is committed
/// ([`Appended::Empty`]); a step whose txn must decide an empty outcome too
/// (a micro-batch, a wave) commits it with [`commit_no_rows`].
pub async fn append_idempotent<S>(table: &mut DeltaTable, batches: S, schema: SchemaRef, txn: &Txn, metadata: Value) -> StepResult<Appended>
where
    S: futures::Stream<Item = StepResult<RecordBatch>> + Send,
{
    append_idempotent_with(table, batches, schema, txn, move || metadata).await
}

/// [`append_idempotent`] with metadata computed after the last batch was
/// written (so it can name what only the data told: a row count).
///
/// The writer takes the table state the caller holds, the one whose schema
/// (`schema`) its rows were converted to, not a newer one: a concurrent call
/// may add a column meanwhile (bronze gaining a newer capture instance's
/// columns, `engine::switch::add_bronze_columns`), and rows without it would
/// not match a writer that has it (the write would fail). So the writer is
/// made before the table is refreshed. Files without the column are valid
/// Delta data (it reads as NULL there); the commit ([`commit_adds`]) is made
/// on the table's newest state, after the same "already applied" check, so
/// a column added during the read does not make it conflict either. The
/// stream's micro-batch does the same (`engine::stream::run_batch`).
pub async fn append_idempotent_with<S, F>(table: &mut DeltaTable, batches: S, schema: SchemaRef, txn: &Txn, metadata: F) -> StepResult<Appended>
where
    S: futures::Stream<Item = StepResult<RecordBatch>> + Send,
    F: FnOnce() -> Value,
{
    match write_files(table, batches, schema, txn).await? {
        Written::AlreadyApplied { found } => Ok(Appended::AlreadyApplied { found }),
        Written::Empty => Ok(Appended::Empty),
        Written::Files { adds, .. } => commit_adds(table, adds, txn, metadata()).await,
    }
}

/// What [`write_files`] wrote.
#[derive(Debug)]
pub enum Written {
    /// The table already holds the txn: nothing was written.
    AlreadyApplied { found: i64 },
    /// There were no rows: nothing was written.
    Empty,
    /// Data files, not committed: [`commit_adds`] makes them part of the
    /// table; files never committed are orphans Delta's VACUUM removes.
    Files { adds: Vec<deltalake::kernel::Add>, rows: usize },
}

/// The first half of [`append_idempotent_with`]: writes the batches to data
/// files (same writer rules) and returns their `Add` actions uncommitted, so
/// a caller can look at the target once more between its read and its
/// commit (a seed, whose read of a copy can take hours, decides again there).
pub async fn write_files<S>(table: &mut DeltaTable, batches: S, schema: SchemaRef, txn: &Txn) -> StepResult<Written>
where
    S: futures::Stream<Item = StepResult<RecordBatch>> + Send,
{
    let label = table.table_url().to_string();
    if table.snapshot().is_err() {
        // A table never loaded has no state to write with: load it first.
        table.update_state().await.map_err(StepError::delta(&label))?;
    }
    let mut writer = streaming_writer(table)?;
    table.update_state().await.map_err(StepError::delta(&label))?;
    if let Some(found) = applied(table, txn).await? {
        return Ok(Written::AlreadyApplied { found });
    }
    check_writer_columns(&writer, &schema, &label)?;
    let mut batches = std::pin::pin!(batches);
    let mut rows = 0usize;
    while let Some(batch) = batches.next().await {
        let batch = batch?;
        if batch.num_rows() > 0 {
            rows += batch.num_rows();
            writer.write(batch).await.map_err(StepError::delta(&label))?;
        }
    }
    if rows == 0 {
        return Ok(Written::Empty);
    }
    let adds = writer.flush().await.map_err(StepError::delta(&label))?;
    Ok(Written::Files { adds, rows })
}

/// The writer of [`append_idempotent_with`] must have the columns the rows
/// were converted to (`schema`): a caller that refreshed its table after it
/// read the schema would hand it a writer of other columns, and every write
/// would fail with Delta's schema mismatch. Said here, naming both, instead.
fn check_writer_columns(writer: &RecordBatchWriter, schema: &SchemaRef, label: &str) -> StepResult<()> {
    let names = |s: &deltalake::arrow::datatypes::Schema| -> Vec<String> {
        let mut v: Vec<String> = s.fields().iter().map(|f| f.name().to_lowercase()).collect();
        v.sort();
        v
    };
    let (rows, table) = (names(schema.as_ref()), names(writer.arrow_schema().as_ref()));
    if rows != table {
        return Err(StepError::Internal(format!(
            "rows for {label} were converted to the columns ({}), but the table state the writer was made from has ({})",
            rows.join(", "),
            table.join(", ")
        )));
    }
    Ok(())
}

/// The txn version the table already holds for `txn`'s app id, when it is
/// at or past `txn`'s: the commit this txn names is then applied.
async fn applied(table: &DeltaTable, txn: &Txn) -> StepResult<Option<i64>> {
    Ok(txn_version(table, &txn.app_id).await?.filter(|found| *found >= txn.version))
}

/// Commit properties that carry `metadata` twice: as an object under
/// `mssql_cdc` (what the engine reads back) and as text in Delta's own
/// `userMetadata` (what Spark's DESCRIBE HISTORY shows a person).
pub(crate) fn metadata_commit_properties(metadata: Value) -> CommitProperties {
    CommitProperties::default().with_metadata([("userMetadata".to_string(), json!(metadata.to_string())), ("mssql_cdc".to_string(), metadata)])
}

/// Commit properties of a step's commit: its metadata and its txn.
pub(crate) fn step_commit_properties(txn: &Txn, metadata: Value) -> CommitProperties {
    metadata_commit_properties(metadata).with_application_transaction(Transaction::new(&txn.app_id, txn.version))
}

/// After a failed commit: a concurrent writer may have committed the same
/// txn first, and then it is applied; otherwise the failure stands.
async fn applied_after_failure(table: &mut DeltaTable, txn: &Txn, label: &str, e: deltalake::DeltaTableError) -> StepResult<Appended> {
    table.update_state().await.map_err(StepError::delta(label))?;
    match applied(table, txn).await? {
        Some(found) => Ok(Appended::AlreadyApplied { found }),
        None => Err(StepError::delta(label)(e)),
    }
}

/// Commits the txn and `metadata` with no data: the outcome of a step that
/// read nothing (an empty micro-batch or wave), recorded in the table whose
/// txn decides it, so a concurrent call with the same txn finds it applied
/// instead of committing a second, different outcome. Same checks as
/// [`append_idempotent`].
pub async fn commit_no_rows(table: &mut DeltaTable, txn: &Txn, metadata: Value) -> StepResult<Appended> {
    commit_adds(table, Vec::new(), txn, metadata).await
}

/// Commits data files already written (by [`RecordBatchWriter`]s whose
/// `flush` returned these `Add` actions) in one commit with a txn, after the
/// same "already applied" check as [`append_idempotent`]. A chunked
/// snapshot's readers write their files while they read, so the wave's commit
/// is only this log entry: its cost does not grow with the wave's rows.
/// Files of an attempt that never commits are orphans Delta's VACUUM removes.
/// With no files the commit holds the txn and the metadata only (see
/// [`commit_no_rows`]): the txn is recorded all the same.
pub async fn commit_adds(table: &mut DeltaTable, adds: Vec<deltalake::kernel::Add>, txn: &Txn, metadata: Value) -> StepResult<Appended> {
    let label = table.table_url().to_string();
    table.update_state().await.map_err(StepError::delta(&label))?;
    if let Some(found) = applied(table, txn).await? {
        return Ok(Appended::AlreadyApplied { found });
    }
    let props = step_commit_properties(txn, metadata);
    match append_adds(table, adds, props, &label).await? {
        Ok(v) => {
            Ok(Appended::Committed { table_version: v })
        }
        Err(e) => applied_after_failure(table, txn, &label, e).await,
    }
}

/// Commits `adds` as one append with `props` on the table's loaded state
/// and reloads it: the commit's version, or the commit's own failure (the
/// caller decides what a refused commit means). Errors reading the state
/// are the outer ones.
async fn append_adds(
    table: &mut DeltaTable,
    adds: Vec<deltalake::kernel::Add>,
    props: CommitProperties,
    label: &str,
) -> StepResult<Result<i64, deltalake::DeltaTableError>> {
    use deltalake::kernel::transaction::CommitBuilder;
    use deltalake::protocol::{DeltaOperation, SaveMode};
    let actions: Vec<deltalake::kernel::Action> = adds.into_iter().map(deltalake::kernel::Action::Add).collect();
    let operation = DeltaOperation::Write { mode: SaveMode::Append, partition_by: None, predicate: None };
    let result = {
        let snapshot = table.snapshot().map_err(StepError::delta(label))?;
        CommitBuilder::from(props).with_actions(actions).build(Some(snapshot), table.log_store(), operation).await
    };
    match result {
        Ok(done) => {
            let v = done.version() as i64;
            table.update_state().await.map_err(StepError::delta(label))?;
            Ok(Ok(v))
        }
        Err(e) => Ok(Err(e)),
    }
}

/// What [`append_claiming`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    /// A new commit at this table version, holding the txn and every claim.
    Committed { table_version: i64 },
    /// The table already held the txn itself (version `found`).
    AlreadyApplied { found: i64 },
    /// The table holds one of the claims (its app id at or past the version
    /// claimed) and not the txn: a commit of another kind decided the
    /// outcome first. Nothing was committed.
    Taken { claim: Txn, found: i64 },
}

/// Appends facts-sized batches (held in memory) in one commit that carries
/// `txn` and, besides it, every txn of `claims`: the keys other steps commit
/// under when they decide the same outcome another way (a seed's completion
/// claims the keys of its generation's stream start and chunked open).
/// Delta refuses a commit when a concurrent winner wrote a txn app id it
/// writes too (delta-rs's conflict checker compares the two commits' app
/// ids), so of the commits that share a key exactly one lands, whichever
/// runs first, and the loser finds the key taken when it reads again.
pub async fn append_claiming(table: &mut DeltaTable, batches: Vec<RecordBatch>, txn: &Txn, claims: &[Txn], metadata: Value) -> StepResult<Claimed> {
    let label = table.table_url().to_string();
    if table.snapshot().is_err() {
        table.update_state().await.map_err(StepError::delta(&label))?;
    }
    let mut writer = streaming_writer(table)?;
    for b in batches {
        if b.num_rows() > 0 {
            writer.write(b).await.map_err(StepError::delta(&label))?;
        }
    }
    let adds = writer.flush().await.map_err(StepError::delta(&label))?;
    table.update_state().await.map_err(StepError::delta(&label))?;
    if let Some(c) = claim_outcome(table, txn, claims).await? {
        return Ok(c);
    }
    let mut props = step_commit_properties(txn, metadata);
    for c in claims {
        props = props.with_application_transaction(Transaction::new(&c.app_id, c.version));
    }
    match append_adds(table, adds, props, &label).await? {
        Ok(v) => {
            Ok(Claimed::Committed { table_version: v })
        }
        Err(e) => {
            table.update_state().await.map_err(StepError::delta(&label))?;
            match claim_outcome(table, txn, claims).await? {
                Some(c) => Ok(c),
                None => Err(StepError::delta(&label)(e)),
            }
        }
    }
}

/// The txn applied, or a claim taken; None when the commit may go ahead.
async fn claim_outcome(table: &DeltaTable, txn: &Txn, claims: &[Txn]) -> StepResult<Option<Claimed>> {
    if let Some(found) = applied(table, txn).await? {
        return Ok(Some(Claimed::AlreadyApplied { found }));
    }
    for c in claims {
        if let Some(found) = applied(table, c).await? {
            return Ok(Some(Claimed::Taken { claim: c.clone(), found }));
        }
    }
    Ok(None)
}

/// The data files commit `version` added that the table's loaded state
/// still holds (paths as the log stores them, decoded).
pub async fn files_of_commit_held(table: &DeltaTable, version: i64) -> StepResult<Vec<String>> {
    let label = table.table_url().to_string();
    let Some(bytes) = table.log_store().read_commit_entry(version as u64).await.map_err(StepError::delta(&label))? else {
        return Err(StepError::NeedsPerson(format!(
            "commit {version} of {label} is no longer in the Delta log, so the files it added cannot be named: remove its rows by hand"
        )));
    };
    let mut added = std::collections::HashSet::new();
    for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let a: Value = serde_json::from_slice(line).map_err(|e| StepError::Internal(format!("commit {version} of {label}: {e}")))?;
        if let Some(p) = a.get("add").and_then(|x| x.get("path")).and_then(Value::as_str) {
            added.insert(percent_encoding::percent_decode_str(p).decode_utf8_lossy().into_owned());
        }
    }
    let snapshot = table.snapshot().map_err(StepError::delta(&label))?;
    Ok(snapshot.log_data().iter().map(|f| f.path().into_owned()).filter(|p| added.contains(p)).collect())
}

/// Removes, in one commit, the data files commit `version` added that the
/// table still holds: the undo of a step's own commit whose outcome a
/// commit of another kind decided first (a seed whose completion lost to a
/// stream start). Idempotent by content: a rerun finds fewer files (none:
/// nothing is committed), and when a concurrent undo removed them first,
/// Delta refuses this commit and the retry finds none. Returns the number
/// of files removed.
pub async fn remove_files_of_commit(table: &mut DeltaTable, version: i64, metadata: Value) -> StepResult<usize> {
    use deltalake::kernel::transaction::CommitBuilder;
    use deltalake::protocol::DeltaOperation;
    let label = table.table_url().to_string();
    for _attempt in 0..5 {
        table.update_state().await.map_err(StepError::delta(&label))?;
        let held: std::collections::HashSet<String> = files_of_commit_held(table, version).await?.into_iter().collect();
        if held.is_empty() {
            return Ok(0);
        }
        let removes: Vec<deltalake::kernel::Action> = {
            let snapshot = table.snapshot().map_err(StepError::delta(&label))?;
            snapshot.log_data().iter().filter(|f| held.contains(f.path().as_ref())).map(|f| deltalake::kernel::Action::Remove(f.remove_action(true))).collect()
        };
        let n = removes.len();
        let props = metadata_commit_properties(metadata.clone());
        let result = {
            let snapshot = table.snapshot().map_err(StepError::delta(&label))?;
            CommitBuilder::from(props).with_actions(removes).build(Some(snapshot), table.log_store(), DeltaOperation::Delete { predicate: None }).await
        };
        match result {
            Ok(_) => {
                table.update_state().await.map_err(StepError::delta(&label))?;
                return Ok(n);
            }
            // A concurrent undo removed them first (Delta's delete-delete
            // conflict), or another commit raced this one: look again.
            Err(e) => tracing::warn!(error = %e, version, "removing the files of a commit met a concurrent commit: looking again"),
        }
    }
    Err(StepError::Temporary(format!("could not remove the files of commit {version} of {label} against concurrent commits: call again")))
}

/// Appends batches in one commit without a txn: for rows written once per
/// attempt by design (a full snapshot's open row), never for a step's effect.
pub async fn append_untracked(table: &mut DeltaTable, batches: Vec<RecordBatch>, metadata: Value) -> StepResult<()> {
    let label = table.table_url().to_string();
    table.update_state().await.map_err(StepError::delta(&label))?;
    let props = metadata_commit_properties(metadata);
    let mut writer = RecordBatchWriter::for_table(table).map_err(StepError::delta(&label))?.with_commit_properties(props);
    for b in batches {
        writer.write(b).await.map_err(StepError::delta(&label))?;
    }
    writer.flush_and_commit(table).await.map_err(StepError::delta(&label))?;
    Ok(())
}

/// Appends batches held in memory (see [`append_idempotent`]).
pub async fn append_batches(table: &mut DeltaTable, batches: Vec<RecordBatch>, schema: SchemaRef, txn: &Txn, metadata: Value) -> StepResult<Appended> {
    append_idempotent(table, futures::stream::iter(batches.into_iter().map(Ok)), schema, txn, metadata).await
}

/// Runs a SQL query over the table (registered as `t`) and collects the result.
pub async fn query(table: &DeltaTable, sql: &str) -> StepResult<Vec<RecordBatch>> {
    let ctx = session_for(table).await?;
    let label = table.table_url().to_string();
    let df = ctx.sql(sql).await.map_err(|e| StepError::Internal(format!("query on {label} failed to plan: {e}\n{sql}")))?;
    let batches = df.collect().await.map_err(|e| StepError::Temporary(format!("query on {label} failed: {e}")))?;
    batches.iter().map(plain_types).collect()
}

/// Casts DataFusion's view types (Utf8View, BinaryView) back to the plain
/// types the rest of the code reads, so readers need one code path.
pub fn plain_types(batch: &RecordBatch) -> StepResult<RecordBatch> {
    use deltalake::arrow::datatypes::{DataType, Field, Schema};
    let schema = batch.schema();
    if !schema.fields().iter().any(|f| matches!(f.data_type(), DataType::Utf8View | DataType::BinaryView | DataType::LargeUtf8)) {
        return Ok(batch.clone());
    }
    let mut fields = Vec::with_capacity(schema.fields().len());
    let mut cols = Vec::with_capacity(schema.fields().len());
    for (f, c) in schema.fields().iter().zip(batch.columns()) {
        let to = match f.data_type() {
            DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
            DataType::BinaryView => DataType::Binary,
            other => other.clone(),
        };
        let c = if &to != f.data_type() {
            deltalake::arrow::compute::cast(c, &to).map_err(|e| StepError::Internal(format!("cast {}: {e}", f.name())))?
        } else {
            c.clone()
        };
        fields.push(Field::new(f.name(), to, f.is_nullable()).with_metadata(f.metadata().clone()));
        cols.push(c);
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).map_err(|e| StepError::Internal(format!("batch: {e}")))
}

/// Runs a SQL query over the table (registered as `t`) as a stream of batches.
pub async fn query_stream(
    table: &DeltaTable,
    sql: &str,
) -> StepResult<deltalake::datafusion::physical_plan::SendableRecordBatchStream> {
    let ctx = session_for(table).await?;
    let label = table.table_url().to_string();
    let df = ctx.sql(sql).await.map_err(|e| StepError::Internal(format!("query on {label} failed to plan: {e}\n{sql}")))?;
    df.execute_stream().await.map_err(|e| StepError::Temporary(format!("query on {label} failed: {e}")))
}

/// A DataFrame of a SQL query over `table` (registered as `t`), with the
/// session that can execute it (it knows the table's object store): a MERGE
/// reading bronze into silver runs its plan in that session.
pub async fn dataframe(
    table: &DeltaTable,
    sql: &str,
) -> StepResult<(deltalake::datafusion::prelude::DataFrame, deltalake::datafusion::execution::context::SessionState)> {
    let ctx = session_for(table).await?;
    let label = table.table_url().to_string();
    let df = ctx.sql(sql).await.map_err(|e| StepError::Internal(format!("query on {label} failed to plan: {e}\n{sql}")))?;
    Ok((df, ctx.state()))
}

async fn session_for(table: &DeltaTable) -> StepResult<SessionContext> {
    let label = table.table_url().to_string();
    let ctx = deltalake::delta_datafusion::create_session().into_inner();
    table.update_datafusion_session(&ctx.state()).map_err(StepError::delta(&label))?;
    let provider = table.table_provider().await.map_err(|e| StepError::Internal(format!("table provider for {label}: {e}")))?;
    ctx.register_table("t", provider).map_err(|e| StepError::Internal(format!("register {label}: {e}")))?;
    Ok(ctx)
}

/// Quotes a string literal for the SQL of [`query`].
pub fn sql_str(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The commit metadata (`mssql_cdc` of commitInfo) of one table version, if
/// that commit is still in the log.
pub async fn commit_metadata(table: &DeltaTable, version: i64) -> StepResult<Option<Value>> {
    let label = table.table_url().to_string();
    let bytes = match table.log_store().read_commit_entry(version as u64).await.map_err(StepError::delta(&label))? {
        Some(b) => b,
        None => return Ok(None),
    };
    for line in bytes.split(|b| *b == b'\n') {
        if line.is_empty() {
            continue;
        }
        let v: Value = serde_json::from_slice(line).map_err(|e| StepError::Internal(format!("commit {version} of {label}: {e}")))?;
        if let Some(ci) = v.get("commitInfo") {
            return Ok(ci.get("mssql_cdc").cloned());
        }
    }
    Ok(None)
}

/// The table version whose commit carries this txn (newest first search).
pub async fn find_txn_commit(table: &DeltaTable, txn: &Txn) -> StepResult<Option<(i64, Value)>> {
    let label = table.table_url().to_string();
    let mut v = table.version().map(|v| v as i64).unwrap_or(-1);
    while v >= 0 {
        let bytes = match table.log_store().read_commit_entry(v as u64).await {
            Ok(Some(b)) => b,
            // Older commits were cleaned up (a checkpoint stands in for them).
            Ok(None) | Err(deltalake::DeltaTableError::InvalidVersion(_)) => break,
            Err(e) => return Err(StepError::delta(&label)(e)),
        };
        let mut found = false;
        let mut meta = Value::Null;
        for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let a: Value = serde_json::from_slice(line).map_err(|e| StepError::Internal(format!("commit {v} of {label}: {e}")))?;
            if let Some(t) = a.get("txn") {
                if t.get("appId").and_then(Value::as_str) == Some(txn.app_id.as_str())
                    && t.get("version").and_then(Value::as_i64) == Some(txn.version)
                {
                    found = true;
                }
            }
            if let Some(ci) = a.get("commitInfo") {
                meta = ci.get("mssql_cdc").cloned().unwrap_or(Value::Null);
            }
        }
        if found {
            return Ok(Some((v, meta)));
        }
        v -= 1;
    }
    Ok(None)
}

/// A shared, reference-counted schema.
pub type Schema = Arc<deltalake::arrow::datatypes::Schema>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;
    use crate::types::{BatchBuilder, ColumnDesc, SqlType, SqlValue};
    use deltalake::arrow::array::{Array, Int64Array};

    /// The full snapshot's race (and the seed's, which appends the same way):
    /// the rows are converted to bronze's schema as the call holds it
    /// (`Context::bronze_schema`), then appended. A concurrent call that
    /// gives bronze a newer capture instance's column in between
    /// (`engine::switch::add_bronze_columns`) must not make the append fail:
    /// the writer takes the table state the rows were converted with, and the
    /// commit lands on the newest table, where the added column reads NULL
    /// in these rows. Before the writer took that state it was made after a
    /// refresh, had the added column, and the write failed on the rows
    /// without it (Delta's schema mismatch).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_append_writes_with_the_schema_its_rows_were_converted_to_when_a_concurrent_call_adds_a_column() {
        let dir = tempfile::tempdir().unwrap();
        let location = dir.path().join("bronze").to_string_lossy().into_owned();
        let storage = HashMap::new();
        let older = vec![ColumnDesc::new("id", SqlType::Int, false), ColumnDesc::new("v", SqlType::Int, true)];
        let mut ours = open_or_create(&location, &storage, TableKind::Bronze, &bronze::schema(&older), "test bronze").await.unwrap();
        // What a full snapshot converts its rows to.
        let schema = ours.snapshot().unwrap().snapshot().arrow_schema();
        // Another call adds a newer instance's column to bronze meanwhile.
        let mut newer = older.clone();
        newer.push(ColumnDesc::new("added", SqlType::Int, true));
        let wanted = commented_schema(TableKind::Bronze, &bronze::schema(&newer)).unwrap();
        let existing: Vec<String> = schema.fields().iter().map(|f| f.name().to_string()).collect();
        let new_fields: Vec<StructField> = wanted.fields().filter(|f| !existing.contains(f.name())).cloned().collect();
        assert_eq!(new_fields.len(), 1, "the newer instance adds one column");
        let theirs = open_existing(&location, &storage).await.unwrap().expect("the table exists");
        theirs.add_columns().with_fields(new_fields).await.unwrap();
        // The snapshot's rows, read with the older columns and converted to `schema`.
        let mut read = BatchBuilder::new(&older);
        for id in 1..=3i64 {
            read.push(&[SqlValue::Int(id), SqlValue::Int(id * 10)]).unwrap();
        }
        let stamp = bronze::SnapshotStamp {
            snapshot: Lsn::from_u128(42),
            start_lsn: Lsn::from_u128(42),
            commit_ts: None,
            capture_instance: "dbo_t".into(),
            chunk: None,
        };
        let rows = bronze::from_snapshot(&read.finish(), &schema, &stamp).unwrap();
        let batches = futures::stream::iter(vec![Ok::<RecordBatch, StepError>(rows)]);
        let appended = append_idempotent_with(&mut ours, batches, schema.clone(), &Txn::new("test#snapshot", 0), || json!({"kind": "snapshot"}))
            .await
            .unwrap();
        assert!(appended.committed(), "{appended:?}");
        // Committed on the newest table: it has the added column, NULL in these rows.
        let names: Vec<String> = ours.snapshot().unwrap().snapshot().arrow_schema().fields().iter().map(|f| f.name().to_string()).collect();
        assert!(names.iter().any(|n| n == "added"), "{names:?}");
        let b = query(&ours, "SELECT COUNT(*) AS n, COUNT(added) AS a, SUM(CAST(v AS BIGINT)) AS s FROM t").await.unwrap();
        let col = |i: usize| b[0].column(i).as_any().downcast_ref::<Int64Array>().unwrap().value(0);
        assert_eq!((col(0), col(1), col(2)), (3, 0, 60));
        // The txn is recorded: the same append again is already applied.
        let again = append_idempotent_with(&mut ours, futures::stream::iter(Vec::<StepResult<RecordBatch>>::new()), schema, &Txn::new("test#snapshot", 0), || json!({}))
            .await
            .unwrap();
        assert!(matches!(again, Appended::AlreadyApplied { found: 0 }), "{again:?}");
    }

    fn facts_row(app: &str, event: &str) -> crate::delta::facts::FactRow {
        crate::delta::facts::FactRow { app_id: app.into(), table: "dbo.t".into(), target: "bronze".into(), event: Some(event.into()), ..Default::default() }
    }

    /// `append_claiming`'s exclusion rests on delta-rs refusing a commit whose
    /// txn app ids a commit that landed after the loser's read also wrote.
    /// Two callers read the table, both find the key free, one commits; the
    /// other's commit, built on the state it read, must fail, and
    /// `append_claiming` must then report the key taken and commit nothing.
    /// A key none of them share does not conflict.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn commits_sharing_a_txn_key_land_once_whoever_read_first() {
        use deltalake::kernel::transaction::CommitBuilder;
        use deltalake::protocol::{DeltaOperation, SaveMode};
        let dir = tempfile::tempdir().unwrap();
        let location = dir.path().join("facts").to_string_lossy().into_owned();
        let storage = HashMap::new();
        let mut winner = open_or_create(&location, &storage, TableKind::Facts, &crate::delta::facts::schema(), "test facts").await.unwrap();
        let loser = open_existing(&location, &storage).await.unwrap().unwrap();
        // The winner: a stream start under its own key.
        let start = Txn::new("t#start", 0);
        let done = append_claiming(&mut winner, vec![crate::delta::facts::to_batch(&[facts_row("t", "stream_start")])], &start, &[], json!({})).await.unwrap();
        assert!(matches!(done, Claimed::Committed { .. }), "{done:?}");
        // The loser read before it: a commit built on that state with the
        // same key (as a seed's completion claims it) is refused by Delta.
        let stale = loser.snapshot().unwrap();
        let props = step_commit_properties(&Txn::new("t#events", 0), json!({})).with_application_transaction(Transaction::new("t#start", 0));
        let refused = CommitBuilder::from(props)
            .with_actions(vec![])
            .build(Some(stale), loser.log_store(), DeltaOperation::Write { mode: SaveMode::Append, partition_by: None, predicate: None })
            .await;
        assert!(refused.is_err(), "a commit sharing a txn key with one that landed after its read must conflict");
        // Through append_claiming, the loser finds the key taken and writes nothing.
        let mut loser = loser;
        let claimed = append_claiming(&mut loser, vec![crate::delta::facts::to_batch(&[facts_row("t", "bootstrap")])], &Txn::new("t#events", 0), &[start.clone()], json!({}))
            .await
            .unwrap();
        assert_eq!(claimed, Claimed::Taken { claim: start, found: 0 });
        assert_eq!(txn_version(&loser, "t#events").await.unwrap(), None, "the loser's own key is not recorded");
        let rows = query(&loser, "SELECT event FROM t").await.unwrap();
        assert_eq!(rows.iter().map(|b| b.num_rows()).sum::<usize>(), 1, "only the winner's row");
        // A commit of another key, built on a stale state, lands.
        let stale = loser.snapshot().unwrap().clone();
        winner.update_state().await.unwrap();
        append_claiming(&mut winner, vec![crate::delta::facts::to_batch(&[facts_row("t", "x")])], &Txn::new("t#facts", 0), &[], json!({})).await.unwrap();
        let other = CommitBuilder::from(step_commit_properties(&Txn::new("u#facts", 0), json!({})))
            .with_actions(vec![])
            .build(Some(&stale), loser.log_store(), DeltaOperation::Write { mode: SaveMode::Append, partition_by: None, predicate: None })
            .await;
        assert!(other.is_ok(), "commits with no key in common do not conflict: {:?}", other.err());
    }

    /// The undo of a commit removes exactly its files, once: a second undo
    /// finds none, and another commit's files stay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn removing_a_commits_files_takes_only_its_own_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let location = dir.path().join("facts").to_string_lossy().into_owned();
        let mut t = open_or_create(&location, &HashMap::new(), TableKind::Facts, &crate::delta::facts::schema(), "test facts").await.unwrap();
        let keep = append_batches(&mut t, vec![crate::delta::facts::to_batch(&[facts_row("t", "keep")])], crate::delta::facts::schema(), &Txn::new("t#a", 0), json!({})).await.unwrap();
        let Appended::Committed { table_version: gone } =
            append_batches(&mut t, vec![crate::delta::facts::to_batch(&[facts_row("t", "gone"), facts_row("t", "gone")])], crate::delta::facts::schema(), &Txn::new("t#b", 0), json!({})).await.unwrap()
        else {
            panic!("no commit")
        };
        assert!(keep.committed());
        assert_eq!(files_of_commit_held(&t, gone).await.unwrap().len(), 1);
        assert_eq!(remove_files_of_commit(&mut t, gone, json!({"kind": "undo"})).await.unwrap(), 1);
        assert_eq!(remove_files_of_commit(&mut t, gone, json!({"kind": "undo"})).await.unwrap(), 0, "a rerun removes nothing");
        let mut events = Vec::new();
        for b in query(&t, "SELECT event FROM t").await.unwrap() {
            let b = plain_types(&b).unwrap();
            let a = b.column(0).as_any().downcast_ref::<deltalake::arrow::array::StringArray>().unwrap();
            events.extend((0..a.len()).map(|i| a.value(i).to_string()));
        }
        assert_eq!(events, vec!["keep".to_string()]);
        // The txn the undone commit carried stays recorded: its key is spent.
        assert_eq!(txn_version(&t, "t#b").await.unwrap(), Some(0));
    }
}
