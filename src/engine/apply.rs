//! The `apply` step: bronze's change log into silver, the current state per key.
//!
//! Like the other steps it loads its state (the control table, then the
//! facts, then the plans), decides with a pure function ([`decide`]) and
//! commits twice: the MERGE into silver (txn `<app>#silver`, version = the
//! apply's sequence number), then the control row (txn `<app>#control`, the
//! same version). A crash between the two is harmless: the next call finds
//! the MERGE's txn in silver without its control row and writes that row from
//! the plan the MERGE carried in its commit metadata, before anything else.
//!
//! The rule is bronze's rebuild rule: per key, the latest bronze row by
//! (`_start_lsn`, `_command_id`, `_seqval`, `_operation`); a delete (1) or a
//! before-image (3) as the latest row removes the key (an update of the key
//! itself, recorded as 3 and 4, leaves the old key with its 3 and the new one
//! with its 4; a plain update's 4 outranks its 3). The source of each MERGE is
//! deduplicated to that latest row first, and silver keeps each image's rank
//! so an older image never overwrites a newer one.
//!
//! What a call applies:
//! - a completed snapshot newer than the one silver was built from (a
//!   `bootstrap` or `resnapshot` row): a rebuild from the rows of S and the
//!   changes after S, deleting the keys absent from them (whatever the key
//!   type; this is how a re-snapshot's purged gap leaves silver);
//! - while a chunked snapshot is open: each new wave's chunk rows (taken from
//!   its `snapshot_chunk` facts rows and their plans rows), each with every
//!   bronze change of its key after S so a chunk row never brings back a key
//!   deleted after its stamp; with one integer, date or timestamp key that is
//!   the open's own, also the range deletes of adr-0028's Amendment;
//! - otherwise the changes after the applied LSN, up to the stream's position.
//!
//! The verdict `finalized_until` moves to the applied LSN only when no
//! snapshot is open, and only from facts rows.
//!
//! Keys are matched null-safely everywhere ([`key_match`]): a NULL in a key
//! column (`snapshot.keys` may name a nullable column; a unique index allows
//! one NULL) is a value of its own, so the NULL-key row is updated and
//! deleted like any other instead of gaining a copy per change.
//!
//! # Heaps
//!
//! A capture instance without a unique index (`index_column_list` empty) is
//! a heap, whatever `snapshot.keys` says: those columns cut a chunked
//! snapshot into ranges, and may repeat, so keying silver on them kept one
//! row per value and lost the others. A heap may even hold identical rows,
//! which nothing in CDC tells apart, so its silver ([`heap`]) is a
//! **multiset**: one row per distinct row (every captured column) with
//! `_count`, how many source rows hold those values. A count, not one silver
//! row per source row, because a MERGE can change a count but cannot delete
//! one of two identical target rows.
//!
//! Nothing ranks one image of a heap over another: images are not replaced,
//! they are counted, +1 for a snapshot row (0), an insert (2) or an update's
//! after-image (4), −1 for a delete (1) or an update's before-image (3). An
//! update's 3/4 pair (same commit, command and seqval) thus moves one
//! occurrence from its old values to its new ones, and nets to nothing when
//! no captured column changed. That needs the before-images, which CDC only
//! returns with `stream.row_filter = "all update old"`: `apply` refuses a
//! heap without that option (exit 2, before anything is written), and
//! refuses bronze holding an after-image without its before-image. Counting
//! is exact only if each change counts once, and only where the snapshot
//! row does not already hold it; so what decides is an image's LSN against
//! the snapshot its row was read in: it counts when it is after that
//! snapshot's S (a full snapshot) or after the stamp of the chunk whose
//! range holds its values (a chunked one; an image is placed by its own
//! values, so the before- and after-image of an update that moves a row
//! across chunks each count in their chunk), and after what silver applied
//! unless its chunk is new in this apply. A change row bronze holds twice (a
//! reseed writes the changes after its L again) counts once. While a chunked
//! snapshot is open, a wave replaces its chunks' ranges: silver's rows of
//! those ranges are taken out, the chunk rows and their later images put
//! in. In the ranges the snapshot has not read yet silver still holds what
//! it held before it took this snapshot (an earlier snapshot's chunks, which
//! a switch's or a re-snapshot's open may interrupt, a completed snapshot,
//! or nothing beneath a first one), and images there go on counting as they
//! did then ([`heap::Base`]'s `under`), so a row deleted there leaves silver
//! at once. A heap's plan reads its last chunk open above, so no value lies
//! above the last chunk's end (in plans recorded before that rule, images
//! of such values count after S once the last chunk is read). A completed
//! snapshot rebuilds the whole multiset and deletes the rest.
//!
//! The stamp alone is not enough for a count. The capture job runs behind
//! the log, so a commit can be in the table when a chunk is read and still
//! be missing from the change tables: its change row then comes after the
//! stamp, and counting it would count the row twice (a keyed silver only
//! replays such a change; a heap's change is tied to no row). So a heap's
//! chunks, and its full snapshot (read as one range), are read **fenced**
//! (`CdcSource::snapshot_read_fenced`): under a shared table lock, ending
//! with the server's clock read between two guards. The read holds exactly
//! the commits that ended at or before that fence; an image counts only
//! when its commit's `tran_end_time` (bronze's `_commit_ts`) is after it.
//! Times, not LSNs, because the capture job may not have reached the fence
//! when the read ends, and waiting for it would stall on a quiet database;
//! the change rows carry their commit times whenever they come. The fence
//! is recorded with the chunk (plans row, bronze commit) or the full
//! snapshot's completion row. A seed has no fence: its copy's point in time
//! is its own rule.

mod decide;
pub mod heap;
mod sql;

pub use self::decide::{decide, decide_with_cleanup, next_window_end, newest_completed, SliceLimits, open_chunked, txn_control, txn_merge, waves_in_facts, Action, Decision};
pub use self::sql::{ident, key_match};
use self::sql::key_match_between;

use std::sync::Arc;

use chrono::Utc;
use deltalake::datafusion::common::Column;
use deltalake::datafusion::prelude::SessionContext;
use deltalake::DeltaTable;
use serde::Serialize;
use serde_json::{json, Value};

use super::chunked::{self, ChunkPayload, OpenPayload, EVENT_SNAPSHOT_CHUNK};
use super::state;
use super::Context;
use crate::delta::control::{self, ControlRow};
use crate::delta::facts::EVENT_SNAPSHOT_OPEN;
use crate::delta::{self, bronze, silver, sql_str, Appended, TableKind};
use crate::error::{StepError, StepResult};
use crate::failpoint;
use crate::lsn::Lsn;
use crate::types::{truncate_to_micros, ColumnDesc, SqlType, SqlValue};

/// The result of `apply`, printed as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct ApplyResult {
    pub step: &'static str,
    pub seq: Option<i64>,
    pub action: String,
    pub applied_lsn: Option<Lsn>,
    pub rows_upserted: i64,
    pub rows_deleted: i64,
    pub silver_version: Option<i64>,
    /// `none`, `open` (a snapshot is being applied; verdict held) or `complete`.
    pub snapshot_state: &'static str,
    pub snapshot_lsn: Option<Lsn>,
    pub open_snapshot_lsn: Option<Lsn>,
    pub snapshot_wave: Option<i64>,
    pub finalized_until: Option<Lsn>,
    pub waves_applied: Vec<i64>,
    pub range_deletes: bool,
    /// A control row an earlier call's crash left unwritten, written first.
    pub repaired: bool,
    /// Rows of bronze the MERGE's source held (latest per key), when it was
    /// collected in memory: every action but a rebuild (which streams) and a
    /// heap's. What bounds a call's memory, so it is reported. Over several
    /// slices: the largest.
    pub source_rows: Option<i64>,
    /// Slices this call applied (each with its MERGE and control row).
    pub slices: u32,
    /// Silver has not caught up with the stream: `apply.max_seconds` ended
    /// the call between two slices. Call apply again.
    pub more: bool,
}

