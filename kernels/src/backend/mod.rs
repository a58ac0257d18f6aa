//! The seam between the model and the device it runs on: a [`Backend`] owns buffers and runs
//! exactly the ops that the model (`worker/src/model.rs`), the RL loss, the rollout and the
//! optimizer need. [`Cpu`] is today's kernels (`crate::ops`); a device backend (CUDA through
//! cudarc) implements the same trait on device memory.
//!
//! Invariants:
//! - Buffers and views never expose host memory: an op takes views and writes views. Every host
//!   transfer is a method that says so ([`Backend::upload`], [`Backend::write`],
//!   [`Backend::to_host`], [`Backend::upload_ids`]); the only other host values are small results
//!   that an op returns (a checksum, a health row, loss statistics, sampled tokens).
//! - Parameters, gradients and Adam moments are ONE flat buffer each; a parameter is a range of it,
//!   taken with [`Backend::view`] / [`Backend::view_mut`] (or, for gradients while backward goes
//!   on, through `gradbus_collectives::grads::GradSlots`, so a bucket can be reduced as soon as its
//!   last parameter is final).
//! - An op has the arguments and the arithmetic of its `crate::ops` namesake, which is the CPU
//!   implementation and the definition: a device op that reorders floating-point operations must
//!   say so where it is defined. Backward ops ACCUMULATE into their gradient outputs.
//! - Buffers are sized for a capacity; an op uses the prefix its dimensions give.
//!
//! How the device backend implements it (`crate::cuda`, its `backend.rs`; cudarc 0.19):
//! `Buf = CudaSlice<f32>`, `Ids = DeviceIds` (the ids on the device and a host copy, for the
//! encoder's backward), `View<'a> = CudaView<'a, f32>`, `ViewMut<'a> = CudaViewMut<'a, f32>`; `view`
//! is `buf.slice(r)`, `reborrow` is `v.as_view()`, `split_mut` checks that the ranges are disjoint
//! and inside the buffer and takes a `slice_mut` of each. Matmuls
//! go to cuBLAS (no TF32), the other ops to NVRTC kernels, all enqueued on one stream; methods that
//! return a host value (`to_host`, `checksum`, `health_scan`, `adamw` for its checksum,
//! `grpo_forward` for its statistics, `sample`) synchronize it. Errors of a device are fatal to
//! the rank: an op panics with the driver's message (a device backend checks the driver,
//! compiles its kernels and allocates its buffers before training starts, where errors are
//! values).

use std::borrow::Cow;
use std::ops::Range;

use crate::health::Health;
use crate::ops::{GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};

mod cpu;
pub use cpu::Cpu;

