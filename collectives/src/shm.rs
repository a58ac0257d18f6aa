//! The shared-memory bus: `ShmBus`, the `Transport` of the ranks of ONE node, over one segment
//! under `/dev/shm` per job and node.
//!
//! Every local rank's gradient buffer lives inside the segment, so backward writes straight onto the
//! bus. An all-reduce of a bucket is: barrier; rank `r` sums chunk `r` of the bucket over every
//! rank's slot in rank order 0..n-1 (`reduce_in_place`), tallying each source rank's health, and
//! writes the sum back into chunk `r` of every slot; barrier. Every element is summed by exactly one
//! process in one fixed order, so all ranks hold the same bits, run after run.
//!
//! ```text
//!   slot 0  [ c0 | c1 | c2 ]      rank 0 reduces column c0 of all slots  (0+1+2 in that order)
//!   slot 1  [ c0 | c1 | c2 ]      rank 1 reduces column c1, rank 2 column c2
//!   slot 2  [ c0 | c1 | c2 ]      barrier ... reduce my column ... barrier
//! ```
//!
//! Invariants:
//! - Between the two barriers of a bucket reduce, chunk `r` of every slot is touched by rank `r`
//!   only, and no borrow of that bucket's range is alive on any rank: every rank is inside
//!   `allreduce_bucket` (which borrows the bus mutably, so no `grads()` borrow is alive), and a
//!   backward that overlaps the reduce holds views of other buckets only (`overlap.rs`). That is
//!   what makes the raw slices sound.
//! - A barrier is a per-rank arrival counter: a rank's k-th barrier stores `k`, then waits until
//!   every counter is `>= k`. Each arrival also records what the rank was doing (phase, step,
//!   bucket); after the barrier every rank compares those tags and, on a mismatch, every rank fails
//!   with the same `Error::Mismatch` instead of summing the wrong buckets.
//! - A waiting rank spins briefly, then yields (ranks may outnumber cores: a spinning waiter
//!   steals the core of the rank it waits for), and after `YIELD_FOR` sleeps on a futex in the
//!   header that the rank completing the barrier wakes, so long waits cost no CPU.
//! - A waiting rank polls the liveness of the ranks it is waiting for: failed flag, departed flag,
//!   process gone (or a zombie). A dead peer ends the wait at once with `PeerFailed`; a live but
//!   stalled one with `Timeout` at the deadline. No rank waits forever. A rank that returns any
//!   error sets its failed flag, and every rank checks the flags after each barrier before it
//!   touches another rank's slot, so a late peer does not reduce into the slot of a rank that gave
//!   up (bar a flag set in the instant after that check: a failed rank's gradients are undefined).
//! - The health table and the reports are double-buffered by update parity (the count of `agree`
//!   calls). A rank writes the buffer of update `u + 2` only after a barrier of update `u + 1`, which
//!   every rank reaches only after it has read update `u`. So no rank overwrites what a slow rank
//!   still reads.
//! - The segment's magic is written last (Release); an attacher trusts nothing before it reads the
//!   magic (Acquire). The creator (local rank 0) unlinks the segment when dropped; a segment whose
//!   creator died is stale and replaced by the next creator; `remove_job_segments` is the launcher's
//!   sweep for the kill -9 case.
//!
//! Why not defer the second barrier of a reduce to `agree`: it would save one barrier per bucket,
//! but `grads()` hands out a `&mut [f32]` of the whole slot at any time, and a slow peer could still
//! be writing its chunk into it. Keeping the barrier keeps that borrow sound.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gradbus_kernels::{reduce_in_place, reduce_plain, reduce_to_one, Health};
use memmap2::{MmapOptions, MmapRaw};

use crate::layout::{Layout, ALIGN_FLOATS};
use crate::transport::{Progress, Transport};
use crate::verdict::{HealthTable, LocalReport, StepId};
use crate::Error;

/// "GRADBUS1" as a little-endian word: the first thing an attacher checks.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GRADBUS1");
/// Version of the segment format; bump on any change to the structures below.
pub const VERSION: u64 = 1;

/// Bytes reserved for the header.
const HEADER_BYTES: usize = 4096;
/// Segment regions start on page boundaries.
const PAGE: usize = 4096;

/// Offset of the wake line (futex word and sleeper count) inside the header page.
const WAKE_OFF: usize = 2048;
/// How long a waiter spins and yields before it sleeps on the futex.
const YIELD_FOR: Duration = Duration::from_millis(1);

/// Rank cell states (0: nobody attached yet).
const ST_ATTACHED: u64 = 1;
const ST_DEPARTED: u64 = 2;

/// Failed-flag values: why a rank stopped.
const FAIL_MARKED: u64 = 1;
const FAIL_ERROR: u64 = 2;

/// "No bucket" / "no first bad index" in a stored word.
const NONE: u64 = u64::MAX;

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
    /// Deadline of every wait (attach and each barrier).
    pub timeout: Duration,
}

impl BusConfig {
    /// A config with `shm_dir` = `/dev/shm`, node 0 and a 60 s timeout.
    pub fn new(job_id: impl Into<String>, local_rank: usize, local_size: usize, layout: Layout) -> BusConfig {
        BusConfig {
            shm_dir: PathBuf::from("/dev/shm"),
            job_id: job_id.into(),
            node_id: 0,
            local_rank,
            local_size,
            config_hash: layout.hash(),
            layout,
            timeout: Duration::from_secs(60),
        }
    }
}

