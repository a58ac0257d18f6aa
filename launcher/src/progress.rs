//! The progress display of the supervision loop ([`ProgressDisplay`]), and the display that reads the bus's header.
//!
//! While a job runs, [`crate::supervise::supervise`] calls [`ProgressDisplay::tick`] about every
//! [`TICK`] on the launcher's main thread, and [`ProgressDisplay::finish`] once when every process is gone.
//! `tick` must return quickly (it delays failure detection by as long as it runs) and must not panic.
//! [`Silent`] draws nothing.
//!
//! [`ShmDisplay`] reads every rank's published progress from the job's segments
//! (`gradbus_collectives::read_progress`, a read-only peek that never attaches) and shows the
//! slowest rank's step, the step rate, and the latest agreed loss, gradient norm and skip count:
//! - when stderr is a terminal, as an `indicatif` bar on stderr. Worker lines are written through
//!   [`with_console`], which lifts the bar while a line is written, so lines and bar never mix;
//! - otherwise (a log file, a pipe, CI), as one plain `gradbus: progress: ...` line on stderr every
//!   [`PLAIN_EVERY`], and only while a segment can be read: the workers' own per-step lines already
//!   tell the story, the plain line adds the slowest rank and the rate. stdout is never touched, so
//!   what the workers print there stays exactly theirs.
//!
//! Per-rank heartbeat staleness is not shown: the heartbeats are readable (`read_status`'s
//! `heartbeat_ns`, against `monotonic_ns()`), but the bar reads only `read_progress`. A segment that does not exist (before the bus opens, after it closes, the
//! remote nodes of an `mpirun` job, a fake worker) simply contributes nothing.

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use gradbus_collectives::Progress;

/// How often [`ProgressDisplay::tick`] is called.
pub const TICK: Duration = Duration::from_millis(500);

/// Interval of the plain progress lines when stderr is not a terminal.
pub const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// Time span over which the step rate is measured.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// A progress display fed by the supervision loop.
pub trait ProgressDisplay {
    /// Called about every [`TICK`] while processes run; `elapsed` is the time since the first spawn,
    /// `live` the number of processes still running.
    fn tick(&mut self, elapsed: Duration, live: usize);

    /// Called once after the last process exited, before the failure summary is printed.
    fn finish(&mut self) {}
}

/// Draws nothing.
#[derive(Debug, Default)]
pub struct Silent;

impl ProgressDisplay for Silent {
    fn tick(&mut self, _elapsed: Duration, _live: usize) {}
}

/// The bar currently drawn, if any: console writers lift it while they write.
static BAR: Mutex<Option<indicatif::ProgressBar>> = Mutex::new(None);

