//! A deterministic scenario over the simulator: a manual clock, a fixed
//! seed, a small table, and the steps run in process.
#![allow(dead_code)]

pub mod gate;
pub mod model;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, TimeZone, Utc};
use deltalake::arrow::record_batch::RecordBatch;
use mssql_cdc::delta::facts::FactRow;
use mssql_cdc::delta::golden;
use mssql_cdc::engine::rebuild::{self, Comparison};
use mssql_cdc::engine::{self, Context};
use mssql_cdc::error::StepResult;
use mssql_cdc::lsn::Lsn;
use mssql_cdc::sim::{Clock, SimConfig, SimDb, TableSpec};
use mssql_cdc::source::{
    BatchStream, CaptureInstance, CdcSource, FencedRead, Isolation, KeyRange, RowFilter, ServerZone, SharedSource, SnapshotRead,
    SourceError, TableInfo, TableName, TimeOp,
};
use mssql_cdc::types::{as_stored, value_at, ColumnDesc, Key, SqlType, SqlValue};
use mssql_cdc::workflow::Workflow;
use serde_json::Value;

pub struct Scenario {
    pub dir: tempfile::TempDir,
    pub db: SimDb,
    pub table: TableName,
    pub wf_path: PathBuf,
    /// The next id an insert takes.
    pub next_id: i64,
    rng: u64,
}

pub fn items_spec(table: &TableName) -> TableSpec {
    TableSpec { collations: Default::default(),
        name: table.clone(),
        columns: vec![
            ColumnDesc::new("id", SqlType::Int, false),
            ColumnDesc::new("name", SqlType::NVarChar { len: Some(40) }, true),
            ColumnDesc::new("qty", SqlType::Int, true),
            ColumnDesc::new("price", SqlType::Decimal { precision: 10, scale: 2 }, true),
            ColumnDesc::new("updated", SqlType::DateTime2 { scale: 7 }, true),
        ],
        primary_key: vec!["id".into()],
        unique_index: vec![],
    }
}

pub fn item_row(id: i64, version: i64) -> Vec<SqlValue> {
    let t = Utc.with_ymd_and_hms(2026, 3, 1, 0, 0, 0).unwrap().naive_utc() + chrono::Duration::nanoseconds(id * 1_000_100 + version * 7_300);
    vec![
        SqlValue::Int(id),
        if id % 7 == 0 { SqlValue::Null } else { SqlValue::Str(format!("item {id} v{version}")) },
        SqlValue::Int(id * 10 + version),
        SqlValue::Decimal { value: (id * 100 + version) as i128, scale: 2 },
        SqlValue::DateTime(t),
    ]
}

pub fn manual_config() -> SimConfig {
    SimConfig {
        clock: Clock::Manual { start: Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap(), tick_ms: 1000 },
        time_zone: "America/Sao_Paulo".into(),
        // The capture job runs seconds behind the writer, as on a server: a
        // transaction is in the change table only once the clock is this far
        // past its commit. Every transition of a test runs with the last
        // transactions still uncaptured unless the test waits (`settle`).
        capture_lag_ms: CAPTURE_LAG_MS,
        idle_interval_seconds: 1,
        ..SimConfig::default()
    }
}

/// How far the shared configuration's capture job is behind the writer.
pub const CAPTURE_LAG_MS: u64 = 3_000;

/// Waits for the capture job as a test on a server waits for it: the clock
/// moves past the lag of every transaction committed so far, then a capture
/// scan harvests them and a second, finding nothing, records its progress
/// (an idle mapping row at the clock, when the configuration writes them).
/// What they captured is returned.
pub fn settle(db: &SimDb) -> mssql_cdc::sim::CaptureReport {
    let cfg = db.config().unwrap();
    match cfg.clock {
        Clock::Manual { .. } => {
            db.advance_clock(std::time::Duration::from_millis(cfg.capture_lag_ms + 1_000)).unwrap();
        }
        Clock::Wall if cfg.capture_lag_ms > 0 => std::thread::sleep(std::time::Duration::from_millis(cfg.capture_lag_ms + 50)),
        Clock::Wall => {}
    }
    let mut report = db.capture().unwrap();
    let idle = db.capture().unwrap();
    report.transactions += idle.transactions;
    report.change_rows += idle.change_rows;
    report.mapping_rows += idle.mapping_rows;
    report.idle_rows += idle.idle_rows;
    report.pending_left = idle.pending_left;
    report.max_lsn = idle.max_lsn.or(report.max_lsn);
    report
}

