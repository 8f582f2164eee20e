//! The simulated database's users, roles and grants, and the checks a read
//! makes against them (issue 12 §5).
//!
//! A `sim://PATH` URL without `user=` connects as the database owner, whom
//! no check stops: every test written before this model keeps its meaning.
//! `sim://PATH?user=NAME` connects as the database user NAME, and each
//! [`super::SimSource`] call then checks what the real server checks for the
//! objects its SQL Server statement (`crate::mssql::sql`) touches, in SQL
//! Server's own terms, as Microsoft documents them:
//!
//! * **Reading columns** (GRANT, "column-level permissions"): SELECT on the
//!   object or its schema allows every column; otherwise each column read
//!   needs its own column grant. With no SELECT on the object at all the
//!   statement fails with error 229 naming the object; with some column
//!   grants, error 230 naming the first column without one.
//!   `COUNT_BIG(*)` reads no column, and is allowed with any column grant
//!   (an inference: the documentation does not say).
//! * **Metadata visibility** ("Metadata Visibility Configuration"): the
//!   catalog (`sys.columns`, `sys.indexes`, `OBJECT_ID`, `sp_spaceused`)
//!   shows an object only to a caller with some permission on it, on one of
//!   its columns or on its schema (SELECT or VIEW DEFINITION), and then all
//!   of its columns. Hidden is answered as missing: no rows, or error 15009
//!   from `sp_spaceused`.
//! * **CDC's own check** (`cdc.fn_cdc_get_all_changes_<ci>`,
//!   `sys.fn_cdc_get_min_lsn`): an instance's change data is open to a
//!   caller with SELECT on every captured column of the source table who is
//!   a member of the instance's gating role when it has one. Otherwise the
//!   change function fails with error 229 naming itself, and
//!   `fn_cdc_get_min_lsn` answers all zeros. The change function also needs
//!   SELECT on itself, like any object.
//! * The system functions (`fn_cdc_get_max_lsn`, the LSN arithmetic, the
//!   time mapping functions) and `sp_spaceused` are open to `public`.
//!
//! Principals: database users; database roles, whose members are users or
//! roles (nested roles count); `public`, which every user is in; and
//! `db_owner`, whose members pass every check as the owner does.
//! `sp_cdc_enable_table` with `@role_name` creates the gating role when it
//! does not exist ([`SimDb::enable_cdc_gated`]).
//!
//! Where it differs from SQL Server: no DENY (a REVOKE removes exactly the
//! grant it names); no ownership chaining, server roles or permissions other
//! than SELECT and VIEW DEFINITION; a column grant names the column, so a
//! rename (`sp_rename`) does not carry it over as SQL Server's grant by
//! column id would; logins and users are one (a user on the URL needs no
//! password). The catalog is one JSON document in the file's `meta` table,
//! so files made before this model open unchanged (no user: only the owner).
//!
//! The checks decide in the simulator's terms; the errors they raise are the
//! server's numbers and texts, classified by the client's own mapping
//! (`crate::mssql::client::classify_server_error_in`), so the message that
//! names the missing grant is the one a real server's error gets.

use std::collections::BTreeMap;
use std::path::Path;

use rusqlite::Connection;
use serde::{Deserialize, Serialize};

use crate::mssql::client::{classify_server_error, classify_server_error_in, ErrorContext};
use crate::mssql::grants::InstanceGrants;
use crate::source::{CaptureInstance, SourceError, TableName};

use super::db::{self, InstanceRow, Result, SimDb, SimError, TableMeta};

/// The `meta` key the catalog is stored under, as JSON.
const META_KEY: &str = "security";
/// The schema CDC's objects live in.
pub const CDC_SCHEMA: &str = "cdc";
/// The fixed role whose members pass every check.
pub const DB_OWNER: &str = "db_owner";
/// The role every user is a member of.
pub const PUBLIC: &str = "public";

