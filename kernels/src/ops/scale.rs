//! Scale a gradient slice in place by one coefficient (the mean over ranks times the clip factor).
//!
//! Invariants: one f32 multiply per element, so the CUDA `scale` gives the same bits, whatever
//! instruction set runs the loop (compiled for the CPU's best). The CPU's optimizer does not call it:
//! `ops::adamw_scaled` multiplies each gradient by the same coefficient in a register, same bits.

/// x: (N). `x[i] *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    #[inline(always)]
    fn body(x: &mut [f32], s: f32) {
        for v in x.iter_mut() {
            *v *= s;
        }
    }
    simd_dispatch!(body(x: &mut [f32], s: f32))
}
