//! Spawning and supervising the processes of one job: any command, N times.
//!
//! [`supervise`] starts every [`ProcSpec`] and returns only when all of them, and everything they
//! started in their process groups, are gone. That is the invariant the rest of the launcher builds
//! on: no orphan survives any exit path of the launcher.
//! - Each process runs in its own process group (`process_group(0)`), so a terminal's Ctrl-C reaches
//!   only the launcher, and a signal to the group reaches the process's children too.
//! - Each process gets `PR_SET_PDEATHSIG = SIGKILL`, so it dies with the launcher even when the
//!   launcher is SIGKILLed and cannot clean up. (The death signal follows the spawning thread: this
//!   module spawns from the caller's thread, which stays alive until supervision ends.)
//! - When a process exits, its group is SIGKILLed before the process is reaped (the zombie keeps the
//!   group id reserved), so leftovers of an exited worker cannot outlive it.
//! - The first process to fail (non-zero exit or a signal) is the root cause. When several are first
//!   seen in the same polling round, their order is unknown (the peers of a killed rank notice it
//!   within milliseconds and exit 4), so a signal death is preferred, then any code but 4, then 4
//!   (see `cause_rank`); ties go to the lower rank. For a gradbus code that
//!   every rank is meant to reach together (2, 3, 5), the others get a short settle window to exit on
//!   their own; then every live group gets SIGTERM, and SIGKILL after the grace period.
//! - SIGINT/SIGTERM/SIGHUP to the launcher (see [`crate::signals`]) do the same teardown at once; a
//!   second signal skips the grace.
//!
//! Output: each process's stdout and stderr are read by one thread per pipe, line by line, written
//! to the launcher's stdout/stderr with the prefix `[label] ` and, unprefixed, to the process's log
//! file. A line is written whole under the console lock, so lines of different ranks never interleave.
//!
//! Reuse: `gradbus bench` can spawn N copies of any program with [`supervise`]; `gradbus run`
//! builds its specs from a [`crate::plan::LaunchPlan`] (see [`crate::run`]).

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gradbus_worker::exit::Code;

use crate::progress::{ProgressDisplay, TICK};
use crate::signals;
use crate::Error;

/// One process to start.
#[derive(Clone, Debug)]
pub struct ProcSpec {
    /// Its name in prefixes and messages, e.g. `rank 3`.
    pub label: String,
    /// The program to execute.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Variables added to (or replacing in) the launcher's environment.
    pub env: Vec<(OsString, OsString)>,
    /// File that receives the process's stdout and stderr lines, unprefixed (appended to).
    pub log: Option<PathBuf>,
}

/// Timing of the teardown.
#[derive(Clone, Debug)]
pub struct Options {
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// After a first failure with a gradbus code the ranks reach together (2, 3, 5): how long the
    /// others may take to exit on their own before SIGTERM.
    pub settle: Duration,
    /// Interval of the polling loop.
    pub poll: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options { grace: Duration::from_secs(3), settle: Duration::from_secs(2), poll: Duration::from_millis(20) }
    }
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl Ending {
    fn from_status(status: ExitStatus) -> Ending {
        match (status.code(), status.signal()) {
            (Some(c), _) => Ending::Code(c),
            (None, Some(s)) => Ending::Signal(s),
            (None, None) => Ending::Signal(0),
        }
    }

    /// Whether this ending is a failure (anything but exit code 0).
    pub fn failed(self) -> bool {
        self != Ending::Code(0)
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Ending::Code(c) => match Code::from_status(c) {
                Some(code) if c != 0 => write!(f, "exited with code {c} ({})", code.describe()),
                _ => write!(f, "exited with code {c}"),
            },
            Ending::Signal(s) => write!(f, "killed by {}", signals::name(s)),
        }
    }
}

/// The end of one process.
#[derive(Clone, Debug)]
pub struct ProcExit {
    /// The spec's label.
    pub label: String,
    /// Its process id (also its process group id).
    pub pid: u32,
    /// How it ended.
    pub ending: Ending,
    /// Time from the first spawn to when the launcher saw it end.
    pub after: Duration,
    /// Whether it ended after the launcher had begun the teardown (sent SIGTERM).
    pub stopped_by_launcher: bool,
    /// Its log file.
    pub log: Option<PathBuf>,
}

