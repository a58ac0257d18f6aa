//! Silent data corruption planted with the `bitflip` fault into the real `gradbus run` (2 ranks of
//! `examples/tiny.toml`, 3 steps of 16 updates): a flipped exponent bit of a local gradient is named
//! (rank, bucket, parameter, element) and the rerun decides - transient: the run ends on the clean
//! run's bits; deterministic: the policy (abort with `report.json`, or skip); a flip in a rank's
//! copy of the reduced gradient or in its weights is repaired from the other rank, and the run ends
//! on the clean bits on EVERY rank (each rank logs its weights' checksum as read back after the
//! last update). Clean runs make no finding at all: no metrics line carries `sdc`, no repair.

mod common;

use std::path::Path;

use common::{gradbus, metrics};
use serde_json::Value;

/// `gradbus run --np 2` of 3 tiny steps with `sets` and the fault plan `faults`.
fn run(dir: &Path, faults: &str, sets: &[&str]) -> common::Run {
    let mut args = vec!["run", "--np", "2", "--run-dir", dir.to_str().unwrap(), "examples/tiny.toml"];
    for s in ["steps=3", "checkpoint.every=0"].iter().chain(sets) {
        args.extend(["--set", s]);
    }
    gradbus(&args, &[("GRADBUS_FAULTS", faults)])
}

/// One bitflip at step 1 on rank `rank`.
fn flip(rank: usize, minibatch: u32, target: &str, param: &str, element: usize, bit: u32, transient: bool) -> String {
    format!(
        "[[faults]]\nkind = \"bitflip\"\nrank = {rank}\nstep = 1\nminibatch = {minibatch}\ntarget = \"{target}\"\n\
         param = \"{param}\"\nelement = {element}\nbit = {bit}\ntransient = {transient}\n"
    )
}

/// Every rank's checksum of its weights as read back after the last update (its log's last such
/// line: a resumed run appends to the log).
fn final_weights(dir: &Path) -> Vec<String> {
    (0..2)
        .map(|k| {
            let log = std::fs::read_to_string(dir.join(format!("rank-{k}.log"))).expect("rank log");
            let line = log.lines().rev().find(|l| l.contains("final weights checksum")).unwrap_or_else(|| {
                panic!("rank {k} logged no final weights checksum:\n{log}");
            });
            line.split("checksum ").nth(1).unwrap().split(' ').next().unwrap().to_string()
        })
        .collect()
}

/// The metrics lines that carry a silent-data-corruption finding.
fn findings(m: &[Value]) -> Vec<&Value> {
    m.iter().filter(|l| l.get("sdc").is_some()).collect()
}

/// The clean run's final weights (every rank) and last metrics checksum.
fn clean(dir: &Path) -> (Vec<String>, Value) {
    run(dir, "", &[]).expect_code(0);
    let m = metrics(dir);
    assert!(findings(&m).is_empty(), "a clean run made a finding: {:?}", findings(&m));
    let w = final_weights(dir);
    assert_eq!(w[0], w[1], "the replicas of a clean run are alike");
    (w, m.last().unwrap()["checksum"].clone())
}

#[test]
fn a_transient_exponent_flip_in_a_local_gradient_is_named_and_rerun_to_the_clean_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let (want, last) = clean(&tmp.path().join("clean"));
    let d = tmp.path().join("flip");
    run(&d, &flip(1, 5, "grad", "head.weight", 5, 30, true), &[]).expect_code(0);
    let m = metrics(&d);
    let f = findings(&m);
    assert_eq!(f.len(), 2, "the outlier, then its rerun's classification: {f:?}");
    let (first, rerun) = (f[0], f[1]);
    assert_eq!(
        (&first["step"], &first["minibatch"], &first["attempt"]),
        (&Value::from(1), &Value::from(5), &Value::from(0))
    );
    let text = first["sdc"].as_str().unwrap();
    for part in ["rank 1 bucket #0", "head.weight[5]", "rerun"] {
        assert!(text.contains(part), "{text} lacks {part}");
    }
    assert_eq!((&rerun["attempt"], &rerun["verdict"]), (&Value::from(1), &Value::from("proceed")));
    assert!(rerun["sdc"].as_str().unwrap().contains("transient"), "{rerun}");
    assert_eq!(final_weights(&d), want, "every rank ends on the clean run's weights");
    assert_eq!(m.last().unwrap()["checksum"], last);
    assert_eq!(m.len(), 3 * 16 + 1, "one more line: the rerun");
}

#[test]
fn a_deterministic_exponent_flip_is_judged_by_the_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = flip(1, 5, "grad", "head.weight", 5, 30, false);
    // abort (the default): every rank stops, report.json names rank, bucket, parameter, element.
    let d = tmp.path().join("abort");
    let r = run(&d, &plan, &[]);
    r.expect_code(3);
    let rep: Value = serde_json::from_str(&std::fs::read_to_string(d.join("report.json")).unwrap()).unwrap();
    let got = (&rep["cause"], &rep["ranks"], &rep["bucket"], &rep["param"], &rep["element"], &rep["classification"]);
    let want = (
        &Value::from("outlier"),
        &Value::from(vec![1]),
        &Value::from(0),
        &Value::from("head.weight"),
        &Value::from(5),
        &Value::from("deterministic"),
    );
    assert_eq!(got, want, "{rep}");
    assert_eq!((&rep["step"], &rep["minibatch"], &rep["attempt"]), (&Value::from(1), &Value::from(5), &Value::from(1)));
    // skip: the update is dropped on every rank and the run goes on.
    let d = tmp.path().join("skip");
    run(&d, &plan, &["policy=skip"]).expect_code(0);
    let m = metrics(&d);
    let skipped: Vec<&Value> = m.iter().filter(|l| l["verdict"] == "skip").collect();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0]["sdc"].as_str().unwrap().contains("deterministic"), "{}", skipped[0]);
    let w = final_weights(&d);
    assert_eq!(w[0], w[1], "a skip keeps the replicas alike");
}

