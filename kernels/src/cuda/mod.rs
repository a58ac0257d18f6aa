//! The CUDA backend (feature `cuda`): every model op of [`crate::ops`], the GRPO loss and the
//! rollout's sampling on device buffers, as methods of a [`Gpu`] (one device, one stream, one
//! cuBLAS handle), each with its CPU twin's name and argument order. The kernels are the `.cu`
//! files of `kernels/cuda/` (listed in [`crate::cuda_grid::SOURCES`], launched with the shapes of
//! [`crate::cuda_grid`]); the dense layer's products are cuBLAS SGEMM. `backend.rs` implements
//! [`crate::backend::Backend`] with them. Without the feature, `cuda_stub.rs` keeps the entry
//! points and every constructor returns [`Error::NotCompiledWithCuda`].
//!
//! Invariants:
//! - No CUDA call is made before [`probe`] has found the driver library: cudarc (dynamic loading)
//!   panics when libcuda is missing, this module returns [`Error::NoCudaDriver`] instead. The same
//!   for libnvrtc ([`Error::NoNvrtc`]) before the first compile and libcublas ([`Error::NoCublas`])
//!   before the handle.
//! - The sources are compiled with NVRTC at first use, to machine code for the device's own
//!   architecture, once per device per process, with `--fmad=false`, IEEE division and square root and no flush-to-zero:
//!   every kernel does the CPU twin's f32 operations in the CPU twin's order, so the ops without
//!   `expf`/`logf` give the CPU's bits and the others differ only by CUDA's math library
//!   (`kernels/tests/cuda_twins/mod.rs` states each op's tolerance and why).
//! - Every result is repeatable bit for bit: no float atomics, reductions of a fixed shape that
//!   depends on the sizes only, cuBLAS in its default math mode on one stream (no TF32 unless
//!   [`Gpu::allow_tf32`]; cuBLAS gives the same bits run to run on one GPU model and toolkit).
//! - Kernels run on the `Gpu`'s stream; methods that return host values synchronize it, the others
//!   only enqueue. Lengths are checked before a launch ([`Error::Shape`]): a kernel never touches
//!   memory outside the buffers it is given.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceSlice, LaunchConfig, PushKernelArg};
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

mod backend;
pub use backend::DeviceIds;

use crate::cuda_grid::{self as grid, Launch, LOSS_STATS, SOURCES};
use crate::health::Health;
use crate::ops::adamw::AdamwScalars;
use crate::ops::grpo::{K3_CLAMP, LOGRATIO_CLAMP};
use crate::ops::{GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};
use crate::Error;

/// An element type the backend moves between host and device.
pub trait Elem: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + Unpin {}
impl Elem for f32 {}
/// bf16, as its raw 16 bits (the high half of an f32); also token ids.
impl Elem for u16 {}
/// Token ids, checksum lanes.
impl Elem for u32 {}
/// Raw 64-bit words (health rows, the sampler's RNG state).
impl Elem for u64 {}

/// True when the CUDA driver library can be loaded (nothing is called in it).
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the driver library's names and closes what
    // it opened; loading a shared library runs its initialisers, which is what makes it unsafe, and
    // libcuda's are meant to run in any process.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`, for libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn cublas_present() -> bool {
    // SAFETY: as in `driver_present`, for libcublas.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// The driver library, looked for without calling it. `Ok(number of devices)` when it loads and
/// initialises; [`Error::NoCudaDriver`] when libcuda cannot be loaded (never a panic).
pub fn probe() -> Result<usize, Error> {
    if !driver_present() {
        return Err(Error::NoCudaDriver("libcuda.so could not be loaded".into()));
    }
    let n = CudaContext::device_count().map_err(|e| Error::NoCudaDevice(format!("cuInit/cuDeviceGetCount: {e}")))?;
    Ok(n.max(0) as usize)
}

fn driver(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    let what = what.into();
    move |e| Error::Driver { what, msg: e.to_string() }
}

