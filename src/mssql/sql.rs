//! Every T-SQL statement the SQL Server source sends, as pure functions.
//!
//! Rules kept by every function here:
//! * a name (schema, table, column, capture instance) enters the text only
//!   through [`quote_ident`], which follows QUOTENAME: bracketed, `]` doubled;
//! * a value (LSN, key bound, count, time, name compared as data) enters only
//!   as a bound parameter `@P1…`, listed in [`Statement::params`];
//! * the few literals in the text are fixed by this module (`N'all'`, type
//!   names from [`SqlType::sql_name`]), never taken from the workflow.
//!
//! Key bounds and key values of integer columns (tinyint, smallint, int,
//! bigint) are bound as `bigint` parameters and compared with the column
//! as they are, `[id] < @P2`, never cast to the column's type:
//! * a chunk's upper bound is one past the key's MAX (the first value after
//!   the range), so on an int key whose MAX is 2147483647 it is 2147483648;
//!   `CAST(@P2 AS int)` fails that statement with error 8115 (arithmetic
//!   overflow) on every call, and the snapshot could never finish. Compared
//!   as bigint it is just a bound above every row;
//! * by data type precedence SQL Server compares an int column with a bigint
//!   parameter as bigint, and the index seek still works: the optimizer turns
//!   the bigint value into a range of the column's type at run time
//!   (`GetRangeWithMismatchedTypes`, a dynamic seek), clamping a value past
//!   the type's range instead of converting it. Writing the conversion on the
//!   column side, `CAST([id] AS bigint) < @P2`, would also avoid the overflow
//!   but makes the predicate opaque to the index: a scan per chunk;
//! * bigint parameters are what the driver sends for the engine's integer
//!   values anyway, so this is the plain `[id] < @P2`.
//!
//! Other types keep the cast: a varchar bound must compare under the
//! column's collation (an nvarchar parameter would convert the column and
//! lose the seek), and a datetime bound as datetime. Their bounds are key
//! values read from the column, so they always fit its type.
//! The integer parameters of slice counts and reconcile's bucket sums
//! (`BETWEEN @P1 AND @P2`, bigint) follow the same rule, and their arithmetic
//! runs in decimal(38,0), which no bigint overflows.
//!
//! # The change read and `__$command_id`
//!
//! `cdc.fn_cdc_get_all_changes_<ci>` returns `__$start_lsn`, `__$seqval`,
//! `__$operation`, `__$update_mask` and the captured columns, never
//! `__$command_id`: that column lives only in the change table
//! `cdc.[<ci>_CT]` (added by the KB3030352 servicing updates, present on
//! every table created from SQL Server 2017). Inside one transaction only
//! `__$command_id` orders the operations: a set-based update of a unique key
//! can log a row's insert before another row's delete of the same key, so
//! `__$seqval` order would make the delete the key's latest image.
//!
//! [`changes`] therefore joins the function's rows to `_CT` on
//! (`__$start_lsn`, `__$seqval`, `__$operation`) and orders by the command id
//! it finds there. Why a join and not a direct read of `_CT` (Debezium's
//! "direct" mode):
//! * the function keeps validating the range on the server, in the same
//!   statement: a `from` below the instance's min LSN, a `to` above max LSN
//!   or `from > to` is still error 313, so a purged range is never read
//!   silently and no check of our own can drift from the server's;
//! * the function applies CDC's own check (SELECT on the captured columns,
//!   the gating role), so the join reads nothing of `_CT` but its ordering
//!   columns: a login needs SELECT on `__$start_lsn`, `__$seqval`,
//!   `__$operation` and `__$command_id` only, a column-level grant that
//!   exposes no captured value. `SELECT ON SCHEMA::cdc` would expose every
//!   change table of the database (see `super::grants` for the least grants
//!   of every statement here: none had to change to run under them, and the
//!   two reads that name a missing one, `role_name` in [`capture_instances`]
//!   and [`instance_catalog`], read only `cdc.change_tables`);
//! * the three join columns were the unique clustered key of `_CT` before
//!   KB3030352 (the update only added `__$command_id` to it), so each
//!   function row meets exactly one `_CT` row. The stream still checks it
//!   (`engine::change_order` refuses a change that comes twice in one
//!   transaction as a bug, rather than writing it under two command ids);
//! * `_CT` is read `WITH (NOLOCK)` as the function reads it, so both sides
//!   see the same rows and neither blocks behind cleanup's deletes. A row that
//!   cleanup deletes between the two reads drops out of the inner join; that
//!   only happens when cleanup passed `from`, which the stream's check of the
//!   min LSN after every read catches.
//!
//! A change table without the column (created before the update, or on a
//! server where `sp_vupgrade_replication` never ran) is found from the
//! catalog, [`change_table_has_command_id`] (`sys.columns` of the `_CT`
//! table), before the read rather than by waiting for error 207. Its rows
//! are read from the function alone, `__$command_id` NULL, in
//! (`__$start_lsn`, `__$seqval`, `__$operation`) order, the only order
//! such a server offers. That order is right except where a transaction
//! logs a key's insert before its delete; `engine::change_order` refuses
//! exactly those batches (exit 3) instead of dropping the key.
//!
//! # Keyset seeks, piece by piece
//!
//! adr-0028 has a keyset bound found by a `TOP (n+1)` read for each piece of
//! the range an index can seek. A composite key's range `(k1, k2) >= (v1, v2)`
//! written as one predicate is an OR, `k1 > v1 OR (k1 = v1 AND k2 >= v2)`,
//! and an index on (k1, k2) seeks only a conjunction: equalities on a prefix
//! of its columns, then a range on the next. Whether the optimizer splits the
//! OR into seeks (an index union, or a dynamic seek over merged intervals) is
//! its choice per plan: write-ups on indexing for OR predicates (Gail Shaw,
//! "Indexing for ORs", sqlinthewild.co.za, 2011; Microsoft's support blog
//! "Why doesn't SQL Server use index seek with this query?", 2009) show that
//! an OR whose branches are not all ranges of one leading column is
//! evaluated as independent predicates, which one seek cannot serve, and
//! often ends in a scan; with `TOP` and `ORDER BY` over the whole key a scan
//! of the index in key order looks cheap to the optimizer. [`key_seek`] therefore
//! sends each piece, `k1 = v1 AND … AND k(i-1) = v(i-1) AND ki > vi`
//! ([`seek_pieces`]; the upper bound is cut the same way and, with both
//! bounds, each piece is one lower and one upper piece together), as its own
//! `SELECT TOP (n+1) … ORDER BY <keys>`, and leaves nothing to the optimizer
//! but seeking each.
//!
//! The branches are derived tables, `SELECT p0.* FROM (SELECT TOP … ORDER BY
//! …) AS p0 UNION ALL …`, because of two T-SQL rules in Microsoft's
//! documentation (the ORDER BY clause reference, and the guidelines for
//! UNION, EXCEPT and INTERSECT): in a UNION the ORDER BY clause may only follow the last
//! query and applies to the whole result, never to a branch; and an ORDER BY
//! inside a derived table (a view, a subquery, a CTE) is rejected, error
//! 1033, unless TOP (or OFFSET, or FOR XML) comes with it, and then it only
//! decides which rows TOP keeps, not the order they come out in. So every
//! ORDER BY below the outermost level has its TOP, and the order that counts
//! is written again on the outer `SELECT TOP (n+1) … ORDER BY <keys>`. Only
//! a server shows the plan: `tests/mssql_integration.rs` is where it can be
//! checked.
//!
//! The golden tests at the bottom snapshot each statement and parse it with
//! sqlparser's SQL Server dialect.

use std::fmt;

use chrono::{DateTime, FixedOffset, NaiveDateTime, Utc};

use crate::lsn::Lsn;
use crate::source::{
    KeyRange, RowFilter, TableName, TimeOp, CHANGE_COMMAND_ID, CHANGE_OPERATION, CHANGE_SEQVAL, CHANGE_START_LSN,
    CHANGE_TRAN_END_TIME,
};
use crate::types::{ColumnDesc, Key, SqlType, SqlValue};

/// One statement and the values bound to `@P1`, `@P2`, … in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Statement {
    pub sql: String,
    pub params: Vec<SqlValue>,
}

impl Statement {
    fn new(sql: String, params: Vec<SqlValue>) -> Statement {
        Statement { sql, params }
    }
}

impl fmt::Display for Statement {
    /// The text, then one line per parameter (used by the golden tests and in debug logs).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.sql)?;
        for (i, p) in self.params.iter().enumerate() {
            write!(f, "\n-- @P{} = {}", i + 1, p.canonical())?;
        }
        Ok(())
    }
}

/// Collects parameters and hands out their placeholders.
#[derive(Default)]
struct Params(Vec<SqlValue>);

impl Params {
    fn bind(&mut self, v: SqlValue) -> String {
        self.0.push(v);
        format!("@P{}", self.0.len())
    }
}

/// A name as a delimited identifier, as QUOTENAME writes it: `[a]]b]` for `a]b`.
pub fn quote_ident(name: &str) -> String {
    format!("[{}]", name.replace(']', "]]"))
}

/// `[schema].[table]`.
pub fn quote_table(t: &TableName) -> String {
    format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name))
}

/// The quoted two-part name as a value, for OBJECT_ID(@Pn).
fn object_name_value(t: &TableName) -> SqlValue {
    SqlValue::Str(quote_table(t))
}

/// `cdc.[fn_cdc_get_all_changes_<ci>]`: the function name quoted as one identifier.
pub fn all_changes_function(capture_instance: &str) -> String {
    format!("cdc.{}", quote_ident(&format!("fn_cdc_get_all_changes_{capture_instance}")))
}

/// A key bound's placeholder as it enters a comparison with its column: an
/// integer column's bound as the bigint parameter itself (see the module doc:
/// never cast to the column's type, which MAX + 1 overflows), any other
/// column's cast to the column's type.
fn bound_expr(placeholder: String, t: &SqlType) -> String {
    if t.is_integer() {
        placeholder
    } else {
        format!("CAST({placeholder} AS {})", cast_type(t))
    }
}

