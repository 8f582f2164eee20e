//! The `seed` step: a copy of the table someone already has (a Delta table
//! or Parquet files) becomes the target's snapshot, so a table too big to
//! snapshot within the CDC retention can still be replicated.
//!
//! The copy stands for the table as of a point L: the LSN the caller recorded
//! before the copy started, or the copy's start time mapped to the largest
//! commit LSN at or before it on the server's clock ([`server_mapping_time`]:
//! the server itself reads its clock at that instant, never rules compiled in
//! here, which can differ from its Windows rules and map an hour late). Every
//! commit at or before L must be in the copy; later ones may be too, because
//! the stream replays everything after L and the latest image per key absorbs
//! the overlap. So every approximation of L goes earlier, never later.
//!
//! Effects (each a commit with a txn id, like the bootstrap's):
//! 1. bronze: the copy's rows as one whole snapshot, operation 0,
//!    `_start_lsn = _snapshot = L`, `_commit_ts` L's commit time, txn
//!    `<app>#snapshot` + generation, the seed named in the commit metadata;
//! 2. facts: the snapshot's completion row, `bootstrap` for generation 0 and
//!    `resnapshot` for a reseed, txn `<app>#events` + generation. The
//!    bootstrap's own completion has the same txn key, so a stream with
//!    `snapshot.bootstrap = true` finds the seed as its snapshot, writes no
//!    second one, and starts at L.
//!
//! Generations: a first seed is generation 0's snapshot. `--reseed` appends a
//! newer copy as the snapshot of a NEW generation (current + 1): its batches
//! then run under `<app>.g<n>` from batch id 0 (txn versions only grow, so a
//! new snapshot cannot reuse the old generation's batch ids), and
//! `StreamState::derive` picks the generation up from the `resnapshot` row
//! with no change. Change rows of the old generation after the new L stay in
//! bronze; the stream writes them again, and the rebuild's latest-per-key rule
//! gives them the same rank, so the image is unchanged.
//!
//! Reruns: before anything else a seed looks for itself. With an LSN, bronze's
//! whole-snapshot rows at L; with a time, the snapshot at the time's L, or,
//! once cleanup has removed the time's mapping rows, the newest whole
//! snapshot committed at or before the time. A crash between the two commits
//! is finished from the bronze commit's metadata on the next call.

use std::time::Instant;

use chrono::{DateTime, Duration, NaiveDateTime, SubsecRound, Utc};
use deltalake::arrow::array::{Array, Int64Array, StringArray, TimestampMicrosecondArray};
use deltalake::arrow::datatypes::Field;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use super::chunked::{Mode, Opened};
use super::Context;
use crate::delta::bronze::{self, SnapshotStamp};
use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT};
use crate::delta::{self, Appended, Claimed, Txn, Written};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::source::{CdcSource, ServerZone, SourceError, TimeOp};

/// What the copy stands for: an LSN recorded before it started, or its start time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsOf {
    Lsn(Lsn),
    Time(DateTime<Utc>),
}

impl AsOf {
    /// Parses `--as-of`: an LSN (`0x` + 20 hex digits) or a time with `Z` or an
    /// offset (RFC 3339). A time without an offset is refused: read on the
    /// wrong clock it could map later than the copy, and skip commits.
    pub fn parse(text: &str) -> StepResult<AsOf> {
        let t = text.trim();
        if t.starts_with("0x") || t.starts_with("0X") {
            return Lsn::parse(t)
                .map(AsOf::Lsn)
                .map_err(|e| StepError::Config(format!("--as-of {t} is not an LSN ({e}): write it as 0x followed by 20 hex digits")));
        }
        match DateTime::parse_from_rfc3339(t) {
            Ok(d) => Ok(AsOf::Time(d.with_timezone(&Utc))),
            Err(e) => {
                let naive = NaiveDateTime::parse_from_str(t, "%Y-%m-%dT%H:%M:%S%.f").or_else(|_| NaiveDateTime::parse_from_str(t, "%Y-%m-%d %H:%M:%S%.f"));
                let hint = if naive.is_ok() {
                    "it has no offset: add Z for UTC or the offset it was read in (e.g. -03:00)".to_string()
                } else {
                    format!("{e}")
                };
                Err(StepError::Config(format!(
                    "--as-of {t} is neither an LSN nor a time ({hint}). Pass the LSN recorded before the copy started \
                     (0x + 20 hex digits) or the copy's start time like 2026-10-01T16:53:59Z"
                )))
            }
        }
    }
}

/// The arguments of a seed.
#[derive(Debug, Clone)]
pub struct SeedArgs {
    /// A Delta table or a folder of Parquet files.
    pub copy: String,
    pub as_of: AsOf,
    pub reseed: bool,
    pub allow_missing_columns: bool,
}

/// A whole snapshot the target holds (bronze rows, or a completion row in the facts).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WholeSnapshot {
    pub lsn: Lsn,
    pub commit_ts: Option<DateTime<Utc>>,
    pub rows: Option<i64>,
    /// The generation whose completion row names it, when the facts have one.
    pub generation: Option<i32>,
    /// For a seed, the copy and `--as-of` (as its completion row records
    /// them) it was made from.
    pub seeded_from: Option<(String, String)>,
}

/// The JSON result of a `seed` call.
#[derive(Debug, Clone, Serialize)]
pub struct SeedResult {
    pub step: &'static str,
    pub lsn: Lsn,
    pub commit_ts: Option<DateTime<Utc>>,
    pub rows: i64,
    pub already_seeded: bool,
    pub generation: i32,
    pub reseed: bool,
    pub copy_kind: Option<crate::seed_copy::CopyKind>,
    pub columns_dropped: Vec<String>,
    pub columns_null: Vec<String>,
    pub duration_ms: i64,
}

/// What a seed call does, decided from what the target and the source hold.
#[derive(Debug, Clone, PartialEq)]
pub enum SeedDecision {
    /// The seed is there already (a rerun): return it, write nothing.
    AlreadySeeded(WholeSnapshot),
    /// Append the copy as the snapshot of this generation at L.
    Write { lsn: Lsn, generation: i32 },
    /// No commit at or before the time is known to CDC any more (exit 3).
    NoCommitAtOrBefore,
    /// The changes right after L are purged (exit 3).
    Purged { lsn: Lsn, next: Lsn, min_lsn: Lsn },
    /// L is above the source's max LSN (exit 2).
    AboveMax { lsn: Lsn, max_lsn: Lsn },
    /// The capture job has recorded nothing yet (exit 75).
    NothingCaptured,
    /// A snapshot holds the snapshot mode (exit 2): finish it first.
    SnapshotOpen(Opened),
    /// Another snapshot is there and no `--reseed` (exit 2).
    SnapshotPresent(WholeSnapshot),
    /// `--reseed` with a copy not newer than the newest snapshot (exit 2).
    NotNewer { lsn: Lsn, newest: WholeSnapshot },
    /// The stream already runs without a snapshot and no `--reseed` (exit 2).
    StartedWithoutSnapshot(Lsn),
}

/// Everything [`decide`] looks at.
#[derive(Debug, Clone)]
pub struct SeedInput {
    /// The copy given (`--copy`).
    pub copy: String,
    pub as_of: AsOf,
    /// L: the LSN given, or the time's mapping (None when nothing maps).
    pub lsn: Option<Lsn>,
    /// The whole snapshots the target holds.
    pub snapshots: Vec<WholeSnapshot>,
    /// The snapshot that holds the snapshot mode
    /// (`engine::rules::snapshot_holding_mode`): a chunked one not complete,
    /// or a full one that may still be read. A dead full open (cleanup passed
    /// its S, or a completion superseded it, including the completion of its
    /// own generation by a concurrent attempt that won) is not one.
    pub open_snapshot: Option<Opened>,
    pub generation: i32,
    /// The highest generation whose full snapshot bronze holds under
    /// `<app>#snapshot` (its txn version). A re-snapshot that died after that
    /// commit, without its completion, has spent its generation's key: a
    /// reseed takes the generation after it.
    pub snapshot_txn_generation: Option<i32>,
    /// The stream's position when its generation has no snapshot (a stream start).
    pub position_without_snapshot: Option<Lsn>,
    pub min_lsn: Option<Lsn>,
    pub max_lsn: Option<Lsn>,
    pub reseed: bool,
}

