//! The CUDA kernels of `kernels/cuda/*.cu`, compiled for the CPU with the shim
//! (`kernels/shim/cuda_shim.h`: real barriers between fiber threads, blocks one at a time), against
//! their CPU twins - every kernel the backend launches but the cuBLAS products, with the launch
//! shapes of `gradbus_kernels::cuda_grid`, on fresh random inputs with NaN, Inf and denormals
//! (`cuda_twins/mod.rs` has the checks and the tolerances); the GRPO loss with log-ratio gaps past
//! exp's overflow, so its kernels overflow exactly where ROLL's loss does. Every launch runs twice, blocks and
//! threads in index order and in reverse order, and the two must agree bitwise: a kernel whose
//! result depends on the schedule (a missing barrier, a race) fails here. Needs `g++` (else
//! `SKIPPED`, capability `cxx`); no GPU, no CUDA.

mod cuda_twins;
mod shim;

use std::ffi::c_int;

use cuda_twins::*;
use gradbus_kernels::cuda_grid::LOSS_STATS;
use gradbus_kernels::cuda_grid::{self, Launch};
use gradbus_kernels::health::Health;
use gradbus_kernels::ops::grpo::{K3_CLAMP, LOGRATIO_CLAMP};
use gradbus_kernels::ops::{AdamwScalars, GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};
use shim::{Lib, Libm};

/// Print past the harness's output capture (the tolerance measurement).
fn say(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}

type F = *mut f32;
type C = *const f32;
type U = *const u32;

/// Results compared bit for bit between the two schedules.
trait Bits {
    fn bits(&self) -> Vec<u64>;
}
impl Bits for Vec<f32> {
    fn bits(&self) -> Vec<u64> {
        self.iter().map(|x| x.to_bits() as u64).collect()
    }
}
impl Bits for Vec<u16> {
    fn bits(&self) -> Vec<u64> {
        self.iter().map(|&x| x as u64).collect()
    }
}
impl Bits for Vec<u32> {
    fn bits(&self) -> Vec<u64> {
        self.iter().map(|&x| x as u64).collect()
    }
}
impl Bits for Vec<u64> {
    fn bits(&self) -> Vec<u64> {
        self.clone()
    }
}
impl<A: Bits, B: Bits> Bits for (A, B) {
    fn bits(&self) -> Vec<u64> {
        [self.0.bits(), self.1.bits()].concat()
    }
}
impl<A: Bits, B: Bits, D: Bits> Bits for (A, B, D) {
    fn bits(&self) -> Vec<u64> {
        [self.0.bits(), self.1.bits(), self.2.bits()].concat()
    }
}

/// The kernels, run on the CPU by the shim, calling glibc's math library or one some ulps off it.
struct Shim {
    libm: Libm,
}

impl Shim {
    /// `None` after a `SKIPPED` line when there is no `g++`.
    fn new() -> Option<Shim> {
        Shim::with(Libm::Glibc)
    }

    /// The shim with the math library `libm` (`Libm::Off`: `expf`/`logf` some ulps from glibc's).
    fn with(libm: Libm) -> Option<Shim> {
        shim::lib_with("scale.cu", libm).map(|_| Shim { libm })
    }

