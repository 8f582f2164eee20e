//! The `backfill` step: its checks before any read, the repair of a wave
//! left without its facts rows, and the loop that gathers the readers' chunks
//! per wave and commits the waves in order. The one place that wires the
//! plan, the readers and the sink (each in its own file) together.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Mutex;

use super::open::ensure_bootstrap_open;
use super::planning::{ensure_plan, keyset_shape, same_columns, SourceKeys};
use super::reader::{ChunkReadOutcome, ChunkReader, Coordinator, ReadEvent};
use super::tables::{open_plans, payload_of, plan_rows};
use super::wave::{chunks_from_bronze, refuse_over_stream_gap, GapCheck, Sink, WaveRead};
use crate::engine::rules::{
    chunked_of_generation, full_holding_mode, is_completed, mode_conflict, open_chunked, progress, switch_batch_of, txn_completion,
    txn_switch_done, txn_wave_bronze, txn_wave_rows, ChunkPayload, Gap, Mode, OpenPayload, PlannedChunk, EVENT_SNAPSHOT_CHUNK,
};
use crate::delta::facts::EVENT_SNAPSHOT_OPEN;
use crate::delta::{self, plans, Txn};
use crate::engine::state::{self, generation_of};
use crate::engine::Context;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;
use crate::source::{Isolation, KeyRange, SnapshotRead};

/// Options of one `backfill` call (CLI flags over the workflow's values).
#[derive(Debug, Clone, Default)]
pub struct BackfillArgs {
    pub max_waves: Option<u32>,
    pub max_seconds: Option<f64>,
    pub chunk_rows: Option<u64>,
    pub min_headroom_hours: Option<f64>,
    pub isolation: Option<Isolation>,
    pub target_wave_seconds: Option<f64>,
    /// Which of the snapshot lane's transitions the call may run.
    pub transitions: LaneTransitions,
}

/// The snapshot lane's transitions one call runs (`engine::machine`). The
/// coarse `backfill` runs them all, in order; `step` runs one, which makes
/// exactly that transition's commits. Every variant first runs the same
/// checks, which write nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LaneTransitions {
    /// `open` (a chunked bootstrap the stream has not opened), `plan`, the
    /// end of a wave a crash left half recorded, the waves, `complete`.
    #[default]
    All,
    /// `plan` alone: its plans row, then its facts row.
    Plan,
    /// One `wave`: its bronze, plans and facts commits. The rerun of a wave
    /// a crash cut (bronze or plans in, facts not) finishes that wave from
    /// its recorded commit instead of reading one. Never the completion,
    /// not even after the last wave: that is `complete`.
    Wave,
    /// `complete` alone: the completion row, once every chunk's facts row
    /// is in (a last wave a crash cut is finished first, as its `wave`'s
    /// rerun would).
    Complete,
}

/// The JSON result of a `backfill` call.
#[derive(Debug, Clone, Serialize, Default)]
pub struct BackfillResult {
    pub step: &'static str,
    /// S of the snapshot worked on (None when none is open).
    pub snapshot: Option<Lsn>,
    pub generation: i32,
    pub chunks_done: usize,
    pub chunks_total: usize,
    pub done: bool,
    pub paused: bool,
    pub reason: Option<String>,
    /// Waves this call committed (not counting a repaired one).
    pub waves: u32,
    pub rows: i64,
    pub repaired_wave: Option<i64>,
    /// Per wave: seconds from its last chunk's last row read to its facts rows committed.
    pub wave_fixed_seconds: Vec<f64>,
    pub duration_ms: i64,
}