/// The type a key parameter is cast to so that it compares as the column does
/// (varchar under the column's collation rather than as nvarchar, datetime as
/// datetime).
fn cast_type(t: &SqlType) -> String {
    match t {
        SqlType::Timestamp => "binary(8)".into(),
        other => other.sql_name(),
    }
}

/// A column in a select list. money and smallmoney are read as decimals: the
/// driver would hand them over as floating point and lose digits.
fn select_item(prefix: &str, c: &ColumnDesc) -> String {
    let q = quote_ident(&c.name);
    match c.sql_type {
        SqlType::Money => format!("CAST({prefix}{q} AS decimal(19,4)) AS {q}"),
        SqlType::SmallMoney => format!("CAST({prefix}{q} AS decimal(10,4)) AS {q}"),
        _ => format!("{prefix}{q}"),
    }
}

/// `sys.fn_cdc_get_max_lsn()`.
pub fn max_lsn() -> Statement {
    Statement::new("SELECT sys.fn_cdc_get_max_lsn() AS max_lsn".into(), vec![])
}

/// `sys.fn_cdc_get_min_lsn(ci)`.
pub fn min_lsn(capture_instance: &str) -> Statement {
    Statement::new("SELECT sys.fn_cdc_get_min_lsn(@P1) AS min_lsn".into(), vec![SqlValue::Str(capture_instance.into())])
}

/// `sys.fn_cdc_increment_lsn(lsn)`.
pub fn increment_lsn(lsn: Lsn) -> Statement {
    Statement::new("SELECT sys.fn_cdc_increment_lsn(@P1) AS lsn".into(), vec![SqlValue::Bytes(lsn.0.to_vec())])
}

/// `sys.fn_cdc_decrement_lsn(lsn)`.
pub fn decrement_lsn(lsn: Lsn) -> Statement {
    Statement::new("SELECT sys.fn_cdc_decrement_lsn(@P1) AS lsn".into(), vec![SqlValue::Bytes(lsn.0.to_vec())])
}

/// How a column's catalog row finds the name of its type. An alias type
/// (`sysname`, or one made with `CREATE TYPE … FROM`) is named by its base
/// type, so the join goes through `system_type_id`. CLR types (`geography`,
/// `geometry`, `hierarchyid` and user CLR types) all have `system_type_id`
/// 240, which no `sys.types` row has as its `user_type_id`: joined the first
/// way, such a column would vanish from the result without a trace. They are
/// joined by their own `user_type_id`, so they come back under their real
/// name and are refused by name (`convert::sql_type_from_catalog`).
const TYPE_OF_COLUMN: &str = "ty.user_type_id = CASE WHEN c.system_type_id = 240 THEN c.user_type_id ELSE c.system_type_id END";

/// The columns of a user table with their base types, in column order.
/// Columns: name, type_name, max_length, precision, scale, is_nullable.
pub fn table_columns(t: &TableName) -> Statement {
    Statement::new(
        format!(
            "SELECT c.name, ty.name AS type_name, CAST(c.max_length AS int) AS max_len, CAST(c.precision AS int) AS num_precision, \
         CAST(c.scale AS int) AS num_scale, c.is_nullable \
         FROM sys.columns AS c JOIN sys.types AS ty ON {TYPE_OF_COLUMN} \
         WHERE c.object_id = OBJECT_ID(@P1, N'U') ORDER BY c.column_id"
        ),
        vec![object_name_value(t)],
    )
}

/// The key columns of the table's primary key, or else of its unique indexes
/// (enabled, unfiltered), primary key first, then by index id and key order.
/// Columns: index_id, is_primary_key, column name.
pub fn table_unique_keys(t: &TableName) -> Statement {
    Statement::new(
        "SELECT i.index_id, i.is_primary_key, c.name \
         FROM sys.indexes AS i \
         JOIN sys.index_columns AS ic ON ic.object_id = i.object_id AND ic.index_id = i.index_id \
         JOIN sys.columns AS c ON c.object_id = ic.object_id AND c.column_id = ic.column_id \
         WHERE i.object_id = OBJECT_ID(@P1, N'U') AND i.is_unique = 1 AND i.has_filter = 0 AND i.is_disabled = 0 AND ic.key_ordinal > 0 \
         ORDER BY i.is_primary_key DESC, i.index_id, ic.key_ordinal"
            .into(),
        vec![object_name_value(t)],
    )
}

/// The table's capture instances, oldest first. Columns: capture_instance,
/// start_lsn, role_name (the gating role, NULL for none: named in the
/// message when CDC refuses the login).
pub fn capture_instances(t: &TableName) -> Statement {
    Statement::new(
        "SELECT ct.capture_instance, ct.start_lsn, ct.role_name \
         FROM cdc.change_tables AS ct WHERE ct.source_object_id = OBJECT_ID(@P1, N'U') \
         ORDER BY ct.create_date, ct.object_id"
            .into(),
        vec![object_name_value(t)],
    )
}

/// One capture instance's row of `cdc.change_tables`, read when
/// `sys.fn_cdc_get_min_lsn` answered all zeros: an instance with a
/// `start_lsn` is then one whose change data is closed to the login
/// (`super::grants::read_min_lsn`). No row when the instance does not exist.
/// Columns: start_lsn, role_name, source_schema, source_name.
pub fn instance_catalog(capture_instance: &str) -> Statement {
    Statement::new(
        "SELECT ct.start_lsn, ct.role_name, OBJECT_SCHEMA_NAME(ct.source_object_id) AS source_schema, \
         OBJECT_NAME(ct.source_object_id) AS source_name FROM cdc.change_tables AS ct WHERE ct.capture_instance = @P1"
            .into(),
        vec![SqlValue::Str(capture_instance.into())],
    )
}

/// Whether CDC is enabled on the current database (when it is not, the `cdc`
/// schema and its tables do not exist). Column: cdc_enabled (int).
pub fn database_cdc_enabled() -> Statement {
    Statement::new("SELECT CAST(d.is_cdc_enabled AS int) AS cdc_enabled FROM sys.databases AS d WHERE d.database_id = DB_ID()".into(), vec![])
}

/// The captured columns of every instance of the table, with the types the
/// change table holds them in, in column ordinal order; nullability from the
/// source column while it exists; whether the column is computed (CDC writes
/// NULL for a computed column in every change row); and the name the source
/// table gives the column now (NULL once it is dropped). The source column is
/// found by `column_id`, which `sp_rename` keeps, never by name: a renamed
/// column keeps its old name in `cdc.captured_columns` and in the change
/// table. Columns: capture_instance, column_name, type_name, max_length,
/// precision, scale, is_nullable, is_computed, source_name.
pub fn captured_columns(t: &TableName) -> Statement {
    Statement::new(
        format!(
            "SELECT ct.capture_instance, cc.column_name, ty.name AS type_name, CAST(c.max_length AS int) AS max_len, \
         CAST(c.precision AS int) AS num_precision, CAST(c.scale AS int) AS num_scale, \
         CAST(COALESCE(sc.is_nullable, 1) AS bit) AS is_nullable, CAST(COALESCE(cc.is_computed, 0) AS bit) AS is_computed, \
         sc.name AS source_name \
         FROM cdc.change_tables AS ct \
         JOIN cdc.captured_columns AS cc ON cc.object_id = ct.object_id \
         JOIN sys.columns AS c ON c.object_id = ct.object_id AND c.name = cc.column_name \
         JOIN sys.types AS ty ON {TYPE_OF_COLUMN} \
         LEFT JOIN sys.columns AS sc ON sc.object_id = ct.source_object_id AND sc.column_id = cc.column_id \
         WHERE ct.source_object_id = OBJECT_ID(@P1, N'U') \
         ORDER BY ct.capture_instance, cc.column_ordinal"
        ),
        vec![object_name_value(t)],
    )
}

/// The index columns of every instance of the table. Columns: capture_instance, column_name.
pub fn index_columns(t: &TableName) -> Statement {
    Statement::new(
        "SELECT ct.capture_instance, ic.column_name \
         FROM cdc.change_tables AS ct JOIN cdc.index_columns AS ic ON ic.object_id = ct.object_id \
         WHERE ct.source_object_id = OBJECT_ID(@P1, N'U') \
         ORDER BY ct.capture_instance, ic.index_ordinal"
            .into(),
        vec![object_name_value(t)],
    )
}

/// `cdc.[<ci>_CT]`: the change table of a capture instance, quoted as one identifier.
pub fn change_table(capture_instance: &str) -> String {
    format!("cdc.{}", quote_ident(&format!("{capture_instance}_CT")))
}

/// Whether the instance's change table has a `__$command_id` column (read
/// from `sys.columns` of the `_CT` table). Column: has_command_id (int, 0 or
/// 1; no row when the instance does not exist).
pub fn change_table_has_command_id(capture_instance: &str) -> Statement {
    Statement::new(
        "SELECT CAST(CASE WHEN EXISTS (SELECT 1 FROM sys.columns AS c WHERE c.object_id = ct.object_id AND c.name = N'__$command_id') \
         THEN 1 ELSE 0 END AS int) AS has_command_id \
         FROM cdc.change_tables AS ct WHERE ct.capture_instance = @P1"
            .into(),
        vec![SqlValue::Str(capture_instance.into())],
    )
}

