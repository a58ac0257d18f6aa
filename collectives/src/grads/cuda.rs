//! The CUDA backend's bus (feature `cuda`), one of two, chosen where it is opened: with a GPU per
//! rank, NCCL, where the gradients stay on the device (backward writes the transport's device
//! buffer, which is scanned and all-reduced where it is); with ranks sharing a GPU, [`Staged`]
//! through the host transport (the shared-memory bus). An enum, matched on every call: each variant
//! is its own type, so no call asks at run time what a transport is.

use gradbus_kernels::backend::Backend;
use gradbus_kernels::cuda::{CudaViewMut, Gpu};

use super::{BusBackend, DeviceSlots, GradBus, Staged};
use crate::nccl::NcclTransport;
use crate::transport::Transport;
use crate::verdict::StepId;
use crate::Error;

/// Where the CUDA backend's gradients go.
pub enum GpuBus {
    /// NCCL over every rank's own GPU: the buckets are reduced on the device.
    Nccl(NcclTransport),
    /// The host transport, each bucket staged through the host (ranks sharing a GPU).
    Staged(Staged<Gpu>),
}

impl GradBus<Gpu> for GpuBus {
    type Slots<'g> = DeviceSlots<'g, Gpu>;
    fn backward_and_reduce<F>(
        &mut self,
        be: &Gpu,
        at: StepId,
        overlap: bool,
        finalize: &mut (dyn FnMut(usize, CudaViewMut<'_, f32>) + Send),
        backward: F,
        after_bucket: &mut dyn FnMut(usize),
    ) -> Result<(), Error>
    where
        F: FnOnce(&mut DeviceSlots<'_, Gpu>) + Send,
    {
        let t = match self {
            GpuBus::Staged(s) => return s.backward_and_reduce(be, at, overlap, finalize, backward, after_bucket),
            GpuBus::Nccl(t) => t,
        };
        let slots: Vec<_> = t.layout().slots.iter().map(|s| s.range()).collect();
        let nb = t.layout().buckets.len();
        {
            let dev = t.device_grads();
            Backend::fill(be, dev.slice_mut(..), 0.0);
            backward(&mut DeviceSlots::new(be, dev, &slots, finalize));
        }
        // The transport scans and reduces on its own streams: this backend's work first.
        be.synchronize()?;
        for b in 0..nb {
            t.allreduce_bucket(at, b)?;
            after_bucket(b);
        }
        Ok(())
    }
    fn reduced_grads(&mut self, be: &Gpu) -> CudaViewMut<'_, f32> {
        match self {
            GpuBus::Nccl(t) => t.device_grads().slice_mut(..),
            GpuBus::Staged(s) => s.reduced_grads(be),
        }
    }
    fn transport(&self) -> &dyn Transport {
        match self {
            GpuBus::Nccl(t) => t,
            GpuBus::Staged(s) => s.transport(),
        }
    }
    fn transport_mut(&mut self) -> &mut dyn Transport {
        match self {
            GpuBus::Nccl(t) => t,
            GpuBus::Staged(s) => s.transport_mut(),
        }
    }
}

impl BusBackend for Gpu {
    type Bus = GpuBus;
}
