//! SQL Server column types, values, their order, and their Arrow form.
//!
//! Both sources (the simulator and the tiberius client) describe columns with
//! [`SqlType`] and produce values as [`SqlValue`]; [`BatchBuilder`] turns rows of
//! values into Arrow batches with the one mapping below, so bronze has the same
//! schema whichever source filled it. [`value_at`] reads a value back out of
//! an Arrow array (rebuilds, reconcile, golden logs).
//!
//! | SQL Server | Arrow / Delta | why |
//! |---|---|---|
//! | tinyint | Int16 | Delta has no unsigned byte; 0..255 does not fit i8 |
//! | smallint, int, bigint | Int16, Int32, Int64 | |
//! | bit | Boolean | |
//! | decimal(p,s), numeric(p,s) | Decimal128(p,s) | exact, 38 digits |
//! | money, smallmoney | Decimal128(19,4), Decimal128(10,4) | exact |
//! | float, real | Float64, Float32 | |
//! | char, varchar, nchar, nvarchar, text, ntext, xml | Utf8 | |
//! | binary, varbinary, image, timestamp/rowversion | Binary | |
//! | date | Date32 | |
//! | time(n) | Utf8 `HH:MM:SS.fffffff` | Delta has no time type |
//! | datetime, smalldatetime, datetime2(n) | Timestamp(µs) without zone (timestamp_ntz) | Delta keeps microseconds; datetime2(7) is truncated to the µs, as the seeds' drivers do |
//! | datetimeoffset(n) | Timestamp(µs, UTC) | the instant; the offset is not kept |
//! | uniqueidentifier | Utf8, upper-case canonical text | |

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use chrono::{DateTime, FixedOffset, NaiveDate, NaiveDateTime, NaiveTime, Timelike};
use deltalake::arrow::array::{
    Array, ArrayRef, BinaryArray, BinaryBuilder, BooleanArray, BooleanBuilder, Date32Array,
    Date32Builder, Decimal128Array, Decimal128Builder, Float32Array, Float32Builder,
    Float64Array, Float64Builder, Int16Array, Int16Builder, Int32Array, Int32Builder,
    Int64Array, Int64Builder, StringArray, StringBuilder, TimestampMicrosecondArray,
    TimestampMicrosecondBuilder,
};
use deltalake::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A SQL Server column type, as CDC captures it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SqlType {
    TinyInt,
    SmallInt,
    Int,
    BigInt,
    Bit,
    Decimal { precision: u8, scale: u8 },
    Money,
    SmallMoney,
    Float,
    Real,
    /// char(n); `len` in characters.
    Char { len: u32 },
    /// varchar(n); `None` is varchar(max).
    VarChar { len: Option<u32> },
    NChar { len: u32 },
    NVarChar { len: Option<u32> },
    Text,
    NText,
    Binary { len: u32 },
    VarBinary { len: Option<u32> },
    Image,
    Date,
    Time { scale: u8 },
    DateTime,
    SmallDateTime,
    DateTime2 { scale: u8 },
    DateTimeOffset { scale: u8 },
    UniqueIdentifier,
    Xml,
    /// timestamp / rowversion, captured as binary(8).
    Timestamp,
}

impl SqlType {
    /// Parses a T-SQL type name such as `int`, `decimal(18,2)`, `nvarchar(max)`, `datetime2(7)`.
    pub fn parse(text: &str) -> Result<SqlType, String> {
        let t = text.trim().to_ascii_lowercase();
        let (name, args) = match t.find('(') {
            Some(i) if t.ends_with(')') => (t[..i].trim().to_string(), Some(t[i + 1..t.len() - 1].to_string())),
            Some(_) => return Err(format!("'{text}' is not a type: unbalanced parentheses")),
            None => (t.clone(), None),
        };
        let nums = |a: &Option<String>| -> Result<Vec<Option<u32>>, String> {
            match a {
                None => Ok(vec![]),
                Some(a) => a
                    .split(',')
                    .map(|p| {
                        let p = p.trim();
                        if p == "max" {
                            Ok(None)
                        } else {
                            p.parse::<u32>().map(Some).map_err(|_| format!("'{text}': '{p}' is not a length"))
                        }
                    })
                    .collect(),
            }
        };
        let n = nums(&args)?;
        let len_or = |d: u32| n.first().copied().flatten().unwrap_or(d);
        let var_len = || if n.is_empty() { Some(1) } else { n[0] };
        let scale_or = |d: u8| n.first().copied().flatten().map(|v| v as u8).unwrap_or(d);
        Ok(match name.as_str() {
            "tinyint" => SqlType::TinyInt,
            "smallint" => SqlType::SmallInt,
            "int" | "integer" => SqlType::Int,
            "bigint" => SqlType::BigInt,
            "bit" => SqlType::Bit,
            "decimal" | "numeric" => {
                let p = n.first().copied().flatten().unwrap_or(18);
                let s = n.get(1).copied().flatten().unwrap_or(0);
                if p == 0 || p > 38 || s > p {
                    return Err(format!("'{text}': precision must be 1..38 and scale at most the precision"));
                }
                SqlType::Decimal { precision: p as u8, scale: s as u8 }
            }
            "money" => SqlType::Money,
            "smallmoney" => SqlType::SmallMoney,
            "float" => SqlType::Float,
            "real" => SqlType::Real,
            "char" => SqlType::Char { len: len_or(1) },
            "varchar" => SqlType::VarChar { len: var_len() },
            "nchar" => SqlType::NChar { len: len_or(1) },
            "nvarchar" => SqlType::NVarChar { len: var_len() },
            "text" => SqlType::Text,
            "ntext" => SqlType::NText,
            "binary" => SqlType::Binary { len: len_or(1) },
            "varbinary" => SqlType::VarBinary { len: var_len() },
            "image" => SqlType::Image,
            "date" => SqlType::Date,
            "time" => SqlType::Time { scale: scale_or(7) },
            "datetime" => SqlType::DateTime,
            "smalldatetime" => SqlType::SmallDateTime,
            "datetime2" => SqlType::DateTime2 { scale: scale_or(7) },
            "datetimeoffset" => SqlType::DateTimeOffset { scale: scale_or(7) },
            "uniqueidentifier" => SqlType::UniqueIdentifier,
            "xml" => SqlType::Xml,
            "timestamp" | "rowversion" => SqlType::Timestamp,
            other => return Err(format!("'{other}' is not a SQL Server type this program knows")),
        })
    }

