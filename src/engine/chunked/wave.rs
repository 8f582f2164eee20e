//! A wave's commits: the sink that owns the tables while the next wave is
//! read, bronze's commit (which decides the wave), the plans and facts rows
//! after it, the completion row, and a wave's chunks rebuilt from bronze's
//! rows for the repair. Apart from the readers: this side writes, they read.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use chrono::{DateTime, Utc};
use deltalake::DeltaTable;
use serde_json::{json, Value};

use super::tables::{append_facts_rows, append_plans, plan_rows};
use crate::engine::rules::{is_completed, txn_wave_bronze, txn_wave_rows, ChunkPayload, Gap, Opened, PlanPayload, EVENT_SNAPSHOT_CHUNK};
use crate::delta::bronze;
use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT};
use crate::delta::plans::PlanRow;
use crate::delta::{self, sql_str, Appended, Txn};
use crate::engine::state;
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::source::SharedSource;

/// Refuses to go on with (and so to complete) the chunked snapshot `open`
/// when the stream of its generation has a gap after S: the changes right
/// after the stream's position were purged by CDC cleanup. Bronze can then
/// never hold every change after S (P3), so adr-0028 gives the snapshot up
/// and a newer one replaces it: the stream's recovery opens it in the next
/// generation (`on_data_loss = "resnapshot"`, adr-0018's Amendment), and
/// this one never completes. A completion written over the gap would be
/// taken by `apply` and `reconcile` for a whole image of the table.
/// With "resnapshot" the call is for later (exit 75, after `stream`); with
/// "fail" or "skip" (which a chunked snapshot refuses) a person decides.
pub async fn refuse_over_stream_gap(
    source: &SharedSource,
    instance: &str,
    rows: &[FactRow],
    open: &Opened,
    on_data_loss: crate::workflow::OnDataLoss,
    workflow: &std::path::Path,
) -> StepResult<()> {
    let st = state::StreamState::derive("", rows, None);
    let Some(position) = st.position() else { return Ok(()) };
    let min = source.min_lsn(instance).await?;
    let max = source.max_lsn().await?;
    if !crate::engine::rules::is_purged_after(position, min, max) {
        return Ok(());
    }
    let min = min.expect("a purged range has a min LSN");
    let wf = workflow.display();
    let head = format!(
        "the stream of generation {} stands at {position} and the changes after it were purged by CDC cleanup (capture instance \
         '{instance}', min LSN now {min}): the chunked snapshot opened at {} can never hold every change after its start, so \
         backfill does not complete it (nothing was written)",
        open.generation, open.s
    );
    Err(match on_data_loss {
        crate::workflow::OnDataLoss::Resnapshot => StepError::Temporary(format!(
            "{head}. Call `mssql-cdc --workflow {wf} stream`: with stream.on_data_loss = \"resnapshot\" it recovers with a newer \
             snapshot in generation {}, which backfill then reads",
            open.generation + 1
        )),
        _ => StepError::NeedsPerson(format!(
            "{head}. Set stream.on_data_loss = \"resnapshot\" and call `mssql-cdc --workflow {wf} stream`: it recovers with a \
             newer snapshot in generation {}, which replaces this one and which backfill then reads",
            open.generation + 1
        )),
    })
}

/// A wave read and ready to commit.
pub(super) struct WaveRead {
    pub(super) wave: i64,
    pub(super) chunks: Vec<ChunkPayload>,
    pub(super) adds: Vec<deltalake::kernel::Add>,
    pub(super) rows: i64,
    pub(super) read_ended: Instant,
    pub(super) stamp_ts: Option<DateTime<Utc>>,
}

/// Everything the commit task needs, owned, so it runs beside the next read.
pub(super) struct Sink {
    pub(super) app: String,
    pub(super) s: Lsn,
    pub(super) generation: i32,
    pub(super) kind: String,
    pub(super) header: FactRow,
    /// The data-loss gap a re-snapshot closes (on its completion row only).
    pub(super) gap: Gap,
    /// The completion row's txn: the generation's, or for a snapshot opened
    /// after a switch the one keyed by its S (see [`txn_switch_done`]).
    pub(super) completion_txn: Txn,
    pub(super) bronze: DeltaTable,
    pub(super) facts: DeltaTable,
    pub(super) plans: DeltaTable,
    pub(super) chunks_total: usize,
    pub(super) done: BTreeSet<i64>,
    pub(super) rows_total: i64,
    pub(super) waves_total: BTreeSet<i64>,
    /// What the completion checks first ([`refuse_over_stream_gap`]).
    pub(super) gap_check: GapCheck,
    /// Whether the commit of the wave that reads the last chunks also
    /// writes the completion (the coarse `backfill`; the `wave` transition
    /// leaves it to `complete`).
    pub(super) complete_after_last_wave: bool,
}