fn blas(what: &'static str) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error {
    move |e| Error::Driver { what: what.into(), msg: format!("cuBLAS: {e}") }
}

/// What NVRTC gives back: PTX (text; `arch` a virtual architecture, `compute_90`) or a CUBIN
/// (machine code; `arch` a real one, `sm_90`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    Ptx,
    Cubin,
}

/// NVRTC compile of one source for `arch`: no FMA contraction, IEEE division and square root,
/// denormals kept. The device loads CUBINs, so the driver never JIT-compiles PTX (a driver older
/// than the NVRTC would refuse its PTX; it loads the same toolkit major's machine code).
fn nvrtc(file: &'static str, src: &str, arch: &str, out: Output) -> Result<Vec<u8>, Error> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::{CStr, CString};
    let fail = |log: String| Error::Compile { file, arch: arch.into(), log };
    let options = [
        format!("--gpu-architecture={arch}"),
        "--fmad=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
        "--std=c++14".into(),
    ];
    let (c_src, c_name) =
        (CString::new(src).expect("a kernel source has no NUL"), CString::new(file).expect("a file name has no NUL"));
    let prog = result::create_program(&c_src, Some(&c_name)).map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?;
    // SAFETY: `prog` was created just above from strings that outlive it, is used only here, and is
    // destroyed once, below; the log and the outputs are copied out before that.
    let r = unsafe {
        match result::compile_program(prog, &options) {
            Err(e) => Err(result::get_program_log(prog)
                .map(|log| CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_else(|_| format!("{e:?}"))),
            Ok(()) if out == Output::Ptx => result::get_ptx(prog)
                .map(|p| CStr::from_ptr(p.as_ptr()).to_bytes().to_vec())
                .map_err(|e| format!("nvrtcGetPTX: {e:?}")),
            Ok(()) => {
                let mut n = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut n)
                    .result()
                    .and_then(|()| {
                        let mut bin = vec![0u8; n];
                        sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast()).result().map(|()| bin)
                    })
                    .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))
            }
        }
    };
    // SAFETY: as above; `prog` is not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    r.map_err(fail)
}

fn nvrtc_or_missing() -> Result<(), Error> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(Error::NoNvrtc("libnvrtc.so could not be loaded".into()))
    }
}

/// Compile every kernel source to PTX for `arch` (e.g. `compute_90`) and return (file, PTX) pairs.
/// Needs libnvrtc only - no driver, no GPU - so it checks the `.cu` files on any machine that has
/// NVRTC.
pub fn compile_sources(arch: &str) -> Result<Vec<(&'static str, String)>, Error> {
    nvrtc_or_missing()?;
    let ptx = |s: &crate::cuda_grid::Source| nvrtc(s.file, s.text, arch, Output::Ptx);
    SOURCES.iter().map(|s| Ok((s.file, String::from_utf8_lossy(&ptx(s)?).into_owned()))).collect()
}

/// Compile every kernel source to machine code for `arch` (e.g. `sm_90`), as the backend loads them,
/// and return (file, CUBIN size in bytes) pairs. Needs libnvrtc only.
pub fn compile_cubins(arch: &str) -> Result<Vec<(&'static str, usize)>, Error> {
    nvrtc_or_missing()?;
    SOURCES.iter().map(|s| Ok((s.file, nvrtc(s.file, s.text, arch, Output::Cubin)?.len()))).collect()
}

/// The compiled kernels of one device, by name.
type Kernels = HashMap<&'static str, CudaFunction>;

/// Compiled kernels per device ordinal (a handful of devices: a linear search).
static CACHE: Mutex<Vec<(usize, Arc<Kernels>)>> = Mutex::new(Vec::new());

