//! Every file gradbus writes and reads back, defined once: `metrics.jsonl` and `warnings.jsonl` lines, `report.json`,
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

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use gradbus_collectives::forecast::{self, Alert, Forecast, Outlook};
use gradbus_collectives::spikes::SpikeDetector;
use gradbus_collectives::{Action, Report};
use gradbus_kernels::Health;

use crate::version::Build;

pub mod version;

/// Format version of a `metrics.jsonl` line.
pub const METRICS_FORMAT: u32 = 1;
/// Format version of `report.json` (2 adds `gradbus`, the build that wrote it; 1 is still read).
pub const REPORT_FORMAT: u32 = 2;
/// Format version of a checkpoint's `DONE` marker.
pub const DONE_FORMAT: u32 = 1;
/// Format version of a checkpoint's `state.bin` metadata (2 adds `run`: what it was trained with;
/// 3 adds `forecast`, the headroom's trend; 1 and 2 are still read).
pub const CHECKPOINT_FORMAT: u32 = 3;
/// Format version of a failure dump's metadata.
pub const DUMP_FORMAT: u32 = 1;
/// Version of the binary container (`GBTF`).
pub const CONTAINER_VERSION: u32 = 2;
const MAGIC: &[u8; 4] = b"GBTF";
const CRC_KEY: &str = "\"crc32c\"";

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

// ------------------------------------------------------------------------------------------------
// Sealed JSON: `{"format": N, ...fields..., "crc32c": "xxxxxxxx"}`.

#[derive(Serialize)]
struct Versioned<'a, T: Serialize> {
    format: u32,
    #[serde(flatten)]
    body: &'a T,
}

/// `body` as a JSON object with its format version first and its checksum last (one line when not
/// `pretty`, no trailing newline).
pub fn seal<T: Serialize>(format: u32, body: &T, pretty: bool) -> String {
    let v = Versioned { format, body };
    let text = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) }.expect("json");
    let open = text.strip_suffix('}').expect("an object").trim_end();
    let prefix = format!("{open},{}", if pretty { "\n  " } else { "" });
    let sum = crc(prefix.as_bytes());
    if pretty {
        format!("{prefix}{CRC_KEY}: \"{sum:08x}\"\n}}")
    } else {
        format!("{prefix}{CRC_KEY}:\"{sum:08x}\"}}")
    }
}

/// Verify and parse a sealed JSON object written by [`seal`]; `file` names it in errors (with
/// `:LINE` for a line of a JSON-lines file).
pub fn unseal<T: DeserializeOwned>(text: &str, format: u32, file: &str) -> Result<T, ArtifactError> {
    let (version, v) = unseal_value(text, file)?;
    if version != format as u64 {
        return Err(ArtifactError::Version { file: file.into(), what: "format", found: version, expected: format });
    }
    from_value(serde_json::Value::Object(v)).map_err(|what| ArtifactError::Schema { file: file.to_string(), what })
}

/// Verify a sealed JSON object's checksum; its format version and its other keys (for a reader of
/// several versions).
fn unseal_value(text: &str, file: &str) -> Result<(u64, serde_json::Map<String, serde_json::Value>), ArtifactError> {
    let schema = |what: String| ArtifactError::Schema { file: file.to_string(), what };
    // The checksum first: a damaged byte is reported as what it is, whatever it broke.
    let written = text.rfind(CRC_KEY).and_then(|k| {
        let rest = text[k + CRC_KEY.len()..].trim_start().strip_prefix(':')?.trim_start().strip_prefix('"')?;
        Some((k, u32::from_str_radix(rest.get(..8)?, 16).ok()?))
    });
    let parsed = serde_json::from_str::<serde_json::Value>(text);
    let Some((k, expected)) = written else {
        return Err(match parsed {
            Err(e) if e.is_eof() => {
                ArtifactError::Truncated { file: file.into(), what: format!("the JSON ends early ({e})") }
            }
            Err(e) => schema(format!("not JSON: {e}")),
            Ok(_) => {
                schema("missing key `crc32c` (hint: not a gradbus artifact, or written by an older gradbus)".into())
            }
        });
    };
    let found = crc(&text.as_bytes()[..k]);
    if expected != found {
        return Err(ArtifactError::Checksum { file: file.into(), section: "content".into(), expected, found });
    }
    let serde_json::Value::Object(mut obj) = parsed.map_err(|e| schema(format!("not JSON: {e}")))? else {
        return Err(schema("not a JSON object".into()));
    };
    obj.remove("crc32c");
    let version = obj.remove("format").ok_or_else(|| schema("missing key `format`".into()))?;
    let version = version.as_u64().ok_or_else(|| schema("key `format` is not an integer".into()))?;
    Ok((version, obj))
}

