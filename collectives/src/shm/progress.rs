//! The progress bar's side of a segment: a rank's [`ProgressWriter`] (its own cell, published by
//! the step loop), what the launcher reads without attaching (every local rank's progress and
//! status; the progress fields are seqlocked, so a read never mixes two publishes), and the sweep
//! that removes a job's segments after ranks were killed before they could clean up. None of it is
//! a collective: nothing here waits for a peer.

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;

use memmap2::MmapRaw;

use super::liveness::monotonic_ns;
use super::segment::{Peek, RankCell};
use super::ST_DEPARTED;
use crate::Error;

/// Progress that a rank publishes for the launcher's progress bar.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Progress {
    /// Optimizer steps completed.
    pub step: u64,
    /// Latest loss.
    pub loss: f32,
    /// Latest global gradient norm.
    pub grad_norm: f32,
    /// Updates skipped so far.
    pub skipped: u32,
    /// Updates whose log-ratio headroom to exp overflow fell under the warning margin.
    pub warnings: u32,
}

/// One rank's progress cell in its node's segment, for the launcher's progress bar. It maps the
/// segment on its own (`ShmBus::progress_writer`), so the step loop publishes without the
/// transport, and the mapping stays valid after the bus is dropped (and the segment unlinked).
pub struct ProgressWriter {
    map: MmapRaw,
    /// Byte offset of this rank's cell in the mapping.
    cell: usize,
}

impl ProgressWriter {
    /// The cell at byte `cell` of a new mapping of `file`, the segment.
    pub(super) fn map(file: &File, cell: usize) -> Result<ProgressWriter, Error> {
        let map = MmapRaw::map_raw(file)
            .map_err(|source| Error::Io { what: "mapping the bus segment for the progress cell".into(), source })?;
        assert!(cell % align_of::<RankCell>() == 0 && cell + size_of::<RankCell>() <= map.len(), "cell {cell}");
        Ok(ProgressWriter { map, cell })
    }

    fn cell(&self) -> &RankCell {
        // SAFETY: the cell lies inside the mapping at an offset aligned for `RankCell` (both
        // checked in `map`); it holds only atomics, valid for any bits, shared with the bus's own
        // mapping of the same pages and with the launcher's peeks.
        unsafe { &*self.map.as_ptr().add(self.cell).cast::<RankCell>() }
    }

    /// Publish `p` (seqlocked: odd while the fields change) and beat the heart.
    pub fn publish(&mut self, p: Progress) {
        let c = self.cell();
        let s = c.seq.load(Ordering::Relaxed);
        c.seq.store(s + 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        c.step.store(p.step, Ordering::Relaxed);
        c.loss.store(p.loss.to_bits(), Ordering::Relaxed);
        c.grad_norm.store(p.grad_norm.to_bits(), Ordering::Relaxed);
        c.skipped.store(p.skipped, Ordering::Relaxed);
        c.warnings.store(p.warnings, Ordering::Relaxed);
        c.seq.store(s + 2, Ordering::Release);
        c.heartbeat_ns.store(monotonic_ns(), Ordering::Relaxed);
    }
}

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
