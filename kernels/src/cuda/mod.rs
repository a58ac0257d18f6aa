//! The CUDA backend (feature `cuda`): the same kernels as the CPU ones - `health_scan`, `scale`,
//! `adamw_update`, same names and argument order - on device buffers, as methods of a [`Gpu`] (one
//! device, one stream). Without the feature, `cuda_stub.rs` keeps this API and every constructor
//! returns [`Error::NotCompiledWithCuda`].
//!
//! Invariants:
//! - No CUDA call is made before [`probe`] has found the driver library: cudarc (dynamic loading)
//!   panics when libcuda is missing, this module returns [`Error::NoCudaDriver`] instead. The same
//!   for libnvrtc ([`Error::NoNvrtc`]) before the first compile.
//! - The `.cu` sources in `kernels/cuda/` are compiled with NVRTC at first use, for the device's
//!   own architecture, once per device per process (a global cache keyed by ordinal), with
//!   `--fmad=false`, IEEE division and square root and no flush-to-zero: `scale` and `adamw_update`
//!   give the CPU kernels' bits, and `health_scan` gives the CPU's counts and first index exactly and
//!   its sum of squares to the last few bits (another order of exact f64 additions).
//! - Every kernel is deterministic: no atomics on floats; the health scan's reduction has a fixed
//!   shape that depends on the length only.
//! - Kernels run on the `Gpu`'s stream; methods that return host values (`health_scan`, `download`)
//!   synchronize it, the others only enqueue.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use cudarc::nvrtc::CompileOptions;

use crate::health::Health;
use crate::ops::adamw::AdamwScalars;
use crate::Error;

/// The kernel sources, one file per op family.
const SOURCES: [(&str, &str); 3] = [
    ("health.cu", include_str!("../../cuda/health.cu")),
    ("scale.cu", include_str!("../../cuda/scale.cu")),
    ("adamw.cu", include_str!("../../cuda/adamw.cu")),
];

/// Threads and elements of one tile of the health scan's first pass (`health.cu`).
const HEALTH_THREADS: u32 = 256;
const HEALTH_TILE: u64 = 256 * 32;
/// Threads of the health scan's second pass.
const FINAL_THREADS: u32 = 1024;
/// "No first bad index" in a health row.
const NO_BAD: u64 = u64::MAX;
/// Threads per block of the elementwise kernels; blocks are capped (grid-stride loops).
const ELEM_THREADS: u32 = 256;
const MAX_BLOCKS: u64 = 65_535;

/// An element type the backend moves between host and device.
pub trait Elem: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + Unpin {}
impl Elem for f32 {}
/// bf16, as its raw 16 bits (the high half of an f32).
impl Elem for u16 {}
/// Raw 64-bit words (health rows).
impl Elem for u64 {}

/// True when the CUDA driver library can be loaded (nothing is called in it).
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the driver library's names and closes what
    // it opened; loading a shared library runs its initialisers, which is what makes it unsafe, and
    // libcuda's are meant to run in any process.
    unsafe { cudarc::driver::sys::is_culib_present() }
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

/// The compiled kernels of one device.
struct Kernels {
    health_partial_f32: CudaFunction,
    health_partial_bf16: CudaFunction,
    health_final: CudaFunction,
    scale_f32: CudaFunction,
    scale_bf16: CudaFunction,
    adamw_update_f32: CudaFunction,
}

/// Compiled kernels per device ordinal (a handful of devices: a linear search).
static CACHE: Mutex<Vec<(usize, Arc<Kernels>)>> = Mutex::new(Vec::new());

/// NVRTC compile of one source for `arch` (e.g. `compute_90`): no FMA contraction, IEEE division
/// and square root, denormals kept.
fn compile(file: &'static str, src: &str, arch: &str) -> Result<cudarc::nvrtc::Ptx, Error> {
    let opts = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++14".into()],
        name: Some(file.into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| Error::Compile {
        file,
        arch: arch.into(),
        log: match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })
}

/// Compile every kernel source for `arch` (e.g. `compute_90`) and return (file, PTX) pairs. Needs
/// libnvrtc only - no driver, no GPU - so it checks the `.cu` files on any machine that has NVRTC.
pub fn compile_sources(arch: &str) -> Result<Vec<(&'static str, String)>, Error> {
    // SAFETY: as in `driver_present`, for libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::NoNvrtc("libnvrtc.so could not be loaded".into()));
    }
    SOURCES.iter().map(|&(file, src)| Ok((file, compile(file, src, arch)?.to_src()))).collect()
}

