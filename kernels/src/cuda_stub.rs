//! The CUDA backend's stand-in when gradbus-kernels is built without the `cuda` feature: the entry
//! points of `cuda/mod.rs` (`driver_present`, `probe`, `compile_sources`, `compile_cubins`, `Gpu::new`), so callers
//! can ask for a GPU without a `cfg` and get [`Error::NotCompiledWithCuda`]. No value of `Gpu` can
//! exist in this build; its device ops (every op on device buffers) exist only with the feature,
//! where the code that calls them is compiled.

use crate::Error;

/// No value: makes `Gpu` uninhabited.
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

/// Always [`Error::NotCompiledWithCuda`].
pub fn compile_cubins(_arch: &str) -> Result<Vec<(&'static str, usize)>, Error> {
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
}
