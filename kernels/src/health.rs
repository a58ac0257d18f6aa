//! The fused health scan: one read of a gradient slice yields its NaN count, Inf count, sum of
//! squares and the index of its first non-finite element.
//!
//! Invariants: the sum of squares is taken over the FINITE elements only and accumulated in f64,
//! so a finite gradient of 1e21 (whose square overflows f32) still gives a finite, exact-enough norm,
//! and a non-finite element is reported by the counts rather than poisoning the norm. The scan works on
//! blocks of `BLOCK` elements with `LANES` independent accumulators so that it vectorizes (a single
//! scalar accumulator stays scalar in Rust, which has no fast-math); the order of additions is fixed,
//! so the same slice always gives the same bits.
//!
//! The reduce does not call the scan on the blocks it validates when they are finite: it accumulates
//! the same lanes inside its add (`crate::reduce`, which says why the bits are the same), and scans
//! only the rare blocks with a NaN/Inf.

/// Elements per block: small enough to stay in L1 while the reduce kernel re-reads it.
pub const BLOCK: usize = 1024;
/// Independent accumulators per block.
pub(crate) const LANES: usize = 16;

/// Health of a slice of gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Health {
    /// Number of NaN elements.
    pub nan: u64,
    /// Number of +Inf or -Inf elements.
    pub inf: u64,
    /// Sum of squares of the finite elements, accumulated in f64.
    pub sumsq: f64,
    /// Index of the first non-finite element, relative to the start of the scanned range.
    pub first_bad: Option<u64>,
}

impl Health {
    /// True when no element is NaN or Inf.
    pub fn is_finite(&self) -> bool {
        self.nan == 0 && self.inf == 0
    }

    /// Norm overflow: every element finite, yet the sum of squares does not fit an f32.
    pub fn norm_overflows_f32(&self) -> bool {
        self.is_finite() && self.sumsq > f32::MAX as f64
    }

    /// Fold in the health of a range that starts `offset` elements after this one's start. Ranges
    /// must be merged in increasing offset order for the sum of squares to keep a fixed order.
    pub fn merge(&mut self, other: &Health, offset: u64) {
        self.nan += other.nan;
        self.inf += other.inf;
        self.sumsq += other.sumsq;
        if self.first_bad.is_none() {
            self.first_bad = other.first_bad.map(|i| i + offset);
        }
    }
}

/// Where a slice's largest values are, as the reduce tallies it per source without a pass of its
/// own: the largest |value| of the block (`BLOCK` elements, as the reduce walks them) with the
/// largest sum of squares. A value many binades above its neighbours owns its block's sum of
/// squares, so this names it; on a healthy slice it is one of the largest values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peak {
    /// The largest |value| among the finite elements of that block (0 for an empty slice).
    pub value: f32,
    /// Its index, relative to the start of the tallied range.
    pub at: u64,
    /// That block's sum of squares (-inf before the first block).
    pub block_sumsq: f64,
}

impl Default for Peak {
    fn default() -> Peak {
        Peak { value: 0.0, at: 0, block_sumsq: f64::NEG_INFINITY }
    }
}

impl Peak {
    /// Take `block` (starting at index `lo`, with sum of squares `sumsq`) if its sum of squares
    /// exceeds the best so far: the block is scanned for its largest finite |value| (the first
    /// such index). Called once per block; a scan happens only on a new best (for random data
    /// about ln(blocks) times).
    #[inline]
    pub fn offer(&mut self, block: &[f32], lo: u64, sumsq: f64) {
        if sumsq > self.block_sumsq {
            let (top, at) = largest(block);
            *self = Peak { value: f32::from_bits(top), at: lo + at as u64, block_sumsq: sumsq };
        }
    }
}

