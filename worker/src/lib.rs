//! gradbus-worker: one rank of a gradbus job - rank discovery, config, the reference RL workload,
//! the step loop over a `Transport`, checkpoints, failure dumps, replay and the forensics trace.
//!
//! [`cli::main_with_args`] is the `gradbus worker` subcommand (the `gradbus` binary calls it): it
//! parses arguments and maps `WorkerError`s to the exit codes of [`exit::Code`].

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod env;
pub mod error;
pub mod exit;
pub mod failure;
pub mod faults;
pub mod forensics;
pub mod gradients;
pub mod host;
pub mod judge;
pub mod loss;
pub mod metrics;
pub mod model;
pub mod probe;
pub mod rank;
pub mod rollout;
pub mod rundir;
pub mod state;
pub mod task;
pub mod train;
pub mod update;

use std::path::PathBuf;

use gradbus_collectives::shm::{ProgressWriter, ShmBus};
use gradbus_collectives::{BusBackend, GradBus, HostBus, Layout, Solo, StepId, Transport};
use gradbus_kernels::backend::Cpu;

use crate::config::{Config, Device};
use crate::exit::Code;
use crate::faults::{FaultPhase, FaultPlan};
use crate::rank::RankInfo;
use crate::train::{Job, Outcome, Trainer};
use crate::update::UpdateValues;

pub use crate::error::WorkerError;

/// Arguments of `gradbus worker`.
#[derive(Clone, Debug, Default)]
pub struct WorkerArgs {
    /// The config file.
    pub config: PathBuf,
    /// `--set key=value` overrides.
    pub overrides: Vec<String>,
    /// `--run-dir`.
    pub run_dir: Option<PathBuf>,
    /// `--resume`: continue from the run dir's latest complete checkpoint.
    pub resume: bool,
    /// `--overwrite`: delete an earlier run in the run dir, then start a new one there.
    pub overwrite: bool,
}

/// The multi-rank transports a worker can pick (a world of one uses `Solo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// The shared-memory bus: one node.
    Shm,
    /// Flat `MPI_Allreduce`: one rank per node (feature `mpi`).
    Mpi,
    /// Shm inside each node, MPI among the node leaders (feature `mpi`).
    Hier,
}

impl std::str::FromStr for TransportKind {
    type Err = WorkerError;
    fn from_str(s: &str) -> Result<TransportKind, WorkerError> {
        match s {
            "shm" => Ok(TransportKind::Shm),
            "mpi" => Ok(TransportKind::Mpi),
            "hier" => Ok(TransportKind::Hier),
            other => Err(WorkerError::Usage(format!("{}={other:?}: expected shm, mpi or hier", env::TRANSPORT))),
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Shm => "shm",
            TransportKind::Mpi => "mpi",
            TransportKind::Hier => "hier",
        })
    }
}

/// A host transport as the wiring opened it, with what the step loop needs of it besides the
/// collectives: the progress bar's cell where the transport has a shm segment.
struct HostTransport {
    transport: Box<dyn Transport>,
    progress: Option<ProgressWriter>,
}

impl HostTransport {
    /// A transport without a progress cell.
    fn bare(transport: Box<dyn Transport>) -> HostTransport {
        HostTransport { transport, progress: None }
    }
}

/// The fault plan's hook inside a bucket reduce (its `reduce` phase: a rank killed there dies
/// mid-collective), for the transports that reduce between barriers of their own (the shm bus).
type ReduceHook = Box<dyn FnMut(StepId, usize) + Send + Sync>;

fn reduce_hook(faults: &FaultPlan) -> Option<ReduceHook> {
    let plan = faults.clone();
    faults.has_phase(FaultPhase::Reduce).then(|| -> ReduceHook {
        Box::new(move |at, bucket| {
            if bucket == 0 {
                plan.at_phase(FaultPhase::Reduce, at);
            }
        })
    })
}

