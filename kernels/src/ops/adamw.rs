//! AdamW (decoupled weight decay, Loshchilov & Hutter) on flat slices: parameters, gradients and both
//! moments share one layout, so one call updates a whole buffer or any bucket of it.
//!
//! Invariants: elementwise and single-threaded, so the update is deterministic and independent of how
//! the buffer is cut into calls. The arithmetic follows PyTorch's single-tensor `AdamW`: decay
//! `p *= 1 - lr * wd` first, `m` by lerp, `v = beta2 v + (1 - beta2) g^2`, bias corrections in f64,
//! `p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`. `t` is the 1-based step count.

/// params, grads, m, v: (N).
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
) {
    let n = params.len();
    assert!(grads.len() == n && m.len() == n && v.len() == n, "adamw_update: length mismatch");
    let s = AdamwScalars::new(lr, beta1, beta2, weight_decay, t);
    for i in 0..n {
        let g = grads[i];
        m[i] += (g - m[i]) * s.one_minus_beta1;
        v[i] = v[i] * beta2 + s.one_minus_beta2 * g * g;
        params[i] *= s.decay;
        params[i] -= s.step_size * (m[i] / (v[i].sqrt() / s.bc2_sqrt + eps));
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
