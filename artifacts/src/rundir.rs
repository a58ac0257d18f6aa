//! The run directory's owner and history (`gradbus_worker::rundir`): `gradbus.lock`'s holder and
//! the lines of `resumes.jsonl`.

use serde::{Deserialize, Serialize};

use crate::sealed::{required, seal};
use crate::version::Build;

/// Format version of `gradbus.lock`'s content.
pub const LOCK_FORMAT: u32 = 1;
/// Format version of a `resumes.jsonl` line.
pub const RESUME_FORMAT: u32 = 1;

/// `RUN_DIR/gradbus.lock`: the job that holds (or last held) the directory's lock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockHolder {
    /// The job id (the launcher's, or the worker's under a bare mpirun or srun).
    pub job_id: String,
    /// The process that holds the lock.
    pub pid: u32,
    /// Its host.
    pub host: String,
    /// When it took the lock, UTC (`2026-12-01T05:17:00Z`).
    pub started: String,
    /// Its command line.
    pub command: String,
    /// Its build.
    pub gradbus: Build,
}

impl LockHolder {
    /// The file's text (one line).
    pub fn to_text(&self) -> String {
        seal(LOCK_FORMAT, self, false) + "\n"
    }
}

/// One changed key of a resumed run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Change {
    /// The dotted config key, or `world size`.
    pub key: String,
    /// The value the checkpoint was trained with (TOML), or `(not set)`.
    pub old: String,
    /// The value of this run.
    pub new: String,
}

/// One line of `RUN_DIR/resumes.jsonl`: a resume, and what it changed (written by rank 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRecord {
    /// The step the run resumed at (the checkpoint's).
    pub step: u64,
    /// The resuming job.
    pub job_id: String,
    /// When, UTC.
    pub at: String,
    /// The resuming build.
    pub gradbus: Build,
    /// Seed, world size and data-affecting keys that differ from the checkpoint's run; null when
    /// the checkpoint (format 1) did not record its run.
    #[serde(deserialize_with = "required")]
    pub changes: Option<Vec<Change>>,
}

impl ResumeRecord {
    /// The line as written (no newline).
    pub fn to_line(&self) -> String {
        seal(RESUME_FORMAT, self, false)
    }
}