/// The end of a whole job.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Every process's end, in spec order.
    pub exits: Vec<ProcExit>,
    /// Index of the process that failed first (the root cause), unless the launcher was
    /// interrupted before any failure.
    pub first_failure: Option<usize>,
    /// Whether the launcher received SIGINT/SIGTERM/SIGHUP.
    pub interrupted: bool,
    /// How many processes survived SIGTERM for the whole grace and were SIGKILLed.
    pub killed_after_grace: usize,
}

impl Outcome {
    /// The launcher's exit code under the policy of `gradbus_worker::exit::Code`:
    /// interrupted -> 130; every process exited 0 -> 0; the first failure was a timeout (5) -> 5;
    /// every process exited with the same code that ends every rank (`Code::ends_every_rank`: 2,
    /// 3, 5) -> that code; anything else (a signal, an unknown code, mixed codes) -> 4.
    pub fn code(&self) -> Code {
        if self.interrupted {
            return Code::Interrupted;
        }
        let Some(first) = self.first_failure else {
            return Code::Done;
        };
        if self.exits[first].ending == Ending::Code(Code::Timeout as i32) {
            return Code::Timeout;
        }
        if let Ending::Code(c) = self.exits[first].ending {
            let shared = Code::from_status(c).filter(|code| code.ends_every_rank());
            if let Some(code) = shared.filter(|_| self.exits.iter().all(|e| e.ending == Ending::Code(c))) {
                return code;
            }
        }
        Code::RankFailed
    }

    /// The torchrun-like root-cause summary, one line per entry; empty when the job succeeded.
    pub fn summary(&self) -> Vec<String> {
        let code = self.code();
        if code == Code::Done {
            return Vec::new();
        }
        let mut out = Vec::new();
        if self.interrupted {
            out.push(format!(
                "interrupted by a signal: stopped {} process(es) with SIGTERM{}",
                self.exits.iter().filter(|e| e.stopped_by_launcher).count(),
                if self.killed_after_grace > 0 {
                    format!(", {} needed SIGKILL after the grace period", self.killed_after_grace)
                } else {
                    String::new()
                }
            ));
        }
        // Every rank ending with the same gradbus code is an agreed ending (all ranks decided together
        // to abort on non-finite gradients, or all saw the same bad config): no rank is the culprit.
        let agreed = code.blames_no_rank() && self.exits.iter().all(|e| e.ending == Ending::Code(code as i32));
        if agreed {
            out.push(format!("every rank ended with exit {}: an agreed ending, not one rank's failure", code as i32));
        } else if let Some(f) = self.first_failure {
            let e = &self.exits[f];
            let log = e.log.as_ref().map(|l| format!("; log: {}", l.display())).unwrap_or_default();
            out.push(format!(
                "root cause: {} failed first: {} ({:.1} s after start{log})",
                e.label,
                e.ending,
                e.after.as_secs_f64()
            ));
        }
        for (i, e) in self.exits.iter().enumerate() {
            let note = if Some(i) == self.first_failure && !agreed {
                "  <- first failure"
            } else if e.stopped_by_launcher && e.ending.failed() {
                "  (stopped by the launcher)"
            } else {
                ""
            };
            out.push(format!("  {}: {}{note}", e.label, e.ending));
        }
        if self.killed_after_grace > 0 && !self.interrupted {
            out.push(format!(
                "{} process(es) ignored SIGTERM and were SIGKILLed after the grace period",
                self.killed_after_grace
            ));
        }
        out.push(format!("exit {}: {}", code as u8, code.describe()));
        out
    }
}

/// A started process.
struct Running {
    label: String,
    child: Child,
    pid: u32,
    log: Option<PathBuf>,
    exit: Option<ProcExit>,
    termed: bool,
}

/// Sends `sig` to the process group `pgid`; a group that no longer exists is not an error.
fn signal_group(pgid: u32, sig: i32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    // SAFETY: kill(2) has no memory-safety preconditions. The group id is the pid of a child we
    // have not reaped yet (callers guarantee it), so the id cannot have been reused by another group.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// Whether the child `pid` has ended, without reaping it (so its pid and group id stay reserved).
fn has_ended(pid: u32) -> bool {
    // SAFETY: an all-zero siginfo_t is a valid value (it is plain data); waitid writes into it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable siginfo_t; WNOWAIT leaves the child waitable, WNOHANG
    // returns at once. pid is our own child's pid.
    let rc = unsafe {
        libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
    };
    if rc != 0 {
        // ECHILD: not (or no longer) our child to wait for; treat it as ended rather than poll
        // forever. Any other error (EINTR) just means "ask again next round".
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD);
    }
    // SAFETY: after a successful waitid, si_pid is initialised (0 when no child was waitable).
    unsafe { info.si_pid() != 0 }
}

