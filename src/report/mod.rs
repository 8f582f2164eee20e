//! `report --out DIR`: a page per table that a person opens in a browser to
//! see how the stream has gone, drawn from the Delta tables alone.
//!
//! Why from Delta alone: a report is wanted most when something is wrong,
//! the source unreachable among it. It reads the facts table (every batch,
//! snapshot wave and event) and the reconcile report, never the source, and
//! writes nothing to either.
//!
//! Why a page with no script: it is opened from an object store, a CI
//! artifact or an e-mail, often where no network reaches. Each page holds
//! its styles and its charts (inline SVG, [`chart`]) whole.
//!
//! What it shows, per table:
//! - the stream: the lag at each batch (the batch's commit in bronze minus
//!   the source commit time of its last change: how long a change waited),
//!   the rows per batch, and the headroom before CDC cleanup, with the
//!   events (recoveries, skipped ranges, snapshots, capture instance
//!   switches) as rules across them;
//! - the snapshots: rows and throughput of every chunked wave (a wave's
//!   time is its slowest chunk's read, the chunks being read at once), and
//!   each snapshot's totals;
//! - every event, in order;
//! - the reconcile verdicts: differences per run, a clean run drawn apart.
//!
//! `DIR/index.html` lists the tables of the call (one, or a fleet's with
//! `--all`), each linked to its page.

pub mod chart;

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};

use crate::delta::facts::{self, FactRow};
use crate::error::{StepError, StepResult};
use crate::workflow::Workflow;
use chart::{esc, fmt_value, CategoryChart, Marks, Point, Rule, TimeChart};

/// The facts events a page lists (a chunk's and a plan's rows are drawn as
/// waves instead: a snapshot has thousands of them).
const LISTED_EVENTS: &[&str] = &[
    facts::EVENT_BOOTSTRAP,
    facts::EVENT_RESNAPSHOT,
    facts::EVENT_SNAPSHOT_OPEN,
    facts::EVENT_RECOVERY,
    facts::EVENT_RESNAPSHOT_FAILED,
    facts::EVENT_DATA_SKIPPED,
    facts::EVENT_CAPTURE_INSTANCE_SWITCHED,
    facts::EVENT_SCHEMA_CHANGE,
];

/// One micro-batch, as the stream charts draw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchPoint {
    pub generation: i32,
    pub batch_id: i64,
    pub at: DateTime<Utc>,
    pub rows: i64,
    /// `at` minus the source commit time of the batch's last LSN.
    pub lag_seconds: Option<f64>,
    pub headroom_seconds: Option<f64>,
    pub range: String,
}

/// One wave of a chunked snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WavePoint {
    pub snapshot: String,
    pub wave: i64,
    pub at: DateTime<Utc>,
    pub chunks: usize,
    pub rows: i64,
    /// The slowest chunk's read: the chunks of a wave are read at once.
    pub seconds: Option<f64>,
}

impl WavePoint {
    pub fn rows_per_second(&self) -> Option<f64> {
        self.seconds.filter(|s| *s > 0.0).map(|s| self.rows as f64 / s)
    }
}

/// One event row of the facts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventPoint {
    pub event: String,
    pub generation: i32,
    pub at: DateTime<Utc>,
    pub rows: Option<i64>,
    pub seconds: Option<f64>,
    pub lsn: Option<String>,
    pub lost_from: Option<DateTime<Utc>>,
    pub lost_to: Option<DateTime<Utc>>,
    pub detail: Option<Value>,
}

/// One reconcile run's summary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReconcilePoint {
    pub run: i64,
    pub at: Option<DateTime<Utc>>,
    pub clean: Option<bool>,
    /// Every class but IN_FLIGHT and SNAPSHOT_PENDING, summed.
    pub differences: u64,
    pub in_flight: u64,
    pub counts: BTreeMap<String, u64>,
}

/// What a table's page shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReportData {
    pub table: String,
    pub app_id: String,
    pub batches: Vec<BatchPoint>,
    pub waves: Vec<WavePoint>,
    pub events: Vec<EventPoint>,
    pub reconciles: Vec<ReconcilePoint>,
}

fn when(r: &FactRow) -> Option<DateTime<Utc>> {
    r.recorded_at.or(r.commit_ts)
}

