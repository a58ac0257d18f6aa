//! A device backend's way onto a host transport: [`Staged`] owns the device copy of this rank's
//! gradient buffer beside any [`Transport`] (the shared-memory bus when ranks share a GPU, `Solo`,
//! MPI, NCCL), and [`staged_backward_and_reduce`] runs backward on it, then takes each bucket to the
//! host, all-reduces it there (the transport tallies every rank's health on the way, as on the CPU)
//! and writes the reduced bucket back to the device, where the optimizer finds it
//! ([`staged_reduced_grads`]). Written for any [`Backend`], so the CPU tests run the very same
//! code with `Cpu` as the device; `BusBackend for Gpu` (feature `cuda`) is these two functions,
//! except on NCCL, where the gradients stay on the device.
//!
//! ```text
//!  backward (device)  ->  for each bucket b, in order:
//!                           device bucket b  --to_host-->  transport's host buffer, range of b
//!                           transport.allreduce_bucket(b)        (sum in rank order + tallies)
//!                           host range of b  --write-->    device bucket b
//!                           after_bucket(b)
//!  agree (host, the transport's)  ->  optimizer on the device buffer
//! ```
//!
//! Invariants: the reduced gradients are the transport's bits (copies only), so a run gives the
//! same verdicts, reports and dumps as the CPU path from the same local gradients. Backward and the
//! reduces do not overlap here (every bucket after backward): `overlap` is accepted and ignored. The
//! transport's host buffer holds the reduced gradients after the reduces too (dumps read it). For
//! the CUDA backend, `to_host` copies through page-locked memory (`Gpu::download_f32`).

use std::any::Any;
use std::ops::Range;

use gradbus_kernels::backend::{Backend, FlatGrads, GradSlots};

use crate::agreement::LocalReport;
use crate::layout::Layout;
use crate::transport::Transport;
use crate::verdict::{HealthTable, StepId};
use crate::Error;

/// A transport whose gradients live on a device: the device buffer (`layout().len` floats of
/// backend `B`) plus the host transport that reduces them.
pub struct Staged<B: Backend> {
    inner: Box<dyn Transport>,
    dev: B::Buf,
    slots: Vec<Range<usize>>,
}

impl<B: Backend> Staged<B> {
    /// `inner`'s layout, its gradients on `be`'s device (zeros).
    pub fn new(be: &B, inner: Box<dyn Transport>) -> Staged<B> {
        let layout = inner.layout();
        let slots = layout.slots.iter().map(|s| s.range()).collect();
        Staged { dev: be.zeros(layout.len), slots, inner }
    }
}

// SAFETY: every method delegates to `inner`, whose contract holds: `grads_ptr` is `inner`'s buffer,
// which `Staged` never moves or frees while it lives.
unsafe impl<B: Backend> Transport for Staged<B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn layout(&self) -> &Layout {
        self.inner.layout()
    }
    fn grads_ptr(&mut self) -> *mut f32 {
        self.inner.grads_ptr()
    }
    /// The host side only: the bucket's host range as it stands (`staged_backward_and_reduce`
    /// brings the device's bucket there first).
    fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
        self.inner.allreduce_bucket(at, bucket)
    }
    fn agree(&mut self, at: StepId, local: LocalReport) -> Result<HealthTable, Error> {
        self.inner.agree(at, local)
    }
    fn health_chunks(&self) -> usize {
        self.inner.health_chunks()
    }
    fn set_inside_reduce_hook(&mut self, hook: Box<dyn FnMut(StepId, usize) + Send + Sync>) {
        self.inner.set_inside_reduce_hook(hook)
    }
    fn publish(&mut self, progress: crate::transport::Progress) {
        self.inner.publish(progress)
    }
    fn mark_failed(&mut self) {
        self.inner.mark_failed()
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn Any> {
        Some(self)
    }
}

/// The gradient slots of a staged backward: the device buffer's parameter views, each handed to
/// `finalize` when backward releases it.
pub struct StagedSlots<'g, B: Backend> {
    flat: FlatGrads<'g, B>,
    finalize: &'g mut (dyn FnMut(usize, B::ViewMut<'_>) + Send),
}