impl Scenario {
    /// A simulator file with `rows` items loaded before CDC was enabled, and a
    /// workflow file with the given extra TOML under `[snapshot]`/`[stream]`.
    pub fn new(rows: i64, workflow_extra: &str) -> Scenario {
        let dir = tempfile::tempdir().unwrap();
        let db = SimDb::create(&dir.path().join("source.sqlite"), manual_config()).unwrap();
        let table = TableName::new("dbo", "items");
        db.create_table(&items_spec(&table)).unwrap();
        db.load_rows(&table, (1..=rows).map(|i| item_row(i, 0))).unwrap();
        db.enable_cdc(&table, None, None).unwrap();
        // The capture job's first scan: an idle mapping row, so max LSN is set.
        db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
        settle(&db);
        assert!(db.max_lsn().unwrap().is_some(), "the first capture scan records an LSN");
        let wf_path = dir.path().join("items.toml");
        let mut s = Scenario { dir, db, table, wf_path, next_id: rows + 1, rng: 0x9e37_79b9_7f4a_7c15 };
        s.write_workflow(workflow_extra);
        s
    }

    pub fn write_workflow(&mut self, extra: &str) {
        let text = format!(
            "app_id = \"items\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"items\"\n[target]\nbronze = \"bronze\"\nfacts = \"facts\"\n{extra}\n"
        );
        std::fs::write(&self.wf_path, text).unwrap();
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// `n` deterministic transactions: inserts, updates, deletes and key updates.
    pub fn changes(&mut self, n: usize) {
        let table = self.table.clone();
        for _ in 0..n {
            let pick = self.next() % 10;
            let existing = self.db.keys(&table).unwrap();
            let victim = if existing.is_empty() { None } else { Some(existing[(self.next() % existing.len() as u64) as usize].clone()) };
            let new_id = self.next_id;
            let version = (self.next() % 1000) as i64 + 1;
            let used_new = std::cell::Cell::new(false);
            self.db
                .transaction(|tx| {
                    match (pick, &victim) {
                        (0..=3, _) | (_, None) => {
                            tx.insert(&table, item_row(new_id, 0))?;
                            used_new.set(true);
                        }
                        (4..=6, Some(k)) => {
                            let id = k[0].as_i64().unwrap();
                            tx.update(&table, k, item_row(id, version))?;
                        }
                        (7..=8, Some(k)) => tx.delete(&table, k)?,
                        (_, Some(k)) => {
                            // A key update: SQL Server records it as a delete and an insert.
                            tx.update(&table, k, item_row(new_id, version))?;
                            used_new.set(true);
                        }
                    }
                    Ok(())
                })
                .unwrap();
            if used_new.get() {
                self.next_id += 1;
            }
        }
    }

    pub fn workflow(&self) -> Workflow {
        Workflow::load(&self.wf_path).unwrap()
    }

    pub async fn context(&self) -> StepResult<Context> {
        Context::open(self.workflow()).await
    }

    /// [`assert_targets_match_source`] for this scenario's workflow.
    pub async fn assert_matches_source(&self) {
        assert_targets_match_source(&self.db, &self.table, &self.wf_path).await
    }

    pub async fn stream(&self) -> StepResult<engine::stream::StreamResult> {
        let mut ctx = self.context().await?;
        engine::coarse::stream(&mut ctx).await
    }

    /// Streams until caught up with the writer, not only with the capture
    /// job: a call that finds nothing more to read is followed by the lag
    /// passing and a capture scan ([`settle`]), as an orchestrator's next
    /// call would find, until a scan finds nothing new (a step that fails is
    /// an error of the test).
    pub async fn stream_until_caught_up(&self) {
        for _ in 0..100 {
            let r = self.stream().await.unwrap();
            if r.caught_up && settle(&self.db).transactions == 0 {
                return;
            }
        }
        panic!("the stream did not catch up in 100 calls");
    }

    /// Rebuilds the table from bronze and compares it with the simulator.
    pub async fn verify(&self) -> Comparison {
        let mut ctx = self.context().await.unwrap();
        let st = engine::state::load(&mut ctx).await.unwrap();
        let keys = if ctx.instance.index_columns.is_empty() { ctx.snapshot_keys() } else { ctx.instance.index_columns.clone() };
        let image = rebuild::rebuild(&ctx.bronze, &ctx.instance.columns, &keys, st.snapshot).await.unwrap();
        rebuild::compare_with_source(ctx.source.as_ref(), &self.table, &ctx.instance.columns, &keys, &image).await.unwrap()
    }

    /// The golden transition log of bronze and facts.
    pub async fn golden(&self) -> String {
        let ctx = self.context().await.unwrap();
        let mut lines = golden::render(&ctx.bronze, "bronze").await.unwrap();
        lines.extend(golden::render(&ctx.facts, "facts").await.unwrap());
        lines.join("\n")
    }

    /// Bronze's change rows: (start_lsn, seqval, operation, command_id) duplicates.
    pub async fn duplicate_change_rows(&self) -> usize {
        let ctx = self.context().await.unwrap();
        let b = mssql_cdc::delta::query(
            &ctx.bronze,
            "SELECT _start_lsn, _seqval, _operation, _command_id, COUNT(*) AS n FROM t WHERE _operation <> 0 \
             GROUP BY _start_lsn, _seqval, _operation, _command_id HAVING COUNT(*) > 1",
        )
        .await
        .unwrap();
        b.iter().map(|b| b.num_rows()).sum()
    }

    /// Facts rows per batch id that appear more than once.
    pub async fn duplicate_batch_rows(&self) -> usize {
        let ctx = self.context().await.unwrap();
        let b = mssql_cdc::delta::query(
            &ctx.facts,
            "SELECT generation, batch_id, COUNT(*) AS n FROM t WHERE event IS NULL GROUP BY generation, batch_id HAVING COUNT(*) > 1",
        )
        .await
        .unwrap();
        b.iter().map(|b| b.num_rows()).sum()
    }

    pub async fn count(&self, table: &str, filter: &str) -> i64 {
        let ctx = self.context().await.unwrap();
        let t = if table == "bronze" { &ctx.bronze } else { &ctx.facts };
        let b = mssql_cdc::delta::query(t, &format!("SELECT COUNT(*) AS n FROM t WHERE {filter}")).await.unwrap();
        b[0].column(0).as_any().downcast_ref::<deltalake::arrow::array::Int64Array>().unwrap().value(0)
    }
}

/// Settings that put insta's golden files in the top-level snapshots/ folder.
/// (A function, not an exported macro: several test files share one binary,
/// each with its own copy of this module.)
pub fn golden_settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"));
    s.set_prepend_module_to_snapshot(false);
    s
}

