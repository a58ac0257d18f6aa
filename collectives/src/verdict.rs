//! The agreed health table and the one pure function that turns it into a verdict.
//!
//! Invariants: every rank holds a bitwise-identical `HealthTable` after `Transport::agree` - on a
//! healthy update only its O(buckets) `Summary` and the reduced buckets' health, otherwise the full
//! per-rank detail too (`agreement`) - and `decide` depends on nothing else but the policy and the
//! history (which every rank updates from the same verdicts). So every rank reaches the same verdict
//! with no extra round trip, and no rank can die alone while the others wait in the next collective.

use std::collections::VecDeque;

use gradbus_kernels::Health;
use serde::{Deserialize, Serialize};

use crate::agreement::{BucketStat, LocalScalars, Stat, Summary, ValueNames};
use crate::layout::Layout;

/// Which optimizer update a collective belongs to. Never "-1": the worker always knows its step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StepId {
    /// Optimizer step (RL step), counted from 0.
    pub step: u64,
    /// Mini-batch (update) inside the step.
    pub minibatch: u32,
    /// 0 for the first execution, 1 for a rerun.
    pub attempt: u32,
}

/// The reduced buckets as their reducers saw them: the health of each sum and the checksum of
/// each sum as written (`HealthTable::reference`).
#[derive(Clone, Debug, PartialEq)]
pub struct Reduced {
    /// Health of each reduced bucket.
    pub health: Vec<Health>,
    /// Position hash of each reduced bucket.
    pub reference: Vec<u64>,
}

/// What every rank knows after the agreement of one update.
///
/// Always: the `summary` (O(buckets), see `agreement`) and the reduced buckets' health. The
/// per-rank detail (`local`, `reports`) only when the agreement gathered the full table
/// (`is_detailed`): when the summary showed a non-finite value or a disagreement, or when the table
/// path was forced. Every field present is bitwise the same on every rank, and the summary is the
/// same whichever path produced it.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthTable {
    /// Number of ranks.
    pub world: usize,
    /// Number of buckets.
    pub buckets: usize,
    /// `local[bucket * world + rank]`: the rank's gradients in that bucket BEFORE the reduce;
    /// `first_bad` is relative to the bucket's start. Empty unless detailed.
    pub local: Vec<Health>,
    /// `peaks[bucket * world + rank]`: the peak of the rank's gradients in that bucket (the largest
    /// |value| of its block with the largest sum of squares, and its offset in the bucket), where
    /// the transport tallies it. Empty unless detailed; `None` where not tallied.
    pub peaks: Vec<Option<(f32, u64)>>,
    /// Health of each reduced bucket (its sum of squares gives the global norm).
    pub reduced: Vec<Health>,
    /// Per bucket: the checksum of the reduced gradient as its reducers wrote it, over the
    /// transport's pieces (`transport::hash_pieces`): what each rank's optimizer must have consumed.
    pub reference: Vec<u64>,
    /// Each rank's report. Empty unless detailed.
    pub reports: Vec<LocalScalars>,
    /// The aggregates every rank decides from.
    pub summary: Summary,
}

impl HealthTable {
    /// The table of a full gather: the summary is the merge of every rank's contribution (rank
    /// `k`'s local cells and report of the values `names`; the reduced health from `reduced`), so
    /// it is bitwise the summary an all-reduce of the same contributions gives; `ops` is the agreed
    /// collective hash (when the transport checks one).
    pub fn detailed(
        world: usize,
        names: &ValueNames,
        local: Vec<Health>,
        peaks: Vec<Option<(f32, u64)>>,
        reduced: Reduced,
        reports: Vec<LocalScalars>,
        ops: Option<u64>,
    ) -> HealthTable {
        let Reduced { health: reduced, reference } = reduced;
        let buckets = reduced.len();
        assert_eq!((local.len(), reports.len(), reference.len()), (world * buckets, world, buckets));
        let peaks = if peaks.is_empty() { vec![None; local.len()] } else { peaks };
        assert_eq!(peaks.len(), local.len(), "one peak (or none) per cell");
        let mut summary = Summary::empty(buckets, names);
        summary.set_reduced(&reduced);
        summary.set_reference(&reference);
        for (k, r) in reports.iter().enumerate() {
            for b in 0..buckets {
                let (h, peak) = (&local[b * world + k], peaks[b * world + k]);
                summary.add_local(b, h.nan, h.inf);
                summary.extremes[b].add(k, &BucketStat { sumsq: h.sumsq, peak });
            }
            summary.add_report(r);
            if let Some(ops) = ops {
                summary.ops.add(ops);
            }
        }
        HealthTable { world, buckets, local, peaks, reduced, reference, reports, summary }
    }

