//! The exit-code policy of every gradbus binary, written down once. The README's table is this enum.

/// Process exit codes shared by `gradbus` and its `worker` subcommand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    /// The job finished.
    Done = 0,
    /// Bad usage, config, hostfile or other input.
    Usage = 2,
    /// Every rank agreed to abort on non-finite gradients.
    NonFinite = 3,
    /// A rank failed (crashed, killed, exited non-zero).
    RankFailed = 4,
    /// A collective timed out waiting for a rank.
    Timeout = 5,
    /// Interrupted by SIGINT/SIGTERM.
    Interrupted = 130,
}

impl Code {
    /// The code as a process exit code.
    pub fn exit_code(self) -> std::process::ExitCode {
        std::process::ExitCode::from(self as u8)
    }

    /// The code a raw exit status maps to, if it is one of ours.
    pub fn from_status(code: i32) -> Option<Code> {
        [Code::Done, Code::Usage, Code::NonFinite, Code::RankFailed, Code::Timeout, Code::Interrupted]
            .into_iter()
            .find(|c| *c as i32 == code)
    }
}
