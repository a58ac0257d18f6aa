//! The step loop of one rank: rollout with the (possibly stale) rollout weights, rewards and group
//! advantages, then epochs x mini-batches of forward, RL loss, backward onto the bus, bucket
//! all-reduces, one agreed verdict, and the update - identical on every rank.
//!
//! Invariants: every random draw is a pure function of (seed, purpose, step, rank), and every
//! reduction has a fixed order, so the same config, seed and world size give bitwise-identical
//! metrics and weights, also after resume. Replicas are checked: each rank's parameter checksum
//! travels in the agreement, and a mismatch stops the job before a diverged replica trains on.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;

use gradbus_collectives::spikes::SpikeDetector;
use gradbus_collectives::{
    backward_and_reduce, decide, Action, HealthTable, History, Layout, LocalReport, ParamGrads, Progress, Report,
    StepId, Transport,
};
use gradbus_kernels::checksum::checksum;
use gradbus_kernels::rng::Rng;
use gradbus_kernels::Health;

use crate::config::Config;
use crate::faults::{FaultPhase, FaultPlan};
use crate::loss::LossStats;
use crate::model::{self, Gpt};
use crate::probe::{NoProbe, Probe};
use crate::rank::RankInfo;
use crate::task::{self, Batch};
use crate::tensorfile;
use crate::WorkerError;

/// Purposes of the random streams (the second key of every `Rng::new`).
mod purpose {
    pub const INIT: u64 = 1;
    pub const PROMPTS: u64 = 2;
    pub const SAMPLE: u64 = 3;
    pub const SHUFFLE: u64 = 4;
}

/// ln(f32::MAX): exp of anything larger is +inf (the same for bf16, whose exponent has 8 bits too).
pub const EXP_OVERFLOW: f32 = 88.72284;

/// Indices of `LocalReport::values`.
mod slot {
    pub const REWARD: usize = 0;
    pub const KL: usize = 1;
    pub const MAX_LR_RESPONSE: usize = 2;
    pub const MAX_LR_MASKED: usize = 3;
    pub const MIN_LOGP: usize = 4;
    pub const CHECKSUM_HI: usize = 5;
    pub const CHECKSUM_LO: usize = 6;
}

/// The gradients of one mini-batch: `forward_loss`, then backward into `grads` (zeroed by the
/// caller). The step loop runs the same two halves (backward on its own thread when overlapping),
/// and the replay this, so a replay is bit for bit the original.
pub fn compute_gradients<P: Probe + ?Sized>(
    gpt: &Gpt,
    cfg: &Config,
    params: &[f32],
    acts: &mut model::Activations,
    mb: &Batch,
    grads: &mut ParamGrads<'_>,
    probe: &mut P,
) -> LossStats {
    let (stats, dlogits) = forward_loss(gpt, cfg, params, acts, mb, probe);
    gpt.backward(params, acts, &dlogits, grads, probe);
    stats
}

/// Forward and RL loss of one mini-batch: the loss statistics and the gradient of the loss with
/// respect to the logits, (B, T, V).
pub fn forward_loss<P: Probe + ?Sized>(
    gpt: &Gpt,
    cfg: &Config,
    params: &[f32],
    acts: &mut model::Activations,
    mb: &Batch,
    probe: &mut P,
) -> (LossStats, Vec<f32>) {
    let logits = gpt.forward(params, &mb.inputs, mb.b, mb.t, acts, probe).to_vec();
    let inputs = crate::loss::LossInputs {
        b: mb.b,
        t: mb.t,
        targets: &mb.targets,
        mask: &mb.mask,
        adv: &mb.adv,
        old_logp: &mb.old_logp,
        ref_logp: &mb.ref_logp,
    };
    crate::loss::rl_loss(&cfg.loss, &logits, &inputs, cfg.model.vocab, probe)
}