    fn lib(&self, file: &'static str) -> &'static Lib {
        shim::lib_with(file, self.libm).expect("g++ was there a moment ago")
    }

    /// Kernel `name` of `file`.
    fn k<T: Copy>(&self, file: &'static str, name: &str) -> T {
        // SAFETY: every call site names `T` as the kernel's C signature (the `.cu` file beside it).
        unsafe { self.lib(file).sym::<T>(name) }
    }

    /// `run(reverse)` under both schedules, the two results bitwise equal; the result.
    fn orders<T: Bits>(&self, what: &str, run: impl Fn(bool) -> T) -> T {
        let (fwd, rev) = (run(false), run(true));
        assert!(fwd.bits() == rev.bits(), "shim: {what}: the result depends on the order of blocks and threads");
        fwd
    }

    fn launch(&self, file: &'static str, l: Launch, reverse: bool, call: &dyn Fn()) {
        self.lib(file).launch(l.grid, l.block, reverse, call);
    }

    fn health<T: Copy>(&self, kernel: &str, x: &[T]) -> Health {
        type K<T> = unsafe extern "C" fn(*const T, u64, *mut u64, *mut u32, *mut u64);
        let n = x.len() as u64;
        if n == 0 {
            return Health::default();
        }
        let k: K<T> = self.k("health.cu", kernel);
        let l = cuda_grid::health(n).unwrap();
        let row = self.orders(kernel, |rev| {
            let mut part = vec![0u64; 4 * cuda_grid::health_tiles(n) as usize];
            let (mut counter, mut out) = (0u32, vec![0u64; 4]);
            let (pp, cp, op) = (part.as_mut_ptr(), &mut counter as *mut u32, out.as_mut_ptr());
            // SAFETY: x has n elements, part 4 per tile, out 4 words (health.cu's contract).
            self.launch("health.cu", l, rev, &|| unsafe { k(x.as_ptr(), n, pp, cp, op) });
            assert_eq!(counter, 0, "{kernel}: the last block resets the counter");
            out
        });
        Health {
            nan: row[0],
            inf: row[1],
            sumsq: f64::from_bits(row[2]),
            first_bad: (row[3] != u64::MAX).then_some(row[3]),
        }
    }
}

impl Exec for Shim {
    fn name(&self) -> String {
        match self.libm {
            Libm::Glibc => "shim".into(),
            Libm::Off { ulps, spread: false } if ulps < 0 => format!("shim (expf, logf {} ulps down)", -ulps),
            Libm::Off { ulps, spread: false } => format!("shim (expf, logf {ulps} ulps up)"),
            Libm::Off { ulps, spread: true } => format!("shim (expf, logf -{ulps}..{ulps} ulps)"),
        }
    }
    fn cpu_libm(&self) -> bool {
        self.libm == Libm::Glibc
    }
    fn health_scan(&self, x: &[f32]) -> Health {
        self.health("health_scan_f32", x)
    }
    fn health_scan_bf16(&self, x: &[u16]) -> Health {
        self.health("health_scan_bf16", x)
    }
    fn scale(&self, x: &mut [f32], s: f32) {
        let k: unsafe extern "C" fn(F, u64, f32) = self.k("scale.cu", "scale_f32");
        let n = x.len() as u64;
        let y = self.orders("scale_f32", |rev| {
            let mut y = x.to_vec();
            let p = y.as_mut_ptr();
            // SAFETY: y has n elements.
            self.launch("scale.cu", cuda_grid::elementwise(n), rev, &|| unsafe { k(p, n, s) });
            y
        });
        x.copy_from_slice(&y);
    }
    fn scale_bf16(&self, x: &mut [u16], s: f32) {
        let k: unsafe extern "C" fn(*mut u16, u64, f32) = self.k("scale.cu", "scale_bf16");
        let n = x.len() as u64;
        let y = self.orders("scale_bf16", |rev| {
            let mut y = x.to_vec();
            let p = y.as_mut_ptr();
            // SAFETY: y has n elements.
            self.launch("scale.cu", cuda_grid::elementwise(n), rev, &|| unsafe { k(p, n, s) });
            y
        });
        x.copy_from_slice(&y);
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
        type K = unsafe extern "C" fn(F, C, F, F, u64, f32, f32, f32, f32, f32, f32, f32);
        let k: K = self.k("adamw.cu", "adamw_update_f32");
        let s = AdamwScalars::new(lr, beta1, beta2, weight_decay, t);
        let n = params.len() as u64;
        let (p, mm, vv) = self.orders("adamw_update_f32", |rev| {
            let (mut p, mut mm, mut vv) = (params.to_vec(), m.to_vec(), v.to_vec());
            let (pp, mp, vp) = (p.as_mut_ptr(), mm.as_mut_ptr(), vv.as_mut_ptr());
            let g = grads.as_ptr();
            // SAFETY: params, grads, m, v have n elements each.
            self.launch("adamw.cu", cuda_grid::elementwise(n), rev, &|| unsafe {
                k(pp, g, mp, vp, n, s.one_minus_beta1, beta2, s.one_minus_beta2, eps, s.decay, s.step_size, s.bc2_sqrt)
            });
            (p, mm, vv)
        });
        params.copy_from_slice(&p);
        m.copy_from_slice(&mm);
        v.copy_from_slice(&vv);
        self.checksum(params)
    }
    fn checksum(&self, x: &[f32]) -> u64 {
        let k: unsafe extern "C" fn(C, u64, *mut u32) = self.k("adamw.cu", "checksum_lanes_f32");
        let n = x.len() as u64;
        let lanes = self.orders("checksum_lanes_f32", |rev| {
            let mut lanes = vec![0u32; cuda_grid::CHECKSUM_LANES as usize];
            let lp = lanes.as_mut_ptr();
            // SAFETY: x has n elements, lanes 128.
            self.launch("adamw.cu", cuda_grid::checksum_lanes(), rev, &|| unsafe { k(x.as_ptr(), n, lp) });
            lanes
        });
        gradbus_kernels::checksum::fold(&lanes.try_into().unwrap(), n)
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
        let k: unsafe extern "C" fn(F, U, C, C, u64, u64, u64, u64) = self.k("encoder.cu", "encoder_forward_f32");
        let (bt, t, c, v) = ((b * t) as u64, t as u64, c as u64, v as u64);
        let o = self.orders("encoder_forward_f32", |rev| {
            let mut o = vec![0f32; out.len()];
            let op = o.as_mut_ptr();
            // SAFETY: out (B, T, C), tokens (B, T), wte (V, C), wpe (>= T, C).
            self.launch("encoder.cu", cuda_grid::elementwise(bt * c), rev, &|| unsafe {
                k(op, tokens.as_ptr(), wte.as_ptr(), wpe.as_ptr(), bt, t, c, v)
            });
            o
        });
        out.copy_from_slice(&o);
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
        let kte: unsafe extern "C" fn(F, C, U, U, U, u64) = self.k("encoder.cu", "encoder_backward_wte_f32");
        let kpe: unsafe extern "C" fn(F, C, u64, u64, u64) = self.k("encoder.cu", "encoder_backward_wpe_f32");
        let (rows, starts, order) = cuda_grid::token_rows(tokens, dwte.len() / c);
        let (bb, tt, cc) = (b as u64, t as u64, c as u64);
        let (te, pe) = self.orders("encoder_backward", |rev| {
            let (mut te, mut pe) = (dwte.to_vec(), dwpe.to_vec());
            let (tp, pp) = (te.as_mut_ptr(), pe.as_mut_ptr());
            let l = cuda_grid::per_row(rows.len() as u64, cuda_grid::ROW_THREADS).unwrap();
            // SAFETY: dwte (V, C) with every row id < V, the CSR lists of token_rows, dout (B, T, C).
            self.launch("encoder.cu", l, rev, &|| unsafe {
                kte(tp, dout.as_ptr(), rows.as_ptr(), starts.as_ptr(), order.as_ptr(), cc)
            });
            // SAFETY: dwpe (>= T, C), dout (B, T, C).
            self.launch("encoder.cu", cuda_grid::elementwise(tt * cc), rev, &|| unsafe {
                kpe(pp, dout.as_ptr(), bb, tt, cc)
            });
            (te, pe)
        });
        dwte.copy_from_slice(&te);
        dwpe.copy_from_slice(&pe);
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
        let k: unsafe extern "C" fn(F, F, F, C, C, C, u64) = self.k("layernorm.cu", "layernorm_forward_f32");
        let l = cuda_grid::per_row(n as u64, cuda_grid::ROW_THREADS).unwrap();
        let (o, m, r) = self.orders("layernorm_forward_f32", |rev| {
            let (mut o, mut m, mut r) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
            let (op, mp, rp) = (o.as_mut_ptr(), m.as_mut_ptr(), r.as_mut_ptr());
            // SAFETY: out, inp (N, C), mean, rstd (N), weight, bias (C).
            self.launch("layernorm.cu", l, rev, &|| unsafe {
                k(op, mp, rp, inp.as_ptr(), weight.as_ptr(), bias.as_ptr(), c as u64)
            });
            (o, m, r)
        });
        out[..n * c].copy_from_slice(&o);
        mean[..n].copy_from_slice(&m);
        rstd[..n].copy_from_slice(&r);
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
        let ki: unsafe extern "C" fn(F, C, C, C, C, C, u64) = self.k("layernorm.cu", "layernorm_backward_inp_f32");
        let kp: unsafe extern "C" fn(F, F, C, C, C, C, u64, u64) =
            self.k("layernorm.cu", "layernorm_backward_params_f32");
        let (d, w, b) = self.orders("layernorm_backward", |rev| {
            let (mut d, mut w, mut b) = (dinp.to_vec(), dweight.to_vec(), dbias.to_vec());
            let (dp, wp, bp) = (d.as_mut_ptr(), w.as_mut_ptr(), b.as_mut_ptr());
            let (o, x, g, m, r) = (dout.as_ptr(), inp.as_ptr(), weight.as_ptr(), mean.as_ptr(), rstd.as_ptr());
            let l = cuda_grid::per_row(n as u64, cuda_grid::ROW_THREADS).unwrap();
            // SAFETY: dinp, dout, inp (N, C), weight (C), mean, rstd (N).
            self.launch("layernorm.cu", l, rev, &|| unsafe { ki(dp, o, x, g, m, r, c as u64) });
            // SAFETY: dweight, dbias (C), dout, inp (N, C), mean, rstd (N).
            self.launch("layernorm.cu", cuda_grid::elementwise(c as u64), rev, &|| unsafe {
                kp(wp, bp, o, x, m, r, n as u64, c as u64)
            });
            (d, w, b)
        });
        dinp.copy_from_slice(&d);
        dweight.copy_from_slice(&w);
        dbias.copy_from_slice(&b);
    }
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32], n: usize) {
        self.unary("gelu.cu", "gelu_forward_f32", out, inp, n);
    }
    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32], n: usize) {
        self.binary_acc("gelu.cu", "gelu_backward_f32", dinp, inp, dout, n);
    }
    fn residual_forward(&self, out: &mut [f32], inp1: &[f32], inp2: &[f32], n: usize) {
        let k: unsafe extern "C" fn(F, C, C, u64) = self.k("residual.cu", "residual_forward_f32");
        let o = self.orders("residual_forward_f32", |rev| {
            let mut o = out.to_vec();
            let op = o.as_mut_ptr();
            // SAFETY: out, inp1, inp2 (N).
            self.launch("residual.cu", cuda_grid::elementwise(n as u64), rev, &|| unsafe {
                k(op, inp1.as_ptr(), inp2.as_ptr(), n as u64)
            });
            o
        });
        out.copy_from_slice(&o);
    }
    fn residual_backward(&self, dinp1: &mut [f32], dinp2: &mut [f32], dout: &[f32], n: usize) {
        let k: unsafe extern "C" fn(F, F, C, u64) = self.k("residual.cu", "residual_backward_f32");
        let (a, b) = self.orders("residual_backward_f32", |rev| {
            let (mut a, mut b) = (dinp1.to_vec(), dinp2.to_vec());
            let (ap, bp) = (a.as_mut_ptr(), b.as_mut_ptr());
            // SAFETY: dinp1, dinp2, dout (N).
            self.launch("residual.cu", cuda_grid::elementwise(n as u64), rev, &|| unsafe {
                k(ap, bp, dout.as_ptr(), n as u64)
            });
            (a, b)
        });
        dinp1.copy_from_slice(&a);
        dinp2.copy_from_slice(&b);
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
        type K = unsafe extern "C" fn(F, F, C, u64, u64, u64, u64, u64);
        let k: K = self.k("attention.cu", "attention_forward_f32");
        let l = cuda_grid::per_row((b * nh * (t - t0)) as u64, cuda_grid::ATTENTION_THREADS).unwrap();
        let (o, a) = self.orders("attention_forward_f32", |rev| {
            let (mut o, mut a) = (out.to_vec(), att.to_vec());
            let (op, ap) = (o.as_mut_ptr(), a.as_mut_ptr());
            let s = |x: usize| x as u64;
            // SAFETY: out (B, t - t0, C), att (B, NH, t - t0, t), inp (B, stride, 3C).
            self.launch("attention.cu", l, rev, &|| unsafe {
                k(op, ap, inp.as_ptr(), s(stride), s(t0), s(t), s(c), s(nh))
            });
            (o, a)
        });
        out.copy_from_slice(&o);
        att.copy_from_slice(&a);
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
        let ks: unsafe extern "C" fn(F, C, C, C, u64, u64, u64) =
            self.k("attention.cu", "attention_backward_scores_f32");
        let kq: unsafe extern "C" fn(F, C, C, u64, u64, u64, u64) = self.k("attention.cu", "attention_backward_dq_f32");
        let kkv: unsafe extern "C" fn(F, C, C, C, C, u64, u64, u64, u64) =
            self.k("attention.cu", "attention_backward_dkv_f32");
        let (bb, tt, cc, hh) = (b as u64, t as u64, c as u64, nh as u64);
        let d = self.orders("attention_backward", |rev| {
            let mut d = dinp.to_vec();
            let mut ds = vec![f32::NAN; b * nh * t * t];
            let (dp, sp) = (d.as_mut_ptr(), ds.as_mut_ptr());
            let (o, x, a) = (dout.as_ptr(), inp.as_ptr(), att.as_ptr());
            let rows = cuda_grid::per_row(bb * hh * tt, cuda_grid::ATTENTION_THREADS).unwrap();
            // SAFETY: dscore, att (B, NH, T, T), dout (B, T, C), inp and dinp (B, T, 3C).
            self.launch("attention.cu", rows, rev, &|| unsafe { ks(sp, o, x, a, tt, cc, hh) });
            let all = cuda_grid::elementwise(bb * tt * cc);
            self.launch("attention.cu", all, rev, &|| unsafe { kq(dp, sp, x, bb, tt, cc, hh) });
            self.launch("attention.cu", all, rev, &|| unsafe { kkv(dp, sp, o, x, a, bb, tt, cc, hh) });
            d
        });
        dinp.copy_from_slice(&d);
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
        let k: unsafe extern "C" fn(F, F, C, U, u64, u64) = self.k("softmax.cu", "logsoftmax_gather_forward_f32");
        let (lp, ls) = self.orders("logsoftmax_gather_forward_f32", |rev| {
            let (mut lp, mut ls) = (vec![0f32; n], vec![0f32; n]);
            let (pp, sp) = (lp.as_mut_ptr(), ls.as_mut_ptr());
            // SAFETY: logp, lse, targets (N), logits (N, V).
            self.launch("softmax.cu", cuda_grid::elementwise(n as u64), rev, &|| unsafe {
                k(pp, sp, logits.as_ptr(), targets.as_ptr(), n as u64, v as u64)
            });
            (lp, ls)
        });
        logp[..n].copy_from_slice(&lp);
        lse[..n].copy_from_slice(&ls);
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
        let k: unsafe extern "C" fn(F, C, C, C, U, u64, u64) = self.k("softmax.cu", "logsoftmax_gather_backward_f32");
        let d = self.orders("logsoftmax_gather_backward_f32", |rev| {
            let mut d = dlogits.to_vec();
            let dp = d.as_mut_ptr();
            // SAFETY: dlogits, logits (N, V), dlogp, lse, targets (N).
            self.launch("softmax.cu", cuda_grid::elementwise((n * v) as u64), rev, &|| unsafe {
                k(dp, dlogp.as_ptr(), logits.as_ptr(), lse.as_ptr(), targets.as_ptr(), n as u64, v as u64)
            });
            d
        });
        dlogits.copy_from_slice(&d);
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
        #[rustfmt::skip]
        type Fwd = unsafe extern "C" fn(C, C, C, C, C, u64, u64, i32, f32, f32, f32, f32, f32, F, F, F, F, F, F, F, F);
        type Reduce = unsafe extern "C" fn(C, C, C, C, C, C, C, u64, u64, i32, f32, f32, f32, f32, F);
        let fwd: Fwd = self.k("loss.cu", "grpo_forward_f32");
        let reduce: Reduce = self.k("loss.cu", "grpo_reduce_f32");
        let (n, t64) = ((b * t) as u64, t as u64);
        let (lim, lo, hi) = (if s.safe { LOGRATIO_CLAMP } else { f32::INFINITY }, 1.0 - s.clip, 1.0 + s.clip);
        let safe = s.safe as i32;
        let (sv, stats) = self.orders("grpo_forward", |rev| {
            let mut sv = saved.clone();
            let mut stats = vec![f32::NAN; LOSS_STATS];
            let GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms } = &mut sv;
            let p = [lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms].map(|x| x.as_mut_ptr());
            let sp = stats.as_mut_ptr();
            let (lp, mp, ap, op, rp) = (logp.as_ptr(), mask.as_ptr(), adv.as_ptr(), old.as_ptr(), reference.as_ptr());
            // SAFETY: every per-position buffer holds >= B T floats, adv B, stats LOSS_STATS.
            self.launch("loss.cu", cuda_grid::elementwise(n), rev, &|| unsafe {
                fwd(
                    lp, mp, ap, op, rp, n, t64, safe, lim, lo, hi, K3_CLAMP, s.kl_coef, p[0], p[1], p[2], p[3], p[4],
                    p[5], p[6], p[7],
                )
            });
            // p: lr1_raw 0, lr1 1, ratio 2, lr2_raw 3, lr2 4, e2 5, k3 6, terms 7.
            // SAFETY: as above; one thread.
            self.launch("loss.cu", cuda_grid::single(), rev, &|| unsafe {
                reduce(lp, mp, ap, p[0], p[3], p[2], p[6], n, t64, safe, lo, hi, K3_CLAMP, s.kl_coef, sp)
            });
            let GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms } = sv;
            (((lr1_raw, lr1, ratio), (lr2_raw, lr2, e2), (k3, terms)), stats)
        });
        let ((lr1_raw, lr1, ratio), (lr2_raw, lr2, e2), (k3, terms)) = sv;
        *saved = GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms };
        cuda_grid::grpo_stats(&stats)
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
        #[rustfmt::skip]
        type Bwd = unsafe extern "C" fn(C, C, u64, u64, i32, f32, f32, f32, f32, f32, f32, C, C, C, C, C, F, F, F);
        let bwd: Bwd = self.k("loss.cu", "grpo_backward_f32");
        let (n, t64) = ((b * t) as u64, t as u64);
        let (lim, lo, hi) = (if s.safe { LOGRATIO_CLAMP } else { f32::INFINITY }, 1.0 - s.clip, 1.0 + s.clip);
        let safe = s.safe as i32;
        let g = self.orders("grpo_backward", |rev| {
            let mut g = grads.clone();
            let gp = [g.d_lr1.as_mut_ptr(), g.d_lr2.as_mut_ptr(), g.dlogp.as_mut_ptr()];
            let sv = saved;
            let (r1, r2, ra, e2, k3) =
                (sv.lr1_raw.as_ptr(), sv.lr2_raw.as_ptr(), sv.ratio.as_ptr(), sv.e2.as_ptr(), sv.k3.as_ptr());
            // SAFETY: every per-position buffer holds >= B T floats, adv B.
            self.launch("loss.cu", cuda_grid::elementwise(n), rev, &|| unsafe {
                bwd(
                    mask.as_ptr(),
                    adv.as_ptr(),
                    n,
                    t64,
                    safe,
                    lim,
                    lo,
                    hi,
                    K3_CLAMP,
                    s.kl_coef,
                    denom,
                    r1,
                    r2,
                    ra,
                    e2,
                    k3,
                    gp[0],
                    gp[1],
                    gp[2],
                )
            });
            (g.d_lr1, g.d_lr2, g.dlogp)
        });
        *grads = GrpoGrads { d_lr1: g.0, d_lr2: g.1, dlogp: g.2 };
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
        let k: unsafe extern "C" fn(*mut u32, C, u64, u64, u64, f32, C) = self.k("sample.cu", "sample_f32");
        let o = self.orders("sample_f32", |rev| {
            let mut o = vec![u32::MAX; b];
            let op = o.as_mut_ptr();
            // SAFETY: out, uniforms (B), logits (B, T, V).
            self.launch("sample.cu", cuda_grid::elementwise(b as u64), rev, &|| unsafe {
                k(op, logits.as_ptr(), b as u64, t as u64, v as u64, temperature, uniforms.as_ptr())
            });
            o
        });
        out[..b].copy_from_slice(&o);
    }
    fn fill(&self, x: &mut [f32], value: f32) {
        let k: unsafe extern "C" fn(F, u64, f32) = self.k("scale.cu", "fill_f32");
        let n = x.len() as u64;
        let y = self.orders("fill_f32", |rev| {
            let mut y = x.to_vec();
            let p = y.as_mut_ptr();
            // SAFETY: y has n elements.
            self.launch("scale.cu", cuda_grid::elementwise(n), rev, &|| unsafe { k(p, n, value) });
            y
        });
        x.copy_from_slice(&y);
    }
    fn copy_2d(&self, dst: &mut [f32], dst_pitch: usize, src: &[f32], src_pitch: usize, width: usize, height: usize) {
        let k: unsafe extern "C" fn(F, u64, C, u64, u64, u64) = self.k("scale.cu", "copy_2d_f32");
        let (dp, sp, w, h) = (dst_pitch as u64, src_pitch as u64, width as u64, height as u64);
        let y = self.orders("copy_2d_f32", |rev| {
            let mut y = dst.to_vec();
            let p = y.as_mut_ptr();
            // SAFETY: the last row ends within both buffers (the check's shapes).
            self.launch("scale.cu", cuda_grid::elementwise(w * h), rev, &|| unsafe {
                k(p, dp, src.as_ptr(), sp, w, h)
            });
            y
        });
        dst.copy_from_slice(&y);
    }
}

