//! How the simulated server evaluates a key-range predicate: the model of the
//! `WHERE` clause a client sends for [`crate::source::CdcSource::snapshot_read`]
//! and [`crate::source::CdcSource::key_seek`], kept apart from the engine's
//! own idea of a range ([`crate::source::KeyRange::contains`]) so that the two
//! can disagree when one of them is wrong.
//!
//! The statement shape modelled (the protocol's contract for range reads,
//! argued in `src/mssql/sql.rs`):
//!
//! - a bound component of an integer column (tinyint, smallint, int, bigint)
//!   is a bigint parameter compared with the column as it is, `[k] < @P`:
//!   by data type precedence the column's value converts to bigint, which
//!   holds every value of every integer type, so no bound can fail, and a
//!   bound past the column type's range (MAX + 1 of an int key) is simply
//!   above (or below) every row;
//! - a bound component of any other column is converted to the column's
//!   type, `[k] < CAST(@P AS <column type>)`. A value the type cannot hold
//!   fails the whole statement with SQL Server's error 8115 (*"Arithmetic
//!   overflow error converting numeric to data type numeric."* for a
//!   decimal) whatever rows the range holds: the converted parameter is a
//!   runtime constant, computed once before the index seek whose bounds it
//!   gives, so the server fails before it reads a row;
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

/// SQL Server's error 8115, reported as the real client reports a server
/// error it does not classify.
fn overflow(what: &str) -> SourceError {
    SourceError::Other(format!("SQL Server error 8115: Arithmetic overflow error converting {what}."))
}

/// One bound component as the statement compares it with its column of type
/// `t` (see the module doc).
pub fn bound_as_compared(t: &SqlType, v: &SqlValue) -> Result<SqlValue, SourceError> {
    if v.is_null() {
        return Ok(SqlValue::Null);
    }
    match t {
        // `[k] < @P`, @P bigint: the column converts, never the bound.
        SqlType::TinyInt | SqlType::SmallInt | SqlType::Int | SqlType::BigInt => Ok(v.clone()),
        // `CAST(@P AS <type>)`: rounds decimals and fractional seconds as
        // CAST does; past an exact numeric type's range it is error 8115.
        _ => match db::coerce_value(v.clone(), t) {
            Ok(c) => Ok(c),
            Err(_) => {
                let from = if matches!(v, SqlValue::Int(_)) { "bigint" } else { "numeric" };
                match t {
                    SqlType::Decimal { .. } => Err(overflow(&format!("{from} to data type numeric"))),
                    SqlType::Money => Err(overflow("expression to data type money")),
                    SqlType::SmallMoney => Err(overflow("expression to data type smallmoney")),
                    // A conversion the simulator does not model: compared as sent.
                    _ => Ok(v.clone()),
                }
            }
        },
    }
}

/// A key range as the server evaluates it for these key columns.
pub struct RangePredicate {
    cols: Vec<keys::KeyCol>,
    /// The bounds as compared, in the columns' types.
    typed: KeyRange,
    lo: Option<Vec<u8>>,
    hi: Option<Vec<u8>>,
}

impl RangePredicate {
    /// Types the bounds as the statement does; error 8115 when one does not
    /// convert, a `Config` error when a bound's width is not the key's.
    pub fn new(cols: &[keys::KeyCol], range: &KeyRange) -> Result<RangePredicate, SourceError> {
        let typed_bound = |b: &Key| -> Result<Key, SourceError> {
            if b.len() != cols.len() {
                return Err(SourceError::Config(format!("a range bound has {} values for {} key columns", b.len(), cols.len())));
            }
            cols.iter().zip(b).map(|(c, v)| bound_as_compared(&c.ty, v)).collect()
        };
        let typed = KeyRange { lo: range.lo.as_ref().map(typed_bound).transpose()?, hi: range.hi.as_ref().map(typed_bound).transpose()? };
        let lo = typed.lo.as_ref().map(|k| keys::encode_key(cols, k));
        let hi = typed.hi.as_ref().map(|k| keys::encode_key(cols, k));
        Ok(RangePredicate { cols: cols.to_vec(), typed, lo, hi })
    }

    /// The bounds in the columns' types (for seeking the sorted row index).
    pub fn typed(&self) -> &KeyRange {
        &self.typed
    }

    /// The sort key of a key (NULL lowest), in which the predicate compares.
    pub fn sort_key(&self, key: &[SqlValue]) -> Vec<u8> {
        keys::encode_key(&self.cols, key)
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
    fn an_integer_bound_past_the_columns_type_is_compared_as_bigint() {
        for (t, max) in [(SqlType::Int, 2_147_483_647i64), (SqlType::SmallInt, 32_767), (SqlType::TinyInt, 255)] {
            // MAX + 1 as the last chunk's end: every row below it, none failing.
            let p = RangePredicate::new(&[keys::KeyCol::plain(t.clone())], &range(Some(max - 3), Some(max + 1))).unwrap();
            assert!(p.holds(&[SqlValue::Int(max)]) && p.holds(&[SqlValue::Int(max - 3)]) && !p.holds(&[SqlValue::Int(max - 4)]));
            let p = RangePredicate::new(&[keys::KeyCol::plain(t)], &range(Some(max + 1), None)).unwrap();
            assert!(!p.holds(&[SqlValue::Int(max)]), "a range from MAX + 1 holds no row");
        }
        let p = RangePredicate::new(&[keys::KeyCol::plain(SqlType::TinyInt)], &range(Some(-1), Some(1))).unwrap();
        assert!(p.holds(&[SqlValue::Int(0)]), "a negative bound on tinyint is below every row");
    }

    #[test]
    fn a_cast_bound_past_a_decimal_columns_precision_is_error_8115() {
        let t = SqlType::Decimal { precision: 5, scale: 2 };
        let e = RangePredicate::new(&[keys::KeyCol::plain(t.clone())], &range(Some(0), Some(1000))).err().expect("overflow");
        assert_eq!(e.to_string(), "source error: SQL Server error 8115: Arithmetic overflow error converting bigint to data type numeric.");
        let ok = RangePredicate::new(&[keys::KeyCol::plain(t)], &range(Some(0), Some(999))).unwrap();
        assert!(ok.holds(&[SqlValue::Decimal { value: 99_899, scale: 2 }]) && !ok.holds(&[SqlValue::Decimal { value: 99_900, scale: 2 }]));
    }

    #[test]
    fn nulls_belong_to_the_range_open_below_only() {
        let p = RangePredicate::new(&[keys::KeyCol::plain(SqlType::Int)], &range(None, Some(5))).unwrap();
        assert!(p.holds(&[SqlValue::Null]) && p.holds(&[SqlValue::Int(4)]) && !p.holds(&[SqlValue::Int(5)]));
        let p = RangePredicate::new(&[keys::KeyCol::plain(SqlType::Int)], &range(Some(5), Some(7))).unwrap();
        assert!(!p.holds(&[SqlValue::Null]) && p.holds(&[SqlValue::Int(5)]) && p.holds(&[SqlValue::Int(6)]) && !p.holds(&[SqlValue::Int(7)]));
    }
}
