//! `status` for people and for monitoring: one line per table, as an
//! aligned text table or as Prometheus metrics in the node_exporter textfile
//! format, both drawn from each table's `status` JSON (so they can say
//! nothing the JSON does not).
//!
//! A table whose status failed is a line of its own (`error` in the table,
//! `mssql_cdc_up 0` in the metrics): a fleet's monitoring must show the
//! table it cannot read, not drop it.

use chrono::{DateTime, Utc};
use serde_json::Value;

/// What one line says of a table.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusLine {
    pub table: String,
    pub app_id: String,
    /// The state machine's state, e.g. `Streaming`.
    pub state: Option<String>,
    pub generation: Option<i64>,
    pub position: Option<String>,
    pub lag_seconds: Option<f64>,
    pub headroom_seconds: Option<f64>,
    /// The snapshot that holds the snapshot mode: (mode, chunks done, chunks planned).
    pub snapshot: Option<(String, Option<i64>, Option<i64>)>,
    pub last_batch_age_seconds: Option<f64>,
    /// The newest reconcile run: clean or not.
    pub reconcile_clean: Option<bool>,
    /// Why status failed for this table.
    pub error: Option<String>,
}

impl StatusLine {
    /// The line of one table's `status` JSON, `now` dating its last batch.
    pub fn from_status(table: &str, app_id: &str, v: &Value, now: DateTime<Utc>) -> StatusLine {
        let f = |p: &str| v.pointer(p).and_then(Value::as_f64);
        let snapshot = v.pointer("/machine/detail/snapshot").filter(|s| !s.is_null()).map(|s| {
            let mode = s.get("mode").and_then(Value::as_str).unwrap_or("?").to_string();
            let phase = s.get("phase");
            let n = |k: &str| phase.and_then(|p| p.get(k)).and_then(Value::as_i64);
            (mode, n("done"), n("chunks"))
        });
        let last_batch_age_seconds = v
            .pointer("/last_batch/recorded_at")
            .and_then(Value::as_str)
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| ((now - t.with_timezone(&Utc)).num_milliseconds() as f64 / 1000.0).max(0.0));
        StatusLine {
            table: table.to_string(),
            app_id: app_id.to_string(),
            state: v.pointer("/machine/state").and_then(Value::as_str).map(str::to_string),
            generation: v.get("generation").and_then(Value::as_i64),
            position: v.get("position").and_then(Value::as_str).map(str::to_string),
            lag_seconds: f("/lag_seconds"),
            headroom_seconds: f("/headroom_seconds"),
            snapshot,
            last_batch_age_seconds,
            reconcile_clean: v.pointer("/last_reconcile/clean").and_then(Value::as_bool),
            error: None,
        }
    }

    /// The line of a table whose status failed.
    pub fn failed(table: &str, app_id: &str, error: &str) -> StatusLine {
        StatusLine {
            table: table.to_string(),
            app_id: app_id.to_string(),
            state: None,
            generation: None,
            position: None,
            lag_seconds: None,
            headroom_seconds: None,
            snapshot: None,
            last_batch_age_seconds: None,
            reconcile_clean: None,
            error: Some(error.to_string()),
        }
    }
}

fn secs(v: Option<f64>) -> String {
    v.map(|s| format!("{s:.0}")).unwrap_or_else(|| "-".into())
}

