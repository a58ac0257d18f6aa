//! A run directory has one owner and keeps its data.
//!
//! - **One owner.** A job takes an exclusive `flock(2)` on `RUN_DIR/gradbus.lock` before it writes
//!   anything there and holds it to its end; the file then names the holder ([`LockHolder`]: job,
//!   pid, host, start time, command). A second job on the directory is refused with exit 2 naming
//!   the first. The kernel drops the lock when its holder dies however it dies, so a crash never
//!   leaves a stale lock, and the file is never removed (removing it would let a third job lock a
//!   new file while a second still locks the old one). `gradbus run` takes the lock itself; rank 0 of
//!   a worker takes it unless its own launcher holds it (the holder's job id is the worker's), so a
//!   bare `mpirun`/`srun` of `gradbus worker` is owned too. Every host that shares the directory must
//!   see the same locks: a local file system, or NFS (where Linux implements `flock` with NFS locks).
//! - **Kept data.** A directory that holds a run ([`run_files`]: its metrics, checkpoints, logs, ...)
//!   is never written over by a new run: [`Mode::Fresh`] refuses it with exit 2 and a hint
//!   (`--resume`, another `--run-dir`, or `--overwrite`, which deletes exactly those files first).
//!   A resume keeps what the runs before it wrote: the launcher appends to the rank logs, and the
//!   earlier launch's own records are kept under its job id: `launch-JOB.json`, and after an abort
//!   `report-JOB.json`, `trace-rank-K-JOB.json` and `dumps-JOB/`.
//! - **Honest resumes.** A checkpoint records the config, world size and build it was trained with
//!   ([`RunRecord`]); `--resume` ([`resumed`]) refuses a change of the model or the bucket layout,
//!   warns about every other change that affects the data (the seed, the world size, any key but
//!   those in [`NOT_DATA`]) with the old and new values, and appends each resume to
//!   `RUN_DIR/resumes.jsonl` ([`ResumeRecord`]).

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::error::WorkerError;
use crate::rank::RankInfo;
use gradbus_artifacts::{self as artifacts, Change, CheckpointMeta, LockHolder, ResumeRecord, RunRecord};

/// The lock file, in the run directory.
pub const LOCK_FILE: &str = "gradbus.lock";
/// One line per `--resume` of the run, in the run directory.
pub const RESUMES_FILE: &str = "resumes.jsonl";

/// Config keys a resume may change without a warning: they change how long the run goes, how often
/// it is saved or how it waits, never the numbers it computes.
pub const NOT_DATA: [&str; 6] =
    ["steps", "checkpoint.every", "collective_timeout_s", "overlap", "warn.headroom", "warn.forecast"];

/// What the job does with what the directory already holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A new run: the directory must not hold one.
    Fresh,
    /// `--resume`: continue the run there.
    Resume,
    /// `--overwrite`: delete the earlier run's files, then a new run.
    Overwrite,
}

impl Mode {
    /// The mode of the `--resume` and `--overwrite` flags (the parsers refuse both at once).
    pub fn of(resume: bool, overwrite: bool) -> Mode {
        match (resume, overwrite) {
            (true, _) => Mode::Resume,
            (false, true) => Mode::Overwrite,
            (false, false) => Mode::Fresh,
        }
    }
}

/// The lock of a run directory; held until dropped (or the process ends).
#[derive(Debug)]
pub struct Owner {
    _file: File,
}

/// Whether the name of a directory entry is one of the files a gradbus run writes.
fn is_run_file(name: &str) -> bool {
    let between = |p: &str, s: &str| name.strip_prefix(p).is_some_and(|r| r.ends_with(s));
    matches!(
        name,
        "launch.json"
            | "metrics.jsonl"
            | "report.json"
            | "report.svg"
            | "checkpoints"
            | "dumps"
            | "mpirun.log"
            | "srun.log"
            | RESUMES_FILE
    ) || between("rank-", ".log")
        || between("trace-rank-", ".json")
        || between("launch-", ".json")
        || between("report-", ".json")
        || name.starts_with("dumps-")
}

