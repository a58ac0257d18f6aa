//! The CUDA kernels against the CPU ones, on fresh random inputs with NaN, Inf, denormals and huge
//! values. Without a CUDA driver (or device) every GPU test prints a `SKIPPED: ...` line straight to
//! stderr (past the test harness's capture, so the skip shows in the output; `tests/common/skip.rs`)
//! and returns; the test of the no-driver path runs instead. `GRADBUS_REQUIRE=cuda` turns those
//! skips into failures on a machine that has a GPU.
//!
//! Tolerances: `scale` and `adamw_update` must give the CPU's bits (same f32 operations, no FMA, IEEE
//! division and square root, no flush-to-zero). The health scan must give the CPU's counts and first
//! index exactly; its sum of squares adds the same exact f64 squares in another order, so it may
//! differ in the last bits: 1e-12 relative is ~10^4 times the worst rounding of these lengths.
#![cfg(feature = "cuda")]

use std::io::Write;

#[path = "../../tests/common/skip.rs"]
mod skip;

use gradbus_kernels::cuda::{self, Gpu};
use gradbus_kernels::ops::{adamw_update, scale};
use gradbus_kernels::rng::Rng;
use gradbus_kernels::{health_scan, Error, Health};
use skip::skip;

/// Print past the harness's output capture (numbers of the benchmark).
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// Device 0, or `None` after a `SKIPPED` line when this machine has no driver or no device.
fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e @ Error::NoCudaDriver(_)) => {
            skip("cuda", &format!("no CUDA driver ({test}: {e})"));
            None
        }
        Err(e @ Error::NoCudaDevice(_)) => {
            skip("cuda", &format!("no CUDA device ({test}: {e})"));
            None
        }
        Err(e) => panic!("{test}: a CUDA driver is present but the backend failed: {e}"),
    }
}

const SPECIALS: [f32; 9] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::MAX,
    -f32::MAX,
    1e-45, // the smallest denormal
    -1e-40,
    -0.0,
    1e21, // its square overflows f32, not f64
];

/// `n` values of a random magnitude with about `bad` special values at random places.
fn random_input(rng: &mut Rng, n: usize, specials: usize) -> Vec<f32> {
    let mag = 10f32.powi(rng.below(50) as i32 - 25);
    let mut x: Vec<f32> = (0..n).map(|_| rng.normal() * mag).collect();
    for _ in 0..specials.min(n) {
        let k = rng.below(n);
        x[k] = SPECIALS[rng.below(SPECIALS.len())];
    }
    x
}

/// Lengths around the tile (8192) and block (1024) boundaries, and a few large ones.
fn lengths(rng: &mut Rng) -> Vec<usize> {
    let mut v = vec![0, 1, 2, 31, 255, 256, 1023, 1024, 8191, 8192, 8193, 16_384, 3 * 8192 + 17];
    v.extend((0..8).map(|_| rng.below(200_000)));
    v.push(1 << 22);
    v.push((1 << 22) + 5);
    v
}

fn same_health(gpu: &Health, cpu: &Health, what: &str) {
    assert_eq!((gpu.nan, gpu.inf, gpu.first_bad), (cpu.nan, cpu.inf, cpu.first_bad), "{what}: counts");
    let tol = 1e-12 * cpu.sumsq.abs();
    assert!((gpu.sumsq - cpu.sumsq).abs() <= tol, "{what}: sum of squares {} (GPU) vs {} (CPU)", gpu.sumsq, cpu.sumsq);
}

/// Equal bits, or both NaN (the GPU's NaN results are canonical, the CPU's keep a payload).
fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn health_scan_matches_the_cpu_and_repeats_bitwise() {
    let Some(g) = gpu("health_scan") else { return };
    let mut rng = Rng::new(&[0xc0da, 1]);
    for (case, n) in lengths(&mut rng).into_iter().enumerate() {
        for specials in [0, 1, 3, n / 100] {
            let x = random_input(&mut rng, n, specials);
            let d = g.upload(&x).unwrap();
            let got = g.health_scan(&d).unwrap();
            same_health(&got, &health_scan(&x), &format!("case {case}: n {n}, {specials} specials"));
            let again = g.health_scan(&d).unwrap();
            assert_eq!(got.sumsq.to_bits(), again.sumsq.to_bits(), "case {case}: not repeatable");
            assert_eq!(got, again, "case {case}: not repeatable");
            // A view that starts off the tile grid: the first bad index is relative to the view.
            if n > 10 {
                let v = d.slice(7..n - 3);
                same_health(&g.health_scan(&v).unwrap(), &health_scan(&x[7..n - 3]), &format!("case {case}: view"));
            }
        }
    }
}

