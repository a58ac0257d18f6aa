//! The GRPO loss and the rollout's sampler of the CUDA backend (`kernels/cuda/loss.cu`,
//! `softmax.cu`, `sample.cu`), run on the CPU by the shim (`kernels/shim/cuda_shim.h`, harness
//! `kernels/tests/shim/mod.rs`), against their CPU twins here in the worker: `loss::loss_forward` /
//! `loss_backward` and `rollout::sample`. Every value the CPU loss shows its probe (log-probs, both
//! exps' inputs and outputs, the terms, each backward stage, dlogits) and every stat must be
//! bitwise the CPU's, in both styles, on random inputs that include log-ratio gaps past exp's
//! overflow at 88.72 (at response and at masked positions), advantages of 0 and NaN logits - so the
//! kernels overflow exactly where ROLL's loss does. The sampler must pick the CPU's tokens and
//! leave the RNG where the CPU leaves it. Each pipeline runs under both schedules of the shim
//! (blocks and threads in index and in reverse order) and must agree with itself bitwise. Needs
//! `g++` (else `SKIPPED`, capability `cxx`).

#[path = "../../kernels/tests/shim/mod.rs"]
mod shim;

use gradbus_kernels::cuda_grid::{self, Launch, LOSS_STATS};
use gradbus_kernels::rng::Rng;
use gradbus_worker::loss::{
    loss_backward, loss_forward, LossCache, LossConfig, LossInputs, LossStats, LossStyle, K3_CLAMP, LOGRATIO_CLAMP,
};
use gradbus_worker::probe::{ExpOp, Phase, Probe};
use gradbus_worker::rollout::sample;
use gradbus_worker::task::{EOS, PAD};
use shim::Lib;

type F = *mut f32;
type C = *const f32;
type U = *const u32;

/// Equal bits, or both NaN.
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn assert_bitwise(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(same(g, w), "{what}[{i}]: kernel {g:e} ({:#010x}) CPU {w:e} ({:#010x})", g.to_bits(), w.to_bits());
    }
}

/// Everything the CPU loss shows its probe.
#[derive(Default)]
struct Record {
    logp: Vec<f32>,
    lr1: Vec<f32>,
    ratio: Vec<f32>,
    lr2: Vec<f32>,
    e2: Vec<f32>,
    evaluated: Vec<f32>,
    terms: Vec<f32>,
    d_lr1: Vec<f32>,
    d_lr2: Vec<f32>,
    dlogp: Vec<f32>,
}

impl Probe for Record {
    fn check(&mut self, op: &'static str, _: Option<usize>, phase: Phase, data: &[f32], _: &[usize]) {
        let slot = match (op, phase) {
            ("loss.logp", Phase::Forward) => &mut self.logp,
            ("loss.terms", Phase::Forward) => &mut self.terms,
            ("loss.ratio_exp", Phase::Backward) => &mut self.d_lr1,
            ("loss.kl_exp", Phase::Backward) => &mut self.d_lr2,
            ("loss.logp", Phase::Backward) => &mut self.dlogp,
            _ => return,
        };
        *slot = data.to_vec();
    }
    fn exp(&mut self, op: ExpOp<'_>) {
        let (input, output) =
            if op.op == "loss.ratio_exp" { (&mut self.lr1, &mut self.ratio) } else { (&mut self.lr2, &mut self.e2) };
        *input = op.input.to_vec();
        *output = op.output.to_vec();
        self.evaluated = op.evaluated.iter().map(|&e| e as u8 as f32).collect();
    }
}

/// One loss problem: logits (B, T, V) and the loss's inputs.
struct Case {
    b: usize,
    t: usize,
    v: usize,
    logits: Vec<f32>,
    targets: Vec<u32>,
    mask: Vec<f32>,
    adv: Vec<f32>,
    old_logp: Vec<f32>,
    ref_logp: Vec<f32>,
}