impl ReportData {
    /// The page's data from a table's facts rows (any order, any app id:
    /// those of `app_id` are kept) and its reconcile summaries.
    pub fn from_rows(table: &str, app_id: &str, rows: &[FactRow], reconciles: Vec<ReconcilePoint>) -> ReportData {
        let rows: Vec<&FactRow> = rows.iter().filter(|r| r.app_id == app_id).collect();
        let mut batches: Vec<BatchPoint> = rows
            .iter()
            .filter(|r| r.event.is_none())
            .filter_map(|r| {
                let at = when(r)?;
                Some(BatchPoint {
                    generation: r.generation,
                    batch_id: r.batch_id?,
                    at,
                    rows: r.rows.unwrap_or(0),
                    lag_seconds: r.commit_ts.map(|c| ((at - c).num_milliseconds() as f64 / 1000.0).max(0.0)),
                    headroom_seconds: r.headroom_seconds,
                    range: match (r.min_lsn, r.max_lsn) {
                        (Some(a), Some(b)) => format!("{}..{}", a.to_hex(), b.to_hex()),
                        _ => String::new(),
                    },
                })
            })
            .collect();
        batches.sort_by_key(|b| (b.at, b.generation, b.batch_id));

        // Waves: the chunk rows grouped by (snapshot, wave).
        let mut waves: BTreeMap<(String, i64), WavePoint> = BTreeMap::new();
        for r in rows.iter().filter(|r| r.event.as_deref() == Some(crate::engine::rules::EVENT_SNAPSHOT_CHUNK)) {
            let d = r.detail.as_ref();
            let snapshot = d.and_then(|d| d.get("snapshot")).and_then(Value::as_str).map(str::to_string).or_else(|| r.max_lsn.map(|l| l.to_hex()));
            let wave = d.and_then(|d| d.get("wave")).and_then(Value::as_i64);
            let (Some(snapshot), Some(wave), Some(at)) = (snapshot, wave, when(r)) else { continue };
            let w = waves.entry((snapshot.clone(), wave)).or_insert(WavePoint { snapshot, wave, at, chunks: 0, rows: 0, seconds: None });
            w.chunks += 1;
            w.rows += r.rows.unwrap_or(0);
            w.at = w.at.max(at);
            if let Some(ms) = r.duration_ms {
                w.seconds = Some(w.seconds.unwrap_or(0.0).max(ms as f64 / 1000.0));
            }
        }
        let mut waves: Vec<WavePoint> = waves.into_values().collect();
        waves.sort_by(|a, b| (a.at, &a.snapshot, a.wave).cmp(&(b.at, &b.snapshot, b.wave)));

        let mut events: Vec<EventPoint> = rows
            .iter()
            .filter(|r| r.event.as_deref().is_some_and(|e| LISTED_EVENTS.contains(&e)))
            .filter_map(|r| {
                Some(EventPoint {
                    event: r.event.clone()?,
                    generation: r.generation,
                    at: when(r)?,
                    rows: r.rows,
                    seconds: r.duration_ms.map(|ms| ms as f64 / 1000.0),
                    lsn: r.max_lsn.map(|l| l.to_hex()),
                    lost_from: r.lost_from_ts,
                    lost_to: r.lost_to_ts,
                    detail: r.detail.clone(),
                })
            })
            .collect();
        events.sort_by(|a, b| (a.at, a.generation, &a.event).cmp(&(b.at, b.generation, &b.event)));
        let mut reconciles = reconciles;
        reconciles.sort_by_key(|r| r.run);
        ReportData { table: table.to_string(), app_id: app_id.to_string(), batches, waves, events, reconciles }
    }

    /// The figures the index and the step's JSON give of the table.
    pub fn summary(&self) -> Value {
        let last = self.batches.last();
        let last_reconcile = self.reconciles.last();
        json!({
            "batches": self.batches.len(),
            "rows_streamed": self.batches.iter().map(|b| b.rows).sum::<i64>(),
            "generations": self.batches.iter().map(|b| b.generation).chain(self.events.iter().map(|e| e.generation)).max().map(|g| g + 1).unwrap_or(0),
            "last_batch_at": last.map(|b| b.at),
            "last_lag_seconds": last.and_then(|b| b.lag_seconds),
            "last_headroom_seconds": last.and_then(|b| b.headroom_seconds),
            "waves": self.waves.len(),
            "snapshot_rows": self.waves.iter().map(|w| w.rows).sum::<i64>(),
            "events": self.events.len(),
            "recoveries": self.events.iter().filter(|e| e.event == facts::EVENT_RECOVERY).count(),
            "skipped_ranges": self.events.iter().filter(|e| e.event == facts::EVENT_DATA_SKIPPED).count(),
            "reconcile_runs": self.reconciles.len(),
            "last_reconcile_clean": last_reconcile.and_then(|r| r.clean),
        })
    }
}

