//! `maintain` (issue 14, history): it compacts the append-only tables'
//! small files, vacuums and checkpoints, and changes no row: every table
//! holds the same multiset of rows, every column, before and after; the
//! workflow goes on and ends equal to the simulator's table and change log
//! (`common::assert_targets_match_source`, which reads the simulator, not the
//! engine); two compactions at once land once; a crash between its commits
//! is repaired by calling it again; a retention under a week is refused
//! before anything is written.

mod common;

use std::collections::BTreeMap;

use common::{ok, settle, step, Scenario};
use deltalake::arrow::util::display::{ArrayFormatter, FormatOptions};
use mssql_cdc::delta;
use mssql_cdc::engine::maintain::{self, MaintainArgs};

const WF: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nchunk_rows = 10\nparallelism = 1\ntarget_wave_seconds = 0\n\
                  [stream]\nmax_batch_rows = 4\n[reconcile]\nsample_fraction = 1.0\ncapture_wait_seconds = 0\n";

/// Every row of a Delta table, all columns by name, as a multiset of texts.
async fn rows_of(location: &str) -> BTreeMap<String, usize> {
    let t = delta::open_existing(location, &Default::default()).await.unwrap().expect("the table exists");
    let mut out = BTreeMap::new();
    let options = FormatOptions::default().with_null("∅");
    for b in delta::query(&t, "SELECT * FROM t").await.unwrap() {
        let schema = b.schema();
        let mut names: Vec<(usize, String)> = schema.fields().iter().enumerate().map(|(i, f)| (i, f.name().clone())).collect();
        names.sort_by(|a, b| a.1.cmp(&b.1));
        let formatters: Vec<(String, ArrayFormatter)> =
            names.iter().map(|(i, n)| (n.clone(), ArrayFormatter::try_new(b.column(*i).as_ref(), &options).unwrap())).collect();
        for r in 0..b.num_rows() {
            let text: Vec<String> = formatters.iter().map(|(n, f)| format!("{n}={}", f.value(r))).collect();
            *out.entry(text.join("|")).or_default() += 1;
        }
    }
    out
}

/// Every table of the workflow that exists: (name, location, rows).
async fn all_rows(s: &Scenario) -> TableRows {
    let mut out = Vec::new();
    for (name, location, _) in maintain::tables_of(&s.workflow()) {
        if delta::open_existing(&location, &Default::default()).await.unwrap().is_some() {
            let rows = rows_of(&location).await;
            out.push((name, location, rows));
        }
    }
    out
}

type TableRows = Vec<(&'static str, String, BTreeMap<String, usize>)>;

/// Every table holds the same multiset of rows, every column, in `after`
/// as in `before`, and the same tables exist.
fn assert_same_rows(before: &TableRows, after: &TableRows, what: &str) {
    let names = |t: &TableRows| t.iter().map(|(n, _, _)| *n).collect::<Vec<_>>();
    assert_eq!(names(before), names(after), "the tables that exist changed {what}");
    for ((name, _, a), (_, _, b)) in before.iter().zip(after) {
        assert_eq!(a, b, "{name}'s rows changed {what}");
    }
}

fn location(s: &Scenario, name: &str) -> String {
    maintain::tables_of(&s.workflow()).into_iter().find(|(n, _, _)| *n == name).unwrap().1
}

async fn data_files(location: &str) -> usize {
    let t = delta::open_existing(location, &Default::default()).await.unwrap().unwrap();
    delta::maintain::file_count(&t).unwrap().0
}

async fn compactions(location: &str) -> Option<i64> {
    let t = delta::open_existing(location, &Default::default()).await.unwrap().unwrap();
    delta::txn_version(&t, delta::maintain::COMPACTION_APP_ID).await.unwrap()
}

fn table_json<'a>(j: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    j["tables"].as_array().unwrap().iter().find(|t| t["table"] == name).unwrap_or_else(|| panic!("no {name} in {j:#}"))
}

/// Rounds of changes, each streamed, one wave read, applied and reconciled,
/// through the binary: every table gains a small file per call.
fn history(s: &mut Scenario, rounds: usize) {
    for _ in 0..rounds {
        s.changes(6);
        settle(&s.db);
        common::cli_stream_until_caught_up(s);
        let _ = ok(s, &["backfill", "--max-waves", "1"]);
        ok(s, &["apply"]);
        let (code, j) = step(s, &["reconcile"], &[]);
        assert!(code == 0 || code == 3, "reconcile exited {code}: {j}");
    }
}