/// The largest finite |value| of `x` as its bits (0 when none), and the first index holding it.
/// |value| as bits orders the finite values as floats (non-finite ones count as 0): an integer
/// maximum, which vectorizes (a float one does not, without fast-math). The reduce calls it for
/// each source's block that leads so far (`Peak::offer`: ~2.7 of a chunk's 8 blocks of random
/// data), from L1. On AVX-512 an explicit loop (`largest_avx512`), which takes about half the
/// compiled portable loop's time there; on the other levels the portable loop compiled for the
/// level. Both return the same pair (`largest_is_the_portable_search`).
fn largest(x: &[f32]) -> (u32, usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() == crate::simd::Level::Avx512 {
        // SAFETY: `simd::active` returns only levels the CPU runs, and Avx512 has AVX-512F.
        return unsafe { largest_avx512(x) };
    }
    largest_portable(x)
}

/// The sort key of `largest`: |value| as bits, 0 for a non-finite value.
#[inline(always)]
fn key(v: &f32) -> u32 {
    let b = v.to_bits() & 0x7fff_ffff;
    if b >= 0x7f80_0000 {
        0
    } else {
        b
    }
}

/// `largest` by 16 independent lane maxima, then a search for the first index holding the top.
fn largest_portable(x: &[f32]) -> (u32, usize) {
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // the indexed lanes vectorize
    fn body(x: &[f32]) -> (u32, usize) {
        let mut lanes = [0u32; 16];
        let chunks = x.chunks_exact(16);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..16 {
                lanes[l] = lanes[l].max(key(&c[l]));
            }
        }
        let top = tail.iter().map(key).fold(lanes.into_iter().fold(0, u32::max), u32::max);
        // The first index holding it: 16 elements tested at a time, then the one chunk searched.
        for (i, c) in x.chunks(16).enumerate() {
            if c.iter().fold(false, |hit, v| hit | (key(v) == top)) {
                return (top, 16 * i + c.iter().position(|v| key(v) == top).unwrap_or(0));
            }
        }
        (top, 0)
    }
    simd_dispatch!(body(x: &[f32]) -> (u32, usize))
}

/// `largest` with AVX-512: the maximum of 16 keys per instruction in four chains (a masked
/// maximum: a non-finite element's key is 0, which leaves a chain as it was), then a compare per
/// 16 elements up to the first hit (|value| as bits against the top: a non-finite element's bits
/// exceed every finite top, so only a top of 0 has to match them too). The last `len % 16`
/// elements go through the scalar `key`.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn largest_avx512(x: &[f32]) -> (u32, usize) {
    use std::arch::x86_64::*;
    let full = x.len() - x.len() % 16;
    let (p, abs, inf) = (x.as_ptr(), _mm512_set1_epi32(0x7fff_ffff), _mm512_set1_epi32(0x7f80_0000));
    // |value| as bits of elements i..i + 16.
    let bits = |i: usize| {
        // SAFETY: callers pass i + 16 <= full <= x.len() (an unaligned load inside `x`); AVX-512F
        // is enabled (caller).
        unsafe { _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p.add(i))), abs) }
    };
    let top_of = |m: __m512i, i: usize| {
        let b = bits(i);
        _mm512_mask_max_epu32(m, _mm512_cmplt_epu32_mask(b, inf), m, b)
    };
    let mut m = [_mm512_setzero_si512(); 4];
    let mut i = 0;
    while i + 64 <= full {
        for (j, m) in m.iter_mut().enumerate() {
            *m = top_of(*m, i + 16 * j);
        }
        i += 64;
    }
    while i < full {
        m[0] = top_of(m[0], i);
        i += 16;
    }
    let m = _mm512_max_epu32(_mm512_max_epu32(m[0], m[1]), _mm512_max_epu32(m[2], m[3]));
    let top = x[full..].iter().map(key).fold(_mm512_reduce_max_epu32(m), u32::max);
    let t = _mm512_set1_epi32(top as i32);
    let mut i = 0;
    while i < full {
        let b = bits(i);
        let hit = if top > 0 {
            _mm512_cmpeq_epi32_mask(b, t)
        } else {
            _mm512_cmpeq_epi32_mask(b, t) | _mm512_cmpge_epu32_mask(b, inf)
        };
        if hit != 0 {
            return (top, i + hit.trailing_zeros() as usize);
        }
        i += 16;
    }
    (top, full + x[full..].iter().position(|v| key(v) == top).unwrap_or(0))
}

