//! The binary container of dumps and checkpoint state (`GBTF`; the crate doc gives the layout):
//! `encode`, and `decode`/`load` that verify every byte before they return a tensor.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::sealed::{crc_hex, from_value};
use crate::{crc, read, ArtifactError};

/// Version of the binary container (`GBTF`).
pub const CONTAINER_VERSION: u32 = 2;
const MAGIC: &[u8; 4] = b"GBTF";

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TensorEntry {
    name: String,
    len: usize,
    #[serde(with = "crc_hex")]
    crc32c: u32,
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
