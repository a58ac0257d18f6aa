//! `gradbus._core`: the runtime's own health scan, agreement, verdict and spike detector, bound for
//! Python.
//!
//! The Python side (`gradbus/guard.py` and its framework adapters) owns only the plumbing: which
//! memory to scan, which small tensors to all-reduce or all-gather, which parameter sits at which
//! offset of a bucket. Every number that decides something comes from here, i.e. from
//! gradbus-kernels' `health_scan` and gradbus-collectives' row codec (`wire`), `Summary`, `Judge`
//! (`decide`, the history, the spike detectors) and `Report`, the very code the Rust runtime runs;
//! nothing of it is re-implemented in Python.
//!
//! The agreement is the runtime's (`docs/agreement.md`): each rank encodes its row (`encode_row`:
//! the runtime's row codec, `shape`) and turns it into its contribution to the O(buckets) `Summary` (`contribute`); the ranks all-reduce its words (SUM,
//! MAX); when the summary shows no anomaly every rank decides from it (`decide_summary`), otherwise
//! the ranks all-gather their rows and decide from the full table (`decide_table`), which names the
//! rank, bucket, parameter and element.
//!
//! Invariants: both paths decide from a `HealthTable` that is a pure function of what every rank
//! holds bitwise alike after the collective (the summary's words, or the gathered rows), the layout
//! (the same on every rank: DDP builds its buckets identically everywhere) and the history (updated
//! on every rank from the same verdicts), so every rank reaches the same verdict with no broadcast.
//! The hook never sees a reduced bucket (its all-reduce is in flight when the rows are exchanged):
//! every rank contributes the same neutral reduced health on both paths, so the table path's summary
//! is bitwise the all-reduced one, and "non-finite" means "non-finite on some rank before the
//! reduce" - which for DDP's mean is also "after it" (|sum g/N| <= max |g|: a sum of finite
//! gradients scaled first cannot overflow).

use gradbus_collectives::agreement::{peak_word, BucketStat};
use gradbus_collectives::choice::Calibration;
use gradbus_collectives::sdc::{Checks, Guard as SdcGuard, OutlierRule};
use gradbus_collectives::wire::{table_of, RowShape, CELL};
use gradbus_collectives::{
    Action, Bucket, Cause, HealthTable, Judge, Layout, LocalScalars, LossScale, OnSpike, Policy, Reduced, Slot, StepId,
    Summary, ValueNames, Watched,
};
use gradbus_kernels::{all_finite, health_scan, scan_and_scale, Checksum, Health, Peak};
use std::sync::Arc;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

mod scan_path;
mod watch;

/// The guard's values in the agreement (`LocalScalars::values`, by name): the rank's local sum of
/// squares over every bucket (the gradient norm of spike detection), and its loss scale (which every
/// rank must share: its minimum and maximum are compared).
/// After them, one value `watch:I` per quantity the guard watches (`guard.watch`): the rank's
/// largest value with its rank (`watch::ranked`; -inf: none this update), whose maximum over ranks
/// the agreement carries on both paths.
const VALUES: [&str; 2] = ["sumsq", "loss_scale"];

fn values(watched: usize) -> ValueNames {
    let names: Vec<String> =
        VALUES.iter().map(|v| v.to_string()).chain((0..watched).map(|i| format!("watch:{i}"))).collect();
    ValueNames::new(&names)
}

/// The shape of the guard's row (`gradbus_collectives::wire`, the runtime's one row codec): no
/// header, the local health and peak per bucket, the reduced part (its health neutral, see the
/// module doc; its checksum per bucket: the reduced gradient this rank's optimizer consumed at the
/// previous update, 0 when not checked), the report of `VALUES` and the `watched` quantities (with
/// the replica checksum and the rank's own finding about its state).
fn shape(buckets: usize, watched: usize) -> RowShape {
    RowShape { head: 0, buckets, reduced: true, values: VALUES.len() + watched }
}

