//! [`MssqlSource`]: the [`CdcSource`] protocol over tiberius.
//!
//! Connections come from a small pool of our own: a call takes an idle
//! connection (or opens one), and gives it back only when its statement ran
//! to the end cleanly and the isolation level is back at READ COMMITTED. A
//! connection that saw any error, or whose stream was dropped part-way, is
//! closed instead: it may be out of step with the server.
//!
//! Reads are idempotent, so transient failures (dropped connections,
//! timeouts, deadlock victims, Azure's throttling codes) are retried on a
//! fresh connection with exponential backoff; a stream is retried only until
//! its first row has been handed out.
//!
//! Permissions (issue 12 §5): the client works with the per-object grants of
//! docs/sqlserver.md, no `SELECT ON SCHEMA::cdc` (why: [`super::grants`]).
//! Three of its readings changed for that, each because a missing grant
//! would otherwise pass unseen: a permission error names the statement that
//! fixes it ([`ErrorContext`] carries the login and the instance it needs);
//! `min_lsn` tells CDC refusing this login (all zeros for an instance that
//! has a `start_lsn`) from "no bound yet", and refuses the former instead of
//! letting a step's purge checks pass blind; and `capture_instances` refuses
//! an instance that shows no captured column (its change table is hidden
//! from the login) rather than describing it as capturing nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use backoff::backoff::Backoff;
use backoff::ExponentialBackoff;
use chrono::{DateTime, NaiveDateTime, Utc};
use deltalake::arrow::record_batch::RecordBatch;
use futures::StreamExt;
use tiberius::{Client, Row, ToSql};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use super::config::{MssqlConfig, PASSWORD_ENV};
use super::convert::{self, Bind};
use super::grants::{self, InstanceCatalog, InstanceGrants};
use super::sql::{self, KeyCol, LocalConversion, ReadColumn, Statement};
use super::windows_zones::{iana_to_windows, windows_to_iana};
use crate::lsn::Lsn;
use crate::source::{
    BatchStream, CaptureInstance, CdcSource, ChangeBatchBuilder, Isolation, KeyRange, RowFilter, ServerZone, SnapshotRead, FencedRead, ReadThenMaxLsn,
    SourceError, SourceSecrets, TableInfo, TableName, TimeOp, ZoneKind,
};
use crate::types::{BatchBuilder, ColumnDesc, Key, SqlType, SqlValue};

type Tds = Client<Compat<TcpStream>>;

/// A pooled connection and the isolation level its session is at.
struct Conn {
    client: Tds,
    isolation: Isolation,
}

/// What a failed statement was about, to name it in the error.
#[derive(Debug, Clone, Default)]
pub struct ErrorContext {
    /// The capture instance and LSN range of a changes read (for error 313).
    pub range: Option<(String, Lsn, Lsn)>,
    /// The login the statement ran as: the grantee of the statement a
    /// permission error names.
    pub login: Option<String>,
    /// A changes read's capture instance: what CDC's own check asks of the
    /// caller, for error 229 on its change function.
    pub instance: Option<InstanceGrants>,
}

type Ctx = ErrorContext;

struct Inner {
    cfg: MssqlConfig,
    password: String,
    idle: Mutex<Vec<Conn>>,
    /// Table descriptions by name, refreshed by every `table_info`; used for
    /// the types of key columns (bounds are cast to them).
    tables: Mutex<HashMap<TableName, TableInfo>>,
    /// Per capture instance, whether its change table has `__$command_id`
    /// (read once per process from the catalog; a table only gains the
    /// column through `sp_vupgrade_replication`, which a new process sees).
    has_command_id: Mutex<HashMap<String, bool>>,
    /// Per table, the collation of each string column by name (read once per
    /// process: `compare_keys` names it in every comparison it sends).
    collations: Mutex<HashMap<TableName, HashMap<String, String>>>,
    /// Per capture instance (lower case), what CDC checks of a caller, as the
    /// last `capture_instances` read it: only for naming a missing grant.
    instance_grants: Mutex<HashMap<String, InstanceGrants>>,
    /// How the server turns instants into its wall-clock time, settled by
    /// `server_time_zone` (which also checks a configured zone).
    conversion: Mutex<Option<LocalConversion>>,
}

/// A SQL Server CDC source over tiberius.
pub struct MssqlSource {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MssqlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MssqlSource({})", self.inner.cfg)
    }
}

/// A statement failure before classification, so callers can look at the server's code.
enum Fail {
    Tds(tiberius::error::Error),
    Source(SourceError),
}

impl Fail {
    fn into_source(self, ctx: &Ctx) -> SourceError {
        match self {
            Fail::Tds(e) => map_error(e, ctx),
            Fail::Source(e) => e,
        }
    }
}

impl From<tiberius::error::Error> for Fail {
    fn from(e: tiberius::error::Error) -> Self {
        Fail::Tds(e)
    }
}

impl From<SourceError> for Fail {
    fn from(e: SourceError) -> Self {
        Fail::Source(e)
    }
}

/// Classifies a tiberius error into the source's error kinds.
fn map_error(e: tiberius::error::Error, ctx: &Ctx) -> SourceError {
    use tiberius::error::Error as E;
    match &e {
        E::Server(t) => map_server_error(t.code(), t.message(), ctx),
        E::Io { .. } => SourceError::Transient(e.to_string()),
        E::Tls(m) => SourceError::Config(format!(
            "the TLS handshake with SQL Server failed ({m}); check ca_file, or trust_server_certificate for a self-signed test server"
        )),
        _ => SourceError::Other(e.to_string()),
    }
}

/// Classifies an error SQL Server reported, by its number, as this client
/// does; `range` is the capture instance and LSN range of a changes read (it
/// makes error 313 a [`SourceError::RangeUnavailable`]). Public so that the
/// simulator, which models the server's numbered errors, hands them to the
/// same classification a real server's errors get.
pub fn classify_server_error(code: u32, msg: &str, range: Option<(String, Lsn, Lsn)>) -> SourceError {
    map_server_error(code, msg, &Ctx { range, ..Ctx::default() })
}

/// [`classify_server_error`] with all the client knows about the statement:
/// the login and a changes read's instance too, which a permission error
/// (229, 230) needs to name the statement that fixes it. The simulator's
/// permission model raises its 229s through this.
pub fn classify_server_error_in(code: u32, msg: &str, ctx: &ErrorContext) -> SourceError {
    map_server_error(code, msg, ctx)
}

/// Classifies an error the server reported, by its number.
fn map_server_error(code: u32, msg: &str, ctx: &Ctx) -> SourceError {
    match code {
        18456 | 18452 | 18470 | 18486 | 18487 | 18488 => SourceError::Permission(format!(
            "SQL Server refused the login (error {code}): check the user name in the URL and the password in {PASSWORD_ENV}; {msg}"
        )),
        229 | 230 => SourceError::Permission(grants::denial_message(code, msg, ctx.login.as_deref(), ctx.instance.as_ref())),
        262 | 297 | 300 | 916 => {
            SourceError::Permission(format!("SQL Server error {code}: {msg} (see docs/sqlserver.md for the grants the reader needs)"))
        }
        // sp_spaceused resolves its @objname as the catalog does: an object
        // the login has no permission on does not exist for it.
        15009 => SourceError::Config(grants::hidden_object_message(msg, ctx.login.as_deref())),
        313 => match &ctx.range {
            Some((ci, from, to)) => {
                SourceError::RangeUnavailable { capture_instance: ci.clone(), from: *from, to: *to, reason: msg.to_string() }
            }
            None => SourceError::Other(format!("SQL Server error 313: {msg}")),
        },
        3952 => SourceError::Config(format!(
            "SNAPSHOT isolation is not allowed in this database (error 3952): run \
             ALTER DATABASE <db> SET ALLOW_SNAPSHOT_ISOLATION ON, or choose read-committed isolation; server: {msg}"
        )),
        208 => SourceError::Config(format!(
            "an object this source reads does not exist or the login cannot see it (error 208): {msg}; \
             check the table name, that CDC is enabled on the database and table, and the grants in docs/sqlserver.md"
        )),
        4060 => SourceError::Config(format!("cannot open the database named in the URL (error 4060): {msg}")),
        // Deadlock victim, lock timeout, memory pressure, dropped sessions and
        // Azure SQL's reconfiguration and throttling codes. 601: a NOLOCK
        // scan (the change function reads its table WITH (NOLOCK)) lost its
        // place to data movement; 3961: a SNAPSHOT transaction met a
        // concurrent DDL on an object it reads. Both pass on a new attempt.
        601 | 3961 | 1205 | 1222 | 701 | 8645 | 233 | 10053 | 10054 | 10060 | 64 | 121 | 4221 | 40197 | 40501 | 40613 | 49918 | 49919 | 49920
        | 10928 | 10929 | 40143 | 40540 => SourceError::Transient(format!("SQL Server error {code}: {msg}")),
        code => SourceError::Other(format!("SQL Server error {code}: {msg}")),
    }
}

/// The retry schedule for idempotent reads: from 200 ms, doubling, for at most a minute.
fn retry_schedule() -> ExponentialBackoff {
    ExponentialBackoff {
        initial_interval: Duration::from_millis(200),
        max_interval: Duration::from_secs(10),
        max_elapsed_time: Some(Duration::from_secs(60)),
        ..ExponentialBackoff::default()
    }
}