fn kernels(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>, Error> {
    let ordinal = ctx.ordinal();
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, k)) = cache.iter().find(|(o, _)| *o == ordinal) {
        return Ok(k.clone());
    }
    nvrtc_or_missing()?;
    let (major, minor) = ctx.compute_capability().map_err(driver("cuDeviceGetAttribute(compute capability)"))?;
    let arch = format!("sm_{major}{minor}");
    let mut k = Kernels::new();
    for s in SOURCES {
        let cubin = cudarc::nvrtc::Ptx::from_binary(nvrtc(s.file, s.text, &arch, Output::Cubin)?);
        let module = ctx.load_module(cubin).map_err(driver(format!("cuModuleLoadData({})", s.file)))?;
        for &name in s.kernels {
            k.insert(name, module.load_function(name).map_err(driver(format!("cuModuleGetFunction({name})")))?);
        }
    }
    let k = Arc::new(k);
    cache.push((ordinal, k.clone()));
    Ok(k)
}

/// One CUDA device, the stream its kernels run on, and a cuBLAS handle on that stream.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Arc<Kernels>,
    blas: CudaBlas,
    /// The health scan's partial rows and counter, grown as needed (one scan at a time: the stream
    /// orders the scans that share it).
    scan_scratch: Mutex<Option<CudaSlice<u64>>>,
    /// Attention backward's dscore (B, NH, T, T), grown as needed.
    att_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Page-locked host memory that device-to-host copies go through (`download_f32`): the copy
    /// runs at the link's speed, where pageable memory is staged by the driver. Grown as needed.
    pinned: Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
}

/// Check that every `(what, have, need)` buffer is long enough.
fn lengths(op: &'static str, bufs: &[(&str, usize, usize)]) -> Result<(), Error> {
    match bufs.iter().find(|(_, have, need)| have < need) {
        None => Ok(()),
        Some((what, have, need)) => {
            Err(Error::Shape { what: op, detail: format!("{what} has {have} elements, needs {need}") })
        }
    }
}

fn cfg(l: Launch) -> LaunchConfig {
    LaunchConfig { grid_dim: l.grid, block_dim: l.block, shared_mem_bytes: 0 }
}

fn shape(op: &'static str, l: Option<Launch>) -> Result<Launch, Error> {
    l.ok_or(Error::Shape { what: op, detail: "more rows than one launch takes (2^31)".into() })
}

/// Enqueue kernel `$name` with launch shape `$l` and arguments `$a` (references to device pointers
/// as `u64` and to scalars), in the kernel's parameter order. Not checked: the call site's
/// `// SAFETY:` comment proves the kernel's contract (buffer lengths, argument types and order).
macro_rules! launch {
    ($self:ident, $name:literal, $l:expr, [$($a:expr),* $(,)?]) => {{
        let f = $self.k.get($name).expect(concat!($name, " is listed in cuda_grid::SOURCES"));
        let mut b = $self.stream.launch_builder(f);
        $( b.arg($a); )*
        let l: Launch = $l;
        // SAFETY: the contract of the kernel, proven at the call site.
        unsafe { b.launch(cfg(l)) }.map(|_| ()).map_err(driver(concat!("launch ", $name)))
    }};
}

mod health;
mod loss;
mod ops;
mod update;

pub use health::health_of_row;

impl Gpu {
    /// Device `ordinal`, with a new stream and cuBLAS handle; compiles the kernels at the first use
    /// of the device.
    pub fn new(ordinal: usize) -> Result<Gpu, Error> {
        let n = probe()?;
        if ordinal >= n {
            return Err(Error::NoCudaDevice(format!("device {ordinal} asked for, the driver sees {n}")));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver(format!("cuDevicePrimaryCtxRetain({ordinal})")))?;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let k = kernels(&ctx)?;
        if !cublas_present() {
            return Err(Error::NoCublas("libcublas.so could not be loaded".into()));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(blas("cublasCreate"))?;
        let gpu = Gpu {
            ctx,
            stream,
            k,
            blas,
            scan_scratch: Mutex::new(None),
            att_scratch: Mutex::new(None),
            pinned: Mutex::new(None),
        };
        gpu.allow_tf32(false)?;
        Ok(gpu)
    }

    /// cuBLAS's math mode: the default (f32 products and sums, no TF32), or TF32 tensor cores
    /// (faster, 10-bit mantissas in the products) when `allow` - only when a user asks for it.
    pub fn allow_tf32(&self, allow: bool) -> Result<(), Error> {
        let mode = if allow { cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH } else { cublasMath_t::CUBLAS_DEFAULT_MATH };
        // SAFETY: the handle is live (owned by `self.blas`); cublasSetMathMode only sets a field of it.
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*self.blas.handle(), mode) }
            .result()
            .map_err(blas("cublasSetMathMode"))
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every kernel of this `Gpu` runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's name (e.g. "NVIDIA H200").
    pub fn name(&self) -> Result<String, Error> {
        self.ctx.name().map_err(driver("cuDeviceGetName"))
    }

