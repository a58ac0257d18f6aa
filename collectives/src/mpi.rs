//! Transports between nodes over MPI (feature `mpi`): `MpiTransport`, a flat MPI world where every
//! rank is its own node, and `HierTransport`, the shared-memory bus inside each node plus MPI between
//! the nodes' leaders.
//!
//! ```text
//!  MpiTransport (per bucket)            HierTransport (per bucket)
//!  scan local health                    node 0: ranks 0..n0    node 1: ranks n0..      ...
//!  MPI_Allreduce(SUM) over the world     shm reduce -> slot of local rank 0 (the leader)
//!  copy the sum back, scan its health    leaders: MPI_Allreduce(SUM) of the node sums
//!                                        shm broadcast: leader's slot -> every local slot
//!
//!  agree (per update, both), on the path chosen at open (`AgreementPath::choose`: the cost
//!  model for this world size, bucket count and value count, or GRADBUS_AGREEMENT; checked at open):
//!    summary path: MPI_Allreduce(SUM) + MPI_Allreduce(MAX) of every rank's `Summary` words
//!      (O(buckets), whatever the world; hier: the leaders contribute their node's summary),
//!      then, only if it shows an anomaly (non-finite, replicas/reducers/collectives differ):
//!    table path: ONE MPI_Allgather of a fixed-size row per rank:
//!      [op hash | local health per bucket | reduced health per bucket | LocalScalars]
//!  every rank builds the HealthTable from the same reduced or gathered bytes: identical tables.
//! ```
//!
//! Invariants and caveats:
//! - MPI is initialised once per process (`universe`) and finalised when the last transport is
//!   dropped cleanly. `MPI_Finalize` (and freeing a communicator) synchronises with every rank, so it
//!   would hang if a peer is blocked in a collective this rank will never join. So a transport that
//!   failed (an error it returned, `mark_failed`, a panic) never finalises, and a clean drop first
//!   meets every rank in a non-blocking barrier on a communicator of its own (`MPI_Ibarrier`,
//!   polled until `Expect::timeout`): only when all ranks are leaving does it finalise. Otherwise
//!   the process exits without finalising and `mpirun` ends the job (it counts such a process as
//!   failed, even with status 0).
//! - Rank identity must agree with MPI: after `MPI_Init`, a world size (or rank) from the environment
//!   that differs from `MPI_COMM_WORLD` is an error (a binary linked against one MPI and started by
//!   another's `mpiexec` runs as N silent size-1 jobs). At open, every rank also checks every
//!   other rank's config hash and node placement, from one allgather, so all ranks fail alike.
//! - Determinism: inside a node the sum is the bus's fixed rank order. Between nodes (and in the
//!   flat transport) the order of `MPI_Allreduce`'s additions is the MPI library's choice: for a
//!   fixed library, process count, message size and algorithm Open MPI repeats it run after run and
//!   gives every rank the same bits, but the standard does not promise it, and a different np or
//!   size may pick another algorithm (so the sum may differ from the serial rank-order sum by float
//!   rounding). `agree` checks it: every reducer reports the health (sum of squares bits) of the
//!   sum it got, and a difference between ranks is an `Error::Mismatch` on every rank.
//! - Timeouts: MPI calls have no deadline. If a peer dies inside `MPI_Allreduce`, the others block
//!   until `mpirun` (or the `gradbus` launcher's supervision) sees the dead process and kills the
//!   job. Inside a node, the shm barriers keep their deadlines and dead-peer detection.
//! - The sequence of collectives is checked at every `agree`: each rank hashes the (step, bucket)
//!   of every all-reduce it ran since the last agreement; differing hashes are an `Error::Mismatch`
//!   on every rank. (A mismatch of message sizes inside one `MPI_Allreduce` cannot be caught before
//!   it happens; the layout hash checked at open makes it a program bug.)
//! - rsmpi ignores MPI's return codes; MPI's default error handler (`MPI_ERRORS_ARE_FATAL`) aborts
//!   the whole job on an MPI error, which mpirun reports.
//! - `mark_failed` cannot wake peers blocked in MPI (short of `MPI_Abort`, which would cut the
//!   rank's own error report): it only stops this rank from finalising, so that it exits at once and
//!   mpirun takes the job down.
//! - rsmpi has no `MPI_IN_PLACE`, so the MPI reduce writes into a scratch buffer and the sum is
//!   copied back (one extra read+write of the bucket).

