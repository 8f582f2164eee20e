//! Issue 12 §5, least privilege, through the command line on the simulator:
//! a database user with exactly the grants docs/sqlserver.md lists ("A
//! read-only login") runs stream, backfill (chunked, and a full snapshot),
//! apply and reconcile, and the targets pass the reference checks; a user
//! missing any one of those grants is stopped by every step that needs it
//! (exit 2, the message naming the statement that grants it) before the step
//! writes anything, while the steps that do not need it still run.
//!
//! The table has a column, `secret`, that the capture instance does not
//! capture and the user has no grant on: the least set really is less than
//! the table.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use common::{assert_targets_match_source_blocking, cli_backfill_until_done, cli_stream_until_caught_up, item_row, ok, step, Scenario};
use mssql_cdc::sim::Permission;
use mssql_cdc::source::{CdcSource, Isolation, KeyRange, SnapshotRead, SourceError};
use mssql_cdc::types::{ColumnDesc, SqlType, SqlValue};

/// The database user the workflow reads as.
const READER: &str = "cdc_reader";
/// The capture instance's gating role (`@role_name`).
const ROLE: &str = "items_readers";
/// The columns the capture instance captures: every column but `secret`.
const CAPTURED: [&str; 5] = ["id", "name", "qty", "price", "updated"];
/// The change table's ordering columns, the only ones the client reads from it.
const ORDERING: [&str; 4] = ["__$start_lsn", "__$seqval", "__$operation", "__$command_id"];
/// Every step that reads the source, in the order a case runs them.
const STEPS: [&str; 5] = ["stream", "backfill", "apply", "reconcile", "status"];

fn workflow_extra(mode: &str) -> String {
    format!(
        "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"{mode}\"\nchunk_rows = 10\nparallelism = 2\ntarget_wave_seconds = 0\n\
         [stream]\nmax_batch_rows = 1000\n"
    )
}

/// The scenario's workflow, read as `user` (None: the database owner).
fn write_workflow(s: &Scenario, user: Option<&str>, extra: &str) {
    let url = match user {
        Some(u) => format!("sim://source.sqlite?user={u}"),
        None => "sim://source.sqlite".to_string(),
    };
    let text = format!(
        "app_id = \"items\"\n[source]\nurl = \"{url}\"\n[table]\nname = \"items\"\n[target]\nbronze = \"bronze\"\nfacts = \"facts\"\n{extra}\n"
    );
    std::fs::write(&s.wf_path, text).unwrap();
}

fn with_secret(mut row: Vec<SqlValue>) -> Vec<SqlValue> {
    row.push(SqlValue::Str("not for the reader".into()));
    row
}

/// 30 rows in dbo.items, a column `secret` added after them, and the
/// capture instance `dbo_items` capturing every column but `secret`, with
/// the gating role `items_readers` when `gated`.
fn scenario(gated: bool) -> Scenario {
    let s = Scenario::new(30, "");
    s.db.add_column(&s.table, ColumnDesc::new("secret", SqlType::NVarChar { len: Some(20) }, true)).unwrap();
    // The instance Scenario::new made predates `secret`, so it does not capture it; a gated one is made again without it.
    if gated {
        s.db.disable_instance("dbo_items").unwrap();
        s.db.enable_cdc_gated(&s.table, None, Some(CAPTURED.iter().map(|c| c.to_string()).collect()), ROLE).unwrap();
        // An idle mapping row above the new instance's start.
        s.db.advance_clock(std::time::Duration::from_secs(2)).unwrap();
        common::settle(&s.db);
    }
    let ci = s.db.capture_instances(&s.table).unwrap();
    assert_eq!(ci[0].columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), CAPTURED, "the instance captures all but secret");
    s
}

/// `n` transactions, each an insert, an update of an existing row and, every
/// third, a delete; then the capture job.
fn write_changes(s: &mut Scenario, n: usize) {
    let table = s.table.clone();
    for round in 0..n {
        let new_id = s.next_id;
        s.next_id += 1;
        let keys = s.db.keys(&table).unwrap();
        let update = keys[(round * 7) % keys.len()].clone();
        let delete = (round % 3 == 2).then(|| keys[(round * 13 + 5) % keys.len()].clone()).filter(|k| *k != update);
        s.db.transaction(|tx| {
            tx.insert(&table, with_secret(item_row(new_id, 0)))?;
            let id = update[0].as_i64().expect("an id");
            tx.update(&table, &update, with_secret(item_row(id, round as i64 + 1)))?;
            if let Some(k) = &delete {
                tx.delete(&table, k)?;
            }
            Ok(())
        })
        .unwrap();
    }
    common::settle(&s.db);
}

