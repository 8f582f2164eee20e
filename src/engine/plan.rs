//! Chunk plans of chunked snapshots (adr-0028's Amendment), as pure functions.
//!
//! One integer key is planned from row counts per slice of a grid: slices
//! holding more than `chunk_rows` are probed for the values they really hold
//! (MIN and MAX, one statement) and counted again on a finer grid over that
//! extent (down to one value), then consecutive non-empty slices are packed,
//! in key order, into chunks of at most `chunk_rows` rows. Sizes follow the counts, not the
//! key's spread: a dense cluster is split, a sparse region or a far sentinel
//! joins its neighbours, and no chunk starts on an empty slice.
//!
//! NULL keys are counted too, once, as the first thing packed: the first
//! chunk is the range open below, which is where the range predicates put
//! NULL keys, so a plan that left them out would promise that chunk fewer
//! rows than it reads (a heap with many NULLs read 1,081 rows in a chunk
//! planned for 280). Packed like a value of their own, NULLs never split,
//! and when they fill a chunk the first chunk holds them alone.
//!
//! Any other key (composite, string, date and time, uniqueidentifier, or a
//! column that is not unique) gets keyset bounds: the key `chunk_rows` rows
//! after the previous bound, sought up front below the MAX recorded at the
//! open. A bound that would repeat its lower bound (a value held by more rows
//! than a chunk, or equal only under the collation) is sought again twice as
//! far, so a value is never split and the walk always moves.
//!
//! Whether a bound repeats, or lies past MAX, is a question of order. For a
//! key with a string column that order is the column's collation (linguistic
//! order, case, accents, width, padding), which only the server knows: the
//! planner asks it ([`KeySeeker::compare`]) instead of comparing strings
//! itself. Deciding in Rust once ended the last chunk of a heap at a value the
//! server held equal to MAX (`ｚ` against `z` under a width-insensitive
//! collation), and every row equal to MAX was left out of the snapshot.
//!
//! Both planners talk to the source through the small [`KeyCounter`] and
//! [`KeySeeker`] traits, so the tests here run them against in-memory tables.

use std::cmp::Ordering;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::source::{KeyRange, SourceError};
use crate::types::{key_cmp, truncate_to_micros, Key, SqlType, SqlValue};

/// Most slices one counting query groups by.
pub const MAX_SLICES_PER_QUERY: u64 = 100_000;
/// Slices per chunk on the first grid (a slice is about 1/16 of a chunk on an even key).
pub const SLICES_PER_CHUNK: u64 = 16;

/// A counted slice of an integer key: the values `[start, start + width)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub start: i64,
    /// Values in the slice (at least 1); i128 so a slice may end past i64::MAX.
    pub width: i128,
    pub rows: u64,
}

impl Slice {
    /// The first value after the slice.
    pub fn end(&self) -> i128 {
        self.start as i128 + self.width
    }
}

/// A planned chunk of an integer key: `[lo, hi)`; `lo = None` is open below
/// (it also takes NULL keys), `hi = None` is open above (the bound would be
/// past BIGINT's range).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntChunk {
    pub lo: Option<i64>,
    pub hi: Option<i64>,
    /// Rows counted when planned.
    pub rows: u64,
}

/// The slices that must be counted again on a finer grid: more rows than a
/// chunk holds, and more than one value wide. [`plan_integer`] probes each
/// one's real MIN and MAX first ([`KeyCounter::extent`]) and grids over them.
pub fn slices_to_refine(slices: &[Slice], chunk_rows: u64) -> Vec<Slice> {
    slices.iter().filter(|s| s.rows > chunk_rows && s.width > 1).copied().collect()
}

/// Packs the NULL keys' rows, then the non-empty slices (sorted by start,
/// not overlapping), into chunks of at most `chunk_rows` rows; the NULLs, or
/// a single-value slice, holding more are a chunk of their own. The first
/// chunk is open below (it reads the NULLs); the last ends at `max + 1`
/// (open when that is past BIGINT). Nothing to pack (an empty table) plans
/// one open chunk.
pub fn pack_slices(null_rows: u64, slices: &[Slice], chunk_rows: u64, max: i64) -> Vec<IntChunk> {
    let chunk_rows = chunk_rows.max(1);
    // (chunk start, rows); the NULLs' start is below every value.
    let mut starts: Vec<(Option<i64>, u64)> = Vec::new();
    if null_rows > 0 {
        starts.push((None, null_rows));
    }
    for s in slices.iter().filter(|s| s.rows > 0) {
        match starts.last_mut() {
            Some((_, rows)) if *rows + s.rows <= chunk_rows => *rows += s.rows,
            _ => starts.push((Some(s.start), s.rows)),
        }
    }
    if starts.is_empty() {
        return vec![IntChunk { lo: None, hi: None, rows: 0 }];
    }
    let last_hi = i64::try_from(max as i128 + 1).ok();
    let n = starts.len();
    (0..n)
        .map(|i| IntChunk {
            lo: if i == 0 { None } else { starts[i].0 },
            hi: if i + 1 < n { starts[i + 1].0 } else { last_hi },
            rows: starts[i].1,
        })
        .collect()
}

/// The chunk that holds a value (None: NULL), by the chunks' predicates.
pub fn chunk_of(chunks: &[IntChunk], value: Option<i64>) -> Vec<usize> {
    chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| match value {
            None => c.lo.is_none(),
            Some(v) => c.lo.is_none_or(|lo| v >= lo) && c.hi.is_none_or(|hi| v < hi),
        })
        .map(|(i, _)| i)
        .collect()
}

/// Counts rows per slice of a grid (the source's `slice_counts`).
#[async_trait]
pub trait KeyCounter: Send + Sync {
    /// (slice start, rows) of the non-empty slices of width `width` from `lo`, for values in `[lo, hi]`.
    async fn count(&self, lo: i64, hi: i64, width: i64) -> Result<Vec<(i64, u64)>, SourceError>;

    /// Rows whose key is NULL (the source's `null_count`).
    async fn null_rows(&self) -> Result<u64, SourceError>;

    /// The smallest and largest value held in `[lo, hi]` (inclusive), or None
    /// when no row's value is in it (the source's `slice_extent`: one
    /// `MIN`/`MAX` statement).
    async fn extent(&self, lo: i64, hi: i64) -> Result<Option<(i64, i64)>, SourceError>;
}

/// Seeks keys (the source's `key_seek`).
#[async_trait]
pub trait KeySeeker: Send + Sync {
    /// The key of the `(n + 1)`-th row of `range` in key order, or None.
    async fn seek(&self, range: &KeyRange, n: u64) -> Result<Option<Key>, SourceError>;

    /// How `a` compares with `b` in the server's key order (the source's
    /// `compare_keys`): the only order the planner uses for keys with a
    /// string column.
    async fn compare(&self, a: &Key, b: &Key) -> Result<Ordering, SourceError>;
}

/// `a` against `b` in the key's order: computed here when no key column is a
/// string (integers, decimals, dates and times, uniqueidentifier and binary
/// order by value, [`key_cmp`]), asked of the server when one is.
async fn key_order(seeker: &dyn KeySeeker, shape: &KeysetShape, a: &Key, b: &Key) -> Result<Ordering, SourceError> {
    if shape.types.iter().any(SqlType::is_string) {
        seeker.compare(a, b).await
    } else {
        Ok(key_cmp(a, b))
    }
}

