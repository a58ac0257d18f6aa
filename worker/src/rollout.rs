//! The rollout engine: its own (possibly stale) copy of the weights, the frozen reference, a KV
//! cache; it samples the step's responses, scores them, and computes the old and reference
//! log-probs of the batch.
//!
//! Invariant: every draw comes from a stream named by (seed, purpose, step, rank), so a rollout is a
//! pure function of the weights and those keys - also after resume. Sampling draws one uniform per
//! live sequence per position, in sequence order, whatever backend samples.

use gradbus_kernels::backend::Backend;
use gradbus_kernels::rng::Rng;

use crate::config::Config;
use crate::model::{Activations, Gpt, KvCache};
use crate::probe::NoProbe;
use crate::task::{self, Batch};

/// Purposes of the random streams (the second key of every `Rng::new`).
pub(crate) mod purpose {
    pub const INIT: u64 = 1;
    pub const PROMPTS: u64 = 2;
    pub const SAMPLE: u64 = 3;
    pub const SHUFFLE: u64 = 4;
}

/// The rollout engine of one rank.
pub struct RolloutEngine<B: Backend> {
    /// The weights it samples with, synced from the policy every `rollout_sync_interval` steps.
    pub weights: B::Buf,
    /// The frozen reference policy.
    reference: B::Buf,
    cache: KvCache<B>,
    /// Every fed position's logits, (B, R + 1, V).
    logits: B::Buf,
}

impl<B: Backend> RolloutEngine<B> {
    /// An engine for `cfg` whose weights and reference start as host `init`.
    pub fn new(be: &B, cfg: &Config, init: &[f32]) -> RolloutEngine<B> {
        let b = cfg.rl.prompts_per_rank * cfg.rl.group_size;
        let t = cfg.rl.response_len + 1;
        RolloutEngine {
            weights: be.upload(init),
            reference: be.upload(init),
            cache: KvCache::new(be, &cfg.model, b, t),
            logits: be.zeros(b * t * cfg.model.vocab),
        }
    }

    /// Take the policy's weights.
    pub fn sync(&mut self, be: &B, params: &B::Buf) {
        be.copy(be.all_mut(&mut self.weights), be.all(params));
    }

    /// Sample the step's responses with the rollout weights and score them; the old log-probs are
    /// the policy's (`params`), the reference's from the frozen reference. `synced`: the rollout
    /// weights are the policy's this step. `acts` is scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn batch(
        &mut self,
        be: &B,
        gpt: &Gpt,
        cfg: &Config,
        step: u64,
        rank: u64,
        synced: bool,
        params: &B::Buf,
        acts: &mut Activations<B>,
    ) -> Batch {
        let rl = &cfg.rl;
        let (v, r, seed) = (cfg.model.vocab, rl.response_len, cfg.seed);
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
        // One position at a time through the KV cache (the prompt first). Positions 0..len-1 are fed
        // (the batch's inputs); their logits are bit for bit those of a forward over the batch
        // (model.rs), kept for the old log-probs.
        self.cache.clear();
        let (mut uniforms, mut sampled) = (vec![0.0f32; b], vec![0u32; b]);
        for t in 2..len {
            let (p0, tn) = (self.cache.len(), t - self.cache.len());
            let new: Vec<u32> = seqs.chunks_exact(len).flat_map(|s| s[p0..t].iter().copied()).collect();
            let logits = gpt.forward_cached(be, &self.weights, &new, b, tn, &mut self.cache, acts);
            // Logits (B, TN, V) into (B, len - 1, V) at position p0.
            let dst = be.view_mut(&mut self.logits, p0 * v..b * (len - 1) * v);
            be.copy_2d(dst, (len - 1) * v, B::dup(&logits), tn * v, tn * v, b);
            let ended: Vec<bool> = (0..b)
                .map(|i| {
                    let prev = seqs[i * len + t - 1];
                    t > 2 && (prev == task::EOS || prev == task::PAD)
                })
                .collect();
            for (u, &done) in uniforms.iter_mut().zip(&ended) {
                *u = if done { 0.0 } else { rng.uniform() };
            }
            be.sample(&mut sampled, logits, b, tn, v, rl.temperature, &uniforms);
            for (i, (&tok, &done)) in sampled.iter().zip(&ended).enumerate() {
                seqs[i * len + t] = if done { task::PAD } else { tok };
            }
        }
        let mut batch = Batch::from_sequences(&seqs, b, rl.group_size, v);
        // Right after a sync the rollout weights ARE the trainer's: the old log-probs are the
        // rollout's own (the same bits as the forward `logp` would run).
        batch.old_logp = if synced {
            crate::loss::target_logp(be, be.view(&self.logits, 0..b * (len - 1) * v), &batch.targets, v)
        } else {
            logp(be, gpt, params, &batch, acts, v)
        };
        batch.ref_logp = logp(be, gpt, &self.reference, &batch, acts, v);
        batch
    }
}

/// Log-probs of the batch's targets under the weights `w`.
fn logp<B: Backend>(be: &B, gpt: &Gpt, w: &B::Buf, batch: &Batch, acts: &mut Activations<B>, v: usize) -> Vec<f32> {
    let logits = gpt.forward(be, w, &batch.inputs, batch.b, batch.t, acts, &mut NoProbe);
    crate::loss::target_logp(be, logits, &batch.targets, v)
}