/// Reads a zone as the URL's `time_zone=` or the server names it: `UTC`, a
/// fixed offset (`UTC+02:00`, `-05:30`), a Windows name or an IANA name.
pub fn resolve_zone(text: &str) -> Option<ServerZone> {
    let t = text.trim();
    if ["utc", "gmt", "z", "etc/utc", "coordinated universal time"].contains(&t.to_ascii_lowercase().as_str()) {
        return Some(ServerZone::utc());
    }
    let off = t.strip_prefix("UTC").or_else(|| t.strip_prefix("GMT")).unwrap_or(t);
    if let Some(sign) = off.chars().next().filter(|c| *c == '+' || *c == '-') {
        let rest = &off[1..];
        let (h, m) = match rest.split_once(':') {
            Some((h, m)) => (h, m),
            None if rest.len() == 4 => (&rest[..2], &rest[2..]),
            None => (rest, "0"),
        };
        if let (Ok(h), Ok(m)) = (h.parse::<i32>(), m.parse::<i32>()) {
            if (0..=14).contains(&h) && (0..60).contains(&m) && windows_to_iana(t).is_none() {
                let secs = (h * 3600 + m * 60) * if sign == '-' { -1 } else { 1 };
                return Some(ServerZone { name: format!("UTC{sign}{h:02}:{m:02}"), kind: ZoneKind::Fixed(secs) });
            }
        }
    }
    if let Some(iana) = windows_to_iana(t) {
        let tz: chrono_tz::Tz = iana.parse().ok()?;
        return Some(ServerZone { name: t.to_string(), kind: ZoneKind::Named(tz) });
    }
    t.parse::<chrono_tz::Tz>().ok().map(|tz| ServerZone { name: t.to_string(), kind: ZoneKind::Named(tz) })
}

/// The server's clock as one `SYSDATETIMEOFFSET()` reading shows it (`sql::server_clock`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct ServerClock {
    /// The offset the clock runs at, in minutes east of UTC.
    offset_minutes: i64,
    /// The instant of the reading.
    utc_now: DateTime<Utc>,
}

/// `+hh:mm` / `-hh:mm`, as `sys.time_zone_info.current_utc_offset` writes offsets.
fn hhmm(minutes: i64) -> String {
    let sign = if minutes < 0 { '-' } else { '+' };
    let m = minutes.abs();
    format!("{sign}{:02}:{:02}", m / 60, m % 60)
}

/// The offset the rules compiled into this program give `zone` at `at`, in
/// minutes east of UTC. Only ever compared with the server's clock: no time
/// the server looks up is computed with it.
fn compiled_offset_minutes(zone: &ServerZone, at: DateTime<Utc>) -> i64 {
    (zone.to_local(at) - at.naive_utc()).num_minutes()
}

/// Refuses a configured zone (`time_zone=` in the URL) that disagrees with the
/// offset the server's clock runs at now. A zone that is wrong puts commit
/// times an offset away from their instants, and a seed's start time an
/// offset away from the commits it must include (an hour late skips them).
fn check_configured_zone(text: &str, zone: &ServerZone, clock: &ServerClock, reported: Option<&str>) -> Result<(), SourceError> {
    let expected = compiled_offset_minutes(zone, clock.utc_now);
    if expected == clock.offset_minutes {
        return Ok(());
    }
    let fix = match reported {
        Some(name) => format!("The server reports its zone as '{name}': remove time_zone= from the source URL, or set it to that name."),
        None => format!(
            "Set time_zone= in the source URL to the zone the server's clock runs in: one of \
             SELECT name FROM sys.time_zone_info WHERE current_utc_offset = '{off}' (SQL Server 2016 and later), \
             or UTC{off} on an older server.",
            off = hhmm(clock.offset_minutes)
        ),
    };
    Err(SourceError::Config(format!(
        "time_zone={text} in the source URL puts the server's clock at UTC{} now, but the server's clock runs at UTC{} \
         (DATEPART(TZOFFSET, SYSDATETIMEOFFSET())); with that zone commit times would be read off by the difference and a \
         seed by time could start after commits its copy lacks. {fix}",
        hhmm(expected),
        hhmm(clock.offset_minutes)
    )))
}

/// The zone and its conversion as far as the server's first answers settle them.
#[derive(Debug, Clone, PartialEq)]
enum ZonePlan {
    /// The zone, and how the server converts instants to its clock.
    Ready(ServerZone, LocalConversion),
    /// A zone configured by name on a server that cannot name its own: the
    /// Windows name to look up in `sys.time_zone_info` next (`sql::zone_rules_offset`).
    Probe(ServerZone, String),
}

/// Settles the server's zone from what it reports (`CURRENT_TIMEZONE_ID()`,
/// SQL Server 2022 and Azure SQL), the configured zone and one reading of
/// its clock, checking a configured zone against that reading first:
/// * a reported zone is the server's own, and `AT TIME ZONE` with its name
///   converts on the server;
/// * a zone configured by name is looked up on the server next, whose own
///   rules for it then convert (`ZonePlan::Probe`); a zone with no Windows
///   name, or a fixed offset, converts at the server's current offset.
fn plan_zone(reported: Option<&str>, configured: Option<&str>, clock: &ServerClock) -> Result<ZonePlan, SourceError> {
    let configured = match configured {
        Some(t) => Some((
            t,
            resolve_zone(t).ok_or_else(|| {
                SourceError::Config(format!("time_zone={t} is neither a Windows or IANA zone name nor a fixed offset like UTC+02:00"))
            })?,
        )),
        None => None,
    };
    if let Some((t, z)) = &configured {
        check_configured_zone(t, z, clock, reported)?;
    }
    if let Some(name) = reported.map(str::trim).filter(|n| !n.is_empty()) {
        let zone = match (resolve_zone(name), &configured) {
            (Some(z), _) => z,
            (None, Some((_, z))) => z.clone(),
            (None, None) => {
                return Err(SourceError::Config(format!(
                    "the server's time zone '{name}' is not one this program can map; set time_zone= in the source URL"
                )))
            }
        };
        if configured.is_none() && compiled_offset_minutes(&zone, clock.utc_now) != clock.offset_minutes {
            tracing::warn!(
                zone = %name,
                server_offset = %hhmm(clock.offset_minutes),
                compiled_offset = %hhmm(compiled_offset_minutes(&zone, clock.utc_now)),
                "the time-zone rules built into this program disagree with the server's clock now: commit times \
                 (converted here) will be off by the difference; a seed's start time is still converted by the server"
            );
        }
        return Ok(ZonePlan::Ready(zone, LocalConversion::AtTimeZone(name.to_string())));
    }
    let Some((text, zone)) = configured else {
        return Err(SourceError::Config(
            "the server does not report its time zone (CURRENT_TIMEZONE_ID needs SQL Server 2022); set time_zone= in the source URL, \
             for example time_zone=UTC or time_zone=W.%20Europe%20Standard%20Time"
                .into(),
        ));
    };
    let windows = match &zone.kind {
        ZoneKind::Fixed(_) => None,
        ZoneKind::Named(tz) => match windows_to_iana(text) {
            Some(_) => Some(text.trim().to_string()),
            None => iana_to_windows(tz.name()).map(str::to_string),
        },
    };
    let named = matches!(zone.kind, ZoneKind::Named(_));
    match (windows, named) {
        (Some(w), _) => Ok(ZonePlan::Probe(zone, w)),
        (None, true) => {
            tracing::warn!(
                time_zone = %text,
                "time_zone= names a zone without a Windows name, so the server cannot apply its rules to it: times are \
                 converted at the server's current offset, which is an hour off for a seed start time across a DST \
                 change; configure the Windows name (sys.time_zone_info) instead"
            );
            Ok(ZonePlan::Ready(zone, LocalConversion::CurrentOffset))
        }
        (None, false) => Ok(ZonePlan::Ready(zone, LocalConversion::CurrentOffset)),
    }
}

/// The conversion after `sql::zone_rules_offset` answered for the Windows
/// name `windows` (configured as `configured`): the server's spelling, the
/// offset its rules give the zone now and the offset its clock runs at now,
/// or no row for a zone it does not have. A zone whose rules disagree with
/// the clock is not the server's zone.
fn settle_probe(configured: &str, windows: &str, answer: Option<(String, i64, i64)>) -> Result<LocalConversion, SourceError> {
    match answer {
        None => Err(SourceError::Config(format!(
            "time_zone={configured} names the Windows zone '{windows}', which this server does not have (sys.time_zone_info \
             has no such name): set time_zone= in the source URL to a name from SELECT name FROM sys.time_zone_info"
        ))),
        Some((name, zone_offset, server_offset)) if zone_offset != server_offset => Err(SourceError::Config(format!(
            "time_zone={configured}: the server's own rules put '{name}' at UTC{} now, but the server's clock runs at UTC{}, \
             so its clock is not in that zone. Set time_zone= in the source URL to the zone it runs in: one of \
             SELECT name FROM sys.time_zone_info WHERE current_utc_offset = '{}'",
            hhmm(zone_offset),
            hhmm(server_offset),
            hhmm(server_offset)
        ))),
        Some((name, _, _)) => Ok(LocalConversion::AtTimeZone(name)),
    }
}

/// Whether a statement failed because the server has no `AT TIME ZONE` or
/// `sys.time_zone_info` (before SQL Server 2016): a syntax error (102, 156)
/// or an unknown object (208).
fn lacks_time_zone_support(e: &SourceError) -> bool {
    match e {
        SourceError::Other(m) => m.contains("SQL Server error 102:") || m.contains("SQL Server error 156:"),
        SourceError::Config(m) => m.contains("(error 208)"),
        _ => false,
    }
}

