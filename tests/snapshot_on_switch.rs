//! `snapshot.snapshot_on_switch` (adr-0028 Amendment 5), through the CLI
//! binary against the simulator: a column is added and a second capture
//! instance captures it while the chunked bootstrap is still being read.
//! Rows whose new column was set before the new instance started are in no
//! change row that carries it, so only the snapshot the switch opens can
//! bring their values to bronze and silver.
//!
//! The expected values come from the simulator's own rows (`SimDb`, read in
//! a transaction), and bronze's latest image is ranked here, in the test,
//! from bronze's raw rows: neither side goes through the engine's rebuild.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use deltalake::arrow::array::{Array, StringArray};
use deltalake::arrow::datatypes::DataType;
use deltalake::arrow::record_batch::RecordBatch;
use mssql_cdc::delta;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};
use serde_json::Value;

const APP: &str = "items";
const NEW_INSTANCE: &str = "dbo_items_v2";
const ROWS: i64 = 60;

/// One row's values as text (None for NULL), in the table's column order.
type Image = Vec<Option<String>>;

struct Setup {
    dir: tempfile::TempDir,
    db: SimDb,
    table: TableName,
    wf_path: PathBuf,
}

fn row(id: i64, qty: i64) -> Vec<SqlValue> {
    vec![SqlValue::Int(id), if id % 7 == 0 { SqlValue::Null } else { SqlValue::Str(format!("item {id}")) }, SqlValue::Int(qty)]
}

fn row_with_note(id: i64, qty: i64, note: Option<&str>) -> Vec<SqlValue> {
    let mut r = row(id, qty);
    r.push(note.map_or(SqlValue::Null, |n| SqlValue::Str(n.into())));
    r
}

const WORKFLOW: &str = "app_id = \"items\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"items\"\n\
     [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
     [snapshot]\nbootstrap = true\nmode = \"chunked\"\nsnapshot_on_switch = true\nparallelism = 2\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
     [stream]\nmax_batch_rows = 1000\n";

fn setup(workflow: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let db = SimDb::create(&dir.path().join("source.sqlite"), common::manual_config()).unwrap();
    let table = TableName::new("dbo", "items");
    let spec = TableSpec { collations: Default::default(),
        name: table.clone(),
        columns: vec![
            ColumnDesc::new("id", SqlType::Int, false),
            ColumnDesc::new("name", SqlType::NVarChar { len: Some(40) }, true),
            ColumnDesc::new("qty", SqlType::Int, true),
        ],
        primary_key: vec!["id".into()],
        unique_index: vec![],
    };
    db.create_table(&spec).unwrap();
    db.load_rows(&table, (1..=ROWS).map(|i| row(i, i * 10))).unwrap();
    db.enable_cdc(&table, None, None).unwrap();
    db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&db);
    let wf_path = dir.path().join("items.toml");
    std::fs::write(&wf_path, workflow).unwrap();
    Setup { dir, db, table, wf_path }
}

impl Setup {
    /// Runs a step of the binary, with failpoints armed when given:
    /// (exit code, the last stdout line as JSON, stderr).
    fn run_with(&self, args: &[&str], failpoints: Option<&str>) -> (i32, Value, String) {
        let mut c = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"));
        c.arg("--workflow").arg(&self.wf_path).args(args).env("MSSQL_CDC_LOG", "warn");
        if let Some(fp) = failpoints {
            c.env("MSSQL_CDC_FAILPOINTS", fp);
        }
        let out = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let last = stdout.lines().last().unwrap_or("null");
        let json = serde_json::from_str(last).unwrap_or_else(|e| panic!("{args:?}: the last line is not JSON ({e}): {last}\nstderr: {stderr}"));
        (out.status.code().unwrap_or(-1), json, stderr)
    }

    fn run(&self, args: &[&str]) -> (i32, Value) {
        let (code, json, _) = self.run_with(args, None);
        (code, json)
    }

    fn ok(&self, args: &[&str]) -> Value {
        let (code, json) = self.run(args);
        assert_eq!(code, 0, "{args:?} exited {code}: {json}");
        json
    }

