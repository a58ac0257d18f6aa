//! The words a transport between machines (MPI, NCCL) puts on the wire for the agreement: a health
//! cell as 4 u64 words (`agreement`'s), and the hash of each collective that every rank folds into a
//! per-update sequence hash, so that ranks which called different collectives find out and all fail alike.

use crate::agreement::NONE;
pub(crate) use crate::agreement::{health_of, health_words};
use crate::layout::Fnv;
use crate::verdict::StepId;

/// Hash of one collective, folded into the per-update sequence hash.
pub(crate) fn fold_op(h: &mut Fnv, phase: &str, at: StepId, bucket: Option<usize>) {
    h.write(phase.as_bytes());
    h.write(&at.step.to_le_bytes());
    h.write(&at.minibatch.to_le_bytes());
    h.write(&at.attempt.to_le_bytes());
    h.write(&bucket.map_or(NONE, |b| b as u64).to_le_bytes());
}