/// The changes of one instance in `[from, to]` with their commit times, in
/// commit order (see the module docs). With `with_command_id` the function's
/// rows are joined to the change table for `__$command_id`, which then
/// orders each transaction; without it (a change table from before
/// KB3030352) `__$command_id` is NULL and the order is
/// (`__$start_lsn`, `__$seqval`, `__$operation`).
pub fn changes(
    capture_instance: &str,
    columns: &[ColumnDesc],
    from: Lsn,
    to: Lsn,
    filter: RowFilter,
    with_command_id: bool,
) -> Statement {
    let mut p = Params::default();
    let from_p = p.bind(SqlValue::Bytes(from.0.to_vec()));
    let to_p = p.bind(SqlValue::Bytes(to.0.to_vec()));
    let (start, seq, op, cmd, time) = (
        quote_ident(CHANGE_START_LSN),
        quote_ident(CHANGE_SEQVAL),
        quote_ident(CHANGE_OPERATION),
        quote_ident(CHANGE_COMMAND_ID),
        quote_ident(CHANGE_TRAN_END_TIME),
    );
    let cmd_item = if with_command_id { format!("t.{cmd}") } else { format!("CAST(NULL AS int) AS {cmd}") };
    let mut items = vec![format!("c.{start}"), format!("c.{seq}"), format!("c.{op}"), cmd_item, format!("m.tran_end_time AS {time}")];
    items.extend(columns.iter().map(|c| select_item("c.", c)));
    let (join, order) = if with_command_id {
        (
            format!(
                " JOIN {} AS t WITH (NOLOCK) ON t.{start} = c.{start} AND t.{seq} = c.{seq} AND t.{op} = c.{op}",
                change_table(capture_instance)
            ),
            format!("c.{start}, t.{cmd}, c.{seq}, c.{op}"),
        )
    } else {
        (String::new(), format!("c.{start}, c.{seq}, c.{op}"))
    };
    let filter = match filter {
        RowFilter::All => "N'all'",
        RowFilter::AllUpdateOld => "N'all update old'",
    };
    Statement::new(
        format!(
            "SELECT {} FROM {}({from_p}, {to_p}, {filter}) AS c{join} LEFT JOIN cdc.lsn_time_mapping AS m ON m.start_lsn = c.{start} ORDER BY {order}",
            items.join(", "),
            all_changes_function(capture_instance),
        ),
        p.0,
    )
}

/// A key column and its type (the type decides how its bound is cast).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyCol {
    pub name: String,
    pub sql_type: SqlType,
}

/// One side of the lexicographic comparison `key (op) bound`, for rows
/// whose key columns are all non-NULL. A NULL in the bound sorts lowest (as
/// ORDER BY does). Returns "1 = 0" when no row qualifies.
fn lex_compare(keys: &[KeyCol], bound: &[SqlValue], greater: bool, p: &mut Params) -> String {
    // One placeholder per bound component, bound at its first use (a
    // component only ever compared with NULL binds nothing) and reused.
    let mut cache: Vec<Option<String>> = vec![None; keys.len()];
    let mut holder = |i: usize, p: &mut Params| -> Option<String> {
        if bound[i].is_null() {
            return None;
        }
        if cache[i].is_none() {
            cache[i] = Some(bound_expr(p.bind(bound[i].clone()), &keys[i].sql_type));
        }
        cache[i].clone()
    };
    let n = keys.len();
    let mut terms = Vec::new();
    'term: for i in 0..n {
        // k = NULL holds for no non-NULL key: such a prefix makes the term false.
        if bound[..i].iter().any(SqlValue::is_null) || (bound[i].is_null() && !greater) {
            continue 'term;
        }
        let mut parts = Vec::new();
        for j in 0..i {
            if let Some(h) = holder(j, p) {
                parts.push(format!("{} = {h}", quote_ident(&keys[j].name)));
            }
        }
        let col = quote_ident(&keys[i].name);
        let last = i + 1 == n;
        match (holder(i, p), greater) {
            (Some(h), true) => parts.push(format!("{col} {} {h}", if last { ">=" } else { ">" })),
            (Some(h), false) => parts.push(format!("{col} < {h}")),
            // Every non-NULL value is above NULL, none is below it.
            (None, true) => parts.push(format!("{col} IS NOT NULL")),
            (None, false) => continue 'term,
        }
        terms.push(if parts.len() == 1 { parts.pop().unwrap_or_default() } else { format!("({})", parts.join(" AND ")) });
    }
    if terms.is_empty() {
        "1 = 0".into()
    } else {
        terms.join(" OR ")
    }
}

/// The WHERE condition of a key range, or None for the whole table.
///
/// `lo` (inclusive) keeps rows whose key is at or above it and excludes rows
/// with a NULL in any key column; `hi` (exclusive) keeps rows below it and,
/// so that the first range of a tiling holds them, rows with a NULL key
/// column. Ranges sharing a bound thus never share a row, and together they
/// cover the table.
fn range_condition(keys: &[KeyCol], range: &KeyRange, p: &mut Params) -> Result<Option<String>, String> {
    let mut conds = Vec::new();
    for b in [&range.lo, &range.hi].into_iter().flatten() {
        if b.len() != keys.len() {
            return Err(format!("a range bound has {} values for {} key columns", b.len(), keys.len()));
        }
    }
    if let Some(lo) = &range.lo {
        let cmp = lex_compare(keys, lo, true, p);
        if keys.len() > 1 {
            let not_null: Vec<String> = keys.iter().map(|k| format!("{} IS NOT NULL", quote_ident(&k.name))).collect();
            conds.push(format!("({}) AND ({cmp})", not_null.join(" AND ")));
        } else {
            conds.push(format!("({cmp})"));
        }
    }
    if let Some(hi) = &range.hi {
        let cmp = lex_compare(keys, hi, false, p);
        let nulls: Vec<String> = keys.iter().map(|k| format!("{} IS NULL", quote_ident(&k.name))).collect();
        conds.push(format!("({} OR {cmp})", nulls.join(" OR ")));
    }
    Ok(if conds.is_empty() { None } else { Some(conds.join(" AND ")) })
}

/// A column of a snapshot read and whether the table still has it (a captured
/// column dropped from the table reads as NULL).
#[derive(Debug, Clone, PartialEq)]
pub struct ReadColumn {
    pub desc: ColumnDesc,
    pub present: bool,
}

/// The rows of one key range. Row order is left to the server.
pub fn snapshot_read(table: &TableName, columns: &[ReadColumn], keys: &[KeyCol], range: &KeyRange) -> Result<Statement, String> {
    table_read(table, columns, keys, range, "")
}

/// The SELECT of a snapshot read, with `hints` (a table hint clause or "") after the table.
fn table_read(table: &TableName, columns: &[ReadColumn], keys: &[KeyCol], range: &KeyRange, hints: &str) -> Result<Statement, String> {
    let mut p = Params::default();
    let items: Vec<String> = columns
        .iter()
        .map(|c| {
            if c.present {
                select_item("", &c.desc)
            } else {
                format!("CAST(NULL AS {}) AS {}", cast_type(&c.desc.sql_type), quote_ident(&c.desc.name))
            }
        })
        .collect();
    let mut sql = format!("SELECT {} FROM {}{hints}", items.join(", "), quote_table(table));
    if let Some(w) = range_condition(keys, range, &mut p)? {
        sql.push_str(" WHERE ");
        sql.push_str(&w);
    }
    Ok(Statement::new(sql, p.0))
}

/// A snapshot read, then the max LSN (`CdcSource::snapshot_read_then_max_lsn`):
/// one batch of two statements, so the max LSN costs no round trip of its
/// own. The batch runs in autocommit: the second SELECT is a statement of
/// its own, which starts (and, under SNAPSHOT, takes its snapshot) only once
/// the first has sent its last row, so the LSN it reads is the server's max
/// LSN after the read, as the chunk window needs.
pub fn snapshot_read_then_max_lsn(table: &TableName, columns: &[ReadColumn], keys: &[KeyCol], range: &KeyRange) -> Result<Statement, String> {
    let read = table_read(table, columns, keys, range, "")?;
    let max = max_lsn();
    Ok(Statement::new(format!("{}; {};", read.sql, max.sql), read.params))
}

/// A fenced snapshot read (`CdcSource::snapshot_read_fenced`): one batch
/// in one transaction. The rows come under `TABLOCK, HOLDLOCK`, a shared lock
/// on the whole table taken before the first row is read and held to the
/// end of the transaction, so no writer of the table commits in between.
/// `WAITFOR DELAY` then lets `guard_ms` pass, the second result set is the
/// server's clock, and the guard passes again before `COMMIT` lets the
/// writers in: every commit of the table ends (`tran_end_time`) more than
/// the guard before or after the fence. The transaction is opened and closed
/// inside the one batch (sp_executesql requires the count to balance); a
/// connection that fails part-way is dropped, which rolls it back.
pub fn snapshot_read_fenced(table: &TableName, columns: &[ReadColumn], keys: &[KeyCol], range: &KeyRange, guard_ms: u64) -> Result<Statement, String> {
    let read = table_read(table, columns, keys, range, " WITH (TABLOCK, HOLDLOCK)")?;
    let sql = read.sql;
    let delay = format!("'00:00:{:02}.{:03}'", guard_ms / 1000, guard_ms % 1000);
    Ok(Statement::new(
        format!(
            "SET XACT_ABORT ON; BEGIN TRANSACTION; {sql}; WAITFOR DELAY {delay}; \
             SELECT SYSDATETIME() AS fence; WAITFOR DELAY {delay}; COMMIT TRANSACTION;"
        ),
        read.params,
    ))
}

fn key_list(keys: &[KeyCol], desc: bool) -> String {
    keys.iter().map(|k| format!("{}{}", quote_ident(&k.name), if desc { " DESC" } else { "" })).collect::<Vec<_>>().join(", ")
}

/// The smallest and largest key, ignoring rows with a NULL key column. One
/// column: MIN and MAX in one row. Several (or bit, which has no MIN): two rows,
/// `end_no` 0 for the smallest and 1 for the largest, each the first in order.
pub fn key_extent(table: &TableName, keys: &[KeyCol]) -> Statement {
    let t = quote_table(table);
    if keys.len() == 1 && keys[0].sql_type != SqlType::Bit {
        let k = quote_ident(&keys[0].name);
        return Statement::new(format!("SELECT MIN({k}) AS lo, MAX({k}) AS hi FROM {t}"), vec![]);
    }
    let not_null: Vec<String> = keys.iter().map(|k| format!("{} IS NOT NULL", quote_ident(&k.name))).collect();
    let w = not_null.join(" AND ");
    let cols = key_list(keys, false);
    Statement::new(
        format!(
            "SELECT lo.* FROM (SELECT TOP (1) 0 AS end_no, {cols} FROM {t} WHERE {w} ORDER BY {cols}) AS lo \
             UNION ALL SELECT hi.* FROM (SELECT TOP (1) 1 AS end_no, {cols} FROM {t} WHERE {w} ORDER BY {desc}) AS hi",
            desc = key_list(keys, true),
        ),
        vec![],
    )
}

