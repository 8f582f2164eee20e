//! Behaviour tests of the simulator through its admin API and the source trait.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use deltalake::arrow::array::{Array, FixedSizeBinaryArray, Int32Array};
use deltalake::arrow::record_batch::RecordBatch;
use futures::StreamExt;

use crate::lsn::Lsn;
use crate::source::*;
use crate::types::{value_at, ColumnDesc, SqlType, SqlValue};

use super::*;

fn manual(start: &str, tick_ms: u64) -> SimConfig {
    SimConfig {
        clock: Clock::Manual { start: start.parse::<DateTime<Utc>>().unwrap(), tick_ms },
        allow_snapshot_isolation: true,
        ..SimConfig::default()
    }
}

fn orders() -> TableName {
    TableName::new("dbo", "orders")
}

/// A file with the orders table holding `rows` rows and CDC enabled.
fn setup(cfg: SimConfig, rows: u64) -> (tempfile::TempDir, SimDb, SimSource, CaptureInstance) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.sim");
    let db = SimDb::create(&path, cfg).unwrap();
    db.create_table(&orders_table_spec(orders())).unwrap();
    db.load_rows(&orders(), orders_rows(rows, 3)).unwrap();
    let ci = db.enable_cdc(&orders(), None, None).unwrap();
    let src = SimSource::open(&path).unwrap();
    (dir, db, src, ci)
}

fn order(id: i64, status: &str) -> Vec<SqlValue> {
    vec![
        SqlValue::Int(id),
        SqlValue::Str(format!("c{id}")),
        SqlValue::Decimal { value: id as i128 * 100, scale: 2 },
        SqlValue::Str(status.into()),
        SqlValue::DateTime(NaiveDate::from_ymd_opt(2026, 1, 1).unwrap().and_hms_opt(0, 0, 0).unwrap()),
        SqlValue::Null,
    ]
}

async fn collect(s: BatchStream) -> (Vec<RecordBatch>, Option<SourceError>) {
    let mut s = s;
    let mut out = Vec::new();
    while let Some(b) = s.next().await {
        match b {
            Ok(b) => out.push(b),
            Err(e) => return (out, Some(e)),
        }
    }
    (out, None)
}

#[derive(Debug, Clone, PartialEq)]
struct Chg {
    lsn: Lsn,
    seq: Lsn,
    op: i32,
    cmd: i32,
    time: Option<NaiveDateTime>,
    vals: Vec<SqlValue>,
}

async fn changes(src: &SimSource, ci: &CaptureInstance, from: Lsn, to: Lsn, f: RowFilter) -> Vec<Chg> {
    let (batches, err) = collect(src.changes(ci, from, to, f, 3).await.unwrap()).await;
    assert!(err.is_none(), "{err:?}");
    let mut out = Vec::new();
    for b in batches {
        assert!(b.num_rows() <= 3);
        let lsn = b.column(0).as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
        let seq = b.column(1).as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
        let op = b.column(2).as_any().downcast_ref::<Int32Array>().unwrap();
        let cmd = b.column(3).as_any().downcast_ref::<Int32Array>().unwrap();
        for r in 0..b.num_rows() {
            let time = match value_at(b.column(4).as_ref(), r, &SqlType::DateTime2 { scale: 6 }) {
                SqlValue::DateTime(t) => Some(t),
                _ => None,
            };
            out.push(Chg {
                lsn: Lsn(lsn.value(r).try_into().unwrap()),
                seq: Lsn(seq.value(r).try_into().unwrap()),
                op: op.value(r),
                cmd: cmd.value(r),
                time,
                vals: ci.columns.iter().enumerate().map(|(i, c)| value_at(b.column(5 + i).as_ref(), r, &c.sql_type)).collect(),
            });
        }
    }
    out
}

async fn read_all(src: &SimSource, cols: &[ColumnDesc], keys: &[&str], range: KeyRange, iso: Isolation) -> Result<Vec<Vec<SqlValue>>, SourceError> {
    let read = SnapshotRead {
        table: orders(),
        columns: cols.to_vec(),
        keys: keys.iter().map(|s| s.to_string()).collect(),
        range,
        isolation: iso,
        batch_rows: 64,
    };
    let (batches, err) = collect(src.snapshot_read(&read).await?).await;
    if let Some(e) = err {
        return Err(e);
    }
    let mut rows = Vec::new();
    for b in batches {
        for r in 0..b.num_rows() {
            rows.push(cols.iter().enumerate().map(|(i, c)| value_at(b.column(i).as_ref(), r, &c.sql_type)).collect());
        }
    }
    Ok(rows)
}

#[tokio::test]
async fn lsns_increase_and_a_transaction_shares_its_commit_lsn() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 0);
    assert_eq!(src.max_lsn().await.unwrap(), None);
    let l1 = db
        .transaction(|tx| {
            for id in 1..=3 {
                tx.insert(&orders(), order(id, "new"))?;
            }
            Ok(())
        })
        .unwrap();
    let l2 = db.transaction(|tx| tx.insert(&orders(), order(4, "new"))).unwrap();
    assert!(l2 > l1 && l1 > ci.start_lsn.unwrap());
    assert_eq!(src.max_lsn().await.unwrap(), Some(l2));
    let rows = changes(&src, &ci, ci.start_lsn.unwrap(), l2, RowFilter::AllUpdateOld).await;
    assert_eq!(rows.len(), 4);
    assert!(rows[..3].iter().all(|r| r.lsn == l1 && r.op == 2));
    assert_eq!(rows.iter().map(|r| r.cmd).collect::<Vec<_>>(), vec![1, 2, 3, 1]);
    assert!(rows[0].seq < rows[1].seq && rows[1].seq < rows[2].seq && rows[2].seq < l1);
    assert_eq!(rows[3].lsn, l2);
    assert_eq!(rows[0].vals[0], SqlValue::Int(1));
    // The commit time comes from the manual clock: start + 10 ms.
    let t1 = src.lsn_to_time(l1).await.unwrap().unwrap();
    assert_eq!(t1, NaiveDate::from_ymd_opt(2026, 3, 1).unwrap().and_hms_milli_opt(12, 0, 0, 10).unwrap());
    assert_eq!(rows[0].time, Some(t1));
    assert_eq!(src.increment_lsn(l1).await.unwrap(), Lsn::from_u128(l1.to_u128() + 1));
}

#[tokio::test]
async fn capture_lag_holds_max_lsn_back() {
    let mut cfg = manual("2026-03-01T12:00:00Z", 10);
    cfg.capture_lag_ms = 1000;
    let (_d, db, src, _ci) = setup(cfg, 0);
    let l1 = db.transaction(|tx| tx.insert(&orders(), order(1, "new"))).unwrap();
    assert_eq!(src.max_lsn().await.unwrap(), None);
    db.advance_clock(Duration::from_millis(500)).unwrap();
    let l2 = db.transaction(|tx| tx.insert(&orders(), order(2, "new"))).unwrap();
    assert_eq!(src.max_lsn().await.unwrap(), None);
    db.advance_clock(Duration::from_millis(500)).unwrap();
    assert_eq!(src.max_lsn().await.unwrap(), Some(l1));
    db.advance_clock(Duration::from_millis(600)).unwrap();
    assert_eq!(src.max_lsn().await.unwrap(), Some(l2));
    let st = db.status().unwrap();
    assert_eq!(st["pending_transactions"], 0);
}

