//! The step loop of one rank: rollout with the (possibly stale) rollout weights, rewards and group
//! advantages, then epochs x mini-batches of forward, RL loss, backward onto the bus, bucket
//! all-reduces, one agreed verdict, and the update - identical on every rank.
//!
//! The loop owns its parts and passes each what it needs, so the data flow is visible here and the
//! parts import nothing of the loop: the [`TrainState`] (weights, Adam state, replica checksum, on the
//! backend), the [`RolloutEngine`] (rollout weights, reference, KV cache), the [`Judge`] (verdict
//! history, spike detectors, warnings) and the [`MetricsWriter`]. Per update:
//!
//! ```text
//!  state.params --forward_backward--> gradients on the bus --agree--> table --Agreed::new--> agreed
//!  judge.judge(table, agreed) --> verdict --Proceed--> state.apply(reduced gradients, agreed norm)
//!  metrics.write(table, agreed, verdict, state.checksum) ; progress.publish(agreed) ; Abort --> dumps
//! ```
//!
//! Invariants: every random draw is a pure function of (seed, purpose, step, rank), and every
//! reduction has a fixed order, so the same config, seed and world size give bitwise-identical
//! metrics and weights, also after resume. Replicas are checked: each rank's parameter checksum
//! travels in the agreement, and a mismatch stops the job before a diverged replica trains on.

use std::path::PathBuf;
use std::time::Instant;

use gradbus_collectives::sdc::StateCheck;
use gradbus_collectives::shm::ProgressWriter;
use gradbus_collectives::{
    Action, BusBackend, Cause, GradBus, Layout, LocalScalars, Progress, Report, StateFault, StepId,
};
use gradbus_kernels::checksum::Prefix;
use gradbus_kernels::rng::Rng;

use crate::checkpoint;
use crate::config::Config;
use crate::error::WorkerError;
use crate::failure::{describe, trace_failure, write_failure};
use crate::faults::{FaultPlan, FlipTarget};
use crate::gradients::Work;
use crate::judge::{Judge, Judged};
use crate::metrics::{MetricsWriter, UpdateRecord};
use crate::model::Gpt;
use crate::rank::RankInfo;
use crate::rollout::{purpose, RolloutEngine};
use crate::state::TrainState;
use crate::task::Batch;
use crate::update::{check_replicas, forward_backward, warn_headroom, Agreed, UpdateValues};

/// The whole state of one rank's training on backend `B`.
pub struct Trainer<B: BusBackend> {
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
    /// Where the gradients go: the backend's bus (`BusBackend::Bus`), and through it the transport.
    pub bus: B::Bus,
    /// This rank's cell of the launcher's progress bar, where the bus has one (a shm segment).
    progress: Option<ProgressWriter>,
    /// Next RL step to run.
    pub step: u64,
    be: B,
    gpt: Gpt,
    work: Work<B>,
    state: TrainState<B>,
    rollout: RolloutEngine<B>,
    judge: Judge,
    metrics: MetricsWriter,
    faults: FaultPlan,
    /// Whether bucket reduces overlap backward (`Config::overlap`, resolved for this node).
    overlap: bool,
    /// The last update's agreed numbers, for the step's summary line.
    last: Option<Agreed>,
    /// The pieces the transport's reducers checksum the reduced gradients in
    /// (`transport::hash_pieces`), which the optimizer's pass checksums too.
    hash_pieces: Vec<std::ops::Range<usize>>,
}

/// Re-executions of one update (or of a step from its rollout) for replica repairs before the job
/// stops: a replica that stays damaged after that many copies is not a transient fault.
const MAX_REPAIRS: u32 = 3;

/// How one update ended.
enum UpdateEnd {
    /// Proceeded or skipped: the next update.
    Done,
    /// The cluster agreed to abort.
    Aborted(Report),
    /// A replica was repaired at the step's first update: run the step again from its rollout,
    /// its first update as this attempt.
    RedoStep(u32),
}

