//! What a permission failure asks the DBA to run: the `GRANT` (or `ALTER
//! ROLE … ADD MEMBER`) statement a step is missing, worked out from what the
//! server said and what the client knows about the read.
//!
//! # The least set of grants, and why per object
//!
//! docs/sqlserver.md ("A read-only login") lists the grants each step needs;
//! this module is where a missing one is named. The set is per object, not
//! `SELECT ON SCHEMA::cdc`: a schema grant is SELECT on every change table
//! `cdc.<instance>_CT` of the database, and a direct read of a change table
//! is an ordinary SELECT, which none of CDC's own checks (SELECT on the
//! captured columns, the gating role) guards. With it, a login meant for one
//! table reads the change data of all of them. The client needs, per
//! replicated table:
//!
//! * SELECT on the columns the capture instance captures (the snapshot reads,
//!   key ranges and counts read them; CDC opens an instance's change data only
//!   to a login with SELECT on every captured column, and membership of its
//!   gating role when it has one);
//! * SELECT on `cdc.change_tables`, `cdc.captured_columns` and
//!   `cdc.index_columns` (the catalog reads: names, LSNs, types, never data);
//! * SELECT on `cdc.lsn_time_mapping` (commit times of LSNs; no data);
//! * SELECT on the change function `cdc.fn_cdc_get_all_changes_<instance>`,
//!   which applies CDC's checks itself;
//! * SELECT on four columns of the change table, `__$start_lsn`, `__$seqval`,
//!   `__$operation` and `__$command_id`: the change read joins the function's
//!   rows to the change table only for `__$command_id` (see `sql`'s module
//!   docs), and those columns are positions and operation codes, not the
//!   captured values. The grant also makes the table's columns visible in
//!   `sys.columns`, which `sql::captured_columns` reads the change table's
//!   types from: "if a user has been granted some permission on a table, the
//!   user can view the metadata for the table['s] columns" (Microsoft, Metadata
//!   Visibility Configuration, "Visibility of subcomponent metadata").
//!
//! No statement had to change to work with exactly these grants: every read
//! of change data already goes through the function, and the one direct read
//! of a change table needs only the ordering columns. Two reads were added,
//! both of `cdc.change_tables` only, to name what a login lacks: the gating
//! role (`role_name`) in `sql::capture_instances`, and `sql::instance_catalog`
//! when `sys.fn_cdc_get_min_lsn` answers all zeros.
//!
//! # From the server's message to the statement
//!
//! Error 229 names the object ("The SELECT permission was denied on the
//! object 'change_tables', database 'Sales', schema 'cdc'."), error 230 the
//! column too ("… on the column 'price' of the object 'items', …"). The
//! statement is then `GRANT SELECT ON OBJECT::[schema].[object] TO [login]`,
//! with the column list for 230, except for two objects whose least grant is
//! not what the message alone suggests:
//!
//! * the change function answers 229 naming itself both when the login lacks
//!   SELECT on it and when CDC's own check fails (a captured column without
//!   SELECT, or a gating role the login is not in): Microsoft's page on
//!   `cdc.fn_cdc_get_all_changes_<capture_instance>` documents exactly that
//!   message for the latter. The message names all three, with the instance's
//!   table, columns and role when the client read them;
//! * a change table's least grant is its four ordering columns, not the
//!   whole table (which is every captured value of every change).
//!
//! Two failures come without an error number, and are named here too:
//! `sys.fn_cdc_get_min_lsn` answers all zeros to a login the instance's
//! change data is closed to ([`read_min_lsn`] tells that from "no bound yet"
//! by the instance's `start_lsn` in `cdc.change_tables`), and the catalog
//! shows no row of a table the login has no permission on ([`table_hidden`],
//! [`change_table_hidden`]).

use crate::lsn::Lsn;
use crate::source::{SourceError, TableName};

use super::sql::{quote_ident, quote_table};

/// The columns of a change table the change read selects directly (the
/// join columns and `__$command_id`): positions and operation codes only.
pub const CHANGE_TABLE_ORDER_COLUMNS: [&str; 4] = ["__$start_lsn", "__$seqval", "__$operation", "__$command_id"];

/// Where docs/sqlserver.md lists the grants of every step.
const DOCS: &str = "docs/sqlserver.md, \"A read-only login\", lists the grants of every step";

/// What CDC checks of a caller before it opens a capture instance's change
/// data: SELECT on every captured column of the source table, and
/// membership of the gating role when the instance has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceGrants {
    pub capture_instance: String,
    /// The source table.
    pub table: TableName,
    /// The captured columns, by the names the source table gives them.
    pub columns: Vec<String>,
    /// `cdc.change_tables.role_name`.
    pub gating_role: Option<String>,
}