/// CDC's metadata tables of the simulated database and their columns (for
/// validating column grants on them).
const CDC_TABLES: &[(&str, &[&str])] = &[
    (
        "change_tables",
        &[
            "object_id",
            "version",
            "source_object_id",
            "capture_instance",
            "start_lsn",
            "end_lsn",
            "supports_net_changes",
            "has_drop_pending",
            "role_name",
            "index_name",
            "filegroup_name",
            "create_date",
            "partition_switch",
        ],
    ),
    ("captured_columns", &["object_id", "column_name", "column_id", "column_type", "column_ordinal", "is_computed"]),
    ("index_columns", &["object_id", "column_name", "index_ordinal", "column_id"]),
    ("lsn_time_mapping", &["start_lsn", "tran_begin_time", "tran_end_time", "tran_id", "tran_begin_lsn"]),
];

/// A permission the model knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Permission {
    Select,
    ViewDefinition,
}

impl Permission {
    pub fn sql_name(self) -> &'static str {
        match self {
            Permission::Select => "SELECT",
            Permission::ViewDefinition => "VIEW DEFINITION",
        }
    }
}

/// What a permission is granted on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "class", rename_all = "snake_case")]
pub enum Securable {
    Schema { schema: String },
    Object { schema: String, name: String },
    Column { schema: String, name: String, column: String },
}

/// One `GRANT permission ON securable TO principal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub principal: String,
    pub permission: Permission,
    pub on: Securable,
}

/// The database's principals and grants, and the gating role of each
/// capture instance that has one (`cdc.change_tables.role_name`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Security {
    pub users: Vec<String>,
    /// Each role and its members (users or roles).
    pub roles: BTreeMap<String, Vec<String>>,
    pub grants: Vec<Grant>,
    /// Capture instance -> its gating role.
    pub gating_roles: BTreeMap<String, String>,
}

/// Names compare as the database's default collation does: ignoring case.
fn same(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}

fn contains(list: &[String], name: &str) -> bool {
    list.iter().any(|x| same(x, name))
}

fn bad(message: String) -> SimError {
    SimError::BadArgument(message)
}

impl Security {
    pub(crate) fn load(conn: &Connection, path: &Path) -> Result<Security> {
        match db::meta_get(conn, path, META_KEY)? {
            None => Ok(Security::default()),
            Some(text) => serde_json::from_str(&text).map_err(|e| SimError::Corrupt(format!("security catalog: {e}"))),
        }
    }

    fn save(&self, conn: &Connection, path: &Path) -> Result<()> {
        db::meta_set(conn, path, META_KEY, &serde_json::to_string(self).expect("the security catalog serialises"))
    }

    fn is_user(&self, name: &str) -> bool {
        contains(&self.users, name)
    }

    fn role_key(&self, name: &str) -> Option<String> {
        self.roles.keys().find(|k| same(k, name)).cloned()
    }

    fn principal_exists(&self, name: &str) -> bool {
        same(name, PUBLIC) || same(name, DB_OWNER) || self.is_user(name) || self.role_key(name).is_some()
    }

    /// The principals whose grants count for `user`: itself, `public`, and
    /// every role it is in, directly or through other roles.
    pub fn principals_of(&self, user: &str) -> Vec<String> {
        let mut out = vec![user.to_string(), PUBLIC.to_string()];
        loop {
            let mut grew = false;
            for (role, members) in &self.roles {
                if !contains(&out, role) && members.iter().any(|m| contains(&out, m)) {
                    out.push(role.clone());
                    grew = true;
                }
            }
            if !grew {
                return out;
            }
        }
    }

    /// The instance's gating role, if it has one.
    pub fn gating_role(&self, capture_instance: &str) -> Option<&str> {
        self.gating_roles.iter().find(|(ci, _)| same(ci, capture_instance)).map(|(_, r)| r.as_str())
    }

    fn check_new_principal(&self, name: &str) -> Result<()> {
        let n = name.trim();
        if n.is_empty() || n.chars().count() > 128 || n.contains(|ch: char| "?&=/".contains(ch)) {
            return Err(bad(format!("'{name}' is not a principal name here: 1 to 128 characters, none of ? & = /")));
        }
        if same(n, "dbo") || self.principal_exists(n) {
            return Err(bad(format!("user, group, or role '{n}' already exists in the current database (SQL Server error 15023)")));
        }
        Ok(())
    }

    fn create_user(&mut self, name: &str) -> Result<()> {
        self.check_new_principal(name)?;
        self.users.push(name.trim().to_string());
        Ok(())
    }

