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

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use gradbus_artifacts::{self as artifacts, ArtifactError, MetricsLine};
use gradbus_collectives::spikes::{Spike, SpikeDetector, DEFAULT_WINDOW};
use gradbus_collectives::Report;
use gradbus_worker::exit::Code;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::error::Error;

/// Help text.
pub const HELP: &str = "\
gradbus report RUN_DIR [--margin NATS] [--window N] [--z-limit Z]

Reads RUN_DIR/metrics.jsonl (and RUN_DIR/report.json after an abort), prints a summary - steps,
updates, skips by cause, reruns, headroom warnings, loss and gradient-norm spikes, the abort and the
replay command - and writes RUN_DIR/report.svg: loss, reward, global gradient norm (log scale),
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

/// ln(f32::MAX): exp of a larger f32 overflows to +inf (the worker's one definition).
const EXP_OVERFLOW: f64 = gradbus_worker::loss::EXP_OVERFLOW as f64;

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

/// What the report draws of one `metrics.jsonl` line (read as [`MetricsLine`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Update {
    /// Optimizer step.
    pub step: u64,
    /// Mini-batch inside the step (epoch * minibatches + mini-batch).
    pub minibatch: u64,
    /// Attempt (1 after a rerun).
    pub attempt: u64,
    /// Mean loss over ranks (NaN when not finite).
    pub loss: f64,
    /// Mean reward.
    pub reward: f64,
    /// Global gradient norm (mean over ranks).
    pub grad_norm: f64,
    /// Per-bucket norms of the reduced gradients.
    pub bucket_norms: Vec<f64>,
    /// Ranks with non-finite local gradients.
    pub nonfinite_ranks: Vec<u64>,
    /// ln(f32::MAX) minus the largest log-ratio fed to an exp.
    pub headroom: f64,
    /// proceed, skip, rerun or abort.
    pub verdict: String,
    /// Why it was skipped, when it was (the line's `skip_cause`).
    pub skip_cause: Option<String>,
}

impl From<MetricsLine> for Update {
    /// The fields the report draws, from the typed line (`gradbus_artifacts::MetricsLine`).
    fn from(m: MetricsLine) -> Update {
        Update {
            step: m.step,
            minibatch: m.minibatch as u64,
            attempt: m.attempt as u64,
            loss: m.loss,
            reward: m.reward,
            grad_norm: m.grad_norm,
            bucket_norms: m.bucket_norms,
            nonfinite_ranks: m.nonfinite_ranks.iter().map(|&r| r as u64).collect(),
            headroom: m.headroom,
            verdict: m.verdict.as_str().to_string(),
            skip_cause: m.skip_cause,
        }
    }
}

/// The abort report (`report.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct AbortReport {
    /// The report, as every rank agreed on it.
    pub report: Report,
}

impl AbortReport {
    /// One line: step, update, ranks, bucket, param, element, NaN and Inf counts, loss finiteness.
    pub fn line(&self) -> String {
        self.report.to_string()
    }
}

/// A run directory's metrics.
#[derive(Clone, Debug)]
pub struct RunData {
    /// The updates in file order.
    pub updates: Vec<Update>,
    /// `report.json`, when the run aborted.
    pub abort: Option<AbortReport>,
    /// Whether `dumps/` exists (for the replay command).
    pub has_dumps: bool,
}

/// Read `metrics.jsonl` and `report.json` of a run directory, each verified (checksum, format
/// version, every key); an error names the file, line and key.
pub fn load(run_dir: &Path) -> Result<RunData, Error> {
    let path = run_dir.join("metrics.jsonl");
    if !path.is_file() {
        return Err(Error::usage(
            format!("cannot read {}: no such file", path.display()),
            "pass the run directory of a `gradbus run` (its --run-dir) that has run at least one update",
        ));
    }
    let updates = artifacts::read_metrics(&path)
        .map_err(|e| Error::usage(e.to_string(), "metrics.jsonl is written by `gradbus run`"))?
        .into_iter()
        .map(Update::from)
        .collect();
    let rpath = run_dir.join("report.json");
    let abort = match rpath.is_file() {
        true => Some(AbortReport {
            report: artifacts::read_report(&rpath)
                .map_err(|e| Error::usage(e.to_string(), "report.json is written by `gradbus run` on an abort"))?,
        }),
        false => None,
    };
    Ok(RunData { updates, abort, has_dumps: run_dir.join("dumps").is_dir() })
}

