//! The reduce step of the gradient bus: sum the same chunk of every rank's gradient slot, in rank
//! order, and write the sum back into every slot, tallying each SOURCE rank's health on the way.
//!
//! Invariants: the sum is `((s0 + s1) + s2) + ...` element by element, always in that order, so every
//! rank gets bitwise-identical results and every run repeats them; where two NaNs meet, [`add`]
//! says which one the sum keeps, the same in every build and on every path. Each source is read once from
//! memory and each destination written once: the memcpy floor. The tallies describe the sources
//! BEFORE they are overwritten, and every `Health` (each tally and the sum's) is bitwise what
//! `scan_block` gives for each block of its input, merged in block order.
//!
//! Validation is fused into the add (x86_64 at the AVX level or above, `simd::active`: the passes use
//! 256-bit float operations only), which makes it nearly free: one pass per
//! source and block loads the source, adds it into the block's sum and accumulates the f64 squares
//! of the source in `scan_block`'s 16 lanes (lane `l` takes elements `l, l + 16, ...` in order; the
//! last `< 16` elements go to lanes `0..`; folded by `fold_lanes`). The square of an f32 is exact in
//! f64, and each lane adds the same squares in the same order, so the lanes hold `scan_block`'s bits.
//! The last source's pass also squares the finished sum into a second set of lanes. The squares cost
//! a convert, a multiply and an add per element from registers, no extra pass over memory; and the
//! loop never tests an element for NaN/Inf, because:
//!
//! - the square of a finite f32 is below 2^256 and a block adds at most 1024 of them, so a lane, and
//!   the folded sum of squares, is finite iff all its elements are;
//! - a NaN/Inf source element makes the rank-ordered sum NaN/Inf at that index (NaN + x = NaN,
//!   Inf + finite = Inf, Inf + -Inf = NaN, and a non-finite partial sum stays non-finite).
//!
//! So a finite sum of squares of the sum block proves every source block finite, and then each
//! block's `Health` is `{ nan: 0, inf: 0, sumsq: fold_lanes(lanes), first_bad: None }`: what
//! `scan_block` returns for a finite block. Otherwise (a NaN/Inf in some source, or finite sources
//! whose sum overflowed: rare) `scan_block` scans the block again, per source (still intact: the sum
//! is written back after) and for the sum, and gives the counts and the first bad index. Below the
//! AVX level the reduce adds (a block whose sum holds a NaN again, with [`add`]), then scans every
//! block. The fused passes prefetch each slot's next block
//! (a block is a 4 KiB page, where the hardware prefetcher stops), and `reduce_plain`, the bus's
//! unvalidated reduce, is the same loop less the squares: what validation costs is the squares.

use crate::checksum::Checksum;
use crate::health::{scan_block, Health, Peak, BLOCK};

/// Rank-ordered in-place all-reduce of `slots` (all the same length). `tally[k]` receives the health
/// of `slots[k]` as it was on entry; the return value is the health of the sum.
///
/// Panics if the slots differ in length or `tally.len() != slots.len()`: callers build both from one
/// layout, so a mismatch is a bug, not an input error.
pub fn reduce_in_place(slots: &mut [&mut [f32]], tally: &mut [Health]) -> Health {
    reduce::<true>(slots, tally, &mut [], None, fused::available(), None)
}

/// `reduce_in_place` (`to = None`) or `reduce_to_one` (`Some(root)`) that also tallies each source's
/// `Peak` into `peaks[k]` (one per slot, or none at all: no peaks; indices relative to the slices'
/// start) and, given `hash`, absorbs the sum into it as written (block by block while in cache: the
/// same value as `checksum` of the written sum): the same sum and tallies, bit for bit, from the
/// same pass.
pub fn reduce_with_peaks(
    slots: &mut [&mut [f32]],
    tally: &mut [Health],
    peaks: &mut [Peak],
    to: Option<usize>,
    hash: Option<&mut Checksum>,
) -> Health {
    assert!(peaks.is_empty() || peaks.len() == slots.len(), "one peak per slot, or none");
    reduce::<true>(slots, tally, peaks, to, fused::available(), hash)
}

