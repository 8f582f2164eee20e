//! Many tables: the fleet file, and running one step over its tables.
//!
//! A fleet file holds what the tables of one source share (`[defaults]`) and
//! one `[[tables]]` entry per replicated table, the shape Debezium users know
//! from one connector with a table list and Lakeflow Connect users from one
//! pipeline with per-table overrides. Each entry is a workflow file's keys
//! laid over the defaults (tables merged key by key, the entry winning), and
//! `name = "schema.table"` names the table. In the defaults' strings,
//! `{schema}` and `{table}` stand for each entry's own, so one line gives
//! every table its targets and app id:
//!
//! ```toml
//! [fleet]
//! max_source_connections = 8
//!
//! [defaults]
//! app_id = "{schema}_{table}"
//! source.url = "mssql://cdc_reader@sql01:1433/shop"
//! source.password_env = "SHOP_CDC_PASSWORD"
//! target.bronze = "s3://lake/bronze/{schema}/{table}"
//! target.facts = "s3://lake/_facts"
//! target.silver = "s3://lake/silver/{schema}/{table}"
//!
//! [[tables]]
//! name = "dbo.orders"
//! snapshot.mode = "chunked"
//!
//! [[tables]]
//! name = "dbo.customers"
//! ```
//!
//! Why a file and not a folder of workflow files: the tables of one source
//! share the connection, the facts table and the target layout, and a
//! change to those (a new password variable, a new bucket) is one line here
//! instead of one per table. A folder of workflow files keeps working table
//! by table (`--workflow`), and the orchestrator examples map over one.
//!
//! Every entry becomes a [`Workflow`] through the same parser and checks as a
//! workflow file (so a misspelt key is refused, naming the table), and the
//! fleet is refused before anything runs when two entries would share a
//! stream's identity: the same source table twice, one app id twice on one
//! facts table, or one bronze table for two entries.
//!
//! [`run_many`] runs a step on the selected tables, at most `parallel` at
//! once and within `max_source_connections` (each table's step takes as many
//! as it may open: `snapshot.parallelism` for the steps that can read a
//! snapshot, one for the others). A table's failure, even a panic, is that
//! table's result: the others run on.

pub mod status;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{StepError, StepResult, EXIT_BUG, EXIT_CONFIG, EXIT_NEEDS_PERSON, EXIT_OK, EXIT_TEMPORARY};
use crate::workflow::Workflow;

/// The fleet's source connections when the file does not say.
pub const DEFAULT_MAX_SOURCE_CONNECTIONS: usize = 16;

