//! Every fast kernel against its naive twin, on fresh random inputs with NaN, Inf, denormal and huge
//! values planted at random places.

use gradbus_kernels::health::BLOCK;
use gradbus_kernels::rng::Rng;
use gradbus_kernels::{health_scan, reduce_in_place, reference, Health};

/// Random gradients with rare specials: NaN, +-Inf, denormals, 1e21 (its square overflows f32).
fn gradients(rng: &mut Rng, n: usize, specials: bool) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let r = rng.uniform();
            if !specials || r > 0.01 {
                rng.normal() * 1e-2
            } else {
                match rng.below(5) {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    3 => 1e-41, // denormal
                    _ => 1e21,
                }
            }
        })
        .collect()
}

fn assert_health_close(fast: &Health, slow: &Health, what: &str) {
    assert_eq!(fast.nan, slow.nan, "{what}: nan");
    assert_eq!(fast.inf, slow.inf, "{what}: inf");
    assert_eq!(fast.first_bad, slow.first_bad, "{what}: first_bad");
    // The lanes change the order of f64 additions; with n <= 1e6 terms the relative error of either
    // order is below n * eps(f64) ~ 2e-10.
    let tol = 1e-9 * slow.sumsq.abs().max(f64::MIN_POSITIVE);
    assert!((fast.sumsq - slow.sumsq).abs() <= tol, "{what}: sumsq {} vs {}", fast.sumsq, slow.sumsq);
}

/// Counts, first bad index and the bits of the sum of squares, all equal.
fn assert_health_bitwise(fast: &Health, scan: &Health, what: &str) {
    assert_eq!(
        (fast.nan, fast.inf, fast.first_bad, fast.sumsq.to_bits()),
        (scan.nan, scan.inf, scan.first_bad, scan.sumsq.to_bits()),
        "{what}: {fast:?} vs {scan:?}"
    );
}

#[test]
fn health_scan_matches_reference() {
    let mut rng = Rng::new(&[1]);
    for &n in &[0, 1, 15, 16, 17, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7, 100_003] {
        for specials in [false, true] {
            let x = gradients(&mut rng, n, specials);
            assert_health_close(&health_scan(&x), &reference::health_scan(&x), &format!("n={n}"));
        }
    }
}

#[test]
fn health_scan_reports_first_bad_and_huge_norms() {
    let mut x = vec![0.5f32; 5000];
    x[4321] = f32::NAN;
    x[4999] = f32::INFINITY;
    let h = health_scan(&x);
    assert_eq!((h.nan, h.inf, h.first_bad), (1, 1, Some(4321)));
    assert!(!h.is_finite());
    assert_eq!(h.sumsq, 0.25 * 4998.0);

    let huge = vec![1e21f32; 4];
    let h = health_scan(&huge);
    assert!(h.is_finite() && h.sumsq.is_finite());
    assert!(h.norm_overflows_f32(), "1e42 per element does not fit f32");
}

#[test]
fn reduce_matches_rank_ordered_sum_bitwise() {
    let mut rng = Rng::new(&[2]);
    for &n_ranks in &[1usize, 2, 3, 4, 7] {
        for &n in &[0usize, 1, 5, BLOCK, 2 * BLOCK + 3, 50_001] {
            let srcs: Vec<Vec<f32>> = (0..n_ranks).map(|_| gradients(&mut rng, n, true)).collect();
            let views: Vec<&[f32]> = srcs.iter().map(|v| v.as_slice()).collect();
            let want = reference::rank_ordered_sum(&views);
            let mut slots = srcs.clone();
            let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(|v| v.as_mut_slice()).collect();
            let mut tally = vec![Health::default(); n_ranks];
            let sum_health = reduce_in_place(&mut refs, &mut tally);
            for (k, slot) in slots.iter().enumerate() {
                let same = slot.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "rank {k} of {n_ranks}, n={n}: reduced values differ from the serial sum");
                assert_health_close(&tally[k], &reference::health_scan(&srcs[k]), "tally");
                // Bitwise what a scan of rank k's input alone gives (replays compare these bits).
                assert_health_bitwise(&tally[k], &health_scan(&srcs[k]), "tally");
            }
            assert_health_close(&sum_health, &reference::health_scan(&want), "sum");
            assert_health_bitwise(&sum_health, &health_scan(&want), "sum");
        }
    }
}