/// What one rank runs, besides its backend and its bus.
pub struct Job {
    /// The config.
    pub cfg: Config,
    /// Its hash, with the layout's folded in (agreed by all ranks through the bus).
    pub config_hash: u64,
    /// The canonical config text (replay rebuilds the run from it).
    pub config_text: String,
    /// Who this rank is.
    pub info: RankInfo,
    /// Run directory.
    pub run_dir: PathBuf,
    /// This rank's planned faults.
    pub faults: FaultPlan,
    /// Continue from the run directory's latest complete checkpoint.
    pub resume: bool,
}

/// How a run ended.
#[derive(Debug)]
pub enum Outcome {
    /// All steps done.
    Done,
    /// The cluster agreed to abort on non-finite gradients.
    Aborted(Box<Report>),
}

impl<B: BusBackend> Trainer<B> {
    /// A fresh trainer at step 0 (or resumed from the latest complete checkpoint in the run dir)
    /// for `job`, on backend `be` and its `bus` (opened with the job's fault hook inside the bucket
    /// reduce, where the transport has one).
    pub fn new(be: B, bus: B::Bus, progress: Option<ProgressWriter>, job: Job) -> Result<Trainer<B>, WorkerError> {
        let Job { cfg, config_hash, config_text, info, run_dir, faults, resume } = job;
        let layout = bus.transport().layout().clone();
        let gpt = Gpt::new(&cfg.model, &layout);
        let mut init = vec![0.0; layout.len];
        gpt.init(&mut init, &mut Rng::new(&[cfg.seed, purpose::INIT]));
        let (mut state, mut rollout) = (TrainState::new(&be, &init, None, 0), RolloutEngine::new(&be, &cfg, &init));
        let (mut judge, mut step) = (Judge::new(&cfg, layout.buckets.len(), info.world, info.rank), 0);
        if resume {
            let r = checkpoint::restore(&run_dir, &layout, &cfg, &config_text, &info)?;
            state = TrainState::new(&be, &r.params, Some((&r.m, &r.v)), r.adam_t);
            be.write(be.all_mut(&mut rollout.weights), &r.rollout);
            (judge, step) = (r.judge, r.step);
        }
        let overlap = cfg.overlap.resolve(info.nodes, info.local_size);
        if info.rank == 0 {
            eprintln!(
                "{} parameters in {} buckets, reduced {} ({} ranks)",
                layout.slots.iter().map(|s| s.numel).sum::<usize>(),
                layout.buckets.len(),
                if overlap { "while backward goes on" } else { "after backward" },
                info.world
            );
        }
        let updates_per_step = (cfg.rl.epochs * cfg.rl.minibatches) as u64;
        let metrics = MetricsWriter::open(&run_dir, step, updates_per_step, info.rank)?;
        let max_b = cfg.rl.prompts_per_rank * cfg.rl.group_size;
        let work = Work::new(&be, &cfg, max_b, cfg.rl.response_len + 1);
        Ok(Trainer {
            be,
            gpt,
            work,
            state,
            rollout,
            judge,
            metrics,
            faults,
            overlap,
            last: None,
            hash_pieces: gradbus_collectives::hash_pieces(&layout, bus.transport().health_chunks()),
            bus,
            progress,
            step,
            cfg,
            config_hash,
            config_text,
            info,
            run_dir,
        })
    }

    fn layout(&self) -> &Layout {
        self.bus.transport().layout()
    }

    /// Run the remaining steps. After the last one, one more agreement checks (and repairs) the
    /// replicas, whose last update no later update would check.
    pub fn run(&mut self) -> Result<Outcome, WorkerError> {
        while self.step < self.cfg.steps {
            if let Some(report) = self.rl_step()? {
                return Ok(Outcome::Aborted(Box::new(report)));
            }
            if self.info.rank == 0 {
                println!("{}", self.step_summary());
            }
            self.step += 1;
            if self.step == self.cfg.steps {
                if let Some(report) = self.final_check()? {
                    return Ok(Outcome::Aborted(Box::new(report)));
                }
            }
            let every = self.cfg.checkpoint.every;
            if every > 0 && self.step % every == 0 && self.info.rank == 0 {
                // Never a damaged replica into a checkpoint: rank 0 checks its own state first
                // (the next update's agreement repairs it; this checkpoint is left out).
                let own = self.sdc_checks().then(|| self.state.self_check(&self.be, None).1).filter(|own| own.any());
                if let Some(own) = own {
                    log::warn!(
                        "rank 0: checkpoint of step {} not written: its own state is damaged ({own:?}); the next update repairs it",
                        self.step
                    );
                } else {
                    self.save_checkpoint()?;
                }
            }
        }
        Ok(Outcome::Done)
    }

