//! Early warning of an overflow ahead: per update, the largest argument of a named `exp` (or any
//! quantity with a known ceiling) that every rank agreed on, its headroom to the ceiling, and from
//! its trend over the last updates a forecast of how many updates remain before it gets there.
//! The native runtime (its log-ratio headroom) and the PyTorch guard (`guard.watch`) both use it,
//! so a warning means the same on both sides.
//!
//! - [`exp_ceiling`]: ln of the largest finite value of a dtype, where `exp` overflows to +inf:
//!   88.72 for float32, 88.72 for bfloat16 (88.719: its largest finite value is a little smaller),
//!   11.09 for float16, 709.78 for float64.
//! - [`ranked`] / [`unranked`]: a rank's value and the rank in ONE f64 whose maximum over ranks is
//!   the largest value together with the lowest rank that holds it. So an agreement that combines
//!   values by maxima (`Stat::max`, on the summary path as on the table path, in any reduction
//!   order) agrees on which rank holds the maximum too, with no extra word or round trip. The value
//!   is rounded to f32 (exact for the float32, bfloat16 and float16 values it carries).
//! - [`Forecast`]: the agreed maxima of the last `window` updates; the trend is their
//!   least-squares slope, the forecast the headroom divided by it.
//! - [`Rule`]: when an [`Outlook`] is a warning, and when it is a stop.
//!
//! Invariant: a pure function of the stream of agreed values, fed in update order, so every rank
//! holds the same state and reaches the same outlook; the state serializes (checkpoints) and a
//! restored forecast continues the stream bit for bit. The slope is computed from the window in a
//! fixed order on every observation, with no running sums.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// ln of the largest finite value of `dtype` (torch's names: "float32", "bfloat16", "float16",
/// "float64"): `exp` of anything larger is +inf. `None` for another name.
pub fn exp_ceiling(dtype: &str) -> Option<f64> {
    let max: f64 = match dtype {
        "float32" => f32::MAX as f64,
        // 0x7f7f: the largest finite bfloat16, (2 - 2^-7) * 2^127.
        "bfloat16" => f32::from_bits(0x7f7f_0000) as f64,
        "float16" => 65504.0,
        "float64" => f64::MAX,
        _ => return None,
    };
    Some(max.ln())
}

/// Mantissa bits of an f64 below those of an f32 widened to it (always zero there): the rank's.
const RANK_BITS: u32 = 29;
const RANK_MASK: u64 = (1 << RANK_BITS) - 1;
/// The most ranks [`ranked`] can name.
pub const MAX_RANKS: usize = 1 << RANK_BITS;
/// Where a non-finite value goes: 2^200, beyond every f32, so +inf and NaN order above any finite
/// value and -inf below, and the word stays finite (the agreement's sums stay exact). A power of
/// two: its low mantissa bits are free for the rank too.
const BEYOND: f64 = f64::from_bits((1023 + 200) << 52);

/// `value` of `rank` as one f64 whose maximum over ranks gives the largest value and the lowest
/// rank holding it ([`unranked`] reads both back). The value is rounded to the nearest f32; NaN
/// counts as +inf (an `exp` of NaN is no better than an overflow). `rank` < [`MAX_RANKS`].
pub fn ranked(value: f64, rank: usize) -> f64 {
    assert!(rank < MAX_RANKS, "ranked: rank {rank} beyond {MAX_RANKS}");
    let v = if value.is_nan() { f32::INFINITY } else { value as f32 };
    let base = if v.is_finite() { v as f64 } else { BEYOND.copysign(v as f64) };
    // A positive value is larger with larger low bits, a negative one smaller: the lowest rank
    // gets the largest word either way.
    let low = if base.is_sign_negative() { rank as u64 } else { RANK_MASK - rank as u64 };
    f64::from_bits(base.to_bits() | low)
}

/// The (value, rank) of a word made by [`ranked`] (or the maximum of several).
pub fn unranked(word: f64) -> (f64, usize) {
    let bits = word.to_bits();
    let low = bits & RANK_MASK;
    let base = f64::from_bits(bits & !RANK_MASK);
    let rank = if base.is_sign_negative() { low } else { RANK_MASK - low } as usize;
    let value = if base.abs() >= BEYOND { f64::INFINITY.copysign(base) } else { base };
    (value, rank)
}

