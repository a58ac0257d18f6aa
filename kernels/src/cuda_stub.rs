//! The CUDA backend's stand-in when gradbus-kernels is built without the `cuda` feature: the same
//! names and signatures as `cuda/mod.rs`, so callers compile unchanged, and every way to get a
//! [`Gpu`] returns [`Error::NotCompiledWithCuda`]. No value of `Gpu` can exist in this build, so its
//! methods are never reached.

use std::marker::PhantomData;

use crate::health::Health;
use crate::Error;

/// A device buffer (never constructed without CUDA).
pub struct CudaSlice<T>(PhantomData<T>, Never);

/// Device memory that a kernel reads.
pub trait DevicePtr<T> {}
/// Device memory that a kernel writes.
pub trait DevicePtrMut<T> {}

/// An element type the backend moves between host and device.
pub trait Elem: Copy + Default {}
impl Elem for f32 {}
/// bf16, as its raw 16 bits (the high half of an f32).
impl Elem for u16 {}
/// Raw 64-bit words (health rows).
impl Elem for u64 {}

/// No value: makes `Gpu` and `CudaSlice` uninhabited.
enum Never {}

/// False: this build cannot use a driver.
pub fn driver_present() -> bool {
    false
}

/// Always [`Error::NotCompiledWithCuda`].
pub fn probe() -> Result<usize, Error> {
    Err(Error::NotCompiledWithCuda)
}

/// Always [`Error::NotCompiledWithCuda`].
pub fn compile_sources(_arch: &str) -> Result<Vec<(&'static str, String)>, Error> {
    Err(Error::NotCompiledWithCuda)
}

/// One CUDA device (never constructed without CUDA).
pub struct Gpu(Never);

impl Gpu {
    /// Always [`Error::NotCompiledWithCuda`].
    pub fn new(_ordinal: usize) -> Result<Gpu, Error> {
        Err(Error::NotCompiledWithCuda)
    }
    /// The device's name.
    pub fn name(&self) -> Result<String, Error> {
        match self.0 {}
    }
    /// Wait for everything enqueued.
    pub fn synchronize(&self) -> Result<(), Error> {
        match self.0 {}
    }
    /// `n` zeros on the device.
    pub fn zeros<T: Elem>(&self, _n: usize) -> Result<CudaSlice<T>, Error> {
        match self.0 {}
    }
    /// A device copy of `x`.
    pub fn upload<T: Elem>(&self, _x: &[T]) -> Result<CudaSlice<T>, Error> {
        match self.0 {}
    }
    /// A host copy of `x`.
    pub fn download<T: Elem, S: DevicePtr<T>>(&self, _x: &S) -> Result<Vec<T>, Error> {
        match self.0 {}
    }
    /// Device-to-device copy.
    pub fn copy<T: Elem, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, _src: &S, _dst: &mut D) -> Result<(), Error> {
        match self.0 {}
    }
    /// The fused health scan (f32).
    pub fn health_scan<S: DevicePtr<f32>>(&self, _x: &S) -> Result<Health, Error> {
        match self.0 {}
    }
    /// The health scan of bf16 words.
    pub fn health_scan_bf16<S: DevicePtr<u16>>(&self, _x: &S) -> Result<Health, Error> {
        match self.0 {}
    }
    /// `x[i] *= s` (f32).
    pub fn scale<D: DevicePtrMut<f32>>(&self, _x: &mut D, _s: f32) -> Result<(), Error> {
        match self.0 {}
    }
    /// `x[i] *= s` (bf16 words).
    pub fn scale_bf16<D: DevicePtrMut<u16>>(&self, _x: &mut D, _s: f32) -> Result<(), Error> {
        match self.0 {}
    }
    /// AdamW.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update<P, G, M, V>(
        &self,
        _params: &mut P,
        _grads: &G,
        _m: &mut M,
        _v: &mut V,
        _lr: f32,
        _beta1: f32,
        _beta2: f32,
        _eps: f32,
        _weight_decay: f32,
        _t: u64,
    ) -> Result<(), Error>
    where
        P: DevicePtrMut<f32>,
        G: DevicePtr<f32>,
        M: DevicePtrMut<f32>,
        V: DevicePtrMut<f32>,
    {
        match self.0 {}
    }
}

impl<T> DevicePtr<T> for CudaSlice<T> {}
impl<T> DevicePtrMut<T> for CudaSlice<T> {}
