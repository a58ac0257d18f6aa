//! The device buses: what a device backend's gradients go through on their way to the optimizer.
//!
//! - The staged bus (`collectives::grads::Staged`: ranks sharing a GPU): each rank's device gradients go to
//!   the host, are summed there by the shared-memory bus in rank order, and come back. The reduced
//!   gradients must be, bit for bit, `reference::rank_ordered_sum` of the device gradients as backward
//!   released them. The same check runs with the CPU as the device on every machine
//!   (`staged_ranks_on_the_cpu_...`) and with 2 and 3 ranks sharing GPU 0 on a GPU.
//! - NCCL (a GPU per rank): world 1 runs the transport's whole protocol (stage, scan, one group of
//!   all-reduces and the allgather, agree) - at world 1 the all-reduce is the identity, so that test
//!   checks the protocol, not a sum. With 2 or more GPUs, `nccl_ranks_on_their_own_gpus_...` sums:
//!   NCCL adds in its own order (ring, tree or NVLS), so its sums are checked against the rank-order
//!   sum within `sum_bound` (derived there), every rank's bits equal, and two runs bitwise.
//!
//! Ranks are threads of this test process, each with its own transport (and its own `Gpu`); the
//! shared-memory segments are unlinked at the end. On a machine without a CUDA driver the GPU tests
//! print a `SKIPPED` line past the harness's capture and return (`GRADBUS_REQUIRE=cuda` makes that a
//! failure where a GPU is listed: scripts/gpu-check.d/20-buses); the multi-GPU test skips below two
//! GPUs with the capability `cuda2` (required by gpu-check.d/25-nccl-gpus).
#![cfg(feature = "cuda")]

use std::time::Duration;

use gradbus_collectives::grads::{GpuBus, GradBus, GradSlots, Staged};
use gradbus_collectives::nccl::{NcclConfig, NcclTransport};
use gradbus_collectives::{
    remove_job_segments, BusConfig, Error, HealthTable, Layout, LocalScalars, ParamSpec, ShmBus, StepId, Transport,
};
use gradbus_kernels::backend::{Backend, Cpu};
use gradbus_kernels::cuda::{self, Gpu};
use gradbus_kernels::reference::rank_ordered_sum;
use gradbus_kernels::rng::Rng;

#[path = "../../tests/common/skip.rs"]
mod skip;

use skip::skip;

fn config(dir: &std::path::Path, world: usize) -> NcclConfig {
    let params = [ParamSpec::new("a", 1000), ParamSpec::new("b", 70_000), ParamSpec::new("c", 5)];
    NcclConfig {
        rank: 0,
        world,
        device: 0,
        run_dir: dir.to_path_buf(),
        job_id: "nccl-test".into(),
        timeout: Duration::from_secs(10),
        config_hash: 42,
        layout: Layout::new(&params, 64 * 1024),
        values: Default::default(),
    }
}

