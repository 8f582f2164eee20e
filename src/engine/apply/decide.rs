//! What one `apply` does, decided from silver's last control row and the
//! stream's facts rows alone (pure): rebuild from a completed snapshot,
//! apply an open chunked snapshot's new waves, apply the changes since the
//! last apply, or nothing; and the control row that records it. The txn ids
//! of its two commits live here too, so `heap` and the step share them
//! without importing the step.
//!
//! Changes are applied in slices ([`SliceLimits`]): an apply that lags the
//! stream by more than `slice_rows` change rows takes the batches up to that
//! many rows and leaves the rest to the next slice, so the MERGE's source
//! (held in memory) follows the slice, not the lag. Any LSN is a safe place
//! to cut, since a transaction's rows share one `__$start_lsn`; cutting
//! where a batch ends only makes the facts' row counts exact for the slice.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

use crate::delta::control::ControlRow;
use crate::delta::facts::{FactRow, EVENT_BOOTSTRAP, EVENT_RESNAPSHOT};
use crate::delta::Txn;
use crate::engine::rules::{self, EVENT_SNAPSHOT_CHUNK};
use crate::engine::state::StreamState;
use crate::lsn::Lsn;

/// What one `apply` does (decided by [`decide`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// Rebuild from the rows of completed snapshot S and the changes after it, deleting by absence.
    Rebuild { snapshot: Lsn },
    /// Apply these waves of the open chunked snapshot S: their chunk rows
    /// with the changes after S of the chunk rows' keys, and every key's
    /// changes after `after` (what silver applied; None: all of them).
    Waves { snapshot: Lsn, waves: Vec<i64>, after: Option<Lsn> },
    /// Apply the changes after `after` (None: all of them).
    Changes { after: Option<Lsn> },
    /// Nothing new.
    Nothing,
}

/// The decision of one apply: the action, up to which LSN, and the control row it leads to.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub action: Action,
    /// Up to where this apply takes bronze's rows: the stream's position
    /// (the newest LSN the facts say bronze holds), or a slice's end below it.
    pub to: Option<Lsn>,
    /// A slice that ends below the stream's position: the next apply (or the
    /// next turn of this one) has more to take.
    pub more: bool,
    /// The control row to write once the MERGE is in (metrics filled then).
    pub next: ControlRow,
}

/// Silver's MERGE txn: one version per apply.
pub fn txn_merge(app: &str, seq: i64) -> Txn {
    Txn::new(format!("{app}#silver"), seq)
}

/// The control row's txn.
pub fn txn_control(app: &str, seq: i64) -> Txn {
    Txn::new(format!("{app}#control"), seq)
}

/// The newest completed snapshot (any generation): S of the newest `bootstrap` or `resnapshot` row.
pub fn newest_completed(facts: &[FactRow]) -> Option<Lsn> {
    facts
        .iter()
        .filter(|r| matches!(r.event.as_deref(), Some(EVENT_BOOTSTRAP) | Some(EVENT_RESNAPSHOT)))
        .filter_map(|r| r.max_lsn)
        .max()
}

/// The chunked snapshot open now, if its S is newer than every completed one.
pub fn open_chunked(facts: &[FactRow]) -> Option<Lsn> {
    let o = rules::open_chunked(facts)?;
    match newest_completed(facts) {
        Some(c) if c >= o.s => None,
        _ => Some(o.s),
    }
}

/// The waves of snapshot `s` that have facts rows, with their chunks.
pub fn waves_in_facts(facts: &[FactRow], s: Lsn) -> BTreeMap<i64, BTreeSet<i64>> {
    let hex = s.to_hex();
    let mut out: BTreeMap<i64, BTreeSet<i64>> = BTreeMap::new();
    for r in facts.iter().filter(|r| r.event.as_deref() == Some(EVENT_SNAPSHOT_CHUNK)) {
        let Some(d) = &r.detail else { continue };
        if d.get("snapshot").and_then(Value::as_str) != Some(hex.as_str()) {
            continue;
        }
        if let (Some(c), Some(w)) = (d.get("chunk").and_then(Value::as_i64), d.get("wave").and_then(Value::as_i64)) {
            out.entry(w).or_default().insert(c);
        }
    }
    out
}

/// How much one apply takes at once (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceLimits {
    /// The most change rows of one slice (at least one batch, however large).
    pub slice_rows: u64,
}

/// Where the slice of changes after `after` (None: from the start) ends:
/// the last end of a stream batch in (`after`, `to`] such that the batches
/// ending there hold at most `slice_rows` rows together, and always at
/// least the first one; `to` when they all fit or no batch ends in the
/// range. Rows are counted from the facts' batch rows (every generation's:
/// after a reseed two generations' batches may cover one range, which
/// only makes a slice smaller than it could be).
pub fn next_window_end(facts: &[FactRow], after: Option<Lsn>, to: Lsn, slice_rows: u64) -> Lsn {
    let mut ends: BTreeMap<Lsn, u64> = BTreeMap::new();
    for r in facts.iter().filter(|r| r.event.is_none() && r.batch_id.is_some()) {
        let Some(end) = r.max_lsn else { continue };
        if after.is_some_and(|a| end <= a) || end > to {
            continue;
        }
        *ends.entry(end).or_default() += r.rows.unwrap_or(0).max(0) as u64;
    }
    let mut total = 0u64;
    let mut cut: Option<Lsn> = None;
    for (end, rows) in ends {
        total = total.saturating_add(rows);
        if total > slice_rows {
            if let Some(c) = cut {
                return c;
            }
            // The first batch alone is larger than a slice: it is the slice.
            return end;
        }
        cut = Some(end);
    }
    to
}

