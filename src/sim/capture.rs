//! The capture job and cleanup, as free functions on a connection (the
//! source runs them on its own connections): moving due transactions from
//! the pending log into the change tables and `lsn_time_mapping`, idle
//! mapping rows, automatic and explicit cleanup, taking armed faults, and
//! their reports ([`CaptureReport`], [`CleanupReport`]).

use std::collections::HashMap;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};

use crate::lsn::Lsn;
use crate::types::{ColumnDesc, SqlType, SqlValue};

use super::config::{FaultOn, Result, SimConfig, SimError, SqlCtx};
use super::meta::TableMeta;
use super::store::{
    alloc_lsns, load_config, load_instances, load_tables, local_ticks, lsn_from_blob, max_lsn, meta_i64, meta_set, now_us, TICKS_PER_SEC,
};
use super::tx::{Image, PendingOp};

#[cfg(doc)]
use super::SimDb;

/// What one capture scan did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CaptureReport {
    /// Committed transactions harvested from the pending log.
    pub transactions: u64,
    /// Change rows written, all instances together.
    pub change_rows: u64,
    /// Mapping rows written (one per transaction that touched a captured table, plus idle rows).
    pub mapping_rows: u64,
    pub idle_rows: u64,
    /// Transactions still waiting (committed less than the capture lag ago).
    pub pending_left: u64,
    pub max_lsn: Option<Lsn>,
    pub cleanup: Option<CleanupReport>,
}

/// What one cleanup did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CleanupReport {
    /// The low watermark applied (None when the mapping is empty).
    pub watermark: Option<Lsn>,
    /// (instance, start_lsn before, start_lsn after).
    pub instances: Vec<(String, Option<Lsn>, Option<Lsn>)>,
    pub change_rows_deleted: u64,
    pub mapping_rows_deleted: u64,
}

/// Whether a capture scan has anything to do now (a cheap read, no write lock).
pub(crate) fn capture_due(conn: &Connection, path: &Path, cfg: &SimConfig) -> Result<bool> {
    let now = now_us(conn, path, cfg)?;
    let cutoff = now - (cfg.capture_lag_ms as i64) * 1000;
    let eligible: bool = conn
        .query_row("SELECT EXISTS(SELECT 1 FROM pending WHERE commit_us <= ?1)", [cutoff], |r| r.get(0))
        .ctx(path)?;
    if eligible {
        return Ok(true);
    }
    if cfg.idle_interval_seconds > 0 && idle_due(conn, path, cfg, now)? {
        return Ok(true);
    }
    if let Some(m) = cfg.auto_cleanup_interval_minutes {
        // The first interval counts from the first capture scan that saw the setting.
        let last = meta_i64(conn, path, "last_cleanup_us")?.unwrap_or(now);
        let any_instance: bool = conn.query_row("SELECT EXISTS(SELECT 1 FROM instances)", [], |r| r.get(0)).ctx(path)?;
        if any_instance && now - last >= (m as i64) * 60_000_000 {
            return Ok(true);
        }
    }
    Ok(false)
}

fn idle_due(conn: &Connection, path: &Path, cfg: &SimConfig, now: i64) -> Result<bool> {
    let (pending, instances): (i64, i64) = conn
        .query_row("SELECT (SELECT count(*) FROM pending), (SELECT count(*) FROM instances)", [], |r| Ok((r.get(0)?, r.get(1)?)))
        .ctx(path)?;
    if pending > 0 || instances == 0 {
        return Ok(false);
    }
    let last = meta_i64(conn, path, "last_mapping_us")?.unwrap_or(i64::MIN / 2);
    Ok(now - last >= (cfg.idle_interval_seconds as i64) * 1_000_000)
}

/// Runs a capture scan if one is due; returns its report (None when idle).
pub(crate) fn capture_if_due(conn: &mut Connection, path: &Path) -> Result<Option<CaptureReport>> {
    let cfg = load_config(conn, path)?;
    if !capture_due(conn, path, &cfg)? {
        return Ok(None);
    }
    capture_conn(conn, path).map(Some)
}