/// Spawns one process in its own group, with the parent-death signal set.
fn spawn(spec: &ProcSpec) -> Result<Child, Error> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe calls
    // are allowed: it calls prctl(2) and getppid(2), both async-signal-safe, allocates nothing and
    // takes no lock (io::Error::from_raw_os_error does not allocate). The getppid check closes the
    // race in which the launcher died between fork and prctl: the death signal would then never come.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    cmd.spawn().map_err(|source| Error::Spawn { label: spec.label.clone(), program: spec.program.clone(), source })
}

/// Copies `pipe` line by line to the console (prefixed) and to the log (whole), then says so on
/// `done`.
fn pump(
    pipe: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    log: Option<Arc<Mutex<File>>>,
    done: mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            if let Some(log) = &log {
                if let Ok(mut f) = log.lock() {
                    let _ = f.write_all(&line);
                }
            }
            // Console write errors (a closed pipe) must not stop the log, so they are ignored.
            // The progress bar, if one is drawn, is lifted while the line is written.
            crate::progress::with_console(|| {
                if to_stderr {
                    let mut err = std::io::stderr().lock();
                    let _ = err.write_all(prefix.as_bytes()).and_then(|_| err.write_all(&line));
                } else {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(prefix.as_bytes()).and_then(|_| out.write_all(&line));
                    let _ = out.flush();
                }
            });
        }
        let _ = done.send(());
    });
}

/// How likely an ending is the root cause among failures seen in the same polling round (lower
/// is likelier): killed by a signal (the process itself crashed or was killed), then an exit code
/// other than 4, then 4 - the code with which a rank reports that a PEER failed, so usually a
/// consequence of another ending in the same round.
fn cause_rank(ending: Option<Ending>) -> u8 {
    match ending {
        Some(Ending::Signal(_)) => 0,
        Some(Ending::Code(c)) if c != Code::RankFailed as i32 => 1,
        _ => 2,
    }
}

/// Kills and reaps everything started so far (used when a later spawn fails).
fn abort_started(procs: &mut [Running]) {
    for p in procs.iter() {
        signal_group(p.pid, libc::SIGKILL);
    }
    for p in procs.iter_mut() {
        let _ = p.child.wait();
    }
}

