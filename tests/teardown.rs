//! Supervision of the REAL worker: `gradbus run` on `examples/tiny.toml` with a fault plan in
//! `GRADBUS_FAULTS`, checking that every fault ends the whole job, with the documented exit code, a
//! message naming the rank, no process and no shared-memory segment left behind - and that a kill in
//! the middle of a checkpoint write never costs more than the steps since the last complete
//! checkpoint.
//!
//! Every wait is a bounded poll on an observable condition (a log line, a metrics line, a process
//! state); the bounds only catch a hang (how fast a job ends is measured by scripts/fault-matrix.py,
//! not asserted). The runs are long (`steps` far beyond the fault) so that only the fault or the
//! signal can end them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{is_dead, metrics, root};

const GRADBUS: &str = env!("CARGO_BIN_EXE_gradbus");
/// Bound of every wait: only a hang reaches it.
const LIMIT: Duration = Duration::from_secs(120);

/// The small, fast workload: examples/tiny.toml with 4 updates per step.
const FAST: &[&str] = &["--set", "rl.epochs=2", "--set", "rl.minibatches=2"];

/// One output pipe of the launcher: the bytes read so far and the thread reading them.
/// A `gradbus run` in progress, its stdout and stderr collected by threads.
struct Launch {
    desc: String,
    child: Child,
    out: [common::Captured; 2],
    run_dir: PathBuf,
}

/// A finished launch.
struct Ended {
    desc: String,
    code: Option<i32>,
    stdout: String,
    stderr: String,
    run_dir: PathBuf,
}

impl Ended {
    fn explain(&self) -> String {
        format!(
            "command: {}\nexit: {:?}\n--- stdout\n{}--- stderr\n{}---",
            self.desc, self.code, self.stdout, self.stderr
        )
    }

    fn assert_code(&self, code: i32) {
        assert_eq!(self.code, Some(code), "{}", self.explain());
    }

    fn assert_stderr(&self, needle: &str) {
        assert!(self.stderr.contains(needle), "stderr lacks {needle:?}\n{}", self.explain());
    }

    /// No segment of this job is left in /dev/shm.
    fn assert_no_segments(&self) {
        let job = job_id(&self.run_dir);
        let left = common::segments_left(&format!("{job}-"));
        assert!(left.is_empty(), "segments left: {left:?}\n{}", self.explain());
    }
}

/// Starts `gradbus run --np NP --run-dir DIR examples/tiny.toml FAST... EXTRA...` with `faults`.
fn launch(run_dir: &Path, np: usize, extra: &[&str], faults: &str) -> Launch {
    let np = np.to_string();
    let mut args = vec!["run", "--np", &np, "--run-dir", run_dir.to_str().unwrap(), "examples/tiny.toml"];
    args.extend_from_slice(FAST);
    args.extend_from_slice(extra);
    let mut cmd = Command::new(GRADBUS);
    cmd.args(&args)
        .current_dir(root())
        .env_remove("RUST_LOG")
        .env("GRADBUS_FAULTS", faults)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let desc = format!("GRADBUS_FAULTS='{faults}' gradbus {}", args.join(" "));
    let mut child = cmd.spawn().expect("spawn gradbus");
    let out = common::capture(&mut child);
    Launch { desc, child, out, run_dir: run_dir.to_path_buf() }
}

impl Launch {
    fn stderr_so_far(&self) -> String {
        self.out[1].so_far()
    }