    /// The Arrow type bronze stores this SQL type as (see the module table).
    pub fn arrow_type(&self) -> DataType {
        match self {
            SqlType::TinyInt | SqlType::SmallInt => DataType::Int16,
            SqlType::Int => DataType::Int32,
            SqlType::BigInt => DataType::Int64,
            SqlType::Bit => DataType::Boolean,
            SqlType::Decimal { precision, scale } => DataType::Decimal128(*precision, *scale as i8),
            SqlType::Money => DataType::Decimal128(19, 4),
            SqlType::SmallMoney => DataType::Decimal128(10, 4),
            SqlType::Float => DataType::Float64,
            SqlType::Real => DataType::Float32,
            SqlType::Char { .. }
            | SqlType::VarChar { .. }
            | SqlType::NChar { .. }
            | SqlType::NVarChar { .. }
            | SqlType::Text
            | SqlType::NText
            | SqlType::Xml
            | SqlType::Time { .. }
            | SqlType::UniqueIdentifier => DataType::Utf8,
            SqlType::Binary { .. } | SqlType::VarBinary { .. } | SqlType::Image | SqlType::Timestamp => DataType::Binary,
            SqlType::Date => DataType::Date32,
            SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. } => {
                DataType::Timestamp(TimeUnit::Microsecond, None)
            }
            SqlType::DateTimeOffset { .. } => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        }
    }

    /// True for the string types, which compare under the column's collation.
    pub fn is_string(&self) -> bool {
        matches!(
            self,
            SqlType::Char { .. } | SqlType::VarChar { .. } | SqlType::NChar { .. } | SqlType::NVarChar { .. } | SqlType::Text | SqlType::NText
        )
    }

    /// True for the integer types (tinyint..bigint), which the integer plan counts by slices.
    pub fn is_integer(&self) -> bool {
        matches!(self, SqlType::TinyInt | SqlType::SmallInt | SqlType::Int | SqlType::BigInt)
    }

    /// Why two values of this type can compare equal on the server while
    /// their bytes differ, if they can. An update from one such spelling to
    /// another is an update of the same key to SQL Server (logged as 3 and
    /// 4, not as a delete and an insert), so without the before-image the
    /// spelling silver holds is named nowhere. `binary(n)` and `char(n)` pad
    /// every value to n, so only their case or accents can differ (char is a
    /// string anyway).
    pub fn equal_respellings(&self) -> Option<&'static str> {
        match self {
            t if t.is_string() => Some("its collation equates spellings (case, accents, width, trailing spaces)"),
            SqlType::VarBinary { .. } => Some("varbinary values that differ in trailing zero bytes compare equal"),
            SqlType::Float | SqlType::Real => Some("a float 0 and -0 compare equal"),
            _ => None,
        }
    }

    /// Why a value of this type does not come back equal from a Delta
    /// column, if it does not: `datetime2(7)` and `datetimeoffset(7)` count
    /// 100 ns ticks, and Delta's timestamps hold microseconds, so two values
    /// 100 ns apart become one. (`time(7)` is kept as exact text.)
    pub fn inexact_in_delta(&self) -> Option<&'static str> {
        match self {
            SqlType::DateTime2 { scale: 7 } => Some("datetime2(7) counts 100 ns ticks and Delta timestamps hold microseconds"),
            SqlType::DateTimeOffset { scale: 7 } => {
                Some("datetimeoffset(7) counts 100 ns ticks and Delta timestamps hold microseconds")
            }
            _ => None,
        }
    }

    /// Why SQL Server cannot order or bound a chunk on this type, if it cannot.
    pub fn unorderable_reason(&self) -> Option<&'static str> {
        match self {
            SqlType::Bit => Some("bit has no MIN or MAX"),
            SqlType::Text | SqlType::NText | SqlType::Image | SqlType::Xml => Some("SQL Server cannot ORDER BY text, ntext, image or xml"),
            _ => None,
        }
    }

    /// The T-SQL spelling of the type (`decimal(18,2)`, `nvarchar(max)`).
    pub fn sql_name(&self) -> String {
        let l = |len: &Option<u32>| len.map(|v| v.to_string()).unwrap_or_else(|| "max".into());
        match self {
            SqlType::TinyInt => "tinyint".into(),
            SqlType::SmallInt => "smallint".into(),
            SqlType::Int => "int".into(),
            SqlType::BigInt => "bigint".into(),
            SqlType::Bit => "bit".into(),
            SqlType::Decimal { precision, scale } => format!("decimal({precision},{scale})"),
            SqlType::Money => "money".into(),
            SqlType::SmallMoney => "smallmoney".into(),
            SqlType::Float => "float".into(),
            SqlType::Real => "real".into(),
            SqlType::Char { len } => format!("char({len})"),
            SqlType::VarChar { len } => format!("varchar({})", l(len)),
            SqlType::NChar { len } => format!("nchar({len})"),
            SqlType::NVarChar { len } => format!("nvarchar({})", l(len)),
            SqlType::Text => "text".into(),
            SqlType::NText => "ntext".into(),
            SqlType::Binary { len } => format!("binary({len})"),
            SqlType::VarBinary { len } => format!("varbinary({})", l(len)),
            SqlType::Image => "image".into(),
            SqlType::Date => "date".into(),
            SqlType::Time { scale } => format!("time({scale})"),
            SqlType::DateTime => "datetime".into(),
            SqlType::SmallDateTime => "smalldatetime".into(),
            SqlType::DateTime2 { scale } => format!("datetime2({scale})"),
            SqlType::DateTimeOffset { scale } => format!("datetimeoffset({scale})"),
            SqlType::UniqueIdentifier => "uniqueidentifier".into(),
            SqlType::Xml => "xml".into(),
            SqlType::Timestamp => "timestamp".into(),
        }
    }
}

