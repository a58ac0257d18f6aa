//! The agreement's summary: what every rank must know about one update to reach the verdict when
//! everything is healthy, in O(buckets) words whatever the world size, and the exact, order-free
//! arithmetic that lets any reduction tree combine it.
//!
//! Each rank (or node) makes a contribution (`Summary`), the contributions are combined by one
//! all-reduce (`to_words`: integer sums for one half of the words, maxima for the other), and every
//! rank decodes the same `Summary`. Only when it shows something wrong (`Summary::anomaly`: a
//! non-finite count or value, replicas or reducers that disagree, ranks that ran other collectives)
//! do the transports gather the full per-rank table, which names the rank, bucket, parameter and
//! element. The table path builds its `Summary` by merging the same per-rank contributions, so both
//! paths hold bitwise the same summary.
//!
//! Invariants:
//! - `merge` is commutative and associative, bit for bit: every field is an integer sum (counts and
//!   the limbs of `ExactSum`, exact while fewer than 2^31 contributions are summed) or a maximum.
//!   So the result cannot depend on the order an MPI library (or NCCL, or a tree) combines ranks in.
//! - A float sum over ranks (`Stat::sum`) is the exact sum of the finite terms rounded once to
//!   nearest-even, with IEEE's rules for non-finite terms (NaN if a NaN or both infinities, else the
//!   infinity). It equals the rank-ordered f64 sum whenever that sum is exact, e.g. for f32-derived
//!   terms whose exponents span fewer than 29 - log2(world) binades.
//! - A value that all contributors must share (the replica checksum, the reduced buckets' health,
//!   the collective-sequence hash) travels as (max, max of the complement): they agree iff
//!   max == min. Merging the same value twice changes nothing, so every reducer may contribute it.
//!
//! Pure functions, no transport: the PyTorch guard reuses this shape.
//!
//! The parts, one concern each: `exact` (the order-free arithmetic: `ExactSum`, `Shared`, `Stat`)
//! and `codec` (the summary as the words of its all-reduce). This module holds what a rank
//! contributes (`LocalScalars`, its values named by `ValueNames`) and what every rank decodes
//! (`Summary`). The choice between the summary and the table, and the cost model that makes it,
//! are `crate::choice` (above the row codec, whose rows it costs).

mod codec;
mod exact;

use std::sync::Arc;

use gradbus_kernels::Health;

use crate::layout::Fnv;

#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) use codec::NONE;
pub(crate) use codec::{health_of, health_words};
use exact::{key, unkey};
pub use exact::{ExactSum, Shared, Stat, LIMBS};

/// The names of the workload's values (a reward, a KL...) that every rank reports in the
/// agreement, in the order its words carry them: any number of them, none included (the PyTorch
/// guard reports none). A transport is opened with them: the shared-memory bus sizes its report
/// cells by their count, ranks check at open that they hold the same names (`hash`), and the
/// agreed summary answers by name (`Summary::value`). Cheap to clone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ValueNames(Arc<[String]>);

impl ValueNames {
    /// Names in wire order.
    ///
    /// # Panics
    /// When a name occurs twice (a program bug: a value could not be found by its name).
    pub fn new<S: AsRef<str>>(names: &[S]) -> ValueNames {
        let names: Vec<String> = names.iter().map(|s| s.as_ref().to_string()).collect();
        for (i, n) in names.iter().enumerate() {
            assert!(!names[..i].contains(n), "value name {n:?} given twice in {names:?}");
        }
        ValueNames(names.into())
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The names in wire order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// Wire position of a name.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.0.iter().position(|n| n == name)
    }

    /// A hash of the names in order (FNV-1a), for the identity check at open.
    pub fn hash(&self) -> u64 {
        let mut h = Fnv::default();
        for n in self.iter() {
            h.write(&(n.len() as u64).to_le_bytes());
            h.write(n.as_bytes());
        }
        h.0
    }
}

/// Scalars that each rank contributes to the agreement (exchanged with the health table, no extra
/// round trip). `loss` decides `loss_finite`; `values` are the workload's own, one per name of the
/// transport's `ValueNames` and in their order, which the agreement sums exactly and takes the
/// extremes of (`Summary`); `replica` is a checksum of the state every rank must hold alike (the
/// parameters, as read back from memory), which must agree across ranks; `state` is what the rank
/// found wrong with its own state (`StateFault`, 0: nothing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LocalScalars {
    /// This rank's loss for the update.
    pub loss: f64,
    /// The workload's values, in the order of the transport's `ValueNames`.
    pub values: Vec<f64>,
    /// Checksum of this rank's replica of the shared state; ranks that differ are repaired or stop.
    pub replica: u64,
    /// This rank's own finding about its state since the last update (`StateFault::word`; 0:
    /// nothing wrong).
    pub state: u64,
}