/// Deserialize a JSON value; an error names the key (`history.skipped: invalid type: ...`).
fn from_value<T: DeserializeOwned>(v: serde_json::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.into_inner().to_string()
        } else {
            format!("key `{path}`: {}", e.into_inner())
        }
    })
}

/// Serde helpers for numbers that may be non-finite: written as `null` (serde_json's own choice
/// for NaN and +-Inf), read back as NaN. A missing key is still an error.
pub mod nullable {
    use super::*;

    /// Write a number (non-finite as `null`).
    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else {
            s.serialize_none()
        }
    }

    /// Read a number or `null` (NaN).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }

    /// The same for a list of numbers.
    pub mod vec {
        use super::*;

        /// Write numbers (non-finite as `null`).
        pub fn serialize<S: Serializer>(x: &[f64], s: S) -> Result<S::Ok, S::Error> {
            let v: Vec<Option<f64>> = x.iter().map(|&x| x.is_finite().then_some(x)).collect();
            v.serialize(s)
        }

        /// Read numbers or `null`s (NaN).
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
            Ok(Vec::<Option<f64>>::deserialize(d)?.into_iter().map(|x| x.unwrap_or(f64::NAN)).collect())
        }
    }
}

/// Serde helpers for a u64 written as 16 hex digits (checksums, hashes, f64 bits).
pub mod hex64 {
    use super::*;

    /// Write 16 hex digits.
    pub fn serialize<S: Serializer>(x: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{x:016x}"))
    }

    /// Read 16 hex digits.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let t = String::deserialize(d)?;
        u64::from_str_radix(&t, 16).map_err(|_| serde::de::Error::custom(format!("{t:?} is not 16 hex digits")))
    }
}

/// A field that must be present although it may be `null` (serde defaults a missing `Option` to
/// `None`; here a missing key is an error).
pub(crate) fn required<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    T::deserialize(d)
}

// ------------------------------------------------------------------------------------------------
// metrics.jsonl

/// One line of `metrics.jsonl`: one optimizer update as every rank agreed on it (written by rank 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsLine {
    /// RL step.
    pub step: u64,
    /// Update inside the step (epoch * minibatches + mini-batch).
    pub minibatch: u32,
    /// 0, or 1 for a rerun.
    pub attempt: u32,
    /// Mean loss over ranks.
    #[serde(with = "nullable")]
    pub loss: f64,
    /// Mean reward over ranks.
    #[serde(with = "nullable")]
    pub reward: f64,
    /// Mean KL over ranks.
    #[serde(with = "nullable")]
    pub kl: f64,
    /// Global gradient norm of the mean gradient.
    #[serde(with = "nullable")]
    pub grad_norm: f64,
    /// Norm of each reduced bucket (of the mean gradient), in reduce order.
    #[serde(with = "nullable::vec")]
    pub bucket_norms: Vec<f64>,
    /// Ranks whose local gradients were non-finite.
    pub nonfinite_ranks: Vec<usize>,
    /// Largest log-ratio of a response position fed to an exp, over ranks.
    #[serde(with = "nullable")]
    pub max_logratio_response: f64,
    /// Largest log-ratio of a masked position fed to an exp, over ranks.
    #[serde(with = "nullable")]
    pub max_logratio_masked: f64,
    /// ln(f32::MAX) minus the larger of the two.
    #[serde(with = "nullable")]
    pub headroom: f64,
    /// The spike, described, if the update was one.
    #[serde(deserialize_with = "required")]
    pub spike: Option<String>,
    /// Why the update was skipped, if it was.
    #[serde(deserialize_with = "required")]
    pub skip_cause: Option<String>,
    /// Smallest log-prob of a response token, over ranks.
    #[serde(with = "nullable")]
    pub min_response_logp: f64,
    /// Learning rate of the update.
    pub lr: f32,
    /// What every rank did.
    pub verdict: Action,
    /// Skipped updates so far.
    pub skipped: u64,
    /// Checksum of the weights after the update.
    #[serde(with = "hex64")]
    pub checksum: u64,
    /// Wall-clock time of the update (the only field that differs between identical runs).
    pub time_update_ms: f64,
}