impl fmt::Display for SqlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.sql_name())
    }
}

/// A column of a source table or capture instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnDesc {
    pub name: String,
    pub sql_type: SqlType,
    pub nullable: bool,
}

impl ColumnDesc {
    pub fn new(name: impl Into<String>, sql_type: SqlType, nullable: bool) -> Self {
        ColumnDesc { name: name.into(), sql_type, nullable }
    }

    /// The Arrow field bronze stores this column as. Always nullable: a snapshot
    /// reads a dropped column as NULL and CDC nulls LOBs on deletes.
    pub fn arrow_field(&self) -> Field {
        Field::new(&self.name, self.sql_type.arrow_type(), true)
    }
}

/// The Arrow schema of rows of these columns.
pub fn arrow_schema(columns: &[ColumnDesc]) -> SchemaRef {
    Arc::new(Schema::new(columns.iter().map(|c| c.arrow_field()).collect::<Vec<_>>()))
}

/// One SQL Server value. Integers of every width are `Int`; datetime, smalldatetime
/// and datetime2 are `DateTime` (local, no zone), at the precision the source gave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", content = "v", rename_all = "snake_case")]
pub enum SqlValue {
    Null,
    Bool(bool),
    Int(i64),
    /// An exact decimal: `value / 10^scale`.
    Decimal { value: i128, scale: u8 },
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Date(NaiveDate),
    Time(NaiveTime),
    DateTime(NaiveDateTime),
    DateTimeOffset(DateTime<FixedOffset>),
    Guid(Uuid),
}

/// A key: the values of the key columns of one row, in key order.
pub type Key = Vec<SqlValue>;

impl SqlValue {
    pub fn is_null(&self) -> bool {
        matches!(self, SqlValue::Null)
    }

    /// The integer, if this is one.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            SqlValue::Int(v) => Some(*v),
            _ => None,
        }
    }

    /// A canonical text form: equal under SQL Server's comparison rules for the
    /// given type gives equal text for everything but strings and binary
    /// values, which keep their exact form (collations are the server's). Used
    /// for hashing and diffs.
    pub fn canonical(&self) -> String {
        match self {
            SqlValue::Null => "null".into(),
            SqlValue::Bool(b) => (if *b { "1" } else { "0" }).into(),
            SqlValue::Int(v) => v.to_string(),
            SqlValue::Decimal { value, scale } => format_decimal(*value, *scale),
            SqlValue::Float(f) => format!("{f:?}"),
            SqlValue::Str(s) => serde_json::to_string(s).unwrap_or_default(),
            SqlValue::Bytes(b) => format!("0x{}", hex::encode(b)),
            SqlValue::Date(d) => d.format("%Y-%m-%d").to_string(),
            SqlValue::Time(t) => t.format("%H:%M:%S%.f").to_string(),
            SqlValue::DateTime(t) => t.format("%Y-%m-%dT%H:%M:%S%.f").to_string(),
            SqlValue::DateTimeOffset(t) => t.to_rfc3339(),
            SqlValue::Guid(g) => g.to_string().to_uppercase(),
        }
    }
}

