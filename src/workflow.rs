//! The workflow file: one TOML file per replicated table.
//!
//! It names the source, the table, the Delta targets, the app id and the
//! options. Unknown keys are errors (a misspelt option silently ignored is a
//! production incident). Secrets never appear here: the file names the
//! environment variable (or a file) that holds the password. Relative paths
//! are resolved against the workflow file's folder, so a workflow folder can
//! be moved as a whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{StepError, StepResult};
use crate::source::{Isolation, RowFilter, TableName};

/// A parsed, validated workflow file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workflow {
    /// Names this stream in every Delta txn id and facts row. Unique per
    /// (table, target); changing it starts a new stream.
    pub app_id: String,
    pub source: SourceConfig,
    pub table: TableConfig,
    pub target: TargetConfig,
    #[serde(default)]
    pub stream: StreamOptions,
    #[serde(default)]
    pub snapshot: SnapshotOptions,
    #[serde(default)]
    pub reconcile: ReconcileOptions,
    /// Where the file was read from (not part of the file).
    #[serde(skip)]
    pub path: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// `sim://PATH` (the embedded simulator) or `mssql://USER@HOST:PORT/DATABASE?options`.
    pub url: String,
    /// The environment variable holding the password (mssql:// only).
    #[serde(default)]
    pub password_env: Option<String>,
    /// A file holding the password (mssql:// only), e.g. a mounted secret.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    #[serde(default = "default_schema")]
    pub schema: String,
    pub name: String,
    /// The capture instance to read; the table's newest one when omitted.
    #[serde(default)]
    pub capture_instance: Option<String>,
}

fn default_schema() -> String {
    "dbo".into()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// The bronze table: a path or a URI (file://, s3://, abfss://, gs://).
    pub bronze: String,
    /// The facts table: micro-batch and event rows. May be shared by many streams.
    pub facts: String,
    /// The silver table `apply` writes (the current state per key). Its
    /// control table is `<silver>_control`, next to it. Needed by `apply`
    /// and `reconcile` only.
    #[serde(default)]
    pub silver: Option<String>,
    /// The reconcile report table (default: `<silver>_reconcile`).
    #[serde(default)]
    pub reconcile: Option<String>,
    /// Options for the object store (e.g. AWS_REGION). A value written
    /// `env:NAME` is read from the environment, so keys stay out of the file.
    #[serde(default)]
    pub storage_options: BTreeMap<String, String>,
}

/// Options of the `stream` step.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamOptions {
    /// The most change rows one micro-batch holds (a batch never splits a
    /// transaction, so it may exceed this by one transaction's rows).
    pub max_batch_rows: usize,
    /// The most micro-batches one `stream` call commits.
    pub max_batches: u32,
    /// `all` (updates as after-images) or `all update old` (before-images too).
    pub row_filter: RowFilterOption,
    /// Where a stream without a bootstrap starts: `earliest`, `latest` or an LSN.
    pub start: String,
    /// What a stream does when the changes after its position were purged by
    /// CDC cleanup: `fail` (exit 3, a person decides), `resnapshot` (take a
    /// new snapshot in a new generation and go on from it), or `skip` (jump
    /// to the capture instance's min LSN, leaving a `data_skipped` event row).
    pub on_data_loss: OnDataLoss,
    /// The anti-loop guard of `resnapshot`: a loss within this many days of
    /// the previous automatic re-snapshot (or of a failed one) stops with
    /// exit 3 instead. Set it above the CDC retention; 0 re-snapshots now.
    pub resnapshot_interval_days: f64,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            max_batch_rows: 100_000,
            max_batches: 1_000,
            row_filter: RowFilterOption::All,
            start: "earliest".into(),
            on_data_loss: OnDataLoss::Fail,
            resnapshot_interval_days: 7.0,
        }
    }
}

/// `stream.on_data_loss`: what the retention guard does with a purged range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDataLoss {
    /// Stop with exit 3 and name the gap (the default: nothing is lost silently).
    Fail,
    /// Re-snapshot in a new generation and stream on from its LSN.
    Resnapshot,
    /// Skip ahead to the min LSN; the gap is recorded as a `data_skipped` row.
    Skip,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RowFilterOption {
    #[serde(rename = "all")]
    All,
    #[serde(rename = "all update old")]
    AllUpdateOld,
}

