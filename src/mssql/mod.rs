//! The SQL Server source: [`MssqlSource`] implements [`crate::source::CdcSource`]
//! over tiberius.
//!
//! * [`config`]: the `mssql://` URL / ADO.NET string, TLS and timeouts (never a password);
//! * [`sql`]: every T-SQL statement, as pure functions (golden-tested);
//! * [`convert`]: tiberius cells to [`crate::types::SqlValue`]s and catalog rows to types;
//! * [`client`]: connections, isolation, retries and the trait implementation;
//! * [`grants`]: the least grants a login needs, and the statement a permission error asks for;
//! * [`windows_zones`]: Windows zone names to IANA names.
//!
//! Nothing here writes to the server: a read-only login with per-object grants
//! is enough, no `SELECT ON SCHEMA::cdc` (see docs/sqlserver.md and [`grants`]).

pub mod client;
pub mod config;
pub mod convert;
pub mod grants;
pub mod sql;
pub mod windows_zones;

pub use client::{resolve_zone, MssqlSource};
pub use config::{Encrypt, MssqlConfig, Trust, PASSWORD_ENV};