/// The row `cdc.change_tables` holds for one capture instance, read when
/// `sys.fn_cdc_get_min_lsn` answered all zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceCatalog {
    /// `start_lsn`: NULL while SQL Server has not established the low end.
    pub start_lsn: Option<Lsn>,
    /// What the change data needs of a caller (the columns may be unknown: empty).
    pub grants: InstanceGrants,
}

/// The parts of a 229 or 230 message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// `SELECT`, `EXECUTE`, …
    pub permission: String,
    /// The column, for error 230.
    pub column: Option<String>,
    pub object: String,
    pub database: String,
    pub schema: String,
}

/// Reads SQL Server's message of error 229 ("The SELECT permission was
/// denied on the object 'o', database 'd', schema 's'.") or 230 ("The SELECT
/// permission was denied on the column 'c' of the object 'o', database 'd',
/// schema 's'."). None for any other text (another language, a message
/// reworded by a later version): the caller then names no statement.
pub fn parse_denial(msg: &str) -> Option<Denial> {
    let rest = msg.trim().strip_prefix("The ")?;
    let (permission, rest) = rest.split_once(" permission was denied on the ")?;
    let (column, rest) = match rest.strip_prefix("column '") {
        Some(r) => {
            let (c, r) = r.split_once("' of the ")?;
            (Some(c.to_string()), r)
        }
        None => (None, rest),
    };
    let rest = rest.strip_prefix("object '")?;
    let (object, rest) = rest.split_once("', database '")?;
    let (database, rest) = rest.split_once("', schema '")?;
    let schema = rest.trim_end().trim_end_matches('.').strip_suffix('\'')?;
    if permission.is_empty() || object.is_empty() || schema.is_empty() {
        return None;
    }
    Some(Denial { permission: permission.to_string(), column, object: object.to_string(), database: database.to_string(), schema: schema.to_string() })
}

/// The grantee as a delimited identifier, or a placeholder when the client
/// does not know the login.
fn grantee(login: Option<&str>) -> String {
    login.map(quote_ident).unwrap_or_else(|| "<the login>".into())
}

/// `GRANT SELECT ON OBJECT::[s].[t] ([a], [b]) TO [login]` (no column list when `columns` is empty).
pub fn grant_select(table: &TableName, columns: &[String], login: Option<&str>) -> String {
    let list = if columns.is_empty() { String::new() } else { format!(" ({})", columns.iter().map(|c| quote_ident(c)).collect::<Vec<_>>().join(", ")) };
    format!("GRANT SELECT ON OBJECT::{}{list} TO {}", quote_table(table), grantee(login))
}

/// `ALTER ROLE [role] ADD MEMBER [login]`.
pub fn add_member(role: &str, login: Option<&str>) -> String {
    format!("ALTER ROLE {} ADD MEMBER {}", quote_ident(role), grantee(login))
}

/// The least grant on a capture instance's change table: its ordering columns.
pub fn grant_change_table(capture_instance: &str, login: Option<&str>) -> String {
    let cols: Vec<String> = CHANGE_TABLE_ORDER_COLUMNS.iter().map(|c| c.to_string()).collect();
    grant_select(&TableName::new("cdc", format!("{capture_instance}_CT")), &cols, login)
}

/// What CDC's own check asks: SELECT on the captured columns, and the gating
/// role when there is one (or a pointer to `role_name` when the client does
/// not know the instance).
fn cdc_check_fix(instance: Option<&InstanceGrants>, login: Option<&str>) -> String {
    match instance {
        Some(i) => {
            let cols = grant_select(&i.table, &i.columns, login);
            match &i.gating_role {
                Some(r) => format!("{cols}; and, as the instance's gating role is {}, {}", quote_ident(r), add_member(r, login)),
                None => cols,
            }
        }
        None => format!(
            "SELECT on every column the capture instance captures ({}), and membership of its gating role when \
             cdc.change_tables.role_name names one ({})",
            grant_select(&TableName::new("<schema>", "<table>"), &["<captured columns>".to_string()], login),
            add_member("<gating role>", login)
        ),
    }
}