/// The whole state of one rank's training.
pub struct Trainer {
    /// The config.
    pub cfg: Config,
    /// Its hash (agreed by all ranks through the bus).
    pub config_hash: u64,
    /// The config text, kept for dumps (replay rebuilds the run from it).
    pub config_text: String,
    /// Who this rank is.
    pub info: RankInfo,
    /// Run directory.
    pub run_dir: PathBuf,
    /// The model.
    pub gpt: Gpt,
    /// The transport.
    pub bus: Box<dyn Transport>,
    /// Trainer weights.
    pub params: Vec<f32>,
    /// Adam first moments.
    pub m: Vec<f32>,
    /// Adam second moments.
    pub v: Vec<f32>,
    /// Adam step counter.
    pub adam_t: u64,
    /// `checksum(&params)`, kept up to date by whatever writes `params` (init, resume, the AdamW
    /// pass, which hashes as it writes), so an update never re-reads the weights to hash them.
    params_checksum: u64,
    /// The rollout engine's copy of the weights.
    pub rollout: Vec<f32>,
    /// The frozen reference policy.
    pub reference: Vec<f32>,
    /// Verdict history.
    pub history: History,
    /// Spike detectors of the agreed loss and gradient norm (in that order).
    pub spikes: [SpikeDetector; 2],
    /// Updates whose agreed log-ratio headroom fell under `warn.headroom`.
    pub warnings: u32,
    /// The last update's agreed loss, mean reward and gradient norm, for the step's summary line.
    last: [f64; 3],
    /// Planned faults.
    pub faults: FaultPlan,
    /// Next RL step to run.
    pub step: u64,
    /// Whether bucket reduces overlap backward (`Config::overlap`, resolved for this node).
    pub overlap: bool,
    acts: model::Activations,
    metrics: Option<std::fs::File>,
}

/// How a run ended.
#[derive(Debug)]
pub enum Outcome {
    /// All steps done.
    Done,
    /// The cluster agreed to abort on non-finite gradients.
    Aborted(Box<Report>),
}

impl Trainer {
    /// A fresh trainer at step 0 (or resumed from the latest complete checkpoint in the run dir).
    pub fn new(
        cfg: Config,
        config_hash: u64,
        config_text: String,
        info: RankInfo,
        run_dir: PathBuf,
        bus: Box<dyn Transport>,
        resume: bool,
    ) -> Result<Trainer, WorkerError> {
        let layout = bus.layout().clone();
        let gpt = Gpt::new(&cfg.model, &layout);
        let mut params = vec![0.0; layout.len];
        gpt.init(&mut params, &mut Rng::new(&[cfg.seed, purpose::INIT]));
        let faults = FaultPlan::new(&cfg.faults, info.rank).map_err(WorkerError::Usage)?;
        let max_b = cfg.rl.prompts_per_rank * cfg.rl.group_size;
        let acts = model::Activations::new(&cfg.model, max_b, cfg.rl.response_len + 1);
        let mut t = Trainer {
            m: vec![0.0; layout.len],
            v: vec![0.0; layout.len],
            adam_t: 0,
            params_checksum: checksum(&params),
            rollout: params.clone(),
            reference: params.clone(),
            params,
            history: History::default(),
            spikes: [
                SpikeDetector::new(cfg.spike.window, cfg.spike.z_limit),
                SpikeDetector::new(cfg.spike.window, cfg.spike.z_limit),
            ],
            warnings: 0,
            last: [f64::NAN; 3],
            faults,
            step: 0,
            overlap: cfg.overlap.resolve(info.nodes, info.local_size),
            acts,
            metrics: None,
            gpt,
            bus,
            cfg,
            config_hash,
            config_text,
            info,
            run_dir,
        };
        if t.faults.has_phase(FaultPhase::Reduce) {
            let plan = t.faults.clone();
            t.bus.set_inside_reduce_hook(Box::new(move |at, bucket| {
                if bucket == 0 {
                    plan.at_phase(FaultPhase::Reduce, at);
                }
            }));
        }
        if resume {
            t.resume()?;
        }
        if t.info.rank == 0 {
            let l = t.layout();
            eprintln!(
                "{} parameters in {} buckets, reduced {} ({} ranks)",
                l.slots.iter().map(|s| s.numel).sum::<usize>(),
                l.buckets.len(),
                if t.overlap { "while backward goes on" } else { "after backward" },
                t.info.world
            );
            t.metrics = Some(open_metrics(&t.run_dir, t.step)?);
        }
        Ok(t)
    }

