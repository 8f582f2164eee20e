//! The rows of a compared range and their classes (pure apart from reading
//! silver's schema): what `reconcile` and its tier 2 passes (`compare`) both
//! use. Kept apart from both so neither imports the other back: `reconcile`
//! drives `compare`, and `compare` needs only these definitions.

use std::collections::{HashMap, HashSet};

use deltalake::arrow::array::{Array, Int64Array};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::DeltaTable;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::engine::apply::ident;
use crate::error::{StepError, StepResult};
use crate::types::{ColumnDesc, Key, SqlValue};

pub const MISSING_TARGET: &str = "MISSING_TARGET";
pub const MISSING_SOURCE: &str = "MISSING_SOURCE";
pub const RECORD_DIFF: &str = "RECORD_DIFF";
pub const IN_FLIGHT: &str = "IN_FLIGHT";
pub const CHUNK_TILING: &str = "CHUNK_TILING";
pub const CHUNK_ROWS: &str = "CHUNK_ROWS";
pub const CHUNK_STAMP: &str = "CHUNK_STAMP";
/// Every class, in report order.
/// A difference in a range the open chunked snapshot has not applied to silver yet.
pub const SNAPSHOT_PENDING: &str = "SNAPSHOT_PENDING";
pub const CLASSES: &[&str] = &[MISSING_TARGET, MISSING_SOURCE, RECORD_DIFF, IN_FLIGHT, SNAPSHOT_PENDING, CHUNK_TILING, CHUNK_ROWS, CHUNK_STAMP];

/// Whether a class counts as a difference (the verdict, exit 3): every one
/// but IN_FLIGHT and SNAPSHOT_PENDING, which only say "not yet".
pub fn is_difference(class: &str) -> bool {
    class != IN_FLIGHT && class != SNAPSHOT_PENDING
}

/// One difference found.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    pub class: &'static str,
    pub key: Option<Key>,
    pub bucket: Option<i64>,
    pub chunk: Option<i64>,
    pub source_hash: Option<String>,
    pub target_hash: Option<String>,
    pub detail: Option<Value>,
}

/// SHA-256 (hex) of a row's canonical encoding: each value's canonical text,
/// separated by U+001F. The source side passes its values through
/// [`as_stored`] first, so both sides encode what Delta holds.
pub fn row_hash(values: &[SqlValue]) -> String {
    let mut h = Sha256::new();
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            h.update([0x1f]);
        }
        h.update(v.canonical().as_bytes());
    }
    hex::encode(h.finalize())
}

/// The key as a JSON object for the report: column -> value, NULL as null.
pub fn key_json(keys: &[ColumnDesc], key: &[SqlValue]) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in keys.iter().zip(key) {
        let j = match v {
            SqlValue::Null => Value::Null,
            SqlValue::Int(i) => json!(i),
            SqlValue::Bool(b) => json!(b),
            other => json!(other.canonical().trim_matches('"')),
        };
        m.insert(k.name.clone(), j);
    }
    Value::Object(m)
}

/// Rows of one side of a compared range: key text -> (key, hash).
pub type Side = HashMap<String, (Key, String)>;

/// Classifies the keys of one range (pure). `in_flight` holds the key texts
/// with a change silver has not applied.
pub fn classify(source: &Side, target: &Side, in_flight: &HashSet<String>, bucket: Option<i64>) -> Vec<Difference> {
    let mut out = Vec::new();
    let mut push = |class: &'static str, kt: &str, key: &Key, s: Option<&String>, t: Option<&String>| {
        let class = if in_flight.contains(kt) { IN_FLIGHT } else { class };
        out.push(Difference {
            class,
            key: Some(key.clone()),
            bucket,
            chunk: None,
            source_hash: s.cloned(),
            target_hash: t.cloned(),
            detail: None,
        });
    };
    let mut skeys: Vec<&String> = source.keys().collect();
    skeys.sort();
    for kt in skeys {
        let (key, sh) = &source[kt];
        match target.get(kt) {
            None => push(MISSING_TARGET, kt, key, Some(sh), None),
            Some((_, th)) if th != sh => push(RECORD_DIFF, kt, key, Some(sh), Some(th)),
            Some(_) => {}
        }
    }
    let mut tkeys: Vec<&String> = target.keys().filter(|k| !source.contains_key(*k)).collect();
    tkeys.sort();
    for kt in tkeys {
        let (key, th) = &target[kt];
        push(MISSING_SOURCE, kt, key, None, Some(th));
    }
    out
}

