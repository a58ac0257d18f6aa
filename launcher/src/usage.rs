//! What every subcommand's parser shares: its outcome ([`Parsed`]: the arguments, or a help text to
//! print) and the conversion of `lexopt`'s errors into usage errors (exit 2, with a hint).
//!
//! It sits below `cli` and the subcommand modules: `cli` -> `run`, `bench` -> `usage`, and no
//! subcommand module imports `cli` (the import graph of the launcher's command line has no cycle).

use crate::Error;

/// What a subcommand's parser found on the command line.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed<T> {
    /// `--help` (or `-h`) was given: print this text and exit 0.
    Help(&'static str),
    /// The subcommand's validated arguments.
    Args(T),
}

/// Turns a lexopt error into a usage error with `hint`.
pub fn lex(e: lexopt::Error, hint: &str) -> Error {
    Error::usage(e.to_string(), hint)
}
