//! The GRPO loss (forward and backward) and the rollout's sampling on the device, and two buffer
//! utilities (`fill`, `copy_2d`).

use super::*;

impl Gpu {
    /// The GRPO loss's per-position forward (`ops::grpo_forward`): logp, mask, old, reference:
    /// (B, T), adv: (B); the saved values into `saved` (each >= B T). Returns the stats
    /// (synchronizes).
    #[allow(clippy::too_many_arguments)]
    pub fn grpo_forward(
        &self,
        s: &GrpoScalars,
        logp: &impl DevicePtr<f32>,
        mask: &impl DevicePtr<f32>,
        adv: &impl DevicePtr<f32>,
        old: &impl DevicePtr<f32>,
        reference: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        saved: &mut GrpoSaved<CudaSlice<f32>>,
    ) -> Result<GrpoStats, Error> {
        let n = b * t;
        let sv = &mut *saved;
        lengths(
            "grpo_forward",
            &[
                ("logp", logp.len(), n),
                ("mask", mask.len(), n),
                ("adv", adv.len(), b),
                ("old", old.len(), n),
                ("reference", reference.len(), n),
                (
                    "saved",
                    [&sv.lr1_raw, &sv.lr1, &sv.ratio, &sv.lr2_raw, &sv.lr2, &sv.e2, &sv.k3, &sv.terms]
                        .iter()
                        .map(|x| x.len())
                        .min()
                        .unwrap_or(0),
                    n,
                ),
            ],
        )?;
        let mut stats = self.zeros::<f32>(LOSS_STATS)?;
        if n > 0 {
            let (lim, lo, hi) = (if s.safe { LOGRATIO_CLAMP } else { f32::INFINITY }, 1.0 - s.clip, 1.0 + s.clip);
            let (safe, n, t) = (s.safe as i32, n as u64, t as u64);
            let (lp, _g0) = logp.device_ptr(&self.stream);
            let (mp, _g1) = mask.device_ptr(&self.stream);
            let (ap, _g2) = adv.device_ptr(&self.stream);
            let (op, _g3) = old.device_ptr(&self.stream);
            let (rp, _g4) = reference.device_ptr(&self.stream);
            let (r1, _g5) = sv.lr1_raw.device_ptr_mut(&self.stream);
            let (l1, _g6) = sv.lr1.device_ptr_mut(&self.stream);
            let (ra, _g7) = sv.ratio.device_ptr_mut(&self.stream);
            let (r2, _g8) = sv.lr2_raw.device_ptr_mut(&self.stream);
            let (l2, _g9) = sv.lr2.device_ptr_mut(&self.stream);
            let (e2, _g10) = sv.e2.device_ptr_mut(&self.stream);
            let (k3, _g11) = sv.k3.device_ptr_mut(&self.stream);
            let (tm, _g12) = sv.terms.device_ptr_mut(&self.stream);
            let (st, _g13) = stats.device_ptr_mut(&self.stream);
            // SAFETY: grpo_forward_f32(logp, mask, adv, old, reference, n, t, safe, lim, lo, hi,
            // k3_clamp, kl_coef, then the 8 saved buffers): every per-position buffer holds >= n
            // floats and adv B = n / t (checked above); grid-stride over i < n.
            launch!(
                self,
                "grpo_forward_f32",
                grid::elementwise(n),
                [
                    &lp, &mp, &ap, &op, &rp, &n, &t, &safe, &lim, &lo, &hi, &K3_CLAMP, &s.kl_coef, &r1, &l1, &ra, &r2,
                    &l2, &e2, &k3, &tm
                ]
            )?;
            // SAFETY: grpo_reduce_f32(logp, mask, adv, lr1_raw, lr2_raw, ratio, k3, n, t, safe, lo, hi,
            // k3_clamp, kl_coef, stats): one thread reads n floats of each (as above) and writes the
            // LOSS_STATS floats of `stats`.
            launch!(
                self,
                "grpo_reduce_f32",
                grid::single(),
                [&lp, &mp, &ap, &r1, &r2, &ra, &k3, &n, &t, &safe, &lo, &hi, &K3_CLAMP, &s.kl_coef, &st]
            )?;
        }
        Ok(grid::grpo_stats(&self.download(&stats)?))
    }

