//! The words a transport between machines (MPI, NCCL) puts on the wire for the agreement: a health
//! cell as 4 u64 words, and the hash of each collective that every rank folds into a per-update
//! sequence hash, so that ranks which called different collectives find out and all fail alike.

use gradbus_kernels::Health;

use crate::layout::Fnv;
use crate::verdict::StepId;

/// "No value" in a word (no first bad index, no bucket).
pub(crate) const NONE: u64 = u64::MAX;

/// Health as 4 row words.
pub(crate) fn health_words(h: &Health) -> [u64; 4] {
    [h.nan, h.inf, h.sumsq.to_bits(), h.first_bad.unwrap_or(NONE)]
}

/// Health from its 4 row words.
pub(crate) fn health_of(w: &[u64]) -> Health {
    Health { nan: w[0], inf: w[1], sumsq: f64::from_bits(w[2]), first_bad: (w[3] != NONE).then_some(w[3]) }
}

/// Hash of one collective, folded into the per-update sequence hash.
pub(crate) fn fold_op(h: &mut Fnv, phase: &str, at: StepId, bucket: Option<usize>) {
    h.write(phase.as_bytes());
    h.write(&at.step.to_le_bytes());
    h.write(&at.minibatch.to_le_bytes());
    h.write(&at.attempt.to_le_bytes());
    h.write(&bucket.map_or(NONE, |b| b as u64).to_le_bytes());
}