/// Row counts per slice `[lo + i*width, lo + (i+1)*width)` of an integer
/// column over `[lo, hi]`. The slice start is computed in decimal(38,0) with
/// `%`, which is exact: `k - lo` can exceed bigint when the range spans it
/// all, and decimal division would round. Columns: slice_start, n.
pub fn slice_counts(table: &TableName, key: &str, lo: i64, hi: i64, width: i64) -> Statement {
    let mut p = Params::default();
    let (lo_p, hi_p, w_p) = (p.bind(SqlValue::Int(lo)), p.bind(SqlValue::Int(hi)), p.bind(SqlValue::Int(width)));
    let k = quote_ident(key);
    Statement::new(
        format!(
            "SELECT s.slice_start, COUNT_BIG(*) AS n FROM (\
             SELECT CAST({lo_p} + (d.dist - d.dist % {w_p}) AS bigint) AS slice_start FROM (\
             SELECT CAST({k} AS decimal(38,0)) - {lo_p} AS dist FROM {t} WHERE {k} BETWEEN {lo_p} AND {hi_p}) AS d) AS s \
             GROUP BY s.slice_start ORDER BY s.slice_start",
            t = quote_table(table),
        ),
        p.0,
    )
}

/// The smallest and largest value of an integer column in `[lo, hi]`, the
/// bounds compared as BIGINT parameters as `slice_counts` compares them (one
/// over-full slice's real extent, probed before it is counted again). One
/// row; both NULL when no value is in the range. Columns: lo, hi (bigint).
pub fn slice_extent(table: &TableName, key: &str, lo: i64, hi: i64) -> Statement {
    let mut p = Params::default();
    let (lo_p, hi_p) = (p.bind(SqlValue::Int(lo)), p.bind(SqlValue::Int(hi)));
    let k = quote_ident(key);
    Statement::new(
        format!(
            "SELECT CAST(MIN({k}) AS bigint) AS lo, CAST(MAX({k}) AS bigint) AS hi FROM {t} WHERE {k} BETWEEN {lo_p} AND {hi_p}",
            t = quote_table(table),
        ),
        p.0,
    )
}

/// The rows whose key column is NULL (they belong to the first chunk of a
/// plan; `slice_counts`'s BETWEEN leaves them out). Column: n.
pub fn null_count(table: &TableName, key: &str) -> Statement {
    let k = quote_ident(key);
    Statement::new(format!("SELECT COUNT_BIG(*) AS n FROM {} WHERE {k} IS NULL", quote_table(table)), vec![])
}

/// Reconcile tier 1: per slice of an integer key, the row count and the exact
/// sum of the key. Columns: slice_start, n, key_sum (decimal(38,0)).
pub fn bucket_sums(table: &TableName, key: &str, lo: i64, hi: i64, width: i64) -> Statement {
    let mut p = Params::default();
    let (lo_p, hi_p, w_p) = (p.bind(SqlValue::Int(lo)), p.bind(SqlValue::Int(hi)), p.bind(SqlValue::Int(width)));
    let k = quote_ident(key);
    Statement::new(
        format!(
            "SELECT s.slice_start, COUNT_BIG(*) AS n, SUM(s.k) AS key_sum FROM (\
             SELECT CAST({lo_p} + (d.dist - d.dist % {w_p}) AS bigint) AS slice_start, d.k FROM (\
             SELECT CAST({k} AS decimal(38,0)) AS k, CAST({k} AS decimal(38,0)) - {lo_p} AS dist FROM {t} \
             WHERE {k} BETWEEN {lo_p} AND {hi_p}) AS d) AS s \
             GROUP BY s.slice_start ORDER BY s.slice_start",
            t = quote_table(table),
        ),
        p.0,
    )
}

/// The collation of every string column of the table. Columns: name, collation_name.
pub fn column_collations(t: &TableName) -> Statement {
    Statement::new(
        "SELECT c.name, c.collation_name FROM sys.columns AS c \
         WHERE c.object_id = OBJECT_ID(@P1, N'U') AND c.collation_name IS NOT NULL ORDER BY c.column_id"
            .into(),
        vec![object_name_value(t)],
    )
}

/// Most key pairs one [`key_compare`] statement carries: each binds up to two
/// parameters per key column, and a request holds at most 2,100.
pub fn key_compare_pairs_per_statement(key_columns: usize) -> usize {
    (2000 / (2 * key_columns.max(1))).max(1)
}

/// Compares pairs of keys on the server, which alone knows how its
/// collations order and equate strings: one row, one column per pair
/// (`c0`, `c1`, ...: -1, 0 or 1 for a below, equal to or above b). Both sides
/// are parameters converted as a range bound is (see `bound_expr`); a
/// string column's side also gets `COLLATE <the column's collation>`, since
/// two parameters would otherwise compare under the database's default
/// collation, not the column's. NULL sorts first, as ORDER BY puts it, which
/// is decided here (a comparison with NULL has no answer in SQL).
pub fn key_compare(keys: &[KeyCol], collations: &[Option<String>], pairs: &[(Key, Key)]) -> Result<Statement, String> {
    if pairs.is_empty() {
        return Err("no key pairs to compare".into());
    }
    for name in collations.iter().flatten() {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("the catalog reports the collation '{name}', which is not a plain collation name"));
        }
    }
    let mut p = Params::default();
    let mut items = Vec::with_capacity(pairs.len());
    for (n, (a, b)) in pairs.iter().enumerate() {
        if a.len() != keys.len() || b.len() != keys.len() {
            return Err(format!("a key to compare has {} and {} values for {} key columns", a.len(), b.len(), keys.len()));
        }
        let side = |v: &SqlValue, i: usize, p: &mut Params| {
            let e = bound_expr(p.bind(v.clone()), &keys[i].sql_type);
            match collations.get(i).cloned().flatten() {
                Some(c) if keys[i].sql_type.is_string() => format!("{e} COLLATE {c}"),
                _ => e,
            }
        };
        let mut whens = String::new();
        let mut tail = "0";
        for i in 0..keys.len() {
            match (a[i].is_null(), b[i].is_null()) {
                (true, true) => continue,
                (true, false) => {
                    tail = "-1";
                    break;
                }
                (false, true) => {
                    tail = "1";
                    break;
                }
                (false, false) => {
                    let (x, y) = (side(&a[i], i, &mut p), side(&b[i], i, &mut p));
                    whens.push_str(&format!(" WHEN {x} < {y} THEN -1 WHEN {x} > {y} THEN 1"));
                }
            }
        }
        items.push(if whens.is_empty() { format!("{tail} AS c{n}") } else { format!("CASE{whens} ELSE {tail} END AS c{n}") });
    }
    Ok(Statement::new(format!("SELECT {}", items.join(", ")), p.0))
}

/// The key of the `(n+1)`-th row of the range in key order: the first `n+1`
/// rows are taken in key order, and the last of them is returned with how many
/// there were (`taken`); the caller keeps it only when `taken = n+1`.
/// Columns: the key columns, then taken.
///
/// One key column: one `SELECT TOP (n+1) … WHERE <range> ORDER BY <key>`,
/// the range as [`snapshot_read`] writes it. Several: the range is cut into
/// the pieces of [`seek_pieces`], each read as its own
/// `SELECT TOP (n+1) … WHERE <piece> ORDER BY <keys>` in a derived table;
/// the branches are joined with `UNION ALL` and an outer
/// `SELECT TOP (n+1) … ORDER BY <keys>` keeps the first `n+1` of them (the
/// pieces share no row, so no row counts twice, and the first `n+1` rows of
/// the range are among the first `n+1` of their pieces). A range that is one
/// piece (the whole table) stays one statement. The result has the same
/// columns either way. See "Keyset seeks, piece by piece" in the module docs.
pub fn key_seek(table: &TableName, keys: &[KeyCol], range: &KeyRange, n: u64) -> Result<Statement, String> {
    let mut p = Params::default();
    let take = i64::try_from(n).ok().and_then(|n| n.checked_add(1)).ok_or_else(|| format!("seek offset {n} is too large"))?;
    let top = p.bind(SqlValue::Int(take));
    let cols = key_list(keys, false);
    let t = quote_table(table);
    let inner = if keys.len() <= 1 {
        let mut inner = format!("SELECT TOP ({top}) {cols} FROM {t}");
        if let Some(w) = range_condition(keys, range, &mut p)? {
            inner.push_str(" WHERE ");
            inner.push_str(&w);
        }
        inner.push_str(&format!(" ORDER BY {cols}"));
        inner
    } else {
        let pieces = seek_pieces(keys, range, &mut p)?;
        let branch = |w: &Option<String>| match w {
            Some(w) => format!("SELECT TOP ({top}) {cols} FROM {t} WHERE {w} ORDER BY {cols}"),
            None => format!("SELECT TOP ({top}) {cols} FROM {t} ORDER BY {cols}"),
        };
        if pieces.len() == 1 {
            branch(&pieces[0])
        } else {
            let union = pieces
                .iter()
                .enumerate()
                .map(|(i, w)| format!("SELECT p{i}.* FROM ({}) AS p{i}", branch(w)))
                .collect::<Vec<_>>()
                .join(" UNION ALL ");
            let u_cols = keys.iter().map(|k| format!("u.{}", quote_ident(&k.name))).collect::<Vec<_>>().join(", ");
            format!("SELECT TOP ({top}) {u_cols} FROM ({union}) AS u ORDER BY {u_cols}")
        }
    };
    let outer_cols = keys.iter().map(|k| format!("s.{}", quote_ident(&k.name))).collect::<Vec<_>>().join(", ");
    let outer_desc = keys.iter().map(|k| format!("s.{} DESC", quote_ident(&k.name))).collect::<Vec<_>>().join(", ");
    Ok(Statement::new(
        format!("SELECT TOP (1) {outer_cols}, COUNT_BIG(*) OVER () AS taken FROM ({inner}) AS s ORDER BY {outer_desc}"),
        p.0,
    ))
}

