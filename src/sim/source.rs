//! [`SimSource`]: the [`CdcSource`] over a simulator file.
//!
//! Every call opens its own SQLite connection on a blocking thread, sleeps the
//! configured latency, and first runs a capture scan if one is due (standing
//! in for SQL Server's continuously running capture job). Streams read inside
//! one SQLite read transaction (a consistent snapshot taken before the call
//! returns), page by page in key order, and hand batches over a small bounded
//! channel, so memory stays flat however large the read.
//!
//! A source opened as a database user (`sim://PATH?user=NAME`) checks, in
//! each call, what SQL Server checks of that user for the statement the real
//! client sends for the same call ([`super::security`]); opened without one
//! it is the database owner and checks nothing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use deltalake::arrow::record_batch::RecordBatch;
use futures::StreamExt;
use rusqlite::{params, Connection, OptionalExtension};
use tokio::sync::{mpsc, oneshot};

use crate::lsn::Lsn;
use crate::source::{
    BatchStream, CaptureInstance, CdcSource, ChangeBatchBuilder, ChangeRow, Isolation, KeyRange, RowFilter, ServerZone, SnapshotRead, FencedRead, ReadThenMaxLsn,
    SourceError, TableInfo, TableName, TimeOp,
};
use crate::types::{BatchBuilder, ColumnDesc, Key, SqlValue};

use super::bounds::RangePredicate;
use super::db::{self, FaultOn, SimConfig, SimError, SqlCtx, TableMeta};
use super::keys;
use super::security::{Guard, CDC_SCHEMA};
use crate::mssql::client::{classify_server_error_in, ErrorContext};
use crate::mssql::grants::{self, InstanceCatalog, CHANGE_TABLE_ORDER_COLUMNS};

/// Rows one SQLite page query returns.
const PAGE_ROWS: i64 = 2000;

/// A simulator file as a CDC source (`sim://PATH`, or `sim://PATH?user=NAME`
/// to read as a database user).
#[derive(Debug, Clone)]
pub struct SimSource {
    path: PathBuf,
    /// The database user the calls run as; None: the database owner.
    login: Option<String>,
}

/// Splits `sim://PATH[?user=NAME]` into the file and the database user
/// (None: the owner). The user sits in a parameter, not before the path as
/// in `mssql://user@host`, because a path may hold an `@`; the only
/// parameter is `user`, and anything else is refused rather than ignored.
pub fn parse_url(url: &str) -> Result<(PathBuf, Option<String>), SourceError> {
    let rest = url.strip_prefix("sim://").ok_or_else(|| SourceError::Config(format!("'{url}' is not a simulator URL; write sim://PATH")))?;
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, q),
        None => (rest, ""),
    };
    let mut login = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("user", v)) if !v.trim().is_empty() => login = Some(v.trim().to_string()),
            _ => {
                return Err(SourceError::Config(format!(
                    "'{pair}' in the simulator URL {url} is not a parameter it takes: the only one is user=NAME, the database user to read as"
                )))
            }
        }
    }
    Ok((PathBuf::from(path), login))
}

impl SimSource {
    /// Opens a simulator file as its owner; a `Config` error naming the path
    /// when it is missing or not a simulator database.
    pub fn open(path: &Path) -> Result<SimSource, SourceError> {
        SimSource::open_as(path, None)
    }

    /// Opens a simulator file as the database user `login` (None: the
    /// owner). A user the file does not have is refused as SQL Server
    /// refuses the login (error 18456), before any call.
    pub fn open_as(path: &Path, login: Option<&str>) -> Result<SimSource, SourceError> {
        let conn = db::open_conn(path).map_err(|e| SourceError::Config(format!("cannot open sim://{}: {e}", path.display())))?;
        let guard = Guard::load(&conn, path, login)?;
        Ok(SimSource { path: path.to_path_buf(), login: guard.login().map(str::to_string) })
    }

