//! The state being trained (the RL policy's weights, AdamW's moments and step count) and the
//! replica checksum of the weights, on the backend's device. (`Policy`, in gradbus, is the rule for
//! non-finite gradients: `gradbus_collectives::Policy`.)
//!
//! Invariants: the weights, `m` and `v` are one flat buffer each, laid out by the model's `Layout`;
//! `checksum` is always the replica checksum of `params`, kept by whatever writes them (the init,
//! a resume, the AdamW pass, which hashes as it writes), so an update never re-reads the weights.

use gradbus_kernels::backend::Backend;

use crate::config::OptimConfig;

/// Weights and optimizer state of one rank (the same on every rank).
pub struct TrainState<B: Backend> {
    /// The weights.
    pub params: B::Buf,
    /// Adam first moments.
    pub m: B::Buf,
    /// Adam second moments.
    pub v: B::Buf,
    /// Adam step counter.
    pub adam_t: u64,
    checksum: u64,
}

impl<B: Backend> TrainState<B> {
    /// Weights from host `params`, moments and step count as given (a fresh start or a checkpoint).
    pub fn new(be: &B, params: &[f32], m: Option<(&[f32], &[f32])>, adam_t: u64) -> TrainState<B> {
        let params = be.upload(params);
        let checksum = be.checksum(be.all(&params));
        let (m, v) = match m {
            Some((m, v)) => (be.upload(m), be.upload(v)),
            None => (be.zeros(be.len(&params)), be.zeros(be.len(&params))),
        };
        TrainState { params, m, v, adam_t, checksum }
    }

    /// The replica checksum of the weights.
    pub fn checksum(&self) -> u64 {
        self.checksum
    }

    /// The learning rate of the next update (linear warmup, then constant).
    pub fn lr(&self, o: &OptimConfig) -> f32 {
        if o.warmup > 0 && self.adam_t < o.warmup {
            o.lr * (self.adam_t + 1) as f32 / o.warmup as f32
        } else {
            o.lr
        }
    }

    /// The update from the reduced gradients (the SUM over `world` ranks, whose mean has the agreed
    /// norm `grad_norm`): the mean, clipped by that norm, then AdamW.
    pub fn apply(&mut self, be: &B, mut grads: B::ViewMut<'_>, grad_norm: f64, world: usize, o: &OptimConfig, lr: f32) {
        let world = world as f64;
        let clip = o.grad_clip as f64;
        let coef = if clip > 0.0 && grad_norm > clip { clip / (grad_norm + 1e-6) } else { 1.0 };
        be.scale(B::reborrow_mut(&mut grads), (coef / world) as f32);
        self.adam_t += 1;
        let (p, m, v) = (be.all_mut(&mut self.params), be.all_mut(&mut self.m), be.all_mut(&mut self.v));
        self.checksum =
            be.adamw(p, B::reborrow(&grads), m, v, lr, o.beta1, o.beta2, o.eps, o.weight_decay, self.adam_t);
    }
}
