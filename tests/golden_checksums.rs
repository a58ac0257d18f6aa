//! The bits of three runs, pinned: the replica checksum (`metrics.jsonl`'s `checksum`, the weights
//! after each update) that the code on main at 4d89fa5 - before the model and the step loop went
//! through a backend - ended on, read from the last metrics line of these same commands. Any change
//! of a single bit of any weight, in any update, changes them; a change that is meant to change the
//! bits (a new kernel order, say) must say so and update this file.

mod common;

use common::{gradbus, metrics};
use serde_json::Value;

fn run(dir: &std::path::Path, np: &str, sets: &[&str]) -> common::Run {
    let mut args = vec!["run", "--np", np, "--run-dir", dir.to_str().unwrap(), "examples/tiny.toml"];
    for s in sets {
        args.extend(["--set", s]);
    }
    gradbus(&args, &[])
}

fn last_checksum(m: &[Value]) -> &str {
    m.last().expect("a metrics line")["checksum"].as_str().expect("checksum")
}

#[test]
fn tiny_at_2_ranks_for_6_steps_ends_on_its_checksum() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    run(&d, "2", &["steps=6"]).expect_code(0);
    let m = metrics(&d);
    assert_eq!(m.len(), 6 * 16, "6 steps of 16 updates");
    assert_eq!(last_checksum(&m), "73b1ee1cc5751340");
}

#[test]
fn the_3_2m_model_at_1_rank_for_1_step_ends_on_its_checksum() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    run(&d, "1", &["steps=1", "model.channels=256", "model.layers=4"]).expect_code(0);
    assert_eq!(last_checksum(&metrics(&d)), "323bede7c1005b32");
}

#[test]
fn the_fast_seed_case_aborts_where_it_did_on_the_same_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    let sets: Vec<&str> = common::FAST_SEED_CASE.iter().copied().filter(|s| *s != "--set").collect();
    run(&d, "2", &sets).expect_code(3);
    let rep: Value = serde_json::from_str(&std::fs::read_to_string(d.join("report.json")).unwrap()).unwrap();
    let got = (&rep["step"], &rep["minibatch"], &rep["param"], &rep["element"], &rep["nan"]);
    assert_eq!(
        got,
        (&Value::from(115), &Value::from(1), &Value::from("head.weight"), &Value::from(0), &Value::from(204288))
    );
    let m = metrics(&d);
    let (abort, before) = (&m[m.len() - 1], &m[m.len() - 2]);
    assert_eq!((&abort["verdict"], &before["verdict"]), (&Value::from("abort"), &Value::from("proceed")));
    assert_eq!(before["checksum"], "173ba622521ab211", "the weights after the last update before the abort");
    assert_eq!(abort["checksum"], before["checksum"], "an abort leaves the weights");
}
