//! Rules of the design records that the code contradicted, each driven
//! through the command line on the simulator:
//! - a full open that CDC cleanup has passed holds no snapshot mode, for
//!   `seed` and `status` too (adr-0028's Amendment, adr-0025), and the error
//!   for one that may still be read names a call that finishes it;
//! - a full re-snapshot committed to bronze but passed by cleanup before its
//!   completion row is a failed attempt, and the reruns recover past it;
//! - `on_data_loss = "skip"` does not skip past a gap while a chunked
//!   snapshot is open (adr-0028, Consequences: the snapshot is superseded).
//!
//! Every check reads the simulator's own rows (its transaction API) and
//! rebuilds bronze's image here with the records' rule in SQL, so no engine
//! helper checks itself.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{
    bronze_image, cli_backfill_until_done as backfill_until_done, cli_stream_until_caught_up as stream_until_caught_up, pass_the_retention, ok, step,
    Scenario,
};
use mssql_cdc::delta::facts::FactRow;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::sim::SimError;
use mssql_cdc::source::CdcSource;
use mssql_cdc::types::as_stored;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A Parquet copy of the table as it is now, and the LSN recorded before it.
fn copy_now(rt: &tokio::runtime::Runtime, s: &Scenario, name: &str) -> (std::path::PathBuf, Lsn) {
    common::settle(&s.db);
    let recorded = s.db.max_lsn().unwrap().unwrap();
    let dir = s.path().join(name);
    rt.block_on(async {
        let source = s.db.source().unwrap();
        let ci = source.capture_instances(&s.table).await.unwrap().pop().unwrap();
        mssql_cdc::seed_copy::export_parquet(&source, &s.table, &ci.columns, &dir, 1000).await.unwrap();
    });
    (dir, recorded)
}

fn seed(s: &Scenario, copy: &Path, at: Lsn, reseed: bool) -> (i32, serde_json::Value) {
    let hex = at.to_hex();
    let mut args = vec!["seed", "--copy", copy.to_str().unwrap(), "--as-of", hex.as_str()];
    if reseed {
        args.push("--reseed");
    }
    step(s, &args, &[])
}

fn facts(rt: &tokio::runtime::Runtime, s: &Scenario) -> Vec<FactRow> {
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        mssql_cdc::engine::state::facts_rows(&ctx.facts, "items").await.unwrap()
    })
}

fn events<'a>(rows: &'a [FactRow], name: &str) -> Vec<&'a FactRow> {
    rows.iter().filter(|r| r.event.as_deref() == Some(name)).collect()
}

/// Bronze's and facts' table versions.
fn versions(rt: &tokio::runtime::Runtime, s: &Scenario) -> (Option<u64>, Option<u64>) {
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        (ctx.bronze.version(), ctx.facts.version())
    })
}

/// The simulator's rows, every column as bronze stores it, by id: read in a
/// transaction that is then rolled back, so reading leaves no trace.
fn table_rows(s: &Scenario) -> BTreeMap<i64, Vec<String>> {
    let keys = s.db.keys(&s.table).unwrap();
    let columns = common::items_spec(&s.table).columns;
    let table = s.table.clone();
    let mut out = BTreeMap::new();
    let r = s.db.transaction(|tx| {
        for k in &keys {
            let row = tx.get(&table, k)?.expect("a listed key has a row");
            let text = row.iter().zip(&columns).map(|(v, c)| as_stored(v, &c.sql_type).canonical()).collect();
            out.insert(k[0].as_i64().unwrap(), text);
        }
        Err(SimError::BadArgument("read only: roll back".into()))
    });
    assert!(matches!(r, Err(SimError::BadArgument(_))), "{r:?}");
    out
}


/// The newest completed snapshot's S, read from the facts rows themselves.
fn newest_completion(rows: &[FactRow]) -> Lsn {
    common::newest_completion(rows).expect("a completed snapshot")
}

/// Bronze's image from the newest completed snapshot equals the table, every column.
fn assert_bronze_equals_table(rt: &tokio::runtime::Runtime, s: &Scenario) {
    let rows = facts(rt, s);
    let image = bronze_image(rt, s, newest_completion(&rows));
    let table = table_rows(s);
    common::assert_image_is_table(&table, &image);
}

