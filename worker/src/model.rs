//! The reference policy: a tiny GPT with explicit forward and backward, llm.c style. Token + position
//! embeddings, L pre-LN blocks (ln1, causal multi-head attention with fused qkv and an output
//! projection, ln2, GELU MLP C -> 4C -> C), a final layer norm and an UNTIED, bias-free head C -> V.
//!
//! Invariants: parameters and gradients live in flat buffers laid out by a [`Layout`] built from
//! [`param_specs`]; the model only holds each parameter's range in them. Parameters are declared in
//! forward order, head last, so the layout puts the head at offset 0 (bucket #0). Backward runs last
//! layer first, ACCUMULATES into the gradient buffer through per-parameter views ([`ParamGrads`]),
//! and releases each view as soon as its gradient is final, in strictly descending parameter order,
//! so the bus can reduce a finished bucket while backward goes on. Everything is plain f32 on one
//! thread in a fixed order of operations: the same inputs give the same bits. Non-finite values are not
//! guarded against; every op's output goes to a [`Probe`] so the trace can find where they are born.

use std::ops::Range;

use gradbus_collectives::{GradMut, Layout, ParamGrads, ParamSpec};
use gradbus_kernels::ops::*;
use gradbus_kernels::rng::Rng;
use serde::{Deserialize, Serialize};

pub use crate::probe::{ExpOp, NoProbe, Phase, Probe};

/// Shape of the model. Defaults are the calibration model of the field notes (~103k parameters).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptConfig {
    /// Vocabulary size V.
    pub vocab: usize,
    /// Longest sequence (rows of the position embedding).
    pub max_seq: usize,
    /// Channels C.
    pub channels: usize,
    /// Attention heads NH (must divide C).
    pub heads: usize,
    /// Blocks L.
    pub layers: usize,
}

impl Default for GptConfig {
    fn default() -> Self {
        GptConfig { vocab: 16, max_seq: 16, channels: 64, heads: 4, layers: 2 }
    }
}

impl GptConfig {
    /// Whether `name` is one of [`param_specs`]' names, without building them (an absurd
    /// `layers` must not allocate before the config check has refused it).
    pub fn has_param(&self, name: &str) -> bool {
        matches!(name, "wte" | "wpe" | "ln_f.weight" | "ln_f.bias" | "head.weight")
            || name.strip_prefix("blocks.").and_then(|x| x.split_once('.')).is_some_and(|(l, p)| {
                l.parse::<usize>().is_ok_and(|n| n < self.layers && n.to_string() == l) && BLOCK_PARAMS.contains(&p)
            })
    }
}

/// Parameters of one block, in forward order; index within the block.
const BLOCK_PARAMS: [&str; 12] = [
    "ln1.weight",
    "ln1.bias",
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "attn.proj.bias",
    "ln2.weight",
    "ln2.bias",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
    "mlp.proj.bias",
];
const LN1_W: usize = 0;
const LN1_B: usize = 1;
const QKV_W: usize = 2;
const QKV_B: usize = 3;
const PROJ_W: usize = 4;
const PROJ_B: usize = 5;
const LN2_W: usize = 6;
const LN2_B: usize = 7;
const FC_W: usize = 8;
const FC_B: usize = 9;
const FCPROJ_W: usize = 10;
const FCPROJ_B: usize = 11;
const WTE: usize = 0;
const WPE: usize = 1;

/// Forward-order index of parameter `k` of block `l`.
fn bp(l: usize, k: usize) -> usize {
    2 + l * BLOCK_PARAMS.len() + k
}

