//! The model's gradients against finite differences of an independent f64 forward (model + safe
//! loss), the backward's readiness contract, bitwise repeatability, and (ignored: a benchmark, not a
//! test) the forward+backward time of the calibration model.

use gradbus_collectives::{Layout, ParamGrads};
use gradbus_kernels::backend::{Backend, Cpu};
use gradbus_kernels::rng::Rng;
use gradbus_worker::loss::{rl_loss_host, target_logp, LossConfig, LossInputs, LossStyle};
use gradbus_worker::model::{param_specs, Activations, Gpt, GptConfig, NoProbe};

/// A small model with every path exercised: 2 blocks, 2 heads, T = max_seq so every wpe row is used.
fn small() -> GptConfig {
    GptConfig { vocab: 7, max_seq: 5, channels: 8, heads: 2, layers: 2 }
}

/// Weights far from init so no gradient is tiny: N(0, 0.3), LN weights 1 + N(0, 0.1), biases N(0, 0.1).
fn random_params(cfg: &GptConfig, gpt: &Gpt, len: usize, rng: &mut Rng) -> Vec<f32> {
    let mut params = vec![0.0f32; len];
    for (p, spec) in param_specs(cfg).iter().enumerate() {
        for x in &mut params[gpt.param_range(p)] {
            *x = if spec.name.contains("ln") && spec.name.ends_with("weight") {
                1.0 + 0.1 * rng.normal()
            } else if spec.name.ends_with("bias") {
                0.1 * rng.normal()
            } else {
                0.3 * rng.normal()
            };
        }
    }
    params
}

/// A batch: random tokens, mask 0 at position 0 and at a random padded tail, random advantages,
/// old/ref log-probs near the current ones so the PPO ratios straddle the clip range.
struct Data {
    b: usize,
    t: usize,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    mask: Vec<f32>,
    adv: Vec<f32>,
    old: Vec<f32>,
    reff: Vec<f32>,
}

impl Data {
    fn inputs(&self) -> LossInputs<'_> {
        LossInputs {
            b: self.b,
            t: self.t,
            targets: &self.targets,
            mask: &self.mask,
            adv: &self.adv,
            old_logp: &self.old,
            ref_logp: &self.reff,
        }
    }
}

fn data(cfg: &GptConfig, gpt: &Gpt, params: &[f32], b: usize, t: usize, rng: &mut Rng) -> Data {
    let v = cfg.vocab;
    let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(v) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|_| rng.below(v) as u32).collect();
    let mut mask = vec![1.0f32; b * t];
    for s in 0..b {
        mask[s * t] = 0.0;
        let live = 2 + rng.below(t - 1);
        for x in &mut mask[s * t + live.min(t)..(s + 1) * t] {
            *x = 0.0;
        }
    }
    let adv: Vec<f32> = (0..b).map(|_| rng.normal()).collect();
    let mut acts = Activations::new(&Cpu, cfg, b, t);
    let logp =
        target_logp(&Cpu, gpt.forward(&Cpu, &params.to_vec(), &tokens, b, t, &mut acts, &mut NoProbe), &targets, v);
    let old = logp.iter().map(|&l| l + 0.15 * rng.normal()).collect();
    let reff = logp.iter().map(|&l| l + 0.5 * rng.normal()).collect();
    Data { b, t, tokens, targets, mask, adv, old, reff }
}