/// Parse the lines of a `metrics.jsonl` (blank lines skipped); errors name `file:LINE` and the key.
pub fn parse_metrics(text: &str, file: &Path) -> Result<Vec<Update>, ArtifactError> {
    Ok(artifacts::parse_metrics(text, file)?.into_iter().map(Update::from).collect())
}

/// A spike and where it happened.
#[derive(Clone, Debug, PartialEq)]
pub struct Flagged {
    /// Index of the update in the metrics.
    pub update: usize,
    /// The detector's finding.
    pub spike: Spike,
}

/// What the report derives from the metrics.
#[derive(Clone, Debug)]
pub struct Analysis {
    /// Updates per step (the largest mini-batch index + 1).
    pub per_step: u64,
    /// Indices of updates whose headroom is below the margin.
    pub warnings: Vec<usize>,
    /// Index of the aborted update.
    pub abort: Option<usize>,
    /// Loss spikes.
    pub loss_spikes: Vec<Flagged>,
    /// Global-norm spikes.
    pub norm_spikes: Vec<Flagged>,
}

/// Warnings, the abort and the spikes of a run.
pub fn analyze(data: &RunData, opts: &Options) -> Analysis {
    let u = &data.updates;
    let per_step = u.iter().map(|x| x.minibatch + 1).max().unwrap_or(1);
    let warnings = (0..u.len()).filter(|&i| u[i].headroom.is_nan() || u[i].headroom < opts.margin).collect();
    let abort = u.iter().position(|x| x.verdict == "abort");
    let spikes = |f: fn(&Update) -> f64| {
        let mut d = SpikeDetector::new(opts.window, opts.z_limit);
        u.iter().enumerate().filter_map(|(i, x)| d.observe(f(x)).map(|spike| Flagged { update: i, spike })).collect()
    };
    Analysis { per_step, warnings, abort, loss_spikes: spikes(|x| x.loss), norm_spikes: spikes(|x| x.grad_norm) }
}

/// The x position of an update: its step plus the fraction of the step it is.
fn xpos(x: &Update, per_step: u64) -> f64 {
    x.step as f64 + x.minibatch as f64 / per_step as f64
}

