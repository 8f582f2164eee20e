//! A stream's identity and its targets, through the command line: app ids
//! that could be taken for another stream's generation, targets that are one
//! table spelt twice or nested, a bronze or facts table that belongs to
//! another stream, `status` writing nothing, and keys Delta would round.
//! Every refusal is exit 2 before anything is written, checked on disk.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use chrono::{TimeZone, Utc};
use common::{last_json, Scenario};
use mssql_cdc::sim::TableSpec;
use mssql_cdc::source::TableName;
use mssql_cdc::types::{as_stored, value_at, ColumnDesc, SqlType, SqlValue};

fn run(wf: &Path, step: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .args(["--workflow", wf.to_str().unwrap(), step])
        .env("MSSQL_CDC_LOG", "warn")
        .output()
        .unwrap()
}

/// Runs a step that must be refused: exit 2, `needle` in the error.
fn expect_refused(wf: &Path, step: &str, needle: &str) -> String {
    let out = run(wf, step);
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(2), "{step} must exit 2: {j}");
    let msg = j["error"].as_str().unwrap().to_string();
    assert!(msg.contains(needle), "the error should mention '{needle}': {msg}");
    msg
}

fn expect_ok(wf: &Path, step: &str) -> serde_json::Value {
    let out = run(wf, step);
    assert_eq!(out.status.code(), Some(0), "{step}: {}", String::from_utf8_lossy(&out.stderr));
    last_json(&out)
}

/// Runs `stream` until it reports `caught_up` (50 calls at the most).
fn stream_until_caught_up(wf: &Path) {
    for _ in 0..50 {
        if expect_ok(wf, "stream")["caught_up"] == true {
            return;
        }
    }
    panic!("the stream of {} did not catch up in 50 calls", wf.display());
}

/// Every file under `dir`, recursively, with its size: a refused step must leave it unchanged.
fn listing(dir: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    fn walk(p: &Path, out: &mut Vec<(String, u64)>) {
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                let path = e.path();
                if path.is_dir() {
                    out.push((path.display().to_string(), 0));
                    walk(&path, out);
                } else if !path.to_string_lossy().contains("sqlite") && path.extension().and_then(|x| x.to_str()) != Some("toml") {
                    // The source file and the workflow files are not targets.
                    out.push((path.display().to_string(), e.metadata().map(|m| m.len()).unwrap_or(0)));
                }
            }
        }
    }
    walk(dir, &mut out);
    out.sort();
    out
}

fn workflow(dir: &Path, file: &str, app_id: &str, table: &str, bronze: &str, facts: &str, extra: &str) -> std::path::PathBuf {
    let path = dir.join(file);
    std::fs::write(
        &path,
        format!(
            "app_id = \"{app_id}\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"{table}\"\n\
             [target]\nbronze = \"{bronze}\"\nfacts = \"{facts}\"\n{extra}\n[snapshot]\nbootstrap = true\n"
        ),
    )
    .unwrap();
    path
}

#[test]
fn an_app_id_of_a_generations_form_is_refused_before_anything_is_written() {
    let mut s = Scenario::new(20, "[snapshot]\nbootstrap = true\n");
    // The stream `items` runs on shared tables.
    expect_ok(&s.wf_path, "stream");
    let before = listing(s.path());
    // `items.g1` is the id generation 1 of `items` commits under.
    let wf = workflow(s.path(), "collide.toml", "items.g1", "items", "bronze", "facts", "");
    expect_refused(&wf, "stream", "generation");
    expect_refused(&wf, "status", "generation");
    assert_eq!(listing(s.path()), before, "nothing may be written");
    // Other separators and characters are refused too; a plain dotted name is fine.
    let wf = workflow(s.path(), "hash.toml", "items#x", "items", "b2", "f2", "");
    expect_refused(&wf, "stream", "items#x");
    assert!(!s.path().join("b2").exists() && !s.path().join("f2").exists());
    // The legitimate stream `items` goes on, now with silver, through
    // changes: had the colliding id been accepted, its facts would have been
    // taken for items' (batch facts dropped as applied, a range written to
    // bronze again, batch ids skipping), which the bronze and tiling checks see.
    s.write_workflow("silver = \"silver\"\n[snapshot]\nbootstrap = true\n");
    for _ in 0..3 {
        s.changes(4);
        s.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        common::settle(&s.db);
        stream_until_caught_up(&s.wf_path);
        expect_ok(&s.wf_path, "apply");
    }
    common::assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
}

