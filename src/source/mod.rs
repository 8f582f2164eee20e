//! The source protocol: every read this program makes of SQL Server.
//!
//! One trait, [`CdcSource`], with two implementations: `crate::sim` (an
//! embedded SQL Server CDC simulator, `sim://PATH`) and `crate::mssql` (a real
//! server over tiberius, `mssql://…`). Steps only ever talk to the trait, so
//! every scenario the tests run on the simulator runs unchanged on a server.
//! This module names neither implementation: both import it, and the URL
//! that picks one is resolved above them (`crate::connect`).
//!
//! Architecture invariant: nothing here writes to the source. The stream and
//! the snapshots read the change tables, the mapping table and the source
//! table; a read-only login is enough.
//!
//! Connections: each call uses a connection of its own for its duration (a
//! returned stream holds it until dropped), and calls may run concurrently, so
//! N snapshot reads side by side are N connections.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, FixedOffset, LocalResult, NaiveDateTime, TimeZone, Utc};
use deltalake::arrow::array::{ArrayRef, FixedSizeBinaryBuilder, Int32Builder, TimestampMicrosecondBuilder};
use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::arrow::record_batch::RecordBatch;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

use crate::lsn::Lsn;
use crate::types::{BatchBuilder, ColumnDesc, Key, SqlValue, ValueTypeError};

/// A stream of Arrow batches read from the source. Dropping it ends the read
/// and gives the connection back.
pub type BatchStream = BoxStream<'static, Result<RecordBatch, SourceError>>;

/// How long a fenced read waits under its lock before and after it reads
/// the fence: much more than `datetime`'s 1/300 s rounding of the commit
/// times it is compared with, so no commit time rounds across it.
pub const FENCE_GUARD_MS: u64 = 20;

/// A fenced snapshot read ([`CdcSource::snapshot_read_fenced`]): its rows,
/// then the server-local time that divides the commits it holds from those
/// it does not.
pub struct FencedRead {
    pub batches: BatchStream,
    pub fence: futures::future::BoxFuture<'static, Result<NaiveDateTime, SourceError>>,
}

/// The fence of a fenced read, delivered by the task that reads it.
pub fn fence_channel() -> (tokio::sync::oneshot::Sender<Result<NaiveDateTime, SourceError>>, futures::future::BoxFuture<'static, Result<NaiveDateTime, SourceError>>) {
    use futures::FutureExt;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let fut = async move {
        rx.await.unwrap_or_else(|_| Err(SourceError::Transient("the fenced read ended before it read its fence".into())))
    }
    .boxed();
    (tx, fut)
}

/// A snapshot read followed, on the same connection and in the same round
/// trip, by the server's max LSN ([`CdcSource::snapshot_read_then_max_lsn`]).
pub struct ReadThenMaxLsn {
    pub batches: BatchStream,
    /// `Some` when the source read the max LSN after the rows: it resolves
    /// once the stream has ended (a read that failed or was dropped has
    /// none). `None` when the source does not do this; the caller asks
    /// [`CdcSource::max_lsn`] itself after the read.
    pub max_lsn_after: Option<futures::future::BoxFuture<'static, Result<Option<Lsn>, SourceError>>>,
}

/// The max LSN of a [`ReadThenMaxLsn`], delivered by the task that reads it.
pub fn max_lsn_channel() -> (tokio::sync::oneshot::Sender<Result<Option<Lsn>, SourceError>>, futures::future::BoxFuture<'static, Result<Option<Lsn>, SourceError>>) {
    use futures::FutureExt;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let fut = async move {
        rx.await.unwrap_or_else(|_| Err(SourceError::Transient("the read ended before it read the max LSN".into())))
    }
    .boxed();
    (tx, fut)
}

/// A table's two-part name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    pub fn new(schema: impl Into<String>, name: impl Into<String>) -> Self {
        TableName { schema: schema.into(), name: name.into() }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// A table as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableInfo {
    pub name: TableName,
    pub columns: Vec<ColumnDesc>,
    /// Primary key or unique index columns; empty for a heap.
    pub unique_key: Vec<String>,
}

