//! The replica checksum: a 64-bit hash of the bits of an f32 buffer (the weights), which every rank
//! sends in the agreement so that replicas that differ stop the job.
//!
//! Invariants: a pure function of the sequence of f32 bit patterns (and its length), the same on every
//! CPU whatever the instruction set: word `i` goes to lane `i % LANES` of `LANES` independent 32-bit
//! FNV-1a lanes (`lane = (lane ^ word) * FNV_PRIME`), and `finish` folds the lanes in lane order
//! through a bijective 64-bit mixer. The lanes have no dependency on each other, so the loop runs at
//! memory speed (AVX2/AVX-512 multiply `LANES` words in a few instructions) where one FNV-1a chain
//! over 64-bit words waited on a multiply per word. Each lane step is a bijection of the lane state
//! for a fixed word and each fold step a bijection of the running hash, so two buffers of the same
//! length that differ in exactly one word ALWAYS hash differently; other differences collide with
//! probability about 2^-64. [`Checksum`] takes the buffer in pieces of any length (the AdamW pass
//! hashes each chunk while it is in cache) and gives the same value as [`checksum`] of the whole.
//! The naive twin is `reference::checksum`.
//!
//! The silent-data-corruption guard hashes gradients with the same function, in pieces: a
//! reducer hashes the chunk of the sum it wrote, and a rank's optimizer hashes what it reads over
//! the same pieces, in its own pass (`ops::adamw_scaled`, through [`Checksum::absorb_groups`] and
//! [`lane_word`]: each group of words hashed while the update has it in registers); [`combine`]
//! folds a bucket's piece hashes in order into one value.

/// Independent lanes: 8 AVX-512 registers (16 AVX2 ones), enough chains to hide the multiply latency.
pub const LANES: usize = 128;
/// FNV-1a's 32-bit prime and offset basis.
pub const FNV_PRIME: u32 = 0x0100_0193;
/// The initial state of lane 0; lane `l` starts at `FNV_OFFSET ^ l`.
pub const FNV_OFFSET: u32 = 0x811c_9dc5;

/// Streaming replica checksum; `update` with consecutive pieces, then `finish`.
#[derive(Clone, Debug)]
pub struct Checksum {
    lanes: [u32; LANES],
    /// Words absorbed so far; the next word goes to lane `len % LANES`.
    len: u64,
}

impl Default for Checksum {
    fn default() -> Self {
        Checksum::new()
    }
}

impl Checksum {
    /// The empty state.
    pub fn new() -> Checksum {
        Checksum { lanes: std::array::from_fn(|l| FNV_OFFSET ^ l as u32), len: 0 }
    }

    /// Absorb the next piece of the buffer.
    pub fn update(&mut self, x: &[f32]) {
        // Head: up to the next lane-0 boundary, one word at a time.
        let head = ((LANES - (self.len as usize % LANES)) % LANES).min(x.len());
        let (first, rest) = x.split_at(head);
        for &v in first {
            self.word(v);
        }
        let whole = rest.len() - rest.len() % LANES;
        lanes::absorb(&mut self.lanes, &rest[..whole]);
        self.len += whole as u64;
        for &v in &rest[whole..] {
            self.word(v);
        }
    }

    /// Absorb the next `words` words of the buffer in a pass of the caller's (a kernel that reads
    /// them anyway): `pass` gets the lanes and must step them over each group of `LANES`
    /// consecutive words, in order, beside its own work on the group ([`lane_word`] on lane `l`
    /// and the group's word `l`, or [`lane_step`] on the group), the last group shorter when
    /// `words` is not whole groups. Needs the words absorbed so far to be whole groups.
    ///
    /// # Panics
    /// When they are not (a program bug).
    pub fn absorb_groups(&mut self, words: usize, pass: impl FnOnce(&mut [u32; LANES])) {
        assert!(
            self.len.is_multiple_of(LANES as u64),
            "absorb_groups: {} words absorbed before are not whole groups of {LANES}",
            self.len
        );
        pass(&mut self.lanes);
        self.len += words as u64;
    }

    #[inline]
    fn word(&mut self, v: f32) {
        let l = &mut self.lanes[self.len as usize % LANES];
        *l = lane_word(*l, v);
        self.len += 1;
    }

    /// The hash of everything absorbed.
    pub fn finish(&self) -> u64 {
        fold(&self.lanes, self.len)
    }
}

/// The replica checksum of a buffer taken while a pass that reads the buffer anyway reaches its
/// parts (the backward pass reads each weight in layout order; hashed right before, it reads them
/// from cache): [`Prefix::upto`] absorbs the buffer up to a point, once, in order (a point already
/// passed absorbs nothing), [`Prefix::finish`] the rest. Always `checksum` of the whole buffer,
/// whatever points the pass offers.
#[derive(Clone, Debug, Default)]
pub struct Prefix {
    hash: Checksum,
    /// Words of the buffer absorbed so far.
    at: usize,
}

