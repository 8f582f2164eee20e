//! An embedded SQL Server CDC simulator, addressed as `sim://PATH`.
//!
//! The whole simulated server lives in one SQLite file (WAL mode), so a
//! writer process, the workflow's steps and the tests can share it, each
//! with real transactions. It models what a CDC reader can observe:
//!
//! - **Writes** ([`SimDb::transaction`]) change the source tables at once and
//!   append the transaction to a pending log with its commit LSN, begin LSN,
//!   per-operation seqvals and command ids, and its commit time from the
//!   simulator's clock ([`Clock`]: the wall clock or a manual one).
//! - **The capture job** ([`SimDb::capture`], also run at the start of every
//!   [`SimSource`] call) moves pending transactions older than the capture lag
//!   into the change tables and `lsn_time_mapping`, strictly in LSN order, in
//!   one SQLite transaction. Key-changing updates become a delete/insert pair
//!   sharing a seqval; other updates a before/after pair. A set-based key
//!   update ([`SimTx::update_keys`]) gives each row a delete and an insert
//!   with their own seqvals, logged inserts first (the KB3030352 symptom)
//!   while `__$command_id` numbers the deletes first. Mapping times are
//!   server-local `datetime` values (the configured zone, DST included, on the
//!   1/300 s grid; `zone_rules` gives the clock other rules than the zone it
//!   reports, as a Windows server without a time-zone update has). The
//!   simulator converts instants to that clock itself, as `AT TIME ZONE` does
//!   on a server (`CdcSource::server_local_times`).
//! - **Cleanup** ([`SimDb::cleanup`]) moves each instance's validity start up
//!   to the retention watermark and purges change and mapping rows below it.
//! - **Reads** go through [`SimSource`], the [`crate::source::CdcSource`]
//!   implementation: consistent streamed snapshots over a memcomparable key
//!   index ([`keys`]), the all-changes function with its error 313 (it has
//!   no `__$command_id`; the change table has it, except on an instance made
//!   by [`SimDb::enable_cdc_without_command_id`], an old server's), time/LSN
//!   mapping, SNAPSHOT refused unless allowed (error 3952), optional latency,
//!   per-stream row rate limits, injected connection faults, numbered server
//!   errors ([`SimDb::inject_server_error`]) and a cleanup that races the
//!   next change read ([`SimDb::cleanup_before_next_change_read`]).
//! - **Permissions** ([`security`]): database users, roles and grants; a
//!   `sim://PATH?user=NAME` URL reads as that user, and each read checks what
//!   SQL Server checks for its statement (SELECT on the columns read, the
//!   catalog shown only to a caller with a permission on an object, CDC's
//!   own check of the captured columns and the gating role), failing with
//!   the server's errors 229 and 230, or all zeros from `fn_cdc_get_min_lsn`.
//!   No user on the URL is the database owner, whom nothing stops.
//! - **Schema changes**: added columns are ignored by existing capture
//!   instances; dropped captured columns read as NULL; a renamed column
//!   ([`SimDb::rename_column`]) keeps its column id, so an instance goes on
//!   capturing it under the old name and reports the rename
//!   (`CaptureInstance::renamed`); at most two instances per table.
//!
//! [`workload`] drives a random transactional workload and provides the
//! `orders` demo table; [`cli`] is the `mssql-cdc sim ...` subcommand.

pub mod bounds;
mod capture;
pub mod collation;
pub mod cli;
mod config;
pub mod db;
pub mod keys;
mod meta;
pub mod security;
pub mod source;
mod store;
mod tx;
mod values;
pub mod workload;

pub use cli::{run, SimCommand};
pub use db::{
    parse_zone, CaptureReport, CleanupReport, Clock, FaultOn, FaultSpec, SimConfig, SimDb, SimError, SimTx, TableSpec,
};
pub use security::{Grant, Permission, Securable, Security};
pub use source::SimSource;
pub use workload::{orders_rows, orders_table_spec, Mix, Until, Workload, WorkloadReport};

#[cfg(test)]
mod tests;
