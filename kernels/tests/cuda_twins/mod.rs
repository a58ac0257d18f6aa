//! Every CUDA kernel against its CPU twin, written once for two executors of the same `.cu`
//! sources: the CPU shim (`cuda_shim.rs`, on every machine with `g++`) and a GPU (`cuda.rs`).
//! An [`Exec`] runs a kernel family with the CPU op's own signature on host slices; each `check_*`
//! draws fresh random inputs with NaN, Inf, denormals, -0.0 and huge values, runs the CPU twin and
//! the executor, and compares them with the op's tolerance. docs/gpu.md's table is this list.
//!
//! Tolerances (the reason in brackets):
//! - bitwise on both executors: scale, AdamW, the replica checksum, the encoder, layer norm, the
//!   residual, attention backward (from the CPU's att), the dense layer's bias (forward fill,
//!   backward sum), fill and the 2D copy [the same IEEE f32 operations on the same operands in the
//!   same order, and no `expf`/`logf`: --fmad=false, IEEE division and square root, no
//!   flush-to-zero, every sum in the CPU's index order];
//! - the health scan: NaN and Inf counts and the first bad index exact; the f64 sum of squares
//!   within 2 (n - 1) 2^-53 of the sum [both sum the same exact squares, in other orders: each is
//!   within (n - 1) 2^-53 of the exact sum];
//! - through `expf`/`logf` (GELU, attention forward, log-softmax-gather, the loss): bitwise on the
//!   shim with glibc's math library [its exp and log ARE the CPU's, so this checks the kernels' order
//!   of operations]; where the math library is another (a GPU; the shim with `Libm::Off`) within the
//!   op's [`Tol`] of a scale named per check, NaN exactly where the CPU's is [CUDA's expf is within 2
//!   ulp and logf 1 ulp of the exact value, glibc's within 1 ulp, so they differ by at most
//!   [`LIBM_ULPS`] = 3; each rtol is measured: `cuda_shim.rs` runs these checks with a math library 3
//!   ulps from glibc's (up, down, spread), prints the worst |kernel - CPU| / tolerance per op, and
//!   refuses one 4096 ulps off];
//! - the sampler: the CPU's token in every row; where the math library is another, a neighbour
//!   token (the tokens between weighing nothing) only when the draw lies within `sample_boundary`'s
//!   margin of their boundary [derived there from the same 3 ulps] - so every case can fail;
//! - the dense layer (cuBLAS SGEMM, GPU only): within 2 gamma_{k+1} of sum |a_i b_i| (+ |bias|),
//!   gamma_k = k 2^-24 / (1 - k 2^-24) [the classic bound of a k-term dot product in any order of
//!   f32 operations, fused or not: both results are within gamma_k of the exact value]. The shim
//!   cannot run cuBLAS: it runs the dense layer's bias kernels alone.
#![allow(dead_code)]

use gradbus_kernels::backend::{Backend, Cpu};
use gradbus_kernels::health::Health;
use gradbus_kernels::ops::{self, GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};
use gradbus_kernels::rng::Rng;
use gradbus_kernels::{checksum, health_scan, reference};

/// The tolerance of an op through `expf`/`logf` where the math library is not the CPU's (a GPU, or
/// the shim with `Libm::Off`): |kernel - CPU| <= `rtol` x the element's scale (named at each check)
/// + 2 ulp of the CPU's value, and non-finite exactly where the CPU's is.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    /// The op, as docs/gpu.md names it.
    pub op: &'static str,
    pub rtol: f32,
}

// Each rtol keeps room over the worst |kernel - CPU| / tolerance that the shim measures with a math
// library `LIBM_ULPS` from glibc's (3 up, 3 down, -3..3 spread: cuda_shim.rs prints it; docs/gpu.md
// has the table): 2x for GELU (one expf per element, so the shim's +3 and -3 are its extremes), 3x
// and more for the ops that sum several exps (where other signs of the errors could add up more).
/// GELU, forward and backward: worst 0.49 of it measured.
pub const GELU: Tol = Tol { op: "gelu", rtol: 1e-5 };
/// Attention's softmax and output: worst 0.28 of it measured.
pub const ATTENTION_FORWARD: Tol = Tol { op: "attention forward", rtol: 2e-6 };
/// log-softmax-gather, forward and backward: worst 0.16 of it measured.
pub const LOGSOFTMAX: Tol = Tol { op: "log-softmax-gather", rtol: 5e-6 };
/// The GRPO loss's chain (log-softmax, the two ratios' exps, k3, the gradients): worst 0.31 of it.
pub const GRPO: Tol = Tol { op: "grpo loss chain", rtol: 1e-5 };
/// Every tolerance, for the tables of the measurement.
pub const TOLS: [Tol; 4] = [GELU, ATTENTION_FORWARD, LOGSOFTMAX, GRPO];
/// How many ulps the math libraries' `expf`/`logf` may differ by: CUDA's within 2 (expf) and 1
/// (logf) ulp of the exact value, glibc's within 1: the sampler's bound and the shim's measurement.
pub const LIBM_ULPS: u32 = 3;

