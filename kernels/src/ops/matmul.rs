//! Dense layer `out = inp @ weight^T + bias`, with the weight stored as (OC, C) like PyTorch's
//! `nn.Linear` and llm.c, on one GEMM, [`gemm_acc`], behind which the implementation is chosen in one
//! line. The naive twins are `reference::matmul_forward` / `reference::matmul_backward`.
//!
//! Invariants: every output element is ONE chain of fused multiply-adds in the order of the inner
//! dimension, `c = fma(a[i, 0], b[0, j], c); c = fma(a[i, 1], b[1, j], c); ...`, starting from the
//! bias (forward), zero, or the gradient already there (backward accumulates). Nothing else touches
//! it: no blocking of the inner dimension, no partial sums. So the bits of a row of the result depend
//! only on that row of the input and the weights - not on how many rows are computed together (a
//! KV-cached forward of one new position gives the bits of the full forward), not on the tile an
//! element falls in, not on the instruction set (the scalar path's `mul_add` is the same IEEE fma as
//! AVX-512's), and not on threads (there are none). The test `gemm_rows_are_one_fma_chain_each` checks
//! this against a scalar fma loop. The kernel: 6 x 48 tiles of C in 18 AVX-512 registers, a row of B
//! loaded and A broadcast per step of the inner dimension, every operand read in place; the forward
//! runs transposed (weight as A, the few input rows transposed as B) so the weight is read once.

/// Rows and columns of the register tile (6 x 3 AVX-512 registers of accumulators).
const MR: usize = 6;
const NR: usize = 48;
/// Block of the inner dimension (module doc: blocking does not change the chain).
const KC: usize = 128;

/// out = inp @ weight^T + bias.
/// out: (BT, OC), inp: (BT, C), weight: (OC, C), bias: (OC) or none.
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    bt: usize,
    c: usize,
    oc: usize,
) {
    assert!(out.len() >= bt * oc && inp.len() >= bt * c && weight.len() >= oc * c, "matmul_forward: short buffer");
    if let Some(bias) = bias {
        assert!(bias.len() >= oc, "matmul_forward: short bias");
    }
    // Computed transposed, out^T (OC, BT) += weight (OC, C) @ inp^T (C, BT), so that the weight is
    // read in place, once, as the broadcast operand; only inp (BT rows) is transposed, its rows padded
    // with zeros to a multiple of 16 (the padding's results are dropped). fma(w, x, acc) is
    // fma(x, w, acc): the same chain, the same bits, as out = inp @ weight^T.
    let ld = bt.div_ceil(16) * 16;
    SCRATCH.with(|scratch| {
        let (inp_t, out_t) = &mut *scratch.borrow_mut();
        grow(inp_t, c * ld);
        grow(out_t, oc * ld);
        for (p, col) in inp_t[..c * ld].chunks_exact_mut(ld).enumerate() {
            for (i, x) in col[..bt].iter_mut().enumerate() {
                *x = inp[i * c + p];
            }
            col[bt..].fill(0.0);
        }
        let out_t = &mut out_t[..oc * ld];
        match bias {
            Some(bias) => {
                for (row, &b) in out_t.chunks_exact_mut(ld).zip(bias) {
                    row.fill(b);
                }
            }
            None => out_t.fill(0.0),
        }
        gemm_acc(oc, ld, c, weight, c, 1, inp_t, ld, out_t, ld);
        // Written row by row (out's rows can be 4 KiB apart: column order would thrash the L1 sets).
        for (i, row) in out[..bt * oc].chunks_exact_mut(oc).enumerate() {
            for (o, x) in row.iter_mut().enumerate() {
                *x = out_t[o * ld + i];
            }
        }
    });
}

