//! Silver of a heap (a table without any unique index), end to end through
//! the CLI binary.
//!
//! The table repeats values and holds fully identical rows; a chunked
//! snapshot is cut on a repeated, nullable column; a writer inserts rows
//! (copies of existing ones too), updates them (to new values, to the same
//! values, and across chunks by changing the cut column) and deletes one
//! occurrence of a row at a time, between `stream`, `backfill` and `apply`
//! calls. After each apply once the snapshot is complete, silver read as a
//! multiset (each distinct row `_count` times) must be the simulator's
//! table: every column, every row. `reconcile` must be clean. And a heap
//! streamed without before-images (`stream.row_filter = "all"`) is refused.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use deltalake::arrow::array::{Array, Int64Array};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::arrow::util::display::array_value_to_string;
use futures::StreamExt;
use mssql_cdc::delta;
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::{CdcSource, Isolation, KeyRange, SnapshotRead, TableName};
use mssql_cdc::types::{value_at, ColumnDesc, SqlType, SqlValue};

fn columns() -> Vec<ColumnDesc> {
    vec![
        ColumnDesc::new("grp", SqlType::Int, true),
        ColumnDesc::new("tag", SqlType::NVarChar { len: Some(20) }, true),
        ColumnDesc::new("amount", SqlType::Decimal { precision: 10, scale: 2 }, true),
    ]
}

fn heap_row(grp: Option<i64>, tag: &str, amount: i64) -> Vec<SqlValue> {
    vec![grp.map(SqlValue::Int).unwrap_or(SqlValue::Null), SqlValue::Str(tag.into()), SqlValue::Decimal { value: amount as i128, scale: 2 }]
}

struct Heap {
    _dir: tempfile::TempDir,
    db: SimDb,
    table: TableName,
    wf_path: PathBuf,
    silver: String,
    rng: u64,
}