impl ApplyResult {
    /// This call's result after slice `next` followed it: `next`'s position,
    /// state and control row, the rows of both, the largest source.
    fn followed_by(self, next: ApplyResult) -> ApplyResult {
        let mut waves_applied = self.waves_applied;
        waves_applied.extend(next.waves_applied.iter().copied());
        ApplyResult {
            rows_upserted: self.rows_upserted + next.rows_upserted,
            rows_deleted: self.rows_deleted + next.rows_deleted,
            silver_version: next.silver_version.or(self.silver_version),
            waves_applied,
            range_deletes: self.range_deletes || next.range_deletes,
            repaired: self.repaired || next.repaired,
            source_rows: self.source_rows.max(next.source_rows),
            slices: self.slices + next.slices,
            // A slice that found nothing left reports what the last one did.
            action: if next.seq.is_some() { next.action.clone() } else { self.action.clone() },
            seq: next.seq.or(self.seq),
            ..next
        }
    }
}

/// The key columns silver merges on: the capture instance's unique index,
/// the row identity SQL Server itself keeps (`index_column_list`).
/// `snapshot.keys` never decide it: they name the columns chunks are cut
/// on, which adr-0028 lets repeat, and keying silver on a repeated column
/// would keep one row per value. A capture instance without a unique index
/// is a heap (`heap`), which is not keyed at all.
///
/// A key that Delta holds inexactly is refused here, before anything is
/// written.
pub fn silver_keys(ctx: &Context) -> StepResult<Vec<ColumnDesc>> {
    let names = ctx.instance.index_columns.clone();
    if names.is_empty() {
        return Err(StepError::Internal(format!(
            "capture instance '{}' has no unique index: its silver is a heap's, not keyed",
            ctx.instance.name
        )));
    }
    let keys: Vec<ColumnDesc> = names
        .iter()
        .map(|k| {
            ctx.instance.column(k).cloned().ok_or_else(|| {
                StepError::Config(format!("key column '{k}' is not captured by capture instance '{}'", ctx.instance.name))
            })
        })
        .collect::<StepResult<_>>()?;
    // Silver tells rows apart by their key as Delta holds it: a key that
    // Delta rounds would merge distinct source rows into one, silently.
    if let Some((k, why)) = keys.iter().find_map(|k| k.sql_type.inexact_in_delta().map(|why| (k, why))) {
        return Err(StepError::Config(format!(
            "silver key column '{}' is {}: {why}, so two keys 100 ns apart would become one silver row. \
             Silver is keyed on the capture instance's unique index ('{}'): create a capture instance whose \
             @index_name names a unique index Delta holds exactly and pin it with table.capture_instance in {}, \
             or leave target.silver unset (bronze keeps every change row either way)",
            k.name,
            k.sql_type.sql_name(),
            ctx.instance.name,
            ctx.workflow.path.display()
        )));
    }
    Ok(keys)
}

/// Refuses, before `apply` writes anything, a keyed silver whose key can be
/// respelled in place while the stream reads no before-images
/// (`stream.row_filter = "all"` set by hand; `auto` reads them): the update
/// would add the new spelling and leave the old one beside it.
pub fn check_key_row_filter(ctx: &Context) -> StepResult<()> {
    if ctx.row_filter() == crate::source::RowFilter::All {
        if let Some((k, why)) = ctx.key_needing_before_images() {
            return Err(StepError::Config(format!(
                "silver key column '{}' is {}: {why}, and SQL Server logs an update that only respells a key as an \
                 update of that key, whose before-image alone names the spelling silver holds; but the stream reads \
                 updates without before-images (stream.row_filter = \"all\"): set stream.row_filter = \"all update old\" \
                 (or remove it: \"auto\" does this) in {} (bronze streamed without it needs a new snapshot, or a new bronze target)",
                k.name,
                k.sql_type.sql_name(),
                ctx.workflow.path.display()
            )));
        }
    }
    Ok(())
}

/// Opens (or creates) silver and its control table. Both are looked at
/// before either is created, so a bad target writes nothing.
pub async fn open_tables(ctx: &Context) -> StepResult<(DeltaTable, DeltaTable)> {
    let silver_loc = ctx.workflow.silver_location("apply")?;
    let control_loc = silver::control_location_for(&silver_loc);
    let silver_schema = silver_schema(ctx);
    let keys_property = if heap::is_heap(ctx) { None } else { Some(ctx.instance.index_columns.join(",")) };
    if let Some(mut t) = delta::open_existing(&silver_loc, &ctx.storage).await? {
        delta::check_kind_and_migrate(&mut t, &silver_loc, TableKind::Silver, &silver_schema).await?;
        check_shape(ctx, &t, &silver_loc)?;
        check_keys_property(ctx, &t, &silver_loc, keys_property.as_deref())?;
    }
    if let Some(mut t) = delta::open_existing(&control_loc, &ctx.storage).await? {
        delta::check_kind_and_migrate(&mut t, &control_loc, TableKind::Control, &control::schema()).await?;
    }
    let table = ctx.workflow.table_name();
    let extra: Vec<(&str, String)> = keys_property.iter().map(|k| (delta::PROP_SILVER_KEYS, k.clone())).collect();
    let s = delta::open_or_create_with(&silver_loc, &ctx.storage, TableKind::Silver, &silver_schema, &format!("mssql-cdc silver of {table}: the latest row per key"), &extra)
        .await?;
    let c = delta::open_or_create(&control_loc, &ctx.storage, TableKind::Control, &control::schema(), &format!("mssql-cdc silver control of {table}: a row per apply")).await?;
    Ok((s, c))
}

/// Silver gains the columns of the stream's capture instance it lacks (a
/// Delta schema change before the MERGE, which a rerun finds made). The
/// stream's instance is the one the rows this call applies were read under
/// (`engine::switch`): a column it added is NULL in every row silver holds,
/// as it is in bronze's images of those rows, until the rows that carry it
/// are merged. Columns an instance dropped stay, like bronze's.
pub async fn gain_added_columns(ctx: &Context, silver_table: &mut DeltaTable) -> StepResult<()> {
    let label = ctx.workflow.target.silver.clone().unwrap_or_default();
    let snapshot = silver_table.snapshot().map_err(StepError::delta(&label))?;
    let existing: Vec<String> = snapshot.schema().fields().map(|f| f.name().to_lowercase()).collect();
    let wanted = delta::commented_schema(TableKind::Silver, &silver_schema(ctx))?;
    let added: Vec<deltalake::kernel::StructField> = wanted.fields().filter(|f| !existing.contains(&f.name().to_lowercase())).cloned().collect();
    if added.is_empty() {
        return Ok(());
    }
    tracing::info!(columns = ?added.iter().map(|f| f.name().to_string()).collect::<Vec<_>>(), instance = %ctx.instance.name, "silver gains the columns the stream's capture instance added");
    *silver_table = silver_table.clone().add_columns().with_fields(added).await.map_err(StepError::delta(&label))?;
    Ok(())
}

/// Silver's schema for this capture instance: keyed, or a heap's multiset.
pub fn silver_schema(ctx: &Context) -> deltalake::arrow::datatypes::SchemaRef {
    if heap::is_heap(ctx) {
        silver::heap_schema(&ctx.instance.columns)
    } else {
        silver::schema(&ctx.instance.columns)
    }
}

/// Refuses a silver of the other shape (keyed for a heap, or the other way
/// round: built before heaps had their own, or the unique index came or went).
pub fn check_shape(ctx: &Context, table: &DeltaTable, location: &str) -> StepResult<()> {
    let snap = table.snapshot().map_err(StepError::delta(location))?;
    let found_heap = silver::is_heap_schema(&snap.snapshot().arrow_schema());
    let heap = heap::is_heap(ctx);
    if found_heap == heap {
        return Ok(());
    }
    let shape = |h: bool| if h { "a multiset of rows (a table without a unique index)" } else { "one row per key" };
    Err(StepError::Config(format!(
        "silver {location} holds {}, but capture instance '{}' needs {}: rebuild silver (delete {location} and its control table, then apply)",
        shape(found_heap),
        ctx.instance.name,
        shape(heap)
    )))
}

