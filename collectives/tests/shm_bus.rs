//! Multi-process tests of the shared-memory bus, with REAL processes.
//!
//! Self-exec pattern: each test (the parent) re-runs this test binary to run only `child_entry` (an
//! ignored test: common/child.rs) with `GRADBUS_TEST_CHILD=<scenario>`; the child acts as local rank
//! `GB_RANK`, writes what it saw into files of the test's temp dir and exits with a code that encodes
//! its outcome (0 = success, see `code_of`). The parent waits with a time limit (killing every child past it), compares the
//! files across ranks and with a serial oracle, and checks that no segment is left in /dev/shm.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gradbus_collectives::shm::{read_progress, remove_job_segments, BusConfig, ShmBus};
use gradbus_collectives::{
    decide, Error, History, Layout, LocalScalars, ParamSpec, Policy, Progress, StepId, Transport,
};
use gradbus_kernels::rng::Rng;

#[path = "common/child.rs"]
mod child;
mod common;
#[path = "../../tests/common/skip.rs"]
mod skip;
use common::{digest, value_names};

const CHILD_ENV: &str = "GRADBUS_TEST_CHILD";
const SHM: &str = "/dev/shm";

// ---------------------------------------------------------------- shared by parent and child

/// Outcome codes of a child.
fn code_of(e: &Error) -> i32 {
    match e {
        Error::Timeout { .. } => 20,
        Error::PeerFailed { .. } => 21,
        Error::BadSegment { .. } => 22,
        Error::ShmFull { .. } => 23,
        Error::Mismatch { .. } => 24,
        Error::Io { .. } => 25,
        Error::Mpi { .. } => 26,
        Error::Cuda(_) | Error::Nccl { .. } => 27,
        Error::Config { .. } => 28,
        Error::Unsupported { .. } => 29,
    }
}

/// Sizes with ragged ends, a 1-element parameter (one 16-float bucket: chunks of 16, 0, 0...) and a
/// 0-element one (an empty bucket).
fn reduce_layout() -> Layout {
    let sizes = [1000, 1, 0, 37, 5000, 3, 70001];
    let specs: Vec<_> = sizes.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), n)).collect();
    Layout::new(&specs, 0)
}

fn nonfinite_layout() -> Layout {
    let specs = [ParamSpec::new("embed", 3000), ParamSpec::new("blk.w", 5000), ParamSpec::new("head", 70)];
    Layout::new(&specs, 0)
}

/// Rank `rank`'s gradients for update `seed`: a pure function of (seed, rank).
fn inputs(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(&[seed, rank as u64]);
    (0..len).map(|_| rng.normal()).collect()
}

fn to_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

// ---------------------------------------------------------------- child side

struct Env {
    scenario: String,
    rank: usize,
    np: usize,
    job: String,
    dir: PathBuf,
    seed: u64,
    arg: usize,
}

fn env() -> Env {
    let get = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    Env {
        scenario: child::scenario(CHILD_ENV),
        rank: get("GB_RANK").parse().unwrap(),
        np: get("GB_NP").parse().unwrap(),
        job: get("GB_JOB"),
        dir: PathBuf::from(get("GB_DIR")),
        seed: get("GB_SEED").parse().unwrap(),
        arg: get("GB_ARG").parse().unwrap(),
    }
}

fn config(e: &Env, layout: Layout, timeout: Duration) -> BusConfig {
    let mut c = BusConfig::new(e.job.clone(), e.rank, e.np, layout);
    c.timeout = timeout;
    c.values = value_names();
    c
}

/// The child's entry (see common/child.rs).
#[test]
#[ignore = "not a test: the child process that this file's tests start"]
fn child_entry() {
    let e = env();
    let code = match std::panic::catch_unwind(|| run_child(&e)) {
        Ok(Ok(())) => 0,
        Ok(Err(err)) => {
            std::fs::write(e.dir.join(format!("outcome-{}.txt", e.rank)), format!("{err:?}\n{err}")).unwrap();
            code_of(&err)
        }
        Err(_) => 101,
    };
    std::process::exit(code);
}