/// Runs the `backfill` step.
pub async fn backfill(ctx: &mut Context, args: &BackfillArgs) -> StepResult<BackfillResult> {
    let started = Instant::now();
    let app = ctx.workflow.app_id.clone();
    let mut result = BackfillResult { step: "backfill", ..Default::default() };
    ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
    // Chunks are read with the columns of the instance the stream is on
    // (engine::switch's module docs argue why, and why a wave past a newer
    // instance's start waits for the stream).
    let instances = crate::engine::switch::follow_stream(ctx).await?;
    let mut rows = state::facts_rows(&ctx.facts, &app).await?;
    let min = ctx.source.min_lsn(&ctx.instance.name).await?;
    if let Some(full) = full_holding_mode(&rows, min) {
        return Err(mode_conflict(&full, Mode::Chunked));
    }
    let mut open = open_chunked(&rows);
    let only = args.transitions;
    if only == LaneTransitions::All
        && open.is_none()
        && ctx.workflow.snapshot.bootstrap
        && ctx.workflow.snapshot.mode == crate::workflow::SnapshotMode::Chunked
    {
        // The workflow asks for a chunked bootstrap the stream has not opened
        // yet: open it here, so the two steps may be called in either order.
        if ensure_bootstrap_open(ctx).await?.is_some() {
            rows = state::facts_rows(&ctx.facts, &app).await?;
            open = open_chunked(&rows);
        }
    }
    let Some(o) = open else {
        result.generation = generation_of(&rows);
        if let Some(c) = chunked_of_generation(&rows) {
            let p = progress(&rows, c.s);
            result.snapshot = Some(c.s);
            result.chunks_done = p.done.len();
            result.chunks_total = p.done.len();
        }
        result.done = true;
        result.reason = Some("no chunked snapshot is open: nothing to backfill".into());
        return Ok(result);
    };
    result.snapshot = Some(o.s);
    result.generation = o.generation;
    // With the stream's instance (followed above), before any plan or wave is written.
    crate::engine::check_no_renamed_columns(ctx, "backfill")?;
    // A gap in the stream after S ruins the snapshot: no chunk is worth reading.
    refuse_over_stream_gap(&ctx.source, &ctx.instance.name, &rows, &o, ctx.workflow.stream.on_data_loss, &ctx.workflow.path).await?;
    let isolation = args.isolation.unwrap_or(ctx.workflow.snapshot.isolation);
    let mut plans_table = open_plans(ctx).await?;
    let location = plans::location_for(&ctx.workflow.target.bronze);
    let prow = plan_rows(&mut plans_table, &app, o.s).await?;
    let open_payload: OpenPayload = payload_of(&prow, EVENT_SNAPSHOT_OPEN, "open", &location)?;
    let keys_now = ctx.snapshot_keys();
    if !same_columns(&open_payload.keys, &keys_now) {
        return Err(StepError::Config(format!(
            "the chunked snapshot at {} is cut on ({}), but the workflow's keys are now ({}): a plan never moves to other columns. \
             Set snapshot.keys back to [{}] until the snapshot completes",
            o.s,
            open_payload.keys.join(", "),
            keys_now.join(", "),
            open_payload.keys.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", ")
        )));
    }
    if only != LaneTransitions::All && (only == LaneTransitions::Plan) == is_planned(&rows, o.s) {
        return Err(StepError::Config(format!(
            "the chunked snapshot at {} is {}planned: the transition asked for is not the one to run now \
             (`mssql-cdc --workflow {} step next` runs the one that is)",
            o.s,
            if only == LaneTransitions::Plan { "already " } else { "not " },
            ctx.workflow.path.display()
        )));
    }
    let plan = ensure_plan(ctx, &mut plans_table, &o, &open_payload, &rows, args.chunk_rows, isolation).await?;
    result.chunks_total = plan.chunk_count;
    if only == LaneTransitions::Plan {
        result.chunks_done = progress(&rows, o.s).done.len();
        result.reason = Some("planned".into());
        result.duration_ms = started.elapsed().as_millis() as i64;
        return Ok(result);
    }

    // Reload after planning: the facts now hold every row this call relies on.
    rows = state::facts_rows(&ctx.facts, &app).await?;
    let mut prog = progress(&rows, o.s);
    let mut header = ctx.fact_row(o.generation);
    header.recorded_at = None;
    header.commit_ts = ctx.commit_time(o.s).await?;
    // A re-snapshot's completion carries the gap its open recorded; a
    // switch's open names the batch its completion's txn is keyed by.
    let open_row = rows.iter().find(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN) && r.min_lsn == Some(o.s) && r.generation == o.generation);
    let gap = open_row.map(|r| Gap { lost_from_ts: r.lost_from_ts, lost_to_ts: r.lost_to_ts }).unwrap_or_default();
    let completion_txn = match open_row.and_then(switch_batch_of) {
        Some(b) => txn_switch_done(&app, o.s, b),
        None => txn_completion(&app, o.generation),
    };
    let mut sink = Sink {
        app: app.clone(),
        s: o.s,
        generation: o.generation,
        kind: o.kind.clone(),
        header,
        gap,
        completion_txn,
        bronze: ctx.bronze.clone(),
        facts: ctx.facts.clone(),
        plans: plans_table,
        chunks_total: plan.chunk_count,
        done: prog.done.keys().copied().collect(),
        rows_total: prog.done.values().sum(),
        waves_total: prog.waves.clone(),
        gap_check: GapCheck {
            source: ctx.source.clone(),
            instance: ctx.instance.name.clone(),
            open: o.clone(),
            on_data_loss: ctx.workflow.stream.on_data_loss,
            workflow: ctx.workflow.path.clone(),
        },
        complete_after_last_wave: true,
    };

    // Repair: a wave whose bronze or plans rows are in without its facts rows.
    let wave_app = txn_wave_bronze(&app, o.s, 0).app_id;
    let rows_app = txn_wave_rows(&app, o.s, 0).app_id;
    let bv = delta::txn_version(&sink.bronze, &wave_app).await?;
    let pv = delta::txn_version(&sink.plans, &rows_app).await?;
    let fv = delta::txn_version(&sink.facts, &rows_app).await?;
    if pv > fv {
        let w = pv.expect("greater than something");
        let prs = plan_rows(&mut sink.plans, &app, o.s).await?;
        let chunks: Vec<ChunkPayload> = prs
            .iter()
            .filter(|r| r.event == EVENT_SNAPSHOT_CHUNK && r.wave == Some(w))
            .filter_map(|r| serde_json::from_value(r.detail.clone()).ok())
            .collect();
        tracing::warn!(wave = w, "the plans table holds a wave without its facts rows (a crash between the two): writing them now");
        let ts = match chunks.first() {
            Some(c) => ctx.commit_time(c.stamp).await?,
            None => None,
        };
        sink.write_wave_facts(&chunks, ts, true, None).await?;
        result.repaired_wave = Some(w);
    } else if bv > pv.max(fv) {
        let w = bv.expect("greater than something");
        let chunks: Vec<ChunkPayload> = match delta::find_txn_commit(&sink.bronze, &Txn::new(wave_app.clone(), w)).await? {
            Some((version, meta)) => meta
                .get("chunks")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|c| {
                            let mut c = c.clone();
                            c["wave"] = json!(w);
                            c["bronze_version"] = json!(version);
                            c["read_ms"] = Value::Null;
                            serde_json::from_value::<ChunkPayload>(c).ok()
                        })
                        .collect()
                })
                .unwrap_or_default(),
            None if ctx.instance.index_columns.is_empty() => {
                // A heap's chunks count later changes against their fences,
                // which only the commit's metadata holds.
                return Err(StepError::NeedsPerson(format!(
                    "bronze records wave {w} of the chunked snapshot at {} of a table without a unique index, but the wave's \
                     commit (which holds its chunks' read fences) is no longer in the log: open a new snapshot (a new generation)",
                    o.s
                )));
            }
            None => {
                let first = plan.chunks.iter().map(|c| c.chunk).find(|c| !sink.done.contains(c)).unwrap_or(0);
                tracing::warn!(wave = w, "the wave's bronze commit is no longer in the log: rebuilding its facts from its rows in bronze");
                chunks_from_bronze(&sink.bronze, o.s, w, &plan, first).await?
            }
        };
        if chunks.is_empty() {
            return Err(StepError::Internal(format!("bronze's commit of wave {w} names no chunks")));
        }
        tracing::warn!(wave = w, chunks = chunks.len(), "bronze holds a wave without its facts rows (a crash between the commits): writing them now");
        let ts = ctx.commit_time(chunks[0].stamp).await?;
        sink.finish_wave(&chunks, ts, true, None).await?;
        result.repaired_wave = Some(w);
    }
    if result.repaired_wave.is_some() {
        rows = state::facts_rows(&sink.facts, &app).await?;
        prog = progress(&rows, o.s);
    }
    // A `wave` that finished the wave a crash cut is that wave's rerun: done.
    // One asked of a snapshot whose chunks are all read reads nothing.
    if only == LaneTransitions::Wave && (result.repaired_wave.is_some() || sink.done.len() >= sink.chunks_total) {
        result.chunks_done = sink.done.len();
        result.done = is_completed(&state::facts_rows(&sink.facts, &app).await?, o.s);
        result.reason = Some(if result.repaired_wave.is_some() { "a wave a crash cut was finished" } else { "every chunk is read: complete is next" }.into());
        ctx.facts = sink.facts;
        ctx.bronze = sink.bronze;
        result.duration_ms = started.elapsed().as_millis() as i64;
        return Ok(result);
    }
    if only == LaneTransitions::Wave {
        sink.complete_after_last_wave = false;
    } else if sink.complete_if_done(None).await? || is_completed(&state::facts_rows(&sink.facts, &app).await?, o.s) {
        result.chunks_done = sink.done.len();
        result.done = true;
        result.reason = Some("complete".into());
        ctx.facts = sink.facts;
        ctx.bronze = sink.bronze;
        result.duration_ms = started.elapsed().as_millis() as i64;
        return Ok(result);
    } else if only == LaneTransitions::Complete {
        return Err(StepError::Config(format!(
            "the chunked snapshot at {} has {} of its {} chunks read: complete is not the transition to run now \
             (`mssql-cdc --workflow {} step next` runs the one that is)",
            o.s,
            sink.done.len(),
            sink.chunks_total,
            ctx.workflow.path.display()
        )));
    }
    let max_waves = if only == LaneTransitions::Wave { Some(1) } else { args.max_waves };

    // The waves. A pool of `parallelism` readers lives for the whole call and
    // pulls chunks from one queue; when the queue runs dry the reader that
    // found it empty stamps the next wave and queues its chunks, so no
    // connection waits for a wave's slowest chunk. Each chunk is written to
    // its own data files as it is read. This task commits the waves, in order,
    // as each one's chunks are all in: the reads go on meanwhile, but only one
    // wave ahead. While two waves are uncommitted (MAX_UNCOMMITTED_WAVES) a
    // reader that finds the queue empty waits on `commits`, which this task
    // bumps after each commit and when the call fails, then asks again: it
    // gets a chunk, waits again, or (failed, out of budget) exits.
    let pending: VecDeque<PlannedChunk> = plan.chunks.iter().filter(|c| !sink.done.contains(&c.chunk)).cloned().collect();
    let first_wave = [bv, pv, fv, prog.last_wave].into_iter().flatten().max().map(|w| w + 1).unwrap_or(0);
    let parallelism = ctx.workflow.snapshot.parallelism.max(1);
    let shape = keyset_shape(ctx, &plan.keys);
    let coordinator = Arc::new(Mutex::new(Coordinator {
        pending,
        queue: VecDeque::new(),
        next_wave: first_wave,
        waves_started: 0,
        waves_committed: 0,
        reading: BTreeMap::new(),
        stop_reason: None,
        paused: false,
        failed: false,
        pace_round_seconds: prog.pace_round_seconds,
        max_waves,
        deadline: args.max_seconds.map(|s| started + Duration::from_secs_f64(s.max(0.0))),
        min_headroom_hours: args.min_headroom_hours.or(ctx.workflow.snapshot.min_headroom_hours),
        target_wave_seconds: args.target_wave_seconds.unwrap_or(ctx.workflow.snapshot.target_wave_seconds),
        parallelism,
        open_end: plan.open_end,
        last_chunk: plan.chunks.len() as i64 - 1,
        max_key: open_payload.max.clone(),
        keys: SourceKeys { source: ctx.source.clone(), table: ctx.workflow.table_name(), keys: plan.keys.clone(), isolation },
        shape,
        facts: ctx.facts.clone(),
        app: app.clone(),
        generation: o.generation,
        zone: ctx.zone.clone(),
        s: o.s,
        stream_instance: ctx.instance.clone(),
        instances,
    }));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<ReadEvent>();
    // Waves this call committed; every change (and a failure) wakes the readers waiting for a commit.
    let (commits, commits_seen) = tokio::sync::watch::channel(0u32);
    // The readers' bronze is this state, never refreshed, and `schema` is
    // read from it: each chunk's writer (`ChunkReader::read`) has the
    // columns its rows are converted to, whatever a concurrent call adds to
    // bronze meanwhile (the race `delta::append_idempotent_with` and the
    // stream's batch guard against). The wave's commit (`Sink::commit`,
    // `delta::commit_adds`) is made on bronze's newest state.
    let reader = ChunkReader {
        source: ctx.source.clone(),
        bronze: ctx.bronze.clone(),
        schema: ctx.bronze_schema()?,
        base: SnapshotRead {
            table: ctx.workflow.table_name(),
            columns: ctx.instance.columns.clone(),
            keys: plan.keys.clone(),
            range: KeyRange::all(),
            isolation,
            batch_rows: ctx.workflow.snapshot.batch_rows,
        },
        capture_instance: ctx.instance.name.clone(),
        s: o.s,
        fenced: ctx.instance.index_columns.is_empty(),
        check_newer_after_fence: ctx.workflow.table.capture_instance.is_none().then(|| ctx.instance.clone()),
        zone: ctx.zone.clone(),
    };
    let mut readers = Vec::with_capacity(parallelism);
    for _ in 0..parallelism {
        let (coordinator, tx, reader, seen) = (coordinator.clone(), tx.clone(), reader.clone(), commits_seen.clone());
        readers.push(tokio::spawn(async move { reader.run(coordinator, tx, seen).await }));
    }
    drop(tx);
    drop(commits_seen);
    // A bar of chunks on a terminal only (`crate::progress`).
    let bar = crate::progress::Progress::new(&format!("backfill of {}", ctx.workflow.table_name()), "chunks", Some(sink.chunks_total as u64));
    bar.set_position(sink.done.len() as u64);
    let mut rows_read: i64 = 0;
    let mut waves: BTreeMap<i64, WaveAcc> = BTreeMap::new();
    let mut next_commit = first_wave;
    let mut failure: Option<StepError> = None;
    while let Some(event) = rx.recv().await {
        match event {
            ReadEvent::WaveStarted { wave, chunks, stamp, stamp_ts, rounds, at } => {
                waves.insert(
                    wave,
                    WaveAcc {
                        expected: chunks,
                        stamp,
                        stamp_ts,
                        rounds,
                        started: at,
                        chunks: Vec::new(),
                        adds: Vec::new(),
                        rows: 0,
                        ended: at,
                        max_lsn_after: None,
                        every_max_lsn_read: true,
                    },
                );
            }
            ReadEvent::ChunkRead { wave, chunk, outcome, ended } => {
                let ChunkReadOutcome { rows, read_ms, read_bytes, fence, max_lsn_after, adds } = outcome;
                rows_read += rows;
                bar.inc(1);
                bar.set_message(format!("· {rows_read} rows read"));
                if let Some(acc) = waves.get_mut(&wave) {
                    acc.rows += rows;
                    acc.adds.extend(adds);
                    acc.ended = acc.ended.max(ended);
                    acc.chunks.push((chunk, rows, read_ms, read_bytes, fence));
                    acc.every_max_lsn_read &= max_lsn_after.is_some();
                    acc.max_lsn_after = acc.max_lsn_after.max(max_lsn_after);
                }
            }
            ReadEvent::Failed(e) => {
                failure.get_or_insert(e);
            }
        }
        // Commit every wave whose chunks are all in, in wave order.
        while failure.is_none() && waves.get(&next_commit).is_some_and(|w| w.chunks.len() >= w.expected) {
            let acc = waves.remove(&next_commit).expect("checked above");
            let committed = async {
                // The window's end: a max LSN read after every chunk of the
                // wave was read. The source's max LSN never goes down, so the
                // largest of those each chunk's read ended with was read after
                // the last read's rows; a wave with a chunk that brought none
                // (a heap's fenced reads, a source that cannot) asks now.
                let max_after = match (acc.every_max_lsn_read, acc.max_lsn_after) {
                    (true, Some(lsn)) => lsn,
                    _ => ctx.source.max_lsn().await?.unwrap_or(acc.stamp),
                };
                let read = acc.into_wave(next_commit, max_after, coordinator.lock().await.last_chunk);
                sink.commit(read).await
            }
            .await;
            match committed {
                Ok(c) => {
                    result.waves += 1;
                    result.rows += c.rows;
                    result.wave_fixed_seconds.push(c.fixed_seconds);
                    coordinator.lock().await.waves_committed += 1;
                    // After the count is in the coordinator: a reader woken by
                    // this finds room for the next wave.
                    let _ = commits.send_replace(result.waves);
                    next_commit += 1;
                }
                Err(e) => failure = Some(e),
            }
        }
        if failure.is_some() {
            // Stop handing out chunks; the readers finish the chunk in hand,
            // and those waiting for a commit wake, find the call failed and exit.
            coordinator.lock().await.failed = true;
            let _ = commits.send_replace(result.waves);
        }
    }
    for r in readers {
        if let Err(e) = r.await {
            failure.get_or_insert(StepError::Internal(format!("a chunk reader panicked: {e}")));
        }
    }
    bar.finish();
    let (stop_reason, paused) = {
        let c = coordinator.lock().await;
        (c.stop_reason.clone(), c.paused)
    };
    result.paused = paused;
    result.chunks_done = sink.done.len();
    let all_read = sink.done.len() >= sink.chunks_total;
    // The coarse call's last wave also completed the snapshot; a `wave` never does.
    result.done = all_read && sink.complete_after_last_wave;
    ctx.facts = sink.facts;
    ctx.bronze = sink.bronze;
    if let Some(e) = failure {
        return Err(e);
    }
    result.reason = match (result.done, all_read) {
        (true, _) => Some("complete".into()),
        (false, true) => Some("every chunk is read: complete is next".into()),
        (false, false) => stop_reason,
    };
    result.duration_ms = started.elapsed().as_millis() as i64;
    Ok(result)
}

