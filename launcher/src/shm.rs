//! The launcher's shared-memory hygiene: the job's own segments after the job, and stale segments
//! of dead launchers before a new job starts.
//!
//! The naming rule of segments (`gradbus-{job}-n{node}`) belongs to `gradbus_collectives::shm`;
//! the sweep after a job calls its `remove_job_segments`, and it must run only after the last
//! process of the job has been reaped, or it could pull a segment from under a live rank.
//!
//! The stale sweep ([`sweep_stale`]) runs before a launch and is deliberately conservative, because
//! `/dev/shm` is shared with every other job and test on the machine. It removes a segment only when
//! all of these hold:
//! - its name is exactly `gradbus-{job}-n{node}` with a job id made by [`crate::run::new_job_id`]
//!   (`YYYYMMDDTHHMMSSp{pid}`), so segments named by tests or bare `mpirun` jobs are never touched;
//! - the launcher pid embedded in the job id is certainly dead: `kill(pid, 0)` answers ESRCH. A live
//!   process with that pid, even an unrelated one that reused it, or a zombie, keeps the segment;
//! - the segment was last modified or changed more than [`STALE_AGE`] ago.
//!
//! A dead launcher's workers are dead too (they get SIGKILL as their parent-death signal), so such a
//! segment cannot be in use by a job that this launcher started. Each removal is logged.
//!
//! Assumption: every launcher that shares this `/dev/shm` shares this pid namespace. A container
//! with its own pid namespace and a bind-mounted `/dev/shm` would make its live launchers look dead
//! here, and only the age bound would protect its segments (memory writes through a mapping do not
//! update a tmpfs file's mtime). The rank heartbeats in the segment header would settle it; they
//! are readable (`gradbus_collectives::read_status`'s `heartbeat_ns`, against `monotonic_ns()`),
//! but this sweep does not consult them yet.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// Where POSIX shared memory lives on Linux.
pub const SHM_DIR: &str = "/dev/shm";

/// How old a segment of a dead launcher must be before the stale sweep removes it.
pub const STALE_AGE: Duration = Duration::from_secs(60);

/// Removes every segment of `job_id` (all nodes) after the job; logs how many. Best-effort: an
/// error is logged, not returned, since the job's result stands either way.
pub fn remove_job(shm_dir: &Path, job_id: &str) {
    match gradbus_collectives::shm::remove_job_segments(shm_dir, job_id) {
        Ok(0) => {}
        Ok(n) => log::info!("removed {n} leftover shared-memory segment(s) of job {job_id}"),
        Err(e) => log::warn!("cannot sweep the segments of job {job_id} in {}: {e}", shm_dir.display()),
    }
}

/// One task of the sweep step after a multi-node `srun` step: removes every segment of `job_id` in
/// `shm_dir` on this node and says how many, naming the node.
pub fn sweep_node(shm_dir: &Path, job_id: &str) -> Result<(), crate::Error> {
    let n = gradbus_collectives::shm::remove_job_segments(shm_dir, job_id).map_err(|e| {
        crate::Error::usage(format!("cannot sweep {}: {e}", shm_dir.display()), "check the node's /dev/shm")
    })?;
    let host = gradbus_worker::host::hostname().unwrap_or_else(|| "?".into());
    println!("{host}: removed {n} leftover shared-memory segment(s) of job {job_id}");
    Ok(())
}

/// The launcher pid embedded in a job id made by [`crate::run::new_job_id`]
/// (`YYYYMMDDTHHMMSSp{pid}`); `None` for any other shape (a test's or a bare `mpirun`'s job id).
pub fn launcher_pid(job_id: &str) -> Option<u32> {
    let b = job_id.as_bytes();
    let digits = |s: &[u8]| !s.is_empty() && s.iter().all(u8::is_ascii_digit);
    if b.len() < 17 || !digits(&b[..8]) || b[8] != b'T' || !digits(&b[9..15]) || b[15] != b'p' {
        return None;
    }
    let pid = &b[16..];
    // A pid is printed without leading zeros; Linux pids fit in 22 bits (pid_max <= 2^22).
    if !digits(pid) || pid[0] == b'0' || pid.len() > 7 {
        return None;
    }
    std::str::from_utf8(pid).ok()?.parse().ok()
}

/// The job id of a segment file name `gradbus-{job}-n{node}` whose job id has the launcher's shape.
pub fn launcher_segment_job(file_name: &str) -> Option<&str> {
    let rest = file_name.strip_prefix("gradbus-")?;
    let (job, node) = rest.rsplit_once("-n")?;
    if node.is_empty() || !node.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    launcher_pid(job).map(|_| job)
}

/// Whether `pid` certainly does not exist: `kill(pid, 0)` fails with ESRCH. Any other answer
/// (it exists, EPERM, a zombie, an unrelated process that reused the pid) means "maybe alive".
pub fn certainly_dead(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks whether the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// A segment the stale sweep removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stale {
    /// The segment's path.
    pub path: PathBuf,
    /// The dead launcher's pid.
    pub pid: u32,
    /// Time since the segment was last modified or changed.
    pub age: Duration,
}