/// `reduce_in_place` that writes the sum into `slots[root]` only (the other slots keep their
/// values): the same rank-ordered sum and the same tallies. The hierarchical transport uses it to
/// leave a node's sum in its leader's slot.
pub fn reduce_to_one(slots: &mut [&mut [f32]], tally: &mut [Health], root: usize) -> Health {
    assert!(root < slots.len(), "root {root} of {} slots", slots.len());
    reduce::<true>(slots, tally, &mut [], Some(root), fused::available(), None)
}

/// `reduce_in_place` without the tallies: the same sum, bit for bit, by the same loop less the
/// squares. The bus's unvalidated reduce, so that what validation costs is measured against the
/// same adds, loads and prefetches.
pub fn reduce_plain(slots: &mut [&mut [f32]]) {
    reduce::<false>(slots, &mut [], &mut [], None, fused::available(), None);
}

/// The one reduce loop: every slot (`to = None`) or one slot (`Some(root)`) receives the sum.
/// `fused` (only where `fused::available()`) takes the fused add-and-square passes; `VALIDATE` =
/// false leaves out the squares and the tallies (`reduce_plain`: `tally` is empty, the result
/// `Health::default()`). `peaks`: empty, or one per slot (each source's `Peak`, offered every block
/// before the sum overwrites it). `hash`: absorbs each block of the sum as it is written.
fn reduce<const VALIDATE: bool>(
    slots: &mut [&mut [f32]],
    tally: &mut [Health],
    peaks: &mut [Peak],
    to: Option<usize>,
    fused: bool,
    mut hash: Option<&mut Checksum>,
) -> Health {
    assert_eq!(if VALIDATE { slots.len() } else { 0 }, tally.len(), "one tally per slot");
    let Some(len) = slots.first().map(|s| s.len()) else {
        return Health::default();
    };
    assert!(slots.iter().all(|s| s.len() == len), "slots of one bucket chunk must have one length");
    let mut sum = Health::default();
    let mut acc = [0f32; BLOCK];
    // The fused pass's per-source sums of squares of the current block.
    let mut sumsq = vec![0f64; if fused && VALIDATE { slots.len() } else { 0 }];
    let mut lo = 0;
    while lo < len {
        let hi = (lo + BLOCK).min(len);
        let acc = &mut acc[..hi - lo];
        let finite = if fused {
            // SAFETY: `fused` is only set where `fused::available()` (the CPU has AVX).
            unsafe { fused::sum_block::<VALIDATE>(slots, lo, acc, &mut sumsq) }
        } else {
            let mut nan = false;
            for (k, slot) in slots.iter().enumerate() {
                // A NaN in a partial sum stays in the sum: the last add's flag covers them all.
                nan = add_block(acc, &slot[lo..hi], k == 0);
            }
            if nan {
                add_block_defined(acc, slots, lo);
            }
            None
        };
        match finite {
            _ if !VALIDATE => {}
            Some(s) => {
                // Every block finite (module doc): the Health `scan_block` gives, from the lanes.
                for (t, &ss) in tally.iter_mut().zip(&sumsq) {
                    t.merge(&Health { sumsq: ss, ..Health::default() }, lo as u64);
                }
                for ((p, slot), &ss) in peaks.iter_mut().zip(slots.iter()).zip(&sumsq) {
                    p.offer(&slot[lo..hi], lo as u64, ss);
                }
                sum.merge(&Health { sumsq: s, ..Health::default() }, lo as u64);
            }
            None => {
                for (k, (t, slot)) in tally.iter_mut().zip(slots.iter()).enumerate() {
                    let h = scan_block(&slot[lo..hi]);
                    if let Some(p) = peaks.get_mut(k) {
                        p.offer(&slot[lo..hi], lo as u64, h.sumsq);
                    }
                    t.merge(&h, lo as u64);
                }
                sum.merge(&scan_block(acc), lo as u64);
            }
        }
        if let Some(c) = hash.as_deref_mut() {
            c.update(acc);
        }
        match to {
            None => slots.iter_mut().for_each(|slot| slot[lo..hi].copy_from_slice(acc)),
            Some(root) => slots[root][lo..hi].copy_from_slice(acc),
        }
        lo = hi;
    }
    sum
}