// ---------------------------------------------------------------------------
// The command-line binary, run as a child process.

/// `mssql-cdc --workflow <wf> <args>` with `MSSQL_CDC_LOG=warn`, then each
/// of `env` set (which may set `MSSQL_CDC_LOG` again).
pub fn cli_command(wf: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"));
    c.arg("--workflow").arg(wf).args(args).env("MSSQL_CDC_LOG", "warn");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Runs one step of the scenario's workflow to its end.
pub fn cli(s: &Scenario, step: &str) -> Output {
    cli_command(&s.wf_path, &[step], &[]).output().unwrap()
}

/// The last stdout line as JSON; no line, or one that is not JSON, fails
/// the test (naming stderr).
pub fn last_json(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| panic!("no stdout; stderr: {}", String::from_utf8_lossy(&out.stderr)));
    json_line(line)
}

/// The last line of `stdout` as JSON; no line, or one that is not JSON,
/// fails the test.
pub fn last_json_line(stdout: &str) -> Value {
    let line = stdout.lines().last().unwrap_or_else(|| panic!("no stdout"));
    json_line(line)
}

fn json_line(line: &str) -> Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}"))
}

/// The last stdout line as JSON, or `null` when there is none or it is not JSON.
pub fn last_json_or_null(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("null")).unwrap_or_default()
}