impl LocalScalars {
    /// Words of a report of `values` values on the wire or in a segment.
    pub fn words(values: usize) -> usize {
        3 + values
    }

    /// The report as words: loss bits, value bits, replica, state.
    pub fn to_words(&self) -> Vec<u64> {
        let values = self.values.iter().map(|v| v.to_bits());
        std::iter::once(self.loss.to_bits()).chain(values).chain([self.replica, self.state]).collect()
    }

    /// The report of `to_words`' words (all of `w`: its length gives the number of values).
    pub fn from_words(w: &[u64]) -> LocalScalars {
        assert!(w.len() >= 3, "a report is at least 3 words, got {}", w.len());
        let n = w.len();
        LocalScalars {
            loss: f64::from_bits(w[0]),
            values: w[1..n - 2].iter().map(|&b| f64::from_bits(b)).collect(),
            replica: w[n - 2],
            state: w[n - 1],
        }
    }
}

/// What a rank found wrong with its own state at the start of an update, by comparing what it
/// computed with what it holds - no other rank needed, so even 2 ranks know which copy is bad.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateFault {
    /// Its weights, read back, no longer hash to what its optimizer step wrote: memory changed
    /// them since.
    pub weights: bool,
    /// The reduced gradient its optimizer step consumed was not the one the reducers wrote: this
    /// first bucket (reduce order) differed from the agreed reference.
    pub consumed: Option<usize>,
}

impl StateFault {
    /// As one word: bit 0 the weights, bit 1 the consumed gradient, its bucket from bit 8.
    pub fn word(self) -> u64 {
        let c = self.consumed.map_or(0, |b| 2 | (b as u64) << 8);
        self.weights as u64 | c
    }

    /// The fault of a report's word.
    pub fn of_word(w: u64) -> StateFault {
        StateFault { weights: w & 1 == 1, consumed: (w & 2 == 2).then_some((w >> 8) as usize) }
    }

    /// True when something is wrong.
    pub fn any(self) -> bool {
        self.weights || self.consumed.is_some()
    }
}

/// One rank's local gradients in one bucket, as the outlier rule sees them: the sum of squares
/// and, where the transport tallies it, the peak (the largest |value| of the bucket's block with
/// the largest sum of squares, and its offset in the bucket).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BucketStat {
    /// Sum of squares of the finite elements.
    pub sumsq: f64,
    /// The peak |value| and its offset in the bucket; `None` where the transport does not tally it.
    pub peak: Option<(f32, u64)>,
}

/// Per bucket, the extremes over ranks of their `BucketStat`s, combined by maxima (see `Summary`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extremes {
    /// Max over ranks of `key(sumsq)` with the low 16 bits replaced by the rank (0: none).
    top: u64,
    /// Max over ranks of `!key(sumsq)` (0: none).
    inv_low: u64,
    /// Max over ranks of `peak bits << 32 | offset` (0: none or no peak tallied).
    peak: u64,
}

/// Ranks above this are folded into the low bits of `Extremes::top` modulo it (the sum of squares
/// keeps 36 of its 52 mantissa bits there: a relative precision of 2^-36).
const RANK_BITS: u32 = 16;

/// A peak as one word, ordered by |value| first: `|value| bits << 32 | offset` (offsets modulo
/// 2^32; 0: no peak).
pub fn peak_word(peak: Option<(f32, u64)>) -> u64 {
    peak.map_or(0, |(v, at)| (v.abs().to_bits() as u64) << 32 | (at & 0xffff_ffff))
}

/// The peak of a `peak_word`.
pub fn peak_of_word(w: u64) -> Option<(f32, u64)> {
    (w != 0).then(|| (f32::from_bits((w >> 32) as u32), w & 0xffff_ffff))
}

