//! `report.svg`: one panel per quantity (loss, reward, global and per-bucket gradient norms, the
//! headroom), with the skipped, rerun and aborted updates, warnings and spikes marked. Deterministic:
//! no date, no wall-clock field, so two reports of one run directory are byte-identical.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{Analysis, Flagged, Options, RunData, Update};

/// ln(f32::MAX): exp of a larger f32 overflows to +inf (the worker's one definition).
const EXP_OVERFLOW: f64 = gradbus_worker::loss::EXP_OVERFLOW as f64;

/// The x position of an update: its step plus the fraction of the step it is.
fn xpos(x: &Update, per_step: u64) -> f64 {
    x.step as f64 + x.minibatch as f64 / per_step as f64
}

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
pub(super) fn tick(v: f64) -> String {
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
pub(super) fn axis_tick(v: f64, span: f64) -> String {
    tick(if v.abs() < span * 1e-9 { 0.0 } else { v })
}

/// The y axis of a linear panel: the range drawn and what lies beyond it.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct LinearAxis {
    /// The axis range: the kept values with a margin.
    pub(super) lo: f64,
    pub(super) hi: f64,
    /// The kept values' range: an off-axis value is drawn at one of these, inside the margin, so
    /// that its mark stays inside the panel.
    pub(super) bottom: f64,
    pub(super) top: f64,
    /// Finite values above `hi` / below `lo` (drawn clamped to the edge and marked).
    pub(super) above: usize,
    pub(super) below: usize,
    /// The most extreme of them.
    pub(super) max: f64,
    pub(super) min: f64,
}

/// How far beyond the central band (the 10th to 90th percentile) a value may lie, in band widths,
/// before it is off the axis. A diverging run's 1e12 loss then sits at the edge, marked, while its
/// normal range fills the panel; a run without outliers keeps its full range.
const FENCE: f64 = 3.0;

/// The axis of some values (non-finite ones are drawn apart and do not count). `extra` values
/// (reference lines) are always inside.
pub(super) fn linear_axis(values: &[f64], extra: &[f64]) -> LinearAxis {
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
    pub(super) fn off_label(&self) -> Option<String> {
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
                u[i].step, u[i].minibatch, r.ranks, r.bucket, r.param
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
