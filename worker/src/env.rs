//! The environment contract between the launcher and its workers, in one place.
//!
//! The launcher sets every `GRADBUS_*` variable below for each worker it spawns. Under a bare
//! `mpirun` or `srun`, the rank and sizes come from that launcher's own variables instead (Open MPI's
//! `OMPI_COMM_WORLD_*`, MPICH's `PMI_*`, Slurm's `SLURM_*` of a job step, checked against PMIx's
//! `PMIX_RANK`), and the job id from `GRADBUS_JOB_ID` if exported, else from the launcher's job
//! (Slurm: job id and step id). Which launcher wins when several left variables is `crate::rank`'s
//! business; this file only names them.

/// Global rank of this worker.
pub const RANK: &str = "GRADBUS_RANK";
/// Rank among the workers of this node.
pub const LOCAL_RANK: &str = "GRADBUS_LOCAL_RANK";
/// Number of workers in the job.
pub const WORLD_SIZE: &str = "GRADBUS_WORLD_SIZE";
/// Number of workers on this node.
pub const LOCAL_SIZE: &str = "GRADBUS_LOCAL_SIZE";
/// Index of this node in the launch plan (local launches; under `mpirun` the MPI transports find
/// the nodes themselves and use this only to tell `FAKE_NODES` apart).
pub const NODE_ID: &str = "GRADBUS_NODE_ID";
/// Unique id of the job; names the shared-memory segments.
pub const JOB_ID: &str = "GRADBUS_JOB_ID";
/// Directory for logs, metrics, checkpoints, dumps and reports.
pub const RUN_DIR: &str = "GRADBUS_RUN_DIR";
/// Split the ranks of one machine into this many fake nodes (testing the hierarchical path).
pub const FAKE_NODES: &str = "GRADBUS_FAKE_NODES";
/// Force a transport: `shm` (one node), `mpi` (flat MPI, every rank its own node) or `hier` (shm
/// inside each node, MPI between nodes). Unset: solo for one rank, shm for one node, and with the
/// `mpi` feature `mpi` when every node has one rank, else `hier`.
pub const TRANSPORT: &str = "GRADBUS_TRANSPORT";
/// Force the agreement's path, `table` or `summary` (collectives' `AgreementPath`); unset, the cost
/// model chooses for the world size and layout.
pub const AGREEMENT: &str = gradbus_collectives::AgreementPath::ENV;
/// Force the kernels' instruction-set level (`baseline`, `avx`, `avx2`, `avx512`); unset, the best
/// this CPU has.
pub const SIMD: &str = gradbus_kernels::simd::Level::ENV;
/// A fault plan (TOML array of tables, the same syntax as `[[faults]]` in the config).
pub const FAULTS: &str = "GRADBUS_FAULTS";
/// Non-empty: rank 0 prints the outlier rule's numbers per bucket every update (`sdc-trace STEP
/// UPDATE ATTEMPT excess:spread:isolation ...`, binades; NaN before the history is long enough).
pub const SDC_TRACE: &str = "GRADBUS_SDC_TRACE";

/// A program the launcher starts in place of `gradbus worker` (a path; it gets the worker's
/// arguments); for tests and debugging. Read by the launcher only; unset, the launcher starts its
/// own executable with `worker`.
pub const WORKER_BIN: &str = "GRADBUS_WORKER_BIN";

/// Open MPI's variables.
pub const OMPI_RANK: &str = "OMPI_COMM_WORLD_RANK";
/// Open MPI world size.
pub const OMPI_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
/// Open MPI local rank.
pub const OMPI_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
/// Open MPI local size.
pub const OMPI_LOCAL_SIZE: &str = "OMPI_COMM_WORLD_LOCAL_SIZE";
/// MPICH / PMI rank.
pub const PMI_RANK: &str = "PMI_RANK";
/// MPICH / PMI size.
pub const PMI_SIZE: &str = "PMI_SIZE";
/// MPICH local rank.
pub const MPICH_LOCAL_RANK: &str = "MPI_LOCALRANKID";
/// MPICH local size.
pub const MPICH_LOCAL_SIZE: &str = "MPI_LOCALNRANKS";
/// PMIx rank (set by `srun --mpi=pmix` and by Open MPI's own launcher beside their variables).
pub const PMIX_RANK: &str = "PMIX_RANK";

/// Slurm: global rank of this task in its job step.
pub const SLURM_PROCID: &str = "SLURM_PROCID";
/// Slurm: tasks in the job step (`srun` sets it for the step; in a batch script it is the job's).
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// Slurm: tasks in this job step (set by `srun` only).
pub const SLURM_STEP_NUM_TASKS: &str = "SLURM_STEP_NUM_TASKS";
/// Slurm: rank of this task among the step's tasks on its node.
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
/// Slurm: index of this node among the step's nodes.
pub const SLURM_NODEID: &str = "SLURM_NODEID";
/// Slurm: nodes of the step (set by `srun`).
pub const SLURM_STEP_NUM_NODES: &str = "SLURM_STEP_NUM_NODES";
/// Slurm: nodes of the job.
pub const SLURM_NNODES: &str = "SLURM_NNODES";
/// Slurm: nodes of the job (the newer name of `SLURM_NNODES`).
pub const SLURM_JOB_NUM_NODES: &str = "SLURM_JOB_NUM_NODES";
/// Slurm: tasks on each node of the step, compressed (`2(x3),1` = 2,2,2,1).
pub const SLURM_STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";
/// Slurm: tasks on each node of the job, same format.
pub const SLURM_TASKS_PER_NODE: &str = "SLURM_TASKS_PER_NODE";
/// Slurm: `--ntasks-per-node`, one number, when it was given.
pub const SLURM_NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
/// Slurm: the job id.
pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
/// Slurm: the step id; set for the tasks of an `srun` step, never in a batch script, which is how a
/// rank tells a launch from the allocation it runs in.
pub const SLURM_STEP_ID: &str = "SLURM_STEP_ID";

/// The GPUs a process may use, renumbered from 0 by CUDA (Slurm sets it per job, or per task with
/// `--gpus-per-task` / `--gpu-bind`).
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
