//! The `sim` subcommand: create, drive and inspect a simulator file.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::lsn::Lsn;
use crate::source::TableName;
use crate::types::{ColumnDesc, SqlType};

use super::db::{Clock, FaultOn, FaultSpec, Result, SimConfig, SimDb, SimError, TableSpec};
use super::security::Permission;
use super::workload::{orders_rows, orders_table_spec, Mix, Until, Workload};

/// Commands that manage an embedded SQL Server CDC simulator (`sim://PATH`).
#[derive(Debug, clap::Subcommand)]
pub enum SimCommand {
    /// Create a simulator file with one table, optionally filled and CDC-enabled.
    ///
    /// Examples:
    ///   sim create --db demo.sim --table dbo.orders --preset orders --rows 100000
    ///   sim create --db t.sim --table dbo.t --columns "id bigint not null, name nvarchar(40)" --primary-key id
    ///   sim create --db dst.sim --preset orders --time-zone America/New_York --manual-clock 2026-11-01T04:00:00Z
    Create(CreateArgs),
    /// Run a write workload (inserts, updates, deletes, key updates) against a table.
    ///
    /// Example: sim write --db demo.sim --tx-per-s 50 --seconds 30 --mix insert=5,update=3,delete=1,key_update=1 --seed 7
    Write(WriteArgs),
    /// Run the capture job once: move committed transactions older than the lag into the change tables.
    Capture(DbArg),
    /// Run the cleanup job: drop change rows and mapping rows older than the retention.
    ///
    /// Examples: sim cleanup --db demo.sim --retention-minutes 60 ; sim cleanup --db demo.sim --to-lsn 0x0000002a000000100020
    Cleanup(CleanupArgs),
    /// Change the schema, the capture instances or the settings.
    ///
    /// Examples:
    ///   sim alter --db demo.sim --add-column "discount decimal(5,2)"
    ///   sim alter --db demo.sim --rename-column amount=total
    ///   sim alter --db demo.sim --enable-instance dbo_orders_v2
    ///   sim alter --db demo.sim --drop-instance dbo_orders
    ///   sim alter --db demo.sim --set capture_lag_ms=2000 --set allow_snapshot_isolation=false
    Alter(AlterArgs),
    /// Print the simulator's state as JSON (clock, LSNs, tables, instances, settings).
    Status(DbArg),
    /// Make the next reads fail like a dropped connection.
    ///
    /// Example: sim fault --db demo.sim --on snapshot --after-rows 5000 --times 1
    Fault(FaultArgs),
    /// Move the manual clock forward.
    ///
    /// Example: sim advance --db demo.sim --seconds 3600
    Advance(AdvanceArgs),
    /// Create or drop a database user; a workflow reads as it with `sim://PATH?user=NAME`.
    ///
    /// Example: sim user --db demo.sim --create cdc_reader
    User(UserArgs),
    /// Create a database role, or add and drop its members (`db_owner` passes every check).
    ///
    /// Examples: sim role --db demo.sim --role orders_readers --add-member cdc_reader ;
    ///   sim role --db demo.sim --create analysts
    Role(RoleArgs),
    /// Grant a permission on a schema, an object or columns of an object.
    ///
    /// Examples:
    ///   sim grant --db demo.sim --user cdc_reader --on OBJECT::cdc.change_tables
    ///   sim grant --db demo.sim --user cdc_reader --on cdc.dbo_orders_CT --columns '__$start_lsn,__$seqval,__$operation,__$command_id'
    ///   sim grant --db demo.sim --user cdc_reader --on dbo.orders --columns id,customer
    Grant(GrantArgs),
    /// Revoke exactly the grant named (a column revoke leaves an object grant alone).
    ///
    /// Example: sim revoke --db demo.sim --user cdc_reader --on OBJECT::cdc.lsn_time_mapping
    Revoke(GrantArgs),
}

