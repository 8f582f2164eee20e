//! The simulator's storage and its administrative side: the SQLite schema,
//! table creation, writes, the capture job, cleanup, schema changes,
//! configuration, faults and status.
//!
//! Everything lives in one SQLite file opened in WAL mode, so several
//! processes can write and read it at once. Writers take the SQLite write
//! lock up front (`BEGIN IMMEDIATE`); readers hold a read transaction, which
//! in WAL mode is a consistent snapshot.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Timelike, Utc};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};

use crate::lsn::Lsn;
use crate::source::{CaptureInstance, ServerZone, SourceError, TableName, ZoneKind};
use crate::types::{ColumnDesc, Key, SqlType, SqlValue};

use super::keys;

/// Marks a SQLite file as a simulator database.
pub(crate) const MAGIC: &str = "mssql-cdc-sim/1";
/// The first LSN handed out in a new file (VLF 0x2a, block 0x10, slot 0).
const FIRST_LSN: (u32, u32, u16) = (0x2a, 0x10, 0);
/// 1/300 s ticks per second: datetime's grid.
pub(crate) const TICKS_PER_SEC: i64 = 300;

/// What can go wrong using the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("simulator database {path}: SQLite error: {source}")]
    Sqlite { path: String, source: rusqlite::Error },
    #[error("{0} already exists; delete it or ask for overwrite (--overwrite) to start a new simulator database")]
    Exists(PathBuf),
    #[error("{0} is not a simulator database ({1}); create one with `mssql-cdc sim create --db PATH`")]
    NotASimFile(PathBuf, String),
    #[error("table {0} does not exist in the simulator; create it first (sim create --table ...)")]
    NoSuchTable(String),
    #[error("table {0} already exists in the simulator")]
    TableExists(String),
    #[error("table {table} has no column '{column}'")]
    NoSuchColumn { table: String, column: String },
    #[error("capture instance '{0}' does not exist")]
    NoSuchInstance(String),
    #[error("capture instance '{0}' already exists; choose another name")]
    InstanceExists(String),
    #[error("table {0} already has two capture instances (SQL Server's limit); drop one first (sim alter --drop-instance NAME)")]
    TooManyInstances(String),
    #[error("violation of the unique key of {table}: the key {key} is already present (keys compare case-insensitively, ignoring trailing spaces)")]
    DuplicateKey { table: String, key: String },
    #[error("table {table} has no row with key {key}")]
    RowNotFound { table: String, key: String },
    #[error("table {table}, column '{column}': {message}")]
    BadValue { table: String, column: String, message: String },
    #[error("{0}")]
    BadArgument(String),
    #[error("simulator configuration: {0}")]
    Config(String),
    #[error("simulator database holds malformed data: {0}")]
    Corrupt(String),
    #[error("I/O error on {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

pub type Result<T, E = SimError> = std::result::Result<T, E>;

impl From<SimError> for SourceError {
    fn from(e: SimError) -> SourceError {
        match &e {
            SimError::Sqlite { source, .. } => match source.sqlite_error_code() {
                Some(rusqlite::ErrorCode::DatabaseBusy) | Some(rusqlite::ErrorCode::DatabaseLocked) => {
                    SourceError::Transient(e.to_string())
                }
                _ => SourceError::Other(e.to_string()),
            },
            SimError::NotASimFile(..)
            | SimError::NoSuchTable(_)
            | SimError::NoSuchColumn { .. }
            | SimError::NoSuchInstance(_)
            | SimError::Config(_)
            | SimError::BadArgument(_) => SourceError::Config(e.to_string()),
            _ => SourceError::Other(e.to_string()),
        }
    }
}

/// Wraps SQLite errors with the file they concern.
pub(crate) trait SqlCtx<T> {
    fn ctx(self, path: &Path) -> Result<T>;
}

impl<T> SqlCtx<T> for rusqlite::Result<T> {
    fn ctx(self, path: &Path) -> Result<T> {
        self.map_err(|source| SimError::Sqlite { path: path.display().to_string(), source })
    }
}

/// How the simulator's clock runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Clock {
    /// The machine's clock.
    Wall,
    /// A clock that starts at `start` and moves only when a transaction
    /// commits (by `tick_ms`) or when told to ([`SimDb::advance_clock`]).
    Manual { start: DateTime<Utc>, tick_ms: u64 },
}

/// The simulated server's settings, stored in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SimConfig {
    pub clock: Clock,
    /// The server's zone: an IANA name (`America/Sao_Paulo`), `UTC`, or a fixed offset (`UTC-03:00`).
    pub time_zone: String,
    /// The rules the server's clock actually follows, when they are not what
    /// `time_zone` means in the IANA database (a Windows server without a
    /// time-zone update still applying an abolished DST, say): an IANA name or
    /// a fixed offset. The server still reports `time_zone` as its zone; its
    /// commit times and its own conversions (`server_local_times`) follow
    /// these rules. None: `time_zone`'s.
    pub zone_rules: Option<String>,
    /// How long after its commit a transaction becomes visible to the capture job.
    pub capture_lag_ms: u64,
    /// Cleanup's default retention, in minutes (SQL Server's default is 4320).
    pub retention_minutes: u64,
    /// ALLOW_SNAPSHOT_ISOLATION.
    pub allow_snapshot_isolation: bool,
    /// The most rows per second one stream delivers (None: unlimited).
    pub conn_rows_per_s: Option<u64>,
    /// A delay every source call starts with.
    pub query_latency_ms: u64,
    /// When > 0, an idle capture scan writes a mapping row (tran_id 0x00)
    /// once this many seconds have passed since the last mapping row.
    pub idle_interval_seconds: u64,
    /// How long a locking read waits behind a writer's lock before it fails
    /// with error 1222 (`SET LOCK_TIMEOUT`, or the client's command timeout,
    /// on a real server). None: it waits until the lock is let go.
    pub lock_timeout_ms: Option<u64>,
    /// When set, the capture job also runs cleanup this often.
    pub auto_cleanup_interval_minutes: Option<u64>,
    /// Seed for anything random the simulator does itself.
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            clock: Clock::Wall,
            time_zone: "UTC".into(),
            zone_rules: None,
            capture_lag_ms: 0,
            retention_minutes: 4320,
            allow_snapshot_isolation: false,
            conn_rows_per_s: None,
            query_latency_ms: 0,
            idle_interval_seconds: 0,
            lock_timeout_ms: None,
            auto_cleanup_interval_minutes: None,
            seed: 0,
        }
    }
}

impl SimConfig {
    /// The server zone the configuration names (what the server reports).
    pub fn zone(&self) -> Result<ServerZone> {
        parse_zone(&self.time_zone)
    }

    /// The rules the server's clock runs on: `zone_rules` when set, else the zone's own.
    pub fn clock_zone(&self) -> Result<ServerZone> {
        match &self.zone_rules {
            Some(rules) => parse_zone(rules),
            None => self.zone(),
        }
    }
}

/// The simulated server's wall-clock reading of an instant under `rules`: its
/// own conversion, as SQL Server's `AT TIME ZONE` is its own. The engine never
/// applies these rules to a time it looks up; it asks the source.
pub(crate) fn wall_clock(rules: &ServerZone, t: DateTime<Utc>) -> NaiveDateTime {
    match &rules.kind {
        ZoneKind::Named(tz) => t.with_timezone(tz).naive_local(),
        ZoneKind::Fixed(secs) => t.naive_utc() + chrono::Duration::seconds(*secs as i64),
    }
}

/// Parses `UTC`, `UTC+02:00` / `UTC-3` style offsets, or an IANA zone name.
pub fn parse_zone(text: &str) -> Result<ServerZone> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("utc") || t.eq_ignore_ascii_case("z") {
        return Ok(ServerZone::utc());
    }
    let upper = t.to_ascii_uppercase();
    let rest = upper.strip_prefix("UTC").or_else(|| upper.strip_prefix("GMT"));
    if let Some(rest) = rest {
        if let Some(sign) = rest.chars().next().filter(|c| *c == '+' || *c == '-') {
            let body = &rest[1..];
            let (h, m) = match body.split_once(':') {
                Some((h, m)) => (h.parse::<i32>().ok(), m.parse::<i32>().ok()),
                None => (body.parse::<i32>().ok(), Some(0)),
            };
            if let (Some(h), Some(m)) = (h, m) {
                if h <= 14 && m < 60 {
                    let secs = (h * 3600 + m * 60) * if sign == '-' { -1 } else { 1 };
                    let name = format!("UTC{}{:02}:{:02}", sign, h, m);
                    return Ok(ServerZone { name, kind: ZoneKind::Fixed(secs) });
                }
            }
            return Err(SimError::Config(format!("'{text}' is not a UTC offset; write it as UTC+HH:MM or UTC-HH:MM")));
        }
    }
    match t.parse::<chrono_tz::Tz>() {
        Ok(tz) => Ok(ServerZone { name: tz.name().to_string(), kind: ZoneKind::Named(tz) }),
        Err(_) => Err(SimError::Config(format!(
            "'{text}' is not a time zone; use an IANA name such as America/Sao_Paulo, UTC, or an offset such as UTC-03:00"
        ))),
    }
}

/// A table to create.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableSpec {
    pub name: TableName,
    pub columns: Vec<ColumnDesc>,
    /// Primary key columns in key order; empty for a heap.
    pub primary_key: Vec<String>,
    /// An optional unique index (the row identity when there is no primary key).
    #[serde(default)]
    pub unique_index: Vec<String>,
    /// Collation names of string columns, by column name; a string column
    /// not named here has [`super::collation::DEFAULT_COLLATION`].
    #[serde(default)]
    pub collations: std::collections::BTreeMap<String, String>,
}

impl TableSpec {
    /// The collation name of a string column (None for other types).
    pub fn collation_name(&self, column: &str) -> Option<String> {
        let c = self.columns.iter().find(|c| c.name.eq_ignore_ascii_case(column))?;
        if !c.sql_type.is_string() {
            return None;
        }
        Some(
            self.collations
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(column))
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| super::collation::DEFAULT_COLLATION.to_string()),
        )
    }

    /// The sort-key description of column `i` (its collation when a string).
    pub(crate) fn key_col(&self, i: usize) -> keys::KeyCol {
        let c = &self.columns[i];
        // Names are checked when the table is created; an unknown one (a file
        // from an older simulator) falls back to the default collation.
        let collation = self.collation_name(&c.name).map(|n| {
            super::collation::collation(&n)
                .unwrap_or_else(|_| super::collation::collation(super::collation::DEFAULT_COLLATION).expect("default collation"))
        });
        keys::KeyCol { ty: c.sql_type.clone(), collation }
    }
}

/// A fault to inject into the next reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultSpec {
    pub on: FaultOn,
    /// Rows the stream delivers before it fails.
    pub after_rows: u64,
    /// How many reads fail.
    pub times: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum FaultOn {
    Snapshot,
    Changes,
    Any,
}

impl FaultOn {
    fn as_str(self) -> &'static str {
        match self {
            FaultOn::Snapshot => "snapshot",
            FaultOn::Changes => "changes",
            FaultOn::Any => "any",
        }
    }
}

/// What one capture scan did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CaptureReport {
    /// Committed transactions harvested from the pending log.
    pub transactions: u64,
    /// Change rows written, all instances together.
    pub change_rows: u64,
    /// Mapping rows written (one per transaction that touched a captured table, plus idle rows).
    pub mapping_rows: u64,
    pub idle_rows: u64,
    /// Transactions still waiting (committed less than the capture lag ago).
    pub pending_left: u64,
    pub max_lsn: Option<Lsn>,
    pub cleanup: Option<CleanupReport>,
}

/// What one cleanup did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CleanupReport {
    /// The low watermark applied (None when the mapping is empty).
    pub watermark: Option<Lsn>,
    /// (instance, start_lsn before, start_lsn after).
    pub instances: Vec<(String, Option<Lsn>, Option<Lsn>)>,
    pub change_rows_deleted: u64,
    pub mapping_rows_deleted: u64,
}

