//! The segment's lifecycle and format: the header, the per-rank control cells, the double-buffered
//! health table and report cells and the gradient slots (`Geometry`, a pure function of ranks,
//! buckets and buffer length), created by local rank 0 (replacing the stale segment of a dead
//! creator), attached by the others once its magic is written, and checked against this rank's
//! config. Invariant: the magic is stored last (Release) and an attacher trusts nothing before it
//! reads it (Acquire).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gradbus_kernels::Health;
use memmap2::{MmapOptions, MmapRaw};

use super::liveness::{process_alive, self_start_time};
use super::{HEADER_BYTES, MAGIC, NONE, PAGE, VERSION};
use crate::agreement::{LocalScalars, ValueNames};
use crate::layout::Layout;
use crate::Error;

/// How the bus is opened by one rank.
#[derive(Clone, Debug)]
pub struct BusConfig {
    /// Directory of the segment: `/dev/shm` (tests may point it at a small tmpfs).
    pub shm_dir: PathBuf,
    /// Job id, the same on every rank of the job: `[A-Za-z0-9_.-]`, at most 100 characters.
    pub job_id: String,
    /// Node index, part of the segment name.
    pub node_id: usize,
    /// This process's rank on the node; local rank 0 creates the segment.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_size: usize,
    /// Caller-given hash of everything the ranks must agree on (config, layout...).
    pub config_hash: u64,
    /// The layout of the gradient buffer, the same on every rank.
    pub layout: Layout,
    /// The workload values each rank reports in the agreement, the same on every rank (they size
    /// the report cells).
    pub values: ValueNames,
    /// Deadline of every wait (attach and each barrier).
    pub timeout: Duration,
}

