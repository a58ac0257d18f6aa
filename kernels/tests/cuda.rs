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
use gradbus_kernels::backend::Backend;
use gradbus_kernels::cuda::{self, CudaSlice, Gpu};
use gradbus_kernels::cuda_grid::SOURCES;
use gradbus_kernels::health::Health;
use gradbus_kernels::ops::{GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};
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

/// The kernels run by a GPU through the CUDA backend's `Backend` methods (the API the model calls;
/// bf16 through `Gpu`'s own): inputs uploaded, outputs downloaded.
struct OnGpu(Gpu);

/// `Backend`'s methods on a `Gpu` (inherent methods of the same names take other arguments).
type Be = Gpu;

impl OnGpu {
    fn up<T: cuda::Elem>(&self, x: &[T]) -> CudaSlice<T> {
        self.0.upload(x).unwrap()
    }
    fn down<T: cuda::Elem>(&self, d: &CudaSlice<T>, out: &mut [T]) {
        out.copy_from_slice(&self.0.download(d).unwrap());
    }
    fn ids(&self, x: &[u32]) -> cuda::DeviceIds {
        let mut ids = <Be as Backend>::ids(&self.0, x.len());
        <Be as Backend>::upload_ids(&self.0, &mut ids, x);
        ids
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
        <Be as Backend>::health_scan(&self.0, self.up(x).slice(..))
    }
    fn health_scan_bf16(&self, x: &[u16]) -> Health {
        self.0.health_scan_bf16(&self.up(x)).unwrap()
    }
    fn scale(&self, x: &mut [f32], s: f32) {
        let mut d = self.up(x);
        <Be as Backend>::scale(&self.0, d.slice_mut(..), s);
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
        <Be as Backend>::checksum(&self.0, self.up(x).slice(..))
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
        let (e, p) = (self.up(wte), self.up(wpe));
        <Be as Backend>::encoder_forward(
            &self.0,
            o.slice_mut(..),
            &self.ids(tokens),
            e.slice(..),
            p.slice(..),
            b,
            t,
            c,
            v,
        );
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
        let (mut e, mut p, d) = (self.up(dwte), self.up(dwpe), self.up(dout));
        <Be as Backend>::encoder_backward(
            &self.0,
            e.slice_mut(..),
            p.slice_mut(..),
            d.slice(..),
            &self.ids(tokens),
            b,
            t,
            c,
        );
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
        let (x, w, bi) = (self.up(inp), self.up(weight), self.up(bias));
        <Be as Backend>::layernorm_forward(
            &self.0,
            o.slice_mut(..),
            m.slice_mut(..),
            r.slice_mut(..),
            x.slice(..),
            w.slice(..),
            bi.slice(..),
            n,
            c,
        );
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
        <Be as Backend>::layernorm_backward(
            &self.0,
            d.slice_mut(..),
            w.slice_mut(..),
            b.slice_mut(..),
            o.slice(..),
            x.slice(..),
            g.slice(..),
            m.slice(..),
            r.slice(..),
            n,
            c,
        );
        self.down(&d, dinp);
        self.down(&w, dweight);
        self.down(&b, dbias);
    }
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32], n: usize) {
        let (mut o, x) = (self.up(out), self.up(inp));
        <Be as Backend>::gelu_forward(&self.0, o.slice_mut(..), x.slice(..), n);
        self.down(&o, out);
    }
    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32], n: usize) {
        let (mut d, x, o) = (self.up(dinp), self.up(inp), self.up(dout));
        <Be as Backend>::gelu_backward(&self.0, d.slice_mut(..), x.slice(..), o.slice(..), n);
        self.down(&d, dinp);
    }
    fn residual_forward(&self, out: &mut [f32], inp1: &[f32], inp2: &[f32], n: usize) {
        let (mut o, a, b) = (self.up(out), self.up(inp1), self.up(inp2));
        <Be as Backend>::residual_forward(&self.0, o.slice_mut(..), a.slice(..), b.slice(..), n);
        self.down(&o, out);
    }
    fn residual_backward(&self, dinp1: &mut [f32], dinp2: &mut [f32], dout: &[f32], n: usize) {
        let (mut a, mut b, d) = (self.up(dinp1), self.up(dinp2), self.up(dout));
        <Be as Backend>::residual_backward(&self.0, a.slice_mut(..), b.slice_mut(..), d.slice(..), n);
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
        let (mut o, mut a, x) = (self.up(out), self.up(att), self.up(inp));
        if t0 == 0 && stride == t {
            <Be as Backend>::attention_forward(&self.0, o.slice_mut(..), a.slice_mut(..), x.slice(..), b, t, c, nh);
        } else {
            <Be as Backend>::attention_forward_rows(
                &self.0,
                o.slice_mut(..),
                a.slice_mut(..),
                x.slice(..),
                stride,
                b,
                t0,
                t,
                c,
                nh,
            );
        }
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
        let (mut d, o, x, a) = (self.up(dinp), self.up(dout), self.up(inp), self.up(att));
        <Be as Backend>::attention_backward(
            &self.0,
            d.slice_mut(..),
            o.slice(..),
            x.slice(..),
            a.slice(..),
            b,
            t,
            c,
            nh,
        );
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
        let (mut p, mut s, l) = (self.up(&logp[..n]), self.up(&lse[..n]), self.up(logits));
        <Be as Backend>::logsoftmax_gather_forward(
            &self.0,
            p.slice_mut(..),
            s.slice_mut(..),
            l.slice(..),
            &self.ids(targets),
            n,
            v,
        );
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
        let (mut d, g, l, s) = (self.up(dlogits), self.up(dlogp), self.up(logits), self.up(lse));
        <Be as Backend>::logsoftmax_gather_backward(
            &self.0,
            d.slice_mut(..),
            g.slice(..),
            l.slice(..),
            s.slice(..),
            &self.ids(targets),
            n,
            v,
        );
        self.down(&d, dlogits);
    }
    fn grpo_forward(
        &self,
        s: &GrpoScalars,
        logp: &[f32],
        mask: &[f32],
        adv: &[f32],
        old: &[f32],
        reference: &[f32],
        b: usize,
        t: usize,
        saved: &mut GrpoSaved<Vec<f32>>,
    ) -> GrpoStats {
        let (lp, m, a, o, r) = (self.up(logp), self.up(mask), self.up(adv), self.up(old), self.up(reference));
        let mut dev = saved.clone().map(|x| self.up(&x));
        let st = <Be as Backend>::grpo_forward(
            &self.0,
            s,
            lp.slice(..),
            m.slice(..),
            a.slice(..),
            o.slice(..),
            r.slice(..),
            b,
            t,
            &mut dev,
        );
        *saved = dev.map(|d| self.0.download(&d).unwrap());
        st
    }
    fn grpo_backward(
        &self,
        s: &GrpoScalars,
        mask: &[f32],
        adv: &[f32],
        saved: &GrpoSaved<Vec<f32>>,
        denom: f32,
        b: usize,
        t: usize,
        grads: &mut GrpoGrads<Vec<f32>>,
    ) {
        let (m, a) = (self.up(mask), self.up(adv));
        let sv = saved.clone().map(|x| self.up(&x));
        let mut g = grads.clone().map(|x| self.up(&x));
        <Be as Backend>::grpo_backward(&self.0, s, m.slice(..), a.slice(..), &sv, denom, b, t, &mut g);
        *grads = g.map(|d| self.0.download(&d).unwrap());
    }
    fn sample(
        &self,
        out: &mut [u32],
        logits: &[f32],
        b: usize,
        t: usize,
        v: usize,
        temperature: f32,
        uniforms: &[f32],
    ) {
        <Be as Backend>::sample(&self.0, out, self.up(logits).slice(..), b, t, v, temperature, uniforms);
    }
    fn fill(&self, x: &mut [f32], value: f32) {
        let mut d = self.up(x);
        <Be as Backend>::fill(&self.0, d.slice_mut(..), value);
        self.down(&d, x);
    }
    fn copy_2d(&self, dst: &mut [f32], dst_pitch: usize, src: &[f32], src_pitch: usize, width: usize, height: usize) {
        let (mut d, s) = (self.up(dst), self.up(src));
        <Be as Backend>::copy_2d(&self.0, d.slice_mut(..), dst_pitch, s.slice(..), src_pitch, width, height);
        self.down(&d, dst);
    }
}

