//! The per-position part of the GRPO-style RL loss, on the log-probs of the targets (B, T): PPO
//! clipped ratio plus a clamped k3 KL to a reference, token-mean over response positions:
//! `loss = mean_resp[ -min(r A, clip(r, 1-eps, 1+eps) A) + kl_coef * clamp(k3, -10, 10) ]`, with
//! `r = exp(logp - old)` and `k3 = exp(ref - logp) - 1 - (ref - logp)`. The log-softmax that gives
//! `logp` and its backward are `softmax.rs`; the worker's `loss.rs` chains the two and the probe.
//!
//! Invariants: single-threaded, one fixed order per loop, so the same inputs give the same bits.
//! Two styles: `safe = false` is ROLL's arithmetic (both exps at EVERY position, masked ones too,
//! no clamp of the log-ratio, the k3 clamp after the exp, the mask multiplied in afterwards; the
//! backward replays PyTorch autograd step by step, so an exp that overflowed gives `0 * inf = NaN`
//! in the gradient while the loss stays finite). `safe = true` selects masked positions out before
//! anything is computed and clamps each log-ratio to [-20, 20] before its exp. A position that is
//! not evaluated (masked, safe style) holds ratio 1, e2 1, every other value 0.

/// Bound of the k3 value (both styles, as ROLL and verl).
pub const K3_CLAMP: f32 = 10.0;
/// Bound of a log-ratio before its exp in the safe style.
pub const LOGRATIO_CLAMP: f32 = 20.0;

/// The loss's settings, as the kernel takes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrpoScalars {
    /// The safe style (masked positions selected out, log-ratios clamped) instead of ROLL's.
    pub safe: bool,
    /// PPO clip epsilon.
    pub clip: f32,
    /// Coefficient of the k3 KL.
    pub kl_coef: f32,
}

/// What the forward reports. Log-ratios are as computed (before the safe style's clamp), at every
/// position, whether or not an exp was evaluated there: they measure the headroom to exp's overflow
/// at ln(f32::MAX) = 88.72.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GrpoStats {
    /// The loss.
    pub loss: f32,
    /// Mean PPO ratio over response positions.
    pub ratio: f32,
    /// Mean (clamped) k3 KL over response positions.
    pub kl: f32,
    /// Largest |logp - old| at response positions (the PPO ratio's exp input).
    pub max_ratio_logratio_response: f32,
    /// Largest |logp - old| at masked positions.
    pub max_ratio_logratio_masked: f32,
    /// Largest |ref - logp| at response positions (the k3 exp's input).
    pub max_kl_logratio_response: f32,
    /// Largest |ref - logp| at masked positions.
    pub max_kl_logratio_masked: f32,
    /// max of the two response log-ratio maxima.
    pub max_logratio_response: f32,
    /// max of the two masked log-ratio maxima.
    pub max_logratio_masked: f32,
    /// Smallest log-prob of a response target under the current policy.
    pub min_response_logp: f32,
    /// Number of response positions (the token-mean's divisor is max(this, 1)).
    pub response_tokens: usize,
}

impl GrpoStats {
    /// The token-mean's divisor.
    pub fn denom(&self) -> f32 {
        self.response_tokens.max(1) as f32
    }
}

/// The per-position values the forward keeps, (B, T) each, in any storage `S` (a backend's buffers).
#[derive(Clone, Debug, Default)]
pub struct GrpoSaved<S> {
    /// `logp - old`, before any clamp.
    pub lr1_raw: S,
    /// The ratio's exp input (clamped in the safe style).
    pub lr1: S,
    /// `exp(lr1)`.
    pub ratio: S,
    /// `ref - logp`, before any clamp.
    pub lr2_raw: S,
    /// The k3 exp input (clamped in the safe style).
    pub lr2: S,
    /// `exp(lr2)`.
    pub e2: S,
    /// `(e2 - 1) - lr2`, before its clamp.
    pub k3: S,
    /// Each position's masked contribution to the loss's sums.
    pub terms: S,
}

/// The gradients of the backward, (B, T) each.
#[derive(Clone, Debug, Default)]
pub struct GrpoGrads<S> {
    /// Gradient of the ratio's exp input.
    pub d_lr1: S,
    /// Gradient of the k3 exp input.
    pub d_lr2: S,
    /// Gradient of logp (what the log-softmax backward takes).
    pub dlogp: S,
}

