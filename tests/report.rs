//! `gradbus report`: real runs (one that finishes, one that aborts from the ROLL-style loss), then
//! the report of each - the SVG renders with its panels, marks the abort and the warnings, is
//! byte-identical across two reports, and the summary names the abort step and the replay command.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use common::gradbus;

/// The two run directories, made once for every test of this file.
struct Runs {
    _dir: tempfile::TempDir,
    ok: PathBuf,
    fail: PathBuf,
}

fn runs() -> &'static Runs {
    static RUNS: OnceLock<Runs> = OnceLock::new();
    RUNS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let ok = dir.path().join("ok");
        let fail = dir.path().join("fail");
        let okp = ok.to_str().unwrap();
        gradbus(
            &[
                "run",
                "--np",
                "2",
                "--run-dir",
                okp,
                "examples/tiny.toml",
                "--set",
                "steps=6",
                "--set",
                "checkpoint.every=0",
            ],
            &[],
        )
        .expect_code(0);
        let mut args = vec!["run", "--np", "2", "--run-dir", fail.to_str().unwrap()];
        args.push("examples/tiny.toml");
        args.extend_from_slice(common::FAST_SEED_CASE);
        args.extend_from_slice(&["--set", "checkpoint.every=0"]);
        gradbus(&args, &[]).expect_code(3);
        Runs { _dir: dir, ok, fail }
    })
}

