//! The agreement's cost model: bytes, exchanges and modelled time of one agreement on both paths,
//! and the measured times the agreement benchmark prints beside them (docs/agreement.md).

use super::AgreementPath;
use crate::agreement::Summary;
use crate::wire::RowShape;

/// The time model's constants for one kind of collective: one exchange's latency, the cost of a
/// byte moved into a rank, and the CPU cost per byte of reading the gathered rows into the table and
/// of writing and reading the summary's words. A real network has a larger latency (which favours
/// the table: one collective instead of two) and a larger cost per byte (which favours the summary);
/// `GRADBUS_AGREEMENT` (the runtime) and `agreement=` (the PyTorch guard) override the choice.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Calibration {
    /// Latency of one exchange (microseconds).
    pub alpha_us: f64,
    /// Transfer cost of a byte into a rank (microseconds).
    pub beta_us_per_byte: f64,
    /// Table path: reading the gathered rows into the table, per byte of all rows (microseconds).
    pub table_cpu_us_per_byte: f64,
    /// Summary path: writing and reading the summary's words, per byte of one summary (microseconds).
    pub summary_cpu_us_per_byte: f64,
}

impl Calibration {
    /// Open MPI 4.1 over shared memory on the development machine (2 cores;
    /// `scripts/agreement-cost.py` on `gradbus worker --bench-allreduce --agreement`, the run in
    /// docs/agreement.md): the latency and the cost of a byte from the 2-rank all-gathers, the CPU
    /// costs from every row's CPU-only timings.
    pub const MPI: Calibration = Calibration {
        alpha_us: 0.63,
        beta_us_per_byte: 0.0818e-3,
        table_cpu_us_per_byte: 0.1165e-3,
        summary_cpu_us_per_byte: 0.5336e-3,
    };

    /// torch.distributed over gloo (TCP on one machine) as the PyTorch guard runs its two paths, its
    /// Python side included (one all-gather of int64 rows; two all-reduces of the summary's words):
    /// `python/bench/exchange.py`'s fit of the 2-rank rows of its run on the quiet development
    /// machine (2 cores, docs/benchmarks.md "The PyTorch guard's agreement"): the table path's
    /// intercept (617 us: one gloo collective's fixed cost, Python's included) and slope over the
    /// bucket counts, the summary's CPU per byte from what those leave of its times. gloo's
    /// collectives are rings (W - 1 steps, not the model's log2 W), so at large worlds both paths'
    /// latency is underestimated, the summary's (two collectives) twice as much (docs/agreement.md).
    pub const GLOO: Calibration = Calibration {
        alpha_us: 616.6,
        beta_us_per_byte: 0.0164,
        table_cpu_us_per_byte: 0.0,
        summary_cpu_us_per_byte: 0.0373,
    };
}

/// Bytes, exchanges and modelled time of one agreement, per rank, on both paths (docs/agreement.md).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Cost {
    /// Ranks.
    pub world: usize,
    /// Buckets.
    pub buckets: usize,
    /// Workload values each rank reports (`ValueNames::len`).
    pub values: usize,
    /// Table path: one rank's row (`RowShape::bytes`, the codec's length).
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
    /// The constants of the collectives' time.
    #[serde(skip)]
    pub calibration: Calibration,
}

impl Cost {
    /// The table path's modelled time (microseconds): one all-gather, then the rows read.
    pub fn table_us(&self) -> f64 {
        let c = &self.calibration;
        self.rounds as f64 * c.alpha_us
            + (self.table_bytes - self.row_bytes) as f64 * c.beta_us_per_byte
            + self.table_bytes as f64 * c.table_cpu_us_per_byte
    }

    /// The cheaper path by this model (a tie goes to the table, which needs no second collective
    /// on an anomaly).
    pub fn cheaper(&self) -> AgreementPath {
        if self.summary_us() < self.table_us() {
            AgreementPath::Summary
        } else {
            AgreementPath::Table
        }
    }

    /// The summary path's modelled time on a healthy update (microseconds): two all-reduces, and
    /// the words written and read.
    pub fn summary_us(&self) -> f64 {
        let c = &self.calibration;
        2.0 * self.rounds as f64 * c.alpha_us
            + self.summary_bytes_in as f64 * c.beta_us_per_byte
            + self.summary_bytes as f64 * c.summary_cpu_us_per_byte
    }
}

/// One agreement's measured times on both paths, beside the model's `Cost` (microseconds per call;
/// measured and printed by the agreement benchmark, `bench_agreement`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Times {
    /// The bare `MPI_Allgather` of one row per rank: calibrates the model's latency and bandwidth.
    pub allgather_us: f64,
    /// The table path as the transports run it: the all-gather and the table read from the rows.
    pub table_us: f64,
    /// The summary path on a healthy update: the words, two `MPI_Allreduce`s, the decoded table.
    pub summary_us: f64,
    /// The table path's CPU part alone: the gathered rows read into the table.
    pub table_cpu_us: f64,
    /// The summary path's CPU part alone: the words written and read back.
    pub summary_cpu_us: f64,
}

/// The cost model of one agreement among `world` ranks whose rows have the shape `row` (its bucket
/// and value counts size the summary too), with the collectives' constants `calibration`.
pub fn cost(world: usize, row: RowShape, calibration: Calibration) -> Cost {
    let (buckets, values) = (row.buckets, row.values);
    let row_bytes = row.bytes();
    let summary_bytes = 8 * (Summary::sum_len(buckets, values) + Summary::max_len(buckets, values));
    let rounds = world.next_power_of_two().trailing_zeros() as usize;
    Cost {
        world,
        buckets,
        values,
        row_bytes,
        table_bytes: world * row_bytes,
        summary_bytes,
        summary_bytes_in: rounds * summary_bytes,
        rounds,
        calibration,
    }
}
