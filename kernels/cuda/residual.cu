// The residual connection (kernels/src/ops/residual.rs): out = a + b, and its backward. Elementwise,
// bitwise the CPU's.

typedef unsigned long long u64;

extern "C" __global__ void residual_forward_f32(float *__restrict__ out, const float *__restrict__ a,
                                                const float *__restrict__ b, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

// dinp1: (N) +=, dinp2: (N) +=, dout: (N).
extern "C" __global__ void residual_backward_f32(float *__restrict__ d1, float *__restrict__ d2,
                                                 const float *__restrict__ dout, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        d1[i] += dout[i];
        d2[i] += dout[i];
    }
}
