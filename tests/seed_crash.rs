//! A seed that crashes between its bronze commit and its facts row is
//! finished by the next call, from the bronze commit's metadata. (Its own test
//! binary: failpoints are process-wide.)

mod common;

use common::Scenario;
use mssql_cdc::engine::seed::{self, AsOf, SeedArgs};

/// A table of 20 rows, a copy of it taken at a recorded max LSN with changes
/// before and after, and a seed from that copy cut by the failpoint after its
/// bronze commit: the scenario, the seed's arguments, the LSN and the copy's
/// row count.
async fn seed_cut_after_its_bronze_commit() -> (Scenario, SeedArgs, mssql_cdc::lsn::Lsn, i64) {
    let mut s = Scenario::new(20, "[snapshot]\nbootstrap = true\n");
    let recorded = s.db.max_lsn().unwrap().unwrap();
    s.changes(3);
    let copy = s.path().join("copy");
    let source = s.db.source().unwrap();
    let ci = mssql_cdc::source::CdcSource::capture_instances(&source, &s.table).await.unwrap().pop().unwrap();
    let rows = mssql_cdc::seed_copy::export_parquet(&source, &s.table, &ci.columns, &copy, 1000).await.unwrap() as i64;
    s.changes(3);
    common::settle(&s.db);
    let args = SeedArgs { copy: copy.to_string_lossy().into_owned(), as_of: AsOf::Lsn(recorded), reseed: false, allow_missing_columns: false };
    fail::cfg("seed.after_bronze", "1*return").unwrap();
    let e = seed::run(&mut s.context().await.unwrap(), &args).await.unwrap_err();
    assert!(e.to_string().contains("seed.after_bronze"), "{e}");
    fail::remove("seed.after_bronze");
    (s, args, recorded, rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_the_bronze_commit_then_rerun() {
    let _failpoints = fail::FailScenario::setup();
    let (s, args, recorded, rows) = seed_cut_after_its_bronze_commit().await;
    assert_eq!(s.count("bronze", "_operation = 0").await, rows);
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 0);
    let r = seed::run(&mut s.context().await.unwrap(), &args).await.unwrap();
    assert!(r.already_seeded && r.lsn == recorded && r.rows == rows, "{r:?}");
    assert_eq!(s.count("facts", "event = 'bootstrap'").await, 1);
    assert_eq!(s.count("bronze", "_operation = 0").await, rows, "the rerun wrote no second copy");
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
}

/// The same crash, then a second capture instance enabled before the rerun
/// (it starts after the seed's LSN; the first instance holds the changes in
/// between). The rerun completes the seed on the instance it was loaded for,
/// so the stream reads the first instance up to the second's start and
/// switches: no loss is reported and bronze rebuilds the table exactly.
/// Completed on the newest instance instead, the stream read its min LSN as
/// a purge of those changes (the bug the torture soak found on a full
/// snapshot, seed 110002687; the seed's completion shares the code path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_the_bronze_commit_then_a_newer_instance_then_rerun() {
    let _failpoints = fail::FailScenario::setup();
    let (mut s, args, recorded, _) = seed_cut_after_its_bronze_commit().await;
    s.changes(4);
    common::settle(&s.db);
    let newer = s.db.enable_cdc(&s.table, Some("dbo_items_v2"), None).unwrap();
    s.changes(4);
    common::settle(&s.db);
    assert!(newer.start_lsn.is_some_and(|start| recorded.increment() < start), "the premise: the newer instance starts after the seed's LSN");
    let r = seed::run(&mut s.context().await.unwrap(), &args).await.unwrap();
    assert!(r.already_seeded && r.lsn == recorded, "{r:?}");
    s.stream_until_caught_up().await;
    assert_eq!(s.count("facts", "event = 'capture_instance_switched'").await, 1);
    assert_eq!(s.count("facts", "event IN ('recovery', 'data_skipped')").await, 0);
    assert_eq!(s.verify().await.differences(), 0);
}

// ---------------------------------------------------------------------------
// A seed beside another step: each race made certain with a gate
// (`common::gate`) that holds the seed between its read of the copy and its
// bronze commit, or between its two commits, while the other step runs.

use std::path::PathBuf;

use common::gate::{failpoints_and_runtime, start_held, Gate};
use mssql_cdc::engine::{self, chunked};
use mssql_cdc::error::StepResult;

const CHUNKED: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                       [stream]\nmax_batch_rows = 1000\n";
const FULL: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\n";
const NO_BOOTSTRAP: &str = "[stream]\nmax_batch_rows = 1000\n";
/// bronze's whole-snapshot rows: a seed's or a full snapshot's.
const WHOLE_SNAPSHOT_ROWS: &str = "_operation = 0 AND _chunk IS NULL";

