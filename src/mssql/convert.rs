//! tiberius values to [`SqlValue`]s and back (for bound parameters), and
//! catalog rows to [`SqlType`]s.
//!
//! Conversion is driven by the cell's [`ColumnData`] variant, with the
//! column's declared [`SqlType`] settling the few cases the wire leaves open
//! (money arrives as a float unless the statement casts it, which ours do).

use std::borrow::Cow;

use chrono::{DateTime, FixedOffset, NaiveDate, NaiveDateTime, NaiveTime};
use tiberius::numeric::Numeric;
use tiberius::{ColumnData, FromSql, Row, ToSql};

use crate::lsn::Lsn;
use crate::source::{ChangeRow, SourceError};
use crate::types::{SqlType, SqlValue};

fn conv<'a, T: FromSql<'a>>(d: &'a ColumnData<'static>) -> Result<Option<T>, String> {
    T::from_sql(d).map_err(|e| e.to_string())
}

fn opt<T>(v: Option<T>, f: impl FnOnce(T) -> SqlValue) -> SqlValue {
    v.map(f).unwrap_or(SqlValue::Null)
}

/// One cell as a value of the column's type.
pub fn column_value(data: &ColumnData<'static>, ty: &SqlType) -> Result<SqlValue, String> {
    Ok(match data {
        ColumnData::U8(v) => opt(*v, |x| SqlValue::Int(x as i64)),
        ColumnData::I16(v) => opt(*v, |x| SqlValue::Int(x as i64)),
        ColumnData::I32(v) => opt(*v, |x| SqlValue::Int(x as i64)),
        ColumnData::I64(v) => opt(*v, SqlValue::Int),
        ColumnData::Bit(v) => opt(*v, SqlValue::Bool),
        ColumnData::F32(v) => opt(*v, |x| SqlValue::Float(x as f64)),
        ColumnData::F64(v) => match ty {
            // money as the driver decodes it: exact to 4 places up to 2^53 / 10^4.
            SqlType::Money | SqlType::SmallMoney => opt(*v, |x| SqlValue::Decimal { value: (x * 1e4).round() as i128, scale: 4 }),
            _ => opt(*v, SqlValue::Float),
        },
        ColumnData::Numeric(v) => opt(*v, |n: Numeric| SqlValue::Decimal { value: n.value(), scale: n.scale() }),
        ColumnData::String(v) => opt(v.as_ref(), |s| SqlValue::Str(s.to_string())),
        ColumnData::Guid(v) => opt(*v, SqlValue::Guid),
        ColumnData::Binary(v) => opt(v.as_ref(), |b| SqlValue::Bytes(b.to_vec())),
        ColumnData::Xml(v) => opt(v.as_ref(), |x| SqlValue::Str(x.to_string())),
        ColumnData::DateTime(_) | ColumnData::SmallDateTime(_) | ColumnData::DateTime2(_) => {
            opt(conv::<NaiveDateTime>(data)?, SqlValue::DateTime)
        }
        ColumnData::Date(_) => opt(conv::<NaiveDate>(data)?, SqlValue::Date),
        ColumnData::Time(_) => opt(conv::<NaiveTime>(data)?, SqlValue::Time),
        // The wire holds the UTC instant and the offset; reading it as
        // DateTime<FixedOffset> keeps both right (the Utc reading shifts it twice).
        ColumnData::DateTimeOffset(_) => opt(conv::<DateTime<FixedOffset>>(data)?, SqlValue::DateTimeOffset),
    })
}

/// The cells `first..first + types.len()` of a row as values.
pub fn row_values(row: &Row, first: usize, types: &[SqlType]) -> Result<Vec<SqlValue>, SourceError> {
    let mut out = Vec::with_capacity(types.len());
    for (i, ty) in types.iter().enumerate() {
        let idx = first + i;
        let data = row.get_column_data(idx).map_err(|e| SourceError::Other(format!("result column {idx}: {e}")))?;
        let name = row.columns().get(idx).map(|c| c.name().to_string()).unwrap_or_default();
        out.push(column_value(data, ty).map_err(|e| SourceError::Other(format!("column '{name}' ({ty}): {e}")))?);
    }
    Ok(out)
}