impl From<RowFilterOption> for RowFilter {
    fn from(o: RowFilterOption) -> RowFilter {
        match o {
            RowFilterOption::All => RowFilter::All,
            RowFilterOption::AllUpdateOld => RowFilter::AllUpdateOld,
        }
    }
}

/// Options of snapshots (bootstrap and, later, re-snapshots).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnapshotOptions {
    /// Take an initial snapshot before streaming.
    pub bootstrap: bool,
    /// `full` (read the whole table at S, one commit) or `chunked`.
    pub mode: SnapshotMode,
    /// Source connections read side by side.
    pub parallelism: usize,
    /// Rows per Arrow batch read from the source.
    pub batch_rows: usize,
    /// READ COMMITTED by default; `snapshot` where the database allows it.
    pub isolation: Isolation,
    /// Columns to cut key ranges on (default: the capture instance's index
    /// columns). A chunked snapshot cuts its chunks on them, unique or not.
    pub keys: Option<Vec<String>>,
    /// Chunked mode: the most rows a planned chunk holds (fixed by the first
    /// `backfill` call; later values are ignored with a warning).
    pub chunk_rows: u64,
    /// Chunked mode: a wave takes as many rounds of `parallelism` chunks as
    /// this many seconds hold at the last wave's pace (0: one round a wave).
    pub target_wave_seconds: f64,
    /// Chunked mode: `backfill` pauses while the stream's retention headroom
    /// (its newest batch's distance to CDC cleanup) is below this.
    pub min_headroom_hours: Option<f64>,
}

impl Default for SnapshotOptions {
    fn default() -> Self {
        SnapshotOptions {
            bootstrap: false,
            mode: SnapshotMode::Full,
            parallelism: 4,
            batch_rows: 8_192,
            isolation: Isolation::ReadCommitted,
            keys: None,
            chunk_rows: 1_000_000,
            target_wave_seconds: 300.0,
            min_headroom_hours: None,
        }
    }
}

/// Options of the `reconcile` step.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconcileOptions {
    /// Tier 1 buckets over one integer key.
    pub buckets: u32,
    /// The share of tier 1's matching buckets that tier 2 still compares row by row (0 to 1).
    pub sample_fraction: f64,
    /// The most difference rows one run writes to the report (the summary counts them all).
    pub max_report_rows: usize,
}

impl Default for ReconcileOptions {
    fn default() -> Self {
        ReconcileOptions { buckets: 64, sample_fraction: 0.1, max_report_rows: 10_000 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotMode {
    Full,
    Chunked,
}

impl Workflow {
    /// Reads and validates a workflow file. Every problem is a `Config` error
    /// naming the file and what to change.
    pub fn load(path: &Path) -> StepResult<Workflow> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            StepError::Config(format!("cannot read workflow file {}: {e}. Pass an existing TOML file with --workflow.", path.display()))
        })?;
        Workflow::parse(&text, path)
    }

    /// Parses workflow text; `path` resolves relative paths and names the file in errors.
    pub fn parse(text: &str, path: &Path) -> StepResult<Workflow> {
        let mut wf: Workflow = toml::from_str(text)
            .map_err(|e| StepError::Config(format!("workflow file {} is not valid: {}", path.display(), e.to_string().trim())))?;
        wf.path = path.to_path_buf();
        wf.resolve_paths();
        wf.validate()?;
        Ok(wf)
    }