use std::sync::{Arc, Mutex, Weak};

use ::mpi::collective::SystemOperation;
use ::mpi::environment::Universe;
use ::mpi::topology::{Color, SimpleCommunicator};
use ::mpi::traits::*;
use gradbus_kernels::checksum::{checksum, combine};
use gradbus_kernels::{health_scan, Health};

use crate::agreement::{peak_word, BucketStat, LocalScalars, Summary, ValueNames};
use crate::choice::AgreementPath;
use crate::layout::{Fnv, Layout};
use crate::shm::ProgressWriter;
use crate::shm::{BusConfig, ShmBus};
use crate::transport::Transport;
use crate::verdict::{HealthTable, StepId};
use crate::Error;

use crate::wire::{fold_op, table_of, RowShape};
/// Largest element count of one `MPI_Allreduce` call (counts are C ints).
const MAX_COUNT: usize = 1 << 30;

/// The process's MPI universe, while some transport holds it.
static UNIVERSE: Mutex<Weak<Universe>> = Mutex::new(Weak::new());

/// Initialise MPI (once per process) or share the live universe. Finalised when the last `Arc` is
/// dropped; after that MPI cannot be initialised again in this process.
pub fn universe() -> Result<Arc<Universe>, Error> {
    let mut slot = UNIVERSE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(u) = slot.upgrade() {
        return Ok(u);
    }
    if ::mpi::environment::is_initialized() {
        return Err(Error::Mpi {
            what: "MPI was already initialised (and finalised) in this process".into(),
            hint: "MPI can be initialised once per process: keep one transport for the whole run".into(),
        });
    }
    // FUNNELED: backward may run on a second thread (`overlap`), but every MPI call is made by the
    // thread that initialised MPI.
    let (u, level) = ::mpi::initialize_with_threading(::mpi::Threading::Funneled).ok_or_else(|| Error::Mpi {
        what: "MPI_Init_thread failed".into(),
        hint: "run under the mpirun of the MPI this binary was built with".into(),
    })?;
    if level < ::mpi::Threading::Funneled {
        return Err(Error::Mpi {
            what: format!("the MPI library grants thread level {level:?}; gradbus needs Funneled"),
            hint: "backward may run on a second thread that makes no MPI call; use an MPI built with thread support"
                .into(),
        });
    }
    let u = Arc::new(u);
    *slot = Arc::downgrade(&u);
    Ok(u)
}

/// The MPI library's version string (one line).
pub fn library_version() -> String {
    ::mpi::environment::library_version()
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or("")
        .trim_end_matches('\0')
        .to_string()
}

/// What the environment said about this rank, to be checked against `MPI_COMM_WORLD`.
#[derive(Clone, Debug)]
pub struct Expect {
    /// Global rank from the environment.
    pub rank: usize,
    /// World size from the environment.
    pub world: usize,
    /// Where the numbers came from (`openmpi`, `mpich`, `gradbus`...), for the error message.
    pub source: String,
    /// How long a rank that is done waits for the others before finalising MPI (see the module
    /// doc); the collective timeout of the job.
    pub timeout: std::time::Duration,
}

/// `MPI_COMM_WORLD`'s size must be the environment's: otherwise the binary was started by another
/// MPI's launcher (N size-1 jobs) or without one. A local check: no collective before it.
pub(crate) fn check_world(world: &SimpleCommunicator, expect: &Expect) -> Result<(), Error> {
    let size = world.size() as usize;
    if size != expect.world {
        return Err(Error::Mpi {
            what: format!(
                "the environment ({}) says {} ranks, but MPI_COMM_WORLD has {size} (this is rank {} of it)",
                expect.source,
                expect.world,
                world.rank()
            ),
            hint: format!(
                "start the binary with the mpirun/mpiexec of the MPI it was built against ({}); \
                 a binary started by another MPI's launcher, or without one, runs as separate size-1 jobs",
                library_version()
            ),
        });
    }
    Ok(())
}

