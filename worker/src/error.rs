//! The worker library's one error type: everything that ends a rank (or a replay, or a check the
//! launcher runs before any rank starts) early, each variant naming the file, key or variable to
//! look at and, where there is one, a hint; and its exit code under the policy of [`Code`].
//!
//! Invariant: everything a user can fix in the config, the command line or the launch environment
//! is [`Code::Usage`] (2); a failure of this rank or of a file it writes is [`Code::RankFailed`] (4);
//! a collective deadline is [`Code::Timeout`] (5).

use std::path::PathBuf;

use crate::env;
use crate::exit::Code;

/// Everything that ends a worker early.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    // The config (file, `--set` overrides, `GRADBUS_FAULTS`) and whether this machine can run it.
    /// The config file could not be read.
    #[error("cannot read config {path}: {source}\n  hint: check the path; examples/tiny.toml is the default config")]
    ConfigRead {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML (its line and column are in the message).
    #[error("{path}: {message}\n  hint: fix the TOML syntax there; examples/tiny.toml shows every key")]
    ConfigToml {
        /// The file.
        path: String,
        /// What the TOML parser said, with the line.
        message: String,
    },
    /// A key does not match the schema: unknown key, wrong type, unknown variant.
    #[error("config key `{key}` ({origin}): {message}\n  hint: {hint}")]
    ConfigKey {
        /// The dotted key, e.g. `optim.lr` or `faults[0].rank`.
        key: String,
        /// The file, and whether `--set` overrides were applied.
        origin: String,
        /// What serde said.
        message: String,
        /// What to do.
        hint: &'static str,
    },
    /// A `--set` override is malformed.
    #[error("--set {arg}: {why}\n  hint: use --set key=value with a dotted key, e.g. --set loss.style=\"safe\"")]
    BadOverride {
        /// The override as given.
        arg: String,
        /// What is wrong.
        why: String,
    },
    /// A value is out of its range.
    #[error("config key `{key}` = {value}: {why}\n  hint: {hint}")]
    ConfigRange {
        /// The dotted key.
        key: String,
        /// The value given.
        value: String,
        /// The allowed range.
        why: String,
        /// What to do, e.g. the default value.
        hint: String,
    },
    /// `GRADBUS_FAULTS` is not a fault plan (the TOML of the config's `[[faults]]`).
    #[error("{}: {source}", env::FAULTS)]
    FaultsEnv {
        /// What the TOML parser said, with the line.
        source: toml::de::Error,
    },
    /// `device = "cuda"` where this build or machine cannot run it.
    #[error("config key `device` = \"cuda\": {why}\n  hint: {hint}")]
    Device {
        /// What is missing (the build's feature, the driver, a GPU).
        why: String,
        /// What to do.
        hint: String,
    },
    /// The job would not fit in this machine's memory.
    #[error("{estimate}\n  hint: {hint}")]
    Memory {
        /// The estimate against what the machine has, in words.
        estimate: String,
        /// What to do.
        hint: String,
    },

    // The launch environment: this process's place in the job, and its GPU.
    /// A variable that must hold a count or an index holds something else.
    #[error("environment variable {var}={value:?} is not a non-negative integer")]
    NotANumber {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A variable that the launcher sets beside the others is not set.
    #[error("environment variable {var} is missing ({set_by} sets it)")]
    Missing {
        /// The variable.
        var: &'static str,
        /// Who sets it, in words.
        set_by: String,
    },
    /// A Slurm tasks-per-node list has a part that is not `N` or `N(xK)`.
    #[error("environment variable {var}={value:?}: `{part}` is not N or N(xK) (hint: Slurm writes e.g. `2(x3),1`)")]
    TaskList {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// The part that does not parse.
        part: String,
    },
    /// An `srun` task has none of the three tasks-per-node variables.
    #[error(
        "environment variable {} is missing (srun sets it, or {} with --ntasks-per-node)",
        env::SLURM_STEP_TASKS_PER_NODE,
        env::SLURM_NTASKS_PER_NODE
    )]
    NoTasksPerNode,
    /// Slurm's task count is not the sum of its tasks per node.
    #[error(
        "inconsistent Slurm environment: {world_var}={world} on {nodes} node(s), but {per_var} gives {per_node:?} \
         (hint: start the ranks with `srun` inside the allocation)"
    )]
    SlurmTasks {
        /// The variable of the task count.
        world_var: &'static str,
        /// The task count.
        world: usize,
        /// The nodes of the step.
        nodes: usize,
        /// The variable of the tasks per node.
        per_var: &'static str,
        /// The tasks per node, expanded.
        per_node: Vec<usize>,
    },
    /// `SLURM_NODEID` is not a node of the step.
    #[error("inconsistent Slurm environment: {}={node_id}, but the step has {nodes} node(s)", env::SLURM_NODEID)]
    SlurmNodeId {
        /// `SLURM_NODEID`.
        node_id: usize,
        /// The nodes of the step.
        nodes: usize,
    },
    /// `PMIX_RANK` is set without any launcher variable that gives the world size.
    #[error(
        "{}={pmix} is set, but no launcher variable gives the world size \
         (hint: start the ranks with srun, mpirun or `gradbus run`)",
        env::PMIX_RANK
    )]
    PmixAlone {
        /// `PMIX_RANK`.
        pmix: usize,
    },
    /// Two launchers of the same world size give this process different ranks (a double launch).
    #[error(
        "two launchers started this process: {inner}, but {outer} \
         (hint: start the ranks once: `srun gradbus worker CONFIG` or `gradbus run --launcher srun`, \
         not `srun gradbus run`)"
    )]
    DoubleLaunch {
        /// What the innermost launcher says (source, rank, world, variables).
        inner: String,
        /// What the outer one says.
        outer: String,
    },
    /// `PMIX_RANK` disagrees with the Slurm or Open MPI rank it was set beside.
    #[error(
        "{claim}, but {}={pmix} (hint: the PMIx server and the launcher disagree; is an outer launcher's \
         {} leaking into this one?)",
        env::PMIX_RANK,
        env::PMIX_RANK
    )]
    PmixConflict {
        /// What the launcher says.
        claim: String,
        /// `PMIX_RANK`.
        pmix: usize,
    },
    /// The winning launcher's numbers do not describe a place in a job.
    #[error(
        "inconsistent rank environment ({launcher}): rank {rank} of {world}, local rank {local_rank} of {local_size}"
    )]
    Inconsistent {
        /// The launcher the numbers came from.
        launcher: &'static str,
        /// Global rank.
        rank: usize,
        /// World size.
        world: usize,
        /// Local rank.
        local_rank: usize,
        /// Local size.
        local_size: usize,
    },
    /// `GRADBUS_FAKE_NODES` does not divide the ranks of this node.
    #[error("{}={fake_nodes} must divide the local size {local_size}", env::FAKE_NODES)]
    FakeNodes {
        /// `GRADBUS_FAKE_NODES`.
        fake_nodes: usize,
        /// Ranks on this node.
        local_size: usize,
    },
    /// `CUDA_VISIBLE_DEVICES` lists no device.
    #[error(
        "{}={list:?} hides every GPU (hint: ask Slurm for GPUs with --gpus-per-task=1)",
        env::CUDA_VISIBLE_DEVICES
    )]
    NoGpu {
        /// Its value.
        list: String,
    },
    /// `CUDA_VISIBLE_DEVICES=NoDevFiles`: Slurm's marker for a job without GPU device files.
    #[error(
        "{}=NoDevFiles: Slurm found no GPU device files for this job (hint: check gres.conf)",
        env::CUDA_VISIBLE_DEVICES
    )]
    NoDevFiles,
    /// Fewer visible devices than local ranks.
    #[error(
        "local rank {local_rank} needs a GPU of its own, but {}={list:?} lists {devices} \
         (hint: one GPU per local rank: --gpus-per-task=1, or fewer tasks per node)",
        env::CUDA_VISIBLE_DEVICES
    )]
    TooFewGpus {
        /// This rank's local rank.
        local_rank: usize,
        /// `CUDA_VISIBLE_DEVICES`.
        list: String,
        /// The devices it lists.
        devices: usize,
    },

    // The run directory (`rundir`): who owns it and what it holds.
    /// Another job holds the lock.
    #[error("run directory {} is in use by {holder}\n  hint: wait for that job to end (or stop it), or give this one another --run-dir", dir.display())]
    RunDirInUse {
        /// The directory.
        dir: PathBuf,
        /// The holder, described.
        holder: String,
    },
    /// The directory holds an earlier run and the job was not told what to do with it.
    #[error("run directory {} holds an earlier run ({})\n  hint: `--resume {}` continues it from its last checkpoint; a new `--run-dir` starts another run; `--overwrite` deletes those files and starts this run there", dir.display(), files.join(", "), dir.display())]
    RunDirHoldsRun {
        /// The directory.
        dir: PathBuf,
        /// What of a run it holds.
        files: Vec<String>,
    },
    /// The lock file or an earlier run's file could not be used.
    #[error("run directory {}: {what}: {source}\n  hint: check that the directory is writable", dir.display())]
    RunDirIo {
        /// The directory.
        dir: PathBuf,
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },

    // Running the job.
    /// Bad arguments or input, with the hint in the message.
    #[error("{0}")]
    Usage(String),
    /// The collectives layer failed (timeout, dead peer, /dev/shm).
    #[error(transparent)]
    Bus(#[from] gradbus_collectives::Error),
    /// A file could not be written or read.
    #[error("{what}: {source}")]
    Io {
        /// The file, named.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// An artifact (checkpoint, dump, report, metrics) was refused or could not be written.
    #[error(transparent)]
    Artifact(#[from] gradbus_artifacts::ArtifactError),
    /// Replicas diverged: the parameter checksums disagree.
    #[error("{0}")]
    Diverged(String),
    /// `gradbus replay`: the dump (or its directory) could not be found or read.
    #[error("{0}")]
    DumpNotFound(String),
}

impl WorkerError {
    /// An I/O error naming the file.
    pub fn io(what: &str, source: std::io::Error) -> WorkerError {
        WorkerError::Io { what: what.into(), source }
    }

    /// The exit code of this error.
    pub fn code(&self) -> Code {
        use gradbus_collectives::Error as E;
        use WorkerError as W;
        match self {
            W::Artifact(gradbus_artifacts::ArtifactError::Io { .. }) => Code::RankFailed,
            W::Bus(E::Timeout { .. }) => Code::Timeout,
            W::Bus(E::ShmFull { .. } | E::BadSegment { .. } | E::Mpi { .. } | E::Config { .. }) => Code::Usage,
            W::Bus(_) | W::Io { .. } | W::Diverged(_) => Code::RankFailed,
            // The rest is the user's to fix: the config, the launch environment, the run directory, a
            // refused artifact, a replay's dump, a bad argument.
            _ => Code::Usage,
        }
    }
}