/// A table's definition with the positions of its key columns resolved.
#[derive(Debug, Clone)]
pub(crate) struct TableMeta {
    pub id: i64,
    pub spec: TableSpec,
    /// Each column's id (SQL Server's `column_id`), aligned with
    /// `spec.columns`: assigned once and never reused, kept by a rename and
    /// a type change, so it names a column whatever it is called now.
    pub column_ids: Vec<i64>,
    /// Positions of the columns rows are ordered and found by (PK, else the unique index).
    pub key_cols: Vec<usize>,
    /// Positions of the unique index columns when it is separate from the PK.
    pub uk_cols: Vec<usize>,
    /// True when some capture instance covers the table.
    pub captured: bool,
}

impl TableMeta {
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.spec.columns.iter().position(|c| c.name.eq_ignore_ascii_case(name))
    }

    /// The position of the column with id `column_id`, while the table has it.
    pub fn column_index_by_id(&self, column_id: i64) -> Option<usize> {
        self.column_ids.iter().position(|&id| id == column_id)
    }

    /// The key columns' sort-key descriptions.
    pub fn key_types(&self) -> Vec<keys::KeyCol> {
        self.key_cols.iter().map(|&i| self.spec.key_col(i)).collect()
    }

    /// The identity columns the catalog reports (PK, else unique index).
    pub fn unique_key(&self) -> Vec<String> {
        self.key_cols.iter().map(|&i| self.spec.columns[i].name.clone()).collect()
    }

    pub fn is_heap(&self) -> bool {
        self.key_cols.is_empty()
    }

    /// The sort key of a row (for keyed tables).
    pub fn row_sort_key(&self, row: &[SqlValue]) -> Vec<u8> {
        let vals: Vec<SqlValue> = self.key_cols.iter().map(|&i| row[i].clone()).collect();
        keys::encode_key(&self.key_types(), &vals)
    }

    fn row_unique_key(&self, row: &[SqlValue]) -> Option<Vec<u8>> {
        if self.uk_cols.is_empty() {
            return None;
        }
        let vals: Vec<SqlValue> = self.uk_cols.iter().map(|&i| row[i].clone()).collect();
        let types: Vec<keys::KeyCol> = self.uk_cols.iter().map(|&i| self.spec.key_col(i)).collect();
        Some(keys::encode_key(&types, &vals))
    }

    /// Decodes a stored row, padding columns added since it was written with NULL.
    pub fn decode_row(&self, data: &str) -> Result<Vec<SqlValue>> {
        let mut row: Vec<SqlValue> = serde_json::from_str(data).map_err(|e| SimError::Corrupt(format!("row of {}: {e}", self.spec.name)))?;
        row.resize(self.spec.columns.len(), SqlValue::Null);
        Ok(row)
    }
}

fn resolve_cols(spec: &TableSpec, names: &[String]) -> Result<Vec<usize>> {
    names
        .iter()
        .map(|n| {
            spec.columns
                .iter()
                .position(|c| c.name.eq_ignore_ascii_case(n))
                .ok_or_else(|| SimError::NoSuchColumn { table: spec.name.to_string(), column: n.clone() })
        })
        .collect()
}

pub(crate) fn table_meta(id: i64, spec: TableSpec, column_ids: Vec<i64>, captured: bool) -> Result<TableMeta> {
    if column_ids.len() != spec.columns.len() {
        return Err(SimError::Corrupt(format!(
            "table {} has {} columns but {} column ids",
            spec.name,
            spec.columns.len(),
            column_ids.len()
        )));
    }
    let pk = resolve_cols(&spec, &spec.primary_key)?;
    let ui = resolve_cols(&spec, &spec.unique_index)?;
    let (key_cols, uk_cols) = if pk.is_empty() { (ui, vec![]) } else { (pk, ui) };
    Ok(TableMeta { id, spec, column_ids, key_cols, uk_cols, captured })
}

/// The column ids stored with a table (`src_tables.column_ids`, a JSON
/// array); a file written before ids were kept has NULL there, and its
/// columns get 1..n in column order, as a table created then would have.
fn parse_column_ids(text: Option<&str>, spec: &TableSpec) -> Result<Vec<i64>> {
    match text {
        None => Ok((1..=spec.columns.len() as i64).collect()),
        Some(t) => serde_json::from_str(t).map_err(|e| SimError::Corrupt(format!("column ids of {}: {e}", spec.name))),
    }
}

fn load_table(id: i64, spec: &str, column_ids: Option<&str>, captured: bool) -> Result<TableMeta> {
    let spec: TableSpec = serde_json::from_str(spec).map_err(|e| SimError::Corrupt(format!("table spec: {e}")))?;
    let ids = parse_column_ids(column_ids, &spec)?;
    table_meta(id, spec, ids, captured)
}

/// Writes a table's definition and its column ids back.
fn save_table(conn: &Connection, path: &Path, t: &TableMeta) -> Result<()> {
    conn.execute(
        "UPDATE src_tables SET spec = ?2, column_ids = ?3 WHERE id = ?1",
        params![t.id, serde_json::to_string(&t.spec).expect("spec serialises"), serde_json::to_string(&t.column_ids).expect("ids serialise")],
    )
    .ctx(path)?;
    Ok(())
}

/// For each captured column whose id the table still has under another
/// name (compared ignoring ASCII case): captured name -> name now. A column
/// whose id is gone was dropped, not renamed.
fn renamed_columns(columns: &[ColumnDesc], column_ids: &[Option<i64>], t: &TableMeta) -> std::collections::BTreeMap<String, String> {
    columns
        .iter()
        .zip(column_ids)
        .filter_map(|(c, id)| {
            let now = &t.spec.columns[t.column_index_by_id((*id)?)?].name;
            (!now.eq_ignore_ascii_case(&c.name)).then(|| (c.name.clone(), now.clone()))
        })
        .collect()
}

/// An instance as stored.
#[derive(Debug, Clone)]
pub(crate) struct InstanceRow {
    pub id: i64,
    pub table_id: i64,
    /// Whether the instance's change table (`cdc.<ci>_CT`) has
    /// `__$command_id`: false for a table created before KB3030352.
    pub ct_command_id: bool,
    pub created_lsn: Lsn,
    /// The source column id of each captured column, aligned with
    /// `info.columns`: the capture job reads values by id, as SQL Server's
    /// does, so a renamed column is still captured under its captured name.
    /// None where an instance stored before ids were kept names a column
    /// the table no longer has.
    pub column_ids: Vec<Option<i64>>,
    pub info: CaptureInstance,
}

// ---------------------------------------------------------------------------
// Connection helpers shared with the source.

const SCHEMA: &str = "
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE src_tables(id INTEGER PRIMARY KEY, schema_name TEXT NOT NULL, name TEXT NOT NULL,
    spec TEXT NOT NULL, heap_seq INTEGER NOT NULL DEFAULT 0, column_ids TEXT, next_column_id INTEGER);
CREATE UNIQUE INDEX src_tables_name ON src_tables(lower(schema_name), lower(name));
CREATE TABLE rows(table_id INTEGER NOT NULL, sk BLOB NOT NULL, uk BLOB, data TEXT NOT NULL,
    PRIMARY KEY(table_id, sk)) WITHOUT ROWID;
CREATE UNIQUE INDEX rows_uk ON rows(table_id, uk);
CREATE TABLE instances(id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE COLLATE NOCASE,
    table_id INTEGER NOT NULL, start_lsn BLOB, created_lsn BLOB NOT NULL,
    columns TEXT NOT NULL, index_columns TEXT NOT NULL, ct_command_id INTEGER NOT NULL DEFAULT 1, column_ids TEXT);
CREATE TABLE changes(instance_id INTEGER NOT NULL, start_lsn BLOB NOT NULL, command_id INTEGER NOT NULL,
    seqval BLOB NOT NULL, operation INTEGER NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY(instance_id, start_lsn, command_id, seqval, operation)) WITHOUT ROWID;
CREATE TABLE lsn_time_mapping(start_lsn BLOB PRIMARY KEY, tran_begin_ticks INTEGER NOT NULL,
    tran_end_ticks INTEGER NOT NULL, tran_id BLOB NOT NULL, tran_begin_lsn BLOB);
CREATE INDEX mapping_end ON lsn_time_mapping(tran_end_ticks);
CREATE TABLE pending(commit_lsn BLOB PRIMARY KEY, begin_lsn BLOB NOT NULL, begin_us INTEGER NOT NULL,
    commit_us INTEGER NOT NULL, ops TEXT NOT NULL);
CREATE TABLE locks(table_id INTEGER PRIMARY KEY, holder TEXT NOT NULL);
CREATE TABLE faults(id INTEGER PRIMARY KEY, on_kind TEXT NOT NULL, after_rows INTEGER NOT NULL,
    remaining INTEGER NOT NULL, error_number INTEGER);
";

/// Opens an existing simulator file with the settings every connection uses.
pub(crate) fn open_conn(path: &Path) -> Result<Connection> {
    if !path.is_file() {
        return Err(SimError::NotASimFile(path.to_path_buf(), "no such file".into()));
    }
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| SimError::NotASimFile(path.to_path_buf(), e.to_string()))?;
    setup_conn(&conn, path).map_err(|e| SimError::NotASimFile(path.to_path_buf(), e.to_string()))?;
    let magic: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE key = 'magic'", [], |r| r.get(0))
        .optional()
        .map_err(|e| SimError::NotASimFile(path.to_path_buf(), e.to_string()))?;
    if magic.as_deref() != Some(MAGIC) {
        return Err(SimError::NotASimFile(path.to_path_buf(), "no simulator marker in its meta table".into()));
    }
    Ok(conn)
}

fn setup_conn(conn: &Connection, path: &Path) -> Result<()> {
    conn.busy_timeout(Duration::from_secs(30)).ctx(path)?;
    conn.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA cache_size = -16000;").ctx(path)?;
    Ok(())
}

pub(crate) fn meta_get(conn: &Connection, path: &Path, key: &str) -> Result<Option<String>> {
    conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0)).optional().ctx(path)
}

pub(crate) fn meta_set(conn: &Connection, path: &Path, key: &str, value: &str) -> Result<()> {
    conn.execute("INSERT INTO meta(key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = excluded.value", [key, value])
        .ctx(path)?;
    Ok(())
}

pub(crate) fn load_config(conn: &Connection, path: &Path) -> Result<SimConfig> {
    let text = meta_get(conn, path, "config")?.ok_or_else(|| SimError::Corrupt("no config".into()))?;
    serde_json::from_str(&text).map_err(|e| SimError::Corrupt(format!("config: {e}")))
}

fn meta_i64(conn: &Connection, path: &Path, key: &str) -> Result<Option<i64>> {
    match meta_get(conn, path, key)? {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| SimError::Corrupt(format!("meta {key} = {v}"))),
    }
}

/// The simulator's current time in µs since the epoch (UTC).
pub(crate) fn now_us(conn: &Connection, path: &Path, cfg: &SimConfig) -> Result<i64> {
    match cfg.clock {
        Clock::Wall => Ok(Utc::now().timestamp_micros()),
        Clock::Manual { start, .. } => Ok(meta_i64(conn, path, "clock_us")?.unwrap_or(start.timestamp_micros())),
    }
}

/// Hands out `n` consecutive LSNs; returns the first.
fn alloc_lsns(conn: &Connection, path: &Path, n: u128) -> Result<u128> {
    let cur: u128 = match meta_get(conn, path, "lsn_counter")? {
        Some(v) => v.parse().map_err(|_| SimError::Corrupt(format!("lsn counter {v}")))?,
        None => Lsn::from_parts(FIRST_LSN.0, FIRST_LSN.1, FIRST_LSN.2).to_u128(),
    };
    meta_set(conn, path, "lsn_counter", &(cur + n).to_string())?;
    Ok(cur + 1)
}

pub(crate) fn lsn_from_blob(b: Vec<u8>) -> Result<Lsn> {
    let arr: [u8; 10] = b.try_into().map_err(|_| SimError::Corrupt("LSN of the wrong length".into()))?;
    Ok(Lsn(arr))
}

