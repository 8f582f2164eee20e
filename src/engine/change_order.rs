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
//! `__$command_id`, and the order itself: within a transaction the rows must
//! come in strictly increasing (`__$command_id`, `__$seqval`,
//! `__$operation`), the read's own ORDER BY. A join that met two
//! change-table rows for one function row gives the row twice with the same
//! command id (the rows of one change share it: an update's before and after
//! images come from one command), and the two copies are then next to each
//! other: a repeat, not an increase. A row out of that order would make the
//! latest image the wrong one. Either is reported as a bug rather than
//! written.
//!
//! Why the order and not a set of the rows seen: a transaction is read
//! whole by one batch however many rows it has (a batch ends on a
//! transaction boundary), and a set of its (`__$seqval`, `__$operation`)
//! would take memory in proportion to it, tens of bytes a row, for a
//! transaction of millions of rows. The comparison with the row before
//! takes none. (A change table without `__$command_id` still keeps the keys
//! a transaction inserted, to find the ambiguous shape above; that table
//! comes only from servers older than 2017.)

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
    /// (command id, seqval, operation) of the row read last in that transaction.
    last_row: Option<(Option<i32>, [u8; 10], i32)>,
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
            last_row: None,
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
                self.last_row = None;
                self.inserted_keys.clear();
            }
            let operation = op.value(i);
            let command_id = if cmd.is_null(i) { None } else { Some(cmd.value(i)) };
            let row = (command_id, bytes10(seq.value(i)), operation);
            if let Some(last) = self.last_row.filter(|last| *last >= row) {
                let what = if last == row { "twice: its join to the change table met two rows for one change" } else { "out of its (__$command_id, __$seqval, __$operation) order" };
                return Err(StepError::Internal(format!(
                    "the change read of capture instance '{}' returned the change (__$command_id {}, __$seqval {}, __$operation {operation}) of \
                     transaction {} {what} (the row before it: __$command_id {}, __$seqval {}, __$operation {}). Nothing was written; \
                     please report this with the instance's change table definition",
                    self.capture_instance,
                    command_id.map_or("NULL".to_string(), |c| c.to_string()),
                    Lsn(row.1).to_hex(),
                    Lsn(txn).to_hex(),
                    last.0.map_or("NULL".to_string(), |c| c.to_string()),
                    Lsn(last.1).to_hex(),
                    last.2,
                )));
            }
            self.last_row = Some(row);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use deltalake::arrow::datatypes::{DataType, Field, Schema};

    use super::*;
    use crate::source::TableName;

    /// Change rows (commit LSN, command id, seqval, operation) of a heap's read.
    fn rows(of: &[(u8, Option<i32>, u8, i32)]) -> RecordBatch {
        let lsn = |n: u8| {
            let mut b = [0u8; 10];
            b[9] = n;
            b
        };
        let schema = Schema::new(vec![
            Field::new(CHANGE_START_LSN, DataType::FixedSizeBinary(10), false),
            Field::new(CHANGE_SEQVAL, DataType::FixedSizeBinary(10), false),
            Field::new(CHANGE_OPERATION, DataType::Int32, false),
            Field::new(CHANGE_COMMAND_ID, DataType::Int32, true),
        ]);
        let start = FixedSizeBinaryArray::try_from_iter(of.iter().map(|r| lsn(r.0))).unwrap();
        let seq = FixedSizeBinaryArray::try_from_iter(of.iter().map(|r| lsn(r.2))).unwrap();
        let op = Int32Array::from(of.iter().map(|r| r.3).collect::<Vec<_>>());
        let cmd = Int32Array::from(of.iter().map(|r| r.1).collect::<Vec<_>>());
        RecordBatch::try_new(Arc::new(schema), vec![Arc::new(start), Arc::new(seq), Arc::new(op), Arc::new(cmd)]).unwrap()
    }

    fn check() -> OrderCheck {
        OrderCheck::new(&CaptureInstance {
            name: "dbo_t".into(),
            table: TableName::new("dbo", "t"),
            start_lsn: None,
            columns: Vec::new(),
            index_columns: Vec::new(),
            renamed: Default::default(),
        })
    }

    #[test]
    fn rows_in_the_reads_order_pass_across_batches_and_transactions() {
        let mut c = check();
        // An update's two images share a seqval and a command id; the
        // set-based update's insert-first seqval order is fine by command id.
        c.check(&rows(&[(1, Some(1), 5, 3), (1, Some(1), 5, 4), (1, Some(2), 3, 2)])).unwrap();
        c.check(&rows(&[(1, Some(2), 4, 1), (2, Some(1), 1, 2)])).unwrap();
        // An old change table: no command ids, (seqval, operation) order.
        let mut old = check();
        old.check(&rows(&[(1, None, 1, 1), (1, None, 2, 3), (1, None, 2, 4)])).unwrap();
    }

    #[test]
    fn a_change_read_twice_or_out_of_order_is_refused_even_across_batches() {
        let mut c = check();
        c.check(&rows(&[(1, Some(1), 5, 3), (1, Some(1), 5, 4)])).unwrap();
        let twice = c.check(&rows(&[(1, Some(1), 5, 4)])).unwrap_err().to_string();
        assert!(twice.contains("twice"), "{twice}");
        let mut c = check();
        let back = c.check(&rows(&[(1, Some(2), 1, 2), (1, Some(1), 9, 2)])).unwrap_err().to_string();
        assert!(back.contains("out of its"), "{back}");
        // The order starts over with each transaction.
        let mut c = check();
        c.check(&rows(&[(1, Some(2), 9, 2), (2, Some(1), 1, 2)])).unwrap();
    }
}
