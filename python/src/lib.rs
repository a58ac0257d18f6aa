//! `gradbus._core`: the runtime's own health scan, verdict and spike detector, bound for Python.
//!
//! The Python side (`gradbus/torch.py`) owns only the plumbing of a PyTorch DDP communication hook:
//! which memory to scan, which small tensor to all-gather, which parameter sits at which offset of a
//! DDP bucket. Every number that decides something comes from here, i.e. from gradbus-kernels'
//! `health_scan` and gradbus-collectives' `decide` / `History` / `Report` / `SpikeDetector`, the very
//! code the Rust runtime runs; nothing of it is re-implemented in Python.
//!
//! Invariants: `Agreement::decide` is a pure function of the gathered table (bitwise the same on
//! every rank after the all-gather), the layout (the same on every rank: DDP builds its buckets
//! identically everywhere) and the history (updated on every rank from the same verdicts), so every
//! rank reaches the same verdict with no broadcast. The table's wire form is `CELL` f64 per bucket
//! plus the loss, per rank, written by `gradbus.torch` in the order `decode_table` reads it.

use gradbus_collectives::{
    decide, Action, Bucket, HealthTable, History, Layout, LocalReport, Policy, Slot, SpikeDetector, StepId, ValueNames,
};
use gradbus_kernels::{health_scan, Health};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// f64 values per bucket in a rank's row of the gathered table: NaN count, Inf count, sum of squares
/// of the finite elements, index of the first non-finite element in the bucket (-1: none).
pub const CELL: usize = 4;

/// One rank's row: `CELL` values per bucket, then its loss.
fn row_len(buckets: usize) -> usize {
    buckets * CELL + 1
}

/// The gathered table (`world` rows of `row_len(buckets)`) as the runtime's `HealthTable`. The reduced
/// bucket health is the merge of the ranks' local health in rank order: the hook does not rescan a
/// reduced bucket (its all-reduce is still in flight when the table is exchanged), so a bucket is
/// non-finite after the reduce exactly when some rank's local bucket was.
fn decode_table(flat: &[f64], world: usize, buckets: usize) -> Result<HealthTable, String> {
    let n = row_len(buckets);
    if world == 0 || flat.len() != world * n {
        return Err(format!(
            "health table has {} values, expected {world} ranks x ({buckets} buckets x {CELL} + 1) = {} (hint: every rank must run the same DDP model with the same buckets)",
            flat.len(),
            world * n
        ));
    }
    let count = |x: f64, what: &str, rank: usize, bucket: usize| -> Result<u64, String> {
        if x.is_finite() && x >= 0.0 && x.fract() == 0.0 {
            Ok(x as u64)
        } else {
            Err(format!("health table: rank {rank} bucket #{bucket}: {what} is {x}, not a count"))
        }
    };
    let mut local = vec![Health::default(); world * buckets];
    for rank in 0..world {
        let row = &flat[rank * n..(rank + 1) * n];
        for b in 0..buckets {
            let c = &row[b * CELL..(b + 1) * CELL];
            let first_bad = if c[3] < 0.0 { None } else { Some(count(c[3], "first_bad", rank, b)?) };
            local[b * world + rank] =
                Health { nan: count(c[0], "nan", rank, b)?, inf: count(c[1], "inf", rank, b)?, sumsq: c[2], first_bad };
        }
    }
    let reduced = (0..buckets)
        .map(|b| {
            let mut h = Health::default();
            for rank in 0..world {
                h.merge(&local[b * world + rank], 0);
            }
            h
        })
        .collect();
    // No workload values and no replica checksum travel in the hook's table (replica 0 on every
    // rank: always agreed).
    let reports =
        (0..world).map(|r| LocalReport { loss: flat[r * n + n - 1], values: Vec::new(), replica: 0 }).collect();
    Ok(HealthTable::detailed(world, &ValueNames::default(), local, reduced, reports, None))
}

/// A `Layout` over DDP's buckets: bucket `b` is a contiguous range of a virtual flat buffer (buckets
/// back to back, in DDP's bucket-index order), holding its parameters at their offsets in DDP's
/// flat bucket buffer (packed, no padding). `buckets[b]` lists (name, numel) in DDP's order.
fn ddp_layout(buckets: &[Vec<(String, usize)>]) -> Layout {
    let mut slots = Vec::new();
    let mut out = Vec::new();
    let mut offset = 0;
    for (b, params) in buckets.iter().enumerate() {
        let start = offset;
        let mut ids = Vec::new();
        for (name, numel) in params {
            ids.push(slots.len());
            slots.push(Slot { name: name.clone(), param: slots.len(), offset, numel: *numel, bucket: b });
            offset += numel;
        }
        out.push(Bucket { range: start..offset, params: ids });
    }
    Layout { slots, buckets: out, len: offset }
}

/// Health of `numel` f32 at address `ptr` (a CPU tensor's `data_ptr()`), scanned in place by the
/// runtime's fused kernel: (nan, inf, sumsq, first_bad or None). The GIL is released meanwhile.
///
/// The caller (`gradbus.torch`) guarantees what the `SAFETY` comment below needs: the tensor is a
/// contiguous float32 CPU tensor of `numel` elements that it keeps alive (it holds a reference) for
/// the call, and nothing writes it meanwhile (DDP hands a bucket to the comm hook after autograd has
/// written every gradient in it, and starts no write to it before the hook has returned).
#[pyfunction]
fn scan_f32(py: Python<'_>, ptr: usize, numel: usize) -> PyResult<(u64, u64, f64, Option<u64>)> {
    if numel == 0 {
        return Ok((0, 0, 0.0, None));
    }
    if ptr == 0 || ptr % std::mem::align_of::<f32>() != 0 {
        return Err(PyValueError::new_err(format!(
            "scan_f32: address {ptr:#x} is null or not aligned for f32 (hint: pass a float32 tensor's data_ptr())"
        )));
    }
    let addr = ptr;
    let h = py.detach(move || {
        // SAFETY: `addr` is non-null and f32-aligned (checked above); the caller guarantees that it
        // points at `numel` initialised f32 of a live, contiguous CPU tensor that it keeps alive for
        // this call and that nothing writes while the hook runs (see the function's doc). The slice
        // is only read, and does not outlive the call.
        let x = unsafe { std::slice::from_raw_parts(addr as *const f32, numel) };
        health_scan(x)
    });
    Ok((h.nan, h.inf, h.sumsq, h.first_bad))
}