impl Case {
    fn inputs(&self) -> LossInputs<'_> {
        LossInputs {
            b: self.b,
            t: self.t,
            targets: &self.targets,
            mask: &self.mask,
            adv: &self.adv,
            old_logp: &self.old_logp,
            ref_logp: &self.ref_logp,
        }
    }
}

/// A random case: ordinary log-ratios, with gaps past exp's overflow planted at random positions
/// (response or masked), advantages of 0 now and then, and a NaN logit in some cases.
fn random_case(rng: &mut Rng, k: usize) -> Case {
    let (b, t, v) = ([1, 3, 8, 4][k % 4], [2, 5, 9, 1][k % 4], [4, 16, 7, 33][k % 4]);
    let n = b * t;
    let mut logits: Vec<f32> = (0..n * v).map(|_| 2.0 * rng.normal()).collect();
    if k % 5 == 4 {
        logits[rng.below(n * v)] = f32::NAN;
    }
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v) as u32).collect();
    let logp = gradbus_worker::loss::target_logp(&logits, &targets, v);
    let mask: Vec<f32> = (0..n).map(|i| if i % t == 0 || rng.below(4) == 0 { 0.0 } else { 1.0 }).collect();
    let adv: Vec<f32> = (0..b).map(|_| if rng.below(5) == 0 { 0.0 } else { rng.normal() }).collect();
    let gap = |rng: &mut Rng| match rng.below(12) {
        0 => 89.0 + 40.0 * rng.uniform(), // past ln(f32::MAX) = 88.72
        1 => -(89.0 + 40.0 * rng.uniform()),
        2 => 15.0 + 10.0 * rng.uniform(), // around the safe style's clamp at 20
        _ => 0.3 * rng.normal(),
    };
    let old_logp = logp.iter().map(|&l| l - gap(rng)).collect();
    let ref_logp = logp.iter().map(|&l| l + gap(rng)).collect();
    Case { b, t, v, logits, targets, mask, adv, old_logp, ref_logp }
}

/// What the kernels produce for a case.
#[derive(PartialEq)]
struct Out {
    logp: Vec<u32>,
    per_position: Vec<Vec<u32>>, // lr1, ratio, lr2, e2, evaluated, terms, d_lr1, d_lr2, dlogp
    stats: Vec<u32>,
    dlogits: Vec<u32>,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn floats(x: &[u32]) -> Vec<f32> {
    x.iter().map(|&v| f32::from_bits(v)).collect()
}

struct Kernels {
    softmax: &'static Lib,
    loss: &'static Lib,
}

impl Kernels {
    fn new() -> Option<Kernels> {
        Some(Kernels { softmax: shim::lib("softmax.cu")?, loss: shim::lib("loss.cu")? })
    }