/// Runs a step in the scenario's folder: (exit code, JSON).
pub fn step(s: &Scenario, args: &[&str], env: &[(&str, &str)]) -> (i32, Value) {
    let out = cli_command(&s.wf_path, args, env).current_dir(s.path()).output().unwrap();
    (out.status.code().unwrap_or(-1), last_json(&out))
}

/// Runs a step that must succeed; returns its JSON.
pub fn ok(s: &Scenario, args: &[&str]) -> Value {
    let (code, j) = step(s, args, &[]);
    assert_eq!(code, 0, "{args:?}: {j}");
    j
}

/// Runs `stream` through the binary until it has caught up with the writer
/// ([`Scenario::stream_until_caught_up`]; 50 calls at the most).
pub fn cli_stream_until_caught_up(s: &Scenario) {
    for _ in 0..50 {
        if ok(s, &["stream"])["caught_up"] == true && settle(&s.db).transactions == 0 {
            return;
        }
    }
    panic!("the stream did not catch up in 50 calls");
}

/// Runs `backfill` through the binary until it reports `done` (50 calls at the most).
pub fn cli_backfill_until_done(s: &Scenario) {
    for _ in 0..50 {
        if ok(s, &["backfill"])["done"] == true {
            return;
        }
    }
    panic!("backfill did not finish in 50 calls");
}

/// The stream stops; changes happen; `days` pass; more changes; the capture
/// job runs, then cleanup (the simulator's 3-day retention).
pub fn pass_the_retention(s: &mut Scenario, days: u32) {
    s.changes(6);
    settle(&s.db);
    s.db.advance_clock(Duration::from_secs(24 * 3600) * days).unwrap();
    s.changes(5);
    settle(&s.db);
    assert!(s.db.cleanup(None).unwrap().watermark.is_some(), "cleanup ran");
}

/// A step in the scenario's folder that logs at debug (so `batch read` and
/// `wave read` lines show), with `MSSQL_CDC_FAILPOINTS` set when given.
pub fn failpoint_command(s: &Scenario, args: &[&str], failpoints: Option<&str>) -> Command {
    let mut c = cli_command(&s.wf_path, args, &[("MSSQL_CDC_LOG", "warn,mssql_cdc=debug")]);
    c.current_dir(s.path());
    if let Some(f) = failpoints {
        c.env("MSSQL_CDC_FAILPOINTS", f);
    }
    c
}

/// A step running in a child process whose stderr lines the test watches.
pub struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Vec<String>,
    stdout: std::thread::JoinHandle<String>,
}

impl Running {
    pub fn spawn(s: &Scenario, args: &[&str], failpoints: &str) -> Running {
        let mut child = failpoint_command(s, args, Some(failpoints)).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let err = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(without_colours(&line)).is_err() {
                    break;
                }
            }
        });
        let mut out = child.stdout.take().unwrap();
        let stdout = std::thread::spawn(move || {
            let mut text = String::new();
            out.read_to_string(&mut text).unwrap();
            text
        });
        Running { child, lines, stderr: Vec::new(), stdout }
    }

    /// Waits for a stderr line holding `marker` (the process logs it before its sleep).
    pub fn wait_for(&mut self, marker: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.stderr.push(line.clone());
                    if line.contains(marker) {
                        return line;
                    }
                }
                Err(_) => panic!("no '{marker}' line in 60 s; stderr so far:\n{}", self.stderr.join("\n")),
            }
        }
    }

    pub fn has_exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// Waits for the process: (exit code, JSON, stderr).
    pub fn finish(mut self) -> (i32, Value, String) {
        let status = self.child.wait().unwrap();
        self.stderr.extend(self.lines.iter());
        let stdout = self.stdout.join().unwrap();
        (status.code().unwrap_or(-1), last_json_line(&stdout), self.stderr.join("\n"))
    }
}

/// The line without terminal colour codes (`ESC [ … m`), so fields read `rows=0`.
pub fn without_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Bronze's image by the records' rule, and the simulator's rows beside it.

