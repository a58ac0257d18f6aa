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
    crate::mpi::check_bench_world(&universe, rank, np)?;
    let mut rows = Vec::new();
    for &b in buckets {
        let times = crate::mpi::bench_agreement(&universe, b, values, 3, iters, ROUNDS);
        let row = crate::wire::RowShape::mpi(b, values.len());
        rows.push(AgreementRow::new(crate::choice::cost(np, row, crate::choice::Calibration::MPI), times));
    }
    Ok((rank == 0).then_some(rows))
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
