//! The all-reduce benchmark behind `gradbus bench allreduce`: N processes on one node, one `ShmBus`,
//! one bucket per message size, nccl-tests-like figures, plus the two ceilings the bus is judged
//! against - a single-thread memcpy of the same bytes, and a plain read of them - and the cost of
//! the fused validation (the same reduce with and without the per-rank health tallies).
//!
//! Every rank runs `rank_main` with the same arguments but its own rank; rank 0 returns the rows.
//! Each rank fills its slot with `rank + 1`, so every reduced element must equal `n(n+1)/2`
//! exactly (`wrong` counts those that do not, over all ranks). Times are those of rank 0, each the
//! average of `iters` back-to-back all-reduces (barrier, reduce, barrier: the time until every rank
//! is done), the best of `ROUNDS` rounds. A benchmark, not a test: it prints numbers.
//!
//! How `gradbus bench allreduce --np N --sizes 1MiB,64MiB [--iters K] [--json]` drives it: pick a
//! job id unique on the machine (e.g. `bench-{pid}`), parse the sizes with `parse_sizes`, start N
//! processes (e.g. the same binary with a hidden per-rank subcommand) that each call
//! `rank_main(BenchArgs { rank, np: N, job_id, sizes, iters: K, ..BenchArgs::new(..) })`; rank 0
//! prints `format_table(&rows)` or `json_lines(&rows)`. A non-zero exit of any rank fails the
//! benchmark; afterwards call `shm::remove_job_segments("/dev/shm", job_id)` in case a rank was
//! killed. The segment holds every size at once: N x (sum of sizes) bytes of /dev/shm.
//! With `BenchTransport::Mpi` (feature `mpi`, every process started by `mpirun`), each size is also
//! all-reduced with Open MPI's (or MPICH's) `MPI_Allreduce` over the same processes in the same run,
//! into the `mpi_*` columns, so the bus and MPI are compared side by side:
//! `mpirun --allow-run-as-root --bind-to none -np 2 gradbus worker --bench-allreduce --transport mpi
//! --sizes 64MiB`. `BenchTransport::Hier` adds the hierarchical transport (shm inside
//! each of `nodes` fake nodes, MPI between their leaders, shm broadcast; validated, like the bus) in a
//! `hier` column: `... --transport hier --nodes 2`.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gradbus_kernels::{health_scan, reduce_plain};
use serde::Serialize;

use crate::agreement::LocalScalars;
use crate::layout::{Fnv, Layout, ParamSpec};
use crate::shm::{BusConfig, ShmBus};
use crate::transport::Transport;
use crate::verdict::StepId;
use crate::Error;

/// Timed rounds per size (the best round is reported).
const ROUNDS: usize = 3;
/// Barriers timed for `barrier_us`.
const BARRIERS: usize = 2000;
/// Repetitions of the single-process ceilings (memcpy, scan, read); the best is reported.
const CEILING_REPS: usize = 5;

/// What one benchmark process is told.
#[derive(Clone, Debug)]
pub struct BenchArgs {
    /// This process's rank, 0..np.
    pub rank: usize,
    /// Number of processes.
    pub np: usize,
    /// Job id, the same for all processes of one benchmark (names the shm segment).
    pub job_id: String,
    /// Message sizes in bytes (multiples of 4).
    pub sizes: Vec<usize>,
    /// Timed all-reduces per round.
    pub iters: usize,
    /// Untimed all-reduces before timing each size.
    pub warmup: usize,
    /// Where the segment lives (`/dev/shm`).
    pub shm_dir: PathBuf,
    /// Deadline of every barrier.
    pub timeout: Duration,
    /// What to measure besides the shm bus.
    pub transport: BenchTransport,
    /// `BenchTransport::Hier`: fake nodes the ranks are split into (contiguous ranks per node).
    pub nodes: usize,
}

/// What the benchmark measures besides the shared-memory bus.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BenchTransport {
    /// The bus only.
    #[default]
    Shm,
    /// The bus, and `MPI_Allreduce` of the same sizes over the same processes (feature `mpi`, the
    /// processes started by `mpirun`).
    Mpi,
    /// As `Mpi`, plus the hierarchical transport with the ranks split into `BenchArgs::nodes` nodes.
    Hier,
}