    /// The table of a summary alone (no per-rank detail): the summary path's healthy update.
    /// `None` when the reducers disagree (then the caller gathers the table).
    pub fn summarized(world: usize, summary: Summary) -> Option<HealthTable> {
        let (reduced, reference) = (summary.reduced()?, summary.reference()?);
        Some(HealthTable {
            world,
            buckets: reduced.len(),
            local: Vec::new(),
            peaks: Vec::new(),
            reduced,
            reference,
            reports: Vec::new(),
            summary,
        })
    }

    /// Whether the per-rank detail (`local`, `reports`) is present.
    pub fn is_detailed(&self) -> bool {
        self.reports.len() == self.world
    }

    /// Health of one rank's local gradients in one bucket (a detailed table only).
    pub fn cell(&self, bucket: usize, rank: usize) -> &Health {
        assert!(self.is_detailed(), "per-rank health is gathered only when something is not finite");
        &self.local[bucket * self.world + rank]
    }

    /// L2 norm of the reduced gradient, from the f64 sums of squares of the finite elements.
    pub fn grad_norm(&self) -> f64 {
        self.reduced.iter().map(|h| h.sumsq).sum::<f64>().sqrt()
    }

    /// True when every rank's local gradients and every reduced bucket are finite.
    pub fn all_finite(&self) -> bool {
        let s = &self.summary;
        s.nan.iter().chain(&s.inf).all(|&c| c == 0) && self.reduced.iter().all(Health::is_finite)
    }

    /// True when every rank reported a finite loss.
    pub fn loss_finite(&self) -> bool {
        self.summary.loss.all_finite()
    }

    /// The loss averaged over ranks (the exact sum rounded once, divided by the world).
    pub fn mean_loss(&self) -> f64 {
        self.summary.loss.sum() / self.world as f64
    }

    /// The workload value `name` over ranks (see `Summary::value`).
    pub fn value(&self, name: &str) -> &Stat {
        self.summary.value(name)
    }

    /// The workload value `name` averaged over ranks (the exact sum rounded once, divided by the
    /// world).
    pub fn mean_value(&self, name: &str) -> f64 {
        self.value(name).sum() / self.world as f64
    }

    /// Ranks whose local gradients hold a non-finite value, ascending (none without detail: the
    /// summary path is taken only when every count is zero).
    pub fn nonfinite_ranks(&self) -> Vec<usize> {
        if !self.is_detailed() {
            return Vec::new();
        }
        (0..self.world).filter(|&r| (0..self.buckets).any(|b| !self.cell(b, r).is_finite())).collect()
    }

    /// Ranks whose replica checksum differs from rank 0's (a detailed table; empty when all agree).
    pub fn replica_outliers(&self) -> Vec<usize> {
        if self.summary.replica.value().is_some() || !self.is_detailed() {
            return Vec::new();
        }
        (0..self.world).filter(|&r| self.reports[r].replica != self.reports[0].replica).collect()
    }

    /// Non-finite counts per (bucket, rank), the fingerprint a rerun is compared by.
    fn fingerprint(&self) -> Vec<(u64, u64, Option<u64>)> {
        self.local.iter().map(|h| (h.nan, h.inf, h.first_bad)).collect()
    }
}

/// What to do when gradients are not finite.
#[derive(Clone, Debug, PartialEq)]
pub enum Policy {
    /// Stop every rank with a report and a failure dump.
    Abort,
    /// Drop the update on every rank, at most `max_consecutive` in a row and at most `max_fraction`
    /// of the last `window` updates; past either bound, abort.
    Skip { max_consecutive: u32, max_fraction: f64, window: u32 },
    /// Recompute the update with the same inputs: the same non-finite result means a deterministic
    /// cause (abort with the trace), a different one a transient fault (continue, rank marked suspect).
    Rerun,
}

/// The action every rank takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Apply the update.
    Proceed,
    /// Drop the update.
    Skip,
    /// Recompute the update (attempt 1).
    Rerun,
    /// Stop the job.
    Abort,
    /// Copy the shared state (weights, optimizer moments) from a healthy replica into the damaged
    /// ones, then recompute the update (silent data corruption found by the replica check).
    Repair,
}