/// The replica word the judge compares across ranks (`sdc::check_state`): the weights' checksum
/// (0 when not checked this update) folded with the checksums of the reduced buckets the rank
/// consumed at the previous update (all 0 when not checked: then the weights' checksum as it
/// is). Both must be bitwise identical on every rank; one word lets the runtime's one replica rule
/// (majority, the donor, a rank's own finding) judge them both.
fn replica_word(replica: u64, reduced: &[u64]) -> u64 {
    if reduced.iter().all(|&h| h == 0) {
        return replica;
    }
    reduced.iter().fold(replica, |h, &x| {
        let mut z = (h ^ x).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// Little-endian 8-byte words of a byte string (a row, a gathered table, all-reduced words).
fn words(bytes: &[u8], what: &str) -> Result<Vec<u64>, String> {
    if bytes.len() % 8 != 0 {
        return Err(format!("{what}: {} bytes is not a whole number of 8-byte words", bytes.len()));
    }
    Ok(bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}

fn to_bytes(w: impl IntoIterator<Item = u64>) -> Vec<u8> {
    w.into_iter().flat_map(u64::to_le_bytes).collect()
}

/// The MAX half travels as int64 (torch.distributed has no unsigned MAX): flipping the top bit maps
/// the unsigned order onto the signed one, and flipping it back after the all-reduce restores it.
const FLIP: u64 = 1 << 63;

/// One bucket's cell as the Python side holds it - (nan, inf, sumsq, first_bad or -1) as floats,
/// from the Rust scan or torch ops - as the runtime's `Health`, its counts checked.
fn cell_health(c: [f64; 4], bucket: usize) -> Result<Health, String> {
    let count = |x: f64, what: &str| -> Result<u64, String> {
        if x.is_finite() && x >= 0.0 && x.fract() == 0.0 {
            Ok(x as u64)
        } else {
            Err(format!("health row: bucket #{bucket}: {what} is {x}, not a count"))
        }
    };
    let first_bad = if c[3] < 0.0 { None } else { Some(count(c[3], "first_bad")?) };
    Ok(Health { nan: count(c[0], "nan")?, inf: count(c[1], "inf")?, sumsq: c[2], first_bad })
}

/// One rank's row, decoded.
struct RowParts {
    /// Health per bucket.
    local: Vec<Health>,
    /// Peak per bucket (`None`: not tallied).
    peaks: Vec<Option<(f32, u64)>>,
    /// Checksum per bucket of the reduced gradient consumed at the previous update (0: none).
    reduced: Vec<u64>,
    /// The report, its replica word as the row carries it (the weights' checksum).
    report: LocalScalars,
}

fn decode_row(row: &[u64], buckets: usize, watched: usize) -> Result<RowParts, String> {
    let s = shape(buckets, watched);
    if row.len() != s.len() {
        return Err(format!(
            "health row has {} words, expected {} for {buckets} buckets and {watched} watched",
            row.len(),
            s.len()
        ));
    }
    let v = s.decode(row);
    Ok(RowParts {
        local: (0..buckets).map(|b| v.local(b)).collect(),
        peaks: (0..buckets).map(|b| v.peak(b)).collect(),
        reduced: v.reduced().reference,
        report: v.report(),
    })
}

/// The hook's neutral reduced health (see the module doc): the same on every rank and both paths.
fn neutral(buckets: usize) -> Vec<Health> {
    vec![Health::default(); buckets]
}

/// The gathered table (`world` rows of `shape(buckets, watched)`) as the runtime's `HealthTable`;
/// `reduced`: each reduced bucket's health where the caller scanned the sums (the `scan` path),
/// else neutral.
fn decode_table(
    table: &[u64],
    world: usize,
    buckets: usize,
    watched: usize,
    reduced: Option<Vec<Health>>,
) -> Result<HealthTable, String> {
    let n = shape(buckets, watched).len();
    if world == 0 || table.len() != world * n {
        return Err(format!(
            "health table has {} words, expected {world} ranks x {n} words ({buckets} buckets, {watched} watched) = {} (hint: every rank must run the same DDP model with the same buckets, and watch the same quantities)",
            table.len(),
            world * n
        ));
    }
    // The judge sees each rank's replica word folded with its reduced checksums (`replica_word`):
    // the words are patched in a copy, so that the rows stay as the ranks sent them.
    let mut judged = table.to_vec();
    let at = n - LocalScalars::words(VALUES.len() + watched) + 1 + VALUES.len() + watched;
    for row in judged.chunks_exact_mut(n) {
        let reduced = shape(buckets, watched).decode(row).reduced().reference;
        row[at] = replica_word(row[at], &reduced);
    }
    let rows = shape(buckets, watched).rows(&judged)?;
    let mut r = unreduced(buckets);
    if let Some(health) = reduced {
        if health.len() != buckets {
            return Err(format!("{} reduced buckets' health for {buckets} buckets", health.len()));
        }
        r.health = health;
    }
    Ok(table_of(&rows, &values(watched), r, None))
}

/// The reduced part every rank contributes alike (see the module doc): neutral health, no
/// reference checksums.
fn unreduced(buckets: usize) -> Reduced {
    Reduced { health: neutral(buckets), reference: vec![0; buckets] }
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
/// runtime's fused kernel: (nan, inf, sumsq, first_bad or None). The GIL is released meanwhile when
/// the scan is long (`DETACH_AT` elements and more; a short one holds it: handing the GIL over and
/// back costs more than it lets another thread do).
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
    let addr = f32_address("scan_f32", ptr)?;
    let scan = move || {
        // SAFETY: `addr` is non-null and f32-aligned (checked above); the caller guarantees that it
        // points at `numel` initialised f32 of a live, contiguous CPU tensor that it keeps alive for
        // this call and that nothing writes while the hook runs (see the function's doc). The slice
        // is only read, and does not outlive the call.
        let x = unsafe { std::slice::from_raw_parts(addr as *const f32, numel) };
        health_scan(x)
    };
    let h = if numel >= DETACH_AT { py.detach(scan) } else { scan() };
    Ok((h.nan, h.inf, h.sumsq, h.first_bad))
}

/// `scan_f32`, then each element multiplied by `scale` in place (one f32 multiply: the bits of
/// torch's `mul_(scale)` on a float32 tensor), in one pass (`gradbus_kernels::scan_and_scale`): the
/// DDP hook's pre-division fused with its scan. Returns the scan as the guard records it (its
/// `Cell`: nan, inf, sumsq and first_bad as floats, first_bad -1.0 for none), which the hook stores
/// as it is. The caller guarantees what `scan_f32` says, and that nothing else reads or writes the
/// tensor during the call.
#[pyfunction]
fn scale_scan_f32(py: Python<'_>, ptr: usize, numel: usize, scale: f32) -> PyResult<Cell> {
    // An empty tensor's address may be null: nothing is read then.
    let addr = if numel == 0 { ptr } else { f32_address("scale_scan_f32", ptr)? };
    // SAFETY: as the function's doc says, which the caller guarantees.
    Ok(unsafe { scale_scan(py, addr, numel, scale) })
}

/// A bucket's health as the guard records it (its Python `Cell`): nan, inf, sumsq and first_bad as
/// floats, first_bad -1.0 for none.
type Cell = (f64, f64, f64, f64);

/// `scale_scan_f32` at an address already checked by `f32_address` (any, when `numel` is 0).
///
/// # Safety
/// What `scale_scan_f32` requires of its caller: `numel` initialised f32 at `addr` of a live,
/// contiguous CPU tensor that the caller keeps alive for the call and that nothing else reads or
/// writes meanwhile.
unsafe fn scale_scan(py: Python<'_>, addr: usize, numel: usize, scale: f32) -> Cell {
    if numel == 0 {
        return (0.0, 0.0, 0.0, -1.0);
    }
    let run = move || {
        // SAFETY: `addr` is non-null and f32-aligned (the caller's `f32_address`) and points at
        // `numel` initialised f32 of a live, contiguous CPU tensor that nothing else reads or writes
        // meanwhile (the function's contract). The slice does not outlive the call.
        let x = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, numel) };
        scan_and_scale(x, scale)
    };
    let h = if numel >= DETACH_AT { py.detach(run) } else { run() };
    (h.nan as f64, h.inf as f64, h.sumsq, h.first_bad.map_or(-1.0, |i| i as f64))
}

/// Whether the `numel` f32 at address `ptr` are all finite (`gradbus_kernels::all_finite`: the
/// scan's verdict without its sum of squares, for the DDP hook's scan of a reduced sum, whose
/// health is needed only when it is not finite). The caller guarantees what `scan_f32` says.
#[pyfunction]
fn finite_f32(py: Python<'_>, ptr: usize, numel: usize) -> PyResult<bool> {
    // An empty tensor's address may be null: nothing is read then.
    let addr = if numel == 0 { ptr } else { f32_address("finite_f32", ptr)? };
    // SAFETY: as the function's doc says, which the caller guarantees.
    Ok(unsafe { finite(py, addr, numel) })
}

/// `finite_f32` at an address already checked by `f32_address` (any, when `numel` is 0).
///
/// # Safety
/// What `finite_f32` requires of its caller: `numel` initialised f32 at `addr` of a live tensor that
/// the caller keeps referenced for the call and that nothing writes meanwhile.
unsafe fn finite(py: Python<'_>, addr: usize, numel: usize) -> bool {
    if numel == 0 {
        return true;
    }
    let check = move || {
        // SAFETY: non-null, aligned (the caller's `f32_address`), `numel` initialised f32 of a live
        // tensor that nothing writes meanwhile (the function's contract); only read.
        all_finite(unsafe { std::slice::from_raw_parts(addr as *const f32, numel) })
    };
    if numel >= DETACH_AT {
        py.detach(check)
    } else {
        check()
    }
}

/// `ptr` when it is a usable f32 address (non-null, aligned), else the error naming `what`.
fn f32_address(what: &str, ptr: usize) -> PyResult<usize> {
    if ptr == 0 || ptr % std::mem::align_of::<f32>() != 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: address {ptr:#x} is null or not aligned for f32 (hint: pass a float32 tensor's data_ptr())"
        )));
    }
    Ok(ptr)
}

