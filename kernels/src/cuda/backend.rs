//! [`Backend`] for a [`Gpu`]: buffers are `CudaSlice<f32>`, views `CudaView`/`CudaViewMut` ranges
//! of them, and every op the `Gpu` method of the same name (NVRTC kernels, cuBLAS for the dense
//! layer), enqueued on the `Gpu`'s one stream. Parameters, gradients, Adam moments and activations
//! live on the device; what crosses to the host is what the trait says: transfers, the replica
//! checksum, a health row, the loss's stats and the sampled tokens.
//!
//! Invariants:
//! - As the trait says, a device error is fatal to the rank: an op panics with the driver's
//!   message. Everything that can fail for a reason other than a broken device (no driver, no
//!   NVRTC, no cuBLAS, a kernel that does not compile) fails in `Gpu::new`, as a value.
//! - Token ids keep a host copy beside the device one ([`DeviceIds`]): ids only ever come from the
//!   host (`upload_ids`), and the encoder's backward lists each token's positions on the host
//!   (`cuda_grid::token_rows`) without a download.
//! - Views of one buffer never overlap unless both are read views (`split_mut` checks).

use std::borrow::Cow;
use std::ops::Range;

use super::{CudaSlice, CudaView, CudaViewMut, Gpu};
use crate::backend::Backend;
use crate::health::Health;
use crate::ops::{GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};
use crate::Error;

/// Token ids on the device, with the host copy they were uploaded from.
pub struct DeviceIds {
    dev: CudaSlice<u32>,
    host: Vec<u32>,
}

impl DeviceIds {
    /// The device copy.
    pub fn device(&self) -> &CudaSlice<u32> {
        &self.dev
    }
}

/// The op's result, or a panic naming the device error (the trait's contract: fatal to the rank).
fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA backend: {e}"))
}

#[allow(clippy::too_many_arguments)]
impl Backend for Gpu {
    type Buf = CudaSlice<f32>;
    type Ids = DeviceIds;
    type View<'a> = CudaView<'a, f32>;
    type ViewMut<'a> = CudaViewMut<'a, f32>;