/// Runs `write` (which writes whole lines to stdout or stderr) with the progress bar lifted, so a
/// line never lands in the middle of the bar. Without a bar it just runs `write`.
pub fn with_console<R>(write: impl FnOnce() -> R) -> R {
    let bar = BAR.lock().ok().and_then(|b| b.clone());
    match bar {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

/// What all ranks published, summed up for one display.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Snapshot {
    /// Ranks read.
    pub ranks: usize,
    /// The slowest rank's step.
    pub step_min: u64,
    /// The fastest rank's step.
    pub step_max: u64,
    /// Loss of the latest update (agreed: the same on every rank that published it).
    pub loss: f32,
    /// Global gradient norm of the latest update.
    pub grad_norm: f32,
    /// Updates skipped so far.
    pub skipped: u32,
    /// Updates that warned of an exp overflow ahead (`warn.*`: the headroom, or its forecast; one
    /// line each in warnings.jsonl), the highest count.
    pub warnings: u32,
}

impl Snapshot {
    /// Sums up the ranks' progress; `None` when there is none. Loss and norm come from a rank at the
    /// highest step (the latest values); skips are the highest count.
    pub fn of(ranks: &[Progress]) -> Option<Snapshot> {
        let latest = ranks.iter().max_by_key(|p| p.step)?;
        Some(Snapshot {
            ranks: ranks.len(),
            step_min: ranks.iter().map(|p| p.step).min().unwrap_or(0),
            step_max: latest.step,
            loss: latest.loss,
            grad_norm: latest.grad_norm,
            skipped: ranks.iter().map(|p| p.skipped).max().unwrap_or(0),
            warnings: ranks.iter().map(|p| p.warnings).max().unwrap_or(0),
        })
    }

    /// The figures after the step, e.g. `0.85 steps/s  loss 0.1234  grad norm 0.456  skipped 0`.
    pub fn figures(&self, rate: Option<f64>) -> String {
        let rate = rate.map_or_else(|| "- steps/s".to_string(), |r| format!("{r:.2} steps/s"));
        let spread = if self.step_max > self.step_min {
            format!("  (fastest rank at step {})", self.step_max)
        } else {
            String::new()
        };
        let warn = if self.warnings > 0 {
            format!("  WARNING: exp warnings in {} update(s) (warnings.jsonl)", self.warnings)
        } else {
            String::new()
        };
        format!(
            "{rate}  loss {:.4}  grad norm {:.4}  skipped {}{warn}{spread}",
            self.loss, self.grad_norm, self.skipped
        )
    }
}

/// Steps per second of the slowest rank over the last [`RATE_WINDOW`].
#[derive(Debug, Default)]
struct Rate {
    samples: VecDeque<(Duration, u64)>,
}

impl Rate {
    fn push(&mut self, at: Duration, step: u64) -> Option<f64> {
        self.samples.push_back((at, step));
        while self.samples.len() > 2 && at - self.samples[1].0 >= RATE_WINDOW {
            self.samples.pop_front();
        }
        let &(t0, s0) = self.samples.front()?;
        let dt = (at - t0).as_secs_f64();
        (dt >= 1.0).then(|| step.saturating_sub(s0) as f64 / dt)
    }
}

enum Display {
    Bar(indicatif::ProgressBar),
    Plain { last: Option<Duration> },
}

/// The progress display of a job, fed from its shared-memory segments (see the module doc).
pub struct ShmDisplay {
    segments: Vec<PathBuf>,
    total_steps: Option<u64>,
    rate: Rate,
    display: Display,
}

impl ShmDisplay {
    /// A display of the job whose segments are `segments` (one per node on this machine), with
    /// `total_steps` when the config could be read. A bar when stderr is a terminal, else plain lines.
    pub fn new(segments: Vec<PathBuf>, total_steps: Option<u64>) -> ShmDisplay {
        let display = if std::io::stderr().is_terminal() {
            let bar = match total_steps {
                Some(n) => indicatif::ProgressBar::new(n),
                None => indicatif::ProgressBar::new_spinner(),
            };
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            let template = if total_steps.is_some() {
                "{elapsed_precise} [{bar:20}] step {pos}/{len}  {wide_msg}"
            } else {
                "{elapsed_precise} {spinner} step {pos}  {wide_msg}"
            };
            if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message("waiting for the ranks");
            if let Ok(mut slot) = BAR.lock() {
                *slot = Some(bar.clone());
            }
            Display::Bar(bar)
        } else {
            Display::Plain { last: None }
        };
        ShmDisplay { segments, total_steps, rate: Rate::default(), display }
    }

    /// Every rank's progress from the segments that can be read now.
    fn read(&self) -> Vec<Progress> {
        self.segments.iter().filter_map(|p| gradbus_collectives::read_progress(p)).flatten().collect()
    }

    /// The plain line for a snapshot.
    fn plain_line(&self, s: &Snapshot, rate: Option<f64>) -> String {
        let total = self.total_steps.map(|n| format!("/{n}")).unwrap_or_default();
        format!("gradbus: progress: step {}{total} (slowest of {} ranks)  {}", s.step_min, s.ranks, s.figures(rate))
    }
}

/// Whether a plain line is due at `elapsed`, the last one having been printed at `last`: every
/// [`PLAIN_EVERY`], the first one only once the ranks have been running that long.
fn plain_due(last: Option<Duration>, elapsed: Duration) -> bool {
    elapsed.saturating_sub(last.unwrap_or(Duration::ZERO)) >= PLAIN_EVERY
}

impl ShmDisplay {
    /// Reads the segments and updates the bar; returns the plain line to print now, if one is due
    /// (and there is something to say).
    fn update(&mut self, elapsed: Duration) -> Option<String> {
        let snapshot = Snapshot::of(&self.read());
        let rate = snapshot.map(|s| self.rate.push(elapsed, s.step_min)).unwrap_or(None);
        let line = snapshot.map(|s| self.plain_line(&s, rate));
        match &mut self.display {
            Display::Bar(bar) => {
                if let Some(s) = snapshot {
                    bar.set_position(s.step_min);
                    bar.set_message(s.figures(rate));
                }
                bar.tick();
                None
            }
            Display::Plain { last } => {
                let line = line.filter(|_| plain_due(*last, elapsed))?;
                *last = Some(elapsed);
                Some(line)
            }
        }
    }
}

impl ProgressDisplay for ShmDisplay {
    fn tick(&mut self, elapsed: Duration, _live: usize) {
        if let Some(line) = self.update(elapsed) {
            eprintln!("{line}");
        }
    }

    fn finish(&mut self) {
        if let Display::Bar(bar) = &self.display {
            if let Ok(mut slot) = BAR.lock() {
                *slot = None;
            }
            bar.finish_and_clear();
        }
    }
}

impl Drop for ShmDisplay {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(step: u64, loss: f32, skipped: u32) -> Progress {
        Progress { step, loss, grad_norm: 0.5, skipped, warnings: 0 }
    }

    #[test]
    fn headroom_warnings_are_marked() {
        assert!(!Snapshot::of(&[p(3, 0.1, 0)]).unwrap().figures(None).contains("WARNING"));
        let warned = Progress { warnings: 4, ..p(3, 0.1, 0) };
        let text = Snapshot::of(&[p(3, 0.1, 0), warned]).unwrap().figures(None);
        assert!(text.contains("WARNING: exp warnings in 4 update(s) (warnings.jsonl)"), "{text}");
    }

    #[test]
    fn snapshot_takes_the_slowest_step_and_the_latest_values() {
        assert_eq!(Snapshot::of(&[]), None);
        let s = Snapshot::of(&[p(7, 0.1, 1), p(8, 0.2, 2), p(7, 0.1, 1)]).unwrap();
        assert_eq!((s.ranks, s.step_min, s.step_max, s.loss, s.skipped), (3, 7, 8, 0.2, 2));
        let text = s.figures(Some(1.5));
        assert!(text.contains("1.50 steps/s") && text.contains("loss 0.2000"), "{text}");
        assert!(text.contains("skipped 2") && text.contains("fastest rank at step 8"), "{text}");
        assert!(Snapshot::of(&[p(3, 0.0, 0)]).unwrap().figures(None).starts_with("- steps/s"));
    }

    #[test]
    fn rate_is_measured_over_the_window() {
        let mut r = Rate::default();
        let s = |x: f64| Duration::from_secs_f64(x);
        assert_eq!(r.push(s(0.0), 0), None);
        assert_eq!(r.push(s(0.5), 1), None);
        assert_eq!(r.push(s(2.0), 4), Some(2.0));
        for i in 3..40 {
            r.push(s(i as f64), 2 * i);
        }
        // Only the last ~10 s count, at 2 steps per second.
        assert!((r.push(s(40.0), 80).unwrap() - 2.0).abs() < 1e-9);
        assert!(r.samples.len() <= 13, "{}", r.samples.len());
    }

    #[test]
    fn plain_lines_come_every_ten_seconds_from_the_tenth_on() {
        let s = |x: u64| Duration::from_secs(x);
        assert!(!plain_due(None, s(0)) && !plain_due(None, s(9)));
        assert!(plain_due(None, s(10)));
        assert!(!plain_due(Some(s(10)), s(19)) && plain_due(Some(s(10)), s(20)));
    }

    #[test]
    fn missing_segments_show_nothing_and_do_not_fail() {
        let dir = tempfile::tempdir().unwrap();
        let segments = vec![dir.path().join("gradbus-none-n0")];
        let mut progress = ShmDisplay {
            segments,
            total_steps: Some(10),
            rate: Rate::default(),
            display: Display::Plain { last: None },
        };
        assert!(progress.read().is_empty());
        for i in 0..30 {
            assert_eq!(progress.update(Duration::from_secs(i)), None, "a line at {i} s from no segment");
        }
        assert!(progress.rate.samples.is_empty(), "no rate from nothing");
        progress.finish();
    }
}