/// Health of one block (at most `BLOCK` elements), lanes folded in a fixed order.
///
/// A block with no NaN/Inf (the common case) takes an explicit-SIMD path on x86_64 (AVX2 when the
/// active level has it, `simd::active`, else SSE2): LLVM spills the 16 f64 lanes of the portable loop below and runs it
/// at ~4 GB/s, the SIMD path runs at ~12 (SSE2) / ~25 (AVX2) GB/s from L1. It keeps the same lanes
/// and the same order of additions (and never fuses the multiply-add), so it returns the same bits;
/// a block with a non-finite element falls back to the portable loop.
///
/// The reduce (`crate::reduce`) accumulates these same lanes inside its add instead of calling this
/// on finite blocks: a change to the lanes or their fold here must be made there too (its tests
/// compare the two bitwise).
#[inline]
pub fn scan_block(x: &[f32]) -> Health {
    debug_assert!(x.len() <= BLOCK);
    if let Some(sumsq) = simd::sumsq_if_finite(x) {
        return Health { nan: 0, inf: 0, sumsq, first_bad: None };
    }
    scan_block_portable(x)
}

/// The portable scan of one block: counts and the f64 sum of squares in `LANES` lanes.
pub fn scan_block_portable(x: &[f32]) -> Health {
    let mut bad = [0u32; LANES];
    let mut nan = [0u32; LANES];
    let mut ss = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            let v = c[l];
            let finite = v.is_finite();
            bad[l] += (!finite) as u32;
            nan[l] += v.is_nan() as u32;
            let f = if finite { v as f64 } else { 0.0 };
            ss[l] += f * f;
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        let finite = v.is_finite();
        bad[l] += (!finite) as u32;
        nan[l] += v.is_nan() as u32;
        let f = if finite { v as f64 } else { 0.0 };
        ss[l] += f * f;
    }
    let bad: u64 = bad.iter().map(|&b| b as u64).sum();
    let nan: u64 = nan.iter().map(|&b| b as u64).sum();
    let first_bad = if bad > 0 { x.iter().position(|v| !v.is_finite()).map(|i| i as u64) } else { None };
    Health { nan, inf: bad - nan, sumsq: fold_lanes(ss), first_bad }
}

/// Pairwise fold of the lanes: fixed order, fewer rounding steps than a chain.
#[inline]
pub(crate) fn fold_lanes(mut ss: [f64; LANES]) -> f64 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            ss[l] += ss[l + w];
        }
    }
    ss[0]
}

/// The sum of squares of an all-finite block, lane `l` taking elements `l, l + 16, ...` in order
/// exactly as `scan_block_portable` does; `None` as soon as the block holds a NaN or Inf.
mod simd {
    #[cfg(target_arch = "x86_64")]
    use super::{fold_lanes, LANES};