    fn layout(&self) -> &Layout {
        self.bus.layout()
    }

    /// Run the remaining steps.
    pub fn run(&mut self) -> Result<Outcome, WorkerError> {
        while self.step < self.cfg.steps {
            if let Some(report) = self.rl_step()? {
                return Ok(Outcome::Aborted(Box::new(report)));
            }
            if self.info.rank == 0 {
                println!("{}", self.step_summary());
            }
            self.step += 1;
            let every = self.cfg.checkpoint.every;
            if every > 0 && self.step % every == 0 {
                self.save_checkpoint()?;
            }
        }
        Ok(Outcome::Done)
    }

    /// A one-line summary of the step just finished, from the last metrics the ranks agreed on.
    fn step_summary(&self) -> String {
        let [loss, reward, norm] = self.last;
        format!(
            "step {} done: {} updates, loss {loss:.4}, reward {reward:.3}, grad norm {norm:.4}, {} skipped in total",
            self.step,
            self.cfg.rl.epochs * self.cfg.rl.minibatches,
            self.history.skipped
        )
    }

    /// One RL step: rollout, then every update of every epoch. Returns the abort report, if any.
    fn rl_step(&mut self) -> Result<Option<Report>, WorkerError> {
        let (seed, step, rank) = (self.cfg.seed, self.step, self.info.rank as u64);
        if step % self.cfg.rollout_sync_interval == 0 {
            self.rollout.copy_from_slice(&self.params);
        }
        let batch = self.rollout_batch()?;
        let rl = self.cfg.rl.clone();
        let per_mb = batch.b / rl.minibatches;
        for epoch in 0..rl.epochs {
            let mut order: Vec<usize> = (0..batch.b).collect();
            let mut rng = Rng::new(&[seed, purpose::SHUFFLE, step, rank, epoch as u64]);
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            for mb in 0..rl.minibatches {
                let at = StepId { step, minibatch: (epoch * rl.minibatches + mb) as u32, attempt: 0 };
                let rows = &order[mb * per_mb..(mb + 1) * per_mb];
                if let Some(report) = self.update(&batch.select(rows), at)? {
                    return Ok(Some(report));
                }
            }
        }
        Ok(None)
    }

    /// Sample the step's responses with the rollout weights and score them.
    fn rollout_batch(&mut self) -> Result<Batch, WorkerError> {
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
        let mut cache = model::KvCache::new(&self.cfg.model, b, len - 1);
        let mut all_logits = vec![0.0f32; b * (len - 1) * v];
        for t in 2..len {
            let (p0, tn) = (cache.len(), t - cache.len());
            let new: Vec<u32> = seqs.chunks_exact(len).flat_map(|s| s[p0..t].iter().copied()).collect();
            let logits = self.gpt.forward_cached(&self.rollout, &new, b, tn, &mut cache, &mut self.acts);
            for (j, row) in logits.chunks_exact(v).enumerate() {
                all_logits[((j / tn) * (len - 1) + p0 + j % tn) * v..][..v].copy_from_slice(row);
            }
            for i in 0..b {
                let prev = seqs[i * len + t - 1];
                seqs[i * len + t] = if t > 2 && (prev == task::EOS || prev == task::PAD) {
                    task::PAD
                } else {
                    let row = &logits[(i * tn + tn - 1) * v..(i * tn + tn) * v];
                    sample(row, rl.temperature, &mut rng)
                };
            }
        }
        let mut batch = Batch::from_sequences(&seqs, b, rl.group_size, v);
        // Right after a sync the rollout weights ARE the trainer's: the old log-probs are the
        // rollout's own (the same bits as the forward `logp` would run).
        batch.old_logp = if step % self.cfg.rollout_sync_interval == 0 {
            crate::loss::target_logp(&all_logits, &batch.targets, v)
        } else {
            self.logp(&batch, false)
        };
        batch.ref_logp = self.logp(&batch, true);
        Ok(batch)
    }