#[tokio::test]
async fn updates_become_3_4_and_key_updates_1_2() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 5);
    let k = vec![SqlValue::Int(2)];
    let l1 = db.transaction(|tx| tx.update(&orders(), &k, order(2, "paid"))).unwrap();
    let l2 = db.transaction(|tx| tx.update(&orders(), &k, order(20, "moved"))).unwrap();
    let l3 = db.transaction(|tx| tx.delete(&orders(), &vec![SqlValue::Int(3)])).unwrap();
    let all_old = changes(&src, &ci, ci.start_lsn.unwrap(), l3, RowFilter::AllUpdateOld).await;
    let ops: Vec<(Lsn, i32)> = all_old.iter().map(|r| (r.lsn, r.op)).collect();
    assert_eq!(ops, vec![(l1, 3), (l1, 4), (l2, 1), (l2, 2), (l3, 1)]);
    let orig = orders_rows(5, 3).nth(1).unwrap();
    assert_eq!(all_old[0].vals[3], orig[3], "the before-image holds the old status");
    assert_eq!(all_old[1].vals[3], SqlValue::Str("paid".into()));
    assert_eq!(all_old[2].seq, all_old[3].seq, "a key update's delete and insert share a seqval");
    assert_eq!(all_old[2].vals[0], SqlValue::Int(2));
    assert_eq!(all_old[3].vals[0], SqlValue::Int(20));
    let all = changes(&src, &ci, ci.start_lsn.unwrap(), l3, RowFilter::All).await;
    assert_eq!(all.iter().map(|r| r.op).collect::<Vec<_>>(), vec![4, 1, 2, 1]);
}

#[tokio::test]
async fn out_of_range_reads_fail_with_313() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 0);
    let min = ci.start_lsn.unwrap();
    // Before any capture there is no max LSN.
    let e = src.changes(&ci, min, min, RowFilter::All, 10).await.err().unwrap();
    assert!(matches!(e, SourceError::RangeUnavailable { .. }), "{e}");
    let l1 = db.transaction(|tx| tx.insert(&orders(), order(1, "new"))).unwrap();
    assert_eq!(src.max_lsn().await.unwrap(), Some(l1));
    for (from, to) in [(min.decrement(), l1), (min, l1.increment()), (l1, min)] {
        match src.changes(&ci, from, to, RowFilter::All, 10).await {
            Err(SourceError::RangeUnavailable { capture_instance, .. }) => assert_eq!(capture_instance, ci.name),
            other => panic!("expected 313 for {from}..{to}, got {:?}", other.map(|_| ())),
        }
    }
    assert!(src.changes(&ci, min, l1, RowFilter::All, 10).await.is_ok());
    assert_eq!(src.min_lsn("no_such_instance").await.unwrap(), None);
    assert_eq!(src.min_lsn(&ci.name).await.unwrap(), Some(min));
}

#[tokio::test]
async fn cleanup_moves_min_lsn_and_purges_rows_and_mapping() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 0);
    let mut lsns = Vec::new();
    for id in 1..=4 {
        lsns.push(db.transaction(|tx| tx.insert(&orders(), order(id, "new"))).unwrap());
        db.advance_clock(Duration::from_secs(3600)).unwrap();
    }
    db.capture().unwrap();
    // Commit times are 0h, 1h, 2h, 3h (+ ticks); keep 90 minutes: the last two stay.
    let r = db.cleanup(Some(90)).unwrap();
    assert_eq!(r.watermark, Some(lsns[2]));
    assert_eq!(r.change_rows_deleted, 2);
    assert_eq!(r.mapping_rows_deleted, 2);
    assert_eq!(src.min_lsn(&ci.name).await.unwrap(), Some(lsns[2]));
    assert!(matches!(src.changes(&ci, lsns[0], lsns[3], RowFilter::All, 10).await, Err(SourceError::RangeUnavailable { .. })));
    let rows = changes(&src, &ci, lsns[2], lsns[3], RowFilter::All).await;
    assert_eq!(rows.len(), 2);
    assert_eq!(src.lsn_to_time(lsns[0]).await.unwrap(), None);
    assert!(src.lsn_to_time(lsns[2]).await.unwrap().is_some());
    // The watermark never moves down.
    let r = db.cleanup_to_lsn(lsns[1]).unwrap();
    assert_eq!(r.instances[0].2, Some(lsns[2]));
    db.cleanup_to_lsn(lsns[3]).unwrap();
    assert_eq!(src.min_lsn(&ci.name).await.unwrap(), Some(lsns[3]));
}

#[tokio::test]
async fn time_to_lsn_operators_ties_and_rounding() {
    // tick 0: transactions share their commit time until the clock is advanced.
    let (_d, db, src, _ci) = setup(manual("2026-03-01T12:00:00Z", 0), 0);
    let a = db.transaction(|tx| tx.insert(&orders(), order(1, "new"))).unwrap();
    let b = db.transaction(|tx| tx.insert(&orders(), order(2, "new"))).unwrap();
    db.advance_clock(Duration::from_secs(1)).unwrap();
    let c = db.transaction(|tx| tx.insert(&orders(), order(3, "new"))).unwrap();
    let t = NaiveDate::from_ymd_opt(2026, 3, 1).unwrap().and_hms_opt(12, 0, 0).unwrap();
    let q = |op, t| src.time_to_lsn(op, t);
    assert_eq!(q(TimeOp::LargestLessThan, t).await.unwrap(), None);
    assert_eq!(q(TimeOp::LargestLessThanOrEqual, t).await.unwrap(), Some(b));
    assert_eq!(q(TimeOp::SmallestGreaterThanOrEqual, t).await.unwrap(), Some(a));
    assert_eq!(q(TimeOp::SmallestGreaterThan, t).await.unwrap(), Some(c));
    // 1 ms before rounds up onto t; 1 ms after rounds down onto t.
    let ms = chrono::Duration::milliseconds(1);
    assert_eq!(q(TimeOp::LargestLessThanOrEqual, t - ms).await.unwrap(), Some(b));
    assert_eq!(q(TimeOp::SmallestGreaterThanOrEqual, t + ms).await.unwrap(), Some(a));
    // 2 ms after stays above t (rounds to .003).
    assert_eq!(q(TimeOp::SmallestGreaterThanOrEqual, t + ms * 2).await.unwrap(), Some(c));
    assert_eq!(q(TimeOp::LargestLessThan, t + chrono::Duration::seconds(5)).await.unwrap(), Some(c));
    assert_eq!(q(TimeOp::SmallestGreaterThan, t + chrono::Duration::seconds(5)).await.unwrap(), None);
    assert_eq!(db::round_to_datetime(t + ms * 5), t + ms * 7);
    assert_eq!(db::round_to_datetime(t + chrono::Duration::microseconds(999_999)), t + chrono::Duration::seconds(1));
}

#[tokio::test]
async fn local_times_go_back_at_the_fall_back_while_lsns_rise() {
    let mut cfg = manual("2026-11-01T05:50:00Z", 0); // 01:50 EDT
    cfg.time_zone = "America/New_York".into();
    let (_d, db, src, _ci) = setup(cfg, 0);
    let l1 = db.transaction(|tx| tx.insert(&orders(), order(1, "new"))).unwrap();
    db.advance_clock(Duration::from_secs(20 * 60)).unwrap(); // 06:10Z = 01:10 EST
    let l2 = db.transaction(|tx| tx.insert(&orders(), order(2, "new"))).unwrap();
    let t1 = src.lsn_to_time(l1).await.unwrap().unwrap();
    let t2 = src.lsn_to_time(l2).await.unwrap().unwrap();
    let d = NaiveDate::from_ymd_opt(2026, 11, 1).unwrap();
    assert_eq!(t1, d.and_hms_opt(1, 50, 0).unwrap());
    assert_eq!(t2, d.and_hms_opt(1, 10, 0).unwrap());
    assert!(l2 > l1 && t2 < t1);
    let z = src.server_time_zone().await.unwrap();
    assert_eq!(z.kind, ZoneKind::Named(chrono_tz::America::New_York));
    // Local 01:30 lies between the two commits in LSN terms only for the first.
    assert_eq!(src.time_to_lsn(TimeOp::LargestLessThanOrEqual, d.and_hms_opt(1, 30, 0).unwrap()).await.unwrap(), Some(l2));
    assert_eq!(db::parse_zone("UTC-03:00").unwrap().kind, ZoneKind::Fixed(-3 * 3600));
}

