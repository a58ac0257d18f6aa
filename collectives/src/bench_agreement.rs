//! The agreement benchmark: what one update's agreement costs on each path, as bytes (the cost
//! model, `cost`) and as time (`rank_main`, under `mpirun`, feature `mpi`): the table path's
//! `MPI_Allgather` of one row per rank against the summary path's all-reduce (two
//! `MPI_Allreduce`s: integer sums, maxima) of `Summary` words, for each bucket count asked for.
//!
//! `mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 target/release/gradbus worker
//! --bench-allreduce --agreement --buckets 7,100,1750` (rank 0 prints one line per bucket count;
//! `--json` for JSON lines). Times are rank 0's, each the average of `iters` back-to-back calls,
//! the best of 10 rounds. A benchmark, not a test: it prints numbers.

use serde::Serialize;

use crate::agreement::{LocalReport, Summary, ValueNames};
use crate::Error;

/// Timed rounds per bucket count; the best is reported (a shared machine's interference only
/// ever adds time).
#[cfg(feature = "mpi")]
const ROUNDS: usize = 10;

/// Bytes and rounds of one agreement, per rank, on both paths (see `docs/agreement.md`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Cost {
    /// Ranks.
    pub world: usize,
    /// Buckets.
    pub buckets: usize,
    /// Table path: one rank's row (op hash, reducer flag, 4 words of local and of reduced health
    /// per bucket, the report).
    pub row_bytes: usize,
    /// Table path: bytes every rank ends up holding (world x row), all of which crossed to it but
    /// its own row.
    pub table_bytes: usize,
    /// Summary path: bytes of one contribution (integer-sum and maximum words together), the
    /// same whatever the world size.
    pub summary_bytes: usize,
    /// Summary path: bytes into each rank over a recursive-doubling all-reduce
    /// (ceil(log2 world) exchanges of the whole summary); a reduce-scatter + all-gather needs
    /// 2 (world - 1) / world of it.
    pub summary_bytes_in: usize,
    /// Latency terms of one collective: ceil(log2 world) exchanges. The table path is one
    /// collective, the summary path two (sums, maxima); the failure path pays both paths.
    pub rounds: usize,
}

/// The cost model of one agreement of `values` workload values.
pub fn cost(world: usize, buckets: usize, values: usize) -> Cost {
    let row_bytes = 8 * (2 + 8 * buckets + LocalReport::words(values));
    let summary_bytes = 8 * (Summary::sum_len(buckets, values) + Summary::max_len(buckets, values));
    let rounds = world.next_power_of_two().trailing_zeros() as usize;
    Cost {
        world,
        buckets,
        row_bytes,
        table_bytes: world * row_bytes,
        summary_bytes,
        summary_bytes_in: rounds * summary_bytes,
        rounds,
    }
}

/// One measured line (rank 0).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgreementRow {
    /// The model's bytes.
    #[serde(flatten)]
    pub cost: Cost,
    /// `MPI_Allgather` of one row per rank (microseconds).
    pub allgather_us: f64,
    /// The summary all-reduce, decode included (microseconds).
    pub summary_us: f64,
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
        let (allgather_us, summary_us) = crate::mpi::bench_agreement(&universe, b, values, 3, iters, ROUNDS);
        rows.push(AgreementRow { cost: cost(np, b, values.len()), allgather_us, summary_us });
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

/// The rows as a table.
pub fn format_table(rows: &[AgreementRow]) -> String {
    let mut s = format!(
        "{:>6} {:>8} {:>10} {:>13} {:>13} {:>13} {:>13}\n",
        "world", "buckets", "row B", "table B", "allgather us", "summary B", "summary us"
    );
    for r in rows {
        let c = &r.cost;
        s += &format!(
            "{:>6} {:>8} {:>10} {:>13} {:>13.1} {:>13} {:>13.1}\n",
            c.world, c.buckets, c.row_bytes, c.table_bytes, r.allgather_us, c.summary_bytes, r.summary_us
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_does_not_grow_with_the_world_and_the_table_does() {
        let (a, b) = (cost(8, 100, 5), cost(16384, 100, 5));
        assert_eq!(a.summary_bytes, b.summary_bytes);
        assert_eq!(b.table_bytes, 2048 * a.table_bytes);
        assert_eq!((a.rounds, b.rounds), (3, 14));
        assert_eq!(cost(1, 7, 5).rounds, 0);
        assert_eq!(cost(8, 100, 7).row_bytes - a.row_bytes, 16, "2 more values, 2 more words");
    }
}