/// The files of a run in `dir` (directories with a trailing `/`), sorted; empty when it holds none
/// or does not exist.
pub fn run_files(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let slash = if e.file_type().ok()?.is_dir() { "/" } else { "" };
                    is_run_file(&name).then(|| format!("{name}{slash}"))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

fn io(dir: &Path, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> WorkerError + '_ {
    let what = what.into();
    move |source| WorkerError::RunDirIo { dir: dir.to_path_buf(), what, source }
}

/// The holder described for a message: `job J (pid P on host H, since T): COMMAND`.
fn describe(h: &LockHolder) -> String {
    format!("job {} (pid {} on host {}, started {}): {}", h.job_id, h.pid, h.host, h.started, h.command)
}

/// Reads the holder from the lock file. Its holder writes it right after taking the lock, so an
/// empty or partial file is read again, briefly (bounded), before it is reported as such.
fn read_holder(file: &mut File, path: &Path) -> Result<LockHolder, String> {
    let mut last = String::new();
    for _ in 0..100 {
        let mut text = String::new();
        if file.rewind().and_then(|_| file.read_to_string(&mut text)).is_ok() {
            match artifacts::unseal::<LockHolder>(text.trim_end(), artifacts::LOCK_FORMAT, &path.display().to_string())
            {
                Ok(h) => return Ok(h),
                Err(e) => last = e.to_string(),
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(last)
}

/// Who holds a lock that this process could not take.
enum Taken {
    /// This job, as its lock file says.
    By(LockHolder),
    /// A job the lock file does not name (why not).
    Unreadable(String),
}

/// Tries to take the lock of `dir` for `job_id`; when it does, records this process as the holder.
fn lock(dir: &Path, job_id: &str) -> Result<Result<Owner, Taken>, WorkerError> {
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io(dir, format!("cannot open {LOCK_FILE}")))?;
    // SAFETY: flock(2) on a file descriptor this function owns (it stays open in `file`); no memory
    // is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io(dir, format!("cannot lock {LOCK_FILE}"))(e));
        }
        return Ok(Err(read_holder(&mut file, &path).map_or_else(Taken::Unreadable, Taken::By)));
    }
    let me = LockHolder {
        job_id: job_id.to_string(),
        pid: std::process::id(),
        host: crate::host::hostname().unwrap_or_else(|| "?".into()),
        started: crate::host::utc_stamp(SystemTime::now()),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        gradbus: gradbus_artifacts::version::build(),
    };
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(me.to_text().as_bytes()))
        .and_then(|_| file.sync_data())
        .map_err(io(dir, format!("cannot write {LOCK_FILE}")))?;
    Ok(Ok(Owner { _file: file }))
}