impl fmt::Display for SqlValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical())
    }
}

/// Formats `value / 10^scale` exactly.
pub fn format_decimal(value: i128, scale: u8) -> String {
    if scale == 0 {
        return value.to_string();
    }
    let neg = value < 0;
    let digits = value.unsigned_abs().to_string();
    let scale = scale as usize;
    let padded = if digits.len() <= scale { format!("{}{}", "0".repeat(scale - digits.len() + 1), digits) } else { digits };
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{}{}.{}", if neg { "-" } else { "" }, int, frac)
}

/// The bytes of a uniqueidentifier in the order SQL Server sorts them: the last
/// six bytes first, then bytes 8-9, 6-7, 4-5, 0-3 (each group as stored).
pub fn guid_sort_key(g: &Uuid) -> [u8; 16] {
    // SQL Server stores the first three groups little-endian; uuid's bytes are the text order.
    let b = g.as_bytes();
    let stored: [u8; 16] = [b[3], b[2], b[1], b[0], b[5], b[4], b[7], b[6], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]];
    let order = [10usize, 11, 12, 13, 14, 15, 8, 9, 6, 7, 4, 5, 0, 1, 2, 3];
    let mut out = [0u8; 16];
    for (i, &o) in order.iter().enumerate() {
        out[i] = stored[o];
    }
    out
}

/// Compares two values by value, as SQL Server's ORDER BY does for every type
/// but strings: NULL first, uniqueidentifier in SQL Server's byte order,
/// decimals exactly whatever their scales, binary values as if the shorter
/// were padded with 0x00 (so `0x01` equals `0x0100`, as the server has it).
///
/// Strings compare by code point with trailing spaces ignored: the order of a
/// `_BIN2` nvarchar column, and of no other collation. The engine never uses
/// it to decide about a source column's strings (linguistic order, case,
/// accent and width rules are the server's: `CdcSource::compare_keys`); it
/// keeps the function total for in-memory tests and for values that are not
/// keys.
pub fn sql_cmp(a: &SqlValue, b: &SqlValue) -> Ordering {
    use SqlValue::*;
    match (a, b) {
        (Null, Null) => Ordering::Equal,
        (Null, _) => Ordering::Less,
        (_, Null) => Ordering::Greater,
        (Bool(x), Bool(y)) => x.cmp(y),
        (Int(x), Int(y)) => x.cmp(y),
        (Decimal { value: x, scale: sx }, Decimal { value: y, scale: sy }) => cmp_decimal(*x, *sx, *y, *sy),
        (Int(x), Decimal { value, scale }) => cmp_decimal(*x as i128, 0, *value, *scale),
        (Decimal { value, scale }, Int(y)) => cmp_decimal(*value, *scale, *y as i128, 0),
        (Float(x), Float(y)) => x.total_cmp(y),
        (Str(x), Str(y)) => x.trim_end_matches(' ').cmp(y.trim_end_matches(' ')),
        (Bytes(x), Bytes(y)) => trim_zeros(x).cmp(trim_zeros(y)),
        (Date(x), Date(y)) => x.cmp(y),
        (Time(x), Time(y)) => x.cmp(y),
        (DateTime(x), DateTime(y)) => x.cmp(y),
        (DateTimeOffset(x), DateTimeOffset(y)) => x.cmp(y),
        (Guid(x), Guid(y)) => guid_sort_key(x).cmp(&guid_sort_key(y)),
        // Values of different kinds never meet in one column; order by kind so the
        // function stays total.
        _ => kind_rank(a).cmp(&kind_rank(b)),
    }
}

/// A binary value without its trailing 0x00 bytes: comparing these is
/// comparing the values padded to one length with 0x00 (0x00 is the least byte).
fn trim_zeros(b: &[u8]) -> &[u8] {
    &b[..b.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1)]
}

fn kind_rank(v: &SqlValue) -> u8 {
    match v {
        SqlValue::Null => 0,
        SqlValue::Bool(_) => 1,
        SqlValue::Int(_) | SqlValue::Decimal { .. } => 2,
        SqlValue::Float(_) => 3,
        SqlValue::Str(_) => 4,
        SqlValue::Bytes(_) => 5,
        SqlValue::Date(_) => 6,
        SqlValue::Time(_) => 7,
        SqlValue::DateTime(_) => 8,
        SqlValue::DateTimeOffset(_) => 9,
        SqlValue::Guid(_) => 10,
    }
}

