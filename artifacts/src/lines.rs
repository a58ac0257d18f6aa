//! JSON-lines artifacts (`metrics.jsonl`, `warnings.jsonl`): one sealed object a line, parsed and
//! verified line by line, and opened for appending on resume with only the lines kept.

use std::fs::File;
use std::path::Path;

use serde::de::DeserializeOwned;

use crate::sealed::unseal;
use crate::{read, ArtifactError};

/// Parse the sealed lines of a JSON-lines artifact of `format` (blank lines skipped); errors name
/// `file:LINE`.
pub(crate) fn parse_lines<T: DeserializeOwned>(text: &str, format: u32, file: &Path) -> Result<Vec<T>, ArtifactError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if !line.trim().is_empty() {
            out.push(unseal(line, format, &format!("{}:{}", file.display(), i + 1))?);
        }
    }
    Ok(out)
}

pub(crate) fn read_lines<T: DeserializeOwned>(path: &Path, format: u32) -> Result<Vec<T>, ArtifactError> {
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