/// Words of one rank's identity row at open.
const ID_WORDS: usize = 6;

/// One allgather of every rank's identity; every rank runs the same checks on the same rows, so all
/// fail alike. Returns the rows: [env rank, node id, local rank, local size, config hash (the
/// agreement path and the workload values' names folded in), layout hash].
fn exchange_identity(comm: &SimpleCommunicator, mine: [u64; ID_WORDS]) -> Result<Vec<[u64; ID_WORDS]>, Error> {
    let n = comm.size() as usize;
    let mut all = vec![0u64; n * ID_WORDS];
    comm.all_gather_into(&mine[..], &mut all[..]);
    let rows: Vec<[u64; ID_WORDS]> =
        all.chunks_exact(ID_WORDS).map(|c| c.try_into().expect("ID_WORDS words")).collect();
    let me = comm.rank() as usize;
    for (j, r) in rows.iter().enumerate() {
        if r[0] != j as u64 {
            return Err(Error::Mpi {
                what: format!("MPI rank {j} was told by the environment that it is rank {}", r[0]),
                hint: "the rank variables of the environment and MPI disagree; start the ranks with mpirun only".into(),
            });
        }
    }
    for (j, r) in rows.iter().enumerate() {
        if r[4] != rows[me][4] || r[5] != rows[me][5] {
            return Err(Error::Mismatch {
                rank: j,
                theirs: format!("config hash {:#018x} / layout hash {:#018x}", r[4], r[5]),
                mine: format!("config hash {:#018x} / layout hash {:#018x}", rows[me][4], rows[me][5]),
            });
        }
    }
    // Each node: local ranks 0..local_size, each once, all agreeing on local_size.
    let mut nodes: Vec<u64> = rows.iter().map(|r| r[1]).collect();
    nodes.sort_unstable();
    nodes.dedup();
    for node in nodes {
        let members: Vec<&[u64; ID_WORDS]> = rows.iter().filter(|r| r[1] == node).collect();
        let size = members.len() as u64;
        let mut locals: Vec<u64> = members.iter().map(|r| r[2]).collect();
        locals.sort_unstable();
        if members.iter().any(|r| r[3] != size) || locals != (0..size).collect::<Vec<_>>() {
            return Err(Error::Mpi {
                what: format!(
                    "node {node} has {size} ranks with local ranks {locals:?} and local sizes {:?}",
                    members.iter().map(|r| r[3]).collect::<Vec<_>>()
                ),
                hint: "local rank and size must describe the ranks that share a node (check GRADBUS_FAKE_NODES and the launch)".into(),
            });
        }
    }
    Ok(rows)
}

/// `MPI_Bcast` of `data` from world rank `root`, in calls of at most `MAX_COUNT` (a replica repair:
/// every rank of the world calls it).
fn broadcast_world(comm: &SimpleCommunicator, root: usize, data: &mut [f32]) {
    for c in data.chunks_mut(MAX_COUNT) {
        comm.process_at_rank(root as i32).broadcast_into(c);
    }
}

/// `MPI_Allreduce(SUM)` of `send` into `recv` (same length), in calls of at most `MAX_COUNT`.
pub(crate) fn allreduce_sum(comm: &SimpleCommunicator, send: &[f32], recv: &mut [f32]) {
    assert_eq!(send.len(), recv.len());
    for (s, r) in send.chunks(MAX_COUNT).zip(recv.chunks_mut(MAX_COUNT)) {
        comm.all_reduce_into(s, r, ::mpi::collective::SystemOperation::sum());
    }
}

