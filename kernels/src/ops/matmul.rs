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
//! element falls in, not on the instruction set (the baseline's `mul_add` is the same IEEE fma as
//! AVX-512's, AVX2's and AVX's), and not on threads (there are none). The tests
//! `gemm_rows_are_one_fma_chain_each` (against a scalar fma loop) and `kernels/tests/simd.rs` (every
//! level this CPU runs, forced one by one) check this.
//!
//! The kernel, per level (`simd::active`): register tiles of C held through the inner loop, a row of
//! B loaded and A broadcast per step of the inner dimension, operands read in place (a panel of B
//! copied where its rows would collide in L1). AVX-512's 32 registers hold 6 x 48 tiles (18
//! accumulators); AVX2's and AVX's 16 hold 6 x 16 (12 accumulators, two rows of B, a broadcast), and a
//! product at most 48 wide is one panel of up to 2 x 48. The forward runs transposed (weight as A,
//! the few input rows transposed as B) so the weight is read once.

use crate::simd::{self, Level};

/// Block of the inner dimension (module doc: blocking does not change the chain).
const KC: usize = 128;

/// The register tiles `gemm_acc` uses at `level` (rows x columns of C), in words, for benchmarks to
/// print beside the path that ran.
pub fn gemm_tiles(level: Level) -> &'static str {
    match level {
        Level::Avx512 => "6 x 48 (18 of 32 zmm registers)",
        Level::Avx2 | Level::Avx => "6 x 16 (12 of 16 ymm registers); n <= 48: one panel, 2 x 48 .. 6 x 16",
        Level::Baseline => "4 x 16 (scalar fma calls)",
    }
}

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
    // with zeros to a whole number of vectors (`lanes`: 16 f32 on AVX-512, else 8; the padding's
    // results are dropped). fma(w, x, acc) is fma(x, w, acc): the same chain, the same bits, as
    // out = inp @ weight^T.
    let lanes = if simd::active() == Level::Avx512 { 16 } else { 8 };
    let ld = bt.div_ceil(lanes) * lanes;
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
    match simd::active() {
        // SAFETY (every arm): `simd::active` returns only levels the CPU runs, and each kernel
        // enables no more than its level's features; the asserts above prove every element the
        // kernel reads or writes is inside its slice, and `c` is a unique borrow whose rows do not
        // overlap, aliasing neither input.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { kernel_avx512(m, n, k, ops) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { kernel_avx2(m, n, k, ops) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx => unsafe { kernel_avx(m, n, k, ops) },
        // `mul_add` is correct (if slow: a libm call without FMA) on any CPU.
        _ => unsafe { kernel::<1>(m, n, k, ops) },
    }
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
    kernel::<16>(m, n, k, ops)
}

/// # Safety
/// The CPU must support AVX2 and FMA; operands as `kernel`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2(m: usize, n: usize, k: usize, ops: Operands) {
    kernel::<8>(m, n, k, ops)
}

/// # Safety
/// The CPU must support AVX and FMA; operands as `kernel`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma")]
unsafe fn kernel_avx(m: usize, n: usize, k: usize, ops: Operands) {
    kernel::<8>(m, n, k, ops)
}

/// The whole product, in blocks of the inner dimension, each cut into the column panels that suit
/// registers of `LANES` f32 (`panels_16`, `panels_8`; 1: the baseline's 4 x 16 tiles of scalar fma
/// calls).
///
/// # Safety
/// Every element of the shapes `gemm_acc` describes must be inside its allocation; C must not alias.
#[inline(always)]
unsafe fn kernel<const LANES: usize>(m: usize, n: usize, k: usize, ops: Operands) {
    // Blocks of the inner dimension, so the B rows a block reads stay in L1 across the row tiles. Each
    // tile stores its accumulators to C and the next block reloads them: the chain goes on unchanged.
    for p0 in (0..k).step_by(KC) {
        let (k, ops) = (KC.min(k - p0), ops.at(0, 0, p0));
        match LANES {
            16 => panels_16(m, n, k, ops),
            8 => panels_8(m, n, k, ops),
            _ => {
                let mut j0 = 0;
                panel::<4, 16>(m, n, k, ops, &mut j0, true);
                columns(m, n, k, ops, j0);
            }
        }
    }
}