    /// The remainder (fewer than `LANES` elements) goes to lanes 0.. in order, like the portable loop.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    fn tail(ss: &mut [f64; LANES], rest: &[f32]) -> bool {
        for (l, &v) in rest.iter().enumerate() {
            if !v.is_finite() {
                return false;
            }
            let f = v as f64;
            ss[l] += f * f;
        }
        true
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub fn sumsq_if_finite(x: &[f32]) -> Option<f64> {
        if crate::simd::active() >= crate::simd::Level::Avx2 {
            // SAFETY: the active level has AVX2 (`simd::active` returns only levels the CPU runs).
            unsafe { avx2(x) }
        } else {
            sse2(x)
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    #[inline]
    pub fn sumsq_if_finite(_x: &[f32]) -> Option<f64> {
        None
    }

    /// Eight `__m128d` accumulators hold lanes (0,1), (2,3), ... (14,15).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub(super) fn sse2(x: &[f32]) -> Option<f64> {
        use std::arch::x86_64::*;
        let mut chunks = x.chunks_exact(LANES);
        // SAFETY: SSE2 is part of the x86_64 baseline; every load reads 4 floats inside a chunk
        // of 16 (unaligned loads).
        let (mut ss, bad) = unsafe {
            let mut acc = [_mm_setzero_pd(); 8];
            let mut bad = _mm_setzero_si128();
            let abs = _mm_set1_epi32(0x7fff_ffff);
            let max = _mm_set1_epi32(0x7f7f_ffff); // bits of f32::MAX: above it is Inf or NaN
            for c in &mut chunks {
                for q in 0..4 {
                    let v = _mm_loadu_ps(c.as_ptr().add(4 * q));
                    let bits = _mm_and_si128(_mm_castps_si128(v), abs);
                    bad = _mm_or_si128(bad, _mm_cmpgt_epi32(bits, max));
                    let lo = _mm_cvtps_pd(v);
                    let hi = _mm_cvtps_pd(_mm_movehl_ps(v, v));
                    acc[2 * q] = _mm_add_pd(acc[2 * q], _mm_mul_pd(lo, lo));
                    acc[2 * q + 1] = _mm_add_pd(acc[2 * q + 1], _mm_mul_pd(hi, hi));
                }
            }
            let mut ss = [0f64; LANES];
            for (j, a) in acc.iter().enumerate() {
                _mm_storeu_pd(ss.as_mut_ptr().add(2 * j), *a);
            }
            (ss, _mm_movemask_epi8(bad) != 0)
        };
        (!bad && tail(&mut ss, chunks.remainder())).then(|| fold_lanes(ss))
    }

    /// Four `__m256d` accumulators hold lanes 0-3, 4-7, 8-11, 12-15.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(x: &[f32]) -> Option<f64> {
        use std::arch::x86_64::*;
        let mut chunks = x.chunks_exact(LANES);
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut bad = _mm256_setzero_si256();
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let max = _mm256_set1_epi32(0x7f7f_ffff);
        for c in &mut chunks {
            for h in 0..2 {
                // SAFETY: reads floats 8h..8h+8 of a chunk of 16; AVX2 is enabled (caller).
                let v = unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * h)) };
                let bits = _mm256_and_si256(_mm256_castps_si256(v), abs);
                bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(bits, max));
                let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
                let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
                acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_mul_pd(lo, lo));
                acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_mul_pd(hi, hi));
            }
        }
        let mut ss = [0f64; LANES];
        for (j, a) in acc.iter().enumerate() {
            // SAFETY: writes 4 doubles at 4j..4j+4 < 16.
            unsafe { _mm256_storeu_pd(ss.as_mut_ptr().add(4 * j), *a) };
        }
        let bad = _mm256_movemask_epi8(bad) != 0;
        (!bad && tail(&mut ss, chunks.remainder())).then(|| fold_lanes(ss))
    }
}

/// Health of a whole slice in one pass.
pub fn health_scan(x: &[f32]) -> Health {
    let mut h = Health::default();
    for (b, blk) in x.chunks(BLOCK).enumerate() {
        h.merge(&scan_block(blk), (b * BLOCK) as u64);
    }
    h
}

/// Whether every element is finite: `health_scan(x).is_finite()` at a fraction of its cost (no sum
/// of squares), for a slice whose health is needed only when it is not (the DDP hook's scan of a
/// reduced sum). A block at a time, without an early exit inside a block, so that it vectorizes.
pub fn all_finite(x: &[f32]) -> bool {
    #[inline(always)]
    fn body(x: &[f32]) -> bool {
        x.chunks(BLOCK).all(|blk| {
            // |v|'s bits: at or above the infinity's exponent means Inf or NaN.
            blk.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff)) < 0x7f80_0000
        })
    }
    simd_dispatch!(body(x: &[f32]) -> bool)
}