impl Extremes {
    /// Contribute rank `rank`'s statistic.
    pub fn add(&mut self, rank: usize, s: &BucketStat) {
        let k = key(s.sumsq);
        self.top = self.top.max((k & !((1 << RANK_BITS) - 1)) | (rank as u64 & ((1 << RANK_BITS) - 1)));
        self.inv_low = self.inv_low.max(!k);
        self.peak = self.peak.max(peak_word(s.peak));
    }
    fn merge(&mut self, o: &Extremes) {
        self.top = self.top.max(o.top);
        self.inv_low = self.inv_low.max(o.inv_low);
        self.peak = self.peak.max(o.peak);
    }
    /// The largest sum of squares over ranks and the rank that holds it (its sum of squares to
    /// 2^-36; the highest rank on a tie); `None` when nobody contributed.
    pub fn top(&self) -> Option<(f64, usize)> {
        (self.top != 0)
            .then(|| (unkey(self.top & !((1 << RANK_BITS) - 1)), (self.top & ((1 << RANK_BITS) - 1)) as usize))
    }
    /// The smallest sum of squares over ranks; `None` when nobody contributed.
    pub fn low(&self) -> Option<f64> {
        (self.inv_low != 0).then(|| unkey(!self.inv_low))
    }
    /// The largest peak over ranks and its offset in the bucket; `None` when none was tallied.
    pub fn peak(&self) -> Option<(f32, u64)> {
        peak_of_word(self.peak)
    }
}

/// Why a summary cannot decide alone: the transports then gather the full table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anomaly {
    /// Ranks folded different collective sequences into their hash.
    Collectives,
    /// Reducers report different health for a reduced bucket (their sums differ), or none did.
    Reducers,
    /// Some local gradient, reduced bucket, loss or reported value is not finite.
    NonFinite,
    /// The replicas' checksums differ.
    Replicas,
    /// Some rank found its own state damaged (`StateFault`).
    State,
}

/// The agreed summary of one update (see the module doc): per bucket the NaN and Inf totals of the
/// ranks' local gradients and the reduced bucket's health; the loss and each workload value (by
/// name) as a `Stat`; the replica checksum and the collective-sequence hash as `Shared` values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Per bucket: NaN elements over every rank's local gradients.
    pub nan: Vec<u64>,
    /// Per bucket: Inf elements over every rank's local gradients.
    pub inf: Vec<u64>,
    /// Per bucket: the reduced bucket's health words (every reducer contributes its own).
    reduced: Vec<[Shared; 4]>,
    /// The loss over ranks.
    pub loss: Stat,
    /// The workload values' names.
    names: ValueNames,
    /// Each workload value over ranks, in the order of `names`.
    values: Vec<Stat>,
    /// The replicas' parameter checksum.
    pub replica: Shared,
    /// The hash of the collectives each rank ran since the last agreement (transports that check it).
    pub ops: Shared,
    /// Ranks that found their own state damaged (`LocalScalars::state` not 0).
    pub damaged: u64,
    /// Per bucket: the checksum of the reduced gradient as its reducers wrote it (every reducer
    /// contributes its own; the reference a rank's consumed copy is checked against).
    reference: Vec<Shared>,
    /// Per bucket: the extremes over ranks of their local gradients' statistics.
    pub extremes: Vec<Extremes>,
}

impl Summary {
    /// The neutral summary of `buckets` buckets and the values `names`: merging it changes nothing.
    pub fn empty(buckets: usize, names: &ValueNames) -> Summary {
        Summary {
            nan: vec![0; buckets],
            inf: vec![0; buckets],
            reduced: vec![[Shared::default(); 4]; buckets],
            loss: Stat::default(),
            names: names.clone(),
            values: vec![Stat::default(); names.len()],
            replica: Shared::default(),
            ops: Shared::default(),
            damaged: 0,
            reference: vec![Shared::default(); buckets],
            extremes: vec![Extremes::default(); buckets],
        }
    }

    /// One rank's contribution: its local health per bucket (rank `rank`'s), the reduced buckets'
    /// health and checksums when it reduced them, its report (of the values `names`).
    pub fn of_rank(
        names: &ValueNames,
        rank: usize,
        local: &[Health],
        reduced: Option<(&[Health], &[u64])>,
        report: &LocalScalars,
    ) -> Summary {
        let mut s = Summary::empty(local.len(), names);
        for (b, h) in local.iter().enumerate() {
            s.add_local(b, h.nan, h.inf);
            s.extremes[b].add(rank, &BucketStat { sumsq: h.sumsq, peak: None });
        }
        if let Some((r, hashes)) = reduced {
            s.set_reduced(r);
            s.set_reference(hashes);
        }
        s.add_report(report);
        s
    }