/// The source and settings [`refuse_over_stream_gap`] needs, owned by the sink.
pub(super) struct GapCheck {
    pub(super) source: SharedSource,
    pub(super) instance: String,
    pub(super) open: Opened,
    pub(super) on_data_loss: crate::workflow::OnDataLoss,
    pub(super) workflow: std::path::PathBuf,
}

/// What committing a wave did.
pub(super) struct WaveCommitted {
    pub(super) rows: i64,
    pub(super) fixed_seconds: f64,
}

impl Sink {
    /// A chunk's facts row. `append_ms` is its wave's bronze append (None for
    /// a wave rebuilt after a crash, whose append this call did not make).
    fn chunk_fact(&self, c: &ChunkPayload, stamp_ts: Option<DateTime<Utc>>, repaired: bool, append_ms: Option<i64>) -> FactRow {
        let mut row = self.header.clone();
        row.recorded_at = Some(Utc::now());
        row.event = Some(EVENT_SNAPSHOT_CHUNK.into());
        row.rows = Some(c.rows);
        row.min_lsn = Some(c.stamp);
        row.max_lsn = Some(c.max_lsn);
        row.commit_ts = stamp_ts;
        row.duration_ms = c.read_ms;
        row.bronze_version = c.bronze_version;
        let mut detail = json!({"snapshot": self.s.to_hex(), "chunk": c.chunk, "wave": c.wave, "last": c.last, "rounds": c.rounds});
        if let Some(bytes) = c.read_bytes {
            detail["read_bytes"] = json!(bytes);
        }
        if let Some(ms) = append_ms {
            // With duration_ms (the read), the record's "its read and its
            // append" that sizes the next call's first wave (see `round_pace`).
            detail["append_ms"] = json!(ms);
        }
        if repaired {
            detail["repaired"] = json!(true);
        }
        row.detail = Some(detail);
        row
    }

    /// Commits a wave: bronze (unless its rows are there already), plans
    /// rows, facts rows, and the completion row when it holds the last chunks.
    pub(super) async fn commit(&mut self, mut w: WaveRead) -> StepResult<WaveCommitted> {
        tracing::debug!(wave = w.wave, rows = w.rows, "wave read");
        // Only a race test arms this (a sleep): two calls then hold the same wave.
        failpoint!("chunked.before_wave_bronze");
        let txn = txn_wave_bronze(&self.app, self.s, w.wave);
        // Bronze's txn decides the wave, one whose chunks all read no rows
        // too (a commit of the txn and the metadata only): see the module docs.
        let (bronze_version, append_ms) = {
            let meta = json!({
                "kind": "snapshot_wave",
                "snapshot_lsn": self.s,
                "wave": w.wave,
                "generation": self.generation,
                "rows": w.rows,
                "chunks": w.chunks.iter().map(|c| json!({
                    "chunk": c.chunk, "lo": c.lo, "hi": c.hi, "last": c.last, "rows": c.rows,
                    "stamp": c.stamp, "max_lsn": c.max_lsn, "rounds": c.rounds, "fence": c.fence,
                })).collect::<Vec<_>>(),
            });
            let append_started = Instant::now();
            let appended = delta::commit_adds(&mut self.bronze, std::mem::take(&mut w.adds), &txn, meta).await?;
            // Rounded up: an append is never recorded as taking no time.
            let append_ms = append_started.elapsed().as_micros().div_ceil(1000) as i64;
            match appended {
                Appended::Committed { table_version } => (Some(table_version), append_ms),
                Appended::Empty => return Err(StepError::Internal(format!("wave {}'s bronze commit was skipped as empty", w.wave))),
                Appended::AlreadyApplied { .. } => {
                    return Err(StepError::Temporary(format!(
                        "wave {} of the snapshot at {} was committed by another backfill call meanwhile: call again",
                        w.wave, self.s
                    )))
                }
            }
        };
        failpoint!("chunked.after_wave_bronze");
        for c in &mut w.chunks {
            c.bronze_version = bronze_version;
        }
        let finish_started = Instant::now();
        self.finish_wave(&w.chunks, w.stamp_ts, false, Some(append_ms)).await?;
        let fixed_seconds = w.read_ended.elapsed().as_secs_f64();
        // Where a wave's fixed cost goes (MSSQL_CDC_LOG=mssql_cdc=debug): the
        // bronze append, the plans and facts commits, and in all, from the
        // wave's last read to here (the window's max LSN is read in between).
        tracing::debug!(
            wave = w.wave,
            append_ms,
            plans_and_facts_ms = finish_started.elapsed().as_millis() as u64,
            fixed_ms = (fixed_seconds * 1000.0) as u64,
            "wave committed"
        );
        if self.complete_after_last_wave {
            self.complete_if_done(None).await?;
        }
        Ok(WaveCommitted { rows: w.rows, fixed_seconds })
    }