fn action_name(a: Action) -> &'static str {
    match a {
        Action::Proceed => "proceed",
        Action::Skip => "skip",
        Action::Rerun => "rerun",
        Action::Abort => "abort",
    }
}

/// One rank's side of the agreement: the policy, the history every rank keeps identically, and the
/// spike detectors of the runtime (llm.c's rolling z-score and Megatron's 10x rule).
#[pyclass(module = "gradbus._core")]
struct Agreement {
    policy: Policy,
    history: History,
    /// Loss and gradient-norm detectors, when spike detection is on.
    spikes: Option<[SpikeDetector; 2]>,
    /// Skip a proceeding update that is a spike (on every rank: the detectors see the same values).
    spike_skip: bool,
}

#[pymethods]
impl Agreement {
    /// `policy`: "abort", "skip" (bounded by `max_consecutive` skips in a row and `max_fraction` of
    /// the last `window` updates, the runtime's defaults) or "rerun". `spike`: None, "warn" or
    /// "skip", with the runtime's `spike.window` / `spike.z_limit` defaults.
    #[new]
    #[pyo3(signature = (policy, max_consecutive=3, max_fraction=0.1, window=100, spike=None, spike_window=128, z_limit=6.0))]
    fn new(
        policy: &str,
        max_consecutive: u32,
        max_fraction: f64,
        window: u32,
        spike: Option<&str>,
        spike_window: usize,
        z_limit: f64,
    ) -> PyResult<Self> {
        let policy = match policy {
            "abort" => Policy::Abort,
            "rerun" => Policy::Rerun,
            "skip" => {
                if !(0.0..=1.0).contains(&max_fraction) || window == 0 {
                    return Err(PyValueError::new_err(format!(
                        "skip bounds: max_fraction {max_fraction} must be in [0, 1] and window {window} at least 1"
                    )));
                }
                Policy::Skip { max_consecutive, max_fraction, window }
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "policy {other:?}: expected \"abort\", \"skip\" or \"rerun\""
                )))
            }
        };
        let (spikes, spike_skip) = match spike {
            None => (None, false),
            Some(s @ ("warn" | "skip")) => {
                let d = SpikeDetector::new(spike_window, z_limit);
                (Some([d.clone(), d]), s == "skip")
            }
            Some(other) => {
                return Err(PyValueError::new_err(format!("spike {other:?}: expected None, \"warn\" or \"skip\"")))
            }
        };
        Ok(Agreement { policy, history: History::default(), spikes, spike_skip })
    }

    /// The verdict on one update from the gathered table (`world` rows, see `CELL`) and DDP's bucket
    /// layout (`layout[b]` = [(name, numel), ...]); records it in the history. Returns
    /// (action, report JSON or None, spike description or None). The report JSON is the runtime's
    /// `report.json` text: the runtime's `Report`, sealed as the runtime writes it (format, crc32c).
    #[pyo3(signature = (table, world, layout, step, attempt))]
    fn decide(
        &mut self,
        table: Vec<f64>,
        world: usize,
        layout: Vec<Vec<(String, usize)>>,
        step: u64,
        attempt: u32,
    ) -> PyResult<(String, Option<String>, Option<String>)> {
        let t = decode_table(&table, world, layout.len()).map_err(PyValueError::new_err)?;
        let l = ddp_layout(&layout);
        let at = StepId { step, minibatch: 0, attempt };
        let mut verdict = decide(&t, &l, &self.policy, &self.history, at);
        let mut spike = None;
        if verdict.action == Action::Proceed {
            if let Some(ds) = &mut self.spikes {
                let loss = t.mean_loss();
                let norm = t.grad_norm() / world as f64;
                for ((d, x), name) in ds.iter_mut().zip([loss, norm]).zip(["loss", "grad norm"]) {
                    if let Some(s) = d.observe(x) {
                        spike.get_or_insert(format!("{name} spike {x:.4} ({})", s.rules()));
                    }
                }
                if spike.is_some() && self.spike_skip {
                    verdict.action = Action::Skip;
                }
            }
        }
        self.history.record(&t, &verdict);
        let report = verdict.report.as_ref().map(gradbus_worker::artifacts::report_text);
        Ok((action_name(verdict.action).to_string(), report, spike))
    }

    /// Updates skipped so far.
    #[getter]
    fn skipped(&self) -> u64 {
        self.history.skipped
    }

    /// Skips in a row up to now.
    #[getter]
    fn consecutive_skips(&self) -> u32 {
        self.history.consecutive_skips
    }

    /// Ranks classified suspect after a transient fault (rerun policy).
    #[getter]
    fn suspects(&self) -> Vec<usize> {
        self.history.suspects.clone()
    }

    /// Skip flags of the most recent updates, newest last.
    #[getter]
    fn recent_skips(&self) -> Vec<bool> {
        self.history.recent.iter().copied().collect()
    }
}

/// gradbus's native core.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("CELL", CELL)?;
    m.add_function(wrap_pyfunction!(scan_f32, m)?)?;
    m.add_class::<Agreement>()?;
    Ok(())
}
