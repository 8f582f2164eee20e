//! The command line's contract: bad input gets a clear error and exit 2
//! before anything is written; the last stdout line is JSON.

mod common;

use std::process::{Command, Output};

use common::{last_json, Scenario};
use mssql_cdc::source::TableName;

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mssql-cdc")).args(args).env("MSSQL_CDC_LOG", "warn").output().unwrap()
}

/// Runs `stream` on the scenario's workflow and expects exit 2 with `needle` in the error.
fn expect_config_error(s: &Scenario, needle: &str) {
    let out = run(&["--workflow", s.wf_path.to_str().unwrap(), "stream"]);
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(2), "{j}");
    assert_eq!(j["ok"], false);
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains(needle), "error should mention '{needle}': {msg}");
    assert!(String::from_utf8_lossy(&out.stderr).contains(needle), "stderr names it too");
}

fn nothing_written(s: &Scenario) {
    for t in ["bronze", "facts"] {
        let p = s.path().join(t);
        let empty = !p.exists() || std::fs::read_dir(&p).unwrap().next().is_none();
        assert!(empty, "{t} was written");
    }
}

#[test]
fn missing_and_malformed_workflow_files() {
    let out = run(&["--workflow", "/nonexistent/wf.toml", "stream"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(last_json(&out)["error"].as_str().unwrap().contains("/nonexistent/wf.toml"));

    let s = Scenario::new(3, "");
    std::fs::write(&s.wf_path, "app_id = \n").unwrap();
    expect_config_error(&s, "items.toml");
    let out = run(&["stream"]);
    assert_eq!(out.status.code(), Some(2), "no --workflow");
}

#[test]
fn unknown_key_in_workflow() {
    let s = Scenario::new(3, "[snapshot]\nbootstrap = true\nparalelism = 4\n");
    expect_config_error(&s, "paralelism");
    nothing_written(&s);
}

#[test]
fn table_that_does_not_exist() {
    let mut s = Scenario::new(3, "");
    let text = std::fs::read_to_string(&s.wf_path).unwrap().replace("name = \"items\"", "name = \"nope\"");
    std::fs::write(&s.wf_path, text).unwrap();
    expect_config_error(&s, "nope");
    nothing_written(&s);
    s.write_workflow("");
}

#[test]
fn table_without_cdc() {
    let s = Scenario::new(3, "");
    let other = TableName::new("dbo", "plain");
    s.db.create_table(&common::items_spec(&other)).unwrap();
    let text = std::fs::read_to_string(&s.wf_path).unwrap().replace("name = \"items\"", "name = \"plain\"");
    std::fs::write(&s.wf_path, text).unwrap();
    expect_config_error(&s, "not enabled");
    nothing_written(&s);
}

#[test]
fn capture_instance_that_does_not_exist() {
    let s = Scenario::new(3, "");
    let text = std::fs::read_to_string(&s.wf_path).unwrap().replace("name = \"items\"", "name = \"items\"\ncapture_instance = \"dbo_other\"");
    std::fs::write(&s.wf_path, text).unwrap();
    expect_config_error(&s, "dbo_other");
    nothing_written(&s);
}

#[test]
fn unreachable_or_malformed_source_url() {
    let s = Scenario::new(3, "");
    let text = std::fs::read_to_string(&s.wf_path).unwrap().replace("sim://source.sqlite", "sim://missing.sqlite");
    std::fs::write(&s.wf_path, text).unwrap();
    expect_config_error(&s, "missing.sqlite");
    let text = std::fs::read_to_string(&s.wf_path).unwrap().replace("sim://missing.sqlite", "ftp://host/db");
    std::fs::write(&s.wf_path, text).unwrap();
    expect_config_error(&s, "ftp://host/db");
    nothing_written(&s);
}

#[test]
fn target_that_holds_other_files() {
    let s = Scenario::new(3, "");
    std::fs::create_dir_all(s.path().join("facts")).unwrap();
    std::fs::write(s.path().join("facts").join("notes.txt"), "not a table").unwrap();
    expect_config_error(&s, "not a Delta table");
    assert!(!s.path().join("bronze").join("_delta_log").exists(), "bronze must not be created when facts is bad");
}

/// The binary runs on jemalloc unless MSSQL_CDC_ALLOCATOR=system, a whole
/// bootstrap and stream on either, and an unknown value is refused with exit 2
/// before anything is written (a typo must not silently pick the default).
#[test]
fn the_allocator_is_jemalloc_or_the_one_asked_for_and_a_typo_is_refused() {
    let s = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    let with = |value: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"));
        c.args(["--workflow", s.wf_path.to_str().unwrap(), "stream"]).env("MSSQL_CDC_LOG", "mssql_cdc=debug,warn").env_remove("MALLOC_ARENA_MAX");
        match value {
            Some(v) => c.env("MSSQL_CDC_ALLOCATOR", v),
            None => c.env_remove("MSSQL_CDC_ALLOCATOR"),
        };
        c.output().unwrap()
    };
    let out = with(Some("glibc"));
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(2), "{j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("MSSQL_CDC_ALLOCATOR") && msg.contains("glibc") && msg.contains("`system`"), "{msg}");
    nothing_written(&s);
    // glibc, left to C code under jemalloc, gets one arena; two when every
    // allocation goes through it (`alloc` has the figures).
    for (value, name, arenas) in [(Some("system"), "system", 2), (None, "jemalloc", 1), (Some("jemalloc"), "jemalloc", 1)] {
        let out = with(value);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{value:?}: {stderr}");
        assert!(stderr.contains(&format!("allocator=\"{name}\"")), "{value:?}: {stderr}");
        assert!(stderr.contains(&format!("c_arena_limit=\"{arenas}\"")), "{value:?}: {stderr}");
        let j = last_json(&out);
        assert_eq!(j["step"], "stream");
        assert_eq!(j["caught_up"], true);
    }
}

#[test]
fn stream_and_status_print_json_and_exit_0() {
    let s = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    let out = run(&["--workflow", s.wf_path.to_str().unwrap(), "stream"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let j = last_json(&out);
    assert_eq!(j["step"], "stream");
    assert_eq!(j["caught_up"], true);
    let out = run(&["--workflow", s.wf_path.to_str().unwrap(), "status"]);
    assert_eq!(out.status.code(), Some(0));
    let j = last_json(&out);
    assert_eq!(j["generation"], 0);
    assert!(j["position"].as_str().unwrap().starts_with("0x"));
    assert!(j["snapshot"].is_string());
}

#[test]
fn purged_range_exits_3_naming_the_gap() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    rt.block_on(s.stream()).unwrap();
    s.changes(5);
    // Four days pass without the stream; cleanup purges past its position.
    s.db.advance_clock(std::time::Duration::from_secs(4 * 24 * 3600)).unwrap();
    s.changes(3);
    common::settle(&s.db);
    s.db.cleanup(None).unwrap();
    let out = run(&["--workflow", s.wf_path.to_str().unwrap(), "stream"]);
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(3), "{j}");
    assert_eq!(j["kind"], "needs_person");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("data loss") && msg.contains("0x"), "{msg}");
}

