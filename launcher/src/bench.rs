//! `gradbus bench allreduce`: the shm all-reduce benchmark of `gradbus_collectives::bench`, run by
//! N processes that the launcher starts and supervises like the ranks of a job.
//!
//! The benchmark's flags are parsed by the worker crate's one parser
//! (`gradbus_worker::bench::BenchFlags`); this module adds `--np`, `--run-dir` and `--help`. The
//! launcher starts N copies of the worker (`gradbus worker --bench-allreduce FLAGS --out FILE`),
//! each with the environment of a rank ([`run::local_specs`]), under [`run::supervise_job`]: a
//! failing or hanging rank is torn down and reported like a training rank, and the job's segment is
//! swept afterwards. Rank 0 writes the formatted result (the table, or JSON lines with `--json`) to
//! `RUN_DIR/result.txt` and prints nothing, and the launcher copies that file to its stdout once
//! every rank has exited 0. So with `--json` the launcher's stdout holds only the JSON lines;
//! everything else goes to stderr. `--transport mpi|hier` starts the same worker command under
//! `mpirun` instead, where rank 0 prints.

use std::io::Write;
use std::path::PathBuf;

use gradbus_collectives::bench::BenchTransport;
use gradbus_worker::bench::BenchFlags;
use gradbus_worker::exit::Code;

use crate::mpirun::{self, MpirunSpec};
use crate::plan::LaunchPlan;
use crate::progress::Silent;
use crate::run;
use crate::supervise::Options;
use crate::usage::{lex, Parsed};
use crate::Error;

/// `gradbus bench --help`.
pub const HELP: &str = "\
gradbus bench - measure the shared-memory all-reduce

USAGE:
    gradbus bench allreduce [OPTIONS]

OPTIONS:
    --np N            processes (default: 2)
    --sizes LIST      message sizes per rank, comma-separated, binary units
                      (default: 1MiB,16MiB,64MiB,256MiB; multiples of 4 bytes)
    --iters K         timed all-reduces per round (default: 20)
    --warmup W        untimed all-reduces per size (default: 3)
    --timeout S       deadline of every barrier in seconds (default: 120)
    --transport T     shm (default: the shared-memory bus alone), mpi (also MPI_Allreduce of the
                      same bytes over the same processes), hier (also the hierarchical path over
                      --nodes K fake nodes); mpi and hier start the ranks with `mpirun` and need
                      a build with `--features mpi`
    --nodes K         fake nodes for --transport hier (default: 2)
    --json            one JSON object per size and line on stdout, nothing else
    --run-dir DIR     keep the ranks' logs and the result in DIR (default: a temporary
                      directory, removed after a successful run)
    -h, --help        print this help

Prints an nccl-tests-like table: time, algbw = bytes/time, busbw = algbw * 2(n-1)/n, #wrong
(elements differing from the exact sum), the single-thread memcpy/scan/read ceilings of the same
bytes, and the cost of the fused validation (valid+, percent). Segments take sum(sizes) per rank
in /dev/shm.
";

/// The validated command line of `gradbus bench allreduce`.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchCmd {
    /// `--np`.
    pub np: usize,
    /// `--run-dir`.
    pub run_dir: Option<PathBuf>,
    /// The benchmark's own flags.
    pub flags: BenchFlags,
}

fn hint() -> &'static str {
    "see `gradbus bench --help`"
}

/// Parses the arguments after `bench`.
pub fn parse(parser: &mut lexopt::Parser) -> Result<Parsed<BenchCmd>, Error> {
    use lexopt::prelude::*;
    let h = hint();
    let mut cmd = BenchCmd { np: 2, run_dir: None, flags: BenchFlags::default() };
    let mut what: Option<String> = None;
    while let Some(arg) = parser.next().map_err(|e| lex(e, h))? {
        match arg {
            Short('h') | Long("help") => return Ok(Parsed::Help(HELP)),
            Long("np") | Short('n') => {
                let v = parser.value().map_err(|e| lex(e, h))?;
                cmd.np = v.to_str().and_then(|s| s.parse().ok()).ok_or_else(|| {
                    Error::usage(format!("--np {}: not a whole number", v.to_string_lossy()), "e.g. --np 2")
                })?;
            }
            Long("run-dir") => cmd.run_dir = Some(PathBuf::from(parser.value().map_err(|e| lex(e, h))?)),
            Long("out") => return Err(Error::usage("--out: the launcher picks the result file", h)),
            Long(flag) => {
                let flag = flag.to_owned();
                if !cmd.flags.parse_long(&flag, parser)? {
                    return Err(lex(Long(&flag).unexpected(), h));
                }
            }
            Value(v) if what.is_none() => what = Some(v.to_string_lossy().into_owned()),
            Value(v) => {
                return Err(Error::usage(format!("unexpected argument `{}`", v.to_string_lossy()), h));
            }
            other => return Err(lex(other.unexpected(), h)),
        }
    }
    match what.as_deref() {
        Some("allreduce") => {}
        None => return Err(Error::usage("missing benchmark name", "usage: gradbus bench allreduce [OPTIONS]")),
        Some(other) => {
            return Err(Error::usage(format!("unknown benchmark `{other}`"), "the one benchmark is `allreduce`"))
        }
    }
    Ok(Parsed::Args(cmd))
}

