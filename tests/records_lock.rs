//! The mode lock and the records' rules around it, each driven through the
//! command line on the simulator (issue "records"):
//! - `apply` holds silver's verdict for an open snapshot by the same rule as
//!   every other step (`engine::rules::snapshot_holding_mode`): a full open
//!   that CDC cleanup has passed holds nothing;
//! - `backfill` never completes a chunked snapshot over a gap in the stream
//!   after S (adr-0028: such a gap ruins the snapshot, a newer one replaces it);
//! - `snapshot.keys` is checked against the capture instance the stream is
//!   on, not the newest one;
//! - a chunked open that finds a full open written after its first check
//!   stops before its commit point (28.82).
//!
//! Checks read the simulator's own rows (`SimDb::rows`) and the facts rows,
//! and rebuild bronze's image here with the records' rule in SQL, so no
//! engine helper checks itself.

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Output};
use std::time::Duration;

use common::{
    bronze_image, cli_backfill_until_done as backfill_until_done, cli_stream_until_caught_up as stream_until_caught_up, pass_the_retention, last_json, ok, step, table_rows_by_id as table_rows,
    Scenario,
};
use mssql_cdc::delta::facts::FactRow;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::types::{value_at, SqlValue};

const DAY: Duration = Duration::from_secs(24 * 3600);

fn command(s: &Scenario, wf: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = common::cli_command(wf, args, env);
    c.current_dir(s.path());
    c
}

/// This stream's facts rows, read from the table itself (no workflow
/// checks, so a test can read them while the workflow is refused).
fn facts(rt: &tokio::runtime::Runtime, s: &Scenario) -> Vec<FactRow> {
    let location = s.path().join("facts").to_string_lossy().into_owned();
    rt.block_on(async {
        let t = mssql_cdc::delta::open_existing(&location, &Default::default()).await.unwrap().expect("facts exist");
        mssql_cdc::engine::state::facts_rows(&t, "items").await.unwrap()
    })
}

fn events<'a>(rows: &'a [FactRow], name: &str) -> Vec<&'a FactRow> {
    rows.iter().filter(|r| r.event.as_deref() == Some(name)).collect()
}

/// Bronze's and facts' table versions, read straight from their logs.
fn versions(s: &Scenario) -> (usize, usize) {
    let count = |t: &str| std::fs::read_dir(s.path().join(t).join("_delta_log")).map(|d| d.count()).unwrap_or(0);
    (count("bronze"), count("facts"))
}

fn status(s: &Scenario) -> serde_json::Value {
    ok(s, &["status"])
}


/// Bronze's image from the newest completed snapshot equals the table, every column.
fn assert_bronze_equals_table(rt: &tokio::runtime::Runtime, s: &Scenario) {
    let rows = facts(rt, s);
    let newest = common::newest_completion(&rows).expect("a completed snapshot");
    let image = bronze_image(rt, s, newest);
    let table = table_rows(s);
    common::assert_image_is_table(&table, &image);
}

/// Each generation's batches tile the LSNs after its start without a gap or
/// an overlap; no range was skipped.
fn assert_batches_tile(rows: &[FactRow]) {
    assert!(events(rows, "data_skipped").is_empty(), "no range was skipped");
    let generations: std::collections::BTreeSet<i32> = rows.iter().filter(|r| r.event.is_none()).map(|r| r.generation).collect();
    for g in generations {
        let start = rows
            .iter()
            .filter(|r| r.generation == g && matches!(r.event.as_deref(), Some("bootstrap") | Some("resnapshot") | Some("stream_start")))
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
            expected_from = b.max_lsn.unwrap().increment();
        }
    }
}

/// The newest batch's end: the stream's position, from the facts rows themselves.
fn stream_position(rows: &[FactRow]) -> Lsn {
    rows.iter().filter(|r| r.event.is_none()).max_by_key(|r| (r.generation, r.batch_id)).and_then(|r| r.max_lsn).expect("a batch")
}

const FULL_SILVER: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\n";