/// A heap's rows on one side: row hash -> (the row's values, how many rows hold them).
pub type Counts = HashMap<String, (Key, i64)>;

/// Classifies a heap's rows (pure): each distinct row whose count differs,
/// `MISSING_TARGET` when the source holds it more often, `MISSING_SOURCE`
/// when silver does, `IN_FLIGHT` when a change silver has not applied has
/// those values (`in_flight` holds row hashes). The report's key is the
/// whole row, the only thing that names a heap's row.
pub fn classify_heap(source: &Counts, target: &Counts, in_flight: &HashSet<String>) -> Vec<Difference> {
    let mut hashes: Vec<&String> = source.keys().chain(target.keys().filter(|h| !source.contains_key(*h))).collect();
    hashes.sort();
    let mut out = Vec::new();
    for h in hashes {
        let (s, t) = (source.get(h), target.get(h));
        let (n_source, n_target) = (s.map_or(0, |x| x.1), t.map_or(0, |x| x.1));
        if n_source == n_target {
            continue;
        }
        let class = if in_flight.contains(h) {
            IN_FLIGHT
        } else if n_source > n_target {
            MISSING_TARGET
        } else {
            MISSING_SOURCE
        };
        out.push(Difference {
            class,
            key: s.or(t).map(|x| x.0.clone()),
            bucket: None,
            chunk: None,
            source_hash: s.map(|_| h.clone()),
            target_hash: t.map(|_| h.clone()),
            detail: Some(json!({"source_count": n_source, "silver_count": n_target})),
        });
    }
    out
}

pub(super) fn i64_col(b: &RecordBatch, i: usize) -> StepResult<&Int64Array> {
    b.column(i).as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal(format!("column {i} is not bigint")))
}

/// The quoted names of the compared columns silver holds. A column the
/// stream's capture instance added that silver has not gained yet (no
/// `apply` since the switch) is left out and compares as NULL: the keys
/// whose values in it silver lacks changed in bronze after silver's applied
/// LSN, so they are IN_FLIGHT, and every other key holds NULL in it.
pub(super) fn columns_silver_holds(silver_table: &DeltaTable, columns: &[ColumnDesc]) -> StepResult<Vec<String>> {
    let snapshot = silver_table.snapshot().map_err(StepError::delta(silver_table.table_url().to_string()))?;
    let held: Vec<String> = snapshot.schema().fields().map(|f| f.name().to_lowercase()).collect();
    Ok(columns.iter().filter(|c| held.contains(&c.name.to_lowercase())).map(|c| ident(&c.name)).collect())
}

/// The differences of keys met more than once on one side (pure): a silver
/// key held twice is `MISSING_SOURCE` (the copy has no source row), a source
/// key held twice `MISSING_TARGET` (silver, one row per key, cannot hold
/// both). Never IN_FLIGHT: no change silver has yet to apply makes a key
/// repeat.
pub fn repeated_keys(source: &[(Key, String)], target: &[(Key, String)], bucket: Option<i64>) -> Vec<Difference> {
    let one = |class: &'static str, side: &str, key: &Key, hash: &String| Difference {
        class,
        key: Some(key.clone()),
        bucket,
        chunk: None,
        source_hash: (side == "source").then(|| hash.clone()),
        target_hash: (side == "silver").then(|| hash.clone()),
        detail: Some(json!({"problem": format!("the key is in {side} more than once")})),
    };
    source.iter().map(|(k, h)| one(MISSING_TARGET, "source", k, h)).chain(target.iter().map(|(k, h)| one(MISSING_SOURCE, "silver", k, h))).collect()
}