fn kernels(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>, Error> {
    let ordinal = ctx.ordinal();
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, k)) = cache.iter().find(|(o, _)| *o == ordinal) {
        return Ok(k.clone());
    }
    // SAFETY: as in `driver_present`, for libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::NoNvrtc("libnvrtc.so could not be loaded".into()));
    }
    let (major, minor) = ctx.compute_capability().map_err(driver("cuDeviceGetAttribute(compute capability)"))?;
    let arch = format!("compute_{major}{minor}");
    let mut modules: Vec<Arc<CudaModule>> = Vec::new();
    for (file, src) in SOURCES {
        let ptx = compile(file, src, &arch)?;
        modules.push(ctx.load_module(ptx).map_err(driver(format!("cuModuleLoadData({file})")))?);
    }
    let f =
        |m: usize, name: &str| modules[m].load_function(name).map_err(driver(format!("cuModuleGetFunction({name})")));
    let k = Arc::new(Kernels {
        health_partial_f32: f(0, "health_partial_f32")?,
        health_partial_bf16: f(0, "health_partial_bf16")?,
        health_final: f(0, "health_final")?,
        scale_f32: f(1, "scale_f32")?,
        scale_bf16: f(1, "scale_bf16")?,
        adamw_update_f32: f(2, "adamw_update_f32")?,
    });
    cache.push((ordinal, k.clone()));
    Ok(k)
}