/// A scenario with a copy of its table taken at the max LSN it records
/// first, changes after it, and everything captured.
fn scenario_with_copy(rt: &tokio::runtime::Runtime, workflow: &str) -> (Scenario, SeedArgs, i64) {
    let mut s = Scenario::new(20, workflow);
    let recorded = s.db.max_lsn().unwrap().unwrap();
    let copy = s.path().join("copy");
    let source = s.db.source().unwrap();
    let rows = rt.block_on(async {
        let ci = mssql_cdc::source::CdcSource::capture_instances(&source, &s.table).await.unwrap().pop().unwrap();
        mssql_cdc::seed_copy::export_parquet(&source, &s.table, &ci.columns, &copy, 1000).await.unwrap() as i64
    });
    s.changes(3);
    common::settle(&s.db);
    let args = SeedArgs { copy: copy.to_string_lossy().into_owned(), as_of: AsOf::Lsn(recorded), reseed: false, allow_missing_columns: false };
    (s, args, rows)
}

async fn seed_at(wf: PathBuf, args: SeedArgs) -> StepResult<seed::SeedResult> {
    let mut ctx = engine::open_workflow(&wf).await?;
    seed::run(&mut ctx, &args).await
}

async fn stream_at(wf: PathBuf) -> StepResult<engine::stream::StreamResult> {
    let mut ctx = engine::open_workflow(&wf).await?;
    engine::coarse::stream(&mut ctx).await
}

async fn open_chunked_at(wf: PathBuf) -> StepResult<Option<chunked::OpenResult>> {
    let mut ctx = engine::open_workflow(&wf).await?;
    chunked::ensure_bootstrap_open(&mut ctx).await
}

fn facts_events(rt: &tokio::runtime::Runtime, s: &Scenario, event: &str) -> Vec<mssql_cdc::delta::facts::FactRow> {
    let rows = rt.block_on(async {
        let t = mssql_cdc::delta::open_existing(&s.path().join("facts").to_string_lossy(), &Default::default()).await.unwrap().unwrap();
        mssql_cdc::delta::facts::from_batches(&mssql_cdc::delta::query(&t, "SELECT * FROM t").await.unwrap()).unwrap()
    });
    rows.into_iter().filter(|r| r.event.as_deref() == Some(event)).collect()
}

#[test]
fn a_chunked_open_while_the_copy_is_read_refuses_the_seed_before_it_commits() {
    let (_fp, rt) = failpoints_and_runtime();
    let (s, args, _) = scenario_with_copy(&rt, CHUNKED);
    let gate = Gate::hold("seed.after_copy_read", 1);
    let a = args.clone();
    let mut seed_call = start_held(&gate, &s.wf_path, move |wf| seed_at(wf, a));
    let opened = rt.block_on(open_chunked_at(s.wf_path.clone())).unwrap().expect("the stream's bootstrap opens its chunked snapshot");
    gate.open();
    let e = seed_call.join().unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("snapshot"), "the refusal names the open snapshot: {e}");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), 0, "the seed committed none of its rows");
    assert!(facts_events(&rt, &s, "bootstrap").is_empty(), "no completion but the chunked snapshot's own, later");
    assert_eq!(facts_events(&rt, &s, "snapshot_open").len(), 1);
    // The chunked snapshot finishes as if the seed had never run.
    common::cli_backfill_until_done(&s);
    rt.block_on(s.stream_until_caught_up());
    let done = facts_events(&rt, &s, "bootstrap");
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].max_lsn, Some(opened.snapshot_lsn));
    assert_eq!(rt.block_on(s.verify()).differences(), 0);
}

#[test]
fn a_stream_started_between_the_seeds_commits_keeps_the_generation_and_the_seeds_rows_are_removed() {
    let (_fp, rt) = failpoints_and_runtime();
    let (s, args, rows) = scenario_with_copy(&rt, NO_BOOTSTRAP);
    let gate = Gate::hold("seed.after_bronze", 1);
    let a = args.clone();
    let mut seed_call = start_held(&gate, &s.wf_path, move |wf| seed_at(wf, a));
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), rows, "held after its bronze commit");
    let streamed = rt.block_on(s.stream()).unwrap();
    gate.open();
    let e = seed_call.join().unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("started by another step"), "{e}");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), 0, "the seed removed the rows it had committed");
    assert!(facts_events(&rt, &s, "bootstrap").is_empty(), "the generation has one start: the stream's");
    let starts = facts_events(&rt, &s, "stream_start");
    assert_eq!(starts.len(), 1);
    assert!(streamed.position >= starts[0].max_lsn, "{streamed:?}");
    // A rerun of the seed is refused as a seed after a stream start is, and writes nothing.
    let e = rt.block_on(seed_at(s.wf_path.clone(), args)).unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), 0);
    assert!(facts_events(&rt, &s, "bootstrap").is_empty());
}

