//! Every instruction-set path this CPU runs (`simd::available`: AVX-512, AVX2, AVX - each with FMA -
//! and the baseline), forced one at a time with `simd::with_level`, gives the same bits in every
//! kernel that dispatches on the level: the GEMM (one fma chain per element whatever the tile), the
//! reduce with its health tallies, the health scan, AdamW and the replica checksum. A level this CPU
//! lacks is reported as SKIPPED. scripts/test.sh reads the CPU's flags in /proc/cpuinfo and requires
//! (`GRADBUS_REQUIRE=simd-<level>`) every level they show, so that the kernels' own detection cannot
//! drop a level unseen.

use gradbus_kernels::ops::{adamw_scaled, adamw_update, matmul_backward, matmul_forward};
use gradbus_kernels::rng::Rng;
use gradbus_kernels::simd::{self, Level};
use gradbus_kernels::{checksum, health_scan, reduce_in_place, reduce_plain, reduce_to_one, Health};

#[path = "../../tests/common/skip.rs"]
mod skip;

fn randn(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The levels to compare, the baseline first; SKIPPED for each level this CPU cannot run.
fn levels(test: &str) -> Vec<Level> {
    for missing in Level::ALL.into_iter().filter(|l| !l.supported()) {
        skip::skip(
            &format!("simd-{missing}"),
            &format!("{test}: the {missing} path (this CPU lacks {})", missing.features()),
        );
    }
    let levels: Vec<Level> = simd::available().collect();
    for want in skip::required_starting("simd-") {
        let run: Vec<String> = levels.iter().map(|l| format!("simd-{l}")).collect();
        assert!(
            run.contains(&want),
            "GRADBUS_REQUIRE names {want} (the CPU's flags show it), yet the kernels run {run:?}"
        );
    }
    eprintln!("{test}: comparing the paths {levels:?}");
    levels
}

/// What `f` returns at every level, which must be equal to the baseline's.
fn same_at_every_level<T: PartialEq + std::fmt::Debug>(test: &str, what: &str, f: impl Fn() -> T) {
    let mut levels = levels(test).into_iter();
    let first = levels.next().expect("the baseline always runs");
    let want = simd::with_level(first, &f).unwrap();
    for level in levels {
        let got = simd::with_level(level, || {
            assert_eq!(simd::active(), level, "with_level forces the level");
            f()
        })
        .unwrap();
        assert!(got == want, "{what}: the {level} path differs from the {first} path");
    }
}

/// The scalar fma chain every GEMM element must be (`ops::matmul`'s contract), independent of the
/// kernel: out = inp @ weight^T + bias.
fn fma_chain_forward(inp: &[f32], w: &[f32], bias: &[f32], bt: usize, c: usize, oc: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; bt * oc];
    for i in 0..bt {
        for o in 0..oc {
            out[i * oc + o] = (0..c).fold(bias[o], |acc, p| inp[i * c + p].mul_add(w[o * c + p], acc));
        }
    }
    out
}

#[test]
fn the_gemm_gives_the_same_bits_on_every_path() {
    // Shapes that reach every panel of every level: forward widths (BT padded) of 8 to 48, wide
    // products with 8-column and single-column remainders, 1..7 leftover rows, and inner dimensions
    // across several blocks of 128.
    let mut rng = Rng::new(&[25, 1]);
    let shapes = [
        (1, 1, 1),
        (5, 3, 7),
        (8, 64, 16),
        (16, 33, 24),
        (24, 64, 40),
        (36, 64, 256),
        (36, 256, 768),
        (40, 300, 100),
        (48, 130, 72),
        (13, 1024, 64),
        (50, 17, 83),
    ];
    for (bt, c, oc) in shapes {
        let (inp, w, bias, dout) =
            (randn(&mut rng, bt * c), randn(&mut rng, oc * c), randn(&mut rng, oc), randn(&mut rng, bt * oc));
        let (dinp0, dw0, db0) = (randn(&mut rng, bt * c), randn(&mut rng, oc * c), randn(&mut rng, oc));
        let oracle = fma_chain_forward(&inp, &w, &bias, bt, c, oc);
        let run = || {
            let mut out = vec![f32::NAN; bt * oc];
            matmul_forward(&mut out, &inp, &w, Some(&bias), bt, c, oc);
            let (mut dinp, mut dw, mut db) = (dinp0.clone(), dw0.clone(), db0.clone());
            matmul_backward(&mut dinp, &mut dw, Some(&mut db), &dout, &inp, &w, bt, c, oc);
            (bits(&out), bits(&dinp), bits(&dw), bits(&db))
        };
        same_at_every_level("gemm", &format!("matmul {bt} x {c} -> {oc}"), run);
        for level in simd::available() {
            let out = simd::with_level(level, run).unwrap().0;
            assert_eq!(out, bits(&oracle), "{level}: forward {bt} x {c} -> {oc} is not the fma chain");
        }
    }
}