/// The records' rule for bronze's image in SQL: the rows of snapshot S and
/// the change rows after S; per id the latest by (_start_lsn, _command_id,
/// _seqval, _operation), a snapshot row losing a tie; ids whose latest row is
/// a delete (1) or a before-image (3) are absent.
pub fn bronze_image_sql(snapshot: Lsn) -> String {
    format!(
        "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY id ORDER BY _start_lsn DESC, _command_id DESC NULLS LAST, \
         _seqval DESC NULLS LAST, _operation DESC) AS rank_in_key FROM t \
         WHERE (_operation = 0 AND coalesce(_snapshot, _start_lsn) = '{s}') OR (_operation <> 0 AND _start_lsn > '{s}')) \
         WHERE rank_in_key = 1 AND _operation NOT IN (1, 3)",
        s = snapshot.to_hex()
    )
}

/// The rows [`bronze_image_sql`] returned, every column of `columns` as
/// canonical text, by id (the first column); an id twice fails the test.
pub fn image_by_id(batches: &[RecordBatch], columns: &[ColumnDesc]) -> BTreeMap<i64, Vec<String>> {
    let mut out = BTreeMap::new();
    for b in batches {
        let cols: Vec<_> = columns.iter().map(|c| b.column_by_name(&c.name).unwrap_or_else(|| panic!("bronze lacks {}", c.name)).clone()).collect();
        for i in 0..b.num_rows() {
            let values: Vec<SqlValue> = cols.iter().zip(columns).map(|(a, c)| value_at(a.as_ref(), i, &c.sql_type)).collect();
            let id = values[0].as_i64().expect("an id");
            assert!(out.insert(id, values.iter().map(SqlValue::canonical).collect()).is_none(), "id {id} twice in the image");
        }
    }
    out
}

/// Bronze's image of snapshot `snapshot` by the records' rule, read through
/// the scenario's workflow.
pub fn bronze_image(rt: &tokio::runtime::Runtime, s: &Scenario, snapshot: Lsn) -> BTreeMap<i64, Vec<String>> {
    let columns = items_spec(&s.table).columns;
    let sql = bronze_image_sql(snapshot);
    let batches = rt.block_on(async {
        let ctx = s.context().await.unwrap();
        mssql_cdc::delta::query(&ctx.bronze, &sql).await.unwrap()
    });
    image_by_id(&batches, &columns)
}

/// The table (not empty) and bronze's image hold the same rows, every column.
pub fn assert_image_is_table(table: &BTreeMap<i64, Vec<String>>, image: &BTreeMap<i64, Vec<String>>) {
    assert!(!table.is_empty());
    let diff = image_diff(table, image);
    assert!(diff.is_empty(), "{} ids differ: {:?}", diff.len(), &diff[..diff.len().min(5)]);
}

/// The simulator's rows (`SimDb::rows`), every column as bronze stores it, by id.
pub fn table_rows_by_id(s: &Scenario) -> BTreeMap<i64, Vec<String>> {
    let columns = items_spec(&s.table).columns;
    s.db.rows(&s.table)
        .unwrap()
        .into_iter()
        .map(|row| (row[0].as_i64().unwrap(), row.iter().zip(&columns).map(|(v, c)| as_stored(v, &c.sql_type).canonical()).collect()))
        .collect()
}

/// S of the newest completed snapshot (`bootstrap` or `resnapshot`) the facts rows record.
pub fn newest_completion(rows: &[FactRow]) -> Option<Lsn> {
    rows.iter().filter(|r| matches!(r.event.as_deref(), Some("bootstrap") | Some("resnapshot"))).filter_map(|r| r.max_lsn).max()
}

/// The ids whose rows differ between the table and bronze's image, each as
/// `id: table … / bronze …`.
pub fn image_diff(table: &BTreeMap<i64, Vec<String>>, image: &BTreeMap<i64, Vec<String>>) -> Vec<String> {
    let ids: std::collections::BTreeSet<_> = table.keys().chain(image.keys()).collect();
    ids.into_iter()
        .filter(|k| table.get(k) != image.get(k))
        .map(|k| format!("{k}: table {:?} / bronze {:?}", table.get(k), image.get(k)))
        .collect()
}