/// Without libcuda, opening the transport is an error that says so, not a panic.
#[test]
fn without_a_driver_open_returns_no_cuda_driver() {
    if cuda::driver_present() {
        skip("no-cuda", "a CUDA driver is present (the no-driver path is tested on machines without one)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    match NcclTransport::open(config(dir.path(), 1)) {
        Err(Error::Cuda(gradbus_kernels::Error::NoCudaDriver(msg))) => assert!(msg.contains("libcuda"), "{msg}"),
        Err(e) => panic!("expected NoCudaDriver, got {e}"),
        Ok(_) => panic!("an NCCL transport without a driver"),
    }
    // Rank 0 failed before the rendezvous: no id file left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// `None` after a `SKIPPED` line when this machine has no CUDA driver or device.
fn no_gpu<T>(test: &str, r: Result<T, Error>) -> Option<T> {
    match r {
        Ok(t) => Some(t),
        Err(e @ Error::Cuda(gradbus_kernels::Error::NoCudaDriver(_) | gradbus_kernels::Error::NoCudaDevice(_))) => {
            skip("cuda", &format!("no CUDA driver or device ({test}: {e})"));
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

/// World size 1 on device 0: the transport's protocol end to end (stage, scan, the group of
/// all-reduces and the allgather, agree). Not a reduce test: at world 1 the sum is the identity.
#[test]
fn one_rank_runs_the_protocol_at_world_1() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut t) = no_gpu("one_rank_runs_the_protocol_at_world_1", NcclTransport::open(config(dir.path(), 1)))
    else {
        return;
    };
    let n = t.layout().len;
    let want: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
    t.grads().copy_from_slice(&want);
    let bad = t.layout().slots[1].offset + 123;
    t.grads()[bad] = f32::NAN;
    let at = StepId { step: 3, minibatch: 0, attempt: 0 };
    for b in 0..t.layout().buckets.len() {
        t.allreduce_bucket(at, b).unwrap();
    }
    let table = t.agree(at, LocalScalars { loss: 1.5, ..LocalScalars::default() }).unwrap();
    assert_eq!(table.world, 1);
    assert_eq!(table.reports[0].loss, 1.5);
    assert_eq!(table.local.iter().map(|h| h.nan).sum::<u64>(), 1);
    assert_eq!(table.local, table.reduced, "world 1: the reduced buckets are the local ones");
    let b = t.layout().slots[1].bucket;
    assert_eq!(table.cell(b, 0).first_bad, Some((bad - t.layout().buckets[b].range.start) as u64));
    let got = t.grads().to_vec();
    for i in 0..n {
        assert!(got[i].to_bits() == want[i].to_bits() || i == bad && got[i].is_nan(), "element {i}");
    }
}

// ---------------------------------------------------------------- several ranks

/// Parameters with ragged sizes across several buckets, and a 1-element one.
fn layout() -> Layout {
    let sizes = [1000, 1, 37, 5000, 70_001, 3];
    let specs: Vec<_> = sizes.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), n)).collect();
    Layout::new(&specs, 64 * 1024)
}

/// Rank `rank`'s gradient values of update `seed` (before the device's scale): magnitudes spread over
/// 10^-3..10^3, so that the order of a 3-term sum shows in its bits; rank 1 gets one NaN in `p3` on
/// odd seeds.
fn values(seed: u64, rank: usize, layout: &Layout) -> Vec<f32> {
    let mut rng = Rng::new(&[0x6b05, seed, rank as u64]);
    let mut x: Vec<f32> = (0..layout.len).map(|_| rng.normal() * 10f32.powi(rng.below(7) as i32 - 3)).collect();
    if rank == 1 && seed % 2 == 1 {
        x[layout.slots[3].offset + 17] = f32::NAN;
    }
    x
}

/// The scale the device applies to the written values (a kernel, so the gradients are the device's).
const SCALE: f32 = 1.0 / 3.0;

/// The backward of `update`: every parameter's slot written and scaled on the device, last first.
fn backward<B: Backend, S: GradSlots<B>>(be: &B, slots: &mut S, layout: &Layout, host: &[f32]) {
    for (p, s) in layout.slots.iter().enumerate().rev() {
        let mut v = slots.take(p);
        be.write(S::view_mut(&mut v), &host[s.range()]);
        be.scale(S::view_mut(&mut v), SCALE);
        slots.release(p, v);
    }
}

/// One update on `bus`: backward writes `host` into each parameter's device slot (last parameter
/// first) and scales it there; `local` receives each slot's device values as backward released it;
/// then the bus reduces every bucket. The same code for every device bus (`GradBus`).
fn update<B: Backend, G: GradBus<B>>(
    be: &B,
    bus: &mut G,
    at: StepId,
    host: &[f32],
    local: &mut [f32],
) -> Result<(), Error> {
    let layout = bus.transport().layout().clone();
    let mut fin =
        |p: usize, v: B::ViewMut<'_>| local[layout.slots[p].range()].copy_from_slice(&be.to_host(B::reborrow(&v)));
    bus.backward_and_reduce(be, at, false, &mut fin, |g| backward(be, g, &layout, host), &mut |_| {})
}

