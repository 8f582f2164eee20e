//! Chunk plans of chunked snapshots (adr-0028's Amendment), as pure functions.
//!
//! One integer key is planned from row counts per slice of a grid: slices
//! holding more than `chunk_rows` are counted again on a finer grid (down to
//! one value), then consecutive non-empty slices are packed, in key order,
//! into chunks of at most `chunk_rows` rows. Sizes follow the counts, not the
//! key's spread: a dense cluster is split, a sparse region or a far sentinel
//! joins its neighbours, and no chunk starts on an empty slice.
//!
//! This module holds the packing and the refinement rule; the step that
//! reads the counts from the source (and the keyset plans of other keys)
//! builds on it.

use serde::{Deserialize, Serialize};

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
/// chunk holds, and more than one value wide.
pub fn slices_to_refine(slices: &[Slice], chunk_rows: u64) -> Vec<Slice> {
    slices.iter().filter(|s| s.rows > chunk_rows && s.width > 1).copied().collect()
}

/// Packs non-empty slices (sorted by start, not overlapping) into chunks of
/// at most `chunk_rows` rows; a single-value slice holding more is a chunk
/// of its own. The first chunk is open below; the last ends at `max + 1`
/// (open when that is past BIGINT). Empty input (an empty table) plans one
/// open chunk.
pub fn pack_slices(slices: &[Slice], chunk_rows: u64, max: i64) -> Vec<IntChunk> {
    let chunk_rows = chunk_rows.max(1);
    let mut starts: Vec<(i64, u64)> = Vec::new(); // (chunk start, rows)
    for s in slices.iter().filter(|s| s.rows > 0) {
        match starts.last_mut() {
            Some((_, rows)) if *rows + s.rows <= chunk_rows => *rows += s.rows,
            _ => starts.push((s.start, s.rows)),
        }
    }
    if starts.is_empty() {
        return vec![IntChunk { lo: None, hi: None, rows: 0 }];
    }
    let last_hi = i64::try_from(max as i128 + 1).ok();
    let n = starts.len();
    (0..n)
        .map(|i| IntChunk {
            lo: if i == 0 { None } else { Some(starts[i].0) },
            hi: if i + 1 < n { Some(starts[i + 1].0) } else { last_hi },
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

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
        let chunks = pack_slices(&slices, 100, i64::MAX);
        assert!(chunks.len() >= 10, "{chunks:?}");
        assert_eq!(chunks.last().unwrap().hi, None, "MAX + 1 is past BIGINT: the last chunk is open");
        assert_eq!(chunk_of(&chunks, Some(i64::MAX)).len(), 1);
        assert_eq!(chunk_of(&chunks, None), vec![0]);
    }

    #[test]
    fn one_value_with_more_rows_than_a_chunk_is_its_own_chunk() {
        let v: BTreeMap<i64, u64> = [(5, 3), (6, 500), (7, 2)].into_iter().collect();
        let slices = count(&v, 5, 7, 3, 100);
        let chunks = pack_slices(&slices, 100, 7);
        assert_eq!(chunks.iter().map(|c| c.rows).collect::<Vec<_>>(), vec![3, 500, 2]);
        assert_eq!(pack_slices(&[], 100, 0), vec![IntChunk { lo: None, hi: None, rows: 0 }]);
    }

    proptest! {
        #[test]
        fn plans_tile_the_key_and_respect_chunk_rows(
            keys in proptest::collection::vec((-5000i64..5000, 1u64..40), 1..300),
            chunk_rows in 1u64..200,
            probe in -6000i64..6000,
        ) {
            let values: BTreeMap<i64, u64> = keys.into_iter().collect();
            let (min, max) = (*values.keys().next().unwrap(), *values.keys().last().unwrap());
            let width = (((max as i128 - min as i128 + 1) / 16).max(1)) as i128;
            let slices = count(&values, min, max, width, chunk_rows);
            let chunks = pack_slices(&slices, chunk_rows, max);
            // Every value up to MAX (and NULL) in exactly one chunk; keys above
            // MAX were inserted after S, and the stream has them (P4).
            prop_assert_eq!(chunk_of(&chunks, Some(probe.min(max))).len(), 1);
            prop_assert_eq!(chunk_of(&chunks, None).len(), 1);
            for (v, _) in &values {
                prop_assert_eq!(chunk_of(&chunks, Some(*v)).len(), 1);
            }
            // No empty chunk; none over chunk_rows unless it is one value.
            for c in &chunks {
                prop_assert!(c.rows > 0);
                let distinct = values.keys().filter(|k| chunk_of(std::slice::from_ref(c), Some(**k)).len() == 1).count();
                prop_assert!(c.rows <= chunk_rows || distinct == 1, "{:?} holds {} values", c, distinct);
            }
            // The counts add up.
            prop_assert_eq!(chunks.iter().map(|c| c.rows).sum::<u64>(), values.values().sum::<u64>());
        }
    }
}
