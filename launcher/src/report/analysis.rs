//! What the report derives from the agreed metrics: the updates below the headroom margin, the
//! aborted update, and the loss and gradient-norm spikes as a training-time detector would see them.

use gradbus_collectives::spikes::{Spike, SpikeDetector};

use super::{Options, RunData, Update};

/// A spike and where it happened.
#[derive(Clone, Debug, PartialEq)]
pub struct Flagged {
    /// Index of the update in the metrics.
    pub update: usize,
    /// The detector's finding.
    pub spike: Spike,
}

/// What the report derives from the metrics.
#[derive(Clone, Debug)]
pub struct Analysis {
    /// Updates per step (the largest mini-batch index + 1).
    pub per_step: u64,
    /// Indices of updates whose headroom is below the margin.
    pub warnings: Vec<usize>,
    /// Index of the aborted update.
    pub abort: Option<usize>,
    /// Loss spikes.
    pub loss_spikes: Vec<Flagged>,
    /// Global-norm spikes.
    pub norm_spikes: Vec<Flagged>,
}

/// Warnings, the abort and the spikes of a run.
pub fn analyze(data: &RunData, opts: &Options) -> Analysis {
    let u = &data.updates;
    let per_step = u.iter().map(|x| x.minibatch + 1).max().unwrap_or(1);
    let warnings = (0..u.len()).filter(|&i| u[i].headroom.is_nan() || u[i].headroom < opts.margin).collect();
    let abort = u.iter().position(|x| x.verdict == "abort");
    let spikes = |f: fn(&Update) -> f64| {
        let mut d = SpikeDetector::new(opts.window, opts.z_limit);
        u.iter().enumerate().filter_map(|(i, x)| d.observe(f(x)).map(|spike| Flagged { update: i, spike })).collect()
    };
    Analysis { per_step, warnings, abort, loss_spikes: spikes(|x| x.loss), norm_spikes: spikes(|x| x.grad_norm) }
}