impl<'g, B: Backend> GradSlots<B> for StagedSlots<'g, B> {
    type Slot = B::ViewMut<'g>;
    fn take(&mut self, p: usize) -> B::ViewMut<'g> {
        self.flat.take(p)
    }
    fn view_mut<'s>(slot: &'s mut B::ViewMut<'g>) -> B::ViewMut<'s> {
        B::reborrow_mut(slot)
    }
    fn view<'s>(slot: &'s B::ViewMut<'g>) -> B::View<'s> {
        B::reborrow(slot)
    }
    fn release(&mut self, p: usize, mut slot: B::ViewMut<'g>) {
        (self.finalize)(p, B::reborrow_mut(&mut slot));
        self.flat.release(p, slot);
    }
}

/// The [`Staged`] transport behind `bus`; panics (a wiring bug, not an input) when `bus` is not one.
fn staged<B: Backend>(bus: &mut dyn Transport) -> &mut Staged<B> {
    bus.as_any_mut()
        .and_then(|a| a.downcast_mut::<Staged<B>>())
        .expect("a device backend reduces through a `Staged` transport (collectives::staged)")
}

/// `BusBackend::backward_and_reduce` for a device backend `be` on a [`Staged`] `bus`: zero the
/// device gradients, run `backward` on them (each parameter's final gradient to `finalize`), then
/// every bucket in order to the host, reduced there, back to the device, `after_bucket(b)`.
pub fn staged_backward_and_reduce<B: Backend, F>(
    be: &B,
    bus: &mut dyn Transport,
    at: StepId,
    finalize: &mut (dyn FnMut(usize, B::ViewMut<'_>) + Send),
    backward: F,
    after_bucket: &mut dyn FnMut(usize),
) -> Result<(), Error>
where
    F: for<'g> FnOnce(&mut StagedSlots<'g, B>),
{
    let s = staged::<B>(bus);
    be.fill(be.all_mut(&mut s.dev), 0.0);
    {
        let mut slots = StagedSlots { flat: FlatGrads::new(be, &mut s.dev, &s.slots), finalize };
        backward(&mut slots);
    }
    let buckets: Vec<Range<usize>> = s.inner.layout().buckets.iter().map(|b| b.range.clone()).collect();
    for (b, r) in buckets.into_iter().enumerate() {
        let host = be.to_host(be.view(&s.dev, r.clone()));
        s.inner.grads()[r.clone()].copy_from_slice(&host);
        s.inner.allreduce_bucket(at, b)?;
        be.write(be.view_mut(&mut s.dev, r.clone()), &s.inner.grads()[r]);
        after_bucket(b);
    }
    Ok(())
}

/// `BusBackend::reduced_grads` for a device backend: the reduced gradients on the device.
pub fn staged_reduced_grads<'a, B: Backend>(be: &B, bus: &'a mut dyn Transport) -> B::ViewMut<'a> {
    let s = staged::<B>(bus);
    be.all_mut(&mut s.dev)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA backend's bus: on an NCCL transport (a GPU per rank) the gradients stay on the
    //! device - backward writes the transport's device buffer, which is scanned and all-reduced
    //! where it is; on any other transport (ranks sharing a GPU: the shared-memory bus) they are
    //! staged through the host (module doc above).
    use gradbus_kernels::backend::FlatGrads;
    use gradbus_kernels::cuda::{CudaViewMut, Gpu};

    use super::{staged_backward_and_reduce, staged_reduced_grads, StagedSlots};
    use crate::nccl::NcclTransport;
    use crate::overlap::BusBackend;
    use crate::transport::Transport;
    use crate::verdict::StepId;
    use crate::Error;

    fn nccl(bus: &mut dyn Transport) -> Option<&mut NcclTransport> {
        bus.as_any_mut().and_then(|a| a.downcast_mut::<NcclTransport>())
    }

    impl BusBackend for Gpu {
        type Slots<'g> = StagedSlots<'g, Gpu>;
        fn backward_and_reduce<F>(
            &self,
            bus: &mut dyn Transport,
            at: StepId,
            _overlap: bool,
            finalize: &mut (dyn FnMut(usize, CudaViewMut<'_, f32>) + Send),
            backward: F,
            after_bucket: &mut dyn FnMut(usize),
        ) -> Result<(), Error>
        where
            F: FnOnce(&mut StagedSlots<'_, Gpu>) + Send,
        {
            let Some(t) = nccl(bus) else {
                return staged_backward_and_reduce(self, bus, at, finalize, backward, after_bucket);
            };
            let slots: Vec<_> = t.layout().slots.iter().map(|s| s.range()).collect();
            let nb = t.layout().buckets.len();
            {
                let dev = t.device_grads();
                <Gpu as gradbus_kernels::backend::Backend>::fill(self, dev.slice_mut(..), 0.0);
                let mut g = StagedSlots { flat: FlatGrads::new(self, dev, &slots), finalize };
                backward(&mut g);
            }
            // The transport scans and reduces on its own streams: this backend's work first.
            self.synchronize()?;
            for b in 0..nb {
                t.allreduce_bucket(at, b)?;
                after_bucket(b);
            }
            Ok(())
        }
        fn reduced_grads<'a>(&self, bus: &'a mut dyn Transport) -> CudaViewMut<'a, f32> {
            if nccl(bus).is_some() {
                return nccl(bus).expect("checked just above").device_grads().slice_mut(..);
            }
            staged_reduced_grads(self, bus)
        }
    }
}

