//! The reference policy: a tiny GPT with explicit forward and backward, llm.c style. Token + position
//! embeddings, L pre-LN blocks (ln1, causal multi-head attention with fused qkv and an output
//! projection, ln2, GELU MLP C -> 4C -> C), a final layer norm and an UNTIED, bias-free head C -> V.
//!
//! Invariants: parameters and gradients live in flat buffers laid out by a [`Layout`] built from
//! [`param_specs`]; the model only holds each parameter's range in them. Parameters are declared in
//! forward order, head last, so the layout puts the head at offset 0 (bucket #0). Backward runs last
//! layer first, ACCUMULATES into the gradient buffer through per-parameter slots ([`GradSlots`]:
//! take, accumulate, release), and releases each slot as soon as its gradient is final, in strictly descending parameter order,
//! so the bus can reduce a finished bucket while backward goes on. The ops run on a [`Backend`] (the
//! CPU's kernels, or a device's), on its buffers: parameters and gradients are views of its flat
//! buffers, activations its buffers; the model never touches their elements itself. Every op is f32
//! in a fixed order of operations: the same inputs give the same bits. Non-finite values are not
//! guarded against; every op's output goes to a [`Probe`] so the trace can find where they are born.

use std::ops::Range;

use gradbus_collectives::GradSlots;
use gradbus_collectives::{Layout, ParamSpec};
use gradbus_kernels::backend::Backend;
use gradbus_kernels::checksum::Prefix;
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

    /// The element count of parameter `name` (`None` when [`GptConfig::has_param`] is false), without
    /// building every layer's specs.
    pub fn param_numel(&self, name: &str) -> Option<usize> {
        if !self.has_param(name) {
            return None;
        }
        // Every block has the same shapes: look the name up in a one-block model.
        let one = GptConfig { layers: 1, ..self.clone() };
        let key = match name.strip_prefix("blocks.").and_then(|x| x.split_once('.')) {
            Some((_, p)) => format!("blocks.0.{p}"),
            None => name.to_string(),
        };
        param_specs(&one).into_iter().find(|s| s.name == key).map(|s| s.numel)
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
struct BlockActs<B: Backend> {
    ln1: B::Buf,      // (B, T, C)
    ln1_mean: B::Buf, // (B, T)
    ln1_rstd: B::Buf, // (B, T)
    qkv: B::Buf,      // (B, T, 3C)
    atty: B::Buf,     // (B, T, C)
    att: B::Buf,      // (B, NH, T, T)
    attproj: B::Buf,  // (B, T, C)
    res2: B::Buf,     // (B, T, C)
    ln2: B::Buf,      // (B, T, C)
    ln2_mean: B::Buf, // (B, T)
    ln2_rstd: B::Buf, // (B, T)
    fch: B::Buf,      // (B, T, 4C)
    fch_gelu: B::Buf, // (B, T, 4C)
    fcproj: B::Buf,   // (B, T, C)
    res3: B::Buf,     // (B, T, C)
}

/// Forward activations and backward scratch for up to (B, T) = the capacity given to [`new`], on
/// backend `B`. Forward may run with any smaller B and T; backward uses the B and T of the last
/// forward.
///
/// [`new`]: Activations::new
pub struct Activations<B: Backend> {
    cap: (usize, usize),
    v: usize,
    b: usize,
    t: usize,
    /// The last forward was a KV-cached one: its activations cover only the new positions, so there
    /// is nothing for backward.
    cached: bool,
    tokens: B::Ids,  // (B, T)
    encoded: B::Buf, // (B, T, C)
    blocks: Vec<BlockActs<B>>,
    lnf: B::Buf,      // (B, T, C)
    lnf_mean: B::Buf, // (B, T)
    lnf_rstd: B::Buf, // (B, T)
    logits: B::Buf,   // (B, T, V)
    // Backward scratch, reused by every block.
    dx: B::Buf,   // (B, T, C): gradient of the residual stream
    dres: B::Buf, // (B, T, C): gradient of the mid-block residual
    d1: B::Buf,   // (B, T, C)
    d2: B::Buf,   // (B, T, C)
    dqkv: B::Buf, // (B, T, 3C)
    dh1: B::Buf,  // (B, T, 4C)
    dh2: B::Buf,  // (B, T, 4C)
}

/// How many 4-byte elements [`Activations::new`] allocates for `(cfg, b, t)`, as f64 so that an
/// absurd shape gives a large number instead of an overflow (the config's memory estimate).
pub fn activations_numel(cfg: &GptConfig, b: usize, t: usize) -> f64 {
    let (c, v, nh, l) = (cfg.channels as f64, cfg.vocab as f64, cfg.heads as f64, cfg.layers as f64);
    let bt = b as f64 * t as f64;
    let block = 18.0 * bt * c + 4.0 * bt + b as f64 * nh * t as f64 * t as f64;
    l * block + 17.0 * bt * c + 3.0 * bt + bt * v
}

impl<B: Backend> Activations<B> {
    /// Buffers for up to `b` sequences of up to `t` positions.
    pub fn new(be: &B, cfg: &GptConfig, b: usize, t: usize) -> Activations<B> {
        let (c, v, nh) = (cfg.channels, cfg.vocab, cfg.heads);
        let bt = b * t;
        let z = |n: usize| be.zeros(n);
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
            tokens: be.ids(bt),
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
    pub fn logits<'a>(&'a self, be: &B) -> B::View<'a> {
        be.view(&self.logits, 0..self.b * self.t * self.v)
    }
}