/// Item 1 (28.80 for apply): a full bootstrap is killed after its open and
/// the stream is then started without one. While the open may still be
/// read, `apply` holds silver's verdict, as `status` lists the open; once
/// cleanup passes its S, no step counts it, and `apply` must not either: the
/// verdict follows the stream.
#[test]
fn apply_stops_holding_the_verdict_for_a_full_open_cleanup_has_passed() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(20, FULL_SILVER);
    let (code, j) = step(&s, &["snapshot"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")]);
    assert_eq!(code, 75, "{j}");
    let open_s = events(&facts(&rt, &s), "snapshot_open")[0].min_lsn.unwrap();
    s.write_workflow(&FULL_SILVER.replace("bootstrap = true", "bootstrap = false").replace("[stream]\n", "[stream]\nstart = \"latest\"\n"));
    s.changes(5);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([open_s.to_hex()]));
    let j = ok(&s, &["apply"]);
    assert_eq!(j["finalized_until"], serde_json::Value::Null, "a full open that may still be read holds the verdict: {j}");

    // The stream keeps running while the retention passes; cleanup passes S.
    s.changes(4);
    common::settle(&s.db);
    s.db.advance_clock(DAY * 4).unwrap();
    s.changes(4);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    let min = s.db.cleanup(None).unwrap().watermark;
    assert!(min.is_some_and(|m| m > open_s.increment()), "cleanup passed the open's S: {min:?} vs {open_s}");
    assert_eq!(status(&s)["open_snapshots"], serde_json::json!([]), "status: the dead open holds nothing");
    let j = ok(&s, &["apply"]);
    let position = stream_position(&facts(&rt, &s));
    assert_eq!(j["applied_lsn"], serde_json::json!(position.to_hex()), "{j}");
    assert_eq!(j["finalized_until"], serde_json::json!(position.to_hex()), "apply agrees with the one rule: {j}");
    assert_batches_tile(&facts(&rt, &s));
}

const CHUNKED_FAIL: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                            [stream]\nmax_batch_rows = 1000\n";