fn cmp_decimal(x: i128, sx: u8, y: i128, sy: u8) -> Ordering {
    // Bring both to the larger scale; fall back to floating point only on overflow.
    let s = sx.max(sy);
    let up = |v: i128, from: u8| v.checked_mul(10i128.checked_pow((s - from) as u32)?);
    match (up(x, sx), up(y, sy)) {
        (Some(a), Some(b)) => a.cmp(&b),
        _ => (x as f64 / 10f64.powi(sx as i32)).total_cmp(&(y as f64 / 10f64.powi(sy as i32))),
    }
}

/// Compares two keys column by column with [`sql_cmp`].
pub fn key_cmp(a: &[SqlValue], b: &[SqlValue]) -> Ordering {
    for (x, y) in a.iter().zip(b.iter()) {
        let o = sql_cmp(x, y);
        if o != Ordering::Equal {
            return o;
        }
    }
    a.len().cmp(&b.len())
}

/// Truncates a datetime to the microsecond, as bronze stores it.
pub fn truncate_to_micros(t: NaiveDateTime) -> NaiveDateTime {
    let nanos = t.nanosecond();
    t.with_nanosecond(nanos - nanos % 1000).unwrap_or(t)
}

/// Builds an Arrow batch from rows of [`SqlValue`]s, one builder per column.
pub struct BatchBuilder {
    schema: SchemaRef,
    builders: Vec<ColBuilder>,
    rows: usize,
}

enum ColBuilder {
    I16(Int16Builder),
    I32(Int32Builder),
    I64(Int64Builder),
    Bool(BooleanBuilder),
    Dec(Decimal128Builder, u8),
    F64(Float64Builder),
    F32(Float32Builder),
    Str(StringBuilder, StrKind),
    Bin(BinaryBuilder),
    Date(Date32Builder),
    Ts(TimestampMicrosecondBuilder, bool),
}

#[derive(Clone, Copy)]
enum StrKind {
    Text,
    Time,
    Guid,
}

/// A value that does not fit its column's type.
#[derive(Debug, Clone, thiserror::Error)]
#[error("column '{column}' ({sql_type}) cannot hold the value {value}")]
pub struct ValueTypeError {
    pub column: String,
    pub sql_type: String,
    pub value: String,
}

impl BatchBuilder {
    /// A builder for rows of these columns (see [`arrow_schema`]).
    pub fn new(columns: &[ColumnDesc]) -> BatchBuilder {
        let builders = columns
            .iter()
            .map(|c| match &c.sql_type {
                SqlType::TinyInt | SqlType::SmallInt => ColBuilder::I16(Int16Builder::new()),
                SqlType::Int => ColBuilder::I32(Int32Builder::new()),
                SqlType::BigInt => ColBuilder::I64(Int64Builder::new()),
                SqlType::Bit => ColBuilder::Bool(BooleanBuilder::new()),
                t @ (SqlType::Decimal { .. } | SqlType::Money | SqlType::SmallMoney) => {
                    let DataType::Decimal128(p, s) = t.arrow_type() else { unreachable!("decimal maps to Decimal128") };
                    ColBuilder::Dec(Decimal128Builder::new().with_precision_and_scale(p, s).expect("valid precision"), s as u8)
                }
                SqlType::Float => ColBuilder::F64(Float64Builder::new()),
                SqlType::Real => ColBuilder::F32(Float32Builder::new()),
                SqlType::Time { .. } => ColBuilder::Str(StringBuilder::new(), StrKind::Time),
                SqlType::UniqueIdentifier => ColBuilder::Str(StringBuilder::new(), StrKind::Guid),
                t if t.arrow_type() == DataType::Utf8 => ColBuilder::Str(StringBuilder::new(), StrKind::Text),
                SqlType::Date => ColBuilder::Date(Date32Builder::new()),
                SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. } => {
                    ColBuilder::Ts(TimestampMicrosecondBuilder::new(), false)
                }
                SqlType::DateTimeOffset { .. } => {
                    ColBuilder::Ts(TimestampMicrosecondBuilder::new().with_timezone("UTC"), true)
                }
                _ => ColBuilder::Bin(BinaryBuilder::new()),
            })
            .collect();
        BatchBuilder { schema: arrow_schema(columns), builders, rows: 0 }
    }

    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    pub fn len(&self) -> usize {
        self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Appends one row; `row` holds one value per column in column order.
    pub fn push(&mut self, row: &[SqlValue]) -> Result<(), ValueTypeError> {
        debug_assert_eq!(row.len(), self.builders.len());
        for (i, v) in row.iter().enumerate() {
            let ok = push_value(&mut self.builders[i], v);
            if !ok {
                let f = self.schema.field(i);
                return Err(ValueTypeError { column: f.name().clone(), sql_type: f.data_type().to_string(), value: v.canonical() });
            }
        }
        self.rows += 1;
        Ok(())
    }

    /// Finishes the rows pushed so far into a batch and starts afresh.
    pub fn finish(&mut self) -> RecordBatch {
        let arrays: Vec<ArrayRef> = self
            .builders
            .iter_mut()
            .map(|b| -> ArrayRef {
                match b {
                    ColBuilder::I16(b) => Arc::new(b.finish()),
                    ColBuilder::I32(b) => Arc::new(b.finish()),
                    ColBuilder::I64(b) => Arc::new(b.finish()),
                    ColBuilder::Bool(b) => Arc::new(b.finish()),
                    ColBuilder::Dec(b, _) => Arc::new(b.finish()),
                    ColBuilder::F64(b) => Arc::new(b.finish()),
                    ColBuilder::F32(b) => Arc::new(b.finish()),
                    ColBuilder::Str(b, _) => Arc::new(b.finish()),
                    ColBuilder::Bin(b) => Arc::new(b.finish()),
                    ColBuilder::Date(b) => Arc::new(b.finish()),
                    ColBuilder::Ts(b, _) => Arc::new(b.finish()),
                }
            })
            .collect();
        self.rows = 0;
        RecordBatch::try_new(self.schema.clone(), arrays).expect("builders match the schema")
    }
}

