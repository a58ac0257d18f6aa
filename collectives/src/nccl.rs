//! The NCCL transport (feature `cuda`): one NCCL communicator per job over every rank's GPU.
//!
//! Run at world size 1 only: `tests/nccl.rs`'s world-1 test passed on an H200 (`scripts/gpu-check.sh
//! --prebuilt`, see FIELD-NOTES); on a machine without a CUDA driver `open` returns
//! `Error::Cuda(NoCudaDriver)`. Two or more ranks have not run yet: that needs a GPU per rank (NCCL
//! refuses two ranks on one device).
//!
//! ```text
//!  open:    rank 0: ncclGetUniqueId -> {run_dir}/nccl-{job_id}.id (temp file + rename)
//!           ranks 1..: poll for that file until the deadline
//!           every rank: ncclCommInitRank(world, id, rank) on device `device`;
//!           rank 0 removes the id file once the init (collective) has returned
//!  per bucket (allreduce_bucket):
//!           host slice -> device (kernel stream), fused health scan of the local values
//!           (the scan returns a host value: the stream is synchronized), bucket marked pending
//!  agree (once per update), on the communicator's own stream, as ONE NCCL group:
//!           ncclGroupStart
//!             ncclAllReduce(SUM, in place) of every pending bucket
//!             ncclAllGather of the fixed-size row of every rank:
//!               [op hash | config hash | layout hash | local health (4 words) x buckets | report (2 + values)]
//!               (`wire`'s row codec)
//!           ncclGroupEnd, stream synchronized
//!           reduced buckets: health scan (same kernel, same bits on every rank), device -> host
//!           every rank builds the same HealthTable from the same gathered rows
//! ```
//!
//! Invariants and caveats:
//! - The health table is agreed exactly as on the CPU transports: every rank decides from the same
//!   gathered rows (`decide` is pure), and a differing op sequence, config or layout is an
//!   `Error::Mismatch` on every rank.
//! - NCCL's all-reduce gives every rank the same bits (the final values are broadcast), so every
//!   rank scans the same reduced buckets and gets the same reduced health without exchanging it.
//!   Its order of additions is NCCL's choice (ring, tree or NVLS by size and topology), not the shm
//!   bus's rank order: a GPU run does not repeat a CPU run's bits.
//! - The local health is the GPU scan's: counts and first bad index equal the CPU's, the sum of
//!   squares may differ from `bucket_health` in its last bits (another order of exact additions),
//!   so a CPU replay cannot compare this transport's sums bitwise.
//! - Two ways in. A CPU workload writes `grads()`, a host buffer staged through the device per
//!   bucket (one copy in, one out). The CUDA backend writes the device buffer itself
//!   (`device_grads`, through `grads::GpuBus::Nccl`): its buckets are scanned and all-reduced where
//!   they are, and only the health rows cross to the host. All-reduces are deferred to `agree` (one
//!   group launch per update); launching each bucket's all-reduce as soon as it is ready, to
//!   overlap backward, is the next step.
//! - Deadlines: the id rendezvous has one (`timeout`); `ncclCommInitRank` and the collectives have
//!   none (blocking communicator): a rank that dies inside them leaves the others waiting until the
//!   launcher's supervision tears the job down.
//! - Every CUDA or NCCL library is looked for before it is called (cudarc panics on a missing one).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};
use gradbus_kernels::cuda::Gpu;
use gradbus_kernels::Health;

use crate::agreement::{LocalScalars, ValueNames};
use crate::layout::{Fnv, Layout};
use crate::transport::{AlignedBuf, Transport};
use crate::verdict::{HealthTable, Reduced, StepId};
use crate::Error;
use gradbus_kernels::checksum::{checksum, combine};

use crate::wire::{fold_op, table_of, RowShape};
/// Bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

/// What a rank needs to join the job's communicator.
#[derive(Clone, Debug)]
pub struct NcclConfig {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// CUDA device ordinal of this rank (its local rank, with one GPU per local rank).
    pub device: usize,
    /// A directory every rank can read and rank 0 can write (the job's run dir).
    pub run_dir: PathBuf,
    /// The job id, the same on every rank: names the id file.
    pub job_id: String,
    /// Deadline for rank 0's id to appear.
    pub timeout: Duration,
    /// Hash of the run's config, checked against every rank at each agreement.
    pub config_hash: u64,
    /// The flat buffer's layout, the same on every rank.
    pub layout: Layout,
    /// The workload values each rank reports in the agreement, the same on every rank.
    pub values: ValueNames,
}

