//! Naive twins of the fast kernels: the plainest code that is obviously right, for the tests that
//! compare each fast kernel against its twin on fresh random inputs.

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

/// Rank-ordered sum of `srcs` into a new vector.
pub fn rank_ordered_sum(srcs: &[&[f32]]) -> Vec<f32> {
    let mut out = srcs[0].to_vec();
    for s in &srcs[1..] {
        for (o, &v) in out.iter_mut().zip(s.iter()) {
            *o += v;
        }
    }
    out
}
