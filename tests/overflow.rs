//! Gradients that are finite on every rank but too large: their rank-ordered sum overflows (an
//! abort that names the sum, its bucket, parameter and element, not a rank), or only their norm
//! would overflow in f32 (the bus's f64 norm stays finite, clipping tames it, training goes on).
//! Both planted with the `scale` fault (multiply by a factor, saturated to +-f32::MAX).

mod common;

use common::{gradbus, metrics};

const TINY: &str = "examples/tiny.toml";

fn scale(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| format!("[[faults]]\nkind = \"scale\"\nrank = {r}\nstep = 0\nminibatch = 1\nfactor = 1e300\n"))
        .collect()
}

#[test]
fn a_sum_of_finite_gradients_that_overflows_is_reported_as_a_sum_overflow() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let d = dir.to_str().unwrap();
    // Both ranks: every non-zero element of head.weight's gradient becomes +-f32::MAX, finite on
    // each rank; where the two agree in sign, their sum is +-Inf.
    let r = gradbus(
        &["run", "--np", "2", "--run-dir", d, TINY, "--set", "steps=2"],
        &[("GRADBUS_FAULTS", &scale(&[0, 1]))],
    );
    r.expect_code(3);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["cause"], "sum_overflow", "{report}");
    assert_eq!(report["ranks"], serde_json::json!([]), "no rank's own gradients were non-finite");
    assert_eq!((report["step"].as_u64(), report["minibatch"].as_u64()), (Some(0), Some(1)));
    assert_eq!(report["bucket"], 0, "head.weight is the last parameter: bucket #0");
    assert_eq!(report["param"], "head.weight");
    assert!(report["inf"].as_u64().unwrap() > 0, "{report}");
    let m = metrics(&dir);
    let last = m.last().unwrap();
    assert_eq!(last["verdict"], "abort");
    assert_eq!(last["nonfinite_ranks"], serde_json::json!([]));
    assert!(r.stderr().contains("the sum overflowed, every rank's gradients finite"), "{}", r.stderr());
}

#[test]
fn a_finite_gradient_whose_norm_overflows_f32_is_clipped_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let d = dir.to_str().unwrap();
    // Rank 0 only: the sum stays finite (+-f32::MAX plus a small value), its norm is far above
    // f32::MAX (an f32 norm would be Inf), the f64 norm is finite and clipping scales it down.
    let r =
        gradbus(&["run", "--np", "2", "--run-dir", d, TINY, "--set", "steps=3"], &[("GRADBUS_FAULTS", &scale(&[0]))]);
    r.expect_code(0);
    let m = metrics(&dir);
    let hit = m.iter().find(|u| u["step"] == 0 && u["minibatch"] == 1).unwrap();
    assert_eq!(hit["verdict"], "proceed", "{hit}");
    let norm = hit["grad_norm"].as_f64().expect("a finite norm is a number, not null");
    assert!(norm > f32::MAX as f64, "{norm}");
    assert!(m.iter().all(|u| u["verdict"] == "proceed" && u["loss"].is_number()), "{m:?}");
}