impl Heap {
    /// A heap of `rows` rows: `grp` repeats (NULL now and then) and whole rows repeat.
    fn new(rows: i64, snapshot_toml: &str, row_filter: &str) -> Heap {
        let dir = tempfile::tempdir().unwrap();
        let db = SimDb::create(&dir.path().join("source.sqlite"), common::manual_config()).unwrap();
        let table = TableName::new("dbo", "events");
        db.create_table(&TableSpec { collations: Default::default(), name: table.clone(), columns: columns(), primary_key: vec![], unique_index: vec![] }).unwrap();
        let rows: Vec<Vec<SqlValue>> =
            (0..rows).map(|i| heap_row(if i % 37 == 5 { None } else { Some(i % 12) }, &format!("t{}", i % 5), (i % 3) * 150)).collect();
        db.load_rows(&table, rows.into_iter()).unwrap();
        let ci = db.enable_cdc(&table, None, None).unwrap();
        assert!(ci.index_columns.is_empty(), "a heap's capture instance has no index columns");
        db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
        common::settle(&db);
        let wf_path = dir.path().join("events.toml");
        std::fs::write(
            &wf_path,
            format!(
                "app_id = \"events\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"events\"\n\
                 [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
                 [snapshot]\nbootstrap = true\nkeys = [\"grp\"]\n{snapshot_toml}\n[stream]\nrow_filter = \"{row_filter}\"\n"
            ),
        )
        .unwrap();
        let silver = dir.path().join("silver").to_string_lossy().into_owned();
        Heap { _dir: dir, db, table, wf_path, silver, rng: 0x2545_f491_4f6c_dd1d }
    }

    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn run(&self, step: &[&str]) -> (Option<i32>, serde_json::Value, String) {
        run_cli(&self.wf_path, step)
    }

    fn ok(&self, step: &[&str]) -> serde_json::Value {
        let (code, r, err) = self.run(step);
        assert_eq!(code, Some(0), "{step:?}: {r}\n{err}");
        r
    }

    /// `n` transactions of the writer, each captured: inserts (new rows and
    /// copies of existing ones), updates (new values, the same values, a new
    /// `grp` that moves the row to another chunk) and deletes of one occurrence.
    fn write(&mut self, rt: &tokio::runtime::Runtime, n: usize) {
        for _ in 0..n {
            let existing = rt.block_on(source_values(&self.db, &self.table));
            let pick = self.next() % 10;
            let victim = existing[(self.next() % existing.len() as u64) as usize].clone();
            // Mostly the table's own values, now and then NULL or above the snapshot's MAX.
            let g = self.next() % 14;
            let grp = match g {
                12 => None,
                13 => Some(40 + (self.next() % 3) as i64),
                _ => Some(g as i64),
            };
            let amount = (self.next() % 5) as i64 * 100;
            let tag = format!("w{}", self.next() % 3);
            let table = self.table.clone();
            self.db
                .transaction(|tx| match pick {
                    0 | 1 => tx.insert(&table, heap_row(grp, &tag, amount)),
                    2 => {
                        // A copy of an existing row, twice in one transaction.
                        tx.insert(&table, victim.clone())?;
                        tx.insert(&table, victim.clone())
                    }
                    3 | 4 => {
                        let mut new = victim.clone();
                        new[2] = SqlValue::Decimal { value: amount as i128 + 1, scale: 2 };
                        tx.update(&table, &victim, new)
                    }
                    5 => {
                        let mut new = victim.clone();
                        new[0] = grp.map(SqlValue::Int).unwrap_or(SqlValue::Null);
                        tx.update(&table, &victim, new)
                    }
                    6 => tx.update(&table, &victim, victim.clone()),
                    _ => tx.delete(&table, &victim),
                })
                .unwrap();
            self.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
            // A test that sets its own lag (`capture_lag`) watches the capture
            // job fall behind: one plain scan per write. Under the shared
            // configuration's lag each write is captured before the next.
            if self.db.config().unwrap().capture_lag_ms == common::CAPTURE_LAG_MS {
                common::settle(&self.db);
            } else {
                self.db.capture().unwrap();
            }
        }
    }

    /// Silver as a multiset must be the simulator's table.
    fn assert_silver_is_the_table(&self, rt: &tokio::runtime::Runtime, when: &str) {
        let source = rt.block_on(source_rows(&self.db, &self.table));
        let silver = rt.block_on(silver_rows(&self.silver));
        assert!(source.values().any(|n| *n > 1), "{when}: the table holds identical rows");
        if silver != source {
            let mut diff = Vec::new();
            for k in source.keys().chain(silver.keys()) {
                let (s, t) = (source.get(k).copied().unwrap_or(0), silver.get(k).copied().unwrap_or(0));
                if s != t {
                    diff.push(format!("{k}: table {s}, silver {t}"));
                }
            }
            diff.dedup();
            panic!("{when}: silver differs from the simulator's table in {} rows:\n{}", diff.len(), diff.join("\n"));
        }
    }
}

fn run_cli(wf_path: &Path, step: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .arg("--workflow")
        .arg(wf_path)
        .args(step)
        .env("MSSQL_CDC_LOG", "warn")
        .output()
        .unwrap();
    let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("null").to_string();
    (out.status.code(), serde_json::from_str(&last).unwrap_or_default(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn row_texts(batch: &RecordBatch, columns: &[ColumnDesc]) -> Vec<String> {
    let arrays: Vec<_> = columns.iter().map(|c| batch.column(batch.schema().index_of(&c.name).unwrap()).clone()).collect();
    (0..batch.num_rows())
        .map(|r| {
            arrays
                .iter()
                .map(|a| if a.is_null(r) { "\u{2400}NULL".to_string() } else { array_value_to_string(a.as_ref(), r).unwrap() })
                .collect::<Vec<_>>()
                .join(" | ")
        })
        .collect()
}

type Multiset = BTreeMap<String, i64>;

fn read_all(table: &TableName) -> SnapshotRead {
    SnapshotRead { table: table.clone(), columns: columns(), keys: vec![], range: KeyRange::all(), isolation: Isolation::ReadCommitted, batch_rows: 1000 }
}

/// The simulator's rows through its own reader (a SELECT of the whole table).
async fn source_rows(db: &SimDb, table: &TableName) -> Multiset {
    let mut stream = db.source().unwrap().snapshot_read(&read_all(table)).await.unwrap();
    let mut out = Multiset::new();
    while let Some(b) = stream.next().await {
        for t in row_texts(&b.unwrap(), &columns()) {
            *out.entry(t).or_default() += 1;
        }
    }
    assert_eq!(out.values().sum::<i64>() as u64, db.row_count(table).unwrap());
    out
}

/// The simulator's rows as values, for the writer to name them.
async fn source_values(db: &SimDb, table: &TableName) -> Vec<Vec<SqlValue>> {
    let mut stream = db.source().unwrap().snapshot_read(&read_all(table)).await.unwrap();
    let mut out = Vec::new();
    while let Some(b) = stream.next().await {
        let b = b.unwrap();
        for r in 0..b.num_rows() {
            out.push(columns().iter().enumerate().map(|(i, c)| value_at(b.column(i).as_ref(), r, &c.sql_type)).collect());
        }
    }
    out
}

/// Silver's rows, each distinct row `_count` times.
async fn silver_rows(location: &str) -> Multiset {
    let t = delta::open_existing(location, &Default::default()).await.unwrap().expect("silver exists");
    let mut out = Multiset::new();
    for b in delta::query(&t, "SELECT * FROM t").await.unwrap() {
        let counts = b.column(b.schema().index_of("_count").unwrap()).as_any().downcast_ref::<Int64Array>().unwrap().clone();
        for (i, t) in row_texts(&b, &columns()).into_iter().enumerate() {
            assert!(!counts.is_null(i) && counts.value(i) > 0, "silver row {t} has count {:?}", counts.is_valid(i).then(|| counts.value(i)));
            assert!(!out.contains_key(&t), "silver holds the distinct row {t} twice");
            out.insert(t, counts.value(i));
        }
    }
    out
}

/// The shared reference check (tests/common): streamed until caught up and
/// applied, silver (a multiset with `_count`) equals the table on every
/// column, bronze's change rows equal the simulator's change function from S
/// (with the stream's `all update old` filter), and the facts' batch ranges
/// tile the LSNs from S.
fn assert_targets_match_source(h: &Heap, rt: &tokio::runtime::Runtime) {
    let mut calls = 0;
    while h.ok(&["stream"])["caught_up"] != true {
        calls += 1;
        assert!(calls < 50, "the stream did not catch up in 50 calls");
    }
    h.ok(&["apply"]);
    rt.block_on(common::assert_targets_match_source(&h.db, &h.table, &h.wf_path));
}

fn reconcile_is_clean(h: &Heap) {
    let (code, r, err) = h.run(&["reconcile"]);
    assert_eq!(code, Some(0), "reconcile: {r}\n{err}");
    assert_eq!((r["clean"].as_bool(), r["differences"].as_u64()), (Some(true), Some(0)), "{r}");
    assert_eq!(r["counts"]["IN_FLIGHT"], 0, "everything was applied: {r}");
}

#[test]
fn a_chunked_heap_with_identical_rows_is_a_multiset_in_silver() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut h = Heap::new(400, "mode = \"chunked\"\nchunk_rows = 40\nparallelism = 2\ntarget_wave_seconds = 0", "all update old");
    let r = h.ok(&["stream"]);
    assert!(r.is_object(), "{r}");
    let mut waves = 0;
    loop {
        h.write(&rt, 6);
        h.ok(&["stream"]);
        let b = h.ok(&["backfill", "--max-waves", "1"]);
        waves += 1;
        h.write(&rt, 3);
        h.ok(&["stream"]);
        let a = h.ok(&["apply"]);
        if b["done"] == true {
            break;
        }
        assert_eq!(a["snapshot_state"], "open", "{a}");
        assert!(waves < 50, "backfill never finished");
    }
    assert!(waves > 2, "the snapshot took several waves ({waves})");
    h.ok(&["stream"]);
    let a = h.ok(&["apply"]);
    assert_eq!(a["snapshot_state"], "complete", "{a}");
    h.assert_silver_is_the_table(&rt, "after the chunked snapshot's completion");
    reconcile_is_clean(&h);
    // Changes after the completion, applied in several calls.
    for round in 0..3 {
        h.write(&rt, 12);
        h.ok(&["stream"]);
        let a = h.ok(&["apply"]);
        assert_eq!(a["action"], "changes", "{a}");
        h.assert_silver_is_the_table(&rt, &format!("after changes round {round}"));
    }
    reconcile_is_clean(&h);
    assert_targets_match_source(&h, &rt);
}

#[test]
fn a_heap_after_a_full_snapshot_is_a_multiset_in_silver() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut h = Heap::new(200, "mode = \"full\"", "all update old");
    h.ok(&["stream"]);
    let a = h.ok(&["apply"]);
    assert_eq!(a["action"], "rebuild", "{a}");
    h.assert_silver_is_the_table(&rt, "after the bootstrap");
    for round in 0..4 {
        h.write(&rt, 10);
        h.ok(&["stream"]);
        h.ok(&["apply"]);
        h.assert_silver_is_the_table(&rt, &format!("after changes round {round}"));
    }
    reconcile_is_clean(&h);
    // The reference check before the tampering below (which makes silver
    // differ from the table on purpose).
    assert_targets_match_source(&h, &rt);
    // A row taken out of silver behind apply's back is a difference reconcile reports.
    rt.block_on(async {
        let t = delta::open_existing(&h.silver, &Default::default()).await.unwrap().unwrap();
        t.update().with_predicate("_count > 1").with_update("_count", "_count - 1").await.unwrap();
    });
    let (code, r, _) = h.run(&["reconcile"]);
    assert_eq!(code, Some(3), "{r}");
    assert!(r["counts"]["MISSING_TARGET"].as_u64().unwrap_or(0) >= 1, "{r}");
}

/// A heap larger than `reconcile.bucket_rows` is compared by hash
/// partitions of its rows (equal rows meet in one): clean, nothing is held;
/// with one copy taken from every repeated row of silver, exactly those
/// rows are MISSING_TARGET, found in passes that hold at most `bucket_rows`
/// rows of a side, not the whole table twice.
#[test]
fn a_heap_larger_than_bucket_rows_is_compared_in_hash_partitions() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut h = Heap::new(400, "mode = \"full\"\n[reconcile]\nbucket_rows = 100", "all update old");
    h.ok(&["stream"]);
    h.ok(&["apply"]);
    // A few captured writes, as a live table has (and the capture job then
    // records a point past reconcile's reads, which the tampering below needs).
    h.write(&rt, 4);
    h.ok(&["stream"]);
    h.ok(&["apply"]);
    h.assert_silver_is_the_table(&rt, "after the bootstrap and the writes");
    let rows = rt.block_on(source_values(&h.db, &h.table)).len() as u64;
    let r = h.ok(&["reconcile"]);
    assert_eq!((r["clean"].as_bool(), r["rows_source"].as_u64(), r["rows_target"].as_u64()), (Some(true), Some(rows), Some(rows)), "{r}");
    assert!(r["partitions"].as_u64().unwrap() >= 8, "{r}");
    assert_eq!((r["partitions_mismatched"].as_u64(), r["passes"].as_u64(), r["rows_held_max"].as_u64()), (Some(0), Some(0), Some(0)), "{r}");
    let repeated = rt.block_on(async {
        let t = delta::open_existing(&h.silver, &Default::default()).await.unwrap().unwrap();
        let n: usize = delta::query(&t, "SELECT * FROM t WHERE _count > 1").await.unwrap().iter().map(|b| b.num_rows()).sum();
        t.update().with_predicate("_count > 1").with_update("_count", "_count - 1").await.unwrap();
        n as u64
    });
    assert!(repeated >= 10, "the heap repeats rows: {repeated}");
    let (code, r, _) = h.run(&["reconcile"]);
    assert_eq!(code, Some(3), "{r}");
    assert_eq!((r["counts"]["MISSING_TARGET"].as_u64(), r["differences"].as_u64()), (Some(repeated), Some(repeated)), "one per repeated row: {r}");
    assert_eq!(r["rows_target"].as_u64(), Some(rows - repeated), "{r}");
    let held = r["rows_held_max"].as_u64().unwrap();
    assert!(held > 0 && held <= 200 && held < 2 * rows, "a pass holds at most 100 rows of each side: {r}");
}

#[test]
fn a_heap_streamed_without_before_images_is_refused_before_anything_is_written() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut h = Heap::new(50, "mode = \"full\"", "all");
    h.ok(&["stream"]);
    h.write(&rt, 5);
    // An update for certain: bronze gets its after-image only.
    let victim = rt.block_on(source_values(&h.db, &h.table))[0].clone();
    let mut new = victim.clone();
    new[1] = SqlValue::Str("updated".into());
    let table = h.table.clone();
    h.db.transaction(|tx| tx.update(&table, &victim, new)).unwrap();
    common::settle(&h.db);
    h.ok(&["stream"]);
    let (code, r, _) = h.run(&["apply"]);
    assert_eq!(code, Some(2), "{r}");
    let e = r["error"].as_str().unwrap_or_default();
    assert!(e.contains("stream.row_filter") && e.contains("all update old"), "the error names the option and its value: {e}");
    assert!(!Path::new(&h.silver).exists(), "nothing written");
    // With the option set now, bronze still lacks that update's before-image: refused too.
    let text = std::fs::read_to_string(&h.wf_path).unwrap().replace("row_filter = \"all\"", "row_filter = \"all update old\"");
    std::fs::write(&h.wf_path, text).unwrap();
    let (code, r, _) = h.run(&["apply"]);
    assert_eq!(code, Some(2), "{r}");
    let e = r["error"].as_str().unwrap_or_default();
    assert!(e.contains("before-image") && e.contains("all update old"), "{e}");
    let rows = rt.block_on(async {
        match delta::open_existing(&h.silver, &Default::default()).await.unwrap() {
            Some(t) => delta::query(&t, "SELECT COUNT(*) FROM t").await.unwrap()[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0),
            None => 0,
        }
    });
    assert_eq!(rows, 0, "no silver row written");
}