#[test]
fn health_scan_bf16_matches_the_cpu_scan_of_the_widened_values() {
    let Some(g) = gpu("health_scan_bf16") else { return };
    let mut rng = Rng::new(&[0xc0da, 2]);
    for (case, n) in lengths(&mut rng).into_iter().enumerate() {
        // Truncate f32 to bf16 words; widening them back is exact.
        let words: Vec<u16> =
            random_input(&mut rng, n, n / 50 + 1).iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let wide: Vec<f32> = words.iter().map(|&w| f32::from_bits((w as u32) << 16)).collect();
        let got = g.health_scan_bf16(&g.upload(&words).unwrap()).unwrap();
        same_health(&got, &health_scan(&wide), &format!("bf16 case {case}: n {n}"));
    }
}

#[test]
fn scale_is_bitwise_the_cpu_scale() {
    let Some(g) = gpu("scale") else { return };
    let mut rng = Rng::new(&[0xc0da, 3]);
    for (case, n) in lengths(&mut rng).into_iter().enumerate() {
        let x = random_input(&mut rng, n, n / 20 + 1);
        let s = [0.5, 1.0 / 3.0, 1e-30, 3e20, -0.0][case % 5];
        let mut d = g.upload(&x).unwrap();
        g.scale(&mut d, s).unwrap();
        let got = g.download(&d).unwrap();
        let mut want = x.clone();
        scale(&mut want, s);
        for i in 0..n {
            assert!(same_f32(got[i], want[i]), "case {case}: x[{i}] = {} * {s}: GPU {} CPU {}", x[i], got[i], want[i]);
        }
    }
}

/// bf16 of an f32 by round to nearest even (NaN stays NaN).
fn bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if f.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

#[test]
fn scale_bf16_rounds_to_nearest_even() {
    let Some(g) = gpu("scale_bf16") else { return };
    let mut rng = Rng::new(&[0xc0da, 4]);
    for (case, n) in lengths(&mut rng).into_iter().enumerate() {
        let words: Vec<u16> = random_input(&mut rng, n, n / 20 + 1).iter().map(|&v| bf16(v)).collect();
        let s = [0.5, 1.0 / 3.0, 1e-30, 3e20, 0.999][case % 5];
        let mut d = g.upload(&words).unwrap();
        g.scale_bf16(&mut d, s).unwrap();
        let got = g.download(&d).unwrap();
        for i in 0..n {
            let want = bf16(f32::from_bits((words[i] as u32) << 16) * s);
            let (a, b) = (f32::from_bits((got[i] as u32) << 16), f32::from_bits((want as u32) << 16));
            assert!(same_f32(a, b), "case {case}: word {:#06x} * {s}: GPU {:#06x} CPU {want:#06x}", words[i], got[i]);
        }
    }
}

#[test]
fn adamw_update_is_bitwise_the_cpu_update() {
    let Some(g) = gpu("adamw_update") else { return };
    let mut rng = Rng::new(&[0xc0da, 5]);
    for (case, n) in lengths(&mut rng).into_iter().enumerate() {
        let mut p = random_input(&mut rng, n, 0);
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let (mut dp, mut dm, mut dv) = (g.upload(&p).unwrap(), g.upload(&m).unwrap(), g.upload(&v).unwrap());
        let (lr, wd) = ([1e-3, 3e-4, 1.0][case % 3], [0.0, 0.01, 0.1][case % 3]);
        for t in 1..=4u64 {
            let grads = random_input(&mut rng, n, if t == 4 { n / 50 + 1 } else { 0 });
            let dg = g.upload(&grads).unwrap();
            g.adamw_update(&mut dp, &dg, &mut dm, &mut dv, lr, 0.9, 0.999, 1e-8, wd, t).unwrap();
            adamw_update(&mut p, &grads, &mut m, &mut v, lr, 0.9, 0.999, 1e-8, wd, t);
            for (name, dev, host) in [("params", &dp, &p), ("m", &dm, &m), ("v", &dv, &v)] {
                let got = g.download(dev).unwrap();
                for i in 0..n {
                    assert!(
                        same_f32(got[i], host[i]),
                        "case {case} step {t}: {name}[{i}] GPU {} CPU {} (grad {})",
                        got[i],
                        host[i],
                        grads[i]
                    );
                }
            }
        }
    }
}