/// The capture job: one scan in one SQLite transaction.
pub(crate) fn capture_conn(conn: &mut Connection, path: &Path) -> Result<CaptureReport> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
    let cfg = load_config(&tx, path)?;
    // Commit times are the server's wall clock: its rules, whatever zone it reports.
    let zone = cfg.clock_zone()?;
    let now = now_us(&tx, path, &cfg)?;
    let cutoff = now - (cfg.capture_lag_ms as i64) * 1000;
    let tables: HashMap<i64, TableMeta> = load_tables(&tx, path)?.into_iter().map(|t| (t.id, t)).collect();
    let instances = load_instances(&tx, path, None)?;
    let mut report = CaptureReport::default();

    let pend: Vec<(Vec<u8>, Vec<u8>, i64, i64, String)> = {
        let mut st = tx
            .prepare("SELECT commit_lsn, begin_lsn, begin_us, commit_us, ops FROM pending ORDER BY commit_lsn")
            .ctx(path)?;
        let v = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
            .ctx(path)?
            .collect::<rusqlite::Result<Vec<_>>>()
            .ctx(path)?;
        v
    };
    {
        let mut ins_change = tx
            .prepare_cached("INSERT INTO changes(instance_id, start_lsn, command_id, seqval, operation, data) VALUES (?1, ?2, ?3, ?4, ?5, ?6)")
            .ctx(path)?;
        let mut ins_map = tx
            .prepare_cached("INSERT INTO lsn_time_mapping(start_lsn, tran_begin_ticks, tran_end_ticks, tran_id, tran_begin_lsn) VALUES (?1, ?2, ?3, ?4, ?5)")
            .ctx(path)?;
        let mut del_pending = tx.prepare_cached("DELETE FROM pending WHERE commit_lsn = ?1").ctx(path)?;
        for (commit_lsn, begin_lsn, begin_us, commit_us, ops) in pend {
            // Harvest in LSN order and stop at the first transaction still inside the
            // lag, so every LSN up to max LSN is complete.
            if commit_us > cutoff {
                report.pending_left += 1;
                continue;
            }
            if report.pending_left > 0 {
                report.pending_left += 1;
                continue;
            }
            let commit = lsn_from_blob(commit_lsn.clone())?;
            let ops: Vec<PendingOp> = serde_json::from_str(&ops).map_err(|e| SimError::Corrupt(format!("pending ops: {e}")))?;
            let mut rows = 0u64;
            for op in &ops {
                if !tables.contains_key(&op.table_id) {
                    continue;
                }
                for inst in instances.iter().filter(|i| i.table_id == op.table_id && commit > i.created_lsn) {
                    let image = |img: &Option<Image>, operation: i32, other: Option<&Image>| -> String {
                        let vals: Vec<SqlValue> = inst
                            .info
                            .columns
                            .iter()
                            .zip(&inst.column_ids)
                            .map(|(c, id)| lob_rule(c, *id, operation, img.as_ref(), other))
                            .collect();
                        serde_json::to_string(&vals).expect("values serialise")
                    };
                    let mut emit = |operation: i32, data: String| -> Result<()> {
                        ins_change
                            .execute(params![inst.id, commit_lsn, op.command_id, op.seqval.0.to_vec(), operation, data])
                            .ctx(path)?;
                        rows += 1;
                        Ok(())
                    };
                    match op.kind {
                        1 => emit(1, image(&op.before, 1, None))?,
                        2 => emit(2, image(&op.after, 2, None))?,
                        _ if op.key_changed => {
                            emit(1, image(&op.before, 1, None))?;
                            emit(2, image(&op.after, 2, None))?;
                        }
                        _ => {
                            emit(3, image(&op.before, 3, op.after.as_ref()))?;
                            emit(4, image(&op.after, 4, None))?;
                        }
                    }
                }
            }
            if rows > 0 {
                let begin = lsn_from_blob(begin_lsn)?;
                ins_map
                    .execute(params![
                        commit_lsn,
                        local_ticks(&zone, begin_us),
                        local_ticks(&zone, commit_us),
                        begin.0.to_vec(),
                        begin.0.to_vec()
                    ])
                    .ctx(path)?;
                report.mapping_rows += 1;
                meta_set(&tx, path, "last_mapping_us", &commit_us.to_string())?;
            }
            del_pending.execute([commit_lsn]).ctx(path)?;
            report.transactions += 1;
            report.change_rows += rows;
        }
    }
    if report.transactions == 0 && cfg.idle_interval_seconds > 0 && idle_due(&tx, path, &cfg, now)? {
        let l = Lsn::from_u128(alloc_lsns(&tx, path, 1)?);
        let ticks = local_ticks(&zone, now);
        tx.execute(
            "INSERT INTO lsn_time_mapping(start_lsn, tran_begin_ticks, tran_end_ticks, tran_id, tran_begin_lsn) VALUES (?1, ?2, ?2, x'00', NULL)",
            params![l.0.to_vec(), ticks],
        )
        .ctx(path)?;
        meta_set(&tx, path, "last_mapping_us", &now.to_string())?;
        report.idle_rows += 1;
        report.mapping_rows += 1;
    }
    if let Some(m) = cfg.auto_cleanup_interval_minutes {
        let last = match meta_i64(&tx, path, "last_cleanup_us")? {
            Some(l) => l,
            None => {
                meta_set(&tx, path, "last_cleanup_us", &now.to_string())?;
                now
            }
        };
        if !instances.is_empty() && now - last >= (m as i64) * 60_000_000 {
            report.cleanup = Some(cleanup_tx(&tx, path, &cfg, None, None)?);
            meta_set(&tx, path, "last_cleanup_us", &now.to_string())?;
        }
    }
    report.max_lsn = max_lsn(&tx, path)?;
    tx.commit().ctx(path)?;
    Ok(report)
}

