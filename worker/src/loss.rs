//! The GRPO-style RL loss over the log-probs of the response tokens: PPO clipped ratio plus a k3 KL
//! to a frozen reference, token-mean over response positions:
//! `loss = mean_resp[ -min(r A, clip(r, 1-eps, 1+eps) A) + kl_coef * clamp(k3, -10, 10) ]`, with
//! `r = exp(logp - old)` and `k3 = exp(ref - logp) - 1 - (ref - logp)`.
//!
//! Two styles, one objective. [`LossStyle::Roll`] computes exactly as ROLL does: both exps at EVERY
//! position (masked ones too) with no clamp of the log-ratio, the k3 clamp after the exp, the mask
//! multiplied in afterwards; its backward replays PyTorch autograd's arithmetic step by step (exp's
//! gradient is its output, clamp's is 0 outside the range, min splits ties), so an exp that overflowed
//! gives `0 * inf = NaN` in the gradient while the loss stays finite - also at masked positions, which
//! contribute 0 to the loss. [`LossStyle::Safe`] is the fix of verl/OpenRLHF/NeMo-RL/TRL: masked
//! positions are selected out before anything is computed, and each log-ratio is clamped to [-20, 20]
//! before its exp. Invariants: single-threaded, fixed order, deterministic; every exp's operands go
//! to the [`Probe`], and each backward stage's output too, so a trace can name the first non-finite.

use serde::{Deserialize, Serialize};

use gradbus_kernels::ops::{logsoftmax_gather_backward, logsoftmax_gather_forward};

use crate::probe::{ExpOp, Phase, Probe};

/// How the loss treats masked positions and large log-ratios.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossStyle {
    /// As ROLL: exp everywhere, clamp after, mask multiplied after (reproduces the NaN).
    #[default]
    Roll,
    /// Masked positions selected out first, log-ratios clamped to [-20, 20] before exp.
    Safe,
}

/// The loss settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossConfig {
    /// "roll" or "safe".
    pub style: LossStyle,
    /// PPO clip epsilon.
    pub clip: f32,
    /// Coefficient of the k3 KL to the reference policy.
    pub kl_coef: f32,
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig { style: LossStyle::Roll, clip: 0.2, kl_coef: 0.01 }
    }
}

/// ln(f32::MAX): exp of anything larger is +inf (the same for bf16, whose exponent has 8 bits too).
/// The one definition; `gradbus report` and the headroom warnings use it.
pub const EXP_OVERFLOW: f32 = 88.72284;

/// Bound of the k3 value (both styles, as ROLL and verl).
pub const K3_CLAMP: f32 = 10.0;
/// Bound of a log-ratio before its exp in the safe style.
pub const LOGRATIO_CLAMP: f32 = 20.0;

/// The loss's inputs besides the logits; per-position slices are (B, T).
#[derive(Clone, Copy, Debug)]
pub struct LossInputs<'a> {
    /// Sequences B.
    pub b: usize,
    /// Positions T.
    pub t: usize,
    /// Target (next) token per position, (B, T).
    pub targets: &'a [u32],
    /// 1 at response positions, 0 at prompt or padding, (B, T).
    pub mask: &'a [f32],
    /// Advantage per sequence, (B).
    pub adv: &'a [f32],
    /// Log-probs of the targets under the rollout ("old") policy, (B, T).
    pub old_logp: &'a [f32],
    /// Log-probs of the targets under the reference policy, (B, T).
    pub ref_logp: &'a [f32],
}

/// What the loss reports. Log-ratios are as computed (before the safe style's clamp), at every
/// position, whether or not an exp was evaluated there: they measure the headroom to exp's overflow
/// at ln(f32::MAX) = 88.72.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossStats {
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

/// Per-position values kept from forward for backward, (B, T) each.
#[derive(Clone, Debug, Default)]
pub struct LossCache {
    logp: Vec<f32>,
    lse: Vec<f32>,
    /// Whether the exps were evaluated (all positions in the roll style, response ones in safe).
    evaluated: Vec<bool>,
    lr1_raw: Vec<f32>,
    lr1: Vec<f32>,
    ratio: Vec<f32>,
    lr2_raw: Vec<f32>,
    lr2: Vec<f32>,
    e2: Vec<f32>,
    k3: Vec<f32>,
    denom: f32,
}