/// The largest |kernel - CPU| / tolerance seen per op (`Tol::op`) since the last `take_worst`: the
/// measurement behind each tolerance (cuda_shim.rs and cuda.rs print it).
static WORST: std::sync::Mutex<Vec<(&'static str, f64)>> = std::sync::Mutex::new(Vec::new());

fn record(op: &'static str, ratio: f64) {
    let mut w = WORST.lock().unwrap_or_else(|p| p.into_inner());
    match w.iter_mut().find(|(o, _)| *o == op) {
        Some((_, r)) => *r = r.max(ratio),
        None => w.push((op, ratio)),
    }
}

/// The worst ratio per op recorded so far, and a fresh start.
pub fn take_worst() -> Vec<(&'static str, f64)> {
    std::mem::take(&mut *WORST.lock().unwrap_or_else(|p| p.into_inner()))
}

/// A runner of the CUDA kernels on host slices, each method with its CPU op's signature.
pub trait Exec {
    /// "shim" or the GPU's name, for messages.
    fn name(&self) -> String;
    /// Whether `expf`/`logf` are the CPU's own (the shim): then every op is compared bitwise.
    fn cpu_libm(&self) -> bool;
    fn health_scan(&self, x: &[f32]) -> Health;
    fn health_scan_bf16(&self, x: &[u16]) -> Health;
    fn scale(&self, x: &mut [f32], s: f32);
    fn scale_bf16(&self, x: &mut [u16], s: f32);
    #[allow(clippy::too_many_arguments)]
    fn adamw_update(
        &self,
        params: &mut [f32],
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        t: u64,
    ) -> u64;
    fn checksum(&self, x: &[f32]) -> u64;
    #[allow(clippy::too_many_arguments)]
    fn encoder_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        wpe: &[f32],
        b: usize,
        t: usize,
        c: usize,
        v: usize,
    );
    #[allow(clippy::too_many_arguments)]
    fn encoder_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        tokens: &[u32],
        b: usize,
        t: usize,
        c: usize,
    );
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: &[f32],
        n: usize,
        c: usize,
    );
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        n: usize,
        c: usize,
    );
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32], n: usize);
    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32], n: usize);
    fn residual_forward(&self, out: &mut [f32], inp1: &[f32], inp2: &[f32], n: usize);
    fn residual_backward(&self, dinp1: &mut [f32], dinp2: &mut [f32], dout: &[f32], n: usize);
    #[allow(clippy::too_many_arguments)]
    fn attention_forward_rows(
        &self,
        out: &mut [f32],
        att: &mut [f32],
        inp: &[f32],
        stride: usize,
        b: usize,
        t0: usize,
        t: usize,
        c: usize,
        nh: usize,
    );
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dinp: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        att: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    );
    fn logsoftmax_gather_forward(
        &self,
        logp: &mut [f32],
        lse: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        n: usize,
        v: usize,
    );
    #[allow(clippy::too_many_arguments)]
    fn logsoftmax_gather_backward(
        &self,
        dlogits: &mut [f32],
        dlogp: &[f32],
        logits: &[f32],
        lse: &[f32],
        targets: &[u32],
        n: usize,
        v: usize,
    );
    #[allow(clippy::too_many_arguments)]
    fn grpo_forward(
        &self,
        s: &GrpoScalars,
        logp: &[f32],
        mask: &[f32],
        adv: &[f32],
        old: &[f32],
        reference: &[f32],
        b: usize,
        t: usize,
        saved: &mut GrpoSaved<Vec<f32>>,
    ) -> GrpoStats;
    #[allow(clippy::too_many_arguments)]
    fn grpo_backward(
        &self,
        s: &GrpoScalars,
        mask: &[f32],
        adv: &[f32],
        saved: &GrpoSaved<Vec<f32>>,
        denom: f32,
        b: usize,
        t: usize,
        grads: &mut GrpoGrads<Vec<f32>>,
    );
    /// The backend's `sample`: a token per sequence from the last position of logits (B, T, V).
    #[allow(clippy::too_many_arguments)]
    fn sample(&self, out: &mut [u32], logits: &[f32], b: usize, t: usize, v: usize, temperature: f32, uniforms: &[f32]);
    fn fill(&self, x: &mut [f32], value: f32);
    #[allow(clippy::too_many_arguments)]
    fn copy_2d(&self, dst: &mut [f32], dst_pitch: usize, src: &[f32], src_pitch: usize, width: usize, height: usize);
}

/// The dense layer (cuBLAS SGEMM and the bias kernels): a GPU only (the shim has no cuBLAS; it runs
/// the bias kernels alone, `cuda_shim.rs`).
pub trait ExecDense: Exec {
    #[allow(clippy::too_many_arguments)]
    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        bt: usize,
        c: usize,
        oc: usize,
    );
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        bt: usize,
        c: usize,
        oc: usize,
    );
}

pub const SPECIALS: [f32; 10] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::MAX,
    -f32::MAX,
    1e-45, // the smallest denormal
    -1e-40,
    -0.0,
    0.0,
    1e21, // its square overflows f32, not f64
];

/// `n` normal values of a random magnitude (1e-25 .. 1e25) with `specials` special values at
/// random places.
pub fn random_input(rng: &mut Rng, n: usize, specials: usize) -> Vec<f32> {
    let mag = 10f32.powi(rng.below(50) as i32 - 25);
    scaled_input(rng, n, mag, specials)
}

/// `n` normal values times `mag` with `specials` special values at random places.
pub fn scaled_input(rng: &mut Rng, n: usize, mag: f32, specials: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.normal() * mag).collect();
    for _ in 0..specials.min(n) {
        let k = rng.below(n);
        x[k] = SPECIALS[rng.below(SPECIALS.len())];
    }
    x
}

/// Lengths around the health scan's tile (32768) and the 256-thread blocks, and random ones.
pub fn lengths(rng: &mut Rng, big: bool) -> Vec<usize> {
    let mut v = vec![1, 2, 31, 255, 256, 257, 1023, 32_767, 32_768, 32_769, 3 * 32_768 + 17];
    v.extend((0..4).map(|_| 1 + rng.below(100_000)));
    if big {
        v.extend([1 << 22, (1 << 22) + 5]);
    }
    v
}

/// Equal bits, or both NaN (NaN payloads are not meaningful: the GPU's NaN is canonical).
pub fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Every element bitwise equal (or both NaN).
pub fn assert_bitwise(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(same_f32(g, w), "{what}[{i}]: kernel {g:e} ({:#010x}) CPU {w:e} ({:#010x})", g.to_bits(), w.to_bits());
    }
}

