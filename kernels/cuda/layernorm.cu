// Layer norm over the last dimension C (kernels/src/ops/layernorm.rs), with the CPU's operations in
// the CPU's order: each row's mean, variance and backward means are sums over the row in index
// order by ONE thread of the row's block (a tree would change the bits), then the block's threads
// write the row's elements. dweight and dbias add the rows in row order: one thread per channel.

typedef unsigned long long u64;

#define LN_EPS 1e-5f

// out: (N, C), mean: (N), rstd: (N), inp: (N, C), weight: (C), bias: (C). Block = row.
extern "C" __global__ void layernorm_forward_f32(float *__restrict__ out, float *__restrict__ mean,
                                                 float *__restrict__ rstd, const float *__restrict__ inp,
                                                 const float *__restrict__ weight, const float *__restrict__ bias,
                                                 u64 c) {
    const u64 row = blockIdx.x;
    const float *x = inp + row * c;
    __shared__ float stats[2];
    if (threadIdx.x == 0) {
        float s = -0.0f;  // Rust's f32 Sum starts at -0.0
        for (u64 j = 0; j < c; j++) s += x[j];
        const float m = s / (float)c;
        float var = -0.0f;
        for (u64 j = 0; j < c; j++) var += (x[j] - m) * (x[j] - m);
        const float r = 1.0f / sqrtf(var / (float)c + LN_EPS);
        stats[0] = m;
        stats[1] = r;
        mean[row] = m;
        rstd[row] = r;
    }
    __syncthreads();
    const float m = stats[0], r = stats[1];
    for (u64 j = threadIdx.x; j < c; j += blockDim.x) out[row * c + j] = (x[j] - m) * r * weight[j] + bias[j];
}

// dinp: (N, C) +=, dout: (N, C), inp: (N, C), weight: (C), mean: (N), rstd: (N). Block = row.
extern "C" __global__ void layernorm_backward_inp_f32(float *__restrict__ dinp, const float *__restrict__ dout,
                                                      const float *__restrict__ inp, const float *__restrict__ weight,
                                                      const float *__restrict__ mean, const float *__restrict__ rstd,
                                                      u64 c) {
    const u64 row = blockIdx.x;
    const float *x = inp + row * c, *d = dout + row * c;
    const float m = mean[row], s = rstd[row];
    __shared__ float means[2];
    if (threadIdx.x == 0) {
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (u64 j = 0; j < c; j++) {
            const float norm = (x[j] - m) * s;
            const float dnorm = weight[j] * d[j];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        means[0] = dnorm_mean / (float)c;
        means[1] = dnorm_norm_mean / (float)c;
    }
    __syncthreads();
    const float dnorm_mean = means[0], dnorm_norm_mean = means[1];
    for (u64 j = threadIdx.x; j < c; j += blockDim.x) {
        const float norm = (x[j] - m) * s;
        const float dnorm = weight[j] * d[j];
        dinp[row * c + j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
}

// dweight: (C) +=, dbias: (C) +=, over the n rows in order; one thread per channel.
extern "C" __global__ void layernorm_backward_params_f32(float *__restrict__ dweight, float *__restrict__ dbias,
                                                         const float *__restrict__ dout,
                                                         const float *__restrict__ inp,
                                                         const float *__restrict__ mean,
                                                         const float *__restrict__ rstd, u64 n, u64 c) {
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < c; j += (u64)gridDim.x * blockDim.x) {
        float dw = dweight[j], db = dbias[j];
        for (u64 i = 0; i < n; i++) {
            const float d = dout[i * c + j];
            const float norm = (inp[i * c + j] - mean[i]) * rstd[i];
            db += d;
            dw += norm * d;
        }
        dweight[j] = dw;
        dbias[j] = db;
    }
}
