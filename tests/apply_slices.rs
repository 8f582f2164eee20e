//! `apply` in slices (`[apply] slice_rows`, `max_seconds`), through the CLI.
//!
//! An apply that lags the stream takes the lag in slices cut where a stream
//! batch ends, each with its own MERGE and control row. The check is
//! against the simulator, not the engine: every transaction's commit LSN (as
//! the simulator returns it) is recorded with the simulator's whole table
//! after it, and after every slice silver must be, every row and every
//! column, the table as it stood after the last transaction at or below the
//! slice's applied LSN. A slice that cut a transaction, took rows past its
//! end, or moved the applied LSN past what it merged would show here.

mod common;

use common::model::{delta_rows, source_rows, Multiset};
use common::{cli_stream_until_caught_up, item_row, items_spec, ok, settle, Scenario};
use mssql_cdc::types::SqlValue;

const SLICE_ROWS: i64 = 100;
const BIG_TRANSACTION_ROWS: i64 = 140;

fn workflow(max_seconds: u64) -> String {
    format!(
        "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 30\n\
         [apply]\nslice_rows = {SLICE_ROWS}\nmax_seconds = {max_seconds}\n"
    )
}

/// `n` transactions of about ten rows each (updates across the table, a
/// delete every third, a key deleted earlier put back, a new key), then one
/// of `BIG_TRANSACTION_ROWS` updates, larger than a slice. Returns each
/// transaction's commit LSN (hex) with the simulator's table after it.
async fn transactions(s: &mut Scenario, first: i64, n: i64) -> Vec<(String, Multiset)> {
    let columns = items_spec(&s.table).columns;
    let table = s.table.clone();
    let mut history = Vec::new();
    for t in first..first + n {
        let lsn = s
            .db
            .transaction(|tx| {
                for j in 0..8 {
                    let id = (t * 5 + j) % 140 + 1;
                    tx.update(&table, &vec![SqlValue::Int(id)], item_row(id, t + 1))?;
                }
                // Keys 150.. are deleted and put back one transaction later.
                let r = t - first;
                if r % 3 == 0 {
                    tx.delete(&table, &vec![SqlValue::Int(150 + r)])?;
                }
                if r % 3 == 1 {
                    tx.insert(&table, item_row(150 + r - 1, t + 1))?;
                }
                tx.insert(&table, item_row(1000 + t, 0))
            })
            .unwrap();
        s.db.advance_clock(std::time::Duration::from_secs(1)).unwrap();
        history.push((lsn.to_hex(), source_rows(&s.db, &table, &columns).await));
    }
    let big = s
        .db
        .transaction(|tx| {
            for id in 1..=BIG_TRANSACTION_ROWS {
                tx.update(&table, &vec![SqlValue::Int(id)], item_row(id, 5000 + first))?;
            }
            Ok(())
        })
        .unwrap();
    history.push((big.to_hex(), source_rows(&s.db, &table, &columns).await));
    settle(&s.db);
    history
}

async fn silver(s: &Scenario) -> Multiset {
    delta_rows(&s.path().join("silver").to_string_lossy(), &items_spec(&s.table).columns, "true").await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lagging_apply_goes_on_in_slices_and_silver_is_the_table_at_every_slices_end() {
    let mut s = Scenario::new(200, &workflow(0));
    let columns = items_spec(&s.table).columns;
    cli_stream_until_caught_up(&s);
    let rebuilt = ok(&s, &["apply"]);
    assert_eq!((rebuilt["action"].as_str(), rebuilt["more"].as_bool()), (Some("rebuild"), Some(false)), "{rebuilt}");
    let base = source_rows(&s.db, &s.table, &columns).await;
    assert_eq!(silver(&s).await, base, "after the bootstrap's rebuild");

    // Phase 1: one slice per call (max_seconds = 0) until silver has caught up.
    let history = transactions(&mut s, 0, 24).await;
    cli_stream_until_caught_up(&s);
    let mut applied_before = rebuilt["applied_lsn"].as_str().unwrap().to_string();
    let mut seq_before = rebuilt["seq"].as_i64().unwrap();
    let mut calls = 0;
    loop {
        calls += 1;
        assert!(calls < 100, "apply never caught up");
        let r = ok(&s, &["apply"]);
        assert_eq!(r["action"], "changes", "{r}");
        assert_eq!(r["slices"], 1, "max_seconds = 0: one slice per call: {r}");
        assert_eq!(r["seq"].as_i64(), Some(seq_before + 1), "one control row per slice: {r}");
        let applied = r["applied_lsn"].as_str().unwrap().to_string();
        assert!(applied > applied_before, "the slice moved the applied LSN: {r}");
        assert_eq!(r["finalized_until"].as_str(), Some(applied.as_str()), "no snapshot holds the verdict: {r}");
        let held = r["source_rows"].as_i64().unwrap();
        assert!(held <= SLICE_ROWS.max(BIG_TRANSACTION_ROWS), "a slice holds at most slice_rows, or one batch larger than that: {r}");
        let expected = history.iter().rev().find(|(lsn, _)| *lsn <= applied).map(|(_, rows)| rows).unwrap_or(&base);
        assert_eq!(&silver(&s).await, expected, "after apply call {calls} (applied {applied}): silver (left) is not the table as of that LSN (right)");
        applied_before = applied;
        seq_before += 1;
        if r["more"] == false {
            break;
        }
    }
    // About 250 change rows in batches of 30 or so, and one batch of 140.
    assert!(calls >= 4, "the lag was taken in {calls} slices");
    assert_eq!(silver(&s).await, source_rows(&s.db, &s.table, &columns).await, "caught up");
    assert_eq!(ok(&s, &["apply"])["action"], "nothing");

    // Phase 2: with time to spare, one call takes every slice.
    s.write_workflow(&workflow(600));
    transactions(&mut s, 100, 24).await;
    cli_stream_until_caught_up(&s);
    let r = ok(&s, &["apply"]);
    let slices = r["slices"].as_i64().unwrap();
    assert!(slices >= 3 && r["more"] == false, "{r}");
    assert_eq!(r["seq"].as_i64(), Some(seq_before + slices), "each slice wrote its control row: {r}");
    assert!(r["rows_upserted"].as_i64().unwrap() >= BIG_TRANSACTION_ROWS, "the slices' rows add up: {r}");
    assert_eq!(silver(&s).await, source_rows(&s.db, &s.table, &columns).await, "after one call of {slices} slices");
}
