//! Every file gradbus writes and reads back, defined once: `metrics.jsonl`, `warnings.jsonl` and
//! `quarantine.jsonl` lines, `report.json`,
//! failure dumps (`dumps/rank-K.bin`) and checkpoints (`checkpoints/step-N/state.bin` and `DONE`).
//! Writers and readers (the worker, `gradbus replay`, `gradbus report`, `--resume`, the Python
//! guard's `report.json`) use these types and functions only. A crate of its own, below the worker:
//! the launcher and the Python package read and write these formats without linking the worker.
//!
//! Invariants: every artifact carries its format version and a CRC-32C of its content, written with
//! the data, and every load verifies both before it trusts a byte; a missing key is an error, never
//! a default. Errors name the file (and line), and say expected vs found checksum, the missing key,
//! the unknown version or the truncation.
//!
//! JSON artifacts (a metrics line, `report.json`, `DONE`) are objects whose first key is `format`
//! and whose last key is `crc32c`: the CRC-32C (8 hex digits) of every byte of the text before the
//! `"crc32c"` key. Non-finite numbers are written as JSON `null` (read back as NaN).
//!
//! Binary files (dumps, checkpoint state): `GBTF` magic, u32 container version, u64 header length,
//! the header JSON (`kind`, `format`, `meta`, and the tensor table: name, length, CRC-32C of the
//! tensor's bytes), the u32 CRC-32C of the header, then the tensors' little-endian f32 bytes in table
//! order. Every byte is covered: magic and version are compared, a wrong header length breaks the
//! header's checksum or the exact-length check. Written atomically (temp file, fsync, rename, fsync
//! of the directory): a crash leaves at most a `.tmp` that nobody loads.
//!
//! The modules, one file format each: `metrics`, `warnings`, `quarantine`, `report`, `dump`, `trace`,
//! `checkpoint`, `rundir` (the lock and `resumes.jsonl`); the encodings they share, `sealed` (the
//! JSON rule above), `lines` (JSON-lines files) and `container` (the binary one); `version` (the
//! build). The crate root holds the error and the atomic write, and re-exports every format, so
//! readers name `gradbus_artifacts::MetricsLine`.

use std::fs::File;
use std::io::Write;
use std::path::Path;

mod checkpoint;
mod container;
mod dump;
mod lines;
mod metrics;
mod quarantine;
mod report;
mod rundir;
mod sealed;
mod trace;
pub mod version;
mod warnings;

pub use checkpoint::{
    load_checkpoint, newest_intact_checkpoint, save_checkpoint, CheckpointMeta, Done, RunRecord, SavedHistory,
    SavedSdc, CHECKPOINT_FORMAT, DONE_FORMAT,
};
pub use container::{decode, encode, load, Kind, Loaded, CONTAINER_VERSION};
pub use dump::{DumpMeta, HealthRecord, DUMP_FORMAT};
pub use lines::open_lines;
pub use metrics::{parse_metrics, read_metrics, MetricsLine, METRICS_FORMAT};
pub use quarantine::{read_quarantine, QuarantineLine, QUARANTINE_FORMAT};
pub use report::{parse_report, read_report, report_text, REPORT_FORMAT};
pub use rundir::{Change, LockHolder, ResumeRecord, LOCK_FORMAT, RESUME_FORMAT};
pub use sealed::{hex64, nullable, seal, unseal};
pub use trace::{Finding, TraceFile, TRACE_FORMAT};
pub use warnings::{read_warnings, WarningLine, WARNINGS_FORMAT};

/// Why an artifact was refused.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The file could not be read or written.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A checksum does not match the content.
    #[error("{file}: checksum mismatch in {section}: expected {expected:08x}, found {found:08x} (hint: the file was damaged after it was written)")]
    Checksum {
        /// The file (and line).
        file: String,
        /// Which part: `header`, `tensor params`, `whole file`, `line`.
        section: String,
        /// The checksum written with the data.
        expected: u32,
        /// The checksum of the data as read.
        found: u32,
    },
    /// The file ends before its content does.
    #[error("{file}: truncated: {what}")]
    Truncated {
        /// The file (and line).
        file: String,
        /// What is missing.
        what: String,
    },
    /// A format version this build does not read.
    #[error("{file}: unknown {what} version {found}, this build reads {expected}")]
    Version {
        /// The file (and line).
        file: String,
        /// Which version: `format` or `container`.
        what: &'static str,
        /// The version in the file.
        found: u64,
        /// The version this build reads.
        expected: u32,
    },
    /// A key is missing, unknown or of the wrong type, or the bytes are not the format at all.
    #[error("{file}: {what}")]
    Schema {
        /// The file (and line).
        file: String,
        /// What is wrong, naming the key.
        what: String,
    },
}

fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Write `bytes` to `path` atomically (temp file, fsync, rename, fsync of the directory).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("{}.tmp", path.extension().and_then(|e| e.to_str()).unwrap_or("")));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        File::open(if dir.as_os_str().is_empty() { Path::new(".") } else { dir })?.sync_all()?;
    }
    Ok(())
}

fn read(path: &Path) -> Result<Vec<u8>, ArtifactError> {
    std::fs::read(path).map_err(|source| ArtifactError::Io { file: path.display().to_string(), source })
}

#[cfg(test)]
mod tests;