/// The q|k|v rows of every position fed so far, per layer, so that sampling one token at a time
/// computes only the new position ([`Gpt::forward_cached`]) instead of the whole prefix again.
pub struct KvCache<B: Backend> {
    b: usize,
    cap: usize,
    len: usize,
    qkv: Vec<B::Buf>, // per layer (B, cap, 3C)
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `b` sequences of up to `cap` positions.
    pub fn new(be: &B, cfg: &GptConfig, b: usize, cap: usize) -> KvCache<B> {
        KvCache { b, cap, len: 0, qkv: (0..cfg.layers).map(|_| be.zeros(b * cap * 3 * cfg.channels)).collect() }
    }

    /// Forget every position (the buffers stay): the next forward starts at position 0.
    pub fn clear(&mut self) {
        self.len = 0;
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

    /// Parameter `p`'s view of the flat parameter buffer.
    fn w<'a, B: Backend>(&self, be: &B, params: &'a B::Buf, p: usize) -> B::View<'a> {
        be.view(params, self.ranges[p].clone())
    }

    /// GPT-2 initialisation: weights N(0, 0.02), the two projections into the residual stream
    /// N(0, 0.02 / sqrt(2L)), layer-norm weights 1, biases 0. Draws in parameter order, element order.
    /// On the host: the caller uploads the result.
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
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'a, B: Backend, P: Probe>(
        &self,
        be: &B,
        params: &B::Buf,
        tokens: &[u32],
        b: usize,
        t: usize,
        acts: &'a mut Activations<B>,
        probe: &mut P,
    ) -> B::View<'a> {
        self.forward_impl(be, params, tokens, b, t, None, acts, probe)
    }

    /// Forward pass of the next `tn` positions of `b` sequences whose earlier positions are in
    /// `cache` (empty: the first positions), which then holds these too. Every op but attention works
    /// row by row, and the GEMM's bits of a row do not depend on the other rows, so the logits are
    /// bit for bit those of [`forward`] over the whole prefix at these positions (the test
    /// `kv_cached_forward_gives_the_full_forwards_bits` checks it). tokens: (B, TN); returns the
    /// logits (B, TN, V). `acts` is scratch: no backward after this.
    ///
    /// [`forward`]: Gpt::forward
    #[allow(clippy::too_many_arguments)]
    pub fn forward_cached<'a, B: Backend>(
        &self,
        be: &B,
        params: &B::Buf,
        tokens: &[u32],
        b: usize,
        tn: usize,
        cache: &mut KvCache<B>,
        acts: &'a mut Activations<B>,
    ) -> B::View<'a> {
        assert!(b == cache.b && cache.len + tn <= cache.cap, "forward_cached: ({b}, {tn}) past the cache");
        self.forward_impl(be, params, tokens, b, tn, Some(cache), acts, &mut NoProbe)
    }

    /// `forward` (no cache) or `forward_cached`: the positions `kv.len..kv.len + t`.
    #[allow(clippy::too_many_arguments)]
    fn forward_impl<'a, B: Backend, P: Probe>(
        &self,
        be: &B,
        params: &B::Buf,
        tokens: &[u32],
        b: usize,
        t: usize,
        mut kv: Option<&mut KvCache<B>>,
        acts: &'a mut Activations<B>,
        probe: &mut P,
    ) -> B::View<'a> {
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
        be.upload_ids(&mut a.tokens, tokens);
        let fwd = Phase::Forward;
        let w = |p| self.w(be, params, p);

        let wpe = be.view(params, self.ranges[WPE].start + pos0 * c..self.ranges[WPE].end);
        be.encoder_forward(be.all_mut(&mut a.encoded), &a.tokens, w(WTE), wpe, b, t, c, v);
        probe.check(be, "encoder", None, fwd, be.view(&a.encoded, 0..n), &[b, t, c]);
        for l in 0..nl {
            let (done, rest) = a.blocks.split_at_mut(l);
            let x = if l == 0 { &a.encoded } else { &done[l - 1].res3 };
            let k = &mut rest[0];
            let w = |i| w(bp(l, i));
            let lo = Some(l);
            be.layernorm_forward(
                be.all_mut(&mut k.ln1),
                be.all_mut(&mut k.ln1_mean),
                be.all_mut(&mut k.ln1_rstd),
                be.all(x),
                w(LN1_W),
                w(LN1_B),
                bt,
                c,
            );
            probe.check(be, "ln1", lo, fwd, be.view(&k.ln1, 0..n), &[b, t, c]);
            be.matmul_forward(be.all_mut(&mut k.qkv), be.all(&k.ln1), w(QKV_W), Some(w(QKV_B)), bt, c, 3 * c);
            probe.check(be, "attn.qkv", lo, fwd, be.view(&k.qkv, 0..n3), &[b, t, 3 * c]);
            match kv.as_deref_mut() {
                None => {
                    be.attention_forward(be.all_mut(&mut k.atty), be.all_mut(&mut k.att), be.all(&k.qkv), b, t, c, nh)
                }
                Some(cache) => {
                    // The new rows, (B, T, 3C), into the cache's (B, cap, 3C) at position pos0.
                    let (c3, cap) = (3 * c, cache.cap);
                    let rows = &mut cache.qkv[l];
                    let dst = be.view_mut(rows, pos0 * c3..b * cap * c3);
                    be.copy_2d(dst, cap * c3, be.view(&k.qkv, 0..n3), t * c3, t * c3, b);
                    be.attention_forward_rows(
                        be.all_mut(&mut k.atty),
                        be.all_mut(&mut k.att),
                        be.all(rows),
                        cap,
                        b,
                        pos0,
                        pos0 + t,
                        c,
                        nh,
                    );
                }
            }
            probe.check(be, "attn", lo, fwd, be.view(&k.atty, 0..n), &[b, t, c]);
            be.matmul_forward(be.all_mut(&mut k.attproj), be.all(&k.atty), w(PROJ_W), Some(w(PROJ_B)), bt, c, c);
            probe.check(be, "attn.proj", lo, fwd, be.view(&k.attproj, 0..n), &[b, t, c]);
            be.residual_forward(be.all_mut(&mut k.res2), be.all(x), be.all(&k.attproj), n);
            probe.check(be, "residual1", lo, fwd, be.view(&k.res2, 0..n), &[b, t, c]);
            be.layernorm_forward(
                be.all_mut(&mut k.ln2),
                be.all_mut(&mut k.ln2_mean),
                be.all_mut(&mut k.ln2_rstd),
                be.all(&k.res2),
                w(LN2_W),
                w(LN2_B),
                bt,
                c,
            );
            probe.check(be, "ln2", lo, fwd, be.view(&k.ln2, 0..n), &[b, t, c]);
            be.matmul_forward(be.all_mut(&mut k.fch), be.all(&k.ln2), w(FC_W), Some(w(FC_B)), bt, c, 4 * c);
            probe.check(be, "mlp.fc", lo, fwd, be.view(&k.fch, 0..n4), &[b, t, 4 * c]);
            be.gelu_forward(be.all_mut(&mut k.fch_gelu), be.all(&k.fch), n4);
            probe.check(be, "mlp.gelu", lo, fwd, be.view(&k.fch_gelu, 0..n4), &[b, t, 4 * c]);
            be.matmul_forward(
                be.all_mut(&mut k.fcproj),
                be.all(&k.fch_gelu),
                w(FCPROJ_W),
                Some(w(FCPROJ_B)),
                bt,
                4 * c,
                c,
            );
            probe.check(be, "mlp.proj", lo, fwd, be.view(&k.fcproj, 0..n), &[b, t, c]);
            be.residual_forward(be.all_mut(&mut k.res3), be.all(&k.res2), be.all(&k.fcproj), n);
            probe.check(be, "residual2", lo, fwd, be.view(&k.res3, 0..n), &[b, t, c]);
        }
        let x = if nl == 0 { &a.encoded } else { &a.blocks[nl - 1].res3 };
        let (wf, bf) = (w(bp(nl, 0)), w(bp(nl, 1)));
        be.layernorm_forward(
            be.all_mut(&mut a.lnf),
            be.all_mut(&mut a.lnf_mean),
            be.all_mut(&mut a.lnf_rstd),
            be.all(x),
            wf,
            bf,
            bt,
            c,
        );
        probe.check(be, "ln_f", None, fwd, be.view(&a.lnf, 0..n), &[b, t, c]);
        be.matmul_forward(be.all_mut(&mut a.logits), be.all(&a.lnf), w(bp(nl, 2)), None, bt, c, v);
        probe.check(be, "head", None, fwd, be.view(&a.logits, 0..bt * v), &[b, t, v]);
        if let Some(cache) = kv {
            cache.len += t;
        }
        be.view(&a.logits, 0..bt * v)
    }

    /// Backward pass of the last forward on `acts`. dlogits: (B, T, V); grads: the gradient buffer
    /// (same layout as `params`), ACCUMULATED into, one parameter view at a time; each view is
    /// released, in strictly descending parameter order, as soon as its gradient is final, so the
    /// buckets it completes can be all-reduced while backward goes on. Given `hash` and host weights
    /// (`Backend::host`), it absorbs the weights into it as it goes: before it reads a parameter, the
    /// flat buffer up to that parameter's end (backward reads the parameters in layout order, so each
    /// is hashed right before its first read and read from cache). The caller finishes the checksum
    /// (`Prefix::finish`): the replica checksum of the weights as read back, without a pass of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<B: Backend, G: GradSlots<B>, P: Probe>(
        &self,
        be: &B,
        params: &B::Buf,
        acts: &mut Activations<B>,
        dlogits: B::View<'_>,
        grads: &mut G,
        probe: &mut P,
        hash: Option<&mut Prefix>,
    ) {
        let GptConfig { vocab: v, channels: c, heads: nh, layers: nl, .. } = self.cfg;
        let a = acts;
        let (b, t) = (a.b, a.t);
        let bt = b * t;
        let (n, n3, n4) = (bt * c, bt * 3 * c, bt * 4 * c);
        assert!(!a.cached, "backward: the last forward was KV-cached (it keeps no activations to differentiate)");
        let bwd = Phase::Backward;
        let (lnf_w, lnf_b, head) = (bp(nl, 0), bp(nl, 1), bp(nl, 2));
        let hash = std::cell::RefCell::new(hash.zip(be.host(be.all(params))));
        let w = |p: usize| {
            if let Some((h, x)) = hash.borrow_mut().as_mut() {
                h.upto(x, self.ranges[p].end);
            }
            self.w(be, params, p)
        };
        // The first n (3n, 4n) elements of a scratch buffer, zeroed.
        let zeroed = |x: &mut B::Buf, n| be.fill(be.view_mut(x, 0..n), 0.0);

        // head: logits = lnf @ head^T
        zeroed(&mut a.d1, n);
        let mut dhead = grads.take(head);
        be.matmul_backward(
            be.view_mut(&mut a.d1, 0..n),
            G::view_mut(&mut dhead),
            None,
            dlogits,
            be.all(&a.lnf),
            w(head),
            bt,
            c,
            v,
        );
        probe.check(be, "head", None, bwd, be.view(&a.d1, 0..n), &[b, t, c]);
        ready(be, grads, probe, head, dhead);

        // ln_f
        let x = if nl == 0 { &a.encoded } else { &a.blocks[nl - 1].res3 };
        zeroed(&mut a.dx, n);
        let (mut dw, mut db) = (grads.take(lnf_w), grads.take(lnf_b));
        let (mean, rstd) = (be.all(&a.lnf_mean), be.all(&a.lnf_rstd));
        be.layernorm_backward(
            be.view_mut(&mut a.dx, 0..n),
            G::view_mut(&mut dw),
            G::view_mut(&mut db),
            be.all(&a.d1),
            be.all(x),
            w(lnf_w),
            mean,
            rstd,
            bt,
            c,
        );
        probe.check(be, "ln_f", None, bwd, be.view(&a.dx, 0..n), &[b, t, c]);
        ready(be, grads, probe, lnf_b, db);
        ready(be, grads, probe, lnf_w, dw);

        for l in (0..nl).rev() {
            let k = &a.blocks[l];
            let x = if l == 0 { &a.encoded } else { &a.blocks[l - 1].res3 };
            let w = |i| w(bp(l, i));
            let lo = Some(l);

            // res3 = res2 + fcproj
            zeroed(&mut a.dres, n);
            zeroed(&mut a.d1, n);
            be.residual_backward(be.view_mut(&mut a.dres, 0..n), be.view_mut(&mut a.d1, 0..n), be.all(&a.dx), n);
            probe.check(be, "residual2", lo, bwd, be.view(&a.dres, 0..n), &[b, t, c]);
            // fcproj = gelu @ W^T + b
            zeroed(&mut a.dh2, n4);
            let (mut dw, mut db) = (grads.take(bp(l, FCPROJ_W)), grads.take(bp(l, FCPROJ_B)));
            let dgelu = be.view_mut(&mut a.dh2, 0..n4);
            be.matmul_backward(
                dgelu,
                G::view_mut(&mut dw),
                Some(G::view_mut(&mut db)),
                be.all(&a.d1),
                be.all(&k.fch_gelu),
                w(FCPROJ_W),
                bt,
                4 * c,
                c,
            );
            probe.check(be, "mlp.proj", lo, bwd, be.view(&a.dh2, 0..n4), &[b, t, 4 * c]);
            ready(be, grads, probe, bp(l, FCPROJ_B), db);
            ready(be, grads, probe, bp(l, FCPROJ_W), dw);
            // gelu
            zeroed(&mut a.dh1, n4);
            be.gelu_backward(be.view_mut(&mut a.dh1, 0..n4), be.all(&k.fch), be.all(&a.dh2), n4);
            probe.check(be, "mlp.gelu", lo, bwd, be.view(&a.dh1, 0..n4), &[b, t, 4 * c]);
            // fch = ln2 @ W^T + b
            zeroed(&mut a.d2, n);
            let (mut dw, mut db) = (grads.take(bp(l, FC_W)), grads.take(bp(l, FC_B)));
            let dln2 = be.view_mut(&mut a.d2, 0..n);
            be.matmul_backward(
                dln2,
                G::view_mut(&mut dw),
                Some(G::view_mut(&mut db)),
                be.all(&a.dh1),
                be.all(&k.ln2),
                w(FC_W),
                bt,
                c,
                4 * c,
            );
            probe.check(be, "mlp.fc", lo, bwd, be.view(&a.d2, 0..n), &[b, t, c]);
            ready(be, grads, probe, bp(l, FC_B), db);
            ready(be, grads, probe, bp(l, FC_W), dw);
            // ln2, accumulating into the mid-block residual gradient
            let (mut dw, mut db) = (grads.take(bp(l, LN2_W)), grads.take(bp(l, LN2_B)));
            let (dres, mean, rstd) = (be.view_mut(&mut a.dres, 0..n), be.all(&k.ln2_mean), be.all(&k.ln2_rstd));
            be.layernorm_backward(
                dres,
                G::view_mut(&mut dw),
                G::view_mut(&mut db),
                be.all(&a.d2),
                be.all(&k.res2),
                w(LN2_W),
                mean,
                rstd,
                bt,
                c,
            );
            probe.check(be, "ln2", lo, bwd, be.view(&a.dres, 0..n), &[b, t, c]);
            ready(be, grads, probe, bp(l, LN2_B), db);
            ready(be, grads, probe, bp(l, LN2_W), dw);

            // res2 = x + attproj
            zeroed(&mut a.dx, n);
            zeroed(&mut a.d1, n);
            be.residual_backward(be.view_mut(&mut a.dx, 0..n), be.view_mut(&mut a.d1, 0..n), be.all(&a.dres), n);
            probe.check(be, "residual1", lo, bwd, be.view(&a.dx, 0..n), &[b, t, c]);
            // attproj = atty @ W^T + b
            zeroed(&mut a.d2, n);
            let (mut dw, mut db) = (grads.take(bp(l, PROJ_W)), grads.take(bp(l, PROJ_B)));
            let datty = be.view_mut(&mut a.d2, 0..n);
            be.matmul_backward(
                datty,
                G::view_mut(&mut dw),
                Some(G::view_mut(&mut db)),
                be.all(&a.d1),
                be.all(&k.atty),
                w(PROJ_W),
                bt,
                c,
                c,
            );
            probe.check(be, "attn.proj", lo, bwd, be.view(&a.d2, 0..n), &[b, t, c]);
            ready(be, grads, probe, bp(l, PROJ_B), db);
            ready(be, grads, probe, bp(l, PROJ_W), dw);
            // attention
            zeroed(&mut a.dqkv, n3);
            be.attention_backward(
                be.view_mut(&mut a.dqkv, 0..n3),
                be.all(&a.d2),
                be.all(&k.qkv),
                be.all(&k.att),
                b,
                t,
                c,
                nh,
            );
            probe.check(be, "attn", lo, bwd, be.view(&a.dqkv, 0..n3), &[b, t, 3 * c]);
            // qkv = ln1 @ W^T + b
            zeroed(&mut a.d1, n);
            let (mut dw, mut db) = (grads.take(bp(l, QKV_W)), grads.take(bp(l, QKV_B)));
            let dln1 = be.view_mut(&mut a.d1, 0..n);
            be.matmul_backward(
                dln1,
                G::view_mut(&mut dw),
                Some(G::view_mut(&mut db)),
                be.all(&a.dqkv),
                be.all(&k.ln1),
                w(QKV_W),
                bt,
                c,
                3 * c,
            );
            probe.check(be, "attn.qkv", lo, bwd, be.view(&a.d1, 0..n), &[b, t, c]);
            ready(be, grads, probe, bp(l, QKV_B), db);
            ready(be, grads, probe, bp(l, QKV_W), dw);
            // ln1, accumulating into the block input's gradient
            let (mut dw, mut db) = (grads.take(bp(l, LN1_W)), grads.take(bp(l, LN1_B)));
            let (dx, mean, rstd) = (be.view_mut(&mut a.dx, 0..n), be.all(&k.ln1_mean), be.all(&k.ln1_rstd));
            be.layernorm_backward(
                dx,
                G::view_mut(&mut dw),
                G::view_mut(&mut db),
                be.all(&a.d1),
                be.all(x),
                w(LN1_W),
                mean,
                rstd,
                bt,
                c,
            );
            probe.check(be, "ln1", lo, bwd, be.view(&a.dx, 0..n), &[b, t, c]);
            ready(be, grads, probe, bp(l, LN1_B), db);
            ready(be, grads, probe, bp(l, LN1_W), dw);
        }

        let (mut dwte, mut dwpe) = (grads.take(WTE), grads.take(WPE));
        be.encoder_backward(G::view_mut(&mut dwte), G::view_mut(&mut dwpe), be.view(&a.dx, 0..n), &a.tokens, b, t, c);
        ready(be, grads, probe, WPE, dwpe);
        ready(be, grads, probe, WTE, dwte);
    }
}