/// Bitwise where the executor's libm is the CPU's; else NaN exactly where the CPU's is, and every
/// other value within `tol` (`Tol`: rtol x |scale[i]| + 2 ulp of the CPU's value) - an infinity
/// only beside a finite value within that of overflowing to it (a product at f32::MAX: a few ulps of
/// a math library decide whether it overflows) - the worst ratio recorded (`take_worst`).
pub fn assert_libm_close(e: &dyn Exec, got: &[f32], want: &[f32], scale: &[f32], tol: Tol, what: &str) {
    if e.cpu_libm() {
        return assert_bitwise(got, want, what);
    }
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g.is_nan() || w.is_nan() || (g.is_infinite() && w.is_infinite()) {
            assert!(same_f32(g, w), "{what}[{i}]: kernel {g:e} CPU {w:e} (non-finite must match)");
            continue;
        }
        if g.is_infinite() || w.is_infinite() {
            let (inf, fin) = if g.is_infinite() { (g, w) } else { (w, g) };
            let t = tol.rtol * scale[i].abs() + 2.0 * ulp(fin);
            let room = (f32::MAX as f64 - fin.abs() as f64) / t as f64;
            assert!(
                inf.signum() == fin.signum() && room <= 1.0,
                "{what}[{i}]: kernel {g:e} CPU {w:e} (an infinity beside a value not within the tolerance of overflow)"
            );
            record(tol.op, room);
            continue;
        }
        let t = tol.rtol * scale[i].abs() + 2.0 * ulp(w);
        let d = (g - w).abs();
        record(tol.op, d as f64 / t as f64);
        assert!(d <= t, "{what}[{i}]: kernel {g:e} CPU {w:e}, |diff| {d:e} > {t:e} ({} tolerance)", tol.op);
    }
}

/// The spacing of f32 at `x`.
pub fn ulp(x: f32) -> f32 {
    let a = x.abs();
    if a == f32::MAX {
        return a - f32::from_bits(a.to_bits() - 1);
    }
    f32::from_bits(a.to_bits() + 1) - a
}

/// Health equal but for the sum of squares, within the bound of the module doc.
pub fn assert_health(got: &Health, want: &Health, n: usize, what: &str) {
    assert_eq!((got.nan, got.inf, got.first_bad), (want.nan, want.inf, want.first_bad), "{what}: counts");
    let tol = 2.0 * n.saturating_sub(1) as f64 * f64::EPSILON / 2.0 * want.sumsq;
    assert!(
        (got.sumsq - want.sumsq).abs() <= tol,
        "{what}: sum of squares {} (kernel) vs {} (CPU)",
        got.sumsq,
        want.sumsq
    );
}

pub fn check_health_scan(e: &dyn Exec, big: bool) {
    let mut rng = Rng::new(&[0xc0da, 1]);
    for (case, n) in lengths(&mut rng, big).into_iter().enumerate() {
        for specials in [0, 1, 3, n / 100] {
            let x = random_input(&mut rng, n, specials);
            let what = format!("{}: health_scan case {case}: n {n}, {specials} specials", e.name());
            assert_health(&e.health_scan(&x), &health_scan(&x), n, &what);
            // Off the 16-byte grid: the kernel's unaligned path.
            if n > 10 {
                assert_health(
                    &e.health_scan(&x[1..n - 3]),
                    &health_scan(&x[1..n - 3]),
                    n - 4,
                    &format!("{what}: view"),
                );
            }
        }
    }
    // All finite, the first and the last element bad, a norm that overflows f32 but not f64.
    let mut x = vec![1e21f32; 70_000];
    assert!(e.health_scan(&x).norm_overflows_f32());
    x[0] = f32::NAN;
    x[69_999] = f32::NEG_INFINITY;
    let h = e.health_scan(&x);
    assert_eq!((h.nan, h.inf, h.first_bad), (1, 1, Some(0)), "{}: ends", e.name());
}

pub fn check_health_scan_bf16(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 2]);
    for (case, n) in lengths(&mut rng, false).into_iter().enumerate() {
        // Truncate f32 to bf16 words; widening them back is exact.
        let words: Vec<u16> =
            random_input(&mut rng, n, n / 50 + 1).iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let wide: Vec<f32> = words.iter().map(|&w| f32::from_bits((w as u32) << 16)).collect();
        let what = format!("{}: health_scan_bf16 case {case}: n {n}", e.name());
        assert_health(&e.health_scan_bf16(&words), &health_scan(&wide), n, &what);
        if n > 10 {
            let view = &wide[3..n - 1];
            assert_health(
                &e.health_scan_bf16(&words[3..n - 1]),
                &health_scan(view),
                view.len(),
                &format!("{what}: view"),
            );
        }
    }
}

/// bf16 of an f32 by round to nearest even (a NaN stays a quiet NaN).
pub fn bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if f.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

pub fn check_scale(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 3]);
    for (case, n) in lengths(&mut rng, false).into_iter().enumerate() {
        let x = random_input(&mut rng, n, n / 20 + 1);
        let s = [0.5, 1.0 / 3.0, 1e-30, 3e20, -0.0][case % 5];
        let mut got = x.clone();
        e.scale(&mut got, s);
        let mut want = x;
        ops::scale(&mut want, s);
        assert_bitwise(&got, &want, &format!("{}: scale case {case} by {s}", e.name()));
        // bf16: the widened product rounded to nearest even.
        let words: Vec<u16> = random_input(&mut rng, n, n / 20 + 1).iter().map(|&v| bf16(v)).collect();
        let mut got = words.clone();
        e.scale_bf16(&mut got, s);
        let want: Vec<u16> = words.iter().map(|&w| bf16(f32::from_bits((w as u32) << 16) * s)).collect();
        let wide = |x: &[u16]| x.iter().map(|&w| f32::from_bits((w as u32) << 16)).collect::<Vec<_>>();
        assert_bitwise(&wide(&got), &wide(&want), &format!("{}: scale_bf16 case {case} by {s}", e.name()));
    }
}

pub fn check_adamw_and_checksum(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 5]);
    for (case, n) in lengths(&mut rng, false).into_iter().enumerate() {
        let mut p = random_input(&mut rng, n, 0);
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let (mut dp, mut dm, mut dv) = (p.clone(), m.clone(), v.clone());
        let (lr, wd) = ([1e-3, 3e-4, 1.0][case % 3], [0.0, 0.01, 0.1][case % 3]);
        for t in 1..=3u64 {
            let grads = random_input(&mut rng, n, if t == 3 { n / 50 + 1 } else { 0 });
            let got = e.adamw_update(&mut dp, &grads, &mut dm, &mut dv, lr, 0.9, 0.999, 1e-8, wd, t);
            let want = ops::adamw_update(&mut p, &grads, &mut m, &mut v, lr, 0.9, 0.999, 1e-8, wd, t);
            let what = format!("{}: adamw case {case} (n {n}) step {t}", e.name());
            assert_bitwise(&dp, &p, &format!("{what}: params"));
            assert_bitwise(&dm, &m, &format!("{what}: m"));
            assert_bitwise(&dv, &v, &format!("{what}: v"));
            // NaN payloads differ (GPU NaNs are canonical): the checksums agree when none is NaN.
            if p.iter().all(|x| !x.is_nan()) {
                assert_eq!(got, want, "{what}: the replica checksum");
            }
        }
        let x = random_input(&mut rng, n, 3);
        assert_eq!(e.checksum(&x), checksum(&x), "{}: checksum n {n}", e.name());
        assert_eq!(e.checksum(&x), reference::checksum(&x), "{}: checksum n {n} (naive twin)", e.name());
    }
}