    /// Opens `sim://PATH` or `sim://PATH?user=NAME`.
    pub fn from_url(url: &str) -> Result<SimSource, SourceError> {
        let (path, login) = parse_url(url)?;
        SimSource::open_as(&path, login.as_deref())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The database user the calls run as (None: the owner).
    pub fn login(&self) -> Option<&str> {
        self.login.as_deref()
    }

    fn url(&self) -> String {
        match &self.login {
            Some(u) => format!("sim://{}?user={u}", self.path.display()),
            None => format!("sim://{}", self.path.display()),
        }
    }

    /// Runs `f` on a fresh connection on a blocking thread, after the latency and a capture scan.
    async fn call<T, F>(&self, f: F) -> Result<T, SourceError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, &Path, &SimConfig) -> Result<T, SourceError> + Send + 'static,
    {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let (mut conn, cfg) = prepare(&path).map_err(|e| map_err(&path, e))?;
            f(&mut conn, &path, &cfg)
        })
        .await
        .map_err(|e| SourceError::Other(format!("simulator task failed: {e}")))?
    }


    /// A snapshot read's body (see [`CdcSource::snapshot_read`]), fenced when
    /// `fence` is given, followed by the max LSN when `then_max_lsn` is.
    async fn table_read(&self, read: &SnapshotRead, fence: Option<FenceTx>, then_max_lsn: Option<MaxLsnTx>) -> Result<BatchStream, SourceError> {
        let read = read.clone();
        // A fenced read takes locks whatever the isolation (HOLDLOCK is SERIALIZABLE's locking read).
        let isolation = if fence.is_some() { Isolation::ReadCommitted } else { read.isolation };
        // A locking read waits behind a writer's lock; a SNAPSHOT read reads row versions.
        let locking = (isolation == Isolation::ReadCommitted).then(|| read.table.clone());
        let login = self.login.clone();
        self.stream_with(FaultOn::Snapshot, read.batch_rows, fence, then_max_lsn, locking, move |conn, path, cfg, sink| {
            check_isolation(cfg, isolation, path)?;
            let g = Guard::load(conn, path, login.as_deref())?;
            let t = self::table(conn, path, &read.table)?;
            let cols = read_positions(conn, path, &t, &read.columns)?;
            let key_pos = key_positions(&t, &read.keys)?;
            // The SELECT names the columns the table still has, and its WHERE the key columns.
            let mut read_names: Vec<String> = cols.iter().flatten().map(|&i| t.spec.columns[i].name.clone()).collect();
            if read.range.lo.is_some() || read.range.hi.is_some() {
                read_names.extend(key_pos.iter().map(|&i| t.spec.columns[i].name.clone()));
            }
            read_columns(&g, &t, &read_names)?;
            // The statement fails before any row is read when a bound does not convert.
            let pred = RangePredicate::new(&key_types(&t, &key_pos), &read.range)?;
            let plan = plan_range(&t, &key_pos, pred.typed());
            let mut em = Emitter::new(sink, BatchBuilder::new(&read.columns));
            let mut stopped = false;
            scan_rows(conn, path, &t, &plan, |row| {
                if !plan.exact {
                    let key: Vec<SqlValue> = key_pos.iter().map(|&i| row[i].clone()).collect();
                    if !pred.holds(&key) {
                        return Ok(true);
                    }
                }
                let out: Vec<SqlValue> = cols.iter().map(|c| c.map(|i| row[i].clone()).unwrap_or(SqlValue::Null)).collect();
                let go = em.push(&out)?;
                stopped = !go;
                Ok(go)
            })?;
            if !stopped {
                em.finish();
            }
            Ok(())
        })
        .await
    }

    /// Runs a streaming read: `body` runs inside one read transaction and
    /// feeds the returned stream through `Sink`.
    async fn stream<F>(&self, on: FaultOn, batch_rows: usize, body: F) -> Result<BatchStream, SourceError>
    where
        F: FnOnce(&Connection, &Path, &SimConfig, &mut Sink) -> Result<(), SourceError> + Send + 'static,
    {
        self.stream_with(on, batch_rows, None, None, None, body).await
    }

    /// [`SimSource::stream`], optionally fenced: with `fence`, the read runs
    /// under the database's write lock (SQLite's `BEGIN IMMEDIATE`, standing
    /// in for `TABLOCK, HOLDLOCK`: no writer commits until it ends; it blocks
    /// writers of every table, not only this one's), and after the last row
    /// the clock passes the guard, the fence is read, and it passes the guard
    /// again, all before the lock is let go. A manual clock is moved by the
    /// guards (time passes while SQL Server runs `WAITFOR DELAY`). With
    /// `then_max_lsn`, once the read's transaction has ended the same
    /// connection reads the max LSN, as the second statement of the client's
    /// batch does (`sql::snapshot_read_then_max_lsn`): the capture job has
    /// run on while the rows were read, so a due scan runs first, and the
    /// statement pays no latency of its own (it shares the read's round trip).
    async fn stream_with<F>(
        &self,
        on: FaultOn,
        batch_rows: usize,
        fence: Option<FenceTx>,
        then_max_lsn: Option<MaxLsnTx>,
        locking: Option<TableName>,
        body: F,
    ) -> Result<BatchStream, SourceError>
    where
        F: FnOnce(&Connection, &Path, &SimConfig, &mut Sink) -> Result<(), SourceError> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel::<Result<RecordBatch, SourceError>>(2);
        let (rtx, rrx) = oneshot::channel::<Result<(), SourceError>>();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let mut sink = Sink {
                ready: Some(rtx),
                tx,
                batch_rows: batch_rows.max(1),
                fault_after: None,
                fault_error: None,
                rate: None,
                started: Instant::now(),
                sent: 0,
                what: on,
            };
            let res = (|| -> Result<(), SourceError> {
                let call_started = Instant::now();
                let (mut conn, cfg) = prepare(&path).map_err(|e| map_err(&path, e))?;
                let prepared_ms = call_started.elapsed().as_millis() as u64;
                let fault = db::take_fault(&mut conn, &path, on).map_err(|e| map_err(&path, e))?;
                sink.fault_after = fault.map(|(n, _)| n);
                sink.fault_error = fault.and_then(|(_, e)| e);
                if on == FaultOn::Changes {
                    // Cleanup armed to run after the caller's min LSN check, before the read's.
                    db::take_cleanup_before_changes(&mut conn, &path).map_err(|e| map_err(&path, e))?;
                }
                sink.rate = cfg.conn_rows_per_s.filter(|r| *r > 0);
                if let Some(table) = &locking {
                    // Before the transaction: inside it, SQLite's snapshot would never see the lock go.
                    wait_for_lock(&conn, &path, &cfg, table)?;
                }
                let fenced = fence.is_some();
                conn.execute_batch(if fenced { "BEGIN IMMEDIATE" } else { "BEGIN DEFERRED" }).ctx(&path).map_err(|e| map_err(&path, e))?;
                let body_started = Instant::now();
                let r = body(&conn, &path, &cfg, &mut sink);
                tracing::debug!(what = ?on, prepared_ms, before_body_ms = (body_started - call_started).as_millis() as u64,
                                body_ms = body_started.elapsed().as_millis() as u64, rows = sink.sent, "simulator read");
                let read_fence = match (&r, fenced) {
                    (Ok(()), true) => Some(fence_under_lock(&conn, &path, &cfg)),
                    _ => None,
                };
                let _ = conn.execute_batch("COMMIT");
                if let (Some(f), Some(tx)) = (read_fence, fence) {
                    let _ = tx.send(f);
                }
                if let (Ok(()), Some(tx)) = (&r, then_max_lsn) {
                    let lsn = db::capture_if_due(&mut conn, &path).and_then(|_| db::max_lsn(&conn, &path)).map_err(|e| map_err(&path, e));
                    let _ = tx.send(lsn);
                }
                r
            })();
            match res {
                Err(e) => match sink.ready.take() {
                    Some(r) => {
                        let _ = r.send(Err(e));
                    }
                    None => {
                        let _ = sink.tx.blocking_send(Err(e));
                    }
                },
                Ok(()) => sink.signal_ready(),
            }
        });
        match rrx.await {
            Ok(Ok(())) => Ok(futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) }).boxed()),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SourceError::Other("the simulator's reader thread ended before starting the read".into())),
        }
    }
}

/// Where a fenced read sends its fence.
type FenceTx = oneshot::Sender<Result<NaiveDateTime, SourceError>>;
/// Where a read followed by the max LSN sends it.
type MaxLsnTx = oneshot::Sender<Result<Option<Lsn>, SourceError>>;

/// Under a fenced read's lock: the guard, the server-local clock, the guard.
fn fence_under_lock(conn: &Connection, path: &Path, cfg: &SimConfig) -> Result<NaiveDateTime, SourceError> {
    let guard = Duration::from_millis(crate::source::FENCE_GUARD_MS);
    let pass = || -> Result<(), SourceError> {
        match cfg.clock {
            db::Clock::Wall => std::thread::sleep(guard),
            db::Clock::Manual { .. } => {
                let now = db::now_us(conn, path, cfg).map_err(|e| map_err(path, e))? + guard.as_micros() as i64;
                db::meta_set(conn, path, "clock_us", &now.to_string()).map_err(|e| map_err(path, e))?;
            }
        }
        Ok(())
    };
    pass()?;
    let now = db::now_us(conn, path, cfg).map_err(|e| map_err(path, e))?;
    let zone = cfg.clock_zone().map_err(|e| map_err(path, e))?;
    let at = DateTime::<Utc>::from_timestamp_micros(now).ok_or_else(|| SourceError::Other("the simulator's clock is out of range".into()))?;
    let fence = db::wall_clock(&zone, at);
    pass()?;
    Ok(fence)
}

/// A statement that reads the source table itself (a snapshot read, and the
/// planners' and reconcile's MIN/MAX, TOP (n+1) seeks, slice counts and
/// extents, NULL counts, bucket sums and row counts) under `isolation`:
/// under locking READ COMMITTED it waits behind a writer's lock on the
/// table ([`wait_for_lock`]: error 1222 after `lock_timeout_ms`), as SQL
/// Server's shared locks wait behind the writer's exclusive ones; under
/// SNAPSHOT it reads row versions and does not wait. Called before the
/// statement's SQLite transaction begins: inside it, SQLite's snapshot would
/// never see the lock go. Statements that read no row of the table do not
/// come here: the catalog, the `cdc.*` objects (change tables, the change
/// function, `lsn_time_mapping`), `sp_spaceused` (row_estimate: it reads
/// `sys.dm_db_partition_stats`) and the parameter-only key comparison.
fn wait_to_read(conn: &Connection, path: &Path, cfg: &SimConfig, table: &TableName, isolation: Isolation) -> Result<(), SourceError> {
    match isolation {
        Isolation::ReadCommitted => wait_for_lock(conn, path, cfg, table),
        Isolation::Snapshot => Ok(()),
    }
}

/// Waits while a writer holds a lock on `table` ([`super::SimDb::hold_lock`]),
/// for up to `lock_timeout_ms`, then fails as SQL Server does: error 1222.
fn wait_for_lock(conn: &Connection, path: &Path, cfg: &SimConfig, table: &TableName) -> Result<(), SourceError> {
    let t = self::table(conn, path, table)?;
    let started = Instant::now();
    let mut waited = false;
    while let Some(holder) = db::lock_holder(conn, path, t.id).map_err(|e| map_err(path, e))? {
        if cfg.lock_timeout_ms.is_some_and(|ms| started.elapsed() >= Duration::from_millis(ms)) {
            return Err(crate::mssql::client::classify_server_error(
                1222,
                &format!("Lock request time out period exceeded: {table} is locked by {holder} (simulated)"),
                None,
            ));
        }
        waited = true;
        std::thread::sleep(Duration::from_millis(20));
    }
    if waited {
        tracing::debug!(%table, waited_ms = started.elapsed().as_millis() as u64, "the read waited behind a writer's lock");
    }
    Ok(())
}

