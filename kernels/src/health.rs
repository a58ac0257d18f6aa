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
/// maximum, which vectorizes (a float one does not, without fast-math), compiled for the CPU's
/// best instruction set.
fn largest(x: &[f32]) -> (u32, usize) {
    #[inline(always)]
    fn key(v: &f32) -> u32 {
        let b = v.to_bits() & 0x7fff_ffff;
        if b >= 0x7f80_0000 {
            0
        } else {
            b
        }
    }
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
}