impl MetricsLine {
    /// The line as written (no newline).
    pub fn to_line(&self) -> String {
        seal(METRICS_FORMAT, self, false)
    }
}

/// Parse the text of a `metrics.jsonl` (blank lines skipped); errors name `file:LINE`.
pub fn parse_metrics(text: &str, file: &Path) -> Result<Vec<MetricsLine>, ArtifactError> {
    parse_lines(text, METRICS_FORMAT, file)
}

/// Read and verify `metrics.jsonl`.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricsLine>, ArtifactError> {
    read_lines(path, METRICS_FORMAT)
}

/// Parse the sealed lines of a JSON-lines artifact of `format` (blank lines skipped); errors name
/// `file:LINE`.
fn parse_lines<T: DeserializeOwned>(text: &str, format: u32, file: &Path) -> Result<Vec<T>, ArtifactError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if !line.trim().is_empty() {
            out.push(unseal(line, format, &format!("{}:{}", file.display(), i + 1))?);
        }
    }
    Ok(out)
}

fn read_lines<T: DeserializeOwned>(path: &Path, format: u32) -> Result<Vec<T>, ArtifactError> {
    let bytes = read(path)?;
    let text = String::from_utf8(bytes)
        .map_err(|e| ArtifactError::Schema { file: path.display().to_string(), what: format!("not UTF-8: {e}") })?;
    parse_lines(&text, format, path)
}

/// Open a JSON-lines artifact of `format` (`metrics.jsonl`, `warnings.jsonl`) to append to: empty
/// for a fresh run (`keep` None); on resume, with only the lines `keep` keeps (those of the updates
/// before the checkpoint), each verified first. A last line without its newline is a write a crash
/// cut short: dropped, and its error returned beside the file for the caller to warn about. Any
/// other line that does not verify is an error naming the file and line: nothing is rewritten.
pub fn open_lines<T: DeserializeOwned>(
    path: &Path,
    format: u32,
    keep: Option<&dyn Fn(&T) -> bool>,
) -> Result<(File, Option<ArtifactError>), ArtifactError> {
    let io = |source| ArtifactError::Io { file: path.display().to_string(), source };
    let (mut kept, mut torn_error) = (String::new(), None);
    if let Some(keep) = keep {
        let text = match std::fs::read(path) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(e)),
        };
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        for (i, raw) in lines.iter().enumerate() {
            let torn = i + 1 == lines.len() && !raw.ends_with('\n');
            let line = raw.trim_end_matches('\n');
            if line.trim().is_empty() {
                continue;
            }
            match unseal::<T>(line, format, &format!("{}:{}", path.display(), i + 1)) {
                Ok(m) if keep(&m) => kept.push_str(&format!("{line}\n")),
                Ok(_) => {}
                Err(e) if torn => torn_error = Some(e),
                Err(e) => return Err(e),
            }
        }
    }
    std::fs::write(path, kept).map_err(io)?;
    let file = std::fs::OpenOptions::new().append(true).open(path).map_err(io)?;
    Ok((file, torn_error))
}

// ------------------------------------------------------------------------------------------------
// warnings.jsonl

/// Format version of a `warnings.jsonl` line.
pub const WARNINGS_FORMAT: u32 = 1;

/// One line of `warnings.jsonl`: an agreed quantity came near its ceiling, or is forecast to
/// within a few updates (`gradbus_collectives::forecast`). Written by rank 0: of the runtime for
/// the largest log-ratio fed to an exp of its loss (`warn.*`), of the PyTorch guard for each
/// quantity of `guard.watch`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarningLine {
    /// The optimizer update, from 0: the runtime's step x updates per step + update within the
    /// step; the guard's `step`.
    pub update: u64,
    /// What is watched: the runtime's `loss.exp`; the name given to `guard.watch`.
    pub quantity: String,
    /// The largest value over every rank (null when non-finite).
    #[serde(with = "nullable")]
    pub value: f64,
    /// Its ceiling (ln of the dtype's largest finite value for an exp argument).
    pub limit: f64,
    /// The lowest rank holding `value`.
    pub rank: usize,
    /// Updates until the ceiling at the trend's slope; null without a rising trend.
    #[serde(deserialize_with = "required")]
    pub forecast_updates: Option<f64>,
    /// `warn`, or `stop`: every rank stopped before the update (the stop policy).
    pub action: Alert,
}

