//! The bus's barrier: per-rank arrival counters with a tag of what each rank is doing, a wait that
//! spins, then yields, then sleeps on the header's futex, and polls the liveness of the ranks it
//! waits for. Every rank compares every tag after a barrier, so a mismatch fails every rank alike;
//! a dead peer ends the wait with `PeerFailed`, a stalled one with `Timeout` at the deadline.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::bus::ShmBus;
use super::liveness::{monotonic_ns, process_alive};
use super::segment::WakeLine;
use super::{FAIL_ERROR, NONE, ST_ATTACHED, ST_DEPARTED, WAKE_OFF, YIELD_FOR};
use crate::verdict::StepId;
use crate::Error;

/// Sixteen bytes of a phase name, as two words (longer names are cut).
pub(super) fn phase_words(phase: &str) -> [u64; 2] {
    let mut b = [0u8; 16];
    let n = phase.len().min(16);
    b[..n].copy_from_slice(&phase.as_bytes()[..n]);
    [u64::from_le_bytes(b[..8].try_into().unwrap()), u64::from_le_bytes(b[8..].try_into().unwrap())]
}

/// The five words of a barrier tag: phase name, step, minibatch and attempt, bucket.
pub(super) fn tag_words(phase: &str, at: StepId, bucket: Option<usize>) -> [u64; 5] {
    let [p0, p1] = phase_words(phase);
    [p0, p1, at.step, (at.minibatch as u64) << 32 | at.attempt as u64, bucket.map_or(NONE, |b| b as u64)]
}

pub(super) fn describe_tag(t: &[u64; 5]) -> String {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&t[0].to_le_bytes());
    b[8..].copy_from_slice(&t[1].to_le_bytes());
    let name = String::from_utf8_lossy(&b).trim_end_matches('\0').to_string();
    let bucket = if t[4] == NONE { String::new() } else { format!(" bucket #{}", t[4]) };
    format!("{name} at step {} (minibatch {}, attempt {}){bucket}", t[2], t[3] >> 32, t[3] & 0xffff_ffff)
}

impl ShmBus {
    /// Wait until every local rank has entered this barrier (or fail: `Timeout` naming the missing
    /// ranks, `PeerFailed` as soon as one of them is dead or failed, `Mismatch` when the ranks are
    /// in different phases). For startup and shutdown; the collectives use it internally.
    pub fn barrier(&mut self, phase: &str, at: StepId) -> Result<(), Error> {
        self.barrier_tagged(phase, at, None)
    }

    pub(super) fn wake_line(&self) -> &WakeLine {
        // SAFETY: WAKE_OFF + size_of::<WakeLine>() <= HEADER_BYTES, inside the mapping, 64-byte
        // aligned; two atomics, valid for any bits.
        unsafe { &*self.map.as_ptr().add(WAKE_OFF).cast::<WakeLine>() }
    }

    /// Bump the futex word and wake every sleeper (if any may sleep). Called when this rank's
    /// arrival completed a barrier, and when it fails or leaves.
    pub(super) fn wake_all(&self) {
        let w = self.wake_line();
        w.seq.fetch_add(1, Ordering::SeqCst);
        if w.sleepers.load(Ordering::SeqCst) > 0 {
            // SAFETY: FUTEX_WAKE on a valid, 4-byte aligned word of a shared mapping; no other
            // memory is touched. Shared (not PRIVATE) futex: the waiters are other processes.
            unsafe { libc::syscall(libc::SYS_futex, w.seq.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
        }
    }

    /// Sleep until the futex word moves away from `seen` or `max` passes (spurious wake-ups are fine:
    /// the caller re-checks).
    pub(super) fn futex_sleep(&self, seen: u32, max: Duration) {
        let ts = libc::timespec { tv_sec: max.as_secs() as libc::time_t, tv_nsec: max.subsec_nanos() as libc::c_long };
        // SAFETY: FUTEX_WAIT on a valid, 4-byte aligned word of a shared mapping with a valid
        // relative timeout; it returns at once if the word no longer holds `seen`.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.wake_line().seq.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                0usize,
                0u32,
            )
        };
    }

    pub(super) fn all_arrived(&self, k: u64) -> bool {
        (0..self.geo.n).all(|j| self.cell(j).arrive.load(Ordering::SeqCst) >= k)
    }