/// The text summary.
pub fn summary(data: &RunData, a: &Analysis, opts: &Options) -> String {
    let u = &data.updates;
    let mut s = String::new();
    let at = |i: usize| format!("step {} update {}", u[i].step, u[i].minibatch);
    let steps: std::collections::BTreeSet<u64> = u.iter().map(|x| x.step).collect();
    let count = |v: &str| u.iter().filter(|x| x.verdict == v).count();
    let _ = writeln!(
        s,
        "run {}: {} step(s) ({}..={}), {} update(s) ({} per step): {} proceed, {} skip, {} rerun, {} abort",
        opts.run_dir.display(),
        steps.len(),
        steps.first().copied().unwrap_or(0),
        steps.last().copied().unwrap_or(0),
        u.len(),
        a.per_step,
        count("proceed"),
        count("skip"),
        count("rerun"),
        count("abort"),
    );
    let mut causes: std::collections::BTreeMap<&str, usize> = Default::default();
    for c in u.iter().filter_map(|x| x.skip_cause.as_deref()) {
        *causes.entry(c).or_default() += 1;
    }
    let causes: Vec<String> = causes.iter().map(|(c, n)| format!("{n} {c}")).collect();
    let _ = writeln!(
        s,
        "skips: {}{}",
        count("skip"),
        if causes.is_empty() { String::new() } else { format!(" ({})", causes.join(", ")) }
    );
    let reruns: Vec<String> = (0..u.len()).filter(|&i| u[i].verdict == "rerun").map(at).collect();
    let _ = writeln!(
        s,
        "reruns: {}{}",
        reruns.len(),
        if reruns.is_empty() { String::new() } else { format!(" ({})", list(&reruns)) }
    );
    match a.warnings.first() {
        None => {
            let _ = writeln!(s, "warnings (headroom < {}): none", opts.margin);
        }
        Some(&first) => {
            let before = match a.abort {
                Some(ab) if ab >= first => format!(", {} update(s) before the abort", ab - first),
                _ => String::new(),
            };
            let _ = writeln!(
                s,
                "warnings (headroom < {}): {} update(s); first at {} (headroom {:.2}){before}",
                opts.margin,
                a.warnings.len(),
                at(first),
                u[first].headroom,
            );
        }
    }
    for (name, spikes) in [("loss", &a.loss_spikes), ("grad norm", &a.norm_spikes)] {
        let items: Vec<String> =
            spikes.iter().map(|f| format!("{} = {:.4} ({})", at(f.update), f.spike.value, f.spike.rules())).collect();
        let _ = writeln!(
            s,
            "{name} spikes (z > {} over {} updates, or > 10x the first-100 max): {}{}",
            opts.z_limit,
            opts.window,
            items.len(),
            if items.is_empty() { String::new() } else { format!(": {}", list(&items)) }
        );
    }
    match (&data.abort, a.abort) {
        (Some(r), _) => {
            let _ = writeln!(s, "abort: {}", r.line());
        }
        (None, Some(i)) => {
            let _ = writeln!(s, "abort: {} (no report.json)", at(i));
        }
        (None, None) => {
            let _ = writeln!(s, "abort: none");
        }
    }
    if data.abort.is_some() || data.has_dumps {
        let _ = writeln!(s, "replay: gradbus replay {} --trace", opts.run_dir.display());
    }
    s
}

/// At most 8 items, then "... and N more".
fn list(items: &[String]) -> String {
    if items.len() <= 8 {
        items.join("; ")
    } else {
        format!("{}; ... and {} more", items[..8].join("; "), items.len() - 8)
    }
}

// ------------------------------------------------------------------------------------------------
// The SVG.

const W: u32 = 1100;
const PANEL_H: u32 = 300;
const FONT: &str = "sans-serif";

/// Colours of the events (series colours come from `Palette99`).
const SKIP: RGBColor = RGBColor(230, 120, 0);
const RERUN: RGBColor = RGBColor(140, 60, 200);
const ABORT: RGBColor = RGBColor(220, 0, 0);
const WARN: RGBColor = RGBColor(200, 160, 0);
const SPIKE: RGBColor = RGBColor(220, 0, 160);
const LINE: RGBColor = RGBColor(30, 90, 200);
const OFF_AXIS: RGBColor = RGBColor(90, 90, 90);

