//! The job configuration: a TOML file plus `--set key=value` overrides with dotted keys, checked
//! into one typed `Config`.
//!
//! Invariants: unknown keys and wrong types are errors that name the file and key (never silently
//! ignored: a typo in `rollout_sync_interval` must not quietly train on-policy). The config hash is
//! taken over the merged, canonical TOML, so two ranks with different configs refuse to share a bus.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use gradbus_collectives::layout::Fnv;
use gradbus_collectives::Policy;

use crate::loss::LossConfig;
use crate::model::GptConfig;

/// Errors in the configuration: each names the file or key and carries a hint.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config {path}: {source} (hint: check the path; examples/tiny.toml is the default config)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not match the schema (unknown key, wrong type).
    #[error("{path}: {message}")]
    Invalid {
        /// The file (or `--set` for overrides).
        path: String,
        /// What toml/serde said, which names the key.
        message: String,
    },
    /// A `--set` override is malformed.
    #[error("--set {arg}: {why} (hint: use --set key=value with a dotted key, e.g. --set loss.style=\"safe\")")]
    BadOverride {
        /// The override as given.
        arg: String,
        /// What is wrong.
        why: String,
    },
    /// A value is out of its range.
    #[error("config key `{key}` = {value}: {why}")]
    Range {
        /// The dotted key.
        key: &'static str,
        /// The value given.
        value: String,
        /// The allowed range.
        why: &'static str,
    },
}

/// The whole job configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Master seed: every random stream is a function of (seed, purpose, step, rank).
    #[serde(default)]
    pub seed: u64,
    /// RL steps to run (each step: one rollout, then epochs x mini-batches updates).
    #[serde(default = "default_steps")]
    pub steps: u64,
    /// What to do with non-finite gradients: "abort", "skip" or "rerun".
    #[serde(default)]
    pub policy: PolicyName,
    /// Sync the rollout engine's weights from the trainer every this many steps (1 = on-policy).
    #[serde(default = "one")]
    pub rollout_sync_interval: u64,
    /// Gradient bucket size in bytes (buckets are cut in reverse parameter order).
    #[serde(default = "default_bucket_bytes")]
    pub bucket_bytes: usize,
    /// Seconds a rank waits in a collective for its peers before failing with a timeout.
    #[serde(default = "default_timeout")]
    pub collective_timeout_s: f64,
    /// Reduce each bucket while backward goes on ("on"), after backward ("off"), or "auto": on in
    /// a multi-node job on nodes with two cores per local rank. The same bits either way.
    #[serde(default)]
    pub overlap: Overlap,
    /// The policy model.
    #[serde(default)]
    pub model: GptConfig,
    /// The RL setting.
    #[serde(default)]
    pub rl: RlConfig,
    /// The loss.
    #[serde(default)]
    pub loss: LossConfig,
    /// The optimizer.
    #[serde(default)]
    pub optim: OptimConfig,
    /// Bounds of the `skip` policy.
    #[serde(default)]
    pub skip: SkipConfig,
    /// Checkpointing.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Early warning on log-ratio headroom.
    #[serde(default)]
    pub warn: WarnConfig,
    /// Spike detection on the agreed loss and gradient norm.
    #[serde(default)]
    pub spike: SpikeConfig,
    /// Planned faults (testing).
    #[serde(default)]
    pub faults: Vec<crate::faults::Fault>,
}

/// Name of the non-finite policy.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PolicyName {
    /// Abort every rank with a report.
    #[default]
    Abort,
    /// Skip the update on every rank (bounded).
    Skip,
    /// Recompute the update to classify the cause.
    Rerun,
}

/// When to all-reduce a bucket: as soon as backward has finished it, or after backward.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Overlap {
    /// On when the job spans several nodes (the reduce waits on the network, which overlap hides)
    /// and this node has a core for each rank's backward and one for its reducer
    /// (`available_parallelism() >= 2 x` local ranks; `GRADBUS_FAKE_NODES`' nodes count as nodes
    /// and their ranks as local ranks). Inside one node the shared-memory reduce
    /// is memory-bound and short, and the hand-over between threads costs more than it hides
    /// (measured: `scripts/bench-overlap.sh`, docs/benchmarks.md).
    #[default]
    Auto,
    /// Backward on its own thread, each bucket reduced as soon as it is final.
    On,
    /// Every bucket reduced after backward.
    Off,
}

