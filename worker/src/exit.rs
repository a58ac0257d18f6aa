//! The exit-code policy of every gradbus binary, written down once: the codes, what each means, and
//! which of them every rank of a job ends with together. The README's table and `gradbus --help`'s
//! are this enum; the launcher's job-level rule (`supervise::Outcome::code`) is built from it.

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
    /// Every code of the policy.
    pub const ALL: [Code; 6] =
        [Code::Done, Code::Usage, Code::NonFinite, Code::RankFailed, Code::Timeout, Code::Interrupted];

    /// What the code means, in a few words (the launcher's summary line).
    pub fn describe(self) -> &'static str {
        match self {
            Code::Done => "done",
            Code::Usage => "usage or config error",
            Code::NonFinite => "aborted on non-finite gradients",
            Code::RankFailed => "a rank failed",
            Code::Timeout => "a collective timed out",
            Code::Interrupted => "interrupted",
        }
    }

    /// Whether every rank of a job may end with this code at about the same time, each on its
    /// own: the same bad config (2), the agreed abort (3), a collective deadline every waiting
    /// rank sees (5). The launcher gives the other ranks a moment to end alike before it tears the
    /// job down, and a job whose every process ended with one such code ends with it.
    pub fn ends_every_rank(self) -> bool {
        matches!(self, Code::Usage | Code::NonFinite | Code::Timeout)
    }

    /// Whether a job whose every rank ended with this code blames no rank: the ranks decided it
    /// together (the agreed abort) or all saw the same bad input. A timeout blames the rank that
    /// did not arrive.
    pub fn blames_no_rank(self) -> bool {
        matches!(self, Code::Usage | Code::NonFinite)
    }

    /// The code as a process exit code.
    pub fn exit_code(self) -> std::process::ExitCode {
        std::process::ExitCode::from(self as u8)
    }

    /// The code a raw exit status maps to, if it is one of ours.
    pub fn from_status(code: i32) -> Option<Code> {
        Code::ALL.into_iter().find(|c| *c as i32 == code)
    }
}
