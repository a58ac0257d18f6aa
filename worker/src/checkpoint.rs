//! Checkpoints: `RUN_DIR/checkpoints/step-N/` with `state.bin` (weights, Adam moments, rollout
//! weights, step, skip history) and a `DONE` marker, written by rank 0 (replicas are identical).
//! The formats are in [`crate::artifacts`].
//!
//! Invariants: `state.bin` is renamed into place before `DONE` (which holds its checksum) is
//! written, so a crash leaves at most a directory without `DONE`. `--resume` loads the newest
//! checkpoint that is complete and verifies, warns about each newer one that does not (file,
//! expected and found checksum), and stops with exit 2 naming every file when none verifies:
//! corrupt state is never loaded.

use std::path::PathBuf;

use crate::artifacts::{self, CheckpointMeta, SavedHistory};
use crate::train::{checksum, Trainer};
use crate::WorkerError;

impl Trainer {
    pub(crate) fn checkpoint_dir(&self) -> PathBuf {
        self.run_dir.join("checkpoints")
    }

    /// Write the state after `self.step` completed steps (rank 0; replicas are identical).
    pub(crate) fn save_checkpoint(&mut self) -> Result<(), WorkerError> {
        if self.info.rank != 0 {
            return Ok(());
        }
        let dir = self.checkpoint_dir().join(format!("step-{:06}", self.step));
        let meta = CheckpointMeta {
            step: self.step,
            adam_t: self.adam_t,
            config_hash: self.config_hash,
            layout_hash: self.layout().hash(),
            spikes: self.spikes.clone(),
            warnings: self.warnings,
            history: SavedHistory {
                consecutive_skips: self.history.consecutive_skips,
                skipped: self.history.skipped,
                recent: self.history.recent.clone(),
                suspects: self.history.suspects.clone(),
            },
            run: Some(crate::rundir::record(&self.config_text, self.info.world)),
        };
        let tensors: [(&str, &[f32]); 4] =
            [("params", &self.params), ("m", &self.m), ("v", &self.v), ("rollout", &self.rollout)];
        let (faults, step) = (&self.faults, self.step);
        artifacts::save_checkpoint(&dir, &meta, &tensors, self.params_checksum, || faults.at_checkpoint(step))?;
        log::info!("checkpoint {}", dir.display());
        Ok(())
    }

    /// Load the newest checkpoint that is complete and verifies.
    pub(crate) fn resume(&mut self) -> Result<(), WorkerError> {
        let root = self.checkpoint_dir();
        let (dir, l, refused) = artifacts::newest_intact_checkpoint(&root).map_err(|refused| {
            let why: Vec<String> = refused.iter().map(|e| format!("\n  {e}")).collect();
            WorkerError::Usage(format!(
                "--resume: no complete checkpoint under {} verifies{} (hint: checkpoints are written every `checkpoint.every` steps)",
                root.display(),
                if why.is_empty() { " (there is none)".to_string() } else { format!(":{}", why.concat()) }
            ))
        })?;
        if self.info.rank == 0 {
            for e in &refused {
                eprintln!("warning: --resume skips a checkpoint: {e}");
            }
        }
        let meta = &l.meta;
        crate::rundir::resumed(&dir, meta, &self.config_text, &self.info, &self.run_dir)?;
        if meta.layout_hash != self.layout().hash() {
            return Err(WorkerError::Usage(format!("{}: saved for a different model or bucket layout", dir.display())));
        }
        self.params = l.get("params")?.to_vec();
        self.params_checksum = checksum(&self.params);
        self.m = l.get("m")?.to_vec();
        self.v = l.get("v")?.to_vec();
        self.rollout = l.get("rollout")?.to_vec();
        let n = self.layout().len;
        for (name, t) in [("params", &self.params), ("m", &self.m), ("v", &self.v), ("rollout", &self.rollout)] {
            if t.len() != n {
                return Err(WorkerError::Usage(format!(
                    "{}: tensor `{name}` has {} elements, the model has {n}",
                    dir.join("state.bin").display(),
                    t.len()
                )));
            }
        }
        self.step = meta.step;
        self.adam_t = meta.adam_t;
        self.history.consecutive_skips = meta.history.consecutive_skips;
        self.history.skipped = meta.history.skipped;
        self.history.recent = meta.history.recent.clone();
        self.history.suspects = meta.history.suspects.clone();
        self.spikes = meta.spikes.clone();
        self.warnings = meta.warnings;
        if self.info.rank == 0 {
            eprintln!("resumed from {} at step {}", dir.display(), self.step);
        }
        Ok(())
    }
}