#[test]
fn a_full_bootstrap_between_the_seeds_commits_completes_it_as_the_seed() {
    let (_fp, rt) = failpoints_and_runtime();
    let (s, args, rows) = scenario_with_copy(&rt, FULL);
    let gate = Gate::hold("seed.after_bronze", 1);
    let a = args.clone();
    let mut seed_call = start_held(&gate, &s.wf_path, move |wf| seed_at(wf, a));
    // The stream's bootstrap finds bronze's snapshot key taken by the seed's
    // commit and completes it: as the seed, naming its copy.
    let boot = rt.block_on(s.stream()).unwrap();
    assert!(boot.bootstrap.is_some(), "{boot:?}");
    gate.open();
    let r = seed_call.join().unwrap();
    assert!(!r.already_seeded && r.rows == rows, "{r:?}");
    let done = facts_events(&rt, &s, "bootstrap");
    assert_eq!(done.len(), 1, "one completion");
    let detail = done[0].detail.clone().unwrap();
    assert_eq!(detail["mode"], "seed", "{detail}");
    assert_eq!(detail["copy"], args.copy.as_str(), "{detail}");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), rows, "one copy of the rows, no full snapshot beside it");
    let again = rt.block_on(seed_at(s.wf_path.clone(), args)).unwrap();
    assert!(again.already_seeded, "{again:?}");
    rt.block_on(s.stream_until_caught_up());
    assert_eq!(rt.block_on(s.verify()).differences(), 0);
}

/// A chunked workflow whose seed was cut by the failpoint after its bronze
/// commit: the copy's rows are in bronze, generation 0 has no completion.
fn chunked_seed_cut_after_its_bronze_commit(rt: &tokio::runtime::Runtime) -> (Scenario, SeedArgs, i64) {
    let (s, args, rows) = scenario_with_copy(&rt, CHUNKED);
    fail::cfg("seed.after_bronze", "1*return").unwrap();
    let e = rt.block_on(seed_at(s.wf_path.clone(), args.clone())).unwrap_err();
    assert!(e.to_string().contains("seed.after_bronze"), "{e}");
    fail::remove("seed.after_bronze");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), rows);
    (s, args, rows)
}

#[test]
fn a_seed_cut_after_its_bronze_commit_then_a_chunked_open_the_rerun_removes_its_rows() {
    let (_fp, rt) = failpoints_and_runtime();
    let (s, args, rows) = chunked_seed_cut_after_its_bronze_commit(&rt);
    // The stream's chunked bootstrap opens: no completion holds generation 0 yet.
    rt.block_on(open_chunked_at(s.wf_path.clone())).unwrap().expect("an open");
    // The rerun cannot complete the seed: cut once more before its undo, then again.
    fail::cfg("seed.before_undo", "1*return").unwrap();
    let e = rt.block_on(seed_at(s.wf_path.clone(), args.clone())).unwrap_err();
    assert!(e.to_string().contains("seed.before_undo"), "{e}");
    fail::remove("seed.before_undo");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), rows, "cut before the undo: the rows are still there");
    let e = rt.block_on(seed_at(s.wf_path.clone(), args.clone())).unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), 0, "the rerun removed the seed's rows");
    assert!(facts_events(&rt, &s, "bootstrap").is_empty());
    common::cli_backfill_until_done(&s);
    rt.block_on(s.stream_until_caught_up());
    assert_eq!(facts_events(&rt, &s, "bootstrap").len(), 1);
    assert_eq!(rt.block_on(s.verify()).differences(), 0);
}

/// The same cut, but the chunked snapshot opens *and completes* before the
/// seed is called again (the soak's schedule 150012436). The generation's
/// completion key is then applied, so the seed's own completion can never
/// be written: every later call answered "another call of this seed is
/// between its commits" (exit 75) for good, and the copy's rows stayed in
/// bronze beside the chunked snapshot. The rerun must remove them and refuse
/// as a seed after another snapshot is refused.
#[test]
fn a_seed_cut_after_its_bronze_commit_then_a_chunked_snapshot_completed_the_rerun_removes_its_rows() {
    let (_fp, rt) = failpoints_and_runtime();
    let (s, args, _) = chunked_seed_cut_after_its_bronze_commit(&rt);
    common::cli_backfill_until_done(&s);
    let done = facts_events(&rt, &s, "bootstrap");
    assert_eq!(done.len(), 1, "the chunked snapshot completed generation 0");
    assert_ne!(done[0].detail.as_ref().and_then(|d| d.get("mode")).and_then(|m| m.as_str()), Some("seed"), "{:?}", done[0].detail);
    for call in 0..2 {
        let e = rt.block_on(seed_at(s.wf_path.clone(), args.clone())).unwrap_err();
        assert_eq!(e.exit_code(), 2, "call {call}: {e}");
        assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), 0, "call {call}: the seed's rows are removed");
    }
    assert_eq!(facts_events(&rt, &s, "bootstrap").len(), 1, "the chunked snapshot's completion only");
    rt.block_on(s.stream_until_caught_up());
    assert_eq!(rt.block_on(s.verify()).differences(), 0);
}

