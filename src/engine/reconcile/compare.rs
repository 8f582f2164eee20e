//! Tier 2 in memory bounded by `reconcile.bucket_rows`, for every key kind.
//!
//! A range tier 1 sends here (an integer or date bucket, or the whole table
//! for any other key and for a heap) is compared in one of two ways:
//!
//! - **One pass**, when tier 1 says it holds at most `bucket_rows` rows on
//!   either side: both sides are read into memory and classified, as the
//!   original tier 2 did.
//! - **Hash partitions**, when it holds more. A first pass streams both sides
//!   and keeps, per hash partition, only a row count and a checksum of the
//!   rows' hashes: the partition of a keyed row is a hash of its key, so a
//!   key's rows on both sides (a key held twice too) land in one partition;
//!   a heap's row is placed by its row hash, so equal rows meet. Partitions
//!   whose count or checksum differ are then read again, as many at a time
//!   as fit in `bucket_rows`, and only their rows are held and classified.
//!   Partitions hold about 64 rows (at most 2^20 of them), so differences
//!   spread over a large table touch few rows beside themselves.
//!   The checksum covers every column, so a partition that matches holds no
//!   difference (up to a 64-bit collision), and no sample is needed.
//!
//! Why hash partitions and not key ranges: a string key's order is its
//! collation's, which only the server knows (`CdcSource::compare_keys`), and
//! silver holds no collation. A partition by a hash of the key's canonical
//! text needs no order at all, is computed the same way on both sides by
//! one function, and costs the engine a SHA-256 per row, which the row hash
//! already costs. The price is that each further pass reads the range again
//! (the server evaluates the range; the engine drops the rows of other
//! partitions): a clean range is read once, one with differences twice, and
//! a range with differences spread over more than `bucket_rows` rows once
//! more per `bucket_rows` of them.
//!
//! Classes come out raw (MISSING_TARGET, MISSING_SOURCE, RECORD_DIFF, and
//! the repeated keys apart): IN_FLIGHT needs the change table read after
//! every source read, so the caller labels them once all reads are done.

use std::collections::HashSet;

use deltalake::arrow::array::{Array, Int64Array};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::DeltaTable;
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::found::Found;
use super::rows::{self, classify, classify_heap, repeated_keys, row_hash, Counts, Side};
use crate::delta;
use crate::engine::apply::ident;
use crate::engine::rebuild::key_text;
use crate::engine::Context;
use crate::error::{StepError, StepResult};
use crate::source::{Isolation, KeyRange, SnapshotRead};
use crate::types::{as_stored, value_at, ColumnDesc, Key, SqlValue};

/// What tier 2 compares with, for one run.
pub(super) struct Compare<'a> {
    pub ctx: &'a Context,
    pub silver: &'a DeltaTable,
    /// The capture instance's columns, in capture order.
    pub columns: &'a [ColumnDesc],
    /// The key's places in `columns`; empty for a heap.
    pub key_idx: &'a [usize],
    pub key_names: &'a [String],
    pub heap: bool,
    pub isolation: Isolation,
    /// The most rows of one side held at once (a partition larger than this
    /// is still held whole: a key's rows cannot be split).
    pub bucket_rows: u64,
}

/// What tier 2 found and what it cost, over every range.
#[derive(Debug, Default)]
pub(super) struct Tier2 {
    /// Differences with their raw class (no IN_FLIGHT yet), in bounded
    /// memory (`found`).
    pub diffs: Found,
    /// Keys met twice on one side: never IN_FLIGHT.
    pub repeated: Found,
    /// Rows compared row by row: per pass, the larger side's rows held.
    pub rows_compared: u64,
    /// Passes that held rows.
    pub passes: u64,
    /// The most rows held at once, both sides together.
    pub rows_held_max: u64,
    /// Hash partitions summarised (non-empty ones), and those that differed.
    pub partitions: u64,
    pub partitions_mismatched: u64,
}

/// A row's hash as a 64-bit word: its first 16 hex digits.
fn word(hex: &str, at: usize) -> u64 {
    u64::from_str_radix(&hex[at..at + 16], 16).unwrap_or(0)
}

