//! Multi-process tests of the MPI transports (feature `mpi`), with REAL processes under `mpirun`.
//!
//! Self-exec pattern, as in `shm_bus.rs`: the test (the parent) runs `mpirun -np N` on this test
//! binary's ignored `child_entry` (common/child.rs) with `GRADBUS_TEST_CHILD=<scenario>`; each child
//! is one MPI rank, writes what it saw into files of the test's temp dir and exits with a code that
//! encodes its outcome (0 = success). The parent compares the files across ranks, across runs and with a serial
//! oracle. Flat MPI runs at 2, 3 and 4 ranks; the hierarchical path at 2 fake nodes x 2 ranks
//! (`GB_FAKE_NODES` splits the ranks of this machine into nodes, each with its own shm segment).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gradbus_collectives::mpi::{Expect, HierTransport, MpiTransport};
use gradbus_collectives::shm::BusConfig;
use gradbus_collectives::{
    decide, AgreementPath, Error, History, Layout, LocalScalars, ParamSpec, Policy, StepId, Transport,
};
use gradbus_kernels::rng::Rng;

#[path = "common/child.rs"]
mod child;
mod common;
use common::{digest, value_names};

const CHILD_ENV: &str = "GRADBUS_TEST_CHILD";
/// Updates per reduce run.
const UPDATES: u64 = 2;

// ---------------------------------------------------------------- shared by parent and child

/// Ragged sizes, a 1-element parameter and an empty one (a zero-count MPI_Allreduce).
fn layout() -> Layout {
    let sizes = [1000, 1, 0, 37, 5000, 3, 70001];
    let specs: Vec<_> = sizes.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), n)).collect();
    Layout::new(&specs, 0)
}

/// Rank `rank`'s gradients for update `u`: a pure function of (seed, u, rank).
fn inputs(seed: u64, u: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(&[seed, u, rank as u64]);
    (0..len).map(|_| rng.normal()).collect()
}

/// Where the planted NaN goes: parameter p4, element 123.
fn nan_offset(l: &Layout) -> usize {
    l.slot("p4").unwrap().offset + 123
}

// ---------------------------------------------------------------- child side

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"))
}

fn num(k: &str) -> usize {
    var(k).parse().unwrap_or_else(|_| panic!("{k} is not a number"))
}

/// The child's entry (see common/child.rs).
#[test]
#[ignore = "not a test: the child process that this file's tests start"]
fn child_entry() {
    let scenario = child::scenario(CHILD_ENV);
    let dir = PathBuf::from(var("GB_DIR"));
    let rank = num("OMPI_COMM_WORLD_RANK");
    let code = match std::panic::catch_unwind(|| run_child(&scenario, &dir, rank)) {
        Ok(Ok(())) => 0,
        Ok(Err(err)) => {
            std::fs::write(dir.join(format!("outcome-{rank}.txt")), format!("{err:?}\n{err}")).unwrap();
            if std::env::var(EVERY_RANK_FAILS).is_ok() {
                await_every_outcome(&dir, num("OMPI_COMM_WORLD_SIZE"));
            }
            match err {
                Error::Mismatch { .. } => 24,
                Error::Mpi { .. } => 26,
                _ => 27,
            }
        }
        Err(_) => 101,
    };
    std::process::exit(code);
}

/// Set for scenarios in which every rank must fail and report why: a rank that has written its
/// outcome waits for every other rank's before it exits, since mpirun kills the job's remaining
/// ranks at the first exit with an error (a rank's report must not depend on how fast it was).
const EVERY_RANK_FAILS: &str = "GB_EVERY_RANK_FAILS";

