//! `metrics.jsonl`: one sealed line per optimizer update, written by rank 0.

use std::path::Path;

use serde::{Deserialize, Serialize};

use gradbus_collectives::Action;

use crate::lines::{parse_lines, read_lines};
use crate::sealed::{hex64, nullable, required, seal};
use crate::ArtifactError;

/// Format version of a `metrics.jsonl` line.
pub const METRICS_FORMAT: u32 = 1;

/// One line of `metrics.jsonl`: one optimizer update as every rank agreed on it (written by rank 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsLine {
    /// RL step.
    pub step: u64,
    /// Update inside the step (epoch * minibatches + mini-batch).
    pub minibatch: u32,
    /// 0, or 1 for a rerun.
    pub attempt: u32,
    /// Mean loss over ranks.
    #[serde(with = "nullable")]
    pub loss: f64,
    /// Mean reward over ranks.
    #[serde(with = "nullable")]
    pub reward: f64,
    /// Mean KL over ranks.
    #[serde(with = "nullable")]
    pub kl: f64,
    /// Global gradient norm of the mean gradient.
    #[serde(with = "nullable")]
    pub grad_norm: f64,
    /// Norm of each reduced bucket (of the mean gradient), in reduce order.
    #[serde(with = "nullable::vec")]
    pub bucket_norms: Vec<f64>,
    /// Ranks whose local gradients were non-finite.
    pub nonfinite_ranks: Vec<usize>,
    /// Largest log-ratio of a response position fed to an exp, over ranks.
    #[serde(with = "nullable")]
    pub max_logratio_response: f64,
    /// Largest log-ratio of a masked position fed to an exp, over ranks.
    #[serde(with = "nullable")]
    pub max_logratio_masked: f64,
    /// ln(f32::MAX) minus the larger of the two.
    #[serde(with = "nullable")]
    pub headroom: f64,
    /// The spike, described, if the update was one.
    #[serde(deserialize_with = "required")]
    pub spike: Option<String>,
    /// The silent-data-corruption guard's finding, described: a replica repaired, an outlier
    /// rerun, classified, skipped or aborted on. Absent (not null) when there was none, so that
    /// the lines of a clean run are those of a build without the guard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sdc: Option<String>,
    /// Why the update was skipped, if it was.
    #[serde(deserialize_with = "required")]
    pub skip_cause: Option<String>,
    /// Smallest log-prob of a response token, over ranks.
    #[serde(with = "nullable")]
    pub min_response_logp: f64,
    /// Learning rate of the update.
    pub lr: f32,
    /// What every rank did.
    pub verdict: Action,
    /// Skipped updates so far.
    pub skipped: u64,
    /// Checksum of the weights after the update.
    #[serde(with = "hex64")]
    pub checksum: u64,
    /// Wall-clock time of the update (the only field that differs between identical runs).
    pub time_update_ms: f64,
}

impl MetricsLine {
    /// The line as written (no newline).
    pub fn to_line(&self) -> String {
        seal(METRICS_FORMAT, self, false)
    }
}

/// Parse the text of a `metrics.jsonl` (blank lines skipped); errors name `file:LINE`.
pub fn parse_metrics(text: &str, file: &Path) -> Result<Vec<MetricsLine>, ArtifactError> {
    parse_lines(text, METRICS_FORMAT, file)
}

/// Read and verify `metrics.jsonl`.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricsLine>, ArtifactError> {
    read_lines(path, METRICS_FORMAT)
}