impl Shim {
    /// out = f(inp), elementwise.
    fn unary(&self, file: &'static str, name: &str, out: &mut [f32], inp: &[f32], n: usize) {
        let k: unsafe extern "C" fn(F, C, u64) = self.k(file, name);
        let o = self.orders(name, |rev| {
            let mut o = out.to_vec();
            let op = o.as_mut_ptr();
            // SAFETY: out, inp (N).
            self.launch(file, cuda_grid::elementwise(n as u64), rev, &|| unsafe { k(op, inp.as_ptr(), n as u64) });
            o
        });
        out.copy_from_slice(&o);
    }

    /// dinp += f(inp, dout), elementwise.
    fn binary_acc(&self, file: &'static str, name: &str, dinp: &mut [f32], inp: &[f32], dout: &[f32], n: usize) {
        let k: unsafe extern "C" fn(F, C, C, u64) = self.k(file, name);
        let d = self.orders(name, |rev| {
            let mut d = dinp.to_vec();
            let dp = d.as_mut_ptr();
            // SAFETY: dinp, inp, dout (N).
            self.launch(file, cuda_grid::elementwise(n as u64), rev, &|| unsafe {
                k(dp, inp.as_ptr(), dout.as_ptr(), n as u64)
            });
            d
        });
        dinp.copy_from_slice(&d);
    }
}

