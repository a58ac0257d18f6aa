//! The model and loss against PyTorch: `tests/golden/gpt_grpo.bin`, written by
//! `tests/golden/make_golden.py` (weights, batch, logits, loss and every parameter gradient of the
//! safe loss; the loss and the per-element NaN pattern of the gradients of ROLL's loss with a 95-nat
//! k3 gap at a masked position). The Rust side loads the weights and inputs from the file, recomputes,
//! and compares per named tensor. A missing or malformed file fails the test.

use std::collections::BTreeMap;

use gradbus_collectives::{Layout, ParamGrads};
use gradbus_kernels::backend::Cpu;
use gradbus_worker::loss::{rl_loss_host, LossConfig, LossInputs, LossStyle};
use gradbus_worker::model::{param_specs, Activations, Gpt, GptConfig, NoProbe};

const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/golden/gpt_grpo.bin");

/// One record of the golden file.
struct Tensor {
    dtype: u8,
    dims: Vec<usize>,
    data: Vec<u8>,
}

impl Tensor {
    fn f32(&self) -> Vec<f32> {
        assert_eq!(self.dtype, 0);
        self.data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }
    fn i32(&self) -> Vec<i32> {
        assert_eq!(self.dtype, 1);
        self.data.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap())).collect()
    }
    fn u8(&self) -> &[u8] {
        assert_eq!(self.dtype, 2);
        &self.data
    }
}

/// A cursor over the file's bytes that panics, naming the offset, on a truncated file.
struct Reader {
    bytes: Vec<u8>,
    at: usize,
}

impl Reader {
    fn take(&mut self, n: usize) -> &[u8] {
        let at = self.at;
        self.at += n;
        self.bytes.get(at..at + n).unwrap_or_else(|| panic!("{PATH}: truncated at byte {at}"))
    }
    fn u32(&mut self) -> usize {
        u32::from_le_bytes(self.take(4).try_into().unwrap()) as usize
    }
}

fn load() -> BTreeMap<String, Tensor> {
    let bytes = std::fs::read(PATH).unwrap_or_else(|e| panic!("{PATH}: {e} (regenerate with make_golden.py)"));
    let mut r = Reader { bytes, at: 0 };
    assert_eq!(r.take(8), b"GBGOLDEN", "bad magic");
    assert_eq!(r.u32(), 1, "golden file version");
    let count = r.u32();
    let mut out = BTreeMap::new();
    for _ in 0..count {
        let len = r.u32();
        let name = String::from_utf8(r.take(len).to_vec()).expect("utf-8 name");
        let dtype = r.take(1)[0];
        let ndim = r.u32();
        let dims: Vec<usize> = (0..ndim).map(|_| r.u32()).collect();
        let elem = if dtype == 2 { 1 } else { 4 };
        let data = r.take(dims.iter().product::<usize>() * elem).to_vec();
        out.insert(name, Tensor { dtype, dims, data });
    }
    assert_eq!(r.at, r.bytes.len(), "trailing bytes");
    out
}

/// Largest |a - b| over the tensor, relative to the tensor's scale max|b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / scale
}

// Tolerances. Both sides compute in f32 and differ only in the order of additions (PyTorch's GEMM
// and reductions block differently from our GEMM and loops). Each element's rounding
// error is then a few ulps of the magnitudes summed, carried through ~40 ops of forward and
// backward: relative to a tensor's largest element that is ~1e-6. Measured (torch 2.15.0, printed
// by the test): logits 5e-7, gradients 0.8e-6 .. 1.6e-6. The tolerances leave a ~10-20x margin for
// another PyTorch build or CPU, while a real mistake (a wrong index, transpose, missing term or
// scale) moves elements by O(1) of the scale (even a 2% change of the cubic term of GELU's derivative
// moves gradients by ~1e-3 of their scale, 50x the tolerance).
const TOL_LOGITS: f32 = 1e-5;
const TOL_LOSS: f32 = 1e-5;
const TOL_GRAD: f32 = 2e-5;

