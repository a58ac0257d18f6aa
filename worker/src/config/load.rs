//! Reading a config: the TOML text, the `--set key=value` overrides merged into it, the typed
//! `Config` deserialized from the merged canonical text (whose hash identifies the config), and the
//! dotted key of a deserialization error.

use std::path::Path;

use gradbus_collectives::layout::Fnv;

use super::Config;
use crate::error::WorkerError;

/// The keys that hold a table.
const SECTIONS: [&str; 9] = ["model", "rl", "loss", "optim", "skip", "checkpoint", "warn", "spike", "sdc"];

/// The dotted key (`optim.lr`, `faults[1].rank`) of the line holding byte `offset` of a TOML text as
/// `toml::Table::to_string` writes it: `[table]` and `[[array]]` headers, one `key = value` a line.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let mut table = String::new();
    let mut arrays: Vec<(String, usize)> = Vec::new();
    let mut pos = 0;
    for line in text.split_inclusive('\n') {
        let t = line.trim();
        let here = offset >= pos && offset < pos + line.len();
        if let Some(name) = t.strip_prefix("[[").and_then(|x| x.strip_suffix("]]")) {
            let name = name.trim().to_string();
            let n = match arrays.iter_mut().find(|(a, _)| *a == name) {
                Some(e) => {
                    e.1 += 1;
                    e.1
                }
                None => {
                    arrays.push((name.clone(), 0));
                    0
                }
            };
            table = format!("{name}[{n}]");
        } else if let Some(name) = t.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
            table = name.trim().to_string();
        } else if here {
            let k = t.split('=').next()?.trim().trim_matches('"');
            return Some(if table.is_empty() { k.to_string() } else { format!("{table}.{k}") });
        }
        if here {
            return Some(table);
        }
        pos += line.len();
    }
    None
}

impl Config {
    /// Load `path`, apply the `--set` overrides, check ranges. Returns the config, its hash and
    /// the canonical merged TOML (which rebuilds the same config with no overrides).
    pub fn load(path: &Path, overrides: &[String]) -> Result<(Config, u64, String), WorkerError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| WorkerError::ConfigRead { path: path.into(), source })?;
        Config::from_toml(&text, &path.display().to_string(), overrides)
    }

    /// Parse TOML text (named `origin` in errors), apply overrides, check ranges.
    pub fn from_toml(text: &str, origin: &str, overrides: &[String]) -> Result<(Config, u64, String), WorkerError> {
        let mut table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| WorkerError::ConfigToml { path: origin.into(), message: e.to_string() })?;
        for arg in overrides {
            apply_override(&mut table, arg)?;
        }
        let origin = if overrides.is_empty() { origin.to_string() } else { format!("{origin} with --set overrides") };
        // serde would take an empty array for a table whose fields all have defaults.
        for (key, v) in table.iter().filter(|(k, _)| SECTIONS.contains(&k.as_str())) {
            if !v.is_table() {
                return Err(WorkerError::ConfigKey {
                    key: key.clone(),
                    origin,
                    message: format!("invalid type: {}, expected a table", v.type_str()),
                    hint: "write it as a [section] of key = value lines, as in examples/tiny.toml",
                });
            }
        }
        let canonical = table.to_string();
        let cfg: Config = toml::from_str(&canonical).map_err(|e| {
            let message = e.message().trim().to_string();
            let hint = if message.starts_with("unknown field") {
                "check the spelling and the table; examples/tiny.toml documents every key"
            } else {
                "examples/tiny.toml documents every key with a value of its type"
            };
            WorkerError::ConfigKey {
                key: e.span().and_then(|s| key_at(&canonical, s.start)).unwrap_or_else(|| "?".into()),
                origin,
                message,
                hint,
            }
        })?;
        cfg.check()?;
        let mut h = Fnv::default();
        h.write(canonical.as_bytes());
        Ok((cfg, h.0, canonical))
    }
}

/// Apply `a.b.c=value` to a TOML table. The value is parsed as a TOML value (`3`, `1e-3`, `true`,
/// `"safe"`); a bare word that is not valid TOML is taken as a string, so `loss.style=safe` works.
fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), WorkerError> {
    let bad = |why: &str| WorkerError::BadOverride { arg: arg.into(), why: why.into() };
    let (key, raw) = arg.split_once('=').ok_or_else(|| bad("missing '='"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(bad("empty key or key segment"));
    }
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").expect("parsed key v"),
        Err(_) => toml::Value::String(raw.trim().to_string()),
    };
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().expect("non-empty key");
    let mut cur = table;
    for p in parts {
        let entry = cur.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| bad(&format!("`{p}` is not a table")))?;
    }
    cur.insert(last.to_string(), value);
    Ok(())
}
