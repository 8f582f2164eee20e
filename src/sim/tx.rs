//! Writes and the pending transaction log: [`SimTx`], a write transaction's
//! operations on the source tables, and [`SimDb::transaction`], which commits
//! them and appends them to the pending log (commit and begin LSNs, seqvals,
//! command ids, row images by column id) for the capture job to harvest.

use std::collections::HashMap;
use std::path::Path;

use chrono::Utc;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};

use crate::lsn::Lsn;
use crate::source::TableName;
use crate::types::{Key, SqlValue};

use super::config::{Clock, Result, SimError, SqlCtx};
use super::db::SimDb;
use super::keys;
use super::meta::TableMeta;
use super::store::{alloc_lsns, find_table, load_config, meta_set, now_us};
use super::values::{coerce_key, coerce_row, dup_key, is_constraint, key_text};

/// A row image as the log holds it: each value under its column's id, so
/// the capture job finds an instance's column whatever the column is called
/// when the job runs (a rename between the commit and the scan changes nothing).
pub(super) type Image = Vec<(i64, SqlValue)>;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct PendingOp {
    pub(super) table_id: i64,
    /// 1 delete, 2 insert, 3 update.
    pub(super) kind: u8,
    pub(super) key_changed: bool,
    pub(super) seqval: Lsn,
    pub(super) command_id: i32,
    pub(super) before: Option<Image>,
    pub(super) after: Option<Image>,
}

fn image_of(t: &TableMeta, row: &[SqlValue]) -> Image {
    t.column_ids.iter().zip(row).map(|(id, v)| (*id, v.clone())).collect()
}

struct LoggedOp {
    table_id: i64,
    /// Where the operation stands in the transaction's command order (the
    /// order `__$command_id` numbers); the Vec's order is the log order
    /// (`__$seqval`). The two differ only inside a set-based key update.
    command_pos: (u64, u64),
    kind: u8,
    key_changed: bool,
    before: Option<Image>,
    after: Option<Image>,
}

/// A write transaction in progress; see [`SimDb::transaction`].
pub struct SimTx<'a> {
    conn: &'a Connection,
    path: &'a Path,
    tables: HashMap<(String, String), TableMeta>,
    ops: Vec<LoggedOp>,
    /// Operations executed, logged or not.
    statements: u64,
}

impl<'a> SimTx<'a> {
    fn table(&mut self, name: &TableName) -> Result<TableMeta> {
        let k = (name.schema.to_lowercase(), name.name.to_lowercase());
        if let Some(t) = self.tables.get(&k) {
            return Ok(t.clone());
        }
        let t = find_table(self.conn, self.path, name)?;
        self.tables.insert(k, t.clone());
        Ok(t)
    }

    /// Finds a row by key: (sort key, row).
    fn find(&self, t: &TableMeta, key: &[SqlValue]) -> Result<Option<(Vec<u8>, Vec<SqlValue>)>> {
        if t.is_heap() {
            // A heap has no key: the "key" names a row by its leading column values.
            let mut st = self.conn.prepare_cached("SELECT sk, data FROM rows WHERE table_id = ?1 ORDER BY sk").ctx(self.path)?;
            let mut rows = st.query([t.id]).ctx(self.path)?;
            while let Some(r) = rows.next().ctx(self.path)? {
                let row = t.decode_row(&r.get::<_, String>(1).ctx(self.path)?)?;
                // Equal as the server's `=` is: each value's sort key under its column's collation.
                let same = |i: usize, a: &SqlValue, b: &SqlValue| {
                    let c = [t.spec.key_col(i)];
                    keys::encode_key(&c, std::slice::from_ref(a)) == keys::encode_key(&c, std::slice::from_ref(b))
                };
                if row.len() >= key.len() && row.iter().zip(key).enumerate().all(|(i, (a, b))| same(i, a, b)) {
                    return Ok(Some((r.get(0).ctx(self.path)?, row)));
                }
            }
            return Ok(None);
        }
        let key = coerce_key(t, key)?;
        let sk = keys::encode_key(&t.key_types(), &key);
        let data: Option<String> = self
            .conn
            .query_row("SELECT data FROM rows WHERE table_id = ?1 AND sk = ?2", params![t.id, sk], |r| r.get(0))
            .optional()
            .ctx(self.path)?;
        data.map(|d| Ok((sk, t.decode_row(&d)?))).transpose()
    }

    /// The current row of `key`, if any (reads inside the transaction).
    pub fn get(&mut self, table: &TableName, key: &Key) -> Result<Option<Vec<SqlValue>>> {
        let t = self.table(table)?;
        Ok(self.find(&t, key)?.map(|(_, r)| r))
    }