/// Decides what one apply does (pure): from silver's last control row and
/// this app id's facts rows, not knowing where CDC cleanup is (see
/// [`decide_with_cleanup`]), taking every change at once.
pub fn decide(app: &str, last: Option<&ControlRow>, facts: &[FactRow]) -> Decision {
    decide_with_cleanup(app, last, facts, None, None)
}

/// [`decide`] with the capture instance's min LSN. A full snapshot holds
/// the verdict (no rows to apply before its completion, but the verdict
/// waits for it) by the rule every step uses,
/// `engine::rules::full_holding_mode`: once cleanup has passed its S it
/// can never complete, and a verdict held for it would stay held forever
/// while `status`, `seed` and the snapshot steps already count it as dead.
///
/// With `limits`, changes come in slices ([`next_window_end`]): the
/// decision's `to`, the control row's applied LSN and (when the verdict is
/// not held) its `finalized_until` stop at the slice's end, and `more` says
/// the stream is further on. Waves and rebuilds are not sliced.
pub fn decide_with_cleanup(app: &str, last: Option<&ControlRow>, facts: &[FactRow], min_lsn: Option<Lsn>, limits: Option<SliceLimits>) -> Decision {
    let st = StreamState::derive(app, facts, None);
    let seq = last.map(|c| c.seq + 1).unwrap_or(0);
    let completed = newest_completed(facts);
    let open = open_chunked(facts);
    let held = open.is_some() || rules::full_holding_mode(facts, min_lsn).is_some();
    let applied = last.and_then(|c| c.applied_lsn);
    let mut to = st.position();
    if let Some(c) = completed {
        to = to.max(Some(c));
    }
    let prev_final = last.and_then(|c| c.finalized_until);
    let mut next = ControlRow {
        app_id: app.to_string(),
        seq,
        applied_lsn: to.max(applied),
        snapshot_lsn: last.and_then(|c| c.snapshot_lsn),
        open_snapshot_lsn: open,
        snapshot_wave: None,
        finalized_until: if held { prev_final } else { to.max(applied) },
        action: String::new(),
        ..Default::default()
    };
    let built_from = last.and_then(|c| c.snapshot_lsn);
    if let Some(c) = completed.filter(|c| built_from.is_none_or(|b| b < *c)) {
        // A rebuild never takes silver back in time. A reseed whose copy is
        // older than what silver has applied starts a generation whose
        // position is below silver's applied LSN: rebuilt now, silver would
        // hold the copy and the changes up to that position while its
        // control row still said the old applied LSN (it never moves back),
        // and the next apply, counting only the changes after it, would
        // never apply those in between. So the rebuild waits until the new
        // generation's stream has read up to silver's applied LSN; silver
        // keeps its image meanwhile.
        if let (Some(t), Some(a)) = (to, applied) {
            if t < a {
                next.action = "position".into();
                return Decision { action: Action::Nothing, to, more: false, next };
            }
        }
        next.snapshot_lsn = Some(c);
        next.action = "rebuild".into();
        return Decision { action: Action::Rebuild { snapshot: c }, to, more: false, next };
    }
    if let Some(s) = open {
        let done = last.filter(|c| c.open_snapshot_lsn == Some(s)).and_then(|c| c.snapshot_wave);
        next.snapshot_wave = done;
        let waves: Vec<i64> = waves_in_facts(facts, s).into_keys().filter(|w| done.is_none_or(|d| *w > d)).collect();
        if let Some(&newest) = waves.last() {
            next.snapshot_wave = Some(newest);
            next.action = "waves".into();
            // The changes silver has not applied yet (every key), and, with
            // the chunk rows, the changes after S of their own keys that it
            // has ([`wave_source_sql`]): a chunk row never brings back a key
            // deleted after its stamp.
            return Decision { action: Action::Waves { snapshot: s, waves, after: applied }, to, more: false, next };
        }
    }
    match (to, applied) {
        (Some(t), Some(a)) if t <= a => {
            next.action = "position".into();
            let same = last.is_some_and(|c| {
                c.finalized_until == next.finalized_until && c.open_snapshot_lsn == next.open_snapshot_lsn && c.snapshot_wave == next.snapshot_wave
            });
            if same {
                Decision { action: Action::Nothing, to, more: false, next }
            } else {
                // Only the verdict or the open snapshot moved: a control row, no MERGE.
                Decision { action: Action::Changes { after: Some(a) }, to, more: false, next }
            }
        }
        (None, _) => {
            next.action = "position".into();
            Decision { action: Action::Nothing, to, more: false, next }
        }
        (Some(t), a) => {
            next.action = "changes".into();
            let end = limits.map_or(t, |l| next_window_end(facts, a, t, l.slice_rows));
            if end < t {
                next.applied_lsn = Some(end);
                if !held {
                    next.finalized_until = Some(end);
                }
            }
            Decision { action: Action::Changes { after: a }, to: Some(end), more: end < t, next }
        }
    }
}
