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
use gradbus_kernels::backend::{Backend, Cpu};

use crate::config::Config;
use crate::error::WorkerError;
use crate::gradients::{self, Work};
use crate::model::{self, Gpt};
use crate::probe::{ExpOp, Phase, Probe};
use crate::task::Batch;
pub use gradbus_artifacts::Finding;
use gradbus_artifacts::{self as artifacts, DumpMeta, HealthRecord, Loaded};

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
    fn check<B: Backend>(
        &mut self,
        be: &B,
        op: &'static str,
        layer: Option<usize>,
        phase: Phase,
        data: B::View<'_>,
        dims: &[usize],
    ) {
        if self.first.is_some() {
            return;
        }
        let data = be.to_host(data);
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

    fn grad<B: Backend>(&mut self, be: &B, param: usize, data: B::View<'_>) {
        if self.first.is_some() {
            return;
        }
        let data = be.to_host(data);
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

    fn exp<B: Backend>(&mut self, be: &B, e: ExpOp<'_, B>) {
        if self.first.is_some() {
            return;
        }
        let (input, output, mask) = (be.to_host(e.input), be.to_host(e.output), be.to_host(e.mask));
        let bad = |i: &usize| (!e.safe || mask[*i] != 0.0) && !output[*i].is_finite();
        let n = (0..output.len()).filter(bad).count();
        if let Some(i) = (0..output.len()).find(bad) {
            self.first = Some(Finding {
                op: e.op.to_string(),
                layer: None,
                phase: "forward",
                sample: Some(i / e.dims[1]),
                token: Some(i % e.dims[1]),
                value: output[i],
                exp_input: Some(input[i]),
                masked: Some(mask[i] == 0.0),
                overflows: Some(n),
            });
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
    pub minibatch: u32,
    /// The replayed loss.
    pub loss: f32,
    /// Per-bucket health of the replayed local gradients.
    pub buckets: Vec<HealthRecord>,
    /// Whether every bucket's health equals the one the rank recorded (bitwise).
    pub identical: bool,
    /// The first non-finite op, with `--trace`.
    pub first: Option<Finding>,
}

/// The dump to replay: a file, or in a dumps directory the first rank the report names.
fn pick_dump(path: &Path) -> Result<(PathBuf, Loaded<DumpMeta>), WorkerError> {
    if !path.is_dir() {
        return Ok((path.to_path_buf(), artifacts::load(path)?));
    }
    let dumps = if path.join("dumps").is_dir() { path.join("dumps") } else { path.to_path_buf() };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dumps)
        .map_err(|e| WorkerError::DumpNotFound(format!("{}: {e}", dumps.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .collect();
    files.sort();
    let mut first = None;
    for f in files {
        let l: Loaded<DumpMeta> = artifacts::load(&f)?;
        if l.meta.report.ranks.first() == Some(&l.meta.rank) {
            return Ok((f, l));
        }
        first.get_or_insert((f, l));
    }
    first.ok_or_else(|| {
        WorkerError::DumpNotFound(format!(
            "{}: no dump files (hint: dumps are written when the job aborts)",
            dumps.display()
        ))
    })
}

/// Re-execute the dumped update in this process.
pub fn replay(path: &Path, trace: bool) -> Result<Replay, WorkerError> {
    let (dump, l) = pick_dump(path)?;
    let meta = &l.meta;
    let (cfg, _, _) = Config::from_toml(&meta.config, &format!("{} (embedded config)", dump.display()), &[])?;
    let layout = Layout::new(&model::param_specs(&cfg.model), cfg.bucket_bytes);
    let gpt = Gpt::new(&cfg.model, &layout);
    let params = l.get("params")?.to_vec();
    let toks = |n: &str| l.get(n).map(|v| v.iter().map(|&x| x as u32).collect::<Vec<u32>>());
    let (b, t) = (meta.b, meta.t);
    let mb = Batch {
        b,
        t,
        inputs: toks("inputs")?,
        targets: toks("targets")?,
        mask: l.get("mask")?.to_vec(),
        reward: l.get("reward")?.to_vec(),
        adv: l.get("adv")?.to_vec(),
        old_logp: l.get("old_logp")?.to_vec(),
        ref_logp: l.get("ref_logp")?.to_vec(),
    };
    let mut work = Work::new(&Cpu, &cfg, b, t);
    let mut grads = vec![0.0; layout.len];
    let mut probe = Trace { first: None, param_names: layout.slots.iter().map(|s| s.name.clone()).collect() };
    let g = &mut ParamGrads::new(&mut grads, &layout);
    let stats = if trace {
        gradients::compute_gradients(&Cpu, &gpt, &cfg, &params, &mut work, &mb, g, &mut probe)
    } else {
        gradients::compute_gradients(&Cpu, &gpt, &cfg, &params, &mut work, &mb, g, &mut crate::probe::NoProbe)
    };
    let chunks = meta.health_chunks.max(1);
    let buckets: Vec<HealthRecord> =
        layout.buckets.iter().map(|bk| HealthRecord::from(&bucket_health(&grads[bk.range.clone()], chunks))).collect();
    Ok(Replay {
        identical: meta.local_health == buckets,
        dump,
        rank: meta.rank,
        step: meta.step,
        minibatch: meta.minibatch,
        loss: stats.loss,
        buckets,
        first: probe.first,
    })
}