impl Inner {
    async fn open(&self) -> Result<Conn, SourceError> {
        let mut config = self.cfg.tiberius_config(&self.password);
        // Azure SQL may redirect the login to another node once.
        for _ in 0..3 {
            let addr = config.get_addr();
            let tcp = tokio::time::timeout(self.cfg.connect_timeout, TcpStream::connect(&addr))
                .await
                .map_err(|_| SourceError::Transient(format!("connecting to {addr} took longer than {:?}", self.cfg.connect_timeout)))?
                .map_err(|e| SourceError::Transient(format!("connecting to {addr}: {e}")))?;
            let _ = tcp.set_nodelay(true);
            match Client::connect(config.clone(), tcp.compat_write()).await {
                Ok(client) => return Ok(Conn { client, isolation: Isolation::ReadCommitted }),
                Err(tiberius::error::Error::Routing { host, port }) => {
                    config.host(&host);
                    config.port(port);
                }
                Err(e) => return Err(map_error(e, &Ctx::default())),
            }
        }
        Err(SourceError::Other("SQL Server redirected the login too many times".into()))
    }

    /// An idle connection, or a new one (always new when `fresh`).
    async fn take(&self, fresh: bool) -> Result<Conn, SourceError> {
        if !fresh {
            let idle = self.idle.lock().map(|mut v| v.pop()).unwrap_or(None);
            if let Some(c) = idle {
                return Ok(c);
            }
        }
        self.open().await
    }

    /// Closes the idle connections: after a dropped connection the others are
    /// likely dead too (server restart, failover), and each would cost a retry.
    fn forget_idle(&self) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.clear();
        }
    }

    /// Gives a connection back after a clean statement, at READ COMMITTED.
    async fn release(&self, mut conn: Conn) {
        if conn.isolation != Isolation::ReadCommitted && set_isolation(&mut conn, Isolation::ReadCommitted).await.is_err() {
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < self.cfg.pool_size {
                idle.push(conn);
            }
        }
    }

    /// Runs a statement with a small result and collects its first result set,
    /// retrying transient failures on fresh connections.
    async fn query_rows(&self, stmt: &Statement, iso: Isolation, ctx: &Ctx) -> Result<Vec<Row>, SourceError> {
        let mut schedule = retry_schedule();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match self.query_rows_once(stmt, iso, attempt > 1).await {
                Ok(rows) => return Ok(rows),
                Err(f) => match f.into_source(ctx) {
                    SourceError::Transient(msg) => match schedule.next_backoff() {
                        Some(wait) => {
                            self.forget_idle();
                            tracing::warn!(attempt, ?wait, "SQL Server read failed, retrying on a new connection: {msg}");
                            tokio::time::sleep(wait).await;
                        }
                        None => return Err(SourceError::Transient(msg)),
                    },
                    other => return Err(other),
                },
            }
        }
    }

    async fn query_rows_once(&self, stmt: &Statement, iso: Isolation, fresh: bool) -> Result<Vec<Row>, Fail> {
        let mut conn = self.take(fresh).await?;
        set_isolation(&mut conn, iso).await?;
        let binds: Vec<Bind<'_>> = stmt.params.iter().map(Bind).collect();
        let refs: Vec<&dyn ToSql> = binds.iter().map(|b| b as &dyn ToSql).collect();
        let rows = conn.client.query(stmt.sql.as_str(), &refs).await?.into_first_result().await?;
        self.release(conn).await;
        Ok(rows)
    }
}

async fn set_isolation(conn: &mut Conn, iso: Isolation) -> Result<(), tiberius::error::Error> {
    if conn.isolation != iso {
        conn.client.simple_query(sql::set_isolation(iso)).await?.into_results().await?;
        conn.isolation = iso;
    }
    Ok(())
}

/// Turns rows into Arrow batches.
enum Sink {
    Rows { builder: BatchBuilder, types: Vec<SqlType> },
    Changes { builder: ChangeBatchBuilder, types: Vec<SqlType> },
}

impl Sink {
    fn push(&mut self, row: &Row) -> Result<(), SourceError> {
        match self {
            Sink::Rows { builder, types } => Ok(builder.push(&convert::row_values(row, 0, types)?)?),
            Sink::Changes { builder, types } => builder.push(&convert::change_row(row, types)?),
        }
    }
    fn len(&self) -> usize {
        match self {
            Sink::Rows { builder, .. } => builder.len(),
            Sink::Changes { builder, .. } => builder.len(),
        }
    }
    fn finish(&mut self) -> RecordBatch {
        match self {
            Sink::Rows { builder, .. } => builder.finish(),
            Sink::Changes { builder, .. } => builder.finish(),
        }
    }
}

/// How a streamed read is set up.
struct StreamPlan {
    /// The statement.
    statement: Statement,
    isolation: Isolation,
    ctx: Ctx,
    sink: Sink,
    batch_rows: usize,
    /// What the one row of the statement's second result set holds, if it has one.
    trailer: Trailer,
}

/// The one-row result set some reads send after their rows.
enum Trailer {
    None,
    /// A fenced read's fence (`sql::snapshot_read_fenced`), read under its lock after the rows.
    Fence(oneshot::Sender<Result<chrono::NaiveDateTime, SourceError>>),
    /// The max LSN read after the rows (`sql::snapshot_read_then_max_lsn`).
    MaxLsn(oneshot::Sender<Result<Option<Lsn>, SourceError>>),
}

type Ready = oneshot::Sender<Result<(), SourceError>>;
/// What the read task sends: batches, then `Done` after the last one, so that
/// a task that dies part-way is never mistaken for a complete read.
enum Msg {
    Batch(Result<RecordBatch, SourceError>),
    Done,
}

type Out = mpsc::Sender<Msg>;

/// Runs one streamed read attempt on `conn`. Err carries whether rows had
/// already been handed out (then the read cannot be retried).
async fn stream_attempt(conn: &mut Conn, plan: &mut StreamPlan, ready: &mut Option<Ready>, out: &Out) -> Result<(), (Fail, bool)> {
    set_isolation(conn, plan.isolation).await.map_err(|e| (Fail::Tds(e), false))?;
    let stmt = &plan.statement;
    let binds: Vec<Bind<'_>> = stmt.params.iter().map(Bind).collect();
    let refs: Vec<&dyn ToSql> = binds.iter().map(|b| b as &dyn ToSql).collect();
    let stream = conn.client.query(stmt.sql.as_str(), &refs).await.map_err(|e| (Fail::Tds(e), false))?;
    let mut rows = stream.into_row_stream();
    let mut started = false;
    while let Some(item) = rows.next().await {
        let row = item.map_err(|e| (Fail::Tds(e), started))?;
        if !started {
            started = true;
            if let Some(r) = ready.take() {
                let _ = r.send(Ok(()));
            }
        }
        if row.result_index() > 0 {
            match std::mem::replace(&mut plan.trailer, Trailer::None) {
                Trailer::Fence(tx) => {
                    let fence: Option<chrono::NaiveDateTime> = row.try_get(0).map_err(|e| (Fail::Tds(e), true))?;
                    let fence = fence.ok_or_else(|| (Fail::Source(SourceError::Other("the fenced read's SYSDATETIME() was NULL".into())), true))?;
                    let _ = tx.send(Ok(fence));
                }
                Trailer::MaxLsn(tx) => {
                    let lsn = convert::row_lsn(&row, 0, false).map_err(|e| (Fail::Source(e), true))?;
                    let _ = tx.send(Ok(lsn));
                }
                Trailer::None => {}
            }
            continue;
        }
        plan.sink.push(&row).map_err(|e| (Fail::Source(e), true))?;
        if plan.sink.len() >= plan.batch_rows && out.send(Msg::Batch(Ok(plan.sink.finish()))).await.is_err() {
            // The reader dropped the stream: stop, and let the connection go.
            return Err((Fail::Source(SourceError::Other("the reader went away".into())), true));
        }
    }
    Ok(())
}

async fn stream_task(inner: Arc<Inner>, mut plan: StreamPlan, ready: Ready, out: Out) {
    let mut ready = Some(ready);
    let mut schedule = retry_schedule();
    let mut fresh = false;
    loop {
        let mut conn = match inner.take(fresh).await {
            Ok(c) => c,
            Err(SourceError::Transient(msg)) => match schedule.next_backoff() {
                Some(wait) => {
                    tracing::warn!(?wait, "connecting to SQL Server failed, retrying: {msg}");
                    tokio::time::sleep(wait).await;
                    fresh = true;
                    continue;
                }
                None => return finish_err(&mut ready, &out, SourceError::Transient(msg)).await,
            },
            Err(e) => return finish_err(&mut ready, &out, e).await,
        };
        match stream_attempt(&mut conn, &mut plan, &mut ready, &out).await {
            Ok(()) => {
                if let Some(r) = ready.take() {
                    let _ = r.send(Ok(()));
                }
                if plan.sink.len() > 0 {
                    let _ = out.send(Msg::Batch(Ok(plan.sink.finish()))).await;
                }
                let _ = out.send(Msg::Done).await;
                inner.release(conn).await;
                return;
            }
            Err((fail, started)) => {
                drop(conn);
                if out.is_closed() {
                    return;
                }
                let err = fail.into_source(&plan.ctx);
                if let (SourceError::Transient(msg), false) = (&err, started) {
                    if let Some(wait) = schedule.next_backoff() {
                        inner.forget_idle();
                        tracing::warn!(?wait, "SQL Server read failed before its first row, retrying on a new connection: {msg}");
                        tokio::time::sleep(wait).await;
                        fresh = true;
                        continue;
                    }
                }
                return finish_err(&mut ready, &out, err).await;
            }
        }
    }
}