    /// Backward of `grpo_forward` (`ops::grpo_backward`) into `grads` (each >= B T); `denom` is the
    /// forward's `GrpoStats::denom`. Enqueued.
    #[allow(clippy::too_many_arguments)]
    pub fn grpo_backward(
        &self,
        s: &GrpoScalars,
        mask: &impl DevicePtr<f32>,
        adv: &impl DevicePtr<f32>,
        saved: &GrpoSaved<CudaSlice<f32>>,
        denom: f32,
        b: usize,
        t: usize,
        grads: &mut GrpoGrads<CudaSlice<f32>>,
    ) -> Result<(), Error> {
        let n = b * t;
        let sv = saved;
        lengths(
            "grpo_backward",
            &[
                ("mask", mask.len(), n),
                ("adv", adv.len(), b),
                (
                    "saved",
                    [&sv.lr1_raw, &sv.lr2_raw, &sv.ratio, &sv.e2, &sv.k3].iter().map(|x| x.len()).min().unwrap_or(0),
                    n,
                ),
                ("grads", grads.d_lr1.len().min(grads.d_lr2.len()).min(grads.dlogp.len()), n),
            ],
        )?;
        if n == 0 {
            return Ok(());
        }
        let (lim, lo, hi) = (if s.safe { LOGRATIO_CLAMP } else { f32::INFINITY }, 1.0 - s.clip, 1.0 + s.clip);
        let (safe, n, t) = (s.safe as i32, n as u64, t as u64);
        let (mp, _g0) = mask.device_ptr(&self.stream);
        let (ap, _g1) = adv.device_ptr(&self.stream);
        let (r1, _g2) = sv.lr1_raw.device_ptr(&self.stream);
        let (r2, _g3) = sv.lr2_raw.device_ptr(&self.stream);
        let (ra, _g4) = sv.ratio.device_ptr(&self.stream);
        let (e2, _g5) = sv.e2.device_ptr(&self.stream);
        let (k3, _g6) = sv.k3.device_ptr(&self.stream);
        let (g1, _g7) = grads.d_lr1.device_ptr_mut(&self.stream);
        let (g2, _g8) = grads.d_lr2.device_ptr_mut(&self.stream);
        let (gp, _g9) = grads.dlogp.device_ptr_mut(&self.stream);
        // SAFETY: grpo_backward_f32(mask, adv, n, t, safe, lim, lo, hi, k3_clamp, kl_coef, denom,
        // lr1_raw, lr2_raw, ratio, e2, k3, d_lr1, d_lr2, dlogp): every per-position buffer holds >= n
        // floats (checked above); grid-stride over i < n.
        launch!(
            self,
            "grpo_backward_f32",
            grid::elementwise(n),
            [
                &mp, &ap, &n, &t, &safe, &lim, &lo, &hi, &K3_CLAMP, &s.kl_coef, &denom, &r1, &r2, &ra, &e2, &k3, &g1,
                &g2, &gp
            ]
        )
    }

    /// One token per sequence (`ops::sample`) from the last position of logits (B, T, V), row `i`
    /// with the caller's uniform draw `uniforms[i]`, into host `out` (B). Synchronizes.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        out: &mut [u32],
        logits: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        v: usize,
        temperature: f32,
        uniforms: &[f32],
    ) -> Result<(), Error> {
        lengths(
            "sample",
            &[("out", out.len(), b), ("uniforms", uniforms.len(), b), ("logits", logits.len(), b * t * v)],
        )?;
        if b == 0 {
            return Ok(());
        }
        if t == 0 || v == 0 {
            return Err(Error::Shape { what: "sample", detail: format!("T {t}, V {v}") });
        }
        let u = self.upload(&uniforms[..b])?;
        let mut tokens = self.zeros::<u32>(b)?;
        {
            let (tp, _t) = tokens.device_ptr_mut(&self.stream);
            let (lp, _l) = logits.device_ptr(&self.stream);
            let (up, _u) = u.device_ptr(&self.stream);
            let (b, t, v) = (b as u64, t as u64, v as u64);
            // SAFETY: sample_f32(out, logits, b, t, v, temperature, uniforms): out and uniforms hold
            // B, logits B T V (checked); a thread per sequence reads its last row only.
            launch!(self, "sample_f32", grid::elementwise(b), [&tp, &lp, &b, &t, &v, &temperature, &up])?;
        }
        out[..b].copy_from_slice(&self.download(&tokens)?);
        Ok(())
    }

    /// Every element of `x` set to `value`. Enqueued.
    pub fn fill(&self, x: &mut impl DevicePtrMut<f32>, value: f32) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let (xp, _x) = x.device_ptr_mut(&self.stream);
        // SAFETY: fill_f32(x, n, value), grid-stride over i < n; x holds n f32.
        launch!(self, "fill_f32", grid::elementwise(n), [&xp, &n, &value])
    }

    /// `height` rows of `width` elements, row `i` of `src` at `i * src_pitch` to row `i` of `dst` at
    /// `i * dst_pitch`. Enqueued.
    pub fn copy_2d(
        &self,
        dst: &mut impl DevicePtrMut<f32>,
        dst_pitch: usize,
        src: &impl DevicePtr<f32>,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<(), Error> {
        if width * height == 0 {
            return Ok(());
        }
        let need = |pitch: usize| (height - 1) * pitch + width;
        lengths("copy_2d", &[("dst", dst.len(), need(dst_pitch)), ("src", src.len(), need(src_pitch))])?;
        let (dp, _d) = dst.device_ptr_mut(&self.stream);
        let (sp, _s) = src.device_ptr(&self.stream);
        let (dpi, spi, w, h) = (dst_pitch as u64, src_pitch as u64, width as u64, height as u64);
        // SAFETY: copy_2d_f32(dst, dst_pitch, src, src_pitch, width, height): the last row ends within
        // both buffers (checked above).
        launch!(self, "copy_2d_f32", grid::elementwise(w * h), [&dp, &dpi, &sp, &spi, &w, &h])
    }
}
