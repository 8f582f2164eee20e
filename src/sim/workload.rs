//! A writer that plays a transactional workload against a simulated table,
//! and the `orders` demo table.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, NaiveDate, NaiveTime, Timelike};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::lsn::Lsn;
use crate::source::TableName;
use crate::types::{ColumnDesc, Key, SqlType, SqlValue};

use super::db::{Result, SimDb, SimError, TableSpec};

/// Relative weights of the operation kinds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Mix {
    pub insert: u32,
    pub update: u32,
    pub delete: u32,
    /// Updates that change the primary key (captured as delete + insert).
    pub key_update: u32,
}

impl Default for Mix {
    fn default() -> Self {
        Mix { insert: 5, update: 3, delete: 1, key_update: 1 }
    }
}

impl Mix {
    /// Parses `insert=5,update=3,delete=1,key_update=1` (missing kinds weigh 0).
    pub fn parse(text: &str) -> Result<Mix> {
        let mut m = Mix { insert: 0, update: 0, delete: 0, key_update: 0 };
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| SimError::BadArgument(format!("'{part}' in the mix is not kind=weight (e.g. insert=5,update=3,delete=1,key_update=1)")))?;
            let v: u32 = v.trim().parse().map_err(|_| SimError::BadArgument(format!("'{v}' in the mix is not a whole number")))?;
            match k.trim().to_ascii_lowercase().replace('-', "_").as_str() {
                "insert" => m.insert = v,
                "update" => m.update = v,
                "delete" => m.delete = v,
                "key_update" => m.key_update = v,
                other => return Err(SimError::BadArgument(format!("'{other}' is not an operation kind; use insert, update, delete, key_update"))),
            }
        }
        if m.insert + m.update + m.delete + m.key_update == 0 {
            return Err(SimError::BadArgument("the mix gives every operation weight 0".into()));
        }
        Ok(m)
    }
}

/// A workload: transactions of `ops_per_tx` operations at `tx_per_s`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Transactions per second (0 or less: as fast as possible).
    pub tx_per_s: f64,
    pub ops_per_tx: u32,
    pub mix: Mix,
    /// The share of keys that are "hot" (0..1).
    pub hot_fraction: f64,
    /// The probability an update or delete picks a hot key (0..1).
    pub skew: f64,
    pub seed: u64,
}

impl Default for Workload {
    fn default() -> Self {
        Workload { tx_per_s: 50.0, ops_per_tx: 3, mix: Mix::default(), hot_fraction: 0.1, skew: 0.5, seed: 1 }
    }
}

/// When a workload stops (besides the stop flag).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Until {
    Deadline(Instant),
    Transactions(u64),
}

/// What a workload did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkloadReport {
    pub transactions: u64,
    pub inserts: u64,
    pub updates: u64,
    pub deletes: u64,
    pub key_updates: u64,
    /// Operations skipped because another writer had changed the row meanwhile.
    pub conflicts: u64,
    pub last_commit_lsn: Option<Lsn>,
    pub elapsed_ms: u64,
}

enum Op {
    Insert(Vec<SqlValue>),
    Update(Key, Vec<SqlValue>),
    Delete(Key),
    KeyUpdate(Key, Vec<SqlValue>),
}