/// Model shapes (B, T, C, NH, V) the model-op checks run on: tiny, odd, a head size of 1, long rows.
pub const SHAPES: [(usize, usize, usize, usize, usize); 5] =
    [(2, 5, 8, 2, 7), (3, 9, 64, 4, 16), (1, 1, 12, 3, 5), (4, 16, 4, 4, 33), (2, 33, 48, 3, 300)];

fn tokens(rng: &mut Rng, n: usize, v: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(v) as u32).collect()
}

pub fn check_encoder(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 6]);
    for (case, &(b, t, c, _, v)) in SHAPES.iter().enumerate() {
        let toks = tokens(&mut rng, b * t, v);
        let (wte, wpe) = (random_input(&mut rng, v * c, case), random_input(&mut rng, t * c, 1));
        let (mut got, mut want) = (vec![0f32; b * t * c], vec![0f32; b * t * c]);
        e.encoder_forward(&mut got, &toks, &wte, &wpe, b, t, c, v);
        ops::encoder_forward(&mut want, &toks, &wte, &wpe, b, t, c, v);
        assert_bitwise(&got, &want, &format!("{}: encoder_forward shape {case}", e.name()));
        let dout = random_input(&mut rng, b * t * c, case);
        let (mut gwte, mut gwpe) = (random_input(&mut rng, v * c, 0), random_input(&mut rng, t * c, 0));
        let (mut wwte, mut wwpe) = (gwte.clone(), gwpe.clone());
        e.encoder_backward(&mut gwte, &mut gwpe, &dout, &toks, b, t, c);
        ops::encoder_backward(&mut wwte, &mut wwpe, &dout, &toks, b, t, c);
        assert_bitwise(&gwte, &wwte, &format!("{}: encoder_backward dwte shape {case}", e.name()));
        assert_bitwise(&gwpe, &wwpe, &format!("{}: encoder_backward dwpe shape {case}", e.name()));
    }
}

pub fn check_layernorm(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 7]);
    for (case, &(b, t, c, _, _)) in SHAPES.iter().enumerate() {
        let n = b * t;
        let inp = random_input(&mut rng, n * c, case % 3);
        let (w, bias) = (random_input(&mut rng, c, 0), random_input(&mut rng, c, 0));
        let mut got = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
        let mut want = got.clone();
        e.layernorm_forward(&mut got.0, &mut got.1, &mut got.2, &inp, &w, &bias, n, c);
        ops::layernorm_forward(&mut want.0, &mut want.1, &mut want.2, &inp, &w, &bias, n, c);
        let what = format!("{}: layernorm_forward shape {case}", e.name());
        assert_bitwise(&got.0, &want.0, &format!("{what}: out"));
        assert_bitwise(&got.1, &want.1, &format!("{what}: mean"));
        assert_bitwise(&got.2, &want.2, &format!("{what}: rstd"));
        let dout = random_input(&mut rng, n * c, case % 2);
        let mut g = (random_input(&mut rng, n * c, 0), random_input(&mut rng, c, 0), random_input(&mut rng, c, 0));
        let mut w2 = g.clone();
        e.layernorm_backward(&mut g.0, &mut g.1, &mut g.2, &dout, &inp, &w, &want.1, &want.2, n, c);
        ops::layernorm_backward(&mut w2.0, &mut w2.1, &mut w2.2, &dout, &inp, &w, &want.1, &want.2, n, c);
        let what = format!("{}: layernorm_backward shape {case}", e.name());
        assert_bitwise(&g.0, &w2.0, &format!("{what}: dinp"));
        assert_bitwise(&g.1, &w2.1, &format!("{what}: dweight"));
        assert_bitwise(&g.2, &w2.2, &format!("{what}: dbias"));
    }
}

pub fn check_gelu_and_residual(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 8]);
    for (case, n) in lengths(&mut rng, false).into_iter().enumerate() {
        // GELU's interesting range is |x| < 10; a few huge and special values too.
        let mag = [0.1, 1.0, 3.0, 30.0, 1e20][case % 5];
        let x = scaled_input(&mut rng, n, mag, n / 50 + 1);
        let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
        e.gelu_forward(&mut got, &x, n);
        ops::gelu_forward(&mut want, &x, n);
        // out = x/2 (1 + tanh(u)): tanh's error times |x| / 2.
        assert_libm_close(e, &got, &want, &x, GELU, &format!("{}: gelu_forward case {case}", e.name()));
        let dout = scaled_input(&mut rng, n, 1.0, 1);
        let init = random_input(&mut rng, n, 0);
        let (mut got, mut want) = (init.clone(), init.clone());
        e.gelu_backward(&mut got, &x, &dout, n);
        ops::gelu_backward(&mut want, &x, &dout, n);
        // dinp += gelu'(x) dout, |gelu'| <= 1 + |x| (the 2 ulp cover the final add to init).
        let scale: Vec<f32> = x.iter().zip(&dout).map(|(x, d)| d * (1.0 + x.abs())).collect();
        assert_libm_close(e, &got, &want, &scale, GELU, &format!("{}: gelu_backward case {case}", e.name()));

        let y = random_input(&mut rng, n, 2);
        let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
        e.residual_forward(&mut got, &x, &y, n);
        ops::residual_forward(&mut want, &x, &y, n);
        assert_bitwise(&got, &want, &format!("{}: residual_forward case {case}", e.name()));
        let (mut g1, mut g2) = (random_input(&mut rng, n, 1), random_input(&mut rng, n, 0));
        let (mut w1, mut w2) = (g1.clone(), g2.clone());
        e.residual_backward(&mut g1, &mut g2, &y, n);
        ops::residual_backward(&mut w1, &mut w2, &y, n);
        assert_bitwise(&g1, &w1, &format!("{}: residual_backward d1 case {case}", e.name()));
        assert_bitwise(&g2, &w2, &format!("{}: residual_backward d2 case {case}", e.name()));
    }
}

