//! Full snapshots: the table read at S = max LSN over N connections, written
//! to bronze as operation-0 rows in one commit.
//!
//! Order of effects (each a commit, each a failpoint after it):
//! 1. a `snapshot_open` facts row (mode full, no txn: one per attempt, so a
//!    rerun under another S shows as its own attempt);
//! 2. the bronze append of every row, txn `<app id>#snapshot` + generation,
//!    S and the row count in the commit metadata (none for an empty table);
//! 3. the `bootstrap` (or, after data loss, `resnapshot`) facts row, txn
//!    `<app id>#events` + generation.
//!
//! A crash after 2 finds the bronze txn on the rerun and writes 3 from the
//! commit's metadata without reading the table again; a crash before 2 reads
//! it again at a new S. The stream then continues from S. A re-snapshot's
//! commit that CDC cleanup passed before 3 was written is never completed:
//! `engine::recover` retires it as a failed attempt and takes a new one.
//!
//! The open row of 1 holds the snapshot mode until 3, or until cleanup passes
//! its S (`engine::rules::full_holding_mode`): a killed attempt blocks a
//! chunked open or a seed for the retention at most. Two attempts at once
//! both write their open row, but only one commits 2 and 3 (both keyed by
//! the generation); the other's open, even at a higher S, is superseded by
//! that completion (`engine::rules::is_superseded_full`) and holds nothing.
//!
//! Before 2 commits, the read checks that CDC cleanup has not passed S (a
//! read longer than the retention): such an image cannot be continued by the
//! stream, so it is never committed; a `resnapshot_failed` row records the
//! attempt instead (adr-0018's step 3), and the step stops with exit 3.

use std::time::Instant;

use chrono::{DateTime, Utc};

use deltalake::arrow::record_batch::RecordBatch;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::Context;
pub use super::rules::{is_purged_after, Gap};
use crate::delta::bronze::{self, SnapshotStamp};
use crate::delta::facts::{EVENT_BOOTSTRAP, EVENT_RESNAPSHOT_FAILED, EVENT_SNAPSHOT_OPEN};
use crate::delta::{self, Appended, Txn};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::source::{KeyRange, SnapshotRead};
use crate::types::{Key, SqlValue};

/// The result of a bootstrap (or of finding one already done).
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotResult {
    pub step: &'static str,
    pub snapshot_lsn: Lsn,
    pub rows: i64,
    pub already_done: bool,
    pub ranges: usize,
    pub duration_ms: i64,
}

/// Splits `[min, max]` of an integer key into `n` ranges that tile the whole
/// key space: the first open below (it also takes NULL keys), the last open
/// above (keys inserted above MAX after S are the stream's, but reading them
/// does no harm), each boundary shared by two ranges' complementary predicates.
pub fn split_integer(min: i64, max: i64, n: usize) -> Vec<KeyRange> {
    let n = n.max(1) as i128;
    let span = max as i128 - min as i128 + 1;
    let parts = n.min(span.max(1));
    let mut bounds: Vec<i64> = Vec::new();
    for i in 1..parts {
        let b = min as i128 + span * i / parts;
        let b = b as i64;
        if bounds.last() != Some(&b) {
            bounds.push(b);
        }
    }
    ranges_from_bounds(bounds.into_iter().map(|b| vec![SqlValue::Int(b)]).collect())
}

/// Ranges `(-inf, b1), [b1, b2), ..., [bk, +inf)` from ascending bounds.
pub fn ranges_from_bounds(bounds: Vec<Key>) -> Vec<KeyRange> {
    let mut out = Vec::with_capacity(bounds.len() + 1);
    let mut lo: Option<Key> = None;
    for b in bounds {
        out.push(KeyRange { lo: lo.clone(), hi: Some(b.clone()) });
        lo = Some(b);
    }
    out.push(KeyRange { lo, hi: None });
    out
}