/// One piece of a composite key's range: conditions on single columns (the
/// column's index, the text, and whether it only says the column is not
/// NULL), and at most one condition over several columns, written last.
#[derive(Debug, Clone, Default)]
struct Piece {
    conds: Vec<(usize, String, bool)>,
    tail: Option<String>,
}

impl Piece {
    fn with(mut self, col: usize, cond: String) -> Piece {
        self.conds.push((col, cond, false));
        self
    }

    fn not_null(mut self, keys: &[KeyCol], col: usize) -> Piece {
        self.conds.push((col, format!("{} IS NOT NULL", quote_ident(&keys[col].name)), true));
        self
    }

    /// Both pieces' conditions (a row in both).
    fn and(&self, other: &Piece) -> Piece {
        let mut conds = self.conds.clone();
        conds.extend(other.conds.iter().cloned());
        let tail = match (&self.tail, &other.tail) {
            (Some(a), Some(b)) => Some(format!("{a} AND {b}")),
            (a, b) => a.clone().or_else(|| b.clone()),
        };
        Piece { conds, tail }
    }

    /// The WHERE condition, columns in key order; `IS NOT NULL` is left out
    /// where another condition on the column already excludes NULL. None
    /// when the piece is the whole table.
    fn sql(&self) -> Option<String> {
        let mut conds: Vec<&(usize, String, bool)> = self.conds.iter().collect();
        conds.sort_by_key(|c| c.0);
        let mut parts: Vec<String> = Vec::new();
        for c in &conds {
            if c.2 && conds.iter().any(|o| o.0 == c.0 && !o.2) {
                continue;
            }
            if !parts.contains(&c.1) {
                parts.push(c.1.clone());
            }
        }
        parts.extend(self.tail.iter().cloned());
        if parts.is_empty() {
            None
        } else {
            Some(parts.join(" AND "))
        }
    }
}

/// The placeholders of one bound's components, each bound at its first use
/// (a component only ever compared with NULL binds nothing) and reused.
struct BoundHolders<'a> {
    keys: &'a [KeyCol],
    values: &'a [SqlValue],
    cache: Vec<Option<String>>,
}

impl<'a> BoundHolders<'a> {
    fn new(keys: &'a [KeyCol], values: &'a [SqlValue]) -> BoundHolders<'a> {
        BoundHolders { keys, values, cache: vec![None; values.len()] }
    }

    /// The component's expression; callers check it is not NULL first.
    fn get(&mut self, i: usize, p: &mut Params) -> String {
        if self.cache[i].is_none() {
            self.cache[i] = Some(bound_expr(p.bind(self.values[i].clone()), &self.keys[i].sql_type));
        }
        self.cache[i].clone().unwrap_or_default()
    }

    /// `k1 = v1 AND … AND k(i-1) = v(i-1)` as a piece (the components must be non-NULL).
    fn prefix(&mut self, i: usize, p: &mut Params) -> Piece {
        let mut piece = Piece::default();
        for j in 0..i {
            let h = self.get(j, p);
            piece = piece.with(j, format!("{} = {h}", quote_ident(&self.keys[j].name)));
        }
        piece
    }
}

/// The rows at or above `lo` (inclusive; every key column non-NULL), cut
/// where they first exceed it: piece i is `k1 = v1 AND … AND k(i-1) = v(i-1)
/// AND ki > vi` (`>=` on the last column), the columns after i `IS NOT NULL`.
/// A NULL component sorts lowest: at i it makes the piece `ki IS NOT NULL`,
/// and no piece follows (no key equals NULL).
fn lower_pieces(keys: &[KeyCol], lo: &[SqlValue], p: &mut Params) -> Vec<Piece> {
    let mut h = BoundHolders::new(keys, lo);
    let n = keys.len();
    let mut out = Vec::new();
    for i in 0..n {
        let mut piece = h.prefix(i, p);
        let col = quote_ident(&keys[i].name);
        let null_here = lo[i].is_null();
        piece = if null_here {
            piece.not_null(keys, i)
        } else {
            let v = h.get(i, p);
            piece.with(i, format!("{col} {} {v}", if i + 1 == n { ">=" } else { ">" }))
        };
        for j in i + 1..n {
            piece = piece.not_null(keys, j);
        }
        out.push(piece);
        if null_here {
            break;
        }
    }
    out
}

/// The rows below `hi` with no NULL key column where they are compared:
/// piece j is `k1 = w1 AND … AND k(j-1) = w(j-1) AND kj < wj`; the pieces
/// stop at the first NULL component (nothing sorts below NULL).
fn below_pieces(keys: &[KeyCol], hi: &[SqlValue], p: &mut Params) -> Vec<Piece> {
    let mut h = BoundHolders::new(keys, hi);
    let mut out = Vec::new();
    for j in 0..keys.len() {
        if hi[j].is_null() {
            break;
        }
        let piece = h.prefix(j, p);
        let w = h.get(j, p);
        out.push(piece.with(j, format!("{} < {w}", quote_ident(&keys[j].name))));
    }
    out
}

/// The rows of a range with only an upper bound: those below `hi` and, as
/// `range_condition` keeps them, every row with a NULL key column. Each row
/// is in the piece of the first column where it leaves `hi`'s prefix: with
/// `k1 = w1 AND … AND k(j-1) = w(j-1)`, `kj IS NULL`, `kj < wj`, or
/// `kj > wj` (`kj IS NOT NULL` when `wj` is NULL) with a NULL in a later
/// column. The last kind cannot seek past column j (its rows are wherever a
/// later column is NULL); on NOT NULL columns, a primary key's, its `IS NULL`
/// tests are contradictions the optimizer removes before the plan is built.
fn upper_only_pieces(keys: &[KeyCol], hi: &[SqlValue], p: &mut Params) -> Vec<Piece> {
    let mut h = BoundHolders::new(keys, hi);
    let n = keys.len();
    let mut out = Vec::new();
    for j in 0..n {
        let prefix = h.prefix(j, p);
        let col = quote_ident(&keys[j].name);
        out.push(prefix.clone().with(j, format!("{col} IS NULL")));
        let later_null = if j + 1 < n {
            let nulls: Vec<String> = keys[j + 1..].iter().map(|k| format!("{} IS NULL", quote_ident(&k.name))).collect();
            Some(if nulls.len() == 1 { nulls.join("") } else { format!("({})", nulls.join(" OR ")) })
        } else {
            None
        };
        if hi[j].is_null() {
            if let Some(tail) = later_null {
                let mut piece = prefix.not_null(keys, j);
                piece.tail = Some(tail);
                out.push(piece);
            }
            break;
        }
        let w = h.get(j, p);
        out.push(prefix.clone().with(j, format!("{col} < {w}")));
        if let Some(tail) = later_null {
            let mut piece = prefix.with(j, format!("{col} > {w}"));
            piece.tail = Some(tail);
            out.push(piece);
        }
    }
    out
}

/// A composite key's range cut into pieces that share no row and together
/// hold exactly the rows [`range_condition`] selects, each a conjunction an
/// index on the key columns can seek: equalities on a prefix of the columns,
/// then a range on the next one. With both bounds a piece is a lower piece
/// and an upper one together (a row in the range is in one of each); its
/// prefix columns then carry an equality from each bound, of which the seek
/// uses one and checks the other. None for a piece without a condition (the
/// whole table). A range no row can be in is the one piece `1 = 0`.
fn seek_pieces(keys: &[KeyCol], range: &KeyRange, p: &mut Params) -> Result<Vec<Option<String>>, String> {
    for b in [&range.lo, &range.hi].into_iter().flatten() {
        if b.len() != keys.len() {
            return Err(format!("a range bound has {} values for {} key columns", b.len(), keys.len()));
        }
    }
    let pieces: Vec<Piece> = match (&range.lo, &range.hi) {
        (None, None) => vec![Piece::default()],
        (Some(lo), None) => lower_pieces(keys, lo, p),
        (None, Some(hi)) => upper_only_pieces(keys, hi, p),
        // Nothing sorts below NULL: no row is below a bound that starts with it.
        (Some(_), Some(hi)) if matches!(hi.first(), None | Some(SqlValue::Null)) => Vec::new(),
        (Some(lo), Some(hi)) => {
            let lower = lower_pieces(keys, lo, p);
            let upper = below_pieces(keys, hi, p);
            lower.iter().flat_map(|l| upper.iter().map(move |u| l.and(u))).collect()
        }
    };
    if pieces.is_empty() {
        return Ok(vec![Some("1 = 0".into())]);
    }
    Ok(pieces.iter().map(Piece::sql).collect())
}

/// `sys.sp_spaceused` of the table (its `rows` column is the estimate).
pub fn row_estimate(table: &TableName) -> Statement {
    Statement::new("EXEC sys.sp_spaceused @objname = @P1".into(), vec![object_name_value(table)])
}

/// `sys.fn_cdc_map_time_to_lsn(op, t)`; `t` goes through datetime as the function's parameter does.
pub fn time_to_lsn(op: TimeOp, local_time: NaiveDateTime) -> Statement {
    Statement::new(
        "SELECT sys.fn_cdc_map_time_to_lsn(@P1, CAST(@P2 AS datetime)) AS lsn".into(),
        vec![SqlValue::Str(op.sql_literal().into()), SqlValue::DateTime(local_time)],
    )
}

/// `sys.fn_cdc_map_lsn_to_time(lsn)`.
pub fn lsn_to_time(lsn: Lsn) -> Statement {
    Statement::new("SELECT sys.fn_cdc_map_lsn_to_time(@P1) AS tran_end_time".into(), vec![SqlValue::Bytes(lsn.0.to_vec())])
}

/// The server's wall clock, at `datetime2(7)` precision.
pub fn server_now() -> Statement {
    Statement::new("SELECT SYSDATETIME() AS server_now".into(), vec![])
}

/// The server's zone name (SQL Server 2022 and Azure SQL; older servers answer
/// with error 195 and the configured zone is used instead).
pub fn server_time_zone() -> Statement {
    Statement::new("SELECT CURRENT_TIMEZONE_ID() AS zone_id".into(), vec![])
}