/// The model's parameters in forward order: `wte`, `wpe`, `blocks.{l}.*`, `ln_f.weight`, `ln_f.bias`,
/// `head.weight` (last, so the layout puts it in bucket #0).
pub fn param_specs(cfg: &GptConfig) -> Vec<ParamSpec> {
    let (v, c) = (cfg.vocab, cfg.channels);
    let mut specs = vec![ParamSpec::new("wte", v * c), ParamSpec::new("wpe", cfg.max_seq * c)];
    let sizes = [c, c, 3 * c * c, 3 * c, c * c, c, c, c, 4 * c * c, 4 * c, c * 4 * c, c];
    for l in 0..cfg.layers {
        for (name, n) in BLOCK_PARAMS.iter().zip(sizes) {
            specs.push(ParamSpec::new(format!("blocks.{l}.{name}"), n));
        }
    }
    specs.push(ParamSpec::new("ln_f.weight", c));
    specs.push(ParamSpec::new("ln_f.bias", c));
    specs.push(ParamSpec::new("head.weight", v * c));
    specs
}

/// Activations of one block, each sized for the capacity (B, T) of [`Activations`].
struct BlockActs {
    ln1: Vec<f32>,      // (B, T, C)
    ln1_mean: Vec<f32>, // (B, T)
    ln1_rstd: Vec<f32>, // (B, T)
    qkv: Vec<f32>,      // (B, T, 3C)
    atty: Vec<f32>,     // (B, T, C)
    att: Vec<f32>,      // (B, NH, T, T)
    attproj: Vec<f32>,  // (B, T, C)
    res2: Vec<f32>,     // (B, T, C)
    ln2: Vec<f32>,      // (B, T, C)
    ln2_mean: Vec<f32>, // (B, T)
    ln2_rstd: Vec<f32>, // (B, T)
    fch: Vec<f32>,      // (B, T, 4C)
    fch_gelu: Vec<f32>, // (B, T, 4C)
    fcproj: Vec<f32>,   // (B, T, C)
    res3: Vec<f32>,     // (B, T, C)
}

/// Forward activations and backward scratch for up to (B, T) = the capacity given to [`new`].
/// Forward may run with any smaller B and T; backward uses the B and T of the last forward.
///
/// [`new`]: Activations::new
pub struct Activations {
    cap: (usize, usize),
    v: usize,
    b: usize,
    t: usize,
    /// The last forward was a KV-cached one: its activations cover only the new positions, so there
    /// is nothing for backward.
    cached: bool,
    tokens: Vec<u32>,  // (B, T)
    encoded: Vec<f32>, // (B, T, C)
    blocks: Vec<BlockActs>,
    lnf: Vec<f32>,      // (B, T, C)
    lnf_mean: Vec<f32>, // (B, T)
    lnf_rstd: Vec<f32>, // (B, T)
    logits: Vec<f32>,   // (B, T, V)
    // Backward scratch, reused by every block.
    dx: Vec<f32>,   // (B, T, C): gradient of the residual stream
    dres: Vec<f32>, // (B, T, C): gradient of the mid-block residual
    d1: Vec<f32>,   // (B, T, C)
    d2: Vec<f32>,   // (B, T, C)
    dqkv: Vec<f32>, // (B, T, 3C)
    dh1: Vec<f32>,  // (B, T, 4C)
    dh2: Vec<f32>,  // (B, T, 4C)
}

impl Activations {
    /// How many 4-byte elements [`Activations::new`] allocates for `(cfg, b, t)`, as f64 so that an
    /// absurd shape gives a large number instead of an overflow (the config's memory estimate).
    pub fn numel(cfg: &GptConfig, b: usize, t: usize) -> f64 {
        let (c, v, nh, l) = (cfg.channels as f64, cfg.vocab as f64, cfg.heads as f64, cfg.layers as f64);
        let bt = b as f64 * t as f64;
        let block = 18.0 * bt * c + 4.0 * bt + b as f64 * nh * t as f64 * t as f64;
        l * block + 17.0 * bt * c + 3.0 * bt + bt * v
    }