/// One grant of the least set, as `sim grant` takes it: the securable and its columns.
#[derive(Debug, Clone, PartialEq)]
struct LeastGrant {
    on: &'static str,
    columns: Vec<&'static str>,
}

/// The least grants of docs/sqlserver.md for dbo.items and its instance
/// dbo_items (the gating role's membership aside).
fn least_grants() -> Vec<LeastGrant> {
    let g = |on, columns: &[&'static str]| LeastGrant { on, columns: columns.to_vec() };
    vec![
        g("OBJECT::dbo.items", &CAPTURED),
        g("OBJECT::cdc.change_tables", &[]),
        g("OBJECT::cdc.captured_columns", &[]),
        g("OBJECT::cdc.index_columns", &[]),
        g("OBJECT::cdc.lsn_time_mapping", &[]),
        g("OBJECT::cdc.fn_cdc_get_all_changes_dbo_items", &[]),
        g("OBJECT::cdc.dbo_items_CT", &ORDERING),
    ]
}

/// Runs `mssql-cdc sim <args>`, which must succeed.
fn sim(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_mssql-cdc")).arg("sim").args(args).env("MSSQL_CDC_LOG", "warn").output().unwrap();
    assert!(
        out.status.success(),
        "sim {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The least set, granted through the `sim` command line as a DBA would run it.
fn grant_least_set_by_cli(s: &Scenario, gated: bool) {
    let db = s.db.path().to_string_lossy().into_owned();
    sim(&["user", "--db", db.as_str(), "--create", READER]);
    for g in least_grants() {
        let mut args: Vec<&str> = vec!["grant", "--db", db.as_str(), "--user", READER, "--on", g.on];
        let cols = g.columns.join(",");
        if !g.columns.is_empty() {
            args.extend(["--columns", cols.as_str()]);
        }
        sim(&args);
    }
    if gated {
        sim(&["role", "--db", db.as_str(), "--role", ROLE, "--add-member", READER]);
    }
}

/// Every file of the targets (everything in the scenario's folder but the
/// simulator's file and the workflow), with its size: a commit, a new
/// table or a rewritten file shows as a difference.
fn target_files(s: &Scenario) -> BTreeMap<PathBuf, u64> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![s.path().to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if d.as_path() == s.path() && (name.starts_with("source.sqlite") || p == s.wf_path) {
                continue;
            }
            if p.is_dir() {
                dirs.push(p);
            } else {
                out.insert(p, e.metadata().unwrap().len());
            }
        }
    }
    out
}

/// The least set: stream (opening the chunked snapshot), backfill beside
/// changes, stream, apply and a clean reconcile, as the user; then the
/// reference checks (silver against the table, bronze against the change
/// function, the batch ranges tiling). The user still cannot read `secret`.
#[test]
fn a_user_with_exactly_the_least_grants_runs_every_step_chunked() {
    let mut s = scenario(true);
    grant_least_set_by_cli(&s, true);
    write_workflow(&s, Some(READER), &workflow_extra("chunked"));
    let first = ok(&s, &["stream"]);
    assert_eq!(first["bootstrap"]["opened_now"], true, "{first}");
    write_changes(&mut s, 4);
    ok(&s, &["backfill", "--max-waves", "1"]);
    write_changes(&mut s, 4);
    cli_backfill_until_done(&s);
    write_changes(&mut s, 3);
    cli_stream_until_caught_up(&s);
    ok(&s, &["apply"]);
    let r = ok(&s, &["reconcile"]);
    assert_eq!(r["clean"], true, "{r}");
    assert_eq!(ok(&s, &["status"])["generation"], 0);
    assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
    assert_secret_stays_closed(&s);
}

/// The same with a full snapshot (the stream's first call reads the table),
/// on an instance without a gating role.
#[test]
fn a_user_with_exactly_the_least_grants_takes_a_full_snapshot() {
    let mut s = scenario(false);
    grant_least_set_by_cli(&s, false);
    write_workflow(&s, Some(READER), &workflow_extra("full"));
    let first = ok(&s, &["stream"]);
    assert!(first["bootstrap"].is_object(), "the first call takes the snapshot: {first}");
    write_changes(&mut s, 5);
    cli_stream_until_caught_up(&s);
    ok(&s, &["apply"]);
    let r = ok(&s, &["reconcile"]);
    assert_eq!(r["clean"], true, "{r}");
    assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
    assert_secret_stays_closed(&s);
}

/// The user's read of the uncaptured column is SQL Server's error 230.
fn assert_secret_stays_closed(s: &Scenario) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let src = s.db.source_as(READER).unwrap();
    let read = SnapshotRead {
        table: s.table.clone(),
        columns: vec![ColumnDesc::new("secret", SqlType::NVarChar { len: Some(20) }, true)],
        keys: vec![],
        range: KeyRange::all(),
        isolation: Isolation::ReadCommitted,
        batch_rows: 100,
    };
    let e = rt.block_on(src.snapshot_read(&read)).err().expect("secret is closed to the reader");
    assert!(
        matches!(&e, SourceError::Permission(m) if m.contains("error 230") && m.contains("GRANT SELECT ON OBJECT::[dbo].[items] ([secret]) TO [cdc_reader]")),
        "{e}"
    );
}