impl Action {
    /// The word written in `metrics.jsonl` and `report.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Proceed => "proceed",
            Action::Skip => "skip",
            Action::Rerun => "rerun",
            Action::Abort => "abort",
            Action::Repair => "repair",
        }
    }
}

/// How a non-finite update was classified.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Classification {
    /// The rerun gave the same non-finite cells: the cause is in the data or the weights.
    Deterministic,
    /// The rerun differed (or came back finite): a transient fault.
    Transient,
    /// Skipping ran out of its budget (`skip.max_consecutive` or `skip.max_fraction`).
    SkipBudget,
    /// An fp16 loss scaler's overflow (the PyTorch guard with a `GradScaler`): skipped while the
    /// scaler lowers its scale; an abort when the scale had already reached its floor.
    LossScale,
}

impl std::fmt::Display for Classification {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Classification::Deterministic => "deterministic",
            Classification::Transient => "transient",
            Classification::SkipBudget => "skip-budget",
            Classification::LossScale => "loss-scale",
        })
    }
}

/// Where the non-finite values of a report came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Some rank's own gradients were non-finite (`ranks` names them).
    LocalGradients,
    /// Every rank's gradients were finite but their rank-ordered sum was not: `bucket`, `param`
    /// and `element` say where the sum first went non-finite.
    SumOverflow,
    /// Finite gradients of `ranks` many binades above the others' and their own history (silent
    /// data corruption, or data that makes them so): `bucket`, `param` and `element` name the
    /// largest value.
    Outlier,
    /// The replicas' weights differ and no majority tells the healthy ones (`ranks`: every rank).
    Replicas,
}

/// Per-rank non-finite counts in a report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankHealth {
    /// The rank.
    pub rank: usize,
    /// NaN elements in its local gradients.
    pub nan: u64,
    /// Inf elements in its local gradients.
    pub inf: u64,
    /// First bucket where they were non-finite.
    pub first_bucket: usize,
    /// The samples (dataset indices or prompt ids) of its micro-batch that held the first
    /// non-finite value, when the trainer says which (the PyTorch guard's `samples`); else empty.
    pub samples: Vec<SampleId>,
}

/// A sample's id: a dataset index, or a name (a prompt id).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SampleId {
    /// A dataset index.
    Index(u64),
    /// A name.
    Name(String),
}

impl std::fmt::Display for SampleId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SampleId::Index(i) => write!(f, "{i}"),
            SampleId::Name(n) => write!(f, "{n:?}"),
        }
    }
}

/// The report of a non-finite update: what Megatron's "iteration -1" message could not say.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// Optimizer step.
    pub step: u64,
    /// Mini-batch inside the step.
    pub minibatch: u32,
    /// The attempt that was judged.
    pub attempt: u32,
    /// The action taken.
    pub verdict: Action,
    /// Whether a rank's own gradients or only their sum went non-finite.
    pub cause: Cause,
    /// Ranks whose local gradients were non-finite, ascending (empty for a sum overflow).
    pub ranks: Vec<usize>,
    /// The first bucket (in reduce order) with a non-finite value (for a sum overflow: in the sum).
    pub bucket: usize,
    /// The parameter holding the first non-finite element of that bucket on the lowest bad rank (or
    /// in the sum).
    pub param: String,
    /// Element index inside that parameter.
    pub element: usize,
    /// NaN elements over all ranks' local gradients (for a sum overflow: in the reduced sum).
    pub nan: u64,
    /// Inf elements over all ranks' local gradients (for a sum overflow: in the reduced sum).
    pub inf: u64,
    /// Per-rank detail.
    pub per_rank: Vec<RankHealth>,
    /// Whether every rank's loss was finite.
    pub loss_finite: bool,
    /// `deterministic` or `transient` after a rerun; `skip-budget` when skipping ran out.
    #[serde(deserialize_with = "required")]
    pub classification: Option<Classification>,
}

