//! AdamW (decoupled weight decay, Loshchilov & Hutter) on flat slices: parameters, gradients and both
//! moments share one layout, so one call updates a whole buffer or any bucket of it.
//!
//! Invariants: elementwise and single-threaded, so the update is deterministic and independent of how
//! the buffer is cut into calls. Same arithmetic as PyTorch's `AdamW` (bias-corrected moments,
//! `p -= lr * wd * p` before the Adam step). `t` is the 1-based step count.

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
    t: u32,
) {
    assert!(t >= 1, "adamw_update: step t is 1-based");
    let n = params.len();
    assert!(grads.len() == n && m.len() == n && v.len() == n, "adamw_update: length mismatch");
    let bc1 = 1.0 - beta1.powi(t as i32);
    let bc2 = 1.0 - beta2.powi(t as i32);
    for i in 0..n {
        let g = grads[i];
        m[i] = beta1 * m[i] + (1.0 - beta1) * g;
        v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
        let m_hat = m[i] / bc1;
        let v_hat = v[i] / bc2;
        params[i] -= lr * weight_decay * params[i];
        params[i] -= lr * m_hat / (v_hat.sqrt() + eps);
    }
}