#[test]
fn model_and_loss_match_pytorch_golden_file() {
    let g = load();
    let cfg_v = g["config"].i32();
    let cfg = GptConfig {
        vocab: cfg_v[0] as usize,
        max_seq: cfg_v[1] as usize,
        channels: cfg_v[2] as usize,
        heads: cfg_v[3] as usize,
        layers: cfg_v[4] as usize,
    };
    assert_eq!(cfg, GptConfig::default(), "the golden file is made for the calibration model");
    let (b, t) = (cfg_v[5] as usize, cfg_v[6] as usize);
    let lc = g["loss_config"].f32();
    let specs = param_specs(&cfg);
    let layout = Layout::new(&specs, 0);
    let gpt = Gpt::new(&cfg, &layout);
    let mut params = vec![0.0f32; layout.len];
    for (p, s) in specs.iter().enumerate() {
        let w = &g[&format!("param.{}", s.name)];
        assert_eq!(w.dims.iter().product::<usize>(), s.numel, "{}: size", s.name);
        params[gpt.param_range(p)].copy_from_slice(&w.f32());
    }
    let tokens: Vec<u32> = g["tokens"].i32().iter().map(|&x| x as u32).collect();
    let targets: Vec<u32> = g["targets"].i32().iter().map(|&x| x as u32).collect();
    let (mask, adv, old, reff) = (g["mask"].f32(), g["adv"].f32(), g["old_logp"].f32(), g["ref_logp"].f32());
    let mut acts = Activations::new(&Cpu, &cfg, b, t);

    // Safe loss: logits, loss, every gradient.
    let logits = gpt.forward(&Cpu, &params, &tokens, b, t, &mut acts, &mut NoProbe).to_vec();
    let e = rel_err(&logits, &g["safe.logits"].f32());
    println!("logits: rel err {e:.2e}");
    assert!(e <= TOL_LOGITS, "logits differ from PyTorch: {e:e}");
    let inputs = LossInputs { b, t, targets: &targets, mask: &mask, adv: &adv, old_logp: &old, ref_logp: &reff };
    let safe = LossConfig { style: LossStyle::Safe, clip: lc[0], kl_coef: lc[1] };
    let (stats, dlogits) = rl_loss_host(&safe, &logits, &inputs, &mut NoProbe);
    let want = g["safe.loss"].f32()[0];
    assert!((stats.loss - want).abs() <= TOL_LOSS * want.abs().max(1.0), "loss {} vs PyTorch {want}", stats.loss);
    let mut grads = vec![0.0f32; layout.len];
    gpt.backward(&Cpu, &params, &mut acts, &dlogits[..], &mut ParamGrads::new(&mut grads, &layout), &mut NoProbe, None);
    let mut failures = Vec::new();
    for (p, s) in specs.iter().enumerate() {
        let e = rel_err(&grads[gpt.param_range(p)], &g[&format!("safe.grad.{}", s.name)].f32());
        println!("grad {:<24} rel err {e:.2e}", s.name);
        if e.is_nan() || e > TOL_GRAD {
            failures.push(format!("{}: {e:e}", s.name));
        }
    }
    assert!(failures.is_empty(), "gradients differ from PyTorch: {failures:?}");
    let safe_grads = grads.clone();

    // ROLL's loss with a 95-nat k3 gap at a masked position: finite loss, PyTorch's NaN pattern.
    let ref_roll = g["roll.ref_logp"].f32();
    let inputs = LossInputs { ref_logp: &ref_roll, ..inputs };
    let roll = LossConfig { style: LossStyle::Roll, clip: lc[0], kl_coef: lc[1] };
    let logits = gpt.forward(&Cpu, &params, &tokens, b, t, &mut acts, &mut NoProbe).to_vec();
    let (stats, dlogits) = rl_loss_host(&roll, &logits, &inputs, &mut NoProbe);
    let want = g["roll.loss"].f32()[0];
    assert!(stats.loss.is_finite() && (stats.loss - want).abs() <= TOL_LOSS * want.abs().max(1.0));
    assert!(stats.max_kl_logratio_masked > 88.73, "the planted gap shows in the stats");
    grads.fill(0.0);
    gpt.backward(&Cpu, &params, &mut acts, &dlogits[..], &mut ParamGrads::new(&mut grads, &layout), &mut NoProbe, None);
    let mut nans = 0;
    for (p, s) in specs.iter().enumerate() {
        let want_nan = g[&format!("roll.grad_is_nan.{}", s.name)].u8();
        let r = gpt.param_range(p);
        // One flag per element: a shorter pattern would leave the tail unchecked by the zip below.
        assert_eq!(want_nan.len(), r.len(), "{}: NaN pattern length", s.name);
        for (i, (&x, &w)) in grads[r.clone()].iter().zip(want_nan).enumerate() {
            assert_eq!(x.is_nan(), w == 1, "{}[{i}]: NaN pattern differs from PyTorch (got {x})", s.name);
            // Where PyTorch stays finite, the roll gradient is the safe one (the gap is masked out).
            if w == 0 {
                let scale = safe_grads[r.clone()].iter().fold(f32::MIN_POSITIVE, |m, y| m.max(y.abs()));
                assert!((x - safe_grads[r.start + i]).abs() <= TOL_GRAD * scale, "{}[{i}]", s.name);
            }
        }
        nans += want_nan.iter().filter(|&&w| w == 1).count();
    }
    assert!(nans > 0, "the roll case has NaN gradients");
}