/// The per-update agreement shared by both transports: one allgather of a fixed-size row per rank,
/// then every rank builds the same table from the same rows.
///
/// Row (`wire`, shape `RowShape::mpi`): head `[op hash, reducer flag]`, local health and peak word
/// per bucket (`peaks`: 0 in the flat transport, whose scan tallies none), reduced health and
/// checksum per bucket, report. `reduced` is meaningful on reducers only (every rank of the
/// flat transport, the leaders of the hierarchical one); the table takes the lowest reducer's, and
/// every reducer's must be bitwise the same.
pub(crate) fn agree_rows(
    comm: &SimpleCommunicator,
    names: &ValueNames,
    ops: u64,
    (local, peaks): (&[Health], &[u64]),
    reduced: Option<(&[Health], &[u64])>,
    report: &LocalScalars,
) -> Result<HealthTable, Error> {
    let mine = row_words(ops, (local, peaks), reduced, report);
    let mut all = vec![0u64; comm.size() as usize * mine.len()];
    comm.all_gather_into(&mine[..], &mut all[..]);
    table_of_rows(&all, local.len(), names, ops, comm.rank() as usize)
}

/// One rank's row of the table path (see `agree_rows`).
pub(crate) fn row_words(
    ops: u64,
    local: (&[Health], &[u64]),
    reduced: Option<(&[Health], &[u64])>,
    report: &LocalScalars,
) -> Vec<u64> {
    let shape = RowShape::mpi(local.0.len(), report.values.len());
    shape.encode(&[ops, reduced.is_some() as u64], local, reduced, report)
}

/// The table every rank builds from the same gathered rows (`row_words` of every rank, in rank
/// order, over `nb` buckets and reports of the values `names`), after checking that all ran the
/// collectives `ops` hashes and that every reducer's sums are the same bits. `me`: this rank, for
/// the error message.
pub(crate) fn table_of_rows(
    all: &[u64],
    nb: usize,
    names: &ValueNames,
    ops: u64,
    me: usize,
) -> Result<HealthTable, Error> {
    let rows = RowShape::mpi(nb, names.len())
        .rows(all)
        .map_err(|what| Error::Mpi { what, hint: "a transport bug: every rank gathers rows of one shape".into() })?;
    for (j, r) in rows.iter().enumerate() {
        if r.head[0] != ops {
            return Err(Error::Mismatch {
                rank: j,
                theirs: format!("an update whose collectives hash to {:#018x}", r.head[0]),
                mine: format!("an update whose collectives hash to {ops:#018x}"),
            });
        }
    }
    let reducers: Vec<usize> = (0..rows.len()).filter(|&j| rows[j].head[1] == 1).collect();
    let first = *reducers.first().ok_or_else(|| Error::Mpi {
        what: "no rank reported a reduced bucket".into(),
        hint: "a transport bug: every node must have a leader".into(),
    })?;
    for &j in &reducers {
        if rows[j].reduced_words() != rows[first].reduced_words() {
            return Err(Error::Mismatch {
                rank: j,
                theirs: "an MPI_Allreduce result with other bits".into(),
                mine: format!("the result of rank {first} (MPI sums differ between ranks; rank {me} stops)"),
            });
        }
    }
    Ok(table_of(&rows, names, rows[first].reduced(), Some(ops)))
}

/// The summary path of the agreement: the all-reduce of every rank's contribution, as two
/// `MPI_Allreduce`s (integer sums, then maxima; see `agreement`). Exact integer operations: the
/// same bits whatever order the library combines the ranks in.
fn allreduce_summary(comm: &SimpleCommunicator, mine: &Summary) -> Summary {
    let (s, m) = (mine.sum_words(), mine.max_words());
    let (mut rs, mut rm) = (vec![0u64; s.len()], vec![0u64; m.len()]);
    // Two blocking calls rather than two `MPI_Iallreduce`s started together: Open MPI's
    // non-blocking collectives (libnbc) took 1.7 ms where the blocking pair took 33 us (2 ranks,
    // 1750 buckets, `--bench-allreduce --agreement`).
    comm.all_reduce_into(&s[..], &mut rs[..], SystemOperation::sum());
    comm.all_reduce_into(&m[..], &mut rm[..], SystemOperation::max());
    Summary::from_words(mine.buckets(), mine.names(), &rs, &rm)
}