    /// Wait for everything enqueued on the stream.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }

    /// `n` zeros on the device.
    pub fn zeros<T: Elem>(&self, n: usize) -> Result<CudaSlice<T>, Error> {
        self.stream.alloc_zeros(n).map_err(driver(format!("alloc {n} elements")))
    }

    /// A device copy of `x`.
    pub fn upload<T: Elem>(&self, x: &[T]) -> Result<CudaSlice<T>, Error> {
        self.stream.clone_htod(x).map_err(driver("copy host to device"))
    }

    /// Copy `x` into the device buffer `dst` (same length).
    pub fn upload_into<T: Elem, D: DevicePtrMut<T>>(&self, x: &[T], dst: &mut D) -> Result<(), Error> {
        lengths("upload_into", &[("dst", dst.len(), x.len()), ("x", x.len(), dst.len())])?;
        self.stream.memcpy_htod(x, dst).map_err(driver("copy host to device"))
    }

    /// A host copy of `x` (synchronizes).
    pub fn download<T: Elem, S: DevicePtr<T>>(&self, x: &S) -> Result<Vec<T>, Error> {
        let v = self.stream.clone_dtoh(x).map_err(driver("copy device to host"))?;
        self.synchronize()?;
        Ok(v)
    }

    /// A host copy of f32 elements through page-locked memory (synchronizes): the backend's
    /// `to_host`, the staged bus's per-bucket copy, the probes' and dumps' reads.
    pub fn download_f32<S: DevicePtr<f32>>(&self, x: &S) -> Result<Vec<f32>, Error> {
        let n = x.len();
        let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(pinned.as_ref(), Some(p) if p.len() >= n) {
            // SAFETY: the memory is uninitialised until written; only the first `n` elements are
            // read below, after the copy that writes them has completed (`as_slice` waits for it).
            // Flags 0: cached (not write-combined) memory, which the host reads at full speed.
            *pinned = Some(
                unsafe { self.ctx.alloc_pinned_with_flags::<f32>(n.max(1), 0) }
                    .map_err(driver(format!("cuMemHostAlloc({n} floats)")))?,
            );
        }
        let p = pinned.as_mut().expect("allocated just above");
        self.stream.memcpy_dtoh(x, p).map_err(driver("copy device to pinned host"))?;
        Ok(p.as_slice().map_err(driver("wait for the copy to pinned host"))?[..n].to_vec())
    }

    /// Device-to-device copy of `src` into `dst` (same length), on the stream.
    pub fn copy<T: Elem, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, src: &S, dst: &mut D) -> Result<(), Error> {
        if src.len() != dst.len() {
            return Err(Error::Shape { what: "copy", detail: format!("{} vs {}", src.len(), dst.len()) });
        }
        self.stream.memcpy_dtod(src, dst).map_err(driver("cuMemcpyDtoDAsync"))
    }

    /// Zero `x` on the stream.
    pub fn fill_zeros<T: Elem, D: DevicePtrMut<T>>(&self, x: &mut D) -> Result<(), Error> {
        self.stream.memset_zeros(x).map_err(driver("cuMemsetD8Async"))
    }
}