/// Checks (or, with [`Mode::Overwrite`], clears) what `dir` holds; the caller holds its lock.
fn check(dir: &Path, mode: Mode) -> Result<(), WorkerError> {
    let files = run_files(dir);
    match mode {
        Mode::Resume => keep_earlier_records(dir),
        Mode::Fresh if files.is_empty() => Ok(()),
        Mode::Fresh => Err(WorkerError::RunDirHoldsRun { dir: dir.to_path_buf(), files }),
        Mode::Overwrite => {
            for f in &files {
                let p = dir.join(f.trim_end_matches('/'));
                let r = if f.ends_with('/') { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
                r.map_err(io(dir, format!("--overwrite cannot remove {f}")))?;
            }
            if !files.is_empty() {
                eprintln!("gradbus: --overwrite: removed the earlier run in {}: {}", dir.display(), files.join(", "));
            }
            Ok(())
        }
    }
}

/// Keeps what the launch being resumed wrote for itself alone - its launch record `launch.json` and,
/// when it aborted, `report.json`, the `trace-rank-K.json` files and `dumps/` - under names that
/// carry its job id JOB (`launch-JOB.json`, `report-JOB.json`, `trace-rank-K-JOB.json`,
/// `dumps-JOB/`), so that the resuming launch's own records replace none of them. The metrics,
/// checkpoints and rank logs are the run's, continued by the resume.
fn keep_earlier_records(dir: &Path) -> Result<(), WorkerError> {
    let job = std::fs::read_to_string(dir.join("launch.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v.get("job_id")?.as_str().map(String::from))
        .filter(|j| !j.is_empty() && j.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or_else(|| "unknown".into());
    let mut records: Vec<(String, String, &str)> = vec![
        ("launch.json".into(), "launch-".into(), ".json"),
        ("report.json".into(), "report-".into(), ".json"),
        ("dumps".into(), "dumps-".into(), ""),
    ];
    let traces = std::fs::read_dir(dir).map_err(io(dir, "cannot list the run directory"))?;
    for e in traces.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(k) = name.strip_prefix("trace-rank-").and_then(|r| r.strip_suffix(".json")) {
            if k.parse::<usize>().is_ok() {
                records.push((name.clone(), format!("trace-rank-{k}-"), ".json"));
            }
        }
    }
    for (name, prefix, suffix) in records {
        let path = dir.join(&name);
        if !path.exists() {
            continue;
        }
        let mut kept = dir.join(format!("{prefix}{job}{suffix}"));
        for n in 2.. {
            if !kept.exists() {
                break;
            }
            kept = dir.join(format!("{prefix}{job}-{n}{suffix}"));
        }
        std::fs::rename(&path, &kept).map_err(io(dir, format!("cannot keep the earlier launch's {name}")))?;
    }
    Ok(())
}

/// `gradbus run`: takes the lock of `dir` (which exists) for job `job_id`, then checks or clears
/// it according to `mode`. Keep the [`Owner`] for the whole job.
pub fn claim(dir: &Path, mode: Mode, job_id: &str) -> Result<Owner, WorkerError> {
    let owner = lock(dir, job_id)?.map_err(|taken| in_use(dir, taken))?;
    check(dir, mode).map(|()| owner)
}

/// Rank 0 of a worker: the same as [`claim`], except that when this job's own launcher holds the
/// lock (the holder's job id is `job_id`) it has checked the directory already: `Ok(None)`.
pub fn claim_as_worker(dir: &Path, mode: Mode, job_id: &str) -> Result<Option<Owner>, WorkerError> {
    match lock(dir, job_id)? {
        Ok(owner) => check(dir, mode).map(|()| Some(owner)),
        Err(Taken::By(holder)) if holder.job_id == job_id => Ok(None),
        Err(taken) => Err(in_use(dir, taken)),
    }
}

/// The refusal of a lock another job holds.
fn in_use(dir: &Path, taken: Taken) -> WorkerError {
    let holder = match taken {
        Taken::By(h) => describe(&h),
        Taken::Unreadable(why) => format!("another job (its {LOCK_FILE} cannot be read: {why})"),
    };
    WorkerError::RunDirInUse { dir: dir.to_path_buf(), holder }
}

/// What this run trains with, for its checkpoints.
pub fn record(config: &str, world: usize) -> RunRecord {
    RunRecord { gradbus: gradbus_artifacts::version::build(), world, config: config.to_string() }
}

/// Every leaf of a TOML table as (dotted key, value as TOML); arrays (the fault plan) are one value.
fn leaves(prefix: &str, table: &toml::Table, out: &mut Vec<(String, String)>) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) => leaves(&key, t, out),
            other => out.push((key, other.to_string())),
        }
    }
}

/// The keys whose values differ between two canonical config texts, with both values (`(not set)`
/// where a side leaves the key to its default), in key order.
fn config_changes(old: &str, new: &str) -> Vec<Change> {
    let flat = |text: &str| {
        let mut out = Vec::new();
        leaves("", &text.parse::<toml::Table>().unwrap_or_default(), &mut out);
        out.into_iter().collect::<std::collections::BTreeMap<_, _>>()
    };
    let (a, b) = (flat(old), flat(new));
    let unset = || "(not set)".to_string();
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| Change {
            key: k.clone(),
            old: a.get(k).cloned().unwrap_or_else(unset),
            new: b.get(k).cloned().unwrap_or_else(unset),
        })
        .collect()
}