#[test]
fn one_table_spelt_twice_or_nested_is_refused_before_anything_is_written() {
    let mut s = Scenario::new(5, "");
    let abs = s.path().join("lake").join("x");
    for (bronze, facts, needle) in [
        ("lake/x".to_string(), "lake/x/".to_string(), "same table"),
        ("lake/x".to_string(), format!("file://{}", abs.display()), "same table"),
        ("lake/x".to_string(), "lake/y/../x".to_string(), "same table"),
        ("lake/x".to_string(), "lake/x/facts".to_string(), "inside"),
    ] {
        let wf = workflow(s.path(), "bad.toml", "items", "items", &bronze, &facts, "");
        expect_refused(&wf, "stream", needle);
        assert!(!s.path().join("lake").exists(), "{bronze} / {facts}: nothing may be created");
    }
    // Silver inside bronze's folder.
    let wf = workflow(s.path(), "bad.toml", "items", "items", "lake/b", "lake/f", "silver = \"lake/b/silver\"");
    expect_refused(&wf, "apply", "inside");
    expect_refused(&wf, "stream", "inside");
    assert!(!s.path().join("lake").exists());
    // The same place, spelt as three tables: a good stream, through changes.
    let wf = workflow(s.path(), "good.toml", "items", "items", "lake/x", "lake/facts", "silver = \"lake/silver\"");
    expect_ok(&wf, "stream");
    s.changes(8);
    s.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
    common::settle(&s.db);
    stream_until_caught_up(&wf);
    expect_ok(&wf, "apply");
    common::assert_targets_match_source_blocking(&s.db, &s.table, &wf);
}

fn others_spec(name: &TableName) -> TableSpec {
    TableSpec { collations: Default::default(),
        name: name.clone(),
        columns: vec![ColumnDesc::new("code", SqlType::NVarChar { len: Some(10) }, false), ColumnDesc::new("v", SqlType::Int, true)],
        primary_key: vec!["code".into()],
        unique_index: vec![],
    }
}

#[test]
fn a_bronze_or_an_app_id_of_another_stream_is_refused_before_anything_is_written() {
    let mut s = Scenario::new(20, "[snapshot]\nbootstrap = true\n");
    let other = TableName::new("dbo", "others");
    s.db.create_table(&others_spec(&other)).unwrap();
    s.db.load_rows(&other, (0..5).map(|i| vec![SqlValue::Str(format!("c{i}")), SqlValue::Int(i)])).unwrap();
    s.db.enable_cdc(&other, None, None).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    expect_ok(&s.wf_path, "stream");
    let before = listing(s.path());

    // Another table's workflow pointed at items' bronze (its own app id and facts).
    let wf = workflow(s.path(), "others.toml", "others", "others", "bronze", "facts_others", "");
    expect_refused(&wf, "stream", "dbo.items");
    // The same app id for another table on the shared facts table.
    let wf = workflow(s.path(), "others2.toml", "items", "others", "bronze_others", "facts", "");
    expect_refused(&wf, "stream", "app id of its own");
    // The same app id and table into another bronze table.
    let wf = workflow(s.path(), "items2.toml", "items", "items", "bronze_items2", "facts", "");
    expect_refused(&wf, "stream", "app id of its own");
    let after: Vec<_> = listing(s.path())
        .into_iter()
        .filter(|(p, _)| !p.contains("facts_others") && !p.contains("bronze_others") && !p.contains("bronze_items2"))
        .collect();
    assert_eq!(after, before, "the first stream's tables are unchanged");
    for t in ["facts_others", "bronze_others", "bronze_items2"] {
        let p = s.path().join(t);
        assert!(!p.join("_delta_log").exists(), "{t} must not be created");
    }

    // Its own app id and tables: fine, and its bronze records its table.
    let wf = workflow(s.path(), "others3.toml", "others", "others", "bronze_others", "facts", "");
    let j = expect_ok(&wf, "stream");
    assert_eq!(j["caught_up"], true, "{j}");
    expect_ok(&s.wf_path, "stream");
    // Both good streams through changes, on the shared facts table: each
    // one's bronze is its own table's change log, each one's batches tile.
    s.changes(8);
    s.db.transaction(|tx| {
        tx.update(&other, &vec![SqlValue::Str("c1".into())], vec![SqlValue::Str("c1".into()), SqlValue::Int(10)])?;
        tx.delete(&other, &vec![SqlValue::Str("c2".into())])?;
        tx.insert(&other, vec![SqlValue::Str("c9".into()), SqlValue::Int(9)])
    })
    .unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
    common::settle(&s.db);
    stream_until_caught_up(&s.wf_path);
    stream_until_caught_up(&wf);
    common::assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
    common::assert_targets_match_source_blocking(&s.db, &other, &wf);
}

