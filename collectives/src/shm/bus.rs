//! `ShmBus`: one rank's handle on the segment, the bucket reduce and broadcast between two
//! barriers, and the agreement that reads the double-buffered health table (see the invariants in
//! the module above).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use gradbus_kernels::checksum::{combine, finish_all, Checksum};
use gradbus_kernels::{reduce_with_peaks, Health, Peak};
use memmap2::MmapRaw;

use super::liveness::{monotonic_ns, self_start_time};
use super::progress::ProgressWriter;
use super::segment::{
    attach, check_job_id, create, load_health, store_health, BusConfig, Geometry, HealthCell, RankCell,
};
use super::{FAIL_MARKED, ST_ATTACHED, ST_DEPARTED};
use crate::agreement::{peak_of_word, peak_word, BucketStat, LocalScalars, Summary};
use crate::choice::AgreementPath;
use crate::layout::{chunk_range, Layout, ALIGN_FLOATS};
use crate::transport::Transport;
use crate::verdict::{HealthTable, StepId};
use crate::Error;

/// The shared-memory bus of one rank.
pub struct ShmBus {
    pub(super) cfg: BusConfig,
    pub(super) path: PathBuf,
    pub(super) geo: Geometry,
    pub(super) map: MmapRaw,
    /// Kept open: its inode tells our segment apart from a later one with the same name.
    pub(super) file: File,
    pub(super) creator: bool,
    /// Whether this rank's cell is ours (claimed); Drop marks only a claimed cell departed.
    pub(super) claimed: bool,
    /// Barriers entered so far (this rank's arrival counter).
    pub(super) barriers: u64,
    /// `agree` calls so far: the update number, whose parity picks the table buffer.
    pub(super) update: u64,
    /// Summary first (always, unless `GRADBUS_AGREEMENT=table`: see `open`), or always the table.
    pub(super) agreement: AgreementPath,
    /// Called inside every bucket reduce, after every rank entered it and before the sum is
    /// written (the fault plan's `reduce` phase: a rank that dies here dies mid-collective).
    pub(super) inside_reduce: Option<Box<dyn FnMut(StepId, usize) + Send + Sync>>,
    /// Whether a validated reduce also tallies the sources' peaks and hashes its chunk of the sum
    /// (the silent-data-corruption guard's inputs; [`ShmBus::set_sdc_tallies`]).
    sdc_tallies: bool,
    /// Per bucket, this rank's chunk of the sum as its last reduce since the last agreement hashed
    /// it, not yet finished: `agree` finishes them side by side (`checksum::finish_all`: a finish
    /// is 128 dependent steps, one per bucket would cost more than the hashing) and publishes them.
    pending_hashes: Mutex<Vec<Option<Checksum>>>,
    /// Called by a waiting rank in its liveness check of peer `j`, between the loads that can end
    /// the wait and the reload of `j`'s arrival (a test's way to run a peer inside that window).
    #[cfg(test)]
    pub(super) in_liveness_check: Option<Box<dyn Fn(usize) + Send + Sync>>,
}

impl ShmBus {
    /// The segment of a job on a node: `{shm_dir}/gradbus-{job_id}-n{node_id}`.
    pub fn segment_path(shm_dir: &Path, job_id: &str, node_id: usize) -> PathBuf {
        shm_dir.join(format!("gradbus-{job_id}-n{node_id}"))
    }

