//! `report.json`: the agreed report of a job that stopped, naming the build that wrote it.

use std::path::Path;

use serde::Serialize;

use gradbus_collectives::Report;

use crate::sealed::{from_value, seal, unseal_value};
use crate::version::Build;
use crate::{read, ArtifactError};

/// Format version of `report.json` (2 adds `gradbus`, the build that wrote it; 3 adds each bad
/// rank's `samples`; 1 and 2 are still read).
pub const REPORT_FORMAT: u32 = 3;

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

/// Verify and parse the text of a `report.json` of format 3, or of format 2 or 1 (before reports
/// named each bad rank's samples, and before they named their build); `file` names it in errors.
pub fn parse_report(text: &str, file: &str) -> Result<Report, ArtifactError> {
    let schema = |what: String| ArtifactError::Schema { file: file.to_string(), what };
    let (version, mut v) = unseal_value(text.trim_end_matches('\n'), file)?;
    if !(1..=REPORT_FORMAT as u64).contains(&version) {
        return Err(ArtifactError::Version {
            file: file.into(),
            what: "format",
            found: version,
            expected: REPORT_FORMAT,
        });
    }
    if version >= 2 {
        let build = v.remove("gradbus").ok_or_else(|| schema("missing key `gradbus`".into()))?;
        from_value::<Build>(build).map_err(|e| schema(format!("key `gradbus`: {e}")))?;
    }
    let mut v = serde_json::Value::Object(v);
    if version < 3 && !add_samples(&mut v) {
        return Err(schema(format!("format {version} has no `per_rank[].samples` (hint: not a file gradbus wrote)")));
    }
    from_value(v).map_err(schema)
}

/// A report of format 1 or 2 brought up to 3: an empty `samples` for each bad rank. False when the
/// report already has one, or has no `per_rank` list (not a file gradbus wrote).
pub(crate) fn add_samples(report: &mut serde_json::Value) -> bool {
    let Some(per_rank) = report.get_mut("per_rank").and_then(|p| p.as_array_mut()) else { return false };
    per_rank
        .iter_mut()
        .all(|r| r.as_object_mut().is_some_and(|r| r.insert("samples".into(), serde_json::json!([])).is_none()))
}

/// Read and verify `report.json`.
pub fn read_report(path: &Path) -> Result<Report, ArtifactError> {
    let bytes = read(path)?;
    parse_report(&String::from_utf8_lossy(&bytes), &path.display().to_string())
}