/// The seed's rules, as a pure function. Reruns are resolved first, so a
/// seed already there is returned whatever happened since (cleanup, a newer
/// snapshot); then the checks that refuse; then the write.
pub fn decide(input: &SeedInput) -> SeedDecision {
    // The same copy and `--as-of` as a seed the target holds is a rerun of
    // it, whatever the time maps to now: under capture lag a commit before
    // the time may have been captured since the first call (the time then
    // maps to a later L), or cleanup may have removed the time's mapping.
    let as_of = as_of_text(&input.as_of);
    if let Some(s) = input.snapshots.iter().find(|s| s.seeded_from.as_ref().is_some_and(|(c, a)| *c == input.copy && *a == as_of)) {
        return SeedDecision::AlreadySeeded(s.clone());
    }
    // Only a seed's snapshot is a seed's rerun: a snapshot another step
    // took at the same L (the stream's bootstrap, which can land first at
    // exactly the copy's point) is "another snapshot", refused below like
    // any other. Answering "already seeded" would tell the caller its copy
    // is the target's snapshot when none of its rows is there.
    let seed_at = |l: Lsn| input.snapshots.iter().find(|s| s.lsn == l && s.seeded_from.is_some()).cloned();
    let lsn = match (input.lsn, &input.as_of) {
        (Some(l), _) => {
            if let Some(s) = seed_at(l) {
                return SeedDecision::AlreadySeeded(s);
            }
            Some(l)
        }
        (None, AsOf::Time(t)) => {
            // The time no longer maps (cleanup removed its mapping rows, or it
            // is older than CDC): a seed made from it is the newest seed
            // committed at or before it.
            if !input.reseed {
                let seed = input
                    .snapshots
                    .iter()
                    .filter(|s| s.seeded_from.is_some() && s.commit_ts.is_some_and(|c| c <= *t))
                    .max_by_key(|s| s.lsn);
                if let Some(s) = seed {
                    return SeedDecision::AlreadySeeded(s.clone());
                }
            }
            None
        }
        (None, AsOf::Lsn(l)) => Some(*l),
    };
    // The refusals that hold whatever the copy is come before the copy's
    // own checks: they depend on the target alone, so the answer to a
    // repeated call does not turn from "the target is started otherwise"
    // (exit 2) into "data loss" (exit 3) when cleanup passes the copy's time
    // in between (the soak's schedule 150001629). Data loss would also be
    // the wrong word there: the target has lost nothing, and a new copy
    // would be refused all the same without --reseed.
    if let Some(open) = &input.open_snapshot {
        return SeedDecision::SnapshotOpen(open.clone());
    }
    let newest = input.snapshots.iter().max_by_key(|s| s.lsn).cloned();
    if !input.reseed {
        if let Some(s) = newest {
            return SeedDecision::SnapshotPresent(s);
        }
        if let Some(p) = input.position_without_snapshot {
            return SeedDecision::StartedWithoutSnapshot(p);
        }
    }
    let Some(lsn) = lsn else { return SeedDecision::NoCommitAtOrBefore };
    let Some(max) = input.max_lsn else { return SeedDecision::NothingCaptured };
    if lsn > max {
        return SeedDecision::AboveMax { lsn, max_lsn: max };
    }
    // The stream's retention test: with changes after L to read, the next one must still be held.
    let next = lsn.increment();
    if let Some(min) = input.min_lsn {
        if max > lsn && next < min {
            return SeedDecision::Purged { lsn, next, min_lsn: min };
        }
    }
    // A reseed's generation: the next one, past any whose snapshot key a dead
    // re-snapshot spent (Delta would skip the append as already applied).
    let next_generation = (input.generation + 1).max(input.snapshot_txn_generation.map_or(0, |g| g + 1));
    match newest {
        Some(s) if lsn <= s.lsn => SeedDecision::NotNewer { lsn, newest: s },
        Some(_) => SeedDecision::Write { lsn, generation: next_generation },
        None if input.position_without_snapshot.is_some() => SeedDecision::Write { lsn, generation: next_generation },
        None => SeedDecision::Write { lsn, generation: input.generation },
    }
}

/// The server-local time to pass to `fn_cdc_map_time_to_lsn('largest less
/// than or equal', ...)` for a copy that started at `as_of`, from the
/// server's own readings of its clock ([`CdcSource::server_local_times`]) at
/// `as_of` and an hour later; see [`mapping_time_from_readings`] for the
/// adjustments. The mapping table holds the server's wall-clock times, so the
/// server converts: with compiled-in rules that differ from the server's
/// (a zone whose DST changed), the time would be an hour late and the seed
/// would skip the commits of that hour.
pub async fn server_mapping_time(source: &dyn CdcSource, as_of: DateTime<Utc>) -> Result<NaiveDateTime, SourceError> {
    let readings = source.server_local_times(&[as_of, as_of + Duration::hours(1)]).await?;
    match readings.as_slice() {
        [own, hour_later] => Ok(mapping_time_from_readings(*own, *hour_later)),
        other => Err(SourceError::Other(format!("the source answered {} wall-clock times for 2 instants", other.len()))),
    }
}

/// The mapping time from two readings of the server's clock: `own` at the
/// copy's start and `hour_later` an hour after it. Each adjustment can only
/// make L earlier (a replay), never later (a skip):
/// - in a fall-back hour the wall clock repeats, and commits up to an hour
///   after the start show earlier local times with larger LSNs; so the time
///   passed is the earlier of `own` and `hour_later` less an hour (the same
///   time outside a fall-back, an hour earlier inside one);
/// - mapping times are `datetime`, rounded to 1/300 s (up or down by up to
///   2 ms), so the time steps back past that error and is truncated to the
///   whole second, which `datetime` holds exactly.
pub fn mapping_time_from_readings(own: NaiveDateTime, hour_later: NaiveDateTime) -> NaiveDateTime {
    let earlier = own.min(hour_later - Duration::hours(1));
    (earlier - Duration::milliseconds(3)).trunc_subsecs(0)
}

/// [`server_mapping_time`] for a server whose clock follows `zone` exactly as
/// the rules compiled into this program say: the reference tests compare a
/// source's answer with. The seed never uses it.
pub fn mapping_time(zone: &ServerZone, as_of: DateTime<Utc>) -> NaiveDateTime {
    mapping_time_from_readings(zone.to_local(as_of), zone.to_local(as_of + Duration::hours(1)))
}