/// A full-mode stream's bootstrap finds a seed cut between its commits and
/// completes it as the seed's; before it writes the completion, a call run
/// with the chunked settings opens a chunked snapshot of generation 0. The
/// seed's rows are removed and the stream is told to call again (exit 75):
/// the seed's own refusal (exit 2, "run seed --reseed") answered a caller
/// who had run no seed. Its next call reads the state as it now is and
/// streams from the chunked snapshot's LSN, which completes without the
/// seed's rows.
#[test]
fn a_stream_completing_a_cut_seed_that_loses_the_generation_calls_again() {
    let (_fp, rt) = failpoints_and_runtime();
    let (mut s, args, rows) = scenario_with_copy(&rt, FULL);
    fail::cfg("seed.after_bronze", "1*return").unwrap();
    let e = rt.block_on(seed_at(s.wf_path.clone(), args.clone())).unwrap_err();
    assert!(e.to_string().contains("seed.after_bronze"), "{e}");
    fail::remove("seed.after_bronze");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), rows);
    let chunked_wf = s.path().join("items_chunked.toml");
    let text = std::fs::read_to_string(&s.wf_path).unwrap();
    assert!(text.contains(FULL));
    std::fs::write(&chunked_wf, text.replace(FULL, CHUNKED)).unwrap();
    let gate = Gate::hold("snapshot.before_repaired_completion", 1);
    let mut stream_call = start_held(&gate, &s.wf_path, stream_at);
    rt.block_on(open_chunked_at(chunked_wf)).unwrap().expect("the chunked open takes generation 0");
    gate.open();
    let e = stream_call.join().unwrap_err();
    assert_eq!(e.exit_code(), 75, "{e}");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), 0, "the seed's rows are removed");
    assert!(facts_events(&rt, &s, "bootstrap").is_empty());
    // Called again, with the same settings, it goes on: it streams from the
    // chunked snapshot that holds the generation, and takes no snapshot.
    let again = rt.block_on(stream_at(s.wf_path.clone())).unwrap();
    assert!(again.bootstrap.is_none() && again.position.is_some(), "{again:?}");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), 0);
    s.write_workflow(CHUNKED);
    common::cli_backfill_until_done(&s);
    rt.block_on(s.stream_until_caught_up());
    let done = facts_events(&rt, &s, "bootstrap");
    assert_eq!(done.len(), 1);
    assert_ne!(done[0].detail.as_ref().and_then(|d| d.get("mode")).and_then(|m| m.as_str()), Some("seed"), "{:?}", done[0].detail);
    assert_eq!(rt.block_on(s.verify()).differences(), 0);
}

/// Two calls of the same seed: the second passes its start (nothing of the
/// seed in bronze yet) and is held after reading the copy; the first commits
/// its rows and dies before its completion row. The second then finds its
/// own seed in bronze, pending: it must write the completion, not answer
/// "already seeded" over rows no facts row counts (the soak's schedule
/// 30001859, where the caller, told the copy was done, never called again).
#[test]
fn a_seed_rerun_beside_one_that_died_between_its_commits_completes_it() {
    let (_fp, rt) = failpoints_and_runtime();
    let (s, args, rows) = scenario_with_copy(&rt, FULL);
    let gate = Gate::hold("seed.after_copy_read", 1);
    let a = args.clone();
    let mut held_call = start_held(&gate, &s.wf_path, move |wf| seed_at(wf, a));
    fail::cfg("seed.after_bronze", "1*return").unwrap();
    let e = rt.block_on(seed_at(s.wf_path.clone(), args.clone())).unwrap_err();
    assert!(e.to_string().contains("seed.after_bronze"), "{e}");
    fail::remove("seed.after_bronze");
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), rows, "the dead call's rows are in");
    assert!(facts_events(&rt, &s, "bootstrap").is_empty(), "and no completion counts them");
    gate.open();
    let r = held_call.join().unwrap();
    assert!(r.already_seeded && r.rows == rows, "{r:?}");
    let done = facts_events(&rt, &s, "bootstrap");
    assert_eq!(done.len(), 1, "the held call wrote the completion");
    assert_eq!(done[0].detail.clone().unwrap()["copy"], args.copy.as_str());
    assert_eq!(rt.block_on(s.count("bronze", WHOLE_SNAPSHOT_ROWS)), rows, "one copy of the rows: the held call's files are never committed");
    rt.block_on(s.stream_until_caught_up());
    assert_eq!(rt.block_on(s.verify()).differences(), 0);
}
