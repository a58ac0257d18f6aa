//! gradbus under a real Slurm: `scripts/slurm-local.sh` starts a cluster (slurmctld, slurmd, munge;
//! everything in a temp dir, on free ports) for each test, and stops it when the test ends, also on
//! failure (the [`Cluster`] guard). A 4-rank job through `sbatch examples/slurm.sbatch`
//! (`gradbus run --launcher srun`) and through a bare `srun` of the worker must write the metrics
//! of `gradbus run --np 4` bit for bit; a rank killed inside the job must end the job step with exit
//! 4, no process of the job and no shared-memory segment left. With the `mpi` feature, the same on
//! two nodes: two slurmd in two network namespaces, each with its own `/dev/shm`.
//!
//! Where the daemons cannot start (no packages, not root), each test says `SKIPPED: why` and passes,
//! unless `GRADBUS_REQUIRE` names `slurm` (set by `scripts/test.sh` as root, where it installs Slurm),
//! which makes that a failure (`tests/common/skip.rs`). The tests share nothing but run one at a time (a lock), so two clusters never
//! race for the same ports.

mod common;
#[path = "common/skip.rs"]
mod skip;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::{gradbus, metrics, root, segments_left};

/// One cluster at a time.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

/// How long one Slurm job of these tests may take before the test kills it and fails.
const JOB_DEADLINE: Duration = Duration::from_secs(180);

/// The training run every comparison uses: `examples/tiny.toml`, two steps.
const TWO_STEPS: [&str; 3] = ["examples/tiny.toml", "--set", "steps=2"];

/// The worker's command line, program first: the one place that says how a worker is started by
/// hand.
fn worker_command() -> Vec<OsString> {
    vec![env!("CARGO_BIN_EXE_gradbus").into(), "worker".into()]
}

/// A running one-node cluster; dropping it stops the daemons, removes its directory and lets the
/// next test start its own.
struct Cluster {
    dir: tempfile::TempDir,
    _one: MutexGuard<'static, ()>,
}

impl Cluster {
    /// Starts a one-node cluster, or returns None after saying why it cannot (`skip::skip`, which
    /// panics instead where `GRADBUS_REQUIRE` names `slurm`).
    fn start(test: &str) -> Option<Cluster> {
        Cluster::start_nodes(test, 1)
    }

    /// The same with `nodes` nodes `n0`.. in network namespaces (`slurm-local.sh start DIR N`).
    fn start_nodes(test: &str, nodes: usize) -> Option<Cluster> {
        let one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::Builder::new().prefix("gradbus-slurm").tempdir().expect("temp dir");
        let out = Command::new(root().join("scripts/slurm-local.sh"))
            .arg("start")
            .arg(dir.path())
            .arg(nodes.to_string())
            .output()
            .expect("run scripts/slurm-local.sh");
        if out.status.success() {
            return Some(Cluster { dir, _one: one });
        }
        let why = format!(
            "scripts/slurm-local.sh start could not start a {nodes}-node Slurm ({:?}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // Whatever did start must stop before the directory goes.
        let _ = Command::new(root().join("scripts/slurm-local.sh")).arg("stop").arg(dir.path()).output();
        // Several nodes also need network namespaces, which a root without CAP_NET_ADMIN lacks.
        skip::skip(if nodes > 1 { "netns" } else { "slurm" }, &format!("{test}: {why}"));
        None
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("slurm.conf")
    }

    /// The shared-memory segments of job `job_id` in node `k`'s own `/dev/shm` (multi-node clusters).
    #[cfg(feature = "mpi")]
    fn node_segments(&self, k: usize, job_id: &str) -> Vec<String> {
        let out = Command::new(root().join("scripts/slurm-local.sh"))
            .arg("exec")
            .arg(self.dir.path())
            .args([&k.to_string(), "ls", "-1", "/dev/shm"])
            .output()
            .expect("run scripts/slurm-local.sh exec");
        assert!(out.status.success(), "ls /dev/shm on node n{k}: {}", String::from_utf8_lossy(&out.stderr));
        let prefix = format!("gradbus-{job_id}-");
        String::from_utf8_lossy(&out.stdout).lines().filter(|n| n.starts_with(&prefix)).map(String::from).collect()
    }

    /// A Slurm client command (`sbatch`, `srun`, `scontrol`) pointed at this cluster, run from the
    /// repository root with no planned fault inherited.
    fn client(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.current_dir(root()).env("SLURM_CONF", self.conf()).env_remove("GRADBUS_FAULTS");
        c
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let out = Command::new(root().join("scripts/slurm-local.sh")).arg("stop").arg(self.dir.path()).output();
        if !out.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("slurm-local.sh stop {}: {out:?}", self.dir.path().display());
        }
    }
}

