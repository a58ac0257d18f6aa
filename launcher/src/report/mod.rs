//! `gradbus report RUN_DIR [--margin NATS] [--window N] [--z-limit Z]`: read a run directory's
//! `metrics.jsonl` (and `report.json` after an abort), print a short summary and draw
//! `RUN_DIR/report.svg`: loss, reward, global gradient norm (log), per-bucket gradient norms (log)
//! and the log-ratio headroom to exp overflow, with skipped, rerun and aborted updates, headroom
//! warnings and loss / gradient-norm spikes marked.
//!
//! Everything drawn is a function of the agreed metrics: the wall-clock `time_*` fields are never
//! read, and the SVG holds no date, so two reports of one run directory are byte-identical.
//! Spikes are found with [`gradbus_collectives::SpikeDetector`] (llm.c's rolling z-score and
//! Megatron's 10x-the-first-100 rule) over the agreed mean loss and global norm, as a training-time
//! policy would see them.
//!
//! The parts: this module is the subcommand (its options, `parse`, `execute`); `data` reads the run
//! directory, `analysis` finds the warnings, the abort and the spikes, `text` writes the summary and
//! `svg` draws the panels.

mod analysis;
mod data;
mod svg;
mod text;

use std::ffi::OsString;
use std::path::PathBuf;

use gradbus_collectives::spikes::DEFAULT_WINDOW;
use gradbus_worker::exit::Code;

use crate::error::Error;

pub use analysis::{analyze, Analysis, Flagged};
pub use data::{load, parse_metrics, RunData, Update};
pub use svg::render_svg;
pub use text::summary;

/// Help text.
pub const HELP: &str = "\
gradbus report RUN_DIR [--margin NATS] [--window N] [--z-limit Z]

Reads RUN_DIR/metrics.jsonl (and RUN_DIR/warnings.jsonl, and RUN_DIR/report.json after an abort),
prints a summary - steps, updates, skips by cause, reruns, the updates under the headroom margin,
the warnings the run wrote (warnings.jsonl: the headroom or its forecast, as warn.* set them), loss
and gradient-norm spikes, the abort and the replay command - and writes RUN_DIR/report.svg: loss, reward, global gradient norm (log scale),
per-bucket gradient norms (log scale) and the log-ratio headroom to exp overflow (88.72), with
skipped, rerun and aborted updates, warnings and spikes marked. The SVG is a pure function of the
metrics (no times, no dates): the same run directory gives the same bytes.

    RUN_DIR        a run directory of `gradbus run`
    --margin NATS  warn where the headroom is below this (default 20, as warn.headroom)
    --window N     rolling z-score window in updates (default 128, as llm.c)
    --z-limit Z    a loss or gradient norm more than Z deviations above the window's mean is a
                   spike (default 6; 0 turns the z-score rule off). Megatron's rule - above 10x
                   the largest of the first 100 values - always applies.
";

/// Parsed options.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Warning margin in nats.
    pub margin: f64,
    /// Rolling z-score window.
    pub window: usize,
    /// z-score limit (0 = off).
    pub z_limit: f64,
}

/// Parse the arguments after `report`.
pub fn parse(args: Vec<OsString>) -> Result<Option<Options>, Error> {
    use lexopt::prelude::*;
    let usage = |message: String| Error::usage(message, "see `gradbus report --help`");
    let mut p = lexopt::Parser::from_args(args);
    let (mut run_dir, mut margin, mut window, mut z_limit) = (None::<PathBuf>, 20.0, DEFAULT_WINDOW, 6.0);
    let number = |p: &mut lexopt::Parser, flag: &str| -> Result<f64, Error> {
        let v = p.value().map_err(|e| usage(e.to_string()))?;
        v.to_str()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| usage(format!("{flag} wants a number >= 0, got `{}`", v.to_string_lossy())))
    };
    while let Some(arg) = p.next().map_err(|e| usage(e.to_string()))? {
        match arg {
            Long("margin") => margin = number(&mut p, "--margin")?,
            Long("z-limit") => z_limit = number(&mut p, "--z-limit")?,
            Long("window") => {
                let w = number(&mut p, "--window")?;
                if w < 2.0 || w.fract() != 0.0 {
                    return Err(usage(format!("--window wants a whole number >= 2, got {w}")));
                }
                window = w as usize;
            }
            Long("help") | Short('h') => return Ok(None),
            Value(v) if run_dir.is_none() => run_dir = Some(v.into()),
            other => return Err(usage(other.unexpected().to_string())),
        }
    }
    let run_dir = run_dir.ok_or_else(|| usage("missing RUN_DIR".into()))?;
    Ok(Some(Options { run_dir, margin, window, z_limit }))
}

