//! `warnings.jsonl`: one sealed line per warning that an agreed quantity nears its ceiling.

use std::path::Path;

use serde::{Deserialize, Serialize};

use gradbus_collectives::forecast::{Alert, Outlook};

use crate::lines::read_lines;
use crate::sealed::{nullable, required, seal};
use crate::ArtifactError;

/// Format version of a `warnings.jsonl` line.
pub const WARNINGS_FORMAT: u32 = 1;

/// One line of `warnings.jsonl`: an agreed quantity came near its ceiling, or is forecast to
/// within a few updates (`gradbus_collectives::forecast`). Written by rank 0: of the runtime for
/// the largest log-ratio fed to an exp of its loss (`warn.*`), of the PyTorch guard for each
/// quantity of `guard.watch`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarningLine {
    /// The optimizer update, from 0: the runtime's step x updates per step + update within the
    /// step; the guard's `step`.
    pub update: u64,
    /// What is watched: the runtime's `loss.exp`; the name given to `guard.watch`.
    pub quantity: String,
    /// The largest value over every rank (null when non-finite).
    #[serde(with = "nullable")]
    pub value: f64,
    /// Its ceiling (ln of the dtype's largest finite value for an exp argument).
    pub limit: f64,
    /// The lowest rank holding `value`.
    pub rank: usize,
    /// Updates until the ceiling at the trend's slope; null without a rising trend.
    #[serde(deserialize_with = "required")]
    pub forecast_updates: Option<f64>,
    /// `warn`, or `stop`: every rank stopped before the update (the stop policy).
    pub action: Alert,
}

impl WarningLine {
    /// The line for `quantity`'s outlook at `update`, held by `rank`.
    pub fn new(update: u64, quantity: &str, o: &Outlook, rank: usize, action: Alert) -> WarningLine {
        WarningLine {
            update,
            quantity: quantity.into(),
            value: o.value,
            limit: o.limit,
            rank,
            forecast_updates: o.updates,
            action,
        }
    }

    /// The line as written (no newline).
    pub fn to_line(&self) -> String {
        seal(WARNINGS_FORMAT, self, false)
    }
}

/// Read and verify `warnings.jsonl`.
pub fn read_warnings(path: &Path) -> Result<Vec<WarningLine>, ArtifactError> {
    read_lines(path, WARNINGS_FORMAT)
}
