//! The reference RL task: prompts, a rule-based reward, and the batch layout the loss consumes.
//!
//! Vocabulary: 0 = BOS, 1 = EOS, 2 = PAD, 3.. = content. A prompt is `[BOS, p]`; the response should
//! spell the prompt's target pattern, `target(p, i) = 3 + (3 (p - 3) + i) mod (V - 3)`, and its reward
//! is the fraction of the `R` response positions that match. EOS ends a response early; the rest is
//! PAD and masked out of the loss.
//!
//! Batch layout: a sequence is `[BOS, p, r_0 .. r_{R-1}]`; the model reads `T = R + 1` inputs
//! `[BOS, p, r_0 .. r_{R-2}]` and position t predicts `targets[t]` = sequence[t + 1]. Position 0
//! predicts the prompt token (masked); positions 1..=R predict the response up to and including EOS.

/// Beginning of sequence.
pub const BOS: u32 = 0;
/// End of response.
pub const EOS: u32 = 1;
/// Padding after EOS.
pub const PAD: u32 = 2;
/// First content token.
pub const FIRST: u32 = 3;

/// The target token of prompt `p` at response position `i`.
pub fn target(p: u32, i: usize, vocab: usize) -> u32 {
    let n = vocab as u32 - FIRST;
    FIRST + (3 * (p - FIRST) + i as u32) % n
}

/// Number of distinct prompts for a vocabulary.
pub fn prompt_kinds(vocab: usize) -> u32 {
    (vocab as u32 - FIRST).min(8)
}

/// Reward of one response (`R` tokens after the prompt).
pub fn reward(p: u32, response: &[u32], vocab: usize) -> f32 {
    let hits = response
        .iter()
        .enumerate()
        .take_while(|(_, &t)| t != EOS && t != PAD)
        .filter(|&(i, &t)| t == target(p, i, vocab))
        .count();
    hits as f32 / response.len() as f32
}

/// One rank's samples for one RL step, in the loss's layout.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// Sequences.
    pub b: usize,
    /// Positions per sequence (`R + 1`).
    pub t: usize,
    /// Input tokens, (B, T).
    pub inputs: Vec<u32>,
    /// Target tokens, (B, T).
    pub targets: Vec<u32>,
    /// 1 at response positions (through EOS), else 0, (B, T).
    pub mask: Vec<f32>,
    /// Reward per sequence, (B).
    pub reward: Vec<f32>,
    /// Group-normalised advantage per sequence, (B).
    pub adv: Vec<f32>,
    /// Log-probs of the targets under the trainer's weights at the start of the step, (B, T).
    pub old_logp: Vec<f32>,
    /// Log-probs of the targets under the frozen reference, (B, T).
    pub ref_logp: Vec<f32>,
}

impl Batch {
    /// Build from full sequences `[BOS, p, r...]` (B, R + 2) and their group size.
    pub fn from_sequences(seqs: &[u32], b: usize, group: usize, vocab: usize) -> Batch {
        let len = seqs.len() / b;
        let t = len - 1;
        let mut batch = Batch { b, t, ..Batch::default() };
        for s in seqs.chunks_exact(len) {
            batch.inputs.extend_from_slice(&s[..t]);
            batch.targets.extend_from_slice(&s[1..]);
            let mut live = true;
            batch.mask.push(0.0); // position 0 predicts the prompt token
            for &tok in &s[2..] {
                batch.mask.push(if live && tok != PAD { 1.0 } else { 0.0 });
                live &= tok != EOS && tok != PAD;
            }
            batch.reward.push(reward(s[1], &s[2..], vocab));
        }
        batch.adv = advantages(&batch.reward, group);
        batch
    }

    /// The rows `rows` of this batch as a new batch.
    pub fn select(&self, rows: &[usize]) -> Batch {
        let t = self.t;
        let per_pos =
            |v: &[f32]| rows.iter().flat_map(|&r| v[r * t..(r + 1) * t].iter().copied()).collect::<Vec<f32>>();
        let tok = |v: &[u32]| rows.iter().flat_map(|&r| v[r * t..(r + 1) * t].iter().copied()).collect::<Vec<u32>>();
        Batch {
            b: rows.len(),
            t,
            inputs: tok(&self.inputs),
            targets: tok(&self.targets),
            mask: per_pos(&self.mask),
            reward: rows.iter().map(|&r| self.reward[r]).collect(),
            adv: rows.iter().map(|&r| self.adv[r]).collect(),
            old_logp: per_pos(&self.old_logp),
            ref_logp: per_pos(&self.ref_logp),
        }
    }
}

/// GRPO advantages: (r - mean) / (std + 1e-6) within each group of `group` consecutive sequences.
pub fn advantages(reward: &[f32], group: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(reward.len());
    for g in reward.chunks(group) {
        let n = g.len() as f32;
        let mean = g.iter().sum::<f32>() / n;
        let std = (g.iter().map(|r| (r - mean) * (r - mean)).sum::<f32>() / n).sqrt();
        out.extend(g.iter().map(|r| (r - mean) / (std + 1e-6)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reward_counts_matches_until_eos() {
        let v = 16;
        let p = 4;
        let perfect: Vec<u32> = (0..8).map(|i| target(p, i, v)).collect();
        assert_eq!(reward(p, &perfect, v), 1.0);
        let mut early = perfect.clone();
        early[2] = EOS;
        early[3..].fill(PAD);
        assert_eq!(reward(p, &early, v), 2.0 / 8.0);
    }

    #[test]
    fn batch_masks_response_through_eos_and_advantages_are_centered() {
        let seqs = [BOS, 3, 5, EOS, PAD, BOS, 3, 5, 6, 7];
        let b = Batch::from_sequences(&seqs, 2, 2, 16);
        assert_eq!(b.t, 4);
        assert_eq!(b.inputs, vec![BOS, 3, 5, EOS, BOS, 3, 5, 6]);
        assert_eq!(b.targets, vec![3, 5, EOS, PAD, 3, 5, 6, 7]);
        assert_eq!(b.mask, vec![0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        assert!((b.adv[0] + b.adv[1]).abs() < 1e-6);
    }
}
