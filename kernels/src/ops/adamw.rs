//! AdamW (decoupled weight decay, Loshchilov & Hutter) on flat slices: parameters, gradients and both
//! moments share one layout, so one call updates a whole buffer or any bucket of it.
//!
//! Invariants: elementwise and single-threaded, so the update is deterministic and independent of how
//! the buffer is cut into calls. The arithmetic follows PyTorch's single-tensor `AdamW`: decay
//! `p *= 1 - lr * wd` first, `m` by lerp, `v = beta2 v + (1 - beta2) g^2`, bias corrections in f64,
//! `p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`. `t` is the 1-based step count.

use std::ops::Range;

use crate::checksum::{finish_all, lane_step, lane_word, tiles, Checksum, LANES};

/// Elements per piece: 4 x 32 KiB of operands, within L2. Whole groups of the checksum's lanes, so
/// that each piece of a hashed range but its last starts and ends at lane 0 (`adamw_scaled`).
const CHUNK: usize = 8192;
const _: () = assert!(CHUNK % LANES == 0);

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
    // x * 1 is x (a NaN's payload too: every use of a gradient below is arithmetic that quiets it).
    adamw_scaled(params, grads, 1.0, m, v, lr, beta1, beta2, eps, weight_decay, t, &[]).0
}

/// AdamW on the reduced gradients scaled by `gscale` (the sum over ranks to its clipped mean): each
/// gradient is multiplied by `gscale` in a register, never written back, so that the optimizer reads
/// the gradients once (bitwise [`crate::ops::scale`] and then [`adamw_update`]). Returns the replica
/// checksum of the updated parameters and, for each of `consumed` (ranges that tile the buffer, in
/// order; empty: nothing hashed), the replica checksum (`checksum::checksum`) of that range of
/// `grads` as the update read it: the consumed gradients, hashed over the pieces that the reducers
/// hashed as they wrote them, in the same pass (no second read: what the hash adds is its integer
/// work beside AdamW's, measured in docs/reliability.md). `grads` is left as it was.
///
/// # Panics
/// When the lengths differ or `consumed` does not tile the buffer (a program bug).
#[allow(clippy::too_many_arguments)]
pub fn adamw_scaled(
    params: &mut [f32],
    grads: &[f32],
    gscale: f32,
    m: &mut [f32],
    v: &mut [f32],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    t: u64,
    consumed: &[Range<usize>],
) -> (u64, Vec<u64>) {
    let n = params.len();
    assert!(grads.len() == n && m.len() == n && v.len() == n, "adamw_scaled: length mismatch");
    assert!(tiles(consumed, n), "adamw_scaled: pieces {consumed:?} must tile a buffer of {n}");
    let st = Step { s: AdamwScalars::new(lr, beta1, beta2, weight_decay, t), gscale, beta2, eps };
    let whole = 0..n;
    let pieces = if consumed.is_empty() { std::slice::from_ref(&whole) } else { consumed };
    let mut sum = Checksum::new();
    let mut read = Vec::with_capacity(consumed.len());
    for piece in pieces {
        // A piece's hash starts at lane 0 and CHUNK is whole groups of LANES: each part of it is
        // hashed in the update's own loop (a piece's last group may be short).
        let mut hash = Checksum::new();
        for start in piece.clone().step_by(CHUNK) {
            let r = start..(start + CHUNK).min(piece.end);
            let (p, g, m, v) = (&mut params[r.clone()], &grads[r.clone()], &mut m[r.clone()], &mut v[r]);
            match consumed.is_empty() {
                true => apply(p, g, m, v, &st),
                false => hash.absorb_groups(g.len(), |lanes| apply_hashed(p, g, m, v, &st, lanes)),
            }
            sum.update(p);
        }
        if !consumed.is_empty() {
            read.push(hash);
        }
    }
    let read = if consumed.is_empty() { Vec::new() } else { finish_all(&read) };
    (sum.finish(), read)
}

/// What every element's update takes: the scalars, and the gradients' coefficient.
#[derive(Clone, Copy)]
struct Step {
    s: AdamwScalars,
    gscale: f32,
    beta2: f32,
    eps: f32,
}

/// The elementwise update on `grads * gscale` (each product rounded to f32, as `ops::scale` stores
/// it; `adamw_update` takes 1, an exact product), compiled for the widest vectors the CPU has
/// (elementwise IEEE operations, no fused multiply-add: every variant gives the same bits).
fn apply(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], st: &Step) {
    simd_dispatch!(apply_body(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], st: &Step))
}

#[inline(always)]
fn apply_body(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], st: &Step) {
    for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
        element(p, g, m, v, st);
    }
}

/// [`apply`] group by group of `LANES` words (the last one possibly shorter), each group also
/// hashed into `lanes` (`checksum::lane_word`, lane `l` taking word `l`) as read, while in
/// registers: one pass.
fn apply_hashed(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], st: &Step, lanes: &mut [u32; LANES]) {
    simd_dispatch!(apply_hashed_body(params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32], st: &Step, lanes: &mut [u32; LANES]))
}

#[inline(always)]
fn apply_hashed_body(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    st: &Step,
    lanes: &mut [u32; LANES],
) {
    let mut acc = *lanes;
    // Whole groups as arrays of LANES (what the compiler keeps in registers), then the short one.
    let groups = params.chunks_exact_mut(LANES).zip(grads.chunks_exact(LANES));
    for ((p, g), (m, v)) in groups.zip(m.chunks_exact_mut(LANES).zip(v.chunks_exact_mut(LANES))) {
        let (p, g): (&mut [f32; LANES], &[f32; LANES]) = (p.try_into().unwrap(), g.try_into().unwrap());
        let (m, v): (&mut [f32; LANES], &mut [f32; LANES]) = (m.try_into().unwrap(), v.try_into().unwrap());
        for l in 0..LANES {
            acc[l] = lane_word(acc[l], g[l]);
            element(&mut p[l], g[l], &mut m[l], &mut v[l], st);
        }
    }
    let tail = params.len() - params.len() % LANES;
    lane_step(&mut acc, &grads[tail..]);
    apply_body(&mut params[tail..], &grads[tail..], &mut m[tail..], &mut v[tail..], st);
    *lanes = acc;
}

/// One element's update on the gradient `g * gscale`: the arithmetic of the module's invariants, in
/// this order.
#[inline(always)]
fn element(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, st: &Step) {
    let (s, g) = (&st.s, g * st.gscale);
    *m += (g - *m) * s.one_minus_beta1;
    *v = *v * st.beta2 + s.one_minus_beta2 * g * g;
    *p *= s.decay;
    *p -= s.step_size * (*m / (v.sqrt() / s.bc2_sqrt + st.eps));
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
