//! Naive twins of the fast kernels: the plainest code that is obviously right, for the tests that
//! compare each fast kernel against its twin on fresh random inputs.

use crate::checksum::{fold, FNV_OFFSET, FNV_PRIME, LANES};
use crate::health::Health;

/// Sequential health scan: one element at a time, one f64 accumulator.
pub fn health_scan(x: &[f32]) -> Health {
    let mut h = Health::default();
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            h.nan += 1;
        } else if v.is_infinite() {
            h.inf += 1;
        } else {
            h.sumsq += (v as f64) * (v as f64);
            continue;
        }
        h.first_bad.get_or_insert(i as u64);
    }
    h
}

/// Rank-ordered sum of `srcs` into a new vector, each element added by the reduce's defined add
/// (`reduce::add`: which NaN a NaN + NaN keeps).
pub fn rank_ordered_sum(srcs: &[&[f32]]) -> Vec<f32> {
    let mut out = srcs[0].to_vec();
    let len = out.len();
    for s in &srcs[1..] {
        for (i, (o, &v)) in out.iter_mut().zip(s.iter()).enumerate() {
            *o = crate::reduce::add(*o, v, i, len);
        }
    }
    out
}

/// Naive twin of `ops::matmul_forward`: out = inp @ weight^T + bias, one dot product per output.
/// out: (BT, OC), inp: (BT, C), weight: (OC, C), bias: (OC) or none.
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    bt: usize,
    c: usize,
    oc: usize,
) {
    for i in 0..bt {
        for o in 0..oc {
            let mut acc = bias.map_or(0.0, |b| b[o]);
            for k in 0..c {
                acc += inp[i * c + k] * weight[o * c + k];
            }
            out[i * oc + o] = acc;
        }
    }
}

/// Naive twin of `ops::matmul_backward` (accumulates).
/// dinp: (BT, C), dweight: (OC, C), dbias: (OC) or none, dout: (BT, OC), inp: (BT, C), weight: (OC, C).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    bt: usize,
    c: usize,
    oc: usize,
) {
    for i in 0..bt {
        for k in 0..c {
            let mut acc = 0.0;
            for o in 0..oc {
                acc += dout[i * oc + o] * weight[o * c + k];
            }
            dinp[i * c + k] += acc;
        }
    }
    for o in 0..oc {
        for k in 0..c {
            let mut acc = 0.0;
            for i in 0..bt {
                acc += dout[i * oc + o] * inp[i * c + k];
            }
            dweight[o * c + k] += acc;
        }
    }
    if let Some(dbias) = dbias {
        for o in 0..oc {
            for i in 0..bt {
                dbias[o] += dout[i * oc + o];
            }
        }
    }
}

/// Naive twin of `checksum::checksum`: word `i` into lane `i % LANES`, one word at a time.
pub fn checksum(x: &[f32]) -> u64 {
    let mut lanes: [u32; LANES] = std::array::from_fn(|l| FNV_OFFSET ^ l as u32);
    for (i, v) in x.iter().enumerate() {
        lanes[i % LANES] = (lanes[i % LANES] ^ v.to_bits()).wrapping_mul(FNV_PRIME);
    }
    fold(&lanes, x.len() as u64)
}