    /// Buffers for up to `b` sequences of up to `t` positions.
    pub fn new(cfg: &GptConfig, b: usize, t: usize) -> Activations {
        let (c, v, nh) = (cfg.channels, cfg.vocab, cfg.heads);
        let bt = b * t;
        let z = |n: usize| vec![0.0f32; n];
        let blocks = (0..cfg.layers)
            .map(|_| BlockActs {
                ln1: z(bt * c),
                ln1_mean: z(bt),
                ln1_rstd: z(bt),
                qkv: z(bt * 3 * c),
                atty: z(bt * c),
                att: z(b * nh * t * t),
                attproj: z(bt * c),
                res2: z(bt * c),
                ln2: z(bt * c),
                ln2_mean: z(bt),
                ln2_rstd: z(bt),
                fch: z(bt * 4 * c),
                fch_gelu: z(bt * 4 * c),
                fcproj: z(bt * c),
                res3: z(bt * c),
            })
            .collect();
        Activations {
            cap: (b, t),
            v,
            b: 0,
            t: 0,
            cached: false,
            tokens: vec![0; bt],
            encoded: z(bt * c),
            blocks,
            lnf: z(bt * c),
            lnf_mean: z(bt),
            lnf_rstd: z(bt),
            logits: z(bt * v),
            dx: z(bt * c),
            dres: z(bt * c),
            d1: z(bt * c),
            d2: z(bt * c),
            dqkv: z(bt * 3 * c),
            dh1: z(bt * 4 * c),
            dh2: z(bt * 4 * c),
        }
    }

    /// The logits of the last forward, (B, T, V).
    pub fn logits(&self) -> &[f32] {
        &self.logits[..self.b * self.t * self.v]
    }
}

/// The q|k|v rows of every position fed so far, per layer, so that sampling one token at a time
/// computes only the new position ([`Gpt::forward_cached`]) instead of the whole prefix again.
pub struct KvCache {
    b: usize,
    cap: usize,
    len: usize,
    qkv: Vec<Vec<f32>>, // per layer (B, cap, 3C)
}

impl KvCache {
    /// An empty cache for `b` sequences of up to `cap` positions.
    pub fn new(cfg: &GptConfig, b: usize, cap: usize) -> KvCache {
        KvCache { b, cap, len: 0, qkv: (0..cfg.layers).map(|_| vec![0.0; b * cap * 3 * cfg.channels]).collect() }
    }

    /// Positions fed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Nothing fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The model: its shape and where each parameter lives in the flat buffers.
#[derive(Clone, Debug)]
pub struct Gpt {
    cfg: GptConfig,
    ranges: Vec<Range<usize>>,
}

impl Gpt {
    /// The model for `cfg`, with each parameter's range taken from the layout's slots. `cfg` is one
    /// that `config::Config`'s check accepted (heads divide channels, every size at least 1); the
    /// layout must have been made from `param_specs(cfg)`, else this panics (a bug, not an input).
    pub fn new(cfg: &GptConfig, layout: &Layout) -> Gpt {
        let specs = param_specs(cfg);
        assert_eq!(specs.len(), layout.slots.len(), "layout has a different parameter count");
        let ranges = specs
            .iter()
            .zip(&layout.slots)
            .map(|(s, slot)| {
                assert!(s.name == slot.name && s.numel == slot.numel, "layout slot {slot:?} is not parameter {s:?}");
                slot.range()
            })
            .collect();
        Gpt { cfg: cfg.clone(), ranges }
    }

    /// The shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Number of parameter tensors.
    pub fn num_params(&self) -> usize {
        self.ranges.len()
    }

    /// The range of parameter `p` (forward-order index) in the flat buffers.
    pub fn param_range(&self, p: usize) -> Range<usize> {
        self.ranges[p].clone()
    }

