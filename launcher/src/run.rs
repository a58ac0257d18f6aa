//! `gradbus run`: from the command line to a supervised job and its exit code.
//!
//! Stages, each of which can only fail with a usage error (exit 2) before anything is started:
//! parse the flags ([`parse`]) -> check the config file exists -> build and validate the
//! [`LaunchPlan`] -> check the config's values and the job's memory with the worker crate's own
//! code (`gradbus_worker::config`) -> find the worker (or `mpirun`, `srun`) -> create the run
//! directory, take its lock and check that it holds no earlier run unless told what to do with it
//! (`gradbus_worker::rundir`; the lock is held until the job's last process is gone) -> record the
//! launch in `RUN_DIR/launch.json`. Then stale segments of dead launchers are swept
//! ([`shm::sweep_stale`]), the job runs under [`supervise`] with a [`ShmDisplay`], the job's
//! leftover shared-memory segments are removed after the last process is gone (on every node of a
//! failed multi-node `srun` step, [`srun::sweep_command_line`]), the root-cause summary is printed,
//! and the policy code is returned.
//!
//! The worker command line is
//! `gradbus worker --run-dir DIR [--resume | --overwrite] CONFIG [--set key=value ...]`,
//! `gradbus` being this very executable ([`worker_command`]), with the environment contract of
//! `gradbus_worker::env` (rank, local rank, sizes, node id, job id, run directory). Paths handed to
//! workers are absolute, so a worker's working directory does not matter.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use gradbus_collectives::ShmBus;
use gradbus_worker::env;
use gradbus_worker::exit::Code;
use gradbus_worker::rundir::{self, Mode};

use crate::hostfile;
use crate::mpirun::{self, MpirunSpec};
use crate::plan::LaunchPlan;
use crate::progress::{ProgressDisplay, ShmDisplay};
use crate::shm;
use crate::signals;
use crate::srun::{self, SrunSpec};
use crate::supervise::{self, Options, Outcome, ProcSpec};
use crate::usage::{lex, Parsed};
use crate::Error;

/// `gradbus run --help`.
pub const HELP: &str = "\
gradbus run - start one worker per rank and supervise them

USAGE:
    gradbus run [OPTIONS] CONFIG.toml [--set key=value ...]

OPTIONS:
    --np N                 number of ranks (default: all slots of the hostfile, else 1)
    --hostfile FILE        Open MPI/DeepSpeed hostfile: `host slots=N [max_slots=M]` per line
    --oversubscribe        allow more ranks than slots (dealt round-robin, capped by max_slots)
    --launcher KIND        local (default: spawn the workers here), mpirun, or srun (inside a
                           Slurm allocation; --np defaults to the allocation's SLURM_NTASKS)
    --run-dir DIR          where logs, metrics and checkpoints go (default: runs/<job id>)
    --resume RUN_DIR       continue the run in RUN_DIR from its last checkpoint
    --overwrite            delete the earlier run in --run-dir (its metrics, checkpoints, logs,
                           ...), then start this one there
    --grace SECONDS        time between SIGTERM and SIGKILL at teardown (default: 3)
    --set key=value        override a config key (repeatable)
    -h, --help             print this help

Each rank's output is shown prefixed `[rank K] ` and written whole to RUN_DIR/rank-K.log.
Progress (slowest rank's step, steps/s, loss, grad norm, skipped updates) is read from the
shared-memory bus: a bar on stderr when it is a terminal, else a `gradbus: progress:` line on
stderr every 10 s. stdout carries only the ranks' own lines.
When a rank fails, the others get SIGTERM, then SIGKILL after the grace; the rank that failed
first is reported. Exit codes: see `gradbus --help`.
A run directory has one job at a time (RUN_DIR/gradbus.lock names it), and a directory that holds
a run is never written over without --resume or --overwrite (exit 2 otherwise). --resume warns
about a changed seed, world size or data-affecting key (RUN_DIR/resumes.jsonl records it) and
refuses another model.
";

/// How the workers are started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LauncherKind {
    /// Spawn every worker on this machine.
    Local,
    /// One `mpirun` that starts the workers on the hostfile's machines.
    Mpirun,
    /// One `srun` that starts the workers as a step of the Slurm allocation.
    Srun,
}

impl LauncherKind {
    /// Its name on the command line and in `launch.json`.
    pub fn name(self) -> &'static str {
        match self {
            LauncherKind::Local => "local",
            LauncherKind::Mpirun => "mpirun",
            LauncherKind::Srun => "srun",
        }
    }
}