impl Workload {
    /// Runs the workload on `table` until `until` or until `stop` is set.
    /// Blocking; deterministic for a seed with the manual clock and a single writer.
    pub fn run(&self, db: &SimDb, table: &TableName, until: Until, stop: Arc<AtomicBool>) -> Result<WorkloadReport> {
        let spec = db.table_spec(table)?;
        let rowgen = RowGen::new(&spec)?;
        let mut keys: Vec<Key> = db.keys(table)?;
        let mut rng = SmallRng::seed_from_u64(self.seed);
        let mut report = WorkloadReport::default();
        let started = Instant::now();
        let total_w = (self.mix.insert + self.mix.update + self.mix.delete + self.mix.key_update).max(1);
        let mut next_int = rowgen.max_int_key(&keys).map(|m| m + 1).unwrap_or(1);
        loop {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            match until {
                Until::Deadline(d) if Instant::now() >= d => break,
                Until::Transactions(n) if report.transactions >= n => break,
                _ => {}
            }
            if self.tx_per_s > 0.0 {
                let due = Duration::from_secs_f64(report.transactions as f64 / self.tx_per_s);
                let spent = started.elapsed();
                if due > spent {
                    let mut wait = due - spent;
                    if let Until::Deadline(d) = until {
                        wait = wait.min(d.saturating_duration_since(Instant::now()));
                    }
                    std::thread::sleep(wait.min(Duration::from_millis(200)));
                    continue;
                }
            }
            // Plan the transaction's operations against the local key list.
            let mut ops = Vec::new();
            for _ in 0..self.ops_per_tx.max(1) {
                let w = rng.random_range(0..total_w);
                let kind = if w < self.mix.insert || keys.is_empty() {
                    0
                } else if w < self.mix.insert + self.mix.update {
                    1
                } else if w < self.mix.insert + self.mix.update + self.mix.delete {
                    2
                } else {
                    3
                };
                match kind {
                    0 => {
                        let row = rowgen.row(&mut rng, &mut next_int);
                        keys.push(rowgen.key_of(&row));
                        ops.push(Op::Insert(row));
                    }
                    1 => {
                        let i = self.pick(&mut rng, keys.len());
                        let row = rowgen.row_with_key(&mut rng, &keys[i]);
                        ops.push(Op::Update(keys[i].clone(), row));
                    }
                    2 => {
                        let i = self.pick(&mut rng, keys.len());
                        ops.push(Op::Delete(keys.swap_remove(i)));
                    }
                    _ => {
                        let i = self.pick(&mut rng, keys.len());
                        let old = keys.swap_remove(i);
                        let row = rowgen.row(&mut rng, &mut next_int);
                        keys.push(rowgen.key_of(&row));
                        ops.push(Op::KeyUpdate(old, row));
                    }
                }
            }
            let mut counts = [0u64; 5];
            let res = db.transaction(|tx| {
                counts = [0; 5];
                for op in &ops {
                    let r = match op {
                        Op::Insert(row) => tx.insert(table, row.clone()).map(|_| 0),
                        Op::Update(k, row) => tx.update(table, k, row.clone()).map(|_| 1),
                        Op::Delete(k) => tx.delete(table, k).map(|_| 2),
                        Op::KeyUpdate(k, row) => tx.update(table, k, row.clone()).map(|_| 3),
                    };
                    match r {
                        Ok(i) => counts[i] += 1,
                        // Another writer got there first: skip the operation.
                        Err(SimError::RowNotFound { .. }) | Err(SimError::DuplicateKey { .. }) => counts[4] += 1,
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            });
            let lsn = res?;
            if counts[4] > 0 {
                // Resynchronise with the table after a conflict.
                keys = db.keys(table)?;
                next_int = next_int.max(rowgen.max_int_key(&keys).map(|m| m + 1).unwrap_or(1));
            }
            report.inserts += counts[0];
            report.updates += counts[1];
            report.deletes += counts[2];
            report.key_updates += counts[3];
            report.conflicts += counts[4];
            report.transactions += 1;
            report.last_commit_lsn = Some(lsn);
        }
        report.elapsed_ms = started.elapsed().as_millis() as u64;
        Ok(report)
    }

    /// Picks a key index: hot keys (the newest `hot_fraction`) with probability `skew`.
    fn pick(&self, rng: &mut SmallRng, n: usize) -> usize {
        let hot = ((n as f64 * self.hot_fraction.clamp(0.0, 1.0)).ceil() as usize).clamp(1, n);
        if rng.random_bool(self.skew.clamp(0.0, 1.0)) {
            n - 1 - rng.random_range(0..hot)
        } else {
            rng.random_range(0..n)
        }
    }
}

/// Generates values for a table's columns.
struct RowGen {
    columns: Vec<ColumnDesc>,
    key_cols: Vec<usize>,
}

impl RowGen {
    fn new(spec: &TableSpec) -> Result<RowGen> {
        let names = if spec.primary_key.is_empty() { &spec.unique_index } else { &spec.primary_key };
        let key_cols = names
            .iter()
            .map(|n| {
                spec.columns
                    .iter()
                    .position(|c| c.name.eq_ignore_ascii_case(n))
                    .ok_or_else(|| SimError::NoSuchColumn { table: spec.name.to_string(), column: n.clone() })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RowGen { columns: spec.columns.clone(), key_cols })
    }

    /// The single integer key column, if the key is one.
    fn int_key(&self) -> Option<usize> {
        match self.key_cols.as_slice() {
            [i] if self.columns[*i].sql_type.is_integer() => Some(*i),
            _ => None,
        }
    }

    fn max_int_key(&self, keys: &[Key]) -> Option<i64> {
        self.int_key()?;
        keys.iter().filter_map(|k| k.first().and_then(SqlValue::as_i64)).max()
    }

    fn key_of(&self, row: &[SqlValue]) -> Key {
        self.key_cols.iter().map(|&i| row[i].clone()).collect()
    }

    /// A new row with a new key (above the max for an integer key, random otherwise).
    fn row(&self, rng: &mut SmallRng, next_int: &mut i64) -> Vec<SqlValue> {
        let int_key = self.int_key();
        self.columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if Some(i) == int_key {
                    let v = *next_int;
                    *next_int += 1;
                    SqlValue::Int(v)
                } else {
                    let key = self.key_cols.contains(&i);
                    gen_value(rng, &c.sql_type, c.nullable && !key, key)
                }
            })
            .collect()
    }

    /// A new version of the row of `key`: same key, fresh other values.
    fn row_with_key(&self, rng: &mut SmallRng, key: &Key) -> Vec<SqlValue> {
        self.columns
            .iter()
            .enumerate()
            .map(|(i, c)| match self.key_cols.iter().position(|&k| k == i) {
                Some(p) => key[p].clone(),
                None => gen_value(rng, &c.sql_type, c.nullable, false),
            })
            .collect()
    }
}

const WORDS: &[&str] = &["acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "tyrell", "cyberdyne", "soylent"];
const STATUSES: &[&str] = &["new", "paid", "shipped", "delivered", "cancelled", "returned"];

/// A random value of a SQL type (NULL now and then when `nullable`; wide
/// random strings when `unique` so generated keys rarely collide).
pub fn gen_value(rng: &mut SmallRng, t: &SqlType, nullable: bool, unique: bool) -> SqlValue {
    if nullable && rng.random_bool(0.15) {
        return SqlValue::Null;
    }
    let text = |rng: &mut SmallRng, max: Option<u32>| -> String {
        let s = if unique {
            format!("{}-{:016x}", WORDS[rng.random_range(0..WORDS.len())], rng.random::<u64>())
        } else {
            let n = rng.random_range(1..4);
            (0..n).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
        };
        match max {
            Some(m) => s.chars().take(m.max(1) as usize).collect(),
            None => s,
        }
    };
    let base = NaiveDate::from_ymd_opt(2020, 1, 1).expect("date").and_hms_opt(0, 0, 0).expect("time");
    match t {
        SqlType::TinyInt => SqlValue::Int(rng.random_range(0..=255)),
        SqlType::SmallInt => SqlValue::Int(rng.random_range(i16::MIN as i64..=i16::MAX as i64)),
        SqlType::Int => SqlValue::Int(rng.random_range(i32::MIN as i64..=i32::MAX as i64)),
        SqlType::BigInt => SqlValue::Int(rng.random::<i64>()),
        SqlType::Bit => SqlValue::Bool(rng.random_bool(0.5)),
        SqlType::Decimal { precision, scale } => {
            let digits = (*precision).min(12) as u32;
            let m = 10i128.pow(digits);
            SqlValue::Decimal { value: rng.random_range(0..m), scale: *scale }
        }
        SqlType::Money | SqlType::SmallMoney => SqlValue::Decimal { value: rng.random_range(0..100_000_000i128), scale: 4 },
        SqlType::Float => SqlValue::Float(rng.random_range(-1e6..1e6)),
        SqlType::Real => SqlValue::Float(rng.random_range(-1e3f32..1e3) as f64),
        SqlType::Char { len } | SqlType::NChar { len } => SqlValue::Str(text(rng, Some(*len))),
        SqlType::VarChar { len } | SqlType::NVarChar { len } => {
            if !unique && len.is_some_and(|l| l <= 12) {
                let s: String = STATUSES[rng.random_range(0..STATUSES.len())].chars().take(len.unwrap_or(12) as usize).collect();
                SqlValue::Str(s)
            } else {
                SqlValue::Str(text(rng, *len))
            }
        }
        SqlType::Text | SqlType::NText | SqlType::Xml => SqlValue::Str(text(rng, None)),
        SqlType::Binary { len } => SqlValue::Bytes((0..*len.min(&64)).map(|_| rng.random()).collect()),
        SqlType::VarBinary { len } => {
            let n = rng.random_range(1..=len.unwrap_or(32).min(32));
            SqlValue::Bytes((0..n).map(|_| rng.random()).collect())
        }
        SqlType::Image => SqlValue::Bytes((0..16).map(|_| rng.random()).collect()),
        SqlType::Timestamp => SqlValue::Bytes(rng.random::<u64>().to_be_bytes().to_vec()),
        SqlType::Date => SqlValue::Date(base.date() + chrono::Duration::days(rng.random_range(0..3650))),
        SqlType::Time { .. } => {
            SqlValue::Time(NaiveTime::from_num_seconds_from_midnight_opt(rng.random_range(0..86_400), rng.random_range(0..10_000_000) * 100).expect("time"))
        }
        SqlType::DateTime | SqlType::SmallDateTime | SqlType::DateTime2 { .. } => {
            let t = base + chrono::Duration::seconds(rng.random_range(0..315_360_000));
            SqlValue::DateTime(t.with_nanosecond(rng.random_range(0..10_000_000) * 100).unwrap_or(t))
        }
        SqlType::DateTimeOffset { .. } => {
            let secs = base.and_utc().timestamp() + rng.random_range(0..315_360_000);
            let off = chrono::FixedOffset::east_opt(rng.random_range(-12..=14) * 3600).expect("offset");
            SqlValue::DateTimeOffset(DateTime::from_timestamp(secs, 0).expect("instant").with_timezone(&off))
        }
        SqlType::UniqueIdentifier => SqlValue::Guid(uuid::Uuid::from_bytes(rng.random())),
    }
}

/// The demo table: `id bigint PK, customer nvarchar(40), amount decimal(12,2),
/// status varchar(12), created_at datetime2(7), note nvarchar(max) NULL`.
pub fn orders_table_spec(name: TableName) -> TableSpec {
    TableSpec { collations: Default::default(),
        name,
        columns: vec![
            ColumnDesc::new("id", SqlType::BigInt, false),
            ColumnDesc::new("customer", SqlType::NVarChar { len: Some(40) }, false),
            ColumnDesc::new("amount", SqlType::Decimal { precision: 12, scale: 2 }, false),
            ColumnDesc::new("status", SqlType::VarChar { len: Some(12) }, false),
            ColumnDesc::new("created_at", SqlType::DateTime2 { scale: 7 }, false),
            ColumnDesc::new("note", SqlType::NVarChar { len: None }, true),
        ],
        primary_key: vec!["id".into()],
        unique_index: vec![],
    }
}

/// `n` deterministic rows of the demo table, ids 1..=n.
pub fn orders_rows(n: u64, seed: u64) -> impl Iterator<Item = Vec<SqlValue>> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let base = NaiveDate::from_ymd_opt(2025, 1, 1).expect("date").and_hms_opt(0, 0, 0).expect("time");
    (1..=n).map(move |id| {
        let customer = format!("{} {}", WORDS[rng.random_range(0..WORDS.len())], rng.random_range(1..1000));
        let amount = SqlValue::Decimal { value: rng.random_range(100..10_000_000i128), scale: 2 };
        let status = STATUSES[rng.random_range(0..STATUSES.len())];
        let created = base + chrono::Duration::seconds(id as i64 * 17) + chrono::Duration::nanoseconds(rng.random_range(0..10_000_000i64) * 100);
        let note = if rng.random_bool(0.3) {
            SqlValue::Null
        } else {
            SqlValue::Str(format!("order {id} for {customer}"))
        };
        vec![SqlValue::Int(id as i64), SqlValue::Str(customer), amount, SqlValue::Str(status.into()), SqlValue::DateTime(created), note]
    })
}