/// The 64-bit hash a keyed row is partitioned by: SHA-256 of its key's text.
fn key_word(key_text: &str) -> u64 {
    let d = Sha256::digest(key_text.as_bytes());
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

/// How many hash partitions a range of `rows` rows is cut into: a power of
/// two, about 64 rows each, at most 2^20 (32 MB of summaries for both
/// sides). Small partitions keep the rows read again small: differences
/// spread over the table touch as many partitions as there are differences,
/// and a pass re-reads the range for every `bucket_rows` rows they hold.
pub(super) fn partition_count(rows: u64) -> u64 {
    rows.div_ceil(ROWS_PER_PARTITION).max(2).next_power_of_two().min(1 << 20)
}

/// The rows a hash partition holds, about.
const ROWS_PER_PARTITION: u64 = 64;

/// Groups the mismatched partitions (with their larger side's rows) into
/// passes of at most `bucket_rows` rows each; a partition larger than that
/// is a pass of its own (pure).
pub(super) fn passes(mismatched: &[(u64, u64)], bucket_rows: u64) -> Vec<Vec<u64>> {
    let mut out: Vec<Vec<u64>> = Vec::new();
    let mut held = 0u64;
    for &(p, rows) in mismatched {
        match out.last_mut() {
            Some(last) if held + rows <= bucket_rows => {
                last.push(p);
                held += rows;
            }
            _ => {
                out.push(vec![p]);
                held = rows;
            }
        }
    }
    out
}

/// One row read, with what places it.
struct Row {
    values: Key,
    /// key text (keyed) or row hash (heap): what identifies it.
    id: String,
    hash: String,
    /// How many rows it stands for (a heap's silver `_count`; 1 otherwise).
    n: i64,
}

/// The values of every row of `batch` in `columns`' order, found by name (a
/// column silver does not hold reads as NULL); `stored` passes the source's
/// values through `as_stored`, so both sides hold what Delta holds.
fn batch_values(batch: &RecordBatch, columns: &[ColumnDesc], stored: bool) -> Vec<Key> {
    let arrays: Vec<Option<&dyn Array>> = columns
        .iter()
        .map(|c| batch.schema().fields().iter().position(|f| f.name().eq_ignore_ascii_case(&c.name)).map(|i| batch.column(i).as_ref()))
        .collect();
    (0..batch.num_rows())
        .map(|r| {
            columns
                .iter()
                .zip(&arrays)
                .map(|(c, a)| match a {
                    Some(a) => {
                        let v = value_at(*a, r, &c.sql_type);
                        if stored {
                            as_stored(&v, &c.sql_type)
                        } else {
                            v
                        }
                    }
                    None => SqlValue::Null,
                })
                .collect()
        })
        .collect()
}

/// The rows one pass holds of one side.
enum Held {
    Keyed { side: Side, repeated: Vec<(Key, String)>, rows: u64 },
    Heap { counts: Counts, rows: u64 },
}

impl Held {
    fn new(heap: bool) -> Held {
        if heap {
            Held::Heap { counts: Counts::new(), rows: 0 }
        } else {
            Held::Keyed { side: Side::new(), repeated: Vec::new(), rows: 0 }
        }
    }

    fn add(&mut self, r: Row, key_idx: &[usize]) {
        match self {
            Held::Keyed { side, repeated, rows } => {
                *rows += 1;
                let key: Key = key_idx.iter().map(|&i| r.values[i].clone()).collect();
                match side.entry(r.id) {
                    std::collections::hash_map::Entry::Occupied(_) => repeated.push((key, r.hash)),
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert((key, r.hash));
                    }
                }
            }
            Held::Heap { counts, rows } => {
                *rows += r.n.max(0) as u64;
                counts.entry(r.hash).or_insert_with(|| (r.values, 0)).1 += r.n;
            }
        }
    }

    fn rows(&self) -> u64 {
        match self {
            Held::Keyed { rows, .. } | Held::Heap { rows, .. } => *rows,
        }
    }
}

/// A row with what identifies it: a keyed row by its key's text, a heap's
/// by its row hash.
fn make_row(values: Key, key_idx: &[usize], heap: bool, n: i64) -> Row {
    let hash = row_hash(&values);
    let id = if heap {
        hash.clone()
    } else {
        let key: Key = key_idx.iter().map(|&i| values[i].clone()).collect();
        key_text(&key)
    };
    Row { values, id, hash, n }
}