/// Refuses a keyed silver built on other key columns than the capture
/// instance's unique index: merging on new columns would never match the
/// rows it holds (duplicates), or merge rows it keeps apart. A silver from a
/// release that did not record its keys is accepted as it is.
fn check_keys_property(ctx: &Context, table: &DeltaTable, location: &str, wanted: Option<&str>) -> StepResult<()> {
    let snap = table.snapshot().map_err(StepError::delta(location))?;
    let found = snap.metadata().configuration().get(delta::PROP_SILVER_KEYS).cloned();
    match (found, wanted) {
        (Some(found), Some(wanted)) if !found.eq_ignore_ascii_case(wanted) => Err(StepError::Config(format!(
            "silver {location} is keyed on ({found}), but capture instance '{}' tells rows apart by its unique index ({wanted}): \
             rebuild silver (delete {location} and its control table, then apply), or point target.silver at a new location",
            ctx.instance.name
        ))),
        _ => Ok(()),
    }
}

/// This app id's control rows, oldest first.
pub async fn control_rows(table: &mut DeltaTable, app: &str) -> StepResult<Vec<ControlRow>> {
    table.update_state().await.map_err(StepError::delta(table.table_url().to_string()))?;
    let batches = delta::query(table, &format!("SELECT * FROM t WHERE app_id = {}", sql_str(app))).await?;
    let mut rows = control::from_batches(&batches)?;
    rows.sort_by_key(|r| r.seq);
    Ok(rows)
}

/// The newest control row of this app id.
pub async fn last_control(table: &mut DeltaTable, app: &str) -> StepResult<Option<ControlRow>> {
    Ok(control_rows(table, app).await?.pop())
}

/// `a`'s rank is above `b`'s (aliases of two relations with silver's rank columns).
fn rank_gt(a: &str, b: &str) -> String {
    format!(
        "({a}._start_lsn > {b}._start_lsn OR ({a}._start_lsn = {b}._start_lsn AND (COALESCE({a}._command_id, -1) > COALESCE({b}._command_id, -1) \
         OR (COALESCE({a}._command_id, -1) = COALESCE({b}._command_id, -1) AND (COALESCE({a}._seqval, '') > COALESCE({b}._seqval, '') \
         OR (COALESCE({a}._seqval, '') = COALESCE({b}._seqval, '') AND {a}._operation > {b}._operation))))))"
    )
}

/// The rank of `a` differs from `b`'s.
fn rank_ne(a: &str, b: &str) -> String {
    format!(
        "NOT ({a}._start_lsn = {b}._start_lsn AND COALESCE({a}._command_id, -1) = COALESCE({b}._command_id, -1) \
         AND COALESCE({a}._seqval, '') = COALESCE({b}._seqval, '') AND {a}._operation = {b}._operation)"
    )
}

/// The SQL over bronze (`t`) that gives the latest row per key among the rows `filter` keeps.
pub fn latest_per_key_sql(columns: &[ColumnDesc], keys: &[ColumnDesc], filter: &str) -> String {
    latest_per_key_over(columns, keys, &format!("t WHERE {filter}"))
}

/// Silver's columns (captured and rank), as a select list.
fn silver_select_list(columns: &[ColumnDesc]) -> String {
    columns.iter().map(|c| ident(&c.name)).chain(silver::META_COLUMNS.iter().map(|m| m.to_string())).collect::<Vec<_>>().join(", ")
}

/// The source of a wave's MERGE: the latest row per key among the waves'
/// chunk rows, every change after `after` (what silver applied; None: every
/// change), and the changes in (S, `after`] of the keys the chunk rows hold.
///
/// The last part is what makes a wave's cost follow its own size rather
/// than the snapshot's age (adr-0028: each chunk row is merged with the
/// changes after S *of its own key*). Silver keeps no tombstone, so a key
/// deleted after a chunk's stamp, and already removed from silver by an
/// earlier apply, would come back with its chunk row unless that delete is
/// in the same MERGE source to outrank it; changes of keys the chunk rows
/// do not hold were applied as they came, and earlier chunks' keys with
/// their own waves. Before, every wave read every change after S, of
/// every key, into memory: on a busy table that grew for the snapshot's
/// whole life. The three parts are disjoint (snapshot rows; changes after
/// `after`; changes at or before it), so the union adds no row twice; the
/// keys are matched null-safely as the MERGE matches them.
pub fn wave_source_sql(columns: &[ColumnDesc], keys: &[ColumnDesc], snapshot: Lsn, after: Option<Lsn>, to: Option<Lsn>, chunks: &[i64]) -> String {
    let lsn = |l: Lsn| sql_str(&l.to_hex());
    let upto = match to {
        Some(t) => format!(" AND {} <= {}", bronze::START_LSN, lsn(t)),
        None => String::new(),
    };
    let list = chunks.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ");
    let chunk_rows = |alias: &str| {
        if chunks.is_empty() {
            "FALSE".to_string()
        } else {
            format!(
                "({alias}{snap} = {s} AND {alias}{op} = 0 AND {alias}{chunk} IN ({list}))",
                snap = bronze::SNAPSHOT,
                op = bronze::OPERATION,
                chunk = bronze::CHUNK,
                s = lsn(snapshot),
            )
        }
    };
    let changes_after = match after {
        Some(a) => format!("({op} <> 0 AND {start} > {a}{upto})", op = bronze::OPERATION, start = bronze::START_LSN, a = lsn(a)),
        None => format!("({op} <> 0{upto})", op = bronze::OPERATION),
    };
    let cols = silver_select_list(columns);
    let mut relation = format!("SELECT {cols} FROM t WHERE {} OR {changes_after}", chunk_rows(""));
    if let Some(a) = after.filter(|a| *a > snapshot && !chunks.is_empty()) {
        relation.push_str(&format!(
            " UNION ALL SELECT {cols} FROM t AS b WHERE b.{op} <> 0 AND b.{start} > {s} AND b.{start} <= {a}{upto_b} \
             AND EXISTS (SELECT 1 FROM t AS c WHERE {rows} AND {on})",
            op = bronze::OPERATION,
            start = bronze::START_LSN,
            s = lsn(snapshot),
            a = lsn(a),
            upto_b = to.map(|t| format!(" AND b.{} <= {}", bronze::START_LSN, lsn(t))).unwrap_or_default(),
            rows = chunk_rows("c."),
            on = key_match_between(keys, "c", "b"),
        ));
    }
    latest_per_key_over(columns, keys, &format!("({relation}) AS u"))
}

/// The latest row per key of `relation` (a FROM clause over bronze's columns).
fn latest_per_key_over(columns: &[ColumnDesc], keys: &[ColumnDesc], relation: &str) -> String {
    let cols = silver_select_list(columns);
    let part: Vec<String> = keys.iter().map(|k| ident(&k.name)).collect();
    format!(
        "SELECT {cols} FROM (SELECT {cols}, ROW_NUMBER() OVER (PARTITION BY {part} ORDER BY {start} DESC, COALESCE({cmd}, -1) DESC, \
         COALESCE({seq}, '') DESC, {op} DESC) AS __rn FROM {relation}) AS ranked WHERE __rn = 1",
        part = part.join(", "),
        start = bronze::START_LSN,
        cmd = bronze::COMMAND_ID,
        seq = bronze::SEQVAL,
        op = bronze::OPERATION,
    )
}

/// The bronze rows an action reads, as a filter.
pub fn source_filter(action: &Action, to: Option<Lsn>, chunks: &[i64]) -> Option<String> {
    let lsn = |l: Lsn| sql_str(&l.to_hex());
    let upto = match to {
        Some(t) => format!(" AND {} <= {}", bronze::START_LSN, lsn(t)),
        None => String::new(),
    };
    let changes_after = |after: Option<Lsn>| match after {
        Some(a) => format!("({op} <> 0 AND {start} > {a}{upto})", op = bronze::OPERATION, start = bronze::START_LSN, a = lsn(a)),
        None => format!("({op} <> 0{upto})", op = bronze::OPERATION),
    };
    match action {
        Action::Nothing => None,
        Action::Rebuild { snapshot } => Some(format!(
            "({snap} = {s} AND {op} = 0) OR {changes}",
            snap = bronze::SNAPSHOT,
            op = bronze::OPERATION,
            s = lsn(*snapshot),
            changes = changes_after(Some(*snapshot)),
        )),
        Action::Waves { snapshot, after, .. } => {
            let list: Vec<String> = chunks.iter().map(|c| c.to_string()).collect();
            let chunk_rows = if list.is_empty() {
                "FALSE".to_string()
            } else {
                format!("({snap} = {s} AND {op} = 0 AND {chunk} IN ({list}))", snap = bronze::SNAPSHOT, op = bronze::OPERATION, chunk = bronze::CHUNK, s = lsn(*snapshot), list = list.join(", "))
            };
            Some(format!("{chunk_rows} OR {}", changes_after(*after)))
        }
        Action::Changes { after } => Some(changes_after(*after)),
    }
}