/// Gradients at a random scale with rare NaN, Inf, denormal and huge values.
fn gradients(rng: &mut Rng, n: usize) -> Vec<f32> {
    let scale = 10f32.powi(rng.below(40) as i32 - 20);
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-41, 1e21, f32::MAX, -0.0];
    (0..n)
        .map(|_| if rng.uniform() < 0.002 { specials[rng.below(specials.len())] } else { rng.normal() * scale })
        .collect()
}

fn health_bits(h: &Health) -> (u64, u64, u64, Option<u64>) {
    (h.nan, h.inf, h.sumsq.to_bits(), h.first_bad)
}

#[test]
fn the_reduce_and_the_health_scan_give_the_same_bits_on_every_path() {
    let mut rng = Rng::new(&[25, 2]);
    for case in 0..40 {
        let (n, len) = (1 + rng.below(4), rng.below(5000));
        let srcs: Vec<Vec<f32>> = (0..n).map(|_| gradients(&mut rng, len)).collect();
        let root = rng.below(n);
        let run = || {
            let mut slots = srcs.clone();
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(|v| v.as_mut_slice()).collect();
            let mut tally = vec![Health::default(); n];
            let sum = reduce_in_place(&mut refs, &mut tally);
            let mut one = srcs.clone();
            let mut refs: Vec<&mut [f32]> = one.iter_mut().map(|v| v.as_mut_slice()).collect();
            let mut tally_one = vec![Health::default(); n];
            let sum_one = reduce_to_one(&mut refs, &mut tally_one, root);
            let mut plain = srcs.clone();
            let mut refs: Vec<&mut [f32]> = plain.iter_mut().map(|v| v.as_mut_slice()).collect();
            reduce_plain(&mut refs);
            let scans: Vec<_> = srcs.iter().map(|s| health_bits(&health_scan(s))).collect();
            let all = |v: &[Vec<f32>]| v.iter().map(|s| bits(s)).collect::<Vec<_>>();
            let tallies = |t: &[Health]| t.iter().map(health_bits).collect::<Vec<_>>();
            (
                (all(&slots), tallies(&tally), health_bits(&sum)),
                (all(&one), tallies(&tally_one), health_bits(&sum_one)),
                (all(&plain), scans),
            )
        };
        same_at_every_level("reduce", &format!("case {case}: {n} slots of {len}"), run);
    }
}

#[test]
fn adamw_and_the_checksum_give_the_same_bits_on_every_path() {
    let mut rng = Rng::new(&[25, 3]);
    for n in [0, 1, 7, 16, 100, 8191, 8192, 8193, 40_000] {
        let (p, g, m) = (randn(&mut rng, n), randn(&mut rng, n), randn(&mut rng, n));
        let v: Vec<f32> = randn(&mut rng, n).iter().map(|x| x * x).collect();
        let run = || {
            let (mut p, mut m, mut v) = (p.clone(), m.clone(), v.clone());
            let mut sums = Vec::new();
            for t in 1..=3 {
                sums.push(adamw_update(&mut p, &g, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.01, t));
            }
            // The optimizer's pass on a sum, hashing what it reads in pieces that start mid-group.
            let pieces = [0..n / 3, n / 3..n / 3 + n / 2, n / 3 + n / 2..n];
            let read = adamw_scaled(&mut p, &g, 0.3, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 4, &pieces);
            (bits(&p), bits(&m), bits(&v), sums, checksum(&g), read)
        };
        same_at_every_level("adamw", &format!("{n} parameters"), run);
    }
}
