//! The readers: the coordinator that stamps each wave and hands out its
//! chunks (at most one wave read ahead of the commits, each wave sized by the
//! pace, paused on the call's budgets and the stream's headroom), and each
//! connection's chunk reader. Apart because it runs in tasks beside the
//! commits and records nothing: it only reads the source and writes data files.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use deltalake::writer::DeltaWriter;
use deltalake::DeltaTable;
use futures::StreamExt;
use tokio::sync::Mutex;

use super::planning::SourceKeys;
use crate::engine::rules::{rounds_for_wave, PlannedChunk};
use crate::delta::bronze::{self, SnapshotStamp};
use crate::delta;
use crate::engine::plan::{self as planner, KeysetShape};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::source::{KeyRange, SharedSource, SnapshotRead};
use crate::types::Key;

/// Waves a call may have stamped and not yet committed (adr-0028 Amendment
/// 3: "at most one wave reads while one commits"). A reader that finds the
/// queue empty starts no wave while this many are uncommitted: it waits for
/// the oldest one's commit. So a chunk of wave n + 2 is never read before
/// wave n is committed (bronze, plans and facts rows), a crash loses at most
/// the two waves' reads, and `--max-seconds` is passed by at most the wave
/// being read and the commit under way.
const MAX_UNCOMMITTED_WAVES: u32 = 2;

/// What the readers tell the committing task.
pub(super) enum ReadEvent {
    /// A wave was stamped and its chunks queued.
    WaveStarted { wave: i64, chunks: usize, stamp: Lsn, stamp_ts: Option<DateTime<Utc>>, rounds: u32, at: Instant },
    /// One chunk is read and its data files written.
    ChunkRead { wave: i64, chunk: PlannedChunk, outcome: ChunkReadOutcome, ended: Instant },
    Failed(StepError),
}

/// A chunk handed to a reader, with its wave's stamp.
pub(super) struct WorkItem {
    wave: i64,
    chunk: PlannedChunk,
    stamp: Lsn,
    stamp_ts: Option<DateTime<Utc>>,
}

/// Hands out chunks and starts waves (the call's budgets and the headroom
/// pause are checked only when a wave would start).
pub(super) struct Coordinator {
    pub(super) pending: VecDeque<PlannedChunk>,
    pub(super) queue: VecDeque<WorkItem>,
    pub(super) next_wave: i64,
    pub(super) waves_started: u32,
    /// Of those, the waves whose commit (bronze, plans, facts) is done.
    pub(super) waves_committed: u32,
    /// Waves being read: wave -> (chunks not read yet, slowest read so far in ms).
    pub(super) reading: BTreeMap<i64, (usize, i64)>,
    pub(super) stop_reason: Option<String>,
    pub(super) paused: bool,
    pub(super) failed: bool,
    pub(super) pace_round_seconds: Option<f64>,
    pub(super) max_waves: Option<u32>,
    pub(super) deadline: Option<Instant>,
    pub(super) min_headroom_hours: Option<f64>,
    pub(super) target_wave_seconds: f64,
    pub(super) parallelism: usize,
    pub(super) open_end: bool,
    pub(super) last_chunk: i64,
    pub(super) max_key: Option<Key>,
    pub(super) keys: SourceKeys,
    pub(super) shape: KeysetShape,
    pub(super) facts: DeltaTable,
    pub(super) app: String,
    pub(super) generation: i32,
    pub(super) zone: crate::source::ServerZone,
    pub(super) s: Lsn,
    /// The instance the stream is on: the chunks' columns.
    pub(super) stream_instance: crate::source::CaptureInstance,
    /// The table's instances when the call started (empty when the workflow pins one).
    pub(super) instances: Vec<crate::source::CaptureInstance>,
}

/// What [`Coordinator::next`] gives a reader.
enum Next {
    /// A chunk to read.
    Chunk(WorkItem),
    /// Nothing to read now, and no wave may start: [`MAX_UNCOMMITTED_WAVES`]
    /// are uncommitted. Ask again after the next commit.
    Wait,
    /// Nothing more for this call.
    Done,
}

