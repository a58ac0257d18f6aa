//! Rollout: sample the step's responses with the rollout engine's (possibly stale) weights, score
//! them, and compute the old and reference log-probs of the batch.
//!
//! Invariant: every draw comes from a stream named by (seed, purpose, step, rank), so a rollout is a
//! pure function of the weights and those keys - also after resume.

use gradbus_kernels::backend::Cpu;
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
        // One position at a time through a KV cache (the prompt first). Positions 0..len-1 are fed (the
        // batch's inputs); their logits are bit for bit those of a forward over the batch (model.rs).
        let mut cache = crate::model::KvCache::new(&Cpu, &self.cfg.model, b, len - 1);
        let mut all_logits = vec![0.0f32; b * (len - 1) * v];
        for t in 2..len {
            let (p0, tn) = (cache.len(), t - cache.len());
            let new: Vec<u32> = seqs.chunks_exact(len).flat_map(|s| s[p0..t].iter().copied()).collect();
            let logits = self.gpt.forward_cached(&Cpu, &self.rollout, &new, b, tn, &mut cache, &mut self.work.acts);
            for (j, row) in logits.chunks_exact(v).enumerate() {
                all_logits[((j / tn) * (len - 1) + p0 + j % tn) * v..][..v].copy_from_slice(row);
            }
            for i in 0..b {
                let prev = seqs[i * len + t - 1];
                seqs[i * len + t] = if t > 2 && (prev == task::EOS || prev == task::PAD) {
                    task::PAD
                } else {
                    let row = &logits[(i * tn + tn - 1) * v..(i * tn + tn) * v];
                    gradbus_kernels::ops::sample(row, rl.temperature, rng.uniform())
                };
            }
        }
        let mut batch = Batch::from_sequences(&seqs, b, rl.group_size, v);
        // Right after a sync the rollout weights ARE the trainer's: the old log-probs are the
        // rollout's own (the same bits as the forward `logp` would run).
        batch.old_logp = if step % self.cfg.rollout_sync_interval == 0 {
            crate::loss::target_logp(&Cpu, &all_logits, &batch.targets, v)
        } else {
            self.logp(&batch, false)
        };
        batch.ref_logp = self.logp(&batch, true);
        Ok(batch)
    }

    /// Log-probs of the batch's targets under the trainer (or reference) weights.
    pub(crate) fn logp(&mut self, batch: &Batch, reference: bool) -> Vec<f32> {
        let w = if reference { &self.reference } else { &self.params };
        let logits = self.gpt.forward(&Cpu, w, &batch.inputs, batch.b, batch.t, &mut self.work.acts, &mut NoProbe);
        crate::loss::target_logp(&Cpu, logits, &batch.targets, self.cfg.model.vocab)
    }
}

/// Purposes of the random streams (the second key of every `Rng::new`).
pub(crate) mod purpose {
    pub const INIT: u64 = 1;
    pub const PROMPTS: u64 = 2;
    pub const SAMPLE: u64 = 3;
    pub const SHUFFLE: u64 = 4;
}