/// A parsed fleet file: one workflow per table.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub path: PathBuf,
    /// The most source connections the fleet's steps hold at once.
    pub max_source_connections: usize,
    /// The tables' workflows, in the file's order.
    pub tables: Vec<Workflow>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetFile {
    #[serde(default)]
    fleet: FleetOptions,
    #[serde(default)]
    defaults: toml::Table,
    #[serde(default)]
    tables: Vec<toml::Table>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetOptions {
    max_source_connections: Option<usize>,
}

impl Fleet {
    /// Reads and checks a fleet file.
    pub fn load(path: &Path) -> StepResult<Fleet> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| StepError::Config(format!("cannot read fleet file {}: {e}. Pass an existing TOML file with --fleet.", path.display())))?;
        Fleet::parse(&text, path)
    }

    /// Parses fleet text; `path` resolves relative paths and names the file in errors.
    pub fn parse(text: &str, path: &Path) -> StepResult<Fleet> {
        let file = path.display();
        let bad = |what: String| StepError::Config(format!("fleet file {file}: {what}"));
        let parsed: FleetFile = toml::from_str(text).map_err(|e| bad(format!("not valid: {}", e.to_string().trim())))?;
        let max_source_connections = parsed.fleet.max_source_connections.unwrap_or(DEFAULT_MAX_SOURCE_CONNECTIONS);
        if max_source_connections == 0 {
            return Err(bad("fleet.max_source_connections is 0: use 1 or more".into()));
        }
        if parsed.tables.is_empty() {
            return Err(bad("it has no [[tables]] entry: add one per table, each with name = \"schema.table\"".into()));
        }
        if parsed.defaults.contains_key("table") {
            return Err(bad("[defaults] has a table section: name each table in its own [[tables]] entry (name = \"schema.table\")".into()));
        }
        let mut tables = Vec::with_capacity(parsed.tables.len());
        for (i, entry) in parsed.tables.into_iter().enumerate() {
            tables.push(entry_workflow(&parsed.defaults, entry, i, path)?);
        }
        check_identities(&tables, path)?;
        Ok(Fleet { path: path.to_path_buf(), max_source_connections, tables })
    }

    /// The tables a call names: `--table NAME` (schema.table, a table name
    /// that only one entry has, or an app id) or `--all`.
    pub fn select(&self, table: Option<&str>, all: bool) -> StepResult<Vec<Workflow>> {
        match (table, all) {
            (Some(_), true) => Err(StepError::Config("pass either --table NAME or --all, not both".into())),
            (None, false) => Err(StepError::Config(format!(
                "with --fleet {}, name the table with --table NAME or run every table with --all",
                self.path.display()
            ))),
            (None, true) => Ok(self.tables.clone()),
            (Some(name), false) => {
                let wanted = name.to_ascii_lowercase();
                let full = |w: &Workflow| format!("{}.{}", w.table.schema, w.table.name).to_ascii_lowercase();
                let by_full: Vec<&Workflow> = self.tables.iter().filter(|w| full(w) == wanted).collect();
                let by_name: Vec<&Workflow> = self.tables.iter().filter(|w| w.table.name.to_ascii_lowercase() == wanted).collect();
                let by_app: Vec<&Workflow> = self.tables.iter().filter(|w| w.app_id == name).collect();
                let found = if !by_full.is_empty() {
                    by_full
                } else if !by_app.is_empty() {
                    by_app
                } else {
                    by_name
                };
                match found.as_slice() {
                    [one] => Ok(vec![(*one).clone()]),
                    [] => Err(StepError::Config(format!(
                        "fleet file {} has no table '{name}': it has {}",
                        self.path.display(),
                        self.tables.iter().map(|w| format!("{}.{}", w.table.schema, w.table.name)).collect::<Vec<_>>().join(", ")
                    ))),
                    many => Err(StepError::Config(format!(
                        "'{name}' names {} tables of fleet file {}: use schema.table ({})",
                        many.len(),
                        self.path.display(),
                        many.iter().map(|w| format!("{}.{}", w.table.schema, w.table.name)).collect::<Vec<_>>().join(", ")
                    ))),
                }
            }
        }
    }
}

/// One entry laid over the defaults, its placeholders filled, parsed as a workflow.
fn entry_workflow(defaults: &toml::Table, mut entry: toml::Table, index: usize, path: &Path) -> StepResult<Workflow> {
    let file = path.display();
    let at = format!("fleet file {file}, [[tables]] entry {}", index + 1);
    let name = match entry.remove("name") {
        Some(toml::Value::String(s)) => s,
        Some(other) => return Err(StepError::Config(format!("{at}: name is {other}: use name = \"schema.table\""))),
        None => return Err(StepError::Config(format!("{at}: it has no name: add name = \"schema.table\""))),
    };
    if entry.contains_key("table") {
        return Err(StepError::Config(format!(
            "{at} ({name}): it has a table section: name the table with name = \"schema.table\" alone \
             (and pin a capture instance with capture_instance = \"NAME\")"
        )));
    }
    let capture_instance = match entry.remove("capture_instance") {
        None => None,
        Some(toml::Value::String(s)) => Some(s),
        Some(other) => return Err(StepError::Config(format!("{at} ({name}): capture_instance is {other}: use a string"))),
    };
    let (schema, table) = match name.split_once('.') {
        Some((s, t)) if !s.is_empty() && !t.is_empty() && !t.contains('.') => (s.to_string(), t.to_string()),
        None if !name.is_empty() => ("dbo".to_string(), name.clone()),
        _ => return Err(StepError::Config(format!("{at}: name '{name}' is not schema.table (or a table name, in dbo)"))),
    };
    let mut merged = defaults.clone();
    merge(&mut merged, entry);
    fill(&mut merged, &schema, &table);
    let mut table_section = toml::Table::new();
    table_section.insert("schema".into(), toml::Value::String(schema.clone()));
    table_section.insert("name".into(), toml::Value::String(table.clone()));
    if let Some(ci) = capture_instance {
        table_section.insert("capture_instance".into(), toml::Value::String(ci));
    }
    merged.insert("table".into(), toml::Value::Table(table_section));
    let text = toml::to_string(&merged).map_err(|e| StepError::Internal(format!("{at} ({name}): cannot write it back as TOML: {e}")))?;
    Workflow::parse(&text, path).map_err(|e| match e {
        StepError::Config(m) => StepError::Config(m.replacen("workflow file", &format!("table {schema}.{table} of fleet file"), 1)),
        other => other,
    })
}