    fn zeros(&self, n: usize) -> CudaSlice<f32> {
        ok(Gpu::zeros(self, n))
    }
    fn upload(&self, x: &[f32]) -> CudaSlice<f32> {
        ok(Gpu::upload(self, x))
    }
    fn len(&self, buf: &CudaSlice<f32>) -> usize {
        buf.len()
    }
    fn ids(&self, n: usize) -> DeviceIds {
        DeviceIds { dev: ok(Gpu::zeros(self, n)), host: vec![0; n] }
    }
    fn upload_ids(&self, dst: &mut DeviceIds, src: &[u32]) {
        dst.host[..src.len()].copy_from_slice(src);
        ok(self.upload_into(src, &mut dst.dev.slice_mut(..src.len())));
    }
    fn view<'a>(&self, buf: &'a CudaSlice<f32>, r: Range<usize>) -> CudaView<'a, f32> {
        buf.slice(r)
    }
    fn view_mut<'a>(&self, buf: &'a mut CudaSlice<f32>, r: Range<usize>) -> CudaViewMut<'a, f32> {
        buf.slice_mut(r)
    }
    fn split_mut<'a>(&self, buf: &'a mut CudaSlice<f32>, ranges: &[Range<usize>]) -> Vec<CudaViewMut<'a, f32>> {
        let mut sorted: Vec<&Range<usize>> = ranges.iter().collect();
        sorted.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in sorted {
            assert!(
                r.start >= at && r.start <= r.end && r.end <= buf.len(),
                "split_mut: range {r:?} overlaps another or is out of 0..{}",
                buf.len()
            );
            at = r.end;
        }
        ranges
            .iter()
            .map(|r| {
                let v = buf.slice_mut(r.clone());
                // SAFETY: only the lifetime changes, from this iteration's reborrow of `buf` to the
                // caller's `'a` borrow of it. The ranges were checked above to be pairwise disjoint
                // and inside the buffer, so the views never alias; each refers to `buf`'s device
                // memory and its stream and events, which live as long as `buf` is borrowed ('a);
                // `buf` is not used again while they exist (it stays borrowed for 'a).
                unsafe { std::mem::transmute::<CudaViewMut<'_, f32>, CudaViewMut<'a, f32>>(v) }
            })
            .collect()
    }
    fn dup<'a>(v: &Self::View<'a>) -> Self::View<'a> {
        v.slice(..)
    }
    fn reborrow<'b>(v: &'b CudaViewMut<'_, f32>) -> CudaView<'b, f32> {
        v.as_view()
    }
    fn reborrow_mut<'b>(v: &'b mut CudaViewMut<'_, f32>) -> CudaViewMut<'b, f32> {
        v.slice_mut(..)
    }
    fn to_host<'a>(&self, v: Self::View<'a>) -> Cow<'a, [f32]> {
        Cow::Owned(ok(self.download_f32(&v)))
    }
    fn write(&self, mut dst: CudaViewMut<'_, f32>, src: &[f32]) {
        ok(self.upload_into(src, &mut dst))
    }
    fn copy(&self, mut dst: CudaViewMut<'_, f32>, src: CudaView<'_, f32>) {
        ok(Gpu::copy(self, &src, &mut dst))
    }
    fn copy_2d(
        &self,
        mut dst: CudaViewMut<'_, f32>,
        dst_pitch: usize,
        src: CudaView<'_, f32>,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) {
        ok(Gpu::copy_2d(self, &mut dst, dst_pitch, &src, src_pitch, width, height))
    }
    fn fill(&self, mut dst: CudaViewMut<'_, f32>, x: f32) {
        ok(Gpu::fill(self, &mut dst, x))
    }

    fn encoder_forward(
        &self,
        mut out: CudaViewMut<'_, f32>,
        tokens: &DeviceIds,
        wte: CudaView<'_, f32>,
        wpe: CudaView<'_, f32>,
        b: usize,
        t: usize,
        c: usize,
        v: usize,
    ) {
        let tokens = tokens.dev.slice(..b * t);
        ok(Gpu::encoder_forward(self, &mut out, &tokens, &wte, &wpe.slice(..t * c), b, t, c, v))
    }
    fn encoder_backward(
        &self,
        mut dwte: CudaViewMut<'_, f32>,
        mut dwpe: CudaViewMut<'_, f32>,
        dout: CudaView<'_, f32>,
        tokens: &DeviceIds,
        b: usize,
        t: usize,
        c: usize,
    ) {
        ok(Gpu::encoder_backward(self, &mut dwte, &mut dwpe, &dout, &tokens.host[..b * t], b, t, c))
    }
    fn layernorm_forward(
        &self,
        mut out: CudaViewMut<'_, f32>,
        mut mean: CudaViewMut<'_, f32>,
        mut rstd: CudaViewMut<'_, f32>,
        inp: CudaView<'_, f32>,
        weight: CudaView<'_, f32>,
        bias: CudaView<'_, f32>,
        n: usize,
        c: usize,
    ) {
        ok(Gpu::layernorm_forward(self, &mut out, &mut mean, &mut rstd, &inp, &weight, &bias, n, c))
    }
    fn layernorm_backward(
        &self,
        mut dinp: CudaViewMut<'_, f32>,
        mut dweight: CudaViewMut<'_, f32>,
        mut dbias: CudaViewMut<'_, f32>,
        dout: CudaView<'_, f32>,
        inp: CudaView<'_, f32>,
        weight: CudaView<'_, f32>,
        mean: CudaView<'_, f32>,
        rstd: CudaView<'_, f32>,
        n: usize,
        c: usize,
    ) {
        ok(Gpu::layernorm_backward(self, &mut dinp, &mut dweight, &mut dbias, &dout, &inp, &weight, &mean, &rstd, n, c))
    }
    fn matmul_forward(
        &self,
        mut out: CudaViewMut<'_, f32>,
        inp: CudaView<'_, f32>,
        weight: CudaView<'_, f32>,
        bias: Option<CudaView<'_, f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        ok(Gpu::matmul_forward(self, &mut out, &inp, &weight, bias.as_ref(), n, c, oc))
    }
    fn matmul_backward(
        &self,
        mut dinp: CudaViewMut<'_, f32>,
        mut dweight: CudaViewMut<'_, f32>,
        mut dbias: Option<CudaViewMut<'_, f32>>,
        dout: CudaView<'_, f32>,
        inp: CudaView<'_, f32>,
        weight: CudaView<'_, f32>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        ok(Gpu::matmul_backward(self, &mut dinp, &mut dweight, dbias.as_mut(), &dout, &inp, &weight, n, c, oc))
    }
    fn attention_forward(
        &self,
        mut out: CudaViewMut<'_, f32>,
        mut att: CudaViewMut<'_, f32>,
        inp: CudaView<'_, f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        ok(Gpu::attention_forward_rows(self, &mut out, &mut att, &inp, t, b, 0, t, c, nh))
    }
    fn attention_forward_rows(
        &self,
        mut out: CudaViewMut<'_, f32>,
        mut att: CudaViewMut<'_, f32>,
        inp: CudaView<'_, f32>,
        stride: usize,
        b: usize,
        t0: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        ok(Gpu::attention_forward_rows(self, &mut out, &mut att, &inp, stride, b, t0, t, c, nh))
    }
    fn attention_backward(
        &self,
        mut dinp: CudaViewMut<'_, f32>,
        dout: CudaView<'_, f32>,
        inp: CudaView<'_, f32>,
        att: CudaView<'_, f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        ok(Gpu::attention_backward(self, &mut dinp, &dout, &inp, &att, b, t, c, nh))
    }
    fn gelu_forward(&self, mut out: CudaViewMut<'_, f32>, inp: CudaView<'_, f32>, n: usize) {
        ok(Gpu::gelu_forward(self, &mut out, &inp, n))
    }
    fn gelu_backward(&self, mut dinp: CudaViewMut<'_, f32>, inp: CudaView<'_, f32>, dout: CudaView<'_, f32>, n: usize) {
        ok(Gpu::gelu_backward(self, &mut dinp, &inp, &dout, n))
    }
    fn residual_forward(
        &self,
        mut out: CudaViewMut<'_, f32>,
        inp1: CudaView<'_, f32>,
        inp2: CudaView<'_, f32>,
        n: usize,
    ) {
        ok(Gpu::residual_forward(self, &mut out, &inp1, &inp2, n))
    }
    fn residual_backward(
        &self,
        mut d1: CudaViewMut<'_, f32>,
        mut d2: CudaViewMut<'_, f32>,
        dout: CudaView<'_, f32>,
        n: usize,
    ) {
        ok(Gpu::residual_backward(self, &mut d1, &mut d2, &dout, n))
    }

    fn logsoftmax_gather_forward(
        &self,
        mut logp: CudaViewMut<'_, f32>,
        mut lse: CudaViewMut<'_, f32>,
        logits: CudaView<'_, f32>,
        targets: &DeviceIds,
        n: usize,
        v: usize,
    ) {
        ok(Gpu::logsoftmax_gather_forward(self, &mut logp, &mut lse, &logits, &targets.dev, n, v))
    }
    fn logsoftmax_gather_backward(
        &self,
        mut dlogits: CudaViewMut<'_, f32>,
        dlogp: CudaView<'_, f32>,
        logits: CudaView<'_, f32>,
        lse: CudaView<'_, f32>,
        targets: &DeviceIds,
        n: usize,
        v: usize,
    ) {
        ok(Gpu::logsoftmax_gather_backward(self, &mut dlogits, &dlogp, &logits, &lse, &targets.dev, n, v))
    }
    fn grpo_forward(
        &self,
        s: &GrpoScalars,
        logp: CudaView<'_, f32>,
        mask: CudaView<'_, f32>,
        adv: CudaView<'_, f32>,
        old: CudaView<'_, f32>,
        reference: CudaView<'_, f32>,
        b: usize,
        t: usize,
        saved: &mut GrpoSaved<CudaSlice<f32>>,
    ) -> GrpoStats {
        ok(Gpu::grpo_forward(self, s, &logp, &mask, &adv, &old, &reference, b, t, saved))
    }
    fn grpo_backward(
        &self,
        s: &GrpoScalars,
        mask: CudaView<'_, f32>,
        adv: CudaView<'_, f32>,
        saved: &GrpoSaved<CudaSlice<f32>>,
        denom: f32,
        b: usize,
        t: usize,
        grads: &mut GrpoGrads<CudaSlice<f32>>,
    ) {
        ok(Gpu::grpo_backward(self, s, &mask, &adv, saved, denom, b, t, grads))
    }

    fn sample(
        &self,
        out: &mut [u32],
        logits: CudaView<'_, f32>,
        b: usize,
        t: usize,
        v: usize,
        temperature: f32,
        uniforms: &[f32],
    ) {
        ok(Gpu::sample(self, out, &logits.slice(..b * t * v), b, t, v, temperature, uniforms))
    }

    fn scale(&self, mut x: CudaViewMut<'_, f32>, s: f32) {
        ok(Gpu::scale(self, &mut x, s))
    }
    fn scaled_adamw(
        &self,
        mut params: CudaViewMut<'_, f32>,
        mut grads: CudaViewMut<'_, f32>,
        s: f32,
        mut m: CudaViewMut<'_, f32>,
        mut v: CudaViewMut<'_, f32>,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        t: u64,
        consumed: &[Range<usize>],
    ) -> (u64, Vec<u64>) {
        // The consumed gradients hashed on the host (a copy), then the scale and AdamW kernels.
        let n = grads.len();
        assert!(crate::checksum::tiles(consumed, n), "scaled_adamw: pieces {consumed:?} must tile a buffer of {n}");
        let read = match consumed.is_empty() {
            true => Vec::new(),
            false => {
                let host = self.to_host(Self::reborrow(&grads));
                consumed.iter().map(|r| crate::checksum::checksum(&host[r.clone()])).collect()
            }
        };
        ok(Gpu::scale(self, &mut grads, s));
        let grads = Self::reborrow(&grads);
        let weights =
            ok(self.adamw_update(&mut params, &grads, &mut m, &mut v, lr, beta1, beta2, eps, weight_decay, t));
        (weights, read)
    }
    fn checksum(&self, x: CudaView<'_, f32>) -> u64 {
        ok(Gpu::checksum(self, &x))
    }
    fn health_scan(&self, x: CudaView<'_, f32>) -> Health {
        ok(Gpu::health_scan(self, &x))
    }
}