async fn finish_err(ready: &mut Option<Ready>, out: &Out, e: SourceError) {
    match ready.take() {
        Some(r) => {
            let _ = r.send(Err(e));
        }
        None => {
            let _ = out.send(Msg::Batch(Err(e))).await;
        }
    }
}

fn first_row(rows: &[Row]) -> Result<&Row, SourceError> {
    rows.first().ok_or_else(|| SourceError::Other("SQL Server returned no row where one was expected".into()))
}

fn cached_key_cols(info: &TableInfo, keys: &[String]) -> Option<Vec<KeyCol>> {
    keys.iter()
        .map(|k| info.columns.iter().find(|c| c.name.eq_ignore_ascii_case(k)).map(|c| KeyCol { name: c.name.clone(), sql_type: c.sql_type.clone() }))
        .collect()
}

impl MssqlSource {
    /// Parses the URL or connection string, logs in once to check the
    /// settings, and keeps that connection for the first call.
    pub async fn connect(url: &str, secrets: SourceSecrets) -> Result<MssqlSource, SourceError> {
        let cfg = MssqlConfig::parse(url)?;
        let password = secrets.password.filter(|p| !p.is_empty()).ok_or_else(|| {
            SourceError::Config(format!(
                "no password for SQL Server login '{}': set the {PASSWORD_ENV} environment variable (or the password file the workflow names)",
                cfg.user
            ))
        })?;
        let inner = Arc::new(Inner {
            cfg,
            password,
            idle: Mutex::new(Vec::new()),
            tables: Mutex::new(HashMap::new()),
            collations: Mutex::new(HashMap::new()),
            instance_grants: Mutex::new(HashMap::new()),
            has_command_id: Mutex::new(HashMap::new()),
            conversion: Mutex::new(None),
        });
        let first = inner.open().await?;
        inner.release(first).await;
        Ok(MssqlSource { inner })
    }

    /// The parsed settings (nothing secret).
    pub fn config(&self) -> &MssqlConfig {
        &self.inner.cfg
    }

    /// Whether the instance's change table has `__$command_id`, from the
    /// catalog (cached for the process). An instance the catalog does not
    /// list is a configuration error naming it.
    async fn change_table_has_command_id(&self, capture_instance: &str) -> Result<bool, SourceError> {
        if let Some(known) = self.inner.has_command_id.lock().ok().and_then(|m| m.get(capture_instance).copied()) {
            return Ok(known);
        }
        let rows = self.rows(&sql::change_table_has_command_id(capture_instance), Isolation::ReadCommitted).await?;
        let has = match rows.first() {
            Some(r) => convert::row_i64(r, 0)?.unwrap_or(0) == 1,
            None => {
                return Err(SourceError::Config(format!(
                    "capture instance '{capture_instance}' is not in cdc.change_tables (dropped, or this login cannot see it): \
                     check the workflow's capture instance and the grants in docs/sqlserver.md"
                )))
            }
        };
        if let Ok(mut m) = self.inner.has_command_id.lock() {
            m.insert(capture_instance.to_string(), has);
        }
        Ok(has)
    }

    async fn rows(&self, stmt: &Statement, iso: Isolation) -> Result<Vec<Row>, SourceError> {
        self.inner.query_rows(stmt, iso, &self.error_context()).await
    }

    /// The context every statement's errors are read in: the login, which a
    /// permission error names as the grantee.
    fn error_context(&self) -> ErrorContext {
        ErrorContext { login: Some(self.inner.cfg.user.clone()), ..ErrorContext::default() }
    }

    /// What CDC checks of a caller for this instance, as `capture_instances` last read it.
    fn instance_grants(&self, capture_instance: &str) -> Option<InstanceGrants> {
        self.inner.instance_grants.lock().ok().and_then(|m| m.get(&capture_instance.to_lowercase()).cloned())
    }

    fn conversion(&self) -> Option<LocalConversion> {
        self.inner.conversion.lock().ok().and_then(|c| (*c).clone())
    }

    fn set_conversion(&self, conversion: LocalConversion) {
        if let Ok(mut c) = self.inner.conversion.lock() {
            *c = Some(conversion);
        }
    }

    /// One reading of the server's clock: its offset now and the instant.
    async fn server_clock(&self) -> Result<ServerClock, SourceError> {
        let rows = self.rows(&sql::server_clock(), Isolation::ReadCommitted).await?;
        let r = first_row(&rows)?;
        let offset_minutes = convert::row_i64(r, 0)?.ok_or_else(|| SourceError::Other("SYSDATETIMEOFFSET() answered no offset".into()))?;
        let d = r.get_column_data(1).map_err(|e| SourceError::Other(e.to_string()))?;
        let utc_now = match convert::column_value(d, &SqlType::DateTime2 { scale: 7 }).map_err(SourceError::Other)? {
            SqlValue::DateTime(t) => t.and_utc(),
            other => return Err(SourceError::Other(format!("the server's clock read as {other}"))),
        };
        Ok(ServerClock { offset_minutes, utc_now })
    }

    async fn single_lsn(&self, stmt: &Statement, zero_is_none: bool) -> Result<Option<Lsn>, SourceError> {
        let rows = self.rows(stmt, Isolation::ReadCommitted).await?;
        match rows.first() {
            Some(r) => convert::row_lsn(r, 0, zero_is_none),
            None => Ok(None),
        }
    }

    async fn key_cols(&self, table: &TableName, keys: &[String]) -> Result<Vec<KeyCol>, SourceError> {
        let cached = self.inner.tables.lock().ok().and_then(|m| m.get(table).cloned());
        if let Some(cols) = cached.as_ref().and_then(|info| cached_key_cols(info, keys)) {
            return Ok(cols);
        }
        let info = self.table_info(table).await?;
        cached_key_cols(&info, keys).ok_or_else(|| {
            SourceError::Config(format!("the key columns {keys:?} are not all columns of {table} (columns are matched case-insensitively)"))
        })
    }

    /// A snapshot read (see [`CdcSource::snapshot_read`]), fenced or followed
    /// by the max LSN as `trailer` asks.
    async fn table_read(&self, read: &SnapshotRead, trailer: Trailer) -> Result<BatchStream, SourceError> {
        let info = self.table_info(&read.table).await?;
        let columns: Vec<ReadColumn> = read
            .columns
            .iter()
            .map(|c| ReadColumn { desc: c.clone(), present: info.columns.iter().any(|t| t.name.eq_ignore_ascii_case(&c.name)) })
            .collect();
        let keys: Vec<KeyCol> = read
            .keys
            .iter()
            .map(|k| {
                read.columns
                    .iter()
                    .chain(info.columns.iter())
                    .find(|c| c.name.eq_ignore_ascii_case(k))
                    .map(|c| KeyCol { name: c.name.clone(), sql_type: c.sql_type.clone() })
                    .ok_or_else(|| SourceError::Config(format!("key column '{k}' is not a column of {}", read.table)))
            })
            .collect::<Result<_, _>>()?;
        let fenced = matches!(trailer, Trailer::Fence(_));
        let stmt = match trailer {
            Trailer::Fence(_) => sql::snapshot_read_fenced(&read.table, &columns, &keys, &read.range, crate::source::FENCE_GUARD_MS),
            Trailer::MaxLsn(_) => sql::snapshot_read_then_max_lsn(&read.table, &columns, &keys, &read.range),
            Trailer::None => sql::snapshot_read(&read.table, &columns, &keys, &read.range),
        }
        .map_err(SourceError::Config)?;
        self.open_stream(StreamPlan {
            statement: stmt,
            // A fenced read is a locking read by its hints; it runs at READ
            // COMMITTED so that no SNAPSHOT session's row versions play a part.
            isolation: if fenced { Isolation::ReadCommitted } else { read.isolation },
            ctx: self.error_context(),
            sink: Sink::Rows { builder: BatchBuilder::new(&read.columns), types: read.columns.iter().map(|c| c.sql_type.clone()).collect() },
            batch_rows: read.batch_rows.max(1),
            trailer,
        })
        .await
    }