    /// Polls `cond` every 20 ms until it holds; fails (killing the launcher) after `limit` or if the
    /// launcher exits first.
    fn wait_for(&mut self, what: &str, limit: Duration, mut cond: impl FnMut(&Launch) -> bool) {
        let deadline = Instant::now() + limit;
        while !cond(self) {
            if let Ok(Some(status)) = self.child.try_wait() {
                // The condition may have come true just before the exit: look once more.
                if cond(self) {
                    break;
                }
                panic!("launcher exited ({status}) before {what}\n--- stderr\n{}", self.stderr_so_far());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("no {what} within {limit:?}\n--- stderr\n{}", self.stderr_so_far());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pids of the launcher's children (the ranks), once `n` of them run.
    fn wait_ranks(&mut self, n: usize) -> Vec<i32> {
        let pid = self.child.id() as i32;
        let mut ranks = Vec::new();
        self.wait_for(&format!("{n} running ranks"), LIMIT, |_| {
            ranks = children_of(pid);
            ranks.len() >= n
        });
        ranks
    }

    /// Waits for the launcher to exit within `limit` of now; fails with its output if it does not.
    fn finish_within(mut self, limit: Duration) -> Ended {
        let deadline = Instant::now() + limit;
        let status = common::wait_until(&mut self.child, deadline);
        let ended = Ended {
            desc: self.desc,
            code: status.and_then(|s| s.code()),
            stdout: self.out[0].finish(),
            stderr: self.out[1].finish(),
            run_dir: self.run_dir,
        };
        assert!(status.is_some(), "launcher did not exit within {limit:?}\n{}", ended.explain());
        ended
    }
}

/// Pids whose parent is `ppid` (from /proc/PID/stat).
fn children_of(ppid: i32) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok());
        if parent == Some(ppid) {
            pids.push(pid);
        }
    }
    pids
}

/// The job id the launcher recorded in RUN_DIR/launch.json.
fn job_id(run_dir: &Path) -> String {
    let text = std::fs::read_to_string(run_dir.join("launch.json")).expect("launch.json");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["job_id"].as_str().expect("job_id").to_string()
}

/// Lines of RUN_DIR/metrics.jsonl so far (0 when it does not exist yet).
fn metric_lines(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count())
}

/// Whether a rank's log holds `needle`.
fn log_has(run_dir: &Path, rank: usize, needle: &str) -> bool {
    std::fs::read_to_string(run_dir.join(format!("rank-{rank}.log"))).is_ok_and(|t| t.contains(needle))
}

fn fault(kind: &str, rank: usize, step: u64, more: &str) -> String {
    format!("[[faults]]\nkind = \"{kind}\"\nrank = {rank}\nstep = {step}\n{more}")
}

#[test]
fn kill_9_of_one_rank_ends_the_launcher_and_every_rank() {
    kill_9_of_rank_1_in("forward");
}

#[test]
fn kill_9_inside_a_bucket_reduce_ends_everything_too() {
    kill_9_of_rank_1_in("reduce");
}

/// SIGKILL of rank 1 of 3 at `phase` of step 5, update 1.
fn kill_9_of_rank_1_in(phase: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let plan = fault("kill", 1, 5, &format!("minibatch = 1\nphase = \"{phase}\"\n"));
    let mut job = launch(&dir, 3, &["--set", "steps=100000"], &plan);
    let ranks = job.wait_ranks(3);
    // The worker announces the kill on stderr right before it; the pump logs it at once.
    job.wait_for("the planned SIGKILL", LIMIT, |j| log_has(&j.run_dir, 1, "fault plan: SIGKILL"));
    // With 100000 steps to go, only the teardown can end the job.
    let ended = job.finish_within(LIMIT);
    for pid in ranks {
        assert!(is_dead(pid), "rank pid {pid} outlived the launcher\n{}", ended.explain());
    }
    ended.assert_code(4);
    // Ranks 0 and 2 notice the death within milliseconds and exit 4; the launcher often sees all
    // three ends in one polling round and must still name the killed rank (this failed 3 runs in 3
    // when the lowest index won).
    ended.assert_stderr("root cause: rank 1 failed first: killed by SIGKILL");
    ended.assert_no_segments();
}

#[test]
fn rank_exiting_with_code_9_ends_the_job_with_exit_4() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let job = launch(&dir, 2, &["--set", "steps=100000"], &fault("exit", 0, 3, "code = 9\nphase = \"backward\"\n"));
    let ended = job.finish_within(LIMIT);
    ended.assert_code(4);
    ended.assert_stderr("root cause: rank 0 failed first: exited with code 9");
    ended.assert_no_segments();
}