/// A capture instance (`cdc.change_tables` with its `captured_columns` and `index_columns`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureInstance {
    pub name: String,
    pub table: TableName,
    /// The low end of the instance's validity interval; None while SQL Server
    /// has not established it.
    pub start_lsn: Option<Lsn>,
    /// Captured columns in column ordinal order, with their types.
    pub columns: Vec<ColumnDesc>,
    /// The columns that identify a row (`index_column_list`); empty when the
    /// table has no primary key or unique index.
    pub index_columns: Vec<String>,
    /// Captured columns renamed at the source since the instance was created
    /// (`sp_rename`): captured column name (as in `columns`) -> the name the
    /// source table gives that column now (the same `column_id`). Only columns
    /// whose current name differs ignoring ASCII case are listed; a dropped
    /// column is not (it has no name now). The change table and the change
    /// function keep returning the column under its captured name, so change
    /// rows are right; a snapshot read selects names from the source table,
    /// which no longer has the captured one, so every step that reads the
    /// table refuses such an instance (`engine::check_no_renamed_columns`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub renamed: std::collections::BTreeMap<String, String>,
}

impl CaptureInstance {
    /// The captured column of that name, compared case-insensitively as SQL Server resolves names.
    pub fn column(&self, name: &str) -> Option<&ColumnDesc> {
        self.columns.iter().find(|c| c.name.eq_ignore_ascii_case(name))
    }
}

/// The row filter of `cdc.fn_cdc_get_all_changes_<ci>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RowFilter {
    /// `N'all'`: updates as their after-image (4) only.
    All,
    /// `N'all update old'`: updates as a before-image (3) and an after-image (4).
    AllUpdateOld,
}

impl RowFilter {
    pub fn sql_literal(self) -> &'static str {
        match self {
            RowFilter::All => "all",
            RowFilter::AllUpdateOld => "all update old",
        }
    }
}

/// The isolation a snapshot read, count or seek runs under. There is no
/// NOLOCK: a dirty read would let a chunk miss a committed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    /// READ COMMITTED (locking, or statement snapshots under RCSI).
    #[default]
    ReadCommitted,
    /// SNAPSHOT; SQL Server refuses it unless ALLOW_SNAPSHOT_ISOLATION is on.
    Snapshot,
}

impl fmt::Display for Isolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Isolation::ReadCommitted => "read-committed",
            Isolation::Snapshot => "snapshot",
        })
    }
}

/// The relational operator of `sys.fn_cdc_map_time_to_lsn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeOp {
    LargestLessThan,
    LargestLessThanOrEqual,
    SmallestGreaterThan,
    SmallestGreaterThanOrEqual,
}

impl TimeOp {
    pub fn sql_literal(self) -> &'static str {
        match self {
            TimeOp::LargestLessThan => "largest less than",
            TimeOp::LargestLessThanOrEqual => "largest less than or equal",
            TimeOp::SmallestGreaterThan => "smallest greater than",
            TimeOp::SmallestGreaterThanOrEqual => "smallest greater than or equal",
        }
    }
}

/// A range of keys `[lo, hi)`, compared as SQL Server orders them (NULL lowest,
/// strings under the column's collation). `lo = None` is open below and so
/// includes NULL keys; `hi = None` is open above. Two ranges that share a
/// bound never share a row: the predicates are complementary.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct KeyRange {
    pub lo: Option<Key>,
    pub hi: Option<Key>,
}

impl KeyRange {
    pub fn all() -> KeyRange {
        KeyRange::default()
    }