impl Prefix {
    /// Nothing absorbed.
    pub fn new() -> Prefix {
        Prefix::default()
    }

    /// Absorb `x[..end]` (`x` the whole buffer, as every call gives it), what is not absorbed yet.
    pub fn upto(&mut self, x: &[f32], end: usize) {
        let end = end.min(x.len());
        if end > self.at {
            self.hash.update(&x[self.at..end]);
            self.at = end;
        }
    }

    /// Words absorbed so far (the buffer's first ones).
    pub fn absorbed(&self) -> usize {
        self.at
    }

    /// The checksum of the whole buffer `x`.
    pub fn finish(mut self, x: &[f32]) -> u64 {
        self.upto(x, x.len());
        self.hash.finish()
    }
}

/// The replica checksum of a whole buffer.
pub fn checksum(x: &[f32]) -> u64 {
    let mut c = Checksum::new();
    c.update(x);
    c.finish()
}

/// Whether `ranges` tile a buffer of `n` words, in order (each starting where the last ended, none
/// reversed; none at all tiles any buffer): the pieces a pass hashes one by one.
pub fn tiles(ranges: &[std::ops::Range<usize>], n: usize) -> bool {
    ranges.first().is_none_or(|r| r.start == 0)
        && ranges.windows(2).all(|w| w[0].end == w[1].start)
        && ranges.iter().all(|r| r.start <= r.end)
        && ranges.last().is_none_or(|r| r.end == n)
}

/// States the portable [`finish_all`] finishes side by side.
const FOLDS: usize = 8;

/// `finish` of each state, in order, with the folds' chains side by side: one fold is 128 dependent
/// mixer steps (~0.45 us on the 2-core AMD EPYC, more than hashing 4,096 words), and independent
/// ones run in about the time of one or two. On AVX-512 (with its 64-bit multiply, AVX-512DQ)
/// 16 at a time in two registers ([`finish_all_avx512`]); elsewhere `FOLDS` at a time in scalar
/// registers. The same values as `finish`, one at a time.
pub fn finish_all(states: &[Checksum]) -> Vec<u64> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() == crate::simd::Level::Avx512 && std::arch::is_x86_feature_detected!("avx512dq") {
        // SAFETY: `simd::active` returns only levels the CPU runs (Avx512: AVX-512F), and the CPU
        // has AVX-512DQ (checked just now).
        return unsafe { finish_all_avx512(states) };
    }
    finish_all_portable(states)
}

/// [`finish_all`] in scalar registers, `FOLDS` chains side by side.
fn finish_all_portable(states: &[Checksum]) -> Vec<u64> {
    let mut out = Vec::with_capacity(states.len());
    for group in states.chunks(FOLDS) {
        // A short group repeats its last state (those values are dropped).
        let g: [&Checksum; FOLDS] = std::array::from_fn(|i| &group[i.min(group.len() - 1)]);
        let mut h: [u64; FOLDS] = std::array::from_fn(|i| FOLD_SEED ^ g[i].len);
        for l in 0..LANES {
            for (h, c) in h.iter_mut().zip(g) {
                *h = mix64(*h ^ c.lanes[l] as u64);
            }
        }
        out.extend_from_slice(&h[..group.len()]);
    }
    out
}

