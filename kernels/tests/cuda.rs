//! The CUDA backend on a GPU: every kernel against its CPU twin through `Gpu`'s own methods (the
//! checks and tolerances of `cuda_twins/mod.rs`, the same the CPU shim runs in `cuda_shim.rs`), the
//! NVRTC compile of every source, the no-driver path, and the health scan's bandwidth benchmark.
//! Without a CUDA driver (or device) every GPU test prints a `SKIPPED: ...` line and returns; the
//! test of the no-driver path runs instead. `GRADBUS_REQUIRE=cuda` turns those skips into failures
//! on a machine that has a GPU; `GRADBUS_REQUIRE=nvrtc` does the same for the compile test.
#![cfg(feature = "cuda")]

mod cuda_twins;

use std::io::Write;

#[path = "../../tests/common/skip.rs"]
mod skip;

use cuda_twins::*;
use gradbus_kernels::cuda::{self, CudaSlice, Gpu};
use gradbus_kernels::cuda_grid::SOURCES;
use gradbus_kernels::health::Health;
use gradbus_kernels::Error;
use skip::skip;

/// Print past the harness's output capture (numbers of the benchmark).
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// Device 0, or `None` after a `SKIPPED` line when this machine has no driver or no device.
fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e @ Error::NoCudaDriver(_)) => {
            skip("cuda", &format!("no CUDA driver ({test}: {e})"));
            None
        }
        Err(e @ Error::NoCudaDevice(_)) => {
            skip("cuda", &format!("no CUDA device ({test}: {e})"));
            None
        }
        Err(e) => panic!("{test}: a CUDA driver is present but the backend failed: {e}"),
    }
}

/// The kernels run by a GPU through `Gpu`'s methods: inputs uploaded, outputs downloaded.
struct OnGpu(Gpu);

impl OnGpu {
    fn up<T: cuda::Elem>(&self, x: &[T]) -> CudaSlice<T> {
        self.0.upload(x).unwrap()
    }
    fn down<T: cuda::Elem>(&self, d: &CudaSlice<T>, out: &mut [T]) {
        out.copy_from_slice(&self.0.download(d).unwrap());
    }
}

