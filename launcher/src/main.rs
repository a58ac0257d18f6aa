//! `gradbus`: the launcher binary. All logic is in the `gradbus` library (`launcher/src/lib.rs`);
//! this file only wires `main -> run(parse()) -> ExitCode` and prints errors with their chain.
//!
//! Exit codes are the policy of `gradbus_worker::exit::Code`, the one place they are defined:
//! 0 done; 2 usage, config or input error (hostfile line, missing file, missing worker or mpirun);
//! 3 every rank aborted on non-finite gradients; 4 a rank failed (non-zero exit other than a shared
//! gradbus code, or killed by a signal); 5 a collective timed out (the first failing rank exited 5);
//! 130 the launcher was interrupted by SIGINT, SIGTERM or SIGHUP. `gradbus --help` prints the table.

use std::process::ExitCode;

use gradbus::cli::{self, Command};
use gradbus_worker::exit::Code;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).format_target(false).init();
    match run(cli::parse(std::env::args_os().skip(1))) {
        Ok(code) => code.exit_code(),
        Err(err) => {
            eprintln!("gradbus: error: {err:#}");
            err.downcast_ref::<gradbus::Error>().map_or(Code::Usage, gradbus::Error::code).exit_code()
        }
    }
}

fn run(cmd: Result<Command, gradbus::Error>) -> anyhow::Result<Code> {
    Ok(cli::execute(cmd?)?)
}
