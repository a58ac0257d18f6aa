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
    assert!(t >= 1, "adamw_update: step t is 1-based");
    let n = params.len();
    assert!(grads.len() == n && m.len() == n && v.len() == n, "adamw_update: length mismatch");
    let bc1 = 1.0 - (beta1 as f64).powf(t as f64);
    let bc2_sqrt = (1.0 - (beta2 as f64).powf(t as f64)).sqrt() as f32;
    let step_size = (lr as f64 / bc1) as f32;
    let decay = 1.0 - lr * weight_decay;
    for i in 0..n {
        let g = grads[i];
        m[i] += (g - m[i]) * (1.0 - beta1);
        v[i] = v[i] * beta2 + (1.0 - beta2) * g * g;
        params[i] *= decay;
        params[i] -= step_size * (m[i] / (v[i].sqrt() / bc2_sqrt + eps));
    }
}
