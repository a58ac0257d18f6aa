//! Loss and gradient-norm spike detection: a pure detector over a stream of values that every rank
//! already agrees on (the mean loss and the global gradient norm of the agreed health table), so
//! that each rank, fed the same stream, flags the same updates without another collective.
//!
//! Two rules, each as its reference implementation states it:
//!
//! - **rolling z-score** (llm.c's `OutlierDetector`): once `window` values have been seen, a value
//!   whose z-score against the mean and standard deviation of the last `window` values exceeds
//!   `z_limit` is a spike. Only upward deviations count (a loss or a norm that drops is no
//!   danger). Unlike llm.c, the statistics are those of the window *before* the new value, so a
//!   single huge value cannot hide itself by inflating the standard deviation; the value then
//!   enters the window whether it was a spike or not, as in llm.c.
//! - **Megatron's "unexpectedly large"** (`RerunStateMachine.is_unexpectedly_large`, used for
//!   `SPIKY_LOSS_FACTOR` and large gradients): the largest of the first `reference` (100) values is
//!   remembered; any later value above `factor` (10) times it is a spike.
//!
//! Non-finite values are not spikes here (the gradient bus's health verdict owns them) and do not
//! enter the statistics. The mean and deviation are recomputed from the window in a fixed order on
//! every observation (128 additions), so there is no drift from running sums and the result is a
//! pure function of the stream.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// llm.c's window (`OUTLIER_DETECTOR_WINDOW_SIZE`).
pub const DEFAULT_WINDOW: usize = 128;
/// Megatron's sample count for the reference maximum.
pub const MEGATRON_REFERENCE: usize = 100;
/// Megatron's `SPIKY_LOSS_FACTOR`.
pub const MEGATRON_FACTOR: f64 = 10.0;

/// One flagged value.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Spike {
    /// 0-based index of the observation in the stream (non-finite values count too).
    pub index: u64,
    /// The value.
    pub value: f64,
    /// Its z-score against the previous window; `None` before the window is full.
    pub z: Option<f64>,
    /// The z-score rule fired (`z > z_limit`).
    pub by_zscore: bool,
    /// Megatron's rule fired (`value > factor * max(first reference values)`).
    pub by_megatron: bool,
    /// The reference maximum of Megatron's rule, once known.
    pub reference_max: Option<f64>,
}

impl Spike {
    /// "z 6.1", "10x first-100 max", or both, for messages.
    pub fn rules(&self) -> String {
        let mut parts = Vec::new();
        if self.by_zscore {
            parts.push(format!("z {:.1}", self.z.unwrap_or(f64::NAN)));
        }
        if self.by_megatron {
            parts.push(format!(
                ">{}x first-{} max {:.4}",
                MEGATRON_FACTOR,
                MEGATRON_REFERENCE,
                self.reference_max.unwrap_or(0.0)
            ));
        }
        parts.join(", ")
    }
}

/// Rolling z-score plus Megatron's reference-maximum rule over one stream of values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpikeDetector {
    window: usize,
    z_limit: f64,
    reference: usize,
    factor: f64,
    recent: VecDeque<f64>,
    /// Finite values seen toward the reference (saturates at `reference`).
    reference_seen: usize,
    /// The largest of those (`None` before the first; an `Option` so that the state is plain JSON).
    reference_max: Option<f64>,
    observed: u64,
}

impl SpikeDetector {
    /// A detector with a z-score `window` and limit, and Megatron's rule at its defaults (10x the
    /// largest of the first 100 values). `window` is at least 2; a non-positive or non-finite
    /// `z_limit` turns the z-score rule off.
    pub fn new(window: usize, z_limit: f64) -> SpikeDetector {
        SpikeDetector {
            window: window.max(2),
            z_limit,
            reference: MEGATRON_REFERENCE,
            factor: MEGATRON_FACTOR,
            recent: VecDeque::with_capacity(window.max(2)),
            reference_seen: 0,
            reference_max: None,
            observed: 0,
        }
    }