impl std::str::FromStr for BenchTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<BenchTransport, String> {
        match s {
            "shm" => Ok(BenchTransport::Shm),
            "mpi" => Ok(BenchTransport::Mpi),
            "hier" => Ok(BenchTransport::Hier),
            _ => Err(format!("transport {s:?}: expected shm, mpi or hier")),
        }
    }
}

impl std::fmt::Display for BenchTransport {
    /// The name `FromStr` reads back (`shm`, `mpi`, `hier`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BenchTransport::Shm => "shm",
            BenchTransport::Mpi => "mpi",
            BenchTransport::Hier => "hier",
        })
    }
}

impl BenchArgs {
    /// Defaults: 20 iterations, 3 warm-up, `/dev/shm`, 120 s deadline.
    pub fn new(rank: usize, np: usize, job_id: impl Into<String>, sizes: Vec<usize>) -> BenchArgs {
        BenchArgs {
            rank,
            np,
            job_id: job_id.into(),
            sizes,
            iters: 20,
            warmup: 3,
            shm_dir: PathBuf::from("/dev/shm"),
            timeout: Duration::from_secs(120),
            transport: BenchTransport::Shm,
            nodes: 2,
        }
    }
}

/// One line of results (rank 0).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchRow {
    /// Bytes per rank.
    pub size_bytes: u64,
    /// Elements per rank.
    pub count: u64,
    /// Element type (`float`).
    #[serde(rename = "type")]
    pub dtype: String,
    /// Reduction (`sum`).
    pub redop: String,
    /// Processes.
    pub np: usize,
    /// All-reduce time with the fused validation (microseconds).
    pub time_us: f64,
    /// `size_bytes / time`, GB/s (1e9 bytes).
    pub algbw_gbps: f64,
    /// `algbw * 2(n-1)/n`, GB/s.
    pub busbw_gbps: f64,
    /// Elements differing from the closed-form sum, over all ranks (and both transports).
    pub wrong: u64,
    /// Single-thread memcpy of `size_bytes`, GB/s.
    pub memcpy_gbps: f64,
    /// The fused health scan (NaN/Inf counts, f64 sum of squares) over `size_bytes`, GB/s.
    pub scan_gbps: f64,
    /// A plain read (vectorized f32 sum) of `size_bytes`, GB/s.
    pub read_gbps: f64,
    /// The same all-reduce without the health tallies (microseconds).
    pub plain_time_us: f64,
    /// What validation adds: `(time_us - plain_time_us) / plain_time_us`, percent.
    pub validation_pct: f64,
    /// Rank 0's reduce phase alone (no barriers), in thread CPU time (not counting preemption by
    /// other processes), fastest iteration, with validation (us).
    pub reduce_min_us: f64,
    /// The same without validation (us).
    pub plain_reduce_min_us: f64,
    /// One empty barrier of all ranks (microseconds, average of `BARRIERS`), measured once.
    pub barrier_us: f64,
    /// `MPI_Allreduce` of the same bytes over the same processes (microseconds), with
    /// `BenchTransport::Mpi`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mpi_time_us: Option<f64>,
    /// `size_bytes / mpi_time`, GB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mpi_algbw_gbps: Option<f64>,
    /// The hierarchical transport's validated all-reduce (microseconds), with `BenchTransport::Hier`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hier_time_us: Option<f64>,
}

/// Parse a size such as `1MiB`, `64M`, `4KiB`, `1GiB`, `4096` (binary units; `kB`/`MB`/`GB` are
/// decimal). Must be a positive multiple of 4 bytes (whole floats).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize =
        num.parse().map_err(|_| format!("size {s:?}: expected a number with an optional unit (e.g. 64MiB)"))?;
    let mult: usize = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        u => return Err(format!("size {s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB)")),
    };
    let bytes = n.checked_mul(mult).ok_or_else(|| format!("size {s:?} is too large"))?;
    if bytes == 0 || bytes % 4 != 0 {
        return Err(format!("size {s:?} = {bytes} bytes: must be a positive multiple of 4 (whole floats)"));
    }
    Ok(bytes)
}