/// A SQL literal of a chunk bound on silver's key column, for a range delete;
/// None when the bound cannot be placed exactly (the range delete is then skipped).
/// A datetime2 bound below the microsecond: a lower one moves up a
/// microsecond and an upper one is truncated, so no chunk deletes the keys of
/// that microsecond (the rebuild at the completion does).
fn bound_literal(v: &SqlValue, ty: &SqlType, lower: bool) -> Option<String> {
    match (v, ty) {
        (SqlValue::Int(i), t) if t.is_integer() => Some(format!("CAST({i} AS BIGINT)")),
        (SqlValue::Date(d), SqlType::Date) => Some(format!("CAST('{}' AS DATE)", d.format("%Y-%m-%d"))),
        (SqlValue::DateTime(t), SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. }) => {
            let mut b = truncate_to_micros(*t);
            if lower && b != *t {
                b += chrono::Duration::microseconds(1);
            }
            Some(format!("CAST('{}' AS TIMESTAMP)", b.format("%Y-%m-%dT%H:%M:%S%.6f")))
        }
        _ => None,
    }
}

/// Whether range deletes may run: silver's key is the open's own, one
/// column, of an integer, date or timestamp type (ordered as SQL Server orders it).
pub fn range_deletes_allowed(keys: &[ColumnDesc], open_keys: &[String]) -> bool {
    keys.len() == 1
        && open_keys.len() == 1
        && keys[0].name.eq_ignore_ascii_case(&open_keys[0])
        && (keys[0].sql_type.is_integer() || matches!(keys[0].sql_type, SqlType::Date | SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. }))
}

/// The range delete predicate of a wave's chunks over silver (alias `target`):
/// the keys of `[lo, hi)` whose image is older than the chunk's stamp.
/// None when no chunk can be placed.
pub fn range_delete_predicate(key: &ColumnDesc, chunks: &[ChunkPayload]) -> Option<String> {
    let k = format!("target.{}", ident(&key.name));
    let mut parts = Vec::new();
    for c in chunks {
        let lo = match c.lo.as_ref().and_then(|l| l.first()) {
            None => format!("({k} IS NULL OR TRUE)"),
            Some(v) => match bound_literal(v, &key.sql_type, true) {
                Some(l) => format!("{k} >= {l}"),
                None => continue,
            },
        };
        let hi = match c.hi.as_ref().and_then(|h| h.first()) {
            None => "TRUE".to_string(),
            // An integer bound past BIGINT's range is open above.
            Some(SqlValue::Decimal { .. }) if key.sql_type.is_integer() => "TRUE".to_string(),
            Some(v) => match bound_literal(v, &key.sql_type, false) {
                Some(l) => format!("{k} < {l}"),
                None => continue,
            },
        };
        parts.push(format!("({lo} AND {hi} AND target._start_lsn < {})", sql_str(&c.stamp.to_hex())));
    }
    if parts.is_empty() {
        None
    } else {
        Some(parts.join(" OR "))
    }
}

/// Runs the MERGE of one decision. Returns (rows upserted, rows deleted,
/// silver version if committed, rows of the MERGE's source when it was
/// collected rather than streamed).
async fn merge(
    ctx: &Context,
    silver_table: &mut DeltaTable,
    keys: &[ColumnDesc],
    d: &Decision,
    chunks: &[ChunkPayload],
    range_deletes: bool,
) -> StepResult<(i64, i64, Option<i64>, Option<i64>)> {
    let chunk_ids: Vec<i64> = chunks.iter().map(|c| c.chunk).collect();
    let Some(filter) = source_filter(&d.action, d.to, &chunk_ids) else { return Ok((0, 0, None, None)) };
    let columns = &ctx.instance.columns;
    let sql = match &d.action {
        Action::Waves { snapshot, after, .. } => wave_source_sql(columns, keys, *snapshot, *after, d.to, &chunk_ids),
        _ => latest_per_key_sql(columns, keys, &filter),
    };
    let silver_label = ctx.workflow.target.silver.clone().unwrap_or_default();
    let rebuild = matches!(d.action, Action::Rebuild { .. });
    // A rebuild streams its source into the MERGE (it may be the whole table);
    // other sources are the changes since the last apply: collected first,
    // so an empty one costs no MERGE and the MERGE reads them once.
    let mut source_rows = None;
    let (source, state) = if rebuild {
        delta::dataframe(&ctx.bronze, &sql).await?
    } else {
        let batches = delta::query(&ctx.bronze, &sql).await?;
        let n: usize = batches.iter().map(|b| b.num_rows()).sum();
        source_rows = Some(n as i64);
        if n == 0 && !(range_deletes && !chunks.is_empty()) {
            return Ok((0, 0, None, source_rows));
        }
        let session = SessionContext::new();
        let schema = match batches.first() {
            Some(b) => b.schema(),
            None => delta::query(&ctx.bronze, &format!("{sql} LIMIT 0")).await?.first().map(|b| b.schema()).unwrap_or_else(|| silver::schema(columns)),
        };
        let mem = deltalake::datafusion::datasource::MemTable::try_new(schema, vec![batches])
            .map_err(|e| StepError::Internal(format!("apply's source: {e}")))?;
        let df = session.read_table(Arc::new(mem)).map_err(|e| StepError::Internal(format!("apply's source: {e}")))?;
        (df, session.state())
    };
    let on = key_match(keys);
    let all_cols: Vec<String> = columns.iter().map(|c| c.name.clone()).chain(silver::META_COLUMNS.iter().map(|m| m.to_string())).collect();
    let newer = if rebuild { rank_ne("source", "target") } else { rank_gt("source", "target") };
    let metadata = json!({
        "kind": "silver_apply",
        "seq": d.next.seq,
        "action": d.action,
        "to": d.to,
        "control": ControlRow { recorded_at: None, ..d.next.clone() },
        "chunks": chunk_ids,
        "range_deletes": range_deletes,
    });
    let props = delta::step_commit_properties(&txn_merge(&ctx.workflow.app_id, d.next.seq), metadata);
    let before = silver_table.version();
    let mut builder = silver_table
        .clone()
        .merge(source, on)
        .with_source_alias("source")
        .with_target_alias("target")
        .with_session_state(Arc::new(state))
        .with_writer_properties(delta::bounded_writer_properties())
        .with_commit_properties(props)
        .when_matched_delete(|del| del.predicate(format!("source._operation IN (1, 3) AND {newer}")))
        .map_err(StepError::delta(&silver_label))?
        .when_matched_update(|mut u| {
            u = u.predicate(format!("source._operation IN (0, 2, 4) AND {newer}"));
            for c in &all_cols {
                u = u.update(Column::new_unqualified(c.clone()), format!("source.{}", ident(c)));
            }
            u
        })
        .map_err(StepError::delta(&silver_label))?
        .when_not_matched_insert(|mut i| {
            i = i.predicate("source._operation IN (0, 2, 4)");
            for c in &all_cols {
                i = i.set(Column::new_unqualified(c.clone()), format!("source.{}", ident(c)));
            }
            i
        })
        .map_err(StepError::delta(&silver_label))?;
    if rebuild {
        builder = builder.when_not_matched_by_source_delete(|del| del).map_err(StepError::delta(&silver_label))?;
    } else if range_deletes {
        if let Some(key) = keys.first() {
            if let Some(p) = range_delete_predicate(key, chunks) {
                builder = builder.when_not_matched_by_source_delete(|del| del.predicate(p)).map_err(StepError::delta(&silver_label))?;
            }
        }
    }
    let (table, metrics) = builder.await.map_err(StepError::delta(&silver_label))?;
    *silver_table = table;
    let after = silver_table.version();
    let committed = if after != before { after.map(|v| v as i64) } else { None };
    Ok((
        (metrics.num_target_rows_inserted + metrics.num_target_rows_updated) as i64,
        metrics.num_target_rows_deleted as i64,
        committed,
        source_rows,
    ))
}