/// The updates a trend needs: least squares over the last `DEFAULT_WINDOW` agreed values (4: a
/// trend of 3 updates took the first updates' transient of the controls below for a climb, see
/// [`Rule::default_for`]).
pub const DEFAULT_WINDOW: usize = 4;

/// The agreed maxima of one quantity over the last updates, and the forecast they give.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "Stored")]
pub struct Forecast {
    window: usize,
    recent: VecDeque<f64>,
}

/// A forecast as a checkpoint holds it, read back with [`Forecast::new`]'s clamp (a window of at
/// least 2) and the window's newest values only.
#[derive(Deserialize)]
struct Stored {
    window: usize,
    recent: VecDeque<f64>,
}

impl From<Stored> for Forecast {
    fn from(s: Stored) -> Forecast {
        let mut f = Forecast::new(s.window);
        let skip = s.recent.len().saturating_sub(f.window);
        f.recent.extend(s.recent.into_iter().skip(skip));
        f
    }
}

/// One update's value against its ceiling, and the forecast.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outlook {
    /// The agreed maximum.
    pub value: f64,
    /// The ceiling.
    pub limit: f64,
    /// `limit - value` (<= 0: at or past the ceiling; -inf for a value of +inf or NaN, +inf for
    /// -inf: nothing was watched).
    pub headroom: f64,
    /// Updates until the value reaches the ceiling at the trend's slope (`headroom / slope`, 0 at
    /// or past it); `None` without a rising trend (fewer than `window` finite values yet, or a
    /// slope <= 0).
    pub updates: Option<f64>,
}

impl Forecast {
    /// An empty forecast over `window` updates (at least 2).
    pub fn new(window: usize) -> Forecast {
        Forecast { window: window.max(2), recent: VecDeque::with_capacity(window.max(2)) }
    }

    /// The least-squares slope per update of the window, once it is full.
    fn slope(&self) -> Option<f64> {
        let n = self.recent.len();
        if n < self.window {
            return None;
        }
        let mid = (n - 1) as f64 / 2.0;
        let (mut num, mut den) = (0.0, 0.0);
        for (i, y) in self.recent.iter().enumerate() {
            let dx = i as f64 - mid;
            num += dx * y;
            den += dx * dx;
        }
        Some(num / den)
    }

    /// Feed the agreed maximum of the next update against `limit`; its outlook. A value of +inf or
    /// NaN (the quantity overflowed, or is NaN) has no headroom; -inf (no rank watched anything
    /// this update) has all of it. Neither enters the trend.
    pub fn observe(&mut self, value: f64, limit: f64) -> Outlook {
        if !value.is_finite() {
            let (headroom, updates) =
                if value == f64::NEG_INFINITY { (f64::INFINITY, None) } else { (f64::NEG_INFINITY, Some(0.0)) };
            return Outlook { value, limit, headroom, updates };
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(value);
        let headroom = limit - value;
        let updates = if headroom <= 0.0 { Some(0.0) } else { self.slope().filter(|&s| s > 0.0).map(|s| headroom / s) };
        Outlook { value, limit, headroom, updates }
    }
}

/// What an outlook calls for (the `action` of a `warnings.jsonl` line: "warn" or "stop").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Alert {
    /// Tell the user.
    Warn,
    /// Stop before the update that would overflow (where the policy says stop; else a warning).
    Stop,
}

/// When an outlook warns and when it stops: the forecast at or under a number of updates, or the
/// headroom under a number of nats (0 turns a test off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rule {
    /// Warn when the forecast is at most this many updates.
    pub warn_updates: f64,
    /// Warn when the headroom is under this.
    pub warn_headroom: f64,
    /// Stop when the forecast is at most this many updates.
    pub stop_updates: f64,
    /// Stop when the headroom is under this.
    pub stop_headroom: f64,
}