/// Item 2 (28.131, adr-0018's Amendment): the stream of a chunked
/// snapshot's generation stops at a purged range after S. `backfill` does
/// not complete the ruined snapshot: with on_data_loss = "fail" it needs a
/// person (exit 3), with "resnapshot" it waits (exit 75) for the stream's
/// recovery, whose newer snapshot then completes equal to the table, and the
/// ruined one never completes.
#[test]
fn backfill_does_not_complete_a_chunked_snapshot_over_a_gap_after_s() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(30, CHUNKED_FAIL);
    ok(&s, &["stream"]);
    let j = ok(&s, &["backfill", "--max-waves", "1"]);
    assert_eq!(j["done"], false, "{j}");
    pass_the_retention(&mut s, 4);
    let (code, j) = step(&s, &["stream"], &[]);
    assert_eq!(code, 3, "the stream stops at the gap: {j}");

    let before = versions(&s);
    let (code, j) = step(&s, &["backfill"], &[]);
    assert_eq!(code, 3, "a ruined snapshot is not completed: {j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("purged") && msg.contains("on_data_loss"), "{msg}");
    assert_eq!(versions(&s), before, "nothing written");
    assert!(events(&facts(&rt, &s), "bootstrap").is_empty());

    s.write_workflow(&CHUNKED_FAIL.replace("[stream]\n", "[stream]\non_data_loss = \"resnapshot\"\n"));
    let (code, j) = step(&s, &["backfill"], &[]);
    assert_eq!(code, 75, "the recovery will replace it: call again after stream: {j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains(&format!("`mssql-cdc --workflow {} stream`", s.wf_path.display())), "{msg}");
    assert_eq!(versions(&s), before, "nothing written");

    let j = ok(&s, &["stream"]);
    assert_eq!((j["generation"].as_i64(), j["recovery"]["mode"].as_str()), (Some(1), Some("chunked")), "{j}");
    s.changes(4);
    common::settle(&s.db);
    backfill_until_done(&s);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert!(events(&rows, "bootstrap").is_empty(), "the ruined generation-0 snapshot never completed");
    let done = events(&rows, "resnapshot");
    assert_eq!((done.len(), done[0].generation), (1, 1));
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

const FULL_KEYED: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\nkeys = [\"qty\"]\n[stream]\nmax_batch_rows = 1000\n";

/// Item 3: `snapshot.keys` is checked against the instance the stream is
/// on. A newer instance that does not capture the key column does not refuse
/// the workflow while the stream still reads the older one (it must reach the
/// switch); once the stream has switched, the workflow is refused, naming the
/// instance.
#[test]
fn snapshot_keys_are_checked_against_the_instance_the_stream_is_on() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(20, FULL_KEYED);
    stream_until_caught_up(&s);
    s.changes(3);
    common::settle(&s.db);
    let old = status(&s)["capture_instance"].as_str().unwrap().to_string();
    let columns = ["id", "name", "price", "updated"].map(String::from).to_vec();
    s.db.enable_cdc(&s.table, Some("dbo_items_v2"), Some(columns)).unwrap();
    common::settle(&s.db);

    let (code, j) = step(&s, &["status"], &[]);
    assert_eq!(code, 0, "the stream is still on {old}, which captures qty: {j}");
    assert_eq!(j["capture_instance"], old.as_str());
    s.changes(4);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(events(&rows, "capture_instance_switched").len(), 1, "the stream reached the switch");
    assert_batches_tile(&rows);

    let before = versions(&s);
    let (code, j) = step(&s, &["status"], &[]);
    assert_eq!(code, 2, "on dbo_items_v2 the key column is not captured: {j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("'qty'") && msg.contains("dbo_items_v2"), "{msg}");
    assert_eq!(step(&s, &["stream"], &[]).0, 2);
    assert_eq!(versions(&s), before, "a refusal writes nothing");
}

const CHUNKED_BOOT: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
                            [stream]\nmax_batch_rows = 1000\n";

/// Item 4 (28.82, the chunked direction): a chunked open checks the mode
/// lock, reads the key's extent and writes its plans row; a full open of the
/// same generation written meanwhile (a full run still reading) stops it
/// before its commit point, the `snapshot_open` facts row. The full open
/// then completes through the call the error names, and no chunked open was
/// ever recorded.
#[test]
fn a_chunked_open_stops_when_a_full_open_appears_after_its_check() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Scenario::new(20, CHUNKED_BOOT);
    let full_wf = s.path().join("items_full.toml");
    std::fs::write(&full_wf, std::fs::read_to_string(&s.wf_path).unwrap().replace("mode = \"chunked\"", "mode = \"full\"")).unwrap();
    // The chunked call sleeps after its plans row (after its check).
    let chunked = command(&s, &s.wf_path, &["snapshot"], &[("MSSQL_CDC_FAILPOINTS", "chunked.after_open_plans=sleep(4000)")]).spawn_output();
    let plans_log = s.path().join("bronze_snapshot_plans").join("_delta_log");
    let waited = std::time::Instant::now();
    while std::fs::read_dir(&plans_log).map(|d| d.count()).unwrap_or(0) < 2 {
        assert!(waited.elapsed() < Duration::from_secs(60), "the chunked call never wrote its plans row");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Meanwhile a full run opens generation 0 and is still reading (killed here).
    let out = command(&s, &full_wf, &["snapshot"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")]).output().unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", String::from_utf8_lossy(&out.stdout));
    let out = chunked.join().unwrap();
    let j = last_json(&out);
    assert_eq!(out.status.code(), Some(2), "the chunked run stops: {j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("full snapshot") && msg.contains("snapshot`"), "{msg}");
    let rows = facts(&rt, &s);
    let opens = events(&rows, "snapshot_open");
    assert_eq!(opens.len(), 1, "only the full open: {opens:?}");
    assert_eq!(opens[0].detail.as_ref().unwrap()["mode"], "full");

    // The full run finishes it; the stream then runs on that snapshot.
    let out = command(&s, &full_wf, &["snapshot"], &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let rows = facts(&rt, &s);
    assert_eq!(events(&rows, "bootstrap").len(), 1);
    assert!(!events(&rows, "snapshot_open").iter().any(|r| r.detail.as_ref().unwrap()["mode"] == "chunked"));
    assert_bronze_equals_table(&rt, &s);
}

/// Spawns a command and collects its output on a thread.
trait SpawnOutput {
    fn spawn_output(self) -> std::thread::JoinHandle<Output>;
}

impl SpawnOutput for Command {
    fn spawn_output(mut self) -> std::thread::JoinHandle<Output> {
        let child = self.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
        std::thread::spawn(move || child.wait_with_output().unwrap())
    }
}

/// A Parquet copy of the table as it is now, and the LSN recorded before it.
fn copy_now(rt: &tokio::runtime::Runtime, s: &Scenario, name: &str) -> (std::path::PathBuf, Lsn) {
    use mssql_cdc::source::CdcSource;
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

fn seed(s: &Scenario, copy: &std::path::Path, at: Lsn) -> (i32, serde_json::Value) {
    let hex = at.to_hex();
    step(s, &["seed", "--copy", copy.to_str().unwrap(), "--as-of", hex.as_str()], &[])
}

/// Silver's rows, every captured column, by id (read from the Delta table).
fn silver_rows(rt: &tokio::runtime::Runtime, s: &Scenario) -> BTreeMap<i64, Vec<String>> {
    let columns = common::items_spec(&s.table).columns;
    let location = s.path().join("silver").to_string_lossy().into_owned();
    let batches = rt.block_on(async {
        let t = mssql_cdc::delta::open_existing(&location, &Default::default()).await.unwrap().expect("silver exists");
        mssql_cdc::delta::query(&t, "SELECT * FROM t").await.unwrap()
    });
    let mut out = BTreeMap::new();
    for b in &batches {
        let cols: Vec<_> = columns.iter().map(|c| b.column_by_name(&c.name).unwrap_or_else(|| panic!("silver lacks {}", c.name)).clone()).collect();
        for i in 0..b.num_rows() {
            let values: Vec<SqlValue> = cols.iter().zip(&columns).map(|(a, c)| value_at(a.as_ref(), i, &c.sql_type)).collect();
            let id = values[0].as_i64().expect("an id");
            assert!(out.insert(id, values.iter().map(SqlValue::canonical).collect()).is_none(), "id {id} twice in silver");
        }
    }
    out
}

fn assert_same_rows(what: &str, got: &BTreeMap<i64, Vec<String>>, table: &BTreeMap<i64, Vec<String>>) {
    assert!(!table.is_empty());
    let ids: std::collections::BTreeSet<_> = table.keys().chain(got.keys()).collect();
    let diff: Vec<_> =
        ids.into_iter().filter(|k| table.get(k) != got.get(k)).map(|k| format!("{k}: table {:?} / {what} {:?}", table.get(k), got.get(k))).collect();
    assert!(diff.is_empty(), "{} ids differ: {:?}", diff.len(), &diff[..diff.len().min(5)]);
}

/// 28.117: the keys stored at the open cut every chunk; a backfill whose
/// configured keys differ refuses (exit 2, nothing written) and says which
/// keys to set back; with them set back the snapshot completes equal to the table.
#[test]
fn backfill_refuses_keys_other_than_the_ones_stored_at_the_open() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(30, CHUNKED_BOOT);
    ok(&s, &["stream"]);
    assert_eq!(ok(&s, &["backfill", "--max-waves", "1"])["done"], false);
    s.write_workflow(&CHUNKED_BOOT.replace("[stream]", "keys = [\"qty\"]\n[stream]"));
    let before = versions(&s);
    let plans_before = std::fs::read_dir(s.path().join("bronze_snapshot_plans").join("_delta_log")).unwrap().count();
    let (code, j) = step(&s, &["backfill"], &[]);
    assert_eq!(code, 2, "{j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("cut on (id)") && msg.contains("(qty)") && msg.contains("[\"id\"]"), "{msg}");
    assert_eq!(versions(&s), before, "nothing written");
    assert_eq!(std::fs::read_dir(s.path().join("bronze_snapshot_plans").join("_delta_log")).unwrap().count(), plans_before);
    s.write_workflow(CHUNKED_BOOT);
    s.changes(5);
    common::settle(&s.db);
    backfill_until_done(&s);
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(events(&rows, "bootstrap").len(), 1);
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

const FULL_RESNAPSHOT: &str =
    "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 2\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n";

/// 18.43: a full re-snapshot of generation 1 is killed while reading; a
/// chunked rerun of the recovery stops (exit 2, nothing written) instead of
/// opening beside it, and names the call that finishes it, which does.
#[test]
fn a_chunked_recovery_stops_beside_a_full_resnapshot_still_being_read() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(30, FULL_RESNAPSHOT);
    stream_until_caught_up(&s);
    s.changes(5);
    stream_until_caught_up(&s);
    pass_the_retention(&mut s, 4);
    let (code, j) = step(&s, &["stream"], &[("MSSQL_CDC_FAILPOINTS", "snapshot.after_open=return")]);
    assert_eq!(code, 75, "{j}");
    let full_s = events(&facts(&rt, &s), "snapshot_open").iter().find(|r| r.generation == 1).and_then(|r| r.min_lsn).unwrap();

    s.write_workflow(&FULL_RESNAPSHOT.replace("mode = \"full\"", "mode = \"chunked\"\nchunk_rows = 10\ntarget_wave_seconds = 0"));
    let before = versions(&s);
    let (code, j) = step(&s, &["stream", "--resnapshot-interval-days", "0"], &[]);
    assert_eq!(code, 2, "{j}");
    let msg = j["error"].as_str().unwrap();
    assert!(msg.contains("full snapshot") && msg.contains(&full_s.to_hex()) && msg.contains("stream`"), "{msg}");
    assert_eq!(versions(&s), before, "nothing written");
    assert!(!events(&facts(&rt, &s), "snapshot_open").iter().any(|r| r.detail.as_ref().unwrap()["mode"] == "chunked"));

    s.write_workflow(FULL_RESNAPSHOT);
    let j = ok(&s, &["stream", "--resnapshot-interval-days", "0"]);
    assert_eq!((j["generation"].as_i64(), j["recovery"]["mode"].as_str()), (Some(1), Some("full")), "{j}");
    stream_until_caught_up(&s);
    let rows = facts(&rt, &s);
    assert_eq!(events(&rows, "resnapshot").len(), 1);
    assert_batches_tile(&rows);
    assert_bronze_equals_table(&rt, &s);
}

/// 25.6: silver rebuilds from a seed as from any snapshot: the first apply
/// after a seed rebuilds from L, and silver then equals the table, every column.
#[test]
fn apply_rebuilds_silver_from_a_seed() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = Scenario::new(25, FULL_SILVER);
    s.changes(4);
    let (copy, at) = copy_now(&rt, &s, "copy");
    s.changes(6);
    common::settle(&s.db);
    let (code, j) = seed(&s, &copy, at);
    assert_eq!(code, 0, "{j}");
    stream_until_caught_up(&s);
    let j = ok(&s, &["apply"]);
    assert_eq!((j["action"].as_str(), j["snapshot_lsn"].as_str()), (Some("rebuild"), Some(at.to_hex().as_str())), "{j}");
    assert_same_rows("silver", &silver_rows(&rt, &s), &table_rows(&s));
    s.changes(7);
    common::settle(&s.db);
    stream_until_caught_up(&s);
    ok(&s, &["apply"]);
    assert_same_rows("silver", &silver_rows(&rt, &s), &table_rows(&s));
    assert_batches_tile(&facts(&rt, &s));
}

/// 25.37: seed's rerun and refusal checks count whole snapshots only. A
/// chunked snapshot at S with some chunks in bronze is no seed at S: `seed
/// --as-of S` is refused as an open snapshot (exit 2, nothing written), not
/// answered as already seeded.
#[test]
fn chunk_rows_are_not_taken_for_a_seed() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = Scenario::new(30, CHUNKED_BOOT);
    ok(&s, &["stream"]);
    assert_eq!(ok(&s, &["backfill", "--max-waves", "1"])["done"], false);
    let open_s = events(&facts(&rt, &s), "snapshot_open")[0].min_lsn.unwrap();
    assert!(rt.block_on(s.count("bronze", &format!("_snapshot = '{}' AND _chunk IS NOT NULL", open_s.to_hex()))) > 0);
    let (copy, _) = copy_now(&rt, &s, "copy");
    let before = versions(&s);
    let (code, j) = seed(&s, &copy, open_s);
    assert_eq!(code, 2, "{j}");
    assert!(j["error"].as_str().unwrap().contains("chunked snapshot"), "{j}");
    assert_eq!(versions(&s), before, "nothing written");
}