/// `acc = src` (`first`) or `acc += src`, element by element; returns whether the sum holds a NaN
/// after an add (a copy keeps the source's bits). Which NaN a NaN + NaN gives here is the
/// compiler's choice (the order of the operands in its vector and scalar adds): a block with a NaN
/// is summed again by [`add_block_defined`].
#[inline(always)]
fn add_block(acc: &mut [f32], src: &[f32], first: bool) -> bool {
    if first {
        acc.copy_from_slice(src);
        return false;
    }
    let mut nan = false;
    for (a, &s) in acc.iter_mut().zip(src) {
        *a += s;
        nan |= a.is_nan();
    }
    nan
}

/// `acc` = the rank-ordered sum of `slots[k][lo..lo + acc.len()]`, each element added by [`add`]:
/// the sum of a block in which a NaN appeared, with the NaNs `add` defines. Rare (a NaN in a
/// source, or Inf + -Inf), so one element at a time.
#[cold]
fn add_block_defined(acc: &mut [f32], slots: &[&mut [f32]], lo: usize) {
    let len = acc.len();
    acc.copy_from_slice(&slots[0][lo..lo + len]);
    for slot in &slots[1..] {
        for (i, (a, &s)) in acc.iter_mut().zip(&slot[lo..lo + len]).enumerate() {
            *a = add(*a, s, i, len);
        }
    }
}

/// How the reduce adds source element `s` into the sum `a` at index `i` of a block (or chunk) of
/// `len` elements: `a + s`, and when that is NaN, the NaN that [`first_nan_add`] gives with the sum
/// first for the elements before [`sum_first`]`(len)` and the source first for the last `len % 8`.
/// Only NaN + NaN tells the two orders apart.
///
/// The split is the order that the release build's loop happened to compile to before the rule was
/// written down (SSE `addps` with the sum first over whole groups of 8, scalar `addss` with the
/// source first after; a debug build picked the other NaN), kept so that the bits of every reduce
/// stay what they were. Blocks are multiples of 8 long except a chunk's last, so a chunk's
/// last `len % 8` elements are its last block's. The rank-ordered twin (`reference`) adds with it.
#[inline]
pub fn add(a: f32, s: f32, i: usize, len: usize) -> f32 {
    if i < sum_first(len) {
        first_nan_add(a, s)
    } else {
        first_nan_add(s, a)
    }
}

/// The elements of a block of `len` whose NaN + NaN keeps the sum's NaN (see [`add`]).
#[inline(always)]
fn sum_first(len: usize) -> usize {
    len - len % 8
}

/// `x + y`, and when that is NaN, the NaN that x86's SSE and AVX adds return for it (Intel SDM vol.
/// 1, table 4-7): `x` if it is a NaN, else `y` if it is one, quietened (the quiet bit set), else
/// (Inf + -Inf) the default NaN `0xffc0_0000`. Rust leaves the payload of a NaN result unspecified
/// and LLVM commutes an add at will, so a plain `x + y` returns whichever NaN the generated code
/// picks; this defines it on every target and build. A finite or infinite sum is the IEEE sum,
/// which does not depend on the order.
#[inline(always)]
fn first_nan_add(x: f32, y: f32) -> f32 {
    const QUIET: u32 = 0x0040_0000;
    let r = x + y;
    let nan = if x.is_nan() {
        f32::from_bits(x.to_bits() | QUIET)
    } else if y.is_nan() {
        f32::from_bits(y.to_bits() | QUIET)
    } else {
        f32::from_bits(0xffc0_0000)
    };
    if r.is_nan() {
        nan
    } else {
        r
    }
}

#[cfg(target_arch = "x86_64")]
mod fused {
    use std::arch::x86_64::*;

    use crate::health::{fold_lanes, LANES};

