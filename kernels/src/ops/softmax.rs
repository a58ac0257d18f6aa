//! Log-softmax over the vocabulary, gathered at one target per row:
//! `logp[i] = logits[i, target[i]] - logsumexp(logits[i, :])`. The loss only ever needs the
//! log-probability of the token taken.
//!
//! Invariants: forward subtracts the row max before exp (as PyTorch does), so logits of any finite
//! size give a finite log-probability; backward is PyTorch's log_softmax backward for a gradient that
//! is `dlogp` at the target and 0 elsewhere: `dlogits[v] += dlogp * (onehot[v] - softmax[v])`, so a
//! non-finite `dlogp` makes the whole row non-finite, exactly as it does in PyTorch.

/// logp: (N), lse: (N) (logsumexp per row, kept for backward), logits: (N, V), targets: (N).
pub fn logsoftmax_gather_forward(
    logp: &mut [f32],
    lse: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) {
    for i in 0..n {
        let row = &logits[i * v..(i + 1) * v];
        let tgt = targets[i] as usize;
        assert!(tgt < v, "logsoftmax_gather_forward: target {tgt} out of vocabulary {v}");
        let maxval = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum: f32 = row.iter().map(|&x| (x - maxval).exp()).sum();
        lse[i] = maxval + sum.ln();
        logp[i] = (row[tgt] - maxval) - sum.ln();
    }
}

/// dlogits: (N, V) +=, dlogp: (N), logits: (N, V), lse: (N), targets: (N).
pub fn logsoftmax_gather_backward(
    dlogits: &mut [f32],
    dlogp: &[f32],
    logits: &[f32],
    lse: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) {
    for i in 0..n {
        let row = &logits[i * v..(i + 1) * v];
        let drow = &mut dlogits[i * v..(i + 1) * v];
        let tgt = targets[i] as usize;
        // PyTorch: grad_input = grad - exp(logsoftmax) * sum(grad), with grad one-hot at the target.
        let g = dlogp[i];
        for (j, (dl, &x)) in drow.iter_mut().zip(row).enumerate() {
            let onehot = if j == tgt { g } else { 0.0 };
            *dl += onehot - (x - lse[i]).exp() * g;
        }
    }
}
