//! The agreement's two paths on the real worker over the shared-memory bus: the O(buckets) summary
//! (the default) and the full per-rank table (`GRADBUS_AGREEMENT=table`) must give bitwise the same
//! metrics at 1 to 4 ranks, through healthy updates and a skipped non-finite one (which the summary
//! path answers by gathering the table).

mod common;

use common::{gradbus, metrics};

#[test]
fn summary_and_table_agreement_give_bitwise_identical_metrics_at_1_to_4_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    for np in 1..=4usize {
        let faults = format!("[[faults]]\nkind = \"inf\"\nrank = {}\nstep = 1\nminibatch = 1\n", np - 1);
        let run = |path: &str| {
            let dir = tmp.path().join(format!("{np}-{path}"));
            let n = np.to_string();
            let args = [
                "run",
                "--np",
                &n,
                "--run-dir",
                dir.to_str().unwrap(),
                "examples/tiny.toml",
                "--set",
                "steps=2",
                "--set",
                "policy=skip",
            ];
            gradbus(&args, &[("GRADBUS_FAULTS", &faults), ("GRADBUS_AGREEMENT", path)]).expect_code(0);
            metrics(&dir)
        };
        let (summary, table) = (run("summary"), run("table"));
        assert_eq!(summary.len(), 2 * 16, "{np} ranks: 2 steps x 16 updates");
        let skipped: Vec<_> = summary.iter().filter(|m| m["verdict"] == "skip").collect();
        assert_eq!(skipped.len(), 1, "{np} ranks: the planted Inf is skipped once");
        assert_eq!(skipped[0]["nonfinite_ranks"], serde_json::json!([np - 1]));
        for (u, (a, b)) in summary.iter().zip(&table).enumerate() {
            assert_eq!(a, b, "{np} ranks, update {u}: the paths' metrics differ");
        }
    }
}

#[test]
fn an_unknown_agreement_path_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bad");
    let r = gradbus(
        &["run", "--np", "2", "--run-dir", dir.to_str().unwrap(), "examples/tiny.toml", "--set", "steps=1"],
        &[("GRADBUS_AGREEMENT", "gossip")],
    );
    r.expect_code(2);
    assert!(r.stderr().contains("GRADBUS_AGREEMENT=\"gossip\""), "{}", r.stderr());
}
