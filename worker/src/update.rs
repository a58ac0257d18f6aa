//! One optimizer update: forward and backward onto the bus, the agreement, the verdict, clipping by
//! the agreed global norm and AdamW.
//!
//! Invariant: every rank feeds the same agreed table to `decide`, the spike detectors and the
//! optimizer, so every rank takes the same action and keeps bitwise-identical weights; each rank's
//! parameter checksum travels in the agreement and a mismatch stops the job.

use std::time::Instant;

use gradbus_kernels::backend::Cpu;

use gradbus_collectives::{backward_and_reduce, decide, Action, HealthTable, LocalReport, Progress, Report, StepId};

use crate::failure::describe;
use crate::faults::FaultPhase;
use crate::gradients::{backward, forward_loss};
use crate::loss::{LossStats, EXP_OVERFLOW};
use crate::metrics::headroom;
use crate::probe::NoProbe;
use crate::task::Batch;
use crate::train::Trainer;
use crate::WorkerError;

impl Trainer {
    /// One optimizer update, with reruns as the verdict asks. Returns the abort report, if any.
    pub(crate) fn update(&mut self, mb: &Batch, mut at: StepId) -> Result<Option<Report>, WorkerError> {
        loop {
            let start = Instant::now();
            let pre_checksum = self.params_checksum;
            let stats = self.forward_backward(mb, at)?;
            self.warn_headroom(&stats, at);
            let values = UpdateValues {
                reward: mean(&mb.reward) as f64,
                kl: stats.kl as f64,
                max_logratio_response: stats.max_logratio_response as f64,
                max_logratio_masked: stats.max_logratio_masked as f64,
                min_response_logp: stats.min_response_logp as f64,
            };
            let report = LocalReport { loss: stats.loss as f64, values: values.to_wire(), replica: pre_checksum };
            let table = self.bus.agree(at, report)?;
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
            self.last = [table.mean_loss(), UpdateValues::agreed(&table).reward, table.grad_norm() / world];
            self.write_metrics(&table, at, verdict.action, spike.as_deref(), lr, start)?;
            self.bus.publish(Progress {
                step: self.step,
                loss: table.mean_loss() as f32,
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
    pub(crate) fn forward_backward(&mut self, mb: &Batch, at: StepId) -> Result<LossStats, WorkerError> {
        let Trainer { gpt, cfg, params, work, faults, bus, overlap, .. } = self;
        faults.at_phase(FaultPhase::Forward, at);
        let stats = forward_loss(&Cpu, gpt, cfg, params, work, mb, &mut NoProbe);
        faults.at_phase(FaultPhase::Backward, at);
        let layout = bus.layout().clone();
        let faults = &*faults;
        backward_and_reduce(
            &mut **bus,
            at,
            *overlap,
            &mut |p, grad| faults.poison(at, &layout, p, grad),
            |grads| backward(&Cpu, gpt, params, work, mb, grads, &mut NoProbe),
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
    pub(crate) fn warn_headroom(&self, stats: &LossStats, at: StepId) {
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

    pub(crate) fn lr(&self) -> f32 {
        let o = &self.cfg.optim;
        if o.warmup > 0 && self.adam_t < o.warmup {
            o.lr * (self.adam_t + 1) as f32 / o.warmup as f32
        } else {
            o.lr
        }
    }

    /// Mean of the reduced gradients, clipped by the agreed global norm, then AdamW.
    pub(crate) fn apply(&mut self, table: &HealthTable, lr: f32) {
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
    pub(crate) fn spike(&mut self, table: &HealthTable) -> Option<String> {
        let values = [table.mean_loss(), table.grad_norm() / table.world as f64];
        let mut found = None;
        for ((d, x), name) in self.spikes.iter_mut().zip(values).zip(["loss", "grad norm"]) {
            if let Some(s) = d.observe(x) {
                found.get_or_insert(format!("{name} spike {x:.4} ({})", s.rules()));
            }
        }
        found
    }
}

/// What each rank contributes to the agreement besides its loss and its replica checksum. It
/// travels as `LocalReport::values`; the `wire` indices below are the only place that knows the
/// order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateValues {
    /// Mean reward of the rank's mini-batch.
    pub reward: f64,
    /// The rank's KL estimate.
    pub kl: f64,
    /// Largest log-ratio of a response position fed to an exp.
    pub max_logratio_response: f64,
    /// Largest log-ratio of a masked position fed to an exp.
    pub max_logratio_masked: f64,
    /// Smallest log-prob of a response token.
    pub min_response_logp: f64,
}

/// Positions of [`UpdateValues`]' fields in `LocalReport::values`.
mod wire {
    pub const REWARD: usize = 0;
    pub const KL: usize = 1;
    pub const MAX_LR_RESPONSE: usize = 2;
    pub const MAX_LR_MASKED: usize = 3;
    pub const MIN_LOGP: usize = 4;
}

impl UpdateValues {
    /// The values of `LocalReport::values`.
    pub fn to_wire(self) -> [f64; LocalReport::VALUES] {
        let mut v = [0.0; LocalReport::VALUES];
        v[wire::REWARD] = self.reward;
        v[wire::KL] = self.kl;
        v[wire::MAX_LR_RESPONSE] = self.max_logratio_response;
        v[wire::MAX_LR_MASKED] = self.max_logratio_masked;
        v[wire::MIN_LOGP] = self.min_response_logp;
        v
    }

    /// The agreed values of every rank, from the agreement's summary (present on both the summary
    /// and the table path): reward and KL averaged over ranks, the extremes of the others.
    pub fn agreed(table: &HealthTable) -> UpdateValues {
        let v = &table.summary.values;
        UpdateValues {
            reward: table.mean_value(wire::REWARD),
            kl: table.mean_value(wire::KL),
            max_logratio_response: v[wire::MAX_LR_RESPONSE].max(),
            max_logratio_masked: v[wire::MAX_LR_MASKED].max(),
            min_response_logp: v[wire::MIN_LOGP].min(),
        }
    }
}

pub(crate) fn check_replicas(table: &HealthTable, at: StepId) -> Result<(), WorkerError> {
    let odd = table.replica_outliers();
    if !odd.is_empty() {
        return Err(WorkerError::Diverged(format!(
            "parameters differ between replicas at step {} update {}: rank(s) {odd:?} differ from rank 0",
            at.step, at.minibatch
        )));
    }
    Ok(())
}

pub(crate) fn mean(x: &[f32]) -> f32 {
    x.iter().sum::<f32>() / x.len().max(1) as f32
}