/// Cuts the table into about `n` key ranges for parallel reads.
async fn plan_ranges(ctx: &Context, keys: &[String]) -> StepResult<Vec<KeyRange>> {
    let n = ctx.workflow.snapshot.parallelism;
    if keys.is_empty() || n <= 1 {
        return Ok(vec![KeyRange::all()]);
    }
    let iso = ctx.workflow.snapshot.isolation;
    let table = ctx.workflow.table_name();
    let Some((min, max)) = ctx.source.key_extent(&table, keys, iso).await? else {
        return Ok(vec![KeyRange::all()]);
    };
    let single_int = keys.len() == 1 && ctx.instance.column(&keys[0]).map(|c| c.sql_type.is_integer()).unwrap_or(false);
    if let (true, Some(lo), Some(hi)) = (single_int, min[0].as_i64(), max[0].as_i64()) {
        return Ok(split_integer(lo, hi, n));
    }
    // Other keys: keyset seeks every estimate/n rows.
    let estimate = ctx.source.row_estimate(&table).await?.max(1);
    let step = (estimate / n as u64).max(1);
    let mut bounds: Vec<Key> = Vec::new();
    let mut lo: Option<Key> = None;
    for _ in 1..n {
        let range = KeyRange { lo: lo.clone(), hi: None };
        match ctx.source.key_seek(&table, keys, &range, step, iso).await? {
            Some(b) if lo.as_ref() != Some(&b) && !b.iter().any(SqlValue::is_null) => {
                bounds.push(b.clone());
                lo = Some(b);
            }
            _ => break,
        }
    }
    Ok(ranges_from_bounds(bounds))
}

/// Makes sure generation 0's bootstrap snapshot exists: returns it when it
/// does, completes it from bronze after a crash, or takes it.
pub async fn ensure_bootstrap(ctx: &mut Context) -> StepResult<SnapshotResult> {
    let st = super::state::load(ctx).await?;
    if st.generation == 0 {
        if let Some(s) = st.snapshot {
            return Ok(SnapshotResult { step: "snapshot", snapshot_lsn: s, rows: 0, already_done: true, ranges: 0, duration_ms: 0 });
        }
    }
    // A later generation (a reseed, a recovery) started from its own snapshot: generation 0's bootstrap is history.
    if st.generation > 0 {
        if let Some(s) = st.snapshot.or(st.position()) {
            return Ok(SnapshotResult { step: "snapshot", snapshot_lsn: s, rows: 0, already_done: true, ranges: 0, duration_ms: 0 });
        }
    }
    if let Some(done) = finish_committed(ctx, 0, EVENT_BOOTSTRAP, None).await? {
        return Ok(done);
    }
    // One snapshot mode per run: a chunked snapshot still being backfilled
    // must finish first (adr-0028's Amendment).
    let rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    if let Some(c) = super::chunked::open_chunked(&rows) {
        return Err(super::chunked::mode_conflict(&c, super::chunked::Mode::Full));
    }
    take_full(ctx, 0, EVENT_BOOTSTRAP, None).await
}

fn txn_full_snapshot(app: &str, generation: i32) -> Txn {
    Txn::new(format!("{app}#snapshot"), generation as i64)
}

/// A full snapshot's bronze commit, as its metadata records it.
#[derive(Debug, Clone, PartialEq)]
pub struct CommittedFull {
    /// The generation it was taken for (its txn version under `<app>#snapshot`).
    pub generation: i32,
    pub bronze_version: i64,
    pub s: Lsn,
    pub rows: i64,
    /// A heap's read fence, as the commit recorded it.
    pub fence: Option<DateTime<Utc>>,
    /// The commit's metadata when a seed made it (`seed` wrote the copy's
    /// rows under the same key): its completion is the seed's, naming the copy.
    pub seed_meta: Option<Value>,
    /// A seed's commit whose rows the seed removed again, because another
    /// step took the generation first (`engine::seed`): nothing to complete,
    /// and the generation's key stays spent, as a dead re-snapshot's does.
    pub undone: bool,
    /// The capture instance the snapshot was read on, as its commit names it.
    pub capture_instance: Option<String>,
}