fn run_child(e: &Env) -> Result<(), Error> {
    let long = Duration::from_secs(30);
    match e.scenario.as_str() {
        "reduce" => child_reduce(e),
        "nonfinite" => child_nonfinite(e),
        "stall" => {
            // `arg` is the stalled rank: it attaches and then sleeps (alive) until killed.
            let mut bus = ShmBus::open(config(e, reduce_layout(), Duration::from_millis(1500)))?;
            if e.rank == e.arg {
                std::thread::sleep(Duration::from_secs(600));
            }
            bus.allreduce_bucket(StepId { step: 5, ..StepId::default() }, 0)
        }
        "exit" | "exit-mark" | "exit-leave" => {
            // `arg` is the rank that exits without cleanup (as under kill -9), or marks itself
            // failed, or drops the bus, and then stays alive. The others would wait 30 s for it,
            // far beyond the parent's limit, unless they notice.
            let mut bus = ShmBus::open(config(e, reduce_layout(), long))?;
            if e.rank == e.arg {
                match e.scenario.as_str() {
                    "exit" => std::process::exit(0),
                    "exit-mark" => bus.mark_failed(),
                    _ => drop(bus),
                }
                std::thread::sleep(Duration::from_secs(600));
                unreachable!("killed by the parent");
            }
            bus.allreduce_bucket(StepId { step: 9, ..StepId::default() }, 1)
        }
        "mismatch" => {
            let mut bus = ShmBus::open(config(e, reduce_layout(), long))?;
            bus.allreduce_bucket(StepId::default(), e.rank)
        }
        "badhash" => {
            let mut c = config(e, reduce_layout(), Duration::from_millis(1500));
            c.config_hash = c.config_hash.wrapping_add(e.rank as u64);
            ShmBus::open(c).map(drop)
        }
        "create-and-die" => {
            let mut c = config(e, reduce_layout(), long);
            c.shm_dir = e.dir.clone();
            let bus = ShmBus::open(c)?;
            std::mem::forget(bus);
            std::process::exit(0);
        }
        "shmfull" => child_shmfull(e),
        other => panic!("unknown scenario {other}"),
    }
}

fn child_reduce(e: &Env) -> Result<(), Error> {
    let layout = reduce_layout();
    if e.arg == 1 {
        // Before any other thread exists in this child (`set_var` is not thread-safe).
        std::env::set_var(gradbus_collectives::AgreementPath::ENV, "table");
    }
    let mut bus = ShmBus::open(config(e, layout.clone(), Duration::from_secs(30)))?;
    let mut history = History::default();
    for u in 0..3u64 {
        bus.grads().copy_from_slice(&inputs(e.seed + u, e.rank, layout.len));
        let at = StepId { step: u, ..StepId::default() };
        if u == 1 && e.rank == e.np - 1 {
            // A late rank: the others wait past the spin/yield phase and sleep on the futex (the
            // outcome must not change).
            std::thread::sleep(Duration::from_millis(20));
        }
        for b in 0..layout.buckets.len() {
            bus.allreduce_bucket(at, b)?;
        }
        let report = LocalScalars {
            loss: e.rank as f64 + 0.5,
            values: vec![u as f64; value_names().len()],
            replica: 7,
            state: 0,
        };
        let table = bus.agree(at, report)?;
        let verdict = decide(&table, &layout, &Policy::Abort, &history, at);
        history.record(&table, &verdict);
        std::fs::write(e.dir.join(format!("grads-{}-{u}.bin", e.rank)), to_bytes(bus.grads())).unwrap();
        std::fs::write(e.dir.join(format!("table-{}-{u}.txt", e.rank)), format!("{table:?}\n{verdict:?}")).unwrap();
        // Every rank's cells, whichever path the agreement took (the summary path gathers none).
        let rows: Vec<_> = (0..e.np).map(|k| bus.last_local_row(k)).collect();
        if table.is_detailed() {
            assert_eq!(
                table.local,
                (0..layout.buckets.len()).flat_map(|b| rows.iter().map(move |r| r[b])).collect::<Vec<_>>()
            );
        }
        let cells: Vec<_> = (0..layout.buckets.len())
            .flat_map(|b| rows.iter().map(move |r| r[b]))
            .map(|h| serde_json::json!([h.nan, h.inf, h.sumsq, h.first_bad]))
            .collect();
        std::fs::write(e.dir.join(format!("digest-{}-{u}.txt", e.rank)), digest(&table, &verdict)).unwrap();
        std::fs::write(e.dir.join(format!("cells-{}-{u}.json", e.rank)), serde_json::to_string(&cells).unwrap())
            .unwrap();
    }
    // Progress: every rank publishes through its own mapping of its cell, rank 0 peeks at the
    // segment like the launcher does.
    let p = Progress { step: 100 + e.rank as u64, loss: 0.25, grad_norm: e.rank as f32, skipped: 1, warnings: 2 };
    bus.progress_writer()?.publish(p);
    bus.barrier("published", StepId::default())?;
    if e.rank == 0 {
        let p = read_progress(bus.path()).expect("segment readable");
        let steps: Vec<u64> = p.iter().map(|p| p.step).collect();
        assert_eq!(steps, (0..e.np as u64).map(|r| 100 + r).collect::<Vec<_>>());
        assert!(p
            .iter()
            .enumerate()
            .all(|(r, p)| p.grad_norm == r as f32 && p.loss == 0.25 && p.skipped == 1 && p.warnings == 2));
        let st = gradbus_collectives::read_status(bus.path()).expect("segment readable");
        assert_eq!(st.len(), e.np);
        assert!(st.iter().all(|s| s.pid != 0 && !s.failed && !s.departed && s.barriers >= 1), "{st:?}");
        assert_eq!(st[0].pid, std::process::id());
    }
    bus.barrier("end", StepId::default())
}