impl Overlap {
    /// Whether to overlap in a job on `nodes` nodes, `local_ranks` of its ranks on this node.
    pub fn resolve(self, nodes: usize, local_ranks: usize) -> bool {
        match self {
            Overlap::On => true,
            Overlap::Off => false,
            Overlap::Auto => {
                nodes > 1 && std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2 * local_ranks
            }
        }
    }
}

/// The RL task and schedule.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlConfig {
    /// Prompts per rank per step.
    pub prompts_per_rank: usize,
    /// Sampled responses per prompt (the GRPO group).
    pub group_size: usize,
    /// Maximum response length in tokens (EOS, then padding).
    pub response_len: usize,
    /// Passes over the step's samples.
    pub epochs: usize,
    /// Mini-batches per epoch; each is one optimizer update.
    pub minibatches: usize,
    /// Sampling temperature of the rollout engine.
    pub temperature: f32,
}

impl Default for RlConfig {
    fn default() -> Self {
        RlConfig { prompts_per_rank: 2, group_size: 8, response_len: 8, epochs: 4, minibatches: 4, temperature: 1.0 }
    }
}

/// AdamW and its schedule.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f32,
    /// Linear warmup in updates.
    pub warmup: u64,
    /// Adam beta1.
    pub beta1: f32,
    /// Adam beta2.
    pub beta2: f32,
    /// Adam epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (0 = off).
    pub grad_clip: f32,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig { lr: 1e-3, warmup: 0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, grad_clip: 1.0 }
    }
}

/// Bounds of the skip policy.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SkipConfig {
    /// Most skipped updates in a row before aborting.
    pub max_consecutive: u32,
    /// Most skipped fraction of the last `window` updates before aborting.
    pub max_fraction: f64,
    /// Window of that fraction, in updates.
    pub window: u32,
}

impl Default for SkipConfig {
    fn default() -> Self {
        SkipConfig { max_consecutive: 3, max_fraction: 0.1, window: 100 }
    }
}

/// Checkpoints.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Write a checkpoint every this many steps (0 = never).
    pub every: u64,
}

/// Early warning.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarnConfig {
    /// Warn when a log-ratio fed to an exp comes within this many nats of ln(f32::MAX) = 88.72.
    pub headroom: f32,
}

impl Default for WarnConfig {
    fn default() -> Self {
        WarnConfig { headroom: 20.0 }
    }
}

/// Spike detection: a rolling z-score over `window` updates (llm.c) and Megatron's rule (10x the
/// largest of the first 100 values), on the loss and the global gradient norm every rank agreed on.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpikeConfig {
    /// Skip (on every rank) an update whose loss or gradient norm is a spike. Off by default:
    /// spikes are then only counted in the metrics (`spike`).
    pub skip: bool,
    /// Updates in the z-score window.
    pub window: usize,
    /// z-score above which a value is a spike (0 = only Megatron's rule).
    pub z_limit: f64,
}

impl Default for SpikeConfig {
    fn default() -> Self {
        SpikeConfig { skip: false, window: 128, z_limit: 6.0 }
    }
}

fn default_steps() -> u64 {
    20
}
fn one() -> u64 {
    1
}
fn default_bucket_bytes() -> usize {
    64 * 1024
}
fn default_timeout() -> f64 {
    30.0
}