impl Coordinator {
    /// The next chunk to read, starting a wave when the queue is empty and
    /// fewer than [`MAX_UNCOMMITTED_WAVES`] are uncommitted.
    async fn next(&mut self, events: &tokio::sync::mpsc::UnboundedSender<ReadEvent>) -> StepResult<Next> {
        if self.failed {
            return Ok(Next::Done);
        }
        if let Some(w) = self.queue.pop_front() {
            return Ok(Next::Chunk(w));
        }
        if self.pending.is_empty() || self.stop_reason.is_some() {
            return Ok(Next::Done);
        }
        if self.max_waves.is_some_and(|m| self.waves_started >= m) {
            self.stop_reason = Some(format!("max_waves ({}) reached", self.waves_started));
            return Ok(Next::Done);
        }
        // A wave starts only before the deadline, and (next) only while at most
        // one other is uncommitted; it is sized (below) to what is left. When
        // the time runs out, one wave may still be reading and one committing,
        // so the call passes max_seconds by at most a wave and the commit under
        // way (adr-0028 Amendment 3). A reader that waited is asked here again,
        // so a wave never starts after the deadline.
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.stop_reason = Some("max_seconds reached".into());
            return Ok(Next::Done);
        }
        if self.waves_started.saturating_sub(self.waves_committed) >= MAX_UNCOMMITTED_WAVES {
            return Ok(Next::Wait);
        }
        if let Some(h) = self.min_headroom_hours {
            let headroom = self.live_headroom().await?;
            if headroom.is_none_or(|s| s < h * 3600.0) {
                self.paused = true;
                self.stop_reason = Some(match headroom {
                    Some(s) => format!(
                        "paused: the stream's retention headroom is {:.2} h, below min_headroom_hours {h}; call again once the stream has caught up",
                        s / 3600.0
                    ),
                    None => format!(
                        "paused: the stream's retention headroom is not known (min_headroom_hours {h}): no stream batch in this generation yet, \
                         or the capture instance's min LSN has no commit time; run the stream step first"
                    ),
                });
                return Ok(Next::Done);
            }
        }
        let remaining = self.deadline.map(|d| d.saturating_duration_since(Instant::now()).as_secs_f64());
        let rounds_left = self.pending.len().div_ceil(self.parallelism);
        let rounds = rounds_for_wave(self.target_wave_seconds, self.pace_round_seconds, remaining, rounds_left);
        let take = (rounds * self.parallelism).min(self.pending.len());
        let mut chunks: Vec<PlannedChunk> = self.pending.drain(..take).collect();
        if self.open_end {
            if let (Some(c), Some(max)) = (chunks.iter_mut().find(|c| c.chunk == self.last_chunk), &self.max_key) {
                // The last chunk ends at the first key after MAX as it is now,
                // so rows inserted above MAX since S (the stream's) do not pile into it.
                c.hi = planner::last_bound(&self.keys, max, &self.shape).await?;
            }
        }
        // The stamp: read before any of the wave's SELECTs starts (P1), never below S (P2).
        let stamp = self.keys.source.max_lsn().await?.ok_or_else(|| StepError::Temporary("max LSN is NULL: call again once capture has run".into()))?;
        if stamp < self.s {
            return Err(StepError::Temporary(format!(
                "the source's max LSN {stamp} is below the snapshot's S {} (a readable secondary behind the primary?): \
                 a chunk stamped below S could miss commits the stream does not have. Read from the server S came from",
                self.s
            )));
        }
        if let Some(newer) = crate::engine::switch::waits_for_switch(stamp, &self.stream_instance, &self.instances) {
            // The chunks go back unread: stamped here, read with the stream's
            // columns, they would outrank the newer instance's changes up to
            // the stamp without the columns those changes carry.
            for c in chunks.into_iter().rev() {
                self.pending.push_front(c);
            }
            self.paused = true;
            self.stop_reason = Some(format!(
                "paused: the wave's stamp {stamp} is past the start {} of capture instance '{}', which the stream (on '{}') has \
                 not switched to yet; run the stream step, then call backfill again",
                newer.start_lsn.map(|l| l.to_string()).unwrap_or_default(),
                newer.name,
                self.stream_instance.name
            ));
            return Ok(Next::Done);
        }
        // A heap's chunks are read fenced: while a newer instance adding
        // columns is listed, a chunk may hold commits that set them, whatever
        // its stamp (engine::switch::newer_with_added_columns). The stream
        // switches once it passes that instance's start.
        let fenced = self.stream_instance.index_columns.is_empty();
        if let Some(newer) = crate::engine::switch::newer_with_added_columns(&self.stream_instance, &self.instances).filter(|_| fenced) {
            for c in chunks.into_iter().rev() {
                self.pending.push_front(c);
            }
            self.paused = true;
            let refused = crate::engine::switch::fenced_read_refused(
                &self.stream_instance,
                newer,
                "the next wave",
                "Paused: run the stream step (it switches once the capture job passes that start), then call backfill again.",
            );
            self.stop_reason = Some(refused.to_string());
            return Ok(Next::Done);
        }
        let stamp_ts = self.keys.source.lsn_to_time(stamp).await?.map(|l| self.zone.to_utc(l));
        let wave = self.next_wave;
        self.next_wave += 1;
        self.waves_started += 1;
        self.reading.insert(wave, (chunks.len(), 0));
        let _ = events.send(ReadEvent::WaveStarted { wave, chunks: chunks.len(), stamp, stamp_ts, rounds: rounds as u32, at: Instant::now() });
        self.queue.extend(chunks.into_iter().map(|chunk| WorkItem { wave, chunk, stamp, stamp_ts }));
        Ok(self.queue.pop_front().map_or(Next::Done, Next::Chunk))
    }

    /// A chunk of `wave` is read in `read_ms`. Once the wave's chunks are all
    /// read, its slowest read is the pace of the waves stamped after it in
    /// this call (the record's "pace of the last wave: its read ... per
    /// round"; its commit runs beside the next wave's read). With one
    /// connection the next wave is stamped right after, at this pace; with
    /// more, a reader may have stamped it while this wave's last chunk was
    /// still being read, at the pace of the wave before.
    fn chunk_read(&mut self, wave: i64, read_ms: i64) {
        let Some(w) = self.reading.get_mut(&wave) else { return };
        w.0 = w.0.saturating_sub(1);
        w.1 = w.1.max(read_ms);
        if w.0 == 0 {
            let slowest = w.1;
            self.reading.remove(&wave);
            self.pace_round_seconds = Some(slowest as f64 / 1000.0);
        }
    }
}

