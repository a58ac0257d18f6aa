//! Checkpoints: `RUN_DIR/checkpoints/step-N/` with `state.bin` (weights, Adam moments, rollout
//! weights, step, skip history) and a `DONE` marker, written by rank 0 (replicas are identical).
//!
//! Invariant: `state.bin` is renamed into place before `DONE` is written, so a crash leaves at most
//! a directory without `DONE`, which `--resume` never loads.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::tensorfile;
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
        std::fs::create_dir_all(&dir).map_err(|e| WorkerError::io(&dir.display().to_string(), e))?;
        let meta = json!({
            "step": self.step,
            "adam_t": self.adam_t,
            "config_hash": format!("{:016x}", self.config_hash),
            "layout_hash": format!("{:016x}", self.layout().hash()),
            "spikes": self.spikes,
            "warnings": self.warnings,
            "history": {
                "consecutive_skips": self.history.consecutive_skips,
                "skipped": self.history.skipped,
                "recent": self.history.recent,
                "suspects": self.history.suspects,
            },
        });
        let bytes = tensorfile::encode(
            &meta,
            &[("params", &self.params), ("m", &self.m), ("v", &self.v), ("rollout", &self.rollout)],
        );
        let state = dir.join("state.bin");
        let tmp = dir.join("state.bin.tmp");
        let io = |e| WorkerError::io(&state.display().to_string(), e);
        std::fs::write(&tmp, &bytes).map_err(io)?;
        self.faults.at_checkpoint(self.step);
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io)?;
        std::fs::rename(&tmp, &state).map_err(io)?;
        tensorfile::write_atomic(&dir.join("DONE"), format!("{:016x}\n", checksum(&self.params)).as_bytes())
            .map_err(io)?;
        log::info!("checkpoint {}", dir.display());
        Ok(())
    }

    /// Load the latest complete checkpoint (one with its DONE marker).
    pub(crate) fn resume(&mut self) -> Result<(), WorkerError> {
        let Some(dir) = latest_checkpoint(&self.checkpoint_dir()) else {
            return Err(WorkerError::Usage(format!(
                "--resume: no complete checkpoint under {} (hint: checkpoints are written every `checkpoint.every` steps)",
                self.checkpoint_dir().display()
            )));
        };
        let l = tensorfile::load(&dir.join("state.bin")).map_err(WorkerError::Usage)?;
        let want = format!("{:016x}", self.layout().hash());
        if l.meta["layout_hash"].as_str() != Some(want.as_str()) {
            return Err(WorkerError::Usage(format!("{}: saved for a different model or bucket layout", dir.display())));
        }
        let get = |n: &str| {
            l.get(n).map(<[f32]>::to_vec).ok_or_else(|| WorkerError::Usage(format!("{}: no tensor {n}", dir.display())))
        };
        self.params = get("params")?;
        self.m = get("m")?;
        self.v = get("v")?;
        self.rollout = get("rollout")?;
        self.step = l.meta["step"].as_u64().unwrap_or(0);
        self.adam_t = l.meta["adam_t"].as_u64().unwrap_or(0);
        let h = &l.meta["history"];
        self.history.consecutive_skips = h["consecutive_skips"].as_u64().unwrap_or(0) as u32;
        self.history.skipped = h["skipped"].as_u64().unwrap_or(0);
        self.history.recent = h["recent"]
            .as_array()
            .map(|a| a.iter().map(|b| b.as_bool().unwrap_or(false)).collect())
            .unwrap_or_default();
        self.history.suspects = h["suspects"]
            .as_array()
            .map(|a| a.iter().filter_map(|b| b.as_u64()).map(|b| b as usize).collect())
            .unwrap_or_default();
        if let Ok(spikes) = serde_json::from_value(l.meta["spikes"].clone()) {
            self.spikes = spikes;
        }
        self.warnings = l.meta["warnings"].as_u64().unwrap_or(0) as u32;
        if self.info.rank == 0 {
            eprintln!("resumed from {} at step {}", dir.display(), self.step);
        }
        Ok(())
    }
}

/// The newest `step-N` directory that has its DONE marker.
pub fn latest_checkpoint(dir: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("DONE").exists() && p.join("state.bin").exists())
        .collect();
    dirs.sort();
    dirs.pop()
}
