//! The environment contract between the launcher and its workers, in one place.
//!
//! The launcher sets every `GRADBUS_*` variable below for each worker it spawns. Under a bare
//! `mpirun`, the rank and sizes come from the MPI launcher's own variables instead (Open MPI's
//! `OMPI_COMM_WORLD_*`, MPICH's `PMI_*`), and the job id from `GRADBUS_JOB_ID` if exported, else from
//! the MPI job's identity.

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
/// A fault plan (TOML array of tables, the same syntax as `[[faults]]` in the config).
pub const FAULTS: &str = "GRADBUS_FAULTS";

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
