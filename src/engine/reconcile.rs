//! The `reconcile` step: is silver the source table, as of what silver applied?
//!
//! Tier 1 compares cheap aggregates: with one integer or date key, the row
//! count and the exact key sum per bucket of the key on both sides (one
//! GROUP BY on the source, [`crate::source::CdcSource::bucket_sums`], or for a
//! date key [`crate::source::CdcSource::date_bucket_sums`] over microseconds
//! from 0001-01-01, the unit silver holds); with any other key, the row count
//! of the whole table, counted on the source (`COUNT_BIG(*)`,
//! [`crate::source::CdcSource::row_count`]) so tier 1 costs one number
//! whatever the table's size, and the whole table is the one bucket tier 2
//! may read. A date key's buckets are whole days (a `date`), minutes
//! (`smalldatetime`) or seconds (`datetime`): bounds the column holds exactly,
//! so a tier 2 range read on the source holds the rows its bucket counted.
//! An integer or date key gets at least `reconcile.buckets` buckets, and
//! enough that one holds about `reconcile.bucket_rows` rows (from the
//! server's row estimate and silver's count).
//! Tier 2 reads every mismatched bucket and a
//! sample of the matching ones through the snapshot reader, one range at a
//! time, hashes each row
//! on both sides with the same function (SHA-256 of a canonical encoding,
//! [`row_hash`]) and classifies each key that differs. A range larger than
//! `bucket_rows` (another key's whole table, a heap) is compared by hash
//! partitions in passes of `bucket_rows` rows (`compare`), so tier 2 holds
//! at most about `bucket_rows` rows of each side whatever the table's size;
//! only the differences are kept. The classes:
//! - `MISSING_TARGET`: in the source, not in silver;
//! - `MISSING_SOURCE`: in silver, not in the source;
//! - `RECORD_DIFF`: in both, with other values;
//! - `IN_FLIGHT`: any of those, for a key with a change silver has not
//!   applied yet: in bronze after silver's applied LSN, or in the change
//!   table after bronze's position up to the max LSN read after the source
//!   reads (adr-0028 Amendment 2), read as the stream reads it: each capture
//!   instance's piece of that range ([`super::switch::plan`]), and only the
//!   key columns (the heap's: every column). Keys compare null-safely (a NULL key
//!   column is a value of its own), and the report writes it as null.
//!
//! A key met twice on one side is a difference of its own (a map keyed on
//! the key would keep one copy and call the other clean): a second silver
//! row of a key is `MISSING_SOURCE`, a second source row `MISSING_TARGET`.
//! Neither side's bucket sums count NULL keys, so with a nullable key the
//! first bucket, which reads them, is always compared.
//!
//! A heap (no unique index; see `engine::apply`) has no key: silver is a
//! multiset with a count per distinct row, so tier 1 compares the row count
//! (silver's summed counts) and tier 2 every row's hash with its count on
//! both sides. A row held more often in the source is `MISSING_TARGET`, more
//! often in silver `MISSING_SOURCE`; IN_FLIGHT when a change silver has not
//! applied holds those values (before-images too), and the report's key is
//! the whole row.
//!
//! With the facts table, the newest chunked snapshot's chunks are checked
//! against their plan and bronze: `CHUNK_TILING` (a chunk's bounds are not
//! the plan's, or do not meet the next chunk's), `CHUNK_ROWS` (bronze holds
//! another number of rows than the chunk recorded), `CHUNK_STAMP` (a stamp
//! below S, or rows stamped otherwise).
//!
//! While a chunked snapshot is open, silver is exact only in the ranges of
//! the chunks it has applied (the waves up to its control row's
//! `snapshot_wave`); elsewhere it holds what it held before the snapshot
//! (nothing, for a first one) plus the changes since, and a key there that
//! differs is `SNAPSHOT_PENDING`, not a difference: the snapshot has yet to
//! bring it. A key is placed by the columns the chunks are cut on, compared
//! by the server (`CdcSource::compare_keys`: a string key's chunk is the
//! collation's question, never the engine's), a binary search over the
//! applied chunks with one batch of comparisons per step. Keys outside every
//! applied chunk, also above the last planned one, are pending: those ranges
//! are read later. A key held twice stays a difference (no snapshot explains
//! it), and when the chunks are cut on a column a difference's key does not
//! hold, every difference is pending until the snapshot completes. The
//! summary names the open snapshot and the chunks applied.
//!
//! The report (one summary row, one row per difference) is appended to the
//! reconcile table with txn `<app>#reconcile`, version = the run. The step
//! is clean when only IN_FLIGHT and SNAPSHOT_PENDING remain; otherwise the
//! CLI exits 3.

use std::collections::{BTreeMap, HashSet};

use chrono::Utc;
use deltalake::arrow::array::{Array, StringArray};
use deltalake::DeltaTable;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::apply::{self, ident};
use super::chunked::{ChunkPayload, PlanPayload, EVENT_SNAPSHOT_CHUNK, EVENT_SNAPSHOT_PLAN};
use super::rebuild::key_text;
use super::state;
use super::Context;
use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::delta::reconcile::{self as report, ReportRow};
use crate::delta::{self, bronze, plans, silver, sql_str, TableKind, Txn};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::source::{self as src, CaptureInstance, KeyRange, RowFilter, SourceError};
use crate::types::{as_stored, value_at, ColumnDesc, Key, SqlType, SqlValue};

mod compare;
mod found;
mod rows;

pub use rows::{classify, classify_heap, is_difference, key_json, repeated_keys, row_hash, Counts, Difference, Side, CHUNK_ROWS, CHUNK_STAMP, CHUNK_TILING, CLASSES, IN_FLIGHT, MISSING_SOURCE, MISSING_TARGET, RECORD_DIFF, SNAPSHOT_PENDING};
use rows::i64_col;

/// The result of `reconcile`, printed as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct ReconcileResult {
    pub step: &'static str,
    pub run: i64,
    /// No difference but IN_FLIGHT and SNAPSHOT_PENDING.
    pub clean: bool,
    /// Differences other than IN_FLIGHT and SNAPSHOT_PENDING.
    pub differences: u64,
    pub counts: BTreeMap<String, u64>,
    /// `buckets` (one integer or date key) or `count` (the whole table's row count).
    pub tier1: &'static str,
    /// The width of a tier 1 bucket: key units, or microseconds for a date key.
    pub bucket_width: Option<i64>,
    pub buckets: usize,
    pub buckets_mismatched: usize,
    pub buckets_compared: usize,
    pub rows_source: u64,
    pub rows_target: u64,
    pub rows_compared: u64,
    /// Tier 2's passes over both sides (`compare`): one per range that fits
    /// in `reconcile.bucket_rows`, and for a larger one a summary pass plus
    /// one per `bucket_rows` of the hash partitions that differ.
    pub passes: u64,
    /// The most rows tier 2 held at once, both sides together: what its
    /// memory follows (at most about twice `reconcile.bucket_rows`).
    pub rows_held_max: u64,
    /// Difference records written to a temporary file past the
    /// `found::HELD_DIFFERENCES` held in memory: those tier 2 found, then
    /// their labelled copy (IN_FLIGHT, SNAPSHOT_PENDING), so what the disk
    /// held at most is about twice this many times a record's size.
    pub differences_spilled: u64,
    /// Hash partitions tier 2 summarised in ranges larger than
    /// `bucket_rows`, and those whose count or checksum differed.
    pub partitions: u64,
    pub partitions_mismatched: u64,
    pub applied_lsn: Option<Lsn>,
    pub source_max_lsn: Option<Lsn>,
    pub chunk_snapshot: Option<Lsn>,
    pub chunks_checked: usize,
    /// S of the chunked snapshot open now, if one is (its unapplied ranges are SNAPSHOT_PENDING).
    pub open_snapshot: Option<Lsn>,
    /// The open snapshot's chunks silver holds.
    pub open_snapshot_chunks_applied: usize,
    /// The first differences found (class and key).
    pub samples: Vec<Value>,
    pub report: String,
}