#[cfg(test)]
mod tests {
    use gradbus_kernels::backend::Cpu;

    use super::*;
    use crate::layout::ParamSpec;
    use crate::overlap::backward_and_reduce;
    use crate::transport::Solo;

    /// The staged path with the CPU as its "device" gives the zero-copy CPU path's bits: the
    /// same reduced gradients, the same agreed table, each parameter finalized once, every bucket
    /// reported after its reduce.
    #[test]
    fn staged_reduce_gives_the_host_paths_bits() {
        let specs: Vec<ParamSpec> = (0..7).map(|i| ParamSpec::new(format!("p{i}"), 37 * (i + 1))).collect();
        let layout = Layout::new(&specs, 256);
        let at = StepId { step: 3, minibatch: 1, attempt: 0 };
        let fill = |p: usize, g: &mut [f32]| {
            for (i, x) in g.iter_mut().enumerate() {
                *x += (p * 1000 + i) as f32 * 0.001 - 0.37;
            }
        };
        // The CPU's own path.
        let mut host = Solo::new(layout.clone(), Default::default());
        let mut seen_host = Vec::new();
        let mut fin = |p: usize, _: &mut [f32]| seen_host.push(p);
        let mut buckets_host = Vec::new();
        backward_and_reduce(
            &mut host,
            at,
            false,
            &mut fin,
            |g| {
                for p in (0..specs.len()).rev() {
                    let mut v = g.take(p);
                    fill(p, &mut v);
                    g.release(p, v);
                }
            },
            &mut |b| buckets_host.push(b),
        )
        .unwrap();
        // The staged path, Cpu as the device.
        let mut bus: Box<dyn Transport> =
            Box::new(Staged::<Cpu>::new(&Cpu, Box::new(Solo::new(layout.clone(), Default::default()))));
        let mut seen = Vec::new();
        let mut fin = |p: usize, _: &mut [f32]| seen.push(p);
        let mut buckets = Vec::new();
        staged_backward_and_reduce(
            &Cpu,
            &mut *bus,
            at,
            &mut fin,
            |g| {
                for p in (0..specs.len()).rev() {
                    let mut v = g.take(p);
                    fill(p, StagedSlots::<Cpu>::view_mut(&mut v));
                    g.release(p, v);
                }
            },
            &mut |b| buckets.push(b),
        )
        .unwrap();
        assert_eq!(seen, seen_host, "each parameter finalized once, in backward's order");
        assert_eq!(buckets, buckets_host, "every bucket reported after its reduce");
        let want: Vec<u32> = host.grads().iter().map(|x| x.to_bits()).collect();
        let got: Vec<u32> = staged_reduced_grads(&Cpu, &mut *bus).iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want, "the device buffer holds the transport's reduced bits");
        let host_copy: Vec<u32> = bus.grads().iter().map(|x| x.to_bits()).collect();
        assert_eq!(host_copy, want, "so does the transport's host buffer (dumps read it)");
        let (t1, t2) =
            (host.agree(at, LocalReport::default()).unwrap(), bus.agree(at, LocalReport::default()).unwrap());
        assert_eq!(format!("{t1:?}"), format!("{t2:?}"), "the same agreed table");
    }

    /// A device backend given a plain host transport is a wiring bug, named as such.
    #[test]
    #[should_panic(expected = "Staged")]
    fn a_plain_transport_is_refused_by_name() {
        let layout = Layout::new(&[ParamSpec::new("w", 8)], 64);
        let mut bus = Solo::new(layout, Default::default());
        let _ = staged_reduced_grads(&Cpu, &mut bus);
    }
}