/// The full snapshot bronze holds for generation `generation` (txn
/// `<app>#snapshot` at that version), from its commit's metadata. None when
/// bronze holds none for it.
pub async fn committed_full(ctx: &Context, generation: i32) -> StepResult<Option<CommittedFull>> {
    let snap_txn = txn_full_snapshot(&ctx.workflow.app_id, generation);
    let Some(found) = delta::txn_version(&ctx.bronze, &snap_txn.app_id).await? else { return Ok(None) };
    if found < snap_txn.version {
        return Ok(None);
    }
    let Some((version, meta)) = delta::find_txn_commit(&ctx.bronze, &snap_txn).await? else {
        if found > snap_txn.version {
            return Ok(None);
        }
        return Err(StepError::NeedsPerson(format!(
            "bronze records the full snapshot of generation {generation} ({}) but its commit is no longer in the log: \
             write its facts row by hand",
            snap_txn.app_id
        )));
    };
    let s = meta.get("snapshot_lsn").and_then(Value::as_str).and_then(|s| Lsn::parse(s).ok()).ok_or_else(|| {
        StepError::Internal(format!("bronze commit {version} lacks its snapshot LSN"))
    })?;
    let rows = meta.get("rows").and_then(Value::as_i64).unwrap_or(0);
    let fence = meta.get("fence").and_then(|f| serde_json::from_value::<DateTime<Utc>>(f.clone()).ok());
    let seed_meta = (meta.get("kind").and_then(Value::as_str) == Some("seed")).then(|| meta.clone());
    let undone = seed_meta.is_some() && delta::files_of_commit_held(&ctx.bronze, version).await?.is_empty();
    let capture_instance = meta.get("capture_instance").and_then(Value::as_str).map(str::to_string);
    Ok(Some(CommittedFull { generation, bronze_version: version, s, rows, fence, seed_meta, undone, capture_instance }))
}

/// The newest generation bronze holds a full snapshot commit for
/// (`<app>#snapshot`'s txn version), if any.
pub async fn newest_full_generation(ctx: &Context) -> StepResult<Option<i32>> {
    Ok(delta::txn_version(&ctx.bronze, &format!("{}#snapshot", ctx.workflow.app_id)).await?.map(|v| v as i32))
}

/// Completes a full snapshot of `generation` whose bronze commit is in but
/// whose completion row is not (a crash between the two): writes the row from
/// the commit's metadata, without reading the table again. None when bronze
/// holds no such commit. Callers that take re-snapshots check first that
/// cleanup has not passed its S (see `engine::recover`): such an image is
/// never completed.
pub async fn finish_committed(ctx: &mut Context, generation: i32, kind: &str, gap: Option<Gap>) -> StepResult<Option<SnapshotResult>> {
    let Some(c) = committed_full(ctx, generation).await? else { return Ok(None) };
    if c.undone {
        return Err(StepError::NeedsPerson(format!(
            "generation {generation}'s snapshot key (txn {}#snapshot) is held by a seed whose rows were removed again because \
             another step started the generation first; this call asks for a full snapshot of that generation, which can no \
             longer be written. Restore the workflow's snapshot settings the other step ran with, or start a new generation \
             with seed --reseed",
            ctx.workflow.app_id
        )));
    }
    complete_committed(ctx, &c, kind, gap).await.map(Some)
}