/// The simulated server converts instants to its wall clock itself, under
/// the rules its clock runs on: the zone's, or `zone_rules` for a server
/// whose rules are not what its zone's name means in the IANA database.
#[tokio::test]
async fn the_server_converts_times_with_its_own_rules() {
    let mut cfg = manual("2026-07-01T12:00:00Z", 0);
    cfg.time_zone = "America/New_York".into();
    let (_d, db, src, _ci) = setup(cfg, 0);
    let july = "2026-07-01T16:00:00Z".parse::<DateTime<Utc>>().unwrap();
    let january = "2026-01-15T16:00:00Z".parse::<DateTime<Utc>>().unwrap();
    let local = |s: &str| NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S").unwrap();
    // The zone's rules: daylight time in July, standard time in January.
    assert_eq!(src.server_local_times(&[july, january]).await.unwrap(), vec![local("2026-07-01 12:00:00"), local("2026-01-15 11:00:00")]);
    assert!(src.server_local_times(&[]).await.unwrap().is_empty());
    // A server whose rules kept standard time all year: it reports the same
    // zone, but converts, and stamps its commits, at UTC-05:00.
    db.set_config_value("zone_rules", "UTC-05:00").unwrap();
    assert_eq!(src.server_time_zone().await.unwrap().kind, ZoneKind::Named(chrono_tz::America::New_York));
    assert_eq!(src.server_local_times(&[july, january]).await.unwrap(), vec![local("2026-07-01 11:00:00"), local("2026-01-15 11:00:00")]);
    let l = db.transaction(|tx| tx.insert(&orders(), order(1, "new"))).unwrap();
    db.capture().unwrap();
    assert_eq!(src.lsn_to_time(l).await.unwrap(), Some(local("2026-07-01 07:00:00")));
    assert!(db.set_config_value("zone_rules", "Mars/Olympus").is_err());
}

#[tokio::test]
async fn snapshot_isolation_needs_the_database_option() {
    let mut cfg = manual("2026-03-01T12:00:00Z", 10);
    cfg.allow_snapshot_isolation = false;
    let (_d, db, src, ci) = setup(cfg, 10);
    let e = read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::Snapshot).await.unwrap_err();
    assert!(matches!(&e, SourceError::Config(m) if m.contains("3952") && m.contains("allow_snapshot_isolation")), "{e}");
    assert!(src.key_extent(&orders(), &["id".into()], Isolation::Snapshot).await.is_err());
    assert_eq!(read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::ReadCommitted).await.unwrap().len(), 10);
    db.set_config_value("allow_snapshot_isolation", "true").unwrap();
    assert_eq!(read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::Snapshot).await.unwrap().len(), 10);
}

#[tokio::test]
async fn string_keys_follow_the_collation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.sim");
    let db = SimDb::create(&path, manual("2026-03-01T12:00:00Z", 10)).unwrap();
    let t = TableName::new("dbo", "codes");
    db.create_table(&TableSpec { collations: Default::default(),
        name: t.clone(),
        columns: vec![ColumnDesc::new("code", SqlType::VarChar { len: Some(10) }, false), ColumnDesc::new("n", SqlType::Int, true)],
        primary_key: vec!["code".into()],
        unique_index: vec![],
    })
    .unwrap();
    let s = |x: &str| SqlValue::Str(x.into());
    db.transaction(|tx| {
        for (c, n) in [("abc", 1), ("B", 2), ("a", 3), ("Abd", 4)] {
            tx.insert(&t, vec![s(c), SqlValue::Int(n)])?;
        }
        Ok(())
    })
    .unwrap();
    let e = db.transaction(|tx| tx.insert(&t, vec![s("ABC "), SqlValue::Int(9)])).unwrap_err();
    assert!(matches!(e, SimError::DuplicateKey { .. }), "{e}");
    // Lookups are collation-aware too.
    db.transaction(|tx| tx.update(&t, &vec![s("ABC")], vec![s("abc"), SqlValue::Int(10)])).unwrap();
    let src = SimSource::open(&path).unwrap();
    let keys = vec!["code".to_string()];
    let range = KeyRange { lo: Some(vec![s("ABC")]), hi: None };
    assert_eq!(src.key_seek(&t, &keys, &range, 0, Isolation::ReadCommitted).await.unwrap(), Some(vec![s("abc")]));
    assert_eq!(src.key_seek(&t, &keys, &range, 1, Isolation::ReadCommitted).await.unwrap(), Some(vec![s("Abd")]));
    assert_eq!(src.key_seek(&t, &keys, &range, 3, Isolation::ReadCommitted).await.unwrap(), None);
    let ext = src.key_extent(&t, &keys, Isolation::ReadCommitted).await.unwrap().unwrap();
    assert_eq!(ext, (vec![s("a")], vec![s("B")]));
    let info = src.table_info(&t).await.unwrap();
    assert_eq!(info.unique_key, vec!["code".to_string()]);
    assert!(src.capture_instances(&t).await.unwrap().is_empty());
    let e = src.table_info(&TableName::new("dbo", "x")).await.unwrap_err();
    assert!(matches!(&e, SourceError::Config(m) if m.contains("dbo.x does not exist in sim://")), "{e}");
}

#[tokio::test]
async fn a_fault_drops_a_stream_once() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 20);
    db.inject_fault(FaultSpec { on: FaultOn::Snapshot, after_rows: 5, times: 1 }).unwrap();
    let read = SnapshotRead {
        table: orders(),
        columns: ci.columns.clone(),
        keys: vec!["id".into()],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 3,
    };
    let (batches, err) = collect(src.snapshot_read(&read).await.unwrap()).await;
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 5);
    assert!(matches!(&err, Some(SourceError::Transient(m)) if m.contains("simulated fault")), "{err:?}");
    let (batches, err) = collect(src.snapshot_read(&read).await.unwrap()).await;
    assert!(err.is_none());
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 20);
    // A changes fault is not spent by snapshot reads.
    db.inject_fault(FaultSpec { on: FaultOn::Changes, after_rows: 0, times: 1 }).unwrap();
    let l = db.transaction(|tx| tx.insert(&orders(), order(100, "new"))).unwrap();
    assert_eq!(read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::ReadCommitted).await.unwrap().len(), 21);
    let (b, err) = collect(src.changes(&ci, ci.start_lsn.unwrap(), l, RowFilter::All, 10).await.unwrap()).await;
    assert!(b.is_empty() && matches!(err, Some(SourceError::Transient(_))));
}