// ---------------------------------------------------------------------------
// A source that hands every read to the real one but the calls a test hooks.

/// The calls a [`Wrapped`] source lets a test watch or change. Each default
/// hands the call to the real source unchanged; a test overrides the ones
/// it needs.
#[async_trait]
pub trait Hooks: Send + Sync {
    async fn max_lsn(&self, inner: &SharedSource) -> Result<Option<Lsn>, SourceError> {
        inner.max_lsn().await
    }
    async fn changes(
        &self,
        inner: &SharedSource,
        ci: &CaptureInstance,
        from: Lsn,
        to: Lsn,
        filter: RowFilter,
        batch_rows: usize,
    ) -> Result<BatchStream, SourceError> {
        inner.changes(ci, from, to, filter, batch_rows).await
    }
    async fn snapshot_read(&self, inner: &SharedSource, read: &SnapshotRead) -> Result<BatchStream, SourceError> {
        inner.snapshot_read(read).await
    }
    async fn snapshot_read_fenced(&self, inner: &SharedSource, read: &SnapshotRead) -> Result<FencedRead, SourceError> {
        inner.snapshot_read_fenced(read).await
    }
    async fn server_now(&self, inner: &SharedSource) -> Result<NaiveDateTime, SourceError> {
        inner.server_now().await
    }
}

/// A [`CdcSource`] over `inner`: `max_lsn`, `changes`, `snapshot_read` and `snapshot_read_fenced` go
/// through `hooks`, every other call straight to `inner`.
pub struct Wrapped<H> {
    pub inner: SharedSource,
    pub hooks: H,
}

impl<H> Wrapped<H> {
    pub fn new(inner: SharedSource, hooks: H) -> Wrapped<H> {
        Wrapped { inner, hooks }
    }
}