/// The segment header. Only atomics: any bit pattern is valid and it is shared between processes.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU64,
    config_hash: AtomicU64,
    layout_hash: AtomicU64,
    creator_pid: AtomicU64,
    creator_start: AtomicU64,
    world: AtomicU64,
    local_size: AtomicU64,
    node_id: AtomicU64,
    buckets: AtomicU64,
    len: AtomicU64,
    size: AtomicU64,
}

/// Where waiters sleep: `seq` is a futex word bumped whenever a barrier may have completed (or a
/// rank failed or left); `sleepers` counts the waiters that may be asleep on it, so that an
/// arriving rank makes the wake-up system call only when someone sleeps.
#[repr(C, align(64))]
struct WakeLine {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

/// One rank's control block, on its own cache lines.
#[repr(C, align(128))]
struct RankCell {
    pid: AtomicU64,
    /// Process start time (clock ticks since boot, /proc/PID/stat field 22): tells pid reuse apart.
    start_time: AtomicU64,
    state: AtomicU64,
    failed: AtomicU64,
    /// The first barrier this rank will not pass, once failed.
    failed_at: AtomicU64,
    /// The rank this one blames for its failure (itself, or the peer that failed or stalled first).
    blame: AtomicU64,
    /// Number of barriers this rank has entered.
    arrive: AtomicU64,
    /// CLOCK_MONOTONIC nanoseconds of the last publish or barrier.
    heartbeat_ns: AtomicU64,
    /// Seqlock of the progress fields: odd while they are being written.
    seq: AtomicU64,
    step: AtomicU64,
    loss: AtomicU32,
    grad_norm: AtomicU32,
    skipped: AtomicU32,
    warnings: AtomicU32,
    /// What the rank was doing at its last two barriers (by barrier parity).
    tags: [[AtomicU64; 5]; 2],
}

/// A stored `Health`: nan, inf, sumsq bits, first bad (or `NONE`).
type HealthCell = [AtomicU64; 4];

/// Byte offsets of the regions of a segment, a pure function of (ranks, buckets, buffer length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    n: usize,
    buckets: usize,
    cells: usize,
    table: usize,
    /// Bytes of one (parity, bucket, reducer) entry: a stamp then n + 1 health cells.
    entry: usize,
    reports: usize,
    grads: usize,
    slot_stride: usize,
    size: usize,
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl Geometry {
    fn new(n: usize, buckets: usize, len: usize) -> Geometry {
        let cells = HEADER_BYTES;
        let table = round_up(cells + n * size_of::<RankCell>(), PAGE);
        let entry = round_up(8 + (n + 1) * size_of::<HealthCell>(), 64);
        let reports = round_up(table + 2 * buckets * n * entry, PAGE);
        let grads = round_up(reports + 2 * n * size_of::<LocalReport>(), PAGE);
        let slot_stride = round_up(len * 4, PAGE).max(PAGE);
        Geometry { n, buckets, cells, table, entry, reports, grads, slot_stride, size: grads + n * slot_stride }
    }
}

/// The element range of chunk `r` of `len` elements split among `n` reducers: cut into units of
/// `align` elements, the units dealt out as evenly as possible (the first `units % n` chunks get one
/// more), the last chunk holding the ragged end. Chunks are contiguous, ordered and cover `0..len`.
pub fn chunk_range(len: usize, n: usize, r: usize, align: usize) -> std::ops::Range<usize> {
    assert!(n > 0 && r < n && align > 0);
    let units = len.div_ceil(align);
    let (base, extra) = (units / n, units % n);
    let start = r * base + r.min(extra);
    let end = start + base + usize::from(r < extra);
    (start * align).min(len)..(end * align).min(len)
}

/// Nanoseconds of CLOCK_MONOTONIC (shared by every process of the machine): the clock of heartbeats.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU time consumed by the calling thread.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// State character and start time of a process, from `/proc/PID/stat`.
fn proc_stat(pid: u64) -> io::Result<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let mut it = rest.split_whitespace();
    let state = it.next().and_then(|f| f.chars().next()).unwrap_or('?');
    let start = it.nth(18).and_then(|f| f.parse().ok()).unwrap_or(0);
    Ok((state, start))
}

/// Whether process `pid` (started at `start`, 0 = unknown) still runs. A zombie counts as dead: a
/// killed rank stays a zombie until its parent reaps it, and must not look alive meanwhile.
fn process_alive(pid: u64, start: u64) -> bool {
    if pid == 0 || pid > i32::MAX as u64 {
        return false;
    }
    match proc_stat(pid) {
        Ok((state, st)) => !matches!(state, 'Z' | 'X' | 'x') && (start == 0 || st == 0 || st == start),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(_) => {
            // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
            let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
            r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
        }
    }
}

fn self_start_time() -> u64 {
    proc_stat(std::process::id() as u64).map(|(_, s)| s).unwrap_or(0)
}

/// Sixteen bytes of a phase name, as two words (longer names are cut).
fn phase_words(phase: &str) -> [u64; 2] {
    let mut b = [0u8; 16];
    let n = phase.len().min(16);
    b[..n].copy_from_slice(&phase.as_bytes()[..n]);
    [u64::from_le_bytes(b[..8].try_into().unwrap()), u64::from_le_bytes(b[8..].try_into().unwrap())]
}

/// The five words of a barrier tag: phase name, step, minibatch and attempt, bucket.
fn tag_words(phase: &str, at: StepId, bucket: Option<usize>) -> [u64; 5] {
    let [p0, p1] = phase_words(phase);
    [p0, p1, at.step, (at.minibatch as u64) << 32 | at.attempt as u64, bucket.map_or(NONE, |b| b as u64)]
}