/// Writes the completion row of a committed full snapshot (see [`finish_committed`]).
pub async fn complete_committed(ctx: &mut Context, c: &CommittedFull, kind: &str, gap: Option<Gap>) -> StepResult<SnapshotResult> {
    tracing::warn!(snapshot = %c.s, generation = c.generation, "bronze holds a full snapshot without its completion row (a crash between the two): writing it now");
    failpoint!("snapshot.before_repaired_completion");
    if let Some(meta) = &c.seed_meta {
        // A seed's rows (its call cut, or still running, between its two
        // commits): completed as the seed's, so a rerun of it finds itself.
        if let Some(refusal) = super::seed::complete_from_commit(ctx, c.generation, c.s, c.rows, c.bronze_version, meta).await? {
            // Another step took the generation first and the seed's rows are
            // removed again. The seed's refusal (exit 2, "seed --reseed")
            // speaks to the seed's caller; this call only has to read the
            // state again, which now shows the step that holds the generation.
            tracing::warn!(error = %refusal, "the seed this call was completing lost its generation");
            return Err(StepError::Temporary(format!(
                "the seed at {} whose rows bronze held for generation {} lost the generation to another step while this call \
                 completed it, and its rows were removed: call again, the next call reads what holds the generation now",
                c.s, c.generation
            )));
        }
        return Ok(SnapshotResult { step: "snapshot", snapshot_lsn: c.s, rows: c.rows, already_done: true, ranges: 0, duration_ms: 0 });
    }
    // The row names the instance the snapshot was read on, not the newest.
    super::switch::use_instance_of_commit(ctx, c.capture_instance.as_deref()).await?;
    write_completion(ctx, c.generation, kind, c.s, c.rows, Some(c.bronze_version), None, gap, c.fence).await?;
    failpoint!("snapshot.after_repaired_completion");
    Ok(SnapshotResult { step: "snapshot", snapshot_lsn: c.s, rows: c.rows, already_done: true, ranges: 0, duration_ms: 0 })
}

/// Records a full snapshot that outlived the CDC retention (its own LSN was
/// purged before its read ended, so the stream cannot go on from it) and
/// returns the error that stops the step. Nothing of it is in bronze's
/// snapshot image: the read is not committed (or, after a crash, never completed).
pub async fn record_failed(ctx: &mut Context, generation: i32, s: Lsn, min_lsn: Option<Lsn>, why: &str) -> StepError {
    if let Err(e) = record_failed_row(ctx, generation, s, min_lsn, why).await {
        return e;
    }
    failed_error(generation, s, why)
}

/// The error of a failed full re-snapshot: what happened and what to do.
pub fn failed_error(generation: i32, s: Lsn, why: &str) -> StepError {
    StepError::NeedsPerson(format!(
        "the full snapshot at {s} for generation {generation} took longer than the CDC retention ({why}): the stream cannot \
         go on from it. Read the table within the retention: set snapshot.mode = \"chunked\" (the stream reads the changes \
         from S while backfill reads the chunks, so S cannot be purged) and rerun with --resnapshot-interval-days 0, which \
         opens the same generation; or raise the CDC retention"
    ))
}

/// Whether the facts already record the failure of the full snapshot at `s` for `generation`.
pub fn failure_recorded(rows: &[crate::delta::facts::FactRow], generation: i32, s: Lsn) -> bool {
    rows.iter().any(|r| {
        r.event.as_deref() == Some(EVENT_RESNAPSHOT_FAILED)
            && r.min_lsn == Some(s)
            && r.detail.as_ref().and_then(|d| d.get("target_generation")).and_then(Value::as_i64) == Some(generation as i64)
    })
}

/// Writes the `resnapshot_failed` row of the full snapshot at `s` for `generation`.
pub async fn record_failed_row(ctx: &mut Context, generation: i32, s: Lsn, min_lsn: Option<Lsn>, why: &str) -> StepResult<()> {
    let mut row = ctx.fact_row(generation.saturating_sub(1).max(0));
    row.event = Some(EVENT_RESNAPSHOT_FAILED.into());
    row.min_lsn = Some(s);
    row.max_lsn = Some(s);
    // When it failed, on the server's clock (the anti-loop guard's time):
    // the commit time of max LSN now. S's own mapping row may be purged.
    let now = match ctx.source.max_lsn().await {
        Ok(Some(m)) => ctx.commit_time(m).await.ok().flatten(),
        _ => None,
    };
    row.commit_ts = match now {
        Some(t) => Some(t),
        None => ctx.commit_time(s).await.ok().flatten(),
    };
    row.retention_watermark_ts = match min_lsn {
        Some(m) => ctx.commit_time(m).await.ok().flatten(),
        None => None,
    };
    row.detail = Some(json!({"mode": "full", "target_generation": generation, "reason": why, "failed_at": Utc::now()}));
    super::state::append_facts_untracked(ctx, vec![row]).await
}

