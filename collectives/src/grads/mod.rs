//! The gradients' way from backward onto the bus, typed end to end: the seam between a backend's
//! backward (which writes gradients) and the transport (which all-reduces them), in one place.
//!
//! Each backend names the bus its gradients travel on ([`BusBackend::Bus`]), and that bus is a
//! [`GradBus`] of that backend: it hands backward the gradient buffer as [`GradSlots`], all-reduces
//! each bucket once its last parameter is given back, and hands the optimizer the reduced
//! gradients. The pairings are types, chosen where the bus is opened (the worker's wiring), so no
//! call on the way asks at run time what kind of transport it holds:
//!
//! ```text
//!  Gpt::backward(be, .., grads: &mut G)                  G: GradSlots<B>   (worker/src/model.rs)
//!    take(p) -> accumulate into the slot -> release(p)   a parameter's gradient is final
//!      ^
//!  B::Bus: GradBus<B>::backward_and_reduce(be, .., backward)               (this module)
//!    Cpu -> HostBus          ParamGrads over the transport's own buffer (the shm segment: zero
//!                            copy); bucket b to Transport::allreduce_bucket as soon as its last
//!                            parameter is released, overlapped with backward or after it (host.rs)
//!    Gpu -> GpuBus::Nccl     DeviceSlots over NcclTransport::device_grads; every bucket reduced
//!                            on the device after backward (cuda.rs)
//!           GpuBus::Staged   DeviceSlots over Staged's device buffer; every bucket to the host,
//!                            reduced by the host transport, back to the device (staged.rs)
//!      v
//!  GradBus::transport_mut().agree(..) -> HealthTable;  GradBus::reduced_grads(be) -> optimizer
//! ```
//!
//! Invariants: every bus reduces buckets #0, #1, ... in order on every rank, and gives the same
//! bits as the host path from the same local gradients (staged.rs's test); a bucket is reduced
//! only after backward gave back every view into it.

mod host;
mod staged;

#[cfg(feature = "cuda")]
mod cuda;

use std::ops::Range;

use gradbus_kernels::backend::Backend;

use crate::transport::Transport;
use crate::verdict::StepId;
use crate::Error;

#[cfg(feature = "cuda")]
pub use cuda::GpuBus;
pub use host::{backward_and_reduce, GradMut, HostBus, ParamGrads};
pub use staged::{DeviceSlots, Staged};

/// The gradient buffer as backward sees it: each parameter's gradient taken once, accumulated
/// into, and given back as soon as it is final, so whoever owns the buffer can reduce a bucket
/// while backward goes on.
pub trait GradSlots<B: Backend> {
    /// One parameter's gradient while backward holds it.
    type Slot: Send;
    /// Parameter `p`'s gradient (forward-order index). Panics when taken twice.
    fn take(&mut self, p: usize) -> Self::Slot;
    /// The slot as a view to accumulate into.
    fn view_mut<'s>(slot: &'s mut Self::Slot) -> B::ViewMut<'s>;
    /// The slot as a view to read.
    fn view<'s>(slot: &'s Self::Slot) -> B::View<'s>;
    /// Give back parameter `p`'s gradient: it is final.
    fn release(&mut self, p: usize, slot: Self::Slot);
}

/// [`GradSlots`] over a plain buffer of any backend (the trace's scratch gradients, a device
/// bus's buffer): nothing waits for the releases.
pub struct FlatGrads<'a, B: Backend> {
    views: Vec<Option<B::ViewMut<'a>>>,
}

impl<'a, B: Backend> FlatGrads<'a, B> {
    /// Views of `ranges` (one per parameter, forward order) of `buf`.
    pub fn new(be: &B, buf: &'a mut B::Buf, ranges: &[Range<usize>]) -> FlatGrads<'a, B> {
        FlatGrads { views: be.split_mut(buf, ranges).into_iter().map(Some).collect() }
    }
}

impl<'a, B: Backend> GradSlots<B> for FlatGrads<'a, B> {
    type Slot = B::ViewMut<'a>;
    fn take(&mut self, p: usize) -> B::ViewMut<'a> {
        self.views[p].take().unwrap_or_else(|| panic!("gradient of parameter {p} taken twice"))
    }
    fn view_mut<'s>(slot: &'s mut B::ViewMut<'a>) -> B::ViewMut<'s> {
        B::reborrow_mut(slot)
    }
    fn view<'s>(slot: &'s B::ViewMut<'a>) -> B::View<'s> {
        B::reborrow(slot)
    }
    fn release(&mut self, _p: usize, slot: B::ViewMut<'a>) {
        drop(slot);
    }
}

/// Where backend `B`'s gradients go: the buffer backward writes, the bucket reduces, and the
/// transport that reduces them and runs the agreement.
pub trait GradBus<B: Backend> {
    /// The gradient buffer as backward sees it.
    type Slots<'g>: GradSlots<B>;
    /// Zero the gradients, run `backward` on them and all-reduce every bucket in order (overlapped
    /// with backward when `overlap` and the bus can), calling `finalize(p, grad)` on each
    /// parameter's final gradient before it can be reduced and `after_bucket(b)` after bucket
    /// `b`'s reduce. On a reduce error the remaining buckets are not reduced.
    fn backward_and_reduce<F>(
        &mut self,
        be: &B,
        at: StepId,
        overlap: bool,
        finalize: &mut (dyn FnMut(usize, B::ViewMut<'_>) + Send),
        backward: F,
        after_bucket: &mut dyn FnMut(usize),
    ) -> Result<(), Error>
    where
        F: FnOnce(&mut Self::Slots<'_>) + Send;
    /// The reduced gradients (after the transport's `agree`), where the optimizer reads them.
    fn reduced_grads(&mut self, be: &B) -> B::ViewMut<'_>;
    /// The transport that reduces the buckets and runs the agreement.
    fn transport(&self) -> &dyn Transport;
    /// The same, mutable (`agree`, `mark_failed`).
    fn transport_mut(&mut self) -> &mut dyn Transport;
}

/// A backend paired with the bus its gradients travel on: the pairing is this associated type,
/// so the step loop, generic over the backend, reaches the bus through typed calls only.
pub trait BusBackend: Backend {
    /// The bus: [`HostBus`] for the CPU, `GpuBus` for the CUDA backend (feature `cuda`).
    type Bus: GradBus<Self>;
}
