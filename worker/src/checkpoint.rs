//! Checkpoints: `RUN_DIR/checkpoints/step-N/` with `state.bin` (weights, Adam moments, rollout
//! weights, step, skip history) and a `DONE` marker, written by rank 0 (replicas are identical).
//! The formats are in [`gradbus_artifacts`].
//!
//! Invariants: `state.bin` is renamed into place before `DONE` (which holds its checksum) is
//! written, so a crash leaves at most a directory without `DONE`. `--resume` loads the newest
//! checkpoint that is complete and verifies, warns about each newer one that does not (file,
//! expected and found checksum), and stops with exit 2 naming every file when none verifies:
//! corrupt state is never loaded.

use std::path::{Path, PathBuf};

use gradbus_collectives::Layout;

use crate::config::Config;
use crate::error::WorkerError;
use crate::faults::FaultPlan;
use crate::judge::Judge;
use crate::rank::RankInfo;
use gradbus_artifacts::{self as artifacts, CheckpointMeta, RunRecord, SavedHistory, SavedSdc};

/// The state a checkpoint holds, as host slices (a backend's `to_host`: borrowed on the CPU).
pub(crate) struct State<'a> {
    /// Steps completed.
    pub step: u64,
    /// Adam's step counter.
    pub adam_t: u64,
    /// The weights, Adam's moments and the rollout engine's weights.
    pub params: &'a [f32],
    pub m: &'a [f32],
    pub v: &'a [f32],
    pub rollout: &'a [f32],
    /// The replica checksum of `params`.
    pub params_checksum: u64,
    /// History, spike detectors, warnings.
    pub judge: &'a Judge,
}

/// A checkpoint as loaded: the host tensors and the rest of the state.
pub(crate) struct Restored {
    /// Steps completed (the next step to run).
    pub step: u64,
    /// Adam's step counter.
    pub adam_t: u64,
    /// The weights, Adam's moments and the rollout engine's weights, each the layout's length.
    pub params: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub rollout: Vec<f32>,
    /// History, spike detectors, warnings.
    pub judge: Judge,
}

fn checkpoint_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

/// Write `s`, trained as `run` says, as `checkpoints/step-N` (rank 0 calls this; replicas are
/// identical).
pub(crate) fn save(
    run_dir: &Path,
    config_hash: u64,
    layout: &Layout,
    s: &State<'_>,
    run: RunRecord,
    faults: &FaultPlan,
) -> Result<(), WorkerError> {
    let dir = checkpoint_dir(run_dir).join(format!("step-{:06}", s.step));
    let h = &s.judge.verdicts.history;
    let meta = CheckpointMeta {
        step: s.step,
        adam_t: s.adam_t,
        config_hash,
        layout_hash: layout.hash(),
        spikes: s.judge.verdicts.spikes.clone(),
        forecast: s.judge.forecast.clone(),
        warnings: s.judge.warnings,
        history: SavedHistory {
            consecutive_skips: h.consecutive_skips,
            skipped: h.skipped,
            recent: h.recent.clone(),
            suspects: h.suspects.clone(),
        },
        run: Some(run),
        sdc: Some(SavedSdc {
            outliers: s.judge.verdicts.sdc.outliers.clone(),
            detections: s.judge.verdicts.sdc.detections,
        }),
    };
    let tensors: [(&str, &[f32]); 4] = [("params", s.params), ("m", s.m), ("v", s.v), ("rollout", s.rollout)];
    let step = s.step;
    artifacts::save_checkpoint(&dir, &meta, &tensors, s.params_checksum, || faults.at_checkpoint(step))?;
    log::info!("checkpoint {}", dir.display());
    Ok(())
}

/// Load the newest checkpoint under `run_dir` that is complete and verifies, for `layout`; the run
/// it was trained with is compared with this one (`config_text` on `info.world` ranks, see
/// `crate::rundir::resumed`).
pub(crate) fn restore(
    run_dir: &Path,
    layout: &Layout,
    cfg: &Config,
    config_text: &str,
    info: &RankInfo,
) -> Result<Restored, WorkerError> {
    let rank = info.rank;
    let root = checkpoint_dir(run_dir);
    let (dir, l, refused) = artifacts::newest_intact_checkpoint(&root).map_err(|refused| {
        let why: Vec<String> = refused.iter().map(|e| format!("\n  {e}")).collect();
        WorkerError::Usage(format!(
            "--resume: no complete checkpoint under {} verifies{} (hint: checkpoints are written every `checkpoint.every` steps)",
            root.display(),
            if why.is_empty() { " (there is none)".to_string() } else { format!(":{}", why.concat()) }
        ))
    })?;
    if rank == 0 {
        for e in &refused {
            eprintln!("warning: --resume skips a checkpoint: {e}");
        }
    }
    let meta = &l.meta;
    crate::rundir::resumed(&dir, meta, config_text, info, run_dir)?;
    if meta.layout_hash != layout.hash() {
        return Err(WorkerError::Usage(format!("{}: saved for a different model or bucket layout", dir.display())));
    }
    let (params, m, v, rollout) = (l.get("params")?, l.get("m")?, l.get("v")?, l.get("rollout")?);
    let n = layout.len;
    for (name, t) in [("params", params), ("m", m), ("v", v), ("rollout", rollout)] {
        if t.len() != n {
            return Err(WorkerError::Usage(format!(
                "{}: tensor `{name}` has {} elements, the model has {n}",
                dir.join("state.bin").display(),
                t.len()
            )));
        }
    }
    let mut judge = Judge::new(cfg, layout.buckets.len(), info.world, rank);
    if let Some(sdc) = &meta.sdc {
        // The rule comes from this run's config; the history from the checkpoint, when it was kept
        // under the same rule and layout.
        let g = &mut judge.verdicts.sdc;
        if let (Some(mine), Some(saved)) = (&mut g.outliers, &sdc.outliers) {
            if saved.rule() == mine.rule() && saved.buckets() == mine.buckets() {
                *mine = saved.clone();
            }
        }
        g.detections = sdc.detections;
    }
    judge.verdicts.history.consecutive_skips = meta.history.consecutive_skips;
    judge.verdicts.history.skipped = meta.history.skipped;
    judge.verdicts.history.recent = meta.history.recent.clone();
    judge.verdicts.history.suspects = meta.history.suspects.clone();
    judge.verdicts.spikes = meta.spikes.clone();
    judge.forecast = meta.forecast.clone();
    judge.warnings = meta.warnings;
    if rank == 0 {
        eprintln!("resumed from {} at step {}", dir.display(), meta.step);
    }
    Ok(Restored {
        step: meta.step,
        adam_t: meta.adam_t,
        params: params.to_vec(),
        m: m.to_vec(),
        v: v.to_vec(),
        rollout: rollout.to_vec(),
        judge,
    })
}