/// Lays `over` onto `base`: tables merge key by key, anything else replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Replaces `{schema}` and `{table}` in every string.
fn fill(t: &mut toml::Table, schema: &str, table: &str) {
    fn value(v: &mut toml::Value, schema: &str, table: &str) {
        match v {
            toml::Value::String(s) => *s = s.replace("{schema}", schema).replace("{table}", table),
            toml::Value::Table(t) => fill(t, schema, table),
            toml::Value::Array(a) => a.iter_mut().for_each(|v| value(v, schema, table)),
            _ => {}
        }
    }
    t.iter_mut().for_each(|(_, v)| value(v, schema, table));
}

/// Refuses entries that would share a stream's identity.
fn check_identities(tables: &[Workflow], path: &Path) -> StepResult<()> {
    let file = path.display();
    let mut sources: HashMap<(String, String), usize> = HashMap::new();
    let mut apps: HashMap<(String, String), usize> = HashMap::new();
    let mut bronzes: HashMap<String, usize> = HashMap::new();
    let label = |w: &Workflow| format!("{}.{}", w.table.schema, w.table.name);
    for (i, w) in tables.iter().enumerate() {
        let table = label(w).to_ascii_lowercase();
        if let Some(j) = sources.insert((w.source.url.clone(), table), i) {
            return Err(StepError::Config(format!("fleet file {file}: {} is listed twice (entries {} and {}): keep one", label(w), j + 1, i + 1)));
        }
        if let Some(j) = apps.insert((w.target.facts.clone(), w.app_id.clone()), i) {
            return Err(StepError::Config(format!(
                "fleet file {file}: {} and {} both have app_id '{}' on facts table {}: give each table its own app id (app_id = \"{{schema}}_{{table}}\" in [defaults] does)",
                label(&tables[j]),
                label(w),
                w.app_id,
                w.target.facts
            )));
        }
        if let Some(j) = bronzes.insert(w.target.bronze.clone(), i) {
            return Err(StepError::Config(format!(
                "fleet file {file}: {} and {} both write bronze {}: give each its own (use {{schema}} and {{table}} in target.bronze)",
                label(&tables[j]),
                label(w),
                w.target.bronze
            )));
        }
    }
    Ok(())
}

/// One table's outcome in a fleet call.
#[derive(Debug, Clone)]
pub struct TableOutcome {
    pub table: String,
    pub app_id: String,
    pub exit_code: i32,
    /// The step's JSON, or `{"ok": false, "kind", "error"}`.
    pub value: Value,
}

impl TableOutcome {
    pub fn to_json(&self) -> Value {
        json!({"table": self.table, "app_id": self.app_id, "exit_code": self.exit_code, "result": self.value})
    }
}

/// Runs `step` on each workflow, at most `parallel` at once and holding at
/// most `max_connections` source connections (`connections(w)` per table,
/// capped at the whole budget); returns the outcomes in the workflows'
/// order. An error or a panic is that table's outcome.
pub async fn run_many<F, Fut>(
    workflows: Vec<Workflow>,
    parallel: usize,
    max_connections: usize,
    connections: impl Fn(&Workflow) -> usize,
    step: F,
) -> Vec<TableOutcome>
where
    F: Fn(Workflow) -> Fut,
    Fut: Future<Output = StepResult<(Value, i32)>>,
{
    let tables_at_once = Arc::new(tokio::sync::Semaphore::new(parallel.max(1)));
    let budget = max_connections.max(1);
    let source_connections = Arc::new(tokio::sync::Semaphore::new(budget));
    let mut running = FuturesUnordered::new();
    for (i, w) in workflows.into_iter().enumerate() {
        let need = connections(&w).clamp(1, budget) as u32;
        let (tables_at_once, source_connections) = (tables_at_once.clone(), source_connections.clone());
        let table = format!("{}.{}", w.table.schema, w.table.name);
        let app_id = w.app_id.clone();
        let fut = step(w);
        running.push(async move {
            let _table_slot = tables_at_once.acquire_owned().await;
            let _connections = source_connections.acquire_many_owned(need).await;
            tracing::info!(table = %table, "fleet: step starts");
            let outcome = AssertUnwindSafe(fut).catch_unwind().await;
            let (exit_code, value) = match outcome {
                Ok(Ok((v, code))) => (code, v),
                Ok(Err(e)) => {
                    let message = crate::error::error_chain(&e);
                    tracing::error!(table = %table, "{message}");
                    (e.exit_code(), json!({"ok": false, "kind": e.kind(), "exit_code": e.exit_code(), "error": message}))
                }
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "a panic".into());
                    tracing::error!(table = %table, "the step panicked: {message}");
                    (EXIT_BUG, json!({"ok": false, "kind": "bug", "exit_code": EXIT_BUG, "error": format!("the step panicked: {message}")}))
                }
            };
            (i, TableOutcome { table, app_id, exit_code, value })
        });
    }
    let mut out: BTreeMap<usize, TableOutcome> = BTreeMap::new();
    while let Some((i, o)) = running.next().await {
        out.insert(i, o);
    }
    out.into_values().collect()
}