impl WarningLine {
    /// The line for `quantity`'s outlook at `update`, held by `rank`.
    pub fn new(update: u64, quantity: &str, o: &Outlook, rank: usize, action: Alert) -> WarningLine {
        WarningLine {
            update,
            quantity: quantity.into(),
            value: o.value,
            limit: o.limit,
            rank,
            forecast_updates: o.updates,
            action,
        }
    }

    /// The line as written (no newline).
    pub fn to_line(&self) -> String {
        seal(WARNINGS_FORMAT, self, false)
    }
}

/// Read and verify `warnings.jsonl`.
pub fn read_warnings(path: &Path) -> Result<Vec<WarningLine>, ArtifactError> {
    read_lines(path, WARNINGS_FORMAT)
}

// ------------------------------------------------------------------------------------------------
// report.json

/// `report.json` as written: the build that wrote it, then the report's own keys.
#[derive(Serialize)]
struct ReportFile<'a> {
    gradbus: Build,
    #[serde(flatten)]
    report: &'a Report,
}

/// `report.json` (pretty, for people too), naming this build.
pub fn report_text(report: &Report) -> String {
    seal(REPORT_FORMAT, &ReportFile { gradbus: crate::version::build(), report }, true) + "\n"
}

/// Verify and parse the text of a `report.json` of format 2, or of format 1 (before reports named
/// their build); `file` names it in errors.
pub fn parse_report(text: &str, file: &str) -> Result<Report, ArtifactError> {
    let schema = |what: String| ArtifactError::Schema { file: file.to_string(), what };
    let (version, mut v) = unseal_value(text.trim_end_matches('\n'), file)?;
    match version {
        1 => {}
        2 => {
            let build = v.remove("gradbus").ok_or_else(|| schema("missing key `gradbus`".into()))?;
            from_value::<Build>(build).map_err(|e| schema(format!("key `gradbus`: {e}")))?;
        }
        found => {
            return Err(ArtifactError::Version { file: file.into(), what: "format", found, expected: REPORT_FORMAT })
        }
    }
    from_value(serde_json::Value::Object(v)).map_err(schema)
}

/// Read and verify `report.json`.
pub fn read_report(path: &Path) -> Result<Report, ArtifactError> {
    let bytes = read(path)?;
    parse_report(&String::from_utf8_lossy(&bytes), &path.display().to_string())
}

// ------------------------------------------------------------------------------------------------
// The binary container.

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TensorEntry {
    name: String,
    len: usize,
    #[serde(with = "crc_hex")]
    crc32c: u32,
}

mod crc_hex {
    use super::*;
    pub fn serialize<S: Serializer>(x: &u32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{x:08x}"))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let t = String::deserialize(d)?;
        u32::from_str_radix(&t, 16).map_err(|_| serde::de::Error::custom(format!("{t:?} is not 8 hex digits")))
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header<M> {
    kind: String,
    format: u32,
    meta: M,
    tensors: Vec<TensorEntry>,
}

/// A kind of binary artifact: its name in the header and its metadata's format version.
pub trait Kind: Serialize + DeserializeOwned {
    /// `checkpoint` or `dump`.
    const KIND: &'static str;
    /// Format version of the metadata.
    const FORMAT: u32;

    /// Brings the metadata JSON of an older `format` up to [`Kind::FORMAT`]; false when this build
    /// does not read that format (the load then fails with a version error).
    fn upgrade(_format: u64, _meta: &mut serde_json::Value) -> bool {
        false
    }
}

/// Encode `meta` and `tensors` into the container.
pub fn encode<M: Kind>(meta: &M, tensors: &[(&str, &[f32])]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, t)| t.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let table = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, t), b)| TensorEntry { name: n.to_string(), len: t.len(), crc32c: crc(b) })
        .collect();
    let header =
        serde_json::to_vec(&Header { kind: M::KIND.into(), format: M::FORMAT, meta, tensors: table }).expect("json");
    let mut out = Vec::with_capacity(20 + header.len() + bytes.iter().map(Vec::len).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&CONTAINER_VERSION.to_le_bytes());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&crc(&header).to_le_bytes());
    for b in bytes {
        out.extend_from_slice(&b);
    }
    out
}