/// The validated command line of `gradbus run`.
#[derive(Clone, Debug, PartialEq)]
pub struct RunArgs {
    /// `--np`.
    pub np: Option<usize>,
    /// `--hostfile`.
    pub hostfile: Option<PathBuf>,
    /// `--oversubscribe`.
    pub oversubscribe: bool,
    /// `--launcher`.
    pub launcher: LauncherKind,
    /// `--run-dir`.
    pub run_dir: Option<PathBuf>,
    /// `--resume`.
    pub resume: Option<PathBuf>,
    /// `--overwrite`.
    pub overwrite: bool,
    /// `--grace`.
    pub grace: Duration,
    /// The config file.
    pub config: PathBuf,
    /// `--set key=value` overrides, in order.
    pub sets: Vec<String>,
}

fn hint() -> &'static str {
    "see `gradbus run --help`"
}

/// Parses the arguments after `run`.
pub fn parse(parser: &mut lexopt::Parser) -> Result<Parsed<RunArgs>, Error> {
    use lexopt::prelude::*;
    let mut np = None;
    let mut hostfile = None;
    let mut oversubscribe = false;
    let mut launcher = LauncherKind::Local;
    let mut run_dir = None;
    let mut resume = None;
    let mut overwrite = false;
    let mut grace = Duration::from_secs(3);
    let mut config: Option<PathBuf> = None;
    let mut sets = Vec::new();
    let h = hint();
    while let Some(arg) = parser.next().map_err(|e| lex(e, h))? {
        match arg {
            Short('h') | Long("help") => return Ok(Parsed::Help(HELP)),
            Long("np") | Short('n') => {
                let v = parser.value().map_err(|e| lex(e, h))?;
                let n = v.parse::<usize>().map_err(|e| lex(e, "--np takes a whole number, e.g. --np 4"))?;
                np = Some(n);
            }
            Long("hostfile") => hostfile = Some(PathBuf::from(parser.value().map_err(|e| lex(e, h))?)),
            Long("oversubscribe") => oversubscribe = true,
            Long("launcher") => {
                let v = parser.value().map_err(|e| lex(e, h))?;
                launcher = match v.to_str() {
                    Some("local") => LauncherKind::Local,
                    Some("mpirun") => LauncherKind::Mpirun,
                    Some("srun") => LauncherKind::Srun,
                    _ => {
                        return Err(Error::usage(
                            format!("--launcher {}: unknown launcher", v.to_string_lossy()),
                            "use --launcher local, mpirun or srun",
                        ))
                    }
                };
            }
            Long("run-dir") => run_dir = Some(PathBuf::from(parser.value().map_err(|e| lex(e, h))?)),
            Long("resume") => resume = Some(PathBuf::from(parser.value().map_err(|e| lex(e, h))?)),
            Long("overwrite") => overwrite = true,
            Long("grace") => {
                let v = parser.value().map_err(|e| lex(e, h))?;
                let s =
                    v.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0 && *s <= 3600.0).ok_or_else(|| {
                        Error::usage(
                            format!("--grace {}: not a number of seconds", v.to_string_lossy()),
                            "e.g. --grace 3 or --grace 0.5 (at most 3600)",
                        )
                    })?;
                grace = Duration::from_secs_f64(s);
            }
            Long("set") => {
                let v = parser.value().map_err(|e| lex(e, h))?;
                let s = v.into_string().map_err(|v| {
                    Error::usage(
                        format!("--set {}: not valid UTF-8", v.to_string_lossy()),
                        "config keys and values are UTF-8",
                    )
                })?;
                match s.split_once('=') {
                    Some((k, _)) if !k.trim().is_empty() => sets.push(s),
                    _ => {
                        return Err(Error::usage(format!("--set {s}: expected key=value"), "e.g. --set train.lr=0.001"))
                    }
                }
            }
            Value(v) if config.is_none() => config = Some(PathBuf::from(v)),
            Value(v) => {
                return Err(Error::usage(
                    format!(
                        "unexpected argument `{}` (the config is `{}`)",
                        v.to_string_lossy(),
                        config.as_deref().unwrap_or(Path::new("")).display()
                    ),
                    "give one CONFIG.toml; overrides go with --set key=value",
                ))
            }
            other => return Err(lex(other.unexpected(), h)),
        }
    }
    let Some(config) = config else {
        return Err(Error::usage("missing CONFIG.toml", "usage: gradbus run [OPTIONS] CONFIG.toml"));
    };
    if resume.is_some() && run_dir.is_some() {
        return Err(Error::usage(
            "--resume and --run-dir both name a run directory",
            "give only --resume RUN_DIR to continue a run",
        ));
    }
    if resume.is_some() && overwrite {
        return Err(Error::usage(
            "--resume and --overwrite: continue the run, or delete it, not both",
            "give --resume RUN_DIR to continue it, or --run-dir RUN_DIR --overwrite to start over there",
        ));
    }
    Ok(Parsed::Args(RunArgs { np, hostfile, oversubscribe, launcher, run_dir, resume, overwrite, grace, config, sets }))
}