/// The statement a 229 or 230 asks for, with the two CDC objects whose least
/// grant the message alone does not give (see the module docs).
fn fix_for(d: &Denial, login: Option<&str>, instance: Option<&InstanceGrants>) -> String {
    let object = TableName::new(d.schema.clone(), d.object.clone());
    let in_cdc = d.schema.eq_ignore_ascii_case("cdc");
    let lower = d.object.to_ascii_lowercase();
    if in_cdc && d.column.is_none() && lower.starts_with("fn_cdc_get_all_changes_") {
        // The prefix is ASCII, so its length in bytes is where the instance's name starts.
        let ci = &d.object["fn_cdc_get_all_changes_".len()..];
        let instance = instance.filter(|i| i.capture_instance.eq_ignore_ascii_case(ci));
        return format!(
            "GRANT {} ON OBJECT::{} TO {}. The change function answers with this same error when CDC's own check fails, so \
             the login may lack, instead: {}. To tell which: sys.fn_cdc_get_min_lsn(N'{}') answers 0x00000000000000000000 to \
             this login when it is CDC's check",
            d.permission,
            quote_table(&object),
            grantee(login),
            cdc_check_fix(instance, login),
            ci.replace('\'', "''"),
        );
    }
    if in_cdc && d.column.is_none() && lower.ends_with("_ct") {
        let ci = &d.object[..d.object.len() - 3];
        return format!(
            "{} (its ordering columns only: they hold no captured value; leave [__$command_id] out on a change table from \
             before KB3030352, which lacks it)",
            grant_change_table(ci, login)
        );
    }
    match &d.column {
        Some(c) => format!("GRANT {} ON OBJECT::{} ({}) TO {}", d.permission, quote_table(&object), quote_ident(c), grantee(login)),
        None => format!("GRANT {} ON OBJECT::{} TO {}", d.permission, quote_table(&object), grantee(login)),
    }
}

/// The message of a permission error the server reported (229, 230), with
/// the statement that fixes it when the message names the object.
pub fn denial_message(code: u32, msg: &str, login: Option<&str>, instance: Option<&InstanceGrants>) -> String {
    match parse_denial(msg) {
        Some(d) => format!("SQL Server error {code}: {msg} Run, as a database owner: {} ({DOCS})", fix_for(&d, login, instance)),
        None => format!("SQL Server error {code}: {msg} ({DOCS})"),
    }
}

/// The message of error 15009 ("The object '[dbo].[items]' does not exist in
/// database 'Sales' or is invalid for this operation.", from `sp_spaceused`),
/// which a login without a permission on the object gets as well.
pub fn hidden_object_message(msg: &str, login: Option<&str>) -> String {
    // sp_spaceused repeats @objname as it was passed: the client passes it quoted.
    let object = msg.split_once("The object '").and_then(|(_, r)| r.split_once("' does not exist")).map(|(o, _)| o).unwrap_or("<the table>");
    format!(
        "SQL Server error 15009: {msg} The object may exist and be hidden from the login: the catalog shows an object only to \
         a login with a permission on it. If it exists, run, as a database owner: GRANT SELECT ON OBJECT::{object} TO {} ({DOCS})",
        grantee(login)
    )
}

/// The error for a table the catalog does not show: it does not exist, or
/// the login has no permission on it (a catalog row, `OBJECT_ID` and
/// `sp_spaceused` show only what the caller has some permission on, and the
/// two cannot be told apart from the client).
pub fn table_hidden(table: &TableName, login: Option<&str>) -> SourceError {
    SourceError::Config(format!(
        "table {table} does not exist in the database, or the login cannot see it: the catalog shows a table only to a login \
         with a permission on it. If it exists, run, as a database owner: {} (or the same on the columns its capture instance \
         captures, a column list after the table name) ({DOCS})",
        grant_select(table, &[], login)
    ))
}

/// The error for a capture instance the catalog lists without a captured
/// column: `sql::captured_columns` reads the columns' types from the change
/// table's `sys.columns`, which shows nothing to a login without a
/// permission on that table. Left as it is, the instance would look as if it
/// captured nothing (and its change table as if it had no `__$command_id`).
pub fn change_table_hidden(capture_instance: &str, login: Option<&str>) -> SourceError {
    SourceError::Permission(format!(
        "capture instance '{capture_instance}' shows this login no captured column: the catalog lists a change table's columns \
         only to a login with a permission on it. Run, as a database owner: {} ({DOCS})",
        grant_change_table(capture_instance, login)
    ))
}