impl std::fmt::Display for Report {
    /// The one abort line (the workers' log, `gradbus report`'s summary): step, update, attempt,
    /// ranks (or the sum), bucket, parameter, element, NaN and Inf counts, the loss, the verdict.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self;
        write!(f, "step {} update {} (attempt {}): ", r.step, r.minibatch, r.attempt)?;
        let ranks: Vec<String> = r.ranks.iter().map(|k| k.to_string()).collect();
        match r.cause {
            Cause::LocalGradients => write!(f, "rank(s) [{}]", ranks.join(", "))?,
            Cause::SumOverflow => write!(f, "the sum overflowed, every rank's gradients finite (rank(s) [])")?,
            Cause::Outlier => write!(f, "finite outlier gradients on rank(s) [{}]", ranks.join(", "))?,
            Cause::Replicas => write!(f, "replicas differ with no majority, rank(s) [{}]", ranks.join(", "))?,
        }
        write!(
            f,
            ", bucket #{}, param {} element {}, {} NaN, {} Inf, loss {}; verdict {}",
            r.bucket,
            r.param,
            r.element,
            r.nan,
            r.inf,
            if r.loss_finite { "finite" } else { "NOT finite" },
            r.verdict.as_str()
        )?;
        match r.classification {
            Some(c) => write!(f, " ({c})"),
            None => Ok(()),
        }
    }
}

/// The verdict on one update.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// What every rank does.
    pub action: Action,
    /// Present whenever some gradient was non-finite.
    pub report: Option<Report>,
}

/// What `decide` remembers between updates; every rank updates it from the same verdicts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History {
    /// Skips in a row up to now.
    pub consecutive_skips: u32,
    /// Skip flags of the most recent updates (newest last).
    pub recent: VecDeque<bool>,
    /// Fingerprint of the first attempt of the update now being rerun.
    first_attempt: Option<Vec<(u64, u64, Option<u64>)>>,
    /// Total skipped updates.
    pub skipped: u64,
    /// Ranks classified suspect after a transient fault.
    pub suspects: Vec<usize>,
}

/// Build the report of a table with some non-finite gradients.
fn report(table: &HealthTable, layout: &Layout, at: StepId, verdict: Action) -> Report {
    let mut per_rank = Vec::new();
    for rank in 0..table.world {
        let cells = (0..table.buckets).map(|b| (b, table.cell(b, rank)));
        let bad: Vec<_> = cells.filter(|(_, h)| !h.is_finite()).collect();
        if let Some(&(first_bucket, _)) = bad.first() {
            let nan = bad.iter().map(|(_, h)| h.nan).sum();
            let inf = bad.iter().map(|(_, h)| h.inf).sum();
            per_rank.push(RankHealth { rank, nan, inf, first_bucket, samples: Vec::new() });
        }
    }
    // Every rank finite but some reduced bucket not: the rank-ordered sum overflowed. Name the first
    // bucket (in reduce order) and element where the sum went non-finite.
    let (cause, bucket, first_bad, nan, inf) = if per_rank.is_empty() {
        let bucket = table.reduced.iter().position(|h| !h.is_finite()).unwrap_or(0);
        let sum: Vec<&Health> = table.reduced.iter().filter(|h| !h.is_finite()).collect();
        let (nan, inf) = (sum.iter().map(|h| h.nan).sum(), sum.iter().map(|h| h.inf).sum());
        (Cause::SumOverflow, bucket, table.reduced[bucket].first_bad, nan, inf)
    } else {
        let bucket = per_rank.iter().map(|r| r.first_bucket).min().unwrap_or(0);
        let first_rank = per_rank.iter().find(|r| r.first_bucket == bucket).map_or(0, |r| r.rank);
        let (nan, inf) = (per_rank.iter().map(|r| r.nan).sum(), per_rank.iter().map(|r| r.inf).sum());
        (Cause::LocalGradients, bucket, table.cell(bucket, first_rank).first_bad, nan, inf)
    };
    let offset = first_bad.unwrap_or(0) as usize + layout.buckets[bucket].range.start;
    let (param, element) = layout.locate(offset).map_or((String::from("?"), 0), |(s, i)| (s.name.clone(), i));
    Report {
        step: at.step,
        minibatch: at.minibatch,
        attempt: at.attempt,
        verdict,
        cause,
        ranks: per_rank.iter().map(|r| r.rank).collect(),
        bucket,
        param,
        element,
        nan,
        inf,
        per_rank,
        loss_finite: table.loss_finite(),
        classification: None,
    }
}

/// Deserialize a field that must be present even though it may be null (serde would default a
/// missing `Option` to `None`: a missing key must be an error, not a silent default).
fn required<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    T::deserialize(d)
}

