//! Keys under collations, end to end through the CLI binary.
//!
//! The simulator orders and equates strings by its own model of SQL Server's
//! collations (linguistic order; case, accents, width and trailing spaces as
//! the collation's name says) and binary values as SQL Server does
//! (padded with 0x00), never by the engine's helpers. Each table here holds
//! values that differ only in ways the column's collation ignores, or only in
//! ways a case-folding rule would ignore but the collation does not, and each
//! test compares silver (and bronze's snapshot rows) with the simulator's
//! rows, every column, as multisets.
//!
//! - A chunked snapshot cut on a non-unique string column whose MAX has
//!   copies that differ in case, width (`ｚ`) and trailing spaces: every
//!   one of them must be read once into bronze. Deciding "past MAX" in Rust ended the
//!   last chunk at `ｚ` and left every row equal to MAX out.
//! - The same on a varbinary column whose MAX has copies with trailing 0x00.
//! - A case-sensitive primary key (`Latin1_General_CS_AS`) with keys that
//!   differ only in case: distinct rows, in silver and in reconcile.
//! - A case-insensitive key updated in place to another case, read with
//!   before-images by default; with `row_filter = "all"` apply refuses.
//! - A heap chunked on a string column: `apply` refuses before writing.

mod common;

use std::path::PathBuf;

use common::model::{delta_rows, ok, run_cli, source_rows};
use mssql_cdc::sim::{SimDb, TableSpec};
use mssql_cdc::source::TableName;
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

struct Case {
    dir: tempfile::TempDir,
    db: SimDb,
    table: TableName,
    columns: Vec<ColumnDesc>,
    wf_path: PathBuf,
}

impl Case {
    /// A table `name` of `columns` holding `rows`, CDC on, and a workflow with `extra` TOML.
    fn new(name: &str, spec: TableSpec, rows: Vec<Vec<SqlValue>>, extra: &str) -> Case {
        let dir = tempfile::tempdir().unwrap();
        let db = SimDb::create(&dir.path().join("source.sqlite"), common::manual_config()).unwrap();
        let table = spec.name.clone();
        let columns = spec.columns.clone();
        db.create_table(&spec).unwrap();
        db.load_rows(&table, rows.into_iter()).unwrap();
        db.enable_cdc(&table, None, None).unwrap();
        db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
        common::settle(&db);
        let wf_path = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &wf_path,
            format!(
                "app_id = \"{name}\"\n[source]\nurl = \"sim://source.sqlite\"\n[table]\nname = \"{}\"\n\
                 [target]\nbronze = \"bronze\"\nfacts = \"facts\"\nsilver = \"silver\"\n{extra}",
                table.name
            ),
        )
        .unwrap();
        Case { dir, db, table, columns, wf_path }
    }

    fn ok(&self, args: &[&str]) -> serde_json::Value {
        ok(&self.wf_path, args)
    }

    fn location(&self, target: &str) -> String {
        self.dir.path().join(target).to_string_lossy().into_owned()
    }

    fn write(&self, f: impl FnOnce(&mut mssql_cdc::sim::SimTx<'_>, &TableName) -> mssql_cdc::sim::db::Result<()>) {
        let table = self.table.clone();
        self.db.transaction(|tx| f(tx, &table)).unwrap();
        self.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        common::settle(&self.db);
    }

    /// Silver must hold the simulator's rows: every column, every row, as a multiset.
    async fn assert_silver_is_the_table(&self, when: &str) {
        let source = source_rows(&self.db, &self.table, &self.columns).await;
        let silver = delta_rows(&self.location("silver"), &self.columns, "true").await;
        assert_eq!(silver, source, "{when}: silver (left) differs from the simulator's table (right)");
    }

    /// Streams, then reads waves of the chunked snapshot until it is complete.
    fn snapshot_to_completion(&self) {
        self.ok(&["stream"]);
        for wave in 0.. {
            let b = self.ok(&["backfill", "--max-waves", "1"]);
            self.ok(&["stream"]);
            if b["done"] == true {
                return;
            }
            assert!(wave < 200, "backfill never finished: {b}");
        }
    }
}