    /// Log-probs of the batch's targets under the trainer (or reference) weights.
    fn logp(&mut self, batch: &Batch, reference: bool) -> Vec<f32> {
        let w = if reference { &self.reference } else { &self.params };
        let logits = self.gpt.forward(w, &batch.inputs, batch.b, batch.t, &mut self.acts, &mut NoProbe);
        crate::loss::target_logp(logits, &batch.targets, self.cfg.model.vocab)
    }

    /// One optimizer update, with reruns as the verdict asks. Returns the abort report, if any.
    fn update(&mut self, mb: &Batch, mut at: StepId) -> Result<Option<Report>, WorkerError> {
        loop {
            let start = Instant::now();
            let pre_checksum = self.params_checksum;
            let stats = self.forward_backward(mb, at)?;
            let mut values = [0.0; 7];
            values[slot::REWARD] = mean(&mb.reward) as f64;
            values[slot::KL] = stats.kl as f64;
            self.warn_headroom(&stats, at);
            values[slot::MAX_LR_RESPONSE] = stats.max_logratio_response as f64;
            values[slot::MAX_LR_MASKED] = stats.max_logratio_masked as f64;
            values[slot::MIN_LOGP] = stats.min_response_logp as f64;
            values[slot::CHECKSUM_HI] = (pre_checksum >> 32) as f64;
            values[slot::CHECKSUM_LO] = (pre_checksum & 0xffff_ffff) as f64;
            let table = self.bus.agree(at, LocalReport { loss: stats.loss as f64, values })?;
            check_replicas(&table, at)?;
            let policy = self.cfg.policy();
            let mut verdict = decide(&table, self.layout(), &policy, &self.history, at);
            let spike = if verdict.action == Action::Proceed { self.spike(&table) } else { None };
            if spike.is_some() && self.cfg.spike.skip {
                verdict.action = Action::Skip;
            }
            self.history.record(&table, &verdict);
            if let Some(r) = &verdict.report {
                log::warn!("rank {}: {}", self.info.rank, describe(r));
            }
            let lr = self.lr();
            if verdict.action == Action::Proceed {
                self.apply(&table, lr);
            }
            if headroom(&table) < self.cfg.warn.headroom as f64 {
                self.warnings += 1;
            }
            let world = table.world as f64;
            let reward = table.reports.iter().map(|r| r.values[slot::REWARD]).sum::<f64>() / world;
            self.last = [mean_loss(&table), reward, table.grad_norm() / world];
            self.write_metrics(&table, at, verdict.action, spike.as_deref(), lr, start)?;
            self.bus.publish(Progress {
                step: self.step,
                loss: mean_loss(&table) as f32,
                grad_norm: (table.grad_norm() / table.world as f64) as f32,
                skipped: self.history.skipped as u32,
                warnings: self.warnings,
            });
            match verdict.action {
                Action::Proceed | Action::Skip => return Ok(None),
                Action::Rerun => at.attempt += 1,
                Action::Abort => {
                    let report = verdict.report.expect("an abort carries its report");
                    self.write_failure(mb, &table, &report)?;
                    if report.ranks.contains(&self.info.rank) {
                        self.trace_failure(mb, &report)?;
                    }
                    return Ok(Some(report));
                }
            }
        }
    }

    /// Forward, loss and backward onto the bus and the bucket all-reduces (overlapped with backward
    /// when `overlap` says so), with the planned faults of this update. Every fault but the NaN/Inf
    /// plants fires on this thread, never on the backward thread.
    fn forward_backward(&mut self, mb: &Batch, at: StepId) -> Result<LossStats, WorkerError> {
        let Trainer { gpt, cfg, params, acts, faults, bus, overlap, .. } = self;
        faults.at_phase(FaultPhase::Forward, at);
        let (stats, dlogits) = forward_loss(gpt, cfg, params, acts, mb, &mut NoProbe);
        faults.at_phase(FaultPhase::Backward, at);
        let layout = bus.layout().clone();
        let faults = &*faults;
        backward_and_reduce(
            &mut **bus,
            at,
            *overlap,
            &mut |p, grad| faults.poison(at, &layout, p, grad),
            |grads| gpt.backward(params, acts, &dlogits, grads, &mut NoProbe),
            &mut |b| {
                if b == 0 {
                    faults.at_phase(FaultPhase::BetweenBuckets, at);
                }
            },
        )?;
        Ok(stats)
    }