/// The agreement of both transports: the summary all-reduce, then the full table (`agree_rows`)
/// only when the summary shows an anomaly or the table path is forced. `contribution` is this
/// rank's share of the summary (without the collective hash, added here); `local` (its health and
/// peak words per bucket) and `reduced` are its row of the table.
#[allow(clippy::too_many_arguments)]
pub(crate) fn agree_world(
    comm: &SimpleCommunicator,
    path: AgreementPath,
    ops: u64,
    mut contribution: Summary,
    local: impl FnOnce() -> (Vec<Health>, Vec<u64>),
    reduced: Option<(&[Health], &[u64])>,
    report: &LocalScalars,
) -> Result<HealthTable, Error> {
    if path == AgreementPath::Summary {
        contribution.ops.add(ops);
        let summary = allreduce_summary(comm, &contribution);
        if summary.anomaly().is_none() {
            let n = comm.size() as usize;
            return Ok(HealthTable::summarized(n, summary).expect("no anomaly: the reducers agree"));
        }
    }
    let (health, peaks) = local();
    agree_rows(comm, contribution.names(), ops, (&health, &peaks), reduced, report)
}

/// MPI handles of one transport, dropped before the universe (or leaked with it on failure).
struct Comms {
    /// A duplicate of `MPI_COMM_WORLD`: our collectives never match anyone else's.
    world: SimpleCommunicator,
    /// Only for the exit handshake: its `MPI_Ibarrier` can match nothing else.
    exit: SimpleCommunicator,
    /// Hierarchical transport: the leaders (local rank 0 of each node), ordered by node id; `None`
    /// on the other ranks and in the flat transport.
    leaders: Option<SimpleCommunicator>,
}

/// MPI state shared by both transports: the universe, the communicators and the failure flag.
struct MpiCore {
    comms: Option<Comms>,
    universe: Option<Arc<Universe>>,
    failed: bool,
    /// Deadline of the exit handshake.
    exit_timeout: std::time::Duration,
}

impl MpiCore {
    /// Initialise (or share) MPI, check the world size, duplicate the world and exchange identities.
    /// Initialise MPI, check the world against `expect`, then exchange every rank's identity row,
    /// which `ident` computes (it may run collectives over the world first).
    fn open(
        expect: &Expect,
        ident: impl FnOnce(&mut MpiCore) -> Result<[u64; ID_WORDS], Error>,
    ) -> Result<(MpiCore, Vec<[u64; ID_WORDS]>), Error> {
        let universe = universe()?;
        let world = universe.world();
        let mut core = MpiCore { comms: None, universe: Some(universe), failed: false, exit_timeout: expect.timeout };
        // A failure from here on leaks MPI instead of finalising it (see `Drop`).
        core.guard(|_| check_world(&world, expect))?;
        core.comms = Some(Comms { world: world.duplicate(), exit: world.duplicate(), leaders: None });
        let ident = core.guard(ident)?;
        let rows = core.guard(|c| exchange_identity(&c.comms().world, ident))?;
        Ok((core, rows))
    }

    fn comms(&self) -> &Comms {
        self.comms.as_ref().expect("communicators live until drop")
    }

    /// Run `f`; an error marks the core failed (no `MPI_Finalize` at drop).
    fn guard<T>(&mut self, f: impl FnOnce(&mut MpiCore) -> Result<T, Error>) -> Result<T, Error> {
        let r = f(self);
        if r.is_err() {
            self.failed = true;
        }
        r
    }
}

impl Drop for MpiCore {
    fn drop(&mut self) {
        let comms = self.comms.take();
        let universe = self.universe.take();
        let clean = !self.failed
            && !std::thread::panicking()
            && comms.as_ref().is_some_and(|c| all_leaving(&c.exit, self.exit_timeout));
        if !clean {
            // Freeing communicators and MPI_Finalize synchronise with peers that may be blocked in
            // a collective that this rank will never join: leak them; the process exits and mpirun
            // tears the job down.
            std::mem::forget(comms);
            std::mem::forget(universe);
        } else {
            drop(comms);
            drop(universe);
        }
    }
}

