//! The judge: the one place that turns an agreed table into the verdict on an update, with the
//! memory every rank keeps alike - the verdict history (`decide`'s) and the spike detectors of the
//! agreed loss and gradient norm. The Rust worker (`worker/src/judge.rs`) and the PyTorch guard's
//! native core (`python/src/lib.rs`) both judge through it.
//!
//! Order of the rules: the silent-data-corruption guard's replica check (`sdc`: a damaged replica
//! is repaired and the update recomputed, whatever else the table shows - its gradients came from
//! damaged weights); `decide` (the policy on non-finite gradients; with a loss scaler, a non-finite
//! update is the scaler's overflow: skipped within the skip budget, an abort at the scale's
//! floor); then, on a finite, proceeding update, the guard's outlier rule (a first outlier is
//! rerun; the rerun tells a transient fault, whose recomputed gradients are used, from a
//! deterministic one, which the policy judges); then the spike detectors (a spike is skipped when
//! the rule says so); then the verdict enters the history (a repair, or an outlier's rerun, only
//! clears it: the recomputed update is judged afresh).
//!
//! Invariant: it is fed only agreed numbers (the table, the agreed loss and norm, the agreed loss
//! scale), in update order, so every rank holds the same state and reaches the same verdict; its
//! state (`history`, `spikes`) is what a checkpoint saves.

use crate::layout::Layout;
use crate::sdc::{Checks, Finding, Guard};
use crate::spikes::SpikeDetector;
use crate::verdict::{decide, Action, Classification, HealthTable, History, Policy, StepId, Verdict};

/// What a spike of the agreed loss or gradient norm does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnSpike {
    /// Detection off: the detectors are not fed.
    Off,
    /// Detected and described with the verdict; the update proceeds.
    Warn,
    /// Detected, and the update is skipped on every rank.
    Skip,
}

/// The agreed values the spike detectors watch, in this order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Watched {
    /// The ranks' mean loss.
    pub loss: f64,
    /// The global gradient norm.
    pub grad_norm: f64,
}

/// A loss scaler's agreed state for one update (fp16 with a GradScaler): a non-finite update is its
/// overflow, skipped within `max_fraction` of the last `window` updates (no bound in a row: the
/// floor bounds them), and an abort when `scale` is at or below `floor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScale {
    /// The agreed loss scale of the update (> 0).
    pub scale: f64,
    /// The floor: an overflow at a scale at or below it aborts.
    pub floor: f64,
    /// The skip budget's fraction of the window.
    pub max_fraction: f64,
    /// The skip budget's window.
    pub window: u32,
}

/// The verdict history and the spike detectors of one rank (the same on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct Judge {
    /// Verdict history (skips, suspects).
    pub history: History,
    /// Spike detectors of the agreed loss and gradient norm (the order of `Watched`).
    pub spikes: [SpikeDetector; 2],
    /// The silent-data-corruption guard (its checks off unless `with_sdc` turns them on).
    pub sdc: Guard,
}

impl Judge {
    /// Empty history; spike detectors over `window` values with the z-score limit `z_limit`.
    pub fn new(window: usize, z_limit: f64) -> Judge {
        let d = SpikeDetector::new(window, z_limit);
        Judge { history: History::default(), spikes: [d.clone(), d], sdc: Guard::new(Checks::default()) }
    }

    /// The same judge with the silent-data-corruption guard's `checks` on.
    pub fn with_sdc(mut self, checks: Checks) -> Judge {
        self.sdc = Guard::new(checks);
        self
    }