impl BusConfig {
    /// A config with `shm_dir` = `/dev/shm`, node 0, no workload values and a 60 s timeout.
    pub fn new(job_id: impl Into<String>, local_rank: usize, local_size: usize, layout: Layout) -> BusConfig {
        BusConfig {
            shm_dir: PathBuf::from("/dev/shm"),
            job_id: job_id.into(),
            node_id: 0,
            local_rank,
            local_size,
            config_hash: layout.hash(),
            layout,
            values: ValueNames::default(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// The segment header. Only atomics: any bit pattern is valid and it is shared between processes.
#[repr(C)]
pub(super) struct Header {
    pub(super) magic: AtomicU64,
    pub(super) version: AtomicU64,
    pub(super) config_hash: AtomicU64,
    pub(super) layout_hash: AtomicU64,
    pub(super) creator_pid: AtomicU64,
    pub(super) creator_start: AtomicU64,
    pub(super) world: AtomicU64,
    pub(super) local_size: AtomicU64,
    pub(super) node_id: AtomicU64,
    pub(super) buckets: AtomicU64,
    pub(super) len: AtomicU64,
    pub(super) size: AtomicU64,
    /// `ValueNames::hash` of the workload values the report cells hold.
    pub(super) values_hash: AtomicU64,
}

/// Where waiters sleep: `seq` is a futex word bumped whenever a barrier may have completed (or a
/// rank failed or left); `sleepers` counts the waiters that may be asleep on it, so that an
/// arriving rank makes the wake-up system call only when someone sleeps.
#[repr(C, align(64))]
pub(super) struct WakeLine {
    pub(super) seq: AtomicU32,
    pub(super) sleepers: AtomicU32,
}

/// One rank's control block, on its own cache lines.
#[repr(C, align(128))]
pub(super) struct RankCell {
    pub(super) pid: AtomicU64,
    /// Process start time (clock ticks since boot, /proc/PID/stat field 22): tells pid reuse apart.
    pub(super) start_time: AtomicU64,
    pub(super) state: AtomicU64,
    pub(super) failed: AtomicU64,
    /// The first barrier this rank will not pass, once failed.
    pub(super) failed_at: AtomicU64,
    /// The rank this one blames for its failure (itself, or the peer that failed or stalled first).
    pub(super) blame: AtomicU64,
    /// Number of barriers this rank has entered.
    pub(super) arrive: AtomicU64,
    /// CLOCK_MONOTONIC nanoseconds of the last publish or barrier.
    pub(super) heartbeat_ns: AtomicU64,
    /// Seqlock of the progress fields: odd while they are being written.
    pub(super) seq: AtomicU64,
    pub(super) step: AtomicU64,
    pub(super) loss: AtomicU32,
    pub(super) grad_norm: AtomicU32,
    pub(super) skipped: AtomicU32,
    pub(super) warnings: AtomicU32,
    /// What the rank was doing at its last two barriers (by barrier parity).
    pub(super) tags: [[AtomicU64; 5]; 2],
}

/// A stored `Health`: nan, inf, sumsq bits, first bad (or `NONE`).
pub(super) type HealthCell = [AtomicU64; 4];

/// Byte offsets of the regions of a segment, a pure function of (ranks, buckets, buffer length,
/// workload values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) n: usize,
    pub(super) buckets: usize,
    pub(super) cells: usize,
    pub(super) table: usize,
    /// Bytes of one (parity, bucket, reducer) entry: a stamp, then n + 2 health cells: the chunk's
    /// health per source rank, the health of the chunk's sum, and the NaN/Inf totals of the sources;
    /// then the checksum of the chunk's sum as written, and per source rank its peak word
    /// (`peak_word`).
    pub(super) entry: usize,
    pub(super) reports: usize,
    /// Bytes of one report cell: `LocalScalars::words(values)` words, then per bucket the rank's
    /// local sum of squares bits and peak word; padded to cache lines.
    pub(super) report: usize,
    pub(super) grads: usize,
    pub(super) slot_stride: usize,
    pub(super) size: usize,
}

pub(super) fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl Geometry {
    pub(super) fn new(n: usize, buckets: usize, len: usize, values: usize) -> Geometry {
        let cells = HEADER_BYTES;
        let table = round_up(cells + n * size_of::<RankCell>(), PAGE);
        let entry = round_up(8 + (n + 2) * size_of::<HealthCell>() + 8 * (1 + n), 64);
        let reports = round_up(table + 2 * buckets * n * entry, PAGE);
        let report = round_up(8 * (LocalScalars::words(values) + 2 * buckets), 64);
        let grads = round_up(reports + 2 * n * report, PAGE);
        let slot_stride = round_up(len * 4, PAGE).max(PAGE);
        let size = grads + n * slot_stride;
        Geometry { n, buckets, cells, table, entry, reports, report, grads, slot_stride, size }
    }
}

pub(super) fn check_job_id(shm_dir: &Path, job_id: &str) -> Result<(), Error> {
    let ok = !job_id.is_empty()
        && job_id.len() <= 100
        && job_id.bytes().all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(&c));
    if ok {
        return Ok(());
    }
    Err(Error::BadSegment {
        path: shm_dir.join(format!("gradbus-{job_id}")).display().to_string(),
        reason: format!("job id {job_id:?} cannot name a segment"),
        hint: "use 1 to 100 characters from [A-Za-z0-9_.-]".into(),
    })
}

pub(super) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// Map a whole file shared read-write.
pub(super) fn map_rw(file: &File) -> io::Result<MmapRaw> {
    MmapRaw::map_raw(file)
}

/// A read-only view of a segment that may or may not be initialised (peek, stale check).
pub(super) struct Peek {
    pub(super) map: MmapRaw,
}

impl Peek {
    pub(super) fn open(path: &Path) -> Option<Peek> {
        let file = File::open(path).ok()?;
        let len = file.metadata().ok()?.len() as usize;
        if len < HEADER_BYTES {
            return None;
        }
        let map = MmapOptions::new().len(len).map_raw_read_only(&file).ok()?;
        Some(Peek { map })
    }
    pub(super) fn header(&self) -> &Header {
        // SAFETY: the mapping is page-aligned and at least HEADER_BYTES >= size_of::<Header>() long
        // (checked in `open`); Header holds only atomics, valid for any bits, and we only load them.
        unsafe { &*self.map.as_ptr().cast::<Header>() }
    }
    pub(super) fn initialised(&self) -> bool {
        self.header().magic.load(Ordering::Acquire) == MAGIC && self.header().version.load(Ordering::Relaxed) == VERSION
    }
    pub(super) fn cells(&self) -> Option<&[RankCell]> {
        let n = self.header().local_size.load(Ordering::Relaxed) as usize;
        if n == 0 || n > 4096 || HEADER_BYTES + n * size_of::<RankCell>() > self.map.len() {
            return None;
        }
        // SAFETY: bounds checked just above; the cells start at HEADER_BYTES (a multiple of their
        // 128-byte alignment) and consist of atomics, valid for any bits; only loaded here.
        Some(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(HEADER_BYTES).cast::<RankCell>(), n) })
    }
}

pub(super) fn store_health(cell: &HealthCell, h: &Health) {
    cell[0].store(h.nan, Ordering::Relaxed);
    cell[1].store(h.inf, Ordering::Relaxed);
    cell[2].store(h.sumsq.to_bits(), Ordering::Relaxed);
    cell[3].store(h.first_bad.unwrap_or(NONE), Ordering::Relaxed);
}