    fn w<'a>(&self, params: &'a [f32], p: usize) -> &'a [f32] {
        &params[self.ranges[p].clone()]
    }

    /// GPT-2 initialisation: weights N(0, 0.02), the two projections into the residual stream
    /// N(0, 0.02 / sqrt(2L)), layer-norm weights 1, biases 0. Draws in parameter order, element order.
    pub fn init(&self, params: &mut [f32], rng: &mut Rng) {
        let proj_std = 0.02 / ((2 * self.cfg.layers) as f32).sqrt();
        for (p, spec) in param_specs(&self.cfg).iter().enumerate() {
            let dst = &mut params[self.ranges[p].clone()];
            let name = spec.name.as_str();
            if name.contains(".ln") || name.starts_with("ln_f") {
                dst.fill(if name.ends_with(".weight") { 1.0 } else { 0.0 });
            } else if name.ends_with(".bias") {
                dst.fill(0.0);
            } else {
                let std = if name.ends_with("proj.weight") { proj_std } else { 0.02 };
                for x in dst.iter_mut() {
                    *x = std * rng.normal();
                }
            }
        }
    }

    /// Forward pass. tokens: (B, T) with B, T within the capacity of `acts` and T <= max_seq.
    /// Returns the logits, (B, T, V).
    pub fn forward<'a, P: Probe + ?Sized>(
        &self,
        params: &[f32],
        tokens: &[u32],
        b: usize,
        t: usize,
        acts: &'a mut Activations,
        probe: &mut P,
    ) -> &'a [f32] {
        self.forward_impl(params, tokens, b, t, None, acts, probe)
    }

    /// Forward pass of the next `tn` positions of `b` sequences whose earlier positions are in
    /// `cache` (empty: the first positions), which then holds these too. Every op but attention works
    /// row by row, and the GEMM's bits of a row do not depend on the other rows, so the logits are
    /// bit for bit those of [`forward`] over the whole prefix at these positions (the test
    /// `kv_cached_forward_gives_the_full_forwards_bits` checks it). tokens: (B, TN); returns the
    /// logits (B, TN, V). `acts` is scratch: no backward after this.
    ///
    /// [`forward`]: Gpt::forward
    pub fn forward_cached<'a>(
        &self,
        params: &[f32],
        tokens: &[u32],
        b: usize,
        tn: usize,
        cache: &mut KvCache,
        acts: &'a mut Activations,
    ) -> &'a [f32] {
        assert!(b == cache.b && cache.len + tn <= cache.cap, "forward_cached: ({b}, {tn}) past the cache");
        self.forward_impl(params, tokens, b, tn, Some(cache), acts, &mut NoProbe)
    }

    /// `forward` (no cache) or `forward_cached`: the positions `kv.len..kv.len + t`.
    #[allow(clippy::too_many_arguments)]
    fn forward_impl<'a, P: Probe + ?Sized>(
        &self,
        params: &[f32],
        tokens: &[u32],
        b: usize,
        t: usize,
        mut kv: Option<&mut KvCache>,
        acts: &'a mut Activations,
        probe: &mut P,
    ) -> &'a [f32] {
        let GptConfig { vocab: v, channels: c, heads: nh, layers: nl, .. } = self.cfg;
        let pos0 = kv.as_ref().map_or(0, |k| k.len);
        assert!(
            b <= acts.cap.0 && t <= acts.cap.1 && pos0 + t <= self.cfg.max_seq,
            "forward: (B, T) = ({b}, {t}) at position {pos0} too large"
        );
        assert_eq!(tokens.len(), b * t, "forward: tokens are not (B, T)");
        let bt = b * t;
        let (n, n3, n4) = (bt * c, bt * 3 * c, bt * 4 * c);
        let a = acts;
        a.b = b;
        a.t = t;
        a.cached = kv.is_some();
        a.tokens[..bt].copy_from_slice(tokens);
        let fwd = Phase::Forward;

        let wpe = &self.w(params, WPE)[pos0 * c..];
        encoder_forward(&mut a.encoded, tokens, self.w(params, WTE), wpe, b, t, c, v);
        probe.check("encoder", None, fwd, &a.encoded[..n], &[b, t, c]);
        for l in 0..nl {
            let (done, rest) = a.blocks.split_at_mut(l);
            let x: &[f32] = if l == 0 { &a.encoded } else { &done[l - 1].res3 };
            let k = &mut rest[0];
            let w = |i| self.w(params, bp(l, i));
            let lo = Some(l);
            layernorm_forward(&mut k.ln1, &mut k.ln1_mean, &mut k.ln1_rstd, x, w(LN1_W), w(LN1_B), bt, c);
            probe.check("ln1", lo, fwd, &k.ln1[..n], &[b, t, c]);
            matmul_forward(&mut k.qkv, &k.ln1, w(QKV_W), Some(w(QKV_B)), bt, c, 3 * c);
            probe.check("attn.qkv", lo, fwd, &k.qkv[..n3], &[b, t, 3 * c]);
            match kv.as_deref_mut() {
                None => attention_forward(&mut k.atty, &mut k.att, &k.qkv, b, t, c, nh),
                Some(cache) => {
                    let (c3, cap) = (3 * c, cache.cap);
                    let rows = &mut cache.qkv[l];
                    for (i, new) in k.qkv[..n3].chunks_exact(c3).enumerate() {
                        let (bi, ti) = (i / t, i % t);
                        rows[(bi * cap + pos0 + ti) * c3..][..c3].copy_from_slice(new);
                    }
                    attention_forward_rows(&mut k.atty, &mut k.att, rows, cap, b, pos0, pos0 + t, c, nh);
                }
            }
            probe.check("attn", lo, fwd, &k.atty[..n], &[b, t, c]);
            matmul_forward(&mut k.attproj, &k.atty, w(PROJ_W), Some(w(PROJ_B)), bt, c, c);
            probe.check("attn.proj", lo, fwd, &k.attproj[..n], &[b, t, c]);
            residual_forward(&mut k.res2, x, &k.attproj, n);
            probe.check("residual1", lo, fwd, &k.res2[..n], &[b, t, c]);
            layernorm_forward(&mut k.ln2, &mut k.ln2_mean, &mut k.ln2_rstd, &k.res2, w(LN2_W), w(LN2_B), bt, c);
            probe.check("ln2", lo, fwd, &k.ln2[..n], &[b, t, c]);
            matmul_forward(&mut k.fch, &k.ln2, w(FC_W), Some(w(FC_B)), bt, c, 4 * c);
            probe.check("mlp.fc", lo, fwd, &k.fch[..n4], &[b, t, 4 * c]);
            gelu_forward(&mut k.fch_gelu, &k.fch, n4);
            probe.check("mlp.gelu", lo, fwd, &k.fch_gelu[..n4], &[b, t, 4 * c]);
            matmul_forward(&mut k.fcproj, &k.fch_gelu, w(FCPROJ_W), Some(w(FCPROJ_B)), bt, 4 * c, c);
            probe.check("mlp.proj", lo, fwd, &k.fcproj[..n], &[b, t, c]);
            residual_forward(&mut k.res3, &k.res2, &k.fcproj, n);
            probe.check("residual2", lo, fwd, &k.res3[..n], &[b, t, c]);
        }
        let x: &[f32] = if nl == 0 { &a.encoded } else { &a.blocks[nl - 1].res3 };
        let (wf, bf) = (self.w(params, bp(nl, 0)), self.w(params, bp(nl, 1)));
        layernorm_forward(&mut a.lnf, &mut a.lnf_mean, &mut a.lnf_rstd, x, wf, bf, bt, c);
        probe.check("ln_f", None, fwd, &a.lnf[..n], &[b, t, c]);
        matmul_forward(&mut a.logits, &a.lnf, self.w(params, bp(nl, 2)), None, bt, c, v);
        probe.check("head", None, fwd, &a.logits[..bt * v], &[b, t, v]);
        if let Some(cache) = kv {
            cache.len += t;
        }
        &a.logits[..bt * v]
    }

    /// Backward pass of the last forward on `acts`. dlogits: (B, T, V); grads: the gradient buffer
    /// (same layout as `params`), ACCUMULATED into, one parameter view at a time; each view is
    /// released, in strictly descending parameter order, as soon as its gradient is final, so the
    /// buckets it completes can be all-reduced while backward goes on.
    pub fn backward<P: Probe + ?Sized>(
        &self,
        params: &[f32],
        acts: &mut Activations,
        dlogits: &[f32],
        grads: &mut ParamGrads<'_>,
        probe: &mut P,
    ) {
        let GptConfig { vocab: v, channels: c, heads: nh, layers: nl, .. } = self.cfg;
        let a = acts;
        let (b, t) = (a.b, a.t);
        let bt = b * t;
        let (n, n3, n4) = (bt * c, bt * 3 * c, bt * 4 * c);
        assert!(!a.cached, "backward: the last forward was KV-cached (it keeps no activations to differentiate)");
        assert_eq!(dlogits.len(), bt * v, "backward: dlogits are not (B, T, V) of the last forward");
        let bwd = Phase::Backward;
        let (lnf_w, lnf_b, head) = (bp(nl, 0), bp(nl, 1), bp(nl, 2));

        // head: logits = lnf @ head^T
        let d_lnf = &mut a.d1[..n];
        d_lnf.fill(0.0);
        let mut dhead = grads.take(head);
        matmul_backward(d_lnf, &mut dhead, None, dlogits, &a.lnf, self.w(params, head), bt, c, v);
        probe.check("head", None, bwd, d_lnf, &[b, t, c]);
        ready(grads, probe, head, dhead);

        // ln_f
        let x: &[f32] = if nl == 0 { &a.encoded } else { &a.blocks[nl - 1].res3 };
        let dx = &mut a.dx[..n];
        dx.fill(0.0);
        let (mut dw, mut db) = (grads.take(lnf_w), grads.take(lnf_b));
        let wf = self.w(params, lnf_w);
        layernorm_backward(dx, &mut dw, &mut db, &a.d1, x, wf, &a.lnf_mean, &a.lnf_rstd, bt, c);
        probe.check("ln_f", None, bwd, dx, &[b, t, c]);
        ready(grads, probe, lnf_b, db);
        ready(grads, probe, lnf_w, dw);

        for l in (0..nl).rev() {
            let k = &a.blocks[l];
            let x: &[f32] = if l == 0 { &a.encoded } else { &a.blocks[l - 1].res3 };
            let w = |i| self.w(params, bp(l, i));
            let lo = Some(l);

            // res3 = res2 + fcproj
            let (dres, dfcproj) = (&mut a.dres[..n], &mut a.d1[..n]);
            dres.fill(0.0);
            dfcproj.fill(0.0);
            residual_backward(dres, dfcproj, &a.dx, n);
            probe.check("residual2", lo, bwd, dres, &[b, t, c]);
            // fcproj = gelu @ W^T + b
            let dgelu = &mut a.dh2[..n4];
            dgelu.fill(0.0);
            let (mut dw, mut db) = (grads.take(bp(l, FCPROJ_W)), grads.take(bp(l, FCPROJ_B)));
            matmul_backward(dgelu, &mut dw, Some(&mut *db), &a.d1, &k.fch_gelu, w(FCPROJ_W), bt, 4 * c, c);
            probe.check("mlp.proj", lo, bwd, dgelu, &[b, t, 4 * c]);
            ready(grads, probe, bp(l, FCPROJ_B), db);
            ready(grads, probe, bp(l, FCPROJ_W), dw);
            // gelu
            let dfch = &mut a.dh1[..n4];
            dfch.fill(0.0);
            gelu_backward(dfch, &k.fch, &a.dh2, n4);
            probe.check("mlp.gelu", lo, bwd, dfch, &[b, t, 4 * c]);
            // fch = ln2 @ W^T + b
            let dln2 = &mut a.d2[..n];
            dln2.fill(0.0);
            let (mut dw, mut db) = (grads.take(bp(l, FC_W)), grads.take(bp(l, FC_B)));
            matmul_backward(dln2, &mut dw, Some(&mut *db), &a.dh1, &k.ln2, w(FC_W), bt, c, 4 * c);
            probe.check("mlp.fc", lo, bwd, dln2, &[b, t, c]);
            ready(grads, probe, bp(l, FC_B), db);
            ready(grads, probe, bp(l, FC_W), dw);
            // ln2, accumulating into the mid-block residual gradient
            let dres = &mut a.dres[..n];
            let (mut dw, mut db) = (grads.take(bp(l, LN2_W)), grads.take(bp(l, LN2_B)));
            layernorm_backward(dres, &mut dw, &mut db, &a.d2, &k.res2, w(LN2_W), &k.ln2_mean, &k.ln2_rstd, bt, c);
            probe.check("ln2", lo, bwd, dres, &[b, t, c]);
            ready(grads, probe, bp(l, LN2_B), db);
            ready(grads, probe, bp(l, LN2_W), dw);

            // res2 = x + attproj
            let (dx, dattproj) = (&mut a.dx[..n], &mut a.d1[..n]);
            dx.fill(0.0);
            dattproj.fill(0.0);
            residual_backward(dx, dattproj, &a.dres, n);
            probe.check("residual1", lo, bwd, dx, &[b, t, c]);
            // attproj = atty @ W^T + b
            let datty = &mut a.d2[..n];
            datty.fill(0.0);
            let (mut dw, mut db) = (grads.take(bp(l, PROJ_W)), grads.take(bp(l, PROJ_B)));
            matmul_backward(datty, &mut dw, Some(&mut *db), &a.d1, &k.atty, w(PROJ_W), bt, c, c);
            probe.check("attn.proj", lo, bwd, datty, &[b, t, c]);
            ready(grads, probe, bp(l, PROJ_B), db);
            ready(grads, probe, bp(l, PROJ_W), dw);
            // attention
            let dqkv = &mut a.dqkv[..n3];
            dqkv.fill(0.0);
            attention_backward(dqkv, &a.d2, &k.qkv, &k.att, b, t, c, nh);
            probe.check("attn", lo, bwd, dqkv, &[b, t, 3 * c]);
            // qkv = ln1 @ W^T + b
            let dln1 = &mut a.d1[..n];
            dln1.fill(0.0);
            let (mut dw, mut db) = (grads.take(bp(l, QKV_W)), grads.take(bp(l, QKV_B)));
            matmul_backward(dln1, &mut dw, Some(&mut *db), &a.dqkv, &k.ln1, w(QKV_W), bt, c, 3 * c);
            probe.check("attn.qkv", lo, bwd, dln1, &[b, t, c]);
            ready(grads, probe, bp(l, QKV_B), db);
            ready(grads, probe, bp(l, QKV_W), dw);
            // ln1, accumulating into the block input's gradient
            let dx = &mut a.dx[..n];
            let (mut dw, mut db) = (grads.take(bp(l, LN1_W)), grads.take(bp(l, LN1_B)));
            layernorm_backward(dx, &mut dw, &mut db, &a.d1, x, w(LN1_W), &k.ln1_mean, &k.ln1_rstd, bt, c);
            probe.check("ln1", lo, bwd, dx, &[b, t, c]);
            ready(grads, probe, bp(l, LN1_B), db);
            ready(grads, probe, bp(l, LN1_W), dw);
        }

        let (mut dwte, mut dwpe) = (grads.take(WTE), grads.take(WPE));
        encoder_backward(&mut dwte, &mut dwpe, &a.dx[..n], &a.tokens[..bt], b, t, c);
        ready(grads, probe, WPE, dwpe);
        ready(grads, probe, WTE, dwte);
    }
}