/// Whether a changed key changes the model or its bucket layout: such a checkpoint cannot be loaded.
fn reshapes(key: &str) -> bool {
    key.starts_with("model.") || key == "bucket_bytes"
}

/// What `--resume` from a checkpoint trained as `old` changes when it runs with `config` on `world`
/// ranks: the changes that affect the data (seed, world size, keys not in [`NOT_DATA`]), or an
/// error naming every model or layout key that changed.
pub fn compare(old: &RunRecord, config: &str, world: usize) -> Result<Vec<Change>, String> {
    let mut changes = config_changes(&old.config, config);
    let refused: Vec<String> =
        changes.iter().filter(|c| reshapes(&c.key)).map(|c| format!("{} {} -> {}", c.key, c.old, c.new)).collect();
    if !refused.is_empty() {
        return Err(format!(
            "the checkpoint was trained with another model or bucket layout: {} (hint: resume with the \
             model it was trained with, or start a new run with another --run-dir)",
            refused.join(", ")
        ));
    }
    changes.retain(|c| !NOT_DATA.contains(&c.key.as_str()));
    if old.world != world {
        changes.insert(0, Change { key: "world size".into(), old: old.world.to_string(), new: world.to_string() });
    }
    Ok(changes)
}

/// Called by every rank when `--resume` has loaded the checkpoint in `dir` (metadata `meta`): refuses
/// a model or layout change (on every rank), and on rank 0 warns about every other change of the
/// data and appends the resume to `RUN_DIR/resumes.jsonl`.
pub fn resumed(
    dir: &Path,
    meta: &CheckpointMeta,
    config: &str,
    info: &RankInfo,
    run_dir: &Path,
) -> Result<(), WorkerError> {
    let changes = match &meta.run {
        Some(old) => {
            Some(compare(old, config, info.world).map_err(|e| WorkerError::Usage(format!("{}: {e}", dir.display())))?)
        }
        None => None,
    };
    if info.rank != 0 {
        return Ok(());
    }
    let path = run_dir.join(RESUMES_FILE);
    match &changes {
        None => eprintln!(
            "note: --resume: {} predates checkpoints that record their config (format 1): the seed, \
             world size and config keys cannot be compared",
            dir.display()
        ),
        Some(c) if c.is_empty() => {}
        Some(c) => {
            let list: Vec<String> = c.iter().map(|c| format!("{}: {} -> {}", c.key, c.old, c.new)).collect();
            eprintln!(
                "warning: --resume: this run continues the checkpoint at step {} with other data than it was \
                 trained with: {} (recorded in {})",
                meta.step,
                list.join("; "),
                path.display()
            );
        }
    }
    let line = ResumeRecord {
        step: meta.step,
        job_id: info.job_id.clone(),
        at: crate::host::utc_stamp(SystemTime::now()),
        gradbus: gradbus_artifacts::version::build(),
        changes,
    }
    .to_line();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| WorkerError::io(&path.display().to_string(), e))?;
    writeln!(f, "{line}").map_err(|e| WorkerError::io(&path.display().to_string(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_has_one_holder_and_names_it_to_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let owner = claim(dir.path(), Mode::Fresh, "jobA").unwrap();
        let e = claim(dir.path(), Mode::Fresh, "jobB").unwrap_err().to_string();
        let me = format!("job jobA (pid {} on host ", std::process::id());
        assert!(e.contains("is in use by") && e.contains(&me) && e.contains("hint:"), "{e}");
        // The holder's own workers (same job id) pass; another job's do not.
        assert!(claim_as_worker(dir.path(), Mode::Fresh, "jobA").unwrap().is_none());
        assert!(claim_as_worker(dir.path(), Mode::Fresh, "jobB").is_err());
        drop(owner);
        // Released: the next job takes it, and the file now names that job.
        let _b = claim(dir.path(), Mode::Fresh, "jobB").unwrap();
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert!(text.contains("\"job_id\":\"jobB\""), "{text}");
    }

    #[test]
    fn a_run_is_kept_unless_resumed_or_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for f in ["metrics.jsonl", "rank-0.log", "trace-rank-1.json", "notes.txt", "rank-x.txt"] {
            std::fs::write(d.join(f), "x").unwrap();
        }
        std::fs::create_dir_all(d.join("checkpoints/step-000002")).unwrap();
        assert_eq!(run_files(d), ["checkpoints/", "metrics.jsonl", "rank-0.log", "trace-rank-1.json"]);
        let e = claim(d, Mode::Fresh, "j").unwrap_err().to_string();
        assert!(e.contains("holds an earlier run (checkpoints/, metrics.jsonl, rank-0.log, trace-rank-1.json)"), "{e}");
        assert!(e.contains("--resume") && e.contains("--run-dir") && e.contains("--overwrite"), "{e}");
        assert_eq!(run_files(d).len(), 4, "a refusal deletes nothing");
        std::fs::write(d.join("launch.json"), r#"{"job_id": "20261201T000000p7"}"#).unwrap();
        std::fs::write(d.join("report.json"), "the abort").unwrap();
        std::fs::create_dir_all(d.join("dumps")).unwrap();
        std::fs::write(d.join("dumps/rank-0.bin"), "dump").unwrap();
        drop(claim(d, Mode::Resume, "j").unwrap());
        assert!(!d.join("launch.json").exists() && d.join("launch-20261201T000000p7.json").exists());
        // An aborted launch's report, traces and dumps are kept under its job id, not replaced.
        assert_eq!(std::fs::read_to_string(d.join("report-20261201T000000p7.json")).unwrap(), "the abort");
        assert!(d.join("trace-rank-1-20261201T000000p7.json").exists() && !d.join("trace-rank-1.json").exists());
        assert!(d.join("dumps-20261201T000000p7/rank-0.bin").exists() && !d.join("dumps").exists());
        // A second resume of a launch with the same id keeps both.
        std::fs::write(d.join("launch.json"), r#"{"job_id": "20261201T000000p7"}"#).unwrap();
        drop(claim(d, Mode::Resume, "j").unwrap());
        assert!(d.join("launch-20261201T000000p7-2.json").exists());
        drop(claim(d, Mode::Overwrite, "j").unwrap());
        assert!(run_files(d).is_empty());
        // The user's own files stay.
        assert!(d.join("notes.txt").exists() && d.join("rank-x.txt").exists());
        drop(claim(d, Mode::Fresh, "j").unwrap());
    }

    #[test]
    fn resume_refuses_a_new_model_and_names_data_changes_with_both_values() {
        let old = record("seed = 1\nsteps = 10\n\n[model]\nheads = 4\n\n[optim]\nlr = 0.001\n", 2);
        let same = compare(&old, "seed = 1\nsteps = 20\n\n[model]\nheads = 4\n\n[optim]\nlr = 0.001\n", 2).unwrap();
        assert_eq!(same, [], "steps is not data");
        let c = compare(&old, "seed = 2\n\n[model]\nheads = 4\n\n[optim]\nlr = 0.002\n", 4).unwrap();
        let got: Vec<_> = c.iter().map(|c| (c.key.as_str(), c.old.as_str(), c.new.as_str())).collect();
        assert_eq!(got, [("world size", "2", "4"), ("optim.lr", "0.001", "0.002"), ("seed", "1", "2")]);
        let c = compare(&old, "[model]\nheads = 4\n\n[optim]\nlr = 0.001\n", 2).unwrap();
        assert_eq!(c, [Change { key: "seed".into(), old: "1".into(), new: "(not set)".into() }]);
        let e = compare(&old, "seed = 1\n\n[model]\nheads = 2\n", 2).unwrap_err();
        assert!(e.contains("model.heads 4 -> 2") && e.contains("hint:"), "{e}");
        let e = compare(&old, "seed = 1\nbucket_bytes = 4\n\n[model]\nheads = 4\n", 2).unwrap_err();
        assert!(e.contains("bucket_bytes (not set) -> 4"), "{e}");
    }
}
