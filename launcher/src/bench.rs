//! `gradbus bench allreduce`: the shm all-reduce benchmark of `gradbus_collectives::bench`, run by
//! N processes that the launcher starts and supervises like the ranks of a job.
//!
//! The launcher starts N copies of its own executable with the hidden subcommand
//! `gradbus __bench-rank`, each with the environment of a rank ([`run::local_specs`]), under
//! [`run::supervise_job`]: a failing or hanging rank is torn down and reported like a training rank,
//! and the job's segment is swept afterwards. Each rank calls `bench::rank_main`; rank 0 writes the
//! formatted result (the table, or JSON lines with `--json`) to `RUN_DIR/result.txt` and prints
//! nothing, and the launcher copies that file to its stdout once every rank has exited 0. So with
//! `--json` the launcher's stdout holds only the JSON lines; everything else goes to stderr.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gradbus_collectives::bench::{self, BenchArgs, BenchTransport};
use gradbus_worker::env;
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
    /// `--sizes`, in bytes.
    pub sizes: Vec<usize>,
    /// `--iters`.
    pub iters: usize,
    /// `--warmup`.
    pub warmup: usize,
    /// `--timeout`.
    pub timeout: Duration,
    /// `--json`.
    pub json: bool,
    /// `--run-dir`.
    pub run_dir: Option<PathBuf>,
    /// `--transport`.
    pub transport: BenchTransport,
    /// `--nodes`, for `hier`.
    pub nodes: usize,
}

/// The hidden `gradbus __bench-rank` command line (one benchmark process).
#[derive(Clone, Debug, PartialEq)]
pub struct RankCmd {
    /// Message sizes in bytes.
    pub sizes: Vec<usize>,
    /// Timed all-reduces per round.
    pub iters: usize,
    /// Untimed all-reduces per size.
    pub warmup: usize,
    /// Barrier deadline.
    pub timeout: Duration,
    /// Format JSON lines instead of the table.
    pub json: bool,
    /// Where rank 0 writes the formatted result.
    pub out: PathBuf,
}

const DEFAULT_SIZES: &str = "1MiB,16MiB,64MiB,256MiB";

fn hint() -> &'static str {
    "see `gradbus bench --help`"
}

fn number<T: std::str::FromStr>(v: OsString, flag: &str, example: &str) -> Result<T, Error> {
    v.to_str().and_then(|s| s.parse().ok()).ok_or_else(|| {
        Error::usage(format!("{flag} {}: not a whole number", v.to_string_lossy()), format!("e.g. {flag} {example}"))
    })
}

fn sizes(v: OsString) -> Result<Vec<usize>, Error> {
    let s = v.to_string_lossy();
    let sizes =
        bench::parse_sizes(&s).map_err(|e| Error::usage(format!("--sizes {s}: {e}"), "e.g. --sizes 1MiB,64MiB"))?;
    if sizes.is_empty() {
        return Err(Error::usage("--sizes: no size given", "e.g. --sizes 1MiB,64MiB"));
    }
    Ok(sizes)
}

fn seconds(v: OsString) -> Result<Duration, Error> {
    v.to_str()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            Error::usage(format!("--timeout {}: not a number of seconds", v.to_string_lossy()), "e.g. --timeout 60")
        })
}

/// `--transport T`, parsed where it is given.
fn transport(v: OsString) -> Result<BenchTransport, Error> {
    v.to_str().and_then(|s| s.parse().ok()).ok_or_else(|| {
        Error::usage(format!("--transport {}: unknown transport", v.to_string_lossy()), "use shm, mpi or hier")
    })
}

