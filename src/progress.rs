//! Progress bars for the long steps (a full snapshot's read, a backfill's
//! chunks, reconcile's comparison), drawn only when stderr is a terminal.
//!
//! Why only there: an orchestrator's log, a file or a pipe would get
//! carriage returns and escape codes instead of lines. Off a terminal a
//! [`Progress`] is nothing at all (no thread, no clock), so the steps run
//! there exactly as without it; `MSSQL_CDC_PROGRESS=0` turns the bars off on
//! a terminal too.
//!
//! Log lines and bars share stderr: every bar is drawn through one
//! [`indicatif::MultiProgress`], and the log writer ([`LogWriter`], which
//! `cli` gives tracing) hides the bars while it writes a line, so a line is
//! never cut by a bar's redraw.

use std::io::Write;
use std::sync::OnceLock;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

fn multi() -> &'static MultiProgress {
    static MULTI: OnceLock<MultiProgress> = OnceLock::new();
    MULTI.get_or_init(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()))
}

/// Whether bars are drawn: stderr is a terminal and `MSSQL_CDC_PROGRESS`
/// is not `0`.
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var("MSSQL_CDC_PROGRESS").map_or(true, |v| v != "0"))
}

/// One bar, or nothing off a terminal. Clones share the bar.
#[derive(Debug, Default, Clone)]
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// A bar counting `unit` (rows, chunks, buckets) towards `total` when
    /// known (then with rate and ETA), a counter with its rate otherwise.
    pub fn new(label: &str, unit: &str, total: Option<u64>) -> Progress {
        Progress::build(enabled(), label, unit, total)
    }

    fn build(draw: bool, label: &str, unit: &str, total: Option<u64>) -> Progress {
        if !draw {
            return Progress(None);
        }
        let bar = match total {
            Some(t) => ProgressBar::new(t).with_style(
                ProgressStyle::with_template(&format!("{{prefix}} [{{bar:30}}] {{human_pos}}/{{human_len}} {unit} · {{per_sec}} · ETA {{eta}} {{msg}}"))
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            ),
            None => ProgressBar::new_spinner().with_style(
                ProgressStyle::with_template(&format!("{{prefix}} {{spinner}} {{human_pos}} {unit} · {{per_sec}} · {{elapsed}} {{msg}}"))
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            ),
        };
        let bar = multi().add(bar.with_prefix(label.to_string()));
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress(Some(bar))
    }

    /// A bar for a count of rows.
    pub fn rows(label: &str, total: Option<u64>) -> Progress {
        Progress::new(label, "rows", total)
    }

    /// Whether this one is drawn (so a caller can skip work done only for it).
    pub fn is_drawn(&self) -> bool {
        self.0.is_some()
    }

    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.0 {
            b.inc(n);
        }
    }

    pub fn set_position(&self, n: u64) {
        if let Some(b) = &self.0 {
            b.set_position(n);
        }
    }

    /// Text after the counts (e.g. the rows a backfill has read).
    pub fn set_message(&self, msg: String) {
        if let Some(b) = &self.0 {
            b.set_message(msg);
        }
    }
}

impl Progress {
    /// Clears the bar (an unfinished one left by an error stays on screen
    /// as it was, which says where the step stopped).
    pub fn finish(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}

/// stderr for tracing, hiding the bars while a log line is written.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if enabled() {
            multi().suspend(|| std::io::stderr().write_all(buf))?;
        } else {
            std::io::stderr().write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;

    fn make_writer(&'a self) -> LogWriter {
        LogWriter
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_progress_not_drawn_is_nothing() {
        let p = Progress::build(false, "x", "rows", Some(10));
        assert!(!p.is_drawn());
        p.inc(5);
        p.set_position(7);
        p.set_message("ignored".into());
        p.finish();
    }

    #[test]
    fn a_drawn_progress_counts() {
        let p = Progress::build(true, "x", "chunks", Some(10));
        assert!(p.is_drawn());
        p.set_position(3);
        p.clone().inc(2);
        assert_eq!(p.0.as_ref().map(|b| b.position()), Some(5));
        p.finish();
        assert!(p.0.as_ref().is_some_and(|b| b.is_finished()));
    }
}
