//! The model's ops on the device, each with its CPU twin's name and argument order: embeddings,
//! layer norm, GELU, the residual, attention, log-softmax with gather, and the dense layer's
//! products (cuBLAS SGEMM).

use super::*;

impl Gpu {
    /// out: (B, T, C) = wte[tokens] + wpe; tokens: (B, T) ids below V, wte: (V, C), wpe: (>= T, C).
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        tokens: &impl DevicePtr<u32>,
        wte: &impl DevicePtr<f32>,
        wpe: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        v: usize,
    ) -> Result<(), Error> {
        let bt = b * t;
        lengths(
            "encoder_forward",
            &[
                ("out", out.len(), bt * c),
                ("tokens", tokens.len(), bt),
                ("wte", wte.len(), v * c),
                ("wpe", wpe.len(), t * c),
            ],
        )?;
        if bt * c == 0 {
            return Ok(());
        }
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (tp, _t) = tokens.device_ptr(&self.stream);
        let (ep, _e) = wte.device_ptr(&self.stream);
        let (pp, _p) = wpe.device_ptr(&self.stream);
        let (bt, t, c, v) = (bt as u64, t as u64, c as u64, v as u64);
        // SAFETY: encoder_forward_f32(out, tokens, wte, wpe, bt, t, c, v): lengths checked above;
        // an id >= V is never used as an index (NaN written instead).
        launch!(self, "encoder_forward_f32", grid::elementwise(bt * c), [&op, &tp, &ep, &pp, &bt, &t, &c, &v])
    }

    /// dwte: (V, C) +=, dwpe: (>= T, C) +=, dout: (B, T, C); `tokens` (B, T) on the host (the
    /// positions of each token are listed there, `cuda_grid::token_rows`).
    #[allow(clippy::too_many_arguments)]
    pub fn encoder_backward(
        &self,
        dwte: &mut impl DevicePtrMut<f32>,
        dwpe: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        tokens: &[u32],
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), Error> {
        let bt = b * t;
        lengths(
            "encoder_backward",
            &[("dwpe", dwpe.len(), t * c), ("dout", dout.len(), bt * c), ("tokens", tokens.len(), bt)],
        )?;
        if bt * c == 0 {
            return Ok(());
        }
        let v = dwte.len() / c;
        if let Some(bad) = tokens[..bt].iter().find(|&&id| id as usize >= v) {
            return Err(Error::Shape {
                what: "encoder_backward",
                detail: format!("token {bad} out of vocabulary {v}"),
            });
        }
        let (rows, starts, order) = grid::token_rows(&tokens[..bt], v);
        let (rows_d, starts_d, order_d) = (self.upload(&rows)?, self.upload(&starts)?, self.upload(&order)?);
        let (ep, _e) = dwte.device_ptr_mut(&self.stream);
        let (pp, _p) = dwpe.device_ptr_mut(&self.stream);
        let (dp, _d) = dout.device_ptr(&self.stream);
        let (rp, _r) = rows_d.device_ptr(&self.stream);
        let (sp, _s) = starts_d.device_ptr(&self.stream);
        let (ordp, _q) = order_d.device_ptr(&self.stream);
        let (b, t, c) = (b as u64, t as u64, c as u64);
        let l = shape("encoder_backward", grid::per_row(rows.len() as u64, grid::ROW_THREADS))?;
        // SAFETY: encoder_backward_wte_f32(dwte, dout, rows, starts, order, c): every row id < V =
        // dwte.len() / C (checked), starts has rows + 1 entries, order every position < B T
        // (token_rows), dout (B, T, C) (checked).
        launch!(self, "encoder_backward_wte_f32", l, [&ep, &dp, &rp, &sp, &ordp, &c])?;
        // SAFETY: encoder_backward_wpe_f32(dwpe, dout, b, t, c): dwpe >= T C, dout B T C (checked).
        launch!(self, "encoder_backward_wpe_f32", grid::elementwise(t * c), [&pp, &dp, &b, &t, &c])
    }

    /// out: (N, C), mean: (N), rstd: (N), inp: (N, C), weight: (C), bias: (C).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        mean: &mut impl DevicePtrMut<f32>,
        rstd: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        bias: &impl DevicePtr<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), Error> {
        lengths(
            "layernorm_forward",
            &[
                ("out", out.len(), n * c),
                ("mean", mean.len(), n),
                ("rstd", rstd.len(), n),
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), c),
                ("bias", bias.len(), c),
            ],
        )?;
        if n * c == 0 {
            return Ok(());
        }
        let l = shape("layernorm_forward", grid::per_row(n as u64, grid::ROW_THREADS))?;
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (mp, _m) = mean.device_ptr_mut(&self.stream);
        let (rp, _r) = rstd.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (wp, _w) = weight.device_ptr(&self.stream);
        let (bp, _b) = bias.device_ptr(&self.stream);
        let c = c as u64;
        // SAFETY: layernorm_forward_f32(out, mean, rstd, inp, weight, bias, c), block r < N takes
        // row r: lengths checked above.
        launch!(self, "layernorm_forward_f32", l, [&op, &mp, &rp, &xp, &wp, &bp, &c])
    }

    /// dinp: (N, C) +=, dweight: (C) +=, dbias: (C) +=, dout: (N, C), inp: (N, C), weight: (C),
    /// mean: (N), rstd: (N).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        dweight: &mut impl DevicePtrMut<f32>,
        dbias: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        mean: &impl DevicePtr<f32>,
        rstd: &impl DevicePtr<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), Error> {
        lengths(
            "layernorm_backward",
            &[
                ("dinp", dinp.len(), n * c),
                ("dweight", dweight.len(), c),
                ("dbias", dbias.len(), c),
                ("dout", dout.len(), n * c),
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), c),
                ("mean", mean.len(), n),
                ("rstd", rstd.len(), n),
            ],
        )?;
        if n * c == 0 {
            return Ok(());
        }
        let l = shape("layernorm_backward", grid::per_row(n as u64, grid::ROW_THREADS))?;
        let (dp, _d) = dinp.device_ptr_mut(&self.stream);
        let (wgp, _wg) = dweight.device_ptr_mut(&self.stream);
        let (bgp, _bg) = dbias.device_ptr_mut(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (wp, _w) = weight.device_ptr(&self.stream);
        let (mp, _m) = mean.device_ptr(&self.stream);
        let (rp, _r) = rstd.device_ptr(&self.stream);
        let (n, c) = (n as u64, c as u64);
        // SAFETY: layernorm_backward_inp_f32(dinp, dout, inp, weight, mean, rstd, c), block r < N
        // takes row r: lengths checked above.
        launch!(self, "layernorm_backward_inp_f32", l, [&dp, &op, &xp, &wp, &mp, &rp, &c])?;
        // SAFETY: layernorm_backward_params_f32(dweight, dbias, dout, inp, mean, rstd, n, c), a
        // thread per channel j < C over the N rows: lengths checked above.
        launch!(self, "layernorm_backward_params_f32", grid::elementwise(c), [&wgp, &bgp, &op, &xp, &mp, &rp, &n, &c])
    }

    /// out: (N) = GELU(inp).
    pub fn gelu_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("gelu_forward", &[("out", out.len(), n), ("inp", inp.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: gelu_forward_f32(out, inp, n), grid-stride over i < n: lengths checked above.
        launch!(self, "gelu_forward_f32", grid::elementwise(n), [&op, &xp, &n])
    }

    /// dinp: (N) +=, inp: (N), dout: (N).
    pub fn gelu_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        dout: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("gelu_backward", &[("dinp", dinp.len(), n), ("inp", inp.len(), n), ("dout", dout.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (dp, _d) = dinp.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: gelu_backward_f32(dinp, inp, dout, n), grid-stride over i < n: lengths checked.
        launch!(self, "gelu_backward_f32", grid::elementwise(n), [&dp, &xp, &op, &n])
    }

    /// out: (N) = inp1 + inp2.
    pub fn residual_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        inp1: &impl DevicePtr<f32>,
        inp2: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("residual_forward", &[("out", out.len(), n), ("inp1", inp1.len(), n), ("inp2", inp2.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (ap, _a) = inp1.device_ptr(&self.stream);
        let (bp, _b) = inp2.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: residual_forward_f32(out, a, b, n), grid-stride over i < n: lengths checked.
        launch!(self, "residual_forward_f32", grid::elementwise(n), [&op, &ap, &bp, &n])
    }

    /// dinp1: (N) +=, dinp2: (N) +=, dout: (N).
    pub fn residual_backward(
        &self,
        dinp1: &mut impl DevicePtrMut<f32>,
        dinp2: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), Error> {
        lengths("residual_backward", &[("dinp1", dinp1.len(), n), ("dinp2", dinp2.len(), n), ("dout", dout.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let (ap, _a) = dinp1.device_ptr_mut(&self.stream);
        let (bp, _b) = dinp2.device_ptr_mut(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let n = n as u64;
        // SAFETY: residual_backward_f32(d1, d2, dout, n), grid-stride over i < n: lengths checked.
        launch!(self, "residual_backward_f32", grid::elementwise(n), [&ap, &bp, &op, &n])
    }

    /// Causal attention's query rows t0..t over positions 0..t (a KV cache passes its capacity as
    /// `stride`; the full forward is t0 = 0, stride = T). out: (B, t - t0, C),
    /// att: (B, NH, t - t0, t), inp: (B, stride, 3C).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward_rows(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        att: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        stride: usize,
        b: usize,
        t0: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), Error> {
        if !(t0 <= t && t <= stride && nh > 0 && c % nh == 0) {
            return Err(Error::Shape {
                what: "attention_forward",
                detail: format!("rows {t0}..{t} of {stride}, C {c}, NH {nh}"),
            });
        }
        let tq = t - t0;
        lengths(
            "attention_forward",
            &[
                ("out", out.len(), b * tq * c),
                ("att", att.len(), b * nh * tq * t),
                ("inp", inp.len(), b * stride * 3 * c),
            ],
        )?;
        if b * tq * c == 0 {
            return Ok(());
        }
        let l = shape("attention_forward", grid::per_row((b * nh * tq) as u64, grid::ATTENTION_THREADS))?;
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let (ap, _a) = att.device_ptr_mut(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (stride, t0, t, c, nh) = (stride as u64, t0 as u64, t as u64, c as u64, nh as u64);
        // SAFETY: attention_forward_f32(out, att, inp, stride, t0, t, c, nh), block r < B NH (t - t0)
        // takes one query row: it reads inp rows < B stride and writes att row r and out's row:
        // lengths checked above.
        launch!(self, "attention_forward_f32", l, [&op, &ap, &xp, &stride, &t0, &t, &c, &nh])
    }

    /// dinp: (B, T, 3C) +=, dout: (B, T, C), inp: (B, T, 3C), att: (B, NH, T, T).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        dout: &impl DevicePtr<f32>,
        inp: &impl DevicePtr<f32>,
        att: &impl DevicePtr<f32>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Result<(), Error> {
        if nh == 0 || c % nh != 0 {
            return Err(Error::Shape { what: "attention_backward", detail: format!("C {c}, NH {nh}") });
        }
        lengths(
            "attention_backward",
            &[
                ("dinp", dinp.len(), b * t * 3 * c),
                ("dout", dout.len(), b * t * c),
                ("inp", inp.len(), b * t * 3 * c),
                ("att", att.len(), b * nh * t * t),
            ],
        )?;
        if b * t * c == 0 {
            return Ok(());
        }
        let rows = shape("attention_backward", grid::per_row((b * nh * t) as u64, grid::ATTENTION_THREADS))?;
        let mut scratch = self.att_scratch.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(scratch.as_ref(), Some(s) if s.len() >= b * nh * t * t) {
            *scratch = Some(self.zeros::<f32>(b * nh * t * t)?);
        }
        let ds = scratch.as_mut().expect("allocated");
        let (sp, _s) = ds.device_ptr_mut(&self.stream);
        let (dp, _d) = dinp.device_ptr_mut(&self.stream);
        let (op, _o) = dout.device_ptr(&self.stream);
        let (xp, _x) = inp.device_ptr(&self.stream);
        let (ap, _a) = att.device_ptr(&self.stream);
        let (b, t, c, nh) = (b as u64, t as u64, c as u64, nh as u64);
        // SAFETY: attention_backward_scores_f32(dscore, dout, inp, att, t, c, nh), block r < B NH T
        // writes dscore row r (the scratch holds B NH T T); the reads are within the lengths checked.
        launch!(self, "attention_backward_scores_f32", rows, [&sp, &op, &xp, &ap, &t, &c, &nh])?;
        let all = grid::elementwise(b * t * c);
        // SAFETY: attention_backward_dq_f32(dinp, dscore, inp, b, t, c, nh), a thread per
        // (b, h, t1, i) < B T C: reads dscore rows and inp, writes dinp's q part (lengths checked).
        launch!(self, "attention_backward_dq_f32", all, [&dp, &sp, &xp, &b, &t, &c, &nh])?;
        // SAFETY: attention_backward_dkv_f32(dinp, dscore, dout, inp, att, b, t, c, nh), a thread per
        // (b, h, t2, i) < B T C: writes dinp's k and v parts (lengths checked).
        launch!(self, "attention_backward_dkv_f32", all, [&dp, &sp, &op, &xp, &ap, &b, &t, &c, &nh])
    }

    /// logp: (N), lse: (N), logits: (N, V), targets: (N) ids below V.
    pub fn logsoftmax_gather_forward(
        &self,
        logp: &mut impl DevicePtrMut<f32>,
        lse: &mut impl DevicePtrMut<f32>,
        logits: &impl DevicePtr<f32>,
        targets: &impl DevicePtr<u32>,
        n: usize,
        v: usize,
    ) -> Result<(), Error> {
        lengths(
            "logsoftmax_gather_forward",
            &[
                ("logp", logp.len(), n),
                ("lse", lse.len(), n),
                ("logits", logits.len(), n * v),
                ("targets", targets.len(), n),
            ],
        )?;
        if n * v == 0 {
            return Ok(());
        }
        let (pp, _p) = logp.device_ptr_mut(&self.stream);
        let (sp, _s) = lse.device_ptr_mut(&self.stream);
        let (lp, _l) = logits.device_ptr(&self.stream);
        let (tp, _t) = targets.device_ptr(&self.stream);
        let (n, v) = (n as u64, v as u64);
        // SAFETY: logsoftmax_gather_forward_f32(logp, lse, logits, targets, n, v), a thread per row
        // i < n reading logits row i only (a target >= V gives NaN, never an index): lengths checked.
        launch!(self, "logsoftmax_gather_forward_f32", grid::elementwise(n), [&pp, &sp, &lp, &tp, &n, &v])
    }

    /// dlogits: (N, V) +=, dlogp: (N), logits: (N, V), lse: (N), targets: (N).
    #[allow(clippy::too_many_arguments)]
    pub fn logsoftmax_gather_backward(
        &self,
        dlogits: &mut impl DevicePtrMut<f32>,
        dlogp: &impl DevicePtr<f32>,
        logits: &impl DevicePtr<f32>,
        lse: &impl DevicePtr<f32>,
        targets: &impl DevicePtr<u32>,
        n: usize,
        v: usize,
    ) -> Result<(), Error> {
        lengths(
            "logsoftmax_gather_backward",
            &[
                ("dlogits", dlogits.len(), n * v),
                ("dlogp", dlogp.len(), n),
                ("logits", logits.len(), n * v),
                ("lse", lse.len(), n),
                ("targets", targets.len(), n),
            ],
        )?;
        if n * v == 0 {
            return Ok(());
        }
        let (dp, _d) = dlogits.device_ptr_mut(&self.stream);
        let (gp, _g) = dlogp.device_ptr(&self.stream);
        let (lp, _l) = logits.device_ptr(&self.stream);
        let (sp, _s) = lse.device_ptr(&self.stream);
        let (tp, _t) = targets.device_ptr(&self.stream);
        let (n, v) = (n as u64, v as u64);
        // SAFETY: logsoftmax_gather_backward_f32(dlogits, dlogp, logits, lse, targets, n, v),
        // grid-stride over e < n v: lengths checked above.
        launch!(self, "logsoftmax_gather_backward_f32", grid::elementwise(n * v), [&dp, &gp, &lp, &sp, &tp, &n, &v])
    }

    /// out: (BT, OC) = inp (BT, C) @ weight (OC, C)^T + bias (OC): cuBLAS SGEMM after a bias fill.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_forward(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        bias: Option<&CudaView<'_, f32>>,
        bt: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), Error> {
        lengths(
            "matmul_forward",
            &[
                ("out", out.len(), bt * oc),
                ("inp", inp.len(), bt * c),
                ("weight", weight.len(), oc * c),
                ("bias", bias.map_or(oc, |b| b.len()), oc),
            ],
        )?;
        if bt * oc == 0 {
            return Ok(());
        }
        let beta = match bias {
            Some(bias) => {
                let (op, _o) = out.device_ptr_mut(&self.stream);
                let (bp, _b) = bias.device_ptr(&self.stream);
                let (bt, oc) = (bt as u64, oc as u64);
                // SAFETY: bias_fill_f32(out, bias, bt, oc), grid-stride over e < BT OC: lengths checked.
                launch!(self, "bias_fill_f32", grid::elementwise(bt * oc), [&op, &bp, &bt, &oc])?;
                1.0
            }
            None => 0.0,
        };
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: dim(oc)?,
            n: dim(bt)?,
            k: dim(c)?,
            alpha: 1.0f32,
            lda: dim(c)?,
            ldb: dim(c)?,
            beta,
            ldc: dim(oc)?,
        };
        // SAFETY: column-major out^T (OC x BT, ld OC) = weight^T... : A = weight (C x OC col-major,
        // ld C, transposed), B = inp (C x BT, ld C), C = out (OC x BT, ld OC); the lengths checked
        // above cover every element cuBLAS reads or writes.
        unsafe { self.blas.gemm(cfg, weight, inp, out) }.map_err(blas("cublasSgemm (matmul_forward)"))
    }

    /// Gradients of `matmul_forward`, accumulated: dinp (BT, C) +=, dweight (OC, C) +=, dbias (OC)
    /// +=, dout (BT, OC), inp (BT, C), weight (OC, C).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &self,
        dinp: &mut impl DevicePtrMut<f32>,
        dweight: &mut impl DevicePtrMut<f32>,
        dbias: Option<&mut CudaViewMut<'_, f32>>,
        dout: &impl DevicePtr<f32>,
        inp: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        bt: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), Error> {
        lengths(
            "matmul_backward",
            &[
                ("dinp", dinp.len(), bt * c),
                ("dweight", dweight.len(), oc * c),
                ("dbias", dbias.as_ref().map_or(oc, |b| b.len()), oc),
                ("dout", dout.len(), bt * oc),
                ("inp", inp.len(), bt * c),
                ("weight", weight.len(), oc * c),
            ],
        )?;
        if bt * oc * c == 0 {
            return Ok(());
        }
        let (m_c, m_bt, m_oc) = (dim(c)?, dim(bt)?, dim(oc)?);
        let op_n = cublasOperation_t::CUBLAS_OP_N;
        // dinp^T (C x BT) += weight^T (C x OC) @ dout^T (OC x BT).
        let cfg = GemmConfig {
            transa: op_n,
            transb: op_n,
            m: m_c,
            n: m_bt,
            k: m_oc,
            alpha: 1.0f32,
            lda: m_c,
            ldb: m_oc,
            beta: 1.0,
            ldc: m_c,
        };
        // SAFETY: A = weight (C x OC col-major, ld C), B = dout (OC x BT, ld OC), C = dinp (C x BT,
        // ld C): within the lengths checked above.
        unsafe { self.blas.gemm(cfg, weight, dout, dinp) }.map_err(blas("cublasSgemm (matmul_backward dinp)"))?;
        // dweight^T (C x OC) += inp^T (C x BT) @ dout (BT x OC).
        let cfg = GemmConfig {
            transa: op_n,
            transb: cublasOperation_t::CUBLAS_OP_T,
            m: m_c,
            n: m_oc,
            k: m_bt,
            alpha: 1.0f32,
            lda: m_c,
            ldb: m_oc,
            beta: 1.0,
            ldc: m_c,
        };
        // SAFETY: A = inp (C x BT col-major, ld C), B = dout (OC x BT, ld OC, transposed), C = dweight
        // (C x OC, ld C): within the lengths checked above.
        unsafe { self.blas.gemm(cfg, inp, dout, dweight) }.map_err(blas("cublasSgemm (matmul_backward dweight)"))?;
        if let Some(dbias) = dbias {
            let (bp, _b) = dbias.device_ptr_mut(&self.stream);
            let (op, _o) = dout.device_ptr(&self.stream);
            let (bt, oc) = (bt as u64, oc as u64);
            // SAFETY: bias_backward_f32(dbias, dout, bt, oc), a thread per channel o < OC over the
            // BT rows: lengths checked above.
            launch!(self, "bias_backward_f32", grid::elementwise(oc), [&bp, &op, &bt, &oc])?;
        }
        Ok(())
    }
}

/// A cuBLAS dimension (i32).
fn dim(x: usize) -> Result<i32, Error> {
    i32::try_from(x).map_err(|_| Error::Shape { what: "matmul", detail: format!("dimension {x} exceeds cuBLAS's i32") })
}