/// Whether the facts record the plan of the snapshot at `s` (its facts row,
/// the plan's commit point).
fn is_planned(rows: &[crate::delta::facts::FactRow], s: Lsn) -> bool {
    let hex = s.to_hex();
    rows.iter().any(|r| {
        r.event.as_deref() == Some(crate::engine::rules::EVENT_SNAPSHOT_PLAN)
            && r.detail.as_ref().and_then(|d| d.get("snapshot")).and_then(Value::as_str) == Some(hex.as_str())
    })
}

/// A wave being read.
struct WaveAcc {
    expected: usize,
    stamp: Lsn,
    stamp_ts: Option<DateTime<Utc>>,
    rounds: u32,
    #[allow(dead_code)]
    started: Instant,
    chunks: Vec<(PlannedChunk, i64, i64, i64, Option<DateTime<Utc>>)>,
    adds: Vec<deltalake::kernel::Add>,
    rows: i64,
    ended: Instant,
    /// The largest max LSN a chunk's read ended with.
    max_lsn_after: Option<Lsn>,
    /// Whether every chunk so far ended its read with one.
    every_max_lsn_read: bool,
}

impl WaveAcc {
    fn into_wave(mut self, wave: i64, max_after: Lsn, last_chunk: i64) -> WaveRead {
        self.chunks.sort_by_key(|c| c.0.chunk);
        let chunks = self
            .chunks
            .into_iter()
            .map(|(c, rows, ms, bytes, fence)| ChunkPayload {
                chunk: c.chunk,
                wave,
                lo: c.lo,
                hi: c.hi,
                last: c.chunk == last_chunk,
                rows,
                stamp: self.stamp,
                max_lsn: max_after,
                read_ms: Some(ms),
                read_bytes: Some(bytes),
                rounds: self.rounds,
                bronze_version: None,
                fence,
            })
            .collect();
        WaveRead { wave, chunks, adds: self.adds, rows: self.rows, read_ended: self.ended, stamp_ts: self.stamp_ts }
    }
}
