//! The `Transport` trait: how a worker's gradient buffer is all-reduced bucket by bucket and how the
//! cluster agrees on one health table, plus `Solo`, the world-size-1 transport.
//!
//! Invariants: after `agree` returns, every rank holds the same `HealthTable` and the same reduced
//! gradients; a transport never returns to one rank an answer that another rank did not get. A
//! failure (a peer that never arrives, a dead peer) is an `Error` on every live rank within the
//! deadline, never a hang.

use std::ops::Range;

use gradbus_kernels::checksum::{checksum, combine};
use gradbus_kernels::{health_scan, Health};

use crate::agreement::{LocalScalars, ValueNames};
use crate::layout::Layout;
use crate::verdict::{HealthTable, Reduced, StepId};
use crate::Error;

/// A data-parallel gradient transport.
///
/// # Safety
/// `backward_and_reduce` (grads/host.rs) lets backward write into parameter slots of the buffer at
/// `grads_ptr` on another thread while `allreduce_bucket` runs, trusting two promises:
/// - `grads_ptr` returns the same pointer for the transport's lifetime, to `layout().len` valid,
///   64-byte aligned f32s, which the transport accesses only inside `grads`, `allreduce_bucket`
///   and `agree`;
/// - `allreduce_bucket(at, b)` reads and writes only bucket `b`'s range of that buffer and makes no
///   reference to the rest of it (no `grads()` there: slice only the bucket's range).
pub unsafe trait Transport {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// The layout every rank shares.
    fn layout(&self) -> &Layout;
    /// This rank's flat gradient buffer (for the shared-memory bus it lives in the segment, so
    /// backward writes straight onto the bus): `layout().len` f32s, 64-byte aligned, valid and at
    /// the same address for the transport's lifetime. A raw pointer, so that backward can hold
    /// views of some parameters while `allreduce_bucket` works on others (`grads/host.rs`).
    fn grads_ptr(&mut self) -> *mut f32;
    /// The whole gradient buffer as one slice.
    fn grads(&mut self) -> &mut [f32] {
        let len = self.layout().len;
        // SAFETY: `grads_ptr` is `len` valid, aligned f32s (its contract); `&mut self` makes this
        // the only borrow made through the transport until it ends.
        unsafe { std::slice::from_raw_parts_mut(self.grads_ptr(), len) }
    }
    /// Sum one bucket over all ranks, in rank order, tallying each rank's local health on the way.
    /// Touches only the bucket's range of this rank's buffer, and makes no borrow of the rest of
    /// it: backward may be writing there (`grads/host.rs`).
    fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error>;
    /// After the last bucket: exchange the local reports and return the agreed table - its O(buckets)
    /// summary on a healthy update, the per-rank detail too when the summary shows an anomaly
    /// (`agreement`; the same summary either way).
    fn agree(&mut self, at: StepId, local: LocalScalars) -> Result<HealthTable, Error>;
    /// How many chunks a bucket's local health is tallied in (merged in chunk order); `bucket_health`
    /// with this count gives the same bits as the table, which is what lets a replay compare exactly.
    fn health_chunks(&self) -> usize {
        1
    }
    /// Copy `data` (`layout().len` floats: weights or optimizer moments, laid out as the
    /// gradients) from rank `root` to every rank, collectively: the repair of a damaged replica, on
    /// a path that only runs when one was found. It may overwrite the gradient buffer (the update is
    /// then recomputed). A transport that cannot refuses (`Error::Unsupported`): the job then stops.
    fn broadcast_from(&mut self, at: StepId, root: usize, data: &mut [f32]) -> Result<(), Error>;
    /// Mark this rank as failed so peers stop waiting for it and fail at once (best effort; a
    /// transport whose peers cannot be told says why it does nothing).
    fn mark_failed(&mut self);
}

/// The health of one bucket's elements as a transport that tallies it in `chunks` reducer chunks
/// reports it: each chunk scanned, the chunks merged in order. With `chunks == 1` this is
/// `health_scan`; the sum of squares of other chunkings differs in its last bits (another order of
/// f64 additions), so a bitwise comparison must use the transport's own count.
pub fn bucket_health(x: &[f32], chunks: usize) -> Health {
    let mut h = Health::default();
    for r in 0..chunks {
        let c = crate::layout::chunk_range(x.len(), chunks, r, crate::layout::ALIGN_FLOATS);
        h.merge(&health_scan(&x[c.clone()]), c.start as u64);
    }
    h
}

