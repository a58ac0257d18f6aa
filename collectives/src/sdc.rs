//! Silent data corruption: what the agreed table says beyond NaN and Inf. Two pure decisions, fed
//! only agreed numbers, so that every rank reaches the same one with no extra round trip:
//!
//! - **Replicas** ([`check_state`]): every rank's weights, read back from memory during an update
//!   before its agreement (on the CPU hashed as its backward pass reads them), must hash alike (`LocalScalars::replica`), and every rank checks its own state
//!   against what it computed (`LocalScalars::state`: weights that no longer hash to what its
//!   optimizer wrote; a consumed gradient that was not the reducers' sum). The damaged ranks are
//!   those that found their own state damaged, and those whose weights differ from the majority of
//!   the others; the donor is the lowest rank of that majority. With no self-finding and no strict
//!   majority (2 ranks that differ, or a tie) nobody can tell the healthy copy: undecided.
//! - **Outliers** ([`OutlierDetector`]): per bucket, the largest local sum of squares over ranks
//!   (`Summary::extremes`, with the rank that holds it) against the median of the same number
//!   over the last `window` healthy updates (robust: a past outlier does not move a median) and
//!   against the smallest rank of the same update, and the largest element (the peak) against the
//!   norm of the rest of that rank's bucket. A bit flip scales ONE element by 2^16 or more (an
//!   exponent bit 27-30 going 1): it stands out on all three. Gradients that grow with the training
//!   grow many elements at once: the seed case's (`examples/roll-193.toml`) jump 14 binades in one
//!   update on one rank, but their largest element never exceeds 0.4x the norm of the rest
//!   (measured, docs/reliability.md), where a flipped element is 2^4 times it or more.
//!
//! Invariants: both are functions of the agreed table and of the detector's state, which is fed
//! only agreed numbers in update order (and saved whole in checkpoints): every rank decides alike.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::agreement::StateFault;
use crate::layout::Layout;
use crate::verdict::{empty_report, Action, Cause, Classification, HealthTable, History, Policy, StepId, Verdict};

/// What the replica check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateCheck {
    /// Every replica is the same and none found its own state damaged.
    Healthy,
    /// Copy the state of `donor` into `damaged` (ascending; never empty).
    Repair {
        /// Ranks whose state is damaged.
        damaged: Vec<usize>,
        /// A rank with healthy state (the lowest of the majority).
        donor: usize,
        /// Why each damaged rank is (in the order of `damaged`).
        why: Vec<String>,
    },
    /// The replicas differ and no rank can be told healthy: the job must stop.
    Undecided {
        /// Every rank, with its replica checksum.
        replicas: Vec<(usize, u64)>,
    },
}

/// The replica check of one agreed table (see the module doc).
pub fn check_state(table: &HealthTable) -> StateCheck {
    let s = &table.summary;
    if s.damaged == 0 && s.replica.value().is_some() {
        return StateCheck::Healthy;
    }
    if !table.is_detailed() {
        // The transports gather the table on either anomaly; a summary without it has none.
        return StateCheck::Healthy;
    }
    let fault = |k: usize| StateFault::of_word(table.reports[k].state);
    let replica = |k: usize| table.reports[k].replica;
    let candidates: Vec<usize> = (0..table.world).filter(|&k| !fault(k).any()).collect();
    // The replica value most candidates hold, if strictly more than any other value.
    let mut counts: Vec<(u64, usize)> = Vec::new();
    for &k in &candidates {
        match counts.iter_mut().find(|(v, _)| *v == replica(k)) {
            Some(c) => c.1 += 1,
            None => counts.push((replica(k), 1)),
        }
    }
    counts.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
    let majority = match counts.as_slice() {
        [(v, _)] => Some(*v),
        [(v, a), (_, b), ..] if a > b => Some(*v),
        _ => None,
    };
    // With 2 or more distinct values among the candidates, a majority only counts when the
    // candidates that hold it outnumber every rank that disagrees with it.
    let majority = majority.filter(|&v| {
        let agree = candidates.iter().filter(|&&k| replica(k) == v).count();
        counts.len() == 1 || agree > table.world - agree
    });
    let Some(good) = majority else {
        return StateCheck::Undecided { replicas: (0..table.world).map(|k| (k, replica(k))).collect() };
    };
    let donor = *candidates.iter().find(|&&k| replica(k) == good).expect("the majority has a rank");
    let mut damaged = Vec::new();
    let mut why = Vec::new();
    for k in 0..table.world {
        let f = fault(k);
        let mut reasons = Vec::new();
        if f.weights {
            reasons.push("its weights no longer hash to what its optimizer step wrote".to_string());
        }
        if let Some(b) = f.consumed {
            reasons
                .push(format!("its optimizer consumed a reduced gradient other than the reducers' sum (bucket #{b})"));
        }
        if replica(k) != good {
            reasons.push(format!("its weights hash to {:016x}, the majority's to {good:016x}", replica(k)));
        }
        if !reasons.is_empty() {
            damaged.push(k);
            why.push(reasons.join("; "));
        }
    }
    StateCheck::Repair { damaged, donor, why }
}