    async fn open_stream(&self, plan: StreamPlan) -> Result<BatchStream, SourceError> {
        let (ready_tx, ready_rx) = oneshot::channel();
        let (tx, rx) = mpsc::channel::<Msg>(1);
        tokio::spawn(stream_task(self.inner.clone(), plan, ready_tx, tx));
        match ready_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(SourceError::Other("the SQL Server read stopped before it started".into())),
        }
        // (receiver, finished): a channel that closes without Done (the task
        // died) ends the stream with an error rather than quietly.
        Ok(futures::stream::unfold((rx, false), |(mut rx, finished)| async move {
            if finished {
                return None;
            }
            match rx.recv().await {
                Some(Msg::Batch(Ok(b))) => Some((Ok(b), (rx, false))),
                Some(Msg::Batch(Err(e))) => Some((Err(e), (rx, true))),
                Some(Msg::Done) => None,
                None => Some((Err(SourceError::Other("the SQL Server read stopped part-way".into())), (rx, true))),
            }
        })
        .boxed())
    }

    /// Reconcile tier 1: per slice of an integer key over `[lo, hi]`, the
    /// slice start, the row count and the exact sum of the key.
    pub async fn bucket_sums(
        &self,
        table: &TableName,
        key: &str,
        lo: i64,
        hi: i64,
        width: i64,
        isolation: Isolation,
    ) -> Result<Vec<(i64, u64, i128)>, SourceError> {
        self.bucket_rows(sql::bucket_sums(table, key, lo, hi, width), lo, hi, width, isolation).await
    }

    /// Runs a tier-1 bucket statement (integer or date key) and reads its
    /// rows: slice start, row count, exact sum of the key.
    async fn bucket_rows(&self, stmt: sql::Statement, lo: i64, hi: i64, width: i64, isolation: Isolation) -> Result<Vec<(i64, u64, i128)>, SourceError> {
        if width <= 0 {
            return Err(SourceError::Other(format!("bucket width must be positive, not {width}")));
        }
        if lo > hi {
            return Ok(vec![]);
        }
        let rows = self.rows(&stmt, isolation).await?;
        rows.iter()
            .map(|r| {
                let start = convert::row_i64(r, 0)?.unwrap_or_default();
                let n = convert::row_i64(r, 1)?.unwrap_or_default() as u64;
                let d = r.get_column_data(2).map_err(|e| SourceError::Other(e.to_string()))?;
                let sum = match convert::column_value(d, &SqlType::Decimal { precision: 38, scale: 0 }).map_err(SourceError::Other)? {
                    SqlValue::Decimal { value, scale: 0 } => value,
                    SqlValue::Int(v) => v as i128,
                    other => return Err(SourceError::Other(format!("unexpected key sum {other}"))),
                };
                Ok((start, n, sum))
            })
            .collect()
    }
}

fn catalog_column(r: &Row, first: usize) -> Result<(String, Result<SqlType, String>, bool), SourceError> {
    let name = convert::row_str(r, first)?.unwrap_or_default();
    let type_name = convert::row_str(r, first + 1)?.unwrap_or_default();
    let max_length = convert::row_i64(r, first + 2)?.unwrap_or(0);
    let precision = convert::row_i64(r, first + 3)?.unwrap_or(0);
    let scale = convert::row_i64(r, first + 4)?.unwrap_or(0);
    let nullable = convert::row_i64(r, first + 5)?.unwrap_or(1) != 0;
    Ok((name, convert::sql_type_from_catalog(&type_name, max_length, precision, scale), nullable))
}

/// One row of `sql::captured_columns` as the column it captures, or the
/// reason it cannot be replicated.
fn captured_column(r: &Row, capture_instance: &str, table: &TableName) -> Result<ColumnDesc, SourceError> {
    let (col, ty, nullable) = catalog_column(r, 1)?;
    if convert::row_i64(r, 7)?.unwrap_or(0) != 0 {
        return Err(SourceError::Config(computed_column_refusal(capture_instance, table, &col)));
    }
    let ty = ty.map_err(|e| {
        SourceError::Config(format!(
            "capture instance '{capture_instance}' of {table} captures column '{col}', whose type this program cannot replicate ({e}); \
             recreate the instance with @captured_column_list leaving it out"
        ))
    })?;
    Ok(ColumnDesc::new(col, ty, nullable))
}

/// The name the source table gives the captured column of a
/// `sql::captured_columns` row now, when it is not the captured name: the
/// column was renamed (`sp_rename`; the row joins the source column by
/// `column_id`). None when the names agree ignoring case, or when the column
/// was dropped (no source column has its id).
fn renamed_to(r: &Row) -> Result<Option<String>, SourceError> {
    let captured = convert::row_str(r, 1)?.unwrap_or_default();
    Ok(convert::row_str(r, 8)?.filter(|now| !now.eq_ignore_ascii_case(&captured)))
}

/// Why a captured computed column is refused. CDC writes NULL for a computed
/// column in every change row while a snapshot reads its value, so silver
/// would hold the value until the row's first change and NULL after it. Of
/// the two ways to make the sources agree (NULL in snapshots too, or leave
/// the column out), only the user can choose to leave it out, and a column
/// that is always NULL is not what anyone capturing it expects.
fn computed_column_refusal(capture_instance: &str, table: &TableName, column: &str) -> String {
    format!(
        "capture instance '{capture_instance}' of {table} captures the computed column '{column}': SQL Server writes NULL for it in \
         every change row, so it cannot be replicated. Recreate the instance with @captured_column_list leaving '{column}' out \
         (sys.sp_cdc_enable_table with a new @capture_instance, then sys.sp_cdc_disable_table for the old one once the stream \
         has switched); a view or a silver-side expression can compute it again"
    )
}

#[async_trait]
impl CdcSource for MssqlSource {
    fn describe(&self) -> String {
        self.inner.cfg.to_string()
    }

    async fn max_lsn(&self) -> Result<Option<Lsn>, SourceError> {
        self.single_lsn(&sql::max_lsn(), false).await
    }

    async fn min_lsn(&self, capture_instance: &str) -> Result<Option<Lsn>, SourceError> {
        let answer = self.single_lsn(&sql::min_lsn(capture_instance), true).await?;
        if answer.is_some() {
            return Ok(answer);
        }
        // All zeros (or NULL): no bound yet, an instance that is gone, or one
        // whose change data is closed to this login. Its catalog row tells
        // which (`grants::read_min_lsn`).
        let rows = self.rows(&sql::instance_catalog(capture_instance), Isolation::ReadCommitted).await?;
        let catalog = match rows.first() {
            None => None,
            Some(r) => {
                let start_lsn = convert::row_lsn(r, 0, true)?;
                let gating_role = convert::row_str(r, 1)?;
                let known = self.instance_grants(capture_instance);
                let table = match (convert::row_str(r, 2)?, convert::row_str(r, 3)?) {
                    (Some(schema), Some(name)) => TableName::new(schema, name),
                    _ => known.as_ref().map(|k| k.table.clone()).unwrap_or_else(|| TableName::new("<schema>", "<table>")),
                };
                let columns = known.map(|k| k.columns).unwrap_or_default();
                Some(InstanceCatalog {
                    start_lsn,
                    grants: InstanceGrants { capture_instance: capture_instance.to_string(), table, columns, gating_role },
                })
            }
        };
        grants::read_min_lsn(answer, catalog.as_ref(), Some(self.inner.cfg.user.as_str()))
    }

    async fn increment_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError> {
        self.single_lsn(&sql::increment_lsn(lsn), false).await?.ok_or_else(|| SourceError::Other("fn_cdc_increment_lsn returned NULL".into()))
    }

    async fn decrement_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError> {
        self.single_lsn(&sql::decrement_lsn(lsn), false).await?.ok_or_else(|| SourceError::Other("fn_cdc_decrement_lsn returned NULL".into()))
    }

    async fn table_info(&self, table: &TableName) -> Result<TableInfo, SourceError> {
        let rows = self.rows(&sql::table_columns(table), Isolation::ReadCommitted).await?;
        if rows.is_empty() {
            return Err(grants::table_hidden(table, Some(self.inner.cfg.user.as_str())));
        }
        let mut columns = Vec::with_capacity(rows.len());
        for r in &rows {
            let (name, ty, nullable) = catalog_column(r, 0)?;
            match ty {
                Ok(t) => columns.push(ColumnDesc::new(name, t, nullable)),
                // A column of a type this program cannot carry (geography, sql_variant…)
                // is left out here; capture_instances refuses it if it is captured.
                Err(e) => tracing::warn!(table = %table, column = %name, "column left out: {e}"),
            }
        }
        let keys = self.rows(&sql::table_unique_keys(table), Isolation::ReadCommitted).await?;
        let mut unique_key = Vec::new();
        let mut first_index = None;
        for r in &keys {
            let idx = convert::row_i64(r, 0)?;
            if first_index.is_none() {
                first_index = Some(idx);
            }
            if first_index == Some(idx) {
                unique_key.push(convert::row_str(r, 2)?.unwrap_or_default());
            }
        }
        let info = TableInfo { name: table.clone(), columns, unique_key };
        if let Ok(mut m) = self.inner.tables.lock() {
            m.insert(table.clone(), info.clone());
        }
        Ok(info)
    }

    async fn capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>, SourceError> {
        let rc = Isolation::ReadCommitted;
        let heads = match self.rows(&sql::capture_instances(table), rc).await {
            Ok(h) => h,
            // No cdc schema at all: CDC is off for the whole database, so the
            // table has no capture instance.
            Err(SourceError::Config(m)) if m.contains("error 208") => {
                let db = self.rows(&sql::database_cdc_enabled(), rc).await?;
                match db.first().map(|r| convert::row_i64(r, 0)).transpose()?.flatten() {
                    Some(0) => return Ok(vec![]),
                    _ => return Err(SourceError::Config(m)),
                }
            }
            Err(e) => return Err(e),
        };
        if heads.is_empty() {
            return Ok(vec![]);
        }
        let cols = self.rows(&sql::captured_columns(table), rc).await?;
        let idx = self.rows(&sql::index_columns(table), rc).await?;
        let mut out = Vec::new();
        for h in &heads {
            let name = convert::row_str(h, 0)?.unwrap_or_default();
            let start_lsn = convert::row_lsn(h, 1, true)?;
            let gating_role = convert::row_str(h, 2)?;
            let mut columns = Vec::new();
            let mut renamed = std::collections::BTreeMap::new();
            for r in &cols {
                if convert::row_str(r, 0)?.as_deref() != Some(name.as_str()) {
                    continue;
                }
                let column = captured_column(r, &name, table)?;
                if let Some(now) = renamed_to(r)? {
                    renamed.insert(column.name.clone(), now);
                }
                columns.push(column);
            }
            let mut index_columns = Vec::new();
            for r in &idx {
                if convert::row_str(r, 0)?.as_deref() == Some(name.as_str()) {
                    index_columns.push(convert::row_str(r, 1)?.unwrap_or_default());
                }
            }
            // The columns come from the change table's sys.columns, which shows
            // nothing to a login without a permission on that table.
            if columns.is_empty() {
                return Err(grants::change_table_hidden(&name, Some(self.inner.cfg.user.as_str())));
            }
            let needs = InstanceGrants {
                capture_instance: name.clone(),
                table: table.clone(),
                // CDC's check is on the source table's columns: a renamed one by its name now.
                columns: columns.iter().map(|c| renamed.get(&c.name).cloned().unwrap_or_else(|| c.name.clone())).collect(),
                gating_role,
            };
            if let Ok(mut m) = self.inner.instance_grants.lock() {
                m.insert(name.to_lowercase(), needs);
            }
            out.push(CaptureInstance { name, table: table.clone(), start_lsn, columns, index_columns, renamed });
        }
        Ok(out)
    }