/// Run the subcommand.
pub fn execute(args: Vec<OsString>) -> Result<Code, Error> {
    let Some(opts) = parse(args)? else {
        print!("{HELP}");
        return Ok(Code::Done);
    };
    let data = load(&opts.run_dir)?;
    let a = analyze(&data, &opts);
    print!("{}", summary(&data, &a, &opts));
    let out = opts.run_dir.join("report.svg");
    // Drawn beside it, then renamed over it: a viewer never sees half an SVG.
    let tmp = opts.run_dir.join(format!(".report.svg.{}", std::process::id()));
    let drawn =
        render_svg(&tmp, &data, &a, &opts).and_then(|()| std::fs::rename(&tmp, &out).map_err(|e| e.to_string()));
    if let Err(e) = drawn {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::usage(
            format!("cannot write {}: {e}", out.display()),
            "check that the run directory is writable",
        ));
    }
    println!("wrote {}", out.display());
    Ok(Code::Done)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use gradbus_artifacts::{self as artifacts, MetricsLine, WarningLine};

    use super::svg::{axis_tick, linear_axis, tick};
    use super::*;

    /// A sealed metrics line; numbers as text, `"NaN"`, `"inf"` and `"-inf"` for the non-finite.
    fn line(step: u64, mb: u64, attempt: u64, loss: &str, verdict: &str, headroom: &str, bad: &str) -> String {
        let num = |s: &str| match s.trim_matches('"') {
            "NaN" => f64::NAN,
            "inf" => f64::INFINITY,
            "-inf" => f64::NEG_INFINITY,
            x => x.parse().unwrap(),
        };
        let verdict: gradbus_collectives::Action = serde_json::from_value(serde_json::json!(verdict)).unwrap();
        let skip_cause = (verdict == gradbus_collectives::Action::Skip).then(|| {
            if attempt > 0 { "transient fault (the rerun differed)" } else { "non-finite gradients" }.to_string()
        });
        MetricsLine {
            step,
            minibatch: mb as u32,
            attempt: attempt as u32,
            loss: num(loss),
            reward: 0.5,
            kl: 0.0,
            grad_norm: 0.3,
            bucket_norms: vec![0.1, 0.2],
            nonfinite_ranks: bad.split(',').filter(|b| !b.is_empty()).map(|b| b.parse().unwrap()).collect(),
            max_logratio_response: 1.0,
            max_logratio_masked: 1.0,
            headroom: num(headroom),
            spike: None,
            sdc: None,
            skip_cause,
            min_response_logp: -3.0,
            lr: 0.001,
            verdict,
            skipped: 0,
            checksum: 0,
            time_update_ms: 12.5,
        }
        .to_line()
    }

    fn parse(lines: &[String]) -> Vec<Update> {
        parse_metrics(&lines.join("\n"), Path::new("metrics.jsonl")).unwrap()
    }

    fn opts() -> Options {
        Options { run_dir: "runs/x".into(), margin: 20.0, window: 128, z_limit: 6.0 }
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick(20.0), "20");
        assert_eq!(tick(0.4), "0.4");
        assert_eq!(tick(-0.0001), "-1e-4");
        assert_eq!(axis_tick(-2.2e-16, 2.0), "0");
        assert_eq!(axis_tick(-2.2e-16, 1e-15), "-2.2e-16");
        assert_eq!(tick(-1.25), "-1.25");
        assert_eq!(tick(1e12), "1e12");
        assert_eq!(tick(9.636e14), "9.6e14");
        assert_eq!(tick(-2.5e-4), "-2.5e-4");
        assert_eq!(tick(12345.678), "12346");
        assert_eq!(tick(0.0), "0");
    }

    /// A diverging run's losses: a normal band in [-1.4, 0.6], 50 spikes from 1e3 to 1e15, NaNs.
    fn diverging() -> Vec<f64> {
        let mut v: Vec<f64> = (0..900).map(|i| -1.4 + 2.0 * ((i * 37) % 100) as f64 / 100.0).collect();
        for k in 0..50 {
            v.insert(k * 18 + 5, 10f64.powf(3.0 + 12.0 * k as f64 / 49.0));
        }
        v.extend([f64::NAN, f64::INFINITY]);
        v
    }

    #[test]
    fn a_diverging_loss_keeps_its_normal_range_and_marks_the_outliers_at_the_edge() {
        let a = linear_axis(&diverging(), &[]);
        assert!(a.lo <= -1.4 && a.bottom <= -1.4, "the normal range's bottom is inside: {a:?}");
        assert!(a.top >= 0.58 && a.hi < 10.0, "the normal range fills the axis, spikes do not: {a:?}");
        assert_eq!((a.above, a.below), (50, 0));
        assert_eq!(a.max, 1e15);
        assert_eq!(a.off_label().unwrap(), "off the axis: 50 above (max 1e15)");
        // A run without outliers keeps its whole range, and reference lines stay on the axis.
        let normal: Vec<f64> = (0..300).map(|i| 0.6 - 2.0 * i as f64 / 299.0).collect();
        let b = linear_axis(&normal, &[5.0]);
        assert!(b.lo <= -1.4 && b.hi >= 5.0 && (b.above, b.below) == (0, 0) && b.off_label().is_none(), "{b:?}");
        // Mostly constant values: a step to another level is not an outlier.
        let mut flat = vec![0.0; 90];
        flat.extend([1.0; 10]);
        assert_eq!(linear_axis(&flat, &[]).above, 0);
    }

    #[test]
    fn a_diverging_run_draws_short_labels_and_the_off_axis_legend() {
        let dir = tempfile::tempdir().unwrap();
        let lines: Vec<String> = diverging()
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let l = if l.is_finite() { format!("{l}") } else { format!("\"{l}\"") };
                line(i as u64 / 4, i as u64 % 4, 0, &l, "proceed", "60.0", "")
            })
            .collect();
        let data = RunData { updates: parse(&lines), abort: None, warnings: None, has_dumps: false };
        let o = Options { run_dir: dir.path().into(), ..opts() };
        let a = analyze(&data, &o);
        let path = dir.path().join("r.svg");
        render_svg(&path, &data, &a, &o).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("off the axis: 50 above (max 1e15)"), "outliers not marked");
        // Every text that is a number is short enough for the label area.
        let numbers: Vec<&str> = svg
            .split('>')
            .filter_map(|t| t.split('<').next())
            .map(str::trim)
            .filter(|t| !t.is_empty() && t.parse::<f64>().is_ok())
            .collect();
        assert!(numbers.iter().any(|t| *t == "0.5"), "the normal range has ticks: {numbers:?}");
        assert!(numbers.iter().all(|t| t.len() <= 7), "{numbers:?}");
    }

    #[test]
    fn non_finite_numbers_are_null_and_a_missing_key_names_file_line_and_key() {
        let lines = [
            line(0, 0, 0, "1.5", "proceed", "80.0", ""),
            line(0, 1, 0, "\"NaN\"", "skip", "\"-inf\"", "1"),
            String::new(),
        ];
        assert!(lines[1].contains("\"loss\":null") && lines[1].contains("\"headroom\":null"), "{}", lines[1]);
        let u = parse(&lines);
        assert_eq!(u.len(), 2);
        assert!(u[1].loss.is_nan() && u[1].headroom.is_nan());
        assert_eq!(u[1].skip_cause.as_deref(), Some("non-finite gradients"));
        assert_eq!(u[0].bucket_norms, vec![0.1, 0.2]);
        let mut v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("crc32c");
        o.remove("format");
        o.remove("minibatch");
        let text = format!("{}\n{}", lines[0], artifacts::seal(artifacts::METRICS_FORMAT, &v, false));
        let e = parse_metrics(&text, Path::new("run/metrics.jsonl")).unwrap_err().to_string();
        assert!(e.starts_with("run/metrics.jsonl:2: ") && e.contains("missing field `minibatch`"), "{e}");
    }

    #[test]
    fn summary_counts_warnings_before_the_abort_and_names_the_replay() {
        let mut lines = Vec::new();
        for s in 0..5 {
            for mb in 0..2 {
                let head = if s >= 3 { "10.0" } else { "60.0" };
                lines.push(line(s, mb, 0, "1.0", "proceed", head, ""));
            }
        }
        lines.push(line(5, 0, 0, "1.0", "rerun", "5.0", "0"));
        lines.push(line(5, 0, 1, "\"inf\"", "abort", "\"-inf\"", "0"));
        let data = RunData {
            updates: parse(&lines),
            abort: Some(
                serde_json::from_value(serde_json::json!({"step":5,"minibatch":0,"attempt":1,"verdict":"abort",
                "cause":"local_gradients","ranks":[0],"bucket":0,"param":"head.w","element":7,"nan":3,"inf":1,
                "per_rank":[],"loss_finite":false,"classification":"deterministic"}))
                .unwrap(),
            ),
            warnings: Some(
                [(5, 9.5, Some(3.2)), (6, 10.0, None)]
                    .map(|(update, headroom, forecast_updates)| WarningLine {
                        update,
                        quantity: "loss.exp".into(),
                        value: 88.72 - headroom,
                        limit: 88.72,
                        rank: 1,
                        forecast_updates,
                        action: gradbus_collectives::Alert::Warn,
                    })
                    .to_vec(),
            ),
            has_dumps: true,
        };
        let a = analyze(&data, &opts());
        assert_eq!(a.per_step, 2);
        assert_eq!(a.abort, Some(11));
        assert_eq!(a.warnings, vec![6, 7, 8, 9, 10, 11]);
        let s = summary(&data, &a, &opts());
        assert!(
            s.contains("6 step(s) (0..=5), 12 update(s) (2 per step): 10 proceed, 0 skip, 1 rerun, 1 abort"),
            "{s}"
        );
        assert!(s.contains("reruns: 1 (step 5 update 0)"), "{s}");
        assert!(s.contains("first at step 3 update 0 (headroom 10.00), 5 update(s) before the abort"), "{s}");
        // The warnings the run wrote, as written: update 5 is step 2 update 1, 5 before the abort.
        assert!(
            s.contains("warnings.jsonl: 2 update(s); first at step 2 update 1 (loss.exp 79.22 on rank 1, limit 88.72, forecast 3.2 update(s)), 5 update(s) before the abort"),
            "{s}"
        );
        assert!(
            s.contains("abort: step 5 update 0 (attempt 1): rank(s) [0], bucket #0, param head.w element 7, 3 NaN, 1 Inf, loss NOT finite; verdict abort (deterministic)"),
            "{s}"
        );
        assert!(s.contains("replay: gradbus replay runs/x --trace"), "{s}");
    }

    #[test]
    fn spikes_come_from_the_detector_over_the_agreed_values() {
        let mut lines: Vec<String> = (0..300)
            .map(|i| line(i, 0, 0, &format!("{}", 1.0 + (i % 7) as f64 * 0.01), "proceed", "70.0", ""))
            .collect();
        lines.push(line(300, 0, 0, "50.0", "proceed", "70.0", ""));
        let data = RunData { updates: parse(&lines), abort: None, warnings: None, has_dumps: false };
        let a = analyze(&data, &opts());
        assert_eq!(a.loss_spikes.len(), 1);
        assert_eq!(a.loss_spikes[0].update, 300);
        assert!(a.loss_spikes[0].spike.by_zscore && a.loss_spikes[0].spike.by_megatron);
        assert!(a.norm_spikes.is_empty());
        let s = summary(&data, &a, &opts());
        assert!(
            s.contains(
                "loss spikes (z > 6 over 128 updates, or > 10x the first-100 max): 1: step 300 update 0 = 50.0000"
            ),
            "{s}"
        );
        assert!(s.contains("abort: none") && !s.contains("replay:"), "{s}");
    }

    #[test]
    fn svg_is_deterministic_and_has_no_time_fields() {
        let dir = tempfile::tempdir().unwrap();
        let mut lines: Vec<String> = (0..40).map(|i| line(i / 2, i % 2, 0, "1.0", "proceed", "30.0", "")).collect();
        lines.push(line(20, 0, 0, "1.0", "skip", "15.0", "1"));
        let mut data = RunData { updates: parse(&lines), abort: None, warnings: None, has_dumps: false };
        let o = Options { run_dir: dir.path().into(), ..opts() };
        let a = analyze(&data, &o);
        let (p1, p2) = (dir.path().join("a.svg"), dir.path().join("b.svg"));
        render_svg(&p1, &data, &a, &o).unwrap();
        // Different wall-clock fields change nothing.
        for l in lines.iter_mut() {
            let mut m: MetricsLine = artifacts::unseal(l, artifacts::METRICS_FORMAT, "m").unwrap();
            m.time_update_ms = 99.0;
            *l = m.to_line();
        }
        data.updates = parse(&lines);
        render_svg(&p2, &data, &a, &o).unwrap();
        let (s1, s2) = (std::fs::read(&p1).unwrap(), std::fs::read(&p2).unwrap());
        assert_eq!(s1, s2);
        let s = String::from_utf8(s1).unwrap();
        assert!(s.starts_with("<svg"), "{}", &s[..80]);
        assert!(s.contains("skipped update") && s.contains("warning: headroom &lt; margin"), "events not marked");
    }
}
