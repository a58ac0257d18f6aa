//! The guard's early warning and quarantine, bound for Python: what `guard.watch` watches (each
//! quantity's ceiling, its forecast and the warn/stop rule: `gradbus_collectives::forecast`, the
//! runtime's), the `warnings.jsonl` lines rank 0 writes (`gradbus_artifacts::WarningLine`, the
//! runtime's format), a report's sample ids (`report.json`'s `per_rank[].samples`) and the
//! `quarantine.jsonl` lines that name them for a resume (`gradbus_artifacts::QuarantineLine`).
//!
//! Invariant: `Watches::observe` is a pure function of the agreed words it is fed, in update order,
//! so every rank holds the same forecasts and reaches the same action; the Python side only moves
//! the words (each rank's [`ranked`] maximum, agreed by the maximum over ranks) and writes the lines.

use gradbus_artifacts::{parse_report, report_text, QuarantineLine, WarningLine};
use gradbus_collectives::forecast::{self, Alert, Forecast, Rule};
use gradbus_collectives::SampleId;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::BTreeMap;

/// ln of the largest finite value of `dtype` ("float32", "bfloat16", "float16", "float64"): where
/// `exp` overflows.
#[pyfunction]
fn exp_ceiling(dtype: &str) -> PyResult<f64> {
    forecast::exp_ceiling(dtype).ok_or_else(|| {
        PyValueError::new_err(format!(
            "no exp ceiling for dtype {dtype:?} (hint: float32, bfloat16, float16 or float64; or pass limit= to watch)"
        ))
    })
}

/// `value` of `rank` as one float whose maximum over ranks is the largest value with the lowest
/// rank holding it (`unranked` reads both back); the value rounded to float32, NaN as +inf.
#[pyfunction]
fn ranked(value: f64, rank: usize) -> PyResult<f64> {
    if rank >= forecast::MAX_RANKS {
        return Err(PyValueError::new_err(format!("rank {rank}: at most {} ranks", forecast::MAX_RANKS)));
    }
    Ok(forecast::ranked(value, rank))
}

/// (value, rank) of a `ranked` word or of the maximum of several.
#[pyfunction]
fn unranked(word: f64) -> (f64, usize) {
    forecast::unranked(word)
}

/// The forecast (`Outlook::updates`: updates to `limit` at the trend; None without a rising trend)
/// after each of `values`, fed in order to a fresh `Forecast` as the guard feeds it: for tools that
/// measure how close a trajectory came to a warning.
#[pyfunction]
fn forecasts(values: Vec<f64>, limit: f64) -> Vec<Option<f64>> {
    let mut f = Forecast::new(forecast::DEFAULT_WINDOW);
    values.into_iter().map(|x| f.observe(x, limit).updates).collect()
}

/// The quantities one guard watches, in the order their words travel, each with its ceiling and
/// forecast; and whether a stop is the guard's policy ("stop") or only a warning ("warn").
#[pyclass(module = "gradbus._core")]
struct Watches {
    stop: bool,
    names: Vec<String>,
    /// Per name: its forecast, its rule and its ceiling.
    watched: Vec<(Forecast, Rule, f64)>,
}

#[pymethods]
impl Watches {
    /// `stop`: an alert at the stop threshold stops (else every alert warns).
    #[new]
    #[pyo3(signature = (stop=false))]
    fn new(stop: bool) -> Watches {
        Watches { stop, names: Vec::new(), watched: Vec::new() }
    }

    /// Watch `name` against the ceiling `limit` (the rule's defaults for it); its index.
    fn add(&mut self, name: String, limit: f64) -> PyResult<usize> {
        if !(limit.is_finite() && limit > 0.0) {
            return Err(PyValueError::new_err(format!("watch {name:?}: limit {limit} must be a positive number")));
        }
        if self.names.contains(&name) {
            return Err(PyValueError::new_err(format!("watch {name:?} is already watched")));
        }
        self.names.push(name);
        self.watched.push((Forecast::new(forecast::DEFAULT_WINDOW), Rule::default_for(limit), limit));
        Ok(self.names.len() - 1)
    }