/// The rest of the workflow after `maintain`: the snapshot completes, the
/// stream and apply catch up, reconcile is clean, and silver, bronze and
/// the facts equal the simulator's table and change log.
fn finish(s: &mut Scenario) {
    s.changes(10);
    settle(&s.db);
    common::cli_backfill_until_done(s);
    common::cli_stream_until_caught_up(s);
    ok(s, &["apply"]);
    let j = ok(s, &["reconcile"]);
    assert_eq!(j["clean"], true, "{j:#}");
    common::assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
}

#[test]
fn maintain_compacts_the_append_only_tables_and_changes_no_row() {
    let mut s = Scenario::new(60, WF);
    history(&mut s, 4);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let before = rt.block_on(all_rows(&s));
    assert_eq!(before.len(), 6, "every table exists: {:?}", before.iter().map(|t| t.0).collect::<Vec<_>>());
    let facts_files = rt.block_on(data_files(&location(&s, "facts")));
    assert!(facts_files >= 8, "the history left {facts_files} facts files");

    let j = ok(&s, &["maintain"]);
    for name in ["facts", "plans", "control", "reconcile"] {
        let t = table_json(&j, name);
        assert!(t["compaction"]["files_compacted"].as_u64().unwrap() >= 2, "{name}: {t:#}");
        assert_eq!(t["files_after"], 1, "{name}: {t:#}");
        assert_eq!(rt.block_on(compactions(&location(&s, name))), Some(1), "{name}");
    }
    for name in ["bronze", "silver"] {
        let t = table_json(&j, name);
        assert!(t["compaction"].is_null(), "{name} is never compacted: {t:#}");
        assert_eq!(rt.block_on(compactions(&location(&s, name))), None, "{name}");
    }
    // Every table holds the same rows, every column, as before.
    let after = rt.block_on(all_rows(&s));
    assert_same_rows(&before, &after, "in maintain");
    // Each table has a checkpoint at its newest version.
    for (name, location, _) in &after {
        let log = std::path::Path::new(location).join("_delta_log");
        let log = if log.is_absolute() { log } else { s.path().join(log) };
        let found = std::fs::read_dir(&log).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".checkpoint.parquet"));
        assert!(found, "{name} has no checkpoint in {}", log.display());
    }
    // A second call has nothing to compact.
    let again = ok(&s, &["maintain"]);
    assert_eq!(table_json(&again, "facts")["compaction"]["files_compacted"], 0, "{again:#}");
    assert_eq!(rt.block_on(compactions(&location(&s, "facts"))), Some(1));
    drop(rt);
    finish(&mut s);
}