    /// Open the bus: local rank 0 creates the segment (replacing a stale one), the others attach
    /// when it is initialised; then every local rank meets at the `attach` barrier. Fails within
    /// `cfg.timeout` if a rank does not come.
    pub fn open(cfg: BusConfig) -> Result<ShmBus, Error> {
        check_job_id(&cfg.shm_dir, &cfg.job_id)?;
        // Inside a node the model's choice is always the summary: both paths read the same
        // shared memory, no collective runs, and the table reads every rank's cells besides.
        let agreement = AgreementPath::from_env()?.unwrap_or(AgreementPath::Summary);
        if cfg.local_size == 0 || cfg.local_rank >= cfg.local_size {
            return Err(Error::BadSegment {
                path: ShmBus::segment_path(&cfg.shm_dir, &cfg.job_id, cfg.node_id).display().to_string(),
                reason: format!("local rank {} of {} ranks", cfg.local_rank, cfg.local_size),
                hint: "local_rank must be below local_size".into(),
            });
        }
        let path = ShmBus::segment_path(&cfg.shm_dir, &cfg.job_id, cfg.node_id);
        let geo = Geometry::new(cfg.local_size, cfg.layout.buckets.len(), cfg.layout.len, cfg.values.len());
        let start = Instant::now();
        let (file, map, creator) = if cfg.local_rank == 0 {
            let (f, m) = create(&cfg, &path, &geo)?;
            (f, m, true)
        } else {
            let (f, m) = attach(&cfg, &path, &geo, start)?;
            (f, m, false)
        };
        let pending_hashes = Mutex::new(vec![None; geo.buckets]);
        let mut bus = ShmBus {
            cfg,
            path,
            geo,
            map,
            file,
            creator,
            claimed: false,
            barriers: 0,
            update: 0,
            agreement,
            inside_reduce: None,
            sdc_tallies: true,
            pending_hashes,
            #[cfg(test)]
            in_liveness_check: None,
        };
        bus.claim_cell()?;
        bus.barrier("attach", StepId::default())?;
        Ok(bus)
    }

    /// The segment's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True for the rank that created (and will unlink) the segment.
    pub fn is_creator(&self) -> bool {
        self.creator
    }

    /// This rank's progress cell, for the launcher's progress bar (a mapping of its own).
    pub fn progress_writer(&self) -> Result<ProgressWriter, Error> {
        ProgressWriter::map(&self.file, self.geo.cells + self.cfg.local_rank * size_of::<RankCell>())
    }

    /// Call `hook` inside every bucket reduce, after every rank entered it and before the sum is
    /// written (fault injection: a rank killed there dies mid-collective).
    pub fn set_inside_reduce_hook(&mut self, hook: Box<dyn FnMut(StepId, usize) + Send + Sync>) {
        self.inside_reduce = Some(hook);
    }

    /// Whether validated reduces tally the peaks and hash their chunk of the sum (on by default).
    /// Off (the guard's checks off): the peak words say none and the chunk hashes are 0 (unknown),
    /// the sums and health tallies are the same bits; so that the checks' cost can be measured
    /// against the same run without them.
    pub fn set_sdc_tallies(&mut self, on: bool) {
        self.sdc_tallies = on;
    }

    pub(super) fn cell(&self, k: usize) -> &RankCell {
        assert!(k < self.geo.n);
        // SAFETY: cell k lies in [cells, table) inside the mapping (Geometry), at an offset that is a
        // multiple of 128 (its alignment); it holds only atomics (plus padding never read).
        unsafe { &*self.map.as_ptr().add(self.geo.cells + k * size_of::<RankCell>()).cast::<RankCell>() }
    }

    pub(super) fn entry(&self, parity: u64, bucket: usize, reducer: usize) -> (&AtomicU64, &[HealthCell]) {
        let g = &self.geo;
        assert!(bucket < g.buckets && reducer < g.n);
        let idx = (parity as usize * g.buckets + bucket) * g.n + reducer;
        // SAFETY: entry idx < 2 * buckets * n lies in [table, reports) (Geometry); it is 64-byte
        // aligned and holds a stamp word then n + 2 cells of 4 words, all atomics.
        unsafe {
            let p = self.map.as_ptr().add(g.table + idx * g.entry);
            (&*p.cast::<AtomicU64>(), std::slice::from_raw_parts(p.add(8).cast::<HealthCell>(), g.n + 2))
        }
    }