/// Elements from which `scan_f32` releases the GIL: 1M f32, ~0.1 ms of scanning.
const DETACH_AT: usize = 1 << 20;

/// The runtime's replica checksum (`gradbus_kernels::Checksum`, the hash the runtime's AdamW pass
/// computes) of `numel` f32 at address `ptr` (a CPU tensor's `data_ptr()`), read in place with the
/// GIL released. The caller guarantees, as for `scan_f32`, a live contiguous float32 CPU tensor of
/// `numel` elements that nothing writes meanwhile (the parameters, between optimizer steps).
#[pyfunction]
fn checksum_f32(py: Python<'_>, ptr: usize, numel: usize) -> PyResult<u64> {
    if numel > 0 && (ptr == 0 || ptr % std::mem::align_of::<f32>() != 0) {
        return Err(PyValueError::new_err(format!(
            "checksum_f32: address {ptr:#x} is null or not aligned for f32 (hint: pass a float32 tensor's data_ptr())"
        )));
    }
    let addr = ptr;
    Ok(py.detach(move || {
        let mut c = Checksum::new();
        if numel > 0 {
            // SAFETY: `addr` is non-null and f32-aligned (checked above); the caller guarantees that
            // it points at `numel` initialised f32 of a live, contiguous CPU tensor that it keeps
            // alive for this call and that nothing writes meanwhile. Only read; does not outlive the call.
            c.update(unsafe { std::slice::from_raw_parts(addr as *const f32, numel) });
        }
        c.finish()
    }))
}

/// This rank's row (`shape(buckets, watched)`'s words, as little-endian bytes) from its cells (per
/// bucket: nan, inf, sumsq, first_bad or -1, as floats), its loss, its loss scale (0: no scaler),
/// its replica checksum (0: not checked this update), its word per watched quantity, and for the
/// silent-data-corruption checks its peaks (per bucket: (largest |value|, its offset in the
/// bucket), or None), its own finding about its state (`StateFault`'s word, 0: nothing) and the
/// checksums of the reduced buckets it consumed at the previous update (0: none). The row's sum of
/// squares (a value of the agreement) is the cells' in bucket order.
#[pyfunction]
#[pyo3(signature = (cells, loss, loss_scale, replica, watched=Vec::new(), peaks=None, state=0, reduced=None))]
#[allow(clippy::too_many_arguments)]
fn encode_row<'py>(
    py: Python<'py>,
    cells: Vec<[f64; 4]>,
    loss: f64,
    loss_scale: f64,
    replica: u64,
    watched: Vec<f64>,
    peaks: Option<Vec<Option<(f32, u64)>>>,
    state: u64,
    reduced: Option<Vec<u64>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let local = cells.iter().enumerate().map(|(b, &c)| cell_health(c, b)).collect::<Result<Vec<_>, _>>();
    let local = local.map_err(PyValueError::new_err)?;
    let n = local.len();
    let peaks: Vec<u64> = peaks.unwrap_or_else(|| vec![None; n]).into_iter().map(peak_word).collect();
    let reduced = reduced.unwrap_or_else(|| vec![0; n]);
    if (peaks.len(), reduced.len()) != (n, n) {
        return Err(PyValueError::new_err(format!(
            "health row: {} peaks and {} reduced checksums for {n} buckets",
            peaks.len(),
            reduced.len()
        )));
    }
    let sumsq = local.iter().map(|h| h.sumsq).sum();
    // In the order of `values`.
    let w = watched.len();
    let values = [sumsq, loss_scale].into_iter().chain(watched).collect();
    let report = LocalScalars { loss, values, replica, state };
    let row = shape(n, w).encode(&[], (&local, &peaks), Some((&neutral(n), &reduced)), &report);
    Ok(PyBytes::new(py, &to_bytes(row)))
}

