//! The progress hook of the supervision loop.
//!
//! While a job runs, [`crate::supervise::supervise`] calls [`Progress::tick`] about every
//! [`TICK`] on the launcher's main thread, and [`Progress::finish`] once when every process is gone.
//! A source that reads the shared-memory header (heartbeats, step counters) will implement it and
//! draw a line or a bar on stderr; [`Silent`], the default, draws nothing. `tick` must return quickly
//! (it delays failure detection by as long as it runs) and must not panic.

use std::time::Duration;

/// How often [`Progress::tick`] is called.
pub const TICK: Duration = Duration::from_millis(500);

/// A progress display fed by the supervision loop.
pub trait Progress {
    /// Called about every [`TICK`] while processes run; `elapsed` is the time since the first spawn,
    /// `live` the number of processes still running.
    fn tick(&mut self, elapsed: Duration, live: usize);

    /// Called once after the last process exited, before the failure summary is printed.
    fn finish(&mut self) {}
}

/// Draws nothing.
#[derive(Debug, Default)]
pub struct Silent;

impl Progress for Silent {
    fn tick(&mut self, _elapsed: Duration, _live: usize) {}
}