    fn drop_user(&mut self, name: &str) -> Result<()> {
        if !self.is_user(name) {
            return Err(bad(format!("cannot drop the user '{name}', because it does not exist (SQL Server error 15151)")));
        }
        self.users.retain(|u| !same(u, name));
        for members in self.roles.values_mut() {
            members.retain(|m| !same(m, name));
        }
        self.grants.retain(|g| !same(&g.principal, name));
        Ok(())
    }

    fn create_role(&mut self, name: &str) -> Result<()> {
        self.check_new_principal(name)?;
        self.roles.insert(name.trim().to_string(), Vec::new());
        Ok(())
    }

    fn add_member(&mut self, role: &str, member: &str) -> Result<()> {
        if same(role, PUBLIC) {
            return Err(bad("every user is a member of public already".into()));
        }
        let key = match self.role_key(role) {
            Some(k) => k,
            None if same(role, DB_OWNER) => DB_OWNER.to_string(),
            None => return Err(bad(format!("cannot alter the role '{role}', because it does not exist (SQL Server error 15151)"))),
        };
        if !(self.is_user(member) || self.role_key(member).is_some()) || same(member, role) {
            return Err(bad(format!("'{member}' is not a user or another role of this database (SQL Server error 15410)")));
        }
        let members = self.roles.entry(key).or_default();
        if !contains(members.as_slice(), member) {
            members.push(member.to_string());
        }
        Ok(())
    }

    fn drop_member(&mut self, role: &str, member: &str) -> Result<()> {
        let key = self.role_key(role).ok_or_else(|| bad(format!("cannot alter the role '{role}', because it does not exist (SQL Server error 15151)")))?;
        if let Some(members) = self.roles.get_mut(&key) {
            members.retain(|m| !same(m, member));
        }
        Ok(())
    }

    fn set_gating_role(&mut self, capture_instance: &str, role: &str) -> Result<()> {
        // sp_cdc_enable_table creates the gating role when it does not exist.
        if self.role_key(role).is_none() {
            if self.is_user(role) || same(role, PUBLIC) || same(role, DB_OWNER) {
                return Err(bad(format!("@role_name '{role}' names a user or a fixed role, not a database role (SQL Server error 22834)")));
            }
            self.create_role(role)?;
        }
        self.gating_roles.retain(|ci, _| !same(ci, capture_instance));
        self.gating_roles.insert(capture_instance.to_string(), role.trim().to_string());
        Ok(())
    }
}