/// Runs the `seed` step.
pub async fn run(ctx: &mut Context, args: &SeedArgs) -> StepResult<SeedResult> {
    let started = Instant::now();
    // The copy is fitted to the columns of the instance the stream is on
    // (bronze's), never a newer one the stream has not switched to.
    super::switch::follow_stream(ctx).await?;
    let mut facts_rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    if finish_interrupted_seed(ctx, &facts_rows).await? {
        facts_rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    }
    let mut st = super::state::load(ctx).await?;
    // A batch the stream committed to bronze without its facts row (a crash
    // between the two commits) belongs to the running generation. A reseed
    // starts the next one, and each stream call repairs only its own
    // generation's batches: left for later, the batch would stay in bronze
    // with no facts row for good. So it is recorded first, as the stream's
    // next call would have.
    if !super::repair::repair(ctx, &st).await?.is_empty() {
        st = super::state::load(ctx).await?;
    }
    let lsn = match &args.as_of {
        AsOf::Lsn(l) => Some(*l),
        AsOf::Time(t) => {
            let local = server_mapping_time(ctx.source.as_ref(), *t).await?;
            let l = ctx.source.time_to_lsn(TimeOp::LargestLessThanOrEqual, local).await?;
            tracing::info!(as_of = %t, server_local = %local, zone = %ctx.zone.name, lsn = ?l, "mapped the copy's start time to an LSN");
            l
        }
    };
    let input = seed_input(ctx, args, &facts_rows, &st, lsn).await?;
    let (lsn, generation) = match decide(&input) {
        SeedDecision::Write { lsn, generation } => (lsn, generation),
        SeedDecision::AlreadySeeded(s) => return rerun_result(ctx, args, s, st.generation, started).await,
        refused => return Err(refusal(ctx, &args.as_of, refused).await),
    };
    let commit_ts = ctx.commit_time(lsn).await?.ok_or_else(|| {
        StepError::Config(format!(
            "--as-of {lsn} is not a commit LSN the source maps to a time (cdc.lsn_time_mapping has no row for it): pass the value \
             sys.fn_cdc_get_max_lsn() returned before the copy started, or the copy's start time"
        ))
    })?;

    // The copy was taken from the table, which names a renamed column
    // otherwise than the instance does: fitted by name, it would load NULL.
    super::check_no_renamed_columns(ctx, "seed (whose copy is fitted to the captured column names)")?;
    // The copy: its columns are fitted from its schema before anything is written.
    let copy = crate::seed_copy::open(&args.copy, &ctx.storage).await?;
    let bronze_schema = ctx.bronze_schema()?;
    let captured: Vec<Field> = ctx
        .instance
        .columns
        .iter()
        .map(|c| bronze_schema.fields().iter().find(|f| f.name().eq_ignore_ascii_case(&c.name)).map(|f| f.as_ref().clone()).unwrap_or_else(|| c.arrow_field()))
        .collect();
    let plan = crate::seed_copy::plan_columns(copy.stream.schema().as_ref(), &captured, args.allow_missing_columns)?;
    if !plan.dropped.is_empty() {
        tracing::info!(columns = ?plan.dropped, "copy columns the capture instance does not capture are dropped");
    }
    if !plan.missing.is_empty() {
        tracing::warn!(columns = ?plan.missing, "captured columns the copy lacks are loaded as NULL (--allow-missing-columns)");
    }
    tracing::info!(lsn = %lsn, commit_ts = %commit_ts, generation, copy = %args.copy, "seeding bronze from the copy");

    let stamp = SnapshotStamp { snapshot: lsn, start_lsn: lsn, commit_ts: Some(commit_ts), capture_instance: ctx.instance.name.clone(), chunk: None };
    let counted = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let c2 = counted.clone();
    let label = args.copy.clone();
    let schema_for_rows = bronze_schema.clone();
    let plan_for_rows = plan.clone();
    let rows_stream = copy.stream.map(move |b| {
        let b = b.map_err(|e| StepError::Temporary(format!("reading the copy {label}: {e}")))?;
        let fitted = plan_for_rows.apply(&b)?;
        let out = bronze::from_snapshot(&fitted, &schema_for_rows, &stamp)?;
        c2.fetch_add(out.num_rows() as i64, std::sync::atomic::Ordering::Relaxed);
        Ok(out)
    });
    let snap_txn = Txn::new(format!("{}#snapshot", ctx.workflow.app_id), generation as i64);
    let meta = json!({
        "kind": "seed",
        "seed": ctx.instance.name,
        "lsn": lsn,
        "commit_ts": commit_ts,
        "snapshot_lsn": lsn,
        "generation": generation,
        "reseed": args.reseed,
        "capture_instance": ctx.instance.name,
    });
    let another_snapshot = || StepError::Temporary("another run committed a snapshot of this generation meanwhile: call seed again".into());
    // The copy's rows go to data files first, uncommitted: the read can take
    // hours, and what the first decision looked at may have changed since.
    let adds = match delta::write_files(&mut ctx.bronze, rows_stream, bronze_schema, &snap_txn).await? {
        Written::Files { adds, .. } => adds,
        Written::Empty => {
            return Err(StepError::Config(format!(
                "the copy {} holds no rows: nothing was written. Check the path; an empty table needs no seed (use snapshot.bootstrap)",
                args.copy
            )))
        }
        Written::AlreadyApplied { .. } => return Err(another_snapshot()),
    };
    let rows = counted.load(std::sync::atomic::Ordering::Relaxed);
    failpoint!("seed.after_copy_read");
    // Decided again on the target as it is now, before anything is
    // committed: a stream that started, a snapshot opened or completed, a
    // cleanup that passed L while the copy was read each refuse here, and the
    // files written are orphans (VACUUM removes them). What lands between
    // this decision and the completion is settled by the completion's claims.
    ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
    let facts_now = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let st_now = super::state::load(ctx).await?;
    let again = seed_input(ctx, args, &facts_now, &st_now, Some(lsn)).await?;
    match decide(&again) {
        SeedDecision::Write { lsn: l, generation: g } if l == lsn && g == generation => {}
        SeedDecision::AlreadySeeded(s) => return rerun_result(ctx, args, s, st_now.generation, started).await,
        SeedDecision::Write { generation: g, .. } => {
            return Err(StepError::Temporary(format!(
                "the target moved from generation {generation} to {g} while the copy was read: call seed again"
            )))
        }
        refused => return Err(refusal(ctx, &args.as_of, refused).await),
    }
    let mut meta = meta;
    meta["rows"] = json!(rows);
    meta["copy"] = json!(args.copy);
    meta["as_of"] = json!(as_of_text(&args.as_of));
    let bronze_version = match delta::commit_adds(&mut ctx.bronze, adds, &snap_txn, meta).await? {
        Appended::Committed { table_version } => table_version,
        Appended::AlreadyApplied { .. } => return Err(another_snapshot()),
        Appended::Empty => return Err(StepError::Internal("a commit of data files reported no rows".into())),
    };
    failpoint!("seed.after_bronze");
    let duration_ms = started.elapsed().as_millis() as i64;
    let detail = json!({"mode": "seed", "reseed": args.reseed, "copy": args.copy, "copy_kind": copy.kind, "as_of": as_of_text(&args.as_of),
                        "columns_dropped": plan.dropped, "columns_null": plan.missing});
    if let Some(err) = complete_or_undo(ctx, generation, lsn, rows, Some(commit_ts), bronze_version, Some(duration_ms), detail).await? {
        return Err(err);
    }
    tracing::info!(lsn = %lsn, rows, duration_ms, generation, "seed complete");
    Ok(SeedResult {
        step: "seed",
        lsn,
        commit_ts: Some(commit_ts),
        rows,
        already_seeded: false,
        generation,
        reseed: args.reseed,
        copy_kind: Some(copy.kind),
        columns_dropped: plan.dropped,
        columns_null: plan.missing,
        duration_ms,
    })
}

/// What [`decide`] looks at, read from the target and the source now. `lsn`
/// is L as the caller mapped it (a second decision keeps the first one's L).
async fn seed_input(ctx: &Context, args: &SeedArgs, facts_rows: &[FactRow], st: &super::state::StreamState, lsn: Option<Lsn>) -> StepResult<SeedInput> {
    let snapshots = whole_snapshots(ctx, facts_rows).await?;
    let max_lsn = ctx.source.max_lsn().await?;
    let min_lsn = ctx.source.min_lsn(&ctx.instance.name).await?;
    let snapshot_txn_generation = delta::txn_version(&ctx.bronze, &format!("{}#snapshot", ctx.workflow.app_id)).await?.map(|v| v as i32);
    Ok(SeedInput {
        copy: args.copy.clone(),
        as_of: args.as_of.clone(),
        lsn,
        snapshots,
        open_snapshot: super::chunked::snapshot_holding_mode(facts_rows, min_lsn),
        generation: st.generation,
        snapshot_txn_generation,
        position_without_snapshot: if st.snapshot.is_none() { st.position() } else { None },
        min_lsn,
        max_lsn,
        reseed: args.reseed,
    })
}