    /// Barrier with a tag naming what this rank is doing; see `barrier`.
    pub(super) fn barrier_tagged(&mut self, phase: &str, at: StepId, bucket: Option<usize>) -> Result<(), Error> {
        let k = self.barriers + 1;
        self.barriers = k;
        let me = self.cfg.local_rank;
        let tag = tag_words(phase, at, bucket);
        {
            let c = self.cell(me);
            for (w, v) in c.tags[(k % 2) as usize].iter().zip(tag) {
                w.store(v, Ordering::Relaxed);
            }
            c.heartbeat_ns.store(monotonic_ns(), Ordering::Relaxed);
            // SeqCst pairs with the failed-flag protocol and the futex protocol in `wait_all`.
            c.arrive.store(k, Ordering::SeqCst);
        }
        if self.all_arrived(k) {
            self.wake_all();
        }
        // Tags before failed flags: a mismatch is seen by every rank alike, even though the first
        // rank to see it sets its failed flag.
        let r = self
            .wait_all(k, phase, at, bucket)
            .and_then(|()| self.check_tags(k, &tag))
            .and_then(|()| self.check_no_failed(k, phase, at, bucket));
        if let Err(e) = &r {
            let blame = match e {
                Error::PeerFailed { rank, .. } => *rank,
                Error::Timeout { missing, .. } => missing.first().copied().unwrap_or(me),
                _ => me,
            };
            self.set_failed(FAIL_ERROR, k, blame);
        }
        r
    }

    /// Raise this rank's failed flag: it will not pass barrier `at_barrier`, because of `blame`.
    pub(super) fn set_failed(&self, reason: u64, at_barrier: u64, blame: usize) {
        let c = self.cell(self.cfg.local_rank);
        c.failed_at.store(at_barrier, Ordering::Relaxed);
        c.blame.store(blame as u64, Ordering::Relaxed);
        c.failed.store(reason, Ordering::SeqCst);
        self.wake_all();
    }

    /// The rank to name when rank `j` has failed: the root cause it recorded, unless that is us.
    pub(super) fn culprit(&self, j: usize) -> usize {
        let blame = self.cell(j).blame.load(Ordering::Relaxed) as usize;
        if blame < self.geo.n && blame != self.cfg.local_rank {
            blame
        } else {
            j
        }
    }

