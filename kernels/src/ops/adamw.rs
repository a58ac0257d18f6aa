//! AdamW (decoupled weight decay, Loshchilov & Hutter) on flat slices: parameters, gradients and both
//! moments share one layout, so one call updates a whole buffer or any bucket of it.
//!
//! Invariants: elementwise and single-threaded, so the update is deterministic and independent of how
//! the buffer is cut into calls. The arithmetic follows PyTorch's single-tensor `AdamW`: decay
//! `p *= 1 - lr * wd` first, `m` by lerp, `v = beta2 v + (1 - beta2) g^2`, bias corrections in f64,
//! `p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`. `t` is the 1-based step count.

use crate::checksum::Checksum;

/// Elements per piece: 4 x 32 KiB of operands, within L2.
const CHUNK: usize = 8192;

/// The update, and the replica checksum of the updated parameters (`checksum::checksum`) computed in
/// the same pass: each piece of `CHUNK` parameters is hashed right after its update, while it is in
/// cache, so the weights are never read again to be hashed. params, grads, m, v: (N).
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    t: u64,
) -> u64 {
    let n = params.len();
    assert!(grads.len() == n && m.len() == n && v.len() == n, "adamw_update: length mismatch");
    let s = AdamwScalars::new(lr, beta1, beta2, weight_decay, t);
    let mut sum = Checksum::new();
    for start in (0..n).step_by(CHUNK) {
        let r = start..(start + CHUNK).min(n);
        let p = &mut params[r.clone()];
        apply(p, &grads[r.clone()], &mut m[r.clone()], &mut v[r], &s, beta2, eps);
        sum.update(p);
    }
    sum.finish()
}

/// The elementwise update with precomputed scalars, compiled for the widest vectors the CPU has
/// (elementwise IEEE operations, no fused multiply-add: every variant gives the same bits).
fn apply(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamwScalars, beta2: f32, eps: f32) {
    simd_dispatch!(apply_body(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamwScalars, beta2: f32, eps: f32))
}

#[inline(always)]
fn apply_body(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamwScalars, beta2: f32, eps: f32) {
    for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
        *m += (g - *m) * s.one_minus_beta1;
        *v = *v * beta2 + s.one_minus_beta2 * g * g;
        *p *= s.decay;
        *p -= s.step_size * (*m / (v.sqrt() / s.bc2_sqrt + eps));
    }
}

/// The per-call scalars of the update, computed once on the host: the CUDA kernel takes these same
/// values, so both backends run the same f32 operations on the same operands (and get the same bits).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwScalars {
    /// `1 - beta1` (f32).
    pub one_minus_beta1: f32,
    /// `1 - beta2` (f32).
    pub one_minus_beta2: f32,
    /// `1 - lr * weight_decay` (f32).
    pub decay: f32,
    /// `lr / (1 - beta1^t)`, the bias correction in f64, rounded once.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`, in f64, rounded once.
    pub bc2_sqrt: f32,
}

impl AdamwScalars {
    /// The scalars of step `t` (1-based; panics on 0).
    pub fn new(lr: f32, beta1: f32, beta2: f32, weight_decay: f32, t: u64) -> AdamwScalars {
        assert!(t >= 1, "adamw_update: step t is 1-based");
        let bc1 = 1.0 - (beta1 as f64).powf(t as f64);
        AdamwScalars {
            one_minus_beta1: 1.0 - beta1,
            one_minus_beta2: 1.0 - beta2,
            decay: 1.0 - lr * weight_decay,
            step_size: (lr as f64 / bc1) as f32,
            bc2_sqrt: (1.0 - (beta2 as f64).powf(t as f64)).sqrt() as f32,
        }
    }
}