/// The reduced gradients the optimizer reads, downloaded.
fn reduced<B: Backend, G: GradBus<B>>(be: &B, bus: &mut G) -> Vec<f32> {
    let v = bus.reduced_grads(be);
    be.to_host(B::reborrow(&v)).into_owned()
}

/// What one rank saw in one update: its device gradients, its reduced gradients, the agreed table.
struct Seen {
    local: Vec<f32>,
    reduced: Vec<f32>,
    table: HealthTable,
}

/// One update `seed` of `world` ranks, each a thread with the backend and transport `open(rank)`
/// gives (`None`: it skipped). The updates run concurrently, as ranks do.
fn run_ranks<B, G, O>(world: usize, seed: u64, open: O) -> Option<Vec<Seen>>
where
    B: Backend,
    G: GradBus<B>,
    O: Fn(usize) -> Option<(B, G)> + Sync,
{
    let at = StepId { step: seed, minibatch: 0, attempt: 0 };
    let out: Vec<Option<Seen>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let open = &open;
                s.spawn(move || {
                    let (be, mut bus) = open(rank)?;
                    let layout = bus.transport().layout().clone();
                    let mut local = vec![f32::NAN; layout.len];
                    update(&be, &mut bus, at, &values(seed, rank, &layout), &mut local).unwrap();
                    let table = bus.transport_mut().agree(at, LocalScalars::default()).unwrap();
                    Some(Seen { reduced: reduced(&be, &mut bus), local, table })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    });
    out.into_iter().collect()
}

/// The gradient elements of `layout` (its slots' ranges; the padding between slots is no gradient).
fn elements(layout: &Layout) -> Vec<usize> {
    layout.slots.iter().flat_map(|s| s.range()).collect()
}

/// Equal bits, or both NaN.
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The checks every bus's update must pass: each rank's device gradients are the written values times
/// SCALE (bitwise: the scale kernel is), every rank holds the same reduced bits and the same table,
/// and the table names rank 1's NaN (odd seeds) in the bucket of `p3`. Returns the rank-order sum of
/// the device gradients.
fn check_common(seen: &[Seen], seed: u64, layout: &Layout, what: &str) -> Vec<f32> {
    for (r, s) in seen.iter().enumerate() {
        let want: Vec<f32> = values(seed, r, layout).iter().map(|x| x * SCALE).collect();
        let bad = elements(layout).into_iter().find(|&i| !same(s.local[i], want[i]));
        assert_eq!(bad, None, "{what}: rank {r}'s device gradients are not the written values times {SCALE}");
        assert!(
            elements(layout).into_iter().all(|i| same(s.reduced[i], seen[0].reduced[i])),
            "{what}: rank {r}'s reduced gradients differ from rank 0's"
        );
        assert_eq!(format!("{:?}", s.table), format!("{:?}", seen[0].table), "{what}: rank {r}'s table differs");
    }
    let t = &seen[0].table;
    let nan_ranks = if seed % 2 == 1 { vec![1] } else { vec![] };
    assert_eq!(t.nonfinite_ranks(), nan_ranks, "{what}: the table's non-finite ranks");
    if seed % 2 == 1 {
        let b = layout.slots[3].bucket;
        let want = (layout.slots[3].offset + 17 - layout.buckets[b].range.start) as u64;
        assert_eq!((t.cell(b, 1).nan, t.cell(b, 1).first_bad), (1, Some(want)), "{what}: rank 1's NaN in the table");
    }
    let locals: Vec<&[f32]> = seen.iter().map(|s| &s.local[..]).collect();
    rank_ordered_sum(&locals)
}