/// Opens a connection, sleeps the configured latency and runs a due capture scan.
fn prepare(path: &Path) -> Result<(Connection, SimConfig), SimError> {
    let mut conn = db::open_conn(path)?;
    let cfg = db::load_config(&conn, path)?;
    if cfg.query_latency_ms > 0 {
        std::thread::sleep(Duration::from_millis(cfg.query_latency_ms));
    }
    db::capture_if_due(&mut conn, path)?;
    Ok((conn, cfg))
}

fn map_err(path: &Path, e: SimError) -> SourceError {
    match e {
        SimError::NoSuchTable(t) => SourceError::Config(format!("table {t} does not exist in sim://{}", path.display())),
        SimError::NotASimFile(..) => SourceError::Config(e.to_string()),
        other => other.into(),
    }
}

fn sql_err(path: &Path) -> impl Fn(rusqlite::Error) -> SourceError + '_ {
    move |source| map_err(path, SimError::Sqlite { path: path.display().to_string(), source })
}

fn check_isolation(cfg: &SimConfig, iso: Isolation, path: &Path) -> Result<(), SourceError> {
    if iso == Isolation::Snapshot && !cfg.allow_snapshot_isolation {
        return Err(SourceError::Config(format!(
            "SNAPSHOT isolation is not allowed in the database sim://{} (SQL Server error 3952). Allow it with \
             `mssql-cdc sim alter --db {} --set allow_snapshot_isolation=true` (on a real server: \
             ALTER DATABASE <db> SET ALLOW_SNAPSHOT_ISOLATION ON), or choose read-committed isolation",
            path.display(),
            path.display()
        )));
    }
    Ok(())
}

/// The hand-over point between a reader thread and its stream.
struct Sink {
    ready: Option<oneshot::Sender<Result<(), SourceError>>>,
    tx: mpsc::Sender<Result<RecordBatch, SourceError>>,
    batch_rows: usize,
    fault_after: Option<u64>,
    /// The SQL Server error number the armed fault raises (None: a dropped connection).
    fault_error: Option<u32>,
    rate: Option<u64>,
    started: Instant,
    sent: u64,
    what: FaultOn,
}

impl Sink {
    fn signal_ready(&mut self) {
        if let Some(r) = self.ready.take() {
            let _ = r.send(Ok(()));
        }
    }

    /// Sends a batch; false when the reader went away.
    fn send(&mut self, batch: RecordBatch) -> bool {
        let n = batch.num_rows() as u64;
        if self.tx.blocking_send(Ok(batch)).is_err() {
            return false;
        }
        self.sent += n;
        if let Some(rate) = self.rate {
            let due = Duration::from_secs_f64(self.sent as f64 / rate as f64);
            let spent = self.started.elapsed();
            if due > spent {
                std::thread::sleep(due - spent);
            }
        }
        true
    }

    fn fail(&mut self) {
        let what = match self.what {
            FaultOn::Snapshot => "snapshot read",
            FaultOn::Changes => "change read",
            FaultOn::Any => "read",
        };
        let rows = self.fault_after.unwrap_or(0);
        let err = match self.fault_error {
            // The server's numbered error, classified as the client classifies a real one.
            Some(number) => crate::mssql::client::classify_server_error(
                number,
                &format!("simulated server error {number} during a {what} after {rows} rows"),
                None,
            ),
            None => SourceError::Transient(format!("connection dropped (simulated fault) during a {what} after {rows} rows")),
        };
        let _ = self.tx.blocking_send(Err(err));
    }
}

/// Row builders a stream can fill.
trait Rows {
    type Row;
    fn push_row(&mut self, r: &Self::Row) -> Result<(), SourceError>;
    fn rows(&self) -> usize;
    fn finish_batch(&mut self) -> RecordBatch;
}

impl Rows for BatchBuilder {
    type Row = Vec<SqlValue>;
    fn push_row(&mut self, r: &Vec<SqlValue>) -> Result<(), SourceError> {
        self.push(r).map_err(SourceError::from)
    }
    fn rows(&self) -> usize {
        self.len()
    }
    fn finish_batch(&mut self) -> RecordBatch {
        self.finish()
    }
}

impl Rows for ChangeBatchBuilder {
    type Row = ChangeRow;
    fn push_row(&mut self, r: &ChangeRow) -> Result<(), SourceError> {
        self.push(r)
    }
    fn rows(&self) -> usize {
        self.len()
    }
    fn finish_batch(&mut self) -> RecordBatch {
        self.finish()
    }
}

/// Cuts rows into batches, applies an armed fault, and stops when the reader goes away.
struct Emitter<'s, B: Rows> {
    sink: &'s mut Sink,
    b: B,
    delivered: u64,
    stopped: bool,
}

impl<'s, B: Rows> Emitter<'s, B> {
    /// Starts emitting; the call that opened the stream returns now.
    fn new(sink: &'s mut Sink, b: B) -> Self {
        sink.signal_ready();
        Emitter { sink, b, delivered: 0, stopped: false }
    }