#[test]
fn health_scan_f32_and_bf16_match_the_cpu_scan() {
    let Some(s) = Shim::new() else { return };
    check_health_scan(&s, false);
    check_health_scan_bf16(&s);
}

#[test]
fn scale_f32_and_bf16_are_bitwise_the_cpu_scale() {
    let Some(s) = Shim::new() else { return };
    check_scale(&s);
}

#[test]
fn adamw_and_the_replica_checksum_are_bitwise_the_cpus() {
    let Some(s) = Shim::new() else { return };
    check_adamw_and_checksum(&s);
}

#[test]
fn encoder_forward_and_backward_are_bitwise_the_cpus() {
    let Some(s) = Shim::new() else { return };
    check_encoder(&s);
}

#[test]
fn layernorm_forward_and_backward_are_bitwise_the_cpus() {
    let Some(s) = Shim::new() else { return };
    check_layernorm(&s);
}

#[test]
fn gelu_and_residual_are_bitwise_the_cpus() {
    let Some(s) = Shim::new() else { return };
    check_gelu_and_residual(&s);
}

#[test]
fn attention_forward_rows_and_backward_are_bitwise_the_cpus() {
    let Some(s) = Shim::new() else { return };
    check_attention(&s);
}

#[test]
fn logsoftmax_gather_forward_and_backward_are_bitwise_the_cpus() {
    let Some(s) = Shim::new() else { return };
    check_logsoftmax_gather(&s);
}