/// One source connection's reader: takes chunks until the coordinator has none.
#[derive(Clone)]
pub(super) struct ChunkReader {
    pub(super) source: SharedSource,
    /// Bronze as `schema` was read from it; never refreshed (see `backfill`).
    pub(super) bronze: DeltaTable,
    pub(super) schema: deltalake::arrow::datatypes::SchemaRef,
    pub(super) base: SnapshotRead,
    pub(super) capture_instance: String,
    pub(super) s: Lsn,
    /// Read chunks fenced: the table is a heap.
    pub(super) fenced: bool,
    /// The instance whose columns are read, when a fenced read must check,
    /// after its fence, that no newer instance adding columns appeared
    /// (None when the workflow pins its instance).
    pub(super) check_newer_after_fence: Option<crate::source::CaptureInstance>,
    /// The server's zone, for the fence.
    pub(super) zone: crate::source::ServerZone,
}

impl ChunkReader {
    /// `commits` counts the waves committed; a reader told to wait sleeps
    /// until it changes (the committing task also bumps it when the call
    /// fails), so it never misses the commit it waits for: it marks the value
    /// seen before asking, and the count reaches the coordinator before it
    /// is sent. It exits when the sender is gone.
    pub(super) async fn run(
        self,
        coordinator: Arc<Mutex<Coordinator>>,
        events: tokio::sync::mpsc::UnboundedSender<ReadEvent>,
        mut commits: tokio::sync::watch::Receiver<u32>,
    ) {
        loop {
            commits.mark_unchanged();
            let next = coordinator.lock().await.next(&events).await;
            let item = match next {
                Ok(Next::Chunk(item)) => item,
                Ok(Next::Done) => return,
                Ok(Next::Wait) => {
                    if commits.changed().await.is_err() {
                        return;
                    }
                    continue;
                }
                Err(e) => {
                    coordinator.lock().await.failed = true;
                    let _ = events.send(ReadEvent::Failed(e));
                    return;
                }
            };
            match self.read_retrying(&item).await {
                Ok(outcome) => {
                    // Before asking for the next chunk: a wave stamped next is sized at this pace.
                    coordinator.lock().await.chunk_read(item.wave, outcome.read_ms);
                    let _ = events.send(ReadEvent::ChunkRead { wave: item.wave, chunk: item.chunk, outcome, ended: Instant::now() });
                }
                Err(e) => {
                    coordinator.lock().await.failed = true;
                    let _ = events.send(ReadEvent::Failed(e));
                    return;
                }
            }
        }
    }

    /// [`ChunkReader::read`], again after a transient failure (a dropped
    /// connection, a lock timeout behind a writer, a deadlock victim), with
    /// backoff for up to a minute. A chunk read is idempotent: the failed
    /// attempt's data files are never committed, the stamp was read before
    /// the first attempt's SELECT (so before every later one's too), and a
    /// fenced read takes its own fence each time.
    async fn read_retrying(&self, item: &WorkItem) -> StepResult<ChunkReadOutcome> {
        use backoff::backoff::Backoff;
        let mut schedule = backoff::ExponentialBackoff {
            initial_interval: Duration::from_millis(200),
            max_interval: Duration::from_secs(10),
            max_elapsed_time: Some(Duration::from_secs(60)),
            ..backoff::ExponentialBackoff::default()
        };
        loop {
            match self.read(item).await {
                Err(StepError::Source(crate::source::SourceError::Transient(msg))) => match schedule.next_backoff() {
                    Some(wait) => {
                        tracing::warn!(chunk = item.chunk.chunk, wave = item.wave, ?wait, "reading the chunk failed, reading it again: {msg}");
                        tokio::time::sleep(wait).await;
                    }
                    None => return Err(StepError::Source(crate::source::SourceError::Transient(msg))),
                },
                other => return other,
            }
        }
    }

