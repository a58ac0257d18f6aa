//! The CPU's bus ([`HostBus`]): backward writes straight into the transport's own gradient buffer
//! (for the shared-memory bus, this rank's slot of the segment: no copy in), and a bucket is
//! all-reduced as soon as backward has finished every parameter in it, while backward goes on with
//! the earlier layers.
//!
//! ```text
//!   backward thread:  head | ln_f | block L-1 ...... | block 0 | embeddings
//!                         ^ bucket #0 final   ^ bucket #1 final          ^ last bucket final
//!   calling thread:        reduce #0 ........  reduce #1 .........        reduce #last, agree
//! ```
//!
//! Invariants:
//! - Backward sees this rank's gradients only as [`ParamGrads`]: one [`GradMut`] per parameter,
//!   taken with [`ParamGrads::take`] and given back BY VALUE with [`ParamGrads::release`] once
//!   final. A `GradMut` is a raw pointer that derefs to a slice only for the length of a borrow of
//!   it, so once it is given back no Rust reference covers that slot, not even a function argument
//!   of the release itself. A bucket is handed to the reducer only after every view into it has
//!   come back, so no live borrow covers memory that a reduce reads or that a peer writes. That is
//!   what makes the overlap sound, not only correct.
//! - Buckets are released in order #0, #1, ... (backward finishes parameters last-first and #0
//!   holds the last ones), and every rank reduces the same sequence, so the sums are the bitwise
//!   sums of the sequential path: overlap changes when a reduce runs, never what it computes.
//! - The collective calls stay on the calling thread (MPI only ever sees one thread); backward
//!   runs on a scoped thread that touches no transport.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::mpsc;

use gradbus_kernels::backend::Cpu;

use super::{BusBackend, GradBus, GradSlots};
use crate::layout::Layout;
use crate::transport::Transport;
use crate::verdict::StepId;
use crate::Error;

/// One parameter's gradient, mutable, until it is given back with [`ParamGrads::release`]; derefs
/// to `[f32]`.
pub struct GradMut<'a> {
    ptr: NonNull<f32>,
    len: usize,
    _slot: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `GradMut` is the unique handle to its elements, like the `&'a mut [f32]` it stands for.
unsafe impl Send for GradMut<'_> {}

impl Deref for GradMut<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `ptr..ptr + len` is this parameter's slot, valid for `'a` and reachable only
        // through this handle (`ParamGrads` hands each slot out once).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for GradMut<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Per-parameter views of one rank's gradient buffer for backward, which gives each back when its
/// gradient is final; see the module doc.
pub struct ParamGrads<'a> {
    views: Vec<Option<GradMut<'a>>>,
    /// Each parameter's slot in the flat buffer and the bucket holding it.
    slots: Vec<(Range<usize>, usize)>,
    /// Address of element 0 of the flat buffer (only compared, never dereferenced).
    base: usize,
    /// Per bucket: parameters not yet released.
    left: Vec<usize>,
    /// The next bucket to hand to the reducer.
    next: usize,
    released: Vec<usize>,
    /// Called on each view just before it is given up (fault injection plants NaN/Inf here).
    finalize: Option<&'a mut (dyn FnMut(usize, &mut [f32]) + Send)>,
    ready: Option<mpsc::Sender<usize>>,
}

impl<'a> ParamGrads<'a> {
    /// Views of the flat buffer `grads` (laid out by `layout`), which keeps its values: backward
    /// accumulates into them.
    pub fn new(grads: &'a mut [f32], layout: &Layout) -> ParamGrads<'a> {
        assert_eq!(grads.len(), layout.len, "gradient buffer and layout disagree");
        // SAFETY: `grads` is `layout.len` valid f32s, borrowed mutably for `'a`.
        unsafe { ParamGrads::from_raw(grads.as_mut_ptr(), layout) }
    }

    /// Views of the `layout.len` f32s at `base`.
    ///
    /// # Safety
    /// `base` must point to `layout.len` valid, aligned f32s that nothing else accesses through a
    /// reference during `'a`, except a bucket's range after it has been handed to the reducer.
    unsafe fn from_raw(base: *mut f32, layout: &Layout) -> ParamGrads<'a> {
        let views = layout
            .slots
            .iter()
            .map(|s| {
                assert!(s.offset + s.numel <= layout.len, "slot {} outside the buffer", s.name);
                // SAFETY: inside the buffer (checked above); slots are disjoint (layout.rs).
                let ptr = unsafe { NonNull::new_unchecked(base.add(s.offset)) };
                Some(GradMut { ptr, len: s.numel, _slot: PhantomData })
            })
            .collect();
        let mut left = vec![0; layout.buckets.len()];
        layout.slots.iter().for_each(|s| left[s.bucket] += 1);
        ParamGrads {
            views,
            slots: layout.slots.iter().map(|s| (s.range(), s.bucket)).collect(),
            base: base as usize,
            left,
            next: 0,
            released: Vec::with_capacity(layout.slots.len()),
            finalize: None,
            ready: None,
        }
    }

    /// Parameter `p`'s gradient, to accumulate into. Panics when taken twice: backward finishes a
    /// parameter once.
    pub fn take(&mut self, p: usize) -> GradMut<'a> {
        self.views[p].take().unwrap_or_else(|| panic!("gradient of parameter {p} taken twice"))
    }

    /// Give back parameter `p`'s view: its gradient is final. When that completes the next
    /// buckets, they go to the reducer. Panics when `view` is not `p`'s slot.
    pub fn release(&mut self, p: usize, mut view: GradMut<'a>) {
        let (range, bucket) = self.slots[p].clone();
        assert!(
            view.ptr.as_ptr() as usize == self.base + 4 * range.start && view.len == range.len(),
            "release of parameter {p}: not its gradient slot"
        );
        if let Some(f) = self.finalize.as_mut() {
            f(p, &mut view);
        }
        drop(view);
        self.released.push(p);
        self.left[bucket] -= 1;
        while self.next < self.left.len() && self.left[self.next] == 0 {
            self.send_next();
        }
    }

    /// Parameters released so far, in order.
    pub fn released(&self) -> &[usize] {
        &self.released
    }

    /// Hand every bucket not yet handed over to the reducer (after backward returned normally:
    /// a parameter it never touched keeps its gradient).
    fn finish(&mut self) {
        self.views.iter_mut().for_each(|v| *v = None);
        while self.next < self.left.len() {
            self.send_next();
        }
    }

    fn send_next(&mut self) {
        if let Some(tx) = &self.ready {
            // The reducer stops receiving only after an error; then nothing is left to reduce.
            let _ = tx.send(self.next);
        }
        self.next += 1;
    }
}