#[tokio::test]
async fn ranges_tile_the_table() {
    let (_d, _db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 1000);
    for keys in [vec!["id"], vec!["customer"], vec!["status", "id"]] {
        let key_names: Vec<String> = keys.iter().map(|s| s.to_string()).collect();
        // Cut points every 137 rows.
        let mut cuts = Vec::new();
        let mut lo: Option<Vec<SqlValue>> = None;
        loop {
            let r = KeyRange { lo: lo.clone(), hi: None };
            let found = src.key_seek(&orders(), &key_names, &r, 137, Isolation::ReadCommitted).await.unwrap();
            // Order is the server's (string keys follow the column's collation), so ask it.
            let moved = match (&found, &lo) {
                (Some(k), Some(l)) => src.compare_keys(&orders(), &key_names, &[(k.clone(), l.clone())]).await.unwrap()[0].is_gt(),
                _ => true,
            };
            match found {
                Some(k) if moved => {
                    cuts.push(k.clone());
                    lo = Some(k);
                }
                Some(_) => {
                    // Many equal keys: step past them.
                    break;
                }
                None => break,
            }
        }
        let mut bounds: Vec<Option<Vec<SqlValue>>> = vec![None];
        bounds.extend(cuts.into_iter().map(Some));
        bounds.push(None);
        let mut ids = Vec::new();
        for w in bounds.windows(2) {
            let range = KeyRange { lo: w[0].clone(), hi: w[1].clone() };
            let rows = read_all(&src, &ci.columns, &keys, range.clone(), Isolation::ReadCommitted).await.unwrap();
            for r in &rows {
                let key: Vec<SqlValue> = keys.iter().map(|k| r[ci.columns.iter().position(|c| c.name == *k).unwrap()].clone()).collect();
                let mut pairs = Vec::new();
                pairs.extend(range.lo.iter().map(|lo| (key.clone(), lo.clone())));
                pairs.extend(range.hi.iter().map(|hi| (key.clone(), hi.clone())));
                let o = src.compare_keys(&orders(), &key_names, &pairs).await.unwrap();
                let mut o = o.into_iter();
                if range.lo.is_some() {
                    assert!(o.next().unwrap().is_ge(), "{key:?} is below its range's lower bound");
                }
                if range.hi.is_some() {
                    assert!(o.next().unwrap().is_lt(), "{key:?} is not below its range's upper bound");
                }
            }
            ids.extend(rows.iter().map(|r| r[0].as_i64().unwrap()));
        }
        ids.sort_unstable();
        assert_eq!(ids, (1..=1000).collect::<Vec<_>>(), "keys {keys:?}");
    }
    let ext = src.key_extent(&orders(), &["id".into()], Isolation::ReadCommitted).await.unwrap().unwrap();
    assert_eq!(ext, (vec![SqlValue::Int(1)], vec![SqlValue::Int(1000)]));
    let slices = src.slice_counts(&orders(), "id", 1, 1000, 300, Isolation::ReadCommitted).await.unwrap();
    assert_eq!(slices, vec![(1, 300), (301, 300), (601, 300), (901, 100)]);
    let slices = src.slice_counts(&orders(), "id", 950, 2000, 25, Isolation::ReadCommitted).await.unwrap();
    assert_eq!(slices, vec![(950, 25), (975, 25), (1000, 1)]);
    // An over-full slice's real extent (the integer planner's probe), from the index keys.
    let rc = Isolation::ReadCommitted;
    assert_eq!(src.slice_extent(&orders(), "id", 950, 2000, rc).await.unwrap(), Some((950, 1000)));
    assert_eq!(src.slice_extent(&orders(), "id", -5, 1, rc).await.unwrap(), Some((1, 1)));
    assert_eq!(src.slice_extent(&orders(), "id", 1001, i64::MAX, rc).await.unwrap(), None);
    assert_eq!(src.slice_extent(&orders(), "id", 10, 9, rc).await.unwrap(), None);
    assert!(matches!(src.slice_extent(&orders(), "customer", 0, 10, rc).await, Err(SourceError::Config(_))));
    assert_eq!(src.row_estimate(&orders()).await.unwrap(), 1000);
}

#[tokio::test]
async fn schema_changes_keep_instance_shapes() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 3);
    db.add_column(&orders(), ColumnDesc::new("discount", SqlType::Decimal { precision: 5, scale: 2 }, true)).unwrap();
    let ci2 = db.enable_cdc(&orders(), Some("dbo_orders_v2"), None).unwrap();
    assert_eq!(ci2.columns.len(), 7);
    assert!(db.enable_cdc(&orders(), Some("third"), None).is_err());
    let mut row = order(10, "new");
    row.push(SqlValue::Decimal { value: 150, scale: 2 });
    let l1 = db.transaction(|tx| tx.insert(&orders(), row)).unwrap();
    db.drop_column(&orders(), "status").unwrap();
    let l2 = db
        .transaction(|tx| {
            let mut r = order(11, "x");
            r.remove(3);
            r.push(SqlValue::Null);
            tx.insert(&orders(), r)
        })
        .unwrap();
    let old = changes(&src, &ci, ci.start_lsn.unwrap(), l2, RowFilter::All).await;
    assert_eq!(old.len(), 2);
    assert_eq!(old[0].vals.len(), 6);
    assert_eq!(old[0].vals[3], SqlValue::Str("new".into()));
    assert_eq!(old[1].vals[3], SqlValue::Null, "a dropped column reads as NULL");
    let new = changes(&src, &ci2, ci2.start_lsn.unwrap(), l2, RowFilter::All).await;
    assert_eq!(new[0].lsn, l1);
    assert_eq!(new[0].vals[6], SqlValue::Decimal { value: 150, scale: 2 });
    let cis = src.capture_instances(&orders()).await.unwrap();
    assert_eq!(cis.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), vec!["dbo_orders", "dbo_orders_v2"]);
    db.disable_instance("dbo_orders").unwrap();
    assert_eq!(src.min_lsn("dbo_orders").await.unwrap(), None);
}

#[tokio::test]
async fn a_renamed_column_is_captured_under_its_old_name_by_id() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 3);
    // Committed before the rename, captured after it (at the next source
    // call): the log holds values by column id, so the name at scan time does not matter.
    let l1 = db.transaction(|tx| tx.update(&orders(), &vec![SqlValue::Int(1)], order(1, "before"))).unwrap();
    db.rename_column(&orders(), "status", "state").unwrap();
    let l2 = db.transaction(|tx| tx.update(&orders(), &vec![SqlValue::Int(2)], order(2, "after"))).unwrap();
    let rows = changes(&src, &ci, ci.start_lsn.unwrap(), l2, RowFilter::All).await;
    assert_eq!(rows.iter().map(|r| (r.lsn, r.op)).collect::<Vec<_>>(), vec![(l1, 4), (l2, 4)]);
    assert_eq!(rows[0].vals[3], SqlValue::Str("before".into()), "the value committed before the rename");
    assert_eq!(rows[1].vals[3], SqlValue::Str("after".into()), "the value written under the new name, captured under the old one");

    // The table has the new name; the instance keeps the old one and reports the rename.
    assert_eq!(src.table_info(&orders()).await.unwrap().columns[3].name, "state");
    let cis = src.capture_instances(&orders()).await.unwrap();
    assert_eq!(cis[0].columns[3].name, "status");
    let want: std::collections::BTreeMap<String, String> = [("status".to_string(), "state".to_string())].into();
    assert_eq!(cis[0].renamed, want);
    assert_eq!(db.capture_instances(&orders()).unwrap()[0].renamed, want, "the admin API reports it too");
    // A read of the old name is refused with both names, not read as NULL.
    let e = read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::ReadCommitted).await.unwrap_err();
    assert!(matches!(&e, SourceError::Config(m) if m.contains("'status'") && m.contains("'state'")), "{e}");

    // Renames that SQL Server refuses; a change of case only is no rename.
    assert!(matches!(db.rename_column(&orders(), "state", "CUSTOMER"), Err(SimError::BadArgument(m)) if m.contains("customer")));
    assert!(matches!(db.rename_column(&orders(), "nope", "x"), Err(SimError::NoSuchColumn { .. })));
    db.rename_column(&orders(), "amount", "Amount").unwrap();
    assert_eq!(src.capture_instances(&orders()).await.unwrap()[0].renamed, want);

    // A key column renamed: the instance's index columns keep the old name, as cdc.index_columns does.
    db.rename_column(&orders(), "id", "order_id").unwrap();
    assert_eq!(src.table_info(&orders()).await.unwrap().unique_key, vec!["order_id".to_string()]);
    let cis = src.capture_instances(&orders()).await.unwrap();
    assert_eq!(cis[0].index_columns, vec!["id".to_string()]);
    assert_eq!(cis[0].renamed.get("id").map(String::as_str), Some("order_id"));

    // A new column that takes the old name is another column (a new id): the
    // old instance goes on capturing the renamed one, never the newcomer.
    db.add_column(&orders(), ColumnDesc::new("status", SqlType::VarChar { len: Some(12) }, true)).unwrap();
    let mut r = order(3, "kept");
    r.push(SqlValue::Str("newcomer".into()));
    let l3 = db.transaction(|tx| tx.update(&orders(), &vec![SqlValue::Int(3)], r)).unwrap();
    let rows = changes(&src, &ci, l3, l3, RowFilter::All).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].vals[3], SqlValue::Str("kept".into()));
    // A new instance captures the columns as they are named now: nothing renamed.
    let ci2 = db.enable_cdc(&orders(), Some("dbo_orders_v2"), None).unwrap();
    assert_eq!(ci2.columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), vec!["order_id", "customer", "Amount", "state", "created_at", "note", "status"]);
    assert!(src.capture_instances(&orders()).await.unwrap()[1].renamed.is_empty());

    // A dropped column is dropped, not renamed: NULL from then on, and not reported.
    db.drop_column(&orders(), "state").unwrap();
    let cis = src.capture_instances(&orders()).await.unwrap();
    assert!(!cis[0].renamed.contains_key("status"), "{:?}", cis[0].renamed);
    let mut r = order(1, "x");
    r.remove(3);
    r.push(SqlValue::Str("new".into()));
    let l4 = db.transaction(|tx| tx.update(&orders(), &vec![SqlValue::Int(1)], r)).unwrap();
    let rows = changes(&src, &ci, l4, l4, RowFilter::All).await;
    assert_eq!(rows[0].vals[3], SqlValue::Null, "a dropped column reads as NULL");
}