impl Rule {
    /// The defaults for a ceiling `limit`, chosen on the k3 exponent `ref - logp` measured per update
    /// (the agreed maximum over 2 ranks) in TRL's GRPOTrainer (python/examples/trl_grpo.py) and in
    /// the plain PyTorch GRPO loop (python/examples/grpo_loop.py), seeds 0-4 (the tables per seed,
    /// stale runs and controls: docs/hf-trainer.md for TRL, docs/pytorch.md for the loop, where the
    /// thresholds are explained; both printed by `python python/bench/early_warning.py`): on stale rollouts it
    /// overflows float32 at updates 7-9 (TRL) and 7-8 (the loop); the on-policy
    /// (`--num-iterations 1`) and plain-k3 (`--no-kl-bias-correction`) controls stay below 25.
    /// - warn at a forecast of 7 updates or fewer: the stale runs' first warning came 4-5 (TRL) and
    ///   3-5 (the loop) updates before the overflow; the controls' shortest forecast was 13.7 (TRL)
    ///   and 12.0 (the loop) updates, so none warned;
    /// - stop at 3.5 updates or fewer: the slope over 4 updates lags an accelerating climb (from one
    ///   update to the next the increase grew up to 1.9x), so a forecast of 3.5 may be 1.8 updates
    ///   in truth, which still leaves the update after the stop finite; the stops came 2-4 updates
    ///   before the overflow, at exponents of 45-64;
    /// - the headroom: warn under 22.5% of the ceiling (20 nats for float32, the runtime's
    ///   `warn.headroom`), stop under 10% (8.9 nats): the backstop for a climb too slow or too noisy
    ///   to make a trend.
    pub fn default_for(limit: f64) -> Rule {
        Rule { warn_updates: 7.0, warn_headroom: 0.225 * limit, stop_updates: 3.5, stop_headroom: 0.1 * limit }
    }

