//! `mssql-cdc seed` on the command line: every refusal exits with its code and
//! writes nothing; the result is JSON with lsn, commit_ts, rows, already_seeded.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{last_json, Scenario};
use mssql_cdc::source::CdcSource;

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"));
    c.args(args).env("MSSQL_CDC_LOG", "warn");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn seed(s: &Scenario, copy: &Path, as_of: &str, extra: &[&str]) -> (i32, serde_json::Value) {
    let mut args = vec!["--workflow", s.wf_path.to_str().unwrap(), "seed", "--copy", copy.to_str().unwrap(), "--as-of", as_of];
    args.extend_from_slice(extra);
    let out = run(&args, &[]);
    let j = last_json(&out);
    (out.status.code().unwrap(), j)
}

/// Bronze's and facts' table versions (opening creates empty tables the first time).
fn versions(rt: &tokio::runtime::Runtime, s: &Scenario) -> (Option<u64>, Option<u64>) {
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        (ctx.bronze.version(), ctx.facts.version())
    })
}

fn copy_of(rt: &tokio::runtime::Runtime, s: &Scenario, dir: &Path, columns: Option<&[&str]>) -> i64 {
    rt.block_on(async {
        let source = s.db.source().unwrap();
        let ci = source.capture_instances(&s.table).await.unwrap().pop().unwrap();
        let cols: Vec<_> = ci.columns.iter().filter(|c| columns.is_none_or(|keep| keep.contains(&c.name.as_str()))).cloned().collect();
        mssql_cdc::seed_copy::export_parquet(&source, &s.table, &cols, dir, 1000).await.unwrap() as i64
    })
}

fn error_of(code: i32, j: &serde_json::Value, expected: i32, needles: &[&str]) {
    assert_eq!(code, expected, "{j}");
    assert_eq!(j["ok"], false);
    let msg = j["error"].as_str().unwrap();
    for n in needles {
        assert!(msg.contains(n), "error should mention '{n}': {msg}");
    }
}

#[test]
fn refusals_exit_with_their_codes_and_write_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(10, "[snapshot]\nbootstrap = true\n");
    let recorded = s.db.max_lsn().unwrap().unwrap();
    let copy = s.path().join("copy");
    let rows = copy_of(&rt, &s, &copy, None);
    let partial = s.path().join("partial");
    copy_of(&rt, &s, &partial, Some(&["id", "name"]));
    s.changes(3);
    common::settle(&s.db);

    // Bad arguments are found before the workflow's targets are even opened.
    let (code, j) = seed(&s, &copy, "yesterday", &[]);
    error_of(code, &j, 2, &["--as-of", "yesterday"]);
    let (code, j) = seed(&s, &copy, "2026-03-01T12:00:00", &[]);
    error_of(code, &j, 2, &["no offset"]);
    assert!(!s.path().join("bronze").join("_delta_log").exists(), "nothing created");

    let before = versions(&rt, &s);
    let (code, j) = seed(&s, &s.path().join("nowhere"), &recorded.to_hex(), &[]);
    error_of(code, &j, 2, &["nowhere", "does not exist"]);
    let above = recorded.increment().increment().increment().increment().to_u128() + (1u128 << 40);
    let above = mssql_cdc::lsn::Lsn::from_u128(above).to_hex();
    let (code, j) = seed(&s, &copy, &above, &[]);
    error_of(code, &j, 2, &["above the source's max LSN"]);
    let (code, j) = seed(&s, &copy, "2020-01-01T00:00:00Z", &[]);
    error_of(code, &j, 3, &["data loss", "no commit at or before"]);
    assert_eq!(j["kind"], "needs_person");
    let (code, j) = seed(&s, &partial, &recorded.to_hex(), &[]);
    error_of(code, &j, 2, &["qty", "price", "--allow-missing-columns"]);
    assert_eq!(versions(&rt, &s), before, "refusals wrote nothing");

    // With --allow-missing-columns the missing ones are NULL.
    let (code, j) = seed(&s, &partial, &recorded.to_hex(), &["--allow-missing-columns"]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["already_seeded"], false);
    assert_eq!(j["lsn"], recorded.to_hex());
    assert_eq!(j["rows"], rows);
    assert!(j["commit_ts"].is_string(), "{j}");
    assert_eq!(j["columns_null"], serde_json::json!(["qty", "price", "updated"]));
    assert_eq!(rt.block_on(s.count("bronze", "_operation = 0 AND (qty IS NOT NULL OR price IS NOT NULL)")), 0);
    let seeded = versions(&rt, &s);

    // The same seed again: returned, nothing written.
    let (code, j) = seed(&s, &copy, &recorded.to_hex(), &[]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["already_seeded"], true);
    assert_eq!(j["lsn"], recorded.to_hex());
    // Another copy while a snapshot is there: refused, saying how to proceed.
    let newer = s.db.max_lsn().unwrap().unwrap();
    let (code, j) = seed(&s, &copy, &newer.to_hex(), &[]);
    error_of(code, &j, 2, &["already holds a snapshot", "--reseed"]);
    // A reseed older than the snapshot there: refused.
    let older = rt.block_on(s.db.source().unwrap().min_lsn("dbo_items")).unwrap().unwrap();
    assert!(older < recorded);
    let (code, j) = seed(&s, &copy, &older.to_hex(), &["--reseed"]);
    error_of(code, &j, 2, &["never goes back"]);
    assert_eq!(versions(&rt, &s), seeded);
}

#[test]
fn a_purged_point_is_data_loss() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(5, "");
    let recorded = s.db.max_lsn().unwrap().unwrap();
    let copy = s.path().join("copy");
    copy_of(&rt, &s, &copy, None);
    s.changes(3);
    s.db.advance_clock(std::time::Duration::from_secs(4 * 24 * 3600)).unwrap();
    s.changes(3);
    common::settle(&s.db);
    s.db.cleanup(None).unwrap();
    let before = versions(&rt, &s);
    let (code, j) = seed(&s, &copy, &recorded.to_hex(), &[]);
    error_of(code, &j, 3, &["data loss", "newer copy"]);
    assert_eq!(versions(&rt, &s), before);
}

#[test]
fn an_open_snapshot_is_refused_with_how_to_finish_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    let copy = s.path().join("copy");
    copy_of(&rt, &s, &copy, None);
    let wf = s.wf_path.to_str().unwrap();
    let out = run(&["--workflow", wf, "snapshot"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")]);
    assert_eq!(out.status.code(), Some(75), "{}", String::from_utf8_lossy(&out.stdout));
    let before = versions(&rt, &s);
    let recorded = s.db.max_lsn().unwrap().unwrap();
    let (code, j) = seed(&s, &copy, &recorded.to_hex(), &[]);
    error_of(code, &j, 2, &["snapshot", "open", "finish it first"]);
    assert_eq!(versions(&rt, &s), before);
}
