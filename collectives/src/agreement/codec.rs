//! The summary as words: the integer-sum half and the maximum half of the one all-reduce that
//! combines every rank's contribution, their lengths, and the decoded `Summary`; and a bucket's
//! health as 4 words (shared with the table's rows). The words' order is the wire format: every
//! rank must encode alike.

use gradbus_kernels::Health;

use super::{ExactSum, Extremes, Shared, Stat, Summary, ValueNames};

impl Summary {
    /// Words of the integer-sum half of the all-reduce: `sum_len(buckets, values)` of them.
    pub fn sum_words(&self) -> Vec<u64> {
        let mut w = Vec::with_capacity(Summary::sum_len(self.buckets(), self.values.len()));
        w.extend(&self.nan);
        w.extend(&self.inf);
        w.push(self.damaged);
        for s in self.stats() {
            w.extend([s.nan, s.pos_inf, s.neg_inf]);
            w.extend(s.sum.words());
        }
        w
    }

    /// Words of the maximum half of the all-reduce: `max_len(buckets, values)` of them.
    pub fn max_words(&self) -> Vec<u64> {
        let mut w = Vec::with_capacity(Summary::max_len(self.buckets(), self.values.len()));
        for a in self.reduced.iter().flatten().chain(&self.reference).chain([&self.replica, &self.ops]) {
            w.extend([a.max, a.inv_min]);
        }
        for e in &self.extremes {
            w.extend([e.top, e.inv_low, e.peak]);
        }
        for s in self.stats() {
            w.extend([s.max, s.inv_min]);
        }
        w
    }

    /// Length of `sum_words` for `buckets` buckets and `values` values.
    pub fn sum_len(buckets: usize, values: usize) -> usize {
        2 * buckets + 1 + (1 + values) * (3 + ExactSum::WORDS)
    }

    /// Length of `max_words` for `buckets` buckets and `values` values.
    pub fn max_len(buckets: usize, values: usize) -> usize {
        13 * buckets + 4 + 2 * (1 + values)
    }

    /// The summary of all-reduced words (element-wise wrapping sums of `sum_words`, maxima of
    /// `max_words`) of `buckets` buckets and the values `names`.
    pub fn from_words(buckets: usize, names: &ValueNames, sum: &[u64], max: &[u64]) -> Summary {
        let lens = (Summary::sum_len(buckets, names.len()), Summary::max_len(buckets, names.len()));
        assert_eq!((sum.len(), max.len()), lens);
        let mut s = Summary::empty(buckets, names);
        s.nan.copy_from_slice(&sum[..buckets]);
        s.inf.copy_from_slice(&sum[buckets..2 * buckets]);
        s.damaged = sum[2 * buckets];
        let mut si = sum[2 * buckets + 1..].chunks_exact(3 + ExactSum::WORDS);
        let mut mi = max.chunks_exact(2);
        let mut shared = || {
            let w = mi.next().expect("max_len words");
            Shared { max: w[0], inv_min: w[1] }
        };
        for a in s.reduced.iter_mut().flatten().chain(&mut s.reference) {
            *a = shared();
        }
        s.replica = shared();
        s.ops = shared();
        let ext = &max[2 * (5 * buckets + 2)..2 * (5 * buckets + 2) + 3 * buckets];
        for (e, w) in s.extremes.iter_mut().zip(ext.chunks_exact(3)) {
            *e = Extremes { top: w[0], inv_low: w[1], peak: w[2] };
        }
        let mut mi = max[2 * (5 * buckets + 2) + 3 * buckets..].chunks_exact(2);
        let mut shared = || {
            let w = mi.next().expect("max_len words");
            Shared { max: w[0], inv_min: w[1] }
        };
        let stats: Vec<Stat> = (0..1 + names.len())
            .map(|_| {
                let w = si.next().expect("sum_len words");
                let m = shared();
                Stat {
                    nan: w[0],
                    pos_inf: w[1],
                    neg_inf: w[2],
                    sum: ExactSum::from_words(&w[3..]),
                    max: m.max,
                    inv_min: m.inv_min,
                }
            })
            .collect();
        s.loss = stats[0].clone();
        s.values = stats[1..].to_vec();
        s
    }

    fn stats(&self) -> impl Iterator<Item = &Stat> {
        std::iter::once(&self.loss).chain(&self.values)
    }
}

/// "No value" in a health word (no first bad index).
pub(crate) const NONE: u64 = u64::MAX;

/// Health as 4 words: nan, inf, sumsq bits, first bad (or `NONE`).
pub(crate) fn health_words(h: &Health) -> [u64; 4] {
    [h.nan, h.inf, h.sumsq.to_bits(), h.first_bad.unwrap_or(NONE)]
}

/// Health from its 4 words.
pub(crate) fn health_of(w: &[u64]) -> Health {
    Health { nan: w[0], inf: w[1], sumsq: f64::from_bits(w[2]), first_bad: (w[3] != NONE).then_some(w[3]) }
}
