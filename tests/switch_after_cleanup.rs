//! Capture-instance starts that the switch rule met wrongly. First, cleanup
//! past a newer capture instance's start. SQL Server's cleanup
//! raises every instance's start LSN to its low watermark, so once it passes
//! the newer instance's start both instances start at the same LSN. The
//! switch rule took "newer" as "starts later" only: after the re-snapshot
//! that the purge causes, the stream stayed on the older instance for good,
//! and every later change lost the added column (NULL in bronze and silver
//! where the table holds a value). Found by the torture tester's schedules
//! that clean up past a switch. Two fixes make it pass: the switch rule
//! takes the later-created instance as the newer one at an equal start
//! (`engine::switch::plan`, whose unit test shows the old rule's failure),
//! and the re-snapshot reads with the instance the stream reads from its S
//! on (`engine::recover`), without which the keys untouched since the
//! cleanup keep NULL in the added column.

use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

mod common;

use common::{item_row, ok, Scenario};

fn with_extra(id: i64, version: i64, extra: i64) -> Vec<SqlValue> {
    let mut row = item_row(id, version);
    row.push(SqlValue::Int(extra));
    row
}

#[test]
fn cleanup_past_the_newer_instances_start_still_moves_the_stream_to_it() {
    let s = Scenario::new(
        12,
        "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\non_data_loss = \"resnapshot\"\n",
    );
    common::cli_stream_until_caught_up(&s);
    ok(&s, &["apply"]);

    // A column is added and captured by a second instance; the writer sets it.
    s.db.add_column(&s.table, ColumnDesc::new("extra", SqlType::Int, true)).unwrap();
    s.db.enable_cdc(&s.table, Some("dbo_items_v2"), None).unwrap();
    let table = s.table.clone();
    s.db.transaction(|tx| {
        for id in [2, 5, 9] {
            tx.update(&table, &vec![SqlValue::Int(id)], with_extra(id, 3, id * 100))?;
        }
        tx.insert(&table, with_extra(13, 0, 1300))
    })
    .unwrap();
    common::settle(&s.db);
    let starts = |s: &Scenario| -> Vec<(String, Option<mssql_cdc::lsn::Lsn>)> {
        s.db.capture_instances(&s.table).unwrap().into_iter().map(|i| (i.name, i.start_lsn)).collect()
    };
    let before = starts(&s);
    assert!(before[1].1 > before[0].1, "the newer instance starts later: {before:?}");

    // Before the stream reaches the newer start, cleanup passes it.
    let watermark = s.db.max_lsn().unwrap().unwrap();
    s.db.cleanup_to_lsn(watermark).unwrap();
    let after = starts(&s);
    assert_eq!(after[0].1, after[1].1, "cleanup raised both starts to its watermark: {after:?}");

    // More changes to the added column after the cleanup.
    s.db.transaction(|tx| {
        tx.update(&table, &vec![SqlValue::Int(3)], with_extra(3, 4, 333))?;
        tx.insert(&table, with_extra(14, 0, 1400))
    })
    .unwrap();
    common::settle(&s.db);

    // The purge is a data loss: the stream re-snapshots, and must read the
    // newer instance from then on.
    common::cli_stream_until_caught_up(&s);
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(9)], with_extra(9, 5, 999))).unwrap();
    common::cli_stream_until_caught_up(&s);
    let status = ok(&s, &["status"]);
    assert_eq!(status["capture_instance"], "dbo_items_v2", "the stream follows the newer instance: {status}");
    ok(&s, &["apply"]);
    ok(&s, &["reconcile"]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Silver against the table, every column (`extra` too: keys 2 and 5 got
    // theirs before the cleanup and no change since, so only a re-snapshot
    // read with the newer instance's columns holds them); bronze's rebuild
    // against the table. (The change-log check of the common helpers reads
    // generation 0's streamed range, which this cleanup purged.)
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        assert_eq!(ctx.instance.name, "dbo_items_v2");
        let silver = ctx.workflow.target.silver.clone().expect("the workflow has silver");
        mssql_cdc::torture::silver_matches_table(&s.db, &s.table, &silver, &ctx.instance.columns)
            .await
            .unwrap_or_else(|e| panic!("silver against the table: {e}"));
        let cmp = s.verify().await;
        assert_eq!(cmp.differences(), 0, "{cmp:?}");
    });
}

/// A new stream whose newest capture instance starts above the max LSN.
/// SQL Server sets a new instance's start when the capture job first scans
/// past its creation, and while the job lags (commits still to capture) that
/// start is above `fn_cdc_get_max_lsn()`. A bootstrap taken then is at an S
/// below the newest instance's start: started on the newest, the stream
/// found its first changes missing and exited 3 as if cleanup had purged
/// them (torture schedule 338). It must start on the older instance, which
/// holds them, and switch at the newer one's start.
#[test]
fn a_new_stream_starts_on_the_instance_that_holds_its_first_changes() {
    let s = Scenario::new(10, "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"full\"\n[stream]\nmax_batch_rows = 1000\n");
    let table = s.table.clone();
    // Commits the capture job has not taken yet (inside the shared lag).
    for id in [2, 4] {
        s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(id)], item_row(id, 7))).unwrap();
    }
    s.db.add_column(&s.table, ColumnDesc::new("extra", SqlType::Int, true)).unwrap();
    s.db.enable_cdc(&s.table, Some("dbo_items_v2"), None).unwrap();
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(6)], with_extra(6, 8, 600))).unwrap();
    let max = s.db.max_lsn().unwrap();
    let v2_start = s.db.capture_instances(&s.table).unwrap()[1].start_lsn;
    assert!(v2_start > max, "the newer instance starts above the max LSN: {v2_start:?} > {max:?}");

    // The first call bootstraps now, below the newer instance's start.
    let first = ok(&s, &["stream"]);
    assert!(first["bootstrap"].is_object(), "the first call bootstrapped: {first}");
    common::cli_stream_until_caught_up(&s);
    s.db.transaction(|tx| tx.update(&table, &vec![SqlValue::Int(8)], with_extra(8, 9, 800))).unwrap();
    common::cli_stream_until_caught_up(&s);
    let status = ok(&s, &["status"]);
    assert_eq!(status["capture_instance"], "dbo_items_v2", "the stream switched at the newer start: {status}");
    ok(&s, &["apply"]);
    ok(&s, &["reconcile"]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let ctx = s.context().await.unwrap();
        let silver = ctx.workflow.target.silver.clone().expect("the workflow has silver");
        mssql_cdc::torture::silver_matches_table(&s.db, &s.table, &silver, &ctx.instance.columns)
            .await
            .unwrap_or_else(|e| panic!("silver against the table: {e}"));
        let cmp = s.verify().await;
        assert_eq!(cmp.differences(), 0, "{cmp:?}");
    });
}
