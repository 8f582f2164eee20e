//! The orchestrator example `workflows/snapshot_by_transition.sh`, run with
//! bash against the test binary as a scheduled task would run it: one wave
//! per run, a writer going on between runs, it drives a chunked snapshot by
//! named transitions (open, plan, waves, complete) with the stream's commits
//! between them, until both lanes are idle, and leaves the targets equal to
//! the simulator's rows and change log. The run that reads the last chunks
//! has its wave's call cut after the facts commit (exit 75, as in
//! tests/machine.rs), so the script retries, finds every chunk read and runs
//! `complete` by name. A workflow file that does not exist stops the script
//! with exit 2 and a message.

mod common;

use std::path::Path;
use std::process::Command;

use common::{ok, Scenario};

const CHUNKED: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 7\ntarget_wave_seconds = 0\n\
                       [stream]\nmax_batch_rows = 1000\n";

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/workflows/snapshot_by_transition.sh");

/// How the script starts each line it writes on stderr.
const PREFIX: &str = "snapshot_by_transition: ";

/// Runs the script with bash in `dir` on `wf` and the test binary, with
/// `env` set: (exit code, stderr). No bash fails the test.
fn run_script(dir: &Path, wf: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let mut c = Command::new("bash");
    c.arg(SCRIPT)
        .arg(wf)
        .arg(env!("CARGO_BIN_EXE_mssql-cdc"))
        .current_dir(dir)
        .env("MSSQL_CDC_LOG", "warn")
        .env("SNAPSHOT_RETRY_SECONDS", "0")
        .env_remove("MSSQL_CDC_FAILPOINTS");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c
        .output()
        .unwrap_or_else(|e| panic!("cannot run `bash {SCRIPT}` ({e}): this test needs bash on PATH, as CI has; it skips nothing"));
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The transitions the script's stderr says ran, in order: its lines
/// `step NAME (LANE lane): BEFORE -> AFTER` (a call that exited non-zero is
/// logged as `step NAME: exit CODE …` and not counted).
fn transitions_run(stderr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in stderr.lines() {
        let Some(rest) = line.strip_prefix(PREFIX).and_then(|r| r.strip_prefix("step ")) else { continue };
        if let Some((name, tail)) = rest.split_once(" (") {
            if tail.contains(" lane): ") && tail.contains(" -> ") {
                out.push(name.to_string());
            }
        }
    }
    out
}

#[test]
fn the_script_drives_a_chunked_snapshot_by_transition_across_runs() {
    let mut s = Scenario::new(40, CHUNKED);
    let mut ran: Vec<String> = Vec::new();
    let mut logs = String::new();
    for run in 0..12 {
        if run > 0 {
            s.changes(3);
            common::settle(&s.db);
        }
        // One wave per run: the run after the last wave finds every chunk
        // read and runs `complete` (a wave never records the completion).
        let mut env = vec![("SNAPSHOT_MAX_WAVES", "1")];
        // Every other run reads the JSON with the python3 fallback.
        if run % 2 == 1 {
            env.push(("SNAPSHOT_JSON_TOOL", "python3"));
        }
        let (code, stderr) = run_script(s.path(), &s.wf_path, &env);
        logs.push_str(&format!("--- run {run}\n{stderr}"));
        assert_eq!(code, 0, "run {run} of the script:\n{logs}");
        ran.extend(transitions_run(&stderr));
        let j = ok(&s, &["status"]);
        if j["machine"]["state"] == "streaming" && j["machine"]["next"]["backfill"]["transition"] == "idle" {
            break;
        }
        assert!(run < 11, "the snapshot was not complete after 12 runs; status: {j}\n{logs}");
    }
    for want in ["open", "plan", "complete", "commit"] {
        assert!(ran.iter().any(|t| t == want), "the script never ran '{want}': {ran:?}\n{logs}");
    }
    let waves = ran.iter().filter(|t| *t == "wave").count();
    assert!(waves >= 2, "the script ran {waves} waves: {ran:?}\n{logs}");
    let first = |t: &str| ran.iter().position(|x| x == t).unwrap();
    assert!(first("open") < first("plan") && first("plan") < first("wave") && first("wave") < first("complete"), "{ran:?}");

    let j = ok(&s, &["status"]);
    assert_eq!(j["machine"]["state"], "streaming", "{j}");
    assert_eq!(j["machine"]["next"]["stream"]["transition"], "idle", "{j}");
    assert_eq!(j["machine"]["next"]["backfill"]["transition"], "idle", "{j}");
    // Bronze holds the change log from S once and the facts tile it; silver
    // (applied now, as a task after the script would) equals the table.
    ok(&s, &["apply"]);
    common::assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
}

#[test]
fn a_workflow_file_that_does_not_exist_stops_the_script_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let (code, stderr) = run_script(dir.path(), &missing, &[]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains(&format!("{PREFIX}status: exit 2, stopping:")) && stderr.contains("cannot read workflow file"), "{stderr}");
}
