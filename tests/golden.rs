//! Golden transition logs: each Delta commit of a deterministic scenario, one line each.

mod common;

use common::Scenario;

const BOOTSTRAP: &str = "[snapshot]\nbootstrap = true\nmode = \"full\"\nparallelism = 3\n[stream]\nmax_batch_rows = 1000\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_then_three_batches() {
    // Failpoints are process-wide: hold the scenario lock so the other test's cannot fire here.
    let _failpoints = fail::FailScenario::setup();
    let mut s = Scenario::new(50, BOOTSTRAP);
    s.stream().await.unwrap(); // bootstrap; nothing captured after S yet
    for _ in 0..3 {
        s.changes(6);
        let r = s.stream().await.unwrap();
        assert_eq!(r.batches, 1, "{r:?}");
    }
    // Each batch took the commits older than the capture lag; the last ones follow.
    s.stream_until_caught_up().await;
    let cmp = s.verify().await;
    assert_eq!(cmp.differences(), 0, "{cmp:?}");
    let log = s.golden().await;
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_bootstrap_three_batches", log));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_bronze_before_facts_then_rerun() {
    let _failpoints = fail::FailScenario::setup();
    let mut s = Scenario::new(20, BOOTSTRAP);
    s.stream().await.unwrap();
    s.changes(5);
    {
        fail::cfg("stream.after_bronze", "return").unwrap();
        let e = s.stream().await.unwrap_err();
        assert!(e.to_string().contains("stream.after_bronze"), "{e}");
        fail::remove("stream.after_bronze");
    }
    let r = s.stream().await.unwrap();
    assert_eq!(r.repaired_batches, vec![0], "{r:?}");
    assert_eq!(r.batches, 0, "nothing new after the repaired batch: {r:?}");
    s.changes(3);
    let r = s.stream().await.unwrap();
    assert_eq!(r.batches, 1);
    s.stream_until_caught_up().await;
    assert_eq!(s.verify().await.differences(), 0);
    assert_eq!(s.duplicate_change_rows().await, 0);
    assert_eq!(s.duplicate_batch_rows().await, 0);
    let log = s.golden().await;
    common::golden_settings().bind(|| insta::assert_snapshot!("golden_crash_after_bronze", log));
}