/// sum_t2 |att[t2] v[t2]| for every output element of `attention_forward_rows` (B, t - t0, C): the
/// scale of the output's error. inp: (B, stride, 3C) with v at offset 2C; att: (B, NH, t - t0, t).
#[allow(clippy::too_many_arguments)]
fn att_v_abs(att: &[f32], inp: &[f32], stride: usize, b: usize, t0: usize, t: usize, c: usize, nh: usize) -> Vec<f32> {
    let (hs, tq) = (c / nh, t - t0);
    let mut out = vec![0f32; b * tq * c];
    for bi in 0..b {
        for h in 0..nh {
            for q in 0..tq {
                let a = &att[((bi * nh + h) * tq + q) * t..][..t];
                for i in 0..hs {
                    let v = |t2: usize| inp[(bi * stride + t2) * 3 * c + 2 * c + h * hs + i];
                    out[(bi * tq + q) * c + h * hs + i] = (0..t).map(|t2| (a[t2] * v(t2)).abs()).sum();
                }
            }
        }
    }
    out
}

pub fn check_attention(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 9]);
    for (case, &(b, t, c, nh, _)) in SHAPES.iter().enumerate() {
        // Scores of order 1 (as in a model), with a special value now and then.
        let inp = scaled_input(&mut rng, b * t * 3 * c, 1.0, case % 3);
        let (mut got, mut want) =
            ((vec![0f32; b * t * c], vec![0f32; b * nh * t * t]), (vec![0f32; b * t * c], vec![0f32; b * nh * t * t]));
        e.attention_forward_rows(&mut got.0, &mut got.1, &inp, t, b, 0, t, c, nh);
        ops::attention_forward(&mut want.0, &mut want.1, &inp, b, t, c, nh);
        let what = format!("{}: attention_forward shape {case}", e.name());
        // att relative to itself (each an exp over a sum of exps); out = sum_t2 att v: relative to
        // sum_t2 |att v|.
        assert_libm_close(e, &got.1, &want.1, &want.1, ATTENTION_FORWARD, &format!("{what}: att"));
        let vscale = att_v_abs(&want.1, &inp, t, b, 0, t, c, nh);
        assert_libm_close(e, &got.0, &want.0, &vscale, ATTENTION_FORWARD, &format!("{what}: out"));
        // The KV cache's rows: positions t0..t of a cache of capacity t + 3.
        if t > 1 {
            let (stride, t0) = (t + 3, t / 2);
            let cache = scaled_input(&mut rng, b * stride * 3 * c, 1.0, 0);
            let tq = t - t0;
            let (mut go, mut ga) = (vec![0f32; b * tq * c], vec![0f32; b * nh * tq * t]);
            let (mut wo, mut wa) = (go.clone(), ga.clone());
            e.attention_forward_rows(&mut go, &mut ga, &cache, stride, b, t0, t, c, nh);
            ops::attention_forward_rows(&mut wo, &mut wa, &cache, stride, b, t0, t, c, nh);
            assert_libm_close(e, &ga, &wa, &wa, ATTENTION_FORWARD, &format!("{what}: rows {t0}..{t}: att"));
            let vscale = att_v_abs(&wa, &cache, stride, b, t0, t, c, nh);
            assert_libm_close(e, &go, &wo, &vscale, ATTENTION_FORWARD, &format!("{what}: rows {t0}..{t}: out"));
        }
        let dout = scaled_input(&mut rng, b * t * c, 1.0, case % 2);
        let init = scaled_input(&mut rng, b * t * 3 * c, 1.0, 0);
        let (mut g, mut w) = (init.clone(), init.clone());
        // Both from the CPU's att, so that only backward's own arithmetic is compared: no exp in it,
        // so bitwise on a GPU too.
        e.attention_backward(&mut g, &dout, &inp, &want.1, b, t, c, nh);
        ops::attention_backward(&mut w, &dout, &inp, &want.1, b, t, c, nh);
        assert_bitwise(&g, &w, &format!("{}: attention_backward shape {case}", e.name()));
    }
}

pub fn check_logsoftmax_gather(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 10]);
    for (case, &(b, t, _, _, v)) in SHAPES.iter().enumerate() {
        let n = b * t;
        let mag = [1.0, 10.0, 100.0, 1e30, 0.01][case % 5];
        let logits = scaled_input(&mut rng, n * v, mag, case % 3);
        let targets = tokens(&mut rng, n, v);
        let mut got = (vec![0f32; n], vec![0f32; n]);
        let mut want = got.clone();
        e.logsoftmax_gather_forward(&mut got.0, &mut got.1, &logits, &targets, n, v);
        ops::logsoftmax_gather_forward(&mut want.0, &mut want.1, &logits, &targets, n, v);
        let what = format!("{}: logsoftmax_gather_forward shape {case}", e.name());
        // logp and lse: the error of log(sum of exps), relative to 1 + |log sum| (lse - max).
        let scale: Vec<f32> = (0..n)
            .map(|i| {
                let max = logits[i * v..][..v].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                1.0 + (want.1[i] - max).abs()
            })
            .collect();
        assert_libm_close(e, &got.0, &want.0, &scale, LOGSOFTMAX, &format!("{what}: logp"));
        assert_libm_close(e, &got.1, &want.1, &scale, LOGSOFTMAX, &format!("{what}: lse"));
        let dlogp = random_input(&mut rng, n, case % 2);
        let init = random_input(&mut rng, n * v, 0);
        let (mut g, mut w) = (init.clone(), init.clone());
        e.logsoftmax_gather_backward(&mut g, &dlogp, &logits, &want.1, &targets, n, v);
        ops::logsoftmax_gather_backward(&mut w, &dlogp, &logits, &want.1, &targets, n, v);
        // dlogits += onehot - exp(l - lse) dlogp: relative to |dlogp| (the 2 ulp cover the add to init).
        let scale: Vec<f32> = (0..n * v).map(|k| dlogp[k / v].abs()).collect();
        let what = format!("{}: logsoftmax_gather_backward shape {case}", e.name());
        assert_libm_close(e, &g, &w, &scale, LOGSOFTMAX, &what);
    }
}