/// Runs `cmd` to its end within [`JOB_DEADLINE`]; returns (exit code, stdout, stderr) and panics with
/// all of it on a timeout.
fn run_bounded(mut cmd: Command) -> (Option<i32>, String, String) {
    let shown = format!("{cmd:?}");
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn a Slurm client");
    let [mut out, mut err] = common::capture(&mut child);
    let status = common::wait_until(&mut child, Instant::now() + JOB_DEADLINE);
    let (out, err) = (out.finish(), err.finish());
    let Some(status) = status else {
        panic!("{shown}: still running after {JOB_DEADLINE:?}; killed\n--- stdout\n{out}\n--- stderr\n{err}")
    };
    (status.code(), out, err)
}

/// `sbatch --wait OPTS examples/slurm.sbatch ARGS` with the run directories under `base`; returns the
/// Slurm job id and the exit code of `sbatch` (the job's).
fn sbatch(
    cluster: &Cluster,
    base: &Path,
    opts: &[&str],
    env: &[(&str, &str)],
    args: &[&str],
) -> (u64, Option<i32>, String) {
    let mut c = cluster.client("sbatch");
    c.args(["--wait", "--parsable", "--time=5"])
        .args(opts)
        .arg("--output")
        .arg(base.join("slurm-%j.out"))
        .arg("examples/slurm.sbatch")
        .args(args)
        .env("GRADBUS", env!("CARGO_BIN_EXE_gradbus"))
        .env("GRADBUS_RUN_DIR_BASE", base);
    for (k, v) in env {
        c.env(k, v);
    }
    let (code, out, err) = run_bounded(c);
    let job: u64 = out
        .trim()
        .split(';')
        .next()
        .and_then(|j| j.parse().ok())
        .unwrap_or_else(|| panic!("sbatch --parsable printed no job id\n--- stdout\n{out}\n--- stderr\n{err}"));
    let log = std::fs::read_to_string(base.join(format!("slurm-{job}.out"))).unwrap_or_default();
    (job, code, format!("--- sbatch stderr\n{err}\n--- job output\n{log}"))
}

/// `srun --kill-on-bad-exit=1 -n 4 EXTRA WORKER --run-dir DIR` [`TWO_STEPS`] with
/// `env`; returns (exit code, stdout, stderr).
fn srun_worker(cluster: &Cluster, extra: &[&str], dir: &Path, env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut c = cluster.client("srun");
    c.args(["--kill-on-bad-exit=1", "--time=5", "-n", "4"])
        .args(extra)
        .args(worker_command())
        .arg("--run-dir")
        .arg(dir)
        .args(TWO_STEPS);
    for (k, v) in env {
        c.env(k, v);
    }
    run_bounded(c)
}

