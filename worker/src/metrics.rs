//! `metrics.jsonl`: one line per optimizer update, written by rank 0 from the agreed table.
//!
//! Invariant: every field but the wall-clock `time_*` ones is a function of the agreed table, so two
//! runs with the same seed and world size write the same lines (also after resume).

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use serde_json::json;

use gradbus_collectives::{Action, HealthTable, StepId};

use crate::train::{checksum, Trainer};
use crate::update::{slot, EXP_OVERFLOW};
use crate::WorkerError;

impl Trainer {
    pub(crate) fn write_metrics(
        &mut self,
        table: &HealthTable,
        at: StepId,
        action: Action,
        spike: Option<&str>,
        lr: f32,
        start: Instant,
    ) -> Result<(), WorkerError> {
        let Some(f) = self.metrics.as_mut() else { return Ok(()) };
        let world = table.world as f64;
        let avg = |k: usize| table.reports.iter().map(|r| r.values[k]).sum::<f64>() / world;
        let max = |k: usize| table.reports.iter().map(|r| r.values[k]).fold(f64::NEG_INFINITY, f64::max);
        let bad: Vec<usize> =
            (0..table.world).filter(|&r| (0..table.buckets).any(|b| !table.cell(b, r).is_finite())).collect();
        let line = json!({
            "step": at.step,
            "minibatch": at.minibatch,
            "attempt": at.attempt,
            "loss": finite_or_null(mean_loss(table)),
            "reward": avg(slot::REWARD),
            "kl": finite_or_null(avg(slot::KL)),
            "grad_norm": finite_or_null(table.grad_norm() / world),
            "bucket_norms": table.reduced.iter().map(|h| h.sumsq.sqrt() / world).collect::<Vec<_>>(),
            "nonfinite_ranks": bad,
            "max_logratio_response": finite_or_null(max(slot::MAX_LR_RESPONSE)),
            "max_logratio_masked": finite_or_null(max(slot::MAX_LR_MASKED)),
            "headroom": finite_or_null(headroom(table)),
            "spike": spike,
            "skip_cause": (action == Action::Skip).then(|| spike.unwrap_or("non-finite gradients")),
            "min_response_logp": finite_or_null(table.reports.iter().map(|r| r.values[slot::MIN_LOGP]).fold(f64::INFINITY, f64::min)),
            "lr": lr,
            "verdict": action,
            "skipped": self.history.skipped,
            "checksum": format!("{:016x}", checksum(&self.params)),
            "time_update_ms": start.elapsed().as_secs_f64() * 1e3,
        });
        writeln!(f, "{line}").map_err(|e| WorkerError::io("metrics.jsonl", e))
    }
}

/// ln(f32::MAX) minus the largest log-ratio any rank fed to an exp of the loss.
pub(crate) fn headroom(table: &HealthTable) -> f64 {
    let max = |k: usize| table.reports.iter().map(|r| r.values[k]).fold(f64::NEG_INFINITY, f64::max);
    EXP_OVERFLOW as f64 - max(slot::MAX_LR_RESPONSE).max(max(slot::MAX_LR_MASKED))
}

pub(crate) fn mean_loss(table: &HealthTable) -> f64 {
    table.reports.iter().map(|r| r.loss).sum::<f64>() / table.world as f64
}

pub(crate) fn finite_or_null(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        json!(format!("{x}"))
    }
}

/// Metrics file for rank 0; on resume keep only the lines of steps before `step`.
pub(crate) fn open_metrics(run_dir: &Path, step: u64) -> Result<std::fs::File, WorkerError> {
    let path = run_dir.join("metrics.jsonl");
    let io = |e| WorkerError::io(&path.display().to_string(), e);
    let kept: String = if step > 0 {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s < step)
            })
            .map(|l| format!("{l}\n"))
            .collect()
    } else {
        String::new()
    };
    std::fs::write(&path, kept).map_err(io)?;
    std::fs::OpenOptions::new().append(true).open(&path).map_err(io)
}