fn describe_tag(t: &[u64; 5]) -> String {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&t[0].to_le_bytes());
    b[8..].copy_from_slice(&t[1].to_le_bytes());
    let name = String::from_utf8_lossy(&b).trim_end_matches('\0').to_string();
    let bucket = if t[4] == NONE { String::new() } else { format!(" bucket #{}", t[4]) };
    format!("{name} at step {} (minibatch {}, attempt {}){bucket}", t[2], t[3] >> 32, t[3] & 0xffff_ffff)
}

fn check_job_id(shm_dir: &Path, job_id: &str) -> Result<(), Error> {
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

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// Map a whole file shared read-write.
fn map_rw(file: &File) -> io::Result<MmapRaw> {
    MmapRaw::map_raw(file)
}

/// A read-only view of a segment that may or may not be initialised (peek, stale check).
struct Peek {
    map: MmapRaw,
}

impl Peek {
    fn open(path: &Path) -> Option<Peek> {
        let file = File::open(path).ok()?;
        let len = file.metadata().ok()?.len() as usize;
        if len < HEADER_BYTES {
            return None;
        }
        let map = MmapOptions::new().len(len).map_raw_read_only(&file).ok()?;
        Some(Peek { map })
    }
    fn header(&self) -> &Header {
        // SAFETY: the mapping is page-aligned and at least HEADER_BYTES >= size_of::<Header>() long
        // (checked in `open`); Header holds only atomics, valid for any bits, and we only load them.
        unsafe { &*self.map.as_ptr().cast::<Header>() }
    }
    fn initialised(&self) -> bool {
        self.header().magic.load(Ordering::Acquire) == MAGIC && self.header().version.load(Ordering::Relaxed) == VERSION
    }
    fn cells(&self) -> Option<&[RankCell]> {
        let n = self.header().local_size.load(Ordering::Relaxed) as usize;
        if n == 0 || n > 4096 || HEADER_BYTES + n * size_of::<RankCell>() > self.map.len() {
            return None;
        }
        // SAFETY: bounds checked just above; the cells start at HEADER_BYTES (a multiple of their
        // 128-byte alignment) and consist of atomics, valid for any bits; only loaded here.
        Some(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(HEADER_BYTES).cast::<RankCell>(), n) })
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

fn read_cell_progress(c: &RankCell) -> Progress {
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

/// The shared-memory bus of one rank.
pub struct ShmBus {
    cfg: BusConfig,
    path: PathBuf,
    geo: Geometry,
    map: MmapRaw,
    /// Kept open: its inode tells our segment apart from a later one with the same name.
    file: File,
    creator: bool,
    /// Whether this rank's cell is ours (claimed); Drop marks only a claimed cell departed.
    claimed: bool,
    /// Barriers entered so far (this rank's arrival counter).
    barriers: u64,
    /// `agree` calls so far: the update number, whose parity picks the table buffer.
    update: u64,
    /// Thread CPU time of this rank's last reduce phase (between the two barriers; no waiting in
    /// it), for the benchmark: unlike wall time it does not count preemption by other processes.
    pub(crate) last_reduce_cpu: Duration,
    /// Called inside every bucket reduce, after every rank entered it and before the sum is
    /// written (the fault plan's `reduce` phase: a rank that dies here dies mid-collective).
    inside_reduce: Option<Box<dyn FnMut(StepId, usize) + Send + Sync>>,
}

impl ShmBus {
    /// The segment of a job on a node: `{shm_dir}/gradbus-{job_id}-n{node_id}`.
    pub fn segment_path(shm_dir: &Path, job_id: &str, node_id: usize) -> PathBuf {
        shm_dir.join(format!("gradbus-{job_id}-n{node_id}"))
    }

    /// Open the bus: local rank 0 creates the segment (replacing a stale one), the others attach
    /// when it is initialised; then every local rank meets at the `attach` barrier. Fails within
    /// `cfg.timeout` if a rank does not come.
    pub fn open(cfg: BusConfig) -> Result<ShmBus, Error> {
        check_job_id(&cfg.shm_dir, &cfg.job_id)?;
        if cfg.local_size == 0 || cfg.local_rank >= cfg.local_size {
            return Err(Error::BadSegment {
                path: ShmBus::segment_path(&cfg.shm_dir, &cfg.job_id, cfg.node_id).display().to_string(),
                reason: format!("local rank {} of {} ranks", cfg.local_rank, cfg.local_size),
                hint: "local_rank must be below local_size".into(),
            });
        }
        let path = ShmBus::segment_path(&cfg.shm_dir, &cfg.job_id, cfg.node_id);
        let geo = Geometry::new(cfg.local_size, cfg.layout.buckets.len(), cfg.layout.len);
        let start = Instant::now();
        let (file, map, creator) = if cfg.local_rank == 0 {
            let (f, m) = create(&cfg, &path, &geo)?;
            (f, m, true)
        } else {
            let (f, m) = attach(&cfg, &path, &geo, start)?;
            (f, m, false)
        };
        let mut bus = ShmBus {
            cfg,
            path,
            geo,
            map,
            file,
            creator,
            claimed: false,
            barriers: 0,
            update: 0,
            last_reduce_cpu: Duration::ZERO,
            inside_reduce: None,
        };
        bus.claim_cell()?;
        bus.barrier("attach", StepId::default())?;
        Ok(bus)
    }

    /// The segment's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True for the rank that created (and will unlink) the segment.
    pub fn is_creator(&self) -> bool {
        self.creator
    }

    /// Wait until every local rank has entered this barrier (or fail: `Timeout` naming the missing
    /// ranks, `PeerFailed` as soon as one of them is dead or failed, `Mismatch` when the ranks are
    /// in different phases). For startup and shutdown; the collectives use it internally.
    pub fn barrier(&mut self, phase: &str, at: StepId) -> Result<(), Error> {
        self.barrier_tagged(phase, at, None)
    }

    fn wake_line(&self) -> &WakeLine {
        // SAFETY: WAKE_OFF + size_of::<WakeLine>() <= HEADER_BYTES, inside the mapping, 64-byte
        // aligned; two atomics, valid for any bits.
        unsafe { &*self.map.as_ptr().add(WAKE_OFF).cast::<WakeLine>() }
    }

    /// Bump the futex word and wake every sleeper (if any may sleep). Called when this rank's
    /// arrival completed a barrier, and when it fails or leaves.
    fn wake_all(&self) {
        let w = self.wake_line();
        w.seq.fetch_add(1, Ordering::SeqCst);
        if w.sleepers.load(Ordering::SeqCst) > 0 {
            // SAFETY: FUTEX_WAKE on a valid, 4-byte aligned word of a shared mapping; no other
            // memory is touched. Shared (not PRIVATE) futex: the waiters are other processes.
            unsafe { libc::syscall(libc::SYS_futex, w.seq.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
        }
    }

    /// Sleep until the futex word moves away from `seen` or `max` passes (spurious wake-ups are fine:
    /// the caller re-checks).
    fn futex_sleep(&self, seen: u32, max: Duration) {
        let ts = libc::timespec { tv_sec: max.as_secs() as libc::time_t, tv_nsec: max.subsec_nanos() as libc::c_long };
        // SAFETY: FUTEX_WAIT on a valid, 4-byte aligned word of a shared mapping with a valid
        // relative timeout; it returns at once if the word no longer holds `seen`.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.wake_line().seq.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                0usize,
                0u32,
            )
        };
    }

    fn all_arrived(&self, k: u64) -> bool {
        (0..self.geo.n).all(|j| self.cell(j).arrive.load(Ordering::SeqCst) >= k)
    }

    fn cell(&self, k: usize) -> &RankCell {
        assert!(k < self.geo.n);
        // SAFETY: cell k lies in [cells, table) inside the mapping (Geometry), at an offset that is a
        // multiple of 128 (its alignment); it holds only atomics (plus padding never read).
        unsafe { &*self.map.as_ptr().add(self.geo.cells + k * size_of::<RankCell>()).cast::<RankCell>() }
    }

    fn entry(&self, parity: u64, bucket: usize, reducer: usize) -> (&AtomicU64, &[HealthCell]) {
        let g = &self.geo;
        assert!(bucket < g.buckets && reducer < g.n);
        let idx = (parity as usize * g.buckets + bucket) * g.n + reducer;
        // SAFETY: entry idx < 2 * buckets * n lies in [table, reports) (Geometry); it is 64-byte
        // aligned and holds a stamp word then n + 1 cells of 4 words, all atomics.
        unsafe {
            let p = self.map.as_ptr().add(g.table + idx * g.entry);
            (&*p.cast::<AtomicU64>(), std::slice::from_raw_parts(p.add(8).cast::<HealthCell>(), g.n + 1))
        }
    }

    fn report_cell(&self, parity: u64, k: usize) -> &[AtomicU64; 8] {
        assert!(k < self.geo.n);
        // SAFETY: report (parity, k) lies in [reports, grads) (Geometry), 8-byte aligned, 8 atomics.
        unsafe { &*self.map.as_ptr().add(self.geo.reports + (parity as usize * self.geo.n + k) * 64).cast() }
    }

    /// Start of rank k's gradient slot.
    fn slot_ptr(&self, k: usize) -> *mut f32 {
        assert!(k < self.geo.n);
        // SAFETY: slot k lies in [grads + k * stride, grads + (k + 1) * stride) inside the mapping.
        unsafe { self.map.as_mut_ptr().add(self.geo.grads + k * self.geo.slot_stride).cast::<f32>() }
    }

    fn claim_cell(&mut self) -> Result<(), Error> {
        let me = std::process::id() as u64;
        let c = self.cell(self.cfg.local_rank);
        if let Err(other) = c.pid.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
            return Err(Error::BadSegment {
                path: self.path.display().to_string(),
                reason: format!("local rank {} is already attached by pid {other}", self.cfg.local_rank),
                hint: "two processes were given the same local rank; check the launch".into(),
            });
        }
        c.start_time.store(self_start_time(), Ordering::Relaxed);
        c.heartbeat_ns.store(monotonic_ns(), Ordering::Relaxed);
        c.state.store(ST_ATTACHED, Ordering::Release);
        self.claimed = true;
        Ok(())
    }

    /// Barrier with a tag naming what this rank is doing; see `barrier`.
    fn barrier_tagged(&mut self, phase: &str, at: StepId, bucket: Option<usize>) -> Result<(), Error> {
        let k = self.barriers + 1;
        self.barriers = k;
        let me = self.cfg.local_rank;
        let tag = tag_words(phase, at, bucket);
        {
            let c = self.cell(me);
            for (w, v) in c.tags[(k % 2) as usize].iter().zip(tag) {
                w.store(v, Ordering::Relaxed);
            }
            c.heartbeat_ns.store(monotonic_ns(), Ordering::Relaxed);
            // SeqCst pairs with the failed-flag protocol and the futex protocol in `wait_all`.
            c.arrive.store(k, Ordering::SeqCst);
        }
        if self.all_arrived(k) {
            self.wake_all();
        }
        // Tags before failed flags: a mismatch is seen by every rank alike, even though the first
        // rank to see it sets its failed flag.
        let r = self
            .wait_all(k, phase, at, bucket)
            .and_then(|()| self.check_tags(k, &tag))
            .and_then(|()| self.check_no_failed(k, phase, at, bucket));
        if let Err(e) = &r {
            let blame = match e {
                Error::PeerFailed { rank, .. } => *rank,
                Error::Timeout { missing, .. } => missing.first().copied().unwrap_or(me),
                _ => me,
            };
            self.set_failed(FAIL_ERROR, k, blame);
        }
        r
    }

    /// Raise this rank's failed flag: it will not pass barrier `at_barrier`, because of `blame`.
    fn set_failed(&self, reason: u64, at_barrier: u64, blame: usize) {
        let c = self.cell(self.cfg.local_rank);
        c.failed_at.store(at_barrier, Ordering::Relaxed);
        c.blame.store(blame as u64, Ordering::Relaxed);
        c.failed.store(reason, Ordering::SeqCst);
        self.wake_all();
    }

    /// The rank to name when rank `j` has failed: the root cause it recorded, unless that is us.
    fn culprit(&self, j: usize) -> usize {
        let blame = self.cell(j).blame.load(Ordering::Relaxed) as usize;
        if blame < self.geo.n && blame != self.cfg.local_rank {
            blame
        } else {
            j
        }
    }

    /// Wait until every rank's arrival counter is at least `k`.
    fn wait_all(&self, k: u64, phase: &str, at: StepId, bucket: Option<usize>) -> Result<(), Error> {
        let n = self.geo.n;
        let start = Instant::now();
        let deadline = start + self.cfg.timeout;
        let mut next_check = start;
        let mut spins = 0u32;
        let mut first_missing = 0;
        loop {
            // Resume the scan at the first rank that was missing last time.
            while first_missing < n && self.cell(first_missing).arrive.load(Ordering::SeqCst) >= k {
                first_missing += 1;
            }
            if first_missing == n {
                return Ok(());
            }
            spins += 1;
            if spins < 200 {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now >= next_check {
                next_check = now + Duration::from_millis(2);
                for j in first_missing..n {
                    let c = self.cell(j);
                    if c.arrive.load(Ordering::SeqCst) >= k {
                        continue;
                    }
                    let pid = c.pid.load(Ordering::Acquire);
                    let state = c.state.load(Ordering::Acquire);
                    if c.failed.load(Ordering::SeqCst) != 0 {
                        return Err(self.peer_failed(self.culprit(j), phase, at, bucket));
                    }
                    let gone = state == ST_DEPARTED
                        || (state == ST_ATTACHED && !process_alive(pid, c.start_time.load(Ordering::Relaxed)));
                    if gone {
                        return Err(self.peer_failed(j, phase, at, bucket));
                    }
                }
                if now >= deadline {
                    let missing =
                        (0..n).filter(|&j| self.cell(j).arrive.load(Ordering::SeqCst) < k).collect::<Vec<_>>();
                    if missing.is_empty() {
                        continue;
                    }
                    return Err(Error::Timeout {
                        phase: phase.to_string(),
                        step: at.step,
                        bucket,
                        missing,
                        secs: self.cfg.timeout.as_secs_f64(),
                    });
                }
            }
            // Spin briefly, then yield: ranks may outnumber cores, and a spinning waiter would
            // steal the core of the rank it waits for. Then sleep on the futex until the rank
            // that completes the barrier wakes us (or the next liveness check is due).
            if now.duration_since(start) < YIELD_FOR {
                // SAFETY: sched_yield has no preconditions.
                unsafe { libc::sched_yield() };
            } else {
                // Futex protocol: announce the sleeper, read the word, re-check the arrivals, then
                // sleep only if the word is unchanged. An arrival that completes the barrier
                // bumps the word after its SeqCst store; if our re-check missed that store, our
                // read of the word came before the bump, so the sleep returns at once or is woken.
                let w = self.wake_line();
                w.sleepers.fetch_add(1, Ordering::SeqCst);
                let seen = w.seq.load(Ordering::SeqCst);
                if !self.all_arrived(k) {
                    let max = next_check.min(deadline).saturating_duration_since(Instant::now());
                    self.futex_sleep(seen, max.max(Duration::from_micros(10)));
                }
                w.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// After barrier `k`: a rank that gave up in it (it arrived, then failed before passing) is not
    /// taking part in the reduce we are about to run; stop instead of writing into its slot. A rank
    /// that failed at a LATER barrier passed this one and is no reason to stop here (the next
    /// barrier names the real culprit).
    fn check_no_failed(&self, k: u64, phase: &str, at: StepId, bucket: Option<usize>) -> Result<(), Error> {
        for j in 0..self.geo.n {
            let c = self.cell(j);
            if j != self.cfg.local_rank
                && c.failed.load(Ordering::SeqCst) != 0
                && c.failed_at.load(Ordering::Relaxed) <= k
            {
                return Err(self.peer_failed(self.culprit(j), phase, at, bucket));
            }
        }
        Ok(())
    }

    fn peer_failed(&self, rank: usize, phase: &str, at: StepId, bucket: Option<usize>) -> Error {
        let phase = match bucket {
            Some(b) => format!("{phase} (bucket #{b})"),
            None => phase.to_string(),
        };
        Error::PeerFailed { rank, phase, step: at.step }
    }

    /// Every rank compares every rank's tag of barrier `k`: all see the same tags, so all fail alike.
    fn check_tags(&self, k: u64, mine: &[u64; 5]) -> Result<(), Error> {
        for j in 0..self.geo.n {
            let t: [u64; 5] = std::array::from_fn(|i| self.cell(j).tags[(k % 2) as usize][i].load(Ordering::Relaxed));
            if &t != mine {
                return Err(Error::Mismatch { rank: j, theirs: describe_tag(&t), mine: describe_tag(mine) });
            }
        }
        Ok(())
    }

    /// The all-reduce of one bucket; `validate` = false skips the health tallies (for the benchmark's
    /// measurement of what validation costs).
    pub(crate) fn allreduce_bucket_with(&mut self, at: StepId, bucket: usize, validate: bool) -> Result<(), Error> {
        self.reduce_bucket(at, bucket, validate, None)
    }

    /// The first half of a hierarchical all-reduce: the same validated, rank-ordered reduce as
    /// `allreduce_bucket` (same tallies, so `agree` reports every local rank's health), but the sum
    /// is written into `root`'s slot only; the other slots keep their local gradients. After it
    /// returns, no peer touches `root`'s slot until the next collective, so `root` may work on its
    /// bucket (e.g. all-reduce it between nodes) and then `broadcast_bucket` it.
    pub fn reduce_bucket_to(&mut self, at: StepId, bucket: usize, root: usize) -> Result<(), Error> {
        assert!(root < self.geo.n, "root {root} of {} local ranks", self.geo.n);
        self.reduce_bucket(at, bucket, true, Some(root))
    }

    /// Copy one bucket of `root`'s slot into every local slot: barrier; rank `r` copies chunk `r`
    /// of the bucket from `root`'s slot into the other slots; barrier. The second half of a
    /// hierarchical all-reduce (after `reduce_bucket_to` and the exchange between nodes).
    pub fn broadcast_bucket(&mut self, at: StepId, bucket: usize, root: usize) -> Result<(), Error> {
        let n = self.geo.n;
        assert!(root < n, "root {root} of {n} local ranks");
        let me = self.cfg.local_rank;
        let range = self.cfg.layout.buckets[bucket].range.clone();
        let chunk = chunk_range(range.len(), n, me, ALIGN_FLOATS);
        self.barrier_tagged("bcast", at, Some(bucket))?;
        let lo = range.start + chunk.start;
        // SAFETY: as in `reduce_bucket`: between these two barriers every rank is inside this call
        // (no borrow of this bucket's range is alive), and elements `lo..lo + chunk.len()` of every slot are
        // touched by this rank only (the chunks of `chunk_range` are disjoint). The source (root's
        // slot) and the destinations are distinct slots, which do not overlap.
        unsafe {
            let src = std::slice::from_raw_parts(self.slot_ptr(root).add(lo), chunk.len());
            for k in (0..n).filter(|&k| k != root) {
                std::slice::from_raw_parts_mut(self.slot_ptr(k).add(lo), chunk.len()).copy_from_slice(src);
            }
        }
        self.barrier_tagged("bcasted", at, Some(bucket))
    }

    /// Reduce one bucket: barrier, sum my chunk over every slot in rank order, write the sum into
    /// every slot (`to` = None) or into slot `to` only, barrier.
    fn reduce_bucket(&mut self, at: StepId, bucket: usize, validate: bool, to: Option<usize>) -> Result<(), Error> {
        let n = self.geo.n;
        let me = self.cfg.local_rank;
        let range = self.cfg.layout.buckets[bucket].range.clone();
        let chunk = chunk_range(range.len(), n, me, ALIGN_FLOATS);
        self.barrier_tagged("reduce", at, Some(bucket))?;
        if let Some(hook) = self.inside_reduce.as_mut() {
            hook(at, bucket);
        }
        let lo = range.start + chunk.start;
        // SAFETY: every rank has entered this reduce (barrier above) and none leaves it before the
        // barrier below, so no rank holds a borrow of this bucket's range (module invariants).
        // Between the two barriers, elements
        // `lo..lo + chunk.len()` of every slot are read and written by this rank only: the other
        // reducers own the other chunks of `chunk_range`, which are disjoint. Slots are disjoint
        // (`slot_stride >= len * 4`) and `range.end <= layout.len`, so the n slices do not overlap
        // and lie inside the mapping, f32-aligned.
        let mut slices: Vec<&mut [f32]> =
            (0..n).map(|k| unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(k).add(lo), chunk.len()) }).collect();
        let t0 = thread_cpu_time();
        if validate {
            let mut tally = vec![Health::default(); n];
            let sum = match to {
                None => reduce_in_place(&mut slices, &mut tally),
                Some(root) => reduce_to_one(&mut slices, &mut tally, root),
            };
            drop(slices);
            let (stamp, cells) = self.entry(self.update % 2, bucket, me);
            for (cell, h) in cells.iter().zip(tally.iter().chain([&sum])) {
                store_health(cell, h);
            }
            stamp.store(self.update + 1, Ordering::Relaxed);
        } else {
            reduce_plain(&mut slices);
        }
        self.last_reduce_cpu = thread_cpu_time().saturating_sub(t0);
        self.barrier_tagged("reduced", at, Some(bucket))
    }
}

fn store_health(cell: &HealthCell, h: &Health) {
    cell[0].store(h.nan, Ordering::Relaxed);
    cell[1].store(h.inf, Ordering::Relaxed);
    cell[2].store(h.sumsq.to_bits(), Ordering::Relaxed);
    cell[3].store(h.first_bad.unwrap_or(NONE), Ordering::Relaxed);
}

fn load_health(cell: &HealthCell) -> Health {
    let first = cell[3].load(Ordering::Relaxed);
    Health {
        nan: cell[0].load(Ordering::Relaxed),
        inf: cell[1].load(Ordering::Relaxed),
        sumsq: f64::from_bits(cell[2].load(Ordering::Relaxed)),
        first_bad: (first != NONE).then_some(first),
    }
}

/// Create the segment (local rank 0), replacing a stale one of a dead creator.
fn create(cfg: &BusConfig, path: &Path, geo: &Geometry) -> Result<(File, MmapRaw), Error> {
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
    // Everything else (cells, table, slots) is zero: fresh pages of a new file. Magic last.
    h.magic.store(MAGIC, Ordering::Release);
    Ok((file, map))
}

/// Attach to the segment of local rank 0 once it exists and is initialised, within the deadline.
fn attach(cfg: &BusConfig, path: &Path, geo: &Geometry, start: Instant) -> Result<(File, MmapRaw), Error> {
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
fn check_header(h: &Header, cfg: &BusConfig, geo: &Geometry, len: usize) -> Result<(), (String, &'static str)> {
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

// SAFETY: the slot lies in the mapping for the bus's lifetime; reduces and broadcasts slice only
// their bucket's chunk (`reduce_bucket`, `broadcast_bucket`).
unsafe impl Transport for ShmBus {
    fn rank(&self) -> usize {
        self.cfg.local_rank
    }

    fn world(&self) -> usize {
        self.cfg.local_size
    }

    fn layout(&self) -> &Layout {
        &self.cfg.layout
    }

    fn health_chunks(&self) -> usize {
        self.cfg.local_size
    }

    fn grads_ptr(&mut self) -> *mut f32 {
        // This rank's slot: `layout.len` f32s inside the mapping, page-aligned. Peers write into it
        // only between the two barriers of a bucket reduce, and only that bucket's range, while
        // this rank is inside `allreduce_bucket` too; see the module invariants.
        self.slot_ptr(self.cfg.local_rank)
    }

    fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
        self.allreduce_bucket_with(at, bucket, true)
    }

    fn set_inside_reduce_hook(&mut self, hook: Box<dyn FnMut(StepId, usize) + Send + Sync>) {
        self.inside_reduce = Some(hook);
    }

    fn agree(&mut self, at: StepId, local: LocalReport) -> Result<HealthTable, Error> {
        let (n, me, parity) = (self.geo.n, self.cfg.local_rank, self.update % 2);
        let words = [
            local.loss,
            local.values[0],
            local.values[1],
            local.values[2],
            local.values[3],
            local.values[4],
            local.values[5],
            local.values[6],
        ];
        for (w, v) in self.report_cell(parity, me).iter().zip(words) {
            w.store(v.to_bits(), Ordering::Relaxed);
        }
        self.barrier_tagged("agree", at, None)?;
        let stamp_now = self.update + 1;
        let nb = self.geo.buckets;
        let mut table = HealthTable {
            world: n,
            buckets: nb,
            local: vec![Health::default(); nb * n],
            reduced: vec![Health::default(); nb],
            reports: Vec::with_capacity(n),
        };
        for b in 0..nb {
            let len = self.cfg.layout.buckets[b].range.len();
            // Chunks in increasing offset order: a fixed order of the f64 sums on every rank.
            for r in 0..n {
                let (stamp, cells) = self.entry(parity, b, r);
                if stamp.load(Ordering::Relaxed) != stamp_now {
                    continue; // bucket not reduced in this update: nothing to report
                }
                let off = chunk_range(len, n, r, ALIGN_FLOATS).start as u64;
                for k in 0..n {
                    table.local[b * n + k].merge(&load_health(&cells[k]), off);
                }
                table.reduced[b].merge(&load_health(&cells[n]), off);
            }
        }
        for k in 0..n {
            let w = self.report_cell(parity, k);
            let f = |i: usize| f64::from_bits(w[i].load(Ordering::Relaxed));
            table.reports.push(LocalReport { loss: f(0), values: std::array::from_fn(|i| f(i + 1)) });
        }
        self.update += 1;
        Ok(table)
    }

    fn publish(&mut self, p: Progress) {
        let c = self.cell(self.cfg.local_rank);
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

    fn mark_failed(&mut self) {
        // It passed its last barrier; it will not pass the next one.
        self.set_failed(FAIL_MARKED, self.barriers + 1, self.cfg.local_rank);
    }
}

impl Drop for ShmBus {
    fn drop(&mut self) {
        // Peers still waiting for this rank fail at once instead of at the deadline.
        if self.claimed {
            self.cell(self.cfg.local_rank).state.store(ST_DEPARTED, Ordering::SeqCst);
            self.wake_all();
        }
        if self.creator {
            // Unlink only if the name still points at OUR segment (same inode).
            let ours = self.file.metadata().ok().map(|m| (m.dev(), m.ino()));
            let there = std::fs::metadata(&self.path).ok().map(|m| (m.dev(), m.ino()));
            if ours.is_some() && ours == there {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    log::warn!("{}: cannot remove the bus segment: {e}", self.path.display());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_in_order_and_differ_by_at_most_one_unit() {
        for len in [0, 1, 2, 15, 16, 17, 31, 33, 100, 1000, 4099] {
            for n in 1..=5 {
                for align in [1, 16] {
                    let mut at = 0;
                    let mut sizes = Vec::new();
                    for r in 0..n {
                        let c = chunk_range(len, n, r, align);
                        assert_eq!(c.start, at, "len {len} n {n} align {align} r {r}");
                        assert!(c.start <= c.end);
                        at = c.end;
                        sizes.push(c.len());
                        if c.end < len {
                            assert_eq!(c.end % align, 0, "inner cuts on unit boundaries");
                        }
                    }
                    assert_eq!(at, len, "chunks cover the range");
                    let units = len.div_ceil(align);
                    let max = sizes.iter().max().unwrap();
                    assert!(*max <= units.div_ceil(n) * align, "len {len} n {n} align {align}: {sizes:?}");
                }
            }
        }
    }

    #[test]
    fn chunks_of_small_ranges() {
        assert_eq!(chunk_range(1, 3, 0, 1), 0..1);
        assert_eq!(chunk_range(1, 3, 1, 1), 1..1);
        assert_eq!(chunk_range(1, 3, 2, 1), 1..1);
        assert_eq!(chunk_range(0, 2, 1, 16), 0..0);
        assert_eq!(chunk_range(10, 3, 0, 1), 0..4);
        assert_eq!(chunk_range(10, 3, 1, 1), 4..7);
        assert_eq!(chunk_range(10, 3, 2, 1), 7..10);
        assert_eq!(chunk_range(48, 2, 1, 16), 32..48);
    }

    #[test]
    fn geometry_regions_are_ordered_aligned_and_disjoint() {
        for (n, b, len) in [(1, 1, 16), (2, 3, 1000), (4, 0, 0), (8, 100, 1 << 20)] {
            let g = Geometry::new(n, b, len);
            assert!(size_of::<Header>() <= WAKE_OFF);
            assert!(WAKE_OFF + size_of::<WakeLine>() <= HEADER_BYTES);
            assert_eq!(size_of::<RankCell>() % 128, 0);
            assert!(g.cells + n * size_of::<RankCell>() <= g.table);
            assert!(g.table + 2 * b * n * g.entry <= g.reports);
            assert!(g.reports + 2 * n * 64 <= g.grads);
            assert!(g.slot_stride >= len * 4 && g.slot_stride % PAGE == 0);
            assert_eq!(g.grads % PAGE, 0);
            assert_eq!(g.size, g.grads + n * g.slot_stride);
        }
    }

    #[test]
    fn tags_describe_themselves() {
        let t = tag_words("reduce", StepId { step: 7, minibatch: 2, attempt: 1 }, Some(3));
        assert_eq!(describe_tag(&t), "reduce at step 7 (minibatch 2, attempt 1) bucket #3");
        assert_ne!(t, tag_words("reduced", StepId { step: 7, minibatch: 2, attempt: 1 }, Some(3)));
    }

    #[test]
    fn plain_reduce_matches_validated_reduce() {
        let mut rng = gradbus_kernels::rng::Rng::new(&[1, 2]);
        let mut a: Vec<Vec<f32>> = (0..3).map(|_| (0..2500).map(|_| rng.normal()).collect()).collect();
        let mut b = a.clone();
        let mut tally = vec![Health::default(); 3];
        reduce_in_place(&mut a.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>(), &mut tally);
        reduce_plain(&mut b.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>());
        let bits = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }

    #[test]
    fn reduce_to_one_matches_reduce_in_place_in_the_root_and_leaves_the_others() {
        let mut rng = gradbus_kernels::rng::Rng::new(&[3, 4]);
        let mut a: Vec<Vec<f32>> = (0..3).map(|_| (0..2500).map(|_| rng.normal()).collect()).collect();
        a[2][1700] = f32::NAN;
        let orig = a.clone();
        let mut b = a.clone();
        let (mut ta, mut tb) = (vec![Health::default(); 3], vec![Health::default(); 3]);
        let sa = reduce_in_place(&mut a.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>(), &mut ta);
        let sb = reduce_to_one(&mut b.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>(), &mut tb, 1);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a[1]), bits(&b[1]), "the root holds the same sum");
        assert_eq!(bits(&b[0]), bits(&orig[0]), "other slots keep their gradients");
        assert_eq!(bits(&b[2]), bits(&orig[2]));
        assert_eq!(ta, tb);
        assert_eq!(format!("{sa:?}"), format!("{sb:?}"));
        assert_eq!(tb[2].first_bad, Some(1700));
    }

    #[test]
    fn job_ids_that_cannot_name_a_file_are_refused() {
        let d = Path::new("/dev/shm");
        assert!(check_job_id(d, "job-1_a.b").is_ok());
        for bad in ["", "a/b", "..\0", "a b"] {
            assert!(matches!(check_job_id(d, bad), Err(Error::BadSegment { .. })), "{bad:?}");
        }
    }

    #[test]
    fn liveness_of_self_and_of_a_reaped_child() {
        assert!(process_alive(std::process::id() as u64, self_start_time()));
        assert!(!process_alive(std::process::id() as u64, self_start_time() + 1), "pid reuse is told apart");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as u64;
        // Not reaped yet: a zombie once it exits; dead either way after the wait.
        child.wait().unwrap();
        assert!(!process_alive(pid, 0));
        assert!(!process_alive(0, 0));
    }
}
