//! The shared-memory bus: `ShmBus`, the `Transport` of the ranks of ONE node, over one segment
//! under `/dev/shm` per job and node.
//!
//! Every local rank's gradient buffer lives inside the segment, so backward writes straight onto the
//! bus. An all-reduce of a bucket is: barrier; rank `r` sums chunk `r` of the bucket over every
//! rank's slot in rank order 0..n-1 (`reduce_in_place`), tallying each source rank's health, and
//! writes the sum back into chunk `r` of every slot; barrier. Every element is summed by exactly one
//! process in one fixed order, so all ranks hold the same bits, run after run.
//!
//! ```text
//!   slot 0  [ c0 | c1 | c2 ]      rank 0 reduces column c0 of all slots  (0+1+2 in that order)
//!   slot 1  [ c0 | c1 | c2 ]      rank 1 reduces column c1, rank 2 column c2
//!   slot 2  [ c0 | c1 | c2 ]      barrier ... reduce my column ... barrier
//! ```
//!
//! Invariants:
//! - Between the two barriers of a bucket reduce, chunk `r` of every slot is touched by rank `r`
//!   only, and no borrow of that bucket's range is alive on any rank: every rank is inside
//!   `allreduce_bucket` (which borrows the bus mutably, so no `grads()` borrow is alive), and a
//!   backward that overlaps the reduce holds views of other buckets only (`grads/host.rs`). That is
//!   what makes the raw slices sound.
//! - A barrier is a per-rank arrival counter: a rank's k-th barrier stores `k`, then waits until
//!   every counter is `>= k`. Each arrival also records what the rank was doing (phase, step,
//!   bucket); after the barrier every rank compares those tags and, on a mismatch, every rank fails
//!   with the same `Error::Mismatch` instead of summing the wrong buckets.
//! - A waiting rank spins briefly, then yields (ranks may outnumber cores: a spinning waiter
//!   steals the core of the rank it waits for), and after `YIELD_FOR` sleeps on a futex in the
//!   header that the rank completing the barrier wakes, so long waits cost no CPU.
//! - A waiting rank polls the liveness of the ranks it is waiting for: failed flag, departed flag,
//!   process gone (or a zombie). A dead peer ends the wait at once with `PeerFailed`; a live but
//!   stalled one with `Timeout` at the deadline. No rank waits forever. A rank that returns any
//!   error sets its failed flag, and every rank checks the flags after each barrier before it
//!   touches another rank's slot, so a late peer does not reduce into the slot of a rank that gave
//!   up (bar a flag set in the instant after that check: a failed rank's gradients are undefined).
//! - The health table and the reports are double-buffered by update parity (the count of `agree`
//!   calls). A rank writes the buffer of update `u + 2` only after a barrier of update `u + 1`, which
//!   every rank reaches only after it has read update `u`. So no rank overwrites what a slow rank
//!   still reads.
//! - The segment's magic is written last (Release); an attacher trusts nothing before it reads the
//!   magic (Acquire). The creator (local rank 0) unlinks the segment when dropped; a segment whose
//!   creator died is stale and replaced by the next creator; `remove_job_segments` is the launcher's
//!   sweep for the kill -9 case.
//!
//! Why not defer the second barrier of a reduce to `agree`: it would save one barrier per bucket,
//! but `grads()` hands out a `&mut [f32]` of the whole slot at any time, and a slow peer could still
//! be writing its chunk into it. Keeping the barrier keeps that borrow sound.

mod barrier;
mod bus;
mod liveness;
mod progress;
mod segment;

pub use bus::ShmBus;
pub use liveness::monotonic_ns;
pub use progress::{read_progress, read_status, remove_job_segments, Progress, ProgressWriter, RankStatus};
pub use segment::BusConfig;

use std::time::Duration;

/// "GRADBUS1" as a little-endian word: the first thing an attacher checks.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GRADBUS1");
/// Version of the segment format; bump on any change to the structures below.
pub const VERSION: u64 = 4;

/// Bytes reserved for the header.
pub(super) const HEADER_BYTES: usize = 4096;
/// Segment regions start on page boundaries.
pub(super) const PAGE: usize = 4096;

/// Offset of the wake line (futex word and sleeper count) inside the header page.
pub(super) const WAKE_OFF: usize = 2048;
/// How long a waiter spins and yields before it sleeps on the futex.
pub(super) const YIELD_FOR: Duration = Duration::from_millis(1);

/// Rank cell states (0: nobody attached yet).
pub(super) const ST_ATTACHED: u64 = 1;
pub(super) const ST_DEPARTED: u64 = 2;

/// Failed-flag values: why a rank stopped.
pub(super) const FAIL_MARKED: u64 = 1;
pub(super) const FAIL_ERROR: u64 = 2;

/// "No bucket" / "no first bad index" in a stored word.
pub(super) const NONE: u64 = u64::MAX;