    /// True when the key falls in the range, under SQL Server's ordering.
    pub fn contains(&self, key: &[SqlValue]) -> bool {
        use std::cmp::Ordering::*;
        let above_lo = match &self.lo {
            None => true,
            Some(lo) => {
                // A NULL in a key column is never >= a bound (SQL comparisons with
                // NULL are unknown), except through the open first range.
                if key.iter().any(SqlValue::is_null) {
                    false
                } else {
                    crate::types::key_cmp(key, lo) != Less
                }
            }
        };
        let below_hi = match &self.hi {
            None => true,
            Some(hi) => key.iter().any(SqlValue::is_null) || crate::types::key_cmp(key, hi) == Less,
        };
        above_lo && below_hi
    }
}

/// A snapshot read of one key range of a table.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRead {
    pub table: TableName,
    /// The columns to read, in this order (the capture instance's captured columns).
    pub columns: Vec<ColumnDesc>,
    /// The columns the range is cut on.
    pub keys: Vec<String>,
    pub range: KeyRange,
    pub isolation: Isolation,
    /// The most rows one batch of the stream holds.
    pub batch_rows: usize,
}

/// The zone the server's clock runs in: CDC times (`tran_end_time`) are local
/// wall-clock times of this zone, without an offset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerZone {
    /// The zone as the server names it (a Windows name such as
    /// `E. South America Standard Time`, or `UTC+02:00` for a fixed offset).
    pub name: String,
    pub kind: ZoneKind,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ZoneKind {
    /// A zone with rules (DST), from the IANA database.
    Named(#[serde(with = "tz_serde")] chrono_tz::Tz),
    /// A fixed offset east of UTC, in seconds (servers before 2022 without zone names).
    Fixed(i32),
}

mod tz_serde {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(tz: &chrono_tz::Tz, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(tz.name())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<chrono_tz::Tz, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl ServerZone {
    pub fn utc() -> ServerZone {
        ServerZone { name: "UTC".into(), kind: ZoneKind::Fixed(0) }
    }

    /// The server-local wall-clock time of an instant.
    pub fn to_local(&self, t: DateTime<Utc>) -> NaiveDateTime {
        match &self.kind {
            ZoneKind::Named(tz) => t.with_timezone(tz).naive_local(),
            ZoneKind::Fixed(secs) => t.with_timezone(&FixedOffset::east_opt(*secs).expect("valid offset")).naive_local(),
        }
    }

    /// The instant of a server-local time. In a fall-back overlap it takes the
    /// earlier instant (the offset before the change, as AT TIME ZONE does); in
    /// a spring-forward gap, the offset after the change.
    pub fn to_utc(&self, local: NaiveDateTime) -> DateTime<Utc> {
        match &self.kind {
            ZoneKind::Named(tz) => match tz.from_local_datetime(&local) {
                LocalResult::Single(t) => t.with_timezone(&Utc),
                LocalResult::Ambiguous(a, b) => a.min(b).with_timezone(&Utc),
                LocalResult::None => {
                    // In the gap: read the wall time with the offset in force after it.
                    let after = tz.from_local_datetime(&(local + chrono::Duration::hours(3)));
                    let off = match after {
                        LocalResult::Single(t) | LocalResult::Ambiguous(t, _) => t.offset().fix(),
                        LocalResult::None => FixedOffset::east_opt(0).expect("zero"),
                    };
                    (local - chrono::Duration::seconds(off.local_minus_utc() as i64)).and_utc()
                }
            },
            ZoneKind::Fixed(secs) => (local - chrono::Duration::seconds(*secs as i64)).and_utc(),
        }
    }

    /// The instant of a fenced read's fence, which must be unambiguous: in
    /// the hour a fall-back repeats, a commit of the second pass has a wall
    /// time below a fence of the first, and would be taken for one the read
    /// holds. So such a fence is refused (the caller reads again later).
    pub fn fence_to_utc(&self, local: NaiveDateTime) -> Result<DateTime<Utc>, SourceError> {
        if let ZoneKind::Named(tz) = &self.kind {
            if let LocalResult::Ambiguous(..) = tz.from_local_datetime(&local) {
                return Err(SourceError::Transient(format!(
                    "the fenced read ended at {local}, a wall-clock time the server's zone ({}) repeats as its clock falls back: \
                     commit times cannot be placed against it; call again after the repeated hour",
                    self.name
                )));
            }
        }
        Ok(self.to_utc(local))
    }
}

use chrono::Offset;

/// What went wrong reading the source. Each kind maps to one exit code.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The configuration names something that is not there or cannot work
    /// (bad URL, no such table, table without CDC, SNAPSHOT not allowed...).
    #[error("{0}")]
    Config(String),
    /// The requested LSN range is no longer (or not yet) in the change table:
    /// SQL Server's error 313. Carries the instance and the bounds asked for.
    #[error("the change table of capture instance '{capture_instance}' does not hold the range {from}..{to} (error 313): {reason}")]
    RangeUnavailable { capture_instance: String, from: Lsn, to: Lsn, reason: String },
    /// The login lacks a permission (SQL Server error 229, or a failed login).
    #[error("permission denied: {0}")]
    Permission(String),
    /// A failure that a retry may not see: dropped connection, timeout, deadlock victim.
    #[error("temporary source failure: {0}")]
    Transient(String),
    /// A value the source returned does not fit its declared type.
    #[error(transparent)]
    Value(#[from] ValueTypeError),
    /// Anything else: a defect here or an unexpected answer from the server.
    #[error("source error: {0}")]
    Other(String),
}

/// Every read the workflow makes of SQL Server. Implementations must honour
/// each method's contract exactly: the steps' correctness proofs (the seeds'
/// P1-P5) rest on them.
#[async_trait]
pub trait CdcSource: Send + Sync {
    /// A description of the source safe for logs and errors (no secrets).
    fn describe(&self) -> String;

    /// `sys.fn_cdc_get_max_lsn()`: the highest commit LSN the capture process
    /// has finished, for the whole database. None before capture has run.
    /// Every change with a start LSN at or below it is in the change tables.
    async fn max_lsn(&self) -> Result<Option<Lsn>, SourceError>;

    /// `sys.fn_cdc_get_min_lsn(ci)`: the low end of the instance's validity
    /// interval. None when the instance is unknown, not visible to this login,
    /// or its start is not established (SQL Server's NULL and all-zero alike).
    async fn min_lsn(&self, capture_instance: &str) -> Result<Option<Lsn>, SourceError>;

    /// `sys.fn_cdc_increment_lsn`: the adjacent higher LSN (no existence check).
    async fn increment_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError>;

    /// `sys.fn_cdc_decrement_lsn`: the adjacent lower LSN (no existence check).
    async fn decrement_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError>;

    /// The table's columns and unique key. `Config` error naming the table
    /// when it does not exist (or this login cannot see it).
    async fn table_info(&self, table: &TableName) -> Result<TableInfo, SourceError>;

    /// The table's capture instances (at most two), oldest first, with start
    /// LSN, captured columns (ordinal order, with types), index columns, and
    /// the captured columns the source table now names otherwise
    /// ([`CaptureInstance::renamed`], matched by column id, never by name).
    /// Empty when CDC is not enabled on the table.
    async fn capture_instances(&self, table: &TableName) -> Result<Vec<CaptureInstance>, SourceError>;

    /// The changes of one capture instance with `from <= __$start_lsn <= to`
    /// (a closed range, as `cdc.fn_cdc_get_all_changes_<ci>`), ordered by
    /// (`__$start_lsn`, `__$command_id`, `__$seqval`, `__$operation`) with the
    /// command id read from the change table; on a change table without the
    /// column (before KB3030352) it is NULL and the order is
    /// (`__$start_lsn`, `__$seqval`, `__$operation`), which
    /// `engine::change_order` checks. In
    /// batches of at most `batch_rows` rows with the schema of
    /// [`change_schema`]. `RangeUnavailable` when `from` is below the
    /// instance's min LSN, `to` above max LSN, or `from > to` (error 313).
    /// Cleanup that runs while the stream is read may remove rows from it; the
    /// caller checks min LSN again after the read.
    async fn changes(
        &self,
        capture_instance: &CaptureInstance,
        from: Lsn,
        to: Lsn,
        filter: RowFilter,
        batch_rows: usize,
    ) -> Result<BatchStream, SourceError>;

    /// The rows of the table in `read.range` (cut on `read.keys`), as they are
    /// at the statement's start under `read.isolation` (P1: every commit
    /// finished before the call is seen), in batches of at most `batch_rows`
    /// rows with the schema of [`crate::types::arrow_schema`] of
    /// `read.columns`. Row order is unspecified. SNAPSHOT where the database
    /// does not allow it is a `Config` error.
    async fn snapshot_read(&self, read: &SnapshotRead) -> Result<BatchStream, SourceError>;

    /// The rows of `read.range` as [`CdcSource::snapshot_read`] returns them,
    /// but read under a shared lock on the whole table, taken before the
    /// first row and held until after the fence (`WITH (TABLOCK, HOLDLOCK)`
    /// in one transaction, whatever `read.isolation` says). The fence is the
    /// server-local clock (`SYSDATETIME()`) read under the lock at least
    /// [`FENCE_GUARD_MS`] after the read ended, and the lock is held at least
    /// as long again after it. So every transaction that changed the table
    /// and ended at or before the fence (`tran_end_time`) is in the rows, and
    /// every one that ended after it is not: no writer of the table can
    /// commit while the lock is held, and the guards keep both sides more
    /// than datetime's rounding away from the fence. Writers of the table
    /// wait for the read. `fence` resolves once the stream has ended; a read
    /// that failed or was dropped has no fence.
    async fn snapshot_read_fenced(&self, read: &SnapshotRead) -> Result<FencedRead, SourceError>;

    /// The rows [`CdcSource::snapshot_read`] returns, and then, once the last
    /// row has been read, `sys.fn_cdc_get_max_lsn()` read on the same
    /// connection in the same batch: an LSN no smaller than any the rows'
    /// commits carry, so it may end a chunk window (ADR 0028) without a
    /// round trip of its own. A source that cannot do this returns
    /// `max_lsn_after: None`, the default, and the caller asks
    /// [`CdcSource::max_lsn`] after the read.
    async fn snapshot_read_then_max_lsn(&self, read: &SnapshotRead) -> Result<ReadThenMaxLsn, SourceError> {
        Ok(ReadThenMaxLsn { batches: self.snapshot_read(read).await?, max_lsn_after: None })
    }

    /// MIN and MAX of the key (compared column by column as ORDER BY does,
    /// ignoring rows with a NULL key column), or None for an empty table.
    async fn key_extent(&self, table: &TableName, keys: &[String], isolation: Isolation)
        -> Result<Option<(Key, Key)>, SourceError>;

    /// Row counts of one integer column per slice of a grid: slice `i` holds
    /// the values in `[lo + i*width, lo + (i+1)*width)`, for values in
    /// `[lo, hi]` (inclusive). Returns (slice start value, count) for the
    /// non-empty slices only, in order. One GROUP BY on the server.
    async fn slice_counts(
        &self,
        table: &TableName,
        key: &str,
        lo: i64,
        hi: i64,
        width: i64,
        isolation: Isolation,
    ) -> Result<Vec<(i64, u64)>, SourceError>;

    /// The smallest and largest value of one integer column among the rows
    /// whose value is in `[lo, hi]` (inclusive, compared as BIGINT, as
    /// [`CdcSource::slice_counts`] bounds its slices), as (MIN, MAX); None
    /// when no row's value is in the range (`lo > hi` included). NULLs are
    /// outside every range. One statement on the server (`SELECT MIN, MAX ...
    /// WHERE key BETWEEN lo AND hi`), read under `isolation`. The integer
    /// planner probes an over-full slice with it before counting the slice
    /// again, so the finer grid spans the values the slice really holds
    /// (adr-0028's `key_range`).
    async fn slice_extent(&self, table: &TableName, key: &str, lo: i64, hi: i64, isolation: Isolation) -> Result<Option<(i64, i64)>, SourceError>;

    /// The number of rows whose `key` column is NULL (`COUNT_BIG(*)` with
    /// `[key] IS NULL`). An integer chunk plan counts them into its first
    /// chunk, the one range that reads NULL keys; `slice_counts` never sees them.
    async fn null_count(&self, table: &TableName, key: &str, isolation: Isolation) -> Result<u64, SourceError>;

    /// Reconcile's tier 1: per slice of one integer column over `[lo, hi]`
    /// (slice `i` holds `[lo + i*width, lo + (i+1)*width)`), the slice start,
    /// the row count and the exact sum of the column's values, for the
    /// non-empty slices only, in order. Rows whose column is NULL are not
    /// counted. One GROUP BY on the server (COUNT_BIG and SUM as decimal(38,0)).
    async fn bucket_sums(
        &self,
        table: &TableName,
        key: &str,
        lo: i64,
        hi: i64,
        width: i64,
        isolation: Isolation,
    ) -> Result<Vec<(i64, u64, i128)>, SourceError>;

    /// A keyset seek: the key of the `(n + 1)`-th row, in key order, among the
    /// rows in `range`; None when the range holds `n` rows or fewer. With
    /// `n = 0` it is the first key of the range. Keys compare under the
    /// columns' collation, so with repeated values the row returned may hold
    /// a value equal to the range's lower bound.
    async fn key_seek(
        &self,
        table: &TableName,
        keys: &[String],
        range: &KeyRange,
        n: u64,
        isolation: Isolation,
    ) -> Result<Option<Key>, SourceError>;

    /// Compares pairs of keys of `keys` (one value per column) as the server
    /// orders them: each value under its column's type and collation (case,
    /// accents, width, trailing spaces, a binary value's trailing 0x00 all as
    /// the column's collation says), a NULL below every value, columns in
    /// order. The engine never orders or equates strings itself: a collation
    /// is the server's (see `docs/sqlserver.md`). Nothing of the table is read;
    /// one answer per pair, in order.
    async fn compare_keys(&self, table: &TableName, keys: &[String], pairs: &[(Key, Key)]) -> Result<Vec<std::cmp::Ordering>, SourceError>;

    /// An estimate of the table's row count (`sys.sp_spaceused`), used only to size a first grid.
    /// It takes no isolation: `sp_spaceused` reads the partition counts
    /// (`sys.dm_db_partition_stats`), never a row of the table, so a writer's
    /// open transaction on the table does not hold it up under any isolation.
    async fn row_estimate(&self, table: &TableName) -> Result<u64, SourceError>;

    /// `sys.fn_cdc_map_time_to_lsn(op, t)` with `t` a server-local time. The
    /// source rounds `t` to datetime's 1/300 s grid as SQL Server does; None
    /// when no mapping row qualifies.
    async fn time_to_lsn(&self, op: TimeOp, local_time: NaiveDateTime) -> Result<Option<Lsn>, SourceError>;

    /// `sys.fn_cdc_map_lsn_to_time(lsn)`: the server-local commit time
    /// (datetime precision) of a commit LSN; None when the mapping has no row
    /// for it (never captured, or removed by cleanup).
    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<NaiveDateTime>, SourceError>;

    /// The server's wall clock now (`SYSDATETIME()`): the clock
    /// `cdc.lsn_time_mapping` is written in. A transaction a read saw ended
    /// at or before this reading taken after the read, so once the mapping
    /// holds a row at or after it, the capture job has scanned past that
    /// transaction (reconcile's test that a difference is not a change the
    /// capture job has yet to capture).
    ///
    /// The default answers that the source cannot: a wrapper that forwards
    /// every read must forward this one too.
    async fn server_now(&self) -> Result<NaiveDateTime, SourceError> {
        Err(SourceError::Config(format!("{} does not read the server's clock", self.describe())))
    }

    /// The zone of the server's clock. A source that is told the zone (SQL
    /// Server before 2022) checks it against the offset the server's clock
    /// runs at now and refuses one that disagrees (a configuration error).
    async fn server_time_zone(&self) -> Result<ServerZone, SourceError>;

    /// The server's wall-clock time at each instant (one answer per instant,
    /// in order, at `datetime2` precision, before any `datetime` rounding),
    /// computed by the server under its own zone rules: SQL Server converts
    /// with `AT TIME ZONE`, or at its current offset where it has no zone
    /// names. `cdc.lsn_time_mapping` is written in this clock, so a time
    /// looked up there ([`CdcSource::time_to_lsn`]) comes from here, never
    /// from the rules compiled into this program, which can differ from the
    /// server's and then map an hour late.
    ///
    /// The default answers that the source cannot: a wrapper that forwards
    /// every read must forward this one too.
    async fn server_local_times(&self, instants: &[DateTime<Utc>]) -> Result<Vec<NaiveDateTime>, SourceError> {
        let _ = instants;
        Err(SourceError::Config(format!(
            "{} does not convert times to the server's clock, so a time cannot be mapped to an LSN; pass an LSN instead",
            self.describe()
        )))
    }

    /// Reconcile's tier 1 for a key that is not one integer or date column
    /// (adr-0028): the table's row count, `COUNT_BIG(*)` on the server, so
    /// the count costs one number however big the table is.
    async fn row_count(&self, table: &TableName, isolation: Isolation) -> Result<u64, SourceError>;

    /// Reconcile's tier 1 for one date or date-and-time column (date,
    /// smalldatetime, datetime, datetime2): [`CdcSource::bucket_sums`] over
    /// each value's [`micros_since_year_one`] (SQL Server's
    /// `DATEDIFF_BIG(MICROSECOND, '0001-01-01', key)`, rounded down), so
    /// silver, which holds microseconds, sums the same numbers. Slice `i`
    /// holds `[lo + i*width, lo + (i+1)*width)` of those numbers, for values
    /// in `[lo, hi]`; NULLs are not counted. One GROUP BY on the server.
    async fn date_bucket_sums(
        &self,
        table: &TableName,
        key: &str,
        lo: i64,
        hi: i64,
        width: i64,
        isolation: Isolation,
    ) -> Result<Vec<(i64, u64, i128)>, SourceError>;
}

/// True for the column types [`CdcSource::date_bucket_sums`] reads: a date
/// or a date and time without an offset (an offset's instant and its local
/// time order differently, so datetimeoffset keys are left to the count).
pub fn is_date_key(t: &crate::types::SqlType) -> bool {
    use crate::types::SqlType;
    matches!(t, SqlType::Date | SqlType::SmallDateTime | SqlType::DateTime | SqlType::DateTime2 { .. })
}

fn year_one() -> NaiveDateTime {
    chrono::NaiveDate::from_ymd_opt(1, 1, 1).expect("year one").and_hms_opt(0, 0, 0).expect("midnight")
}

/// The microseconds from 0001-01-01 00:00 to a date or date-and-time value,
/// rounded down (a datetime2(7)'s last digit dropped, as silver stores it);
/// None for any other value. Never negative: SQL Server's dates start there.
pub fn micros_since_year_one(v: &SqlValue) -> Option<i64> {
    let t = match v {
        SqlValue::Date(d) => d.and_hms_opt(0, 0, 0)?,
        SqlValue::DateTime(t) => *t,
        _ => return None,
    };
    (t - year_one()).num_microseconds()
}

/// The value of a column of type `ty` at `micros` from 0001-01-01 (the
/// inverse of [`micros_since_year_one`] where the type can hold it): a
/// bound of a tier 2 range. A date takes the day, whatever the time.
pub fn from_micros_since_year_one(micros: i64, ty: &crate::types::SqlType) -> Option<SqlValue> {
    let t = year_one().checked_add_signed(chrono::Duration::microseconds(micros))?;
    match ty {
        crate::types::SqlType::Date => Some(SqlValue::Date(t.date())),
        t2 if is_date_key(t2) => Some(SqlValue::DateTime(t)),
        _ => None,
    }
}

/// A shared handle on a source.
pub type SharedSource = Arc<dyn CdcSource>;

/// The metadata columns that lead every change batch.
pub const CHANGE_START_LSN: &str = "__$start_lsn";
pub const CHANGE_SEQVAL: &str = "__$seqval";
pub const CHANGE_OPERATION: &str = "__$operation";
pub const CHANGE_COMMAND_ID: &str = "__$command_id";
pub const CHANGE_TRAN_END_TIME: &str = "__$tran_end_time";

/// The schema of a change batch: `__$start_lsn` and `__$seqval` as
/// FixedSizeBinary(10), `__$operation` Int32, `__$command_id` Int32 (NULL on
/// change tables from before KB3030352), `__$tran_end_time` the server-local
/// commit time, then the captured columns.
pub fn change_schema(columns: &[ColumnDesc]) -> SchemaRef {
    let mut fields = vec![
        Field::new(CHANGE_START_LSN, DataType::FixedSizeBinary(10), false),
        Field::new(CHANGE_SEQVAL, DataType::FixedSizeBinary(10), false),
        Field::new(CHANGE_OPERATION, DataType::Int32, false),
        Field::new(CHANGE_COMMAND_ID, DataType::Int32, true),
        Field::new(CHANGE_TRAN_END_TIME, DataType::Timestamp(TimeUnit::Microsecond, None), true),
    ];
    fields.extend(columns.iter().map(|c| c.arrow_field()));
    Arc::new(Schema::new(fields))
}

/// One change row as a source produces it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeRow {
    pub start_lsn: Lsn,
    pub seqval: Lsn,
    pub operation: i32,
    pub command_id: Option<i32>,
    pub tran_end_time: Option<NaiveDateTime>,
    pub values: Vec<SqlValue>,
}

/// Builds change batches ([`change_schema`]) from [`ChangeRow`]s; both sources use it.
pub struct ChangeBatchBuilder {
    schema: SchemaRef,
    start: FixedSizeBinaryBuilder,
    seq: FixedSizeBinaryBuilder,
    op: Int32Builder,
    cmd: Int32Builder,
    time: TimestampMicrosecondBuilder,
    values: BatchBuilder,
}

impl ChangeBatchBuilder {
    pub fn new(columns: &[ColumnDesc]) -> Self {
        ChangeBatchBuilder {
            schema: change_schema(columns),
            start: FixedSizeBinaryBuilder::new(10),
            seq: FixedSizeBinaryBuilder::new(10),
            op: Int32Builder::new(),
            cmd: Int32Builder::new(),
            time: TimestampMicrosecondBuilder::new(),
            values: BatchBuilder::new(columns),
        }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub fn push(&mut self, row: &ChangeRow) -> Result<(), SourceError> {
        self.values.push(&row.values)?;
        self.start.append_value(row.start_lsn.0).expect("10 bytes");
        self.seq.append_value(row.seqval.0).expect("10 bytes");
        self.op.append_value(row.operation);
        self.cmd.append_option(row.command_id);
        self.time.append_option(row.tran_end_time.map(|t| t.and_utc().timestamp_micros()));
        Ok(())
    }

    pub fn finish(&mut self) -> RecordBatch {
        let values = self.values.finish();
        let mut cols: Vec<ArrayRef> = vec![
            Arc::new(self.start.finish()),
            Arc::new(self.seq.finish()),
            Arc::new(self.op.finish()),
            Arc::new(self.cmd.finish()),
            Arc::new(self.time.finish()),
        ];
        cols.extend(values.columns().iter().cloned());
        RecordBatch::try_new(self.schema.clone(), cols).expect("builders match the change schema")
    }
}

/// Secrets a source may need, taken from the environment by the caller.
#[derive(Clone, Default)]
pub struct SourceSecrets {
    pub password: Option<String>,
}

impl fmt::Debug for SourceSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.password.is_some() { "SourceSecrets(password: <redacted>)" } else { "SourceSecrets(none)" })
    }
}