/// The capture job `ms` behind (on the manual clock): the writer's newest
/// commits are in the table, but not in the change tables, while steps run.
fn capture_lag(h: &Heap, ms: u64) {
    h.db.set_config_value("capture_lag_ms", &ms.to_string()).unwrap();
}

/// A heap read while some of its commits wait for the capture job: each read
/// holds rows whose change rows come after its stamp. Without the read's
/// fence those rows were counted twice (fails with `counts` ignoring the
/// fence: silver's counts exceed the table's).
#[test]
fn a_chunked_heap_read_ahead_of_capture_counts_each_row_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut h = Heap::new(300, "mode = \"chunked\"\nchunk_rows = 30\nparallelism = 2\ntarget_wave_seconds = 0", "all update old");
    capture_lag(&h, 3_500);
    h.ok(&["stream"]);
    // Two identical rows with a NULL cut value, committed but not captured
    // when the first wave reads the first chunk (the one range holding NULLs).
    let table = h.table.clone();
    h.db.transaction(|tx| {
        tx.insert(&table, heap_row(None, "early", 100))?;
        tx.insert(&table, heap_row(None, "early", 100))
    })
    .unwrap();
    h.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
    h.db.capture().unwrap(); // a scan that leaves both inside the lag
    let mut waves = 0;
    loop {
        h.write(&rt, 5);
        let pending = h.db.status().unwrap()["pending_transactions"].as_u64();
        assert!(pending.unwrap_or(0) > 0, "commits wait for capture while the chunks are read: {:?}", h.db.status().unwrap());
        h.ok(&["stream"]);
        let b = h.ok(&["backfill", "--max-waves", "1"]);
        waves += 1;
        h.ok(&["apply"]);
        if b["done"] == true {
            break;
        }
        assert!(waves < 50, "backfill never finished");
    }
    assert!(waves > 2, "the snapshot took several waves ({waves})");
    capture_lag(&h, 0);
    h.db.advance_clock(std::time::Duration::from_secs(5)).unwrap();
    common::settle(&h.db);
    h.ok(&["stream"]);
    let a = h.ok(&["apply"]);
    assert_eq!(a["snapshot_state"], "complete", "{a}");
    h.assert_silver_is_the_table(&rt, "after a chunked snapshot read ahead of capture");
    reconcile_is_clean(&h);
    assert_targets_match_source(&h, &rt);
}

