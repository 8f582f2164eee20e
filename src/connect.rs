//! From a workflow's source URL to a source: the one place that knows both
//! implementations of the source protocol (`crate::sim`, `crate::mssql`),
//! so the protocol (`crate::source`) imports neither of them.

use std::sync::Arc;

use crate::source::{SharedSource, SourceError, SourceSecrets};

/// Opens the source a workflow's URL names: `sim://PATH` (as the database
/// owner, or `sim://PATH?user=NAME` as that database user) or `mssql://…`
/// (or an ADO string).
pub async fn open_source(url: &str, secrets: SourceSecrets) -> Result<SharedSource, SourceError> {
    if url.starts_with("sim://") {
        return Ok(Arc::new(crate::sim::SimSource::from_url(url)?));
    }
    if url.starts_with("mssql://") || url.contains('=') {
        return Ok(Arc::new(crate::mssql::MssqlSource::connect(url, secrets).await?));
    }
    Err(SourceError::Config(format!("'{url}' is not a source URL: use sim://PATH or mssql://USER@HOST:PORT/DATABASE")))
}