    /// Whether the replica checks run: `sdc.replicas` and more than one rank to compare with.
    fn sdc_checks(&self) -> bool {
        self.cfg.sdc.replicas && self.info.world > 1
    }

    /// The replica check of the state the last update left: an agreement on zeroed gradients (one
    /// reduce and one agreement per run), repairing a damaged replica; every rank then logs the
    /// checksum of its weights as read back. Returns the abort report when no replica can be told
    /// healthy.
    fn final_check(&mut self) -> Result<Option<Report>, WorkerError> {
        if !self.sdc_checks() {
            return Ok(None);
        }
        let at = StepId { step: self.cfg.steps, minibatch: 0, attempt: 0 };
        for attempt in 0..=MAX_REPAIRS {
            let at = StepId { attempt, ..at };
            let (replica, state) = self.state.self_check(&self.be, None);
            let bus = self.bus.transport_mut();
            bus.grads().fill(0.0);
            for b in 0..bus.layout().buckets.len() {
                bus.allreduce_bucket(at, b)?;
            }
            let values = UpdateValues::default().to_report(self.info.rank);
            let report = LocalScalars { loss: 0.0, values, replica, state: state.word() };
            let table = bus.agree(at, report)?;
            match gradbus_collectives::sdc::check_state(&table) {
                StateCheck::Healthy => {
                    eprintln!("rank {}: final weights checksum {replica:016x} (read back)", self.info.rank);
                    return Ok(None);
                }
                StateCheck::Repair { donor, damaged, why } => {
                    self.judge.verdicts.sdc.detections += 1;
                    log::warn!(
                        "rank {}: after the last update: rank(s) {damaged:?} damaged ({}); repaired from rank {donor}",
                        self.info.rank,
                        why.join("; ")
                    );
                    self.repair(at, donor)?;
                }
                StateCheck::Undecided { replicas } => {
                    let mut r = gradbus_collectives::empty_report(at, Action::Abort);
                    (r.cause, r.ranks) = (Cause::Replicas, replicas.iter().map(|&(k, _)| k).collect());
                    log::warn!("rank {}: {}", self.info.rank, describe(&r));
                    return Ok(Some(r));
                }
            }
        }
        Err(WorkerError::Diverged(format!(
            "the replicas stayed damaged after {MAX_REPAIRS} repairs at the end of the run"
        )))
    }

    /// Copy the weights and both Adam moments from rank `donor` into every rank (collectively; the
    /// gradient buffer is lost). A rank whose copy differed logs where: the count, the first
    /// element, its value and the donor's, and the bits that differ.
    fn repair(&mut self, at: StepId, donor: usize) -> Result<(), WorkerError> {
        let (be, rank) = (&self.be, self.info.rank);
        let mut copies = Vec::with_capacity(3);
        for (name, buf) in [("weights", &self.state.params), ("adam m", &self.state.m), ("adam v", &self.state.v)] {
            let mine = be.to_host(be.all(buf)).into_owned();
            let mut x = mine.clone();
            self.bus.transport_mut().broadcast_from(at, donor, &mut x)?;
            let differ: Vec<usize> = (0..x.len()).filter(|&i| x[i].to_bits() != mine[i].to_bits()).collect();
            if let Some(&i) = differ.first() {
                let (p, e) = self.layout().locate(i).map_or(("(padding)".to_string(), i), |(s, e)| (s.name.clone(), e));
                log::warn!(
                    "rank {rank}: repair at step {} update {}: {name} differed from rank {donor}'s in {} element(s), first {p}[{e}]: {:e} here, {:e} there (bits {:#010x} differ)",
                    at.step,
                    at.minibatch,
                    differ.len(),
                    mine[i],
                    x[i],
                    mine[i].to_bits() ^ x[i].to_bits()
                );
            }
            copies.push(x);
        }
        self.state.adopt(be, &copies[0], &copies[1], &copies[2]);
        Ok(())
    }