#[test]
fn the_grpo_loss_is_bitwise_the_cpus_in_both_styles_and_overflows_where_rolls_does() {
    let Some(s) = Shim::new() else { return };
    // The random gaps past 88.72 must give ROLL's failure (finite loss, NaN gradient) in some cases.
    let overflowed = check_grpo(&s);
    assert!(overflowed > 5, "roll: a finite loss with a non-finite gradient in only {overflowed} cases");
}

#[test]
fn the_seed_cases_masked_k3_overflow_gives_a_finite_loss_and_a_nan_gradient() {
    let Some(s) = Shim::new() else { return };
    check_seed_case(&s);
}

#[test]
fn the_sampler_picks_the_cpus_tokens() {
    let Some(s) = Shim::new() else { return };
    check_sample(&s);
}

#[test]
fn fill_and_copy_2d_are_exact() {
    let Some(s) = Shim::new() else { return };
    check_fill_and_copy_2d(&s);
}

/// The dense layer's own kernels (its products are cuBLAS's: `cuda.rs` checks those on a GPU): the
/// bias broadcast of forward and the row-order sum of backward, bitwise the CPU's.
#[test]
fn the_dense_layers_bias_kernels_are_bitwise_the_cpus() {
    let Some(s) = Shim::new() else { return };
    let fill: unsafe extern "C" fn(F, C, u64, u64) = s.k("matmul.cu", "bias_fill_f32");
    let back: unsafe extern "C" fn(F, C, u64, u64) = s.k("matmul.cu", "bias_backward_f32");
    let mut rng = gradbus_kernels::rng::Rng::new(&[0xc0da, 16]);
    for (case, &(bt, c, oc)) in [(1, 1, 1), (7, 13, 5), (36, 256, 768), (64, 64, 16), (5, 1024, 3)].iter().enumerate() {
        let (n, o) = (bt as u64, oc as u64);
        let bias = random_input(&mut rng, oc, 1);
        let out = s.orders("bias_fill_f32", |rev| {
            let mut out = vec![f32::NAN; bt * oc];
            let p = out.as_mut_ptr();
            // SAFETY: out (BT, OC), bias (OC).
            s.launch("matmul.cu", cuda_grid::elementwise(n * o), rev, &|| unsafe { fill(p, bias.as_ptr(), n, o) });
            out
        });
        // Forward with zero inputs is the bias broadcast (the CPU's matmul adds 0 x w to it).
        let mut want = vec![0f32; bt * oc];
        gradbus_kernels::ops::matmul_forward(&mut want, &vec![0.0; bt * c], &vec![0.0; oc * c], Some(&bias), bt, c, oc);
        assert_bitwise(&out, &want, &format!("shim: bias_fill case {case}"));
        let dout = random_input(&mut rng, bt * oc, 2);
        let init = random_input(&mut rng, oc, 0);
        let got = s.orders("bias_backward_f32", |rev| {
            let mut d = init.clone();
            let p = d.as_mut_ptr();
            // SAFETY: dbias (OC), dout (BT, OC).
            s.launch("matmul.cu", cuda_grid::elementwise(o), rev, &|| unsafe { back(p, dout.as_ptr(), n, o) });
            d
        });
        let (mut di, mut dw, mut db) = (vec![0f32; bt * c], vec![0f32; oc * c], init.clone());
        gradbus_kernels::ops::matmul_backward(
            &mut di,
            &mut dw,
            Some(&mut db),
            &dout,
            &vec![0.0; bt * c],
            &vec![0.0; oc * c],
            bt,
            c,
            oc,
        );
        assert_bitwise(&got, &db, &format!("shim: bias_backward case {case}"));
    }
}

