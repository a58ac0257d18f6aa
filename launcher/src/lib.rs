//! The `gradbus` launcher library: everything behind the thin `gradbus` binary.
//!
//! - [`cli`] parses the command line into a [`cli::Command`] and dispatches it, one match arm per
//!   subcommand; [`usage`] holds what the subcommands' parsers share. `gradbus worker` (one rank)
//!   is the worker library's `cli::main_with_args`: one binary is the whole tool.
//! - [`hostfile`] (text -> raw entries with line numbers) and [`plan`] (entries -> a validated
//!   [`plan::LaunchPlan`]) are the two parsing stages of a launch.
//! - [`run`] is `gradbus run`: plan, run directory, worker environment (each rank is this
//!   executable's `worker` subcommand), then [`supervise`], which
//!   spawns any set of processes, prefixes and logs their output, tears the job down on the first
//!   failure or on a signal, and maps the ends to the exit-code policy of
//!   `gradbus_worker::exit::Code`.
//! - [`bench`](mod@crate::bench) is `gradbus bench allreduce`: N supervised workers
//!   (`gradbus worker --bench-allreduce`) run the collectives' benchmark; rank 0's result is relayed.
//! - [`report`] is `gradbus report`: the summary of a run directory and its `report.svg`.
//! - [`mpirun`] and [`srun`] build the `mpirun` and `srun` command lines; [`shm`] sweeps a job's leftover shared memory
//!   and the stale segments of dead launchers;
//!   [`progress`] is the hook for a progress display; [`signals`] counts SIGINT/SIGTERM/SIGHUP.
//!
//! Invariant across the crate: once a worker has been started, every path out of the launcher
//! (success, failure, signal, even SIGKILL of the launcher) leaves no worker process behind.

pub mod bench;
pub mod cli;
mod error;
pub mod hostfile;
pub mod mpirun;
pub mod plan;
pub mod progress;
pub mod replay;
pub mod report;
pub mod run;
pub mod shm;
pub mod signals;
pub mod srun;
pub mod supervise;
pub mod usage;

pub use error::Error;
