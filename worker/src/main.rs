//! `gradbus-worker`: one rank of a gradbus job. Thin: parse, run, map the outcome to an exit code.
//!
//! Usage: `gradbus-worker [--run-dir DIR] [--resume] CONFIG.toml [--set key=value ...]`
//! Rank and sizes come from the launcher's `GRADBUS_*` variables, or from a bare `mpirun`.

use std::process::ExitCode;

use gradbus_worker::exit::Code;
use gradbus_worker::WorkerArgs;

const USAGE: &str = "usage: gradbus-worker [--run-dir DIR] [--resume] CONFIG.toml [--set key=value ...]";

fn parse() -> Result<WorkerArgs, String> {
    use lexopt::prelude::*;
    let mut args = WorkerArgs::default();
    let mut config = None;
    let mut p = lexopt::Parser::from_env();
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        match arg {
            Long("run-dir") => args.run_dir = Some(p.value().map_err(|e| e.to_string())?.into()),
            Long("resume") => args.resume = true,
            Long("set") => {
                args.overrides.push(p.value().map_err(|e| e.to_string())?.string().map_err(|e| e.to_string())?)
            }
            Long("help") | Short('h') => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            Value(v) if config.is_none() => config = Some(v.into()),
            other => return Err(other.unexpected().to_string()),
        }
    }
    args.config = config.ok_or("missing CONFIG.toml")?;
    Ok(args)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    // Hidden: one process of the all-reduce benchmark under mpirun (see worker/src/bench.rs).
    let mut raw = std::env::args_os().skip(1);
    if raw.next().is_some_and(|a| a == "--bench-allreduce") {
        return match gradbus_worker::bench::main(raw.collect()) {
            Ok(()) => Code::Done.exit_code(),
            Err(e) => {
                eprintln!("gradbus-worker --bench-allreduce: {e}\n{}", gradbus_worker::bench::USAGE);
                Code::Usage.exit_code()
            }
        };
    }
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gradbus-worker: {e}\n{USAGE}");
            return Code::Usage.exit_code();
        }
    };
    match gradbus_worker::run(&args) {
        Ok(code) => code.exit_code(),
        Err(e) => {
            let rank = std::env::var(gradbus_worker::env::RANK).unwrap_or_else(|_| "?".into());
            eprintln!("gradbus-worker rank {rank}: error: {e}");
            e.code().exit_code()
        }
    }
}