impl Exec for OnGpu {
    fn name(&self) -> String {
        self.0.name().unwrap_or_else(|_| "GPU".into())
    }
    fn cpu_libm(&self) -> bool {
        false
    }
    fn health_scan(&self, x: &[f32]) -> Health {
        self.0.health_scan(&self.up(x)).unwrap()
    }
    fn health_scan_bf16(&self, x: &[u16]) -> Health {
        self.0.health_scan_bf16(&self.up(x)).unwrap()
    }
    fn scale(&self, x: &mut [f32], s: f32) {
        let mut d = self.up(x);
        self.0.scale(&mut d, s).unwrap();
        self.down(&d, x);
    }
    fn scale_bf16(&self, x: &mut [u16], s: f32) {
        let mut d = self.up(x);
        self.0.scale_bf16(&mut d, s).unwrap();
        self.down(&d, x);
    }
    fn adamw_update(
        &self,
        params: &mut [f32],
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        t: u64,
    ) -> u64 {
        let (mut p, g, mut dm, mut dv) = (self.up(params), self.up(grads), self.up(m), self.up(v));
        let sum = self.0.adamw_update(&mut p, &g, &mut dm, &mut dv, lr, beta1, beta2, eps, weight_decay, t).unwrap();
        self.down(&p, params);
        self.down(&dm, m);
        self.down(&dv, v);
        sum
    }
    fn checksum(&self, x: &[f32]) -> u64 {
        self.0.checksum(&self.up(x)).unwrap()
    }
    fn encoder_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        wpe: &[f32],
        b: usize,
        t: usize,
        c: usize,
        v: usize,
    ) {
        let mut o = self.up(out);
        self.0.encoder_forward(&mut o, &self.up(tokens), &self.up(wte), &self.up(wpe), b, t, c, v).unwrap();
        self.down(&o, out);
    }
    fn encoder_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        tokens: &[u32],
        b: usize,
        t: usize,
        c: usize,
    ) {
        let (mut e, mut p) = (self.up(dwte), self.up(dwpe));
        self.0.encoder_backward(&mut e, &mut p, &self.up(dout), tokens, b, t, c).unwrap();
        self.down(&e, dwte);
        self.down(&p, dwpe);
    }
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: &[f32],
        n: usize,
        c: usize,
    ) {
        let (mut o, mut m, mut r) = (self.up(out), self.up(mean), self.up(rstd));
        self.0
            .layernorm_forward(&mut o, &mut m, &mut r, &self.up(inp), &self.up(weight), &self.up(bias), n, c)
            .unwrap();
        self.down(&o, out);
        self.down(&m, mean);
        self.down(&r, rstd);
    }
    fn layernorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        n: usize,
        c: usize,
    ) {
        let (mut d, mut w, mut b) = (self.up(dinp), self.up(dweight), self.up(dbias));
        let (o, x, g, m, r) = (self.up(dout), self.up(inp), self.up(weight), self.up(mean), self.up(rstd));
        self.0.layernorm_backward(&mut d, &mut w, &mut b, &o, &x, &g, &m, &r, n, c).unwrap();
        self.down(&d, dinp);
        self.down(&w, dweight);
        self.down(&b, dbias);
    }
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32], n: usize) {
        let mut o = self.up(out);
        self.0.gelu_forward(&mut o, &self.up(inp), n).unwrap();
        self.down(&o, out);
    }
    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32], n: usize) {
        let mut d = self.up(dinp);
        self.0.gelu_backward(&mut d, &self.up(inp), &self.up(dout), n).unwrap();
        self.down(&d, dinp);
    }
    fn residual_forward(&self, out: &mut [f32], inp1: &[f32], inp2: &[f32], n: usize) {
        let mut o = self.up(out);
        self.0.residual_forward(&mut o, &self.up(inp1), &self.up(inp2), n).unwrap();
        self.down(&o, out);
    }
    fn residual_backward(&self, dinp1: &mut [f32], dinp2: &mut [f32], dout: &[f32], n: usize) {
        let (mut a, mut b) = (self.up(dinp1), self.up(dinp2));
        self.0.residual_backward(&mut a, &mut b, &self.up(dout), n).unwrap();
        self.down(&a, dinp1);
        self.down(&b, dinp2);
    }
    fn attention_forward_rows(
        &self,
        out: &mut [f32],
        att: &mut [f32],
        inp: &[f32],
        stride: usize,
        b: usize,
        t0: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let (mut o, mut a) = (self.up(out), self.up(att));
        self.0.attention_forward_rows(&mut o, &mut a, &self.up(inp), stride, b, t0, t, c, nh).unwrap();
        self.down(&o, out);
        self.down(&a, att);
    }
    fn attention_backward(
        &self,
        dinp: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        att: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        let mut d = self.up(dinp);
        self.0.attention_backward(&mut d, &self.up(dout), &self.up(inp), &self.up(att), b, t, c, nh).unwrap();
        self.down(&d, dinp);
    }
    fn logsoftmax_gather_forward(
        &self,
        logp: &mut [f32],
        lse: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        n: usize,
        v: usize,
    ) {
        let (mut p, mut s) = (self.up(&logp[..n]), self.up(&lse[..n]));
        self.0.logsoftmax_gather_forward(&mut p, &mut s, &self.up(logits), &self.up(targets), n, v).unwrap();
        self.down(&p, &mut logp[..n]);
        self.down(&s, &mut lse[..n]);
    }
    fn logsoftmax_gather_backward(
        &self,
        dlogits: &mut [f32],
        dlogp: &[f32],
        logits: &[f32],
        lse: &[f32],
        targets: &[u32],
        n: usize,
        v: usize,
    ) {
        let mut d = self.up(dlogits);
        let (g, l, s, t) = (self.up(dlogp), self.up(logits), self.up(lse), self.up(targets));
        self.0.logsoftmax_gather_backward(&mut d, &g, &l, &s, &t, n, v).unwrap();
        self.down(&d, dlogits);
    }
    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        bt: usize,
        c: usize,
        oc: usize,
    ) -> bool {
        let mut o = self.up(out);
        let bias = bias.map(|b| self.up(b));
        self.0
            .matmul_forward(
                &mut o,
                &self.up(inp),
                &self.up(weight),
                bias.as_ref().map(|b| b.slice(..)).as_ref(),
                bt,
                c,
                oc,
            )
            .unwrap();
        self.down(&o, out);
        true
    }
    fn matmul_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        bt: usize,
        c: usize,
        oc: usize,
    ) -> bool {
        let (mut di, mut dw) = (self.up(dinp), self.up(dweight));
        let mut db = dbias.as_ref().map(|b| self.up(b));
        let (o, x, w) = (self.up(dout), self.up(inp), self.up(weight));
        self.0
            .matmul_backward(&mut di, &mut dw, db.as_mut().map(|b| b.slice_mut(..)).as_mut(), &o, &x, &w, bt, c, oc)
            .unwrap();
        self.down(&di, dinp);
        self.down(&dw, dweight);
        if let (Some(host), Some(dev)) = (dbias, db.as_ref()) {
            self.down(dev, host);
        }
        true
    }
}