/// Finite points, split into runs at non-finite (or, on a log scale, non-positive) values.
fn segments(points: &[(f64, f64)], log: bool) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    for &(x, y) in points {
        if y.is_finite() && (!log || y > 0.0) {
            out.last_mut().expect("one").push((x, y));
        } else if !out.last().expect("one").is_empty() {
            out.push(Vec::new());
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// The y range of some values, padded; on a log scale only positive values count.
fn y_range(values: impl Iterator<Item = f64>, log: bool, extra: &[f64]) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.chain(extra.iter().copied()) {
        if v.is_finite() && (!log || v > 0.0) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    if lo > hi {
        return if log { (1e-3, 1.0) } else { (0.0, 1.0) };
    }
    if log {
        // Whole decades, so that the log axis's ticks are powers of ten.
        let (lo, hi) = (10f64.powf(lo.log10().floor()), 10f64.powf(hi.log10().ceil()));
        (lo, if hi > lo { hi } else { lo * 10.0 })
    } else {
        let pad = if hi > lo { (hi - lo) * 0.08 } else { lo.abs().max(1.0) * 0.1 };
        (lo - pad, hi + pad)
    }
}

/// A tick label that fits the label area: at most 3 decimals and no trailing zeros between 1e-3
/// and 1e5, else the shortest of `1e12` / `9.6e14` / `-2.5e-4`; never "-0".
fn tick(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && a.is_finite() && !(1e-3..1e5).contains(&a) {
        let s = format!("{v:.1e}");
        return s.replace(".0e", "e");
    }
    let s = if a >= 1e3 { format!("{v:.0}") } else { format!("{v:.3}") };
    let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.') } else { &s };
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// A tick label on an axis spanning `span`: a rounding residue of zero (|v| below a billionth of
/// the span) is 0.
fn axis_tick(v: f64, span: f64) -> String {
    tick(if v.abs() < span * 1e-9 { 0.0 } else { v })
}

/// The y axis of a linear panel: the range drawn and what lies beyond it.
#[derive(Clone, Debug, PartialEq)]
struct LinearAxis {
    /// The axis range: the kept values with a margin.
    lo: f64,
    hi: f64,
    /// The kept values' range: an off-axis value is drawn at one of these, inside the margin, so
    /// that its mark stays inside the panel.
    bottom: f64,
    top: f64,
    /// Finite values above `hi` / below `lo` (drawn clamped to the edge and marked).
    above: usize,
    below: usize,
    /// The most extreme of them.
    max: f64,
    min: f64,
}

/// How far beyond the central band (the 10th to 90th percentile) a value may lie, in band widths,
/// before it is off the axis. A diverging run's 1e12 loss then sits at the edge, marked, while its
/// normal range fills the panel; a run without outliers keeps its full range.
const FENCE: f64 = 3.0;

/// The axis of some values (non-finite ones are drawn apart and do not count). `extra` values
/// (reference lines) are always inside.
fn linear_axis(values: &[f64], extra: &[f64]) -> LinearAxis {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    if !v.is_empty() {
        // The narrowest band with a spread; with no spread at all the full range is the band.
        let (a, b) =
            [0.1, 0.05, 0.02, 0.0].iter().map(|&p| (q(p), q(1.0 - p))).find(|(a, b)| b > a).unwrap_or((v[0], v[0]));
        let w = b - a;
        let (flo, fhi) = (a - FENCE * w, b + FENCE * w);
        let inside = v.iter().filter(|&&x| x >= flo && x <= fhi);
        lo = inside.clone().copied().fold(lo, f64::min);
        hi = inside.copied().fold(hi, f64::max);
    }
    for &x in extra.iter().filter(|x| x.is_finite()) {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    let (above, below) = (v.iter().filter(|&&x| x > hi).count(), v.iter().filter(|&&x| x < lo).count());
    let (max, min) = (v.last().copied().unwrap_or(f64::NAN), v.first().copied().unwrap_or(f64::NAN));
    let (bottom, top) = (lo, hi);
    let (lo, hi) = y_range([lo, hi].into_iter(), false, &[]);
    LinearAxis { lo, hi, bottom: bottom.max(lo), top: top.min(hi), above, below, max, min }
}

impl LinearAxis {
    /// The legend entry of the off-axis marks, e.g. `off the axis: 54 above (max 9.6e14)`.
    fn off_label(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.above > 0 {
            parts.push(format!("{} above (max {})", self.above, tick(self.max)));
        }
        if self.below > 0 {
            parts.push(format!("{} below (min {})", self.below, tick(self.min)));
        }
        (!parts.is_empty()).then(|| format!("off the axis: {}", parts.join(", ")))
    }
}

/// A marked event on a panel.
struct Mark {
    x: f64,
    /// The value there; non-finite ones are drawn at the top of the panel.
    y: f64,
    kind: MarkKind,
}

#[derive(Clone, Copy, PartialEq)]
enum MarkKind {
    Skip,
    Rerun,
    Abort,
    Warning,
    Spike,
    /// A value beyond a linear axis, drawn at the edge.
    OffAxis,
}

/// A named, coloured line.
type Series = (String, RGBColor, Vec<(f64, f64)>);

/// One panel: its title, scale, lines, horizontal reference lines and marks.
struct Panel {
    title: String,
    y_desc: &'static str,
    log: bool,
    series: Vec<Series>,
    hlines: Vec<(String, RGBColor, f64)>,
    marks: Vec<Mark>,
    /// Text placed at the top, ending at x (the abort, the first warning), and its colour.
    label: Option<(f64, String, RGBColor)>,
    /// Where the legend goes; `None`: the corner the fewest points are drawn in ([`quiet_corner`]).
    legend: Option<SeriesLabelPosition>,
    /// The legend entry of the off-axis marks (set when the axis is fitted).
    off_label: String,
}

type DrawResult<T> = Result<T, String>;

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("{e:?}")
}

/// Draw the series, lines and marks of a panel on a chart of either scale.
macro_rules! draw_panel {
    ($chart:expr, $p:expr, $x0:expr, $x1:expr, $ylo:expr, $yhi:expr, $to_unit:expr) => {{
        let chart = $chart;
        let p: &Panel = $p;
        let (ylo, yhi) = ($ylo, $yhi);
        let legend = p.legend.clone().unwrap_or_else(|| {
            let to_unit = $to_unit;
            let xs = |x: f64| (x - $x0) / ($x1 - $x0);
            let pts = p.series.iter().flat_map(|(_, _, pts)| pts.iter()).map(|&(x, y)| (x, y));
            let marks = p.marks.iter().map(|m| (m.x, if m.y.is_finite() { m.y } else { yhi }));
            quiet_corner(
                pts.chain(marks)
                    .filter(|(_, y)| y.is_finite() && (!p.log || *y > 0.0))
                    .map(|(x, y)| (xs(x), to_unit(y))),
            )
        });
        let clamp = |y: f64| if y.is_finite() && (!p.log || y > 0.0) { y.clamp(ylo, yhi) } else { yhi };
        for (name, color, points) in &p.series {
            let mut first = true;
            for seg in segments(points, p.log) {
                let s = chart.draw_series(LineSeries::new(seg, color.stroke_width(1))).map_err(err)?;
                if std::mem::take(&mut first) {
                    let c = *color;
                    s.label(name.as_str())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
                }
            }
        }
        for (name, color, y) in &p.hlines {
            let c = *color;
            chart
                .draw_series(LineSeries::new(vec![($x0, *y), ($x1, *y)], c.stroke_width(2)))
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        }
        for kind in
            [MarkKind::OffAxis, MarkKind::Warning, MarkKind::Skip, MarkKind::Rerun, MarkKind::Spike, MarkKind::Abort]
        {
            let pts: Vec<(f64, f64)> = p.marks.iter().filter(|m| m.kind == kind).map(|m| (m.x, clamp(m.y))).collect();
            if pts.is_empty() {
                continue;
            }
            let (label, color) = match kind {
                MarkKind::OffAxis => (p.off_label.as_str(), OFF_AXIS),
                MarkKind::Warning => ("warning: headroom < margin", WARN),
                MarkKind::Skip => ("skipped update", SKIP),
                MarkKind::Rerun => ("rerun update", RERUN),
                MarkKind::Spike => ("spike", SPIKE),
                MarkKind::Abort => ("ABORT", ABORT),
            };
            let s = match kind {
                MarkKind::OffAxis => {
                    chart.draw_series(pts.iter().map(|&c| TriangleMarker::new(c, 4, OFF_AXIS.filled())))
                }
                MarkKind::Warning => chart.draw_series(pts.iter().map(|&c| Circle::new(c, 3, WARN.filled()))),
                MarkKind::Skip => chart.draw_series(pts.iter().map(|&c| TriangleMarker::new(c, 6, SKIP.filled()))),
                MarkKind::Rerun => chart.draw_series(pts.iter().map(|&c| Cross::new(c, 5, RERUN.stroke_width(2)))),
                MarkKind::Spike => chart.draw_series(pts.iter().map(|&c| Circle::new(c, 7, SPIKE.stroke_width(2)))),
                MarkKind::Abort => {
                    for &(x, _) in &pts {
                        chart
                            .draw_series(LineSeries::new(vec![(x, ylo), (x, yhi)], ABORT.stroke_width(2)))
                            .map_err(err)?;
                    }
                    chart.draw_series(pts.iter().map(|&c| Cross::new(c, 8, ABORT.stroke_width(3))))
                }
            }
            .map_err(err)?;
            s.label(label).legend(move |(x, y)| Circle::new((x + 9, y), 4, color.filled()));
        }
        if let Some((x, text, color)) = &p.label {
            chart
                .draw_series(std::iter::once(Text::new(
                    text.clone(),
                    (*x, yhi),
                    (FONT, 13).into_font().color(color).pos(Pos::new(HPos::Right, VPos::Top)),
                )))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FONT, 11))
            .draw()
            .map_err(err)?;
    }};
}

/// The corner of a panel where a legend box (about 30% of the width, 35% of the height) covers the
/// fewest of `points` (in panel units, 0..1 both ways); ties go to the first of upper left, upper
/// right, lower left, lower right.
fn quiet_corner(points: impl Iterator<Item = (f64, f64)>) -> SeriesLabelPosition {
    let (w, h) = (0.3, 0.35);
    let mut n = [0usize; 4];
    for (x, y) in points {
        let (left, right, up, low) = (x < w, x > 1.0 - w, y > 1.0 - h, y < h);
        n[0] += usize::from(left && up);
        n[1] += usize::from(right && up);
        n[2] += usize::from(left && low);
        n[3] += usize::from(right && low);
    }
    let best = (0..4).min_by_key(|&i| n[i]).unwrap_or(0);
    [
        SeriesLabelPosition::UpperLeft,
        SeriesLabelPosition::UpperRight,
        SeriesLabelPosition::LowerLeft,
        SeriesLabelPosition::LowerRight,
    ][best]
        .clone()
}

/// The label area's width for tick labels of up to `chars` characters (plotters' 11-12 px font)
/// plus the axis description.
fn label_area(chars: usize) -> u32 {
    (34 + 7 * chars as u32).max(60)
}

fn draw_one<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    mut p: Panel,
    x0: f64,
    x1: f64,
) -> DrawResult<()>
where
    DB::ErrorType: 'static,
{
    let extra: Vec<f64> = p.hlines.iter().map(|h| h.2).collect();
    let mut builder = ChartBuilder::on(area);
    builder.caption(&p.title, (FONT, 16)).margin(10).x_label_area_size(32);
    if p.log {
        let mut values: Vec<f64> = p.series.iter().flat_map(|(_, _, pts)| pts.iter().map(|&(_, y)| y)).collect();
        values.extend(p.marks.iter().map(|m| m.y));
        let (ylo, yhi) = y_range(values.into_iter(), true, &extra);
        let label = |v: &f64| format!("{v:.0e}");
        builder.y_label_area_size(label_area(label(&ylo).len().max(label(&yhi).len())));
        let mut chart = builder.build_cartesian_2d(x0..x1, (ylo..yhi).log_scale()).map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|v| axis_tick(*v, x1 - x0))
            .y_desc(p.y_desc)
            .y_label_formatter(&label)
            .light_line_style(BLACK.mix(0.05))
            .draw()
            .map_err(err)?;
        draw_panel!(&mut chart, &p, x0, x1, ylo, yhi, |y: f64| (y.ln() - ylo.ln()) / (yhi.ln() - ylo.ln()));
    } else {
        let values: Vec<f64> = p.series.iter().flat_map(|(_, _, pts)| pts.iter().map(|&(_, y)| y)).collect();
        let axis = linear_axis(&values, &extra);
        let (ylo, yhi) = (axis.lo, axis.hi);
        // Values beyond the axis: the line goes to the edge, and a mark at the edge says so.
        let (bottom, top) = (axis.bottom, axis.top);
        let mut off = Vec::new();
        for (_, _, pts) in p.series.iter_mut() {
            for (x, y) in pts.iter_mut().filter(|(_, y)| y.is_finite() && (*y > top || *y < bottom)) {
                *y = y.clamp(bottom, top);
                off.push(Mark { x: *x, y: *y, kind: MarkKind::OffAxis });
            }
        }
        for m in p.marks.iter_mut().filter(|m| m.y.is_finite()) {
            m.y = m.y.clamp(bottom, top);
        }
        p.marks.extend(off);
        p.off_label = axis.off_label().unwrap_or_default();
        builder.y_label_area_size(label_area(tick(ylo).len().max(tick(yhi).len())));
        let mut chart = builder.build_cartesian_2d(x0..x1, ylo..yhi).map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|v| axis_tick(*v, x1 - x0))
            .y_desc(p.y_desc)
            .y_label_formatter(&|v| axis_tick(*v, yhi - ylo))
            .light_line_style(BLACK.mix(0.05))
            .draw()
            .map_err(err)?;
        draw_panel!(&mut chart, &p, x0, x1, ylo, yhi, |y: f64| (y - ylo) / (yhi - ylo));
    }
    Ok(())
}