#[test]
fn rng_streams_are_reproducible_and_distinct() {
    let a: Vec<u64> = {
        let mut r = Rng::new(&[7, 1, 2]);
        (0..4).map(|_| r.next_u64()).collect()
    };
    let b: Vec<u64> = {
        let mut r = Rng::new(&[7, 1, 2]);
        (0..4).map(|_| r.next_u64()).collect()
    };
    let c: Vec<u64> = {
        let mut r = Rng::new(&[7, 1, 3]);
        (0..4).map(|_| r.next_u64()).collect()
    };
    assert_eq!(a, b);
    assert_ne!(a, c);
    let mut r = Rng::new(&[0]);
    let mean: f64 = (0..10_000).map(|_| r.uniform() as f64).sum::<f64>() / 10_000.0;
    assert!((mean - 0.5).abs() < 0.02, "uniform mean {mean}");
}

#[test]
fn checksum_matches_reference_in_any_pieces() {
    use gradbus_kernels::checksum::{checksum, Checksum, Prefix, LANES};
    let mut rng = Rng::new(&[5]);
    for &n in &[0, 1, LANES - 1, LANES, LANES + 1, 3 * LANES + 7, 100_003] {
        let x = gradients(&mut rng, n, true);
        let want = reference::checksum(&x);
        assert_eq!(checksum(&x), want, "n={n}");
        // The same value whatever the pieces the buffer arrives in.
        let mut c = Checksum::new();
        let mut at = 0;
        while at < n {
            let len = (rng.below(3 * LANES) + 1).min(n - at);
            c.update(&x[at..at + len]);
            at += len;
        }
        assert_eq!(c.finish(), want, "n={n} in random pieces");
        // Offered points in any order, some passed already, some past the end: still the whole.
        let mut p = Prefix::new();
        for _ in 0..rng.below(8) {
            p.upto(&x, rng.below(n + 2));
        }
        assert!(p.absorbed() <= n);
        assert_eq!(p.finish(&x), want, "n={n} by a prefix");
    }
    // Many states finished side by side: each one's own `finish` (groups of 8 or 16 and a short
    // one), on every level this CPU runs (AVX-512 with DQ: the vector folds).
    for count in [0, 1, 7, 8, 9, 15, 16, 17, 20, 33] {
        let states: Vec<Checksum> = (0..count)
            .map(|_| {
                let mut c = Checksum::new();
                let len = rng.below(3 * LANES);
                c.update(&gradients(&mut rng, len, true));
                c
            })
            .collect();
        let one_by_one: Vec<u64> = states.iter().map(|c| c.finish()).collect();
        for level in gradbus_kernels::simd::Level::ALL.into_iter().filter(|l| l.supported()) {
            let all = gradbus_kernels::simd::with_level(level, || gradbus_kernels::checksum::finish_all(&states));
            assert_eq!(all.unwrap(), one_by_one, "{count} states at {level}");
        }
    }
}

#[test]
fn checksum_sees_every_single_word_change_and_the_length() {
    use gradbus_kernels::checksum::checksum;
    let mut rng = Rng::new(&[6]);
    let x = gradients(&mut rng, 4099, false);
    let base = checksum(&x);
    for i in [0, 1, 63, 64, 2048, 4098] {
        for bit in [0, 13, 22, 31] {
            let mut y = x.clone();
            y[i] = f32::from_bits(y[i].to_bits() ^ (1 << bit));
            assert_ne!(checksum(&y), base, "bit {bit} of word {i}");
        }
    }
    // +0 and -0 are equal floats but different weights' bits; a zero appended changes the length.
    assert_ne!(checksum(&[0.0]), checksum(&[-0.0]));
    assert_ne!(checksum(&x[..4098]), checksum(&[&x[..4098], &[0.0]].concat()));
    // Two words swapped between lanes.
    let mut y = x.clone();
    y.swap(3, 4);
    assert_ne!(checksum(&y), base);
}

