//! Silver tells rows apart by the capture instance's unique index, never by
//! `snapshot.keys`, end to end through the CLI binary.
//!
//! adr-0028 lets `snapshot.keys` name a column that repeats (chunks are cut
//! on it; a value never straddles two chunks). A table with a primary key,
//! chunked (or read in full) on such a column, must still give one silver
//! row per source row: silver keyed on the chunk column kept one row per
//! value (7 rows for a 140-row table). Changes land between waves: updates
//! that move a row to another chunk value, deletes, inserts. After every
//! `apply`, silver must hold the simulator's rows, every column, as a
//! multiset; `reconcile` must then report no difference.

use std::path::PathBuf;

mod common;
use common::model::{delta_rows, ok, source_rows};
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

const GROUPS: i64 = 7;

struct Case {
    dir: tempfile::TempDir,
    db: SimDb,
    table: TableName,
    wf_path: PathBuf,
}

fn columns() -> Vec<ColumnDesc> {
    vec![
        ColumnDesc::new("id", SqlType::Int, false),
        ColumnDesc::new("grp", SqlType::Int, true),
        ColumnDesc::new("note", SqlType::NVarChar { len: Some(30) }, true),
    ]
}

fn row(id: i64, grp: i64, note: &str) -> Vec<SqlValue> {
    vec![SqlValue::Int(id), SqlValue::Int(grp), SqlValue::Str(note.into())]
}

impl Case {
    /// `orders(id PK, grp, note)` with 140 rows spread over 7 values of
    /// `grp`, CDC on, and a workflow cutting snapshots on `grp`.
    fn new(snapshot_toml: &str) -> Case {
        let dir = tempfile::tempdir().unwrap();
        let db = SimDb::create(&dir.path().join("source.sqlite"), common::manual_config()).unwrap();
        let table = TableName::new("dbo", "orders");
        db.create_table(&TableSpec {
            name: table.clone(),
            columns: columns(),
            primary_key: vec!["id".into()],
            unique_index: vec![],
            collations: Default::default(),
        })
        .unwrap();
        db.load_rows(&table, (1..=140).map(|id| row(id, id % GROUPS, "loaded"))).unwrap();
        db.enable_cdc(&table, None, None).unwrap();
        db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
        common::settle(&db);
        let wf_path = dir.path().join("orders.toml");
        std::fs::write(
            &wf_path,
            format!(
                "app_id = \"orders\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"orders\"\n\
                 [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n\
                 [snapshot]\nbootstrap = true\nkeys = [\"grp\"]\n{snapshot_toml}\n[reconcile]\nsample_fraction = 1.0\n"
            ),
        )
        .unwrap();
        Case { dir, db, table, wf_path }
    }

    fn ok(&self, args: &[&str]) -> serde_json::Value {
        ok(&self.wf_path, args)
    }