/// A job id unique on this machine and readable: UTC time of the launch and the launcher's pid,
/// e.g. `20261129T175530p4242`. It contains no `-`, so `gradbus-{job}-` prefixes of two jobs never
/// nest.
pub fn new_job_id() -> String {
    let (y, mo, d, h, mi, s) = gradbus_worker::host::utc(SystemTime::now());
    format!("{y:04}{mo:02}{d:02}T{h:02}{mi:02}{s:02}p{}", std::process::id())
}

/// How a rank is started: a program and the arguments that come before the worker's own.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerCommand {
    /// Absolute path of the program.
    pub program: PathBuf,
    /// `["worker"]` for this executable; nothing for a `GRADBUS_WORKER_BIN` override.
    pub prefix: Vec<OsString>,
}

impl WorkerCommand {
    /// The prefix followed by the worker's arguments.
    pub fn args(&self, worker_args: Vec<OsString>) -> Vec<OsString> {
        self.prefix.iter().cloned().chain(worker_args).collect()
    }
}

/// The worker: this executable's `worker` subcommand, or `$GRADBUS_WORKER_BIN` (a program that takes
/// the worker's arguments) if set.
pub fn worker_command() -> Result<WorkerCommand, Error> {
    let (path, prefix, hint) = match std::env::var_os(env::WORKER_BIN) {
        Some(p) => (PathBuf::from(p), vec![], format!("{} points here; fix or unset it", env::WORKER_BIN)),
        None => {
            let hint = "the launcher starts itself as `gradbus worker`; reinstall it (`cargo install --path .`)";
            match std::env::current_exe() {
                Ok(exe) => (exe, vec!["worker".into()], hint.to_string()),
                Err(e) => (PathBuf::from("gradbus"), vec![], format!("{hint} ({e})")),
            }
        }
    };
    if !path.is_file() {
        return Err(Error::WorkerMissing { path, hint });
    }
    Ok(WorkerCommand { program: std::path::absolute(&path).unwrap_or(path), prefix })
}

/// Checks that the config file exists and can be opened; returns its absolute path.
fn check_config(path: &Path) -> Result<PathBuf, Error> {
    let err = |reason: String| Error::Config { path: path.to_path_buf(), reason };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    Ok(std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()))
}

/// Creates (or, with `--resume`, checks) the run directory; returns its absolute path.
fn prepare_run_dir(args: &RunArgs, job_id: &str) -> Result<PathBuf, Error> {
    if let Some(dir) = &args.resume {
        if !dir.is_dir() {
            return Err(Error::RunDir {
                path: dir.clone(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
                hint: "--resume takes the run directory of an earlier `gradbus run`".into(),
            });
        }
        return Ok(std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone()));
    }
    let dir = args.run_dir.clone().unwrap_or_else(|| Path::new("runs").join(job_id));
    std::fs::create_dir_all(&dir).map_err(|source| Error::RunDir {
        path: dir.clone(),
        source,
        hint: "pick a writable place with --run-dir DIR".into(),
    })?;
    Ok(std::fs::canonicalize(&dir).unwrap_or(dir))
}

/// What `launch.json` records, for `gradbus report` and for humans.
#[derive(serde::Serialize)]
struct LaunchRecord<'a> {
    gradbus: gradbus_artifacts::version::Build,
    job_id: &'a str,
    launcher: &'a str,
    config: &'a Path,
    sets: &'a [String],
    resume: bool,
    argv: Vec<String>,
    plan: &'a LaunchPlan,
}

