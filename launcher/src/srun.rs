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
//! killed before it could unlink its segment leaves one); on the other nodes of a multi-node step
//! such a segment stays until the cluster's epilog sweeps `/dev/shm`.

use std::ffi::OsString;
use std::path::PathBuf;

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
    fn np_comes_from_the_flag_then_the_allocation() {
        let alloc = |k: &str| (k == "SLURM_NTASKS").then(|| "8".to_string());
        assert_eq!(np(Some(4), alloc).unwrap(), 4);
        assert_eq!(np(None, alloc).unwrap(), 8);
        assert_eq!(np(None, |_| None).unwrap(), 1);
        let e = np(None, |_| Some("many".into())).unwrap_err();
        assert!(e.to_string().contains("SLURM_NTASKS=\"many\"") && e.to_string().contains("--np"), "{e}");
    }
}