/// The pieces a transport's reducers hash the reduced gradients in (every bucket cut into
/// `chunks` reducer chunks, `Transport::health_chunks`), bucket by bucket in reduce order, chunks
/// in offset order: they tile the buffer. A rank's optimizer hashes the same pieces of what it
/// consumes, and `checksum::combine` folds a bucket's pieces alike on both sides.
pub fn hash_pieces(layout: &Layout, chunks: usize) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(layout.buckets.len() * chunks);
    for b in &layout.buckets {
        for r in 0..chunks {
            let c = crate::layout::chunk_range(b.range.len(), chunks, r, crate::layout::ALIGN_FLOATS);
            out.push(b.range.start + c.start..b.range.start + c.end);
        }
    }
    out
}

/// A 64-byte aligned, zeroed f32 buffer on the heap.
pub struct AlignedBuf {
    lines: Vec<Line>,
    len: usize,
}

/// One cache line of floats; its alignment is what makes the buffer 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; 16]);

impl AlignedBuf {
    /// `len` zeros.
    pub fn zeros(len: usize) -> AlignedBuf {
        AlignedBuf { lines: vec![Line([0.0; 16]); len.div_ceil(16)], len }
    }
    /// The elements.
    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` around `[f32; 16]` and exactly 64 bytes (no padding), so
        // `lines` is `16 * lines.len() >= len` initialised, contiguous f32s.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
    /// The elements, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        let len = self.len;
        self.range_mut(0..len)
    }
    /// Elements `r`, mutable, without borrowing the others (see `Transport::allreduce_bucket`).
    pub fn range_mut(&mut self, r: Range<usize>) -> &mut [f32] {
        assert!(r.start <= r.end && r.end <= self.len, "range {r:?} of {} elements", self.len);
        // SAFETY: as in `as_slice`, `r` lies inside the buffer, and `&mut self` makes the borrow
        // unique. `Vec::as_mut_ptr` materializes no reference to the other elements.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr().add(r.start), r.len()) }
    }
    /// The first element's address (stable: the buffer never reallocates).
    pub fn as_mut_ptr(&mut self) -> *mut f32 {
        self.lines.as_mut_ptr().cast::<f32>()
    }
}

/// World size 1: no peers, the reduce is the identity, the health tally is a plain scan.
pub struct Solo {
    layout: Layout,
    values: ValueNames,
    grads: AlignedBuf,
    local: Vec<Health>,
    /// Position hash of each bucket (its own sum) at its reduce.
    hashes: Vec<u64>,
}

impl Solo {
    /// A solo transport over `layout`, agreeing on the workload values `values`.
    pub fn new(layout: Layout, values: ValueNames) -> Solo {
        let n = layout.buckets.len();
        Solo {
            grads: AlignedBuf::zeros(layout.len),
            layout,
            values,
            local: vec![Health::default(); n],
            hashes: vec![0; n],
        }
    }
}

// SAFETY: `AlignedBuf` never moves its elements; `allreduce_bucket` borrows only its bucket
// (`range_mut`).
unsafe impl Transport for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn grads_ptr(&mut self) -> *mut f32 {
        self.grads.as_mut_ptr()
    }
    fn allreduce_bucket(&mut self, _at: StepId, bucket: usize) -> Result<(), Error> {
        let r = self.layout.buckets[bucket].range.clone();
        let g = self.grads.range_mut(r.clone());
        self.local[bucket] = health_scan(g);
        self.hashes[bucket] = combine(&[checksum(g)]);
        Ok(())
    }
    fn agree(&mut self, _at: StepId, local: LocalScalars) -> Result<HealthTable, Error> {
        let reduced = Reduced { health: self.local.clone(), reference: self.hashes.clone() };
        Ok(HealthTable::detailed(1, &self.values, self.local.clone(), Vec::new(), reduced, vec![local], None))
    }
    /// No peers: nothing to copy to (and no replica to differ).
    fn broadcast_from(&mut self, _at: StepId, _root: usize, _data: &mut [f32]) -> Result<(), Error> {
        Ok(())
    }
    /// No peers to tell.
    fn mark_failed(&mut self) {}
}