    /// Number of buckets.
    pub fn buckets(&self) -> usize {
        self.nan.len()
    }

    /// The workload values' names.
    pub fn names(&self) -> &ValueNames {
        &self.names
    }

    /// The workload value `name` over ranks.
    ///
    /// # Panics
    /// When `name` is not one of the values the transport was opened with (a program bug).
    pub fn value(&self, name: &str) -> &Stat {
        match self.names.position(name) {
            Some(i) => &self.values[i],
            None => panic!("{name:?} is not a value of this agreement (its values: {:?})", self.names),
        }
    }

    /// Every workload value over ranks, with its name, in wire order.
    pub fn values(&self) -> impl Iterator<Item = (&str, &Stat)> {
        self.names.iter().zip(&self.values)
    }

    /// Count non-finite local elements of one bucket.
    pub fn add_local(&mut self, bucket: usize, nan: u64, inf: u64) {
        self.nan[bucket] += nan;
        self.inf[bucket] += inf;
    }

    /// Contribute the reduced buckets' health (as a reducer).
    pub fn set_reduced(&mut self, reduced: &[Health]) {
        assert_eq!(reduced.len(), self.buckets());
        for (a, h) in self.reduced.iter_mut().zip(reduced) {
            for (a, w) in a.iter_mut().zip(health_words(h)) {
                a.add(w);
            }
        }
    }

    /// Forget the reduced buckets' health and hashes (a node summary whose reduce was not the
    /// global one).
    pub fn clear_reduced(&mut self) {
        self.reduced.fill([Shared::default(); 4]);
        self.reference.fill(Shared::default());
    }

    /// Contribute the reduced buckets' checksums (as a reducer).
    pub fn set_reference(&mut self, hashes: &[u64]) {
        assert_eq!(hashes.len(), self.buckets());
        for (a, &h) in self.reference.iter_mut().zip(hashes) {
            a.add(h);
        }
    }

    /// The reduced buckets' checksums as the reducers wrote them; `None` when reducers
    /// disagree or none contributed.
    pub fn reference(&self) -> Option<Vec<u64>> {
        self.reference.iter().map(Shared::value).collect()
    }

    /// Contribute one rank's report.
    ///
    /// # Panics
    /// When it holds another number of values than the summary's names (a program bug).
    pub fn add_report(&mut self, r: &LocalScalars) {
        assert_eq!(
            r.values.len(),
            self.values.len(),
            "a report of {} values to an agreement of the values {:?}",
            r.values.len(),
            self.names
        );
        self.loss.add(r.loss);
        for (s, &v) in self.values.iter_mut().zip(&r.values) {
            s.add(v);
        }
        self.replica.add(r.replica);
        self.damaged += (r.state != 0) as u64;
    }

    /// Combine with another contribution (commutative and associative, bit for bit).
    pub fn merge(&mut self, o: &Summary) {
        assert_eq!((self.buckets(), &self.names), (o.buckets(), &o.names));
        for b in 0..self.buckets() {
            self.nan[b] += o.nan[b];
            self.inf[b] += o.inf[b];
            for (a, x) in self.reduced[b].iter_mut().zip(&o.reduced[b]) {
                a.merge(x);
            }
            self.reference[b].merge(&o.reference[b]);
            self.extremes[b].merge(&o.extremes[b]);
        }
        self.loss.merge(&o.loss);
        for (a, x) in self.values.iter_mut().zip(&o.values) {
            a.merge(x);
        }
        self.replica.merge(&o.replica);
        self.ops.merge(&o.ops);
        self.damaged += o.damaged;
    }

    /// The reduced buckets' health; `None` when reducers disagree or none contributed.
    pub fn reduced(&self) -> Option<Vec<Health>> {
        self.reduced
            .iter()
            .map(|a| Some(health_of(&[a[0].value()?, a[1].value()?, a[2].value()?, a[3].value()?])))
            .collect()
    }