    /// The backend's pipeline (kernels/src/cuda/mod.rs `loss_forward` / `loss_backward`): log-softmax-
    /// gather, per position, the one-thread reduce, backward per position, log-softmax backward.
    fn run(&self, cfg: &LossConfig, c: &Case, rev: bool) -> Out {
        type Gather = unsafe extern "C" fn(F, F, C, U, u64, u64);
        type GatherBack = unsafe extern "C" fn(F, C, C, C, U, u64, u64);
        #[rustfmt::skip]
        type Fwd = unsafe extern "C" fn(C, C, C, C, C, u64, u64, i32, f32, f32, f32, f32, f32,
                                        F, F, F, F, F, F, F, F, F, F, F, F);
        type Reduce = unsafe extern "C" fn(C, C, C, C, C, C, C, C, C, u64, f32, F);
        #[rustfmt::skip]
        type Bwd = unsafe extern "C" fn(C, C, u64, u64, i32, f32, f32, f32, f32, f32,
                                        C, C, C, C, C, C, C, F, F, F);
        // SAFETY: each type is the kernel's C signature (loss.cu, softmax.cu).
        let (gather, gather_back, fwd, reduce, bwd) = unsafe {
            (
                self.softmax.sym::<Gather>("logsoftmax_gather_forward_f32"),
                self.softmax.sym::<GatherBack>("logsoftmax_gather_backward_f32"),
                self.loss.sym::<Fwd>("loss_forward_f32"),
                self.loss.sym::<Reduce>("loss_reduce_f32"),
                self.loss.sym::<Bwd>("loss_backward_f32"),
            )
        };
        let (n, v) = (c.b * c.t, c.v);
        let (n64, t64, v64) = (n as u64, c.t as u64, v as u64);
        let safe = cfg.style == LossStyle::Safe;
        let (lim, lo, hi) = (if safe { LOGRATIO_CLAMP } else { f32::INFINITY }, 1.0 - cfg.clip, 1.0 + cfg.clip);
        // The per-position buffers: logp, lse, then loss.cu's 12 outputs, then d_lr1, d_lr2, dlogp.
        let mut buf = vec![vec![f32::NAN; n]; 17];
        let p: Vec<F> = buf.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let mut stats = vec![f32::NAN; LOSS_STATS];
        let sp = stats.as_mut_ptr();
        let mut dlogits = vec![0f32; n * v];
        let dp = dlogits.as_mut_ptr();
        let (lg, tg, ms, ad) = (c.logits.as_ptr(), c.targets.as_ptr(), c.mask.as_ptr(), c.adv.as_ptr());
        let (old, refp) = (c.old_logp.as_ptr(), c.ref_logp.as_ptr());
        let (kl, k3) = (cfg.kl_coef, K3_CLAMP);
        let el = |k: u64| cuda_grid::elementwise(k);
        let one: Launch = cuda_grid::single();
        // SAFETY (all launches): every buffer holds n floats (dlogits, logits n V; adv B; stats
        // LOSS_STATS), the kernels' contracts in loss.cu and softmax.cu.
        self.softmax.launch(el(n64).grid, el(n64).block, rev, &|| unsafe { gather(p[0], p[1], lg, tg, n64, v64) });
        let f = |i: usize| p[i];
        self.loss.launch(el(n64).grid, el(n64).block, rev, &|| unsafe {
            fwd(
                f(0),
                old,
                refp,
                ms,
                ad,
                n64,
                t64,
                safe as i32,
                lim,
                lo,
                hi,
                k3,
                kl,
                f(2),
                f(3),
                f(4),
                f(5),
                f(6),
                f(7),
                f(8),
                f(9),
                f(10),
                f(11),
                f(12),
                f(13),
            )
        });
        // lr1_raw 2, lr2_raw 3, lr1 4, ratio 5, lr2 6, e2 7, k3 8, k3c 9, evaluated 10, pgm 11,
        // klm 12, terms 13; d_lr1 14, d_lr2 15, dlogp 16.
        self.loss.launch(one.grid, one.block, rev, &|| unsafe {
            reduce(f(0), ms, f(2), f(3), f(5), f(9), f(10), f(11), f(12), n64, kl, sp)
        });
        self.loss.launch(el(n64).grid, el(n64).block, rev, &|| unsafe {
            bwd(
                ms,
                ad,
                n64,
                t64,
                safe as i32,
                lim,
                lo,
                hi,
                k3,
                kl,
                f(2),
                f(3),
                f(5),
                f(7),
                f(8),
                f(10),
                sp,
                f(14),
                f(15),
                f(16),
            )
        });
        let l = el(n64 * v64);
        self.softmax.launch(l.grid, l.block, rev, &|| unsafe { gather_back(dp, f(16), lg, f(1), tg, n64, v64) });
        Out {
            logp: bits(&buf[0]),
            per_position: [4, 5, 6, 7, 10, 13, 14, 15, 16].iter().map(|&i| bits(&buf[i])).collect(),
            stats: bits(&stats),
            dlogits: bits(&dlogits),
        }
    }
}

/// The stats in loss.cu's order.
fn stats_of(s: &LossStats) -> Vec<f32> {
    let denom = s.response_tokens.max(1) as f32;
    vec![
        s.loss,
        s.ratio,
        s.kl,
        s.max_ratio_logratio_response,
        s.max_ratio_logratio_masked,
        s.max_kl_logratio_response,
        s.max_kl_logratio_masked,
        s.max_logratio_response,
        s.max_logratio_masked,
        s.min_response_logp,
        s.response_tokens as f32,
        denom,
    ]
}

#[test]
fn the_loss_kernels_are_bitwise_the_cpu_loss_in_both_styles_overflow_included() {
    let Some(k) = Kernels::new() else { return };
    let mut rng = Rng::new(&[0x1055, 1]);
    let mut overflowed = [0usize; 2];
    for case in 0..80 {
        let c = random_case(&mut rng, case);
        for style in [LossStyle::Roll, LossStyle::Safe] {
            let cfg = LossConfig { style, clip: [0.2, 0.1, 0.3][case % 3], kl_coef: [0.01, 0.1][case % 2] };
            let inp = c.inputs();
            let mut rec = Record::default();
            let mut cache = LossCache::default();
            let st = loss_forward(&cfg, &c.logits, &inp, c.v, &mut cache, &mut rec);
            let mut want_dlogits = vec![0f32; c.logits.len()];
            loss_backward(&cfg, &c.logits, &inp, c.v, &cache, &mut want_dlogits, &mut rec);

            let got = k.run(&cfg, &c, false);
            assert!(got == k.run(&cfg, &c, true), "case {case} {style:?}: the result depends on the schedule");
            let what = |x: &str| format!("case {case} {style:?} (B {} T {} V {}): {x}", c.b, c.t, c.v);
            assert_bitwise(&floats(&got.logp), &rec.logp, &what("logp"));
            let want = [
                &rec.lr1,
                &rec.ratio,
                &rec.lr2,
                &rec.e2,
                &rec.evaluated,
                &rec.terms,
                &rec.d_lr1,
                &rec.d_lr2,
                &rec.dlogp,
            ];
            let names = ["lr1", "ratio", "lr2", "e2", "evaluated", "terms", "d_lr1", "d_lr2", "dlogp"];
            for ((g, w), name) in got.per_position.iter().zip(want).zip(names) {
                assert_bitwise(&floats(g), w, &what(name));
            }
            assert_bitwise(&floats(&got.stats), &stats_of(&st), &what("stats"));
            assert_bitwise(&floats(&got.dlogits), &want_dlogits, &what("dlogits"));
            // The seed case's mechanism, counted: a finite loss with a non-finite gradient.
            if st.loss.is_finite() && want_dlogits.iter().any(|x| !x.is_finite()) {
                overflowed[(style == LossStyle::Safe) as usize] += 1;
            }
        }
    }
    // The random gaps past 88.72 must have produced ROLL's failure (finite loss, NaN gradient) in
    // some cases, and the safe style must never produce it unless a logit is NaN itself.
    assert!(overflowed[0] > 5, "roll: finite loss with a non-finite gradient in only {} cases", overflowed[0]);
}

#[test]
fn the_seed_case_k3_overflow_at_a_masked_position_gives_the_cpus_finite_loss_and_nan_gradient() {
    let Some(k) = Kernels::new() else { return };
    // FIELD-NOTES' failing update: the stale rollout gave the token logp -0.89, the current policy
    // -91.3, the reference -2.5: a k3 gap of 88.8 > 88.72, at a masked position here.
    let (b, t, v) = (1, 2, 4);
    let logits = vec![0.3, -0.2, 0.1, 0.0, -0.5, 0.2, 0.4, 0.1];
    let targets = vec![1, 2];
    let logp = gradbus_worker::loss::target_logp(&logits, &targets, v);
    let c = Case {
        b,
        t,
        v,
        logits,
        targets,
        mask: vec![0.0, 1.0],
        adv: vec![1.0],
        old_logp: logp.clone(),
        ref_logp: vec![logp[0] + 88.8, logp[1]],
    };
    let cfg = LossConfig::default(); // roll
    let got = k.run(&cfg, &c, false);
    let stats = floats(&got.stats);
    assert!(stats[0].is_finite(), "loss {}", stats[0]);
    let dlogits = floats(&got.dlogits);
    assert!(dlogits[..v].iter().all(|x| x.is_nan()), "the masked position's row is NaN: {dlogits:?}");
    assert!(dlogits[v..].iter().all(|x| x.is_finite()), "the other row is untouched: {dlogits:?}");
    assert_eq!(f32::from_bits(got.per_position[3][0]), f32::INFINITY, "e2 = exp(88.8) overflowed");
    let safe = k.run(&LossConfig { style: LossStyle::Safe, ..cfg }, &c, false);
    assert!(floats(&safe.dlogits).iter().all(|x| x.is_finite()), "the safe style stays finite");
}

#[test]
fn the_sampler_picks_the_cpus_tokens_and_leaves_the_rng_where_the_cpu_does() {
    let Some(lib) = shim::lib("sample.cu") else { return };
    #[rustfmt::skip]
    type K = unsafe extern "C" fn(C, u64, u64, u64, *mut u32, u64, u64, u64, i32, u32, u32, f32, *mut u64, F);
    // SAFETY: K is sample_f32's C signature (sample.cu).
    let k: K = unsafe { lib.sym("sample_f32") };
    let mut rng = Rng::new(&[0x5a, 1]);
    for case in 0..60 {
        let (b, v, len) = ([1, 5, 64, 130][case % 4], [4, 16, 33][case % 3], 10);
        let (tn, pos) = (1 + case % 3, 2 + case % 7);
        let temperature = [1.0, 0.7, 2.5][case % 3];
        // Rows of tn positions; the sampler reads each sequence's last. Some rows peaked, some with
        // -inf (a masked logit), one NaN row now and then.
        let mut logits: Vec<f32> = (0..b * tn * v).map(|_| 3.0 * rng.normal()).collect();
        if case % 4 == 1 {
            let k = rng.below(logits.len());
            logits[k] = f32::NEG_INFINITY;
        }
        if case % 9 == 8 {
            let r = rng.below(b);
            logits[(r * tn + tn - 1) * v] = f32::NAN;
        }
        let seqs: Vec<u32> = (0..b * len).map(|_| [EOS, PAD, 3, 4, 5][rng.below(5)]).collect();
        let may_stop = case % 2 == 0;
        let state = Rng::new(&[0x5a, 2, case as u64]);
        // The CPU: worker/src/rollout.rs's loop body for one position.
        let (mut want, mut cpu_rng) = (seqs.clone(), state.clone());
        for i in 0..b {
            let prev = want[i * len + pos - 1];
            want[i * len + pos] = if may_stop && (prev == EOS || prev == PAD) {
                PAD
            } else {
                sample(&logits[(i * tn + tn - 1) * v..(i * tn + tn) * v], temperature, &mut cpu_rng)
            };
        }
        for rev in [false, true] {
            let (mut got, mut st, mut scratch) = (seqs.clone(), state.state().to_vec(), vec![0f32; b]);
            let (gp, rp, up) = (got.as_mut_ptr(), st.as_mut_ptr(), scratch.as_mut_ptr());
            let l = cuda_grid::one_block(cuda_grid::SAMPLE_THREADS);
            let (stride, off) = ((tn * v) as u64, ((tn - 1) * v) as u64);
            // SAFETY: logits (B, tn, V), seqs (B, len), 0 < pos < len, rng 4 words, scratch B.
            lib.launch(l.grid, l.block, rev, &|| unsafe {
                k(
                    logits.as_ptr(),
                    stride,
                    off,
                    v as u64,
                    gp,
                    b as u64,
                    len as u64,
                    pos as u64,
                    may_stop as i32,
                    EOS,
                    PAD,
                    temperature,
                    rp,
                    up,
                )
            });
            assert_eq!(got, want, "case {case} (B {b}, V {v}, rev {rev}): tokens");
            assert_eq!(st, cpu_rng.state().to_vec(), "case {case}: the RNG's state after the draws");
        }
    }
}