#[tokio::test]
async fn idle_rows_and_untracked_transactions() {
    let mut cfg = manual("2026-03-01T12:00:00Z", 10);
    cfg.idle_interval_seconds = 60;
    let (_d, db, src, _ci) = setup(cfg, 0);
    let t = TableName::new("dbo", "plain");
    let mut spec = orders_table_spec(t.clone());
    spec.name = t.clone();
    db.create_table(&spec).unwrap();
    // A transaction on a table without CDC leaves no mapping row.
    let l = db.transaction(|tx| tx.insert(&t, order(1, "new"))).unwrap();
    let first = src.max_lsn().await.unwrap();
    assert!(first.is_some(), "the first scan writes an idle row");
    assert_eq!(src.lsn_to_time(l).await.unwrap(), None);
    assert_eq!(src.max_lsn().await.unwrap(), first);
    db.advance_clock(Duration::from_secs(61)).unwrap();
    let second = src.max_lsn().await.unwrap();
    assert!(second > first);
}

#[test]
fn two_handles_write_and_read_concurrently() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.sim");
    let cfg = SimConfig { allow_snapshot_isolation: true, ..SimConfig::default() };
    let db = SimDb::create(&path, cfg).unwrap();
    db.create_table(&orders_table_spec(orders())).unwrap();
    db.load_rows(&orders(), orders_rows(200, 1)).unwrap();
    let ci = db.enable_cdc(&orders(), None, None).unwrap();
    let p2 = path.clone();
    let writer = std::thread::spawn(move || {
        let db = SimDb::open(&p2).unwrap();
        let w = Workload { tx_per_s: 0.0, ops_per_tx: 4, seed: 9, ..Workload::default() };
        w.run(&db, &orders(), Until::Transactions(150), Arc::new(AtomicBool::new(false))).unwrap()
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let src = SimSource::open(&path).unwrap();
    let mut last = None;
    while !writer.is_finished() {
        let n = rt.block_on(read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::Snapshot)).unwrap().len();
        assert!(n > 0);
        let m = rt.block_on(src.max_lsn()).unwrap();
        assert!(m >= last);
        last = m;
    }
    let report = writer.join().unwrap();
    assert_eq!(report.transactions, 150);
    let max = rt.block_on(src.max_lsn()).unwrap().unwrap();
    assert_eq!(Some(max), report.last_commit_lsn);
    let rows = rt.block_on(changes(&src, &ci, ci.start_lsn.unwrap(), max, RowFilter::All));
    let ops = report.inserts + report.updates + report.deletes + 2 * report.key_updates;
    assert_eq!(rows.len() as u64, ops);
    // Replaying the changes over the initial rows gives the table.
    let mut state: std::collections::BTreeMap<i64, Vec<SqlValue>> =
        orders_rows(200, 1).map(|r| (r[0].as_i64().unwrap(), r)).collect();
    for c in &rows {
        let id = c.vals[0].as_i64().unwrap();
        match c.op {
            1 => {
                state.remove(&id);
            }
            _ => {
                state.insert(id, c.vals.clone());
            }
        }
    }
    let table = rt.block_on(read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::ReadCommitted)).unwrap();
    let ids: Vec<i64> = table.iter().map(|r| r[0].as_i64().unwrap()).collect();
    assert_eq!(ids, state.keys().copied().collect::<Vec<_>>());
}

#[test]
fn cli_creates_writes_and_reports() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Top {
        #[command(subcommand)]
        cmd: SimCommand,
    }
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("cli.sim");
    let d = db.to_str().unwrap();
    let run_args = |args: &[&str]| {
        let mut v = vec!["x"];
        v.extend_from_slice(args);
        cli::run(Top::try_parse_from(v).unwrap().cmd)
    };
    let out = run_args(&["create", "--db", d, "--preset", "orders", "--rows", "50", "--manual-clock", "2026-03-01T00:00:00Z"]).unwrap();
    assert_eq!(out["rows_loaded"], 50);
    assert!(run_args(&["create", "--db", d]).is_err(), "an existing file is not overwritten");
    run_args(&["write", "--db", d, "--transactions", "20", "--tx-per-s", "0", "--mix", "insert=1,update=1,delete=1,key_update=1"]).unwrap();
    run_args(&["alter", "--db", d, "--set", "capture_lag_ms=5000", "--add-column", "extra int"]).unwrap();
    run_args(&["alter", "--db", d, "--rename-column", "note=remark"]).unwrap();
    assert!(run_args(&["alter", "--db", d, "--rename-column", "remark"]).is_err(), "a rename needs old=new");
    run_args(&["fault", "--db", d, "--on", "snapshot", "--after-rows", "3"]).unwrap();
    let cap = run_args(&["capture", "--db", d]).unwrap();
    assert_eq!(cap["transactions"], 0, "the lag holds the transactions back");
    run_args(&["advance", "--db", d, "--seconds", "10", "--capture"]).unwrap();
    let st = run_args(&["status", "--db", d]).unwrap();
    assert_eq!(st["pending_transactions"], 0);
    assert_eq!(st["armed_faults"], 1);
    assert!(st["max_lsn"].is_string());
    assert_eq!(st["tables"][0]["capture_instances"][0]["renamed"]["note"], "remark", "{st}");
    run_args(&["cleanup", "--db", d, "--retention-minutes", "0"]).unwrap();
    let cols = cli::parse_columns("id bigint not null, price decimal(10, 2), name nvarchar(max) null").unwrap();
    assert_eq!(cols[1].sql_type, SqlType::Decimal { precision: 10, scale: 2 });
    assert!(!cols[0].nullable && cols[2].nullable);
}

