//! Sampling one token from softmax(logits / temperature) with a given uniform draw, by the inverse
//! of the cumulative distribution in vocabulary order.
//!
//! Invariants: the caller draws the uniform (from its named random stream), so a backend that
//! samples on its device consumes the same draws in the same order; the arithmetic is f32 in
//! vocabulary order: `w[i] = exp((l[i] - max) / temperature)`, `u *= sum(w)`, then the first `i`
//! with `u < w[i]` after subtracting the earlier weights (the last token if rounding leaves none).

/// The token sampled from `logits` (V) with the uniform `u` in [0, 1).
pub fn sample(logits: &[f32], temperature: f32, u: f32) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = logits.iter().map(|&l| ((l - max) / temperature).exp()).collect();
    let total: f32 = w.iter().sum();
    let mut u = u * total;
    for (i, &p) in w.iter().enumerate() {
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    (w.len() - 1) as u32
}