/// Hand parameter `p`'s final gradient to the probe, then release it to the bus.
fn ready<B: Backend, G: GradSlots<B>, P: Probe>(be: &B, g: &mut G, probe: &mut P, p: usize, grad: G::Slot) {
    probe.grad(be, p, G::view(&grad));
    g.release(p, grad);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradbus_kernels::backend::Cpu;

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
    fn backward_with_a_hash_gives_the_gradients_and_the_replica_checksum_of_the_weights_it_read() {
        // The replica check's read-back taken by backward as it reads each parameter: the same
        // gradients bit for bit, the checksum of the whole buffer (padding too), all but the
        // embeddings absorbed during backward (in layout order), and a flipped weight bit shows.
        let cfg = GptConfig { channels: 32, layers: 3, ..GptConfig::default() };
        let layout = Layout::new(&param_specs(&cfg), 1 << 12);
        let gpt = Gpt::new(&cfg, &layout);
        let mut params = vec![0.0; layout.len];
        let mut rng = Rng::new(&[29]);
        gpt.init(&mut params, &mut rng);
        let (b, t, v) = (3, 7, cfg.vocab);
        let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(v) as u32).collect();
        let dlogits: Vec<f32> = (0..b * t * v).map(|_| 1e-2 * rng.normal()).collect();
        let mut acts = Activations::new(&Cpu, &cfg, b, t);
        let mut grads = |params: &[f32], hash: Option<&mut Prefix>| {
            let mut g = vec![0.0; layout.len];
            gpt.forward(&Cpu, &params.to_vec(), &tokens, b, t, &mut acts, &mut NoProbe);
            let mut slots = gradbus_collectives::ParamGrads::new(&mut g, &layout);
            gpt.backward(&Cpu, &params.to_vec(), &mut acts, &dlogits[..], &mut slots, &mut NoProbe, hash);
            g.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let plain = grads(&params, None);
        let mut read = Prefix::new();
        assert_eq!(grads(&params, Some(&mut read)), plain, "the same gradients");
        // All but the embeddings (last in the layout), which backward does not read.
        let wpe = gpt.param_range(WPE);
        assert!(read.absorbed() >= wpe.start, "backward read up to wpe: {} of {}", read.absorbed(), layout.len);
        assert_eq!(read.finish(&params), gradbus_kernels::checksum::checksum(&params));
        let mut flipped = params.clone();
        let at = gpt.param_range(bp(1, QKV_W)).start + 5;
        flipped[at] = f32::from_bits(flipped[at].to_bits() ^ 1);
        let mut read = Prefix::new();
        grads(&flipped, Some(&mut read));
        assert_ne!(read.finish(&flipped), gradbus_kernels::checksum::checksum(&params), "a flipped bit shows");
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
            let mut acts = Activations::new(&Cpu, &cfg, b, t);
            let full = gpt.forward(&Cpu, &params, &tokens, b, t, &mut acts, &mut NoProbe).to_vec();
            for steps in [vec![2, 1, 1, 1, 1, 1, 1, 1], vec![3, 2, 2, 2], vec![9]] {
                let mut cache = KvCache::new(&Cpu, &cfg, b, t);
                let mut got = vec![f32::NAN; b * t * v];
                for tn in steps {
                    let p0 = cache.len();
                    let new: Vec<u32> = tokens.chunks_exact(t).flat_map(|s| s[p0..p0 + tn].iter().copied()).collect();
                    let logits = gpt.forward_cached(&Cpu, &params, &new, b, tn, &mut cache, &mut acts);
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
            assert_eq!(cfg.param_numel(bad), None, "{bad}");
        }
        for s in param_specs(&cfg) {
            assert_eq!(cfg.param_numel(&s.name), Some(s.numel), "{}", s.name);
        }
    }

    #[test]
    fn activation_count_matches_the_buffers() {
        let cfg = GptConfig { vocab: 7, max_seq: 9, channels: 12, heads: 3, layers: 2 };
        let (b, t) = (5, 6);
        let a = Activations::new(&Cpu, &cfg, b, t);
        let mut n = a.tokens.len() + a.encoded.len() + a.lnf.len() + a.lnf_mean.len() + a.lnf_rstd.len();
        n += a.logits.len() + a.dx.len() + a.dres.len() + a.d1.len() + a.d2.len();
        n += a.dqkv.len() + a.dh1.len() + a.dh2.len();
        for k in &a.blocks {
            n += k.ln1.len() + k.ln1_mean.len() + k.ln1_rstd.len() + k.qkv.len() + k.atty.len() + k.att.len();
            n += k.attproj.len() + k.res2.len() + k.ln2.len() + k.ln2_mean.len() + k.ln2_rstd.len();
            n += k.fch.len() + k.fch_gelu.len() + k.fcproj.len() + k.res3.len();
        }
        assert_eq!(activations_numel(&cfg, b, t), n as f64);
    }
}
