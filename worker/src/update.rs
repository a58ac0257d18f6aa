//! One optimizer update's pieces that need no state of the step loop: its gradients onto the bus
//! ([`forward_backward`]), what a rank contributes to the agreement ([`UpdateValues`]) and what the
//! cluster agreed on ([`Agreed`]), the headroom warning and the replica check.
//!
//! Invariant: every number the verdict, the spike detectors, the optimizer, the metrics line and the
//! progress bar use is computed once per update, in [`Agreed::new`], from the agreed table; every
//! rank has the same table, so every rank computes the same numbers.

use gradbus_collectives::forecast::{ranked, unranked};
use gradbus_collectives::{BusBackend, GradBus, HealthTable, StepId, ValueNames};
use gradbus_kernels::checksum::Prefix;

use crate::config::Config;
use crate::error::WorkerError;
use crate::faults::{FaultPhase, FaultPlan, FlipTarget};
use crate::gradients::{backward, forward_loss, Work};
use crate::loss::{LossStats, EXP_OVERFLOW};
use crate::model::Gpt;
use crate::probe::NoProbe;
use crate::task::Batch;

/// Forward, loss and backward onto the bus and the bucket all-reduces (overlapped with backward
/// when `overlap` says so), with the planned faults of this update: a `reduced` bit flip lands in
/// this rank's reduced gradients after the last reduce. Every fault but the plants into the local
/// gradients fires on this thread, never on the backward thread. Given `hash`, backward absorbs the
/// weights into it as it reads them (the replica check's read-back without a pass of its own).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_backward<B: BusBackend>(
    be: &B,
    gpt: &Gpt,
    cfg: &Config,
    params: &B::Buf,
    work: &mut Work<B>,
    bus: &mut B::Bus,
    faults: &FaultPlan,
    overlap: bool,
    mb: &Batch,
    at: StepId,
    hash: Option<&mut Prefix>,
) -> Result<LossStats, WorkerError> {
    faults.at_phase(FaultPhase::Forward, at);
    let stats = forward_loss(be, gpt, cfg, params, work, mb, &mut NoProbe);
    faults.at_phase(FaultPhase::Backward, at);
    let layout = bus.transport().layout().clone();
    bus.backward_and_reduce(
        be,
        at,
        overlap,
        &mut |p, grad| faults.poison(be, at, &layout, p, grad),
        |grads| backward(be, gpt, params, work, mb, grads, &mut NoProbe, hash),
        &mut |b| {
            if b == 0 {
                faults.at_phase(FaultPhase::BetweenBuckets, at);
            }
        },
    )?;
    if faults.has_flip(FlipTarget::Reduced) {
        faults.flip_in(be, at, &layout, FlipTarget::Reduced, bus.reduced_grads(be));
    }
    Ok(stats)
}

/// Warn when a log-ratio fed to an exp of the loss comes within `warn.headroom` nats of
/// overflowing - before anything is non-finite. Each rank names its own term.
pub(crate) fn warn_headroom(stats: &LossStats, margin: f32, rank: usize, at: StepId) {
    let terms = [
        ("ratio exp(logp - old), response", stats.max_ratio_logratio_response),
        ("ratio exp(logp - old), masked", stats.max_ratio_logratio_masked),
        ("k3 exp(ref - logp), response", stats.max_kl_logratio_response),
        ("k3 exp(ref - logp), masked", stats.max_kl_logratio_masked),
    ];
    for (term, x) in terms {
        let headroom = EXP_OVERFLOW - x;
        if headroom < margin {
            log::warn!(
                "rank {rank}: step {} update {}: log-ratio {x:.2} of the {term} is {headroom:.2} nats from exp overflow (88.72)",
                at.step,
                at.minibatch
            );
        }
    }
}

/// What each rank contributes to the agreement besides its loss and its replica checksum. It
/// travels as `LocalScalars::values`, by name: [`UpdateValues::named`] is the only place that knows
/// the order, and the agreed values are read back by name.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
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