/// datetime's 1/300 s ticks since 1970 of a naive time, rounded to the nearest tick.
pub fn to_ticks(t: NaiveDateTime) -> i64 {
    let u = t.and_utc();
    let nanos = (t.nanosecond() as i64).min(999_999_999);
    u.timestamp() * TICKS_PER_SEC + (nanos * TICKS_PER_SEC + 500_000_000) / 1_000_000_000
}

/// The datetime value of a tick count (milliseconds .000/.003/.007 as SQL Server shows them).
pub fn from_ticks(k: i64) -> NaiveDateTime {
    let secs = k.div_euclid(TICKS_PER_SEC);
    let f = k.rem_euclid(TICKS_PER_SEC);
    let ms = (f * 10 + 1) / 3;
    DateTime::from_timestamp(secs, (ms * 1_000_000) as u32).expect("datetime in range").naive_utc()
}

/// Rounds a naive time to datetime's grid.
pub fn round_to_datetime(t: NaiveDateTime) -> NaiveDateTime {
    from_ticks(to_ticks(t))
}

fn utc_of_us(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}

pub(crate) fn local_ticks(zone: &ServerZone, us: i64) -> i64 {
    to_ticks(wall_clock(zone, utc_of_us(us)))
}

pub(crate) fn load_tables(conn: &Connection, path: &Path) -> Result<Vec<TableMeta>> {
    let captured: std::collections::HashSet<i64> = {
        let mut st = conn.prepare_cached("SELECT DISTINCT table_id FROM instances").ctx(path)?;
        let ids = st.query_map([], |r| r.get::<_, i64>(0)).ctx(path)?.collect::<rusqlite::Result<_>>().ctx(path)?;
        ids
    };
    let mut st = conn.prepare_cached("SELECT id, spec, column_ids FROM src_tables ORDER BY id").ctx(path)?;
    let rows = st
        .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, Option<String>>(2)?)))
        .ctx(path)?
        .collect::<rusqlite::Result<Vec<_>>>()
        .ctx(path)?;
    rows.into_iter().map(|(id, spec, ids)| load_table(id, &spec, ids.as_deref(), captured.contains(&id))).collect()
}

pub(crate) fn find_table(conn: &Connection, path: &Path, name: &TableName) -> Result<TableMeta> {
    let row: Option<(i64, String, Option<String>)> = conn
        .query_row(
            "SELECT id, spec, column_ids FROM src_tables WHERE lower(schema_name) = lower(?1) AND lower(name) = lower(?2)",
            [&name.schema, &name.name],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()
        .ctx(path)?;
    let (id, spec, ids) = row.ok_or_else(|| SimError::NoSuchTable(name.to_string()))?;
    let captured: bool = conn
        .query_row("SELECT EXISTS(SELECT 1 FROM instances WHERE table_id = ?1)", [id], |r| r.get(0))
        .ctx(path)?;
    load_table(id, &spec, ids.as_deref(), captured)
}

pub(crate) fn load_instances(conn: &Connection, path: &Path, table_id: Option<i64>) -> Result<Vec<InstanceRow>> {
    let mut st = conn
        .prepare_cached(
            "SELECT i.id, i.name, i.table_id, i.start_lsn, i.created_lsn, i.columns, i.index_columns, t.schema_name, t.name, i.ct_command_id,
                    i.column_ids, t.spec, t.column_ids
             FROM instances i JOIN src_tables t ON t.id = i.table_id
             WHERE ?1 IS NULL OR i.table_id = ?1 ORDER BY i.id",
        )
        .ctx(path)?;
    type Raw = (i64, String, i64, Option<Vec<u8>>, Vec<u8>, String, String, String, String, bool, Option<String>, String, Option<String>);
    let raw: Vec<Raw> = st
        .query_map([table_id], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
                r.get(6)?,
                r.get(7)?,
                r.get(8)?,
                r.get(9)?,
                r.get(10)?,
                r.get(11)?,
                r.get(12)?,
            ))
        })
        .ctx(path)?
        .collect::<rusqlite::Result<Vec<_>>>()
        .ctx(path)?;
    raw.into_iter()
        .map(|(id, name, table_id, start, created, cols, idx, sch, tn, ct_command_id, ids, spec, table_ids)| {
            let columns: Vec<ColumnDesc> = serde_json::from_str(&cols).map_err(|e| SimError::Corrupt(format!("instance columns: {e}")))?;
            let index_columns: Vec<String> = serde_json::from_str(&idx).map_err(|e| SimError::Corrupt(format!("instance index: {e}")))?;
            let table = load_table(table_id, &spec, table_ids.as_deref(), true)?;
            let column_ids: Vec<Option<i64>> = match ids {
                Some(text) => {
                    let ids: Vec<i64> = serde_json::from_str(&text).map_err(|e| SimError::Corrupt(format!("instance column ids: {e}")))?;
                    if ids.len() != columns.len() {
                        return Err(SimError::Corrupt(format!("capture instance '{name}' has {} columns but {} column ids", columns.len(), ids.len())));
                    }
                    ids.into_iter().map(Some).collect()
                }
                // Stored before ids were kept: the names were the table's then.
                None => columns.iter().map(|c| table.column_index(&c.name).map(|i| table.column_ids[i])).collect(),
            };
            let renamed = renamed_columns(&columns, &column_ids, &table);
            Ok(InstanceRow {
                id,
                table_id,
                ct_command_id,
                created_lsn: lsn_from_blob(created)?,
                column_ids,
                info: CaptureInstance {
                    name,
                    table: TableName::new(sch, tn),
                    start_lsn: start.map(lsn_from_blob).transpose()?,
                    columns,
                    index_columns,
                    renamed,
                },
            })
        })
        .collect()
}

pub(crate) fn find_instance(conn: &Connection, path: &Path, name: &str) -> Result<Option<InstanceRow>> {
    Ok(load_instances(conn, path, None)?.into_iter().find(|i| i.info.name.eq_ignore_ascii_case(name)))
}

pub(crate) fn max_lsn(conn: &Connection, path: &Path) -> Result<Option<Lsn>> {
    let b: Option<Vec<u8>> = conn.query_row("SELECT max(start_lsn) FROM lsn_time_mapping", [], |r| r.get(0)).ctx(path)?;
    b.map(lsn_from_blob).transpose()
}

// ---------------------------------------------------------------------------
// Values.

fn bad(t: &TableMeta, col: &ColumnDesc, message: String) -> SimError {
    SimError::BadValue { table: t.spec.name.to_string(), column: col.name.clone(), message }
}

/// Brings a value into the canonical form the simulator stores for the column
/// type (decimals at the column's scale, bit as bool, datetime on its grid...),
/// or explains why the column cannot hold it.
pub(crate) fn coerce_value(v: SqlValue, t: &SqlType) -> std::result::Result<SqlValue, String> {
    use SqlType as T;
    use SqlValue as V;
    let int_range = |x: i64, lo: i64, hi: i64| {
        if x < lo || x > hi {
            Err(format!("{x} is out of range for {t}"))
        } else {
            Ok(V::Int(x))
        }
    };
    let dec = |value: i128, scale: u8, to: u8, precision: u8| -> std::result::Result<SqlValue, String> {
        let v = if to >= scale {
            value.checked_mul(10i128.pow((to - scale) as u32)).ok_or("decimal overflow")?
        } else {
            let d = 10i128.pow((scale - to) as u32);
            let q = value / d;
            let r = value % d;
            // Round half away from zero, as SQL Server does on conversion.
            if r.abs() * 2 >= d {
                q + value.signum()
            } else {
                q
            }
        };
        if v.unsigned_abs() >= 10u128.pow(precision as u32) {
            return Err(format!("{} does not fit {t}", crate::types::format_decimal(value, scale)));
        }
        Ok(V::Decimal { value: v, scale: to })
    };
    match (t, v) {
        (_, V::Null) => Ok(V::Null),
        (T::TinyInt, V::Int(x)) => int_range(x, 0, 255),
        (T::SmallInt, V::Int(x)) => int_range(x, i16::MIN as i64, i16::MAX as i64),
        (T::Int, V::Int(x)) => int_range(x, i32::MIN as i64, i32::MAX as i64),
        (T::BigInt, V::Int(x)) => Ok(V::Int(x)),
        (T::Bit, V::Bool(b)) => Ok(V::Bool(b)),
        (T::Bit, V::Int(x)) => Ok(V::Bool(x != 0)),
        (T::Decimal { precision, scale }, V::Decimal { value, scale: s }) => dec(value, s, *scale, *precision),
        (T::Decimal { precision, scale }, V::Int(x)) => dec(x as i128, 0, *scale, *precision),
        (T::Money, V::Decimal { value, scale }) => dec(value, scale, 4, 19),
        (T::Money, V::Int(x)) => dec(x as i128, 0, 4, 19),
        (T::SmallMoney, V::Decimal { value, scale }) => dec(value, scale, 4, 10),
        (T::SmallMoney, V::Int(x)) => dec(x as i128, 0, 4, 10),
        (T::Float, V::Float(f)) => Ok(V::Float(f)),
        (T::Float, V::Int(x)) => Ok(V::Float(x as f64)),
        (T::Real, V::Float(f)) => Ok(V::Float(f as f32 as f64)),
        (T::Real, V::Int(x)) => Ok(V::Float(x as f32 as f64)),
        (T::Char { .. } | T::VarChar { .. } | T::NChar { .. } | T::NVarChar { .. } | T::Text | T::NText | T::Xml, V::Str(s)) => {
            let max = match t {
                T::Char { len } | T::NChar { len } => Some(*len),
                T::VarChar { len } | T::NVarChar { len } => *len,
                _ => None,
            };
            match max {
                Some(m) if s.chars().count() > m as usize => Err(format!("a string of {} characters is too long for {t}", s.chars().count())),
                _ => Ok(V::Str(s)),
            }
        }
        (T::Binary { .. } | T::VarBinary { .. } | T::Image | T::Timestamp, V::Bytes(b)) => Ok(V::Bytes(b)),
        (T::Date, V::Date(d)) => Ok(V::Date(d)),
        (T::Date, V::DateTime(d)) => Ok(V::Date(d.date())),
        (T::Time { .. }, V::Time(x)) => Ok(V::Time(x)),
        (T::DateTime, V::DateTime(x)) => Ok(V::DateTime(round_to_datetime(x))),
        (T::SmallDateTime, V::DateTime(x)) => {
            let secs = x.and_utc().timestamp();
            let m = (secs + 30).div_euclid(60) * 60;
            Ok(V::DateTime(DateTime::from_timestamp(m, 0).unwrap_or_default().naive_utc()))
        }
        (T::DateTime2 { scale }, V::DateTime(x)) => {
            let unit = 10u32.pow(9 - (*scale).min(7) as u32);
            let n = x.nanosecond();
            Ok(V::DateTime(x.with_nanosecond(n - n % unit).unwrap_or(x)))
        }
        (T::DateTimeOffset { .. }, V::DateTimeOffset(x)) => Ok(V::DateTimeOffset(x)),
        (T::UniqueIdentifier, V::Guid(g)) => Ok(V::Guid(g)),
        (T::UniqueIdentifier, V::Str(s)) => uuid::Uuid::parse_str(&s).map(V::Guid).map_err(|_| format!("'{s}' is not a uniqueidentifier")),
        (t, v) => Err(format!("a {} value ({}) cannot be stored in a {t} column", kind_name(&v), v.canonical())),
    }
}

fn kind_name(v: &SqlValue) -> &'static str {
    match v {
        SqlValue::Null => "NULL",
        SqlValue::Bool(_) => "boolean",
        SqlValue::Int(_) => "integer",
        SqlValue::Decimal { .. } => "decimal",
        SqlValue::Float(_) => "float",
        SqlValue::Str(_) => "string",
        SqlValue::Bytes(_) => "binary",
        SqlValue::Date(_) => "date",
        SqlValue::Time(_) => "time",
        SqlValue::DateTime(_) => "datetime",
        SqlValue::DateTimeOffset(_) => "datetimeoffset",
        SqlValue::Guid(_) => "uniqueidentifier",
    }
}