/// 2 gamma_{k+1} of `s` (module doc), for k-term dot products.
fn gemm_tol(k: usize, s: f32) -> f32 {
    let ku = (k + 1) as f32 * f32::EPSILON / 2.0;
    2.0 * ku / (1.0 - ku) * s
}

/// The dense layer: the products within the dot-product bound, dbias bitwise.
pub fn check_matmul(e: &dyn ExecDense) {
    let mut rng = Rng::new(&[0xc0da, 11]);
    for (case, &(bt, c, oc)) in [(1, 1, 1), (7, 13, 5), (36, 256, 768), (64, 64, 16), (5, 1024, 3)].iter().enumerate() {
        let inp = scaled_input(&mut rng, bt * c, 1.0, 0);
        let weight = scaled_input(&mut rng, oc * c, 0.02, 0);
        let bias = scaled_input(&mut rng, oc, 0.1, 0);
        let mut got = vec![0f32; bt * oc];
        e.matmul_forward(&mut got, &inp, &weight, Some(&bias), bt, c, oc);
        let mut want = vec![0f32; bt * oc];
        ops::matmul_forward(&mut want, &inp, &weight, Some(&bias), bt, c, oc);
        let what = format!("{}: matmul_forward case {case}", e.name());
        for i in 0..bt {
            for o in 0..oc {
                let s: f32 = bias[o].abs() + (0..c).map(|k| (inp[i * c + k] * weight[o * c + k]).abs()).sum::<f32>();
                let (g, w) = (got[i * oc + o], want[i * oc + o]);
                assert!((g - w).abs() <= gemm_tol(c + 1, s), "{what} [{i}, {o}]: {g:e} vs {w:e}");
            }
        }
        let dout = scaled_input(&mut rng, bt * oc, 1.0, 0);
        let (mut gi, mut gw, mut gb) = (vec![0f32; bt * c], vec![0f32; oc * c], vec![0f32; oc]);
        let (mut wi, mut ww, mut wb) = (gi.clone(), gw.clone(), gb.clone());
        e.matmul_backward(&mut gi, &mut gw, Some(&mut gb), &dout, &inp, &weight, bt, c, oc);
        ops::matmul_backward(&mut wi, &mut ww, Some(&mut wb), &dout, &inp, &weight, bt, c, oc);
        let what = format!("{}: matmul_backward case {case}", e.name());
        assert_bitwise(&gb, &wb, &format!("{what}: dbias"));
        for i in 0..bt {
            for k in 0..c {
                let s: f32 = (0..oc).map(|o| (dout[i * oc + o] * weight[o * c + k]).abs()).sum();
                assert!((gi[i * c + k] - wi[i * c + k]).abs() <= gemm_tol(oc, s), "{what}: dinp [{i}, {k}]");
            }
        }
        for o in 0..oc {
            for k in 0..c {
                let s: f32 = (0..bt).map(|i| (dout[i * oc + o] * inp[i * c + k]).abs()).sum();
                assert!((gw[o * c + k] - ww[o * c + k]).abs() <= gemm_tol(bt, s), "{what}: dweight [{o}, {k}]");
            }
        }
    }
}

/// A loss problem: logits (B, T, V) and the loss's inputs besides, with ordinary log-ratios and gaps
/// past exp's overflow at 88.72 planted at random positions (response or masked), advantages of 0
/// now and then, and a NaN logit in some cases.
pub struct LossCase {
    pub b: usize,
    pub t: usize,
    pub v: usize,
    pub logits: Vec<f32>,
    pub targets: Vec<u32>,
    pub mask: Vec<f32>,
    pub adv: Vec<f32>,
    pub old: Vec<f32>,
    pub reference: Vec<f32>,
}

impl LossCase {
    pub fn random(rng: &mut Rng, k: usize) -> LossCase {
        let (b, t, v) = ([1, 3, 8, 4][k % 4], [2, 5, 9, 1][k % 4], [4, 16, 7, 33][k % 4]);
        let n = b * t;
        let mut logits: Vec<f32> = (0..n * v).map(|_| 2.0 * rng.normal()).collect();
        if k % 5 == 4 {
            let i = rng.below(n * v);
            logits[i] = f32::NAN;
        }
        let targets: Vec<u32> = tokens(rng, n, v);
        let (mut logp, mut lse) = (vec![0f32; n], vec![0f32; n]);
        ops::logsoftmax_gather_forward(&mut logp, &mut lse, &logits, &targets, n, v);
        let mask: Vec<f32> = (0..n).map(|i| if i % t == 0 || rng.below(4) == 0 { 0.0 } else { 1.0 }).collect();
        let adv: Vec<f32> = (0..b).map(|_| if rng.below(5) == 0 { 0.0 } else { rng.normal() }).collect();
        let gap = |rng: &mut Rng| match rng.below(12) {
            0 => 89.0 + 40.0 * rng.uniform(), // past ln(f32::MAX) = 88.72
            1 => -(89.0 + 40.0 * rng.uniform()),
            2 => 15.0 + 10.0 * rng.uniform(), // around the safe style's clamp at 20
            _ => 0.3 * rng.normal(),
        };
        let old = logp.iter().map(|&l| l - gap(rng)).collect();
        let reference = logp.iter().map(|&l| l + gap(rng)).collect();
        LossCase { b, t, v, logits, targets, mask, adv, old, reference }
    }
}

/// Every buffer of the loss, computed by `e` (or the CPU when `e` is `None`): logp, lse, the saved
/// values, the stats, the gradients and dlogits.
pub struct LossRun {
    pub logp: Vec<f32>,
    pub lse: Vec<f32>,
    pub saved: GrpoSaved<Vec<f32>>,
    pub stats: GrpoStats,
    pub grads: GrpoGrads<Vec<f32>>,
    pub dlogits: Vec<f32>,
}

