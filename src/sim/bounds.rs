//! How the simulated server evaluates a key-range predicate: the model of the
//! `WHERE` clause a client sends for [`crate::source::CdcSource::snapshot_read`]
//! and [`crate::source::CdcSource::key_seek`], kept apart from the engine's
//! own idea of a range ([`crate::source::KeyRange::contains`]) so that the two
//! can disagree when one of them is wrong.
//!
//! The statement shape modelled (the protocol's contract for range reads):
//!
//! - each bound component is sent as a parameter and, in the predicate,
//!   converted to the key column's type: `[k] < CAST(@P AS <column type>)`.
//!   A value outside the type's range fails the whole statement with SQL
//!   Server's error 8115, *"Arithmetic overflow error converting expression
//!   to data type int."*, whatever rows the range holds: the converted
//!   parameter is a runtime constant, computed once before the index seek
//!   whose bounds it gives, so the server fails before it reads a row;
//! - the lower bound keeps rows whose key is at or above it and no row with
//!   a NULL key column (a comparison with NULL is unknown); the upper bound
//!   keeps rows below it and every row with a NULL key column (the first range
//!   of a tiling holds them); a NULL inside a bound sorts lowest, as ORDER BY
//!   puts it.
//!
//! Order is the simulator's own: the memcomparable sort keys of [`super::keys`]
//! (SQL Server's ORDER BY order, collations included), compared as bytes.

use crate::source::{KeyRange, SourceError};
use crate::types::{Key, SqlType, SqlValue};

use super::db;
use super::keys;

/// SQL Server's error 8115 on converting a value to an integer type it does
/// not fit, reported as the real client reports a server error it does not
/// classify.
fn overflow(type_name: &str) -> SourceError {
    SourceError::Other(format!("SQL Server error 8115: Arithmetic overflow error converting expression to data type {type_name}."))
}

/// The name and value range of an integer type (tinyint is unsigned).
fn integer_type(t: &SqlType) -> Option<(&'static str, i64, i64)> {
    match t {
        SqlType::TinyInt => Some(("tinyint", 0, 255)),
        SqlType::SmallInt => Some(("smallint", -32_768, 32_767)),
        SqlType::Int => Some(("int", -2_147_483_648, 2_147_483_647)),
        SqlType::BigInt => Some(("bigint", i64::MIN, i64::MAX)),
        _ => None,
    }
}

/// One bound component as the statement compares it with its column of type
/// `t`: converted to the column's type (see the module doc).
pub fn bound_as_compared(t: &SqlType, v: &SqlValue) -> Result<SqlValue, SourceError> {
    if v.is_null() {
        return Ok(SqlValue::Null);
    }
    if let (Some((name, min, max)), SqlValue::Int(x)) = (integer_type(t), v) {
        return if *x < min || *x > max { Err(overflow(name)) } else { Ok(SqlValue::Int(*x)) };
    }
    // Other types: the conversion to the column's type (rounding decimals and
    // fractional seconds as CAST does); a value the simulator cannot convert
    // is compared as sent.
    Ok(db::coerce_value(v.clone(), t).unwrap_or_else(|_| v.clone()))
}

/// A key range as the server evaluates it for key columns of `types`.
pub struct RangePredicate {
    types: Vec<SqlType>,
    /// The bounds as compared, in the columns' types.
    typed: KeyRange,
    lo: Option<Vec<u8>>,
    hi: Option<Vec<u8>>,
}

impl RangePredicate {
    /// Types the bounds as the statement does; error 8115 when one does not
    /// convert, a `Config` error when a bound's width is not the key's.
    pub fn new(types: &[SqlType], range: &KeyRange) -> Result<RangePredicate, SourceError> {
        let typed_bound = |b: &Key| -> Result<Key, SourceError> {
            if b.len() != types.len() {
                return Err(SourceError::Config(format!("a range bound has {} values for {} key columns", b.len(), types.len())));
            }
            types.iter().zip(b).map(|(t, v)| bound_as_compared(t, v)).collect()
        };
        let typed = KeyRange { lo: range.lo.as_ref().map(typed_bound).transpose()?, hi: range.hi.as_ref().map(typed_bound).transpose()? };
        let refs: Vec<&SqlType> = types.iter().collect();
        let lo = typed.lo.as_ref().map(|k| keys::encode_key(&refs, k));
        let hi = typed.hi.as_ref().map(|k| keys::encode_key(&refs, k));
        Ok(RangePredicate { types: types.to_vec(), typed, lo, hi })
    }

    /// The bounds in the columns' types (for seeking the sorted row index).
    pub fn typed(&self) -> &KeyRange {
        &self.typed
    }

    /// The sort key of a key (NULL lowest), in which the predicate compares.
    pub fn sort_key(&self, key: &[SqlValue]) -> Vec<u8> {
        let refs: Vec<&SqlType> = self.types.iter().collect();
        keys::encode_key(&refs, key)
    }

    /// Whether the predicate keeps a row with this key.
    pub fn holds(&self, key: &[SqlValue]) -> bool {
        if key.iter().any(SqlValue::is_null) {
            // `[k] >= @lo` is unknown for NULL; the upper side's `[k] IS NULL` keeps it.
            return self.lo.is_none();
        }
        let k = self.sort_key(key);
        self.lo.as_ref().is_none_or(|lo| k >= *lo) && self.hi.as_ref().is_none_or(|hi| k < *hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(lo: Option<i64>, hi: Option<i64>) -> KeyRange {
        KeyRange { lo: lo.map(|v| vec![SqlValue::Int(v)]), hi: hi.map(|v| vec![SqlValue::Int(v)]) }
    }

    #[test]
    fn a_bound_past_the_columns_type_is_error_8115() {
        for (t, name, past) in [(SqlType::Int, "int", 2_147_483_648i64), (SqlType::SmallInt, "smallint", 32_768), (SqlType::TinyInt, "tinyint", 256)] {
            let e = RangePredicate::new(&[t.clone()], &range(Some(0), Some(past))).err().expect("overflow");
            assert_eq!(e.to_string(), format!("source error: SQL Server error 8115: Arithmetic overflow error converting expression to data type {name}."));
            assert!(RangePredicate::new(&[t], &range(Some(past - 1), None)).is_ok());
        }
        assert!(RangePredicate::new(&[SqlType::TinyInt], &range(Some(-1), None)).is_err(), "tinyint has no negative values");
    }

    #[test]
    fn nulls_belong_to_the_range_open_below_only() {
        let p = RangePredicate::new(&[SqlType::Int], &range(None, Some(5))).unwrap();
        assert!(p.holds(&[SqlValue::Null]) && p.holds(&[SqlValue::Int(4)]) && !p.holds(&[SqlValue::Int(5)]));
        let p = RangePredicate::new(&[SqlType::Int], &range(Some(5), Some(7))).unwrap();
        assert!(!p.holds(&[SqlValue::Null]) && p.holds(&[SqlValue::Int(5)]) && p.holds(&[SqlValue::Int(6)]) && !p.holds(&[SqlValue::Int(7)]));
    }
}