/// The same for a full snapshot, read as one fenced range.
#[test]
fn a_full_heap_snapshot_read_ahead_of_capture_counts_each_row_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut h = Heap::new(200, "mode = \"full\"\nparallelism = 3", "all update old");
    capture_lag(&h, 3_500);
    h.write(&rt, 6);
    assert!(h.db.status().unwrap()["pending_transactions"].as_u64().unwrap_or(0) > 0, "commits wait for capture: {:?}", h.db.status().unwrap());
    h.ok(&["stream"]);
    h.write(&rt, 4);
    h.ok(&["stream"]);
    h.ok(&["apply"]);
    capture_lag(&h, 0);
    h.db.advance_clock(std::time::Duration::from_secs(5)).unwrap();
    common::settle(&h.db);
    h.ok(&["stream"]);
    h.ok(&["apply"]);
    h.assert_silver_is_the_table(&rt, "after a full snapshot read ahead of capture");
    reconcile_is_clean(&h);
    assert_targets_match_source(&h, &rt);
}

/// Silver as a multiset holds no row more often than the table does (during
/// a chunked snapshot, rows of ranges not read yet may be missing).
fn assert_silver_within_the_table(h: &Heap, rt: &tokio::runtime::Runtime, when: &str) {
    let source = rt.block_on(source_rows(&h.db, &h.table));
    let silver = rt.block_on(silver_rows(&h.silver));
    let extra: Vec<String> = silver
        .iter()
        .filter(|(t, n)| source.get(*t).copied().unwrap_or(0) < **n)
        .map(|(t, n)| format!("{t}: silver {n}, table {}", source.get(t).copied().unwrap_or(0)))
        .collect();
    assert!(extra.is_empty(), "{when}: silver holds rows the table does not:\n{}", extra.join("\n"));
}