/// The outlier rule's settings (`[sdc]` in the worker's config).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutlierRule {
    /// Binades (log2 of the norm) the largest rank of a bucket must stand above the median of its
    /// history to be an outlier.
    pub binades: f64,
    /// Binades it must stand above the smallest rank of the same update (ignored at 1 rank).
    pub spread: f64,
    /// Binades (log2) the bucket's largest element must stand above the norm of the rest of that
    /// rank's bucket: one isolated value, as a flipped bit makes it.
    pub isolation: f64,
    /// Healthy updates whose levels make the history.
    pub window: usize,
    /// Updates of history needed before the rule judges (the first ones are not judged).
    pub warmup: usize,
}

impl Default for OutlierRule {
    fn default() -> OutlierRule {
        OutlierRule { binades: 6.0, spread: 6.0, isolation: 4.0, window: 32, warmup: 4 }
    }
}

/// One bucket's outlier, as the agreed table names it.
#[derive(Clone, Debug, PartialEq)]
pub struct Outlier {
    /// The rank with the largest sum of squares in the bucket.
    pub rank: usize,
    /// The bucket (reduce order).
    pub bucket: usize,
    /// log2 of that rank's norm in the bucket.
    pub level: f64,
    /// Binades above the median of the bucket's history.
    pub excess: f64,
    /// Binades above the smallest rank of the update.
    pub spread: f64,
    /// Binades the largest element stands above the norm of the rest of the bucket.
    pub isolation: f64,
    /// The parameter and element of the largest value in the bucket, and the value (where the
    /// transport tallies peaks).
    pub peak: Option<(String, usize, f32)>,
}

impl std::fmt::Display for Outlier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} bucket #{}: local gradient norm 2^{:.1}, {:.1} binades above the bucket's median of the last updates and {:.1} above the smallest rank, its largest value {:.1} binades above the norm of the rest",
            self.rank, self.bucket, self.level, self.excess, self.spread, self.isolation
        )?;
        match &self.peak {
            Some((p, e, v)) => write!(f, "; largest value {p}[{e}] = {v:e}"),
            None => Ok(()),
        }
    }
}

/// The outlier rule's numbers for one bucket of one update (see `OutlierDetector::inputs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleInputs {
    /// Binades above the median of the bucket's history.
    pub excess: f64,
    /// Binades above the smallest rank (+inf at 1 rank).
    pub spread: f64,
    /// Binades the largest value stands above the norm of the rest (NaN with no peak tallied).
    pub isolation: f64,
    /// The rank with the largest sum of squares.
    pub rank: usize,
    /// log2 of its norm.
    pub level: f64,
}

/// The outlier rule's state: per bucket, log2 of the largest rank's norm in the last `window`
/// healthy updates, oldest first; beside it, per bucket, the finite ones sorted by `total_cmp`
/// (kept in step by `observe`, rebuilt from the history when a checkpoint is read: not saved), so
/// that a judgement reads each bucket's median instead of selecting it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "SavedDetector", into = "SavedDetector")]
pub struct OutlierDetector {
    rule: OutlierRule,
    history: Vec<VecDeque<f64>>,
    sorted: Vec<Vec<f64>>,
}

/// What a checkpoint holds of an [`OutlierDetector`]: its rule and history (the sorted windows
/// are a function of the history), each level as [`levels`] writes it.
#[derive(Serialize, Deserialize)]
struct SavedDetector {
    rule: OutlierRule,
    #[serde(with = "levels")]
    history: Vec<VecDeque<f64>>,
}

/// The history's levels as a checkpoint writes them, so that every level reads back bit for bit: a
/// finite one as a number (as before), the others as strings: `"-inf"` (a bucket whose gradient is
/// all zero on every rank: log2 of 0), `"inf"`, and a NaN as `"nan:0x"` and its 16 hex digits.
/// A `null` reads as -inf: serde_json wrote every non-finite level as `null`, and -inf is the only
/// one the runtime (the only writer of checkpoints; the Python guard saves none) can observe -
/// `Judge::judge` observes only updates whose every local gradient is finite
/// (`HealthTable::all_finite`), whose sums of squares, of finite f32 values accumulated in f64, are
/// then finite and >= 0: their levels are finite, or -inf where the sum is 0.
mod levels {
    use std::collections::VecDeque;
    use std::fmt;

