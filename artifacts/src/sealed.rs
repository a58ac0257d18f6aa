//! Sealed JSON, the shape of every JSON artifact: `{"format": N, ...fields..., "crc32c": "xxxxxxxx"}`
//! (the crate doc gives the rule), and the serde helpers the formats share: numbers that may be
//! non-finite (`nullable`), u64 and u32 checksums as hex (`hex64`, `crc_hex`), keys that must be
//! present although null (`required`).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{crc, ArtifactError};

const CRC_KEY: &str = "\"crc32c\"";

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
pub(crate) fn unseal_value(
    text: &str,
    file: &str,
) -> Result<(u64, serde_json::Map<String, serde_json::Value>), ArtifactError> {
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
pub(crate) fn from_value<T: DeserializeOwned>(v: serde_json::Value) -> Result<T, String> {
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

/// Serde helpers for a u32 written as 8 hex digits (CRC-32C checksums).
pub(crate) mod crc_hex {
    use super::*;
    pub fn serialize<S: Serializer>(x: &u32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{x:08x}"))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let t = String::deserialize(d)?;
        u32::from_str_radix(&t, 16).map_err(|_| serde::de::Error::custom(format!("{t:?} is not 8 hex digits")))
    }
}