    async fn changes(
        &self,
        capture_instance: &CaptureInstance,
        from: Lsn,
        to: Lsn,
        filter: RowFilter,
        batch_rows: usize,
    ) -> Result<BatchStream, SourceError> {
        let ci = &capture_instance.name;
        let cols = &capture_instance.columns;
        let with_command_id = self.change_table_has_command_id(ci).await?;
        if !with_command_id {
            tracing::warn!(
                capture_instance = %ci,
                "the change table has no __$command_id (created before KB3030352): reading changes in (__$start_lsn, __$seqval, __$operation) order"
            );
        }
        self.open_stream(StreamPlan {
            statement: sql::changes(ci, cols, from, to, filter, with_command_id),
            isolation: Isolation::ReadCommitted,
            ctx: ErrorContext {
                range: Some((ci.clone(), from, to)),
                login: Some(self.inner.cfg.user.clone()),
                instance: self.instance_grants(ci),
            },
            sink: Sink::Changes { builder: ChangeBatchBuilder::new(cols), types: cols.iter().map(|c| c.sql_type.clone()).collect() },
            batch_rows: batch_rows.max(1),
            trailer: Trailer::None,
        })
        .await
    }

    async fn snapshot_read(&self, read: &SnapshotRead) -> Result<BatchStream, SourceError> {
        self.table_read(read, Trailer::None).await
    }

    async fn snapshot_read_fenced(&self, read: &SnapshotRead) -> Result<FencedRead, SourceError> {
        let (tx, fence) = crate::source::fence_channel();
        let batches = self.table_read(read, Trailer::Fence(tx)).await?;
        Ok(FencedRead { batches, fence })
    }

    async fn snapshot_read_then_max_lsn(&self, read: &SnapshotRead) -> Result<ReadThenMaxLsn, SourceError> {
        let (tx, max_lsn_after) = crate::source::max_lsn_channel();
        let batches = self.table_read(read, Trailer::MaxLsn(tx)).await?;
        Ok(ReadThenMaxLsn { batches, max_lsn_after: Some(max_lsn_after) })
    }

    async fn key_extent(&self, table: &TableName, keys: &[String], isolation: Isolation) -> Result<Option<(Key, Key)>, SourceError> {
        let kc = self.key_cols(table, keys).await?;
        let types: Vec<SqlType> = kc.iter().map(|k| k.sql_type.clone()).collect();
        let rows = self.rows(&sql::key_extent(table, &kc), isolation).await?;
        if kc.len() == 1 && kc[0].sql_type != SqlType::Bit {
            let Some(r) = rows.first() else { return Ok(None) };
            let v = convert::row_values(r, 0, &[types[0].clone(), types[0].clone()])?;
            if v[0].is_null() {
                return Ok(None);
            }
            return Ok(Some((vec![v[0].clone()], vec![v[1].clone()])));
        }
        let mut lo = None;
        let mut hi = None;
        for r in &rows {
            let end = convert::row_i64(r, 0)?;
            let key = convert::row_values(r, 1, &types)?;
            if end == Some(0) {
                lo = Some(key);
            } else {
                hi = Some(key);
            }
        }
        Ok(lo.zip(hi))
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
        if width <= 0 {
            return Err(SourceError::Other(format!("slice width must be positive, not {width}")));
        }
        if lo > hi {
            return Ok(vec![]);
        }
        let rows = self.rows(&sql::slice_counts(table, key, lo, hi, width), isolation).await?;
        rows.iter()
            .map(|r| Ok((convert::row_i64(r, 0)?.unwrap_or_default(), convert::row_i64(r, 1)?.unwrap_or_default() as u64)))
            .collect()
    }

    async fn slice_extent(&self, table: &TableName, key: &str, lo: i64, hi: i64, isolation: Isolation) -> Result<Option<(i64, i64)>, SourceError> {
        if lo > hi {
            return Ok(None);
        }
        let rows = self.rows(&sql::slice_extent(table, key, lo, hi), isolation).await?;
        let Some(r) = rows.first() else { return Ok(None) };
        Ok(convert::row_i64(r, 0)?.zip(convert::row_i64(r, 1)?))
    }

    async fn null_count(&self, table: &TableName, key: &str, isolation: Isolation) -> Result<u64, SourceError> {
        let rows = self.rows(&sql::null_count(table, key), isolation).await?;
        let n = match rows.first() {
            Some(r) => convert::row_i64(r, 0)?.unwrap_or(0),
            None => 0,
        };
        u64::try_from(n).map_err(|_| SourceError::Other(format!("COUNT_BIG answered {n}")))
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
        MssqlSource::bucket_sums(self, table, key, lo, hi, width, isolation).await
    }

    async fn compare_keys(&self, table: &TableName, keys: &[String], pairs: &[(Key, Key)]) -> Result<Vec<std::cmp::Ordering>, SourceError> {
        if pairs.is_empty() {
            return Ok(vec![]);
        }
        let kc = self.key_cols(table, keys).await?;
        let cached = self.inner.collations.lock().ok().and_then(|m| m.get(table).cloned());
        let by_name = match cached {
            Some(m) => m,
            None => {
                let rows = self.rows(&sql::column_collations(table), Isolation::ReadCommitted).await?;
                let mut m = HashMap::new();
                for r in &rows {
                    if let (Some(name), Some(collation)) = (convert::row_str(r, 0)?, convert::row_str(r, 1)?) {
                        m.insert(name.to_lowercase(), collation);
                    }
                }
                if let Ok(mut all) = self.inner.collations.lock() {
                    all.insert(table.clone(), m.clone());
                }
                m
            }
        };
        let collations: Vec<Option<String>> = kc.iter().map(|k| by_name.get(&k.name.to_lowercase()).cloned()).collect();
        let mut out = Vec::with_capacity(pairs.len());
        for part in pairs.chunks(sql::key_compare_pairs_per_statement(kc.len())) {
            let stmt = sql::key_compare(&kc, &collations, part).map_err(SourceError::Config)?;
            let rows = self.rows(&stmt, Isolation::ReadCommitted).await?;
            let r = first_row(&rows)?;
            for i in 0..part.len() {
                out.push(match convert::row_i64(r, i)? {
                    Some(v) if v < 0 => std::cmp::Ordering::Less,
                    Some(0) => std::cmp::Ordering::Equal,
                    Some(_) => std::cmp::Ordering::Greater,
                    None => return Err(SourceError::Other(format!("the server's key comparison {i} answered NULL"))),
                });
            }
        }
        Ok(out)
    }

    async fn key_seek(&self, table: &TableName, keys: &[String], range: &KeyRange, n: u64, isolation: Isolation) -> Result<Option<Key>, SourceError> {
        let kc = self.key_cols(table, keys).await?;
        let types: Vec<SqlType> = kc.iter().map(|k| k.sql_type.clone()).collect();
        let stmt = sql::key_seek(table, &kc, range, n).map_err(SourceError::Config)?;
        let rows = self.rows(&stmt, isolation).await?;
        let Some(r) = rows.first() else { return Ok(None) };
        let taken = convert::row_i64(r, kc.len())?.unwrap_or(0);
        if u64::try_from(taken).ok() != n.checked_add(1) {
            return Ok(None);
        }
        Ok(Some(convert::row_values(r, 0, &types)?))
    }

    async fn row_estimate(&self, table: &TableName) -> Result<u64, SourceError> {
        let rows = self.rows(&sql::row_estimate(table), Isolation::ReadCommitted).await?;
        let r = first_row(&rows)?;
        let idx = r.columns().iter().position(|c| c.name().eq_ignore_ascii_case("rows")).unwrap_or(1);
        let text = convert::row_str(r, idx)?.unwrap_or_default();
        text.trim().parse::<u64>().map_err(|_| SourceError::Other(format!("sp_spaceused reported rows = '{}'", text.trim())))
    }

    async fn time_to_lsn(&self, op: TimeOp, local_time: NaiveDateTime) -> Result<Option<Lsn>, SourceError> {
        self.single_lsn(&sql::time_to_lsn(op, local_time), true).await
    }

    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<NaiveDateTime>, SourceError> {
        let rows = self.rows(&sql::lsn_to_time(lsn), Isolation::ReadCommitted).await?;
        let Some(r) = rows.first() else { return Ok(None) };
        let d = r.get_column_data(0).map_err(|e| SourceError::Other(e.to_string()))?;
        match convert::column_value(d, &SqlType::DateTime).map_err(SourceError::Other)? {
            SqlValue::DateTime(t) => Ok(Some(t)),
            SqlValue::Null => Ok(None),
            other => Err(SourceError::Other(format!("fn_cdc_map_lsn_to_time returned {other}"))),
        }
    }

