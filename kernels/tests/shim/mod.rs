//! The harness of the CUDA shim (`kernels/shim/cuda_shim.h`): builds one kernel source of
//! `kernels/cuda/` for the CPU with `g++`, loads it, and launches its kernels, so that the tests
//! run the very `.cu` files the GPU runs against their CPU twins on a machine without a GPU. The
//! header's comment says what the shim emulates exactly and what it does not.
//!
//! Invariants: each source is compiled once per test process, from the text the library embeds
//! (`gradbus_kernels::cuda_grid::SOURCES`, so any crate's tests can use this harness by `#[path]`),
//! into a file of its own (the pid in the name: test binaries run at once), loaded, and the file
//! removed. The shim's state (the
//! fibers, `threadIdx`, ...) is per library and not reentrant, so every launch holds the library's
//! lock. Without `g++` the caller gets `None` after a `SKIPPED` line (capability `cxx`).
#![allow(dead_code)]

use std::ffi::{c_int, c_uint, c_void, CString};
use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

#[path = "../../../tests/common/skip.rs"]
mod skip;

type LaunchFn = unsafe extern "C" fn(c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_int, Call, *mut c_void) -> c_int;
type Call = unsafe extern "C" fn(*mut c_void);

/// The math library the kernels call: glibc's (the CPU twins' own), or one `ulps` from it (every
/// result moved by `ulps`: up, or down when negative; or by -|ulps|..|ulps| with `spread`): the
/// header's `SHIM_LIBM_ULPS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Libm {
    Glibc,
    Off { ulps: i32, spread: bool },
}

/// One `.cu` file built for the CPU and loaded.
pub struct Lib {
    file: &'static str,
    libm: Libm,
    handle: usize,
    launch: LaunchFn,
    lock: Mutex<()>,
}

/// The shim, and the shim's own test kernels (kernels/shim/).
const SHIM_HEADER: &str = include_str!("../../shim/cuda_shim.h");
/// The math library's nudge (`Libm::Off`), inlined where the header includes it.
const NUDGE_HEADER: &str = include_str!("../../shim/libm_nudge.h");
const SELFTEST: &str = include_str!("../../shim/selftest.cu");

/// The text of `file`: a source of `cuda_grid::SOURCES`, or `selftest.cu`.
fn source(file: &str) -> &'static str {
    if file == "selftest.cu" {
        return SELFTEST;
    }
    gradbus_kernels::cuda_grid::SOURCES
        .iter()
        .find(|s| s.file == file)
        .unwrap_or_else(|| panic!("no kernel source {file}"))
        .text
}

/// `kernels/cuda/<file>` (or the shim's `selftest.cu`) built and loaded (once per process), or `None` after a `SKIPPED` line
/// when this machine has no `g++`. A source that does not compile is a panic with g++'s output.
pub fn lib(file: &'static str) -> Option<&'static Lib> {
    lib_with(file, Libm::Glibc)
}

/// [`lib`] with the math library `libm`.
pub fn lib_with(file: &'static str, libm: Libm) -> Option<&'static Lib> {
    static LIBS: Mutex<Vec<&'static Lib>> = Mutex::new(Vec::new());
    static GXX: OnceLock<Result<(), String>> = OnceLock::new();
    let gxx = GXX.get_or_init(|| match Command::new("g++").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!("`g++ --version` failed: {}", String::from_utf8_lossy(&o.stderr))),
        Err(e) => Err(format!("g++ not found ({e}); scripts/test.sh installs it")),
    });
    if let Err(why) = gxx {
        skip::skip("cxx", &format!("the CUDA shim needs a C++ compiler: {why}"));
        return None;
    }
    let mut libs = LIBS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = libs.iter().find(|l| l.file == file && l.libm == libm) {
        return Some(l);
    }
    let l: &'static Lib = Box::leak(Box::new(build(file, libm)));
    libs.push(l);
    Some(l)
}

