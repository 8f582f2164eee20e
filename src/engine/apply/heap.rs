//! Silver of a heap (a capture instance without a unique index): a multiset
//! of rows with a count, applied from bronze's images. The design and its
//! reasons are in the module doc of [`super`] ("Heaps").

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use deltalake::arrow::array::{new_null_array, Array, BooleanArray, Int32Array, StringArray, TimestampMicrosecondArray};
use deltalake::arrow::compute::filter_record_batch;
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::datafusion::common::Column;
use deltalake::datafusion::datasource::MemTable;
use deltalake::datafusion::prelude::SessionContext;
use deltalake::DeltaTable;
use futures::StreamExt;
use serde_json::{json, Value};

use super::decide::{txn_merge, waves_in_facts, Action, Decision};
use super::sql::{ident, key_match};
use crate::delta::control::ControlRow;
use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT, EVENT_SNAPSHOT_OPEN};
use crate::delta::{self, bronze, silver, sql_str};
use crate::engine::chunked::{ChunkPayload, OpenPayload, EVENT_SNAPSHOT_CHUNK};
use crate::engine::Context;
use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;
use crate::source::KeyRange;
use crate::types::{key_cmp, value_at, Key};
use crate::source::RowFilter;

/// Whether silver keeps this capture instance as a heap: it has no unique
/// index (`index_column_list` is empty). `snapshot.keys` does not change
/// that: on a heap they name the columns chunks are cut on, which may repeat.
pub fn is_heap(ctx: &Context) -> bool {
    ctx.instance.index_columns.is_empty()
}

/// The refusals of a heap's silver, before anything is written: a heap
/// streamed without before-images, and a heap chunked on a string column.
///
/// Silver counts each change image of a chunked heap against the chunk its
/// key falls in ([`chunk_of`]), which orders keys here, in the engine. For a
/// string column that order is its collation's (linguistic order, case,
/// accents, width), which only the server knows; ordering by code point
/// instead would put a change in the wrong chunk, counted twice or never.
pub fn check_options(ctx: &Context) -> StepResult<()> {
    if ctx.workflow.snapshot.mode == crate::workflow::SnapshotMode::Chunked {
        let keys = ctx.workflow.snapshot.keys.clone().unwrap_or_default();
        if let Some(k) = keys.iter().find(|k| ctx.instance.column(k).is_some_and(|c| c.sql_type.is_string())) {
            return Err(StepError::Config(format!(
                "capture instance '{}' has no unique index, so silver keeps {} as a multiset of rows and places every \
                 change in the chunk its snapshot.keys value falls in; but snapshot.keys names the string column '{k}', \
                 whose order is its collation's and known only to the server: set snapshot.keys in {} to a column that \
                 is not a string (a number, a date or time, a uniqueidentifier), or take the snapshot with \
                 snapshot.mode = \"full\"",
                ctx.instance.name,
                ctx.workflow.table_name(),
                ctx.workflow.path.display()
            )));
        }
    }
    if ctx.row_filter() == RowFilter::AllUpdateOld {
        return Ok(());
    }
    Err(StepError::Config(format!(
        "capture instance '{}' has no unique index, so silver keeps {} as a multiset of rows and must take each \
         updated row's old values out of it, which only the update's before-image holds; but the stream reads \
         updates without them (stream.row_filter = \"all\"): set stream.row_filter = \"all update old\" in {} \
         (bronze streamed without it needs a new snapshot, or a new bronze target)",
        ctx.instance.name,
        ctx.workflow.table_name(),
        ctx.workflow.path.display()
    )))
}

/// The snapshot a heap's silver is counted from, and its chunks read so far.
#[derive(Debug, Clone, PartialEq)]
pub enum Base {
    /// Silver holds nothing here: no image counts (the ranges a first
    /// snapshot has not read yet).
    Empty,
    /// No snapshot: changes only.
    None,
    /// A full snapshot (or a seed) at S: every row read as of S, and, for a
    /// fenced read, exactly the commits that ended at or before its fence.
    Full(Lsn, Option<DateTime<Utc>>),
    /// A chunked snapshot at S: its chunks read so far (sorted by chunk,
    /// so by range), each as of its stamp, cut on `keys`; in the ranges it
    /// has not read yet, silver holds what it held before it took this
    /// snapshot (`under`), and images there count as they did then.
    Chunked { s: Lsn, keys: Vec<String>, read: Vec<ChunkPayload>, under: Box<Base> },
}