#[test]
fn stalled_rank_makes_the_others_time_out_naming_it_and_exit_5() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let job = launch(
        &dir,
        3,
        &["--set", "steps=100000", "--set", "collective_timeout_s=2"],
        &fault("stall", 1, 2, "minibatch = 1\nphase = \"between_buckets\"\n"),
    );
    let ended = job.finish_within(LIMIT);
    ended.assert_code(5);
    // Ranks 0 and 2 name the rank that did not arrive; rank 1 is stopped by the launcher.
    for r in [0, 2] {
        assert!(
            ended.stderr.lines().any(|l| l.starts_with(&format!("[rank {r}] "))
                && l.contains("collective timeout")
                && l.contains("rank(s) [1] did not arrive")),
            "rank {r} does not name the stalled rank\n{}",
            ended.explain()
        );
    }
    ended.assert_stderr("exit 5: a collective timed out");
    ended.assert_no_segments();
}

#[test]
fn sigint_to_the_launcher_mid_run_exits_130_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let mut job = launch(&dir, 2, &["--set", "steps=100000"], "");
    let ranks = job.wait_ranks(2);
    // Mid-run, and long enough for the launcher's plain progress line (stderr is a pipe here).
    job.wait_for("a plain progress line", LIMIT, |j| {
        metric_lines(&j.run_dir) > 0 && j.stderr_so_far().contains("gradbus: progress: step ")
    });
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is our own unreaped child.
    assert_eq!(unsafe { libc::kill(job.child.id() as i32, libc::SIGINT) }, 0);
    let ended = job.finish_within(LIMIT);
    ended.assert_code(130);
    ended.assert_stderr("interrupted");
    for pid in ranks {
        assert!(is_dead(pid), "rank pid {pid} outlived the launcher\n{}", ended.explain());
    }
    ended.assert_no_segments();
    let line = ended.stderr.lines().find(|l| l.starts_with("gradbus: progress: step ")).unwrap();
    assert!(line.contains("/100000 (slowest of 2 ranks)") && line.contains("loss "), "{line}");
}

#[test]
fn kill_during_a_checkpoint_write_resumes_from_the_last_complete_one_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let (full, part) = (tmp.path().join("full"), tmp.path().join("part"));
    let sets = ["--set", "steps=6", "--set", "checkpoint.every=2"];
    // The reference: the same 6 steps, uninterrupted.
    launch(&full, 2, &sets, "").finish_within(LIMIT).assert_code(0);

    // Rank 0 writes the checkpoints; kill it inside the write of step-000004 (temp file written,
    // not yet renamed, no DONE marker).
    let killed = launch(&part, 2, &sets, &fault("kill", 0, 4, "phase = \"checkpoint\"\n")).finish_within(LIMIT);
    killed.assert_code(4);
    killed.assert_stderr("root cause: rank 0 failed first: killed by SIGKILL");
    killed.assert_no_segments();
    let ckpt = part.join("checkpoints");
    assert!(ckpt.join("step-000002/DONE").exists(), "{}", killed.explain());
    assert!(ckpt.join("step-000004").is_dir(), "the kill came before the checkpoint dir\n{}", killed.explain());
    assert!(!ckpt.join("step-000004/DONE").exists(), "the kill came after the write\n{}", killed.explain());

    // Resume: it must pick step-000002, not the half-written step-000004, and finish like `full`.
    let mut args = vec!["run", "--np", "2", "--resume", part.to_str().unwrap(), "examples/tiny.toml"];
    args.extend_from_slice(FAST);
    args.extend_from_slice(&sets);
    let out = Command::new(GRADBUS)
        .args(&args)
        .current_dir(root())
        .env("RUST_LOG", "info")
        .env_remove("GRADBUS_FAULTS")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "gradbus {}\n--- stderr\n{stderr}", args.join(" "));
    assert!(stderr.contains("step-000002 at step 2"), "resume did not start from step-000002\n{stderr}");
    assert!(ckpt.join("step-000004/DONE").exists() && ckpt.join("step-000006/DONE").exists());
    assert_eq!(metrics(&part), metrics(&full));
}
