//! A run directory has one owner and keeps its data (`gradbus_worker::rundir`), end to end with the
//! real binary: a second job on a directory in use exits 2 naming the running one (also when both
//! start at once: exactly one runs, and its metrics verify); a finished or crashed run is never
//! written over without `--resume` or `--overwrite`; bare workers own their directory the same way;
//! `--resume` names a changed seed or world size with both values, records it, and refuses another
//! model.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{gradbus, metrics, root};

const GRADBUS: &str = env!("CARGO_BIN_EXE_gradbus");
/// Bound of every wait (only against a hang; the runs take about a second).
const LIMIT: Duration = Duration::from_secs(120);

/// `gradbus run --np NP --run-dir DIR examples/tiny.toml` with a short, fast config and `extra`.
fn run_args(np: usize, dir: &Path, extra: &[&str]) -> Vec<String> {
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let mut a: Vec<String> = ["run", "--np", &np.to_string(), "--run-dir", dir.to_str().unwrap(), "examples/tiny.toml"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for s in ["steps=2", "rl.epochs=1", "rl.minibatches=2", "checkpoint.every=1"] {
        a.extend(["--set".to_string(), s.to_string()]);
    }
    a.extend(extra);
    a
}

fn gb(args: &[String]) -> common::Run {
    gradbus(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[])
}

/// Every file under `dir` (but the lock, which each job that tries rewrites) with its length and a
/// hash of its bytes: a refused job must leave this as it was.
fn snapshot(dir: &Path) -> Vec<(PathBuf, usize, u64)> {
    use std::hash::{Hash, Hasher};
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()) {
            if e.is_dir() {
                stack.push(e);
            } else if !e.ends_with("gradbus.lock") {
                let bytes = std::fs::read(&e).unwrap();
                let mut h = std::collections::hash_map::DefaultHasher::new();
                bytes.hash(&mut h);
                out.push((e.strip_prefix(dir).unwrap().to_path_buf(), bytes.len(), h.finish()));
            }
        }
    }
    out.sort();
    out
}

fn spawn_cmd(args: &[String]) -> Command {
    let mut c = Command::new(GRADBUS);
    c.args(args)
        .current_dir(root())
        .env_remove("GRADBUS_FAULTS")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits (bounded) for `child`; its exit code and stderr.
fn finish(mut child: Child, what: &str) -> (Option<i32>, String) {
    let [mut out, mut err] = common::capture(&mut child);
    let status = common::wait_until(&mut child, Instant::now() + LIMIT);
    let (_, err) = (out.finish(), err.finish());
    let status = status.unwrap_or_else(|| panic!("{what} did not exit within {LIMIT:?}\n{err}"));
    (status.code(), err)
}

#[test]
fn a_finished_run_is_kept_unless_resumed_or_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    gb(&run_args(2, &d, &["--set", "steps=3"])).expect_code(0);
    let before = snapshot(&d);
    assert!(d.join("checkpoints/step-000003/DONE").exists());

    // The issue's case: the same command again rewrote metrics.jsonl without a word.
    let r = gb(&run_args(2, &d, &[]));
    r.expect_code(2);
    let e = r.stderr();
    assert!(e.contains(&format!("run directory {} holds an earlier run (", d.display())), "{e}");
    assert!(e.contains("checkpoints/") && e.contains("metrics.jsonl") && e.contains("launch.json"), "{e}");
    assert!(e.contains(&format!("`--resume {}`", d.display())) && e.contains("--run-dir"), "{e}");
    assert!(!e.contains("[rank "), "no rank may start: {e}");
    assert_eq!(snapshot(&d), before, "a refused launch changed the run directory");

    // --overwrite: the earlier run's files are gone (no checkpoint of step 3 is left for a later
    // --resume to pick up), the new run's are there.
    let r = gb(&run_args(2, &d, &["--overwrite"]));
    r.expect_code(0);
    assert!(r.stderr().contains("--overwrite: removed the earlier run in"), "{}", r.stderr());
    assert!(!d.join("checkpoints/step-000003").exists());
    assert!(d.join("checkpoints/step-000002/DONE").exists());
    assert_eq!(metrics(&d).last().unwrap()["step"], 1);
}

#[test]
fn a_crashed_run_is_kept_too_and_a_resume_keeps_its_logs() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    // Killed in step 2: checkpoint 1 is complete (step 1 needed rank 0 back from writing it).
    let kill = "[[faults]]\nkind = \"kill\"\nrank = 1\nstep = 2\nminibatch = 0\n";
    let args = run_args(2, &d, &["--set", "steps=3"]);
    gradbus(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[("GRADBUS_FAULTS", kill)]).expect_code(4);
    let before = snapshot(&d);
    let r = gb(&args);
    r.expect_code(2);
    assert!(r.stderr().contains("holds an earlier run"), "{}", r.stderr());
    assert_eq!(snapshot(&d), before);
    let launch = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join(name)).unwrap()).unwrap()
    };
    let crashed = launch("launch.json")["job_id"].as_str().unwrap().to_string();
    let mut resume = args.clone();
    let at = resume.iter().position(|a| a == "--run-dir").unwrap();
    resume[at] = "--resume".into();
    gb(&resume).expect_code(0);
    // Both launches are on record.
    assert_eq!(launch(&format!("launch-{crashed}.json"))["job_id"], crashed.as_str());
    assert_eq!(launch("launch.json")["resume"], true);
    // The rank logs hold the crashed run and the resumed one.
    let log = std::fs::read_to_string(d.join("rank-0.log")).unwrap();
    assert!(log.contains("resumed from") && log.find("step 0 done") < log.find("resumed from"), "{log}");
}