thread_local! {
    /// `matmul_forward`'s transposed input and output, kept between calls: allocating them per call
    /// cost page faults and zeroing at every layer (per thread: the ops are single-threaded).
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Make `v` at least `n` long.
fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// Gradients of `matmul_forward`, accumulated.
/// dinp: (BT, C), dweight: (OC, C), dbias: (OC) or none, dout: (BT, OC), inp: (BT, C), weight: (OC, C).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    bt: usize,
    c: usize,
    oc: usize,
) {
    assert!(dinp.len() >= bt * c && dweight.len() >= oc * c && dout.len() >= bt * oc, "matmul_backward: short buffer");
    assert!(inp.len() >= bt * c && weight.len() >= oc * c, "matmul_backward: short buffer");
    // dinp (BT, C) += dout (BT, OC) @ weight (OC, C).
    gemm_acc(bt, c, oc, dout, oc, 1, weight, c, dinp, c);
    // dweight (OC, C) += dout^T (OC, BT) @ inp (BT, C): A = dout^T read in place, A[o, i] = dout[i, o].
    gemm_acc(oc, c, bt, dout, 1, oc, inp, c, dweight, c);
    if let Some(dbias) = dbias {
        assert!(dbias.len() >= oc, "matmul_backward: short dbias");
        for row in dout[..bt * oc].chunks_exact(oc) {
            for (db, &d) in dbias.iter_mut().zip(row) {
                *db += d;
            }
        }
    }
}

/// The GEMM: C (m, n) += A (m, k) @ B (k, n), every element one fma chain in the order of k (module
/// doc). A's element (i, p) is `a[i * rsa + p * csa]`; B and C are row-major with row strides `rsb`
/// and `rsc` (unit column stride). Panics if a slice is too short for its shape.
#[allow(clippy::too_many_arguments)]
pub fn gemm_acc(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    rsa: usize,
    csa: usize,
    b: &[f32],
    rsb: usize,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    assert!(m == 1 || rsc >= n, "gemm: rows of C overlap (rsc {rsc} < n {n})");
    assert!((m - 1) * rsc + n <= c.len(), "gemm: C is shorter than ({m}, {n}) with row stride {rsc}");
    assert!((m - 1) * rsa + (k - 1) * csa < a.len(), "gemm: A is shorter than ({m}, {k})");
    assert!((k - 1) * rsb + n <= b.len(), "gemm: B is shorter than ({k}, {n}) with row stride {rsb}");
    let ops = Operands { a: a.as_ptr(), rsa, csa, b: b.as_ptr(), rsb, c: c.as_mut_ptr(), rsc };
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above); the asserts above prove every
            // element `kernel` reads or writes is inside its slice, and `c` is a unique borrow whose
            // rows do not overlap, aliasing neither input.
            return unsafe { kernel_avx512(m, n, k, ops) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: as above, with AVX2 and FMA.
            return unsafe { kernel_avx2(m, n, k, ops) };
        }
    }
    // SAFETY: bounds and aliasing as above; `mul_add` is correct (if slow) on any CPU.
    unsafe { kernel(m, n, k, ops) }
}

/// The operands of one product: A's element (i, p) at `a + i * rsa + p * csa`, B's (p, j) at
/// `b + p * rsb + j`, C's (i, j) at `c + i * rsc + j`.
#[derive(Clone, Copy)]
struct Operands {
    a: *const f32,
    rsa: usize,
    csa: usize,
    b: *const f32,
    rsb: usize,
    c: *mut f32,
    rsc: usize,
}

impl Operands {
    /// The operands of the sub-product that starts at row `i`, column `j`, inner index `p`.
    ///
    /// # Safety
    /// Reads and writes through the result must stay inside the allocations (the caller's shapes);
    /// the pointers themselves may point past them (a tile with no rows left is never touched).
    #[inline(always)]
    unsafe fn at(self, i: usize, j: usize, p: usize) -> Operands {
        Operands {
            // wrapping: `rows` asks for the tile at i == m (no rows left) too, which is never read.
            a: self.a.wrapping_add(i * self.rsa + p * self.csa),
            b: self.b.wrapping_add(p * self.rsb + j),
            c: self.c.wrapping_add(i * self.rsc + j),
            ..self
        }
    }
}

