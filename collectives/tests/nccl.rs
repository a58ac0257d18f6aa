//! The NCCL transport. On a machine without a CUDA driver only the no-driver path runs (the others
//! print a `SKIPPED` line past the harness's capture and return). With one GPU, a world of one rank
//! runs the whole protocol: stage, scan, one group of all-reduces + allgather, agree.
#![cfg(feature = "cuda")]

use std::time::Duration;

use gradbus_collectives::nccl::{NcclConfig, NcclTransport};
use gradbus_collectives::{Error, Layout, LocalReport, ParamSpec, StepId, Transport};
use gradbus_kernels::cuda;

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

/// World size 1 on device 0: the sum is the identity, the table is the local scan.
#[test]
fn one_rank_reduces_and_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = match NcclTransport::open(config(dir.path(), 1)) {
        Ok(t) => t,
        Err(e @ Error::Cuda(gradbus_kernels::Error::NoCudaDriver(_))) => {
            skip("cuda", &format!("no CUDA driver (nccl one_rank_reduces_and_agrees: {e})"));
            return;
        }
        Err(e) => panic!("{e}"),
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
    let table = t.agree(at, LocalReport { loss: 1.5, ..LocalReport::default() }).unwrap();
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
