//! `metrics.jsonl`: one line per optimizer update, and `warnings.jsonl`: one line per headroom
//! warning, written by rank 0 from the agreed table (the lines' formats are
//! [`gradbus_artifacts::MetricsLine`] and [`gradbus_artifacts::WarningLine`]).
//!
//! Invariant: every field but the wall-clock `time_*` ones is a function of the agreed table, so two
//! runs with the same seed and world size write the same lines (also after resume, which keeps the
//! verified lines of the steps before the checkpoint and never a line it cannot verify).

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use gradbus_collectives::forecast::{Alert, Outlook};
use gradbus_collectives::{Action, HealthTable, StepId};

use crate::error::WorkerError;
use crate::update::Agreed;
use gradbus_artifacts::{self as artifacts, MetricsLine, WarningLine};

/// Rank 0's `metrics.jsonl` and `warnings.jsonl` (nothing on the other ranks).
pub struct MetricsWriter {
    files: Option<(std::fs::File, std::fs::File)>,
    /// Updates per RL step: a warning's `update` is step x this + update within the step.
    updates_per_step: u64,
}

/// What the step loop knows of an update besides the agreed numbers.
pub struct UpdateRecord<'a> {
    /// Which update.
    pub at: StepId,
    /// The action taken.
    pub action: Action,
    /// The spike, described, if the agreed loss or norm was one.
    pub spike: Option<&'a str>,
    /// The silent-data-corruption finding, described (a repair, an outlier).
    pub sdc: Option<&'a str>,
    /// The learning rate of the update.
    pub lr: f32,
    /// Updates skipped so far, this one included.
    pub skipped: u64,
    /// The replica checksum of the weights after the update.
    pub checksum: u64,
    /// When the update started (the wall-clock `time_update_ms`).
    pub start: Instant,
}

impl MetricsWriter {
    /// Rank 0's files from RL step `step` on (on resume, the verified lines of the steps before it
    /// are kept, see [`open_kept`]); a writer that writes nothing on the other ranks.
    pub fn open(run_dir: &Path, step: u64, updates_per_step: u64, rank: usize) -> Result<MetricsWriter, WorkerError> {
        let files = if rank == 0 {
            let metrics =
                open_kept(run_dir, "metrics.jsonl", artifacts::METRICS_FORMAT, step > 0, &|m: &MetricsLine| {
                    m.step < step
                })?;
            let first = step * updates_per_step;
            let warnings =
                open_kept(run_dir, "warnings.jsonl", artifacts::WARNINGS_FORMAT, step > 0, &|w: &WarningLine| {
                    w.update < first
                })?;
            Some((metrics, warnings))
        } else {
            None
        };
        Ok(MetricsWriter { files, updates_per_step })
    }

    /// The warning line of a headroom outlook that warns (`Judge::judge`), at update `at`, the
    /// largest log-ratio held by `rank`.
    pub fn warn(&mut self, at: StepId, o: &Outlook, rank: usize) -> Result<(), WorkerError> {
        let Some((_, f)) = self.files.as_mut() else { return Ok(()) };
        let update = at.step * self.updates_per_step + at.minibatch as u64;
        let line = WarningLine::new(update, "loss.exp", o, rank, Alert::Warn);
        writeln!(f, "{}", line.to_line()).map_err(|e| WorkerError::io("warnings.jsonl", e))
    }

    /// One line for one update.
    pub fn write(&mut self, table: &HealthTable, agreed: &Agreed, u: &UpdateRecord<'_>) -> Result<(), WorkerError> {
        let Some((f, _)) = self.files.as_mut() else { return Ok(()) };
        let (values, at) = (&agreed.values, u.at);
        let line = MetricsLine {
            step: at.step,
            minibatch: at.minibatch,
            attempt: at.attempt,
            loss: agreed.loss,
            reward: values.reward,
            kl: values.kl,
            grad_norm: agreed.grad_norm,
            bucket_norms: agreed.bucket_norms.clone(),
            nonfinite_ranks: table.nonfinite_ranks(),
            max_logratio_response: values.max_logratio_response,
            max_logratio_masked: values.max_logratio_masked,
            headroom: agreed.headroom,
            spike: u.spike.map(String::from),
            sdc: u.sdc.map(String::from),
            skip_cause: (u.action == Action::Skip).then(|| match (u.spike, at.attempt) {
                (Some(s), _) => s.to_string(),
                (None, _) if u.sdc.is_some() => "a deterministic outlier (silent data corruption)".to_string(),
                (None, 0) => "non-finite gradients".to_string(),
                (None, _) => "transient fault (the rerun differed)".to_string(),
            }),
            min_response_logp: values.min_response_logp,
            lr: u.lr,
            verdict: u.action,
            skipped: u.skipped,
            checksum: u.checksum,
            time_update_ms: u.start.elapsed().as_secs_f64() * 1e3,
        };
        writeln!(f, "{}", line.to_line()).map_err(|e| WorkerError::io("metrics.jsonl", e))
    }
}

/// `name` in the run directory for rank 0: empty, or on `resume` with only the verified lines
/// `keep` keeps (`gradbus_artifacts::open_lines`).
fn open_kept<T: serde::de::DeserializeOwned>(
    run_dir: &Path,
    name: &str,
    format: u32,
    resume: bool,
    keep: &dyn Fn(&T) -> bool,
) -> Result<std::fs::File, WorkerError> {
    let (file, torn) = artifacts::open_lines(&run_dir.join(name), format, resume.then_some(keep))?;
    if let Some(e) = torn {
        eprintln!("warning: dropping the last line of {name}, cut short by the crash: {e}");
    }
    Ok(file)
}