impl ExecDense for OnGpu {
    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        bt: usize,
        c: usize,
        oc: usize,
    ) {
        let (mut o, x, w) = (self.up(out), self.up(inp), self.up(weight));
        let bias = bias.map(|b| self.up(b));
        <Be as Backend>::matmul_forward(
            &self.0,
            o.slice_mut(..),
            x.slice(..),
            w.slice(..),
            bias.as_ref().map(|b| b.slice(..)),
            bt,
            c,
            oc,
        );
        self.down(&o, out);
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
    ) {
        let (mut di, mut dw) = (self.up(dinp), self.up(dweight));
        let mut db = dbias.as_ref().map(|b| self.up(b));
        let (o, x, w) = (self.up(dout), self.up(inp), self.up(weight));
        <Be as Backend>::matmul_backward(
            &self.0,
            di.slice_mut(..),
            dw.slice_mut(..),
            db.as_mut().map(|b| b.slice_mut(..)),
            o.slice(..),
            x.slice(..),
            w.slice(..),
            bt,
            c,
            oc,
        );
        self.down(&di, dinp);
        self.down(&dw, dweight);
        if let (Some(host), Some(dev)) = (dbias, db.as_ref()) {
            self.down(dev, host);
        }
    }
}

fn on_gpu(test: &str) -> Option<OnGpu> {
    gpu(test).map(OnGpu)
}