    /// Replace Megatron's parameters; `reference == 0` or a non-positive `factor` turns the rule off.
    pub fn with_megatron(mut self, reference: usize, factor: f64) -> SpikeDetector {
        self.reference = reference;
        self.factor = factor;
        self
    }

    /// The z-score `x` would have against the current window (`None` until it is full or when
    /// the window has no spread and `x` equals its mean). Does not change the detector.
    pub fn zscore(&self, x: f64) -> Option<f64> {
        if self.recent.len() < self.window || !x.is_finite() {
            return None;
        }
        let n = self.recent.len() as f64;
        let mean = self.recent.iter().sum::<f64>() / n;
        let var = self.recent.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let std = var.sqrt();
        if std > 0.0 {
            Some((x - mean) / std)
        } else if x == mean {
            Some(0.0)
        } else {
            // A perfectly flat window: any departure is infinitely many deviations away.
            Some(if x > mean { f64::INFINITY } else { f64::NEG_INFINITY })
        }
    }

    /// The reference maximum of Megatron's rule, once `reference` finite values have been seen.
    pub fn reference_max(&self) -> Option<f64> {
        if self.reference > 0 && self.reference_seen >= self.reference {
            self.reference_max
        } else {
            None
        }
    }

    /// Feed the next value; returns the spike it is, if it is one.
    pub fn observe(&mut self, x: f64) -> Option<Spike> {
        let index = self.observed;
        self.observed += 1;
        if !x.is_finite() {
            return None;
        }
        let z = self.zscore(x);
        let by_zscore = self.z_limit > 0.0 && z.is_some_and(|z| z > self.z_limit);
        let reference_max = self.reference_max();
        let by_megatron = self.factor > 0.0 && reference_max.is_some_and(|m| x > self.factor * m);
        if self.reference > 0 && self.reference_seen < self.reference {
            self.reference_seen += 1;
            self.reference_max = Some(self.reference_max.map_or(x, |m| m.max(x)));
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(x);
        (by_zscore || by_megatron).then_some(Spike { index, value: x, z, by_zscore, by_megatron, reference_max })
    }

    /// Values observed so far (non-finite ones included).
    pub fn observed(&self) -> u64 {
        self.observed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic, slightly noisy stream around `base`.
    fn noisy(n: usize, base: f64) -> Vec<f64> {
        (0..n).map(|i| base + 0.01 * (((i * 7919) % 13) as f64 - 6.0)).collect()
    }

    #[test]
    fn nothing_before_the_window_is_full() {
        let mut d = SpikeDetector::new(8, 3.0).with_megatron(0, 0.0);
        for (i, x) in noisy(7, 1.0).into_iter().enumerate() {
            assert_eq!(d.observe(x), None, "value {i}");
        }
        assert_eq!(d.zscore(100.0), None, "7 of 8 values: no z-score yet");
        assert_eq!(d.observe(100.0), None, "the 8th value fills the window, is not judged");
        assert!(d.zscore(1.0).is_some());
    }

    #[test]
    fn rolling_zscore_flags_an_upward_jump_only() {
        let mut d = SpikeDetector::new(128, 6.0).with_megatron(0, 0.0);
        for x in noisy(200, 2.0) {
            assert_eq!(d.observe(x), None);
        }
        assert_eq!(d.observe(1.0), None, "a drop is no spike");
        let s = d.observe(3.0).expect("a jump of many deviations is a spike");
        assert!(s.by_zscore && !s.by_megatron);
        assert_eq!(s.index, 201);
        assert!(s.z.unwrap() > 6.0, "{s:?}");
        assert!(s.rules().starts_with("z "), "{}", s.rules());
    }

    #[test]
    fn the_window_forgets_old_values() {
        // A level shift: flagged at first, then the new level becomes normal once it fills the window.
        let mut d = SpikeDetector::new(16, 4.0).with_megatron(0, 0.0);
        for x in noisy(32, 1.0) {
            d.observe(x);
        }
        assert!(d.observe(5.0).is_some());
        let flagged: usize = noisy(40, 5.0).into_iter().filter(|&x| d.observe(x).is_some()).count();
        assert!(flagged < 16, "the new level is normal after a window: {flagged} flagged");
        assert!(d.observe(5.0).is_none());
    }

    #[test]
    fn flat_window_makes_any_rise_a_spike() {
        let mut d = SpikeDetector::new(4, 3.0).with_megatron(0, 0.0);
        for _ in 0..4 {
            assert!(d.observe(1.0).is_none());
        }
        assert_eq!(d.zscore(1.0), Some(0.0));
        let s = d.observe(1.5).unwrap();
        assert_eq!(s.z, Some(f64::INFINITY));
    }

    #[test]
    fn megatron_rule_is_ten_times_the_largest_of_the_first_hundred() {
        let mut d = SpikeDetector::new(DEFAULT_WINDOW, 0.0); // z-score off
        for i in 0..100 {
            // The largest of the first 100 is 3.0 (at i = 50).
            let x = if i == 50 { 3.0 } else { 1.0 };
            assert_eq!(d.observe(x), None, "no judgment during the first 100");
        }
        assert_eq!(d.reference_max(), Some(3.0));
        assert_eq!(d.observe(29.0), None, "below 10x");
        // Later values do not raise the reference.
        assert_eq!(d.observe(25.0), None);
        let s = d.observe(31.0).expect("above 10x 3.0");
        assert!(s.by_megatron && !s.by_zscore, "{s:?}");
        assert_eq!(s.reference_max, Some(3.0));
        assert_eq!(s.index, 102);
        assert!(s.rules().contains("10x first-100 max"), "{}", s.rules());
    }

    #[test]
    fn both_rules_can_fire_together() {
        let mut d = SpikeDetector::new(DEFAULT_WINDOW, 6.0);
        for x in noisy(300, 1.0) {
            assert_eq!(d.observe(x), None);
        }
        let s = d.observe(1000.0).unwrap();
        assert!(s.by_zscore && s.by_megatron);
    }

    #[test]
    fn non_finite_values_are_counted_but_neither_judged_nor_kept() {
        let mut d = SpikeDetector::new(4, 3.0).with_megatron(2, 10.0);
        for x in [1.0, f64::NAN, 1.1, f64::INFINITY, 0.9, 1.0] {
            assert_eq!(d.observe(x), None);
        }
        assert_eq!(d.observed(), 6);
        assert_eq!(d.reference_max(), Some(1.1), "NaN and Inf do not enter the reference");
        assert!(d.zscore(1.0).unwrap().abs() < 1.0, "nor the window");
    }

    #[test]
    fn same_stream_same_spikes_and_state_round_trips() {
        let stream: Vec<f64> = (0..400).map(|i| if i % 97 == 96 { 50.0 } else { 1.0 + (i % 5) as f64 * 0.1 }).collect();
        let run = |d: &mut SpikeDetector, xs: &[f64]| xs.iter().filter_map(|&x| d.observe(x)).collect::<Vec<_>>();
        let mut a = SpikeDetector::new(DEFAULT_WINDOW, 6.0);
        let mut b = SpikeDetector::new(DEFAULT_WINDOW, 6.0);
        let fresh: SpikeDetector = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(fresh, b, "a fresh detector round trips too");
        let all = run(&mut a, &stream);
        assert!(!all.is_empty());
        // Half the stream, then a checkpoint round trip through JSON, then the rest.
        let mut first = run(&mut b, &stream[..200]);
        let saved = serde_json::to_string(&b).unwrap();
        let mut c: SpikeDetector = serde_json::from_str(&saved).unwrap();
        first.extend(run(&mut c, &stream[200..]));
        assert_eq!(first, all);
    }
}