    /// Inserts a row (values in column order).
    pub fn insert(&mut self, table: &TableName, row: Vec<SqlValue>) -> Result<()> {
        let t = self.table(table)?;
        let row = coerce_row(&t, row)?;
        let sk = if t.is_heap() {
            let seq: i64 = self
                .conn
                .query_row("UPDATE src_tables SET heap_seq = heap_seq + 1 WHERE id = ?1 RETURNING heap_seq", [t.id], |r| r.get(0))
                .ctx(self.path)?;
            seq.to_be_bytes().to_vec()
        } else {
            t.row_sort_key(&row)
        };
        let data = serde_json::to_string(&row).expect("values serialise");
        match self.conn.execute("INSERT INTO rows(table_id, sk, uk, data) VALUES (?1, ?2, ?3, ?4)", params![t.id, sk, t.row_unique_key(&row), data]) {
            Ok(_) => {}
            Err(e) if is_constraint(&e) => {
                return Err(SimError::DuplicateKey { table: t.spec.name.to_string(), key: key_text(&dup_key(&t, &row)) })
            }
            Err(e) => return Err(e).ctx(self.path),
        }
        self.statements += 1;
        if t.captured {
            self.ops.push(LoggedOp {
                table_id: t.id,
                command_pos: (self.statements, 0),
                kind: 2,
                key_changed: false,
                before: None,
                after: Some(image_of(&t, &row)),
            });
        }
        Ok(())
    }

    /// Replaces the row of `key` with `new_row` (all columns, in column order).
    pub fn update(&mut self, table: &TableName, key: &Key, new_row: Vec<SqlValue>) -> Result<()> {
        let t = self.table(table)?;
        let (old_sk, old_row) = self.find(&t, key)?.ok_or_else(|| SimError::RowNotFound { table: t.spec.name.to_string(), key: key_text(key) })?;
        let new_row = coerce_row(&t, new_row)?;
        // A key changes when the server's `=` says so: an update that only
        // respells a key under its collation (`abc` to `ABC` under `_CI`) keeps
        // the row in place (the plan's Collapse turns its delete and insert of
        // one key back into an update), logged as a before/after pair.
        let key_changed = t.key_cols.iter().chain(&t.uk_cols).any(|&i| {
            let c = [t.spec.key_col(i)];
            keys::encode_key(&c, std::slice::from_ref(&old_row[i])) != keys::encode_key(&c, std::slice::from_ref(&new_row[i]))
        });
        let new_sk = if t.is_heap() { old_sk.clone() } else { t.row_sort_key(&new_row) };
        let data = serde_json::to_string(&new_row).expect("values serialise");
        match self.conn.execute(
            "UPDATE rows SET sk = ?3, uk = ?4, data = ?5 WHERE table_id = ?1 AND sk = ?2",
            params![t.id, old_sk, new_sk, t.row_unique_key(&new_row), data],
        ) {
            Ok(_) => {}
            Err(e) if is_constraint(&e) => {
                return Err(SimError::DuplicateKey { table: t.spec.name.to_string(), key: key_text(&dup_key(&t, &new_row)) })
            }
            Err(e) => return Err(e).ctx(self.path),
        }
        self.statements += 1;
        if t.captured {
            self.ops.push(LoggedOp {
                table_id: t.id,
                command_pos: (self.statements, 0),
                kind: 3,
                key_changed,
                before: Some(image_of(&t, &old_row)),
                after: Some(image_of(&t, &new_row)),
            });
        }
        Ok(())
    }

    /// Deletes the row of `key`.
    pub fn delete(&mut self, table: &TableName, key: &Key) -> Result<()> {
        let t = self.table(table)?;
        let (sk, old_row) = self.find(&t, key)?.ok_or_else(|| SimError::RowNotFound { table: t.spec.name.to_string(), key: key_text(key) })?;
        self.conn.execute("DELETE FROM rows WHERE table_id = ?1 AND sk = ?2", params![t.id, sk]).ctx(self.path)?;
        self.statements += 1;
        if t.captured {
            self.ops.push(LoggedOp {
                table_id: t.id,
                command_pos: (self.statements, 0),
                kind: 1,
                key_changed: false,
                before: Some(image_of(&t, &old_row)),
                after: None,
            });
        }
        Ok(())
    }