#[test]
fn resnapshot_mode_recovers_through_the_cli_and_the_guard_exits_3() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(8, "[snapshot]\nbootstrap = true\n[stream]\non_data_loss = \"resnapshot\"\n");
    let wf = s.wf_path.to_str().unwrap().to_string();
    // A bad override and a bad option are refused before anything is written.
    let out = run(&["--workflow", &wf, "stream", "--resnapshot-interval-days", "-1"]);
    assert_eq!(out.status.code(), Some(2), "{}", last_json(&out));
    nothing_written(&s);
    s.write_workflow("[snapshot]\nbootstrap = true\n[stream]\non_data_loss = \"later\"\n");
    expect_config_error(&s, "on_data_loss");
    nothing_written(&s);
    s.write_workflow("[snapshot]\nbootstrap = true\n[stream]\non_data_loss = \"resnapshot\"\n");
    rt.block_on(s.stream()).unwrap();
    for round in 0..2 {
        s.changes(5);
        s.db.advance_clock(std::time::Duration::from_secs(4 * 24 * 3600)).unwrap();
        s.changes(3);
        common::settle(&s.db);
        s.db.cleanup(None).unwrap();
        let out = run(&["--workflow", &wf, "stream"]);
        let j = last_json(&out);
        if round == 0 {
            assert_eq!(out.status.code(), Some(0), "{j}");
            assert_eq!(j["recovery"]["generation"], 1, "{j}");
            assert_eq!(j["generation"], 1);
        } else {
            // Four days after the first recovery: within the 7-day interval.
            assert_eq!(out.status.code(), Some(3), "{j}");
            assert!(j["error"].as_str().unwrap().contains("--resnapshot-interval-days 0"), "{j}");
            let out = run(&["--workflow", &wf, "stream", "--resnapshot-interval-days", "0"]);
            let j = last_json(&out);
            assert_eq!(out.status.code(), Some(0), "{j}");
            assert_eq!(j["recovery"]["generation"], 2, "{j}");
        }
    }
}