/// Takes a full snapshot for `generation`: the open row, the read of the
/// whole table at S = max LSN, one bronze commit, the completion row
/// (`bootstrap` or `resnapshot`, with the gap it closes).
pub async fn take_full(ctx: &mut Context, generation: i32, kind: &str, gap: Option<Gap>) -> StepResult<SnapshotResult> {
    // Before the open row: a read with renamed columns must not even start.
    super::check_no_renamed_columns(ctx, "a full snapshot")?;
    let started = Instant::now();
    let app = ctx.workflow.app_id.clone();
    let snap_txn = txn_full_snapshot(&app, generation);
    let s = ctx.source.max_lsn().await?.ok_or_else(|| {
        StepError::Temporary("the capture job has not recorded any LSN yet (max LSN is NULL): call again once it has run".into())
    })?;
    // The new generation's stream starts at S on the instance the switch
    // rule reaches there, and the rows are read with that one's columns.
    // The instance the context picked was planned at an earlier max LSN: if
    // S is at or past a newer instance's start, the changes between that
    // start and S are the newer instance's alone and the stream never reads
    // them (they are not after S), so the rows must carry their columns.
    let pinned = ctx.workflow.table.capture_instance.is_some();
    let instances = if pinned { Vec::new() } else { ctx.source.capture_instances(&ctx.workflow.table_name()).await? };
    let reached = super::switch::reached_at(s, &ctx.instance, &instances);
    if reached.name != ctx.instance.name {
        tracing::info!(from = %ctx.instance.name, to = %reached.name, snapshot = %s, "the snapshot reads the instance the stream reads from its S on");
        ctx.instance = reached;
    }
    // A heap's read is fenced: it must not hold commits that set columns
    // a newer instance adds (engine::switch::newer_with_added_columns).
    if ctx.instance.index_columns.is_empty() {
        if let Some(newer) = super::switch::newer_with_added_columns(&ctx.instance, &instances) {
            return Err(super::switch::fenced_read_refused(
                &ctx.instance,
                newer,
                "this full snapshot",
                "Nothing was written; call again once the capture job has passed that start (the snapshot then reads the newer instance).",
            ));
        }
    }
    // The rows are read with this instance's columns: bronze must hold them
    // all (it may be older than the instance; see stream::run_transitions).
    let instance = ctx.instance.clone();
    super::switch::add_bronze_columns(ctx, &instance).await?;
    let commit_ts = ctx.commit_time(s).await?;
    let mut open = ctx.fact_row(generation);
    open.event = Some(EVENT_SNAPSHOT_OPEN.into());
    open.min_lsn = Some(s);
    open.max_lsn = Some(s);
    open.commit_ts = commit_ts;
    open.lost_from_ts = gap.and_then(|g| g.lost_from_ts);
    open.lost_to_ts = gap.and_then(|g| g.lost_to_ts);
    open.detail = Some(json!({"mode": "full", "kind": kind, "generation": generation}));
    // Not a commit boundary (not in `FAILPOINTS`): a race test holds a run
    // here, its mode check passed, while a chunked open is written
    // (tests/records_race.rs).
    failpoint!("snapshot.before_open");
    // A run cut after its open row, called again with nothing committed
    // since, opens at the same S: that row is this run's open already
    // (untracked, so a second would stand beside it, read by nobody).
    let recorded = super::state::facts_rows(&ctx.facts, &app).await?.iter().any(|r| {
        r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN)
            && r.generation == generation
            && r.min_lsn == Some(s)
            && r.detail.as_ref().is_some_and(|d| {
                d.get("mode").and_then(serde_json::Value::as_str) == Some("full") && d.get("kind").and_then(serde_json::Value::as_str) == Some(kind)
            })
    });
    if recorded {
        tracing::info!(snapshot = %s, generation, "the open row of this full snapshot is recorded already (a run cut after it): not written again");
    } else {
        super::state::append_facts_untracked(ctx, vec![open]).await?;
    }
    failpoint!("snapshot.after_open");
    // A chunked open committed between our check and our open takes the
    // generation: stop rather than put two snapshots in it.
    let rows = super::state::facts_rows(&ctx.facts, &app).await?;
    if let Some(c) = super::chunked::open_chunked(&rows).filter(|c| c.generation == generation) {
        return Err(super::chunked::mode_conflict(&c, super::chunked::Mode::Full));
    }

    let keys = ctx.snapshot_keys();
    // A heap is read in one fenced read (one lock, one fence): its silver
    // counts a change after S only when the change's commit ended after the
    // fence (engine::apply::heap), which needs one fence for the whole table.
    let fenced = ctx.instance.index_columns.is_empty();
    let ranges = if fenced { vec![KeyRange::all()] } else { plan_ranges(ctx, &keys).await? };
    let fence_read = std::sync::Arc::new(std::sync::Mutex::new(None::<DateTime<Utc>>));
    let n_ranges = ranges.len();
    tracing::info!(snapshot = %s, ranges = n_ranges, generation, kind, "reading the table for a full snapshot");
    let stamp = SnapshotStamp { snapshot: s, start_lsn: s, commit_ts, capture_instance: ctx.instance.name.clone(), chunk: None };
    // The rows are converted to this schema, and the append's writer takes
    // the same table state (`delta::append_idempotent_with`), not a newer one
    // a concurrent call gave an added column meanwhile.
    let bronze_schema = ctx.bronze_schema()?;
    let (tx, rx) = mpsc::channel::<StepResult<RecordBatch>>(2 * n_ranges.max(1));
    let mut readers = Vec::new();
    for range in ranges {
        let read = SnapshotRead {
            table: ctx.workflow.table_name(),
            columns: ctx.instance.columns.clone(),
            keys: keys.clone(),
            range,
            isolation: ctx.workflow.snapshot.isolation,
            batch_rows: ctx.workflow.snapshot.batch_rows,
        };
        let source = ctx.source.clone();
        let tx = tx.clone();
        let stamp = stamp.clone();
        let schema = bronze_schema.clone();
        let (zone, fence_read) = (ctx.zone.clone(), fence_read.clone());
        let on = ctx.instance.clone();
        readers.push(tokio::spawn(async move {
            let opened = if fenced {
                source.snapshot_read_fenced(&read).await.map(|f| (f.batches, Some(f.fence)))
            } else {
                source.snapshot_read(&read).await.map(|s| (s, None))
            };
            let (mut stream, fence) = match opened {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
            };
            while let Some(b) = stream.next().await {
                let item = b.map_err(StepError::from).and_then(|b| bronze::from_snapshot(&b, &schema, &stamp));
                let failed = item.is_err();
                if tx.send(item).await.is_err() || failed {
                    return;
                }
            }
            // The fence is in before this sender goes, so before the commit's metadata is written.
            if let Some(f) = fence {
                match f.await.and_then(|local| zone.fence_to_utc(local)) {
                    Ok(at) => *fence_read.lock().expect("lock") = Some(at),
                    Err(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                }
                // An instance created while the read was starting: an error
                // through the channel, so the append commits nothing.
                let checked = super::switch::check_after_fenced_read(source.as_ref(), &read.table, pinned, &on, "this full snapshot").await;
                if let Err(e) = checked {
                    let _ = tx.send(Err(e)).await;
                }
            }
        }));
    }
    drop(tx);
    // A bar on a terminal only (`crate::progress`); its total is the
    // source's estimate, asked only when the bar is drawn.
    let progress = if crate::progress::enabled() {
        let total = ctx.source.row_estimate(&ctx.workflow.table_name()).await.ok();
        crate::progress::Progress::rows(&format!("full snapshot of {}", ctx.workflow.table_name()), total)
    } else {
        crate::progress::Progress::default()
    };
    let rows_stream = tokio_stream_from(rx);
    let counted = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let c2 = counted.clone();
    let p2 = progress.clone();
    let rows_stream = rows_stream.inspect(move |b| {
        if let Ok(b) = b {
            c2.fetch_add(b.num_rows() as i64, std::sync::atomic::Ordering::Relaxed);
            p2.inc(b.num_rows() as u64);
        }
    });
    // Step 3 of the recovery (adr-0018): once every row is read and before
    // the commit, is S still readable? A read that outlived the retention
    // must not become the snapshot the stream continues from, so the writer
    // gets an error instead of its end and commits nothing.
    let purged = std::sync::Arc::new(std::sync::Mutex::new(None::<Option<Lsn>>));
    let check = {
        let source = ctx.source.clone();
        let ci = ctx.instance.name.clone();
        let purged = purged.clone();
        futures::stream::once(async move {
            let min = source.min_lsn(&ci).await?;
            let max = source.max_lsn().await?;
            if is_purged_after(s, min, max) {
                *purged.lock().expect("lock") = Some(min);
                return Err(StepError::Internal("the snapshot's LSN was purged during its read".into()));
            }
            Ok(None)
        })
        .filter_map(|r: StepResult<Option<RecordBatch>>| async move { r.transpose() })
    };
    let rows_stream = rows_stream.chain(check);
    // The row count is only known after the read, so the metadata names the
    // snapshot and the count is recorded from the stream as it passes.
    let meta = json!({"kind": "snapshot", "mode": "full", "snapshot_lsn": s, "generation": generation, "event": kind, "capture_instance": ctx.instance.name});
    let appended = append_counted(ctx, rows_stream, bronze_schema, &snap_txn, meta, counted.clone(), fence_read.clone()).await;
    for r in readers {
        let _ = r.await;
    }
    progress.finish();
    let purged_min = purged.lock().expect("lock").take();
    if let Some(min) = purged_min {
        return Err(record_failed(ctx, generation, s, min, "CDC cleanup passed its LSN before the read ended").await);
    }
    let appended = appended?;
    let rows = counted.load(std::sync::atomic::Ordering::Relaxed);
    let bronze_version = match appended {
        Appended::Committed { table_version } => Some(table_version),
        Appended::Empty => None,
        Appended::AlreadyApplied { .. } => {
            return Err(StepError::Temporary(format!("another run committed the full snapshot of generation {generation} meanwhile: call again")))
        }
    };
    failpoint!("snapshot.after_bronze");
    let duration_ms = started.elapsed().as_millis() as i64;
    let fence = *fence_read.lock().expect("lock");
    write_completion(ctx, generation, kind, s, rows, bronze_version, Some(duration_ms), gap, fence).await?;
    failpoint!("snapshot.after_event");
    tracing::info!(snapshot = %s, rows, duration_ms, generation, kind, "full snapshot complete");
    Ok(SnapshotResult { step: "snapshot", snapshot_lsn: s, rows, already_done: false, ranges: n_ranges, duration_ms })
}

