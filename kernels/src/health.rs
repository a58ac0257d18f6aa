//! The fused health scan: one read of a gradient slice yields its NaN count, Inf count, sum of
//! squares and the index of its first non-finite element.
//!
//! Invariants: the sum of squares is taken over the FINITE elements only and accumulated in f64,
//! so a finite gradient of 1e21 (whose square overflows f32) still gives a finite, exact-enough norm,
//! and a non-finite element is reported by the counts rather than poisoning the norm. The scan works on
//! blocks of `BLOCK` elements with `LANES` independent accumulators so that it vectorizes (a single
//! scalar accumulator stays scalar in Rust, which has no fast-math); the order of additions is fixed,
//! so the same slice always gives the same bits.

/// Elements per block: small enough to stay in L1 while the reduce kernel re-reads it.
pub const BLOCK: usize = 1024;
/// Independent accumulators per block.
const LANES: usize = 16;

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

/// Health of one block (at most `BLOCK` elements), lanes folded in a fixed order.
#[inline]
pub fn scan_block(x: &[f32]) -> Health {
    debug_assert!(x.len() <= BLOCK);
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
    // Pairwise fold of the lanes: fixed order, fewer rounding steps than a chain.
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            ss[l] += ss[l + w];
        }
    }
    let first_bad = if bad > 0 {
        x.iter().position(|v| !v.is_finite()).map(|i| i as u64)
    } else {
        None
    };
    Health {
        nan,
        inf: bad - nan,
        sumsq: ss[0],
        first_bad,
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