impl Base {
    /// The layers beneath the top cut on a column `columns` lack (the
    /// capture instance dropped it) become [`Base::Empty`]: their images
    /// cannot be placed, so they count for nothing there, as before those
    /// layers were followed (silver keeps their rows until the top
    /// snapshot reads the range or completes).
    fn without_uncut_layers(self, columns: &[crate::types::ColumnDesc]) -> Base {
        fn go(base: Base, columns: &[crate::types::ColumnDesc], top: bool) -> Base {
            match base {
                Base::Chunked { s, keys, read, under } => {
                    if !top && !keys.iter().all(|k| columns.iter().any(|c| c.name.eq_ignore_ascii_case(k))) {
                        tracing::warn!(snapshot = %s, keys = ?keys, "a snapshot beneath the open one was cut on a column the capture instance no longer has: its ranges wait for the open snapshot");
                        return Base::Empty;
                    }
                    Base::Chunked { s, keys, read, under: Box::new(go(*under, columns, false)) }
                }
                other => other,
            }
        }
        go(self, columns, true)
    }

    /// Whether any layer was read fenced (an image's commit time then decides).
    fn fenced(&self) -> bool {
        match self {
            Base::Full(_, f) => f.is_some(),
            Base::Chunked { read, under, .. } => read.iter().any(|c| c.fence.is_some()) || under.fenced(),
            Base::Empty | Base::None => false,
        }
    }

    /// Every layer's chunk columns (a layer beneath may be cut on others).
    fn cut_columns(&self) -> Vec<String> {
        match self {
            Base::Chunked { keys, under, .. } => {
                let mut all = keys.clone();
                all.extend(under.cut_columns());
                all
            }
            _ => vec![],
        }
    }
}

/// The LSN every image an apply may count is above (`Some(None)`: no bound;
/// None: it counts none): a layer's S when the whole of it is new to silver
/// (a rebuild, a wave's new chunks, which take every image after their
/// stamps), else also what silver applied; the ranges a chunked snapshot has
/// not read count as the layer beneath does.
fn counted_above(base: &Base, whole: bool, applied: Option<Lsn>) -> Option<Option<Lsn>> {
    let own = match base {
        Base::Empty => return None,
        Base::None => applied,
        Base::Full(s, _) | Base::Chunked { s, .. } => Some(if whole { *s } else { applied.map_or(*s, |a| a.max(*s)) }),
    };
    let beneath = match base {
        Base::Chunked { under, .. } => counted_above(under, false, applied),
        _ => None,
    };
    Some(match (own, beneath) {
        (own, None) => own,
        (Some(a), Some(Some(b))) => Some(a.min(b)),
        _ => None,
    })
}

/// Whether the snapshot at `s` was opened chunked.
fn opened_chunked(facts: &[FactRow], s: Lsn) -> bool {
    facts.iter().any(|r| {
        r.event.as_deref() == Some(EVENT_SNAPSHOT_OPEN)
            && r.min_lsn == Some(s)
            && r.detail.as_ref().and_then(|d| d.get("mode")).and_then(Value::as_str) == Some("chunked")
    })
}

/// The chunks of snapshot `s` the facts record, up to wave `upto` (None: all), with the open's keys.
pub(crate) async fn chunked_base(ctx: &Context, facts: &[FactRow], s: Lsn, upto: Option<i64>, under: Base) -> StepResult<Base> {
    let app = &ctx.workflow.app_id;
    let prows = crate::engine::chunked::plan_rows_if_any(ctx, app, s).await?;
    let mut read = Vec::new();
    for (w, cs) in waves_in_facts(facts, s).into_iter().filter(|(w, _)| upto.is_none_or(|u| *w <= u)) {
        for c in cs {
            let row = prows.iter().find(|r| r.event == EVENT_SNAPSHOT_CHUNK && r.chunk == Some(c) && r.wave == Some(w)).ok_or_else(|| {
                StepError::NeedsPerson(format!(
                    "the facts record chunk {c} of wave {w} of the snapshot at {s}, but the plans table has no row for it: \
                     restore the plans table, or open a new snapshot"
                ))
            })?;
            let p: ChunkPayload = serde_json::from_value(row.detail.clone()).map_err(|e| StepError::Internal(format!("chunk {c}'s plans row: {e}")))?;
            read.push(p);
        }
    }
    read.sort_by_key(|c| c.chunk);
    read.dedup_by_key(|c| c.chunk);
    let keys = match prows.iter().find(|r| r.event == EVENT_SNAPSHOT_OPEN) {
        Some(r) => serde_json::from_value::<OpenPayload>(r.detail.clone()).map_err(|e| StepError::Internal(format!("the open's plans row: {e}")))?.keys,
        None if read.is_empty() => vec![],
        None => {
            return Err(StepError::NeedsPerson(format!(
                "the snapshot at {s} has chunks but the plans table has no open row naming the columns they are cut on: restore the plans table"
            )))
        }
    };
    Ok(Base::Chunked { s, keys, read, under: Box::new(under) })
}

/// The read fence the completion row of the full snapshot at `s` records (a heap's, read fenced).
fn full_fence(facts: &[FactRow], s: Lsn) -> Option<DateTime<Utc>> {
    facts
        .iter()
        .filter(|r| r.min_lsn == Some(s) && matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP | EVENT_RESNAPSHOT)))
        .filter_map(|r| r.detail.as_ref()?.get("fence").cloned())
        .find_map(|f| serde_json::from_value::<DateTime<Utc>>(f).ok())
}