/// Held by each test that reports on the shared run directories: a report rewrites report.svg, and
/// one test must not read another's (e.g. a different --margin).
fn lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// `gradbus report DIR` (exit 0) -> (stdout, the SVG).
fn report(dir: &Path, extra: &[&str]) -> (String, String) {
    let mut args = vec!["report", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    let r = gradbus(&args, &[]);
    r.expect_code(0);
    let svg = std::fs::read_to_string(dir.join("report.svg")).expect("report.svg");
    (r.stdout(), svg)
}

const PANELS: [&str; 5] = [
    "loss (mean over ranks)",
    "reward (mean)",
    "global grad norm (log scale)",
    "per-bucket grad norms (log scale)",
    "log-ratio headroom to exp overflow",
];

#[test]
fn a_clean_run_renders_every_panel_and_no_event() {
    let r = runs();
    let _g = lock();
    let (out, svg) = report(&r.ok, &[]);
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    assert!(svg.trim_end().ends_with("</svg>"));
    for p in PANELS {
        assert!(svg.contains(p), "panel `{p}` missing");
    }
    assert!(svg.contains("bucket #0") && svg.contains("exp overflow (log-ratio 88.72)"));
    assert!(!svg.contains("ABORT") && !svg.contains("skipped update"), "a clean run has no events");
    assert!(!svg.contains("off the axis"), "a clean run's linear panels show every value");
    assert!(out.contains("6 step(s) (0..=5)"), "{out}");
    assert!(out.contains("abort: none"), "{out}");
    assert!(!out.contains("replay:"), "{out}");
    assert!(out.contains(&format!("wrote {}", r.ok.join("report.svg").display())), "{out}");
}

#[test]
fn an_aborted_run_marks_the_abort_and_the_warnings_and_names_the_replay() {
    let r = runs();
    let _g = lock();
    let (out, svg) = report(&r.fail, &[]);
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(r.fail.join("report.json")).unwrap()).unwrap();
    let (step, mb) = (rep["step"].as_u64().unwrap(), rep["minibatch"].as_u64().unwrap());
    // The summary: abort line with the report's fields, the warnings before it, the replay command.
    let abort_line = out.lines().find(|l| l.starts_with("abort: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(abort_line.starts_with(&format!("abort: step {step} update {mb} ")), "{out}");
    for field in ["rank(s) [", "bucket #", "param ", "element ", " NaN", " Inf", "loss "] {
        assert!(abort_line.contains(field), "abort line lacks `{field}`: {abort_line}");
    }
    let warn = out.lines().find(|l| l.starts_with("warnings (headroom < 20): ")).unwrap_or_else(|| panic!("{out}"));
    assert!(warn.contains("first at step ") && warn.contains("before the abort"), "{out}");
    // ... and the warnings the run wrote: warnings.jsonl's count and first update, as written.
    let w = gradbus_artifacts::read_warnings(&r.fail.join("warnings.jsonl")).expect("warnings.jsonl");
    let written = out.lines().find(|l| l.starts_with("warnings.jsonl: ")).unwrap_or_else(|| panic!("{out}"));
    assert!(written.starts_with(&format!("warnings.jsonl: {} update(s); first at step ", w.len())), "{out}");
    assert!(!w.is_empty() && written.contains("loss.exp") && written.contains("before the abort"), "{out}");
    assert!(out.contains(&format!("replay: gradbus replay {} --trace", r.fail.display())), "{out}");
    // The SVG: the abort marker and its label, the warning markers and the margin line.
    for p in PANELS {
        assert!(svg.contains(p), "panel `{p}` missing");
    }
    assert!(svg.contains(&format!("ABORT step {step} update {mb}")), "abort label missing");
    assert!(svg.contains(">\nABORT\n<"), "abort legend entry missing");
    assert!(svg.contains("warning: headroom &lt; margin"), "warning markers missing");
    assert!(svg.contains("warning margin (20)"));
    assert!(svg.contains("first warning: step "), "first warning not labelled");
    assert!(svg.contains("warning(s) &lt; 20"));
    // Spikes listed in the summary are marked on the plot.
    let spikes: usize = out
        .lines()
        .filter(|l| l.contains(" spikes (z > "))
        .map(|l| l.split("): ").nth(1).and_then(|n| n.split(':').next()).unwrap().trim().parse::<usize>().unwrap())
        .sum();
    assert_eq!(spikes > 0, svg.contains(">\nspike\n<"), "{out}");
    // A different margin changes what is marked.
    let (out0, svg0) = report(&r.fail, &["--margin", "0"]);
    assert!(out0.contains("warnings (headroom < 0): "), "{out0}");
    assert!(svg0.contains("warning margin (0)"));
}

#[test]
fn two_reports_of_one_run_are_byte_identical_and_hold_no_time() {
    let r = runs();
    let _g = lock();
    let (out1, svg1) = report(&r.fail, &[]);
    let (out2, svg2) = report(&r.fail, &[]);
    assert_eq!(out1, out2);
    assert!(svg1 == svg2, "two reports of one run directory differ");
    let year = 2000..2100;
    for y in year {
        assert!(!svg1.contains(&format!("{y}-")), "a date in the SVG");
    }
    assert!(!svg1.contains("time_update"), "wall-clock fields are not plotted");
}

#[test]
fn report_errors_are_usage_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let r = gradbus(&["report", dir.path().to_str().unwrap()], &[]);
    r.expect_code(2);
    assert!(r.stderr().contains("metrics.jsonl"), "{}", r.stderr());
    gradbus(&["report"], &[]).expect_code(2);
    gradbus(&["report", "x", "--window", "1"], &[]).expect_code(2);
    let h = gradbus(&["report", "--help"], &[]);
    h.expect_code(0);
    assert!(h.stdout().contains("--z-limit"));
}

#[test]
fn skipped_and_rerun_updates_are_counted_by_cause_and_marked() {
    let dir = tempfile::tempdir().unwrap();
    let (skip, rerun) = (dir.path().join("skip"), dir.path().join("rerun"));
    let base = ["examples/tiny.toml", "--set", "steps=3", "--set", "checkpoint.every=0"];
    let start = |d: &Path, policy: &str, faults: &str| {
        let p = format!("policy={policy}");
        let mut args = vec!["run", "--np", "2", "--run-dir", d.to_str().unwrap()];
        args.extend_from_slice(&base);
        args.extend_from_slice(&["--set", &p]);
        gradbus(&args, &[("GRADBUS_FAULTS", faults)]).expect_code(0);
    };
    start(&skip, "skip", "[[faults]]\nkind = \"inf\"\nrank = 1\nstep = 1\nminibatch = 1\n");
    start(&rerun, "rerun", "[[faults]]\nkind = \"nan\"\nrank = 0\nstep = 1\nminibatch = 2\ntransient = true\n");
    let (out, svg) = report(&skip, &[]);
    assert!(out.contains("skips: 1 (1 non-finite gradients)"), "{out}");
    assert!(svg.contains(">\nskipped update\n<") && !svg.contains(">\nrerun update\n<"), "skip not marked");
    let (out, svg) = report(&rerun, &[]);
    assert!(out.contains("reruns: 1 (step 1 update 2)"), "{out}");
    assert!(svg.contains(">\nrerun update\n<") && !svg.contains(">\nskipped update\n<"), "rerun not marked");
    assert!(out.contains("abort: none") && !out.contains("replay:"), "{out}");
}