/// A `binary(10)` cell as an LSN; None for NULL (and for the all-zero value when `zero_is_none`).
pub fn lsn_value(data: &ColumnData<'static>, zero_is_none: bool) -> Result<Option<Lsn>, SourceError> {
    match data {
        ColumnData::Binary(None) => Ok(None),
        ColumnData::Binary(Some(b)) => {
            let arr: [u8; 10] =
                b.as_ref().try_into().map_err(|_| SourceError::Other(format!("an LSN of {} bytes (expected 10)", b.len())))?;
            let l = Lsn(arr);
            Ok(if zero_is_none && l.is_zero() { None } else { Some(l) })
        }
        other => Err(SourceError::Other(format!("expected an LSN (binary(10)), got {other:?}"))),
    }
}

/// Cell `idx` of a row as an LSN.
pub fn row_lsn(row: &Row, idx: usize, zero_is_none: bool) -> Result<Option<Lsn>, SourceError> {
    let d = row.get_column_data(idx).map_err(|e| SourceError::Other(e.to_string()))?;
    lsn_value(d, zero_is_none)
}

/// Cell `idx` as an integer of any width.
pub fn row_i64(row: &Row, idx: usize) -> Result<Option<i64>, SourceError> {
    let d = row.get_column_data(idx).map_err(|e| SourceError::Other(e.to_string()))?;
    match column_value(d, &SqlType::BigInt).map_err(SourceError::Other)? {
        SqlValue::Null => Ok(None),
        SqlValue::Int(v) => Ok(Some(v)),
        SqlValue::Bool(b) => Ok(Some(b as i64)),
        SqlValue::Decimal { value, scale: 0 } => i64::try_from(value).map(Some).map_err(|_| SourceError::Other(format!("{value} is not a bigint"))),
        other => Err(SourceError::Other(format!("expected an integer in result column {idx}, got {other}"))),
    }
}

/// Cell `idx` as text.
pub fn row_str(row: &Row, idx: usize) -> Result<Option<String>, SourceError> {
    let d = row.get_column_data(idx).map_err(|e| SourceError::Other(e.to_string()))?;
    match column_value(d, &SqlType::NVarChar { len: None }).map_err(SourceError::Other)? {
        SqlValue::Null => Ok(None),
        SqlValue::Str(s) => Ok(Some(s)),
        other => Err(SourceError::Other(format!("expected text in result column {idx}, got {other}"))),
    }
}

/// A row of the changes statement: start LSN, seqval, operation, command id,
/// commit time, then the captured columns.
pub fn change_row(row: &Row, types: &[SqlType]) -> Result<ChangeRow, SourceError> {
    let missing = |what: &str| SourceError::Other(format!("a change row without {what}"));
    let start_lsn = row_lsn(row, 0, false)?.ok_or_else(|| missing("__$start_lsn"))?;
    let seqval = row_lsn(row, 1, false)?.ok_or_else(|| missing("__$seqval"))?;
    let operation = row_i64(row, 2)?.ok_or_else(|| missing("__$operation"))? as i32;
    let command_id = row_i64(row, 3)?.map(|v| v as i32);
    let t = row.get_column_data(4).map_err(|e| SourceError::Other(e.to_string()))?;
    let tran_end_time = match column_value(t, &SqlType::DateTime).map_err(SourceError::Other)? {
        SqlValue::DateTime(t) => Some(t),
        _ => None,
    };
    Ok(ChangeRow { start_lsn, seqval, operation, command_id, tran_end_time, values: row_values(row, 5, types)? })
}