#[async_trait]
impl<H: Hooks + 'static> CdcSource for Wrapped<H> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    async fn max_lsn(&self) -> Result<Option<Lsn>, SourceError> {
        self.hooks.max_lsn(&self.inner).await
    }
    async fn min_lsn(&self, ci: &str) -> Result<Option<Lsn>, SourceError> {
        self.inner.min_lsn(ci).await
    }
    async fn increment_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError> {
        self.inner.increment_lsn(lsn).await
    }
    async fn decrement_lsn(&self, lsn: Lsn) -> Result<Lsn, SourceError> {
        self.inner.decrement_lsn(lsn).await
    }
    async fn table_info(&self, t: &TableName) -> Result<TableInfo, SourceError> {
        self.inner.table_info(t).await
    }
    async fn capture_instances(&self, t: &TableName) -> Result<Vec<CaptureInstance>, SourceError> {
        self.inner.capture_instances(t).await
    }
    async fn changes(&self, ci: &CaptureInstance, from: Lsn, to: Lsn, filter: RowFilter, batch_rows: usize) -> Result<BatchStream, SourceError> {
        self.hooks.changes(&self.inner, ci, from, to, filter, batch_rows).await
    }
    async fn snapshot_read(&self, read: &SnapshotRead) -> Result<BatchStream, SourceError> {
        self.hooks.snapshot_read(&self.inner, read).await
    }
    async fn snapshot_read_fenced(&self, read: &SnapshotRead) -> Result<FencedRead, SourceError> {
        self.hooks.snapshot_read_fenced(&self.inner, read).await
    }
    async fn key_extent(&self, t: &TableName, keys: &[String], iso: Isolation) -> Result<Option<(Key, Key)>, SourceError> {
        self.inner.key_extent(t, keys, iso).await
    }
    async fn slice_counts(&self, t: &TableName, key: &str, lo: i64, hi: i64, width: i64, iso: Isolation) -> Result<Vec<(i64, u64)>, SourceError> {
        self.inner.slice_counts(t, key, lo, hi, width, iso).await
    }
    async fn slice_extent(&self, t: &TableName, key: &str, lo: i64, hi: i64, iso: Isolation) -> Result<Option<(i64, i64)>, SourceError> {
        self.inner.slice_extent(t, key, lo, hi, iso).await
    }
    async fn null_count(&self, t: &TableName, key: &str, iso: Isolation) -> Result<u64, SourceError> {
        self.inner.null_count(t, key, iso).await
    }
    async fn bucket_sums(&self, t: &TableName, key: &str, lo: i64, hi: i64, width: i64, iso: Isolation) -> Result<Vec<(i64, u64, i128)>, SourceError> {
        self.inner.bucket_sums(t, key, lo, hi, width, iso).await
    }
    async fn key_seek(&self, t: &TableName, keys: &[String], range: &KeyRange, n: u64, iso: Isolation) -> Result<Option<Key>, SourceError> {
        self.inner.key_seek(t, keys, range, n, iso).await
    }
    async fn compare_keys(&self, t: &TableName, keys: &[String], pairs: &[(Key, Key)]) -> Result<Vec<std::cmp::Ordering>, SourceError> {
        self.inner.compare_keys(t, keys, pairs).await
    }
    async fn row_estimate(&self, t: &TableName) -> Result<u64, SourceError> {
        self.inner.row_estimate(t).await
    }
    async fn time_to_lsn(&self, op: TimeOp, t: NaiveDateTime) -> Result<Option<Lsn>, SourceError> {
        self.inner.time_to_lsn(op, t).await
    }
    async fn lsn_to_time(&self, lsn: Lsn) -> Result<Option<NaiveDateTime>, SourceError> {
        self.inner.lsn_to_time(lsn).await
    }
    async fn server_time_zone(&self) -> Result<ServerZone, SourceError> {
        self.inner.server_time_zone().await
    }
    async fn server_local_times(&self, instants: &[DateTime<Utc>]) -> Result<Vec<NaiveDateTime>, SourceError> {
        self.inner.server_local_times(instants).await
    }
    async fn server_now(&self) -> Result<NaiveDateTime, SourceError> {
        self.hooks.server_now(&self.inner).await
    }
    async fn row_count(&self, t: &TableName, iso: Isolation) -> Result<u64, SourceError> {
        self.inner.row_count(t, iso).await
    }
    async fn date_bucket_sums(&self, t: &TableName, key: &str, lo: i64, hi: i64, width: i64, iso: Isolation) -> Result<Vec<(i64, u64, i128)>, SourceError> {
        self.inner.date_bucket_sums(t, key, lo, hi, width, iso).await
    }
}

/// The torture tester's reference checks, for one scenario's targets (the
/// workflow at `wf_path` names them): silver equals the simulator's table on
/// every column (skipped where the workflow has no silver), bronze's change
/// rows equal the simulator's change function from S on every column (with
/// the stream's row filter; one generation, one capture instance), and the
/// facts' batch ranges tile the LSNs from S. Read from the simulator and the
/// Delta tables, never through the engine's rebuild. Panics naming the
/// first difference.
pub async fn assert_targets_match_source(db: &SimDb, table: &TableName, wf_path: &Path) {
    let ctx = Context::open_read_only(Workflow::load(wf_path).unwrap()).await.unwrap();
    let columns = ctx.instance.columns.clone();
    let (bronze, facts) = (ctx.workflow.target.bronze.clone(), ctx.workflow.target.facts.clone());
    if let Some(silver) = ctx.workflow.target.silver.clone() {
        mssql_cdc::torture::silver_matches_table(db, table, &silver, &columns).await.unwrap_or_else(|e| panic!("silver against the table: {e}"));
    }
    let s = mssql_cdc::torture::bronze_matches_change_log(db, table, &bronze, &facts, &columns, ctx.row_filter())
        .await
        .unwrap_or_else(|e| panic!("bronze against the change log: {e}"));
    mssql_cdc::torture::batch_ranges_tile(&facts, &ctx.workflow.app_id, s).await.unwrap_or_else(|e| panic!("the facts' batch ranges: {e}"));
}

/// [`assert_targets_match_source`] from a test without a runtime of its own.
pub fn assert_targets_match_source_blocking(db: &SimDb, table: &TableName, wf_path: &Path) {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(assert_targets_match_source(db, table, wf_path));
}
