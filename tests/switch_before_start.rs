//! A capture instance newer than bronze at the stream's start: a call made
//! before a column was added (and a second instance enabled) created bronze
//! with the first instance's columns, and the stream then starts on the
//! newer one. Found by the torture tester's switch schedules: the snapshot
//! rows were cut to bronze's columns (the added column's values lost) and
//! `apply` failed with exit 1 selecting the column from bronze; `reconcile`
//! after the switch and before an apply failed the same way on silver.

use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

mod common;

use common::{item_row, ok, step, Scenario};

const CHUNKED_WITH_SILVER: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 1\nchunk_rows = 10\n\
                                   target_wave_seconds = 0\n[stream]\nmax_batch_rows = 1000\n";

fn with_extra(id: i64, version: i64, extra: i64) -> Vec<SqlValue> {
    let mut row = item_row(id, version);
    row.push(SqlValue::Int(extra));
    row
}

#[test]
fn a_snapshot_on_an_instance_newer_than_bronze_keeps_the_added_column_everywhere() {
    let s = Scenario::new(25, CHUNKED_WITH_SILVER);
    // The first call, before the column exists: bronze is created from
    // dbo_items. (apply finds nothing to apply yet; how it says so is not
    // what this test is about.)
    let (code, out) = step(&s, &["apply"], &[]);
    assert!(s.path().join("bronze/_delta_log").exists(), "the first call created bronze (exit {code}: {out})");

    s.db.add_column(&s.table, ColumnDesc::new("extra", SqlType::Int, true)).unwrap();
    s.db.enable_cdc(&s.table, Some("dbo_items_v2"), None).unwrap();
    let table = s.table.clone();
    s.db.transaction(|tx| {
        for id in [2, 11, 23] {
            tx.update(&table, &vec![SqlValue::Int(id)], with_extra(id, 5, id * 100))?;
        }
        tx.insert(&table, with_extra(26, 0, 2600))
    })
    .unwrap();

    // backfill opens the chunked snapshot (on the newer instance, whose
    // start is before S), then stream and backfill in turn until it is done.
    let mut done = false;
    for _ in 0..50 {
        if ok(&s, &["backfill"])["done"] == true {
            done = true;
            break;
        }
        ok(&s, &["stream"]);
    }
    assert!(done, "backfill did not finish");
    common::cli_stream_until_caught_up(&s);

    // reconcile before any apply since the instance changed: a call-again, never a bug exit.
    let (code, out) = step(&s, &["reconcile"], &[]);
    assert!(code == 75 || code == 0 || code == 2, "reconcile before apply: exit {code}: {out}");
    ok(&s, &["apply"]);
    ok(&s, &["reconcile"]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Silver against the table (every column, `extra` too), bronze against
    // the newer instance's change log from S, the batch ranges tiling.
    rt.block_on(s.assert_matches_source());
}
