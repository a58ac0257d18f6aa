//! The agreement benchmark: what one update's agreement costs on each path, measured (`rank_main`,
//! under `mpirun`, feature `mpi`) beside the cost model that chooses the path (`choice::cost`,
//! `AgreementPath::cheaper`): the table path (an `MPI_Allgather` of one row per rank, the rows read
//! into the table) against the summary path (two `MPI_Allreduce`s of `Summary` words: integer sums,
//! maxima; decoded), each also without MPI (its CPU part), for each bucket count asked for and the
//! workload's values (the worker's: their count sizes the row and the summary).
//!
//! `mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 target/release/gradbus worker
//! --bench-allreduce --agreement --buckets 7,100,1750` (rank 0 prints one line per bucket count;
//! `--json` for JSON lines). Times are rank 0's, each the average of `iters` back-to-back calls,
//! the best of 10 rounds. A benchmark, not a test: it prints numbers.

use serde::Serialize;

use crate::agreement::ValueNames;
use crate::choice::{Cost, Times};
use crate::Error;

/// Timed rounds per bucket count; the best is reported (a shared machine's interference only
/// ever adds time).
#[cfg(feature = "mpi")]
const ROUNDS: usize = 10;

/// One measured line (rank 0): the model's bytes and times beside the measured times.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgreementRow {
    /// The model's bytes.
    #[serde(flatten)]
    pub cost: Cost,
    /// The measured times.
    #[serde(flatten)]
    pub times: Times,
    /// The model's time of the table path (`Cost::table_us`).
    pub model_table_us: f64,
    /// The model's time of the summary path (`Cost::summary_us`).
    pub model_summary_us: f64,
    /// The path the model chooses (`AgreementPath::cheaper`), as `GRADBUS_AGREEMENT` names it.
    pub model_choice: &'static str,
}

impl AgreementRow {
    /// The row of `times` measured at `cost`'s world size, bucket count and value count, with the
    /// model's times and choice.
    pub fn new(cost: Cost, times: Times) -> AgreementRow {
        let model_choice = cost.cheaper().name();
        AgreementRow { cost, times, model_table_us: cost.table_us(), model_summary_us: cost.summary_us(), model_choice }
    }
}

/// Run one benchmark process (started by `mpirun`, every rank with the same arguments) with the
/// workload values `values`; rank 0 returns the rows.
#[cfg(feature = "mpi")]
pub fn rank_main(
    rank: usize,
    np: usize,
    buckets: &[usize],
    values: &ValueNames,
    iters: usize,
) -> Result<Option<Vec<AgreementRow>>, Error> {
    let universe = crate::mpi::universe()?;
    crate::bench::check_mpi_world(&universe, rank, np)?;
    let mut rows = Vec::new();
    for &b in buckets {
        let times = measure(&universe, b, values, 3, iters, ROUNDS);
        let row = crate::wire::RowShape::mpi(b, values.len());
        rows.push(AgreementRow::new(crate::choice::cost(np, row, crate::choice::Calibration::MPI), times));
    }
    Ok((rank == 0).then_some(rows))
}

/// One bucket count's measurement: the average time of `iters`
/// back-to-back calls of each, over `buckets` buckets, best of `rounds`, rank 0's times shared with
/// every rank, in microseconds: the table path's bare `MPI_Allgather` of one row per rank (which
/// calibrates the model's latency and bandwidth) and whole path (`agree_rows`: the gather and the
/// table read from the rows), the summary path on a healthy update (`agree_world`: words, two
/// all-reduces, the table decoded), and the CPU part of each path alone, without MPI.
#[cfg(feature = "mpi")]
fn measure(
    universe: &::mpi::environment::Universe,
    buckets: usize,
    values: &ValueNames,
    warmup: usize,
    iters: usize,
    rounds: usize,
) -> Times {
    use ::mpi::traits::*;
    use gradbus_kernels::Health;

    use crate::agreement::{LocalScalars, Summary};
    use crate::choice::AgreementPath;
    use crate::mpi::{agree_rows, agree_world, row_words, table_of_rows};
    use crate::verdict::HealthTable;

    let world = universe.world();
    let (local, health) = (vec![Health::default(); buckets], vec![Health { sumsq: 1.5, ..Health::default() }; buckets]);
    let hashes = vec![7u64; buckets];
    let reduced = Some((&health[..], &hashes[..]));
    let report = LocalScalars { loss: 0.5, values: vec![0.25; values.len()], ..LocalScalars::default() };
    let ops = 1;
    let contribution = Summary::of_rank(values, world.rank() as usize, &local, reduced, &report);
    let peaks = vec![0u64; buckets];
    let mine = row_words(ops, (&local, &peaks), reduced, &report);
    let mut all = vec![0u64; world.size() as usize * mine.len()];
    let time = |f: &mut dyn FnMut()| {
        for _ in 0..warmup {
            f();
        }
        let mut best = f64::INFINITY;
        for _ in 0..rounds {
            world.barrier();
            let t0 = std::time::Instant::now();
            for _ in 0..iters {
                f();
            }
            best = best.min(t0.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64);
        }
        world.process_at_rank(0).broadcast_into(&mut best);
        best
    };
    let allgather_us = time(&mut || world.all_gather_into(&mine[..], &mut all[..]));
    let table_us = time(&mut || {
        let t = agree_rows(&world, values, ops, (&local, &peaks), reduced, &report).expect("healthy rows");
        assert!(t.is_detailed());
    });
    let summary_us = time(&mut || {
        let (s, row) = (contribution.clone(), || (local.clone(), peaks.clone()));
        let t = agree_world(&world, AgreementPath::Summary, ops, s, row, reduced, &report).expect("healthy");
        assert!(!t.is_detailed(), "a healthy update decides from the summary");
    });
    let table_cpu_us = time(&mut || assert!(table_of_rows(&all, buckets, values, ops, 0).is_ok()));
    let summary_cpu_us = time(&mut || {
        let mut s = contribution.clone();
        s.ops.add(ops);
        let back = Summary::from_words(buckets, values, &s.sum_words(), &s.max_words());
        assert!(back.anomaly().is_none() && HealthTable::summarized(1, back).is_some());
    });
    Times { allgather_us, table_us, summary_us, table_cpu_us, summary_cpu_us }
}

/// Without MPI there is nothing to measure.
#[cfg(not(feature = "mpi"))]
pub fn rank_main(
    _rank: usize,
    _np: usize,
    _buckets: &[usize],
    _values: &ValueNames,
    _iters: usize,
) -> Result<Option<Vec<AgreementRow>>, Error> {
    Err(Error::Mpi {
        what: "the agreement benchmark measures MPI collectives".into(),
        hint: "build with `--features mpi` and start the ranks with mpirun".into(),
    })
}

/// The rows as a table: per path the measured time, its CPU part and the model's time (all
/// microseconds), and the model's choice.
pub fn format_table(rows: &[AgreementRow]) -> String {
    let mut s = format!(
        "{:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}\n",
        "world", "buckets", "allgather", "table", "table cpu", "model", "summary", "summ. cpu", "model", "choice"
    );
    for r in rows {
        let (c, t) = (&r.cost, &r.times);
        s += &format!(
            "{:>6} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8}\n",
            c.world,
            c.buckets,
            t.allgather_us,
            t.table_us,
            t.table_cpu_us,
            r.model_table_us,
            t.summary_us,
            t.summary_cpu_us,
            r.model_summary_us,
            r.model_choice
        );
    }
    s
}
