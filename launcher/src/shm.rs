//! Removal of a job's leftover shared-memory segments after every worker is gone.
//!
//! Segments of job `J` are the files of `/dev/shm` whose names start with `gradbus-J-` (the naming
//! rule of `gradbus_collectives`' shm bus). Workers unlink their segments on every exit path they
//! control; this sweep covers the paths they do not (SIGKILL, a crash). It must run only after the
//! last worker of the job has been reaped, or it could pull a segment from under a live rank.
//!
//! Stand-in: `gradbus_collectives::shm::remove_job_segments` is being written; when it lands, call it
//! from `run` and delete this module.

use std::path::{Path, PathBuf};

/// Where POSIX shared memory lives on Linux.
pub const SHM_DIR: &str = "/dev/shm";

/// Local stand-in for `gradbus_collectives::shm::remove_job_segments`: unlinks every file in `dir`
/// whose name starts with `gradbus-{job_id}-`, returning the paths removed. Errors on single files
/// (already gone, no permission) are skipped: the sweep is best-effort.
pub fn remove_job_segments_local(dir: &Path, job_id: &str) -> Vec<PathBuf> {
    let prefix = format!("gradbus-{job_id}-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_str().is_some_and(|n| n.starts_with(&prefix)) {
            let path = entry.path();
            if std::fs::remove_file(&path).is_ok() {
                removed.push(path);
            }
        }
    }
    removed.sort();
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_only_this_jobs_segments() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["gradbus-j1-node0", "gradbus-j1-x", "gradbus-j12-node0", "gradbus-j2-node0", "other"] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let removed = remove_job_segments_local(dir.path(), "j1");
        let names: Vec<_> = removed.iter().map(|p| p.file_name().unwrap().to_str().unwrap().to_string()).collect();
        assert_eq!(names, ["gradbus-j1-node0", "gradbus-j1-x"]);
        let mut left: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["gradbus-j12-node0", "gradbus-j2-node0", "other"]);
    }
}