/// Parse a comma-separated list of sizes.
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    s.split(',').filter(|p| !p.trim().is_empty()).map(parse_size).collect()
}

/// The layout of the benchmark: one parameter (and so one bucket) per size.
fn bench_layout(sizes: &[usize]) -> Layout {
    let specs: Vec<_> = sizes.iter().enumerate().map(|(i, &b)| ParamSpec::new(format!("size{i}"), b / 4)).collect();
    Layout::new(&specs, 0)
}

/// Run one benchmark process; rank 0 returns the rows, the others `None`. Every process must be
/// given the same arguments except `rank`.
pub fn rank_main(args: BenchArgs) -> Result<Option<Vec<BenchRow>>, Error> {
    let layout = bench_layout(&args.sizes);
    let mut h = Fnv::default();
    h.write(b"gradbus bench allreduce");
    h.write(&layout.hash().to_le_bytes());
    h.write(&(args.iters as u64).to_le_bytes());
    h.write(&(args.warmup as u64).to_le_bytes());
    let mut cfg = BusConfig::new(args.job_id.clone(), args.rank, args.np, layout.clone());
    cfg.shm_dir = args.shm_dir.clone();
    cfg.timeout = args.timeout;
    cfg.config_hash = h.0;
    #[cfg(feature = "mpi")]
    let universe = match args.transport {
        BenchTransport::Shm => None,
        BenchTransport::Mpi | BenchTransport::Hier => {
            let u = crate::mpi::universe()?;
            check_mpi_world(&u, args.rank, args.np)?;
            Some(u)
        }
    };
    #[cfg(not(feature = "mpi"))]
    if args.transport != BenchTransport::Shm {
        return Err(Error::Mpi {
            what: "the MPI comparison needs MPI".into(),
            hint: "build with `--features mpi` and start the ranks with mpirun".into(),
        });
    }
    let mut bus = ShmBus::open(cfg)?;
    #[cfg(feature = "mpi")]
    let mut hier = match args.transport {
        BenchTransport::Hier => Some(open_hier(&args, &layout, h.0)?),
        _ => None,
    };
    let n = args.np;
    let mut rows = Vec::new();
    let mut at = StepId::default();
    bus.barrier("bench-start", at)?;
    let t0 = Instant::now();
    for _ in 0..BARRIERS {
        bus.barrier("bench-barrier", at)?;
    }
    let barrier_us = t0.elapsed().as_secs_f64() * 1e6 / BARRIERS as f64;
    for (i, &size) in args.sizes.iter().enumerate() {
        let slot = &layout.slots[i];
        let (bucket, range) = (slot.bucket, slot.range());
        let fill = |bus: &mut ShmBus| bus.grads()[range.clone()].fill((args.rank + 1) as f32);
        at.step = i as u64;

        fill(&mut bus);
        for _ in 0..args.warmup {
            bus.allreduce_bucket(at, bucket)?;
        }
        let mut best = [f64::INFINITY; 2];
        // The fastest reduce phase in CPU time: least disturbed by other processes.
        let mut phase = [f64::INFINITY; 2];
        for _ in 0..ROUNDS {
            for (v, validate) in [(0, true), (1, false)] {
                // Refill so that values stay small and finite (they grow n-fold per all-reduce).
                fill(&mut bus);
                bus.barrier("bench-fill", at)?;
                let t0 = Instant::now();
                for _ in 0..args.iters {
                    phase[v] = phase[v].min(timed_reduce(&mut bus, at, bucket, validate)?);
                }
                let us = t0.elapsed().as_secs_f64() * 1e6 / args.iters.max(1) as f64;
                best[v] = best[v].min(us);
            }
        }

        // Correctness: one validated all-reduce of rank + 1 must give n(n+1)/2 everywhere.
        fill(&mut bus);
        bus.barrier("bench-fill", at)?;
        bus.allreduce_bucket(at, bucket)?;
        let want = (n * (n + 1) / 2) as f32;
        let wrong = bus.grads()[range.clone()].iter().filter(|&&x| x != want).count();
        let table = bus.agree(at, LocalScalars { loss: wrong as f64, ..LocalScalars::default() })?;
        #[allow(unused_mut)]
        let mut wrong = table.summary.loss.sum() as u64;

        // The same bytes through MPI_Allreduce (every rank takes part; the result is checked too).
        #[allow(unused_mut)]
        let mut mpi_time: Option<f64> = None;
        #[cfg(feature = "mpi")]
        if let Some(u) = &universe {
            let x = vec![(args.rank + 1) as f32; size / 4];
            let (us, bad) = mpi_allreduce(u, &x, want, args.warmup, args.iters, ROUNDS);
            mpi_time = Some(us);
            wrong += bad;
        }
        #[allow(unused_mut)]
        let mut hier_time: Option<f64> = None;
        #[cfg(feature = "mpi")]
        if let Some(t) = hier.as_mut() {
            let (us, bad) = time_transport(t, at, bucket, range.clone(), (args.rank + 1) as f32, want, &args)?;
            hier_time = Some(us);
            wrong += bad;
        }

        // The single-process ceilings, measured by rank 0 while the others wait in a barrier.
        if args.rank == 0 {
            let (memcpy, scan, read) = ceilings(&bus.grads()[range.clone()]);
            let time = best[0];
            let algbw = size as f64 / (time * 1e-6) / 1e9;
            rows.push(BenchRow {
                size_bytes: size as u64,
                count: (size / 4) as u64,
                dtype: "float".into(),
                redop: "sum".into(),
                np: n,
                time_us: time,
                algbw_gbps: algbw,
                busbw_gbps: algbw * 2.0 * (n as f64 - 1.0) / n as f64,
                wrong,
                memcpy_gbps: memcpy,
                scan_gbps: scan,
                read_gbps: read,
                plain_time_us: best[1],
                validation_pct: (best[0] - best[1]) / best[1] * 100.0,
                reduce_min_us: phase[0],
                plain_reduce_min_us: phase[1],
                barrier_us,
                mpi_time_us: mpi_time,
                mpi_algbw_gbps: mpi_time.map(|t| size as f64 / (t * 1e-6) / 1e9),
                hier_time_us: hier_time,
            });
        }
        bus.barrier("bench-size-done", at)?;
    }
    bus.barrier("bench-end", at)?;
    Ok((args.rank == 0).then_some(rows))
}

