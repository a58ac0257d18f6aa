//! The job configuration: a TOML file plus `--set key=value` overrides with dotted keys, checked
//! into one typed `Config`.
//!
//! Invariants: unknown keys and wrong types are errors that name the dotted key (never silently
//! ignored: a typo in `rollout_sync_interval` must not quietly train on-policy), and every value is
//! range-checked when the config is loaded, by rules that allocate nothing the config sizes, so no
//! value however wrong reaches an `expect`, an overflow or an allocation abort. What needs the world
//! size (a fault's rank) and the machine (the memory estimate) is checked by `check_world` and
//! `check_memory`: `gradbus run` calls both once before it starts any rank, each worker again for a
//! bare mpirun. The config hash is taken over the merged, canonical TOML, so two ranks with
//! different configs refuse to share a bus.
//!
//! The parts: this module holds the schema (`Config` and its sections, with their defaults) and its
//! range rules; `load` reads the TOML and applies the overrides, `placement` checks what needs the
//! world size or the device, `memory` estimates the memory and checks it against the machine.

mod load;
mod memory;
mod placement;

use serde::Deserialize;

use gradbus_collectives::Policy;

use crate::error::WorkerError;
use crate::faults::FaultPhase;
use crate::loss::LossConfig;
use crate::model::GptConfig;

pub use memory::{bytes, Machine, MemoryEstimate};

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
    /// Where each rank computes: "cpu", or "cuda" (one GPU per local rank; a build with the `cuda`
    /// feature on a machine with the CUDA driver).
    #[serde(default)]
    pub device: Device,
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
    /// The silent-data-corruption checks: replicas and the consumed gradients, outliers.
    #[serde(default)]
    pub sdc: SdcConfig,
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

/// Where each rank computes.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The CPU kernels (`gradbus_kernels::backend::Cpu`).
    #[default]
    Cpu,
    /// One CUDA GPU per local rank (`rank::gpu_ordinal`); more local ranks than GPUs share them.
    Cuda,
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
    /// Warn when the trend of that log-ratio (least squares over 4 updates) forecasts the ceiling
    /// within this many updates (0 = off).
    pub forecast: f32,
}