/// A verified container: its metadata and its tensors in order.
#[derive(Debug)]
pub struct Loaded<M> {
    /// The metadata.
    pub meta: M,
    /// Named tensors.
    pub tensors: Vec<(String, Vec<f32>)>,
    file: String,
}

impl<M> Loaded<M> {
    /// A tensor by name, or an error naming the file and the tensor.
    pub fn get(&self, name: &str) -> Result<&[f32], ArtifactError> {
        self.tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_slice())
            .ok_or_else(|| ArtifactError::Schema { file: self.file.clone(), what: format!("missing tensor `{name}`") })
    }
}

/// Verify and decode a container's bytes; `file` names it in errors.
pub fn decode<M: Kind>(bytes: &[u8], file: &str) -> Result<Loaded<M>, ArtifactError> {
    let truncated = |what: String| ArtifactError::Truncated { file: file.into(), what };
    let schema = |what: String| ArtifactError::Schema { file: file.into(), what };
    if bytes.len() < 4 || &bytes[..4] != MAGIC {
        return Err(schema("no GBTF magic (hint: not a gradbus checkpoint or dump)".into()));
    }
    let word = |at: usize, n: usize| bytes.get(at..at + n).ok_or_else(|| truncated(format!("{} bytes", bytes.len())));
    let version = u32::from_le_bytes(word(4, 4)?.try_into().expect("4 bytes"));
    if version != CONTAINER_VERSION {
        return Err(ArtifactError::Version {
            file: file.into(),
            what: "container",
            found: version as u64,
            expected: CONTAINER_VERSION,
        });
    }
    let hlen = u64::from_le_bytes(word(8, 8)?.try_into().expect("8 bytes"));
    let hend = 16usize.saturating_add(usize::try_from(hlen).unwrap_or(usize::MAX));
    if hend.saturating_add(4) > bytes.len() {
        return Err(truncated(format!("header of {hlen} bytes and its checksum, file of {} bytes", bytes.len())));
    }
    let header = &bytes[16..hend];
    let expected = u32::from_le_bytes(bytes[hend..hend + 4].try_into().expect("4 bytes"));
    let found = crc(header);
    if expected != found {
        return Err(ArtifactError::Checksum { file: file.into(), section: "header".into(), expected, found });
    }
    let mut raw: serde_json::Value = serde_json::from_slice(header).map_err(|e| schema(format!("header: {e}")))?;
    match raw.get("kind").and_then(|k| k.as_str()) {
        Some(k) if k == M::KIND => {}
        Some(k) => return Err(schema(format!("a {k}, not a {} (hint: pass the right file)", M::KIND))),
        None => return Err(schema("header: missing key `kind`".into())),
    }
    match raw.get("format").map(|f| f.as_u64()) {
        Some(Some(f)) if f == M::FORMAT as u64 => {}
        Some(Some(f)) if raw.get_mut("meta").is_some_and(|meta| M::upgrade(f, meta)) => {}
        Some(Some(f)) => {
            return Err(ArtifactError::Version { file: file.into(), what: "format", found: f, expected: M::FORMAT })
        }
        Some(None) => return Err(schema("header: key `format` is not an integer".into())),
        None => return Err(schema("header: missing key `format`".into())),
    }
    let h: Header<M> = from_value(raw).map_err(|e| schema(format!("header: {e}")))?;
    let mut at = hend + 4;
    let mut tensors = Vec::with_capacity(h.tensors.len());
    for t in &h.tensors {
        let raw = at.checked_add(t.len.saturating_mul(4)).and_then(|end| bytes.get(at..end)).ok_or_else(|| {
            truncated(format!("tensor `{}` of {} floats at byte {at}, file of {}", t.name, t.len, bytes.len()))
        })?;
        let found = crc(raw);
        if found != t.crc32c {
            let section = format!("tensor `{}`", t.name);
            return Err(ArtifactError::Checksum { file: file.into(), section, expected: t.crc32c, found });
        }
        tensors.push((
            t.name.clone(),
            raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect(),
        ));
        at += raw.len();
    }
    if at != bytes.len() {
        return Err(schema(format!("{} trailing bytes after the last tensor", bytes.len() - at)));
    }
    Ok(Loaded { meta: h.meta, tensors, file: file.into() })
}

