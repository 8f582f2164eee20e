//! The step layer's error, and the exit code each kind maps to.
//!
//! Exit codes are a contract with the orchestrator (README, "Exit codes"):
//! - 0: done, or progress made (the JSON says whether to call again);
//! - 2: bad input or configuration, found before anything was written;
//! - 3: needs a person (data loss the configuration does not let us repair, a
//!   guard that stopped a loop);
//! - 75: a temporary failure: call the same step again later (EX_TEMPFAIL);
//! - 1: a bug, or an error nobody classified: read the message and report it.

use crate::lsn::Lsn;
use crate::source::SourceError;

/// Exit code: success or progress.
pub const EXIT_OK: i32 = 0;
/// Exit code: a bug or an unclassified failure.
pub const EXIT_BUG: i32 = 1;
/// Exit code: bad input or configuration; nothing was written.
pub const EXIT_CONFIG: i32 = 2;
/// Exit code: a person has to decide (data loss, a guard).
pub const EXIT_NEEDS_PERSON: i32 = 3;
/// Exit code: temporary failure; call again later.
pub const EXIT_TEMPORARY: i32 = 75;

/// Why a step stopped without finishing.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// Bad input or configuration; nothing was written.
    #[error("configuration error: {0}")]
    Config(String),
    /// Changes the stream needs were purged by CDC cleanup.
    #[error(
        "data loss: capture instance '{capture_instance}' no longer holds the changes after {position} \
         (the next LSN to read is {next}, but the instance's minimum LSN is now {min_lsn}{times}). \
         The changes in between were purged by CDC cleanup before this stream read them. {advice}"
    )]
    DataLoss {
        capture_instance: String,
        position: Lsn,
        next: Lsn,
        min_lsn: Lsn,
        times: String,
        advice: String,
    },
    /// A person has to decide; the message says what and how.
    #[error("needs a person: {0}")]
    NeedsPerson(String),
    /// A temporary condition; calling the step again later should succeed.
    #[error("temporary failure, call again later: {0}")]
    Temporary(String),
    /// A failpoint fired (crash drills only).
    #[error("failpoint '{0}' fired")]
    Injected(String),
    /// The source failed.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Delta Lake failed.
    #[error("delta table {table}: {source}")]
    Delta {
        table: String,
        #[source]
        source: deltalake::DeltaTableError,
    },
    /// An invariant of our own did not hold: a bug.
    #[error("internal error (a bug, please report it): {0}")]
    Internal(String),
}

impl StepError {
    /// The process exit code for this error (see the module docs).
    pub fn exit_code(&self) -> i32 {
        match self {
            StepError::Config(_) => EXIT_CONFIG,
            StepError::DataLoss { .. } | StepError::NeedsPerson(_) => EXIT_NEEDS_PERSON,
            StepError::Temporary(_) => EXIT_TEMPORARY,
            StepError::Injected(_) => EXIT_TEMPORARY,
            StepError::Source(e) => match e {
                SourceError::Config(_) | SourceError::Permission(_) => EXIT_CONFIG,
                SourceError::RangeUnavailable { .. } => EXIT_NEEDS_PERSON,
                SourceError::Transient(_) => EXIT_TEMPORARY,
                SourceError::Value(_) => EXIT_NEEDS_PERSON,
                SourceError::Other(_) => EXIT_BUG,
            },
            StepError::Delta { source, .. } => match source {
                deltalake::DeltaTableError::ObjectStore { .. } | deltalake::DeltaTableError::Io { .. } => EXIT_TEMPORARY,
                deltalake::DeltaTableError::Transaction { .. } => EXIT_TEMPORARY,
                _ => EXIT_BUG,
            },
            StepError::Internal(_) => EXIT_BUG,
        }
    }

    /// A short machine-readable kind for the JSON result.
    pub fn kind(&self) -> &'static str {
        match self.exit_code() {
            EXIT_CONFIG => "config",
            EXIT_NEEDS_PERSON => "needs_person",
            EXIT_TEMPORARY => "temporary",
            _ => "bug",
        }
    }

    pub fn delta(table: impl Into<String>) -> impl FnOnce(deltalake::DeltaTableError) -> StepError {
        let table = table.into();
        move |source| StepError::Delta { table, source }
    }
}

/// Results of the step layer.
pub type StepResult<T> = Result<T, StepError>;

/// An error with its causes, outermost first.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}