/// [`finish_all`] 16 states at a time, 8 per AVX-512 register (two chains side by side), each
/// register lane one state's fold: `mix64` with the 64-bit multiply of AVX-512DQ. Each step's two
/// lanes of the 8 states come in one gather of their u64 (lane `2p` the low half, `2p + 1` the
/// high: little-endian), off the chain's critical path. A short group repeats its last state
/// (those values are dropped).
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512DQ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn finish_all_avx512(states: &[Checksum]) -> Vec<u64> {
    use std::arch::x86_64::*;
    const W: usize = 16;
    // `mix64`, 8 lanes at a time.
    let mix = |z: __m512i| {
        let z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64::<30>(z)), _mm512_set1_epi64(MIX_1 as i64));
        let z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64::<27>(z)), _mm512_set1_epi64(MIX_2 as i64));
        _mm512_xor_si512(z, _mm512_srli_epi64::<31>(z))
    };
    let low = _mm512_set1_epi64(0xffff_ffff);
    let mut out = Vec::with_capacity(states.len());
    for group in states.chunks(W) {
        let pick = |i: usize| i.min(group.len() - 1);
        // Byte offsets of the states' lanes from the group's first, per register.
        let size = std::mem::size_of::<Checksum>() as i64;
        let offsets: [__m512i; 2] = std::array::from_fn(|r| {
            let o: [i64; 8] = std::array::from_fn(|i| pick(8 * r + i) as i64 * size);
            // SAFETY: an unaligned load of 8 i64 from a local array of 8.
            unsafe { _mm512_loadu_si512(o.as_ptr().cast()) }
        });
        let mut h: [__m512i; 2] = std::array::from_fn(|r| {
            let seed: [u64; 8] = std::array::from_fn(|i| FOLD_SEED ^ group[pick(8 * r + i)].len);
            // SAFETY: an unaligned load of 8 u64 from a local array of 8.
            unsafe { _mm512_loadu_si512(seed.as_ptr().cast()) }
        });
        // SAFETY: the `lanes` field of the group's first state: inside the slice.
        let base = unsafe { group.as_ptr().cast::<u8>().add(std::mem::offset_of!(Checksum, lanes)) };
        for p in 0..LANES / 2 {
            for (h, offsets) in h.iter_mut().zip(&offsets) {
                // SAFETY: every address is base + 8p + offset: lanes 2p and 2p + 1 (8 bytes inside
                // the `lanes` array, p < LANES / 2) of the state of `group` `offset` bytes past the
                // first in the slice (a multiple of the size of `Checksum`); unaligned 8-byte reads
                // are allowed.
                let pair = unsafe { _mm512_i64gather_epi64::<1>(*offsets, base.add(8 * p).cast()) };
                *h = mix(_mm512_xor_si512(*h, _mm512_and_si512(pair, low)));
                *h = mix(_mm512_xor_si512(*h, _mm512_srli_epi64::<32>(pair)));
            }
        }
        let mut done = [0u64; W];
        for (r, h) in h.iter().enumerate() {
            // SAFETY: an unaligned store of 8 u64 into 8 of the local array's 16.
            unsafe { _mm512_storeu_si512(done[8 * r..].as_mut_ptr().cast(), *h) };
        }
        out.extend_from_slice(&done[..group.len()]);
    }
    out
}

/// One value for consecutive pieces' checksums, in their order (a bucket's chunks, as its reducers
/// hash them): splitmix64's bijective finaliser chained over them.
pub fn combine(hashes: &[u64]) -> u64 {
    hashes.iter().fold(0x2545_f491_4f6c_dd1du64 ^ hashes.len() as u64, |h, &x| mix64(h ^ x))
}

/// The fold's initial value (xor the length).
const FOLD_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// Fold the lanes, in lane order, into one 64-bit value (splitmix64's bijective finaliser per step).
pub fn fold(lanes: &[u32; LANES], len: u64) -> u64 {
    let mut h = FOLD_SEED ^ len;
    for &l in lanes {
        h = mix64(h ^ l as u64);
    }
    h
}

/// splitmix64's finaliser's multipliers.
const MIX_1: u64 = 0xbf58_476d_1ce4_e5b9;
const MIX_2: u64 = 0x94d0_49bb_1331_11eb;

/// splitmix64's finaliser: a bijection of u64.
#[inline]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(MIX_1);
    z = (z ^ (z >> 27)).wrapping_mul(MIX_2);
    z ^ (z >> 31)
}

/// One step of the lanes over a group of at most `LANES` consecutive words that starts at lane 0
/// (`group[l]` goes to lane `l`, by [`lane_word`]), for passes that hash what they read
/// ([`Checksum::absorb_groups`]).
#[inline(always)]
pub fn lane_step(acc: &mut [u32; LANES], group: &[f32]) {
    for (a, &w) in acc.iter_mut().zip(group) {
        *a = lane_word(*a, w);
    }
}

/// One lane's FNV-1a step over one word: the lane hash's one definition.
#[inline(always)]
pub fn lane_word(lane: u32, word: f32) -> u32 {
    (lane ^ word.to_bits()).wrapping_mul(FNV_PRIME)
}

/// The lane loop over whole groups of `LANES` words, compiled for the best instruction set the CPU
/// has. Integer arithmetic: every variant gives the same bits.
mod lanes {
    use super::{lane_word, LANES};

    /// x: (k * LANES).
    #[inline(always)]
    fn body(lanes: &mut [u32; LANES], x: &[f32]) {
        let mut acc = *lanes;
        for c in x.chunks_exact(LANES) {
            let c: &[f32; LANES] = c.try_into().expect("a whole group");
            for l in 0..LANES {
                acc[l] = lane_word(acc[l], c[l]);
            }
        }
        *lanes = acc;
    }

    pub fn absorb(lanes: &mut [u32; LANES], x: &[f32]) {
        debug_assert_eq!(x.len() % LANES, 0);
        simd_dispatch!(body(lanes: &mut [u32; LANES], x: &[f32]))
    }
}
