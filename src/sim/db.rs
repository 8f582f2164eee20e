//! The simulator's handle, [`SimDb`], and its administrative side: creating
//! and opening a file, configuration and clock, table creation and bulk
//! loads, capture instances, schema changes, running capture and cleanup,
//! faults, writer locks and status. Writes ([`SimDb::transaction`]) live in
//! `tx.rs`. This module also re-exports the items the rest of the simulator
//! and the crate's users name by `sim::db::...`.
//!
//! Everything lives in one SQLite file opened in WAL mode, so several
//! processes can write and read it at once. Writers take the SQLite write
//! lock up front (`BEGIN IMMEDIATE`); readers hold a read transaction, which
//! in WAL mode is a consistent snapshot.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rusqlite::{params, Connection, TransactionBehavior};

use crate::lsn::Lsn;
use crate::source::{CaptureInstance, SourceError, TableName};
use crate::types::{ColumnDesc, Key, SqlType, SqlValue};

pub use super::capture::{CaptureReport, CleanupReport};
pub use super::config::{parse_zone, Clock, FaultOn, FaultSpec, Result, SimConfig, SimError, TableSpec};
pub use super::store::{from_ticks, round_to_datetime, to_ticks};
pub use super::tx::SimTx;

pub(crate) use super::capture::{capture_if_due, take_cleanup_before_changes, take_fault};
pub(crate) use super::config::{wall_clock, SqlCtx};
pub(crate) use super::meta::{InstanceRow, TableMeta};
pub(crate) use super::store::{
    find_instance, find_table, load_config, load_instances, load_tables, lock_holder, lsn_from_blob, max_lsn, meta_get, meta_set, now_us,
    open_conn,
};
pub(crate) use super::values::coerce_value;

use super::capture::{capture_conn, cleanup_tx};
use super::meta::{resolve_cols, save_table, table_meta};
use super::store::{alloc_lsns, setup_conn, utc_of_us, MAGIC, SCHEMA};
use super::values::{bad, coerce_row, dup_key, is_constraint, key_text};

/// A handle on a simulator file. Several handles (in one process or many) can
/// use the same file at once.
pub struct SimDb {
    pub(super) path: PathBuf,
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

    pub(super) fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
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
