//! Traces (`trace-rank-K.json`, written for people and tests; gradbus never reads one back): the first
//! non-finite op of a rank's failing update.

use serde::Serialize;

use crate::sealed::seal;

/// The first non-finite value of an update, in execution order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// The op that produced it, e.g. `loss.kl_exp` or `blocks.1.attn.softmax`.
    pub op: String,
    /// Block index, when the op belongs to one.
    pub layer: Option<usize>,
    /// `forward` or `backward`.
    pub phase: &'static str,
    /// Sample (row of the mini-batch), when the tensor is (B, T, ...).
    pub sample: Option<usize>,
    /// Token position, when the tensor is (B, T, ...).
    pub token: Option<usize>,
    /// The non-finite value.
    pub value: f32,
    /// For an exp: the log-ratio it was fed.
    pub exp_input: Option<f32>,
    /// For an exp: whether the position is masked out of the loss (prompt or padding).
    pub masked: Option<bool>,
    /// For an exp: how many positions of this op overflowed.
    pub overflows: Option<usize>,
}

impl Finding {
    /// One human line.
    pub fn describe(&self) -> String {
        let at = match (self.sample, self.token) {
            (Some(s), Some(t)) => format!(" at sample {s}, token {t}"),
            _ => String::new(),
        };
        let layer = self.layer.map(|l| format!(" (block {l})")).unwrap_or_default();
        match (self.exp_input, self.masked) {
            (Some(x), Some(m)) => format!(
                "{} {}{layer}: exp of a log-ratio of {x:.2} (> ln(f32::MAX) = 88.72) = {}{at}, a {} position; {} position(s) overflowed",
                self.phase,
                self.op,
                self.value,
                if m { "MASKED" } else { "response" },
                self.overflows.unwrap_or(1)
            ),
            _ => format!("{} {}{layer}: {}{at}", self.phase, self.op, self.value),
        }
    }
}

/// `trace-rank-K.json`: the first non-finite op of a rank's failing update.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceFile {
    /// RL step of the failing update.
    pub step: u64,
    /// The update inside the step.
    pub minibatch: u32,
    /// The rank that traced it.
    pub rank: usize,
    /// The first non-finite op, if the recomputation found one.
    pub first: Option<Finding>,
}

/// Format version of `trace-rank-K.json`.
pub const TRACE_FORMAT: u32 = 1;

impl TraceFile {
    /// The file's text (pretty, sealed like every JSON artifact).
    pub fn to_text(&self) -> String {
        seal(TRACE_FORMAT, self, true) + "\n"
    }
}
