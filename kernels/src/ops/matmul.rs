//! Dense layer `out = inp @ weight^T + bias` through `matrixmultiply::sgemm`, with the weight stored
//! as (OC, C) like PyTorch's `nn.Linear` and llm.c. The naive twin is `reference::matmul_forward` /
//! `reference::matmul_backward`.
//!
//! Invariants: `matrixmultiply` is built without its threading feature, so every call runs on the
//! calling thread with a fixed blocking order: results are bitwise repeatable (though not bitwise equal
//! to the naive twin, whose summation order differs). Backward accumulates (`beta = 1`).

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
    let out = &mut out[..bt * oc];
    let beta = match bias {
        Some(bias) => {
            assert!(bias.len() >= oc, "matmul_forward: short bias");
            for row in out.chunks_exact_mut(oc) {
                row.copy_from_slice(&bias[..oc]);
            }
            1.0
        }
        None => 0.0,
    };
    // SAFETY: the asserts above prove every index sgemm touches is in bounds: A = inp is (bt, c) with
    // strides (c, 1); B = weight^T is (c, oc), read from weight (oc, c) with strides (1, c); C = out is
    // (bt, oc) with strides (oc, 1). `out` is a unique borrow that aliases neither input.
    unsafe {
        matrixmultiply::sgemm(
            bt,
            c,
            oc,
            1.0,
            inp.as_ptr(),
            c as isize,
            1,
            weight.as_ptr(),
            1,
            c as isize,
            beta,
            out.as_mut_ptr(),
            oc as isize,
            1,
        );
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
    // SAFETY: bounds by the asserts above. dinp (bt, c) += dout (bt, oc) @ weight (oc, c): A strides
    // (oc, 1), B strides (c, 1), C strides (c, 1). dinp is a unique borrow aliasing no input.
    unsafe {
        matrixmultiply::sgemm(
            bt,
            oc,
            c,
            1.0,
            dout.as_ptr(),
            oc as isize,
            1,
            weight.as_ptr(),
            c as isize,
            1,
            1.0,
            dinp.as_mut_ptr(),
            c as isize,
            1,
        );
    }
    // SAFETY: bounds by the asserts above. dweight (oc, c) += dout^T (oc, bt) @ inp (bt, c): A = dout^T
    // read from dout (bt, oc) with strides (1, oc), B strides (c, 1), C strides (c, 1). dweight is a
    // unique borrow aliasing no input.
    unsafe {
        matrixmultiply::sgemm(
            oc,
            bt,
            c,
            1.0,
            dout.as_ptr(),
            1,
            oc as isize,
            inp.as_ptr(),
            c as isize,
            1,
            1.0,
            dweight.as_mut_ptr(),
            c as isize,
            1,
        );
    }
    if let Some(dbias) = dbias {
        assert!(dbias.len() >= oc, "matmul_backward: short dbias");
        for row in dout[..bt * oc].chunks_exact(oc) {
            for (db, &d) in dbias.iter_mut().zip(row) {
                *db += d;
            }
        }
    }
}