/// Starts every spec, supervises them to the end (see the module doc) and returns how each ended.
///
/// Errors only when a process cannot be started (or its log file created); the processes already
/// started are then killed and reaped before the error is returned.
pub fn supervise(specs: Vec<ProcSpec>, opts: &Options, display: &mut dyn ProgressDisplay) -> Result<Outcome, Error> {
    let start = Instant::now();
    let (done_tx, done_rx) = mpsc::channel();
    let mut pumps = 0usize;
    let mut procs: Vec<Running> = Vec::with_capacity(specs.len());
    for spec in &specs {
        if signals::received() > 0 {
            // Interrupted while starting: start no more; the loop below stops the rest.
            break;
        }
        let log = match &spec.log {
            // Appended to: a resumed run keeps the logs of the runs before it.
            Some(path) => match File::options().create(true).append(true).open(path) {
                Ok(f) => Some(Arc::new(Mutex::new(f))),
                Err(source) => {
                    abort_started(&mut procs);
                    return Err(Error::LogFile { path: path.clone(), source });
                }
            },
            None => None,
        };
        let mut child = match spawn(spec) {
            Ok(c) => c,
            Err(e) => {
                abort_started(&mut procs);
                return Err(e);
            }
        };
        let prefix = format!("[{}] ", spec.label);
        if let Some(out) = child.stdout.take() {
            pump(out, prefix.clone(), false, log.clone(), done_tx.clone());
            pumps += 1;
        }
        if let Some(err) = child.stderr.take() {
            pump(err, prefix, true, log, done_tx.clone());
            pumps += 1;
        }
        log::debug!("started {} as pid {}: {}", spec.label, child.id(), spec.program.display());
        procs.push(Running {
            label: spec.label.clone(),
            pid: child.id(),
            child,
            log: spec.log.clone(),
            exit: None,
            termed: false,
        });
    }
    drop(done_tx);

    let mut first_failure: Option<(usize, Instant)> = None;
    let mut term_sent: Option<Instant> = None;
    let mut kill_sent = false;
    let mut killed_after_grace = 0usize;
    let mut interrupted_at: Option<usize> = None;
    let mut last_tick = Instant::now();
    loop {
        let now = Instant::now();
        // Failures first seen in this round: which of them came first is unknown (a dead rank's
        // peers notice within milliseconds and exit too), so the likeliest cause is picked below.
        let mut failed_now: Vec<usize> = Vec::new();
        for (i, p) in procs.iter_mut().enumerate() {
            if p.exit.is_some() || !has_ended(p.pid) {
                continue;
            }
            // Leftovers in the group die with it; the unreaped zombie keeps the group id ours.
            signal_group(p.pid, libc::SIGKILL);
            let status = match p.child.wait() {
                Ok(s) => s,
                Err(_) => ExitStatus::from_raw(libc::SIGKILL),
            };
            let ending = Ending::from_status(status);
            log::debug!("{} (pid {}) {ending}", p.label, p.pid);
            if ending.failed() && interrupted_at.is_none() && !p.termed {
                failed_now.push(i);
            }
            p.exit = Some(ProcExit {
                label: p.label.clone(),
                pid: p.pid,
                ending,
                after: now - start,
                stopped_by_launcher: p.termed,
                log: p.log.clone(),
            });
        }
        if first_failure.is_none() {
            let ends = |i: usize| procs[i].exit.as_ref().map(|e| e.ending);
            if let Some(i) = failed_now.into_iter().min_by_key(|&i| (cause_rank(ends(i)), i)) {
                first_failure = Some((i, now));
            }
        }
        // Checked before the end test, so that a signal that stopped the spawning (no process
        // started at all) still makes the job an interrupted one.
        let signals_now = signals::received();
        if signals_now > 0 && interrupted_at.is_none() {
            log::info!("signal received: stopping every process");
            interrupted_at = Some(signals_now);
        }
        let live: Vec<usize> = (0..procs.len()).filter(|&i| procs[i].exit.is_none()).collect();
        if live.is_empty() {
            break;
        }

        let begin_teardown = match (interrupted_at, first_failure) {
            _ if term_sent.is_some() => false,
            (Some(_), _) => true,
            (None, Some((f, seen))) => {
                let ending = procs[f].exit.as_ref().map(|e| e.ending);
                let shared =
                    matches!(ending, Some(Ending::Code(c)) if Code::from_status(c).is_some_and(Code::ends_every_rank));
                !shared || now - seen >= opts.settle
            }
            (None, None) => false,
        };
        if begin_teardown {
            for &i in &live {
                signal_group(procs[i].pid, libc::SIGTERM);
                procs[i].termed = true;
            }
            term_sent = Some(now);
        }
        let second_signal = interrupted_at.is_some_and(|n| signals_now > n);
        if let Some(t) = term_sent {
            if !kill_sent && (now - t >= opts.grace || second_signal) {
                for &i in &live {
                    log::info!("{} survived SIGTERM: SIGKILL", procs[i].label);
                    signal_group(procs[i].pid, libc::SIGKILL);
                }
                killed_after_grace = live.len();
                kill_sent = true;
            }
        }

        if now - last_tick >= TICK {
            display.tick(now - start, live.len());
            last_tick = now;
        }
        std::thread::sleep(opts.poll);
    }
    display.finish();

    // Every group is dead, so the pipes are closed unless a process escaped its group (setsid); do
    // not let such an escapee hold the launcher forever.
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            log::warn!("output of a process still open after it exited; not waiting for it");
            break;
        }
    }

    Ok(Outcome {
        exits: procs.into_iter().filter_map(|p| p.exit).collect(),
        first_failure: first_failure.map(|(i, _)| i),
        interrupted: interrupted_at.is_some(),
        killed_after_grace,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::Silent;

    fn sh(label: &str, script: &str, log: Option<PathBuf>) -> ProcSpec {
        ProcSpec {
            label: label.into(),
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![],
            log,
        }
    }

    fn exit(label: &str, ending: Ending) -> ProcExit {
        ProcExit { label: label.into(), pid: 1, ending, after: Duration::ZERO, stopped_by_launcher: false, log: None }
    }

    fn outcome(endings: &[Ending], first: Option<usize>) -> Outcome {
        Outcome {
            exits: endings.iter().enumerate().map(|(i, &e)| exit(&format!("rank {i}"), e)).collect(),
            first_failure: first,
            interrupted: false,
            killed_after_grace: 0,
        }
    }

    #[test]
    fn exit_code_policy() {
        use Ending::{Code as C, Signal as S};
        assert_eq!(outcome(&[C(0), C(0)], None).code(), Code::Done);
        assert_eq!(outcome(&[C(3), C(3)], Some(1)).code(), Code::NonFinite);
        assert_eq!(outcome(&[C(2), C(2)], Some(0)).code(), Code::Usage);
        assert_eq!(outcome(&[C(3), S(15)], Some(0)).code(), Code::RankFailed);
        assert_eq!(outcome(&[C(5), S(15)], Some(0)).code(), Code::Timeout);
        assert_eq!(outcome(&[S(15), C(5)], Some(1)).code(), Code::Timeout);
        assert_eq!(outcome(&[C(0), C(7)], Some(1)).code(), Code::RankFailed);
        assert_eq!(outcome(&[S(9), C(3)], Some(0)).code(), Code::RankFailed);
        assert_eq!(outcome(&[C(4), C(4)], Some(0)).code(), Code::RankFailed);
        let mut o = outcome(&[C(3), C(3)], Some(0));
        o.interrupted = true;
        assert_eq!(o.code(), Code::Interrupted);
    }

    #[test]
    fn summary_names_the_first_failure() {
        let o = outcome(&[Ending::Signal(15), Ending::Signal(9)], Some(1));
        let s = o.summary().join("\n");
        assert!(s.contains("root cause: rank 1 failed first: killed by SIGKILL"), "{s}");
        assert!(s.contains("exit 4: a rank failed"), "{s}");
        assert!(outcome(&[Ending::Code(0)], None).summary().is_empty());
    }

    #[test]
    fn summary_of_an_agreed_abort_blames_no_rank() {
        let s = outcome(&[Ending::Code(3), Ending::Code(3)], Some(1)).summary().join("\n");
        assert!(s.contains("every rank ended with exit 3: an agreed ending"), "{s}");
        assert!(!s.contains("root cause") && !s.contains("first failure"), "{s}");
        let s = outcome(&[Ending::Code(3), Ending::Signal(9)], Some(1)).summary().join("\n");
        assert!(s.contains("root cause: rank 1"), "{s}");
    }

    #[test]
    fn supervises_success_failure_and_stubborn_processes() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("a.log");
        let opts = Options { grace: Duration::from_millis(300), ..Options::default() };
        let ok = supervise(
            vec![sh("a", "echo one; echo two >&2; printf three", Some(log.clone())), sh("b", "true", None)],
            &opts,
            &mut Silent,
        )
        .unwrap();
        assert_eq!(ok.code(), Code::Done);
        let text = std::fs::read_to_string(&log).unwrap();
        let mut lines: Vec<_> = text.lines().collect();
        lines.sort();
        assert_eq!(lines, ["one", "three", "two"]);

        // `b` fails only once `a` ignores SIGTERM (else the SIGTERM could beat the trap); bounded.
        // `a` sleeps 60 s: only the SIGKILL after the grace ends it sooner, and if it did not come, `a`
        // would exit 0 and the endings asserted below would differ (a bound, not a hang).
        let ready = dir.path().join("a-ready");
        let ready = ready.display();
        let failed = supervise(
            vec![
                sh("a", &format!("trap '' TERM; touch '{ready}'; sleep 60"), None),
                sh(
                    "b",
                    &format!(
                        "i=0; while [ ! -e '{ready}' ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; exit 7"
                    ),
                    None,
                ),
            ],
            &opts,
            &mut Silent,
        )
        .unwrap();
        assert_eq!(failed.code(), Code::RankFailed);
        assert_eq!(failed.first_failure, Some(1));
        assert_eq!(failed.exits[1].ending, Ending::Code(7));
        assert_eq!(failed.exits[0].ending, Ending::Signal(libc::SIGKILL));
        assert_eq!(failed.killed_after_grace, 1);
    }

    #[test]
    fn spawn_failure_is_an_error_naming_the_program() {
        let mut spec = sh("rank 0", "true", None);
        spec.program = "/nonexistent/gradbus-worker".into();
        let e = supervise(vec![sh("x", "sleep 30", None), spec], &Options::default(), &mut Silent).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/gradbus-worker"), "{e}");
    }
}
