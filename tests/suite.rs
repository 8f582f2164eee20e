//! The integration tests that share one binary. Each module is one file of
//! `tests/`, kept at its old path so the paths docs cite still hold; a file's
//! tests are filtered by its module name (`cargo test --release --test suite
//! type_change::`). Files that arm failpoints in process keep a binary each
//! (see Cargo.toml).

#[path = "apply_slices.rs"]
mod apply_slices;
#[path = "batch_race.rs"]
mod batch_race;
#[path = "bench_cli.rs"]
mod bench_cli;
#[path = "change_order.rs"]
mod change_order;
#[path = "cli.rs"]
mod cli;
#[path = "collations.rs"]
mod collations;
#[path = "concurrent_first.rs"]
mod concurrent_first;
#[path = "facts_read.rs"]
mod facts_read;
#[path = "fleet.rs"]
mod fleet;
#[path = "heap_silver.rs"]
mod heap_silver;
#[path = "identity_cli.rs"]
mod identity_cli;
#[path = "layers.rs"]
mod layers;
#[path = "lock_wait.rs"]
mod lock_wait;
#[path = "machine.rs"]
mod machine;
#[path = "maintain.rs"]
mod maintain;
#[path = "mssql_integration.rs"]
mod mssql_integration;
#[path = "orchestration_by_transition.rs"]
mod orchestration_by_transition;
#[path = "permissions.rs"]
mod permissions;
#[path = "reconcile_tiers.rs"]
mod reconcile_tiers;
#[path = "records_last.rs"]
mod records_last;
#[path = "records_lock.rs"]
mod records_lock;
#[path = "records_more.rs"]
mod records_more;
#[path = "records_rules.rs"]
mod records_rules;
#[path = "records_untested.rs"]
mod records_untested;
#[path = "records_waves.rs"]
mod records_waves;
#[path = "rename.rs"]
mod rename;
#[path = "seed.rs"]
mod seed;
#[path = "seed_cli.rs"]
mod seed_cli;
#[path = "silver_identity.rs"]
mod silver_identity;
#[path = "silver_keys.rs"]
mod silver_keys;
#[path = "source_bounds.rs"]
mod source_bounds;
#[path = "switch_before_start.rs"]
mod switch_before_start;
#[path = "switch_after_cleanup.rs"]
mod switch_after_cleanup;
#[path = "switch_chunked.rs"]
mod switch_chunked;
#[path = "torture.rs"]
mod torture;
#[path = "transitions.rs"]
mod transitions;
#[path = "type_change.rs"]
mod type_change;