/// A grant of the least set taken away, one per case.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Missing {
    /// No grant at all on dbo.items.
    Table,
    /// SELECT on the captured columns but `price`.
    OneCapturedColumn,
    ChangeTables,
    CapturedColumns,
    IndexColumns,
    /// No grant at all on cdc.dbo_items_CT.
    ChangeTable,
    /// The change table's ordering columns but `__$command_id`.
    CommandId,
    ChangeFunction,
    TimeMapping,
    /// Not a member of the gating role.
    GatingRole,
}

impl Missing {
    /// The grants the user has: the least set without this one.
    fn grants(self) -> Vec<LeastGrant> {
        least_grants()
            .into_iter()
            .filter_map(|mut g| {
                let drop = match self {
                    Missing::Table => g.on == "OBJECT::dbo.items",
                    Missing::ChangeTables => g.on == "OBJECT::cdc.change_tables",
                    Missing::CapturedColumns => g.on == "OBJECT::cdc.captured_columns",
                    Missing::IndexColumns => g.on == "OBJECT::cdc.index_columns",
                    Missing::ChangeTable => g.on == "OBJECT::cdc.dbo_items_CT",
                    Missing::ChangeFunction => g.on == "OBJECT::cdc.fn_cdc_get_all_changes_dbo_items",
                    Missing::TimeMapping => g.on == "OBJECT::cdc.lsn_time_mapping",
                    Missing::OneCapturedColumn | Missing::CommandId | Missing::GatingRole => false,
                };
                if self == Missing::OneCapturedColumn && g.on == "OBJECT::dbo.items" {
                    g.columns.retain(|c| *c != "price");
                }
                if self == Missing::CommandId && g.on == "OBJECT::cdc.dbo_items_CT" {
                    g.columns.retain(|c| *c != "__$command_id");
                }
                (!drop).then_some(g)
            })
            .collect()
    }

    /// What the error of a step that needs the grant must hold: the
    /// statement that grants it (its parts, where the step may meet it in
    /// either of two reads).
    fn names(self) -> Vec<&'static str> {
        match self {
            Missing::Table => vec!["GRANT SELECT ON OBJECT::[dbo].[items] TO [cdc_reader]"],
            // CDC's check (every captured column) or a read's 230 (the one column).
            Missing::OneCapturedColumn => vec!["GRANT SELECT ON OBJECT::[dbo].[items] (", "[price]", ") TO [cdc_reader]"],
            Missing::ChangeTables => vec!["GRANT SELECT ON OBJECT::[cdc].[change_tables] TO [cdc_reader]"],
            Missing::CapturedColumns => vec!["GRANT SELECT ON OBJECT::[cdc].[captured_columns] TO [cdc_reader]"],
            Missing::IndexColumns => vec!["GRANT SELECT ON OBJECT::[cdc].[index_columns] TO [cdc_reader]"],
            Missing::ChangeTable => {
                vec!["GRANT SELECT ON OBJECT::[cdc].[dbo_items_CT] ([__$start_lsn], [__$seqval], [__$operation], [__$command_id]) TO [cdc_reader]"]
            }
            Missing::CommandId => vec!["GRANT SELECT ON OBJECT::[cdc].[dbo_items_CT] ([__$command_id]) TO [cdc_reader]"],
            Missing::ChangeFunction => vec!["GRANT SELECT ON OBJECT::[cdc].[fn_cdc_get_all_changes_dbo_items] TO [cdc_reader]"],
            Missing::TimeMapping => vec!["GRANT SELECT ON OBJECT::[cdc].[lsn_time_mapping] TO [cdc_reader]"],
            Missing::GatingRole => vec!["ALTER ROLE [items_readers] ADD MEMBER [cdc_reader]"],
        }
    }

    /// The steps that need it, as docs/sqlserver.md's table has them: every
    /// step opens the catalog and asks for the instance's min LSN (CDC's
    /// check); only stream and reconcile read changes.
    fn needed_by(self) -> &'static [&'static str] {
        match self {
            Missing::CommandId | Missing::ChangeFunction | Missing::TimeMapping => &["stream", "reconcile"],
            _ => &STEPS,
        }
    }
}