/// Appends the snapshot's rows; the row count goes into the metadata once
/// known, by writing the count the stream saw into the commit (the writer
/// only commits after the last batch).
async fn append_counted<S>(
    ctx: &mut Context,
    batches: S,
    schema: deltalake::arrow::datatypes::SchemaRef,
    txn: &Txn,
    meta: Value,
    counted: std::sync::Arc<std::sync::atomic::AtomicI64>,
    fence: std::sync::Arc<std::sync::Mutex<Option<DateTime<Utc>>>>,
) -> StepResult<Appended>
where
    S: futures::Stream<Item = StepResult<RecordBatch>> + Send,
{
    delta::append_idempotent_with(&mut ctx.bronze, batches, schema, txn, move || {
        let mut m = meta.clone();
        m["rows"] = json!(counted.load(std::sync::atomic::Ordering::Relaxed));
        if let Some(f) = *fence.lock().expect("lock") {
            m["fence"] = json!(f);
        }
        m
    })
    .await
}

/// Writes the snapshot's completion row (`bootstrap` or `resnapshot`), once per generation.
///
/// The row has no batch id and min = max = S. adr-0018 leaves its row count
/// and read time empty when a run reuses a snapshot an earlier, crashed run
/// committed to bronze; here the count is taken from that bronze commit's
/// metadata instead (its `rows`), so the row says how many rows the snapshot
/// holds whichever run finished it. Only the read time stays empty on reuse:
/// this run did not read.
#[allow(clippy::too_many_arguments)]
async fn write_completion(
    ctx: &mut Context,
    generation: i32,
    kind: &str,
    s: Lsn,
    rows: i64,
    bronze_version: Option<i64>,
    duration_ms: Option<i64>,
    gap: Option<Gap>,
    fence: Option<DateTime<Utc>>,
) -> StepResult<()> {
    let mut row = ctx.fact_row(generation);
    row.event = Some(kind.into());
    row.min_lsn = Some(s);
    row.max_lsn = Some(s);
    row.rows = Some(rows);
    row.duration_ms = duration_ms;
    row.commit_ts = ctx.commit_time(s).await?;
    row.bronze_version = bronze_version;
    row.lost_from_ts = gap.and_then(|g| g.lost_from_ts);
    row.lost_to_ts = gap.and_then(|g| g.lost_to_ts);
    row.retention_watermark_ts = gap.and_then(|g| g.lost_to_ts);
    let mut detail = json!({"mode": "full"});
    if let Some(f) = fence {
        // A heap's read fence: its silver counts the changes after it (engine::apply::heap).
        detail["fence"] = json!(f);
    }
    row.detail = Some(detail);
    let txn = Txn::new(format!("{}#events", ctx.workflow.app_id), generation as i64);
    super::state::append_facts(ctx, vec![row], &txn).await?;
    Ok(())
}

