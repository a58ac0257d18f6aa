//! The update's device ops: scaling a gradient (f32, bf16), AdamW, and the replica checksum.

use super::*;

impl Gpu {
    /// `x[i] *= s` (f32), enqueued on the stream.
    pub fn scale<D: DevicePtrMut<f32>>(&self, x: &mut D, s: f32) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let (xp, _x) = x.device_ptr_mut(&self.stream);
        // SAFETY: scale_f32(float *x, u64 n, float s), grid-stride over i < n; x holds n f32.
        launch!(self, "scale_f32", grid::elementwise(n), [&xp, &n, &s])
    }

    /// `x[i] *= s` on bf16 elements (raw 16-bit words), rounded to nearest even.
    pub fn scale_bf16<D: DevicePtrMut<u16>>(&self, x: &mut D, s: f32) -> Result<(), Error> {
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let (xp, _x) = x.device_ptr_mut(&self.stream);
        // SAFETY: scale_bf16(unsigned short *x, u64 n, float s), grid-stride over i < n; x holds n
        // 16-bit words.
        launch!(self, "scale_bf16", grid::elementwise(n), [&xp, &n, &s])
    }

    /// AdamW, the CPU `adamw_update`'s arithmetic (same bits): params, grads, m, v: (N). Returns the
    /// replica checksum of the updated params (`checksum::checksum`'s value; synchronizes).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update<P, G, M, V>(
        &self,
        params: &mut P,
        grads: &G,
        m: &mut M,
        v: &mut V,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        t: u64,
    ) -> Result<u64, Error>
    where
        P: DevicePtr<f32> + DevicePtrMut<f32>,
        G: DevicePtr<f32>,
        M: DevicePtrMut<f32>,
        V: DevicePtrMut<f32>,
    {
        let n = DeviceSlice::len(params);
        if grads.len() != n || m.len() != n || v.len() != n {
            return Err(Error::Shape {
                what: "adamw_update",
                detail: format!("params {n}, grads {}, m {}, v {}", grads.len(), m.len(), v.len()),
            });
        }
        let s = AdamwScalars::new(lr, beta1, beta2, weight_decay, t);
        if n > 0 {
            let n = n as u64;
            let (pp, _p) = params.device_ptr_mut(&self.stream);
            let (gp, _g) = grads.device_ptr(&self.stream);
            let (mp, _m) = m.device_ptr_mut(&self.stream);
            let (vp, _v) = v.device_ptr_mut(&self.stream);
            // SAFETY: adamw_update_f32(float *params, const float *grads, float *m, float *v, u64 n,
            // float x7): the four buffers hold n f32 each (checked above), grid-stride over i < n.
            launch!(
                self,
                "adamw_update_f32",
                grid::elementwise(n),
                [
                    &pp,
                    &gp,
                    &mp,
                    &vp,
                    &n,
                    &s.one_minus_beta1,
                    &beta2,
                    &s.one_minus_beta2,
                    &eps,
                    &s.decay,
                    &s.step_size,
                    &s.bc2_sqrt
                ]
            )?;
        }
        self.checksum(params)
    }

    /// The replica checksum of `x` (`checksum::checksum`'s value): the 128 lanes on the device, folded
    /// on the host by the CPU's own `checksum::fold`. Synchronizes.
    pub fn checksum<S: DevicePtr<f32>>(&self, x: &S) -> Result<u64, Error> {
        let n = x.len() as u64;
        let mut lanes = self.zeros::<u32>(grid::CHECKSUM_LANES as usize)?;
        {
            let (xp, _x) = x.device_ptr(&self.stream);
            let (lp, _l) = lanes.device_ptr_mut(&self.stream);
            // SAFETY: checksum_lanes_f32(const float *x, u64 n, unsigned *lanes): x holds n f32,
            // lanes 128 words, one block of 128 threads.
            launch!(self, "checksum_lanes_f32", grid::checksum_lanes(), [&xp, &n, &lp])?;
        }
        let lanes: [u32; crate::checksum::LANES] = self.download(&lanes)?.try_into().expect("128 lanes");
        Ok(crate::checksum::fold(&lanes, n))
    }
}