    /// The words after an entry's health cells: the checksum of the chunk's sum, then one
    /// peak word per source rank.
    pub(super) fn entry_words(&self, parity: u64, bucket: usize, reducer: usize) -> &[AtomicU64] {
        let g = &self.geo;
        assert!(bucket < g.buckets && reducer < g.n);
        let idx = (parity as usize * g.buckets + bucket) * g.n + reducer;
        // SAFETY: as in `entry`: the entry holds, after its stamp and n + 2 cells of 4 words,
        // 1 + n more atomics (`Geometry::entry`).
        unsafe {
            let p = self.map.as_ptr().add(g.table + idx * g.entry + 8 + (g.n + 2) * size_of::<HealthCell>());
            std::slice::from_raw_parts(p.cast::<AtomicU64>(), 1 + g.n)
        }
    }

    pub(super) fn report_cell(&self, parity: u64, k: usize) -> &[AtomicU64] {
        &self.report_words(parity, k)[..LocalScalars::words(self.cfg.values.len())]
    }

    /// Rank `k`'s per-bucket statistics in its report cell: sum of squares bits, peak word.
    fn stat_cell(&self, parity: u64, k: usize) -> &[AtomicU64] {
        &self.report_words(parity, k)[LocalScalars::words(self.cfg.values.len())..]
    }

    fn report_words(&self, parity: u64, k: usize) -> &[AtomicU64] {
        assert!(k < self.geo.n);
        let words = LocalScalars::words(self.cfg.values.len()) + 2 * self.geo.buckets;
        let at = self.geo.reports + (parity as usize * self.geo.n + k) * self.geo.report;
        // SAFETY: report (parity, k) lies in [reports, grads) (Geometry), 64-byte aligned, and holds
        // `geo.report >= 8 * words` bytes: `words` atomics, valid for any bits.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at).cast::<AtomicU64>(), words) }
    }

    fn read_report(&self, parity: u64, k: usize) -> LocalScalars {
        let w: Vec<u64> = self.report_cell(parity, k).iter().map(|w| w.load(Ordering::Relaxed)).collect();
        LocalScalars::from_words(&w)
    }

    /// Local rank `k`'s health per bucket in the last agreed update (its cells of every reducer's
    /// chunk, merged in chunk order). Valid until the next `agree`: the buffer of that update is
    /// rewritten only two updates later, after barriers this rank has not passed.
    pub fn last_local_row(&self, k: usize) -> Vec<Health> {
        self.last_local_stats(k).into_iter().map(|(h, _)| h).collect()
    }

    /// `last_local_row` with each bucket's peak (`agreement::BucketStat`'s: offset in the bucket).
    pub fn last_local_stats(&self, k: usize) -> Vec<(Health, Option<(f32, u64)>)> {
        self.local_row(k, (self.update + 1) % 2, self.update)
    }

    /// Rank `k`'s health and peak per bucket in the table buffer `parity`, from the entries stamped
    /// `stamp` (chunks merged in chunk order; the peak: the chunks' largest).
    fn local_row(&self, k: usize, parity: u64, stamp: u64) -> Vec<(Health, Option<(f32, u64)>)> {
        let n = self.geo.n;
        (0..self.geo.buckets)
            .map(|b| {
                let len = self.cfg.layout.buckets[b].range.len();
                let (mut h, mut peak) = (Health::default(), 0);
                for r in 0..n {
                    let (st, cells) = self.entry(parity, b, r);
                    if st.load(Ordering::Relaxed) == stamp {
                        h.merge(&load_health(&cells[k]), chunk_range(len, n, r, ALIGN_FLOATS).start as u64);
                        peak = peak.max(self.entry_words(parity, b, r)[1 + k].load(Ordering::Relaxed));
                    }
                }
                (h, peak_of_word(peak))
            })
            .collect()
    }

    /// Start of rank k's gradient slot.
    pub(super) fn slot_ptr(&self, k: usize) -> *mut f32 {
        assert!(k < self.geo.n);
        // SAFETY: slot k lies in [grads + k * stride, grads + (k + 1) * stride) inside the mapping.
        unsafe { self.map.as_mut_ptr().add(self.geo.grads + k * self.geo.slot_stride).cast::<f32>() }
    }