    /// Warn when a log-ratio fed to an exp of the loss comes within `warn.headroom` nats of
    /// overflowing - before anything is non-finite. Each rank names its own term.
    fn warn_headroom(&self, stats: &LossStats, at: StepId) {
        let terms = [
            ("ratio exp(logp - old), response", stats.max_ratio_logratio_response),
            ("ratio exp(logp - old), masked", stats.max_ratio_logratio_masked),
            ("k3 exp(ref - logp), response", stats.max_kl_logratio_response),
            ("k3 exp(ref - logp), masked", stats.max_kl_logratio_masked),
        ];
        for (term, x) in terms {
            let headroom = EXP_OVERFLOW - x;
            if headroom < self.cfg.warn.headroom {
                log::warn!(
                    "rank {}: step {} update {}: log-ratio {x:.2} of the {term} is {headroom:.2} nats from exp overflow (88.72)",
                    self.info.rank,
                    at.step,
                    at.minibatch
                );
            }
        }
    }

    fn lr(&self) -> f32 {
        let o = &self.cfg.optim;
        if o.warmup > 0 && self.adam_t < o.warmup {
            o.lr * (self.adam_t + 1) as f32 / o.warmup as f32
        } else {
            o.lr
        }
    }

    /// Mean of the reduced gradients, clipped by the agreed global norm, then AdamW.
    fn apply(&mut self, table: &HealthTable, lr: f32) {
        let world = table.world as f64;
        let norm = table.grad_norm() / world;
        let clip = self.cfg.optim.grad_clip as f64;
        let coef = if clip > 0.0 && norm > clip { clip / (norm + 1e-6) } else { 1.0 };
        let scale = (coef / world) as f32;
        let grads = self.bus.grads();
        for g in grads.iter_mut() {
            *g *= scale;
        }
        self.adam_t += 1;
        let o = &self.cfg.optim;
        self.params_checksum = gradbus_kernels::ops::adamw_update(
            &mut self.params,
            grads,
            &mut self.m,
            &mut self.v,
            lr,
            o.beta1,
            o.beta2,
            o.eps,
            o.weight_decay,
            self.adam_t,
        );
    }

    /// Feed the agreed loss and gradient norm of a proceeding update to the spike detectors; the
    /// spike, described, if either is one. Every rank feeds the same values: the same answer.
    fn spike(&mut self, table: &HealthTable) -> Option<String> {
        let values = [mean_loss(table), table.grad_norm() / table.world as f64];
        let mut found = None;
        for ((d, x), name) in self.spikes.iter_mut().zip(values).zip(["loss", "grad norm"]) {
            if let Some(s) = d.observe(x) {
                found.get_or_insert(format!("{name} spike {x:.4} ({})", s.rules()));
            }
        }
        found
    }

