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
//! before its exp. The arithmetic is the backend's: the log-softmax gathered at the targets, then the
//! per-position GRPO op (`gradbus_kernels::ops::grpo`), and their backwards. Invariants:
//! deterministic; every exp's operands go to the [`Probe`], and each backward stage's output too, so a
//! trace can name the first non-finite.

use serde::{Deserialize, Serialize};

use gradbus_kernels::backend::Backend;
use gradbus_kernels::ops::grpo::{GrpoGrads, GrpoSaved, GrpoScalars};
pub use gradbus_kernels::ops::grpo::{GrpoStats as LossStats, K3_CLAMP, LOGRATIO_CLAMP};

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

impl LossConfig {
    /// The settings as the GRPO op takes them.
    fn scalars(&self) -> GrpoScalars {
        GrpoScalars { safe: self.style == LossStyle::Safe, clip: self.clip, kl_coef: self.kl_coef }
    }
}

/// The loss's buffers on a backend, for up to `cap` = (B, T) positions of a vocabulary of V: its
/// inputs (uploaded at each call), the values kept from forward for backward, and `dlogits`.
pub struct LossBufs<B: Backend> {
    cap: (usize, usize),
    v: usize,
    targets: B::Ids,
    mask: B::Buf,     // (B, T)
    adv: B::Buf,      // (B)
    old_logp: B::Buf, // (B, T)
    ref_logp: B::Buf, // (B, T)
    logp: B::Buf,     // (B, T)
    lse: B::Buf,      // (B, T)
    saved: GrpoSaved<B::Buf>,
    grads: GrpoGrads<B::Buf>,
    dlogits: B::Buf, // (B, T, V)
}

impl<B: Backend> LossBufs<B> {
    /// Buffers for up to `b` sequences of `t` positions over a vocabulary of `v`.
    pub fn new(be: &B, b: usize, t: usize, v: usize) -> LossBufs<B> {
        let n = b * t;
        LossBufs {
            cap: (b, t),
            v,
            targets: be.ids(n),
            mask: be.zeros(n),
            adv: be.zeros(b),
            old_logp: be.zeros(n),
            ref_logp: be.zeros(n),
            logp: be.zeros(n),
            lse: be.zeros(n),
            saved: GrpoSaved::<()>::default().map(|()| be.zeros(n)),
            grads: GrpoGrads::<()>::default().map(|()| be.zeros(n)),
            dlogits: be.zeros(n * v),
        }
    }

    /// The gradient of the loss with respect to the logits of the last [`rl_loss`], (B, T, V).
    pub fn dlogits<'a>(&'a self, be: &B, b: usize, t: usize) -> B::View<'a> {
        be.view(&self.dlogits, 0..b * t * self.v)
    }
}

/// Log-probs of `targets` under `logits`. logits: (N, V), targets: (N) -> (N), on the host.
pub fn target_logp<B: Backend>(be: &B, logits: B::View<'_>, targets: &[u32], v: usize) -> Vec<f32> {
    let n = targets.len();
    let mut ids = be.ids(n);
    be.upload_ids(&mut ids, targets);
    let (mut logp, mut lse) = (be.zeros(n), be.zeros(n));
    be.logsoftmax_gather_forward(be.all_mut(&mut logp), be.all_mut(&mut lse), logits, &ids, n, v);
    be.to_host(be.all(&logp)).into_owned()
}