/// adr-0028 Amendment 5 on a heap: the bootstrap is half read (silver holds
/// its first chunks) when a new capture instance appears, and the switch
/// opens a chunked snapshot at its start. Until that snapshot reads a range,
/// silver still holds the bootstrap's rows there, so the changes there must
/// go on counting against them: a row deleted or updated there after the
/// switch must leave silver at once, not wait for the newer chunk (or the
/// completion) while silver holds a row the table no longer has.
#[test]
fn a_heap_snapshot_opened_on_a_switch_counts_the_ranges_it_has_not_read_as_before() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut h = Heap::new(
        400,
        "mode = \"chunked\"\nchunk_rows = 40\nparallelism = 1\ntarget_wave_seconds = 0\nsnapshot_on_switch = true",
        "all update old",
    );
    h.ok(&["stream"]);
    for _ in 0..3 {
        h.write(&rt, 4);
        h.ok(&["stream"]);
        assert_eq!(h.ok(&["backfill", "--max-waves", "1"])["done"], false);
        h.ok(&["apply"]);
    }
    assert_silver_within_the_table(&h, &rt, "three waves of the bootstrap applied");

    h.db.enable_cdc(&h.table, Some("dbo_events_v2"), None).unwrap();
    h.write(&rt, 2);
    let r = h.ok(&["stream"]);
    assert_eq!(r["snapshots_on_switch"].as_array().map(Vec::len), Some(1), "the switch opened a snapshot: {r}");
    // Rows of the bootstrap's first range (grp NULL and 0 come first): one
    // deleted, one updated in place, after the switch's snapshot opened.
    let rows = rt.block_on(source_values(&h.db, &h.table));
    let first = |g: Option<i64>| rows.iter().find(|r| r[0] == g.map(SqlValue::Int).unwrap_or(SqlValue::Null)).cloned().expect("a row of the group");
    let (gone, changed) = (first(None), first(Some(0)));
    let table = h.table.clone();
    h.db.transaction(|tx| {
        tx.delete(&table, &gone)?;
        let mut new = changed.clone();
        new[1] = SqlValue::Str("after".into());
        tx.update(&table, &changed, new)
    })
    .unwrap();
    common::settle(&h.db);
    h.ok(&["stream"]);
    let a = h.ok(&["apply"]);
    assert_eq!(a["snapshot_state"], "open", "{a}");
    assert_silver_within_the_table(&h, &rt, "changes after the switch's open, before any of its waves");
    let mut waves = 0;
    loop {
        h.write(&rt, 3);
        h.ok(&["stream"]);
        let b = h.ok(&["backfill", "--max-waves", "1"]);
        h.ok(&["stream"]);
        h.ok(&["apply"]);
        waves += 1;
        if b["done"] == true {
            break;
        }
        assert_silver_within_the_table(&h, &rt, &format!("wave {waves} of the switch's snapshot"));
        assert!(waves < 50, "backfill never finished");
    }
    h.ok(&["stream"]);
    let a = h.ok(&["apply"]);
    assert_eq!(a["snapshot_state"], "complete", "{a}");
    h.assert_silver_is_the_table(&rt, "after the switch's snapshot completed");
    reconcile_is_clean(&h);
    // (The shared bronze check reads one capture instance's change log;
    // across a switch the torture tester's checks cover bronze.)
}