/// The client's reading of `sys.fn_cdc_get_min_lsn`: `answer` is what it
/// returned (None for NULL or all zeros), `catalog` the instance's row in
/// `cdc.change_tables` (None: no such instance). All zeros for an instance
/// that exists with a `start_lsn` is CDC refusing this caller (Microsoft's
/// page on the function: it returns all zeros "when the caller is not
/// authorized to access the change data"), which a step must not read as
/// "no bound": its checks for purged changes would pass blind. NULL
/// `start_lsn` (not established yet) and a missing instance stay None.
pub fn read_min_lsn(answer: Option<Lsn>, catalog: Option<&InstanceCatalog>, login: Option<&str>) -> Result<Option<Lsn>, SourceError> {
    match (answer, catalog) {
        (Some(l), _) => Ok(Some(l)),
        (None, Some(c)) if c.start_lsn.is_some_and(|s| !s.is_zero()) => Err(SourceError::Permission(format!(
            "capture instance '{}' holds changes from {} (cdc.change_tables.start_lsn), but sys.fn_cdc_get_min_lsn answers \
             0x00000000000000000000 to this login: SQL Server opens an instance's change data only to a login with SELECT on \
             every column it captures and, when it has a gating role, membership of that role. Run, as a database owner: {} ({DOCS})",
            c.grants.capture_instance,
            c.start_lsn.map(|l| l.to_hex()).unwrap_or_default(),
            cdc_check_fix(Some(&c.grants), login)
        ))),
        (None, _) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Error 229 and 230 as SQL Server words them (Microsoft's pages on
    /// `cdc.fn_cdc_get_all_changes_<capture_instance>` and on column-level
    /// security quote these forms).
    #[test]
    fn denials_parse_from_the_servers_text() {
        let d = parse_denial("The SELECT permission was denied on the object 'change_tables', database 'Sales', schema 'cdc'.").unwrap();
        assert_eq!(
            d,
            Denial { permission: "SELECT".into(), column: None, object: "change_tables".into(), database: "Sales".into(), schema: "cdc".into() }
        );
        let d = parse_denial("The SELECT permission was denied on the column 'SSN' of the object 'Membership', database 'CLS_TestDW', schema 'dbo'.").unwrap();
        assert_eq!((d.column.as_deref(), d.object.as_str(), d.schema.as_str()), (Some("SSN"), "Membership", "dbo"));
        let d = parse_denial("The EXECUTE permission was denied on the object 'GetSalaryReport', database 'HR', schema 'dbo'.").unwrap();
        assert_eq!(d.permission, "EXECUTE");
        // Names with spaces and brackets come back as the server wrote them.
        let d = parse_denial("The SELECT permission was denied on the object 'Order Lines]', database 'my db', schema 'sales data'.").unwrap();
        assert_eq!((d.object.as_str(), d.database.as_str(), d.schema.as_str()), ("Order Lines]", "my db", "sales data"));
        for other in ["Invalid object name 'cdc.change_tables'.", "Die SELECT-Berechtigung wurde für das Objekt verweigert.", ""] {
            assert_eq!(parse_denial(other), None, "{other}");
        }
    }

    #[test]
    fn a_denial_names_the_grant_that_fixes_it() {
        let login = Some("cdc_reader");
        let m = denial_message(229, "The SELECT permission was denied on the object 'change_tables', database 'Sales', schema 'cdc'.", login, None);
        assert!(m.contains("GRANT SELECT ON OBJECT::[cdc].[change_tables] TO [cdc_reader]"), "{m}");
        assert!(m.starts_with("SQL Server error 229: The SELECT permission was denied"), "{m}");
        let m = denial_message(230, "The SELECT permission was denied on the column 'price' of the object 'items', database 'Sales', schema 'dbo'.", login, None);
        assert!(m.contains("GRANT SELECT ON OBJECT::[dbo].[items] ([price]) TO [cdc_reader]"), "{m}");
        // A change table: the ordering columns, not the captured values.
        let m = denial_message(229, "The SELECT permission was denied on the object 'dbo_items_CT', database 'Sales', schema 'cdc'.", login, None);
        assert!(
            m.contains("GRANT SELECT ON OBJECT::[cdc].[dbo_items_CT] ([__$start_lsn], [__$seqval], [__$operation], [__$command_id]) TO [cdc_reader]"),
            "{m}"
        );
        // A column of the change table (230): that column.
        let m = denial_message(
            230,
            "The SELECT permission was denied on the column '__$command_id' of the object 'dbo_items_CT', database 'Sales', schema 'cdc'.",
            login,
            None,
        );
        assert!(m.contains("GRANT SELECT ON OBJECT::[cdc].[dbo_items_CT] ([__$command_id]) TO [cdc_reader]"), "{m}");
        // An unknown login: a placeholder, never a wrong name.
        let m = denial_message(229, "The SELECT permission was denied on the object 'lsn_time_mapping', database 'Sales', schema 'cdc'.", None, None);
        assert!(m.contains("GRANT SELECT ON OBJECT::[cdc].[lsn_time_mapping] TO <the login>"), "{m}");
        // A text the client cannot read: the server's words and the docs, no statement.
        let m = denial_message(229, "Permission denied.", login, None);
        assert!(!m.contains("GRANT"), "{m}");
    }

    /// The change function's 229 is also CDC's own check: the message names
    /// the grant on the function, the captured columns and the gating role.
    #[test]
    fn the_change_functions_denial_names_every_grant_it_may_mean() {
        let i = InstanceGrants {
            capture_instance: "dbo_items".into(),
            table: TableName::new("dbo", "items"),
            columns: vec!["id".into(), "name".into()],
            gating_role: Some("items readers".into()),
        };
        let msg = "The SELECT permission was denied on the object 'fn_cdc_get_all_changes_dbo_items', database 'Sales', schema 'cdc'.";
        let m = denial_message(229, msg, Some("cdc_reader"), Some(&i));
        for part in [
            "GRANT SELECT ON OBJECT::[cdc].[fn_cdc_get_all_changes_dbo_items] TO [cdc_reader]",
            "GRANT SELECT ON OBJECT::[dbo].[items] ([id], [name]) TO [cdc_reader]",
            "ALTER ROLE [items readers] ADD MEMBER [cdc_reader]",
            "sys.fn_cdc_get_min_lsn(N'dbo_items')",
        ] {
            assert!(m.contains(part), "missing {part}: {m}");
        }
        // Another instance's facts are not used for this function.
        let m = denial_message(229, &msg.replace("dbo_items", "dbo_other"), Some("cdc_reader"), Some(&i));
        assert!(!m.contains("[dbo].[items]"), "{m}");
    }

    #[test]
    fn all_zeros_for_an_instance_with_a_start_is_a_closed_instance() {
        let grants = InstanceGrants {
            capture_instance: "dbo_items".into(),
            table: TableName::new("dbo", "items"),
            columns: vec!["id".into(), "qty".into()],
            gating_role: None,
        };
        let start = Lsn::from_parts(0x2a, 0x10, 1);
        let open = InstanceCatalog { start_lsn: Some(start), grants: grants.clone() };
        assert_eq!(read_min_lsn(Some(start), Some(&open), Some("r")).unwrap(), Some(start));
        let e = read_min_lsn(None, Some(&open), Some("cdc_reader")).unwrap_err();
        assert!(matches!(&e, SourceError::Permission(m) if m.contains("GRANT SELECT ON OBJECT::[dbo].[items] ([id], [qty]) TO [cdc_reader]")), "{e}");
        let gated = InstanceCatalog { start_lsn: Some(start), grants: InstanceGrants { gating_role: Some("gate".into()), ..grants.clone() } };
        let e = read_min_lsn(None, Some(&gated), Some("cdc_reader")).unwrap_err();
        assert!(e.to_string().contains("ALTER ROLE [gate] ADD MEMBER [cdc_reader]"), "{e}");
        // No start yet, or no such instance: no bound, as before.
        let unset = InstanceCatalog { start_lsn: None, grants };
        assert_eq!(read_min_lsn(None, Some(&unset), Some("r")).unwrap(), None);
        assert_eq!(read_min_lsn(None, None, Some("r")).unwrap(), None);
    }

    #[test]
    fn hidden_tables_name_their_grants() {
        let m = hidden_object_message("The object '[dbo].[items]' does not exist in database 'Sales' or is invalid for this operation.", Some("cdc_reader"));
        assert!(m.contains("GRANT SELECT ON OBJECT::[dbo].[items] TO [cdc_reader]"), "{m}");
        let e = table_hidden(&TableName::new("dbo", "items"), Some("cdc_reader"));
        assert!(matches!(&e, SourceError::Config(m) if m.contains("does not exist") && m.contains("GRANT SELECT ON OBJECT::[dbo].[items] TO [cdc_reader]")), "{e}");
        let e = change_table_hidden("dbo_items", Some("cdc_reader"));
        assert!(
            matches!(&e, SourceError::Permission(m) if m.contains("GRANT SELECT ON OBJECT::[cdc].[dbo_items_CT] ([__$start_lsn], [__$seqval], [__$operation], [__$command_id]) TO [cdc_reader]")),
            "{e}"
        );
    }
}