/// The loss's chain as worker/src/loss.rs runs it: log-softmax-gather, the GRPO op forward and
/// backward, log-softmax backward; on `e`, or with the CPU ops.
pub fn run_loss(e: Option<&dyn Exec>, s: &GrpoScalars, c: &LossCase) -> LossRun {
    let (n, v) = (c.b * c.t, c.v);
    let (mut logp, mut lse) = (vec![0f32; n], vec![0f32; n]);
    let z = || vec![f32::NAN; n];
    let mut saved =
        GrpoSaved { lr1_raw: z(), lr1: z(), ratio: z(), lr2_raw: z(), lr2: z(), e2: z(), k3: z(), terms: z() };
    let mut grads = GrpoGrads { d_lr1: z(), d_lr2: z(), dlogp: z() };
    let mut dlogits = vec![0f32; n * v];
    let stats = match e {
        Some(e) => {
            e.logsoftmax_gather_forward(&mut logp, &mut lse, &c.logits, &c.targets, n, v);
            let st = e.grpo_forward(s, &logp, &c.mask, &c.adv, &c.old, &c.reference, c.b, c.t, &mut saved);
            e.grpo_backward(s, &c.mask, &c.adv, &saved, st.denom(), c.b, c.t, &mut grads);
            e.logsoftmax_gather_backward(&mut dlogits, &grads.dlogp, &c.logits, &lse, &c.targets, n, v);
            st
        }
        None => {
            // The CPU backend: each method the `ops` function of its name.
            let cpu = Cpu;
            cpu.logsoftmax_gather_forward(&mut logp, &mut lse, &c.logits, &c.targets.to_vec(), n, v);
            let st = cpu.grpo_forward(s, &logp, &c.mask, &c.adv, &c.old, &c.reference, c.b, c.t, &mut saved);
            cpu.grpo_backward(s, &c.mask, &c.adv, &saved, st.denom(), c.b, c.t, &mut grads);
            cpu.logsoftmax_gather_backward(&mut dlogits, &grads.dlogp, &c.logits, &lse, &c.targets.to_vec(), n, v);
            st
        }
    };
    LossRun { logp, lse, saved, stats, grads, dlogits }
}

/// The stats as floats, in loss.cu's order (the inverse of `cuda_grid::grpo_stats`).
pub fn stats_floats(s: &GrpoStats) -> Vec<f32> {
    vec![
        s.loss,
        s.ratio,
        s.kl,
        s.max_ratio_logratio_response,
        s.max_ratio_logratio_masked,
        s.max_kl_logratio_response,
        s.max_kl_logratio_masked,
        s.max_logratio_response,
        s.max_logratio_masked,
        s.min_response_logp,
        s.response_tokens as f32,
        s.denom(),
    ]
}

/// The GRPO loss's chain against the CPU's, in both styles: every saved value, the stats, the
/// gradients and dlogits; on the GPU within `GRPO` of (1 + |value|) (the exps and the logs).
/// Returns how many cases gave ROLL's failure: a finite loss with a non-finite gradient.
pub fn check_grpo(e: &dyn Exec) -> usize {
    let mut rng = Rng::new(&[0x1055, 1]);
    let mut overflowed = 0;
    for case in 0..80 {
        let c = LossCase::random(&mut rng, case);
        for safe in [false, true] {
            let s = GrpoScalars { safe, clip: [0.2, 0.1, 0.3][case % 3], kl_coef: [0.01, 0.1][case % 2] };
            let want = run_loss(None, &s, &c);
            let got = run_loss(Some(e), &s, &c);
            let what =
                |x: &str| format!("{}: grpo case {case} safe {safe} (B {} T {} V {}): {x}", e.name(), c.b, c.t, c.v);
            let close = |g: &[f32], w: &[f32], x: &str| {
                let scale: Vec<f32> = w.iter().map(|v| 1.0 + v.abs()).collect();
                assert_libm_close(e, g, w, &scale, GRPO, &what(x));
            };
            close(&got.logp, &want.logp, "logp");
            let names = ["lr1_raw", "lr1", "ratio", "lr2_raw", "lr2", "e2", "k3", "terms"];
            let (g, w) = (&got.saved, &want.saved);
            let pairs = [
                (&g.lr1_raw, &w.lr1_raw),
                (&g.lr1, &w.lr1),
                (&g.ratio, &w.ratio),
                (&g.lr2_raw, &w.lr2_raw),
                (&g.lr2, &w.lr2),
                (&g.e2, &w.e2),
                (&g.k3, &w.k3),
                (&g.terms, &w.terms),
            ];
            for ((g, w), name) in pairs.into_iter().zip(names) {
                close(g, w, name);
            }
            close(&stats_floats(&got.stats), &stats_floats(&want.stats), "stats");
            close(&got.grads.d_lr1, &want.grads.d_lr1, "d_lr1");
            close(&got.grads.d_lr2, &want.grads.d_lr2, "d_lr2");
            close(&got.grads.dlogp, &want.grads.dlogp, "dlogp");
            close(&got.dlogits, &want.dlogits, "dlogits");
            // The kernel's own outcome (the checks above make it the CPU's): a finite loss with a
            // non-finite gradient.
            if !safe && got.stats.loss.is_finite() && got.dlogits.iter().any(|x| !x.is_finite()) {
                overflowed += 1;
            }
        }
    }
    overflowed
}

/// FIELD-NOTES' failing update, on `e`: a k3 gap of 88.8 > 88.72 at a masked position. ROLL's style:
/// the loss finite, the masked row of dlogits NaN, the other row finite, e2 = +inf; the safe style
/// all finite.
pub fn check_seed_case(e: &dyn Exec) {
    let logits = vec![0.3, -0.2, 0.1, 0.0, -0.5, 0.2, 0.4, 0.1];
    let targets = vec![1, 2];
    let (mut logp, mut lse) = (vec![0f32; 2], vec![0f32; 2]);
    ops::logsoftmax_gather_forward(&mut logp, &mut lse, &logits, &targets, 2, 4);
    let c = LossCase {
        b: 1,
        t: 2,
        v: 4,
        logits,
        targets,
        mask: vec![0.0, 1.0],
        adv: vec![1.0],
        old: logp.clone(),
        reference: vec![logp[0] + 88.8, logp[1]],
    };
    let roll = run_loss(Some(e), &GrpoScalars { safe: false, clip: 0.2, kl_coef: 0.01 }, &c);
    assert!(roll.stats.loss.is_finite(), "{}: loss {}", e.name(), roll.stats.loss);
    assert_eq!(roll.saved.e2[0], f32::INFINITY, "{}: exp(88.8) overflowed", e.name());
    assert!(roll.dlogits[..4].iter().all(|x| x.is_nan()), "{}: the masked row is NaN: {:?}", e.name(), roll.dlogits);
    assert!(
        roll.dlogits[4..].iter().all(|x| x.is_finite()),
        "{}: the other row is finite: {:?}",
        e.name(),
        roll.dlogits
    );
    let safe = run_loss(Some(e), &GrpoScalars { safe: true, clip: 0.2, kl_coef: 0.01 }, &c);
    assert!(safe.dlogits.iter().all(|x| x.is_finite()), "{}: the safe style stays finite", e.name());
}

