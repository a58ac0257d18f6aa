//! Scale a gradient slice in place by one coefficient (the mean over ranks times the clip factor).
//!
//! Invariants: one f32 multiply per element, so the CUDA `scale` gives the same bits.

/// x: (N). `x[i] *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}