/// The ops through `expf`/`logf` against the shim's math library: each op's check with its GPU
/// tolerance, the sampler's with its margin when `sampler`.
fn libm_checks(s: &Shim, sampler: bool) -> Vec<(&'static str, std::thread::Result<()>)> {
    let mut checks: Vec<(&'static str, fn(&dyn Exec))> = vec![
        ("gelu", check_gelu_and_residual),
        ("attention forward", check_attention),
        ("log-softmax-gather", check_logsoftmax_gather),
        ("grpo loss chain", |e| {
            check_grpo(e);
        }),
    ];
    if sampler {
        checks.push(("sampler", check_sample));
    }
    checks.iter().map(|&(op, f)| (op, std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(s))))).collect()
}

/// The sampler's check can fail in each of its cases: a wrong token in row 0 (a random draw) is
/// refused, with glibc's math library and with one 3 ulps off (where the check allows a token on the
/// other side of a boundary the draw lies within its margin of).
#[test]
fn the_sampler_check_can_fail_in_every_case() {
    for libm in [Libm::Glibc, Libm::Off { ulps: LIBM_ULPS as i32, spread: true }] {
        let Some(s) = Shim::with(libm) else { return };
        for case in 0..60 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_sample_upto(&s, Some(case))));
            assert!(r.is_err(), "{}: sample case {case}: a wrong token passed the check", s.name());
        }
    }
}

