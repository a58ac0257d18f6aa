//! The DDP hook's fast path on the scan path's healthy updates (`gradbus.torch.Guard._fast`): the
//! buckets as the guard learnt them, each one's pre-division fused with its scan as the update's
//! buckets arrive (`tally`), and the reduced sums' check before the optimizer step (`healthy`),
//! with the update's tallies kept here instead of in Python's records - the same work as the
//! hook's general path (`scale_scan_f32`, `finite_f32`) in two calls per bucket and update. On
//! anything else (a bucket not as learnt, a sum that is not finite) the Python side takes the
//! tallies over (`take`) and decides on its general path.
//!
//! Invariant: the addresses are those of the bucket buffers held in `buffers` (references to the
//! tensors, so their memory lives as long as this object), checked usable for f32 at construction (but an empty one's, never read).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{f32_address, finite, scale_scan, Cell};

#[pyclass(module = "gradbus._core")]
pub struct ScanPath {
    /// The bucket buffers (torch tensors), in DDP's bucket order: kept alive with the addresses.
    _buffers: Vec<Py<PyAny>>,
    /// Each bucket buffer's (address, elements).
    buckets: Vec<(usize, usize)>,
    /// The pre-division (1 / world).
    scale: f32,
    /// This update's tallies, bucket by bucket (buckets 0..len).
    cells: Vec<Cell>,
}

#[pymethods]
impl ScanPath {
    /// `buffers`: the bucket buffers (contiguous float32 CPU tensors), `ptrs` and `numels` their
    /// `data_ptr()` and `numel()`, in DDP's bucket order; `scale`: the pre-division.
    #[new]
    fn new(buffers: Vec<Py<PyAny>>, ptrs: Vec<usize>, numels: Vec<usize>, scale: f32) -> PyResult<Self> {
        if buffers.len() != ptrs.len() || ptrs.len() != numels.len() || ptrs.is_empty() {
            return Err(PyValueError::new_err(format!(
                "ScanPath: {} buffers, {} addresses and {} lengths (hint: one of each per bucket, at least one)",
                buffers.len(),
                ptrs.len(),
                numels.len()
            )));
        }
        for (&p, &n) in ptrs.iter().zip(&numels) {
            if n > 0 {
                f32_address("ScanPath", p)?;
            }
        }
        Ok(ScanPath { _buffers: buffers, buckets: ptrs.into_iter().zip(numels).collect(), scale, cells: Vec::new() })
    }

    /// Bucket `b` of the update being computed, whose buffer is at `ptr` with `numel` elements:
    /// when it is the update's next bucket and the buffer learnt, scale it by the pre-division and
    /// scan it in one pass (`scale_scan_f32`), keep its cell, and return True. Else False, and
    /// nothing is done (the caller's general path takes the bucket).
    fn tally(&mut self, py: Python<'_>, b: usize, ptr: usize, numel: usize) -> bool {
        if b != self.cells.len() || self.buckets.get(b) != Some(&(ptr, numel)) {
            return false;
        }
        // SAFETY: `ptr` is the held buffer's address (checked at construction), `numel` its
        // length; DDP hands the bucket to the hook after autograd has written it and starts no
        // read or write of it before the hook has returned (the caller's contract, as for
        // `scale_scan_f32`).
        self.cells.push(unsafe { scale_scan(py, ptr, numel, self.scale) });
        true
    }

    /// Whether every bucket of the update has been tallied and every reduced sum in the buffers is
    /// finite (`finite_f32`): then the tallies are dropped, ready for the next update. Else False,
    /// with the tallies kept for `take`.
    fn healthy(&mut self, py: Python<'_>) -> bool {
        if self.cells.len() != self.buckets.len() {
            return false;
        }
        // SAFETY: the held buffers' addresses and lengths; the all-reduces have completed (DDP
        // waited for them before backward returned) and nothing writes the buffers before the
        // optimizer step that this check precedes (only read).
        if self.buckets.iter().all(|&(ptr, numel)| unsafe { finite(py, ptr, numel) }) {
            self.cells.clear();
            return true;
        }
        false
    }

    /// The update's tallies so far (buckets 0..), handed to the general path; none are kept.
    fn take(&mut self) -> Vec<Cell> {
        std::mem::take(&mut self.cells)
    }

    /// The buckets this path knows.
    #[getter]
    fn buckets(&self) -> usize {
        self.buckets.len()
    }
}