#[test]
fn adamw_scaled_hashes_each_range_as_read_and_updates_like_scale_then_adamw() {
    use gradbus_kernels::checksum::{checksum, combine, Checksum};
    use gradbus_kernels::ops::{adamw_scaled, adamw_update, scale};
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut rng = Rng::new(&[29, 1]);
    for &n in &[0, 1, 15, 100, 8192, 8193, 40_003] {
        let g = gradients(&mut rng, n, true);
        let p = gradients(&mut rng, n, false);
        let m = gradients(&mut rng, n, false);
        let v: Vec<f32> = gradients(&mut rng, n, false).iter().map(|x| x * x).collect();
        // Random cuts into 21 tiling ranges (3 groups of finishes), some of them empty, most of
        // them starting and ending mid-group.
        let mut cuts: Vec<usize> = (0..20).map(|_| rng.below(n + 1)).collect();
        cuts.extend([0, n]);
        cuts.sort_unstable();
        let ranges: Vec<_> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
        let s = rng.normal();
        // The two passes it replaces: the sum scaled in memory, then AdamW on it.
        let (mut scaled, mut p0, mut m0, mut v0) = (g.clone(), p.clone(), m.clone(), v.clone());
        scale(&mut scaled, s);
        let written = adamw_update(&mut p0, &scaled, &mut m0, &mut v0, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
        for ranges in [&ranges[..], &[]] {
            let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
            let (w, read) = adamw_scaled(&mut p1, &g, s, &mut m1, &mut v1, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3, ranges);
            let what = format!("n={n}, {} ranges", ranges.len());
            assert_eq!((bits(&p1), bits(&m1), bits(&v1)), (bits(&p0), bits(&m0), bits(&v0)), "{what}: the same update");
            assert_eq!(w, written, "{what}: the checksum of the weights written");
            let want: Vec<u64> = ranges.iter().map(|r| checksum(&g[r.clone()])).collect();
            assert_eq!(read, want, "{what}: the checksum of each range of the gradients as read");
            let twin: Vec<u64> = ranges.iter().map(|r| reference::checksum(&g[r.clone()])).collect();
            assert_eq!(read, twin, "{what}: the twin's checksum of each range");
        }
        assert!(n == 0 || bits(&scaled) != bits(&g), "n={n}: the scale moved the gradients");
        let want: Vec<u64> = ranges.iter().map(|r| checksum(&g[r.clone()])).collect();
        assert_ne!(combine(&want), combine(&[want.as_slice(), &[0]].concat()), "one more piece");
    }
    let (a, b) = (checksum(&[1.0]), checksum(&[2.0]));
    assert_ne!(combine(&[a, b]), combine(&[b, a]), "combine is ordered");
    let (mut p, mut m, mut v) = ([0.0f32; 4], [0.0f32; 4], [0.0f32; 4]);
    let bad = std::panic::catch_unwind(move || {
        adamw_scaled(&mut p, &[0.0; 4], 1.0, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, &[0..2])
    });
    assert!(bad.is_err(), "ranges that do not tile are a program bug");
    let (mut p, mut m, mut v) = ([0.0f32; 4], [0.0f32; 4], [0.0f32; 4]);
    let reversed = [0..3, 3..1, 1..4];
    let bad = std::panic::catch_unwind(move || {
        adamw_scaled(&mut p, &[0.0; 4], 1.0, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, &reversed)
    });
    assert!(bad.is_err(), "a reversed range (elements 1..3 would be updated twice) is a program bug");
    let bad = std::panic::catch_unwind(|| {
        let mut c = Checksum::new();
        c.update(&[1.0; 3]);
        c.absorb_groups(4, |_| ());
    });
    assert!(bad.is_err(), "a pass's groups that would not start at lane 0 are a program bug");
}

#[test]
fn adamw_returns_the_checksum_of_the_weights_it_wrote() {
    use gradbus_kernels::checksum::checksum;
    use gradbus_kernels::ops::adamw_update;
    let mut rng = Rng::new(&[8]);
    for &n in &[0usize, 5, 8192, 20_001] {
        let mut p = gradients(&mut rng, n, false);
        let g = gradients(&mut rng, n, true);
        let mut m = gradients(&mut rng, n, false);
        let mut v: Vec<f32> = gradients(&mut rng, n, false).iter().map(|x| x * x).collect();
        let before = checksum(&p);
        let got = adamw_update(&mut p, &g, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 7);
        assert_eq!(got, checksum(&p), "n={n}");
        if n > 0 {
            assert_ne!(got, before, "n={n}: the weights moved");
        }
    }
}