/// The staged bus's checks: the reduced gradients are bitwise the rank-order sum of the device
/// gradients; with 3 ranks the inputs are such that another order gives other bits (so the check
/// can tell the order).
fn check_staged<B: Backend, G: GradBus<B>>(
    world: usize,
    open_be: impl Fn() -> Option<B> + Sync,
    as_bus: impl Fn(Staged<B>) -> G + Sync,
    what: &str,
) -> bool {
    let job = format!("gpucheck-staged-{}-{world}", std::process::id());
    let mut ran = false;
    for seed in [1u64, 2] {
        let open = |rank| {
            let be = open_be()?;
            let mut cfg = BusConfig::new(job.clone(), rank, world, layout());
            cfg.timeout = Duration::from_secs(30);
            let bus = ShmBus::open(cfg).unwrap();
            let staged = as_bus(Staged::new(&be, Box::new(bus)));
            Some((be, staged))
        };
        let Some(seen) = run_ranks(world, seed, open) else { return ran };
        let lay = layout();
        let what = format!("{what}, {world} ranks, update {seed}");
        let sum = check_common(&seen, seed, &lay, &what);
        let bad = elements(&lay).into_iter().find(|&i| !same(seen[0].reduced[i], sum[i]));
        assert_eq!(bad, None, "{what}: the reduced gradients are not the rank-order sum of the device gradients");
        if world >= 3 {
            let rev: Vec<&[f32]> = seen.iter().rev().map(|s| &s.local[..]).collect();
            let other = rank_ordered_sum(&rev);
            assert!(
                elements(&lay).into_iter().any(|i| !same(other[i], sum[i])),
                "{what}: the inputs cannot tell the order"
            );
        }
        ran = true;
    }
    let _ = remove_job_segments(std::path::Path::new("/dev/shm"), &job);
    ran
}

/// The staged bus's logic with the CPU as the device: the code path of ranks sharing a GPU, on
/// every machine.
#[test]
fn staged_ranks_on_the_cpu_reduce_bitwise_the_rank_order_sum_of_their_device_gradients() {
    for world in [2, 3] {
        assert!(check_staged(world, || Some(Cpu), |s| s, "staged, the CPU as the device"));
    }
}

/// 2 and 3 ranks sharing GPU 0 through the staged bus (what `device = "cuda"` does with more ranks
/// than GPUs): bitwise the rank-order sum that the host transport computes of the device gradients.
#[test]
fn staged_ranks_sharing_gpu_0_reduce_bitwise_the_rank_order_sum_of_their_device_gradients() {
    if no_gpu("staged_ranks_sharing_gpu_0", Gpu::new(0).map_err(Error::Cuda)).is_none() {
        return;
    }
    for world in [2, 3] {
        let gpu0 = || Some(Gpu::new(0).unwrap());
        assert!(check_staged(world, gpu0, GpuBus::Staged, "staged, ranks sharing GPU 0 (GpuBus::Staged)"));
    }
}

/// Higham's bound on the error of any order of `n - 1` f32 additions: |fl(sum) - sum| <= gamma_{n-1}
/// sum |x_i|, gamma_k = k u / (1 - k u), u = 2^-24. NCCL's sum and the rank-order sum are two such
/// orders, each within it of the exact sum, so they differ by at most twice it. Non-finite exactly
/// where the rank-order sum is (the inputs here cannot overflow).
fn sum_bound(locals: &[&[f32]], i: usize) -> f32 {
    let k = (locals.len() - 1) as f64 * (f32::EPSILON as f64 / 2.0);
    let abs: f64 = locals.iter().map(|l| (l[i] as f64).abs()).sum();
    (2.0 * k / (1.0 - k) * abs) as f32
}

/// Where `got` is not within `sum_bound` of the rank-order sum `want` of `locals`: the first index.
fn outside_sum_bound(got: &[f32], want: &[f32], locals: &[&[f32]], layout: &Layout) -> Option<usize> {
    elements(layout).into_iter().find(|&i| {
        if !want[i].is_finite() || !got[i].is_finite() {
            return !same(got[i], want[i]);
        }
        (got[i] as f64 - want[i] as f64).abs() > sum_bound(locals, i) as f64
    })
}