    /// The plans rows, then the facts rows, of a wave whose bronze rows are in.
    pub(super) async fn finish_wave(&mut self, chunks: &[ChunkPayload], stamp_ts: Option<DateTime<Utc>>, repaired: bool, append_ms: Option<i64>) -> StepResult<()> {
        let Some(wave) = chunks.first().map(|c| c.wave) else { return Ok(()) };
        let prows: Vec<PlanRow> = chunks
            .iter()
            .map(|c| PlanRow {
                app_id: self.app.clone(),
                snapshot: self.s,
                event: EVENT_SNAPSHOT_CHUNK.into(),
                wave: Some(c.wave),
                chunk: Some(c.chunk),
                detail: serde_json::to_value(c).unwrap_or(Value::Null),
                recorded_at: Some(Utc::now()),
            })
            .collect();
        let txn = txn_wave_rows(&self.app, self.s, wave);
        if let Appended::AlreadyApplied { .. } = append_plans(&mut self.plans, &self.app, prows, &txn).await? {
            // A concurrent repair wrote them from the same bronze commit; anything else is a second outcome.
            let recorded: Vec<ChunkPayload> = plan_rows(&mut self.plans, &self.app, self.s)
                .await?
                .iter()
                .filter(|r| r.event == EVENT_SNAPSHOT_CHUNK && r.wave == Some(wave))
                .filter_map(|r| serde_json::from_value(r.detail.clone()).ok())
                .collect();
            self.check_recorded_wave(wave, chunks, &recorded, "plans")?;
        }
        failpoint!("chunked.after_wave_plans");
        self.write_wave_facts(chunks, stamp_ts, repaired, append_ms).await
    }