/// One tier 1 bucket of an integer key: `[start, start + width)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    pub start: i64,
    pub n: u64,
    pub sum: i128,
}

/// Which buckets tier 2 compares (pure): every one whose count or key sum
/// differs, and `fraction` of the others, picked by a hash of (bucket, run)
/// so each run looks at other ones.
pub fn buckets_to_compare(source: &BTreeMap<i64, (u64, i128)>, target: &BTreeMap<i64, (u64, i128)>, fraction: f64, run: i64) -> (Vec<i64>, usize) {
    let all: std::collections::BTreeSet<i64> = source.keys().chain(target.keys()).copied().collect();
    let mut mismatched = Vec::new();
    let mut matching = Vec::new();
    for b in all {
        if source.get(&b) != target.get(&b) {
            mismatched.push(b);
        } else {
            matching.push(b);
        }
    }
    let take = ((matching.len() as f64) * fraction).ceil() as usize;
    let mut scored: Vec<(u64, i64)> = matching
        .iter()
        .map(|b| {
            let mut h = Sha256::new();
            h.update(b.to_le_bytes());
            h.update(run.to_le_bytes());
            let d = h.finalize();
            (u64::from_le_bytes(d[..8].try_into().expect("8 bytes")), *b)
        })
        .collect();
    scored.sort();
    let n_mismatched = mismatched.len();
    let mut out = mismatched;
    out.extend(scored.into_iter().take(take).map(|(_, b)| b));
    out.sort();
    (out, n_mismatched)
}

/// The tiling, rows and stamps of a chunked snapshot's recorded chunks (pure).
/// `bronze_chunks`: chunk -> (rows, min _start_lsn, max _start_lsn) of its operation-0 rows.
///
/// `completed`: the snapshot has its completion row, so every planned chunk
/// must have been recorded; one that was not is a hole in the tiling, rows
/// the snapshot never read.
pub fn check_chunks(s: Lsn, plan: &PlanPayload, chunks: &[ChunkPayload], bronze_chunks: &BTreeMap<i64, (i64, String, String)>, completed: bool) -> Vec<Difference> {
    let mut out = Vec::new();
    let mut diff = |class: &'static str, chunk: i64, detail: Value| {
        out.push(Difference { class, key: None, bucket: None, chunk: Some(chunk), source_hash: None, target_hash: None, detail: Some(detail) });
    };
    let mut sorted: Vec<&ChunkPayload> = chunks.iter().collect();
    sorted.sort_by_key(|c| c.chunk);
    sorted.dedup_by_key(|c| c.chunk);
    let last_planned = plan.chunks.iter().map(|c| c.chunk).max();
    for c in &sorted {
        match plan.chunks.iter().find(|p| p.chunk == c.chunk) {
            None => diff(CHUNK_TILING, c.chunk, json!({"problem": "not in the plan"})),
            Some(p) => {
                let open_end = plan.open_end && Some(c.chunk) == last_planned;
                if p.lo != c.lo || (p.hi != c.hi && !open_end) {
                    diff(CHUNK_TILING, c.chunk, json!({"problem": "bounds differ from the plan", "plan": {"lo": p.lo, "hi": p.hi}, "chunk": {"lo": c.lo, "hi": c.hi}}));
                }
            }
        }
    }
    if completed {
        for p in plan.chunks.iter().filter(|p| !sorted.iter().any(|c| c.chunk == p.chunk)) {
            diff(CHUNK_TILING, p.chunk, json!({"problem": "planned but never recorded, though the snapshot completed", "plan": {"lo": p.lo, "hi": p.hi}}));
        }
    }
    for pair in sorted.windows(2) {
        if pair[1].chunk == pair[0].chunk + 1 && pair[0].hi != pair[1].lo {
            diff(CHUNK_TILING, pair[1].chunk, json!({"problem": "does not start where the chunk before ends", "before_hi": pair[0].hi, "lo": pair[1].lo}));
        }
    }
    if let Some(first) = sorted.first().filter(|c| c.chunk == 0) {
        if first.lo.is_some() {
            diff(CHUNK_TILING, 0, json!({"problem": "the first chunk is not open below (NULL keys and keys below MIN)"}));
        }
    }
    for c in &sorted {
        if c.stamp < s {
            diff(CHUNK_STAMP, c.chunk, json!({"problem": "stamp below S", "stamp": c.stamp, "snapshot": s}));
        }
        let stamp = c.stamp.to_hex();
        match bronze_chunks.get(&c.chunk) {
            None if c.rows == 0 => {}
            None => diff(CHUNK_ROWS, c.chunk, json!({"recorded": c.rows, "bronze": 0})),
            Some((n, lo, hi)) => {
                if *n != c.rows {
                    diff(CHUNK_ROWS, c.chunk, json!({"recorded": c.rows, "bronze": n}));
                }
                if *lo != stamp || *hi != stamp {
                    diff(CHUNK_STAMP, c.chunk, json!({"problem": "rows stamped otherwise", "stamp": stamp, "min": lo, "max": hi}));
                }
            }
        }
    }
    out
}

/// A SQL predicate over silver for a tier 2 range of one integer or date key.
fn range_sql(key: &str, range: &KeyRange) -> String {
    let k = ident(key);
    let lo = match range.lo.as_ref().and_then(|l| l.first()).and_then(silver_literal) {
        Some(v) => format!("{k} >= {v}"),
        None => "TRUE".into(),
    };
    let hi = match range.hi.as_ref().and_then(|h| h.first()).and_then(silver_literal) {
        Some(v) => format!("({k} < {v} OR {k} IS NULL)"),
        None => "TRUE".into(),
    };
    format!("{lo} AND {hi}")
}

/// A bucket bound as a literal of silver's key column: an integer, a DATE,
/// or a TIMESTAMP to the microsecond (bucket bounds are whole microseconds).
fn silver_literal(v: &SqlValue) -> Option<String> {
    match v {
        SqlValue::Int(i) => Some(i.to_string()),
        SqlValue::Date(d) => Some(format!("CAST('{}' AS DATE)", d.format("%Y-%m-%d"))),
        SqlValue::DateTime(t) => Some(format!("CAST('{}' AS TIMESTAMP)", t.format("%Y-%m-%dT%H:%M:%S%.6f"))),
        _ => None,
    }
}

/// A tier 1 key value as a number on the bucket grid: the integer itself,
/// or a date's microseconds from 0001-01-01 (rounded down, as silver holds it).
fn key_ordinal(v: &SqlValue) -> Option<i64> {
    match v {
        SqlValue::Int(i) => Some(*i),
        other => src::micros_since_year_one(other),
    }
}

/// The grid unit of a tier 1 key, in its ordinal: 1 for an integer; for a
/// date type the finest step whose bounds the column holds exactly, so a
/// bucket bound sent to the source (cast to the column's type) is not
/// rounded into the next bucket: a day for `date`, a minute for
/// `smalldatetime`, a second for `datetime` (1/300 s ticks), a microsecond
/// for `datetime2`.
fn bucket_unit(t: &SqlType) -> i64 {
    match t {
        SqlType::Date => 86_400_000_000,
        SqlType::SmallDateTime => 60_000_000,
        SqlType::DateTime => 1_000_000,
        _ => 1,
    }
}

/// The grid of `buckets` buckets over `[lo, hi]` (ordinals): the start,
/// aligned down to the unit, and the width, a whole number of units (pure).
pub fn bucket_grid(lo: i64, hi: i64, buckets: u32, unit: i64) -> (i64, i64) {
    let unit = unit.max(1) as i128;
    let start = lo as i128 - (lo as i128).rem_euclid(unit);
    let span = hi as i128 - start + 1;
    let per = (span + buckets.max(1) as i128 - 1) / buckets.max(1) as i128;
    let width = ((per + unit - 1) / unit * unit).max(unit);
    (start as i64, i64::try_from(width).unwrap_or(i64::MAX))
}

