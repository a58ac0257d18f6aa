//! The agreement's path: the O(buckets) summary or the full table, forced by
//! `GRADBUS_AGREEMENT` or chosen by the cost model. Every rank must choose alike (the choice is a
//! pure function of what the ranks check at open).

use super::{cost, Calibration, ValueNames};
use crate::wire::RowShape;

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