#[derive(Debug, clap::Args)]
pub struct UserArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// CREATE USER with this name.
    #[arg(long)]
    pub create: Vec<String>,
    /// DROP USER with this name (its memberships and grants go with it).
    #[arg(long)]
    pub drop: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct RoleArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// CREATE ROLE with this name.
    #[arg(long)]
    pub create: Vec<String>,
    /// The role --add-member and --drop-member change.
    #[arg(long)]
    pub role: Option<String>,
    /// ALTER ROLE <role> ADD MEMBER <name>.
    #[arg(long)]
    pub add_member: Vec<String>,
    /// ALTER ROLE <role> DROP MEMBER <name>.
    #[arg(long)]
    pub drop_member: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct GrantArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// The grantee: a user or a role.
    #[arg(long, aliases = ["to", "from"])]
    pub user: String,
    /// The securable: SCHEMA::name, OBJECT::schema.name, or schema.name.
    #[arg(long)]
    pub on: String,
    /// Columns of the object, comma-separated (SELECT only).
    #[arg(long)]
    pub columns: Option<String>,
    /// The permission.
    #[arg(long, value_enum, default_value = "select")]
    pub permission: Permission,
}

#[derive(Debug, clap::Args)]
pub struct DbArg {
    /// The simulator file.
    #[arg(long)]
    pub db: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// The simulator file to create.
    #[arg(long)]
    pub db: PathBuf,
    /// Replace the file if it exists.
    #[arg(long)]
    pub overwrite: bool,
    /// The table, as schema.name.
    #[arg(long, default_value = "dbo.orders")]
    pub table: String,
    /// A table preset (`orders`: id bigint PK, customer, amount, status, created_at, note).
    #[arg(long, conflicts_with = "columns")]
    pub preset: Option<String>,
    /// Column definitions: "name type [not null], ..." (e.g. "id bigint not null, name nvarchar(40)").
    #[arg(long)]
    pub columns: Option<String>,
    /// Primary key columns, comma-separated (omit for a heap).
    #[arg(long)]
    pub primary_key: Option<String>,
    /// A unique index, comma-separated (the row identity when there is no primary key).
    #[arg(long)]
    pub unique_index: Option<String>,
    /// Rows to load before CDC is enabled (only with --preset).
    #[arg(long, default_value_t = 0)]
    pub rows: u64,
    /// The server's time zone: IANA name, UTC, or UTC+HH:MM.
    #[arg(long, default_value = "UTC")]
    pub time_zone: String,
    /// Delay between a commit and its capture, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub capture_lag_ms: u64,
    /// Cleanup retention in minutes.
    #[arg(long, default_value_t = 4320)]
    pub retention_minutes: u64,
    /// Allow SNAPSHOT isolation (otherwise snapshot reads fail with error 3952).
    #[arg(long)]
    pub allow_snapshot_isolation: bool,
    /// Use a manual clock starting at this RFC 3339 instant (e.g. 2026-11-01T04:00:00Z).
    #[arg(long)]
    pub manual_clock: Option<DateTime<Utc>>,
    /// Milliseconds the manual clock moves per committed transaction.
    #[arg(long, default_value_t = 10)]
    pub tick_ms: u64,
    /// Most rows per second one read delivers.
    #[arg(long)]
    pub rows_per_s: Option<u64>,
    /// Latency added to every source call, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Write idle mapping rows after this many quiet seconds (0: never).
    #[arg(long, default_value_t = 0)]
    pub idle_interval_seconds: u64,
    /// Run cleanup automatically this often, in minutes.
    #[arg(long)]
    pub auto_cleanup_minutes: Option<u64>,
    /// Do not enable CDC on the table.
    #[arg(long)]
    pub no_cdc: bool,
    /// The capture instance's gating role (`@role_name`; created when missing).
    #[arg(long)]
    pub gating_role: Option<String>,
    /// Seed for generated rows.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, clap::Args)]
pub struct WriteArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// The table to write to (default: the only table).
    #[arg(long)]
    pub table: Option<String>,
    /// Transactions per second (0: as fast as possible).
    #[arg(long, default_value_t = 50.0)]
    pub tx_per_s: f64,
    /// How long to write, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Stop after this many transactions instead of after --seconds.
    #[arg(long)]
    pub transactions: Option<u64>,
    /// Operations per transaction.
    #[arg(long, default_value_t = 3)]
    pub ops_per_tx: u32,
    /// Operation weights: insert=5,update=3,delete=1,key_update=1.
    #[arg(long, default_value = "insert=5,update=3,delete=1,key_update=1")]
    pub mix: String,
    /// Share of keys that are hot (0..1).
    #[arg(long, default_value_t = 0.1)]
    pub hot_fraction: f64,
    /// Probability that an update or delete hits a hot key (0..1).
    #[arg(long, default_value_t = 0.5)]
    pub skew: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, clap::Args)]