/// A bucket bound as a value of the key's column.
fn bound_value(ordinal: i64, t: &SqlType) -> Option<SqlValue> {
    if t.is_integer() {
        Some(SqlValue::Int(ordinal))
    } else {
        src::from_micros_since_year_one(ordinal, t)
    }
}

/// The key texts of bronze's changes after `after` (all changes when None).
/// `id` names a key (its key text) or, for a heap, a row (its hash over every column).
async fn bronze_changed_keys(bronze_table: &DeltaTable, keys: &[ColumnDesc], after: Option<Lsn>, id: fn(&[SqlValue]) -> String) -> StepResult<HashSet<String>> {
    let cols: Vec<String> = keys.iter().map(|k| ident(&k.name)).collect();
    let filter = match after {
        Some(a) => format!("{} <> 0 AND {} > {}", bronze::OPERATION, bronze::START_LSN, sql_str(&a.to_hex())),
        None => format!("{} <> 0", bronze::OPERATION),
    };
    let mut stream = delta::query_stream(bronze_table, &format!("SELECT DISTINCT {} FROM t WHERE {filter}", cols.join(", "))).await?;
    let mut out = HashSet::new();
    while let Some(b) = stream.next().await {
        let b = delta::plain_types(&b.map_err(|e| StepError::Temporary(format!("reading bronze: {e}")))?)?;
        for r in 0..b.num_rows() {
            let key: Key = keys.iter().enumerate().map(|(i, k)| value_at(b.column(i).as_ref(), r, &k.sql_type)).collect();
            out.insert(id(&key));
        }
    }
    Ok(out)
}

/// The key texts of the change table's changes in `(position, max]`: what
/// the stream has not read yet, read as the stream reads it (adr-0028
/// Amendment 2, ADR 0023): the stream's instance up to the LSN before a newer
/// instance's start, then the newer one from its start ([`super::switch::plan`],
/// the rule the stream moves by), so a lag that spans a switch is read whole
/// even once the older instance is dropped, and no change is read twice.
/// Each read asks for `columns` only (keys; a heap's every column), what the
/// IN_FLIGHT match needs: a stream far behind sends keys, not rows. A piece
/// the change table no longer holds (cleanup, a dropped instance) is logged
/// and skipped; the other pieces still count.
#[allow(clippy::too_many_arguments)]
async fn change_table_keys(
    ctx: &Context,
    instances: &[CaptureInstance],
    columns: &[ColumnDesc],
    position: Option<Lsn>,
    max: Option<Lsn>,
    filter: RowFilter,
    id: fn(&[SqlValue]) -> String,
) -> StepResult<HashSet<String>> {
    let mut out = HashSet::new();
    let (Some(max), Some(mut pos)) = (max, position) else { return Ok(out) };
    let mut on = ctx.instance.clone();
    while pos < max {
        let upto = match super::switch::plan(pos, &on, instances) {
            super::switch::InstancePlan::Switch { to } => {
                on = to;
                continue;
            }
            super::switch::InstancePlan::Stay { upto } => upto,
        };
        let to = upto.map_or(max, |u| u.min(max));
        let from = ctx.source.increment_lsn(pos).await?;
        if from <= to {
            let mut piece = on.clone();
            piece.columns = columns.iter().filter_map(|c| on.column(&c.name).cloned()).collect();
            read_change_keys(ctx, &piece, columns, from, to, filter, id, &mut out).await?;
        }
        pos = to;
    }
    Ok(out)
}

/// Where the capture job stands against the end of reconcile's reads.
enum CapturePassed {
    /// The max LSN read after the reads already maps to a time at or after their end.
    Already,
    /// It does now: the newer max LSN.
    Now(Lsn),
    /// Not within the wait; the newest mapping time seen.
    NotYet { newest: Option<chrono::NaiveDateTime> },
}

/// Waits, up to `wait`, for the capture job to record a mapping row at or
/// after `reads_ended` (the server's clock read after the source reads).
/// Commit LSNs follow commit order, and the capture job scans the log in
/// that order and records idle rows in quiet periods, so such a row means
/// every transaction the reads saw is in the change table (or touched no
/// captured table). A row in the same `datetime` tick as the end may have
/// been rounded below it: the wait then goes on to the next row, never the
/// other way.
async fn capture_passed(ctx: &Context, reads_ended: chrono::NaiveDateTime, read_max: Option<Lsn>, wait: std::time::Duration) -> StepResult<CapturePassed> {
    let deadline = std::time::Instant::now() + wait;
    let mut max = read_max;
    loop {
        let newest = match max {
            Some(m) => ctx.source.lsn_to_time(m).await?,
            None => None,
        };
        if let (Some(m), Some(t)) = (max, newest) {
            if t >= reads_ended {
                return Ok(if max == read_max { CapturePassed::Already } else { CapturePassed::Now(m) });
            }
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return Ok(CapturePassed::NotYet { newest });
        }
        tokio::time::sleep((deadline - now).min(std::time::Duration::from_millis(250))).await;
        max = ctx.source.max_lsn().await?;
    }
}

/// One piece of [`change_table_keys`]: one instance, `[from, to]`.
#[allow(clippy::too_many_arguments)]
async fn read_change_keys(
    ctx: &Context,
    piece: &CaptureInstance,
    columns: &[ColumnDesc],
    from: Lsn,
    to: Lsn,
    filter: RowFilter,
    id: fn(&[SqlValue]) -> String,
    out: &mut HashSet<String>,
) -> StepResult<()> {
    let mut stream = match ctx.source.changes(piece, from, to, filter, 8192).await {
        Ok(s) => s,
        Err(SourceError::RangeUnavailable { reason, .. }) => {
            tracing::warn!(instance = %piece.name, %from, %to, %reason, "the change table no longer holds this piece of the stream's lag: IN_FLIGHT counts bronze's changes for it");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    while let Some(b) = stream.next().await {
        let b = b?;
        let idx: Vec<Option<usize>> = columns.iter().map(|k| b.schema().fields().iter().position(|f| f.name().eq_ignore_ascii_case(&k.name))).collect();
        for r in 0..b.num_rows() {
            let key: Key = columns
                .iter()
                .zip(&idx)
                .map(|(k, i)| match i {
                    Some(i) => as_stored(&value_at(b.column(*i).as_ref(), r, &k.sql_type), &k.sql_type),
                    None => SqlValue::Null,
                })
                .collect();
            out.insert(id(&key));
        }
    }
    Ok(())
}

/// Checks the newest chunked snapshot's recorded chunks against its plan and bronze.
async fn chunk_checks(ctx: &Context, facts: &[FactRow]) -> StepResult<(Option<Lsn>, usize, Vec<Difference>)> {
    let newest = facts
        .iter()
        .filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN))
        .filter(|r| r.detail.as_ref().and_then(|d| d.get("mode")).and_then(Value::as_str) == Some("chunked"))
        .filter_map(|r| r.min_lsn)
        .max();
    let Some(s) = newest else { return Ok((None, 0, vec![])) };
    let recorded = apply::waves_in_facts(facts, s);
    let recorded_count: usize = recorded.values().map(|cs| cs.len()).sum();
    let completed = facts
        .iter()
        .any(|r| matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT)) && r.min_lsn == Some(s));
    let location = plans::location_for(&ctx.workflow.target.bronze);
    // Facts first, then plans (adr-0028 Amendment 4): a chunk the facts record
    // without its plans row is a broken pair, never a reason to check nothing.
    let missing = |what: &str| {
        StepError::NeedsPerson(format!(
            "the facts record {recorded_count} chunk(s) of the chunked snapshot at {s}, but {what} in the plans table {location}: \
             the chunks' bounds are lost, so their tiling cannot be checked. Restore the plans table (Delta time travel or a backup), \
             or open a new snapshot for this table"
        ))
    };
    let table = match delta::open_existing(&location, &ctx.storage).await? {
        Some(t) => t,
        None if recorded_count == 0 => return Ok((Some(s), 0, vec![])),
        None => return Err(missing("there is no such table")),
    };
    let batches = delta::query(&table, &format!("SELECT * FROM t WHERE app_id = {} AND snapshot = {}", sql_str(&ctx.workflow.app_id), sql_str(&s.to_hex()))).await?;
    let rows = plans::from_batches(&batches)?;
    let plan = match rows.iter().find(|r| r.event == EVENT_SNAPSHOT_PLAN) {
        Some(p) => p,
        // Not planned yet: the first backfill writes the plan before any chunk.
        None if recorded_count == 0 => return Ok((Some(s), 0, vec![])),
        None => return Err(missing("the snapshot has no plan row")),
    };
    let plan: PlanPayload = serde_json::from_value(plan.detail.clone()).map_err(|e| StepError::Internal(format!("plan row: {e}")))?;
    let mut chunks: Vec<ChunkPayload> = Vec::new();
    for (w, cs) in &recorded {
        for c in cs {
            let Some(r) = rows.iter().find(|r| r.event == EVENT_SNAPSHOT_CHUNK && r.chunk == Some(*c) && r.wave == Some(*w)) else {
                return Err(missing(&format!("chunk {c} of wave {w} has no row")));
            };
            chunks.push(serde_json::from_value(r.detail.clone()).map_err(|e| StepError::Internal(format!("chunk {c}'s plans row: {e}")))?);
        }
    }
    let sql = format!(
        "SELECT {chunk}, COUNT(*) AS n, MIN({start}) AS lo, MAX({start}) AS hi FROM t WHERE {snap} = {s} AND {op} = 0 AND {chunk} IS NOT NULL GROUP BY {chunk}",
        chunk = bronze::CHUNK,
        start = bronze::START_LSN,
        snap = bronze::SNAPSHOT,
        op = bronze::OPERATION,
        s = sql_str(&s.to_hex())
    );
    let mut bronze_chunks = BTreeMap::new();
    for b in delta::query(&ctx.bronze, &sql).await? {
        let (c, n) = (i64_col(&b, 0)?, i64_col(&b, 1)?);
        let lo = b.column(2).as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("min stamp".into()))?;
        let hi = b.column(3).as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("max stamp".into()))?;
        for i in 0..b.num_rows() {
            bronze_chunks.insert(c.value(i), (n.value(i), lo.value(i).to_string(), hi.value(i).to_string()));
        }
    }
    let diffs = check_chunks(s, &plan, &chunks, &bronze_chunks, completed);
    Ok((Some(s), chunks.len(), diffs))
}

