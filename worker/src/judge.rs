//! The worker's judge: the collectives' `Judge` (the verdict history, the spike detectors of the
//! agreed loss and gradient norm and the silent-data-corruption guard: the one judge the PyTorch
//! guard shares) under the run's config, plus the headroom forecast and its warnings - everything
//! that turns an agreed table into a verdict and a warning.
//!
//! Invariant: it is fed only agreed numbers (the table and its [`Agreed`] values), in update order,
//! so every rank holds the same state and reaches the same verdict and warnings; a checkpoint saves
//! it whole.

use gradbus_collectives::forecast::{exp_ceiling, Alert, Forecast, Outlook, Rule, DEFAULT_WINDOW};
use gradbus_collectives::sdc::{Checks, Finding};
use gradbus_collectives::{Action, HealthTable, Layout, OnSpike, StepId, Verdict, Watched};

use crate::config::{Config, WarnConfig};
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
        let logratio = agreed.values.max_logratio_response.max(agreed.values.max_logratio_masked);
        let warning = self.warn(verdict.action, logratio, &cfg.warn);
        Judged { verdict, spike, warning, sdc }
    }

    /// Feed an update's agreed largest log-ratio fed to an exp of the loss to the forecast, against
    /// float32's ceiling (`forecast::exp_ceiling`, the PyTorch guard's too), once per update: not
    /// on an attempt whose verdict is `Rerun` or `Repair` (the attempt after it feeds it). The outlook when `warn` says it
    /// warns (every alert is a warning: the runtime has no stop policy), counted in `warnings`.
    fn warn(&mut self, action: Action, logratio: f64, warn: &WarnConfig) -> Option<Outlook> {
        if matches!(action, Action::Rerun | Action::Repair) {
            return None;
        }
        let outlook = self.forecast.observe(logratio, exp_ceiling("float32").expect("float32 has a ceiling"));
        let rule = Rule {
            warn_updates: warn.forecast as f64,
            warn_headroom: warn.headroom as f64,
            stop_updates: 0.0,
            stop_headroom: 0.0,
        };
        let warns = rule.alert(&outlook) >= Some(Alert::Warn);
        self.warnings += warns as u32;
        warns.then_some(outlook)
    }
}

#[cfg(test)]
mod tests {
    use gradbus_artifacts::read_warnings;
    use gradbus_collectives::StepId;

    use super::*;
    use crate::metrics::MetricsWriter;

    fn judge() -> Judge {
        Judge {
            verdicts: gradbus_collectives::Judge::new(128, 6.0),
            forecast: Forecast::new(DEFAULT_WINDOW),
            warnings: 0,
            trace: false,
        }
    }

    /// The forecast alone warns (the headroom rule off), and the warning is the line rank 0 writes.
    #[test]
    fn the_forecast_warns_alone_and_rank_0_writes_the_line() {
        let ceiling = exp_ceiling("float32").unwrap();
        let only_forecast = WarnConfig { headroom: 0.0, forecast: 7.0 };
        let mut j = judge();
        // Headrooms 78.7, 68.7, 58.7, 48.7: the 4th completes the trend, 10 nats per update, 4.9
        // updates to go.
        let out: Vec<Option<Outlook>> =
            [10.0, 20.0, 30.0, 40.0].iter().map(|&x| j.warn(Action::Proceed, x, &only_forecast)).collect();
        assert_eq!(out[..3], [None, None, None], "no trend, and the headroom rule is off");
        let o = out[3].expect("the forecast of 4.9 updates warns");
        assert!((o.updates.unwrap() - (ceiling - 40.0) / 10.0).abs() < 1e-12 && o.limit == ceiling, "{o:?}");
        assert_eq!(j.warnings, 1);

        // Rank 0 writes it to warnings.jsonl (update = step x updates per step + update); rank 1
        // writes nothing.
        let dir = tempfile::tempdir().unwrap();
        let at = StepId { step: 2, minibatch: 1, attempt: 0 };
        MetricsWriter::open(dir.path(), 0, 4, 0).unwrap().warn(at, &o, 1).unwrap();
        let lines = read_warnings(&dir.path().join("warnings.jsonl")).unwrap();
        assert_eq!(lines.len(), 1);
        let l = &lines[0];
        assert_eq!((l.update, l.quantity.as_str(), l.value, l.limit, l.rank), (9, "loss.exp", 40.0, ceiling, 1));
        assert_eq!((l.forecast_updates, l.action), (o.updates, Alert::Warn));
        let other = tempfile::tempdir().unwrap();
        MetricsWriter::open(other.path(), 0, 4, 1).unwrap().warn(at, &o, 1).unwrap();
        assert!(!other.path().join("warnings.jsonl").exists());
    }

    #[test]
    fn a_forecast_of_0_is_off_and_a_rerun_does_not_move_the_window() {
        let off = WarnConfig { headroom: 0.0, forecast: 0.0 };
        let mut j = judge();
        assert!([10.0, 20.0, 30.0, 40.0, 50.0].iter().all(|&x| j.warn(Action::Proceed, x, &off).is_none()));
        assert_eq!(j.warnings, 0);

        // A rerun or repaired attempt's value stays out: the same outlooks as without it.
        let on = WarnConfig { headroom: 0.0, forecast: 7.0 };
        let (mut a, mut b) = (judge(), judge());
        for x in [10.0, 20.0, 30.0] {
            a.warn(Action::Proceed, x, &on);
            b.warn(Action::Proceed, x, &on);
        }
        assert_eq!(a.warn(Action::Rerun, 80.0, &on), None);
        assert_eq!(a.warn(Action::Repair, 85.0, &on), None);
        assert_eq!(a.warn(Action::Proceed, 40.0, &on), b.warn(Action::Proceed, 40.0, &on));
        assert_eq!(a.forecast, b.forecast);
        assert_eq!((a.warnings, b.warnings), (1, 1));
    }
}
