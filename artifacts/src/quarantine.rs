//! `quarantine.jsonl`: one sealed line per bad rank of an aborted or skipped update that named the
//! samples of its micro-batch; the PyTorch guard's adapters leave those samples out on resume.

use std::path::Path;

use serde::{Deserialize, Serialize};

use gradbus_collectives::{Action, Report, SampleId};

use crate::lines::read_lines;
use crate::sealed::seal;
use crate::ArtifactError;

/// Format version of a `quarantine.jsonl` line.
pub const QUARANTINE_FORMAT: u32 = 1;

/// One line of `quarantine.jsonl`: the samples of one rank's micro-batch that held the first
/// non-finite value of an update that every rank aborted or skipped (the report's
/// `per_rank[].samples`). Written by rank 0 of the PyTorch guard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantineLine {
    /// The update (the guard's `step`).
    pub update: u64,
    /// The rank whose micro-batch it was.
    pub rank: usize,
    /// What every rank did with the update: `abort` or `skip`.
    pub verdict: Action,
    /// The samples.
    pub samples: Vec<SampleId>,
}

impl QuarantineLine {
    /// One line per bad rank of `report` that names its samples.
    pub fn of_report(report: &Report) -> Vec<QuarantineLine> {
        report
            .per_rank
            .iter()
            .filter(|r| !r.samples.is_empty())
            .map(|r| QuarantineLine {
                update: report.step,
                rank: r.rank,
                verdict: report.verdict,
                samples: r.samples.clone(),
            })
            .collect()
    }

    /// The line as written (no newline).
    pub fn to_line(&self) -> String {
        seal(QUARANTINE_FORMAT, self, false)
    }
}

/// Read and verify `quarantine.jsonl`.
pub fn read_quarantine(path: &Path) -> Result<Vec<QuarantineLine>, ArtifactError> {
    read_lines(path, QUARANTINE_FORMAT)
}
