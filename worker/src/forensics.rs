//! Forensics: the trace that names the first non-finite tensor of an update, and the one-process
//! replay of a failure dump.
//!
//! Invariants: replay runs the very code path of the step loop (`gradients::compute_gradients`) on the
//! dumped weights and mini-batch, so its gradients are bit for bit those of the failing rank; it
//! proves that by comparing each bucket's health (NaN and Inf counts, first bad index, and the bits
//! of the f64 sum of squares) with the health the rank recorded. The trace only observes.

use std::path::{Path, PathBuf};

use serde::Serialize;

use gradbus_collectives::transport::bucket_health;
use gradbus_collectives::{Layout, ParamGrads};

use crate::config::Config;
use crate::failure::health_json;
use crate::gradients;
use crate::model::{self, Gpt};
use crate::probe::{ExpOp, Phase, Probe};
use crate::task::Batch;
use crate::tensorfile;

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

/// A probe that keeps the first non-finite output it sees.
#[derive(Debug, Default)]
pub struct Trace {
    /// The first finding.
    pub first: Option<Finding>,
    /// Names of the parameters, to name a gradient finding.
    pub param_names: Vec<String>,
}

fn unravel(i: usize, dims: &[usize]) -> (Option<usize>, Option<usize>) {
    if dims.len() < 2 {
        return (None, None);
    }
    let inner: usize = dims[2..].iter().product();
    (Some(i / (dims[1] * inner.max(1))), Some((i / inner.max(1)) % dims[1]))
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
    }
}

impl Probe for Trace {
    fn check(&mut self, op: &'static str, layer: Option<usize>, phase: Phase, data: &[f32], dims: &[usize]) {
        if self.first.is_some() {
            return;
        }
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            let (sample, token) = unravel(i, dims);
            self.first = Some(Finding {
                op: op.to_string(),
                layer,
                phase: phase_name(phase),
                sample,
                token,
                value: data[i],
                exp_input: None,
                masked: None,
                overflows: None,
            });
        }
    }

    fn grad(&mut self, param: usize, data: &[f32]) {
        if self.first.is_some() {
            return;
        }
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            let name = self.param_names.get(param).cloned().unwrap_or_else(|| format!("param {param}"));
            self.first = Some(Finding {
                op: format!("grad of {name} [element {i}]"),
                layer: None,
                phase: "backward",
                sample: None,
                token: None,
                value: data[i],
                exp_input: None,
                masked: None,
                overflows: None,
            });
        }
    }

    fn exp(&mut self, e: ExpOp<'_>) {
        if self.first.is_some() {
            return;
        }
        let bad = |i: &usize| e.evaluated[*i] && !e.output[*i].is_finite();
        let n = (0..e.output.len()).filter(bad).count();
        if let Some(i) = (0..e.output.len()).find(bad) {
            self.first = Some(Finding {
                op: e.op.to_string(),
                layer: None,
                phase: "forward",
                sample: Some(i / e.dims[1]),
                token: Some(i % e.dims[1]),
                value: e.output[i],
                exp_input: Some(e.input[i]),
                masked: Some(e.mask[i] == 0.0),
                overflows: Some(n),
            });
        }
    }
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

/// What a replay found.
#[derive(Debug, Serialize)]
pub struct Replay {
    /// The dump replayed.
    pub dump: PathBuf,
    /// Rank whose update was replayed.
    pub rank: usize,
    /// Step and update.
    pub step: u64,
    /// Update inside the step.
    pub minibatch: u64,
    /// The replayed loss.
    pub loss: f32,
    /// Per-bucket health of the replayed local gradients.
    pub buckets: Vec<serde_json::Value>,
    /// Whether every bucket's health equals the one the rank recorded (bitwise).
    pub identical: bool,
    /// The first non-finite op, with `--trace`.
    pub first: Option<Finding>,
}

/// The dump to replay: a file, or in a dumps directory the first rank the report names.
fn pick_dump(path: &Path) -> Result<PathBuf, String> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let dumps = if path.join("dumps").is_dir() { path.join("dumps") } else { path.to_path_buf() };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dumps)
        .map_err(|e| format!("{}: {e}", dumps.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .collect();
    files.sort();
    for f in &files {
        let l = tensorfile::load(f)?;
        let rank = l.meta["rank"].as_u64();
        if l.meta["report"]["ranks"].as_array().and_then(|r| r.first()).and_then(|r| r.as_u64()) == rank {
            return Ok(f.clone());
        }
    }
    files
        .into_iter()
        .next()
        .ok_or_else(|| format!("{}: no dump files (hint: dumps are written when the job aborts)", dumps.display()))
}

/// Re-execute the dumped update in this process.
pub fn replay(path: &Path, trace: bool) -> Result<Replay, String> {
    let dump = pick_dump(path)?;
    let l = tensorfile::load(&dump)?;
    let meta = &l.meta;
    let text = meta["config"].as_str().ok_or_else(|| format!("{}: no config in the dump", dump.display()))?;
    let (cfg, _, _) =
        Config::from_toml(text, &format!("{} (embedded config)", dump.display()), &[]).map_err(|e| e.to_string())?;
    let layout = Layout::new(&model::param_specs(&cfg.model), cfg.bucket_bytes);
    let gpt = Gpt::new(&cfg.model, &layout);
    let get = |n: &str| l.get(n).ok_or_else(|| format!("{}: no tensor {n}", dump.display()));
    let params = get("params")?.to_vec();
    let toks = |n: &str| get(n).map(|v| v.iter().map(|&x| x as u32).collect::<Vec<u32>>());
    let (b, t) = (meta["b"].as_u64().unwrap_or(0) as usize, meta["t"].as_u64().unwrap_or(0) as usize);
    let mb = Batch {
        b,
        t,
        inputs: toks("inputs")?,
        targets: toks("targets")?,
        mask: get("mask")?.to_vec(),
        reward: get("reward")?.to_vec(),
        adv: get("adv")?.to_vec(),
        old_logp: get("old_logp")?.to_vec(),
        ref_logp: get("ref_logp")?.to_vec(),
    };
    let mut acts = model::Activations::new(&cfg.model, b, t);
    let mut grads = vec![0.0; layout.len];
    let mut probe = Trace { first: None, param_names: layout.slots.iter().map(|s| s.name.clone()).collect() };
    let g = &mut ParamGrads::new(&mut grads, &layout);
    let stats = if trace {
        gradients::compute_gradients(&gpt, &cfg, &params, &mut acts, &mb, g, &mut probe)
    } else {
        gradients::compute_gradients(&gpt, &cfg, &params, &mut acts, &mb, g, &mut crate::probe::NoProbe)
    };
    let chunks = meta["health_chunks"].as_u64().unwrap_or(1).max(1) as usize;
    let buckets: Vec<serde_json::Value> =
        layout.buckets.iter().map(|bk| health_json(&bucket_health(&grads[bk.range.clone()], chunks))).collect();
    let recorded = meta["local_health"].as_array().cloned().unwrap_or_default();
    Ok(Replay {
        dump,
        rank: meta["rank"].as_u64().unwrap_or(0) as usize,
        step: meta["step"].as_u64().unwrap_or(0),
        minibatch: meta["minibatch"].as_u64().unwrap_or(0),
        loss: stats.loss,
        identical: recorded == buckets,
        buckets,
        first: probe.first,
    })
}
