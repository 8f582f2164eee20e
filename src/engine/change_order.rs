//! Checks of the order a change read delivers, run on every batch before the
//! stream commits it.
//!
//! Bronze, the rebuild rule and silver all take a key's latest image by
//! (`_start_lsn`, `_command_id`, `_seqval`, `_operation`). That is right only
//! when the source ordered each transaction by `__$command_id`, and the
//! column exists only on change tables from after KB3030352 (see
//! `mssql::sql`). On an older change table the read falls back to
//! (`__$start_lsn`, `__$seqval`, `__$operation`), and for a set-based update of
//! a unique key SQL Server may log a row's insert *before* another row's
//! delete of the same key value: in that order the delete looks latest and
//! the key would vanish from silver and from the rebuild.
//!
//! Nothing in such a transaction tells that misorder from a real "insert k,
//! then delete k" (two statements): both show an insert of k, then a delete
//! of k, in seqval order, and no other column decides it. So the order is
//! kept where it cannot be wrong, and a batch that holds the one ambiguous
//! shape is refused (exit 3, before anything is written) with the fix:
//! upgrade the change table so it has the column. A refusal can be repaired
//! by a person; a dropped key is silent.
//!
//! The same pass checks the join the read makes to the change table for
//! `__$command_id`: each (`__$seqval`, `__$operation`) of a transaction must
//! come once. A repeat would mean the join met two change-table rows for one
//! function row, which would duplicate the change under two command ids; it
//! is reported as a bug rather than written.

use std::collections::HashSet;

use deltalake::arrow::array::{Array, ArrayRef, FixedSizeBinaryArray, Int32Array};
use deltalake::arrow::record_batch::RecordBatch;
use deltalake::arrow::row::{RowConverter, SortField};

use crate::error::{StepError, StepResult};
use crate::lsn::Lsn;
use crate::source::{CaptureInstance, CHANGE_COMMAND_ID, CHANGE_OPERATION, CHANGE_SEQVAL, CHANGE_START_LSN};

/// The state of the check across the batches of one read (a transaction may
/// span two batches).
pub struct OrderCheck {
    capture_instance: String,
    key_columns: Vec<String>,
    converter: Option<RowConverter>,
    /// The transaction being read (its commit LSN).
    transaction: Option<[u8; 10]>,
    /// (seqval, operation) of the rows of that transaction.
    row_ids: HashSet<([u8; 10], i32)>,
    /// Keys (row-encoded) the transaction inserted, in a read without command ids.
    inserted_keys: HashSet<Vec<u8>>,
}

impl OrderCheck {
    /// A check for one read of `instance`, keyed on its index columns (none
    /// for a heap, whose silver is a multiset and has no key to lose).
    pub fn new(instance: &CaptureInstance) -> OrderCheck {
        OrderCheck {
            capture_instance: instance.name.clone(),
            key_columns: instance.index_columns.clone(),
            converter: None,
            transaction: None,
            row_ids: HashSet::new(),
            inserted_keys: HashSet::new(),
        }
    }

    /// Checks the next batch of the read (rows in the order the source gave).
    pub fn check(&mut self, batch: &RecordBatch) -> StepResult<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let missing = |c: &str| StepError::Internal(format!("change batch without {c}"));
        let start = fixed(batch, CHANGE_START_LSN).ok_or_else(|| missing(CHANGE_START_LSN))?;
        let seq = fixed(batch, CHANGE_SEQVAL).ok_or_else(|| missing(CHANGE_SEQVAL))?;
        let op = int32(batch, CHANGE_OPERATION).ok_or_else(|| missing(CHANGE_OPERATION))?;
        let cmd = int32(batch, CHANGE_COMMAND_ID).ok_or_else(|| missing(CHANGE_COMMAND_ID))?;
        let keys = self.encoded_keys(batch)?;
        for i in 0..batch.num_rows() {
            let txn = bytes10(start.value(i));
            if self.transaction != Some(txn) {
                self.transaction = Some(txn);
                self.row_ids.clear();
                self.inserted_keys.clear();
            }
            let operation = op.value(i);
            if !self.row_ids.insert((bytes10(seq.value(i)), operation)) {
                return Err(StepError::Internal(format!(
                    "the change read of capture instance '{}' returned the change (__$seqval {}, __$operation {operation}) of \
                     transaction {} twice: its join to the change table met two rows for one change. Nothing was written; \
                     please report this with the instance's change table definition",
                    self.capture_instance,
                    Lsn(bytes10(seq.value(i))).to_hex(),
                    Lsn(txn).to_hex()
                )));
            }
            if !cmd.is_null(i) {
                continue;
            }
            let Some(keys) = &keys else { continue };
            let key = keys[i].clone();
            match operation {
                2 => {
                    self.inserted_keys.insert(key);
                }
                1 if self.inserted_keys.contains(&key) => {
                    return Err(StepError::NeedsPerson(format!(
                        "capture instance '{ci}' has a change table without __$command_id (created before the KB3030352 \
                         update), so its changes come in __$seqval order, and transaction {txn} inserts a key of ({keys}) \
                         before deleting it in that order. That is either an insert followed by a delete, or a set-based \
                         update of the key that SQL Server logged insert-first; the change table cannot tell which, and \
                         the wrong choice drops the key from silver. Nothing was written. Fix: add the column (apply a \
                         current cumulative update, then run sys.sp_vupgrade_replication), or create a new capture \
                         instance on an up-to-date server (the stream switches to it); then call the step again",
                        ci = self.capture_instance,
                        txn = Lsn(txn).to_hex(),
                        keys = self.key_columns.join(", "),
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The key of each row, row-encoded so equal keys give equal bytes;
    /// None when the instance has no key (a heap).
    fn encoded_keys(&mut self, batch: &RecordBatch) -> StepResult<Option<Vec<Vec<u8>>>> {
        if self.key_columns.is_empty() {
            return Ok(None);
        }
        let cols: Vec<ArrayRef> = self
            .key_columns
            .iter()
            .map(|k| {
                let idx = batch.schema().fields().iter().position(|f| f.name().eq_ignore_ascii_case(k));
                idx.map(|i| batch.column(i).clone())
                    .ok_or_else(|| StepError::Internal(format!("change batch without the key column '{k}'")))
            })
            .collect::<StepResult<_>>()?;
        if self.converter.is_none() {
            let fields = cols.iter().map(|c| SortField::new(c.data_type().clone())).collect();
            self.converter = Some(RowConverter::new(fields).map_err(|e| StepError::Internal(format!("key encoder: {e}")))?);
        }
        let conv = self.converter.as_ref().expect("set above");
        let rows = conv.convert_columns(&cols).map_err(|e| StepError::Internal(format!("key encoder: {e}")))?;
        Ok(Some((0..batch.num_rows()).map(|i| rows.row(i).as_ref().to_vec()).collect()))
    }
}

fn fixed<'a>(b: &'a RecordBatch, name: &str) -> Option<&'a FixedSizeBinaryArray> {
    b.column_by_name(name)?.as_any().downcast_ref::<FixedSizeBinaryArray>()
}

fn int32<'a>(b: &'a RecordBatch, name: &str) -> Option<&'a Int32Array> {
    b.column_by_name(name)?.as_any().downcast_ref::<Int32Array>()
}

fn bytes10(v: &[u8]) -> [u8; 10] {
    let mut b = [0u8; 10];
    b.copy_from_slice(v);
    b
}