/// NaN at `blk.w`[4000] and [4500] on rank 2, Inf at `embed`[5] on rank 0 (world 3).
fn child_nonfinite(e: &Env) -> Result<(), Error> {
    let layout = nonfinite_layout();
    let mut bus = ShmBus::open(config(e, layout.clone(), Duration::from_secs(30)))?;
    let mut x = inputs(e.seed, e.rank, layout.len);
    let w = layout.slot("blk.w").unwrap().offset;
    let emb = layout.slot("embed").unwrap().offset;
    if e.rank == 2 {
        x[w + 4000] = f32::NAN;
        x[w + 4500] = f32::NAN;
    }
    if e.rank == 0 {
        x[emb + 5] = f32::INFINITY;
    }
    bus.grads().copy_from_slice(&x);
    let at = StepId { step: 205, minibatch: 1, attempt: 0 };
    for b in 0..layout.buckets.len() {
        bus.allreduce_bucket(at, b)?;
    }
    let table =
        bus.agree(at, LocalScalars { loss: 1.0, values: vec![0.0; value_names().len()], replica: 0, state: 0 })?;
    let verdict = decide(&table, &layout, &Policy::Abort, &History::default(), at);
    let json = serde_json::to_string(&verdict.report).unwrap();
    std::fs::write(e.dir.join(format!("table-{}.txt", e.rank)), format!("{table:?}\n{verdict:?}")).unwrap();
    std::fs::write(e.dir.join(format!("report-{}.json", e.rank)), json).unwrap();
    bus.barrier("end", at)
}

/// Runs inside a private mount namespace with a 1 MiB tmpfs at `{dir}/shm` (see the parent).
fn child_shmfull(e: &Env) -> Result<(), Error> {
    let shm = e.dir.join("shm");
    // A bus that fits: the tmpfs works.
    let mut small = config(e, Layout::new(&[ParamSpec::new("w", 1000)], 0), Duration::from_secs(5));
    small.shm_dir = shm.clone();
    drop(ShmBus::open(small)?);
    // 4 MiB of gradients do not fit in 1 MiB: a clear error up front, no SIGBUS, nothing left.
    let mut big = config(e, Layout::new(&[ParamSpec::new("w", 1 << 20)], 0), Duration::from_secs(5));
    big.shm_dir = shm.clone();
    let r = ShmBus::open(big).map(drop);
    let left = std::fs::read_dir(&shm).unwrap().count();
    assert_eq!(left, 0, "no segment left behind in the full tmpfs");
    r
}

