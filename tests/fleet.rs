//! A fleet file through the binary: `--all` runs a step on every table, one
//! table's failure is its own result, `--table` picks one, `status` writes
//! nothing and renders as a table or Prometheus metrics. The targets are
//! compared with the simulator's own rows and change log, table by table.

use std::path::Path;
use std::process::{Command, Output};

mod common;

use common::{item_row, items_spec, last_json, Scenario};
use mssql_cdc::fleet::Fleet;
use mssql_cdc::source::TableName;
use mssql_cdc::types::SqlValue;

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mssql-cdc")).args(args).env("MSSQL_CDC_LOG", "warn").output().unwrap()
}

const FLEET: &str = r#"
[fleet]
max_source_connections = 3

[defaults]
app_id = "{schema}_{table}"
source.url = "sim://source.sqlite"
target.bronze = "lake/{schema}/{table}/bronze"
target.facts = "lake/_facts"
target.silver = "lake/{schema}/{table}/silver"
snapshot.bootstrap = true
snapshot.mode = "full"
snapshot.parallelism = 2

[[tables]]
name = "dbo.items"

[[tables]]
name = "sales.items"

[[tables]]
name = "dbo.nocdc"
"#;

/// Each table's workflow written out as a file of its own, for the checks
/// that read a workflow file.
fn workflow_files(fleet_path: &Path) -> Vec<(TableName, std::path::PathBuf)> {
    let fleet = Fleet::load(fleet_path).unwrap();
    fleet
        .tables
        .iter()
        .map(|w| {
            let path = fleet_path.with_file_name(format!("{}_{}.toml", w.table.schema, w.table.name));
            std::fs::write(&path, toml::to_string(w).unwrap()).unwrap();
            (TableName::new(w.table.schema.clone(), w.table.name.clone()), path)
        })
        .collect()
}

fn by_table<'a>(j: &'a serde_json::Value, table: &str) -> &'a serde_json::Value {
    j["tables"].as_array().unwrap().iter().find(|t| t["table"] == table).unwrap_or_else(|| panic!("no {table} in {j}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_streams_applies_and_reconciles_every_table_and_one_tables_failure_is_its_own() {
    let mut s = Scenario::new(25, "");
    let sales = TableName::new("sales", "items");
    s.db.create_table(&items_spec(&sales)).unwrap();
    s.db.load_rows(&sales, (1..=40).map(|i| item_row(i, 0))).unwrap();
    s.db.enable_cdc(&sales, None, None).unwrap();
    // A table without CDC: every step on it fails with exit 2.
    s.db.create_table(&items_spec(&TableName::new("dbo", "nocdc"))).unwrap();
    common::settle(&s.db);
    let fleet_path = s.path().join("fleet.toml");
    std::fs::write(&fleet_path, FLEET).unwrap();
    let f = fleet_path.to_str().unwrap();

    // No --table, no --all: refused, naming both.
    let out = run(&["--fleet", f, "stream"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(last_json(&out)["error"].as_str().unwrap().contains("--table NAME or run every table with --all"));
    // seed is one table's: --all is refused before anything is read.
    let out = run(&["--fleet", f, "--all", "seed", "--copy", "x", "--as-of", "2026-01-01T00:00:00Z"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(last_json(&out)["error"].as_str().unwrap().contains("--table NAME, not --all"));

    // Status writes nothing, for any table.
    let out = run(&["--fleet", f, "--all", "status", "--format", "table"]);
    assert_eq!(out.status.code(), Some(2), "the table without CDC fails its status");
    assert!(!s.path().join("lake").exists(), "status created a target");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("TABLE") && lines.iter().any(|l| l.starts_with("dbo.nocdc") && l.contains("ERROR")), "{stdout}");

    // Every table's stream: the two with CDC bootstrap; the third fails alone.
    let out = run(&["--fleet", f, "--all", "--parallel", "3", "stream"]);
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(2), "{j}");
    assert_eq!((j["succeeded"].as_u64(), j["failed"].as_u64()), (Some(2), Some(1)), "{j}");
    let bad = by_table(&j, "dbo.nocdc");
    assert_eq!(bad["exit_code"], 2, "{bad}");
    assert!(bad["result"]["error"].as_str().unwrap().contains("sp_cdc_enable_table"), "{bad}");
    for t in ["dbo.items", "sales.items"] {
        assert_eq!(by_table(&j, t)["exit_code"], 0, "{j}");
        assert!(by_table(&j, t)["result"]["bootstrap"].is_object(), "{t} bootstrapped: {j}");
    }

    // Changes on both tables, then stream, apply and reconcile the two.
    s.changes(12);
    s.db.transaction(|tx| {
        tx.insert(&sales, item_row(1000, 1))?;
        tx.update(&sales, &vec![SqlValue::Int(3)], item_row(3, 7))?;
        tx.delete(&sales, &vec![SqlValue::Int(5)])
    })
    .unwrap();
    common::settle(&s.db);
    for step in ["stream", "apply", "reconcile"] {
        let out = run(&["--fleet", f, "--table", "dbo.items", step]);
        assert_eq!(out.status.code(), Some(0), "{step} of one table: {}", last_json(&out));
        let out = run(&["--fleet", f, "--table", "sales.items", step]);
        assert_eq!(out.status.code(), Some(0), "{step} of one table: {}", last_json(&out));
    }
    let out = run(&["--fleet", f, "--all", "reconcile"]);
    let j = last_json(&out);
    for t in ["dbo.items", "sales.items"] {
        assert_eq!(by_table(&j, t)["result"]["clean"], true, "{j}");
    }

    // Against the simulator's own rows and change log, every column.
    for (table, wf) in workflow_files(&fleet_path) {
        if table.name == "nocdc" {
            continue;
        }
        common::assert_targets_match_source(&s.db, &table, &wf).await;
    }

    // The metrics: two tables up with their state and a clean reconcile, the third down.
    let prom = s.path().join("metrics.prom");
    let out = run(&["--fleet", f, "--all", "status", "--format", "prometheus", "--out", prom.to_str().unwrap()]);
    let j = last_json(&out);
    assert_eq!(j["out"], prom.to_str().unwrap(), "{j}");
    let text = std::fs::read_to_string(&prom).unwrap();
    assert!(text.contains("mssql_cdc_up{table=\"dbo.items\",app_id=\"dbo_items\"} 1\n"), "{text}");
    assert!(text.contains("mssql_cdc_up{table=\"dbo.nocdc\",app_id=\"dbo_nocdc\"} 0\n"), "{text}");
    assert!(text.contains("mssql_cdc_reconcile_clean{table=\"sales.items\",app_id=\"sales_items\"} 1\n"), "{text}");
    assert!(text.contains("mssql_cdc_state{table=\"sales.items\",app_id=\"sales_items\",state=\"streaming\"} 1\n"), "{text}");
    assert!(text.contains("mssql_cdc_lag_seconds{table=\"dbo.items\",app_id=\"dbo_items\"} 0\n"), "caught up: {text}");
    // One table's status through --table is that table's JSON.
    let out = run(&["--fleet", f, "--table", "sales_items", "status"]);
    let j = last_json(&out);
    assert_eq!((j["app_id"].as_str(), j["table"].as_str()), (Some("sales_items"), Some("sales.items")), "{j}");
    assert_eq!(j["last_reconcile"]["clean"], true, "{j}");
}