/// The exit handshake: whether every rank enters a barrier on `exit` within `timeout`. A rank whose
/// peers are stuck elsewhere (blocked in a collective this rank left) gets `false` at the deadline.
fn all_leaving(exit: &SimpleCommunicator, timeout: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    let mut req = exit.immediate_barrier();
    let mut pause = std::time::Duration::from_micros(50);
    loop {
        match req.test() {
            Ok(_) => return true,
            Err(pending) if std::time::Instant::now() >= deadline => {
                log::warn!(
                    "MPI: not every rank reached the end within {:.0} s; exiting without MPI_Finalize",
                    timeout.as_secs_f64()
                );
                // An incomplete request panics when dropped; MPI is being abandoned anyway.
                std::mem::forget(pending);
                return false;
            }
            Err(pending) => req = pending,
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(10));
    }
}

/// A flat MPI world: every rank is its own node, no shared memory.
pub struct MpiTransport {
    layout: Layout,
    values: ValueNames,
    grads: crate::transport::AlignedBuf,
    scratch: Vec<f32>,
    local: Vec<Health>,
    reduced: Vec<Health>,
    /// Position hash of each reduced bucket as this rank received it.
    hashes: Vec<u64>,
    ops: Fnv,
    rank: usize,
    world: usize,
    agreement: AgreementPath,
    core: MpiCore,
}

impl MpiTransport {
    /// Initialise MPI, check that the environment's rank and world size agree with it, and check
    /// every rank's `config_hash`, layout and workload `values` (one allgather), the agreement path
    /// (`AgreementPath::choose`) folded into the hash. Collective over `MPI_COMM_WORLD`.
    pub fn open(expect: Expect, layout: Layout, values: ValueNames, config_hash: u64) -> Result<MpiTransport, Error> {
        let agreement = AgreementPath::choose(expect.world, layout.buckets.len(), &values)?;
        let hash = agreement.fold(config_hash) ^ values.hash();
        let ident = [expect.rank as u64, expect.rank as u64, 0, 1, hash, layout.hash()];
        let (core, _) = MpiCore::open(&expect, |_| Ok(ident))?;
        let nb = layout.buckets.len();
        let biggest = layout.buckets.iter().map(|b| b.range.len()).max().unwrap_or(0);
        Ok(MpiTransport {
            grads: crate::transport::AlignedBuf::zeros(layout.len),
            scratch: vec![0.0; biggest],
            local: vec![Health::default(); nb],
            reduced: vec![Health::default(); nb],
            hashes: vec![0; nb],
            ops: Fnv::default(),
            rank: expect.rank,
            world: expect.world,
            agreement,
            layout,
            values,
            core,
        })
    }
}

// SAFETY: `AlignedBuf` never moves its elements; `allreduce_bucket` borrows only its bucket
// (`range_mut`).
unsafe impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn grads_ptr(&mut self) -> *mut f32 {
        self.grads.as_mut_ptr()
    }
    fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
        let r = self.layout.buckets[bucket].range.clone();
        let g = self.grads.range_mut(r.clone());
        self.local[bucket] = health_scan(g);
        let out = &mut self.scratch[..r.len()];
        allreduce_sum(&self.core.comms().world, g, out);
        self.reduced[bucket] = health_scan(out);
        self.hashes[bucket] = combine(&[checksum(out)]);
        g.copy_from_slice(out);
        fold_op(&mut self.ops, "reduce", at, Some(bucket));
        Ok(())
    }
    fn agree(&mut self, at: StepId, local: LocalScalars) -> Result<HealthTable, Error> {
        fold_op(&mut self.ops, "agree", at, None);
        let ops = std::mem::take(&mut self.ops).0;
        let (l, red) = (&self.local, Some((&self.reduced[..], &self.hashes[..])));
        let mine = Summary::of_rank(&self.values, self.rank, l, red, &local);
        let path = self.agreement;
        // The flat transport's scan tallies no peaks: words of 0 (the outlier rule then stays off).
        let row = || (l.clone(), vec![0; l.len()]);
        let table = self.core.guard(|c| agree_world(&c.comms().world, path, ops, mine, row, red, &local))?;
        // Buckets not reduced in the next update report nothing, as on the bus.
        self.local.fill(Health::default());
        self.reduced.fill(Health::default());
        self.hashes.fill(0);
        Ok(table)
    }
    fn broadcast_from(&mut self, at: StepId, root: usize, data: &mut [f32]) -> Result<(), Error> {
        fold_op(&mut self.ops, "bcast", at, None);
        self.core.guard(|c| {
            broadcast_world(&c.comms().world, root, data);
            Ok(())
        })
    }
    fn mark_failed(&mut self) {
        self.core.failed = true;
    }
}

