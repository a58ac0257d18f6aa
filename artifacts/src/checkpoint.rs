//! Checkpoints (`checkpoints/step-N/state.bin` and `DONE`): the metadata, the write (state, then
//! the `DONE` marker that holds its checksum) and the loads that verify both, down to the newest
//! intact checkpoint `--resume` takes.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use gradbus_collectives::forecast::{self, Forecast};
use gradbus_collectives::spikes::SpikeDetector;

use crate::container::{decode, encode, Kind, Loaded};
use crate::sealed::{crc_hex, hex64, required, seal, unseal};
use crate::version::Build;
use crate::{crc, read, write_atomic, ArtifactError};

/// Format version of a checkpoint's `state.bin` metadata (2 adds `run`: what it was trained with;
/// 3 adds `forecast`, the headroom's trend; 1 and 2 are still read).
pub const CHECKPOINT_FORMAT: u32 = 3;
/// Format version of a checkpoint's `DONE` marker.
pub const DONE_FORMAT: u32 = 1;

/// The verdict history a checkpoint keeps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedHistory {
    /// Skips in a row.
    pub consecutive_skips: u32,
    /// Skipped updates in total.
    pub skipped: u64,
    /// Skip flags of the most recent updates.
    pub recent: VecDeque<bool>,
    /// Ranks classified suspect.
    pub suspects: Vec<usize>,
}

/// The metadata of `checkpoints/step-N/state.bin` (its tensors: `params`, `m`, `v`, `rollout`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointMeta {
    /// Steps completed (the next step to run).
    pub step: u64,
    /// Adam's step counter.
    pub adam_t: u64,
    /// Hash of the config and layout the state was trained with.
    #[serde(with = "hex64")]
    pub config_hash: u64,
    /// Hash of the bucket layout.
    #[serde(with = "hex64")]
    pub layout_hash: u64,
    /// The spike detectors (loss, grad norm).
    pub spikes: [SpikeDetector; 2],
    /// The trend of the largest log-ratio fed to an exp (empty in a checkpoint of format 1 or 2,
    /// which did not record it: the forecast starts again from the resumed step).
    pub forecast: Forecast,
    /// Headroom warnings so far.
    pub warnings: u32,
    /// The verdict history.
    pub history: SavedHistory,
    /// The config, world size and build the state was trained with (null in a checkpoint of
    /// format 1, which did not record them).
    #[serde(deserialize_with = "required")]
    pub run: Option<RunRecord>,
    /// The silent-data-corruption guard's outlier history and its count of findings (absent in a
    /// checkpoint written before the guard: a resume then starts an empty history).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sdc: Option<SavedSdc>,
}

/// The silent-data-corruption guard's state a checkpoint keeps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedSdc {
    /// The outlier rule's history (null when the rule was off).
    #[serde(deserialize_with = "required")]
    pub outliers: Option<gradbus_collectives::sdc::OutlierDetector>,
    /// Findings so far (repairs, outliers).
    pub detections: u64,
}

impl Kind for CheckpointMeta {
    const KIND: &'static str = "checkpoint";
    const FORMAT: u32 = CHECKPOINT_FORMAT;

    fn upgrade(format: u64, meta: &mut serde_json::Value) -> bool {
        let Some(m) = meta.as_object_mut() else { return false };
        // A key that the format did not have is refused, not overwritten: not a file gradbus wrote.
        let mut add = |key: &str, v: serde_json::Value| m.insert(key.into(), v).is_none();
        let empty = || serde_json::to_value(Forecast::new(forecast::DEFAULT_WINDOW)).expect("json");
        match format {
            1 => add("run", serde_json::Value::Null) && add("forecast", empty()),
            2 => add("forecast", empty()),
            _ => false,
        }
    }
}

/// What a run's state was trained with: `--resume` compares it with the config it is given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRecord {
    /// The build of gradbus.
    pub gradbus: Build,
    /// World size.
    pub world: usize,
    /// The canonical config text (`--set` overrides applied).
    pub config: String,
}

/// `DONE`: written last, it says the checkpoint is complete and holds `state.bin`'s checksum.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Done {
    /// CRC-32C of the whole `state.bin`.
    #[serde(with = "crc_hex")]
    pub state_crc32c: u32,
    /// Its length in bytes.
    pub state_bytes: u64,
    /// Checksum of the weights (as in `metrics.jsonl`).
    #[serde(with = "hex64")]
    pub params_checksum: u64,
}

/// Write a checkpoint directory's `state.bin` then `DONE`; `before_rename` runs between the
/// temp file and its rename (the fault plan's checkpoint phase).
pub fn save_checkpoint(
    dir: &Path,
    meta: &CheckpointMeta,
    tensors: &[(&str, &[f32])],
    params_checksum: u64,
    before_rename: impl FnOnce(),
) -> Result<(), ArtifactError> {
    let io = |p: &Path| {
        let file = p.display().to_string();
        move |source| ArtifactError::Io { file, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let bytes = encode(meta, tensors);
    let state = dir.join("state.bin");
    let tmp = dir.join("state.bin.tmp");
    std::fs::write(&tmp, &bytes).map_err(io(&state))?;
    before_rename();
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(io(&state))?;
    std::fs::rename(&tmp, &state).map_err(io(&state))?;
    let done = Done { state_crc32c: crc(&bytes), state_bytes: bytes.len() as u64, params_checksum };
    let done_path = dir.join("DONE");
    write_atomic(&done_path, (seal(DONE_FORMAT, &done, false) + "\n").as_bytes()).map_err(io(&done_path))
}

/// Verify and load one checkpoint directory: `DONE`, then `state.bin` against it, then every section.
pub fn load_checkpoint(dir: &Path) -> Result<Loaded<CheckpointMeta>, ArtifactError> {
    let done_path = dir.join("DONE");
    let done_text = match std::fs::read(&done_path) {
        Ok(b) => String::from_utf8_lossy(&b).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ArtifactError::Truncated {
                file: done_path.display().to_string(),
                what: "no DONE marker (the checkpoint write did not finish)".into(),
            })
        }
        Err(source) => return Err(ArtifactError::Io { file: done_path.display().to_string(), source }),
    };
    let done: Done = unseal(done_text.trim_end_matches('\n'), DONE_FORMAT, &done_path.display().to_string())?;
    let state = dir.join("state.bin");
    let bytes = read(&state)?;
    let file = state.display().to_string();
    if bytes.len() as u64 != done.state_bytes {
        let what = format!("{} bytes, DONE records {}", bytes.len(), done.state_bytes);
        return Err(ArtifactError::Truncated { file, what });
    }
    let found = crc(&bytes);
    if found != done.state_crc32c {
        let section = "whole file (as DONE records it)".into();
        return Err(ArtifactError::Checksum { file, section, expected: done.state_crc32c, found });
    }
    decode(&bytes, &file)
}

/// The checkpoint `--resume` uses: the newest `step-N` directory that is complete and verifies.
/// Every newer one that does not is returned with its reason (for the warning); if none verifies,
/// the error lists each directory and why.
pub fn newest_intact_checkpoint(
    dir: &Path,
) -> Result<(PathBuf, Loaded<CheckpointMeta>, Vec<ArtifactError>), Vec<ArtifactError>> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    dirs.sort();
    let mut refused = Vec::new();
    for d in dirs.into_iter().rev() {
        match load_checkpoint(&d) {
            Ok(l) => return Ok((d, l, refused)),
            Err(e) => refused.push(e),
        }
    }
    Err(refused)
}