/// A row of `encode_row`, decoded: (cells as `encode_row` takes them, loss, loss scale, replica,
/// watched words, peaks, state, reduced checksums).
#[pyfunction]
#[allow(clippy::type_complexity)]
#[pyo3(name = "decode_row", signature = (row, buckets, watched=0))]
fn decode_row_py(
    row: &[u8],
    buckets: usize,
    watched: usize,
) -> PyResult<(Vec<(f64, f64, f64, f64)>, f64, f64, u64, Vec<f64>, Vec<Option<(f32, u64)>>, u64, Vec<u64>)> {
    let w = words(row, "health row").map_err(PyValueError::new_err)?;
    let p = decode_row(&w, buckets, watched).map_err(PyValueError::new_err)?;
    let cells =
        p.local.iter().map(|h| (h.nan as f64, h.inf as f64, h.sumsq, h.first_bad.map_or(-1.0, |i| i as f64))).collect();
    let r = p.report;
    Ok((cells, r.loss, r.values[1], r.replica, r.values[VALUES.len()..].to_vec(), p.peaks, r.state, p.reduced))
}

/// `replica_checksum`'s fold (python/gradbus/guard.py) over float32 CPU tensors given as
/// (address, numel) pairs, in one call: each hashed by the runtime's replica checksum
/// (`checksum_f32`), the hashes folded in order as the Python loop folds them (the same bits), with
/// the GIL released. The caller guarantees, for every pair, what `checksum_f32` needs: a live
/// contiguous float32 CPU tensor (or a contiguous part of one) that it keeps referenced for the
/// call and that nothing writes meanwhile.
#[pyfunction]
fn checksum_f32_fold(py: Python<'_>, ptrs: Vec<usize>, numels: Vec<usize>) -> PyResult<u64> {
    if ptrs.len() != numels.len() {
        return Err(PyValueError::new_err(format!(
            "checksum_f32_fold: {} addresses and {} lengths",
            ptrs.len(),
            numels.len()
        )));
    }
    if let Some((&p, _)) =
        ptrs.iter().zip(&numels).find(|(&p, &n)| n > 0 && (p == 0 || p % std::mem::align_of::<f32>() != 0))
    {
        return Err(PyValueError::new_err(format!(
            "checksum_f32_fold: address {p:#x} is null or not aligned for f32 (hint: pass float32 tensors' data_ptr())"
        )));
    }
    Ok(py.detach(move || {
        ptrs.iter().zip(&numels).fold(0u64, |h, (&addr, &numel)| {
            let mut c = Checksum::new();
            if numel > 0 {
                // SAFETY: `addr` is non-null and f32-aligned (checked above); the caller guarantees
                // `numel` initialised f32 of a live tensor that it keeps referenced for this call
                // and that nothing writes meanwhile. Only read; does not outlive the call.
                c.update(unsafe { std::slice::from_raw_parts(addr as *const f32, numel) });
            }
            let h = (h ^ c.finish()).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            h ^ (h >> 31)
        })
    }))
}

/// The largest finite |value| of `numel` f32 at address `ptr` and its index (None for an empty
/// buffer): the peak of a bucket for the outlier rule, by the kernels' own scan (`Peak`). The caller
/// guarantees, as for `scan_f32`, a live contiguous float32 CPU tensor that nothing writes meanwhile.
#[pyfunction]
fn peak_f32(py: Python<'_>, ptr: usize, numel: usize) -> PyResult<Option<(f32, u64)>> {
    if numel == 0 {
        return Ok(None);
    }
    if ptr == 0 || ptr % std::mem::align_of::<f32>() != 0 {
        return Err(PyValueError::new_err(format!(
            "peak_f32: address {ptr:#x} is null or not aligned for f32 (hint: pass a float32 tensor's data_ptr())"
        )));
    }
    let addr = ptr;
    Ok(py.detach(move || {
        // SAFETY: as in `scan_f32`: non-null, aligned, `numel` initialised f32 of a live tensor
        // that nothing writes during the call; only read, and the slice does not outlive the call.
        let x = unsafe { std::slice::from_raw_parts(addr as *const f32, numel) };
        let mut p = Peak::default();
        p.offer(x, 0, 0.0);
        Some((p.value, p.at))
    }))
}

/// Words of one rank's row over `buckets` buckets and `watched` quantities.
#[pyfunction]
#[pyo3(signature = (buckets, watched=0))]
fn row_words(buckets: usize, watched: usize) -> usize {
    shape(buckets, watched).len()
}

/// A float element type of a ride segment whose 16-bit chunks it holds exactly (f32, f64).
trait Chunk: Copy {
    fn from_chunk(c: u16) -> Self;
    fn to_chunk(self) -> Option<u16>;
}

impl Chunk for f32 {
    fn from_chunk(c: u16) -> f32 {
        c as f32
    }
    fn to_chunk(self) -> Option<u16> {
        (self >= 0.0 && self <= 65535.0 && self.fract() == 0.0).then_some(self as u16)
    }
}

impl Chunk for f64 {
    fn from_chunk(c: u16) -> f64 {
        c as f64
    }
    fn to_chunk(self) -> Option<u16> {
        (self >= 0.0 && self <= 65535.0 && self.fract() == 0.0).then_some(self as u16)
    }
}

fn fill_ride<T: Chunk>(out: &mut [T], row: &[u8], rank: usize) {
    let per = row.len() / 2;
    out.fill(T::from_chunk(0));
    for (o, c) in out[rank * per..(rank + 1) * per].iter_mut().zip(row.chunks_exact(2)) {
        *o = T::from_chunk(u16::from_le_bytes([c[0], c[1]]));
    }
}

fn ride_bytes<T: Chunk + std::fmt::Display>(seg: &[T]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(2 * seg.len());
    for (i, &x) in seg.iter().enumerate() {
        let c = x.to_chunk().ok_or_else(|| {
            format!("ride segment element {i} is {x}, not a 16-bit chunk (hint: every rank must run the same guard with the same buckets)")
        })?;
        out.extend(c.to_le_bytes());
    }
    Ok(out)
}

