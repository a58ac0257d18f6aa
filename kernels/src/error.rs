//! The one error type of gradbus-kernels. The CPU kernels cannot fail (a length mismatch is a
//! caller bug and panics); the variants come from the CUDA backend, or from its stub when the crate
//! was built without the `cuda` feature, and from choosing an instruction-set level (`simd`). The
//! enum is the same in both builds, so callers can match on `NoCudaDriver` / `NotCompiledWithCuda`
//! without a `cfg`.

/// Errors of the CUDA backend and of the choice of instruction set.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This build has no CUDA backend.
    #[error("gradbus was built without CUDA (hint: rebuild with `--features cuda`)")]
    NotCompiledWithCuda,
    /// The CUDA driver library (libcuda) could not be loaded; nothing was called.
    #[error("no CUDA driver: {0} (hint: install the NVIDIA driver, or run on a machine with a GPU)")]
    NoCudaDriver(String),
    /// The driver loaded but reports no device, or not the one asked for.
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
    /// The NVRTC library (libnvrtc) could not be loaded, so the kernels cannot be compiled.
    #[error("no NVRTC: {0} (hint: install the CUDA runtime compiler libraries, e.g. cuda-nvrtc-12-x, and put them on LD_LIBRARY_PATH)")]
    NoNvrtc(String),
    /// The cuBLAS library (libcublas) could not be loaded, so the dense layers cannot run.
    #[error("no cuBLAS: {0} (hint: install the CUDA math libraries, e.g. the nvidia-cublas wheel or libcublas, and put them on LD_LIBRARY_PATH)")]
    NoCublas(String),
    /// NVRTC rejected a kernel source (a bug in `kernels/cuda/*.cu`, or an NVRTC too old for the GPU).
    #[error("NVRTC could not compile {file} for {arch}: {log}")]
    Compile {
        /// The `.cu` file.
        file: &'static str,
        /// The `--gpu-architecture` it was compiled for.
        arch: String,
        /// The compiler's log.
        log: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver: {what}: {msg}")]
    Driver {
        /// What was being done.
        what: String,
        /// The driver's error.
        msg: String,
    },
    /// Buffers that must have one length do not.
    #[error("{what}: length mismatch ({detail})")]
    Shape {
        /// The kernel.
        what: &'static str,
        /// The lengths.
        detail: String,
    },
    /// An instruction-set level that does not exist or that this CPU cannot run (`GRADBUS_SIMD`,
    /// `simd::with_level`).
    #[error("{what} (hint: {hint})")]
    Simd {
        /// What was asked for.
        what: String,
        /// What to do instead.
        hint: String,
    },
}
