//! The gradients of one mini-batch: forward, RL loss and backward, as one function that the step
//! loop and the replay both call.
//!
//! Invariant: there is exactly one code path from (weights, mini-batch) to gradients, so a replay of a
//! failure dump is bit for bit the failing rank's update.

use gradbus_collectives::GradSlots;
use gradbus_kernels::backend::Backend;
use gradbus_kernels::checksum::Prefix;

use crate::config::Config;
use crate::loss::{LossBufs, LossInputs, LossStats};
use crate::model::{Activations, Gpt};
use crate::probe::Probe;
use crate::task::Batch;

/// The buffers of one rank's forward, loss and backward on its backend, sized for its largest
/// mini-batch (the rollout's forwards use the activations too).
pub struct Work<B: Backend> {
    /// Activations and backward scratch.
    pub acts: Activations<B>,
    /// The loss's inputs, values and dlogits.
    pub loss: LossBufs<B>,
}

impl<B: Backend> Work<B> {
    /// Buffers for up to `b` sequences of `t` positions of `cfg`'s model.
    pub fn new(be: &B, cfg: &Config, b: usize, t: usize) -> Work<B> {
        Work { acts: Activations::new(be, &cfg.model, b, t), loss: LossBufs::new(be, b, t, cfg.model.vocab) }
    }
}

/// The gradients of one mini-batch: `forward_loss`, then backward into `grads` (zeroed by the
/// caller). The step loop runs the same two halves (backward on its own thread when overlapping),
/// and the replay this, so a replay is bit for bit the original.
#[allow(clippy::too_many_arguments)]
pub fn compute_gradients<B: Backend, G: GradSlots<B>, P: Probe>(
    be: &B,
    gpt: &Gpt,
    cfg: &Config,
    params: &B::Buf,
    work: &mut Work<B>,
    mb: &Batch,
    grads: &mut G,
    probe: &mut P,
) -> LossStats {
    let stats = forward_loss(be, gpt, cfg, params, work, mb, probe);
    backward(be, gpt, params, work, mb, grads, probe, None);
    stats
}

/// Forward and RL loss of one mini-batch: the loss statistics; the gradient of the loss with
/// respect to the logits stays in `work` for [`backward`].
pub fn forward_loss<B: Backend, P: Probe>(
    be: &B,
    gpt: &Gpt,
    cfg: &Config,
    params: &B::Buf,
    work: &mut Work<B>,
    mb: &Batch,
    probe: &mut P,
) -> LossStats {
    let logits = gpt.forward(be, params, &mb.inputs, mb.b, mb.t, &mut work.acts, probe);
    let inputs = LossInputs {
        b: mb.b,
        t: mb.t,
        targets: &mb.targets,
        mask: &mb.mask,
        adv: &mb.adv,
        old_logp: &mb.old_logp,
        ref_logp: &mb.ref_logp,
    };
    crate::loss::rl_loss(be, &cfg.loss, logits, &inputs, &mut work.loss, probe)
}

/// Backward of the last [`forward_loss`] on `work` into `grads`; given `hash`, it absorbs the
/// weights as it reads them (`Gpt::backward`).
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend, G: GradSlots<B>, P: Probe>(
    be: &B,
    gpt: &Gpt,
    params: &B::Buf,
    work: &mut Work<B>,
    mb: &Batch,
    grads: &mut G,
    probe: &mut P,
    hash: Option<&mut Prefix>,
) {
    let Work { acts, loss } = work;
    gpt.backward(be, params, acts, loss.dlogits(be, mb.b, mb.t), grads, probe, hash);
}