/// Shared memory inside each node, MPI between the nodes' leaders (local rank 0).
pub struct HierTransport {
    bus: ShmBus,
    /// Leaders: receive buffer of the MPI all-reduce (largest bucket).
    scratch: Vec<f32>,
    /// Leaders: health of each globally reduced bucket in this update.
    reduced: Vec<Health>,
    /// Leaders: checksum of each globally reduced bucket in this update.
    hashes: Vec<u64>,
    ops: Fnv,
    rank: usize,
    world: usize,
    agreement: AgreementPath,
    core: MpiCore,
}

impl HierTransport {
    /// Initialise MPI, check the environment against it, find this rank's node and the leaders'
    /// communicator (three splits and a broadcast), check every rank's identity and config (one
    /// allgather), and open the node's shared-memory bus. Collective over `MPI_COMM_WORLD`; every
    /// rank runs the same collectives whatever fails, and fails after them.
    ///
    /// The node is what MPI calls one shared-memory domain (`MPI_Comm_split_type(SHARED)`), cut
    /// further by `bus.node_id` (which tells `GRADBUS_FAKE_NODES`' nodes apart); `bus.local_rank`,
    /// `local_size` and `node_id` are replaced by MPI's view: the node's number is its leader's
    /// rank among the leaders, so hosts that share one `/dev/shm` (containers, network namespaces)
    /// never pick the same segment, as they would with a node id from the environment.
    pub fn open(expect: Expect, mut bus: BusConfig) -> Result<HierTransport, Error> {
        // A node id past a C int gets a colour anyway, so that this rank joins every split; it
        // fails after them (and its peers at their bus's deadline).
        let agreement = AgreementPath::choose(expect.world, bus.layout.buckets.len(), &bus.values)?;
        let env_node = bus.node_id;
        let fake = i32::try_from(env_node).unwrap_or(i32::MAX);
        // Find the node before opening the bus: the splits are collective over the world, and a
        // rank that fails to open its bus must not leave the other nodes waiting in them.
        let mut leaders = None;
        let (core, _) = MpiCore::open(&expect, |c| {
            let world = &c.comms().world;
            let me = world.rank();
            let node = world.split_shared(me).split_by_color_with_key(Color::with_value(fake), me);
            let node = node.expect("a defined color gives every rank a communicator");
            let color = if node.rank() == 0 { Color::with_value(0) } else { Color::undefined() };
            leaders = world.split_by_color_with_key(color, me);
            let mut id = leaders.as_ref().map_or(0, |l| l.rank() as u64);
            node.process_at_rank(0).broadcast_into(&mut id);
            (bus.node_id, bus.local_rank, bus.local_size) = (id as usize, node.rank() as usize, node.size() as usize);
            let (n, lr, ls) = (bus.node_id as u64, bus.local_rank as u64, bus.local_size as u64);
            let hash = agreement.fold(bus.config_hash) ^ bus.values.hash();
            Ok([expect.rank as u64, n, lr, ls, hash, bus.layout.hash()])
        })?;
        let mut core = core;
        core.comms.as_mut().expect("live").leaders = leaders;
        core.guard(|_| match i32::try_from(env_node) {
            Ok(_) => Ok(()),
            Err(_) => Err(Error::Mpi {
                what: format!("node id {env_node} does not fit a C int"),
                hint: "use node ids below 2^31".into(),
            }),
        })?;
        let leader = bus.local_rank == 0;
        let nb = bus.layout.buckets.len();
        let biggest = bus.layout.buckets.iter().map(|b| b.range.len()).max().unwrap_or(0);
        let bus = core.guard(|_| ShmBus::open(bus))?;
        Ok(HierTransport {
            bus,
            scratch: if leader { vec![0.0; biggest] } else { Vec::new() },
            reduced: vec![Health::default(); nb],
            hashes: vec![0; nb],
            ops: Fnv::default(),
            rank: expect.rank,
            world: expect.world,
            agreement,
            core,
        })
    }

