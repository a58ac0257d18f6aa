//! The agreement's memory: the verdict history, the spike detectors of the agreed loss and gradient
//! norm, and the count of headroom warnings - everything that turns an agreed table into a verdict.
//!
//! Invariant: it is fed only agreed numbers (the table and its [`Agreed`] values), in update order,
//! so every rank holds the same state and reaches the same verdict; a checkpoint saves it whole.

use gradbus_collectives::spikes::SpikeDetector;
use gradbus_collectives::{decide, Action, HealthTable, History, Layout, StepId, Verdict};

use crate::config::Config;
use crate::update::Agreed;

/// Verdict history, spike detectors and warnings of one rank (the same on every rank).
#[derive(Clone, Debug)]
pub struct Judge {
    /// Verdict history (skips, suspects).
    pub history: History,
    /// Spike detectors of the agreed loss and gradient norm (in that order).
    pub spikes: [SpikeDetector; 2],
    /// Updates whose agreed log-ratio headroom fell under `warn.headroom`.
    pub warnings: u32,
}

impl Judge {
    /// Empty history and detectors for `cfg`'s spike settings.
    pub fn new(cfg: &Config) -> Judge {
        let detector = || SpikeDetector::new(cfg.spike.window, cfg.spike.z_limit);
        Judge { history: History::default(), spikes: [detector(), detector()], warnings: 0 }
    }

    /// The verdict on one agreed update: `decide` from the table and the history; a proceeding
    /// update whose agreed loss or gradient norm spikes is skipped when `spike.skip` says so. The
    /// verdict is recorded, the headroom warning counted. Returns the verdict and the spike, if any.
    pub fn judge(
        &mut self,
        table: &HealthTable,
        agreed: &Agreed,
        layout: &Layout,
        cfg: &Config,
        at: StepId,
    ) -> (Verdict, Option<String>) {
        let mut verdict = decide(table, layout, &cfg.policy(), &self.history, at);
        let spike = if verdict.action == Action::Proceed { self.spike(agreed) } else { None };
        if spike.is_some() && cfg.spike.skip {
            verdict.action = Action::Skip;
        }
        self.history.record(table, &verdict);
        if agreed.headroom < cfg.warn.headroom as f64 {
            self.warnings += 1;
        }
        (verdict, spike)
    }

    /// Feed the agreed loss and gradient norm of a proceeding update to the spike detectors; the
    /// spike, described, if either is one.
    fn spike(&mut self, agreed: &Agreed) -> Option<String> {
        let mut found = None;
        for ((d, x), name) in self.spikes.iter_mut().zip([agreed.loss, agreed.grad_norm]).zip(["loss", "grad norm"]) {
            if let Some(s) = d.observe(x) {
                found.get_or_insert(format!("{name} spike {x:.4} ({})", s.rules()));
            }
        }
        found
    }
}
