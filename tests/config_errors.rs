//! Bad input at the edges ends with exit 2 and a message that names the file, key or line and gives a
//! hint - never a panic or a backtrace. A bad config is refused once, by the launcher, before any
//! rank starts.

mod common;
#[path = "common/skip.rs"]
mod skip;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{gradbus, root};

fn no_panic(r: &common::Run) {
    let all = r.stdout() + &r.stderr();
    assert!(!all.contains("panicked") && !all.contains("RUST_BACKTRACE"), "{}\n{all}", r.cmd);
}

#[test]
fn unknown_config_key_names_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    let r = gradbus(
        &[
            "run",
            "--np",
            "2",
            "--run-dir",
            d.to_str().unwrap(),
            "examples/tiny.toml",
            "--set",
            "rollout_sync_intervall=5",
        ],
        &[],
    );
    r.expect_code(2);
    no_panic(&r);
    assert!(
        r.stdout().contains("rollout_sync_intervall") || r.stderr().contains("rollout_sync_intervall"),
        "{}",
        r.stderr()
    );
}

#[test]
fn wrong_type_and_out_of_range_values_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    let r =
        gradbus(&["run", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml", "--set", "optim.lr=\"fast\""], &[]);
    r.expect_code(2);
    no_panic(&r);
    assert!((r.stdout() + &r.stderr()).contains("lr"), "{}", r.stderr());
    let r = gradbus(
        &["run", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml", "--set", "rollout_sync_interval=0"],
        &[],
    );
    r.expect_code(2);
    assert!((r.stdout() + &r.stderr()).contains("rollout_sync_interval"), "{}", r.stderr());
    let r = gradbus(&["run", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml", "--set", "nokey"], &[]);
    r.expect_code(2);
    assert!((r.stdout() + &r.stderr()).contains("--set nokey"), "{}", r.stderr());
}

/// Every key of the config (examples/tiny.toml and worker/src/config/mod.rs), each with a value of the
/// wrong type, a value just past its boundary and an absurd one (non-finite, negative, or a model
/// that cannot fit any machine). `faults[0].FIELD` rows plant one fault with that field set.
const BAD_VALUES: &[(&str, [&str; 3])] = &[
    ("seed", ["\"zero\"", "-1", "1e30"]),
    ("steps", ["\"many\"", "0", "-5"]),
    ("policy", ["1", "\"\"", "\"panic\""]),
    ("rollout_sync_interval", ["true", "0", "-1"]),
    ("bucket_bytes", ["\"64k\"", "3", "-65536"]),
    ("collective_timeout_s", ["\"30s\"", "0", "inf"]),
    ("overlap", ["1", "\"\"", "\"maybe\""]),
    ("device", ["1", "\"\"", "\"tpu\""]),
    ("model", ["1", "[]", "\"big\""]),
    ("model.vocab", ["\"16\"", "3", "1000000000000"]),
    ("model.max_seq", ["\"16\"", "2", "10000000000000"]),
    ("model.channels", ["64.0", "0", "100000"]),
    ("model.heads", ["\"4\"", "0", "1000000000"]),
    ("model.layers", ["[2]", "0", "1000000000000"]),
    ("rl", ["1", "[]", "\"x\""]),
    ("rl.prompts_per_rank", ["\"2\"", "0", "1000000000000"]),
    ("rl.group_size", ["8.5", "1", "1000000000000"]),
    ("rl.response_len", ["\"8\"", "0", "1000000"]),
    ("rl.epochs", ["\"4\"", "0", "-4"]),
    ("rl.minibatches", ["\"4\"", "0", "1000000"]),
    ("rl.temperature", ["\"hot\"", "0", "inf"]),
    ("loss", ["1", "[]", "\"x\""]),
    ("loss.style", ["1", "\"\"", "\"unsafe\""]),
    ("loss.clip", ["\"0.2\"", "0", "inf"]),
    ("loss.kl_coef", ["\"0.01\"", "-0.001", "nan"]),
    ("optim", ["1", "[]", "\"x\""]),
    ("optim.lr", ["\"fast\"", "0", "nan"]),
    ("optim.warmup", ["\"10\"", "-1", "1e30"]),
    ("optim.beta1", ["\"0.9\"", "1.0", "-inf"]),
    ("optim.beta2", ["\"0.999\"", "1.0", "1e30"]),
    ("optim.eps", ["\"1e-8\"", "0", "inf"]),
    ("optim.weight_decay", ["\"0\"", "-1e-9", "nan"]),
    ("optim.grad_clip", ["\"1\"", "-0.001", "inf"]),
    ("skip", ["1", "[]", "\"x\""]),
    ("skip.max_consecutive", ["\"3\"", "-1", "4294967296"]),
    ("skip.max_fraction", ["\"0.1\"", "1.0001", "nan"]),
    ("skip.window", ["\"100\"", "0", "4294967296"]),
    ("checkpoint", ["1", "[]", "\"x\""]),
    ("checkpoint.every", ["\"10\"", "-1", "1e30"]),
    ("warn", ["1", "[]", "\"x\""]),
    ("warn.headroom", ["\"20\"", "-0.001", "inf"]),
    ("warn.forecast", ["\"5\"", "-0.001", "inf"]),
    ("spike", ["1", "[]", "\"x\""]),
    ("spike.skip", ["1", "\"yes\"", "[]"]),
    ("spike.window", ["\"128\"", "1", "1000000000000"]),
    ("spike.z_limit", ["\"6\"", "-0.5", "nan"]),
    ("faults", ["3", "[1]", "\"none\""]),
    ("faults[0].kind", ["1", "\"\"", "\"meteor\""]),
    ("faults[0].rank", ["\"0\"", "2", "-1"]),
    ("faults[0].step", ["\"0\"", "20", "-1"]),
    ("faults[0].minibatch", ["\"0\"", "16", "4294967296"]),
    ("faults[0].phase", ["1", "\"\"", "\"during\""]),
    ("faults[0].param", ["1", "\"\"", "\"blocks.99.ln1.weight\""]),
    ("faults[0].element", ["\"5\"", "-1", "1e30"]),
    ("faults[0].transient", ["1", "\"no\"", "[]"]),
    ("faults[0].code", ["\"9\"", "256", "99999999999"]),
    ("faults[0].seconds", ["\"1\"", "-1", "inf"]),
];

/// The `--set` argument that gives `key` the value `v`.
fn set_arg(key: &str, v: &str) -> String {
    match key.strip_prefix("faults[0].") {
        Some(field) => {
            let mut fields: Vec<(&str, &str)> = vec![("kind", "\"stall\""), ("rank", "0"), ("step", "0")];
            fields.retain(|(k, _)| *k != field);
            fields.push((field, v));
            let body: Vec<String> = fields.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            format!("faults=[{{{}}}]", body.join(", "))
        }
        None => format!("{key}={v}"),
    }
}

#[test]
fn every_config_key_refuses_wrong_type_boundary_and_absurd_values_once_before_any_rank_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("never");
    let mut failures = Vec::new();
    for (key, values) in BAD_VALUES {
        for v in values {
            let set = set_arg(key, v);
            let r = gradbus(
                &["run", "--np", "2", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml", "--set", &set],
                &[],
            );
            let (out, err) = (r.stdout(), r.stderr());
            let errors = err.lines().filter(|l| l.contains("error:")).count();
            let why = if r.code() != Some(2) {
                format!("exit {:?}", r.code())
            } else if err.contains("panicked") || err.contains("RUST_BACKTRACE") {
                "panicked".into()
            } else if errors != 1 || !err.starts_with("gradbus: error:") {
                format!("{errors} error lines")
            } else if !err.contains(key) {
                format!("the message does not name `{key}`")
            } else if !err.contains("hint:") {
                "no hint".into()
            } else if d.exists() || out.contains("[rank ") || err.contains("gradbus-worker") {
                "a rank was started".into()
            } else {
                continue;
            };
            failures.push(format!("--set '{set}': {why}\n{err}"));
            let _ = std::fs::remove_dir_all(&d);
        }
    }
    assert!(failures.is_empty(), "{} of {} cases:\n{}", failures.len(), BAD_VALUES.len() * 3, failures.join("\n"));
}

/// A worker started without the launcher (as by a bare mpirun) runs the same checks: exit 2, the
/// key named, no panic (the model's shape used to be checked by an `expect` in `Gpt::new`).
#[test]
fn a_bare_worker_refuses_a_bad_config_without_panicking() {
    let tmp = tempfile::tempdir().unwrap();
    for (set, key) in [("model.heads=3", "model.heads"), ("model.channels=100000", "model.channels")] {
        let out = Command::new(env!("CARGO_BIN_EXE_gradbus"))
            .current_dir(root())
            .args(["worker", "--run-dir", tmp.path().to_str().unwrap(), "examples/tiny.toml", "--set", set])
            .env("GRADBUS_RANK", "0")
            .env("GRADBUS_LOCAL_RANK", "0")
            .env("GRADBUS_WORLD_SIZE", "1")
            .env("GRADBUS_LOCAL_SIZE", "1")
            .env("GRADBUS_NODE_ID", "0")
            .env("GRADBUS_JOB_ID", format!("bareworker{}", std::process::id()))
            .env_remove("GRADBUS_FAULTS")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--set {set}: {err}");
        assert!(err.contains(key) && err.contains("hint:") && !err.contains("panicked"), "--set {set}: {err}");
    }
}

/// `device = "cuda"` where it cannot run - a build without the `cuda` feature, or a machine without
/// the CUDA driver - is refused by the launcher before any rank starts, and by a bare worker (as
/// under mpirun), with exit 2 and a message that names what is missing: never "unknown key".
#[test]
fn device_cuda_without_the_feature_or_the_driver_names_what_is_missing_before_any_rank_starts() {
    if cfg!(feature = "cuda") && gradbus_kernels::cuda::driver_present() {
        skip::skip("no-cuda-driver", "this machine has a CUDA driver: the no-driver path cannot be shown here");
        return;
    }
    // What the message must name: the feature in a default build, the driver library in a cuda build.
    let want = if cfg!(feature = "cuda") { "libcuda.so" } else { "--features cuda" };
    let check = |code: Option<i32>, out: &str, err: &str, who: &str| {
        assert_eq!(code, Some(2), "{who}: {err}");
        assert!(!err.contains("panicked") && !err.contains("unknown"), "{who}: {err}");
        assert!(err.contains("`device`") && err.contains(want) && err.contains("hint:"), "{who}: {err}");
        assert!(!out.contains("[rank "), "{who}: a rank was started\n{out}");
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("never");
    let r = gradbus(
        &["run", "--np", "2", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml", "--set", "device=\"cuda\""],
        &[],
    );
    check(r.code(), &r.stdout(), &r.stderr(), "gradbus run");
    assert!(!d.exists(), "the run dir was created");
    let out = Command::new(env!("CARGO_BIN_EXE_gradbus"))
        .current_dir(root())
        .args(["worker", "--run-dir", d.to_str().unwrap(), "examples/tiny.toml", "--set", "device=cuda"])
        .env("GRADBUS_RANK", "0")
        .env("GRADBUS_LOCAL_RANK", "0")
        .env("GRADBUS_WORLD_SIZE", "1")
        .env("GRADBUS_LOCAL_SIZE", "1")
        .env("GRADBUS_NODE_ID", "0")
        .env("GRADBUS_JOB_ID", format!("cudaworker{}", std::process::id()))
        .env_remove("GRADBUS_FAULTS")
        .output()
        .unwrap();
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    check(out.status.code(), &o, &e, "a bare worker");
    assert!(!d.exists(), "the bare worker created the run dir");
}

#[test]
fn resume_without_checkpoint_and_replay_of_a_missing_dump_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("empty");
    std::fs::create_dir_all(&d).unwrap();
    let r = gradbus(&["run", "--resume", d.to_str().unwrap(), "examples/tiny.toml"], &[]);
    r.expect_code(2);
    no_panic(&r);
    assert!((r.stdout() + &r.stderr()).contains("no complete checkpoint"), "{}", r.stderr());
    let r = gradbus(&["replay", d.to_str().unwrap()], &[]);
    r.expect_code(2);
    assert!(r.stderr().contains("no dump files"), "{}", r.stderr());
}

/// Two ranks started by hand with different configs: the second refuses the first's segment
/// (config hash), and the first times out naming the rank that never arrived.
///
/// Rank 1 starts first and waits for rank 0's segment (its own timeout only bounds a hang). Rank 0
/// starts once rank 1 has made its run directory, the last thing a worker does before it opens the
/// bus: rank 1 then polls for the segment (every 10 ms at most) and reads its header as soon as it is
/// made, while rank 0 waits its 3 s for rank 1 - the timeout under test, not a guess at start-up.
#[test]
fn ranks_with_different_configs_refuse_to_share_a_bus() {
    let tmp = tempfile::tempdir().unwrap();
    let job = format!("cfgmismatch{}", std::process::id());
    let run_dir = |rank: usize| tmp.path().join(format!("rank-{rank}"));
    let spawn = |rank: usize, seed: &str, timeout: &str| {
        Command::new(env!("CARGO_BIN_EXE_gradbus"))
            .current_dir(root())
            .args(["worker", "--run-dir", run_dir(rank).to_str().unwrap(), "examples/tiny.toml"])
            .args(["--set", seed, "--set", &format!("collective_timeout_s={timeout}"), "--set", "steps=1"])
            .env("GRADBUS_RANK", rank.to_string())
            .env("GRADBUS_LOCAL_RANK", rank.to_string())
            .env("GRADBUS_WORLD_SIZE", "2")
            .env("GRADBUS_LOCAL_SIZE", "2")
            .env("GRADBUS_NODE_ID", "0")
            .env("GRADBUS_JOB_ID", &job)
            .env_remove("GRADBUS_FAULTS")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut r1 = spawn(1, "seed=2", "120");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !run_dir(1).exists() {
        if r1.try_wait().unwrap().is_some() || Instant::now() > deadline {
            let _ = r1.kill();
            let o = r1.wait_with_output().unwrap();
            panic!("rank 1 ended or hung before it made its run directory:\n{}", String::from_utf8_lossy(&o.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let r0 = spawn(0, "seed=1", "3");
    let o1 = r1.wait_with_output().unwrap();
    let o0 = r0.wait_with_output().unwrap();
    let (e0, e1) = (String::from_utf8_lossy(&o0.stderr), String::from_utf8_lossy(&o1.stderr));
    assert_eq!(o1.status.code(), Some(2), "rank 1 refuses the segment:\n{e1}");
    assert!(e1.contains("hash"), "rank 1 names the config hash:\n{e1}");
    assert_eq!(o0.status.code(), Some(5), "rank 0 cannot train alone: a collective timeout\n{e0}");
    assert!(e0.contains("rank(s) [1] did not arrive"), "rank 0 names rank 1 as the one missing:\n{e0}");
    assert!(common::segments_left(&job).is_empty(), "segment left behind");
}

/// A bad `GRADBUS_SIMD` (the kernels' instruction-set level) is exit 2 with one message naming the
/// variable and the valid levels, never a panic: from `gradbus run`, `bench` and `replay` before
/// anything starts (no run directory, no rank), and from a bare worker and a bare benchmark rank (as
/// under mpirun).
#[test]
fn a_bad_simd_level_is_refused_naming_the_variable_and_the_levels_before_any_rank_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("never");
    let dir = d.to_str().unwrap();
    let bad = [("GRADBUS_SIMD", "sse9")];
    let check = |r: &common::Run, who: &str| {
        let (out, err) = (r.stdout(), r.stderr());
        assert_eq!(r.code(), Some(2), "{who}: {}\n{err}", r.cmd);
        no_panic(r);
        assert_eq!(err.lines().filter(|l| l.contains("error:")).count(), 1, "{who}: one error line\n{err}");
        assert!(err.contains("GRADBUS_SIMD=\"sse9\""), "{who}: names the variable and its value\n{err}");
        for level in ["baseline", "avx", "avx2", "avx512"] {
            assert!(err.contains(level), "{who}: names the level {level}\n{err}");
        }
        assert!(err.contains("hint:"), "{who}: {err}");
        assert!(!out.contains("[rank ") && !err.contains("[rank "), "{who}: a rank was started\n{out}{err}");
        assert!(!d.exists(), "{who}: the run dir was created");
    };
    check(&gradbus(&["run", "--np", "2", "--run-dir", dir, "examples/tiny.toml"], &bad), "gradbus run");
    check(&gradbus(&["bench", "allreduce", "--np", "2", "--run-dir", dir], &bad), "gradbus bench");
    check(&gradbus(&["replay", dir], &bad), "gradbus replay");
    let rank = [
        ("GRADBUS_RANK", "0"),
        ("GRADBUS_LOCAL_RANK", "0"),
        ("GRADBUS_WORLD_SIZE", "1"),
        ("GRADBUS_LOCAL_SIZE", "1"),
        ("GRADBUS_NODE_ID", "0"),
        ("GRADBUS_JOB_ID", "badsimd"),
        bad[0],
    ];
    check(&gradbus(&["worker", "--run-dir", dir, "examples/tiny.toml"], &rank), "a bare worker");
    check(&gradbus(&["worker", "--bench-allreduce", "--run-dir", dir], &rank), "a bare benchmark rank");
    // Unset or empty: the best level this CPU has, as before.
    let r = gradbus(&["run", "--run-dir", dir, "examples/tiny.toml", "--set", "steps=1"], &[("GRADBUS_SIMD", "")]);
    r.expect_code(0);
}