/// The sampler: the CPU's token for every sequence, on peaked, flat, -inf and NaN rows and uniforms
/// at the edges. Exactly, where the math library is the CPU's; else exactly too, unless the draw lies
/// within `sample_boundary`'s margin of the boundary between the CPU's token and the kernel's (and
/// the tokens between them weigh less than it): there either is right. So every row away from a
/// boundary must match, in every case (`the_sampler_check_can_fail_in_every_case`).
pub fn check_sample(e: &dyn Exec) {
    check_sample_upto(e, None);
}

/// `check_sample`; with `corrupt = Some(case)`, row 0 of that case is given a wrong token (the
/// heaviest other than the CPU's) and the check stops after that case: it must have failed there.
pub fn check_sample_upto(e: &dyn Exec, corrupt: Option<usize>) {
    let mut rng = Rng::new(&[0x5a, 1]);
    for case in 0..60 {
        let (b, v, t) = ([1, 5, 64, 130][case % 4], [4, 16, 33][case % 3], 1 + case % 3);
        let temperature = [1.0, 0.7, 2.5][case % 3];
        let mut logits: Vec<f32> = (0..b * t * v).map(|_| [3.0, 0.01, 30.0][case % 3] * rng.normal()).collect();
        if case % 4 == 1 {
            let i = rng.below(logits.len());
            logits[i] = f32::NEG_INFINITY;
        }
        if case % 9 == 8 {
            let r = rng.below(b);
            logits[(r * t + t - 1) * v] = f32::NAN;
        }
        // Random draws (row 0 always) and the edges of [0, 1) (the largest uniform Rng::uniform
        // draws is 1 - 2^-24).
        let uniforms: Vec<f32> = (0..b)
            .map(|i| match i % 4 {
                1 => 0.0,
                2 => 1.0 - f32::EPSILON / 2.0,
                _ => rng.uniform(),
            })
            .collect();
        let row = |i: usize| &logits[(i * t + t - 1) * v..][..v];
        let want: Vec<u32> = (0..b).map(|i| ops::sample(row(i), temperature, uniforms[i])).collect();
        let mut got = vec![u32::MAX; b];
        e.sample(&mut got, &logits, b, t, v, temperature, &uniforms);
        if corrupt == Some(case) {
            let w: Vec<f32> = row(0).iter().map(|l| if l.is_nan() { 0.0 } else { *l }).collect();
            got[0] = (0..v as u32)
                .filter(|&k| k != want[0])
                .max_by(|&a, &c| w[a as usize].total_cmp(&w[c as usize]))
                .unwrap();
        }
        for i in 0..b {
            if got[i] == want[i] {
                continue;
            }
            let what =
                format!("{}: sample case {case} row {i}: token {} where the CPU's is {}", e.name(), got[i], want[i]);
            assert!(!e.cpu_libm(), "{what}");
            let (lo, hi) = (got[i].min(want[i]), got[i].max(want[i]));
            let (x, boundary, between, margin) = sample_boundary(row(i), temperature, uniforms[i], lo, hi);
            assert!(
                (x - boundary).abs() <= margin && between <= margin,
                "{what}: the draw {x:e} is {:e} from their boundary {boundary:e}, the tokens between weigh {between:e}, \
                 the margin is {margin:e}",
                (x - boundary).abs()
            );
        }
        if corrupt == Some(case) {
            return;
        }
    }
}

/// Where the sampler's decision between tokens `lo` < `hi` of `row` lies, in f64 from the CPU's f32
/// weights w = exp((l - max) / temperature): the draw u x sum(w), the boundary w_0 + ... + w_lo, the
/// weight of the tokens between them (0 when they are adjacent or the ones between weigh nothing),
/// and the margin within which two math libraries `LIBM_ULPS` apart may decide differently: each w
/// differs by <= LIBM_ULPS 2^-23 w between them, the draw by as much of the total, and each side's
/// f32 running subtraction (and sum) rounds by <= 2^-24 of the total per term - so the two decisions
/// agree wherever |draw - boundary| > 2 (2 LIBM_ULPS + 2 V + 2) 2^-23 total.
pub fn sample_boundary(row: &[f32], temperature: f32, u: f32, lo: u32, hi: u32) -> (f64, f64, f64, f64) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = row.iter().map(|&l| ((l - max) / temperature).exp() as f64).collect();
    let total: f64 = w.iter().sum();
    let boundary: f64 = w[..=lo as usize].iter().sum();
    let between: f64 = w[lo as usize + 1..hi as usize].iter().sum();
    let margin = 2.0 * (2 * LIBM_ULPS as usize + 2 * row.len() + 2) as f64 * f32::EPSILON as f64 * total;
    (u as f64 * total, boundary, between, margin)
}

/// fill and the 2D copy (the KV cache's rows, the rollout's logits): exact.
pub fn check_fill_and_copy_2d(e: &dyn Exec) {
    let mut rng = Rng::new(&[0xc0da, 15]);
    for (w, h, sp, dp) in [(1, 1, 1, 1), (5, 3, 7, 5), (48, 9, 48, 100), (3, 40, 10, 3)] {
        let src = random_input(&mut rng, (h - 1) * sp + w, 2);
        let init = random_input(&mut rng, (h - 1) * dp + w + 3, 0);
        let (mut got, mut want) = (init.clone(), init);
        e.copy_2d(&mut got, dp, &src, sp, w, h);
        for i in 0..h {
            want[i * dp..][..w].copy_from_slice(&src[i * sp..][..w]);
        }
        assert_bitwise(&got, &want, &format!("{}: copy_2d {w}x{h}", e.name()));
        e.fill(&mut got, -0.0);
        assert!(got.iter().all(|x| x.to_bits() == (-0.0f32).to_bits()), "{}: fill", e.name());
    }
}
