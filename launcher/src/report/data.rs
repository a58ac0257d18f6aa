//! What `gradbus report` reads of a run directory: `metrics.jsonl` as the updates it draws,
//! `warnings.jsonl` (the warnings the run wrote) and `report.json` after an abort, each verified by
//! gradbus-artifacts.

use std::path::Path;

use gradbus_artifacts::{self as artifacts, ArtifactError, MetricsLine, WarningLine};
use gradbus_collectives::Report;

use crate::error::Error;

/// What the report draws of one `metrics.jsonl` line (read as [`MetricsLine`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Update {
    /// Optimizer step.
    pub step: u64,
    /// Mini-batch inside the step (epoch * minibatches + mini-batch).
    pub minibatch: u64,
    /// Attempt (1 after a rerun).
    pub attempt: u64,
    /// Mean loss over ranks (NaN when not finite).
    pub loss: f64,
    /// Mean reward.
    pub reward: f64,
    /// Global gradient norm (mean over ranks).
    pub grad_norm: f64,
    /// Per-bucket norms of the reduced gradients.
    pub bucket_norms: Vec<f64>,
    /// Ranks with non-finite local gradients.
    pub nonfinite_ranks: Vec<u64>,
    /// ln(f32::MAX) minus the largest log-ratio fed to an exp.
    pub headroom: f64,
    /// proceed, skip, rerun or abort.
    pub verdict: String,
    /// Why it was skipped, when it was (the line's `skip_cause`).
    pub skip_cause: Option<String>,
}

impl From<MetricsLine> for Update {
    /// The fields the report draws, from the typed line (`gradbus_artifacts::MetricsLine`).
    fn from(m: MetricsLine) -> Update {
        Update {
            step: m.step,
            minibatch: m.minibatch as u64,
            attempt: m.attempt as u64,
            loss: m.loss,
            reward: m.reward,
            grad_norm: m.grad_norm,
            bucket_norms: m.bucket_norms,
            nonfinite_ranks: m.nonfinite_ranks.iter().map(|&r| r as u64).collect(),
            headroom: m.headroom,
            verdict: m.verdict.as_str().to_string(),
            skip_cause: m.skip_cause,
        }
    }
}

/// A run directory's metrics.
#[derive(Clone, Debug)]
pub struct RunData {
    /// The updates in file order.
    pub updates: Vec<Update>,
    /// `report.json`, when the run aborted: the report every rank agreed on.
    pub abort: Option<Report>,
    /// `warnings.jsonl`'s lines, when the run wrote the file (every run since its format 1).
    pub warnings: Option<Vec<WarningLine>>,
    /// Whether `dumps/` exists (for the replay command).
    pub has_dumps: bool,
}

/// Read `metrics.jsonl`, `warnings.jsonl` and `report.json` of a run directory, each verified
/// (checksum, format version, every key); an error names the file, line and key.
pub fn load(run_dir: &Path) -> Result<RunData, Error> {
    let path = run_dir.join("metrics.jsonl");
    if !path.is_file() {
        return Err(Error::usage(
            format!("cannot read {}: no such file", path.display()),
            "pass the run directory of a `gradbus run` (its --run-dir) that has run at least one update",
        ));
    }
    let updates = artifacts::read_metrics(&path)
        .map_err(|e| Error::usage(e.to_string(), "metrics.jsonl is written by `gradbus run`"))?
        .into_iter()
        .map(Update::from)
        .collect();
    let abort = optional(
        run_dir,
        "report.json",
        artifacts::read_report,
        "report.json is written by `gradbus run` on an abort",
    )?;
    let warnings =
        optional(run_dir, "warnings.jsonl", artifacts::read_warnings, "warnings.jsonl is written by `gradbus run`")?;
    Ok(RunData { updates, abort, warnings, has_dumps: run_dir.join("dumps").is_dir() })
}

/// `name` in the run directory read (and verified) by `read`, when it exists; an error names the
/// file, with `hint`.
fn optional<T>(
    run_dir: &Path,
    name: &str,
    read: fn(&Path) -> Result<T, ArtifactError>,
    hint: &str,
) -> Result<Option<T>, Error> {
    let path = run_dir.join(name);
    match path.is_file() {
        true => read(&path).map(Some).map_err(|e| Error::usage(e.to_string(), hint)),
        false => Ok(None),
    }
}

/// Parse the lines of a `metrics.jsonl` (blank lines skipped); errors name `file:LINE` and the key.
pub fn parse_metrics(text: &str, file: &Path) -> Result<Vec<Update>, ArtifactError> {
    Ok(artifacts::parse_metrics(text, file)?.into_iter().map(Update::from).collect())
}
