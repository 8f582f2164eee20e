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
use crate::source::{Isolation, TableName};

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
    pub apply: ApplyOptions,
    #[serde(default)]
    pub reconcile: ReconcileOptions,
    /// Where the file was read from (not part of the file).
    #[serde(skip)]
    pub path: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// `sim://PATH` (the embedded simulator, as its owner; `sim://PATH?user=NAME`
    /// as its database user NAME) or `mssql://USER@HOST:PORT/DATABASE?options`.
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
    /// Options for the object store (e.g. AWS_REGION). A secret is written
    /// as a reference, `env:NAME` or `file:PATH`, never literally: a literal
    /// one is refused (`crate::storage`).
    #[serde(default)]
    pub storage_options: BTreeMap<String, String>,
    /// Go on, with a warning, on an object store that does not honour
    /// create-only puts (`crate::storage::check_conditional_puts` refuses it
    /// otherwise). Only for targets no two steps ever write at once.
    #[serde(default)]
    pub single_writer: bool,
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
    /// `auto` (the default), `all` (updates as after-images) or `all update
    /// old` (before-images too). `auto` reads before-images when silver needs
    /// them to find a row's old form (see [`RowFilterOption::Auto`]).
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
            row_filter: RowFilterOption::Auto,
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
    /// `all update old` when silver cannot do without the updates'
    /// before-images, `all` otherwise (`engine::Context::row_filter`): a
    /// table without a unique index (silver takes an updated row's old
    /// values out of a multiset), or a unique index with a column whose equal
    /// values can be spelled differently (a string under its collation, a
    /// varbinary with trailing zero bytes, a float zero's sign). SQL Server
    /// logs an update that only respells such a key as an update of the same
    /// key (3 and 4), so only the before-image names the old spelling silver
    /// holds.
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "all")]
    All,
    #[serde(rename = "all update old")]
    AllUpdateOld,
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
    /// Chunked mode only (adr-0028 Amendment 5): after the batch that first
    /// reads a newer capture instance, the stream opens a chunked snapshot at
    /// that instance's start LSN, so `backfill` reads every row again with
    /// the new instance's columns (values no change row carries, such as a
    /// column added with a default, reach bronze and silver).
    pub snapshot_on_switch: bool,
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
            snapshot_on_switch: false,
        }
    }
}

/// Options of the `apply` step.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApplyOptions {
    /// The most change rows of bronze one MERGE takes (its source, held in
    /// memory, is the latest row per key of them). An apply that lags the
    /// stream by more goes on in slices of this many rows, cut where a
    /// stream batch ends (so never inside a transaction), each with its own
    /// MERGE and control row. One batch larger than this is one slice:
    /// `stream.max_batch_rows` bounds it.
    pub slice_rows: u64,
    /// A call starts no new slice after this many seconds; it then ends with
    /// `more: true` and the next call goes on from there. 0: one slice per call.
    pub max_seconds: u64,
}

impl Default for ApplyOptions {
    fn default() -> Self {
        ApplyOptions { slice_rows: 1_000_000, max_seconds: 600 }
    }
}

/// Options of the `reconcile` step.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconcileOptions {
    /// Tier 1 buckets over one integer or date key, at least (more when the
    /// table needs them to keep a bucket near `bucket_rows`).
    pub buckets: u32,
    /// The most rows of one side tier 2 holds at once: an integer or date
    /// key gets buckets of about this size, and a larger range (any other
    /// key's whole table, a heap) is compared by hash partitions in passes
    /// of this many rows. Memory follows it: a few hundred bytes a row.
    pub bucket_rows: u64,
    /// The share of tier 1's matching buckets that tier 2 still compares row by row (0 to 1).
    pub sample_fraction: f64,
    /// The most difference rows one run writes to the report (the summary counts them all).
    pub max_report_rows: usize,
    /// When keys differ, how long to wait for the capture job to pass the
    /// end of the source reads (a change it has not captured yet is not a
    /// difference); past it the call exits 75 having written nothing.
    pub capture_wait_seconds: u64,
}

