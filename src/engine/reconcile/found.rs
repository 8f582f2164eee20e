//! The differences tier 2 finds, in bounded memory.
//!
//! A reconcile of an empty or far-behind silver finds a difference in every
//! row of the table, and its class is only settled after the source reads
//! (IN_FLIGHT needs the change table read after them, SNAPSHOT_PENDING the
//! open snapshot's applied chunks). Holding them all until then would make
//! reconcile's memory follow the table. [`Found`] holds the first
//! [`HELD_DIFFERENCES`] in memory and writes the rest, in the order found, to
//! an anonymous temporary file (removed by the OS when it is closed, a crash
//! included). [`Found::into_chunks`] gives them back in that order, at most
//! [`HELD_DIFFERENCES`] at a time, so each later pass holds one chunk.
//!
//! Counts are taken from the passes over every difference, never from the
//! rows kept for the report, so they stay exact however many there are.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::rows::{Difference, CLASSES};
use crate::error::{StepError, StepResult};
use crate::types::Key;

/// How many differences are held in memory before the rest go to disk,
/// and the most a pass over them holds at once.
pub const HELD_DIFFERENCES: usize = 10_000;

/// A difference as it is written to the spill file: one JSON line.
#[derive(Serialize, Deserialize)]
struct Stored {
    class: String,
    key: Option<Key>,
    bucket: Option<i64>,
    chunk: Option<i64>,
    source_hash: Option<String>,
    target_hash: Option<String>,
    detail: Option<Value>,
}

fn spill_error(e: impl std::fmt::Display) -> StepError {
    StepError::Temporary(format!(
        "reconcile could not write or read its differences in the temporary directory ({}): {e}. \
         Free space there (or point TMPDIR elsewhere) and call reconcile again",
        std::env::temp_dir().display()
    ))
}

/// Differences in the order found: the first [`HELD_DIFFERENCES`] in
/// memory, the rest in a temporary file.
pub struct Found {
    held: Vec<Difference>,
    spill: Option<BufWriter<File>>,
    spilled: u64,
    hold_max: usize,
}

impl Default for Found {
    fn default() -> Self {
        Found::with_hold(HELD_DIFFERENCES)
    }
}

impl std::fmt::Debug for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Found").field("held", &self.held.len()).field("spilled", &self.spilled).finish()
    }
}

impl Found {
    /// Holds at most `hold_max` (at least 1) in memory.
    pub fn with_hold(hold_max: usize) -> Found {
        Found { held: Vec::new(), spill: None, spilled: 0, hold_max: hold_max.max(1) }
    }

    /// How many differences were written to disk.
    pub fn spilled(&self) -> u64 {
        self.spilled
    }

    pub fn push(&mut self, d: Difference) -> StepResult<()> {
        if self.held.len() < self.hold_max && self.spill.is_none() {
            self.held.push(d);
            return Ok(());
        }
        if self.spill.is_none() {
            self.spill = Some(BufWriter::with_capacity(1 << 16, tempfile::tempfile().map_err(spill_error)?));
        }
        let w = self.spill.as_mut().expect("opened above");
        let stored = Stored {
            class: d.class.to_string(),
            key: d.key,
            bucket: d.bucket,
            chunk: d.chunk,
            source_hash: d.source_hash,
            target_hash: d.target_hash,
            detail: d.detail,
        };
        serde_json::to_writer(&mut *w, &stored).map_err(spill_error)?;
        w.write_all(b"\n").map_err(spill_error)?;
        self.spilled += 1;
        Ok(())
    }

    pub fn extend(&mut self, ds: impl IntoIterator<Item = Difference>) -> StepResult<()> {
        for d in ds {
            self.push(d)?;
        }
        Ok(())
    }

    /// Every difference, in the order pushed, in chunks of at most the hold.
    pub fn into_chunks(self) -> StepResult<Chunks> {
        let reader = match self.spill {
            None => None,
            Some(w) => {
                let mut f = w.into_inner().map_err(|e| spill_error(e.error()))?;
                f.seek(SeekFrom::Start(0)).map_err(spill_error)?;
                Some(BufReader::with_capacity(1 << 16, f).lines())
            }
        };
        Ok(Chunks { first: Some(self.held), reader, hold_max: self.hold_max })
    }
}