/// Panels for 16-lane registers (AVX-512, 32 of them): 6 x 48 tiles, 18 accumulators, then one panel
/// each of 32, 16 and 8 columns, then single columns.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn panels_16(m: usize, n: usize, k: usize, ops: Operands) {
    let mut j0 = 0;
    panel::<6, 48>(m, n, k, ops, &mut j0, true);
    panel::<6, 32>(m, n, k, ops, &mut j0, false);
    panel::<6, 16>(m, n, k, ops, &mut j0, false);
    panel::<6, 8>(m, n, k, ops, &mut j0, false);
    columns(m, n, k, ops, j0);
}

/// Panels for 8-lane registers (AVX2, AVX: 16 of them): 6 x 16 tiles, 12 accumulators beside two rows
/// of B and a broadcast. A product at most 48 columns wide (the forward's few transposed input rows)
/// is one panel instead, its tile as tall as 12 accumulators allow, so that A (the weight) is read
/// once rather than once per 16 columns.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn panels_8(m: usize, n: usize, k: usize, ops: Operands) {
    let mut j0 = 0;
    match n / 8 {
        6 => panel::<2, 48>(m, n, k, ops, &mut j0, false),
        5 => panel::<2, 40>(m, n, k, ops, &mut j0, false),
        4 => panel::<3, 32>(m, n, k, ops, &mut j0, false),
        3 => panel::<4, 24>(m, n, k, ops, &mut j0, false),
        _ => panel::<6, 16>(m, n, k, ops, &mut j0, true),
    }
    panel::<6, 8>(m, n, k, ops, &mut j0, false);
    columns(m, n, k, ops, j0);
}

/// Panels of `W` columns from column `*j0`, as many as fit (`all`) or at most one, in tiles of `MR`
/// rows; `*j0` moves past them.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn panel<const MR: usize, const W: usize>(
    m: usize,
    n: usize,
    k: usize,
    ops: Operands,
    j0: &mut usize,
    all: bool,
) {
    while *j0 + W <= n {
        rows::<MR, W>(m, k, ops.at(0, *j0, 0));
        *j0 += W;
        if !all {
            break;
        }
    }
}

/// Columns `j0..n` one by one, each element its fma chain.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn columns(m: usize, n: usize, k: usize, ops: Operands, j0: usize) {
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

/// One column panel of width `W`: the row tiles of `MR` rows, then one of the rows left.
///
/// # Safety
/// As `kernel`.
#[inline(always)]
unsafe fn rows<const MR: usize, const W: usize>(m: usize, k: usize, ops: Operands) {
    const { assert!(MR >= 1 && MR <= 8, "the match below covers tiles of up to 8 rows") };
    // Several row tiles read this panel of B: copy it into a contiguous block first where that pays
    // (measured): rows of B 4 KiB apart (a 1024-wide weight or input) all fall into one L1 set, and
    // panels wider than 16 (AVX-512's) lose to set conflicts at 1 KiB strides too. An AVX2 panel of
    // 16 at shorter strides runs faster in place than the copy costs.
    let mut packed = std::mem::MaybeUninit::<[[f32; W]; KC]>::uninit();
    let ops = if m > MR && ops.rsb != W && (W > 16 || (ops.rsb * 4).is_multiple_of(4096)) {
        let dst = packed.as_mut_ptr() as *mut [f32; W];
        for p in 0..k {
            // SAFETY: row p < k <= KC of the block, written before `tile` reads it; B's row p of the
            // panel is inside B (caller).
            dst.add(p).write(*(ops.b.add(p * ops.rsb) as *const [f32; W]));
        }
        Operands { b: dst as *const f32, rsb: W, ..ops }
    } else {
        ops
    };
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
        6 => tile::<6, W>(k, rest),
        7 => tile::<7, W>(k, rest),
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
    // Each row of A has its own pointer, stepped on its own: one pointer stepped from row to row
    // would chain R + 1 dependent adds through every step of the loop (7 cycles for 6 rows, more
    // than the 6 that the 12 fmas of an AVX2 tile take).
    let mut ap: [*const f32; R] = std::array::from_fn(|i| a.wrapping_add(i * rsa));
    let mut bp = b;
    for _ in 0..k {
        let brow = *(bp as *const [f32; W]);
        for (row, p) in acc.iter_mut().zip(ap.iter_mut()) {
            let ai = **p;
            for (x, &bj) in row.iter_mut().zip(&brow) {
                *x = ai.mul_add(bj, *x);
            }
            // wrapping: after the last step these point one stride past the operands, never read.
            *p = p.wrapping_add(csa);
        }
        bp = bp.wrapping_add(rsb);
    }
    for (i, row) in acc.iter().enumerate() {
        *(c.add(i * rsc) as *mut [f32; W]) = *row;
    }
}
