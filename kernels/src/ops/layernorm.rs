//! Layer normalization over the last dimension C, with PyTorch's epsilon (1e-5) and biased variance.
//! Forward saves the mean and reciprocal standard deviation per row for backward.

/// PyTorch's default `nn.LayerNorm` epsilon.
pub const LN_EPS: f32 = 1e-5;

/// out: (N, C), mean: (N), rstd: (N), inp: (N, C), weight: (C), bias: (C). N = B * T.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
) {
    for i in 0..n {
        let x = &inp[i * c..(i + 1) * c];
        let m = x.iter().sum::<f32>() / c as f32;
        let var = x.iter().map(|&v| (v - m) * (v - m)).sum::<f32>() / c as f32;
        let s = 1.0 / (var + LN_EPS).sqrt();
        let o = &mut out[i * c..(i + 1) * c];
        for j in 0..c {
            o[j] = (x[j] - m) * s * weight[j] + bias[j];
        }
        mean[i] = m;
        rstd[i] = s;
    }
}

/// dinp: (N, C) +=, dweight: (C) +=, dbias: (C) +=, dout: (N, C), inp: (N, C), weight: (C),
/// mean: (N), rstd: (N).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
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
    for i in 0..n {
        let x = &inp[i * c..(i + 1) * c];
        let d = &dout[i * c..(i + 1) * c];
        let (m, s) = (mean[i], rstd[i]);
        // Two reductions: mean of dnorm and mean of dnorm * norm.
        let mut dnorm_mean = 0.0f32;
        let mut dnorm_norm_mean = 0.0f32;
        for j in 0..c {
            let norm = (x[j] - m) * s;
            let dnorm = weight[j] * d[j];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= c as f32;
        dnorm_norm_mean /= c as f32;
        let di = &mut dinp[i * c..(i + 1) * c];
        for j in 0..c {
            let norm = (x[j] - m) * s;
            let dnorm = weight[j] * d[j];
            dbias[j] += d[j];
            dweight[j] += norm * d[j];
            di[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
}