/// Model + safe loss in f64, written independently of the f32 code (straight loops, PyTorch's
/// definitions), on the same flat parameter layout.
fn loss_f64(cfg: &GptConfig, gpt: &Gpt, params: &[f64], d: &Data, lc: &LossConfig) -> f64 {
    let (v, c, nh, nl) = (cfg.vocab, cfg.channels, cfg.heads, cfg.layers);
    let (b, t) = (d.b, d.t);
    let n = b * t;
    let p = |i: usize| &params[gpt.param_range(i)];
    let linear = |x: &[f64], cin: usize, w: &[f64], bias: Option<&[f64]>, cout: usize| -> Vec<f64> {
        let mut y = vec![0.0; n * cout];
        for r in 0..n {
            for o in 0..cout {
                let dot: f64 = (0..cin).map(|k| x[r * cin + k] * w[o * cin + k]).sum();
                y[r * cout + o] = dot + bias.map_or(0.0, |bb| bb[o]);
            }
        }
        y
    };
    let layernorm = |x: &[f64], w: &[f64], bb: &[f64]| -> Vec<f64> {
        let mut y = vec![0.0; n * c];
        for r in 0..n {
            let row = &x[r * c..(r + 1) * c];
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|z| (z - mean).powi(2)).sum::<f64>() / c as f64;
            for j in 0..c {
                y[r * c + j] = (row[j] - mean) / (var + 1e-5f32 as f64).sqrt() * w[j] + bb[j];
            }
        }
        y
    };
    let mut x = vec![0.0; n * c];
    for r in 0..n {
        for j in 0..c {
            x[r * c + j] = p(0)[d.tokens[r] as usize * c + j] + p(1)[(r % t) * c + j];
        }
    }
    let hs = c / nh;
    for l in 0..nl {
        let q = |k: usize| p(2 + 12 * l + k);
        let h = layernorm(&x, q(0), q(1));
        let qkv = linear(&h, c, q(2), Some(q(3)), 3 * c);
        let mut y = vec![0.0; n * c];
        for s in 0..b {
            for hd in 0..nh {
                for t1 in 0..t {
                    let at = |tt: usize, part: usize, i: usize| qkv[(s * t + tt) * 3 * c + part * c + hd * hs + i];
                    let scores: Vec<f64> = (0..=t1)
                        .map(|t2| (0..hs).map(|i| at(t1, 0, i) * at(t2, 1, i)).sum::<f64>() / (hs as f64).sqrt())
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                    for (t2, sc) in scores.iter().enumerate() {
                        for i in 0..hs {
                            y[(s * t + t1) * c + hd * hs + i] += (sc - mx).exp() / z * at(t2, 2, i);
                        }
                    }
                }
            }
        }
        let proj = linear(&y, c, q(4), Some(q(5)), c);
        x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        let h = layernorm(&x, q(6), q(7));
        let mut f = linear(&h, c, q(8), Some(q(9)), 4 * c);
        for z in &mut f {
            let u = (2.0 / std::f64::consts::PI).sqrt() * (*z + 0.044715 * z.powi(3));
            *z = 0.5 * *z * (1.0 + u.tanh());
        }
        let proj = linear(&f, 4 * c, q(10), Some(q(11)), c);
        x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
    }
    let base = 2 + 12 * nl;
    let h = layernorm(&x, p(base), p(base + 1));
    let logits = linear(&h, c, p(base + 2), None, v);
    assert_eq!(lc.style, LossStyle::Safe);
    let (mut total, mut count) = (0.0, 0.0);
    for r in 0..n {
        if d.mask[r] == 0.0 {
            continue;
        }
        let row = &logits[r * v..(r + 1) * v];
        let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let logp = row[d.targets[r] as usize] - mx - row.iter().map(|z| (z - mx).exp()).sum::<f64>().ln();
        let a = d.adv[r / t] as f64;
        let ratio = (logp - d.old[r] as f64).clamp(-20.0, 20.0).exp();
        let eps = lc.clip as f64;
        let pg = -(ratio * a).min(ratio.clamp(1.0 - eps, 1.0 + eps) * a);
        let lr = (d.reff[r] as f64 - logp).clamp(-20.0, 20.0);
        let k3 = (lr.exp() - 1.0 - lr).clamp(-10.0, 10.0);
        total += pg + lc.kl_coef as f64 * k3;
        count += 1.0;
    }
    total / count
}