fn coerce_row(t: &TableMeta, row: Vec<SqlValue>) -> Result<Vec<SqlValue>> {
    if row.len() != t.spec.columns.len() {
        return Err(SimError::BadArgument(format!(
            "a row of {} needs {} values (columns {}), got {}",
            t.spec.name,
            t.spec.columns.len(),
            t.spec.columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
            row.len()
        )));
    }
    row.into_iter()
        .zip(&t.spec.columns)
        .enumerate()
        .map(|(i, (v, c))| {
            let v = coerce_value(v, &c.sql_type).map_err(|m| bad(t, c, m))?;
            if v.is_null() && (!c.nullable || t.key_cols.contains(&i) && !t.spec.primary_key.is_empty()) {
                return Err(bad(t, c, "the column does not accept NULL".into()));
            }
            Ok(v)
        })
        .collect()
}

fn coerce_key(t: &TableMeta, key: &[SqlValue]) -> Result<Vec<SqlValue>> {
    if t.is_heap() {
        return Ok(key.to_vec());
    }
    if key.len() != t.key_cols.len() {
        return Err(SimError::BadArgument(format!(
            "a key of {} has {} values ({}), got {}",
            t.spec.name,
            t.key_cols.len(),
            t.unique_key().join(", "),
            key.len()
        )));
    }
    key.iter()
        .zip(&t.key_cols)
        .map(|(v, &i)| {
            let c = &t.spec.columns[i];
            coerce_value(v.clone(), &c.sql_type).map_err(|m| bad(t, c, m))
        })
        .collect()
}

fn key_text(key: &[SqlValue]) -> String {
    format!("({})", key.iter().map(|v| v.canonical()).collect::<Vec<_>>().join(", "))
}

fn is_constraint(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation)
}

// ---------------------------------------------------------------------------
// The pending transaction log.

/// A row image as the log holds it: each value under its column's id, so
/// the capture job finds an instance's column whatever the column is called
/// when the job runs (a rename between the commit and the scan changes nothing).
type Image = Vec<(i64, SqlValue)>;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PendingOp {
    table_id: i64,
    /// 1 delete, 2 insert, 3 update.
    kind: u8,
    key_changed: bool,
    seqval: Lsn,
    command_id: i32,
    before: Option<Image>,
    after: Option<Image>,
}

fn image_of(t: &TableMeta, row: &[SqlValue]) -> Image {
    t.column_ids.iter().zip(row).map(|(id, v)| (*id, v.clone())).collect()
}

struct LoggedOp {
    table_id: i64,
    /// Where the operation stands in the transaction's command order (the
    /// order `__$command_id` numbers); the Vec's order is the log order
    /// (`__$seqval`). The two differ only inside a set-based key update.
    command_pos: (u64, u64),
    kind: u8,
    key_changed: bool,
    before: Option<Image>,
    after: Option<Image>,
}

/// A write transaction in progress; see [`SimDb::transaction`].
pub struct SimTx<'a> {
    conn: &'a Connection,
    path: &'a Path,
    tables: HashMap<(String, String), TableMeta>,
    ops: Vec<LoggedOp>,
    /// Operations executed, logged or not.
    statements: u64,
}

impl<'a> SimTx<'a> {
    fn table(&mut self, name: &TableName) -> Result<TableMeta> {
        let k = (name.schema.to_lowercase(), name.name.to_lowercase());
        if let Some(t) = self.tables.get(&k) {
            return Ok(t.clone());
        }
        let t = find_table(self.conn, self.path, name)?;
        self.tables.insert(k, t.clone());
        Ok(t)
    }

    /// Finds a row by key: (sort key, row).
    fn find(&self, t: &TableMeta, key: &[SqlValue]) -> Result<Option<(Vec<u8>, Vec<SqlValue>)>> {
        if t.is_heap() {
            // A heap has no key: the "key" names a row by its leading column values.
            let mut st = self.conn.prepare_cached("SELECT sk, data FROM rows WHERE table_id = ?1 ORDER BY sk").ctx(self.path)?;
            let mut rows = st.query([t.id]).ctx(self.path)?;
            while let Some(r) = rows.next().ctx(self.path)? {
                let row = t.decode_row(&r.get::<_, String>(1).ctx(self.path)?)?;
                // Equal as the server's `=` is: each value's sort key under its column's collation.
                let same = |i: usize, a: &SqlValue, b: &SqlValue| {
                    let c = [t.spec.key_col(i)];
                    keys::encode_key(&c, std::slice::from_ref(a)) == keys::encode_key(&c, std::slice::from_ref(b))
                };
                if row.len() >= key.len() && row.iter().zip(key).enumerate().all(|(i, (a, b))| same(i, a, b)) {
                    return Ok(Some((r.get(0).ctx(self.path)?, row)));
                }
            }
            return Ok(None);
        }
        let key = coerce_key(t, key)?;
        let sk = keys::encode_key(&t.key_types(), &key);
        let data: Option<String> = self
            .conn
            .query_row("SELECT data FROM rows WHERE table_id = ?1 AND sk = ?2", params![t.id, sk], |r| r.get(0))
            .optional()
            .ctx(self.path)?;
        data.map(|d| Ok((sk, t.decode_row(&d)?))).transpose()
    }

    /// The current row of `key`, if any (reads inside the transaction).
    pub fn get(&mut self, table: &TableName, key: &Key) -> Result<Option<Vec<SqlValue>>> {
        let t = self.table(table)?;
        Ok(self.find(&t, key)?.map(|(_, r)| r))
    }

    /// Inserts a row (values in column order).
    pub fn insert(&mut self, table: &TableName, row: Vec<SqlValue>) -> Result<()> {
        let t = self.table(table)?;
        let row = coerce_row(&t, row)?;
        let sk = if t.is_heap() {
            let seq: i64 = self
                .conn
                .query_row("UPDATE src_tables SET heap_seq = heap_seq + 1 WHERE id = ?1 RETURNING heap_seq", [t.id], |r| r.get(0))
                .ctx(self.path)?;
            seq.to_be_bytes().to_vec()
        } else {
            t.row_sort_key(&row)
        };
        let data = serde_json::to_string(&row).expect("values serialise");
        match self.conn.execute("INSERT INTO rows(table_id, sk, uk, data) VALUES (?1, ?2, ?3, ?4)", params![t.id, sk, t.row_unique_key(&row), data]) {
            Ok(_) => {}
            Err(e) if is_constraint(&e) => {
                return Err(SimError::DuplicateKey { table: t.spec.name.to_string(), key: key_text(&dup_key(&t, &row)) })
            }
            Err(e) => return Err(e).ctx(self.path),
        }
        self.statements += 1;
        if t.captured {
            self.ops.push(LoggedOp {
                table_id: t.id,
                command_pos: (self.statements, 0),
                kind: 2,
                key_changed: false,
                before: None,
                after: Some(image_of(&t, &row)),
            });
        }
        Ok(())
    }

    /// Replaces the row of `key` with `new_row` (all columns, in column order).
    pub fn update(&mut self, table: &TableName, key: &Key, new_row: Vec<SqlValue>) -> Result<()> {
        let t = self.table(table)?;
        let (old_sk, old_row) = self.find(&t, key)?.ok_or_else(|| SimError::RowNotFound { table: t.spec.name.to_string(), key: key_text(key) })?;
        let new_row = coerce_row(&t, new_row)?;
        // A key changes when the server's `=` says so: an update that only
        // respells a key under its collation (`abc` to `ABC` under `_CI`) keeps
        // the row in place (the plan's Collapse turns its delete and insert of
        // one key back into an update), logged as a before/after pair.
        let key_changed = t.key_cols.iter().chain(&t.uk_cols).any(|&i| {
            let c = [t.spec.key_col(i)];
            keys::encode_key(&c, std::slice::from_ref(&old_row[i])) != keys::encode_key(&c, std::slice::from_ref(&new_row[i]))
        });
        let new_sk = if t.is_heap() { old_sk.clone() } else { t.row_sort_key(&new_row) };
        let data = serde_json::to_string(&new_row).expect("values serialise");
        match self.conn.execute(
            "UPDATE rows SET sk = ?3, uk = ?4, data = ?5 WHERE table_id = ?1 AND sk = ?2",
            params![t.id, old_sk, new_sk, t.row_unique_key(&new_row), data],
        ) {
            Ok(_) => {}
            Err(e) if is_constraint(&e) => {
                return Err(SimError::DuplicateKey { table: t.spec.name.to_string(), key: key_text(&dup_key(&t, &new_row)) })
            }
            Err(e) => return Err(e).ctx(self.path),
        }
        self.statements += 1;
        if t.captured {
            self.ops.push(LoggedOp {
                table_id: t.id,
                command_pos: (self.statements, 0),
                kind: 3,
                key_changed,
                before: Some(image_of(&t, &old_row)),
                after: Some(image_of(&t, &new_row)),
            });
        }
        Ok(())
    }

    /// Deletes the row of `key`.
    pub fn delete(&mut self, table: &TableName, key: &Key) -> Result<()> {
        let t = self.table(table)?;
        let (sk, old_row) = self.find(&t, key)?.ok_or_else(|| SimError::RowNotFound { table: t.spec.name.to_string(), key: key_text(key) })?;
        self.conn.execute("DELETE FROM rows WHERE table_id = ?1 AND sk = ?2", params![t.id, sk]).ctx(self.path)?;
        self.statements += 1;
        if t.captured {
            self.ops.push(LoggedOp {
                table_id: t.id,
                command_pos: (self.statements, 0),
                kind: 1,
                key_changed: false,
                before: Some(image_of(&t, &old_row)),
                after: None,
            });
        }
        Ok(())
    }

    /// One set-based UPDATE that gives several rows new key values at once
    /// (`UPDATE t SET id = id + 1`, or keys swapped): `changes` maps each
    /// row's current key to its new row. Uniqueness is checked at the end of
    /// the statement, as SQL Server checks it, so keys may pass through
    /// values another row still holds. SQL Server runs it as a deferred
    /// update: every old row is deleted, then every new row inserted. CDC
    /// captures a delete and an insert per row, each with its own seqval,
    /// and (KB3030352) the log may hold the inserts *before* the deletes:
    /// this model logs them that way, while `__$command_id` numbers the
    /// deletes first, the order the statement ran them in.
    pub fn update_keys(&mut self, table: &TableName, changes: Vec<(Key, Vec<SqlValue>)>) -> Result<()> {
        let t = self.table(table)?;
        if t.is_heap() {
            return Err(SimError::BadArgument(format!("table {} has no key to update set-based", t.spec.name)));
        }
        let mut old_rows = Vec::new();
        for (key, _) in &changes {
            let (sk, row) = self.find(&t, key)?.ok_or_else(|| SimError::RowNotFound { table: t.spec.name.to_string(), key: key_text(key) })?;
            if old_rows.iter().any(|(s, _)| *s == sk) {
                return Err(SimError::BadArgument(format!("key {} is updated twice in one statement", key_text(key))));
            }
            old_rows.push((sk, row));
        }
        for (sk, _) in &old_rows {
            self.conn.execute("DELETE FROM rows WHERE table_id = ?1 AND sk = ?2", params![t.id, sk]).ctx(self.path)?;
        }
        let mut new_rows = Vec::new();
        for (_, row) in changes {
            let row = coerce_row(&t, row)?;
            let data = serde_json::to_string(&row).expect("values serialise");
            match self.conn.execute(
                "INSERT INTO rows(table_id, sk, uk, data) VALUES (?1, ?2, ?3, ?4)",
                params![t.id, t.row_sort_key(&row), t.row_unique_key(&row), data],
            ) {
                Ok(_) => {}
                Err(e) if is_constraint(&e) => {
                    return Err(SimError::DuplicateKey { table: t.spec.name.to_string(), key: key_text(&dup_key(&t, &row)) })
                }
                Err(e) => return Err(e).ctx(self.path),
            }
            new_rows.push(row);
        }
        let statement = self.statements;
        self.statements += 1;
        if t.captured {
            let n = old_rows.len() as u64;
            // Log order: the inserts, then the deletes (insert-before-delete).
            for (i, row) in new_rows.iter().enumerate() {
                self.ops.push(LoggedOp {
                    table_id: t.id,
                    command_pos: (statement, n + i as u64),
                    kind: 2,
                    key_changed: false,
                    before: None,
                    after: Some(image_of(&t, row)),
                });
            }
            for (i, (_, row)) in old_rows.iter().enumerate() {
                self.ops.push(LoggedOp {
                    table_id: t.id,
                    command_pos: (statement, i as u64),
                    kind: 1,
                    key_changed: false,
                    before: Some(image_of(&t, row)),
                    after: None,
                });
            }
        }
        Ok(())
    }
}