/// The value a change row holds for a captured column (`c`, whose source
/// column id is `column_id`), with SQL Server's LOB rules: text/ntext/image
/// are NULL in deletes and before-images; the (max) types are NULL in
/// before-images unless the update changed them. The value is found by the
/// column's id, as SQL Server's capture maps columns, so a renamed column is
/// captured under the instance's name for it; a column the image lacks
/// (dropped since, even if another column took its name) is NULL.
fn lob_rule(c: &ColumnDesc, column_id: Option<i64>, operation: i32, img: Option<&Image>, after: Option<&Image>) -> SqlValue {
    let get = |img: Option<&Image>| {
        img.zip(column_id)
            .and_then(|(v, id)| v.iter().find(|(i, _)| *i == id).map(|(_, v)| v.clone()))
            .unwrap_or(SqlValue::Null)
    };
    let old_lob = matches!(c.sql_type, SqlType::Text | SqlType::NText | SqlType::Image);
    let max_lob = matches!(
        c.sql_type,
        SqlType::VarChar { len: None } | SqlType::NVarChar { len: None } | SqlType::VarBinary { len: None } | SqlType::Xml
    );
    if old_lob && (operation == 1 || operation == 3) {
        return SqlValue::Null;
    }
    let v = get(img);
    if max_lob && operation == 3 && after.is_some() && get(after) == v {
        return SqlValue::Null;
    }
    v
}