    /// Adds a row; false when the stream must end.
    fn push(&mut self, row: &B::Row) -> Result<bool, SourceError> {
        if self.stopped {
            return Ok(false);
        }
        if self.sink.fault_after == Some(self.delivered) {
            self.flush();
            self.sink.fail();
            self.stopped = true;
            return Ok(false);
        }
        self.b.push_row(row)?;
        self.delivered += 1;
        if self.b.rows() >= self.sink.batch_rows && !self.flush() {
            self.stopped = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn flush(&mut self) -> bool {
        if self.b.rows() == 0 {
            return true;
        }
        let batch = self.b.finish_batch();
        self.sink.send(batch)
    }

    fn finish(mut self) {
        if self.stopped {
            return;
        }
        if self.flush() && self.sink.fault_after.is_some() {
            // The read held fewer rows than the fault waits for: it fails at the end.
            self.sink.fail();
        }
    }
}

/// How a key range maps onto the sorted row index.
struct RangePlan {
    /// Lower byte bound (inclusive); empty = none.
    lo: Vec<u8>,
    /// Upper byte bound (exclusive).
    hi: Option<Vec<u8>>,
    /// True when the byte range holds exactly the rows of the key range (no Rust filter needed).
    exact: bool,
    /// True when the index orders rows by the requested keys.
    ordered: bool,
}

fn plan_range(t: &TableMeta, key_pos: &[usize], range: &KeyRange) -> RangePlan {
    let prefix = !key_pos.is_empty() && key_pos.len() <= t.key_cols.len() && key_pos == &t.key_cols[..key_pos.len()];
    let nullable = key_pos.iter().any(|&i| t.spec.columns[i].nullable);
    if !prefix || (nullable && range.lo.is_none() && range.hi.is_some()) {
        return RangePlan { lo: vec![], hi: None, exact: false, ordered: prefix };
    }
    let types: Vec<keys::KeyCol> = key_types(t, key_pos);
    let canonical = |k: &Key| {
        k.len() == types.len() && k.iter().zip(&types).all(|(v, c)| db::coerce_value(v.clone(), &c.ty).map(|x| x == *v).unwrap_or(false))
    };
    let exact = !nullable && range.lo.as_ref().is_none_or(|k| canonical(k)) && range.hi.as_ref().is_none_or(|k| canonical(k));
    let lo = range.lo.as_ref().map(|k| keys::encode_key(&types, k)).unwrap_or_default();
    let hi = range.hi.as_ref().and_then(|k| {
        let e = keys::encode_key(&types, k);
        if exact {
            Some(e)
        } else {
            keys::prefix_successor(&e)
        }
    });
    RangePlan { lo, hi, exact, ordered: true }
}

/// Visits the rows of a table within a byte range, in index order, page by
/// page; `f` returns false to stop.
fn scan_rows(
    conn: &Connection,
    path: &Path,
    t: &TableMeta,
    plan: &RangePlan,
    mut f: impl FnMut(Vec<SqlValue>) -> Result<bool, SourceError>,
) -> Result<(), SourceError> {
    let first = "SELECT sk, data FROM rows WHERE table_id = ?1 AND sk >= ?2 AND (?3 IS NULL OR sk < ?3) ORDER BY sk LIMIT ?4";
    let next = "SELECT sk, data FROM rows WHERE table_id = ?1 AND sk > ?2 AND (?3 IS NULL OR sk < ?3) ORDER BY sk LIMIT ?4";
    let mut cursor: Option<Vec<u8>> = None;
    loop {
        let mut st = conn.prepare_cached(if cursor.is_some() { next } else { first }).map_err(sql_err(path))?;
        let from = cursor.clone().unwrap_or_else(|| plan.lo.clone());
        let page: Vec<(Vec<u8>, String)> = st
            .query_map(params![t.id, from, plan.hi, PAGE_ROWS], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(sql_err(path))?
            .collect::<rusqlite::Result<_>>()
            .map_err(sql_err(path))?;
        let n = page.len() as i64;
        for (sk, data) in page {
            let row = t.decode_row(&data).map_err(|e| map_err(path, e))?;
            cursor = Some(sk);
            if !f(row)? {
                return Ok(());
            }
        }
        if n < PAGE_ROWS {
            return Ok(());
        }
    }
}

/// A key's values converted to the key columns' types, as a comparison with the columns converts them.
fn typed_key(cols: &[keys::KeyCol], key: &[SqlValue]) -> Result<Key, SourceError> {
    if key.len() != cols.len() {
        return Err(SourceError::Config(format!("a key has {} values for {} key columns", key.len(), cols.len())));
    }
    cols.iter().zip(key).map(|(c, v)| crate::sim::bounds::bound_as_compared(&c.ty, v)).collect()
}

fn key_types(t: &TableMeta, key_pos: &[usize]) -> Vec<keys::KeyCol> {
    key_pos.iter().map(|&i| t.spec.key_col(i)).collect()
}

fn key_positions(t: &TableMeta, keys: &[String]) -> Result<Vec<usize>, SourceError> {
    keys.iter()
        .map(|k| {
            t.column_index(k).ok_or_else(|| SourceError::Config(format!("table {} has no column '{k}' to cut ranges on", t.spec.name)))
        })
        .collect()
}

/// Where each column a snapshot read names is in the table's rows; None for
/// a captured column that was dropped (its id is gone), read as NULL as the
/// client reads one. A captured column renamed since (its id still there
/// under another name) is refused, naming the rename: a SELECT of the old
/// name fails on SQL Server (error 207), and the engine never asks for one
/// (`engine::check_no_renamed_columns`), so reading NULL here would only hide
/// a step that forgot to ask.
fn read_positions(conn: &Connection, path: &Path, t: &TableMeta, columns: &[ColumnDesc]) -> Result<Vec<Option<usize>>, SourceError> {
    let mut renamed: Option<std::collections::BTreeMap<String, String>> = None;
    let mut out = Vec::with_capacity(columns.len());
    for c in columns {
        if let Some(i) = t.column_index(&c.name) {
            out.push(Some(i));
            continue;
        }
        if renamed.is_none() {
            let instances = db::load_instances(conn, path, Some(t.id)).map_err(|e| map_err(path, e))?;
            renamed = Some(instances.into_iter().flat_map(|i| i.info.renamed).collect());
        }
        let now = renamed.as_ref().and_then(|r| r.iter().find(|(old, _)| old.eq_ignore_ascii_case(&c.name)).map(|(_, now)| now.clone()));
        if let Some(now) = now {
            return Err(SourceError::Config(format!(
                "invalid column name '{}' in a read of {} (SQL Server error 207): the column was renamed to '{now}', and its capture \
                 instance still captures it as '{}'; read a capture instance that captures '{now}'",
                c.name, t.spec.name, c.name
            )));
        }
        out.push(None);
    }
    Ok(out)
}

fn table(conn: &Connection, path: &Path, name: &TableName) -> Result<TableMeta, SourceError> {
    db::find_table(conn, path, name).map_err(|e| map_err(path, e))
}

/// The source table as the catalog shows it to the caller (`sys.columns`,
/// `OBJECT_ID`): a table it has no permission on does not exist for it, as a
/// missing one does not (the client cannot tell them apart, and says both).
fn visible_table(conn: &Connection, path: &Path, g: &Guard, name: &TableName) -> Result<TableMeta, SourceError> {
    match db::find_table(conn, path, name) {
        Ok(t) if g.sees(&t.spec.name.schema, &t.spec.name.name) => Ok(t),
        Ok(_) => Err(grants::table_hidden(name, g.login())),
        Err(SimError::NoSuchTable(_)) if g.login().is_some() => Err(grants::table_hidden(name, g.login())),
        Err(e) => Err(map_err(path, e)),
    }
}

/// A statement that reads `columns` of the source table `t` (none: `COUNT_BIG(*)`).
fn read_columns(g: &Guard, t: &TableMeta, columns: &[String]) -> Result<(), SourceError> {
    let names: Vec<&str> = columns.iter().map(String::as_str).collect();
    g.check_select_columns(&t.spec.name.schema, &t.spec.name.name, &names, &g.context(None))
}

fn lsn_of(b: Vec<u8>, path: &Path) -> Result<Lsn, SourceError> {
    db::lsn_from_blob(b).map_err(|e| map_err(path, e))
}

#[async_trait]
impl CdcSource for SimSource {
    fn describe(&self) -> String {
        self.url()
    }

    async fn max_lsn(&self) -> Result<Option<Lsn>, SourceError> {
        self.call(|c, p, _| db::max_lsn(c, p).map_err(|e| map_err(p, e))).await
    }

    async fn min_lsn(&self, capture_instance: &str) -> Result<Option<Lsn>, SourceError> {
        let (name, login) = (capture_instance.to_string(), self.login.clone());
        self.call(move |c, p, _| {
            let g = Guard::load(c, p, login.as_deref())?;
            let Some(i) = db::find_instance(c, p, &name).map_err(|e| map_err(p, e))? else { return Ok(None) };
            let t = self::table(c, p, &i.info.table)?;
            // The server's answer: the instance's start, or all zeros to a
            // caller its change data is closed to (read as None, as the client reads it).
            let open = g.opens_change_data(&t, &i);
            let answer = if open { i.info.start_lsn.filter(|l| !l.is_zero()) } else { None };
            if open {
                return Ok(answer);
            }
            // The client then reads the instance's row of cdc.change_tables (sql::instance_catalog).
            g.check_select_columns(CDC_SCHEMA, "change_tables", &["start_lsn", "role_name", "source_object_id", "capture_instance"], &g.context(None))?;
            let catalog = InstanceCatalog { start_lsn: i.info.start_lsn, grants: g.instance_grants(&t, &i) };
            grants::read_min_lsn(answer, Some(&catalog), g.login())
        })
        .await
    }

    async fn increment_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError> {
        Ok(lsn.increment())
    }

    async fn decrement_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError> {
        Ok(lsn.decrement())
    }

    async fn table_info(&self, table: &TableName) -> Result<TableInfo, SourceError> {
        let (name, login) = (table.clone(), self.login.clone());
        self.call(move |c, p, _| {
            let g = Guard::load(c, p, login.as_deref())?;
            let t = visible_table(c, p, &g, &name)?;
            Ok(TableInfo { name: t.spec.name.clone(), unique_key: t.unique_key(), columns: t.spec.columns })
        })
        .await
    }

    async fn capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>, SourceError> {
        let (name, login) = (table.clone(), self.login.clone());
        self.call(move |c, p, _| {
            let g = Guard::load(c, p, login.as_deref())?;
            let ctx = g.context(None);
            // The client's three catalog reads (sql::capture_instances,
            // captured_columns, index_columns), in its order: the last two
            // only when the first found an instance.
            g.check_select_columns(
                CDC_SCHEMA,
                "change_tables",
                &["capture_instance", "start_lsn", "role_name", "source_object_id", "create_date", "object_id"],
                &ctx,
            )?;
            let t = match db::find_table(c, p, &name) {
                // OBJECT_ID is NULL for a table the caller cannot see: no instance matches it.
                Ok(t) if !g.sees(&t.spec.name.schema, &t.spec.name.name) => return Ok(vec![]),
                Ok(t) => t,
                Err(SimError::NoSuchTable(_)) if g.login().is_some() => return Ok(vec![]),
                Err(e) => return Err(map_err(p, e)),
            };
            let instances = db::load_instances(c, p, Some(t.id)).map_err(|e| map_err(p, e))?;
            if instances.is_empty() {
                return Ok(vec![]);
            }
            g.check_select_columns(CDC_SCHEMA, "captured_columns", &["object_id", "column_name", "column_id", "column_ordinal", "is_computed"], &ctx)?;
            g.check_select_columns(CDC_SCHEMA, "index_columns", &["object_id", "column_name", "index_ordinal"], &ctx)?;
            let mut out = Vec::with_capacity(instances.len());
            for i in instances {
                // The captured columns' types come from the change table's
                // sys.columns, which shows nothing to a caller without a
                // permission on it: the instance would list no column, and
                // the client refuses such an answer.
                if !g.sees(CDC_SCHEMA, &format!("{}_CT", i.info.name)) {
                    return Err(grants::change_table_hidden(&i.info.name, g.login()));
                }
                out.push(i.info);
            }
            Ok(out)
        })
        .await
    }

    async fn changes(
        &self,
        capture_instance: &CaptureInstance,
        from: Lsn,
        to: Lsn,
        filter: RowFilter,
        batch_rows: usize,
    ) -> Result<BatchStream, SourceError> {
        let name = capture_instance.name.clone();
        let login = self.login.clone();
        self.stream(FaultOn::Changes, batch_rows, move |conn, path, _cfg, sink| {
            let g = Guard::load(conn, path, login.as_deref())?;
            let inst = db::find_instance(conn, path, &name)
                .map_err(|e| map_err(path, e))?
                .ok_or_else(|| SourceError::Config(format!("capture instance '{name}' does not exist in sim://{}", path.display())))?;
            let t = self::table(conn, path, &inst.info.table)?;
            let ctx = ErrorContext { range: Some((name.clone(), from, to)), ..g.context(Some(g.instance_grants(&t, &inst))) };
            // What the client's statements touch: cdc.change_tables and the
            // change table's catalog (sql::change_table_has_command_id), then
            // the change function, the change table's ordering columns (when
            // it has __$command_id and the catalog showed it) and the time mapping.
            g.check_select_columns(CDC_SCHEMA, "change_tables", &["object_id", "capture_instance"], &ctx)?;
            let change_table = format!("{}_CT", inst.info.name);
            let function = format!("fn_cdc_get_all_changes_{}", inst.info.name);
            let with_command_id = inst.ct_command_id && g.sees(CDC_SCHEMA, &change_table);
            g.check_select_object(CDC_SCHEMA, &function, &ctx)?;
            if with_command_id {
                g.check_select_columns(CDC_SCHEMA, &change_table, &CHANGE_TABLE_ORDER_COLUMNS, &ctx)?;
            }
            g.check_select_columns(CDC_SCHEMA, "lsn_time_mapping", &["start_lsn", "tran_end_time"], &ctx)?;
            // The function's own check: the captured columns and the gating role.
            if !g.opens_change_data(&t, &inst) {
                return Err(g.denied(CDC_SCHEMA, &function, None, &ctx));
            }
            let unavailable = |reason: String| SourceError::RangeUnavailable { capture_instance: name.clone(), from, to, reason };
            let max = db::max_lsn(conn, path).map_err(|e| map_err(path, e))?;
            let Some(min) = inst.info.start_lsn else {
                return Err(unavailable("the instance's validity interval has no start yet".into()));
            };
            let Some(max) = max else {
                return Err(unavailable("the capture job has not recorded any LSN yet (max LSN is NULL)".into()));
            };
            if from > to {
                return Err(unavailable(format!("from {from} is above to {to}")));
            }
            if from < min {
                return Err(unavailable(format!("from {from} is below the instance's min LSN {min} (cleanup removed older changes)")));
            }
            if to > max {
                return Err(unavailable(format!("to {to} is above the max LSN {max}")));
            }
            let columns = inst.info.columns.clone();
            let mut em = Emitter::new(sink, ChangeBatchBuilder::new(&columns));
            // The change function has no __$command_id; it is read from the
            // change table when that has the column. An old change table
            // (before KB3030352) has none: the rows come in
            // (start_lsn, seqval, operation) order with the column NULL, and
            // the command id (kept here only as the storage key) is read as
            // 0, so it neither orders nor leaks. A change table hidden from
            // the caller reads as one without the column, as the client's
            // catalog check (which finds no such column) reads it.
            let ct_command_id = with_command_id;
            let (cmd, order) = if ct_command_id {
                ("c.command_id", "c.start_lsn, c.command_id, c.seqval, c.operation")
            } else {
                ("0", "c.start_lsn, c.seqval, c.operation")
            };
            let sql = format!(
                "SELECT c.start_lsn, {cmd}, c.seqval, c.operation, c.data, m.tran_end_ticks
                 FROM changes c LEFT JOIN lsn_time_mapping m ON m.start_lsn = c.start_lsn
                 WHERE c.instance_id = ?1 AND (c.start_lsn, {cmd}, c.seqval, c.operation) > (?2, ?3, ?4, ?5)
                   AND c.start_lsn <= ?6 {}
                 ORDER BY {order} LIMIT ?7",
                if filter == RowFilter::All { "AND c.operation <> 3" } else { "" }
            );
            let mut cur: (Vec<u8>, i64, Vec<u8>, i64) = (from.0.to_vec(), i64::MIN, Vec::new(), i64::MIN);
            loop {
                let mut st = conn.prepare_cached(&sql).map_err(sql_err(path))?;
                type Raw = (Vec<u8>, i64, Vec<u8>, i64, String, Option<i64>);
                let page: Vec<Raw> = st
                    .query_map(params![inst.id, cur.0, cur.1, cur.2, cur.3, to.0.to_vec(), PAGE_ROWS], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
                    })
                    .map_err(sql_err(path))?
                    .collect::<rusqlite::Result<_>>()
                    .map_err(sql_err(path))?;
                let n = page.len() as i64;
                for (start, cmd, seq, op, data, end) in page {
                    let values: Vec<SqlValue> = serde_json::from_str(&data)
                        .map_err(|e| SourceError::Other(format!("malformed change row in sim://{}: {e}", path.display())))?;
                    let row = ChangeRow {
                        start_lsn: lsn_of(start.clone(), path)?,
                        seqval: lsn_of(seq.clone(), path)?,
                        operation: op as i32,
                        command_id: ct_command_id.then_some(cmd as i32),
                        tran_end_time: end.map(db::from_ticks),
                        values,
                    };
                    cur = (start, cmd, seq, op);
                    if !em.push(&row)? {
                        return Ok(());
                    }
                }
                if n < PAGE_ROWS {
                    break;
                }
            }
            em.finish();
            Ok(())
        })
        .await
    }

    async fn snapshot_read(&self, read: &SnapshotRead) -> Result<BatchStream, SourceError> {
        self.table_read(read, None, None).await
    }

    async fn snapshot_read_fenced(&self, read: &SnapshotRead) -> Result<FencedRead, SourceError> {
        let (tx, fence) = crate::source::fence_channel();
        let batches = self.table_read(read, Some(tx), None).await?;
        Ok(FencedRead { batches, fence })
    }

    async fn snapshot_read_then_max_lsn(&self, read: &SnapshotRead) -> Result<ReadThenMaxLsn, SourceError> {
        let (tx, max_lsn_after) = crate::source::max_lsn_channel();
        let batches = self.table_read(read, None, Some(tx)).await?;
        Ok(ReadThenMaxLsn { batches, max_lsn_after: Some(max_lsn_after) })
    }

    async fn key_extent(&self, table: &TableName, keys: &[String], isolation: Isolation) -> Result<Option<(Key, Key)>, SourceError> {
        let (name, keys, login) = (table.clone(), keys.to_vec(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            // MIN/MAX (or TOP (1) each way) reads the table: it waits behind a writer.
            wait_to_read(c, p, cfg, &name, isolation)?;
            let tx = c.transaction().map_err(sql_err(p))?;
            let t = self::table(&tx, p, &name)?;
            read_columns(&Guard::load(&tx, p, login.as_deref())?, &t, &keys)?;
            let key_pos = key_positions(&t, &keys)?;
            let nullable = key_pos.iter().any(|&i| t.spec.columns[i].nullable);
            let plan = plan_range(&t, &key_pos, &KeyRange::all());
            let extract = |row: &[SqlValue]| -> Key { key_pos.iter().map(|&i| row[i].clone()).collect() };
            if plan.ordered && !nullable {
                let q = |dir: &str| -> Result<Option<Key>, SourceError> {
                    let d: Option<String> = tx
                        .query_row(&format!("SELECT data FROM rows WHERE table_id = ?1 ORDER BY sk {dir} LIMIT 1"), [t.id], |r| r.get(0))
                        .optional()
                        .map_err(sql_err(p))?;
                    d.map(|d| t.decode_row(&d).map(|r| extract(&r)).map_err(|e| map_err(p, e))).transpose()
                };
                return Ok(match (q("ASC")?, q("DESC")?) {
                    (Some(a), Some(b)) => Some((a, b)),
                    _ => None,
                });
            }
            let mut ext: Option<(Key, Key)> = None;
            scan_rows(&tx, p, &t, &plan, |row| {
                let k = extract(&row);
                if k.iter().any(SqlValue::is_null) {
                    return Ok(true);
                }
                ext = Some(match ext.take() {
                    None => (k.clone(), k),
                    Some((lo, hi)) => {
                        // MIN and MAX as the server orders: by the sort keys (collations included).
                        let sk = |x: &Key| keys::encode_key(&key_types(&t, &key_pos), x);
                        let lo = if sk(&k) < sk(&lo) { k.clone() } else { lo };
                        let hi = if sk(&k) > sk(&hi) { k } else { hi };
                        (lo, hi)
                    }
                });
                Ok(true)
            })?;
            Ok(ext)
        })
        .await
    }

    async fn slice_counts(
        &self,
        table: &TableName,
        key: &str,
        lo: i64,
        hi: i64,
        width: i64,
        isolation: Isolation,
    ) -> Result<Vec<(i64, u64)>, SourceError> {
        let (name, key, login) = (table.clone(), key.to_string(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            if width <= 0 {
                return Err(SourceError::Config(format!("slice width must be positive, got {width}")));
            }
            wait_to_read(c, p, cfg, &name, isolation)?;
            let tx = c.transaction().map_err(sql_err(p))?;
            let t = self::table(&tx, p, &name)?;
            read_columns(&Guard::load(&tx, p, login.as_deref())?, &t, std::slice::from_ref(&key))?;
            let pos = key_positions(&t, std::slice::from_ref(&key))?[0];
            if !t.spec.columns[pos].sql_type.is_integer() {
                return Err(SourceError::Config(format!("column '{key}' of {} is not an integer column", t.spec.name)));
            }
            let mut counts: std::collections::BTreeMap<i64, u64> = Default::default();
            let mut add = |v: i64| {
                if v >= lo && v <= hi {
                    let i = (v as i128 - lo as i128) / width as i128;
                    let start = (lo as i128 + i * width as i128) as i64;
                    *counts.entry(start).or_default() += 1;
                }
            };
            if hi < lo {
                return Ok(vec![]);
            }
            if t.key_cols.first() == Some(&pos) {
                // The leading key column: count straight from the index keys.
                let ty = &t.spec.columns[pos].sql_type;
                let from = keys::encode_key(&[keys::KeyCol::plain(ty.clone())], &[SqlValue::Int(lo)]);
                let to = keys::prefix_successor(&keys::encode_key(&[keys::KeyCol::plain(ty.clone())], &[SqlValue::Int(hi)]));
                let mut st = tx
                    .prepare("SELECT sk FROM rows WHERE table_id = ?1 AND sk >= ?2 AND (?3 IS NULL OR sk < ?3)")
                    .map_err(sql_err(p))?;
                let mut rows = st.query(params![t.id, from, to]).map_err(sql_err(p))?;
                while let Some(r) = rows.next().map_err(sql_err(p))? {
                    let sk: Vec<u8> = r.get(0).map_err(sql_err(p))?;
                    if let Some(v) = keys::decode_leading_int(&sk) {
                        add(v);
                    }
                }
            } else {
                let plan = RangePlan { lo: vec![], hi: None, exact: false, ordered: false };
                scan_rows(&tx, p, &t, &plan, |row| {
                    if let SqlValue::Int(v) = row[pos] {
                        add(v);
                    }
                    Ok(true)
                })?;
            }
            Ok(counts.into_iter().collect())
        })
        .await
    }

    async fn slice_extent(&self, table: &TableName, key: &str, lo: i64, hi: i64, isolation: Isolation) -> Result<Option<(i64, i64)>, SourceError> {
        let (name, key, login) = (table.clone(), key.to_string(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            wait_to_read(c, p, cfg, &name, isolation)?;
            let tx = c.transaction().map_err(sql_err(p))?;
            let t = self::table(&tx, p, &name)?;
            read_columns(&Guard::load(&tx, p, login.as_deref())?, &t, std::slice::from_ref(&key))?;
            let pos = key_positions(&t, std::slice::from_ref(&key))?[0];
            if !t.spec.columns[pos].sql_type.is_integer() {
                return Err(SourceError::Config(format!("column '{key}' of {} is not an integer column", t.spec.name)));
            }
            if hi < lo {
                return Ok(None);
            }
            if t.key_cols.first() == Some(&pos) {
                // The leading key column: the first and the last index key in [lo, hi], as a seek each way.
                let ty = &t.spec.columns[pos].sql_type;
                let from = keys::encode_key(&[keys::KeyCol::plain(ty.clone())], &[SqlValue::Int(lo)]);
                let to = keys::prefix_successor(&keys::encode_key(&[keys::KeyCol::plain(ty.clone())], &[SqlValue::Int(hi)]));
                let end = |dir: &str| -> Result<Option<i64>, SourceError> {
                    let sk: Option<Vec<u8>> = tx
                        .query_row(
                            &format!("SELECT sk FROM rows WHERE table_id = ?1 AND sk >= ?2 AND (?3 IS NULL OR sk < ?3) ORDER BY sk {dir} LIMIT 1"),
                            params![t.id, from, to],
                            |r| r.get(0),
                        )
                        .optional()
                        .map_err(sql_err(p))?;
                    Ok(sk.and_then(|sk| keys::decode_leading_int(&sk)))
                };
                let (first, last) = (end("ASC")?, end("DESC")?);
                return Ok(first.zip(last));
            }
            // Any other column: every row's own value.
            let mut ext: Option<(i64, i64)> = None;
            let plan = RangePlan { lo: vec![], hi: None, exact: false, ordered: false };
            scan_rows(&tx, p, &t, &plan, |row| {
                if let SqlValue::Int(v) = row[pos] {
                    if v >= lo && v <= hi {
                        ext = Some(match ext {
                            None => (v, v),
                            Some((a, b)) => (a.min(v), b.max(v)),
                        });
                    }
                }
                Ok(true)
            })?;
            Ok(ext)
        })
        .await
    }

    async fn null_count(&self, table: &TableName, key: &str, isolation: Isolation) -> Result<u64, SourceError> {
        let (name, key, login) = (table.clone(), key.to_string(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            wait_to_read(c, p, cfg, &name, isolation)?;
            let tx = c.transaction().map_err(sql_err(p))?;
            let t = self::table(&tx, p, &name)?;
            read_columns(&Guard::load(&tx, p, login.as_deref())?, &t, std::slice::from_ref(&key))?;
            let pos = key_positions(&t, std::slice::from_ref(&key))?[0];
            // Every row's stored value, read from the rows themselves (no index on a NULL).
            let mut n = 0u64;
            let plan = RangePlan { lo: vec![], hi: None, exact: false, ordered: false };
            scan_rows(&tx, p, &t, &plan, |row| {
                if row[pos].is_null() {
                    n += 1;
                }
                Ok(true)
            })?;
            Ok(n)
        })
        .await
    }

    async fn bucket_sums(
        &self,
        table: &TableName,
        key: &str,
        lo: i64,
        hi: i64,
        width: i64,
        isolation: Isolation,
    ) -> Result<Vec<(i64, u64, i128)>, SourceError> {
        let (name, key, login) = (table.clone(), key.to_string(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            if width <= 0 {
                return Err(SourceError::Config(format!("bucket width must be positive, got {width}")));
            }
            wait_to_read(c, p, cfg, &name, isolation)?;
            let tx = c.transaction().map_err(sql_err(p))?;
            let t = self::table(&tx, p, &name)?;
            read_columns(&Guard::load(&tx, p, login.as_deref())?, &t, std::slice::from_ref(&key))?;
            let pos = key_positions(&t, std::slice::from_ref(&key))?[0];
            if !t.spec.columns[pos].sql_type.is_integer() {
                return Err(SourceError::Config(format!("column '{key}' of {} is not an integer column", t.spec.name)));
            }
            let mut sums: std::collections::BTreeMap<i64, (u64, i128)> = Default::default();
            let mut add = |v: i64| {
                if v >= lo && v <= hi {
                    let i = (v as i128 - lo as i128) / width as i128;
                    let start = (lo as i128 + i * width as i128) as i64;
                    let e = sums.entry(start).or_default();
                    e.0 += 1;
                    e.1 += v as i128;
                }
            };
            if hi < lo {
                return Ok(vec![]);
            }
            if t.key_cols.first() == Some(&pos) {
                let ty = &t.spec.columns[pos].sql_type;
                let from = keys::encode_key(&[keys::KeyCol::plain(ty.clone())], &[SqlValue::Int(lo)]);
                let to = keys::prefix_successor(&keys::encode_key(&[keys::KeyCol::plain(ty.clone())], &[SqlValue::Int(hi)]));
                let mut st = tx
                    .prepare("SELECT sk FROM rows WHERE table_id = ?1 AND sk >= ?2 AND (?3 IS NULL OR sk < ?3)")
                    .map_err(sql_err(p))?;
                let mut rows = st.query(params![t.id, from, to]).map_err(sql_err(p))?;
                while let Some(r) = rows.next().map_err(sql_err(p))? {
                    let sk: Vec<u8> = r.get(0).map_err(sql_err(p))?;
                    if let Some(v) = keys::decode_leading_int(&sk) {
                        add(v);
                    }
                }
            } else {
                let plan = RangePlan { lo: vec![], hi: None, exact: false, ordered: false };
                scan_rows(&tx, p, &t, &plan, |row| {
                    if let SqlValue::Int(v) = row[pos] {
                        add(v);
                    }
                    Ok(true)
                })?;
            }
            Ok(sums.into_iter().map(|(k, (n, s))| (k, n, s)).collect())
        })
        .await
    }

    async fn compare_keys(&self, table: &TableName, keys: &[String], pairs: &[(Key, Key)]) -> Result<Vec<std::cmp::Ordering>, SourceError> {
        let (name, keys, pairs, login) = (table.clone(), keys.to_vec(), pairs.to_vec(), self.login.clone());
        self.call(move |c, p, _cfg| {
            // No wait behind a writer's lock: the client's statements read the
            // catalog (sys.columns) and compare parameters (`SELECT CASE ...`
            // with no FROM), never the table (sql::key_compare).
            let tx = c.transaction().map_err(sql_err(p))?;
            // The client reads the columns' collations from the catalog (sql::column_collations).
            let t = visible_table(&tx, p, &Guard::load(&tx, p, login.as_deref())?, &name)?;
            let key_pos = key_positions(&t, &keys)?;
            // Each value as the comparison converts it (the bound rules of a
            // range predicate), then ordered by the simulator's sort keys.
            let cols = key_types(&t, &key_pos);
            pairs
                .iter()
                .map(|(a, b)| {
                    let (a, b) = (typed_key(&cols, a)?, typed_key(&cols, b)?);
                    Ok(keys::encode_key(&cols, &a).cmp(&keys::encode_key(&cols, &b)))
                })
                .collect()
        })
        .await
    }

    async fn key_seek(&self, table: &TableName, keys: &[String], range: &KeyRange, n: u64, isolation: Isolation) -> Result<Option<Key>, SourceError> {
        let (name, keys, range, login) = (table.clone(), keys.to_vec(), range.clone(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            // The TOP (n+1) seek reads the table's rows: it waits behind a writer.
            wait_to_read(c, p, cfg, &name, isolation)?;
            let tx = c.transaction().map_err(sql_err(p))?;
            let t = self::table(&tx, p, &name)?;
            read_columns(&Guard::load(&tx, p, login.as_deref())?, &t, &keys)?;
            let key_pos = key_positions(&t, &keys)?;
            let pred = RangePredicate::new(&key_types(&t, &key_pos), &range)?;
            let plan = plan_range(&t, &key_pos, pred.typed());
            let extract = |row: &[SqlValue]| -> Key { key_pos.iter().map(|&i| row[i].clone()).collect() };
            if plan.exact {
                let d: Option<String> = tx
                    .query_row(
                        "SELECT data FROM rows WHERE table_id = ?1 AND sk >= ?2 AND (?3 IS NULL OR sk < ?3) ORDER BY sk LIMIT 1 OFFSET ?4",
                        params![t.id, plan.lo, plan.hi, n.min(i64::MAX as u64) as i64],
                        |r| r.get(0),
                    )
                    .optional()
                    .map_err(sql_err(p))?;
                return d.map(|d| t.decode_row(&d).map(|r| extract(&r)).map_err(|e| map_err(p, e))).transpose();
            }
            if plan.ordered {
                let mut seen = 0u64;
                let mut found = None;
                scan_rows(&tx, p, &t, &plan, |row| {
                    let k = extract(&row);
                    if !pred.holds(&k) {
                        return Ok(true);
                    }
                    if seen == n {
                        found = Some(k);
                        return Ok(false);
                    }
                    seen += 1;
                    Ok(true)
                })?;
                return Ok(found);
            }
            // Not in index order (a heap, or keys that are not the index's
            // leading columns): the (n+1)-th key by the sort keys' order.
            let mut all: Vec<(Vec<u8>, Key)> = Vec::new();
            scan_rows(&tx, p, &t, &plan, |row| {
                let k = extract(&row);
                if pred.holds(&k) {
                    all.push((pred.sort_key(&k), k));
                }
                Ok(true)
            })?;
            let n = n as usize;
            if n >= all.len() {
                return Ok(None);
            }
            let (_, k, _) = all.select_nth_unstable_by(n, |a, b| a.0.cmp(&b.0));
            Ok(Some(k.1.clone()))
        })
        .await
    }

    async fn row_estimate(&self, table: &TableName) -> Result<u64, SourceError> {
        let (name, login) = (table.clone(), self.login.clone());
        // No wait behind a writer's lock: the client runs `EXEC
        // sys.sp_spaceused @objname` (sql::row_estimate, no isolation of its
        // own: the session's READ COMMITTED), which reads the partition
        // counts of sys.dm_db_partition_stats, never a row of the table, so
        // an open transaction on the table does not hold it up.
        self.call(move |c, p, _| {
            let g = Guard::load(c, p, login.as_deref())?;
            let t = self::table(c, p, &name)?;
            // sp_spaceused is open to public, but resolves @objname as the
            // catalog does: a table the caller has no permission on does not exist.
            if !g.sees(&t.spec.name.schema, &t.spec.name.name) {
                let text = format!(
                    "The object '{}' does not exist in database '{}' or is invalid for this operation.",
                    crate::mssql::sql::quote_table(&name),
                    g.database()
                );
                return Err(classify_server_error_in(15009, &text, &g.context(None)));
            }
            let n: i64 = c.query_row("SELECT count(*) FROM rows WHERE table_id = ?1", [t.id], |r| r.get(0)).map_err(sql_err(p))?;
            Ok(n as u64)
        })
        .await
    }

    async fn time_to_lsn(&self, op: TimeOp, local_time: NaiveDateTime) -> Result<Option<Lsn>, SourceError> {
        self.call(move |c, p, _| {
            let ticks = db::to_ticks(local_time);
            let sql = match op {
                TimeOp::LargestLessThan => "SELECT max(start_lsn) FROM lsn_time_mapping WHERE tran_end_ticks < ?1",
                TimeOp::LargestLessThanOrEqual => "SELECT max(start_lsn) FROM lsn_time_mapping WHERE tran_end_ticks <= ?1",
                TimeOp::SmallestGreaterThan => "SELECT min(start_lsn) FROM lsn_time_mapping WHERE tran_end_ticks > ?1",
                TimeOp::SmallestGreaterThanOrEqual => "SELECT min(start_lsn) FROM lsn_time_mapping WHERE tran_end_ticks >= ?1",
            };
            let b: Option<Vec<u8>> = c.query_row(sql, [ticks], |r| r.get(0)).map_err(sql_err(p))?;
            b.map(|b| lsn_of(b, p)).transpose()
        })
        .await
    }

    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<NaiveDateTime>, SourceError> {
        self.call(move |c, p, _| {
            let t: Option<i64> = c
                .query_row("SELECT tran_end_ticks FROM lsn_time_mapping WHERE start_lsn = ?1", [lsn.0.to_vec()], |r| r.get(0))
                .optional()
                .map_err(sql_err(p))?;
            Ok(t.map(db::from_ticks))
        })
        .await
    }

    async fn server_time_zone(&self) -> Result<ServerZone, SourceError> {
        self.call(|_, p, cfg| cfg.zone().map_err(|e| map_err(p, e))).await
    }

    /// The simulated server's clock (manual or wall) under its own rules,
    /// the clock its mapping rows are written in.
    async fn server_now(&self) -> Result<NaiveDateTime, SourceError> {
        self.call(|c, p, cfg| {
            let now = db::now_us(c, p, cfg).map_err(|e| map_err(p, e))?;
            let zone = cfg.clock_zone().map_err(|e| map_err(p, e))?;
            let at = DateTime::<Utc>::from_timestamp_micros(now).ok_or_else(|| SourceError::Other("the simulator's clock is out of range".into()))?;
            Ok(db::wall_clock(&zone, at))
        })
        .await
    }

    /// The simulated server converts with its own clock's rules (`zone_rules`,
    /// else its zone), as SQL Server's `AT TIME ZONE` applies its Windows
    /// rules: which may not be what the zone it reports means elsewhere.
    async fn server_local_times(&self, instants: &[DateTime<Utc>]) -> Result<Vec<NaiveDateTime>, SourceError> {
        let instants = instants.to_vec();
        self.call(move |_, p, cfg| {
            let rules = cfg.clock_zone().map_err(|e| map_err(p, e))?;
            Ok(instants.iter().map(|t| db::wall_clock(&rules, *t)).collect())
        })
        .await
    }

    async fn row_count(&self, table: &TableName, isolation: Isolation) -> Result<u64, SourceError> {
        let (name, login) = (table.clone(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            // COUNT_BIG(*) reads the table: it waits behind a writer.
            wait_to_read(c, p, cfg, &name, isolation)?;
            let t = self::table(c, p, &name)?;
            read_columns(&Guard::load(c, p, login.as_deref())?, &t, &[])?;
            let n: i64 = c.query_row("SELECT count(*) FROM rows WHERE table_id = ?1", [t.id], |r| r.get(0)).map_err(sql_err(p))?;
            Ok(n as u64)
        })
        .await
    }

    async fn date_bucket_sums(
        &self,
        table: &TableName,
        key: &str,
        lo: i64,
        hi: i64,
        width: i64,
        isolation: Isolation,
    ) -> Result<Vec<(i64, u64, i128)>, SourceError> {
        let (name, key, login) = (table.clone(), key.to_string(), self.login.clone());
        self.call(move |c, p, cfg| {
            check_isolation(cfg, isolation, p)?;
            if width <= 0 {
                return Err(SourceError::Config(format!("bucket width must be positive, got {width}")));
            }
            wait_to_read(c, p, cfg, &name, isolation)?;
            let tx = c.transaction().map_err(sql_err(p))?;
            let t = self::table(&tx, p, &name)?;
            read_columns(&Guard::load(&tx, p, login.as_deref())?, &t, std::slice::from_ref(&key))?;
            let pos = key_positions(&t, std::slice::from_ref(&key))?[0];
            if !crate::source::is_date_key(&t.spec.columns[pos].sql_type) {
                return Err(SourceError::Config(format!("column '{key}' of {} is not a date or datetime column", t.spec.name)));
            }
            let mut sums: std::collections::BTreeMap<i64, (u64, i128)> = Default::default();
            // Every row's stored value (as DATEDIFF_BIG reads the column, not an index).
            let plan = RangePlan { lo: vec![], hi: None, exact: false, ordered: false };
            scan_rows(&tx, p, &t, &plan, |row| {
                if let Some(v) = crate::source::micros_since_year_one(&row[pos]).filter(|v| *v >= lo && *v <= hi) {
                    let start = (lo as i128 + ((v as i128 - lo as i128) / width as i128) * width as i128) as i64;
                    let e = sums.entry(start).or_default();
                    e.0 += 1;
                    e.1 += v as i128;
                }
                Ok(true)
            })?;
            Ok(sums.into_iter().map(|(k, (n, s))| (k, n, s)).collect())
        })
        .await
    }
}