/// Each generation's batches tile the LSNs after its start without a gap or
/// an overlap: the first reads from start + 1, each next one from the
/// previous one's end + 1. The start is the generation's completed snapshot,
/// else its chunked open. No batch skipped a range.
fn assert_batches_tile(rows: &[FactRow]) {
    assert!(events(rows, "data_skipped").is_empty(), "no range was skipped");
    let generations: std::collections::BTreeSet<i32> = rows.iter().filter(|r| r.event.is_none()).map(|r| r.generation).collect();
    for g in generations {
        let start = rows
            .iter()
            .filter(|r| r.generation == g && matches!(r.event.as_deref(), Some("bootstrap") | Some("resnapshot")))
            .filter_map(|r| r.max_lsn)
            .max()
            .or_else(|| {
                rows.iter()
                    .filter(|r| r.generation == g && r.event.as_deref() == Some("snapshot_open"))
                    .filter(|r| r.detail.as_ref().is_some_and(|d| d["mode"] == "chunked"))
                    .filter_map(|r| r.min_lsn)
                    .max()
            })
            .unwrap_or_else(|| panic!("generation {g} has batches but no start"));
        let mut batches: Vec<&FactRow> = rows.iter().filter(|r| r.generation == g && r.event.is_none()).collect();
        batches.sort_by_key(|r| r.batch_id);
        let mut expected_from = start.increment();
        for (i, b) in batches.iter().enumerate() {
            assert_eq!(b.batch_id, Some(i as i64), "generation {g}: batch ids from 0 without a hole");
            assert_eq!(b.min_lsn, Some(expected_from), "generation {g} batch {i}: a gap or an overlap");
            let to = b.max_lsn.unwrap();
            assert!(to >= b.min_lsn.unwrap() || b.rows == Some(0), "generation {g} batch {i}: an empty range with rows");
            expected_from = to.increment();
        }
    }
}

fn status(s: &Scenario) -> serde_json::Value {
    ok(s, &["status"])
}

const SEEDABLE: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\n";

/// 28.80, 25.39: a full bootstrap killed after its open holds the mode while
/// it may still be read (the refusal names `snapshot`, and that call does
/// finish it), and holds nothing once cleanup has passed its S: `status`
/// stops listing it and `seed` goes ahead; the seeded stream equals the table.
#[test]
fn a_killed_full_bootstrap_holds_the_mode_until_cleanup_passes_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(25, SEEDABLE);
    let (code, j) = step(&s, &["snapshot"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")]);
    assert_eq!(code, 75, "{j}");
    let open_s = events(&facts(&rt, &s), "snapshot_open")[0].min_lsn.unwrap();
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([open_s.to_hex()]));

    // While it may still be read: refused, nothing written.
    let (copy, at) = copy_now(&rt, &s, "copy1");
    let before = versions(&rt, &s);
    let (code, j) = seed(&s, &copy, at, false);
    assert_eq!(code, 2, "{j}");
    let msg = j["error"].as_str().unwrap();
    let wf = s.wf_path.display().to_string();
    assert!(msg.contains("full snapshot") && msg.contains(&open_s.to_hex()), "{msg}");
    assert!(msg.contains(&format!("`mssql-cdc --workflow {wf} snapshot`")), "names the call that finishes it: {msg}");
    assert_eq!(versions(&rt, &s), before, "a refusal writes nothing");

    // Time passes beyond the retention, and cleanup passes the open's S.
    pass_the_retention(&mut s, 4);
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([]), "a dead open is not listed");
    let (copy, at) = copy_now(&rt, &s, "copy2");
    let (code, j) = seed(&s, &copy, at, false);
    assert_eq!(code, 0, "the dead open no longer blocks the seed: {j}");
    assert_eq!((j["lsn"].as_str(), j["generation"].as_i64(), j["already_seeded"].as_bool()), (Some(at.to_hex().as_str()), Some(0), Some(false)), "{j}");
    s.changes(7);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(events(&rows, "bootstrap").len(), 1);
    assert_eq!(events(&rows, "bootstrap")[0].max_lsn, Some(at));
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