/// Buffers on a device and the model's ops on them. Dimension names as in `crate::ops`: B batch,
/// T time, C channels, V vocabulary, NH heads, OC output channels; N a row count (B * T).
#[allow(clippy::too_many_arguments)]
pub trait Backend: Sync + Sized + 'static {
    /// An owned f32 buffer (CPU: `Vec<f32>`).
    type Buf: Send + Sync;
    /// An owned buffer of token ids (CPU: `Vec<u32>`).
    type Ids: Send + Sync;
    /// A read view of a range of a buffer (CPU: `&'a [f32]`).
    type View<'a>: Send + Sync;
    /// A write view of a range of a buffer (CPU: `&'a mut [f32]`).
    type ViewMut<'a>: Send;

    // --- buffers, views and transfers -------------------------------------------------------

    /// `n` zeros.
    fn zeros(&self, n: usize) -> Self::Buf;
    /// A buffer holding a copy of host `x` (a transfer).
    fn upload(&self, x: &[f32]) -> Self::Buf;
    /// Elements of a buffer.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// `n` token ids, all 0.
    fn ids(&self, n: usize) -> Self::Ids;
    /// Host `src` into the first `src.len()` ids of `dst` (a transfer).
    fn upload_ids(&self, dst: &mut Self::Ids, src: &[u32]);
    /// Elements `r` of `buf`.
    fn view<'a>(&self, buf: &'a Self::Buf, r: Range<usize>) -> Self::View<'a>;
    /// Elements `r` of `buf`, mutable.
    fn view_mut<'a>(&self, buf: &'a mut Self::Buf, r: Range<usize>) -> Self::ViewMut<'a>;
    /// The whole buffer.
    fn all<'a>(&self, buf: &'a Self::Buf) -> Self::View<'a> {
        self.view(buf, 0..self.len(buf))
    }
    /// The whole buffer, mutable.
    fn all_mut<'a>(&self, buf: &'a mut Self::Buf) -> Self::ViewMut<'a> {
        let n = self.len(buf);
        self.view_mut(buf, 0..n)
    }
    /// Disjoint mutable views of `ranges` of one buffer, in the order given (ranges in any order,
    /// none overlapping another; panics otherwise).
    fn split_mut<'a>(&self, buf: &'a mut Self::Buf, ranges: &[Range<usize>]) -> Vec<Self::ViewMut<'a>>;
    /// A second handle on the same elements (CPU: a copy of the reference; CUDA: `v.slice(..)`).
    fn dup<'a>(v: &Self::View<'a>) -> Self::View<'a>;
    /// A mutable view read for a while.
    fn reborrow<'b>(v: &'b Self::ViewMut<'_>) -> Self::View<'b>;
    /// A mutable view lent for a while.
    fn reborrow_mut<'b>(v: &'b mut Self::ViewMut<'_>) -> Self::ViewMut<'b>;
    /// The elements of `v` on the host: borrowed where they already are (CPU), else downloaded (a
    /// transfer; for the trace, checkpoints and dumps).
    fn to_host<'a>(&self, v: Self::View<'a>) -> Cow<'a, [f32]>;
    /// Host `src` into `dst` (same length; a transfer).
    fn write(&self, dst: Self::ViewMut<'_>, src: &[f32]);
    /// `dst = src` (same length), on the device.
    fn copy(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>);
    /// `height` rows of `width` elements: row `i` of `src` at `i * src_pitch` to row `i` of `dst`
    /// at `i * dst_pitch` (cudaMemcpy2D). The KV cache's new rows, the rollout's logits.
    fn copy_2d(
        &self,
        dst: Self::ViewMut<'_>,
        dst_pitch: usize,
        src: Self::View<'_>,
        src_pitch: usize,
        width: usize,
        height: usize,
    );
    /// Every element of `dst` set to `x`.
    fn fill(&self, dst: Self::ViewMut<'_>, x: f32);

    // --- the model (crate::ops, same names, arguments and arithmetic) -------------------------

    /// out: (B, T, C), tokens: (B, T), wte: (V, C), wpe: (T.., C) from the first position.
    fn encoder_forward(
        &self,
        out: Self::ViewMut<'_>,
        tokens: &Self::Ids,
        wte: Self::View<'_>,
        wpe: Self::View<'_>,
        b: usize,
        t: usize,
        c: usize,
        v: usize,
    );
    /// dwte: (V, C) +=, dwpe: (T.., C) +=, dout: (B, T, C), tokens: (B, T).
    fn encoder_backward(
        &self,
        dwte: Self::ViewMut<'_>,
        dwpe: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        tokens: &Self::Ids,
        b: usize,
        t: usize,
        c: usize,
    );
    /// out: (N, C), mean: (N), rstd: (N), inp: (N, C), weight: (C), bias: (C).
    fn layernorm_forward(
        &self,
        out: Self::ViewMut<'_>,
        mean: Self::ViewMut<'_>,
        rstd: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        weight: Self::View<'_>,
        bias: Self::View<'_>,
        n: usize,
        c: usize,
    );
    /// dinp: (N, C) +=, dweight: (C) +=, dbias: (C) +=, dout: (N, C), inp: (N, C), weight: (C),
    /// mean: (N), rstd: (N).
    fn layernorm_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dweight: Self::ViewMut<'_>,
        dbias: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        weight: Self::View<'_>,
        mean: Self::View<'_>,
        rstd: Self::View<'_>,
        n: usize,
        c: usize,
    );
    /// out = inp @ weight^T + bias. out: (N, OC), inp: (N, C), weight: (OC, C), bias: (OC).
    fn matmul_forward(
        &self,
        out: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        weight: Self::View<'_>,
        bias: Option<Self::View<'_>>,
        n: usize,
        c: usize,
        oc: usize,
    );
    /// dinp: (N, C) +=, dweight: (OC, C) +=, dbias: (OC) +=, dout: (N, OC), inp: (N, C),
    /// weight: (OC, C).
    fn matmul_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dweight: Self::ViewMut<'_>,
        dbias: Option<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        weight: Self::View<'_>,
        n: usize,
        c: usize,
        oc: usize,
    );
    /// Causal attention. out: (B, T, C), att: (B, NH, T, T), inp: (B, T, 3C) as q | k | v.
    fn attention_forward(
        &self,
        out: Self::ViewMut<'_>,
        att: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    );
    /// The query positions `t0..t` over positions `0..t` of a KV cache whose rows are `stride`
    /// apart per sequence. out: (B, t - t0, C), att: (B, NH, t - t0, t), inp: (B, stride, 3C).
    fn attention_forward_rows(
        &self,
        out: Self::ViewMut<'_>,
        att: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        stride: usize,
        b: usize,
        t0: usize,
        t: usize,
        c: usize,
        nh: usize,
    );
    /// dinp: (B, T, 3C) +=, dout: (B, T, C), inp: (B, T, 3C), att: (B, NH, T, T).
    fn attention_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        att: Self::View<'_>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    );
    /// out: (N), inp: (N).
    fn gelu_forward(&self, out: Self::ViewMut<'_>, inp: Self::View<'_>, n: usize);
    /// dinp: (N) +=, inp: (N), dout: (N).
    fn gelu_backward(&self, dinp: Self::ViewMut<'_>, inp: Self::View<'_>, dout: Self::View<'_>, n: usize);
    /// out = inp1 + inp2, (N).
    fn residual_forward(&self, out: Self::ViewMut<'_>, inp1: Self::View<'_>, inp2: Self::View<'_>, n: usize);
    /// dinp1: (N) +=, dinp2: (N) +=, dout: (N).
    fn residual_backward(&self, dinp1: Self::ViewMut<'_>, dinp2: Self::ViewMut<'_>, dout: Self::View<'_>, n: usize);

    // --- the loss -------------------------------------------------------------------------------

    /// logp: (N), lse: (N), logits: (N, V), targets: (N).
    fn logsoftmax_gather_forward(
        &self,
        logp: Self::ViewMut<'_>,
        lse: Self::ViewMut<'_>,
        logits: Self::View<'_>,
        targets: &Self::Ids,
        n: usize,
        v: usize,
    );
    /// dlogits: (N, V) +=, dlogp: (N), logits: (N, V), lse: (N), targets: (N).
    fn logsoftmax_gather_backward(
        &self,
        dlogits: Self::ViewMut<'_>,
        dlogp: Self::View<'_>,
        logits: Self::View<'_>,
        lse: Self::View<'_>,
        targets: &Self::Ids,
        n: usize,
        v: usize,
    );
    /// The GRPO loss's per-position forward (`ops::grpo_forward`): logp, mask, old, reference:
    /// (B, T), adv: (B). Its statistics are a host value.
    fn grpo_forward(
        &self,
        s: &GrpoScalars,
        logp: Self::View<'_>,
        mask: Self::View<'_>,
        adv: Self::View<'_>,
        old: Self::View<'_>,
        reference: Self::View<'_>,
        b: usize,
        t: usize,
        saved: &mut GrpoSaved<Self::Buf>,
    ) -> GrpoStats;
    /// Its backward (`ops::grpo_backward`), into `grads`.
    fn grpo_backward(
        &self,
        s: &GrpoScalars,
        mask: Self::View<'_>,
        adv: Self::View<'_>,
        saved: &GrpoSaved<Self::Buf>,
        denom: f32,
        b: usize,
        t: usize,
        grads: &mut GrpoGrads<Self::Buf>,
    );

    // --- the rollout -----------------------------------------------------------------------------

    /// One token per sequence from the last position of logits (B, T, V), row `b` with the
    /// caller's uniform draw `uniforms[b]` (`ops::sample`), into host `out` (B).
    fn sample(
        &self,
        out: &mut [u32],
        logits: Self::View<'_>,
        b: usize,
        t: usize,
        v: usize,
        temperature: f32,
        uniforms: &[f32],
    );

    // --- the optimizer and the health of gradients ---------------------------------------------

    /// `x[i] *= s`.
    fn scale(&self, x: Self::ViewMut<'_>, s: f32);
    /// The optimizer's pass over the reduced gradients: AdamW (`ops::adamw_update`) on `grads * s`
    /// (the sum over ranks scaled to its clipped mean, each product rounded to f32 as `scale` stores
    /// it). Returns the replica checksum of the updated parameters (`checksum::checksum`'s
    /// definition) and, for each of `consumed` (ranges that tile the buffer, in order; empty:
    /// nothing hashed), the replica checksum of that range of the gradients as the update read
    /// them. `grads` is left unspecified (the CPU's one pass, `ops::adamw_scaled`, leaves it as it
    /// was; the GPU scales it in place, then updates).
    #[allow(clippy::too_many_arguments)]
    fn scaled_adamw(
        &self,
        params: Self::ViewMut<'_>,
        grads: Self::ViewMut<'_>,
        s: f32,
        m: Self::ViewMut<'_>,
        v: Self::ViewMut<'_>,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        t: u64,
        consumed: &[Range<usize>],
    ) -> (u64, Vec<u64>);
    /// The replica checksum of `x` (`checksum::checksum`).
    fn checksum(&self, x: Self::View<'_>) -> u64;
    /// `x` as host memory, where the backend keeps its buffers there (the CPU); `None` on a device
    /// (passes that hash what they read on the host, `checksum::Prefix`, are then not taken).
    fn host<'a>(&self, _x: Self::View<'a>) -> Option<&'a [f32]> {
        None
    }
    /// The fused health scan of `x` (`health::health_scan`): where a bucket lives, only this
    /// crosses to the host.
    fn health_scan(&self, x: Self::View<'_>) -> Health;
}