/// The answer to a call [`decide`] finds to be a rerun of seed `s`. When
/// `s` has no completion row yet (its bronze commit is in: another call of
/// the same seed between its two commits, or one that died there), "already
/// seeded" would be a promise nothing keeps: if that call never comes back,
/// the copy's rows stay in bronze with no generation counting them, and the
/// caller, told the copy is done, never calls again. So this call writes the
/// completion from the commit itself (the completion's txn id makes its write
/// and the other call's one commit), then decides once more on what the
/// target now holds.
async fn rerun_result(ctx: &mut Context, args: &SeedArgs, s: WholeSnapshot, generation: i32, started: Instant) -> StepResult<SeedResult> {
    if s.generation.is_some() {
        return Ok(already_seeded(&s, generation, args, started));
    }
    tracing::warn!(lsn = %s.lsn, "bronze holds this seed's rows without its completion row: completing it");
    ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
    let facts_rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    finish_interrupted_seed(ctx, &facts_rows).await?;
    let st = super::state::load(ctx).await?;
    let facts_rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
    let input = seed_input(ctx, args, &facts_rows, &st, Some(s.lsn)).await?;
    match decide(&input) {
        SeedDecision::AlreadySeeded(done) if done.generation.is_some() => Ok(already_seeded(&done, st.generation, args, started)),
        SeedDecision::AlreadySeeded(_) | SeedDecision::Write { .. } => {
            Err(StepError::Temporary("another call of this seed is between its commits: call seed again".into()))
        }
        refused => Err(refusal(ctx, &args.as_of, refused).await),
    }
}

/// The result of a seed the target already holds (nothing written).
fn already_seeded(s: &WholeSnapshot, generation: i32, args: &SeedArgs, started: Instant) -> SeedResult {
    tracing::info!(lsn = %s.lsn, "the target already holds this seed: nothing to write");
    SeedResult {
        step: "seed",
        lsn: s.lsn,
        commit_ts: s.commit_ts,
        rows: s.rows.unwrap_or(0),
        already_seeded: true,
        generation: s.generation.unwrap_or(generation),
        reseed: args.reseed,
        copy_kind: None,
        columns_dropped: vec![],
        columns_null: vec![],
        duration_ms: started.elapsed().as_millis() as i64,
    }
}

/// Writes the completion of the seed whose rows bronze commit
/// `bronze_version` holds; when a commit of another kind took the
/// generation first (its completion's claims, [`completion_claims`]),
/// removes those rows again and returns the refusal a new decision gives
/// (None: the seed is complete, by this call or a concurrent one).
#[allow(clippy::too_many_arguments)]
async fn complete_or_undo(
    ctx: &mut Context,
    generation: i32,
    lsn: Lsn,
    rows: i64,
    commit_ts: Option<DateTime<Utc>>,
    bronze_version: i64,
    duration_ms: Option<i64>,
    detail: Value,
) -> StepResult<Option<StepError>> {
    let taken_by = match write_completion(ctx, generation, lsn, rows, commit_ts, Some(bronze_version), duration_ms, detail).await? {
        Claimed::Committed { .. } => return Ok(None),
        Claimed::Taken { claim, .. } => claim.app_id,
        // The generation's completion key is applied: by this seed (another
        // call of it) or by another step's completion of the generation (a
        // chunked snapshot that completed while the seed was cut, an empty
        // table's full snapshot, which commits nothing to bronze). Only the
        // completion row says which.
        Claimed::AlreadyApplied { .. } => {
            ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
            let facts_rows = super::state::facts_rows(&ctx.facts, &ctx.workflow.app_id).await?;
            if facts_rows.iter().any(|r| r.generation == generation && completes_commit(r, bronze_version, lsn)) {
                return Ok(None);
            }
            format!("{}#events", ctx.workflow.app_id)
        }
    };
    Ok(Some(undo(ctx, generation, lsn, bronze_version, &taken_by).await?))
}

/// Whether completion row `r` completes the seed whose bronze commit is
/// `bronze_version` at `lsn`: it names that commit (every completion this
/// program writes from a seed's commit does), or, without a commit, it is a
/// seed's completion at that LSN.
fn completes_commit(r: &FactRow, bronze_version: i64, lsn: Lsn) -> bool {
    is_completion(r)
        && match r.bronze_version {
            Some(v) => v == bronze_version,
            None => is_seed_completion(r) && r.min_lsn == Some(lsn),
        }
}

/// Removes the rows of the seed whose bronze commit is `bronze_version`,
/// which lost `generation` to another step (`taken_by` names the key or the
/// completion that holds it), and returns the refusal to give.
async fn undo(ctx: &mut Context, generation: i32, lsn: Lsn, bronze_version: i64, taken_by: &str) -> StepResult<StepError> {
    failpoint!("seed.before_undo");
    tracing::warn!(generation, taken_by, lsn = %lsn, "another step started this generation while the seed was written: removing the seed's rows from bronze");
    let removed = delta::remove_files_of_commit(
        &mut ctx.bronze,
        bronze_version,
        json!({"kind": "seed_undone", "generation": generation, "lsn": lsn, "bronze_version": bronze_version, "taken_by": taken_by}),
    )
    .await?;
    tracing::info!(files = removed, bronze_version, "the seed's rows are removed from bronze");
    Ok(StepError::Config(format!(
        "generation {generation} was started by another step ({taken_by}) while this seed was written, so the seed at {lsn} was not \
         recorded and its rows were removed from bronze again. Run `status` to see how the stream started; to replace it \
         with this copy, run seed --reseed with a copy taken after that start"
    )))
}

/// The txn keys a seed's completion of `generation` claims besides its own
/// (`<app>#events`): those of the commits that start the same generation
/// another way, a stream start without a snapshot (`<gen app>#start`) and a
/// chunked snapshot's open (`<app>#snapshots`). With them in one commit,
/// only one of the three can land for a generation, and a stream or an open
/// that loses finds its own key applied and reads the seed's state instead.
fn completion_claims(app_id: &str, generation: i32) -> Vec<Txn> {
    vec![
        Txn::new(format!("{}#start", super::generation_app_id(app_id, generation)), 0),
        Txn::new(format!("{app_id}#snapshots"), generation as i64),
    ]
}

fn as_of_text(a: &AsOf) -> String {
    match a {
        AsOf::Lsn(l) => l.to_hex(),
        AsOf::Time(t) => t.to_rfc3339(),
    }
}

