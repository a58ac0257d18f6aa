//! Bad input at the edges ends with exit 2 and a message that names the file, key or line and gives a
//! hint - never a panic or a backtrace.

mod common;

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
#[test]
fn ranks_with_different_configs_refuse_to_share_a_bus() {
    let tmp = tempfile::tempdir().unwrap();
    let job = format!("cfgmismatch{}", std::process::id());
    let spawn = |rank: usize, seed: &str| {
        Command::new(env!("CARGO_BIN_EXE_gradbus"))
            .current_dir(root())
            .args(["worker", "--run-dir", tmp.path().to_str().unwrap(), "examples/tiny.toml"])
            .args(["--set", seed, "--set", "collective_timeout_s=3", "--set", "steps=1"])
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
    let r0 = spawn(0, "seed=1");
    // Rank 0 creates the segment; wait until it exists before starting rank 1 (bounded).
    let t0 = Instant::now();
    while !common::segments_left(&job).iter().any(|n| n.contains(&job)) && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let r1 = spawn(1, "seed=2");
    let o1 = r1.wait_with_output().unwrap();
    let o0 = r0.wait_with_output().unwrap();
    let (e0, e1) = (String::from_utf8_lossy(&o0.stderr), String::from_utf8_lossy(&o1.stderr));
    assert_eq!(o1.status.code(), Some(2), "rank 1 refuses the segment:\n{e1}");
    assert!(e1.contains("hash"), "rank 1 names the config hash:\n{e1}");
    assert_ne!(o0.status.code(), Some(0), "rank 0 cannot train alone:\n{e0}");
    assert!(e0.contains('1'), "rank 0 names rank 1:\n{e0}");
    assert!(common::segments_left(&job).is_empty(), "segment left behind");
}