    /// Whether the fused passes run: the active level has AVX (`simd::active`; they use 256-bit float
    /// operations only, so AVX without AVX2 runs them too).
    #[inline]
    pub fn available() -> bool {
        crate::simd::active() >= crate::simd::Level::Avx
    }

    /// One block of the reduce: `acc` (`acc.len()` elements) = the rank-ordered sum of
    /// `slots[k][lo..lo + acc.len()]`; with `SQ`, `sumsq[k]` = the fold of that source block's f64
    /// lanes, and `Some(fold of the sum's lanes)` when that is finite, i.e. when the sum block is
    /// finite. Without `SQ`, only the sum (and `None`).
    ///
    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    pub unsafe fn sum_block<const SQ: bool>(
        slots: &[&mut [f32]],
        lo: usize,
        acc: &mut [f32],
        sumsq: &mut [f64],
    ) -> Option<f64> {
        let (n, hi) = (slots.len(), lo + acc.len());
        // Each pass prefetches the slot's next block (the current one at the end).
        let next = |k: usize| slots[k][if hi < slots[k].len() { hi } else { lo }..].as_ptr();
        // SAFETY (every `pass` call below): AVX is enabled (caller).
        if !SQ {
            for (k, slot) in slots.iter().enumerate() {
                let (src, next) = (&slot[lo..hi], next(k));
                unsafe {
                    match k {
                        0 => pass::<true, false, false>(acc, src, next),
                        _ => pass::<false, false, false>(acc, src, next),
                    }
                };
            }
            return None;
        }
        let s = if n == 1 {
            sumsq[0] = unsafe { pass::<true, true, true>(acc, &slots[0][lo..hi], next(0)) }.0;
            sumsq[0] // the sum is the one source, bit for bit
        } else {
            sumsq[0] = unsafe { pass::<true, false, true>(acc, &slots[0][lo..hi], next(0)) }.0;
            for k in 1..n - 1 {
                sumsq[k] = unsafe { pass::<false, false, true>(acc, &slots[k][lo..hi], next(k)) }.0;
            }
            let (src, sum) = unsafe { pass::<false, true, true>(acc, &slots[n - 1][lo..hi], next(n - 1)) };
            sumsq[n - 1] = src;
            sum
        };
        s.is_finite().then_some(s)
    }

    /// `acc = src` (`FIRST`) or `acc = acc + src`, returning (with `SQ`) the folded f64 lanes of the
    /// squares of `src` and, when `LAST && !FIRST`, of the new `acc` (else 0): `scan_block`'s sums of
    /// squares, bit for bit.
    ///
    /// The adds are `acc + src` for elements `..m - m % 8` and `src + acc` for the last `m % 8`: the
    /// rule of [`super::add`]. The order only decides which NaN a NaN + NaN returns; x86 returns
    /// the first operand's (what `first_nan_add` defines), and `asm!` pins the operands, which an
    /// intrinsic would not (LLVM commutes `fadd` at will).
    ///
    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn pass<const FIRST: bool, const LAST: bool, const SQ: bool>(
        acc: &mut [f32],
        src: &[f32],
        next: *const f32,
    ) -> (f64, f64) {
        assert_eq!(acc.len(), src.len());
        let m = acc.len();
        let (full, body) = (m - m % LANES, m - m % 8);
        let (a, s) = (acc.as_mut_ptr(), src.as_ptr());
        // Four accumulators per set hold lanes 0-3, 4-7, 8-11, 12-15, as in `health::simd::avx2`.
        let mut ls = [_mm256_setzero_pd(); 4];
        let mut lu = [_mm256_setzero_pd(); 4];
        let mut i = 0;
        while i < full {
            // A hint only: never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(i) as *const i8);
            // SAFETY: elements i..i + 16 <= full <= m of both slices; AVX is enabled (caller).
            unsafe {
                step::<FIRST, LAST, SQ>(a.add(i), s.add(i), &mut ls[..2], &mut lu[..2]);
                step::<FIRST, LAST, SQ>(a.add(i + 8), s.add(i + 8), &mut ls[2..], &mut lu[2..]);
            }
            i += LANES;
        }
        if body > full {
            // Elements full..full + 8 go to lanes 0..8, one square each: the order of `tail`.
            // SAFETY: full + 8 == body <= m.
            unsafe { step::<FIRST, LAST, SQ>(a.add(full), s.add(full), &mut ls[..2], &mut lu[..2]) };
        }
        if body == m {
            return (fold(&ls), fold(&lu));
        }
        let (mut src_ss, mut sum_ss) = (lanes(&ls), lanes(&lu));
        // The last m % 8 elements (only a chunk's last block can have them) go to lanes
        // body - full.. in order, like `health::simd::tail`.
        for j in body..m {
            let v = src[j];
            let r = if FIRST {
                v
            } else {
                let r: f32;
                // SAFETY: one register-only AVX instruction: r = v + acc[j].
                unsafe {
                    std::arch::asm!(
                        "vaddss {r}, {v}, {a}",
                        r = lateout(xmm_reg) r,
                        v = in(xmm_reg) v,
                        a = in(xmm_reg) acc[j],
                        options(pure, nomem, nostack, preserves_flags),
                    )
                };
                r
            };
            acc[j] = r;
            if !SQ {
                continue;
            }
            let f = v as f64;
            src_ss[j - full] += f * f;
            if LAST && !FIRST {
                let f = r as f64;
                sum_ss[j - full] += f * f;
            }
        }
        (fold_lanes(src_ss), fold_lanes(sum_ss))
    }