/// How the server turns a UTC instant into its own wall-clock time, the
/// clock `cdc.lsn_time_mapping` is written in. Either way the server does the
/// arithmetic: rules compiled into this program can differ from the Windows
/// rules the server applies, and then a looked-up time lands an hour off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalConversion {
    /// `AT TIME ZONE` with a Windows zone name as `sys.time_zone_info` spells
    /// it (SQL Server 2016 and later): the server's rules for that zone, DST
    /// included, at the instant converted.
    AtTimeZone(String),
    /// The offset the server's clock runs at when the statement runs
    /// (`SYSDATETIMEOFFSET()`): servers without `AT TIME ZONE`, or a zone
    /// configured as a fixed offset. Right for instants under the same offset
    /// as now; across a DST change an hour off.
    CurrentOffset,
}

/// The server's wall-clock time at each instant, computed by the server (see
/// [`LocalConversion`]). Each instant is bound as a `datetimeoffset` at
/// +00:00 and comes back as `datetime2(7)`, its offset dropped: the local
/// reading, before any `datetime` rounding. Columns: `local_0`, `local_1`, …,
/// one per instant, in order. `instants` must not be empty.
pub fn local_times(conversion: &LocalConversion, instants: &[DateTime<Utc>]) -> Statement {
    let mut p = Params::default();
    let utc = FixedOffset::east_opt(0).expect("zero offset");
    match conversion {
        LocalConversion::AtTimeZone(zone) => {
            let z = p.bind(SqlValue::Str(zone.clone()));
            let cols: Vec<String> = instants
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let at = p.bind(SqlValue::DateTimeOffset(t.with_timezone(&utc)));
                    format!("CAST(({at} AT TIME ZONE {z}) AS datetime2(7)) AS local_{i}")
                })
                .collect();
            Statement::new(format!("SELECT {}", cols.join(", ")), p.0)
        }
        LocalConversion::CurrentOffset => {
            let cols: Vec<String> = instants
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let at = p.bind(SqlValue::DateTimeOffset(t.with_timezone(&utc)));
                    format!("CAST(SWITCHOFFSET({at}, c.offset_minutes) AS datetime2(7)) AS local_{i}")
                })
                .collect();
            Statement::new(
                format!("SELECT {} FROM (SELECT DATEPART(TZOFFSET, SYSDATETIMEOFFSET()) AS offset_minutes) AS c", cols.join(", ")),
                p.0,
            )
        }
    }
}

/// The offset the server's clock runs at now, in minutes east of UTC, and the
/// UTC instant it was read at (both from one `SYSDATETIMEOFFSET()` reading),
/// to check a configured zone against. Columns: offset_minutes, utc_now
/// (datetime2(7)). Every version CDC runs on has both functions.
pub fn server_clock() -> Statement {
    Statement::new(
        "SELECT DATEPART(TZOFFSET, c.server_now) AS offset_minutes, CAST(SWITCHOFFSET(c.server_now, '+00:00') AS datetime2(7)) AS utc_now \
         FROM (SELECT SYSDATETIMEOFFSET() AS server_now) AS c"
            .into(),
        vec![],
    )
}

/// A Windows zone name as the server knows it (`sys.time_zone_info`, SQL
/// Server 2016 and later): its spelling there, the offset the server's own
/// rules give that zone now, and the offset the server's clock runs at now,
/// from one reading. No row when the server has no zone of that name; older
/// servers fail the statement (no `AT TIME ZONE`, no view). Columns: name,
/// zone_offset_minutes, server_offset_minutes.
pub fn zone_rules_offset(windows_name: &str) -> Statement {
    Statement::new(
        "SELECT z.name, DATEPART(TZOFFSET, c.server_now AT TIME ZONE z.name) AS zone_offset_minutes, \
         DATEPART(TZOFFSET, c.server_now) AS server_offset_minutes \
         FROM (SELECT SYSDATETIMEOFFSET() AS server_now) AS c CROSS JOIN sys.time_zone_info AS z WHERE z.name = @P1"
            .into(),
        vec![SqlValue::Str(windows_name.to_string())],
    )
}

/// Sent with `simple_query` on the connection before a read, and back after.
pub fn set_isolation(level: crate::source::Isolation) -> &'static str {
    match level {
        crate::source::Isolation::ReadCommitted => "SET TRANSACTION ISOLATION LEVEL READ COMMITTED",
        crate::source::Isolation::Snapshot => "SET TRANSACTION ISOLATION LEVEL SNAPSHOT",
    }
}

/// Reconcile's tier 1 for a key that is not one integer or date column:
/// the table's rows, counted on the server. Column: n.
pub fn row_count(table: &TableName) -> Statement {
    Statement::new(format!("SELECT COUNT_BIG(*) AS n FROM {}", quote_table(table)), vec![])
}