    pub(super) async fn write_wave_facts(&mut self, chunks: &[ChunkPayload], stamp_ts: Option<DateTime<Utc>>, repaired: bool, append_ms: Option<i64>) -> StepResult<()> {
        let Some(wave) = chunks.first().map(|c| c.wave) else { return Ok(()) };
        let frows: Vec<FactRow> = chunks.iter().map(|c| self.chunk_fact(c, stamp_ts, repaired, append_ms)).collect();
        let txn = txn_wave_rows(&self.app, self.s, wave);
        if let Appended::AlreadyApplied { .. } = append_facts_rows(&mut self.facts, &self.app, frows, &txn).await? {
            self.facts.update_state().await.map_err(StepError::delta(self.facts.table_url().to_string()))?;
            let hex = self.s.to_hex();
            let recorded: Vec<ChunkPayload> = state::facts_rows(&self.facts, &self.app)
                .await?
                .iter()
                .filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_CHUNK))
                .filter_map(|r| {
                    let d = r.detail.as_ref()?;
                    (d.get("snapshot")?.as_str()? == hex && d.get("wave")?.as_i64()? == wave).then_some(())?;
                    Some(ChunkPayload {
                        chunk: d.get("chunk")?.as_i64()?,
                        wave,
                        lo: None,
                        hi: None,
                        last: false,
                        rows: r.rows.unwrap_or(0),
                        stamp: r.min_lsn?,
                        max_lsn: r.max_lsn?,
                        read_ms: None,
                        read_bytes: None,
                        rounds: 1,
                        bronze_version: r.bronze_version,
                        fence: None,
                    })
                })
                .collect();
            self.check_recorded_wave(wave, chunks, &recorded, "facts")?;
        }
        failpoint!("chunked.after_wave_facts");
        for c in chunks {
            if self.done.insert(c.chunk) {
                self.rows_total += c.rows;
            }
        }
        self.waves_total.insert(wave);
        Ok(())
    }

    /// After the plans or facts rows of a wave were found already applied:
    /// they must record the outcome this call derived from bronze's commit of
    /// the wave (the same chunks, rows, stamps, and bronze version). Another
    /// outcome for one wave would mark chunks done that bronze holds other
    /// rows of, so it is exit 3 naming both, never accepted.
    fn check_recorded_wave(&self, wave: i64, meant: &[ChunkPayload], recorded: &[ChunkPayload], table: &str) -> StepResult<()> {
        let key = |c: &ChunkPayload, with_version: bool| (c.chunk, c.rows, c.stamp, if with_version { c.bronze_version } else { None });
        // A wave rebuilt from bronze's rows (its commit cleaned up) knows no bronze version.
        let with_version = meant.iter().all(|c| c.bronze_version.is_some());
        let mut a: Vec<_> = meant.iter().map(|c| key(c, with_version)).collect();
        let mut b: Vec<_> = recorded.iter().map(|c| key(c, with_version)).collect();
        a.sort();
        b.sort();
        if a == b {
            return Ok(());
        }
        let show = |v: &[(i64, i64, Lsn, Option<i64>)]| {
            v.iter()
                .map(|(c, r, l, bv)| format!("chunk {c}: {r} rows at {l}{}", bv.map(|v| format!(" (bronze version {v})")).unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        Err(StepError::NeedsPerson(format!(
            "wave {wave} of the chunked snapshot at {} has two outcomes: bronze's commit of it says [{}], but the {table} table \
             records [{}] under txn {}. Stop every other backfill of app_id '{}' (an older mssql-cdc commits an empty wave \
             without bronze), then open a new snapshot (a new generation) for this table",
            self.s,
            show(&a),
            if b.is_empty() { "nothing".to_string() } else { show(&b) },
            txn_wave_rows(&self.app, self.s, wave).app_id,
            self.app
        )))
    }

    /// Writes the completion row once every planned chunk has its facts row.
    pub(super) async fn complete_if_done(&mut self, commit_ts: Option<DateTime<Utc>>) -> StepResult<bool> {
        if self.done.len() < self.chunks_total {
            return Ok(false);
        }
        // The stream may have hit a purged range since this call started.
        self.facts.update_state().await.map_err(StepError::delta(self.facts.table_url().to_string()))?;
        let rows = state::facts_rows(&self.facts, &self.app).await?;
        if is_completed(&rows, self.s) {
            return Ok(true);
        }
        let g = &self.gap_check;
        refuse_over_stream_gap(&g.source, &g.instance, &rows, &g.open, g.on_data_loss, &g.workflow).await?;
        let mut row = self.header.clone();
        row.recorded_at = Some(Utc::now());
        row.event = Some(if self.kind == EVENT_RESNAPSHOT { EVENT_RESNAPSHOT } else { EVENT_BOOTSTRAP }.into());
        row.min_lsn = Some(self.s);
        row.max_lsn = Some(self.s);
        row.rows = Some(self.rows_total);
        row.commit_ts = commit_ts.or(row.commit_ts);
        row.lost_from_ts = self.gap.lost_from_ts;
        row.lost_to_ts = self.gap.lost_to_ts;
        row.retention_watermark_ts = self.gap.lost_to_ts;
        row.detail = Some(json!({"mode": "chunked", "snapshot": self.s.to_hex(), "chunks": self.chunks_total, "waves": self.waves_total.len()}));
        append_facts_rows(&mut self.facts, &self.app, vec![row], &self.completion_txn).await?;
        failpoint!("chunked.after_complete");
        tracing::info!(snapshot = %self.s, rows = self.rows_total, chunks = self.chunks_total, "chunked snapshot complete");
        Ok(true)
    }
}

/// Rebuilds the chunk payloads of a wave whose bronze commit is no longer in
/// the log: from its rows in bronze (the chunks of `_snapshot = S` from the
/// wave's first chunk to the last one with rows there), with the plan's bounds.
pub(super) async fn chunks_from_bronze(bronze_table: &DeltaTable, s: Lsn, wave: i64, plan: &PlanPayload, first: i64) -> StepResult<Vec<ChunkPayload>> {
    let sql = format!(
        "SELECT {chunk} AS chunk, COUNT(*) AS n, MIN({start}) AS stamp FROM t WHERE {snap} = {s} AND {op} = 0 AND {chunk} >= {first} GROUP BY {chunk}",
        chunk = bronze::CHUNK,
        start = bronze::START_LSN,
        snap = bronze::SNAPSHOT,
        op = bronze::OPERATION,
        s = sql_str(&s.to_hex()),
    );
    let batches = delta::query(bronze_table, &sql).await?;
    let mut found: BTreeMap<i64, (i64, Lsn)> = BTreeMap::new();
    for b in &batches {
        use deltalake::arrow::array::{Array, Int64Array, StringArray};
        let c = b.column(0).as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal("chunk column".into()))?;
        let n = b.column(1).as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal("count column".into()))?;
        let st = b.column(2).as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("stamp column".into()))?;
        for i in 0..b.num_rows() {
            if c.is_null(i) {
                continue;
            }
            let stamp = Lsn::parse(st.value(i)).map_err(|e| StepError::Internal(e.to_string()))?;
            found.insert(c.value(i), (n.value(i), stamp));
        }
    }
    let Some((&last, _)) = found.iter().next_back() else {
        return Err(StepError::NeedsPerson(format!(
            "bronze records wave {wave} of the chunked snapshot at {s}, but neither its commit nor its rows are there: \
             open a new snapshot (a new generation) for this table"
        )));
    };
    let stamp = found.values().map(|(_, l)| *l).min().unwrap_or(s);
    let last_planned = plan.chunks.len() as i64 - 1;
    Ok(plan
        .chunks
        .iter()
        .filter(|c| c.chunk >= first && c.chunk <= last)
        .map(|c| ChunkPayload {
            chunk: c.chunk,
            wave,
            lo: c.lo.clone(),
            hi: c.hi.clone(),
            last: c.chunk == last_planned,
            rows: found.get(&c.chunk).map(|x| x.0).unwrap_or(0),
            stamp,
            max_lsn: stamp,
            read_ms: None,
            read_bytes: None,
            rounds: 1,
            bronze_version: None,
            fence: None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::delta::TableKind;
        use crate::engine::rules::PlannedChunk;

    fn lsn(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }
    use crate::source::Isolation;
    use crate::types::{SqlType, SqlValue};

    // Tests that close UNTESTED rows of docs/CONFORMANCE.md (28.72, 28.73).

    /// A bronze table in `dir` holding these rows: (_snapshot, _chunk,
    /// _operation, _start_lsn); every other column NULL.
    async fn bronze_with(dir: &std::path::Path, rows: &[(Option<u128>, Option<i64>, i32, u128)]) -> DeltaTable {
        use deltalake::arrow::array::{ArrayRef, Int32Array, Int64Array, StringArray};
        let location = dir.join("bronze").to_string_lossy().into_owned();
        let columns = vec![crate::types::ColumnDesc::new("id", SqlType::Int, false)];
        let mut table = delta::open_or_create(&location, &std::collections::HashMap::new(), TableKind::Bronze, &bronze::schema(&columns), "test bronze")
            .await
            .unwrap();
        let schema = table.snapshot().unwrap().snapshot().arrow_schema();
        let n = rows.len();
        let arrays: Vec<ArrayRef> = schema
            .fields()
            .iter()
            .map(|f| {
                let a: ArrayRef = match f.name().as_str() {
                    bronze::SNAPSHOT => Arc::new(StringArray::from(rows.iter().map(|r| r.0.map(|s| lsn(s).to_hex())).collect::<Vec<_>>())) as ArrayRef,
                    bronze::CHUNK => Arc::new(Int64Array::from(rows.iter().map(|r| r.1).collect::<Vec<_>>())) as ArrayRef,
                    bronze::OPERATION => Arc::new(Int32Array::from(rows.iter().map(|r| Some(r.2)).collect::<Vec<_>>())) as ArrayRef,
                    bronze::START_LSN => Arc::new(StringArray::from(rows.iter().map(|r| Some(lsn(r.3).to_hex())).collect::<Vec<_>>())) as ArrayRef,
                    _ => return deltalake::arrow::array::new_null_array(f.data_type(), n),
                };
                deltalake::arrow::compute::cast(&a, f.data_type()).unwrap()
            })
            .collect();
        let batch = deltalake::arrow::record_batch::RecordBatch::try_new(schema.clone(), arrays).unwrap();
        delta::append_batches(&mut table, vec![batch], schema, &Txn::new("test#snap", 0), json!({})).await.unwrap();
        table
    }

    /// A plan of five integer chunks: (-inf, 10), [10, 20), [20, 30), [30, 40), [40, +inf).
    fn five_chunks() -> PlanPayload {
        let int = |v: i64| Some(vec![SqlValue::Int(v)]);
        let chunks: Vec<PlannedChunk> = (0..5i64)
            .map(|i| PlannedChunk { chunk: i, lo: if i == 0 { None } else { int(i * 10) }, hi: if i == 4 { None } else { int(i * 10 + 10) }, rows: Some(10) })
            .collect();
        PlanPayload {
            kind: "integer".into(),
            keys: vec!["id".into()],
            chunk_rows: 10,
            chunk_count: 5,
            chunks,
            open_end: false,
            isolation: Isolation::ReadCommitted,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wave_rebuilt_from_bronze_ends_at_its_last_chunk_with_rows_so_trailing_empty_chunks_are_read_again() {
        // 28.72. Catches a rebuild that records every planned chunk from `first` (chunk 4, empty in bronze, would be
        // marked done and never read), one that drops the `_snapshot = S` filter (an older snapshot's chunk-4 row
        // would count), one that drops `_chunk >= first` (an earlier wave's chunk 0 would be taken again), a
        // stamp other than the smallest, or middle empty chunks left out.
        let dir = tempfile::tempdir().unwrap();
        let (s, older) = (100u128, 50u128);
        let mut rows = Vec::new();
        rows.extend([(Some(s), Some(0), 0, 101); 2]); // wave 6's chunk 0, done before
        rows.extend([(Some(s), Some(1), 0, 105); 3]);
        rows.extend([(Some(s), Some(3), 0, 103); 2]);
        rows.push((Some(older), Some(4), 0, 51)); // an older snapshot's row
        rows.push((None, None, 2, 107)); // a change row
        let bronze_table = bronze_with(dir.path(), &rows).await;
        let plan = five_chunks();
        let got = chunks_from_bronze(&bronze_table, lsn(s), 7, &plan, 1).await.unwrap();
        let want: Vec<ChunkPayload> = [(1, 3), (2, 0), (3, 2)]
            .into_iter()
            .map(|(c, n): (usize, i64)| ChunkPayload {
                chunk: c as i64,
                wave: 7,
                lo: plan.chunks[c].lo.clone(),
                hi: plan.chunks[c].hi.clone(),
                last: false,
                rows: n,
                stamp: lsn(103),
                max_lsn: lsn(103),
                read_ms: None,
                read_bytes: None,
                rounds: 1,
                bronze_version: None,
                fence: None,
            })
            .collect();
        assert_eq!(got, want);
        // The older snapshot's wave reaches the last planned chunk: every chunk from 0 on, chunk 4 flagged last.
        let got = chunks_from_bronze(&bronze_table, lsn(older), 2, &plan, 0).await.unwrap();
        assert_eq!(got.iter().map(|c| (c.chunk, c.rows, c.last)).collect::<Vec<_>>(), vec![(0, 0, false), (1, 0, false), (2, 0, false), (3, 0, false), (4, 1, true)]);
        assert!(got.iter().all(|c| c.stamp == lsn(51) && c.wave == 2));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wave_whose_rows_are_not_in_bronze_needs_a_person() {
        // 28.73. Catches a rebuild that returns no chunks (the wave's facts would never be written and the
        // snapshot could complete without its rows) or a temporary error (the call would loop forever).
        let dir = tempfile::tempdir().unwrap();
        let bronze_table = bronze_with(dir.path(), &[(Some(100), Some(0), 0, 101), (Some(100), Some(1), 0, 102)]).await;
        for (s, first) in [(100u128, 2i64), (200, 0)] {
            let e = chunks_from_bronze(&bronze_table, lsn(s), 3, &five_chunks(), first).await.unwrap_err();
            assert!(matches!(e, StepError::NeedsPerson(_)), "S {s}, from chunk {first}: {e}");
            assert_eq!(e.exit_code(), 3);
            assert!(e.to_string().contains("wave 3") && e.to_string().contains("new snapshot"), "{e}");
        }
    }
}