/// The worst |kernel - CPU| / tolerance of each op the test just checked through `expf`/`logf`:
/// the GPU's own measurement beside the shim's (scripts/gpu-check.d/10-kernels puts it in the table).
fn say_worst(g: &OnGpu) {
    for (op, worst) in take_worst() {
        let rtol = TOLS.iter().find(|t| t.op == op).map_or(f32::NAN, |t| t.rtol);
        say(&format!("TOLERANCE {}: {op}: rtol {rtol:e}, worst |kernel - CPU| / tolerance {worst:.3}", g.name()));
    }
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
    say_worst(&g);
}

#[test]
fn attention_forward_rows_and_backward_within_exp_tolerance() {
    let Some(g) = on_gpu("attention") else { return };
    check_attention(&g);
    say_worst(&g);
}

#[test]
fn logsoftmax_gather_forward_and_backward_within_exp_tolerance() {
    let Some(g) = on_gpu("logsoftmax_gather") else { return };
    check_logsoftmax_gather(&g);
    say_worst(&g);
}

#[test]
fn matmul_within_the_dot_product_bound_and_dbias_bitwise() {
    let Some(g) = on_gpu("matmul") else { return };
    check_matmul(&g);
}

#[test]
fn the_grpo_loss_within_exp_tolerance_and_overflows_where_rolls_does() {
    let Some(g) = on_gpu("grpo") else { return };
    let overflowed = check_grpo(&g);
    say_worst(&g);
    assert!(overflowed > 5, "roll: a finite loss with a non-finite gradient in only {overflowed} cases");
}

#[test]
fn the_seed_cases_masked_k3_overflow_gives_a_finite_loss_and_a_nan_gradient() {
    let Some(g) = on_gpu("seed case") else { return };
    check_seed_case(&g);
}

#[test]
fn the_sampler_picks_the_cpus_tokens() {
    let Some(g) = on_gpu("sample") else { return };
    check_sample(&g);
}