    /// Reads one chunk into data files of its own.
    async fn read(&self, item: &WorkItem) -> StepResult<ChunkReadOutcome> {
        // Not a commit boundary (not in `FAILPOINTS`): a race test holds a
        // reader here while the wave before commits (tests/records_race.rs).
        failpoint!("chunked.before_chunk_read");
        let label = self.bronze.table_url().to_string();
        let t0 = Instant::now();
        let mut writer = delta::streaming_writer(&self.bronze)?;
        let read = SnapshotRead { range: KeyRange { lo: item.chunk.lo.clone(), hi: item.chunk.hi.clone() }, ..self.base.clone() };
        let stamp = SnapshotStamp {
            snapshot: self.s,
            start_lsn: item.stamp,
            commit_ts: item.stamp_ts,
            capture_instance: self.capture_instance.clone(),
            chunk: Some(item.chunk.chunk),
        };
        // A heap's chunk is read fenced (the lock makes it exact at its
        // fence: see engine::apply::heap); a keyed table's is not locked,
        // and the max LSN that may end its wave's window comes in the same
        // round trip, after its rows (backfill's commit of the wave).
        let (mut stream, fence, max_lsn_after) = if self.fenced {
            let f = self.source.snapshot_read_fenced(&read).await?;
            (f.batches, Some(f.fence), None)
        } else {
            let r = self.source.snapshot_read_then_max_lsn(&read).await?;
            (r.batches, None, r.max_lsn_after)
        };
        let mut rows = 0i64;
        let mut read_bytes = 0i64;
        while let Some(b) = stream.next().await {
            let b = b?;
            if b.num_rows() == 0 {
                continue;
            }
            rows += b.num_rows() as i64;
            read_bytes += b.get_array_memory_size() as i64;
            writer.write(bronze::from_snapshot(&b, &self.schema, &stamp)?).await.map_err(StepError::delta(&label))?;
        }
        let fence = match fence {
            Some(f) => Some(self.zone.fence_to_utc(f.await?)?),
            None => None,
        };
        if let (Some(on), Some(_)) = (&self.check_newer_after_fence, fence) {
            let what = format!("the read of chunk {}", item.chunk.chunk);
            crate::engine::switch::check_after_fenced_read(self.source.as_ref(), &self.base.table, false, on, &what).await?;
        }
        let max_lsn_after = match max_lsn_after {
            Some(f) => f.await?,
            None => None,
        };
        let adds = writer.flush().await.map_err(StepError::delta(&label))?;
        Ok(ChunkReadOutcome { rows, read_ms: t0.elapsed().as_millis() as i64, read_bytes, fence, max_lsn_after, adds })
    }
}

/// What reading one chunk gave: its rows, how long it took, how many bytes
/// the rows took as read, and the data files they went to.
pub(super) struct ChunkReadOutcome {
    pub(super) rows: i64,
    pub(super) read_ms: i64,
    pub(super) read_bytes: i64,
    /// A fenced read's fence, in UTC.
    pub(super) fence: Option<DateTime<Utc>>,
    /// The max LSN the source read after the rows (None: it did not, or it was NULL).
    pub(super) max_lsn_after: Option<Lsn>,
    pub(super) adds: Vec<deltalake::kernel::Add>,
}

impl Coordinator {
    /// The stream's retention headroom now, in seconds (`engine::headroom`):
    /// its newest batch's position in this generation against the min LSN
    /// the source reports at this moment, on the instance that batch read.
    /// `None` when the stream has no batch in this generation yet. The
    /// batch's recorded headroom is not used: it stays where it was once the
    /// stream stops, while cleanup goes on.
    async fn live_headroom(&self) -> StepResult<Option<f64>> {
        let mut t = self.facts.clone();
        t.update_state().await.map_err(StepError::delta(t.table_url().to_string()))?;
        let rows = delta::facts_read::rows_of(&t, &self.app).await?;
        let newest = rows
            .iter()
            .filter(|r| r.generation == self.generation && r.event.is_none() && r.batch_id.is_some())
            .max_by_key(|r| r.batch_id);
        let Some((position, instance)) = newest.and_then(|r| r.max_lsn.map(|m| (m, r.capture_instance.clone()))) else {
            return Ok(None);
        };
        let instance = instance.unwrap_or_else(|| self.stream_instance.name.clone());
        let headroom = crate::engine::headroom::live(&self.keys.source, &self.zone, &instance, Some(position)).await?;
        Ok(headroom.seconds)
    }
}