    /// This rank's progress cell in its node's segment (`ShmBus::progress_writer`).
    pub fn progress_writer(&self) -> Result<ProgressWriter, Error> {
        self.bus.progress_writer()
    }

    /// Call `hook` inside every node reduce (`ShmBus::set_inside_reduce_hook`).
    pub fn set_inside_reduce_hook(&mut self, hook: Box<dyn FnMut(StepId, usize) + Send + Sync>) {
        self.bus.set_inside_reduce_hook(hook)
    }

    fn step(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
        self.bus.reduce_bucket_to(at, bucket, 0)?;
        if let Some(leaders) = &self.core.comms().leaders {
            let r = self.bus.layout().buckets[bucket].range.clone();
            // Between `reduce_bucket_to` and `broadcast_bucket` no peer touches the leader's slot.
            // SAFETY: the bucket's range of this rank's slot (`grads_ptr` is `layout.len` f32s),
            // and only it: backward may hold views of the rest (`Transport::allreduce_bucket`).
            let g = unsafe { std::slice::from_raw_parts_mut(self.bus.grads_ptr().add(r.start), r.len()) };
            let out = &mut self.scratch[..r.len()];
            allreduce_sum(leaders, g, out);
            self.reduced[bucket] = health_scan(out);
            self.hashes[bucket] = combine(&[checksum(out)]);
            g.copy_from_slice(out);
        }
        self.bus.broadcast_bucket(at, bucket, 0)
    }
}

// SAFETY: the buffer is the shm bus's slot (its promises); the leader's exchange slices only the
// bucket's range (`step`).
unsafe impl Transport for HierTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn layout(&self) -> &Layout {
        self.bus.layout()
    }
    fn grads_ptr(&mut self) -> *mut f32 {
        self.bus.grads_ptr()
    }
    fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
        fold_op(&mut self.ops, "reduce", at, Some(bucket));
        let r = self.step(at, bucket);
        if r.is_err() {
            self.core.failed = true;
        }
        r
    }
    fn agree(&mut self, at: StepId, local: LocalScalars) -> Result<HealthTable, Error> {
        fold_op(&mut self.ops, "agree", at, None);
        let ops = std::mem::take(&mut self.ops).0;
        let r = (|| {
            // The node's summary (a full node table only when the node shows an anomaly). Its
            // leader contributes it, with the global reduce's health in place of the node's;
            // the other ranks contribute nothing but their collective hash.
            let node = self.bus.agree(at, local.clone())?;
            let leader = self.core.comms().leaders.is_some();
            let red = leader.then_some((&self.reduced[..], &self.hashes[..]));
            let mut mine = Summary::empty(node.buckets, node.summary.names());
            if let Some((red, hashes)) = red {
                mine = node.summary.clone();
                mine.clear_reduced();
                mine.set_reduced(red);
                mine.set_reference(hashes);
                // The node's statistics name its local ranks: every rank adds its own instead.
                mine.extremes.fill(Default::default());
            }
            let own = self.bus.last_local_stats(self.bus.rank());
            for (e, &(h, peak)) in mine.extremes.iter_mut().zip(&own) {
                e.add(self.rank, &BucketStat { sumsq: h.sumsq, peak });
            }
            let row = || own.iter().map(|&(h, p)| (h, peak_word(p))).unzip();
            agree_world(&self.core.comms().world, self.agreement, ops, mine, row, red, &local)
        })();
        self.reduced.fill(Health::default());
        self.hashes.fill(0);
        if r.is_err() {
            self.core.failed = true;
        }
        r
    }
    fn broadcast_from(&mut self, at: StepId, root: usize, data: &mut [f32]) -> Result<(), Error> {
        fold_op(&mut self.ops, "bcast", at, None);
        self.core.guard(|c| {
            broadcast_world(&c.comms().world, root, data);
            Ok(())
        })
    }
    fn mark_failed(&mut self) {
        self.core.failed = true;
        self.bus.mark_failed();
    }
}