    async fn server_now(&self) -> Result<NaiveDateTime, SourceError> {
        let rows = self.rows(&sql::server_now(), Isolation::ReadCommitted).await?;
        let r = rows.first().ok_or_else(|| SourceError::Other("SELECT SYSDATETIME() returned no row".into()))?;
        let d = r.get_column_data(0).map_err(|e| SourceError::Other(e.to_string()))?;
        match convert::column_value(d, &SqlType::DateTime2 { scale: 7 }).map_err(SourceError::Other)? {
            SqlValue::DateTime(t) => Ok(t),
            other => Err(SourceError::Other(format!("SYSDATETIME() returned {other}"))),
        }
    }

    async fn server_local_times(&self, instants: &[DateTime<Utc>]) -> Result<Vec<NaiveDateTime>, SourceError> {
        if instants.is_empty() {
            return Ok(vec![]);
        }
        let conversion = match self.conversion() {
            Some(c) => c,
            None => {
                self.server_time_zone().await?;
                self.conversion().ok_or_else(|| SourceError::Other("the server's time conversion was not settled".into()))?
            }
        };
        let rows = self.rows(&sql::local_times(&conversion, instants), Isolation::ReadCommitted).await?;
        let r = first_row(&rows)?;
        let mut out = Vec::with_capacity(instants.len());
        for (i, t) in instants.iter().enumerate() {
            let d = r.get_column_data(i).map_err(|e| SourceError::Other(e.to_string()))?;
            match convert::column_value(d, &SqlType::DateTime2 { scale: 7 }).map_err(SourceError::Other)? {
                SqlValue::DateTime(local) => out.push(local),
                other => return Err(SourceError::Other(format!("the server's local time of {t} read as {other}"))),
            }
        }
        Ok(out)
    }

    async fn server_time_zone(&self) -> Result<ServerZone, SourceError> {
        let rc = Isolation::ReadCommitted;
        let configured = self.inner.cfg.time_zone.clone();
        let reported = match self.rows(&sql::server_time_zone(), rc).await {
            Ok(rows) => match rows.first() {
                Some(r) => convert::row_str(r, 0)?,
                None => None,
            },
            // Before SQL Server 2022 the function does not exist (error 195).
            Err(SourceError::Other(msg)) if msg.contains("error 195") => None,
            Err(e) => return Err(e),
        };
        let clock = self.server_clock().await?;
        let (zone, conversion) = match plan_zone(reported.as_deref(), configured.as_deref(), &clock)? {
            ZonePlan::Ready(zone, conversion) => (zone, conversion),
            ZonePlan::Probe(zone, windows) => {
                let conversion = match self.rows(&sql::zone_rules_offset(&windows), rc).await {
                    Ok(rows) => {
                        let answer = match rows.first() {
                            Some(r) => Some((
                                convert::row_str(r, 0)?.unwrap_or_else(|| windows.clone()),
                                convert::row_i64(r, 1)?.unwrap_or_default(),
                                convert::row_i64(r, 2)?.unwrap_or_default(),
                            )),
                            None => None,
                        };
                        settle_probe(configured.as_deref().unwrap_or(windows.as_str()), &windows, answer)?
                    }
                    Err(e) if lacks_time_zone_support(&e) => {
                        tracing::warn!(
                            zone = %windows,
                            "this server has no AT TIME ZONE (SQL Server before 2016): times are converted to its clock at its \
                             current offset, an hour off for a seed start time across a DST change; pass --as-of as an LSN for such a copy"
                        );
                        LocalConversion::CurrentOffset
                    }
                    Err(e) => return Err(e),
                };
                (zone, conversion)
            }
        };
        tracing::debug!(zone = %zone.name, ?conversion, "settled the server's time zone");
        self.set_conversion(conversion);
        Ok(zone)
    }