/// # Safety
/// The CPU must support AVX-512F and FMA; operands as `kernel`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn kernel_avx512(m: usize, n: usize, k: usize, ops: Operands) {
    kernel(m, n, k, ops)
}

/// # Safety
/// The CPU must support AVX2 and FMA; operands as `kernel`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2(m: usize, n: usize, k: usize, ops: Operands) {
    kernel(m, n, k, ops)
}

/// The whole product, in blocks of the inner dimension.
///
/// # Safety
/// Every element of the shapes `gemm_acc` describes must be inside its allocation; C must not alias.
#[inline(always)]
unsafe fn kernel(m: usize, n: usize, k: usize, ops: Operands) {
    // Blocks of the inner dimension, so the B rows a block reads stay in L1 across the row tiles. Each
    // tile stores its accumulators to C and the next block reloads them: the chain goes on unchanged.
    for p0 in (0..k).step_by(KC) {
        panels(m, n, KC.min(k - p0), ops.at(0, 0, p0));
    }
}

/// Column panels of `NR` (then 32, 16, then single columns) for one block of the inner dimension.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn panels(m: usize, n: usize, k: usize, ops: Operands) {
    let mut j0 = 0;
    while j0 + NR <= n {
        rows::<NR>(m, k, ops.at(0, j0, 0));
        j0 += NR;
    }
    if j0 + 32 <= n {
        rows::<32>(m, k, ops.at(0, j0, 0));
        j0 += 32;
    }
    if j0 + 16 <= n {
        rows::<16>(m, k, ops.at(0, j0, 0));
        j0 += 16;
    }
    let Operands { a, rsa, csa, b, rsb, c, rsc } = ops;
    for j in j0..n {
        for i in 0..m {
            let cij = c.add(i * rsc + j);
            let mut acc = *cij;
            for p in 0..k {
                acc = (*a.add(i * rsa + p * csa)).mul_add(*b.add(p * rsb + j), acc);
            }
            *cij = acc;
        }
    }
}

/// One column panel of width `W`: the row tiles.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn rows<const W: usize>(m: usize, k: usize, ops: Operands) {
    let mut i0 = 0;
    while i0 + MR <= m {
        tile::<MR, W>(k, ops.at(i0, 0, 0));
        i0 += MR;
    }
    let rest = ops.at(i0, 0, 0);
    match m - i0 {
        1 => tile::<1, W>(k, rest),
        2 => tile::<2, W>(k, rest),
        3 => tile::<3, W>(k, rest),
        4 => tile::<4, W>(k, rest),
        5 => tile::<5, W>(k, rest),
        _ => {}
    }
}

/// C (R, W) += A (R, k) @ B (k, W), the tile held in registers through the whole inner loop.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn tile<const R: usize, const W: usize>(k: usize, ops: Operands) {
    let Operands { a, rsa, csa, b, rsb, c, rsc } = ops;
    let mut acc = [[0.0f32; W]; R];
    for (i, row) in acc.iter_mut().enumerate() {
        *row = *(c.add(i * rsc) as *const [f32; W]);
    }
    let (mut ap, mut bp) = (a, b);
    for _ in 0..k {
        let brow = *(bp as *const [f32; W]);
        for (i, row) in acc.iter_mut().enumerate() {
            let ai = *ap.add(i * rsa);
            for (x, &bj) in row.iter_mut().zip(&brow) {
                *x = ai.mul_add(bj, *x);
            }
        }
        // wrapping: after the last step these point one stride past the operands, never read.
        ap = ap.wrapping_add(csa);
        bp = bp.wrapping_add(rsb);
    }
    for (i, row) in acc.iter().enumerate() {
        *(c.add(i * rsc) as *mut [f32; W]) = *row;
    }
}
