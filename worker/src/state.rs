//! The state being trained (the RL policy's weights, AdamW's moments and step count) and the
//! replica checksum of the weights, on the backend's device. (`Policy`, in gradbus, is the rule for
//! non-finite gradients: `gradbus_collectives::Policy`.)
//!
//! Invariants: the weights, `m` and `v` are one flat buffer each, laid out by the model's `Layout`;
//! `checksum` is always the replica checksum of `params` as last WRITTEN (the init, a resume, a
//! repair, the AdamW pass, which hashes as it writes), so reading the weights back and hashing them
//! again ([`TrainState::self_check`], or the backward pass as it reads them) tells whether memory
//! changed them since. The optimizer's scaling
//! pass hashes the reduced gradients it consumes, per bucket, so that the next update can check
//! them against the reducers' reference.

use std::ops::Range;

use gradbus_collectives::StateFault;
use gradbus_kernels::backend::Backend;
use gradbus_kernels::checksum::{combine, Prefix};

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
    /// The last update's consumed gradients per bucket (checksums, as the optimizer read
    /// them) and the reducers' reference for them; `None` before the first and after a repair.
    consumed: Option<(Vec<u64>, Vec<u64>)>,
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
        TrainState { params, m, v, adam_t, checksum, consumed: None }
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

    /// What this rank finds wrong with its own state, and the replica checksum of its weights as
    /// read back: weights that no longer hash to what was last written, a consumed gradient whose
    /// bucket hash differs from the reducers' reference (a reference of 0 is unknown: a transport
    /// that does not hash its sums). `read`: the weights as a pass that read them all since the
    /// last write absorbed them (`Gpt::backward`), finished here; `None`: read back now,
    /// one pass of its own.
    pub fn self_check(&self, be: &B, read: Option<Prefix>) -> (u64, StateFault) {
        let replica = match (read, be.host(be.all(&self.params))) {
            (Some(read), Some(x)) => read.finish(x),
            _ => be.checksum(be.all(&self.params)),
        };
        let consumed =
            self.consumed.as_ref().and_then(|(got, want)| got.iter().zip(want).position(|(g, w)| *w != 0 && g != w));
        (replica, StateFault { weights: replica != self.checksum, consumed })
    }

    /// Take a healthy replica's state (host copies of the weights and both moments), as the
    /// replica repair delivers it.
    pub fn adopt(&mut self, be: &B, params: &[f32], m: &[f32], v: &[f32]) {
        for (buf, x) in [(&mut self.params, params), (&mut self.m, m), (&mut self.v, v)] {
            be.write(be.all_mut(buf), x);
        }
        self.checksum = be.checksum(be.all(&self.params));
        self.consumed = None;
    }

    /// The update from the reduced gradients (the SUM over `world` ranks, whose mean has the agreed
    /// norm `grad_norm`): AdamW on the mean, clipped by that norm (`Backend::scaled_adamw`: on the
    /// CPU one pass, the gradients scaled in registers). That pass checksums the gradients it reads
    /// over `pieces` (`transport::hash_pieces`: each bucket's `pieces.len() / reference.len()`
    /// reducer chunks), folded per bucket (`checksum::combine`) and kept with `reference`, the
    /// reducers' hashes, for the next [`TrainState::self_check`]; no `pieces` (the replica checks
    /// off): nothing hashed, nothing kept. The gradients are not to be read afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &mut self,
        be: &B,
        grads: B::ViewMut<'_>,
        grad_norm: f64,
        world: usize,
        o: &OptimConfig,
        lr: f32,
        pieces: &[Range<usize>],
        reference: &[u64],
    ) {
        let world = world as f64;
        let clip = o.grad_clip as f64;
        let coef = if clip > 0.0 && grad_norm > clip { clip / (grad_norm + 1e-6) } else { 1.0 };
        let scale = (coef / world) as f32;
        self.adam_t += 1;
        let (p, m, v) = (be.all_mut(&mut self.params), be.all_mut(&mut self.m), be.all_mut(&mut self.v));
        let (b1, b2, t) = (o.beta1, o.beta2, self.adam_t);
        let (written, read) = be.scaled_adamw(p, grads, scale, m, v, lr, b1, b2, o.eps, o.weight_decay, t, pieces);
        self.checksum = written;
        self.consumed = (!pieces.is_empty()).then(|| {
            let per_bucket = pieces.len() / reference.len().max(1);
            (read.chunks(per_bucket.max(1)).map(combine).collect(), reference.to_vec())
        });
    }
}