/// The most tier 1 buckets of an integer or date key (`reconcile.buckets`'s bound too).
const MAX_BUCKETS: u64 = 1_000_000;

/// Labels IN_FLIGHT each difference (other than a repeated key's) whose key
/// (a heap's: row hash) has a change silver has not applied, SNAPSHOT_PENDING
/// ones included: a change in flight explains a key whatever the snapshot.
fn label_in_flight(diffs: &mut [Difference], in_flight: &HashSet<String>, heap: bool) {
    for d in diffs.iter_mut().filter(|d| matches!(d.class, MISSING_TARGET | MISSING_SOURCE | RECORD_DIFF | SNAPSHOT_PENDING)) {
        let id = if heap { d.source_hash.clone().or_else(|| d.target_hash.clone()) } else { d.key.as_ref().map(|k| key_text(k)) };
        if id.is_some_and(|id| in_flight.contains(&id)) {
            d.class = IN_FLIGHT;
        }
    }
}

/// A chunked snapshot open beside silver, as reconcile places keys in it.
struct OpenSnapshot {
    s: Lsn,
    /// The chunks silver holds (the waves up to its control row's), sorted by range.
    applied: Vec<ChunkPayload>,
    /// The columns the chunks are cut on.
    cut: Vec<String>,
    /// For each of `cut`, its place in a difference's key (`key_cols`);
    /// None when the key lacks one: nothing can be placed.
    at: Option<Vec<usize>>,
}

/// The chunked snapshot open now, if any, with the chunks silver applied
/// (none when its control row is not applying this snapshot yet).
/// `key_cols` are the columns of a difference's key: the silver key, or a
/// heap's every column.
async fn open_snapshot(ctx: &Context, facts: &[FactRow], control: &crate::delta::control::ControlRow, key_cols: &[ColumnDesc]) -> StepResult<Option<OpenSnapshot>> {
    let Some(s) = apply::open_chunked(facts) else { return Ok(None) };
    let upto = control.snapshot_wave.filter(|_| control.open_snapshot_lsn == Some(s));
    let (cut, applied) = match upto {
        None => (vec![], vec![]),
        Some(_) => match apply::heap::chunked_base(ctx, facts, s, upto, apply::heap::Base::Empty).await? {
            apply::heap::Base::Chunked { keys, read, .. } => (keys, read),
            _ => return Err(StepError::Internal("a chunked snapshot's base is not chunked".into())),
        },
    };
    let at: Option<Vec<usize>> = cut.iter().map(|c| key_cols.iter().position(|k| k.name.eq_ignore_ascii_case(c))).collect();
    Ok(Some(OpenSnapshot { s, applied, cut, at }))
}

/// Marks `SNAPSHOT_PENDING` the keys of `diffs` (MISSING_TARGET,
/// MISSING_SOURCE, RECORD_DIFF) that lie outside every chunk silver holds of
/// the open snapshot.
async fn mark_pending(ctx: &Context, table: &crate::source::TableName, open: Option<&OpenSnapshot>, diffs: &mut [Difference]) -> StepResult<()> {
    let Some(open) = open else { return Ok(()) };
    let candidates: Vec<usize> =
        (0..diffs.len()).filter(|&i| matches!(diffs[i].class, MISSING_TARGET | MISSING_SOURCE | RECORD_DIFF) && diffs[i].key.is_some()).collect();
    let inside = match (&open.at, open.applied.is_empty()) {
        (_, true) | (None, _) => vec![false; candidates.len()],
        (Some(at), false) => {
            let keys: Vec<Key> = candidates.iter().map(|&i| at.iter().map(|&j| diffs[i].key.as_ref().expect("a candidate has a key")[j].clone()).collect()).collect();
            let source = &ctx.source;
            in_chunks(&open.applied, &keys, |pairs| async move { source.compare_keys(table, &open.cut, &pairs).await }).await?
        }
    };
    for (i, inside) in candidates.into_iter().zip(inside) {
        if !inside {
            diffs[i].class = SNAPSHOT_PENDING;
        }
    }
    Ok(())
}

/// Which of `keys` lie in one of `chunks` (sorted by range, `[lo, hi)`, the
/// one open below holding the keys with a NULL), under the order `compare`
/// answers for a batch of pairs (the server's). A binary search per key for
/// the last chunk whose `lo` is at or below it, then one comparison with its
/// `hi`; each step of all the searches is one call of `compare`.
pub async fn in_chunks<F, Fut>(chunks: &[ChunkPayload], keys: &[Key], compare: F) -> StepResult<Vec<bool>>
where
    F: Fn(Vec<(Key, Key)>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<std::cmp::Ordering>, SourceError>>,
{
    use std::cmp::Ordering::*;
    let n = chunks.len();
    let null = |k: &Key| k.iter().any(SqlValue::is_null);
    let mut out: Vec<bool> = keys.iter().map(|k| null(k) && chunks.first().is_some_and(|c| c.lo.is_none())).collect();
    // [lo, hi) of the search: the count of chunks whose `lo` is at or below the key lies in it.
    let mut bounds: Vec<(usize, usize)> = keys.iter().map(|k| if null(k) { (0, 0) } else { (0, n) }).collect();
    loop {
        let mut pairs = Vec::new();
        let mut asked = Vec::new();
        for (i, b) in bounds.iter_mut().enumerate() {
            while b.0 < b.1 {
                let mid = (b.0 + b.1) / 2;
                match &chunks[mid].lo {
                    None => b.0 = mid + 1,
                    Some(lo) => {
                        pairs.push((lo.clone(), keys[i].clone()));
                        asked.push((i, mid));
                        break;
                    }
                }
            }
        }
        if pairs.is_empty() {
            break;
        }
        let answers = compare(pairs).await.map_err(StepError::from)?;
        for ((i, mid), o) in asked.into_iter().zip(answers) {
            if o == Greater {
                bounds[i].1 = mid;
            } else {
                bounds[i].0 = mid + 1;
            }
        }
    }
    let mut pairs = Vec::new();
    let mut asked = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if null(k) || bounds[i].0 == 0 {
            continue;
        }
        match &chunks[bounds[i].0 - 1].hi {
            None => out[i] = true,
            Some(hi) => {
                pairs.push((k.clone(), hi.clone()));
                asked.push(i);
            }
        }
    }
    if !pairs.is_empty() {
        for (i, o) in asked.into_iter().zip(compare(pairs).await.map_err(StepError::from)?) {
            out[i] = o == Less;
        }
    }
    Ok(out)
}