/// `MPI_COMM_WORLD`'s size must be the benchmark's process count.
#[cfg(feature = "mpi")]
pub(crate) fn check_mpi_world(universe: &::mpi::environment::Universe, rank: usize, np: usize) -> Result<(), Error> {
    let expect =
        crate::mpi::Expect { rank, world: np, source: "benchmark arguments".into(), timeout: Default::default() };
    crate::mpi::check_world(&universe.world(), &expect)
}

/// The MPI side (`BenchTransport::Mpi`): the average time of `iters` back-to-back `MPI_Allreduce(SUM)`s of `x`
/// over the world (best of `rounds`; rank 0's time, shared with every rank), in microseconds, and
/// the number of result elements that differ from `want`, summed over the ranks. The result goes to
/// a separate buffer (rsmpi has no `MPI_IN_PLACE`), so `x` is the input of every call. The caller
/// holds the `universe` for the whole benchmark (MPI is initialised once per process).
#[cfg(feature = "mpi")]
fn mpi_allreduce(
    universe: &::mpi::environment::Universe,
    x: &[f32],
    want: f32,
    warmup: usize,
    iters: usize,
    rounds: usize,
) -> (f64, u64) {
    use ::mpi::traits::*;

    let world = universe.world();
    let mut out = vec![0f32; x.len()];
    for _ in 0..warmup {
        crate::mpi::allreduce_sum(&world, x, &mut out);
    }
    let mut best = f64::INFINITY;
    for _ in 0..rounds {
        world.barrier();
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            crate::mpi::allreduce_sum(&world, x, &mut out);
        }
        best = best.min(t0.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64);
    }
    let wrong = out.iter().filter(|&&v| v != want).count() as u64;
    let mut total = 0u64;
    world.all_reduce_into(&wrong, &mut total, ::mpi::collective::SystemOperation::sum());
    world.process_at_rank(0).broadcast_into(&mut best);
    (best, total)
}