/// The error for a refusal, saying what to do.
async fn refusal(ctx: &Context, as_of: &AsOf, d: SeedDecision) -> StepError {
    let wf = ctx.workflow.path.display();
    match d {
        SeedDecision::NoCommitAtOrBefore => {
            let t = as_of_text(as_of);
            let min = ctx.source.min_lsn(&ctx.instance.name).await.ok().flatten();
            let min_t = match min {
                Some(m) => ctx.commit_time(m).await.ok().flatten().map(|t| format!(" (the oldest change it holds was committed at {t})")).unwrap_or_default(),
                None => String::new(),
            };
            StepError::NeedsPerson(format!(
                "data loss: the copy started at {t}, but CDC holds no commit at or before that time{min_t}: the changes between the copy and \
                 what CDC still holds are gone, so this copy cannot be completed by the stream. Take a newer copy (record \
                 sys.fn_cdc_get_max_lsn() or the time before it starts) and seed from it"
            ))
        }
        SeedDecision::Purged { lsn, next, min_lsn } => StepError::DataLoss {
            capture_instance: ctx.instance.name.clone(),
            position: lsn,
            next,
            min_lsn,
            times: String::new(),
            advice: "The copy is older than the CDC retention: take a newer copy and seed from it (with --reseed if the target has a snapshot), \
                     or raise the retention (sys.sp_cdc_change_job @retention) for the next one."
                .into(),
        },
        SeedDecision::AboveMax { lsn, max_lsn } => StepError::Config(format!(
            "--as-of {lsn} is above the source's max LSN {max_lsn}: an LSN recorded before the copy cannot be newer than what the \
             capture job has seen. Check that the LSN comes from this database"
        )),
        SeedDecision::NothingCaptured => {
            StepError::Temporary("the capture job has not recorded any LSN yet (max LSN is NULL): call seed again once it has run".into())
        }
        SeedDecision::SnapshotOpen(open) => StepError::Config(format!(
            "a {} snapshot of this stream is open (started at {}, generation {}) and not complete: a seed beside it would put two \
             snapshots in one run, so finish it first: {}; then seed with --reseed if the copy is newer",
            if open.mode == Mode::Full { "full" } else { "chunked" },
            open.s,
            open.generation,
            super::chunked::how_to_finish(&open).replace("--workflow FILE", &format!("--workflow {wf}"))
        )),
        SeedDecision::SnapshotPresent(s) => StepError::Config(format!(
            "the target already holds a snapshot at {}{}: a second seed would move the point downstream rebuilds start from. \
             A rerun with that snapshot's --as-of returns it; to replace it with this newer copy pass --reseed (it starts a new \
             stream generation from the copy)",
            s.lsn,
            s.commit_ts.map(|t| format!(" (committed {t})")).unwrap_or_default()
        )),
        SeedDecision::NotNewer { lsn, newest } => StepError::Config(format!(
            "--reseed needs a copy newer than the target's newest snapshot {}, but this copy stands at {lsn}: a reseed never goes \
             back. Take a newer copy",
            newest.lsn
        )),
        SeedDecision::StartedWithoutSnapshot(p) => StepError::Config(format!(
            "the stream already runs without a snapshot (position {p}): seeding its generation now would leave a gap. Pass --reseed \
             to start a new generation from the copy"
        )),
        SeedDecision::Write { .. } | SeedDecision::AlreadySeeded(_) => StepError::Internal("refusal of a decision that is not one".into()),
    }
}

/// The whole snapshots the target holds: bronze's operation-0 rows outside
/// chunks, grouped by snapshot (one aggregate over them: a table of billions
/// of seeded rows pays a scan of three columns here), joined with the facts'
/// completion rows (which also name snapshots that wrote no rows).
async fn whole_snapshots(ctx: &Context, facts_rows: &[FactRow]) -> StepResult<Vec<WholeSnapshot>> {
    let sql = format!(
        "SELECT coalesce({snap}, {start}) AS s, min({ts}) AS ts, count(*) AS n FROM t WHERE {op} = 0 AND {chunk} IS NULL GROUP BY coalesce({snap}, {start})",
        snap = bronze::SNAPSHOT,
        start = bronze::START_LSN,
        ts = bronze::COMMIT_TS,
        op = bronze::OPERATION,
        chunk = bronze::CHUNK
    );
    let batches = delta::query(&ctx.bronze, &sql).await?;
    let mut out: Vec<WholeSnapshot> = Vec::new();
    for b in &batches {
        let s = b.column(0).as_any().downcast_ref::<StringArray>().ok_or_else(|| StepError::Internal("snapshot LSN column".into()))?;
        let ts = b.column(1).as_any().downcast_ref::<TimestampMicrosecondArray>().ok_or_else(|| StepError::Internal("snapshot time column".into()))?;
        let n = b.column(2).as_any().downcast_ref::<Int64Array>().ok_or_else(|| StepError::Internal("snapshot count column".into()))?;
        for i in 0..b.num_rows() {
            if s.is_null(i) {
                continue;
            }
            let lsn = Lsn::parse(s.value(i)).map_err(|e| StepError::Internal(format!("bronze holds a bad snapshot LSN: {e}")))?;
            out.push(WholeSnapshot {
                lsn,
                commit_ts: if ts.is_null(i) { None } else { DateTime::from_timestamp_micros(ts.value(i)) },
                rows: Some(n.value(i)),
                generation: None,
                seeded_from: None,
            });
        }
    }
    for r in facts_rows.iter().filter(|r| is_completion(r)) {
        let Some(l) = r.max_lsn else { continue };
        let seeded_from = r.detail.as_ref().filter(|d| d.get("mode").and_then(Value::as_str) == Some("seed")).and_then(|d| {
            Some((d.get("copy")?.as_str()?.to_string(), d.get("as_of")?.as_str()?.to_string()))
        });
        match out.iter_mut().find(|s| s.lsn == l) {
            Some(s) => {
                s.generation = Some(r.generation);
                s.commit_ts = s.commit_ts.or(r.commit_ts);
                s.seeded_from = s.seeded_from.take().or(seeded_from);
            }
            None => out.push(WholeSnapshot { lsn: l, commit_ts: r.commit_ts, rows: r.rows, generation: Some(r.generation), seeded_from }),
        }
    }
    // A seed whose bronze commit is in but its completion row not yet (a
    // seed call running beside this one, between its two commits): its
    // commit's metadata names the copy and the time. Only the newest full
    // snapshot's commit can lack its completion, so only that one is read.
    if out.iter().any(|s| s.generation.is_none()) {
        let snap_app = format!("{}#snapshot", ctx.workflow.app_id);
        if let Some(version) = delta::txn_version(&ctx.bronze, &snap_app).await? {
            if let Some((_, meta)) = delta::find_txn_commit(&ctx.bronze, &Txn::new(snap_app, version)).await? {
                let lsn = meta.get("snapshot_lsn").and_then(Value::as_str).and_then(|l| Lsn::parse(l).ok());
                let copy = meta.get("copy").and_then(Value::as_str).zip(meta.get("as_of").and_then(Value::as_str));
                if let (Some("seed"), Some(l), Some((c, a))) = (meta.get("kind").and_then(Value::as_str), lsn, copy) {
                    if let Some(s) = out.iter_mut().find(|s| s.lsn == l && s.generation.is_none()) {
                        s.seeded_from = Some((c.to_string(), a.to_string()));
                    }
                }
            }
        }
    }
    out.sort_by_key(|s| s.lsn);
    Ok(out)
}

fn is_completion(r: &FactRow) -> bool {
    matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT))
}