/// Cleanup inside an open write transaction. `to_lsn` forces the watermark.
pub(super) fn cleanup_tx(conn: &Connection, path: &Path, cfg: &SimConfig, retention: Option<u64>, to_lsn: Option<Lsn>) -> Result<CleanupReport> {
    let mut report = CleanupReport::default();
    let wm: Option<Lsn> = match to_lsn {
        Some(l) => Some(l),
        None => {
            let max_end: Option<i64> = conn.query_row("SELECT max(tran_end_ticks) FROM lsn_time_mapping", [], |r| r.get(0)).ctx(path)?;
            match max_end {
                None => None,
                Some(max_end) => {
                    let ret = retention.unwrap_or(cfg.retention_minutes) as i64;
                    let wm_ticks = max_end.saturating_sub(ret.saturating_mul(60 * TICKS_PER_SEC));
                    let b: Option<Vec<u8>> = conn
                        .query_row("SELECT min(start_lsn) FROM lsn_time_mapping WHERE tran_end_ticks >= ?1", [wm_ticks], |r| r.get(0))
                        .ctx(path)?;
                    b.map(lsn_from_blob).transpose()?
                }
            }
        }
    };
    report.watermark = wm;
    let Some(wm) = wm else { return Ok(report) };
    let instances = load_instances(conn, path, None)?;
    let mut lowest: Option<Lsn> = None;
    for inst in &instances {
        let old = inst.info.start_lsn;
        let new = match old {
            Some(s) if s >= wm => s,
            _ => wm,
        };
        if old != Some(new) {
            conn.execute("UPDATE instances SET start_lsn = ?2 WHERE id = ?1", params![inst.id, new.0.to_vec()]).ctx(path)?;
        }
        let n = conn
            .execute("DELETE FROM changes WHERE instance_id = ?1 AND start_lsn < ?2", params![inst.id, new.0.to_vec()])
            .ctx(path)?;
        report.change_rows_deleted += n as u64;
        report.instances.push((inst.info.name.clone(), old, Some(new)));
        lowest = Some(lowest.map_or(new, |l: Lsn| l.min(new)));
    }
    if let Some(low) = lowest {
        let n = conn.execute("DELETE FROM lsn_time_mapping WHERE start_lsn < ?1", [low.0.to_vec()]).ctx(path)?;
        report.mapping_rows_deleted = n as u64;
    }
    Ok(report)
}

/// Takes one matching fault, if any is armed: the rows the read may deliver before failing.
pub(crate) fn take_fault(conn: &mut Connection, path: &Path, on: FaultOn) -> Result<Option<(u64, Option<u32>)>> {
    let armed: bool = conn.query_row("SELECT EXISTS(SELECT 1 FROM faults WHERE remaining > 0)", [], |r| r.get(0)).ctx(path)?;
    if !armed {
        return Ok(None);
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
    let f: Option<(i64, i64, Option<i64>)> = tx
        .query_row(
            "SELECT id, after_rows, error_number FROM faults WHERE remaining > 0 AND (on_kind = ?1 OR on_kind = 'any') ORDER BY id LIMIT 1",
            [on.as_str()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()
        .ctx(path)?;
    if let Some((id, _, _)) = f {
        tx.execute("UPDATE faults SET remaining = remaining - 1 WHERE id = ?1", [id]).ctx(path)?;
    }
    tx.commit().ctx(path)?;
    Ok(f.map(|(_, n, e)| (n.max(0) as u64, e.map(|e| e as u32))))
}

/// Runs an armed cleanup-before-change-read (see
/// [`SimDb::cleanup_before_next_change_read`]): cleanup to the max LSN.
pub(crate) fn take_cleanup_before_changes(conn: &mut Connection, path: &Path) -> Result<bool> {
    let armed: bool = conn
        .query_row("SELECT EXISTS(SELECT 1 FROM faults WHERE remaining > 0 AND on_kind = 'cleanup_before_changes')", [], |r| r.get(0))
        .ctx(path)?;
    if !armed {
        return Ok(false);
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
    tx.execute("UPDATE faults SET remaining = remaining - 1 WHERE on_kind = 'cleanup_before_changes' AND remaining > 0", []).ctx(path)?;
    let cfg = load_config(&tx, path)?;
    if let Some(max) = max_lsn(&tx, path)? {
        cleanup_tx(&tx, path, &cfg, None, Some(max))?;
    }
    tx.commit().ctx(path)?;
    Ok(true)
}