/// The exit code of a fleet call: 0 when every table's was, else the most
/// serious one (a bug, then a person needed, then bad input, then "call
/// again later"), so an orchestrator that retries exit 75 retries only a
/// fleet whose every failure was temporary.
pub fn fleet_exit_code(outcomes: &[TableOutcome]) -> i32 {
    let rank = |c: i32| match c {
        EXIT_OK => 0,
        EXIT_TEMPORARY => 1,
        EXIT_CONFIG => 2,
        EXIT_NEEDS_PERSON => 3,
        _ => 4,
    };
    outcomes.iter().map(|o| o.exit_code).max_by_key(|c| rank(*c)).unwrap_or(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLEET: &str = r#"
[fleet]
max_source_connections = 6

[defaults]
app_id = "{schema}_{table}"
source.url = "sim://source.sqlite"
target.bronze = "lake/bronze/{schema}/{table}"
target.facts = "lake/_facts"
target.silver = "lake/silver/{schema}/{table}"
snapshot.mode = "full"
snapshot.parallelism = 2

[[tables]]
name = "dbo.orders"
snapshot.mode = "chunked"
snapshot.chunk_rows = 500

[[tables]]
name = "sales.orders"

[[tables]]
name = "customers"
app_id = "crm_customers"
"#;

    fn parse(text: &str) -> StepResult<Fleet> {
        Fleet::parse(text, Path::new("/etc/cdc/fleet.toml"))
    }

    #[test]
    fn entries_are_laid_over_the_defaults_with_their_placeholders_filled() {
        let f = parse(FLEET).unwrap();
        assert_eq!(f.max_source_connections, 6);
        assert_eq!(f.tables.len(), 3);
        let o = &f.tables[0];
        assert_eq!((o.app_id.as_str(), o.table.schema.as_str(), o.table.name.as_str()), ("dbo_orders", "dbo", "orders"));
        assert_eq!(o.target.bronze, "/etc/cdc/lake/bronze/dbo/orders");
        assert_eq!(o.target.facts, "/etc/cdc/lake/_facts");
        assert_eq!(o.snapshot.mode, crate::workflow::SnapshotMode::Chunked, "the entry's key wins");
        assert_eq!(o.snapshot.parallelism, 2, "a key the entry does not set comes from the defaults");
        assert_eq!(o.snapshot.chunk_rows, 500);
        assert_eq!(f.tables[1].snapshot.mode, crate::workflow::SnapshotMode::Full);
        assert_eq!(f.tables[1].target.bronze, "/etc/cdc/lake/bronze/sales/orders");
        assert_eq!((f.tables[2].app_id.as_str(), f.tables[2].table.schema.as_str()), ("crm_customers", "dbo"));
        assert_eq!(o.source.url, "sim:///etc/cdc/source.sqlite", "relative paths resolve against the fleet file");
    }

    #[test]
    fn a_table_is_selected_by_schema_and_name_by_a_name_only_one_has_or_by_app_id() {
        let f = parse(FLEET).unwrap();
        assert_eq!(f.select(Some("sales.orders"), false).unwrap()[0].app_id, "sales_orders");
        assert_eq!(f.select(Some("SALES.Orders"), false).unwrap()[0].app_id, "sales_orders");
        assert_eq!(f.select(Some("customers"), false).unwrap()[0].app_id, "crm_customers");
        assert_eq!(f.select(Some("dbo_orders"), false).unwrap()[0].table.schema, "dbo");
        let e = f.select(Some("orders"), false).unwrap_err().to_string();
        assert!(e.contains("names 2 tables") && e.contains("dbo.orders, sales.orders"), "{e}");
        let e = f.select(Some("nope"), false).unwrap_err().to_string();
        assert!(e.contains("no table 'nope'") && e.contains("dbo.customers"), "{e}");
        assert_eq!(f.select(None, true).unwrap().len(), 3);
        assert!(f.select(None, false).unwrap_err().to_string().contains("--table NAME or run every table with --all"));
    }

    #[test]
    fn entries_that_would_share_an_identity_or_say_something_wrong_are_refused() {
        let cases: [(&str, &str); 7] = [
            ("[[tables]]\nname = \"dbo.a\"\n[[tables]]\nname = \"DBO.A\"\n", "is listed twice"),
            ("[[tables]]\nname = \"dbo.a\"\n[[tables]]\nname = \"dbo.b\"\napp_id = \"dbo_a\"\n", "both have app_id 'dbo_a'"),
            ("[[tables]]\nname = \"dbo.a\"\ntarget.bronze = \"x\"\n[[tables]]\nname = \"dbo.b\"\ntarget.bronze = \"x\"\n", "both write bronze"),
            ("[[tables]]\nname = \"dbo.a\"\nsnapshot.modee = \"full\"\n", "table dbo.a of fleet file /etc/cdc/fleet.toml is not valid"),
            ("[[tables]]\nnam = \"dbo.a\"\n", "it has no name"),
            ("", "no [[tables]] entry"),
            ("[fleet]\nmax_source_connections = 0\n[[tables]]\nname = \"dbo.a\"\n", "max_source_connections is 0"),
        ];
        let head = "[defaults]\napp_id = \"{schema}_{table}\"\nsource.url = \"sim://s.sqlite\"\ntarget.bronze = \"b/{table}\"\ntarget.facts = \"f\"\n";
        for (tail, want) in cases {
            let text = if tail.starts_with("[fleet]") { format!("{tail}{head}") } else { format!("{head}{tail}") };
            let e = parse(&text).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains(want), "{tail:?}: {e}");
            assert!(e.contains("/etc/cdc/fleet.toml"), "the file is named: {e}");
        }
    }

    #[test]
    fn the_fleet_exit_code_is_the_most_serious_tables() {
        let o = |c: i32| TableOutcome { table: "t".into(), app_id: "a".into(), exit_code: c, value: Value::Null };
        assert_eq!(fleet_exit_code(&[o(0), o(0)]), 0);
        assert_eq!(fleet_exit_code(&[o(0), o(75)]), 75);
        assert_eq!(fleet_exit_code(&[o(75), o(2), o(0)]), 2);
        assert_eq!(fleet_exit_code(&[o(2), o(3)]), 3);
        assert_eq!(fleet_exit_code(&[o(3), o(1), o(75)]), 1);
    }

    #[tokio::test]
    async fn one_tables_failure_or_panic_does_not_stop_the_others_and_the_budgets_hold() {
        let f = parse(FLEET).unwrap();
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (r, m) = (running.clone(), most.clone());
        let out = run_many(f.tables.clone(), 3, 2, |_| 2, move |w: Workflow| {
            let (r, m) = (r.clone(), m.clone());
            async move {
                let now = r.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                m.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                r.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                match w.app_id.as_str() {
                    "dbo_orders" => Err(StepError::Temporary("the source dropped the connection".into())),
                    "sales_orders" => panic!("boom"),
                    _ => Ok((json!({"ok": true}), EXIT_OK)),
                }
            }
        })
        .await;
        assert_eq!(out.iter().map(|o| o.exit_code).collect::<Vec<_>>(), vec![75, 1, 0], "in the file's order");
        assert!(out[1].value["error"].as_str().unwrap().contains("boom"));
        assert_eq!(out[2].value["ok"], true);
        assert_eq!(most.load(std::sync::atomic::Ordering::SeqCst), 1, "2 connections each within a budget of 2: one table at a time");
        assert_eq!(fleet_exit_code(&out), 1);
    }
}