pub struct CleanupArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// Retention in minutes (default: the configured one).
    #[arg(long)]
    pub retention_minutes: Option<u64>,
    /// Clean up to this LSN instead of by retention.
    #[arg(long, conflicts_with = "retention_minutes")]
    pub to_lsn: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct AlterArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// The table to alter (default: the only table).
    #[arg(long)]
    pub table: Option<String>,
    /// Add a nullable column: "name type".
    #[arg(long)]
    pub add_column: Vec<String>,
    /// Drop a non-key column.
    #[arg(long)]
    pub drop_column: Vec<String>,
    /// Rename a column, as `sp_rename 'schema.table.old', 'new', 'COLUMN'`:
    /// "old=new". The column keeps its id and values; capture instances keep
    /// capturing it under the old name (their change rows still carry it),
    /// and report it renamed, so the steps that read the table refuse them
    /// until a new instance captures the new name.
    #[arg(long)]
    pub rename_column: Vec<String>,
    /// Create a capture instance with this name (capturing the current columns).
    #[arg(long)]
    pub enable_instance: Vec<String>,
    /// The gating role of the instances --enable-instance creates (`@role_name`).
    #[arg(long)]
    pub gating_role: Option<String>,
    /// Drop a capture instance and its change rows.
    #[arg(long)]
    pub drop_instance: Vec<String>,
    /// Change a setting: key=value (e.g. capture_lag_ms=500, time_zone=UTC, conn_rows_per_s=null).
    #[arg(long)]
    pub set: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct FaultArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// Which reads fail.
    #[arg(long, value_enum, default_value = "any")]
    pub on: FaultOn,
    /// Rows delivered before the failure.
    #[arg(long, default_value_t = 0)]
    pub after_rows: u64,
    /// How many reads fail.
    #[arg(long, default_value_t = 1)]
    pub times: u32,
}

#[derive(Debug, clap::Args)]
pub struct AdvanceArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// Seconds to move the manual clock forward.
    #[arg(long, default_value_t = 0.0)]
    pub seconds: f64,
    /// Minutes to move the manual clock forward.
    #[arg(long, default_value_t = 0.0)]
    pub minutes: f64,
    /// Run the capture job afterwards.
    #[arg(long)]
    pub capture: bool,
}

/// Parses `schema.name` (schema defaults to dbo).
pub fn parse_table_name(text: &str) -> Result<TableName> {
    let t = text.trim();
    let strip = |s: &str| s.trim().trim_start_matches('[').trim_end_matches(']').to_string();
    match t.split_once('.') {
        Some((s, n)) if !s.is_empty() && !n.is_empty() => Ok(TableName::new(strip(s), strip(n))),
        None if !t.is_empty() => Ok(TableName::new("dbo", strip(t))),
        _ => Err(SimError::BadArgument(format!("'{text}' is not a table name; write schema.name (e.g. dbo.orders)"))),
    }
}

/// Parses one column definition: `name type [not null | null]`.
pub fn parse_column(text: &str) -> Result<ColumnDesc> {
    let t = text.trim();
    let (name, rest) = t
        .split_once(char::is_whitespace)
        .ok_or_else(|| SimError::BadArgument(format!("'{t}' is not a column definition; write 'name type [not null]'")))?;
    let rest = rest.trim();
    let lower = rest.to_ascii_lowercase();
    let (ty, nullable) = if let Some(s) = lower.strip_suffix("not null") {
        (rest[..s.len()].trim(), false)
    } else if let Some(s) = lower.strip_suffix("null") {
        (rest[..s.len()].trim(), true)
    } else {
        (rest, true)
    };
    let sql_type = SqlType::parse(ty).map_err(|e| SimError::BadArgument(format!("column '{name}': {e}")))?;
    Ok(ColumnDesc::new(name, sql_type, nullable))
}

/// Parses a comma-separated list of column definitions (commas inside parentheses are kept).
pub fn parse_columns(text: &str) -> Result<Vec<ColumnDesc>> {
    let mut parts = Vec::new();
    let (mut depth, mut cur) = (0i32, String::new());
    for ch in text.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    parts.push(cur);
    parts.iter().filter(|p| !p.trim().is_empty()).map(|p| parse_column(p)).collect()
}