impl<'a> GradSlots<Cpu> for ParamGrads<'a> {
    type Slot = GradMut<'a>;
    fn take(&mut self, p: usize) -> GradMut<'a> {
        ParamGrads::take(self, p)
    }
    fn view_mut<'s>(slot: &'s mut GradMut<'a>) -> &'s mut [f32] {
        slot
    }
    fn view<'s>(slot: &'s GradMut<'a>) -> &'s [f32] {
        slot
    }
    fn release(&mut self, p: usize, slot: GradMut<'a>) {
        ParamGrads::release(self, p, slot)
    }
}

/// The CPU's bus: any host transport (`Solo`, the shared-memory bus, MPI, hierarchical), whose
/// own gradient buffer backward writes through [`ParamGrads`], reduced bucket by bucket by
/// [`backward_and_reduce`].
pub struct HostBus {
    transport: Box<dyn Transport>,
}

impl HostBus {
    /// The bus over `transport`.
    pub fn new(transport: Box<dyn Transport>) -> HostBus {
        HostBus { transport }
    }
}

impl GradBus<Cpu> for HostBus {
    type Slots<'g> = ParamGrads<'g>;
    fn backward_and_reduce<F>(
        &mut self,
        _be: &Cpu,
        at: StepId,
        overlap: bool,
        finalize: &mut (dyn FnMut(usize, &mut [f32]) + Send),
        backward: F,
        after_bucket: &mut dyn FnMut(usize),
    ) -> Result<(), Error>
    where
        F: FnOnce(&mut ParamGrads<'_>) + Send,
    {
        backward_and_reduce(&mut *self.transport, at, overlap, finalize, backward, after_bucket)
    }
    fn reduced_grads(&mut self, _be: &Cpu) -> &mut [f32] {
        self.transport.grads()
    }
    fn transport(&self) -> &dyn Transport {
        &*self.transport
    }
    fn transport_mut(&mut self) -> &mut dyn Transport {
        &mut *self.transport
    }
}

impl BusBackend for Cpu {
    type Bus = HostBus;
}

/// Zero this rank's gradients, run `backward` (which fills them through [`ParamGrads`]) and
/// all-reduce every bucket, in order, calling `after_bucket(b)` after bucket `b`. With `overlap`,
/// backward runs on a scoped thread and each bucket is reduced as soon as it is final; without,
/// the buckets are reduced after backward returns. Both give the same bits. `finalize(p, grad)`
/// sees each parameter's final gradient before it can be reduced.
///
/// On a reduce error the remaining buckets are not reduced; backward is still waited for, then the
/// error is returned. A panic in backward is resumed on the calling thread.
pub fn backward_and_reduce<T, R, B>(
    bus: &mut T,
    at: StepId,
    overlap: bool,
    finalize: &mut (dyn FnMut(usize, &mut [f32]) + Send),
    backward: B,
    after_bucket: &mut dyn FnMut(usize),
) -> Result<R, Error>
where
    T: Transport + ?Sized,
    R: Send,
    B: FnOnce(&mut ParamGrads<'_>) -> R + Send,
{
    let layout = bus.layout().clone();
    let nb = layout.buckets.len();
    if !overlap {
        let grads = bus.grads();
        grads.fill(0.0);
        let mut g = ParamGrads::new(grads, &layout);
        g.finalize = Some(finalize);
        let r = backward(&mut g);
        for b in 0..nb {
            bus.allreduce_bucket(at, b)?;
            after_bucket(b);
        }
        return Ok(r);
    }
    let (len, base) = (layout.len, bus.grads_ptr());
    // SAFETY: `grads_ptr` is this rank's slot of `layout.len` f32s, valid while `bus` lives, which
    // outlives the scope below (the `Transport` contract). No other borrow of the slot exists:
    // `bus` is borrowed mutably for this call, and its `allreduce_bucket(b)` touches only bucket
    // `b`'s range (the contract again), which it is given only after every view into that range
    // has been released (module doc). Peers write into a bucket only inside its reduce, which
    // needs this rank too.
    let g = unsafe {
        std::ptr::write_bytes(base, 0, len);
        ParamGrads::from_raw(base, &layout)
    };
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let spawned = std::thread::Builder::new().name("backward".into()).spawn_scoped(s, || {
            // Owned by this thread, so a panic drops the sender and ends the reducer's loop.
            let mut g = g;
            g.finalize = Some(finalize);
            g.ready = Some(tx);
            let r = backward(&mut g);
            g.finish();
            r
        });
        let worker = spawned.map_err(|e| Error::Io { what: "starting the backward thread".into(), source: e })?;
        let mut failed = None;
        for b in rx {
            if failed.is_none() {
                match bus.allreduce_bucket(at, b) {
                    Ok(()) => after_bucket(b),
                    Err(e) => failed = Some(e),
                }
            }
        }
        let r = worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        match failed {
            Some(e) => Err(e),
            None => Ok(r),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ParamSpec;

    fn layout() -> Layout {
        let specs: Vec<_> =
            [5, 17, 1, 40, 3].iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), n)).collect();
        Layout::new(&specs, 20 * 4)
    }