/// The panels of a run.
fn panels(data: &RunData, a: &Analysis, opts: &Options) -> Vec<Panel> {
    let u = &data.updates;
    let xs: Vec<f64> = u.iter().map(|x| xpos(x, a.per_step)).collect();
    let pts = |f: &dyn Fn(&Update) -> f64| -> Vec<(f64, f64)> { u.iter().zip(&xs).map(|(x, &p)| (p, f(x))).collect() };
    let events = |f: &dyn Fn(&Update) -> f64| -> Vec<Mark> {
        let mut m = Vec::new();
        for (i, x) in u.iter().enumerate() {
            let kind = match x.verdict.as_str() {
                "skip" => MarkKind::Skip,
                "rerun" => MarkKind::Rerun,
                "abort" => MarkKind::Abort,
                _ => continue,
            };
            m.push(Mark { x: xs[i], y: f(x), kind });
        }
        m
    };
    let spike_marks = |spikes: &[Flagged]| -> Vec<Mark> {
        spikes.iter().map(|f| Mark { x: xs[f.update], y: f.spike.value, kind: MarkKind::Spike }).collect()
    };
    let abort_label = a.abort.map(|i| {
        let what = match &data.abort {
            Some(r) => format!(
                "ABORT step {} update {}: rank(s) {:?} bucket #{} {}",
                u[i].step, u[i].minibatch, r.report.ranks, r.report.bucket, r.report.param
            ),
            None => format!("ABORT step {} update {}", u[i].step, u[i].minibatch),
        };
        (xs[i], what, ABORT)
    });
    let n = |v: usize, what: &str| if v == 0 { String::new() } else { format!(", {v} {what}") };

    let mut loss_marks = events(&|x| x.loss);
    loss_marks.extend(spike_marks(&a.loss_spikes));
    let mut norm_marks = events(&|x| x.grad_norm);
    norm_marks.extend(spike_marks(&a.norm_spikes));
    let nb = u.iter().map(|x| x.bucket_norms.len()).max().unwrap_or(0);
    let buckets: Vec<Series> = (0..nb)
        .map(|b| {
            let c = Palette99::pick(b).to_rgba();
            (
                format!("bucket #{b}"),
                RGBColor(c.0, c.1, c.2),
                pts(&|x| x.bucket_norms.get(b).copied().unwrap_or(f64::NAN)),
            )
        })
        .collect();
    let mut head_marks: Vec<Mark> =
        a.warnings.iter().map(|&i| Mark { x: xs[i], y: u[i].headroom, kind: MarkKind::Warning }).collect();
    head_marks.extend(events(&|x| x.headroom));

    vec![
        Panel {
            title: format!("loss (mean over ranks){}", n(a.loss_spikes.len(), "spike(s)")),
            y_desc: "loss",
            log: false,
            series: vec![("loss".into(), LINE, pts(&|x| x.loss))],
            hlines: vec![],
            marks: loss_marks,
            label: abort_label.clone(),
            legend: None,
            off_label: String::new(),
        },
        Panel {
            title: "reward (mean)".into(),
            y_desc: "reward",
            log: false,
            series: vec![("reward".into(), RGBColor(0, 140, 70), pts(&|x| x.reward))],
            hlines: vec![],
            marks: events(&|x| x.reward),
            label: None,
            legend: None,
            off_label: String::new(),
        },
        Panel {
            title: format!("global grad norm (log scale){}", n(a.norm_spikes.len(), "spike(s)")),
            y_desc: "grad norm",
            log: true,
            series: vec![("grad norm".into(), LINE, pts(&|x| x.grad_norm))],
            hlines: vec![],
            marks: norm_marks,
            label: None,
            legend: None,
            off_label: String::new(),
        },
        Panel {
            title: "per-bucket grad norms (log scale)".into(),
            y_desc: "bucket norm",
            log: true,
            series: buckets,
            hlines: vec![],
            marks: events(&|x| x.bucket_norms.iter().copied().fold(f64::NAN, f64::max)),
            label: None,
            legend: None,
            off_label: String::new(),
        },
        Panel {
            title: format!(
                "log-ratio headroom to exp overflow (88.72 - max log-ratio){}",
                n(a.warnings.len(), &format!("warning(s) < {}", opts.margin))
            ),
            y_desc: "headroom (nats)",
            log: false,
            series: vec![("headroom".into(), LINE, pts(&|x| x.headroom))],
            hlines: vec![
                (format!("exp overflow (log-ratio {EXP_OVERFLOW:.2})"), ABORT, 0.0),
                (format!("warning margin ({})", opts.margin), WARN, opts.margin),
            ],
            marks: head_marks,
            label: a.warnings.first().map(|&i| {
                let before = a.abort.filter(|&ab| ab >= i).map(|ab| format!(", {} update(s) before the abort", ab - i));
                (
                    xs[i],
                    format!(
                        "first warning: step {} update {}{}",
                        u[i].step,
                        u[i].minibatch,
                        before.unwrap_or_default()
                    ),
                    WARN,
                )
            }),
            legend: Some(SeriesLabelPosition::MiddleLeft),
            off_label: String::new(),
        },
    ]
}

