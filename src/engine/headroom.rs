//! The stream's retention headroom, read from the source at the moment it is
//! asked for.
//!
//! Headroom is how far the stream's position is ahead of what CDC cleanup
//! has purged: the commit time of the position minus the commit time of the
//! capture instance's min LSN (cleanup's low watermark). When it reaches
//! zero, the next cleanup purges changes the stream has not read.
//!
//! Each batch records the headroom it saw (`facts.headroom_seconds`), but a
//! recorded value is only right at the moment of its batch: once the stream
//! stops, cleanup goes on and the real headroom shrinks while the recorded
//! one stays where it was. So `status` and `backfill`'s `min_headroom_hours`
//! pause read it here, live: the min LSN from the source now, the position
//! from the Delta tables.
//!
//! What it cannot see: SQL Server does not tell a read-only login the
//! cleanup job's retention (it lives in `msdb.dbo.cdc_jobs`), so a capture
//! instance cleanup has not yet trimmed (younger than the retention) reads
//! as a headroom as old as the instance, not the retention. That errs on the
//! side of pausing: `backfill` with `min_headroom_hours` waits until the
//! instance is that old (workflows/README.md says so).

use chrono::{DateTime, Utc};

use crate::error::StepResult;
use crate::lsn::Lsn;
use crate::source::{ServerZone, SharedSource};

/// The commit times that make up a headroom, and the headroom itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Headroom {
    /// The capture instance's min LSN now (cleanup's low watermark).
    pub min_lsn: Option<Lsn>,
    /// Its commit time, in UTC.
    pub min_commit_ts: Option<DateTime<Utc>>,
    /// The position's commit time, in UTC.
    pub position_commit_ts: Option<DateTime<Utc>>,
    /// `position_commit_ts - min_commit_ts`, in seconds; `None` when either
    /// time is unknown (no position yet, an empty instance, or a time the
    /// mapping table no longer holds).
    pub seconds: Option<f64>,
}

/// Reads the headroom of `position` on `instance` from the source now.
pub async fn live(source: &SharedSource, zone: &ServerZone, instance: &str, position: Option<Lsn>) -> StepResult<Headroom> {
    let min_lsn = source.min_lsn(instance).await?;
    let time = |lsn: Option<Lsn>| async move {
        match lsn {
            Some(l) => Ok::<_, crate::error::StepError>(source.lsn_to_time(l).await?.map(|t| zone.to_utc(t))),
            None => Ok(None),
        }
    };
    let min_commit_ts = time(min_lsn).await?;
    let position_commit_ts = time(position).await?;
    let seconds = seconds_between(position_commit_ts, min_commit_ts);
    Ok(Headroom { min_lsn, min_commit_ts, position_commit_ts, seconds })
}

/// `position - watermark` in seconds, when both are known.
pub fn seconds_between(position: Option<DateTime<Utc>>, watermark: Option<DateTime<Utc>>) -> Option<f64> {
    match (position, watermark) {
        (Some(p), Some(w)) => Some((p - w).num_milliseconds() as f64 / 1000.0),
        _ => None,
    }
}