    /// One set-based UPDATE that gives several rows new key values at once
    /// (`UPDATE t SET id = id + 1`, or keys swapped): `changes` maps each
    /// row's current key to its new row. Uniqueness is checked at the end of
    /// the statement, as SQL Server checks it, so keys may pass through
    /// values another row still holds. SQL Server runs it as a deferred
    /// update: every old row is deleted, then every new row inserted. CDC
    /// captures a delete and an insert per row, each with its own seqval,
    /// and (KB3030352) the log may hold the inserts *before* the deletes:
    /// this model logs them that way, while `__$command_id` numbers the
    /// deletes first, the order the statement ran them in.
    pub fn update_keys(&mut self, table: &TableName, changes: Vec<(Key, Vec<SqlValue>)>) -> Result<()> {
        let t = self.table(table)?;
        if t.is_heap() {
            return Err(SimError::BadArgument(format!("table {} has no key to update set-based", t.spec.name)));
        }
        let mut old_rows = Vec::new();
        for (key, _) in &changes {
            let (sk, row) = self.find(&t, key)?.ok_or_else(|| SimError::RowNotFound { table: t.spec.name.to_string(), key: key_text(key) })?;
            if old_rows.iter().any(|(s, _)| *s == sk) {
                return Err(SimError::BadArgument(format!("key {} is updated twice in one statement", key_text(key))));
            }
            old_rows.push((sk, row));
        }
        for (sk, _) in &old_rows {
            self.conn.execute("DELETE FROM rows WHERE table_id = ?1 AND sk = ?2", params![t.id, sk]).ctx(self.path)?;
        }
        let mut new_rows = Vec::new();
        for (_, row) in changes {
            let row = coerce_row(&t, row)?;
            let data = serde_json::to_string(&row).expect("values serialise");
            match self.conn.execute(
                "INSERT INTO rows(table_id, sk, uk, data) VALUES (?1, ?2, ?3, ?4)",
                params![t.id, t.row_sort_key(&row), t.row_unique_key(&row), data],
            ) {
                Ok(_) => {}
                Err(e) if is_constraint(&e) => {
                    return Err(SimError::DuplicateKey { table: t.spec.name.to_string(), key: key_text(&dup_key(&t, &row)) })
                }
                Err(e) => return Err(e).ctx(self.path),
            }
            new_rows.push(row);
        }
        let statement = self.statements;
        self.statements += 1;
        if t.captured {
            let n = old_rows.len() as u64;
            // Log order: the inserts, then the deletes (insert-before-delete).
            for (i, row) in new_rows.iter().enumerate() {
                self.ops.push(LoggedOp {
                    table_id: t.id,
                    command_pos: (statement, n + i as u64),
                    kind: 2,
                    key_changed: false,
                    before: None,
                    after: Some(image_of(&t, row)),
                });
            }
            for (i, (_, row)) in old_rows.iter().enumerate() {
                self.ops.push(LoggedOp {
                    table_id: t.id,
                    command_pos: (statement, i as u64),
                    kind: 1,
                    key_changed: false,
                    before: Some(image_of(&t, row)),
                    after: None,
                });
            }
        }
        Ok(())
    }
}

impl SimDb {
    /// Runs `f` as one transaction: all its writes commit together with one
    /// commit LSN, or none do when it returns an error. Returns the commit LSN.
    pub fn transaction<F>(&self, f: F) -> Result<Lsn>
    where
        F: FnOnce(&mut SimTx<'_>) -> Result<()>,
    {
        let mut c = self.conn();
        let path = self.path.as_path();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate).ctx(path)?;
        let cfg = load_config(&tx, path)?;
        let begin_us = now_us(&tx, path, &cfg)?;
        let mut stx = SimTx { conn: &tx, path, tables: HashMap::new(), ops: Vec::new(), statements: 0 };
        f(&mut stx)?;
        let ops = std::mem::take(&mut stx.ops);
        drop(stx);
        let n = ops.len() as u128;
        let first = alloc_lsns(&tx, path, n + 2)?;
        let begin_lsn = Lsn::from_u128(first);
        let commit_lsn = Lsn::from_u128(first + n + 1);
        let commit_us = match cfg.clock {
            Clock::Wall => Utc::now().timestamp_micros().max(begin_us),
            Clock::Manual { tick_ms, .. } => {
                let t = begin_us + (tick_ms as i64) * 1000;
                meta_set(&tx, path, "clock_us", &t.to_string())?;
                t
            }
        };
        if !ops.is_empty() {
            // seqval follows the log order (the Vec's), command id the order
            // the statements ran the operations in.
            let mut by_command: Vec<(u64, u64)> = ops.iter().map(|o| o.command_pos).collect();
            by_command.sort_unstable();
            let pending: Vec<PendingOp> = ops
                .into_iter()
                .enumerate()
                .map(|(i, o)| PendingOp {
                    table_id: o.table_id,
                    kind: o.kind,
                    key_changed: o.key_changed,
                    seqval: Lsn::from_u128(first + 1 + i as u128),
                    command_id: by_command.partition_point(|p| *p < o.command_pos) as i32 + 1,
                    before: o.before,
                    after: o.after,
                })
                .collect();
            tx.execute(
                "INSERT INTO pending(commit_lsn, begin_lsn, begin_us, commit_us, ops) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![commit_lsn.0.to_vec(), begin_lsn.0.to_vec(), begin_us, commit_us, serde_json::to_string(&pending).expect("ops serialise")],
            )
            .ctx(path)?;
        }
        tx.commit().ctx(path)?;
        Ok(commit_lsn)
    }
}
