//! The CPU backend: host `Vec`s and slices, each op the `crate::ops` function of the same name.
//!
//! Invariants: every method is a direct call of the kernel it names (or a plain copy), so the CPU
//! backend's bits are the kernels' bits; `to_host` borrows (no copy), so a probe or a checkpoint
//! reads the buffers in place.

use std::borrow::Cow;
use std::ops::Range;

use super::Backend;
use crate::health::Health;
use crate::ops::{self, GrpoGrads, GrpoSaved, GrpoScalars, GrpoStats};

/// The CPU backend (a unit: the kernels need no state).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

#[allow(clippy::too_many_arguments)]
impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Ids = Vec<u32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn zeros(&self, n: usize) -> Vec<f32> {
        vec![0.0; n]
    }
    fn upload(&self, x: &[f32]) -> Vec<f32> {
        x.to_vec()
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }
    fn ids(&self, n: usize) -> Vec<u32> {
        vec![0; n]
    }
    fn upload_ids(&self, dst: &mut Vec<u32>, src: &[u32]) {
        dst[..src.len()].copy_from_slice(src);
    }
    fn view<'a>(&self, buf: &'a Vec<f32>, r: Range<usize>) -> &'a [f32] {
        &buf[r]
    }
    fn view_mut<'a>(&self, buf: &'a mut Vec<f32>, r: Range<usize>) -> &'a mut [f32] {
        &mut buf[r]
    }
    fn split_mut<'a>(&self, buf: &'a mut Vec<f32>, ranges: &[Range<usize>]) -> Vec<&'a mut [f32]> {
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&i| ranges[i].start);
        let mut out: Vec<Option<&'a mut [f32]>> = (0..ranges.len()).map(|_| None).collect();
        let (mut rest, mut at) = (&mut buf[..], 0);
        for i in order {
            let r = ranges[i].clone();
            assert!(r.start >= at && r.start <= r.end, "split_mut: range {r:?} overlaps another or is reversed");
            let (_, tail) = rest.split_at_mut(r.start - at);
            let (this, tail) = tail.split_at_mut(r.len());
            (out[i], rest, at) = (Some(this), tail, r.end);
        }
        out.into_iter().map(|v| v.expect("every range placed")).collect()
    }
    fn dup<'a>(v: &Self::View<'a>) -> Self::View<'a> {
        v
    }
    fn reborrow<'b>(v: &'b &mut [f32]) -> &'b [f32] {
        v
    }
    fn reborrow_mut<'b>(v: &'b mut &mut [f32]) -> &'b mut [f32] {
        v
    }
    fn to_host<'a>(&self, v: Self::View<'a>) -> Cow<'a, [f32]> {
        Cow::Borrowed(v)
    }
    fn write(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
    fn copy(&self, dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
    fn copy_2d(&self, dst: &mut [f32], dst_pitch: usize, src: &[f32], src_pitch: usize, width: usize, height: usize) {
        for i in 0..height {
            dst[i * dst_pitch..][..width].copy_from_slice(&src[i * src_pitch..][..width]);
        }
    }
    fn fill(&self, dst: &mut [f32], x: f32) {
        dst.fill(x);
    }

    fn encoder_forward(
        &self,
        out: &mut [f32],
        tokens: &Vec<u32>,
        wte: &[f32],
        wpe: &[f32],
        b: usize,
        t: usize,
        c: usize,
        v: usize,
    ) {
        ops::encoder_forward(out, tokens, wte, wpe, b, t, c, v)
    }
    fn encoder_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        tokens: &Vec<u32>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        ops::encoder_backward(dwte, dwpe, dout, tokens, b, t, c)
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
        ops::layernorm_forward(out, mean, rstd, inp, weight, bias, n, c)
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
        ops::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, n, c)
    }
    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        ops::matmul_forward(out, inp, weight, bias, n, c, oc)
    }
    fn matmul_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        n: usize,
        c: usize,
        oc: usize,
    ) {
        ops::matmul_backward(dinp, dweight, dbias, dout, inp, weight, n, c, oc)
    }
    fn attention_forward(
        &self,
        out: &mut [f32],
        att: &mut [f32],
        inp: &[f32],
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) {
        ops::attention_forward(out, att, inp, b, t, c, nh)
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
        ops::attention_forward_rows(out, att, inp, stride, b, t0, t, c, nh)
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
        ops::attention_backward(dinp, dout, inp, att, b, t, c, nh)
    }
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32], n: usize) {
        ops::gelu_forward(out, inp, n)
    }
    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32], n: usize) {
        ops::gelu_backward(dinp, inp, dout, n)
    }
    fn residual_forward(&self, out: &mut [f32], inp1: &[f32], inp2: &[f32], n: usize) {
        ops::residual_forward(out, inp1, inp2, n)
    }
    fn residual_backward(&self, dinp1: &mut [f32], dinp2: &mut [f32], dout: &[f32], n: usize) {
        ops::residual_backward(dinp1, dinp2, dout, n)
    }

    fn logsoftmax_gather_forward(
        &self,
        logp: &mut [f32],
        lse: &mut [f32],
        logits: &[f32],
        targets: &Vec<u32>,
        n: usize,
        v: usize,
    ) {
        ops::logsoftmax_gather_forward(logp, lse, logits, targets, n, v)
    }
    fn logsoftmax_gather_backward(
        &self,
        dlogits: &mut [f32],
        dlogp: &[f32],
        logits: &[f32],
        lse: &[f32],
        targets: &Vec<u32>,
        n: usize,
        v: usize,
    ) {
        ops::logsoftmax_gather_backward(dlogits, dlogp, logits, lse, targets, n, v)
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
        let GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms } = saved;
        let mut saved = GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms }.map(|x| &mut x[..]);
        ops::grpo_forward(s, logp, mask, adv, old, reference, b, t, &mut saved)
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
        let GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms } = saved;
        let saved = GrpoSaved { lr1_raw, lr1, ratio, lr2_raw, lr2, e2, k3, terms }.map(|x| &x[..]);
        let GrpoGrads { d_lr1, d_lr2, dlogp } = grads;
        let mut grads = GrpoGrads { d_lr1, d_lr2, dlogp }.map(|x| &mut x[..]);
        ops::grpo_backward(s, mask, adv, &saved, denom, b, t, &mut grads)
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
        for (i, (o, &u)) in out[..b].iter_mut().zip(uniforms).enumerate() {
            *o = ops::sample(&logits[(i * t + t - 1) * v..][..v], temperature, u);
        }
    }

    fn scale(&self, x: &mut [f32], s: f32) {
        ops::scale(x, s)
    }
    fn host<'a>(&self, x: Self::View<'a>) -> Option<&'a [f32]> {
        Some(x)
    }
    fn scaled_adamw(
        &self,
        params: &mut [f32],
        grads: &mut [f32],
        s: f32,
        m: &mut [f32],
        v: &mut [f32],
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        t: u64,
        consumed: &[Range<usize>],
    ) -> (u64, Vec<u64>) {
        ops::adamw_scaled(params, grads, s, m, v, lr, beta1, beta2, eps, weight_decay, t, consumed)
    }
    fn checksum(&self, x: &[f32]) -> u64 {
        crate::checksum::checksum(x)
    }
    fn health_scan(&self, x: &[f32]) -> Health {
        crate::health::health_scan(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_mut_gives_each_range_in_the_order_asked_and_refuses_overlaps() {
        let mut buf: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let views = Cpu.split_mut(&mut buf, &[6..9, 0..2, 2..2, 3..5]);
        let got: Vec<Vec<f32>> = views.iter().map(|v| v.to_vec()).collect();
        assert_eq!(got, vec![vec![6.0, 7.0, 8.0], vec![0.0, 1.0], vec![], vec![3.0, 4.0]]);
        let overlap = std::panic::catch_unwind(|| Cpu.split_mut(&mut vec![0.0; 4], &[0..3, 2..4]).len());
        assert!(overlap.is_err());
    }

    #[test]
    fn copy_2d_moves_rows_between_pitches() {
        // Two rows of 3 from a (2, 4) source into a (2, 5) destination at column 1.
        let src: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut dst = vec![-1.0f32; 10];
        Cpu.copy_2d(&mut dst[1..], 5, &src, 4, 3, 2);
        assert_eq!(dst, vec![-1.0, 0.0, 1.0, 2.0, -1.0, -1.0, 4.0, 5.0, 6.0, -1.0]);
    }
}
