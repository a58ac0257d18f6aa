//! The launcher library's one error type.
//!
//! Every variant names what the user has to look at (the file and line, the flag, the path that was
//! searched) and, where there is one, a hint that says what to do about it. Each variant maps to one
//! exit code of the policy in `gradbus_worker::exit::Code` through [`Error::code`]: everything the
//! user can fix by changing the command line or an input file is `Usage` (2).

use std::path::PathBuf;

use gradbus_worker::exit::Code;

/// Errors of the `gradbus` launcher library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line is wrong: unknown flag, missing value, bad number, missing argument.
    #[error("{message}\n  hint: {hint}")]
    Usage {
        /// What is wrong, naming the flag or argument.
        message: String,
        /// What to do instead.
        hint: String,
    },

    /// The hostfile could not be read at all.
    #[error("cannot read hostfile {}: {source}\n  hint: check the path given to --hostfile", path.display())]
    HostfileRead {
        /// The hostfile's path as given.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },

    /// A line of the hostfile is malformed or contradicts another line.
    #[error("{}:{line}: {message}\n  hint: {hint}", path.display())]
    Hostfile {
        /// The hostfile's path as given.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        message: String,
        /// How to fix it.
        hint: String,
    },

    /// The hostfile lists no host at all (only comments and blank lines).
    #[error("{}: the hostfile lists no host\n  hint: add a line such as `localhost slots=4` (see hostfile.example)", path.display())]
    HostfileEmpty {
        /// The hostfile's path as given.
        path: PathBuf,
    },

    /// More ranks were asked for than the plan has slots.
    #[error("--np {np} asks for more ranks than the {slots} slot(s) {where_}\n  hint: {hint}")]
    NotEnoughSlots {
        /// Ranks asked for.
        np: usize,
        /// Slots available.
        slots: u64,
        /// Where the slots come from ("of hostfile FILE").
        where_: String,
        /// How to fix it.
        hint: String,
    },

    /// The config file given on the command line does not exist or is not a readable file.
    #[error("config file {}: {reason}\n  hint: pass the path of a TOML config, e.g. examples/tiny.toml", path.display())]
    Config {
        /// The config path as given.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },

    /// The worker crate's own checks, run by the launcher before any rank starts (the config's
    /// content, whether this machine can run it): names the key, with a hint.
    #[error(transparent)]
    Worker(#[from] gradbus_worker::WorkerError),

    /// The worker binary was not found where the launcher looked.
    #[error("worker binary not found: {}\n  hint: {hint}", path.display())]
    WorkerMissing {
        /// The path that was looked at.
        path: PathBuf,
        /// Where it should come from.
        hint: String,
    },

    /// `mpirun` is not on PATH.
    #[error("`mpirun` not found on PATH\n  hint: install Open MPI (`apt-get install openmpi-bin libopenmpi-dev`), or use --launcher local")]
    MpirunMissing,

    /// The run directory could not be created or used.
    #[error("run directory {}: {source}\n  hint: {hint}", path.display())]
    RunDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
        /// How to fix it.
        hint: String,
    },

    /// A process of the job could not be started (the others already started were stopped).
    #[error("cannot start {label} ({}): {source}\n  hint: check that the file is an executable for this machine", program.display())]
    Spawn {
        /// The process's label, e.g. "rank 3".
        label: String,
        /// The program that was executed.
        program: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },

    /// A per-rank log file could not be created.
    #[error("cannot create log file {}: {source}\n  hint: check that the run directory is writable", path.display())]
    LogFile {
        /// The log file's path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },

    /// The launcher's own signal handler could not be installed.
    #[error("cannot install the signal handler: {0}")]
    Signals(String),
}

impl Error {
    /// The exit code this error ends the launcher with.
    pub fn code(&self) -> Code {
        match self {
            Error::Worker(e) => e.code(),
            // Nothing of the job ran (or what ran was stopped before it did anything): the cause is
            // an input, a path or the environment the user controls.
            Error::Usage { .. }
            | Error::HostfileRead { .. }
            | Error::Hostfile { .. }
            | Error::HostfileEmpty { .. }
            | Error::NotEnoughSlots { .. }
            | Error::Config { .. }
            | Error::WorkerMissing { .. }
            | Error::MpirunMissing
            | Error::RunDir { .. }
            | Error::Spawn { .. }
            | Error::LogFile { .. }
            | Error::Signals(_) => Code::Usage,
        }
    }

    /// A usage error with a hint.
    pub fn usage(message: impl Into<String>, hint: impl Into<String>) -> Error {
        Error::Usage { message: message.into(), hint: hint.into() }
    }
}