    /// A one-line summary of the step just finished, from the last numbers the ranks agreed on.
    fn step_summary(&self) -> String {
        let (loss, reward, norm) =
            self.last.as_ref().map_or((f64::NAN, f64::NAN, f64::NAN), |a| (a.loss, a.values.reward, a.grad_norm));
        format!(
            "step {} done: {} updates, loss {loss:.4}, reward {reward:.3}, grad norm {norm:.4}, {} skipped in total",
            self.step,
            self.cfg.rl.epochs * self.cfg.rl.minibatches,
            self.judge.verdicts.history.skipped
        )
    }

    /// Write the state after `self.step` completed steps (rank 0; replicas are identical).
    fn save_checkpoint(&self) -> Result<(), WorkerError> {
        let (be, p) = (&self.be, &self.state);
        let host = |buf| be.to_host(be.all(buf));
        let (params, m, v, rollout) = (host(&p.params), host(&p.m), host(&p.v), host(&self.rollout.weights));
        let state = checkpoint::State {
            step: self.step,
            adam_t: p.adam_t,
            params: &params,
            m: &m,
            v: &v,
            rollout: &rollout,
            params_checksum: p.checksum(),
            judge: &self.judge,
        };
        let run = crate::rundir::record(&self.config_text, self.info.world);
        checkpoint::save(&self.run_dir, self.config_hash, self.layout(), &state, run, &self.faults)
    }