/// The host transport for this rank: solo for a world of one, the shared-memory bus inside a node,
/// MPI between nodes (feature `mpi`); `GRADBUS_TRANSPORT` = shm | mpi | hier overrides the choice.
/// Once open, its name goes to the rank's log after `via` (`say_gradient_path`).
fn transport(
    info: &RankInfo,
    cfg: &Config,
    hash: u64,
    layout: Layout,
    faults: &FaultPlan,
    via: &str,
) -> Result<HostTransport, WorkerError> {
    let forced = std::env::var(env::TRANSPORT).ok().filter(|v| !v.is_empty());
    let kind = match forced.as_deref() {
        None if info.world == 1 => {
            say_gradient_path(&format!("{via}solo"));
            return Ok(HostTransport::bare(Box::new(Solo::new(layout, UpdateValues::names()))));
        }
        Some(k) => k.parse()?,
        None if info.nodes > 1 && info.local_size == 1 => TransportKind::Mpi,
        None if info.nodes > 1 => TransportKind::Hier,
        None => TransportKind::Shm,
    };
    let bus = gradbus_collectives::shm::BusConfig {
        shm_dir: PathBuf::from("/dev/shm"),
        job_id: info.job_id.clone(),
        node_id: info.node_id,
        local_rank: info.local_rank,
        local_size: info.local_size,
        config_hash: hash,
        layout,
        values: UpdateValues::names(),
        timeout: std::time::Duration::from_secs_f64(cfg.collective_timeout_s),
    };
    if kind == TransportKind::Shm {
        if info.nodes > 1 {
            return Err(WorkerError::Usage(format!(
                "{}=shm: the bus serves one node, this job has {}",
                env::TRANSPORT,
                info.nodes
            )));
        }
        let mut bus = ShmBus::open(bus)?;
        if let Some(hook) = reduce_hook(faults) {
            bus.set_inside_reduce_hook(hook);
        }
        bus.set_sdc_tallies(cfg.sdc.replicas || cfg.sdc.outliers);
        let progress = Some(bus.progress_writer()?);
        say_gradient_path(&format!("{via}{kind}"));
        return Ok(HostTransport { transport: Box::new(bus), progress });
    }
    let host = mpi_transport(kind, info, bus, faults)?;
    say_gradient_path(&format!("{via}{kind}"));
    Ok(host)
}

/// The line, on every rank's log, naming the path its gradients take: `gradients: solo|shm|mpi|hier`
/// on the CPU; `nccl`, or `staged over` one of those, on a GPU. The GPU check confirms by it that the
/// path it pinned is the one that ran (scripts/gpu-check.d/common.sh, `gradients_over`).
fn say_gradient_path(path: &str) {
    eprintln!("gradients: {path}");
}

#[cfg(feature = "mpi")]
fn mpi_transport(
    kind: TransportKind,
    info: &RankInfo,
    bus: gradbus_collectives::shm::BusConfig,
    faults: &FaultPlan,
) -> Result<HostTransport, WorkerError> {
    use gradbus_collectives::mpi::{Expect, HierTransport, MpiTransport};
    let expect = Expect { rank: info.rank, world: info.world, source: info.source.into(), timeout: bus.timeout };
    if kind == TransportKind::Mpi {
        let mpi = MpiTransport::open(expect, bus.layout, bus.values, bus.config_hash)?;
        return Ok(HostTransport::bare(Box::new(mpi)));
    }
    let mut hier = HierTransport::open(expect, bus)?;
    if let Some(hook) = reduce_hook(faults) {
        hier.set_inside_reduce_hook(hook);
    }
    let progress = Some(hier.progress_writer()?);
    Ok(HostTransport { transport: Box::new(hier), progress })
}

#[cfg(not(feature = "mpi"))]
fn mpi_transport(
    kind: TransportKind,
    info: &RankInfo,
    _bus: gradbus_collectives::shm::BusConfig,
    _faults: &FaultPlan,
) -> Result<HostTransport, WorkerError> {
    Err(WorkerError::Usage(format!(
        "the {kind} transport ({} nodes) needs MPI between nodes (hint: build with `--features mpi`)",
        info.nodes
    )))
}

/// `GRADBUS_SIMD` (the kernels' instruction-set level, `gradbus_kernels::simd`), checked before any
/// kernel runs: a name that is no level, or a level this CPU lacks, is a usage error (exit 2) naming
/// the variable and the levels, where the first kernel to read it could only panic.
pub fn check_simd() -> Result<(), WorkerError> {
    gradbus_kernels::simd::from_env().map(drop).map_err(|e| WorkerError::Usage(e.to_string()))
}

/// Run one rank to its end. `Ok(Code)` is the exit code of a run that ended as planned (done, or
/// the agreed abort on non-finite gradients).
pub fn run(args: &WorkerArgs) -> Result<Code, WorkerError> {
    check_simd()?;
    let info = RankInfo::discover()?;
    let (cfg, config_hash, canonical) = Config::load(&args.config, &args.overrides)?;
    // `gradbus run` has checked the whole node already; under a bare mpirun this is the only check,
    // and each rank can only see its own share (the others may already hold theirs).
    cfg.check_world(info.world)?;
    cfg.check_memory(1, info.world > 1, &config::Machine { shm_free: None, ..config::Machine::probe() })?;
    if let Some(warning) = cfg.check_device(info.local_size, true)? {
        if info.local_rank == 0 {
            eprintln!("warning: {warning}");
        }
    }
    let run_dir = info.run_dir(args.run_dir.clone());
    std::fs::create_dir_all(&run_dir).map_err(|e| WorkerError::io(&run_dir.display().to_string(), e))?;
    // Rank 0 owns the run directory unless this job's launcher does (held to the end of the run).
    let mode = rundir::Mode::of(args.resume, args.overwrite);
    let _owner = if info.rank == 0 { rundir::claim_as_worker(&run_dir, mode, &info.job_id)? } else { None };
    let layout = Layout::new(&model::param_specs(&cfg.model), cfg.bucket_bytes);
    let hash = config_hash ^ layout.hash();
    let faults = FaultPlan::new(&cfg.faults, &cfg.model, info.rank)?;
    let job = Job { cfg, config_hash: hash, config_text: canonical, info, run_dir, faults, resume: args.resume };
    match job.cfg.device {
        Device::Cpu => {
            let host = transport(&job.info, &job.cfg, hash, layout, &job.faults, "")?;
            train(Cpu, HostBus::new(host.transport), host.progress, job)
        }
        Device::Cuda => train_cuda(job, layout),
    }
}