/// Draw `report.svg` at `path`.
pub fn render_svg(path: &Path, data: &RunData, a: &Analysis, opts: &Options) -> DrawResult<()> {
    let panels = panels(data, a, opts);
    let u = &data.updates;
    let x0 = u.first().map(|x| x.step as f64).unwrap_or(0.0);
    let x1 = u.last().map(|x| x.step as f64 + 1.0).unwrap_or(1.0).max(x0 + 1.0);
    let title = format!(
        "gradbus report: {}",
        opts.run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| ".".into())
    );
    let root = SVGBackend::new(path, (W, PANEL_H * panels.len() as u32 + 40)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(&title, (FONT, 20)).map_err(err)?;
    for (area, p) in root.split_evenly((panels.len(), 1)).iter().zip(panels) {
        draw_one(area, p, x0, x1)?;
    }
    root.present().map_err(err)?;
    Ok(())
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
        let data = RunData { updates: parse(&lines), abort: None, has_dumps: false };
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
            abort: Some(AbortReport {
                report: serde_json::from_value(
                    serde_json::json!({"step":5,"minibatch":0,"attempt":1,"verdict":"abort",
                    "cause":"local_gradients","ranks":[0],"bucket":0,"param":"head.w","element":7,"nan":3,"inf":1,
                    "per_rank":[],"loss_finite":false,"classification":"deterministic"}),
                )
                .unwrap(),
            }),
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
        let data = RunData { updates: parse(&lines), abort: None, has_dumps: false };
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
        let mut data = RunData { updates: parse(&lines), abort: None, has_dumps: false };
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