fn epoch_days(d: NaiveDate) -> i32 {
    (d - NaiveDate::from_ymd_opt(1970, 1, 1).expect("epoch")).num_days() as i32
}

fn push_value(b: &mut ColBuilder, v: &SqlValue) -> bool {
    use SqlValue as V;
    match (b, v) {
        (ColBuilder::I16(b), V::Null) => b.append_null(),
        (ColBuilder::I16(b), V::Int(x)) => match i16::try_from(*x) {
            Ok(x) => b.append_value(x),
            Err(_) => return false,
        },
        (ColBuilder::I32(b), V::Null) => b.append_null(),
        (ColBuilder::I32(b), V::Int(x)) => match i32::try_from(*x) {
            Ok(x) => b.append_value(x),
            Err(_) => return false,
        },
        (ColBuilder::I64(b), V::Null) => b.append_null(),
        (ColBuilder::I64(b), V::Int(x)) => b.append_value(*x),
        (ColBuilder::Bool(b), V::Null) => b.append_null(),
        (ColBuilder::Bool(b), V::Bool(x)) => b.append_value(*x),
        (ColBuilder::Bool(b), V::Int(x)) => b.append_value(*x != 0),
        (ColBuilder::Dec(b, _), V::Null) => b.append_null(),
        (ColBuilder::Dec(b, s), V::Decimal { value, scale }) => match rescale(*value, *scale, *s) {
            Some(x) => b.append_value(x),
            None => return false,
        },
        (ColBuilder::Dec(b, s), V::Int(x)) => match rescale(*x as i128, 0, *s) {
            Some(x) => b.append_value(x),
            None => return false,
        },
        (ColBuilder::F64(b), V::Null) => b.append_null(),
        (ColBuilder::F64(b), V::Float(x)) => b.append_value(*x),
        (ColBuilder::F64(b), V::Int(x)) => b.append_value(*x as f64),
        (ColBuilder::F32(b), V::Null) => b.append_null(),
        (ColBuilder::F32(b), V::Float(x)) => b.append_value(*x as f32),
        (ColBuilder::Str(b, _), V::Null) => b.append_null(),
        (ColBuilder::Str(b, StrKind::Text), V::Str(s)) => b.append_value(s),
        (ColBuilder::Str(b, StrKind::Time), V::Time(t)) => {
            b.append_value(format!("{}.{:07}", t.format("%H:%M:%S"), (t.nanosecond() % 1_000_000_000) / 100))
        }
        (ColBuilder::Str(b, StrKind::Guid), V::Guid(g)) => b.append_value(g.to_string().to_uppercase()),
        (ColBuilder::Str(b, StrKind::Guid), V::Str(s)) => match Uuid::parse_str(s) {
            Ok(g) => b.append_value(g.to_string().to_uppercase()),
            Err(_) => return false,
        },
        (ColBuilder::Bin(b), V::Null) => b.append_null(),
        (ColBuilder::Bin(b), V::Bytes(x)) => b.append_value(x),
        (ColBuilder::Date(b), V::Null) => b.append_null(),
        (ColBuilder::Date(b), V::Date(d)) => b.append_value(epoch_days(*d)),
        (ColBuilder::Ts(b, _), V::Null) => b.append_null(),
        (ColBuilder::Ts(b, false), V::DateTime(t)) => b.append_value(t.and_utc().timestamp_micros()),
        (ColBuilder::Ts(b, true), V::DateTimeOffset(t)) => b.append_value(t.timestamp_micros()),
        _ => return false,
    }
    true
}