    pub(super) fn claim_cell(&mut self) -> Result<(), Error> {
        let me = std::process::id() as u64;
        let c = self.cell(self.cfg.local_rank);
        if let Err(other) = c.pid.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
            return Err(Error::BadSegment {
                path: self.path.display().to_string(),
                reason: format!("local rank {} is already attached by pid {other}", self.cfg.local_rank),
                hint: "two processes were given the same local rank; check the launch".into(),
            });
        }
        c.start_time.store(self_start_time(), Ordering::Relaxed);
        c.heartbeat_ns.store(monotonic_ns(), Ordering::Relaxed);
        c.state.store(ST_ATTACHED, Ordering::Release);
        self.claimed = true;
        Ok(())
    }

    /// The first half of a hierarchical all-reduce: the same validated, rank-ordered reduce as
    /// `allreduce_bucket` (same tallies, so `agree` reports every local rank's health), but the sum
    /// is written into `root`'s slot only; the other slots keep their local gradients. After it
    /// returns, no peer touches `root`'s slot until the next collective, so `root` may work on its
    /// bucket (e.g. all-reduce it between nodes) and then `broadcast_bucket` it.
    pub fn reduce_bucket_to(&mut self, at: StepId, bucket: usize, root: usize) -> Result<(), Error> {
        assert!(root < self.geo.n, "root {root} of {} local ranks", self.geo.n);
        self.reduce_bucket(at, bucket, Some(root))
    }

    /// Copy one bucket of `root`'s slot into every local slot: barrier; rank `r` copies chunk `r`
    /// of the bucket from `root`'s slot into the other slots; barrier. The second half of a
    /// hierarchical all-reduce (after `reduce_bucket_to` and the exchange between nodes).
    pub fn broadcast_bucket(&mut self, at: StepId, bucket: usize, root: usize) -> Result<(), Error> {
        let n = self.geo.n;
        assert!(root < n, "root {root} of {n} local ranks");
        let me = self.cfg.local_rank;
        let range = self.cfg.layout.buckets[bucket].range.clone();
        let chunk = chunk_range(range.len(), n, me, ALIGN_FLOATS);
        self.barrier_tagged("bcast", at, Some(bucket))?;
        let lo = range.start + chunk.start;
        // SAFETY: as in `reduce_bucket`: between these two barriers every rank is inside this call
        // (no borrow of this bucket's range is alive), and elements `lo..lo + chunk.len()` of every slot are
        // touched by this rank only (the chunks of `chunk_range` are disjoint). The source (root's
        // slot) and the destinations are distinct slots, which do not overlap.
        unsafe {
            let src = std::slice::from_raw_parts(self.slot_ptr(root).add(lo), chunk.len());
            for k in (0..n).filter(|&k| k != root) {
                std::slice::from_raw_parts_mut(self.slot_ptr(k).add(lo), chunk.len()).copy_from_slice(src);
            }
        }
        self.barrier_tagged("bcasted", at, Some(bucket))
    }

    /// Reduce one bucket: barrier, sum my chunk over every slot in rank order, write the sum into
    /// every slot (`to` = None) or into slot `to` only, barrier.
    pub(super) fn reduce_bucket(&mut self, at: StepId, bucket: usize, to: Option<usize>) -> Result<(), Error> {
        self.in_reduce(at, bucket, |bus, start, slices| bus.reduce_chunk(bucket, to, start, slices))
    }

    /// The frame of every bucket reduce: barrier; the fault hook; `f` with this rank's chunk of
    /// `bucket` (its offset in the bucket, and that chunk of every slot, in rank order); barrier.
    /// `f` gets the bus shared, so it cannot start another collective or borrow the slots again.
    pub(crate) fn in_reduce<R>(
        &mut self,
        at: StepId,
        bucket: usize,
        f: impl FnOnce(&ShmBus, usize, &mut [&mut [f32]]) -> R,
    ) -> Result<R, Error> {
        let n = self.geo.n;
        let range = self.cfg.layout.buckets[bucket].range.clone();
        let chunk = chunk_range(range.len(), n, self.cfg.local_rank, ALIGN_FLOATS);
        self.barrier_tagged("reduce", at, Some(bucket))?;
        if let Some(hook) = self.inside_reduce.as_mut() {
            hook(at, bucket);
        }
        let lo = range.start + chunk.start;
        // SAFETY: every rank has entered this reduce (barrier above) and none leaves it before the
        // barrier below, so no rank holds a borrow of this bucket's range (module invariants).
        // Between the two barriers, elements
        // `lo..lo + chunk.len()` of every slot are read and written by this rank only: the other
        // reducers own the other chunks of `chunk_range`, which are disjoint. Slots are disjoint
        // (`slot_stride >= len * 4`) and `range.end <= layout.len`, so the n slices do not overlap
        // and lie inside the mapping, f32-aligned. `f` holds the bus shared: it cannot reach the
        // slots through it (`grads`, the collectives take it mutably), and the slices are dropped
        // before the barrier below.
        let mut slices: Vec<&mut [f32]> =
            (0..n).map(|k| unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(k).add(lo), chunk.len()) }).collect();
        let r = f(self, chunk.start, &mut slices);
        drop(slices);
        self.barrier_tagged("reduced", at, Some(bucket))?;
        Ok(r)
    }

    /// The validated reduce of this rank's chunk (at `start` in `bucket`; `slices` that chunk of
    /// every slot, inside `in_reduce`): the rank-ordered sum into every slot or slot `to`, each
    /// source's health and peak and the sum's checksum into this update's table entry.
    pub(crate) fn reduce_chunk(&self, bucket: usize, to: Option<usize>, start: usize, slices: &mut [&mut [f32]]) {
        let (n, me) = (self.geo.n, self.cfg.local_rank);
        let mut tally = vec![Health::default(); n];
        let mut peaks = vec![Peak::default(); if self.sdc_tallies { n } else { 0 }];
        // The reference of this chunk of the sum: its checksum as written (each block while in
        // cache), finished and published by `agree` (0 when not hashed: unknown).
        let mut hash = self.sdc_tallies.then(Checksum::new);
        let sum = reduce_with_peaks(slices, &mut tally, &mut peaks, to, hash.as_mut());
        let words = self.entry_words(self.update % 2, bucket, me);
        match hash {
            Some(c) => self.pending_hashes.lock().expect("no panic holds it")[bucket] = Some(c),
            None => words[0].store(0, Ordering::Relaxed),
        }
        for (k, w) in words[1..].iter().enumerate() {
            let peak = peaks.get(k).map(|p| (p.value, start as u64 + p.at));
            w.store(peak_word(peak), Ordering::Relaxed);
        }
        let (stamp, cells) = self.entry(self.update % 2, bucket, me);
        let totals = Health {
            nan: tally.iter().map(|h| h.nan).sum(),
            inf: tally.iter().map(|h| h.inf).sum(),
            ..Health::default()
        };
        for (cell, h) in cells.iter().zip(tally.iter().chain([&sum, &totals])) {
            store_health(cell, h);
        }
        stamp.store(self.update + 1, Ordering::Relaxed);
    }
}