#[test]
fn backfill_through_the_cli_until_done_and_its_bad_flags() {
    let s = Scenario::new(40, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\n");
    let wf = s.wf_path.to_str().unwrap();
    for (flag, value) in [("--chunk-rows", "0"), ("--max-waves", "0"), ("--max-seconds", "-1"), ("--isolation", "nolock")] {
        let out = run(&["--workflow", wf, "backfill", flag, value]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {}", last_json(&out));
        nothing_written(&s);
    }
    // SNAPSHOT isolation where the database does not allow it: refused, exit 2.
    let out = run(&["--workflow", wf, "backfill", "--isolation", "snapshot"]);
    assert_eq!(out.status.code(), Some(2), "{}", last_json(&out));
    assert!(last_json(&out)["error"].as_str().unwrap().to_lowercase().contains("snapshot"));
    let mut calls = 0;
    loop {
        let out = run(&["--workflow", wf, "backfill", "--max-waves", "1"]);
        let j = last_json(&out);
        assert_eq!(out.status.code(), Some(0), "{j}");
        for k in ["snapshot", "chunks_done", "chunks_total", "done", "paused", "reason"] {
            assert!(j.get(k).is_some(), "{k} missing from {j}");
        }
        calls += 1;
        if j["done"] == true {
            assert_eq!(j["chunks_done"], j["chunks_total"]);
            break;
        }
        assert!(calls < 20);
    }
    assert!(calls >= 2, "one wave a call: several calls");
    // Headroom pause: exit 75, paused in the JSON.
    let s2 = Scenario::new(20, "[snapshot]\nbootstrap = true\nmode = \"chunked\"\n");
    let out = run(&["--workflow", s2.wf_path.to_str().unwrap(), "backfill", "--min-headroom-hours", "1000"]);
    assert_eq!(out.status.code(), Some(75), "{}", last_json(&out));
    assert_eq!(last_json(&out)["paused"], true);
}

#[test]
fn a_refusal_names_the_workflow_file_in_the_command_it_advises() {
    // A full bootstrap killed after its open row holds the mode; a chunked
    // backfill is then refused, advising the `snapshot` call that finishes
    // the open: with this workflow's own path, not a placeholder.
    let mut s = Scenario::new(5, "[snapshot]\nbootstrap = true\n");
    let wf = s.wf_path.to_str().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .args(["--workflow", &wf, "snapshot"])
        .env("MSSQL_CDC_LOG", "warn")
        .env("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", String::from_utf8_lossy(&out.stdout));
    s.write_workflow("[snapshot]\nbootstrap = true\nmode = \"chunked\"\n");
    let out = run(&["--workflow", &wf, "backfill"]);
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(2), "{j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains(&format!("mssql-cdc --workflow {wf} snapshot")), "the advice names this workflow file: {msg}");
    assert!(!msg.contains("--workflow FILE"), "{msg}");
}

/// `machine` prints the state machine's diagram from the code's own table,
/// in either format, and ends with the JSON line; it needs no workflow.
#[test]
fn machine_prints_the_diagram_of_the_codes_transition_table() {
    let out = run(&["machine", "--format", "mermaid"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.starts_with("stateDiagram-v2\n    [*] --> NotStarted\n"), "{text}");
    let j = last_json(&out);
    assert_eq!(j["step"], "machine");
    let edges = j["edges"].as_u64().unwrap() as usize;
    assert_eq!(text.lines().filter(|l| l.contains(" --> ") && !l.contains("[*]")).count(), edges, "one line per edge");
    for t in ["open", "plan", "wave", "complete", "commit", "recover", "resnapshot", "repair", "start", "idle"] {
        assert!(text.contains(&format!(": {t}\n")), "the diagram has a '{t}' edge: {text}");
    }
    let dot = run(&["machine", "--format", "dot"]);
    let text = String::from_utf8_lossy(&dot.stdout).into_owned();
    assert!(text.starts_with("digraph machine {") && text.contains("ChunkedOpened -> ChunkedPlanned [label=\"plan\"];"), "{text}");
    assert_eq!(last_json(&dot)["edges"].as_u64().unwrap() as usize, edges);
}
