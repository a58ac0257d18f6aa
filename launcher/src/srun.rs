//! `--launcher srun`: the `srun` command line inside a Slurm allocation, built by a pure function.
//!
//! The launcher starts one `srun` child and supervises it like the `mpirun` child (signals forwarded:
//! `srun` passes SIGTERM/SIGINT on to every task and cancels the step; exit code mapped by the same
//! policy: `srun` exits with the highest exit code of its tasks, 128 + signal when Slurm had to
//! terminate them). Slurm places the ranks; each learns its rank, local rank, node and sizes from
//! the step's `SLURM_*` variables (`gradbus_worker::rank`), and inherits the launcher's environment
//! (`srun --export=ALL`, its default), so the launcher only sets the job id and the run directory.
//!
//! Fixed choices: `--kill-on-bad-exit=1` always, so a rank that dies ends the job step at once (the
//! supervision promise of the local launcher, kept by Slurm); `--label`, so each output line starts
//! with its rank (`3: ...`; all of them go to `RUN_DIR/srun.log`, there is no `rank-K.log`); `-n NP` always, from `--np`, else the
//! allocation's `SLURM_NTASKS`; `--overcommit` with `--oversubscribe` (more tasks than CPUs). Anything
//! else comes from Slurm's own input variables (`SLURM_MPI_TYPE=pmix` for `--mpi=pmix`, ...).
//!
//! After the step, the launcher removes the job's shared-memory segments on its own node (a rank
//! killed before it could unlink its segment leaves one). When the step did not end cleanly and the
//! allocation has several nodes, it also runs one more step, one task per node
//! ([`sweep_command_line`]: this executable's hidden `__sweep-shm JOB`), that removes the job's
//! segments on every node; it is bounded ([`SWEEP_LIMIT`]) and its failure is only reported, since
//! the job's result stands either way.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gradbus_worker::env;

use crate::Error;

/// Everything the `srun` command line depends on.
#[derive(Clone, Debug)]
pub struct SrunSpec {
    /// The `srun` executable (as found on PATH).
    pub srun: PathBuf,
    /// Number of ranks.
    pub np: usize,
    /// Pass `--overcommit` (more tasks than CPUs).
    pub overcommit: bool,
    /// Absolute path of the worker binary.
    pub worker: PathBuf,
    /// The worker's arguments (`--run-dir DIR CONFIG [--set k=v ...]`).
    pub worker_args: Vec<OsString>,
}

/// The full command line, program first:
/// `srun --kill-on-bad-exit=1 --label -n N [--overcommit] WORKER ARGS...`.
pub fn command_line(spec: &SrunSpec) -> Vec<OsString> {
    let mut argv: Vec<OsString> = vec![
        spec.srun.clone().into(),
        "--kill-on-bad-exit=1".into(),
        "--label".into(),
        "-n".into(),
        spec.np.to_string().into(),
    ];
    if spec.overcommit {
        argv.push("--overcommit".into());
    }
    argv.push(spec.worker.clone().into());
    argv.extend(spec.worker_args.iter().cloned());
    argv
}

/// How long the sweep step may take before it is killed.
pub const SWEEP_LIMIT: Duration = Duration::from_secs(60);

/// The step that removes job `job_id`'s segments on each of the allocation's `nodes` nodes:
/// `srun --overlap --mpi=none --kill-on-bad-exit=0 -N NODES -n NODES --ntasks-per-node=1 GRADBUS
/// __sweep-shm JOB`. `--overlap`: it needs no free CPU of the allocation; `--mpi=none`: an exported
/// `SLURM_MPI_TYPE` (for the ranks' MPI) is not for it.
pub fn sweep_command_line(srun: &Path, nodes: usize, gradbus: &Path, job_id: &str) -> Vec<OsString> {
    let n = nodes.to_string();
    let mut argv: Vec<OsString> = vec![srun.into()];
    for a in ["--overlap", "--mpi=none", "--kill-on-bad-exit=0", "-N", &n, "-n", &n, "--ntasks-per-node=1"] {
        argv.push(a.into());
    }
    argv.extend([gradbus.into(), "__sweep-shm".into(), job_id.into()]);
    argv
}

