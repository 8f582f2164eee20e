//! A deterministic scenario over the simulator: a manual clock, a fixed
//! seed, a small table, and the steps run in process.
#![allow(dead_code)]

pub mod model;

use std::path::{Path, PathBuf};

use chrono::{TimeZone, Utc};
use mssql_cdc::delta::golden;
use mssql_cdc::engine::rebuild::{self, Comparison};
use mssql_cdc::engine::{self, Context};
use mssql_cdc::error::StepResult;
use mssql_cdc::sim::{Clock, SimConfig, SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};
use mssql_cdc::workflow::Workflow;

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
        capture_lag_ms: 0,
        idle_interval_seconds: 1,
        ..SimConfig::default()
    }
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
        db.capture().unwrap();
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

    pub async fn stream(&self) -> StepResult<engine::stream::StreamResult> {
        let mut ctx = self.context().await?;
        engine::stream::run(&mut ctx).await
    }

    /// Streams until caught up (a step that fails is an error of the test).
    pub async fn stream_until_caught_up(&self) {
        for _ in 0..100 {
            let r = self.stream().await.unwrap();
            if r.caught_up {
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