#[test]
fn sbatch_and_srun_train_the_same_bits_as_the_local_launcher() {
    let Some(cluster) = Cluster::start("sbatch_and_srun_train_the_same_bits_as_the_local_launcher") else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let local = d.path().join("local");
    let local_dir = local.to_str().unwrap();
    gradbus(&[&["run", "--np", "4", "--run-dir", local_dir][..], &TWO_STEPS].concat(), &[]).expect_code(0);
    let want = metrics(&local);
    assert_eq!(want.len(), 2 * 16, "2 steps x 16 updates");

    let (job, code, story) = sbatch(&cluster, d.path(), &[], &[], &TWO_STEPS[1..]);
    assert_eq!(code, Some(0), "sbatch examples/slurm.sbatch\n{story}");
    let run_dir = d.path().join(format!("slurm-{job}"));
    let launch = std::fs::read_to_string(run_dir.join("launch.json")).expect("launch.json");
    assert!(launch.contains("\"launcher\": \"srun\""), "{launch}");
    assert_eq!(metrics(&run_dir), want, "sbatch examples/slurm.sbatch vs gradbus run --np 4\n{story}");

    // The bare form: every rank finds itself in the step's SLURM_* variables, no launcher involved.
    let bare = d.path().join("bare");
    let (code, out, err) = srun_worker(&cluster, &[], &bare, &[]);
    assert_eq!(code, Some(0), "srun -n 4 worker\n--- stdout\n{out}\n--- stderr\n{err}");
    assert_eq!(metrics(&bare), want, "srun -n 4 worker vs gradbus run --np 4");
}

/// Processes whose command line mentions `needle` (the test's unique run directory).
fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| !common::is_dead(pid))
        .filter_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(needle).then_some((pid, cmd))
        })
        .collect()
}

/// After Slurm job `job` of `examples/slurm.sbatch` (run directories under `base`): its run directory
/// and gradbus job id, once no process mentions that directory any more. The job is over when
/// `sbatch --wait` returns, and slurmstepd has reaped its tasks by then; the bound only absorbs /proc
/// catching up.
fn no_process_left(base: &Path, job: u64, story: &str) -> (PathBuf, String) {
    let run_dir = base.join(format!("slurm-{job}"));
    let launch: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("launch.json")).expect("launch.json")).unwrap();
    let job_id = launch["job_id"].as_str().expect("job_id in launch.json").to_string();
    let needle = run_dir.to_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !processes_mentioning(needle).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(processes_mentioning(needle), [], "processes of job {job} left\n{story}");
    (run_dir, job_id)
}

#[test]
fn a_rank_killed_under_slurm_ends_the_step_with_no_process_or_segment_left() {
    let test = "a_rank_killed_under_slurm_ends_the_step_with_no_process_or_segment_left";
    let Some(cluster) = Cluster::start(test) else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    // Rank 0 creates the node's segment and would unlink it on a clean exit: SIGKILLed, it cannot.
    let kill = "[[faults]]\nkind = \"kill\"\nrank = 0\nstep = 1\nminibatch = 0\n";
    let (job, code, story) = sbatch(&cluster, d.path(), &[], &[("GRADBUS_FAULTS", kill)], &["--set", "steps=50"]);
    assert_eq!(code, Some(4), "a killed rank: gradbus exit 4 through sbatch\n{story}");
    assert!(story.contains("task 0: Killed"), "srun must report the killed task\n{story}");

    // Slurm recorded the job as failed with gradbus's code.
    let mut c = cluster.client("scontrol");
    c.args(["show", "job", &job.to_string()]);
    let (_, show, _) = run_bounded(c);
    assert!(show.contains("JobState=FAILED") && show.contains("ExitCode=4:0"), "scontrol show job {job}:\n{show}");

    let (run_dir, job_id) = no_process_left(d.path(), job, &story);
    assert_eq!(segments_left(&job_id), Vec::<String>::new(), "segments of job {job_id} left\n{story}");
    let metrics_lines = metrics(&run_dir).len();
    assert!(metrics_lines >= 16 && metrics_lines < 50 * 16, "the job stopped at step 1: {metrics_lines} lines");
}