/// Two compactions planned on the same version, both held before their
/// commits: the txn they share lets one land; the other plans again and
/// finds nothing to do. Without it both would land (delta-rs does not refuse
/// a winner's layout-only removes) and every facts row would be held twice.
#[test]
fn two_maintains_at_once_compact_once() {
    let mut s = Scenario::new(40, WF);
    history(&mut s, 3);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let before = rt.block_on(all_rows(&s));
    let held = [("MSSQL_CDC_FAILPOINTS", "maintain.before_compact_commit=sleep(1500)")];
    let spawn = || common::cli_command(&s.wf_path, &["maintain", "--no-vacuum"], &held).current_dir(s.path()).spawn().unwrap();
    let (a, b) = (spawn(), spawn());
    for c in [a, b] {
        let out = c.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let after = rt.block_on(all_rows(&s));
    assert_same_rows(&before, &after, "when two maintains ran at once");
    for (name, location, _) in &after {
        if ["facts", "plans", "control", "reconcile"].contains(name) {
            assert_eq!(rt.block_on(compactions(location)), Some(1), "{name}: exactly one compaction lands");
        }
    }
    drop(rt);
    finish(&mut s);
}

/// `maintain` in a loop beside the steps: no step is refused for it, and
/// nothing is lost or held twice.
#[test]
fn maintain_beside_the_steps_loses_nothing() {
    let mut s = Scenario::new(40, WF);
    history(&mut s, 1);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (wf, dir, flag) = (s.wf_path.clone(), s.path().to_path_buf(), stop.clone());
    let looping = std::thread::spawn(move || {
        let mut calls = 0;
        while !flag.load(std::sync::atomic::Ordering::SeqCst) {
            let out = common::cli_command(&wf, &["maintain"], &[]).current_dir(&dir).output().unwrap();
            assert_eq!(out.status.code(), Some(0), "maintain beside the steps: {}", String::from_utf8_lossy(&out.stderr));
            calls += 1;
        }
        calls
    });
    history(&mut s, 4);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let calls = looping.join().unwrap();
    assert!(calls >= 2, "maintain ran {calls} times beside the steps");
    finish(&mut s);
}

/// A crash after the compaction's commit, and one after VACUUM's: the rerun
/// finishes the upkeep and the rows are unchanged.
#[test]
fn a_crash_in_maintain_is_repaired_by_the_next_call() {
    let mut s = Scenario::new(40, WF);
    history(&mut s, 3);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for fp in ["maintain.after_compact", "maintain.after_vacuum"] {
        let before = rt.block_on(all_rows(&s));
        let env = [("MSSQL_CDC_FAILPOINTS", format!("{fp}=return"))];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (code, j) = step(&s, &["maintain"], &env);
        assert_eq!(code, mssql_cdc::error::EXIT_TEMPORARY, "{fp}: {j}");
        let j = ok(&s, &["maintain"]);
        assert_eq!(table_json(&j, "facts")["files_after"], 1, "{j:#}");
        let after = rt.block_on(all_rows(&s));
        assert_same_rows(&before, &after, &format!("across a crash at {fp}"));
        history(&mut s, 1);
    }
    drop(rt);
    finish(&mut s);
}

/// VACUUM deletes a compaction's old files only once they are older than
/// the retention, and the tables read the same afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vacuum_deletes_the_compacted_files_after_the_retention() {
    let mut s = Scenario::new(40, WF);
    tokio::task::block_in_place(|| history(&mut s, 3));
    let facts = location(&s, "facts");
    let on_disk = |loc: &str| -> usize {
        let p = std::path::Path::new(loc);
        let p = if p.is_absolute() { p.to_path_buf() } else { s.path().join(p) };
        std::fs::read_dir(p).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".parquet")).count()
    };
    let files = on_disk(&facts);
    let before = all_rows(&s).await;
    let args = MaintainArgs::new(maintain::DEFAULT_VACUUM_RETENTION_HOURS, false).unwrap();
    let j = maintain::run(&s.workflow(), &args).await.unwrap();
    let compacted = table_json(&j, "facts")["compaction"]["files_compacted"].as_u64().unwrap() as usize;
    assert!(compacted >= 2, "{j:#}");
    assert_eq!(table_json(&j, "facts")["vacuum"]["files_deleted"], 0, "a removed file younger than the retention stays: {j:#}");
    assert_eq!(on_disk(&facts), files + 1, "the compacted file is added, none deleted");
    // Six days on: past the five-day retention, inside the week the
    // checkpoints keep the removes (the one maintain wrote holds them).
    let days_later = chrono::Utc::now().timestamp_millis() + 6 * 24 * 3_600_000;
    let j = maintain::run(&s.workflow(), &MaintainArgs { now_ms: Some(days_later), ..args }).await.unwrap();
    assert_eq!(table_json(&j, "facts")["vacuum"]["files_deleted"], compacted as u64, "{j:#}");
    assert_eq!(on_disk(&facts), files + 1 - compacted);
    let after = all_rows(&s).await;
    assert_same_rows(&before, &after, "in VACUUM");
    tokio::task::block_in_place(|| finish(&mut s));
}

/// A retention under a day, and one at or past the week the checkpoints
/// keep removes (VACUUM would find almost nothing), each exit 2 naming the
/// flag, before any table is touched.
#[test]
fn a_vacuum_retention_that_cannot_work_is_refused_before_anything_is_written() {
    let mut s = Scenario::new(20, WF);
    history(&mut s, 2);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let version = |loc: String| rt.block_on(async { delta::open_existing(&loc, &Default::default()).await.unwrap().unwrap().version() });
    let versions = |s: &Scenario| ["bronze", "facts", "plans"].map(|n| version(location(s, n)));
    let v = versions(&s);
    for (hours, names) in [("12", "a call that loaded"), ("168", "delta.deletedFileRetentionDuration")] {
        let (code, j) = step(&s, &["maintain", "--vacuum-retention-hours", hours], &[]);
        assert_eq!(code, 2, "{hours}: {j}");
        let e = j["error"].as_str().unwrap();
        assert!(e.contains("--vacuum-retention-hours") && e.contains(names), "{hours}: {j}");
        assert_eq!(versions(&s), v, "{hours}: nothing was committed");
    }
    assert_eq!(table_json(&ok(&s, &["maintain", "--vacuum-retention-hours", "167"]), "facts")["vacuum"]["files_deleted"], 0);
}