/// Parses the arguments after `bench`.
pub fn parse(parser: &mut lexopt::Parser) -> Result<Parsed<BenchCmd>, Error> {
    use lexopt::prelude::*;
    let h = hint();
    let mut cmd = BenchCmd {
        np: 2,
        sizes: bench::parse_sizes(DEFAULT_SIZES).expect("default sizes parse"),
        iters: 20,
        warmup: 3,
        timeout: Duration::from_secs(120),
        json: false,
        run_dir: None,
        transport: BenchTransport::Shm,
        nodes: 2,
    };
    let mut what: Option<String> = None;
    while let Some(arg) = parser.next().map_err(|e| lex(e, h))? {
        match arg {
            Short('h') | Long("help") => return Ok(Parsed::Help(HELP)),
            Long("np") | Short('n') => cmd.np = number(parser.value().map_err(|e| lex(e, h))?, "--np", "2")?,
            Long("sizes") => cmd.sizes = sizes(parser.value().map_err(|e| lex(e, h))?)?,
            Long("iters") => cmd.iters = number(parser.value().map_err(|e| lex(e, h))?, "--iters", "20")?,
            Long("warmup") => cmd.warmup = number(parser.value().map_err(|e| lex(e, h))?, "--warmup", "3")?,
            Long("timeout") => cmd.timeout = seconds(parser.value().map_err(|e| lex(e, h))?)?,
            Long("json") => cmd.json = true,
            Long("transport") => cmd.transport = transport(parser.value().map_err(|e| lex(e, h))?)?,
            Long("nodes") => cmd.nodes = number(parser.value().map_err(|e| lex(e, h))?, "--nodes", "2")?,
            Long("run-dir") => cmd.run_dir = Some(PathBuf::from(parser.value().map_err(|e| lex(e, h))?)),
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
    if cmd.iters == 0 {
        return Err(Error::usage("--iters 0: nothing would be timed", "use --iters 1 or more"));
    }
    Ok(Parsed::Args(cmd))
}

/// Parses the arguments after the hidden `__bench-rank`.
pub fn parse_rank(parser: &mut lexopt::Parser) -> Result<RankCmd, Error> {
    use lexopt::prelude::*;
    let h = "`__bench-rank` is started by `gradbus bench`, not by hand";
    let (mut sizes_, mut iters, mut warmup, mut timeout) = (None, 20, 3, Duration::from_secs(120));
    let (mut json, mut out) = (false, None);
    while let Some(arg) = parser.next().map_err(|e| lex(e, h))? {
        match arg {
            Long("sizes") => sizes_ = Some(sizes(parser.value().map_err(|e| lex(e, h))?)?),
            Long("iters") => iters = number(parser.value().map_err(|e| lex(e, h))?, "--iters", "20")?,
            Long("warmup") => warmup = number(parser.value().map_err(|e| lex(e, h))?, "--warmup", "3")?,
            Long("timeout") => timeout = seconds(parser.value().map_err(|e| lex(e, h))?)?,
            Long("json") => json = true,
            Long("out") => out = Some(PathBuf::from(parser.value().map_err(|e| lex(e, h))?)),
            other => return Err(lex(other.unexpected(), h)),
        }
    }
    let (Some(sizes), Some(out)) = (sizes_, out) else {
        return Err(Error::usage("__bench-rank needs --sizes and --out", h));
    };
    Ok(RankCmd { sizes, iters, warmup, timeout, json, out })
}

/// The arguments of every benchmark process.
fn rank_args(cmd: &BenchCmd, out: &Path) -> Vec<OsString> {
    let sizes = cmd.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let mut args: Vec<OsString> = vec![
        "__bench-rank".into(),
        "--sizes".into(),
        sizes.into(),
        "--iters".into(),
        cmd.iters.to_string().into(),
        "--warmup".into(),
        cmd.warmup.to_string().into(),
        "--timeout".into(),
        cmd.timeout.as_secs_f64().to_string().into(),
        "--out".into(),
        out.into(),
    ];
    if cmd.json {
        args.push("--json".into());
    }
    args
}

/// `--transport mpi|hier`: the same benchmark with `MPI_Allreduce` beside the bus, every process
/// started by `mpirun` (`gradbus worker --bench-allreduce`); rank 0 prints the table.
fn execute_mpirun(cmd: &BenchCmd) -> Result<Code, Error> {
    let mpirun = mpirun::find_on_path("mpirun", std::env::var_os("PATH").as_deref()).ok_or(Error::MpirunMissing)?;
    let sizes = cmd.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let worker = run::worker_command()?;
    let mut worker_args: Vec<OsString> =
        vec!["--bench-allreduce".into(), "--transport".into(), cmd.transport.to_string().into()];
    for (flag, value) in [
        ("--sizes", sizes),
        ("--iters", cmd.iters.to_string()),
        ("--warmup", cmd.warmup.to_string()),
        ("--nodes", cmd.nodes.to_string()),
    ] {
        worker_args.push(flag.into());
        worker_args.push(value.into());
    }
    if cmd.json {
        worker_args.push("--json".into());
    }
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
    if cmd.transport != BenchTransport::Shm {
        return execute_mpirun(&cmd);
    }
    let plan = LaunchPlan::local(cmd.np)?;
    let exe = std::env::current_exe().map_err(|source| Error::Spawn {
        label: "rank 0".into(),
        program: PathBuf::from("gradbus"),
        source,
    })?;
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
        cmd.sizes.len(),
        dir.display()
    );
    let specs = run::local_specs(&plan, &exe, &rank_args(&cmd, &out), &job_id, &dir);
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

/// Reads a `GRADBUS_*` number of the rank's environment.
fn env_number(name: &str) -> Result<usize, Error> {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).ok_or_else(|| {
        Error::usage(format!("{name} is not set to a number"), "`__bench-rank` is started by `gradbus bench`")
    })
}

/// Executes the hidden `gradbus __bench-rank`: one benchmark process.
pub fn execute_rank(cmd: RankCmd) -> Result<Code, Error> {
    let rank = env_number(env::LOCAL_RANK)?;
    let np = env_number(env::LOCAL_SIZE)?;
    let job_id = std::env::var(env::JOB_ID).map_err(|_| {
        Error::usage(format!("{} is not set", env::JOB_ID), "`__bench-rank` is started by `gradbus bench`")
    })?;
    let mut args = BenchArgs::new(rank, np, job_id, cmd.sizes);
    args.iters = cmd.iters;
    args.warmup = cmd.warmup;
    args.timeout = cmd.timeout;
    let rows = match bench::rank_main(args) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("gradbus bench rank {rank}: error: {e}");
            // The same mapping as a training rank's bus error (timeout 5, /dev/shm full 2, else 4).
            return Ok(gradbus_worker::WorkerError::Bus(e).code());
        }
    };
    if let Some(rows) = rows {
        let text = if cmd.json { bench::json_lines(&rows) } else { bench::format_table(&rows) };
        let tmp = cmd.out.with_extension("tmp");
        std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &cmd.out)).map_err(|source| Error::RunDir {
            path: cmd.out.clone(),
            source,
            hint: "the benchmark's run directory must be writable".into(),
        })?;
    }
    Ok(Code::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gradbus ARGS` parsed the way `cli` does: `bench ...` and `__bench-rank ...`.
    fn p(args: &[&str]) -> Result<Parsed<BenchCmd>, Error> {
        let mut parser = lexopt::Parser::from_args(&args[1..]);
        match args[0] {
            "bench" => parse(&mut parser),
            "__bench-rank" => parse_rank(&mut parser).map(|_| Parsed::Help("__bench-rank")),
            other => panic!("not a bench command: {other}"),
        }
    }

    #[test]
    fn parses_the_benchmark_and_its_defaults() {
        let Parsed::Args(b) = p(&["bench", "allreduce"]).unwrap() else { panic!() };
        assert_eq!((b.np, b.iters, b.warmup, b.json), (2, 20, 3, false));
        assert_eq!(b.sizes, [1 << 20, 16 << 20, 64 << 20, 256 << 20]);
        let Parsed::Args(b) =
            p(&["bench", "--np", "3", "allreduce", "--sizes", "4KiB,1MiB", "--json", "--iters", "5"]).unwrap()
        else {
            panic!()
        };
        assert_eq!((b.np, b.iters, b.json), (3, 5, true));
        assert_eq!(b.sizes, [4096, 1 << 20]);
        let args = rank_args(&b, Path::new("/r/out"));
        assert_eq!(args[0], "__bench-rank");
        let r = parse_rank(&mut lexopt::Parser::from_args(&args[1..])).unwrap();
        assert_eq!(r.sizes, b.sizes);
        assert_eq!((r.iters, r.warmup, r.json, r.timeout), (5, 3, true, b.timeout));
        assert_eq!(r.out, PathBuf::from("/r/out"));
        assert_eq!(b.transport, BenchTransport::Shm);
        for t in [BenchTransport::Mpi, BenchTransport::Hier] {
            let Parsed::Args(b) = p(&["bench", "allreduce", "--transport", &t.to_string()]).unwrap() else { panic!() };
            assert_eq!(b.transport, t);
        }
    }

    #[test]
    fn bad_bench_usage_is_exit_2_with_a_hint() {
        for bad in [
            &["bench"][..],
            &["bench", "broadcast"],
            &["bench", "allreduce", "--sizes", "3"],
            &["bench", "allreduce", "--sizes", ""],
            &["bench", "allreduce", "--np", "two"],
            &["bench", "allreduce", "--iters", "0"],
            &["bench", "allreduce", "--timeout", "-1"],
            &["bench", "allreduce", "extra"],
            &["bench", "allreduce", "--transport", "tcp"],
            &["bench", "allreduce", "--transport", "SHM"],
            &["__bench-rank", "--sizes", "4096"],
        ] {
            let e = p(bad).unwrap_err();
            assert_eq!(e.code(), Code::Usage, "{bad:?}");
            assert!(e.to_string().contains("hint:"), "{bad:?}: {e}");
        }
        let e = p(&["bench", "allreduce", "--transport", "tcp"]).unwrap_err().to_string();
        assert!(e.contains("--transport tcp: unknown transport") && e.contains("use shm, mpi or hier"), "{e}");
        assert_eq!(p(&["bench", "--help"]).unwrap(), Parsed::Help(HELP));
    }
}