fn ceil_div(a: u128, b: u128) -> u128 {
    a.div_ceil(b.max(1))
}

/// Plans one integer key over `[min, max]` from per-slice counts: a first grid
/// of about 16 slices per chunk (sized from `row_estimate`), every slice
/// holding more than `chunk_rows` counted again on a finer grid over its own
/// values, down to one value, then packed after the NULL keys' rows.
///
/// adr-0028: the finer grid spans the slice's actual MIN..MAX, probed from
/// the source ([`KeyCounter::extent`]) before it is counted again, not the
/// slice's grid bounds. A sparse slice (a narrow cluster inside a slice of a
/// grid stretched by a far sentinel) is then split in one recount instead of
/// one recount per factor of 16 or more that the slice is wider than it; a slice
/// whose MIN is its MAX holds one value and is not counted again. The slices
/// still tile the key: a probed slice holds no value between its grid start
/// and its MIN, nor between its MAX and its grid end, so moving its first
/// sub-slice's start up to MIN changes no chunk's rows.
pub async fn plan_integer(counter: &dyn KeyCounter, min: i64, max: i64, chunk_rows: u64, row_estimate: u64) -> Result<Vec<IntChunk>, SourceError> {
    let chunk_rows = chunk_rows.max(1);
    let span = (max as i128 - min as i128 + 1) as u128;
    let wanted = (SLICES_PER_CHUNK as u128 * ceil_div(row_estimate.max(1) as u128, chunk_rows as u128)).clamp(SLICES_PER_CHUNK as u128, MAX_SLICES_PER_QUERY as u128);
    let width = ceil_div(span, wanted).max(1);
    let mut done: Vec<Slice> = Vec::new();
    // (lo, hi, width) grids still to count.
    let mut todo: Vec<(i64, i64, u128)> = vec![(min, max, width)];
    while let Some((lo, hi, width)) = todo.pop() {
        let w = i64::try_from(width).unwrap_or(i64::MAX);
        for (start, rows) in counter.count(lo, hi, w).await? {
            let slice = Slice { start, width: width as i128, rows };
            if rows > chunk_rows && width > 1 {
                let end = (start as i128 + width as i128 - 1).min(hi as i128) as i64;
                match counter.extent(start, end).await? {
                    // Emptied since it was counted (a writer under READ COMMITTED): nothing there to plan.
                    None => {}
                    // One value: a chunk of its own, however many rows hold it.
                    Some((first, last)) if first >= last => done.push(Slice { start: first, width: 1, rows }),
                    Some((first, last)) => {
                        let sub_span = (last as i128 - first as i128 + 1) as u128;
                        let sub_slices = (SLICES_PER_CHUNK as u128 * ceil_div(rows as u128, chunk_rows as u128)).clamp(2, MAX_SLICES_PER_QUERY as u128);
                        todo.push((first, last, ceil_div(sub_span, sub_slices).max(1)));
                    }
                }
            } else if rows > 0 {
                done.push(slice);
            }
        }
    }
    done.sort_by_key(|s| s.start);
    let null_rows = counter.null_rows().await?;
    Ok(pack_slices(null_rows, &done, chunk_rows, max))
}

/// What a keyset plan's key columns are, for the rules that depend on type.
#[derive(Debug, Clone)]
pub struct KeysetShape {
    pub types: Vec<SqlType>,
    /// The columns are the capture instance's unique index: no value repeats,
    /// so a bound needs no check that its chunk is non-empty.
    pub unique: bool,
}

/// A bound as the drivers return it: a datetime2/datetimeoffset key column
/// with 100 ns digits truncated to the microsecond (adr-0028's Amendment), so
/// bounds sit where a microsecond engine puts them too.
pub fn truncate_bound(key: Key, shape: &KeysetShape) -> Key {
    key.into_iter()
        .zip(shape.types.iter())
        .map(|(v, t)| match (v, t) {
            (SqlValue::DateTime(d), SqlType::DateTime2 { .. }) => SqlValue::DateTime(truncate_to_micros(d)),
            (SqlValue::DateTimeOffset(d), SqlType::DateTimeOffset { .. }) => {
                let nanos = d.timestamp_subsec_nanos();
                SqlValue::DateTimeOffset(d - chrono::Duration::nanoseconds((nanos % 1000) as i64))
            }
            (v, _) => v,
        })
        .collect()
}

/// Seeks the next bound after `lo`: the key `chunk_rows` rows on, doubled
/// while it would not move past `lo` (a NULL key, a value equal to `lo` under
/// the collation, or, when the columns are not unique, a range `[lo, bound)`
/// the server finds empty). None when fewer rows remain.
pub async fn next_bound(seeker: &dyn KeySeeker, lo: Option<&Key>, chunk_rows: u64, shape: &KeysetShape) -> Result<Option<Key>, SourceError> {
    let mut n = chunk_rows.max(1);
    loop {
        let range = KeyRange { lo: lo.cloned(), hi: None };
        let Some(b) = seeker.seek(&range, n).await? else { return Ok(None) };
        let b = truncate_bound(b, shape);
        let repeats = b.iter().any(SqlValue::is_null)
            || match lo {
                Some(lo) => key_order(seeker, shape, &b, lo).await? != Ordering::Greater,
                None => false,
            };
        let empty = !repeats && !shape.unique && {
            let below = KeyRange { lo: lo.cloned(), hi: Some(b.clone()) };
            seeker.seek(&below, 0).await?.is_none()
        };
        if !repeats && !empty {
            return Ok(Some(b));
        }
        n = n.saturating_mul(2);
    }
}

/// The first key after `max` (past MAX's own copies), or None when there is
/// none or it reads back at or below MAX: then the last chunk stays open.
///
/// Rows from MAX on are MAX's copies, then the keys after it: the seek goes
/// 0, 1, 2, 4... rows in until it leaves MAX's copies, then bisects back to
/// the first row that does, so a doubling that overshoots the end of the
/// table does not miss the keys just after MAX.
pub async fn last_bound(seeker: &dyn KeySeeker, max: &Key, shape: &KeysetShape) -> Result<Option<Key>, SourceError> {
    enum Found {
        Repeat,
        End,
        After(Key),
    }
    let range = KeyRange { lo: Some(max.clone()), hi: None };
    let probe = |n: u64| {
        let range = &range;
        async move {
            Ok::<_, SourceError>(match seeker.seek(range, n).await? {
                None => Found::End,
                Some(b) => {
                    let b = truncate_bound(b, shape);
                    if !b.iter().any(SqlValue::is_null) && key_order(seeker, shape, &b, max).await? == Ordering::Greater {
                        Found::After(b)
                    } else {
                        Found::Repeat
                    }
                }
            })
        }
    };
    let mut repeat_at: Option<u64> = None;
    let mut n = 0u64;
    let mut found = loop {
        match probe(n).await? {
            Found::Repeat => {
                if shape.unique && n >= 1 {
                    // A unique key after MAX truncated to MAX's microsecond: adr-0028 leaves the last chunk open.
                    return Ok(None);
                }
                repeat_at = Some(n);
                n = if n == 0 { 1 } else { n.saturating_mul(2) };
            }
            other => break other,
        }
    };
    if let Some(mut lo) = repeat_at {
        let mut hi = n;
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match probe(mid).await? {
                Found::Repeat => lo = mid,
                other => {
                    hi = mid;
                    found = other;
                }
            }
        }
    }
    Ok(match found {
        Found::After(b) => Some(b),
        _ => None,
    })
}