/// A seed that crashed between its bronze commit and its facts row: bronze
/// holds `<app>#snapshot` at a generation the facts have no seed completion
/// for, and that commit is a seed's. Writes the row from the commit's
/// metadata; when another step completed the generation meanwhile (a chunked
/// snapshot opened and finished while the seed was cut), removes the seed's
/// rows instead. True when it wrote anything.
async fn finish_interrupted_seed(ctx: &mut Context, facts_rows: &[FactRow]) -> StepResult<bool> {
    let snap_app = format!("{}#snapshot", ctx.workflow.app_id);
    let Some(version) = delta::txn_version(&ctx.bronze, &snap_app).await? else { return Ok(false) };
    let generation = version as i32;
    // A seed's completion of the generation is this commit's: only one
    // commit holds `<app>#snapshot` at a version. Any of the generation's
    // completions counts, not the first found: a chunked snapshot opened on
    // a capture-instance switch completes in the running generation too,
    // beside the seed's row, under a key of its own.
    if facts_rows.iter().any(|r| r.generation == generation && is_seed_completion(r)) {
        return Ok(false);
    }
    // Other snapshots' interrupted completions are their own step's to finish.
    let Some((bronze_version, meta)) = delta::find_txn_commit(&ctx.bronze, &Txn::new(snap_app, version)).await? else { return Ok(false) };
    if meta.get("kind").and_then(Value::as_str) != Some("seed") {
        return Ok(false);
    }
    if facts_rows.iter().any(|r| r.generation == generation && is_completion(r) && r.bronze_version == Some(bronze_version)) {
        return Ok(false);
    }
    let lsn = meta.get("snapshot_lsn").and_then(Value::as_str).and_then(|s| Lsn::parse(s).ok()).ok_or_else(|| {
        StepError::Internal(format!("bronze commit {bronze_version} is a seed without its LSN in the metadata"))
    })?;
    // A seed that lost its generation to another step removed its rows (or
    // was cut before it could): nothing of it is left to complete.
    if delta::files_of_commit_held(&ctx.bronze, bronze_version).await?.is_empty() {
        return Ok(false);
    }
    // Otherwise the completion is written now; when another step completed
    // the generation meanwhile (a chunked snapshot opened and read to its end
    // while the seed was cut), the completion key is applied without the
    // seed's row, and `complete_or_undo` removes the rows instead. Left alone
    // they stayed in bronze beside that snapshot, while every call of this
    // seed found itself pending (the soak's schedule 150012436, answered
    // "call again" for good).
    let rows = meta.get("rows").and_then(Value::as_i64).unwrap_or(0);
    tracing::warn!(lsn = %lsn, generation, "bronze holds a seed without its facts row (a crash between the two commits): writing it now");
    match complete_from_commit(ctx, generation, lsn, rows, bronze_version, &meta).await? {
        None => Ok(true),
        // The rows are removed; the decision that follows refuses with what holds the generation.
        Some(e) => {
            tracing::warn!(error = %e, "the interrupted seed lost its generation");
            Ok(true)
        }
    }
}

/// A seed's completion row: `bootstrap` or `resnapshot` with `"mode": "seed"`.
fn is_seed_completion(r: &FactRow) -> bool {
    is_completion(r) && r.detail.as_ref().and_then(|d| d.get("mode")).and_then(Value::as_str) == Some("seed")
}

/// Completes a seed from its bronze commit (version `bronze_version`,
/// metadata `meta`) for a step that finds it without its completion row: the
/// seed's rerun, or a stream's bootstrap whose snapshot key the seed holds.
/// Some(error) when another step had taken the generation (the rows are
/// removed again).
pub(crate) async fn complete_from_commit(ctx: &mut Context, generation: i32, lsn: Lsn, rows: i64, bronze_version: i64, meta: &Value) -> StepResult<Option<StepError>> {
    let commit_ts = meta.get("commit_ts").and_then(Value::as_str).and_then(|t| DateTime::parse_from_rfc3339(t).ok()).map(|t| t.with_timezone(&Utc));
    // The row names the instance the seed was loaded for, not the newest
    // (`switch::use_instance_of_commit`).
    super::switch::use_instance_of_commit(ctx, meta.get("capture_instance").and_then(Value::as_str)).await?;
    complete_or_undo(ctx, generation, lsn, rows, commit_ts, bronze_version, None, seed_completion_detail(meta)).await
}

/// The detail of a seed's completion written from its bronze commit's
/// metadata (by the seed's rerun, or by a stream's bootstrap that finds the
/// seed's commit without its row): it names the copy and `--as-of` as the
/// seed's own row does, so a rerun of the seed finds itself by them.
pub fn seed_completion_detail(meta: &Value) -> Value {
    json!({"mode": "seed", "repaired": true, "reseed": meta.get("reseed"), "copy": meta.get("copy"), "as_of": meta.get("as_of")})
}