/// The allocation's number of nodes (`SLURM_JOB_NUM_NODES`, else `SLURM_NNODES`, read through `get`).
pub fn allocation_nodes(get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    get(env::SLURM_JOB_NUM_NODES).or_else(|| get(env::SLURM_NNODES)).and_then(|v| v.trim().parse().ok())
}

/// Runs the sweep step (bounded by [`SWEEP_LIMIT`]) and shows what it says on stderr.
pub fn sweep_nodes(argv: &[OsString]) {
    let Some((program, args)) = argv.split_first() else { return };
    let child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return eprintln!("gradbus: cannot start the sweep of the other nodes' segments: {e}"),
    };
    let deadline = Instant::now() + SWEEP_LIMIT;
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
        eprintln!("gradbus: the sweep of the other nodes' segments took over {} s: stopped", SWEEP_LIMIT.as_secs());
    }
    match child.wait_with_output() {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                eprintln!("gradbus: sweep: {line}");
            }
            if !out.status.success() {
                eprintln!("gradbus: the sweep of the other nodes' segments ended with {}", out.status);
            }
        }
        Err(e) => eprintln!("gradbus: the sweep of the other nodes' segments: {e}"),
    }
}

/// The number of ranks: `--np`, else the allocation's `SLURM_NTASKS` (read through `get`), else 1
/// (what `srun` itself would start).
pub fn np(arg: Option<usize>, get: impl Fn(&str) -> Option<String>) -> Result<usize, Error> {
    if let Some(n) = arg {
        return Ok(n);
    }
    match get(env::SLURM_NTASKS) {
        None => Ok(1),
        Some(v) => v.trim().parse().map_err(|_| {
            Error::usage(
                format!("{}={v:?} is not a number of tasks", env::SLURM_NTASKS),
                "give the number of ranks with --np N",
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(argv: &[OsString]) -> String {
        argv.iter().map(|a| a.to_str().unwrap()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn builds_the_documented_command_line() {
        let mut spec = SrunSpec {
            srun: "/usr/bin/srun".into(),
            np: 4,
            overcommit: false,
            worker: "/opt/gradbus/bin/gradbus-worker".into(),
            worker_args: vec!["--run-dir".into(), "/runs/j1".into(), "/cfg/tiny.toml".into()],
        };
        assert_eq!(
            joined(&command_line(&spec)),
            "/usr/bin/srun --kill-on-bad-exit=1 --label -n 4 /opt/gradbus/bin/gradbus-worker --run-dir /runs/j1 /cfg/tiny.toml"
        );
        spec.overcommit = true;
        assert!(joined(&command_line(&spec))
            .starts_with("/usr/bin/srun --kill-on-bad-exit=1 --label -n 4 --overcommit /opt/"));
    }

    #[test]
    fn sweep_step_has_one_task_per_node_and_needs_no_free_cpu() {
        let argv = sweep_command_line(Path::new("/usr/bin/srun"), 3, Path::new("/bin/gradbus"), "j7");
        assert_eq!(
            joined(&argv),
            "/usr/bin/srun --overlap --mpi=none --kill-on-bad-exit=0 -N 3 -n 3 --ntasks-per-node=1 \
             /bin/gradbus __sweep-shm j7"
        );
        let alloc = |k: &str| (k == "SLURM_NNODES").then(|| "2".to_string());
        assert_eq!(allocation_nodes(alloc), Some(2));
        assert_eq!(allocation_nodes(|k| (k == "SLURM_JOB_NUM_NODES").then(|| "4".into())), Some(4));
        assert_eq!(allocation_nodes(|_| None), None);
    }

    #[test]
    fn np_comes_from_the_flag_then_the_allocation() {
        let alloc = |k: &str| (k == "SLURM_NTASKS").then(|| "8".to_string());
        assert_eq!(np(Some(4), alloc).unwrap(), 4);
        assert_eq!(np(None, alloc).unwrap(), 8);
        assert_eq!(np(None, |_| None).unwrap(), 1);
        let e = np(None, |_| Some("many".into())).unwrap_err();
        assert!(e.to_string().contains("SLURM_NTASKS=\"many\"") && e.to_string().contains("--np"), "{e}");
    }
}