#[test]
fn status_writes_nothing_on_a_new_stream_and_reads_a_started_one() {
    let mut s = Scenario::new(10, "[snapshot]\nbootstrap = true\n");
    let before = listing(s.path());
    let j = expect_ok(&s.wf_path, "status");
    assert_eq!(j["step"], "status");
    assert_eq!(j["position"], serde_json::Value::Null, "{j}");
    assert_eq!(j["generation"], 0);
    // The state machine's view: not started, and the stream's bootstrap opens a snapshot.
    assert_eq!(j["machine"]["state"], "not_started", "{j}");
    assert_eq!(j["machine"]["next"]["stream"]["transition"], "open", "{j}");
    assert_eq!(listing(s.path()), before, "status must create nothing");
    assert!(!s.path().join("bronze").exists() && !s.path().join("facts").exists());
    expect_ok(&s.wf_path, "stream");
    let j = expect_ok(&s.wf_path, "status");
    assert!(j["position"].is_string(), "{j}");
    assert!(j["snapshot"].is_string(), "{j}");
    assert_eq!(j["machine"]["state"], "streaming", "{j}");
    assert_eq!(j["machine"]["next"]["backfill"]["transition"], "idle", "{j}");
    // The stream status read goes on through changes, status between its calls.
    s.changes(8);
    s.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
    common::settle(&s.db);
    expect_ok(&s.wf_path, "status");
    stream_until_caught_up(&s.wf_path);
    expect_ok(&s.wf_path, "status");
    common::assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
}