async fn append_control(table: &mut DeltaTable, row: &ControlRow) -> StepResult<Appended> {
    let meta = json!({
        "control": {"seq": row.seq, "action": row.action, "applied_lsn": row.applied_lsn, "snapshot_lsn": row.snapshot_lsn,
                    "open_snapshot_lsn": row.open_snapshot_lsn, "snapshot_wave": row.snapshot_wave, "finalized_until": row.finalized_until,
                    "rows_upserted": row.rows_upserted, "rows_deleted": row.rows_deleted},
        "app_id": row.app_id,
    });
    delta::append_batches(table, vec![control::to_batch(std::slice::from_ref(row))], control::schema(), &txn_control(&row.app_id, row.seq), meta).await
}

/// Writes the control row of a MERGE a crash left without one (from the
/// plan in the MERGE's commit metadata). Returns whether it did.
async fn repair(app: &str, silver_table: &mut DeltaTable, control_table: &mut DeltaTable, last: Option<&ControlRow>) -> StepResult<bool> {
    let seq = last.map(|c| c.seq + 1).unwrap_or(0);
    let found = delta::txn_version(silver_table, &format!("{app}#silver")).await?;
    if found.is_none_or(|v| v < seq) {
        return Ok(false);
    }
    let txn = txn_merge(app, seq);
    let (version, meta) = delta::find_txn_commit(silver_table, &txn).await?.ok_or_else(|| {
        StepError::NeedsPerson(format!(
            "silver holds apply {seq}'s MERGE (txn {}) but its commit is no longer in the log, and the control table has no row for it: \
             restore the control row, or rebuild silver (delete silver and its control table, then apply)",
            txn.app_id
        ))
    })?;
    let mut row: ControlRow = serde_json::from_value(meta.get("control").cloned().unwrap_or(Value::Null))
        .map_err(|e| StepError::Internal(format!("silver commit {version} carries no control plan: {e}")))?;
    row.silver_version = Some(version);
    row.recorded_at = Some(Utc::now());
    let mut detail = row.detail.take().unwrap_or_else(|| json!({}));
    detail["repaired"] = json!(true);
    row.detail = Some(detail);
    append_control(control_table, &row).await?;
    failpoint!("apply.after_control");
    tracing::info!(seq, silver_version = version, "wrote the control row of an apply that stopped after its MERGE");
    Ok(true)
}

/// The `apply` step: slices ([`SliceLimits`]) one after another until
/// silver has caught up with the stream or `apply.max_seconds` has passed
/// (the result then says `more`). Each slice is a whole apply of its own,
/// with its MERGE and its control row, so a crash between two slices loses
/// nothing and the rerun goes on from the last control row.
pub async fn run(ctx: &mut Context) -> StepResult<ApplyResult> {
    let started = std::time::Instant::now();
    let budget = std::time::Duration::from_secs(ctx.workflow.apply.max_seconds);
    let mut total: Option<ApplyResult> = None;
    loop {
        let r = run_one_slice(ctx).await?;
        let more = r.more;
        total = Some(match total.take() {
            None => r,
            Some(t) => t.followed_by(r),
        });
        if !more || started.elapsed() >= budget {
            break;
        }
    }
    Ok(total.expect("the loop runs once at least"))
}

/// One slice of [`run`].
async fn run_one_slice(ctx: &mut Context) -> StepResult<ApplyResult> {
    let mut repaired = false;
    for attempt in 0..3 {
        if let Some(mut result) = run_on_the_streams_instance(ctx, attempt, &mut repaired).await? {
            result.repaired = repaired;
            return Ok(result);
        }
    }
    Err(StepError::Temporary(
        "the stream moved to another capture instance three times while this apply read its state: call apply again".into(),
    ))
}

/// One attempt of [`run`]. Silver's columns and the MERGE's come from the
/// capture instance the stream is on, picked from the facts at the start;
/// a stream that switches to a newer instance before the facts are read
/// again (those the decision is made from) has committed rows of columns
/// the pick lacks, which this MERGE would leave out (NULL in silver, and
/// never mended: the next apply finds nothing new). So when those facts
/// name another instance, nothing is written and the call starts over
/// (None), on the instance they name. `repaired` is set when this attempt
/// wrote a control row an earlier call's crash left unwritten.
async fn run_on_the_streams_instance(ctx: &mut Context, attempt: u32, repaired_any: &mut bool) -> StepResult<Option<ApplyResult>> {
    let instances = super::switch::follow_stream(ctx).await?;
    let is_heap = heap::is_heap(ctx);
    let keys = if is_heap {
        heap::check_options(ctx)?;
        vec![]
    } else {
        check_key_row_filter(ctx)?;
        silver_keys(ctx)?
    };
    let app = ctx.workflow.app_id.clone();
    let (mut silver_table, mut control_table) = open_tables(ctx).await?;
    gain_added_columns(ctx, &mut silver_table).await?;
    let mut history = control_rows(&mut control_table, &app).await?;
    let repaired = repair(&app, &mut silver_table, &mut control_table, history.last()).await?;
    if repaired {
        *repaired_any = true;
        history = control_rows(&mut control_table, &app).await?;
    }
    let last = history.last().cloned();
    // Not a commit boundary (not in `FAILPOINTS`): a race test holds the
    // call here, after the instance is picked, while the stream switches
    // (tests/records_race.rs).
    failpoint!("apply.before_state");
    // Facts first, then the plans: a facts row read always finds its plans row.
    ctx.facts.update_state().await.map_err(StepError::delta(&ctx.workflow.target.facts))?;
    ctx.bronze.update_state().await.map_err(StepError::delta(&ctx.workflow.target.bronze))?;
    let facts = state::facts_rows(&ctx.facts, &app).await?;
    if ctx.workflow.table.capture_instance.is_none() {
        if let Some(recorded) = super::switch::recorded_instance(&facts) {
            // A name not listed when the call started may be an instance
            // created since: the first attempt looks again.
            let listed = instances.iter().any(|i| i.name.eq_ignore_ascii_case(&recorded));
            if !recorded.eq_ignore_ascii_case(&ctx.instance.name) && (attempt == 0 || listed) {
                tracing::info!(picked = %ctx.instance.name, now = %recorded, "the stream switched capture instance while apply read its state: starting over");
                return Ok(None);
            }
        }
    }
    let min_lsn = ctx.source.min_lsn(&ctx.instance.name).await?;
    // A heap's MERGE is not sliced: its changes are netted per row image
    // over what silver holds (`heap`), not per key.
    let limits = (!is_heap).then_some(SliceLimits { slice_rows: ctx.workflow.apply.slice_rows });
    let d = decide_with_cleanup(&app, last.as_ref(), &facts, min_lsn, limits);
    let mut chunks: Vec<ChunkPayload> = Vec::new();
    let mut range_deletes = false;
    if let Action::Waves { snapshot, waves, .. } = &d.action {
        // Not a commit boundary (not in `FAILPOINTS`): a race test holds the
        // call here, between its facts read and its plans read, while a wave
        // lands (tests/records_race.rs).
        failpoint!("apply.between_facts_and_plans");
        let prows = chunked::plan_rows_if_any(ctx, &app, *snapshot).await?;
        let wanted = waves_in_facts(&facts, *snapshot);
        for w in waves {
            for c in wanted.get(w).into_iter().flatten() {
                let row = prows.iter().find(|r| r.event == EVENT_SNAPSHOT_CHUNK && r.chunk == Some(*c) && r.wave == Some(*w)).ok_or_else(|| {
                    StepError::NeedsPerson(format!(
                        "the facts record chunk {c} of wave {w} of the snapshot at {snapshot}, but the plans table has no row for it: \
                         restore the plans table, or open a new snapshot"
                    ))
                })?;
                let p: ChunkPayload = serde_json::from_value(row.detail.clone()).map_err(|e| StepError::Internal(format!("chunk {c}'s plans row: {e}")))?;
                chunks.push(p);
            }
        }
        let open: Option<OpenPayload> =
            prows.iter().find(|r| r.event == EVENT_SNAPSHOT_OPEN).and_then(|r| serde_json::from_value(r.detail.clone()).ok());
        range_deletes = open.is_some_and(|o| range_deletes_allowed(&keys, &o.keys));
    }
    let mut result = ApplyResult {
        step: "apply",
        seq: None,
        action: d.next.action.clone(),
        applied_lsn: last.as_ref().and_then(|c| c.applied_lsn),
        rows_upserted: 0,
        rows_deleted: 0,
        silver_version: None,
        snapshot_state: "none",
        snapshot_lsn: last.as_ref().and_then(|c| c.snapshot_lsn),
        open_snapshot_lsn: last.as_ref().and_then(|c| c.open_snapshot_lsn),
        snapshot_wave: last.as_ref().and_then(|c| c.snapshot_wave),
        finalized_until: last.as_ref().and_then(|c| c.finalized_until),
        waves_applied: vec![],
        range_deletes,
        repaired,
        source_rows: None,
        slices: 0,
        more: false,
    };
    if d.action == Action::Nothing {
        result.action = "nothing".into();
        result.snapshot_state = snapshot_state(last.as_ref());
        return Ok(Some(result));
    }
    let (up, del, version, source_rows) = if is_heap {
        let ids: Vec<i64> = chunks.iter().map(|c| c.chunk).collect();
        let (up, del, version) = heap::merge(ctx, &mut silver_table, &d, &history, &facts, &ids).await?;
        (up, del, version, None)
    } else {
        merge(ctx, &mut silver_table, &keys, &d, &chunks, range_deletes).await?
    };
    result.source_rows = source_rows;
    failpoint!("apply.after_merge");
    let mut row = d.next.clone();
    row.rows_upserted = Some(up);
    row.rows_deleted = Some(del);
    row.silver_version = version;
    row.recorded_at = Some(Utc::now());
    if let Action::Waves { waves, .. } = &d.action {
        row.detail = Some(json!({"waves": waves, "chunks": chunks.iter().map(|c| c.chunk).collect::<Vec<_>>(), "range_deletes": range_deletes}));
        result.waves_applied = waves.clone();
    }
    append_control(&mut control_table, &row).await?;
    failpoint!("apply.after_control");
    tracing::info!(seq = row.seq, action = %row.action, upserted = up, deleted = del, applied = ?row.applied_lsn, "silver applied");
    result.seq = Some(row.seq);
    result.slices = 1;
    result.more = d.more;
    result.applied_lsn = row.applied_lsn;
    result.rows_upserted = up;
    result.rows_deleted = del;
    result.silver_version = version;
    result.snapshot_state = snapshot_state(Some(&row));
    result.snapshot_lsn = row.snapshot_lsn;
    result.open_snapshot_lsn = row.open_snapshot_lsn;
    result.snapshot_wave = row.snapshot_wave;
    result.finalized_until = row.finalized_until;
    Ok(Some(result))
}

