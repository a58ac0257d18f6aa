//! Rollout: sample the step's responses with the rollout engine's (possibly stale) weights, score
//! them, and compute the old and reference log-probs of the batch.
//!
//! Invariant: every draw comes from a stream named by (seed, purpose, step, rank), so a rollout is a
//! pure function of the weights and those keys - also after resume.

use gradbus_kernels::rng::Rng;

use crate::probe::NoProbe;
use crate::task::{self, Batch};
use crate::train::Trainer;
use crate::WorkerError;

impl Trainer {
    /// Sample the step's responses with the rollout weights and score them.
    pub(crate) fn rollout_batch(&mut self) -> Result<Batch, WorkerError> {
        let rl = &self.cfg.rl;
        let (v, r) = (self.cfg.model.vocab, rl.response_len);
        let (seed, step, rank) = (self.cfg.seed, self.step, self.info.rank as u64);
        let b = rl.prompts_per_rank * rl.group_size;
        let mut prompts = Rng::new(&[seed, purpose::PROMPTS, step, rank]);
        let mut seqs = Vec::with_capacity(b * (r + 2));
        for _ in 0..rl.prompts_per_rank {
            let p = task::FIRST + prompts.below(task::prompt_kinds(v) as usize) as u32;
            for _ in 0..rl.group_size {
                seqs.extend_from_slice(&[task::BOS, p]);
                seqs.extend(std::iter::repeat_n(task::PAD, r));
            }
        }
        let mut rng = Rng::new(&[seed, purpose::SAMPLE, step, rank]);
        let len = r + 2;
        for t in 2..len {
            // Recompute the prefix each token: the model is tiny and this keeps one forward path.
            let prefix: Vec<u32> = seqs.chunks_exact(len).flat_map(|s| s[..t].iter().copied()).collect();
            let logits = self.gpt.forward(&self.rollout, &prefix, b, t, &mut self.acts, &mut NoProbe);
            for i in 0..b {
                let prev = seqs[i * len + t - 1];
                seqs[i * len + t] = if t > 2 && (prev == task::EOS || prev == task::PAD) {
                    task::PAD
                } else {
                    let row = &logits[(i * t + t - 1) * v..(i * t + t) * v];
                    sample(row, rl.temperature, &mut rng)
                };
            }
        }
        let mut batch = Batch::from_sequences(&seqs, b, rl.group_size, v);
        batch.old_logp = self.logp(&batch, false);
        batch.ref_logp = self.logp(&batch, true);
        Ok(batch)
    }

    /// Log-probs of the batch's targets under the trainer (or reference) weights.
    pub(crate) fn logp(&mut self, batch: &Batch, reference: bool) -> Vec<f32> {
        let w = if reference { &self.reference } else { &self.params };
        let logits = self.gpt.forward(w, &batch.inputs, batch.b, batch.t, &mut self.acts, &mut NoProbe);
        crate::loss::target_logp(logits, &batch.targets, self.cfg.model.vocab)
    }
}

/// Purposes of the random streams (the second key of every `Rng::new`).
pub(crate) mod purpose {
    pub const INIT: u64 = 1;
    pub const PROMPTS: u64 = 2;
    pub const SAMPLE: u64 = 3;
    pub const SHUFFLE: u64 = 4;
}

/// Sample from softmax(logits / temperature).
pub(crate) fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = logits.iter().map(|&l| ((l - max) / temperature).exp()).collect();
    let total: f32 = w.iter().sum();
    let mut u = rng.uniform() * total;
    for (i, &p) in w.iter().enumerate() {
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    (w.len() - 1) as u32
}