pub(super) fn load_health(cell: &HealthCell) -> Health {
    let first = cell[3].load(Ordering::Relaxed);
    Health {
        nan: cell[0].load(Ordering::Relaxed),
        inf: cell[1].load(Ordering::Relaxed),
        sumsq: f64::from_bits(cell[2].load(Ordering::Relaxed)),
        first_bad: (first != NONE).then_some(first),
    }
}

/// Create the segment (local rank 0), replacing a stale one of a dead creator.
pub(super) fn create(cfg: &BusConfig, path: &Path, geo: &Geometry) -> Result<(File, MmapRaw), Error> {
    let file = loop {
        let r = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path);
        match r {
            Ok(f) => break f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let live = Peek::open(path).and_then(|p| {
                    let h = p.header();
                    let pid = h.creator_pid.load(Ordering::Acquire);
                    process_alive(pid, h.creator_start.load(Ordering::Relaxed)).then_some(pid)
                });
                if let Some(pid) = live {
                    return Err(Error::BadSegment {
                        path: path.display().to_string(),
                        reason: format!("the segment is in use by a live process (pid {pid})"),
                        hint: "another job runs with the same job id on this node; pick a unique job id".into(),
                    });
                }
                log::warn!("{}: removing a stale segment (its creator is gone)", path.display());
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(format!("removing stale segment {}", path.display()))(e)),
                }
            }
            Err(e) => return Err(io_err(format!("creating {}", path.display()))(e)),
        }
    };
    // From here on, a failure must not leave the file behind.
    let unlink = |e: Error| {
        let _ = std::fs::remove_file(path);
        e
    };
    use std::os::fd::AsRawFd;
    // SAFETY: `file` is an open, writable descriptor; the range is non-negative.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, geo.size as libc::off_t) };
    if rc != 0 {
        let source = io::Error::from_raw_os_error(rc);
        let e = if rc == libc::ENOSPC || rc == libc::EFBIG {
            Error::ShmFull { path: path.display().to_string(), need: geo.size as u64, reason: source.to_string() }
        } else {
            Error::Io { what: format!("reserving {} bytes for {}", geo.size, path.display()), source }
        };
        return Err(unlink(e));
    }
    let map = map_rw(&file).map_err(io_err(format!("mapping {}", path.display()))).map_err(unlink)?;
    // SAFETY: the mapping is page-aligned and geo.size > HEADER_BYTES long; the header is atomics.
    let h = unsafe { &*map.as_ptr().cast::<Header>() };
    h.creator_pid.store(std::process::id() as u64, Ordering::Relaxed);
    h.creator_start.store(self_start_time(), Ordering::Relaxed);
    h.version.store(VERSION, Ordering::Relaxed);
    h.config_hash.store(cfg.config_hash, Ordering::Relaxed);
    h.layout_hash.store(cfg.layout.hash(), Ordering::Relaxed);
    h.world.store(cfg.local_size as u64, Ordering::Relaxed);
    h.local_size.store(cfg.local_size as u64, Ordering::Relaxed);
    h.node_id.store(cfg.node_id as u64, Ordering::Relaxed);
    h.buckets.store(geo.buckets as u64, Ordering::Relaxed);
    h.len.store(cfg.layout.len as u64, Ordering::Relaxed);
    h.size.store(geo.size as u64, Ordering::Relaxed);
    h.values_hash.store(cfg.values.hash(), Ordering::Relaxed);
    // Everything else (cells, table, slots) is zero: fresh pages of a new file. Magic last.
    h.magic.store(MAGIC, Ordering::Release);
    Ok((file, map))
}

