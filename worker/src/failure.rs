//! What a rank leaves behind on an agreed abort: its failure dump (`dumps/rank-K.bin`), rank 0's
//! `report.json`, and the trace of its own update when its gradients were non-finite.
//!
//! Invariant: the dump holds the weights at the start of the failing update and the rank's
//! mini-batch, so `gradbus replay` recomputes exactly the failing gradients.

use serde_json::json;

use gradbus_collectives::{HealthTable, ParamGrads, Report};
use gradbus_kernels::Health;

use crate::gradients::compute_gradients;
use crate::task::Batch;
use crate::tensorfile;
use crate::train::Trainer;
use crate::WorkerError;

impl Trainer {
    /// On abort, each rank whose gradients were non-finite recomputes its update with the trace on
    /// (into a scratch buffer: the bus is left as it is) and reports the first non-finite op, in its
    /// log and in `RUN_DIR/trace-rank-K.json`.
    pub(crate) fn trace_failure(&mut self, mb: &Batch, report: &Report) -> Result<(), WorkerError> {
        let layout = self.layout().clone();
        let mut trace =
            crate::forensics::Trace { first: None, param_names: layout.slots.iter().map(|s| s.name.clone()).collect() };
        let mut scratch = vec![0.0; layout.len];
        let grads = &mut ParamGrads::new(&mut scratch, &layout);
        compute_gradients(&self.gpt, &self.cfg, &self.params, &mut self.acts, mb, grads, &mut trace);
        let line = trace
            .first
            .as_ref()
            .map_or_else(|| "no non-finite tensor on recomputation (transient?)".to_string(), |f| f.describe());
        eprintln!(
            "rank {}: trace of step {} update {}: first non-finite: {line}",
            self.info.rank, report.step, report.minibatch
        );
        let p = self.run_dir.join(format!("trace-rank-{}.json", self.info.rank));
        let text = serde_json::to_string_pretty(
            &json!({"step": report.step, "minibatch": report.minibatch, "rank": self.info.rank, "first": trace.first}),
        )
        .expect("json")
            + "\n";
        tensorfile::write_atomic(&p, text.as_bytes()).map_err(|e| WorkerError::io(&p.display().to_string(), e))
    }

    /// On abort: every rank dumps the state at the start of the failing update and its mini-batch;
    /// rank 0 writes `report.json`.
    pub(crate) fn write_failure(&self, mb: &Batch, table: &HealthTable, report: &Report) -> Result<(), WorkerError> {
        let dumps = self.run_dir.join("dumps");
        std::fs::create_dir_all(&dumps).map_err(|e| WorkerError::io(&dumps.display().to_string(), e))?;
        let rank = self.info.rank;
        let local: Vec<_> = (0..table.buckets).map(|b| health_json(table.cell(b, rank))).collect();
        let f32s = |v: &[u32]| v.iter().map(|&t| t as f32).collect::<Vec<f32>>();
        let meta = json!({
            "config": self.config_text,
            "rank": rank,
            "world": self.info.world,
            "step": report.step,
            "minibatch": report.minibatch,
            "attempt": report.attempt,
            "b": mb.b,
            "t": mb.t,
            "loss": table.reports[rank].loss,
            "local_health": local,
            "health_chunks": self.bus.health_chunks(),
            "report": report,
        });
        let (inputs, targets) = (f32s(&mb.inputs), f32s(&mb.targets));
        let path = dumps.join(format!("rank-{rank}.bin"));
        tensorfile::save(
            &path,
            &meta,
            &[
                ("params", &self.params),
                ("inputs", &inputs),
                ("targets", &targets),
                ("mask", &mb.mask),
                ("reward", &mb.reward),
                ("adv", &mb.adv),
                ("old_logp", &mb.old_logp),
                ("ref_logp", &mb.ref_logp),
            ],
        )
        .map_err(|e| WorkerError::io(&path.display().to_string(), e))?;
        if rank == 0 {
            let p = self.run_dir.join("report.json");
            let text = serde_json::to_string_pretty(report).expect("json") + "\n";
            tensorfile::write_atomic(&p, text.as_bytes()).map_err(|e| WorkerError::io(&p.display().to_string(), e))?;
        }
        Ok(())
    }
}

/// JSON of a health cell, sums of squares as bits so replay can compare exactly.
pub fn health_json(h: &Health) -> serde_json::Value {
    json!({"nan": h.nan, "inf": h.inf, "sumsq_bits": format!("{:016x}", h.sumsq.to_bits()), "first_bad": h.first_bad})
}

/// One line about a non-finite report, the same on every rank.
pub fn describe(r: &Report) -> String {
    format!(
        "non-finite gradients at step {} update {} (attempt {}): rank(s) {:?}, bucket #{}, param {} element {}, {} NaN, {} Inf, loss {}; verdict {:?}{}",
        r.step,
        r.minibatch,
        r.attempt,
        r.ranks,
        r.bucket,
        r.param,
        r.element,
        r.nan,
        r.inf,
        if r.loss_finite { "finite" } else { "NOT finite" },
        r.verdict,
        r.classification.as_ref().map(|c| format!(" ({c})")).unwrap_or_default()
    )
}
