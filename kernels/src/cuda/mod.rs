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

/// "No first bad index" in a health row.
const NO_BAD: u64 = u64::MAX;

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

    // ------------------------------------------------------------------ health scan

    /// The fused health scan of `x` (f32): NaN and Inf counts, f64 sum of squares of the finite
    /// elements, first non-finite index. Synchronizes (the result is a host value).
    pub fn health_scan<S: DevicePtr<f32>>(&self, x: &S) -> Result<Health, Error> {
        self.scan_to_host(x, "health_scan_f32")
    }

    /// The health scan of bf16 elements (raw 16-bit words), widened exactly to f32.
    pub fn health_scan_bf16<S: DevicePtr<u16>>(&self, x: &S) -> Result<Health, Error> {
        self.scan_to_host(x, "health_scan_bf16")
    }

    /// The health scan of `x` into the 4 words of `row` on the device ([nan, inf, sum of squares
    /// as f64 bits, first bad index or `u64::MAX`]), enqueued: a bucket's tallies stay on the device
    /// until the agreement copies the whole table to the host at once.
    pub fn health_scan_into<S: DevicePtr<f32>, D: DevicePtrMut<u64>>(&self, x: &S, row: &mut D) -> Result<(), Error> {
        self.scan_into(x, "health_scan_f32", row)
    }

    /// The health scan's read-only baseline over `x`: the same tiles and loads, an xor per element
    /// (`health.cu`), enqueued. For the bandwidth benchmark.
    pub fn read_only<S: DevicePtr<f32>>(&self, x: &S) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let l = shape("read_only", grid::health(n))?;
        let mut scratch = self.scan_scratch(l.grid.0 as usize)?;
        let part = scratch.as_mut().expect("allocated");
        let (xp, _x) = x.device_ptr(&self.stream);
        let (pp, _p) = part.device_ptr_mut(&self.stream);
        // SAFETY: read_only_f32(const float *x, u64 n, unsigned *part): x holds n f32, part at least
        // one word per tile (the scratch has 4 u64 per tile).
        launch!(self, "read_only_f32", l, [&xp, &n, &pp])
    }

    /// The scratch of a scan over `tiles` tiles: 4 words per tile, 4 for a result, one counter (0).
    fn scan_scratch(&self, tiles: usize) -> Result<std::sync::MutexGuard<'_, Option<CudaSlice<u64>>>, Error> {
        let words = 4 * tiles + 5;
        let mut scratch = self.scan_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(scratch.as_ref(), Some(s) if s.len() >= words) {
            *scratch = Some(self.zeros::<u64>(words)?); // zero: the counter starts at 0
        }
        Ok(scratch)
    }

    fn scan_into<T, S: DevicePtr<T>, D: DevicePtrMut<u64>>(
        &self,
        x: &S,
        kernel: &'static str,
        row: &mut D,
    ) -> Result<(), Error> {
        if row.len() != 4 {
            return Err(Error::Shape { what: "health_scan", detail: format!("a row is 4 words, not {}", row.len()) });
        }
        let n = x.len() as u64;
        if n == 0 {
            return self.upload_into(&[0, 0, 0f64.to_bits(), NO_BAD], row);
        }
        let l = shape("health_scan", grid::health(n))?;
        let tiles = l.grid.0 as usize;
        let mut scratch = self.scan_scratch(tiles)?;
        let part = scratch.as_mut().expect("allocated");
        let counter_word = (part.len() - 1) as u64;
        let (xp, _x) = x.device_ptr(&self.stream);
        let (pp, _p) = part.device_ptr_mut(&self.stream);
        let (rp, _r) = row.device_ptr_mut(&self.stream);
        let cp = pp + 8 * counter_word; // the last word: zero, and reset by the last block
                                        // SAFETY: health_scan_<T>(const T *x, u64 n, u64 *part, unsigned *counter, u64 *out): x
                                        // holds n elements of the kernel's dtype (the caller picked the kernel of S's element type);
                                        // tile b < ceil(n / TILE) reads indices < n only and writes part[4b..4b+4) < 4 * tiles; the
                                        // counter is the scratch's last word (zero since allocation: every launch's last block
                                        // resets it); out is `row`, 4 words (checked).
        match kernel {
            "health_scan_f32" => launch!(self, "health_scan_f32", l, [&xp, &n, &pp, &cp, &rp]),
            _ => launch!(self, "health_scan_bf16", l, [&xp, &n, &pp, &cp, &rp]),
        }
    }

    fn scan_to_host<T, S: DevicePtr<T>>(&self, x: &S, kernel: &'static str) -> Result<Health, Error> {
        let mut row = self.zeros::<u64>(4)?;
        self.scan_into(x, kernel, &mut row)?;
        Ok(health_of_row(&self.download(&row)?))
    }

    // ------------------------------------------------------------------ scale, AdamW, checksum

    /// `x[i] *= s` (f32), enqueued on the stream.
    pub fn scale<D: DevicePtrMut<f32>>(&self, x: &mut D, s: f32) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let (xp, _x) = x.device_ptr_mut(&self.stream);
        // SAFETY: scale_f32(float *x, u64 n, float s), grid-stride over i < n; x holds n f32.
        launch!(self, "scale_f32", grid::elementwise(n), [&xp, &n, &s])
    }

    /// `x[i] *= s` on bf16 elements (raw 16-bit words), rounded to nearest even.
    pub fn scale_bf16<D: DevicePtrMut<u16>>(&self, x: &mut D, s: f32) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let (xp, _x) = x.device_ptr_mut(&self.stream);
        // SAFETY: scale_bf16(unsigned short *x, u64 n, float s), grid-stride over i < n; x holds n
        // 16-bit words.
        launch!(self, "scale_bf16", grid::elementwise(n), [&xp, &n, &s])
    }

    /// AdamW, the CPU `adamw_update`'s arithmetic (same bits): params, grads, m, v: (N). Returns the
    /// replica checksum of the updated params (`checksum::checksum`'s value; synchronizes).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update<P, G, M, V>(
        &self,
        params: &mut P,
        grads: &G,
        m: &mut M,
        v: &mut V,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        t: u64,
    ) -> Result<u64, Error>
    where
        P: DevicePtr<f32> + DevicePtrMut<f32>,
        G: DevicePtr<f32>,
        M: DevicePtrMut<f32>,
        V: DevicePtrMut<f32>,
    {
        let n = DeviceSlice::len(params);
        if grads.len() != n || m.len() != n || v.len() != n {
            return Err(Error::Shape {
                what: "adamw_update",
                detail: format!("params {n}, grads {}, m {}, v {}", grads.len(), m.len(), v.len()),
            });
        }
        let s = AdamwScalars::new(lr, beta1, beta2, weight_decay, t);
        if n > 0 {
            let n = n as u64;
            let (pp, _p) = params.device_ptr_mut(&self.stream);
            let (gp, _g) = grads.device_ptr(&self.stream);
            let (mp, _m) = m.device_ptr_mut(&self.stream);
            let (vp, _v) = v.device_ptr_mut(&self.stream);
            // SAFETY: adamw_update_f32(float *params, const float *grads, float *m, float *v, u64 n,
            // float x7): the four buffers hold n f32 each (checked above), grid-stride over i < n.
            launch!(
                self,
                "adamw_update_f32",
                grid::elementwise(n),
                [
                    &pp,
                    &gp,
                    &mp,
                    &vp,
                    &n,
                    &s.one_minus_beta1,
                    &beta2,
                    &s.one_minus_beta2,
                    &eps,
                    &s.decay,
                    &s.step_size,
                    &s.bc2_sqrt
                ]
            )?;
        }
        self.checksum(params)
    }

    /// The replica checksum of `x` (`checksum::checksum`'s value): the 128 lanes on the device, folded
    /// on the host by the CPU's own `checksum::fold`. Synchronizes.
    pub fn checksum<S: DevicePtr<f32>>(&self, x: &S) -> Result<u64, Error> {
        let n = x.len() as u64;
        let mut lanes = self.zeros::<u32>(grid::CHECKSUM_LANES as usize)?;
        {
            let (xp, _x) = x.device_ptr(&self.stream);
            let (lp, _l) = lanes.device_ptr_mut(&self.stream);
            // SAFETY: checksum_lanes_f32(const float *x, u64 n, unsigned *lanes): x holds n f32,
            // lanes 128 words, one block of 128 threads.
            launch!(self, "checksum_lanes_f32", grid::checksum_lanes(), [&xp, &n, &lp])?;
        }
        let lanes: [u32; crate::checksum::LANES] = self.download(&lanes)?.try_into().expect("128 lanes");
        Ok(crate::checksum::fold(&lanes, n))
    }

    // ------------------------------------------------------------------ model ops

    /// out: (B, T, C) = wte[tokens] + wpe; tokens: (B, T) ids below V, wte: (V, C), wpe: (>= T, C).
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        tokens: &impl DevicePtr<u32>,
        wte: &impl DevicePtr<f32>,
        wpe: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        v: usize,
    ) -> Result<(), Error> {
        let bt = b * t;
        lengths(
            "encoder_forward",
            &[
                ("out", out.len(), bt * c),
                ("tokens", tokens.len(), bt),
                ("wte", wte.len(), v * c),
                ("wpe", wpe.len(), t * c),
            ],
        )?;
        if bt * c == 0 {
            return Ok(());
        }
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (tp, _t) = tokens.device_ptr(&self.stream);
        let (ep, _e) = wte.device_ptr(&self.stream);
        let (pp, _p) = wpe.device_ptr(&self.stream);
        let (bt, t, c, v) = (bt as u64, t as u64, c as u64, v as u64);
        // SAFETY: encoder_forward_f32(out, tokens, wte, wpe, bt, t, c, v): lengths checked above;
        // an id >= V is never used as an index (NaN written instead).
        launch!(self, "encoder_forward_f32", grid::elementwise(bt * c), [&op, &tp, &ep, &pp, &bt, &t, &c, &v])
    }

    /// dwte: (V, C) +=, dwpe: (>= T, C) +=, dout: (B, T, C); `tokens` (B, T) on the host (the
    /// positions of each token are listed there, `cuda_grid::token_rows`).
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_backward(
        &self,
        dwte: &mut impl DevicePtrMut<f32>,
        dwpe: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        tokens: &[u32],
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), Error> {
        let bt = b * t;
        lengths(
            "encoder_backward",
            &[("dwpe", dwpe.len(), t * c), ("dout", dout.len(), bt * c), ("tokens", tokens.len(), bt)],
        )?;
        if bt * c == 0 {
            return Ok(());
        }
        let v = dwte.len() / c;
        if let Some(bad) = tokens[..bt].iter().find(|&&id| id as usize >= v) {
            return Err(Error::Shape {
                what: "encoder_backward",
                detail: format!("token {bad} out of vocabulary {v}"),
            });
        }
        let (rows, starts, order) = grid::token_rows(&tokens[..bt], v);
        let (rows_d, starts_d, order_d) = (self.upload(&rows)?, self.upload(&starts)?, self.upload(&order)?);
        let (ep, _e) = dwte.device_ptr_mut(&self.stream);
        let (pp, _p) = dwpe.device_ptr_mut(&self.stream);
        let (dp, _d) = dout.device_ptr(&self.stream);
        let (rp, _r) = rows_d.device_ptr(&self.stream);
        let (sp, _s) = starts_d.device_ptr(&self.stream);
        let (ordp, _q) = order_d.device_ptr(&self.stream);
        let (b, t, c) = (b as u64, t as u64, c as u64);
        let l = shape("encoder_backward", grid::per_row(rows.len() as u64, grid::ROW_THREADS))?;
        // SAFETY: encoder_backward_wte_f32(dwte, dout, rows, starts, order, c): every row id < V =
        // dwte.len() / C (checked), starts has rows + 1 entries, order every position < B T
        // (token_rows), dout (B, T, C) (checked).
        launch!(self, "encoder_backward_wte_f32", l, [&ep, &dp, &rp, &sp, &ordp, &c])?;
        // SAFETY: encoder_backward_wpe_f32(dwpe, dout, b, t, c): dwpe >= T C, dout B T C (checked).
        launch!(self, "encoder_backward_wpe_f32", grid::elementwise(t * c), [&pp, &dp, &b, &t, &c])
    }

    /// out: (N, C), mean: (N), rstd: (N), inp: (N, C), weight: (C), bias: (C).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        mean: &mut impl DevicePtrMut<f32>,
        rstd: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        bias: &impl DevicePtr<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), Error> {
        lengths(
            "layernorm_forward",
            &[
                ("out", out.len(), n * c),
                ("mean", mean.len(), n),
                ("rstd", rstd.len(), n),
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), c),
                ("bias", bias.len(), c),
            ],
        )?;
        if n * c == 0 {
            return Ok(());
        }
        let l = shape("layernorm_forward", grid::per_row(n as u64, grid::ROW_THREADS))?;
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (mp, _m) = mean.device_ptr_mut(&self.stream);
        let (rp, _r) = rstd.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (wp, _w) = weight.device_ptr(&self.stream);
        let (bp, _b) = bias.device_ptr(&self.stream);
        let c = c as u64;
        // SAFETY: layernorm_forward_f32(out, mean, rstd, inp, weight, bias, c), block r < N takes
        // row r: lengths checked above.
        launch!(self, "layernorm_forward_f32", l, [&op, &mp, &rp, &xp, &wp, &bp, &c])
    }

    /// dinp: (N, C) +=, dweight: (C) +=, dbias: (C) +=, dout: (N, C), inp: (N, C), weight: (C),
    /// mean: (N), rstd: (N).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        dweight: &mut impl DevicePtrMut<f32>,
        dbias: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        mean: &impl DevicePtr<f32>,
        rstd: &impl DevicePtr<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), Error> {
        lengths(
            "layernorm_backward",
            &[
                ("dinp", dinp.len(), n * c),
                ("dweight", dweight.len(), c),
                ("dbias", dbias.len(), c),
                ("dout", dout.len(), n * c),
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), c),
                ("mean", mean.len(), n),
                ("rstd", rstd.len(), n),
            ],
        )?;
        if n * c == 0 {
            return Ok(());
        }
        let l = shape("layernorm_backward", grid::per_row(n as u64, grid::ROW_THREADS))?;
        let (dp, _d) = dinp.device_ptr_mut(&self.stream);
        let (wgp, _wg) = dweight.device_ptr_mut(&self.stream);
        let (bgp, _bg) = dbias.device_ptr_mut(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (wp, _w) = weight.device_ptr(&self.stream);
        let (mp, _m) = mean.device_ptr(&self.stream);
        let (rp, _r) = rstd.device_ptr(&self.stream);
        let (n, c) = (n as u64, c as u64);
        // SAFETY: layernorm_backward_inp_f32(dinp, dout, inp, weight, mean, rstd, c), block r < N
        // takes row r: lengths checked above.
        launch!(self, "layernorm_backward_inp_f32", l, [&dp, &op, &xp, &wp, &mp, &rp, &c])?;
        // SAFETY: layernorm_backward_params_f32(dweight, dbias, dout, inp, mean, rstd, n, c), a
        // thread per channel j < C over the N rows: lengths checked above.
        launch!(self, "layernorm_backward_params_f32", grid::elementwise(c), [&wgp, &bgp, &op, &xp, &mp, &rp, &n, &c])
    }

    /// out: (N) = GELU(inp).
    pub fn gelu_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("gelu_forward", &[("out", out.len(), n), ("inp", inp.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: gelu_forward_f32(out, inp, n), grid-stride over i < n: lengths checked above.
        launch!(self, "gelu_forward_f32", grid::elementwise(n), [&op, &xp, &n])
    }

    /// dinp: (N) +=, inp: (N), dout: (N).
    pub fn gelu_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        dout: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("gelu_backward", &[("dinp", dinp.len(), n), ("inp", inp.len(), n), ("dout", dout.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (dp, _d) = dinp.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: gelu_backward_f32(dinp, inp, dout, n), grid-stride over i < n: lengths checked.
        launch!(self, "gelu_backward_f32", grid::elementwise(n), [&dp, &xp, &op, &n])
    }

    /// out: (N) = inp1 + inp2.
    pub fn residual_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        inp1: &impl DevicePtr<f32>,
        inp2: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("residual_forward", &[("out", out.len(), n), ("inp1", inp1.len(), n), ("inp2", inp2.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (ap, _a) = inp1.device_ptr(&self.stream);
        let (bp, _b) = inp2.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: residual_forward_f32(out, a, b, n), grid-stride over i < n: lengths checked.
        launch!(self, "residual_forward_f32", grid::elementwise(n), [&op, &ap, &bp, &n])
    }

    /// dinp1: (N) +=, dinp2: (N) +=, dout: (N).
    pub fn residual_backward(
        &self,
        dinp1: &mut impl DevicePtrMut<f32>,
        dinp2: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("residual_backward", &[("dinp1", dinp1.len(), n), ("dinp2", dinp2.len(), n), ("dout", dout.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (ap, _a) = dinp1.device_ptr_mut(&self.stream);
        let (bp, _b) = dinp2.device_ptr_mut(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: residual_backward_f32(d1, d2, dout, n), grid-stride over i < n: lengths checked.
        launch!(self, "residual_backward_f32", grid::elementwise(n), [&ap, &bp, &op, &n])
    }

    /// Causal attention's query rows t0..t over positions 0..t (a KV cache passes its capacity as
    /// `stride`; the full forward is t0 = 0, stride = T). out: (B, t - t0, C),
    /// att: (B, NH, t - t0, t), inp: (B, stride, 3C).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward_rows(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        att: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        stride: usize,
        b: usize,
        t0: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), Error> {
        if !(t0 <= t && t <= stride && nh > 0 && c % nh == 0) {
            return Err(Error::Shape {
                what: "attention_forward",
                detail: format!("rows {t0}..{t} of {stride}, C {c}, NH {nh}"),
            });
        }
        let tq = t - t0;
        lengths(
            "attention_forward",
            &[
                ("out", out.len(), b * tq * c),
                ("att", att.len(), b * nh * tq * t),
                ("inp", inp.len(), b * stride * 3 * c),
            ],
        )?;
        if b * tq * c == 0 {
            return Ok(());
        }
        let l = shape("attention_forward", grid::per_row((b * nh * tq) as u64, grid::ATTENTION_THREADS))?;
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (ap, _a) = att.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (stride, t0, t, c, nh) = (stride as u64, t0 as u64, t as u64, c as u64, nh as u64);
        // SAFETY: attention_forward_f32(out, att, inp, stride, t0, t, c, nh), block r < B NH (t - t0)
        // takes one query row: it reads inp rows < B stride and writes att row r and out's row:
        // lengths checked above.
        launch!(self, "attention_forward_f32", l, [&op, &ap, &xp, &stride, &t0, &t, &c, &nh])
    }

    /// dinp: (B, T, 3C) +=, dout: (B, T, C), inp: (B, T, 3C), att: (B, NH, T, T).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        inp: &impl DevicePtr<f32>,
        att: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), Error> {
        if nh == 0 || c % nh != 0 {
            return Err(Error::Shape { what: "attention_backward", detail: format!("C {c}, NH {nh}") });
        }
        lengths(
            "attention_backward",
            &[
                ("dinp", dinp.len(), b * t * 3 * c),
                ("dout", dout.len(), b * t * c),
                ("inp", inp.len(), b * t * 3 * c),
                ("att", att.len(), b * nh * t * t),
            ],
        )?;
        if b * t * c == 0 {
            return Ok(());
        }
        let rows = shape("attention_backward", grid::per_row((b * nh * t) as u64, grid::ATTENTION_THREADS))?;
        let mut scratch = self.att_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(scratch.as_ref(), Some(s) if s.len() >= b * nh * t * t) {
            *scratch = Some(self.zeros::<f32>(b * nh * t * t)?);
        }
        let ds = scratch.as_mut().expect("allocated");
        let (sp, _s) = ds.device_ptr_mut(&self.stream);
        let (dp, _d) = dinp.device_ptr_mut(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (ap, _a) = att.device_ptr(&self.stream);
        let (b, t, c, nh) = (b as u64, t as u64, c as u64, nh as u64);
        // SAFETY: attention_backward_scores_f32(dscore, dout, inp, att, t, c, nh), block r < B NH T
        // writes dscore row r (the scratch holds B NH T T); the reads are within the lengths checked.
        launch!(self, "attention_backward_scores_f32", rows, [&sp, &op, &xp, &ap, &t, &c, &nh])?;
        let all = grid::elementwise(b * t * c);
        // SAFETY: attention_backward_dq_f32(dinp, dscore, inp, b, t, c, nh), a thread per
        // (b, h, t1, i) < B T C: reads dscore rows and inp, writes dinp's q part (lengths checked).
        launch!(self, "attention_backward_dq_f32", all, [&dp, &sp, &xp, &b, &t, &c, &nh])?;
        // SAFETY: attention_backward_dkv_f32(dinp, dscore, dout, inp, att, b, t, c, nh), a thread per
        // (b, h, t2, i) < B T C: writes dinp's k and v parts (lengths checked).
        launch!(self, "attention_backward_dkv_f32", all, [&dp, &sp, &op, &xp, &ap, &b, &t, &c, &nh])
    }

    /// logp: (N), lse: (N), logits: (N, V), targets: (N) ids below V.
    pub fn logsoftmax_gather_forward(
        &self,
        logp: &mut impl DevicePtrMut<f32>,
        lse: &mut impl DevicePtrMut<f32>,
        logits: &impl DevicePtr<f32>,
        targets: &impl DevicePtr<u32>,
        n: usize,
        v: usize,
    ) -> Result<(), Error> {
        lengths(
            "logsoftmax_gather_forward",
            &[
                ("logp", logp.len(), n),
                ("lse", lse.len(), n),
                ("logits", logits.len(), n * v),
                ("targets", targets.len(), n),
            ],
        )?;
        if n * v == 0 {
            return Ok(());
        }
        let (pp, _p) = logp.device_ptr_mut(&self.stream);
        let (sp, _s) = lse.device_ptr_mut(&self.stream);
        let (lp, _l) = logits.device_ptr(&self.stream);
        let (tp, _t) = targets.device_ptr(&self.stream);
        let (n, v) = (n as u64, v as u64);
        // SAFETY: logsoftmax_gather_forward_f32(logp, lse, logits, targets, n, v), a thread per row
        // i < n reading logits row i only (a target >= V gives NaN, never an index): lengths checked.
        launch!(self, "logsoftmax_gather_forward_f32", grid::elementwise(n), [&pp, &sp, &lp, &tp, &n, &v])
    }

    /// dlogits: (N, V) +=, dlogp: (N), logits: (N, V), lse: (N), targets: (N).
    #[allow(clippy::too_many_arguments)]
    pub fn logsoftmax_gather_backward(
        &self,
        dlogits: &mut impl DevicePtrMut<f32>,
        dlogp: &impl DevicePtr<f32>,
        logits: &impl DevicePtr<f32>,
        lse: &impl DevicePtr<f32>,
        targets: &impl DevicePtr<u32>,
        n: usize,
        v: usize,
    ) -> Result<(), Error> {
        lengths(
            "logsoftmax_gather_backward",
            &[
                ("dlogits", dlogits.len(), n * v),
                ("dlogp", dlogp.len(), n),
                ("logits", logits.len(), n * v),
                ("lse", lse.len(), n),
                ("targets", targets.len(), n),
            ],
        )?;
        if n * v == 0 {
            return Ok(());
        }
        let (dp, _d) = dlogits.device_ptr_mut(&self.stream);
        let (gp, _g) = dlogp.device_ptr(&self.stream);
        let (lp, _l) = logits.device_ptr(&self.stream);
        let (sp, _s) = lse.device_ptr(&self.stream);
        let (tp, _t) = targets.device_ptr(&self.stream);
        let (n, v) = (n as u64, v as u64);
        // SAFETY: logsoftmax_gather_backward_f32(dlogits, dlogp, logits, lse, targets, n, v),
        // grid-stride over e < n v: lengths checked above.
        launch!(self, "logsoftmax_gather_backward_f32", grid::elementwise(n * v), [&dp, &gp, &lp, &sp, &tp, &n, &v])
    }

    /// out: (BT, OC) = inp (BT, C) @ weight (OC, C)^T + bias (OC): cuBLAS SGEMM after a bias fill.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        bias: Option<&CudaView<'_, f32>>,
        bt: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), Error> {
        lengths(
            "matmul_forward",
            &[
                ("out", out.len(), bt * oc),
                ("inp", inp.len(), bt * c),
                ("weight", weight.len(), oc * c),
                ("bias", bias.map_or(oc, |b| b.len()), oc),
            ],
        )?;
        if bt * oc == 0 {
            return Ok(());
        }
        let beta = match bias {
            Some(bias) => {
                let (op, _o) = out.device_ptr_mut(&self.stream);
                let (bp, _b) = bias.device_ptr(&self.stream);
                let (bt, oc) = (bt as u64, oc as u64);
                // SAFETY: bias_fill_f32(out, bias, bt, oc), grid-stride over e < BT OC: lengths checked.
                launch!(self, "bias_fill_f32", grid::elementwise(bt * oc), [&op, &bp, &bt, &oc])?;
                1.0
            }
            None => 0.0,
        };
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: dim(oc)?,
            n: dim(bt)?,
            k: dim(c)?,
            alpha: 1.0f32,
            lda: dim(c)?,
            ldb: dim(c)?,
            beta,
            ldc: dim(oc)?,
        };
        // SAFETY: column-major out^T (OC x BT, ld OC) = weight^T... : A = weight (C x OC col-major,
        // ld C, transposed), B = inp (C x BT, ld C), C = out (OC x BT, ld OC); the lengths checked
        // above cover every element cuBLAS reads or writes.
        unsafe { self.blas.gemm(cfg, weight, inp, out) }.map_err(blas("cublasSgemm (matmul_forward)"))
    }

    /// Gradients of `matmul_forward`, accumulated: dinp (BT, C) +=, dweight (OC, C) +=, dbias (OC)
    /// +=, dout (BT, OC), inp (BT, C), weight (OC, C).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        dweight: &mut impl DevicePtrMut<f32>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
        dout: &impl DevicePtr<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        bt: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), Error> {
        lengths(
            "matmul_backward",
            &[
                ("dinp", dinp.len(), bt * c),
                ("dweight", dweight.len(), oc * c),
                ("dbias", dbias.as_ref().map_or(oc, |b| b.len()), oc),
                ("dout", dout.len(), bt * oc),
                ("inp", inp.len(), bt * c),
                ("weight", weight.len(), oc * c),
            ],
        )?;
        if bt * oc * c == 0 {
            return Ok(());
        }
        let (m_c, m_bt, m_oc) = (dim(c)?, dim(bt)?, dim(oc)?);
        let op_n = cublasOperation_t::CUBLAS_OP_N;
        // dinp^T (C x BT) += weight^T (C x OC) @ dout^T (OC x BT).
        let cfg = GemmConfig {
            transa: op_n,
            transb: op_n,
            m: m_c,
            n: m_bt,
            k: m_oc,
            alpha: 1.0f32,
            lda: m_c,
            ldb: m_oc,
            beta: 1.0,
            ldc: m_c,
        };
        // SAFETY: A = weight (C x OC col-major, ld C), B = dout (OC x BT, ld OC), C = dinp (C x BT,
        // ld C): within the lengths checked above.
        unsafe { self.blas.gemm(cfg, weight, dout, dinp) }.map_err(blas("cublasSgemm (matmul_backward dinp)"))?;
        // dweight^T (C x OC) += inp^T (C x BT) @ dout (BT x OC).
        let cfg = GemmConfig {
            transa: op_n,
            transb: cublasOperation_t::CUBLAS_OP_T,
            m: m_c,
            n: m_oc,
            k: m_bt,
            alpha: 1.0f32,
            lda: m_c,
            ldb: m_oc,
            beta: 1.0,
            ldc: m_c,
        };
        // SAFETY: A = inp (C x BT col-major, ld C), B = dout (OC x BT, ld OC, transposed), C = dweight
        // (C x OC, ld C): within the lengths checked above.
        unsafe { self.blas.gemm(cfg, inp, dout, dweight) }.map_err(blas("cublasSgemm (matmul_backward dweight)"))?;
        if let Some(dbias) = dbias {
            let (bp, _b) = dbias.device_ptr_mut(&self.stream);
            let (op, _o) = dout.device_ptr(&self.stream);
            let (bt, oc) = (bt as u64, oc as u64);
            // SAFETY: bias_backward_f32(dbias, dout, bt, oc), a thread per channel o < OC over the
            // BT rows: lengths checked above.
            launch!(self, "bias_backward_f32", grid::elementwise(oc), [&bp, &op, &bt, &oc])?;
        }
        Ok(())
    }

    // ------------------------------------------------------------------ loss, sampling, utilities

    /// The GRPO loss's per-position forward (`ops::grpo_forward`): logp, mask, old, reference:
    /// (B, T), adv: (B); the saved values into `saved` (each >= B T). Returns the stats
    /// (synchronizes).
    #[allow(clippy::too_many_arguments)]
    pub fn grpo_forward(
        &self,
        s: &GrpoScalars,
        logp: &impl DevicePtr<f32>,
        mask: &impl DevicePtr<f32>,
        adv: &impl DevicePtr<f32>,
        old: &impl DevicePtr<f32>,
        reference: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        saved: &mut GrpoSaved<CudaSlice<f32>>,
    ) -> Result<GrpoStats, Error> {
        let n = b * t;
        let sv = &mut *saved;
        lengths(
            "grpo_forward",
            &[
                ("logp", logp.len(), n),
                ("mask", mask.len(), n),
                ("adv", adv.len(), b),
                ("old", old.len(), n),
                ("reference", reference.len(), n),
                (
                    "saved",
                    [&sv.lr1_raw, &sv.lr1, &sv.ratio, &sv.lr2_raw, &sv.lr2, &sv.e2, &sv.k3, &sv.terms]
                        .iter()
                        .map(|x| x.len())
                        .min()
                        .unwrap_or(0),
                    n,
                ),
            ],
        )?;
        let mut stats = self.zeros::<f32>(LOSS_STATS)?;
        if n > 0 {
            let (lim, lo, hi) = (if s.safe { LOGRATIO_CLAMP } else { f32::INFINITY }, 1.0 - s.clip, 1.0 + s.clip);
            let (safe, n, t) = (s.safe as i32, n as u64, t as u64);
            let (lp, _g0) = logp.device_ptr(&self.stream);
            let (mp, _g1) = mask.device_ptr(&self.stream);
            let (ap, _g2) = adv.device_ptr(&self.stream);
            let (op, _g3) = old.device_ptr(&self.stream);
            let (rp, _g4) = reference.device_ptr(&self.stream);
            let (r1, _g5) = sv.lr1_raw.device_ptr_mut(&self.stream);
            let (l1, _g6) = sv.lr1.device_ptr_mut(&self.stream);
            let (ra, _g7) = sv.ratio.device_ptr_mut(&self.stream);
            let (r2, _g8) = sv.lr2_raw.device_ptr_mut(&self.stream);
            let (l2, _g9) = sv.lr2.device_ptr_mut(&self.stream);
            let (e2, _g10) = sv.e2.device_ptr_mut(&self.stream);
            let (k3, _g11) = sv.k3.device_ptr_mut(&self.stream);
            let (tm, _g12) = sv.terms.device_ptr_mut(&self.stream);
            let (st, _g13) = stats.device_ptr_mut(&self.stream);
            // SAFETY: grpo_forward_f32(logp, mask, adv, old, reference, n, t, safe, lim, lo, hi,
            // k3_clamp, kl_coef, then the 8 saved buffers): every per-position buffer holds >= n
            // floats and adv B = n / t (checked above); grid-stride over i < n.
            launch!(
                self,
                "grpo_forward_f32",
                grid::elementwise(n),
                [
                    &lp, &mp, &ap, &op, &rp, &n, &t, &safe, &lim, &lo, &hi, &K3_CLAMP, &s.kl_coef, &r1, &l1, &ra, &r2,
                    &l2, &e2, &k3, &tm
                ]
            )?;
            // SAFETY: grpo_reduce_f32(logp, mask, adv, lr1_raw, lr2_raw, ratio, k3, n, t, safe, lo, hi,
            // k3_clamp, kl_coef, stats): one thread reads n floats of each (as above) and writes the
            // LOSS_STATS floats of `stats`.
            launch!(
                self,
                "grpo_reduce_f32",
                grid::single(),
                [&lp, &mp, &ap, &r1, &r2, &ra, &k3, &n, &t, &safe, &lo, &hi, &K3_CLAMP, &s.kl_coef, &st]
            )?;
        }
        Ok(grid::grpo_stats(&self.download(&stats)?))
    }

    /// Backward of `grpo_forward` (`ops::grpo_backward`) into `grads` (each >= B T); `denom` is the
    /// forward's `GrpoStats::denom`. Enqueued.
    #[allow(clippy::too_many_arguments)]
    pub fn grpo_backward(
        &self,
        s: &GrpoScalars,
        mask: &impl DevicePtr<f32>,
        adv: &impl DevicePtr<f32>,
        saved: &GrpoSaved<CudaSlice<f32>>,
        denom: f32,
        b: usize,
        t: usize,
        grads: &mut GrpoGrads<CudaSlice<f32>>,
    ) -> Result<(), Error> {
        let n = b * t;
        let sv = saved;
        lengths(
            "grpo_backward",
            &[
                ("mask", mask.len(), n),
                ("adv", adv.len(), b),
                (
                    "saved",
                    [&sv.lr1_raw, &sv.lr2_raw, &sv.ratio, &sv.e2, &sv.k3].iter().map(|x| x.len()).min().unwrap_or(0),
                    n,
                ),
                ("grads", grads.d_lr1.len().min(grads.d_lr2.len()).min(grads.dlogp.len()), n),
            ],
        )?;
        if n == 0 {
            return Ok(());
        }
        let (lim, lo, hi) = (if s.safe { LOGRATIO_CLAMP } else { f32::INFINITY }, 1.0 - s.clip, 1.0 + s.clip);
        let (safe, n, t) = (s.safe as i32, n as u64, t as u64);
        let (mp, _g0) = mask.device_ptr(&self.stream);
        let (ap, _g1) = adv.device_ptr(&self.stream);
        let (r1, _g2) = sv.lr1_raw.device_ptr(&self.stream);
        let (r2, _g3) = sv.lr2_raw.device_ptr(&self.stream);
        let (ra, _g4) = sv.ratio.device_ptr(&self.stream);
        let (e2, _g5) = sv.e2.device_ptr(&self.stream);
        let (k3, _g6) = sv.k3.device_ptr(&self.stream);
        let (g1, _g7) = grads.d_lr1.device_ptr_mut(&self.stream);
        let (g2, _g8) = grads.d_lr2.device_ptr_mut(&self.stream);
        let (gp, _g9) = grads.dlogp.device_ptr_mut(&self.stream);
        // SAFETY: grpo_backward_f32(mask, adv, n, t, safe, lim, lo, hi, k3_clamp, kl_coef, denom,
        // lr1_raw, lr2_raw, ratio, e2, k3, d_lr1, d_lr2, dlogp): every per-position buffer holds >= n
        // floats (checked above); grid-stride over i < n.
        launch!(
            self,
            "grpo_backward_f32",
            grid::elementwise(n),
            [
                &mp, &ap, &n, &t, &safe, &lim, &lo, &hi, &K3_CLAMP, &s.kl_coef, &denom, &r1, &r2, &ra, &e2, &k3, &g1,
                &g2, &gp
            ]
        )
    }

    /// One token per sequence (`ops::sample`) from the last position of logits (B, T, V), row `i`
    /// with the caller's uniform draw `uniforms[i]`, into host `out` (B). Synchronizes.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        out: &mut [u32],
        logits: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        v: usize,
        temperature: f32,
        uniforms: &[f32],
    ) -> Result<(), Error> {
        lengths(
            "sample",
            &[("out", out.len(), b), ("uniforms", uniforms.len(), b), ("logits", logits.len(), b * t * v)],
        )?;
        if b == 0 {
            return Ok(());
        }
        if t == 0 || v == 0 {
            return Err(Error::Shape { what: "sample", detail: format!("T {t}, V {v}") });
        }
        let u = self.upload(&uniforms[..b])?;
        let mut tokens = self.zeros::<u32>(b)?;
        {
            let (tp, _t) = tokens.device_ptr_mut(&self.stream);
            let (lp, _l) = logits.device_ptr(&self.stream);
            let (up, _u) = u.device_ptr(&self.stream);
            let (b, t, v) = (b as u64, t as u64, v as u64);
            // SAFETY: sample_f32(out, logits, b, t, v, temperature, uniforms): out and uniforms hold
            // B, logits B T V (checked); a thread per sequence reads its last row only.
            launch!(self, "sample_f32", grid::elementwise(b), [&tp, &lp, &b, &t, &v, &temperature, &up])?;
        }
        out[..b].copy_from_slice(&self.download(&tokens)?);
        Ok(())
    }

    /// Every element of `x` set to `value`. Enqueued.
    pub fn fill(&self, x: &mut impl DevicePtrMut<f32>, value: f32) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let (xp, _x) = x.device_ptr_mut(&self.stream);
        // SAFETY: fill_f32(x, n, value), grid-stride over i < n; x holds n f32.
        launch!(self, "fill_f32", grid::elementwise(n), [&xp, &n, &value])
    }

    /// `height` rows of `width` elements, row `i` of `src` at `i * src_pitch` to row `i` of `dst` at
    /// `i * dst_pitch`. Enqueued.
    pub fn copy_2d(
        &self,
        dst: &mut impl DevicePtrMut<f32>,
        dst_pitch: usize,
        src: &impl DevicePtr<f32>,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<(), Error> {
        if width * height == 0 {
            return Ok(());
        }
        let need = |pitch: usize| (height - 1) * pitch + width;
        lengths("copy_2d", &[("dst", dst.len(), need(dst_pitch)), ("src", src.len(), need(src_pitch))])?;
        let (dp, _d) = dst.device_ptr_mut(&self.stream);
        let (sp, _s) = src.device_ptr(&self.stream);
        let (dpi, spi, w, h) = (dst_pitch as u64, src_pitch as u64, width as u64, height as u64);
        // SAFETY: copy_2d_f32(dst, dst_pitch, src, src_pitch, width, height): the last row ends within
        // both buffers (checked above).
        launch!(self, "copy_2d_f32", grid::elementwise(w * h), [&dp, &dpi, &sp, &spi, &w, &h])
    }
}

/// A cuBLAS dimension (i32).
fn dim(x: usize) -> Result<i32, Error> {
    i32::try_from(x).map_err(|_| Error::Shape { what: "matmul", detail: format!("dimension {x} exceeds cuBLAS's i32") })
}

/// A health row's 4 words as a [`Health`].
pub fn health_of_row(row: &[u64]) -> Health {
    Health { nan: row[0], inf: row[1], sumsq: f64::from_bits(row[2]), first_bad: (row[3] != NO_BAD).then_some(row[3]) }
}
