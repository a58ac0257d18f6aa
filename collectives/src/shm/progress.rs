//! What the launcher reads of a segment without attaching: every local rank's progress and status
//! (seqlocked progress fields, so a read never mixes two publishes), and the sweep that removes a
//! job's segments after ranks were killed before they could clean up.

use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;

use super::segment::{Peek, RankCell};
use super::ST_DEPARTED;
use crate::transport::Progress;

/// Read every local rank's progress from a segment, without attaching (for the launcher's progress
/// bar). `None` when the segment does not exist or is not initialised yet.
pub fn read_progress(path: &Path) -> Option<Vec<Progress>> {
    let peek = Peek::open(path)?;
    if !peek.initialised() {
        return None;
    }
    let cells = peek.cells()?;
    Some(cells.iter().map(read_cell_progress).collect())
}

/// What the launcher can see of one local rank without attaching.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankStatus {
    /// Its process id (0 until it attached).
    pub pid: u32,
    /// It left the bus (dropped it).
    pub departed: bool,
    /// It marked itself failed or gave up on an error.
    pub failed: bool,
    /// Barriers it has entered.
    pub barriers: u64,
    /// CLOCK_MONOTONIC nanoseconds of its last barrier or publish (compare with `monotonic_ns()`).
    pub heartbeat_ns: u64,
    /// Its last published progress.
    pub progress: Progress,
}

/// Read every local rank's status from a segment, without attaching. `None` when the segment does
/// not exist or is not initialised yet.
pub fn read_status(path: &Path) -> Option<Vec<RankStatus>> {
    let peek = Peek::open(path)?;
    if !peek.initialised() {
        return None;
    }
    let cells = peek.cells()?;
    let status = |c: &RankCell| RankStatus {
        pid: c.pid.load(Ordering::Acquire) as u32,
        departed: c.state.load(Ordering::Acquire) == ST_DEPARTED,
        failed: c.failed.load(Ordering::Acquire) != 0,
        barriers: c.arrive.load(Ordering::Acquire),
        heartbeat_ns: c.heartbeat_ns.load(Ordering::Relaxed),
        progress: read_cell_progress(c),
    };
    Some(cells.iter().map(status).collect())
}

pub(super) fn read_cell_progress(c: &RankCell) -> Progress {
    let mut p = Progress::default();
    for _ in 0..1000 {
        let s0 = c.seq.load(Ordering::Acquire);
        p = Progress {
            step: c.step.load(Ordering::Relaxed),
            loss: f32::from_bits(c.loss.load(Ordering::Relaxed)),
            grad_norm: f32::from_bits(c.grad_norm.load(Ordering::Relaxed)),
            skipped: c.skipped.load(Ordering::Relaxed),
            warnings: c.warnings.load(Ordering::Relaxed),
        };
        std::sync::atomic::fence(Ordering::Acquire);
        if s0 % 2 == 0 && c.seq.load(Ordering::Relaxed) == s0 {
            break;
        }
        std::hint::spin_loop();
    }
    p
}

/// Remove every segment of a job (all nodes) from `shm_dir`; returns how many were removed. The
/// launcher's sweep after the job, for ranks that were killed before they could clean up.
pub fn remove_job_segments(shm_dir: &Path, job_id: &str) -> io::Result<usize> {
    let prefix = format!("gradbus-{job_id}-n");
    let mut removed = 0;
    for entry in std::fs::read_dir(shm_dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(node) = name.strip_prefix(&prefix) else {
            continue;
        };
        if node.is_empty() || !node.bytes().all(|c| c.is_ascii_digit()) {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}