/// Walks keyset bounds from the start of the key up to `max`: the bounds
/// between chunks, in order (the chunks are `(-inf, b1), [b1, b2), ...,
/// [bk, end)`, the end sought by [`last_bound`]).
pub async fn plan_keyset(seeker: &dyn KeySeeker, max: &Key, chunk_rows: u64, shape: &KeysetShape) -> Result<Vec<Key>, SourceError> {
    let mut bounds: Vec<Key> = Vec::new();
    loop {
        let Some(b) = next_bound(seeker, bounds.last(), chunk_rows, shape).await? else { break };
        if key_order(seeker, shape, &b, max).await? == Ordering::Greater {
            break;
        }
        bounds.push(b);
    }
    Ok(bounds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// An in-memory integer column: value -> rows (and no NULL keys).
    struct Counts(BTreeMap<i64, u64>);

    #[async_trait]
    impl KeyCounter for Counts {
        async fn null_rows(&self) -> Result<u64, SourceError> {
            Ok(0)
        }

        async fn extent(&self, lo: i64, hi: i64) -> Result<Option<(i64, i64)>, SourceError> {
            let mut held = self.0.range(lo..=hi).filter(|(_, n)| **n > 0).map(|(v, _)| *v);
            let first = held.next();
            let last = held.last().or(first);
            Ok(first.zip(last))
        }

        async fn count(&self, lo: i64, hi: i64, width: i64) -> Result<Vec<(i64, u64)>, SourceError> {
            let mut out: BTreeMap<i64, u64> = BTreeMap::new();
            for (v, n) in self.0.range(lo..=hi) {
                let start = (lo as i128 + (*v as i128 - lo as i128) / width as i128 * width as i128) as i64;
                *out.entry(start).or_default() += n;
            }
            Ok(out.into_iter().collect())
        }
    }

    /// An in-memory table's key column(s), sorted as SQL Server sorts them.
    struct Keys(Vec<Key>);

    impl Keys {
        fn new(mut keys: Vec<Key>) -> Keys {
            keys.sort_by(|a, b| key_cmp(a, b));
            Keys(keys)
        }
    }

    #[async_trait]
    impl KeySeeker for Keys {
        async fn seek(&self, range: &KeyRange, n: u64) -> Result<Option<Key>, SourceError> {
            Ok(self.0.iter().filter(|k| range.contains(k)).nth(n as usize).cloned())
        }

        async fn compare(&self, a: &Key, b: &Key) -> Result<Ordering, SourceError> {
            Ok(key_cmp(a, b))
        }
    }

    fn block<F: std::future::Future>(f: F) -> F::Output {
        futures::executor::block_on(f)
    }

    /// The chunks of a keyset plan, as key ranges.
    fn keyset_ranges(bounds: &[Key], end: Option<Key>) -> Vec<KeyRange> {
        let mut out = Vec::new();
        let mut lo = None;
        for b in bounds {
            out.push(KeyRange { lo: lo.clone(), hi: Some(b.clone()) });
            lo = Some(b.clone());
        }
        out.push(KeyRange { lo, hi: end });
        out
    }

    #[test]
    fn integer_plan_counts_a_skewed_key_with_a_sentinel_at_bigint_max() {
        let mut v = BTreeMap::new();
        for k in 1..=2000 {
            v.insert(k, 1);
        }
        for k in 1_000_000..1_000_050 {
            v.insert(k, 40); // a dense cluster
        }
        v.insert(i64::MAX, 1);
        let total: u64 = v.values().sum();
        let chunks = block(plan_integer(&Counts(v.clone()), 1, i64::MAX, 100, total)).unwrap();
        assert_eq!(chunks.iter().map(|c| c.rows).sum::<u64>(), total);
        assert!(chunks.iter().all(|c| c.rows <= 100 && c.rows > 0), "{chunks:?}");
        assert_eq!(chunks.last().unwrap().hi, None);
        for k in v.keys() {
            assert_eq!(chunk_of(&chunks, Some(*k)).len(), 1);
        }
    }

    /// Counts values on a grid of `width` from `min`, refining dense slices
    /// down to single values, as the planning step will with the source.
    fn count(values: &BTreeMap<i64, u64>, min: i64, max: i64, width: i128, chunk_rows: u64) -> Vec<Slice> {
        let mut out = Vec::new();
        let mut start = min as i128;
        while start <= max as i128 {
            let rows: u64 = values.range(start as i64..=((start + width - 1).min(max as i128)) as i64).map(|(_, n)| n).sum();
            let s = Slice { start: start as i64, width, rows };
            if rows > chunk_rows && width > 1 {
                let finer = (width / 16).max(1);
                out.extend(count(values, start as i64, ((start + width - 1).min(max as i128)) as i64, finer, chunk_rows));
            } else if rows > 0 {
                out.push(s);
            }
            start += width;
        }
        out
    }

    #[test]
    fn dense_cluster_is_split_and_sparse_tail_joins() {
        let mut v = BTreeMap::new();
        for k in 1..=1000 {
            v.insert(k, 1);
        }
        v.insert(i64::MAX, 1); // a sentinel at BIGINT's max
        let slices = count(&v, 1, i64::MAX, (i64::MAX as i128) / 16, 100);
        assert!(slices_to_refine(&slices, 100).is_empty());
        let chunks = pack_slices(0, &slices, 100, i64::MAX);
        assert!(chunks.len() >= 10, "{chunks:?}");
        assert_eq!(chunks.last().unwrap().hi, None, "MAX + 1 is past BIGINT: the last chunk is open");
        assert_eq!(chunk_of(&chunks, Some(i64::MAX)).len(), 1);
        assert_eq!(chunk_of(&chunks, None), vec![0]);
    }

    /// An in-memory nullable integer column: values -> rows, and NULL keys.
    struct NullableCounts(BTreeMap<i64, u64>, u64);

    #[async_trait]
    impl KeyCounter for NullableCounts {
        async fn count(&self, lo: i64, hi: i64, width: i64) -> Result<Vec<(i64, u64)>, SourceError> {
            Counts(self.0.clone()).count(lo, hi, width).await
        }
        async fn null_rows(&self) -> Result<u64, SourceError> {
            Ok(self.1)
        }
        async fn extent(&self, lo: i64, hi: i64) -> Result<Option<(i64, i64)>, SourceError> {
            Counts(self.0.clone()).extent(lo, hi).await
        }
    }

    #[test]
    fn null_keys_are_planned_into_the_first_chunk() {
        let v: BTreeMap<i64, u64> = (1..=50).map(|k| (k, 1)).collect();
        // Many NULLs: a first chunk of their own, below the first value.
        let chunks = block(plan_integer(&NullableCounts(v.clone(), 70), 1, 50, 10, 120)).unwrap();
        assert_eq!(chunks[0], IntChunk { lo: None, hi: Some(1), rows: 70 }, "{chunks:?}");
        assert_eq!(chunks.iter().map(|c| c.rows).sum::<u64>(), 120);
        // A few NULLs share the first chunk with the smallest values.
        let chunks = block(plan_integer(&NullableCounts(v, 4), 1, 50, 10, 54)).unwrap();
        assert_eq!(chunks[0].lo, None);
        assert_eq!(chunks[0].rows, 4 + (1..chunks[0].hi.unwrap()).count() as u64, "{chunks:?}");
        assert!(chunks.iter().all(|c| c.rows <= 10), "{chunks:?}");
        assert_eq!(chunks.iter().map(|c| c.rows).sum::<u64>(), 54);
    }

    #[test]
    fn one_value_with_more_rows_than_a_chunk_is_its_own_chunk() {
        let v: BTreeMap<i64, u64> = [(5, 3), (6, 500), (7, 2)].into_iter().collect();
        let slices = count(&v, 5, 7, 3, 100);
        let chunks = pack_slices(0, &slices, 100, 7);
        assert_eq!(chunks.iter().map(|c| c.rows).collect::<Vec<_>>(), vec![3, 500, 2]);
        assert_eq!(pack_slices(0, &[], 100, 0), vec![IntChunk { lo: None, hi: None, rows: 0 }]);
    }

    proptest! {
        #[test]
        fn plans_tile_the_key_and_respect_chunk_rows(
            keys in proptest::collection::vec((-5000i64..5000, 1u64..40), 1..300),
            chunk_rows in 1u64..200,
            probe in -6000i64..6000,
            nulls in prop_oneof![Just(0u64), 1u64..400],
        ) {
            let values: BTreeMap<i64, u64> = keys.into_iter().collect();
            let (min, max) = (*values.keys().next().unwrap(), *values.keys().last().unwrap());
            let width = (((max as i128 - min as i128 + 1) / 16).max(1)) as i128;
            let slices = count(&values, min, max, width, chunk_rows);
            let chunks = pack_slices(nulls, &slices, chunk_rows, max);
            // Every value up to MAX (and NULL) in exactly one chunk; keys above
            // MAX were inserted after S, and the stream has them (P4).
            prop_assert_eq!(chunk_of(&chunks, Some(probe.min(max))).len(), 1);
            prop_assert_eq!(chunk_of(&chunks, None).len(), 1);
            for (v, _) in &values {
                prop_assert_eq!(chunk_of(&chunks, Some(*v)).len(), 1);
            }
            // Each chunk's rows are the rows its predicates hold, NULLs in
            // the first; no chunk is empty, and none is over chunk_rows
            // unless it holds one value (or the NULLs) alone.
            for (i, c) in chunks.iter().enumerate() {
                let holds: Vec<(i64, u64)> = values.iter().filter(|(k, _)| chunk_of(std::slice::from_ref(c), Some(**k)).len() == 1).map(|(k, n)| (*k, *n)).collect();
                let null_rows = if i == 0 { nulls } else { 0 };
                prop_assert_eq!(c.rows, holds.iter().map(|(_, n)| n).sum::<u64>() + null_rows, "{:?}", c);
                prop_assert!(c.rows > 0);
                let distinct = holds.len() + usize::from(null_rows > 0);
                prop_assert!(c.rows <= chunk_rows || distinct == 1, "{:?} holds {} values", c, distinct);
            }
            // The counts add up.
            prop_assert_eq!(chunks.iter().map(|c| c.rows).sum::<u64>(), values.values().sum::<u64>() + nulls);
        }
    }
    fn string_shape(unique: bool) -> KeysetShape {
        KeysetShape { types: vec![SqlType::VarChar { len: Some(20) }], unique }
    }

    #[test]
    fn keyset_plan_on_a_repeated_case_mixed_column_never_splits_a_value() {
        // 'n' and 'N' are one value under the server's case-insensitive collation; NULLs sort first.
        let mut keys: Vec<Key> = Vec::new();
        for _ in 0..7 {
            keys.push(vec![SqlValue::Null]);
        }
        for (v, n) in [("a", 3), ("n", 9), ("N", 9), ("n ", 2), ("q", 1), ("z", 5)] {
            for _ in 0..n {
                keys.push(vec![SqlValue::Str(v.into())]);
            }
        }
        let table = Folded::new(keys);
        let max = vec![SqlValue::Str("z".into())];
        let shape = string_shape(false);
        let bounds = block(plan_keyset(&table, &max, 4, &shape)).unwrap();
        let end = block(last_bound(&table, &max, &shape)).unwrap();
        assert_eq!(end, None, "nothing after MAX: the last chunk is open");
        let ranges = keyset_ranges(&bounds, end);
        for k in &table.0 {
            assert_eq!(ranges.iter().filter(|r| Folded::holds(r, k)).count(), 1, "{k:?}");
        }
        // Every 'n' (any case, trailing space) in one chunk, and no chunk empty.
        let n_chunks: std::collections::BTreeSet<usize> =
            table.0.iter().filter(|k| matches!(&k[0], SqlValue::Str(s) if s.trim().eq_ignore_ascii_case("n"))).map(|k| ranges.iter().position(|r| Folded::holds(r, k)).unwrap()).collect();
        assert_eq!(n_chunks.len(), 1);
        for r in &ranges {
            assert!(table.0.iter().any(|k| Folded::holds(r, k)), "empty chunk {r:?}");
        }
        assert!(ranges[0].contains(&[SqlValue::Null]));
    }

    proptest! {
        #[test]
        fn keyset_plans_tile_repeated_and_null_values(
            values in proptest::collection::vec(proptest::option::of(0u8..12), 1..120),
            upper in proptest::collection::vec(any::<bool>(), 120),
            chunk_rows in 1u64..10,
            extra_after_max in 0usize..4,
        ) {
            let word = |v: u8, up: bool| { let s = format!("k{v:02}"); if up { s.to_uppercase() } else { s } };
            let mut keys: Vec<Key> = values.iter().zip(upper.iter()).map(|(v, up)| vec![v.map(|v| SqlValue::Str(word(v, *up))).unwrap_or(SqlValue::Null)]).collect();
            let table0 = Folded::new(keys.clone());
            let Some(max) = table0.0.iter().rev().find(|k| !k[0].is_null()).cloned() else { return Ok(()) };
            // Rows inserted above MAX after the open: the last bound stops before them.
            for i in 0..extra_after_max {
                keys.push(vec![SqlValue::Str(format!("z{i}"))]);
            }
            let table = Folded::new(keys);
            let shape = string_shape(false);
            let bounds = block(plan_keyset(&table, &max, chunk_rows, &shape)).unwrap();
            let end = block(last_bound(&table, &max, &shape)).unwrap();
            prop_assert_eq!(end.is_some(), extra_after_max > 0);
            let ranges = keyset_ranges(&bounds, end);
            for k in &table0.0 {
                prop_assert_eq!(ranges.iter().filter(|r| Folded::holds(r, k)).count(), 1);
            }
            for r in &ranges {
                prop_assert!(table0.0.iter().any(|k| Folded::holds(r, k)), "empty chunk {:?}", r);
            }
            // A value is in one chunk only, so each chunk but one starting on a
            // value held by more than chunk_rows rows holds at most chunk_rows
            // rows plus the rows of its last value's repeats.
            for w in bounds.windows(2) {
                prop_assert_eq!(Folded::cmp(&w[0], &w[1]), Ordering::Less);
            }
        }

        #[test]
        fn keyset_plans_on_a_unique_composite_key(n in 1usize..200, chunk_rows in 1u64..30) {
            let keys: Vec<Key> = (0..n).map(|i| vec![SqlValue::Str(if i % 2 == 0 { "A".into() } else { "b".into() }), SqlValue::Int(i as i64)]).collect();
            let table = Keys::new(keys);
            let shape = KeysetShape { types: vec![SqlType::VarChar { len: Some(5) }, SqlType::Int], unique: true };
            let max = table.0.last().unwrap().clone();
            let bounds = block(plan_keyset(&table, &max, chunk_rows, &shape)).unwrap();
            let ranges = keyset_ranges(&bounds, None);
            for r in &ranges {
                let rows = table.0.iter().filter(|k| r.contains(k)).count();
                prop_assert!(rows > 0 && rows as u64 <= chunk_rows + 1 && (rows as u64 <= chunk_rows || r.hi.is_none()), "{:?} holds {}", r, rows);
            }
            for k in &table.0 {
                prop_assert_eq!(ranges.iter().filter(|r| r.contains(k)).count(), 1);
            }
        }
    }

    #[test]
    fn datetime2_bounds_sit_on_a_microsecond_and_the_last_chunk_stays_open_in_max_microsecond() {
        let base = chrono::NaiveDate::from_ymd_opt(2026, 3, 1).unwrap().and_hms_opt(0, 0, 0).unwrap();
        let t = |ns: i64| vec![SqlValue::DateTime(base + chrono::Duration::nanoseconds(ns))];
        // 100 ns apart: ten keys share each microsecond.
        let table = Keys::new((0..40).map(|i| t(i * 100)).collect());
        let shape = KeysetShape { types: vec![SqlType::DateTime2 { scale: 7 }], unique: true };
        let max = t(3500); // the open saw keys up to 3.5 us; 3.6-3.9 us were inserted after
        let bounds = block(plan_keyset(&table, &max, 5, &shape)).unwrap();
        for b in &bounds {
            let SqlValue::DateTime(d) = &b[0] else { panic!() };
            assert_eq!(d.and_utc().timestamp_subsec_nanos() % 1000, 0, "{d}");
        }
        // The keys after MAX share its microsecond: the bound reads back as MAX's, so the end is open.
        assert_eq!(block(last_bound(&table, &max, &shape)).unwrap(), None);
        let ranges = keyset_ranges(&bounds, None);
        for k in table.0.iter().filter(|k| key_cmp(k, &max) != Ordering::Greater) {
            assert_eq!(ranges.iter().filter(|r| r.contains(k)).count(), 1, "{k:?}");
        }
    }

    /// A string column under a stand-in server collation that Rust's order
    /// does not share: case-, width- and padding-insensitive (`ｚ` = `Z` =
    /// `z `). Its seeks and its `compare` both follow that collation, as a
    /// server's do; NULLs sort first.
    struct Folded(Vec<Key>);

    fn fold(s: &str) -> String {
        s.trim_end_matches(' ')
            .chars()
            .map(|c| if ('\u{ff41}'..='\u{ff5a}').contains(&c) { char::from_u32(c as u32 - 0xfee0).unwrap() } else { c })
            .collect::<String>()
            .to_lowercase()
    }

    impl Folded {
        fn new(mut keys: Vec<Key>) -> Folded {
            keys.sort_by(Folded::cmp);
            Folded(keys)
        }

        fn strs(v: Vec<&str>) -> Folded {
            Folded::new(v.into_iter().map(|s| vec![SqlValue::Str(s.to_string())]).collect())
        }

        fn cmp(a: &Key, b: &Key) -> Ordering {
            match (&a[0], &b[0]) {
                (SqlValue::Str(x), SqlValue::Str(y)) => fold(x).cmp(&fold(y)),
                _ => key_cmp(a, b),
            }
        }

        /// As a range predicate holds: a NULL key only in the range open below.
        fn holds(range: &KeyRange, k: &Key) -> bool {
            if k.iter().any(SqlValue::is_null) {
                return range.lo.is_none();
            }
            range.lo.as_ref().is_none_or(|lo| Folded::cmp(k, lo) != Ordering::Less) && range.hi.as_ref().is_none_or(|hi| Folded::cmp(k, hi) == Ordering::Less)
        }
    }

    #[async_trait]
    impl KeySeeker for Folded {
        async fn seek(&self, range: &KeyRange, n: u64) -> Result<Option<Key>, SourceError> {
            Ok(self.0.iter().filter(|k| Folded::holds(range, k)).nth(n as usize).cloned())
        }

        async fn compare(&self, a: &Key, b: &Key) -> Result<Ordering, SourceError> {
            Ok(Folded::cmp(a, b))
        }
    }

    #[test]
    fn a_string_key_is_ordered_by_the_server_not_by_code_point() {
        // MAX has three spellings; `ｚ` is above `z` by code point, equal to it for the server.
        let mut v = Vec::new();
        for s in ["a", "B", "b", "c", "D", "Z", "z", "\u{ff5a}"] {
            v.extend([s; 3]);
        }
        let table = Folded::strs(v);
        let shape = KeysetShape { types: vec![SqlType::NVarChar { len: Some(10) }], unique: false };
        let max = vec![SqlValue::Str("z".into())];
        let bounds = block(plan_keyset(&table, &max, 4, &shape)).unwrap();
        let end = block(last_bound(&table, &max, &shape)).unwrap();
        assert_eq!(end, None, "no key follows MAX: the last chunk stays open");
        let ranges = keyset_ranges(&bounds, end);
        for k in &table.0 {
            assert_eq!(ranges.iter().filter(|r| Folded::holds(r, k)).count(), 1, "{k:?} is in one chunk");
        }
        for w in bounds.windows(2) {
            assert_eq!(Folded::cmp(&w[0], &w[1]), Ordering::Less, "bounds move in the server's order: {bounds:?}");
        }
    }

    // Tests that close UNTESTED rows of docs/CONFORMANCE.md (28.57, 28.58,
    // 28.70, 28.124, 28.126). Each expectation is computed here from the
    // in-memory table or by hand, never by another planner function.

    /// Non-overlapping slices in key order from (gap before, width, rows).
    fn slices_of(parts: &[(u8, u8, u64)]) -> Vec<Slice> {
        let mut next = -100i64;
        parts
            .iter()
            .map(|&(gap, width, rows)| {
                let s = Slice { start: next + gap as i64, width: width as i128, rows };
                next = s.start + width as i64;
                s
            })
            .collect()
    }

    #[test]
    fn pack_slices_closes_a_chunk_only_when_the_next_slice_would_overflow_it() {
        // 28.57 by hand. Catches `<=` turned into `<` in the packer (it would give [3], [4+2], [5+1]) or any early cut.
        let slices = slices_of(&[(0, 1, 3), (0, 1, 4), (0, 1, 2), (0, 1, 5), (0, 1, 1)]); // starts -100..=-96
        assert_eq!(
            pack_slices(0, &slices, 7, -96),
            vec![
                IntChunk { lo: None, hi: Some(-98), rows: 7 },
                IntChunk { lo: Some(-98), hi: Some(-96), rows: 7 },
                IntChunk { lo: Some(-96), hi: Some(-95), rows: 1 },
            ]
        );
        // The NULLs are packed first, like a value: 5 + 3 > 7 closes them alone.
        assert_eq!(
            pack_slices(5, &slices, 7, -96).iter().map(|c| (c.lo, c.rows)).collect::<Vec<_>>(),
            vec![(None, 5), (Some(-100), 7), (Some(-98), 7), (Some(-96), 1)]
        );
    }

    proptest! {
        #[test]
        fn every_chunk_but_the_last_holds_more_than_chunk_rows_less_the_next_slice(
            parts in proptest::collection::vec((0u8..4, 1u8..5, 0u64..60), 1..200),
            chunk_rows in 1u64..120,
            nulls in prop_oneof![Just(0u64), 1u64..150],
        ) {
            // 28.57. Catches a packer that closes chunks early (`<` for `<=`, a fill target below chunk_rows, a cut per slice).
            let slices = slices_of(&parts);
            let max = (slices.last().unwrap().end() - 1) as i64;
            let chunks = pack_slices(nulls, &slices, chunk_rows, max);
            // Rows of a chunk, counted here from the slices its bounds hold (and the NULLs in the first).
            let held = |i: usize| -> u64 {
                let c = &chunks[i];
                let in_slices: u64 = slices
                    .iter()
                    .filter(|s| c.lo.is_none_or(|lo| s.start >= lo) && c.hi.is_none_or(|hi| s.start < hi))
                    .map(|s| s.rows)
                    .sum();
                in_slices + if i == 0 { nulls } else { 0 }
            };
            for i in 0..chunks.len().saturating_sub(1) {
                let next_lo = chunks[i + 1].lo.expect("only the first chunk is open below");
                let next = slices.iter().find(|s| s.start == next_lo && s.rows > 0).expect("a chunk starts on a non-empty slice");
                prop_assert!(held(i) + next.rows > chunk_rows, "chunk {} {:?} holds {}, the next slice {:?}", i, chunks[i], held(i), next);
            }
        }
    }

    /// An integer column that records every count it is asked for, every
    /// extent probe, and how often its NULLs are counted.
    struct LoggedCounts {
        table: Counts,
        calls: std::sync::Mutex<Vec<(i64, i64, i64, Vec<(i64, u64)>)>>,
        extents: std::sync::Mutex<Vec<(i64, i64, Option<(i64, i64)>)>>,
        null_calls: std::sync::atomic::AtomicUsize,
    }

    impl LoggedCounts {
        fn new(values: BTreeMap<i64, u64>) -> LoggedCounts {
            LoggedCounts { table: Counts(values), calls: Default::default(), extents: Default::default(), null_calls: Default::default() }
        }
    }

    #[async_trait]
    impl KeyCounter for LoggedCounts {
        async fn count(&self, lo: i64, hi: i64, width: i64) -> Result<Vec<(i64, u64)>, SourceError> {
            let out = self.table.count(lo, hi, width).await?;
            self.calls.lock().unwrap().push((lo, hi, width, out.clone()));
            Ok(out)
        }

        async fn null_rows(&self) -> Result<u64, SourceError> {
            self.null_calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(0)
        }

        async fn extent(&self, lo: i64, hi: i64) -> Result<Option<(i64, i64)>, SourceError> {
            let out = self.table.extent(lo, hi).await?;
            self.extents.lock().unwrap().push((lo, hi, out));
            Ok(out)
        }
    }

    /// 1..=1000 one row each, 500..=509 thirty rows each: 1,290 rows.
    fn clustered() -> BTreeMap<i64, u64> {
        (1..=1000).map(|k| (k, if (500..=509).contains(&k) { 30 } else { 1 })).collect()
    }

    #[test]
    fn integer_planning_counts_the_whole_key_once_then_only_the_over_full_slices() {
        // 28.70. Catches a planner that recounts [MIN, MAX] (a second full pass, e.g. a finer grid over the whole
        // key), recounts a slice that was not over-full, or counts the NULLs more than once.
        let counter = LoggedCounts::new(clustered());
        let chunks = block(plan_integer(&counter, 1, 1000, 50, 1290)).unwrap();
        let calls = counter.calls.lock().unwrap().clone();
        assert_eq!(counter.null_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The first GROUP BY spans the key: 16 * ceil(1290 / 50) = 416 slices wanted, so width ceil(1000 / 416) = 3.
        assert_eq!((calls[0].0, calls[0].1, calls[0].2), (1, 1000, 3));
        assert_eq!(calls.iter().filter(|c| c.0 <= 1 && c.1 >= 1000).count(), 1, "one full pass: {calls:?}");
        assert!(calls.len() > 1, "the cluster's slices (61 and 90 rows) are counted again");
        for (j, (lo, hi, _, _)) in calls.iter().enumerate().skip(1) {
            let inside_an_over_full_slice = calls[..j].iter().any(|(_, _, w, out)| {
                *w > 1 && out.iter().any(|(start, rows)| *rows > 50 && *start <= *lo && *hi <= *start + *w - 1)
            });
            assert!(inside_an_over_full_slice, "count {j} over [{lo}, {hi}] is not a recount of an over-full slice: {calls:?}");
        }
        assert_eq!(chunks.iter().map(|c| c.rows).sum::<u64>(), 1290);
    }

    #[test]
    fn an_over_full_slice_is_recounted_on_a_grid_over_its_real_min_and_max() {
        // 28.55. A sparse, skewed key: 1,000 rows on 1e12..1e12+999 (one each) and a sentinel near BIGINT's max.
        // The first grid's slices are ~5.2e16 wide, so the band, 1,000 values wide, fills a sliver of the first one.
        //
        // By hand, adr-0028's algorithm: 16 * ceil(1001 / 100) = 176 slices wanted over [1e12, MAX - 5], width
        // ceil(9223371036854775803 / 176) = 52405517254856681. Slice 1e12 holds 1,000 rows (> 100): its MIN and
        // MAX are probed, 1e12 and 1e12 + 999, and that span of 1,000 is counted again with
        // 16 * ceil(1000 / 100) = 160 slices, width ceil(1000 / 160) = 7: 142 slices of 7 rows and one of 6, none
        // over-full. Two GROUP BY rounds and one probe.
        //
        // Fails against the old planner, which re-gridded the slice's grid bounds [1e12, 1e12 + 52405517254856680]
        // in 160 slices each round: the band stays in the first sub-slice while the width is at least 1,000, so it
        // counted widths 327534482842855, 2047090517768, 12794315737, 79964474, 499778, 3124 and 20: eight GROUP BY
        // rounds (and no probe), where this asserts two.
        const OLD_COUNT_ROUNDS: usize = 8;
        let band = 1_000_000_000_000i64;
        let sentinel = i64::MAX - 5;
        let mut values: BTreeMap<i64, u64> = (band..band + 1000).map(|k| (k, 1)).collect();
        values.insert(sentinel, 1);
        let total: u64 = values.values().sum();
        let counter = LoggedCounts::new(values.clone());
        let chunks = block(plan_integer(&counter, band, sentinel, 100, total)).unwrap();
        let calls: Vec<(i64, i64, i64)> = counter.calls.lock().unwrap().iter().map(|c| (c.0, c.1, c.2)).collect();
        let extents = counter.extents.lock().unwrap().clone();
        assert_eq!(calls, vec![(band, sentinel, 52_405_517_254_856_681), (band, band + 999, 7)], "GROUP BY rounds");
        assert!(calls.len() < OLD_COUNT_ROUNDS);
        assert_eq!(extents, vec![(band, band + 52_405_517_254_856_680, Some((band, band + 999)))], "one probe, of the over-full slice");
        assert_eq!(counter.null_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Still exact: each chunk's rows are the rows its bounds hold (counted here from the table), at most 100,
        // and every value is in exactly one chunk. 14 slices of 7 fill a chunk to 98; the last holds 7 + 7 + 6 and
        // the sentinel.
        for c in &chunks {
            let held: u64 = values.iter().filter(|(k, _)| c.lo.is_none_or(|lo| **k >= lo) && c.hi.is_none_or(|hi| **k < hi)).map(|(_, n)| n).sum();
            assert_eq!(c.rows, held, "{c:?}");
            assert!(held > 0 && held <= 100, "{c:?} holds {held}");
        }
        for k in values.keys() {
            assert_eq!(chunk_of(&chunks, Some(*k)).len(), 1, "value {k}");
        }
        let mut want = vec![98u64; 10];
        want.push(21);
        assert_eq!(chunks.iter().map(|c| c.rows).collect::<Vec<_>>(), want);
        assert_eq!(chunks[1].lo, Some(band + 98), "bounds sit on the probed grid from MIN");
        assert_eq!(chunks.last().unwrap().hi, Some(sentinel + 1));
    }

    #[test]
    fn a_probed_slice_of_one_value_is_not_counted_again() {
        // 28.55. 300 rows of one value inside a wide slice: the probe finds MIN = MAX, so the slice is that value
        // alone, a chunk of its own, without a recount. Fails against the old planner, which re-gridded the slice
        // down to width 1 (widths 324, 7, 1: four GROUP BY rounds).
        let values: BTreeMap<i64, u64> = [(5_000, 300), (1_000_000, 1)].into_iter().collect();
        let counter = LoggedCounts::new(values);
        let chunks = block(plan_integer(&counter, 5_000, 1_000_000, 100, 301)).unwrap();
        // By hand: 16 * ceil(301 / 100) = 64 slices over 995,001 values, width ceil(995001 / 64) = 15547; slice
        // [5000, 20546] holds the 300 rows of 5,000, and 1,000,000 is in the slice from 5000 + 63 * 15547 = 984461.
        assert_eq!(counter.calls.lock().unwrap().len(), 1, "one GROUP BY, no recount");
        assert_eq!(counter.extents.lock().unwrap().clone(), vec![(5_000, 20_546, Some((5_000, 5_000)))]);
        assert_eq!(
            chunks,
            vec![IntChunk { lo: None, hi: Some(984_461), rows: 300 }, IntChunk { lo: Some(984_461), hi: Some(1_000_001), rows: 1 }]
        );
    }

    proptest! {
        #[test]
        fn probed_integer_plans_tile_any_key_exactly(
            keys in proptest::collection::vec((prop_oneof![-5000i64..5000, any::<i64>(), Just(i64::MAX), Just(i64::MIN)], 1u64..40), 1..200),
            chunk_rows in 1u64..150,
            nulls in prop_oneof![Just(0u64), 1u64..300],
            estimate in 0u64..20_000,
        ) {
            // 28.55. Catches a recount over the probed MIN..MAX that leaves a value out (a grid from MIN stopping
            // short of MAX, a first sub-slice moved past a value) or counts one twice, on keys spread over BIGINT.
            let values: BTreeMap<i64, u64> = keys.into_iter().collect();
            let (min, max) = (*values.keys().next().unwrap(), *values.keys().last().unwrap());
            let chunks = block(plan_integer(&NullableCounts(values.clone(), nulls), min, max, chunk_rows, estimate)).unwrap();
            for v in values.keys() {
                prop_assert_eq!(chunk_of(&chunks, Some(*v)).len(), 1, "value {}", v);
            }
            prop_assert_eq!(chunk_of(&chunks, None), vec![0]);
            for (i, c) in chunks.iter().enumerate() {
                let held: Vec<(i64, u64)> =
                    values.iter().filter(|(k, _)| c.lo.is_none_or(|lo| **k >= lo) && c.hi.is_none_or(|hi| **k < hi)).map(|(k, n)| (*k, *n)).collect();
                let null_rows = if i == 0 { nulls } else { 0 };
                prop_assert_eq!(c.rows, held.iter().map(|(_, n)| n).sum::<u64>() + null_rows, "{:?}", c);
                prop_assert!(c.rows > 0);
                let distinct = held.len() + usize::from(null_rows > 0);
                prop_assert!(c.rows <= chunk_rows || distinct == 1, "{:?} holds {} values", c, distinct);
            }
            prop_assert_eq!(chunks.last().unwrap().hi, i64::try_from(max as i128 + 1).ok());
        }
    }

    #[test]
    fn the_row_estimate_only_sizes_the_first_grid() {
        // 28.58. Catches the estimate used beyond the first grid's width (as a row total, a chunk count, a cap on
        // refinement): every estimate, however wrong, must plan a valid tiling with exact counts.
        let values = clustered();
        for (estimate, first_width) in [(0u64, 63i64), (1, 63), (1290, 3), (1_000_000_000_000, 1)] {
            // By hand: slices wanted = clamp(16 * ceil(max(estimate, 1) / 50), 16, 100000); width = ceil(1000 / wanted).
            let counter = LoggedCounts::new(values.clone());
            let chunks = block(plan_integer(&counter, 1, 1000, 50, estimate)).unwrap();
            assert_eq!(counter.calls.lock().unwrap()[0].2, first_width, "estimate {estimate}");
            for (k, _) in &values {
                assert_eq!(chunk_of(&chunks, Some(*k)).len(), 1, "estimate {estimate}: value {k}");
            }
            for c in &chunks {
                let rows: u64 = values.iter().filter(|(k, _)| c.lo.is_none_or(|lo| **k >= lo) && c.hi.is_none_or(|hi| **k < hi)).map(|(_, n)| n).sum();
                assert_eq!(c.rows, rows, "estimate {estimate}: {c:?}");
                assert!(rows > 0 && rows <= 50, "estimate {estimate}: {c:?} holds {rows}");
            }
            assert_eq!(chunks.last().unwrap().hi, Some(1001), "estimate {estimate}");
        }
    }

    /// A table's keys (as [`Keys`]) that records every seek.
    struct LoggedKeys {
        table: Keys,
        seeks: std::sync::Mutex<Vec<(KeyRange, u64)>>,
    }

    impl LoggedKeys {
        fn new(keys: Vec<Key>) -> LoggedKeys {
            LoggedKeys { table: Keys::new(keys), seeks: Default::default() }
        }

        fn take(&self) -> Vec<(KeyRange, u64)> {
            std::mem::take(&mut *self.seeks.lock().unwrap())
        }
    }

    #[async_trait]
    impl KeySeeker for LoggedKeys {
        async fn seek(&self, range: &KeyRange, n: u64) -> Result<Option<Key>, SourceError> {
            self.seeks.lock().unwrap().push((range.clone(), n));
            self.table.seek(range, n).await
        }

        async fn compare(&self, a: &Key, b: &Key) -> Result<Ordering, SourceError> {
            self.table.compare(a, b).await
        }
    }

    /// 50 keys of a composite integer key, (i / 3, i) for i in 0..50.
    fn composite_keys() -> Vec<Key> {
        (0..50).map(|i| vec![SqlValue::Int(i / 3), SqlValue::Int(i)]).collect()
    }

    fn int_pair_shape(unique: bool) -> KeysetShape {
        KeysetShape { types: vec![SqlType::Int, SqlType::Int], unique }
    }

    #[test]
    fn a_keyset_plan_walks_the_key_once_with_one_seek_per_chunk() {
        // 28.70. Catches a walk that seeks from the start of the key again (lo None with a growing n), or seeks a
        // bound twice: the seeks must start at None, then at each bound in turn, chunk_rows rows each.
        let keys = composite_keys();
        let table = LoggedKeys::new(keys.clone());
        let max = keys[49].clone();
        let bounds = block(plan_keyset(&table, &max, 7, &int_pair_shape(true))).unwrap();
        // By hand: the rows 7, 14, ..., 49 rows in; from row 49 no 8th row is left.
        let expected: Vec<Key> = (1..=7).map(|i| keys[i * 7].clone()).collect();
        assert_eq!(bounds, expected);
        let seeks = table.take();
        let los: Vec<Option<Key>> = seeks.iter().map(|(r, _)| r.lo.clone()).collect();
        let mut want: Vec<Option<Key>> = vec![None];
        want.extend(expected.iter().cloned().map(Some));
        assert_eq!(los, want, "one seek per chunk, each from the previous bound");
        assert!(seeks.iter().all(|(r, n)| r.hi.is_none() && *n == 7), "{seeks:?}");
    }

    #[test]
    fn a_plan_on_the_unique_index_makes_no_extra_seeks() {
        // 28.126. Catches the non-empty check `[lo, bound)` run for unique keys too (`!shape.unique` dropped):
        // 15 seeks instead of 8. The non-unique walk over the same keys shows the check that unique plans skip.
        let keys = composite_keys();
        let max = keys[49].clone();
        let unique = LoggedKeys::new(keys.clone());
        let bounds = block(plan_keyset(&unique, &max, 7, &int_pair_shape(true))).unwrap();
        assert_eq!(bounds.len(), 7);
        assert_eq!(unique.take().len(), 8, "a seek per bound and the last one that finds none");
        let repeated = LoggedKeys::new(keys.clone());
        assert_eq!(block(plan_keyset(&repeated, &max, 7, &int_pair_shape(false))).unwrap(), bounds, "same keys, same plan");
        let seeks = repeated.take();
        assert_eq!(seeks.len(), 15, "each of the 7 bounds checked by one more seek: {seeks:?}");
        assert_eq!(seeks.iter().filter(|(r, n)| r.hi.is_some() && *n == 0).count(), 7);
        // The end seek past MAX reads the same on both: MAX itself, then nothing.
        block(last_bound(&unique, &max, &int_pair_shape(true))).unwrap();
        block(last_bound(&repeated, &max, &int_pair_shape(false))).unwrap();
        assert_eq!(unique.take().len(), 2);
        assert_eq!(repeated.take().len(), 2);
    }

    #[test]
    fn a_heavy_value_makes_a_chunk_of_its_own_under_twice_its_rows() {
        // 28.124 by hand: chunk_rows 4 over a a b×9 c c c d e×10; from 'b' the seeks at 4 and 8 rows repeat 'b',
        // the one at 16 finds 'e'. Catches a walk that splits 'b', or one that grows n by other than doubling
        // (adding chunk_rows, or ×3, reaches 12 rows and ends the chunk at 'd').
        let mut v = Vec::new();
        for (s, n) in [("a", 2), ("b", 9), ("c", 3), ("d", 1), ("e", 10)] {
            v.extend(std::iter::repeat_n(s, n));
        }
        let table = Folded::strs(v);
        let max = vec![SqlValue::Str("e".into())];
        let bounds = block(plan_keyset(&table, &max, 4, &string_shape(false))).unwrap();
        assert_eq!(bounds, vec![vec![SqlValue::Str("b".into())], vec![SqlValue::Str("e".into())]]);
        // The chunks hold 2, 13 (< 2 × 9) and 10 (< 2 × 10) rows.
        let ranges = keyset_ranges(&bounds, None);
        let sizes: Vec<usize> = ranges.iter().map(|r| table.0.iter().filter(|k| Folded::holds(r, k)).count()).collect();
        assert_eq!(sizes, vec![2, 13, 10]);
    }

    proptest! {
        #[test]
        fn a_chunk_over_chunk_rows_starts_on_a_heavy_value_and_holds_under_twice_its_rows(
            values in proptest::collection::vec(proptest::option::of(0u8..6), 1..150),
            upper in proptest::collection::vec(any::<bool>(), 150),
            chunk_rows in 1u64..8,
        ) {
            // 28.124. Catches a doubling step other than ×2 (×4 lets a chunk reach 2× its first value's rows) and a
            // bound accepted while it repeats lo (a chunk over chunk_rows whose first value is not heavy).
            let word = |v: u8, up: bool| { let s = format!("k{v:02}"); if up { s.to_uppercase() } else { s } };
            let keys: Vec<Key> = values.iter().zip(upper.iter()).map(|(v, up)| vec![v.map(|v| SqlValue::Str(word(v, *up))).unwrap_or(SqlValue::Null)]).collect();
            let table = Folded::new(keys);
            let Some(max) = table.0.iter().rev().find(|k| !k[0].is_null()).cloned() else { return Ok(()) };
            let shape = string_shape(false);
            let bounds = block(plan_keyset(&table, &max, chunk_rows, &shape)).unwrap();
            let end = block(last_bound(&table, &max, &shape)).unwrap();
            // One value: equal under the collation, or both NULL.
            let same = |a: &Key, b: &Key| match (a[0].is_null(), b[0].is_null()) {
                (true, true) => true,
                (false, false) => Folded::cmp(a, b) == Ordering::Equal,
                _ => false,
            };
            for r in keyset_ranges(&bounds, end) {
                let held: Vec<&Key> = table.0.iter().filter(|k| Folded::holds(&r, k)).collect();
                let rows = held.len() as u64;
                if rows > chunk_rows {
                    // Sorted with NULLs first, so held[0] is the value the chunk starts on.
                    let first_rows = table.0.iter().filter(|k| same(*k, held[0])).count() as u64;
                    prop_assert!(first_rows > chunk_rows, "{:?} holds {} rows but starts on {:?} held by {}", r, rows, held[0], first_rows);
                    prop_assert!(rows < 2 * first_rows, "{:?} holds {} rows, {:?} only {}", r, rows, held[0], first_rows);
                }
            }
        }
    }
}