/// The worker's command-line arguments.
pub fn worker_args(run_dir: &Path, mode: Mode, config: &Path, sets: &[String]) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["--run-dir".into(), run_dir.into()];
    match mode {
        Mode::Resume => args.push("--resume".into()),
        Mode::Overwrite => args.push("--overwrite".into()),
        Mode::Fresh => {}
    }
    args.push(config.into());
    for s in sets {
        args.push("--set".into());
        args.push(s.into());
    }
    args
}

/// The environment contract of one rank (see `gradbus_worker::env`).
pub fn rank_env(plan: &LaunchPlan, rank: usize, job_id: &str, run_dir: &Path) -> Vec<(OsString, OsString)> {
    let slot = &plan.ranks[rank];
    let kv = |k: &str, v: String| (OsString::from(k), OsString::from(v));
    vec![
        kv(env::RANK, slot.rank.to_string()),
        kv(env::LOCAL_RANK, slot.local_rank.to_string()),
        kv(env::WORLD_SIZE, plan.world_size.to_string()),
        kv(env::LOCAL_SIZE, plan.local_size(rank).to_string()),
        kv(env::NODE_ID, slot.node_id.to_string()),
        (env::JOB_ID.into(), job_id.into()),
        (env::RUN_DIR.into(), run_dir.into()),
    ]
}

/// One [`ProcSpec`] per rank of `plan`, running `program args` with the rank's environment and
/// `RUN_DIR/rank-K.log`. `gradbus bench` calls this with another program.
pub fn local_specs(
    plan: &LaunchPlan,
    program: &Path,
    args: &[OsString],
    job_id: &str,
    run_dir: &Path,
) -> Vec<ProcSpec> {
    (0..plan.world_size)
        .map(|rank| ProcSpec {
            label: format!("rank {rank}"),
            program: program.to_path_buf(),
            args: args.to_vec(),
            env: rank_env(plan, rank, job_id, run_dir),
            log: Some(run_dir.join(format!("rank-{rank}.log"))),
        })
        .collect()
}

/// Sweeps stale segments of dead launchers, runs the specs under supervision, then removes the
/// job's shm segments and prints the summary. The common tail of every subcommand that starts a job.
pub fn supervise_job(
    specs: Vec<ProcSpec>,
    opts: &Options,
    display: &mut dyn ProgressDisplay,
    job_id: &str,
) -> Result<Outcome, Error> {
    signals::install()?;
    shm::sweep_stale_and_log();
    let result = supervise::supervise(specs, opts, display);
    // Every process is reaped at this point (also on a spawn error), so no live rank can lose a
    // segment.
    shm::remove_job(Path::new(shm::SHM_DIR), job_id);
    let outcome = result?;
    for line in outcome.summary() {
        eprintln!("gradbus: {line}");
    }
    Ok(outcome)
}

/// The specs of the one child process that starts every rank (`mpirun`, `srun`): it gets the job
/// id and run directory in its environment and logs to `RUN_DIR/<name>.log`.
fn launcher_spec(argv: Vec<OsString>, name: &str, job_id: &str, run_dir: &Path) -> Vec<ProcSpec> {
    let mut argv = argv.into_iter();
    let program = PathBuf::from(argv.next().unwrap_or_default());
    vec![ProcSpec {
        label: name.into(),
        program,
        args: argv.collect(),
        env: vec![(env::JOB_ID.into(), job_id.into()), (env::RUN_DIR.into(), run_dir.into())],
        log: Some(run_dir.join(format!("{name}.log"))),
    }]
}

/// The plan of `--launcher srun`: Slurm places the ranks, so the plan is only the world size (one
/// node, this one, whose segment the progress display reads); a hostfile is an error.
fn srun_plan(args: &RunArgs) -> Result<LaunchPlan, Error> {
    if let Some(h) = &args.hostfile {
        return Err(Error::usage(
            format!("--hostfile {} with --launcher srun: Slurm places the ranks", h.display()),
            "drop --hostfile; the allocation's nodes are in SLURM_JOB_NODELIST",
        ));
    }
    LaunchPlan::local(srun::np(args.np, |k| std::env::var(k).ok().filter(|v| !v.is_empty()))?)
}

