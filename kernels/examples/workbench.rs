//! Kernel workbench: each fast kernel beside its variants and the machine's ceiling, on fresh random
//! inputs, best of several rounds. A benchmark prints numbers; the tests in `kernels/tests` assert.
//!
//! ```sh
//! cargo run --release -p gradbus-kernels --example workbench -- checksum [N ...]
//!
//! cargo run --release -p gradbus-kernels --example workbench -- sdc [N ...]
//!
//! cargo run --release -p gradbus-kernels --example workbench -- gemm [C L]
//!
//! GRADBUS_SIMD=avx2 cargo run --release -p gradbus-kernels --example workbench -- gemm [C L]
//!
//! cargo run --release -p gradbus-kernels --example workbench -- simd
//! ```
//!
//! Every table says which instruction-set path ran (`simd::active`): the best this CPU has, or the
//! one `GRADBUS_SIMD` (`avx512`, `avx2`, `avx`, `baseline`) forces, e.g. to measure the AVX2 path on
//! an AVX-512 machine.
//!
//! `gemm`: GFLOP/s of `matmul_forward` / `matmul_backward` at every shape the model runs (BT = 36
//! rows: 4 sequences x 9 positions; default C = 256, and C = 64, the tiny model), the kernel gradbus
//! uses beside `matrixmultiply` (what it used before; it picks its own instruction set), against the
//! single-core FMA peak of the active path's vector width, measured by a loop of independent fused
//! multiply-adds.
//!
//! `checksum`: the replica checksum per update at N parameters (default 103,168 and 3,171,840: the
//! tiny model and `model.channels=256 model.layers=4`): the one-chain FNV-1a it replaced, the lane
//! hash alone, the AdamW update that computes it in its own pass, and a memcpy of the same bytes.
//!
//! `sdc`: what the silent-data-corruption guard adds to one rank's kernels per update at N
//! parameters and 2 ranks, beside the same kernels without it, alternated in this one process: the
//! weights read back and hashed (the replica checksum in a pass of its own, as a GPU runs it; the
//! CPU run hashes them inside backward, so this is its upper bound), the optimizer's pass that
//! hashes the gradients it reads (`adamw_scaled` with the pieces against it without), and this rank's half of
//! the bucket reduces with each source's peak and the checksum of its chunk of the sum
//! (`reduce_with_peaks`, which hashes the sum as it writes it, against `reduce_in_place`), both in
//! the run's pieces (a reducer's chunk of a 64 KiB bucket: 8,192 words, each piece's hash finished,
//! `finish_all`).
//!
//! `simd`: the path the kernels take here and every level this CPU runs (one line each), for scripts
//! to print beside their numbers.

use std::hint::black_box;
use std::time::Instant;

use gradbus_kernels::checksum::{checksum, finish_all, Checksum};
use gradbus_kernels::ops::matmul::gemm_tiles;
use gradbus_kernels::ops::{adamw_scaled, adamw_update, matmul_backward, matmul_forward};
use gradbus_kernels::rng::Rng;
use gradbus_kernels::simd::{self, Level};
use gradbus_kernels::{reduce_in_place, reduce_with_peaks, Health, Peak};

/// Words per piece of the `sdc` table's hashed passes: a reducer's chunk of a bucket in the run
/// (`bucket_bytes = 65536`: 16,384 words per bucket, 2 reducers).
const PIECE: usize = 8192;

