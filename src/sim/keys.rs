//! Memcomparable sort keys.
//!
//! A key (one value per key column) is turned into bytes whose plain
//! lexicographic order is the simulated server's ORDER BY order for that key,
//! and whose equality is its `=` (strings under their column's collation,
//! [`super::collation`]). The simulator stores rows under these bytes in
//! a SQLite index, so a key range becomes a byte range and a chunked read is
//! an index seek instead of a table scan. Each encoded value is
//! self-delimiting, so the encoding of a key prefix is a byte prefix of the
//! full key's encoding: ranges on the leading key columns work too.
//!
//! Layout of one value: a tag byte (0x00 for NULL, which sorts first; 0x01
//! otherwise) followed by:
//! - integers, bit: the i64 with its sign bit flipped, big-endian;
//! - decimal, money: the unscaled i128 at the column's scale, sign bit flipped, big-endian;
//! - float, real: IEEE bits arranged so unsigned order equals `f64::total_cmp`;
//! - strings: the column collation's sort key (trailing spaces never count),
//!   each 0x00 written as 0x00 0xFF, then the terminator 0x00 0x00; binary
//!   values alike, raw but without trailing 0x00 bytes (SQL Server pads the
//!   shorter of two binary values with 0x00 to compare them, so `0x01` and
//!   `0x0100` are one value);
//! - uniqueidentifier: `guid_sort_key`;
//! - date: days, time: nanoseconds of the day, datetime kinds: seconds and
//!   nanoseconds since 1970 (datetimeoffset by its instant).

use std::sync::Arc;

use chrono::{NaiveDate, Timelike};

use super::collation::Collation;
use crate::types::{guid_sort_key, SqlType, SqlValue};

/// A key column as its sort key needs it: the type and, for a string
/// column, its collation.
#[derive(Clone)]
pub struct KeyCol {
    pub ty: SqlType,
    pub collation: Option<Arc<Collation>>,
}

impl KeyCol {
    /// A column whose values need no collation (any non-string type).
    pub fn plain(ty: SqlType) -> KeyCol {
        KeyCol { ty, collation: None }
    }
}

/// Appends the sort-key bytes of one value of a column.
///
/// Values are expected in the column's canonical form (what the simulator
/// stores after coercion); an integer in a decimal column is scaled, and a
/// decimal with more fraction digits than the column is floored, which keeps
/// the mapping monotone.
pub fn encode_value(out: &mut Vec<u8>, col: &KeyCol, v: &SqlValue) {
    let t = &col.ty;
    if v.is_null() {
        out.push(0x00);
        return;
    }
    out.push(0x01);
    let col_scale = match t {
        SqlType::Decimal { scale, .. } => Some(*scale),
        SqlType::Money | SqlType::SmallMoney => Some(4),
        _ => None,
    };
    match v {
        SqlValue::Null => unreachable!("handled above"),
        SqlValue::Bool(b) => push_i64(out, *b as i64),
        SqlValue::Int(x) => match col_scale {
            Some(s) => push_i128(out, scale_floor(*x as i128, 0, s)),
            None => push_i64(out, *x),
        },
        SqlValue::Decimal { value, scale } => {
            let s = col_scale.unwrap_or(*scale);
            push_i128(out, scale_floor(*value, *scale, s))
        }
        SqlValue::Float(f) => {
            let bits = f.to_bits();
            let k = if bits >> 63 == 1 { !bits } else { bits ^ (1u64 << 63) };
            out.extend_from_slice(&k.to_be_bytes());
        }
        SqlValue::Str(s) => {
            let mut sk = Vec::with_capacity(s.len() * 2);
            match &col.collation {
                Some(c) => c.sort_key(s, &mut sk),
                // A string in a column the caller did not collate: the default collation.
                None => super::collation::collation(super::collation::DEFAULT_COLLATION).expect("default collation").sort_key(s, &mut sk),
            }
            push_escaped(out, &sk)
        }
        SqlValue::Bytes(b) => {
            let end = b.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1);
            push_escaped(out, &b[..end])
        }
        SqlValue::Date(d) => push_i64(out, days(*d)),
        SqlValue::Time(t) => {
            let ns = t.num_seconds_from_midnight() as u64 * 1_000_000_000 + t.nanosecond() as u64;
            out.extend_from_slice(&ns.to_be_bytes());
        }
        SqlValue::DateTime(t) => {
            let u = t.and_utc();
            push_i64(out, u.timestamp());
            out.extend_from_slice(&u.timestamp_subsec_nanos().to_be_bytes());
        }
        SqlValue::DateTimeOffset(t) => {
            push_i64(out, t.timestamp());
            out.extend_from_slice(&t.timestamp_subsec_nanos().to_be_bytes());
        }
        SqlValue::Guid(g) => out.extend_from_slice(&guid_sort_key(g)),
    }
}

