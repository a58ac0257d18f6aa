//! A device backend's way onto a host transport: [`Staged`] owns the device copy of this rank's
//! gradient buffer beside any host [`Transport`] (the shared-memory bus when ranks share a GPU,
//! `Solo`, MPI); its [`GradBus::backward_and_reduce`] runs backward on the device buffer, then
//! takes each bucket to the host, all-reduces it there (the transport tallies every rank's health
//! on the way, as on the CPU) and writes the reduced bucket back to the device, where the optimizer
//! finds it ([`GradBus::reduced_grads`]). Written for any [`Backend`], so the CPU tests run the very
//! same code with `Cpu` as the device; the CUDA backend takes it as `GpuBus::Staged`.
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

use std::ops::Range;

use gradbus_kernels::backend::Backend;

use super::{FlatGrads, GradBus, GradSlots};
use crate::transport::Transport;
use crate::verdict::StepId;
use crate::Error;

/// The bus of a device backend `B` over a host transport: the device buffer (`layout().len`
/// floats of backend `B`) plus the host transport that reduces them.
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

/// The gradient slots of a device backend's backward: the device buffer's parameter views, each
/// handed to `finalize` when backward releases it.
pub struct DeviceSlots<'g, B: Backend> {
    flat: FlatGrads<'g, B>,
    finalize: &'g mut (dyn FnMut(usize, B::ViewMut<'_>) + Send),
}

impl<'g, B: Backend> DeviceSlots<'g, B> {
    /// Views of `ranges` (one per parameter, forward order) of the device buffer `buf`.
    pub fn new(
        be: &B,
        buf: &'g mut B::Buf,
        ranges: &[Range<usize>],
        finalize: &'g mut (dyn FnMut(usize, B::ViewMut<'_>) + Send),
    ) -> DeviceSlots<'g, B> {
        DeviceSlots { flat: FlatGrads::new(be, buf, ranges), finalize }
    }
}

impl<'g, B: Backend> GradSlots<B> for DeviceSlots<'g, B> {
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

impl<B: Backend> GradBus<B> for Staged<B> {
    type Slots<'g> = DeviceSlots<'g, B>;
    /// Zero the device gradients, run `backward` on them (each parameter's final gradient to
    /// `finalize`), then every bucket in order to the host, reduced there, back to the device,
    /// `after_bucket(b)`.
    fn backward_and_reduce<F>(
        &mut self,
        be: &B,
        at: StepId,
        _overlap: bool,
        finalize: &mut (dyn FnMut(usize, B::ViewMut<'_>) + Send),
        backward: F,
        after_bucket: &mut dyn FnMut(usize),
    ) -> Result<(), Error>
    where
        F: FnOnce(&mut DeviceSlots<'_, B>) + Send,
    {
        be.fill(be.all_mut(&mut self.dev), 0.0);
        backward(&mut DeviceSlots::new(be, &mut self.dev, &self.slots, finalize));
        let buckets: Vec<Range<usize>> = self.inner.layout().buckets.iter().map(|b| b.range.clone()).collect();
        for (b, r) in buckets.into_iter().enumerate() {
            let host = be.to_host(be.view(&self.dev, r.clone()));
            self.inner.grads()[r.clone()].copy_from_slice(&host);
            self.inner.allreduce_bucket(at, b)?;
            be.write(be.view_mut(&mut self.dev, r.clone()), &self.inner.grads()[r]);
            after_bucket(b);
        }
        Ok(())
    }
    /// The reduced gradients on the device.
    fn reduced_grads(&mut self, be: &B) -> B::ViewMut<'_> {
        be.all_mut(&mut self.dev)
    }
    fn transport(&self) -> &dyn Transport {
        &*self.inner
    }
    fn transport_mut(&mut self) -> &mut dyn Transport {
        &mut *self.inner
    }
}

#[cfg(test)]
mod tests {
    use gradbus_kernels::backend::Cpu;

    use super::*;
    use crate::agreement::LocalScalars;
    use crate::grads::HostBus;
    use crate::layout::{Layout, ParamSpec};
    use crate::transport::Solo;

    /// Backward over `n` parameters, last first, on `bus`: the parameters in the order they were
    /// finalized and the buckets in the order they were reduced. The same code drives every
    /// `GradBus<Cpu>`.
    fn run<G: GradBus<Cpu>>(bus: &mut G, n: usize, at: StepId) -> (Vec<usize>, Vec<usize>) {
        let (mut seen, mut buckets) = (Vec::new(), Vec::new());
        let mut fin = |p: usize, _: &mut [f32]| seen.push(p);
        let backward = |g: &mut G::Slots<'_>| {
            for p in (0..n).rev() {
                let mut v = g.take(p);
                for (i, x) in <G::Slots<'_> as GradSlots<Cpu>>::view_mut(&mut v).iter_mut().enumerate() {
                    *x += (p * 1000 + i) as f32 * 0.001 - 0.37;
                }
                g.release(p, v);
            }
        };
        bus.backward_and_reduce(&Cpu, at, false, &mut fin, backward, &mut |b| buckets.push(b)).unwrap();
        (seen, buckets)
    }

    /// The staged path with the CPU as its "device" gives the zero-copy CPU path's bits: the
    /// same reduced gradients, the same agreed table, each parameter finalized once, every bucket
    /// reported after its reduce.
    #[test]
    fn staged_reduce_gives_the_host_paths_bits() {
        let specs: Vec<ParamSpec> = (0..7).map(|i| ParamSpec::new(format!("p{i}"), 37 * (i + 1))).collect();
        let layout = Layout::new(&specs, 256);
        let at = StepId { step: 3, minibatch: 1, attempt: 0 };
        let solo = || Box::new(Solo::new(layout.clone(), Default::default()));
        let mut host = HostBus::new(solo());
        let (seen_host, buckets_host) = run(&mut host, specs.len(), at);
        let mut bus = Staged::<Cpu>::new(&Cpu, solo());
        let (seen, buckets) = run(&mut bus, specs.len(), at);
        assert_eq!(seen, seen_host, "each parameter finalized once, in backward's order");
        assert_eq!(buckets, buckets_host, "every bucket reported after its reduce");
        let want: Vec<u32> = host.reduced_grads(&Cpu).iter().map(|x| x.to_bits()).collect();
        let got: Vec<u32> = bus.reduced_grads(&Cpu).iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want, "the device buffer holds the transport's reduced bits");
        let host_copy: Vec<u32> = bus.transport_mut().grads().iter().map(|x| x.to_bits()).collect();
        assert_eq!(host_copy, want, "so does the transport's host buffer (dumps read it)");
        let t1 = host.transport_mut().agree(at, LocalScalars::default()).unwrap();
        let t2 = bus.transport_mut().agree(at, LocalScalars::default()).unwrap();
        assert_eq!(format!("{t1:?}"), format!("{t2:?}"), "the same agreed table");
    }
}