/// With the `mpi` feature under `srun --mpi=pmix`: the hierarchical transport (2 fake nodes, MPI
/// between their leaders) opens only when `MPI_COMM_WORLD` agrees with Slurm's variables on the
/// world size, every rank and the node layout (`gradbus_collectives::mpi` checks them and stops
/// with exit 2 otherwise), and `PMIX_RANK` agrees with `SLURM_PROCID` (`gradbus_worker::rank`).
#[cfg(feature = "mpi")]
#[test]
fn pmix_srun_with_the_mpi_transport_agrees_with_slurm() {
    let Some(cluster) = Cluster::start("pmix_srun_with_the_mpi_transport_agrees_with_slurm") else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("pmix");
    let env = [("GRADBUS_TRANSPORT", "hier"), ("GRADBUS_FAKE_NODES", "2")];
    let (code, out, err) = srun_worker(&cluster, &["--mpi=pmix"], &dir, &env);
    if err.contains("Couldn't load specified plugin name for mpi/pmix") {
        skip::skip(
            "slurm",
            &format!("pmix_srun_with_the_mpi_transport_agrees_with_slurm: Slurm's mpi/pmix plugin cannot load\n{err}"),
        );
        return;
    }
    assert_eq!(code, Some(0), "srun --mpi=pmix -n 4 worker (hier)\n--- stdout\n{out}\n--- stderr\n{err}");
    assert_eq!(metrics(&dir).len(), 2 * 16, "2 steps x 16 updates");
}

/// Two nodes, really (feature `mpi`): two slurmd in two network namespaces, each with its own
/// `/dev/shm`, MPI over TCP between them (`SLURM_MPI_TYPE=pmix`). A 2 x 2-rank `sbatch` job trains the
/// bits of `gradbus run` over the same hierarchy on one machine (2 fake nodes under mpirun: shm inside
/// a node, MPI between the leaders, the same sums in the same order). Then rank 2 - the first local
/// rank of the second node, which created that node's segment and cannot unlink it when SIGKILLed -
/// is killed: the job ends with exit 4, and no process and no segment is left on either node.
#[cfg(feature = "mpi")]
#[test]
fn two_nodes_train_the_bits_of_gradbus_run_and_a_rank_killed_on_the_second_leaves_nothing() {
    let test = "two_nodes_train_the_bits_of_gradbus_run_and_a_rank_killed_on_the_second_leaves_nothing";
    let Some(cluster) = Cluster::start_nodes(test, 2) else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let hosts = d.path().join("hosts");
    std::fs::write(&hosts, "localhost slots=4\n").unwrap();
    let local = d.path().join("local");
    let (h, l) = (hosts.to_str().unwrap(), local.to_str().unwrap());
    let args =
        [&["run", "--launcher", "mpirun", "--hostfile", h, "--np", "4", "--run-dir", l][..], &TWO_STEPS].concat();
    gradbus(&args, &[("GRADBUS_FAKE_NODES", "2")]).expect_code(0);
    let want = metrics(&local);
    assert_eq!(want.len(), 2 * 16, "2 steps x 16 updates");

    let nodes = ["-N", "2", "--ntasks-per-node=2"];
    let (job, code, story) = sbatch(&cluster, d.path(), &nodes, &[("SLURM_MPI_TYPE", "pmix")], &TWO_STEPS[1..]);
    assert_eq!(code, Some(0), "sbatch -N 2 examples/slurm.sbatch\n{story}");
    let run_dir = d.path().join(format!("slurm-{job}"));
    assert_eq!(metrics(&run_dir), want, "2 nodes under Slurm vs gradbus run over 2 fake nodes\n{story}");

    let kill = "[[faults]]\nkind = \"kill\"\nrank = 2\nstep = 1\nminibatch = 0\n";
    let env = [("SLURM_MPI_TYPE", "pmix"), ("GRADBUS_FAULTS", kill)];
    let (job, code, story) = sbatch(&cluster, d.path(), &nodes, &env, &["--set", "steps=50"]);
    assert_eq!(code, Some(4), "a rank killed on the second node: exit 4\n{story}");
    assert!(story.contains("task 2: Killed"), "srun must report the killed task\n{story}");
    let (run_dir, job_id) = no_process_left(d.path(), job, &story);
    for node in 0..2 {
        assert_eq!(cluster.node_segments(node, &job_id), Vec::<String>::new(), "segments left on n{node}\n{story}");
    }
    assert!(metrics(&run_dir).len() < 50 * 16, "the job stopped early");
}