/// The columns of an object of the simulated database that can be granted
/// on (the function: none), or None when there is no such object.
fn object_columns(conn: &Connection, path: &Path, object: &TableName) -> Result<Option<Vec<String>>> {
    if same(&object.schema, CDC_SCHEMA) {
        if let Some((_, cols)) = CDC_TABLES.iter().find(|(n, _)| same(n, &object.name)) {
            return Ok(Some(cols.iter().map(|c| c.to_string()).collect()));
        }
        for i in db::load_instances(conn, path, None)? {
            if same(&object.name, &format!("{}_CT", i.info.name)) {
                let mut cols: Vec<String> =
                    ["__$start_lsn", "__$end_lsn", "__$seqval", "__$operation", "__$update_mask"].iter().map(|c| c.to_string()).collect();
                cols.extend(i.info.columns.iter().map(|c| c.name.clone()));
                if i.ct_command_id {
                    cols.push("__$command_id".into());
                }
                return Ok(Some(cols));
            }
            if same(&object.name, &format!("fn_cdc_get_all_changes_{}", i.info.name)) {
                return Ok(Some(Vec::new()));
            }
        }
        return Ok(None);
    }
    match db::find_table(conn, path, object) {
        Ok(t) => Ok(Some(t.spec.columns.iter().map(|c| c.name.clone()).collect())),
        Err(SimError::NoSuchTable(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `SCHEMA::s`, `OBJECT::s.o` or `s.o` (brackets allowed; a bare name is in
/// `dbo`), with `columns` for a column grant: the securables a GRANT names.
fn securables(conn: &Connection, path: &Path, permission: Permission, on: &str, columns: &[String]) -> Result<Vec<Securable>> {
    let text = on.trim();
    if let Some(schema) = text.strip_prefix("SCHEMA::").or_else(|| text.strip_prefix("schema::")) {
        let schema = schema.trim().trim_start_matches('[').trim_end_matches(']').to_string();
        let known = same(&schema, CDC_SCHEMA) || same(&schema, "dbo") || db::load_tables(conn, path)?.iter().any(|t| same(&t.spec.name.schema, &schema));
        if !known {
            return Err(bad(format!("cannot find the schema '{schema}' (SQL Server error 15151)")));
        }
        if !columns.is_empty() {
            return Err(bad("a schema has no columns: grant on an object to name columns".into()));
        }
        return Ok(vec![Securable::Schema { schema }]);
    }
    let name = text.strip_prefix("OBJECT::").or_else(|| text.strip_prefix("object::")).unwrap_or(text);
    let object = super::cli::parse_table_name(name)?;
    let have = object_columns(conn, path, &object)?
        .ok_or_else(|| bad(format!("cannot find the object '{object}' in the simulated database (SQL Server error 15151)")))?;
    if columns.is_empty() {
        return Ok(vec![Securable::Object { schema: object.schema, name: object.name }]);
    }
    if permission != Permission::Select {
        return Err(bad(format!("{} cannot be granted on columns, only on the object or its schema", permission.sql_name())));
    }
    columns
        .iter()
        .map(|c| {
            let c = c.trim().trim_start_matches('[').trim_end_matches(']');
            match have.iter().find(|h| same(h, c)) {
                Some(h) => Ok(Securable::Column { schema: object.schema.clone(), name: object.name.clone(), column: h.clone() }),
                None => Err(bad(format!("invalid column name '{c}' for {object} (SQL Server error 207)"))),
            }
        })
        .collect()
}

/// The administrative side, as a database owner runs it.
impl SimDb {
    /// The users, roles, grants and gating roles.
    pub fn security(&self) -> Result<Security> {
        self.write(Security::load)
    }

    /// `CREATE USER name` (a user on the URL, `sim://PATH?user=name`, needs no password).
    pub fn create_user(&self, name: &str) -> Result<()> {
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            s.create_user(name)?;
            s.save(c, p)
        })
    }

    /// `DROP USER name`: its memberships and grants go with it.
    pub fn drop_user(&self, name: &str) -> Result<()> {
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            s.drop_user(name)?;
            s.save(c, p)
        })
    }

    /// `CREATE ROLE name`.
    pub fn create_role(&self, name: &str) -> Result<()> {
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            s.create_role(name)?;
            s.save(c, p)
        })
    }

    /// `ALTER ROLE role ADD MEMBER member` (`db_owner` included).
    pub fn add_role_member(&self, role: &str, member: &str) -> Result<()> {
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            s.add_member(role, member)?;
            s.save(c, p)
        })
    }

    /// `ALTER ROLE role DROP MEMBER member`.
    pub fn drop_role_member(&self, role: &str, member: &str) -> Result<()> {
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            s.drop_member(role, member)?;
            s.save(c, p)
        })
    }

    /// `GRANT permission ON on (columns) TO principal`: `on` is
    /// `SCHEMA::cdc`, `OBJECT::cdc.change_tables` or `dbo.items`; the object
    /// must exist (error 15151 otherwise), as must the columns. Returns the
    /// grants it added (one per column).
    pub fn grant(&self, principal: &str, permission: Permission, on: &str, columns: &[String]) -> Result<Vec<Grant>> {
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            if !s.principal_exists(principal) || same(principal, DB_OWNER) {
                return Err(bad(format!("cannot find the user '{principal}', because it does not exist or you do not have permission (SQL Server error 15151)")));
            }
            let mut added = Vec::new();
            for on in securables(c, p, permission, on, columns)? {
                let g = Grant { principal: principal.to_string(), permission, on };
                if !s.grants.iter().any(|h| same(&h.principal, principal) && h.permission == permission && h.on == g.on) {
                    s.grants.push(g.clone());
                    added.push(g);
                }
            }
            s.save(c, p)?;
            Ok(added)
        })
    }

    /// `REVOKE permission ON on (columns) FROM principal`: removes exactly
    /// the grants it names (a column revoke leaves an object grant alone).
    /// Returns how many it removed.
    pub fn revoke(&self, principal: &str, permission: Permission, on: &str, columns: &[String]) -> Result<usize> {
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            let targets = securables(c, p, permission, on, columns)?;
            let before = s.grants.len();
            s.grants.retain(|g| !(same(&g.principal, principal) && g.permission == permission && targets.iter().any(|t| t == &g.on)));
            let removed = before - s.grants.len();
            s.save(c, p)?;
            Ok(removed)
        })
    }

    /// `sys.sp_cdc_enable_table` with `@role_name = gating_role`: the
    /// instance's change data is open only to members of that role (with
    /// SELECT on its captured columns); the role is created when missing.
    /// (Two writes: a reader between them sees the instance without its role.)
    pub fn enable_cdc_gated(
        &self,
        table: &TableName,
        capture_instance: Option<&str>,
        captured_columns: Option<Vec<String>>,
        gating_role: &str,
    ) -> Result<CaptureInstance> {
        let info = self.enable_cdc(table, capture_instance, captured_columns)?;
        self.write(|c, p| {
            let mut s = Security::load(c, p)?;
            s.set_gating_role(&info.name, gating_role)?;
            s.save(c, p)
        })?;
        Ok(info)
    }

    /// The URL that connects to this file as the database user `user`.
    pub fn url_as(&self, user: &str) -> String {
        format!("{}?user={user}", self.url())
    }

    /// A [`super::SimSource`] reading this file as the database user `user`.
    pub fn source_as(&self, user: &str) -> std::result::Result<super::SimSource, SourceError> {
        super::SimSource::open_as(self.path(), Some(user))
    }
}

