//! Causal multi-head self-attention on a fused (B, T, 3C) q|k|v input: per head,
//! `att = softmax(mask(q k^T / sqrt(hs)))`, `out = att v`, hs = C / NH.
//!
//! Invariants: the arithmetic mirrors the dense PyTorch formulation (`masked_fill(-inf)`, `softmax`,
//! `att @ v`): masked weights are exactly 0 and still take part in the products, so a NaN in a later
//! value (forward) or in an earlier output gradient (backward) spreads through `0 * NaN = NaN` exactly
//! as it does in PyTorch; the gradient of a masked score is 0 (masked_fill's backward). Only `att` is
//! kept for backward; there is no separate pre-softmax buffer.

/// out: (B, T, C), att: (B, NH, T, T), inp: (B, T, 3C) laid out as q | k | v, each split in NH heads.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(out: &mut [f32], att: &mut [f32], inp: &[f32], b: usize, t: usize, c: usize, nh: usize) {
    attention_forward_rows(out, att, inp, t, b, 0, t, c, nh)
}

/// The query positions `t0..t` of the causal attention over positions `0..t`, for a KV cache: the
/// q|k|v row of sequence `bi`, position `t2` is `inp[(bi * stride + t2) * 3C..]` (a cache passes its
/// capacity as `stride`). Each row's arithmetic is `attention_forward`'s (which is this with `t0 = 0`,
/// `stride = t`); a row computed here over `t` positions and there over more differs only by masked
/// weights of exactly 0, whose `+ 0` and `0 * v` change no finite value.
/// out: (B, t - t0, C), att: (B, NH, t - t0, t), inp: (B, stride, 3C), t <= stride.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_rows(
    out: &mut [f32],
    att: &mut [f32],
    inp: &[f32],
    stride: usize,
    b: usize,
    t0: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    assert!(t0 <= t && t <= stride, "attention_forward_rows: rows {t0}..{t} of {stride}");
    let hs = c / nh;
    let c3 = 3 * c;
    let tq = t - t0;
    let scale = 1.0 / (hs as f32).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            for r in 0..tq {
                let t1 = t0 + r;
                let q = &inp[(bi * stride + t1) * c3 + h * hs..][..hs];
                let row = &mut att[((bi * nh + h) * tq + r) * t..][..t];
                let mut maxval = f32::NEG_INFINITY;
                for (t2, a) in row.iter_mut().enumerate() {
                    if t2 > t1 {
                        *a = f32::NEG_INFINITY;
                        continue;
                    }
                    let k = &inp[(bi * stride + t2) * c3 + c + h * hs..][..hs];
                    let dot: f32 = q.iter().zip(k).map(|(x, y)| x * y).sum();
                    *a = dot * scale;
                    maxval = maxval.max(*a);
                }
                let mut sum = 0.0f32;
                for a in row.iter_mut() {
                    *a = (*a - maxval).exp(); // exp(-inf) = 0 at masked places
                    sum += *a;
                }
                for a in row.iter_mut() {
                    *a /= sum;
                }
                let o = &mut out[(bi * tq + r) * c + h * hs..][..hs];
                o.fill(0.0);
                for (t2, &a) in row.iter().enumerate() {
                    let v = &inp[(bi * stride + t2) * c3 + 2 * c + h * hs..][..hs];
                    for (oi, &vi) in o.iter_mut().zip(v) {
                        *oi += a * vi;
                    }
                }
            }
        }
    }
}

/// dinp: (B, T, 3C) +=, dout: (B, T, C), inp: (B, T, 3C), att: (B, NH, T, T).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let hs = c / nh;
    let c3 = 3 * c;
    let scale = 1.0 / (hs as f32).sqrt();
    let mut datt = vec![0.0f32; t];
    for bi in 0..b {
        for h in 0..nh {
            for t1 in 0..t {
                let row = &att[((bi * nh + h) * t + t1) * t..][..t];
                let d = &dout[(bi * t + t1) * c + h * hs..][..hs];
                // out = att @ v: datt = dout v^T, dv += att^T dout (dense, masked weights included).
                for t2 in 0..t {
                    let v = &inp[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    datt[t2] = d.iter().zip(v).map(|(x, y)| x * y).sum();
                    let dv = &mut dinp[(bi * t + t2) * c3 + 2 * c + h * hs..][..hs];
                    for (dvi, &di) in dv.iter_mut().zip(d) {
                        *dvi += row[t2] * di;
                    }
                }
                // softmax: dscore = att * (datt - sum(att * datt)); masked_fill: 0 where masked.
                let dot: f32 = row.iter().zip(&datt).map(|(a, g)| a * g).sum();
                for t2 in 0..t {
                    let dscore = if t2 > t1 { 0.0 } else { row[t2] * (datt[t2] - dot) * scale };
                    // scores = q k^T: dq += dscore k, dk += dscore q (dense).
                    let (qi, ki) = ((bi * t + t1) * c3 + h * hs, (bi * t + t2) * c3 + c + h * hs);
                    for i in 0..hs {
                        dinp[qi + i] += dscore * inp[ki + i];
                        dinp[ki + i] += dscore * inp[qi + i];
                    }
                }
            }
        }
    }
}