#[test]
fn missing_or_foreign_files_are_config_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nope.sim");
    assert!(matches!(SimSource::open(&p), Err(SourceError::Config(m)) if m.contains("nope.sim")));
    std::fs::write(&p, b"hello").unwrap();
    assert!(matches!(SimSource::open(&p), Err(SourceError::Config(_))));
    assert!(matches!(SimDb::open(&p), Err(SimError::NotASimFile(..))));
}

#[tokio::test]
async fn heaps_unique_indexes_rate_limits_and_auto_cleanup() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.sim");
    let mut cfg = manual("2026-03-01T12:00:00Z", 1000);
    cfg.conn_rows_per_s = Some(2000);
    cfg.auto_cleanup_interval_minutes = Some(1);
    cfg.retention_minutes = 1;
    let db = SimDb::create(&path, cfg).unwrap();
    let heap = TableName::new("dbo", "heap");
    let cols = vec![ColumnDesc::new("a", SqlType::Int, true), ColumnDesc::new("b", SqlType::NVarChar { len: Some(10) }, true)];
    db.create_table(&TableSpec { collations: Default::default(), name: heap.clone(), columns: cols.clone(), primary_key: vec![], unique_index: vec![] }).unwrap();
    let uq = TableName::new("dbo", "uq");
    db.create_table(&TableSpec { collations: Default::default(), name: uq.clone(), columns: cols.clone(), primary_key: vec!["a".into()], unique_index: vec!["b".into()] })
        .unwrap();
    let hci = db.enable_cdc(&heap, None, None).unwrap();
    assert!(hci.index_columns.is_empty());
    let (i, s) = (SqlValue::Int, |x: &str| SqlValue::Str(x.into()));
    db.transaction(|tx| {
        tx.insert(&heap, vec![i(1), s("x")])?;
        tx.insert(&heap, vec![i(1), s("x")])?; // a heap takes duplicates
        tx.insert(&heap, vec![i(2), SqlValue::Null])?;
        tx.update(&heap, &vec![i(2)], vec![i(2), s("y")])?;
        tx.delete(&heap, &vec![i(1), s("x")])?;
        tx.insert(&uq, vec![i(1), s("k")])
    })
    .unwrap();
    let e = db.transaction(|tx| tx.insert(&uq, vec![i(2), s("K ")])).unwrap_err();
    assert!(matches!(e, SimError::DuplicateKey { .. }), "{e}");
    let src = SimSource::open(&path).unwrap();
    let info = src.table_info(&heap).await.unwrap();
    assert!(info.unique_key.is_empty());
    assert_eq!(src.table_info(&uq).await.unwrap().unique_key, vec!["a".to_string()]);
    let read = |t: &TableName, keys: Vec<String>| SnapshotRead {
        table: t.clone(),
        columns: cols.clone(),
        keys,
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 100,
    };
    let (b, err) = collect(src.snapshot_read(&read(&heap, vec!["a".into()])).await.unwrap()).await;
    assert!(err.is_none());
    assert_eq!(b.iter().map(|b| b.num_rows()).sum::<usize>(), 2);
    // A heap has no index keys: the extent is read from the rows, (1, x) and (2, y).
    let rc = Isolation::ReadCommitted;
    assert_eq!(src.slice_extent(&heap, "a", 0, 10, rc).await.unwrap(), Some((1, 2)));
    assert_eq!(src.slice_extent(&heap, "a", 2, 10, rc).await.unwrap(), Some((2, 2)));
    assert_eq!(src.slice_extent(&heap, "a", 3, 10, rc).await.unwrap(), None);
    let max = src.max_lsn().await.unwrap().unwrap();
    let rows = changes(&src, &hci, hci.start_lsn.unwrap(), max, RowFilter::AllUpdateOld).await;
    assert_eq!(rows.iter().map(|r| r.op).collect::<Vec<_>>(), vec![2, 2, 2, 3, 4, 1]);

    // Rate limit: 600 rows at 2000 rows/s take at least ~0.25 s after the first batch.
    db.load_rows(&uq, (10..610).map(|n| vec![i(n), s(&format!("v{n}"))])).unwrap();
    let started = std::time::Instant::now();
    let (b, _) = collect(src.snapshot_read(&read(&uq, vec!["a".into()])).await.unwrap()).await;
    assert_eq!(b.iter().map(|b| b.num_rows()).sum::<usize>(), 601);
    assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());

    // Auto cleanup: each commit moves the clock 1 s; after two minutes the old changes go.
    for n in 0..3 {
        db.transaction(|tx| tx.insert(&heap, vec![i(100 + n), SqlValue::Null])).unwrap();
        db.advance_clock(Duration::from_secs(70)).unwrap();
    }
    let last = db.transaction(|tx| tx.insert(&heap, vec![i(200), SqlValue::Null])).unwrap();
    assert_eq!(src.max_lsn().await.unwrap(), Some(last));
    let min = src.min_lsn(&hci.name).await.unwrap().unwrap();
    assert!(min > hci.start_lsn.unwrap() && min <= last, "{min} {last}");
}

/// Rough timings on a bigger table: `cargo test --release --lib sim::tests::big -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn big_table_timings() {
    let n: u64 = std::env::var("SIM_BIG_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let t0 = std::time::Instant::now();
    let (_d, db, src, ci) = setup(SimConfig::default(), n);
    eprintln!("load {n} rows: {:?}", t0.elapsed());
    let t0 = std::time::Instant::now();
    let keys = vec!["id".to_string()];
    let mut lo = None;
    let mut cuts = vec![];
    loop {
        match src.key_seek(&orders(), &keys, &KeyRange { lo: lo.clone(), hi: None }, n / 100, Isolation::ReadCommitted).await.unwrap() {
            Some(k) => {
                cuts.push(k.clone());
                lo = Some(k);
            }
            None => break,
        }
    }
    eprintln!("{} cuts: {:?}", cuts.len(), t0.elapsed());
    let t0 = std::time::Instant::now();
    let range = KeyRange { lo: Some(cuts[10].clone()), hi: Some(cuts[11].clone()) };
    let rows = read_all(&src, &ci.columns, &["id"], range, Isolation::ReadCommitted).await.unwrap();
    eprintln!("one chunk of {}: {:?}", rows.len(), t0.elapsed());
    let t0 = std::time::Instant::now();
    let all = read_all(&src, &ci.columns, &["id"], KeyRange::all(), Isolation::ReadCommitted).await.unwrap().len();
    eprintln!("full read of {all}: {:?}", t0.elapsed());
    let t0 = std::time::Instant::now();
    let w = Workload { tx_per_s: 0.0, ..Workload::default() };
    let r = w.run(&db, &orders(), Until::Transactions(2000), Arc::new(AtomicBool::new(false))).unwrap();
    eprintln!("2000 tx: {:?} ({:?})", t0.elapsed(), r);
    let t0 = std::time::Instant::now();
    let max = src.max_lsn().await.unwrap().unwrap();
    eprintln!("capture: {:?}", t0.elapsed());
    let t0 = std::time::Instant::now();
    let c = changes(&src, &ci, ci.start_lsn.unwrap(), max, RowFilter::All).await.len();
    eprintln!("{c} changes: {:?}", t0.elapsed());
}

#[tokio::test]
async fn workloads_are_deterministic_with_the_manual_clock() {
    let mut seen = Vec::new();
    for _ in 0..2 {
        let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 50);
        let w = Workload { tx_per_s: 0.0, ops_per_tx: 3, seed: 42, ..Workload::default() };
        let r = w.run(&db, &orders(), Until::Transactions(40), Arc::new(AtomicBool::new(false))).unwrap();
        assert!(r.inserts > 0 && r.updates > 0 && r.deletes > 0 && r.key_updates > 0, "{r:?}");
        let max = src.max_lsn().await.unwrap().unwrap();
        seen.push(changes(&src, &ci, ci.start_lsn.unwrap(), max, RowFilter::AllUpdateOld).await);
    }
    assert_eq!(seen[0], seen[1]);
}

