//! `mssql-cdc bench reconcile` and `bench apply` through the CLI, small: the
//! figures they print come from steps that really ran. Reconcile: an
//! untouched silver found clean, a damaged one found with exactly the rows
//! the bench deleted, at 1x and 10x, for both key kinds, and tier 2 held no
//! more than `bucket_rows` per side even where the table was ten times that.
//! Apply: both shapes of changes applied, each key's net change counted once,
//! and silver equal to the source afterwards. Snapshot: both modes read
//! every row at 1x, the chunked one in the chunks it planned, and the 10x
//! table in both modes too, so each ratio has its two sides.

mod common;

use std::process::Command;

use common::last_json;
use serde_json::Value;

/// Runs `mssql-cdc bench <args> --dir <dir>` and returns its last JSON line,
/// failing the test (with the child's stderr) unless the bench succeeded.
fn run_bench(args: &[&str], dir: &std::path::Path) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_mssql-cdc"))
        .arg("bench")
        .args(args)
        .arg("--dir")
        .arg(dir)
        .env("MSSQL_CDC_LOG", "warn")
        .output()
        .unwrap();
    let j = last_json(&out);
    assert!(out.status.success(), "bench failed: {j}\n{}", String::from_utf8_lossy(&out.stderr));
    j
}

#[test]
fn bench_reconcile_finds_exactly_the_rows_it_deleted_at_both_scales_within_bucket_rows() {
    let dir = tempfile::tempdir().unwrap();
    let bucket_rows: u64 = 200;
    let j = run_bench(&["reconcile", "--rows", "400", "--bucket-rows", &bucket_rows.to_string(), "--damage-every", "25", "--keys", "int,string"], dir.path());
    let runs = j["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4, "int and string, each at 400 and 4000 rows: {j}");
    for r in runs {
        let rows = r["rows"].as_u64().unwrap();
        assert_eq!(r["setup"]["silver_rows"].as_u64(), Some(rows), "{r}");
        assert_eq!(r["clean"]["differences"].as_u64(), Some(0), "{r}");
        assert_eq!(r["clean"]["rows_source"].as_u64(), Some(rows), "{r}");
        let deleted = r["damage"]["rows_deleted"].as_u64().unwrap();
        assert_eq!(deleted, rows / 25, "one row in 25 deleted: {r}");
        assert_eq!(r["damaged"]["differences"].as_u64(), Some(deleted), "{r}");
        for phase in ["clean", "damaged"] {
            let held = r[phase]["rows_held_max"].as_u64().unwrap();
            // Both sides together, each at most bucket_rows plus one hash
            // partition (about 64 rows) that does not split.
            assert!(held <= 2 * (bucket_rows + 128), "{phase} held {held} rows at once: {r}");
            assert!(r[phase]["peak_rss_bytes"].as_u64().unwrap() > 0, "{r}");
        }
        if r["key"] == "string" && rows > bucket_rows {
            assert!(r["damaged"]["partitions"].as_u64().unwrap() > 0, "a string key larger than bucket_rows is summarised per partition: {r}");
            let mismatched = r["damaged"]["partitions_mismatched"].as_u64().unwrap();
            assert!(mismatched > 0 && mismatched <= deleted, "{r}");
        }
    }
    for key in ["int", "string"] {
        let ratio = j["summary"][format!("{key}_peak_rss_ratio_10x")].as_f64().unwrap();
        assert!(ratio > 0.0, "{j}");
    }
}

#[test]
fn bench_apply_applies_both_shapes_and_leaves_silver_equal_to_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, changes) = (2000u64, 300u64);
    let j = run_bench(&["apply", "--rows", &rows.to_string(), "--changes", &changes.to_string(), "--shapes", "spread,hot", "--scales", "1"], dir.path());
    let runs = j["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{j}");
    for r in runs {
        assert_eq!(r["setup"]["silver_rows"].as_u64(), Some(rows), "{r}");
        assert_eq!(r["setup"]["change_rows_streamed"].as_u64(), Some(changes), "one bronze row per change: {r}");
        assert_eq!(r["reconcile"]["differences"].as_u64(), Some(0), "{r}");
        let net = r["apply"]["rows_upserted"].as_u64().unwrap() + r["apply"]["rows_deleted"].as_u64().unwrap();
        match r["shape"].as_str().unwrap() {
            // Each key changed once: every change is its own net row.
            "spread" => {
                assert_eq!(net, changes, "{r}");
                assert_eq!(r["reconcile"]["rows_source"].as_u64(), Some(rows), "as many inserts as deletes: {r}");
            }
            // 20 hot keys and 30 new ones take every change: apply nets them.
            "hot" => assert!(net > 0 && net <= rows / 100 + changes / 10, "{r}"),
            other => panic!("unexpected shape {other}: {r}"),
        }
        assert!(r["apply_over_append_rows_per_s"].as_f64().unwrap() > 0.0, "{r}");
        let secs = r["apply"]["seconds"].as_f64().unwrap();
        assert!((r["apply_change_rows_per_s"].as_f64().unwrap() - changes as f64 / secs).abs() < 1e-6 * changes as f64 / secs, "{r}");
    }
}

#[test]
fn bench_snapshot_reads_every_row_in_both_modes_at_both_scales() {
    let dir = tempfile::tempdir().unwrap();
    let rows: u64 = 1_600;
    let j = run_bench(&["snapshot", "--rows", &rows.to_string(), "--rows-per-s", "200000", "--latency-ms", "1"], dir.path());
    assert_eq!(j["chunk_rows"].as_u64(), Some(rows / 16), "{j}");
    for (k, want) in [("full_rows_read", rows), ("chunked_rows_read", rows), ("full_rows_read_10x", 10 * rows), ("chunked_rows_read_10x", 10 * rows)] {
        assert_eq!(j[k].as_u64(), Some(want), "{k}: {j}");
    }
    // The packing never puts more than chunk_rows rows in a chunk, so at
    // least 16 chunks, and about a slice's worth short of it each, so few more.
    let chunks = j["chunks"].as_u64().unwrap();
    assert!((16..=18).contains(&chunks), "{j}");
    assert!(j["waves"].as_u64().unwrap() >= 1, "{j}");
    for k in ["full_rows_per_s", "chunked_rows_per_s", "chunked_over_full", "full_rows_per_s_10x", "chunked_rows_per_s_10x", "chunked_over_full_10x"] {
        let v = j[k].as_f64().unwrap_or(0.0);
        assert!(v > 0.0 && v.is_finite(), "{k}: {j}");
    }
    let chunks_10x = j["chunks_10x"].as_u64().unwrap();
    assert!((160..=180).contains(&chunks_10x), "the same chunk_rows over ten times the rows: {j}");
    assert!(j["wave_fixed_seconds_median"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["peak_rss_10x_over_1x"].as_f64().unwrap() > 0.0, "{j}");
}