/// The verdict on one update. Pure: the same table, policy and history give the same verdict.
pub fn decide(table: &HealthTable, layout: &Layout, policy: &Policy, history: &History, at: StepId) -> Verdict {
    let finite = table.all_finite();
    // The execution after a `Rerun` verdict (`first_attempt` is that verdict's fingerprint; an
    // update recomputed for another reason, a replica repair, is judged as a first execution).
    let rerun = history.first_attempt.is_some();
    // A rerun that came back finite was a transient fault: continue with the recomputed gradients.
    if finite {
        let mut v = Verdict { action: Action::Proceed, report: None };
        if rerun {
            v.report =
                Some(Report { classification: Some(Classification::Transient), ..empty_report(at, Action::Proceed) });
        }
        return v;
    }
    let (action, class) = match policy {
        Policy::Abort => (Action::Abort, None),
        Policy::Rerun if !rerun => (Action::Rerun, None),
        Policy::Rerun => {
            let same = history.first_attempt.as_ref() == Some(&table.fingerprint());
            if same {
                (Action::Abort, Some(Classification::Deterministic))
            } else {
                (Action::Skip, Some(Classification::Transient))
            }
        }
        Policy::Skip { .. } if history.would_skip(policy) => (Action::Skip, None),
        Policy::Skip { .. } => (Action::Abort, Some(Classification::SkipBudget)),
    };
    let mut r = report(table, layout, at, action);
    r.classification = class;
    Verdict { action, report: Some(r) }
}

/// A report of no non-finite value at `at` (`cause`, `ranks`, where and what to fill in).
pub fn empty_report(at: StepId, verdict: Action) -> Report {
    Report {
        step: at.step,
        minibatch: at.minibatch,
        attempt: at.attempt,
        verdict,
        cause: Cause::LocalGradients,
        ranks: Vec::new(),
        bucket: 0,
        param: String::new(),
        element: 0,
        nan: 0,
        inf: 0,
        per_rank: Vec::new(),
        loss_finite: true,
        classification: None,
    }
}

impl History {
    /// Whether `policy` is `Skip` and one more skip stays within its budget: at most
    /// `max_consecutive` in a row, at most `max_fraction` of the last `window` updates.
    pub fn would_skip(&self, policy: &Policy) -> bool {
        let Policy::Skip { max_consecutive, max_fraction, window } = policy else { return false };
        let in_window = self.recent.iter().rev().take(*window as usize - 1).filter(|&&s| s).count() + 1;
        self.consecutive_skips < *max_consecutive && in_window as f64 <= max_fraction * *window as f64
    }

    /// Remember a verdict (call on every rank after every `decide`).
    pub fn record(&mut self, table: &HealthTable, verdict: &Verdict) {
        match verdict.action {
            Action::Rerun => {
                self.first_attempt = Some(table.fingerprint());
                return;
            }
            // The update is recomputed from repaired state and judged afresh.
            Action::Repair => {
                self.first_attempt = None;
                return;
            }
            Action::Skip => {
                self.consecutive_skips += 1;
                self.skipped += 1;
            }
            Action::Proceed | Action::Abort => self.consecutive_skips = 0,
        }
        if let Some(r) = &verdict.report {
            if r.classification == Some(Classification::Transient) {
                let ranks = self.first_attempt.as_ref().map(|fp| suspects(fp, table.world)).unwrap_or_default();
                for k in ranks {
                    if !self.suspects.contains(&k) {
                        self.suspects.push(k);
                    }
                }
            }
        }
        self.ended(verdict.action == Action::Skip);
    }

    /// Remember a "proceed" decided without a table (no report, no rerun pending): what `record`
    /// does for one.
    pub fn proceeded(&mut self) {
        self.consecutive_skips = 0;
        self.ended(false);
    }

    /// The end of an update's attempts: skipped or not.
    fn ended(&mut self, skipped: bool) {
        self.first_attempt = None;
        self.recent.push_back(skipped);
        while self.recent.len() > 1024 {
            self.recent.pop_front();
        }
    }
}

