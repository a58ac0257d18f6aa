//! `report.json`: the agreed report of a job that stopped, naming the build that wrote it.

use std::path::Path;

use serde::Serialize;

use gradbus_collectives::Report;

use crate::sealed::{from_value, seal, unseal_value};
use crate::version::Build;
use crate::{read, ArtifactError};

/// Format version of `report.json` (2 adds `gradbus`, the build that wrote it; 1 is still read).
pub const REPORT_FORMAT: u32 = 2;

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