// ---------------------------------------------------------------- parent side

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A unique job id and a fresh temp dir for one test.
fn job(name: &str) -> (String, tempfile::TempDir) {
    let job = format!("t{}-{name}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    (job, tempfile::tempdir().unwrap())
}

fn spawn(scenario: &str, rank: usize, np: usize, job: &str, dir: &Path, arg: usize) -> Child {
    spawn_via(None, scenario, rank, np, job, dir, arg)
}

/// Spawn this test binary as rank `rank`, optionally through a wrapper command (`unshare ...`).
fn spawn_via(
    wrap: Option<&[&str]>,
    scenario: &str,
    rank: usize,
    np: usize,
    job: &str,
    dir: &Path,
    arg: usize,
) -> Child {
    let exe = std::env::current_exe().unwrap();
    let exe = exe.to_str().unwrap();
    let mut cmd = match wrap {
        Some(w) => {
            let mut c = Command::new(w[0]);
            c.args(&w[1..]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(child::args("child_entry"));
    let log = std::fs::File::create(dir.join(format!("child-{rank}.log"))).unwrap();
    cmd.env(CHILD_ENV, scenario)
        .env("GB_RANK", rank.to_string())
        .env("GB_NP", np.to_string())
        .env("GB_JOB", job)
        .env("GB_DIR", dir)
        .env("GB_SEED", "1234")
        .env("GB_ARG", arg.to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    cmd.spawn().unwrap()
}

fn logs(dir: &Path, np: usize) -> String {
    (0..np)
        .map(|r| {
            format!(
                "--- rank {r}: {}\n{}",
                outcome(dir, r),
                std::fs::read_to_string(dir.join(format!("child-{r}.log"))).unwrap_or_default()
            )
        })
        .collect()
}

/// Wait for every child that is not in `stalled`; past the limit, kill them all and fail. Then kill
/// and reap the stalled ones. Returns the exit codes (None for a killed child).
fn wait_children(children: &mut [Child], stalled: &[usize], dir: &Path) -> Vec<Option<i32>> {
    let limit = Instant::now() + Duration::from_secs(60);
    let mut codes: Vec<Option<Option<i32>>> = vec![None; children.len()];
    loop {
        for (r, c) in children.iter_mut().enumerate() {
            if codes[r].is_none() {
                if let Some(st) = c.try_wait().unwrap() {
                    codes[r] = Some(st.code());
                }
            }
        }
        if (0..children.len()).all(|r| stalled.contains(&r) || codes[r].is_some()) {
            break;
        }
        if Instant::now() > limit {
            for c in children.iter_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            panic!("children did not finish within the limit\n{}", logs(dir, children.len()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for &r in stalled {
        if codes[r].is_none() {
            let _ = children[r].kill();
            codes[r] = Some(children[r].wait().unwrap().code());
        }
    }
    codes.into_iter().map(|c| c.unwrap()).collect()
}

fn assert_no_segment(job: &str) {
    let prefix = format!("gradbus-{job}-");
    let left: Vec<_> = std::fs::read_dir(SHM)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "segments left in {SHM}: {left:?}");
}

fn outcome(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("outcome-{rank}.txt"))).unwrap_or_default()
}

/// The reduce scenario at `np` ranks (`table`: force the table path); every check below, then
/// rank 0's digest of each update.
fn run_reduce(np: usize, table: bool) -> Vec<String> {
    let (job, dir) = job(&format!("reduce{np}"));
    let arg = usize::from(table);
    let mut ch: Vec<Child> = (0..np).map(|r| spawn("reduce", r, np, &job, dir.path(), arg)).collect();
    let codes = wait_children(&mut ch, &[], dir.path());
    assert!(codes.iter().all(|&c| c == Some(0)), "exit codes {codes:?}\n{}", logs(dir.path(), np));
    let layout = reduce_layout();
    for u in 0..3u64 {
        // Serial oracle: ((x0 + x1) + x2) + ..., element by element, in rank order.
        let mut want = inputs(1234 + u, 0, layout.len);
        for r in 1..np {
            for (a, b) in want.iter_mut().zip(inputs(1234 + u, r, layout.len)) {
                *a += b;
            }
        }
        let want = to_bytes(&want);
        let table0 = std::fs::read_to_string(dir.path().join(format!("table-0-{u}.txt"))).unwrap();
        assert!(table0.contains("action: Proceed"), "{table0}");
        for r in 0..np {
            let got = std::fs::read(dir.path().join(format!("grads-{r}-{u}.bin"))).unwrap();
            assert!(got == want, "update {u}: rank {r}'s reduced buffer differs from the serial rank-order sum");
            let t = std::fs::read_to_string(dir.path().join(format!("table-{r}-{u}.txt"))).unwrap();
            assert_eq!(t, table0, "update {u}: rank {r}'s table differs from rank 0's");
            let d = std::fs::read_to_string(dir.path().join(format!("digest-{r}-{u}.txt"))).unwrap();
            assert_eq!(d, std::fs::read_to_string(dir.path().join(format!("digest-0-{u}.txt"))).unwrap());
        }
        // The table's per-rank cells agree with a direct scan of each rank's input (the bus merges
        // chunk sums, a different order than one scan of the whole bucket: equal to ~1 ulp).
        let cells: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(format!("cells-0-{u}.json"))).unwrap())
                .unwrap();
        for r in 0..np {
            let x = inputs(1234 + u, r, layout.len);
            for (b, bucket) in layout.buckets.iter().enumerate() {
                let h = gradbus_kernels::health_scan(&x[bucket.range.clone()]);
                let c = &cells[b * np + r];
                assert_eq!(
                    (c[0].as_u64(), c[1].as_u64(), c[3].is_null()),
                    (Some(0), Some(0), true),
                    "bucket {b} rank {r}"
                );
                let got = c[2].as_f64().unwrap();
                assert!((got - h.sumsq).abs() <= 1e-12 * h.sumsq, "bucket {b} rank {r}: sumsq {got} vs {}", h.sumsq);
            }
        }
    }
    assert_no_segment(&job);
    (0..3).map(|u| std::fs::read_to_string(dir.path().join(format!("digest-0-{u}.txt"))).unwrap()).collect()
}

#[test]
fn reduce_2_ranks_is_bitwise_the_serial_rank_order_sum() {
    run_reduce(2, false);
}

#[test]
fn reduce_3_ranks_is_bitwise_the_serial_rank_order_sum() {
    run_reduce(3, false);
}

#[test]
fn reduce_4_ranks_is_bitwise_the_serial_rank_order_sum() {
    run_reduce(4, false);
}

/// The summary path (the default) and the forced table path agree on everything a rank decides
/// and reports from, bit for bit, at 1 to 4 ranks.
#[test]
fn summary_and_table_paths_agree_bitwise_at_1_to_4_ranks() {
    for np in 1..=4 {
        let (summary, table) = (run_reduce(np, false), run_reduce(np, true));
        assert_eq!(summary, table, "{np} ranks");
    }
}

#[test]
fn nonfinite_gradients_give_every_rank_the_same_verdict_naming_rank_bucket_param_element() {
    let np = 3;
    let (job, dir) = job("nonfinite");
    let mut ch: Vec<Child> = (0..np).map(|r| spawn("nonfinite", r, np, &job, dir.path(), 0)).collect();
    let codes = wait_children(&mut ch, &[], dir.path());
    assert!(codes.iter().all(|&c| c == Some(0)), "exit codes {codes:?}\n{}", logs(dir.path(), np));
    let read = |name: String| std::fs::read_to_string(dir.path().join(name)).unwrap();
    let (t0, j0) = (read("table-0.txt".into()), read("report-0.json".into()));
    for r in 1..np {
        assert_eq!(read(format!("table-{r}.txt")), t0, "rank {r}'s table and verdict");
        assert_eq!(read(format!("report-{r}.json")), j0, "rank {r}'s report");
    }
    let v: serde_json::Value = serde_json::from_str(&j0).unwrap();
    assert_eq!(v["verdict"], "abort");
    assert_eq!(v["step"], 205);
    assert_eq!(v["ranks"], serde_json::json!([0, 2]));
    // Buckets in reduce order: #0 head, #1 blk.w, #2 embed. The first bad bucket is #1 (rank 2).
    assert_eq!(v["bucket"], 1);
    assert_eq!(v["param"], "blk.w");
    assert_eq!(v["element"], 4000);
    assert_eq!(v["nan"], 2);
    assert_eq!(v["inf"], 1);
    assert_eq!(v["per_rank"][0]["first_bucket"], 2);
    assert_no_segment(&job);
}

#[test]
fn a_stalled_rank_is_named_by_a_timeout_on_every_other_rank() {
    let np = 3;
    let stalled = 2;
    let (job, dir) = job("stall");
    let mut ch: Vec<Child> = (0..np).map(|r| spawn("stall", r, np, &job, dir.path(), stalled)).collect();
    let codes = wait_children(&mut ch, &[stalled], dir.path());
    for r in 0..np - 1 {
        let o = outcome(dir.path(), r);
        assert_eq!(codes[r], Some(20), "rank {r}: {o}\n{}", logs(dir.path(), np));
        assert!(o.contains("missing: [2]") && o.contains("phase: \"reduce\"") && o.contains("step: 5"), "{o}");
        assert!(o.contains("bucket: Some(0)"), "{o}");
    }
    assert_eq!(codes[stalled], None, "the stalled rank was still alive and had to be killed");
    assert_no_segment(&job);
}

fn run_exit(how: &str, np: usize, dead: usize) {
    let (job, dir) = job(&format!("{how}{dead}"));
    let mut ch: Vec<Child> = (0..np).map(|r| spawn(how, r, np, &job, dir.path(), dead)).collect();
    // A rank that marked itself failed or left the bus stays alive: killed after the others.
    let alive: &[usize] = if how == "exit" { &[] } else { &[dead] };
    let codes = wait_children(&mut ch, alive, dir.path());
    for r in (0..np).filter(|&r| r != dead) {
        let o = outcome(dir.path(), r);
        assert_eq!(codes[r], Some(21), "rank {r}: {o}\n{}", logs(dir.path(), np));
        assert!(o.contains(&format!("PeerFailed {{ rank: {dead}")) && o.contains("step: 9"), "{o}");
    }
    assert_eq!(codes[dead], if how == "exit" { Some(0) } else { None });
    if dead == 0 && how == "exit" {
        // The creator died without cleanup: the launcher's sweep removes its segment.
        assert_eq!(remove_job_segments(Path::new(SHM), &job).unwrap(), 1);
    }
    assert_no_segment(&job);
}

#[test]
fn a_rank_that_dies_fails_the_others_at_once_with_peer_failed() {
    run_exit("exit", 3, 1);
}

#[test]
fn a_rank_that_marks_itself_failed_fails_the_others_at_once() {
    run_exit("exit-mark", 3, 2);
}

#[test]
fn a_rank_that_drops_the_bus_fails_the_others_at_once() {
    run_exit("exit-leave", 2, 1);
}

#[test]
fn a_creator_that_dies_fails_the_others_and_the_sweep_removes_its_segment() {
    run_exit("exit", 2, 0);
}

#[test]
fn ranks_in_different_buckets_all_fail_with_mismatch() {
    let np = 2;
    let (job, dir) = job("mismatch");
    let mut ch: Vec<Child> = (0..np).map(|r| spawn("mismatch", r, np, &job, dir.path(), 0)).collect();
    let codes = wait_children(&mut ch, &[], dir.path());
    assert_eq!(codes, vec![Some(24), Some(24)], "{}", logs(dir.path(), np));
    assert!(outcome(dir.path(), 0).contains("bucket #1"), "{}", outcome(dir.path(), 0));
    assert_no_segment(&job);
}

#[test]
fn attach_with_a_different_config_hash_is_refused() {
    let np = 2;
    let (job, dir) = job("badhash");
    let mut ch: Vec<Child> = (0..np).map(|r| spawn("badhash", r, np, &job, dir.path(), 0)).collect();
    let codes = wait_children(&mut ch, &[], dir.path());
    let o1 = outcome(dir.path(), 1);
    assert_eq!(codes[1], Some(22), "{o1}\n{}", logs(dir.path(), np));
    assert!(o1.contains("config hash"), "{o1}");
    // Rank 0 never saw rank 1 attach: a timeout in `attach` naming it.
    let o0 = outcome(dir.path(), 0);
    assert_eq!(codes[0], Some(20), "{o0}");
    assert!(o0.contains("missing: [1]") && o0.contains("attach"), "{o0}");
    assert_no_segment(&job);
}

fn solo_config(job: &str, dir: &Path, rank: usize, np: usize) -> BusConfig {
    let mut c = BusConfig::new(job, rank, np, reduce_layout());
    c.shm_dir = dir.to_path_buf();
    c.timeout = Duration::from_millis(300);
    c
}

#[test]
fn the_bus_can_move_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ShmBus>();
}

#[test]
fn attach_to_a_file_with_bad_magic_is_refused() {
    let (job, dir) = job("badmagic");
    let path = ShmBus::segment_path(dir.path(), &job, 0);
    let mut junk = vec![0u8; 8192];
    junk[..8].copy_from_slice(b"NOTGRADB");
    std::fs::write(&path, junk).unwrap();
    match ShmBus::open(solo_config(&job, dir.path(), 1, 2)) {
        Err(Error::BadSegment { reason, .. }) => assert!(reason.contains("magic"), "{reason}"),
        other => panic!("expected BadSegment, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_stale_segment_of_a_dead_creator_is_replaced_and_a_live_one_is_not() {
    let (job, dir) = job("stale");
    let path = ShmBus::segment_path(dir.path(), &job, 0);
    // A creator that dies without cleanup (local size 1: its attach barrier passes alone).
    let mut ch = vec![spawn("create-and-die", 0, 1, &job, dir.path(), 0)];
    assert_eq!(wait_children(&mut ch, &[], dir.path()), vec![Some(0)], "{}", logs(dir.path(), 1));
    // Held open, the stale file keeps its inode number, so a fresh segment gets another one.
    let stale = std::fs::File::open(&path).expect("stale segment left");
    let stale_ino = std::os::unix::fs::MetadataExt::ino(&stale.metadata().unwrap());
    assert!(read_progress(&path).is_some(), "the stale segment is initialised");
    // An attacher does not attach to it (its creator is dead): it waits for a new one, times out.
    match ShmBus::open(solo_config(&job, dir.path(), 1, 2)) {
        Err(Error::Timeout { phase, missing, .. }) => {
            assert_eq!((phase.as_str(), missing), ("attach", vec![0]))
        }
        other => panic!("expected Timeout, got {:?}", other.map(|_| ())),
    }
    // The next creator removes it and makes a fresh one.
    let bus = ShmBus::open(solo_config(&job, dir.path(), 0, 1)).expect("stale segment replaced");
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap());
    assert_ne!(ino, stale_ino, "a fresh segment");
    assert_eq!(std::os::unix::fs::MetadataExt::nlink(&stale.metadata().unwrap()), 0, "the stale one was unlinked");
    // A second creator while this one lives is refused.
    match ShmBus::open(solo_config(&job, dir.path(), 0, 1)) {
        Err(Error::BadSegment { reason, .. }) => {
            assert!(reason.contains("live process"), "{reason}")
        }
        other => panic!("expected BadSegment, got {:?}", other.map(|_| ())),
    }
    assert!(path.exists(), "the refused creator left the live segment alone");
    drop(bus);
    assert!(!path.exists(), "the creator unlinks on drop");
    assert!(read_progress(&path).is_none());
}

#[test]
fn remove_job_segments_removes_only_that_jobs_segments() {
    let dir = tempfile::tempdir().unwrap();
    for n in ["gradbus-a-n0", "gradbus-a-n12", "gradbus-ab-n0", "gradbus-a-n1-n0", "gradbus-a-nx", "other"] {
        std::fs::write(dir.path().join(n), b"").unwrap();
    }
    assert_eq!(remove_job_segments(dir.path(), "a").unwrap(), 2);
    let mut left: Vec<_> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, ["gradbus-a-n1-n0", "gradbus-a-nx", "gradbus-ab-n0", "other"]);
}

/// A full /dev/shm, for real: the child runs in a private mount namespace (`unshare -rm`, which
/// needs no privilege where user namespaces are enabled) with a 1 MiB tmpfs mounted as its shm dir.
#[test]
fn a_too_small_shm_is_a_clear_shm_full_error() {
    let (job, dir) = job("shmfull");
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    if !skip::tmpfs_mounts(&shm, "a_too_small_shm_is_a_clear_shm_full_error") {
        return;
    }
    let script = format!("{} && exec \"$0\" \"$@\"", skip::tmpfs_mount(&shm));
    let wrap = ["unshare", "-rm", "sh", "-c", &script];
    let mut ch = vec![spawn_via(Some(&wrap), "shmfull", 0, 1, &job, dir.path(), 0)];
    let codes = wait_children(&mut ch, &[], dir.path());
    let o = outcome(dir.path(), 0);
    assert_eq!(codes, vec![Some(23)], "{o}\n{}", logs(dir.path(), 1));
    assert!(o.contains("ShmFull") && o.contains("No space left"), "{o}");
}