    /// Wait until every rank's arrival counter is at least `k`.
    pub(super) fn wait_all(&self, k: u64, phase: &str, at: StepId, bucket: Option<usize>) -> Result<(), Error> {
        let n = self.geo.n;
        let start = Instant::now();
        let deadline = start + self.cfg.timeout;
        let mut next_check = start;
        let mut spins = 0u32;
        let mut first_missing = 0;
        loop {
            // Resume the scan at the first rank that was missing last time.
            while first_missing < n && self.cell(first_missing).arrive.load(Ordering::SeqCst) >= k {
                first_missing += 1;
            }
            if first_missing == n {
                return Ok(());
            }
            spins += 1;
            if spins < 200 {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now >= next_check {
                next_check = now + Duration::from_millis(2);
                for j in first_missing..n {
                    let c = self.cell(j);
                    if c.arrive.load(Ordering::SeqCst) >= k {
                        continue;
                    }
                    // What ends the wait first, the arrival again last: a peer may arrive, pass
                    // this barrier (we arrived already) and leave or fail at a later one between
                    // two loads. It stores its arrival before its departure or failed flag, so an
                    // arrival loaded after them is seen, and such a peer is not taken for gone.
                    let failed = c.failed.load(Ordering::SeqCst) != 0;
                    let pid = c.pid.load(Ordering::Acquire);
                    let state = c.state.load(Ordering::SeqCst);
                    let gone = state == ST_DEPARTED
                        || (state == ST_ATTACHED && !process_alive(pid, c.start_time.load(Ordering::Relaxed)));
                    #[cfg(test)]
                    if let Some(hook) = &self.in_liveness_check {
                        hook(j);
                    }
                    if !(failed || gone) || c.arrive.load(Ordering::SeqCst) >= k {
                        continue;
                    }
                    let rank = if failed { self.culprit(j) } else { j };
                    return Err(self.peer_failed(rank, phase, at, bucket));
                }
                if now >= deadline {
                    let missing =
                        (0..n).filter(|&j| self.cell(j).arrive.load(Ordering::SeqCst) < k).collect::<Vec<_>>();
                    if missing.is_empty() {
                        continue;
                    }
                    return Err(Error::Timeout {
                        phase: phase.to_string(),
                        step: at.step,
                        bucket,
                        missing,
                        secs: self.cfg.timeout.as_secs_f64(),
                    });
                }
            }
            // Spin briefly, then yield: ranks may outnumber cores, and a spinning waiter would
            // steal the core of the rank it waits for. Then sleep on the futex until the rank
            // that completes the barrier wakes us (or the next liveness check is due).
            if now.duration_since(start) < YIELD_FOR {
                // SAFETY: sched_yield has no preconditions.
                unsafe { libc::sched_yield() };
            } else {
                // Futex protocol: announce the sleeper, read the word, re-check the arrivals, then
                // sleep only if the word is unchanged. An arrival that completes the barrier
                // bumps the word after its SeqCst store; if our re-check missed that store, our
                // read of the word came before the bump, so the sleep returns at once or is woken.
                let w = self.wake_line();
                w.sleepers.fetch_add(1, Ordering::SeqCst);
                let seen = w.seq.load(Ordering::SeqCst);
                if !self.all_arrived(k) {
                    let max = next_check.min(deadline).saturating_duration_since(Instant::now());
                    self.futex_sleep(seen, max.max(Duration::from_micros(10)));
                }
                w.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// After barrier `k`: a rank that gave up in it (it arrived, then failed before passing) is not
    /// taking part in the reduce we are about to run; stop instead of writing into its slot. A rank
    /// that failed at a LATER barrier passed this one and is no reason to stop here (the next
    /// barrier names the real culprit).
    pub(super) fn check_no_failed(&self, k: u64, phase: &str, at: StepId, bucket: Option<usize>) -> Result<(), Error> {
        for j in 0..self.geo.n {
            let c = self.cell(j);
            if j != self.cfg.local_rank
                && c.failed.load(Ordering::SeqCst) != 0
                && c.failed_at.load(Ordering::Relaxed) <= k
            {
                return Err(self.peer_failed(self.culprit(j), phase, at, bucket));
            }
        }
        Ok(())
    }

    pub(super) fn peer_failed(&self, rank: usize, phase: &str, at: StepId, bucket: Option<usize>) -> Error {
        let phase = match bucket {
            Some(b) => format!("{phase} (bucket #{b})"),
            None => phase.to_string(),
        };
        Error::PeerFailed { rank, phase, step: at.step }
    }

    /// Every rank compares every rank's tag of barrier `k`: all see the same tags, so all fail alike.
    pub(super) fn check_tags(&self, k: u64, mine: &[u64; 5]) -> Result<(), Error> {
        for j in 0..self.geo.n {
            let t: [u64; 5] = std::array::from_fn(|i| self.cell(j).tags[(k % 2) as usize][i].load(Ordering::Relaxed));
            if &t != mine {
                return Err(Error::Mismatch { rank: j, theirs: describe_tag(&t), mine: describe_tag(mine) });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that arrives, passes the barrier and leaves while a waiting rank checks its
    /// liveness is not taken for gone: the waiter sees its arrival (a race seen in CI, where a
    /// rank of the reduce test failed the last barrier naming a peer that had passed it).
    #[test]
    fn a_peer_that_passes_and_leaves_during_a_liveness_check_is_not_taken_for_gone() {
        use crate::shm::BusConfig;
        use crate::{Layout, ParamSpec};
        use std::sync::{mpsc, Mutex};
        let dir = tempfile::tempdir().unwrap();
        let job = format!("race{}", std::process::id());
        let config = |rank| {
            let mut c = BusConfig::new(job.clone(), rank, 2, Layout::new(&[ParamSpec::new("w", 64)], 0));
            c.shm_dir = dir.path().to_path_buf();
            c.timeout = Duration::from_secs(20);
            c
        };
        let (go, go_rx) = mpsc::channel::<()>();
        let (done, done_rx) = mpsc::channel::<()>();
        let cfg0 = config(0);
        let rank0 = std::thread::spawn(move || -> Result<(), Error> {
            let mut bus = ShmBus::open(cfg0)?;
            go_rx.recv().unwrap();
            bus.barrier("end", StepId::default())?;
            drop(bus);
            done.send(()).unwrap();
            Ok(())
        });
        let mut bus = ShmBus::open(config(1)).unwrap();
        let window = Mutex::new(Some((go, done_rx)));
        bus.in_liveness_check = Some(Box::new(move |j| {
            // Once, for rank 0: let it run its whole barrier and leave inside the window.
            let mut window = window.lock().unwrap();
            if let Some((go, done)) = window.take_if(|_| j == 0) {
                go.send(()).unwrap();
                done.recv().unwrap();
            }
        }));
        let r = bus.barrier("end", StepId::default());
        rank0.join().unwrap().unwrap();
        assert!(r.is_ok(), "{r:?}");
    }

    #[test]
    fn tags_describe_themselves() {
        let t = tag_words("reduce", StepId { step: 7, minibatch: 2, attempt: 1 }, Some(3));
        assert_eq!(describe_tag(&t), "reduce at step 7 (minibatch 2, attempt 1) bucket #3");
        assert_ne!(t, tag_words("reduced", StepId { step: 7, minibatch: 2, attempt: 1 }, Some(3)));
    }
}