    /// The verdict on one agreed update under `policy` (see the module doc for the order of the
    /// rules); recorded in the history. Returns the verdict, the spike, described, if any, and the
    /// silent-data-corruption guard's finding, if any.
    #[allow(clippy::too_many_arguments)]
    pub fn judge(
        &mut self,
        table: &HealthTable,
        layout: &Layout,
        policy: &Policy,
        at: StepId,
        watched: Watched,
        on_spike: OnSpike,
        scale: Option<LossScale>,
    ) -> (Verdict, Option<String>, Option<Finding>) {
        if let Some((verdict, finding)) = self.sdc.replicas(table, at) {
            self.history.record(table, &verdict);
            return (verdict, None, Some(finding));
        }
        let mut verdict = match scale {
            None => decide(table, layout, policy, &self.history, at),
            Some(s) => {
                let scaled = Policy::Skip { max_consecutive: u32::MAX, max_fraction: s.max_fraction, window: s.window };
                let mut v = decide(table, layout, &scaled, &self.history, at);
                // decide's skip (within the budget) is the scaler's overflow; past the budget it
                // stays decide's abort ("skip-budget").
                if v.action == Action::Skip {
                    if s.scale <= s.floor {
                        v.action = Action::Abort;
                    }
                    if let Some(r) = &mut v.report {
                        r.verdict = v.action;
                        r.classification = Some(Classification::LossScale);
                    }
                }
                v
            }
        };
        let mut finding = None;
        if verdict.action == Action::Proceed {
            if let Some((v, f)) = self.sdc.outlier(table, layout, policy, &mut self.history, at) {
                if v.action == Action::Rerun {
                    return (v, None, Some(f));
                }
                (verdict, finding) = (v, Some(f));
            }
        }
        if verdict.action == Action::Proceed && finding.is_none() {
            self.sdc.observe(table);
        }
        let spike =
            if verdict.action == Action::Proceed && on_spike != OnSpike::Off { self.spike(watched) } else { None };
        if spike.is_some() && on_spike == OnSpike::Skip {
            verdict.action = Action::Skip;
        }
        self.history.record(table, &verdict);
        (verdict, spike, finding)
    }

    /// Feed the watched values of a proceeding update to the detectors; the spike, described, if
    /// either is one.
    fn spike(&mut self, w: Watched) -> Option<String> {
        let mut found = None;
        for ((d, x), name) in self.spikes.iter_mut().zip([w.loss, w.grad_norm]).zip(["loss", "grad norm"]) {
            if let Some(s) = d.observe(x) {
                found.get_or_insert(format!("{name} spike {x:.4} ({})", s.rules()));
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verdict::tests::{layout, table};

    const WATCHED: Watched = Watched { loss: 0.5, grad_norm: 1.0 };

    fn at(minibatch: u32) -> StepId {
        StepId { step: 3, minibatch, attempt: 0 }
    }

    fn scale(scale: f64) -> Option<LossScale> {
        Some(LossScale { scale, floor: 1.0, max_fraction: 0.5, window: 4 })
    }

    /// With a loss scaler, a non-finite update is the scaler's overflow: skipped (classification
    /// loss-scale, whatever the policy) above the floor, an abort at it; past the skip budget,
    /// decide's abort; a finite update proceeds with no report.
    #[test]
    fn a_loss_scalers_overflow_is_skipped_above_the_floor_and_aborts_at_it() {
        let (layout, abort) = (layout(), Policy::Abort);
        let nan = table(&[(1, 0, 5, true)]);
        let mut j = Judge::new(16, 6.0);

        let (v, spike, finding) = j.judge(&table(&[]), &layout, &abort, at(0), WATCHED, OnSpike::Off, scale(1024.0));
        assert_eq!((v.action, v.report.is_none(), spike, finding.is_none()), (Action::Proceed, true, None, true));

        let (v, ..) = j.judge(&nan, &layout, &abort, at(1), WATCHED, OnSpike::Off, scale(1024.0));
        assert_eq!(v.action, Action::Skip, "an overflow above the floor is the scaler's skip, not the policy's abort");
        let r = v.report.expect("a non-finite update has its report");
        assert_eq!(
            (r.verdict, r.classification, r.ranks.clone()),
            (Action::Skip, Some(Classification::LossScale), vec![1])
        );

        let (v, ..) = j.judge(&nan, &layout, &abort, at(2), WATCHED, OnSpike::Off, scale(1.0));
        assert_eq!(v.action, Action::Abort, "an overflow at the floor aborts");
        let r = v.report.expect("report");
        assert_eq!((r.verdict, r.classification), (Action::Abort, Some(Classification::LossScale)));

        // The budget: 2 skips in a window of 4 (max_fraction 0.5); the third overflow aborts.
        let mut j = Judge::new(16, 6.0);
        let actions: Vec<Action> = (0..3)
            .map(|m| j.judge(&nan, &layout, &abort, at(m), WATCHED, OnSpike::Off, scale(1024.0)).0.action)
            .collect();
        assert_eq!(actions, [Action::Skip, Action::Skip, Action::Abort]);
    }

    /// Without a scaler the policy decides: the same overflow aborts under Policy::Abort.
    #[test]
    fn without_a_scaler_the_policy_decides() {
        let mut j = Judge::new(16, 6.0);
        let (v, ..) =
            j.judge(&table(&[(0, 2, 1, false)]), &layout(), &Policy::Abort, at(0), WATCHED, OnSpike::Off, None);
        let r = v.report.expect("report");
        assert_eq!((v.action, r.classification == Some(Classification::LossScale)), (Action::Abort, false));
    }
}
