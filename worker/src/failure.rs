//! What a rank leaves behind on an agreed abort: its failure dump (`dumps/rank-K.bin`), rank 0's
//! `report.json`, and the trace of its own update when its gradients were non-finite.
//!
//! Invariant: the dump holds the weights at the start of the failing update and the rank's
//! mini-batch, so `gradbus replay` recomputes exactly the failing gradients.

use std::path::Path;

use gradbus_collectives::grads::FlatGrads;
use gradbus_collectives::{Cause, HealthTable, Layout, Report};
use gradbus_kernels::backend::Backend;

use crate::config::Config;
use crate::error::WorkerError;
use crate::gradients::{compute_gradients, Work};
use crate::model::Gpt;
use crate::rank::RankInfo;
use crate::task::Batch;
use gradbus_artifacts::{self as artifacts, DumpMeta, HealthRecord, TraceFile};

/// On abort, a rank whose gradients were non-finite recomputes its update with the trace on (into
/// scratch gradients: the bus is left as it is) and reports the first non-finite op, in its log
/// and in `RUN_DIR/trace-rank-K.json`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn trace_failure<B: Backend>(
    be: &B,
    gpt: &Gpt,
    cfg: &Config,
    params: &B::Buf,
    work: &mut Work<B>,
    layout: &Layout,
    mb: &Batch,
    report: &Report,
    run_dir: &Path,
    rank: usize,
) -> Result<(), WorkerError> {
    let mut trace =
        crate::forensics::Trace { first: None, param_names: layout.slots.iter().map(|s| s.name.clone()).collect() };
    let mut scratch = be.zeros(layout.len);
    let ranges: Vec<_> = layout.slots.iter().map(|s| s.range()).collect();
    let grads = &mut FlatGrads::new(be, &mut scratch, &ranges);
    compute_gradients(be, gpt, cfg, params, work, mb, grads, &mut trace);
    let line = trace
        .first
        .as_ref()
        .map_or_else(|| "no non-finite tensor on recomputation (transient?)".to_string(), |f| f.describe());
    eprintln!("rank {rank}: trace of step {} update {}: first non-finite: {line}", report.step, report.minibatch);
    let p = run_dir.join(format!("trace-rank-{rank}.json"));
    let file = TraceFile { step: report.step, minibatch: report.minibatch, rank, first: trace.first };
    let text = file.to_text();
    artifacts::write_atomic(&p, text.as_bytes()).map_err(|e| WorkerError::io(&p.display().to_string(), e))
}

/// On abort: every rank dumps the weights at the start of the failing update (`params`, on the
/// host) and its mini-batch; rank 0 writes `report.json`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_failure(
    run_dir: &Path,
    info: &RankInfo,
    config_text: &str,
    health_chunks: usize,
    params: &[f32],
    mb: &Batch,
    table: &HealthTable,
    report: &Report,
) -> Result<(), WorkerError> {
    let dumps = run_dir.join("dumps");
    std::fs::create_dir_all(&dumps).map_err(|e| WorkerError::io(&dumps.display().to_string(), e))?;
    let rank = info.rank;
    let f32s = |v: &[u32]| v.iter().map(|&t| t as f32).collect::<Vec<f32>>();
    let meta = DumpMeta {
        config: config_text.to_string(),
        rank,
        world: info.world,
        step: report.step,
        minibatch: report.minibatch,
        attempt: report.attempt,
        b: mb.b,
        t: mb.t,
        // An abort decided from the summary alone (a deterministic outlier) has no per-rank detail.
        loss: table.reports.get(rank).map_or(f64::NAN, |r| r.loss),
        local_health: match table.is_detailed() {
            true => (0..table.buckets).map(|b| HealthRecord::from(table.cell(b, rank))).collect(),
            false => Vec::new(),
        },
        health_chunks,
        report: report.clone(),
    };
    let (inputs, targets) = (f32s(&mb.inputs), f32s(&mb.targets));
    let path = dumps.join(format!("rank-{rank}.bin"));
    let tensors: [(&str, &[f32]); 8] = [
        ("params", params),
        ("inputs", &inputs),
        ("targets", &targets),
        ("mask", &mb.mask),
        ("reward", &mb.reward),
        ("adv", &mb.adv),
        ("old_logp", &mb.old_logp),
        ("ref_logp", &mb.ref_logp),
    ];
    artifacts::write_atomic(&path, &artifacts::encode(&meta, &tensors))
        .map_err(|e| WorkerError::io(&path.display().to_string(), e))?;
    if rank == 0 {
        let p = run_dir.join("report.json");
        artifacts::write_atomic(&p, artifacts::report_text(report).as_bytes())
            .map_err(|e| WorkerError::io(&p.display().to_string(), e))?;
    }
    Ok(())
}

/// One line about a report, the same on every rank.
pub fn describe(r: &Report) -> String {
    match r.cause {
        Cause::LocalGradients | Cause::SumOverflow => format!("non-finite gradients at {r}"),
        Cause::Outlier | Cause::Replicas => format!("silent data corruption at {r}"),
    }
}