#[test]
fn flips_in_a_reduced_copy_and_in_the_weights_are_repaired_to_the_clean_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let (want, last) = clean(&tmp.path().join("clean"));
    // A sign flip in rank 1's copy of the reduced gradient (consumed by its optimizer), a flip of
    // exponent bit 30 in rank 0's weights after the last update of step 1 (the next step's rollout
    // samples with them before any check: the step is redone), a low mantissa bit.
    for (name, plan) in [
        ("reduced", flip(1, 3, "reduced", "blocks.1.mlp.fc.weight", 100, 31, false)),
        ("weight", flip(0, 15, "weight", "head.weight", 3, 30, false)),
        ("mantissa", flip(1, 7, "weight", "wte", 9, 0, true)),
    ] {
        let d = tmp.path().join(name);
        run(&d, &plan, &[]).expect_code(0);
        let m = metrics(&d);
        let repairs: Vec<&Value> = m.iter().filter(|l| l["verdict"] == "repair").collect();
        assert_eq!(repairs.len(), 1, "{name}: {repairs:?}");
        assert!(repairs[0]["sdc"].as_str().unwrap().contains("repaired from rank"), "{name}: {}", repairs[0]);
        assert_eq!(final_weights(&d), want, "{name}: every rank ends on the clean run's weights");
        assert_eq!(m.last().unwrap()["checksum"], last, "{name}");
    }
}

#[test]
fn clean_runs_make_no_finding() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("four");
    let args = ["run", "--np", "4", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml"];
    let sets = ["--set", "steps=4", "--set", "seed=3", "--set", "checkpoint.every=0"];
    gradbus(&[&args[..], &sets[..]].concat(), &[]).expect_code(0);
    let m = metrics(&d);
    assert_eq!(m.len(), 4 * 16);
    assert!(findings(&m).is_empty() && m.iter().all(|l| l["verdict"] == "proceed"), "{:?}", findings(&m));
    // The fast seed case up to its abort: its gradients grow for 115 steps; no finding before the NaN.
    let d = tmp.path().join("seed");
    let mut args = vec!["run", "--np", "2", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml"];
    args.extend(common::FAST_SEED_CASE);
    gradbus(&args, &[]).expect_code(3);
    let m = metrics(&d);
    assert!(findings(&m).is_empty(), "{:?}", findings(&m));
    assert_eq!(m.last().unwrap()["step"], 115, "the abort where it was");
}

#[test]
fn the_checks_turned_off_change_no_bit() {
    // The guard only reads: without it (no read-back, no peaks or chunk hashes in the reduce, an
    // optimizer that hashes nothing it reads; bench/sdc-cost.py measures the difference) every update's loss and
    // weights' checksum are the same.
    let tmp = tempfile::tempdir().unwrap();
    let on = tmp.path().join("on");
    clean(&on);
    let off = tmp.path().join("off");
    run(&off, "", &["sdc.replicas=false", "sdc.outliers=false"]).expect_code(0);
    let bits = |d: &Path| metrics(d).iter().map(|l| (l["loss"].clone(), l["checksum"].clone())).collect::<Vec<_>>();
    let (a, b) = (bits(&on), bits(&off));
    assert_eq!(a.len(), 3 * 16);
    assert_eq!(a, b, "every update's loss and weights' checksum");
    assert!(findings(&metrics(&off)).is_empty());
}

/// A bucket whose gradient is all zero on every rank - `ln_f.bias` alone in its bucket
/// (`bucket_bytes=4`), scaled by 0 on both ranks at step 1 - puts a level of -inf (log2 of 0) into
/// the outlier rule's history; the checkpoint written after it resumes (it was refused: "key
/// `meta.sdc.outliers.history[1][16]`: invalid type: null, expected f64") and the resumed run ends
/// on the uninterrupted run's bits.
#[test]
fn a_checkpoint_after_a_bucket_all_zero_on_every_rank_resumes_to_the_uninterrupted_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let zero: String = (0..2)
        .map(|k| format!("[[faults]]\nkind = \"scale\"\nrank = {k}\nstep = 1\nfactor = 0.0\nparam = \"ln_f.bias\"\n"))
        .collect();
    let run = |dir: &Path, how: &str, steps: &str| {
        let mut args = vec!["run", "--np", "2", how, dir.to_str().unwrap(), "examples/tiny.toml"];
        for s in [steps, "checkpoint.every=2", "bucket_bytes=4", "sdc.outliers=true"] {
            args.extend(["--set", s]);
        }
        gradbus(&args, &[("GRADBUS_FAULTS", &zero)])
    };
    let (full, part) = (tmp.path().join("full"), tmp.path().join("part"));
    run(&full, "--run-dir", "steps=3").expect_code(0);
    run(&part, "--run-dir", "steps=2").expect_code(0);
    let state = std::fs::read(part.join("checkpoints/step-000002/state.bin")).unwrap();
    assert!(String::from_utf8_lossy(&state).contains(r#","-inf","#), "the zero bucket's level is in the checkpoint");
    let r = run(&part, "--resume", "steps=3");
    r.expect_code(0);
    assert!(r.stderr().contains("step-000002 at step 2"), "did not resume from step-000002\n{}", r.stderr());
    assert_eq!(metrics(&part), metrics(&full));
    assert_eq!(final_weights(&part), final_weights(&full));
}
