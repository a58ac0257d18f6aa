//! Model ops: the sgemm matmul against its naive twin on fresh random shapes and values, and
//! behavioural checks of the ops that have no fast twin (causality, AdamW's first step, GELU values).

use gradbus_kernels::ops::*;
use gradbus_kernels::reference;
use gradbus_kernels::rng::Rng;

fn randn(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

/// Largest |a - b| relative to the largest |b| (the scale of the result).
fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        // Both sides sum k <= 300 products of N(0,1) values in a different order: each has a rounding
        // error below k * eps(f32) * sum|terms| ~ 300 * 6e-8 * 300 ~ 5e-3 worst case, ~1e-5 typical
        // against a result scale of ~sqrt(k) ~ 17. 1e-5 of the scale is a hundred times that typical
        // error, and a wrong index or stride gives errors of order 1.
        assert!((x - y).abs() <= 1e-5 * scale, "{what}[{i}]: fast {x} vs reference {y} (scale {scale})");
    }
}

#[test]
fn matmul_matches_reference() {
    let mut rng = Rng::new(&[7, 1]);
    for &(bt, c, oc) in &[(1, 1, 1), (5, 3, 7), (40, 64, 192), (33, 256, 64), (17, 64, 16)] {
        for with_bias in [false, true] {
            let inp = randn(&mut rng, bt * c);
            let w = randn(&mut rng, oc * c);
            let bias = randn(&mut rng, oc);
            let bias = with_bias.then_some(&bias[..]);
            let (mut fast, mut slow) = (vec![f32::NAN; bt * oc], vec![0.0; bt * oc]);
            matmul_forward(&mut fast, &inp, &w, bias, bt, c, oc);
            reference::matmul_forward(&mut slow, &inp, &w, bias, bt, c, oc);
            assert_close(&fast, &slow, "out");

            // Backward accumulates: start both from the same non-zero gradients.
            let dout = randn(&mut rng, bt * oc);
            let (dinp0, dw0, db0) = (randn(&mut rng, bt * c), randn(&mut rng, oc * c), randn(&mut rng, oc));
            let (mut fdi, mut fdw, mut fdb) = (dinp0.clone(), dw0.clone(), db0.clone());
            let (mut sdi, mut sdw, mut sdb) = (dinp0, dw0, db0);
            matmul_backward(&mut fdi, &mut fdw, with_bias.then_some(&mut fdb[..]), &dout, &inp, &w, bt, c, oc);
            reference::matmul_backward(
                &mut sdi,
                &mut sdw,
                with_bias.then_some(&mut sdb[..]),
                &dout,
                &inp,
                &w,
                bt,
                c,
                oc,
            );
            assert_close(&fdi, &sdi, "dinp");
            assert_close(&fdw, &sdw, "dweight");
            assert_close(&fdb, &sdb, "dbias");
        }
    }
}

/// out = inp @ weight^T + bias as the kernel's contract says: one fma chain per element, in order.
fn fma_chain_forward(inp: &[f32], w: &[f32], bias: Option<&[f32]>, bt: usize, c: usize, oc: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; bt * oc];
    for i in 0..bt {
        for o in 0..oc {
            let init = bias.map_or(0.0, |b| b[o]);
            out[i * oc + o] = (0..c).fold(init, |acc, p| inp[i * c + p].mul_add(w[o * c + p], acc));
        }
    }
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn gemm_rows_are_one_fma_chain_each() {
    // Bitwise equal to a scalar fma loop at every shape (whole tiles, partial tiles, single columns,
    // inner dimensions across several blocks): the kernel's bits do not depend on tiling, blocking or
    // the instruction set.
    let mut rng = Rng::new(&[7, 5]);
    for &(bt, c, oc) in
        &[(1, 1, 1), (5, 3, 7), (36, 64, 16), (36, 256, 768), (36, 1024, 256), (13, 300, 100), (50, 17, 83)]
    {
        let inp = randn(&mut rng, bt * c);
        let w = randn(&mut rng, oc * c);
        let bias = randn(&mut rng, oc);
        let mut out = vec![f32::NAN; bt * oc];
        matmul_forward(&mut out, &inp, &w, Some(&bias), bt, c, oc);
        assert_eq!(bits(&out), bits(&fma_chain_forward(&inp, &w, Some(&bias), bt, c, oc)), "forward {bt}x{c}x{oc}");

        let dout = randn(&mut rng, bt * oc);
        let (dinp0, dw0) = (randn(&mut rng, bt * c), randn(&mut rng, oc * c));
        let (mut dinp, mut dw) = (dinp0.clone(), dw0.clone());
        matmul_backward(&mut dinp, &mut dw, None, &dout, &inp, &w, bt, c, oc);
        for i in 0..bt {
            for p in 0..c {
                let want = (0..oc).fold(dinp0[i * c + p], |acc, o| dout[i * oc + o].mul_add(w[o * c + p], acc));
                assert_eq!(dinp[i * c + p].to_bits(), want.to_bits(), "dinp[{i}, {p}] at {bt}x{c}x{oc}");
            }
        }
        for o in 0..oc {
            for p in 0..c {
                let want = (0..bt).fold(dw0[o * c + p], |acc, i| dout[i * oc + o].mul_add(inp[i * c + p], acc));
                assert_eq!(dw[o * c + p].to_bits(), want.to_bits(), "dweight[{o}, {p}] at {bt}x{c}x{oc}");
            }
        }
    }
}