/// The permission model (issue 12 §5) in its own terms: SELECT on some
/// columns reads exactly those (another column is SQL Server's error 230
/// naming it; no grant at all is 229 on the object); any grant shows the
/// table's metadata, none hides it; CDC's own check keeps the change data
/// closed (all zeros from fn_cdc_get_min_lsn, 229 from the change function)
/// until every captured column is granted and the caller is in the gating
/// role; and the owner (no user on the URL) is never stopped.
#[tokio::test]
async fn column_grants_read_exactly_their_columns_and_cdc_checks_every_captured_one() {
    let (_d, db, owner, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 5);
    let max = db.transaction(|tx| tx.insert(&orders(), order(100, "new"))).unwrap();
    db.capture().unwrap();
    let start = ci.start_lsn.unwrap();
    let cols = orders_table_spec(orders()).columns;
    let (id_customer, id_customer_amount) = (cols[..2].to_vec(), cols[..3].to_vec());
    let rc = Isolation::ReadCommitted;

    // A user the file does not have: the login fails (error 18456).
    let e = db.source_as("nobody").unwrap_err();
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("18456") && m.contains("nobody")), "{e}");

    db.create_user("reader").unwrap();
    let src = db.source_as("reader").unwrap();
    assert!(src.describe().ends_with("?user=reader"), "{}", src.describe());
    // No grant: the catalog shows no table, a read of it is 229 on the object.
    let e = src.table_info(&orders()).await.unwrap_err();
    assert!(matches!(&e, SourceError::Config(m) if m.contains("GRANT SELECT ON OBJECT::[dbo].[orders] TO [reader]")), "{e}");
    let e = read_all(&src, &id_customer, &["id"], KeyRange::all(), rc).await.unwrap_err();
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("error 229") && m.contains("object 'orders'")), "{e}");
    let e = src.row_estimate(&orders()).await.unwrap_err();
    assert!(matches!(&e, SourceError::Config(m) if m.contains("15009") && m.contains("GRANT SELECT ON OBJECT::[dbo].[orders] TO [reader]")), "{e}");

    // SELECT on (id, customer): the whole table's metadata shows; those two
    // columns read; amount is error 230 naming it, and the grant that fixes it.
    let added = db.grant("reader", Permission::Select, "dbo.orders", &["id".into(), "customer".into()]).unwrap();
    assert_eq!(added.len(), 2);
    assert_eq!(src.table_info(&orders()).await.unwrap().columns.len(), cols.len());
    assert_eq!(read_all(&src, &id_customer, &["id"], KeyRange::all(), rc).await.unwrap().len(), 6);
    let e = read_all(&src, &id_customer_amount, &["id"], KeyRange::all(), rc).await.unwrap_err();
    assert!(
        matches!(&e, SourceError::Permission(m) if m.contains("error 230") && m.contains("column 'amount'")
            && m.contains("GRANT SELECT ON OBJECT::[dbo].[orders] ([amount]) TO [reader]")),
        "{e}"
    );
    // A range's WHERE reads its key column: cut on status, it is 230 too.
    let e = src.key_extent(&orders(), &["status".to_string()], rc).await.unwrap_err();
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("column 'status'")), "{e}");
    assert!(src.key_extent(&orders(), &["id".to_string()], rc).await.unwrap().is_some());
    // COUNT_BIG(*) reads no column: any column grant allows it.
    assert_eq!(src.row_count(&orders(), rc).await.unwrap(), 6);

    // The catalog and the change function granted, the change table's
    // ordering columns too; but not every captured column of the table: CDC
    // keeps the change data closed.
    for on in ["cdc.change_tables", "cdc.captured_columns", "cdc.index_columns", "cdc.lsn_time_mapping", "OBJECT::cdc.fn_cdc_get_all_changes_dbo_orders"] {
        db.grant("reader", Permission::Select, on, &[]).unwrap();
    }
    let order_cols: Vec<String> = ["__$start_lsn", "__$seqval", "__$operation", "__$command_id"].iter().map(|c| c.to_string()).collect();
    db.grant("reader", Permission::Select, "cdc.dbo_orders_CT", &order_cols).unwrap();
    assert_eq!(src.capture_instances(&orders()).await.unwrap().len(), 1);
    let e = src.min_lsn(&ci.name).await.unwrap_err();
    assert!(
        matches!(&e, SourceError::Permission(m)
            if m.contains("GRANT SELECT ON OBJECT::[dbo].[orders] ([id], [customer], [amount], [status], [created_at], [note]) TO [reader]")),
        "{e}"
    );
    let e = src.changes(&ci, start, max, RowFilter::All, 10).await.err().expect("the change function refuses");
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("error 229") && m.contains("'fn_cdc_get_all_changes_dbo_orders'")), "{e}");
    // The whole table: the change data opens, and reads as the owner's.
    db.grant("reader", Permission::Select, "OBJECT::dbo.orders", &[]).unwrap();
    assert_eq!(src.min_lsn(&ci.name).await.unwrap(), Some(start));
    assert_eq!(changes(&src, &ci, start, max, RowFilter::All).await, changes(&owner, &ci, start, max, RowFilter::All).await);

    // Revoked, the time mapping closes the change read again (229 naming it).
    assert_eq!(db.revoke("reader", Permission::Select, "cdc.lsn_time_mapping", &[]).unwrap(), 1);
    let e = src.changes(&ci, start, max, RowFilter::All, 10).await.err().expect("the change read joins the time mapping");
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("GRANT SELECT ON OBJECT::[cdc].[lsn_time_mapping] TO [reader]")), "{e}");
    db.grant("reader", Permission::Select, "cdc.lsn_time_mapping", &[]).unwrap();
    // The ordering columns without __$command_id: 230 naming it.
    db.revoke("reader", Permission::Select, "cdc.dbo_orders_CT", &order_cols[3..]).unwrap();
    let e = src.changes(&ci, start, max, RowFilter::All, 10).await.err().expect("the change read selects __$command_id");
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("GRANT SELECT ON OBJECT::[cdc].[dbo_orders_CT] ([__$command_id]) TO [reader]")), "{e}");
    db.grant("reader", Permission::Select, "cdc.dbo_orders_CT", &order_cols[3..]).unwrap();

    // A gated instance: closed to a non-member, open once it is a member;
    // the owner reads it either way.
    let gated = db.enable_cdc_gated(&orders(), Some("dbo_orders_gated"), None, "order_readers").unwrap();
    db.grant("reader", Permission::Select, "cdc.dbo_orders_gated_CT", &order_cols).unwrap();
    let e = src.min_lsn(&gated.name).await.unwrap_err();
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("ALTER ROLE [order_readers] ADD MEMBER [reader]")), "{e}");
    assert_eq!(owner.min_lsn(&gated.name).await.unwrap(), gated.start_lsn);
    db.add_role_member("order_readers", "reader").unwrap();
    assert_eq!(src.min_lsn(&gated.name).await.unwrap(), gated.start_lsn);

    // A grant must name something the database has.
    assert!(db.grant("reader", Permission::Select, "cdc.dbo_nothing_CT", &[]).is_err());
    assert!(db.grant("reader", Permission::Select, "dbo.orders", &["no_such_column".into()]).is_err());
    assert!(db.grant("ghost", Permission::Select, "dbo.orders", &[]).is_err());
}