/// A worker that waits (bounded) for `go` in `dir`, then runs as the real `gradbus worker`: a job
/// whose claim of its run directory is settled before any rank trains.
fn worker_after_go(dir: &Path) -> PathBuf {
    let script = dir.join("worker-after-go.sh");
    let text = format!(
        "#!/bin/sh\ni=0\nwhile [ ! -e '{go}' ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done\n\
         [ -e '{go}' ] || exit 1\nexec '{GRADBUS}' worker \"$@\"\n",
        go = dir.join("go").display()
    );
    std::fs::write(&script, text).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    script
}

#[test]
fn two_jobs_started_at_once_exactly_one_runs_and_its_metrics_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    // Both claim the directory at once; the winner's ranks train only after the loser has ended,
    // so the loser meets a job in use however slowly it starts.
    let worker = worker_after_go(tmp.path());
    let args = run_args(2, &d, &["--set", "steps=3"]);
    let spawn_job = || {
        let mut c = spawn_cmd(&args);
        c.env("GRADBUS_WORKER_BIN", &worker);
        c.spawn().unwrap()
    };
    let mut jobs = [spawn_job(), spawn_job()];
    let deadline = Instant::now() + LIMIT;
    let loser = loop {
        if let Some(i) = (0..2).find(|&i| jobs[i].try_wait().unwrap().is_some()) {
            break i;
        }
        assert!(Instant::now() < deadline, "neither job ended within {LIMIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    std::fs::write(tmp.path().join("go"), "").unwrap();
    let [a, b] = jobs;
    let (a, b) = (finish(a, "job a"), finish(b, "job b"));
    let (winner, lost) = if loser == 0 { (b, a) } else { (a, b) };
    assert_eq!(
        lost.0,
        Some(2),
        "the job that ended first was refused\n--- it\n{}\n--- the other\n{}",
        lost.1,
        winner.1
    );
    assert!(lost.1.contains("is in use by job "), "the loser names the running job:\n{}", lost.1);
    assert_eq!(winner.0, Some(0), "the other job runs\n{}", winner.1);
    // The winner's metrics are whole: every line verifies, and they are those of a run alone.
    let report = gradbus(&["report", d.to_str().unwrap()], &[]);
    report.expect_code(0);
    let alone = tmp.path().join("alone");
    gb(&run_args(2, &alone, &["--set", "steps=3"])).expect_code(0);
    assert_eq!(metrics(&d), metrics(&alone));
}

/// A worker script that waits for `go` in its directory (bounded), for a job that stays up.
fn napping_worker(dir: &Path) -> PathBuf {
    let script = dir.join("worker.sh");
    let go = dir.join("go");
    let text = format!(
        "#!/bin/sh\ntouch '{d}/ready-'$GRADBUS_RANK\ni=0\nwhile [ ! -e '{go}' ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done\n",
        d = dir.display(),
        go = go.display()
    );
    std::fs::write(&script, text).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    script
}

#[test]
fn a_second_job_on_a_directory_in_use_exits_2_naming_pid_host_start_and_command() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    let worker = napping_worker(tmp.path());
    let start = |args: &[&str]| {
        Command::new(GRADBUS)
            .args(args)
            .current_dir(tmp.path())
            .env("GRADBUS_WORKER_BIN", &worker)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    std::fs::write(tmp.path().join("c.toml"), "# any config\n").unwrap();
    let first = start(&["run", "--np", "2", "--run-dir", d.to_str().unwrap(), "c.toml"]);
    let deadline = Instant::now() + LIMIT;
    while !(tmp.path().join("ready-0").exists() && tmp.path().join("ready-1").exists()) {
        assert!(Instant::now() < deadline, "the first job's workers did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let holder = std::fs::read_to_string(d.join("gradbus.lock")).unwrap();
    let job: serde_json::Value = serde_json::from_str(&holder).unwrap();
    for args in [
        &["run", "--np", "1", "--run-dir", d.to_str().unwrap(), "c.toml"][..],
        &["run", "--resume", d.to_str().unwrap(), "c.toml"],
        &["run", "--overwrite", "--run-dir", d.to_str().unwrap(), "c.toml"],
    ] {
        let (code, err) = finish(start(args), "the second job");
        assert_eq!(code, Some(2), "{args:?}\n{err}");
        let want = format!(
            "is in use by job {} (pid {} on host {}, started {}): ",
            job["job_id"].as_str().unwrap(),
            first.id(),
            job["host"].as_str().unwrap(),
            job["started"].as_str().unwrap()
        );
        assert!(err.contains(&want) && err.contains(" run --np 2 --run-dir "), "{args:?}: lacks {want:?}\n{err}");
    }
    std::fs::write(tmp.path().join("go"), "").unwrap();
    let (code, err) = finish(first, "the first job");
    assert_eq!(code, Some(0), "{err}");
}

/// `gradbus worker` started by hand (a world of one, as under a bare mpirun or srun).
fn bare_worker(dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(GRADBUS);
    c.args(["worker", "--run-dir", dir.to_str().unwrap(), "examples/tiny.toml"])
        .args(["--set", "rl.epochs=1", "--set", "rl.minibatches=2"])
        .args(extra)
        .current_dir(root())
        .env_remove("GRADBUS_FAULTS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[test]
fn bare_workers_own_their_directory_too() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    let mut long = bare_worker(&d, &["--set", "steps=100000"]).spawn().unwrap();
    let [mut out, mut err] = common::capture(&mut long);
    let deadline = Instant::now() + LIMIT;
    while std::fs::read_to_string(d.join("metrics.jsonl")).map_or(true, |t| t.is_empty()) {
        assert!(Instant::now() < deadline, "the first worker did not train\n{}", err.so_far());
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = bare_worker(&d, &["--set", "steps=1"]).output().unwrap();
    let e = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{e}");
    assert!(e.contains(&format!("is in use by job p{} (pid {} on host ", long.id(), long.id())), "{e}");
    assert!(e.contains(" worker --run-dir "), "the holder's command: {e}");

    // Killed, its run is kept: a new worker needs --resume or --overwrite.
    long.kill().unwrap();
    long.wait().unwrap();
    let (_, _) = (out.finish(), err.finish());
    let kept = snapshot(&d);
    let third = bare_worker(&d, &["--set", "steps=1"]).output().unwrap();
    let e = String::from_utf8_lossy(&third.stderr);
    assert_eq!(third.status.code(), Some(2), "{e}");
    assert!(e.contains("holds an earlier run (") && e.contains("--overwrite"), "{e}");
    assert_eq!(snapshot(&d), kept);
    let fourth = bare_worker(&d, &["--set", "steps=1", "--overwrite"]).output().unwrap();
    assert_eq!(fourth.status.code(), Some(0), "{}", String::from_utf8_lossy(&fourth.stderr));
    assert_eq!(metrics(&d).len(), 2, "one step of 2 updates, the killed run's lines gone");
}

#[test]
fn resume_names_a_changed_seed_and_world_size_records_them_and_refuses_another_model() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("r");
    let base = run_args(2, &d, &["--set", "seed=1"]);
    gb(&base).expect_code(0);
    let resume = |np: usize, extra: &[&str]| {
        let mut a = run_args(np, &d, extra);
        let at = a.iter().position(|a| a == "--run-dir").unwrap();
        a[at] = "--resume".into();
        gb(&a)
    };

    // The same data, longer: no warning.
    let r = resume(2, &["--set", "seed=1", "--set", "steps=3"]);
    r.expect_code(0);
    assert!(!r.stderr().contains("warning: --resume"), "{}", r.stderr());

    // Another seed and world size: named with both values, and the run goes on.
    let r = resume(1, &["--set", "seed=2", "--set", "steps=4"]);
    r.expect_code(0);
    let e = r.stderr();
    assert!(e.contains("warning: --resume: this run continues the checkpoint at step 3"), "{e}");
    assert!(e.contains("world size: 2 -> 1; seed: 1 -> 2"), "{e}");
    assert!(e.contains(&format!("recorded in {}", d.join("resumes.jsonl").display())), "{e}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(d.join("resumes.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "every resume is recorded");
    assert_eq!((lines[0]["step"].as_u64(), lines[0]["changes"].as_array().map(Vec::len)), (Some(2), Some(0)));
    assert_eq!(lines[1]["step"], 3);
    assert_eq!(
        lines[1]["changes"],
        serde_json::json!([{"key": "world size", "old": "2", "new": "1"}, {"key": "seed", "old": "1", "new": "2"}])
    );
    assert_eq!(metrics(&d).last().unwrap()["step"], 3);

    // Another model: refused on every rank, naming the key, and nothing is written.
    let before = std::fs::read(d.join("metrics.jsonl")).unwrap();
    let r = resume(1, &["--set", "seed=2", "--set", "steps=5", "--set", "model.heads=2"]);
    r.expect_code(2);
    assert!(r.stderr().contains("another model or bucket layout: model.heads 4 -> 2"), "{}", r.stderr());
    assert_eq!(std::fs::read(d.join("metrics.jsonl")).unwrap(), before);
}
