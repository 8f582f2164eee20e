//! Values: bringing written rows and keys into the canonical form the
//! simulator stores for each column type, and the errors (and key texts)
//! for values a table cannot hold.

use chrono::{DateTime, Timelike};

use crate::types::{ColumnDesc, SqlType, SqlValue};

use super::config::{Result, SimError};
use super::meta::TableMeta;
use super::store::round_to_datetime;

pub(super) fn bad(t: &TableMeta, col: &ColumnDesc, message: String) -> SimError {
    SimError::BadValue { table: t.spec.name.to_string(), column: col.name.clone(), message }
}

/// Brings a value into the canonical form the simulator stores for the column
/// type (decimals at the column's scale, bit as bool, datetime on its grid...),
/// or explains why the column cannot hold it.
pub(crate) fn coerce_value(v: SqlValue, t: &SqlType) -> std::result::Result<SqlValue, String> {
    use SqlType as T;
    use SqlValue as V;
    let int_range = |x: i64, lo: i64, hi: i64| {
        if x < lo || x > hi {
            Err(format!("{x} is out of range for {t}"))
        } else {
            Ok(V::Int(x))
        }
    };
    let dec = |value: i128, scale: u8, to: u8, precision: u8| -> std::result::Result<SqlValue, String> {
        let v = if to >= scale {
            value.checked_mul(10i128.pow((to - scale) as u32)).ok_or("decimal overflow")?
        } else {
            let d = 10i128.pow((scale - to) as u32);
            let q = value / d;
            let r = value % d;
            // Round half away from zero, as SQL Server does on conversion.
            if r.abs() * 2 >= d {
                q + value.signum()
            } else {
                q
            }
        };
        if v.unsigned_abs() >= 10u128.pow(precision as u32) {
            return Err(format!("{} does not fit {t}", crate::types::format_decimal(value, scale)));
        }
        Ok(V::Decimal { value: v, scale: to })
    };
    match (t, v) {
        (_, V::Null) => Ok(V::Null),
        (T::TinyInt, V::Int(x)) => int_range(x, 0, 255),
        (T::SmallInt, V::Int(x)) => int_range(x, i16::MIN as i64, i16::MAX as i64),
        (T::Int, V::Int(x)) => int_range(x, i32::MIN as i64, i32::MAX as i64),
        (T::BigInt, V::Int(x)) => Ok(V::Int(x)),
        (T::Bit, V::Bool(b)) => Ok(V::Bool(b)),
        (T::Bit, V::Int(x)) => Ok(V::Bool(x != 0)),
        (T::Decimal { precision, scale }, V::Decimal { value, scale: s }) => dec(value, s, *scale, *precision),
        (T::Decimal { precision, scale }, V::Int(x)) => dec(x as i128, 0, *scale, *precision),
        (T::Money, V::Decimal { value, scale }) => dec(value, scale, 4, 19),
        (T::Money, V::Int(x)) => dec(x as i128, 0, 4, 19),
        (T::SmallMoney, V::Decimal { value, scale }) => dec(value, scale, 4, 10),
        (T::SmallMoney, V::Int(x)) => dec(x as i128, 0, 4, 10),
        (T::Float, V::Float(f)) => Ok(V::Float(f)),
        (T::Float, V::Int(x)) => Ok(V::Float(x as f64)),
        (T::Real, V::Float(f)) => Ok(V::Float(f as f32 as f64)),
        (T::Real, V::Int(x)) => Ok(V::Float(x as f32 as f64)),
        (T::Char { .. } | T::VarChar { .. } | T::NChar { .. } | T::NVarChar { .. } | T::Text | T::NText | T::Xml, V::Str(s)) => {
            let max = match t {
                T::Char { len } | T::NChar { len } => Some(*len),
                T::VarChar { len } | T::NVarChar { len } => *len,
                _ => None,
            };
            match max {
                Some(m) if s.chars().count() > m as usize => Err(format!("a string of {} characters is too long for {t}", s.chars().count())),
                _ => Ok(V::Str(s)),
            }
        }
        (T::Binary { .. } | T::VarBinary { .. } | T::Image | T::Timestamp, V::Bytes(b)) => Ok(V::Bytes(b)),
        (T::Date, V::Date(d)) => Ok(V::Date(d)),
        (T::Date, V::DateTime(d)) => Ok(V::Date(d.date())),
        (T::Time { .. }, V::Time(x)) => Ok(V::Time(x)),
        (T::DateTime, V::DateTime(x)) => Ok(V::DateTime(round_to_datetime(x))),
        (T::SmallDateTime, V::DateTime(x)) => {
            let secs = x.and_utc().timestamp();
            let m = (secs + 30).div_euclid(60) * 60;
            Ok(V::DateTime(DateTime::from_timestamp(m, 0).unwrap_or_default().naive_utc()))
        }
        (T::DateTime2 { scale }, V::DateTime(x)) => {
            let unit = 10u32.pow(9 - (*scale).min(7) as u32);
            let n = x.nanosecond();
            Ok(V::DateTime(x.with_nanosecond(n - n % unit).unwrap_or(x)))
        }
        (T::DateTimeOffset { .. }, V::DateTimeOffset(x)) => Ok(V::DateTimeOffset(x)),
        (T::UniqueIdentifier, V::Guid(g)) => Ok(V::Guid(g)),
        (T::UniqueIdentifier, V::Str(s)) => uuid::Uuid::parse_str(&s).map(V::Guid).map_err(|_| format!("'{s}' is not a uniqueidentifier")),
        (t, v) => Err(format!("a {} value ({}) cannot be stored in a {t} column", kind_name(&v), v.canonical())),
    }
}