#[test]
fn silver_refuses_a_key_that_delta_would_round_before_writing_silver() {
    let s = Scenario::new(1, "");
    let name = TableName::new("dbo", "ticks");
    s.db.create_table(&TableSpec { collations: Default::default(),
        name: name.clone(),
        columns: vec![ColumnDesc::new("at", SqlType::DateTime2 { scale: 7 }, false), ColumnDesc::new("v", SqlType::Int, true)],
        primary_key: vec!["at".into()],
        unique_index: vec![],
    })
    .unwrap();
    let t0 = Utc.with_ymd_and_hms(2026, 3, 1, 0, 0, 0).unwrap().naive_utc();
    // Two keys 100 ns apart: distinct in SQL Server, one microsecond in Delta.
    let rows = vec![
        vec![SqlValue::DateTime(t0), SqlValue::Int(1)],
        vec![SqlValue::DateTime(t0 + chrono::Duration::nanoseconds(100)), SqlValue::Int(2)],
    ];
    s.db.load_rows(&name, rows.into_iter()).unwrap();
    s.db.enable_cdc(&name, None, None).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    let wf = workflow(s.path(), "ticks.toml", "ticks", "ticks", "bronze_ticks", "facts_ticks", "silver = \"silver_ticks\"");
    expect_ok(&wf, "stream");
    let msg = expect_refused(&wf, "apply", "100 ns");
    assert!(msg.contains("@index_name") && msg.contains("table.capture_instance"), "the message names the fix: {msg}");
    expect_refused(&wf, "reconcile", "100 ns");
    assert!(!s.path().join("silver_ticks").join("_delta_log").exists(), "silver must not be created");
    assert!(!s.path().join("silver_ticks_control").join("_delta_log").exists());
    // Bronze still holds both keys as two rows. Its `at` column is a Delta
    // timestamp (µs; src/types.rs, no exact column beside it), so both rows
    // hold the key truncated to the µs: the 100 ns that tell them apart are
    // not in bronze, which is why apply refuses the key. The rows stay apart
    // by their other columns and their count.
    let ty = SqlType::DateTime2 { scale: 7 };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let snapshot_rows = rt.block_on(async {
        let bronze = mssql_cdc::delta::open_existing(&s.path().join("bronze_ticks").to_string_lossy(), &Default::default())
            .await
            .unwrap()
            .expect("bronze exists");
        let mut rows = Vec::new();
        for b in mssql_cdc::delta::query(&bronze, "SELECT * FROM t WHERE _operation = 0").await.unwrap() {
            let (at, v) = (b.column_by_name("at").expect("at").clone(), b.column_by_name("v").expect("v").clone());
            for r in 0..b.num_rows() {
                rows.push((value_at(v.as_ref(), r, &SqlType::Int), value_at(at.as_ref(), r, &ty)));
            }
        }
        rows.sort_by_key(|(v, _)| v.as_i64());
        rows
    });
    assert_eq!(
        snapshot_rows,
        vec![
            (SqlValue::Int(1), as_stored(&SqlValue::DateTime(t0), &ty)),
            (SqlValue::Int(2), as_stored(&SqlValue::DateTime(t0 + chrono::Duration::nanoseconds(100)), &ty)),
        ],
        "bronze's snapshot holds both rows, each key as bronze stores it"
    );
    // Changes on both keys and a third 100 ns on: bronze's change rows are
    // the change log's, every column, and the batches tile from S.
    s.db.transaction(|tx| {
        tx.update(&name, &vec![SqlValue::DateTime(t0)], vec![SqlValue::DateTime(t0), SqlValue::Int(10)])?;
        tx.delete(&name, &vec![SqlValue::DateTime(t0 + chrono::Duration::nanoseconds(100))])?;
        tx.insert(&name, vec![SqlValue::DateTime(t0 + chrono::Duration::nanoseconds(200)), SqlValue::Int(3)])
    })
    .unwrap();
    s.db.transaction(|tx| tx.insert(&name, vec![SqlValue::DateTime(t0 + chrono::Duration::nanoseconds(100)), SqlValue::Int(4)])).unwrap();
    s.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
    common::settle(&s.db);
    stream_until_caught_up(&wf);
    rt.block_on(async {
        // No silver (apply is refused): bronze and the facts only.
        let ctx = mssql_cdc::engine::Context::open_read_only(mssql_cdc::workflow::Workflow::load(&wf).unwrap()).await.unwrap();
        let (bronze, facts) = (ctx.workflow.target.bronze.clone(), ctx.workflow.target.facts.clone());
        let from = mssql_cdc::torture::bronze_matches_change_log(&s.db, &name, &bronze, &facts, &ctx.instance.columns, ctx.row_filter())
            .await
            .unwrap_or_else(|e| panic!("bronze against the change log: {e}"));
        mssql_cdc::torture::batch_ranges_tile(&facts, &ctx.workflow.app_id, from).await.unwrap_or_else(|e| panic!("the facts' batch ranges: {e}"));
    });
}

#[test]
fn failpoints_are_armed_only_by_the_programs_own_variable_and_say_so() {
    let s = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    let step = |var: &str| {
        Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
            .args(["--workflow", s.wf_path.to_str().unwrap(), "snapshot"])
            .env("MSSQL_CDC_LOG", "warn")
            .env(var, "snapshot.after_open=return")
            .output()
            .unwrap()
    };
    // The fail crate's generic variable is ignored, with a warning.
    let out = step("FAILPOINTS");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ignored"));
    // The program's own variable arms it, loudly; the step fails there.
    let s2 = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    let out = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .args(["--workflow", s2.wf_path.to_str().unwrap(), "snapshot"])
        .env("MSSQL_CDC_LOG", "warn")
        .env("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ARMED"));
}