    /// One RL step: rollout, then every update of every epoch. Returns the abort report, if any.
    /// A replica repaired at the step's first update may have sampled with damaged weights: the
    /// step starts again from the rollout (the first update then counts as a re-execution).
    fn rl_step(&mut self) -> Result<Option<Report>, WorkerError> {
        let mut attempt = 0;
        'step: loop {
            let (seed, step, rank) = (self.cfg.seed, self.step, self.info.rank as u64);
            let synced = step % self.cfg.rollout_sync_interval == 0;
            if synced {
                self.rollout.sync(&self.be, &self.state.params);
            }
            let (be, gpt, cfg) = (&self.be, &self.gpt, &self.cfg);
            let batch = self.rollout.batch(be, gpt, cfg, step, rank, synced, &self.state.params, &mut self.work.acts);
            let rl = self.cfg.rl.clone();
            let per_mb = batch.b / rl.minibatches;
            for epoch in 0..rl.epochs {
                let mut order: Vec<usize> = (0..batch.b).collect();
                let mut rng = Rng::new(&[seed, purpose::SHUFFLE, step, rank, epoch as u64]);
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i + 1));
                }
                for mb in 0..rl.minibatches {
                    let minibatch = (epoch * rl.minibatches + mb) as u32;
                    let at = StepId { step, minibatch, attempt: if minibatch == 0 { attempt } else { 0 } };
                    let rows = &order[mb * per_mb..(mb + 1) * per_mb];
                    match self.update(&batch.select(rows), at)? {
                        UpdateEnd::Done => {}
                        UpdateEnd::Aborted(report) => return Ok(Some(report)),
                        UpdateEnd::RedoStep(next) if next <= MAX_REPAIRS => {
                            attempt = next;
                            continue 'step;
                        }
                        UpdateEnd::RedoStep(_) => {
                            return Err(WorkerError::Diverged(format!(
                                "step {step}: the replicas stayed damaged after {MAX_REPAIRS} repairs"
                            )))
                        }
                    }
                }
            }
            return Ok(None);
        }
    }

    /// One optimizer update, with reruns and replica repairs as the verdict asks.
    fn update(&mut self, mb: &Batch, mut at: StepId) -> Result<UpdateEnd, WorkerError> {
        let rank = self.info.rank;
        loop {
            let (be, start) = (&self.be, Instant::now());
            let checks = self.sdc_checks();
            let (gpt, cfg, faults) = (&self.gpt, &self.cfg, &self.faults);
            let params = &self.state.params;
            // The weights the previous update wrote, hashed as backward reads them (each from cache,
            // no pass of its own), and the consumed gradients against their reference: the state
            // that update left, checked before this one's agreement.
            let mut read = checks.then(Prefix::new);
            let (work, bus, overlap) = (&mut self.work, &mut self.bus, self.overlap);
            let stats = forward_backward(be, gpt, cfg, params, work, bus, faults, overlap, mb, at, read.as_mut())?;
            let (replica, state) = match checks {
                true => self.state.self_check(be, read),
                false => (self.state.checksum(), StateFault::default()),
            };
            warn_headroom(&stats, cfg.warn.headroom, rank, at);
            let values = UpdateValues::local(mb, &stats).to_report(rank);
            let report = LocalScalars { loss: stats.loss as f64, values, replica, state: state.word() };
            let table = self.bus.transport_mut().agree(at, report)?;
            if !checks {
                check_replicas(&table, at)?;
            }
            let agreed = Agreed::new(&table);
            let Judged { verdict, spike, warning, sdc: finding } =
                self.judge.judge(&table, &agreed, self.bus.transport().layout(), cfg, at);
            if let Some(o) = &warning {
                self.metrics.warn(at, o, agreed.headroom_rank)?;
            }
            if let Some(r) = &verdict.report {
                log::warn!("rank {rank}: {}", describe(r));
            }
            if let Some(f) = &finding {
                log::warn!("rank {rank}: {}", f.text);
            }
            let lr = self.state.lr(&cfg.optim);
            if verdict.action == Action::Proceed {
                let grads = self.bus.reduced_grads(be);
                let (norm, world) = (agreed.grad_norm, agreed.world);
                // The consumed gradients' hashes only where the replica checks will read them.
                let pieces = if checks { &self.hash_pieces[..] } else { &[] };
                self.state.apply(be, grads, norm, world, &cfg.optim, lr, pieces, &table.reference);
                if faults.has_flip(FlipTarget::Weight) {
                    let layout = self.bus.transport().layout();
                    faults.flip_in(be, at, layout, FlipTarget::Weight, be.all_mut(&mut self.state.params));
                }
            }
            let record = UpdateRecord {
                at,
                action: verdict.action,
                spike: spike.as_deref(),
                sdc: finding.as_ref().map(|f| f.text.as_str()),
                lr,
                skipped: self.judge.verdicts.history.skipped,
                checksum: self.state.checksum(),
                start,
            };
            self.metrics.write(&table, &agreed, &record)?;
            if let Some(cell) = self.progress.as_mut() {
                cell.publish(Progress {
                    step: self.step,
                    loss: agreed.loss as f32,
                    grad_norm: agreed.grad_norm as f32,
                    skipped: self.judge.verdicts.history.skipped as u32,
                    warnings: self.judge.warnings,
                });
            }
            self.last = Some(agreed);
            match verdict.action {
                Action::Proceed | Action::Skip => return Ok(UpdateEnd::Done),
                Action::Rerun => at.attempt += 1,
                Action::Repair => {
                    let (donor, _) = finding.and_then(|f| f.repair).expect("a repair names its donor");
                    self.repair(at, donor)?;
                    if at.minibatch == 0 {
                        return Ok(UpdateEnd::RedoStep(at.attempt + 1));
                    }
                    if at.attempt >= MAX_REPAIRS {
                        return Err(WorkerError::Diverged(format!(
                            "step {} update {}: the replicas stayed damaged after {MAX_REPAIRS} repairs",
                            at.step, at.minibatch
                        )));
                    }
                    at.attempt += 1;
                }
                Action::Abort => {
                    let report = verdict.report.expect("an abort carries its report");
                    let params = be.to_host(be.all(&self.state.params));
                    let chunks = self.bus.transport().health_chunks();
                    write_failure(&self.run_dir, &self.info, &self.config_text, chunks, &params, mb, &table, &report)?;
                    let nonfinite = matches!(report.cause, Cause::LocalGradients | Cause::SumOverflow);
                    if nonfinite && report.ranks.contains(&rank) {
                        let (layout, params) = (self.bus.transport().layout(), &self.state.params);
                        trace_failure(be, gpt, cfg, params, &mut self.work, layout, mb, &report, &self.run_dir, rank)?;
                    }
                    return Ok(UpdateEnd::Aborted(report));
                }
            }
        }
    }
}
