//! The probe interface between the model/loss and the forensics trace: forward, backward and the loss
//! hand every op's output to a [`Probe`] right after computing it, in execution order, so a trace can
//! name the FIRST op whose output holds a non-finite value.
//!
//! Invariants: a probe only observes (read views); it can change no number. Calls come in the order
//! the ops run (forward layer 0 up, then the loss, then backward from the loss down to layer 0), and
//! each call's `dims` give the row-major shape of `data`. Activation tensors have `dims[0] = B` and
//! `dims[1] = T`, so a flat index unravels to (sample, token); parameter gradients come through
//! [`Probe::grad`] instead. Data arrives as views of the backend's buffers: a probe that looks at
//! values brings them to the host with `Backend::to_host` (a borrow on the CPU, a download on a
//! device); [`NoProbe`] does nothing, downloads nothing and, being a generic parameter, compiles
//! away.
//!
//! Op names, in call order. Forward: `encoder`; per block `ln1`, `attn.qkv`, `attn`, `attn.proj`,
//! `residual1`, `ln2`, `mlp.fc`, `mlp.gelu`, `mlp.proj`, `residual2`; `ln_f`, `head` (the logits).
//! Loss forward: `loss.logp`, then [`Probe::exp`] for `loss.ratio_exp` and `loss.kl_exp`, then
//! `loss.terms` (each position's masked contribution). Loss backward: `loss.ratio_exp` and
//! `loss.kl_exp` (the gradients of the log-ratios, where `0 * inf = NaN` appears first), `loss.logp`,
//! `loss.logits`. Model backward: the forward names in reverse, each with the gradient of the op's
//! input, and [`Probe::grad`] for each parameter as it becomes final.

use gradbus_kernels::backend::Backend;

/// Which pass an op belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The forward pass (including the loss's forward).
    Forward,
    /// The backward pass (including the loss's backward).
    Backward,
}

/// One exp in the loss, with its operands, so a trace can say "exp of a log-ratio of 91.3 at a masked
/// position, sample b, token t". All views are (B, T): every position, whether or not the exp was
/// evaluated there (see `safe`).
pub struct ExpOp<'a, B: Backend> {
    /// `"loss.ratio_exp"` (PPO ratio, `exp(logp - old)`) or `"loss.kl_exp"` (k3, `exp(ref - logp)`).
    pub op: &'static str,
    /// The log-ratio fed to exp (after the [-20, 20] clamp in the safe style).
    pub input: B::View<'a>,
    /// The exp's output.
    pub output: B::View<'a>,
    /// Response mask: 1 at response tokens, 0 at prompt or padding.
    pub mask: B::View<'a>,
    /// The safe style: exp was evaluated only where the mask is not 0 (elsewhere `input` and
    /// `output` hold 0 and 1); in ROLL's style everywhere.
    pub safe: bool,
    /// (B, T).
    pub dims: [usize; 2],
}

/// Observer of every op's output; all methods default to doing nothing.
pub trait Probe {
    /// The output of `op` (of block `layer`, if any) in `phase`; `data` has shape `dims`, whose first
    /// two entries are (B, T). In backward, `data` is the gradient the op produced for its input.
    #[inline(always)]
    fn check<B: Backend>(
        &mut self,
        be: &B,
        op: &'static str,
        layer: Option<usize>,
        phase: Phase,
        data: B::View<'_>,
        dims: &[usize],
    ) {
        let _ = (be, op, layer, phase, data, dims);
    }

    /// The final gradient of parameter `param` (forward-order index) for this backward, as it
    /// stands in the flat gradient buffer (accumulated over earlier micro-batches, if any).
    #[inline(always)]
    fn grad<B: Backend>(&mut self, be: &B, param: usize, data: B::View<'_>) {
        let _ = (be, param, data);
    }

    /// An exp of the loss (forward only), with its input and output at every position.
    #[inline(always)]
    fn exp<B: Backend>(&mut self, be: &B, op: ExpOp<'_, B>) {
        let _ = (be, op);
    }
}

/// The probe that checks nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProbe;

impl Probe for NoProbe {}