    fn write_metrics(
        &mut self,
        table: &HealthTable,
        at: StepId,
        action: Action,
        spike: Option<&str>,
        lr: f32,
        start: Instant,
    ) -> Result<(), WorkerError> {
        let Some(f) = self.metrics.as_mut() else { return Ok(()) };
        let world = table.world as f64;
        let avg = |k: usize| table.reports.iter().map(|r| r.values[k]).sum::<f64>() / world;
        let max = |k: usize| table.reports.iter().map(|r| r.values[k]).fold(f64::NEG_INFINITY, f64::max);
        let bad: Vec<usize> =
            (0..table.world).filter(|&r| (0..table.buckets).any(|b| !table.cell(b, r).is_finite())).collect();
        let line = json!({
            "step": at.step,
            "minibatch": at.minibatch,
            "attempt": at.attempt,
            "loss": finite_or_null(mean_loss(table)),
            "reward": avg(slot::REWARD),
            "kl": finite_or_null(avg(slot::KL)),
            "grad_norm": finite_or_null(table.grad_norm() / world),
            "bucket_norms": table.reduced.iter().map(|h| h.sumsq.sqrt() / world).collect::<Vec<_>>(),
            "nonfinite_ranks": bad,
            "max_logratio_response": finite_or_null(max(slot::MAX_LR_RESPONSE)),
            "max_logratio_masked": finite_or_null(max(slot::MAX_LR_MASKED)),
            "headroom": finite_or_null(headroom(table)),
            "spike": spike,
            "skip_cause": (action == Action::Skip).then(|| spike.unwrap_or("non-finite gradients")),
            "min_response_logp": finite_or_null(table.reports.iter().map(|r| r.values[slot::MIN_LOGP]).fold(f64::INFINITY, f64::min)),
            "lr": lr,
            "verdict": action,
            "skipped": self.history.skipped,
            "checksum": format!("{:016x}", self.params_checksum),
            "time_update_ms": start.elapsed().as_secs_f64() * 1e3,
        });
        writeln!(f, "{line}").map_err(|e| WorkerError::io("metrics.jsonl", e))
    }

    fn checkpoint_dir(&self) -> PathBuf {
        self.run_dir.join("checkpoints")
    }