/// Log-probs of `targets` under `logits`. logits: (N, V), targets: (N) -> (N).
pub fn target_logp(logits: &[f32], targets: &[u32], v: usize) -> Vec<f32> {
    let n = targets.len();
    let (mut logp, mut lse) = (vec![0.0; n], vec![0.0; n]);
    logsoftmax_gather_forward(&mut logp, &mut lse, logits, targets, n, v);
    logp
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

/// Forward of the loss. logits: (B, T, V). Fills `cache` for [`loss_backward`].
#[allow(clippy::needless_range_loop)] // one index runs over six parallel (B, T) arrays
pub fn loss_forward<P: Probe + ?Sized>(
    cfg: &LossConfig,
    logits: &[f32],
    inp: &LossInputs<'_>,
    v: usize,
    cache: &mut LossCache,
    probe: &mut P,
) -> LossStats {
    let (b, t) = (inp.b, inp.t);
    let n = b * t;
    assert!(logits.len() == n * v && inp.targets.len() == n && inp.mask.len() == n, "loss_forward: shapes");
    assert!(inp.adv.len() == b && inp.old_logp.len() == n && inp.ref_logp.len() == n, "loss_forward: shapes");
    let safe = cfg.style == LossStyle::Safe;
    let c = cache;
    for buf in [&mut c.logp, &mut c.lse, &mut c.lr1_raw, &mut c.lr1, &mut c.ratio, &mut c.lr2_raw, &mut c.lr2] {
        buf.clear();
        buf.resize(n, 0.0);
    }
    c.e2.clear();
    c.e2.resize(n, 1.0);
    c.ratio.fill(1.0);
    c.k3.clear();
    c.k3.resize(n, 0.0);
    c.evaluated.clear();
    c.evaluated.resize(n, false);

    logsoftmax_gather_forward(&mut c.logp, &mut c.lse, logits, inp.targets, n, v);
    probe.check("loss.logp", None, Phase::Forward, &c.logp, &[b, t]);

    let response_tokens = inp.mask.iter().filter(|&&m| m != 0.0).count();
    c.denom = response_tokens.max(1) as f32;
    let mut st = LossStats { response_tokens, min_response_logp: 0.0, ..LossStats::default() };
    let mut min_logp = f32::INFINITY;
    for i in 0..n {
        let resp = inp.mask[i] != 0.0;
        c.lr1_raw[i] = c.logp[i] - inp.old_logp[i];
        c.lr2_raw[i] = inp.ref_logp[i] - c.logp[i];
        let (m1, m2) = if resp {
            (&mut st.max_ratio_logratio_response, &mut st.max_kl_logratio_response)
        } else {
            (&mut st.max_ratio_logratio_masked, &mut st.max_kl_logratio_masked)
        };
        *m1 = m1.max(c.lr1_raw[i].abs());
        *m2 = m2.max(c.lr2_raw[i].abs());
        if resp {
            min_logp = min_logp.min(c.logp[i]);
        }
        if safe && !resp {
            continue; // selected out: no exp, no term, no gradient
        }
        c.evaluated[i] = true;
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
    let dims = [b, t];
    let (mask, evaluated) = (inp.mask, &c.evaluated[..]);
    probe.exp(ExpOp { op: "loss.ratio_exp", input: &c.lr1, output: &c.ratio, mask, evaluated, dims });
    probe.exp(ExpOp { op: "loss.kl_exp", input: &c.lr2, output: &c.e2, mask, evaluated, dims });

    // Terms, then the token-mean: sum(pg * mask) / N + kl_coef * sum(k3c * mask) / N (roll), or the
    // same sums over the selected positions only (safe).
    let (lo, hi) = (1.0 - cfg.clip, 1.0 + cfg.clip);
    let mut terms = vec![0.0f32; n];
    let (mut pg_sum, mut kl_sum, mut ratio_sum, mut kl_resp_sum) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    for i in 0..n {
        if !c.evaluated[i] {
            continue;
        }
        let a = inp.adv[i / t];
        let surr1 = c.ratio[i] * a;
        let surr2 = torch_clamp(c.ratio[i], lo, hi) * a;
        let pg = -torch_min(surr1, surr2);
        let k3c = torch_clamp(c.k3[i], -K3_CLAMP, K3_CLAMP);
        let m = if safe { 1.0 } else { inp.mask[i] };
        pg_sum += pg * m;
        kl_sum += k3c * m;
        terms[i] = pg * m + cfg.kl_coef * k3c * m;
        if inp.mask[i] != 0.0 {
            ratio_sum += c.ratio[i];
            kl_resp_sum += k3c;
        }
    }
    probe.check("loss.terms", None, Phase::Forward, &terms, &dims);
    st.loss = pg_sum / c.denom + cfg.kl_coef * (kl_sum / c.denom);
    st.ratio = ratio_sum / c.denom;
    st.kl = kl_resp_sum / c.denom;
    st
}

/// Backward of the loss: dlogits (B, T, V) +=. Replays PyTorch autograd's arithmetic for the graph
/// [`loss_forward`] built (see the module doc).
pub fn loss_backward<P: Probe + ?Sized>(
    cfg: &LossConfig,
    logits: &[f32],
    inp: &LossInputs<'_>,
    v: usize,
    cache: &LossCache,
    dlogits: &mut [f32],
    probe: &mut P,
) {
    let (b, t) = (inp.b, inp.t);
    let n = b * t;
    assert_eq!(dlogits.len(), n * v, "loss_backward: dlogits are not (B, T, V)");
    let c = cache;
    let safe = cfg.style == LossStyle::Safe;
    let lim = if safe { LOGRATIO_CLAMP } else { f32::INFINITY };
    let (lo, hi) = (1.0 - cfg.clip, 1.0 + cfg.clip);
    let mut d_lr1 = vec![0.0f32; n];
    let mut d_lr2 = vec![0.0f32; n];
    let mut dlogp = vec![0.0f32; n];
    for i in 0..n {
        if !c.evaluated[i] {
            continue;
        }
        let a = inp.adv[i / t];
        let m = if safe { 1.0 } else { inp.mask[i] };
        // loss = sum(pg * m) / N + kl_coef * (sum(k3c * m) / N)
        let d_pg = (1.0 / c.denom) * m;
        let d_k3c = (cfg.kl_coef / c.denom) * m;
        // pg = -min(surr1, surr2): PyTorch's minimum backward splits ties, and NaN compares false.
        let d_min = -d_pg;
        let surr1 = c.ratio[i] * a;
        let surr2 = torch_clamp(c.ratio[i], lo, hi) * a;
        let half = if surr1 == surr2 { d_min / 2.0 } else { d_min };
        let d_surr1 = if surr1 > surr2 { 0.0 } else { half };
        let d_surr2 = if surr1 < surr2 { 0.0 } else { half };
        // surr1 = ratio * a; surr2 = clamp(ratio) * a; ratio = exp(lr1): d = grad * output.
        let d_ratio = d_surr1 * a + clamp_grad(d_surr2 * a, c.ratio[i], lo, hi);
        d_lr1[i] = d_ratio * c.ratio[i];
        // k3c = clamp(k3); k3 = (e2 - 1) - lr2; e2 = exp(lr2).
        let d_k3 = clamp_grad(d_k3c, c.k3[i], -K3_CLAMP, K3_CLAMP);
        d_lr2[i] = d_k3 * c.e2[i] + -d_k3;
    }
    probe.check("loss.ratio_exp", None, Phase::Backward, &d_lr1, &[b, t]);
    probe.check("loss.kl_exp", None, Phase::Backward, &d_lr2, &[b, t]);
    for i in 0..n {
        if !c.evaluated[i] {
            continue;
        }
        // lr1 = clamp(logp - old), lr2 = clamp(ref - logp): the clamps only in the safe style.
        let g1 = if safe { clamp_grad(d_lr1[i], c.lr1_raw[i], -lim, lim) } else { d_lr1[i] };
        let g2 = if safe { clamp_grad(d_lr2[i], c.lr2_raw[i], -lim, lim) } else { d_lr2[i] };
        dlogp[i] = g1 + -g2;
    }
    probe.check("loss.logp", None, Phase::Backward, &dlogp, &[b, t]);
    logsoftmax_gather_backward(dlogits, &dlogp, logits, &c.lse, inp.targets, n, v);
    probe.check("loss.logits", None, Phase::Backward, dlogits, &[b, t, v]);
}

/// Forward and backward in one call: the stats and a fresh dlogits (B, T, V).
pub fn rl_loss<P: Probe + ?Sized>(
    cfg: &LossConfig,
    logits: &[f32],
    inp: &LossInputs<'_>,
    v: usize,
    probe: &mut P,
) -> (LossStats, Vec<f32>) {
    let mut cache = LossCache::default();
    let stats = loss_forward(cfg, logits, inp, v, &mut cache, probe);
    let mut dlogits = vec![0.0; logits.len()];
    loss_backward(cfg, logits, inp, v, &cache, &mut dlogits, probe);
    (stats, dlogits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::NoProbe;

    const V: usize = 4;

    /// B = 1, T = 2. Position 0 carries the planted log-ratios (`ref - logp = kl_gap`,
    /// `logp - old = ratio_gap`) and mask `mask0`; position 1 is an ordinary response token.
    fn run(style: LossStyle, kl_gap: f32, ratio_gap: f32, mask0: f32, adv: f32) -> (LossStats, Vec<f32>) {
        let logits = [0.3, -0.2, 0.1, 0.0, -0.5, 0.2, 0.4, 0.1];
        let targets = [1, 2];
        let logp = target_logp(&logits, &targets, V);
        let old_logp = [logp[0] - ratio_gap, logp[1] + 0.05];
        let ref_logp = [logp[0] + kl_gap, logp[1] - 0.1];
        let inp = LossInputs {
            b: 1,
            t: 2,
            targets: &targets,
            mask: &[mask0, 1.0],
            adv: &[adv],
            old_logp: &old_logp,
            ref_logp: &ref_logp,
        };
        rl_loss(&LossConfig { style, clip: 0.2, kl_coef: 0.01 }, &logits, &inp, V, &mut NoProbe)
    }

    fn all_finite(x: &[f32]) -> bool {
        x.iter().all(|v| v.is_finite())
    }

    #[test]
    fn k3_gap_past_88_72_roll_gives_finite_loss_and_nan_gradient_safe_stays_finite() {
        for gap in [89.0, 120.0] {
            for mask0 in [1.0, 0.0] {
                let (st, d) = run(LossStyle::Roll, gap, 0.0, mask0, 0.5);
                assert!(st.loss.is_finite(), "roll gap {gap} mask {mask0}: loss {}", st.loss);
                assert!(d[..V].iter().all(|x| x.is_nan()), "roll gap {gap} mask {mask0}: row 0 is NaN: {d:?}");
                assert!(all_finite(&d[V..]), "the other position is untouched");
                let (st, d) = run(LossStyle::Safe, gap, 0.0, mask0, 0.5);
                assert!(st.loss.is_finite() && all_finite(&d), "safe gap {gap} mask {mask0}: {st:?} {d:?}");
                let which = if mask0 == 1.0 { st.max_kl_logratio_response } else { st.max_kl_logratio_masked };
                assert!((which - gap).abs() < 1e-3, "stats report the raw gap: {which}");
            }
        }
    }

    #[test]
    fn masked_positions_contribute_nothing_in_either_style_when_benign() {
        let (roll, droll) = run(LossStyle::Roll, 0.3, -0.2, 0.0, 0.7);
        let (safe, dsafe) = run(LossStyle::Safe, 0.3, -0.2, 0.0, 0.7);
        assert_eq!(roll.loss, safe.loss);
        assert_eq!(droll, dsafe);
        assert!(dsafe[..V].iter().all(|&x| x == 0.0));
        assert_eq!(safe.response_tokens, 1);
    }

    #[test]
    fn ppo_ratio_log_ratio_90_with_advantage_plus_one_roll_nan_gradient_finite_loss() {
        let (st, d) = run(LossStyle::Roll, 0.0, 90.0, 1.0, 1.0);
        assert!(st.loss.is_finite(), "loss {}", st.loss);
        assert!(d[..V].iter().all(|x| x.is_nan()));
        // Advantage 0: inf * 0 = NaN already in the loss.
        let (st, _) = run(LossStyle::Roll, 0.0, 90.0, 1.0, 0.0);
        assert!(st.loss.is_nan());
        let (st, d) = run(LossStyle::Safe, 0.0, 90.0, 1.0, 1.0);
        assert!(st.loss.is_finite() && all_finite(&d));
        assert!((st.max_ratio_logratio_response - 90.0).abs() < 1e-3);
    }

    #[test]
    fn loss_value_matches_the_formula_on_ordinary_values() {
        // Position 0: lr1 = 0.1 (ratio 1.105, inside the clip), lr2 = 0.3; position 1 as in `run`.
        let logits = [0.3, -0.2, 0.1, 0.0, -0.5, 0.2, 0.4, 0.1];
        let logp = target_logp(&logits, &[1, 2], V);
        let (st, _) = run(LossStyle::Safe, 0.3, 0.1, 1.0, 0.5);
        let k3 = |x: f64| x.exp() - 1.0 - x;
        let pg = |lr: f64, a: f64| -(lr.exp() * a).min(lr.exp().clamp(0.8, 1.2) * a);
        let lr1_1 = (logp[1] as f64) - (logp[1] as f64 + 0.05);
        let want = (pg(0.1, 0.5) + pg(lr1_1, 0.5)) / 2.0 + 0.01 * (k3(0.3) + k3(-0.1)) / 2.0;
        assert!((st.loss as f64 - want).abs() < 1e-6, "{} vs {want}", st.loss);
        let (roll, _) = run(LossStyle::Roll, 0.3, 0.1, 1.0, 0.5);
        assert_eq!(roll.loss, st.loss, "the styles agree where nothing is masked or clamped");
    }

    #[test]
    fn probe_sees_the_exp_operands_and_the_first_nan_is_the_kl_exp_backward() {
        #[derive(Default)]
        struct Rec {
            first_bad: Option<(&'static str, Phase)>,
            kl_input: Vec<f32>,
        }
        impl Probe for Rec {
            fn check(&mut self, op: &'static str, _: Option<usize>, phase: Phase, data: &[f32], _: &[usize]) {
                if self.first_bad.is_none() && data.iter().any(|x| !x.is_finite()) {
                    self.first_bad = Some((op, phase));
                }
            }
            fn exp(&mut self, op: ExpOp<'_>) {
                if op.op == "loss.kl_exp" {
                    self.kl_input = op.input.to_vec();
                }
            }
        }
        let logits = [0.3, -0.2, 0.1, 0.0, -0.5, 0.2, 0.4, 0.1];
        let logp = target_logp(&logits, &[1, 2], V);
        let inp = LossInputs {
            b: 1,
            t: 2,
            targets: &[1, 2],
            mask: &[0.0, 1.0],
            adv: &[1.0],
            old_logp: &logp,
            ref_logp: &[logp[0] + 91.3, logp[1]],
        };
        let mut rec = Rec::default();
        let (st, _) = rl_loss(&LossConfig::default(), &logits, &inp, V, &mut rec);
        assert!(st.loss.is_finite());
        assert!((rec.kl_input[0] - 91.3).abs() < 1e-3);
        assert_eq!(rec.first_bad, Some(("loss.kl_exp", Phase::Backward)));
    }

    #[test]
    fn style_parses_lowercase() {
        let c: LossConfig = toml::from_str("style = \"safe\"\nclip = 0.1").unwrap();
        assert_eq!((c.style, c.clip, c.kl_coef), (LossStyle::Safe, 0.1, 0.01));
        assert!(toml::from_str::<LossConfig>("style = \"Safe\"").is_err());
    }
}