    async fn row_count(&self, table: &TableName, isolation: Isolation) -> Result<u64, SourceError> {
        let rows = self.rows(&sql::row_count(table), isolation).await?;
        let n = match rows.first() {
            Some(r) => convert::row_i64(r, 0)?.unwrap_or(0),
            None => 0,
        };
        u64::try_from(n).map_err(|_| SourceError::Other(format!("COUNT_BIG answered {n}")))
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
        self.bucket_rows(sql::date_bucket_sums(table, key, lo, hi, width), lo, hi, width, isolation).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_resolve_from_every_spelling() {
        assert_eq!(resolve_zone("UTC"), Some(ServerZone::utc()));
        let z = resolve_zone("UTC+02:00").unwrap();
        assert_eq!((z.name.as_str(), &z.kind), ("UTC+02:00", &ZoneKind::Fixed(7200)));
        assert_eq!(resolve_zone("-05:30").unwrap().kind, ZoneKind::Fixed(-(5 * 3600 + 30 * 60)));
        let w = resolve_zone("E. South America Standard Time").unwrap();
        assert_eq!(w.name, "E. South America Standard Time");
        assert_eq!(w.kind, ZoneKind::Named(chrono_tz::America::Sao_Paulo));
        // The Windows "UTC-11" zone is the IANA Etc/GMT+11 zone.
        assert_eq!(resolve_zone("UTC-11").unwrap().kind, ZoneKind::Named(chrono_tz::Etc::GMTPlus11));
        assert_eq!(resolve_zone("Europe/Lisbon").unwrap().kind, ZoneKind::Named(chrono_tz::Europe::Lisbon));
        assert!(resolve_zone("Mars/Olympus").is_none());
        assert!(resolve_zone("UTC+15:00").is_none());
    }

    fn clock(offset_minutes: i64, utc: &str) -> ServerClock {
        ServerClock { offset_minutes, utc_now: utc.parse::<DateTime<Utc>>().unwrap() }
    }

    /// A configured zone is checked against the offset the server's clock
    /// runs at (one `SYSDATETIMEOFFSET()` reading), whatever the version.
    #[test]
    fn a_configured_zone_must_agree_with_the_servers_clock() {
        let july = clock(-240, "2026-07-01T12:00:00Z"); // a server in New York, on daylight time
        // The right zone by its Windows or its IANA name: looked up on the server next.
        let ny = resolve_zone("Eastern Standard Time").unwrap();
        assert_eq!(plan_zone(None, Some("Eastern Standard Time"), &july).unwrap(), ZonePlan::Probe(ny, "Eastern Standard Time".into()));
        match plan_zone(None, Some("America/New_York"), &july).unwrap() {
            ZonePlan::Probe(_, w) => assert_eq!(w, "Eastern Standard Time"),
            other => panic!("{other:?}"),
        }
        // A fixed offset equal to the clock's: converted at the server's current offset.
        assert!(matches!(plan_zone(None, Some("UTC-04:00"), &july).unwrap(), ZonePlan::Ready(_, LocalConversion::CurrentOffset)));
        // Standard time while the clock is on daylight time, another zone, UTC:
        // refused, naming both offsets and how to find the right name.
        for wrong in ["UTC-05:00", "Central Standard Time", "UTC"] {
            let e = plan_zone(None, Some(wrong), &july).unwrap_err();
            assert!(
                matches!(&e, SourceError::Config(m) if m.contains(&format!("time_zone={wrong}"))
                    && m.contains("runs at UTC-04:00")
                    && m.contains("sys.time_zone_info WHERE current_utc_offset = '-04:00'")),
                "{wrong}: {e}"
            );
        }
        // A server that names its zone still has a configured zone checked; the fix names the server's zone.
        let e = plan_zone(Some("Eastern Standard Time"), Some("UTC"), &july).unwrap_err();
        assert!(matches!(&e, SourceError::Config(m) if m.contains("reports its zone as 'Eastern Standard Time'")), "{e}");
        // Nothing reported and nothing configured: time_zone= is asked for.
        let e = plan_zone(None, None, &july).unwrap_err();
        assert!(matches!(&e, SourceError::Config(m) if m.contains("set time_zone=")), "{e}");
    }

    /// Every plan leaves the conversion to the server: `AT TIME ZONE` with a
    /// name the server knows, or the server's own current offset. None uses
    /// the rules compiled in here, which can differ from the server's.
    #[test]
    fn the_server_converts_in_every_plan() {
        let july = clock(-240, "2026-07-01T12:00:00Z");
        // SQL Server 2022 names its zone: AT TIME ZONE with that name.
        match plan_zone(Some("Eastern Standard Time"), None, &july).unwrap() {
            ZonePlan::Ready(zone, conversion) => {
                assert_eq!(zone.kind, ZoneKind::Named(chrono_tz::America::New_York));
                assert_eq!(conversion, LocalConversion::AtTimeZone("Eastern Standard Time".into()));
            }
            other => panic!("{other:?}"),
        }
        // Azure SQL Database runs in UTC.
        assert_eq!(
            plan_zone(Some("UTC"), None, &clock(0, "2026-07-01T12:00:00Z")).unwrap(),
            ZonePlan::Ready(ServerZone::utc(), LocalConversion::AtTimeZone("UTC".into()))
        );
        // A server whose Windows rules kept standard time (the built-in rules
        // say daylight time): still the server's name and rules, not ours.
        let stale = clock(-300, "2026-07-01T12:00:00Z");
        assert!(matches!(
            plan_zone(Some("Eastern Standard Time"), None, &stale).unwrap(),
            ZonePlan::Ready(_, LocalConversion::AtTimeZone(n)) if n == "Eastern Standard Time"
        ));

        // A configured name the server has: its spelling there, its rules.
        assert_eq!(
            settle_probe("eastern standard time", "eastern standard time", Some(("Eastern Standard Time".into(), -240, -240))).unwrap(),
            LocalConversion::AtTimeZone("Eastern Standard Time".into())
        );
        // One it lacks, or one its rules put elsewhere than its clock: refused, with the query that lists the right names.
        let e = settle_probe("Nowhere Standard Time", "Nowhere Standard Time", None).unwrap_err();
        assert!(matches!(&e, SourceError::Config(m) if m.contains("does not have") && m.contains("sys.time_zone_info")), "{e}");
        let e = settle_probe("Eastern Standard Time", "Eastern Standard Time", Some(("Eastern Standard Time".into(), -240, -300))).unwrap_err();
        assert!(
            matches!(&e, SourceError::Config(m) if m.contains("UTC-04:00") && m.contains("runs at UTC-05:00") && m.contains("current_utc_offset = '-05:00'")),
            "{e}"
        );
        // Before SQL Server 2016 the lookup fails (no AT TIME ZONE, no view): the current offset converts.
        assert!(lacks_time_zone_support(&classify_server_error(102, "Incorrect syntax near 'AT'.", None)));
        assert!(lacks_time_zone_support(&classify_server_error(208, "Invalid object name 'sys.time_zone_info'.", None)));
        assert!(!lacks_time_zone_support(&classify_server_error(229, "The SELECT permission was denied", None)));
        assert_eq!((hhmm(-240), hhmm(330), hhmm(0)), ("-04:00".to_string(), "+05:30".to_string(), "+00:00".to_string()));
    }

    #[test]
    fn server_errors_map_to_source_errors() {
        let ctx = Ctx { range: Some(("dbo_t".into(), Lsn::from_parts(1, 0, 0), Lsn::from_parts(2, 0, 0))), ..Ctx::default() };
        let io = tiberius::error::Error::Io { kind: std::io::ErrorKind::ConnectionReset, message: "reset".into() };
        assert!(matches!(map_error(io, &ctx), SourceError::Transient(_)));
        let tls = tiberius::error::Error::Tls("bad certificate".into());
        assert!(matches!(map_error(tls, &ctx), SourceError::Config(_)));
        match map_server_error(313, "insufficient arguments", &ctx) {
            SourceError::RangeUnavailable { capture_instance, from, to, .. } => {
                assert_eq!((capture_instance.as_str(), from, to), ("dbo_t", Lsn::from_parts(1, 0, 0), Lsn::from_parts(2, 0, 0)))
            }
            other => panic!("{other:?}"),
        }
        let none = Ctx::default();
        assert!(matches!(map_server_error(18456, "Login failed", &none), SourceError::Permission(m) if m.contains(PASSWORD_ENV)));
        assert!(matches!(map_server_error(229, "SELECT denied", &none), SourceError::Permission(_)));
        // A real 229 with the login known: the message names the GRANT to run.
        let reader = Ctx { login: Some("cdc_reader".into()), ..Ctx::default() };
        let e = map_server_error(229, "The SELECT permission was denied on the object 'index_columns', database 'Sales', schema 'cdc'.", &reader);
        assert!(matches!(&e, SourceError::Permission(m) if m.contains("GRANT SELECT ON OBJECT::[cdc].[index_columns] TO [cdc_reader]")), "{e}");
        let e = map_server_error(230, "The SELECT permission was denied on the column 'qty' of the object 'items', database 'Sales', schema 'dbo'.", &reader);
        assert!(matches!(&e, SourceError::Permission(m) if m.contains("GRANT SELECT ON OBJECT::[dbo].[items] ([qty]) TO [cdc_reader]")), "{e}");
        let e = map_server_error(15009, "The object '[dbo].[items]' does not exist in database 'Sales' or is invalid for this operation.", &reader);
        assert!(matches!(&e, SourceError::Config(m) if m.contains("GRANT SELECT ON OBJECT::[dbo].[items] TO [cdc_reader]")), "{e}");
        assert!(matches!(map_server_error(3952, "snapshot", &none), SourceError::Config(m) if m.contains("ALLOW_SNAPSHOT_ISOLATION")));
        assert!(matches!(map_server_error(208, "Invalid object name", &none), SourceError::Config(_)));
        assert!(matches!(map_server_error(1205, "deadlock victim", &none), SourceError::Transient(_)));
        assert!(matches!(map_server_error(40613, "database unavailable", &none), SourceError::Transient(_)));
        assert!(matches!(map_server_error(8134, "divide by zero", &none), SourceError::Other(_)));
    }

    /// 601 (a NOLOCK scan lost its place) and 3961 (SNAPSHOT met a concurrent
    /// DDL) pass on a new attempt: temporary, so retried and then exit 75.
    #[test]
    fn nolock_data_movement_and_snapshot_ddl_are_transient() {
        for code in [601, 3961] {
            let e = classify_server_error(code, "x", None);
            assert!(matches!(e, SourceError::Transient(ref m) if m.contains(&code.to_string())), "{code}: {e:?}");
        }
    }

    #[tokio::test]
    async fn connect_needs_a_password_and_a_valid_url() {
        let e = MssqlSource::connect("mssql://u@127.0.0.1:1/db", SourceSecrets::default()).await.err().unwrap();
        assert!(e.to_string().contains(PASSWORD_ENV), "{e}");
        let e = MssqlSource::connect("mssql://u:pw@127.0.0.1:1/db", SourceSecrets { password: Some("pw".into()) }).await.err().unwrap();
        assert!(matches!(e, SourceError::Config(_)));
        // Nothing listens on port 1: a transient failure, not a panic.
        let e = MssqlSource::connect("mssql://u@127.0.0.1:1/db?connect_timeout_s=2", SourceSecrets { password: Some("pw".into()) })
            .await
            .err()
            .unwrap();
        assert!(matches!(e, SourceError::Transient(_)), "{e}");
    }

    /// A row of `sql::captured_columns`, as the server sends it, for a
    /// column the source table still names as captured.
    fn captured_row(column: &str, type_name: &str, max_len: i32, computed: bool) -> Row {
        captured_row_named(column, type_name, max_len, computed, Some(column))
    }

    /// A row of `sql::captured_columns` whose source column is now named
    /// `source_name` (None: the column was dropped).
    fn captured_row_named(column: &str, type_name: &str, max_len: i32, computed: bool, source_name: Option<&str>) -> Row {
        use tiberius::{ColumnData, ColumnType};
        let text = |v: &str| ColumnData::String(Some(v.to_string().into()));
        Row::builder()
            .column("capture_instance", ColumnType::NVarchar, text("dbo_t"))
            .column("column_name", ColumnType::NVarchar, text(column))
            .column("type_name", ColumnType::NVarchar, text(type_name))
            .column("max_len", ColumnType::Int4, ColumnData::I32(Some(max_len)))
            .column("num_precision", ColumnType::Int4, ColumnData::I32(Some(0)))
            .column("num_scale", ColumnType::Int4, ColumnData::I32(Some(0)))
            .column("is_nullable", ColumnType::Bit, ColumnData::Bit(Some(true)))
            .column("is_computed", ColumnType::Bit, ColumnData::Bit(Some(computed)))
            .column("source_name", ColumnType::NVarchar, source_name.map(text).unwrap_or(ColumnData::String(None)))
            .build()
    }

    #[test]
    fn a_captured_column_the_source_names_otherwise_is_reported_renamed() {
        // sp_rename keeps the column id: the catalog row carries the new name.
        assert_eq!(renamed_to(&captured_row_named("amount", "int", 4, false, Some("total"))).unwrap(), Some("total".to_string()));
        // A change of case only is no rename: SQL Server resolves names case-insensitively here.
        assert_eq!(renamed_to(&captured_row_named("amount", "int", 4, false, Some("AMOUNT"))).unwrap(), None);
        assert_eq!(renamed_to(&captured_row("amount", "int", 4, false)).unwrap(), None);
        // A dropped column has no source name: dropped, not renamed.
        assert_eq!(renamed_to(&captured_row_named("amount", "int", 4, false, None)).unwrap(), None);
    }

    #[test]
    fn captured_columns_that_cannot_be_replicated_are_refused_by_name() {
        let t = TableName::new("dbo", "t");
        let ok = captured_column(&captured_row("note", "varchar", 20, false), "dbo_t", &t).unwrap();
        assert_eq!(ok, ColumnDesc::new("note", SqlType::VarChar { len: Some(20) }, true));
        // A computed column is NULL in every change row: refused, naming the fix.
        let e = captured_column(&captured_row("total", "int", 4, true), "dbo_t", &t).unwrap_err();
        assert!(matches!(&e, SourceError::Config(m) if m.contains("'total'") && m.contains("computed") && m.contains("@captured_column_list")), "{e}");
        // CLR types come back under their own names (sql::captured_columns) and are refused.
        for clr in ["geography", "geometry", "hierarchyid"] {
            let e = captured_column(&captured_row("shape", clr, -1, false), "dbo_t", &t).unwrap_err();
            assert!(matches!(&e, SourceError::Config(m) if m.contains("'shape'") && m.contains("@captured_column_list")), "{clr}: {e}");
        }
    }
}