    /// Write the state after `self.step` completed steps (rank 0; replicas are identical).
    fn save_checkpoint(&mut self) -> Result<(), WorkerError> {
        if self.info.rank != 0 {
            return Ok(());
        }
        let dir = self.checkpoint_dir().join(format!("step-{:06}", self.step));
        std::fs::create_dir_all(&dir).map_err(|e| WorkerError::io(&dir.display().to_string(), e))?;
        let meta = json!({
            "step": self.step,
            "adam_t": self.adam_t,
            "config_hash": format!("{:016x}", self.config_hash),
            "layout_hash": format!("{:016x}", self.layout().hash()),
            "spikes": self.spikes,
            "warnings": self.warnings,
            "history": {
                "consecutive_skips": self.history.consecutive_skips,
                "skipped": self.history.skipped,
                "recent": self.history.recent,
                "suspects": self.history.suspects,
            },
        });
        let bytes = tensorfile::encode(
            &meta,
            &[("params", &self.params), ("m", &self.m), ("v", &self.v), ("rollout", &self.rollout)],
        );
        let state = dir.join("state.bin");
        let tmp = dir.join("state.bin.tmp");
        let io = |e| WorkerError::io(&state.display().to_string(), e);
        std::fs::write(&tmp, &bytes).map_err(io)?;
        self.faults.at_checkpoint(self.step);
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io)?;
        std::fs::rename(&tmp, &state).map_err(io)?;
        tensorfile::write_atomic(&dir.join("DONE"), format!("{:016x}\n", self.params_checksum).as_bytes())
            .map_err(io)?;
        log::info!("checkpoint {}", dir.display());
        Ok(())
    }

    /// Load the latest complete checkpoint (one with its DONE marker).
    fn resume(&mut self) -> Result<(), WorkerError> {
        let Some(dir) = latest_checkpoint(&self.checkpoint_dir()) else {
            return Err(WorkerError::Usage(format!(
                "--resume: no complete checkpoint under {} (hint: checkpoints are written every `checkpoint.every` steps)",
                self.checkpoint_dir().display()
            )));
        };
        let l = tensorfile::load(&dir.join("state.bin")).map_err(WorkerError::Usage)?;
        let want = format!("{:016x}", self.layout().hash());
        if l.meta["layout_hash"].as_str() != Some(want.as_str()) {
            return Err(WorkerError::Usage(format!("{}: saved for a different model or bucket layout", dir.display())));
        }
        let get = |n: &str| {
            l.get(n).map(<[f32]>::to_vec).ok_or_else(|| WorkerError::Usage(format!("{}: no tensor {n}", dir.display())))
        };
        self.params = get("params")?;
        self.params_checksum = checksum(&self.params);
        self.m = get("m")?;
        self.v = get("v")?;
        self.rollout = get("rollout")?;
        self.step = l.meta["step"].as_u64().unwrap_or(0);
        self.adam_t = l.meta["adam_t"].as_u64().unwrap_or(0);
        let h = &l.meta["history"];
        self.history.consecutive_skips = h["consecutive_skips"].as_u64().unwrap_or(0) as u32;
        self.history.skipped = h["skipped"].as_u64().unwrap_or(0);
        self.history.recent = h["recent"]
            .as_array()
            .map(|a| a.iter().map(|b| b.as_bool().unwrap_or(false)).collect())
            .unwrap_or_default();
        self.history.suspects = h["suspects"]
            .as_array()
            .map(|a| a.iter().filter_map(|b| b.as_u64()).map(|b| b as usize).collect())
            .unwrap_or_default();
        if let Ok(spikes) = serde_json::from_value(l.meta["spikes"].clone()) {
            self.spikes = spikes;
        }
        self.warnings = l.meta["warnings"].as_u64().unwrap_or(0) as u32;
        if self.info.rank == 0 {
            eprintln!("resumed from {} at step {}", dir.display(), self.step);
        }
        Ok(())
    }

    /// On abort, each rank whose gradients were non-finite recomputes its update with the trace on
    /// (into a scratch buffer: the bus is left as it is) and reports the first non-finite op, in its
    /// log and in `RUN_DIR/trace-rank-K.json`.
    fn trace_failure(&mut self, mb: &Batch, report: &Report) -> Result<(), WorkerError> {
        let layout = self.layout().clone();
        let mut trace =
            crate::forensics::Trace { first: None, param_names: layout.slots.iter().map(|s| s.name.clone()).collect() };
        let mut scratch = vec![0.0; layout.len];
        let grads = &mut ParamGrads::new(&mut scratch, &layout);
        compute_gradients(&self.gpt, &self.cfg, &self.params, &mut self.acts, mb, grads, &mut trace);
        let line = trace
            .first
            .as_ref()
            .map_or_else(|| "no non-finite tensor on recomputation (transient?)".to_string(), |f| f.describe());
        eprintln!(
            "rank {}: trace of step {} update {}: first non-finite: {line}",
            self.info.rank, report.step, report.minibatch
        );
        let p = self.run_dir.join(format!("trace-rank-{}.json", self.info.rank));
        let text = serde_json::to_string_pretty(
            &json!({"step": report.step, "minibatch": report.minibatch, "rank": self.info.rank, "first": trace.first}),
        )
        .expect("json")
            + "\n";
        tensorfile::write_atomic(&p, text.as_bytes()).map_err(|e| WorkerError::io(&p.display().to_string(), e))
    }

    /// On abort: every rank dumps the state at the start of the failing update and its mini-batch;
    /// rank 0 writes `report.json`.
    fn write_failure(&self, mb: &Batch, table: &HealthTable, report: &Report) -> Result<(), WorkerError> {
        let dumps = self.run_dir.join("dumps");
        std::fs::create_dir_all(&dumps).map_err(|e| WorkerError::io(&dumps.display().to_string(), e))?;
        let rank = self.info.rank;
        let local: Vec<_> = (0..table.buckets).map(|b| health_json(table.cell(b, rank))).collect();
        let f32s = |v: &[u32]| v.iter().map(|&t| t as f32).collect::<Vec<f32>>();
        let meta = json!({
            "config": self.config_text,
            "rank": rank,
            "world": self.info.world,
            "step": report.step,
            "minibatch": report.minibatch,
            "attempt": report.attempt,
            "b": mb.b,
            "t": mb.t,
            "loss": table.reports[rank].loss,
            "local_health": local,
            "health_chunks": self.bus.health_chunks(),
            "report": report,
        });
        let (inputs, targets) = (f32s(&mb.inputs), f32s(&mb.targets));
        let path = dumps.join(format!("rank-{rank}.bin"));
        tensorfile::save(
            &path,
            &meta,
            &[
                ("params", &self.params),
                ("inputs", &inputs),
                ("targets", &targets),
                ("mask", &mb.mask),
                ("reward", &mb.reward),
                ("adv", &mb.adv),
                ("old_logp", &mb.old_logp),
                ("ref_logp", &mb.ref_logp),
            ],
        )
        .map_err(|e| WorkerError::io(&path.display().to_string(), e))?;
        if rank == 0 {
            let p = self.run_dir.join("report.json");
            let text = serde_json::to_string_pretty(report).expect("json") + "\n";
            tensorfile::write_atomic(&p, text.as_bytes()).map_err(|e| WorkerError::io(&p.display().to_string(), e))?;
        }
        Ok(())
    }
}