// SAFETY: the slot lies in the mapping for the bus's lifetime; reduces and broadcasts slice only
// their bucket's chunk (`reduce_bucket`, `broadcast_bucket`).
unsafe impl Transport for ShmBus {
    fn rank(&self) -> usize {
        self.cfg.local_rank
    }

    fn world(&self) -> usize {
        self.cfg.local_size
    }

    fn layout(&self) -> &Layout {
        &self.cfg.layout
    }

    fn health_chunks(&self) -> usize {
        self.cfg.local_size
    }

    fn grads_ptr(&mut self) -> *mut f32 {
        // This rank's slot: `layout.len` f32s inside the mapping, page-aligned. Peers write into it
        // only between the two barriers of a bucket reduce, and only that bucket's range, while
        // this rank is inside `allreduce_bucket` too; see the module invariants.
        self.slot_ptr(self.cfg.local_rank)
    }

    fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
        self.reduce_bucket(at, bucket, None)
    }

    /// The node's agreement. Every rank reads, per bucket, each reducer's chunk of the reduced
    /// health and its NaN/Inf totals (O(local ranks x buckets) words, not the O(local ranks^2 x
    /// buckets) of the per-rank cells), and every rank's report; only when that summary shows an
    /// anomaly (or `GRADBUS_AGREEMENT=table`) does it read every rank's cells too.
    fn agree(&mut self, at: StepId, local: LocalScalars) -> Result<HealthTable, Error> {
        let (n, me, parity) = (self.geo.n, self.cfg.local_rank, self.update % 2);
        let values = &self.cfg.values;
        assert_eq!(
            local.values.len(),
            values.len(),
            "a report of {} values to a bus of {values:?}",
            local.values.len()
        );
        for (w, v) in self.report_cell(parity, me).iter().zip(local.to_words()) {
            w.store(v, Ordering::Relaxed);
        }
        // This rank's reduced chunks' hashes, finished together.
        let (buckets, states): (Vec<usize>, Vec<Checksum>) = {
            let mut pending = self.pending_hashes.lock().expect("no panic holds it");
            pending.iter_mut().enumerate().filter_map(|(b, c)| Some(b).zip(c.take())).unzip()
        };
        for (b, hash) in buckets.into_iter().zip(finish_all(&states)) {
            self.entry_words(parity, b, me)[0].store(hash, Ordering::Relaxed);
        }
        // This rank's own row (its cells of every reducer's chunk: O(local ranks x buckets)) goes
        // beside its report, so that every rank reads every rank's statistics in O(ranks x buckets).
        let stats = self.stat_cell(parity, me);
        for (b, (h, peak)) in self.local_row(me, parity, self.update + 1).into_iter().enumerate() {
            stats[2 * b].store(h.sumsq.to_bits(), Ordering::Relaxed);
            stats[2 * b + 1].store(peak_word(peak), Ordering::Relaxed);
        }
        self.barrier_tagged("agree", at, None)?;
        let nb = self.geo.buckets;
        let mut summary = Summary::empty(nb, &self.cfg.values);
        let mut reduced = vec![Health::default(); nb];
        let mut reference = vec![0u64; nb];
        for (b, red) in reduced.iter_mut().enumerate() {
            let len = self.cfg.layout.buckets[b].range.len();
            let mut chunk_hashes = Vec::with_capacity(n);
            // Chunks in increasing offset order: a fixed order of the f64 sums on every rank.
            for r in 0..n {
                let (stamp, cells) = self.entry(parity, b, r);
                if stamp.load(Ordering::Relaxed) != self.update + 1 {
                    continue; // bucket not reduced in this update: nothing to report
                }
                let off = chunk_range(len, n, r, ALIGN_FLOATS).start as u64;
                red.merge(&load_health(&cells[n]), off);
                let totals = load_health(&cells[n + 1]);
                summary.add_local(b, totals.nan, totals.inf);
                chunk_hashes.push(self.entry_words(parity, b, r)[0].load(Ordering::Relaxed));
            }
            // The reducers' chunks in chunk order: what a consumer that hashes the same chunks folds.
            reference[b] = combine(&chunk_hashes);
        }
        summary.set_reduced(&reduced);
        summary.set_reference(&reference);
        let reports: Vec<LocalScalars> = (0..n).map(|k| self.read_report(parity, k)).collect();
        for r in &reports {
            summary.add_report(r);
        }
        for k in 0..n {
            let w: Vec<u64> = self.stat_cell(parity, k).iter().map(|w| w.load(Ordering::Relaxed)).collect();
            for (b, e) in summary.extremes.iter_mut().enumerate() {
                e.add(k, &BucketStat { sumsq: f64::from_bits(w[2 * b]), peak: peak_of_word(w[2 * b + 1]) });
            }
        }
        self.update += 1;
        if self.agreement == AgreementPath::Summary && summary.anomaly().is_none() {
            return Ok(HealthTable::summarized(n, summary).expect("one reduced health per bucket"));
        }
        let rows: Vec<_> = (0..n).map(|k| self.local_row(k, parity, self.update)).collect();
        let local = (0..nb).flat_map(|b| rows.iter().map(move |row| row[b].0)).collect();
        let peaks = (0..nb).flat_map(|b| rows.iter().map(move |row| row[b].1)).collect();
        let reduced = crate::verdict::Reduced { health: reduced, reference };
        let table = HealthTable::detailed(n, &self.cfg.values, local, peaks, reduced, reports, None);
        debug_assert_eq!(table.summary, summary, "both paths agree on the summary");
        Ok(table)
    }

    /// Through the gradient slots: `root` writes `data` into its slot, every bucket is broadcast
    /// from it (`broadcast_bucket`), every rank reads its slot back. The slots' gradients are lost.
    fn broadcast_from(&mut self, at: StepId, root: usize, data: &mut [f32]) -> Result<(), Error> {
        assert_eq!(data.len(), self.cfg.layout.len, "a replica buffer is laid out as the gradients");
        if self.cfg.local_rank == root {
            self.grads().copy_from_slice(data);
        }
        for b in 0..self.geo.buckets {
            self.broadcast_bucket(at, b, root)?;
        }
        data.copy_from_slice(self.grads());
        Ok(())
    }

    fn mark_failed(&mut self) {
        // It passed its last barrier; it will not pass the next one.
        self.set_failed(FAIL_MARKED, self.barriers + 1, self.cfg.local_rank);
    }
}