    fn base_dir(&self) -> PathBuf {
        let dir = self.path.parent().map(Path::to_path_buf).unwrap_or_default();
        if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        }
    }

    fn resolve_paths(&mut self) {
        let base = self.base_dir();
        let resolve = |s: &str| -> String {
            if s.contains("://") || Path::new(s).is_absolute() {
                s.to_string()
            } else {
                absolute(&base.join(s)).to_string_lossy().into_owned()
            }
        };
        self.target.bronze = resolve(&self.target.bronze);
        self.target.facts = resolve(&self.target.facts);
        self.target.silver = self.target.silver.as_deref().map(resolve);
        self.target.reconcile = self.target.reconcile.as_deref().map(resolve);
        if let Some(rest) = self.source.url.strip_prefix("sim://") {
            if !Path::new(rest).is_absolute() {
                self.source.url = format!("sim://{}", absolute(&base.join(rest)).display());
            }
        }
        if let Some(f) = &self.source.password_file {
            if f.is_relative() {
                self.source.password_file = Some(absolute(&base.join(f)));
            }
        }
    }

    fn validate(&self) -> StepResult<()> {
        let file = self.path.display();
        let bad = |what: String| Err(StepError::Config(format!("workflow file {file}: {what}")));
        if self.app_id.trim().is_empty() || self.app_id.contains('#') || self.app_id.chars().any(char::is_whitespace) {
            return bad(format!("app_id '{}' must be non-empty, without spaces or '#' (it prefixes Delta txn ids)", self.app_id));
        }
        if !(self.source.url.starts_with("sim://") || self.source.url.starts_with("mssql://") || self.source.url.contains('=')) {
            return bad(format!(
                "source.url '{}' is not a source: use sim://PATH for the simulator or mssql://USER@HOST:PORT/DATABASE",
                self.source.url
            ));
        }
        if self.table.name.trim().is_empty() {
            return bad("table.name is empty".into());
        }
        if self.target.bronze == self.target.facts {
            return bad("target.bronze and target.facts must be different tables".into());
        }
        if let Some(silver) = &self.target.silver {
            let control = crate::delta::silver::control_location_for(silver);
            let plans = crate::delta::plans::location_for(&self.target.bronze);
            for (name, other) in [("target.bronze", &self.target.bronze), ("target.facts", &self.target.facts), ("the plans table", &plans)] {
                if silver == other || &control == other {
                    return bad(format!("target.silver '{silver}' (or its control table) is the same table as {name}: name another folder"));
                }
            }
        }
        if let Some(report) = &self.target.reconcile {
            if [&self.target.bronze, &self.target.facts].contains(&report) || self.target.silver.as_ref() == Some(report) {
                return bad(format!("target.reconcile '{report}' is the same table as another target: name another folder"));
            }
        }
        if self.reconcile.buckets == 0 || self.reconcile.buckets > 1_000_000 {
            return bad(format!("reconcile.buckets is {}: use 1 to 1000000", self.reconcile.buckets));
        }
        if !(0.0..=1.0).contains(&self.reconcile.sample_fraction) {
            return bad(format!("reconcile.sample_fraction is {}: use a number from 0 to 1", self.reconcile.sample_fraction));
        }
        if self.stream.max_batch_rows == 0 || self.stream.max_batches == 0 {
            return bad("stream.max_batch_rows and stream.max_batches must be at least 1".into());
        }
        if self.snapshot.parallelism == 0 || self.snapshot.parallelism > 64 {
            return bad(format!("snapshot.parallelism is {}: use 1 to 64 connections", self.snapshot.parallelism));
        }
        if self.snapshot.batch_rows == 0 {
            return bad("snapshot.batch_rows must be at least 1".into());
        }
        match self.stream.start.as_str() {
            "earliest" | "latest" => {}
            other => {
                if crate::lsn::Lsn::parse(other).is_err() {
                    return bad(format!("stream.start '{other}' must be earliest, latest or an LSN like 0x0000002a000001f00003"));
                }
            }
        }
        if !(self.stream.resnapshot_interval_days >= 0.0 && self.stream.resnapshot_interval_days.is_finite()) {
            return bad(format!(
                "stream.resnapshot_interval_days is {}: use 0 or more days (above the CDC retention; 0 re-snapshots now)",
                self.stream.resnapshot_interval_days
            ));
        }
        if self.snapshot.chunk_rows == 0 {
            return bad("snapshot.chunk_rows must be at least 1".into());
        }
        if !(self.snapshot.target_wave_seconds >= 0.0 && self.snapshot.target_wave_seconds.is_finite()) {
            return bad(format!("snapshot.target_wave_seconds is {}: use 0 or more seconds", self.snapshot.target_wave_seconds));
        }
        if let Some(h) = self.snapshot.min_headroom_hours {
            if !(h >= 0.0 && h.is_finite()) {
                return bad(format!("snapshot.min_headroom_hours is {h}: use 0 or more hours, or remove it"));
            }
        }
        if let Some(keys) = &self.snapshot.keys {
            if keys.is_empty() {
                return bad("snapshot.keys is empty: name at least one column, or remove the key".into());
            }
        }
        Ok(())
    }

    /// The silver table, or a `Config` error naming the setting a step needs.
    pub fn silver_location(&self, step: &str) -> StepResult<String> {
        self.target.silver.clone().ok_or_else(|| {
            StepError::Config(format!(
                "`{step}` needs the silver table: set target.silver in {} (a path or URI, e.g. silver = \"silver/{}\")",
                self.path.display(),
                self.table.name
            ))
        })
    }

    /// The reconcile report table: target.reconcile, or `<silver>_reconcile`.
    pub fn reconcile_location(&self) -> StepResult<String> {
        match &self.target.reconcile {
            Some(r) => Ok(r.clone()),
            None => Ok(crate::delta::silver::reconcile_location_for(&self.silver_location("reconcile")?)),
        }
    }

    /// The source table's name.
    pub fn table_name(&self) -> TableName {
        TableName::new(self.table.schema.clone(), self.table.name.clone())
    }

    /// The object-store options with `env:NAME` values read from the environment.
    pub fn storage_options(&self) -> StepResult<std::collections::HashMap<String, String>> {
        let mut out = std::collections::HashMap::new();
        for (k, v) in &self.target.storage_options {
            let value = match v.strip_prefix("env:") {
                Some(var) => std::env::var(var).map_err(|_| {
                    StepError::Config(format!("target.storage_options.{k} names the environment variable {var}, which is not set"))
                })?,
                None => v.clone(),
            };
            out.insert(k.clone(), value);
        }
        Ok(out)
    }
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
app_id = "orders"
[source]
url = "sim://db.sqlite"
[table]
name = "orders"
[target]
bronze = "bronze"
facts = "facts"
[snapshot]
bootstrap = true
mode = "full"
"#;

    #[test]
    fn parses_and_resolves_relative_paths() {
        let wf = Workflow::parse(GOOD, Path::new("/tmp/wf/orders.toml")).unwrap();
        assert_eq!(wf.target.bronze, "/tmp/wf/bronze");
        assert_eq!(wf.source.url, "sim:///tmp/wf/db.sqlite");
        assert_eq!(wf.table.schema, "dbo");
        assert!(wf.snapshot.bootstrap);
        assert_eq!(wf.stream.max_batch_rows, 100_000);
    }

    #[test]
    fn unknown_key_is_an_error_naming_it() {
        let text = GOOD.replace("mode = \"full\"", "mode = \"full\"\nbootstarp = true");
        let e = Workflow::parse(&text, Path::new("wf.toml")).unwrap_err();
        assert!(matches!(e, StepError::Config(_)));
        assert!(e.to_string().contains("bootstarp"), "{e}");
    }

    #[test]
    fn data_loss_options_parse_and_are_checked() {
        let wf = Workflow::parse(GOOD, Path::new("wf.toml")).unwrap();
        assert_eq!(wf.stream.on_data_loss, OnDataLoss::Fail);
        assert_eq!(wf.stream.resnapshot_interval_days, 7.0);
        let text = format!("{GOOD}[stream]\non_data_loss = \"resnapshot\"\nresnapshot_interval_days = 10\n");
        let wf = Workflow::parse(&text, Path::new("wf.toml")).unwrap();
        assert_eq!((wf.stream.on_data_loss, wf.stream.resnapshot_interval_days), (OnDataLoss::Resnapshot, 10.0));
        let skip = format!("{GOOD}[stream]\non_data_loss = \"skip\"\n");
        assert_eq!(Workflow::parse(&skip, Path::new("wf.toml")).unwrap().stream.on_data_loss, OnDataLoss::Skip);
        for bad in ["on_data_loss = \"ignore\"", "resnapshot_interval_days = -1"] {
            let e = Workflow::parse(&format!("{GOOD}[stream]\n{bad}\n"), Path::new("wf.toml")).unwrap_err();
            assert!(matches!(e, StepError::Config(_)), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_values_are_errors() {
        for (from, to) in [
            ("app_id = \"orders\"", "app_id = \"a#b\""),
            ("url = \"sim://db.sqlite\"", "url = \"postgres://x\""),
            ("mode = \"full\"", "mode = \"fast\""),
        ] {
            let e = Workflow::parse(&GOOD.replace(from, to), Path::new("wf.toml")).unwrap_err();
            assert!(matches!(e, StepError::Config(_)), "{from} -> {to}: {e}");
        }
        let e = Workflow::parse("app_id = ", Path::new("wf.toml")).unwrap_err();
        assert!(e.to_string().contains("wf.toml"));
    }
}