/// The heap's columns after `extra` was added, as the newer instance captures them.
fn columns_with_extra() -> Vec<ColumnDesc> {
    let mut c = columns();
    c.push(ColumnDesc::new("extra", SqlType::NVarChar { len: Some(16) }, true));
    c
}

/// While the capture job lags, a column is added, a second capture instance
/// is enabled for it, and rows are given values in it: the commits are in
/// the table but in neither change table. A fenced read of the older
/// instance's columns made now would hold those commits without the new
/// values, and silver skips their change rows (they ended before the
/// fence), so the values would never arrive. Returns the rows changed.
fn add_a_column_and_set_it_while_capture_lags(h: &Heap, rt: &tokio::runtime::Runtime) -> usize {
    capture_lag(h, 3_500);
    // A commit first, so the capture job has work waiting: it writes no idle
    // mapping row meanwhile, and the max LSN stays below the newer start.
    let table = h.table.clone();
    h.db.transaction(|tx| tx.insert(&table, heap_row(Some(2), "before", 100))).unwrap();
    h.db.add_column(&h.table, ColumnDesc::new("extra", SqlType::NVarChar { len: Some(16) }, true)).unwrap();
    h.db.enable_cdc(&h.table, Some("dbo_events_v2"), None).unwrap();
    h.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
    let rows = rt.block_on(source_values(&h.db, &h.table));
    let picked: Vec<Vec<SqlValue>> = rows.iter().step_by(7).take(6).cloned().collect();
    h.db.transaction(|tx| {
        for (i, row) in picked.iter().enumerate() {
            let mut new = row.clone();
            new.push(SqlValue::Str(format!("x{i}")));
            tx.update(&table, row, new)?;
        }
        let mut added = heap_row(Some(3), "new", 700);
        added.push(SqlValue::Str("inserted".into()));
        tx.insert(&table, added)
    })
    .unwrap();
    h.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
    assert!(h.db.status().unwrap()["pending_transactions"].as_u64().unwrap_or(0) > 1, "the commits wait for capture");
    let max = h.db.max_lsn().unwrap().expect("a max LSN");
    let v2 = rt.block_on(h.db.source().unwrap().capture_instances(&h.table)).unwrap().into_iter().find(|i| i.name == "dbo_events_v2").unwrap();
    assert!(v2.start_lsn.is_some_and(|s| s > max), "capture has not reached the newer instance's start: {:?} vs max {max}", v2.start_lsn);
    picked.len() + 1
}

