//! End-to-end tests of the `gradbus` launcher: they spawn the real binary in a fresh temp directory.
//!
//! The worker is a small `/bin/sh` script per test, put in place with `GRADBUS_WORKER_BIN`, so that
//! supervision (teardown, signals, exit codes, orphans, shm cleanup) is tested without the real
//! worker. Every script prints its environment, writes its pid (and its child's pid) to files in the
//! temp dir and creates a fake shared-memory segment `/dev/shm/gradbus-{job}-nK` (the bus's naming
//! rule `gradbus-{job}-n{node}`, with the rank standing in for the node) that the launcher must
//! remove. Waits are bounded polls on conditions; the bounds only catch a hang (the workers that must
//! be stopped sleep 300 s, the bounds are 60 s), no test asserts how fast anything is.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const GRADBUS: &str = env!("CARGO_BIN_EXE_gradbus");
/// Bound of every wait: only a hang reaches it.
const LIMIT: Duration = Duration::from_secs(60);

/// A temp directory with a config file and a worker script.
struct Job {
    dir: tempfile::TempDir,
}

impl Job {
    /// A job whose worker runs the common prologue, then `body` (sh; `$R` is the rank, `$D` the dir).
    fn new(body: &str) -> Job {
        let dir = tempfile::Builder::new().prefix("gradbus-launcher-test").tempdir().unwrap();
        let d = dir.path().canonicalize().unwrap();
        std::fs::write(d.join("c.toml"), "# test config\n").unwrap();
        let script = format!(
            r#"#!/bin/sh
D='{d}'
R="$GRADBUS_RANK"
echo "rank $R of $GRADBUS_WORLD_SIZE local $GRADBUS_LOCAL_RANK/$GRADBUS_LOCAL_SIZE node $GRADBUS_NODE_ID"
echo "args: $*"
echo "run dir: $GRADBUS_RUN_DIR"
echo "err from rank $R" >&2
touch "/dev/shm/gradbus-$GRADBUS_JOB_ID-n$R"
echo "$GRADBUS_JOB_ID" > "$D/job"
echo $$ > "$D/pid-$R.tmp" && mv "$D/pid-$R.tmp" "$D/pid-$R"
# Waits (bounded) until every rank has written its pid file.
all_ready() {{
  i=0
  while [ $i -lt 600 ]; do
    n=$(ls "$D" | grep -c '^pid-[0-9]*$')
    [ "$n" -ge "$GRADBUS_WORLD_SIZE" ] && return 0
    sleep 0.05; i=$((i+1))
  done
  return 1
}}
# Sleeps in a child (whose pid is recorded) so that group-wide teardown is tested too.
nap() {{
  sleep 300 &
  echo $! > "$D/child-$R"
  wait
}}
{body}
"#,
            d = d.display()
        );
        let path = d.join("worker.sh");
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        Job { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().canonicalize().unwrap()
    }

    /// `gradbus ARGS` in the temp dir with the script as worker.
    fn gradbus(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(GRADBUS);
        cmd.args(args)
            .current_dir(self.path())
            .env("GRADBUS_WORKER_BIN", self.path().join("worker.sh"))
            .env_remove("RUST_LOG");
        cmd
    }

    /// Pids of the workers (and of their sleeping children) that have written their files.
    fn pids(&self, prefix: &str) -> Vec<i32> {
        let mut pids = Vec::new();
        for e in std::fs::read_dir(self.path()).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.strip_prefix(prefix).is_some_and(|r| r.chars().all(|c| c.is_ascii_digit())) {
                let text = std::fs::read_to_string(self.path().join(&name)).unwrap();
                if let Ok(pid) = text.trim().parse() {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// Waits until `n` ranks wrote their pid files (bounded).
    fn wait_ready(&self, n: usize, launcher: &mut Running) {
        let deadline = Instant::now() + LIMIT;
        while self.pids("pid-").len() < n {
            if let Ok(Some(_)) = launcher.child.try_wait() {
                panic!("launcher exited before the workers were ready");
            }
            assert!(Instant::now() < deadline, "workers did not start within {LIMIT:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asserts that every recorded worker and child pid is gone and the job's segments are removed.
    fn assert_clean(&self, ran: &Ran, ranks: usize) {
        let workers = self.pids("pid-");
        assert_eq!(workers.len(), ranks, "pid files missing\n{}", ran.explain());
        for pid in workers.iter().chain(&self.pids("child-")) {
            wait_dead(*pid, ran);
        }
        let job = std::fs::read_to_string(self.path().join("job")).unwrap();
        let prefix = format!("gradbus-{}-", job.trim());
        let left: Vec<_> = std::fs::read_dir("/dev/shm")
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(&prefix))
            .collect();
        assert!(left.is_empty(), "segments left: {left:?}\n{}", ran.explain());
    }
}

fn wait_dead(pid: i32, ran: &Ran) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !common::is_dead(pid) {
        assert!(Instant::now() < deadline, "pid {pid} still alive\n{}", ran.explain());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One output pipe of the launcher: the bytes read so far and the thread reading them.
/// A launcher process being run, its output collected by threads.
struct Running {
    desc: String,
    child: Child,
    out: [common::Captured; 2],
    started: Instant,
}

/// A finished launcher.
struct Ran {
    desc: String,
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl Ran {
    fn explain(&self) -> String {
        format!(
            "command: {}\nexit: {:?} after {:?}\n--- stdout\n{}--- stderr\n{}---",
            self.desc, self.code, self.elapsed, self.stdout, self.stderr
        )
    }

    fn assert_code(&self, code: i32) {
        assert_eq!(self.code, Some(code), "{}", self.explain());
    }

    fn assert_stderr(&self, needle: &str) {
        assert!(self.stderr.contains(needle), "stderr lacks {needle:?}\n{}", self.explain());
    }
}

fn start(mut cmd: Command) -> Running {
    let desc = format!("{cmd:?}");
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let out = common::capture(&mut child);
    Running { desc, child, out, started: Instant::now() }
}

impl Running {
    /// Waits (bounded) for the launcher to exit; on timeout kills it and fails with its output.
    fn finish(mut self) -> Ran {
        let deadline = self.started + LIMIT;
        let status = common::wait_until(&mut self.child, deadline);
        let elapsed = self.started.elapsed();
        let ran = Ran {
            desc: self.desc,
            code: status.and_then(|s| s.code()),
            stdout: self.out[0].finish(),
            stderr: self.out[1].finish(),
            elapsed,
        };
        assert!(status.is_some(), "launcher did not exit within {LIMIT:?}\n{}", ran.explain());
        ran
    }
}

fn run(cmd: Command) -> Ran {
    start(cmd).finish()
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions; pid is our own unreaped child.
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
}

#[test]
fn two_and_four_ranks_succeed_with_prefixed_output_and_rank_logs() {
    for np in [2usize, 4] {
        let job = Job::new("exit 0");
        let mut args = vec!["run", "--run-dir", "run", "c.toml", "--set", "seed=1"];
        let np_s = np.to_string();
        if np == 2 {
            args.extend(["--np", &np_s]);
        } else {
            // Four ranks from a hostfile's slots.
            std::fs::write(job.path().join("hosts"), "# one node\nlocalhost slots=4\n").unwrap();
            args.extend(["--hostfile", "hosts"]);
        }
        let ran = run(job.gradbus(&args));
        ran.assert_code(0);
        let d = job.path();
        let run_dir = d.join("run");
        for r in 0..np {
            let hello = format!("rank {r} of {np} local {r}/{np} node 0");
            assert!(ran.stdout.contains(&format!("[rank {r}] {hello}\n")), "{}", ran.explain());
            assert!(ran.stderr.contains(&format!("[rank {r}] err from rank {r}\n")), "{}", ran.explain());
            let log = std::fs::read_to_string(run_dir.join(format!("rank-{r}.log"))).unwrap();
            assert!(log.lines().any(|l| l == hello), "rank-{r}.log: {log}");
            assert!(log.lines().any(|l| l == format!("err from rank {r}")), "rank-{r}.log: {log}");
            let args_line =
                format!("args: --run-dir {} {} --set seed=1", run_dir.display(), d.join("c.toml").display());
            assert!(log.lines().any(|l| l == args_line), "rank-{r}.log lacks {args_line:?}: {log}");
            assert!(!log.contains("[rank"), "log lines must be unprefixed: {log}");
        }
        assert!(run_dir.join("launch.json").is_file());
        job.assert_clean(&ran, np);
    }
}

#[test]
fn version_names_the_crate_and_the_commit_it_was_built_from() {
    let job = Job::new("exit 0");
    let version = run(job.gradbus(&["--version"]));
    version.assert_code(0);
    let ran = &version;
    let want = format!("gradbus {} (commit ", env!("CARGO_PKG_VERSION"));
    assert!(ran.stdout.starts_with(&want), "{}", ran.explain());
    let head = Command::new("git").args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "HEAD"]).output();
    match head {
        Ok(out) if out.status.success() => {
            let hash = String::from_utf8_lossy(&out.stdout).trim().to_string();
            assert!(ran.stdout.starts_with(&format!("{want}{hash}, ")), "built from HEAD {hash}?\n{}", ran.explain());
        }
        _ => assert!(ran.stdout.starts_with(&format!("{want}unknown: ")), "{}", ran.explain()),
    }
    // launch.json names the same build.
    let ran = run(job.gradbus(&["run", "--run-dir", "run", "c.toml"]));
    ran.assert_code(0);
    let launch: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(job.path().join("run/launch.json")).unwrap()).unwrap();
    assert_eq!(launch["gradbus"]["version"], env!("CARGO_PKG_VERSION"), "{launch}");
    match launch["gradbus"]["commit"].as_str() {
        Some(c) => assert!(version.stdout.contains(&format!("(commit {c}, ")), "{launch}\n{}", version.stdout),
        None => assert!(version.stdout.contains("(commit unknown: "), "{launch}\n{}", version.stdout),
    }
}

#[test]
fn leftover_children_of_a_worker_that_exited_are_killed() {
    // The worker exits 0 but leaves a sleeping child in its process group (holding its stdout).
    let job = Job::new(r#"sleep 300 & echo $! > "$D/child-$R"; exit 0"#);
    let ran = run(job.gradbus(&["run", "--np", "2", "c.toml"]));
    ran.assert_code(0);
    assert_eq!(job.pids("child-").len(), 2, "{}", ran.explain());
    job.assert_clean(&ran, 2);
}

#[test]
fn default_run_dir_is_under_runs() {
    let job = Job::new("exit 0");
    let ran = run(job.gradbus(&["run", "c.toml"]));
    ran.assert_code(0);
    let runs: Vec<_> = std::fs::read_dir(job.path().join("runs")).unwrap().collect();
    assert_eq!(runs.len(), 1, "{}", ran.explain());
    let dir = runs.into_iter().next().unwrap().unwrap().path();
    assert!(dir.join("rank-0.log").is_file(), "{}", ran.explain());
}

#[test]
fn failing_rank_stops_the_others_and_is_named_first() {
    let job = Job::new(r#"if [ "$R" = 1 ]; then all_ready; exit 7; fi; nap"#);
    let ran = run(job.gradbus(&["run", "--np", "3", "c.toml"]));
    ran.assert_code(4);
    ran.assert_stderr("root cause: rank 1 failed first: exited with code 7");
    job.assert_clean(&ran, 3);
}

#[test]
fn rank_killed_by_a_signal_is_named_with_the_signal() {
    let job = Job::new(r#"if [ "$R" = 0 ]; then all_ready; kill -9 $$; fi; nap"#);
    let ran = run(job.gradbus(&["run", "--np", "2", "c.toml"]));
    ran.assert_code(4);
    ran.assert_stderr("rank 0 failed first: killed by SIGKILL");
    job.assert_clean(&ran, 2);
}

#[test]
fn all_ranks_exiting_non_finite_pass_the_code_through() {
    let job = Job::new("all_ready; exit 3");
    let ran = run(job.gradbus(&["run", "--np", "3", "c.toml"]));
    ran.assert_code(3);
    ran.assert_stderr("aborted on non-finite gradients");
    job.assert_clean(&ran, 3);
}

/// The launcher's rule for a timeout: the first failure's exit 5 decides, although the rank it
/// stopped ended by SIGTERM. Here a script exits with the code; a real collective timeout of the real
/// worker ending the job with 5 is `tests/teardown.rs`'s `stalled_rank_makes_the_others_time_out_...`.
#[test]
fn first_rank_exiting_with_the_timeout_code_gives_exit_5_though_the_other_was_stopped() {
    let job = Job::new(r#"if [ "$R" = 1 ]; then all_ready; exit 5; fi; nap"#);
    let ran = run(job.gradbus(&["run", "--np", "2", "--grace", "1", "c.toml"]));
    ran.assert_code(5);
    ran.assert_stderr("rank 1 failed first: exited with code 5 (a collective timed out)");
    ran.assert_stderr("rank 0: killed by SIGTERM");
    job.assert_clean(&ran, 2);
}

#[test]
fn sigint_to_the_launcher_stops_every_worker_and_exits_130() {
    let job = Job::new("nap");
    let mut launcher = start(job.gradbus(&["run", "--np", "3", "c.toml"]));
    job.wait_ready(3, &mut launcher);
    signal(launcher.child.id(), libc::SIGINT);
    let ran = launcher.finish();
    ran.assert_code(130);
    ran.assert_stderr("interrupted");
    job.assert_clean(&ran, 3);
}

#[test]
fn sigterm_to_the_launcher_also_exits_130() {
    let job = Job::new("nap");
    let mut launcher = start(job.gradbus(&["run", "--np", "2", "c.toml"]));
    job.wait_ready(2, &mut launcher);
    signal(launcher.child.id(), libc::SIGTERM);
    let ran = launcher.finish();
    ran.assert_code(130);
    job.assert_clean(&ran, 2);
}

#[test]
fn worker_ignoring_sigterm_is_sigkilled_after_the_grace() {
    let job = Job::new(r#"if [ "$R" = 0 ]; then all_ready; exit 9; fi; trap '' TERM; nap"#);
    let ran = run(job.gradbus(&["run", "--np", "2", "--grace", "1", "c.toml"]));
    ran.assert_code(4);
    ran.assert_stderr("rank 0 failed first: exited with code 9");
    ran.assert_stderr("ignored SIGTERM and were SIGKILLed");
    ran.assert_stderr("rank 1: killed by SIGKILL");
    job.assert_clean(&ran, 2);
}

#[test]
fn sigkill_of_the_launcher_takes_the_workers_down() {
    // `exec` makes the worker process itself the sleeper: PR_SET_PDEATHSIG survives exec.
    let job = Job::new("exec sleep 300");
    let mut launcher = start(job.gradbus(&["run", "--np", "2", "c.toml"]));
    job.wait_ready(2, &mut launcher);
    signal(launcher.child.id(), libc::SIGKILL);
    let ran = launcher.finish();
    assert_eq!(ran.code, None, "{}", ran.explain());
    for pid in job.pids("pid-") {
        wait_dead(pid, &ran);
    }
    // A SIGKILLed launcher cannot sweep shared memory: remove this test's fake segments.
    let jobid = std::fs::read_to_string(job.path().join("job")).unwrap();
    for r in 0..2 {
        let _ = std::fs::remove_file(format!("/dev/shm/gradbus-{}-n{r}", jobid.trim()));
    }
}

#[test]
fn malformed_hostfile_is_exit_2_with_file_and_line() {
    let job = Job::new("exit 0");
    std::fs::write(job.path().join("hosts"), "# ok\nlocalhost slots=2\nnode2 slots=two\n").unwrap();
    let ran = run(job.gradbus(&["run", "--hostfile", "hosts", "c.toml"]));
    ran.assert_code(2);
    ran.assert_stderr("hosts:3: ");
    ran.assert_stderr("hint:");
    assert!(job.pids("pid-").is_empty(), "no worker may start\n{}", ran.explain());
}

#[test]
fn too_many_ranks_for_the_hostfile_is_exit_2_with_an_oversubscribe_hint() {
    let job = Job::new("exit 0");
    std::fs::write(job.path().join("hosts"), "localhost slots=2\n").unwrap();
    let ran = run(job.gradbus(&["run", "--hostfile", "hosts", "--np", "3", "c.toml"]));
    ran.assert_code(2);
    ran.assert_stderr("--oversubscribe");
    let ran = run(job.gradbus(&["run", "--hostfile", "hosts", "--np", "3", "--oversubscribe", "c.toml"]));
    ran.assert_code(0);
}

#[test]
fn missing_config_is_exit_2_naming_it() {
    let job = Job::new("exit 0");
    let ran = run(job.gradbus(&["run", "--np", "2", "no-such-config.toml"]));
    ran.assert_code(2);
    ran.assert_stderr("no-such-config.toml");
    assert!(!job.path().join("runs").exists(), "no run dir for a failed launch");
}

#[test]
fn missing_worker_binary_is_exit_2_naming_the_path() {
    let job = Job::new("exit 0");
    let mut cmd = job.gradbus(&["run", "c.toml"]);
    cmd.env("GRADBUS_WORKER_BIN", job.path().join("no-such-worker"));
    let ran = run(cmd);
    ran.assert_code(2);
    ran.assert_stderr("no-such-worker");
    ran.assert_stderr("hint:");
}

#[test]
fn mpirun_missing_from_path_is_exit_2_with_an_install_hint() {
    let job = Job::new("exit 0");
    let empty = job.path().join("empty-bin");
    std::fs::create_dir(&empty).unwrap();
    let mut cmd = job.gradbus(&["run", "--launcher", "mpirun", "--np", "2", "c.toml"]);
    cmd.env("PATH", &empty);
    let ran = run(cmd);
    ran.assert_code(2);
    ran.assert_stderr("mpirun");
    ran.assert_stderr("Open MPI");
}

#[test]
fn help_and_bad_usage() {
    let job = Job::new("exit 0");
    let ran = run(job.gradbus(&["--help"]));
    ran.assert_code(0);
    assert!(ran.stdout.contains("EXIT CODES") && ran.stdout.contains("130"), "{}", ran.explain());
    let ran = run(job.gradbus(&["run", "--help"]));
    ran.assert_code(0);
    assert!(ran.stdout.contains("--hostfile"), "{}", ran.explain());
    for args in [&[][..], &["frobnicate"], &["run"], &["run", "--np", "many", "c.toml"], &["bench"]] {
        let ran = run(job.gradbus(args));
        ran.assert_code(2);
        ran.assert_stderr("hint:");
        assert!(!ran.stderr.contains("panicked"), "{}", ran.explain());
    }
}

#[test]
fn without_the_override_each_rank_is_the_launchers_own_worker_subcommand() {
    // No GRADBUS_WORKER_BIN: the launcher starts its own executable as `gradbus worker`, so there is
    // no second binary to find. The real worker of rank 1 runs the config (which the launcher has
    // accepted) and meets a planned exit fault, which only a real worker knows how to read.
    let job = Job::new("exit 0");
    let config = common::root().join("examples/tiny.toml");
    let mut cmd = job.gradbus(&["run", "--np", "2", config.to_str().unwrap(), "--set", "steps=1"]);
    cmd.env_remove("GRADBUS_WORKER_BIN")
        .env("GRADBUS_FAULTS", "[[faults]]\nkind = \"exit\"\nrank = 1\nstep = 0\ncode = 7\n");
    let ran = run(cmd);
    ran.assert_code(4);
    ran.assert_stderr("[rank 1] fault plan: exit 7 at step 0");
    assert!(!job.path().join("pid-0").exists(), "the override's script must not have run");
}

#[test]
fn two_local_host_names_make_two_nodes_with_local_ranks() {
    let job = Job::new("exit 0");
    std::fs::write(job.path().join("hosts"), "localhost slots=2\n127.0.0.1 slots=2 # same machine\n").unwrap();
    let ran = run(job.gradbus(&["run", "--hostfile", "hosts", "c.toml"]));
    ran.assert_code(0);
    for (r, local, node) in [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)] {
        let line = format!("[rank {r}] rank {r} of 4 local {local}/2 node {node}\n");
        assert!(ran.stdout.contains(&line), "lacks {line:?}\n{}", ran.explain());
    }
    job.assert_clean(&ran, 4);
}

#[test]
fn bench_allreduce_json_prints_only_json_lines_with_no_wrong_element() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(GRADBUS);
    cmd.args(["bench", "allreduce", "--np", "2", "--sizes", "4KiB,1MiB", "--json", "--iters", "3"])
        .current_dir(dir.path())
        .env_remove("RUST_LOG");
    let ran = run(cmd);
    ran.assert_code(0);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "stdout must be the JSON lines only\n{}", ran.explain());
    for (line, size) in lines.iter().zip([4096u64, 1 << 20]) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}\n{}", ran.explain()));
        for k in ["size_bytes", "algbw_gbps", "busbw_gbps", "memcpy_gbps", "wrong"] {
            assert!(v[k].is_number(), "{k} missing in {line}");
        }
        assert_eq!(v["size_bytes"].as_u64(), Some(size), "{line}");
        assert_eq!(v["wrong"].as_u64(), Some(0), "{line}");
        assert!(v["algbw_gbps"].as_f64().unwrap() > 0.0, "{line}");
    }
    // The job's segment is gone, and nothing was left in the temporary run directory's place.
    let job = ran.stderr.split("job ").nth(1).and_then(|s| s.split(':').next()).expect("job id on stderr");
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(&format!("gradbus-{job}-")))
        .collect();
    assert!(left.is_empty(), "segments left: {left:?}\n{}", ran.explain());
    assert!(!std::env::temp_dir().join(format!("gradbus-bench-{job}")).exists(), "{}", ran.explain());
}

#[test]
fn bench_allreduce_table_ends_with_the_bus_bandwidth() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(GRADBUS);
    cmd.args(["bench", "allreduce", "--np", "3", "--sizes", "64KiB", "--iters", "2", "--run-dir", "b"])
        .current_dir(dir.path())
        .env_remove("RUST_LOG");
    let ran = run(cmd);
    ran.assert_code(0);
    assert!(ran.stdout.starts_with("# gradbus shm all-reduce, 3 ranks"), "{}", ran.explain());
    assert!(ran.stdout.contains("# Out of bounds values : 0 OK"), "{}", ran.explain());
    assert!(ran.stdout.contains("# Avg bus bandwidth"), "{}", ran.explain());
    assert!(!ran.stdout.contains("[rank"), "rank output must not reach stdout\n{}", ran.explain());
    // --run-dir keeps the ranks' logs and the result.
    for f in ["rank-0.log", "rank-2.log", "result.txt"] {
        assert!(dir.path().join("b").join(f).is_file(), "{f}\n{}", ran.explain());
    }
}