fn elem_grid(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(ELEM_THREADS as u64).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (ELEM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One CUDA device and the stream its kernels run on.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Arc<Kernels>,
    /// The health scan's partial rows (4 words per tile, then 4 for the result), grown as needed.
    scratch: Mutex<Option<CudaSlice<u64>>>,
}

impl Gpu {
    /// Device `ordinal`, with a new stream; compiles the kernels at the first use of the device.
    pub fn new(ordinal: usize) -> Result<Gpu, Error> {
        let n = probe()?;
        if ordinal >= n {
            return Err(Error::NoCudaDevice(format!("device {ordinal} asked for, the driver sees {n}")));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver(format!("cuDevicePrimaryCtxRetain({ordinal})")))?;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let k = kernels(&ctx)?;
        Ok(Gpu { ctx, stream, k, scratch: Mutex::new(None) })
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

    /// A host copy of `x` (synchronizes).
    pub fn download<T: Elem, S: DevicePtr<T>>(&self, x: &S) -> Result<Vec<T>, Error> {
        let v = self.stream.clone_dtoh(x).map_err(driver("copy device to host"))?;
        self.synchronize()?;
        Ok(v)
    }

    /// Device-to-device copy of `src` into `dst` (same length), on the stream: the bandwidth the
    /// health scan is measured against.
    pub fn copy<T: Elem, S: DevicePtr<T>, D: DevicePtrMut<T>>(&self, src: &S, dst: &mut D) -> Result<(), Error> {
        if src.len() != dst.len() {
            return Err(Error::Shape { what: "copy", detail: format!("{} vs {}", src.len(), dst.len()) });
        }
        self.stream.memcpy_dtod(src, dst).map_err(driver("cuMemcpyDtoDAsync"))
    }

    /// The fused health scan of `x` (f32): NaN and Inf counts, f64 sum of squares of the finite
    /// elements, first non-finite index. Synchronizes (the result is a host value).
    pub fn health_scan<S: DevicePtr<f32>>(&self, x: &S) -> Result<Health, Error> {
        self.scan(x, &self.k.health_partial_f32)
    }

    /// The health scan of bf16 elements (raw 16-bit words), widened exactly to f32.
    pub fn health_scan_bf16<S: DevicePtr<u16>>(&self, x: &S) -> Result<Health, Error> {
        self.scan(x, &self.k.health_partial_bf16)
    }

    fn scan<T, S: DevicePtr<T>>(&self, x: &S, partial: &CudaFunction) -> Result<Health, Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(Health::default());
        }
        let tiles = n.div_ceil(HEALTH_TILE);
        let grid = u32::try_from(tiles).map_err(|_| Error::Shape {
            what: "health_scan",
            detail: format!("{n} elements is more than 2^31 tiles"),
        })?;
        let words = 4 * tiles as usize + 4;
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let big_enough = matches!(scratch.as_ref(), Some(s) if s.len() >= words);
        if !big_enough {
            *scratch = Some(self.zeros::<u64>(words)?);
        }
        let part = scratch.as_mut().expect("allocated just above");
        {
            let (xp, _x_sync) = x.device_ptr(&self.stream);
            let (pp, _p_sync) = part.device_ptr_mut(&self.stream);
            let out = pp + 8 * 4 * tiles;
            let mut b = self.stream.launch_builder(partial);
            b.arg(&xp).arg(&n).arg(&pp);
            let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (HEALTH_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: `health_partial_*(const T *x, u64 n, u64 *part)`: `xp` holds `n` elements of
            // the kernel's dtype (`S: DevicePtr<T>`, and `partial` is the kernel of that dtype);
            // tile `b < grid = ceil(n / TILE)` reads indices below `n` only and writes words
            // 4b..4b+4 < 4 * tiles <= part.len(). Both pointers stay valid until the stream is
            // synchronized below (the sync guards record the use on this stream).
            unsafe { b.launch(cfg) }.map_err(driver("launch health_partial"))?;
            let mut b = self.stream.launch_builder(&self.k.health_final);
            b.arg(&pp).arg(&tiles).arg(&out);
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (FINAL_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: `health_final(const u64 *part, u64 tiles, u64 *out)` reads the 4 * tiles words
            // written by the launch before it on the same stream and writes the 4 words after them,
            // inside `part` (length >= 4 * tiles + 4).
            unsafe { b.launch(cfg) }.map_err(driver("launch health_final"))?;
        }
        let mut row = [0u64; 4];
        let view = part.slice(4 * tiles as usize..4 * tiles as usize + 4);
        self.stream.memcpy_dtoh(&view, &mut row).map_err(driver("copy health row to host"))?;
        self.synchronize()?;
        Ok(Health {
            nan: row[0],
            inf: row[1],
            sumsq: f64::from_bits(row[2]),
            first_bad: (row[3] != NO_BAD).then_some(row[3]),
        })
    }

    /// `x[i] *= s` (f32), enqueued on the stream.
    pub fn scale<D: DevicePtrMut<f32>>(&self, x: &mut D, s: f32) -> Result<(), Error> {
        self.scale_with(x, s, &self.k.scale_f32)
    }

    /// `x[i] *= s` on bf16 elements (raw 16-bit words), rounded to nearest even.
    pub fn scale_bf16<D: DevicePtrMut<u16>>(&self, x: &mut D, s: f32) -> Result<(), Error> {
        self.scale_with(x, s, &self.k.scale_bf16)
    }

    fn scale_with<T, D: DevicePtrMut<T>>(&self, x: &mut D, s: f32, f: &CudaFunction) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let (xp, _x_sync) = x.device_ptr_mut(&self.stream);
        let mut b = self.stream.launch_builder(f);
        b.arg(&xp).arg(&n).arg(&s);
        // SAFETY: `scale_*(T *x, u64 n, float s)` with a grid-stride loop over i < n; `xp` holds `n`
        // elements of the kernel's dtype and is recorded as in use on this stream.
        unsafe { b.launch(elem_grid(n)) }.map_err(driver("launch scale"))?;
        Ok(())
    }

    /// AdamW, the CPU `adamw_update`'s arithmetic (same bits): params, grads, m, v: (N).
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
    ) -> Result<(), Error>
    where
        P: DevicePtrMut<f32>,
        G: DevicePtr<f32>,
        M: DevicePtrMut<f32>,
        V: DevicePtrMut<f32>,
    {
        let n = params.len();
        if grads.len() != n || m.len() != n || v.len() != n {
            return Err(Error::Shape {
                what: "adamw_update",
                detail: format!("params {n}, grads {}, m {}, v {}", grads.len(), m.len(), v.len()),
            });
        }
        let s = AdamwScalars::new(lr, beta1, beta2, weight_decay, t);
        if n == 0 {
            return Ok(());
        }
        let n = n as u64;
        let (pp, _p_sync) = params.device_ptr_mut(&self.stream);
        let (gp, _g_sync) = grads.device_ptr(&self.stream);
        let (mp, _m_sync) = m.device_ptr_mut(&self.stream);
        let (vp, _v_sync) = v.device_ptr_mut(&self.stream);
        let mut b = self.stream.launch_builder(&self.k.adamw_update_f32);
        b.arg(&pp).arg(&gp).arg(&mp).arg(&vp).arg(&n);
        b.arg(&s.one_minus_beta1).arg(&beta2).arg(&s.one_minus_beta2).arg(&eps);
        b.arg(&s.decay).arg(&s.step_size).arg(&s.bc2_sqrt);
        // SAFETY: `adamw_update_f32(float *params, const float *grads, float *m, float *v, u64 n,
        // float x7)`: the four buffers hold `n` f32 each (checked above), the kernel touches i < n
        // only, and the argument list matches the kernel's in number, order and types.
        unsafe { b.launch(elem_grid(n)) }.map_err(driver("launch adamw_update"))?;
        Ok(())
    }
}