/// The measurement behind the GPU's tolerances of the ops through `expf`/`logf`: CUDA's `expf` is
/// within 2 ulp and `logf` within 1 ulp of the exact value, glibc's within 1, so the two differ by at
/// most `LIBM_ULPS` (3). With the shim's math library that far from glibc's - every result 3 ulps
/// up, 3 down, and spread over -3..3 - every op passes its tolerance and the sampler its margin (the
/// worst |kernel - CPU| / tolerance per op is printed: how much room each keeps); 4096 ulps off,
/// each op's check fails (the sampler's: `the_sampler_check_can_fail_in_every_case`).
#[test]
fn the_libm_tolerances_admit_a_math_library_3_ulps_off_and_refuse_4096() {
    let u = LIBM_ULPS as i32;
    for (ulps, spread) in [(u, false), (-u, false), (u, true)] {
        let Some(s) = Shim::with(Libm::Off { ulps, spread }) else { return };
        let _ = take_worst();
        for (op, r) in libm_checks(&s, true) {
            assert!(r.is_ok(), "{}: the {op} check refused a math library {LIBM_ULPS} ulps off", s.name());
        }
        for (op, worst) in take_worst() {
            let rtol = TOLS.iter().find(|t| t.op == op).map_or(f32::NAN, |t| t.rtol);
            say(&format!("TOLERANCE {}: {op}: rtol {rtol:e}, worst |kernel - CPU| / tolerance {worst:.3}", s.name()));
        }
    }
    let Some(s) = Shim::with(Libm::Off { ulps: 4096, spread: true }) else { return };
    for (op, r) in libm_checks(&s, false) {
        assert!(r.is_err(), "{}: the {op} check admitted a math library 4096 ulps off", s.name());
    }
    let _ = take_worst();
}