/// What [`Found::into_chunks`] gives: `Vec`s of at most the hold, in order.
pub struct Chunks {
    first: Option<Vec<Difference>>,
    reader: Option<std::io::Lines<BufReader<File>>>,
    hold_max: usize,
}

impl Iterator for Chunks {
    type Item = StepResult<Vec<Difference>>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(first) = self.first.take() {
            if !first.is_empty() {
                return Some(Ok(first));
            }
        }
        let lines = self.reader.as_mut()?;
        let mut out = Vec::new();
        while out.len() < self.hold_max {
            let Some(line) = lines.next() else { break };
            let read = line.map_err(spill_error).and_then(|l| {
                let s: Stored = serde_json::from_str(&l).map_err(|e| StepError::Internal(format!("a spilled difference does not read back: {e}")))?;
                let class = CLASSES
                    .iter()
                    .copied()
                    .find(|c| *c == s.class)
                    .ok_or_else(|| StepError::Internal(format!("a spilled difference has an unknown class {}", s.class)))?;
                Ok(Difference { class, key: s.key, bucket: s.bucket, chunk: s.chunk, source_hash: s.source_hash, target_hash: s.target_hash, detail: s.detail })
            });
            match read {
                Ok(d) => out.push(d),
                Err(e) => return Some(Err(e)),
            }
        }
        if out.is_empty() {
            self.reader = None;
            None
        } else {
            Some(Ok(out))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::reconcile::rows::{MISSING_SOURCE, MISSING_TARGET, RECORD_DIFF};
    use crate::types::SqlValue;
    use chrono::NaiveDate;

    fn diff(i: i64) -> Difference {
        let class = [MISSING_TARGET, MISSING_SOURCE, RECORD_DIFF][(i % 3) as usize];
        let when = NaiveDate::from_ymd_opt(2026, 1, 1).unwrap().and_hms_nano_opt(1, 2, 3, 100).unwrap();
        Difference {
            class,
            key: Some(vec![
                SqlValue::Int(i),
                SqlValue::Decimal { value: -(i as i128) * 10_i128.pow(30), scale: 4 },
                SqlValue::Float(-0.0),
                SqlValue::Str(format!("k\u{1F600} {i} ")),
                SqlValue::DateTime(when),
                if i % 2 == 0 { SqlValue::Null } else { SqlValue::Bytes(vec![0, 255, i as u8]) },
            ]),
            bucket: Some(i / 7),
            chunk: (i % 5 == 0).then_some(i),
            source_hash: Some(format!("{i:064x}")),
            target_hash: None,
            detail: Some(serde_json::json!({"n": i})),
        }
    }

    #[test]
    fn differences_come_back_in_order_whole_and_in_bounded_chunks() {
        let mut f = Found::with_hold(7);
        let want: Vec<Difference> = (0..50).map(diff).collect();
        f.extend(want.clone()).unwrap();
        assert_eq!(f.spilled(), 43);
        let chunks: Vec<Vec<Difference>> = f.into_chunks().unwrap().map(|c| c.unwrap()).collect();
        assert!(chunks.iter().all(|c| !c.is_empty() && c.len() <= 7), "{:?}", chunks.iter().map(Vec::len).collect::<Vec<_>>());
        let got: Vec<Difference> = chunks.into_iter().flatten().collect();
        assert_eq!(got, want, "every field, a 128-bit decimal and a supplementary character included, reads back as written");
        // Fewer than the hold: nothing is written, and nothing at all gives no chunk.
        let mut small = Found::with_hold(7);
        small.extend((0..3).map(diff)).unwrap();
        assert_eq!(small.spilled(), 0);
        assert_eq!(small.into_chunks().unwrap().map(|c| c.unwrap().len()).collect::<Vec<_>>(), vec![3]);
        assert_eq!(Found::default().into_chunks().unwrap().count(), 0);
    }
}