impl<S> GrpoSaved<S> {
    /// Each value through `f`, in declaration order (allocate them, borrow them).
    pub fn map<U>(self, mut f: impl FnMut(S) -> U) -> GrpoSaved<U> {
        let GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms } = self;
        GrpoSaved {
            lr1_raw: f(lr1_raw),
            lr1: f(lr1),
            ratio: f(ratio),
            lr2_raw: f(lr2_raw),
            lr2: f(lr2),
            e2: f(e2),
            k3: f(k3),
            terms: f(terms),
        }
    }
}

impl<S> GrpoGrads<S> {
    /// Each gradient through `f`, in declaration order.
    pub fn map<U>(self, mut f: impl FnMut(S) -> U) -> GrpoGrads<U> {
        GrpoGrads { d_lr1: f(self.d_lr1), d_lr2: f(self.d_lr2), dlogp: f(self.dlogp) }
    }
}

/// PyTorch's `torch.min(a, b)`: NaN if either is NaN (Rust's `f32::min` would drop the NaN).
fn torch_min(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.min(b)
    }
}

/// PyTorch's `clamp`: NaN stays NaN.
fn torch_clamp(x: f32, lo: f32, hi: f32) -> f32 {
    x.clamp(lo, hi)
}

/// PyTorch's clamp backward: the gradient where `lo <= x <= hi`, else 0 (also for NaN x).
fn clamp_grad(g: f32, x: f32, lo: f32, hi: f32) -> f32 {
    if x >= lo && x <= hi {
        g
    } else {
        0.0
    }
}

/// Forward. logp, mask, old, reference: (B, T); adv: (B); `saved` (each at least B * T) is
/// overwritten at every position.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // one index over parallel (B, T) arrays
pub fn grpo_forward(
    s: &GrpoScalars,
    logp: &[f32],
    mask: &[f32],
    adv: &[f32],
    old: &[f32],
    reference: &[f32],
    b: usize,
    t: usize,
    saved: &mut GrpoSaved<&mut [f32]>,
) -> GrpoStats {
    let n = b * t;
    assert!(logp.len() >= n && mask.len() >= n && old.len() >= n && reference.len() >= n, "grpo_forward: shapes");
    assert!(adv.len() >= b, "grpo_forward: shapes");
    let safe = s.safe;
    let c = saved;
    let response_tokens = mask[..n].iter().filter(|&&m| m != 0.0).count();
    let denom = response_tokens.max(1) as f32;
    let mut st = GrpoStats { response_tokens, min_response_logp: 0.0, ..GrpoStats::default() };
    let mut min_logp = f32::INFINITY;
    for i in 0..n {
        let resp = mask[i] != 0.0;
        c.lr1_raw[i] = logp[i] - old[i];
        c.lr2_raw[i] = reference[i] - logp[i];
        let (m1, m2) = if resp {
            (&mut st.max_ratio_logratio_response, &mut st.max_kl_logratio_response)
        } else {
            (&mut st.max_ratio_logratio_masked, &mut st.max_kl_logratio_masked)
        };
        *m1 = m1.max(c.lr1_raw[i].abs());
        *m2 = m2.max(c.lr2_raw[i].abs());
        if resp {
            min_logp = min_logp.min(logp[i]);
        }
        if safe && !resp {
            // Selected out: no exp, no term, no gradient.
            (c.lr1[i], c.ratio[i], c.lr2[i], c.e2[i], c.k3[i]) = (0.0, 1.0, 0.0, 1.0, 0.0);
            continue;
        }
        let lim = if safe { LOGRATIO_CLAMP } else { f32::INFINITY };
        c.lr1[i] = torch_clamp(c.lr1_raw[i], -lim, lim);
        c.ratio[i] = c.lr1[i].exp();
        c.lr2[i] = torch_clamp(c.lr2_raw[i], -lim, lim);
        c.e2[i] = c.lr2[i].exp();
        c.k3[i] = (c.e2[i] - 1.0) - c.lr2[i];
    }
    if response_tokens > 0 {
        st.min_response_logp = min_logp;
    }
    st.max_logratio_response = st.max_ratio_logratio_response.max(st.max_kl_logratio_response);
    st.max_logratio_masked = st.max_ratio_logratio_masked.max(st.max_kl_logratio_masked);

    // Terms, then the token-mean: sum(pg * mask) / N + kl_coef * sum(k3c * mask) / N (roll), or the
    // same sums over the selected positions only (safe).
    let (lo, hi) = (1.0 - s.clip, 1.0 + s.clip);
    let (mut pg_sum, mut kl_sum, mut ratio_sum, mut kl_resp_sum) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    for i in 0..n {
        if safe && mask[i] == 0.0 {
            c.terms[i] = 0.0;
            continue;
        }
        let a = adv[i / t];
        let surr1 = c.ratio[i] * a;
        let surr2 = torch_clamp(c.ratio[i], lo, hi) * a;
        let pg = -torch_min(surr1, surr2);
        let k3c = torch_clamp(c.k3[i], -K3_CLAMP, K3_CLAMP);
        let m = if safe { 1.0 } else { mask[i] };
        pg_sum += pg * m;
        kl_sum += k3c * m;
        c.terms[i] = pg * m + s.kl_coef * k3c * m;
        if mask[i] != 0.0 {
            ratio_sum += c.ratio[i];
            kl_resp_sum += k3c;
        }
    }
    st.loss = pg_sum / denom + s.kl_coef * (kl_sum / denom);
    st.ratio = ratio_sum / denom;
    st.kl = kl_resp_sum / denom;
    st
}

