//! mssql-cdc: SQL Server change data capture replicated into Delta Lake, as a
//! durable workflow of idempotent steps. See docs/ARCHITECTURE.md for the map.

pub mod alloc;
pub mod bench;
pub mod cli;
pub mod connect;
pub mod delta;
pub mod demo;
pub mod engine;
pub mod fleet;
pub mod error;
pub mod lsn;
pub mod mssql;
pub mod progress;
pub mod report;
pub mod seed_copy;
pub mod sim;
pub mod source;
pub mod storage;
pub mod torture;
pub mod types;
pub mod workflow;