/// The capture job catches up, then silver must be the table in every column.
fn catch_up(h: &Heap) {
    capture_lag(h, 0);
    h.db.advance_clock(std::time::Duration::from_secs(5)).unwrap();
    common::settle(&h.db);
}

fn assert_silver_is_the_table_with_extra(h: &Heap, rt: &tokio::runtime::Runtime) {
    rt.block_on(mssql_cdc::torture::silver_matches_table(&h.db, &h.table, &h.silver, &columns_with_extra()))
        .unwrap_or_else(|e| panic!("silver is not the table in every column: {e}"));
}

/// Found by the torture soak (schedule 10000933): a heap's full bootstrap,
/// read while a newer instance adding a column was listed but not reached by
/// capture, left the values set after that instance's start NULL in silver
/// for good. The read must wait (exit 75, naming the instance) until the
/// capture job has passed the start; the bootstrap then reads the newer
/// instance. Fails if the snapshot reads the older instance's columns.
#[test]
fn a_full_heap_snapshot_waits_while_a_newer_instance_adds_a_column_capture_has_not_reached() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let h = Heap::new(120, "mode = \"full\"", "all update old");
    let changed = add_a_column_and_set_it_while_capture_lags(&h, &rt);
    assert!(changed > 1);
    let (code, r, err) = h.run(&["stream"]);
    assert_eq!(code, Some(75), "the bootstrap must wait: {r}\n{err}");
    assert!(format!("{r}{err}").contains("dbo_events_v2"), "the refusal names the newer instance: {r}\n{err}");
    assert!(!Path::new(&h.silver).exists() || rt.block_on(silver_rows(&h.silver)).is_empty(), "nothing was applied");
    catch_up(&h);
    h.ok(&["stream"]);
    let st = h.ok(&["status"]);
    assert_eq!(st["capture_instance"], "dbo_events_v2", "the bootstrap read the newer instance: {st}");
    h.ok(&["apply"]);
    assert_silver_is_the_table_with_extra(&h, &rt);
}

