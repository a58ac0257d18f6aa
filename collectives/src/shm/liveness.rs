//! Process liveness and clocks: whether a peer process still runs (a zombie counts as dead, a
//! reused pid is told apart by its start time), and the monotonic clock of heartbeats.

use std::io;

/// Nanoseconds of CLOCK_MONOTONIC (shared by every process of the machine): the clock of heartbeats.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// State character and start time of a process, from `/proc/PID/stat`.
pub(super) fn proc_stat(pid: u64) -> io::Result<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let mut it = rest.split_whitespace();
    let state = it.next().and_then(|f| f.chars().next()).unwrap_or('?');
    let start = it.nth(18).and_then(|f| f.parse().ok()).unwrap_or(0);
    Ok((state, start))
}

/// Whether process `pid` (started at `start`, 0 = unknown) still runs. A zombie counts as dead: a
/// killed rank stays a zombie until its parent reaps it, and must not look alive meanwhile.
pub(super) fn process_alive(pid: u64, start: u64) -> bool {
    if pid == 0 || pid > i32::MAX as u64 {
        return false;
    }
    match proc_stat(pid) {
        Ok((state, st)) => !matches!(state, 'Z' | 'X' | 'x') && (start == 0 || st == 0 || st == start),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(_) => {
            // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
            let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
            r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
        }
    }
}

pub(super) fn self_start_time() -> u64 {
    proc_stat(std::process::id() as u64).map(|(_, s)| s).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_of_self_and_of_a_reaped_child() {
        assert!(process_alive(std::process::id() as u64, self_start_time()));
        assert!(!process_alive(std::process::id() as u64, self_start_time() + 1), "pid reuse is told apart");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as u64;
        // Not reaped yet: a zombie once it exits; dead either way after the wait.
        child.wait().unwrap();
        assert!(!process_alive(pid, 0));
        assert!(!process_alive(0, 0));
    }
}
