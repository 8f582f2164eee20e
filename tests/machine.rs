//! The state machine through the command line (`engine::machine`,
//! `engine::step`): `step next`, called until both lanes are idle while a
//! writer goes on between calls, takes a chunked snapshot through every
//! state (opened, planned, waves, chunks read, streaming) and brings the
//! targets to the source's own rows and change log, as `stream` and
//! `backfill` do (the last wave leaves every chunk read, and the completion
//! runs as a transition of its own); a named transition that is not next
//! exits 2 naming what is; `status` shows the state and both lanes' next
//! transitions.

mod common;

use std::collections::BTreeSet;

use common::{ok, step, Scenario};

const CHUNKED: &str = "silver = \"silver\"\n[snapshot]\nbootstrap = true\nmode = \"chunked\"\nparallelism = 2\nchunk_rows = 7\ntarget_wave_seconds = 0\n\
                       [stream]\nmax_batch_rows = 1000\n";

#[test]
fn step_next_until_idle_reaches_the_tables_stream_and_backfill_reach() {
    let mut s = Scenario::new(40, CHUNKED);
    // Nothing is allowed but what is next: a wave before the open is refused.
    let (code, j) = step(&s, &["step", "wave"], &[]);
    assert_eq!(code, 2, "{j}");
    let e = j["error"].as_str().unwrap();
    assert!(e.contains("not allowed in state NotStarted") && e.contains("'open'"), "{e}");
    assert!(!s.path().join("bronze").join("_delta_log").exists() || ok(&s, &["status"])["position"].is_null(), "the refusal wrote nothing");
    let (code, j) = step(&s, &["step", "teleport"], &[]);
    assert_eq!(code, 2, "{j}");
    assert!(j["error"].as_str().unwrap().contains("not a transition"), "{j}");

    let mut states = BTreeSet::new();
    let mut transitions = BTreeSet::new();
    let mut last: serde_json::Value;
    let mut waves = 0;
    for call in 0..300 {
        // A writer for the first 60 calls (captured at once); then one wait
        // for the capture job, and no more writes, so both lanes run out of work.
        if (call % 3 == 0 && call < 60) || call == 60 {
            if call < 60 {
                s.changes(2);
            }
            common::settle(&s.db);
        }
        let (code, j) = step(&s, &["step"], &[]);
        assert_eq!(code, 0, "{j}");
        let t = j["transition"].as_str().unwrap().to_string();
        if t == "wave" {
            waves += 1;
            // A wave never records the completion, not even the last one.
            assert_ne!(j["after"]["state"], "streaming", "a wave completed the snapshot: {j}");
        }
        states.insert(j["before"]["state"].as_str().unwrap().to_string());
        states.insert(j["after"]["state"].as_str().unwrap().to_string());
        assert!(j["next"]["stream"]["transition"].is_string(), "{j}");
        // Done once the writer has stopped, the snapshot is complete and a
        // call found the stream caught up (the capture job's idle rows keep
        // moving the max LSN on, so the stream lane goes on committing
        // empty batches, as `stream` would).
        let caught_up = t == "idle" || j["result"]["caught_up"] == true;
        let done = call > 60 && caught_up && j["after"]["state"] == "streaming" && j["next"]["backfill"]["transition"] == "idle";
        transitions.insert(t);
        last = j;
        if done {
            break;
        }
        assert!(call < 299, "step next never caught up with the snapshot complete; the last call: {last}");
    }
    assert!(waves >= 2, "the snapshot was read in {waves} waves");
    for want in ["open", "plan", "complete", "commit"] {
        assert!(transitions.contains(want), "step next never ran '{want}': {transitions:?}");
    }
    for want in ["not_started", "chunked_opened", "chunked_planned", "chunks_read", "streaming"] {
        assert!(states.contains(want), "step next never passed state {want}: {states:?}");
    }
    let j = ok(&s, &["status"]);
    assert_eq!(j["machine"]["state"], "streaming", "{j}");
    assert_eq!(j["machine"]["next"]["backfill"]["transition"], "idle", "{j}");
    // Bronze holds the change log from S once and the facts tile it, as after stream + backfill.
    ok(&s, &["apply"]);
    common::assert_targets_match_source_blocking(&s.db, &s.table, &s.wf_path);
}