/// JSON of a health cell, sums of squares as bits so replay can compare exactly.
pub fn health_json(h: &Health) -> serde_json::Value {
    json!({"nan": h.nan, "inf": h.inf, "sumsq_bits": format!("{:016x}", h.sumsq.to_bits()), "first_bad": h.first_bad})
}

/// One line about a non-finite report, the same on every rank.
pub fn describe(r: &Report) -> String {
    format!(
        "non-finite gradients at step {} update {} (attempt {}): rank(s) {:?}, bucket #{}, param {} element {}, {} NaN, {} Inf, loss {}; verdict {:?}{}",
        r.step,
        r.minibatch,
        r.attempt,
        r.ranks,
        r.bucket,
        r.param,
        r.element,
        r.nan,
        r.inf,
        if r.loss_finite { "finite" } else { "NOT finite" },
        r.verdict,
        r.classification.as_ref().map(|c| format!(" ({c})")).unwrap_or_default()
    )
}

fn check_replicas(table: &HealthTable, at: StepId) -> Result<(), WorkerError> {
    let sums: Vec<(u64, u64)> = table
        .reports
        .iter()
        .map(|r| (r.values[slot::CHECKSUM_HI] as u64, r.values[slot::CHECKSUM_LO] as u64))
        .collect();
    if sums.iter().any(|s| *s != sums[0]) {
        let odd: Vec<usize> = (0..sums.len()).filter(|&r| sums[r] != sums[0]).collect();
        return Err(WorkerError::Diverged(format!(
            "parameters differ between replicas at step {} update {}: rank(s) {odd:?} differ from rank 0",
            at.step, at.minibatch
        )));
    }
    Ok(())
}

/// ln(f32::MAX) minus the largest log-ratio any rank fed to an exp of the loss.
fn headroom(table: &HealthTable) -> f64 {
    let max = |k: usize| table.reports.iter().map(|r| r.values[k]).fold(f64::NEG_INFINITY, f64::max);
    EXP_OVERFLOW as f64 - max(slot::MAX_LR_RESPONSE).max(max(slot::MAX_LR_MASKED))
}

fn mean(x: &[f32]) -> f32 {
    x.iter().sum::<f32>() / x.len().max(1) as f32
}

fn mean_loss(table: &HealthTable) -> f64 {
    table.reports.iter().map(|r| r.loss).sum::<f64>() / table.world as f64
}

fn finite_or_null(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        json!(format!("{x}"))
    }
}

/// Sample from softmax(logits / temperature).
fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> u32 {
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

/// Metrics file for rank 0; on resume keep only the lines of steps before `step`.
fn open_metrics(run_dir: &Path, step: u64) -> Result<std::fs::File, WorkerError> {
    let path = run_dir.join("metrics.jsonl");
    let io = |e| WorkerError::io(&path.display().to_string(), e);
    let kept: String = if step > 0 {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s < step)
            })
            .map(|l| format!("{l}\n"))
            .collect()
    } else {
        String::new()
    };
    std::fs::write(&path, kept).map_err(io)?;
    std::fs::OpenOptions::new().append(true).open(&path).map_err(io)
}

/// The newest `step-N` directory that has its DONE marker.
pub fn latest_checkpoint(dir: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("DONE").exists() && p.join("state.bin").exists())
        .collect();
    dirs.sort();
    dirs.pop()
}