/// Executes `gradbus run`.
pub fn execute(args: RunArgs) -> Result<Code, Error> {
    let config = check_config(&args.config)?;
    let plan = match (&args.hostfile, args.launcher) {
        (_, LauncherKind::Srun) => srun_plan(&args)?,
        (Some(path), _) => LaunchPlan::from_hosts(&hostfile::read(path)?, args.np, args.oversubscribe)?,
        (None, _) => LaunchPlan::local(args.np.unwrap_or(1))?,
    };
    // The worker's own checks, once, before any rank starts: a bad config is one message and exit 2
    // (the workers check again for a bare mpirun). Memory is this machine's only for a local launch.
    let (cfg, _, _) = gradbus_worker::config::Config::load(&config, &args.sets)?;
    cfg.check_world(plan.world_size)?;
    let local = (0..plan.world_size).map(|r| plan.local_size(r)).max().unwrap_or(1);
    if args.launcher == LauncherKind::Local {
        cfg.check_memory(local, plan.world_size > 1, &gradbus_worker::config::Machine::probe())?;
    }
    if let Some(warning) = cfg.check_device(local, args.launcher == LauncherKind::Local)? {
        eprintln!("gradbus: warning: {warning}");
    }
    let worker = worker_command()?;
    let path = std::env::var_os("PATH");
    let starter = match args.launcher {
        LauncherKind::Local => {
            plan.require_local(args.hostfile.as_deref())?;
            None
        }
        LauncherKind::Mpirun => Some(mpirun::find_on_path("mpirun", path.as_deref()).ok_or(Error::MpirunMissing)?),
        LauncherKind::Srun => Some(mpirun::find_on_path("srun", path.as_deref()).ok_or_else(|| {
            Error::usage("srun is not on PATH", "run inside a Slurm allocation (sbatch, salloc) on a Slurm client")
        })?),
    };
    let job_id = new_job_id();
    let run_dir = prepare_run_dir(&args, &job_id)?;
    let resume = args.resume.is_some();
    let mode = Mode::of(resume, args.overwrite);
    // Held until the last process of the job is gone: no other job may use the directory meanwhile.
    let _owner = rundir::claim(&run_dir, mode, &job_id)?;
    let record = LaunchRecord {
        gradbus: gradbus_artifacts::version::build(),
        job_id: &job_id,
        launcher: args.launcher.name(),
        config: &config,
        sets: &args.sets,
        resume,
        argv: std::env::args().collect(),
        plan: &plan,
    };
    if let Ok(json) = serde_json::to_string_pretty(&record) {
        let path = run_dir.join("launch.json");
        if let Err(e) = std::fs::write(&path, json + "\n") {
            log::warn!("cannot write {}: {e}", path.display());
        }
    }
    eprintln!(
        "gradbus: job {job_id}: {} rank(s) on {} node(s), run dir {}",
        plan.world_size,
        plan.nodes.len(),
        run_dir.display()
    );

    let wargs = worker.args(worker_args(&run_dir, mode, &config, &args.sets));
    let sweeper = starter.clone();
    let specs = match (args.launcher, starter) {
        (LauncherKind::Mpirun, Some(mpirun)) => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let hostfile = args.hostfile.as_ref().map(|h| std::path::absolute(h).unwrap_or(h.clone()));
            let spec = MpirunSpec {
                mpirun,
                oversubscribe: args.oversubscribe
                    || plan.oversubscribed
                    || (hostfile.is_none() && plan.world_size > cores),
                hostfile,
                np: plan.world_size,
                as_root: mpirun::running_as_root(),
                exports: mpirun::exports(|n| std::env::var_os(n).is_some()),
                worker: worker.program,
                worker_args: wargs,
            };
            launcher_spec(mpirun::command_line(&spec), "mpirun", &job_id, &run_dir)
        }
        (LauncherKind::Srun, Some(srun)) => {
            let spec = SrunSpec {
                srun,
                np: plan.world_size,
                overcommit: args.oversubscribe,
                worker: worker.program,
                worker_args: wargs,
            };
            launcher_spec(srun::command_line(&spec), "srun", &job_id, &run_dir)
        }
        _ => local_specs(&plan, &worker.program, &wargs, &job_id, &run_dir),
    };
    let opts = Options { grace: args.grace, ..Options::default() };
    // The bar's length is the config's, checked above; segments are those of this machine's nodes.
    let segments =
        (0..plan.nodes.len()).map(|node| ShmBus::segment_path(Path::new(shm::SHM_DIR), &job_id, node)).collect();
    let mut display = ShmDisplay::new(segments, Some(cfg.steps));
    let outcome = supervise_job(specs, &opts, &mut display, &job_id)?;
    // A rank killed on another node of a Slurm step leaves its segment there: sweep every node.
    let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let (LauncherKind::Srun, Some(srun), Some(nodes)) = (args.launcher, sweeper, srun::allocation_nodes(get)) {
        if nodes > 1 && outcome.code() != Code::Done {
            let me = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("gradbus"));
            srun::sweep_nodes(&srun::sweep_command_line(&srun, nodes, &me, &job_id));
        }
    }
    Ok(outcome.code())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_run(args: &[&str]) -> Result<RunArgs, Error> {
        let mut p = lexopt::Parser::from_args(args.iter().copied());
        match parse(&mut p)? {
            Parsed::Args(a) => Ok(a),
            Parsed::Help(_) => panic!("not a run command"),
        }
    }

    #[test]
    fn parses_flags_config_and_sets_in_any_order() {
        let a = parse_run(&[
            "--np",
            "4",
            "--set",
            "a.b=1",
            "cfg.toml",
            "--hostfile",
            "h",
            "--set=c=2",
            "--grace",
            "0.5",
            "--launcher",
            "mpirun",
            "--oversubscribe",
        ])
        .unwrap();
        assert_eq!(a.np, Some(4));
        assert_eq!(a.config, PathBuf::from("cfg.toml"));
        assert_eq!(a.sets, ["a.b=1", "c=2"]);
        assert_eq!(a.hostfile, Some(PathBuf::from("h")));
        assert_eq!(a.launcher, LauncherKind::Mpirun);
        assert_eq!(a.grace, Duration::from_millis(500));
        assert!(a.oversubscribe);
    }

    #[test]
    fn bad_usage_is_an_error_with_a_hint() {
        for bad in [
            &["--np", "x", "c.toml"][..],
            &["--np"],
            &[],
            &["a.toml", "b.toml"],
            &["--set", "novalue", "c.toml"],
            &["--set", "=1", "c.toml"],
            &["--launcher", "ssh", "c.toml"],
            &["--grace", "-1", "c.toml"],
            &["--frobnicate", "c.toml"],
            &["--resume", "r", "--run-dir", "d", "c.toml"],
            &["--resume", "r", "--overwrite", "c.toml"],
        ] {
            let e = parse_run(bad).unwrap_err();
            assert_eq!(e.code(), Code::Usage, "{bad:?}");
            assert!(e.to_string().contains("hint:"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn srun_launcher_parses_and_refuses_a_hostfile() {
        let a = parse_run(&["--launcher", "srun", "--np", "3", "c.toml"]).unwrap();
        assert_eq!((a.launcher, a.launcher.name()), (LauncherKind::Srun, "srun"));
        assert_eq!(srun_plan(&a).unwrap().world_size, 3);
        let e = srun_plan(&parse_run(&["--launcher", "srun", "--hostfile", "h", "c.toml"]).unwrap()).unwrap_err();
        assert_eq!(e.code(), Code::Usage);
        assert!(e.to_string().contains("--hostfile h with --launcher srun"), "{e}");
    }

    #[test]
    fn job_ids_are_dated_and_dashless() {
        let id = new_job_id();
        assert!(id.len() > 16 && !id.contains('-'), "{id}");
    }

    #[test]
    fn rank_env_follows_the_contract() {
        let plan = LaunchPlan::local(3).unwrap();
        let e = rank_env(&plan, 2, "j1", Path::new("/r"));
        let get = |k: &str| e.iter().find(|(n, _)| n == k).map(|(_, v)| v.to_str().unwrap().to_string());
        assert_eq!(get(env::RANK).as_deref(), Some("2"));
        assert_eq!(get(env::LOCAL_RANK).as_deref(), Some("2"));
        assert_eq!(get(env::WORLD_SIZE).as_deref(), Some("3"));
        assert_eq!(get(env::LOCAL_SIZE).as_deref(), Some("3"));
        assert_eq!(get(env::NODE_ID).as_deref(), Some("0"));
        assert_eq!(get(env::JOB_ID).as_deref(), Some("j1"));
        assert_eq!(get(env::RUN_DIR).as_deref(), Some("/r"));
        let args = worker_args(Path::new("/r"), Mode::Resume, Path::new("/c.toml"), &["k=v".into()]);
        assert_eq!(args, ["--run-dir", "/r", "--resume", "/c.toml", "--set", "k=v"]);
        let args = worker_args(Path::new("/r"), Mode::Overwrite, Path::new("/c.toml"), &[]);
        assert_eq!(args, ["--run-dir", "/r", "--overwrite", "/c.toml"]);
    }
}
