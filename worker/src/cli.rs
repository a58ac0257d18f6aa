//! `gradbus worker`: one rank of a gradbus job, as a function from its arguments to an exit code.
//!
//! The `gradbus` binary (launcher crate) hands everything after `worker` to [`main_with_args`]; the
//! launcher starts its ranks that way (`gradbus worker --run-dir DIR CONFIG ...`), and so does a user
//! under a bare `mpirun -np N gradbus worker CONFIG`. Rank and sizes come from the launcher's
//! `GRADBUS_*` variables or from the MPI launcher's own (see [`crate::env`]). Thin: parse, run, map
//! the outcome to an exit code of [`Code`]; every error is printed once, naming the rank.

use std::ffi::OsString;

use crate::exit::Code;
use crate::WorkerArgs;

/// `gradbus worker --help`.
pub const USAGE: &str = "\
usage: gradbus worker [--run-dir DIR] [--resume | --overwrite] CONFIG.toml [--set key=value ...]
       gradbus worker --bench-allreduce [BENCH FLAGS: see `gradbus bench --help`]
One rank of a job: started by `gradbus run`, or by a bare `mpirun -np N gradbus worker CONFIG.toml`.
Rank 0 owns the run directory (unless its launcher does): a directory in use by another job, or
holding an earlier run without --resume or --overwrite (which deletes that run first), is exit 2.";

/// What the arguments ask for.
#[derive(Debug)]
enum Parsed {
    /// `--help`.
    Help,
    /// Train one rank.
    Train(WorkerArgs),
}

fn parse(args: Vec<OsString>) -> Result<Parsed, String> {
    use lexopt::prelude::*;
    let err = |e: lexopt::Error| e.to_string();
    let mut out = WorkerArgs::default();
    let mut config = None;
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(err)? {
        match arg {
            Long("run-dir") => out.run_dir = Some(p.value().map_err(err)?.into()),
            Long("resume") => out.resume = true,
            Long("overwrite") => out.overwrite = true,
            Long("set") => out.overrides.push(p.value().map_err(err)?.string().map_err(err)?),
            Long("help") | Short('h') => return Ok(Parsed::Help),
            Value(v) if config.is_none() => config = Some(v.into()),
            other => return Err(other.unexpected().to_string()),
        }
    }
    out.config = config.ok_or("missing CONFIG.toml")?;
    if out.resume && out.overwrite {
        return Err("--resume and --overwrite: continue the run, or delete it, not both".into());
    }
    Ok(Parsed::Train(out))
}

/// Runs one rank (or, after `--bench-allreduce`, one process of a benchmark, see
/// [`crate::bench`]) with the arguments after `worker`; returns its exit code.
pub fn main_with_args(args: Vec<OsString>) -> Code {
    if args.first().is_some_and(|a| a == "--bench-allreduce") {
        return match crate::bench::main(args[1..].to_vec()) {
            Ok(()) => Code::Done,
            Err(e) => {
                let rank = std::env::var(crate::env::RANK).unwrap_or_else(|_| "?".into());
                eprintln!("gradbus worker --bench-allreduce rank {rank}: error: {e}");
                e.code()
            }
        };
    }
    let args = match parse(args) {
        Ok(Parsed::Train(a)) => a,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return Code::Done;
        }
        Err(e) => {
            eprintln!("gradbus worker: {e}\n{USAGE}");
            return Code::Usage;
        }
    };
    match crate::run(&args) {
        Ok(code) => code,
        Err(e) => {
            let rank = std::env::var(crate::env::RANK).unwrap_or_else(|_| "?".into());
            eprintln!("gradbus worker rank {rank}: error: {e}");
            e.code()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Parsed, String> {
        parse(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn parses_the_flags_the_launcher_passes() {
        let Parsed::Train(a) = p(&["--run-dir", "/r", "--resume", "c.toml", "--set", "steps=2"]).unwrap() else {
            panic!("not a training command")
        };
        assert_eq!(a.run_dir.as_deref(), Some(std::path::Path::new("/r")));
        assert!(a.resume);
        assert_eq!(a.config, std::path::PathBuf::from("c.toml"));
        assert_eq!(a.overrides, ["steps=2"]);
        assert!(matches!(p(&["--help"]), Ok(Parsed::Help)));
    }

    #[test]
    fn bad_arguments_are_usage_errors() {
        assert_eq!(p(&[]).unwrap_err(), "missing CONFIG.toml");
        assert!(p(&["a.toml", "b.toml"]).is_err());
        assert!(p(&["--frob", "a.toml"]).is_err());
        assert!(p(&["--resume", "--overwrite", "a.toml"]).is_err());
        assert_eq!(main_with_args(vec!["--no-such-flag".into()]), Code::Usage);
        assert_eq!(main_with_args(vec!["--bench-allreduce".into(), "--frob".into()]), Code::Usage);
    }
}
