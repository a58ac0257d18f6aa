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