/// The step loop on backend `be` and its bus to its end.
fn train<B: BusBackend>(be: B, bus: B::Bus, progress: Option<ProgressWriter>, job: Job) -> Result<Code, WorkerError> {
    let mut trainer = Trainer::new(be, bus, progress, job)?;
    match trainer.run() {
        Ok(Outcome::Done) => Ok(Code::Done),
        Ok(Outcome::Aborted(report)) => {
            eprintln!("rank {}: ABORT: {}", trainer.info.rank, failure::describe(&report));
            Ok(Code::NonFinite)
        }
        Err(e) => {
            trainer.bus.transport_mut().mark_failed();
            Err(e)
        }
    }
}

/// This rank's GPU (`rank::gpu_ordinal`, shared round-robin when the node has fewer GPUs than local
/// ranks: `Config::check_device` warned about it), and whether it is the rank's own.
#[cfg(feature = "cuda")]
fn gpu_index(info: &RankInfo) -> Result<(usize, bool), WorkerError> {
    let gpus = gradbus_kernels::cuda::probe().unwrap_or(1).max(1);
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let bound = visible.as_deref().is_some_and(|v| v.split(',').filter(|d| !d.trim().is_empty()).count() == 1);
    match rank::gpu_ordinal(info.local_rank, visible.as_deref()) {
        Ok(ordinal) => Ok((ordinal % gpus, bound || gpus >= info.local_size)),
        Err(WorkerError::TooFewGpus { devices, .. }) => Ok((info.local_rank % devices, false)),
        Err(e) => Err(e.into()),
    }
}

/// `device = "cuda"`: the step loop on this rank's GPU (the CUDA backend: parameters, gradients, Adam
/// moments and activations on the device). The gradients' bus (`GpuBus`): with a GPU per rank and
/// more than one rank, NCCL over the GPUs (scanned and reduced on the device, only the health rows
/// to the host); else the host transport through `Staged` (each bucket to the host, reduced with
/// the transport's tallies, back to the device). `GRADBUS_TRANSPORT` keeps the host transport.
/// Either way the verdicts, reports and dumps are the CPU path's.
#[cfg(feature = "cuda")]
fn train_cuda(job: Job, layout: Layout) -> Result<Code, WorkerError> {
    use gradbus_collectives::grads::{GpuBus, Staged};
    use gradbus_collectives::nccl::{NcclConfig, NcclTransport};
    let (cfg, info) = (&job.cfg, &job.info);
    let (ordinal, own) = gpu_index(info)?;
    let gpu = gradbus_kernels::cuda::Gpu::new(ordinal)
        .map_err(|e| WorkerError::Usage(format!("device = \"cuda\": rank {} on GPU {ordinal}: {e}", info.rank)))?;
    let forced = std::env::var(env::TRANSPORT).ok().is_some_and(|v| !v.is_empty());
    let (bus, progress) = if info.world > 1 && own && !forced {
        let nccl = NcclTransport::open(NcclConfig {
            rank: info.rank,
            world: info.world,
            device: ordinal,
            run_dir: job.run_dir.clone(),
            job_id: info.job_id.clone(),
            timeout: std::time::Duration::from_secs_f64(cfg.collective_timeout_s),
            config_hash: job.config_hash,
            layout,
            values: UpdateValues::names(),
        })?;
        say_gradient_path("nccl");
        (GpuBus::Nccl(nccl), None)
    } else {
        let host = transport(info, cfg, job.config_hash, layout, &job.faults, "staged over ")?;
        (GpuBus::Staged(Staged::new(&gpu, host.transport)), host.progress)
    };
    train(gpu, bus, progress, job)
}

/// Without the `cuda` feature `Config::check_device` refuses `device = "cuda"` before this.
#[cfg(not(feature = "cuda"))]
fn train_cuda(_job: Job, _layout: Layout) -> Result<Code, WorkerError> {
    Err(WorkerError::Device {
        why: "gradbus was built without the cuda feature".into(),
        hint: "build it with `cargo build --release --features cuda`".into(),
    })
}