    #[test]
    fn views_are_the_slots_and_buckets_release_in_order() {
        let layout = layout();
        let mut flat = vec![0.0f32; layout.len];
        let mut sent = Vec::new();
        {
            let (tx, rx) = mpsc::channel();
            let mut g = ParamGrads::new(&mut flat, &layout);
            g.ready = Some(tx);
            for p in (0..layout.slots.len()).rev() {
                let mut v = g.take(p);
                v.iter_mut().for_each(|x| *x = p as f32 + 1.0);
                g.release(p, v);
                sent.push(rx.try_iter().collect::<Vec<_>>());
            }
            g.finish();
            assert!(rx.try_iter().next().is_none());
        }
        // Each bucket goes out with its first parameter (the lowest index in it, released last).
        for (p, s) in sent.iter().enumerate().map(|(i, s)| (layout.slots.len() - 1 - i, s)) {
            let b = layout.slots[p].bucket;
            let closes = layout.buckets[b].params.iter().all(|&q| q >= p);
            assert_eq!(s, &if closes { vec![b] } else { vec![] }, "after parameter {p}");
        }
        for s in &layout.slots {
            assert!(flat[s.range()].iter().all(|&x| x == s.param as f32 + 1.0), "{}", s.name);
        }
    }

    /// A transport that records which buckets it reduced (and fails on `fail_at`).
    struct Recorder {
        solo: crate::transport::Solo,
        reduced: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
        fail_at: Option<usize>,
    }