    /// The alert `o` calls for, if any.
    pub fn alert(&self, o: &Outlook) -> Option<Alert> {
        let within = |updates: f64, headroom: f64| {
            o.headroom < headroom || o.updates.is_some_and(|u| u <= updates) || o.headroom == f64::NEG_INFINITY
        };
        if within(self.stop_updates, self.stop_headroom) {
            Some(Alert::Stop)
        } else if within(self.warn_updates, self.warn_headroom) {
            Some(Alert::Warn)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_per_dtype() {
        let c = |d| exp_ceiling(d).unwrap();
        assert!((c("float32") - 88.7228).abs() < 1e-4);
        assert!((c("bfloat16") - 88.7189).abs() < 1e-4);
        assert!((c("float16") - 11.0899).abs() < 1e-4);
        assert!((c("float64") - 709.7827).abs() < 1e-4);
        assert_eq!(exp_ceiling("int8"), None);
        // Just under the ceiling exp is finite; just over, it is not.
        assert!((c("float32") as f32 - 1e-4).exp().is_finite() && !(c("float32") as f32 + 1e-4).exp().is_finite());
    }

    #[test]
    fn ranked_maximum_names_the_value_and_its_lowest_rank() {
        let words = |vals: &[f64]| vals.iter().enumerate().map(|(r, &v)| ranked(v, r)).collect::<Vec<_>>();
        let max = |w: &[f64]| w.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(unranked(max(&words(&[12.5, 98.875, 3.0]))), (98.875, 1));
        // Ties go to the lowest rank, for positive and negative values alike.
        assert_eq!(unranked(max(&words(&[1.0, 7.0, 7.0, 7.0]))), (7.0, 1));
        assert_eq!(unranked(max(&words(&[-2.5, -2.5, -3.0]))), (-2.5, 0));
        assert_eq!(unranked(max(&words(&[-0.0, 0.0]))), (0.0, 1));
        // Non-finite values: NaN and +inf above every finite value, -inf below; the words finite.
        let w = words(&[f64::NEG_INFINITY, 88.0, f64::NAN, f64::INFINITY]);
        assert!(w.iter().all(|x| x.is_finite()));
        assert_eq!(unranked(max(&w)), (f64::INFINITY, 2));
        assert_eq!(unranked(ranked(f64::NEG_INFINITY, 5)), (f64::NEG_INFINITY, 5));
        // Rounded to f32; a float32 value is exact, and the last rank fits.
        assert_eq!(unranked(ranked(0.1f32 as f64, MAX_RANKS - 1)), (0.1f32 as f64, MAX_RANKS - 1));
        assert_eq!(unranked(ranked(0.1, 0)).0, 0.1f32 as f64);
    }

    /// TRL's k3 exponent, seed 0 (docs/hf-trainer.md): the agreed maxima of updates 0-6; update 7
    /// overflowed (99.3).
    const SEED0: [f64; 7] = [0.0, 12.3, 19.8, 28.7, 45.3, 64.4, 82.2];

    #[test]
    fn forecast_from_the_least_squares_trend() {
        let limit = exp_ceiling("float32").unwrap();
        let mut f = Forecast::new(DEFAULT_WINDOW);
        let out: Vec<Outlook> = SEED0.iter().map(|&x| f.observe(x, limit)).collect();
        assert_eq!(out[..3].iter().map(|o| o.updates).collect::<Vec<_>>(), [None; 3], "no trend before 4 updates");
        // Update 4: least squares over 12.3, 19.8, 28.7, 45.3: (3 x 33.0 + 8.9) / 10 = 10.79 per
        // update, 43.4 nats to go.
        let u4 = out[4].updates.unwrap();
        assert!((u4 - (limit - 45.3) / 10.79).abs() < 1e-9, "{u4}");
        let rule = Rule::default_for(limit);
        let alerts: Vec<Option<Alert>> = out.iter().map(|o| rule.alert(o)).collect();
        assert_eq!(
            alerts,
            [None, None, None, Some(Alert::Warn), Some(Alert::Warn), Some(Alert::Stop), Some(Alert::Stop)]
        );
        // A falling or flat trend forecasts nothing; a value at the ceiling is 0 updates away.
        let mut g = Forecast::new(3);
        for x in [12.3, 11.9, 9.8] {
            assert_eq!(g.observe(x, limit).updates, None);
        }
        assert_eq!(g.observe(89.0, limit).updates, Some(0.0));
    }

    #[test]
    fn non_finite_values_have_no_headroom_and_stay_out_of_the_trend() {
        let mut f = Forecast::new(3);
        for x in [10.0, 20.0] {
            f.observe(x, 88.0);
        }
        let o = f.observe(f64::INFINITY, 88.0);
        assert_eq!((o.headroom, o.updates), (f64::NEG_INFINITY, Some(0.0)));
        assert_eq!(Rule::default_for(88.0).alert(&o), Some(Alert::Stop));
        assert_eq!(f.observe(f64::NAN, 88.0).headroom, f64::NEG_INFINITY);
        // -inf: nothing was watched: all the headroom, no alert.
        let o = f.observe(f64::NEG_INFINITY, 88.0);
        assert_eq!((o.headroom, o.updates, Rule::default_for(88.0).alert(&o)), (f64::INFINITY, None, None));
        // The window still holds 10 and 20: a third finite value completes it.
        assert_eq!(f.observe(30.0, 88.0).updates, Some(58.0 / 10.0));
    }

    #[test]
    fn state_round_trips_and_continues_the_stream() {
        let mut a = Forecast::new(3);
        let all: Vec<Outlook> = SEED0.iter().map(|&x| a.observe(x, 88.7)).collect();
        let mut b = Forecast::new(3);
        let mut out: Vec<Outlook> = SEED0[..4].iter().map(|&x| b.observe(x, 88.7)).collect();
        let mut c: Forecast = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        out.extend(SEED0[4..].iter().map(|&x| c.observe(x, 88.7)));
        assert_eq!(out, all);
        // A stored window under 2, or longer than its window, reads back clamped: no panic.
        let d: Forecast = serde_json::from_str(r#"{"window":0,"recent":[]}"#).unwrap();
        assert_eq!(d, Forecast::new(2));
        let mut e: Forecast = serde_json::from_str(r#"{"window":2,"recent":[1.0,2.0,3.0]}"#).unwrap();
        assert_eq!(e.observe(4.0, 88.7).updates, Some(88.7 - 4.0), "the window holds 2, 3");
    }
}