    /// What keeps this summary from deciding alone, in the order checked; `None` when everything
    /// is finite and consistent (then every rank's verdict is `Proceed`-able from it).
    pub fn anomaly(&self) -> Option<Anomaly> {
        if !self.ops.is_empty() && self.ops.value().is_none() {
            return Some(Anomaly::Collectives);
        }
        let Some(reduced) = self.reduced() else { return Some(Anomaly::Reducers) };
        if self.reference().is_none() {
            return Some(Anomaly::Reducers);
        }
        let stats_finite = self.loss.all_finite() && self.values.iter().all(Stat::all_finite);
        if self.nan.iter().chain(&self.inf).any(|&c| c > 0) || !reduced.iter().all(Health::is_finite) || !stats_finite {
            return Some(Anomaly::NonFinite);
        }
        if self.damaged > 0 {
            return Some(Anomaly::State);
        }
        if self.replica.value().is_none() {
            return Some(Anomaly::Replicas);
        }
        None
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::layout::{Layout, ParamSpec};
    use gradbus_kernels::rng::Rng;

    /// Shewchuk's exact partials with a correctly rounded result (Python's `math.fsum`): an
    /// independent oracle for `ExactSum::round` (valid while no partial overflows).
    fn fsum(xs: &[f64]) -> f64 {
        let mut partials: Vec<f64> = Vec::new();
        for &x0 in xs {
            let mut x = x0;
            let mut i = 0;
            for j in 0..partials.len() {
                let mut y = partials[j];
                if x.abs() < y.abs() {
                    std::mem::swap(&mut x, &mut y);
                }
                let hi = x + y;
                let lo = y - (hi - x);
                if lo != 0.0 {
                    partials[i] = lo;
                    i += 1;
                }
                x = hi;
            }
            partials.truncate(i);
            partials.push(x);
        }
        let mut n = partials.len();
        if n == 0 {
            return 0.0;
        }
        n -= 1;
        let mut hi = partials[n];
        let mut lo = 0.0;
        while n > 0 {
            let x = hi;
            n -= 1;
            let y = partials[n];
            hi = x + y;
            lo = y - (hi - x);
            if lo != 0.0 {
                break;
            }
        }
        if n > 0 && ((lo < 0.0 && partials[n - 1] < 0.0) || (lo > 0.0 && partials[n - 1] > 0.0)) {
            let y = lo * 2.0;
            let x = hi + y;
            if y == x - hi {
                hi = x;
            }
        }
        hi
    }

    pub(crate) fn shuffle<T>(rng: &mut Rng, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, rng.below(i + 1));
        }
    }

    fn exact(xs: &[f64]) -> f64 {
        let mut s = ExactSum::default();
        xs.iter().for_each(|&x| s.add(x));
        s.round()
    }

    /// A random finite f64 with an exponent in `exp` (either sign, some subnormals and zeros).
    pub(crate) fn value(rng: &mut Rng, exp: std::ops::Range<i32>) -> f64 {
        let m = 1.0 + rng.uniform() as f64 + (rng.uniform() as f64) * 2f64.powi(-24);
        let e = exp.start + rng.below((exp.end - exp.start) as usize) as i32;
        let sign = if rng.uniform() < 0.5 { -1.0 } else { 1.0 };
        match rng.below(20) {
            0 => 0.0,
            1 => sign * f64::from_bits(1 + rng.below(1 << 20) as u64), // subnormal
            _ => sign * m * 2f64.powi(e),
        }
    }

    #[test]
    fn exact_sum_rounds_like_an_independent_correctly_rounded_sum() {
        let mut rng = Rng::new(&[18, 1]);
        for case in 0..3000 {
            let n = 1 + rng.below(40);
            let span = [4, 60, 400, 2000][case % 4];
            let lo = -1000 + rng.below(2000 - span) as i32;
            let xs: Vec<f64> = (0..n).map(|_| value(&mut rng, lo..lo + span as i32)).collect();
            assert_eq!(exact(&xs).to_bits(), fsum(&xs).to_bits(), "case {case}: {xs:?}");
        }
    }

    #[test]
    fn exact_sum_edge_cases() {
        let tiny = f64::from_bits(1);
        assert_eq!(exact(&[]).to_bits(), (-0f64).to_bits(), "as Iterator::sum");
        assert_eq!(exact(&[-0.0, -0.0]).to_bits(), (-0f64).to_bits());
        assert_eq!(exact(&[-0.0, 0.0]).to_bits(), 0f64.to_bits());
        assert_eq!(exact(&[-1.0, 1.0]).to_bits(), 0f64.to_bits());
        assert_eq!(exact(&[0.1, 0.2]), 0.30000000000000004);
        assert_eq!(exact(&[1e308, 1e308, -1e308]), 1e308, "no intermediate overflow");
        assert_eq!(exact(&[f64::MAX, f64::MAX]), f64::INFINITY);
        assert_eq!(exact(&[-f64::MAX, -f64::MAX]), f64::NEG_INFINITY);
        assert_eq!(exact(&[f64::MAX, -f64::MAX, tiny]), tiny);
        assert_eq!(exact(&[1.0, 2f64.powi(-53)]), 1.0, "a tie rounds to even (down)");
        assert_eq!(exact(&[1.0 + f64::EPSILON, 2f64.powi(-53)]), 1.0 + 2.0 * f64::EPSILON, "a tie rounds to even (up)");
        assert_eq!(exact(&[1.0, 2f64.powi(-53), tiny]), 1.0 + f64::EPSILON, "past the tie: up");
        assert_eq!(exact(&[1e16, 1.0, -1e16]), 1.0, "the rank-ordered f64 sum says 0");
        assert_eq!(exact(&[-0.5, 0.25]), -0.25);
        assert_eq!(exact(&[tiny, tiny, -tiny]), tiny);
        assert_eq!(exact(&[f64::MIN_POSITIVE, -tiny]).to_bits(), f64::MIN_POSITIVE.to_bits() - 1);
    }

    #[test]
    fn exact_sums_do_not_depend_on_order_or_grouping() {
        let mut rng = Rng::new(&[18, 2]);
        for _ in 0..200 {
            let xs: Vec<f64> = (0..64).map(|_| value(&mut rng, -300..300)).collect();
            let whole = exact(&xs);
            let mut shuffled = xs.clone();
            shuffle(&mut rng, &mut shuffled);
            // Grouped into random partial sums, merged in another order.
            let mut parts: Vec<ExactSum> = shuffled
                .chunks(1 + rng.below(9))
                .map(|c| {
                    let mut s = ExactSum::default();
                    c.iter().for_each(|&x| s.add(x));
                    s
                })
                .collect();
            shuffle(&mut rng, &mut parts);
            let mut total = ExactSum::default();
            parts.iter().for_each(|p| total.merge(p));
            assert_eq!(total.round().to_bits(), whole.to_bits());
            assert_eq!(total, {
                let mut s = ExactSum::default();
                xs.iter().for_each(|&x| s.add(x));
                s
            });
        }
    }

    /// Why the seed case's metrics do not move: f32 values summed in f64 in rank order are summed
    /// exactly while their exponents span few binades, and an exact sum rounds to itself.
    #[test]
    fn rank_ordered_sums_of_nearby_f32_values_are_exact_so_both_definitions_agree() {
        let mut rng = Rng::new(&[18, 3]);
        for _ in 0..2000 {
            let n = 1 + rng.below(16);
            let xs: Vec<f64> = (0..n).map(|_| value(&mut rng, -12..8) as f32 as f64).collect();
            let ordered: f64 = xs.iter().sum();
            assert_eq!(exact(&xs).to_bits(), ordered.to_bits(), "{xs:?}");
        }
    }

    #[test]
    fn stats_follow_ieee_for_non_finite_values_and_fold_for_extremes() {
        let stat = |xs: &[f64]| {
            let mut s = Stat::default();
            xs.iter().for_each(|&x| s.add(x));
            s
        };
        let fold_max = |xs: &[f64]| xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let fold_min = |xs: &[f64]| xs.iter().copied().fold(f64::INFINITY, f64::min);
        for xs in [
            vec![1.0, f64::NAN, 3.0],
            vec![f64::INFINITY, 1.0],
            vec![f64::NEG_INFINITY, 1.0],
            vec![f64::INFINITY, f64::NEG_INFINITY],
            vec![f64::NAN],
            vec![],
            vec![-2.5, 7.0, 1e-300],
        ] {
            let s = stat(&xs);
            let ordered: f64 = xs.iter().sum();
            assert_eq!(s.sum().is_nan(), ordered.is_nan(), "{xs:?}");
            if !ordered.is_nan() {
                assert_eq!(s.sum(), ordered, "{xs:?}");
            }
            assert_eq!(s.max().to_bits(), fold_max(&xs).to_bits(), "{xs:?}");
            assert_eq!(s.min().to_bits(), fold_min(&xs).to_bits(), "{xs:?}");
            assert_eq!(s.all_finite(), xs.iter().all(|x| x.is_finite()));
        }
    }

    /// The values of the random reports below.
    pub(crate) fn names() -> ValueNames {
        ValueNames::new(&["reward", "kl", "max_a", "max_b", "min_c"])
    }

    /// A random health table of `world` ranks over `layout`, some cells, reduced buckets or
    /// reports made non-finite or inconsistent with probability `p_bad` each.
    pub(crate) fn random_rows(
        rng: &mut Rng,
        layout: &Layout,
        world: usize,
        p_bad: f32,
    ) -> (Vec<Vec<Health>>, Vec<Health>, Vec<LocalScalars>) {
        let nb = layout.buckets.len();
        let bad = |rng: &mut Rng| rng.uniform() < p_bad;
        let health = |rng: &mut Rng, bucket: usize| {
            let mut h = Health { sumsq: value(rng, -40..40).abs(), ..Health::default() };
            if bad(rng) {
                h.nan = rng.below(3) as u64;
                h.inf = rng.below(3) as u64;
                if h.nan + h.inf > 0 {
                    h.first_bad = Some(rng.below(layout.buckets[bucket].range.len()) as u64);
                }
            }
            h
        };
        let rows: Vec<Vec<Health>> = (0..world).map(|_| (0..nb).map(|b| health(rng, b)).collect()).collect();
        let reduced: Vec<Health> = (0..nb).map(|b| health(rng, b)).collect();
        let replica = 0x1234_5678_9abc_def0;
        let reports = (0..world)
            .map(|_| {
                let mut r = LocalScalars {
                    loss: value(rng, -8..3) as f32 as f64,
                    values: (0..names().len()).map(|_| value(rng, -20..20)).collect(),
                    replica,
                    state: 0,
                };
                if bad(rng) {
                    r.loss = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][rng.below(3)];
                }
                if bad(rng) {
                    r.values[rng.below(names().len())] = f64::NAN;
                }
                if bad(rng) {
                    r.replica ^= 1 << rng.below(64);
                }
                if bad(rng) {
                    r.state = StateFault { weights: rng.below(2) == 0, consumed: Some(rng.below(nb)) }.word();
                }
                r
            })
            .collect();
        (rows, reduced, reports)
    }

    /// An all-reduce of the contributions in a random order: wrapping sums and maxima of words.
    pub(crate) fn allreduce(rng: &mut Rng, parts: &[Summary]) -> Summary {
        let nb = parts[0].buckets();
        let mut order: Vec<usize> = (0..parts.len()).collect();
        shuffle(rng, &mut order);
        let values = parts[0].names().len();
        let (mut s, mut m) = (vec![0u64; Summary::sum_len(nb, values)], vec![0u64; Summary::max_len(nb, values)]);
        for &k in &order {
            for (a, b) in s.iter_mut().zip(parts[k].sum_words()) {
                *a = a.wrapping_add(b);
            }
            for (a, b) in m.iter_mut().zip(parts[k].max_words()) {
                *a = (*a).max(b);
            }
        }
        Summary::from_words(nb, parts[0].names(), &s, &m)
    }

    #[test]
    fn a_node_summary_merged_with_other_nodes_is_the_merge_of_every_rank() {
        // The hierarchical transport: leaders contribute their node's summary, the others nothing.
        let layout = Layout::new(&[ParamSpec::new("a", 100), ParamSpec::new("b", 50)], 0);
        let mut rng = Rng::new(&[18, 5]);
        for _ in 0..100 {
            let world = 2 + rng.below(10);
            let (rows, reduced, reports) = random_rows(&mut rng, &layout, world, 0.1);
            let hashes = [3u64, 4];
            let red = Some((&reduced[..], &hashes[..]));
            let per_rank: Vec<Summary> =
                (0..world).map(|k| Summary::of_rank(&names(), k, &rows[k], red, &reports[k])).collect();
            let cut = 1 + rng.below(world - 1);
            let mut nodes = Vec::new();
            for range in [0..cut, cut..world] {
                let mut node = Summary::empty(2, &names());
                for k in range {
                    node.merge(&Summary::of_rank(&names(), k, &rows[k], None, &reports[k]));
                }
                node.set_reduced(&reduced);
                node.set_reference(&hashes);
                nodes.push(node);
            }
            nodes.push(Summary::empty(2, &names())); // a non-leader
            assert_eq!(allreduce(&mut rng, &nodes), allreduce(&mut rng, &per_rank));
        }
    }

    #[test]
    fn values_travel_by_name_in_any_number() {
        let h = [Health { sumsq: 1.0, ..Health::default() }];
        for n in [0, 1, 5, 13] {
            let names = ValueNames::new(&(0..n).map(|i| format!("v{i}")).collect::<Vec<_>>());
            let report = |k: usize| LocalScalars {
                loss: 0.5,
                values: (0..n).map(|i| (10 * i + k) as f64).collect(),
                replica: 3,
                state: k as u64,
            };
            assert_eq!(report(1).to_words().len(), LocalScalars::words(n));
            assert_eq!(LocalScalars::from_words(&report(1).to_words()), report(1));
            let red = Some((&h[..], &[5u64][..]));
            let parts: Vec<Summary> = (0..3).map(|k| Summary::of_rank(&names, k, &h, red, &report(k))).collect();
            let s = allreduce(&mut Rng::new(&[18, 6]), &parts);
            assert_eq!(s.values().count(), n);
            for i in 0..n {
                let v = s.value(&format!("v{i}"));
                assert_eq!((v.sum(), v.min(), v.max()), ((30 * i + 3) as f64, (10 * i) as f64, (10 * i + 2) as f64));
            }
        }
        assert_ne!(ValueNames::new(&["a", "b"]).hash(), ValueNames::new(&["b", "a"]).hash(), "order is part of it");
        assert_ne!(ValueNames::new(&["ab"]).hash(), ValueNames::new(&["a", "b"]).hash());
    }

    #[test]
    fn state_faults_and_extremes_round_trip_and_name_the_rank() {
        for f in [
            StateFault::default(),
            StateFault { weights: true, consumed: None },
            StateFault { weights: false, consumed: Some(0) },
            StateFault { weights: true, consumed: Some(1749) },
        ] {
            assert_eq!(StateFault::of_word(f.word()), f);
            assert_eq!(f.any(), f.word() != 0);
        }
        let mut e = Extremes::default();
        assert_eq!((e.top(), e.low(), e.peak()), (None, None, None));
        for (k, ss, peak) in [(0, 2.0, 0.5), (1, 1e30, 3e15), (2, 0.25, 0.1), (3, 1.0, 0.3)] {
            e.add(k, &BucketStat { sumsq: ss, peak: Some((-peak as f32, 40 + k as u64)) });
        }
        let (top, rank) = e.top().unwrap();
        assert_eq!(rank, 1);
        assert!((top / 1e30 - 1.0).abs() < 1e-10, "{top}");
        assert_eq!(e.low(), Some(0.25));
        assert_eq!(e.peak(), Some((3e15, 41)), "the largest |value| and its offset");
    }

    #[test]
    #[should_panic(expected = "\"kl\" is not a value of this agreement")]
    fn a_value_that_was_not_declared_is_a_program_bug() {
        Summary::empty(1, &ValueNames::new(&["reward"])).value("kl");
    }

    #[test]
    fn disagreeing_reducers_replicas_or_collectives_are_anomalies() {
        let h = [Health { sumsq: 2.0, ..Health::default() }];
        let (none, r) = (ValueNames::default(), LocalScalars { loss: 1.0, ..LocalScalars::default() });
        let hash = [8u64];
        let mut a = Summary::of_rank(&none, 0, &h, Some((&h, &hash)), &r);
        assert_eq!(a.anomaly(), None);
        let mut b = a.clone();
        b.merge(&Summary::of_rank(&none, 1, &h, Some((&[Health { sumsq: 2.5, ..Health::default() }], &hash)), &r));
        assert_eq!(b.anomaly(), Some(Anomaly::Reducers));
        let mut b = a.clone();
        b.merge(&Summary::of_rank(&none, 1, &h, Some((&h, &[9])), &r));
        assert_eq!(b.anomaly(), Some(Anomaly::Reducers), "reducers that wrote other bits");
        let mut c = a.clone();
        c.merge(&Summary::of_rank(&none, 1, &h, None, &LocalScalars { replica: 9, ..r.clone() }));
        assert_eq!(c.anomaly(), Some(Anomaly::Replicas));
        assert_eq!(c.replica.range(), Some((0, 9)));
        let mut d = a.clone();
        let weights = StateFault { weights: true, consumed: None };
        d.merge(&Summary::of_rank(&none, 1, &h, None, &LocalScalars { state: weights.word(), ..r.clone() }));
        assert_eq!((d.anomaly(), d.damaged), (Some(Anomaly::State), 1), "a rank that found its own state damaged");
        a.ops.add(1);
        a.ops.add(2);
        assert_eq!(a.anomaly(), Some(Anomaly::Collectives));
        assert_eq!(Summary::of_rank(&none, 0, &h, None, &r).anomaly(), Some(Anomaly::Reducers), "no reducer at all");
    }
}