impl Default for ReconcileOptions {
    fn default() -> Self {
        ReconcileOptions { buckets: 64, bucket_rows: 1_000_000, sample_fraction: 0.1, max_report_rows: 10_000, capture_wait_seconds: 30 }
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
            // `sim://PATH?user=NAME`: only the path is resolved.
            let (path, query) = match rest.split_once('?') {
                Some((p, q)) => (p, format!("?{q}")),
                None => (rest, String::new()),
            };
            if !Path::new(path).is_absolute() {
                self.source.url = format!("sim://{}{query}", absolute(&base.join(path)).display());
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
        if let Err(why) = crate::storage::check(&self.target.storage_options) {
            return bad(why);
        }
        if let Err(why) = check_app_id(&self.app_id) {
            return bad(why);
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
        if let Err(why) = self.check_targets_apart() {
            return bad(why);
        }
        if self.reconcile.buckets == 0 || self.reconcile.buckets > 1_000_000 {
            return bad(format!("reconcile.buckets is {}: use 1 to 1000000", self.reconcile.buckets));
        }
        if self.apply.slice_rows == 0 {
            return bad("apply.slice_rows is 0: use at least 1 (the most change rows one MERGE of apply takes; 1000000 by default)".to_string());
        }
        if self.apply.max_seconds > 86_400 {
            return bad(format!("apply.max_seconds is {}: use 0 to 86400 (0: one slice per call)", self.apply.max_seconds));
        }
        if self.reconcile.bucket_rows == 0 {
            return bad("reconcile.bucket_rows is 0: use at least 1 (the most rows of a side tier 2 holds at once; 1000000 by default)".to_string());
        }
        if self.reconcile.capture_wait_seconds > 3600 {
            return bad(format!("reconcile.capture_wait_seconds is {}: use 0 to 3600", self.reconcile.capture_wait_seconds));
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
        if self.snapshot.snapshot_on_switch && self.snapshot.mode != SnapshotMode::Chunked {
            return bad(
                "snapshot.snapshot_on_switch = true needs snapshot.mode = \"chunked\": the snapshot it opens after a capture \
                 instance switch is read in chunks beside the stream. Set snapshot.mode = \"chunked\", or remove snapshot_on_switch"
                    .into(),
            );
        }
        if self.snapshot.snapshot_on_switch {
            if let Some(pinned) = &self.table.capture_instance {
                return bad(format!(
                    "snapshot.snapshot_on_switch = true, but table.capture_instance pins '{pinned}': a pinned stream never \
                     switches, so no snapshot would ever open. Remove table.capture_instance, or remove snapshot_on_switch"
                ));
            }
        }
        if let Some(keys) = &self.snapshot.keys {
            if keys.is_empty() {
                return bad("snapshot.keys is empty: name at least one column, or remove the key".into());
            }
        }
        Ok(())
    }

    /// Every table this workflow writes, named as in the file (the plans,
    /// control and report tables are siblings derived from bronze and silver).
    pub fn target_tables(&self) -> Vec<(String, String)> {
        let mut out = vec![
            ("target.bronze".to_string(), self.target.bronze.clone()),
            ("target.facts".to_string(), self.target.facts.clone()),
            ("the plans table (next to target.bronze)".to_string(), crate::delta::plans::location_for(&self.target.bronze)),
        ];
        if let Some(silver) = &self.target.silver {
            out.push(("target.silver".into(), silver.clone()));
            out.push(("silver's control table (next to target.silver)".into(), crate::delta::silver::control_location_for(silver)));
        }
        if let Ok(report) = self.reconcile_location() {
            let name = if self.target.reconcile.is_some() { "target.reconcile" } else { "the reconcile report (next to target.silver)" };
            out.push((name.into(), report));
        }
        out
    }

    /// No two tables of this workflow may be the same table, however spelt
    /// (`lake/x`, `lake/x/`, `file:///…/lake/x`), and none may sit inside
    /// another's folder: Delta's VACUUM of the outer table would delete the
    /// inner one's files as unreferenced.
    fn check_targets_apart(&self) -> Result<(), String> {
        let tables = self.target_tables();
        let keys: Vec<LocationKey> = tables.iter().map(|(_, loc)| LocationKey::of(loc)).collect::<Result<_, _>>()?;
        for i in 0..tables.len() {
            for j in i + 1..tables.len() {
                let ((a_name, a), (b_name, b)) = (&tables[i], &tables[j]);
                match keys[i].relation(&keys[j]) {
                    Relation::Apart => {}
                    Relation::Same => {
                        return Err(format!("{a_name} '{a}' and {b_name} '{b}' are the same table: give each its own folder"));
                    }
                    Relation::Inside => {
                        return Err(format!(
                            "{a_name} '{a}' lies inside the folder of {b_name} '{b}' (a VACUUM of the outer table would delete \
                             its files): give each table a folder of its own, side by side"
                        ));
                    }
                    Relation::Contains => {
                        return Err(format!(
                            "{b_name} '{b}' lies inside the folder of {a_name} '{a}' (a VACUUM of the outer table would delete \
                             its files): give each table a folder of its own, side by side"
                        ));
                    }
                }
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

    /// The object-store options with their references read (`env:NAME`
    /// from the environment, `file:PATH` from a file, a relative path from
    /// the workflow file's folder): see [`crate::storage`].
    pub fn storage_options(&self) -> StepResult<std::collections::HashMap<String, String>> {
        let base = self.path.parent().map(Path::to_path_buf).unwrap_or_default();
        crate::storage::resolve(&self.target.storage_options, &base)
    }
}

/// Checks an app id. It prefixes every Delta txn id of the stream and names
/// its facts rows, and generation n > 0 runs under `<app_id>.g<n>`
/// ([`crate::engine::generation_app_id`]). So an app id must not itself end in
/// `.g<digits>`: `orders.g1` would share txn ids and batch ids with generation
/// 1 of a stream `orders` on the same tables, and each would take the other's
/// commits for its own. `#` separates the txn suffixes (`#facts`, `#snap.…`).
/// Letters, digits, `_`, `-` and `.` are enough for any naming scheme and
/// keep ids safe in file names, metrics labels and log searches.
pub fn check_app_id(app_id: &str) -> Result<(), String> {
    if app_id.is_empty() {
        return Err("app_id is empty: name the stream, e.g. app_id = \"orders\"".into());
    }
    if let Some(c) = app_id.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))) {
        return Err(format!(
            "app_id '{app_id}' holds '{c}': use letters, digits, '_', '-' and '.' only (the app id prefixes Delta txn ids)"
        ));
    }
    if let Some((_, tail)) = app_id.rsplit_once(".g") {
        if !tail.is_empty() && tail.chars().all(|c| c.is_ascii_digit()) {
            return Err(format!(
                "app_id '{app_id}' ends in '.g{tail}', the form of a later generation's id of the stream '{}': \
                 choose an app id that does not end in '.g' and digits (e.g. '{}_g{tail}')",
                &app_id[..app_id.len() - tail.len() - 2],
                &app_id[..app_id.len() - tail.len() - 2],
            ));
        }
    }
    Ok(())
}

/// A table location reduced to what identifies it: a local path (from a
/// path or a `file://` URI) made absolute and lexically normal, or an object
/// store URL with its scheme and bucket lower-cased and no trailing slash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocationKey {
    /// `file`, or the object store's scheme (`s3a` counts as `s3`).
    scheme: String,
    /// The bucket or account (empty for local paths).
    authority: String,
    /// Path segments, without empty ones, `.` or `..`.
    segments: Vec<String>,
}

/// How two locations relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    Apart,
    Same,
    /// The first lies inside the second's folder.
    Inside,
    /// The second lies inside the first's folder.
    Contains,
}

impl LocationKey {
    pub fn of(location: &str) -> Result<LocationKey, String> {
        let (scheme, authority, path) = if location.contains("://") {
            let url = url::Url::parse(location).map_err(|e| format!("'{location}' is not a valid table URI: {e}"))?;
            if url.scheme() == "file" {
                let path = url.to_file_path().map_err(|_| format!("'{location}' is not a local file URI"))?;
                ("file".to_string(), String::new(), path.to_string_lossy().into_owned())
            } else {
                let scheme = match url.scheme() {
                    "s3a" => "s3".to_string(),
                    s => s.to_ascii_lowercase(),
                };
                let authority = format!("{}{}", url.username(), url.host_str().unwrap_or("")).to_ascii_lowercase();
                (scheme, authority, url.path().to_string())
            }
        } else {
            ("file".to_string(), String::new(), absolute(Path::new(location)).to_string_lossy().into_owned())
        };
        let mut segments: Vec<String> = Vec::new();
        for seg in path.split('/') {
            match seg {
                "" | "." => {}
                ".." => {
                    segments.pop();
                }
                s => segments.push(s.to_string()),
            }
        }
        Ok(LocationKey { scheme, authority, segments })
    }