impl Compare<'_> {
    fn row(&self, values: Key, n: i64) -> Row {
        make_row(values, self.key_idx, self.heap, n)
    }

    /// The partition of a row among `count`.
    fn partition(&self, r: &Row, count: u64) -> u64 {
        let w = if self.heap { word(&r.id, 0) } else { key_word(&r.id) };
        w % count
    }

    /// The word a row adds to its partition's checksum: bits of its row
    /// hash the partition was not chosen by.
    fn checksum_word(&self, r: &Row) -> u64 {
        word(&r.hash, if self.heap { 16 } else { 0 })
    }

    /// Reads the source's rows in `range`, each to `each`.
    async fn read_source(&self, range: &KeyRange, mut each: impl FnMut(Row)) -> StepResult<()> {
        let read = SnapshotRead {
            table: self.ctx.workflow.table_name(),
            columns: self.columns.to_vec(),
            keys: if self.heap { vec![] } else { self.key_names.to_vec() },
            range: range.clone(),
            isolation: self.isolation,
            batch_rows: self.ctx.workflow.snapshot.batch_rows,
        };
        let mut stream = self.ctx.source.snapshot_read(&read).await?;
        while let Some(b) = stream.next().await {
            for values in batch_values(&b?, self.columns, true) {
                each(self.row(values, 1));
            }
        }
        Ok(())
    }

    /// Reads silver's rows under `filter` (a SQL predicate), each to `each`;
    /// a heap's row with its `_count`.
    async fn read_silver(&self, filter: &str, mut each: impl FnMut(Row)) -> StepResult<()> {
        let mut cols = rows::columns_silver_holds(self.silver, self.columns)?;
        if self.heap {
            cols = self.columns.iter().map(|c| ident(&c.name)).collect();
            cols.push(ident(crate::delta::silver::COUNT));
        }
        let sql = format!("SELECT {} FROM t WHERE {filter}", cols.join(", "));
        let mut stream = delta::query_stream(self.silver, &sql).await?;
        while let Some(b) = stream.next().await {
            let b = delta::plain_types(&b.map_err(|e| StepError::Temporary(format!("reading silver: {e}")))?)?;
            let counts: Option<&Int64Array> = if self.heap { Some(rows::i64_col(&b, self.columns.len())?) } else { None };
            for (r, values) in batch_values(&b, self.columns, false).into_iter().enumerate() {
                let n = counts.map_or(1, |c| if c.is_null(r) { 0 } else { c.value(r) });
                each(self.row(values, n));
            }
        }
        Ok(())
    }

    /// Compares one range: `silver_filter` is its predicate over silver and
    /// `expected_rows` the larger side's rows tier 1 counted in it.
    pub(super) async fn range(&self, bucket: Option<i64>, range: &KeyRange, silver_filter: &str, expected_rows: u64, out: &mut Tier2) -> StepResult<()> {
        if expected_rows <= self.bucket_rows {
            return self.pass(bucket, range, silver_filter, None, out).await;
        }
        let count = partition_count(expected_rows);
        // Per partition: (rows, wrapping sum of the rows' checksum words).
        let mut source: Vec<(u64, u64)> = vec![(0, 0); count as usize];
        let mut target: Vec<(u64, u64)> = vec![(0, 0); count as usize];
        self.read_source(range, |r| {
            let e = &mut source[self.partition(&r, count) as usize];
            e.0 += 1;
            e.1 = e.1.wrapping_add(self.checksum_word(&r));
        })
        .await?;
        self.read_silver(silver_filter, |r| {
            let n = r.n.max(0) as u64;
            let e = &mut target[self.partition(&r, count) as usize];
            e.0 += n;
            e.1 = e.1.wrapping_add(self.checksum_word(&r).wrapping_mul(n));
        })
        .await?;
        let non_empty = source.iter().zip(&target).filter(|(s, t)| s.0 > 0 || t.0 > 0).count();
        let mismatched: Vec<(u64, u64)> =
            source.iter().zip(&target).enumerate().filter(|(_, (s, t))| s != t).map(|(p, (s, t))| (p as u64, s.0.max(t.0))).collect();
        out.partitions += non_empty as u64;
        out.partitions_mismatched += mismatched.len() as u64;
        tracing::debug!(?bucket, partitions = count, non_empty, mismatched = mismatched.len(), "hash partitions of a tier 2 range");
        for group in passes(&mismatched, self.bucket_rows) {
            let set: HashSet<u64> = group.into_iter().collect();
            self.pass(bucket, range, silver_filter, Some((count, &set)), out).await?;
        }
        Ok(())
    }

    /// One pass: the rows of `range` (of the partitions in `only`, when
    /// given) on both sides, held and classified.
    async fn pass(&self, bucket: Option<i64>, range: &KeyRange, silver_filter: &str, only: Option<(u64, &HashSet<u64>)>, out: &mut Tier2) -> StepResult<()> {
        let keep = |r: &Row| only.is_none_or(|(count, set)| set.contains(&self.partition(r, count)));
        let mut source = Held::new(self.heap);
        self.read_source(range, |r| {
            if keep(&r) {
                source.add(r, self.key_idx)
            }
        })
        .await?;
        let mut target = Held::new(self.heap);
        self.read_silver(silver_filter, |r| {
            if keep(&r) {
                target.add(r, self.key_idx)
            }
        })
        .await?;
        out.passes += 1;
        out.rows_compared += source.rows().max(target.rows());
        out.rows_held_max = out.rows_held_max.max(source.rows() + target.rows());
        let none = HashSet::new();
        match (source, target) {
            (Held::Keyed { side: s, repeated: rs, .. }, Held::Keyed { side: t, repeated: rt, .. }) => {
                out.diffs.extend(classify(&s, &t, &none, bucket))?;
                out.repeated.extend(repeated_keys(&rs, &rt, bucket))?;
            }
            (Held::Heap { counts: s, .. }, Held::Heap { counts: t, .. }) => out.diffs.extend(classify_heap(&s, &t, &none))?,
            _ => unreachable!("both sides are held alike"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key met twice on one side: the first copy is held, the second
    /// handed over as repeated (a map would keep one and hide the other);
    /// a NULL key is a value of its own, twice here.
    #[test]
    fn a_side_keeps_the_first_copy_of_a_key_and_hands_over_the_second() {
        let b = RecordBatch::try_from_iter(vec![(
            "k",
            std::sync::Arc::new(deltalake::arrow::array::Int32Array::from(vec![None, Some(1), None])) as deltalake::arrow::array::ArrayRef,
        )])
        .unwrap();
        let columns = [ColumnDesc::new("k", crate::types::SqlType::Int, true)];
        let mut held = Held::new(false);
        for values in batch_values(&b, &columns, false) {
            held.add(make_row(values, &[0], false, 1), &[0]);
        }
        let Held::Keyed { side, repeated, rows } = held else { panic!("keyed") };
        assert_eq!((side.len(), repeated.len(), rows), (2, 1, 3));
        assert_eq!(repeated[0].0, vec![SqlValue::Null]);
    }

    /// A heap's silver row stands for `_count` rows: held with its count.
    #[test]
    fn a_heaps_rows_are_held_with_their_counts() {
        let mut held = Held::new(true);
        held.add(make_row(vec![SqlValue::Int(7)], &[], true, 3), &[]);
        held.add(make_row(vec![SqlValue::Int(7)], &[], true, 1), &[]);
        let Held::Heap { counts, rows } = held else { panic!("heap") };
        assert_eq!((counts.len(), rows, counts.values().next().unwrap().1), (1, 4, 4));
    }

    #[test]
    fn partitions_are_a_power_of_two_of_about_64_rows() {
        assert_eq!(partition_count(6_400), 128);
        assert_eq!(partition_count(6_401), 128);
        assert_eq!(partition_count(600), 16);
        assert_eq!(partition_count(1_000_000_000), 1 << 20);
        assert_eq!(partition_count(0), 2);
    }

    #[test]
    fn passes_hold_at_most_bucket_rows_unless_one_partition_is_larger() {
        let m = [(1, 40), (3, 50), (4, 20), (9, 200), (11, 5), (12, 100)];
        assert_eq!(passes(&m, 100), vec![vec![1, 3], vec![4], vec![9], vec![11], vec![12]]);
        assert_eq!(passes(&m, 1_000), vec![vec![1, 3, 4, 9, 11, 12]]);
        assert!(passes(&[], 10).is_empty());
        for group in passes(&m, 100) {
            let held: u64 = group.iter().map(|p| m.iter().find(|(q, _)| q == p).unwrap().1).sum();
            assert!(held <= 100 || group.len() == 1, "{group:?} holds {held}");
        }
    }
}
