//! The simulator file's storage: its SQLite schema and marker, opening a
//! connection, the `meta` key/value table (configuration, manual clock, LSN
//! counter), LSN allocation, the `datetime` tick grid, and loading tables,
//! capture instances, the max LSN and writer locks. They work on a bare
//! connection, so the source ([`super::source`]) runs them on its own.

use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, Timelike, Utc};
use rusqlite::{Connection, OpenFlags, OptionalExtension};

use crate::lsn::Lsn;
use crate::source::{CaptureInstance, ServerZone, TableName};
use crate::types::ColumnDesc;

use super::config::{wall_clock, Clock, Result, SimConfig, SimError, SqlCtx};
use super::meta::{load_table, renamed_columns, InstanceRow, TableMeta};

#[cfg(doc)]
use super::SimDb;

/// Marks a SQLite file as a simulator database.
pub(crate) const MAGIC: &str = "mssql-cdc-sim/1";
/// The first LSN handed out in a new file (VLF 0x2a, block 0x10, slot 0).
const FIRST_LSN: (u32, u32, u16) = (0x2a, 0x10, 0);
/// 1/300 s ticks per second: datetime's grid.
pub(crate) const TICKS_PER_SEC: i64 = 300;

pub(super) const SCHEMA: &str = "
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

pub(super) fn setup_conn(conn: &Connection, path: &Path) -> Result<()> {
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

pub(super) fn meta_i64(conn: &Connection, path: &Path, key: &str) -> Result<Option<i64>> {
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
pub(super) fn alloc_lsns(conn: &Connection, path: &Path, n: u128) -> Result<u128> {
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

pub(super) fn utc_of_us(us: i64) -> DateTime<Utc> {
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

/// Who holds a writer's lock on table `table_id`, if anyone (see [`SimDb::hold_lock`]).
pub(crate) fn lock_holder(conn: &Connection, path: &Path, table_id: i64) -> Result<Option<String>> {
    conn.query_row("SELECT holder FROM locks WHERE table_id = ?1", [table_id], |r| r.get(0)).optional().ctx(path)
}