/// Ranks with non-finite cells in a fingerprint.
fn suspects(fp: &[(u64, u64, Option<u64>)], world: usize) -> Vec<usize> {
    let mut out: Vec<usize> = fp.iter().enumerate().filter(|(_, c)| c.0 + c.1 > 0).map(|(i, _)| i % world).collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::agreement::tests::{allreduce, names, random_rows};
    use crate::layout::ParamSpec;
    use gradbus_kernels::rng::Rng;

    pub(crate) fn layout() -> Layout {
        Layout::new(&[ParamSpec::new("w0", 40), ParamSpec::new("w1", 20), ParamSpec::new("head", 10)], 0)
    }

    /// A table for 3 ranks over `layout()`, with `bad = (rank, bucket, offset in bucket, nan?)` planted.
    pub(crate) fn table(bad: &[(usize, usize, u64, bool)]) -> HealthTable {
        let (world, buckets) = (3, 3);
        let mut local = vec![Health { sumsq: 1.0, ..Health::default() }; world * buckets];
        for &(r, b, off, nan) in bad {
            let h = &mut local[b * world + r];
            if nan {
                h.nan += 1
            } else {
                h.inf += 1
            }
            h.first_bad = Some(h.first_bad.map_or(off, |o| o.min(off)));
        }
        let reduced = (0..buckets)
            .map(|b| {
                let mut h = Health::default();
                for r in 0..world {
                    h.merge(&local[b * world + r], 0);
                }
                h
            })
            .collect();
        let reports = vec![LocalScalars { loss: 0.5, ..LocalScalars::default() }; world];
        let reduced = Reduced { health: reduced, reference: vec![11; buckets] };
        HealthTable::detailed(world, &ValueNames::default(), local, Vec::new(), reduced, reports, None)
    }

    const AT: StepId = StepId { step: 7, minibatch: 2, attempt: 0 };

    /// The reduced buckets of a table, as `detailed` takes them.
    fn red(t: &HealthTable) -> Reduced {
        Reduced { health: t.reduced.clone(), reference: t.reference.clone() }
    }

    #[test]
    fn finite_tables_proceed_under_every_policy() {
        let skip = Policy::Skip { max_consecutive: 1, max_fraction: 0.5, window: 4 };
        for p in [Policy::Abort, Policy::Rerun, skip] {
            let v = decide(&table(&[]), &layout(), &p, &History::default(), AT);
            assert_eq!(v, Verdict { action: Action::Proceed, report: None });
        }
    }

    #[test]
    fn report_names_rank_bucket_param_and_element_of_the_first_bad_value() {
        let l = layout();
        // Bucket #0 holds `head` (the last parameter); rank 2 is bad there at element 3, rank 1 only later.
        let t = table(&[(2, 0, 3, true), (1, 2, 5, false)]);
        let v = decide(&t, &l, &Policy::Abort, &History::default(), AT);
        assert_eq!(v.action, Action::Abort);
        let r = v.report.unwrap();
        assert_eq!((r.step, r.minibatch, r.bucket), (7, 2, 0));
        assert_eq!((r.param.as_str(), r.element), ("head", 3));
        assert_eq!(r.ranks, vec![1, 2]);
        assert_eq!((r.nan, r.inf), (1, 1));
        assert!(r.loss_finite);
        assert_eq!(r.per_rank[0], RankHealth { rank: 1, nan: 0, inf: 1, first_bucket: 2, samples: Vec::new() });
    }

    #[test]
    fn skip_is_bounded_by_consecutive_count_and_window_fraction() {
        let l = layout();
        let bad = table(&[(0, 1, 0, true)]);
        let good = table(&[]);
        let p = Policy::Skip { max_consecutive: 2, max_fraction: 0.5, window: 6 };
        let mut h = History::default();
        let mut actions = Vec::new();
        for t in [&bad, &bad, &bad] {
            let v = decide(t, &l, &p, &h, AT);
            h.record(t, &v);
            actions.push(v.action);
        }
        assert_eq!(actions, vec![Action::Skip, Action::Skip, Action::Abort], "third in a row exceeds max_consecutive");
        assert_eq!(h.skipped, 2);

        // Alternating bad/good: never 3 in a row, but a third skip in 6 updates exceeds 40% of them.
        let p = Policy::Skip { max_consecutive: 2, max_fraction: 0.4, window: 6 };
        let mut h = History::default();
        let mut actions = Vec::new();
        for t in [&bad, &good, &bad, &good, &bad] {
            let v = decide(t, &l, &p, &h, AT);
            h.record(t, &v);
            actions.push(v.action);
        }
        assert_eq!(actions.last(), Some(&Action::Abort));
        assert_eq!(actions.iter().filter(|&&a| a == Action::Skip).count(), 2);
        assert_eq!(decide(&bad, &l, &p, &h, AT).report.unwrap().classification, Some(Classification::SkipBudget));
    }

    #[test]
    fn a_proceed_without_a_table_is_remembered_as_a_recorded_one() {
        let (l, bad, good) = (layout(), table(&[(0, 1, 0, true)]), table(&[]));
        let p = Policy::Skip { max_consecutive: 2, max_fraction: 0.5, window: 6 };
        let (mut recorded, mut clean) = (History::default(), History::default());
        for (k, t) in [&bad, &good, &bad, &good, &bad].into_iter().enumerate() {
            let v = decide(t, &l, &p, &recorded, AT);
            assert_eq!(v.action, decide(t, &l, &p, &clean, AT).action, "update {k}");
            recorded.record(t, &v);
            match v.action {
                Action::Proceed => clean.proceeded(),
                _ => clean.record(t, &v),
            }
            assert_eq!(
                (clean.consecutive_skips, &clean.recent, clean.skipped),
                (recorded.consecutive_skips, &recorded.recent, recorded.skipped)
            );
        }
    }

    #[test]
    fn rerun_classifies_identical_as_deterministic_and_different_as_transient() {
        let l = layout();
        let bad = table(&[(1, 0, 4, true)]);
        let rerun = StepId { attempt: 1, ..AT };

        let mut h = History::default();
        let v = decide(&bad, &l, &Policy::Rerun, &h, AT);
        assert_eq!(v.action, Action::Rerun);
        h.record(&bad, &v);
        let v = decide(&bad, &l, &Policy::Rerun, &h, rerun);
        assert_eq!(v.action, Action::Abort);
        assert_eq!(v.report.unwrap().classification, Some(Classification::Deterministic));

        let mut h = History::default();
        let v = decide(&bad, &l, &Policy::Rerun, &h, AT);
        h.record(&bad, &v);
        let good = table(&[]);
        let v = decide(&good, &l, &Policy::Rerun, &h, rerun);
        assert_eq!(v.action, Action::Proceed);
        assert_eq!(v.report.as_ref().unwrap().classification, Some(Classification::Transient));
        h.record(&good, &v);
        assert_eq!(h.suspects, vec![1], "the rank that was bad once is suspect");

        // A rerun that is non-finite in another place: transient, skipped.
        let mut h = History::default();
        let v = decide(&bad, &l, &Policy::Rerun, &h, AT);
        h.record(&bad, &v);
        let other = table(&[(2, 1, 0, false)]);
        let v = decide(&other, &l, &Policy::Rerun, &h, rerun);
        assert_eq!((v.action, v.report.unwrap().classification), (Action::Skip, Some(Classification::Transient)));
    }

    #[test]
    fn a_sum_that_overflows_from_finite_gradients_names_the_sum_bucket_param_and_element() {
        let l = layout();
        let mut t = table(&[]);
        // Every rank's gradients finite; the sum of bucket #1 (w1) overflowed at its element 6.
        t.reduced[1] = Health { inf: 2, sumsq: 1.0, first_bad: Some(6), nan: 0 };
        let r = decide(&t, &l, &Policy::Abort, &History::default(), AT).report.unwrap();
        assert_eq!(r.cause, Cause::SumOverflow);
        assert!(r.ranks.is_empty() && r.per_rank.is_empty());
        assert_eq!((r.bucket, r.param.as_str(), r.element, r.inf), (1, "w1", 6, 2));
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"cause\":\"sum_overflow\""), "{json}");
        assert_eq!(serde_json::from_str::<Report>(&json).unwrap(), r);
    }

    #[test]
    fn replicas_that_differ_are_named_and_healthy_summaries_hold_no_detail() {
        let t = table(&[]);
        assert!(t.replica_outliers().is_empty());
        let mut reports = t.reports.clone();
        reports[1].replica = 99;
        let odd =
            HealthTable::detailed(t.world, &ValueNames::default(), t.local.clone(), Vec::new(), red(&t), reports, None);
        assert_eq!(odd.summary.anomaly(), Some(crate::agreement::Anomaly::Replicas));
        assert_eq!(odd.replica_outliers(), vec![1]);
        let small = HealthTable::summarized(t.world, t.summary.clone()).unwrap();
        assert!(!small.is_detailed() && small.nonfinite_ranks().is_empty() && small.replica_outliers().is_empty());
        assert_eq!((small.mean_loss(), small.grad_norm()), (t.mean_loss(), t.grad_norm()));
    }

    #[test]
    fn the_loss_scale_classification_reads_as_written() {
        let json = serde_json::to_string(&Classification::LossScale).unwrap();
        assert_eq!((json.as_str(), Classification::LossScale.to_string().as_str()), ("\"loss-scale\"", "loss-scale"));
        assert_eq!(serde_json::from_str::<Classification>(&json).unwrap(), Classification::LossScale);
    }

    #[test]
    fn non_finite_loss_is_reported() {
        let t = table(&[(0, 0, 0, true)]);
        let mut reports = t.reports.clone();
        reports[2].loss = f64::NAN;
        let t =
            HealthTable::detailed(t.world, &ValueNames::default(), t.local.clone(), Vec::new(), red(&t), reports, None);
        let r = decide(&t, &layout(), &Policy::Abort, &History::default(), AT).report.unwrap();
        assert!(!r.loss_finite);
    }

    #[test]
    fn the_summary_path_gives_the_table_paths_summary_verdict_and_metrics_bit_for_bit() {
        let specs: Vec<ParamSpec> = (0..9).map(|i| ParamSpec::new(format!("p{i}"), 10 + 37 * i)).collect();
        let layout = Layout::new(&specs, 600);
        let mut rng = Rng::new(&[18, 4]);
        let at = StepId { step: 3, minibatch: 1, attempt: 0 };
        let (mut healthy, mut anomalous) = (0, 0);
        for case in 0..600 {
            let world = 1 + rng.below(12);
            let p_bad = [0.0, 0.02, 0.2][case % 3];
            let (rows, reduced, reports) = random_rows(&mut rng, &layout, world, p_bad);
            let nb = layout.buckets.len();
            let local = (0..nb).flat_map(|b| rows.iter().map(move |r| r[b])).collect();
            let hashes: Vec<u64> = (0..nb as u64).map(|b| 0x5eed ^ b).collect();
            let red = Reduced { health: reduced.clone(), reference: hashes.clone() };
            let table = HealthTable::detailed(world, &names(), local, Vec::new(), red, reports.clone(), Some(7));
            // Every rank a reducer, as in the flat MPI transport.
            let parts: Vec<Summary> = (0..world)
                .map(|k| {
                    let mut s = Summary::of_rank(&names(), k, &rows[k], Some((&reduced, &hashes)), &reports[k]);
                    s.ops.add(7);
                    s
                })
                .collect();
            let summary = allreduce(&mut rng, &parts);
            assert_eq!(summary, table.summary, "case {case}");
            let finite =
                table.all_finite() && table.loss_finite() && table.summary.values().all(|(_, s)| s.all_finite());
            let same_replica = reports.iter().all(|r| r.replica == reports[0].replica);
            let undamaged = reports.iter().all(|r| r.state == 0);
            assert_eq!(summary.anomaly().is_none(), finite && same_replica && undamaged, "case {case}");
            if summary.anomaly().is_some() {
                anomalous += 1;
                continue;
            }
            healthy += 1;
            let small = HealthTable::summarized(world, summary).unwrap();
            assert!(!small.is_detailed());
            assert_eq!((&small.reduced, &small.reference), (&table.reduced, &table.reference));
            assert_eq!(small.summary.extremes, table.summary.extremes);
            assert_eq!(small.grad_norm().to_bits(), table.grad_norm().to_bits());
            assert_eq!(small.mean_loss().to_bits(), table.mean_loss().to_bits());
            for name in names().iter() {
                assert_eq!(small.mean_value(name).to_bits(), table.mean_value(name).to_bits());
                assert_eq!(small.value(name).max().to_bits(), table.value(name).max().to_bits());
            }
            assert!(small.nonfinite_ranks().is_empty() && table.nonfinite_ranks().is_empty());
            let policy = Policy::Skip { max_consecutive: 2, max_fraction: 0.5, window: 8 };
            let h = History::default();
            assert_eq!(decide(&small, &layout, &policy, &h, at), decide(&table, &layout, &policy, &h, at));
        }
        assert!(healthy > 150 && anomalous > 150, "both paths exercised: {healthy} healthy, {anomalous} not");
    }
}