fn build(file: &'static str, libm: Libm) -> Lib {
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-shim");
    std::fs::create_dir_all(&out_dir).expect("create the shim's build folder");
    let defines: Vec<String> = match libm {
        Libm::Glibc => vec![],
        Libm::Off { ulps, spread } => {
            let mut d = vec![format!("-DSHIM_LIBM_ULPS={}", if spread { ulps.abs() } else { ulps })];
            if spread {
                d.push("-DSHIM_LIBM_SPREAD".into());
            }
            d
        }
    };
    let tag: String = defines.concat().chars().filter(|c| c.is_ascii_alphanumeric()).collect();
    let stem = format!("{}-{}-{tag}-{}", file.trim_end_matches(".cu"), std::process::id(), ulps_sign(libm));
    let (src, header, so) =
        (out_dir.join(format!("{stem}.cu")), out_dir.join(format!("{stem}.h")), out_dir.join(format!("{stem}.so")));
    std::fs::write(&src, source(file)).expect("write the kernel source");
    let text = SHIM_HEADER.replace("#include \"libm_nudge.h\"", NUDGE_HEADER);
    std::fs::write(&header, text).expect("write the shim header");
    // No -march: no FMA contraction possible; -ffp-contract=off says it anyway (NVRTC --fmad=false).
    let out = Command::new("g++")
        .args(["-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"])
        .args(["-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function", "-Werror", "-Wl,-Bsymbolic"])
        .args(&defines)
        .arg("-include")
        .arg(&header)
        .args(["-x", "c++"])
        .arg(&src)
        .arg("-o")
        .arg(&so)
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "g++ could not build {file} against the shim:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = (std::fs::remove_file(&src), std::fs::remove_file(&header));
    let path = CString::new(so.to_str().expect("a UTF-8 path")).unwrap();
    // SAFETY: dlopen of a library just built from our own sources; its initialisers are the C++
    // runtime's (no static constructors in the kernels or the shim).
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "dlopen {}: {}", so.display(), dlerror());
    let _ = std::fs::remove_file(&so);
    let mut lib = Lib { file, libm, handle: handle as usize, launch: launch_unset, lock: Mutex::new(()) };
    // SAFETY: `shim_launch` is defined by cuda_shim.h with exactly `LaunchFn`'s signature.
    lib.launch = unsafe { lib.sym::<LaunchFn>("shim_launch") };
    lib
}

/// "m" for a math library moved down (the tag of its build's file name), else "p".
fn ulps_sign(libm: Libm) -> &'static str {
    match libm {
        Libm::Off { ulps, .. } if ulps < 0 => "m",
        _ => "p",
    }
}

unsafe extern "C" fn launch_unset(
    _: c_uint,
    _: c_uint,
    _: c_uint,
    _: c_uint,
    _: c_uint,
    _: c_uint,
    _: c_int,
    _: Call,
    _: *mut c_void,
) -> c_int {
    1
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc, read at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

impl Lib {
    /// The symbol `name` as a function pointer of type `F`.
    ///
    /// # Safety
    /// `F` must be an `extern "C"` function pointer type matching the symbol's C signature.
    pub unsafe fn sym<F: Copy>(&self, name: &str) -> F {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        let c = CString::new(name).unwrap();
        // SAFETY: `handle` is a live dlopen handle (never closed).
        let p = unsafe { libc::dlsym(self.handle as *mut c_void, c.as_ptr()) };
        assert!(!p.is_null(), "{}: no symbol {name}", self.file);
        // SAFETY: the caller promises `F` is the symbol's function pointer type; sizes checked.
        unsafe { std::mem::transmute_copy(&p) }
    }

    /// Run `call` (which calls one kernel of this library with its arguments) on a grid of `grid`
    /// blocks of `block` threads, blocks and threads in index order or in `reverse` order. Panics
    /// when the shim refuses the launch (a bad shape, a barrier not every thread reached).
    pub fn launch(&self, grid: (u32, u32, u32), block: (u32, u32, u32), reverse: bool, call: &dyn Fn()) {
        unsafe extern "C" fn tramp(arg: *mut c_void) {
            // SAFETY: `arg` points at the `&dyn Fn()` below, alive for the whole launch.
            let f = unsafe { &*(arg as *const &dyn Fn()) };
            f();
        }
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut call = call;
        let arg = &mut call as *mut &dyn Fn() as *mut c_void;
        // SAFETY: `shim_launch` calls `tramp(arg)` once per emulated thread, on this OS thread, before
        // it returns; the lock keeps other launches of this library out meanwhile.
        let rc =
            unsafe { (self.launch)(grid.0, grid.1, grid.2, block.0, block.1, block.2, reverse as c_int, tramp, arg) };
        assert_eq!(rc, 0, "{}: the shim refused the launch {grid:?} x {block:?} (see stderr)", self.file);
    }
}

/// `run(reverse)` in index order and in reverse order, asserting both give the same bits (the
/// kernel's result does not depend on the order of its blocks and threads), and the result.
pub fn both_orders<T: PartialEq + std::fmt::Debug>(what: &str, run: impl Fn(bool) -> T) -> T {
    let fwd = run(false);
    let rev = run(true);
    assert!(fwd == rev, "{what}: the result depends on the order of blocks and threads");
    fwd
}