    pub fn relation(&self, other: &LocationKey) -> Relation {
        if self.scheme != other.scheme || self.authority != other.authority {
            return Relation::Apart;
        }
        let n = self.segments.len().min(other.segments.len());
        if self.segments[..n] != other.segments[..n] {
            return Relation::Apart;
        }
        match self.segments.len().cmp(&other.segments.len()) {
            std::cmp::Ordering::Equal => Relation::Same,
            std::cmp::Ordering::Greater => Relation::Inside,
            std::cmp::Ordering::Less => Relation::Contains,
        }
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
        // A database user on a simulator URL: the path is resolved, the user kept.
        let as_user = Workflow::parse(&GOOD.replace("sim://db.sqlite", "sim://db.sqlite?user=cdc_reader"), Path::new("/tmp/wf/orders.toml")).unwrap();
        assert_eq!(as_user.source.url, "sim:///tmp/wf/db.sqlite?user=cdc_reader");
        assert!(wf.snapshot.bootstrap);
        assert_eq!(wf.stream.max_batch_rows, 100_000);
    }

    #[test]
    fn snapshot_on_switch_needs_the_chunked_mode_and_an_unpinned_instance() {
        let on_full = GOOD.replace("mode = \"full\"", "mode = \"full\"\nsnapshot_on_switch = true");
        let e = Workflow::parse(&on_full, Path::new("wf.toml")).unwrap_err();
        assert!(matches!(e, StepError::Config(_)) && e.to_string().contains("snapshot.mode = \"chunked\""), "{e}");
        let on_chunked = GOOD.replace("mode = \"full\"", "mode = \"chunked\"\nsnapshot_on_switch = true");
        assert!(Workflow::parse(&on_chunked, Path::new("wf.toml")).unwrap().snapshot.snapshot_on_switch);
        let pinned = on_chunked.replace("name = \"orders\"\n", "name = \"orders\"\ncapture_instance = \"dbo_orders\"\n");
        let e = Workflow::parse(&pinned, Path::new("wf.toml")).unwrap_err();
        assert!(e.to_string().contains("table.capture_instance"), "{e}");
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
    fn apply_options_default_and_are_checked() {
        let wf = Workflow::parse(GOOD, Path::new("wf.toml")).unwrap();
        assert_eq!((wf.apply.slice_rows, wf.apply.max_seconds), (1_000_000, 600));
        let wf = Workflow::parse(&format!("{GOOD}[apply]\nslice_rows = 5000\nmax_seconds = 0\n"), Path::new("wf.toml")).unwrap();
        assert_eq!((wf.apply.slice_rows, wf.apply.max_seconds), (5000, 0));
        for (bad, named) in [("slice_rows = 0", "apply.slice_rows"), ("max_seconds = 100000", "apply.max_seconds"), ("slice_row = 5", "slice_row")] {
            let e = Workflow::parse(&format!("{GOOD}[apply]\n{bad}\n"), Path::new("wf.toml")).unwrap_err();
            assert!(matches!(e, StepError::Config(_)) && e.to_string().contains(named), "{bad}: {e}");
        }
    }

    #[test]
    fn app_ids_that_collide_with_generation_ids_are_refused() {
        for ok in ["orders", "orders.v2", "sales.orders", "o-1_x", "orders.g", "orders.gx1", "g1"] {
            assert!(check_app_id(ok).is_ok(), "{ok}");
        }
        for bad in ["orders.g1", "x.g12", "a.b.g0", "", "a b", "a#b", "a/b", "ü"] {
            assert!(check_app_id(bad).is_err(), "{bad}");
        }
        let e = Workflow::parse(&GOOD.replace("app_id = \"orders\"", "app_id = \"orders.g1\""), Path::new("wf.toml")).unwrap_err();
        assert!(e.to_string().contains("generation"), "{e}");
    }

    #[test]
    fn the_same_table_spelt_differently_or_nested_is_refused() {
        let base = "/tmp/wf";
        for (bronze, facts) in [
            ("lake/x", "lake/x/"),
            ("lake/x", "file:///tmp/wf/lake/x"),
            ("lake/x", "./lake/y/../x"),
            ("lake/x", "lake/x/facts"),
            ("lake/x/facts", "lake/x"),
        ] {
            let text = GOOD.replace("bronze = \"bronze\"", &format!("bronze = \"{bronze}\"")).replace("facts = \"facts\"", &format!("facts = \"{facts}\""));
            let e = Workflow::parse(&text, &Path::new(base).join("wf.toml")).unwrap_err();
            assert!(matches!(e, StepError::Config(_)), "{bronze} / {facts}: {e}");
        }
        // Silver inside bronze, or the report inside silver.
        let nested = GOOD.replace("facts = \"facts\"", "facts = \"facts\"\nsilver = \"bronze/silver\"");
        assert!(Workflow::parse(&nested, Path::new("/tmp/wf/wf.toml")).unwrap_err().to_string().contains("inside"));
        let report = GOOD.replace("facts = \"facts\"", "facts = \"facts\"\nsilver = \"silver\"\nreconcile = \"silver/report\"");
        assert!(Workflow::parse(&report, Path::new("/tmp/wf/wf.toml")).is_err());
        // Siblings that share a prefix of their names are fine.
        let ok = GOOD.replace("facts = \"facts\"", "facts = \"bronze2\"\nsilver = \"bronze_silver\"");
        Workflow::parse(&ok, Path::new("/tmp/wf/wf.toml")).unwrap();
        // Object stores: bucket case and trailing slashes do not make another table.
        let a = LocationKey::of("s3://Bucket/lake/x/").unwrap();
        assert_eq!(a.relation(&LocationKey::of("s3a://bucket/lake/x").unwrap()), Relation::Same);
        assert_eq!(a.relation(&LocationKey::of("s3://bucket/lake/x/y").unwrap()), Relation::Contains);
        assert_eq!(a.relation(&LocationKey::of("s3://other/lake/x").unwrap()), Relation::Apart);
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

    #[test]
    fn a_workflow_without_target_facts_is_refused_naming_it() {
        // 28.22, 18.22: chunked snapshots and re-snapshot recovery keep their state in the facts table. Catches
        // `target.facts` given a default or made optional (the workflow would parse and write its state nowhere
        // the next call reads).
        let no_facts = GOOD.replace("facts = \"facts\"\n", "");
        assert_ne!(no_facts, GOOD, "the fixture names target.facts");
        let chunked = no_facts.replace("mode = \"full\"", "mode = \"chunked\"");
        let resnapshot = format!("{no_facts}[stream]\non_data_loss = \"resnapshot\"\n");
        for text in [&chunked, &resnapshot] {
            let e = Workflow::parse(text, Path::new("wf.toml")).unwrap_err();
            assert!(matches!(e, StepError::Config(_)), "{e}");
            assert!(e.to_string().contains("missing field `facts`") && e.to_string().contains("wf.toml"), "{e}");
            // The same file with target.facts parses.
            let with = text.replace("bronze = \"bronze\"\n", "bronze = \"bronze\"\nfacts = \"facts\"\n");
            Workflow::parse(&with, Path::new("wf.toml")).unwrap();
        }
    }
}