impl Config {
    /// Load `path`, apply the `--set` overrides, check ranges. Returns the config, its hash and
    /// the canonical merged TOML (which rebuilds the same config with no overrides).
    pub fn load(path: &Path, overrides: &[String]) -> Result<(Config, u64, String), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        Config::from_toml(&text, &path.display().to_string(), overrides)
    }

    /// Parse TOML text (named `origin` in errors), apply overrides, check ranges.
    pub fn from_toml(text: &str, origin: &str, overrides: &[String]) -> Result<(Config, u64, String), ConfigError> {
        let invalid =
            |path: &str, e: &dyn std::fmt::Display| ConfigError::Invalid { path: path.into(), message: e.to_string() };
        let mut table: toml::Table = text.parse().map_err(|e| invalid(origin, &e))?;
        for arg in overrides {
            apply_override(&mut table, arg)?;
        }
        let canonical = table.to_string();
        let cfg: Config =
            toml::from_str(&canonical).map_err(|e| invalid(&format!("{origin} (with --set overrides)"), &e))?;
        cfg.check()?;
        let mut h = Fnv::default();
        h.write(canonical.as_bytes());
        Ok((cfg, h.0, canonical))
    }

    fn check(&self) -> Result<(), ConfigError> {
        let range = |key, value: String, why| Err(ConfigError::Range { key, value, why });
        let rl = &self.rl;
        if rl.prompts_per_rank == 0 || rl.group_size < 2 {
            return range(
                "rl.group_size",
                rl.group_size.to_string(),
                "need prompts_per_rank >= 1 and group_size >= 2 (group-normalised advantages)",
            );
        }
        if rl.epochs == 0 || rl.minibatches == 0 || (rl.prompts_per_rank * rl.group_size) % rl.minibatches != 0 {
            return range(
                "rl.minibatches",
                rl.minibatches.to_string(),
                "must be >= 1 and divide prompts_per_rank * group_size",
            );
        }
        if rl.response_len == 0 || 2 + rl.response_len > self.model.max_seq {
            return range(
                "rl.response_len",
                rl.response_len.to_string(),
                "must be >= 1 and 2 + response_len <= model.max_seq",
            );
        }
        if self.rollout_sync_interval == 0 {
            return range("rollout_sync_interval", "0".into(), "must be >= 1 (1 = on-policy)");
        }
        if !(self.collective_timeout_s > 0.0) {
            return range("collective_timeout_s", self.collective_timeout_s.to_string(), "must be > 0");
        }
        if !(rl.temperature > 0.0) {
            return range("rl.temperature", rl.temperature.to_string(), "must be > 0");
        }
        Ok(())
    }

    /// The collectives' policy from the config.
    pub fn policy(&self) -> Policy {
        match self.policy {
            PolicyName::Abort => Policy::Abort,
            PolicyName::Rerun => Policy::Rerun,
            PolicyName::Skip => Policy::Skip {
                max_consecutive: self.skip.max_consecutive,
                max_fraction: self.skip.max_fraction,
                window: self.skip.window.max(1),
            },
        }
    }
}

/// Apply `a.b.c=value` to a TOML table. The value is parsed as a TOML value (`3`, `1e-3`, `true`,
/// `"safe"`); a bare word that is not valid TOML is taken as a string, so `loss.style=safe` works.
fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| ConfigError::BadOverride { arg: arg.into(), why: why.into() };
    let (key, raw) = arg.split_once('=').ok_or_else(|| bad("missing '='"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(bad("empty key or key segment"));
    }
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").expect("parsed key v"),
        Err(_) => toml::Value::String(raw.trim().to_string()),
    };
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().expect("non-empty key");
    let mut cur = table;
    for p in parts {
        let entry = cur.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| bad(&format!("`{p}` is not a table")))?;
    }
    cur.insert(last.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Overlap;

    #[test]
    fn overlap_auto_needs_other_nodes_and_a_free_core_per_rank() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(Overlap::On.resolve(1, 1000));
        assert!(!Overlap::Off.resolve(8, 1));
        assert!(!Overlap::Auto.resolve(1, 1), "one node: the shared-memory reduce is short");
        assert!(!Overlap::Auto.resolve(4, cores), "every core already runs a rank");
        assert_eq!(Overlap::Auto.resolve(4, (cores / 2).max(1)), cores >= 2);
    }
}