/// `health_scan(x)`, then `x[i] *= s`, each block scaled while it is in L1 after its scan: one
/// read of the slice from memory for both (the DDP hook's pre-division, fused with its scan). The
/// same `Health` as `health_scan` of the unscaled slice, the same products as `ops::scale`.
pub fn scan_and_scale(x: &mut [f32], s: f32) -> Health {
    let mut h = Health::default();
    for (b, blk) in x.chunks_mut(BLOCK).enumerate() {
        h.merge(&scan_block(blk), (b * BLOCK) as u64);
        crate::ops::scale(blk, s);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// The SIMD path must return the portable loop's bits, not merely close values: the bus
    /// promises the same table on every rank and every run, whatever CPU each rank has.
    #[test]
    fn simd_scan_is_bitwise_the_portable_scan() {
        let mut rng = Rng::new(&[42]);
        for t in 0..20_000usize {
            let n = rng.below(BLOCK + 1);
            let scale = 10f32.powi(rng.below(44) as i32 - 22);
            let mut x: Vec<f32> = (0..n).map(|_| rng.normal() * scale).collect();
            if n > 0 {
                let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, 1e-45, -0.0, 1e21];
                for _ in 0..t % 3 {
                    let k = rng.below(n);
                    x[k] = specials[rng.below(specials.len())];
                }
            }
            let (fast, slow) = (scan_block(&x), scan_block_portable(&x));
            assert_eq!((fast.nan, fast.inf, fast.first_bad), (slow.nan, slow.inf, slow.first_bad), "case {t}");
            assert_eq!(fast.sumsq.to_bits(), slow.sumsq.to_bits(), "case {t}: {} vs {}", fast.sumsq, slow.sumsq);
            // The SSE2 path too, which this CPU may not take through `scan_block`.
            #[cfg(target_arch = "x86_64")]
            assert_eq!(simd::sse2(&x).map(f64::to_bits), slow.is_finite().then(|| slow.sumsq.to_bits()), "case {t}");
        }
    }

    /// The search by its definition: the largest finite |value|, the first index holding it (0 when
    /// no element is finite and non-zero).
    fn naive_largest(x: &[f32]) -> (u32, usize) {
        let (mut top, mut at) = (0f32, 0);
        for (i, a) in x.iter().map(|v| v.abs()).enumerate() {
            if a.is_finite() && a > top {
                (top, at) = (a, i);
            }
        }
        (top.to_bits(), at)
    }

    /// Every level's search (the explicit AVX-512 loop and the compiled portable loop) gives the
    /// definition's pair, ties (the first index wins), zeros, NaNs and infinities included, at every
    /// length up to a block.
    #[test]
    fn largest_is_the_portable_search() {
        let mut rng = Rng::new(&[7]);
        let specials = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MAX, -f32::MAX, 1e-45];
        for t in 0..6_000usize {
            let n = if t < BLOCK + 1 { t } else { rng.below(BLOCK + 1) };
            let mut x: Vec<f32> = match t % 4 {
                0 => (0..n).map(|_| rng.normal()).collect(),
                1 => vec![0.0; n],
                2 => (0..n).map(|_| specials[rng.below(specials.len())]).collect(),
                _ => (0..n).map(|_| rng.normal() * 1e-3).collect(),
            };
            if n > 0 {
                for _ in 0..t % 5 {
                    let i = rng.below(n);
                    x[i] = specials[rng.below(specials.len())];
                }
                // The same largest value at several indices, of both signs.
                let top = naive_largest(&x).0;
                for _ in 0..t % 3 {
                    let i = rng.below(n);
                    x[i] = if rng.below(2) == 0 { f32::from_bits(top) } else { -f32::from_bits(top) };
                }
            }
            let want = naive_largest(&x);
            assert_eq!(largest_portable(&x), want, "case {t}: portable");
            for level in crate::simd::available() {
                let got = crate::simd::with_level(level, || largest(&x)).expect("an available level");
                assert_eq!(got, want, "case {t} (n {n}) at {level}");
            }
        }
    }

    /// A peak is the largest |value| of the block with the largest sum of squares, not of the first
    /// block that led, nor the slice's largest value: here the first block (largest 5 at 3) leads,
    /// then block 1 (7 at 1000 and -7 at 1010: the first), block 2 holds the slice's largest value
    /// (60, alone: a smaller sum of squares), and block 3 wins with -11 at 517 (11 again at 900, a
    /// NaN and an Inf, which count for nothing). At every level.
    #[test]
    fn a_peak_names_the_largest_element_of_the_block_with_the_largest_sum_of_squares() {
        let mut x = vec![0f32; 4 * BLOCK];
        x[3] = 5.0;
        x[BLOCK..2 * BLOCK].fill(2.0);
        x[BLOCK + 1000] = 7.0;
        x[BLOCK + 1010] = -7.0;
        x[2 * BLOCK + 40] = 60.0;
        x[3 * BLOCK..].fill(3.0);
        x[3 * BLOCK + 5] = f32::NAN;
        x[3 * BLOCK + 6] = f32::INFINITY;
        x[3 * BLOCK + 517] = -11.0;
        x[3 * BLOCK + 900] = 11.0;
        for level in crate::simd::available() {
            let mut peak = Peak::default();
            let mut seen = vec![];
            crate::simd::with_level(level, || {
                for (b, block) in x.chunks(BLOCK).enumerate() {
                    peak.offer(block, (b * BLOCK) as u64, scan_block(block).sumsq);
                    seen.push((peak.value, peak.at));
                }
            })
            .expect("an available level");
            let want =
                [(5.0, 3), (7.0, BLOCK as u64 + 1000), (7.0, BLOCK as u64 + 1000), (11.0, 3 * BLOCK as u64 + 517)];
            assert_eq!(seen, want, "at {level}");
            assert_eq!(peak.block_sumsq, scan_block(&x[3 * BLOCK..]).sumsq, "at {level}");
        }
    }

    /// `all_finite` says what the scan's counts say, wherever the one non-finite element sits.
    #[test]
    fn all_finite_agrees_with_the_scan() {
        let mut rng = Rng::new(&[11]);
        for t in 0..400usize {
            let n = rng.below(3 * BLOCK + 5);
            let mut x: Vec<f32> = (0..n).map(|_| rng.normal() * [1e-30f32, 1.0, 1e30][t % 3]).collect();
            if n > 0 && t % 4 != 0 {
                x[rng.below(n)] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX][t % 4];
            }
            assert_eq!(all_finite(&x), health_scan(&x).is_finite(), "case {t}");
        }
        assert!(all_finite(&[]));
        assert!(!all_finite(&[-f32::NAN]));
    }

    /// The fused scan-and-scale is the scan of the slice as it was, then the plain scale: the same
    /// health bits and the same products, across block boundaries and with non-finite elements.
    #[test]
    fn scan_and_scale_is_the_scan_then_the_scale() {
        let mut rng = Rng::new(&[7]);
        for t in 0..300usize {
            let n = rng.below(5 * BLOCK + 3);
            let mut x: Vec<f32> = (0..n).map(|_| rng.normal() * 1e3).collect();
            if n > 0 && t % 2 == 1 {
                x[rng.below(n)] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][t % 3];
            }
            let s = [0.5f32, 1.0 / 3.0, 0.125, 1.0 / 7.0][t % 4];
            let want = health_scan(&x);
            let mut scaled = x.clone();
            crate::ops::scale(&mut scaled, s);
            let got = scan_and_scale(&mut x, s);
            assert_eq!((got.nan, got.inf, got.first_bad), (want.nan, want.inf, want.first_bad), "case {t}");
            assert_eq!(got.sumsq.to_bits(), want.sumsq.to_bits(), "case {t}");
            assert!(x.iter().zip(&scaled).all(|(a, b)| a.to_bits() == b.to_bits()), "case {t}: products differ");
        }
    }
}
