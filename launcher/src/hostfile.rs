//! Hostfiles, stage one: text -> raw entries with line numbers.
//!
//! The syntax is Open MPI's and DeepSpeed's: one host per line, `host [slots=N] [max_slots=M]`
//! (`max-slots` is accepted as Open MPI spells it too), `#` starts a comment anywhere on a line,
//! blank lines are skipped, a bare host has one slot. This stage checks only the shape of each line
//! (valid UTF-8, a host name, known `key=value` pairs with whole-number values, no key twice); whether
//! the entries make a sensible launch (zero slots, duplicate hosts, enough slots for `--np`) is the
//! job of stage two, [`crate::plan::LaunchPlan::from_hosts`], which still has every entry's line.
//!
//! Invariant: [`parse`] never panics, whatever the bytes; every error carries the path and the
//! 1-based line number, and a hint.

use std::path::{Path, PathBuf};

use crate::Error;

/// One host line of a hostfile, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostEntry {
    /// 1-based line number in the file.
    pub line: usize,
    /// The host name or address.
    pub host: String,
    /// `slots=N`, if given.
    pub slots: Option<u32>,
    /// `max_slots=M` (or `max-slots=M`), if given.
    pub max_slots: Option<u32>,
}

/// A parsed hostfile: its path (for later error messages) and its host lines in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hostfile {
    /// The path the file was read from, as given.
    pub path: PathBuf,
    /// The host lines, in file order.
    pub entries: Vec<HostEntry>,
}

/// Reads and parses the hostfile at `path`.
pub fn read(path: &Path) -> Result<Hostfile, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::HostfileRead { path: path.to_path_buf(), source })?;
    parse(path, &bytes)
}

/// Parses hostfile text. `path` is used only in error messages.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Hostfile, Error> {
    let mut entries = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        let err = |message: String, hint: &str| Error::Hostfile {
            path: path.to_path_buf(),
            line,
            message,
            hint: hint.to_string(),
        };
        let text = std::str::from_utf8(raw)
            .map_err(|_| err("the line is not valid UTF-8".into(), "hostfiles are plain text"))?;
        let text = match text.find('#') {
            Some(at) => &text[..at],
            None => text,
        };
        let mut words = text.split_whitespace();
        let Some(host) = words.next() else { continue };
        check_host(host).map_err(|m| err(m, "a host line is `HOST [slots=N] [max_slots=M]`, e.g. `node1 slots=4`"))?;
        let mut entry = HostEntry { line, host: host.to_string(), slots: None, max_slots: None };
        for word in words {
            let Some((key, value)) = word.split_once('=') else {
                return Err(err(
                    format!("expected `key=value` after the host, found `{word}`"),
                    "write `slots=N` without spaces around `=`",
                ));
            };
            let slot = match key {
                "slots" => &mut entry.slots,
                "max_slots" | "max-slots" => &mut entry.max_slots,
                _ => return Err(err(format!("unknown key `{key}`"), "the known keys are `slots` and `max_slots`")),
            };
            if slot.is_some() {
                return Err(err(format!("`{key}` is given twice"), "give each key once per line"));
            }
            let n = value
                .parse::<u32>()
                .map_err(|_| err(format!("`{key}={value}`: the value must be a whole number"), "e.g. `slots=4`"))?;
            *slot = Some(n);
        }
        entries.push(entry);
    }
    Ok(Hostfile { path: path.to_path_buf(), entries })
}

/// Host names are DNS names or IPv4/IPv6 addresses: a conservative character set that still rejects
/// `slots=4` without a host and stray punctuation.
fn check_host(host: &str) -> Result<(), String> {
    if host.contains('=') {
        return Err(format!("the line starts with `{host}`, not with a host name"));
    }
    if let Some(c) = host.chars().find(|c| !(c.is_ascii_alphanumeric() || ".-_:[]%".contains(*c))) {
        return Err(format!("host name `{host}` contains the character {c:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradbus_kernels::rng::Rng;

    fn p(text: &str) -> Result<Hostfile, Error> {
        parse(Path::new("hosts.txt"), text.as_bytes())
    }

    fn line_of(e: Error) -> usize {
        match e {
            Error::Hostfile { line, .. } => line,
            other => panic!("expected a hostfile error, got {other}"),
        }
    }

    #[test]
    fn parses_slots_comments_blank_lines_and_bare_hosts() {
        let h = p("# cluster\n\nnode1 slots=4 max_slots=8 # big one\n  node2\nnode3 max-slots=2\r\n").unwrap();
        let got: Vec<_> = h.entries.iter().map(|e| (e.line, e.host.as_str(), e.slots, e.max_slots)).collect();
        assert_eq!(got, vec![(3, "node1", Some(4), Some(8)), (4, "node2", None, None), (5, "node3", None, Some(2))]);
    }

    #[test]
    fn errors_name_file_and_line() {
        let e = p("a slots=1\nb slots=x\n").unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("hosts.txt:2: "), "{msg}");
        assert!(msg.contains("hint:"), "{msg}");
        assert_eq!(line_of(p("a\n\nslots=4\n").unwrap_err()), 3);
        assert_eq!(line_of(p("a cpus=4\n").unwrap_err()), 1);
        assert_eq!(line_of(p("a slots=1 slots=2\n").unwrap_err()), 1);
        assert_eq!(line_of(p("a slots = 2\n").unwrap_err()), 1);
        assert_eq!(line_of(p("a slots=-1\n").unwrap_err()), 1);
        assert_eq!(line_of(parse(Path::new("h"), b"a\n\xff\n").unwrap_err()), 2);
        assert_eq!(line_of(p("a\nb!c\n").unwrap_err()), 2);
    }

    /// Random bytes, and random mutations of a valid hostfile, never make the parser (or the plan
    /// built from its output) panic.
    #[test]
    fn parser_never_panics_on_random_input() {
        let valid = b"# hosts\nnode1 slots=4 max_slots=8\nnode2 slots=2\n\nnode3\n";
        let alphabet = b"ab1 =\n#\t\rslots=max_slots-0123456789\xff\xc3";
        let mut rng = Rng::new(&[0x4057, 0xF11E]);
        for case in 0..20_000 {
            let bytes: Vec<u8> = if case % 2 == 0 {
                let n = rng.below(80);
                (0..n)
                    .map(|_| if rng.below(4) == 0 { rng.next_u64() as u8 } else { alphabet[rng.below(alphabet.len())] })
                    .collect()
            } else {
                let mut v = valid.to_vec();
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(v.len() + 1);
                    match rng.below(3) {
                        0 if at < v.len() => {
                            v.remove(at);
                        }
                        1 if at < v.len() => v[at] = alphabet[rng.below(alphabet.len())],
                        _ => v.insert(at, alphabet[rng.below(alphabet.len())]),
                    }
                }
                v
            };
            if let Ok(h) = parse(Path::new("fuzz"), &bytes) {
                let np = if rng.below(3) == 0 { None } else { Some(rng.below(40)) };
                let oversubscribe = rng.below(2) == 0;
                if let Ok(plan) = crate::plan::LaunchPlan::from_hosts(&h, np, oversubscribe) {
                    plan.check_invariants();
                }
            }
        }
    }
}