/// The base of a completed snapshot: all its chunks when it was chunked
/// (they cover every key, so nothing lies beneath them).
async fn completed_base(ctx: &Context, facts: &[FactRow], s: Lsn) -> StepResult<Base> {
    if opened_chunked(facts, s) {
        chunked_base(ctx, facts, s, None, Base::Empty).await
    } else {
        Ok(Base::Full(s, full_fence(facts, s)))
    }
}

/// What silver held before it took the open chunked snapshot at `open`:
/// the base of the newest control row from before the first that names it
/// (`history`: this app's control rows, oldest first). Such a base may
/// itself be an open snapshot that was never completed (a switch's snapshot
/// supersedes the bootstrap being read; a re-snapshot, the one before it),
/// with what lay beneath it in turn. Silver holds nothing beneath a first
/// snapshot. A rebuild made while a snapshot was open (a completed snapshot
/// applied after a newer one opened) is the bottom: silver then held that
/// snapshot whole, whatever came before.
async fn beneath(ctx: &Context, facts: &[FactRow], history: &[ControlRow], open: Lsn) -> StepResult<Base> {
    // The chunked opens beneath, newest first, each with the wave silver took of it.
    let mut layers: Vec<(Lsn, Option<i64>)> = Vec::new();
    let mut rest = history;
    let mut open = open;
    let bottom = loop {
        let first = rest.iter().rposition(|c| c.open_snapshot_lsn != Some(open)).map_or(0, |i| i + 1);
        if let Some(rebuilt) = rest[first..].iter().rev().find(|c| c.action == "rebuild") {
            break match rebuilt.snapshot_lsn {
                Some(s) => completed_base(ctx, facts, s).await?,
                None => Base::None,
            };
        }
        rest = &rest[..first];
        match rest.last() {
            None => break Base::Empty,
            Some(c) => match (c.open_snapshot_lsn, c.snapshot_lsn) {
                (Some(p), _) => {
                    layers.push((p, c.snapshot_wave));
                    open = p;
                }
                (None, Some(s)) => break completed_base(ctx, facts, s).await?,
                (None, None) => break Base::None,
            },
        }
    };
    let mut base = bottom;
    for (p, wave) in layers.into_iter().rev() {
        base = match wave {
            Some(_) => chunked_base(ctx, facts, p, wave, base).await?,
            None => Base::Chunked { s: p, keys: vec![], read: vec![], under: Box::new(base) },
        };
    }
    Ok(base)
}

/// The base of one apply (see [`Base`]); `history` is this app's control
/// rows, oldest first.
async fn base_of(ctx: &Context, d: &Decision, last: Option<&ControlRow>, history: &[ControlRow], facts: &[FactRow]) -> StepResult<Base> {
    match &d.action {
        Action::Rebuild { snapshot } => completed_base(ctx, facts, *snapshot).await,
        Action::Waves { snapshot, waves, .. } => {
            let under = beneath(ctx, facts, history, *snapshot).await?;
            chunked_base(ctx, facts, *snapshot, waves.last().copied(), under).await
        }
        Action::Changes { .. } | Action::Nothing => match (d.next.open_snapshot_lsn, d.next.snapshot_lsn) {
            (Some(o), _) => {
                let upto = last.filter(|c| c.open_snapshot_lsn == Some(o)).and_then(|c| c.snapshot_wave);
                let under = beneath(ctx, facts, history, o).await?;
                match upto {
                    Some(_) => chunked_base(ctx, facts, o, upto, under).await,
                    None => Ok(Base::Chunked { s: o, keys: vec![], read: vec![], under: Box::new(under) }),
                }
            }
            (None, Some(s)) => completed_base(ctx, facts, s).await,
            (None, None) => Ok(Base::None),
        },
    }
}

/// The read chunk whose range holds `key` (chunks sorted by range; a key
/// with a NULL column is only in the chunk open below, as SQL Server's
/// comparisons put it).
pub fn chunk_of<'a>(read: &'a [ChunkPayload], key: &[crate::types::SqlValue]) -> Option<&'a ChunkPayload> {
    let range = |c: &ChunkPayload| KeyRange { lo: c.lo.clone(), hi: c.hi.clone() };
    if key.iter().any(|v| v.is_null()) {
        return read.iter().find(|c| c.lo.is_none()).filter(|c| range(c).contains(key));
    }
    let i = read.partition_point(|c| c.lo.as_ref().is_none_or(|lo| key_cmp(lo, key) != std::cmp::Ordering::Greater));
    let c = read.get(i.checked_sub(1)?)?;
    range(c).contains(key).then_some(c)
}