/// One all-reduce of `bucket` on the bus, validated (the transport's reduce) or not (`reduce_plain`:
/// the same adds without the tallies, for what validation costs); returns the thread CPU time of
/// this rank's reduce phase in microseconds (between the two barriers, no waiting in it: unlike
/// wall time it does not count preemption by other processes).
fn timed_reduce(bus: &mut ShmBus, at: StepId, bucket: usize, validate: bool) -> Result<f64, Error> {
    bus.in_reduce(at, bucket, |bus, start, slices| {
        let t0 = thread_cpu_time();
        if validate {
            bus.reduce_chunk(bucket, None, start, slices);
        } else {
            reduce_plain(slices);
        }
        thread_cpu_time().saturating_sub(t0).as_secs_f64() * 1e6
    })
}

/// CPU time consumed by the calling thread.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The hierarchical transport of the benchmark: `args.nodes` fake nodes of contiguous ranks, each
/// with its own segment (job id `JOB-h`).
#[cfg(feature = "mpi")]
fn open_hier(args: &BenchArgs, layout: &Layout, hash: u64) -> Result<crate::mpi::HierTransport, Error> {
    let nodes = args.nodes.max(1);
    if args.np % nodes != 0 {
        return Err(Error::Mpi {
            what: format!("{} ranks cannot be split into {nodes} nodes", args.np),
            hint: "pick a number of nodes that divides the number of ranks".into(),
        });
    }
    let per = args.np / nodes;
    let mut cfg = BusConfig::new(format!("{}-h", args.job_id), args.rank % per, per, layout.clone());
    cfg.node_id = args.rank / per;
    cfg.shm_dir = args.shm_dir.clone();
    cfg.timeout = args.timeout;
    cfg.config_hash = hash;
    let expect = crate::mpi::Expect {
        rank: args.rank,
        world: args.np,
        source: "benchmark arguments".into(),
        timeout: args.timeout,
    };
    crate::mpi::HierTransport::open(expect, cfg)
}

/// Time any `Transport`'s all-reduce of one bucket the way the bus is timed (warm-up, best of
/// `ROUNDS` averages of `iters`, each round after an `agree` that lines the ranks up), then check one
/// all-reduce of `fill` against `want`: (rank 0's microseconds, wrong elements over all ranks).
#[cfg(feature = "mpi")]
fn time_transport(
    t: &mut dyn Transport,
    at: StepId,
    bucket: usize,
    range: std::ops::Range<usize>,
    fill: f32,
    want: f32,
    args: &BenchArgs,
) -> Result<(f64, u64), Error> {
    t.grads()[range.clone()].fill(fill);
    for _ in 0..args.warmup {
        t.allreduce_bucket(at, bucket)?;
    }
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        t.grads()[range.clone()].fill(fill);
        t.agree(at, LocalScalars::default())?;
        let t0 = Instant::now();
        for _ in 0..args.iters {
            t.allreduce_bucket(at, bucket)?;
        }
        best = best.min(t0.elapsed().as_secs_f64() * 1e6 / args.iters.max(1) as f64);
    }
    t.grads()[range.clone()].fill(fill);
    t.allreduce_bucket(at, bucket)?;
    let wrong = t.grads()[range].iter().filter(|&&x| x != want).count();
    let table = t.agree(at, LocalScalars { loss: wrong as f64, ..LocalScalars::default() })?;
    Ok((best, table.summary.loss.sum() as u64))
}