impl UpdateValues {
    /// This rank's values: its mini-batch's mean reward and its loss statistics.
    pub fn local(mb: &Batch, stats: &LossStats) -> UpdateValues {
        UpdateValues {
            reward: mean(&mb.reward) as f64,
            kl: stats.kl as f64,
            max_logratio_response: stats.max_logratio_response as f64,
            max_logratio_masked: stats.max_logratio_masked as f64,
            min_response_logp: stats.min_response_logp as f64,
        }
    }

    /// The values by name, in the order they travel (`LocalScalars::values`). The two largest
    /// log-ratios travel with `rank` (`forecast::ranked`: the agreed maximum names its rank); a
    /// finite log-ratio keeps its bits through it, a NaN one counts as +inf (past the ceiling: a
    /// warning, where the agreement used to ignore a NaN rank's maximum).
    fn named(self, rank: usize) -> [(&'static str, f64); 5] {
        [
            ("reward", self.reward),
            ("kl", self.kl),
            ("max_logratio_response", ranked(self.max_logratio_response, rank)),
            ("max_logratio_masked", ranked(self.max_logratio_masked, rank)),
            ("min_response_logp", self.min_response_logp),
        ]
    }

    /// The names the transport is opened with.
    pub fn names() -> ValueNames {
        ValueNames::new(&UpdateValues::default().named(0).map(|(name, _)| name))
    }

    /// The values of `LocalScalars::values` of `rank`, in the order of [`UpdateValues::names`].
    pub fn to_report(self, rank: usize) -> Vec<f64> {
        self.named(rank).iter().map(|&(_, v)| v).collect()
    }

    /// The agreed values of every rank, from the agreement's summary (present on both the summary
    /// and the table path): reward and KL averaged over ranks, the extremes of the others; and the
    /// rank holding the largest log-ratio.
    pub fn agreed(table: &HealthTable) -> (UpdateValues, usize) {
        let (response, at_response) = unranked(table.value("max_logratio_response").max());
        let (masked, at_masked) = unranked(table.value("max_logratio_masked").max());
        let values = UpdateValues {
            reward: table.mean_value("reward"),
            kl: table.mean_value("kl"),
            max_logratio_response: response,
            max_logratio_masked: masked,
            min_response_logp: table.value("min_response_logp").min(),
        };
        (values, if masked > response { at_masked } else { at_response })
    }
}

/// The numbers of one update that every rank agreed on, computed once from the agreed table.
#[derive(Clone, Debug, PartialEq)]
pub struct Agreed {
    /// Ranks.
    pub world: usize,
    /// Mean loss over ranks.
    pub loss: f64,
    /// The agreed [`UpdateValues`].
    pub values: UpdateValues,
    /// Norm of the MEAN gradient over ranks (the reduced buffer holds the sum): what clipping,
    /// the spike detector, the metrics and the progress bar use.
    pub grad_norm: f64,
    /// Each bucket's norm of the mean gradient.
    pub bucket_norms: Vec<f64>,
    /// ln(f32::MAX) minus the largest log-ratio any rank fed to an exp of the loss.
    pub headroom: f64,
    /// The (lowest) rank that fed it.
    pub headroom_rank: usize,
}

impl Agreed {
    /// The agreed numbers of `table`.
    pub fn new(table: &HealthTable) -> Agreed {
        let world = table.world as f64;
        let (values, headroom_rank) = UpdateValues::agreed(table);
        Agreed {
            world: table.world,
            loss: table.mean_loss(),
            values,
            grad_norm: table.grad_norm() / world,
            bucket_norms: table.reduced.iter().map(|h| h.sumsq.sqrt() / world).collect(),
            headroom: EXP_OVERFLOW as f64 - values.max_logratio_response.max(values.max_logratio_masked),
            headroom_rank,
        }
    }
}

/// Stop when the replicas' parameter checksums disagree.
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