    fn write(&self, f: impl FnOnce(&mut mssql_cdc::sim::db::SimTx<'_>) -> mssql_cdc::sim::db::Result<()>) {
        self.db.transaction(f).unwrap();
        common::settle(&self.db);
    }

    /// The simulator's table, read with its own API: key -> every column as text.
    fn source_rows(&self) -> (Vec<String>, BTreeMap<i64, Image>) {
        let spec = self.db.table_spec(&self.table).unwrap();
        let names: Vec<String> = spec.columns.iter().map(|c| c.name.clone()).collect();
        let keys = self.db.keys(&self.table).unwrap();
        let mut rows = BTreeMap::new();
        let table = self.table.clone();
        self.db
            .transaction(|tx| {
                for k in &keys {
                    let r = tx.get(&table, k)?.expect("a listed key has a row");
                    rows.insert(k[0].as_i64().unwrap(), r.iter().map(sql_text).collect::<Image>());
                }
                Ok(())
            })
            .unwrap();
        (names, rows)
    }

    fn location(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_string()
    }

    /// The new capture instance's start LSN, as the simulator lists it.
    fn new_instance_start(&self) -> Lsn {
        let instances = self.db.capture_instances(&self.table).unwrap();
        instances.iter().find(|i| i.name == NEW_INSTANCE).and_then(|i| i.start_lsn).expect("the new instance has a start LSN")
    }
}

fn sql_text(v: &SqlValue) -> Option<String> {
    match v {
        SqlValue::Null => None,
        SqlValue::Int(i) => Some(i.to_string()),
        SqlValue::Str(s) => Some(s.clone()),
        other => panic!("the test's table holds only int and nvarchar columns, not {other:?}"),
    }
}

fn text_column(b: &RecordBatch, name: &str) -> Vec<Option<String>> {
    let i = b.schema().index_of(name).unwrap_or_else(|_| panic!("no column '{name}' in {:?}", b.schema()));
    let a = deltalake::arrow::compute::cast(b.column(i), &DataType::Utf8).unwrap();
    let a = a.as_any().downcast_ref::<StringArray>().unwrap();
    (0..a.len()).map(|r| if a.is_null(r) { None } else { Some(a.value(r).to_string()) }).collect()
}

async fn open_table(location: &str) -> deltalake::DeltaTable {
    delta::open_existing(location, &Default::default()).await.unwrap().unwrap_or_else(|| panic!("no Delta table at {location}"))
}

async fn read_table(location: &str, sql: &str) -> Vec<RecordBatch> {
    delta::query(&open_table(location).await, sql).await.unwrap()
}

/// Bronze's latest image per key, ranked by (`_start_lsn`, `_command_id`,
/// `_seqval`, `_operation`) with NULL lowest; a key whose latest row is a
/// delete (1) or a before-image (3) is absent.
async fn bronze_latest(location: &str, columns: &[String]) -> BTreeMap<i64, Image> {
    let cols = columns.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ");
    let sql = format!("SELECT {cols}, _start_lsn, _command_id, _seqval, _operation FROM t");
    type Rank = (Option<String>, Option<i64>, Option<String>, i64);
    let mut latest: BTreeMap<i64, (Rank, Image)> = BTreeMap::new();
    for b in read_table(location, &sql).await {
        let values: Vec<Vec<Option<String>>> = columns.iter().map(|c| text_column(&b, c)).collect();
        let (lsn, cmd, seq, op) = (text_column(&b, "_start_lsn"), text_column(&b, "_command_id"), text_column(&b, "_seqval"), text_column(&b, "_operation"));
        for r in 0..b.num_rows() {
            let id: i64 = values[0][r].as_ref().expect("id is never NULL").parse().unwrap();
            let rank: Rank = (lsn[r].clone(), cmd[r].as_ref().map(|c| c.parse().unwrap()), seq[r].clone(), op[r].as_ref().unwrap().parse().unwrap());
            let image: Image = values.iter().map(|v| v[r].clone()).collect();
            match latest.get(&id) {
                Some((best, _)) if *best >= rank => {}
                _ => {
                    latest.insert(id, (rank, image));
                }
            }
        }
    }
    latest.into_iter().filter(|(_, (rank, _))| rank.3 != 1 && rank.3 != 3).map(|(id, (_, image))| (id, image)).collect()
}

async fn silver_rows(location: &str, columns: &[String]) -> BTreeMap<i64, Image> {
    let cols = columns.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ");
    let mut out = BTreeMap::new();
    for b in read_table(location, &format!("SELECT {cols} FROM t")).await {
        let values: Vec<Vec<Option<String>>> = columns.iter().map(|c| text_column(&b, c)).collect();
        for r in 0..b.num_rows() {
            let id: i64 = values[0][r].as_ref().unwrap().parse().unwrap();
            let prior = out.insert(id, values.iter().map(|v| v[r].clone()).collect::<Image>());
            assert!(prior.is_none(), "silver holds key {id} twice");
        }
    }
    out
}

fn assert_same(what: &str, columns: &[String], expected: &BTreeMap<i64, Image>, got: &BTreeMap<i64, Image>) {
    let mut wrong = Vec::new();
    for id in expected.keys().chain(got.keys()).collect::<std::collections::BTreeSet<_>>() {
        match (expected.get(id), got.get(id)) {
            (Some(e), Some(g)) if e == g => {}
            (e, g) => wrong.push(format!("id {id}: table {e:?}, {what} {g:?}")),
        }
    }
    assert!(wrong.is_empty(), "{what} differs from the table (columns {columns:?}) on {} keys:\n{}", wrong.len(), wrong.join("\n"));
}

/// A facts row as the test reads it.
#[derive(Debug, Clone)]
struct Fact {
    generation: i64,
    event: Option<String>,
    batch_id: Option<i64>,
    min_lsn: Option<Lsn>,
    max_lsn: Option<Lsn>,
    detail: Option<Value>,
}

async fn facts(location: &str) -> Vec<Fact> {
    let sql = format!("SELECT generation, event, batch_id, min_lsn, max_lsn, detail FROM t WHERE app_id = '{APP}'");
    let mut out = Vec::new();
    for b in read_table(location, &sql).await {
        let cols: Vec<Vec<Option<String>>> = ["generation", "event", "batch_id", "min_lsn", "max_lsn", "detail"].iter().map(|c| text_column(&b, c)).collect();
        for r in 0..b.num_rows() {
            out.push(Fact {
                generation: cols[0][r].as_ref().unwrap().parse().unwrap(),
                event: cols[1][r].clone(),
                batch_id: cols[2][r].as_ref().map(|v| v.parse().unwrap()),
                min_lsn: cols[3][r].as_deref().map(|v| Lsn::parse(v).unwrap()),
                max_lsn: cols[4][r].as_deref().map(|v| Lsn::parse(v).unwrap()),
                detail: cols[5][r].as_deref().map(|v| serde_json::from_str(v).unwrap()),
            });
        }
    }
    out
}

/// Where a crash is injected: the failpoint, and the step whose call arms it
/// (`stream` only on the call whose next batch switches, `backfill` on every
/// call until it fires once).
#[derive(Clone, Copy)]
struct Crash {
    failpoint: &'static str,
    step: &'static str,
}

/// What the scenario observed, for the assertions after it.
struct Outcome {
    new_start: Lsn,
    /// The stream call's JSON that opened the switch's snapshot.
    opened_by: Value,
    /// Stream position before and after the call that switched and opened.
    position_before_open: Lsn,
    fired: bool,
}

/// The scenario: a chunked bootstrap read one wave and applied; then the
/// DBA adds `note`, sets it on rows while only the old instance captures
/// (their values are in no change row that carries `note`), enables a second
/// instance that captures it and sets it on more rows. The stream switches
/// and opens the switch's snapshot; backfill reads it to the end beside more
/// changes; apply and reconcile. `crash` fires once, then the step is rerun.
fn scenario(s: &Setup, crash: Option<Crash>) -> Outcome {
    let table = s.table.clone();
    let mut fired = false;
    // A step, with the crash armed when `arm` says so; a crashed call is run again unarmed.
    let mut step = |args: &[&str], arm: bool| -> Value {
        if let Some(c) = crash.filter(|c| arm && !fired && c.step == args[0]) {
            let (code, json, stderr) = s.run_with(args, Some(&format!("{}=return", c.failpoint)));
            if code != 0 {
                assert!(stderr.contains(c.failpoint) || json.to_string().contains(c.failpoint), "{args:?} failed, but not at {}: {json}", c.failpoint);
                fired = true;
                return s.ok(args);
            }
            return json;
        }
        s.ok(args)
    };

    let r = step(&["stream"], false);
    assert_eq!(r["bootstrap"]["opened_now"], true, "{r}");
    s.write(|tx| {
        tx.update(&table, &vec![SqlValue::Int(2)], row(2, 21))?;
        tx.insert(&table, row(61, 610))
    });
    step(&["stream"], false);
    let b = step(&["backfill", "--max-waves", "1"], false);
    assert_eq!(b["done"], false, "the bootstrap is still open when the instance switches: {b}");
    step(&["apply"], false);

    s.db.add_column(&table, ColumnDesc::new("note", SqlType::NVarChar { len: Some(20) }, true)).unwrap();
    // Set while only the old instance captures: no change row carries these notes.
    s.write(|tx| {
        tx.update(&table, &vec![SqlValue::Int(5)], row_with_note(5, 51, Some("pre5")))?;
        tx.update(&table, &vec![SqlValue::Int(33)], row_with_note(33, 331, Some("pre33")))
    });
    s.db.enable_cdc(&table, Some(NEW_INSTANCE), None).unwrap();
    s.write(|tx| {
        tx.update(&table, &vec![SqlValue::Int(3)], row_with_note(3, 31, Some("n3")))?;
        tx.update(&table, &vec![SqlValue::Int(35)], row_with_note(35, 351, Some("n35")))?;
        tx.insert(&table, row_with_note(62, 620, Some("n62")))
    });
    let new_start = s.new_instance_start();

    // One batch a call, so the call whose batch switches is known: the one
    // whose position is right below the new instance's start.
    let mut opened_by = None;
    let mut position_before_open = None;
    for _ in 0..10 {
        let pos = Lsn::parse(s.ok(&["status"])["position"].as_str().unwrap()).unwrap();
        let switching = pos.increment() >= new_start;
        let arm = match crash.map(|c| c.failpoint) {
            Some("stream.after_facts") => switching,
            _ => true,
        };
        let r = step(&["stream", "--max-batches", "1"], arm);
        if switching {
            position_before_open = Some(pos);
            opened_by = Some(r);
            break;
        }
    }
    let opened_by = opened_by.expect("the stream reached the new instance's start");
    s.write(|tx| {
        tx.update(&table, &vec![SqlValue::Int(55)], row_with_note(55, 551, Some("n55")))?;
        tx.update(&table, &vec![SqlValue::Int(40)], row_with_note(40, 401, None))?;
        tx.delete(&table, &vec![SqlValue::Int(45)])
    });
    step(&["stream"], true);
    let mut calls = 0;
    loop {
        let b = step(&["backfill", "--max-waves", "1"], true);
        calls += 1;
        if b["done"] == true {
            break;
        }
        assert!(calls < 20, "backfill never finished: {b}");
        s.write(|tx| tx.update(&table, &vec![SqlValue::Int(58)], row_with_note(58, 580 + calls, Some("n58"))));
        step(&["stream"], true);
        if calls == 2 {
            // Silver takes the switch snapshot's waves while it is open.
            step(&["apply"], true);
        }
    }
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    step(&["stream"], true);
    Outcome { new_start, opened_by, position_before_open: position_before_open.unwrap(), fired }
}

/// Everything the scenario must end with: bronze's latest image and silver
/// equal to the table on every column, reconcile clean with no difference,
/// facts batches contiguous, one open and one completion for the switch's
/// snapshot under the S-keyed txns, the stream's position never moved by it.
fn check(s: &Setup, o: &Outcome, what: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    for _ in 0..10 {
        if s.ok(&["apply"])["action"] == "nothing" {
            break;
        }
    }
    let (code, rec) = s.run(&["reconcile"]);

    let (columns, expected) = s.source_rows();
    assert_eq!(columns, ["id", "name", "qty", "note"], "the simulator's table has the added column");
    for id in [5, 33] {
        assert!(expected[&id][3].is_some(), "{what}: the scenario's premise: {id} has a note set before the new instance");
    }
    let bronze = rt.block_on(bronze_latest(&s.location("bronze"), &columns));
    assert_same(&format!("{what}: bronze's latest image"), &columns, &expected, &bronze);
    let silver = rt.block_on(silver_rows(&s.location("silver"), &columns));
    assert_same(&format!("{what}: silver"), &columns, &expected, &silver);
    assert_eq!(code, 0, "{what}: reconcile: {rec}");
    assert_eq!(rec["clean"], true, "{what}: {rec}");
    assert_eq!(rec["differences"], 0, "{what}: {rec}");
    assert_eq!(rec["chunk_snapshot"], o.new_start.to_hex(), "{what}: reconcile checks the switch snapshot's chunks: {rec}");

    let f = rt.block_on(facts(&s.location("facts")));
    // Batches contiguous: each reads from right after the one before, the first right after the bootstrap's S.
    let mut batches: Vec<&Fact> = f.iter().filter(|r| r.event.is_none()).collect();
    batches.sort_by_key(|r| r.batch_id);
    assert!(batches.iter().all(|b| b.generation == 0), "{what}: one generation");
    let ids: Vec<i64> = batches.iter().map(|b| b.batch_id.unwrap()).collect();
    assert_eq!(ids, (0..ids.len() as i64).collect::<Vec<_>>(), "{what}: one facts row per batch id, none missing");
    let opens: Vec<&Fact> = f.iter().filter(|r| r.event.as_deref() == Some("snapshot_open")).collect();
    let bootstrap_s = opens.iter().filter_map(|r| r.min_lsn).min().unwrap();
    let mut expected_from = bootstrap_s.increment();
    for b in &batches {
        assert_eq!(b.min_lsn, Some(expected_from), "{what}: batch {:?} does not start right after the one before", b.batch_id);
        expected_from = b.max_lsn.unwrap().increment();
    }

    // The switch's open: at the new instance's start, recording its switch batch.
    assert_eq!(opens.len(), 2, "{what}: the bootstrap's open and the switch's, once each: {opens:?}");
    let switch_open = opens.iter().find(|r| r.min_lsn == Some(o.new_start)).unwrap_or_else(|| panic!("{what}: no open at {}: {opens:?}", o.new_start));
    let switched: Vec<&Fact> = f.iter().filter(|r| r.event.as_deref() == Some("capture_instance_switched")).collect();
    assert_eq!(switched.len(), 1, "{what}: {switched:?}");
    let switch_batch = switched[0].batch_id.unwrap();
    let detail = switch_open.detail.as_ref().unwrap();
    assert_eq!(detail["switch_batch_id"], switch_batch, "{what}: {detail}");
    assert_eq!(detail["mode"], "chunked", "{what}: {detail}");
    // Completed once, by a bootstrap row at its S; the bootstrap's own S never completed (superseded).
    let completions: Vec<&Fact> = f.iter().filter(|r| matches!(r.event.as_deref(), Some("bootstrap") | Some("resnapshot"))).collect();
    assert_eq!(completions.len(), 1, "{what}: {completions:?}");
    assert_eq!((completions[0].event.as_deref(), completions[0].max_lsn), (Some("bootstrap"), Some(o.new_start)), "{what}");
    // Its Delta txns are keyed by S, at the switch batch's id.
    rt.block_on(async {
        let facts_table = open_table(&s.location("facts")).await;
        let hex = o.new_start.to_hex();
        assert_eq!(delta::txn_version(&facts_table, &format!("{APP}#snapopen.{hex}")).await.unwrap(), Some(switch_batch), "{what}");
        assert_eq!(delta::txn_version(&facts_table, &format!("{APP}#snapdone.{hex}")).await.unwrap(), Some(switch_batch), "{what}");
        assert_eq!(delta::txn_version(&facts_table, &format!("{APP}#events")).await.unwrap(), None, "{what}: the generation's key stays free");
        let plans = open_table(&format!("{}_snapshot_plans", s.location("bronze"))).await;
        assert_eq!(delta::txn_version(&plans, &format!("{APP}#snapopen.{hex}")).await.unwrap(), Some(0), "{what}");
    });
    // The open never moved the stream's position (adr-0028 Amendment 2):
    // the switching call ended at its batch's end, above S.
    let switch_row = batches.iter().find(|b| b.batch_id == Some(switch_batch)).unwrap();
    assert_eq!(switch_row.min_lsn, Some(o.position_before_open.increment()), "{what}");
    assert!(o.new_start <= switch_row.max_lsn.unwrap(), "{what}: the stream read past S");
    if let Some(r) = o.opened_by.get("position").and_then(Value::as_str) {
        assert_eq!(Lsn::parse(r).ok(), switch_row.max_lsn, "{what}: the call that opened it ended at its batch: {}", o.opened_by);
    }
}

/// A full bootstrap whose call crashed between its bronze commit and its
/// completion row; before the rerun the DBA adds a column and enables a
/// second capture instance (its start is after the snapshot's S, and the
/// older instance holds the changes in between). The rerun writes the
/// completion on the instance the snapshot was read on, so the stream reads
/// the older instance up to the newer one's start and switches there.
/// Found by the torture soak (seed 110002687): the completion named the
/// newest instance, whose min LSN the stream then read as a purge, exiting
/// 3 for a loss that never happened (with `skip`, skipping those changes).
#[test]
fn a_full_snapshot_completed_after_a_newer_instance_appeared_streams_on_from_the_instance_it_was_read_on() {
    const FULL: &str = "app_id = \"items\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"items\"\n\
         [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
         [snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\n";
    let s = setup(FULL);
    let table = s.table.clone();
    let (code, json, stderr) = s.run_with(&["stream"], Some("snapshot.after_bronze=return"));
    assert_ne!(code, 0, "the crash is armed: {json}");
    assert!(stderr.contains("snapshot.after_bronze") || json.to_string().contains("snapshot.after_bronze"), "{json}\n{stderr}");
    // Changes only the older instance captures, then the column and the newer instance, then changes both capture.
    s.write(|tx| {
        tx.update(&table, &vec![SqlValue::Int(2)], row(2, 21))?;
        tx.delete(&table, &vec![SqlValue::Int(9)])?;
        tx.insert(&table, row(61, 610))
    });
    s.db.add_column(&table, ColumnDesc::new("note", SqlType::NVarChar { len: Some(20) }, true)).unwrap();
    s.write(|tx| tx.update(&table, &vec![SqlValue::Int(4)], row_with_note(4, 41, None)));
    s.db.enable_cdc(&table, Some(NEW_INSTANCE), None).unwrap();
    s.write(|tx| {
        tx.update(&table, &vec![SqlValue::Int(3)], row_with_note(3, 31, Some("n3")))?;
        tx.insert(&table, row_with_note(62, 620, Some("n62")))
    });
    let new_start = s.new_instance_start();

    let (code, r) = s.run(&["stream"]);
    assert_eq!(code, 0, "the rerun completes the snapshot and streams on, no loss: {r}");
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.ok(&["stream"]);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let f = rt.block_on(facts(&s.location("facts")));
    let boot: Vec<&Fact> = f.iter().filter(|r| r.event.as_deref() == Some("bootstrap")).collect();
    assert_eq!(boot.len(), 1, "{f:?}");
    let snapshot_s = boot[0].max_lsn.unwrap();
    assert!(snapshot_s.increment() < new_start, "the premise: the newer instance starts after S: {snapshot_s} {new_start}");
    let mut batches: Vec<&Fact> = f.iter().filter(|r| r.event.is_none()).collect();
    batches.sort_by_key(|r| r.batch_id);
    let mut expected_from = snapshot_s.increment();
    for b in &batches {
        assert_eq!(b.min_lsn, Some(expected_from), "batch {:?} does not start right after the one before: {batches:?}", b.batch_id);
        expected_from = b.max_lsn.unwrap().increment();
    }
    assert_eq!(f.iter().filter(|r| r.event.as_deref() == Some("capture_instance_switched")).count(), 1, "{f:?}");
    assert!(!f.iter().any(|r| matches!(r.event.as_deref(), Some("recovery") | Some("data_skipped"))), "{f:?}");

    let (columns, expected) = s.source_rows();
    let bronze = rt.block_on(bronze_latest(&s.location("bronze"), &columns));
    assert_same("bronze's latest image", &columns, &expected, &bronze);
    for _ in 0..10 {
        if s.ok(&["apply"])["action"] == "nothing" {
            break;
        }
    }
    let silver = rt.block_on(silver_rows(&s.location("silver"), &columns));
    assert_same("silver", &columns, &expected, &silver);
    let (code, rec) = s.run(&["reconcile"]);
    assert_eq!((code, rec["clean"].clone(), rec["differences"].clone()), (0, Value::Bool(true), Value::from(0)), "{rec}");
}

#[test]
fn a_switch_opens_a_chunked_snapshot_at_the_new_instances_start_that_brings_every_column() {
    let s = setup(WORKFLOW);
    let o = scenario(&s, None);
    check(&s, &o, "no crash");
    let opened = &o.opened_by["snapshots_on_switch"];
    assert_eq!(opened.as_array().map(Vec::len), Some(1), "the switching call opened one snapshot: {}", o.opened_by);
    assert_eq!(opened[0]["snapshot_lsn"], o.new_start.to_hex(), "{}", o.opened_by);
    assert_eq!(opened[0]["opened_now"], true, "{}", o.opened_by);
}

#[test]
fn a_crash_at_each_commit_boundary_of_the_switch_snapshot_reruns_to_the_same_result() {
    let crashes = [
        Crash { failpoint: "stream.after_facts", step: "stream" },
        Crash { failpoint: "switch.after_open_plans", step: "stream" },
        Crash { failpoint: "switch.after_open", step: "stream" },
        Crash { failpoint: "chunked.after_complete", step: "backfill" },
    ];
    for c in crashes {
        let s = setup(WORKFLOW);
        let o = scenario(&s, Some(c));
        assert!(o.fired, "{} never fired: the drill did not test it", c.failpoint);
        check(&s, &o, c.failpoint);
    }
    // Every failpoint the open adds is drilled here.
    for fp in mssql_cdc::engine::FAILPOINTS.iter().filter(|f| f.starts_with("switch.")) {
        assert!(crashes.iter().any(|c| c.failpoint == *fp), "{fp} is not drilled");
    }
}

#[test]
fn snapshot_on_switch_is_refused_unless_chunked_and_following_instances() {
    let full = WORKFLOW.replace("mode = \"chunked\"", "mode = \"full\"");
    let pinned = WORKFLOW.replace("name = \"items\"\n", "name = \"items\"\ncapture_instance = \"dbo_items\"\n");
    for (wf, names) in [(full, ["snapshot_on_switch", "mode = \"chunked\""]), (pinned, ["snapshot_on_switch", "capture_instance"])] {
        let s = setup(&wf);
        for step in ["stream", "backfill", "status"] {
            let (code, j) = s.run(&[step]);
            assert_eq!(code, 2, "{step}: {j}");
            let msg = j["error"].as_str().unwrap_or_default();
            for n in names {
                assert!(msg.contains(n), "{step}: the error names {n}: {msg}");
            }
        }
        for t in ["bronze", "facts", "silver"] {
            assert!(!s.dir.path().join(t).exists(), "{t} was written before the refusal");
        }
    }
}

/// The golden transition log of a switch's snapshot: the batch that switches
/// (bronze gains `note`), the open under its S-keyed txns right after it, the
/// plan and waves, the completion under `#snapdone.<S>`, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_snapshot_opened_by_a_switch() {
    use mssql_cdc::delta::plans;
    use mssql_cdc::engine::chunked::{self, BackfillArgs};
    let _fp = fail::FailScenario::setup();
    let s = common::Scenario::new(
        20,
        "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nsnapshot_on_switch = true\nparallelism = 1\nchunk_rows = 10\ntarget_wave_seconds = 0\n\
         [stream]\nmax_batch_rows = 1000\n",
    );
    let scenario = &s;
    let backfill_to_done = || async move {
        for _ in 0..10 {
            let mut ctx = scenario.context().await.unwrap();
            if chunked::backfill(&mut ctx, &BackfillArgs::default()).await.unwrap().done {
                return;
            }
        }
        panic!("backfill never finished");
    };
    s.stream().await.unwrap();
    backfill_to_done().await;
    s.db.add_column(&s.table, ColumnDesc::new("note", SqlType::NVarChar { len: Some(20) }, true)).unwrap();
    s.db.enable_cdc(&s.table, Some(NEW_INSTANCE), None).unwrap();
    let table = s.table.clone();
    s.db.transaction(|tx| {
        let mut r = common::item_row(21, 0);
        r.push(SqlValue::Str("n21".into()));
        tx.insert(&table, r)
    })
    .unwrap();
    common::settle(&s.db);
    let r = s.stream().await.unwrap();
    assert_eq!(r.snapshots_on_switch.len(), 1, "{r:?}");
    backfill_to_done().await;
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    let mut log = s.golden().await;
    let ctx = s.context().await.unwrap();
    let plans_table = delta::open_existing(&plans::location_for(&ctx.workflow.target.bronze), &Default::default()).await.unwrap().unwrap();
    log.push('\n');
    log.push_str(&delta::golden::render(&plans_table, "plans").await.unwrap().join("\n"));
    // The switch's event rows ride in the batch's bronze metadata whole: their
    // wall-clock `recorded_at` and the temporary target path vary per run.
    let log = stable(&log.replace(s.path().to_str().unwrap(), "<dir>"), "\"recorded_at\":\"");
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_snapshot_opened_by_a_switch", log));
}

/// `text` with every quoted value after `key` replaced by `<varies>`.
fn stable(text: &str, key: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(key) {
        out.push_str(&rest[..i + key.len()]);
        rest = &rest[i + key.len()..];
        let end = rest.find('"').unwrap_or(rest.len());
        out.push_str("<varies>");
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// bronze's rows of whole snapshots (a seed's or a full snapshot's), counted.
async fn whole_snapshot_rows(location: &str) -> usize {
    read_table(location, "SELECT _start_lsn FROM t WHERE _operation = 0 AND _chunk IS NULL").await.iter().map(RecordBatch::num_rows).sum()
}

/// A seed completes generation 0; the stream then switches capture
/// instances and the chunked snapshot the switch opens is read to its end.
/// Its completion is a second `bootstrap` row of generation 0 (under its
/// own S-keyed txn), beside the seed's. A later call of the same seed must
/// find itself done and leave its rows. A rerun that took the switch
/// snapshot's completion for another step's start of the generation would
/// remove the seed's rows from bronze and still answer "already seeded"
/// (the review of the fix for soak schedule 150012436 found that window).
#[test]
fn a_seed_called_again_after_a_switch_snapshot_completed_in_its_generation_keeps_its_rows() {
    let s = setup(WORKFLOW);
    let table = s.table.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let recorded = s.db.max_lsn().unwrap().unwrap();
    let copy = s.dir.path().join("copy");
    rt.block_on(async {
        let source = s.db.source().unwrap();
        let ci = mssql_cdc::source::CdcSource::capture_instances(&source, &table).await.unwrap().pop().unwrap();
        mssql_cdc::seed_copy::export_parquet(&source, &table, &ci.columns, &copy, 1000).await.unwrap();
    });
    let (copy_text, as_of) = (copy.to_str().unwrap().to_string(), recorded.to_hex());
    let seed_args = ["seed", "--copy", copy_text.as_str(), "--as-of", as_of.as_str()];
    let seeded = s.ok(&seed_args);
    assert_eq!(seeded["already_seeded"], false, "{seeded}");
    let seed_rows = rt.block_on(whole_snapshot_rows(&s.location("bronze")));
    assert_eq!(seed_rows as i64, ROWS, "the copy's rows are bronze's snapshot");

    s.write(|tx| tx.update(&table, &vec![SqlValue::Int(2)], row(2, 21)));
    s.ok(&["stream"]);
    s.db.add_column(&table, ColumnDesc::new("note", SqlType::NVarChar { len: Some(20) }, true)).unwrap();
    s.write(|tx| tx.update(&table, &vec![SqlValue::Int(5)], row_with_note(5, 51, Some("pre5"))));
    s.db.enable_cdc(&table, Some(NEW_INSTANCE), None).unwrap();
    s.write(|tx| tx.insert(&table, row_with_note(62, 620, Some("n62"))));
    let mut opened = false;
    for _ in 0..10 {
        let r = s.ok(&["stream"]);
        opened |= r["snapshots_on_switch"].as_array().is_some_and(|a| !a.is_empty());
        if opened {
            break;
        }
    }
    assert!(opened, "the stream switched and opened the switch's snapshot");
    for calls in 0.. {
        assert!(calls < 20, "backfill never finished");
        if s.ok(&["backfill", "--max-waves", "1"])["done"] == true {
            break;
        }
    }
    s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
    common::settle(&s.db);
    s.ok(&["stream"]);
    let f = rt.block_on(facts(&s.location("facts")));
    let completions: Vec<&Fact> = f.iter().filter(|r| r.event.as_deref() == Some("bootstrap") && r.generation == 0).collect();
    assert_eq!(completions.len(), 2, "the premise: the seed's and the switch snapshot's completions, both generation 0: {f:?}");

    let again = s.ok(&seed_args);
    assert_eq!(again["already_seeded"], true, "{again}");
    assert_eq!(rt.block_on(whole_snapshot_rows(&s.location("bronze"))), seed_rows, "the seed's rows are still in bronze");
    let (columns, expected) = s.source_rows();
    let bronze = rt.block_on(bronze_latest(&s.location("bronze"), &columns));
    assert_same("bronze's latest image", &columns, &expected, &bronze);
}