/// The type of a column from its catalog entry (`sys.types.name` of the base
/// type, `max_length` in bytes with -1 for max, precision, scale).
pub fn sql_type_from_catalog(type_name: &str, max_length: i64, precision: i64, scale: i64) -> Result<SqlType, String> {
    let name = type_name.to_ascii_lowercase();
    let len = |divisor: i64| if max_length < 0 { None } else { Some((max_length / divisor) as u32) };
    let scale_u8 = scale.clamp(0, 7) as u8;
    Ok(match name.as_str() {
        "decimal" | "numeric" => SqlType::Decimal { precision: precision.clamp(1, 38) as u8, scale: scale.clamp(0, 38) as u8 },
        "char" => SqlType::Char { len: len(1).unwrap_or(1) },
        "varchar" => SqlType::VarChar { len: len(1) },
        "nchar" => SqlType::NChar { len: len(2).unwrap_or(1) },
        "nvarchar" => SqlType::NVarChar { len: len(2) },
        "binary" => SqlType::Binary { len: len(1).unwrap_or(1) },
        "varbinary" => SqlType::VarBinary { len: len(1) },
        "time" => SqlType::Time { scale: scale_u8 },
        "datetime2" => SqlType::DateTime2 { scale: scale_u8 },
        "datetimeoffset" => SqlType::DateTimeOffset { scale: scale_u8 },
        "sysname" => SqlType::NVarChar { len: Some(128) },
        other => SqlType::parse(other)?,
    })
}

/// A value bound as a statement parameter.
pub struct Bind<'a>(pub &'a SqlValue);