    use serde::de::{self, Deserializer, Visitor};
    use serde::{Deserialize, Serialize, Serializer};

    /// One level (see the module doc).
    struct Level(f64);

    impl Serialize for Level {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let x = self.0;
            match x {
                _ if x.is_finite() => s.serialize_f64(x),
                f64::NEG_INFINITY => s.serialize_str("-inf"),
                f64::INFINITY => s.serialize_str("inf"),
                _ => s.serialize_str(&format!("nan:{:#018x}", x.to_bits())),
            }
        }
    }

    impl<'de> Deserialize<'de> for Level {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Level, D::Error> {
            d.deserialize_any(LevelVisitor)
        }
    }

    struct LevelVisitor;

    impl Visitor<'_> for LevelVisitor {
        type Value = Level;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a level: a number, \"-inf\", \"inf\", \"nan:0x\" and 16 hex digits, or null (-inf)")
        }
        fn visit_f64<E: de::Error>(self, x: f64) -> Result<Level, E> {
            Ok(Level(x))
        }
        fn visit_u64<E: de::Error>(self, x: u64) -> Result<Level, E> {
            Ok(Level(x as f64))
        }
        fn visit_i64<E: de::Error>(self, x: i64) -> Result<Level, E> {
            Ok(Level(x as f64))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Level, E> {
            Ok(Level(f64::NEG_INFINITY))
        }
        fn visit_none<E: de::Error>(self) -> Result<Level, E> {
            self.visit_unit()
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Level, E> {
            let nan = v.strip_prefix("nan:0x").filter(|h| h.len() == 16).and_then(|h| u64::from_str_radix(h, 16).ok());
            match (v, nan.map(f64::from_bits)) {
                ("-inf", _) => Ok(Level(f64::NEG_INFINITY)),
                ("inf", _) => Ok(Level(f64::INFINITY)),
                (_, Some(x)) if x.is_nan() => Ok(Level(x)),
                _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
            }
        }
    }

    pub fn serialize<S: Serializer>(history: &[VecDeque<f64>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(history.iter().map(|h| h.iter().map(|&x| Level(x)).collect::<Vec<_>>()))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<VecDeque<f64>>, D::Error> {
        let h = Vec::<Vec<Level>>::deserialize(d)?;
        Ok(h.into_iter().map(|h| h.into_iter().map(|Level(x)| x).collect()).collect())
    }
}

impl From<SavedDetector> for OutlierDetector {
    fn from(s: SavedDetector) -> OutlierDetector {
        let sorted = s.history.iter().map(|h| sorted_finite(h.iter().copied())).collect();
        OutlierDetector { rule: s.rule, history: s.history, sorted }
    }
}

impl From<OutlierDetector> for SavedDetector {
    fn from(d: OutlierDetector) -> SavedDetector {
        SavedDetector { rule: d.rule, history: d.history }
    }
}

/// The finite values of `x`, sorted by `total_cmp`.
fn sorted_finite(x: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = x.filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// log2 of the norm of a sum of squares (-inf for 0).
fn level(sumsq: f64) -> f64 {
    0.5 * sumsq.log2()
}

/// log2 of how far a bucket's largest |value| `peak` stands above the norm of the rest of the
/// bucket whose sum of squares is `sumsq`. The rest, `sumsq - peak^2`, is taken no smaller than
/// `sumsq` x 2^-100: where the peak is all of the bucket (the subtraction then cancels), the
/// isolation is 50 binades, not infinite.
fn isolation(sumsq: f64, peak: f32) -> f64 {
    let p = peak as f64;
    (p / (sumsq - p * p).max(sumsq * 2f64.powi(-100)).sqrt()).log2()
}

/// The median of `x` (at least one value), sorted by `total_cmp`: its middle value, or the mean of
/// the middle two.
fn median(x: &[f64]) -> f64 {
    let n = x.len();
    if n % 2 == 1 {
        x[n / 2]
    } else {
        0.5 * (x[n / 2 - 1] + x[n / 2])
    }
}

impl OutlierDetector {
    /// An empty history for `buckets` buckets.
    pub fn new(rule: OutlierRule, buckets: usize) -> OutlierDetector {
        OutlierDetector { rule, history: vec![VecDeque::new(); buckets], sorted: vec![Vec::new(); buckets] }
    }

    /// The rule it applies.
    pub fn rule(&self) -> OutlierRule {
        self.rule
    }

    /// The rule's three numbers per bucket - binades above the history's median, above the smallest
    /// rank, of the largest value above the rest (`NaN` where the bucket is not judged: too little
    /// history, no sum of squares) - with the rank and its level: what `check` compares with the
    /// thresholds (and `GRADBUS_SDC_TRACE` prints).
    pub fn inputs(&self, table: &HealthTable) -> Vec<RuleInputs> {
        let none = RuleInputs { excess: f64::NAN, spread: f64::NAN, isolation: f64::NAN, rank: 0, level: f64::NAN };
        let mut out = vec![none; table.summary.extremes.len()];
        // Each bucket's finite history, sorted.
        for ((e, finite), o) in table.summary.extremes.iter().zip(&self.sorted).zip(&mut out) {
            let (Some((top, rank)), Some(low)) = (e.top(), e.low()) else { continue };
            if finite.len() < self.rule.warmup.max(1) || top <= 0.0 || !top.is_finite() {
                continue;
            }
            let x = level(top);
            // Without a tallied peak (the flat MPI transport, NCCL) the isolation is unknown
            // (NaN): the rule does not flag there, for a gradient the data makes large is told from
            // one flipped element only by it.
            let isolation = e.peak().map_or(f64::NAN, |(v, _)| isolation(top, v));
            let spread = if table.world == 1 { f64::INFINITY } else { x - level(low) };
            *o = RuleInputs { excess: x - median(finite), spread, isolation, rank, level: x };
        }
        out
    }

    /// The bucket with the largest excess among those whose largest rank breaks the rule, if any.
    /// Pure: the state changes only in [`OutlierDetector::observe`].
    pub fn check(&self, table: &HealthTable, layout: &Layout) -> Option<Outlier> {
        let r = &self.rule;
        let mut best: Option<Outlier> = None;
        for (b, i) in self.inputs(table).into_iter().enumerate() {
            let flagged = i.excess > r.binades && i.spread > r.spread && i.isolation > r.isolation;
            if flagged && best.as_ref().is_none_or(|o| i.excess > o.excess) {
                let peak = table.summary.extremes[b].peak().and_then(|(v, at)| {
                    let (slot, e) = layout.locate(layout.buckets[b].range.start + at as usize)?;
                    Some((slot.name.clone(), e, v))
                });
                let (rank, level, excess, spread, isolation) = (i.rank, i.level, i.excess, i.spread, i.isolation);
                best = Some(Outlier { rank, bucket: b, level, excess, spread, isolation, peak });
            }
        }
        best
    }

    /// Add a healthy update's levels to the history (call after every update that proceeds
    /// without an outlier, in update order).
    pub fn observe(&mut self, table: &HealthTable) {
        for ((h, sorted), e) in self.history.iter_mut().zip(&mut self.sorted).zip(&table.summary.extremes) {
            let Some((top, _)) = e.top() else { continue };
            if h.len() == self.rule.window.max(1) {
                let old = h.pop_front().expect("a full window");
                // Found by scans, not binary searches: the window is cold by the next update, and a
                // scan's loads do not wait on each other as a search's do.
                if old.is_finite() {
                    let bits = old.to_bits();
                    let at = sorted.iter().position(|x| x.to_bits() == bits).expect("a finite level is in the window");
                    sorted.remove(at);
                }
            }
            let new = level(top);
            h.push_back(new);
            if new.is_finite() {
                // Where it goes in the order: after every smaller value (`total_cmp`).
                let at = sorted.iter().filter(|x| x.total_cmp(&new).is_lt()).count();
                sorted.insert(at, new);
            }
        }
    }

    /// The buckets it keeps a history of.
    pub fn buckets(&self) -> usize {
        self.history.len()
    }

    /// Updates in the shortest bucket history (for tests and messages).
    pub fn seen(&self) -> usize {
        self.history.iter().map(VecDeque::len).min().unwrap_or(0)
    }
}

/// What the guard found in one update, the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    /// One line, for the log and the metrics line's `sdc`.
    pub text: String,
    /// For a repair: the rank to copy the state from, and the damaged ranks.
    pub repair: Option<(usize, Vec<usize>)>,
}

/// Which checks run: the replica check and the outlier rule (over `buckets` buckets), each off by
/// default (a judge without them judges NaN/Inf as before).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Checks {
    /// The replica check (`check_state`).
    pub replicas: bool,
    /// The outlier rule and the bucket count, or off.
    pub outliers: Option<(OutlierRule, usize)>,
}

/// The guard's state in the judge: the outlier rule's history, the outlier of the first
/// execution of an update being rerun, and the findings so far.
#[derive(Clone, Debug, PartialEq)]
pub struct Guard {
    /// The replica check is on.
    pub replicas: bool,
    /// The outlier rule's history (off: `None`).
    pub outliers: Option<OutlierDetector>,
    /// The outlier of the first execution of the update now being rerun.
    outlier_first: Option<Outlier>,
    /// Findings so far (repairs, outliers).
    pub detections: u64,
}

impl Guard {
    /// The guard with `checks`.
    pub fn new(checks: Checks) -> Guard {
        let outliers = checks.outliers.map(|(rule, buckets)| OutlierDetector::new(rule, buckets));
        Guard { replicas: checks.replicas, outliers, outlier_first: None, detections: 0 }
    }

    /// The replica check: a repair, or an abort when no healthy replica can be told.
    pub(crate) fn replicas(&mut self, table: &HealthTable, at: StepId) -> Option<(Verdict, Finding)> {
        if !self.replicas {
            return None;
        }
        let found = match check_state(table) {
            StateCheck::Healthy => return None,
            StateCheck::Repair { damaged, donor, why } => {
                let what: Vec<String> = damaged.iter().zip(&why).map(|(k, w)| format!("rank {k}: {w}")).collect();
                let text = format!(
                    "replica damaged at step {} update {} (attempt {}): {}; repaired from rank {donor}, update recomputed",
                    at.step,
                    at.minibatch,
                    at.attempt,
                    what.join("; ")
                );
                let v = Verdict { action: Action::Repair, report: None };
                (v, Finding { text, repair: Some((donor, damaged)) })
            }
            StateCheck::Undecided { replicas } => {
                let ranks: Vec<usize> = replicas.iter().map(|&(k, _)| k).collect();
                let hashes: Vec<String> = replicas.iter().map(|(k, h)| format!("rank {k}: {h:016x}")).collect();
                let text = format!(
                    "replicas differ at step {} update {} (attempt {}) and none can be told healthy ({}): no majority, and no rank found its own state changed",
                    at.step,
                    at.minibatch,
                    at.attempt,
                    hashes.join(", ")
                );
                let mut r = empty_report(at, Action::Abort);
                (r.cause, r.ranks, r.param) = (Cause::Replicas, ranks, "(the weights)".into());
                (Verdict { action: Action::Abort, report: Some(r) }, Finding { text, repair: None })
            }
        };
        self.detections += 1;
        Some(found)
    }

    /// The outlier rule on a finite, proceeding update: a first outlier asks for a rerun; on the
    /// rerun, an outlier again is deterministic (`policy`: skip within its budget, else abort),
    /// none is transient (proceed with the recomputed gradients; the rank is suspect).
    pub(crate) fn outlier(
        &mut self,
        table: &HealthTable,
        layout: &Layout,
        policy: &Policy,
        history: &mut History,
        at: StepId,
    ) -> Option<(Verdict, Finding)> {
        let found = self.outliers.as_ref()?.check(table, layout);
        let (action, class, o) = match (found, self.outlier_first.take()) {
            (None, None) => return None,
            (Some(o), None) => {
                let text = format!("outlier at step {} update {}: {o}; rerun", at.step, at.minibatch);
                self.outlier_first = Some(o);
                self.detections += 1;
                return Some((Verdict { action: Action::Rerun, report: None }, Finding { text, repair: None }));
            }
            (None, Some(o)) => {
                if !history.suspects.contains(&o.rank) {
                    history.suspects.push(o.rank);
                }
                (Action::Proceed, Classification::Transient, o)
            }
            (Some(o), Some(_)) => {
                // The skip budget as `decide` keeps it for non-finite updates.
                let action = if history.would_skip(policy) { Action::Skip } else { Action::Abort };
                (action, Classification::Deterministic, o)
            }
        };
        let mut r = empty_report(at, action);
        (r.cause, r.ranks, r.bucket, r.classification) = (Cause::Outlier, vec![o.rank], o.bucket, Some(class));
        if let Some((p, e, _)) = &o.peak {
            (r.param, r.element) = (p.clone(), *e);
        }
        let done = match action {
            Action::Proceed => "the rerun's gradients are used",
            Action::Skip => "skipped",
            _ => "aborted",
        };
        let text = format!("outlier at step {} update {} ({class}: {done}): {o}", at.step, at.minibatch);
        Some((Verdict { action, report: Some(r) }, Finding { text, repair: None }))
    }

    /// A healthy update's levels into the outlier rule's history.
    pub(crate) fn observe(&mut self, table: &HealthTable) {
        if let Some(d) = &mut self.outliers {
            d.observe(table);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agreement::{LocalScalars, ValueNames};
    use crate::layout::ParamSpec;
    use crate::verdict::Reduced;
    use gradbus_kernels::rng::Rng;
    use gradbus_kernels::Health;

    /// A detailed table of `world` ranks over 2 buckets: rank k's sums of squares `ss[k]`, its
    /// replica and state words; each rank's peak 0.1 x its norm (not isolated) at offset 3.
    fn table(ss: &[[f64; 2]], replicas: &[u64], states: &[u64]) -> HealthTable {
        let peaks: Vec<[f32; 2]> = ss.iter().map(|r| r.map(|x| 0.1 * x.sqrt() as f32)).collect();
        table_with(ss, &peaks, replicas, states)
    }

    /// `table` with rank k's peaks `peaks[k]`.
    fn table_with(ss: &[[f64; 2]], peaks: &[[f32; 2]], replicas: &[u64], states: &[u64]) -> HealthTable {
        let world = ss.len();
        let local = (0..2).flat_map(|b| ss.iter().map(move |r| Health { sumsq: r[b], ..Health::default() })).collect();
        let peaks = (0..2).flat_map(|b| peaks.iter().map(move |p| Some((p[b], 3)))).collect();
        let reports = (0..world)
            .map(|k| LocalScalars { loss: 1.0, replica: replicas[k], state: states[k], ..LocalScalars::default() })
            .collect();
        let reduced = Reduced { health: vec![Health::default(); 2], reference: vec![1, 2] };
        HealthTable::detailed(world, &ValueNames::default(), local, peaks, reduced, reports, None)
    }

    fn layout() -> Layout {
        Layout::new(&[ParamSpec::new("w", 64), ParamSpec::new("head", 32)], 0)
    }

    /// The sorted windows `observe` keeps give every judgement the numbers the history gives when
    /// its finite values are sorted afresh (the median: the middle value, or the mean of the middle
    /// two), bit for bit, through evictions, ties, zeros (level -inf) and values far apart, and a
    /// checkpoint's round trip rebuilds them from the history alone (the saved form has no more).
    #[test]
    fn the_sorted_windows_give_the_medians_of_the_history() {
        let l = layout();
        let mut rng = Rng::new(&[29]);
        for (window, warmup, zeros) in [(1, 1, true), (2, 1, true), (5, 2, true), (32, 4, true), (32, 4, false)] {
            let rule = OutlierRule { window, warmup, ..OutlierRule::default() };
            let mut d = OutlierDetector::new(rule, 2);
            let mut hist: Vec<VecDeque<f64>> = vec![VecDeque::new(); 2];
            let mut infinite = 0;
            for t in 0..400usize {
                let pool = [0.0, 1.0, 4.0, 1e300, 1e-300, 2.5];
                let mut draw =
                    || if rng.below(3) == 0 { pool[rng.below(pool.len())] } else { rng.uniform() as f64 * 1e3 };
                let mut ss: Vec<[f64; 2]> = (0..3).map(|_| [draw(), draw()]).collect();
                if zeros && rng.below(6) == 0 {
                    let b = rng.below(2);
                    ss.iter_mut().for_each(|r| r[b] = 0.0);
                }
                let t_ = table(&ss, &[1; 3], &[0; 3]);
                let got = d.inputs(&t_);
                for (b, (h, g)) in hist.iter().zip(&got).enumerate() {
                    let mut finite: Vec<f64> = h.iter().copied().filter(|x| x.is_finite()).collect();
                    finite.sort_by(f64::total_cmp);
                    let top = t_.summary.extremes[b].top().unwrap().0;
                    let n = finite.len();
                    if n < warmup || top <= 0.0 {
                        assert!(g.excess.is_nan(), "window {window} update {t} bucket {b}: {g:?}");
                        continue;
                    }
                    let m = if n % 2 == 1 { finite[n / 2] } else { 0.5 * (finite[n / 2 - 1] + finite[n / 2]) };
                    assert_eq!(g.excess.to_bits(), (level(top) - m).to_bits(), "window {window} update {t} bucket {b}");
                }
                assert_eq!(d.check(&t_, &l), OutlierDetector::from(SavedDetector::from(d.clone())).check(&t_, &l));
                d.observe(&t_);
                for (b, h) in hist.iter_mut().enumerate() {
                    if h.len() == window {
                        h.pop_front();
                    }
                    h.push_back(level(t_.summary.extremes[b].top().unwrap().0));
                    infinite += h.back().unwrap().is_infinite() as usize;
                }
                let want: Vec<Vec<f64>> = hist.iter().map(|h| sorted_finite(h.iter().copied())).collect();
                assert_eq!(format!("{:?}", d.sorted), format!("{want:?}"), "window {window} update {t}");
            }
            assert!(!zeros || infinite > 10, "zero levels went through the windows: {infinite}");
            let json = serde_json::to_string(&d).unwrap();
            assert!(!json.contains("sorted"), "the saved form is the rule and the history: {json}");
            let back: OutlierDetector = serde_json::from_str(&json).unwrap();
            assert_eq!(format!("{back:?}"), format!("{d:?}"));
        }
    }

    /// The JSON round trip a checkpoint's header makes (`gradbus_artifacts`' container: written with
    /// `to_vec`, read into a `Value`, then decoded from it), and the plain one.
    fn through_json(d: &OutlierDetector) -> Vec<OutlierDetector> {
        let bytes = serde_json::to_vec(d).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        vec![serde_json::from_value(value).unwrap(), serde_json::from_slice(&bytes).unwrap()]
    }

    /// The bits of every level of a detector's history and sorted windows.
    fn bits(d: &OutlierDetector) -> (Vec<Vec<u64>>, Vec<Vec<u64>>) {
        let history = d.history.iter().map(|h| h.iter().map(|x| x.to_bits()).collect()).collect();
        (history, d.sorted.iter().map(|h| h.iter().map(|x| x.to_bits()).collect()).collect())
    }

    /// Every level a history can hold - -inf (a bucket all zero on every rank), finite ones down to
    /// the smallest subnormal, +inf and NaNs of any sign and payload - reads back from a checkpoint's
    /// JSON bit for bit (serde_json alone writes the non-finite ones as null), and a detector fed a
    /// zero bucket judges alike after the round trip.
    #[test]
    fn every_level_round_trips_through_a_checkpoints_json_bit_for_bit() {
        let nans = [f64::NAN, -f64::NAN, f64::from_bits(0x7ff0_0000_0000_0001), f64::from_bits(0xfff8_dead_beef_0001)];
        let odd = [f64::NEG_INFINITY, 1.5, f64::INFINITY, -0.0, 5e-324, f64::MAX, -537.0, f64::MIN];
        let history = vec![odd.into_iter().chain(nans).collect(), VecDeque::new(), [f64::NEG_INFINITY; 3].into()];
        let d = OutlierDetector::from(SavedDetector { rule: OutlierRule::default(), history });
        let json = serde_json::to_string(&d).unwrap();
        assert!(!json.contains("null"), "{json}");
        assert!(json.contains(r#"["-inf",1.5,"inf",-0.0,5e-324,"#), "{json}");
        assert!(
            json.contains(r#""nan:0x7ff8000000000000","nan:0xfff8000000000000","nan:0x7ff0000000000001","#),
            "{json}"
        );
        for back in through_json(&d) {
            assert_eq!(bits(&back), bits(&d));
            assert_eq!(back.rule, d.rule);
        }

        // A zero bucket in a run: level -inf in the history, the judgement the same after a resume.
        let l = layout();
        let mut d = OutlierDetector::new(OutlierRule::default(), 2);
        for t in 0..40 {
            // Bucket 0 all zero on both ranks every fifth update.
            let (a, b) = if t % 5 == 2 { (0.0, 0.0) } else { (1.0 + t as f64, 2.0) };
            d.observe(&table(&[[a, 3.0], [b, 4.0]], &[1; 2], &[0; 2]));
        }
        assert!(d.history[0].iter().any(|x| *x == f64::NEG_INFINITY));
        let spike = table_with(&[[1e12, 3.0], [2.0, 4.0]], &[[1e6, 0.1], [0.1, 0.1]], &[1; 2], &[0; 2]);
        assert_eq!(d.check(&spike, &l).map(|o| (o.rank, o.bucket)), Some((0, 0)), "a flipped-bit-like outlier");
        for back in through_json(&d) {
            assert_eq!(bits(&back), bits(&d));
            assert_eq!(format!("{:?}", back.inputs(&spike)), format!("{:?}", d.inputs(&spike)));
            assert_eq!(back.check(&spike, &l), d.check(&spike, &l));
        }
    }

    /// A checkpoint written before non-finite levels had their own strings holds `null` where a
    /// bucket was all zero: it reads as -inf (the only non-finite level the runtime observes, see
    /// `levels`), its sorted windows rebuilt without it; anything else that is not a level is refused
    /// with the key and what a level is.
    #[test]
    fn a_null_level_of_an_older_checkpoint_reads_as_minus_infinity() {
        let rule = r#"{"binades":6.0,"spread":6.0,"isolation":4.0,"window":32,"warmup":4}"#;
        // What the code before this format wrote for a history with a zero bucket at its second update.
        let old = format!(r#"{{"rule":{rule},"history":[[1.5,null,-2.25],[]]}}"#);
        let d: OutlierDetector = serde_json::from_str(&old).unwrap();
        assert_eq!(bits(&d).0, [vec![1.5f64.to_bits(), f64::NEG_INFINITY.to_bits(), (-2.25f64).to_bits()], vec![]]);
        assert_eq!(d.sorted, [vec![-2.25, 1.5], vec![]]);
        let again = serde_json::to_string(&d).unwrap();
        assert_eq!(again, old.replace("null", "\"-inf\""), "the same history, its -inf now written as such");

        for bad in [r#""-Infinity""#, r#""nan:0x0000000000000001""#, r#""nan:0x7ff8""#, "true"] {
            let text = format!(r#"{{"rule":{rule},"history":[[1.5,{bad}]]}}"#);
            let e = serde_json::from_str::<OutlierDetector>(&text).map(|_| ()).unwrap_err().to_string();
            assert!(e.starts_with("invalid ") && e.contains("expected a level: a number,"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_rank_that_found_its_own_state_damaged_is_repaired_even_at_2_ranks() {
        let weights = StateFault { weights: true, consumed: None }.word();
        let t = table(&[[1.0; 2]; 2], &[5, 9], &[0, weights]);
        match check_state(&t) {
            StateCheck::Repair { damaged, donor, why } => {
                assert_eq!((damaged, donor), (vec![1], 0));
                assert!(why[0].contains("no longer hash"), "{why:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(check_state(&table(&[[1.0; 2]; 2], &[5, 5], &[0, 0])), StateCheck::Healthy);
    }

    #[test]
    fn without_a_finding_the_majority_decides_and_2_ranks_cannot() {
        let t = table(&[[1.0; 2]; 3], &[5, 7, 5], &[0; 3]);
        assert!(matches!(check_state(&t), StateCheck::Repair { ref damaged, donor: 0, .. } if damaged == &[1]));
        let t = table(&[[1.0; 2]; 3], &[7, 5, 5], &[0; 3]);
        assert!(matches!(check_state(&t), StateCheck::Repair { ref damaged, donor: 1, .. } if damaged == &[0]));
        assert!(matches!(check_state(&table(&[[1.0; 2]; 2], &[5, 7], &[0; 2])), StateCheck::Undecided { .. }));
        let tie = table(&[[1.0; 2]; 4], &[5, 7, 5, 7], &[0; 4]);
        assert!(matches!(check_state(&tie), StateCheck::Undecided { .. }));
        // Every rank damaged by its own account: nobody to copy from.
        let all = StateFault { weights: true, consumed: None }.word();
        assert!(matches!(check_state(&table(&[[1.0; 2]; 2], &[5, 5], &[all; 2])), StateCheck::Undecided { .. }));
    }

    #[test]
    fn an_outlier_needs_history_and_must_stand_above_both_its_history_and_the_other_ranks() {
        let l = layout();
        let mut d = OutlierDetector::new(OutlierRule::default(), 2);
        let calm = table(&[[1.0, 4.0], [2.0, 3.0], [1.5, 5.0]], &[1; 3], &[0; 3]);
        // Rank 2's bucket #0 holds one element of 2^20 (a flipped exponent bit): its norm is it.
        let ss = [[1.0, 4.0], [2.0, 3.0], [2f64.powi(40) + 1.0, 5.0]];
        let flipped = table_with(&ss, &[[0.1, 0.2], [0.1, 0.2], [2f32.powi(20), 0.2]], &[1; 3], &[0; 3]);
        assert_eq!(d.check(&flipped, &l), None, "no history yet");
        for _ in 0..4 {
            assert_eq!(d.check(&calm, &l), None);
            d.observe(&calm);
        }
        let o = d.check(&flipped, &l).expect("2^20 in norm above its history and the others, one element");
        assert_eq!((o.rank, o.bucket, o.peak.clone()), (2, 0, Some(("head".to_string(), 3, 2f32.powi(20)))));
        assert!((o.level - 20.0).abs() < 1e-9 && o.excess > 19.0 && o.spread > 19.0 && o.isolation > 19.0, "{o}");
        // The same norm spread over many elements (a gradient the data makes large): not isolated.
        let spread_out = table(&ss, &[1; 3], &[0; 3]);
        assert_eq!(d.check(&spread_out, &l), None);
        // The same jump on every rank: no outlier against the others.
        let all = table_with(&[ss[2]; 3], &[[2f32.powi(20), 0.2]; 3], &[1; 3], &[0; 3]);
        assert_eq!(d.check(&all, &l), None);
        assert!((isolation(2f64.powi(40), 2f32.powi(20)) - 50.0).abs() < 1e-9, "all of the bucket: 50 binades");
        assert!((isolation(5.0, 1.0) - -1.0).abs() < 1e-9, "1 against a rest of norm 2");
        // A slow climb: each step within the rule of the recent median.
        let mut slow = OutlierDetector::new(OutlierRule::default(), 2);
        for i in 0..200 {
            let ss = 2f64.powf(i as f64 * 0.2);
            let t = table(&[[ss, 1.0], [ss * 4.0, 1.0], [ss * 2.0, 1.0]], &[1; 3], &[0; 3]);
            assert_eq!(slow.check(&t, &l), None, "update {i}");
            slow.observe(&t);
        }
    }
}
