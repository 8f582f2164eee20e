//! The simulator's errors and settings: [`SimError`] (and how it maps to the
//! source's errors), the server's configuration as the file stores it
//! ([`SimConfig`], [`Clock`], the server zone and its clock rules), and the
//! specs the admin API takes: tables ([`TableSpec`]) and faults
//! ([`FaultSpec`], [`FaultOn`]).

use std::path::{Path, PathBuf};

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::source::{ServerZone, SourceError, TableName, ZoneKind};
use crate::types::ColumnDesc;

use super::keys;

#[cfg(doc)]
use super::SimDb;

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
    pub(super) fn as_str(self) -> &'static str {
        match self {
            FaultOn::Snapshot => "snapshot",
            FaultOn::Changes => "changes",
            FaultOn::Any => "any",
        }
    }
}