fn spec(name: &str, columns: Vec<ColumnDesc>, primary_key: &[&str], collations: &[(&str, &str)]) -> TableSpec {
    TableSpec {
        name: TableName::new("dbo", name),
        columns,
        primary_key: primary_key.iter().map(|s| s.to_string()).collect(),
        unique_index: vec![],
        collations: collations.iter().map(|(c, n)| (c.to_string(), n.to_string())).collect(),
    }
}

const CHUNKED: &str = "[snapshot]\nbootstrap = true\nmode = \"chunked\"\nkeys = [\"code\"]\nchunk_rows = 5\nparallelism = 2\ntarget_wave_seconds = 0\n";

/// A table keyed on `id`, chunked on the non-unique `code`; its largest codes
/// are several spellings of one value under the column's rules. The
/// snapshot's rows in bronze, then silver, must be the table's, every row once.
async fn chunked_on_a_non_unique_column(name: &str, code_type: SqlType, codes: Vec<SqlValue>) {
    let columns = vec![
        ColumnDesc::new("id", SqlType::Int, false),
        ColumnDesc::new("code", code_type, true),
        ColumnDesc::new("v", SqlType::Int, true),
    ];
    let rows: Vec<Vec<SqlValue>> =
        (0..codes.len() as i64 * 3).map(|i| vec![SqlValue::Int(i + 1), codes[i as usize % codes.len()].clone(), SqlValue::Int(i * 7)]).collect();
    let case = Case::new(name, spec(name, columns.clone(), &["id"], &[]), rows, CHUNKED);
    case.snapshot_to_completion();
    // Nothing was written during the snapshot: its rows are the table.
    let source = source_rows(&case.db, &case.table, &columns).await;
    let snapshot_rows = delta_rows(&case.location("bronze"), &columns, "_operation = 0").await;
    assert_eq!(snapshot_rows, source, "the snapshot's rows in bronze (left) differ from the simulator's table (right)");
    // Silver is keyed on the primary key, not on the repeated chunk column:
    // one silver row per source row.
    case.ok(&["apply"]);
    case.assert_silver_is_the_table("after the chunked snapshot").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_string_chunk_key_reads_every_spelling_of_max() {
    // Under the default collation (case-, width- and padding-insensitive,
    // accent-sensitive) the last four are one value, the table's MAX; its
    // order also puts digits and punctuation before letters, `10` before `9`
    // and `é` before `f`, unlike code-point order.
    let codes = ["apple", "Apple", "ápple", "-dash", "10", "9", "e", "é", "f", "Ｃherry", "cherry", "z", "Z", "\u{ff5a}", "z  "];
    let codes: Vec<SqlValue> = codes.iter().map(|s| SqlValue::Str(s.to_string())).collect();
    chunked_on_a_non_unique_column("codes", SqlType::NVarChar { len: Some(20) }, codes).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_binary_chunk_key_reads_every_padding_of_max() {
    // Binary values compare padded with 0x00: the last three are one value, the MAX.
    let codes: Vec<Vec<u8>> = vec![vec![0], vec![0, 1], vec![0, 0, 2], vec![0x00, 0xff], vec![0x01], vec![0x01, 0x00], vec![0x01, 0x00, 0x00]];
    let codes: Vec<SqlValue> = codes.into_iter().map(SqlValue::Bytes).collect();
    chunked_on_a_non_unique_column("blobs", SqlType::VarBinary { len: Some(8) }, codes).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn case_sensitive_keys_are_distinct_rows() {
    let columns = vec![ColumnDesc::new("code", SqlType::NVarChar { len: Some(10) }, false), ColumnDesc::new("v", SqlType::Int, true)];
    let row = |c: &str, v: i64| vec![SqlValue::Str(c.into()), SqlValue::Int(v)];
    let rows = vec![row("abc", 1), row("ABC", 2), row("Abc", 3), row("x", 4), row("X", 5), row("é", 6), row("E", 7)];
    let case = Case::new(
        "tags",
        spec("tags", columns, &["code"], &[("code", "Latin1_General_CS_AS")]),
        rows,
        "[snapshot]\nbootstrap = true\n[reconcile]\nbuckets = 4\nsample_fraction = 1.0\n",
    );
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    case.assert_silver_is_the_table("after the bootstrap").await;
    case.write(|tx, t| {
        tx.update(t, &vec![SqlValue::Str("ABC".into())], row("ABC", 20))?;
        tx.delete(t, &vec![SqlValue::Str("abc".into())])?;
        tx.insert(t, row("aBc", 30))?;
        tx.insert(t, row("abc", 40))
    });
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    case.assert_silver_is_the_table("after changes to keys that differ only in case").await;
    let r = case.ok(&["reconcile"]);
    assert_eq!(r["differences"], 0, "{r}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_case_insensitive_key_updated_to_another_case() {
    let columns = vec![ColumnDesc::new("code", SqlType::VarChar { len: Some(10) }, false), ColumnDesc::new("v", SqlType::Int, true)];
    let row = |c: &str, v: i64| vec![SqlValue::Str(c.into()), SqlValue::Int(v)];
    let rows = vec![row("abc", 1), row("def", 2), row("ghi", 3)];
    // The default row filter (`auto`) reads before-images for a string key:
    // the update's old spelling is only in its before-image.
    let case = Case::new("names", spec("names", columns, &["code"], &[]), rows, "[snapshot]\nbootstrap = true\n[reconcile]\nsample_fraction = 1.0\n");
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    // The same key under the collation, spelled otherwise: an update in place.
    case.write(|tx, t| {
        tx.update(t, &vec![SqlValue::Str("abc".into())], row("ABC", 10))?;
        tx.update(t, &vec![SqlValue::Str("DEF".into())], row("Def  ", 20))
    });
    case.ok(&["stream"]);
    case.ok(&["apply"]);
    case.assert_silver_is_the_table("after keys were updated to other spellings").await;
    let r = case.ok(&["reconcile"]);
    assert_eq!(r["differences"], 0, "{r}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_string_key_streamed_without_before_images_is_refused_by_apply() {
    let columns = vec![ColumnDesc::new("code", SqlType::VarChar { len: Some(10) }, false), ColumnDesc::new("v", SqlType::Int, true)];
    let rows = vec![vec![SqlValue::Str("abc".into()), SqlValue::Int(1)]];
    let case = Case::new("plain", spec("plain", columns, &["code"], &[]), rows, "[snapshot]\nbootstrap = true\n[stream]\nrow_filter = \"all\"\n");
    case.ok(&["stream"]);
    let (code, json, err) = run_cli(&case.wf_path, &["apply"]);
    assert_eq!(code, Some(2), "{json}\n{err}");
    assert!(err.contains("stream.row_filter") && err.contains("all update old") && err.contains("'code'"), "names the option and the key: {err}");
    assert!(!std::path::Path::new(&case.location("silver")).join("_delta_log").exists(), "nothing was written to silver");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_heap_chunked_on_a_string_column_is_refused_by_apply() {
    let columns = vec![ColumnDesc::new("code", SqlType::NVarChar { len: Some(10) }, true), ColumnDesc::new("v", SqlType::Int, true)];
    let rows: Vec<Vec<SqlValue>> = (0..30).map(|i| vec![SqlValue::Str(format!("c{}", i % 4)), SqlValue::Int(i)]).collect();
    let extra = format!("{CHUNKED}[stream]\nrow_filter = \"all update old\"\n");
    let case = Case::new("piles", spec("piles", columns, &[], &[]), rows, &extra);
    case.snapshot_to_completion();
    let (code, json, err) = run_cli(&case.wf_path, &["apply"]);
    assert_eq!(code, Some(2), "{json}\n{err}");
    assert!(err.contains("snapshot.keys") && err.contains("'code'"), "the refusal names the option and the column: {err}");
    assert!(!std::path::Path::new(&case.location("silver")).join("_delta_log").exists(), "nothing was written to silver");
}
