//! The step loop of one rank: rollout with the (possibly stale) rollout weights, rewards and group
//! advantages, then epochs x mini-batches of forward, RL loss, backward onto the bus, bucket
//! all-reduces, one agreed verdict, and the update - identical on every rank.
//!
//! Invariants: every random draw is a pure function of (seed, purpose, step, rank), and every
//! reduction has a fixed order, so the same config, seed and world size give bitwise-identical
//! metrics and weights, also after resume. Replicas are checked: each rank's parameter checksum
//! travels in the agreement, and a mismatch stops the job before a diverged replica trains on.

use std::path::PathBuf;

use gradbus_collectives::spikes::SpikeDetector;
use gradbus_collectives::{History, Layout, Report, StepId, Transport};
use gradbus_kernels::backend::Cpu;
use gradbus_kernels::rng::Rng;

use crate::config::Config;
use crate::faults::{FaultPhase, FaultPlan};
use crate::gradients::Work;
use crate::metrics::open_metrics;
use crate::model::Gpt;
use crate::rank::RankInfo;
use crate::rollout::purpose;
use crate::WorkerError;

/// The replica checksum of the weights (kernels/src/checksum.rs).
pub use gradbus_kernels::checksum::checksum;

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
    pub(crate) params_checksum: u64,
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
    pub(crate) last: [f64; 3],
    /// Planned faults.
    pub faults: FaultPlan,
    /// Next RL step to run.
    pub step: u64,
    /// Whether bucket reduces overlap backward (`Config::overlap`, resolved for this node).
    pub overlap: bool,
    pub(crate) work: Work<Cpu>,
    pub(crate) metrics: Option<std::fs::File>,
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
        let faults = FaultPlan::new(&cfg.faults, info.rank)?;
        let max_b = cfg.rl.prompts_per_rank * cfg.rl.group_size;
        let work = Work::new(&Cpu, &cfg, max_b, cfg.rl.response_len + 1);
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
            work,
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

    pub(crate) fn layout(&self) -> &Layout {
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
}