/// Read, verify and decode a container file.
pub fn load<M: Kind>(path: &Path) -> Result<Loaded<M>, ArtifactError> {
    decode(&read(path)?, &path.display().to_string())
}

// ------------------------------------------------------------------------------------------------
// Failure dumps.

/// One bucket's health as a dump records it: sums of squares as bits, so replay compares exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthRecord {
    /// NaN elements.
    pub nan: u64,
    /// Inf elements.
    pub inf: u64,
    /// Bits of the f64 sum of squares of the finite elements.
    #[serde(with = "hex64")]
    pub sumsq_bits: u64,
    /// First non-finite element, relative to the bucket.
    #[serde(deserialize_with = "required")]
    pub first_bad: Option<u64>,
}

impl From<&Health> for HealthRecord {
    fn from(h: &Health) -> HealthRecord {
        HealthRecord { nan: h.nan, inf: h.inf, sumsq_bits: h.sumsq.to_bits(), first_bad: h.first_bad }
    }
}

/// The metadata of `dumps/rank-K.bin` (its tensors: `params`, `inputs`, `targets`, `mask`,
/// `reward`, `adv`, `old_logp`, `ref_logp`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DumpMeta {
    /// The canonical config text (replay rebuilds the run from it).
    pub config: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// World size.
    pub world: usize,
    /// RL step of the failing update.
    pub step: u64,
    /// The failing update inside the step.
    pub minibatch: u32,
    /// Its attempt.
    pub attempt: u32,
    /// Mini-batch rows (B).
    pub b: usize,
    /// Sequence length (T).
    pub t: usize,
    /// This rank's loss.
    #[serde(with = "nullable")]
    pub loss: f64,
    /// This rank's bucket health before the reduce, in reduce order.
    pub local_health: Vec<HealthRecord>,
    /// How many chunks the transport scans a bucket in (the sums of squares depend on it).
    pub health_chunks: usize,
    /// The agreed report.
    pub report: Report,
}

impl Kind for DumpMeta {
    const KIND: &'static str = "dump";
    const FORMAT: u32 = DUMP_FORMAT;
}

// ------------------------------------------------------------------------------------------------
// Traces (`trace-rank-K.json`, written for people and tests; gradbus never reads one back).

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

// ------------------------------------------------------------------------------------------------
// Checkpoints.

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

// ------------------------------------------------------------------------------------------------
// The run directory's owner and history (`gradbus_worker::rundir`).

/// Format version of `gradbus.lock`'s content.
pub const LOCK_FORMAT: u32 = 1;
/// Format version of a `resumes.jsonl` line.
pub const RESUME_FORMAT: u32 = 1;

/// `RUN_DIR/gradbus.lock`: the job that holds (or last held) the directory's lock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockHolder {
    /// The job id (the launcher's, or the worker's under a bare mpirun or srun).
    pub job_id: String,
    /// The process that holds the lock.
    pub pid: u32,
    /// Its host.
    pub host: String,
    /// When it took the lock, UTC (`2026-12-01T05:17:00Z`).
    pub started: String,
    /// Its command line.
    pub command: String,
    /// Its build.
    pub gradbus: Build,
}

impl LockHolder {
    /// The file's text (one line).
    pub fn to_text(&self) -> String {
        seal(LOCK_FORMAT, self, false) + "\n"
    }
}

/// One changed key of a resumed run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Change {
    /// The dotted config key, or `world size`.
    pub key: String,
    /// The value the checkpoint was trained with (TOML), or `(not set)`.
    pub old: String,
    /// The value of this run.
    pub new: String,
}

/// One line of `RUN_DIR/resumes.jsonl`: a resume, and what it changed (written by rank 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRecord {
    /// The step the run resumed at (the checkpoint's).
    pub step: u64,
    /// The resuming job.
    pub job_id: String,
    /// When, UTC.
    pub at: String,
    /// The resuming build.
    pub gradbus: Build,
    /// Seed, world size and data-affecting keys that differ from the checkpoint's run; null when
    /// the checkpoint (format 1) did not record its run.
    #[serde(deserialize_with = "required")]
    pub changes: Option<Vec<Change>>,
}

impl ResumeRecord {
    /// The line as written (no newline).
    pub fn to_line(&self) -> String {
        seal(RESUME_FORMAT, self, false)
    }
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

#[cfg(test)]
mod tests;