/// The call the refusal names does finish a live full bootstrap open.
#[test]
fn the_call_a_live_full_bootstrap_refusal_names_finishes_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Scenario::new(15, SEEDABLE);
    assert_eq!(step(&s, &["snapshot"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")]).0, 75);
    let (copy, at) = copy_now(&rt, &s, "copy");
    let (code, j) = seed(&s, &copy, at, false);
    assert_eq!(code, 2, "{j}");
    let msg = j["error"].as_str().unwrap().to_string();
    let named = msg.split('`').nth(1).expect("a call in backquotes").to_string();
    let args: Vec<&str> = named.split_whitespace().collect();
    assert_eq!(&args[..3], &["mssql-cdc", "--workflow", s.wf_path.to_str().unwrap()], "{msg}");
    ok(&s, &args[3..]);
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([]), "the named call finished it");
    // Now a snapshot is there: the newer copy goes in with --reseed.
    s.db.transaction(|tx| tx.insert(&s.table, common::item_row(500, 1))).unwrap();
    let (copy, at) = copy_now(&rt, &s, "copy2");
    let (code, j) = seed(&s, &copy, at, true);
    assert_eq!((code, j["generation"].as_i64()), (0, Some(1)), "{j}");
    stream_until_caught_up(&s);
    assert_batches_tile(&facts(&rt, &s));
    assert_bronze_equals_table(&rt, &s);
}

const SEEDED_RESNAPSHOT: &str =
    "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";

/// A seeded stream loses changes; its full re-snapshot is killed after its
/// open (generation 1). The refusal of `seed --reseed` names a call that
/// finishes it (`stream`, which resumes the recovery); not `snapshot`, which
/// returns at once since generation 0 has its snapshot.
fn seeded_stream_with_a_killed_resnapshot(rt: &tokio::runtime::Runtime) -> (Scenario, Lsn) {
    let mut s = Scenario::new(20, SEEDED_RESNAPSHOT);
    let (copy, at) = copy_now(rt, &s, "copy1");
    s.changes(4);
    assert_eq!(seed(&s, &copy, at, false).0, 0);
    stream_until_caught_up(&s);
    pass_the_retention(&mut s, 4);
    let (code, j) = step(&s, &["stream"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")]);
    assert_eq!(code, 75, "{j}");
    let rows = facts(rt, &s);
    let open = events(&rows, "snapshot_open");
    assert_eq!((open.len(), open[0].generation), (1, 1));
    (s, open[0].min_lsn.unwrap())
}

/// 25.25: the live re-snapshot's refusal names `stream`, and `stream` finishes it.
#[test]
fn a_live_full_resnapshot_refuses_reseed_naming_stream_which_finishes_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (s, open_s) = seeded_stream_with_a_killed_resnapshot(&rt);
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([open_s.to_hex()]));
    let (copy, at) = copy_now(&rt, &s, "copy2");
    let before = versions(&rt, &s);
    let (code, j) = seed(&s, &copy, at, true);
    assert_eq!(code, 2, "{j}");
    let msg = j["error"].as_str().unwrap();
    let wf = s.wf_path.display().to_string();
    assert!(msg.contains(&format!("`mssql-cdc --workflow {wf} stream`")), "names stream: {msg}");
    assert!(!msg.contains(&format!("`mssql-cdc --workflow {wf} snapshot`")), "snapshot would not finish it: {msg}");
    assert_eq!(versions(&rt, &s), before);
    // `snapshot` indeed leaves it open; `stream` completes it in generation 1.
    ok(&s, &["snapshot"]);
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([open_s.to_hex()]));
    let j = ok(&s, &["stream"]);
    assert_eq!(j["generation"], 1, "{j}");
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([]));
    stream_until_caught_up(&s);
    assert_batches_tile(&facts(&rt, &s));
    assert_bronze_equals_table(&rt, &s);
}