/// GB/s of a single-thread memcpy, the fused health scan and a plain read of `x`'s bytes.
fn ceilings(x: &[f32]) -> (f64, f64, f64) {
    let bytes = std::mem::size_of_val(x) as f64;
    let gbps = |secs: f64| bytes / secs / 1e9;
    let best = |f: &mut dyn FnMut()| {
        (0..CEILING_REPS)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let src: Vec<f32> = x.to_vec();
    let mut dst = vec![1f32; x.len()];
    let memcpy = best(&mut || {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    });
    let scan = best(&mut || {
        black_box(health_scan(black_box(&src)));
    });
    let read = best(&mut || {
        black_box(plain_sum(black_box(&src)));
    });
    (gbps(memcpy), gbps(scan), gbps(read))
}

/// A read of every element that vectorizes: 16 independent f32 lanes.
fn plain_sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// The rows as an nccl-tests-like table, with the average bus bandwidth at the end.
///
/// Columns after nccl-tests' own: the single-thread ceilings (memcpy, health scan, plain read),
/// the all-reduce time without validation and what validation adds, then the same pair for the
/// reduce phase alone in thread CPU time (fastest iteration: the least disturbed by other
/// processes; `cpu0` without validation).
pub fn format_table(rows: &[BenchRow]) -> String {
    const HEAD: [(&str, &str); 16] = [
        ("size", "(B)"),
        ("count", "(elements)"),
        ("type", ""),
        ("redop", ""),
        ("time", "(us)"),
        ("algbw", "(GB/s)"),
        ("busbw", "(GB/s)"),
        ("#wrong", ""),
        ("memcpy", "(GB/s)"),
        ("scan", "(GB/s)"),
        ("read", "(GB/s)"),
        ("novalid", "(us)"),
        ("valid+", "(%)"),
        ("cpu", "(us)"),
        ("cpu0", "(us)"),
        ("cpu+", "(%)"),
    ];
    const W: [usize; 16] = [12, 12, 6, 6, 10, 7, 7, 6, 7, 7, 7, 10, 7, 10, 10, 7];
    let line =
        |cells: Vec<String>| -> String { cells.iter().zip(W).map(|(c, w)| format!(" {c:>w$}")).collect::<String>() };
    let np = rows.first().map_or(0, |r| r.np);
    // The MPI_Allreduce columns, when measured: its time, bandwidth and how many times slower than the bus.
    let with_mpi = rows.iter().any(|r| r.mpi_time_us.is_some());
    let mpi_head = |a: &str, b: &str, c: &str| if with_mpi { format!(" {a:>11} {b:>7} {c:>7}") } else { String::new() };
    // The hierarchical all-reduce column (shm inside fake nodes, MPI between their leaders), when measured.
    let with_hier = rows.iter().any(|r| r.hier_time_us.is_some());
    let hier_head = |a: &str| if with_hier { format!(" {a:>11}") } else { String::new() };
    let mut s = format!(
        "# gradbus shm all-reduce, {np} ranks, times of rank 0 (best round average); kernels' path {}\n#\n",
        gradbus_kernels::simd::active()
    );
    s += &format!(
        "#{}{}{}\n",
        line(HEAD.iter().map(|h| h.0.to_string()).collect()),
        mpi_head("mpi", "mpi_bw", "mpi/shm"),
        hier_head("hier")
    );
    s += &format!(
        "#{}{}{}\n",
        line(HEAD.iter().map(|h| h.1.to_string()).collect()),
        mpi_head("(us)", "(GB/s)", "(x)"),
        hier_head("(us)")
    );
    for r in rows {
        let pct = |a: f64, b: f64| format!("{:.1}", (a - b) / b * 100.0);
        let mpi = match r.mpi_time_us {
            Some(t) => format!(" {:>11.1} {:>7.2} {:>7.2}", t, r.mpi_algbw_gbps.unwrap_or(0.0), t / r.time_us),
            None => mpi_head("-", "-", "-"),
        };
        let hier = r.hier_time_us.map_or_else(|| hier_head("-"), |t| format!(" {t:>11.1}"));
        s += &format!(
            " {}{mpi}{hier}\n",
            line(vec![
                r.size_bytes.to_string(),
                r.count.to_string(),
                r.dtype.clone(),
                r.redop.clone(),
                format!("{:.1}", r.time_us),
                format!("{:.2}", r.algbw_gbps),
                format!("{:.2}", r.busbw_gbps),
                r.wrong.to_string(),
                format!("{:.2}", r.memcpy_gbps),
                format!("{:.2}", r.scan_gbps),
                format!("{:.2}", r.read_gbps),
                format!("{:.1}", r.plain_time_us),
                format!("{:.1}", r.validation_pct),
                format!("{:.1}", r.reduce_min_us),
                format!("{:.1}", r.plain_reduce_min_us),
                pct(r.reduce_min_us, r.plain_reduce_min_us),
            ])
        );
    }
    let avg = if rows.is_empty() { 0.0 } else { rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64 };
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    s += &format!("# Out of bounds values : {wrong} {}\n", if wrong == 0 { "OK" } else { "FAILED" });
    s += &format!("# Avg bus bandwidth    : {avg:.3} GB/s\n");
    if let Some(r) = rows.first() {
        s += &format!("# Barrier (all ranks)  : {:.2} us\n", r.barrier_us);
    }
    s
}

/// One JSON object per row and line (keys as in `BenchRow`, `type` for the element type).
pub fn json_lines(rows: &[BenchRow]) -> String {
    rows.iter().map(|r| serde_json::to_string(r).expect("rows serialize") + "\n").collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units_and_reject_partial_floats() {
        assert_eq!(
            parse_sizes("1MiB,16MiB, 64M,4096,1KiB,1GiB").unwrap(),
            vec![1 << 20, 16 << 20, 64 << 20, 4096, 1024, 1 << 30]
        );
        assert_eq!(parse_size("1MB").unwrap(), 1_000_000);
        assert!(parse_size("6").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("MiB").is_err());
    }

    #[test]
    fn plain_sum_reads_everything() {
        let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        assert_eq!(plain_sum(&x), 499_500.0);
    }

    #[test]
    fn table_and_json_carry_every_figure() {
        let row = BenchRow {
            size_bytes: 64 << 20,
            count: 16 << 20,
            dtype: "float".into(),
            redop: "sum".into(),
            np: 2,
            time_us: 10_000.0,
            algbw_gbps: 6.71,
            busbw_gbps: 6.71,
            wrong: 0,
            memcpy_gbps: 10.0,
            scan_gbps: 20.0,
            read_gbps: 25.0,
            plain_time_us: 9_800.0,
            validation_pct: 2.04,
            reduce_min_us: 9_000.0,
            plain_reduce_min_us: 8_800.0,
            barrier_us: 3.5,
            mpi_time_us: None,
            mpi_algbw_gbps: None,
            hier_time_us: None,
        };
        let t = format_table(std::slice::from_ref(&row));
        assert!(t.contains("67108864") && t.contains("Avg bus bandwidth") && t.contains("OK"), "{t}");
        let j: serde_json::Value =
            serde_json::from_str(json_lines(std::slice::from_ref(&row)).lines().next().unwrap()).unwrap();
        for k in ["size_bytes", "algbw_gbps", "busbw_gbps", "memcpy_gbps", "wrong", "type", "time_us", "validation_pct"]
        {
            assert!(j.get(k).is_some(), "{k}");
        }
        assert!(j.get("mpi_time_us").is_none(), "no MPI columns unless measured");
        assert!(!t.contains("mpi/shm"), "{t}");
        let mpi = BenchRow { mpi_time_us: Some(40_000.0), mpi_algbw_gbps: Some(1.68), ..row.clone() };
        let t = format_table(std::slice::from_ref(&mpi));
        assert!(t.contains("mpi/shm") && t.contains("40000.0") && t.contains("4.00"), "{t}");
        let j: serde_json::Value = serde_json::from_str(json_lines(std::slice::from_ref(&mpi)).trim()).unwrap();
        assert_eq!(j["mpi_time_us"], 40_000.0);
        assert!(j.get("hier_time_us").is_none());
        let hier = BenchRow { hier_time_us: Some(12_345.6), ..mpi };
        let t = format_table(std::slice::from_ref(&hier));
        assert!(t.contains(" hier") && t.contains("12345.6"), "{t}");
    }
}