fn kind_name(v: &SqlValue) -> &'static str {
    match v {
        SqlValue::Null => "NULL",
        SqlValue::Bool(_) => "boolean",
        SqlValue::Int(_) => "integer",
        SqlValue::Decimal { .. } => "decimal",
        SqlValue::Float(_) => "float",
        SqlValue::Str(_) => "string",
        SqlValue::Bytes(_) => "binary",
        SqlValue::Date(_) => "date",
        SqlValue::Time(_) => "time",
        SqlValue::DateTime(_) => "datetime",
        SqlValue::DateTimeOffset(_) => "datetimeoffset",
        SqlValue::Guid(_) => "uniqueidentifier",
    }
}

pub(super) fn coerce_row(t: &TableMeta, row: Vec<SqlValue>) -> Result<Vec<SqlValue>> {
    if row.len() != t.spec.columns.len() {
        return Err(SimError::BadArgument(format!(
            "a row of {} needs {} values (columns {}), got {}",
            t.spec.name,
            t.spec.columns.len(),
            t.spec.columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
            row.len()
        )));
    }
    row.into_iter()
        .zip(&t.spec.columns)
        .enumerate()
        .map(|(i, (v, c))| {
            let v = coerce_value(v, &c.sql_type).map_err(|m| bad(t, c, m))?;
            if v.is_null() && (!c.nullable || t.key_cols.contains(&i) && !t.spec.primary_key.is_empty()) {
                return Err(bad(t, c, "the column does not accept NULL".into()));
            }
            Ok(v)
        })
        .collect()
}

pub(super) fn coerce_key(t: &TableMeta, key: &[SqlValue]) -> Result<Vec<SqlValue>> {
    if t.is_heap() {
        return Ok(key.to_vec());
    }
    if key.len() != t.key_cols.len() {
        return Err(SimError::BadArgument(format!(
            "a key of {} has {} values ({}), got {}",
            t.spec.name,
            t.key_cols.len(),
            t.unique_key().join(", "),
            key.len()
        )));
    }
    key.iter()
        .zip(&t.key_cols)
        .map(|(v, &i)| {
            let c = &t.spec.columns[i];
            coerce_value(v.clone(), &c.sql_type).map_err(|m| bad(t, c, m))
        })
        .collect()
}

pub(super) fn key_text(key: &[SqlValue]) -> String {
    format!("({})", key.iter().map(|v| v.canonical()).collect::<Vec<_>>().join(", "))
}

pub(super) fn is_constraint(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation)
}

pub(super) fn dup_key(t: &TableMeta, row: &[SqlValue]) -> Vec<SqlValue> {
    let cols = if t.key_cols.is_empty() { &t.uk_cols } else { &t.key_cols };
    cols.iter().map(|&i| row[i].clone()).collect()
}