/// The tone of an event's rule and row: loss is `bad`, a snapshot `ok`.
fn event_tone(event: &str) -> &'static str {
    match event {
        facts::EVENT_RECOVERY | facts::EVENT_RESNAPSHOT_FAILED | facts::EVENT_DATA_SKIPPED => "bad",
        facts::EVENT_BOOTSTRAP | facts::EVENT_RESNAPSHOT => "ok",
        _ => "info",
    }
}

const STYLE: &str = r#"
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2430; margin: 24px auto; max-width: 960px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 6px; border-bottom: 1px solid #d8dde6; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 16px 0 4px; color: #3a4556; }
.sub { color: #5b6575; margin: 0 0 14px; } .empty { color: #5b6575; font-style: italic; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; } th, td { padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { color: #5b6575; font-weight: 600; border-bottom: 1px solid #d8dde6; } td.num, th.num { text-align: right; }
.figures td:first-child { color: #5b6575; padding-right: 18px; }
svg.chart { display: block; max-width: 100%; height: auto; background: #fbfcfe; border: 1px solid #e3e7ee; }
svg .grid { stroke: #e6e9ef; stroke-width: 1; } svg .tick { fill: #5b6575; font-size: 11px; } svg .axis-label { fill: #3a4556; font-size: 12px; }
svg rect.mark { fill: #3b73c4; } svg circle.mark { fill: #3b73c4; } svg .line { fill: none; stroke: #3b73c4; stroke-width: 1.5; }
svg .mark.bad, svg rect.mark.bad { fill: #c43b3b; } svg .mark.ok, svg rect.mark.ok { fill: #2f9a55; }
svg .rule { stroke-width: 1.5; stroke-dasharray: 4 3; } svg .rule.bad { stroke: #c43b3b; } svg .rule.ok { stroke: #2f9a55; } svg .rule.info { stroke: #8a6bc4; }
tr.bad td:first-child { color: #c43b3b; font-weight: 600; } tr.ok td:first-child { color: #2f9a55; }
code { font-size: 12px; } td code { word-break: break-all; } td code.id { word-break: normal; white-space: nowrap; } a { color: #2d5fa8; }
"#;

fn page_head(out: &mut String, title: &str) {
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{}</title><style>{STYLE}</style></head><body>",
        esc(title)
    );
}

/// The unit a series of seconds reads best in: (seconds per unit, name).
fn duration_unit(seconds: impl Iterator<Item = f64>) -> (f64, &'static str) {
    let max = seconds.fold(0.0, f64::max);
    if max >= 2.0 * 3600.0 {
        (3600.0, "hours")
    } else if max >= 120.0 {
        (60.0, "minutes")
    } else {
        (1.0, "seconds")
    }
}

/// Seconds as a person reads them: `0.12 s`, `14.5 min`, `36.2 h`.
fn fmt_duration(seconds: Option<f64>) -> String {
    match seconds {
        None => "–".into(),
        Some(s) => {
            let (div, unit) = duration_unit(std::iter::once(s));
            let short = match unit {
                "hours" => "h",
                "minutes" => "min",
                _ => "s",
            };
            format!("{} {short}", fmt_value(s / div))
        }
    }
}

fn opt_num(v: Option<f64>) -> String {
    v.map(fmt_value).unwrap_or_else(|| "–".into())
}

fn chart_or_empty(out: &mut String, svg: Option<String>, empty: &str) {
    match svg {
        Some(s) => out.push_str(&s),
        None => {
            let _ = write!(out, r#"<p class="empty">{}</p>"#, esc(empty));
        }
    }
}

/// A table's page.
pub fn page(data: &ReportData, generated_at: DateTime<Utc>) -> String {
    let mut out = String::new();
    page_head(&mut out, &format!("{} · mssql-cdc report", data.table));
    let s = data.summary();
    let _ = write!(
        out,
        r#"<h1>{}</h1><p class="sub">app id <code>{}</code> · drawn from the facts table and the reconcile report at {} · <a href="index.html">all tables</a></p>"#,
        esc(&data.table),
        esc(&data.app_id),
        generated_at.format("%Y-%m-%d %H:%M:%S UTC")
    );
    let figures: Vec<(&str, String)> = vec![
        ("batches", fmt_value(s["batches"].as_f64().unwrap_or(0.0))),
        ("change rows streamed", fmt_value(s["rows_streamed"].as_f64().unwrap_or(0.0))),
        ("generations", s["generations"].to_string()),
        ("last batch", data.batches.last().map(|b| b.at.format("%Y-%m-%d %H:%M:%S UTC").to_string()).unwrap_or_else(|| "–".into())),
        ("lag at the last batch", fmt_duration(s["last_lag_seconds"].as_f64())),
        ("headroom at the last batch", fmt_duration(s["last_headroom_seconds"].as_f64())),
        ("snapshot waves · rows", format!("{} · {}", s["waves"], fmt_value(s["snapshot_rows"].as_f64().unwrap_or(0.0)))),
        ("recoveries · skipped ranges", format!("{} · {}", s["recoveries"], s["skipped_ranges"])),
        (
            "last reconcile",
            match data.reconciles.last() {
                Some(r) => format!("run {}: {}", r.run, verdict(r)),
                None => "–".into(),
            },
        ),
    ];
    out.push_str(r#"<table class="figures">"#);
    for (k, v) in figures {
        let _ = write!(out, "<tr><td>{}</td><td>{}</td></tr>", esc(k), esc(&v));
    }
    out.push_str("</table>");

    let rules: Vec<Rule> = data.events.iter().map(|e| Rule { at: e.at, label: format!("{} (generation {})", e.event, e.generation), tone: event_tone(&e.event) }).collect();
    let batch_note = |b: &BatchPoint| format!("batch {} of generation {}, LSN {}", b.batch_id, b.generation, b.range);
    out.push_str("<h2 id=\"stream\">Stream</h2>");
    if data.batches.is_empty() {
        out.push_str(r#"<p class="empty">No micro-batch yet: the stream has not committed one.</p>"#);
    } else {
        let (div, unit) = duration_unit(data.batches.iter().filter_map(|b| b.lag_seconds));
        let _ = write!(out, "<h3>Lag at each batch ({unit} from a change's commit on the source to the batch's commit in bronze)</h3>");
        let lag: Vec<Point> = data
            .batches
            .iter()
            .filter_map(|b| Some(Point { at: b.at, value: b.lag_seconds? / div, note: batch_note(b), tone: None }))
            .collect();
        let y_label = format!("lag ({unit})");
        chart_or_empty(&mut out, chart::time_chart(&TimeChart { id: "lag", y_label: &y_label, marks: Marks::Line, points: &lag, rules: &rules }), "No batch has a commit time.");
        out.push_str("<h3>Change rows per batch</h3>");
        let rows: Vec<Point> = data.batches.iter().map(|b| Point { at: b.at, value: b.rows as f64, note: batch_note(b), tone: None }).collect();
        chart_or_empty(&mut out, chart::time_chart(&TimeChart { id: "rows", y_label: "rows", marks: Marks::Bars, points: &rows, rules: &rules }), "");
        let (div, unit) = duration_unit(data.batches.iter().filter_map(|b| b.headroom_seconds));
        let _ = write!(out, "<h3>Headroom before CDC cleanup reaches the stream's position ({unit})</h3>");
        let headroom: Vec<Point> = data
            .batches
            .iter()
            .filter_map(|b| Some(Point { at: b.at, value: b.headroom_seconds? / div, note: batch_note(b), tone: None }))
            .collect();
        let y_label = format!("headroom ({unit})");
        chart_or_empty(
            &mut out,
            chart::time_chart(&TimeChart { id: "headroom", y_label: &y_label, marks: Marks::Line, points: &headroom, rules: &rules }),
            "No batch recorded its headroom (the capture instance's min LSN had no commit time).",
        );
    }

    out.push_str("<h2 id=\"snapshots\">Snapshots</h2>");
    if data.waves.is_empty() {
        out.push_str(r#"<p class="empty">No chunked snapshot wave yet.</p>"#);
    } else {
        // Waves in the order read, on a category axis: a fast source reads
        // many in one second, which a time axis would pile on one another.
        let mut snapshots: Vec<&str> = Vec::new();
        for w in &data.waves {
            if !snapshots.contains(&w.snapshot.as_str()) {
                snapshots.push(&w.snapshot);
            }
        }
        let label = |w: &WavePoint| match snapshots.iter().position(|s| *s == w.snapshot) {
            Some(i) if snapshots.len() > 1 => format!("#{} w{}", i + 1, w.wave),
            _ => format!("w{}", w.wave),
        };
        let wave_note = |w: &WavePoint| format!("snapshot {}, {} chunks, read in {} s, done {}", w.snapshot, w.chunks, opt_num(w.seconds), w.at.format("%Y-%m-%d %H:%M:%S UTC"));
        out.push_str("<h3>Rows per wave, in the order read</h3>");
        let rows: Vec<(String, f64, String, Option<&'static str>)> = data.waves.iter().map(|w| (label(w), w.rows as f64, wave_note(w), None)).collect();
        chart_or_empty(&mut out, chart::category_chart(&CategoryChart { id: "wave-rows", y_label: "rows", bars: &rows }), "");
        out.push_str("<h3>Throughput per wave (rows a second of its slowest chunk's read)</h3>");
        let speed: Vec<(String, f64, String, Option<&'static str>)> =
            data.waves.iter().filter_map(|w| Some((label(w), w.rows_per_second()?, wave_note(w), None))).collect();
        chart_or_empty(&mut out, chart::category_chart(&CategoryChart { id: "wave-throughput", y_label: "rows/s", bars: &speed }), "No wave recorded its read time.");
    }
    let completions: Vec<&EventPoint> = data.events.iter().filter(|e| e.event == facts::EVENT_BOOTSTRAP || e.event == facts::EVENT_RESNAPSHOT).collect();
    if !completions.is_empty() {
        out.push_str("<h3>Completed snapshots</h3><table><tr><th>completed</th><th>kind</th><th class=\"num\">generation</th><th>LSN</th><th class=\"num\">rows</th><th class=\"num\">seconds</th><th class=\"num\">rows/s</th></tr>");
        for e in completions {
            let speed = match (e.rows, e.seconds) {
                (Some(r), Some(s)) if s > 0.0 => fmt_value(r as f64 / s),
                _ => "–".into(),
            };
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td><code>{}</code></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                e.at.format("%Y-%m-%d %H:%M:%S"),
                esc(&e.event),
                e.generation,
                esc(e.lsn.as_deref().unwrap_or("")),
                e.rows.map(|r| fmt_value(r as f64)).unwrap_or_else(|| "–".into()),
                opt_num(e.seconds),
                speed
            );
        }
        out.push_str("</table>");
    }

    out.push_str("<h2 id=\"events\">Events</h2>");
    if data.events.is_empty() {
        out.push_str(r#"<p class="empty">No event yet.</p>"#);
    } else {
        out.push_str("<table id=\"event-list\"><tr><th>event</th><th>at (UTC)</th><th class=\"num\">generation</th><th>LSN</th><th>changes lost between</th><th>detail</th></tr>");
        for e in &data.events {
            let lost = match (e.lost_from, e.lost_to) {
                (Some(a), Some(b)) => format!("{} and {}", a.format("%Y-%m-%d %H:%M:%S"), b.format("%Y-%m-%d %H:%M:%S")),
                _ => String::new(),
            };
            let detail = e.detail.as_ref().map(|d| d.to_string()).unwrap_or_default();
            let detail = if detail.chars().count() > 160 { format!("{}…", detail.chars().take(160).collect::<String>()) } else { detail };
            let _ = write!(
                out,
                "<tr class=\"{}\"><td>{}</td><td>{}</td><td class=\"num\">{}</td><td><code>{}</code></td><td>{}</td><td><code>{}</code></td></tr>",
                event_tone(&e.event),
                esc(&e.event),
                e.at.format("%Y-%m-%d %H:%M:%S"),
                e.generation,
                esc(e.lsn.as_deref().unwrap_or("")),
                esc(&lost),
                esc(&detail)
            );
        }
        out.push_str("</table>");
    }

    out.push_str("<h2 id=\"reconcile\">Reconcile</h2>");
    if data.reconciles.is_empty() {
        out.push_str(r#"<p class="empty">No reconcile run yet (or the workflow has no silver table).</p>"#);
    } else {
        out.push_str("<h3>Differences per run (a clean run in green, others in red; IN_FLIGHT and SNAPSHOT_PENDING are not differences)</h3>");
        let bars: Vec<(String, f64, String, Option<&'static str>)> = data
            .reconciles
            .iter()
            .map(|r| {
                let tone = match r.clean {
                    Some(true) => Some("ok"),
                    Some(false) => Some("bad"),
                    None => None,
                };
                (format!("run {}", r.run), r.differences as f64, verdict(r), tone)
            })
            .collect();
        chart_or_empty(&mut out, chart::category_chart(&CategoryChart { id: "reconcile-runs", y_label: "differences", bars: &bars }), "");
        out.push_str("<table><tr><th>run</th><th>checked at (UTC)</th><th>verdict</th><th>counts</th></tr>");
        for r in data.reconciles.iter().rev().take(50) {
            let counts: Vec<String> = r.counts.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")).collect();
            let _ = write!(
                out,
                "<tr class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                if r.clean == Some(false) { "bad" } else { "ok" },
                r.run,
                r.at.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_default(),
                esc(&verdict(r)),
                esc(&counts.join(", "))
            );
        }
        out.push_str("</table>");
    }
    out.push_str("</body></html>\n");
    out
}

fn verdict(r: &ReconcilePoint) -> String {
    match r.clean {
        Some(true) if r.in_flight > 0 => format!("clean ({} in flight)", r.in_flight),
        Some(true) => "clean".into(),
        Some(false) => format!("{} differences", r.differences),
        None => "unknown".into(),
    }
}

/// The file name of a table's page: its app id where that is a safe file
/// name, or the app id's safe characters and a hash that keeps two apart.
pub fn page_file(app_id: &str) -> String {
    let safe: String = app_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' }).collect();
    if safe == app_id && !safe.starts_with('.') && safe != "index" {
        return format!("{safe}.html");
    }
    use sha2::Digest;
    let h = sha2::Sha256::digest(app_id.as_bytes());
    format!("{}-{}.html", safe.trim_start_matches('.'), hex::encode(&h[..4]))
}

/// The index page: a line per table from each table's report JSON (or the
/// error that kept its page from being written).
pub fn index(tables: &[(String, String, Value)], generated_at: DateTime<Utc>) -> String {
    let mut out = String::new();
    page_head(&mut out, "mssql-cdc report");
    let _ = write!(
        out,
        r#"<h1>mssql-cdc report</h1><p class="sub">{} table{} · drawn at {}</p>"#,
        tables.len(),
        if tables.len() == 1 { "" } else { "s" },
        generated_at.format("%Y-%m-%d %H:%M:%S UTC")
    );
    out.push_str(
        "<table id=\"tables\"><tr><th>table</th><th>app id</th><th class=\"num\">batches</th><th class=\"num\">rows streamed</th><th>last batch (UTC)</th>\
         <th class=\"num\">lag (s)</th><th class=\"num\">headroom (h)</th><th class=\"num\">recoveries</th><th>last reconcile</th></tr>",
    );
    for (table, app_id, v) in tables {
        if let Some(e) = v.get("error").and_then(Value::as_str) {
            let _ = write!(out, "<tr class=\"bad\"><td>{}</td><td><code class=\"id\">{}</code></td><td colspan=\"7\">{}</td></tr>", esc(table), esc(app_id), esc(e));
            continue;
        }
        let page = v.get("page_file").and_then(Value::as_str).unwrap_or("");
        let s = &v["summary"];
        let last_reconcile = match s["last_reconcile_clean"].as_bool() {
            Some(true) => "clean",
            Some(false) => "differences",
            None => "–",
        };
        let last_at = s["last_batch_at"].as_str().and_then(|t| DateTime::parse_from_rfc3339(t).ok()).map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string());
        let _ = write!(
            out,
            "<tr class=\"{}\"><td><a href=\"{}\">{}</a></td><td><code class=\"id\">{}</code></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            if s["last_reconcile_clean"].as_bool() == Some(false) || s["recoveries"].as_u64().unwrap_or(0) > 0 { "bad" } else { "ok" },
            esc(page),
            esc(table),
            esc(app_id),
            s["batches"],
            fmt_value(s["rows_streamed"].as_f64().unwrap_or(0.0)),
            esc(&last_at.unwrap_or_else(|| "–".into())),
            opt_num(s["last_lag_seconds"].as_f64()),
            opt_num(s["last_headroom_seconds"].as_f64().map(|x| x / 3600.0)),
            s["recoveries"],
            last_reconcile
        );
    }
    out.push_str("</table></body></html>\n");
    out
}

/// The reconcile summaries of `app_id`, oldest run first; none when the
/// workflow has no silver table or reconcile never ran.
async fn reconcile_summaries(wf: &Workflow, storage: &std::collections::HashMap<String, String>) -> StepResult<Vec<ReconcilePoint>> {
    let Ok(location) = wf.reconcile_location() else {
        return Ok(Vec::new());
    };
    let Some(table) = crate::delta::peek_existing(&location, storage).await? else {
        return Ok(Vec::new());
    };
    let sql = format!("SELECT run, detail, checked_at FROM t WHERE app_id = {} AND class = 'SUMMARY' ORDER BY run", crate::delta::sql_str(&wf.app_id));
    let batches = crate::delta::query(&table, &sql).await?;
    crate::delta::reconcile::summaries_from_batches(&batches, &location)?
        .into_iter()
        .map(|(run, detail, at)| {
            let counts: BTreeMap<String, u64> = detail
                .as_ref()
                .and_then(|d| d.get("counts"))
                .and_then(Value::as_object)
                .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_u64()?))).collect())
                .unwrap_or_default();
            let in_flight = counts.get("IN_FLIGHT").copied().unwrap_or(0);
            let differences = counts.iter().filter(|(k, _)| crate::engine::reconcile::is_difference(k)).map(|(_, n)| n).sum();
            Ok(ReconcilePoint { run, at, clean: detail.as_ref().and_then(|d| d.get("clean")).and_then(Value::as_bool), differences, in_flight, counts })
        })
        .collect()
}

/// Reads a workflow's tables (never its source) and returns its page's data.
pub async fn load(wf: &Workflow) -> StepResult<ReportData> {
    let storage = wf.storage_options()?;
    let table = wf.table_name().to_string();
    let rows = match crate::delta::peek_existing(&wf.target.facts, &storage).await? {
        Some(f) => {
            crate::delta::check_kind(&f, &wf.target.facts, crate::delta::TableKind::Facts)?;
            crate::delta::facts_read::rows_of(&f, &wf.app_id).await?
        }
        None => Vec::new(),
    };
    let reconciles = reconcile_summaries(wf, &storage).await?;
    Ok(ReportData::from_rows(&table, &wf.app_id, &rows, reconciles))
}

/// Makes the output folder (and its parents), or says why it cannot.
pub fn prepare_out(out: &Path) -> StepResult<()> {
    if out.exists() && !out.is_dir() {
        return Err(StepError::Config(format!("--out {} is a file: name a folder (it is made if missing)", out.display())));
    }
    std::fs::create_dir_all(out).map_err(|e| StepError::Config(format!("cannot make the folder {}: {e}. Pass --out a folder you can write", out.display())))
}

fn write_file(path: &Path, text: &str) -> StepResult<()> {
    crate::fleet::status::write_atomically(path, text).map_err(|e| StepError::Config(format!("cannot write {}: {e}. Pass --out a folder you can write", path.display())))
}

/// The `report` step on one workflow: writes its page into `out` and
/// returns the step's JSON (the index is written by the caller, which
/// knows every table of the call).
pub async fn run(wf: &Workflow, out: &Path) -> StepResult<Value> {
    prepare_out(out)?;
    let data = load(wf).await?;
    let file = page_file(&wf.app_id);
    let path: PathBuf = out.join(&file);
    write_file(&path, &page(&data, Utc::now()))?;
    Ok(json!({
        "step": "report",
        "app_id": wf.app_id,
        "table": data.table,
        "page": path.display().to_string(),
        "page_file": file,
        "summary": data.summary(),
    }))
}

/// Writes `out/index.html` for the tables of a call; returns its path.
pub fn write_index(out: &Path, tables: &[(String, String, Value)]) -> StepResult<PathBuf> {
    prepare_out(out)?;
    let path = out.join("index.html");
    write_file(&path, &index(tables, Utc::now()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_790_000_000 + s, 0).unwrap()
    }

    fn batch(app: &str, generation: i32, id: i64, at: i64, rows: i64) -> FactRow {
        FactRow {
            app_id: app.into(),
            generation,
            batch_id: Some(id),
            rows: Some(rows),
            min_lsn: Some(Lsn::parse("0x0000002a000000100002").unwrap()),
            max_lsn: Some(Lsn::parse("0x0000002a000000200002").unwrap()),
            commit_ts: Some(t(at - 3)),
            recorded_at: Some(t(at)),
            headroom_seconds: Some(7200.0),
            ..Default::default()
        }
    }

    fn chunk(snapshot: &str, wave: i64, chunk: i64, at: i64, rows: i64, ms: i64) -> FactRow {
        FactRow {
            app_id: "a".into(),
            event: Some(crate::engine::rules::EVENT_SNAPSHOT_CHUNK.into()),
            rows: Some(rows),
            duration_ms: Some(ms),
            recorded_at: Some(t(at)),
            detail: Some(json!({"snapshot": snapshot, "wave": wave, "chunk": chunk})),
            ..Default::default()
        }
    }

    #[test]
    fn batches_waves_and_events_come_from_the_apps_rows_only() {
        let mut rows = vec![batch("a", 0, 2, 20, 5), batch("a", 0, 1, 10, 0), batch("other", 0, 1, 10, 99)];
        rows.push(chunk("S1", 0, 0, 30, 100, 2_000));
        rows.push(chunk("S1", 0, 1, 31, 300, 4_000));
        rows.push(chunk("S1", 1, 2, 40, 50, 500));
        rows.push(FactRow { app_id: "a".into(), generation: 1, event: Some(facts::EVENT_RECOVERY.into()), recorded_at: Some(t(50)), ..Default::default() });
        rows.push(FactRow { app_id: "a".into(), event: Some("snapshot_plan".into()), recorded_at: Some(t(29)), ..Default::default() });
        let d = ReportData::from_rows("dbo.t", "a", &rows, vec![]);
        assert_eq!(d.batches.iter().map(|b| (b.batch_id, b.rows)).collect::<Vec<_>>(), vec![(1, 0), (2, 5)]);
        assert_eq!(d.batches[0].lag_seconds, Some(3.0));
        assert_eq!(d.waves.len(), 2);
        assert_eq!((d.waves[0].chunks, d.waves[0].rows, d.waves[0].seconds), (2, 400, Some(4.0)));
        assert_eq!(d.waves[0].rows_per_second(), Some(100.0));
        assert_eq!(d.events.iter().map(|e| e.event.as_str()).collect::<Vec<_>>(), vec!["recovery"]);
        let s = d.summary();
        assert_eq!((s["batches"].as_u64(), s["rows_streamed"].as_i64(), s["generations"].as_i64(), s["recoveries"].as_u64()), (Some(2), Some(5), Some(2), Some(1)));
    }

    #[test]
    fn the_page_draws_a_mark_per_batch_and_wave_and_names_every_event() {
        let mut rows: Vec<FactRow> = (1..=30).map(|i| batch("a", 0, i, i * 10, i % 4)).collect();
        rows.push(chunk("S1", 0, 0, 5, 10, 1_000));
        rows.push(FactRow { app_id: "a".into(), event: Some(facts::EVENT_DATA_SKIPPED.into()), recorded_at: Some(t(150)), ..Default::default() });
        let rec = vec![
            ReconcilePoint { run: 1, at: Some(t(200)), clean: Some(false), differences: 3, in_flight: 0, counts: BTreeMap::from([("RECORD_DIFF".into(), 3)]) },
            ReconcilePoint { run: 2, at: Some(t(300)), clean: Some(true), differences: 0, in_flight: 1, counts: BTreeMap::from([("IN_FLIGHT".into(), 1)]) },
        ];
        let d = ReportData::from_rows("dbo.t", "a", &rows, rec);
        let html = page(&d, t(400));
        let marks_in = |id: &str| {
            let start = html.find(&format!(r#"id="{id}""#)).unwrap_or_else(|| panic!("no chart {id}"));
            let end = start + html[start..].find("</svg>").unwrap();
            html[start..end].matches(r#"class="mark"#).count()
        };
        assert_eq!(marks_in("lag"), 30);
        assert_eq!(marks_in("rows"), 30);
        assert_eq!(marks_in("headroom"), 30);
        assert_eq!(marks_in("wave-rows"), 1);
        assert_eq!(marks_in("reconcile-runs"), 2);
        assert!(html.contains("data_skipped") && html.contains(r#"class="rule bad""#));
        assert!(!html.contains("<script"), "the page needs no script");
        assert!(!html.contains("http://") || html.matches("http://").count() == html.matches("http://www.w3.org/2000/svg").count(), "no network reference");
    }

    #[test]
    fn an_empty_stream_is_said_in_words_not_drawn() {
        let d = ReportData::from_rows("dbo.t", "a", &[], vec![]);
        let html = page(&d, t(0));
        assert!(!html.contains("<svg"));
        assert!(html.contains("No micro-batch yet"));
    }

    #[test]
    fn page_files_are_safe_and_distinct() {
        assert_eq!(page_file("orders"), "orders.html");
        let a = page_file("sales/orders");
        let b = page_file("sales_orders");
        assert_ne!(a, b);
        assert!(a.starts_with("sales_orders-") && a.ends_with(".html"));
        assert_ne!(page_file("index"), "index.html");
        assert!(!page_file("../x").contains('/'));
    }
}