/// `value / 10^from` as an integer scaled by `10^to`; None if it would lose digits or overflow.
fn rescale(value: i128, from: u8, to: u8) -> Option<i128> {
    if to >= from {
        value.checked_mul(10i128.checked_pow((to - from) as u32)?)
    } else {
        let d = 10i128.checked_pow((from - to) as u32)?;
        if value % d != 0 {
            None
        } else {
            Some(value / d)
        }
    }
}

/// Reads row `row` of an Arrow array back as a value, given the column's SQL type.
/// datetime2 values come back at the microsecond bronze stores.
pub fn value_at(array: &dyn Array, row: usize, sql_type: &SqlType) -> SqlValue {
    if array.is_null(row) {
        return SqlValue::Null;
    }
    let any = array.as_any();
    match sql_type {
        SqlType::TinyInt | SqlType::SmallInt => SqlValue::Int(any.downcast_ref::<Int16Array>().expect("Int16").value(row) as i64),
        SqlType::Int => SqlValue::Int(any.downcast_ref::<Int32Array>().expect("Int32").value(row) as i64),
        SqlType::BigInt => SqlValue::Int(any.downcast_ref::<Int64Array>().expect("Int64").value(row)),
        SqlType::Bit => SqlValue::Bool(any.downcast_ref::<BooleanArray>().expect("Boolean").value(row)),
        SqlType::Decimal { .. } | SqlType::Money | SqlType::SmallMoney => {
            let a = any.downcast_ref::<Decimal128Array>().expect("Decimal128");
            SqlValue::Decimal { value: a.value(row), scale: a.scale() as u8 }
        }
        SqlType::Float => SqlValue::Float(any.downcast_ref::<Float64Array>().expect("Float64").value(row)),
        SqlType::Real => SqlValue::Float(any.downcast_ref::<Float32Array>().expect("Float32").value(row) as f64),
        SqlType::Time { .. } => {
            let s = any.downcast_ref::<StringArray>().expect("Utf8").value(row);
            NaiveTime::parse_from_str(s, "%H:%M:%S%.f").map(SqlValue::Time).unwrap_or_else(|_| SqlValue::Str(s.to_string()))
        }
        SqlType::UniqueIdentifier => {
            let s = any.downcast_ref::<StringArray>().expect("Utf8").value(row);
            Uuid::parse_str(s).map(SqlValue::Guid).unwrap_or_else(|_| SqlValue::Str(s.to_string()))
        }
        SqlType::Date => {
            let d = any.downcast_ref::<Date32Array>().expect("Date32").value(row);
            SqlValue::Date(NaiveDate::from_ymd_opt(1970, 1, 1).expect("epoch") + chrono::Duration::days(d as i64))
        }
        SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. } => {
            let us = any.downcast_ref::<TimestampMicrosecondArray>().expect("Timestamp").value(row);
            SqlValue::DateTime(DateTime::from_timestamp_micros(us).expect("in range").naive_utc())
        }
        SqlType::DateTimeOffset { .. } => {
            let us = any.downcast_ref::<TimestampMicrosecondArray>().expect("Timestamp").value(row);
            SqlValue::DateTimeOffset(DateTime::from_timestamp_micros(us).expect("in range").fixed_offset())
        }
        t if t.arrow_type() == DataType::Utf8 => SqlValue::Str(any.downcast_ref::<StringArray>().expect("Utf8").value(row).to_string()),
        _ => SqlValue::Bytes(any.downcast_ref::<BinaryArray>().expect("Binary").value(row).to_vec()),
    }
}