    // SAFETY: delegates to `Solo`.
    unsafe impl Transport for Recorder {
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            1
        }
        fn layout(&self) -> &Layout {
            self.solo.layout()
        }
        fn grads_ptr(&mut self) -> *mut f32 {
            self.solo.grads_ptr()
        }
        fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
            if self.fail_at == Some(bucket) {
                return Err(Error::PeerFailed { rank: 1, phase: "reduce".into(), step: at.step });
            }
            self.reduced.lock().unwrap().push(bucket);
            self.solo.allreduce_bucket(at, bucket)
        }
        fn agree(&mut self, at: StepId, local: crate::LocalScalars) -> Result<crate::HealthTable, Error> {
            self.solo.agree(at, local)
        }
        fn broadcast_from(&mut self, at: StepId, root: usize, data: &mut [f32]) -> Result<(), Error> {
            self.solo.broadcast_from(at, root, data)
        }
        fn mark_failed(&mut self) {}
    }

    fn recorder(fail_at: Option<usize>) -> Recorder {
        Recorder {
            solo: crate::transport::Solo::new(layout(), Default::default()),
            reduced: Default::default(),
            fail_at,
        }
    }

    /// A backward that writes `p + 1` into every parameter, last first.
    fn fill(g: &mut ParamGrads<'_>, n: usize, mut between: impl FnMut(usize)) {
        for p in (0..n).rev() {
            let mut v = g.take(p);
            v.iter_mut().for_each(|x| *x += p as f32 + 1.0);
            g.release(p, v);
            between(p);
        }
    }

    #[test]
    fn overlapped_reduces_run_while_backward_goes_on_and_match_the_serial_path() {
        let n = layout().slots.len();
        let nb = layout().buckets.len();
        assert!(nb >= 3, "the test needs several buckets");
        let mut results = Vec::new();
        for overlap in [false, true] {
            let mut bus = recorder(None);
            bus.grads().fill(7.0); // zeroed by backward_and_reduce
            let reduced = bus.reduced.clone();
            let mut seen_during_backward = Vec::new();
            let mut after = Vec::new();
            let mut planted = |p: usize, g: &mut [f32]| g[0] = -(p as f32);
            backward_and_reduce(
                &mut bus,
                StepId::default(),
                overlap,
                &mut planted,
                |g| {
                    fill(g, n, |p| {
                        let b = layout().slots[p].bucket;
                        if overlap && layout().buckets[b].params.iter().all(|&q| q >= p) {
                            // Bucket b just closed: the reducer must get to it while backward
                            // waits here (no timing assumption: wait for the event itself).
                            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                            while !reduced.lock().unwrap().contains(&b) {
                                assert!(
                                    std::time::Instant::now() < deadline,
                                    "bucket {b} was not reduced during backward"
                                );
                                std::thread::yield_now();
                            }
                            seen_during_backward.push(b);
                        }
                    })
                },
                &mut |b| after.push(b),
            )
            .unwrap();
            assert_eq!(*bus.reduced.lock().unwrap(), (0..nb).collect::<Vec<_>>());
            assert_eq!(after, (0..nb).collect::<Vec<_>>());
            if overlap {
                assert_eq!(seen_during_backward, (0..nb).collect::<Vec<_>>());
            }
            results.push(bus.grads().to_vec());
        }
        assert_eq!(results[0], results[1]);
        for s in &layout().slots {
            let g = &results[0][s.range()];
            assert_eq!(g[0], -(s.param as f32), "finalize ran on {}", s.name);
            assert!(g[1..].iter().all(|&x| x == s.param as f32 + 1.0), "{}", s.name);
        }
    }

    #[test]
    fn a_reduce_error_waits_for_backward_then_returns() {
        let n = layout().slots.len();
        let mut bus = recorder(Some(1));
        let mut finished = false;
        let r = backward_and_reduce(
            &mut bus,
            StepId::default(),
            true,
            &mut |_, _| {},
            |g| {
                fill(g, n, |_| {});
                finished = true;
            },
            &mut |_| {},
        );
        assert!(matches!(r, Err(Error::PeerFailed { .. })), "{r:?}");
        assert!(finished);
        assert_eq!(*bus.reduced.lock().unwrap(), vec![0], "nothing reduced after the failed bucket");
    }

    #[test]
    #[should_panic(expected = "backward blew up")]
    fn a_panic_in_backward_reaches_the_caller() {
        let mut bus = recorder(None);
        let _ = backward_and_reduce(
            &mut bus,
            StepId::default(),
            true,
            &mut |_, _| {},
            |_g| panic!("backward blew up"),
            &mut |_| {},
        );
    }

    #[test]
    #[should_panic(expected = "not its gradient slot")]
    fn releasing_another_view_panics() {
        let layout = layout();
        let mut flat = vec![0.0f32; layout.len];
        let mut g = ParamGrads::new(&mut flat, &layout);
        let v = g.take(1);
        g.release(2, v);
    }

    #[test]
    #[should_panic(expected = "taken twice")]
    fn taking_twice_panics() {
        let layout = layout();
        let mut flat = vec![0.0f32; layout.len];
        let mut g = ParamGrads::new(&mut flat, &layout);
        let _ = g.take(1);
        let _ = g.take(1);
    }
}