/// The state every case starts from, made by the owner (no user on the
/// URL): the chunked snapshot read, streamed, applied and reconciled; then
/// changes captured that no step has read, so stream and reconcile have a
/// change read to make.
fn prepared() -> Scenario {
    let mut s = scenario(true);
    write_workflow(&s, None, &workflow_extra("chunked"));
    ok(&s, &["stream"]);
    cli_backfill_until_done(&s);
    write_changes(&mut s, 3);
    cli_stream_until_caught_up(&s);
    ok(&s, &["apply"]);
    ok(&s, &["reconcile"]);
    write_changes(&mut s, 4);
    s
}

/// A user with the least set but `missing`: each step that needs it exits 2
/// naming the grant, and leaves every file of the targets as it was; the
/// other steps run (exit 0).
fn missing_one(missing: Missing) {
    let s = prepared();
    s.db.create_user(READER).unwrap();
    for g in missing.grants() {
        let cols: Vec<String> = g.columns.iter().map(|c| c.to_string()).collect();
        s.db.grant(READER, Permission::Select, g.on, &cols).unwrap();
    }
    if missing != Missing::GatingRole {
        s.db.add_role_member(ROLE, READER).unwrap();
    }
    write_workflow(&s, Some(READER), &workflow_extra("chunked"));
    let needed = missing.needed_by();
    for name in STEPS.into_iter().filter(|n| needed.contains(n)) {
        let before = target_files(&s);
        let (code, j) = step(&s, &[name], &[]);
        assert_eq!(code, 2, "{missing:?}: `{name}` should stop with exit 2: {j}");
        let msg = j["error"].as_str().unwrap_or_default();
        for part in missing.names() {
            assert!(msg.contains(part), "{missing:?}: `{name}`'s error should name {part:?}: {msg}");
        }
        let after = target_files(&s);
        let changed: Vec<_> = after.iter().filter(|(p, n)| before.get(*p) != Some(*n)).map(|(p, _)| p.clone()).collect();
        assert!(changed.is_empty() && before.len() == after.len(), "{missing:?}: `{name}` wrote to the targets: {changed:?}");
    }
    for name in STEPS.into_iter().filter(|n| !needed.contains(n)) {
        let (code, j) = step(&s, &[name], &[]);
        assert_eq!(code, 0, "{missing:?}: `{name}` does not need the grant: {j}");
    }
}

#[test]
fn without_select_on_the_table_every_step_stops_naming_it() {
    missing_one(Missing::Table);
}

#[test]
fn without_select_on_one_captured_column_every_step_stops_naming_it() {
    missing_one(Missing::OneCapturedColumn);
}

#[test]
fn without_select_on_cdc_change_tables_every_step_stops_naming_it() {
    missing_one(Missing::ChangeTables);
}

#[test]
fn without_select_on_cdc_captured_columns_every_step_stops_naming_it() {
    missing_one(Missing::CapturedColumns);
}

#[test]
fn without_select_on_cdc_index_columns_every_step_stops_naming_it() {
    missing_one(Missing::IndexColumns);
}

#[test]
fn without_a_grant_on_the_change_table_every_step_stops_naming_it() {
    missing_one(Missing::ChangeTable);
}

#[test]
fn without_select_on_command_id_the_change_reads_stop_naming_it() {
    missing_one(Missing::CommandId);
}

#[test]
fn without_select_on_the_change_function_the_change_reads_stop_naming_it() {
    missing_one(Missing::ChangeFunction);
}

#[test]
fn without_select_on_the_time_mapping_the_change_reads_stop_naming_it() {
    missing_one(Missing::TimeMapping);
}

#[test]
fn outside_the_gating_role_every_step_stops_naming_it() {
    missing_one(Missing::GatingRole);
}

/// A user the database does not have is refused as SQL Server refuses the
/// login (error 18456), before anything is written.
#[test]
fn an_unknown_user_is_refused_at_login() {
    let s = scenario(false);
    write_workflow(&s, Some("nobody"), &workflow_extra("chunked"));
    let (code, j) = step(&s, &["stream"], &[]);
    assert_eq!(code, 2, "{j}");
    assert!(j["error"].as_str().is_some_and(|m| m.contains("18456") && m.contains("nobody")), "{j}");
    assert!(target_files(&s).is_empty(), "nothing is created for a refused login");
}