#[test]
fn every_parameter_gradient_matches_f64_central_differences() {
    let cfg = small();
    let layout = Layout::new(&param_specs(&cfg), 0);
    let gpt = Gpt::new(&cfg, &layout);
    let mut rng = Rng::new(&[42, 1]);
    let params = random_params(&cfg, &gpt, layout.len, &mut rng);
    let (b, t) = (3, cfg.max_seq);
    let d = data(&cfg, &gpt, &params, b, t, &mut rng);
    let lc = LossConfig { style: LossStyle::Safe, clip: 0.2, kl_coef: 0.5 }; // a large kl_coef: k3 matters

    let mut acts = Activations::new(&Cpu, &cfg, b, t);
    let logits = gpt.forward(&Cpu, &params, &d.tokens, b, t, &mut acts, &mut NoProbe).to_vec();
    let (stats, dlogits) = rl_loss_host(&lc, &logits, &d.inputs(), &mut NoProbe);
    let mut grads = vec![0.0f32; layout.len];
    gpt.backward(&Cpu, &params, &mut acts, &dlogits[..], &mut ParamGrads::new(&mut grads, &layout), &mut NoProbe, None);

    let p64: Vec<f64> = params.iter().map(|&x| x as f64).collect();
    let l64 = loss_f64(&cfg, &gpt, &p64, &d, &lc);
    // The f32 forward and the f64 one are the same function: they agree to f32 rounding.
    assert!((stats.loss as f64 - l64).abs() < 1e-5, "loss f32 {} vs f64 {l64}", stats.loss);

    // h = 1e-4: the truncation error of the central difference is ~h^2 |f'''| ~ 1e-8 and the f64
    // rounding error ~1e-16 / h ~ 1e-12, so `fd` is exact to ~1e-8 and the error is all the f32
    // analytic gradient's: relative ~1e-6..1e-5 of the tensor's gradient scale after a few dozen
    // f32 ops. The tolerance, 1e-4 |fd| + 1e-5 * (largest |g| of the tensor), leaves ~10x margin
    // for that and is still far below a wrong gradient (a wrong sign, index or missing term is off by
    // O(|fd|)). Measured worst ratio of error to tolerance is printed.
    let h = 1e-4;
    let mut worst: f64 = 0.0;
    for (pi, spec) in param_specs(&cfg).iter().enumerate() {
        let range = gpt.param_range(pi);
        let g = &grads[range.clone()];
        let scale = g.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
        assert!(scale > 1e-6, "{}: gradient is all zero", spec.name);
        let mut nontrivial = 0;
        for _ in 0..6 {
            let i = rng.below(range.len());
            let mut pp = p64.clone();
            pp[range.start + i] += h;
            let up = loss_f64(&cfg, &gpt, &pp, &d, &lc);
            pp[range.start + i] -= 2.0 * h;
            let down = loss_f64(&cfg, &gpt, &pp, &d, &lc);
            let fd = (up - down) / (2.0 * h);
            let err = (g[i] as f64 - fd).abs();
            let tol = 1e-4 * fd.abs() + 1e-5 * scale;
            worst = worst.max(err / tol);
            assert!(err <= tol, "{}[{i}]: analytic {} vs finite difference {fd} (tol {tol:e})", spec.name, g[i]);
            nontrivial += (fd.abs() > 1e-3 * scale) as usize;
        }
        assert!(nontrivial > 0, "{}: no sampled element has a non-trivial gradient", spec.name);
    }
    println!("worst error / tolerance: {worst:.3}");
}

#[test]
fn backward_reports_each_parameter_once_descending_and_final() {
    let cfg = small();
    let layout = Layout::new(&param_specs(&cfg), 256);
    let gpt = Gpt::new(&cfg, &layout);
    let mut rng = Rng::new(&[42, 2]);
    let params = random_params(&cfg, &gpt, layout.len, &mut rng);
    let d = data(&cfg, &gpt, &params, 2, 4, &mut rng);
    let mut acts = Activations::new(&Cpu, &cfg, 2, 5);
    let logits = gpt.forward(&Cpu, &params, &d.tokens, 2, 4, &mut acts, &mut NoProbe).to_vec();
    let lc = LossConfig { style: LossStyle::Safe, ..LossConfig::default() };
    let (_, dlogits) = rl_loss_host(&lc, &logits, &d.inputs(), &mut NoProbe);

    // Record the order; snapshots of each gradient at its report must equal the final gradient.
    struct Snap<'a> {
        gpt: &'a Gpt,
        snaps: Vec<(usize, Vec<f32>)>,
    }
    impl gradbus_worker::model::Probe for Snap<'_> {
        fn grad<B: Backend>(&mut self, be: &B, p: usize, data: B::View<'_>) {
            let data = be.to_host(data);
            assert_eq!(data.len(), self.gpt.param_range(p).len());
            self.snaps.push((p, data.to_vec()));
        }
    }
    let mut grads = vec![0.0f32; layout.len];
    let mut snap = Snap { gpt: &gpt, snaps: Vec::new() };
    let mut g = ParamGrads::new(&mut grads, &layout);
    gpt.backward(&Cpu, &params, &mut acts, &dlogits[..], &mut g, &mut snap, None);
    let order = g.released().to_vec();
    let n = gpt.num_params();
    assert_eq!(order, (0..n).rev().collect::<Vec<_>>());
    for (p, s) in &snap.snaps {
        assert_eq!(&grads[gpt.param_range(*p)], &s[..], "parameter {p} changed after it was reported");
    }
}