/// The catalog hides a change table the caller has no permission on, and
/// the instance then lists no captured column: refused, naming the grant,
/// rather than described as capturing nothing. VIEW DEFINITION (metadata
/// only) is enough for the catalog read.
#[tokio::test]
async fn a_hidden_change_table_is_refused_naming_its_grant() {
    let (_d, db, _owner, _ci) = setup(manual("2026-03-01T12:00:00Z", 10), 2);
    db.create_user("reader").unwrap();
    for on in ["dbo.orders", "cdc.change_tables", "cdc.captured_columns", "cdc.index_columns"] {
        db.grant("reader", Permission::Select, on, &[]).unwrap();
    }
    let src = db.source_as("reader").unwrap();
    let e = src.capture_instances(&orders()).await.unwrap_err();
    assert!(
        matches!(&e, SourceError::Permission(m)
            if m.contains("GRANT SELECT ON OBJECT::[cdc].[dbo_orders_CT] ([__$start_lsn], [__$seqval], [__$operation], [__$command_id]) TO [reader]")),
        "{e}"
    );
    db.grant("reader", Permission::ViewDefinition, "OBJECT::cdc.dbo_orders_CT", &[]).unwrap();
    assert_eq!(src.capture_instances(&orders()).await.unwrap()[0].columns.len(), 6);
    // Without cdc.index_columns, the third catalog read fails, naming it.
    db.revoke("reader", Permission::Select, "cdc.index_columns", &[]).unwrap();
    let e = src.capture_instances(&orders()).await.unwrap_err();
    assert!(matches!(&e, SourceError::Permission(m) if m.contains("GRANT SELECT ON OBJECT::[cdc].[index_columns] TO [reader]")), "{e}");
}

/// A writer's lock on the table (`SimDb::hold_lock`) holds up every
/// statement that reads the table's rows under locking READ COMMITTED, as
/// SQL Server's shared locks wait behind the writer's exclusive one: the
/// snapshot read and the planners' and reconcile's extents, seeks, counts
/// and sums, each failing with error 1222 (transient) once `lock_timeout_ms`
/// has passed, and each reading once the writer lets go. Under SNAPSHOT none
/// of them waits. Reads of no row of the table (the catalog, the change
/// function and the time mapping, `sp_spaceused`, the key comparison) never
/// wait.
#[tokio::test]
async fn every_read_of_the_tables_rows_waits_behind_a_writers_lock_under_read_committed_only() {
    let (_d, db, src, ci) = setup(manual("2026-03-01T12:00:00Z", 10), 50);
    let l = db.transaction(|tx| tx.insert(&orders(), order(51, "new"))).unwrap();
    db.capture().unwrap();
    db.set_config_value("lock_timeout_ms", "100").unwrap();
    db.hold_lock(&orders(), "a writer's open transaction").unwrap();
    let (t, id) = (orders(), vec!["id".to_string()]);
    let day_us: i64 = 86_400_000_000;
    for iso in [Isolation::ReadCommitted, Isolation::Snapshot] {
        let outcomes: Vec<(&str, Result<(), SourceError>)> = vec![
            ("snapshot_read", read_all(&src, &ci.columns, &["id"], KeyRange::all(), iso).await.map(drop)),
            ("key_extent", src.key_extent(&t, &id, iso).await.map(drop)),
            ("key_seek", src.key_seek(&t, &id, &KeyRange::all(), 10, iso).await.map(drop)),
            ("slice_counts", src.slice_counts(&t, "id", 1, 100, 10, iso).await.map(drop)),
            ("slice_extent", src.slice_extent(&t, "id", 1, 100, iso).await.map(drop)),
            ("null_count", src.null_count(&t, "note", iso).await.map(drop)),
            ("bucket_sums", src.bucket_sums(&t, "id", 1, 100, 10, iso).await.map(drop)),
            ("date_bucket_sums", src.date_bucket_sums(&t, "created_at", 0, i64::MAX, day_us, iso).await.map(drop)),
            ("row_count", src.row_count(&t, iso).await.map(drop)),
        ];
        for (what, r) in outcomes {
            match (iso, r) {
                (Isolation::ReadCommitted, Err(SourceError::Transient(m))) if m.contains("1222") => {}
                (Isolation::Snapshot, Ok(())) => {}
                (iso, other) => panic!("{what} under {iso} behind the writer's lock: {other:?}"),
            }
        }
    }
    // Reads that touch no row of the table do not wait, under READ COMMITTED too.
    assert_eq!(src.row_estimate(&t).await.unwrap(), 51);
    assert_eq!(src.table_info(&t).await.unwrap().columns.len(), 6);
    assert_eq!(src.capture_instances(&t).await.unwrap().len(), 1);
    let pair = (vec![SqlValue::Int(1)], vec![SqlValue::Int(2)]);
    assert_eq!(src.compare_keys(&t, &id, &[pair]).await.unwrap(), vec![std::cmp::Ordering::Less]);
    assert_eq!(changes(&src, &ci, ci.start_lsn.unwrap(), l, RowFilter::All).await.len(), 1);
    assert!(src.lsn_to_time(l).await.unwrap().is_some());
    // A wait the writer's commit ends: the statement then reads the table.
    db.set_config_value("lock_timeout_ms", "5000").unwrap();
    let path = db.path().to_path_buf();
    let started = std::time::Instant::now();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        SimDb::open(&path).unwrap().release_lock(&orders()).unwrap();
    });
    let found = src.key_seek(&t, &id, &KeyRange::all(), 10, Isolation::ReadCommitted).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300), "the seek waited for the lock ({:?})", started.elapsed());
    release.join().unwrap();
    assert_eq!(found, Some(vec![SqlValue::Int(11)]));
    assert_eq!(src.key_extent(&t, &id, Isolation::ReadCommitted).await.unwrap(), Some((vec![SqlValue::Int(1)], vec![SqlValue::Int(51)])));
    assert_eq!(src.row_count(&t, Isolation::ReadCommitted).await.unwrap(), 51);
}

/// The max LSN a read brings back is read once its last row has been read,
/// not when the read began: a transaction the capture job takes in while
/// the rows are read is under it. The read is held part-way (its channel is
/// full) while the clock passes the capture lag; a max LSN read at the
/// read's start would still be NULL.
#[tokio::test]
async fn a_read_then_max_lsn_reads_max_lsn_after_the_last_row() {
    let mut cfg = manual("2026-03-01T12:00:00Z", 10);
    cfg.capture_lag_ms = 1000;
    let (_d, db, src, ci) = setup(cfg, 20);
    let l1 = db.transaction(|tx| tx.insert(&orders(), order(100, "new"))).unwrap();
    assert_eq!(src.max_lsn().await.unwrap(), None, "the insert is not captured yet");
    let read = SnapshotRead {
        table: orders(),
        columns: ci.columns.clone(),
        keys: vec!["id".into()],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 1,
    };
    let r = src.snapshot_read_then_max_lsn(&read).await.unwrap();
    let mut batches = r.batches;
    let first = batches.next().await.unwrap().unwrap();
    assert_eq!(first.num_rows(), 1);
    db.advance_clock(Duration::from_millis(1500)).unwrap();
    let mut rows = 1;
    while let Some(b) = batches.next().await {
        rows += b.unwrap().num_rows();
    }
    assert_eq!(rows, 21, "the 20 loaded rows and the insert, committed before the read");
    let after = r.max_lsn_after.expect("the simulator reads the max LSN after the rows").await.unwrap();
    assert_eq!(after, Some(l1));
    // A read that fails brings none.
    let bad = SnapshotRead { table: TableName::new("dbo", "nope"), ..read };
    assert!(src.snapshot_read_then_max_lsn(&bad).await.is_err());
}