impl ToSql for Bind<'_> {
    fn to_sql(&self) -> ColumnData<'_> {
        match self.0 {
            SqlValue::Null => ColumnData::I32(None),
            SqlValue::Bool(b) => ColumnData::Bit(Some(*b)),
            SqlValue::Int(v) => ColumnData::I64(Some(*v)),
            SqlValue::Decimal { value, scale } => ColumnData::Numeric(Some(Numeric::new_with_scale(*value, (*scale).min(38)))),
            SqlValue::Float(f) => ColumnData::F64(Some(*f)),
            SqlValue::Str(s) => ColumnData::String(Some(Cow::Borrowed(s.as_str()))),
            SqlValue::Bytes(b) => ColumnData::Binary(Some(Cow::Borrowed(b.as_slice()))),
            SqlValue::Date(d) => d.to_sql(),
            SqlValue::Time(t) => t.to_sql(),
            SqlValue::DateTime(t) => t.to_sql(),
            SqlValue::DateTimeOffset(t) => t.to_sql(),
            SqlValue::Guid(g) => ColumnData::Guid(Some(*g)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{TimeZone, Timelike};
    use tiberius::time::{Date, DateTime as TdsDateTime, DateTime2, DateTimeOffset, SmallDateTime, Time};
    use tiberius::xml::XmlData;
    use tiberius::ColumnType;
    use uuid::Uuid;

    fn days_since_year_1(d: NaiveDate) -> u32 {
        (d - NaiveDate::from_ymd_opt(1, 1, 1).unwrap()).num_days() as u32
    }

    fn v(d: ColumnData<'static>, t: SqlType) -> SqlValue {
        column_value(&d, &t).unwrap()
    }

    #[test]
    fn integers_bits_and_floats() {
        assert_eq!(v(ColumnData::U8(Some(255)), SqlType::TinyInt), SqlValue::Int(255));
        assert_eq!(v(ColumnData::I16(Some(-32768)), SqlType::SmallInt), SqlValue::Int(-32768));
        assert_eq!(v(ColumnData::I32(Some(i32::MAX)), SqlType::Int), SqlValue::Int(i32::MAX as i64));
        assert_eq!(v(ColumnData::I64(Some(i64::MIN)), SqlType::BigInt), SqlValue::Int(i64::MIN));
        assert_eq!(v(ColumnData::I64(None), SqlType::BigInt), SqlValue::Null);
        assert_eq!(v(ColumnData::Bit(Some(true)), SqlType::Bit), SqlValue::Bool(true));
        assert_eq!(v(ColumnData::F64(Some(1.5e300)), SqlType::Float), SqlValue::Float(1.5e300));
        assert_eq!(v(ColumnData::F32(Some(0.25)), SqlType::Real), SqlValue::Float(0.25));
    }

    #[test]
    fn decimals_to_38_digits_and_money() {
        let big = 99_999_999_999_999_999_999_999_999_999_999_999_999i128; // 38 nines
        assert_eq!(
            v(ColumnData::Numeric(Some(Numeric::new_with_scale(big, 10))), SqlType::Decimal { precision: 38, scale: 10 }),
            SqlValue::Decimal { value: big, scale: 10 }
        );
        assert_eq!(
            v(ColumnData::Numeric(Some(Numeric::new_with_scale(-big, 0))), SqlType::Decimal { precision: 38, scale: 0 }),
            SqlValue::Decimal { value: -big, scale: 0 }
        );
        // money as the statements read it (cast to decimal(19,4)), and as the driver decodes it bare.
        let max_money = 9_223_372_036_854_775_807i128;
        assert_eq!(
            v(ColumnData::Numeric(Some(Numeric::new_with_scale(max_money, 4))), SqlType::Money),
            SqlValue::Decimal { value: max_money, scale: 4 }
        );
        assert_eq!(v(ColumnData::F64(Some(-214748.3648)), SqlType::SmallMoney), SqlValue::Decimal { value: -2147483648, scale: 4 });
        assert_eq!(v(ColumnData::F64(Some(12.34)), SqlType::Money), SqlValue::Decimal { value: 123400, scale: 4 });
    }

    #[test]
    fn strings_binaries_guids_xml() {
        assert_eq!(v(ColumnData::String(Some("Ünï ".into())), SqlType::NChar { len: 4 }), SqlValue::Str("Ünï ".into()));
        let long = "x".repeat(100_000);
        assert_eq!(v(ColumnData::String(Some(long.clone().into())), SqlType::VarChar { len: None }), SqlValue::Str(long));
        assert_eq!(v(ColumnData::String(None), SqlType::NVarChar { len: None }), SqlValue::Null);
        assert_eq!(v(ColumnData::Binary(Some(vec![0u8, 255].into())), SqlType::VarBinary { len: Some(2) }), SqlValue::Bytes(vec![0, 255]));
        let rv = vec![0, 0, 0, 0, 0, 0, 7, 209u8];
        assert_eq!(v(ColumnData::Binary(Some(rv.clone().into())), SqlType::Timestamp), SqlValue::Bytes(rv));
        let g = Uuid::parse_str("6F9619FF-8B86-D011-B42D-00C04FC964FF").unwrap();
        assert_eq!(v(ColumnData::Guid(Some(g)), SqlType::UniqueIdentifier), SqlValue::Guid(g));
        let x = XmlData::new("<a b=\"1\">é</a>");
        assert_eq!(v(ColumnData::Xml(Some(Cow::Owned(x))), SqlType::Xml), SqlValue::Str("<a b=\"1\">é</a>".into()));
    }

    #[test]
    fn dates_and_times() {
        let d = NaiveDate::from_ymd_opt(2026, 3, 8).unwrap();
        assert_eq!(v(ColumnData::Date(Some(Date::new(days_since_year_1(d)))), SqlType::Date), SqlValue::Date(d));
        // time(7): 100 ns increments kept.
        let inc = (13 * 3600 + 14 * 60 + 15) as u64 * 10_000_000 + 1_234_567;
        let t = v(ColumnData::Time(Some(Time::new(inc, 7))), SqlType::Time { scale: 7 });
        assert_eq!(t, SqlValue::Time(NaiveTime::from_hms_nano_opt(13, 14, 15, 123_456_700).unwrap()));
        // time(3)
        let t3 = v(ColumnData::Time(Some(Time::new(1_500, 3))), SqlType::Time { scale: 3 });
        assert_eq!(t3, SqlValue::Time(NaiveTime::from_hms_milli_opt(0, 0, 1, 500).unwrap()));
        // datetime: days since 1900, 1/300 s ticks (150 ticks = .5 s).
        let days1900 = (d - NaiveDate::from_ymd_opt(1900, 1, 1).unwrap()).num_days() as i32;
        let dt = v(ColumnData::DateTime(Some(TdsDateTime::new(days1900, 3600 * 300 + 150))), SqlType::DateTime);
        assert_eq!(dt, SqlValue::DateTime(d.and_hms_milli_opt(1, 0, 0, 500).unwrap()));
        // smalldatetime: minutes.
        let sdt = v(ColumnData::SmallDateTime(Some(SmallDateTime::new(days1900 as u16, 61))), SqlType::SmallDateTime);
        assert_eq!(sdt, SqlValue::DateTime(d.and_hms_opt(1, 1, 0).unwrap()));
        // datetime2(7) keeps 100 ns; datetime2(0) whole seconds.
        for (scale, inc, nanos) in [(7u8, 10_000_000u64 * 59 + 9_999_999, 999_999_900u32), (0, 59, 0)] {
            let dt2 = DateTime2::new(Date::new(days_since_year_1(d)), Time::new(inc, scale));
            match v(ColumnData::DateTime2(Some(dt2)), SqlType::DateTime2 { scale }) {
                SqlValue::DateTime(t) => {
                    assert_eq!(t.date(), d);
                    assert_eq!(t.second(), 59);
                    assert_eq!(t.nanosecond(), nanos);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn datetimeoffset_keeps_instant_and_offset() {
        // 2026-03-08 10:00:00 UTC, shown at +05:30: the wire holds the UTC time and the offset in minutes.
        let d = NaiveDate::from_ymd_opt(2026, 3, 8).unwrap();
        let dto = DateTimeOffset::new(DateTime2::new(Date::new(days_since_year_1(d)), Time::new(10 * 3600 * 10_000_000, 7)), 330);
        let got = v(ColumnData::DateTimeOffset(Some(dto)), SqlType::DateTimeOffset { scale: 7 });
        let off = FixedOffset::east_opt(330 * 60).unwrap();
        let want = off.with_ymd_and_hms(2026, 3, 8, 15, 30, 0).unwrap();
        assert_eq!(got, SqlValue::DateTimeOffset(want));
        if let SqlValue::DateTimeOffset(t) = got {
            assert_eq!(t.naive_utc(), d.and_hms_opt(10, 0, 0).unwrap());
            assert_eq!(t.offset().local_minus_utc(), 330 * 60);
        }
    }

    #[test]
    fn change_rows_from_tiberius_rows() {
        let l1 = Lsn::from_parts(1, 2, 3);
        let l2 = Lsn::from_parts(1, 2, 4);
        let t = NaiveDate::from_ymd_opt(2026, 1, 2).unwrap();
        let days1900 = (t - NaiveDate::from_ymd_opt(1900, 1, 1).unwrap()).num_days() as i32;
        let row = Row::builder()
            .column("__$start_lsn", ColumnType::BigBinary, ColumnData::Binary(Some(l1.0.to_vec().into())))
            .column("__$seqval", ColumnType::BigBinary, ColumnData::Binary(Some(l2.0.to_vec().into())))
            .column("__$operation", ColumnType::Int4, ColumnData::I32(Some(2)))
            .column("__$command_id", ColumnType::Int4, ColumnData::I32(None))
            .column("__$tran_end_time", ColumnType::Datetime, ColumnData::DateTime(Some(TdsDateTime::new(days1900, 300))))
            .column("id", ColumnType::Int4, ColumnData::I32(Some(7)))
            .column("name", ColumnType::NVarchar, ColumnData::String(Some("seven".into())))
            .build();
        let r = change_row(&row, &[SqlType::Int, SqlType::NVarChar { len: Some(10) }]).unwrap();
        assert_eq!(r.start_lsn, l1);
        assert_eq!(r.seqval, l2);
        assert_eq!(r.operation, 2);
        assert_eq!(r.command_id, None);
        assert_eq!(r.tran_end_time, Some(t.and_hms_opt(0, 0, 1).unwrap()));
        assert_eq!(r.values, vec![SqlValue::Int(7), SqlValue::Str("seven".into())]);
        // A short LSN is an error, not a panic.
        let bad = Row::builder().column("l", ColumnType::BigBinary, ColumnData::Binary(Some(vec![1u8, 2].into()))).build();
        assert!(row_lsn(&bad, 0, false).is_err());
        let zero = Row::builder().column("l", ColumnType::BigBinary, ColumnData::Binary(Some(vec![0u8; 10].into()))).build();
        assert_eq!(row_lsn(&zero, 0, true).unwrap(), None);
    }

    #[test]
    fn catalog_types() {
        assert_eq!(sql_type_from_catalog("nvarchar", -1, 0, 0).unwrap(), SqlType::NVarChar { len: None });
        assert_eq!(sql_type_from_catalog("nvarchar", 80, 0, 0).unwrap(), SqlType::NVarChar { len: Some(40) });
        assert_eq!(sql_type_from_catalog("nchar", 20, 0, 0).unwrap(), SqlType::NChar { len: 10 });
        assert_eq!(sql_type_from_catalog("varbinary", -1, 0, 0).unwrap(), SqlType::VarBinary { len: None });
        assert_eq!(sql_type_from_catalog("decimal", 17, 38, 6).unwrap(), SqlType::Decimal { precision: 38, scale: 6 });
        assert_eq!(sql_type_from_catalog("datetime2", 8, 27, 7).unwrap(), SqlType::DateTime2 { scale: 7 });
        assert_eq!(sql_type_from_catalog("datetimeoffset", 10, 34, 3).unwrap(), SqlType::DateTimeOffset { scale: 3 });
        assert_eq!(sql_type_from_catalog("time", 5, 16, 0).unwrap(), SqlType::Time { scale: 0 });
        assert_eq!(sql_type_from_catalog("timestamp", 8, 0, 0).unwrap(), SqlType::Timestamp);
        assert_eq!(sql_type_from_catalog("money", 8, 19, 4).unwrap(), SqlType::Money);
        assert!(sql_type_from_catalog("geography", -1, 0, 0).is_err());
    }

    #[test]
    fn parameters_bind_as_their_wire_types() {
        assert!(matches!(Bind(&SqlValue::Int(5)).to_sql(), ColumnData::I64(Some(5))));
        assert!(matches!(Bind(&SqlValue::Str("a".into())).to_sql(), ColumnData::String(Some(_))));
        assert!(matches!(Bind(&SqlValue::Bytes(vec![1])).to_sql(), ColumnData::Binary(Some(_))));
        match Bind(&SqlValue::Decimal { value: -12345, scale: 2 }).to_sql() {
            ColumnData::Numeric(Some(n)) => assert_eq!((n.value(), n.scale()), (-12345, 2)),
            other => panic!("{other:?}"),
        }
        let t = NaiveDate::from_ymd_opt(2026, 3, 8).unwrap().and_hms_nano_opt(1, 2, 3, 100).unwrap();
        assert!(matches!(Bind(&SqlValue::DateTime(t)).to_sql(), ColumnData::DateTime2(Some(_))));
    }

    /// Every capturable type, from a tiberius row through `row_values` into
    /// the Arrow batch bronze writes, and back out equal to what was read.
    #[test]
    fn every_type_reaches_arrow() {
        use crate::types::{as_stored, value_at, BatchBuilder, ColumnDesc};
        let d = NaiveDate::from_ymd_opt(2026, 3, 8).unwrap();
        let day1 = Date::new(days_since_year_1(d));
        let days1900 = (d - NaiveDate::from_ymd_opt(1900, 1, 1).unwrap()).num_days() as i32;
        let g = Uuid::parse_str("6F9619FF-8B86-D011-B42D-00C04FC964FF").unwrap();
        let cells: Vec<(SqlType, ColumnType, ColumnData<'static>)> = vec![
            (SqlType::TinyInt, ColumnType::Int1, ColumnData::U8(Some(200))),
            (SqlType::SmallInt, ColumnType::Int2, ColumnData::I16(Some(-7))),
            (SqlType::Int, ColumnType::Int4, ColumnData::I32(Some(7))),
            (SqlType::BigInt, ColumnType::Int8, ColumnData::I64(Some(i64::MAX))),
            (SqlType::Bit, ColumnType::Bitn, ColumnData::Bit(Some(false))),
            (SqlType::Decimal { precision: 38, scale: 0 }, ColumnType::Decimaln, ColumnData::Numeric(Some(Numeric::new_with_scale(-(10i128.pow(37)), 0)))),
            (SqlType::Money, ColumnType::Decimaln, ColumnData::Numeric(Some(Numeric::new_with_scale(-9_223_372_036_854_775_808, 4)))),
            (SqlType::SmallMoney, ColumnType::Decimaln, ColumnData::Numeric(Some(Numeric::new_with_scale(2_147_483_647, 4)))),
            (SqlType::Float, ColumnType::Floatn, ColumnData::F64(Some(-0.5))),
            (SqlType::Real, ColumnType::Floatn, ColumnData::F32(Some(3.25))),
            (SqlType::Char { len: 3 }, ColumnType::BigChar, ColumnData::String(Some("ab ".into()))),
            (SqlType::VarChar { len: None }, ColumnType::BigVarChar, ColumnData::String(Some("long".into()))),
            (SqlType::NChar { len: 2 }, ColumnType::NChar, ColumnData::String(Some("éü".into()))),
            (SqlType::NVarChar { len: Some(10) }, ColumnType::NVarchar, ColumnData::String(Some("日本".into()))),
            (SqlType::Binary { len: 2 }, ColumnType::BigBinary, ColumnData::Binary(Some(vec![1u8, 2].into()))),
            (SqlType::VarBinary { len: None }, ColumnType::BigVarBin, ColumnData::Binary(Some(vec![3u8; 9000].into()))),
            (SqlType::Timestamp, ColumnType::BigBinary, ColumnData::Binary(Some(vec![0u8, 0, 0, 0, 0, 0, 0, 9].into()))),
            (SqlType::Date, ColumnType::Daten, ColumnData::Date(Some(day1))),
            (SqlType::DateTime, ColumnType::Datetimen, ColumnData::DateTime(Some(TdsDateTime::new(days1900, 1)))),
            (SqlType::SmallDateTime, ColumnType::Datetimen, ColumnData::SmallDateTime(Some(SmallDateTime::new(days1900 as u16, 1439)))),
            (SqlType::DateTime2 { scale: 7 }, ColumnType::Datetime2, ColumnData::DateTime2(Some(DateTime2::new(day1, Time::new(1, 7))))),
            (SqlType::DateTimeOffset { scale: 7 }, ColumnType::DatetimeOffsetn, ColumnData::DateTimeOffset(Some(DateTimeOffset::new(DateTime2::new(day1, Time::new(0, 7)), -300)))),
            (SqlType::UniqueIdentifier, ColumnType::Guid, ColumnData::Guid(Some(g))),
            (SqlType::Xml, ColumnType::Xml, ColumnData::Xml(Some(Cow::Owned(XmlData::new("<x/>"))))),
            (SqlType::NVarChar { len: None }, ColumnType::NVarchar, ColumnData::String(None)),
            // 01:02:03.1234567 in 100 ns increments.
            (SqlType::Time { scale: 7 }, ColumnType::Timen, ColumnData::Time(Some(Time::new(37_231_234_567, 7)))),
        ];
        let mut b = Row::builder();
        let mut cols = Vec::new();
        for (i, (t, ct, data)) in cells.iter().enumerate() {
            b = b.column(format!("c{i}"), *ct, data.clone());
            cols.push(ColumnDesc::new(format!("c{i}"), t.clone(), true));
        }
        let row = b.build();
        let types: Vec<SqlType> = cols.iter().map(|c| c.sql_type.clone()).collect();
        let values = row_values(&row, 0, &types).unwrap();
        for (i, c) in cols.iter().enumerate() {
            let mut one = BatchBuilder::new(std::slice::from_ref(c));
            assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| one.push(&values[i..i + 1]).is_ok())).unwrap_or(false), "column {} ({}) refuses {:?}", c.name, c.sql_type, values[i]);
        }
        let mut bb = BatchBuilder::new(&cols);
        bb.push(&values).unwrap_or_else(|e| panic!("{e}"));
        let batch = bb.finish();
        for (i, c) in cols.iter().enumerate() {
            assert_eq!(value_at(batch.column(i).as_ref(), 0, &c.sql_type), as_stored(&values[i], &c.sql_type), "column {} ({})", c.name, c.sql_type);
        }
        assert_eq!(values[24], SqlValue::Null);
        if let SqlValue::DateTimeOffset(t) = &values[21] {
            assert_eq!(t.offset().local_minus_utc(), -300 * 60);
            assert_eq!(t.naive_utc(), d.and_hms_opt(0, 0, 0).unwrap());
        } else {
            panic!("{:?}", values[21]);
        }
    }
}