/// Waits until every rank of `np` has written its outcome file; the bound only catches a rank that
/// never fails (the parent then finds its outcome missing).
fn await_every_outcome(dir: &Path, np: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while (0..np).any(|k| !dir.join(format!("outcome-{k}.txt")).exists()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every rank's outcome, in rank order; fails naming the ranks that wrote none.
fn every_outcome(r: &Mpirun, np: usize) -> Vec<String> {
    let outcomes: Vec<Option<String>> =
        (0..np).map(|k| std::fs::read_to_string(r.dir.path().join(format!("outcome-{k}.txt"))).ok()).collect();
    let missing: Vec<usize> = (0..np).filter(|&k| outcomes[k].is_none()).collect();
    assert!(missing.is_empty(), "rank(s) {missing:?} reported no error\n{}", r.explain());
    outcomes.into_iter().flatten().collect()
}

/// Open the transport the parent asked for, as this rank.
fn open(world_claimed: usize) -> Result<Box<dyn Transport>, Error> {
    let rank = num("OMPI_COMM_WORLD_RANK");
    let (lrank, lsize) = (num("OMPI_COMM_WORLD_LOCAL_RANK"), num("OMPI_COMM_WORLD_LOCAL_SIZE"));
    let exit_timeout = std::env::var("GB_EXIT_TIMEOUT").map_or(30, |v| v.parse().unwrap());
    let expect =
        Expect { rank, world: world_claimed, source: "openmpi".into(), timeout: Duration::from_secs(exit_timeout) };
    let l = layout();
    match var("GB_TRANSPORT").as_str() {
        "mpi" => Ok(Box::new(MpiTransport::open(expect, l.clone(), value_names(), l.hash())?)),
        "hier" => {
            let k = num("GB_FAKE_NODES");
            let per = lsize / k;
            let mut c = BusConfig::new(var("GB_JOB"), lrank % per, per, l);
            c.node_id = lrank / per;
            c.values = value_names();
            c.timeout = Duration::from_secs(30);
            Ok(Box::new(HierTransport::open(expect, c)?))
        }
        t => panic!("unknown transport {t}"),
    }
}

fn run_child(scenario: &str, dir: &Path, rank: usize) -> Result<(), Error> {
    let np = num("OMPI_COMM_WORLD_SIZE");
    match scenario {
        "reduce" => child_reduce(dir, rank),
        // The environment claims another world size than mpirun started.
        "size" => open(num("GB_CLAIM")).map(drop),
        // Every rank reduces bucket 0 but labels it with its own step: a program bug.
        "mismatch" => {
            let mut t = open(np)?;
            let at = StepId { step: rank as u64, ..StepId::default() };
            t.allreduce_bucket(at, 0)?;
            let report = LocalScalars { values: vec![0.0; value_names().len()], ..LocalScalars::default() };
            t.agree(StepId::default(), report).map(drop)
        }
        // Odd ranks force the table path, even ones the summary: refused at open.
        "mixed-path" => {
            let path = if rank % 2 == 1 { AgreementPath::Table } else { AgreementPath::Summary };
            // Before any other thread exists in this child (`set_var` is not thread-safe).
            std::env::set_var(AgreementPath::ENV, path.name());
            open(np).map(drop)
        }
        // Odd ranks force the path the cost model chooses for this world, layout and value count
        // (`GB_FORCE=model`) or the other one (`other`); even ones let the model choose.
        "model-path" => {
            let row = gradbus_collectives::wire::RowShape::mpi(layout().buckets.len(), value_names().len());
            let model = AgreementPath::cheaper(np, row, gradbus_collectives::choice::Calibration::MPI);
            if rank % 2 == 1 {
                let forced = match var("GB_FORCE").as_str() {
                    "model" => model,
                    _ if model == AgreementPath::Table => AgreementPath::Summary,
                    _ => AgreementPath::Table,
                };
                std::env::set_var(AgreementPath::ENV, forced.name());
            }
            open(np).map(drop)
        }
        // Every rank opens the transport and drops it at once (a run of zero updates): clean.
        "open-drop" => open(np).map(drop),
        // Rank 0 leaves right after open while the others wait for it in an all-reduce.
        "leave" => {
            let mut t = open(np)?;
            if rank == 0 {
                return Ok(());
            }
            t.allreduce_bucket(StepId::default(), 0)
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn child_reduce(dir: &Path, rank: usize) -> Result<(), Error> {
    let np = num("OMPI_COMM_WORLD_SIZE");
    let seed: u64 = num("GB_SEED") as u64;
    let nan_rank: Option<usize> = std::env::var("GB_NAN_RANK").ok().map(|v| v.parse().unwrap());
    let mut t = open(np)?;
    assert_eq!((t.rank(), t.world()), (rank, np));
    let l = t.layout().clone();
    let mut history = History::default();
    for u in 0..UPDATES {
        let x = inputs(seed, u, rank, l.len);
        t.grads().copy_from_slice(&x);
        if u == 1 && nan_rank == Some(rank) {
            t.grads()[nan_offset(&l)] = f32::NAN;
        }
        let at = StepId { step: u, ..StepId::default() };
        for b in 0..l.buckets.len() {
            t.allreduce_bucket(at, b)?;
        }
        let report = LocalScalars {
            loss: rank as f64 + u as f64,
            values: vec![u as f64; value_names().len()],
            replica: 7,
            state: 0,
        };
        let table = t.agree(at, report)?;
        let verdict = decide(&table, &l, &Policy::Abort, &history, at);
        history.record(&table, &verdict);
        let bytes: Vec<u8> = t.grads().iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.join(format!("grads-{u}-{rank}.bin")), bytes).unwrap();
        std::fs::write(dir.join(format!("table-{u}-{rank}.txt")), format!("{table:?}\n{verdict:?}\n")).unwrap();
        std::fs::write(dir.join(format!("digest-{u}-{rank}.txt")), digest(&table, &verdict)).unwrap();
    }
    Ok(())
}

// ---------------------------------------------------------------- parent side

static COUNTER: AtomicUsize = AtomicUsize::new(0);

struct Mpirun {
    cmd: String,
    code: Option<i32>,
    log: String,
    dir: tempfile::TempDir,
}

/// `mpirun -np N` this test binary as scenario `scenario`, with `env` exported to every rank.
fn mpirun(np: usize, scenario: &str, env: &[(&str, &str)]) -> Mpirun {
    let dir = tempfile::tempdir().unwrap();
    let job = format!("tm{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    let exe = std::env::current_exe().unwrap();
    let mut vars: Vec<(String, String)> = vec![
        (CHILD_ENV.into(), scenario.into()),
        ("GB_DIR".into(), dir.path().display().to_string()),
        ("GB_JOB".into(), job.clone()),
        ("GB_SEED".into(), "1234".into()),
    ];
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", &np.to_string()]);
    for (k, v) in &vars {
        c.env(k, v).args(["-x", k]);
    }
    c.arg(&exe).args(child::args("child_entry"));
    let cmd = format!(
        "{} mpirun -np {np} ... {} --ignored --exact child_entry",
        vars.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "),
        exe.display()
    );
    let log_path = dir.path().join("mpirun.log");
    let log = std::fs::File::create(&log_path).unwrap();
    c.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log);
    let mut child = c.spawn().expect("spawn mpirun (is Open MPI installed? scripts/test.sh installs it)");
    let start = Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if start.elapsed() > Duration::from_secs(180) {
            // mpirun answers SIGTERM by terminating every rank.
            // SAFETY: kill(2) on our own child's pid; no memory is involved.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
            panic!("{cmd}: still running after 180 s\n{}", std::fs::read_to_string(&log_path).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    // mpirun may kill a rank before it unlinks its node's segment (a failing scenario): sweep.
    let _ = gradbus_collectives::remove_job_segments(Path::new("/dev/shm"), &job);
    Mpirun { cmd, code, log, dir }
}

impl Mpirun {
    fn explain(&self) -> String {
        let outcomes: String = std::fs::read_dir(self.dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("outcome-"))
            .map(|e| format!("{}: {}\n", e.file_name().to_string_lossy(), std::fs::read_to_string(e.path()).unwrap()))
            .collect();
        format!("{}\nexit {:?}\n--- output\n{}\n--- outcomes\n{outcomes}", self.cmd, self.code, self.log)
    }
    fn file(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.path().join(name)).unwrap_or_else(|e| panic!("{name}: {e}\n{}", self.explain()))
    }
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Run the reduce scenario; check bitwise agreement across ranks, the serial oracle and the tables.
/// Returns every update's reduced bytes (rank 0) and table text for run-to-run comparisons.
fn run_reduce(np: usize, env: &[(&str, &str)]) -> Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> {
    let r = mpirun(np, "reduce", env);
    assert_eq!(r.code, Some(0), "{}", r.explain());
    let l = layout();
    let mut out = Vec::new();
    for u in 0..UPDATES {
        let g0 = r.file(&format!("grads-{u}-0.bin"));
        let t0 = r.file(&format!("table-{u}-0.txt"));
        for k in 1..np {
            assert!(
                g0 == r.file(&format!("grads-{u}-{k}.bin")),
                "update {u}: rank {k}'s sum differs from rank 0's\n{}",
                r.explain()
            );
            assert_eq!(
                String::from_utf8_lossy(&t0),
                String::from_utf8_lossy(&r.file(&format!("table-{u}-{k}.txt"))),
                "update {u}: rank {k}'s table or verdict differs from rank 0's"
            );
        }
        // The serial rank-order sum, and the rounding a different association order may cause.
        let xs: Vec<Vec<f32>> = (0..np).map(|k| inputs(1234, u, k, l.len)).collect();
        let got = floats(&g0);
        for (i, &g) in got.iter().enumerate() {
            let serial = xs.iter().fold(0f32, |a, x| a + x[i]);
            let abs: f32 = xs.iter().map(|x| x[i].abs()).sum();
            let tol = 2.0 * np as f32 * f32::EPSILON * abs;
            let planted = u == 1 && env.iter().any(|(k, _)| *k == "GB_NAN_RANK") && i == nan_offset(&l);
            if planted {
                assert!(g.is_nan(), "element {i}: the planted NaN must survive the sum, got {g}");
            } else {
                assert!((g - serial).abs() <= tol, "update {u} element {i}: {g} vs serial {serial} (tol {tol})");
            }
        }
        let t = String::from_utf8_lossy(&t0).into_owned();
        assert!(t.contains(&format!("world: {np},")), "{t}");
        if t.contains("reports: [L") {
            for k in 0..np {
                assert!(t.contains(&format!("loss: {}.0,", k as u64 + u)), "report of rank {k} missing:\n{t}");
            }
        }
        // The mean loss, from the summary on either path: exact.
        let mean = (0..np).map(|k| (k as u64 + u) as f64).sum::<f64>() / np as f64;
        let d = String::from_utf8_lossy(&r.file(&format!("digest-{u}-0.txt"))).into_owned();
        assert!(d.contains(&format!("mean_loss {:016x}", mean.to_bits())), "{d}");
        for k in 1..np {
            assert!(r.file(&format!("digest-{u}-{k}.txt")) == d.as_bytes(), "update {u}: rank {k}'s digest differs");
        }
        out.push((g0, t0, r.file(&format!("digest-{u}-0.txt"))));
    }
    out
}

fn flat(np: usize) {
    let a = run_reduce(np, &[("GB_TRANSPORT", "mpi")]);
    let b = run_reduce(np, &[("GB_TRANSPORT", "mpi")]);
    assert!(a == b, "{np} ranks: two runs gave different bits");
    let t = String::from_utf8_lossy(&a[0].1).into_owned();
    assert!(t.contains("action: Proceed"), "{t}");
}

#[test]
fn flat_mpi_2_ranks_is_identical_across_ranks_and_runs_and_close_to_the_serial_sum() {
    flat(2);
}

#[test]
fn flat_mpi_3_ranks_is_identical_across_ranks_and_runs_and_close_to_the_serial_sum() {
    flat(3);
}

#[test]
fn flat_mpi_4_ranks_is_identical_across_ranks_and_runs_and_close_to_the_serial_sum() {
    flat(4);
}

#[test]
fn hier_2_nodes_x_2_ranks_is_identical_across_ranks_and_runs_and_close_to_the_serial_sum() {
    let env = [("GB_TRANSPORT", "hier"), ("GB_FAKE_NODES", "2")];
    let a = run_reduce(4, &env);
    let b = run_reduce(4, &env);
    assert!(a == b, "two runs gave different bits");
}

/// A NaN planted on one rank gives the same Abort verdict on every rank (checked by `run_reduce`:
/// identical table and verdict text) naming that rank, the parameter and the element.
fn planted_nan(np: usize, env: &[(&str, &str)], nan_rank: usize) {
    let mut env = env.to_vec();
    let nr = nan_rank.to_string();
    env.push(("GB_NAN_RANK", &nr));
    let out = run_reduce(np, &env);
    let t = String::from_utf8_lossy(&out[1].1).into_owned();
    assert!(t.contains("action: Abort"), "{t}");
    assert!(t.contains(&format!("ranks: [{nan_rank}]")), "{t}");
    assert!(t.contains("param: \"p4\", element: 123"), "{t}");
    assert!(t.contains("nan: 1, inf: 0"), "{t}");
    assert!(String::from_utf8_lossy(&out[0].1).contains("action: Proceed"));
}

#[test]
fn planted_nan_gives_the_same_verdict_on_every_rank_flat() {
    planted_nan(3, &[("GB_TRANSPORT", "mpi")], 2);
}

#[test]
fn planted_nan_gives_the_same_verdict_on_every_rank_hier() {
    // Rank 3 is local rank 1 of node 1: not a leader, and not on the first node.
    planted_nan(4, &[("GB_TRANSPORT", "hier"), ("GB_FAKE_NODES", "2")], 3);
}

#[test]
fn world_size_that_disagrees_with_mpi_is_a_clear_error_on_every_rank() {
    let r = mpirun(2, "size", &[("GB_TRANSPORT", "mpi"), ("GB_CLAIM", "3"), (EVERY_RANK_FAILS, "1")]);
    assert_ne!(r.code, Some(0), "{}", r.explain());
    // Each rank fails on its own, before any collective.
    for (k, o) in every_outcome(&r, 2).iter().enumerate() {
        assert!(o.contains("says 3 ranks, but MPI_COMM_WORLD has 2") && o.contains("mpirun"), "rank {k}: {o}");
    }
}

#[test]
fn ranks_running_different_collectives_all_fail_with_a_mismatch() {
    for (np, mut env) in
        [(2, vec![("GB_TRANSPORT", "mpi")]), (4, vec![("GB_TRANSPORT", "hier"), ("GB_FAKE_NODES", "2")])]
    {
        env.push((EVERY_RANK_FAILS, "1"));
        let r = mpirun(np, "mismatch", &env);
        assert_ne!(r.code, Some(0), "{}", r.explain());
        for (k, o) in every_outcome(&r, np).iter().enumerate() {
            assert!(o.contains("Mismatch"), "rank {k}: {o}\n{}", r.explain());
        }
    }
}

#[test]
fn transports_dropped_by_every_rank_finalise_mpi_cleanly() {
    for (np, env) in [(2, vec![("GB_TRANSPORT", "mpi")]), (4, vec![("GB_TRANSPORT", "hier"), ("GB_FAKE_NODES", "2")])] {
        let r = mpirun(np, "open-drop", &env);
        // mpirun fails a job whose processes exit without MPI_Finalize, even with status 0.
        assert_eq!(r.code, Some(0), "{}", r.explain());
    }
}

#[test]
fn rank_leaving_while_the_others_wait_in_mpi_ends_the_job_instead_of_hanging() {
    // Rank 0 must not finalise (a fence the others never reach): after the 2 s exit handshake it
    // exits without MPI_Finalize and mpirun takes the job down. A hang is what `mpirun` bounds: past
    // 180 s it kills the job and fails the test.
    let r = mpirun(3, "leave", &[("GB_TRANSPORT", "mpi"), ("GB_EXIT_TIMEOUT", "2")]);
    assert_ne!(r.code, Some(0), "{}", r.explain());
}

/// The summary path and the table path, each forced (`GRADBUS_AGREEMENT`), give the same sums and
/// the same digest (everything decided and reported from), bit for bit; on the update with a
/// planted NaN (if any) both gather the same full table.
fn paths_agree(np: usize, env: &[(&str, &str)]) {
    let (mut summary, mut table) = (env.to_vec(), env.to_vec());
    summary.push((AgreementPath::ENV, "summary"));
    table.push((AgreementPath::ENV, "table"));
    let (a, b) = (run_reduce(np, &summary), run_reduce(np, &table));
    for (u, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x.0 == y.0, "{np} ranks, update {u}: the sums differ between the paths");
        assert_eq!(String::from_utf8_lossy(&x.2), String::from_utf8_lossy(&y.2), "{np} ranks, update {u}");
    }
    if env.iter().any(|(k, _)| *k == "GB_NAN_RANK") {
        assert_eq!(String::from_utf8_lossy(&a[1].1), String::from_utf8_lossy(&b[1].1), "the failure's table");
    }
}

#[test]
fn summary_and_table_paths_agree_bitwise_flat_mpi_2_to_4_ranks() {
    for np in 2..=4 {
        paths_agree(np, &[("GB_TRANSPORT", "mpi")]);
    }
}

#[test]
fn summary_and_table_paths_agree_bitwise_hier_2_nodes() {
    paths_agree(4, &[("GB_TRANSPORT", "hier"), ("GB_FAKE_NODES", "2")]);
    paths_agree(4, &[("GB_TRANSPORT", "hier"), ("GB_FAKE_NODES", "2"), ("GB_NAN_RANK", "3")]);
}

#[test]
fn summary_and_table_paths_agree_bitwise_on_a_planted_nan_flat() {
    paths_agree(3, &[("GB_TRANSPORT", "mpi"), ("GB_NAN_RANK", "1")]);
}

/// Without `GRADBUS_AGREEMENT` every rank takes the cost model's choice for the world size, the
/// layout's bucket count and the number of workload values, and the choice is part of the identity
/// checked at open: ranks that force the model's path open with the others, ranks that force the
/// other path are refused on every rank (a forced path still overrides the model, so those ranks
/// would run other collectives).
#[test]
fn without_an_override_every_rank_takes_the_cost_models_path_checked_at_open() {
    for np in [2, 3] {
        let env = [("GB_TRANSPORT", "mpi"), ("GB_FORCE", "model")];
        let r = mpirun(np, "model-path", &env);
        assert_eq!(r.code, Some(0), "{np} ranks, model's path forced on odd ranks: {}", r.explain());
        assert_refused_at_open(np, "model-path", &[("GB_TRANSPORT", "mpi"), ("GB_FORCE", "other")]);
    }
}

/// `scenario` on `np` ranks fails, and every rank reports a config-hash mismatch at open.
fn assert_refused_at_open(np: usize, scenario: &str, env: &[(&str, &str)]) {
    let mut env = env.to_vec();
    env.push((EVERY_RANK_FAILS, "1"));
    let r = mpirun(np, scenario, &env);
    assert_ne!(r.code, Some(0), "{}", r.explain());
    for (k, o) in every_outcome(&r, np).iter().enumerate() {
        assert!(o.contains("Mismatch") && o.contains("config hash"), "rank {k}: {o}\n{}", r.explain());
    }
}

/// Ranks on different agreement paths would run different collectives (all-reduce against
/// all-gather): the identity check at open refuses them on every rank instead.
#[test]
fn ranks_on_different_agreement_paths_fail_at_open_with_a_mismatch() {
    for (np, env) in [(2, vec![("GB_TRANSPORT", "mpi")]), (4, vec![("GB_TRANSPORT", "hier"), ("GB_FAKE_NODES", "2")])] {
        assert_refused_at_open(np, "mixed-path", &env);
    }
}