/// Whether a change image at `lsn`, of a commit that ended at `ts`, counts
/// in this apply (pure): it must be after the snapshot its row was read in
/// (a chunk's stamp, a full snapshot's S, and where the read was fenced, a
/// commit that ended after the fence: one that ended before it is in the
/// rows read, though captured after the stamp), after what silver applied
/// unless its chunk is new to silver in this apply, and in a chunk read so
/// far. Values above the last chunk's end (rows inserted above the open's
/// MAX) are in no chunk: no read holds them, so all their images after S
/// count, from the apply that reads the last chunk on. Values in a range
/// the snapshot has not read yet count as they did in the base beneath it
/// (silver still holds that base's rows there), never as new. `key` gives
/// an image's values of the columns named.
#[allow(clippy::too_many_arguments)]
pub fn counts<K: Fn(&[String]) -> Key>(
    base: &Base,
    key: &K,
    lsn: Lsn,
    ts: Option<DateTime<Utc>>,
    applied: Option<Lsn>,
    new_chunks: &BTreeSet<i64>,
    rebuild: bool,
) -> bool {
    let after = |l: Option<Lsn>| l.is_none_or(|l| lsn > l);
    // A commit time is always there where a fence is (merge refuses otherwise).
    let after_fence = |f: &Option<DateTime<Utc>>| match (f, ts) {
        (Some(f), Some(t)) => t > *f,
        _ => true,
    };
    match base {
        Base::Empty => false,
        Base::None => after(applied),
        Base::Full(s, fence) => lsn > *s && after_fence(fence) && (rebuild || after(applied)),
        Base::Chunked { s, keys, read, under } => {
            let values = key(keys);
            if let Some(c) = chunk_of(read, &values) {
                return lsn > c.stamp && after_fence(&c.fence) && (rebuild || new_chunks.contains(&c.chunk) || after(applied));
            }
            match read.iter().find(|c| beyond_last(c, &values)) {
                Some(last) => lsn > *s && (rebuild || new_chunks.contains(&last.chunk) || after(applied)),
                None => counts(under, key, lsn, ts, applied, &BTreeSet::new(), false),
            }
        }
    }
}

/// Whether `key` lies above the end of `c`, the last chunk of its plan
/// (values the open's MAX did not reach, which no chunk reads).
fn beyond_last(c: &ChunkPayload, key: &[crate::types::SqlValue]) -> bool {
    c.last && c.hi.as_ref().is_some_and(|hi| !key.iter().any(|v| v.is_null()) && key_cmp(key, hi) != std::cmp::Ordering::Less)
}

