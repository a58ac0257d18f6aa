//! Which way the agreement goes: the O(buckets) summary or the full table, forced by
//! `GRADBUS_AGREEMENT` or chosen by the cost model (`cost`). Every rank must choose alike (the
//! choice is a pure function of what the ranks check at open). Above the row codec (`wire`): the
//! model costs the codec's rows (`RowShape::len`) beside the summary's words (`agreement`).

mod cost;

use crate::agreement::ValueNames;
use crate::wire::RowShape;

pub use cost::{cost, Calibration, Cost, Times};

/// Which way the agreement goes: the O(buckets) summary with the table only on an anomaly, or
/// always the full table. Over MPI the cost model (`Cost`) chooses, for the world size, bucket
/// count and number of workload values, at open; `GRADBUS_AGREEMENT=table|summary` overrides it.
/// Both give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgreementPath {
    /// One all-reduce of the summary; the table only when the summary shows an anomaly.
    Summary,
    /// Always gather the full per-rank table (today's path).
    Table,
}

impl AgreementPath {
    /// The environment variable that forces the path.
    pub const ENV: &'static str = "GRADBUS_AGREEMENT";

    /// The path's name, as `GRADBUS_AGREEMENT` takes it.
    pub fn name(self) -> &'static str {
        match self {
            AgreementPath::Summary => "summary",
            AgreementPath::Table => "table",
        }
    }

    /// `config_hash` with the path folded in, for the identity check at open: ranks on different
    /// paths would run different collectives (an all-reduce against an all-gather), so they must fail
    /// at open instead, as ranks with different configs do.
    pub fn fold(self, config_hash: u64) -> u64 {
        match self {
            AgreementPath::Summary => config_hash,
            AgreementPath::Table => config_hash ^ 0x7461_626c_6500_0000, // "table"
        }
    }

    /// The path forced by `GRADBUS_AGREEMENT` (`summary` or `table`; unset or empty: none).
    pub fn from_env() -> Result<Option<AgreementPath>, crate::Error> {
        match std::env::var(AgreementPath::ENV) {
            Err(_) => Ok(None),
            Ok(v) => match v.as_str() {
                "" => Ok(None),
                v if v == AgreementPath::Summary.name() => Ok(Some(AgreementPath::Summary)),
                v if v == AgreementPath::Table.name() => Ok(Some(AgreementPath::Table)),
                other => Err(crate::Error::Config {
                    what: format!("{}={other:?} is not an agreement path", AgreementPath::ENV),
                    hint: "use `summary` or `table`, or unset it to let the cost model choose".into(),
                }),
            },
        }
    }

    /// The path the cost model says is cheaper for `world` ranks exchanging rows of the shape `row`
    /// over collectives of the constants `calibration` (a tie goes to the table, which needs no
    /// second collective on an anomaly).
    pub fn cheaper(world: usize, row: RowShape, calibration: Calibration) -> AgreementPath {
        cost(world, row, calibration).cheaper()
    }

    /// The path of an MPI agreement among `world` ranks over `buckets` buckets with the workload
    /// values `values`: `GRADBUS_AGREEMENT` if set, else the cost model's choice for MPI's row
    /// (`RowShape::mpi`) and constants. A pure function of the three, which every rank shares (the
    /// world size, layout and value names are checked at open: ranks that differ in any of them are
    /// refused there whatever path they chose), so every rank chooses alike.
    pub fn choose(world: usize, buckets: usize, values: &ValueNames) -> Result<AgreementPath, crate::Error> {
        let row = RowShape::mpi(buckets, values.len());
        Ok(AgreementPath::from_env()?.unwrap_or_else(|| AgreementPath::cheaper(world, row, Calibration::MPI)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_does_not_grow_with_the_world_and_the_table_does() {
        let mpi = |w, b, v| cost(w, RowShape::mpi(b, v), Calibration::MPI);
        let (a, b) = (mpi(8, 100, 5), mpi(16384, 100, 5));
        assert_eq!(a.summary_bytes, b.summary_bytes);
        assert_eq!(b.table_bytes, 2048 * a.table_bytes);
        assert_eq!((a.rounds, b.rounds), (3, 14));
        assert_eq!(mpi(1, 7, 5).rounds, 0);
        let c = mpi(8, 100, 7);
        assert_eq!(c.row_bytes - a.row_bytes, 16, "2 more values, 2 more words");
        assert_eq!(c.summary_bytes - a.summary_bytes, 2 * 8 * 73, "2 more values, 2 more stats of 73 words");
    }

    /// The cost model's choice: the table where the summary is not cheaper (one rank, and small
    /// worlds: the summary's two collectives and fixed 3.5 KB), the summary at scale (16k ranks move
    /// 1.8 GB of table into every rank at 1750 buckets), and once the summary wins at some world
    /// size it wins at twice that size (the table's bytes double, the summary adds one exchange);
    /// with no workload value, the reference workload's 5 and many.
    #[test]
    fn the_model_chooses_the_table_for_small_worlds_and_the_summary_at_scale() {
        for values in [0, 5, 100] {
            for buckets in [1, 7, 100, 1750] {
                let at = |world| AgreementPath::cheaper(world, RowShape::mpi(buckets, values), Calibration::MPI);
                let case = format!("{buckets} buckets, {values} values");
                assert_eq!(at(1), AgreementPath::Table, "1 rank, {case}");
                assert_eq!(at(2), AgreementPath::Table, "2 ranks, {case}");
                assert_eq!(at(16384), AgreementPath::Summary, "16k ranks, {case}");
                for world in 1..=8192 {
                    let c = cost(world, RowShape::mpi(buckets, values), Calibration::MPI);
                    assert_eq!(at(world) == AgreementPath::Summary, c.summary_us() < c.table_us());
                    if at(world) == AgreementPath::Summary {
                        assert_eq!(at(2 * world), AgreementPath::Summary, "{world} ranks, {case}");
                    }
                }
            }
        }
    }

    /// The value count is part of the choice: each value adds 73 words to the summary and one word
    /// to every rank's row, so more values move the crossover to larger worlds (at 7 buckets, 64
    /// ranks take the summary with no value and the table with 100).
    #[test]
    fn the_models_choice_depends_on_the_value_count() {
        let cheaper = |w, b, v| AgreementPath::cheaper(w, RowShape::mpi(b, v), Calibration::MPI);
        assert_eq!(cheaper(64, 7, 0), AgreementPath::Summary);
        assert_eq!(cheaper(64, 7, 100), AgreementPath::Table);
        for buckets in [1, 7, 30, 100, 300, 1750] {
            let crossover = |values| (1..=1 << 16).find(|&w| cheaper(w, buckets, values) == AgreementPath::Summary);
            let xs: Vec<usize> =
                [0, 1, 5, 20, 100].map(|v| crossover(v).expect("the summary wins by 64k ranks")).to_vec();
            assert!(
                xs.windows(2).all(|p| p[0] <= p[1]),
                "{buckets} buckets: crossovers {xs:?} for 0, 1, 5, 20, 100 values"
            );
        }
    }
}