/// The sort key of a composite key: the concatenation of its values' encodings.
pub fn encode_key(cols: &[KeyCol], key: &[SqlValue]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 * key.len());
    for (c, v) in cols.iter().zip(key) {
        encode_value(&mut out, c, v);
    }
    out
}

/// Reads back the leading integer of a sort key whose first column is an
/// integer type: None when it is NULL or the bytes are too short.
pub fn decode_leading_int(key: &[u8]) -> Option<i64> {
    if key.len() < 9 || key[0] != 0x01 {
        return None;
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[1..9]);
    Some((u64::from_be_bytes(b) ^ (1u64 << 63)) as i64)
}

/// The smallest byte string greater than every string that starts with `prefix`
/// (None when there is none, i.e. the prefix is all 0xFF).
pub fn prefix_successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut p = prefix.to_vec();
    while let Some(last) = p.pop() {
        if last < 0xFF {
            p.push(last + 1);
            return Some(p);
        }
    }
    None
}

fn push_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&((v as u64) ^ (1u64 << 63)).to_be_bytes());
}

fn push_i128(out: &mut Vec<u8>, v: i128) {
    out.extend_from_slice(&((v as u128) ^ (1u128 << 127)).to_be_bytes());
}

fn push_escaped(out: &mut Vec<u8>, bytes: &[u8]) {
    for &b in bytes {
        if b == 0 {
            out.extend_from_slice(&[0x00, 0xFF]);
        } else {
            out.push(b);
        }
    }
    out.extend_from_slice(&[0x00, 0x00]);
}

fn days(d: NaiveDate) -> i64 {
    (d - NaiveDate::from_ymd_opt(1970, 1, 1).expect("epoch")).num_days()
}