/// Runs the MERGE of one decision into a heap's silver. Returns (rows upserted, rows deleted, silver version if committed).
pub async fn merge(
    ctx: &Context,
    silver_table: &mut DeltaTable,
    d: &Decision,
    history: &[ControlRow],
    facts: &[FactRow],
    new_chunk_ids: &[i64],
) -> StepResult<(i64, i64, Option<i64>)> {
    let Some(to) = d.to else { return Ok((0, 0, None)) };
    let columns = &ctx.instance.columns;
    let rebuild = matches!(d.action, Action::Rebuild { .. });
    let last = history.last();
    let applied = last.and_then(|c| c.applied_lsn);
    let base = base_of(ctx, d, last, history, facts).await?.without_uncut_layers(columns);
    let new_chunks: BTreeSet<i64> = new_chunk_ids.iter().copied().collect();
    let fenced = base.fenced();
    // Where each chunk column of every layer is among the columns read.
    let mut cut_idx: HashMap<String, usize> = HashMap::new();
    for k in base.cut_columns() {
        let i = columns.iter().position(|c| c.name.eq_ignore_ascii_case(&k)).ok_or_else(|| StepError::Config(format!("chunk column '{k}' is not captured")))?;
        cut_idx.insert(k, i);
    }
    let key_in = |b: &RecordBatch, i: usize, names: &[String]| -> Key {
        names.iter().map(|n| cut_idx.get(n).map_or(crate::types::SqlValue::Null, |&c| value_at(b.column(c).as_ref(), i, &columns[c].sql_type))).collect()
    };
    let cols: Vec<String> = columns.iter().map(|c| ident(&c.name)).collect();
    let cols = cols.join(", ");
    let lsn = |l: Lsn| sql_str(&l.to_hex());

    // The change images that may count: after the base's S (or what silver
    // applied), up to the stream's position; a change row bronze holds twice
    // (a reseed writes the changes after its L again) counts once.
    let whole = matches!(d.action, Action::Rebuild { .. } | Action::Waves { .. });
    let lower = counted_above(&base, whole, applied).flatten();
    let mut filter = format!("{op} <> 0 AND {start} <= {to}", op = bronze::OPERATION, start = bronze::START_LSN, to = lsn(to));
    if let Some(l) = lower {
        filter.push_str(&format!(" AND {} > {}", bronze::START_LSN, lsn(l)));
    }
    let sql = format!(
        "SELECT DISTINCT {cols}, {start}, {cmd}, {seq}, {op}, {ts} FROM t WHERE {filter}",
        start = bronze::START_LSN,
        cmd = bronze::COMMAND_ID,
        seq = bronze::SEQVAL,
        op = bronze::OPERATION,
        ts = bronze::COMMIT_TS
    );
    let mut stream = delta::query_stream(&ctx.bronze, &sql).await?;
    let mut counted: Vec<RecordBatch> = Vec::new();
    // Per change (commit, command, seqval): whether its before- and after-image are there.
    let mut pairs: HashMap<(String, i32, String), (bool, bool)> = HashMap::new();
    let n = columns.len();
    while let Some(b) = stream.next().await {
        let b = delta::plain_types(&b.map_err(|e| StepError::Temporary(format!("reading bronze: {e}")))?)?;
        let start = b.column(n).as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("_start_lsn".into()))?;
        let cmd = b.column(n + 1).as_any().downcast_ref::<Int32Array>().ok_or_else(|| StepError::Internal("_command_id".into()))?;
        let seq = b.column(n + 2).as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("_seqval".into()))?;
        let op = b.column(n + 3).as_any().downcast_ref::<Int32Array>().ok_or_else(|| StepError::Internal("_operation".into()))?;
        let commit_ts = b.column(n + 4).as_any().downcast_ref::<TimestampMicrosecondArray>().ok_or_else(|| StepError::Internal("_commit_ts".into()))?;
        let mut mask = Vec::with_capacity(b.num_rows());
        for i in 0..b.num_rows() {
            let o = op.value(i);
            if o == 3 || o == 4 {
                let id = (start.value(i).to_string(), if cmd.is_null(i) { -1 } else { cmd.value(i) }, if seq.is_null(i) { String::new() } else { seq.value(i).to_string() });
                let e = pairs.entry(id).or_default();
                if o == 3 {
                    e.0 = true;
                } else {
                    e.1 = true;
                }
            }
            let l = Lsn::parse(start.value(i)).map_err(|e| StepError::Internal(format!("bronze _start_lsn: {e}")))?;
            let ts = (!commit_ts.is_null(i)).then(|| DateTime::<Utc>::from_timestamp_micros(commit_ts.value(i))).flatten();
            if ts.is_none() && fenced {
                return Err(StepError::NeedsPerson(format!(
                    "bronze holds a change at {l} without its commit time (_commit_ts), and the snapshot of this table without \
                     a unique index was read fenced: whether the read already holds that change is decided by the time. \
                     Take a new snapshot"
                )));
            }
            mask.push(counts(&base, &|names: &[String]| key_in(&b, i, names), l, ts, applied, &new_chunks, rebuild));
        }
        let kept = filter_record_batch(&b, &BooleanArray::from(mask)).map_err(|e| StepError::Internal(format!("bronze images: {e}")))?;
        if kept.num_rows() > 0 {
            counted.push(kept);
        }
    }
    let unpaired = pairs.values().filter(|(before, after)| *after && !*before).count();
    if unpaired > 0 {
        return Err(StepError::Config(format!(
            "bronze holds {unpaired} update(s) of {} without a before-image (streamed with stream.row_filter = \"all\"), \
             so silver of this table without a unique index cannot take the old rows out: keep stream.row_filter = \"all update old\" \
             in {} and take a new snapshot (or stream into a new bronze target)",
            ctx.workflow.table_name(),
            ctx.workflow.path.display()
        )));
    }

    // The silver rows a new chunk replaces: those of its range, and for the
    // last chunk those above its end too (no row was there at S, so the
    // images after S counted above are all that range holds; silver may
    // still hold a base's rows there).
    let mut replaced: Vec<RecordBatch> = Vec::new();
    if let (Action::Waves { .. }, Base::Chunked { keys, read, .. }) = (&d.action, &base) {
        let fresh: Vec<ChunkPayload> = read.iter().filter(|c| new_chunks.contains(&c.chunk)).cloned().collect();
        let sql = format!("SELECT {cols}, {count}, {start}, {ts} FROM t", count = ident(silver::COUNT), start = bronze::START_LSN, ts = bronze::COMMIT_TS);
        let mut stream = delta::query_stream(silver_table, &sql).await?;
        while let Some(b) = stream.next().await {
            let b = delta::plain_types(&b.map_err(|e| StepError::Temporary(format!("reading silver: {e}")))?)?;
            let mask: Vec<bool> = (0..b.num_rows())
                .map(|i| {
                    let key = key_in(&b, i, keys);
                    chunk_of(&fresh, &key).is_some() || fresh.iter().any(|c| beyond_last(c, &key))
                })
                .collect();
            let kept = filter_record_batch(&b, &BooleanArray::from(mask)).map_err(|e| StepError::Internal(format!("silver rows: {e}")))?;
            if kept.num_rows() > 0 {
                // Their freshness does not carry over to what replaces them.
                let mut arrays = kept.columns().to_vec();
                for a in arrays.iter_mut().skip(n + 1) {
                    *a = new_null_array(a.data_type(), kept.num_rows());
                }
                replaced.push(RecordBatch::try_new(kept.schema(), arrays).map_err(|e| StepError::Internal(format!("silver rows: {e}")))?);
            }
        }
    }

    // Snapshot rows: all of S for a rebuild, the new chunks' for waves.
    let snapshot_rows = match (&d.action, &base) {
        (Action::Rebuild { snapshot }, _) => Some(format!("{} = {} AND {} = 0", bronze::SNAPSHOT, lsn(*snapshot), bronze::OPERATION)),
        (Action::Waves { snapshot, .. }, _) if !new_chunks.is_empty() => Some(format!(
            "{} = {} AND {} = 0 AND {} IN ({})",
            bronze::SNAPSHOT,
            lsn(*snapshot),
            bronze::OPERATION,
            bronze::CHUNK,
            new_chunks.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
        )),
        _ => None,
    };
    if snapshot_rows.is_none() && counted.is_empty() && replaced.is_empty() {
        return Ok((0, 0, None));
    }

    // One session: bronze as `t`, the counted images and the replaced rows beside it.
    let (_, state) = delta::dataframe(&ctx.bronze, "SELECT 1").await?;
    let session = SessionContext::new_with_state(state);
    let mut parts = Vec::new();
    let (start, ts) = (bronze::START_LSN, bronze::COMMIT_TS);
    if let Some(f) = &snapshot_rows {
        parts.push(format!("SELECT {cols}, CAST(1 AS BIGINT) AS __w, {start}, {ts} FROM t WHERE {f}"));
    }
    for (name, batches) in [("__counted", counted), ("__replaced", replaced)] {
        let Some(schema) = batches.first().map(|b| b.schema()) else { continue };
        let mem = MemTable::try_new(schema, vec![batches]).map_err(|e| StepError::Internal(format!("apply's source: {e}")))?;
        session.register_table(name, Arc::new(mem)).map_err(|e| StepError::Internal(format!("apply's source: {e}")))?;
        parts.push(if name == "__counted" {
            format!("SELECT {cols}, CASE WHEN {op} IN (1, 3) THEN CAST(-1 AS BIGINT) ELSE CAST(1 AS BIGINT) END AS __w, {start}, {ts} FROM {name}", op = bronze::OPERATION)
        } else {
            format!("SELECT {cols}, -{count} AS __w, {start}, {ts} FROM {name}", count = ident(silver::COUNT))
        });
    }
    let sql = format!(
        "SELECT {cols}, CAST(SUM(__w) AS BIGINT) AS {count}, MAX({start}) AS {start}, MAX({ts}) AS {ts} FROM ({parts}) AS parts GROUP BY {cols} HAVING SUM(__w) {keep}",
        count = ident(silver::COUNT),
        parts = parts.join(" UNION ALL "),
        keep = if rebuild { "> 0" } else { "<> 0" },
    );
    let source = session.sql(&sql).await.map_err(|e| StepError::Internal(format!("apply's source failed to plan: {e}\n{sql}")))?;

    let silver_label = ctx.workflow.target.silver.clone().unwrap_or_default();
    let metadata = json!({
        "kind": "silver_apply",
        "shape": "heap",
        "seq": d.next.seq,
        "action": d.action,
        "to": d.to,
        "control": ControlRow { recorded_at: None, ..d.next.clone() },
        "chunks": new_chunk_ids,
    });
    let props = delta::step_commit_properties(&txn_merge(&ctx.workflow.app_id, d.next.seq), metadata);
    let count = format!("target.{}", ident(silver::COUNT));
    let newest = |c: &str| format!("CASE WHEN source.{c} IS NOT NULL AND (target.{c} IS NULL OR source.{c} > target.{c}) THEN source.{c} ELSE target.{c} END");
    let before = silver_table.version();
    let mut builder = silver_table
        .clone()
        .merge(source, key_match(columns))
        .with_source_alias("source")
        .with_target_alias("target")
        .with_session_state(Arc::new(session.state()))
        .with_writer_properties(delta::bounded_writer_properties())
        .with_commit_properties(props);
    let insert = |mut i: deltalake::operations::merge::InsertBuilder| {
        for c in columns.iter().map(|c| c.name.as_str()).chain([silver::COUNT, start, ts]) {
            i = i.set(Column::new_unqualified(c), format!("source.{}", ident(c)));
        }
        i
    };
    builder = if rebuild {
        builder
            .when_matched_update(|u| {
                u.predicate(format!("{count} <> source.{c} OR target.{start} IS DISTINCT FROM source.{start}", c = ident(silver::COUNT)))
                    .update(Column::new_unqualified(silver::COUNT), format!("source.{}", ident(silver::COUNT)))
                    .update(Column::new_unqualified(start), format!("source.{start}"))
                    .update(Column::new_unqualified(ts), format!("source.{ts}"))
            })
            .map_err(StepError::delta(&silver_label))?
            .when_not_matched_insert(insert)
            .map_err(StepError::delta(&silver_label))?
            .when_not_matched_by_source_delete(|del| del)
            .map_err(StepError::delta(&silver_label))?
    } else {
        builder
            .when_matched_delete(|del| del.predicate(format!("{count} + source.{} <= 0", ident(silver::COUNT))))
            .map_err(StepError::delta(&silver_label))?
            .when_matched_update(|u| {
                u.update(Column::new_unqualified(silver::COUNT), format!("{count} + source.{}", ident(silver::COUNT)))
                    .update(Column::new_unqualified(start), newest(start))
                    .update(Column::new_unqualified(ts), newest(ts))
            })
            .map_err(StepError::delta(&silver_label))?
            // A net removal of a row silver lacks has nothing to take from
            // (reconcile reports the difference it comes from).
            .when_not_matched_insert(|i| insert(i.predicate(format!("source.{} > 0", ident(silver::COUNT)))))
            .map_err(StepError::delta(&silver_label))?
    };
    let (table, metrics) = builder.await.map_err(StepError::delta(&silver_label))?;
    *silver_table = table;
    let after = silver_table.version();
    let committed = if after != before { after.map(|v| v as i64) } else { None };
    Ok(((metrics.num_target_rows_inserted + metrics.num_target_rows_updated) as i64, metrics.num_target_rows_deleted as i64, committed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::SqlValue;

    fn lsn(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }

    fn chunk(c: i64, lo: Option<i64>, hi: Option<i64>, stamp: u128) -> ChunkPayload {
        ChunkPayload {
            chunk: c,
            wave: 0,
            lo: lo.map(|v| vec![SqlValue::Int(v)]),
            hi: hi.map(|v| vec![SqlValue::Int(v)]),
            last: hi.is_none(),
            rows: 0,
            stamp: lsn(stamp),
            max_lsn: lsn(stamp),
            read_ms: None,
            read_bytes: None,
            rounds: 1,
            bronze_version: None,
            fence: None,
        }
    }

    #[test]
    fn an_image_counts_after_its_chunks_stamp_and_only_in_a_read_chunk() {
        // Chunks 0 [-, 10) stamped 20 and 2 [20, -) stamped 40 are read; chunk 1 [10, 20) is not.
        let read = vec![chunk(0, None, Some(10), 20), chunk(2, Some(20), None, 40)];
        let base = Base::Chunked { s: lsn(10), keys: vec!["k".into()], read, under: Box::new(Base::Empty) };
        let k = |v: Option<i64>| move |_: &[String]| vec![v.map(SqlValue::Int).unwrap_or(SqlValue::Null)];
        let none = BTreeSet::new();
        let nothing = |_: &[String]| Vec::new();
        assert!(!counts(&base, &k(Some(5)), lsn(15), None, None, &none, true), "before its chunk's stamp: the chunk holds it");
        assert!(counts(&base, &k(Some(5)), lsn(25), None, None, &none, true));
        assert!(counts(&base, &k(None), lsn(25), None, None, &none, true), "a NULL key is in the first chunk");
        assert!(!counts(&base, &k(Some(15)), lsn(99), None, None, &none, true), "chunk 1 is not read yet");
        assert!(!counts(&base, &k(Some(25)), lsn(35), None, None, &none, true), "before chunk 2's stamp");
        // Incremental: after what silver applied, unless the chunk is new in this apply.
        assert!(!counts(&base, &k(Some(25)), lsn(45), None, Some(lsn(50)), &none, false));
        assert!(counts(&base, &k(Some(25)), lsn(45), None, Some(lsn(50)), &[2].into(), false), "a new chunk takes the changes after its stamp");
        assert!(counts(&base, &k(Some(25)), lsn(55), None, Some(lsn(50)), &none, false));
        let full = Base::Full(lsn(10), None);
        assert!(!counts(&full, &nothing, lsn(10), None, None, &none, true));
        assert!(counts(&full, &nothing, lsn(11), None, None, &none, true));
        assert!(!counts(&full, &nothing, lsn(11), None, Some(lsn(12)), &none, false));
        assert!(counts(&Base::None, &nothing, lsn(1), None, None, &none, false));
        // Above the last chunk's end: after S, once the last chunk is read.
        let mut read = vec![chunk(0, None, Some(10), 20), chunk(1, Some(10), Some(20), 30)];
        let open = Base::Chunked { s: lsn(10), keys: vec!["k".into()], read: read.clone(), under: Box::new(Base::Empty) };
        assert!(!counts(&open, &k(Some(25)), lsn(15), None, None, &none, true), "the last chunk is not read yet");
        read[1].last = true;
        let done = Base::Chunked { s: lsn(10), keys: vec!["k".into()], read, under: Box::new(Base::Empty) };
        assert!(counts(&done, &k(Some(25)), lsn(15), None, None, &none, true), "no chunk read it");
        assert!(!counts(&done, &k(Some(25)), lsn(10), None, None, &none, true));
        assert!(counts(&done, &k(Some(25)), lsn(15), None, Some(lsn(40)), &[1].into(), false), "counted from the apply that reads the last chunk");
        assert!(!counts(&done, &k(Some(25)), lsn(15), None, Some(lsn(40)), &none, false));
    }

    #[test]
    fn ranges_a_newer_snapshot_has_not_read_count_as_the_snapshot_beneath_did() {
        // Silver took chunks 0 [-, 10) and 1 [10, 20) of the snapshot at 10
        // (stamped 20 and 30, not its last), then a snapshot at 40 opened
        // over it and has read its chunk 0 [-, 10), stamped 50.
        let older = Base::Chunked {
            s: lsn(10),
            keys: vec!["k".into()],
            read: vec![chunk(0, None, Some(10), 20), chunk(1, Some(10), Some(20), 30)],
            under: Box::new(Base::Empty),
        };
        let newer = Base::Chunked { s: lsn(40), keys: vec!["k".into()], read: vec![chunk(0, None, Some(10), 50)], under: Box::new(older.clone()) };
        let k = |v: i64| move |_: &[String]| vec![SqlValue::Int(v)];
        let none = BTreeSet::new();
        assert!(!counts(&newer, &k(5), lsn(45), None, Some(lsn(40)), &[0].into(), false), "the newer chunk's read holds it");
        assert!(counts(&newer, &k(15), lsn(45), None, Some(lsn(40)), &none, false), "silver still holds the older chunk 1: its changes go on counting");
        assert!(!counts(&newer, &k(15), lsn(35), None, Some(lsn(40)), &none, false), "but not twice");
        assert!(!counts(&newer, &k(15), lsn(35), None, Some(lsn(40)), &[1].into(), false), "a chunk new in this apply is the newer snapshot's, not the older's");
        assert!(!counts(&newer, &k(25), lsn(45), None, Some(lsn(40)), &none, false), "neither snapshot read [20, -): silver holds nothing there");
        // The bronze read starts low enough for the older layer's images.
        assert_eq!(counted_above(&newer, true, Some(lsn(20))), Some(Some(lsn(20))));
        assert_eq!(counted_above(&newer, true, Some(lsn(45))), Some(Some(lsn(40))));
        assert_eq!(counted_above(&newer, false, None), Some(Some(lsn(10))));
        assert_eq!(counted_above(&older, true, Some(lsn(20))), Some(Some(lsn(10))));
        let over_changes = Base::Chunked { s: lsn(40), keys: vec!["k".into()], read: vec![], under: Box::new(Base::None) };
        assert_eq!(counted_above(&over_changes, true, None), Some(None), "beneath, every change counts: no bound");
        assert!(counts(&over_changes, &k(15), lsn(5), None, None, &none, false));
    }

    #[test]
    fn a_fenced_read_holds_the_commits_that_ended_before_its_fence() {
        // Chunk 0 stamped 20 and read fenced at t0: a change captured after
        // the stamp whose commit ended before t0 is in the rows read.
        let t0 = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).expect("a time");
        let before = Some(t0 - chrono::Duration::milliseconds(25));
        let after = Some(t0 + chrono::Duration::milliseconds(25));
        let mut c = chunk(0, None, None, 20);
        c.fence = Some(t0);
        let base = Base::Chunked { s: lsn(10), keys: vec!["k".into()], read: vec![c], under: Box::new(Base::Empty) };
        let k = |_: &[String]| vec![SqlValue::Int(5)];
        let none = BTreeSet::new();
        let nothing = |_: &[String]| Vec::new();
        assert!(!counts(&base, &k, lsn(25), before, None, &none, true), "ended before the fence: the chunk read it");
        assert!(counts(&base, &k, lsn(25), after, None, &none, true), "ended after the fence: a change to count");
        assert!(!counts(&base, &k, lsn(15), after, None, &none, true), "at or before the stamp: never");
        let full = Base::Full(lsn(10), Some(t0));
        assert!(!counts(&full, &nothing, lsn(11), before, None, &none, true), "a full read holds what ended before its fence");
        assert!(counts(&full, &nothing, lsn(11), after, None, &none, true));
        assert!(!counts(&full, &nothing, lsn(11), after, Some(lsn(12)), &none, false), "and silver has applied it");
    }

    #[test]
    fn a_key_finds_the_chunk_of_its_range() {
        let read = vec![chunk(0, None, Some(10), 1), chunk(1, Some(10), Some(20), 1), chunk(3, Some(30), None, 1)];
        let at = |v: Option<i64>| chunk_of(&read, &[v.map(SqlValue::Int).unwrap_or(SqlValue::Null)]).map(|c| c.chunk);
        assert_eq!(at(None), Some(0));
        assert_eq!(at(Some(-5)), Some(0));
        assert_eq!(at(Some(10)), Some(1));
        assert_eq!(at(Some(19)), Some(1));
        assert_eq!(at(Some(25)), None, "chunk 2 is not read");
        assert_eq!(at(Some(30)), Some(3));
        assert_eq!(at(Some(i64::MAX)), Some(3));
    }
}