    /// The 16 lanes held in four accumulators, in order.
    #[target_feature(enable = "avx")]
    #[inline]
    fn lanes(v: &[__m256d; 4]) -> [f64; LANES] {
        let mut ss = [0f64; LANES];
        for (j, a) in v.iter().enumerate() {
            // SAFETY: writes 4 doubles at 4j..4j+4 < 16.
            unsafe { _mm256_storeu_pd(ss.as_mut_ptr().add(4 * j), *a) };
        }
        ss
    }

    /// `fold_lanes(lanes(v))` in registers: the same pairwise additions (lane l += lane l + w for
    /// w = 8, 4, 2, 1), hence the same bits.
    #[target_feature(enable = "avx")]
    #[inline]
    fn fold(v: &[__m256d; 4]) -> f64 {
        let w4 = _mm256_add_pd(_mm256_add_pd(v[0], v[2]), _mm256_add_pd(v[1], v[3]));
        let w2 = _mm_add_pd(_mm256_castpd256_pd128(w4), _mm256_extractf128_pd::<1>(w4));
        _mm_cvtsd_f64(_mm_add_sd(w2, _mm_unpackhi_pd(w2, w2)))
    }

    /// Eight elements of `pass`: `a[..8] = s[..8]` or `a[..8] + s[..8]`; with `SQ`, the squares of
    /// `s` into `ls[0]` (elements 0-3) and `ls[1]` (4-7), of the new `a` into `lu` when `LAST && !FIRST`.
    ///
    /// # Safety
    /// The CPU must support AVX; `a` and `s` must be valid for 8 floats.
    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn step<const FIRST: bool, const LAST: bool, const SQ: bool>(
        a: *mut f32,
        s: *const f32,
        ls: &mut [__m256d],
        lu: &mut [__m256d],
    ) {
        // SAFETY: 8 floats at `a` and `s` (caller).
        let v = unsafe { _mm256_loadu_ps(s) };
        let r = if FIRST {
            v
        } else {
            let acc = unsafe { _mm256_loadu_ps(a) };
            let r: __m256;
            // SAFETY: one register-only AVX instruction: r = acc + v.
            unsafe {
                std::arch::asm!(
                    "vaddps {r}, {acc}, {v}",
                    r = lateout(ymm_reg) r,
                    acc = in(ymm_reg) acc,
                    v = in(ymm_reg) v,
                    options(pure, nomem, nostack, preserves_flags),
                )
            };
            r
        };
        // SAFETY: 8 floats at `a` (caller).
        unsafe { _mm256_storeu_ps(a, r) };
        if !SQ {
            return;
        }
        let (vl, vh) = (_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v)));
        ls[0] = _mm256_add_pd(ls[0], _mm256_mul_pd(vl, vl));
        ls[1] = _mm256_add_pd(ls[1], _mm256_mul_pd(vh, vh));
        if LAST && !FIRST {
            let (rl, rh) = (_mm256_cvtps_pd(_mm256_castps256_ps128(r)), _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(r)));
            lu[0] = _mm256_add_pd(lu[0], _mm256_mul_pd(rl, rl));
            lu[1] = _mm256_add_pd(lu[1], _mm256_mul_pd(rh, rh));
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod fused {
    /// No fused pass off x86_64: the reduce adds, then scans.
    #[inline]
    pub fn available() -> bool {
        false
    }

    /// Never called (`available()` is false).
    pub unsafe fn sum_block<const SQ: bool>(_: &[&mut [f32]], _: usize, _: &mut [f32], _: &mut [f64]) -> Option<f64> {
        unreachable!("no fused reduce on this architecture")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::health_scan;
    use crate::reference;
    use crate::rng::Rng;

    /// NaNs of both signs and several payloads (one signalling), infinities, the largest finite
    /// values, denormals and signed zeros.
    const SPECIALS: [f32; 16] = [
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(0xff80_0001),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
        1e-45,
        -1e-45,
        1e-41,
        -0.0,
        0.0,
        1e21,
        -1e21,
        f32::MIN_POSITIVE,
    ];

    /// `n` sources of `len` elements at a random scale in 1e-22..1e21, with specials planted in
    /// some cases and, in others, large same-sign values at shared indices (finite sources whose
    /// rank-ordered sum overflows to +-Inf).
    fn sources(rng: &mut Rng, n: usize, len: usize) -> Vec<Vec<f32>> {
        let scale = 10f32.powi(rng.below(44) as i32 - 22);
        let mut srcs: Vec<Vec<f32>> = (0..n).map(|_| (0..len).map(|_| rng.normal() * scale).collect()).collect();
        if len == 0 {
            return srcs;
        }
        match rng.below(4) {
            0 => {}
            1 => {
                for _ in 0..1 + rng.below(4) {
                    let (k, i) = (rng.below(n), rng.below(len));
                    srcs[k][i] = SPECIALS[rng.below(SPECIALS.len())];
                }
            }
            2 => {
                // Many specials, NaN meeting NaN of another payload at one index.
                for _ in 0..1 + rng.below(len / 8 + 1) {
                    let i = rng.below(len);
                    for src in srcs.iter_mut() {
                        if rng.below(2) == 0 {
                            src[i] = SPECIALS[rng.below(SPECIALS.len())];
                        }
                    }
                }
            }
            _ => {
                for _ in 0..1 + rng.below(3) {
                    let (i, sign) = (rng.below(len), if rng.below(2) == 0 { 1.0 } else { -1.0 });
                    for src in srcs.iter_mut() {
                        src[i] = sign * f32::MAX * (0.5 + 0.5 * rng.uniform());
                    }
                }
            }
        }
        srcs
    }

    /// Slots after, tallies, peaks, sum health and the sum's checksum (as absorbed) of one reduce.
    #[allow(clippy::type_complexity)]
    fn run(srcs: &[Vec<f32>], to: Option<usize>, fused: bool) -> (Vec<Vec<f32>>, Vec<Health>, Vec<Peak>, Health, u64) {
        let mut slots = srcs.to_vec();
        let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mut tally = vec![Health::default(); srcs.len()];
        let mut peaks = vec![Peak::default(); srcs.len()];
        let mut hash = Checksum::new();
        let sum = reduce::<true>(&mut refs, &mut tally, &mut peaks, to, fused, Some(&mut hash));
        (slots, tally, peaks, sum, hash.finish())
    }

    /// The peak by its definition: the first block with the largest sum of squares (`scan_block`'s),
    /// its first largest finite |value|.
    fn naive_peak(x: &[f32]) -> (f32, u64) {
        let mut best: Option<(f64, usize)> = None;
        for (i, b) in x.chunks(BLOCK).enumerate() {
            let ss = scan_block(b).sumsq;
            if best.is_none_or(|(s, _)| ss > s) {
                best = Some((ss, i));
            }
        }
        let Some((_, i)) = best else { return (0.0, 0) };
        let block = &x[i * BLOCK..(i * BLOCK + BLOCK).min(x.len())];
        let (mut v, mut at) = (0f32, 0);
        for (j, a) in block.iter().map(|x| x.abs()).enumerate() {
            if a.is_finite() && a > v {
                (v, at) = (a, j);
            }
        }
        (v, (i * BLOCK + at) as u64)
    }

    /// Slots after one unvalidated reduce (`reduce_plain`).
    fn run_plain(srcs: &[Vec<f32>], fused: bool) -> Vec<Vec<f32>> {
        let mut slots = srcs.to_vec();
        let mut refs: Vec<&mut [f32]> = slots.iter_mut().map(|v| v.as_mut_slice()).collect();
        reduce::<false>(&mut refs, &mut [], &mut [], None, fused, None);
        slots
    }

    fn bits(h: &Health) -> (u64, u64, u64, Option<u64>) {
        (h.nan, h.inf, h.sumsq.to_bits(), h.first_bad)
    }

    fn value_bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
        v.iter().map(|s| s.iter().map(|x| x.to_bits()).collect()).collect()
    }

    /// One case: the fused reduce (where the CPU has it) is bitwise the unfused one, and both are
    /// bitwise the twins: values the rank-ordered sum, every `Health` the block scan of its input.
    /// `reduce_plain`, fused or not, leaves the same values as `reduce_in_place`.
    fn check(srcs: &[Vec<f32>], to: Option<usize>, what: &str) {
        let views: Vec<&[f32]> = srcs.iter().map(|v| v.as_slice()).collect();
        let want = reference::rank_ordered_sum(&views);
        let (slots, tally, peaks, sum, hash) = run(srcs, to, false);
        assert_eq!(hash, reference::checksum(&want), "{what}: the sum's checksum");
        for (k, p) in peaks.iter().enumerate() {
            assert_eq!(
                (p.value.to_bits(), p.at),
                {
                    let (v, at) = naive_peak(&srcs[k]);
                    (v.to_bits(), at)
                },
                "{what}: peak {k}"
            );
        }
        for (k, slot) in slots.iter().enumerate() {
            let expect = if to.is_none() || to == Some(k) { &want } else { &srcs[k] };
            let same = slot.iter().zip(expect).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: slot {k} differs from the rank-ordered sum");
            assert_eq!(bits(&tally[k]), bits(&health_scan(&srcs[k])), "{what}: tally {k}");
            let r = reference::health_scan(&srcs[k]);
            assert_eq!((tally[k].nan, tally[k].inf, tally[k].first_bad), (r.nan, r.inf, r.first_bad), "{what}: {k}");
        }
        assert_eq!(bits(&sum), bits(&health_scan(&want)), "{what}: sum");
        if to.is_none() {
            assert_eq!(value_bits(&run_plain(srcs, false)), value_bits(&slots), "{what}: plain values");
        }
        if fused::available() {
            if to.is_none() {
                assert_eq!(value_bits(&run_plain(srcs, true)), value_bits(&slots), "{what}: fused plain values");
            }
            let (fslots, ftally, fpeaks, fsum, fhash) = run(srcs, to, true);
            assert_eq!(fhash, hash, "{what}: fused sum's checksum");
            assert_eq!(value_bits(&fslots), value_bits(&slots), "{what}: fused values");
            assert_eq!(fpeaks, peaks, "{what}: fused peaks");
            for (k, (f, u)) in ftally.iter().zip(&tally).enumerate() {
                assert_eq!(bits(f), bits(u), "{what}: fused tally {k}: {f:?} vs {u:?}");
            }
            assert_eq!(bits(&fsum), bits(&sum), "{what}: fused sum: {fsum:?} vs {sum:?}");
        }
    }

    #[test]
    fn fused_reduce_is_bitwise_the_unfused_reduce_and_the_twins() {
        if !fused::available() {
            eprintln!("no AVX here: only the unfused reduce is checked");
        }
        let mut rng = Rng::new(&[77]);
        for case in 0..3000 {
            let n = 1 + rng.below(5);
            let len = rng.below(5000);
            let srcs = sources(&mut rng, n, len);
            let to = (case % 3 == 2).then(|| rng.below(n));
            check(&srcs, to, &format!("case {case}: {n} sources of {len}, to {to:?}"));
        }
    }

    /// Every tail shape (lengths around 16, 8 and BLOCK multiples), 1 to 3 sources.
    #[test]
    fn fused_reduce_is_bitwise_at_every_tail_length() {
        let mut rng = Rng::new(&[78]);
        for len in (0..=48).chain(BLOCK - 17..=BLOCK + 33).chain(2 * BLOCK - 9..=2 * BLOCK + 9) {
            for n in 1..=3 {
                for _ in 0..3 {
                    let srcs = sources(&mut rng, n, len);
                    check(&srcs, None, &format!("{n} sources of {len}"));
                }
            }
        }
    }

    /// Where NaN meets NaN the sum keeps the one `add` defines (the sum's, the source's in the
    /// last `len % 8`), on the fused and the portable path, in a debug build as in a release one.
    #[test]
    fn nan_payloads_of_the_sum_are_the_ones_add_defines() {
        let (p, q) = (f32::from_bits(0x7fc0_0001), f32::from_bits(0xffc0_0002));
        for len in [5, 8, 13, 16, 29, 1024, 1031, 2050] {
            let mut srcs = vec![vec![1.0f32; len]; 3];
            for i in 0..len {
                srcs[i % 2][i] = p;
                srcs[2][i] = q;
            }
            check(&srcs, None, &format!("NaN payloads, len {len}"));
        }
    }

    /// `first_nan_add` is what x86's scalar SSE add (`addss`, first operand the sum) returns, for
    /// every pair of specials and a few ordinary values, NaN payloads included: the rule the fused
    /// pass's pinned `vaddps`/`vaddss` follow, so both paths keep the same NaN.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn first_nan_add_is_the_x86_add() {
        let values: Vec<f32> =
            SPECIALS.iter().copied().chain([1.5, -2.25, 3e38, f32::from_bits(0x7f80_0001)]).collect();
        for &x in &values {
            for &y in &values {
                let mut r = x;
                // SAFETY: one register-only SSE instruction (SSE is part of x86_64): r = r + y.
                unsafe {
                    std::arch::asm!("addss {r}, {y}", r = inout(xmm_reg) r, y = in(xmm_reg) y, options(pure, nomem, nostack))
                };
                assert_eq!(first_nan_add(x, y).to_bits(), r.to_bits(), "{:#x} + {:#x}", x.to_bits(), y.to_bits());
            }
        }
    }

    /// Finite sources whose sum overflows: the sum is Inf there and counted, no source is blamed,
    /// and every source's sum of squares is still exact (the rescan of that block).
    #[test]
    fn finite_sources_overflowing_to_inf_are_not_blamed() {
        let mut srcs = vec![vec![0.25f32; 3000]; 2];
        srcs[0][1500] = f32::MAX;
        srcs[1][1500] = f32::MAX;
        let (slots, tally, _, sum, _) = run(&srcs, None, fused::available());
        assert_eq!(slots[0][1500], f32::INFINITY);
        assert_eq!((sum.nan, sum.inf, sum.first_bad), (0, 1, Some(1500)));
        for (k, t) in tally.iter().enumerate() {
            assert!(t.is_finite() && t.norm_overflows_f32(), "{k}: {t:?}");
            assert_eq!(bits(t), bits(&health_scan(&srcs[k])));
        }
        check(&srcs, None, "overflow");
    }
}