    fn write(&self, f: impl FnOnce(&mut mssql_cdc::sim::SimTx<'_>, &TableName) -> mssql_cdc::sim::db::Result<()>) {
        let table = self.table.clone();
        self.db.transaction(|tx| f(tx, &table)).unwrap();
        self.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        common::settle(&self.db);
    }

    /// Changes of round `n`: a row moved to another group, a note changed,
    /// a delete and an insert.
    fn changes(&self, n: i64) {
        self.write(|tx, t| {
            tx.update(t, &vec![SqlValue::Int(n * 3)], row(n * 3, (n * 3 + 1) % GROUPS, &format!("moved in round {n}")))?;
            tx.update(t, &vec![SqlValue::Int(n * 5 + 1)], row(n * 5 + 1, (n * 5 + 1) % GROUPS, &format!("noted in round {n}")))?;
            tx.delete(t, &vec![SqlValue::Int(100 + n)])?;
            tx.insert(t, row(200 + n, n % GROUPS, &format!("inserted in round {n}")))
        });
    }

    /// The shared reference check (tests/common), once streamed until caught
    /// up and applied: silver equals the table on every column, bronze's
    /// change rows (the changes of every round, all after S) equal the
    /// simulator's change function from S, and the facts' batch ranges tile
    /// the LSNs from S.
    async fn assert_targets_match_source(&self) {
        let mut calls = 0;
        while self.ok(&["stream"])["caught_up"] != true {
            calls += 1;
            assert!(calls < 50, "the stream did not catch up in 50 calls");
        }
        self.ok(&["apply"]);
        common::assert_targets_match_source(&self.db, &self.table, &self.wf_path).await;
    }

    async fn assert_silver_is_the_table(&self, when: &str) {
        let source = source_rows(&self.db, &self.table, &columns()).await;
        let silver = delta_rows(&self.dir.path().join("silver").to_string_lossy(), &columns(), "true").await;
        assert_eq!(silver, source, "{when}: silver (left) differs from the simulator's table (right)");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chunked_snapshot_on_a_repeated_column_keeps_every_row_in_silver() {
    let case = Case::new("mode = \"chunked\"\nchunk_rows = 20\nparallelism = 1\ntarget_wave_seconds = 0");
    case.ok(&["stream"]);
    for round in 1.. {
        let b = case.ok(&["backfill", "--max-waves", "1"]);
        case.changes(round);
        case.ok(&["stream"]);
        case.ok(&["apply"]);
        if b["done"] == true {
            break;
        }
        assert!(round < 20, "backfill never finished: {b}");
    }
    case.assert_silver_is_the_table("after the chunked snapshot completed").await;
    case.changes(25);
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    case.assert_silver_is_the_table("after changes past the snapshot").await;
    let r = case.ok(&["reconcile"]);
    assert_eq!(r["differences"], 0, "{r}");
    case.assert_targets_match_source().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_snapshot_ranged_on_a_repeated_column_keeps_every_row_in_silver() {
    let case = Case::new("mode = \"full\"");
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    case.assert_silver_is_the_table("after the full snapshot").await;
    case.changes(1);
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    case.assert_silver_is_the_table("after changes").await;
    let r = case.ok(&["reconcile"]);
    assert_eq!(r["differences"], 0, "{r}");
    case.assert_targets_match_source().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_silver_keyed_on_other_columns_is_refused_before_apply_writes() {
    // Silver records the key it was built on (`mssql_cdc.silver_keys`): here
    // `id`, the primary key. A silver whose recorded key differs (built by an
    // older rule on `snapshot.keys`, or before the capture instance's index
    // changed) would be merged on columns its rows were never told apart by.
    let case = Case::new("mode = \"full\"");
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    let silver = case.dir.path().join("silver").to_string_lossy().into_owned();
    let t = mssql_cdc::delta::open_existing(&silver, &Default::default()).await.unwrap().unwrap();
    let recorded = t.snapshot().unwrap().metadata().configuration().get(mssql_cdc::delta::PROP_SILVER_KEYS).cloned();
    assert_eq!(recorded.as_deref(), Some("id"), "silver records the unique index it is keyed on");
    let _ = t
        .set_tbl_properties()
        .with_properties([(mssql_cdc::delta::PROP_SILVER_KEYS.to_string(), "grp".to_string())].into())
        .with_raise_if_not_exists(false)
        .await
        .unwrap();
    let version_before = mssql_cdc::delta::open_existing(&silver, &Default::default()).await.unwrap().unwrap().version();
    case.changes(1);
    case.ok(&["stream"]);
    let (code, json, err) = common::model::run_cli(&case.wf_path, &["apply"]);
    assert_eq!(code, Some(2), "{json}\n{err}");
    assert!(err.contains("keyed on (grp)") && err.contains("(id)"), "names both keys: {err}");
    let version_after = mssql_cdc::delta::open_existing(&silver, &Default::default()).await.unwrap().unwrap().version();
    assert_eq!(version_before, version_after, "nothing was written to silver");
}