/// `--transport mpi|hier`: the same benchmark with `MPI_Allreduce` beside the bus, every process
/// started by `mpirun` (`gradbus worker --bench-allreduce`); rank 0 prints the table.
fn execute_mpirun(cmd: &BenchCmd) -> Result<Code, Error> {
    let mpirun = mpirun::find_on_path("mpirun", std::env::var_os("PATH").as_deref()).ok_or(Error::MpirunMissing)?;
    let worker = run::worker_command()?;
    let worker_args = std::iter::once("--bench-allreduce".into()).chain(cmd.flags.to_args()).collect();
    let spec = MpirunSpec {
        mpirun,
        hostfile: None,
        np: cmd.np,
        oversubscribe: true,
        as_root: mpirun::running_as_root(),
        exports: std::env::var_os("RUST_LOG").map(|_| "RUST_LOG".to_string()).into_iter().collect(),
        worker: worker.program.clone(),
        worker_args: worker.args(worker_args),
    };
    let argv = mpirun::command_line(&spec);
    eprintln!("gradbus: bench allreduce: {}", argv.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" "));
    let status = std::process::Command::new(&argv[0]).args(&argv[1..]).status().map_err(|source| Error::Spawn {
        label: "mpirun".into(),
        program: spec.mpirun.clone(),
        source,
    })?;
    Ok(status.code().and_then(Code::from_status).unwrap_or(Code::RankFailed))
}

/// Executes `gradbus bench allreduce`.
pub fn execute(cmd: BenchCmd) -> Result<Code, Error> {
    if cmd.flags.transport != BenchTransport::Shm {
        return execute_mpirun(&cmd);
    }
    let plan = LaunchPlan::local(cmd.np)?;
    let worker = run::worker_command()?;
    let job_id = run::new_job_id();
    let keep = cmd.run_dir.is_some();
    let dir = cmd.run_dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("gradbus-bench-{job_id}")));
    std::fs::create_dir_all(&dir).map_err(|source| Error::RunDir {
        path: dir.clone(),
        source,
        hint: "pick a writable place with --run-dir DIR".into(),
    })?;
    let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
    let out = dir.join("result.txt");
    let _ = std::fs::remove_file(&out);
    eprintln!(
        "gradbus: bench allreduce: job {job_id}: {} process(es), {} size(s), run dir {}",
        cmd.np,
        cmd.flags.sizes.len(),
        dir.display()
    );
    let flags = BenchFlags { out: Some(out.clone()), ..cmd.flags.clone() };
    let args = worker.args(std::iter::once("--bench-allreduce".into()).chain(flags.to_args()).collect());
    let specs = run::local_specs(&plan, &worker.program, &args, &job_id, &dir);
    let outcome = run::supervise_job(specs, &Options::default(), &mut Silent, &job_id)?;
    let code = outcome.code();
    if code != Code::Done {
        eprintln!("gradbus: the ranks' logs are in {}", dir.display());
        return Ok(code);
    }
    let text = std::fs::read_to_string(&out).map_err(|source| Error::RunDir {
        path: out.clone(),
        source,
        hint: "rank 0 exited 0 without writing its result; see rank-0.log beside it".into(),
    })?;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush());
    if !keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(Code::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gradbus bench ARGS` parsed the way `cli` does.
    fn p(args: &[&str]) -> Result<Parsed<BenchCmd>, Error> {
        parse(&mut lexopt::Parser::from_args(args))
    }

    #[test]
    fn parses_the_benchmark_and_its_defaults() {
        let Parsed::Args(b) = p(&["allreduce"]).unwrap() else { panic!() };
        assert_eq!((b.np, &b.flags), (2, &BenchFlags::default()));
        assert_eq!(b.flags.sizes, [1 << 20, 16 << 20, 64 << 20, 256 << 20]);
        let Parsed::Args(b) = p(&["--np", "3", "allreduce", "--sizes", "4KiB,1MiB", "--json", "--iters", "5"]).unwrap()
        else {
            panic!()
        };
        assert_eq!((b.np, b.flags.iters, b.flags.json), (3, 5, true));
        assert_eq!(b.flags.sizes, [4096, 1 << 20]);
        for t in [BenchTransport::Mpi, BenchTransport::Hier] {
            let Parsed::Args(b) = p(&["allreduce", "--transport", &t.to_string()]).unwrap() else { panic!() };
            assert_eq!(b.flags.transport, t);
        }
    }

    #[test]
    fn bad_bench_usage_is_exit_2_with_a_hint() {
        for bad in [
            &[][..],
            &["broadcast"],
            &["allreduce", "--sizes", "3"],
            &["allreduce", "--sizes", ""],
            &["allreduce", "--np", "two"],
            &["allreduce", "--iters", "0"],
            &["allreduce", "--timeout", "-1"],
            &["allreduce", "extra"],
            &["allreduce", "--transport", "tcp"],
            &["allreduce", "--transport", "SHM"],
            &["allreduce", "--out", "f"],
            &["allreduce", "--frob"],
        ] {
            let e = p(bad).unwrap_err();
            assert_eq!(e.code(), Code::Usage, "{bad:?}");
            assert!(e.to_string().contains("hint:"), "{bad:?}: {e}");
        }
        let e = p(&["allreduce", "--transport", "tcp"]).unwrap_err().to_string();
        assert!(e.contains("--transport tcp: unknown transport") && e.contains("use shm, mpi or hier"), "{e}");
        assert_eq!(p(&["--help"]).unwrap(), Parsed::Help(HELP));
    }
}
