//! The `gradbus` command line: parse into a [`Command`], then [`execute`] it.
//!
//! Adding a subcommand is two match arms: one in [`parse`] that hands the `lexopt` parser to the
//! subcommand module's own `parse` (which returns its arguments or its help text, a
//! [`Parsed`]), and one in [`execute`] that calls the module's `execute` and returns its exit
//! [`Code`]. The subcommand modules never import this one (no cycle). Parsing never starts anything
//! and never panics; every mistake is an [`Error`] with a hint, exit 2.
//!
//! `gradbus worker` is one rank of a job: the launcher starts its own executable with it (and a user
//! may, under a bare `mpirun`); its arguments go unparsed to `gradbus_worker::cli::main_with_args`.

use std::ffi::OsString;

use gradbus_worker::exit::Code;

use crate::bench::BenchCmd;
use crate::run::{self, RunArgs};
use crate::usage::{lex, Parsed};
use crate::Error;

/// `gradbus --help`. The exit-code table is `gradbus_worker::exit::Code` (a test keeps them equal).
pub const HELP: &str = "\
gradbus - data-parallel training with a validated shared-memory gradient bus

USAGE:
    gradbus run [OPTIONS] CONFIG.toml [--set key=value ...]   start and supervise a job
    gradbus replay DUMP [--trace] [--json]
    gradbus bench allreduce [--np N] [--sizes LIST] [--json]  measure the shm all-reduce
    gradbus report RUN_DIR [--margin NATS] [--z-limit Z]      summary and RUN_DIR/report.svg
    gradbus worker [--run-dir DIR] [--resume] CONFIG.toml [--set key=value ...]
                                                  one rank (started by `run`, or by a bare mpirun)
    gradbus --help | gradbus run --help | gradbus bench --help | gradbus worker --help
    gradbus --version                             the version and the git commit it was built from

EXIT CODES (gradbus_worker::exit::Code):
    0    done
    2    usage, config or input error (the message names the file, line or key)
    3    every rank agreed to abort on non-finite gradients
    4    a rank failed (crashed, killed by a signal, exited with another code)
    5    a collective timed out waiting for a rank
    130  interrupted (SIGINT, SIGTERM or SIGHUP to the launcher)

ENVIRONMENT:
    RUST_LOG               the launcher's verbosity (env_logger); exported to the workers
    GRADBUS_WORKER_BIN     a program to start in place of `gradbus worker` (tests and debugging)
";

/// A parsed command line.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Print this help text and exit 0.
    Help(&'static str),
    /// `gradbus --version`: print the version and commit, exit 0.
    Version,
    /// `gradbus run`.
    Run(RunArgs),
    /// `gradbus replay` (arguments not parsed yet).
    Replay(Vec<OsString>),
    /// `gradbus bench allreduce`.
    Bench(BenchCmd),
    /// `gradbus report` (its module parses the arguments).
    Report(Vec<OsString>),
    /// `gradbus worker`: one rank (the worker library parses the arguments).
    Worker(Vec<OsString>),
    /// The hidden `gradbus __sweep-shm JOB`: remove job JOB's shared-memory segments on this node
    /// (one task per node of the sweep step after a multi-node `srun`, see `srun::sweep_command_line`).
    SweepShm(String),
}

/// A subcommand parser's outcome as a [`Command`]: its help text, or `args` wrapped by `wrap`.
fn command<T>(parsed: Result<Parsed<T>, Error>, wrap: impl FnOnce(T) -> Command) -> Result<Command, Error> {
    Ok(match parsed? {
        Parsed::Help(text) => Command::Help(text),
        Parsed::Args(args) => wrap(args),
    })
}