/// `value / 10^from` expressed at scale `to`, rounding toward negative
/// infinity when digits are lost; saturates on overflow.
fn scale_floor(value: i128, from: u8, to: u8) -> i128 {
    if to >= from {
        let m = 10i128.checked_pow((to - from) as u32);
        match m.and_then(|m| value.checked_mul(m)) {
            Some(v) => v,
            None => {
                if value < 0 {
                    i128::MIN
                } else {
                    i128::MAX
                }
            }
        }
    } else {
        match 10i128.checked_pow((from - to) as u32) {
            Some(d) => value.div_euclid(d),
            None => {
                if value < 0 {
                    -1
                } else {
                    0
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::collation::{collation, DEFAULT_COLLATION};
    use crate::types::sql_cmp;
    use chrono::{DateTime, NaiveTime};
    use std::cmp::Ordering;
    use proptest::prelude::*;
    use uuid::Uuid;

    fn arb_string() -> impl Strategy<Value = String> {
        // Small alphabet so that equal-under-collation pairs are frequent.
        proptest::collection::vec(prop_oneof![Just('a'), Just('A'), Just('b'), Just('B'), Just(' '), Just('\0'), Just('é'), Just('z')], 0..5)
            .prop_map(|v| v.into_iter().collect())
    }

    fn arb_value(kind: u8) -> BoxedStrategy<SqlValue> {
        let non_null: BoxedStrategy<SqlValue> = match kind {
            0 => prop_oneof![any::<i64>(), -3i64..3].prop_map(SqlValue::Int).boxed(),
            1 => (-100_000i128..100_000).prop_map(|v| SqlValue::Decimal { value: v, scale: 2 }).boxed(),
            2 => arb_string().prop_map(SqlValue::Str).boxed(),
            3 => any::<[u8; 16]>().prop_map(|b| SqlValue::Guid(Uuid::from_bytes(b))).boxed(),
            4 => (-5_000_000_000i64..5_000_000_000, 0u32..1_000_000_000)
                .prop_map(|(s, n)| SqlValue::DateTime(DateTime::from_timestamp(s, n).unwrap().naive_utc()))
                .boxed(),
            5 => any::<f64>().prop_filter("not NaN", |f| !f.is_nan()).prop_map(SqlValue::Float).boxed(),
            6 => proptest::collection::vec(prop_oneof![Just(0u8), Just(1u8), Just(255u8)], 0..4).prop_map(SqlValue::Bytes).boxed(),
            7 => (0u32..86_400, 0u32..1_000_000_000)
                .prop_map(|(s, n)| SqlValue::Time(NaiveTime::from_num_seconds_from_midnight_opt(s, n).unwrap()))
                .boxed(),
            _ => (-100_000i32..100_000)
                .prop_map(|d| SqlValue::Date(NaiveDate::from_ymd_opt(1970, 1, 1).unwrap() + chrono::Duration::days(d as i64)))
                .boxed(),
        };
        prop_oneof![1 => Just(SqlValue::Null), 8 => non_null].boxed()
    }

    fn type_of(kind: u8) -> SqlType {
        match kind {
            0 => SqlType::BigInt,
            1 => SqlType::Decimal { precision: 12, scale: 2 },
            2 => SqlType::NVarChar { len: Some(10) },
            3 => SqlType::UniqueIdentifier,
            4 => SqlType::DateTime2 { scale: 7 },
            5 => SqlType::Float,
            6 => SqlType::VarBinary { len: Some(10) },
            7 => SqlType::Time { scale: 7 },
            _ => SqlType::Date,
        }
    }

    fn arb_pair() -> impl Strategy<Value = (Vec<SqlType>, Vec<SqlValue>, Vec<SqlValue>)> {
        proptest::collection::vec(0u8..9, 1..4).prop_flat_map(|kinds| {
            let types: Vec<SqlType> = kinds.iter().map(|k| type_of(*k)).collect();
            let a: Vec<BoxedStrategy<SqlValue>> = kinds.iter().map(|k| arb_value(*k)).collect();
            let b: Vec<BoxedStrategy<SqlValue>> = kinds.iter().map(|k| arb_value(*k)).collect();
            (Just(types), a, b)
        })
    }

    fn cols(types: &[SqlType]) -> Vec<KeyCol> {
        types
            .iter()
            .map(|t| KeyCol { ty: t.clone(), collation: t.is_string().then(|| collation(DEFAULT_COLLATION).unwrap()) })
            .collect()
    }

    /// The order the sort keys must give, value by value: strings by the
    /// collator's own comparison (not its sort key), binary values padded
    /// with 0x00, everything else by value.
    fn reference(a: &[SqlValue], b: &[SqlValue]) -> Ordering {
        for (x, y) in a.iter().zip(b) {
            let o = match (x, y) {
                (SqlValue::Str(x), SqlValue::Str(y)) => collation(DEFAULT_COLLATION).unwrap().compare(x, y),
                (SqlValue::Bytes(x), SqlValue::Bytes(y)) => {
                    let n = x.len().max(y.len());
                    let pad = |v: &Vec<u8>| v.iter().copied().chain(std::iter::repeat(0)).take(n).collect::<Vec<u8>>();
                    pad(x).cmp(&pad(y))
                }
                _ => sql_cmp(x, y),
            };
            if o != Ordering::Equal {
                return o;
            }
        }
        Ordering::Equal
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn byte_order_is_sql_order((types, a, b) in arb_pair()) {
            let c = cols(&types);
            let (ka, kb) = (encode_key(&c, &a), encode_key(&c, &b));
            prop_assert_eq!(ka.cmp(&kb), reference(&a, &b), "{:?} vs {:?}", a, b);
        }

        #[test]
        fn prefix_encoding_is_a_prefix((types, a, _b) in arb_pair()) {
            let c = cols(&types);
            let full = encode_key(&c, &a);
            let pre = encode_key(&c[..1], &a[..1]);
            prop_assert!(full.starts_with(&pre));
        }
    }

    #[test]
    fn collation_equal_values_share_a_key() {
        let c = cols(&[SqlType::VarChar { len: Some(10) }]);
        assert_eq!(encode_key(&c, &[SqlValue::Str("abc".into())]), encode_key(&c, &[SqlValue::Str("ABC  ".into())]));
        assert_eq!(encode_key(&c, &[SqlValue::Str("z".into())]), encode_key(&c, &[SqlValue::Str("\u{ff5a}".into())]));
        let b = cols(&[SqlType::VarBinary { len: Some(4) }]);
        assert_eq!(encode_key(&b, &[SqlValue::Bytes(vec![1])]), encode_key(&b, &[SqlValue::Bytes(vec![1, 0, 0])]));
        assert_eq!(decode_leading_int(&encode_key(&cols(&[SqlType::Int]), &[SqlValue::Int(-42)])), Some(-42));
        assert_eq!(prefix_successor(&[1, 0xFF]), Some(vec![2]));
    }
}