/// Backward of [`grpo_forward`]: writes `grads` (each at least B * T) at every position. Replays
/// PyTorch autograd's arithmetic for the graph the forward built (see the module doc). `denom` is
/// the forward's [`GrpoStats::denom`].
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // one index over parallel (B, T) arrays
pub fn grpo_backward(
    s: &GrpoScalars,
    mask: &[f32],
    adv: &[f32],
    saved: &GrpoSaved<&[f32]>,
    denom: f32,
    b: usize,
    t: usize,
    grads: &mut GrpoGrads<&mut [f32]>,
) {
    let n = b * t;
    let c = saved;
    let safe = s.safe;
    let lim = if safe { LOGRATIO_CLAMP } else { f32::INFINITY };
    let (lo, hi) = (1.0 - s.clip, 1.0 + s.clip);
    for i in 0..n {
        if safe && mask[i] == 0.0 {
            (grads.d_lr1[i], grads.d_lr2[i]) = (0.0, 0.0);
            continue;
        }
        let a = adv[i / t];
        let m = if safe { 1.0 } else { mask[i] };
        // loss = sum(pg * m) / N + kl_coef * (sum(k3c * m) / N)
        let d_pg = (1.0 / denom) * m;
        let d_k3c = (s.kl_coef / denom) * m;
        // pg = -min(surr1, surr2): PyTorch's minimum backward splits ties, and NaN compares false.
        let d_min = -d_pg;
        let surr1 = c.ratio[i] * a;
        let surr2 = torch_clamp(c.ratio[i], lo, hi) * a;
        let half = if surr1 == surr2 { d_min / 2.0 } else { d_min };
        let d_surr1 = if surr1 > surr2 { 0.0 } else { half };
        let d_surr2 = if surr1 < surr2 { 0.0 } else { half };
        // surr1 = ratio * a; surr2 = clamp(ratio) * a; ratio = exp(lr1): d = grad * output.
        let d_ratio = d_surr1 * a + clamp_grad(d_surr2 * a, c.ratio[i], lo, hi);
        grads.d_lr1[i] = d_ratio * c.ratio[i];
        // k3c = clamp(k3); k3 = (e2 - 1) - lr2; e2 = exp(lr2).
        let d_k3 = clamp_grad(d_k3c, c.k3[i], -K3_CLAMP, K3_CLAMP);
        grads.d_lr2[i] = d_k3 * c.e2[i] + -d_k3;
    }
    for i in 0..n {
        if safe && mask[i] == 0.0 {
            grads.dlogp[i] = 0.0;
            continue;
        }
        // lr1 = clamp(logp - old), lr2 = clamp(ref - logp): the clamps only in the safe style.
        let g1 = if safe { clamp_grad(grads.d_lr1[i], c.lr1_raw[i], -lim, lim) } else { grads.d_lr1[i] };
        let g2 = if safe { clamp_grad(grads.d_lr2[i], c.lr2_raw[i], -lim, lim) } else { grads.d_lr2[i] };
        grads.dlogp[i] = g1 + -g2;
    }
}