/// Attach to the segment of local rank 0 once it exists and is initialised, within the deadline.
pub(super) fn attach(cfg: &BusConfig, path: &Path, geo: &Geometry, start: Instant) -> Result<(File, MmapRaw), Error> {
    let bad = |reason: String, hint: &str| Error::BadSegment {
        path: path.display().to_string(),
        reason,
        hint: hint.to_string(),
    };
    let mut wait = Duration::from_micros(200);
    loop {
        match OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(path) {
            Ok(file) => {
                let len = file.metadata().map_err(io_err(format!("stat {}", path.display())))?.len() as usize;
                if len >= HEADER_BYTES {
                    let map = map_rw(&file).map_err(io_err(format!("mapping {}", path.display())))?;
                    // SAFETY: page-aligned mapping of len >= HEADER_BYTES bytes; header is atomics.
                    let h = unsafe { &*map.as_ptr().cast::<Header>() };
                    let magic = h.magic.load(Ordering::Acquire);
                    let creator_alive = || {
                        process_alive(h.creator_pid.load(Ordering::Relaxed), h.creator_start.load(Ordering::Relaxed))
                    };
                    if magic != 0 && magic != MAGIC {
                        return Err(bad(
                            format!("bad magic {magic:#018x}: not a gradbus segment"),
                            "another program uses this name under /dev/shm; remove the file or change the job id",
                        ));
                    }
                    // A stale segment of a dead creator is skipped: local rank 0 replaces it.
                    if magic == MAGIC && creator_alive() {
                        check_header(h, cfg, geo, len).map_err(|(r, hint)| bad(r, hint))?;
                        return Ok((file, map));
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(format!("opening {}", path.display()))(e)),
        }
        if start.elapsed() >= cfg.timeout {
            return Err(Error::Timeout {
                phase: "attach".into(),
                step: 0,
                bucket: None,
                missing: vec![0],
                secs: cfg.timeout.as_secs_f64(),
            });
        }
        std::thread::sleep(wait);
        wait = (wait * 2).min(Duration::from_millis(10));
    }
}

/// Whether an initialised header matches this rank's view of the job.
pub(super) fn check_header(
    h: &Header,
    cfg: &BusConfig,
    geo: &Geometry,
    len: usize,
) -> Result<(), (String, &'static str)> {
    let version = h.version.load(Ordering::Relaxed);
    if version != VERSION {
        return Err((
            format!("segment format version {version}, this binary speaks {VERSION}"),
            "every rank must run the same gradbus build",
        ));
    }
    let hash = h.config_hash.load(Ordering::Relaxed);
    if hash != cfg.config_hash {
        return Err((
            format!("config hash {hash:#018x} differs from this rank's {:#018x}", cfg.config_hash),
            "every rank must run with the same config and layout",
        ));
    }
    let lsize = h.local_size.load(Ordering::Relaxed);
    if lsize != cfg.local_size as u64 {
        return Err((
            format!("segment made for {lsize} local ranks, this rank expects {}", cfg.local_size),
            "every rank must be given the same local size",
        ));
    }
    let vhash = h.values_hash.load(Ordering::Relaxed);
    if vhash != cfg.values.hash() {
        return Err((
            format!("segment made for workload values {vhash:#018x}, this rank reports {:?}", cfg.values),
            "every rank must run the same workload (the same gradbus build)",
        ));
    }
    let lhash = h.layout_hash.load(Ordering::Relaxed);
    let size = h.size.load(Ordering::Relaxed);
    if lhash != cfg.layout.hash() || size != geo.size as u64 || len != geo.size {
        return Err((
            format!(
                "segment layout {lhash:#018x} of {size} bytes, this rank expects {:#018x} of {} bytes",
                cfg.layout.hash(),
                geo.size
            ),
            "every rank must build the same model layout (parameters and bucket size)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::WAKE_OFF;
    use super::*;

    #[test]
    pub(super) fn geometry_regions_are_ordered_aligned_and_disjoint() {
        for (n, b, len, v) in [(1, 1, 16, 0), (2, 3, 1000, 5), (4, 0, 0, 6), (8, 100, 1 << 20, 40)] {
            let g = Geometry::new(n, b, len, v);
            assert!(size_of::<Header>() <= WAKE_OFF);
            assert!(WAKE_OFF + size_of::<WakeLine>() <= HEADER_BYTES);
            assert_eq!(size_of::<RankCell>() % 128, 0);
            assert!(g.cells + n * size_of::<RankCell>() <= g.table);
            assert!(g.table + 2 * b * n * g.entry <= g.reports);
            assert!(g.report >= 8 * (2 + v) && g.report % 64 == 0);
            assert!(g.reports + 2 * n * g.report <= g.grads);
            assert!(g.slot_stride >= len * 4 && g.slot_stride % PAGE == 0);
            assert_eq!(g.grads % PAGE, 0);
            assert_eq!(g.size, g.grads + n * g.slot_stride);
        }
    }

    #[test]
    pub(super) fn job_ids_that_cannot_name_a_file_are_refused() {
        let d = Path::new("/dev/shm");
        assert!(check_job_id(d, "job-1_a.b").is_ok());
        for bad in ["", "a/b", "..\0", "a b"] {
            assert!(matches!(check_job_id(d, bad), Err(Error::BadSegment { .. })), "{bad:?}");
        }
    }
}
