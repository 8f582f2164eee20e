//! Golden transition logs: every commit of a table rendered as one line.
//!
//! A deterministic scenario (fixed seed, simulated clock) makes the same
//! commits every run, so the rendered log is a snapshot test of the whole
//! state machine: which step committed what, in which order, with which txn.
//! The line leaves out what varies between runs (wall-clock times, file
//! names, durations) and keeps what the workflow decides.

use deltalake::DeltaTable;
use serde_json::Value;

use crate::error::{StepError, StepResult};

/// Renders every commit of `table`, oldest first, one line each, prefixed by `label`.
pub async fn render(table: &DeltaTable, label: &str) -> StepResult<Vec<String>> {
    let url = table.table_url().to_string();
    let mut lines = Vec::new();
    let Some(latest) = table.version() else { return Ok(lines) };
    for v in 0..=latest {
        let bytes = match table.log_store().read_commit_entry(v).await {
            Ok(Some(b)) => b,
            Ok(None) | Err(deltalake::DeltaTableError::InvalidVersion(_)) => {
                lines.push(format!("{label} v{v} (cleaned up)"));
                continue;
            }
            Err(e) => return Err(StepError::delta(&url)(e)),
        };
        let mut op = String::new();
        let mut txns = Vec::new();
        let mut rows: i64 = 0;
        let mut adds = 0;
        let mut meta = Value::Null;
        let mut schema_change = false;
        for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let a: Value = serde_json::from_slice(line).map_err(|e| StepError::Internal(format!("commit {v}: {e}")))?;
            if let Some(ci) = a.get("commitInfo") {
                op = ci.get("operation").and_then(Value::as_str).unwrap_or("?").to_string();
                meta = ci.get("mssql_cdc").cloned().unwrap_or(Value::Null);
            }
            if let Some(t) = a.get("txn") {
                txns.push(format!(
                    "{}:{}",
                    t.get("appId").and_then(Value::as_str).unwrap_or("?"),
                    t.get("version").and_then(Value::as_i64).unwrap_or(-1)
                ));
            }
            if let Some(add) = a.get("add") {
                adds += 1;
                if let Some(stats) = add.get("stats").and_then(Value::as_str) {
                    if let Ok(s) = serde_json::from_str::<Value>(stats) {
                        rows += s.get("numRecords").and_then(Value::as_i64).unwrap_or(0);
                    }
                }
            }
            if a.get("metaData").is_some() && v > 0 {
                schema_change = true;
            }
        }
        let mut line = format!("{label} v{v} {op}");
        if !txns.is_empty() {
            line.push_str(&format!(" txn={}", txns.join(",")));
        }
        if adds > 0 || op == "WRITE" {
            line.push_str(&format!(" rows={rows}"));
        }
        if schema_change {
            line.push_str(" metadata-changed");
        }
        if !meta.is_null() {
            line.push_str(&format!(" {}", meta));
        }
        lines.push(line);
    }
    Ok(lines)
}