#[test]
fn forward_backward_is_bitwise_repeatable_and_accumulates() {
    let cfg = GptConfig::default();
    let layout = Layout::new(&param_specs(&cfg), 1 << 16);
    let gpt = Gpt::new(&cfg, &layout);
    let mut params = vec![0.0f32; layout.len];
    gpt.init(&mut params, &mut Rng::new(&[3, 1]));
    let mut rng = Rng::new(&[3, 2]);
    let (b, t) = (8, 10);
    let d = data(&cfg, &gpt, &params, b, t, &mut rng);
    let mut acts = Activations::new(&Cpu, &cfg, b, t);
    let mut run = |grads: &mut Vec<f32>| {
        let logits = gpt.forward(&Cpu, &params, &d.tokens, b, t, &mut acts, &mut NoProbe).to_vec();
        let (st, dl) = rl_loss_host(&LossConfig::default(), &logits, &d.inputs(), &mut NoProbe);
        gpt.backward(&Cpu, &params, &mut acts, &dl[..], &mut ParamGrads::new(grads, &layout), &mut NoProbe, None);
        st.loss
    };
    let (mut g1, mut g2) = (vec![0.0; layout.len], vec![0.0; layout.len]);
    let (l1, l2) = (run(&mut g1), run(&mut g2));
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(g1.iter().any(|&x| x != 0.0));
    // A second backward onto the same buffer adds to it: about twice the first (not bitwise: the
    // per-row accumulations of layer norm and the biases round differently on a non-zero start).
    run(&mut g2);
    let scale = g1.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(g1.iter().zip(&g2).all(|(a, b)| (2.0 * a - b).abs() <= 1e-5 * scale));
}

/// Benchmark (prints, asserts nothing): `cargo test -p gradbus-worker --release -- --ignored bench`.
#[test]
#[ignore]
fn bench_forward_backward_calibration_model_b64_t10() {
    let cfg = GptConfig::default();
    let layout = Layout::new(&param_specs(&cfg), 1 << 16);
    let gpt = Gpt::new(&cfg, &layout);
    let mut params = vec![0.0f32; layout.len];
    gpt.init(&mut params, &mut Rng::new(&[3, 1]));
    let (b, t) = (64, 10);
    let d = data(&cfg, &gpt, &params, b, t, &mut Rng::new(&[3, 3]));
    let mut acts = Activations::new(&Cpu, &cfg, b, t);
    let mut grads = vec![0.0f32; layout.len];
    let (mut fwd, mut total) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..30 {
        let t0 = std::time::Instant::now();
        let logits = gpt.forward(&Cpu, &params, &d.tokens, b, t, &mut acts, &mut NoProbe).to_vec();
        let t1 = t0.elapsed().as_secs_f64();
        let (_, dl) = rl_loss_host(&LossConfig::default(), &logits, &d.inputs(), &mut NoProbe);
        grads.fill(0.0);
        gpt.backward(&Cpu, &params, &mut acts, &dl[..], &mut ParamGrads::new(&mut grads, &layout), &mut NoProbe, None);
        fwd = fwd.min(t1);
        total = total.min(t0.elapsed().as_secs_f64());
    }
    println!(
        "B={b} T={t}: forward {:.2} ms, forward+loss+backward {:.2} ms (best of 30), {:.0} tokens/s",
        fwd * 1e3,
        total * 1e3,
        (b * t) as f64 / total
    );
}