/// The bound of `nccl_ranks_...` holds for other orders of the same sum and refuses a result a few
/// ulps outside it: it is neither vacuous nor too tight.
#[test]
fn the_sum_bound_admits_any_order_and_refuses_more() {
    let lay = layout();
    for world in [2usize, 3, 8] {
        let xs: Vec<Vec<f32>> = (0..world).map(|r| values(2, r, &lay)).collect();
        let locals: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
        let want = rank_ordered_sum(&locals);
        // Reverse order, and pairwise (a tree, as NCCL's tree and NVLS may add).
        let rev: Vec<&[f32]> = locals.iter().rev().copied().collect();
        assert_eq!(outside_sum_bound(&rank_ordered_sum(&rev), &want, &locals, &lay), None, "world {world}: reversed");
        let tree: Vec<f32> = (0..lay.len)
            .map(|i| {
                let mut v: Vec<f32> = locals.iter().map(|l| l[i]).collect();
                while v.len() > 1 {
                    v = v.chunks(2).map(|c| c.iter().sum()).collect();
                }
                v[0]
            })
            .collect();
        assert_eq!(outside_sum_bound(&tree, &want, &locals, &lay), None, "world {world}: pairwise");
        // One element off by twice the bound (and at least one ulp) is refused, NaN for a finite too.
        let mut off = want.clone();
        let i = 4321;
        let b = sum_bound(&locals, i).max(f32::EPSILON * want[i].abs());
        off[i] = want[i] + 2.0 * b;
        assert_eq!(outside_sum_bound(&off, &want, &locals, &lay), Some(i), "world {world}: a result outside");
        off[i] = f32::NAN;
        assert_eq!(outside_sum_bound(&off, &want, &locals, &lay), Some(i), "world {world}: NaN for a finite sum");
    }
}

/// NCCL with a GPU per rank, at world 2 and at the number of GPUs (up to 8): each rank's device
/// gradients summed by NCCL within `sum_bound` of their rank-order sum, the same bits on every rank,
/// the same table, and a second run of the same update gives the same bits. Skips (capability
/// `cuda2`) below two GPUs: NCCL refuses two ranks on one device.
#[test]
fn nccl_ranks_on_their_own_gpus_sum_within_the_bound_and_repeat_bitwise() {
    let gpus = match cuda::probe() {
        Ok(n) => n,
        Err(e) => {
            skip("cuda", &format!("no CUDA driver (nccl_ranks_on_their_own_gpus: {e})"));
            return;
        }
    };
    if gpus < 2 {
        skip("cuda2", &format!("NCCL at world >= 2 needs a GPU per rank; the driver sees {gpus}"));
        return;
    }
    let mut worlds = vec![2];
    if gpus.min(8) > 2 {
        worlds.push(gpus.min(8));
    }
    for world in worlds {
        let dir = tempfile::tempdir().unwrap();
        let mut runs = Vec::new();
        for (run, seed) in [(0, 1u64), (1, 1), (2, 2)] {
            let open = |rank: usize| {
                let be = Gpu::new(rank).unwrap();
                let cfg = NcclConfig {
                    rank,
                    device: rank,
                    job_id: format!("nccl-world-{world}-run-{run}"),
                    layout: layout(),
                    ..config(dir.path(), world)
                };
                Some((be, GpuBus::Nccl(NcclTransport::open(cfg).unwrap())))
            };
            let seen = run_ranks(world, seed, open).expect("no rank skips here");
            let lay = layout();
            let what = format!("NCCL world {world}, update {seed} (run {run})");
            let sum = check_common(&seen, seed, &lay, &what);
            let locals: Vec<&[f32]> = seen.iter().map(|s| &s.local[..]).collect();
            if let Some(i) = outside_sum_bound(&seen[0].reduced, &sum, &locals, &lay) {
                panic!(
                    "{what}: element {i}: NCCL {:e}, rank-order sum {:e}, bound {:e}",
                    seen[0].reduced[i],
                    sum[i],
                    sum_bound(&locals, i)
                );
            }
            let all = elements(&lay);
            let bitwise = all.iter().filter(|&&i| same(seen[0].reduced[i], sum[i])).count();
            eprintln!("{what}: {bitwise} of {} elements bitwise the rank-order sum, all within the bound", all.len());
            runs.push(seen.into_iter().next().unwrap().reduced);
        }
        let differ = elements(&layout()).into_iter().find(|&i| !same(runs[0][i], runs[1][i]));
        assert_eq!(differ, None, "NCCL world {world}: two runs of the same update differ");
    }
}
