//! One small file format for checkpoints and failure dumps: a JSON header and named f32 tensors,
//! written atomically (temp file, fsync, rename, fsync of the directory).
//!
//! Layout: `GBTF` magic, u32 version, u64 header length, header JSON (`meta` plus the tensor table
//! of names and lengths), then the tensors' little-endian f32 bytes in table order. A reader never
//! sees a half-written file under the final name: a crash leaves at most a `.tmp` that nobody loads.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use serde_json::Value;

const MAGIC: &[u8; 4] = b"GBTF";
const VERSION: u32 = 1;

/// Write `bytes` to `path` atomically.
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

/// Encode `meta` and `tensors` into the file format.
pub fn encode(meta: &Value, tensors: &[(&str, &[f32])]) -> Vec<u8> {
    let table: Vec<Value> = tensors.iter().map(|(n, t)| serde_json::json!({"name": n, "len": t.len()})).collect();
    let header = serde_json::to_vec(&serde_json::json!({"meta": meta, "tensors": table})).expect("json");
    let body: usize = tensors.iter().map(|(_, t)| t.len() * 4).sum();
    let mut out = Vec::with_capacity(16 + header.len() + body);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    for (_, t) in tensors {
        for v in t.iter() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// A loaded file: its meta and its tensors in order.
#[derive(Debug)]
pub struct Loaded {
    /// The JSON meta.
    pub meta: Value,
    /// Named tensors.
    pub tensors: Vec<(String, Vec<f32>)>,
}

impl Loaded {
    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_slice())
    }
}

/// Save atomically.
pub fn save(path: &Path, meta: &Value, tensors: &[(&str, &[f32])]) -> std::io::Result<()> {
    write_atomic(path, &encode(meta, tensors))
}

/// Load and check a file; errors say what is wrong with which file.
pub fn load(path: &Path) -> Result<Loaded, String> {
    let mut bytes = Vec::new();
    File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad =
        |why: &str| format!("{}: {why} (hint: the file is not a complete gradbus checkpoint or dump)", path.display());
    if bytes.len() < 16 || &bytes[..4] != MAGIC {
        return Err(bad("bad magic"));
    }
    let version = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(bad(&format!("format version {version}, this build reads {VERSION}")));
    }
    let hlen = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")) as usize;
    let header: Value =
        bytes.get(16..16 + hlen).and_then(|h| serde_json::from_slice(h).ok()).ok_or_else(|| bad("bad header"))?;
    let mut at = 16 + hlen;
    let mut tensors = Vec::new();
    for t in header["tensors"].as_array().ok_or_else(|| bad("no tensor table"))? {
        let name = t["name"].as_str().ok_or_else(|| bad("tensor without name"))?.to_string();
        let len = t["len"].as_u64().ok_or_else(|| bad("tensor without len"))? as usize;
        let raw = bytes.get(at..at + 4 * len).ok_or_else(|| bad("truncated"))?;
        tensors.push((name, raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()));
        at += 4 * len;
    }
    if at != bytes.len() {
        return Err(bad("trailing bytes"));
    }
    Ok(Loaded { meta: header["meta"].clone(), tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_is_bitwise_and_truncation_is_an_error() {
        let dir = std::env::temp_dir().join(format!("gbtf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.bin");
        let a = [1.0f32, f32::NAN, -0.0, 1e-41];
        save(&p, &serde_json::json!({"step": 7}), &[("a", &a), ("empty", &[])]).unwrap();
        let l = load(&p).unwrap();
        assert_eq!(l.meta["step"], 7);
        let got = l.get("a").unwrap();
        assert!(got.iter().zip(&a).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(l.get("empty").unwrap().len(), 0);
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        assert!(load(&p).unwrap_err().contains("truncated"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
