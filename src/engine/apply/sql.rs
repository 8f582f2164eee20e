//! The SQL text silver's MERGE joins on: quoted identifiers and the
//! null-safe key match, shared by keyed silver and a heap's (`heap`).

use crate::types::{ColumnDesc, SqlType};

/// A quoted SQL identifier.
pub fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The join of silver (`target`) and a MERGE's source on these columns,
/// null-safe: a NULL in a key column is a value of its own, as the dedup's
/// PARTITION BY, the rebuild and reconcile already take it. With `=`, a
/// change of the row whose key is NULL matched nothing, so it inserted a
/// second copy and its delete never removed one. A column that cannot hold
/// NULL keeps `=`, which deltalake also uses to skip silver files by their
/// key statistics. A nullable one is matched by two equalities, so the join
/// stays a hash join on keys that are never NULL: `COALESCE(k, x)` with a
/// stand-in x of the column's type, and `k IS NULL`, which tells a NULL from
/// a real x. (`IS NOT DISTINCT FROM` alone did not match NULLs in the MERGE's
/// join here: the NULL-key row was inserted again; it stays the fallback for
/// types without a stand-in.)
pub fn key_match(columns: &[ColumnDesc]) -> String {
    key_match_between(columns, "target", "source")
}

/// [`key_match`] between any two aliases.
pub(super) fn key_match_between(columns: &[ColumnDesc], a: &str, b: &str) -> String {
    columns
        .iter()
        .map(|k| {
            let c = ident(&k.name);
            match (k.nullable, null_stand_in(&k.sql_type)) {
                (false, _) => format!("{a}.{c} = {b}.{c}"),
                // A timestamp's stand-in literal made deltalake's MERGE fail
                // to print its predicate ("Unable to convert expression to
                // string", exit 1, found by a heap with a nullable datetime2
                // column): compare its microseconds as BIGINT instead.
                (true, _) if matches!(k.sql_type, SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. }) => format!(
                    "COALESCE(CAST({a}.{c} AS BIGINT), 0) = COALESCE(CAST({b}.{c} AS BIGINT), 0) AND ({a}.{c} IS NULL) = ({b}.{c} IS NULL)"
                ),
                (true, Some(x)) => format!("COALESCE({a}.{c}, {x}) = COALESCE({b}.{c}, {x}) AND ({a}.{c} IS NULL) = ({b}.{c} IS NULL)"),
                (true, None) => format!("{a}.{c} IS NOT DISTINCT FROM {b}.{c}"),
            }
        })
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// A literal of the column's Arrow type that stands in for NULL in [`key_match`].
fn null_stand_in(ty: &SqlType) -> Option<&'static str> {
    use SqlType::*;
    match ty {
        t if t.is_integer() => Some("0"),
        Decimal { .. } | Money | SmallMoney | Float | Real => Some("0"),
        Bit => Some("false"),
        Char { .. } | VarChar { .. } | NChar { .. } | NVarChar { .. } | Text | NText | Xml | UniqueIdentifier | Time { .. } => Some("''"),
        Date => Some("CAST('1970-01-01' AS DATE)"),
        DateTime | SmallDateTime | DateTime2 { .. } => Some("CAST('1970-01-01T00:00:00' AS TIMESTAMP)"),
        _ => None,
    }
}