/// 25.25, 25.39: once cleanup has passed the killed re-snapshot's S, `seed
/// --reseed` (the manual recovery) goes ahead as generation 1.
#[test]
fn a_dead_full_resnapshot_no_longer_blocks_reseed() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut s, _open_s) = seeded_stream_with_a_killed_resnapshot(&rt);
    s.db.advance_clock(DAY * 4).unwrap();
    s.changes(3);
    common::settle(&s.db);
    s.db.cleanup(None).unwrap();
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([]));
    let (copy, at) = copy_now(&rt, &s, "copy2");
    let (code, j) = seed(&s, &copy, at, true);
    assert_eq!(code, 0, "{j}");
    assert_eq!((j["generation"].as_i64(), j["already_seeded"].as_bool()), (Some(1), Some(false)), "{j}");
    s.changes(5);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(status(&s)["generation"], 1);
    assert_eq!(newest_completion(&rows), at);
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

const FULL_RESNAPSHOT: &str =
    "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";
const CHUNKED_RESNAPSHOT_NOW: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                                      [stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\nresnapshot_interval_days = 0\n";

/// A recovery's full re-snapshot is killed between its bronze commit and its
/// completion row, then cleanup passes its S: its image can never be
/// continued. Returns the scenario and that S.
fn resnapshot_committed_then_passed(rt: &tokio::runtime::Runtime) -> (Scenario, Lsn) {
    let mut s = Scenario::new(30, FULL_RESNAPSHOT);
    stream_until_caught_up(&s);
    s.changes(5);
    stream_until_caught_up(&s);
    pass_the_retention(&mut s, 4);
    let (code, j) = step(&s, &["stream"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_bronze=return")]);
    assert_eq!(code, 75, "{j}");
    let rows = facts(rt, &s);
    assert!(events(&rows, "resnapshot").is_empty());
    let dead_s = events(&rows, "snapshot_open").iter().filter(|r| r.generation == 1).find_map(|r| r.min_lsn).unwrap();
    assert!(rt.block_on(s.count("bronze", &format!("_snapshot = '{}'", dead_s.to_hex()))) > 0, "the re-snapshot's rows are in bronze");
    pass_the_retention(&mut s, 4);
    (s, dead_s)
}

/// The dead attempt counts as a failure (once) for the anti-loop guard; with
/// interval 0 a chunked rerun opens generation 1 and completes it.
#[test]
fn a_committed_resnapshot_passed_by_cleanup_is_failed_once_and_a_chunked_rerun_recovers() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut s, dead_s) = resnapshot_committed_then_passed(&rt);
    // Within the interval of the failure: a person decides (exit 3), twice, with one failure row.
    for _ in 0..2 {
        let (code, j) = step(&s, &["stream"], &[]);
        assert_eq!(code, 3, "{j}");
        assert!(j["error"].as_str().unwrap().contains("failed re-snapshot"), "{j}");
    }
    let failed = facts(&rt, &s);
    let failed = events(&failed, "resnapshot_failed");
    assert_eq!(failed.len(), 1, "the dead attempt is recorded once: {failed:?}");
    assert_eq!(failed[0].min_lsn, Some(dead_s));
    // Chunked, interval 0: the rerun opens generation 1 at once.
    s.write_workflow(CHUNKED_RESNAPSHOT_NOW);
    let j = ok(&s, &["stream"]);
    assert_eq!((j["generation"].as_i64(), j["recovery"]["mode"].as_str()), (Some(1), Some("chunked")), "{j}");
    s.changes(4);
    common::settle(&s.db);
    backfill_until_done(&s);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(status(&s)["generation"], 1);
    let done = events(&rows, "resnapshot");
    assert_eq!(done.len(), 1);
    assert_ne!(done[0].max_lsn, Some(dead_s), "the dead image was never completed");
    assert_eq!(events(&rows, "resnapshot_failed").len(), 1);
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

/// In full mode the rerun takes a new full re-snapshot: the dead commit
/// holds generation 1's bronze key, so the stream goes live in generation 2.
#[test]
fn a_committed_resnapshot_passed_by_cleanup_then_a_full_rerun_recovers() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut s, dead_s) = resnapshot_committed_then_passed(&rt);
    let j = ok(&s, &["stream", "--resnapshot-interval-days", "0"]);
    assert_eq!((j["generation"].as_i64(), j["recovery"]["mode"].as_str()), (Some(2), Some("full")), "{j}");
    assert_eq!(j["caught_up"], true, "{j}");
    s.changes(6);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(status(&s)["generation"], 2);
    let done = events(&rows, "resnapshot");
    assert_eq!((done.len(), done[0].generation), (1, 2));
    assert!(done[0].max_lsn.unwrap() > dead_s);
    assert_eq!(events(&rows, "resnapshot_failed").len(), 1);
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

/// The retire row is a commit boundary of its own: a call cut right after
/// writing the dead attempt's `resnapshot_failed` row leaves that row once,
/// and its rerun goes on to the same recovery as an uncut call (generation 2,
/// one failure row, bronze equal to the table).
#[test]
fn a_crash_after_the_failed_attempts_row_reruns_to_one_failure_row() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (mut s, dead_s) = resnapshot_committed_then_passed(&rt);
    let (code, j) = step(&s, &["stream", "--resnapshot-interval-days", "0"], &[("MSSQL_CDC_FAILPOINTS", "recover.after_failed_row=return")]);
    assert_eq!(code, 75, "the cut call is one to call again: {j}");
    assert!(j["error"].as_str().unwrap_or("").contains("recover.after_failed_row"), "{j}");
    let rows = facts(&rt, &s);
    let failed = events(&rows, "resnapshot_failed");
    assert_eq!((failed.len(), failed[0].min_lsn), (1, Some(dead_s)), "the row is in before the cut: {failed:?}");
    assert!(events(&rows, "resnapshot").is_empty(), "nothing after the cut");
    let j = ok(&s, &["stream", "--resnapshot-interval-days", "0"]);
    assert_eq!((j["generation"].as_i64(), j["recovery"]["mode"].as_str()), (Some(2), Some("full")), "{j}");
    s.changes(6);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(events(&rows, "resnapshot_failed").len(), 1, "the rerun found the row and wrote no second one");
    assert_eq!(events(&rows, "resnapshot").len(), 1);
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

const CHUNKED_SKIP: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                            [stream]\nmax_batch_rows = 1000\non_data_loss = \"skip\"\n";

/// 28.131: with a chunked snapshot open, the stream does not skip a purged
/// range (the snapshot would complete over the gap): exit 3, nothing
/// written, and the advice (on_data_loss = "resnapshot") supersedes the
/// snapshot with a new one that completes equal to the table.
#[test]
fn skip_is_refused_while_a_chunked_snapshot_is_open_and_a_resnapshot_supersedes_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(40, CHUNKED_SKIP);
    ok(&s, &["stream"]);
    let j = ok(&s, &["backfill", "--max-waves", "1"]);
    assert_eq!(j["done"], false, "{j}");
    s.changes(5);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    pass_the_retention(&mut s, 4);
    let before = versions(&rt, &s);
    let (code, j) = step(&s, &["stream"], &[]);
    assert_eq!(code, 3, "{j}");
    assert_eq!(j["kind"], "needs_person");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("chunked snapshot") && msg.contains("on_data_loss = \"resnapshot\"") && msg.contains("nothing was written"), "{msg}");
    assert_eq!(versions(&rt, &s), before, "no batch, no data_skipped row");
    // The advice: a recovery opens a new chunked snapshot in generation 1.
    s.write_workflow(&CHUNKED_SKIP.replace("\"skip\"", "\"resnapshot\""));
    let j = ok(&s, &["stream"]);
    assert_eq!((j["generation"].as_i64(), j["recovery"]["mode"].as_str()), (Some(1), Some("chunked")), "{j}");
    s.changes(4);
    common::settle(&s.db);
    backfill_until_done(&s);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert!(events(&rows, "bootstrap").is_empty(), "the broken generation-0 snapshot never completed");
    let done = events(&rows, "resnapshot");
    assert_eq!((done.len(), done[0].generation), (1, 1));
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}
