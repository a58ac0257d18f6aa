//! The worker's judge: the collectives' `Judge` (the verdict history, the spike detectors of the
//! agreed loss and gradient norm and the silent-data-corruption guard: the one judge the PyTorch
//! guard shares) under the run's config, plus the headroom forecast and its warnings - everything
//! that turns an agreed table into a verdict and a warning.
//!
//! Invariant: it is fed only agreed numbers (the table and its [`Agreed`] values), in update order,
//! so every rank holds the same state and reaches the same verdict and warnings; a checkpoint saves
//! it whole.

use gradbus_collectives::forecast::{Alert, Forecast, Outlook, Rule, DEFAULT_WINDOW};
use gradbus_collectives::sdc::{Checks, Finding};
use gradbus_collectives::{Action, HealthTable, Layout, OnSpike, StepId, Verdict, Watched};

use crate::config::Config;
use crate::loss::EXP_OVERFLOW;
use crate::update::Agreed;

/// Verdict history, spike detectors, headroom forecast and warnings of one rank (the same on every
/// rank).
#[derive(Clone, Debug)]
pub struct Judge {
    /// Verdict history and spike detectors.
    pub verdicts: gradbus_collectives::Judge,
    /// The trend of the agreed largest log-ratio fed to an exp of the loss, one value per update.
    pub forecast: Forecast,
    /// Updates that warned (`warn.*`: the headroom, or the forecast, under its threshold).
    pub warnings: u32,
    /// `GRADBUS_SDC_TRACE` was set (on rank 0): print the outlier rule's numbers every update.
    trace: bool,
}

/// What one update's verdict comes with.
#[derive(Clone, Debug, PartialEq)]
pub struct Judged {
    /// The verdict.
    pub verdict: Verdict,
    /// The loss or gradient-norm spike, described, if either was one.
    pub spike: Option<String>,
    /// The headroom outlook, when it warns (`warn.*`).
    pub warning: Option<Outlook>,
    /// The silent-data-corruption guard's finding (a repair, an outlier), if any.
    pub sdc: Option<Finding>,
}

impl Judge {
    /// Empty history, detectors and forecast for `cfg`'s spike and `sdc` settings, for rank `rank`
    /// of `world` ranks and a layout of `buckets` buckets (the replica check needs 2 ranks).
    pub fn new(cfg: &Config, buckets: usize, world: usize, rank: usize) -> Judge {
        let checks = Checks {
            replicas: cfg.sdc.replicas && world > 1,
            outliers: cfg.sdc.outliers.then(|| (cfg.sdc.rule(), buckets)),
        };
        Judge {
            verdicts: gradbus_collectives::Judge::new(cfg.spike.window, cfg.spike.z_limit).with_sdc(checks),
            forecast: Forecast::new(DEFAULT_WINDOW),
            warnings: 0,
            trace: rank == 0 && std::env::var_os(crate::env::SDC_TRACE).is_some_and(|v| !v.is_empty()),
        }
    }

    /// The verdict on one agreed update: the collectives' judge under `cfg`'s policy (a proceeding
    /// update whose agreed loss or gradient norm spikes is skipped when `spike.skip` says so),
    /// recorded in its history; the update's largest log-ratio feeds the forecast (once per update:
    /// not on an attempt that is rerun or repaired) and a warning is counted when `warn.*` says so.
    pub fn judge(&mut self, table: &HealthTable, agreed: &Agreed, layout: &Layout, cfg: &Config, at: StepId) -> Judged {
        if let (true, Some(d)) = (self.trace, &self.verdicts.sdc.outliers) {
            let cells: Vec<String> =
                d.inputs(table).iter().map(|i| format!("{:.3}:{:.3}:{:.3}", i.excess, i.spread, i.isolation)).collect();
            eprintln!("sdc-trace {} {} {} {}", at.step, at.minibatch, at.attempt, cells.join(" "));
        }
        let on_spike = if cfg.spike.skip { OnSpike::Skip } else { OnSpike::Warn };
        let watched = Watched { loss: agreed.loss, grad_norm: agreed.grad_norm };
        let (verdict, spike, sdc) = self.verdicts.judge(table, layout, &cfg.policy(), at, watched, on_spike, None);
        let mut warning = None;
        if !matches!(verdict.action, Action::Rerun | Action::Repair) {
            let limit = EXP_OVERFLOW as f64;
            let outlook = self.forecast.observe(limit - agreed.headroom, limit);
            // The runtime has no stop policy: every alert is a warning.
            let rule = Rule {
                warn_updates: cfg.warn.forecast as f64,
                warn_headroom: cfg.warn.headroom as f64,
                stop_updates: 0.0,
                stop_headroom: 0.0,
            };
            if rule.alert(&outlook) >= Some(Alert::Warn) {
                self.warnings += 1;
                warning = Some(outlook);
            }
        }
        Judged { verdict, spike, warning, sdc }
    }
}