/// The address, element count and element size of a ride segment, checked: a non-null address
/// aligned for its element type, f32 or f64.
fn ride_slice_args(ptr: usize, itemsize: usize) -> PyResult<()> {
    if !matches!(itemsize, 4 | 8) || ptr == 0 || ptr % itemsize != 0 {
        return Err(PyValueError::new_err(format!(
            "ride segment at {ptr:#x} of {itemsize}-byte elements: expected an aligned float32 or float64 CPU tensor"
        )));
    }
    Ok(())
}

/// Write the ride segment of this rank (`GuardCore.ride`) into `numel` elements of float32
/// (`itemsize` 4) or float64 (8) at `ptr` (a contiguous CPU tensor's `data_ptr()`): `world` slots
/// of the row's 16-bit little-endian chunks (`row`: `encode_row`'s bytes), this rank's row in slot
/// `rank`, zeros in the others. The caller guarantees a live contiguous CPU tensor of `numel`
/// elements of that size that nothing else reads or writes during the call (it is filled before
/// its all-reduce starts).
#[pyfunction]
fn ride_fill(ptr: usize, numel: usize, itemsize: usize, row: &[u8], rank: usize, world: usize) -> PyResult<()> {
    ride_slice_args(ptr, itemsize)?;
    if row.len() % 8 != 0 || rank >= world || numel != world * row.len() / 2 {
        return Err(PyValueError::new_err(format!(
            "ride segment of {numel} elements for rank {rank} of {world} and a row of {} bytes (expected {} elements)",
            row.len(),
            world * row.len() / 2
        )));
    }
    // SAFETY: `ptr` is non-null and aligned for the element type (checked above); the caller
    // guarantees `numel` initialised elements of a live contiguous CPU tensor of that type that
    // nothing else touches during the call. The slice does not outlive the call.
    unsafe {
        match itemsize {
            4 => fill_ride(std::slice::from_raw_parts_mut(ptr as *mut f32, numel), row, rank),
            _ => fill_ride(std::slice::from_raw_parts_mut(ptr as *mut f64, numel), row, rank),
        }
    }
    Ok(())
}

/// Every rank's row from a summed ride segment of `numel` float32 or float64 elements at `ptr`
/// (see `ride_fill`): the rows' bytes, back to back in rank order, as `decide_table` takes them.
/// Every element must be a 16-bit chunk (an integer in 0..=65535), else a `ValueError` naming it.
/// The caller guarantees, as for `ride_fill`, a live contiguous CPU tensor that nothing writes
/// during the call (its all-reduce has completed).
#[pyfunction]
fn ride_rows<'py>(py: Python<'py>, ptr: usize, numel: usize, itemsize: usize) -> PyResult<Bound<'py, PyBytes>> {
    ride_slice_args(ptr, itemsize)?;
    // SAFETY: as in `ride_fill`; only read, and the slice does not outlive the call.
    let bytes = unsafe {
        match itemsize {
            4 => ride_bytes(std::slice::from_raw_parts(ptr as *const f32, numel)),
            _ => ride_bytes(std::slice::from_raw_parts(ptr as *const f64, numel)),
        }
    };
    Ok(PyBytes::new(py, &bytes.map_err(PyValueError::new_err)?))
}

/// Rank `rank`'s contribution to the summary, from its row (`encode_row`'s bytes): (SUM words, MAX
/// words), each as little-endian int64 bytes for `torch.distributed.all_reduce` (SUM, resp. MAX with
/// the top bit flipped, see `FLIP`).
#[pyfunction]
#[pyo3(signature = (row, buckets, watched=0, rank=0))]
fn contribute<'py>(
    py: Python<'py>,
    row: &[u8],
    buckets: usize,
    watched: usize,
    rank: usize,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let w = words(row, "health row").map_err(PyValueError::new_err)?;
    let p = decode_row(&w, buckets, watched).map_err(PyValueError::new_err)?;
    // As the table path judges it (`decode_table`): the replica word folded, the peaks tallied.
    let report = LocalScalars { replica: replica_word(p.report.replica, &p.reduced), ..p.report };
    let Reduced { health, reference } = unreduced(buckets);
    let mut s = Summary::of_rank(&values(watched), rank, &p.local, Some((&health, &reference)), &report);
    for ((e, h), &peak) in s.extremes.iter_mut().zip(&p.local).zip(&p.peaks) {
        e.add(rank, &BucketStat { sumsq: h.sumsq, peak });
    }
    let max = s.max_words().into_iter().map(|x| x ^ FLIP);
    Ok((PyBytes::new(py, &to_bytes(s.sum_words())), PyBytes::new(py, &to_bytes(max))))
}

/// The agreement path the runtime's cost model (`AgreementPath::cheaper`) picks for `world` ranks
/// and `buckets` buckets with the guard's row (`shape`) and gloo's constants (`Calibration::GLOO`):
/// "table" or "summary". A function of numbers every rank has alike, so every rank picks the same
/// path.
#[pyfunction]
#[pyo3(signature = (world, buckets, watched=0))]
fn cheaper_path(world: usize, buckets: usize, watched: usize) -> &'static str {
    gradbus_collectives::AgreementPath::cheaper(world, shape(buckets, watched), Calibration::GLOO).name()
}

