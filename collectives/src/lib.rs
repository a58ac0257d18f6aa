//! gradbus-collectives: the flat gradient buffer's layout, the transports that all-reduce it
//! bucket by bucket while validating every rank's gradients, and the agreement that turns the
//! validated numbers into one verdict on every rank.
//!
//! This crate knows nothing about models: it sees named slots of f32 and ranks.
//!
//! Transports: `Solo` (one rank), the shared-memory bus, MPI and hierarchical shm+MPI (feature
//! `mpi`), NCCL (feature `cuda`, module `nccl`: run at world size 1 on one GPU so far, see its header).

pub mod agreement;
pub mod bench;
pub mod bench_agreement;
pub mod choice;
pub mod forecast;
pub mod grads;
pub mod judge;
pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod sdc;
pub mod shm;
pub mod spikes;
pub mod transport;
pub mod verdict;
pub mod wire;

pub use agreement::{Anomaly, BucketStat, ExactSum, Extremes, LocalScalars, Stat, StateFault, Summary, ValueNames};
pub use choice::AgreementPath;
pub use forecast::{Alert, Forecast, Outlook, Rule};
pub use grads::{backward_and_reduce, BusBackend, GradBus, GradMut, GradSlots, HostBus, ParamGrads};
pub use judge::{Judge, LossScale, OnSpike, Watched};
pub use layout::{Bucket, Layout, ParamSpec, Slot};
pub use shm::{read_progress, read_status, remove_job_segments, BusConfig, Progress, RankStatus, ShmBus};
pub use spikes::{Spike, SpikeDetector};
pub use transport::{hash_pieces, AlignedBuf, Solo, Transport};
pub use verdict::{
    decide, empty_report, Action, Cause, Classification, HealthTable, History, Policy, RankHealth, Reduced, Report,
    SampleId, StepId, Verdict,
};

/// Errors of the collectives layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Some ranks did not reach a barrier before the deadline.
    #[error("collective timeout after {secs:.1}s in {phase} at step {step}{}: rank(s) {missing:?} did not arrive (hint: a rank may be stalled or dead; see its log, or raise collective_timeout_s)", bucket.map(|b| format!(", bucket #{b}")).unwrap_or_default())]
    Timeout {
        /// Phase name (`reduce`, `agree`, `attach`...).
        phase: String,
        /// Optimizer step.
        step: u64,
        /// Bucket, when the phase is a bucket reduce.
        bucket: Option<usize>,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
        /// The deadline that passed.
        secs: f64,
    },
    /// A peer marked itself failed; this rank stops instead of waiting.
    #[error("rank {rank} failed during {phase} at step {step}; stopping this rank too")]
    PeerFailed {
        /// The failed rank.
        rank: usize,
        /// Where this rank noticed.
        phase: String,
        /// Optimizer step.
        step: u64,
    },
    /// The shared-memory filesystem has too little room for the segment.
    #[error("{path}: cannot reserve {need} bytes for the gradient bus segment ({reason}) (hint: free space in /dev/shm, enlarge it with `--shm-size` for containers, or use smaller buckets/model)")]
    ShmFull {
        /// Segment path.
        path: String,
        /// Bytes needed.
        need: u64,
        /// What the OS said.
        reason: String,
    },
    /// A segment exists but is not one this job can attach to.
    #[error("{path}: {reason} (hint: {hint})")]
    BadSegment {
        /// Segment path.
        path: String,
        /// What was wrong.
        reason: String,
        /// What to do.
        hint: String,
    },
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, naming the file.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// MPI could not be set up, or disagrees with the environment the ranks were launched with.
    #[error("MPI: {what} (hint: {hint})")]
    Mpi {
        /// What went wrong.
        what: String,
        /// What to do.
        hint: String,
    },
    /// The CUDA backend failed (or is absent: `NoCudaDriver`, `NotCompiledWithCuda`).
    #[error("CUDA: {0}")]
    Cuda(#[from] gradbus_kernels::Error),
    /// NCCL could not be loaded, or one of its calls failed.
    #[error("NCCL: {what} (hint: {hint})")]
    Nccl {
        /// What went wrong.
        what: String,
        /// What to do.
        hint: String,
    },
    /// A setting the collectives read (an environment variable) has a value they do not know.
    #[error("{what} (hint: {hint})")]
    Config {
        /// What was wrong, naming the setting.
        what: String,
        /// What to do.
        hint: String,
    },
    /// Ranks called different collectives (a program bug): every rank stops with this error.
    #[error("rank {rank} is in {theirs} while this rank is in {mine} (hint: every rank must run the same sequence of collectives, steps and buckets)")]
    Mismatch {
        /// The first rank whose operation differs from this rank's.
        rank: usize,
        /// What that rank was doing.
        theirs: String,
        /// What this rank was doing.
        mine: String,
    },
    /// The transport cannot do what was asked (e.g. repair a replica over NCCL).
    #[error("{what} (hint: {hint})")]
    Unsupported {
        /// What it cannot do.
        what: String,
        /// What to do.
        hint: String,
    },
}