impl Default for WarnConfig {
    fn default() -> Self {
        WarnConfig { headroom: 20.0, forecast: 7.0 }
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

/// The silent-data-corruption guard (docs/reliability.md, "Silent data corruption").
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SdcConfig {
    /// Check every update that the replicas' weights (read back from memory) are alike and that
    /// each rank's optimizer consumed the reducers' gradients; repair a damaged replica from a
    /// healthy one (no effect at 1 rank).
    pub replicas: bool,
    /// Flag a rank whose local gradients in a bucket stand `binades` above the bucket's recent
    /// history and `spread` above the smallest rank; the update is rerun, then judged by `policy`.
    pub outliers: bool,
    /// Binades (log2 of the norm) above the median of the last `window` updates.
    pub binades: f64,
    /// Binades above the smallest rank of the same update (at 2 or more ranks).
    pub spread: f64,
    /// Binades the bucket's largest value must stand above the norm of the rest of its rank's
    /// bucket (one isolated value, as a flipped bit makes it).
    pub isolation: f64,
    /// Healthy updates in the history.
    pub window: usize,
    /// Updates of history before the outlier rule judges.
    pub warmup: usize,
}

impl Default for SdcConfig {
    fn default() -> Self {
        let r = gradbus_collectives::sdc::OutlierRule::default();
        let (replicas, outliers) = (true, true);
        SdcConfig {
            replicas,
            outliers,
            binades: r.binades,
            spread: r.spread,
            isolation: r.isolation,
            window: r.window,
            warmup: r.warmup,
        }
    }
}

impl SdcConfig {
    /// The outlier rule of these settings.
    pub fn rule(&self) -> gradbus_collectives::sdc::OutlierRule {
        gradbus_collectives::sdc::OutlierRule {
            binades: self.binades,
            spread: self.spread,
            isolation: self.isolation,
            window: self.window,
            warmup: self.warmup,
        }
    }
}

/// The longest wait in seconds a config may ask for (`collective_timeout_s`, a planned stall).
pub const MAX_SECONDS: f64 = 86_400.0;
/// The largest spike window: the detectors keep that many values.
pub const MAX_SPIKE_WINDOW: usize = 1_000_000;

/// One range rule: (key, value as given, whether it holds, the requirement, an example value).
type Rule = (String, String, bool, String, &'static str);

/// A [`Rule`].
fn rule(key: &str, value: impl std::fmt::Display, holds: bool, why: &str, example: &'static str) -> Rule {
    (key.to_string(), value.to_string(), holds, why.to_string(), example)
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
    /// Every range rule of every key; the first one broken is the error. No rule allocates, so an
    /// absurd model shape is refused here or by [`Config::memory`], never by an allocation.
    fn check(&self) -> Result<(), WorkerError> {
        let (m, rl, o, l) = (&self.model, &self.rl, &self.optim, &self.loss);
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
        let fraction = |x: f64| (0.0..1.0).contains(&x);
        let per_rank = rl.prompts_per_rank.checked_mul(rl.group_size);
        let updates = rl.epochs.checked_mul(rl.minibatches);
        // (key, value, holds, requirement, example): in the order of examples/tiny.toml.
        let mut rules: Vec<Rule> = vec![
            rule("steps", self.steps, self.steps >= 1, "must be at least 1", "20"),
            rule(
                "rollout_sync_interval",
                self.rollout_sync_interval,
                self.rollout_sync_interval >= 1,
                "must be at least 1 (1 = on-policy)",
                "1",
            ),
            rule("bucket_bytes", self.bucket_bytes, self.bucket_bytes >= 4, "must be at least 4 (one f32)", "65536"),
            rule(
                "collective_timeout_s",
                self.collective_timeout_s,
                finite_pos(self.collective_timeout_s) && self.collective_timeout_s <= MAX_SECONDS,
                &format!("must be > 0 and at most {MAX_SECONDS} seconds"),
                "30",
            ),
            rule(
                "model.vocab",
                m.vocab,
                m.vocab >= 4,
                "must be at least 4 (BOS, EOS, PAD and one content token)",
                "16",
            ),
            rule(
                "model.max_seq",
                m.max_seq,
                m.max_seq >= 3,
                "must be at least 3 (a prompt [BOS, p] and one response token)",
                "16",
            ),
            rule("model.channels", m.channels, m.channels >= 1, "must be at least 1", "64"),
            rule(
                "model.heads",
                m.heads,
                m.heads >= 1 && m.channels % m.heads == 0,
                &format!("must be at least 1 and divide model.channels = {}", m.channels),
                "4",
            ),
            rule("model.layers", m.layers, m.layers >= 1, "must be at least 1", "2"),
            rule("rl.prompts_per_rank", rl.prompts_per_rank, rl.prompts_per_rank >= 1, "must be at least 1", "2"),
            rule(
                "rl.group_size",
                rl.group_size,
                rl.group_size >= 2 && per_rank.is_some(),
                "must be at least 2 (group-normalised advantages)",
                "8",
            ),
            rule(
                "rl.response_len",
                rl.response_len,
                rl.response_len >= 1 && rl.response_len.checked_add(2).is_some_and(|n| n <= m.max_seq),
                &format!("must be at least 1 and 2 + rl.response_len <= model.max_seq = {}", m.max_seq),
                "8",
            ),
            rule("rl.epochs", rl.epochs, rl.epochs >= 1, "must be at least 1", "4"),
            rule(
                "rl.minibatches",
                rl.minibatches,
                rl.minibatches >= 1 && updates.is_some() && per_rank.is_some_and(|n| n % rl.minibatches == 0),
                &format!(
                    "must be at least 1 and divide rl.prompts_per_rank x rl.group_size = {}",
                    per_rank.map_or("overflow".into(), |n| n.to_string())
                ),
                "4",
            ),
            rule("rl.temperature", rl.temperature, finite_pos(rl.temperature.into()), "must be finite and > 0", "1.0"),
            rule(
                "loss.clip",
                l.clip,
                finite_pos(l.clip.into()),
                "must be finite and > 0 (the PPO ratio is clipped to [1 - clip, 1 + clip])",
                "0.2",
            ),
            rule("loss.kl_coef", l.kl_coef, finite_nonneg(l.kl_coef.into()), "must be finite and >= 0", "0.01"),
            rule("optim.lr", o.lr, finite_pos(o.lr.into()), "must be finite and > 0", "1e-3"),
            rule("optim.beta1", o.beta1, fraction(o.beta1.into()), "must be in [0, 1)", "0.9"),
            rule("optim.beta2", o.beta2, fraction(o.beta2.into()), "must be in [0, 1)", "0.999"),
            rule("optim.eps", o.eps, finite_pos(o.eps.into()), "must be finite and > 0", "1e-8"),
            rule(
                "optim.weight_decay",
                o.weight_decay,
                finite_nonneg(o.weight_decay.into()),
                "must be finite and >= 0",
                "0.0",
            ),
            rule(
                "optim.grad_clip",
                o.grad_clip,
                finite_nonneg(o.grad_clip.into()),
                "must be finite and >= 0 (0 = no clipping)",
                "1.0",
            ),
            rule(
                "skip.max_fraction",
                self.skip.max_fraction,
                (0.0..=1.0).contains(&self.skip.max_fraction),
                "must be in [0, 1]",
                "0.1",
            ),
            rule("skip.window", self.skip.window, self.skip.window >= 1, "must be at least 1", "100"),
            rule(
                "warn.headroom",
                self.warn.headroom,
                finite_nonneg(self.warn.headroom.into()),
                "must be finite and >= 0 (nats below ln(f32::MAX) = 88.72)",
                "20",
            ),
            rule(
                "warn.forecast",
                self.warn.forecast,
                finite_nonneg(self.warn.forecast.into()),
                "must be finite and >= 0 (updates; 0 = off)",
                "7",
            ),
            rule(
                "spike.window",
                self.spike.window,
                (2..=MAX_SPIKE_WINDOW).contains(&self.spike.window),
                &format!("must be in 2..={MAX_SPIKE_WINDOW} updates"),
                "128",
            ),
            rule(
                "spike.z_limit",
                self.spike.z_limit,
                finite_nonneg(self.spike.z_limit),
                "must be finite and >= 0 (0 = only the 10x rule)",
                "6",
            ),
            rule("sdc.binades", self.sdc.binades, finite_nonneg(self.sdc.binades), "must be finite and >= 0", "6"),
            rule("sdc.spread", self.sdc.spread, finite_nonneg(self.sdc.spread), "must be finite and >= 0", "6"),
            rule("sdc.isolation", self.sdc.isolation, self.sdc.isolation.is_finite(), "must be finite", "4"),
            rule(
                "sdc.window",
                self.sdc.window,
                (1..=MAX_SPIKE_WINDOW).contains(&self.sdc.window),
                &format!("must be in 1..={MAX_SPIKE_WINDOW} updates"),
                "32",
            ),
            rule(
                "sdc.warmup",
                self.sdc.warmup,
                (1..=self.sdc.window.max(1)).contains(&self.sdc.warmup),
                "must be in 1..=sdc.window updates",
                "4",
            ),
        ];
        let updates = updates.unwrap_or(usize::MAX);
        for (i, f) in self.faults.iter().enumerate() {
            let key = |k: &str| format!("faults[{i}].{k}");
            let (last, last_why) = if f.phase == FaultPhase::Checkpoint {
                (self.steps, "must be at most steps (a checkpoint's step is the steps completed)")
            } else {
                (self.steps.saturating_sub(1), "must be below steps (the fault would never fire)")
            };
            rules.push(rule(&key("step"), f.step, f.step <= last, last_why, "1"));
            let mb_ok =
                if f.phase == FaultPhase::Checkpoint { f.minibatch == 0 } else { (f.minibatch as usize) < updates };
            rules.push(rule(
                &key("minibatch"),
                f.minibatch,
                mb_ok,
                "must be below rl.epochs x rl.minibatches (0 for phase \"checkpoint\")",
                "0",
            ));
            rules.push(rule(
                &key("seconds"),
                f.seconds,
                finite_nonneg(f.seconds) && f.seconds <= MAX_SECONDS,
                &format!("must be in [0, {MAX_SECONDS}]"),
                "3600",
            ));
            rules.push(rule(&key("code"), f.code, (0..=255).contains(&f.code), "must be an exit code in 0..=255", "1"));
            if let Some(p) = &f.param {
                rules.push((
                    key("param"),
                    format!("{p:?}"),
                    m.has_param(p),
                    "must name a parameter of the model".into(),
                    "\"head.weight\"",
                ));
            }
            if let Err((field, value, why, example)) = f.check_flip(m) {
                rules.push((key(field), value, false, why, example));
            }
        }
        match rules.into_iter().find(|rule| !rule.2) {
            Some((key, value, _, why, example)) => {
                let hint = match key.split_once("].") {
                    Some((entry, field)) => format!("e.g. {field} = {example} in the {entry}] entry"),
                    None => format!("e.g. --set {key}={example}"),
                };
                Err(WorkerError::ConfigRange { key, value, why, hint })
            }
            None => Ok(()),
        }
    }

    /// The collectives' policy from the config.
    pub fn policy(&self) -> Policy {
        match self.policy {
            PolicyName::Abort => Policy::Abort,
            PolicyName::Rerun => Policy::Rerun,
            PolicyName::Skip => Policy::Skip {
                max_consecutive: self.skip.max_consecutive,
                max_fraction: self.skip.max_fraction,
                window: self.skip.window,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::memory::param_floats;
    use super::placement::cuda_check;
    use super::*;

    fn load(sets: &[&str]) -> Result<Config, WorkerError> {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/tiny.toml")).unwrap();
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::from_toml(&text, "tiny.toml", &sets).map(|c| c.0)
    }

    fn key_of(e: WorkerError) -> String {
        match e {
            WorkerError::ConfigRange { key, .. } | WorkerError::ConfigKey { key, .. } => key,
            other => panic!("not a keyed error: {other}"),
        }
    }

    #[test]
    fn overlap_auto_needs_other_nodes_and_a_free_core_per_rank() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(Overlap::On.resolve(1, 1000));
        assert!(!Overlap::Off.resolve(8, 1));
        assert!(!Overlap::Auto.resolve(1, 1), "one node: the shared-memory reduce is short");
        assert!(!Overlap::Auto.resolve(4, cores), "every core already runs a rank");
        assert_eq!(Overlap::Auto.resolve(4, (cores / 2).max(1)), cores >= 2);
    }

    #[test]
    fn schema_errors_name_the_dotted_key() {
        assert_eq!(key_of(load(&["optim.lr=\"fast\""]).unwrap_err()), "optim.lr");
        assert_eq!(key_of(load(&["optim.lrr=1"]).unwrap_err()), "optim.lrr");
        assert_eq!(key_of(load(&["seed=-1"]).unwrap_err()), "seed");
        assert_eq!(
            key_of(load(&["faults=[{kind=\"nan\",rank=0,step=0},{kind=\"nan\",rank=\"x\",step=0}]"]).unwrap_err()),
            "faults[1].rank"
        );
    }

    #[test]
    fn range_errors_name_the_key_and_the_defaults_pass() {
        load(&[]).unwrap();
        for (set, key) in [
            ("model.heads=3", "model.heads"),
            ("model.channels=0", "model.channels"),
            ("model.vocab=3", "model.vocab"),
            ("optim.lr=nan", "optim.lr"),
            ("optim.lr=-1", "optim.lr"),
            ("loss.clip=inf", "loss.clip"),
            ("warn.headroom=-1", "warn.headroom"),
            ("warn.forecast=-1", "warn.forecast"),
            ("optim.beta2=1.0", "optim.beta2"),
            ("skip.window=0", "skip.window"),
            ("collective_timeout_s=inf", "collective_timeout_s"),
            ("faults=[{kind=\"stall\",rank=0,step=0,seconds=-1}]", "faults[0].seconds"),
            ("faults=[{kind=\"nan\",rank=0,step=0,param=\"blocks.9.ln1.weight\"}]", "faults[0].param"),
        ] {
            assert_eq!(key_of(load(&[set]).unwrap_err()), key, "{set}");
        }
        let c = load(&["faults=[{kind=\"kill\",rank=2,step=0}]"]).unwrap();
        assert_eq!(key_of(c.check_world(2).unwrap_err()), "faults[0].rank");
        c.check_world(3).unwrap();
    }

    #[test]
    fn device_cuda_names_the_missing_feature_driver_or_gpu_and_allows_sharing_with_a_warning() {
        use gradbus_kernels::Error as E;
        let msg = |r: Result<Option<String>, WorkerError>| r.unwrap_err().to_string();
        let m = msg(cuda_check(Err(E::NotCompiledWithCuda), 1));
        assert!(
            m.contains("`device`") && m.contains("without the cuda feature") && m.contains("--features cuda"),
            "{m}"
        );
        let m = msg(cuda_check(Err(E::NoCudaDriver("libcuda.so could not be loaded".into())), 1));
        assert!(m.contains("libcuda.so") && m.contains("NVIDIA driver"), "{m}");
        assert!(msg(cuda_check(Ok(0), 1)).contains("no GPU"));
        assert_eq!(cuda_check(Ok(2), 2).unwrap(), None);
        let w = cuda_check(Ok(1), 4).unwrap().expect("a warning");
        assert!(w.contains("4 local ranks share 1 GPU"), "{w}");
        let cpu = load(&["device=\"cpu\""]).unwrap();
        assert_eq!((cpu.device, cpu.check_device(64, true).unwrap()), (Device::Cpu, None));
        assert_eq!(load(&["device=\"cuda\""]).unwrap().device, Device::Cuda);
        assert_eq!(key_of(load(&["device=\"tpu\""]).unwrap_err()), "device");
    }

    #[test]
    fn memory_estimate_counts_the_layout_and_refuses_what_does_not_fit() {
        for m in [GptConfig::default(), GptConfig { vocab: 7, max_seq: 5, channels: 12, heads: 3, layers: 3 }] {
            let layout = gradbus_collectives::Layout::new(&crate::model::param_specs(&m), 64);
            assert_eq!(param_floats(&m), layout.len as f64, "{m:?}");
        }
        let c = load(&["checkpoint.every=0"]).unwrap();
        let e = c.memory(2, true);
        let p = param_floats(&c.model) * 4.0;
        assert_eq!(e.segment, 2.0 * (p / 4096.0).ceil() * 4096.0);
        assert_eq!(e.total(), 2.0 * (5.0 * p + e.activations) + e.segment);
        assert_eq!(c.memory(1, false).private_grads, p);
        let big = Machine { mem_available: Some(1e12), shm_free: Some(1e12) };
        c.check_memory(2, true, &big).unwrap();
        let small = Machine { mem_available: Some(e.total() - 1.0), shm_free: None };
        let msg = c.check_memory(2, true, &small).unwrap_err().to_string();
        assert!(msg.contains("MemAvailable") && msg.contains("model.channels = 64") && msg.contains("hint:"), "{msg}");
        let tight_shm = Machine { mem_available: None, shm_free: Some(e.segment - 1.0) };
        assert!(c.check_memory(2, true, &tight_shm).unwrap_err().to_string().contains("/dev/shm"));
        let huge = load(&["model.channels=100000"]).unwrap();
        let msg = huge.check_memory(1, false, &big).unwrap_err().to_string();
        assert!(msg.contains("TiB") && msg.contains("model.channels = 100000"), "{msg}");
        assert_eq!(bytes(1536.0), "1.5 KiB");
        assert_eq!(bytes(3.0), "3 B");
    }
}
