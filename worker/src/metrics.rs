//! `metrics.jsonl`: one line per optimizer update, written by rank 0 from the agreed table (the
//! line's format is [`gradbus_artifacts::MetricsLine`]).
//!
//! Invariant: every field but the wall-clock `time_*` ones is a function of the agreed table, so two
//! runs with the same seed and world size write the same lines (also after resume, which keeps the
//! verified lines of the steps before the checkpoint and never a line it cannot verify).

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use gradbus_collectives::{Action, HealthTable, StepId};

use crate::error::WorkerError;
use crate::update::Agreed;
use gradbus_artifacts::{self as artifacts, MetricsLine};

/// Rank 0's `metrics.jsonl` (nothing on the other ranks).
pub struct MetricsWriter {
    file: Option<std::fs::File>,
}

/// What the step loop knows of an update besides the agreed numbers.
pub struct UpdateRecord<'a> {
    /// Which update.
    pub at: StepId,
    /// The action taken.
    pub action: Action,
    /// The spike, described, if the agreed loss or norm was one.
    pub spike: Option<&'a str>,
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
    /// Rank 0's file (kept lines verified on resume, see [`open_metrics`]); a writer that writes
    /// nothing on the other ranks.
    pub fn open(run_dir: &Path, step: u64, rank: usize) -> Result<MetricsWriter, WorkerError> {
        Ok(MetricsWriter { file: if rank == 0 { Some(open_metrics(run_dir, step)?) } else { None } })
    }

    /// One line for one update.
    pub fn write(&mut self, table: &HealthTable, agreed: &Agreed, u: &UpdateRecord<'_>) -> Result<(), WorkerError> {
        let Some(f) = self.file.as_mut() else { return Ok(()) };
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
            skip_cause: (u.action == Action::Skip).then(|| match (u.spike, at.attempt) {
                (Some(s), _) => s.to_string(),
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

/// Metrics file for rank 0; on resume keep only the lines of steps before `step`, each verified.
/// A last line without its newline is a write the crash cut short: dropped, with a warning. Any
/// other line that does not verify stops the resume (exit 2), naming the file and line.
fn open_metrics(run_dir: &Path, step: u64) -> Result<std::fs::File, WorkerError> {
    let path = run_dir.join("metrics.jsonl");
    let io = |e| WorkerError::io(&path.display().to_string(), e);
    let mut kept = String::new();
    if step > 0 {
        let text = match std::fs::read(&path) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(e)),
        };
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        for (i, raw) in lines.iter().enumerate() {
            let torn = i + 1 == lines.len() && !raw.ends_with('\n');
            let line = raw.trim_end_matches('\n');
            if line.trim().is_empty() {
                continue;
            }
            let file = format!("{}:{}", path.display(), i + 1);
            match artifacts::unseal::<MetricsLine>(line, artifacts::METRICS_FORMAT, &file) {
                Ok(m) if m.step < step => kept.push_str(&format!("{line}\n")),
                Ok(_) => {}
                Err(e) if torn => eprintln!("warning: dropping the last metrics line, cut short by the crash: {e}"),
                Err(e) => return Err(e.into()),
            }
        }
    }
    std::fs::write(&path, kept).map_err(io)?;
    std::fs::OpenOptions::new().append(true).open(&path).map_err(io)
}