/// Reconcile's tier 1 for one date or date-and-time key: [`bucket_sums`]
/// over the microseconds from 0001-01-01 to each value
/// (`DATEDIFF_BIG(MICROSECOND, ...)` counts the microsecond boundaries
/// crossed, so a datetime2(7) value is rounded down, as silver holds it; the
/// largest, 9999-12-31, is about 3.2e17 and fits bigint). NULL keys are not
/// counted. Columns: slice_start, n, key_sum (decimal(38,0)).
pub fn date_bucket_sums(table: &TableName, key: &str, lo: i64, hi: i64, width: i64) -> Statement {
    let mut p = Params::default();
    let (lo_p, hi_p, w_p) = (p.bind(SqlValue::Int(lo)), p.bind(SqlValue::Int(hi)), p.bind(SqlValue::Int(width)));
    let k = quote_ident(key);
    Statement::new(
        format!(
            "SELECT s.slice_start, COUNT_BIG(*) AS n, SUM(s.k) AS key_sum FROM (\
             SELECT CAST({lo_p} + (d.dist - d.dist % {w_p}) AS bigint) AS slice_start, d.k FROM (\
             SELECT CAST(x.us AS decimal(38,0)) AS k, CAST(x.us AS decimal(38,0)) - {lo_p} AS dist FROM (\
             SELECT DATEDIFF_BIG(MICROSECOND, CAST('00010101' AS datetime2(7)), {k}) AS us FROM {t} WHERE {k} IS NOT NULL) AS x \
             WHERE x.us BETWEEN {lo_p} AND {hi_p}) AS d) AS s \
             GROUP BY s.slice_start ORDER BY s.slice_start",
            t = quote_table(table),
        ),
        p.0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Isolation;
    use chrono::NaiveDate;
    use deltalake::datafusion::sql::sqlparser::dialect::MsSqlDialect;
    use deltalake::datafusion::sql::sqlparser::parser::Parser;

    fn golden(name: &str, s: &Statement) {
        // Every statement must parse as T-SQL: a syntax slip shows here, without a server.
        if let Err(e) = Parser::parse_sql(&MsSqlDialect {}, &s.sql) {
            panic!("{name}: sqlparser rejects the statement: {e}\n{}", s.sql);
        }
        insta::with_settings!({snapshot_path => "../../snapshots", prepend_module_to_snapshot => false}, {
            insta::assert_snapshot!(format!("mssql__{name}"), s.to_string());
        });
    }

    fn odd_table() -> TableName {
        TableName::new("sales ]data", "Order's Ünïcode]")
    }

    fn key(name: &str, t: SqlType) -> KeyCol {
        KeyCol { name: name.into(), sql_type: t }
    }

    fn cols() -> Vec<ColumnDesc> {
        vec![
            ColumnDesc::new("id", SqlType::Int, false),
            ColumnDesc::new("na]me", SqlType::NVarChar { len: Some(40) }, true),
            ColumnDesc::new("prix €", SqlType::Money, true),
            ColumnDesc::new("small", SqlType::SmallMoney, true),
        ]
    }

    #[test]
    fn quoting_follows_quotename() {
        assert_eq!(quote_ident("a]b"), "[a]]b]");
        assert_eq!(quote_ident("it's"), "[it's]");
        assert_eq!(quote_ident("x]]"), "[x]]]]]");
        assert_eq!(quote_table(&odd_table()), "[sales ]]data].[Order's Ünïcode]]]");
        assert_eq!(all_changes_function("dbo_t]x"), "cdc.[fn_cdc_get_all_changes_dbo_t]]x]");
    }

    #[test]
    fn lsn_statements() {
        let l = Lsn::from_parts(0x31, 0xda0, 1);
        golden("max_lsn", &max_lsn());
        golden("min_lsn", &min_lsn("dbo_Orders"));
        golden("increment_lsn", &increment_lsn(l));
        golden("decrement_lsn", &decrement_lsn(l));
        golden("lsn_to_time", &lsn_to_time(l));
        golden("server_now", &server_now());
        let t = NaiveDate::from_ymd_opt(2026, 3, 8).unwrap().and_hms_milli_opt(1, 2, 3, 456).unwrap();
        for (name, op) in [
            ("time_to_lsn_lt", TimeOp::LargestLessThan),
            ("time_to_lsn_le", TimeOp::LargestLessThanOrEqual),
            ("time_to_lsn_gt", TimeOp::SmallestGreaterThan),
            ("time_to_lsn_ge", TimeOp::SmallestGreaterThanOrEqual),
        ] {
            golden(name, &time_to_lsn(op, t));
        }
        golden("server_time_zone", &server_time_zone());
    }

    /// The seed's time-to-LSN lookup needs the server's wall clock at the
    /// copy's start; the server computes it. What goes out is the instant at
    /// +00:00 and the zone's name (or nothing but the instant, for the
    /// server's current offset), never a local time worked out here: a
    /// statement that carried one would be the client-side conversion back.
    #[test]
    fn local_times_are_converted_on_the_server() {
        use chrono::TimeZone;
        let first = Utc.with_ymd_and_hms(2026, 11, 1, 5, 30, 0).unwrap();
        let instants = [first, first + chrono::Duration::hours(1)];
        let named = local_times(&LocalConversion::AtTimeZone("Eastern Standard Time".into()), &instants);
        golden("local_times_named", &named);
        golden("local_times_utc", &local_times(&LocalConversion::AtTimeZone("UTC".into()), &instants[..1]));
        let fixed = local_times(&LocalConversion::CurrentOffset, &instants);
        golden("local_times_fixed_offset", &fixed);
        golden("server_clock", &server_clock());
        golden("zone_rules_offset", &zone_rules_offset("Eastern Standard Time"));

        assert!(named.sql.contains("AT TIME ZONE @P1"), "{}", named.sql);
        assert_eq!(named.params[0], SqlValue::Str("Eastern Standard Time".into()));
        assert!(fixed.sql.contains("DATEPART(TZOFFSET, SYSDATETIMEOFFSET())"), "{}", fixed.sql);
        for (st, first_instant) in [(&named, 1), (&fixed, 0)] {
            let sent: Vec<&SqlValue> = st.params[first_instant..].iter().collect();
            assert_eq!(sent.len(), instants.len());
            for (p, t) in sent.into_iter().zip(instants) {
                match p {
                    SqlValue::DateTimeOffset(v) => {
                        assert_eq!(v.offset().local_minus_utc(), 0, "an instant goes out at +00:00: {v}");
                        assert_eq!(v.with_timezone(&Utc), t);
                    }
                    other => panic!("an instant must be bound as datetimeoffset, not {other:?}"),
                }
            }
            assert!(!st.params.iter().any(|p| matches!(p, SqlValue::DateTime(_))), "no local time is sent: {st}");
        }
    }

    #[test]
    fn catalog_statements() {
        let t = odd_table();
        golden("table_columns", &table_columns(&t));
        golden("table_unique_keys", &table_unique_keys(&t));
        golden("capture_instances", &capture_instances(&t));
        golden("instance_catalog", &instance_catalog("dbo_Orders"));
        golden("captured_columns", &captured_columns(&t));
        golden("index_columns", &index_columns(&t));
        golden("database_cdc_enabled", &database_cdc_enabled());
        golden("row_estimate", &row_estimate(&t));
    }

    #[test]
    fn change_statements() {
        let (a, b) = (Lsn::from_parts(1, 2, 3), Lsn::from_parts(4, 5, 6));
        golden("changes_all", &changes("dbo_Orders", &cols(), a, b, RowFilter::All, true));
        golden("changes_update_old", &changes("odd ]ci'", &cols(), a, b, RowFilter::AllUpdateOld, true));
        golden("changes_no_command_id", &changes("dbo_Orders", &cols(), a, b, RowFilter::All, false));
        golden("change_table_has_command_id", &change_table_has_command_id("odd ]ci'"));
    }

    /// The change function never returns `__$command_id`: it must come from
    /// the change table, joined on the function's own row identity.
    #[test]
    fn command_id_comes_from_the_change_table() {
        let (a, b) = (Lsn::from_parts(1, 2, 3), Lsn::from_parts(4, 5, 6));
        let st = changes("dbo_Orders", &cols(), a, b, RowFilter::All, true);
        assert!(!st.sql.contains("c.[__$command_id]"), "the function has no __$command_id: {}", st.sql);
        assert!(st.sql.contains("JOIN cdc.[dbo_Orders_CT] AS t WITH (NOLOCK) ON t.[__$start_lsn] = c.[__$start_lsn]"), "{}", st.sql);
        assert!(st.sql.ends_with("ORDER BY c.[__$start_lsn], t.[__$command_id], c.[__$seqval], c.[__$operation]"), "{}", st.sql);
        assert_eq!(change_table("a]b"), "cdc.[a]]b_CT]");
    }

    #[test]
    fn snapshot_statements() {
        let t = odd_table();
        let read: Vec<ReadColumn> = cols().into_iter().map(|desc| ReadColumn { present: desc.name != "small", desc }).collect();
        let k1 = vec![key("id", SqlType::Int)];
        let k2 = vec![key("region ]x", SqlType::VarChar { len: Some(10) }), key("id", SqlType::BigInt)];
        let r = |lo: Option<Vec<SqlValue>>, hi: Option<Vec<SqlValue>>| KeyRange { lo, hi };
        golden("snapshot_all", &snapshot_read(&t, &read, &k1, &KeyRange::all()).unwrap());
        golden("snapshot_first", &snapshot_read(&t, &read, &k1, &r(None, Some(vec![SqlValue::Int(100)]))).unwrap());
        golden("snapshot_middle", &snapshot_read(&t, &read, &k1, &r(Some(vec![SqlValue::Int(100)]), Some(vec![SqlValue::Int(200)]))).unwrap());
        golden("snapshot_last", &snapshot_read(&t, &read, &k1, &r(Some(vec![SqlValue::Int(200)]), None)).unwrap());
        golden("snapshot_then_max_lsn", &snapshot_read_then_max_lsn(&t, &read, &k1, &r(Some(vec![SqlValue::Int(100)]), Some(vec![SqlValue::Int(200)]))).unwrap());
        golden("snapshot_fenced", &snapshot_read_fenced(&t, &read, &k1, &r(Some(vec![SqlValue::Int(100)]), Some(vec![SqlValue::Int(200)])), 20).unwrap());
        let lo = vec![SqlValue::Str("nord'".into()), SqlValue::Int(7)];
        let hi = vec![SqlValue::Str("süd".into()), SqlValue::Int(-1)];
        golden("snapshot_composite_first", &snapshot_read(&t, &read, &k2, &r(None, Some(lo.clone()))).unwrap());
        golden("snapshot_composite_middle", &snapshot_read(&t, &read, &k2, &r(Some(lo.clone()), Some(hi.clone()))).unwrap());
        golden("snapshot_composite_null_bound", &snapshot_read(&t, &read, &k2, &r(Some(vec![SqlValue::Str("a".into()), SqlValue::Null]), Some(vec![SqlValue::Null, SqlValue::Int(3)]))).unwrap());
        assert!(snapshot_read(&t, &read, &k2, &r(Some(vec![SqlValue::Int(1)]), None)).is_err());
    }

    #[test]
    fn planning_statements() {
        let t = odd_table();
        let k1 = vec![key("id", SqlType::Int)];
        let k2 = vec![key("region ]x", SqlType::VarChar { len: Some(10) }), key("id", SqlType::BigInt)];
        golden("key_extent_single", &key_extent(&t, &k1));
        golden("key_extent_composite", &key_extent(&t, &k2));
        golden("slice_counts", &slice_counts(&t, "id ]", i64::MIN, i64::MAX, 1 << 40));
        golden("bucket_sums", &bucket_sums(&t, "id ]", -10, 1_000, 100));
        golden("null_count", &null_count(&t, "id ]"));
        golden("slice_extent", &slice_extent(&t, "id ]", -5, i64::MAX));
        golden("key_seek_first", &key_seek(&t, &k1, &KeyRange::all(), 0).unwrap());
        let pairs = vec![
            (vec![SqlValue::Str("abc".into()), SqlValue::Int(1)], vec![SqlValue::Str("ABC".into()), SqlValue::Int(2)]),
            (vec![SqlValue::Null, SqlValue::Int(1)], vec![SqlValue::Str("a".into()), SqlValue::Int(0)]),
            (vec![SqlValue::Str("z".into()), SqlValue::Null], vec![SqlValue::Str("z".into()), SqlValue::Null]),
        ];
        golden("key_compare", &key_compare(&k2, &[Some("Latin1_General_CS_AS".into()), None], &pairs).unwrap());
        golden("column_collations", &column_collations(&t));
        assert!(key_compare(&k2, &[Some("x COLLATE y".into()), None], &pairs).is_err(), "a collation name is checked before it is spliced");
        let range = KeyRange { lo: Some(vec![SqlValue::Str("m".into()), SqlValue::Int(5)]), hi: Some(vec![SqlValue::Str("t".into()), SqlValue::Int(0)]) };
        golden("key_seek_composite", &key_seek(&t, &k2, &range, 1000).unwrap());
        assert!(key_seek(&t, &k1, &KeyRange::all(), u64::MAX).is_err());
        let single = KeyRange { lo: Some(vec![SqlValue::Int(100)]), hi: Some(vec![SqlValue::Int(200)]) };
        golden("key_seek_single", &key_seek(&t, &k1, &single, 99).unwrap());
        let k3 = vec![key("region ]x", SqlType::VarChar { len: Some(10) }), key("seq", SqlType::Int), key("id", SqlType::BigInt)];
        let after = KeyRange { lo: Some(vec![SqlValue::Str("m".into()), SqlValue::Int(5), SqlValue::Int(7)]), hi: None };
        golden("key_seek_three", &key_seek(&t, &k3, &after, 10).unwrap());
        let below = KeyRange { lo: None, hi: Some(vec![SqlValue::Str("t".into()), SqlValue::Int(0), SqlValue::Int(3)]) };
        golden("key_seek_three_below", &key_seek(&t, &k3, &below, 10).unwrap());
    }

    /// Every key seek, for one to three key columns and bounds with and
    /// without NULLs, parses as T-SQL; a composite range is one UNION ALL
    /// branch per piece, and every ORDER BY has the TOP that SQL Server
    /// requires of an ORDER BY in a derived table (error 1033 without it).
    #[test]
    fn key_seek_statements_parse_with_one_top_per_order_by() {
        let t = odd_table();
        let all_keys = vec![key("region ]x", SqlType::VarChar { len: Some(10) }), key("seq", SqlType::Int), key("id", SqlType::BigInt)];
        let values = |width: usize, null_at: Option<usize>| -> Vec<SqlValue> {
            (0..width).map(|i| if Some(i) == null_at { SqlValue::Null } else if i == 0 { SqlValue::Str("m".into()) } else { SqlValue::Int(i as i64) }).collect()
        };
        for width in 1..=3usize {
            let keys = &all_keys[..width];
            let mut bounds: Vec<Option<Vec<SqlValue>>> = vec![None, Some(values(width, None))];
            for i in 0..width {
                bounds.push(Some(values(width, Some(i))));
            }
            for lo in &bounds {
                for hi in &bounds {
                    let range = KeyRange { lo: lo.clone(), hi: hi.clone() };
                    let st = key_seek(&t, keys, &range, 41).unwrap();
                    if let Err(e) = Parser::parse_sql(&MsSqlDialect {}, &st.sql) {
                        panic!("sqlparser rejects the seek of {range:?}: {e}\n{}", st.sql);
                    }
                    assert_eq!(st.sql.matches("ORDER BY").count(), st.sql.matches("SELECT TOP (").count(), "{}", st.sql);
                    assert!(st.sql.starts_with("SELECT TOP (1) "), "{}", st.sql);
                    assert!(st.sql.ends_with(" DESC"), "{}", st.sql);
                    assert_eq!(st.params[0], SqlValue::Int(42));
                    let placeholders = (1..=st.params.len()).all(|i| st.sql.contains(&format!("@P{i}")));
                    assert!(placeholders && !st.sql.contains(&format!("@P{}", st.params.len() + 1)), "every parameter is used: {st}");
                    let unions = st.sql.matches(" UNION ALL ").count();
                    if width == 1 {
                        assert_eq!(unions, 0, "a one-column key stays one statement: {}", st.sql);
                    } else {
                        let mut p = Params::default();
                        let pieces = seek_pieces(keys, &range, &mut p).unwrap();
                        assert_eq!(unions + 1, pieces.len(), "{}", st.sql);
                        for w in pieces.iter().flatten() {
                            // A piece is a conjunction; its only OR is the tail of NULL tests.
                            assert!(w.split(" OR ").skip(1).all(|term| term.contains(" IS NULL")), "{w}");
                        }
                    }
                }
            }
        }
        let k2 = &all_keys[..2];
        assert!(key_seek(&t, k2, &KeyRange { lo: Some(vec![SqlValue::Int(1)]), hi: None }, 3).is_err(), "a bound of the wrong width is refused");
    }

    /// MAX + 1 of an int key (the last chunk's end) goes out as a bigint
    /// parameter compared with the column, never converted to the column's
    /// type (which fails with error 8115); a varchar bound keeps its cast.
    #[test]
    fn integer_bounds_are_never_cast_to_the_columns_type() {
        let t = odd_table();
        let read = vec![ReadColumn { desc: ColumnDesc::new("id", SqlType::Int, false), present: true }];
        for ty in [SqlType::TinyInt, SqlType::SmallInt, SqlType::Int, SqlType::BigInt] {
            let keys = vec![key("id", ty.clone())];
            let range = KeyRange { lo: Some(vec![SqlValue::Int(2_147_483_600)]), hi: Some(vec![SqlValue::Int(2_147_483_648)]) };
            let st = snapshot_read(&t, &read, &keys, &range).unwrap();
            assert!(st.sql.ends_with("WHERE ([id] >= @P1) AND ([id] IS NULL OR [id] < @P2)"), "{ty:?}: {}", st.sql);
            assert_eq!(st.params, vec![SqlValue::Int(2_147_483_600), SqlValue::Int(2_147_483_648)]);
            let seek = key_seek(&t, &keys, &range, 5).unwrap();
            assert!(!seek.sql.contains("CAST(@P"), "{ty:?}: {}", seek.sql);
        }
        let keys = vec![key("code", SqlType::VarChar { len: Some(4) })];
        let st = snapshot_read(&t, &read, &keys, &KeyRange { lo: None, hi: Some(vec![SqlValue::Str("m".into())]) }).unwrap();
        assert!(st.sql.contains("[code] < CAST(@P1 AS varchar(4))"), "{}", st.sql);
    }

    #[test]
    fn isolation_statements() {
        assert_eq!(set_isolation(Isolation::Snapshot), "SET TRANSACTION ISOLATION LEVEL SNAPSHOT");
        assert_eq!(set_isolation(Isolation::ReadCommitted), "SET TRANSACTION ISOLATION LEVEL READ COMMITTED");
    }

    /// The range predicates, run on SQLite (which reads bracketed names (without `]]`),
    /// `@Pn` parameters and NULL comparisons as SQL Server does), select exactly
    /// the rows `KeyRange::contains` puts in the range, NULL keys included.
    #[test]
    fn range_predicates_match_key_range_contains() {
        let db = rusqlite::Connection::open_in_memory().unwrap();
        db.execute_batch("CREATE TABLE [t x] (rid INTEGER, [a x] INTEGER, [b c] INTEGER)").unwrap();
        let dom = [None, Some(0i64), Some(1), Some(2)];
        let as_val = |v: Option<i64>| v.map(SqlValue::Int).unwrap_or(SqlValue::Null);
        let mut rows = Vec::new();
        for a in dom {
            for b in dom {
                let rid = rows.len() as i64;
                db.execute("INSERT INTO [t x] VALUES (?1, ?2, ?3)", rusqlite::params![rid, a, b]).unwrap();
                rows.push(vec![as_val(a), as_val(b)]);
            }
        }
        let table = TableName::new("main", "t x");
        let all_keys = vec![key("a x", SqlType::BigInt), key("b c", SqlType::BigInt)];
        for width in [1usize, 2] {
            let keys = &all_keys[..width];
            let read = vec![ReadColumn { desc: ColumnDesc::new("rid", SqlType::BigInt, false), present: true }];
            let mut bounds: Vec<Option<Vec<SqlValue>>> = vec![None];
            for r in &rows {
                bounds.push(Some(r[..width].to_vec()));
            }
            for lo in &bounds {
                for hi in &bounds {
                    let range = KeyRange { lo: lo.clone(), hi: hi.clone() };
                    let st = snapshot_read(&table, &read, keys, &range).unwrap();
                    let mut q = db.prepare(&st.sql).unwrap_or_else(|e| panic!("{e}: {}", st.sql));
                    for (i, p) in st.params.iter().enumerate() {
                        let idx = q.parameter_index(&format!("@P{}", i + 1)).unwrap().unwrap();
                        let SqlValue::Int(v) = p else { panic!("{p:?}") };
                        q.raw_bind_parameter(idx, v).unwrap();
                    }
                    let mut got = std::collections::BTreeSet::new();
                    let mut rs = q.raw_query();
                    while let Some(r) = rs.next().unwrap() {
                        got.insert(r.get::<_, i64>(0).unwrap());
                    }
                    let want: std::collections::BTreeSet<i64> =
                        rows.iter().enumerate().filter(|(_, r)| range.contains(&r[..width])).map(|(i, _)| i as i64).collect();
                    assert_eq!(got, want, "range {range:?}\n{}", st.sql);
                }
            }
        }
    }

    /// The pieces of a composite seek, run on SQLite as in the test above,
    /// share no row and together hold exactly the rows `KeyRange::contains`
    /// puts in the range (a row in two pieces would count twice under
    /// UNION ALL), NULL keys included, for two and three key columns.
    #[test]
    fn seek_pieces_partition_the_range() {
        let db = rusqlite::Connection::open_in_memory().unwrap();
        db.execute_batch("CREATE TABLE [t x] (rid INTEGER, [a x] INTEGER, [b c] INTEGER, [d] INTEGER)").unwrap();
        let dom = [None, Some(0i64), Some(1), Some(2)];
        let as_val = |v: Option<i64>| v.map(SqlValue::Int).unwrap_or(SqlValue::Null);
        let mut rows = Vec::new();
        for a in dom {
            for b in dom {
                for d in &dom[..3] {
                    let rid = rows.len() as i64;
                    db.execute("INSERT INTO [t x] VALUES (?1, ?2, ?3, ?4)", rusqlite::params![rid, a, b, d]).unwrap();
                    rows.push(vec![as_val(a), as_val(b), as_val(*d)]);
                }
            }
        }
        let all_keys = vec![key("a x", SqlType::BigInt), key("b c", SqlType::BigInt), key("d", SqlType::BigInt)];
        for width in [2usize, 3] {
            let keys = &all_keys[..width];
            let mut seen = std::collections::BTreeSet::new();
            let mut bounds: Vec<Option<Vec<SqlValue>>> = vec![None];
            for r in &rows {
                if seen.insert(format!("{:?}", &r[..width])) {
                    bounds.push(Some(r[..width].to_vec()));
                }
            }
            for lo in &bounds {
                for hi in &bounds {
                    let range = KeyRange { lo: lo.clone(), hi: hi.clone() };
                    let mut p = Params::default();
                    let pieces = seek_pieces(keys, &range, &mut p).unwrap();
                    let mut got: Vec<i64> = Vec::new();
                    for piece in &pieces {
                        let sql = match piece {
                            Some(w) => format!("SELECT rid FROM [t x] WHERE {w}"),
                            None => "SELECT rid FROM [t x]".to_string(),
                        };
                        let mut q = db.prepare(&sql).unwrap_or_else(|e| panic!("{e}: {sql}"));
                        for (i, v) in p.0.iter().enumerate() {
                            if let Some(idx) = q.parameter_index(&format!("@P{}", i + 1)).unwrap() {
                                let SqlValue::Int(v) = v else { panic!("{v:?}") };
                                q.raw_bind_parameter(idx, v).unwrap();
                            }
                        }
                        let mut rs = q.raw_query();
                        while let Some(r) = rs.next().unwrap() {
                            got.push(r.get::<_, i64>(0).unwrap());
                        }
                    }
                    got.sort_unstable();
                    let want: Vec<i64> =
                        rows.iter().enumerate().filter(|(_, r)| range.contains(&r[..width])).map(|(i, _)| i as i64).collect();
                    assert_eq!(got, want, "range {range:?} (a row twice is in two pieces)\n{pieces:#?}");
                }
            }
        }
    }

    #[test]
    fn clr_typed_columns_are_not_lost_by_the_catalog_join() {
        // geography, geometry and hierarchyid have system_type_id 240, which is
        // no sys.types row's user_type_id: joining on it alone drops them.
        let t = TableName::new("dbo", "t");
        for s in [table_columns(&t), captured_columns(&t)] {
            assert!(!s.sql.contains("ty.user_type_id = c.system_type_id "), "{}", s.sql);
            assert!(s.sql.contains("WHEN c.system_type_id = 240 THEN c.user_type_id"), "{}", s.sql);
        }
        assert!(captured_columns(&t).sql.contains("cc.is_computed"));
    }

    #[test]
    fn reconcile_tier1_statements() {
        let t = odd_table();
        golden("row_count", &row_count(&t));
        golden("date_bucket_sums", &date_bucket_sums(&t, "day ]", 63_900_000_000_000_000, 63_999_999_999_999_999, 86_400_000_000));
    }
}