/// The loss of one mini-batch and its gradient with respect to the logits (B, T, V), left in
/// `bufs` ([`LossBufs::dlogits`]). Forward: log-softmax at the targets, the GRPO terms; backward:
/// the GRPO op's, then the log-softmax's (PyTorch autograd's arithmetic; see the module doc).
pub fn rl_loss<B: Backend, P: Probe>(
    be: &B,
    cfg: &LossConfig,
    logits: B::View<'_>,
    inp: &LossInputs<'_>,
    bufs: &mut LossBufs<B>,
    probe: &mut P,
) -> LossStats {
    let (b, t, v) = (inp.b, inp.t, bufs.v);
    let n = b * t;
    assert!(b <= bufs.cap.0 && t <= bufs.cap.1, "rl_loss: (B, T) = ({b}, {t}) past the buffers");
    assert!(inp.targets.len() == n && inp.mask.len() == n, "rl_loss: shapes");
    assert!(inp.adv.len() == b && inp.old_logp.len() == n && inp.ref_logp.len() == n, "rl_loss: shapes");
    let s = cfg.scalars();
    let k = bufs;
    be.upload_ids(&mut k.targets, inp.targets);
    be.write(be.view_mut(&mut k.mask, 0..n), inp.mask);
    be.write(be.view_mut(&mut k.adv, 0..b), inp.adv);
    be.write(be.view_mut(&mut k.old_logp, 0..n), inp.old_logp);
    be.write(be.view_mut(&mut k.ref_logp, 0..n), inp.ref_logp);
    let pos = |buf| be.view(buf, 0..n);
    let dims = [b, t];

    // forward
    let (logp, lse) = (be.view_mut(&mut k.logp, 0..n), be.view_mut(&mut k.lse, 0..n));
    be.logsoftmax_gather_forward(logp, lse, B::dup(&logits), &k.targets, n, v);
    probe.check(be, "loss.logp", None, Phase::Forward, pos(&k.logp), &dims);
    let adv = be.view(&k.adv, 0..b);
    let st =
        be.grpo_forward(&s, pos(&k.logp), pos(&k.mask), adv, pos(&k.old_logp), pos(&k.ref_logp), b, t, &mut k.saved);
    let saved = &k.saved;
    let mask = pos(&k.mask);
    let (safe, m) = (s.safe, || B::dup(&mask));
    probe.exp(
        be,
        ExpOp { op: "loss.ratio_exp", input: pos(&saved.lr1), output: pos(&saved.ratio), mask: m(), safe, dims },
    );
    probe.exp(be, ExpOp { op: "loss.kl_exp", input: pos(&saved.lr2), output: pos(&saved.e2), mask: m(), safe, dims });
    probe.check(be, "loss.terms", None, Phase::Forward, pos(&saved.terms), &dims);

    // backward
    be.grpo_backward(&s, m(), be.view(&k.adv, 0..b), saved, st.denom(), b, t, &mut k.grads);
    probe.check(be, "loss.ratio_exp", None, Phase::Backward, pos(&k.grads.d_lr1), &dims);
    probe.check(be, "loss.kl_exp", None, Phase::Backward, pos(&k.grads.d_lr2), &dims);
    probe.check(be, "loss.logp", None, Phase::Backward, pos(&k.grads.dlogp), &dims);
    be.fill(be.view_mut(&mut k.dlogits, 0..n * v), 0.0);
    let dlogits = be.view_mut(&mut k.dlogits, 0..n * v);
    be.logsoftmax_gather_backward(dlogits, pos(&k.grads.dlogp), logits, pos(&k.lse), &k.targets, n, v);
    probe.check(be, "loss.logits", None, Phase::Backward, be.view(&k.dlogits, 0..n * v), &[b, t, v]);
    st
}

/// [`rl_loss`] on the CPU backend over host slices, in fresh buffers: the statistics and dlogits
/// (B, T, V). For tests and tools; the step loop keeps its buffers.
pub fn rl_loss_host<P: Probe>(
    cfg: &LossConfig,
    logits: &[f32],
    inp: &LossInputs<'_>,
    probe: &mut P,
) -> (LossStats, Vec<f32>) {
    let be = &gradbus_kernels::backend::Cpu;
    let mut bufs = LossBufs::new(be, inp.b, inp.t, logits.len() / (inp.b * inp.t).max(1));
    let st = rl_loss(be, cfg, logits, inp, &mut bufs, probe);
    (st, bufs.dlogits(be, inp.b, inp.t).to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::NoProbe;
    use gradbus_kernels::backend::Cpu;

    const V: usize = 4;

    /// B = 1, T = 2. Position 0 carries the planted log-ratios (`ref - logp = kl_gap`,
    /// `logp - old = ratio_gap`) and mask `mask0`; position 1 is an ordinary response token.
    fn run(style: LossStyle, kl_gap: f32, ratio_gap: f32, mask0: f32, adv: f32) -> (LossStats, Vec<f32>) {
        let logits = [0.3, -0.2, 0.1, 0.0, -0.5, 0.2, 0.4, 0.1];
        let targets = [1, 2];
        let logp = target_logp(&Cpu, &logits, &targets, V);
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
        rl_loss_host(&LossConfig { style, clip: 0.2, kl_coef: 0.01 }, &logits, &inp, &mut NoProbe)
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
        let logp = target_logp(&Cpu, &logits, &[1, 2], V);
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
            fn check<B: Backend>(
                &mut self,
                be: &B,
                op: &'static str,
                _: Option<usize>,
                phase: Phase,
                data: B::View<'_>,
                _: &[usize],
            ) {
                if self.first_bad.is_none() && be.to_host(data).iter().any(|x| !x.is_finite()) {
                    self.first_bad = Some((op, phase));
                }
            }
            fn exp<B: Backend>(&mut self, be: &B, op: ExpOp<'_, B>) {
                if op.op == "loss.kl_exp" {
                    self.kl_input = be.to_host(op.input).into_owned();
                }
            }
        }
        let logits = [0.3, -0.2, 0.1, 0.0, -0.5, 0.2, 0.4, 0.1];
        let logp = target_logp(&Cpu, &logits, &[1, 2], V);
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
        let (st, _) = rl_loss_host(&LossConfig::default(), &logits, &inp, &mut rec);
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