/// Best time of `rounds` rounds of `iters` calls, in seconds per call.
fn best(rounds: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn randn(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// The checksum gradbus used before: one FNV-1a chain over 64-bit state, a multiply per word.
fn fnv1a_one_chain(x: &[f32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in x {
        h = (h ^ v.to_bits() as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn bench_checksum(sizes: &[usize]) {
    println!("# replica checksum per update: ms per call (GB/s of the weights read); path {}", simd::active());
    println!(
        "{:>10} {:>16} {:>16} {:>16} {:>16} {:>16}",
        "params", "fnv1a-1chain", "lanes", "lanes-hot", "adamw+lanes", "memcpy"
    );
    let mut rng = Rng::new(&[42]);
    for &n in sizes {
        let mut p = randn(&mut rng, n, 0.02);
        let g = randn(&mut rng, n, 1e-3);
        let mut m = randn(&mut rng, n, 1e-4);
        let mut v: Vec<f32> = randn(&mut rng, n, 1e-4).iter().map(|x| x * x).collect();
        let mut dst = vec![0.0f32; n];
        let iters = (20_000_000 / n.max(1)).clamp(3, 1000);
        let t_fnv = best(5, iters, || {
            black_box(fnv1a_one_chain(black_box(&p)));
        });
        let t_lanes = best(5, iters, || {
            black_box(checksum(black_box(&p)));
        });
        // What the hash costs inside the AdamW pass, which hashes each 8192-word piece right after
        // writing it: one hot piece, hashed over and over, times the number of pieces.
        let piece = &p[..n.min(8192)];
        let t_hot = best(5, iters, || {
            let mut c = Checksum::new();
            for _ in 0..n.div_ceil(8192) {
                c.update(black_box(piece));
            }
            black_box(c.finish());
        });
        let mut t = 1u64;
        let t_adam = best(5, iters, || {
            black_box(adamw_update(&mut p, &g, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.01, t));
            t += 1;
        });
        let t_copy = best(5, iters, || {
            dst.copy_from_slice(black_box(&p));
            black_box(&dst);
        });
        let gbs = |t: f64| 4.0 * n as f64 / t / 1e9;
        let cell = |t: f64| format!("{:.3} ({:.1})", t * 1e3, gbs(t));
        println!(
            "{n:>10} {:>16} {:>16} {:>16} {:>16} {:>16}",
            cell(t_fnv),
            cell(t_lanes),
            cell(t_hot),
            cell(t_adam),
            cell(t_copy)
        );
    }
    println!("# fnv1a-1chain: the checksum before (run twice per update); lanes: the checksum now, alone;");
    println!("# lanes-hot: the same on pieces already in cache, as inside the AdamW pass;");
    println!("# adamw+lanes: the AdamW update that hashes each piece as it writes it (once per update)");
}

fn bench_sdc(sizes: &[usize]) {
    println!(
        "# the SDC guard's kernels per update and rank, 2 ranks: ms per update, off | on; path {}",
        simd::active()
    );
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "params", "readback", "adamw", "adamw+hash", "reduce", "reduce+sdc", "off", "on", "added"
    );
    let mut rng = Rng::new(&[29]);
    for &n in sizes {
        let mut p = randn(&mut rng, n, 0.02);
        let g = randn(&mut rng, n, 1e-3);
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        // This rank's chunk of a 2-rank reduce: half the buffer, from 2 sources, reduced and hashed
        // in pieces of PIECE words as the run does (its reducer chunks), the hashes finished together.
        let half = n / 2;
        let pieces: Vec<_> = (0..n)
            .step_by(2 * PIECE)
            .map(|i| i..(i + 2 * PIECE).min(n))
            .flat_map(|b| {
                let mid = b.start + (b.len() / 2);
                [b.start..mid, mid..b.end]
            })
            .collect();
        let (mut a, mut b) = (randn(&mut rng, half, 1e-3), randn(&mut rng, half, 1e-3));
        // Short rounds, many of them: a round of ~0.1-1 ms is seldom preempted on a busy machine.
        let iters = (200_000 / n.max(1)).clamp(1, 50);
        // The reduce overwrites its sources with their sum: each call starts from copies of the same
        // two (the copies are timed alone and taken off, so that only the reduce counts).
        let (a0, b0) = (a.clone(), b.clone());
        let fresh = |a: &mut [f32], b: &mut [f32]| {
            a.copy_from_slice(&a0);
            b.copy_from_slice(&b0);
        };
        // Each variant beside its guard-off twin, alternated round by round, best of many rounds:
        // a loaded machine steals whole rounds, not a share of each.
        let (mut t_read, mut t_adamw, mut t_adamw_hash) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
        let (mut t_copy, mut t_reduce, mut t_reduce_sdc) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
        for _ in 0..200 {
            t_read = t_read.min(best(1, iters, || {
                black_box(checksum(black_box(&p)));
            }));
            // The optimizer's pass on the reduced gradients (scaled by 1/2 in registers), without
            // and with the consumed gradients' hashes over the reducers' pieces.
            let mut t = 0;
            let mut optimizer = |pieces: &[std::ops::Range<usize>]| {
                t += 1;
                let (p, m, v) = (black_box(&mut p), &mut m, &mut v);
                black_box(adamw_scaled(p, black_box(&g), 0.5, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, t, pieces));
            };
            t_adamw = t_adamw.min(best(1, iters, || optimizer(&[])));
            t_adamw_hash = t_adamw_hash.min(best(1, iters, || optimizer(&pieces)));
            t_copy = t_copy.min(best(1, iters, || fresh(&mut a, &mut b)));
            t_reduce = t_reduce.min(best(1, iters, || {
                fresh(&mut a, &mut b);
                for (a, b) in a.chunks_mut(PIECE).zip(b.chunks_mut(PIECE)) {
                    let mut tally = [Health::default(); 2];
                    black_box(reduce_in_place(&mut [a, b], &mut tally));
                }
            }));
            t_reduce_sdc = t_reduce_sdc.min(best(1, iters, || {
                fresh(&mut a, &mut b);
                let mut hashes = Vec::new();
                for (a, b) in a.chunks_mut(PIECE).zip(b.chunks_mut(PIECE)) {
                    let (mut tally, mut peaks, mut hash) =
                        ([Health::default(); 2], [Peak::default(); 2], Checksum::new());
                    black_box(reduce_with_peaks(&mut [a, b], &mut tally, &mut peaks, None, Some(&mut hash)));
                    hashes.push(hash);
                }
                black_box(finish_all(&hashes));
            }));
        }
        let (t_reduce, t_reduce_sdc) = (t_reduce - t_copy, t_reduce_sdc - t_copy);
        let (off, on) = (t_adamw + t_reduce, t_read + t_adamw_hash + t_reduce_sdc);
        let ms = |t: f64| format!("{:.4}", t * 1e3);
        println!(
            "{n:>10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
            ms(t_read),
            ms(t_adamw),
            ms(t_adamw_hash),
            ms(t_reduce),
            ms(t_reduce_sdc),
            ms(off),
            ms(on),
            ms(on - off)
        );
    }
    println!("# readback: the weights hashed in a pass of their own (a GPU's read-back; on the CPU the run");
    println!("# hashes them inside backward, from cache: this column is its upper bound);");
    println!("# adamw / adamw+hash: the optimizer's pass (AdamW on the scaled sum) without / with hashing");
    println!("# the gradients it reads;");
    println!("# reduce / reduce+sdc: this rank's half of a 2-rank reduce without / with peaks and the");
    println!("# hash of its chunk of the sum; off / on: the sums; added: on - off (the guard's kernels)");
}

/// `matmul_forward` through `matrixmultiply::sgemm` (gradbus before its own kernel).
fn mm_forward(out: &mut [f32], inp: &[f32], weight: &[f32], bias: &[f32], bt: usize, c: usize, oc: usize) {
    for row in out.chunks_exact_mut(oc) {
        row.copy_from_slice(bias);
    }
    // SAFETY: out (bt, oc), inp (bt, c), weight (oc, c) are the sizes the caller allocated.
    unsafe {
        matrixmultiply::sgemm(
            bt,
            c,
            oc,
            1.0,
            inp.as_ptr(),
            c as isize,
            1,
            weight.as_ptr(),
            1,
            c as isize,
            1.0,
            out.as_mut_ptr(),
            oc as isize,
            1,
        );
    }
}

/// `matmul_backward` (no bias) through `matrixmultiply::sgemm`.
#[allow(clippy::too_many_arguments)]
fn mm_backward(dinp: &mut [f32], dw: &mut [f32], dout: &[f32], inp: &[f32], w: &[f32], bt: usize, c: usize, oc: usize) {
    // SAFETY: dinp (bt, c), dw (oc, c), dout (bt, oc), inp (bt, c), w (oc, c) as allocated by the caller.
    unsafe {
        matrixmultiply::sgemm(
            bt,
            oc,
            c,
            1.0,
            dout.as_ptr(),
            oc as isize,
            1,
            w.as_ptr(),
            c as isize,
            1,
            1.0,
            dinp.as_mut_ptr(),
            c as isize,
            1,
        );
        matrixmultiply::sgemm(
            oc,
            bt,
            c,
            1.0,
            dout.as_ptr(),
            1,
            oc as isize,
            inp.as_ptr(),
            c as isize,
            1,
            1.0,
            dw.as_mut_ptr(),
            c as isize,
            1,
        );
    }
}

/// Single-core FMA peak of the active level, GFLOP/s (2 flops per lane per fma): 12 independent
/// chains of vector fmas (enough to cover the latency of two FMA units) at the level's vector width,
/// 16 lanes on AVX-512, 8 on AVX2 and AVX (their fma is the same 256-bit instruction). Every chain
/// starts from its own value and reaches the result: a compiler may compute equal or unused chains
/// once, and then the loop times one chain's latency instead of the units' throughput.
fn fma_peak() -> (f64, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const CHAINS: usize = 12;
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn avx512(iters: usize) -> f32 {
            let mut acc: [__m512; CHAINS] = std::array::from_fn(|i| _mm512_set1_ps(black_box(1.0 + i as f32)));
            let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            for _ in 0..iters {
                for x in acc.iter_mut() {
                    *x = _mm512_fmadd_ps(*x, m, a);
                }
            }
            acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
        }
        #[target_feature(enable = "avx,fma")]
        unsafe fn avx(iters: usize) -> f32 {
            let mut acc: [__m256; CHAINS] = std::array::from_fn(|i| _mm256_set1_ps(black_box(1.0 + i as f32)));
            let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            for _ in 0..iters {
                for x in acc.iter_mut() {
                    *x = _mm256_fmadd_ps(*x, m, a);
                }
            }
            // Every chain reaches the result (storing each over the last one let the compiler drop 11).
            let total = acc.iter().fold(_mm256_setzero_ps(), |t, &x| _mm256_add_ps(t, x));
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), total);
            out.iter().sum()
        }
        // Short rounds, best of many: on a shared machine a long one is always preempted somewhere.
        let iters = 100_000;
        match simd::active() {
            Level::Avx512 => {
                // SAFETY: the active level is one the CPU runs: it has AVX-512F and FMA.
                let t = best(200, 1, || {
                    black_box(unsafe { avx512(black_box(iters)) });
                });
                return ((iters * CHAINS * 16 * 2) as f64 / t / 1e9, "16-lane AVX-512 FMA");
            }
            Level::Avx2 | Level::Avx => {
                // SAFETY: the active level is one the CPU runs: it has AVX and FMA.
                let t = best(200, 1, || {
                    black_box(unsafe { avx(black_box(iters)) });
                });
                return ((iters * CHAINS * 8 * 2) as f64 / t / 1e9, "8-lane AVX FMA");
            }
            Level::Baseline => {}
        }
    }
    (f64::NAN, "no vector FMA at the baseline level")
}

fn bench_gemm(c: usize, layers: usize) {
    let bt = 36;
    let (peak, isa) = fma_peak();
    let level = simd::active();

    println!("# GEMM at BT = {bt} rows, C = {c} ({layers} layers): GFLOP/s, single thread; FMA peak {peak:.1} GFLOP/s ({isa})");
    println!(
        "# path: {level} ({}; tiles {}; this CPU's best: {}; {}=... forces one)",
        level.features(),
        gemm_tiles(level),
        simd::detected(),
        Level::ENV
    );
    println!(
        "{:<10} {:>16} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8}",
        "layer", "BT x C -> OC", "fwd mm", "fwd own", "%peak", "bwd mm", "bwd own", "%peak"
    );
    let mut rng = Rng::new(&[43]);
    let shapes =
        [("attn.qkv", c, 3 * c), ("attn.proj", c, c), ("mlp.fc", c, 4 * c), ("mlp.proj", 4 * c, c), ("head", c, 16)];
    let (mut t_mm, mut t_own) = (0.0, 0.0);
    for (name, k, oc) in shapes {
        let inp = randn(&mut rng, bt * k, 1.0);
        let w = randn(&mut rng, oc * k, 0.02);
        let bias = randn(&mut rng, oc, 0.02);
        let dout = randn(&mut rng, bt * oc, 1.0);
        let mut out = vec![0.0f32; bt * oc];
        let (mut dinp, mut dw) = (vec![0.0f32; bt * k], vec![0.0f32; oc * k]);
        let iters = (50_000_000 / (bt * k * oc)).clamp(5, 2000);
        let f_mm = best(7, iters, || mm_forward(&mut out, &inp, &w, &bias, bt, k, oc));
        let f_own = best(7, iters, || matmul_forward(&mut out, &inp, &w, Some(&bias), bt, k, oc));
        let b_mm = best(7, iters, || mm_backward(&mut dinp, &mut dw, &dout, &inp, &w, bt, k, oc));
        let b_own = best(7, iters, || matmul_backward(&mut dinp, &mut dw, None, &dout, &inp, &w, bt, k, oc));
        let per_layer = if name == "head" { 1.0 } else { layers as f64 };
        t_mm += (f_mm + b_mm) * per_layer;
        t_own += (f_own + b_own) * per_layer;
        let flops = (2 * bt * k * oc) as f64;
        let g = |t: f64, f: f64| f / t / 1e9;
        println!(
            "{name:<10} {:>16} {:>10.1} {:>10.1} {:>7.0}% {:>10.1} {:>10.1} {:>7.0}%",
            format!("{bt} x {k} -> {oc}"),
            g(f_mm, flops),
            g(f_own, flops),
            100.0 * g(f_own, flops) / peak,
            g(b_mm, 2.0 * flops),
            g(b_own, 2.0 * flops),
            100.0 * g(b_own, 2.0 * flops) / peak
        );
    }
    println!(
        "# all matmuls of one update (forward + backward, every layer): matrixmultiply {:.3} ms, own {:.3} ms",
        t_mm * 1e3,
        t_own * 1e3
    );
}

fn main() {
    if let Err(e) = simd::from_env() {
        eprintln!("workbench: {e}");
        std::process::exit(2);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes = |rest: &[String], default: &[usize]| -> Vec<usize> {
        if rest.is_empty() {
            default.to_vec()
        } else {
            rest.iter().map(|s| s.parse().unwrap_or_else(|_| panic!("not a size: {s}"))).collect()
        }
    };
    match args.first().map(String::as_str) {
        Some("checksum") => bench_checksum(&sizes(&args[1..], &[103_168, 3_171_840])),
        Some("sdc") => bench_sdc(&sizes(&args[1..], &[103_168, 3_171_840])),
        Some("simd") => {
            println!("path {} (this CPU's best: {})", simd::active(), simd::detected());
            for level in simd::available() {
                println!("runs {level}: {}; GEMM tiles {}", level.features(), gemm_tiles(level));
            }
        }
        Some("gemm") => {
            let v = sizes(&args[1..], &[256, 4]);
            bench_gemm(v[0], v.get(1).copied().unwrap_or(4));
        }
        _ => {
            eprintln!("usage: workbench checksum [N ...] | workbench sdc [N ...] | workbench gemm [C LAYERS] | workbench simd");
            std::process::exit(2);
        }
    }
}