/// The runtime's cost model (`gradbus_collectives::choice::cost`) of the guard's agreement among
/// `world` ranks over `buckets` buckets with the constants `cheaper_path` uses: a dict of its bytes
/// and exchanges (`row_bytes`: the row codec's length; `table_bytes`, `summary_bytes`,
/// `summary_bytes_in`, `rounds`) and modelled times (`table_us`, `summary_us`), for the benchmark
/// that calibrates it.
#[pyfunction]
fn agreement_cost(py: Python<'_>, world: usize, buckets: usize) -> PyResult<Bound<'_, PyDict>> {
    let c = gradbus_collectives::choice::cost(world, shape(buckets, 0), Calibration::GLOO);
    let d = PyDict::new(py);
    for (k, v) in [
        ("row_bytes", c.row_bytes),
        ("table_bytes", c.table_bytes),
        ("summary_bytes", c.summary_bytes),
        ("summary_bytes_in", c.summary_bytes_in),
        ("rounds", c.rounds),
    ] {
        d.set_item(k, v)?;
    }
    d.set_item("table_us", c.table_us())?;
    d.set_item("summary_us", c.summary_us())?;
    Ok(d)
}

/// (SUM words, MAX words) of a summary for `buckets` buckets: the lengths `contribute` returns.
#[pyfunction]
#[pyo3(signature = (buckets, watched=0))]
fn summary_words(buckets: usize, watched: usize) -> (usize, usize) {
    let v = VALUES.len() + watched;
    (Summary::sum_len(buckets, v), Summary::max_len(buckets, v))
}

/// What every rank concludes about one update (the same on every rank).
#[pyclass(module = "gradbus._core", get_all)]
struct Decision {
    /// "proceed", "skip", "rerun", "abort", "repair" (some ranks' replicas are damaged and a
    /// healthy one, `donor`, is known: copy its state into them and recompute the update), or
    /// "diverged" (the replicas differ and none can be told healthy: the job must stop).
    action: String,
    /// The runtime's `report.json` text (sealed: format, crc32c) when some gradient was non-finite.
    report: Option<String>,
    /// A loss or gradient-norm spike, described, when spike detection is on and flagged one.
    spike: Option<String>,
    /// "repair": the damaged ranks; "diverged": every rank (none can be told healthy).
    diverged: Vec<usize>,
    /// "repair": the rank to copy the state from.
    donor: Option<usize>,
    /// "repair", "diverged": every rank's replica word (its weights' checksum folded with its
    /// reduced buckets' checksums, see `replica_word`).
    replicas: Vec<u64>,
    /// "repair", "diverged": per damaged rank, what differs: its own finding, the reduced buckets
    /// whose checksum differs from the donor's (or rank 0's), its weights' checksum.
    why: Vec<String>,
    /// The silent-data-corruption guard's finding, one line (a repair, an outlier), if any.
    finding: Option<String>,
    /// The agreed loss scale of the update (0.0: no scaler).
    loss_scale: f64,
    /// The ranks' mean loss (the exact sum rounded once, divided by the world).
    loss: f64,
    /// The gradient norm of spike detection: sqrt of the ranks' summed local squared norms / world,
    /// divided by the loss scale when there is one.
    grad_norm: f64,
    /// Whether the summary alone decided (false: the table was gathered).
    summary: bool,
    /// Per watched quantity, the maximum over ranks of their `watch::ranked` words (for
    /// `Watches::observe`).
    watched: Vec<f64>,
}

/// One rank's side of the agreement: the policy, and the runtime's judge (`gradbus_collectives::Judge`:
/// the history every rank keeps identically and the spike detectors, llm.c's rolling z-score and
/// Megatron's 10x rule).
#[pyclass(module = "gradbus._core")]
struct Agreement {
    policy: Policy,
    /// The skip budget's fraction and window (also the budget of loss-scale overflows).
    max_fraction: f64,
    window: u32,
    /// An overflow at a loss scale at or below this aborts.
    min_scale: f64,
    judge: Judge,
    /// What a spike of the agreed loss or gradient norm does (detection off without `spike`).
    on_spike: OnSpike,
    /// The silent-data-corruption guard's outlier rule on (the replica check is always on: it
    /// judges only updates whose rows carry checksums).
    outliers: bool,
    /// The last layout object passed in and its `Layout`: the guard passes the same list object
    /// while its buckets do not change, and it is converted once (see `layout`).
    layout: Option<(Py<PyAny>, Arc<Layout>)>,
}

impl Agreement {
    /// The `Layout` of the Python layout `obj` (`[[(name, numel), ...], ...]` per bucket), converted
    /// when `obj` is not the object of the previous call (the caller never mutates a layout it
    /// passed: a changed layout is a new list).
    fn layout(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Arc<Layout>> {
        match &self.layout {
            Some((o, l)) if o.bind(obj.py()).is(obj) => Ok(l.clone()),
            _ => {
                let buckets: Vec<Vec<(String, usize)>> = obj.extract()?;
                let l = Arc::new(ddp_layout(&buckets));
                self.layout = Some((obj.clone().unbind(), l.clone()));
                Ok(l)
            }
        }
    }

    /// The verdict from an agreed table (either path); records it in the history. `rows`: every
    /// rank's decoded row on the table path (empty on the summary path).
    fn judge(
        &mut self,
        t: &HealthTable,
        rows: &[RowParts],
        layout: &Layout,
        step: u64,
        attempt: u32,
    ) -> PyResult<Decision> {
        let scales = t.value("loss_scale");
        if scales.min().to_bits() != scales.max().to_bits() {
            return Err(PyRuntimeError::new_err(format!(
                "gradbus: the ranks' loss scales differ at step {step} (from {} to {}) (hint: give every rank its own GradScaler with the same settings, and the guard the scaler of its rank)",
                scales.min(),
                scales.max()
            )));
        }
        let scale = scales.max();
        let world = t.world;
        let mut out = Decision {
            action: String::new(),
            report: None,
            spike: None,
            diverged: Vec::new(),
            donor: None,
            replicas: Vec::new(),
            why: Vec::new(),
            finding: None,
            loss_scale: scale,
            loss: t.mean_loss(),
            grad_norm: t.value("sumsq").sum().sqrt() / world as f64 / if scale > 0.0 { scale } else { 1.0 },
            summary: !t.is_detailed(),
            watched: t.summary.names().iter().filter(|n| n.starts_with("watch:")).map(|n| t.value(n).max()).collect(),
        };
        self.checks(layout.buckets.len());
        let at = StepId { step, minibatch: 0, attempt };
        let watched = Watched { loss: out.loss, grad_norm: out.grad_norm };
        // With a loss scaler every non-finite update is an overflow of the scale.
        let scaler = (scale > 0.0).then_some(LossScale {
            scale,
            floor: self.min_scale,
            max_fraction: self.max_fraction,
            window: self.window,
        });
        let (verdict, spike, finding) = self.judge.judge(t, layout, &self.policy, at, watched, self.on_spike, scaler);
        out.action = verdict.action.as_str().into();
        out.spike = spike;
        out.report = verdict.report.as_ref().map(gradbus_artifacts::report_text);
        let replicas = verdict.action == Action::Repair
            || verdict.report.as_ref().is_some_and(|r| r.cause == Cause::Replicas && verdict.action == Action::Abort);
        if replicas {
            // The replica rule's decision (`sdc::check_state`): the damaged ranks and the donor, or
            // every rank when none can be told healthy.
            let (damaged, donor) = match finding.as_ref().and_then(|f| f.repair.clone()) {
                Some((donor, damaged)) => (damaged, Some(donor)),
                None => ((0..world).collect(), None),
            };
            out.action = if donor.is_some() { "repair" } else { "diverged" }.into();
            out.replicas = t.reports.iter().map(|r| r.replica).collect();
            if !rows.is_empty() {
                let other = |k: usize| donor.unwrap_or(if k == 0 { 1 % world } else { 0 });
                out.why = damaged.iter().map(|&k| what_differs(rows, k, other(k))).collect();
            }
            out.diverged = damaged;
            out.donor = donor;
        }
        out.finding = finding.map(|f| f.text);
        Ok(out)
    }

    /// The judge's silent-data-corruption checks for `buckets` buckets: the replica check, and the
    /// outlier rule when on. Set anew (the outlier rule's history emptied) when the bucket count
    /// changes (DDP rebuilds its buckets once, after the first update): the same on every rank.
    fn checks(&mut self, buckets: usize) {
        let outliers = self.outliers.then_some((OutlierRule::default(), buckets));
        let have = self.judge.sdc.outliers.as_ref().map(|d| (d.rule(), d.buckets()));
        if !self.judge.sdc.replicas || have != outliers {
            self.judge.sdc = SdcGuard::new(Checks { replicas: true, outliers });
        }
    }
}

/// What differs in rank `k`'s row from rank `other`'s (both decoded rows of the gathered table):
/// its own finding (`StateFault`), the buckets whose reduced checksum differs, its weights'
/// checksum. One line, for the report.
fn what_differs(rows: &[RowParts], k: usize, other: usize) -> String {
    let (r, o) = (&rows[k], &rows[other]);
    let mut out = Vec::new();
    let f = gradbus_collectives::StateFault::of_word(r.report.state);
    if f.weights {
        out.push("its weights changed after its optimizer step (its own check)".to_string());
    }
    if let Some(b) = f.consumed {
        out.push(format!(
            "its optimizer consumed a reduced bucket #{b} other than its all-reduce's result (its own check)"
        ));
    }
    let buckets: Vec<String> = (0..r.reduced.len())
        .filter(|&b| r.reduced[b] != o.reduced[b])
        .map(|b| format!("#{b} {:016x} (rank {other}: {:016x})", r.reduced[b], o.reduced[b]))
        .collect();
    if !buckets.is_empty() {
        out.push(format!("the reduced gradient it consumed differs in bucket(s) {}", buckets.join(", ")));
    }
    if r.report.replica != o.report.replica {
        out.push(format!("its weights hash to {:016x} (rank {other}: {:016x})", r.report.replica, o.report.replica));
    }
    if out.is_empty() {
        out.push(format!("nothing differs from rank {other}"));
    }
    out.join("; ")
}

#[pymethods]
impl Agreement {
    /// `policy`: "abort", "skip" (bounded by `max_consecutive` skips in a row and `max_fraction` of
    /// the last `window` updates, the runtime's defaults) or "rerun". `spike`: None, "warn" or
    /// "skip", with the runtime's `spike.window` / `spike.z_limit` defaults. `min_scale`: the loss
    /// scale floor (an overflow at a scale at or below it aborts). `outliers`: the
    /// silent-data-corruption guard's outlier rule (`sdc::OutlierRule`'s defaults) on.
    #[new]
    #[pyo3(signature = (policy, max_consecutive=3, max_fraction=0.1, window=100, spike=None, spike_window=128, z_limit=6.0, min_scale=1.0, outliers=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        policy: &str,
        max_consecutive: u32,
        max_fraction: f64,
        window: u32,
        spike: Option<&str>,
        spike_window: usize,
        z_limit: f64,
        min_scale: f64,
        outliers: bool,
    ) -> PyResult<Self> {
        if !(0.0..=1.0).contains(&max_fraction) || window == 0 {
            return Err(PyValueError::new_err(format!(
                "skip bounds: max_fraction {max_fraction} must be in [0, 1] and window {window} at least 1"
            )));
        }
        if !(min_scale.is_finite() && min_scale > 0.0) {
            return Err(PyValueError::new_err(format!(
                "min_scale {min_scale}: the loss scale floor must be a positive number (DeepSpeed's and Megatron's default: 1.0)"
            )));
        }
        let policy = match policy {
            "abort" => Policy::Abort,
            "rerun" => Policy::Rerun,
            "skip" => Policy::Skip { max_consecutive, max_fraction, window },
            other => {
                return Err(PyValueError::new_err(format!(
                    "policy {other:?}: expected \"abort\", \"skip\" or \"rerun\""
                )))
            }
        };
        let on_spike = match spike {
            None => OnSpike::Off,
            Some("warn") => OnSpike::Warn,
            Some("skip") => OnSpike::Skip,
            Some(other) => {
                return Err(PyValueError::new_err(format!("spike {other:?}: expected None, \"warn\" or \"skip\"")))
            }
        };
        Ok(Agreement {
            policy,
            max_fraction,
            window,
            min_scale,
            judge: Judge::new(spike_window, z_limit),
            on_spike,
            outliers,
            layout: None,
        })
    }

    /// The decision from the all-reduced summary (`sum`, `max`: the element-wise SUM and MAX of every
    /// rank's `contribute` words, as bytes); `None` when the summary shows an anomaly: then every
    /// rank all-gathers its row and calls `decide_table`. `layout[b]` = [(name, numel), ...].
    #[pyo3(signature = (sum, max, world, layout, step, attempt, watched=0))]
    #[allow(clippy::too_many_arguments)]
    fn decide_summary(
        &mut self,
        sum: &[u8],
        max: &[u8],
        world: usize,
        layout: &Bound<'_, PyAny>,
        step: u64,
        attempt: u32,
        watched: usize,
    ) -> PyResult<Option<Decision>> {
        let layout = self.layout(layout)?;
        let buckets = layout.buckets.len();
        let (s, m) = (
            words(sum, "summary").map_err(PyValueError::new_err)?,
            words(max, "summary").map_err(PyValueError::new_err)?,
        );
        if (s.len(), m.len()) != summary_words(buckets, watched) || world == 0 {
            return Err(PyValueError::new_err(format!(
                "summary of {} + {} words for {world} ranks, expected {} + {} for {buckets} buckets (hint: every rank must run the same DDP model with the same buckets)",
                s.len(),
                m.len(),
                summary_words(buckets, watched).0,
                summary_words(buckets, watched).1
            )));
        }
        let m: Vec<u64> = m.into_iter().map(|x| x ^ FLIP).collect();
        let summary = Summary::from_words(buckets, &values(watched), &s, &m);
        if summary.anomaly().is_some() {
            return Ok(None);
        }
        let t = HealthTable::summarized(world, summary).expect("no anomaly: the reducers agree");
        self.judge(&t, &[], &layout, step, attempt).map(Some)
    }

    /// The decision from the gathered table (`world` rows of `contribute`'s row, concatenated, as
    /// bytes); records it in the history. `reduced`: per bucket, the health of the reduced sum as
    /// every rank scanned it alike ((nan, inf, sumsq, first_bad or -1), the `scan` path's), so that
    /// a sum that overflowed from finite inputs is judged as one; None: not scanned.
    #[pyo3(signature = (table, world, layout, step, attempt, watched=0, reduced=None))]
    #[allow(clippy::too_many_arguments)]
    fn decide_table(
        &mut self,
        table: &[u8],
        world: usize,
        layout: &Bound<'_, PyAny>,
        step: u64,
        attempt: u32,
        watched: usize,
        reduced: Option<Vec<[f64; 4]>>,
    ) -> PyResult<Decision> {
        let layout = self.layout(layout)?;
        let w = words(table, "health table").map_err(PyValueError::new_err)?;
        let buckets = layout.buckets.len();
        let reduced = match reduced {
            Some(cells) => Some(
                cells.into_iter().enumerate().map(|(b, c)| cell_health(c, b)).collect::<Result<Vec<_>, _>>(),
            ),
            None => None,
        };
        let reduced = reduced.transpose().map_err(PyValueError::new_err)?;
        let t = decode_table(&w, world, buckets, watched, reduced).map_err(PyValueError::new_err)?;
        let n = shape(buckets, watched).len();
        let rows = w.chunks_exact(n).map(|r| decode_row(r, buckets, watched)).collect::<Result<Vec<_>, _>>();
        self.judge(&t, &rows.map_err(PyValueError::new_err)?, &layout, step, attempt)
    }

    /// A first attempt decided "proceed" without any exchange (the `scan` path: every rank scanned
    /// the same reduced sums and found them finite, so every rank's input was finite): recorded in
    /// the history as the table paths record a proceed, so that the skip policy's bounds count it.
    /// Only where nothing else needs the table: no spike detection, no outlier rule, no replica
    /// check, no rerun in progress (the caller's conditions, `GuardCore._scans`).
    fn proceed_clean(&mut self) {
        self.judge.history.proceeded();
    }

    /// Updates skipped so far.
    #[getter]
    fn skipped(&self) -> u64 {
        self.judge.history.skipped
    }

    /// Skips in a row up to now.
    #[getter]
    fn consecutive_skips(&self) -> u32 {
        self.judge.history.consecutive_skips
    }

    /// Ranks classified suspect after a transient fault (rerun policy).
    #[getter]
    fn suspects(&self) -> Vec<usize> {
        self.judge.history.suspects.clone()
    }

    /// The silent-data-corruption guard's findings so far (repairs, undecided replicas, outliers).
    #[getter]
    fn detections(&self) -> u64 {
        self.judge.sdc.detections
    }

    /// Skip flags of the most recent updates, newest last.
    #[getter]
    fn recent_skips(&self) -> Vec<bool> {
        self.judge.history.recent.iter().copied().collect()
    }
}

/// gradbus's native core.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // A bad GRADBUS_SIMD fails the import with the kernels' message (naming the variable and the
    // levels), not a panic inside the first scan.
    gradbus_kernels::simd::from_env().map_err(|e| PyValueError::new_err(e.to_string()))?;
    m.add("CELL", CELL)?;
    m.add_function(wrap_pyfunction!(scan_f32, m)?)?;
    m.add_function(wrap_pyfunction!(scale_scan_f32, m)?)?;
    m.add_function(wrap_pyfunction!(finite_f32, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_f32, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_f32_fold, m)?)?;
    m.add_function(wrap_pyfunction!(peak_f32, m)?)?;
    m.add_function(wrap_pyfunction!(encode_row, m)?)?;
    m.add_function(wrap_pyfunction!(decode_row_py, m)?)?;
    m.add_function(wrap_pyfunction!(row_words, m)?)?;
    m.add_function(wrap_pyfunction!(ride_fill, m)?)?;
    m.add_function(wrap_pyfunction!(ride_rows, m)?)?;
    m.add_function(wrap_pyfunction!(contribute, m)?)?;
    m.add_function(wrap_pyfunction!(summary_words, m)?)?;
    m.add_function(wrap_pyfunction!(cheaper_path, m)?)?;
    m.add_function(wrap_pyfunction!(agreement_cost, m)?)?;
    m.add_class::<Agreement>()?;
    m.add_class::<scan_path::ScanPath>()?;
    m.add_class::<Decision>()?;
    watch::register(m)?;
    Ok(())
}
