//! The gradients of one mini-batch: forward, RL loss and backward, as one function that the step
//! loop and the replay both call.
//!
//! Invariant: there is exactly one code path from (weights, mini-batch) to gradients, so a replay of a
//! failure dump is bit for bit the failing rank's update.

use gradbus_collectives::ParamGrads;

use crate::config::Config;
use crate::loss::LossStats;
use crate::model::{self, Gpt};
use crate::probe::Probe;
use crate::task::Batch;

/// The gradients of one mini-batch: `forward_loss`, then backward into `grads` (zeroed by the
/// caller). The step loop runs the same two halves (backward on its own thread when overlapping),
/// and the replay this, so a replay is bit for bit the original.
pub fn compute_gradients<P: Probe + ?Sized>(
    gpt: &Gpt,
    cfg: &Config,
    params: &[f32],
    acts: &mut model::Activations,
    mb: &Batch,
    grads: &mut ParamGrads<'_>,
    probe: &mut P,
) -> LossStats {
    let (stats, dlogits) = forward_loss(gpt, cfg, params, acts, mb, probe);
    gpt.backward(params, acts, &dlogits, grads, probe);
    stats
}

/// Forward and RL loss of one mini-batch: the loss statistics and the gradient of the loss with
/// respect to the logits, (B, T, V).
pub fn forward_loss<P: Probe + ?Sized>(
    gpt: &Gpt,
    cfg: &Config,
    params: &[f32],
    acts: &mut model::Activations,
    mb: &Batch,
    probe: &mut P,
) -> (LossStats, Vec<f32>) {
    let logits = gpt.forward(params, &mb.inputs, mb.b, mb.t, acts, probe).to_vec();
    let inputs = crate::loss::LossInputs {
        b: mb.b,
        t: mb.t,
        targets: &mb.targets,
        mask: &mb.mask,
        adv: &mb.adv,
        old_logp: &mb.old_logp,
        ref_logp: &mb.ref_logp,
    };
    crate::loss::rl_loss(&cfg.loss, &logits, &inputs, cfg.model.vocab, probe)
}