#[test]
fn fill_and_copy_2d_are_exact() {
    let Some(g) = on_gpu("fill and copy_2d") else { return };
    check_fill_and_copy_2d(&g);
}

#[test]
fn two_runs_of_the_loss_chain_give_the_same_bits() {
    let Some(g) = on_gpu("repeatability") else { return };
    // The GPU against itself: the loss chain (its exps, its one-thread sums) twice, bit for bit.
    let mut rng = gradbus_kernels::rng::Rng::new(&[0x1055, 2]);
    for case in 0..8 {
        let c = LossCase::random(&mut rng, case);
        let s = GrpoScalars { safe: case % 2 == 1, clip: 0.2, kl_coef: 0.01 };
        let (a, b) = (run_loss(Some(&g), &s, &c), run_loss(Some(&g), &s, &c));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.dlogits), bits(&b.dlogits), "case {case}: dlogits");
        assert_eq!(bits(&stats_floats(&a.stats)), bits(&stats_floats(&b.stats)), "case {case}: stats");
    }
}

/// The optimizer's pass as the trainer calls it (`Backend::scaled_adamw`: the consumed gradients
/// hashed, scaled, AdamW) gives the CPU's one pass's bits: weights, moments and both checksums.
#[test]
fn scaled_adamw_is_bitwise_the_cpus() {
    let Some(g) = on_gpu("scaled_adamw") else { return };
    let n = 20_003;
    let wave = |k: f32, a: f32| (0..n).map(|i| a * (i as f32 * k).sin()).collect::<Vec<f32>>();
    let (p, gr, m) = (wave(0.37, 0.02), wave(1.3, 3e-3), wave(0.11, 1e-3));
    let v: Vec<f32> = wave(0.7, 1e-3).iter().map(|x| x * x).collect();
    let pieces = [0..8_192, 8_192..8_200, 8_200..n];
    let cpu = gradbus_kernels::backend::Cpu;
    let (mut cp, mut cg, mut cm, mut cv) = (p.clone(), gr.clone(), m.clone(), v.clone());
    let want = cpu.scaled_adamw(&mut cp, &mut cg, 0.3, &mut cm, &mut cv, 1e-3, 0.9, 0.999, 1e-8, 0.01, 5, &pieces);
    let (mut dp, mut dg, mut dm, mut dv) = (g.up(&p), g.up(&gr), g.up(&m), g.up(&v));
    let (a, b, c, d) = (dp.slice_mut(..), dg.slice_mut(..), dm.slice_mut(..), dv.slice_mut(..));
    let got = <Be as Backend>::scaled_adamw(&g.0, a, b, 0.3, c, d, 1e-3, 0.9, 0.999, 1e-8, 0.01, 5, &pieces);
    assert_eq!(got, want, "the weights' checksum and the consumed pieces' checksums");
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (d, want, what) in [(&dp, &cp, "weights"), (&dm, &cm, "m"), (&dv, &cv, "v")] {
        let mut host = vec![0f32; n];
        g.down(d, &mut host);
        assert_eq!(bits(&host), bits(want), "{what}");
    }
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

/// Every source compiles to machine code for the GPUs gradbus targets (A100, H100/H200), as the
/// backend loads it (a CUBIN: no PTX JIT in the driver). Needs libnvrtc only.
#[test]
fn kernel_sources_compile_to_cubins_with_nvrtc() {
    for arch in ["sm_80", "sm_90"] {
        let bins = match cuda::compile_cubins(arch) {
            Ok(b) => b,
            Err(e @ Error::NoNvrtc(_)) => {
                skip("nvrtc", &format!("no NVRTC (kernel_sources_compile_to_cubins_with_nvrtc: {e})"));
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(bins.len(), SOURCES.len());
        for (file, size) in bins {
            assert!(size > 0, "{arch}: {file} gave an empty CUBIN");
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