/// Removes the stale segments of dead launchers from `shm_dir` (the rules are in the module doc)
/// and returns them. `is_dead` decides whether a launcher pid is certainly dead ([`certainly_dead`]
/// in production). Best-effort: files that vanish or cannot be removed are skipped.
pub fn sweep_stale(shm_dir: &Path, now: SystemTime, is_dead: &dyn Fn(u32) -> bool) -> Vec<Stale> {
    let Ok(entries) = std::fs::read_dir(shm_dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(job) = name.to_str().and_then(launcher_segment_job) else {
            continue;
        };
        let Some(pid) = launcher_pid(job) else { continue };
        if pid == std::process::id() || !is_dead(pid) {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if !meta.file_type().is_file() {
            continue;
        }
        // The newer of mtime and ctime: any sign of recent use keeps the segment.
        let changed = {
            use std::os::unix::fs::MetadataExt;
            let ctime = SystemTime::UNIX_EPOCH + Duration::from_secs(meta.ctime().max(0) as u64);
            meta.modified().map_or(ctime, |m| m.max(ctime))
        };
        let Ok(age) = now.duration_since(changed) else { continue };
        if age < STALE_AGE {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            removed.push(Stale { path, pid, age });
        }
    }
    removed.sort_by(|a, b| a.path.cmp(&b.path));
    removed
}

/// The stale sweep of `/dev/shm` before a launch, each removal reported on stderr.
pub fn sweep_stale_and_log() {
    for s in sweep_stale(Path::new(SHM_DIR), SystemTime::now(), &certainly_dead) {
        eprintln!(
            "gradbus: removed stale shared-memory segment {} (its launcher, pid {}, is gone; last used {} s ago)",
            s.path.display(),
            s.pid,
            s.age.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_of_the_launcher_are_recognised_strictly() {
        assert_eq!(launcher_pid("20261129T175530p4242"), Some(4242));
        assert_eq!(launcher_pid(&crate::run::new_job_id()), Some(std::process::id()));
        for bad in [
            "",
            "t31093-exit0-0",
            "20261129T175530p",
            "20261129T175530p04242",
            "20261129T175530p42x",
            "20261129T175530p12345678",
            "2026112xT175530p42",
            "20261129t175530p42",
            "20261129T17553p42",
            "x20261129T175530p42",
        ] {
            assert_eq!(launcher_pid(bad), None, "{bad:?}");
        }
        assert_eq!(launcher_segment_job("gradbus-20261129T175530p42-n0"), Some("20261129T175530p42"));
        assert_eq!(launcher_segment_job("gradbus-20261129T175530p42-n17"), Some("20261129T175530p42"));
        for bad in [
            "gradbus-20261129T175530p42-rank0",
            "gradbus-20261129T175530p42-n",
            "gradbus-20261129T175530p42-n0x",
            "gradbus-t1-exit0-0-n0",
            "other-20261129T175530p42-n0",
            "gradbus-20261129T175530p42",
        ] {
            assert_eq!(launcher_segment_job(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn our_own_pid_is_not_dead_and_a_reaped_child_is() {
        assert!(!certainly_dead(std::process::id()));
        assert!(!certainly_dead(0));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        // The pid could be reused in between, which only makes the answer "maybe alive".
        let _ = certainly_dead(pid);
    }

    #[test]
    fn stale_sweep_removes_only_old_segments_of_dead_launchers() {
        let dir = tempfile::tempdir().unwrap();
        let names = [
            "gradbus-20261129T175530p111-n0",    // dead launcher, old: removed
            "gradbus-20261129T175530p111-n1",    // same job, other node: removed
            "gradbus-20261129T175530p222-n0",    // live launcher: kept
            "gradbus-t31093-exit0-0-n0",         // not a launcher job id: kept
            "gradbus-20261129T175530p111-rank0", // not a segment name: kept
            "unrelated",
        ];
        for n in names {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        let dead = |pid: u32| pid == 111;
        // Just written: younger than STALE_AGE, nothing goes.
        assert!(sweep_stale(dir.path(), SystemTime::now(), &dead).is_empty());
        let later = SystemTime::now() + STALE_AGE + Duration::from_secs(5);
        let removed = sweep_stale(dir.path(), later, &dead);
        let got: Vec<_> = removed.iter().map(|s| s.path.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(got, ["gradbus-20261129T175530p111-n0", "gradbus-20261129T175530p111-n1"]);
        assert!(removed.iter().all(|s| s.pid == 111 && s.age >= STALE_AGE));
        let mut left: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(
            left,
            [
                "gradbus-20261129T175530p111-rank0",
                "gradbus-20261129T175530p222-n0",
                "gradbus-t31093-exit0-0-n0",
                "unrelated"
            ]
        );
    }

    #[test]
    fn a_node_sweep_removes_that_jobs_segments_only() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["gradbus-j1-n1", "gradbus-j12-n1", "unrelated"] {
            std::fs::write(dir.path().join(n), b"").unwrap();
        }
        sweep_node(dir.path(), "j1").unwrap();
        let mut left: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["gradbus-j12-n1", "unrelated"]);
        assert!(sweep_node(&dir.path().join("missing"), "j1").is_err());
    }

    #[test]
    fn job_sweep_removes_every_node_of_the_job_only() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["gradbus-j1-n0", "gradbus-j1-n1", "gradbus-j12-n0", "gradbus-j2-n0"] {
            std::fs::write(dir.path().join(n), b"").unwrap();
        }
        remove_job(dir.path(), "j1");
        let mut left: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["gradbus-j12-n0", "gradbus-j2-n0"]);
    }
}
