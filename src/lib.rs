//! mssql-cdc: SQL Server change data capture replicated into Delta Lake, as a
//! durable workflow of idempotent steps. See docs/ARCHITECTURE.md for the map.

pub mod lsn;
pub mod mssql;
pub mod source;
pub mod types;