/// Writes the seed's completion row: `bootstrap` for generation 0 (the
/// bootstrap's own txn key, so the bootstrap finds it done), `resnapshot` for
/// a reseed's new generation.
#[allow(clippy::too_many_arguments)]
async fn write_completion(
    ctx: &mut Context,
    generation: i32,
    lsn: Lsn,
    rows: i64,
    commit_ts: Option<DateTime<Utc>>,
    bronze_version: Option<i64>,
    duration_ms: Option<i64>,
    detail: Value,
) -> StepResult<Claimed> {
    let row = FactRow {
        app_id: ctx.workflow.app_id.clone(),
        table: ctx.workflow.table_name().to_string(),
        target: ctx.workflow.target.bronze.clone(),
        generation,
        event: Some(if generation == 0 { EVENT_BOOTSTRAP } else { EVENT_RESNAPSHOT }.into()),
        capture_instance: Some(ctx.instance.name.clone()),
        min_lsn: Some(lsn),
        max_lsn: Some(lsn),
        rows: Some(rows),
        duration_ms,
        commit_ts,
        bronze_version,
        detail: Some(detail),
        recorded_at: Some(Utc::now()),
        ..Default::default()
    };
    let txn = Txn::new(format!("{}#events", ctx.workflow.app_id), generation as i64);
    let meta = json!({"facts": crate::delta::facts::summary(std::slice::from_ref(&row)), "app_id": ctx.workflow.app_id});
    let claims = completion_claims(&ctx.workflow.app_id, generation);
    delta::append_claiming(&mut ctx.facts, vec![crate::delta::facts::to_batch(&[row])], &txn, &claims, meta).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::ZoneKind;
    use chrono::TimeZone;

    fn l(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }

    fn t(h: u32, m: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 1, h, m, 0).unwrap()
    }

    fn snap(n: u128, at: DateTime<Utc>) -> WholeSnapshot {
        WholeSnapshot { lsn: l(n), commit_ts: Some(at), rows: Some(10), generation: Some(0), seeded_from: None }
    }

    fn input(as_of: AsOf, lsn: Option<Lsn>) -> SeedInput {
        SeedInput {
            copy: "copy.parquet".into(),
            as_of,
            lsn,
            snapshots: vec![],
            open_snapshot: None,
            generation: 0,
            snapshot_txn_generation: None,
            position_without_snapshot: None,
            min_lsn: Some(l(10)),
            max_lsn: Some(l(100)),
            reseed: false,
        }
    }

    #[test]
    fn the_same_copy_and_time_is_a_rerun_whatever_the_time_maps_to_now() {
        // The first call mapped 05:00 to L 40; a commit before 05:00 captured
        // since makes it map to 45 now (or cleanup removed its mapping).
        let mut first = snap(40, t(4, 59));
        first.seeded_from = Some(("copy.parquet".into(), t(5, 0).to_rfc3339()));
        for (lsn, reseed) in [(Some(l(45)), false), (None, false), (Some(l(45)), true)] {
            let mut i = input(AsOf::Time(t(5, 0)), lsn);
            i.reseed = reseed;
            i.snapshots = vec![first.clone()];
            assert_eq!(decide(&i), SeedDecision::AlreadySeeded(first.clone()), "{lsn:?} reseed={reseed}");
        }
        // Another copy at the same time is not that seed.
        let mut i = input(AsOf::Time(t(5, 0)), Some(l(45)));
        i.copy = "other.parquet".into();
        i.snapshots = vec![first.clone()];
        assert!(matches!(decide(&i), SeedDecision::SnapshotPresent(_)), "{:?}", decide(&i));
    }

    #[test]
    fn first_seed_writes_generation_zero() {
        assert_eq!(decide(&input(AsOf::Lsn(l(50)), Some(l(50)))), SeedDecision::Write { lsn: l(50), generation: 0 });
        // L at max LSN: nothing after it to read, nothing purged.
        assert_eq!(decide(&input(AsOf::Lsn(l(100)), Some(l(100)))), SeedDecision::Write { lsn: l(100), generation: 0 });
    }

    /// A seed's snapshot: its completion row names the copy and the time.
    fn seeded(n: u128, at: DateTime<Utc>) -> WholeSnapshot {
        WholeSnapshot { seeded_from: Some(("copy.parquet".into(), t(5, 0).to_rfc3339())), ..snap(n, at) }
    }

    #[test]
    fn reruns_are_found_first_even_after_cleanup_and_under_a_newer_snapshot() {
        let mut i = input(AsOf::Time(t(5, 0)), None);
        i.snapshots = vec![seeded(40, t(4, 59)), snap(80, t(6, 0))];
        i.min_lsn = Some(l(90)); // cleanup passed L: the time no longer maps
        assert_eq!(decide(&i), SeedDecision::AlreadySeeded(seeded(40, t(4, 59))));
        // Another copy given for the same L finds the seed there all the same.
        let mut i = input(AsOf::Lsn(l(40)), Some(l(40)));
        i.copy = "moved/copy.parquet".into();
        i.snapshots = vec![seeded(40, t(4, 59)), snap(80, t(6, 0))];
        i.min_lsn = Some(l(90));
        assert_eq!(decide(&i), SeedDecision::AlreadySeeded(seeded(40, t(4, 59))));
        // A snapshot open does not hide the rerun either.
        i.open_snapshot = Some(opened(95, Mode::Chunked));
        assert_eq!(decide(&i), SeedDecision::AlreadySeeded(seeded(40, t(4, 59))));
    }

    /// Found by the torture soak (schedules 10001125, 20000761, 20001282):
    /// the stream's bootstrap landed first, at exactly the copy's L, and the
    /// seed answered "already seeded" with none of its rows in the target.
    #[test]
    fn a_snapshot_another_step_took_at_l_is_not_the_seeds_rerun() {
        let mut i = input(AsOf::Lsn(l(40)), Some(l(40)));
        i.snapshots = vec![snap(40, t(4, 59))];
        assert_eq!(decide(&i), SeedDecision::SnapshotPresent(snap(40, t(4, 59))));
        i.reseed = true;
        assert_eq!(decide(&i), SeedDecision::NotNewer { lsn: l(40), newest: snap(40, t(4, 59)) });
        // Nor, once the time maps nowhere, is the newest snapshot before it:
        // it is the other snapshot the target holds.
        let mut i = input(AsOf::Time(t(5, 0)), None);
        i.snapshots = vec![snap(40, t(4, 59))];
        assert_eq!(decide(&i), SeedDecision::SnapshotPresent(snap(40, t(4, 59))));
    }

    #[test]
    fn a_time_that_maps_nowhere_is_data_loss_without_a_seed_before_it() {
        let mut i = input(AsOf::Time(t(5, 0)), None);
        assert_eq!(decide(&i), SeedDecision::NoCommitAtOrBefore);
        i.snapshots = vec![snap(40, t(4, 0))];
        i.reseed = true;
        assert_eq!(decide(&i), SeedDecision::NoCommitAtOrBefore, "a reseed never resolves to an existing snapshot");
        i.snapshots = vec![];
        i.position_without_snapshot = Some(l(60));
        assert_eq!(decide(&i), SeedDecision::NoCommitAtOrBefore, "nor to a stream started without one");
    }

    /// Found by the torture soak (schedule 150001629): a seed lost its
    /// generation to a stream's bootstrap, and a cleanup then removed the
    /// mapping rows of its copy's time. Its repeated call answered "data
    /// loss" (exit 3) where the call before it had said "the target holds
    /// another snapshot" (exit 2). Whatever the target alone refuses is
    /// refused the same with the time mapped or not, purged or not.
    #[test]
    fn a_refusal_of_the_target_does_not_change_when_cleanup_passes_the_copy() {
        let mapped = |i: &mut SeedInput| i.lsn = Some(l(40));
        let unmapped = |i: &mut SeedInput| i.lsn = None;
        let purged = |i: &mut SeedInput| {
            i.lsn = Some(l(8));
            i.min_lsn = Some(l(10));
        };
        let cases: [(&str, fn(&mut SeedInput), SeedDecision); 3] = [
            ("another snapshot", |i| i.snapshots = vec![snap(30, t(4, 0))], SeedDecision::SnapshotPresent(snap(30, t(4, 0)))),
            ("a stream start", |i| i.position_without_snapshot = Some(l(60)), SeedDecision::StartedWithoutSnapshot(l(60))),
            ("an open snapshot", |i| i.open_snapshot = Some(opened(45, Mode::Chunked)), SeedDecision::SnapshotOpen(opened(45, Mode::Chunked))),
        ];
        for (what, target, expected) in cases {
            for (copy, place) in [("mapped", &mapped as &dyn Fn(&mut SeedInput)), ("unmapped", &unmapped), ("purged", &purged)] {
                let mut i = input(AsOf::Time(t(5, 0)), None);
                target(&mut i);
                place(&mut i);
                assert_eq!(decide(&i), expected, "{what}, copy's time {copy}");
            }
        }
    }

    #[test]
    fn refusals() {
        let i = input(AsOf::Lsn(l(101)), Some(l(101)));
        assert_eq!(decide(&i), SeedDecision::AboveMax { lsn: l(101), max_lsn: l(100) });
        let i = input(AsOf::Lsn(l(8)), Some(l(8)));
        assert_eq!(decide(&i), SeedDecision::Purged { lsn: l(8), next: l(9), min_lsn: l(10) });
        // increment(L) == min LSN: still held.
        assert_eq!(decide(&input(AsOf::Lsn(l(9)), Some(l(9)))), SeedDecision::Write { lsn: l(9), generation: 0 });
        let mut i = input(AsOf::Lsn(l(8)), Some(l(8)));
        i.max_lsn = None;
        assert_eq!(decide(&i), SeedDecision::NothingCaptured);
        let mut i = input(AsOf::Lsn(l(50)), Some(l(50)));
        i.open_snapshot = Some(opened(45, Mode::Full));
        assert_eq!(decide(&i), SeedDecision::SnapshotOpen(opened(45, Mode::Full)));
        let mut i = input(AsOf::Lsn(l(50)), Some(l(50)));
        i.snapshots = vec![snap(30, t(4, 0))];
        assert_eq!(decide(&i), SeedDecision::SnapshotPresent(snap(30, t(4, 0))));
        let mut i = input(AsOf::Lsn(l(50)), Some(l(50)));
        i.position_without_snapshot = Some(l(60));
        assert_eq!(decide(&i), SeedDecision::StartedWithoutSnapshot(l(60)));
    }

    #[test]
    fn reseed_starts_a_new_generation_and_never_goes_back() {
        let mut i = input(AsOf::Lsn(l(50)), Some(l(50)));
        i.snapshots = vec![snap(30, t(4, 0))];
        i.generation = 2;
        i.reseed = true;
        assert_eq!(decide(&i), SeedDecision::Write { lsn: l(50), generation: 3 });
        let mut i = input(AsOf::Lsn(l(20)), Some(l(20)));
        i.snapshots = vec![snap(30, t(4, 0))];
        i.reseed = true;
        assert_eq!(decide(&i), SeedDecision::NotNewer { lsn: l(20), newest: snap(30, t(4, 0)) });
        let mut i = input(AsOf::Lsn(l(50)), Some(l(50)));
        i.position_without_snapshot = Some(l(60));
        i.reseed = true;
        assert_eq!(decide(&i), SeedDecision::Write { lsn: l(50), generation: 1 });
        // A dead full re-snapshot committed bronze for generation 1 (and maybe 2)
        // without completing: the reseed takes the generation after it.
        let mut i = input(AsOf::Lsn(l(50)), Some(l(50)));
        i.snapshots = vec![snap(30, t(4, 0))];
        i.reseed = true;
        i.snapshot_txn_generation = Some(2);
        assert_eq!(decide(&i), SeedDecision::Write { lsn: l(50), generation: 3 });
        i.snapshot_txn_generation = Some(0);
        assert_eq!(decide(&i), SeedDecision::Write { lsn: l(50), generation: 1 });
    }

    fn opened(s: u128, mode: Mode) -> Opened {
        Opened { s: l(s), generation: 0, mode, kind: EVENT_BOOTSTRAP.into() }
    }

    fn zone(name: &str) -> ServerZone {
        let tz: chrono_tz::Tz = name.parse().unwrap();
        ServerZone { name: name.into(), kind: ZoneKind::Named(tz) }
    }

    fn local(s: &str) -> NaiveDateTime {
        NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S").unwrap()
    }

    #[test]
    fn mapping_time_in_a_named_zone_across_a_fall_back() {
        // Eastern Standard Time as SQL Server names it: 2026-11-01 02:00 EDT falls back to 01:00 EST.
        let iana = crate::mssql::windows_zones::windows_to_iana("Eastern Standard Time").unwrap();
        let z = zone(iana);
        // Before the change: its own local time, less the rounding margin.
        assert_eq!(mapping_time(&z, t(4, 30)), local("2026-11-01 00:29:59"));
        // In the first 01:30 (EDT, 05:30Z): an hour earlier, since commits of the
        // repeated hour up to 06:30Z show local times at or before 01:30.
        assert_eq!(mapping_time(&z, t(5, 30)), local("2026-11-01 00:29:59"));
        // In the second 01:30 (EST, 06:30Z): its own local time.
        assert_eq!(mapping_time(&z, t(6, 30)), local("2026-11-01 01:29:59"));
        // After the change.
        assert_eq!(mapping_time(&z, t(8, 0)), local("2026-11-01 02:59:59"));
        // Spring forward (2026-03-08 02:00 EST -> 03:00 EDT) only moves the clock on.
        let before = Utc.with_ymd_and_hms(2026, 3, 8, 6, 30, 0).unwrap();
        assert_eq!(mapping_time(&z, before), local("2026-03-08 01:29:59"));
        let after = Utc.with_ymd_and_hms(2026, 3, 8, 7, 30, 0).unwrap();
        assert_eq!(mapping_time(&z, after), local("2026-03-08 03:29:59"));
    }

    #[test]
    fn mapping_time_with_a_fixed_offset_and_datetime_rounding() {
        // A server before 2022: a fixed offset, no DST.
        let z = ServerZone { name: "UTC-03:00".into(), kind: ZoneKind::Fixed(-3 * 3600) };
        let at = Utc.with_ymd_and_hms(2026, 10, 1, 19, 53, 59).unwrap() + Duration::milliseconds(999);
        // datetime would round .999 up to the next second; the mapping never goes later.
        assert_eq!(mapping_time(&z, at), local("2026-10-01 16:53:59"));
        // Within the rounding error of a whole second, it steps back a second.
        let at = Utc.with_ymd_and_hms(2026, 10, 1, 19, 54, 0).unwrap() + Duration::milliseconds(1);
        assert_eq!(mapping_time(&z, at), local("2026-10-01 16:53:59"));
        let at = Utc.with_ymd_and_hms(2026, 10, 1, 19, 54, 0).unwrap() + Duration::milliseconds(5);
        assert_eq!(mapping_time(&z, at), local("2026-10-01 16:54:00"));
    }

    /// The copy's start is read on the server's clock, by the server. Here a
    /// server in New York whose rules kept standard time in July (UTC-05:00)
    /// while the rules compiled in here say daylight time (UTC-04:00) for the
    /// zone it reports: converted here, the start would land an hour late,
    /// on a commit made half an hour after the copy began.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_seed_by_time_reads_the_servers_clock_not_compiled_rules() {
        use crate::sim::{Clock, SimConfig};
        use crate::types::SqlValue;
        let dir = tempfile::tempdir().unwrap();
        let cfg = SimConfig {
            clock: Clock::Manual { start: Utc.with_ymd_and_hms(2026, 7, 1, 12, 0, 0).unwrap(), tick_ms: 1000 },
            time_zone: "America/New_York".into(),
            zone_rules: Some("UTC-05:00".into()),
            capture_lag_ms: 0,
            idle_interval_seconds: 0,
            ..SimConfig::default()
        };
        let h = crate::demo::Harness::create_with(dir.path(), 20, cfg).unwrap();
        h.write_workflow("").unwrap();
        let created = chrono::NaiveDate::from_ymd_opt(2026, 1, 1).unwrap().and_hms_opt(0, 0, 0).unwrap();
        let order = |id: i64| {
            vec![
                SqlValue::Int(id),
                SqlValue::Str(format!("c{id}")),
                SqlValue::Decimal { value: 100, scale: 2 },
                SqlValue::Str("new".into()),
                SqlValue::DateTime(created),
                SqlValue::Null,
            ]
        };
        let before = h.db.transaction(|tx| tx.insert(&h.table, order(101))).unwrap();
        h.db.capture().unwrap();
        h.db.advance_clock(std::time::Duration::from_secs(600)).unwrap();
        let as_of = h.db.now().unwrap();
        let source = h.db.source().unwrap();
        let ci = source.capture_instances(&h.table).await.unwrap().pop().unwrap();
        let copy = dir.path().join("copy");
        crate::seed_copy::export_parquet(&source, &h.table, &ci.columns, &copy, 1000).await.unwrap();
        // Half an hour after the copy started: 07:40 on the server's clock.
        h.db.advance_clock(std::time::Duration::from_secs(1800)).unwrap();
        let after = h.db.transaction(|tx| tx.insert(&h.table, order(102))).unwrap();
        h.db.capture().unwrap();

        let mut ctx = Context::open(h.workflow().unwrap()).await.unwrap();
        // The trap: the compiled-in rules read the start as 08:10, after the later commit's 07:40.
        let compiled = mapping_time(&ctx.zone, as_of);
        assert_eq!(ctx.source.time_to_lsn(TimeOp::LargestLessThanOrEqual, compiled).await.unwrap(), Some(after));
        // The server reads 07:10, its own clock.
        let servers = ServerZone { name: "UTC-05:00".into(), kind: ZoneKind::Fixed(-5 * 3600) };
        assert_eq!(server_mapping_time(ctx.source.as_ref(), as_of).await.unwrap(), mapping_time(&servers, as_of));
        let args = SeedArgs { copy: copy.to_string_lossy().into_owned(), as_of: AsOf::Time(as_of), reseed: false, allow_missing_columns: false };
        let r = run(&mut ctx, &args).await.unwrap();
        assert_eq!(r.lsn, before, "L must be the last commit before the copy started");
    }

    #[test]
    fn as_of_parsing() {
        assert_eq!(AsOf::parse("0x0000002a000001f00003").unwrap(), AsOf::Lsn(Lsn::parse("0x0000002a000001f00003").unwrap()));
        assert_eq!(AsOf::parse("2026-10-01T16:53:59-03:00").unwrap(), AsOf::Time(Utc.with_ymd_and_hms(2026, 10, 1, 19, 53, 59).unwrap()));
        assert_eq!(AsOf::parse("2026-10-01T19:53:59Z").unwrap(), AsOf::Time(Utc.with_ymd_and_hms(2026, 10, 1, 19, 53, 59).unwrap()));
        let e = AsOf::parse("2026-10-01T16:53:59").unwrap_err().to_string();
        assert!(e.contains("no offset"), "{e}");
        assert!(AsOf::parse("yesterday").is_err());
        assert!(AsOf::parse("0x12").is_err());
    }
}