fn snapshot_state(row: Option<&ControlRow>) -> &'static str {
    match row {
        Some(r) if r.open_snapshot_lsn.is_some() => "open",
        Some(r) if r.snapshot_lsn.is_some() => "complete",
        _ => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT};
    use crate::engine::rules::EVENT_STREAM_START;

    fn lsn(n: u128) -> Lsn {
        Lsn::from_u128(n)
    }

    fn event(gen: i32, name: &str, at: u128, detail: Option<Value>) -> FactRow {
        FactRow { app_id: "a".into(), generation: gen, event: Some(name.into()), min_lsn: Some(lsn(at)), max_lsn: Some(lsn(at)), detail, ..Default::default() }
    }

    fn batch(gen: i32, id: i64, to: u128) -> FactRow {
        FactRow { app_id: "a".into(), generation: gen, batch_id: Some(id), min_lsn: Some(lsn(to - 1)), max_lsn: Some(lsn(to)), ..Default::default() }
    }

    fn chunk(s: u128, c: i64, w: i64) -> FactRow {
        FactRow {
            app_id: "a".into(),
            event: Some(EVENT_SNAPSHOT_CHUNK.into()),
            min_lsn: Some(lsn(s + 1)),
            max_lsn: Some(lsn(s + 2)),
            detail: Some(json!({"snapshot": lsn(s).to_hex(), "chunk": c, "wave": w})),
            ..Default::default()
        }
    }

    fn control(seq: i64, applied: u128, snap: Option<u128>, open: Option<u128>, wave: Option<i64>, fin: Option<u128>) -> ControlRow {
        ControlRow {
            app_id: "a".into(),
            seq,
            applied_lsn: Some(lsn(applied)),
            snapshot_lsn: snap.map(lsn),
            open_snapshot_lsn: open.map(lsn),
            snapshot_wave: wave,
            finalized_until: fin.map(lsn),
            action: "changes".into(),
            ..Default::default()
        }
    }

    fn chunked_open(gen: i32, s: u128, kind: &str) -> FactRow {
        event(gen, EVENT_SNAPSHOT_OPEN, s, Some(json!({"mode": "chunked", "kind": kind})))
    }

    fn batch_of(gen: i32, id: i64, to: u128, rows: i64) -> FactRow {
        FactRow { rows: Some(rows), ..batch(gen, id, to) }
    }

    #[test]
    fn a_slice_ends_where_a_batch_ends_within_slice_rows_and_takes_one_batch_at_least() {
        let facts = vec![batch_of(0, 0, 10, 400), batch_of(0, 1, 20, 400), batch_of(0, 2, 30, 400), batch_of(0, 3, 40, 0), batch_of(0, 4, 50, 5000)];
        // 400 + 400 fit in 1000, the third batch would not.
        assert_eq!(decide::next_window_end(&facts, None, lsn(50), 1000), lsn(20));
        assert_eq!(decide::next_window_end(&facts, Some(lsn(20)), lsn(50), 1000), lsn(40), "an empty batch rides along");
        // A batch larger than a slice is a slice of its own.
        assert_eq!(decide::next_window_end(&facts, Some(lsn(40)), lsn(50), 1000), lsn(50));
        assert_eq!(decide::next_window_end(&facts, None, lsn(50), 10), lsn(10));
        // Everything fits: the slice is the whole lag.
        assert_eq!(decide::next_window_end(&facts, None, lsn(50), 1_000_000), lsn(50));
        // Two generations' batches ending at one LSN count together.
        let two = vec![batch_of(0, 0, 10, 400), batch_of(1, 0, 10, 400), batch_of(1, 1, 20, 100)];
        assert_eq!(decide::next_window_end(&two, None, lsn(20), 500), lsn(10));
    }

    #[test]
    fn changes_come_in_slices_that_move_the_applied_lsn_and_the_verdict_to_their_end() {
        let facts = vec![event(0, EVENT_STREAM_START, 5, None), batch_of(0, 0, 10, 400), batch_of(0, 1, 20, 400), batch_of(0, 2, 30, 400)];
        let limits = Some(decide::SliceLimits { slice_rows: 500 });
        let mut last: Option<ControlRow> = None;
        let mut ends = vec![];
        loop {
            let d = decide_with_cleanup("a", last.as_ref(), &facts, None, limits);
            if d.action == Action::Nothing {
                break;
            }
            assert!(matches!(d.action, Action::Changes { after } if after == last.as_ref().and_then(|c| c.applied_lsn)), "{d:?}");
            assert_eq!(d.next.applied_lsn, d.to, "{d:?}");
            assert_eq!(d.next.finalized_until, d.to, "no snapshot holds the verdict: {d:?}");
            assert_eq!(d.more, d.to != Some(lsn(30)), "{d:?}");
            ends.push(d.to.unwrap());
            last = Some(d.next);
        }
        assert_eq!(ends, vec![lsn(10), lsn(20), lsn(30)]);
        // Without limits (and with limits the lag fits in) it is one apply.
        let whole = decide_with_cleanup("a", None, &facts, None, None);
        assert_eq!((whole.to, whole.more), (Some(lsn(30)), false));
        assert_eq!(decide_with_cleanup("a", None, &facts, None, Some(decide::SliceLimits { slice_rows: 1200 })).to, Some(lsn(30)));
    }

    #[test]
    fn a_held_verdict_stays_where_it_was_while_changes_come_in_slices() {
        let facts = vec![chunked_open(0, 5, "bootstrap"), batch_of(0, 0, 10, 400), batch_of(0, 1, 20, 400)];
        let last = control(0, 5, None, Some(5), None, None);
        let d = decide_with_cleanup("a", Some(&last), &facts, None, Some(decide::SliceLimits { slice_rows: 500 }));
        assert_eq!((d.to, d.more, d.next.applied_lsn, d.next.finalized_until), (Some(lsn(10)), true, Some(lsn(10)), None), "{d:?}");
    }

    #[test]
    fn a_first_apply_after_a_bootstrap_rebuilds_from_it() {
        let facts = vec![event(0, EVENT_SNAPSHOT_OPEN, 10, Some(json!({"mode": "full"}))), event(0, EVENT_BOOTSTRAP, 10, None), batch(0, 0, 20)];
        let d = decide("a", None, &facts);
        assert_eq!(d.action, Action::Rebuild { snapshot: lsn(10) });
        assert_eq!(d.to, Some(lsn(20)));
        assert_eq!(d.next.seq, 0);
        assert_eq!(d.next.applied_lsn, Some(lsn(20)));
        assert_eq!(d.next.finalized_until, Some(lsn(20)));
        // The next call applies the changes after 20 only.
        let mut facts2 = facts.clone();
        facts2.push(batch(0, 1, 30));
        let d2 = decide("a", Some(&d.next), &facts2);
        assert_eq!(d2.action, Action::Changes { after: Some(lsn(20)) });
        assert_eq!(d2.next.seq, 1);
        assert_eq!(d2.next.applied_lsn, Some(lsn(30)));
        // And with nothing new, nothing at all.
        let d3 = decide("a", Some(&d2.next), &facts2);
        assert_eq!(d3.action, Action::Nothing);
    }

    #[test]
    fn a_stream_without_a_snapshot_applies_every_change() {
        let facts = vec![event(0, "stream_start", 5, None), batch(0, 0, 20)];
        let d = decide("a", None, &facts);
        assert_eq!(d.action, Action::Changes { after: None });
        assert_eq!(d.next.finalized_until, Some(lsn(20)));
    }

    #[test]
    fn a_resnapshot_rebuilds_and_deletes_by_absence() {
        let facts = vec![event(0, EVENT_BOOTSTRAP, 10, None), batch(0, 0, 20), event(1, EVENT_RESNAPSHOT, 50, None), batch(1, 0, 60)];
        let last = control(3, 20, Some(10), None, None, Some(20));
        let d = decide("a", Some(&last), &facts);
        assert_eq!(d.action, Action::Rebuild { snapshot: lsn(50) });
        assert_eq!(d.next.snapshot_lsn, Some(lsn(50)));
        assert_eq!(d.next.applied_lsn, Some(lsn(60)));
        assert_eq!(d.next.seq, 4);
    }

    /// A reseed whose copy is older than what silver applied: no rebuild
    /// until the new generation's stream has read past silver's applied LSN,
    /// then a rebuild up to that position, so no change in between is lost
    /// (torture seed 120010174: the rebuild ran at once, silver held the copy
    /// alone, the control row kept the older applied LSN, and the changes in
    /// between were never applied).
    #[test]
    fn a_reseed_older_than_silver_waits_for_the_stream_then_rebuilds() {
        let mut facts = vec![event(0, EVENT_BOOTSTRAP, 20, None), batch(0, 0, 51), batch(0, 1, 55)];
        let last = control(1, 55, Some(20), None, None, Some(55));
        facts.push(event(1, EVENT_RESNAPSHOT, 43, None));
        let d = decide("a", Some(&last), &facts);
        assert_eq!(d.action, Action::Nothing, "the new generation stands at 43, silver applied 55: {d:?}");
        facts.push(batch(1, 0, 50));
        assert_eq!(decide("a", Some(&last), &facts).action, Action::Nothing, "still below 55");
        facts.push(batch(1, 1, 56));
        let d = decide("a", Some(&last), &facts);
        assert_eq!(d.action, Action::Rebuild { snapshot: lsn(43) });
        assert_eq!((d.to, d.next.applied_lsn, d.next.snapshot_lsn), (Some(lsn(56)), Some(lsn(56)), Some(lsn(43))));
    }

    #[test]
    fn waves_are_applied_as_they_arrive_and_the_verdict_is_held() {
        let mut facts = vec![chunked_open(0, 10, "bootstrap"), batch(0, 0, 20), chunk(10, 0, 0), chunk(10, 1, 0)];
        let d = decide("a", None, &facts);
        assert_eq!(d.action, Action::Waves { snapshot: lsn(10), waves: vec![0], after: None });
        assert_eq!(d.next.open_snapshot_lsn, Some(lsn(10)));
        assert_eq!(d.next.snapshot_wave, Some(0));
        assert_eq!(d.next.finalized_until, None, "held while the snapshot is open");
        // The same wave is not applied twice; changes go on.
        facts.push(batch(0, 1, 30));
        let d2 = decide("a", Some(&d.next), &facts);
        assert_eq!(d2.action, Action::Changes { after: Some(lsn(20)) });
        assert_eq!(d2.next.snapshot_wave, Some(0));
        assert_eq!(d2.next.finalized_until, None);
        facts.push(chunk(10, 2, 1));
        let d3 = decide("a", Some(&d2.next), &facts);
        // A new wave: with the changes silver has not applied; its chunk
        // rows' own keys' changes after S are joined in by the MERGE's source.
        assert_eq!(d3.action, Action::Waves { snapshot: lsn(10), waves: vec![1], after: Some(lsn(30)) });
        // The completion: a rebuild from S, and the verdict moves.
        facts.push(event(0, EVENT_BOOTSTRAP, 10, None));
        let d4 = decide("a", Some(&d3.next), &facts);
        assert_eq!(d4.action, Action::Rebuild { snapshot: lsn(10) });
        assert_eq!(d4.next.open_snapshot_lsn, None);
        assert_eq!(d4.next.finalized_until, Some(lsn(30)));
    }

    #[test]
    fn a_chunked_resnapshot_holds_the_verdict_where_it_was() {
        let facts = vec![event(0, EVENT_BOOTSTRAP, 10, None), batch(0, 0, 20), chunked_open(1, 40, "resnapshot"), batch(1, 0, 45), chunk(40, 0, 0)];
        let last = control(2, 20, Some(10), None, None, Some(20));
        let d = decide("a", Some(&last), &facts);
        assert_eq!(d.action, Action::Waves { snapshot: lsn(40), waves: vec![0], after: Some(lsn(20)) });
        assert_eq!(d.next.finalized_until, Some(lsn(20)), "held at its value before the open");
        assert_eq!(d.next.applied_lsn, Some(lsn(45)));
    }

    #[test]
    fn keys_match_null_safely_where_they_may_be_null() {
        let id = ColumnDesc::new("id", SqlType::Int, false);
        let code = ColumnDesc::new("co\"de", SqlType::NVarChar { len: Some(10) }, true);
        assert_eq!(
            key_match(&[id, code]),
            "target.\"id\" = source.\"id\" AND COALESCE(target.\"co\"\"de\", '') = COALESCE(source.\"co\"\"de\", '') \
             AND (target.\"co\"\"de\" IS NULL) = (source.\"co\"\"de\" IS NULL)"
        );
    }

    #[test]
    fn range_deletes_only_on_one_ordered_key_that_is_the_opens() {
        let id = ColumnDesc::new("id", SqlType::Int, false);
        let name = ColumnDesc::new("name", SqlType::NVarChar { len: Some(10) }, false);
        let ts = ColumnDesc::new("at", SqlType::DateTime2 { scale: 7 }, false);
        assert!(range_deletes_allowed(std::slice::from_ref(&id), &["ID".into()]));
        assert!(range_deletes_allowed(std::slice::from_ref(&ts), &["at".into()]));
        assert!(!range_deletes_allowed(&[id.clone(), name.clone()], &["id".into(), "name".into()]), "composite");
        assert!(!range_deletes_allowed(std::slice::from_ref(&name), &["name".into()]), "string");
        assert!(!range_deletes_allowed(std::slice::from_ref(&id), &["other".into()]), "not the open's key");
    }

    #[test]
    fn range_delete_bounds_follow_the_microsecond_and_bigint_rules() {
        let ts = ColumnDesc::new("at", SqlType::DateTime2 { scale: 7 }, false);
        let t = chrono::NaiveDate::from_ymd_opt(2026, 1, 2).unwrap().and_hms_nano_opt(3, 4, 5, 123_456_700).unwrap();
        let c = ChunkPayload {
            chunk: 1,
            wave: 0,
            lo: Some(vec![SqlValue::DateTime(t)]),
            hi: Some(vec![SqlValue::DateTime(t + chrono::Duration::seconds(1))]),
            last: false,
            rows: 0,
            stamp: lsn(7),
            max_lsn: lsn(8),
            read_ms: None,
            read_bytes: None,
            rounds: 1,
            bronze_version: None,
            fence: None,
        };
        let p = range_delete_predicate(&ts, std::slice::from_ref(&c)).unwrap();
        assert!(p.contains(">= CAST('2026-01-02T03:04:05.123457' AS TIMESTAMP)"), "a lower bound inside a microsecond moves up: {p}");
        assert!(p.contains("< CAST('2026-01-02T03:04:06.123456' AS TIMESTAMP)"), "an upper one is truncated: {p}");
        let id = ColumnDesc::new("id", SqlType::BigInt, false);
        let last = ChunkPayload { lo: Some(vec![SqlValue::Int(100)]), hi: Some(vec![SqlValue::Decimal { value: i64::MAX as i128 + 1, scale: 0 }]), ..c.clone() };
        let p = range_delete_predicate(&id, &[last]).unwrap();
        assert!(p.contains(">= CAST(100 AS BIGINT) AND TRUE"), "past BIGINT's max is open: {p}");
        let first = ChunkPayload { lo: None, hi: Some(vec![SqlValue::Int(5)]), ..c };
        let p = range_delete_predicate(&id, &[first]).unwrap();
        assert!(p.contains("IS NULL") && p.contains("< CAST(5 AS BIGINT)"), "{p}");
    }

    // Tests that close UNTESTED rows of docs/CONFORMANCE.md (18.31, 18.51, 18.52, 28.7).

    #[test]
    fn finalized_until_never_goes_back_when_a_new_generation_starts_below_it() {
        // 18.31. A reseed's generation 1 starts at L = 60, below what silver applied (100): catches the verdict
        // set to the new generation's position (`to`) instead of `to.max(applied)` (60, then 80). The rebuild
        // itself waits until the new generation has read past 100 (it would otherwise hold the changes up to
        // 60 only, under a control row that says 100), so no control row is written before.
        let mut facts = vec![event(0, EVENT_BOOTSTRAP, 10, None), batch(0, 0, 40), batch(0, 1, 70), batch(0, 2, 100), event(1, EVENT_RESNAPSHOT, 60, None)];
        let last = control(5, 100, Some(10), None, None, Some(100));
        let d1 = decide("a", Some(&last), &facts);
        assert_eq!(d1.action, Action::Nothing);
        // Generation 1 streams to 80, still below: nothing moves back, nothing is rebuilt.
        facts.push(batch(1, 0, 80));
        let d2 = decide("a", Some(&last), &facts);
        assert_eq!(d2.action, Action::Nothing);
        // Past it, the rebuild, and the verdict moves on with it.
        facts.push(batch(1, 1, 120));
        let d3 = decide("a", Some(&last), &facts);
        assert_eq!(d3.action, Action::Rebuild { snapshot: lsn(60) });
        assert_eq!((d3.next.applied_lsn, d3.next.finalized_until), (Some(lsn(120)), Some(lsn(120))));
    }

    #[test]
    fn apply_and_its_verdict_take_no_notice_of_a_skipped_range() {
        // 18.51, 18.52. Catches a verdict held at a skip (at its start 20, or its end 35) or a batch carrying a
        // `data_skipped` row left out of the changes: the decision is the one without the skip row.
        let mut skip = event(0, crate::delta::facts::EVENT_DATA_SKIPPED, 35, Some(json!({"from": lsn(21), "to": lsn(35), "certain": true})));
        skip.batch_id = Some(1);
        skip.rows = Some(0);
        let without = vec![event(0, EVENT_BOOTSTRAP, 10, None), batch(0, 0, 20), batch(0, 1, 40)];
        let mut with = without.clone();
        with.push(skip);
        let last = control(3, 20, Some(10), None, None, Some(20));
        let d = decide("a", Some(&last), &with);
        assert_eq!(d.action, Action::Changes { after: Some(lsn(20)) });
        assert_eq!(d.to, Some(lsn(40)));
        assert_eq!((d.next.applied_lsn, d.next.finalized_until), (Some(lsn(40)), Some(lsn(40))));
        assert_eq!(d, decide("a", Some(&last), &without));
    }

    /// A rank: (_start_lsn, _command_id, _seqval, _operation).
    type Rank = (u128, Option<i32>, Option<&'static str>, i32);

    /// Whether `rank_gt("a", "b")` holds for one row `a` and one row `b`, evaluated by DataFusion.
    async fn outranks(a: Rank, b: Rank) -> bool {
        use deltalake::arrow::array::{Array, ArrayRef, Int32Array, Int64Array, StringArray};
        use deltalake::arrow::datatypes::{DataType, Field, Schema};
        use deltalake::arrow::record_batch::RecordBatch;
        let schema = Arc::new(Schema::new(vec![
            Field::new(bronze::START_LSN, DataType::Utf8, true),
            Field::new(bronze::COMMAND_ID, DataType::Int32, true),
            Field::new(bronze::SEQVAL, DataType::Utf8, true),
            Field::new(bronze::OPERATION, DataType::Int32, true),
        ]));
        let row = |r: Rank| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from(vec![Some(lsn(r.0).to_hex())])) as ArrayRef,
                    Arc::new(Int32Array::from(vec![r.1])) as ArrayRef,
                    Arc::new(StringArray::from(vec![r.2])) as ArrayRef,
                    Arc::new(Int32Array::from(vec![Some(r.3)])) as ArrayRef,
                ],
            )
            .unwrap()
        };
        let session = SessionContext::new();
        session.register_batch("a", row(a)).unwrap();
        session.register_batch("b", row(b)).unwrap();
        let sql = format!("SELECT COUNT(*) AS n FROM a CROSS JOIN b WHERE {}", rank_gt("a", "b"));
        let out = session.sql(&sql).await.unwrap().collect().await.unwrap();
        out[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0) == 1
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_at_a_chunks_stamp_outranks_the_chunks_image_with_or_without_a_command_id() {
        // 28.7. A chunk stamped L may read a row a commit at L made; its change row (same LSN) must win the MERGE.
        // Catches the COALESCE to -1 dropped or changed (a NULL command id compares as unknown, or an image's NULL
        // ranks above a change's 1), a NULL seqval not ranked below a change's, or the order of the four reversed.
        const SEQ: &str = "0x0000002a000000070003";
        let image = (7, None, None, 0);
        let old_change = (7, None, Some(SEQ), 2); // a change table without __$command_id
        let change = (7, Some(1), Some(SEQ), 4);
        assert!(outranks(old_change, image).await);
        assert!(outranks(change, image).await);
        assert!(!outranks(image, old_change).await);
        assert!(!outranks(image, change).await);
        // Equal ranks replace nothing; a later LSN outranks whatever the rest.
        assert!(!outranks(image, image).await);
        assert!(!outranks(change, change).await);
        assert!(outranks((8, None, None, 0), change).await);
        assert!(!outranks(change, (8, None, None, 0)).await);
        // Within one LSN: command id, then seqval, then operation (an update's 4 over its 3).
        assert!(outranks((7, Some(2), Some("0x0000002a000000070001"), 2), change).await);
        assert!(outranks((7, Some(1), Some("0x0000002a000000070004"), 1), change).await);
        assert!(outranks((7, Some(1), Some(SEQ), 4), (7, Some(1), Some(SEQ), 3)).await);
    }
}