#[test]
fn matmul_rows_do_not_depend_on_how_many_rows_run_together() {
    // What the KV-cached forward relies on: one row alone gives the bits it has among 36.
    let mut rng = Rng::new(&[7, 6]);
    let (bt, c, oc) = (36, 256, 768);
    let (inp, w, bias) = (randn(&mut rng, bt * c), randn(&mut rng, oc * c), randn(&mut rng, oc));
    let mut all = vec![0.0; bt * oc];
    matmul_forward(&mut all, &inp, &w, Some(&bias), bt, c, oc);
    for (i, rows) in [(0, 1), (7, 1), (35, 1), (3, 16), (20, 16)] {
        let mut part = vec![0.0; rows * oc];
        matmul_forward(&mut part, &inp[i * c..(i + rows) * c], &w, Some(&bias), rows, c, oc);
        assert_eq!(bits(&part), bits(&all[i * oc..(i + rows) * oc]), "rows {i}..{}", i + rows);
    }
}

#[test]
fn matmul_is_bitwise_repeatable() {
    let mut rng = Rng::new(&[7, 2]);
    let (bt, c, oc) = (640, 64, 256);
    let (inp, w) = (randn(&mut rng, bt * c), randn(&mut rng, oc * c));
    let mut a = vec![0.0; bt * oc];
    let mut b = vec![0.0; bt * oc];
    matmul_forward(&mut a, &inp, &w, None, bt, c, oc);
    matmul_forward(&mut b, &inp, &w, None, bt, c, oc);
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn attention_is_causal_and_rows_sum_to_one() {
    let (b, t, c, nh) = (2, 5, 8, 2);
    let mut rng = Rng::new(&[7, 3]);
    let mut inp = randn(&mut rng, b * t * 3 * c);
    let mut out = vec![0.0; b * t * c];
    let mut att = vec![0.0; b * nh * t * t];
    attention_forward(&mut out, &mut att, &inp, b, t, c, nh);
    for row in att.chunks(t) {
        let s: f32 = row.iter().sum();
        assert!((s - 1.0).abs() < 1e-6, "softmax row sums to {s}");
    }
    for (i, row) in att.chunks(t).enumerate() {
        let t1 = i % t;
        assert!(row[t1 + 1..].iter().all(|&a| a == 0.0), "no weight on the future");
    }
    // Changing the last position of sample 0 leaves every earlier output unchanged.
    let before = out.clone();
    for x in &mut inp[(t - 1) * 3 * c..t * 3 * c] {
        *x += 1.0;
    }
    attention_forward(&mut out, &mut att, &inp, b, t, c, nh);
    assert_eq!(before[..(t - 1) * c], out[..(t - 1) * c]);
    assert_ne!(before[(t - 1) * c..t * c], out[(t - 1) * c..t * c]);
}

#[test]
fn attention_backward_spreads_nan_through_masked_weights_like_pytorch() {
    // A NaN in the output gradient at position 0 reaches the VALUE gradient of later positions through
    // att[0, t2 > 0] = 0 (0 * NaN = NaN), as the dense `att @ v` backward does in PyTorch.
    let (b, t, c, nh) = (1, 3, 4, 1);
    let mut rng = Rng::new(&[7, 4]);
    let inp = randn(&mut rng, b * t * 3 * c);
    let mut out = vec![0.0; b * t * c];
    let mut att = vec![0.0; b * nh * t * t];
    attention_forward(&mut out, &mut att, &inp, b, t, c, nh);
    let mut dout = vec![0.0; b * t * c];
    dout[0] = f32::NAN;
    let mut dinp = vec![0.0; b * t * 3 * c];
    attention_backward(&mut dinp, &dout, &inp, &att, b, t, c, nh);
    let dv_last = &dinp[2 * 3 * c + 2 * c..3 * 3 * c];
    assert!(dv_last[0].is_nan(), "dv of the last position is NaN");
    // The masked score gradients are zeroed: q of the last position does not see position 0's NaN.
    let dq_last = &dinp[2 * 3 * c..2 * 3 * c + c];
    assert!(dq_last.iter().all(|x| x.is_finite()));
}

#[test]
fn gelu_matches_known_values() {
    // PyTorch: gelu(x, approximate="tanh") at -3, -1, 0, 0.5, 2.
    let x = [-3.0f32, -1.0, 0.0, 0.5, 2.0];
    let want = [-0.003_637_433f32, -0.158_808, 0.0, 0.345_714, 1.954_597_7];
    let mut out = [0.0; 5];
    gelu_forward(&mut out, &x, 5);
    for (o, w) in out.iter().zip(want) {
        assert!((o - w).abs() < 1e-6, "gelu {o} vs {w}");
    }
}

#[test]
fn adamw_first_step_moves_each_weight_by_lr_against_its_gradient() {
    // At t = 1 the bias-corrected step is g / (|g| + eps) ~ sign(g); weight decay adds lr * wd * p.
    let mut p = vec![1.0f32, -2.0, 0.5];
    let g = [0.3f32, -0.01, 0.0];
    let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
    adamw_update(&mut p, &g, &mut m, &mut v, 0.1, 0.9, 0.999, 1e-8, 0.0, 1);
    assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] + 1.9).abs() < 1e-5 && p[2] == 0.5, "{p:?}");
    let mut q = vec![1.0f32];
    let (mut m, mut v) = (vec![0.0], vec![0.0]);
    adamw_update(&mut q, &[0.0], &mut m, &mut v, 0.1, 0.9, 0.999, 1e-8, 0.5, 1);
    assert!((q[0] - 0.95).abs() < 1e-7, "decoupled decay: {}", q[0]);
}