    /// The watched names, in the order of their words.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// One update's agreed words (the maxima over ranks of `ranked`), in the order of `names`:
    /// (action, [(warnings.jsonl line, message), ...]). The action is None, "warn", or "stop" (the
    /// most urgent alert; "stop" only when the policy stops). A word of -inf (no rank watched the
    /// quantity this update) is no observation.
    fn observe(&mut self, update: u64, words: Vec<f64>) -> PyResult<(Option<&'static str>, Vec<(String, String)>)> {
        if words.len() != self.names.len() {
            return Err(PyValueError::new_err(format!(
                "{} watched words for {} watched quantities {:?}",
                words.len(),
                self.names.len(),
                self.names
            )));
        }
        let mut top = None;
        let mut out = Vec::new();
        for ((name, (f, rule, limit)), word) in self.names.iter().zip(&mut self.watched).zip(words) {
            let (value, rank) = forecast::unranked(word);
            let o = f.observe(value, *limit);
            let Some(alert) = rule.alert(&o) else { continue };
            let alert = if self.stop { alert } else { Alert::Warn };
            top = top.max(Some(alert));
            let line = WarningLine::new(update, name, &o, rank, alert);
            let whence = if o.headroom > 0.0 {
                let trend = o.updates.map_or("no rising trend".into(), |u| format!("{u:.1} updates away at its trend"));
                format!("{:.2} below its ceiling {:.2}, {trend}", o.headroom, o.limit)
            } else {
                format!("past its ceiling {:.2}", o.limit)
            };
            let action =
                if alert == Alert::Stop { format!("stopping before update {update}") } else { "warning".into() };
            let message =
                format!("gradbus: update {update}: {name} reached {value:.2} on rank {rank}, {whence}; {action}");
            out.push((line.to_line(), message));
        }
        Ok((top.map(|a| if a == Alert::Stop { "stop" } else { "warn" }), out))
    }
}

/// `text` (a sealed report.json) with each listed rank's sample ids (`samples`: rank -> [int | str,
/// ...]) in `per_rank[].samples`, sealed again. Ranks not in `per_rank` are ignored.
#[pyfunction]
fn report_with_samples(text: &str, samples: BTreeMap<usize, Vec<Bound<'_, PyAny>>>) -> PyResult<String> {
    let mut report = parse_report(text, "report").map_err(|e| PyValueError::new_err(e.to_string()))?;
    for r in &mut report.per_rank {
        if let Some(ids) = samples.get(&r.rank) {
            r.samples = ids.iter().map(sample_id).collect::<PyResult<_>>()?;
        }
    }
    Ok(report_text(&report))
}

/// A sample id from Python: an int >= 0 (a dataset index) or a str (a prompt id).
fn sample_id(ob: &Bound<'_, PyAny>) -> PyResult<SampleId> {
    if let Ok(i) = ob.extract::<u64>() {
        return Ok(SampleId::Index(i));
    }
    if let Ok(s) = ob.extract::<String>() {
        return Ok(SampleId::Name(s));
    }
    Err(PyValueError::new_err(format!("sample id {ob}: expected an int >= 0 (a dataset index) or a str")))
}

/// The `quarantine.jsonl` lines (`gradbus_artifacts::QuarantineLine`) of a sealed report: one per
/// bad rank that names its samples.
#[pyfunction]
fn quarantine_lines(report: &str) -> PyResult<Vec<String>> {
    let r = parse_report(report, "report").map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(QuarantineLine::of_report(&r).iter().map(QuarantineLine::to_line).collect())
}

/// Every sample id of a `quarantine.jsonl` (each line verified), in file order, without repeats.
#[pyfunction]
fn read_quarantine(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Vec<Py<PyAny>>> {
    let lines = gradbus_artifacts::read_quarantine(&path).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for id in lines.into_iter().flat_map(|l| l.samples) {
        if seen.insert(id.clone()) {
            out.push(match id {
                SampleId::Index(i) => i.into_pyobject(py)?.into_any().unbind(),
                SampleId::Name(n) => n.into_pyobject(py)?.into_any().unbind(),
            });
        }
    }
    Ok(out)
}

/// Keep in `path` (a `warnings.jsonl`) only the verified lines of the updates before `before`, as a
/// resumed runtime keeps its own (`gradbus_artifacts::open_lines`); a missing file is made empty.
/// Returns the error of a last line cut short by a crash (dropped), for the caller to warn about.
#[pyfunction]
fn keep_warnings(path: std::path::PathBuf, before: u64) -> PyResult<Option<String>> {
    let keep = |w: &WarningLine| w.update < before;
    let (_, torn) = gradbus_artifacts::open_lines(&path, gradbus_artifacts::WARNINGS_FORMAT, Some(&keep as _))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(torn.map(|e| e.to_string()))
}

/// Add this module's functions and class to `gradbus._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(exp_ceiling, m)?)?;
    m.add_function(wrap_pyfunction!(ranked, m)?)?;
    m.add_function(wrap_pyfunction!(unranked, m)?)?;
    m.add_function(wrap_pyfunction!(report_with_samples, m)?)?;
    m.add_function(wrap_pyfunction!(quarantine_lines, m)?)?;
    m.add_function(wrap_pyfunction!(read_quarantine, m)?)?;
    m.add_function(wrap_pyfunction!(keep_warnings, m)?)?;
    m.add_function(wrap_pyfunction!(forecasts, m)?)?;
    m.add_class::<Watches>()?;
    Ok(())
}