impl Drop for ShmBus {
    fn drop(&mut self) {
        // Peers still waiting for this rank fail at once instead of at the deadline.
        if self.claimed {
            self.cell(self.cfg.local_rank).state.store(ST_DEPARTED, Ordering::SeqCst);
            self.wake_all();
        }
        if self.creator {
            // Unlink only if the name still points at OUR segment (same inode).
            let ours = self.file.metadata().ok().map(|m| (m.dev(), m.ino()));
            let there = std::fs::metadata(&self.path).ok().map(|m| (m.dev(), m.ino()));
            if ours.is_some() && ours == there {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    log::warn!("{}: cannot remove the bus segment: {e}", self.path.display());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradbus_kernels::{reduce_in_place, reduce_plain, reduce_to_one};

    #[test]
    fn plain_reduce_matches_validated_reduce() {
        let mut rng = gradbus_kernels::rng::Rng::new(&[1, 2]);
        let mut a: Vec<Vec<f32>> = (0..3).map(|_| (0..2500).map(|_| rng.normal()).collect()).collect();
        let mut b = a.clone();
        let mut tally = vec![Health::default(); 3];
        reduce_in_place(&mut a.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>(), &mut tally);
        reduce_plain(&mut b.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>());
        let bits = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }

    #[test]
    fn reduce_to_one_matches_reduce_in_place_in_the_root_and_leaves_the_others() {
        let mut rng = gradbus_kernels::rng::Rng::new(&[3, 4]);
        let mut a: Vec<Vec<f32>> = (0..3).map(|_| (0..2500).map(|_| rng.normal()).collect()).collect();
        a[2][1700] = f32::NAN;
        let orig = a.clone();
        let mut b = a.clone();
        let (mut ta, mut tb) = (vec![Health::default(); 3], vec![Health::default(); 3]);
        let sa = reduce_in_place(&mut a.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>(), &mut ta);
        let sb = reduce_to_one(&mut b.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>(), &mut tb, 1);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a[1]), bits(&b[1]), "the root holds the same sum");
        assert_eq!(bits(&b[0]), bits(&orig[0]), "other slots keep their gradients");
        assert_eq!(bits(&b[2]), bits(&orig[2]));
        assert_eq!(ta, tb);
        assert_eq!(format!("{sa:?}"), format!("{sb:?}"));
        assert_eq!(tb[2].first_bad, Some(1700));
    }
}
