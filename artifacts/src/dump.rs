//! Failure dumps (`dumps/rank-K.bin`): the state at the start of the failing update, the rank's
//! mini-batch and the verdict, in the binary container; `gradbus replay` reads them.

use serde::{Deserialize, Serialize};

use gradbus_collectives::Report;
use gradbus_kernels::Health;

use crate::container::Kind;
use crate::sealed::{hex64, nullable, required};

/// Format version of a failure dump's metadata.
pub const DUMP_FORMAT: u32 = 2;

/// One bucket's health as a dump records it: sums of squares as bits, so replay compares exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthRecord {
    /// NaN elements.
    pub nan: u64,
    /// Inf elements.
    pub inf: u64,
    /// Bits of the f64 sum of squares of the finite elements.
    #[serde(with = "hex64")]
    pub sumsq_bits: u64,
    /// First non-finite element, relative to the bucket.
    #[serde(deserialize_with = "required")]
    pub first_bad: Option<u64>,
}

impl From<&Health> for HealthRecord {
    fn from(h: &Health) -> HealthRecord {
        HealthRecord { nan: h.nan, inf: h.inf, sumsq_bits: h.sumsq.to_bits(), first_bad: h.first_bad }
    }
}

/// The metadata of `dumps/rank-K.bin` (its tensors: `params`, `inputs`, `targets`, `mask`,
/// `reward`, `adv`, `old_logp`, `ref_logp`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DumpMeta {
    /// The canonical config text (replay rebuilds the run from it).
    pub config: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// World size.
    pub world: usize,
    /// RL step of the failing update.
    pub step: u64,
    /// The failing update inside the step.
    pub minibatch: u32,
    /// Its attempt.
    pub attempt: u32,
    /// Mini-batch rows (B).
    pub b: usize,
    /// Sequence length (T).
    pub t: usize,
    /// This rank's loss.
    #[serde(with = "nullable")]
    pub loss: f64,
    /// This rank's bucket health before the reduce, in reduce order.
    pub local_health: Vec<HealthRecord>,
    /// How many chunks the transport scans a bucket in (the sums of squares depend on it).
    pub health_chunks: usize,
    /// The agreed report.
    pub report: Report,
}

impl Kind for DumpMeta {
    const KIND: &'static str = "dump";
    const FORMAT: u32 = DUMP_FORMAT;

    /// Format 1: the report without each bad rank's `samples`.
    fn upgrade(format: u64, meta: &mut serde_json::Value) -> bool {
        format == 1 && meta.get_mut("report").is_some_and(crate::report::add_samples)
    }
}