fn on_gpu(test: &str) -> Option<OnGpu> {
    gpu(test).map(OnGpu)
}

#[test]
fn health_scan_f32_and_bf16_match_the_cpu_scan() {
    let Some(g) = on_gpu("health_scan") else { return };
    check_health_scan(&g, true);
    check_health_scan_bf16(&g);
}

#[test]
fn health_scan_repeats_bitwise_and_a_row_stays_on_the_device() {
    let Some(g) = gpu("health_scan repeat") else { return };
    let mut rng = gradbus_kernels::rng::Rng::new(&[0xc0da, 13]);
    let x = random_input(&mut rng, 3_000_017, 40);
    let d = g.upload(&x).unwrap();
    let first = g.health_scan(&d).unwrap();
    for _ in 0..3 {
        assert_eq!(g.health_scan(&d).unwrap().sumsq.to_bits(), first.sumsq.to_bits(), "not repeatable");
    }
    let mut row = g.zeros::<u64>(4).unwrap();
    g.health_scan_into(&d, &mut row).unwrap();
    assert_eq!(cuda::health_of_row(&g.download(&row).unwrap()), first);
}

#[test]
fn scale_f32_and_bf16_are_bitwise_the_cpu_scale() {
    let Some(g) = on_gpu("scale") else { return };
    check_scale(&g);
}

#[test]
fn adamw_and_the_replica_checksum_are_bitwise_the_cpus() {
    let Some(g) = on_gpu("adamw_update") else { return };
    check_adamw_and_checksum(&g);
}

#[test]
fn encoder_forward_and_backward_are_bitwise_the_cpus() {
    let Some(g) = on_gpu("encoder") else { return };
    check_encoder(&g);
}

#[test]
fn layernorm_forward_and_backward_are_bitwise_the_cpus() {
    let Some(g) = on_gpu("layernorm") else { return };
    check_layernorm(&g);
}

#[test]
fn gelu_within_exp_tolerance_and_residual_bitwise() {
    let Some(g) = on_gpu("gelu and residual") else { return };
    check_gelu_and_residual(&g);
}

#[test]
fn attention_forward_rows_and_backward_within_exp_tolerance() {
    let Some(g) = on_gpu("attention") else { return };
    check_attention(&g);
}

#[test]
fn logsoftmax_gather_forward_and_backward_within_exp_tolerance() {
    let Some(g) = on_gpu("logsoftmax_gather") else { return };
    check_logsoftmax_gather(&g);
}

#[test]
fn matmul_within_the_dot_product_bound_and_dbias_bitwise() {
    let Some(g) = on_gpu("matmul") else { return };
    assert!(check_matmul(&g), "the GPU runs the dense layer");
}