/// The `reconcile` step.
pub async fn run(ctx: &mut Context) -> StepResult<ReconcileResult> {
    let instances = super::switch::follow_stream(ctx).await?;
    // Tier 2 reads the table with the stream's instance's columns; a renamed
    // one would read as NULL and be reported as a difference in every row.
    super::check_no_renamed_columns(ctx, "reconcile")?;
    let is_heap = apply::heap::is_heap(ctx);
    let keys = if is_heap { vec![] } else { apply::silver_keys(ctx)? };
    let app = ctx.workflow.app_id.clone();
    let silver_loc = ctx.workflow.silver_location("reconcile")?;
    let report_loc = ctx.workflow.reconcile_location()?;
    let no_silver = || StepError::Config(format!("silver {silver_loc} has no applied state yet: run `mssql-cdc --workflow FILE apply` first"));
    let mut silver_table = delta::open_existing(&silver_loc, &ctx.storage).await?.ok_or_else(no_silver)?;
    delta::check_kind_and_migrate(&mut silver_table, &silver_loc, TableKind::Silver, &apply::silver_schema(ctx)).await?;
    apply::check_shape(ctx, &silver_table, &silver_loc)?;
    // After the stream moved to a capture instance with more columns, silver
    // gains them at the next apply; until then there is nothing to compare
    // them with, and the verdict would be wrong, not late.
    let silver_holds: Vec<String> =
        silver_table.snapshot().map_err(StepError::delta(&silver_loc))?.schema().fields().map(|f| f.name().to_lowercase()).collect();
    let not_in_silver: Vec<&str> =
        ctx.instance.columns.iter().filter(|c| !silver_holds.contains(&c.name.to_lowercase())).map(|c| c.name.as_str()).collect();
    if !not_in_silver.is_empty() {
        return Err(StepError::Temporary(format!(
            "silver {silver_loc} does not hold column(s) {} of capture instance '{}' yet: the stream has moved to that instance \
             and `apply` has not run since. Run `mssql-cdc --workflow FILE apply`, then reconcile again",
            not_in_silver.join(", "),
            ctx.instance.name
        )));
    }
    let control_loc = silver::control_location_for(&silver_loc);
    let mut control_table = delta::open_existing(&control_loc, &ctx.storage).await?.ok_or_else(no_silver)?;
    delta::check_kind_and_migrate(&mut control_table, &control_loc, TableKind::Control, &crate::delta::control::schema()).await?;
    if let Some(mut t) = delta::open_existing(&report_loc, &ctx.storage).await? {
        delta::check_kind_and_migrate(&mut t, &report_loc, TableKind::Reconcile, &report::schema()).await?;
    }
    let control = apply::last_control(&mut control_table, &app).await?.ok_or_else(no_silver)?;
    let applied = control.applied_lsn;
    let mut report_table = delta::open_or_create(
        &report_loc,
        &ctx.storage,
        TableKind::Reconcile,
        &report::schema(),
        &format!("mssql-cdc reconcile reports of {}: a summary row per run and a row per difference", ctx.workflow.table_name()),
    )
    .await?;
    let run = delta::txn_version(&report_table, &format!("{app}#reconcile")).await?.map(|v| v + 1).unwrap_or(0);
    let opts = ctx.workflow.reconcile.clone();
    let columns = ctx.instance.columns.clone();
    let key_idx: Vec<usize> = keys.iter().map(|k| columns.iter().position(|c| c.name == k.name).expect("a key is captured")).collect();
    let table = ctx.workflow.table_name();
    let iso = ctx.workflow.snapshot.isolation;
    let key_names: Vec<String> = keys.iter().map(|k| k.name.clone()).collect();

    // Tier 1.
    let bucketed = !is_heap && keys.len() == 1 && (keys[0].sql_type.is_integer() || src::is_date_key(&keys[0].sql_type));
    let mut ranges: Vec<(Option<i64>, KeyRange)> = Vec::new();
    let (rows_source, mut rows_target): (u64, u64);
    let (tier1, n_buckets, n_mismatched);
    let mut bucket_width = None;
    // Per tier 1 bucket, the larger side's rows: how tier 2 compares it.
    let mut bucket_rows_counted: BTreeMap<i64, u64> = BTreeMap::new();
    if bucketed {
        let k = &keys[0].name;
        let key_type = keys[0].sql_type.clone();
        let src_ext = ctx.source.key_extent(&table, &key_names, iso).await?;
        let ext_sql = format!("SELECT MIN({k}), MAX({k}), COUNT(*) FROM t", k = ident(k));
        let tb = delta::query(&silver_table, &ext_sql).await?;
        let mut silver_rows = 0u64;
        for b in &tb {
            let b = delta::plain_types(b)?;
            for i in 0..b.num_rows() {
                silver_rows += value_at(b.column(2).as_ref(), i, &SqlType::BigInt).as_i64().unwrap_or(0).max(0) as u64;
            }
        }
        // Enough buckets that one holds about bucket_rows rows: a bucket
        // tier 2 compares is then one pass (`compare`), not a hash split.
        let rows_estimate = ctx.source.row_estimate(&table).await?.max(silver_rows);
        let n_grid = u64::from(opts.buckets).max(rows_estimate.div_ceil(opts.bucket_rows.max(1))).min(MAX_BUCKETS) as u32;
        let mut lo: Option<i64> = None;
        let mut hi: Option<i64> = None;
        let mut widen = |v: Option<i64>| {
            if let Some(v) = v {
                lo = Some(lo.map_or(v, |l| l.min(v)));
                hi = Some(hi.map_or(v, |h| h.max(v)));
            }
        };
        if let Some((a, b)) = &src_ext {
            widen(a.first().and_then(key_ordinal));
            widen(b.first().and_then(key_ordinal));
        }
        for b in &tb {
            let b = delta::plain_types(b)?;
            for col in 0..2 {
                for i in 0..b.num_rows() {
                    widen(key_ordinal(&value_at(b.column(col).as_ref(), i, &key_type)));
                }
            }
        }
        let mut src: BTreeMap<i64, (u64, i128)> = BTreeMap::new();
        let mut tgt: BTreeMap<i64, (u64, i128)> = BTreeMap::new();
        let mut width = 1i64;
        let mut grid_start = None;
        if let (Some(lo), Some(hi)) = (lo, hi) {
            let (start, w) = bucket_grid(lo, hi, n_grid, bucket_unit(&key_type));
            let lo = start;
            width = w;
            grid_start = Some(lo);
            let sums = if key_type.is_integer() {
                ctx.source.bucket_sums(&table, k, lo, hi, width, iso).await?
            } else {
                ctx.source.date_bucket_sums(&table, k, lo, hi, width, iso).await?
            };
            for (start, n, sum) in sums {
                src.insert(start, (n, sum));
            }
            let mut stream = delta::query_stream(&silver_table, &format!("SELECT {} FROM t", ident(k))).await?;
            while let Some(b) = stream.next().await {
                let b = delta::plain_types(&b.map_err(|e| StepError::Temporary(format!("reading silver: {e}")))?)?;
                for i in 0..b.num_rows() {
                    let Some(v) = key_ordinal(&value_at(b.column(0).as_ref(), i, &key_type)) else { continue };
                    let start = (lo as i128 + ((v as i128 - lo as i128) / width as i128) * width as i128) as i64;
                    let e = tgt.entry(start).or_default();
                    e.0 += 1;
                    e.1 += v as i128;
                }
            }
        }
        bucket_width = grid_start.map(|_| width);
        rows_source = src.values().map(|v| v.0).sum();
        rows_target = tgt.values().map(|v| v.0).sum();
        for (b, (n, _)) in src.iter().chain(tgt.iter()) {
            let e = bucket_rows_counted.entry(*b).or_default();
            *e = (*e).max(*n);
        }
        let (chosen, mismatched) = buckets_to_compare(&src, &tgt, opts.sample_fraction, run);
        n_buckets = src.keys().chain(tgt.keys()).collect::<HashSet<_>>().len();
        n_mismatched = mismatched;
        let first = src.keys().chain(tgt.keys()).min().copied();
        let last = src.keys().chain(tgt.keys()).max().copied();
        // NULL keys are in no bucket sum (neither side counts them), so the
        // first bucket, which also reads them, is compared whenever the key
        // may be NULL; with no bucket at all, the whole (NULL-only or empty) table is.
        let mut chosen = chosen;
        if keys[0].nullable {
            match first {
                Some(f) if !chosen.contains(&f) => chosen.insert(0, f),
                Some(_) => {}
                None => ranges.push((None, KeyRange::all())),
            }
        }
        for b in chosen {
            // The first bucket also takes NULL keys and keys below the extent; the last, keys above it.
            let lo_b = if Some(b) == first { None } else { bound_value(b, &key_type).map(|v| vec![v]) };
            let hi_b = if Some(b) == last { None } else { b.checked_add(width).and_then(|h| bound_value(h, &key_type)).map(|v| vec![v]) };
            ranges.push((Some(b), KeyRange { lo: lo_b, hi: hi_b }));
        }
        tier1 = "buckets";
    } else {
        // One row count for the whole table: the source counts its rows, so
        // no row crosses unless tier 2 reads the table (a count mismatch, or
        // the sample). A heap's silver counts its rows in `_count`.
        rows_source = ctx.source.row_count(&table, iso).await?;
        let count_sql = if is_heap { format!("SELECT CAST(SUM({}) AS BIGINT) FROM t", ident(silver::COUNT)) } else { "SELECT COUNT(*) FROM t".to_string() };
        rows_target = 0;
        for b in delta::query(&silver_table, &count_sql).await? {
            let b = delta::plain_types(&b)?;
            for i in 0..b.num_rows() {
                if let Some(n) = value_at(b.column(0).as_ref(), i, &SqlType::BigInt).as_i64() {
                    rows_target += n.max(0) as u64;
                }
            }
        }
        let whole = |n: u64| -> BTreeMap<i64, (u64, i128)> { [(0, (n, 0))].into() };
        let (chosen, mismatched) = buckets_to_compare(&whole(rows_source), &whole(rows_target), opts.sample_fraction, run);
        // A heap's rows are compared whole every run: with no key, a sample has nothing to cut on.
        if is_heap || !chosen.is_empty() {
            ranges.push((None, KeyRange::all()));
        }
        tier1 = "count";
        n_buckets = 1;
        n_mismatched = mismatched;
    }

    // Tier 2, range by range, in memory bounded by reconcile.bucket_rows
    // (`compare`): only the differences found are kept.
    let cmp = compare::Compare {
        ctx,
        silver: &silver_table,
        columns: &columns,
        key_idx: &key_idx,
        key_names: &key_names,
        heap: is_heap,
        isolation: iso,
        bucket_rows: opts.bucket_rows,
    };
    let mut t2 = compare::Tier2::default();
    // A bar of the ranges compared, on a terminal only (`crate::progress`).
    let bar = crate::progress::Progress::new(&format!("reconcile of {}", ctx.workflow.table_name()), "ranges", Some(ranges.len() as u64));
    for (bucket, range) in &ranges {
        bar.inc(1);
        bar.set_message(format!("· {} rows compared", t2.rows_compared));
        let filter = if bucketed { range_sql(&keys[0].name, range) } else { "TRUE".into() };
        let expected = match bucket {
            Some(b) => bucket_rows_counted.get(b).copied().unwrap_or(0),
            None => rows_source.max(rows_target),
        };
        cmp.range(*bucket, range, &filter, expected, &mut t2).await?;
    }
    let compare::Tier2 { diffs: raw, repeated, rows_compared, passes, rows_held_max, partitions, partitions_mismatched } = t2;
    let mut differences_spilled = raw.spilled() + repeated.spilled();
    bar.finish();
    // After the source reads: the server's clock (every transaction they
    // saw ended at or before it), then what the stream has not read yet and
    // what silver has not applied.
    let reads_ended = ctx.source.server_now().await?;
    let mut source_max = ctx.source.max_lsn().await?;
    let st = state::load(ctx).await?;
    // A heap's rows are told apart by all their values: what is in flight is a row's hash.
    // Before-images are read for keyed tables too: a key respelled in place
    // (`k1` to `K1` under its collation) names its old form only in op 3, and
    // that old form is what silver still holds.
    let (flight_cols, id, filter): (&[ColumnDesc], fn(&[SqlValue]) -> String, RowFilter) =
        if is_heap { (&columns, row_hash, RowFilter::AllUpdateOld) } else { (&keys, key_text, RowFilter::AllUpdateOld) };
    let mut in_flight = bronze_changed_keys(&ctx.bronze, flight_cols, applied, id).await?;
    in_flight.extend(change_table_keys(ctx, &instances, flight_cols, st.position(), source_max, filter, id).await?);
    let facts = state::facts_rows(&ctx.facts, &app).await?;
    let open = open_snapshot(ctx, &facts, &control, if is_heap { &columns } else { &keys }).await?;
    // First pass over what tier 2 found, one chunk held at a time (`found`):
    // the keys changed since silver's applied LSN are IN_FLIGHT, the keys of
    // an open snapshot's unapplied chunks SNAPSHOT_PENDING.
    let mut labelled = found::Found::default();
    let mut differing = 0u64;
    for chunk in raw.into_chunks()? {
        let mut chunk = chunk?;
        label_in_flight(&mut chunk, &in_flight, is_heap);
        mark_pending(ctx, &table, open.as_ref(), &mut chunk).await?;
        differing += chunk.iter().filter(|d| is_difference(d.class)).count() as u64;
        labelled.extend(chunk)?;
    }
    let mut relabel = false;
    if differing > 0 {
        // The capture job runs seconds behind the writers: a transaction the
        // source reads saw may not be in the change table yet, and its keys
        // would differ without being IN_FLIGHT. They count only once the
        // capture job has passed the end of the reads.
        let wait = std::time::Duration::from_secs(opts.capture_wait_seconds);
        match capture_passed(ctx, reads_ended, source_max, wait).await? {
            CapturePassed::Already => {}
            CapturePassed::Now(max) => {
                let from = source_max.or(st.position());
                in_flight.extend(change_table_keys(ctx, &instances, flight_cols, from, Some(max), filter, id).await?);
                source_max = Some(max);
                relabel = true;
                tracing::info!(%max, differing_before = differing,
                               "the capture job has passed the end of the source reads: their keys are checked against its changes");
            }
            CapturePassed::NotYet { newest } => {
                return Err(StepError::Temporary(format!(
                    "{differing} key(s) differ between the source and silver, and after {} s the capture job has not yet recorded the \
                     end of reconcile's source reads (server time {reads_ended}; its newest mapping row is from {}): changes it has \
                     yet to capture may explain them. Nothing was written: call reconcile again. If this goes on, the capture job is \
                     stopped or far behind (see `status` and sys.dm_cdc_errors), or raise reconcile.capture_wait_seconds",
                    opts.capture_wait_seconds,
                    newest.map_or("no time".to_string(), |t| t.to_string()),
                )));
            }
        }
    }
    differences_spilled += labelled.spilled();
    let (chunk_snapshot, chunks_checked, chunk_diffs) = chunk_checks(ctx, &facts).await?;

    // The last pass counts every difference and keeps the first
    // `max_report_rows` for the report: counts never come from what is kept.
    let mut counts: BTreeMap<String, u64> = CLASSES.iter().map(|c| (c.to_string(), 0)).collect();
    let mut diffs: Vec<Difference> = Vec::new();
    let mut tally = |d: Difference| {
        *counts.entry(d.class.to_string()).or_default() += 1;
        if diffs.len() < opts.max_report_rows.max(20) {
            diffs.push(d);
        }
    };
    for chunk in labelled.into_chunks()? {
        let mut chunk = chunk?;
        if relabel {
            label_in_flight(&mut chunk, &in_flight, is_heap);
        }
        chunk.into_iter().for_each(&mut tally);
    }
    for chunk in repeated.into_chunks()? {
        chunk?.into_iter().for_each(&mut tally);
    }
    chunk_diffs.into_iter().for_each(&mut tally);
    let differences = counts.iter().filter(|(c, _)| is_difference(c)).map(|(_, n)| n).sum::<u64>();
    let (open_s, chunks_applied) = open.as_ref().map_or((None, 0), |o| (Some(o.s), o.applied.len()));
    let report_keys: &[ColumnDesc] = if is_heap { &columns } else { &keys };
    let clean = differences == 0;
    let now = Some(Utc::now());
    let header = ReportRow {
        app_id: app.clone(),
        run,
        applied_lsn: applied.map(|l| l.to_hex()),
        source_max_lsn: source_max.map(|l| l.to_hex()),
        checked_at: now,
        ..Default::default()
    };
    let mut rows = vec![ReportRow {
        class: "SUMMARY".into(),
        detail: Some(json!({"counts": counts, "clean": clean, "tier1": tier1, "buckets": n_buckets, "bucket_width": bucket_width, "buckets_mismatched": n_mismatched,
                            "buckets_compared": ranges.len(), "rows_source": rows_source, "rows_target": rows_target, "rows_compared": rows_compared,
                            "passes": passes, "rows_held_max": rows_held_max, "differences_spilled": differences_spilled, "partitions": partitions, "partitions_mismatched": partitions_mismatched,
                            "chunk_snapshot": chunk_snapshot, "chunks_checked": chunks_checked,
                            "open_snapshot": open_s, "open_snapshot_chunks_applied": chunks_applied})),
        ..header.clone()
    }];
    let samples: Vec<Value> = diffs
        .iter()
        .take(20)
        .map(|d| json!({"class": d.class, "key": d.key.as_ref().map(|k| key_json(report_keys, k)), "bucket": d.bucket, "chunk": d.chunk, "detail": d.detail}))
        .collect();
    for d in diffs.iter().take(opts.max_report_rows) {
        rows.push(ReportRow {
            class: d.class.to_string(),
            key: d.key.as_ref().map(|k| key_json(report_keys, k)),
            bucket: d.bucket,
            chunk: d.chunk,
            source_hash: d.source_hash.clone(),
            target_hash: d.target_hash.clone(),
            detail: d.detail.clone(),
            ..header.clone()
        });
    }
    let meta = json!({"reconcile": {"run": run, "clean": clean, "counts": counts, "applied_lsn": applied}, "app_id": app});
    delta::append_batches(&mut report_table, vec![report::to_batch(&rows)], report::schema(), &Txn::new(format!("{app}#reconcile"), run), meta).await?;
    failpoint!("reconcile.after_report");
    if let Some(s) = open_s {
        tracing::info!(%s, chunks_applied, pending = counts.get(SNAPSHOT_PENDING).copied().unwrap_or(0),
                       "a chunked snapshot is open: keys outside the chunks silver has applied are SNAPSHOT_PENDING, not differences");
    }
    tracing::info!(run, clean, differences, ?counts, "reconciled silver with the source");
    Ok(ReconcileResult {
        step: "reconcile",
        run,
        clean,
        differences,
        counts,
        tier1,
        bucket_width,
        buckets: n_buckets,
        buckets_mismatched: n_mismatched,
        buckets_compared: ranges.len(),
        rows_source,
        rows_target,
        rows_compared,
        passes,
        rows_held_max,
        differences_spilled,
        partitions,
        partitions_mismatched,
        applied_lsn: applied,
        source_max_lsn: source_max,
        chunk_snapshot,
        chunks_checked,
        open_snapshot: open_s,
        open_snapshot_chunks_applied: chunks_applied,
        samples,
        report: report_loc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks of one integer key: [lo, hi) each, None open.
    fn int_chunks(bounds: &[(Option<i64>, Option<i64>)]) -> Vec<ChunkPayload> {
        bounds
            .iter()
            .enumerate()
            .map(|(i, (lo, hi))| ChunkPayload {
                chunk: i as i64,
                wave: 0,
                lo: lo.map(|v| vec![SqlValue::Int(v)]),
                hi: hi.map(|v| vec![SqlValue::Int(v)]),
                last: false,
                rows: 0,
                stamp: Lsn::ZERO,
                max_lsn: Lsn::ZERO,
                read_ms: None,
                read_bytes: None,
                rounds: 1,
                bronze_version: None,
                fence: None,
            })
            .collect()
    }

    #[test]
    fn keys_are_placed_in_the_applied_chunks_by_the_order_compare_answers() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let calls = std::cell::Cell::new(0);
        let cmp = |pairs: Vec<(Key, Key)>| {
            calls.set(calls.get() + 1);
            async move { Ok(pairs.iter().map(|(a, b)| crate::types::key_cmp(a, b)).collect()) }
        };
        // Applied: the one open below up to 10, [20, 30), [40, 50), and [60, open above).
        let chunks = int_chunks(&[(None, Some(10)), (Some(20), Some(30)), (Some(40), Some(50)), (Some(60), None)]);
        let probe = [i64::MIN, 9, 10, 19, 20, 29, 30, 45, 50, 59, 60, i64::MAX];
        let keys: Vec<Key> = probe.iter().map(|v| vec![SqlValue::Int(*v)]).chain([vec![SqlValue::Null]]).collect();
        let got = rt.block_on(in_chunks(&chunks, &keys, cmp)).unwrap();
        let want = [true, true, false, false, true, true, false, true, false, false, true, true, true];
        assert_eq!(got, want);
        // A binary search: a few rounds of one batch each, not a call per key.
        assert!(calls.get() <= 4, "{} calls", calls.get());
        // Without the chunk open below, a NULL key is in none; no chunk, no key.
        let tail = int_chunks(&[(Some(20), Some(30))]);
        let got = rt.block_on(in_chunks(&tail, &[vec![SqlValue::Null], vec![SqlValue::Int(25)], vec![SqlValue::Int(30)]], cmp)).unwrap();
        assert_eq!(got, [false, true, false]);
        assert_eq!(rt.block_on(in_chunks(&[], &[vec![SqlValue::Int(1)]], cmp)).unwrap(), [false]);
    }
    use crate::engine::chunked::PlannedChunk;

    fn side(rows: &[(Option<i64>, &str)]) -> Side {
        rows.iter()
            .map(|(k, v)| {
                let key = vec![k.map(SqlValue::Int).unwrap_or(SqlValue::Null)];
                (key_text(&key), (key, row_hash(&[SqlValue::Str(v.to_string())])))
            })
            .collect()
    }

    #[test]
    fn keys_are_classified_and_in_flight_wins() {
        let s = side(&[(Some(1), "a"), (Some(2), "b"), (Some(3), "c"), (None, "n")]);
        let t = side(&[(Some(1), "a"), (Some(2), "B"), (Some(4), "d"), (None, "m")]);
        let none = HashSet::new();
        let d = classify(&s, &t, &none, Some(0));
        let classes: Vec<(&str, String)> = d.iter().map(|d| (d.class, key_text(d.key.as_ref().unwrap()))).collect();
        assert!(classes.contains(&(RECORD_DIFF, "2".into())), "{classes:?}");
        assert!(classes.contains(&(MISSING_TARGET, "3".into())), "{classes:?}");
        assert!(classes.contains(&(MISSING_SOURCE, "4".into())), "{classes:?}");
        assert!(classes.contains(&(RECORD_DIFF, "null".into())), "a NULL key compares null-safely: {classes:?}");
        // Keys with a change silver has not applied are IN_FLIGHT, a NULL key too; the rest stay.
        let flight: HashSet<String> = ["3".to_string(), "null".to_string()].into();
        let d = classify(&s, &t, &flight, Some(0));
        let classes: Vec<(&str, String)> = d.iter().map(|d| (d.class, key_text(d.key.as_ref().unwrap()))).collect();
        assert!(classes.contains(&(IN_FLIGHT, "3".into())) && classes.contains(&(IN_FLIGHT, "null".into())), "{classes:?}");
        assert!(classes.contains(&(RECORD_DIFF, "2".into())), "a real difference beside them stays: {classes:?}");
        assert_eq!(key_json(&[ColumnDesc::new("id", crate::types::SqlType::Int, true)], &[SqlValue::Null]), json!({"id": null}));
    }

    #[test]
    fn a_key_held_twice_is_a_difference_and_never_in_flight() {
        let null = vec![SqlValue::Null];
        let d = repeated_keys(&[], &[(null.clone(), "h".into())], Some(0));
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].class, d[0].key.as_ref()), (MISSING_SOURCE, Some(&null)), "{d:?}");
        let d = repeated_keys(&[(vec![SqlValue::Int(4)], "h".into())], &[], None);
        assert_eq!(d[0].class, MISSING_TARGET);
    }

    #[test]
    fn a_heaps_rows_compare_by_count() {
        let row = |v: i64| vec![SqlValue::Int(v)];
        let counts = |rows: &[(i64, i64)]| -> Counts { rows.iter().map(|(v, n)| (row_hash(&row(*v)), (row(*v), *n))).collect() };
        let s = counts(&[(1, 2), (2, 1), (3, 1)]);
        let t = counts(&[(1, 1), (2, 1), (4, 3)]);
        let d = classify_heap(&s, &t, &HashSet::new());
        let mut got: Vec<(&str, Value)> = d.iter().map(|d| (d.class, d.detail.clone().unwrap())).collect();
        got.sort_by_key(|(c, v)| (c.to_string(), v.to_string()));
        assert_eq!(
            got,
            vec![
                (MISSING_SOURCE, json!({"source_count": 0, "silver_count": 3})),
                (MISSING_TARGET, json!({"source_count": 1, "silver_count": 0})),
                (MISSING_TARGET, json!({"source_count": 2, "silver_count": 1})),
            ]
        );
        let flight: HashSet<String> = [row_hash(&row(1))].into();
        assert!(classify_heap(&s, &t, &flight).iter().any(|d| d.class == IN_FLIGHT && d.key == Some(row(1))));
    }

    #[test]
    fn the_same_row_hashes_the_same_on_both_sides() {
        let ty = crate::types::SqlType::DateTime2 { scale: 7 };
        let t = chrono::NaiveDate::from_ymd_opt(2026, 1, 1).unwrap().and_hms_nano_opt(1, 2, 3, 123_456_789).unwrap();
        let src = as_stored(&SqlValue::DateTime(t), &ty);
        let stored = SqlValue::DateTime(crate::types::truncate_to_micros(t));
        assert_eq!(row_hash(&[SqlValue::Int(1), src]), row_hash(&[SqlValue::Int(1), stored]));
        assert_ne!(row_hash(&[SqlValue::Null]), row_hash(&[SqlValue::Str("null".into())]));
    }

    #[test]
    fn mismatched_buckets_and_a_sample_are_compared() {
        let src: BTreeMap<i64, (u64, i128)> = (0..10).map(|b| (b * 10, (10, 45 + b as i128 * 100))).collect();
        let mut tgt = src.clone();
        tgt.insert(30, (9, 40));
        let (chosen, mismatched) = buckets_to_compare(&src, &tgt, 0.2, 0);
        assert_eq!(mismatched, 1);
        assert!(chosen.contains(&30));
        assert_eq!(chosen.len(), 1 + 2, "{chosen:?}");
        let (chosen, _) = buckets_to_compare(&src, &src, 0.0, 0);
        assert!(chosen.is_empty());
    }

    #[test]
    fn chunk_bounds_changed_after_the_plan_fail_the_tiling() {
        let s = Lsn::from_u128(100);
        let b = |v: i64| Some(vec![SqlValue::Int(v)]);
        let plan = PlanPayload {
            kind: "integer".into(),
            keys: vec!["id".into()],
            chunk_rows: 10,
            chunk_count: 3,
            chunks: vec![
                PlannedChunk { chunk: 0, lo: None, hi: b(10), rows: None },
                PlannedChunk { chunk: 1, lo: b(10), hi: b(20), rows: None },
                PlannedChunk { chunk: 2, lo: b(20), hi: None, rows: None },
            ],
            open_end: false,
            isolation: Default::default(),
        };
        let stamp = Lsn::from_u128(101);
        let chunk = |c: i64, lo, hi, rows| ChunkPayload { chunk: c, wave: 0, lo, hi, last: c == 2, rows, stamp, max_lsn: stamp, read_ms: None, read_bytes: None, rounds: 1, bronze_version: None, fence: None };
        let good = vec![chunk(0, None, b(10), 5), chunk(1, b(10), b(20), 4), chunk(2, b(20), None, 0)];
        let bronze: BTreeMap<i64, (i64, String, String)> = [(0, (5, stamp.to_hex(), stamp.to_hex())), (1, (4, stamp.to_hex(), stamp.to_hex()))].into();
        assert!(check_chunks(s, &plan, &good, &bronze, true).is_empty());
        let mut moved = good.clone();
        moved[1].lo = b(12);
        let d = check_chunks(s, &plan, &moved, &bronze, true);
        assert!(d.iter().all(|d| d.class == CHUNK_TILING) && d.len() == 2, "{d:?}");
        let mut fewer = bronze.clone();
        fewer.insert(1, (3, stamp.to_hex(), Lsn::from_u128(102).to_hex()));
        let d = check_chunks(s, &plan, &good, &fewer, true);
        let classes: Vec<&str> = d.iter().map(|d| d.class).collect();
        assert_eq!(classes, vec![CHUNK_ROWS, CHUNK_STAMP]);
        let mut early = good.clone();
        early[0].stamp = Lsn::from_u128(99);
        assert!(check_chunks(s, &plan, &early, &bronze, true).iter().any(|d| d.class == CHUNK_STAMP));
        // A completed snapshot that never recorded chunk 1 has a hole; an open one is only not done yet.
        let holed = vec![good[0].clone(), good[2].clone()];
        let d = check_chunks(s, &plan, &holed, &bronze, true);
        assert!(d.iter().any(|d| d.class == CHUNK_TILING && d.chunk == Some(1)), "{d:?}");
        let open: Vec<_> = check_chunks(s, &plan, &holed, &bronze, false).into_iter().filter(|d| d.class == CHUNK_TILING).collect();
        assert!(open.is_empty(), "{open:?}");
    }
}