fn dup_key(t: &TableMeta, row: &[SqlValue]) -> Vec<SqlValue> {
    let cols = if t.key_cols.is_empty() { &t.uk_cols } else { &t.key_cols };
    cols.iter().map(|&i| row[i].clone()).collect()
}

/// Who holds a writer's lock on table `table_id`, if anyone (see [`SimDb::hold_lock`]).
pub(crate) fn lock_holder(conn: &Connection, path: &Path, table_id: i64) -> Result<Option<String>> {
    conn.query_row("SELECT holder FROM locks WHERE table_id = ?1", [table_id], |r| r.get(0)).optional().ctx(path)
}

// ---------------------------------------------------------------------------
// Capture and cleanup (free functions: the source runs them on its own connections).

/// Whether a capture scan has anything to do now (a cheap read, no write lock).
pub(crate) fn capture_due(conn: &Connection, path: &Path, cfg: &SimConfig) -> Result<bool> {
    let now = now_us(conn, path, cfg)?;
    let cutoff = now - (cfg.capture_lag_ms as i64) * 1000;
    let eligible: bool = conn
        .query_row("SELECT EXISTS(SELECT 1 FROM pending WHERE commit_us <= ?1)", [cutoff], |r| r.get(0))
        .ctx(path)?;
    if eligible {
        return Ok(true);
    }
    if cfg.idle_interval_seconds > 0 && idle_due(conn, path, cfg, now)? {
        return Ok(true);
    }
    if let Some(m) = cfg.auto_cleanup_interval_minutes {
        // The first interval counts from the first capture scan that saw the setting.
        let last = meta_i64(conn, path, "last_cleanup_us")?.unwrap_or(now);
        let any_instance: bool = conn.query_row("SELECT EXISTS(SELECT 1 FROM instances)", [], |r| r.get(0)).ctx(path)?;
        if any_instance && now - last >= (m as i64) * 60_000_000 {
            return Ok(true);
        }
    }
    Ok(false)
}

fn idle_due(conn: &Connection, path: &Path, cfg: &SimConfig, now: i64) -> Result<bool> {
    let (pending, instances): (i64, i64) = conn
        .query_row("SELECT (SELECT count(*) FROM pending), (SELECT count(*) FROM instances)", [], |r| Ok((r.get(0)?, r.get(1)?)))
        .ctx(path)?;
    if pending > 0 || instances == 0 {
        return Ok(false);
    }
    let last = meta_i64(conn, path, "last_mapping_us")?.unwrap_or(i64::MIN / 2);
    Ok(now - last >= (cfg.idle_interval_seconds as i64) * 1_000_000)
}

/// Runs a capture scan if one is due; returns its report (None when idle).
pub(crate) fn capture_if_due(conn: &mut Connection, path: &Path) -> Result<Option<CaptureReport>> {
    let cfg = load_config(conn, path)?;
    if !capture_due(conn, path, &cfg)? {
        return Ok(None);
    }
    capture_conn(conn, path).map(Some)
}

/// The capture job: one scan in one SQLite transaction.
pub(crate) fn capture_conn(conn: &mut Connection, path: &Path) -> Result<CaptureReport> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
    let cfg = load_config(&tx, path)?;
    // Commit times are the server's wall clock: its rules, whatever zone it reports.
    let zone = cfg.clock_zone()?;
    let now = now_us(&tx, path, &cfg)?;
    let cutoff = now - (cfg.capture_lag_ms as i64) * 1000;
    let tables: HashMap<i64, TableMeta> = load_tables(&tx, path)?.into_iter().map(|t| (t.id, t)).collect();
    let instances = load_instances(&tx, path, None)?;
    let mut report = CaptureReport::default();

    let pend: Vec<(Vec<u8>, Vec<u8>, i64, i64, String)> = {
        let mut st = tx
            .prepare("SELECT commit_lsn, begin_lsn, begin_us, commit_us, ops FROM pending ORDER BY commit_lsn")
            .ctx(path)?;
        let v = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
            .ctx(path)?
            .collect::<rusqlite::Result<Vec<_>>>()
            .ctx(path)?;
        v
    };
    {
        let mut ins_change = tx
            .prepare_cached("INSERT INTO changes(instance_id, start_lsn, command_id, seqval, operation, data) VALUES (?1, ?2, ?3, ?4, ?5, ?6)")
            .ctx(path)?;
        let mut ins_map = tx
            .prepare_cached("INSERT INTO lsn_time_mapping(start_lsn, tran_begin_ticks, tran_end_ticks, tran_id, tran_begin_lsn) VALUES (?1, ?2, ?3, ?4, ?5)")
            .ctx(path)?;
        let mut del_pending = tx.prepare_cached("DELETE FROM pending WHERE commit_lsn = ?1").ctx(path)?;
        for (commit_lsn, begin_lsn, begin_us, commit_us, ops) in pend {
            // Harvest in LSN order and stop at the first transaction still inside the
            // lag, so every LSN up to max LSN is complete.
            if commit_us > cutoff {
                report.pending_left += 1;
                continue;
            }
            if report.pending_left > 0 {
                report.pending_left += 1;
                continue;
            }
            let commit = lsn_from_blob(commit_lsn.clone())?;
            let ops: Vec<PendingOp> = serde_json::from_str(&ops).map_err(|e| SimError::Corrupt(format!("pending ops: {e}")))?;
            let mut rows = 0u64;
            for op in &ops {
                if !tables.contains_key(&op.table_id) {
                    continue;
                }
                for inst in instances.iter().filter(|i| i.table_id == op.table_id && commit > i.created_lsn) {
                    let image = |img: &Option<Image>, operation: i32, other: Option<&Image>| -> String {
                        let vals: Vec<SqlValue> = inst
                            .info
                            .columns
                            .iter()
                            .zip(&inst.column_ids)
                            .map(|(c, id)| lob_rule(c, *id, operation, img.as_ref(), other))
                            .collect();
                        serde_json::to_string(&vals).expect("values serialise")
                    };
                    let mut emit = |operation: i32, data: String| -> Result<()> {
                        ins_change
                            .execute(params![inst.id, commit_lsn, op.command_id, op.seqval.0.to_vec(), operation, data])
                            .ctx(path)?;
                        rows += 1;
                        Ok(())
                    };
                    match op.kind {
                        1 => emit(1, image(&op.before, 1, None))?,
                        2 => emit(2, image(&op.after, 2, None))?,
                        _ if op.key_changed => {
                            emit(1, image(&op.before, 1, None))?;
                            emit(2, image(&op.after, 2, None))?;
                        }
                        _ => {
                            emit(3, image(&op.before, 3, op.after.as_ref()))?;
                            emit(4, image(&op.after, 4, None))?;
                        }
                    }
                }
            }
            if rows > 0 {
                let begin = lsn_from_blob(begin_lsn)?;
                ins_map
                    .execute(params![
                        commit_lsn,
                        local_ticks(&zone, begin_us),
                        local_ticks(&zone, commit_us),
                        begin.0.to_vec(),
                        begin.0.to_vec()
                    ])
                    .ctx(path)?;
                report.mapping_rows += 1;
                meta_set(&tx, path, "last_mapping_us", &commit_us.to_string())?;
            }
            del_pending.execute([commit_lsn]).ctx(path)?;
            report.transactions += 1;
            report.change_rows += rows;
        }
    }
    if report.transactions == 0 && cfg.idle_interval_seconds > 0 && idle_due(&tx, path, &cfg, now)? {
        let l = Lsn::from_u128(alloc_lsns(&tx, path, 1)?);
        let ticks = local_ticks(&zone, now);
        tx.execute(
            "INSERT INTO lsn_time_mapping(start_lsn, tran_begin_ticks, tran_end_ticks, tran_id, tran_begin_lsn) VALUES (?1, ?2, ?2, x'00', NULL)",
            params![l.0.to_vec(), ticks],
        )
        .ctx(path)?;
        meta_set(&tx, path, "last_mapping_us", &now.to_string())?;
        report.idle_rows += 1;
        report.mapping_rows += 1;
    }
    if let Some(m) = cfg.auto_cleanup_interval_minutes {
        let last = match meta_i64(&tx, path, "last_cleanup_us")? {
            Some(l) => l,
            None => {
                meta_set(&tx, path, "last_cleanup_us", &now.to_string())?;
                now
            }
        };
        if !instances.is_empty() && now - last >= (m as i64) * 60_000_000 {
            report.cleanup = Some(cleanup_tx(&tx, path, &cfg, None, None)?);
            meta_set(&tx, path, "last_cleanup_us", &now.to_string())?;
        }
    }
    report.max_lsn = max_lsn(&tx, path)?;
    tx.commit().ctx(path)?;
    Ok(report)
}

/// The value a change row holds for a captured column (`c`, whose source
/// column id is `column_id`), with SQL Server's LOB rules: text/ntext/image
/// are NULL in deletes and before-images; the (max) types are NULL in
/// before-images unless the update changed them. The value is found by the
/// column's id, as SQL Server's capture maps columns, so a renamed column is
/// captured under the instance's name for it; a column the image lacks
/// (dropped since, even if another column took its name) is NULL.
fn lob_rule(c: &ColumnDesc, column_id: Option<i64>, operation: i32, img: Option<&Image>, after: Option<&Image>) -> SqlValue {
    let get = |img: Option<&Image>| {
        img.zip(column_id)
            .and_then(|(v, id)| v.iter().find(|(i, _)| *i == id).map(|(_, v)| v.clone()))
            .unwrap_or(SqlValue::Null)
    };
    let old_lob = matches!(c.sql_type, SqlType::Text | SqlType::NText | SqlType::Image);
    let max_lob = matches!(
        c.sql_type,
        SqlType::VarChar { len: None } | SqlType::NVarChar { len: None } | SqlType::VarBinary { len: None } | SqlType::Xml
    );
    if old_lob && (operation == 1 || operation == 3) {
        return SqlValue::Null;
    }
    let v = get(img);
    if max_lob && operation == 3 && after.is_some() && get(after) == v {
        return SqlValue::Null;
    }
    v
}

/// Cleanup inside an open write transaction. `to_lsn` forces the watermark.
fn cleanup_tx(conn: &Connection, path: &Path, cfg: &SimConfig, retention: Option<u64>, to_lsn: Option<Lsn>) -> Result<CleanupReport> {
    let mut report = CleanupReport::default();
    let wm: Option<Lsn> = match to_lsn {
        Some(l) => Some(l),
        None => {
            let max_end: Option<i64> = conn.query_row("SELECT max(tran_end_ticks) FROM lsn_time_mapping", [], |r| r.get(0)).ctx(path)?;
            match max_end {
                None => None,
                Some(max_end) => {
                    let ret = retention.unwrap_or(cfg.retention_minutes) as i64;
                    let wm_ticks = max_end.saturating_sub(ret.saturating_mul(60 * TICKS_PER_SEC));
                    let b: Option<Vec<u8>> = conn
                        .query_row("SELECT min(start_lsn) FROM lsn_time_mapping WHERE tran_end_ticks >= ?1", [wm_ticks], |r| r.get(0))
                        .ctx(path)?;
                    b.map(lsn_from_blob).transpose()?
                }
            }
        }
    };
    report.watermark = wm;
    let Some(wm) = wm else { return Ok(report) };
    let instances = load_instances(conn, path, None)?;
    let mut lowest: Option<Lsn> = None;
    for inst in &instances {
        let old = inst.info.start_lsn;
        let new = match old {
            Some(s) if s >= wm => s,
            _ => wm,
        };
        if old != Some(new) {
            conn.execute("UPDATE instances SET start_lsn = ?2 WHERE id = ?1", params![inst.id, new.0.to_vec()]).ctx(path)?;
        }
        let n = conn
            .execute("DELETE FROM changes WHERE instance_id = ?1 AND start_lsn < ?2", params![inst.id, new.0.to_vec()])
            .ctx(path)?;
        report.change_rows_deleted += n as u64;
        report.instances.push((inst.info.name.clone(), old, Some(new)));
        lowest = Some(lowest.map_or(new, |l: Lsn| l.min(new)));
    }
    if let Some(low) = lowest {
        let n = conn.execute("DELETE FROM lsn_time_mapping WHERE start_lsn < ?1", [low.0.to_vec()]).ctx(path)?;
        report.mapping_rows_deleted = n as u64;
    }
    Ok(report)
}

