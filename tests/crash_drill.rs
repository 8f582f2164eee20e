//! The crash drill: a crash at every commit boundary, then a rerun, must
//! leave bronze equal to the source, no change row twice, one facts row per batch.

mod common;

use common::Scenario;
use mssql_cdc::engine::FAILPOINTS;

const WF: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 7\n";
const WF_NO_BOOTSTRAP: &str = "[stream]\nmax_batch_rows = 7\nstart = \"earliest\"\n";

/// Runs a scenario with `failpoint` firing once, then reruns to the end.
async fn drill(failpoint: &str, workflow: &str) {
    // Failpoints are process-wide: the scenario lock is held for the whole
    // drill, its reruns included, so a failpoint the other test arms cannot
    // fire in this one's calls (nor this one's in the other's).
    let _guard = fail::FailScenario::setup();
    // Without a bootstrap bronze only holds changes, so the table starts empty.
    let initial_rows = if workflow.contains("bootstrap") { 40 } else { 0 };
    let mut s = Scenario::new(initial_rows, workflow);
    // Failpoints of a stream's first call fire on it; the others need a
    // bootstrapped stream with changes to read.
    let first_call = failpoint.starts_with("snapshot.") || failpoint == "stream.after_start";
    if !first_call {
        s.stream().await.unwrap();
    }
    s.changes(10);
    let fired = {
        fail::cfg(failpoint, "1*return").unwrap();
        let mut fired = false;
        for _ in 0..5 {
            match s.stream().await {
                Err(e) if e.to_string().contains(failpoint) => {
                    fired = true;
                    break;
                }
                Err(e) => panic!("{failpoint}: unexpected error {e}"),
                Ok(r) if r.caught_up => break,
                Ok(_) => {}
            }
        }
        fail::remove(failpoint);
        fired
    };
    // More changes after the crash, then rerun until caught up.
    s.changes(10);
    s.stream_until_caught_up().await;
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{failpoint}: {cmp:?}");
    assert_eq!(s.duplicate_change_rows().await, 0, "{failpoint}: a change row twice in bronze");
    assert_eq!(s.duplicate_batch_rows().await, 0, "{failpoint}: a batch with two facts rows");
    assert!(s.count("facts", "event = 'bootstrap' OR event = 'stream_start'").await <= 1, "{failpoint}: two start events");
    assert!(fired, "{failpoint} never fired: the drill did not test it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failpoint_in_process() {
    // The chunked snapshot's failpoints have their own drill (tests/chunked.rs),
    // and so have silver's and reconcile's (tests/silver.rs) and the
    // recovery's (tests/recovery.rs, a crash at every step of it), and the
    // open after a capture-instance switch's (tests/snapshot_on_switch.rs).
    // The two that only a repair passes have theirs below.
    for fp in FAILPOINTS.iter().filter(|f| {
        !f.starts_with("chunked.")
            && !f.starts_with("apply.")
            && !f.starts_with("reconcile.")
            && !f.starts_with("recover.")
            && !f.starts_with("switch.")
            && !f.starts_with("maintain.")
            && !REPAIR_FAILPOINTS.contains(f)
    }) {
        let wf = if *fp == "stream.after_start" { WF_NO_BOOTSTRAP } else { WF };
        drill(fp, wf).await;
    }
}

/// The commit boundaries only a repair passes: the facts row of a batch
/// bronze holds without one, and the completion row of a full snapshot bronze
/// holds without one.
const REPAIR_FAILPOINTS: &[&str] = &["repair.after_facts", "snapshot.after_repaired_completion"];

/// A crash between a step's two commits, then a crash right after the rerun's
/// repair wrote the missing row: the third call finds nothing to repair and
/// goes on, and bronze ends equal to the source with no change row or batch
/// row twice and one bootstrap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_repair_reruns_to_the_same_result() {
    for (first, second) in [("stream.after_bronze", "repair.after_facts"), ("snapshot.after_bronze", "snapshot.after_repaired_completion")] {
        assert!(FAILPOINTS.contains(&first) && FAILPOINTS.contains(&second) && REPAIR_FAILPOINTS.contains(&second));
        // Held for the whole round, as in `drill`.
        let _guard = fail::FailScenario::setup();
        let mut s = Scenario::new(40, WF);
        if first.starts_with("stream.") {
            s.stream().await.unwrap();
            s.changes(10);
            common::settle(&s.db);
        }
        for fp in [first, second] {
            fail::cfg(fp, "1*return").unwrap();
            let e = s.stream().await.expect_err(&format!("{fp} should have cut the call"));
            assert!(e.to_string().contains(fp), "{first} then {second}: the call stopped elsewhere: {e}");
            fail::remove(fp);
        }
        s.changes(10);
        s.stream_until_caught_up().await;
        let cmp = s.verify().await;
        assert_eq!(cmp.differences(), 0, "{first} then {second}: {cmp:?}");
        assert_eq!(s.duplicate_change_rows().await, 0, "{first} then {second}: a change row twice in bronze");
        assert_eq!(s.duplicate_batch_rows().await, 0, "{first} then {second}: a batch with two facts rows");
        assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1, "{first} then {second}");
        common::assert_targets_match_source(&s.db, &s.table, &s.wf_path).await;
    }
}

/// The same crash, but the process is killed at the failpoint (abort, no unwinding, no cleanup).
#[test]
fn killed_process_reruns_to_the_same_result() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(30, WF);
    let bin = env!("CARGO_BIN_EXE_mssql-cdc");
    let wf_path = s.wf_path.clone();
    let run = |fp: Option<&str>| {
        let mut c = std::process::Command::new(bin);
        c.arg("--workflow").arg(&wf_path).arg("stream").env("MSSQL_CDC_LOG", "warn");
        if let Some(fp) = fp {
            c.env("MSSQL_CDC_FAILPOINTS", format!("{fp}=return(abort)"));
        }
        c.output().unwrap()
    };
    let out = run(Some("snapshot.after_bronze"));
    assert!(!out.status.success(), "the process should have been killed");
    let out = run(None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    s.changes(12);
    common::settle(&s.db);
    let out = run(Some("stream.after_bronze"));
    assert!(!out.status.success());
    let out = run(None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let last: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(last["caught_up"], true, "{last}");
    rt.block_on(async {
        assert_eq!(s.verify().await.differences(), 0);
        assert_eq!(s.duplicate_change_rows().await, 0);
        assert_eq!(s.duplicate_batch_rows().await, 0);
        assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1);
        assert_eq!(s.count("facts", "event = 'snapshot_open'").await, 1, "the killed attempt wrote the open row; the rerun found its snapshot in bronze");
    });
}