fn nccl_err(what: &str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> Error + '_ {
    move |e| Error::Nccl { what: format!("{what}: {:?}", e.0), hint: "set NCCL_DEBUG=INFO for NCCL's own log".into() }
}

fn cuda_err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Nccl { what: format!("{what}: {e}"), hint: "a CUDA driver call failed".into() }
}

/// The id file of a job.
pub fn id_path(run_dir: &Path, job_id: &str) -> PathBuf {
    run_dir.join(format!("nccl-{job_id}.id"))
}

/// Rank 0: write the id atomically (temp file, fsync, rename), so a reader sees all of it or none.
fn publish_id(path: &Path, id: &Id) -> Result<(), Error> {
    let io = |what: String| move |source| Error::Io { what, source };
    let tmp = path.with_extension(format!("id.tmp.{}", std::process::id()));
    let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
    let mut f = fs::File::create(&tmp).map_err(io(format!("create {}", tmp.display())))?;
    f.write_all(&bytes).map_err(io(format!("write {}", tmp.display())))?;
    f.sync_all().map_err(io(format!("fsync {}", tmp.display())))?;
    fs::rename(&tmp, path).map_err(io(format!("rename {} -> {}", tmp.display(), path.display())))
}

/// Ranks 1..: wait for rank 0's id until the deadline.
fn await_id(path: &Path, timeout: Duration) -> Result<Id, Error> {
    let start = Instant::now();
    loop {
        if let Ok(bytes) = fs::read(path) {
            if bytes.len() == ID_BYTES {
                let mut internal = [0 as std::ffi::c_char; ID_BYTES];
                for (d, s) in internal.iter_mut().zip(&bytes) {
                    *d = *s as std::ffi::c_char;
                }
                return Ok(Id::uninit(internal));
            }
        }
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                phase: format!("nccl id rendezvous ({} never appeared)", path.display()),
                step: 0,
                bucket: None,
                missing: vec![0],
                secs: timeout.as_secs_f64(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A data-parallel transport over NCCL, one GPU per rank.
pub struct NcclTransport {
    cfg: NcclConfig,
    /// The kernels' device and stream (copies, health scans).
    gpu: Gpu,
    /// The communicator, on its own stream.
    comm: Comm,
    comm_stream: Arc<CudaStream>,
    /// What `grads()` returns: the workload's gradients, on the host.
    host: AlignedBuf,
    /// The same buffer on the device.
    dev: CudaSlice<f32>,
    /// Buckets staged since the last agreement, to be all-reduced in its group.
    pending: Vec<usize>,
    /// This update's gradients were written to `dev` by a device backend (`device_grads`): no copy
    /// from or back to the host buffer, only the health rows cross.
    device_resident: bool,
    local: Vec<Health>,
    ops: Fnv,
}

impl NcclTransport {
    /// Open the device, rendezvous on the NCCL id through `run_dir`, and join the communicator
    /// (collective over every rank). Without a CUDA driver: `Error::Cuda(NoCudaDriver)`, no panic.
    pub fn open(cfg: NcclConfig) -> Result<NcclTransport, Error> {
        let gpu = Gpu::new(cfg.device)?;
        // SAFETY: `is_culib_present` only tries `dlopen` on libnccl's names and closes what it
        // opened; loading a shared library runs its initialisers, which is what makes it unsafe.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(Error::Nccl {
                what: "libnccl.so could not be loaded".into(),
                hint: "cudarc looks for libnccl.so (or .so.12/.11/.10/.9/.1), never libnccl.so.2: link \
                       libnccl.so -> libnccl.so.2 in a folder on LD_LIBRARY_PATH (scripts/gpu-check.sh does)"
                    .into(),
            });
        }
        let path = id_path(&cfg.run_dir, &cfg.job_id);
        let id = if cfg.rank == 0 {
            let id = Id::new().map_err(nccl_err("ncclGetUniqueId"))?;
            publish_id(&path, &id)?;
            id
        } else {
            await_id(&path, cfg.timeout)?
        };
        let comm_stream = gpu.context().new_stream().map_err(cuda_err("cuStreamCreate"))?;
        // ncclCommInitRank works on the calling thread's current device.
        gpu.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let comm = Comm::from_rank(comm_stream.clone(), cfg.rank, cfg.world, id);
        if cfg.rank == 0 {
            // Success: every rank has read the id (the init returns only once all of them joined).
            // Failure: the id is dead. Either way the file goes.
            let _ = fs::remove_file(&path);
        }
        let comm = comm.map_err(nccl_err("ncclCommInitRank"))?;
        let dev = gpu.zeros::<f32>(cfg.layout.len)?;
        Ok(NcclTransport {
            host: AlignedBuf::zeros(cfg.layout.len),
            local: vec![Health::default(); cfg.layout.buckets.len()],
            pending: Vec::new(),
            device_resident: false,
            ops: Fnv::default(),
            gpu,
            comm,
            comm_stream,
            dev,
            cfg,
        })
    }

    /// One group: the pending all-reduces and the allgather of the rows. Returns every rank's row.
    fn exchange(&mut self, row: &[u64]) -> Result<Vec<u64>, Error> {
        let send = self.gpu.upload(row)?;
        let mut recv = self.gpu.zeros::<u64>(row.len() * self.cfg.world)?;
        // The uploads ran on the kernel stream; the group runs on the communicator's.
        self.gpu.synchronize()?;
        cudarc::nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let mut r = Ok(());
        for &b in &self.pending {
            let range = self.cfg.layout.buckets[b].range.clone();
            let mut view = self.dev.slice_mut(range);
            if let Err(e) = self.comm.all_reduce_in_place(&mut view, &ReduceOp::Sum) {
                r = Err(nccl_err("ncclAllReduce")(e));
                break;
            }
        }
        if r.is_ok() {
            r = self.comm.all_gather(&send, &mut recv).map(|_| ()).map_err(nccl_err("ncclAllGather"));
        }
        // End the group even after an error, so NCCL's group depth stays balanced.
        let end = cudarc::nccl::group_end().map(|_| ()).map_err(nccl_err("ncclGroupEnd"));
        r.and(end)?;
        // A host-side wait, not cudarc's event tracking: inside a group the collectives are
        // enqueued at ncclGroupEnd, after cudarc recorded its "written" events for the buffers.
        self.comm_stream.synchronize().map_err(cuda_err("cuStreamSynchronize (NCCL)"))?;
        self.gpu.download(&recv).map_err(Error::from)
    }
}