#[test]
fn the_read_only_baseline_reads_every_element() {
    let Some(s) = Shim::new() else { return };
    let k: unsafe extern "C" fn(C, u64, *mut u32) = s.k("health.cu", "read_only_f32");
    let mut rng = gradbus_kernels::rng::Rng::new(&[0xc0da, 12]);
    for n in [1usize, 100, 32_768, 100_001] {
        let x = random_input(&mut rng, n, 2);
        let l = cuda_grid::health(n as u64).unwrap();
        let words = s.orders("read_only_f32", |rev| {
            let mut part = vec![0u32; l.grid.0 as usize];
            let p = part.as_mut_ptr();
            // SAFETY: x has n elements, part one word per tile.
            s.launch("health.cu", l, rev, &|| unsafe { k(x.as_ptr(), n as u64, p) });
            part
        });
        let want = x.iter().fold(0u32, |a, v| a ^ v.to_bits());
        assert_eq!(words.iter().fold(0, |a, w| a ^ w), want, "n {n}");
    }
}

/// The shim itself: a block whose threads do not all reach a barrier is refused, as CUDA leaves it
/// undefined; and a kernel that reads shared memory without a barrier gives different results
/// under the two schedules, which `Shim::orders` reports.
#[test]
fn the_shim_refuses_a_divergent_barrier_and_exposes_a_missing_one() {
    let Some(s) = Shim::new() else { return };
    // The kernels below live in kernels/shim/selftest.cu.
    let k: unsafe extern "C" fn(*mut c_int) = s.k("selftest.cu", "divergent_barrier");
    let mut x = 0;
    let p = &mut x as *mut c_int;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: divergent_barrier(int *x) writes x[0] from thread 0 only.
        s.launch("selftest.cu", Launch { grid: (1, 1, 1), block: (64, 1, 1) }, false, &|| unsafe { k(p) })
    }));
    assert!(r.is_err(), "a barrier that half the block skips must be refused");
    let k: unsafe extern "C" fn(*mut c_int) = s.k("selftest.cu", "missing_barrier");
    let run = |rev| {
        let mut out = vec![0u32; 64];
        let p = out.as_mut_ptr() as *mut c_int;
        // SAFETY: missing_barrier(int *out) writes out[threadIdx.x], 64 threads.
        s.launch("selftest.cu", Launch { grid: (1, 1, 1), block: (64, 1, 1) }, rev, &|| unsafe { k(p) });
        out
    };
    assert_ne!(run(false), run(true), "a read of shared memory before the barrier must depend on the schedule");
}
