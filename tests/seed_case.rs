//! The seed case (roll-193) on a small, fast config with the same mechanism: a stale rollout engine
//! (never synced) and a high learning rate drive the current policy's log-prob of a sampled token far
//! below the reference's, until ROLL's k3 `exp(ref - logp)` overflows. Nothing is injected.
//! The failure must be deterministic (same step on a second run and after resume), every rank must
//! stop with the same report, replay must reproduce it bit for bit and name the exp, and the safe
//! loss must pass the same step.

mod common;

use common::{gradbus, metrics};
use serde_json::Value;

/// The fast seed-case config, with a checkpoint every 40 steps.
fn sets() -> Vec<&'static str> {
    [common::FAST_SEED_CASE, &["--set", "checkpoint.every=40"]].concat()
}

fn run(dir: &std::path::Path, extra: &[&str]) -> common::Run {
    let mut args = vec!["run", "--np", "2", "--run-dir", dir.to_str().unwrap(), "examples/tiny.toml"];
    args.extend(sets());
    args.extend_from_slice(extra);
    gradbus(&args, &[])
}

fn report(dir: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).expect("report.json")).unwrap()
}

#[test]
fn stale_rollouts_overflow_the_k3_exp_deterministically_and_the_safe_loss_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let r = run(&a, &[]);
    r.expect_code(3);
    let rep = report(&a);
    for key in
        ["gradbus", "step", "minibatch", "verdict", "ranks", "bucket", "param", "element", "nan", "inf", "loss_finite"]
    {
        assert!(rep.get(key).is_some(), "report.json lacks {key}: {rep}");
    }
    let step = rep["step"].as_u64().unwrap();
    assert!(step > 40, "the failure comes from the dynamics, not at the start (step {step})");
    assert_eq!(rep["verdict"], "abort");
    assert_eq!(rep["bucket"], 0, "the NaN enters at the loss: the head's bucket #0 sees it first");
    assert_eq!(rep["param"], "head.weight");
    assert_eq!(rep["loss_finite"], true, "ROLL's clamp keeps the loss finite while the gradient is NaN");
    assert!(rep["nan"].as_u64().unwrap() > 0);
    // Every rank stopped with the same report line.
    let line = format!("non-finite gradients at step {step} update {}", rep["minibatch"]);
    for rank in 0..2 {
        let log = std::fs::read_to_string(a.join(format!("rank-{rank}.log"))).unwrap();
        assert!(log.contains(&line), "rank {rank} log lacks `{line}`:\n{log}");
    }

    // Each rank with non-finite gradients traced its update on the spot and names the k3 exp.
    let bad = rep["ranks"][0].as_u64().unwrap();
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(a.join(format!("trace-rank-{bad}.json"))).unwrap()).unwrap();
    assert_eq!(trace["first"]["op"], "loss.kl_exp", "{trace}");

    // The early warning fired before the first non-finite gradient, from the agreed headroom.
    let m = metrics(&a);
    let warned = m.iter().position(|l| l["headroom"].as_f64().is_some_and(|h| h < 20.0)).expect("no warning");
    let failed = m.iter().position(|l| l["verdict"] == "abort").expect("no abort line");
    assert!(warned < failed, "warning at update {warned}, failure at {failed}");
    assert!(std::fs::read_to_string(a.join("rank-0.log")).unwrap().contains("nats from exp overflow"));
    // ... and its lines in warnings.jsonl (rank 0's, verified): the first at that update or before
    // (the forecast may come first), each for its own reason (the headroom under 20 nats, or the
    // ceiling forecast within 7 updates), the last the failing update's log-ratio past the
    // ceiling, held by a rank of the report.
    let w = gradbus_artifacts::read_warnings(&a.join("warnings.jsonl")).expect("warnings.jsonl");
    let (first, last) = (&w[0], w.last().unwrap());
    // A warning's update is step x updates per step + update within the step (not a line index:
    // a rerun writes a line too).
    let per_step = m.iter().map(|l| l["minibatch"].as_u64().unwrap() + 1).max().unwrap();
    let update = |i: usize| m[i]["step"].as_u64().unwrap() * per_step + m[i]["minibatch"].as_u64().unwrap();
    assert!(first.update <= update(warned) && first.quantity == "loss.exp", "{first:?}");
    assert!(w.windows(2).all(|p| p[0].update < p[1].update), "one line per update, in order");
    for l in &w {
        let why = l.limit - l.value < 20.0 || l.forecast_updates.is_some_and(|f| f <= 7.0);
        assert!(why && l.action == gradbus_collectives::Alert::Warn, "{l:?}");
    }
    assert_eq!((last.update, last.forecast_updates), (update(failed), Some(0.0)), "{last:?}");
    let ceiling = gradbus_collectives::forecast::exp_ceiling("float32").unwrap();
    assert!(last.value > last.limit && last.limit == ceiling, "{last:?}");
    assert!(rep["ranks"].as_array().unwrap().contains(&last.rank.into()), "{last:?} {rep}");

    // Deterministic: a second run fails at the same update with the same report.
    let b = tmp.path().join("b");
    run(&b, &[]).expect_code(3);
    assert_eq!(report(&b), rep);
    assert_eq!(metrics(&b), metrics(&a));

    // Resume from the last checkpoint before the failure: the same failure again. The first run's
    // report and dumps are removed, so what is compared is what the resumed run wrote.
    let ckpt = (step / 40) * 40;
    assert!(a.join(format!("checkpoints/step-{ckpt:06}/DONE")).exists());
    std::fs::remove_file(a.join("report.json")).unwrap();
    std::fs::remove_dir_all(a.join("dumps")).unwrap();
    let mut args = vec!["run", "--np", "2", "--resume", a.to_str().unwrap(), "examples/tiny.toml"];
    args.extend(sets());
    let resumed = gradbus(&args, &[]);
    resumed.expect_code(3);
    assert!(resumed.stderr().contains(&format!("step-{ckpt:06} at step {ckpt}")), "{}", resumed.stderr());
    assert_eq!(report(&a), rep, "the resumed run's report.json");
    assert_eq!(metrics(&a), metrics(&b), "the resumed run's metrics are the uninterrupted run's");
    let warnings = |d: &std::path::Path| std::fs::read_to_string(d.join("warnings.jsonl")).unwrap();
    assert_eq!(warnings(&a), warnings(&b), "the resumed run's warnings are the uninterrupted run's");

    // Replay in one process: bit for bit, and the trace names the k3 exp.
    let out = gradbus(&["replay", a.to_str().unwrap(), "--trace", "--json"], &[]);
    out.expect_code(0);
    let replay: Value = serde_json::from_str(out.stdout().trim()).unwrap();
    assert_eq!(replay["identical"], true, "{replay}");
    assert_eq!(replay["first"]["phase"], "forward");
    assert_eq!(replay["first"]["op"], "loss.kl_exp", "{replay}");
    assert!(replay["first"]["exp_input"].as_f64().unwrap() > 88.72);

    // Policy rerun: the recomputed update is non-finite in the same places: deterministic.
    let d = tmp.path().join("d");
    run(&d, &["--set", "policy=rerun"]).expect_code(3);
    let rerun = report(&d);
    assert_eq!((rerun["step"].clone(), rerun["minibatch"].clone()), (rep["step"].clone(), rep["minibatch"].clone()));
    assert_eq!(rerun["attempt"], 1);
    assert_eq!(rerun["classification"], "deterministic");

    // The fix: the safe loss passes that step with no non-finite gradient.
    let c = tmp.path().join("c");
    run(&c, &["--set", "loss.style=safe", "--set", &format!("steps={}", step + 5)]).expect_code(0);
    let m = metrics(&c);
    assert!(m.iter().all(|l| l["verdict"] == "proceed"), "safe run skipped or aborted");
    assert_eq!(m.last().unwrap()["step"].as_u64(), Some(step + 4));
}