/// The same for a chunked heap (schedule 20000981): a wave stamped below the
/// newer instance's start (capture lags) is still read fenced at a time the
/// table holds the added column's values. It pauses until the stream has
/// switched; the waves then read the newer instance's columns.
#[test]
fn a_chunked_heap_wave_waits_while_a_newer_instance_adds_a_column_the_stream_has_not_reached() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let h = Heap::new(120, "mode = \"chunked\"\nchunk_rows = 30\nparallelism = 1\ntarget_wave_seconds = 0", "all update old");
    h.ok(&["stream"]);
    add_a_column_and_set_it_while_capture_lags(&h, &rt);
    let (code, r, err) = h.run(&["backfill", "--max-waves", "1"]);
    assert_eq!(code, Some(75), "the wave must wait: {r}\n{err}");
    assert!(format!("{r}{err}").contains("dbo_events_v2"), "the pause names the newer instance: {r}\n{err}");
    assert_eq!((r["paused"].as_bool(), r["waves"].as_u64()), (Some(true), Some(0)), "paused, no wave read: {r}");
    catch_up(&h);
    let mut calls = 0;
    loop {
        h.ok(&["stream"]);
        let b = h.ok(&["backfill", "--max-waves", "1"]);
        h.ok(&["apply"]);
        calls += 1;
        if b["done"] == true {
            break;
        }
        assert!(calls < 30, "backfill never finished");
    }
    h.ok(&["stream"]);
    let a = h.ok(&["apply"]);
    assert_eq!(a["snapshot_state"], "complete", "{a}");
    assert_silver_is_the_table_with_extra(&h, &rt);
}