/// The value a source value becomes once stored in bronze and read back
/// (datetime2 truncated to the µs, time at 100 ns, tinyint as an integer...).
/// Comparisons between a source and bronze normalise the source side with it.
pub fn as_stored(v: &SqlValue, sql_type: &SqlType) -> SqlValue {
    match (v, sql_type) {
        (SqlValue::DateTime(t), _) => SqlValue::DateTime(truncate_to_micros(*t)),
        (SqlValue::DateTimeOffset(t), _) => {
            let us = t.timestamp_micros();
            SqlValue::DateTimeOffset(DateTime::from_timestamp_micros(us).expect("in range").fixed_offset())
        }
        (SqlValue::Decimal { value, scale }, t) => match t.arrow_type() {
            DataType::Decimal128(_, s) => SqlValue::Decimal { value: rescale(*value, *scale, s as u8).unwrap_or(*value), scale: s as u8 },
            _ => v.clone(),
        },
        (SqlValue::Int(x), SqlType::Bit) => SqlValue::Bool(*x != 0),
        (SqlValue::Float(f), SqlType::Real) => SqlValue::Float(*f as f32 as f64),
        (SqlValue::Time(t), _) => {
            let n = t.nanosecond();
            SqlValue::Time(t.with_nanosecond(n - n % 100).unwrap_or(*t))
        }
        _ => v.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_type_names() {
        assert_eq!(SqlType::parse("decimal(18, 2)").unwrap(), SqlType::Decimal { precision: 18, scale: 2 });
        assert_eq!(SqlType::parse("NVARCHAR(max)").unwrap(), SqlType::NVarChar { len: None });
        assert_eq!(SqlType::parse("datetime2").unwrap(), SqlType::DateTime2 { scale: 7 });
        assert_eq!(SqlType::parse("varchar(20)").unwrap().sql_name(), "varchar(20)");
        assert!(SqlType::parse("decimal(40,2)").is_err());
        assert!(SqlType::parse("geography").is_err());
    }

    #[test]
    fn strings_by_code_point_and_binary_values_padded() {
        // Only trailing spaces are ignored: case is a difference (a BIN2 column's order).
        assert_eq!(sql_cmp(&SqlValue::Str("abc ".into()), &SqlValue::Str("abc".into())), Ordering::Equal);
        assert_eq!(sql_cmp(&SqlValue::Str("B".into()), &SqlValue::Str("a".into())), Ordering::Less);
        assert_eq!(sql_cmp(&SqlValue::Bytes(vec![1]), &SqlValue::Bytes(vec![1, 0, 0])), Ordering::Equal);
        assert_eq!(sql_cmp(&SqlValue::Bytes(vec![1, 0]), &SqlValue::Bytes(vec![1, 0, 5])), Ordering::Less);
        assert_eq!(sql_cmp(&SqlValue::Null, &SqlValue::Int(i64::MIN)), Ordering::Less);
    }

    #[test]
    fn guids_sort_by_their_last_group_first() {
        let a = Uuid::parse_str("FFFFFFFF-FFFF-FFFF-FFFF-000000000001").unwrap();
        let b = Uuid::parse_str("00000000-0000-0000-0000-000000000002").unwrap();
        assert_eq!(sql_cmp(&SqlValue::Guid(a), &SqlValue::Guid(b)), Ordering::Less);
    }

    #[test]
    fn decimals_compare_across_scales_and_format_exactly() {
        let a = SqlValue::Decimal { value: 150, scale: 2 };
        let b = SqlValue::Decimal { value: 15, scale: 1 };
        assert_eq!(sql_cmp(&a, &b), Ordering::Equal);
        assert_eq!(format_decimal(-5, 3), "-0.005");
        assert_eq!(format_decimal(12345, 2), "123.45");
    }

    #[test]
    fn batch_round_trip_every_kind() {
        let cols = vec![
            ColumnDesc::new("a", SqlType::TinyInt, true),
            ColumnDesc::new("b", SqlType::BigInt, false),
            ColumnDesc::new("c", SqlType::Decimal { precision: 38, scale: 4 }, true),
            ColumnDesc::new("d", SqlType::NVarChar { len: None }, true),
            ColumnDesc::new("e", SqlType::DateTime2 { scale: 7 }, true),
            ColumnDesc::new("f", SqlType::UniqueIdentifier, true),
            ColumnDesc::new("g", SqlType::Bit, true),
            ColumnDesc::new("h", SqlType::VarBinary { len: Some(10) }, true),
            ColumnDesc::new("i", SqlType::Date, true),
            ColumnDesc::new("j", SqlType::Time { scale: 7 }, true),
        ];
        let t = NaiveDate::from_ymd_opt(2026, 3, 8).unwrap().and_hms_nano_opt(1, 2, 3, 123_456_789).unwrap();
        let g = Uuid::parse_str("6F9619FF-8B86-D011-B42D-00C04FC964FF").unwrap();
        let row = vec![
            SqlValue::Int(255),
            SqlValue::Int(i64::MAX),
            SqlValue::Decimal { value: 170141183460469231731687303715884105727, scale: 4 },
            SqlValue::Str("Ünïcode".into()),
            SqlValue::DateTime(t),
            SqlValue::Guid(g),
            SqlValue::Bool(true),
            SqlValue::Bytes(vec![0, 1, 255]),
            SqlValue::Date(t.date()),
            SqlValue::Time(t.time()),
        ];
        let mut bb = BatchBuilder::new(&cols);
        bb.push(&row).unwrap();
        bb.push(&vec![SqlValue::Null; cols.len()]).unwrap();
        let batch = bb.finish();
        assert_eq!(batch.num_rows(), 2);
        for (i, c) in cols.iter().enumerate() {
            assert_eq!(value_at(batch.column(i).as_ref(), 0, &c.sql_type), as_stored(&row[i], &c.sql_type), "column {}", c.name);
            assert_eq!(value_at(batch.column(i).as_ref(), 1, &c.sql_type), SqlValue::Null);
        }
    }

    #[test]
    fn out_of_range_value_names_the_column() {
        let cols = vec![ColumnDesc::new("small", SqlType::SmallInt, true)];
        let mut bb = BatchBuilder::new(&cols);
        let e = bb.push(&[SqlValue::Int(1 << 20)]).unwrap_err();
        assert!(e.to_string().contains("small"));
    }
}
