//! `--launcher mpirun`: the `mpirun` command line, built by a pure function.
//!
//! The launcher starts one `mpirun` child and supervises it like a worker (signals forwarded, exit
//! code mapped by the same policy: Open MPI's `mpirun` exits with the code of the first rank that
//! failed). Ranks learn their rank and sizes from `OMPI_COMM_WORLD_*`; the launcher exports only what
//! MPI cannot know: the job id, the run directory and the variables in [`PASS_THROUGH`] that are set.
//!
//! Fixed choices, from the field notes: `--bind-to none` always (with binding, two jobs on one
//! machine pin to the same cores); `--oversubscribe` when the plan places more ranks than slots
//! (or, without a hostfile, more ranks than this machine has cores); `--allow-run-as-root` when
//! running as root, which Open MPI otherwise refuses.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

use gradbus_worker::env;

/// Variables exported to the ranks with `-x` when they are set in the launcher's environment
/// (besides the job id and run directory, which are always exported).
pub const PASS_THROUGH: [&str; 8] = [
    "RUST_LOG",
    "RUST_BACKTRACE",
    env::FAULTS,
    env::FAKE_NODES,
    env::WORKER_BIN,
    env::TRANSPORT,
    env::AGREEMENT,
    env::SIMD,
];

/// Everything the `mpirun` command line depends on.
#[derive(Clone, Debug)]
pub struct MpirunSpec {
    /// The `mpirun` executable (as found on PATH).
    pub mpirun: PathBuf,
    /// `--hostfile`, if any (without one, mpirun runs every rank on this machine).
    pub hostfile: Option<PathBuf>,
    /// Number of ranks.
    pub np: usize,
    /// Pass `--oversubscribe`.
    pub oversubscribe: bool,
    /// Pass `--allow-run-as-root` (the launcher runs as uid 0).
    pub as_root: bool,
    /// Variable names to export with `-x`, in order.
    pub exports: Vec<String>,
    /// Absolute path of the program that runs a rank (the launcher's own executable).
    pub worker: PathBuf,
    /// Its arguments (`worker --run-dir DIR CONFIG [--set k=v ...]`).
    pub worker_args: Vec<OsString>,
}

/// The full command line, program first:
/// `mpirun [--hostfile FILE] -np N --bind-to none [--oversubscribe] [--allow-run-as-root]
/// -x VAR ... WORKER ARGS...`.
pub fn command_line(spec: &MpirunSpec) -> Vec<OsString> {
    let mut argv: Vec<OsString> = vec![spec.mpirun.clone().into()];
    if let Some(h) = &spec.hostfile {
        argv.push("--hostfile".into());
        argv.push(h.clone().into());
    }
    argv.extend(["-np".into(), spec.np.to_string().into(), "--bind-to".into(), "none".into()]);
    if spec.oversubscribe {
        argv.push("--oversubscribe".into());
    }
    if spec.as_root {
        argv.push("--allow-run-as-root".into());
    }
    for name in &spec.exports {
        argv.push("-x".into());
        argv.push(name.into());
    }
    argv.push(spec.worker.clone().into());
    argv.extend(spec.worker_args.iter().cloned());
    argv
}

/// The variables to export: the job id and run directory, then those of [`PASS_THROUGH`] for which
/// `is_set` says yes.
pub fn exports(is_set: impl Fn(&str) -> bool) -> Vec<String> {
    let mut names = vec![env::JOB_ID.to_string(), env::RUN_DIR.to_string()];
    names.extend(PASS_THROUGH.iter().filter(|n| is_set(n)).map(|n| n.to_string()));
    names
}

/// The first executable file called `name` in the directories of `path` (a PATH-style list).
pub fn find_on_path(name: &str, path: Option<&OsStr>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path?)
        .map(|dir| dir.join(name))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Whether the launcher runs as root.
pub fn running_as_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> MpirunSpec {
        MpirunSpec {
            mpirun: "/usr/bin/mpirun".into(),
            hostfile: Some("hosts.txt".into()),
            np: 4,
            oversubscribe: false,
            as_root: false,
            exports: exports(|n| n == "RUST_LOG"),
            worker: "/opt/gradbus/bin/gradbus".into(),
            worker_args: vec!["worker".into(), "--run-dir".into(), "/runs/j1".into(), "/cfg/tiny.toml".into()],
        }
    }

    fn joined(argv: &[OsString]) -> String {
        argv.iter().map(|a| a.to_str().unwrap()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn builds_the_documented_command_line() {
        assert_eq!(
            joined(&command_line(&spec())),
            "/usr/bin/mpirun --hostfile hosts.txt -np 4 --bind-to none \
             -x GRADBUS_JOB_ID -x GRADBUS_RUN_DIR -x RUST_LOG \
             /opt/gradbus/bin/gradbus worker --run-dir /runs/j1 /cfg/tiny.toml"
        );
    }

    #[test]
    fn oversubscribe_root_sets_and_no_hostfile() {
        let mut s = spec();
        s.hostfile = None;
        s.oversubscribe = true;
        s.as_root = true;
        s.exports = exports(|_| false);
        s.worker_args.extend(["--set".into(), "lr=0.001".into()]);
        assert_eq!(
            joined(&command_line(&s)),
            "/usr/bin/mpirun -np 4 --bind-to none --oversubscribe --allow-run-as-root \
             -x GRADBUS_JOB_ID -x GRADBUS_RUN_DIR \
             /opt/gradbus/bin/gradbus worker --run-dir /runs/j1 /cfg/tiny.toml --set lr=0.001"
        );
    }

    #[test]
    fn the_variables_that_force_a_transport_path_or_level_reach_every_node() {
        // A rank on another node sees only what `-x` exports: an override set for the job must
        // reach every rank, or ranks would open different transports or agreement paths.
        let set = ["GRADBUS_TRANSPORT", "GRADBUS_AGREEMENT", "GRADBUS_SIMD"];
        let names = exports(|n| set.contains(&n));
        assert_eq!(
            names,
            ["GRADBUS_JOB_ID", "GRADBUS_RUN_DIR", "GRADBUS_TRANSPORT", "GRADBUS_AGREEMENT", "GRADBUS_SIMD"]
        );
    }

    #[test]
    fn finds_executables_on_path() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("mpirun");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        let plain = dir.path().join("notexec");
        std::fs::write(&plain, "").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = std::env::join_paths(["/nonexistent-dir".as_ref(), dir.path()]).unwrap();
        assert_eq!(find_on_path("mpirun", Some(&path)), Some(exe));
        assert_eq!(find_on_path("notexec", Some(&path)), None);
        assert_eq!(find_on_path("mpirun", None), None);
    }
}