/// Hand parameter `p`'s final gradient to the probe, then release it to the bus.
fn ready<'a, P: Probe + ?Sized>(g: &mut ParamGrads<'a>, probe: &mut P, p: usize, grad: GradMut<'a>) {
    probe.grad(p, &grad);
    g.release(p, grad);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_model_has_about_103k_parameters_and_head_in_bucket_0() {
        let cfg = GptConfig::default();
        let specs = param_specs(&cfg);
        assert_eq!(specs.iter().map(|s| s.numel).sum::<usize>(), 103_168);
        assert_eq!(specs.last().unwrap().name, "head.weight");
        assert_eq!(specs[2].name, "blocks.0.ln1.weight");
        let layout = Layout::new(&specs, 1 << 20);
        assert_eq!(layout.slots[specs.len() - 1].offset, 0);
        assert_eq!(layout.buckets[0].params[0], specs.len() - 1);
        let gpt = Gpt::new(&cfg, &layout);
        assert_eq!(gpt.param_range(specs.len() - 1), 0..16 * 64);
    }

    #[test]
    fn kv_cached_forward_gives_the_full_forwards_bits() {
        // Every position's logits, fed 2 (the prompt), then 1 at a time, or 3 then 2 at a time, are
        // bit for bit the full forward's: the rollout samples exactly what it sampled before the cache.
        for cfg in [GptConfig::default(), GptConfig { channels: 256, layers: 4, ..GptConfig::default() }] {
            let layout = Layout::new(&param_specs(&cfg), 1 << 16);
            let gpt = Gpt::new(&cfg, &layout);
            let mut params = vec![0.0; layout.len];
            let mut rng = Rng::new(&[11]);
            gpt.init(&mut params, &mut rng);
            for x in params.iter_mut() {
                *x += 0.05 * rng.normal(); // break the init's symmetries (zero biases, unit norms)
            }
            let (b, t, v) = (5, 9, cfg.vocab);
            let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(v) as u32).collect();
            let mut acts = Activations::new(&cfg, b, t);
            let full = gpt.forward(&params, &tokens, b, t, &mut acts, &mut NoProbe).to_vec();
            for steps in [vec![2, 1, 1, 1, 1, 1, 1, 1], vec![3, 2, 2, 2], vec![9]] {
                let mut cache = KvCache::new(&cfg, b, t);
                let mut got = vec![f32::NAN; b * t * v];
                for tn in steps {
                    let p0 = cache.len();
                    let new: Vec<u32> = tokens.chunks_exact(t).flat_map(|s| s[p0..p0 + tn].iter().copied()).collect();
                    let logits = gpt.forward_cached(&params, &new, b, tn, &mut cache, &mut acts);
                    for (i, row) in logits.chunks_exact(v).enumerate() {
                        let (bi, ti) = (i / tn, p0 + i % tn);
                        got[(bi * t + ti) * v..][..v].copy_from_slice(row);
                    }
                }
                assert_eq!(cache.len(), t);
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&full), "C = {}", cfg.channels);
            }
        }
    }

    #[test]
    fn config_rejects_unknown_keys() {
        let c: GptConfig = toml::from_str("channels = 32\nheads = 2").unwrap();
        assert_eq!((c.channels, c.heads, c.vocab), (32, 2, 16));
        assert!(toml::from_str::<GptConfig>("chanels = 32").is_err());
    }

    #[test]
    fn has_param_knows_exactly_the_names_of_param_specs() {
        let cfg = GptConfig { layers: 3, ..GptConfig::default() };
        for s in param_specs(&cfg) {
            assert!(cfg.has_param(&s.name), "{}", s.name);
        }
        for bad in ["blocks.3.ln1.weight", "blocks.01.ln1.weight", "blocks.0.ln3.weight", "head", "blocks.0", ""] {
            assert!(!cfg.has_param(bad), "{bad}");
        }
    }

    #[test]
    fn activation_count_matches_the_buffers() {
        let cfg = GptConfig { vocab: 7, max_seq: 9, channels: 12, heads: 3, layers: 2 };
        let (b, t) = (5, 6);
        let a = Activations::new(&cfg, b, t);
        let mut n = a.tokens.len() + a.encoded.len() + a.lnf.len() + a.lnf_mean.len() + a.lnf_rstd.len();
        n += a.logits.len() + a.dx.len() + a.dres.len() + a.d1.len() + a.d2.len();
        n += a.dqkv.len() + a.dh1.len() + a.dh2.len();
        for k in &a.blocks {
            n += k.ln1.len() + k.ln1_mean.len() + k.ln1_rstd.len() + k.qkv.len() + k.atty.len() + k.att.len();
            n += k.attproj.len() + k.res2.len() + k.ln2.len() + k.ln2_mean.len() + k.ln2_rstd.len();
            n += k.fch.len() + k.fch_gelu.len() + k.fcproj.len() + k.res3.len();
        }
        assert_eq!(Activations::numel(&cfg, b, t), n as f64);
    }
}