#[test]
fn logsoftmax_gather_gradient_sums_to_zero_and_is_one_minus_p_at_target() {
    let logits = [1.0f32, 2.0, 3.0, -1.0];
    let (mut logp, mut lse) = ([0.0f32], [0.0f32]);
    logsoftmax_gather_forward(&mut logp, &mut lse, &logits, &[2], 1, 4);
    let z: f32 = logits.iter().map(|x| x.exp()).sum();
    assert!((logp[0] - (3.0 - z.ln())).abs() < 1e-6);
    let mut d = [0.0f32; 4];
    logsoftmax_gather_backward(&mut d, &[1.0], &logits, &lse, &[2], 1, 4);
    assert!((d[2] - (1.0 - 3f32.exp() / z)).abs() < 1e-6);
    assert!(d.iter().sum::<f32>().abs() < 1e-6);
}

#[test]
fn gelu_tanh_through_exp_stays_within_a_few_ulps_of_libm_and_keeps_limits() {
    let mut rng = Rng::new(&[7, 5]);
    let x: Vec<f32> =
        (0..10_000).map(|i| if i < 20 { [-1e30, 1e30, -90.0, 90.0][i % 4] } else { 6.0 * rng.normal() }).collect();
    let mut out = vec![0.0; x.len()];
    gelu_forward(&mut out, &x, x.len());
    for (&xi, &o) in x.iter().zip(&out) {
        let u = 0.797_884_6f64 * (xi as f64 + 0.044_715 * (xi as f64).powi(3));
        let want = 0.5 * xi as f64 * (1.0 + u.tanh());
        assert!((o as f64 - want).abs() <= 1e-6 * (xi as f64).abs().max(1.0), "gelu({xi}) = {o}, want {want}");
    }
    let mut nan = [0.0f32];
    gelu_forward(&mut nan, &[f32::NAN], 1);
    assert!(nan[0].is_nan());
}

#[test]
fn adamw_matches_pytorch_over_three_steps() {
    // torch 2.15 `optim.AdamW(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
    // foreach=False)` on these parameters and gradients. Same formula in f32: a few ulps apart.
    let mut p = vec![1.0f32, -2.0, 0.5, 0.0];
    let grads = [[0.3f32, -0.01, 0.0, 1e-3], [-0.2, 0.05, 0.1, 1e-3], [0.1, 0.0, -0.3, -2.0]];
    let (mut m, mut v) = (vec![0.0; 4], vec![0.0; 4]);
    for (t, g) in grads.iter().enumerate() {
        adamw_update(&mut p, g, &mut m, &mut v, 0.01, 0.9, 0.999, 1e-8, 0.1, t as u64 + 1);
    }
    let want = [0.982_794_17f32, -1.994_629, 0.495_31, -0.013_587_138];
    for (x, w) in p.iter().zip(want) {
        assert!((x - w).abs() <= 1e-6 * w.abs().max(1e-2), "adamw {x} vs PyTorch {w}");
    }
}
