//! Residual connection `out = inp1 + inp2`, elementwise over N values.

/// out: (N), inp1: (N), inp2: (N).
pub fn residual_forward(out: &mut [f32], inp1: &[f32], inp2: &[f32], n: usize) {
    for ((o, &a), &b) in out[..n].iter_mut().zip(&inp1[..n]).zip(&inp2[..n]) {
        *o = a + b;
    }
}

/// dinp1: (N) +=, dinp2: (N) +=, dout: (N).
pub fn residual_backward(dinp1: &mut [f32], dinp2: &mut [f32], dout: &[f32], n: usize) {
    for ((d1, d2), &d) in dinp1[..n].iter_mut().zip(&mut dinp2[..n]).zip(&dout[..n]) {
        *d1 += d;
        *d2 += d;
    }
}