#[test]
fn adamw_update_rejects_mismatched_lengths() {
    let Some(g) = gpu("adamw_update lengths") else { return };
    let (mut p, gr, mut m, mut v) =
        (g.zeros::<f32>(8).unwrap(), g.zeros::<f32>(7).unwrap(), g.zeros(8).unwrap(), g.zeros(8).unwrap());
    let e = g.adamw_update(&mut p, &gr, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}

/// The `.cu` sources compile with NVRTC for the architectures gradbus targets, and export every
/// kernel the backend loads. Needs libnvrtc only (no driver, no GPU): scripts/test.sh points it at
/// the NVRTC of PyPI's `nvidia-cuda-nvrtc` (in target/pyvenv) on every commit.
#[test]
fn kernel_sources_compile_with_nvrtc() {
    for arch in ["compute_80", "compute_90"] {
        let ptx = match cuda::compile_sources(arch) {
            Ok(p) => p,
            Err(e @ Error::NoNvrtc(_)) => {
                skip("nvrtc", &format!("no NVRTC (kernel_sources_compile_with_nvrtc: {e})"));
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(ptx.len(), SOURCES.len(), "every source compiled");
        for ((file, ptx), src) in ptx.iter().zip(SOURCES) {
            assert_eq!(*file, src.file);
            for name in src.kernels {
                assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: no kernel {name} in {file}'s PTX");
            }
            // --fmad=false: no contraction to an f32 FMA (the health scan's one fma, on an exact
            // product, is f64). CUDA's own expf and logf use fmaf inside: files that call them
            // cannot be checked this way.
            if !src.text.contains("expf(") && !src.text.contains("logf(") {
                assert!(!ptx.contains("fma.rn.f32"), "{arch}: {file} was contracted to an f32 FMA");
            }
        }
    }
}

/// Without libcuda the API answers `NoCudaDriver`, it does not panic (cudarc itself would).
#[test]
fn without_a_driver_the_api_returns_no_cuda_driver() {
    if cuda::driver_present() {
        skip("no-cuda", "a CUDA driver is present (the no-driver path is tested on machines without one)");
        return;
    }
    assert!(matches!(cuda::probe(), Err(Error::NoCudaDriver(_))), "{:?}", cuda::probe());
    match Gpu::new(0) {
        Err(Error::NoCudaDriver(msg)) => assert!(msg.contains("libcuda"), "{msg}"),
        Err(e) => panic!("expected NoCudaDriver, got {e}"),
        Ok(_) => panic!("a Gpu without a driver"),
    }
}

/// The health scan's bandwidth against the read-only kernel of the same tiles and loads
/// (`read_only_f32`), both device-resident (no host copy, no sync inside the timed loop), in the
/// same run (`scripts/gpu-check.sh` runs it). A benchmark, not a test: it prints one `THROUGHPUT`
/// line per size and asserts nothing about the numbers.
#[test]
#[ignore = "benchmark: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn health_scan_throughput() {
    let Some(g) = gpu("health_scan_throughput") else { return };
    say(&format!("device: {}", g.name().unwrap_or_default()));
    for mib in [256usize, 1024] {
        let n = mib << 18; // f32 elements
        let mut rng = gradbus_kernels::rng::Rng::new(&[0xc0da, 14]);
        let src = g.upload(&scaled_input(&mut rng, n, 1.0, 0)).unwrap();
        let mut row = g.zeros::<u64>(4).unwrap();
        let time = |f: &mut dyn FnMut()| {
            for _ in 0..3 {
                f();
            }
            g.synchronize().unwrap();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                for _ in 0..20 {
                    f();
                }
                g.synchronize().unwrap();
                best = best.min(t0.elapsed().as_secs_f64() / 20.0);
            }
            best
        };
        let t_read = time(&mut || g.read_only(&src).unwrap());
        let t_scan = time(&mut || g.health_scan_into(&src, &mut row).unwrap());
        let bytes = (n * 4) as f64;
        let (read, scan) = (bytes / t_read / 1e9, bytes / t_scan / 1e9);
        say(&format!(
            "THROUGHPUT {mib} MiB: health_scan {scan:.0} GB/s ({:.1} us) | read_only {read:.0} GB/s ({:.1} us) | scan/read {:.0}%",
            t_scan * 1e6,
            t_read * 1e6,
            100.0 * scan / read
        ));
        let _ = src.len();
    }
}