/// Takes one matching fault, if any is armed: the rows the read may deliver before failing.
pub(crate) fn take_fault(conn: &mut Connection, path: &Path, on: FaultOn) -> Result<Option<(u64, Option<u32>)>> {
    let armed: bool = conn.query_row("SELECT EXISTS(SELECT 1 FROM faults WHERE remaining > 0)", [], |r| r.get(0)).ctx(path)?;
    if !armed {
        return Ok(None);
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
    let f: Option<(i64, i64, Option<i64>)> = tx
        .query_row(
            "SELECT id, after_rows, error_number FROM faults WHERE remaining > 0 AND (on_kind = ?1 OR on_kind = 'any') ORDER BY id LIMIT 1",
            [on.as_str()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()
        .ctx(path)?;
    if let Some((id, _, _)) = f {
        tx.execute("UPDATE faults SET remaining = remaining - 1 WHERE id = ?1", [id]).ctx(path)?;
    }
    tx.commit().ctx(path)?;
    Ok(f.map(|(_, n, e)| (n.max(0) as u64, e.map(|e| e as u32))))
}

/// Runs an armed cleanup-before-change-read (see
/// [`SimDb::cleanup_before_next_change_read`]): cleanup to the max LSN.
pub(crate) fn take_cleanup_before_changes(conn: &mut Connection, path: &Path) -> Result<bool> {
    let armed: bool = conn
        .query_row("SELECT EXISTS(SELECT 1 FROM faults WHERE remaining > 0 AND on_kind = 'cleanup_before_changes')", [], |r| r.get(0))
        .ctx(path)?;
    if !armed {
        return Ok(false);
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
    tx.execute("UPDATE faults SET remaining = remaining - 1 WHERE on_kind = 'cleanup_before_changes' AND remaining > 0", []).ctx(path)?;
    let cfg = load_config(&tx, path)?;
    if let Some(max) = max_lsn(&tx, path)? {
        cleanup_tx(&tx, path, &cfg, None, Some(max))?;
    }
    tx.commit().ctx(path)?;
    Ok(true)
}

// ---------------------------------------------------------------------------
// The handle.

/// A handle on a simulator file. Several handles (in one process or many) can
/// use the same file at once.
pub struct SimDb {
    path: PathBuf,
    conn: Mutex<Connection>,
}

impl std::fmt::Debug for SimDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimDb({})", self.path.display())
    }
}

impl SimDb {
    /// Creates a new simulator file; fails when the file exists.
    pub fn create(path: &Path, cfg: SimConfig) -> Result<SimDb> {
        SimDb::create_with(path, cfg, false)
    }

    /// Creates a new simulator file, replacing an existing one when `overwrite`.
    pub fn create_with(path: &Path, cfg: SimConfig, overwrite: bool) -> Result<SimDb> {
        cfg.zone()?;
        cfg.clock_zone()?;
        if path.exists() {
            if !overwrite {
                return Err(SimError::Exists(path.to_path_buf()));
            }
            for suffix in ["", "-wal", "-shm"] {
                let p = PathBuf::from(format!("{}{}", path.display(), suffix));
                if p.exists() {
                    std::fs::remove_file(&p).map_err(|source| SimError::Io { path: p.display().to_string(), source })?;
                }
            }
        }
        let conn = Connection::open(path).ctx(path)?;
        setup_conn(&conn, path)?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0)).ctx(path)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(SimError::Config(format!("{} cannot use SQLite's WAL mode (got {mode})", path.display())));
        }
        conn.execute_batch(&format!("BEGIN; {SCHEMA} COMMIT;")).ctx(path)?;
        meta_set(&conn, path, "magic", MAGIC)?;
        meta_set(&conn, path, "config", &serde_json::to_string(&cfg).expect("config serialises"))?;
        if let Clock::Manual { start, .. } = cfg.clock {
            meta_set(&conn, path, "clock_us", &start.timestamp_micros().to_string())?;
        }
        Ok(SimDb { path: path.to_path_buf(), conn: Mutex::new(conn) })
    }

    /// Opens an existing simulator file.
    pub fn open(path: &Path) -> Result<SimDb> {
        let conn = open_conn(path)?;
        Ok(SimDb { path: path.to_path_buf(), conn: Mutex::new(conn) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `sim://` URL of this file.
    pub fn url(&self) -> String {
        format!("sim://{}", self.path.display())
    }

    /// A [`super::SimSource`] reading this file.
    pub fn source(&self) -> std::result::Result<super::SimSource, SourceError> {
        super::SimSource::open(&self.path)
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` in one write transaction (`BEGIN IMMEDIATE`) on this handle's connection.
    pub(crate) fn write<T>(&self, f: impl FnOnce(&Connection, &Path) -> Result<T>) -> Result<T> {
        let mut c = self.conn();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).ctx(&self.path)?;
        let out = f(&tx, &self.path)?;
        tx.commit().ctx(&self.path)?;
        Ok(out)
    }

    pub fn config(&self) -> Result<SimConfig> {
        load_config(&self.conn(), &self.path)
    }

    pub fn set_config(&self, cfg: SimConfig) -> Result<()> {
        cfg.zone()?;
        cfg.clock_zone()?;
        self.write(|c, p| {
            let old = load_config(c, p)?;
            if let Clock::Manual { start, .. } = cfg.clock {
                if !matches!(old.clock, Clock::Manual { .. }) || meta_get(c, p, "clock_us")?.is_none() {
                    meta_set(c, p, "clock_us", &start.timestamp_micros().to_string())?;
                }
            }
            meta_set(c, p, "config", &serde_json::to_string(&cfg).expect("config serialises"))
        })
    }

    /// Sets one configuration field from text (`capture_lag_ms=500`,
    /// `time_zone=America/New_York`, `conn_rows_per_s=null`...).
    pub fn set_config_value(&self, key: &str, value: &str) -> Result<SimConfig> {
        let cfg = self.config()?;
        let mut j = serde_json::to_value(&cfg).expect("config serialises");
        let obj = j.as_object_mut().expect("config is an object");
        if !obj.contains_key(key) {
            return Err(SimError::BadArgument(format!(
                "'{key}' is not a setting; settings are: {}",
                obj.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        let v: serde_json::Value = serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        obj.insert(key.to_string(), v);
        let cfg: SimConfig = serde_json::from_value(j).map_err(|e| SimError::BadArgument(format!("{key}={value}: {e}")))?;
        self.set_config(cfg.clone())?;
        Ok(cfg)
    }

    /// The simulator's current time.
    pub fn now(&self) -> Result<DateTime<Utc>> {
        let c = self.conn();
        let cfg = load_config(&c, &self.path)?;
        Ok(utc_of_us(now_us(&c, &self.path, &cfg)?))
    }

    /// Moves the manual clock forward (an error with the wall clock).
    pub fn advance_clock(&self, by: Duration) -> Result<DateTime<Utc>> {
        self.write(|c, p| {
            let cfg = load_config(c, p)?;
            if !matches!(cfg.clock, Clock::Manual { .. }) {
                return Err(SimError::Config("the clock is the wall clock; only a manual clock can be advanced (set clock to manual)".into()));
            }
            let now = now_us(c, p, &cfg)? + by.as_micros() as i64;
            meta_set(c, p, "clock_us", &now.to_string())?;
            Ok(utc_of_us(now))
        })
    }

    /// Creates a source table.
    pub fn create_table(&self, spec: &TableSpec) -> Result<()> {
        // Column ids 1..n in column order, as SQL Server numbers a new table's columns.
        let column_ids: Vec<i64> = (1..=spec.columns.len() as i64).collect();
        let meta = table_meta(0, spec.clone(), column_ids.clone(), false)?;
        if spec.columns.is_empty() {
            return Err(SimError::BadArgument(format!("table {} needs at least one column", spec.name)));
        }
        for (i, c) in spec.columns.iter().enumerate() {
            if spec.columns[..i].iter().any(|d| d.name.eq_ignore_ascii_case(&c.name)) {
                return Err(SimError::BadArgument(format!("table {} names column '{}' twice", spec.name, c.name)));
            }
        }
        for (column, name) in &spec.collations {
            match spec.columns.iter().find(|c| c.name.eq_ignore_ascii_case(column)) {
                Some(c) if c.sql_type.is_string() => {
                    super::collation::collation(name).map_err(|e| SimError::BadArgument(format!("column '{column}': {e}")))?;
                }
                _ => return Err(SimError::BadArgument(format!("a collation is given for '{column}', which is not a string column of {}", spec.name))),
            }
        }
        for &i in meta.key_cols.iter().chain(&meta.uk_cols) {
            if let Some(r) = spec.columns[i].sql_type.unorderable_reason() {
                return Err(SimError::BadArgument(format!("column '{}' cannot be in a key: {r}", spec.columns[i].name)));
            }
        }
        let mut spec = spec.clone();
        for &i in &meta.key_cols {
            if !spec.primary_key.is_empty() {
                spec.columns[i].nullable = false;
            }
        }
        self.write(|c, p| {
            let r = c.execute(
                "INSERT INTO src_tables(schema_name, name, spec, column_ids, next_column_id) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    spec.name.schema,
                    spec.name.name,
                    serde_json::to_string(&spec).expect("spec serialises"),
                    serde_json::to_string(&column_ids).expect("ids serialise"),
                    column_ids.len() as i64 + 1
                ],
            );
            match r {
                Err(e) if is_constraint(&e) => Err(SimError::TableExists(spec.name.to_string())),
                r => r.map(|_| ()).ctx(p),
            }
        })
    }

    /// The table's definition.
    pub fn table_spec(&self, table: &TableName) -> Result<TableSpec> {
        Ok(find_table(&self.conn(), &self.path, table)?.spec)
    }

    /// Bulk-loads rows without logging them as changes (rows that existed
    /// before CDC was enabled). Returns the number of rows loaded.
    pub fn load_rows(&self, table: &TableName, rows: impl Iterator<Item = Vec<SqlValue>>) -> Result<u64> {
        let mut rows = rows.peekable();
        let mut total = 0u64;
        while rows.peek().is_some() {
            // Commit every 50,000 rows so a huge load does not hold one giant transaction.
            let n = self.write(|c, p| {
                let t = find_table(c, p, table)?;
                let mut st = c.prepare_cached("INSERT INTO rows(table_id, sk, uk, data) VALUES (?1, ?2, ?3, ?4)").ctx(p)?;
                let mut n = 0u64;
                for row in rows.by_ref().take(50_000) {
                    let row = coerce_row(&t, row)?;
                    let sk = if t.is_heap() {
                        let seq: i64 = c
                            .query_row("UPDATE src_tables SET heap_seq = heap_seq + 1 WHERE id = ?1 RETURNING heap_seq", [t.id], |r| r.get(0))
                            .ctx(p)?;
                        seq.to_be_bytes().to_vec()
                    } else {
                        t.row_sort_key(&row)
                    };
                    let data = serde_json::to_string(&row).expect("values serialise");
                    match st.execute(params![t.id, sk, t.row_unique_key(&row), data]) {
                        Ok(_) => {}
                        Err(e) if is_constraint(&e) => {
                            return Err(SimError::DuplicateKey { table: t.spec.name.to_string(), key: key_text(&dup_key(&t, &row)) })
                        }
                        Err(e) => return Err(e).ctx(p),
                    }
                    n += 1;
                }
                Ok(n)
            })?;
            total += n;
        }
        Ok(total)
    }

    /// Runs `f` as one transaction: all its writes commit together with one
    /// commit LSN, or none do when it returns an error. Returns the commit LSN.
    pub fn transaction<F>(&self, f: F) -> Result<Lsn>
    where
        F: FnOnce(&mut SimTx<'_>) -> Result<()>,
    {
        let mut c = self.conn();
        let path = self.path.as_path();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
        let cfg = load_config(&tx, path)?;
        let begin_us = now_us(&tx, path, &cfg)?;
        let mut stx = SimTx { conn: &tx, path, tables: HashMap::new(), ops: Vec::new(), statements: 0 };
        f(&mut stx)?;
        let ops = std::mem::take(&mut stx.ops);
        drop(stx);
        let n = ops.len() as u128;
        let first = alloc_lsns(&tx, path, n + 2)?;
        let begin_lsn = Lsn::from_u128(first);
        let commit_lsn = Lsn::from_u128(first + n + 1);
        let commit_us = match cfg.clock {
            Clock::Wall => Utc::now().timestamp_micros().max(begin_us),
            Clock::Manual { tick_ms, .. } => {
                let t = begin_us + (tick_ms as i64) * 1000;
                meta_set(&tx, path, "clock_us", &t.to_string())?;
                t
            }
        };
        if !ops.is_empty() {
            // seqval follows the log order (the Vec's), command id the order
            // the statements ran the operations in.
            let mut by_command: Vec<(u64, u64)> = ops.iter().map(|o| o.command_pos).collect();
            by_command.sort_unstable();
            let pending: Vec<PendingOp> = ops
                .into_iter()
                .enumerate()
                .map(|(i, o)| PendingOp {
                    table_id: o.table_id,
                    kind: o.kind,
                    key_changed: o.key_changed,
                    seqval: Lsn::from_u128(first + 1 + i as u128),
                    command_id: by_command.partition_point(|p| *p < o.command_pos) as i32 + 1,
                    before: o.before,
                    after: o.after,
                })
                .collect();
            tx.execute(
                "INSERT INTO pending(commit_lsn, begin_lsn, begin_us, commit_us, ops) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![commit_lsn.0.to_vec(), begin_lsn.0.to_vec(), begin_us, commit_us, serde_json::to_string(&pending).expect("ops serialise")],
            )
            .ctx(path)?;
        }
        tx.commit().ctx(path)?;
        Ok(commit_lsn)
    }

    /// Enables CDC on a table: a new capture instance (default name
    /// `<schema>_<table>`) capturing `captured_columns` (default all), with its
    /// start LSN a fresh LSN above every LSN so far.
    pub fn enable_cdc(&self, table: &TableName, capture_instance: Option<&str>, captured_columns: Option<Vec<String>>) -> Result<CaptureInstance> {
        self.enable_cdc_on_index(table, capture_instance, captured_columns, None)
    }

    /// `sys.sp_cdc_enable_table` with `@index_name`: the instance's row
    /// identity (`index_column_list`) is the named unique index instead of the
    /// primary key. The table's indexes are its primary key and its one
    /// unique index, so `index` must name the columns of either, in order
    /// (SQL Server raises error 22957 for an index that is not unique).
    pub fn enable_cdc_on_index(
        &self,
        table: &TableName,
        capture_instance: Option<&str>,
        captured_columns: Option<Vec<String>>,
        index: Option<&[String]>,
    ) -> Result<CaptureInstance> {
        self.write(|c, p| {
            let t = find_table(c, p, table)?;
            let index_columns = match index {
                None => t.unique_key(),
                Some(names) => {
                    let same = |cols: &[String]| cols.len() == names.len() && cols.iter().zip(names).all(|(a, b)| a.eq_ignore_ascii_case(b));
                    if !names.is_empty() && (same(&t.spec.primary_key) || same(&t.spec.unique_index)) {
                        names.iter().map(|n| t.spec.columns.iter().find(|c| c.name.eq_ignore_ascii_case(n)).expect("named by an index").name.clone()).collect()
                    } else {
                        return Err(SimError::BadArgument(format!(
                            "@index_name must name a unique index of {}: its primary key ({}) or its unique index ({})",
                            t.spec.name,
                            t.spec.primary_key.join(", "),
                            t.spec.unique_index.join(", ")
                        )));
                    }
                }
            };
            let name = capture_instance.map(str::to_string).unwrap_or_else(|| format!("{}_{}", t.spec.name.schema, t.spec.name.name));
            if name.is_empty() || name.len() > 100 {
                return Err(SimError::BadArgument(format!("capture instance name '{name}' must have 1 to 100 characters")));
            }
            if find_instance(c, p, &name)?.is_some() {
                return Err(SimError::InstanceExists(name));
            }
            if load_instances(c, p, Some(t.id))?.len() >= 2 {
                return Err(SimError::TooManyInstances(t.spec.name.to_string()));
            }
            let positions: Vec<usize> = match captured_columns {
                None => (0..t.spec.columns.len()).collect(),
                Some(names) => {
                    let mut idx = resolve_cols(&t.spec, &names)?;
                    idx.extend(resolve_cols(&t.spec, &index_columns)?);
                    idx.sort_unstable();
                    idx.dedup();
                    idx
                }
            };
            let columns: Vec<ColumnDesc> = positions.iter().map(|&i| t.spec.columns[i].clone()).collect();
            // cdc.captured_columns.column_id: what the capture job reads each column by.
            let column_ids: Vec<i64> = positions.iter().map(|&i| t.column_ids[i]).collect();
            let lsn = Lsn::from_u128(alloc_lsns(c, p, 1)?);
            let info = CaptureInstance {
                name: name.clone(),
                table: t.spec.name.clone(),
                start_lsn: Some(lsn),
                columns,
                index_columns,
                renamed: Default::default(),
            };
            c.execute(
                "INSERT INTO instances(name, table_id, start_lsn, created_lsn, columns, index_columns, column_ids) VALUES (?1, ?2, ?3, ?3, ?4, ?5, ?6)",
                params![
                    name,
                    t.id,
                    lsn.0.to_vec(),
                    serde_json::to_string(&info.columns).expect("columns serialise"),
                    serde_json::to_string(&info.index_columns).expect("names serialise"),
                    serde_json::to_string(&column_ids).expect("ids serialise")
                ],
            )
            .ctx(p)?;
            Ok(info)
        })
    }

    /// Enables CDC as a server without the KB3030352 update did: the new
    /// instance's change table has no `__$command_id` column, so its reads
    /// order each transaction by `__$seqval` and return the column as NULL.
    pub fn enable_cdc_without_command_id(
        &self,
        table: &TableName,
        capture_instance: Option<&str>,
        captured_columns: Option<Vec<String>>,
    ) -> Result<CaptureInstance> {
        let info = self.enable_cdc(table, capture_instance, captured_columns)?;
        self.write(|c, p| {
            c.execute("UPDATE instances SET ct_command_id = 0 WHERE name = ?1", [&info.name]).ctx(p)?;
            Ok(())
        })?;
        Ok(info)
    }

    /// Arms a numbered server error for the next matching reads: the read
    /// delivers `after_rows` rows, then fails with SQL Server error `number`
    /// (601 for a NOLOCK scan that lost its place, 3961 for SNAPSHOT against
    /// a concurrent DDL, ...), classified as the client classifies it.
    pub fn inject_server_error(&self, on: FaultOn, after_rows: u64, times: u32, number: u32) -> Result<()> {
        self.write(|c, p| {
            c.execute(
                "INSERT INTO faults(on_kind, after_rows, remaining, error_number) VALUES (?1, ?2, ?3, ?4)",
                params![on.as_str(), after_rows as i64, times as i64, number as i64],
            )
            .ctx(p)?;
            Ok(())
        })
    }

    /// A writer's exclusive lock on `table`, held until [`SimDb::release_lock`]
    /// (an open transaction that has changed the table, as far as readers
    /// can tell). Every statement that reads the table's rows under locking
    /// READ COMMITTED waits behind it for up to `lock_timeout_ms` and then
    /// fails with error 1222: snapshot reads and fenced reads, and the key
    /// extents, seeks, slice counts and extents, NULL counts, bucket sums and
    /// row counts of the planners and reconcile. SNAPSHOT reads do not wait
    /// (they read row versions), nor do reads that touch no row of the table:
    /// the catalog, the `cdc.*` objects (change tables, `lsn_time_mapping`),
    /// `sp_spaceused`'s estimate, the key comparison. The lock lives in the
    /// file, so it holds for every process that reads it.
    pub fn hold_lock(&self, table: &TableName, holder: &str) -> Result<()> {
        self.write(|c, p| {
            let t = find_table(c, p, table)?;
            c.execute("INSERT INTO locks(table_id, holder) VALUES (?1, ?2) ON CONFLICT(table_id) DO UPDATE SET holder = excluded.holder", params![t.id, holder])
                .ctx(p)?;
            Ok(())
        })
    }

    /// Lets go of the lock [`SimDb::hold_lock`] took.
    pub fn release_lock(&self, table: &TableName) -> Result<()> {
        self.write(|c, p| {
            let t = find_table(c, p, table)?;
            c.execute("DELETE FROM locks WHERE table_id = ?1", [t.id]).ctx(p)?;
            Ok(())
        })
    }

    /// Arms a cleanup that runs right before the next change read checks its
    /// range, moving every instance's min LSN up to the max LSN: the race
    /// where cleanup passes a stream between its check of the min LSN and its
    /// read, so the read itself fails with error 313.
    pub fn cleanup_before_next_change_read(&self) -> Result<()> {
        self.write(|c, p| {
            c.execute("INSERT INTO faults(on_kind, after_rows, remaining) VALUES ('cleanup_before_changes', 0, 1)", []).ctx(p)?;
            Ok(())
        })
    }

    /// Drops a capture instance and its change rows.
    pub fn disable_instance(&self, name: &str) -> Result<()> {
        self.write(|c, p| {
            let i = find_instance(c, p, name)?.ok_or_else(|| SimError::NoSuchInstance(name.to_string()))?;
            c.execute("DELETE FROM changes WHERE instance_id = ?1", [i.id]).ctx(p)?;
            c.execute("DELETE FROM instances WHERE id = ?1", [i.id]).ctx(p)?;
            // Its gating role goes with it: a new instance of the same name has its own.
            super::security::forget_instance(c, p, &i.info.name)?;
            Ok(())
        })
    }

    /// The capture instances of a table, oldest first.
    pub fn capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>> {
        let c = self.conn();
        let t = find_table(&c, &self.path, table)?;
        Ok(load_instances(&c, &self.path, Some(t.id))?.into_iter().map(|i| i.info).collect())
    }

    /// Adds a (nullable) column at the end of the table. Existing capture
    /// instances keep their columns; a new instance captures the new shape.
    pub fn add_column(&self, table: &TableName, column: ColumnDesc) -> Result<()> {
        self.write(|c, p| {
            let mut t = find_table(c, p, table)?;
            if t.column_index(&column.name).is_some() {
                return Err(SimError::BadArgument(format!("table {} already has a column '{}'", t.spec.name, column.name)));
            }
            if !column.nullable {
                return Err(SimError::BadArgument(format!(
                    "column '{}' must be nullable: existing rows of {} get NULL in it",
                    column.name, t.spec.name
                )));
            }
            // A new id above every id the table ever had: a dropped column's id is never reused.
            let next: Option<i64> = c.query_row("SELECT next_column_id FROM src_tables WHERE id = ?1", [t.id], |r| r.get(0)).ctx(p)?;
            let id = next.unwrap_or_else(|| t.column_ids.iter().max().copied().unwrap_or(0) + 1);
            t.spec.columns.push(column);
            t.column_ids.push(id);
            save_table(c, p, &t)?;
            c.execute("UPDATE src_tables SET next_column_id = ?2 WHERE id = ?1", params![t.id, id + 1]).ctx(p)?;
            Ok(())
        })
    }

    /// Drops a non-key column (rewrites every row). Capture instances that
    /// capture it get NULL in it from then on.
    pub fn drop_column(&self, table: &TableName, column: &str) -> Result<()> {
        self.write(|c, p| {
            let mut t = find_table(c, p, table)?;
            let i = t.column_index(column).ok_or_else(|| SimError::NoSuchColumn { table: t.spec.name.to_string(), column: column.into() })?;
            if t.key_cols.contains(&i) || t.uk_cols.contains(&i) {
                return Err(SimError::BadArgument(format!("column '{column}' is part of a key of {} and cannot be dropped", t.spec.name)));
            }
            let rows: Vec<(Vec<u8>, String)> = {
                let mut st = c.prepare("SELECT sk, data FROM rows WHERE table_id = ?1").ctx(p)?;
                let v = st.query_map([t.id], |r| Ok((r.get(0)?, r.get(1)?))).ctx(p)?.collect::<rusqlite::Result<Vec<_>>>().ctx(p)?;
                v
            };
            {
                let mut up = c.prepare("UPDATE rows SET data = ?3 WHERE table_id = ?1 AND sk = ?2").ctx(p)?;
                for (sk, data) in rows {
                    let mut row = t.decode_row(&data)?;
                    row.remove(i);
                    up.execute(params![t.id, sk, serde_json::to_string(&row).expect("values serialise")]).ctx(p)?;
                }
            }
            // The high-water mark outlives the column, so its id is never
            // handed out again (a file from before the mark was kept gets one now).
            let high = t.column_ids.iter().max().copied().unwrap_or(0) + 1;
            t.spec.columns.remove(i);
            t.column_ids.remove(i);
            save_table(c, p, &t)?;
            c.execute("UPDATE src_tables SET next_column_id = coalesce(next_column_id, ?2) WHERE id = ?1", params![t.id, high]).ctx(p)?;
            Ok(())
        })
    }

    /// `ALTER TABLE … ALTER COLUMN <column> <new type>` on a non-key column:
    /// every row's value is converted (a value the new type cannot hold fails
    /// the statement, as SQL Server's conversion does), and, as SQL Server
    /// documents for CDC, the change is carried to the change table of every
    /// instance that captures the column, so change rows read from then on
    /// arrive in the new type.
    pub fn alter_column_type(&self, table: &TableName, column: &str, new_type: SqlType) -> Result<()> {
        self.write(|c, p| {
            let mut t = find_table(c, p, table)?;
            let i = t.column_index(column).ok_or_else(|| SimError::NoSuchColumn { table: t.spec.name.to_string(), column: column.into() })?;
            if t.key_cols.contains(&i) || t.uk_cols.contains(&i) {
                return Err(SimError::BadArgument(format!("column '{column}' is part of a key of {}; this model alters non-key columns only", t.spec.name)));
            }
            let rows: Vec<(Vec<u8>, String)> = {
                let mut st = c.prepare("SELECT sk, data FROM rows WHERE table_id = ?1").ctx(p)?;
                let v = st.query_map([t.id], |r| Ok((r.get(0)?, r.get(1)?))).ctx(p)?.collect::<rusqlite::Result<Vec<_>>>().ctx(p)?;
                v
            };
            let mut altered = t.spec.columns[i].clone();
            altered.sql_type = new_type.clone();
            {
                let mut up = c.prepare("UPDATE rows SET data = ?3 WHERE table_id = ?1 AND sk = ?2").ctx(p)?;
                for (sk, data) in rows {
                    let mut row = t.decode_row(&data)?;
                    row[i] = coerce_value(row[i].clone(), &new_type).map_err(|m| bad(&t, &altered, m))?;
                    up.execute(params![t.id, sk, serde_json::to_string(&row).expect("values serialise")]).ctx(p)?;
                }
            }
            t.spec.columns[i] = altered;
            save_table(c, p, &t)?;
            // The instances that capture this column by id, whatever they call it.
            let column_id = t.column_ids[i];
            for inst in load_instances(c, p, Some(t.id))? {
                let mut columns = inst.info.columns.clone();
                let mut touched = false;
                for (col, _) in columns.iter_mut().zip(&inst.column_ids).filter(|(_, id)| **id == Some(column_id)) {
                    col.sql_type = new_type.clone();
                    touched = true;
                }
                if touched {
                    c.execute(
                        "UPDATE instances SET columns = ?2 WHERE id = ?1",
                        params![inst.id, serde_json::to_string(&columns).expect("columns serialise")],
                    )
                    .ctx(p)?;
                }
            }
            Ok(())
        })
    }

    /// `sp_rename 'schema.table.old', 'new', 'COLUMN'`: the column keeps its
    /// id, type, values and place, and takes the new name in the table, its
    /// keys and its collation. Capture instances are left as SQL Server
    /// leaves them: their captured column (and an index column,
    /// `cdc.index_columns`) keeps the old name, and the capture job goes on
    /// capturing it under that name, by id. `capture_instances` reports the
    /// rename ([`CaptureInstance::renamed`]). A change of case only is allowed
    /// and is no rename there.
    pub fn rename_column(&self, table: &TableName, old: &str, new: &str) -> Result<()> {
        self.write(|c, p| {
            let mut t = find_table(c, p, table)?;
            let i = t.column_index(old).ok_or_else(|| SimError::NoSuchColumn { table: t.spec.name.to_string(), column: old.into() })?;
            if new.trim().is_empty() || new.chars().count() > 128 {
                return Err(SimError::BadArgument(format!("'{new}' is not a column name: it must have 1 to 128 characters")));
            }
            if let Some(j) = t.column_index(new).filter(|&j| j != i) {
                return Err(SimError::BadArgument(format!(
                    "table {} already has a column '{}': rename to a name no other column uses (names compare case-insensitively)",
                    t.spec.name, t.spec.columns[j].name
                )));
            }
            let was = std::mem::replace(&mut t.spec.columns[i].name, new.to_string());
            for k in t.spec.primary_key.iter_mut().chain(t.spec.unique_index.iter_mut()) {
                if k.eq_ignore_ascii_case(&was) {
                    *k = new.to_string();
                }
            }
            if let Some(key) = t.spec.collations.keys().find(|k| k.eq_ignore_ascii_case(&was)).cloned() {
                let collation = t.spec.collations.remove(&key).expect("found just now");
                t.spec.collations.insert(new.to_string(), collation);
            }
            save_table(c, p, &t)
        })
    }

    /// Runs the capture job once (all due transactions, in LSN order, one transaction).
    pub fn capture(&self) -> Result<CaptureReport> {
        capture_conn(&mut self.conn(), &self.path)
    }

    /// Cleanup with a retention (None: the configured one).
    pub fn cleanup(&self, retention_minutes: Option<u64>) -> Result<CleanupReport> {
        self.write(|c, p| {
            let cfg = load_config(c, p)?;
            cleanup_tx(c, p, &cfg, retention_minutes, None)
        })
    }

    /// Cleanup to an explicit low watermark.
    pub fn cleanup_to_lsn(&self, lsn: Lsn) -> Result<CleanupReport> {
        self.write(|c, p| {
            let cfg = load_config(c, p)?;
            cleanup_tx(c, p, &cfg, None, Some(lsn))
        })
    }

    /// Arms a fault for the next matching reads (of any process).
    pub fn inject_fault(&self, f: FaultSpec) -> Result<()> {
        self.write(|c, p| {
            c.execute(
                "INSERT INTO faults(on_kind, after_rows, remaining) VALUES (?1, ?2, ?3)",
                params![f.on.as_str(), f.after_rows as i64, f.times as i64],
            )
            .ctx(p)?;
            Ok(())
        })
    }

    /// The highest captured commit LSN (None before any capture).
    pub fn max_lsn(&self) -> Result<Option<Lsn>> {
        max_lsn(&self.conn(), &self.path)
    }

    /// The number of rows of a table.
    pub fn row_count(&self, table: &TableName) -> Result<u64> {
        let c = self.conn();
        let t = find_table(&c, &self.path, table)?;
        let n: i64 = c.query_row("SELECT count(*) FROM rows WHERE table_id = ?1", [t.id], |r| r.get(0)).ctx(&self.path)?;
        Ok(n as u64)
    }

    /// The keys of a table in key order (for workloads and tests).
    pub fn keys(&self, table: &TableName) -> Result<Vec<Key>> {
        let c = self.conn();
        let t = find_table(&c, &self.path, table)?;
        let mut st = c.prepare("SELECT data FROM rows WHERE table_id = ?1 ORDER BY sk").ctx(&self.path)?;
        let mut rows = st.query([t.id]).ctx(&self.path)?;
        let mut out = Vec::new();
        while let Some(r) = rows.next().ctx(&self.path)? {
            let row = t.decode_row(&r.get::<_, String>(0).ctx(&self.path)?)?;
            out.push(t.key_cols.iter().map(|&i| row[i].clone()).collect());
        }
        Ok(out)
    }

    /// Every row of a table (values in column order), in key order (a heap:
    /// insertion order), read straight from the simulator's storage (for tests
    /// that check what a reader wrote against the table itself).
    pub fn rows(&self, table: &TableName) -> Result<Vec<Vec<SqlValue>>> {
        let c = self.conn();
        let t = find_table(&c, &self.path, table)?;
        let mut st = c.prepare("SELECT data FROM rows WHERE table_id = ?1 ORDER BY sk").ctx(&self.path)?;
        let mut rows = st.query([t.id]).ctx(&self.path)?;
        let mut out = Vec::new();
        while let Some(r) = rows.next().ctx(&self.path)? {
            out.push(t.decode_row(&r.get::<_, String>(0).ctx(&self.path)?)?);
        }
        Ok(out)
    }

    /// A JSON summary: clock, configuration, tables, instances, LSNs, pending work.
    pub fn status(&self) -> Result<serde_json::Value> {
        let c = self.conn();
        let p = self.path.as_path();
        let cfg = load_config(&c, p)?;
        let zone = cfg.zone()?;
        let now = now_us(&c, p, &cfg)?;
        let mut tables = Vec::new();
        for t in load_tables(&c, p)? {
            let n: i64 = c.query_row("SELECT count(*) FROM rows WHERE table_id = ?1", [t.id], |r| r.get(0)).ctx(p)?;
            let instances: Vec<serde_json::Value> = load_instances(&c, p, Some(t.id))?
                .into_iter()
                .map(|i| {
                    let rows: i64 = c.query_row("SELECT count(*) FROM changes WHERE instance_id = ?1", [i.id], |r| r.get(0)).unwrap_or(0);
                    serde_json::json!({
                        "name": i.info.name,
                        "min_lsn": i.info.start_lsn,
                        "columns": i.info.columns.iter().map(|c| format!("{} {}", c.name, c.sql_type)).collect::<Vec<_>>(),
                        "index_columns": i.info.index_columns,
                        "renamed": i.info.renamed,
                        "change_rows": rows,
                    })
                })
                .collect();
            tables.push(serde_json::json!({
                "table": t.spec.name.to_string(),
                "rows": n,
                "columns": t.spec.columns.iter().map(|c| format!("{} {}{}", c.name, c.sql_type, if c.nullable { "" } else { " not null" })).collect::<Vec<_>>(),
                "unique_key": t.unique_key(),
                "capture_instances": instances,
            }));
        }
        let (pending, mapping): (i64, i64) = c
            .query_row("SELECT (SELECT count(*) FROM pending), (SELECT count(*) FROM lsn_time_mapping)", [], |r| Ok((r.get(0)?, r.get(1)?)))
            .ctx(p)?;
        let faults: i64 = c.query_row("SELECT coalesce(sum(remaining), 0) FROM faults WHERE remaining > 0", [], |r| r.get(0)).ctx(p)?;
        Ok(serde_json::json!({
            "url": self.url(),
            "clock_utc": utc_of_us(now).to_rfc3339(),
            "clock_server_local": wall_clock(&cfg.clock_zone()?, utc_of_us(now)).to_string(),
            "time_zone": zone.name,
            "max_lsn": max_lsn(&c, p)?,
            "pending_transactions": pending,
            "mapping_rows": mapping,
            "armed_faults": faults,
            "tables": tables,
            "config": cfg,
            "security": super::security::Security::load(&c, p)?,
        }))
    }
}
