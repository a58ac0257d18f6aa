//! The agreement's order-free arithmetic: an exact sum of f64s (`ExactSum`), a value every
//! contributor must share (`Shared`) and one scalar over ranks (`Stat`). Every combination is an
//! integer sum or a maximum, so any reduction tree, in any order, gives the same bits (the
//! invariants are in the parent module's doc).

/// Limbs of `ExactSum`: 32-bit digits from 2^-1074 (the least subnormal) up. The largest finite
/// f64's top bit is bit 2097, so 66 limbs hold any one value; the 67th, and the 32 spare bits of
/// each i64 limb, hold the carries of up to 2^31 summed contributions.
pub const LIMBS: usize = 67;

/// An exact sum of finite f64s: a fixed-point superaccumulator over the whole f64 range, as
/// integer limbs (limb `i` weighs 2^(32 i - 1074)). Adding is integer addition, so any order of
/// additions gives the same bits; `round` rounds the exact value once to nearest-even. An exactly
/// zero sum is -0.0 when every term was -0.0 (or there was none), else +0.0, as Rust's ordered
/// `Iterator::sum` (which starts from -0.0) gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExactSum {
    limbs: [i64; LIMBS],
    /// Terms other than -0.0.
    signed: u64,
}

impl Default for ExactSum {
    fn default() -> ExactSum {
        ExactSum { limbs: [0; LIMBS], signed: 0 }
    }
}

impl ExactSum {
    /// Add a finite value exactly (non-finite values are the caller's business: see `Stat`).
    pub fn add(&mut self, x: f64) {
        assert!(x.is_finite(), "ExactSum::add({x}): only finite values have an exact sum");
        let bits = x.to_bits();
        if bits != (-0.0f64).to_bits() {
            self.signed += 1;
        }
        let (e, frac) = ((bits >> 52) & 0x7ff, bits & ((1 << 52) - 1));
        // x = m * 2^(p - 1074): subnormals have p = 0 and no hidden bit.
        let (m, p) = if e == 0 { (frac, 0) } else { (frac | 1 << 52, e as usize - 1) };
        let w = (m as u128) << (p % 32);
        for k in 0..3 {
            let digit = ((w >> (32 * k)) & 0xffff_ffff) as i64;
            if bits >> 63 == 1 {
                self.limbs[p / 32 + k] -= digit;
            } else {
                self.limbs[p / 32 + k] += digit;
            }
        }
        self.normalize();
    }

    /// Add another sum exactly.
    pub fn merge(&mut self, other: &ExactSum) {
        for (a, b) in self.limbs.iter_mut().zip(&other.limbs) {
            *a = a.wrapping_add(*b);
        }
        self.signed += other.signed;
        self.normalize();
    }

    /// Carry every limb's excess into the next: limbs 0..LIMBS-1 in [0, 2^32), the last one signed.
    /// The value, and so `round`, is unchanged; equal values then have equal limbs.
    fn normalize(&mut self) {
        let mut carry: i128 = 0;
        for l in &mut self.limbs[..LIMBS - 1] {
            let v = *l as i128 + carry;
            *l = (v & 0xffff_ffff) as i64;
            carry = v >> 32;
        }
        self.limbs[LIMBS - 1] = (self.limbs[LIMBS - 1] as i128 + carry) as i64;
    }

    /// The exact sum rounded once to the nearest f64 (ties to even); past f64::MAX, an infinity.
    /// An exactly cancelling sum is +0.0; an empty sum, or one of only -0.0 terms, is -0.0.
    pub fn round(&self) -> f64 {
        let mut d = self.clone();
        d.normalize();
        let negative = d.limbs[LIMBS - 1] < 0;
        if negative {
            for l in &mut d.limbs {
                *l = -*l;
            }
            d.normalize();
        }
        let sign = if negative { 1u64 << 63 } else { 0 };
        if d.limbs[LIMBS - 1] != 0 {
            return f64::from_bits(sign | f64::INFINITY.to_bits());
        }
        let Some(top) = (0..LIMBS - 1).rev().find(|&i| d.limbs[i] != 0) else {
            return if self.signed == 0 { -0.0 } else { 0.0 };
        };
        let h = 32 * top + 31 - (d.limbs[top] as u32).leading_zeros() as usize;
        if h <= 52 {
            // Below 2^53 units of 2^-1074: the subnormal (or least normal) encoding is the integer.
            return f64::from_bits(sign | d.bits(0, h + 1));
        }
        let mut lo = h - 52;
        let mut mant = d.bits(lo, 53);
        let half = d.bits(lo - 1, 1) == 1;
        let sticky = d.any_below(lo - 1);
        if half && (sticky || mant & 1 == 1) {
            mant += 1;
            if mant == 1 << 53 {
                mant >>= 1;
                lo += 1;
            }
        }
        let e = lo as u64 + 1;
        if e >= 0x7ff {
            return f64::from_bits(sign | f64::INFINITY.to_bits());
        }
        f64::from_bits(sign | e << 52 | (mant & ((1 << 52) - 1)))
    }