/// Drops a capture instance's gating role entry with the instance (inside the write that drops it).
pub(crate) fn forget_instance(conn: &Connection, path: &Path, capture_instance: &str) -> Result<()> {
    let mut s = Security::load(conn, path)?;
    let before = s.gating_roles.len();
    s.gating_roles.retain(|ci, _| !same(ci, capture_instance));
    if s.gating_roles.len() != before {
        s.save(conn, path)?;
    }
    Ok(())
}

/// Who one source call runs as, and what that caller may do.
pub(crate) struct Guard {
    security: Security,
    /// The user on the URL (None: the owner).
    login: Option<String>,
    /// The principals whose grants count; None for the owner and members of
    /// `db_owner`, whom no check stops.
    principals: Option<Vec<String>>,
    /// The database's name in the server's messages: the file's stem.
    database: String,
}

impl Guard {
    /// The caller `login` names (None: the owner). A name the database has
    /// no user of fails as the server's login does (error 18456).
    pub(crate) fn load(conn: &Connection, path: &Path, login: Option<&str>) -> std::result::Result<Guard, SourceError> {
        let security = Security::load(conn, path).map_err(SourceError::from)?;
        let database = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "sim".into());
        let Some(login) = login else { return Ok(Guard { security, login: None, principals: None, database }) };
        let Some(user) = security.users.iter().find(|u| same(u, login)).cloned() else {
            return Err(classify_server_error(
                18456,
                &format!(
                    "Login failed for user '{login}'. (The simulated database {database} has no user of that name: create it with \
                     `mssql-cdc sim user --db {} --create {login}`.)",
                    path.display()
                ),
                None,
            ));
        };
        let principals = security.principals_of(&user);
        let owner = contains(&principals, DB_OWNER);
        Ok(Guard { security, login: Some(user), principals: if owner { None } else { Some(principals) }, database })
    }

    /// The user the call runs as (None: the owner).
    pub(crate) fn login(&self) -> Option<&str> {
        self.login.as_deref()
    }

    pub(crate) fn database(&self) -> &str {
        &self.database
    }

    /// The context a permission error is classified in.
    pub(crate) fn context(&self, instance: Option<InstanceGrants>) -> ErrorContext {
        ErrorContext { range: None, login: self.login.clone(), instance }
    }

    /// Whether a grant of `permission` to one of the caller's principals matches `on`.
    fn holds(&self, permission: Permission, on: impl Fn(&Securable) -> bool) -> bool {
        match &self.principals {
            None => true,
            Some(ps) => self.security.grants.iter().any(|g| g.permission == permission && contains(ps, &g.principal) && on(&g.on)),
        }
    }

    /// SELECT on the whole object: granted on it or on its schema.
    fn selects_object(&self, schema: &str, name: &str) -> bool {
        self.holds(Permission::Select, |s| match s {
            Securable::Schema { schema: s } => same(s, schema),
            Securable::Object { schema: s, name: n } => same(s, schema) && same(n, name),
            Securable::Column { .. } => false,
        })
    }

    fn selects_some_column(&self, schema: &str, name: &str) -> bool {
        self.holds(Permission::Select, |s| matches!(s, Securable::Column { schema: s, name: n, .. } if same(s, schema) && same(n, name)))
    }

    fn selects_column(&self, schema: &str, name: &str, column: &str) -> bool {
        self.selects_object(schema, name)
            || self.holds(Permission::Select, |s| {
                matches!(s, Securable::Column { schema: s, name: n, column: c } if same(s, schema) && same(n, name) && same(c, column))
            })
    }

    /// Whether the catalog shows the object to the caller: some permission
    /// on it, on one of its columns, or on its schema.
    pub(crate) fn sees(&self, schema: &str, name: &str) -> bool {
        let on = |s: &Securable| match s {
            Securable::Schema { schema: s } => same(s, schema),
            Securable::Object { schema: s, name: n } | Securable::Column { schema: s, name: n, .. } => same(s, schema) && same(n, name),
        };
        self.holds(Permission::Select, on) || self.holds(Permission::ViewDefinition, on)
    }

    fn in_role(&self, role: &str) -> bool {
        match &self.principals {
            None => true,
            Some(ps) => contains(ps, role),
        }
    }

    /// Error 229 (the object) or 230 (a column of it), in the server's words.
    pub(crate) fn denied(&self, schema: &str, name: &str, column: Option<&str>, ctx: &ErrorContext) -> SourceError {
        let db = &self.database;
        let (code, text) = match column {
            None => (229, format!("The SELECT permission was denied on the object '{name}', database '{db}', schema '{schema}'.")),
            Some(c) => (230, format!("The SELECT permission was denied on the column '{c}' of the object '{name}', database '{db}', schema '{schema}'.")),
        };
        classify_server_error_in(code, &text, ctx)
    }

    /// A statement reading the whole object (a function): SELECT on it or its schema.
    pub(crate) fn check_select_object(&self, schema: &str, name: &str, ctx: &ErrorContext) -> std::result::Result<(), SourceError> {
        if self.selects_object(schema, name) {
            Ok(())
        } else {
            Err(self.denied(schema, name, None, ctx))
        }
    }

    /// A statement reading `columns` of an object (none: `COUNT_BIG(*)`).
    pub(crate) fn check_select_columns(&self, schema: &str, name: &str, columns: &[&str], ctx: &ErrorContext) -> std::result::Result<(), SourceError> {
        if self.selects_object(schema, name) {
            return Ok(());
        }
        if !self.selects_some_column(schema, name) {
            return Err(self.denied(schema, name, None, ctx));
        }
        match columns.iter().find(|c| !self.selects_column(schema, name, c)) {
            Some(c) => Err(self.denied(schema, name, Some(*c), ctx)),
            None => Ok(()),
        }
    }

    /// The source table's names of the columns the instance captures, found
    /// by column id (a renamed one by its name now; a dropped one is gone).
    pub(crate) fn captured_names(t: &TableMeta, i: &InstanceRow) -> Vec<String> {
        i.column_ids.iter().filter_map(|id| id.and_then(|id| t.column_index_by_id(id))).map(|k| t.spec.columns[k].name.clone()).collect()
    }

    /// What CDC checks of a caller for the instance.
    pub(crate) fn instance_grants(&self, t: &TableMeta, i: &InstanceRow) -> InstanceGrants {
        InstanceGrants {
            capture_instance: i.info.name.clone(),
            table: t.spec.name.clone(),
            columns: Guard::captured_names(t, i),
            gating_role: self.security.gating_role(&i.info.name).map(str::to_string),
        }
    }

    /// CDC's own check: SELECT on every captured column of the source table
    /// `t`, and membership of the instance's gating role when it has one.
    pub(crate) fn opens_change_data(&self, t: &TableMeta, i: &InstanceRow) -> bool {
        let (schema, name) = (&t.spec.name.schema, &t.spec.name.name);
        Guard::captured_names(t, i).iter().all(|c| self.selects_column(schema, name, c))
            && self.security.gating_role(&i.info.name).is_none_or(|r| self.in_role(r))
    }
}
