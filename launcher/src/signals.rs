//! The launcher's own signal handling: SIGINT, SIGTERM and SIGHUP only bump a counter.
//!
//! The handler (the `ctrlc` crate with its `termination` feature, which runs it on a dedicated thread,
//! not in signal context) does nothing but count; the supervision loop polls the count, forwards
//! SIGTERM to every worker on the first signal and SIGKILL on the second, and the launcher then exits
//! 130. Workers run in their own process groups, so a Ctrl-C at the terminal reaches only the
//! launcher, and teardown is always the launcher's decision.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::Error;

static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// Installs the handler (idempotent: later calls return the first call's result).
pub fn install() -> Result<(), Error> {
    INSTALLED
        .get_or_init(|| {
            ctrlc::set_handler(|| {
                RECEIVED.fetch_add(1, Ordering::SeqCst);
            })
            .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(Error::Signals)
}

/// How many of SIGINT/SIGTERM/SIGHUP the launcher has received so far.
pub fn received() -> usize {
    RECEIVED.load(Ordering::SeqCst)
}

/// The conventional name of a signal number, e.g. `SIGKILL`, or `signal N` for others.
pub fn name(sig: i32) -> String {
    let known = [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGTRAP, "SIGTRAP"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGXFSZ, "SIGXFSZ"),
        (libc::SIGSYS, "SIGSYS"),
    ];
    match known.iter().find(|(n, _)| *n == sig) {
        Some((_, name)) => (*name).to_string(),
        None => format!("signal {sig}"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_common_signals() {
        assert_eq!(super::name(libc::SIGKILL), "SIGKILL");
        assert_eq!(super::name(libc::SIGSEGV), "SIGSEGV");
        assert_eq!(super::name(77), "signal 77");
    }
}