    /// `n <= 64` bits starting at bit `lo` of a normalized, non-negative sum.
    fn bits(&self, lo: usize, n: usize) -> u64 {
        let limb = |i: usize| self.limbs.get(i).map_or(0, |&l| l as u64 as u128);
        let i = lo / 32;
        let w = (limb(i) | limb(i + 1) << 32 | limb(i + 2) << 64) >> (lo % 32);
        (w & ((1u128 << n) - 1)) as u64
    }

    /// Whether any bit below bit `q` is set.
    fn any_below(&self, q: usize) -> bool {
        let i = q / 32;
        self.limbs[..i].iter().any(|&l| l != 0) || (self.limbs[i] & ((1i64 << (q % 32)) - 1)) != 0
    }

    /// The limbs as words for an integer-sum all-reduce (two's complement: a wrapping u64 sum is
    /// the i64 sum).
    pub(super) fn words(&self) -> impl Iterator<Item = u64> + '_ {
        self.limbs.iter().map(|&l| l as u64).chain([self.signed])
    }

    /// Words per sum in `words`.
    pub(super) const WORDS: usize = LIMBS + 1;

    pub(super) fn from_words(w: &[u64]) -> ExactSum {
        let mut s = ExactSum { limbs: std::array::from_fn(|i| w[i] as i64), signed: w[LIMBS] };
        s.normalize();
        s
    }
}

/// A value every contributor must share, combined by maxima: (max, max of the complement). Empty
/// (nobody contributed) is (0, 0); one or many equal contributions give `value()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shared {
    pub(super) max: u64,
    pub(super) inv_min: u64,
}

impl Shared {
    /// Contribute a value.
    pub fn add(&mut self, v: u64) {
        self.max = self.max.max(v);
        self.inv_min = self.inv_min.max(!v);
    }
    pub(super) fn merge(&mut self, o: &Shared) {
        self.max = self.max.max(o.max);
        self.inv_min = self.inv_min.max(o.inv_min);
    }
    /// True when nobody contributed.
    pub fn is_empty(&self) -> bool {
        self.max == 0 && self.inv_min == 0
    }
    /// The shared value; `None` when contributors differ or nobody contributed.
    pub fn value(&self) -> Option<u64> {
        (!self.is_empty() && self.max == !self.inv_min).then_some(self.max)
    }
    /// (smallest, largest) contribution; `None` when nobody contributed.
    pub fn range(&self) -> Option<(u64, u64)> {
        (!self.is_empty()).then_some((!self.inv_min, self.max))
    }
}

/// Order key of a non-NaN f64: `key(a) < key(b)` iff a < b (with -0 < +0); never 0.
pub(super) fn key(x: f64) -> u64 {
    let b = x.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | 1 << 63
    }
}

pub(super) fn unkey(k: u64) -> f64 {
    f64::from_bits(if k >> 63 == 1 { k & !(1 << 63) } else { !k })
}

/// One scalar over ranks (a loss, a workload value): exact sum, extremes, non-finite counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub(super) sum: ExactSum,
    pub(super) nan: u64,
    pub(super) pos_inf: u64,
    pub(super) neg_inf: u64,
    /// Max of the order keys of the non-NaN values (0: none).
    pub(super) max: u64,
    /// Max of the complemented order keys (0: none).
    pub(super) inv_min: u64,
}

impl Stat {
    /// Contribute one rank's value.
    pub fn add(&mut self, x: f64) {
        if x.is_nan() {
            self.nan += 1;
            return;
        }
        if x == f64::INFINITY {
            self.pos_inf += 1;
        } else if x == f64::NEG_INFINITY {
            self.neg_inf += 1;
        } else {
            self.sum.add(x);
        }
        self.max = self.max.max(key(x));
        self.inv_min = self.inv_min.max(!key(x));
    }
    pub(super) fn merge(&mut self, o: &Stat) {
        self.sum.merge(&o.sum);
        self.nan += o.nan;
        self.pos_inf += o.pos_inf;
        self.neg_inf += o.neg_inf;
        self.max = self.max.max(o.max);
        self.inv_min = self.inv_min.max(o.inv_min);
    }
    /// The sum over ranks: the exact sum of the finite values rounded once; NaN when some value
    /// is NaN or both infinities occur, else an infinity when one occurs (IEEE's rules).
    pub fn sum(&self) -> f64 {
        if self.nan > 0 || (self.pos_inf > 0 && self.neg_inf > 0) {
            f64::NAN
        } else if self.pos_inf > 0 {
            f64::INFINITY
        } else if self.neg_inf > 0 {
            f64::NEG_INFINITY
        } else {
            self.sum.round()
        }
    }
    /// The largest non-NaN value; -inf when there is none (as `fold(-inf, f64::max)`).
    pub fn max(&self) -> f64 {
        if self.max == 0 {
            f64::NEG_INFINITY
        } else {
            unkey(self.max)
        }
    }
    /// The smallest non-NaN value; +inf when there is none (as `fold(inf, f64::min)`).
    pub fn min(&self) -> f64 {
        if self.inv_min == 0 {
            f64::INFINITY
        } else {
            unkey(!self.inv_min)
        }
    }
    /// True when every contributed value was finite.
    pub fn all_finite(&self) -> bool {
        self.nan == 0 && self.pos_inf == 0 && self.neg_inf == 0
    }
}