fn list(text: &Option<String>) -> Vec<String> {
    text.as_deref().unwrap_or("").split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

/// The table a command names, or the file's only table.
fn pick_table(db: &SimDb, name: &Option<String>) -> Result<TableName> {
    if let Some(n) = name {
        return parse_table_name(n);
    }
    let status = db.status()?;
    let tables: Vec<String> =
        status["tables"].as_array().map(|a| a.iter().filter_map(|t| t["table"].as_str().map(str::to_string)).collect()).unwrap_or_default();
    match tables.as_slice() {
        [one] => parse_table_name(one),
        [] => Err(SimError::BadArgument(format!("{} has no table yet", db.path().display()))),
        _ => Err(SimError::BadArgument(format!("{} has several tables ({}); name one with --table", db.path().display(), tables.join(", ")))),
    }
}

fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// Runs a `sim` command; returns what to print.
pub fn run(cmd: SimCommand) -> Result<serde_json::Value> {
    match cmd {
        SimCommand::Create(a) => {
            let cfg = SimConfig {
                clock: match a.manual_clock {
                    Some(start) => Clock::Manual { start, tick_ms: a.tick_ms },
                    None => Clock::Wall,
                },
                time_zone: a.time_zone.clone(),
                zone_rules: None,
                capture_lag_ms: a.capture_lag_ms,
                retention_minutes: a.retention_minutes,
                allow_snapshot_isolation: a.allow_snapshot_isolation,
                conn_rows_per_s: a.rows_per_s,
                query_latency_ms: a.latency_ms,
                idle_interval_seconds: a.idle_interval_seconds,
                auto_cleanup_interval_minutes: a.auto_cleanup_minutes,
                lock_timeout_ms: None,
                seed: a.seed,
            };
            let name = parse_table_name(&a.table)?;
            let spec = match (&a.preset, &a.columns) {
                (Some(p), _) if p.eq_ignore_ascii_case("orders") => orders_table_spec(name.clone()),
                (Some(p), _) => return Err(SimError::BadArgument(format!("'{p}' is not a preset; the presets are: orders"))),
                (None, Some(cols)) => TableSpec { collations: Default::default(),
                    name: name.clone(),
                    columns: parse_columns(cols)?,
                    primary_key: list(&a.primary_key),
                    unique_index: list(&a.unique_index),
                },
                (None, None) => orders_table_spec(name.clone()),
            };
            if a.rows > 0 && a.columns.is_some() {
                return Err(SimError::BadArgument("--rows needs --preset orders (generated rows for custom columns are written with `sim write`)".into()));
            }
            let db = SimDb::create_with(&a.db, cfg, a.overwrite)?;
            db.create_table(&spec)?;
            let loaded = if a.rows > 0 { db.load_rows(&name, orders_rows(a.rows, a.seed))? } else { 0 };
            let instance = match (a.no_cdc, &a.gating_role) {
                (true, _) => None,
                (false, Some(role)) => Some(db.enable_cdc_gated(&name, None, None, role)?),
                (false, None) => Some(db.enable_cdc(&name, None, None)?),
            };
            Ok(serde_json::json!({
                "created": db.url(),
                "table": name.to_string(),
                "rows_loaded": loaded,
                "capture_instance": json(&instance),
            }))
        }
        SimCommand::Write(a) => {
            let db = SimDb::open(&a.db)?;
            let table = pick_table(&db, &a.table)?;
            let w = Workload { tx_per_s: a.tx_per_s, ops_per_tx: a.ops_per_tx, mix: Mix::parse(&a.mix)?, hot_fraction: a.hot_fraction, skew: a.skew, seed: a.seed };
            let until = match a.transactions {
                Some(n) => Until::Transactions(n),
                None => Until::Deadline(Instant::now() + Duration::from_secs_f64(a.seconds.max(0.0))),
            };
            let report = w.run(&db, &table, until, Arc::new(AtomicBool::new(false)))?;
            Ok(serde_json::json!({ "table": table.to_string(), "workload": json(&w), "report": json(&report) }))
        }
        SimCommand::Capture(a) => Ok(json(&SimDb::open(&a.db)?.capture()?)),
        SimCommand::Cleanup(a) => {
            let db = SimDb::open(&a.db)?;
            let r = match &a.to_lsn {
                Some(l) => db.cleanup_to_lsn(Lsn::parse(l).map_err(|e| SimError::BadArgument(e.to_string()))?)?,
                None => db.cleanup(a.retention_minutes)?,
            };
            Ok(json(&r))
        }
        SimCommand::Alter(a) => {
            let db = SimDb::open(&a.db)?;
            let mut done = Vec::new();
            for kv in &a.set {
                let (k, v) = kv.split_once('=').ok_or_else(|| SimError::BadArgument(format!("'{kv}' is not key=value")))?;
                db.set_config_value(k.trim(), v.trim())?;
                done.push(format!("set {}", kv.trim()));
            }
            let needs_table =
                !(a.add_column.is_empty() && a.drop_column.is_empty() && a.rename_column.is_empty() && a.enable_instance.is_empty());
            if needs_table {
                let table = pick_table(&db, &a.table)?;
                for c in &a.add_column {
                    db.add_column(&table, parse_column(c)?)?;
                    done.push(format!("added column {c} to {table}"));
                }
                for c in &a.drop_column {
                    db.drop_column(&table, c)?;
                    done.push(format!("dropped column {c} from {table}"));
                }
                for r in &a.rename_column {
                    let (old, new) = r
                        .split_once('=')
                        .map(|(o, n)| (o.trim(), n.trim()))
                        .filter(|(o, n)| !o.is_empty() && !n.is_empty())
                        .ok_or_else(|| SimError::BadArgument(format!("--rename-column '{r}' is not old=new (e.g. --rename-column amount=total)")))?;
                    db.rename_column(&table, old, new)?;
                    done.push(format!("renamed column {old} of {table} to {new}"));
                }
                for i in &a.enable_instance {
                    let ci = match &a.gating_role {
                        Some(role) => db.enable_cdc_gated(&table, Some(i), None, role)?,
                        None => db.enable_cdc(&table, Some(i), None)?,
                    };
                    done.push(format!("enabled capture instance {} at {}", ci.name, ci.start_lsn.map(|l| l.to_hex()).unwrap_or_default()));
                }
            }
            for i in &a.drop_instance {
                db.disable_instance(i)?;
                done.push(format!("dropped capture instance {i}"));
            }
            Ok(serde_json::json!({ "done": done, "config": json(&db.config()?) }))
        }
        SimCommand::Status(a) => SimDb::open(&a.db)?.status(),
        SimCommand::Fault(a) => {
            let db = SimDb::open(&a.db)?;
            let f = FaultSpec { on: a.on, after_rows: a.after_rows, times: a.times };
            db.inject_fault(f)?;
            Ok(serde_json::json!({ "armed": json(&f) }))
        }
        SimCommand::Advance(a) => {
            let db = SimDb::open(&a.db)?;
            let secs = a.seconds + a.minutes * 60.0;
            if secs < 0.0 {
                return Err(SimError::BadArgument("the clock only moves forward".into()));
            }
            let now = db.advance_clock(Duration::from_secs_f64(secs))?;
            let capture = if a.capture { Some(db.capture()?) } else { None };
            Ok(serde_json::json!({ "clock_utc": now.to_rfc3339(), "capture": json(&capture) }))
        }
        SimCommand::User(a) => {
            let db = SimDb::open(&a.db)?;
            for u in &a.create {
                db.create_user(u)?;
            }
            for u in &a.drop {
                db.drop_user(u)?;
            }
            Ok(serde_json::json!({ "security": json(&db.security()?) }))
        }
        SimCommand::Role(a) => {
            let db = SimDb::open(&a.db)?;
            for r in &a.create {
                db.create_role(r)?;
            }
            if !(a.add_member.is_empty() && a.drop_member.is_empty()) {
                let role = a.role.as_deref().ok_or_else(|| SimError::BadArgument("--add-member and --drop-member need --role".into()))?;
                for m in &a.add_member {
                    db.add_role_member(role, m)?;
                }
                for m in &a.drop_member {
                    db.drop_role_member(role, m)?;
                }
            }
            Ok(serde_json::json!({ "security": json(&db.security()?) }))
        }
        SimCommand::Grant(a) => {
            let db = SimDb::open(&a.db)?;
            let added = db.grant(&a.user, a.permission, &a.on, &list(&a.columns))?;
            Ok(serde_json::json!({ "granted": json(&added) }))
        }
        SimCommand::Revoke(a) => {
            let db = SimDb::open(&a.db)?;
            let removed = db.revoke(&a.user, a.permission, &a.on, &list(&a.columns))?;
            Ok(serde_json::json!({ "revoked": removed }))
        }
    }
}