/// An aligned text table, a header and one row per table.
pub fn table(lines: &[StatusLine]) -> String {
    let header = ["TABLE", "APP_ID", "STATE", "GEN", "POSITION", "LAG_S", "HEADROOM_H", "SNAPSHOT", "LAST_BATCH_AGE_S", "RECONCILE"];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for l in lines {
        let snapshot = match &l.snapshot {
            None => "-".to_string(),
            Some((mode, Some(done), Some(chunks))) => format!("{mode} {done}/{chunks}"),
            Some((mode, _, _)) => format!("{mode} open"),
        };
        let reconcile = match l.reconcile_clean {
            Some(true) => "clean",
            Some(false) => "DIFFERENCES",
            None => "-",
        };
        let state = match (&l.error, &l.state) {
            (Some(_), _) => "ERROR".to_string(),
            (None, Some(s)) => s.clone(),
            (None, None) => "-".to_string(),
        };
        rows.push(vec![
            l.table.clone(),
            l.app_id.clone(),
            state,
            l.generation.map(|g| g.to_string()).unwrap_or_else(|| "-".into()),
            l.position.clone().unwrap_or_else(|| "-".into()),
            secs(l.lag_seconds),
            l.headroom_seconds.map(|s| format!("{:.1}", s / 3600.0)).unwrap_or_else(|| "-".into()),
            snapshot,
            secs(l.last_batch_age_seconds),
            reconcile.to_string(),
        ]);
    }
    let widths: Vec<usize> = (0..header.len()).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in &rows {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    for l in lines {
        if let Some(e) = &l.error {
            out.push_str(&format!("{}: {e}\n", l.table));
        }
    }
    out
}

/// A label value escaped as the exposition format asks (backslash, double
/// quote and newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Prometheus metrics in the text exposition format (node_exporter's
/// textfile collector reads it from a `.prom` file). A value status does not
/// know is left out, never written as 0.
pub fn prometheus(lines: &[StatusLine]) -> String {
    type Get = fn(&StatusLine) -> Option<f64>;
    let metrics: [(&str, &str, Get); 9] = [
        ("mssql_cdc_up", "1 when status read the table's state, 0 when it failed.", |l| Some(if l.error.is_none() { 1.0 } else { 0.0 })),
        ("mssql_cdc_generation", "The stream's live generation (each recovery or reseed starts one).", |l| l.generation.map(|g| g as f64)),
        ("mssql_cdc_lag_seconds", "Commit time of the source's max LSN minus that of the stream's position.", |l| l.lag_seconds),
        ("mssql_cdc_headroom_seconds", "Commit time of the stream's position minus that of the capture instance's min LSN, read now.", |l| {
            l.headroom_seconds
        }),
        ("mssql_cdc_last_batch_age_seconds", "Seconds since the stream's newest batch was recorded.", |l| l.last_batch_age_seconds),
        ("mssql_cdc_snapshot_open", "1 while a snapshot holds the snapshot mode (being read), else 0.", |l| {
            l.error.is_none().then_some(if l.snapshot.is_some() { 1.0 } else { 0.0 })
        }),
        ("mssql_cdc_snapshot_chunks_done", "Chunks of the open chunked snapshot recorded so far.", |l| l.snapshot.as_ref().and_then(|s| s.1).map(|n| n as f64)),
        ("mssql_cdc_snapshot_chunks", "Chunks the open chunked snapshot was planned into.", |l| l.snapshot.as_ref().and_then(|s| s.2).map(|n| n as f64)),
        ("mssql_cdc_reconcile_clean", "1 when the newest reconcile run found silver equal to the table, 0 when it found differences.", |l| {
            l.reconcile_clean.map(|c| if c { 1.0 } else { 0.0 })
        }),
    ];
    let mut out = String::new();
    for (name, help, get) in metrics {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for l in lines {
            if let Some(v) = get(l) {
                out.push_str(&format!("{name}{{table=\"{}\",app_id=\"{}\"}} {v}\n", label(&l.table), label(&l.app_id)));
            }
        }
    }
    out.push_str("# HELP mssql_cdc_state 1 for the state machine's state the table is in.\n# TYPE mssql_cdc_state gauge\n");
    for l in lines {
        if let Some(s) = &l.state {
            out.push_str(&format!("mssql_cdc_state{{table=\"{}\",app_id=\"{}\",state=\"{}\"}} 1\n", label(&l.table), label(&l.app_id), label(s)));
        }
    }
    out
}

/// Writes `text` to `path` as node_exporter asks of textfiles: to a
/// temporary file beside it, then renamed over it, so a scrape never reads
/// half a file.
pub fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "status".into());
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status() -> Value {
        json!({
            "generation": 1,
            "position": "0x0000002a00000011389d",
            "lag_seconds": 12.4,
            "headroom_seconds": 7200.0,
            "last_batch": {"recorded_at": "2026-12-04T10:00:00Z"},
            "last_reconcile": {"run": 3, "clean": false},
            "machine": {"state": "ChunkedPlanned", "detail": {"snapshot": {"mode": "chunked", "phase": {"phase": "waves", "chunks": 40, "done": 12}}}},
        })
    }

    #[test]
    fn a_line_reads_the_status_json() {
        let now = DateTime::parse_from_rfc3339("2026-12-04T10:01:30Z").unwrap().with_timezone(&Utc);
        let l = StatusLine::from_status("dbo.orders", "orders", &status(), now);
        assert_eq!(l.state.as_deref(), Some("ChunkedPlanned"));
        assert_eq!(l.generation, Some(1));
        assert_eq!(l.snapshot, Some(("chunked".into(), Some(12), Some(40))));
        assert_eq!(l.last_batch_age_seconds, Some(90.0));
        assert_eq!(l.reconcile_clean, Some(false));
        let t = table(&[l.clone(), StatusLine::failed("dbo.x", "x", "cannot reach sql01")]);
        let rows: Vec<&str> = t.lines().collect();
        assert!(rows[0].starts_with("TABLE") && rows[0].contains("HEADROOM_H"), "{t}");
        assert!(rows[1].contains("chunked 12/40") && rows[1].contains("DIFFERENCES") && rows[1].contains(" 2.0 "), "{t}");
        assert!(rows[2].contains("ERROR") && rows[3] == "dbo.x: cannot reach sql01", "{t}");
        assert_eq!(rows[0].find("APP_ID"), rows[1].find("  orders").map(|i| i + 2), "columns are aligned:\n{t}");
    }

    #[test]
    fn metrics_are_the_exposition_format_and_leave_unknown_values_out() {
        let now = DateTime::parse_from_rfc3339("2026-12-04T10:01:30Z").unwrap().with_timezone(&Utc);
        let l = StatusLine::from_status("dbo.\"odd\"", "orders", &status(), now);
        let p = prometheus(&[l, StatusLine::failed("dbo.x", "x", "down")]);
        assert!(p.contains("mssql_cdc_up{table=\"dbo.\\\"odd\\\"\",app_id=\"orders\"} 1\n"), "{p}");
        assert!(p.contains("mssql_cdc_up{table=\"dbo.x\",app_id=\"x\"} 0\n"), "{p}");
        assert!(p.contains("mssql_cdc_headroom_seconds{table=\"dbo.\\\"odd\\\"\",app_id=\"orders\"} 7200\n"), "{p}");
        assert!(!p.contains("mssql_cdc_lag_seconds{table=\"dbo.x\""), "a failed table has no lag line: {p}");
        assert!(p.contains("mssql_cdc_state{table=\"dbo.\\\"odd\\\"\",app_id=\"orders\",state=\"ChunkedPlanned\"} 1\n"), "{p}");
        // Every line is a comment or `name{labels} value`.
        for line in p.lines() {
            assert!(line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line.rsplit_once(' ').is_some_and(|(_, v)| v.parse::<f64>().is_ok()), "{line}");
        }
    }
}