/// Parses the arguments after the program name.
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Command, Error> {
    use lexopt::prelude::*;
    let hint = "see `gradbus --help`";
    let mut parser = lexopt::Parser::from_args(args);
    let arg = parser.next().map_err(|e| lex(e, hint))?;
    match arg {
        None => Err(Error::usage("missing subcommand", "try `gradbus run --help`")),
        Some(Short('h') | Long("help")) => Ok(Command::Help(HELP)),
        Some(Short('V') | Long("version")) => Ok(Command::Version),
        Some(Value(v)) => match v.to_str() {
            Some("run") => command(run::parse(&mut parser), Command::Run),
            Some("replay") => Ok(Command::Replay(rest(&mut parser))),
            Some("bench") => command(crate::bench::parse(&mut parser), Command::Bench),
            Some("report") => Ok(Command::Report(rest(&mut parser))),
            Some("worker") => Ok(Command::Worker(rest(&mut parser))),
            Some("__sweep-shm") => match rest(&mut parser).as_slice() {
                [job] => Ok(Command::SweepShm(job.to_string_lossy().into_owned())),
                _ => {
                    Err(Error::usage("__sweep-shm takes one job id", "it is started by `gradbus run --launcher srun`"))
                }
            },
            Some("help") => Ok(Command::Help(HELP)),
            _ => Err(Error::usage(
                format!("unknown subcommand `{}`", v.to_string_lossy()),
                "the subcommands are run, replay, bench, report and worker; see `gradbus --help`",
            )),
        },
        Some(other) => Err(lex(other.unexpected(), hint)),
    }
}

/// The remaining raw arguments (for subcommands that do not parse theirs yet).
fn rest(parser: &mut lexopt::Parser) -> Vec<OsString> {
    parser.raw_args().map(|raw| raw.collect()).unwrap_or_default()
}

/// Executes a parsed command and returns the launcher's exit code.
pub fn execute(cmd: Command) -> Result<Code, Error> {
    // These run kernels here or start ranks that would: a bad `GRADBUS_SIMD` is one message and
    // exit 2 before anything starts (a bare worker checks it too).
    if matches!(cmd, Command::Run(_) | Command::Replay(_) | Command::Bench(_)) {
        gradbus_worker::check_simd()?;
    }
    match cmd {
        Command::Help(text) => {
            print!("{text}");
            Ok(Code::Done)
        }
        Command::Version => {
            println!("gradbus {}", gradbus_artifacts::version::describe());
            Ok(Code::Done)
        }
        Command::Run(args) => run::execute(args),
        Command::Replay(args) => crate::replay::execute(args),
        Command::Bench(args) => crate::bench::execute(args),
        Command::Report(args) => crate::report::execute(args),
        Command::Worker(args) => Ok(gradbus_worker::cli::main_with_args(args)),
        Command::SweepShm(job) => {
            crate::shm::sweep_node(std::path::Path::new(crate::shm::SHM_DIR), &job)?;
            Ok(Code::Done)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Command, Error> {
        parse(args.iter().map(OsString::from))
    }

    #[test]
    fn dispatches_subcommands_and_help() {
        assert_eq!(p(&["--help"]).unwrap(), Command::Help(HELP));
        assert_eq!(p(&["--version"]).unwrap(), Command::Version);
        assert_eq!(p(&["-V"]).unwrap(), Command::Version);
        assert_eq!(p(&["run", "--help"]).unwrap(), Command::Help(run::HELP));
        assert!(matches!(p(&["run", "c.toml"]).unwrap(), Command::Run(_)));
        assert_eq!(p(&["replay", "d", "--x"]).unwrap(), Command::Replay(vec!["d".into(), "--x".into()]));
        assert_eq!(
            p(&["worker", "--run-dir", "r", "c.toml"]).unwrap(),
            Command::Worker(vec!["--run-dir".into(), "r".into(), "c.toml".into()])
        );
        for bad in [&[][..], &["frob"], &["--np", "2"]] {
            let e = p(bad).unwrap_err();
            assert_eq!(e.code(), Code::Usage);
            assert!(e.to_string().contains("hint:"), "{e}");
        }
        assert_eq!(p(&["__sweep-shm", "j7"]).unwrap(), Command::SweepShm("j7".into()));
        assert_eq!(p(&["__sweep-shm"]).unwrap_err().code(), Code::Usage);
        assert_eq!(
            p(&["report", "r", "--margin", "5"]).unwrap(),
            Command::Report(vec!["r".into(), "--margin".into(), "5".into()])
        );
        let e = execute(p(&["report", "/nonexistent/runs/x"]).unwrap()).unwrap_err();
        assert_eq!(e.code(), Code::Usage);
        assert!(e.to_string().contains("metrics.jsonl"), "{e}");
    }

    #[test]
    fn help_lists_every_exit_code_of_the_policy() {
        for code in Code::ALL {
            let line = format!("\n    {:<4} ", code as u8);
            assert!(HELP.contains(&line), "help lacks exit code {}", code as u8);
        }
    }
}