#[test]
fn adamw_update_rejects_mismatched_lengths() {
    let Some(g) = gpu("adamw_update lengths") else { return };
    let (mut p, gr, mut m, mut v) =
        (g.zeros::<f32>(8).unwrap(), g.zeros::<f32>(7).unwrap(), g.zeros(8).unwrap(), g.zeros(8).unwrap());
    let e = g.adamw_update(&mut p, &gr, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}

/// The `.cu` sources compile with NVRTC for the architectures gradbus targets, and export every
/// kernel the backend loads. Needs libnvrtc only (no driver, no GPU): it runs wherever NVRTC is
/// installed, e.g. from the `nvidia-cuda-nvrtc-cu12` wheel with its folder on LD_LIBRARY_PATH.
#[test]
fn kernel_sources_compile_with_nvrtc() {
    for arch in ["compute_80", "compute_90"] {
        let ptx = match cuda::compile_sources(arch) {
            Ok(p) => p,
            Err(e @ Error::NoNvrtc(_)) => {
                skip("nvrtc", &format!("no NVRTC (kernel_sources_compile_with_nvrtc: {e})"));
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let all: String = ptx.iter().map(|(_, p)| p.as_str()).collect();
        for name in
            ["health_partial_f32", "health_partial_bf16", "health_final", "scale_f32", "scale_bf16", "adamw_update_f32"]
        {
            assert!(all.contains(&format!(".entry {name}(")), "{arch}: no kernel {name} in the PTX");
        }
        // No FMA contraction in the kernels that promise the CPU's bits.
        let adamw = &ptx.iter().find(|(f, _)| *f == "adamw.cu").unwrap().1;
        assert!(!adamw.contains("fma.rn.f32"), "{arch}: adamw.cu was contracted to FMA");
    }
}

/// Without libcuda the API answers `NoCudaDriver`, it does not panic (cudarc itself would).
#[test]
fn without_a_driver_the_api_returns_no_cuda_driver() {
    if cuda::driver_present() {
        skip("no-cuda", "a CUDA driver is present (the no-driver path is tested on machines without one)");
        return;
    }
    assert!(matches!(cuda::probe(), Err(Error::NoCudaDriver(_))), "{:?}", cuda::probe());
    match Gpu::new(0) {
        Err(Error::NoCudaDriver(msg)) => assert!(msg.contains("libcuda"), "{msg}"),
        Err(e) => panic!("expected NoCudaDriver, got {e}"),
        Ok(_) => panic!("a Gpu without a driver"),
    }
}

/// The health scan's read bandwidth against a device-to-device copy of the same buffer, in the same
/// run (`scripts/gpu-check.sh` runs it). A benchmark, not a test: it prints numbers, one
/// `THROUGHPUT` line per size, and asserts nothing about them.
#[test]
#[ignore = "benchmark: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn health_scan_throughput() {
    let Some(g) = gpu("health_scan_throughput") else { return };
    say(&format!("device: {}", g.name().unwrap_or_default()));
    for mib in [256usize, 1024] {
        let n = mib << 18; // f32 elements
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let x: Vec<f32> = (0..n)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        let src = g.upload(&x).unwrap();
        drop(x);
        let mut dst = g.zeros::<f32>(n).unwrap();
        let bytes = (n * 4) as f64;
        let time = |f: &mut dyn FnMut()| {
            for _ in 0..3 {
                f();
            }
            g.synchronize().unwrap();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                for _ in 0..10 {
                    f();
                }
                g.synchronize().unwrap();
                best = best.min(t0.elapsed().as_secs_f64() / 10.0);
            }
            best
        };
        let t_copy = time(&mut || g.copy(&src, &mut dst).unwrap());
        // Each scan ends with a 32-byte copy to the host and a stream sync (~10 us): included.
        let t_scan = time(&mut || {
            g.health_scan(&src).unwrap();
        });
        let copy_read = bytes / t_copy / 1e9;
        let scan = bytes / t_scan / 1e9;
        say(&format!(
            "THROUGHPUT {mib} MiB: health_scan {scan:.0} GB/s read ({:.1} us) | dtod copy {copy_read:.0} GB/s read, {:.0} GB/s read+write ({:.1} us) | scan/copy-read {:.0}% | scan/copy-read+write {:.0}%",
            t_scan * 1e6,
            2.0 * copy_read,
            t_copy * 1e6,
            100.0 * scan / copy_read,
            50.0 * scan / copy_read,
        ));
    }
}