fn tokio_stream_from<T: Send + 'static>(mut rx: mpsc::Receiver<T>) -> impl futures::Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn covers(ranges: &[KeyRange], v: i64) -> usize {
        ranges.iter().filter(|r| r.contains(&[SqlValue::Int(v)])).count()
    }

    #[test]
    fn integer_split_tiles_and_handles_edges() {
        let r = split_integer(1, 100, 4);
        assert_eq!(r.len(), 4);
        assert!(r[0].lo.is_none() && r[3].hi.is_none());
        for v in [-5, 1, 25, 26, 100, 1000] {
            assert_eq!(covers(&r, v), 1, "value {v}");
        }
        // NULL keys only in the first range.
        assert!(r[0].contains(&[SqlValue::Null]));
        assert!(!r[1].contains(&[SqlValue::Null]));
        // More ranges than values, and the extremes of bigint.
        assert_eq!(split_integer(5, 5, 8).len(), 1);
        let r = split_integer(i64::MIN, i64::MAX, 3);
        assert_eq!(r.len(), 3);
        assert_eq!(covers(&r, i64::MAX), 1);
    }

    proptest! {
        #[test]
        fn every_value_in_exactly_one_range(min in -1000i64..1000, len in 0i64..5000, n in 1usize..12, probe in -3000i64..8000) {
            let r = split_integer(min, min + len, n);
            prop_assert_eq!(covers(&r, probe), 1);
        }
    }
}