impl NcclTransport {
    /// The device gradient buffer, for a device backend that writes this update's gradients into it
    /// (`layout().len` floats on this transport's GPU). From this call to the next `agree` the
    /// buckets are reduced where they are: `allreduce_bucket` copies nothing from the host buffer
    /// and `agree` copies nothing back to it (the host buffer is stale; the backend reads the
    /// reduced gradients here).
    pub fn device_grads(&mut self) -> &mut CudaSlice<f32> {
        self.device_resident = true;
        &mut self.dev
    }
}

// SAFETY: the host staging buffer never moves; `allreduce_bucket` copies only its bucket's range.
unsafe impl Transport for NcclTransport {
    fn rank(&self) -> usize {
        self.cfg.rank
    }
    fn world(&self) -> usize {
        self.cfg.world
    }
    fn layout(&self) -> &Layout {
        &self.cfg.layout
    }
    fn grads_ptr(&mut self) -> *mut f32 {
        self.host.as_mut_ptr()
    }
    fn allreduce_bucket(&mut self, at: StepId, bucket: usize) -> Result<(), Error> {
        fold_op(&mut self.ops, "reduce", at, Some(bucket));
        let range = self.cfg.layout.buckets[bucket].range.clone();
        let mut view = self.dev.slice_mut(range.clone());
        if !self.device_resident {
            self.gpu
                .stream()
                .memcpy_htod(&*self.host.range_mut(range), &mut view)
                .map_err(cuda_err("copy bucket to device"))?;
        }
        self.local[bucket] = self.gpu.health_scan(&view)?;
        self.pending.push(bucket);
        Ok(())
    }
    fn agree(&mut self, at: StepId, report: LocalScalars) -> Result<HealthTable, Error> {
        fold_op(&mut self.ops, "agree", at, None);
        let ops = std::mem::take(&mut self.ops).0;
        let nb = self.local.len();
        let shape = RowShape::nccl(nb, self.cfg.values.len());
        let head = [ops, self.cfg.config_hash, self.cfg.layout.hash()];
        // No peaks: the device scan tallies none (the outlier rule stays off on this transport).
        let mine = shape.encode(&head, (&self.local, &vec![0; nb]), None, &report);
        let all = self.exchange(&mine)?;
        let pending = std::mem::take(&mut self.pending);
        let mut reduced = vec![Health::default(); nb];
        for &b in &pending {
            let range = self.cfg.layout.buckets[b].range.clone();
            let view = self.dev.slice(range.clone());
            reduced[b] = self.gpu.health_scan(&view)?;
            if !self.device_resident {
                self.gpu
                    .stream()
                    .memcpy_dtoh(&view, &mut self.host.as_mut_slice()[range])
                    .map_err(cuda_err("copy bucket to host"))?;
            }
        }
        self.gpu.synchronize()?;
        // The reference of each reduced bucket where it reached the host; 0 (unknown: no check of
        // the consumed copy) where it stays on the device.
        let reference: Vec<u64> = (0..nb)
            .map(|b| {
                let range = self.cfg.layout.buckets[b].range.clone();
                let on_host = pending.contains(&b) && !self.device_resident;
                if on_host {
                    combine(&[checksum(&self.host.as_slice()[range.clone()])])
                } else {
                    0
                }
            })
            .collect();
        self.device_resident = false;
        let rows = shape.rows(&all).map_err(|what| Error::Nccl {
            what,
            hint: "a transport bug: every rank gathers rows of one shape".into(),
        })?;
        for (j, r) in rows.iter().enumerate() {
            if r.head != head {
                return Err(Error::Mismatch {
                    rank: j,
                    theirs: format!("ops {:#018x}, config {:#018x}, layout {:#018x}", r.head[0], r.head[1], r.head[2]),
                    mine: format!("ops {:#018x}, config {:#018x}, layout {:#018x}", head[0], head[1], head[2]),
                });
            }
        }
        // The table path always: a single GPU per machine has not run this transport yet.
        let table = table_of(&rows, &self.cfg.values, Reduced { health: reduced, reference }, Some(ops));
        // Buckets not reduced in the next update report nothing, as on the bus.
        self.local.fill(Health::default());
        Ok(table)
    }
    /// Not over NCCL yet: a replica repair stops the job here.
    fn broadcast_from(&mut self, _at: StepId, _root: usize, _data: &mut [f32]) -> Result<(), Error> {
        Err(Error::Unsupported {
            what: "the NCCL transport cannot copy a replica from one rank to another yet".into(),
            hint: "replica repair runs over the shared-memory bus and MPI; set sdc.replicas = false to stop on a damaged replica without it".into(),
        })
    }
    /// No way to wake peers blocked in NCCL (blocking communicator; see the module doc): the
    /// launcher's supervision tears the job down.
    fn mark_failed(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id file is written whole (temp + rename) and read back byte for byte.
    #[test]
    fn the_unique_id_travels_through_the_run_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = id_path(dir.path(), "job-1");
        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
        for (i, c) in internal.iter_mut().enumerate() {
            *c = (i as u8).wrapping_mul(37) as std::ffi::c_char;
        }
        publish_id(&path, &Id::uninit(internal)).unwrap();
        let got = await_id(&path, Duration::from_secs(1)).unwrap();
        assert_eq!(got.internal(), &internal);
        // Nothing but the id file is left in the run dir.
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("nccl-job-1.id")]);
    }

    /// A rank whose rank 0 never publishes fails at the deadline, naming rank 0; a partial file
    /// (a writer that did not rename) is not taken for an id.
    #[test]
    fn a_missing_id_is_a_timeout_naming_rank_0() {
        let dir = tempfile::tempdir().unwrap();
        let path = id_path(dir.path(), "job-2");
        fs::write(&path, [1u8; 17]).unwrap();
        match await_id(&path, Duration::from_millis(100)) {
            Err(Error::Timeout { missing, phase, secs, .. }) => {
                assert_eq!(missing, vec![0]);
                assert!(phase.contains("nccl-job-2.id"), "{phase}");
                assert_eq!(secs, 0.1);
            }
            other => panic!("expected a timeout, got {:?}", other.map(|_| ())),
        }
    }

    /// A reader that finds a partial file keeps waiting, and takes the id once rank 0 has renamed
    /// it into place (the 60 s deadline only bounds a hang).
    #[test]
    fn a_partial_id_is_waited_past_until_the_whole_one_arrives() {
        let dir = tempfile::tempdir().unwrap();
        let path = id_path(dir.path(), "job-3");
        fs::write(&path, [1u8; 17]).unwrap();
        let internal = [7 as std::ffi::c_char; ID_BYTES];
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = {
            let path = path.clone();
            std::thread::spawn(move || {
                tx.send(()).unwrap();
                await_id(&path, Duration::from_secs(60)).map(|id| *id.internal())
            })
        };
        rx.recv().unwrap();
        publish_id(&path, &Id::uninit(internal)).unwrap();
        assert_eq!(reader.join().unwrap().unwrap(), internal);
    }
}
